"""mlx-lm models and AttnRes: Kimi K3's Block AttnRes weights both ways, and PreNorm decoders
converted in place.

Kimi K3 (`mlx_lm.models.kimi_k3`, `attn_res_block_size` decoder layers per block) is Block
AttnRes with S = 2 x attn_res_block_size sublayers, softmax, key norm, one head, scale 1 and
static queries; its per-read parameters `*_res_proj.weight [1, D]` (the pseudo-query) and
`*_res_norm.weight [D]` (the key-norm gain) are rows of `DepthRouter`'s `queries` and
`norm_weights`: decoder layer i's attention read is row 2i, its MLP read row 2i + 1, the
output read (`output_attn_res_*`) row L = 2 x num_hidden_layers (M4).

* `kimi_k3_router(model)`: a `DepthRouter` holding K3's residual weights; `load_kimi_k3(model,
  router)`: the reverse (router rows into K3's modules); `kimi_k3_logits(model, router,
  inputs)`: K3's own sublayers driven by the router (what the mapping is tested with).
* `convert_prenorm(model, config)`: an mlx-lm PreNorm decoder (Llama and the models that share
  its layer layout: `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`) turned
  into AttnRes in place.  Each decoder layer keeps its own weights, names and `__call__`
  signature (its class is swapped for a subclass) and owns its router rows (`attnres_queries`,
  `attnres_norm_weights`: rows 2i, 2i + 1, and for the last layer also row L), so checkpoints,
  `KVCache`, `make_prompt_cache` and `generate_step` work unchanged.  `mix=0.0` is exactly the
  PreNorm model (M10).
* `load_hf(path)`: a checkpoint directory saved by `attnres_torch.hf` (`save_pretrained` of a
  converted model) as (converted mlx-lm model, tokenizer or None), the rows moved from torch's
  layers to MLX's; `save_hf(model, path)`: the way back (`attnres_mlx.hf_checkpoint`).  Never
  `mlx_lm.load(path, strict=False)` on such a checkpoint: it drops the rows (the PreNorm model).

This module imports `mlx_lm` only inside the functions that need its types.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualStream
from attnres_core.training import from_k3, k3_config, to_k3
from mlx.utils import tree_flatten, tree_unflatten

from .modules import DepthRouter
from .residual_ops import MlxOps


def _identity(x):
    return x


def _k3_text(model) -> nn.Module:
    """The `KimiK3TextModel` of a K3 `Model`, `LanguageModel` or text model."""
    for _ in range(3):
        if hasattr(model, "layers") and hasattr(model, "embed_tokens"):
            return model
        model = getattr(model, "language_model", None) or getattr(model, "model", None)
        if model is None:
            break
    raise TypeError("model: expected an mlx_lm kimi_k3 Model, LanguageModel or KimiK3TextModel")


def kimi_k3_config(model) -> ResidualConfig:
    """The `ResidualConfig` of a K3 model: block, S = 2 x attn_res_block_size, eps =
    rms_norm_eps (K3's depth reads use the model's RMSNorm epsilon; `attnres_core.training.
    k3_config`)."""
    args = _k3_text(model).args
    if args.attn_res_block_size is None:
        raise ValueError("model: attn_res_block_size is None (a K3 model without AttnRes)")
    return k3_config(args.attn_res_block_size, float(args.rms_norm_eps))


def _k3_weights(text) -> Dict[str, mx.array]:
    """The K3 text model's parameters by their mlx-lm names (`layers.0.mlp_res_proj.weight`)."""
    return dict(tree_flatten(text.parameters()))


def kimi_k3_router(model) -> DepthRouter:
    """A `DepthRouter` (L = 2 x num_hidden_layers, float32) holding K3's residual weights:
    queries[r] = the read's `*_res_proj.weight` `[1, D]` flattened, norm_weights[r] = its
    `*_res_norm.weight` `[D]` (the core K3 mapping, `attnres_core.training.from_k3`)."""
    text = _k3_text(model)
    rows = from_k3(_k3_weights(text), prefix="", as_array=_identity, stack=mx.stack)
    L = 2 * len(text.layers)
    if rows["queries"].shape != (L + 1, text.args.hidden_size):
        raise ValueError(f"model: expected K3 residual weights for {len(text.layers)} decoder layers "
                         f"of width {text.args.hidden_size}, found rows {rows['queries'].shape}")
    router = DepthRouter(kimi_k3_config(model), L, text.args.hidden_size)
    router.update({k: v.astype(mx.float32) for k, v in rows.items()})
    router.fused_reads = False  # the spec's ops: K3's arithmetic, so its logits bit for bit
    return router


