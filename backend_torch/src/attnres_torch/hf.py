"""Hugging Face `transformers` integration: a loaded PreNorm decoder (Llama, Mistral, Qwen2,
Qwen3, GPT-2, ...) converted in place to any `ResidualConfig` scheme.

    from transformers import LlamaForCausalLM
    from attnres_torch import ResidualConfig, hf

    model = LlamaForCausalLM(config)                       # or .from_pretrained(path)
    hf.convert(model, ResidualConfig(kind="block", block_size=4))
    model.save_pretrained(out)                             # config.json records the scheme
    model = hf.from_pretrained(LlamaForCausalLM, out)      # the router comes back, bitwise

How it works.  Nothing of the model's code is copied or replaced: the decoder loop is found by
structure (a `ModuleList` of layers, each with two norms and two sublayers, `norm -> sublayer`
twice, as every PreNorm decoder layer has), and each decoder layer keeps its own `__call__`, so
FSDP2's per-layer hooks, HF gradient checkpointing, forward hooks, `output_hidden_states`, the KV
cache and `generate()` keep working.  Module hooks route the residual stream through the shared
schedule (`attnres_core.schedule.ResidualStream`, the same one `DepthRouter` runs):

* layer i's forward pre-hook: layer 0 starts the stream on the embedding v_0 and hands the layer
  h_1 (spec M1: attention and MLP are one sublayer each, L = 2 x layers);
* each sublayer module's forward hook pushes its output v_l; the second norm's forward pre-hook
  replaces that norm's input (the layer's own `residual + v`) by the depth-attended h_l;
* layer i's forward hook replaces the layer's output by the next layer's input h_{2i+3} (the last
  layer: the stream's output h_{L+1}, which the model's final norm then takes).  So every
  decoder layer's output is a hidden state in PreNorm's sense, and `output_hidden_states` reports
  them.  The layer's own residual additions still run (two adds per layer) and are discarded.

Parameter ownership (`per_layer=True`, the default where the scheme allows it): decoder layer i
owns, as `layers[i].attnres.row<r>` (`DepthSite`s), the rows of the scheme's parameters that its
call reads: rows 2i + 1 and 2i + 2 (layer 0 also row 0; the last layer's row 2i + 2 is the output
row L).  So a layer's state_dict carries its AttnRes rows, and `fully_shard(layer)` gathers them
with the layer's own weights.  Schemes with parameters shared across sublayers (shared queries,
low-rank keys) keep one stacked `DepthRouter` on the base model (`model.<base>.attnres_router`);
FSDP2's root group holds it, unsharded for the whole forward.

Gradient checkpointing (`model.gradient_checkpointing_enable()`, non-reentrant): HF checkpoints
each layer's `forward` with its hooks outside; the conversion wraps the layer's checkpoint call so
that the recomputation in the backward replays the layer on a copy of the stream as it was in the
forward (no source is saved twice; the reads at layer boundaries run outside the checkpoint and
are not recomputed).  Reentrant checkpointing cannot carry gradients to the earlier sources the
depth attention reads and is refused with a ValueError.

At init (zero queries) a converted model is not the PreNorm model: Full AttnRes hands the first
norm the mean of the sources, 1/N of their sum, and a norm undoes the 1/N exactly only at eps = 0
(eps acts as N^2 eps).  The exact PreNorm model is `mix=0` (M10 progressive introduction:
`with hf.residual_inputs(model, mix=0.0): ...`), bitwise equal to the unconverted model.

One forward at a time per model instance (the stream of the running pass lives on the model).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from typing import Dict, List, Optional, Tuple, Union

import torch
from attnres_core.config import ResidualConfig
from torch import nn

from .convert import PerLayerRouter, _infer_dim, make_sites, param_dtype
from .modules import DepthRouter

__all__ = ["convert", "decoder_layers", "from_pretrained", "is_converted", "residual_inputs",
           "router", "sublayer_modules", "TESTED_FAMILIES"]

#: `config.model_type`s whose models are converted and checked in CI (tiny configs, random
#: weights); any decoder with the same layer structure converts too.
TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

#: The key under which `config.json` records the scheme.
CONFIG_KEY = "attnres"

_STATE_ATTR = "_attnres_state"
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


# -- finding the decoder --------------------------------------------------------------------------

def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def layer_layout(layer: nn.Module) -> Optional[Tuple[str, str, str, str]]:
    """(norm1, sublayer1, norm2, sublayer2) attribute names of a PreNorm decoder layer, or None.

    Structure: exactly two norm children and exactly two other children with parameters, paired
    in registration order (Llama registers self_attn, mlp, input_layernorm,
    post_attention_layernorm; GPT-2 ln_1, attn, ln_2, mlp).  The call order norm1 -> sublayer1 ->
    norm2 -> sublayer2 is checked at every forward."""
    norms, fns = [], []
    for name, child in layer.named_children():
        if name == "attnres":
            continue
        if _is_norm(child):
            norms.append(name)
        elif _has_params(child):
            fns.append(name)
    if len(norms) != 2 or len(fns) != 2:
        return None
    return norms[0], fns[0], norms[1], fns[1]


def find_decoder(model: nn.Module) -> Tuple[nn.Module, str, nn.ModuleList, Tuple[str, str, str, str]]:
    """(the module holding the layers, the ModuleList's attribute name, the layers, their layout):
    the longest `ModuleList` of one layer class whose layers all have a PreNorm layout."""
    best = None
    for owner in model.modules():
        for name, child in owner.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            kinds = {type(m) for m in child}
            if len(kinds) != 1:
                continue
            layouts = {layer_layout(m) for m in child}
            if len(layouts) != 1 or None in layouts:
                continue
            if best is None or len(child) > len(best[2]):
                best = (owner, name, child, layouts.pop())
    if best is None:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"model: no PreNorm decoder found in this {type(model).__name__} (model_type "
            f"{family!r}): expected a ModuleList of decoder layers, each with two norms and two "
            f"sublayers (norm -> attention, norm -> MLP). Tested families: "
            f"{', '.join(TESTED_FAMILIES)}; layers with extra norms (Gemma's sandwich norms), a "
            "parallel attention+MLP block (Phi, GPT-J) or cross-attention do not have this form")
    return best


# -- the per-forward state and the hooks ------------------------------------------------------------

class _State:
    """What the hooks share: the router, the running pass's stream, a checkpoint replay's
    stream, the call-order cursor, and the M10 per-call inputs."""

    def __init__(self, router: DepthRouter, base: nn.Module, num_layers: int):
        self.router, self.base, self.num_layers = router, base, num_layers
        self.mix: Optional[float] = None
        self.scale: Optional[float] = None
        self.stream = None
        self.replay = None
        self.cursor: Optional[Tuple[int, int]] = None  # (layer, step) of the running pass

    def __getstate__(self):  # torch.save / deepcopy: no pass in flight is carried
        state = dict(self.__dict__)
        state.update(stream=None, replay=None, cursor=None)
        return state

    def begin(self, embedding: torch.Tensor) -> None:
        router = self.router
        router.train(self.base.training)  # the schedule follows the model's mode (two-phase in eval)
        self.stream = router.stream(embedding, mix=self.mix, scale=self.scale)
        self.cursor = (0, 0)

    def step(self, layer: int, step: int, what: str):
        """The stream a hook of (layer, step) works on; checks the call order of a live pass.
        Steps: 0 layer entered, 1 sublayer 1 pushed, 2 norm 2 fed, 3 sublayer 2 pushed."""
        if self.replay is not None:
            return self.replay
        if self.stream is None or self.cursor != (layer, step - 1):
            raise RuntimeError(
                f"attnres_torch.hf: {what} of decoder layer {layer} ran out of order (expected "
                f"norm -> sublayer -> norm -> sublayer inside each layer, layers 0..n-1 in order; "
                f"the pass was at {self.cursor}). The layer is not a sequential PreNorm layer, or "
                "a sublayer module was called outside its layer")
        self.cursor = (layer, step)
        return self.stream


def _first_tensor(value):
    return value[0] if isinstance(value, (tuple, list)) else value


class _LayerEnter:
    """Forward pre-hook (with kwargs) of decoder layer i: layer 0 starts the pass and hands the
    layer h_1; every layer checks the order and prepares the checkpoint replay."""

    def __init__(self, state: _State, index: int):
        self.state, self.index = state, index

    def __call__(self, module, args, kwargs):
        state, i = self.state, self.index
        if i == 0:
            if args:
                embedding = args[0]
            elif "hidden_states" in kwargs:
                embedding = kwargs["hidden_states"]
            else:
                raise RuntimeError("attnres_torch.hf: decoder layer 0 was called without hidden "
                                   "states (positional or hidden_states=)")
            state.begin(embedding)
            h = state.stream.input()
            if args:
                args = (h,) + tuple(args[1:])
            else:
                kwargs = dict(kwargs, hidden_states=h)
        elif state.stream is None or state.cursor != (i - 1, 4):
            raise RuntimeError(f"attnres_torch.hf: decoder layer {i} ran before layer {i - 1} "
                               f"finished (the pass was at {state.cursor}); the layers must run "
                               "in order, once per forward")
        state.cursor = (i, 0)
        func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and func is not None \
                and not isinstance(func, _ReplayingCheckpoint):
            module._gradient_checkpointing_func = _ReplayingCheckpoint(func, state)
        return args, kwargs


class _LayerExit:
    """Forward hook of decoder layer i: the layer's output becomes the next layer's input
    (the last layer's: the stream's output h_{L+1})."""

    def __init__(self, state: _State, index: int):
        self.state, self.index = state, index

    def __call__(self, module, args, output):
        state, i = self.state, self.index
        if state.stream is None or state.cursor != (i, 3):
            raise RuntimeError(f"attnres_torch.hf: decoder layer {i} returned before both its "
                               f"sublayers ran (the pass was at {state.cursor})")
        stream = state.stream
        last = i == state.num_layers - 1
        h = stream.output() if last else stream.input()
        state.cursor = (i, 4)
        if last:
            state.stream, state.cursor = None, None
        if isinstance(output, tuple):
            return (h,) + output[1:]
        return h


class _SublayerExit:
    """Forward hook of sublayer j (1 or 2) of decoder layer i: push its output v_l."""

    def __init__(self, state: _State, index: int, which: int):
        self.state, self.index, self.which = state, index, which

    def __call__(self, module, args, output):
        step = 1 if self.which == 1 else 3
        stream = self.state.step(self.index, step, f"sublayer {self.which}")
        stream.push(_first_tensor(output))


class _Norm2Enter:
    """Forward pre-hook of decoder layer i's second norm: its input is h_l, not `residual + v`."""

    def __init__(self, state: _State, index: int):
        self.state, self.index = state, index

    def __call__(self, module, args):
        stream = self.state.step(self.index, 2, "the second norm")
        if not args:
            raise RuntimeError("attnres_torch.hf: the second norm was called without a positional "
                               "input")
        return (stream.input(),) + tuple(args[1:])


class _Replay:
    """The recompute context of one layer's checkpoint: the hooks run on a copy of the stream as
    it was when the layer ran in the forward; the copy is dropped afterwards."""

    def __init__(self, state: _State, snapshot):
        self.state, self.snapshot = state, snapshot

    def __enter__(self):
        self.saved = self.state.replay
        self.state.replay = copy.copy(self.snapshot)
        return self

    def __exit__(self, *exc):
        self.state.replay = self.saved
        return False


class _ReplayingCheckpoint:
    """Wraps a layer's `_gradient_checkpointing_func` (HF: `partial(checkpoint, **kwargs)`) so
    that its recomputation replays the layer on the stream of its own forward."""

    def __init__(self, inner, state: _State):
        keywords = getattr(inner, "keywords", {}) or {}
        if keywords.get("use_reentrant", False):
            raise ValueError("gradient_checkpointing_kwargs: use_reentrant=True cannot carry "
                             "gradients to the earlier layers' outputs that AttnRes reads; use "
                             "gradient_checkpointing_enable() (non-reentrant, HF's default)")
        self.inner, self.state = inner, state

    def __call__(self, function, *args, **kwargs):
        snapshot = copy.copy(self.state.stream)
        user = kwargs.pop("context_fn", None) or (getattr(self.inner, "keywords", {}) or {}).get("context_fn")

        def context_fn():
            fwd, rec = user() if user is not None else (contextlib.nullcontext(), contextlib.nullcontext())
            replay = _Replay(self.state, snapshot)

            @contextlib.contextmanager
            def recompute_ctx():
                with replay, rec:
                    yield

            return fwd, recompute_ctx()

        return self.inner(function, *args, context_fn=context_fn, **kwargs)


# -- conversion -----------------------------------------------------------------------------------

def _rows_of_layer(i: int, per_layer: int = 2) -> List[int]:
    """The parameter rows decoder layer i's call reads (M4 rows: sublayer l is row l - 1)."""
    rows = list(range(i * per_layer + 1, (i + 1) * per_layer + 1))
    return ([0] + rows) if i == 0 else rows


def _state(model: nn.Module) -> Optional[_State]:
    return model.__dict__.get(_STATE_ATTR)


def is_converted(model: nn.Module) -> bool:
    """Whether `convert` was applied to `model`."""
    return _state(model) is not None


def router(model: nn.Module) -> DepthRouter:
    """The router of a converted model (a `PerLayerRouter` over the layers' sites, or the
    stacked `DepthRouter`); set `.observer` on it for `DepthMonitor`-style observation."""
    state = _state(model)
    if state is None:
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    return state.router


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The decoder layers of a converted model, in order."""
    state = _state(model)
    if state is None:
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    return list(state.layers)


def sublayer_modules(model: nn.Module) -> List[nn.Module]:
    """The 2 x layers sublayer modules (attention, MLP, ...) of a converted model, in order."""
    state = _state(model)
    if state is None:
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    return list(state.sublayers)


def convert(model: nn.Module, config: ResidualConfig, *, per_layer: Optional[bool] = None,
            dtype: Union[None, str, torch.dtype] = None, schedule: Optional[str] = None) -> nn.Module:
    """Convert a Hugging Face PreNorm decoder model to `config`'s residual scheme, in place.

    Args:
      model: a `PreTrainedModel` (`LlamaForCausalLM`, `Qwen3Model`, `GPT2LMHeadModel`, ...) or
        any module holding such a decoder.
      config: the residual scheme (`ResidualConfig(kind="block", block_size=4)`, ...); not
        `fuse_out_norm` (the layers keep their own norms).
      per_layer: each decoder layer owns the rows it reads (`layers[i].attnres`); False: one
        stacked `DepthRouter` on the base model.  None: per layer unless the scheme shares
        parameters across sublayers (shared queries, low-rank keys).
      dtype: the AttnRes parameters' dtype: a torch dtype, "model" (the layers' parameter dtype)
        or None (float32).
      schedule: "direct", "two_phase" or None (two-phase in eval mode where the scheme allows).

    Returns the model (converted in place; `config.json` of `save_pretrained` records the
    scheme under "attnres").
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    if is_converted(model):
        raise ValueError("model: already converted (attnres_torch.hf.convert was applied before)")
    if config.fuse_out_norm:
        raise ValueError("config: fuse_out_norm=True moves each sublayer's pre-norm gain into the "
                         "scheme (M15), but a converted model keeps its layers' own norms")
    if schedule is not None:
        config.check_schedule(schedule)
    shared = config.query_sharing != "none" or config.key_rank is not None
    if per_layer is None:
        per_layer = not shared
    elif per_layer and shared:
        raise ValueError(f"per_layer: the scheme shares parameters across sublayers "
                         f"(query_sharing={config.query_sharing!r}, key_rank={config.key_rank}); "
                         "use per_layer=False (one stacked router on the base model)")
    owner, list_name, layers, layout = find_decoder(model)
    norm1, fn1, norm2, fn2 = layout
    dim = _infer_dim(layers[0], [(norm1, fn1)])
    n = len(layers)
    L = 2 * n
    dtype = param_dtype(layers, dtype)
    for layer in layers:
        if hasattr(layer, "attnres"):
            raise ValueError(f"model: a {type(layer).__name__} already has an 'attnres' attribute")
    if per_layer:
        sites = make_sites(config, L, dim, dtype)
        for i, layer in enumerate(layers):
            layer.add_module("attnres", nn.ModuleDict(
                {f"row{r}": sites[r] for r in _rows_of_layer(i)}))
        rt = PerLayerRouter(config, L, dim, schedule, sites=sites)
    else:
        rt = DepthRouter(config, L, dim, schedule=schedule).to(dtype)
        owner.add_module("attnres_router", rt)
    state = _State(rt, owner, n)
    state.layers = list(layers)
    state.sublayers = [m for layer in layers for m in (getattr(layer, fn1), getattr(layer, fn2))]
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(_LayerEnter(state, i), with_kwargs=True)
        layer.register_forward_hook(_LayerExit(state, i), prepend=True)  # before FSDP2's reshard
        getattr(layer, fn1).register_forward_hook(_SublayerExit(state, i, 1))
        getattr(layer, norm2).register_forward_pre_hook(_Norm2Enter(state, i))
        getattr(layer, fn2).register_forward_hook(_SublayerExit(state, i, 2))
    object.__setattr__(model, _STATE_ATTR, state)
    if owner is not model:
        object.__setattr__(owner, _STATE_ATTR, state)
    hf_config = getattr(model, "config", None)
    if hf_config is not None:
        setattr(hf_config, CONFIG_KEY, {
            "config": config.to_dict(), "per_layer": bool(per_layer), "schedule": schedule,
            "dtype": str(dtype).replace("torch.", ""), "layers": f"{_path(model, owner)}{list_name}",
            "layout": list(layout)})
    return model


