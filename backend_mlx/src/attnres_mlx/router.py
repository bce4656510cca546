"""`mlx.nn` residual modules: `DepthAttention` and `DepthRouter` (spec sections 4-5, M1-M9).

`DepthRouter` drives the user's L sublayers (callables `h [..., D] -> v [..., D]`) with any
`ResidualConfig`; its parameters are named and shaped exactly as `config.param_shapes(L, D)`
(row r = l - 1 belongs to sublayer l, row L to the output aggregation), so the probe's
parameters load 1:1 with `router.update(params)`.

The schedule is the shared `attnres_core.schedule.ResidualStream` on `MlxOps`.  Every
depth-attention source has its inverse RMS computed once, when it is produced (for Block AttnRes:
once per sealed block), and reused by every later read through
`ops.depth_attention(..., inv_rms=...)`; only the running intra-block partial sum is normed
inside the op.  Small reads (single-token decode: at most `compiled.VECTOR_MAX_ELEMENTS` source
elements) go to the op as one stacked array with one stacked inverse RMS, grown by one row per
sealed source and reused by every read of the pass, so a read costs a few graph nodes whatever
the number of sources.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualOps, ResidualStream, ScheduleObserver, split_result

from . import compiled, ops

Sublayer = Callable[[mx.array], mx.array]


def rmsnorm(x: mx.array, eps: float) -> mx.array:
    """Gainless RMSNorm over the last axis, returned in the compute dtype (float32, or float64
    for float64 x): the router's small projections (input queries, gates) stay in it."""
    xc = x.astype(ops.compute_dtype(x.dtype))
    return xc * mx.rsqrt(mx.mean(xc * xc, axis=-1, keepdims=True) + eps)


