"""The Pallas implementation: `Pallas` (its support check, its tile choice and its VJP entry
points for the registry `attnres_jax.dispatch`) and the Pallas kernels of the single-head ops
(spec 2-3) it runs, one token tile per program.

Path of a call: `ops` (validation) -> `dispatch` (the choice and the custom VJP) -> this module
(`Pallas.forward` -> `forward` -> `pallas_call`).  It shares the query side and the numerics with
the XLA implementation through `_math`, and never imports it: phase 1's backward and merge's
backward have no kernel here (`Pallas.phase1_backward` / `merge_backward` are None), and the
registry runs the XLA rules on the residuals these forwards save (the same as XLA's forward).

Platforms: compiled kernels run on GPU (Triton-lowered Pallas, D a power of two) and TPU
(Mosaic) in float32 compute (C10: not for float64 sources); the interpreters
(`interpret="generic"`: `pallas_call(interpret=True)`, `"tpu"`: JAX's TPU interpreter
`pltpu.InterpretParams`) run anywhere, float64 included.  The tests run the kernels in both
interpreters; `bench/kernel_report.py` lowers every kernel for TPU and, abstractly (no device),
for an H200, and compiles the Triton lowering for sm_90 with the Triton wheel's ptxas.

Layout: every source is a `[T, D]` array (tokens flattened, never stacked); the grid runs over
token tiles of TB rows, each program holding full rows `[TB, D]` (one tile of every source).
A kernel's per-token statistics (lse, r_i, s_i, ...) travel packed in ONE `[T, K]` array (block
`(TB, K)`), one statistic per column as its `Columns` layout says, K the count padded up to a
power of two, pad columns written as zeros.  Why packed: on TPU a 2-D f32 array is laid out in
(8, 128) tiles with the last dim on the 128 lanes, so a `[T, 1]` column is padded 128x in HBM
and VMEM (4 MiB at T = 8192 for 32 KiB of data), and the forward has 1 + 2N statistics, phase
1 S + N + N S, the backward's inputs 1 + 3N.  Packed, K <= 128 columns cost what one column does.
Every block shape is (TB or 1) x (D or K or 1): legal for Mosaic (full last dim) and for Triton
(powers of two where `Pallas.supports` checks D; K is one).  In the kernel a column is put into
the `[TB, K]` tile by a select on a lane iota and read back by a select and a lane sum (`_put`,
`_get`), the tile moving as one full block: only ops every kernel here already lowers (lane
broadcast, iota, select, lane reduction, full-block load and store).  The host lowerings of
Mosaic and Triton also accept width-1 ref slices (`ref[:, j:j + 1]`), but Mosaic's layout
passes (a store at lane offset j needs a lane shift and a masked store) run only in libtpu,
which no host check here reaches.  Every kernel computes in `ct`, the compute dtype its caller
derives with `_args.compute_dtype` (C10: float32; float64 for float64 sources, interpreters
only); outputs are written in their final dtype (one cast).

Poisoning: with `poison=True` each output is aliased to a NaN-filled input
(`input_output_aliases`), so an element the kernel never writes reads back as NaN.  `CALLS`
counts the `pallas_call`s built, by kernel name, when traced (the tests' proof that a kernel
ran); which implementation served each op call is the registry's `last_choice` / `impl_counts`.

Kernels:
  forward   single pass over the N sources with an online softmax (running max m, sum l and
            accumulator acc [TB, D]); writes out and the statistics lse, r_i, s_i (packed); with
            the fused output norm (C17, "attnres_forward_normed") also out_normed, from acc.
  backward  from d_lse and the residual weights and statistics p_i, r_i, s_i (packed by the
            caller, one XLA concatenate); two passes over the tile's
            sources (dp_i = <g, x_i>, then dx_i); the pseudo-query gradient is written as one
            partial sum per tile (`[tiles, D]`, summed afterwards): no atomics anywhere.  With
            the output norm ("attnres_backward_normed") a first pass over the tile recomputes
            out = sum_i p_i x_i and adds the C17 d_y to g; d_out_norm_weight is one partial per
            tile like the pseudo-query's.
  phase1    S pseudo-queries at once: each source tile is read once and feeds S online softmaxes.
  merge     phase 2: out = w1 * out1 + (1 - w1) * partial, w1 = sigmoid(lse1 - z2).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._args import MergeOptions, Options, Request, compute_dtype
from .._math import Query, inv_rms, merge_weights, tile_sets

#: Spy: kernel name -> number of `pallas_call`s built (counted when traced, in `_call`).
CALLS: collections.Counter = collections.Counter()


def _rows(tb: int, width: int):
    """BlockSpec of a `[T, width]` array: tile t holds rows t*TB .. t*TB + TB - 1, all columns."""
    return pl.BlockSpec((tb, width), lambda t: (t, 0))


def _whole(shape):
    """BlockSpec of a small array every program reads whole (pseudo-queries `[S, D]`)."""
    return pl.BlockSpec(shape, lambda t: (0,) * len(shape))


def _call(body, name: str, inputs: Sequence, in_specs: Sequence, out_shapes: Sequence, out_specs: Sequence,
          tokens: int, tb: int, *, interpret, poison: bool, compiler_params=None):
    """pallas_call over `cdiv(tokens, TB)` tiles; `body(in_refs, out_refs)`.  No tokens: empty
    outputs (every output has a token axis), no kernel (a `[TB, D]` block of a `[0, D]` input
    cannot be sliced)."""
    if tokens == 0:
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]
    n_in, n_out = len(inputs), len(out_shapes)
    aliases = {}
    inputs, in_specs = list(inputs), list(in_specs)
    if poison:
        for j, (shape, spec) in enumerate(zip(out_shapes, out_specs)):
            aliases[len(inputs)] = j
            inputs.append(jnp.full(shape.shape, jnp.nan, shape.dtype))
            in_specs.append(spec)

    def kernel(*refs):
        body(refs[:n_in], refs[len(refs) - n_out:])

    CALLS[name] += 1

    return pl.pallas_call(kernel, out_shape=list(out_shapes), grid=(pl.cdiv(tokens, tb),), in_specs=in_specs,
                          out_specs=list(out_specs), input_output_aliases=aliases, interpret=interpret,
                          compiler_params=compiler_params, name=name)(*inputs)


@dataclasses.dataclass(frozen=True)
class Columns:
    """Column layout of a kernel's packed statistics, one `[T, K]` array: named groups of
    consecutive columns in order, e.g. (("lse", 1), ("r", N), ("s", N)) puts lse in column 0,
    r_i in column 1 + i, s_i in column 1 + N + i; K = `width`, the total padded up to a power of
    two (Triton blocks), the pad columns zeros."""

    groups: Tuple[Tuple[str, int], ...]

    def col(self, name: str, i: int = 0) -> int:
        """The column of statistic `name`, member i of its group."""
        start = 0
        for group, count in self.groups:
            if group == name:
                if not 0 <= i < count:
                    raise IndexError(f"{name}[{i}]: the group has {count} columns")
                return start + i
            start += count
        raise KeyError(name)

    @property
    def used(self) -> int:
        return sum(count for _, count in self.groups)

    @property
    def width(self) -> int:
        """K: the columns used, padded up to a power of two."""
        return 1 << max(0, self.used - 1).bit_length()

    def pack(self, dtype, parts: Dict[str, "jax.Array"]):
        """XLA side: parts name -> `[T, count]` -> `[T, K]` in dtype, pad columns zero (one
        concatenate)."""
        pieces = [parts[name].astype(dtype) for name, count in self.groups if count]
        tokens = pieces[0].shape[0]
        return jnp.concatenate(pieces + [jnp.zeros((tokens, self.width - self.used), dtype)], axis=1)

    def unpack(self, packed) -> Dict[str, "jax.Array"]:
        """XLA side: `[T, K]` -> name -> `[T, count]` (its columns, in group order)."""
        return {name: packed[:, self.col(name):self.col(name) + count] for name, count in self.groups if count}


def forward_columns(n: int, softmax: bool) -> Columns:
    """The forward's statistics: lse (softmax only), r_i, s_i for the N sources."""
    return Columns((("lse", int(softmax)), ("r", n), ("s", n)))


