"""Metal kernels (`mx.fast.metal_kernel`) for the forward and backward of depth attention (both
the single-query op and phase 1 of the two-phase schedule) and of `merge_partial`.

Used only where `mx.metal.is_available()`; everywhere else `ops.py` runs the compiled twin
(`compiled.py`).  NOT VERIFIED: this file was written on Linux, where Metal does not exist; its
source has never been compiled or run (see backend_mlx/README.md).  The Python wrappers only
build and launch the kernels; the results go through the same shaping/reduction code in
`ops.py` as the twin's.

Thread layout (every kernel): one threadgroup = one SIMD group of 32 lanes per (token, head)
pair `th = token * H + head`; lane `l` owns the channels `c = l + 32 k` (k < K = ceil(Dh / 32))
of that head and keeps them in registers; reductions over channels are `simd_sum` (a fixed
tree, so results are deterministic; no atomics anywhere).  All arithmetic is float32 (C10);
inputs are read through `float(...)` whatever their dtype, and `out`/`dx` are cast once to the
template type `T` (the sources' dtype).  Sources stay separate buffers (a list is never
stacked): the kernel indexes a thread-local array of device pointers `src[N]`.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

SIMD = 32

#: Output fill value before a kernel runs (tests set NaN to prove every element is written).
INIT_VALUE = None


def is_available() -> bool:
    return mx.metal.is_available()


def usable(dtype) -> bool:
    """Whether a call with sources of `dtype` runs the kernels: Metal present, the default
    device is the GPU, and the dtype is not float64 (Metal has none; the twin handles it)."""
    return is_available() and mx.default_device() == mx.gpu and dtype != mx.float64


def _common(st, num_queries: int, head_dim: int, per_token: bool) -> str:
    """Compile-time constants shared by the attend kernels."""
    cached = [i for i, c in enumerate(st.cached) if c]
    r_index = ", ".join(str(cached.index(i)) if c else "-1" for i, c in enumerate(st.cached))
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
    const int R_INDEX[N] = {{{r_index}}};   // cached inverse RMS slot per source, or -1
    const uint TOKENS = meta[0];
    const uint TH = TOKENS * H;
    const uint th = threadgroup_position_in_grid.x;   // (token, head) pair
    const uint lane = thread_index_in_simdgroup;      // 0..31
    const uint tok = th / H, h = th % H;
    """


def _pointer_init(name: str, n: int, stacked: bool, qualifier: str) -> str:
    """`src[N]`: list -> separate buffers x0..x{N-1}; stacked -> offsets into one buffer."""
    items = [f"{name} + {i} * TOKENS * D" for i in range(n)] if stacked else [
        f"{name}{i}" for i in range(n)]
    return f"{qualifier} T* {name}_ptr[N] = {{{', '.join(items)}}};"


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
          float ss = 0.0f;
          for (int k = 0; k < K; ++k) ss += xv[k] * xv[k];
          r = rsqrt(simd_sum(ss) / DH + EPS);
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

_FORWARD = """
""" + _LOAD_QG + _ONLINE_SOFTMAX.replace(
    "STORE_Z", "if (lane == 0) p_out[(s * N + i) * TH + th] = z;  // logits, turned into p below") + """
    for (int s = 0; s < NQ; ++s) {
      for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        if (c < DH) out[(s * TOKENS + tok) * D + h * DH + c] = T(SIGMOID ? acc[s][k] : acc[s][k] / den[s]);
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
"""