def _project(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """rmsnorm(x) @ weight in the compute dtype: `[..., D] x [D, D] -> [..., D]`."""
    normed = rmsnorm(x, eps)
    return normed @ weight.astype(normed.dtype)


class RowCache:
    """Single rows `p[r]` of a router's parameters, each kept with the array it was cut from:
    a decode step reads the same rows of the same (evaluated) arrays on every token, and a kept
    row is a leaf of the next graph instead of two new nodes.  A row is reused only while its
    parameter is the very same array object, so updated or traced parameters get fresh rows."""

    def __init__(self):
        self._rows = {}

    def get(self, name: str, p: mx.array, index: int) -> mx.array:
        hit = self._rows.get((name, index))
        if hit is not None and hit[0] is p:
            return hit[1]
        row = p[index]
        self._rows[name, index] = (p, row)
        return row


class MlxOps(ResidualOps):
    """MLX's `ResidualOps` for the shared schedule (`attnres_core.schedule`).

    Every sealed source (the embedding, each layer output, each completed block) gets its inverse
    RMS once (`source_stats`), reused by every later read (`inv_rms=`); only the running partial
    sum is normed inside the op.  Small projections (input queries, gates) stay in the compute
    dtype (C10); `mul` returns the value's dtype, so the stream keeps the embedding's dtype.
    Small reads take the stacked form (`_stacked`).
    """

    def __init__(self, params=None, rows: Optional["RowCache"] = None):
        super().__init__(params)
        # The sealed sources stacked so far in this pass: (their list, X `[n, ..., D]`,
        # R `[n, ..., H]`); the list holds them, so identity comparison is safe.
        self._stack = ([], None, None)
        self._rows = rows

    def param(self, name, index, *, like=None):
        p = self.params.get(name)
        if p is None or self._rows is None or type(index) is not int:
            return super().param(name, index, like=like)
        row = self._rows.get(name, p, index)
        return row if like is None else self.cast_like(row, like)

    def _stacked(self, sources, stats, config):
        """(X `[N, ..., D]`, R `[N, ..., H]`) of a small key-normed read, else None.  The
        sealed sources (every one but a trailing partial sum) extend the pass's stack when they
        extend its list; a partial sum gets its inverse RMS here and one more row."""
        x0 = sources[0]
        if (not config.key_norm
                or len(sources) * x0.size > compiled.VECTOR_MAX_ELEMENTS
                or any(r is None for r in stats[:-1])):
            return None
        k = len(sources) - (stats[-1] is None)
        sealed = sources[:k]
        known, X, R = self._stack
        m = len(known)
        if m > k or any(a is not b for a, b in zip(known, sealed)):
            m, X, R = 0, None, None
        if m < k:
            new_x = mx.stack(sealed[m:])
            new_r = mx.stack(stats[m:k])
            X = new_x if X is None else mx.concatenate([X, new_x])
            R = new_r if R is None else mx.concatenate([R, new_r])
            self._stack = (list(sealed), X, R)
        if k == len(sources):
            return X, R
        partial = sources[-1]
        r = self.source_stats(partial, config)
        if X is None:
            return partial[None], r[None]
        return mx.concatenate([X, partial[None]]), mx.concatenate([R, r[None]])

    def mul(self, a, b):
        c = ops.compute_dtype(b.dtype)
        return (a.astype(c) * b.astype(c)).astype(b.dtype)

    def rmsnorm(self, x, eps):
        return rmsnorm(x, eps)

    def matmul(self, x, w):
        return x @ w.astype(x.dtype)

    def to_compute(self, x):
        return x.astype(ops.compute_dtype(x.dtype))

    def sigmoid(self, x):
        return ops.sigmoid(x)

    def tanh(self, x):
        return mx.tanh(x)

    def source_stats(self, value, config):
        if not config.key_norm:
            return None
        return ops.inverse_rms(value, eps=config.eps, num_heads=config.num_heads)

    def rmsnorm_gain(self, x, weight, eps):
        """M15 composed: `rmsnorm(x) * weight` in the compute dtype, rounded once (C10)."""
        normed = rmsnorm(x, eps)
        return (normed * weight.astype(normed.dtype)).astype(x.dtype)

    def depth_attention(self, sources, stats, query, norm_weight, config, *, return_weights,
                        out_norm_weight=None):
        stacked = self._stacked(sources, stats, config)
        if stacked is None:
            xs, rs = list(sources), list(stats) if config.key_norm else None
        else:
            xs, rs = stacked
        result = ops.depth_attention(xs, query, norm_weight, eps=config.eps,
                                     scale=config.scale, num_heads=config.num_heads,
                                     activation=config.activation, key_norm=config.key_norm,
                                     inv_rms=rs, out_norm_weight=out_norm_weight,
                                     return_weights=return_weights)
        return split_result(result, out_norm_weight, return_weights)

    def depth_attention_multi(self, sources, stats, queries, norm_weights, config):
        return ops.depth_attention_multi(list(sources), queries, norm_weights, eps=config.eps,
                                         scale=config.scale, inv_rms=list(stats))

    def merge_partial(self, out1, lse1, partial, query, norm_weight, config):
        return ops.merge_partial(out1, lse1, partial, query, norm_weight, eps=config.eps,
                                 scale=config.scale)


class DepthAttention(nn.Module):
    """One depth-attention read with its own parameters (spec section 2).

    query="static": parameters `query [D]` (zero init) and `norm_weight [D]` (one init);
    query="input": `query_weight [D, D]` (zero init), q = rmsnorm(sources[-1]) @ query_weight.
    fuse_out_norm=True (C17, as torch's): also `out_norm [D]` (one init), the next sublayer's
    pre-norm gain fused into the op (epsilon out_norm_eps, None: eps).
    Call with a list of N sources `[..., D]` (or a stacked `[N, ..., D]`); returns `[..., D]`,
    or `(out, out_normed)` with fuse_out_norm.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                 activation: str = "softmax", key_norm: bool = True, query: str = "static",
                 fuse_out_norm: bool = False, out_norm_eps: Optional[float] = None):
        super().__init__()
        cfg = ResidualConfig(kind="full", query=query, activation=activation, key_norm=key_norm,
                             num_heads=num_heads, eps=eps, scale=scale)
        self.config = cfg
        if query == "static":
            self.query = mx.zeros((dim,))
        else:
            self.query_weight = mx.zeros((dim, dim))
        self.norm_weight = mx.ones((dim,))
        if fuse_out_norm:
            self.out_norm = mx.ones((dim,))
        elif out_norm_eps is not None:
            raise ValueError("out_norm_eps: given while fuse_out_norm is False")
        self.out_norm_eps = out_norm_eps

    def __call__(self, sources, *, return_lse: bool = False, return_weights: bool = False,
                 inv_rms=None):
        """out `[..., D]`, or `(out, out_normed?, lse?, weights?)` with fuse_out_norm / return_lse /
        return_weights (as `ops.depth_attention`); inv_rms: the sources' cached inverse RMS
        (`inverse_rms`)."""
        cfg = self.config
        q = self.query if cfg.query == "static" else _project(sources[-1], self.query_weight,
                                                              cfg.eps)
        return ops.depth_attention(sources, q, self.norm_weight, eps=cfg.eps, scale=cfg.scale,
                                   num_heads=cfg.num_heads, activation=cfg.activation,
                                   key_norm=cfg.key_norm, return_lse=return_lse,
                                   return_weights=return_weights,
                                   out_norm_weight=self.get("out_norm"),
                                   out_norm_eps=self.out_norm_eps, inv_rms=inv_rms)


class DepthRouter(nn.Module):
    """The residual scheme of `config` around L user sublayers of width D (spec 4-5).

    Parameters (attributes, `config.param_shapes(L, D)`, M8 init): queries `[L+1, D]` or
    query_weights `[L+1, D, D]` and norm_weights `[L+1, D]`; alphas `[L]`; gate_weights
    `[L, D, D]`, gate_biases `[L, D]`; depth_weights `[L+1, L+1]`.
    """

    def __init__(self, config: ResidualConfig, num_layers: int, dim: int, *,
                 dtype: mx.Dtype = mx.float32):
        super().__init__()
        if not isinstance(config, ResidualConfig):
            raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
        self.config = config
        self.num_layers = int(num_layers)
        self.dim = int(dim)
        for name, value in config.init_params(num_layers, dim).items():
            setattr(self, name, mx.array(value).astype(dtype))

    # -- the schedule ------------------------------------------------------------------------
    def stream(self, embedding: mx.array, *, schedule: str = "direct",
               observer: Optional[ScheduleObserver] = None, mix=None,
               scale: Optional[float] = None) -> ResidualStream:
        """Start a pass step by step: embedding v_0 `[..., D]`; the stream
        (`attnres_core.schedule`) gives `input()`, `push(v_l)` and `output()`.  mix (alpha in
        [0, 1]: progressive introduction; a Python float, or a 0-d array under `mx.compile`) and
        scale (this call's logit scale) are the M10 per-call inputs."""
        if embedding.ndim < 1 or embedding.shape[-1] != self.dim:
            raise ValueError(f"embedding: expected shape [..., {self.dim}], got {embedding.shape}")
        params = {name: self[name] for name in self.config.param_shapes(self.num_layers, self.dim)}
        if not isinstance(self.__dict__.get("_rows"), RowCache):
            object.__setattr__(self, "_rows", RowCache())  # a plain attribute, not a parameter
        return ResidualStream(self.config, MlxOps(params, self._rows), embedding,
                              num_layers=self.num_layers,
                              schedule=schedule, observer=observer, mix=mix, scale=scale)

    def __call__(self, embedding: mx.array, sublayers: Sequence[Sublayer], *,
                 schedule: str = "direct", observer: Optional[ScheduleObserver] = None,
                 mix=None, scale: Optional[float] = None) -> mx.array:
        """Run the scheme: embedding v_0 `[..., D]`, sublayers f_1..f_L; returns h_{L+1}
        `[..., D]` (before any final norm).  schedule="two_phase" (M9) needs kind="block",
        softmax, key_norm, one head and static queries."""
        L = self.num_layers
        if len(sublayers) != L:
            raise ValueError(f"sublayers: expected L = {L} callables, got {len(sublayers)}")
        self.config.check_schedule(schedule)
        stream = self.stream(embedding, schedule=schedule, observer=observer, mix=mix, scale=scale)
        for f in sublayers:
            stream.push(f(stream.input()))
        return stream.output()
