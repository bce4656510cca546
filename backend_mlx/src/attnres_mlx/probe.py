"""The spec's probe network in MLX (spec section 6): `f_l(h) = tanh(rmsnorm(h) @ W[l-1])`."""

from __future__ import annotations

from typing import Dict, List, Mapping

import mlx.core as mx
from attnres_numpy.config import ResidualConfig

from . import ops
from .router import DepthRouter, Sublayer, rmsnorm


def probe_sublayers(sublayer_weights: mx.array, eps: float, *, prenorm: bool = True) -> List[Sublayer]:
    """L callables `h [..., D] -> tanh(rmsnorm(h) @ W[l-1]) [..., D]`; W `[L, D, D]`.  Computed
    in the compute dtype with one cast back to h's dtype.  prenorm=False (fuse_out_norm, M15:
    the stream hands the normed input): `tanh(h @ W[l-1])`."""
    def sublayer(h, w):
        normed = rmsnorm(h, eps) if prenorm else h.astype(ops.compute_dtype(h.dtype))
        return mx.tanh(normed @ w.astype(normed.dtype)).astype(h.dtype)

    return [lambda h, w=sublayer_weights[l]: sublayer(h, w)
            for l in range(sublayer_weights.shape[0])]


def probe_forward(config: ResidualConfig, params: Mapping[str, mx.array], embedding: mx.array,
                  sublayer_weights: mx.array, *, schedule: str = "direct", mix=None,
                  scale=None) -> mx.array:
    """Probe output `[..., D]` (before any final norm) with the router loaded from `params`."""
    L, D = sublayer_weights.shape[0], embedding.shape[-1]
    router = DepthRouter(config, L, D)
    config.check_params(params, L, D, lambda a: ops.dtype_name(a.dtype))
    router.update(dict(params))
    sublayers = probe_sublayers(sublayer_weights, config.eps, prenorm=not config.fuse_out_norm)  # M15
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
