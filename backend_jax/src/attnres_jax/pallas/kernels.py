"""Pallas kernels of the single-head ops (spec 2-3), one token tile per program.

Layout: every source is a `[T, D]` array (tokens flattened, never stacked); the grid runs over
token tiles of TB rows, each program holding full rows `[TB, D]` (one tile of every source).
Per-token statistics travel as one `[T, 1]` array per source (block `(TB, 1)`), so every block
shape is (TB or 1) x (D or 1): legal for Mosaic (full last dim) and for Triton (powers of two
where `Pallas.supports` checks D).  Every kernel computes in `ct`, the compute dtype its caller
derives with `_args.compute_dtype` (C10: float32; float64 for float64 sources, interpreters
only); outputs are written in their final dtype (one cast).

Poisoning: with `poison=True` each output is aliased to a NaN-filled input
(`input_output_aliases`), so an element the kernel never writes reads back as NaN.

Kernels:
  forward   single pass over the N sources with an online softmax (running max m, sum l and
            accumulator acc [TB, D]); writes out, lse and the residual statistics r_i, s_i; with
            the fused output norm (C17, "attnres_forward_normed") also out_normed, from acc.
  backward  from the residual weights and statistics p_i, r_i, s_i; two passes over the tile's
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
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._xla import inv_rms, merge_weights

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


def _rms(x, eps: float):
    """r [TB, 1] of a tile x [TB, D]: `_xla.inv_rms`, overflow-safe (C10.6)."""
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
    Returns out `[T, D]` (sources' dtype), lse `[T, 1]` (softmax; else None), r, s: N x `[T, 1]`,
    and out_normed `[T, D]` (sources' dtype; None without out_norm_weight)."""
    n, (t, d) = len(xs), xs[0].shape
    normed = out_norm_weight is not None

    def body(ins, outs):
        q = ins[n][...].astype(ct)
        out_ref, rest = outs[0], outs[1:]
        if normed:
            normed_ref, rest = rest[0], rest[1:]
        lse_ref, stats = (rest[0], rest[1:]) if softmax else (None, rest)
        m = l = acc = None
        for i in range(n):  # static unroll over the sources: each tile read once
            x = ins[i][...].astype(ct)
            r, s = _key(x, q, eps, key_norm)
            stats[i][...] = r
            stats[n + i][...] = s
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
            normed_ref[...] = ((_rms(y, out_norm_eps) * y) * ins[n + 1][...]).astype(normed_ref.dtype)
        if softmax:
            lse_ref[...] = m + jnp.log(l)

    col = jax.ShapeDtypeStruct((t, 1), ct)
    big = jax.ShapeDtypeStruct((t, d), xs[0].dtype)
    out_shapes = [big] * (1 + normed) + ([col] if softmax else []) + [col] * (2 * n)
    q_spec = _rows(tb, d) if per_token else _whole((1, d))
    inputs, in_specs = [*xs, qg], [_rows(tb, d)] * n + [q_spec]
    if normed:
        inputs, in_specs = inputs + [out_norm_weight], in_specs + [_whole((1, d))]
    outs = _call(body, "attnres_forward_normed" if normed else "attnres_forward", inputs, in_specs, out_shapes,
                 [_rows(tb, d)] * (1 + normed) + [_rows(tb, 1)] * (len(out_shapes) - 1 - normed), t, tb,
                 interpret=interpret, poison=poison, compiler_params=compiler_params)
    out, outs = outs[0], outs[1:]
    out_normed, outs = (outs[0], outs[1:]) if normed else (None, outs)
    lse, stats = (outs[0], outs[1:]) if softmax else (None, outs)
    return out, lse, stats[:n], stats[n:], out_normed


# -- backward --------------------------------------------------------------------------------------