def backward_columns(n: int, softmax: bool) -> Columns:
    """The backward's inputs: d_lse (softmax only), then the weights p_i and statistics r_i, s_i."""
    return Columns((("d_lse", int(softmax)), ("p", n), ("r", n), ("s", n)))


def phase1_columns(n: int, sets: int) -> Columns:
    """Phase 1's statistics: lse_k (S), r_i (N), s_ik (N x S, row-major: column of s[i * S + k])."""
    return Columns((("lse", sets), ("r", n), ("s", n * sets)))


#: The merge's statistics: lse, r, s and the weight w1 of out1.
MERGE_COLUMNS = Columns((("lse", 1), ("r", 1), ("s", 1), ("w1", 1)))


def _put(tile, j: int, value):
    """tile `[TB, K]` with column j replaced by value `[TB, 1]` (a lane broadcast and a select)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    return jnp.where(lane == j, value.astype(tile.dtype), tile)


def _get(tile, j: int):
    """Column j `[TB, 1]` of a tile `[TB, K]`: a select and a lane sum, exact (x + 0 = x)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    return jnp.sum(jnp.where(lane == j, tile, 0), axis=1, keepdims=True)


def _rms(x, eps: float):
    """r [TB, 1] of a tile x [TB, D]: `_math.inv_rms`, overflow-safe (C10.6)."""
    return inv_rms(x, lambda v: jnp.sum(v, axis=1, keepdims=True), x.shape[1], eps)


