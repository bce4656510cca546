"""The Metal implementation: `mx.fast.metal_kernel` kernels for the forward and backward of
depth attention (both the single-query op and phase 1 of the two-phase schedule) and of
`merge_partial`, and `IMPLEMENTATION`, the entry points `ops.py` calls (registered in
`dispatch.py`).

Preferred where Metal is present and the default device is the GPU, for every dtype but float64
(Metal has none); everything else runs the compiled composition (`compiled.py`).  NOT VERIFIED:
this file was written on Linux, where Metal does not exist; its source has never been compiled
or run on a GPU (see backend_mlx/README.md; `tests/test_metal_emulated.py` runs the kernel
bodies as C++).  The entry points take the op's own arrays (sources as given: a list, or one
stacked array passed to the kernel as it is), launch the kernels, and return the op's outputs
and gradients in their final shapes and dtypes.

Thread layout (every kernel): one threadgroup = one SIMD group of 32 lanes per (token, head)
pair `th = token * H + head`; lane `l` owns the channels `c = l + 32 k` (k < K = ceil(Dh / 32))
of that head and keeps them in registers; reductions over channels are `simd_sum` (a fixed
tree, so results are deterministic; no atomics anywhere).  With the fused output norm (C17: an
RMS over all D channels of a token) one threadgroup serves the H heads of a token in turn and
keeps their out rows in registers: the forward writes out and out_normed in the same pass, the
backward applies the d_y prologue between its pass A (which recomputes out in float32) and
pass B, and writes d w's per-token terms, summed over tokens outside the kernel.  All arithmetic is float32 (C10);
inputs are read through `float(...)` whatever their dtype, and `out`/`dx` are cast once to the
template type `T` (the sources' dtype).  Sources stay separate buffers (a list is never
stacked): the kernel indexes a thread-local array of device pointers `src[N]`; a stacked array
is one buffer indexed by offsets.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ..common import query_grads

SIMD = 32

#: Output fill value before a kernel runs (tests set NaN to prove every element is written).
INIT_VALUE = None


def is_available() -> bool:
    """Whether this machine has Metal (Apple silicon)."""
    return mx.metal.is_available()


def _common(st, num_queries: int, head_dim: int, per_token: bool) -> str:
    """Compile-time constants shared by the attend kernels."""
    cached = [i for i, c in enumerate(st.cached) if c]
    r_index = ", ".join(str(cached.index(i)) if c else "-1" for i, c in enumerate(st.cached))
    out_norm = st.out_norm_eps is not None
    return f"""
    constexpr int N = {st.num_sources};        // sources
    constexpr int NQ = {num_queries};          // queries per token (S for phase 1, else 1)
    constexpr int H = {st.num_heads};
    constexpr int DH = {head_dim};
    constexpr int D = H * DH;
    constexpr int K = {math.ceil(head_dim / SIMD)};  // channels per lane
    constexpr bool KEY_NORM = {str(st.key_norm).lower()};
    constexpr bool SIGMOID = {str(st.activation == "sigmoid").lower()};
    constexpr float EPS = {st.eps!r};
    constexpr float SCALE = {st.scale!r};
    constexpr bool PER_TOKEN_Q = {str(per_token).lower()};
    // C17 fused output norm (single-query op only, so NQ = 1): its RMS runs over all D channels,
    // so one threadgroup then serves all H heads of a token (HG = H), else one (token, head).
    constexpr bool OUT_NORM = {str(out_norm).lower()};
    constexpr float EPS_O = {st.out_norm_eps if out_norm else 0.0!r};
    constexpr int HG = OUT_NORM ? H : 1;       // heads per threadgroup
    constexpr int YH = OUT_NORM ? HG : 1;      // heads whose out rows are kept in registers
    const int R_INDEX[N] = {{{r_index}}};   // cached inverse RMS slot per source, or -1
    const uint TOKENS = meta[0];
    const uint TH = TOKENS * H;
    const uint grp = threadgroup_position_in_grid.x;  // HG consecutive (token, head) pairs
    const uint lane = thread_index_in_simdgroup;      // 0..31
    """


def _pointer_init(name: str, n: int, stacked: bool, qualifier: str) -> str:
    """`src[N]`: list -> separate buffers x0..x{N-1}; stacked -> offsets into one buffer."""
    items = [f"{name} + {i} * TOKENS * D" for i in range(n)] if stacked else [
        f"{name}{i}" for i in range(n)]
    return f"{qualifier} T* {name}_ptr[N] = {{{', '.join(items)}}};"


# The (token, head) pair `th` of head `hh` of this threadgroup.
_HEAD = """
      const uint th = grp * HG + hh;
      const uint tok = th / H, h = th % H;