def backward(xs, qg, d_out, d_lse, ps, rs, ss, *, per_token, scale, softmax, key_norm, tb, ct, interpret,
             poison, compiler_params=None, out_norm_weight=None, out_norm_eps=None, d_normed=None):
    """Gradients of `forward` from its residuals.  d_out `[T, D]`; d_lse `[T, 1]` (softmax, else
    None); ps, rs, ss: N x `[T, 1]` (weights and statistics).  With the fused output norm (C17):
    out_norm_weight `[1, D]` (compute dtype), its eps, d_normed `[T, D]` the cotangent of
    out_normed.  Returns dxs N x `[T, D]` (sources' dtype), dqg: `[tiles, D]` per-tile partial sums
    for a pseudo-query (sum over axis 0), `[T, D]` for a per-token query, and d_out_norm_weight as
    `[tiles, D]` per-tile partial sums (None without the output norm)."""
    n, (t, d) = len(xs), xs[0].shape
    tiles = pl.cdiv(t, tb)
    normed = out_norm_weight is not None

    def body(ins, outs):
        x_refs, q, g = ins[:n], ins[n][...].astype(ct), ins[n + 1][...].astype(ct)
        dl = ins[n + 2][...]
        p_refs, r_refs, s_refs = ins[n + 3:2 * n + 3], ins[2 * n + 3:3 * n + 3], ins[3 * n + 3:4 * n + 3]

        def valid():  # rows past T (last partial tile) hold garbage: masked before a tile sum
            return pl.program_id(0) * tb + jax.lax.broadcasted_iota(jnp.int32, (tb, 1), 0) < t

        if normed:  # C17 prologue: y recomputed from the tiles this program holds anyway (no extra
            # HBM read; out in the compute dtype, as the forward formed it), then g += d_y
            gn, w = ins[4 * n + 3][...].astype(ct), ins[4 * n + 4][...]
            y = functools.reduce(lambda a, b: a + b, [p_refs[i][...] * x_refs[i][...].astype(ct) for i in range(n)])
            rho = _rms(y, out_norm_eps)
            y_hat = rho * y
            a = gn * w
            g = g + rho * (a - y_hat * (jnp.sum(a * y_hat, axis=1, keepdims=True) / d))
            outs[n + 1][...] = jnp.sum(jnp.where(valid(), gn * y_hat, 0.0), axis=0, keepdims=True)
        dps = [jnp.sum(g * x_refs[i][...].astype(ct), axis=1, keepdims=True) for i in range(n)]  # pass 1
        if softmax:
            pdp = functools.reduce(lambda a, b: a + b, [p_refs[i][...] * dps[i] for i in range(n)])
        dqg = None
        for i in range(n):  # pass 2: dx_i, and the query gradient contribution c_i r_i x_i
            x, r, s, p = x_refs[i][...].astype(ct), r_refs[i][...], s_refs[i][...], p_refs[i][...]
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

    inputs = [*xs, qg, d_out, jnp.zeros((t, 1), ct) if d_lse is None else d_lse, *ps, *rs, *ss]
    in_specs = ([_rows(tb, d)] * n + [_rows(tb, d) if per_token else _whole((1, d)), _rows(tb, d)]
                + [_rows(tb, 1)] * (1 + 3 * n))
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
    Returns outs S x `[T, D]` (sources' dtype), lses S x `[T, 1]`, rs N x `[T, 1]`,
    ss N x S x `[T, 1]` (row-major: ss[i * S + k])."""
    n, (t, d), sets = len(xs), xs[0].shape, qg.shape[0]

    def body(ins, outs):
        q = ins[n][...].astype(ct)  # [S, D]
        out_refs, lse_refs = outs[:sets], outs[sets:2 * sets]
        r_refs, s_refs = outs[2 * sets:2 * sets + n], outs[2 * sets + n:]
        state = [None] * sets  # (m, l, acc) per query
        for i in range(n):
            x = ins[i][...].astype(ct)  # one read of source i's tile for all S queries
            r = _rms(x, eps)
            r_refs[i][...] = r
            for k in range(sets):
                s = jnp.sum(x * q[k:k + 1], axis=1, keepdims=True)
                s_refs[i * sets + k][...] = s
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
            lse_refs[k][...] = m + jnp.log(l)

    col = jax.ShapeDtypeStruct((t, 1), ct)
    out_shapes = [jax.ShapeDtypeStruct((t, d), xs[0].dtype)] * sets + [col] * (sets + n + n * sets)
    out_specs = [_rows(tb, d)] * sets + [_rows(tb, 1)] * (sets + n + n * sets)
    outs = _call(body, "attnres_phase1", [*xs, qg], [_rows(tb, d)] * n + [_whole((sets, d))], out_shapes,
                 out_specs, t, tb, interpret=interpret, poison=poison,
                 compiler_params=compiler_params)
    return outs[:sets], outs[sets:2 * sets], outs[2 * sets:2 * sets + n], outs[2 * sets + n:]


# -- phase 2 ---------------------------------------------------------------------------------------


def merge(out1, lse1, partial, qg, *, per_token, eps, scale, tb, ct, interpret, poison, compiler_params=None):
    """out1, partial `[T, D]`; lse1 `[T, 1]`; qg `[1, D]` or `[T, D]`.  Returns out `[T, D]`
    (partial's dtype), lse, r, s, w1 `[T, 1]` (compute dtype)."""
    t, d = partial.shape

    def body(ins, outs):
        o1, l1, x = ins[0][...].astype(ct), ins[1][...].astype(ct), ins[2][...].astype(ct)
        r, s = _key(x, ins[3][...].astype(ct), eps, True)
        z2 = scale * r * s
        w1, w2 = merge_weights(l1, z2)  # C10.7: each from its own logistic, not 1 - w1
        m = jnp.maximum(l1, z2)
        outs[0][...] = (w1 * o1 + w2 * x).astype(outs[0].dtype)
        outs[1][...] = m + jnp.log(jnp.exp(l1 - m) + jnp.exp(z2 - m))
        outs[2][...], outs[3][...], outs[4][...] = r, s, w1

    col = jax.ShapeDtypeStruct((t, 1), ct)
    out_shapes = [jax.ShapeDtypeStruct((t, d), partial.dtype)] + [col] * 4
    in_specs = [_rows(tb, d), _rows(tb, 1), _rows(tb, d), _rows(tb, d) if per_token else _whole((1, d))]
    return _call(body, "attnres_merge", [out1, lse1, partial, qg], in_specs, out_shapes,
                 [_rows(tb, d)] + [_rows(tb, 1)] * 4, t, tb, interpret=interpret, poison=poison,
                 compiler_params=compiler_params)
