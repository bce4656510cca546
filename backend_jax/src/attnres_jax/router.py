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
from attnres_numpy.schedule import (
    FixedResidualStream,
    ResidualOps,
    ScheduleObserver,
    run_schedule,
    split_result,
)
from jax.ad_checkpoint import checkpoint_name

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

    def where(self, cond, a, b):
        return jnp.where(cond, a, b)

    def rows_init(self, first, rows):
        return jnp.zeros((rows,) + first.shape, first.dtype).at[0].set(first)

    def write_row(self, buffer, index, value):
        return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), index, 0)

    def take(self, x, i):
        return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)

    def depth_attention_prefix(self, buffer, count, query, norm_weight, config, *, return_weights,
                               out_norm_weight=None):
        result = depth_attention(buffer, query, norm_weight, eps=config.eps, scale=config.scale,
                                 num_heads=config.num_heads, activation=config.activation,
                                 key_norm=config.key_norm, return_weights=return_weights,
                                 out_norm_weight=out_norm_weight, num_valid=count)
        return split_result(result, out_norm_weight, return_weights)

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


#: The checkpoint name of every layer output v_l (the depth-attention sources) under `remat`.
SOURCE_NAME = "attnres_source"

REMAT_MODES = (None, "recompute", "offload")


def remat_policy(remat: Optional[str]):
    """The `jax.checkpoint` policy of a memory mode (None: no checkpoint).  "recompute": save
    only the arrays named `SOURCE_NAME` (the layer outputs v_l), recompute every sublayer and
    depth-attention read in the backward (torch's `Recompute`); "offload": the same, with the
    sources moved to pinned host memory between forward and backward (torch's `Offload`; on the
    CPU platform device and host memory are the same memory)."""
    if remat not in REMAT_MODES:
        raise ValueError(f"remat: expected one of {REMAT_MODES}, got {remat!r}")
    if remat is None:
        return None
    if remat == "recompute":
        return jax.checkpoint_policies.save_only_these_names(SOURCE_NAME)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(SOURCE_NAME,),
        offload_src="device", offload_dst="pinned_host")


def _named(f):
    """f with its output v_l named `SOURCE_NAME` for the remat policies."""
    return lambda *args: checkpoint_name(f(*args), SOURCE_NAME)


def _as_scale(scale, embedding):
    """M10: an array scale in the compute dtype (traced under jit: a temperature schedule
    without recompiles); a Python value as it is (checked by the schedule)."""
    if hasattr(scale, "shape"):
        return jnp.asarray(scale, dtype=compute_dtype(embedding.dtype))
    return scale


def stack_apply(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Sublayer], *,
                schedule: str = "direct", observer: Optional[ScheduleObserver] = None,
                mix=None, scale=None, remat: Optional[str] = None):
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
      scale: M10 logit scale for this call: a Python float (static under `jit`) or a 0-d array
        (traced: one compiled step serves every temperature; folded into the queries,
        `attnres_numpy.schedule.call_scale`).
      remat: None, "recompute" or "offload" (`remat_policy`): the whole stack under one
        `jax.checkpoint` that keeps only the layer outputs v_l.

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
    scale, policy = _as_scale(scale, embedding), remat_policy(remat)
    if policy is None:
        return run_schedule(config, JaxOps(params), embedding, list(sublayers), schedule=schedule,
                            observer=observer, mix=mix, scale=scale)
    named = [_named(f) for f in sublayers]

    def run(params, embedding, mix, scale):
        return run_schedule(config, JaxOps(params), embedding, named, schedule=schedule,
                            observer=observer, mix=mix, scale=scale)

    return jax.checkpoint(run, policy=policy, static_argnums=_static(mix, scale))(
        params, embedding, mix, scale)


def _static(*values) -> tuple:
    """The argument numbers (after params, embedding) of the Python values among mix, scale."""
    return tuple(2 + i for i, v in enumerate(values) if not hasattr(v, "shape"))


