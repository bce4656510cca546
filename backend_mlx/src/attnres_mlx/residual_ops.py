"""MLX's `ResidualOps`: the primitives the shared residual schedule (`attnres_core.schedule`)
runs on.  `DepthRouter` (`modules.py`) drives `ResidualStream` with `MlxOps`, which reads in one
of two ways, chosen once per pass:

* Fused reads (`fusable`: small passes on the CPU device, e.g. single-token decode, with the
  key norm, one head and static queries; float16/bfloat16/float32).  Each sealed source keeps
  itself and its normalized key `r x` as rows `[..., 1, D]` (`FusedKey`), stacked once per
  pass into `K, X [..., n, D]`; a read is `softmax(qg K^T) X` (two matmuls and a softmax), the
  running partial sum's key formed for that read only; qg = query * gain * scale is cut from one
  table of every row formed once per pass.  Two-phase (M9): phase 1 is the same over S queries,
  and each merge a matmul, a float64 sum of squares and one fused elementwise node.  A read
  costs ~10 graph nodes (a merge ~7), differentiable by plain MLX autodiff.
* Otherwise the spec's ops (`ops.depth_attention` with cached inverse RMS, the Metal kernels
  where they apply): every sealed source has its inverse RMS computed once and reused by every
  later read (`inv_rms=`); small reads (float64, several heads, input queries) go as one
  stacked array with one stacked inverse RMS, grown by one row per sealed source.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import mlx.core as mx
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualOps, split_result

from . import dispatch, ops
from .kernels import compiled


def rmsnorm(x: mx.array, eps: float) -> mx.array:
    """Gainless RMSNorm over the last axis, returned in the compute dtype (float32, or float64
    for float64 x): the router's small projections (input queries, gates) stay in it."""
    xc = x.astype(ops.compute_dtype(x.dtype))
    return xc * mx.rsqrt(mx.mean(xc * xc, axis=-1, keepdims=True) + eps)


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

    def memo(self, key, deps: Sequence[mx.array], make: Callable[[], object]):
        """`make()`, kept under `key` while every array of `deps` is the very same object."""
        hit = self._rows.get(key)
        if hit is not None and len(hit[0]) == len(deps) and all(
                a is b for a, b in zip(hit[0], deps)):
            return hit[1]
        value = make()
        self._rows[key] = (tuple(deps), value)
        return value


class FusedKey:
    """A sealed source in the fused-read form (`MlxOps(fused=True)`): the source `x` and its
    normalized key `k = r x`, each `[..., 1, D]` in the compute dtype."""

    __slots__ = ("x", "k")

    def __init__(self, x: mx.array, k: mx.array):
        self.x, self.k = x, k


class FusedRows:
    """Phase-1 results of a fused read, `rows [..., S, W]`: `row(i)` is query i's, of `shape`
    and `dtype` (the schedule takes them with `MlxOps.take`)."""

    __slots__ = ("rows", "shape", "dtype")

    def __init__(self, rows: mx.array, shape, dtype):
        self.rows, self.shape, self.dtype = rows, tuple(shape), dtype

    def row(self, i: int) -> mx.array:
        return _from_row(self.rows[..., i:i + 1, :], self.shape).astype(self.dtype)


def _as_row(x: mx.array) -> mx.array:
    """x `[..., D]` as a row `[..., 1, D]`: itself when its second-to-last axis is a unit one."""
    return x if x.ndim >= 2 and x.shape[-2] == 1 else x[..., None, :]


def _from_row(y: mx.array, shape) -> mx.array:
    """A row result back in its source's `shape` (no node when it already has it)."""
    return y if tuple(y.shape) == tuple(shape) else y.reshape(shape)


