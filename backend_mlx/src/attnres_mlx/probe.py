"""The spec's probe network in MLX (spec section 6): the shared probe
(`attnres_core.probe`, `f_l(h) = tanh(rmsnorm(h) @ W[l-1])`) on `MlxOps`, driven by `DepthRouter`
with the given parameters, and its gradients by `mx.vjp`."""

from __future__ import annotations

from typing import Dict, List, Mapping

import mlx.core as mx
from attnres_core import probe as core
from attnres_core.config import ResidualConfig

from . import ops
from .modules import DepthRouter, Sublayer
from .residual_ops import MlxOps


def probe_sublayers(sublayer_weights: mx.array, eps: float, *, prenorm: bool = True) -> List[Sublayer]:
    """The probe's L sublayers `f_l(h) = tanh(rmsnorm(h, eps) @ W[l-1])` on `MlxOps`
    (`attnres_core.probe.probe_sublayers`, with eps and fuse_out_norm = not prenorm), as
    `attnres_numpy` and `attnres_jax` name it.  L callables `h [..., D] -> v [..., D]`; W `[L, D, D]`."""
    config = ResidualConfig(eps=eps, fuse_out_norm=not prenorm)
    return core.probe_sublayers(config, MlxOps(), sublayer_weights)


def probe_forward(config: ResidualConfig, params: Mapping[str, mx.array], embedding: mx.array,
                  sublayer_weights: mx.array, *, schedule: str = "direct", mix=None,
                  scale=None) -> mx.array:
    """Probe output `[..., D]` (before any final norm) with the router loaded from `params`."""
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    D = embedding.shape[-1] if embedding.ndim else 0
    L = core.check_sublayer_weights(sublayer_weights, D, lambda a: ops.dtype_name(a.dtype))
    router = DepthRouter(config, L, D)
    config.check_params(params, L, D, lambda a: ops.dtype_name(a.dtype))
    router.update(dict(params))
    sublayers = core.probe_sublayers(config, MlxOps(), sublayer_weights)
    return router(embedding, sublayers, schedule=schedule, mix=mix, scale=scale)


def probe_vjp(config: ResidualConfig, params: Mapping[str, mx.array], embedding: mx.array,
              sublayer_weights: mx.array, cotangent: mx.array, *,
              schedule: str = "direct", mix=None, scale=None) -> Dict[str, mx.array]:
    """Gradients of `<probe_forward(...), cotangent>`: "embedding", "sublayer_weights" and one
    entry per parameter name."""
    names = sorted(params)

    def run(emb, w, *values):
        return probe_forward(config, dict(zip(names, values)), emb, w, schedule=schedule, mix=mix,
                             scale=scale)

    _, grads = mx.vjp(run, [embedding, sublayer_weights, *(params[n] for n in names)],
                      [cotangent])
    return {"embedding": grads[0], "sublayer_weights": grads[1], **dict(zip(names, grads[2:]))}