def _path(model: nn.Module, owner: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is owner:
            return f"{name}." if name else ""
    return ""


@contextlib.contextmanager
def residual_inputs(model: nn.Module, *, mix: Optional[float] = None, scale: Optional[float] = None):
    """The M10 per-call inputs for the forwards inside the block: `mix` (progressive
    introduction: alpha in [0, 1]; 0 is exactly the PreNorm model) and `scale` (a temperature
    schedule's logit scale; None keeps config.scale)."""
    state = _state(model)
    if state is None:
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    saved = state.mix, state.scale
    state.mix, state.scale = mix, scale
    try:
        yield
    finally:
        state.mix, state.scale = saved


# -- save / load ----------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def _checkpoint_tensors(path: str, keys_like: str) -> Dict[str, torch.Tensor]:
    """The tensors of a local `save_pretrained` directory whose names contain `keys_like`."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    out: Dict[str, torch.Tensor] = {}
    if os.path.isfile(index) or os.path.isfile(single):
        from safetensors import safe_open

        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        for name in files:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    if keys_like in key:
                        out[key] = f.get_tensor(key)
        return out
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        sd = torch.load(binary, map_location="cpu", weights_only=True)
        return {k: v for k, v in sd.items() if keys_like in k}
    raise ValueError(f"path: {path!r} holds no model.safetensors(.index.json) or pytorch_model.bin")


@contextlib.contextmanager
def _quiet_unexpected(cls, pattern: str):
    """HF warns about checkpoint keys its class has no place for; ours are loaded right after."""
    saved = cls.__dict__.get("_keys_to_ignore_on_load_unexpected", None)
    inherited = getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []
    cls._keys_to_ignore_on_load_unexpected = list(inherited) + [pattern]
    try:
        yield
    finally:
        if saved is None:
            del cls._keys_to_ignore_on_load_unexpected
        else:
            cls._keys_to_ignore_on_load_unexpected = saved


def from_pretrained(model_class, path: str, **kwargs) -> nn.Module:
    """`model_class.from_pretrained(path, **kwargs)` for a directory that `save_pretrained` wrote
    from a converted model: the base weights load as usual, then the model is converted with the
    scheme recorded in config.json and its AttnRes rows are loaded (every one must be there).

    A plain `model_class.from_pretrained(path)` builds the PreNorm model and drops the rows (HF
    reports them as unexpected keys)."""
    if not os.path.isdir(path):
        raise ValueError(f"path: expected a local directory written by save_pretrained, got {path!r}")
    with open(os.path.join(path, "config.json")) as f:
        record = json.load(f).get(CONFIG_KEY)
    if record is None:
        raise ValueError(f"path: {path}/config.json has no {CONFIG_KEY!r} entry (not saved from a "
                         "converted model); load it and call attnres_torch.hf.convert")
    with _quiet_unexpected(model_class, r"attnres"):
        model = model_class.from_pretrained(path, **kwargs)
    convert(model, ResidualConfig.from_dict(record["config"]), per_layer=record["per_layer"],
            dtype=_DTYPES[record["dtype"]], schedule=record.get("schedule"))
    wanted = {k for k in model.state_dict() if "attnres" in k}
    found = _checkpoint_tensors(path, "attnres")
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"path: the checkpoint lacks {len(missing)} AttnRes tensors, e.g. {missing[:3]}")
    model.load_state_dict({k: found[k] for k in wanted}, strict=False)
    return model
