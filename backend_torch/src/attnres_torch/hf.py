"""Hugging Face `transformers` integration: a loaded decoder (Llama, Mistral, Qwen2/3, GPT-2,
Granite, OLMo2, Gemma2/3, ... see docs/hf-families.md) converted in place to any
`ResidualConfig` scheme.  The user's contract (what converts and what is refused, the probe
verification and `verify=`, saving and loading with `"model_type": "attnres"` and the Auto
classes, PEFT's `modules_to_save`, the rows each layer owns, gradient checkpointing, `mix=0` as
the exact PreNorm model, one forward at a time per model) is docs/hf-fsdp-autocast.md.

    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from attnres_torch import ResidualConfig, hf

    model = LlamaForCausalLM(config)                       # or .from_pretrained(path)
    hf.convert(model, ResidualConfig(kind="block", block_size=4))   # checked on a probe batch
    model.save_pretrained(out)                             # config.json: model_type "attnres"
    model = hf.from_pretrained(LlamaForCausalLM, out)      # the router comes back, bitwise
    model = AutoModelForCausalLM.from_pretrained(out)      # the same model (needs this import)

How it works.  Nothing of the model's code is copied or replaced: the decoder loop is found by
structure and each decoder layer keeps its own `__call__` (FSDP2's per-layer hooks, HF gradient
checkpointing, forward hooks, `output_hidden_states`, the KV cache and `generate()` keep
working).  A probe forward reads each layer's form: two sublayer chains, the layer computing
`x + m * chain_j(x)` for each; the value pushed to the stream is `m * chain_j(.)`.  Module hooks
then route the residual stream through the shared schedule (`attnres_core.schedule`, as
`DepthRouter` does):

* layer i's forward pre-hook: layer 0 starts the stream on the embedding v_0 and hands the layer
  h_1 (spec M1: attention and MLP are one sublayer each, L = 2 x layers);
* the last module of each chain has a forward hook that pushes `m * output` as v_l; the first
  module of the second chain has a forward pre-hook that replaces its input (the layer's own
  `residual + ...`) by the depth-attended h_l;
* layer i's forward hook replaces the layer's output by the next layer's input h_{2i+3} (the last
  layer: the stream's output h_{L+1}, which the model's final norm then takes), so every layer's
  output is a hidden state in PreNorm's sense.  The layer's own residual additions still run and
  are discarded.

torch.compile.  Dynamo does not guard on module hooks, so a graph compiled for an unconverted
model of the same class could be reused for a converted one (computing PreNorm).  Each
converted layer therefore carries its class's `forward` as an instance attribute, which dynamo
guards on: a graph traced without the conversion never matches a converted model.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.abc
import importlib.util
import json
import os
import sys
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from attnres_core.checkpoint import AUTO_MODEL_TYPE, CONFIG_KEY, GUARD_FIELDS, guard, unguard
from attnres_core.config import ResidualConfig
from torch import nn

from .convert import DepthSite, PerLayerRouter, make_sites, norm_dim, param_dtype
from .modules import DepthRouter

__all__ = ["convert", "decoder_layers", "find_decoder", "from_pretrained", "is_converted",
           "layer_form", "peft_modules_to_save", "residual_inputs", "router", "sublayer_modules",
           "FrozenRowsWarning", "TESTED_FAMILIES", "AUTO_MODEL_TYPE"]

#: `config.model_type`s whose models are converted and checked in depth in CI (tiny configs,
#: random weights); docs/hf-families.md lists every family the support walk converts or refuses.
TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

# CONFIG_KEY: the key under which `config.json` records the scheme; AUTO_MODEL_TYPE: the
# `model_type` that `save_pretrained` writes for a converted model (registered with the
# transformers Auto classes when this module is imported); the guard: `attnres_core.checkpoint`.

_STATE_ATTR = "_attnres_state"
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)
#: Layer attributes that scale a sublayer's output before the residual add (Granite's
#: residual_multiplier, MiniCPM3's residual_scale = scale_depth / sqrt(layers)).
_MULTIPLIER_ATTRS = ("residual_multiplier", "residual_scale")
#: Layer / config flags of a parallel attention + MLP block.
_PARALLEL_FLAGS = ("use_parallel_residual", "parallel_attn", "parallel_block")
_PROBE_TOKENS = 5


# -- finding the decoder --------------------------------------------------------------------------

def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _children(layer: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, c) for n, c in layer.named_children() if n != "attnres"]


def _looks_like_layer(layer: nn.Module) -> bool:
    kids = _children(layer)
    return (any(_is_norm(c) for _, c in kids)
            and sum(1 for _, c in kids if not _is_norm(c) and _has_params(c)) >= 2)


def _layer_list(container: nn.Module) -> List[nn.Module]:
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    return list(container)


def find_decoder(model: nn.Module) -> Tuple[nn.Module, str, List[nn.Module]]:
    """(the module holding the layers, the container's attribute name, the layers in order): the
    longest `ModuleList` / `ModuleDict` (torchtitan) / `Sequential` of one layer class whose
    layers have a norm and at least two sublayer modules.  Raises ValueError if there is none."""
    best = None
    for owner in model.modules():
        for name, child in owner.named_children():
            if not isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or len(child) == 0:
                continue
            layers = _layer_list(child)
            if len({type(m) for m in layers}) != 1 or not all(_looks_like_layer(m) for m in layers):
                continue
            if best is None or len(layers) > len(best[2]):
                best = (owner, name, layers)
    if best is None:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"model: no decoder layer stack found in this {type(model).__name__} (model_type "
            f"{family!r}): expected a ModuleList, ModuleDict or Sequential of layers of one class, "
            "each with a norm and at least two sublayer modules (attention, MLP); see "
            "docs/hf-families.md for the families that convert")
    return best


# -- the layer's form -------------------------------------------------------------------------------
#
# A form is a tuple of two sublayers; a sublayer is (chain, fn, multiplier): the child names the
# layer calls in a chain (each reading the previous one's output), the sublayer module among
# them, and the layer attribute that scales the chain's output before the residual add (or None).

Form = Tuple[Tuple[Tuple[str, ...], str, Optional[str]], ...]


def describe_form(form: Form) -> str:
    """'input_layernorm -> self_attn; post_attention_layernorm -> mlp' (x residual_multiplier)."""
    parts = []
    for chain, _, mult in form:
        text = " -> ".join(chain)
        parts.append(f"{text} (x {mult})" if mult else text)
    return "; ".join(parts)


def _form_name(form: Form, layer: nn.Module) -> str:
    kinds = []
    for chain, fn, _ in form:
        i = chain.index(fn)
        pre = any(_is_norm(getattr(layer, c)) for c in chain[:i])
        post = any(_is_norm(getattr(layer, c)) for c in chain[i + 1:])
        kinds.append("sandwich norms" if pre and post else "branch-output norm" if post
                     else "PreNorm" if pre else "no norm")
    name = kinds[0] if len(set(kinds)) == 1 else " / ".join(kinds)
    if any(m for _, _, m in form):
        name += " with residual multiplier"
    return name


class _Refusal(ValueError):
    pass


def _multiplier_attr(layer: nn.Module) -> Optional[str]:
    for attr in _MULTIPLIER_ATTRS:
        value = getattr(layer, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return attr
    return None


def _static_form(layer: nn.Module) -> Form:
    """The form read from the children in registration order (verify=False)."""
    kids = _children(layer)
    norms = [n for n, c in kids if _is_norm(c)]
    fns = [n for n, c in kids if not _is_norm(c) and _has_params(c)]
    cls = type(layer).__name__
    config = getattr(layer, "config", None)
    for flag in _PARALLEL_FLAGS:
        if getattr(layer, flag, False) is True or getattr(config, flag, False) is True:
            raise _Refusal(f"{cls}: {flag}=True (attention and MLP in parallel on one input)")
    if len(fns) != 2:
        raise _Refusal(f"{cls}: {len(fns)} sublayer modules ({', '.join(fns)}), expected two")
    mult = _multiplier_attr(layer)
    if len(norms) == 2 and all("post" in n for n in norms):
        return ((fns[0], norms[0]), fns[0], mult), ((fns[1], norms[1]), fns[1], mult)
    if len(norms) == 2:
        return ((norms[0], fns[0]), fns[0], mult), ((norms[1], fns[1]), fns[1], mult)
    if len(norms) == 4:
        return ((norms[0], fns[0], norms[1]), fns[0], mult), ((norms[2], fns[1], norms[3]), fns[1], mult)
    raise _Refusal(f"{cls}: {len(norms)} norms ({', '.join(norms)}) beside two sublayer modules; "
                   "without a probe forward only 2 (pre or branch-output norms) or 4 (sandwich) "
                   "are read")


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _input_of(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    for v in kwargs.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    return None


def _same(a, b) -> bool:
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                      and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


class _LayerTrace:
    """One decoder layer's calls in a probe forward: its input, output and each child call
    (name, input, output) in order."""

    def __init__(self):
        self.input = self.output = None
        self.calls: List[Tuple[str, Any, Any]] = []


def _traced_form(layer: nn.Module, trace: _LayerTrace) -> Form:
    cls = type(layer).__name__
    calls = trace.calls
    if trace.input is None or trace.output is None:
        raise _Refusal(f"{cls}: the layer was not called by the probe forward")
    names = [c[0] for c in calls]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _Refusal(f"{cls}: child modules called more than once per layer ({', '.join(twice)}); "
                       f"calls: {' , '.join(names)}")
    # chains: consecutive calls, each reading the previous call's output
    chains: List[List[Tuple[str, Any, Any]]] = []
    for call in calls:
        if chains and _same(call[1], chains[-1][-1][2]):
            chains[-1].append(call)
        else:
            chains.append([call])
    found = "; ".join(" -> ".join(c[0] for c in chain) for chain in chains)
    subs = []
    for chain in chains:
        fns = [c[0] for c in chain if not _is_norm(getattr(layer, c[0])) and _has_params(getattr(layer, c[0]))]
        if len(fns) > 1:
            raise _Refusal(f"{cls}: {', '.join(fns)} are called one on the other's output with "
                           f"no residual add between them (one sublayer split over several "
                           f"child modules, or two sublayers chained); one sublayer module per "
                           f"chain is supported (calls: {found})")
        if fns:
            subs.append((chain, fns[0]))
        elif any(_has_params(getattr(layer, c[0])) for c in chain):
            raise _Refusal(f"{cls}: {' -> '.join(c[0] for c in chain)} is not part of a sublayer "
                           f"(calls: {found})")
    if len(subs) != 2:
        raise _Refusal(f"{cls}: {len(subs)} sublayers ({', '.join(f for _, f in subs)}), expected "
                       f"two (calls: {found})")
    (c1, f1), (c2, f2) = subs
    x, y = trace.input, trace.output
    in1, v1, in2, v2 = c1[0][1], c1[-1][2], c2[0][1], c2[-1][2]
    if not all(isinstance(t, torch.Tensor) for t in (in1, v1, in2, v2)):
        raise _Refusal(f"{cls}: a sublayer chain does not take or return a tensor (calls: {found})")
    for f, v in ((f1, v1), (f2, v2)):
        if v.numel() != x.numel():  # a broadcast add (a bias, a batch-1 probe) is no residual add
            raise _Refusal(f"{cls}: {f}'s output has shape {tuple(v.shape)}, the layer's input "
                           f"{tuple(x.shape)} (calls: {found})")
    # a sublayer may return its tokens flattened (Llama4's MoE: [B*T, D]); the family adds
    # `v.view(residual.shape)`, and so does the stream (_SublayerExit reshapes alike)
    v1, v2 = v1.reshape(x.shape), v2.reshape(x.shape)
    if not _same(in1, x):
        raise _Refusal(f"{cls}: the first sublayer ({f1}) does not read the layer's input "
                       f"(calls: {found})")
    if _same(in2, x) or any(_same(in2, c[2]) for c in c1[:-1]):
        raise _Refusal(f"{cls}: attention and MLP in parallel ({f2} reads the layer's input or "
                       f"{f1}'s norm output, not residual + {f1}'s output; calls: {found})")
    mult = None
    # the layer's multiplier attribute first: at m = 1.0 both read alike (x * 1.0 is exact), and
    # the form then matches the one read without a probe (verify=False)
    candidates = [a for a in _MULTIPLIER_ATTRS if _multiplier_attr(layer) == a] + [None]
    for attr in candidates:
        m = None if attr is None else getattr(layer, attr)
        want2 = x + v1 if m is None else x + v1 * m
        want_y = in2 + v2 if m is None else in2 + v2 * m
        if _same(in2, want2) and _same(y, want_y):
            mult = attr
            break
    else:
        d2 = _maxdiff(in2, x + v1)
        dy = _maxdiff(y, in2 + v2)
        raise _Refusal(f"{cls}: the residual update is not x + m * sublayer(x) twice (m = 1 or a "
                       f"residual multiplier attribute): the second sublayer's input differs from "
                       f"x + v1 by {d2:.3g}, the layer output from that + v2 by {dy:.3g} "
                       f"(calls: {found})")
    return (tuple(c[0] for c in c1), f1, mult), (tuple(c[0] for c in c2), f2, mult)


def layer_form(model: nn.Module) -> str:
    """The form a converted model's layers were converted with, e.g. 'PreNorm:
    input_layernorm -> self_attn; post_attention_layernorm -> mlp'."""
    state = _state(model)
    if state is None:
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    return f"{_form_name(state.form, state.layers[0])}: {describe_form(state.form)}"


# -- the per-forward state and the hooks ------------------------------------------------------------

def _active_module(module: nn.Module) -> nn.Module:
    """`module`, or what a PEFT `ModulesToSaveWrapper` around it runs now: the active adapter's
    trainable copy, or the original while adapters are disabled (PEFT's own forward rule)."""
    copies = module._modules.get("modules_to_save")
    if copies is None or "original_module" not in module._modules:
        return module
    active = list(getattr(module, "active_adapters", None) or [])
    adapters = getattr(module, "_adapters", None)
    if getattr(module, "disable_adapters", False) or not active or (
            adapters is not None and any(a not in adapters for a in active)):
        return module._modules["original_module"]
    if len(active) != 1 or active[0] not in copies:
        raise ValueError(f"attnres_torch.hf: a modules_to_save wrapper around an AttnRes module has "
                         f"{len(active)} active adapters ({active}); activate one adapter")
    return copies[active[0]]


class _HFSiteRouter(PerLayerRouter):
    """The per-layer router of a converted model: its sites are read through the layers'
    `attnres` dicts at every pass (a PEFT `modules_to_save` wrapper put there is honoured)."""

    def bind(self, layers: Sequence[nn.Module]) -> "_HFSiteRouter":
        where = [None] * (self.num_layers + 1)
        for i, layer in enumerate(layers):
            for r in _rows_of_layer(i):
                where[r] = (layer, f"row{r}")
        self._where = where
        return self

    def site_list(self) -> List[DepthSite]:
        where = self.__dict__.get("_where")
        if where is None:  # PerLayerRouter.__init__ checks the sites before bind
            return super().site_list()
        out = []
        for layer, key in where:
            site = _active_module(layer._modules["attnres"]._modules[key])
            if not isinstance(site, DepthSite):
                raise TypeError(f"attnres_torch.hf: {type(layer).__name__}.attnres.{key} is a "
                                f"{type(site).__name__}, expected a DepthSite")
            out.append(site)
        return out


class FrozenRowsWarning(UserWarning):
    """A converted model trains (other parameters require gradients) while all its AttnRes rows
    are frozen, e.g. after PEFT's `get_peft_model` without `modules_to_save`: depth attention
    then learns nothing.  Warned once per model; to freeze the rows on purpose, filter it:
    `warnings.filterwarnings("ignore", category=hf.FrozenRowsWarning)`."""


def _check_rows_train(state: "_State") -> None:
    """At a training forward with gradients on: warn (once) when every AttnRes row is frozen
    while other parameters train (the rows read are the active ones: PEFT's trainable copies
    under `modules_to_save`)."""
    if getattr(state, "rows_warned", False) or not state.base.training or not torch.is_grad_enabled():
        return
    if torch.compiler.is_compiling():
        return
    router = state.router
    sites = router.site_list() if isinstance(router, PerLayerRouter) else [router]
    rows = [p for site in sites for p in site.parameters()]
    if not rows or any(p.requires_grad for p in rows):
        return
    if not any(p.requires_grad for p in state.base.parameters()):
        return
    state.rows_warned = True
    warnings.warn(
        "attnres_torch.hf: this converted model trains, but all its AttnRes rows are frozen "
        "(requires_grad=False), so depth attention learns nothing. PEFT's get_peft_model "
        "freezes every module not in modules_to_save: pass LoraConfig(..., modules_to_save="
        "hf.peft_modules_to_save(model)) (the rows then train, are saved in the adapter file "
        "and restored by PeftModel.from_pretrained). To freeze them on purpose, filter "
        "attnres_torch.hf.FrozenRowsWarning.", FrozenRowsWarning, stacklevel=3)


class _State:
    """What the hooks share: the router, the running pass's stream, a checkpoint replay's
    stream, the call-order cursor, and the M10 per-call inputs."""

    def __init__(self, router: DepthRouter, base: nn.Module, num_layers: int):
        self._router, self.base, self.num_layers = router, base, num_layers
        self.mix: Optional[float] = None
        self.scale: Optional[float] = None
        self.stream = None
        self.replay = None
        self.cursor: Optional[Tuple[int, int]] = None  # (layer, step) of the running pass
        self.handles: List[Any] = []
        self.rows_warned = False
        self.marked: List[nn.Module] = []  # layers given an instance `forward` (compile guard)

    @property
    def router(self) -> DepthRouter:
        if isinstance(self._router, DepthRouter):
            return self._router
        router = _active_module(self.base._modules["attnres_router"])  # stacked: owned by the base
        if not isinstance(router, DepthRouter):
            raise TypeError(f"attnres_torch.hf: attnres_router is a {type(router).__name__}")
        return router

    def __getstate__(self):  # torch.save / deepcopy: no pass in flight is carried
        state = dict(self.__dict__)
        state.update(stream=None, replay=None, cursor=None, handles=[])
        return state

    def begin(self, embedding: torch.Tensor) -> None:
        _check_rows_train(self)
        router = self.router
        router.train(self.base.training)  # the schedule follows the model's mode (two-phase in eval)
        self.stream = router.stream(embedding, mix=self.mix, scale=self.scale)
        self.cursor = (0, 0)

    def step(self, layer: int, step: int, what: str):
        """The stream a hook of (layer, step) works on; checks the call order of a live pass.
        Steps: 0 layer entered, 1 sublayer 1 pushed, 2 sublayer 2 fed, 3 sublayer 2 pushed."""
        if self.replay is not None:
            return self.replay
        if self.stream is None or self.cursor != (layer, step - 1):
            raise RuntimeError(
                f"attnres_torch.hf: {what} of decoder layer {layer} ran out of order (expected "
                f"the layer's form {describe_form(self.form)} inside each layer, layers 0..n-1 in "
                f"order; the pass was at {self.cursor}). The layer took another path than in the "
                "probe forward of convert, or a sublayer module was called outside its layer")
        self.cursor = (layer, step)
        return self.stream


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
    """Forward hook of the last module of sublayer j (1 or 2) of decoder layer i: push its output
    v_l, times the layer's residual multiplier where the family has one."""

    def __init__(self, state: _State, index: int, which: int, layer: nn.Module,
                 multiplier: Optional[str]):
        self.state, self.index, self.which = state, index, which
        self.multiplier = multiplier
        self.layer = layer if multiplier else None

    def __call__(self, module, args, output):
        step = 1 if self.which == 1 else 3
        stream = self.state.step(self.index, step, f"sublayer {self.which}")
        v = _first_tensor(output)
        like = getattr(stream, "_embedding", None)
        if isinstance(like, torch.Tensor) and v.shape != like.shape:
            if v.numel() != like.numel():
                raise RuntimeError(f"attnres_torch.hf: sublayer {self.which} of decoder layer "
                                   f"{self.index} returned shape {tuple(v.shape)}, the residual "
                                   f"stream's is {tuple(like.shape)}")
            v = v.reshape(like.shape)  # flattened tokens (Llama4's MoE), as the family's view
        if self.multiplier:
            v = v * getattr(self.layer, self.multiplier)
        stream.push(v)


class _SublayerEnter:
    """Forward pre-hook of the first module of decoder layer i's second sublayer: its input is
    h_l, not the layer's own `residual + v`."""

    def __init__(self, state: _State, index: int):
        self.state, self.index = state, index

    def __call__(self, module, args, kwargs):
        stream = self.state.step(self.index, 2, "the second sublayer's input")
        if args and isinstance(args[0], torch.Tensor):
            return (stream.input(),) + tuple(args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, dict(kwargs, hidden_states=stream.input())
        raise RuntimeError("attnres_torch.hf: the second sublayer's first module was called "
                           "without a positional or hidden_states= input")


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


def peft_modules_to_save(model: nn.Module) -> List[str]:
    """The full module names of a converted model's AttnRes parameters, for PEFT's
    `LoraConfig(modules_to_save=...)`: the per-layer sites (`...layers.3.attnres.row7`), or the
    stacked `...attnres_router`.  PEFT then trains them, saves them in the adapter file and
    `PeftModel.from_pretrained` restores them; the conversion reads the active adapter's copy."""
    state = _state(model)
    if state is None:
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    wanted = {id(layer.attnres._modules[k]) for layer in state.layers if "attnres" in layer._modules
              for k in layer.attnres._modules}
    router_module = state.base._modules.get("attnres_router")
    if router_module is not None:
        wanted.add(id(router_module))
    return [name for name, m in model.named_modules() if id(m) in wanted]


def _probe_value(out) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    value = _first_tensor(out)
    if value is None and isinstance(out, dict):
        value = next((v for v in out.values() if isinstance(v, torch.Tensor)), None)
    if value is None:
        raise ValueError(f"verify: the probe forward returned {type(out).__name__}, with no "
                         "logits, last_hidden_state or tensor to compare")
    return value


def _probe_call(model: nn.Module, verify):
    """A callable running the probe batch through `model`."""
    if isinstance(verify, dict):
        kwargs = dict(verify)
        return lambda: model(**kwargs)
    if verify is not True:
        raise TypeError(f"verify: expected True, False or a dict of the model's keyword "
                        f"arguments, got {verify!r}")
    for p in model.parameters():
        if p.is_meta:
            raise ValueError("verify: the model's parameters are on the meta device, so convert "
                             "cannot run its probe forward; load the weights first, or pass "
                             "verify=False (the form is then read from the layers' children)")
    emb = None
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        pass
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError("verify: no nn.Embedding found to build a probe batch of token ids; pass "
                         "verify={...} (the model's keyword arguments for a small batch) or "
                         "verify=False")
    ids = ((torch.arange(_PROBE_TOKENS) * 7 + 3) % emb.num_embeddings).unsqueeze(0)
    ids = ids.to(emb.weight.device)
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        return lambda: model(input_ids=ids, use_cache=False)
    return lambda: model(ids)


@contextlib.contextmanager
def _probe_mode(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def _trace(model: nn.Module, layers: Sequence[nn.Module], run) -> Tuple[List[_LayerTrace], torch.Tensor]:
    traces = [_LayerTrace() for _ in layers]
    handles = []

    def on_layer_in(t):
        def hook(mod, args, kwargs):
            if t.input is None:
                t.input = _input_of(args, kwargs)
        return hook

    def on_layer_out(t):
        def hook(mod, args, out):
            if t.output is None:
                t.output = _first_tensor(out)
        return hook

    def on_child(t, name):
        def pre(mod, args, kwargs):
            t.calls.append([name, _input_of(args, kwargs), None])

        def post(mod, args, out):
            for call in reversed(t.calls):
                if call[0] == name and call[2] is None:
                    call[2] = _first_tensor(out)
                    break
        return pre, post

    try:
        for layer, t in zip(layers, traces):
            handles.append(layer.register_forward_pre_hook(on_layer_in(t), with_kwargs=True))
            handles.append(layer.register_forward_hook(on_layer_out(t)))
            for name, child in _children(layer):
                pre, post = on_child(t, name)
                handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(child.register_forward_hook(post))
        with _probe_mode(model):
            reference = _probe_value(run())
    finally:
        for h in handles:
            h.remove()
    for t in traces:
        t.calls = [tuple(c) for c in t.calls]
    return traces, reference


def _find_forms(model, layers, verify) -> Tuple[Form, Optional[Any], Optional[torch.Tensor]]:
    """The layers' form (one for all layers), the probe call and the unconverted output."""
    if verify is False:
        forms = [_static_form(layer) for layer in layers]
        run = reference = None
    else:
        run = _probe_call(model, verify)
        traces, reference = _trace(model, layers, run)
        forms = [_traced_form(layer, t) for layer, t in zip(layers, traces)]
    for i, form in enumerate(forms):
        if form != forms[0]:
            raise _Refusal(f"{type(layers[i]).__name__}: layer {i} has the form {describe_form(form)}, "
                           f"layer 0 {describe_form(forms[0])}; one form for all layers is supported")
    return forms[0], run, reference


def _undo(model: nn.Module, state: _State, layers, owner, saved_config) -> None:
    for h in state.handles:
        h.remove()
    for layer in state.marked:
        layer.__dict__.pop("forward", None)
    for layer in layers:
        if "attnres" in layer._modules:
            del layer._modules["attnres"]
    owner._modules.pop("attnres_router", None)
    model.__dict__.pop(_STATE_ATTR, None)
    owner.__dict__.pop(_STATE_ATTR, None)
    hf_config = getattr(model, "config", None)
    if hf_config is not None and saved_config is not None:
        cls, had, value = saved_config
        if had:
            setattr(hf_config, CONFIG_KEY, value)
        elif CONFIG_KEY in hf_config.__dict__:
            delattr(hf_config, CONFIG_KEY)
        hf_config.__class__ = cls


def convert(model: nn.Module, config: ResidualConfig, *, per_layer: Optional[bool] = None,
            dtype: Union[None, str, torch.dtype] = None, schedule: Optional[str] = None,
            verify: Union[bool, Dict[str, Any]] = True) -> nn.Module:
    """Convert a Hugging Face decoder model to `config`'s residual scheme, in place.

    Args:
      model: a `PreTrainedModel` (`LlamaForCausalLM`, `Qwen3Model`, `GPT2LMHeadModel`,
        `Gemma2ForCausalLM`, ...) or any module holding such a decoder (a torchtitan-style
        `ModuleDict` of layers too).
      config: the residual scheme (`ResidualConfig(kind="block", block_size=4)`, ...); not
        `fuse_out_norm` (the layers keep their own norms).
      per_layer: each decoder layer owns the rows it reads (`layers[i].attnres`); False: one
        stacked `DepthRouter` on the base model.  None: per layer unless the scheme shares
        parameters across sublayers (shared queries, low-rank keys).
      dtype: the AttnRes parameters' dtype: a torch dtype, "model" (the layers' parameter dtype)
        or None (float32).
      schedule: "direct", "two_phase" or None (two-phase in eval mode where the scheme allows).
      verify: True (default): read the layers' form from a probe forward of 5 tokens and, before
        returning, check that the converted model at `mix=0` reproduces the unconverted output
        bitwise; otherwise undo the conversion and raise ValueError (layer class, form,
        difference).  A dict: the probe's keyword arguments (models that take no `input_ids`).
        False: no forward at all (models on the meta device, or too large for a probe); the
        form is read from the layers' children in registration order, unchecked; use it only
        for families that docs/hf-families.md lists as "same" without a probe.

    Returns the model (converted in place; `save_pretrained` writes `"model_type": "attnres"`
    and records the scheme and the form under "attnres").
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    if not (isinstance(verify, (bool, dict))):
        raise TypeError(f"verify: expected True, False or a dict of the model's keyword "
                        f"arguments, got {type(verify).__name__}")
    return _convert(model, config, per_layer=per_layer, dtype=dtype, schedule=schedule,
                    verify=verify, form=None)


def _convert(model, config, *, per_layer, dtype, schedule, verify, form) -> nn.Module:
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
    owner, list_name, layers = find_decoder(model)
    for layer in layers:
        if "attnres" in layer._modules or hasattr(layer, "attnres"):
            raise ValueError(f"model: a {type(layer).__name__} already has an 'attnres' attribute")
    run = reference = None
    try:
        if form is None:
            form, run, reference = _find_forms(model, layers, verify)
        for chain, _, mult in form:
            for name in chain:
                if not isinstance(getattr(layers[0], name, None), nn.Module):
                    raise _Refusal(f"{type(layers[0]).__name__}: no child module {name!r}")
    except _Refusal as e:
        raise ValueError(f"model: cannot convert this {type(model).__name__}'s decoder layers: {e}. "
                         "Supported forms: per sublayer [pre norm ->] sublayer [-> post norm], "
                         "added to the residual (optionally times residual_multiplier), twice per "
                         "layer; see docs/hf-families.md") from None
    (chain1, fn1, mult), (chain2, fn2, _) = form
    dim = _infer_dim(model, layers[0], form)
    n = len(layers)
    L = 2 * n
    dtype = param_dtype(layers, dtype)
    hf_config = getattr(model, "config", None)
    saved_config = None
    if hf_config is not None and hasattr(hf_config, "to_dict"):
        saved_config = (type(hf_config), CONFIG_KEY in getattr(hf_config, "__dict__", {}),
                        getattr(hf_config, CONFIG_KEY, None))
    if per_layer:
        sites = make_sites(config, L, dim, dtype)
        for i, layer in enumerate(layers):
            layer.add_module("attnres", nn.ModuleDict(
                {f"row{r}": sites[r] for r in _rows_of_layer(i)}))
        rt = _HFSiteRouter(config, L, dim, schedule, sites=sites).bind(layers)
    else:
        rt = None
        owner.add_module("attnres_router", DepthRouter(config, L, dim, schedule=schedule).to(dtype))
    state = _State(rt, owner, n)
    state.layers = list(layers)
    state.form = form
    state.sublayers = [m for layer in layers for m in (getattr(layer, fn1), getattr(layer, fn2))]
    try:
        for i, layer in enumerate(layers):
            hs = state.handles
            hs.append(layer.register_forward_pre_hook(_LayerEnter(state, i), with_kwargs=True))
            hs.append(layer.register_forward_hook(_LayerExit(state, i), prepend=True))  # before FSDP2's reshard
            hs.append(getattr(layer, chain1[-1]).register_forward_hook(
                _SublayerExit(state, i, 1, layer, mult)))
            hs.append(getattr(layer, chain2[0]).register_forward_pre_hook(
                _SublayerEnter(state, i), with_kwargs=True))
            hs.append(getattr(layer, chain2[-1]).register_forward_hook(
                _SublayerExit(state, i, 2, layer, mult)))
        # torch.compile: dynamo does not guard on module hooks (skip_nnmodule_hook_guards), so a
        # graph compiled for an unconverted model of the same class would be reused and compute
        # PreNorm.  It does guard that "forward" is not in each called module's __dict__: a
        # converted layer carries its class's forward as an instance attribute (the same
        # function), so no graph traced without the conversion matches it.
        for layer in layers:
            if "forward" not in layer.__dict__:
                layer.__dict__["forward"] = types.MethodType(type(layer).forward, layer)
                state.marked.append(layer)
        object.__setattr__(model, _STATE_ATTR, state)
        if owner is not model:
            object.__setattr__(owner, _STATE_ATTR, state)
        if saved_config is not None:
            record = {"config": config.to_dict(), "per_layer": bool(per_layer), "schedule": schedule,
                      "dtype": str(dtype).replace("torch.", ""),
                      "layers": f"{_path(model, owner)}{list_name}",
                      "form": [[list(c), f, m] for c, f, m in form]}
            base_type = getattr(type(hf_config), "model_type", None)
            if base_type:
                record["base_model_type"] = getattr(type(hf_config), "_attnres_base_type", base_type)
            setattr(hf_config, CONFIG_KEY, record)
            if _is_transformers_config(hf_config) and base_type:
                hf_config.__class__ = _config_class(type(hf_config))
        if run is not None:
            with _probe_mode(model), residual_inputs(model, mix=0.0):
                try:
                    got = _probe_value(run())
                except RuntimeError as e:  # our hooks: the layers took another path
                    if not str(e).startswith("attnres_torch.hf:"):
                        raise
                    raise _Refusal(f"{type(layers[0]).__name__} ({_form_name(form, layers[0])}: "
                                   f"{describe_form(form)}): the converted model's probe "
                                   f"forward failed: {e}") from None
            if not torch.equal(got, reference):
                raise _Refusal(f"{type(layers[0]).__name__} ({_form_name(form, layers[0])}: "
                               f"{describe_form(form)}): at mix=0 the converted model's output "
                               f"differs from the unconverted model's by "
                               f"{_maxdiff(got, reference):.3g} (max abs) on the probe batch")
    except BaseException as e:
        _undo(model, state, layers, owner, saved_config)
        if isinstance(e, _Refusal):
            raise ValueError(f"model: the conversion is not exact and was undone: {e}. Report the "
                             "family; see docs/hf-families.md") from None
        raise
    return model


def _infer_dim(model: nn.Module, layer: nn.Module, form: Form) -> int:
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    for chain, _, _ in form:
        for name in chain:
            norm = getattr(layer, name)
            dim = norm_dim(norm) if _is_norm(norm) else None
            if dim is not None:
                return dim
    if isinstance(hidden, int):
        return hidden
    raise ValueError("model: cannot infer the hidden size D from the layers' norms or config")


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


def _checkpoint_keys(path: str) -> List[str]:
    """The tensor names of a local `save_pretrained` directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return list(f.keys())
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        return list(torch.load(binary, map_location="cpu", weights_only=True))
    raise ValueError(f"path: {path!r} holds no model.safetensors(.index.json) or pytorch_model.bin")


def _is_transformers_config(config) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedConfig"
               for c in type(config).__mro__)


_DYNAMIC: Dict[Tuple[str, type], type] = {}
_PREFIX = "AttnRes_"


def _config_class(base: type) -> type:
    """`AttnRes_<Config>`: the family's config class whose `to_dict` writes
    `model_type: "attnres"` while the record is set (behaviour otherwise unchanged)."""
    if getattr(base, "_attnres_base_type", None) is not None:
        return base
    key = ("config", base)
    if key not in _DYNAMIC:
        def to_dict(self):
            out = base.to_dict(self)
            if isinstance(out.get(CONFIG_KEY), dict):
                out["model_type"] = AUTO_MODEL_TYPE
            return out

        def to_json_file(self, json_file_path, use_diff: bool = True):
            """config.json with the guard (`attnres_core.checkpoint`): the family's own class
            refuses the directory instead of loading it as the PreNorm model.  Only the file:
            `to_dict` (which generation configs read) keeps the real `use_cache`."""
            data = json.loads(self.to_json_string(use_diff=use_diff))
            if isinstance(data.get(CONFIG_KEY), dict):
                declared = getattr(base, "__dataclass_fields__", {})
                field = next((f for f in GUARD_FIELDS if f in declared), GUARD_FIELDS[0])
                data = guard(data, field, getattr(self, field, None))
            with open(json_file_path, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")

        @classmethod
        def from_dict(cls, config_dict, **kwargs):
            return base.from_dict.__func__(cls, unguard(config_dict), **kwargs)

        _DYNAMIC[key] = type(f"{_PREFIX}{base.__name__}", (base,), {
            "to_dict": to_dict, "to_json_file": to_json_file, "from_dict": from_dict,
            "__module__": __name__, "_attnres_base_type": base.model_type,
            "__doc__": f"{base.__name__} of a model converted by attnres_torch.hf."})
    return _DYNAMIC[key]


def _model_class(base: type) -> type:
    """`AttnRes_<Model>`: the family's model class converting itself in `__init__` with the
    record of its config (the scheme and the form), so the checkpoint's rows load as its own
    parameters."""
    if getattr(base, "_attnres_converted_class", False):
        return base
    key = ("model", base)
    if key not in _DYNAMIC:
        def __init__(self, config, *args, **kwargs):
            base.__init__(self, config, *args, **kwargs)
            record = getattr(config, CONFIG_KEY, None)
            if record is None:
                raise ValueError(f"config: {type(self).__name__} needs a config with an "
                                 f"{CONFIG_KEY!r} record (saved from a converted model)")
            _convert_from_record(self, record)

        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            wants_info = kwargs.get("output_loading_info", False)
            kwargs["output_loading_info"] = True
            model, info = base.from_pretrained.__func__(cls, *args, **kwargs)
            missing = sorted(k for k in info.get("missing_keys", ()) if "attnres" in k)
            if missing:
                raise ValueError(f"the checkpoint lacks {len(missing)} AttnRes tensors, e.g. "
                                 f"{missing[:3]} (its config records a converted model, its weights "
                                 "are a PreNorm model's)")
            return (model, info) if wants_info else model

        _DYNAMIC[key] = type(f"{_PREFIX}{base.__name__}", (base,), {
            "__init__": __init__, "from_pretrained": from_pretrained, "__module__": __name__,
            "config_class": _config_class(base.config_class), "_attnres_converted_class": True,
            "__doc__": f"{base.__name__} converted by attnres_torch.hf (built by the Auto classes "
                       "or hf.from_pretrained from a converted checkpoint)."})
    return _DYNAMIC[key]


def __getattr__(name: str):
    """Pickling: `AttnRes_<Class>` resolves to the dynamic subclass of transformers' <Class>."""
    if name.startswith(_PREFIX):
        import transformers

        base = getattr(transformers, name[len(_PREFIX):], None)
        if isinstance(base, type):
            from transformers import PreTrainedConfig

            return _config_class(base) if issubclass(base, PreTrainedConfig) else _model_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _convert_from_record(model: nn.Module, record: Dict[str, Any]) -> nn.Module:
    form = record.get("form")
    if form is None:
        raise ValueError(f"config: the {CONFIG_KEY!r} record has no 'form' (saved by an older "
                         "attnres_torch); load with hf.from_pretrained")
    form = tuple((tuple(c), f, m) for c, f, m in form)
    return _convert(model, ResidualConfig.from_dict(record["config"]), per_layer=record["per_layer"],
                    dtype=_DTYPES[record["dtype"]], schedule=record.get("schedule"),
                    verify=False, form=form)


#: The Auto classes a converted checkpoint loads with (the base config's entry of each).
_AUTO_MAPPINGS = ("MODEL_MAPPING", "MODEL_FOR_CAUSAL_LM_MAPPING",
                  "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
                  "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING", "MODEL_FOR_QUESTION_ANSWERING_MAPPING")


def _register_models(config_class: type) -> None:
    from transformers.models.auto import modeling_auto

    base = config_class.__mro__[1]
    for name in _AUTO_MAPPINGS:
        mapping = getattr(modeling_auto, name)
        if config_class in mapping._extra_content or base not in mapping:
            continue
        value = mapping[base]
        value = tuple(_model_class(v) for v in value) if isinstance(value, (tuple, list)) \
            else _model_class(value)
        mapping.register(config_class, value, exist_ok=True)


def _auto_config_class() -> type:
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class AttnResConfig(PreTrainedConfig):
        """The `model_type: "attnres"` entry: builds the base family's config (the record's
        "model_type") as `AttnRes_<Config>` and registers its Auto model classes."""

        model_type = AUTO_MODEL_TYPE

        @classmethod
        def from_dict(cls, config_dict, **kwargs):
            record = config_dict.get(CONFIG_KEY)
            base_type = record.get("base_model_type") if isinstance(record, dict) else None
            if base_type is None or base_type == AUTO_MODEL_TYPE:
                raise ValueError(f"config: model_type {AUTO_MODEL_TYPE!r} without the base "
                                 f"model_type in its {CONFIG_KEY!r} record")
            dynamic = _config_class(CONFIG_MAPPING[base_type])
            _register_models(dynamic)
            return dynamic.from_dict(dict(config_dict, model_type=base_type), **kwargs)

    AttnResConfig.__module__ = __name__
    return AttnResConfig


_AUTO_REGISTERED = False


def _register_auto() -> None:
    """Register model_type "attnres" with `AutoConfig` (once)."""
    global _AUTO_REGISTERED
    if _AUTO_REGISTERED:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    CONFIG_MAPPING.register(AUTO_MODEL_TYPE, _auto_config_class(), exist_ok=True)
    _AUTO_REGISTERED = True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers model_type "attnres" as soon as transformers' AutoConfig module is imported, so
    `import attnres_torch.hf` neither imports transformers nor depends on the import order."""

    TARGET = "transformers.models.auto.configuration_auto"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.TARGET:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        inner = spec.loader.exec_module

        def exec_module(module):
            inner(module)
            _register_auto()

        spec.loader.exec_module = exec_module
        return spec


if _RegisterOnImport.TARGET in sys.modules:
    _register_auto()
elif importlib.util.find_spec("transformers") is not None:
    sys.meta_path.insert(0, _RegisterOnImport())


def from_pretrained(model_class, path: str, **kwargs) -> nn.Module:
    """`model_class.from_pretrained(path, **kwargs)` for a directory that `save_pretrained` wrote
    from a converted model: the model is built converted (the scheme and the form recorded in
    config.json) and loads its AttnRes rows with the base weights (every one must be there).
    Equal, bitwise, to `AutoModelForCausalLM.from_pretrained(path)` (and the other registered
    Auto classes).  The class-specific `LlamaForCausalLM.from_pretrained(path)` refuses the
    directory (the guard of `attnres_core.checkpoint`: a config.json field says what it is)."""
    if not os.path.isdir(path):
        raise ValueError(f"path: expected a local directory written by save_pretrained, got {path!r}")
    with open(os.path.join(path, "config.json")) as f:
        record = json.load(f).get(CONFIG_KEY)
    if record is None:
        raise ValueError(f"path: {path}/config.json has no {CONFIG_KEY!r} entry (not saved from a "
                         "converted model); load it and call attnres_torch.hf.convert")
    from transformers import AutoConfig

    _register_auto()
    config = kwargs.pop("config", None)
    if config is None:
        config, kwargs = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **kwargs)
    if getattr(type(config), "_attnres_base_type", None) is None:  # saved before model_type "attnres"
        config.__class__ = _config_class(type(config))
    if "form" not in getattr(config, CONFIG_KEY):
        return _from_pretrained_legacy(model_class, path, config, **kwargs)
    return _model_class(model_class).from_pretrained(path, config=config, **kwargs)


def _from_pretrained_legacy(model_class, path, config, **kwargs):
    """A checkpoint saved before the form was recorded (PreNorm layouts only): load the base,
    convert with a probe check, then load the rows."""
    record = getattr(config, CONFIG_KEY)
    from safetensors.torch import load_file

    model = model_class.from_pretrained(path, config=config, **kwargs)
    delattr(model.config, CONFIG_KEY)
    model.config.__class__ = type(model.config).__mro__[1]
    convert(model, ResidualConfig.from_dict(record["config"]), per_layer=record["per_layer"],
            dtype=_DTYPES[record["dtype"]], schedule=record.get("schedule"))
    wanted = {k for k in model.state_dict() if "attnres" in k}
    found = set(_checkpoint_keys(path))
    missing = sorted(wanted - found)
    if missing:
        raise ValueError(f"path: the checkpoint lacks {len(missing)} AttnRes tensors, e.g. {missing[:3]}")
    sd = load_file(os.path.join(path, "model.safetensors"))
    model.load_state_dict({k: sd[k] for k in wanted}, strict=False)
    return model.eval()