def _key(x, qg, eps: float, key_norm: bool):
    """Tile statistics: x [TB, D], qg [1 or TB, D] -> r, s [TB, 1] (r = 1 without key norm)."""
    r = _rms(x, eps) if key_norm else jnp.ones_like(x[:, :1])
    return r, jnp.sum(x * qg, axis=1, keepdims=True)


# -- forward ---------------------------------------------------------------------------------------


def forward(xs, qg, *, per_token, eps, scale, softmax, key_norm, tb, ct, interpret, poison, compiler_params=None,
            out_norm_weight=None, out_norm_eps=None):
    """xs: N x `[T, D]`; qg `[1, D]` (pseudo) or `[T, D]` (per token), compute dtype;
    out_norm_weight `[1, D]` (compute dtype) or None: the fused output norm (C17, eps out_norm_eps).
    Returns out `[T, D]` (sources' dtype), the statistics `[T, K]` (compute dtype; columns
    `forward_columns(N, softmax)`: lse if softmax, r_i, s_i), and out_normed `[T, D]` (sources'
    dtype; None without out_norm_weight)."""
    n, (t, d) = len(xs), xs[0].shape
    normed = out_norm_weight is not None
    columns = forward_columns(n, softmax)

    def body(ins, outs):
        q = ins[n][...].astype(ct)
        out_ref, stats_ref = outs[0], outs[-1]
        stats = jnp.zeros(stats_ref.shape, ct)  # the [TB, K] tile, stored once at the end
        m = l = acc = None
        for i in range(n):  # static unroll over the sources: each tile read once
            x = ins[i][...].astype(ct)
            r, s = _key(x, q, eps, key_norm)
            stats = _put(_put(stats, columns.col("r", i), r), columns.col("s", i), s)
            z = scale * r * s
            if not softmax:
                acc = jax.nn.sigmoid(z) * x if acc is None else acc + jax.nn.sigmoid(z) * x
            elif m is None:  # online softmax state starts at the first source
                m, l, acc = z, jnp.ones_like(z), x
            else:
                m_new = jnp.maximum(m, z)
                alpha, e = jnp.exp(m - m_new), jnp.exp(z - m_new)
                m, l, acc = m_new, alpha * l + e, alpha * acc + e * x
        y = acc / l if softmax else acc  # out in the compute dtype, before its one cast (C10)
        out_ref[...] = y.astype(out_ref.dtype)
        if normed:  # C17 from the same registers: (rho y) w, rho overflow-safe (C10.6)
            outs[1][...] = ((_rms(y, out_norm_eps) * y) * ins[n + 1][...]).astype(outs[1].dtype)
        if softmax:
            stats = _put(stats, columns.col("lse"), m + jnp.log(l))
        stats_ref[...] = stats  # every column, pads included (zeros)

    big = jax.ShapeDtypeStruct((t, d), xs[0].dtype)
    out_shapes = [big] * (1 + normed) + [jax.ShapeDtypeStruct((t, columns.width), ct)]
    q_spec = _rows(tb, d) if per_token else _whole((1, d))
    inputs, in_specs = [*xs, qg], [_rows(tb, d)] * n + [q_spec]
    if normed:
        inputs, in_specs = inputs + [out_norm_weight], in_specs + [_whole((1, d))]
    outs = _call(body, "attnres_forward_normed" if normed else "attnres_forward", inputs, in_specs, out_shapes,
                 [_rows(tb, d)] * (1 + normed) + [_rows(tb, columns.width)], t, tb,
                 interpret=interpret, poison=poison, compiler_params=compiler_params)
    return outs[0], outs[-1], outs[1] if normed else None


# -- backward --------------------------------------------------------------------------------------


