"""Residual schemes around the user's sublayers, as pure JAX functions (spec sections 4-6, M1-M9).

`stack_apply(config, params, embedding, sublayers)` drives user-supplied sublayers (callables
`h [..., D] -> v [..., D]`, from any JAX library: Flax, Equinox, Haiku or plain functions over
pytrees) with the residual scheme `config` (`attnres_numpy.config.ResidualConfig`).  params is a
dict name -> array shaped exactly as `config.param_shapes(L, D)`; row r = l - 1 belongs to
sublayer l and row L to the output aggregation (M4).  The schedule itself is the shared
`attnres_numpy.schedule.ResidualStream`, run on `JaxOps`.  Everything here is differentiable and
works under `jit`, `grad`, `vmap` and `checkpoint`.

`probe_forward` is the spec's probe network (`f_l(h) = tanh(rmsnorm(h) @ W[l-1])`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from attnres_numpy import validation
from attnres_numpy.config import ResidualConfig
from attnres_numpy.schedule import ResidualOps, ScheduleObserver, run_schedule, split_result

from .ops import compute_dtype, depth_attention, depth_attention_multi, dtype_name, merge_partial

Sublayer = Callable[[jax.Array], jax.Array]
HIGHEST = jax.lax.Precision.HIGHEST


def _rmsnorm_compute(x, eps: float):
    """Gainless RMSNorm over the last axis in the compute dtype (C10: float32, float64 for
    float64 x), not rounded back: `[..., D]`."""
    xc = x.astype(compute_dtype(x.dtype))
    return xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)


def rmsnorm(x, eps: float):
    """Gainless RMSNorm over the last axis, statistics in the compute dtype (C10: float32, float64
    for float64 x).  x `[..., D]` -> `[..., D]` in x's dtype."""
    return _rmsnorm_compute(x, eps).astype(x.dtype)


def matmul(x, w):
    """Right-multiplication `x [..., D_in] @ w [D_in, D_out]` at full precision."""
    return jnp.matmul(x, w.astype(x.dtype), precision=HIGHEST)


class JaxOps(ResidualOps):
    """JAX's `ResidualOps` for the shared schedule (`attnres_numpy.schedule`).

    params: name -> array of `ResidualConfig.param_shapes(L, D)` (a missing or None
    "norm_weights" means a gainless key norm).  The stream keeps the embedding's dtype, the
    scheme's own parameters are cast to it, the depth-attention query and gain pass as they are.
    """

    def rmsnorm(self, x, eps):
        return rmsnorm(x, eps)

    def matmul(self, x, w):
        return matmul(x, w)

    def sigmoid(self, x):
        return jax.nn.sigmoid(x)

    def to_compute(self, x):
        return x.astype(compute_dtype(x.dtype))

    def rmsnorm_gain(self, x, weight, eps):
        """M15 composed: `rmsnorm(x) * weight` in the compute dtype, rounded once (C10)."""
        normed = _rmsnorm_compute(x, eps)
        return (normed * weight.astype(normed.dtype)).astype(x.dtype)

    def depth_attention(self, sources, stats, query, norm_weight, config, *, return_weights,
                        out_norm_weight=None):
        result = depth_attention(list(sources), query, norm_weight, eps=config.eps,
                                 scale=config.scale, num_heads=config.num_heads,
                                 activation=config.activation, key_norm=config.key_norm,
                                 return_weights=return_weights, out_norm_weight=out_norm_weight)
        return split_result(result, out_norm_weight, return_weights)

    def depth_attention_multi(self, sources, stats, queries, norm_weights, config):
        return depth_attention_multi(list(sources), queries, norm_weights, eps=config.eps,
                                     scale=config.scale)

    def merge_partial(self, out1, lse1, partial, query, norm_weight, config):
        return merge_partial(out1, lse1, partial, query, norm_weight, eps=config.eps,
                             scale=config.scale)