def scan_apply(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Callable],
               layer_params, *, mix=None, scale=None, remat: Optional[str] = None, unroll: int = 1,
               stages: Optional[int] = None):
    """`stack_apply` as one `jax.lax.scan` over groups of sublayers: the program holds one group
    whatever L is (compile time flat in L), the schedule's state has a fixed shape
    (`attnres_numpy.schedule.FixedResidualStream`: Full a history buffer `[L + 1, ..., D]`,
    Block `[ceil(L / S) + 1, ..., D]`; every read masks the rows not yet written, which
    contribute exact zeros) and the result is `stack_apply`'s.

    Args:
      config: kinds standard, scalar, gated, full or block (direct schedule).  params: as
        `stack_apply`, of `config.param_shapes(L, D)`.
      embedding: v_0 `[..., D]`.
      sublayers: P callables `f_j(p, h [..., D]) -> v [..., D]`, one period of the stack (a
        transformer block: attention, MLP).
      layer_params: a pytree whose leaves are stacked `[n, ...]`; scan step i hands its slice p
        to every f_j and runs sublayers l = i * P + j + 1, so L = n * P.
      mix, scale: M10 as in `stack_apply`.
      remat: None, "recompute" or "offload" (`remat_policy`) on the scan body: the backward
        keeps each step's carry (the schedule's state) and the layer outputs, and recomputes the
        rest.
      unroll: `lax.scan`'s unroll.
      stages: the scan is split into this many consecutive scans (None: 4 for kind="full", else
        1), each holding only the buffer rows its sublayers touch: the rows read per sublayer
        are ~(stages + 1) / (2 stages) of L instead of L, each stage one more body in the program.

    Returns: out `[..., D]` (h_{L+1}, before any final norm) in the embedding's dtype.
    """
    if not isinstance(sublayers, (list, tuple)) or not sublayers or not all(callable(f) for f in sublayers):
        raise TypeError("sublayers: expected a non-empty list or tuple of callables (p, h) -> v")
    leaves = jax.tree_util.tree_leaves(layer_params)
    if not leaves or any(jnp.ndim(x) < 1 for x in leaves) or len({jnp.shape(x)[0] for x in leaves}) != 1:
        raise ValueError("layer_params: expected a pytree of arrays stacked over one leading axis [n, ...], "
                         f"got leaf shapes {[jnp.shape(x) for x in leaves]}")
    n, period = jnp.shape(leaves[0])[0], len(sublayers)
    embedding = jnp.asarray(embedding)
    params = {k: jnp.asarray(v) for k, v in params.items()} if isinstance(params, Mapping) else params
    _check(config, params, embedding, n * period, "direct")
    if hasattr(mix, "shape"):
        mix = jnp.asarray(mix, dtype=compute_dtype(embedding.dtype))
    stream = FixedResidualStream(config, JaxOps(params), embedding, num_layers=n * period, mix=mix,
                                 scale=_as_scale(scale, embedding))
    policy = remat_policy(remat)
    fs = list(sublayers) if policy is None else [_named(f) for f in sublayers]

    def body(state, step):
        i, p = step
        stream.load(state, i * period + 1)
        for f in fs:
            stream.push(f(p, stream.input()))
        return stream.state, None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy)
    stages = min(n, 4 if config.kind == "full" else 1) if stages is None else stages
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n:
        raise ValueError(f"stages: expected an int in [1, {n}] (the scan steps) or None, got {stages!r}")
    state, start = stream.state, 0
    for stage in range(stages):
        stop = n * (stage + 1) // stages
        h, buffer, standard = state
        rows = buffer if buffer is None else buffer[:stream.count(stop * period + 1)]  # rows touched
        steps = (jnp.arange(start, stop), jax.tree_util.tree_map(lambda x: x[start:stop], layer_params))
        (h, rows, standard), _ = jax.lax.scan(body, (h, rows, standard), steps, unroll=unroll)
        state = (h, buffer if buffer is None else buffer.at[:rows.shape[0]].set(rows), standard)
        start = stop
    stream.load(state, n * period + 1)
    return stream.output()


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