def backward(xs, qg, d_out, stats, *, per_token, scale, softmax, key_norm, tb, ct, interpret, poison,
             compiler_params=None, out_norm_weight=None, out_norm_eps=None, d_normed=None):
    """Gradients of `forward` from its residuals.  d_out `[T, D]`; stats `[T, K]` (compute dtype;
    columns `backward_columns(N, softmax)`: d_lse if softmax, the weights p_i, the statistics r_i,
    s_i; `Columns.pack`).  With the fused output norm (C17):
    out_norm_weight `[1, D]` (compute dtype), its eps, d_normed `[T, D]` the cotangent of
    out_normed.  Returns dxs N x `[T, D]` (sources' dtype), dqg: `[tiles, D]` per-tile partial sums
    for a pseudo-query (sum over axis 0), `[T, D]` for a per-token query, and d_out_norm_weight as
    `[tiles, D]` per-tile partial sums (None without the output norm)."""
    n, (t, d) = len(xs), xs[0].shape
    tiles = pl.cdiv(t, tb)
    normed = out_norm_weight is not None
    columns = backward_columns(n, softmax)
    if stats.shape != (t, columns.width):
        raise ValueError(f"stats: expected [T, K] = {(t, columns.width)}, got {stats.shape}")

    def body(ins, outs):
        x_refs, q, g = ins[:n], ins[n][...].astype(ct), ins[n + 1][...].astype(ct)
        tile = ins[n + 2][...]  # [TB, K]: one load, then a column per statistic
        dl = _get(tile, columns.col("d_lse")) if softmax else None
        ps, rs, ss = ([_get(tile, columns.col(name, i)) for i in range(n)] for name in ("p", "r", "s"))

        def valid():  # rows past T (last partial tile) hold garbage: masked before a tile sum
            return pl.program_id(0) * tb + jax.lax.broadcasted_iota(jnp.int32, (tb, 1), 0) < t

        if normed:  # C17 prologue: y recomputed from the tiles this program holds anyway (no extra
            # HBM read; out in the compute dtype, as the forward formed it), then g += d_y
            gn, w = ins[n + 3][...].astype(ct), ins[n + 4][...]
            y = functools.reduce(lambda a, b: a + b, [ps[i] * x_refs[i][...].astype(ct) for i in range(n)])
            rho = _rms(y, out_norm_eps)
            y_hat = rho * y
            a = gn * w
            g = g + rho * (a - y_hat * (jnp.sum(a * y_hat, axis=1, keepdims=True) / d))
            outs[n + 1][...] = jnp.sum(jnp.where(valid(), gn * y_hat, 0.0), axis=0, keepdims=True)
        dps = [jnp.sum(g * x_refs[i][...].astype(ct), axis=1, keepdims=True) for i in range(n)]  # pass 1
        if softmax:
            pdp = functools.reduce(lambda a, b: a + b, [ps[i] * dps[i] for i in range(n)])
        dqg = None
        for i in range(n):  # pass 2: dx_i, and the query gradient contribution c_i r_i x_i
            x, r, s, p = x_refs[i][...].astype(ct), rs[i], ss[i], ps[i]
            dz = p * (dps[i] - pdp) + p * dl if softmax else dps[i] * p * (1.0 - p)
            c = scale * dz
            dx = p * g + c * r * q
            if key_norm:
                dx = dx - ((c * r) * (s * r) / d) * (r * x)  # c s r^3 x: the normalized key r x
                # times factors of order 1, nothing under- or overflows for huge x
            outs[i][...] = dx.astype(outs[i].dtype)
            dqg = c * r * x if dqg is None else dqg + c * r * x
        if per_token:
            outs[n][...] = dqg.astype(outs[n].dtype)
        else:
            outs[n][...] = jnp.sum(jnp.where(valid(), dqg, 0.0), axis=0, keepdims=True).astype(outs[n].dtype)

    inputs = [*xs, qg, d_out, stats]
    in_specs = ([_rows(tb, d)] * n + [_rows(tb, d) if per_token else _whole((1, d)), _rows(tb, d)]
                + [_rows(tb, columns.width)])
    out_shapes = [jax.ShapeDtypeStruct((t, d), x.dtype) for x in xs]
    # pseudo-query: one [1, D] partial per tile, as a [tiles, 1, D] array (block (squeezed, 1, D)).
    out_shapes.append(jax.ShapeDtypeStruct((t, d) if per_token else (tiles, 1, d), ct))
    tile_partial = pl.BlockSpec((None, 1, d), lambda i: (i, 0, 0))
    out_specs = [_rows(tb, d)] * n + [_rows(tb, d) if per_token else tile_partial]
    if normed:  # d_out_norm_weight: one [1, D] partial per tile, like the pseudo-query's
        inputs += [d_normed, out_norm_weight]
        in_specs += [_rows(tb, d), _whole((1, d))]
        out_shapes.append(jax.ShapeDtypeStruct((tiles, 1, d), ct))
        out_specs.append(tile_partial)
    outs = _call(body, "attnres_backward_normed" if normed else "attnres_backward", inputs, in_specs, out_shapes,
                 out_specs, t, tb, interpret=interpret, poison=poison, compiler_params=compiler_params)
    return outs[:n], outs[n] if per_token else outs[n][:, 0], outs[n + 1][:, 0] if normed else None