def load_kimi_k3(model, router: DepthRouter) -> None:
    """The reverse of `kimi_k3_router`: write `router`'s rows into K3's residual modules, each in
    the dtype the module's weight has (`attnres_core.training.to_k3`).  Clears K3's cached
    effective queries (`_*_w_eff`)."""
    text = _k3_text(model)
    L, dim = 2 * len(text.layers), text.args.hidden_size
    if router.config != kimi_k3_config(model) or router.num_layers != L or router.dim != dim:
        raise ValueError(f"router: expected {kimi_k3_config(model)} over L = {L} sublayers of "
                         f"width {dim}, got {router.config} over L = {router.num_layers}, "
                         f"width {router.dim}")
    current = _k3_weights(text)
    keys = to_k3({"queries": router.queries, "norm_weights": router.norm_weights}, prefix="",
                 copy=_identity)
    text.update(tree_unflatten([(k, v.astype(current[k].dtype)) for k, v in keys.items()]))
    for layer in text.layers:
        layer._attn_res_w_eff = layer._mlp_res_w_eff = None
    text._output_res_w_eff = None


def kimi_k3_logits(model, router: DepthRouter, inputs: mx.array, cache=None) -> mx.array:
    """K3's logits `[B, T, V]` (model: K3's `Model` or `LanguageModel`; inputs `[B, T]`; cache:
    `model.make_cache()` or None) with its residual stream run by `router` (direct schedule): the
    embedding, every decoder layer's attention and MLP (each behind its own RMSNorm, with K3's
    masks and `cache`), the final norm and head.  Single pipeline stage only."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    text = _k3_text(model)
    h = text.embed_tokens(inputs)
    cache = [None] * len(text.layers) if cache is None else cache
    ssm_mask = create_ssm_mask(h, cache[text.ssm_idx]) if text.ssm_idx is not None else None
    attn_mask = (create_attention_mask(h, cache[text.attn_idx], return_array=True)
                 if text.attn_idx is not None else None)
    sublayers = []
    for layer, c in zip(text.layers, cache):
        mask = ssm_mask if layer.is_linear else attn_mask
        sublayers += [lambda x, ly=layer, m=mask, c=c: ly.self_attn(ly.input_layernorm(x), m, c),
                      lambda x, ly=layer: ly.mlp(ly.post_attention_layernorm(x))]
    out = text.norm(router(h, sublayers))
    lm = getattr(model, "language_model", model)
    if not hasattr(lm, "lm_head"):
        raise TypeError("model: kimi_k3_logits needs the K3 Model or LanguageModel (the head)")
    return text.embed_tokens.as_linear(out) if lm.lm_head is None else lm.lm_head(out)


# -- PreNorm decoders converted in place ------------------------------------------------------

class _Pass:
    """What the converted layers of one model share: the scheme, mix/scale, and the stream of the
    pass in progress (started by the first layer, read out by the last)."""

    def __init__(self, config: ResidualConfig, layers: List[nn.Module], dim: int, mix, scale):
        self.config, self.layers, self.dim = config, layers, dim
        self.mix, self.scale = mix, scale
        self.stream = None


class AttnResDecoderLayer:
    """Mixin of a converted decoder layer (`convert_prenorm` makes `type(layer)` a subclass of
    this and the layer's own class).  Layer i's `__call__(x, mask, cache)` pushes its attention
    and MLP sublayers through the model's shared stream; the first layer starts it from x (the
    embedding), the last returns the stream's output (before the model's final norm), the
    others return their MLP output (the next converted layer ignores its x)."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        shared: _Pass = self._attnres_pass
        i, layers = self._attnres_index, shared.layers
        if i == 0:
            # The rows live on the layers that read them: gathered once per pass.
            params = {"queries": mx.concatenate([ly.attnres_queries for ly in layers]),
                      "norm_weights": mx.concatenate([ly.attnres_norm_weights for ly in layers])}
            shared.stream = ResidualStream(shared.config, MlxOps(params), x,
                                           num_layers=2 * len(layers), mix=shared.mix,
                                           scale=shared.scale)
        stream = shared.stream
        if stream is None or stream.layer != 2 * i + 1:
            raise ValueError(f"layer {i}: converted decoder layers must run in order from layer "
                             f"0 in one pass (got sublayer {getattr(stream, 'layer', None)})")
        stream.push(self.self_attn(self.input_layernorm(stream.input()), mask, cache))
        v = self.mlp(self.post_attention_layernorm(stream.input()))
        stream.push(v)
        if i == len(layers) - 1:
            shared.stream = None
            return stream.output()
        return v