_BACKWARD = """
""" + _LOAD_QG + """
    // d_out of query s in registers; d_lse per query (zeros when lse had no cotangent).
    float go[NQ][K], dl[NQ];
    for (int s = 0; s < NQ; ++s) {
      dl[s] = float(d_lse[s * TH + th]);
      for (int k = 0; k < K; ++k) {
        const uint c = lane + 32 * k;
        go[s][k] = c < DH ? float(d_out[(s * TOKENS + tok) * D + h * DH + c]) : 0.0f;
      }
    }
    // Pass A: softmax statistics and out (as in the forward).
""" + _ONLINE_SOFTMAX.replace("STORE_Z", "") + """
    float gdo[NQ];  // <d_out, out> per query
    for (int s = 0; s < NQ; ++s) {
      float t = 0.0f;
      for (int k = 0; k < K; ++k) t += go[s][k] * (SIGMOID ? acc[s][k] : acc[s][k] / den[s]);
      gdo[s] = simd_sum(t);
    }
    // Pass B: per source, dz and dx (spec 2.3); dqg accumulates over sources in registers.
    float dqg[NQ][K];
    for (int s = 0; s < NQ; ++s) for (int k = 0; k < K; ++k) dqg[s][k] = 0.0f;
    for (int i = 0; i < N; ++i) {
""" + _SOURCE_STATS + """
      const bool rms_path = KEY_NORM && R_INDEX[i] < 0;   // dr/dx enters dx here
      float dx[K], dr = 0.0f;
      for (int k = 0; k < K; ++k) dx[k] = 0.0f;
      for (int s = 0; s < NQ; ++s) {
        float dot = 0.0f, dpp = 0.0f;
        for (int k = 0; k < K; ++k) { dot += qg[s][k] * xv[k]; dpp += go[s][k] * xv[k]; }
        const float sd = simd_sum(dot), dp = simd_sum(dpp);
        const float z = SCALE * r * sd;
        const float p = SIGMOID ? 1.0f / (1.0f + exp(-z)) : exp(z - m[s]) / den[s];
        const float dz = SIGMOID ? dp * p * (1.0f - p) : p * (dp - gdo[s] + dl[s]);
        for (int k = 0; k < K; ++k) {
          const float dkey = SCALE * (r * qg[s][k] - (rms_path ? sd * r * r * r * xv[k] / DH : 0.0f));
          dx[k] += p * go[s][k] + dz * dkey;
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
"""


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
    if backward:
        inputs += ["d_out", "d_lse"]
        outputs = _names("dx", st.num_sources, st.stacked) + ["dqg_out", "dr_out"]
        pointers.append(_pointer_init("dx", st.num_sources, st.stacked, "device"))
        body = _BACKWARD
    else:
        outputs = ["out", "p_out", "lse_out"]
        body = _FORWARD
    return inputs, outputs, _common(st, num_queries, head_dim, per_token) + "\n".join(
        pointers) + body


@functools.lru_cache(maxsize=None)
def _attend_kernel(st, per_token: bool, num_queries: int, head_dim: int, backward: bool):
    """Build (once per configuration) the forward or backward attend kernel."""
    inputs, outputs, source = attend_source(st, per_token, num_queries, head_dim, backward)
    return mx.fast.metal_kernel(name=f"attnres_attend_{'bwd' if backward else 'fwd'}",
                                input_names=inputs, output_names=outputs, source=source,
                                ensure_row_contiguous=True)


def _launch(kernel, inputs, outputs, num_pairs: int, dtype):
    shapes, dtypes = zip(*outputs)
    return kernel(inputs=inputs, template=[("T", dtype)], grid=(SIMD * num_pairs, 1, 1),
                  threadgroup=(SIMD, 1, 1), output_shapes=list(shapes),
                  output_dtypes=list(dtypes), init_value=INIT_VALUE)


def _geometry(st, srcs, q):
    batch = srcs[0].shape[:-1]
    tokens = math.prod(batch)
    nq = q.shape[0] if st.mode == "multi" else 1
    per_token = st.mode == "single" and q.ndim > 1
    return batch, tokens, nq, per_token


def _raw_inputs(st, srcs, q, g, rs, tokens):
    xs = [mx.stack(srcs)] if st.stacked else list(srcs)
    return xs + [q, g, mx.array([tokens], dtype=mx.uint32)] + [r.astype(mx.float32) for r in rs]