"""

_LOAD_QG = """
    // qg[s][k] = query * gain for query s, channel c = lane + 32k of head h.
    float qg[NQ][K];
    for (int s = 0; s < NQ; ++s) for (int k = 0; k < K; ++k) {
      const uint c = lane + 32 * k;
      const uint qi = PER_TOKEN_Q ? tok * D + h * DH + c : s * D + h * DH + c;
      qg[s][k] = c < DH ? float(q[qi]) * float(g[s * D + h * DH + c]) : 0.0f;
    }
"""

_SOURCE_STATS = """
      // Load source i's channels; r = cached, computed (key norm) or 1.
      float xv[K];
      for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        xv[k] = c < DH ? float(x_ptr[i][tok * D + h * DH + c]) : 0.0f;
      }
      float r = 1.0f;
      if (KEY_NORM) {
        if (R_INDEX[i] >= 0) {
          r = float(rs_ptr[R_INDEX[i]][th]);
        } else {
          // C10.6: where the fp32 sum of squares overflows (|x| >= ~1.8e19), r comes from the
          // squares of 2^-80 x (finite for every finite x; eps is negligible there).
          float ss = 0.0f, sl = 0.0f;
          for (int k = 0; k < K; ++k) {
            const float y = xv[k] * 8.271806125530277e-25f;
            ss += xv[k] * xv[k];
            sl += y * y;
          }
          const float tot = simd_sum(ss), tot_lo = simd_sum(sl);
          r = tot == INFINITY ? 8.271806125530277e-25f * rsqrt(tot_lo / DH) : rsqrt(tot / DH + EPS);
        }
      }
"""

_ONLINE_SOFTMAX = """
    // Online softmax over sources (flash-style): m = running max, den = running sum.
    float acc[NQ][K], m[NQ], den[NQ];
    for (int s = 0; s < NQ; ++s) {
      m[s] = -INFINITY; den[s] = 0.0f;
      for (int k = 0; k < K; ++k) acc[s][k] = 0.0f;
    }
    for (int i = 0; i < N; ++i) {
""" + _SOURCE_STATS + """
      for (int s = 0; s < NQ; ++s) {
        float dot = 0.0f;
        for (int k = 0; k < K; ++k) dot += qg[s][k] * xv[k];
        const float z = SCALE * r * simd_sum(dot);
        STORE_Z
        if (SIGMOID) {
          const float p = 1.0f / (1.0f + exp(-z));
          for (int k = 0; k < K; ++k) acc[s][k] += p * xv[k];
        } else {
          // -inf logits contribute 0 (an all -inf column ends with den = 0 -> NaN, C12).
          const float mn = z > m[s] ? z : m[s];
          const float a = m[s] == -INFINITY ? 0.0f : exp(m[s] - mn);
          const float b = z == -INFINITY ? 0.0f : exp(z - mn);
          den[s] = den[s] * a + b;
          for (int k = 0; k < K; ++k) acc[s][k] = acc[s][k] * a + b * xv[k];
          m[s] = mn;
        }
      }
    }