_CLASSES: Dict[type, type] = {}


def _converted_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"AttnRes{cls.__name__}", (AttnResDecoderLayer, cls), {})
    return _CLASSES[cls]


def convert_prenorm(model, config: Optional[ResidualConfig] = None, *, mix=None,
                    scale=None) -> nn.Module:
    """Turn an mlx-lm PreNorm decoder (e.g. `mlx_lm.models.llama.Model`) into AttnRes in place
    and return it.

    config: the scheme (default: block with S = 2, i.e. one block per decoder layer); kinds
      whose parameters are only `queries` and `norm_weights` (full, block, window with static
      queries) and the direct schedule.  mix, scale: M10 per-call inputs (mix=0.0: exactly the
      PreNorm model; `set_mix(model, alpha)` changes it later, for progressive introduction).
    New parameters (M8 init: zero queries, unit gains, float32) per decoder layer i:
    `attnres_queries [2, D]` and `attnres_norm_weights [2, D]` (rows 2i, 2i + 1); the last
    layer's are `[3, D]` (also row L, the output read).
    """
    config = ResidualConfig.variant("block") if config is None else config
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not layers:
        raise TypeError("model: expected an mlx-lm model with model.layers (decoder layers)")
    shapes = config.param_shapes(2 * len(layers), 1)
    if config.kind not in ("full", "block", "window") or set(shapes) != {"queries",
                                                                         "norm_weights"}:
        raise ValueError(f"config: convert_prenorm supports full/block/window with static "
                         f"queries (parameters queries, norm_weights), got {config}")
    for i, layer in enumerate(layers):
        missing = [a for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
                   if not hasattr(layer, a)]
        if missing or isinstance(layer, AttnResDecoderLayer):
            raise TypeError(f"model.layers[{i}]: expected an unconverted PreNorm decoder layer "
                            f"with input_layernorm/self_attn/post_attention_layernorm/mlp, got "
                            f"{type(layer).__name__}" + (f" (missing {missing})" if missing else ""))
    dim = layers[0].input_layernorm.weight.shape[-1]
    L = 2 * len(layers)
    init = config.init_params(L, dim)
    shared = _Pass(config, layers, dim, mix, scale)
    for i, layer in enumerate(layers):
        rows = slice(2 * i, L + 1 if i == len(layers) - 1 else 2 * i + 2)
        layer.__class__ = _converted_class(type(layer))
        layer.attnres_queries = mx.array(init["queries"][rows]).astype(mx.float32)
        layer.attnres_norm_weights = mx.array(init["norm_weights"][rows]).astype(mx.float32)
        object.__setattr__(layer, "_attnres_pass", shared)
        object.__setattr__(layer, "_attnres_index", i)
    return model


def set_mix(model, mix=None, scale=None) -> None:
    """Change a converted model's M10 per-call inputs (mix alpha in [0, 1] or None; scale)."""
    layers = getattr(getattr(model, "model", model), "layers", [])
    if not layers or not isinstance(layers[0], AttnResDecoderLayer):
        raise TypeError("model: expected a model converted by convert_prenorm")
    shared = layers[0]._attnres_pass
    shared.mix, shared.scale = mix, scale


from .hf_checkpoint import load_hf, save_hf  # noqa: E402, F401  (re-exported; that module imports this one lazily)