def attend_forward_core(st, srcs, xb, qg, rb, q, g, rs):
    """Kernel forward; returns ops' broadcast forms (out, p, lse)."""
    batch, tokens, nq, per_token = _geometry(st, srcs, q)
    H, D = st.num_heads, srcs[0].shape[-1]
    kernel = _attend_kernel(st, per_token, nq, D // H, False)
    out, p, lse = _launch(kernel, _raw_inputs(st, srcs, q, g, rs, tokens),
                          [((nq * tokens * D,), srcs[0].dtype),
                           ((nq * st.num_sources * tokens * H,), mx.float32),
                           ((nq * tokens * H,), mx.float32)], tokens * H, srcs[0].dtype)
    if st.mode == "multi":
        return (out.reshape(nq, *batch, 1, D), p.reshape(nq, st.num_sources, *batch, 1)
                .swapaxes(0, 1), lse.reshape(nq, *batch, 1))
    return (out.reshape(*batch, H, D // H), p.reshape(st.num_sources, *batch, H),
            None if st.activation == "sigmoid" else lse.reshape(*batch, H))


def attend_backward_core(st, srcs, xb, qg, rb, q, g, rs, d_out, d_lse):
    """Kernel backward; returns ops' broadcast forms (dxs, dqg, drs)."""
    batch, tokens, nq, per_token = _geometry(st, srcs, q)
    H, D = st.num_heads, srcs[0].shape[-1]
    n_cached = sum(st.cached)
    kernel = _attend_kernel(st, per_token, nq, D // H, True)
    if d_lse is None:
        d_lse = mx.zeros((nq * tokens * H,), dtype=mx.float32)
    inputs = _raw_inputs(st, srcs, q, g, rs, tokens) + [d_out, d_lse.astype(mx.float32)]
    dx_outputs = ([((st.num_sources * tokens * D,), srcs[0].dtype)] if st.stacked else
                  [((tokens * D,), srcs[0].dtype)] * st.num_sources)
    results = _launch(kernel, inputs, dx_outputs + [((nq * tokens * D,), mx.float32),
                                                    ((max(n_cached, 1) * tokens * H,),
                                                     mx.float32)], tokens * H, srcs[0].dtype)
    dxs = (list(results[0].reshape(st.num_sources, -1)) if st.stacked
           else list(results[:st.num_sources]))
    dxs = [dx.reshape(x.shape) for dx, x in zip(dxs, xb)]
    dqg = results[-2].reshape(xb[0].shape if st.mode == "single" else (nq, *batch, 1, D))
    dr_all = results[-1].reshape(max(n_cached, 1), -1)
    slots = iter(range(n_cached))
    drs = [dr_all[next(slots)].reshape(r.shape) if r is not None else None for r in rb]
    return dxs, dqg, drs


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
    float ss = 0.0f, dot = 0.0f;
    for (int k = 0; k < K; ++k) {{
      const uint c = lane + 32 * k;
      const bool ok = c < D;
      o1[k] = ok ? float(out1[tok * D + c]) : 0.0f;
      x[k] = ok ? float(partial[tok * D + c]) : 0.0f;
      qv[k] = ok ? float(q[PER_TOKEN_Q ? tok * D + c : c]) : 0.0f;
      gv[k] = ok ? float(g[c]) : 0.0f;
      qgv[k] = qv[k] * gv[k];
      ss += x[k] * x[k];
      dot += qgv[k] * x[k];
    }}
    const float r = rsqrt(simd_sum(ss) / D + EPS);
    const float sd = simd_sum(dot);
    const float l1 = float(lse1[tok]);
    const float z2 = SCALE * r * sd;
    const float w1 = 1.0f / (1.0f + exp(z2 - l1));   // sigmoid(lse1 - z2)
    const float w2 = 1.0f - w1;
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
        d_partial[tok * D + c] = T(w2 * go + d_z2 * SCALE * (r * qgv[k] - sd * r * r * r * x[k] / D));
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


def merge_forward_core(eps: float, scale: float, o1, l1, x, q, g):
    """Kernel phase 2: (out in partial's dtype, lse float32), shaped like partial / lse1."""
    D, tokens = x.shape[-1], math.prod(x.shape[:-1])
    kernel = _merge_kernel(D, eps, scale, q.ndim > 1, False)
    out, lse = _launch(kernel, [o1, l1, x, q, g], [((tokens * D,), x.dtype),
                                                   ((tokens,), mx.float32)], tokens, x.dtype)
    return out.reshape(x.shape), lse.reshape(l1.shape)


def merge_backward_core(eps: float, scale: float, o1, l1, x, q, g, d_out, d_lse):
    """Kernel VJP of phase 2: (d_o1, d_l1 float32, d_x, dqg float32 `[..., D]`)."""
    D, tokens = x.shape[-1], math.prod(x.shape[:-1])
    kernel = _merge_kernel(D, eps, scale, q.ndim > 1, True)
    d_o1, d_l1, d_x, dqg = _launch(
        kernel, [o1, l1, x, q, g, d_out, d_lse.astype(mx.float32)],
        [((tokens * D,), x.dtype), ((tokens,), mx.float32), ((tokens * D,), x.dtype),
         ((tokens * D,), mx.float32)], tokens, x.dtype)
    return d_o1.reshape(x.shape), d_l1.reshape(l1.shape), d_x.reshape(x.shape), dqg.reshape(
        x.shape)