"""

# C17: (pre, rr) with rho = pre * rr = 1/sqrt(mean(y^2) + EPS_O) over the D channels of the
# token's out row y (lane-local sums ss_o of y^2, sl_o of (2^-80 y)^2).  Where the fp32 sum
# overflows, pre = 2^-80 and rr comes from the scaled squares (C10.6); rho y is then formed as
# (y pre) rr, never as the possibly subnormal rho times y.
_OUT_NORM_RHO = """
      const float tot_o = simd_sum(ss_o), tot_o_lo = simd_sum(sl_o);
      const bool big_o = tot_o == INFINITY;
      const float pre = big_o ? 8.271806125530277e-25f : 1.0f;
      const float rr = big_o ? rsqrt(tot_o_lo / D) : rsqrt(tot_o / D + EPS_O);
"""

_KEEP_Y = """
          if (s == 0) {   // keep y (out in fp32, before its rounding) for C17
            const float yk = c < DH ? y : 0.0f;
            yv[hh][k] = yk;
            ss_o += yk * yk;
            sl_o += (yk * 8.271806125530277e-25f) * (yk * 8.271806125530277e-25f);
          }
"""

_OUT_NORM_DECL = """
    float yv[YH][K];                 // C17: this token's out rows (all heads), fp32
    float ss_o = 0.0f, sl_o = 0.0f;
"""

_FORWARD = """
    OUT_NORM_DECL
    for (int hh = 0; hh < HG; ++hh) {
""" + _HEAD + _LOAD_QG + _ONLINE_SOFTMAX.replace(
    "STORE_Z", "if (lane == 0) p_out[(s * N + i) * TH + th] = z;  // logits, turned into p below") + """
    for (int s = 0; s < NQ; ++s) {
      for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        const float y = SIGMOID ? acc[s][k] : acc[s][k] / den[s];
        if (c < DH) out[(s * TOKENS + tok) * D + h * DH + c] = T(y);
        KEEP_Y
      }
      if (lane == 0) {
        lse_out[s * TH + th] = den[s] > 0.0f ? m[s] + log(den[s]) : NAN;
        // Only lane 0 wrote these logits, so it may read them back without a barrier.
        for (int i = 0; i < N; ++i) {
          const float z = p_out[(s * N + i) * TH + th];
          p_out[(s * N + i) * TH + th] = SIGMOID ? 1.0f / (1.0f + exp(-z)) : exp(z - m[s]) / den[s];
        }
      }
    }
    }
    OUT_NORM_FORWARD
"""

# C17, same pass as out: out_normed = (rho y) w over the token's whole row, rounded once to T.
_OUT_NORM_FORWARD = """
    {
""" + _OUT_NORM_RHO + """
      for (int hh = 0; hh < YH; ++hh) for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        if (c < DH) normed[grp * D + hh * DH + c] = T(((yv[hh][k] * pre) * rr) * float(wn[hh * DH + c]));
      }
    }
"""

_OUT_NORM_BACKWARD = """
    {
      // C17 prologue (NQ = 1, HG = H: the whole row of D channels is here): a = d_normed w,
      // y_hat = rho y, d_out += rho (a - y_hat <a, y_hat> / D); d w's per-token terms
      // d_normed y_hat go to dwn_out (summed over tokens outside, deterministically).
      float ss_o = 0.0f, sl_o = 0.0f;
      for (int hh = 0; hh < HG; ++hh) for (int k = 0; k < K; ++k) {
        const float yk = ys[hh][0][k];
        ss_o += yk * yk;
        sl_o += (yk * 8.271806125530277e-25f) * (yk * 8.271806125530277e-25f);
      }
""" + _OUT_NORM_RHO + """
      float av[HG][K], dot_o = 0.0f;
      for (int hh = 0; hh < HG; ++hh) for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        const uint at = grp * D + hh * DH + c;
        const float gn = c < DH ? float(d_normed[at]) : 0.0f;
        const float yh = (ys[hh][0][k] * pre) * rr;
        av[hh][k] = c < DH ? gn * float(wn[hh * DH + c]) : 0.0f;
        dot_o += av[hh][k] * yh;
        if (c < DH) dwn_out[at] = gn * yh;
      }
      const float dot_d = simd_sum(dot_o) / D;
      for (int hh = 0; hh < HG; ++hh) for (int k = 0; k < K; ++k) {
        const float yh = (ys[hh][0][k] * pre) * rr;
        gos[hh][0][k] += ((av[hh][k] - yh * dot_d) * pre) * rr;
      }
    }