def _check(config, params, embedding, num_layers: int, schedule: str) -> None:
    """Config, schedule (M9), embedding `[..., D]` and params names/shapes (M6), at trace time."""
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    config.check_schedule(schedule)
    validation.check_floating("embedding", dtype_name(embedding))
    if embedding.ndim < 1 or embedding.shape[-1] < 1:
        raise ValueError(f"embedding: expected shape [..., D] with D >= 1, got shape {embedding.shape}")
    config.check_params(params, num_layers, embedding.shape[-1], dtype_name)


def stack_apply(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Sublayer], *,
                schedule: str = "direct", observer: Optional[ScheduleObserver] = None,
                mix=None, scale: Optional[float] = None):
    """Run the residual scheme `config` over L user-supplied sublayers (spec section 4), on the
    shared schedule (`attnres_numpy.schedule.run_schedule`).

    Args:
      config: the residual scheme.  params: name -> array of `config.param_shapes(L, D)`.
      embedding: v_0 `[..., D]`.  sublayers: L callables `h [..., D] -> v [..., D]`.
      schedule: "direct" or "two_phase" (M9, see `ResidualConfig.supports_two_phase`); both give the same out.
      observer: an optional `ScheduleObserver` (sees every depth-attention row and sublayer;
        traced values under `jit`).
      mix: M10 progressive introduction, alpha in [0, 1] (None = 1): a Python float (0 runs no
        depth attention) or a 0-d array, e.g. traced under `jit`, so one compiled step serves
        every alpha of a warm-up.
      scale: M10 logit scale for this call (a Python float: static under `jit`).

    Returns: out `[..., D]` (h_{L+1}, before any final norm) in the embedding's dtype.
    """
    if not isinstance(sublayers, (list, tuple)) or not all(callable(f) for f in sublayers):
        raise TypeError("sublayers: expected a list or tuple of callables h -> v")
    if len(sublayers) < 1:
        raise ValueError("sublayers: expected L >= 1 sublayers, got an empty sequence")
    embedding = jnp.asarray(embedding)
    params = {k: jnp.asarray(v) for k, v in params.items()} if isinstance(params, Mapping) else params
    _check(config, params, embedding, len(sublayers), schedule)
    if hasattr(mix, "shape"):  # an array alpha (numpy or JAX, traced under jit), in the compute dtype
        mix = jnp.asarray(mix, dtype=compute_dtype(embedding.dtype))
    return run_schedule(config, JaxOps(params), embedding, list(sublayers), schedule=schedule,
                        observer=observer, mix=mix, scale=scale)


def probe_sublayers(sublayer_weights, eps: float, *, prenorm: bool = True) -> list:
    """The probe's L sublayers `f_l(h) = tanh(rmsnorm(h, eps) @ W[l-1])`; W `[L, D, D]`;
    prenorm=False (fuse_out_norm, M15: the stream hands the normed input) drops the rmsnorm."""
    norm = (lambda h: rmsnorm(h, eps)) if prenorm else (lambda h: h)
    return [lambda h, w=sublayer_weights[l]: jnp.tanh(matmul(norm(h), w))
            for l in range(sublayer_weights.shape[0])]


def probe_forward(config: ResidualConfig, params: Mapping, embedding, sublayer_weights, *,
                  schedule: str = "direct", mix=None, scale: Optional[float] = None):
    """The spec's probe network (spec section 6): embedding `[..., D]`, sublayer_weights
    `[L, D, D]`; returns out `[..., D]`."""
    w = jnp.asarray(sublayer_weights)
    embedding = jnp.asarray(embedding)
    validation.check_floating("sublayer_weights", dtype_name(w))
    dim = embedding.shape[-1] if embedding.ndim else 0
    if w.ndim != 3 or w.shape[0] < 1 or w.shape[1:] != (dim, dim):
        raise ValueError(f"sublayer_weights: expected shape [L, D, D] with L >= 1 and D = {dim}, "
                         f"got shape {w.shape}")
    sublayers = probe_sublayers(w, config.eps, prenorm=not config.fuse_out_norm)  # M15
    return stack_apply(config, params, embedding, sublayers, schedule=schedule,
                       mix=mix, scale=scale)