def fusable(config: ResidualConfig, embedding: mx.array, num_layers: int) -> bool:
    """Whether a pass of `config` over `num_layers` sublayers from `embedding [..., D]` takes
    the fused reads: on the CPU device, float16/bfloat16/float32 sources (float32 compute),
    softmax or sigmoid with the key norm, one head, static queries without a key projection,
    and at most `compiled.VECTOR_MAX_ELEMENTS` elements in the largest read's sources; never
    under `dispatch.use_impl(...)`, whose forced implementation serves every read."""
    return (config.is_attention and config.key_norm and config.num_heads == 1
            and config.query == "static" and config.key_rank is None
            and embedding.dtype in (mx.float16, mx.bfloat16, mx.float32)
            and (num_layers + 1) * embedding.size <= compiled.VECTOR_MAX_ELEMENTS
            and mx.default_device() == mx.cpu
            and dispatch._REGISTRY.forced() is None)  # use_impl(...) forces the spec's ops


@functools.lru_cache(maxsize=None)
def _key_fn(eps: float):
    """`k = r x` of a row x `[..., 1, D]` (float32), r = 1 / sqrt(mean(x^2) + eps) from a
    float64 sum of squares, one compiled function (a few fused nodes, eager too)."""
    def key(xr):
        # |x| squared: the same bits as x^2, in a fused node of its own (not sharing the
        # product's float64 cast of x, which would be a node of its own)
        ms = mx.mean(mx.square(mx.abs(xr).astype(mx.float64)), axis=-1, keepdims=True)
        return (xr * mx.rsqrt(ms + eps)).astype(mx.float32)
    return mx.compile(key)


@functools.lru_cache(maxsize=None)
def _read_fn(activation: str):
    """(out = p X `[..., 1, D]`, p `[..., 1, N]`) from qg `[..., 1, D]`, K and X `[..., N, D]`:
    z = qg K^T, p = softmax(z) or sigmoid(z)."""
    def read(qg, K, X):
        z = qg @ K.swapaxes(-1, -2)
        p = mx.softmax(z, axis=-1) if activation == "softmax" else ops.sigmoid(z)
        return p @ X, p
    return mx.compile(read)


@functools.lru_cache(maxsize=None)
def _merge_fn(eps: float):
    """Phase 2 (spec 3.2): out1 `[..., D]`, lse1 `[..., 1]`, the partial `[..., D]` and its row
    view `[..., 1, D]`, qg `[..., D, 1]`: z2 = r <qg, partial> (r from a float64 sum of squares),
    w1 = sigmoid(lse1 - z2), w2 = sigmoid(z2 - lse1) (C10.7), out = w1 out1 + w2 partial."""
    def merge(out1, lse1, partial, row, qg):
        s = row.astype(mx.float32) @ qg  # <qg, partial> [..., 1, 1]
        s = s if s.shape == lse1.shape else s.reshape(lse1.shape)
        ms = mx.mean(mx.square(partial.astype(mx.float64)), axis=-1, keepdims=True)
        z2 = (s * mx.rsqrt(ms + eps)).astype(mx.float32)
        l1 = lse1.astype(mx.float32)
        w1, w2 = ops.sigmoid(l1 - z2), ops.sigmoid(z2 - l1)
        out = w1 * out1.astype(mx.float32) + w2 * partial.astype(mx.float32)
        return out.astype(partial.dtype)
    return mx.compile(merge)