"""

_PASS_B = """
    float dl[NQ];  // d_lse (zeros when lse had no cotangent)
    for (int s = 0; s < NQ; ++s) dl[s] = float(d_lse[s * TH + th]);
    // Pass B: per source, dz and dx (spec 2.3); dqg accumulates over sources in registers.
    float dqg[NQ][K];
    for (int s = 0; s < NQ; ++s) for (int k = 0; k < K; ++k) dqg[s][k] = 0.0f;
    for (int i = 0; i < N; ++i) {
""" + _SOURCE_STATS + """
      const bool rms_path = KEY_NORM && R_INDEX[i] < 0;   // dr/dx enters dx here
      float dx[K], dr = 0.0f;
      for (int k = 0; k < K; ++k) dx[k] = 0.0f;
      for (int s = 0; s < NQ; ++s) {
        // dp = <d_out, x_i>, or for softmax <d_out, x_i - out> (one dot, not the difference of
        // two nearly equal dots over D: with peaked weights x_i ~ out and fp32 lost it)
        float dot = 0.0f, dpp = 0.0f;
        for (int k = 0; k < K; ++k) {
          dot += qg[s][k] * xv[k];
          dpp += gos[hh][s][k] * (SIGMOID ? xv[k] : xv[k] - ys[hh][s][k]);
        }
        const float sd = simd_sum(dot), dp = simd_sum(dpp);
        const float z = SCALE * r * sd;
        const float p = SIGMOID ? 1.0f / (1.0f + exp(-z)) : exp(z - ms[hh][s]) / dens[hh][s];
        const float dz = SIGMOID ? dp * p * (1.0f - p) : p * (dp + dl[s]);
        for (int k = 0; k < K; ++k) {
          // s r^3 x / Dh as ((s r) r / Dh)(r x): no r^3 (it underflows for |x| >~ 1e13)
          const float dkey = SCALE * (r * qg[s][k] - (rms_path ? ((sd * r) * r / DH) * (r * xv[k]) : 0.0f));
          dx[k] += p * gos[hh][s][k] + dz * dkey;
          dqg[s][k] += dz * SCALE * r * xv[k];
        }
        dr += dz * SCALE * sd;
      }
      for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        if (c < DH) dx_ptr[i][tok * D + h * DH + c] = T(dx[k]);
      }
      if (lane == 0 && R_INDEX[i] >= 0) dr_out[R_INDEX[i] * TH + th] = dr;
    }
    for (int s = 0; s < NQ; ++s) for (int k = 0; k < K; ++k) {
      const uint c = lane + 32 * k;
      if (c < DH) dqg_out[(s * TOKENS + tok) * D + h * DH + c] = dqg[s][k];
    }
    }