# -- phase 1 ---------------------------------------------------------------------------------------


def phase1(xs, qg, *, eps, scale, tb, ct, interpret, poison, compiler_params=None):
    """S pseudo-queries over N sources, each source tile read once.  qg `[S, D]` (query * gain).
    Returns outs S x `[T, D]` (sources' dtype) and the statistics `[T, K]` (compute dtype; columns
    `phase1_columns(N, S)`: lse_k, r_i, s_ik row-major)."""
    n, (t, d), sets = len(xs), xs[0].shape, qg.shape[0]
    columns = phase1_columns(n, sets)

    def body(ins, outs):
        q = ins[n][...].astype(ct)  # [S, D]
        out_refs, stats_ref = outs[:sets], outs[sets]
        stats = jnp.zeros(stats_ref.shape, ct)  # the [TB, K] tile, stored once at the end
        state = [None] * sets  # (m, l, acc) per query
        for i in range(n):
            x = ins[i][...].astype(ct)  # one read of source i's tile for all S queries
            r = _rms(x, eps)
            stats = _put(stats, columns.col("r", i), r)
            for k in range(sets):
                s = jnp.sum(x * q[k:k + 1], axis=1, keepdims=True)
                stats = _put(stats, columns.col("s", i * sets + k), s)
                z = scale * r * s
                if state[k] is None:
                    state[k] = (z, jnp.ones_like(z), x)
                else:
                    m, l, acc = state[k]
                    m_new = jnp.maximum(m, z)
                    alpha, e = jnp.exp(m - m_new), jnp.exp(z - m_new)
                    state[k] = (m_new, alpha * l + e, alpha * acc + e * x)
        for k, (m, l, acc) in enumerate(state):
            out_refs[k][...] = (acc / l).astype(out_refs[k].dtype)
            stats = _put(stats, columns.col("lse", k), m + jnp.log(l))
        stats_ref[...] = stats  # every column, pads included (zeros)

    out_shapes = [jax.ShapeDtypeStruct((t, d), xs[0].dtype)] * sets + [jax.ShapeDtypeStruct((t, columns.width), ct)]
    out_specs = [_rows(tb, d)] * sets + [_rows(tb, columns.width)]
    outs = _call(body, "attnres_phase1", [*xs, qg], [_rows(tb, d)] * n + [_whole((sets, d))], out_shapes,
                 out_specs, t, tb, interpret=interpret, poison=poison,
                 compiler_params=compiler_params)
    return outs[:sets], outs[sets]


# -- phase 2 ---------------------------------------------------------------------------------------


def merge(out1, lse1, partial, qg, *, per_token, eps, scale, tb, ct, interpret, poison, compiler_params=None):
    """out1, partial `[T, D]`; lse1 `[T, 1]`; qg `[1, D]` or `[T, D]`.  Returns out `[T, D]`
    (partial's dtype) and the statistics `[T, K]` (compute dtype; columns `MERGE_COLUMNS`: lse, r,
    s, w1)."""
    t, d = partial.shape
    columns = MERGE_COLUMNS

    def body(ins, outs):
        o1, l1, x = ins[0][...].astype(ct), ins[1][...].astype(ct), ins[2][...].astype(ct)
        r, s = _key(x, ins[3][...].astype(ct), eps, True)
        z2 = scale * r * s
        w1, w2 = merge_weights(l1, z2)  # C10.7: each from its own logistic, not 1 - w1
        m = jnp.maximum(l1, z2)
        outs[0][...] = (w1 * o1 + w2 * x).astype(outs[0].dtype)
        stats = jnp.zeros(outs[1].shape, ct)
        for name, value in (("lse", m + jnp.log(jnp.exp(l1 - m) + jnp.exp(z2 - m))), ("r", r), ("s", s), ("w1", w1)):
            stats = _put(stats, columns.col(name), value)
        outs[1][...] = stats  # every column, pads included (zeros)

    out_shapes = [jax.ShapeDtypeStruct((t, d), partial.dtype), jax.ShapeDtypeStruct((t, columns.width), ct)]
    in_specs = [_rows(tb, d), _rows(tb, 1), _rows(tb, d), _rows(tb, d) if per_token else _whole((1, d))]
    return _call(body, "attnres_merge", [out1, lse1, partial, qg], in_specs, out_shapes,
                 [_rows(tb, d), _rows(tb, columns.width)], t, tb, interpret=interpret, poison=poison,
                 compiler_params=compiler_params)