class MlxOps(ResidualOps):
    """MLX's `ResidualOps` for the shared schedule (`attnres_core.schedule`).

    Every sealed source (the embedding, each layer output, each completed block) gets its
    statistics once (`source_stats`), reused by every later read: its inverse RMS (`inv_rms=`
    of the ops; small reads take the stacked form, `_stacked`), or with `fused` its
    `FusedKey` (the fused reads of the module docstring; then phase 1 returns `FusedRows`, taken
    with `take`).  Small projections (input queries, gates) stay in the compute dtype (C10);
    `mul` returns the value's dtype, so the stream keeps the embedding's dtype.
    """

    def __init__(self, params=None, rows: Optional["RowCache"] = None, *, fused: bool = False):
        super().__init__(params)
        # The sealed sources stacked so far in this pass: (their list, X `[n, ..., D]`,
        # R `[n, ..., H]`); the list holds them, so identity comparison is safe.  Fused reads:
        # (their `FusedKey` list, K `[..., n, D]`, X `[..., n, D]`).
        self._stack = ([], None, None)
        self._rows = rows
        self.fused = fused
        self._row_of = {}  # id(row handed out by `param`) -> (row, name, index)
        self._qg = {}  # fused reads: (scale, lead) -> this pass's `_qg_table`

    def param(self, name, index, *, like=None):
        p = self.params.get(name)
        if p is None or self._rows is None or type(index) is not int:
            row = super().param(name, index, like=like)
        else:
            row = self._rows.get(name, p, index)
            row = row if like is None else self.cast_like(row, like)
        if self.fused and like is None and name in ("queries", "norm_weights") and row is not None:
            self._row_of[id(row)] = (row, name, index)
        return row

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
        if self.fused:
            return self._fused_key(value, config)
        return ops.inverse_rms(value, eps=config.eps, num_heads=config.num_heads)

    # -- fused reads (module docstring) ----------------------------------------------------
    # Every source is a row `[..., 1, D]`: its own unit axis when it has one (a T = 1 decode
    # token), else a new one.  r = 1 / sqrt(mean(x^2) + eps) comes from a float64 sum of
    # squares: overflow-safe for every finite float32 source (C10.6), and its gradient too.

    def _fused_key(self, x, config) -> FusedKey:
        xr = _as_row(x).astype(mx.float32)
        return FusedKey(xr, _key_fn(float(config.eps))(xr))

    def _fused_stack(self, keys):
        """(K, X) `[..., n, D]` of the sealed sources' keys, grown from the pass's stack."""
        known, K, X = self._stack
        m = len(known)
        if m > len(keys) or any(a is not b for a, b in zip(known, keys)):
            m, K, X = 0, None, None
        if m < len(keys):
            new = keys[m:]
            ks, xs = [k.k for k in new], [k.x for k in new]
            if K is not None:
                ks, xs = [K] + ks, [X] + xs
            K = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=-2)
            X = xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=-2)
            self._stack = (list(keys), K, X)
        return K, X

    def _row_index(self, query, gain):
        """The row index `param` handed out for (query, gain), or None."""
        a = self._row_of.get(id(query))
        b = self._row_of.get(id(gain))
        if (a is None or b is None or a[0] is not query or b[0] is not gain
                or a[1] != "queries" or b[1] != "norm_weights" or a[2] != b[2]):
            return None
        return a[2]

    def _fused_qg(self, query, gain, config, lead, *, column=False):
        """qg = query * gain * scale in float32 as rows `[*lead, S, D]` (S = 1 for one query),
        or with `column` one column `[*lead, D, 1]`.  Parameter rows are cut from one table
        `[*lead, R, D]` of all rows, formed once per pass and kept, with the rows cut from it,
        between passes while the parameters are the same arrays (eager decode: no graph node)."""
        index = self._row_index(query, gain)
        if index is None:  # not a parameter row (e.g. an array call scale multiplied it)
            qg = query.astype(mx.float32) * config.scale
            if gain is not None:
                qg = qg * gain.astype(mx.float32)
            qg = qg.reshape((-1, qg.shape[-1]))
            qg = mx.broadcast_to(qg, tuple(lead) + qg.shape)
            return qg.swapaxes(-1, -2) if column else qg
        table = self._qg_table(float(config.scale), tuple(lead))
        key = (column, index) if type(index) is int else (column, index.start, index.stop,
                                                          index.step)
        rows = table.get(key)
        if rows is None:
            QG = table["QG"]
            if column:
                QT = table.get("QT")
                if QT is None:
                    QT = table["QT"] = QG.swapaxes(-1, -2)
                rows = QT[..., index:index + 1]
            else:
                rows = QG[..., index:index + 1, :] if type(index) is int else QG[..., index, :]
            table[key] = rows
        return rows

    def _qg_table(self, scale: float, lead: tuple) -> dict:
        """{"QG": `[*lead, R, D]`, and the rows cut from it so far} of this pass."""
        entry = self._qg.get((scale, lead))
        if entry is None:
            q, g = self.params["queries"], self.params["norm_weights"]

            def make():
                qg = (q.astype(mx.float32) * g.astype(mx.float32)) * scale
                return {"QG": mx.broadcast_to(qg, lead + qg.shape)}

            entry = make() if self._rows is None else self._rows.memo(("qg", scale, lead),
                                                                      (q, g), make)
            self._qg[scale, lead] = entry
        return entry

    def _fused_read(self, sources, stats, query, gain, config, return_weights, out_norm_weight):
        x0 = sources[0]
        k = len(sources) - (stats[-1] is None)
        K, X = self._fused_stack(stats[:k])
        if k < len(sources):  # the running partial sum: its key for this read only
            pk = self._fused_key(sources[-1], config)
            K = pk.k if K is None else mx.concatenate([K, pk.k], axis=-2)
            X = pk.x if X is None else mx.concatenate([X, pk.x], axis=-2)
        qg = self._fused_qg(query, gain, config, K.shape[:-2])  # [..., 1, D]
        y, p = _read_fn(config.activation)(qg, K, X)  # [..., 1, D] float32, [..., 1, N]
        result = [_from_row(y, x0.shape).astype(x0.dtype)]
        if out_norm_weight is not None:  # C17 from y in float32, rho from a float64 sum
            ms = mx.mean(mx.square(y.astype(mx.float64)), axis=-1, keepdims=True)
            normed = (y * mx.rsqrt(ms + config.eps)).astype(mx.float32)
            normed = normed * out_norm_weight.astype(mx.float32)
            result.append(_from_row(normed, x0.shape).astype(x0.dtype))
        if return_weights:  # [N, ...], not differentiable (C11)
            w = mx.moveaxis(p.reshape(x0.shape[:-1] + (p.shape[-1],)), -1, 0)
            result.append(mx.stop_gradient(w))
        return tuple(result) if len(result) > 1 else result[0]

    def _fused_multi(self, sources, stats, queries, gains, config):
        x0 = sources[0]
        K, X = self._fused_stack(list(stats))
        qg = self._fused_qg(queries, gains, config, K.shape[:-2])  # [..., S, D]
        z = qg @ K.swapaxes(-1, -2)  # [..., S, n]
        lse = mx.logsumexp(z, axis=-1, keepdims=True)  # [..., S, 1]
        out = mx.softmax(z, axis=-1) @ X  # [..., S, D]
        return (FusedRows(out, x0.shape, x0.dtype),
                FusedRows(lse, x0.shape[:-1] + (1,), mx.float32))

    def _fused_merge(self, out1, lse1, partial, query, gain, config):
        """Phase 2 (spec 3.2) with w1 = sigmoid(lse1 - z2), w2 = sigmoid(z2 - lse1) (C10.7):
        out1 `[..., D]`, lse1 `[..., 1]` (`FusedRows.row`), partial `[..., D]`."""
        pr = _as_row(partial)
        qg = self._fused_qg(query, gain, config, pr.shape[:-2], column=True)  # [..., D, 1]
        return _merge_fn(float(config.eps))(out1, lse1, partial, pr, qg)

    def take(self, x, i):
        return x.row(i) if isinstance(x, FusedRows) else x[i]

    def rmsnorm_gain(self, x, weight, eps):
        """M15 composed: `rmsnorm(x) * weight` in the compute dtype, rounded once (C10)."""
        normed = rmsnorm(x, eps)
        return (normed * weight.astype(normed.dtype)).astype(x.dtype)

    def depth_attention(self, sources, stats, query, norm_weight, config, *, return_weights,
                        out_norm_weight=None):
        if self.fused:
            result = self._fused_read(sources, stats, query, norm_weight, config,
                                      return_weights, out_norm_weight)
            return split_result(result, out_norm_weight, return_weights)
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
        if self.fused:
            return self._fused_multi(sources, stats, queries, norm_weights, config)
        return ops.depth_attention_multi(list(sources), queries, norm_weights, eps=config.eps,
                                         scale=config.scale, inv_rms=list(stats))

    def merge_partial(self, out1, lse1, partial, query, norm_weight, config):
        if self.fused:
            return self._fused_merge(out1, lse1, partial, query, norm_weight, config)
        return ops.merge_partial(out1, lse1, partial, query, norm_weight, eps=config.eps,
                                 scale=config.scale)