"""


_BACKWARD = """
    // Pass A, per head of the group: softmax statistics and y = out in fp32 (recomputed, never
    // read back from the rounded out), with d_out in registers.
    float gos[HG][NQ][K], ys[HG][NQ][K], ms[HG][NQ], dens[HG][NQ];
    for (int hh = 0; hh < HG; ++hh) {
""" + _HEAD + _LOAD_QG + """
    for (int s = 0; s < NQ; ++s) for (int k = 0; k < K; ++k) {
      const uint c = lane + 32 * k;
      gos[hh][s][k] = c < DH ? float(d_out[(s * TOKENS + tok) * D + h * DH + c]) : 0.0f;
    }
""" + _ONLINE_SOFTMAX.replace("STORE_Z", "") + """
    for (int s = 0; s < NQ; ++s) {
      ms[hh][s] = m[s]; dens[hh][s] = den[s];
      for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        ys[hh][s][k] = c < DH ? (SIGMOID ? acc[s][k] : acc[s][k] / den[s]) : 0.0f;
      }
    }
    }
    OUT_NORM_BACKWARD
    for (int hh = 0; hh < HG; ++hh) {
""" + _HEAD + _LOAD_QG + _PASS_B


def _names(prefix: str, n: int, stacked: bool):
    return [prefix] if stacked else [f"{prefix}{i}" for i in range(n)]


def attend_source(st, per_token: bool, num_queries: int, head_dim: int, backward: bool):
    """(input names, output names, kernel body) of the forward or backward attend kernel."""
    n_cached = sum(st.cached)
    inputs = _names("x", st.num_sources, st.stacked) + ["q", "g", "meta"] + [
        f"rs{j}" for j in range(n_cached)]
    pointers = [_pointer_init("x", st.num_sources, st.stacked, "const device")]
    pointers.append("const device float* rs_ptr[%d] = {%s};" % (
        max(n_cached, 1), ", ".join(f"rs{j}" for j in range(n_cached)) or "nullptr"))
    out_norm = st.out_norm_eps is not None  # C17: the code that needs wn etc. only then
    if backward:
        inputs += ["d_out", "d_lse"] + (["wn", "d_normed"] if out_norm else [])
        outputs = _names("dx", st.num_sources, st.stacked) + ["dqg_out", "dr_out"] + (
            ["dwn_out"] if out_norm else [])
        pointers.append(_pointer_init("dx", st.num_sources, st.stacked, "device"))
        body = _BACKWARD.replace("OUT_NORM_BACKWARD", _OUT_NORM_BACKWARD if out_norm else "")
    else:
        inputs += ["wn"] if out_norm else []
        outputs = ["out", "p_out", "lse_out"] + (["normed"] if out_norm else [])
        body = _FORWARD
        for mark, code in (("OUT_NORM_DECL", _OUT_NORM_DECL), ("KEEP_Y", _KEEP_Y),
                           ("OUT_NORM_FORWARD", _OUT_NORM_FORWARD)):
            body = body.replace(mark, code if out_norm else "")
    return inputs, outputs, _common(st, num_queries, head_dim, per_token) + "\n".join(
        pointers) + body


@functools.lru_cache(maxsize=None)
def _attend_kernel(st, per_token: bool, num_queries: int, head_dim: int, backward: bool):
    """Build (once per configuration) the forward or backward attend kernel."""
    inputs, outputs, source = attend_source(st, per_token, num_queries, head_dim, backward)
    return mx.fast.metal_kernel(name=f"attnres_attend_{'bwd' if backward else 'fwd'}",
                                input_names=inputs, output_names=outputs, source=source,
                                ensure_row_contiguous=True)


def _launch(kernel, inputs, outputs, num_groups: int, dtype):
    shapes, dtypes = zip(*outputs)
    return kernel(inputs=inputs, template=[("T", dtype)], grid=(SIMD * num_groups, 1, 1),
                  threadgroup=(SIMD, 1, 1), output_shapes=list(shapes),
                  output_dtypes=list(dtypes), init_value=INIT_VALUE)


def _geometry(st, xs, q):
    """(one source's shape `[..., D]`, its dtype, tokens, queries per token, per-token query)."""
    source = xs[0]  # for a stacked array a view: only shape and dtype are read
    nq = q.shape[0] if st.mode == "multi" else 1
    per_token = st.mode == "single" and q.ndim > 1
    return source.shape, source.dtype, math.prod(source.shape[:-1]), nq, per_token


def _inputs(st, xs, q, g, rs, tokens: int):
    """Kernel inputs: the sources as given (a stacked array is one buffer), q, g, meta, rs."""
    sources = [xs] if st.stacked else list(xs)
    return sources + [q, g, mx.array([tokens], dtype=mx.uint32)] + [
        r.astype(mx.float32) for r in rs]


def _heads_shape(st, batch) -> tuple:
    """Shape of a per-(token, head) result: `[..., H]`, or `[...]` with one head."""
    return (*batch, st.num_heads) if st.num_heads > 1 else tuple(batch)


def _groups(st, tokens: int) -> int:
    """Threadgroups of an attend kernel: one per (token, head) pair, or with the fused output
    norm (C17) one per token, serving all its heads."""
    return tokens if st.out_norm_eps is not None else tokens * st.num_heads


def attend_forward(st, xs, q, g, rs, ws):
    """Forward kernel; returns the op's outputs: out `[..., D]` (`[S, ..., D]` for phase 1) and,
    with ws = [w `[D]`] (C17), out_normed `[..., D]`, both in the sources' dtype, then lse
    `[..., H?]` (`[S, ...]`; softmax only; single-query op with `st.with_lse`) and, for the
    single-query op with `st.with_weights`, weights `[N, ..., H?]`, both float32."""
    shape, dtype, tokens, nq, per_token = _geometry(st, xs, q)
    batch, D, H = shape[:-1], shape[-1], st.num_heads
    kernel = _attend_kernel(st, per_token, nq, D // H, False)
    results = _launch(kernel, _inputs(st, xs, q, g, rs, tokens) + [
        w.astype(mx.float32) for w in ws],  # C17: w in the compute dtype (Metal has no fp64)
        [((nq * tokens * D,), dtype), ((nq * st.num_sources * tokens * H,), mx.float32),
         ((nq * tokens * H,), mx.float32)] + [((tokens * D,), dtype)] * len(ws),
        _groups(st, tokens), dtype)
    out, p, lse = results[:3]
    if st.mode == "multi":
        return out.reshape(nq, *shape), lse.reshape(nq, *batch)
    outs = [out.reshape(shape)] + [normed.reshape(shape) for normed in results[3:]]
    if st.activation == "softmax" and st.with_lse:
        outs.append(lse.reshape(_heads_shape(st, batch)))
    if st.with_weights:
        outs.append(p.reshape(st.num_sources, *_heads_shape(st, batch)))
    return tuple(outs)


def attend_backward(st, xs, q, g, rs, ws, d_out, d_normed, d_lse):
    """Backward kernel; returns the gradients (sources as given, query, gain, cached rs, [d w
    per w in ws]), each in its input's shape and dtype.  d_out like out; d_normed like
    out_normed or None; d_lse like lse, or None (sigmoid).  With ws (C17) the kernel applies the
    d_y prologue itself, from y = out recomputed in float32 in its pass A."""
    shape, dtype, tokens, nq, per_token = _geometry(st, xs, q)
    D, H = shape[-1], st.num_heads
    n_cached = len(rs)
    kernel = _attend_kernel(st, per_token, nq, D // H, True)
    if d_lse is None:
        d_lse = mx.zeros((nq * tokens * H,), dtype=mx.float32)
    inputs = _inputs(st, xs, q, g, rs, tokens) + [d_out, d_lse.astype(mx.float32)]
    if ws:
        inputs += [ws[0].astype(mx.float32),
                   mx.zeros(shape, dtype=dtype) if d_normed is None else d_normed]
    dx_outputs = ([((st.num_sources * tokens * D,), dtype)] if st.stacked else
                  [((tokens * D,), dtype)] * st.num_sources)
    results = _launch(kernel, inputs, dx_outputs + [
        ((nq * tokens * D,), mx.float32), ((max(n_cached, 1) * tokens * H,), mx.float32)] + [
        ((tokens * D,), mx.float32)] * len(ws), _groups(st, tokens), dtype)
    n_dx = 1 if st.stacked else st.num_sources
    d_sources = (results[0].reshape(xs.shape) if st.stacked
                 else [dx.reshape(shape) for dx in results[:n_dx]])
    multi = st.mode == "multi"
    dq, dg = query_grads(results[n_dx].reshape(*((nq,) if multi else ()), *shape), q, g,
                         multi=multi)
    dr_all = results[n_dx + 1].reshape(max(n_cached, 1), tokens * H)  # no -1: T = 0 is legal
    d_rs = [dr_all[j].reshape(r.shape).astype(r.dtype) for j, r in enumerate(rs)]
    # C17: d w = the per-token terms summed over tokens (one reduction, no atomics)
    d_ws = [results[n_dx + 2].reshape(tokens, D).sum(axis=0).astype(w.dtype) for w in ws]
    return d_sources, dq, dg, d_rs, d_ws


_MERGE = """
    // One SIMD group per token; lane owns channels c = lane + 32k of D.
    constexpr int D = {dim};
    constexpr int K = {k};
    constexpr float EPS = {eps!r};
    constexpr float SCALE = {scale!r};
    constexpr bool PER_TOKEN_Q = {per_token};
    const uint tok = threadgroup_position_in_grid.x;
    const uint lane = thread_index_in_simdgroup;
    float o1[K], x[K], qgv[K], qv[K], gv[K];
    float ss = 0.0f, sl = 0.0f, dot = 0.0f;
    for (int k = 0; k < K; ++k) {{
      const uint c = lane + 32 * k;
      const bool ok = c < D;
      o1[k] = ok ? float(out1[tok * D + c]) : 0.0f;
      x[k] = ok ? float(partial[tok * D + c]) : 0.0f;
      qv[k] = ok ? float(q[PER_TOKEN_Q ? tok * D + c : c]) : 0.0f;
      gv[k] = ok ? float(g[c]) : 0.0f;
      qgv[k] = qv[k] * gv[k];
      ss += x[k] * x[k];
      sl += (x[k] * 8.271806125530277e-25f) * (x[k] * 8.271806125530277e-25f);
      dot += qgv[k] * x[k];
    }}
    const float tot = simd_sum(ss), tot_lo = simd_sum(sl);  // C10.6, as in the attend kernels
    const float r = tot == INFINITY ? 8.271806125530277e-25f * rsqrt(tot_lo / D) : rsqrt(tot / D + EPS);
    const float sd = simd_sum(dot);
    const float l1 = float(lse1[tok]);
    const float z2 = SCALE * r * sd;
    const float w1 = 1.0f / (1.0f + exp(z2 - l1));   // sigmoid(lse1 - z2)
    const float w2 = 1.0f / (1.0f + exp(l1 - z2));   // sigmoid(z2 - lse1), not 1 - w1 (C10.7)
"""

_MERGE_FORWARD = """
    for (int k = 0; k < K; ++k) {
      const uint c = lane + 32 * k;
      if (c < D) out[tok * D + c] = T(w1 * o1[k] + w2 * x[k]);
    }
    if (lane == 0) {
      const float mx_ = max(l1, z2);
      lse_out[tok] = mx_ + log(exp(l1 - mx_) + exp(z2 - mx_));
    }
"""

_MERGE_BACKWARD = """
    float t = 0.0f;
    for (int k = 0; k < K; ++k) {
      const uint c = lane + 32 * k;
      t += (c < D ? float(d_out[tok * D + c]) : 0.0f) * (o1[k] - x[k]);
    }
    const float d_delta = simd_sum(t) * w1 * w2;          // delta = lse1 - z2
    const float dlse = float(d_lse[tok]);
    const float d_z2 = -d_delta + dlse * w2;
    for (int k = 0; k < K; ++k) {
      const uint c = lane + 32 * k;
      if (c < D) {
        const float go = float(d_out[tok * D + c]);
        d_out1[tok * D + c] = T(w1 * go);
        d_partial[tok * D + c] = T(w2 * go + d_z2 * SCALE * (r * qgv[k] - ((sd * r) * r / D) * (r * x[k])));
        dqg_out[tok * D + c] = d_z2 * SCALE * r * x[k];
      }
    }
    if (lane == 0) d_lse1[tok] = d_delta + dlse * w1;
"""


def merge_source(dim: int, eps: float, scale: float, per_token: bool, backward: bool):
    """(input names, output names, kernel body) of the forward or backward merge kernel."""
    head = _MERGE.format(dim=dim, k=math.ceil(dim / SIMD), eps=eps, scale=scale,
                         per_token=str(per_token).lower())
    inputs = ["out1", "lse1", "partial", "q", "g"] + (["d_out", "d_lse"] if backward else [])
    outputs = ["d_out1", "d_lse1", "d_partial", "dqg_out"] if backward else ["out", "lse_out"]
    return inputs, outputs, head + (_MERGE_BACKWARD if backward else _MERGE_FORWARD)


@functools.lru_cache(maxsize=None)
def _merge_kernel(dim: int, eps: float, scale: float, per_token: bool, backward: bool):
    inputs, outputs, source = merge_source(dim, eps, scale, per_token, backward)
    return mx.fast.metal_kernel(name=f"attnres_merge_{'bwd' if backward else 'fwd'}",
                                input_names=inputs, output_names=outputs, source=source,
                                ensure_row_contiguous=True)


def merge_forward(eps: float, scale: float, o1, l1, x, q, g):
    """Phase-2 kernel: (out `[..., D]` in partial's dtype, lse float32 shaped like lse1)."""
    D, tokens = x.shape[-1], math.prod(x.shape[:-1])
    kernel = _merge_kernel(D, eps, scale, q.ndim > 1, False)
    out, lse = _launch(kernel, [o1, l1, x, q, g], [((tokens * D,), x.dtype),
                                                   ((tokens,), mx.float32)], tokens, x.dtype)
    return out.reshape(x.shape), lse.reshape(l1.shape)


def merge_backward(eps: float, scale: float, o1, l1, x, q, g, d_out, d_lse):
    """Phase-2 VJP kernel: gradients of (out1, lse1, partial, query, gain), each in its input's
    shape and dtype."""
    D, tokens = x.shape[-1], math.prod(x.shape[:-1])
    kernel = _merge_kernel(D, eps, scale, q.ndim > 1, True)
    d_o1, d_l1, d_x, dqg = _launch(
        kernel, [o1, l1, x, q, g, d_out, d_lse.astype(mx.float32)],
        [((tokens * D,), x.dtype), ((tokens,), mx.float32), ((tokens * D,), x.dtype),
         ((tokens * D,), mx.float32)], tokens, x.dtype)
    return (d_o1.reshape(o1.shape).astype(o1.dtype), d_l1.reshape(l1.shape).astype(l1.dtype),
            d_x.reshape(x.shape), *query_grads(dqg.reshape(x.shape), q, g, multi=False))


class Kernels:
    """The Metal kernels (see `dispatch.Implementation` for the entry points' contract)."""

    name = "metal"
    stacked_inv_rms = False  # the kernels take one inverse RMS per source

    def unavailable(self):
        """None where Metal is present and the default device is the GPU (the kernels run
        there), else why not."""
        if not is_available():
            return "not Apple silicon / Metal unavailable"
        if mx.default_device() != mx.gpu:
            return "the default device is the CPU (the kernels run on the GPU)"
        return None

    def unsupported(self, dtype):
        """None for every source dtype but float64: Metal has none (C10)."""
        return "Metal has no float64 (C10)" if dtype == mx.float64 else None

    def available(self) -> bool:
        return self.unavailable() is None

    def supports(self, dtype) -> bool:
        return self.unsupported(dtype) is None

    def attend_forward(self, st, xs, q, g, rs, ws):
        return attend_forward(st, xs, q, g, rs, ws)

    def attend_backward(self, st, xs, q, g, rs, ws, d_out, d_normed, d_lse):
        return attend_backward(st, xs, q, g, rs, ws, d_out, d_normed, d_lse)

    def merge_forward(self, eps, scale, o1, l1, x, q, g):
        return merge_forward(eps, scale, o1, l1, x, q, g)

    def merge_backward(self, eps, scale, o1, l1, x, q, g, d_out, d_lse):
        return merge_backward(eps, scale, o1, l1, x, q, g, d_out, d_lse)


IMPLEMENTATION = Kernels()