# -- the implementation ------------------------------------------------------------------------------

INTERPRETERS = ("off", "generic", "tpu")


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def _auto_tile(request: Request) -> int:
    """Token rows per program.  TPU: a tile of every source (plus S accumulators, plus out_normed
    or its cotangent with the output norm) within ~4 MiB of fp32 VMEM.  GPU (Triton): the values
    live in registers, so one `[TB, D]` fp32 tile is at most 4096 elements, 8 per thread at
    `_GPU_WARPS` warps (the VMEM rule's larger tiles spill registers in the sm_90 compile;
    `bench/kernel_report.py` reports registers and spills per kernel)."""
    if request.platform == "tpu":
        rows = (1 << 20) // max(1, request.dim * (request.num_sources + request.num_sets + request.out_norm))
        return max(8, min(256, _pow2_floor(rows)))
    return max(1, min(64, _pow2_floor(4096 // max(1, request.dim))))


_GPU_WARPS = 16  # most warps of a Triton-lowered program (512 threads)
_GPU_MAX_DIM = 8192  # widest row the GPU kernels take: wider rows spill in the sm_90 compile
# (`bench/kernel_report.py`, its D = 16384 edge case)


def _gpu_warps(tile: int, dim: int) -> int:
    """Warps for a `[tile, D]` tile: 8 elements per thread, at most `_GPU_WARPS`."""
    return max(1, min(_GPU_WARPS, _pow2_floor(max(1, tile * dim // 256))))


@dataclasses.dataclass(frozen=True)
class Pallas:
    """The Pallas kernels as an implementation of the registry (`attnres_jax.dispatch`).
    Hashable: a static argument of the custom VJPs, so a traced call is keyed by the interpreter,
    tile and poison."""

    name = "pallas"

    interpret: str = "off"  # one of INTERPRETERS
    tile: Optional[int] = None  # TB token rows per program (None: chosen by `resolve`)
    num_warps: Optional[int] = None  # compiled GPU (Triton) kernels: warps (None: `resolve`)
    poison: bool = False  # alias every output to a NaN-filled input (tests: unwritten -> NaN)
    platform: Optional[str] = None  # "gpu" / "tpu": picks the lowering's compiler params

    def __post_init__(self):
        if self.interpret not in INTERPRETERS:
            raise ValueError(f"interpret: expected one of {INTERPRETERS}, got {self.interpret!r}")

    @staticmethod
    def unavailable(platform: str) -> Optional[str]:
        """None if compiled kernels can run on `platform` ("cpu", "gpu", "tpu"), else why not."""
        if platform not in ("gpu", "tpu"):
            return (f"no compiled Pallas kernels on platform {platform!r}: Pallas compiles for gpu/tpu "
                    f"only (interpret mode via use_impl)")
        return None

    def supports(self, request: Request) -> Optional[str]:
        """None if the kernels run this call, else why not."""
        if request.num_heads != 1:
            return "the kernels have one head (num_heads=1)"
        if request.masked:
            return "a masked read (num_valid) runs on XLA only"
        if self.interpret != "off":
            return None
        reason = self.unavailable(request.platform)
        if reason is not None:
            return reason
        if compute_dtype(request.dtype) != jnp.float32:
            return f"compiled kernels compute in float32; {request.dtype} sources compute in float64 (C10)"
        if request.platform == "gpu" and request.dim & (request.dim - 1):
            return f"Triton blocks must be powers of two (D = {request.dim})"
        if request.platform == "gpu" and request.num_sets > 1:
            return (f"phase 1 ({request.num_sets} query sets) does not lower for Triton (no slice "
                    f"primitive for the query rows)")
        if request.platform == "gpu" and request.dim > _GPU_MAX_DIM:
            return (f"a row of D = {request.dim} > {_GPU_MAX_DIM} does not fit a Triton program's "
                    f"registers (the sm_90 compile spills)")
        return None

    def resolve(self, request: Request) -> "Pallas":
        """This implementation with the tile fixed for the call."""
        tile = self.tile or (8 if self.interpret != "off" else _auto_tile(request))
        warps = self.num_warps
        if warps is None and self.interpret == "off" and request.platform == "gpu":
            warps = _gpu_warps(tile, request.dim)
        return dataclasses.replace(self, tile=tile, platform=request.platform, num_warps=warps)

    # -- entry points (each calls the module-level kernel of the same name) --------------------

    def kernel_options(self, ct) -> dict:
        """The keyword arguments every entry point passes to the kernels (`forward`, `backward`,
        `phase1`, `merge`) for compute dtype `ct`: tile, interpreter, poisoning, compiler params."""
        interpret = {"off": False, "generic": True}.get(self.interpret)
        if interpret is None:
            from jax.experimental.pallas import tpu as pltpu

            interpret = pltpu.InterpretParams()
        params = None
        if interpret is False and self.platform == "gpu":  # Triton, not JAX's default Mosaic GPU
            from jax.experimental.pallas import triton as pltriton

            params = (pltriton.CompilerParams() if self.num_warps is None
                      else pltriton.CompilerParams(num_warps=self.num_warps))
        elif interpret is False and self.platform == "tpu":
            from jax.experimental.pallas import tpu as pltpu

            # The one grid axis walks token tiles, and every output block is the tile's own
            # (rows, or a per-tile partial summed outside): the programs are independent, so
            # Mosaic may split the axis over a megacore chip's two TensorCores.
            params = pltpu.CompilerParams(dimension_semantics=("parallel",))
        return dict(tb=self.tile, ct=ct, interpret=interpret, poison=self.poison, compiler_params=params)

    def forward(self, xs: list, qs: Query, opts: Options, ct):
        """XLA's `forward` for S = 1 on the forward kernel: out `[1, ..., D]` (sources' dtype),
        lse `[..., 1]` or None, p, r, s `[N, ..., 1]`."""
        tokens, dim = xs[0].shape[:-1], xs[0].shape[-1]
        softmax = opts.activation == "softmax"
        out, stats, _ = forward([x.reshape(-1, dim) for x in xs], qs.qg.reshape(-1, dim), per_token=qs.qm is None,
                                eps=opts.eps, scale=opts.scale, softmax=softmax, key_norm=opts.key_norm,
                                **self.kernel_options(ct))
        out = out.reshape((1,) + tokens + (dim,))
        return (out,) + self._forward_stats(stats, len(xs), softmax, tokens, opts)

    def _forward_stats(self, stats, n: int, softmax: bool, tokens, opts: Options):
        """The forward kernel's statistics `[T, K]` -> lse `[..., 1]` or None, p, r, s `[N, ..., 1]`."""
        cols = forward_columns(n, softmax).unpack(stats)
        lse = cols["lse"].reshape(tokens + (1,)) if softmax else None
        r, s = (cols[name].T.reshape((n,) + tokens + (1,)) for name in ("r", "s"))
        return (lse,) + self._weights(r, s, lse, opts, 1)

    def forward_normed(self, xs: list, qs: Query, opts: Options, ct, w):
        """XLA's `forward_normed` on the forward kernel (out_normed from the tile's accumulator, C17):
        as `forward`, then out_normed `[1, ..., D]` (sources' dtype) and nothing saved (the
        backward kernel recomputes out from the tiles it reads anyway)."""
        tokens, dim = xs[0].shape[:-1], xs[0].shape[-1]
        softmax = opts.activation == "softmax"
        out, stats, normed = forward(
            [x.reshape(-1, dim) for x in xs], qs.qg.reshape(-1, dim), per_token=qs.qm is None, eps=opts.eps,
            scale=opts.scale, softmax=softmax, key_norm=opts.key_norm, out_norm_weight=w.reshape(1, dim),
            out_norm_eps=opts.out_norm_eps, **self.kernel_options(ct))
        shape = (1,) + tokens + (dim,)
        return ((out.reshape(shape),) + self._forward_stats(stats, len(xs), softmax, tokens, opts)
                + (normed.reshape(shape), None))

    def phase1(self, xs: list, qs: Query, opts: Options, ct):
        """XLA's `forward` for S pseudo-queries on the phase-1 kernel (each source tile read once):
        out `[S, ..., D]`, lse `[..., S]`, p, s `[N, ..., S]`, r `[N, ..., 1]`."""
        tokens, dim, n, sets = xs[0].shape[:-1], xs[0].shape[-1], len(xs), qs.num_sets
        outs, stats = phase1([x.reshape(-1, dim) for x in xs], qs.qg, eps=opts.eps, scale=opts.scale,
                             **self.kernel_options(ct))
        cols = phase1_columns(n, sets).unpack(stats)
        out = jnp.stack(outs).reshape((sets,) + tokens + (dim,))
        lse = cols["lse"].reshape(tokens + (sets,))
        r = cols["r"].T.reshape((n,) + tokens + (1,))
        s = cols["s"].reshape((-1, n, sets)).transpose(1, 0, 2).reshape((n,) + tokens + (sets,))
        return (out, lse) + self._weights(r, s, lse, opts, sets)

    @staticmethod
    def _weights(r, s, lse, opts: Options, sets: int):
        """p `[N, ..., S]` from the kernels' statistics r `[N, ..., 1]`, s `[N, ..., S]` (and lse
        `[..., S]`, None for sigmoid), then r and s."""
        z = opts.scale * tile_sets(r, sets) * s
        p = jax.nn.sigmoid(z) if lse is None else jnp.exp(z - lse[None])
        return p, r, s

    def backward(self, xs: list, qs: Query, opts: Options, ct, d_out, d_lse, p, r, s):
        """XLA's `backward` for S = 1 on the backward kernel; d_out `[1, ..., D]`."""
        return self._backward(xs, qs, opts, ct, d_out, d_lse, p, r, s)[:2]

    def backward_normed(self, xs: list, qs: Query, opts: Options, ct, d_out, d_lse, p, r, s, w, d_normed,
                        saved):
        """XLA's `backward_normed` on the backward kernel, its C17 prologue fused in (out recomputed
        in the kernel; `saved` is None).  Returns d_sources, dqg and d_out_norm_weight `[D]`."""
        return self._backward(xs, qs, opts, ct, d_out, d_lse, p, r, s,
                              dict(out_norm_weight=w.reshape(1, -1), out_norm_eps=opts.out_norm_eps,
                                   d_normed=d_normed[0].reshape(-1, xs[0].shape[-1])))

    @staticmethod
    def _backward_stats(ct, softmax: bool, d_lse, p, r, s):
        """The backward kernel's input `[T, K]` (`backward_columns`) from d_lse `[..., 1]`
        or None (zeros) and p, r, s `[N, ..., 1]`: one concatenate."""
        rows = lambda a: a.reshape(a.shape[0], -1).T  # [N, ..., 1] -> [T, N]
        parts = dict(p=rows(p), r=rows(r), s=rows(s))
        if softmax:
            parts["d_lse"] = jnp.zeros((parts["p"].shape[0], 1), ct) if d_lse is None else d_lse.reshape(-1, 1)
        return backward_columns(p.shape[0], softmax).pack(ct, parts)

    def _backward(self, xs, qs, opts, ct, d_out, d_lse, p, r, s, normed=None):
        dim = xs[0].shape[-1]
        per_token, softmax = qs.qm is None, opts.activation == "softmax"
        dxs, dqg, d_w = backward(
            [x.reshape(-1, dim) for x in xs], qs.qg.reshape(-1, dim), d_out[0].reshape(-1, dim),
            self._backward_stats(ct, softmax, d_lse, p, r, s), per_token=per_token, scale=opts.scale,
            softmax=softmax, key_norm=opts.key_norm, **(normed or {}), **self.kernel_options(ct))
        d_sources = [dx.reshape(x.shape) for dx, x in zip(dxs, xs)]
        d_w = None if d_w is None else jnp.sum(d_w, axis=0)  # per-tile partials, in tile order
        if per_token:
            return d_sources, dqg.reshape(qs.q.shape), d_w
        return d_sources, jnp.sum(dqg, axis=0, keepdims=True), d_w  # per-tile partials, in tile order

    #: No phase-1 backward kernel: the registry runs XLA's rule on phase 1's residuals.
    phase1_backward = None

    def merge(self, opts: MergeOptions, out1, lse1, partial, query, norm_weight, ct):
        """XLA's `merge` on the merge kernel: out `[..., D]` (partial's dtype), lse, r, s, w1 `[...]`."""
        tokens, dim = partial.shape[:-1], partial.shape[-1]
        qg = query.astype(ct).reshape(-1, dim)
        if norm_weight is not None:
            qg = qg * norm_weight.astype(ct)
        out, stats = merge(out1.reshape(-1, dim), lse1.reshape(-1, 1), partial.reshape(-1, dim), qg,
                           per_token=query.ndim > 1, eps=opts.eps, scale=opts.scale, **self.kernel_options(ct))
        cols = MERGE_COLUMNS.unpack(stats)
        return (out.reshape(partial.shape),) + tuple(cols[name].reshape(tokens) for name in ("lse", "r", "s", "w1"))

    #: No merge backward kernel: the registry runs XLA's rule (the merge kernel saves XLA's residuals).
    merge_backward = None
