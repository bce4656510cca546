/* Fused CPU kernels of the default depth-attention op (softmax, key norm, one head;
 * spec 2.1-2.3 and 3.1-3.2, numerics C10).  Built at first use by attnres_torch/kernels/cpu_c.py with
 * the system C compiler (-O3 -march=native -fopenmp, falling back to pthreads) and called through
 * ctypes on tensor data pointers.
 *
 * Layout: every 2-D operand is rows x D with unit stride along D and its own row stride (in
 * elements; 0 broadcasts one row, used for a shared pseudo-query).  Sources, out and d_sources
 * share one storage dtype (DT_F32, DT_BF16 or DT_F16); qg = query * gain, lse, d_lse and d_qg
 * are fp32.  Each result is rounded once (C10.3) and no intermediate is narrower than fp32
 * (C10.2): the row sums over D are blocked (fp32 runs folded into float64, see row_sums) and the
 * per-row scalars (z, m, l, p, r, a, b) are float64 — the backward's dz = p (dp - <p, dp>)
 * cancels when one weight is near 1, where plain fp32 sums cost 10x the error of the chunked
 * torch kernel — while the vector work over D (weighted sums, gradients, d_qg) is fp32.
 *
 * One token row t at a time; its N source rows (N * D * size bytes) stay in L1/L2 between passes:
 *   forward   pass 1 reads x_i once for s_i = <x_i, qg> and |x_i|^2 (both sums in one sweep),
 *             z_i = scale * s_i * r_i, r_i = 1 / sqrt(|x_i|^2 / D + eps); max-subtracted softmax
 *             (C10.4; NaN-propagating max for C12); pass 2: out = sum_i p_i x_i from cache,
 *             a [OUT_VECS x VW] column tile in registers at a time.  On request the p_i of
 *             that softmax are written as the weights (return_weights: same logits, max, sum).
 *   key norm  |x_i|^2 whose fp32 runs overflow (|x| >= ~1.8e19) is re-summed in float64
 *             (sumsq_f64, only then): the key norm is scale-invariant (spec C10.6).
 *   backward  pass 1: s_i, |x_i|^2 and dp_i = <x_i, d_out> in one sweep, p_i recomputed from the
 *             logits (not from the fp32 lse); pass 2 writes dx_i = p_i d_out + a_i qg - b_i x_i
 *             and accumulates d_qg += a_i x_i (spec 2.3), the rows again from cache.
 *   phase 1   (spec 3.1) the forward with S queries: each source row is read from memory once and
 *             its row sums taken for every query from L1; S softmaxes and S weighted sums.
 *   merge     (spec 3.2) one pass over out1 and the partial sum: the partial's logit z2, then
 *             out = w1 out1 + w2 partial with w1 = sigmoid(lse1 - z2), w2 = sigmoid(z2 - lse1).
 *   out norm  (C17, spec 2.6; on request) the forward also writes out_normed = (rho y) w, with y
 *             the row's fp32 accumulator (before out's rounding, kept in an L1 scratch row) and
 *             rho = (mean(y^2) + eps_o)^-1/2 over all D (float64 row sum, C10.6 fallback).  The
 *             backward recomputes y the same way from the rows in cache (the same p and the same
 *             summation order as the forward: the same bits), folds d_out_normed into
 *             g_total = d_out + rho (a - yh <a, yh> / D) (a = d_out_normed w, yh = rho y) in an
 *             fp32 scratch row, and runs the unchanged VJP with g_total (dp_i = <x_i, g_total>
 *             in one more sweep from cache); d_out_norm_weight = sum_t d_out_normed yh is
 *             summed per block, then over blocks in block order, like a shared query's d_qg.
 * Every sum has a fixed order that depends only on D, never on the thread count (C15).  Rows are
 * cut into NBLK <= MAX_BLOCKS blocks fixed by T alone; threads take contiguous runs of blocks.  A
 * shared query's d_qg is summed per block into its own fp32 row, then the blocks are added in
 * block order: no atomics, and the bits do not depend on how many threads ran.  N and D are
 * unbounded (C16): scratch is malloc'ed.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__F16C__)
#include <immintrin.h> /* fp16 <-> fp32 vectors: GCC scalarizes the generic conversion */
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
/* fp32 elements per vector: 32 bytes (a ymm register; 2 x 128-bit without AVX), or 64 bytes (a
 * zmm register) in the build cpu_c.py makes for bfloat16 sources on AVX-512 hosts (-DATTNRES_WIDE):
 * measured on a 2-core Intel Xeon (Sapphire/Emerald Rapids class) VM, 1.2-1.35x faster bf16
 * kernels (the shift-widening is the bottleneck there), while fp32 was no faster (its backward
 * slower) and fp16 3.8x slower (no 16-lane F16C path).  The width sets the blocking of the row
 * sums, so the two builds differ in the last bits; each is thread-count independent (C15). */
#if defined(ATTNRES_WIDE) && defined(__AVX512F__) && defined(__AVX512BW__)
#define VW 16
#else
#define VW 8
#endif
#define OUT_VECS 8  /* forward pass 2: OUT_VECS x VW = 64 output columns in registers over N rows */
#define MIN_BLOCK_ROWS 16 /* rows are cut into blocks of >= 16 rows ... */
#define SUM_RUN 256 /* row sums: elements per fp32 run before folding into float64 (2 VW | SUM_RUN) */
#define PF_ROWS 1   /* software prefetch distance, in token rows (2 and 4 measured no better) */
#define MAX_BLOCKS 256    /* ... and at most 256 blocks (bounds the [NBLK, D] d_qg partials) */
#define INLINE static inline __attribute__((always_inline))

/* GCC/Clang vector extensions, lowered to the SIMD of -march=native.  No type is wider than the
 * target's registers (32 bytes, 64 only with AVX-512): wider generic vectors are kept in memory by
 * GCC (each accumulator update would become a store/load round trip). */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf4 __attribute__((vector_size(16)));
typedef double vd4 __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef _Float16 vh16 __attribute__((vector_size(VW * 2)));

/* ---- storage dtypes: load to fp32, store rounded to nearest even (as torch rounds) ---- */
INLINE float ld(int dt, const void *p, int64_t j) {
    if (dt == DT_F32) return ((const float *)p)[j];
    if (dt == DT_F16) return (float)((const _Float16 *)p)[j];
    uint32_t u = (uint32_t)((const uint16_t *)p)[j] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
INLINE void st(int dt, void *p, int64_t j, float v) {
    if (dt == DT_F32) {
        ((float *)p)[j] = v;
    } else if (dt == DT_F16) {
        ((_Float16 *)p)[j] = (_Float16)v;
    } else {
        uint32_t u;
        memcpy(&u, &v, 4);
        ((uint16_t *)p)[j] = (v != v) ? (uint16_t)0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}
INLINE vf ldv(int dt, const void *p, int64_t j) {
    vf f;
    if (dt == DT_F32) {
        memcpy(&f, (const float *)p + j, sizeof f);
    } else if (dt == DT_F16) {
#if defined(__F16C__) && VW == 8
        const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + j)));
        memcpy(&f, &w, sizeof f);
#else
        vh16 h;
        memcpy(&h, (const _Float16 *)p + j, sizeof h);
        f = __builtin_convertvector(h, vf);
#endif
    } else {
        vh h;
        memcpy(&h, (const uint16_t *)p + j, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
    }
    return f;
}
INLINE void stv(int dt, void *p, int64_t j, vf v) {
    if (dt == DT_F32) {
        memcpy((float *)p + j, &v, sizeof v);
    } else if (dt == DT_F16) {
#if defined(__F16C__) && VW == 8
        __m256 w;
        memcpy(&w, &v, sizeof w);
        _mm_storeu_si128((__m128i *)((uint16_t *)p + j), _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
        vh16 h = __builtin_convertvector(v, vh16);
        memcpy((_Float16 *)p + j, &h, sizeof h);
#endif
    } else {
        vu u;
        memcpy(&u, &v, sizeof u);
        vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        vu nan = (vu)(v != v);                         /* all ones where v is NaN */
        r = (r & ~nan) | (0x7fc0u & nan);
        vh h = __builtin_convertvector(r, vh);
        memcpy((uint16_t *)p + j, &h, sizeof h);
    }
}

INLINE double hsum(vd4 a) { /* lanes 0 + 2, 1 + 3, then the two: fixed order */
    return (a[0] + a[2]) + (a[1] + a[3]);
}

static inline double nan_max(double m, double z) { return (z > m || z != z) ? z : m; }

/* Row sums over D of one source row x: *s = <x, q>, *ss = <x, x> when ss is not NULL, and
 * *dp = <x, g> when g is not NULL.  Blocked summation: fp32 vector accumulators (2 x VW lanes) over runs of SUM_RUN
 * elements (each lane adds SUM_RUN / (2 VW) products in fp32), each run folded (fold8) into float64
 * accumulators; then a fixed tree over the lanes, then the tail in order.  The fp32 rounding
 * stays that of a 16-term sum whatever D is, at fp32 vector speed (summing in float64 throughout
 * made this loop compute-bound: 2x slower at D = 1024).
 * pf_x / pf_g (or NULL): the rows PF_ROWS tokens ahead, prefetched (into L2) as this one is read —
 * the hardware prefetchers stop at 4 KiB pages, and at D = 1024 fp32 each source row is a page. */
typedef float vf8 __attribute__((vector_size(32)));
/* 2 x VW fp32 lanes -> 8 (lanes k and k + 8 added: a fixed order) */
#if VW == 16
INLINE vf8 fold8(vf a) {
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
INLINE vf8 fold8(vf a) { return a; }
#endif
INLINE vd4 widen(vf8 a, int half) { /* lanes 4 half .. 4 half + 3 of a, as float64 */
    vf4 h = half ? __builtin_shufflevector(a, a, 4, 5, 6, 7) : __builtin_shufflevector(a, a, 0, 1, 2, 3);
    return __builtin_convertvector(h, vd4);
}

/* <x, x> with every square and sum in float64: the key norm of a row whose fp32 squares
 * overflow (|x_k| >= ~1.8e19).  The key norm is scale-invariant, so it must not go to r = 0
 * there (spec C10.6); float64 holds the sum of D squares of any finite fp32 (C10.2 allows the
 * wider sum).  Only called when the fast fp32 sum came out infinite: no cost otherwise. */
static double sumsq_f64(int dt, const void *x, int64_t d) {
    double acc = 0.0;
    for (int64_t j = 0; j < d; j++) {
        const double v = ld(dt, x, j);
        acc += v * v;
    }
    return acc;
}

INLINE void row_sums(int dt, const void *x, const float *q, const void *g, int64_t d, double *s,
                     double *ss, double *dp, const char *pf_x, const char *pf_g) {
    vd4 ds = {0}, dq = {0}, dg = {0};
    const int64_t es = dt == DT_F32 ? 4 : 2, full = d - d % (2 * VW);
    int64_t j = 0;
    while (j < full) {
        const int64_t end = j + SUM_RUN < full ? j + SUM_RUN : full;
        vf fs[2] = {{0}}, fq[2] = {{0}}, fg[2] = {{0}};
        for (; j < end; j += 2 * VW) {
            for (int64_t o = 0; o < 2 * VW * es; o += 64) { /* every 64-byte line of this step */
                if (pf_x) __builtin_prefetch(pf_x + j * es + o, 0, 1);
                if (pf_g) __builtin_prefetch(pf_g + j * es + o, 0, 1);
            }
            for (int k = 0; k < 2; k++) {
                const vf v = ldv(dt, x, j + VW * k);
                fs[k] += v * ldv(DT_F32, q, j + VW * k);
                if (ss) fq[k] += v * v;
                if (g) fg[k] += v * ldv(dt, g, j + VW * k);
            }
        }
        const vf8 s8 = fold8(fs[0] + fs[1]), q8 = fold8(fq[0] + fq[1]);
        ds += widen(s8, 0) + widen(s8, 1);
        if (ss) dq += widen(q8, 0) + widen(q8, 1);
        if (g) {
            const vf8 g8 = fold8(fg[0] + fg[1]);
            dg += widen(g8, 0) + widen(g8, 1);
        }
    }
    double ts = 0.0, tq = 0.0, tg = 0.0; /* the tail, in order */
    for (; j < d; j++) {
        double v = ld(dt, x, j);
        ts += v * q[j];
        if (ss) tq += v * v;
        if (g) tg += v * ld(dt, g, j);
    }
    *s = hsum(ds) + ts;
    if (ss) {
        *ss = hsum(dq) + tq;
        if (isinf(*ss)) *ss = sumsq_f64(dt, x, d); /* an fp32 square overflowed: C10.6 */
    }
    if (g) *dp = hsum(dg) + tg;
}

typedef struct {
    int64_t n, rows, dim, nblk, elsize;
    int dtype;
    const void *const *src; /* N pointers */
    const int64_t *src_rs;  /* N row strides */
    const float *qg;
    int64_t qg_rs;
    double eps, scale;
    /* forward: S = nq >= 1 queries qg + k * qg_qs (phase 1 when S > 1), out + k * out_qs,
     * lse + k * lse_qs */
    int64_t nq, qg_qs, out_qs, lse_qs;
    float *weights; /* [N, T] fp32 (row stride T) or NULL: query 0's p, the ones of its lse */
    void *out;
    int64_t out_rs;
    float *lse;
    /* merge (phase 2) */
    const void *out1;
    int64_t out1_rs;
    const float *lse1;
    /* fused output norm (C17): gain [D] fp32 or NULL (off), its eps; forward: out_normed;
     * backward: d_out_normed and the [NBLK, D] d_out_norm_weight partials */
    const float *onw;
    double on_eps;
    void *normed;
    int64_t normed_rs;
    const void *d_normed;
    int64_t d_normed_rs;
    float *on_partials;
    /* backward */
    const void *d_out;
    int64_t d_out_rs;
    const float *d_lse;
    void *const *d_src;
    const int64_t *d_src_rs;
    float *d_qg;     /* [D] (shared query) or [T, D] (per-token, row stride D) */
    float *partials; /* [NBLK, D] fp32, shared query only */
    int64_t blk0, blk1;
    int failed;
} job_t;

static inline int64_t block_start(const job_t *j, int64_t b) { return b * j->rows / j->nblk; }

INLINE const void *row_ptr(const void *base, int64_t rs, int64_t t, int64_t elsize) {
    return (const char *)base + t * rs * elsize;
}

/* out_row = sum_i p_i x_i(t) for one token row: the N rows from cache, an [OUT_VECS x VW] column
 * tile of out in registers at a time.  o (storage dtype) and y (the fp32 accumulator, unrounded:
 * the output norm's y) may each be NULL. */
INLINE void weighted_row(int dt, const job_t *j, int64_t t, const float *p, void *o, float *y) {
    const int64_t n = j->n, d = j->dim, es = j->elsize;
    int64_t c = 0;
    for (; c + OUT_VECS * VW <= d; c += OUT_VECS * VW) {
        vf acc[OUT_VECS] = {{0}};
        for (int64_t i = 0; i < n; i++) {
            const void *x = row_ptr(j->src[i], j->src_rs[i], t, es);
            for (int k = 0; k < OUT_VECS; k++) acc[k] += p[i] * ldv(dt, x, c + k * VW);
        }
        for (int k = 0; k < OUT_VECS; k++) {
            if (o) stv(dt, o, c + k * VW, acc[k]);
            if (y) memcpy(y + c + k * VW, &acc[k], sizeof acc[k]);
        }
    }
    for (; c + VW <= d; c += VW) {
        vf acc = {0};
        for (int64_t i = 0; i < n; i++) acc += p[i] * ldv(dt, row_ptr(j->src[i], j->src_rs[i], t, es), c);
        if (o) stv(dt, o, c, acc);
        if (y) memcpy(y + c, &acc, sizeof acc);
    }
    for (; c < d; c++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) acc += p[i] * ld(dt, row_ptr(j->src[i], j->src_rs[i], t, es), c);
        if (o) st(dt, o, c, acc);
        if (y) y[c] = acc;
    }
}

/* C17: rho = (mean(y^2) + eps_o)^-1/2 of an fp32 row y [D], the sum of squares in the blocked
 * fp32/float64 order of row_sums, re-summed in float64 where an fp32 square overflowed (C10.6).
 * (or underflowed: tiny rows with a tiny eps_o).  NaN/Inf in y give a NaN/0 rho and so NaN
 * out_normed (C12). */
static double out_norm_rho(const float *y, int64_t d, double eps_o) {
    double ss;
    row_sums(DT_F32, y, y, NULL, d, &ss, NULL, NULL, NULL, NULL);
    if (isinf(ss) || ss < 1e-30 * (double)d) ss = sumsq_f64(DT_F32, y, d); /* fp32 squares over/underflowed */
    return 1.0 / sqrt(ss / (double)d + eps_o);
}

/* yh = rho y in place (fp32, one factor: rho y never as rho^3 y ...); in float64 where rho is
 * outside the normal fp32 range (|y| near the fp32 maximum, or a tiny eps_o). */
static void scale_row(float *y, int64_t d, double rho) {
    if (rho >= FLT_MIN && rho <= FLT_MAX) {
        const float rf = (float)rho;
        int64_t c = 0;
        for (; c + VW <= d; c += VW) {
            vf v;
            memcpy(&v, y + c, sizeof v);
            v *= rf;
            memcpy(y + c, &v, sizeof v);
        }
        for (; c < d; c++) y[c] *= rf;
    } else {
        for (int64_t c = 0; c < d; c++) y[c] = (float)(rho * (double)y[c]);
    }
}

/* out_normed row = yh w (C17), rounded once to the storage dtype; yh = rho y (scale_row). */
INLINE void out_norm_store(int dt, const float *yh, const float *w, int64_t d, void *o) {
    int64_t c = 0;
    for (; c + VW <= d; c += VW) stv(dt, o, c, ldv(DT_F32, yh, c) * ldv(DT_F32, w, c));
    for (; c < d; c++) st(dt, o, c, yh[c] * w[c]);
}

/* The max-subtracted softmax of z[0..n) (C10.4; NaN-propagating max for C12) into p (fp32);
 * returns lse.  z is overwritten. */
INLINE double softmax_row(double *z, int64_t n, float *p) {
    double m = -INFINITY, l = 0.0;
    for (int64_t i = 0; i < n; i++) m = nan_max(m, z[i]);
    for (int64_t i = 0; i < n; i++) l += (z[i] = exp(z[i] - m));
    for (int64_t i = 0; i < n; i++) p[i] = (float)(z[i] / l);
    return m + log(l);
}

/* ---- forward and phase 1: for the rows of blocks [blk0, blk1) and each of the S queries,
 * out[k][t] and lse[k][t]; each source row is read from memory once for all S (spec 3.1).
 * z: S x N doubles, p: N floats. ---- */
INLINE void forward_rows(int dt, job_t *j, double *z, float *p, float *y) {
    const int64_t n = j->n, d = j->dim, es = j->elsize, nq = j->nq;
    for (int64_t t = block_start(j, j->blk0); t < block_start(j, j->blk1); t++) {
        for (int64_t i = 0; i < n; i++) {
            const void *x = row_ptr(j->src[i], j->src_rs[i], t, es);
            const char *pf = t + PF_ROWS < j->rows ? row_ptr(j->src[i], j->src_rs[i], t + PF_ROWS, es) : NULL;
            double s, ss;
            row_sums(dt, x, j->qg + t * j->qg_rs, NULL, d, &s, &ss, NULL, pf, NULL);
            const double r = 1.0 / sqrt(ss / (double)d + j->eps);
            z[i] = j->scale * (s * r);
            for (int64_t k = 1; k < nq; k++) { /* the other queries find x in L1 */
                row_sums(dt, x, j->qg + k * j->qg_qs + t * j->qg_rs, NULL, d, &s, NULL, NULL, NULL, NULL);
                z[k * n + i] = j->scale * (s * r);
            }
        }
        for (int64_t k = 0; k < nq; k++) {
            j->lse[k * j->lse_qs + t] = (float)softmax_row(z + k * n, n, p);
            if (k == 0 && j->weights) /* the p of this lse: same logits, max and sum */
                for (int64_t i = 0; i < n; i++) j->weights[i * j->rows + t] = p[i];
            weighted_row(dt, j, t, p, (char *)j->out + (k * j->out_qs + t * j->out_rs) * es,
                         k == 0 ? y : NULL);
            if (k == 0 && y) { /* C17: out_normed from the same fp32 accumulator */
                scale_row(y, d, out_norm_rho(y, d, j->on_eps));
                out_norm_store(dt, y, j->onw, d, (char *)j->normed + t * j->normed_rs * es);
            }
        }
    }
}

/* ---- phase 2 merge (spec 3.2): out = w1 out1 + w2 partial, w1 = sigmoid(lse1 - z2),
 * w2 = sigmoid(z2 - lse1), lse = logaddexp(lse1, z2), z2 the partial's logit; the partial is src[0]. ---- */
INLINE void merge_rows(int dt, job_t *j) {
    const int64_t d = j->dim, es = j->elsize;
    for (int64_t t = block_start(j, j->blk0); t < block_start(j, j->blk1); t++) {
        const void *x = row_ptr(j->src[0], j->src_rs[0], t, es);
        const void *o1 = row_ptr(j->out1, j->out1_rs, t, es);
        double s, ss;
        row_sums(dt, x, j->qg + t * j->qg_rs, NULL, d, &s, &ss, NULL,
                 t + PF_ROWS < j->rows ? row_ptr(j->src[0], j->src_rs[0], t + PF_ROWS, es) : NULL,
                 t + PF_ROWS < j->rows ? row_ptr(j->out1, j->out1_rs, t + PF_ROWS, es) : NULL);
        const double z2 = j->scale * (s / sqrt(ss / (double)d + j->eps)), l1 = j->lse1[t];
        const double m = nan_max(l1, z2);
        j->lse[t] = (float)(m + log(exp(l1 - m) + exp(z2 - m)));
        /* C10.7: each weight from its own logistic (1 - w1 would keep few of a small w2's bits) */
        const float w1 = (float)(1.0 / (1.0 + exp(z2 - l1)));
        const float w2 = (float)(1.0 / (1.0 + exp(l1 - z2)));
        void *o = (char *)j->out + t * j->out_rs * es;
        int64_t c = 0;
        for (; c + VW <= d; c += VW) stv(dt, o, c, w1 * ldv(dt, o1, c) + w2 * ldv(dt, x, c));
        for (; c < d; c++) st(dt, o, c, w1 * ld(dt, o1, c) + w2 * ld(dt, x, c));
    }
}

/* C17 backward prologue of one token row, y [D] = the row's fp32 accumulator (recomputed):
 * y <- yh = rho y; gt [D] <- g_total = d_out + rho (a - yh <a, yh> / D), a = d_out_normed w (fp32,
 * <a, yh> in the blocked float64 order of row_sums); on_blk [D] += d_out_normed yh. */
INLINE void out_norm_prologue(int dt, const job_t *j, int64_t t, float *y, float *gt, float *on_blk) {
    const int64_t d = j->dim, es = j->elsize;
    const void *g = row_ptr(j->d_out, j->d_out_rs, t, es);
    const void *gn = row_ptr(j->d_normed, j->d_normed_rs, t, es);
    const double rho = out_norm_rho(y, d, j->on_eps);
    scale_row(y, d, rho);
    int64_t c = 0;
    for (; c + VW <= d; c += VW) {
        const vf vgn = ldv(dt, gn, c);
        stv(DT_F32, gt, c, vgn * ldv(DT_F32, j->onw, c));
        stv(DT_F32, on_blk, c, ldv(DT_F32, on_blk, c) + vgn * ldv(DT_F32, y, c));
    }
    for (; c < d; c++) {
        const float vgn = ld(dt, gn, c);
        gt[c] = vgn * j->onw[c];
        on_blk[c] += vgn * y[c];
    }
    double ay;
    row_sums(DT_F32, gt, y, NULL, d, &ay, NULL, NULL, NULL, NULL);
    if (rho >= FLT_MIN && rho <= FLT_MAX) {
        const float rf = (float)rho, cf = (float)(ay / (double)d);
        for (c = 0; c + VW <= d; c += VW)
            stv(DT_F32, gt, c, ldv(dt, g, c) + rf * (ldv(DT_F32, gt, c) - ldv(DT_F32, y, c) * cf));
        for (; c < d; c++) gt[c] = ld(dt, g, c) + rf * (gt[c] - y[c] * cf);
    } else {
        const double cd = ay / (double)d;
        for (c = 0; c < d; c++) gt[c] = (float)(ld(dt, g, c) + rho * (gt[c] - y[c] * cd));
    }
}

/* ---- backward: d_src[t] for the rows of blocks [blk0, blk1); d_qg per token or per block ----
 * st: 4 N doubles (r, s, p, dp per source).  ON (the output norm; then GDT = DT_F32): sc holds
 * p (N floats), y and g_total ([D] floats each), and g_total replaces d_out (GDT: its dtype).
 * co: 3 N floats, the per-source coefficients (p, a, b) of the gradient sweep; rp: 2 N
 * pointers, the token's source rows and gradient rows (formed once per token, not per tile).
 *
 * The gradient sweep walks D in VW-wide column tiles and, inside a tile, every source: the
 * tile's g, q and d_qg stay in registers across the N sources, so per source element it loads
 * x (from cache) and stores dx only, instead of also reloading g and q and reading and writing
 * d_qg once per source.  d_qg still adds the sources in order 0..N-1 for every column, and dx
 * is the same expression: the bits are those of a source-by-source sweep. */
INLINE void backward_rows(int dt, int on, job_t *j, double *st_, float *sc, float *co, void **rp) {
    const int64_t n = j->n, d = j->dim, es = j->elsize;
    const int gdt = on ? DT_F32 : dt;
    double *rr = st_, *sq = st_ + n, *pp = st_ + 2 * n, *dpp = st_ + 3 * n;
    float *cp = co, *ca = co + n, *cb = co + 2 * n;
    float *pf32 = on ? sc : NULL, *yrow = on ? sc + n : NULL, *gt = on ? sc + n + d : NULL;
    for (int64_t b = j->blk0; b < j->blk1; b++) {
        float *dq_blk = NULL, *on_blk = NULL;
        if (j->qg_rs == 0) {
            dq_blk = j->partials + b * d;
            memset(dq_blk, 0, (size_t)d * sizeof(float));
        }
        if (on) {
            on_blk = j->on_partials + b * d;
            memset(on_blk, 0, (size_t)d * sizeof(float));
        }
        for (int64_t t = block_start(j, b); t < block_start(j, b + 1); t++) {
            const float *q = j->qg + t * j->qg_rs;
            const void *g = on ? (const void *)gt : row_ptr(j->d_out, j->d_out_rs, t, es);
            double m = -INFINITY, l = 0.0, base = j->d_lse ? j->d_lse[t] : 0.0;
            for (int64_t i = 0; i < n; i++) {
                double s, ss, dp = 0.0;
                const int pf = t + PF_ROWS < j->rows;
                row_sums(dt, row_ptr(j->src[i], j->src_rs[i], t, es), q, on ? NULL : g, d, &s, &ss, &dp,
                         pf ? row_ptr(j->src[i], j->src_rs[i], t + PF_ROWS, es) : NULL,
                         pf && i == 0 && !on ? row_ptr(j->d_out, j->d_out_rs, t + PF_ROWS, es) : NULL);
                rr[i] = 1.0 / sqrt(ss / (double)d + j->eps);
                sq[i] = s;
                pp[i] = j->scale * (s * rr[i]);
                dpp[i] = dp;
                m = nan_max(m, pp[i]);
            }
            for (int64_t i = 0; i < n; i++) l += (pp[i] = exp(pp[i] - m));
            if (on) { /* C17: y as the forward formed it (same p, same order), then g_total */
                for (int64_t i = 0; i < n; i++) pf32[i] = (float)(pp[i] / l);
                weighted_row(dt, j, t, pf32, NULL, yrow);
                out_norm_prologue(dt, j, t, yrow, gt, on_blk);
                for (int64_t i = 0; i < n; i++) { /* dp_i = <x_i, g_total>, the rows from cache */
                    double s;
                    row_sums(dt, row_ptr(j->src[i], j->src_rs[i], t, es), gt, NULL, d, &s, NULL, NULL,
                             NULL, NULL);
                    dpp[i] = s;
                }
            }
            for (int64_t i = 0; i < n; i++) base -= (pp[i] /= l) * dpp[i];
            float *dq = dq_blk ? dq_blk : j->d_qg + t * d;
            if (!dq_blk) memset(dq, 0, (size_t)d * sizeof(float));
            for (int64_t i = 0; i < n; i++) {
                const double a_ = pp[i] * (dpp[i] + base) * (j->scale * rr[i]);
                cp[i] = (float)pp[i], ca[i] = (float)a_;
                cb[i] = (float)(a_ * sq[i] * rr[i] * rr[i] / (double)d);
                rp[i] = (void *)row_ptr(j->src[i], j->src_rs[i], t, es);
                rp[n + i] = (char *)j->d_src[i] + t * j->d_src_rs[i] * es;
            }
            int64_t c = 0;
            for (; c + VW <= d; c += VW) {
                const vf gv = ldv(gdt, g, c), qv = ldv(DT_F32, q, c);
                vf dqv = ldv(DT_F32, dq, c);
                for (int64_t i = 0; i < n; i++) {
                    const vf v = ldv(dt, rp[i], c);
                    stv(dt, rp[n + i], c, cp[i] * gv + ca[i] * qv - cb[i] * v);
                    dqv += ca[i] * v;
                }
                stv(DT_F32, dq, c, dqv);
            }
            for (; c < d; c++) {
                const float gc = ld(gdt, g, c), qc = q[c];
                float dqc = dq[c];
                for (int64_t i = 0; i < n; i++) {
                    const float v = ld(dt, rp[i], c);
                    st(dt, rp[n + i], c, cp[i] * gc + ca[i] * qc - cb[i] * v);
                    dqc += ca[i] * v;
                }
                dq[c] = dqc;
            }
        }
    }
}

/* Fresh outputs: each thread prefaults its own rows of every output it is about to write with
 * one madvise(MADV_POPULATE_WRITE) (Linux >= 5.14) instead of one page fault per 4 KiB page as
 * the kernel's stores reach them.  It writes no data and does not change how the memory is
 * backed (unlike the MADV_HUGEPAGE opt-in below); on pages already present it only walks the
 * page table.  On this project's VM a fresh 32 MiB fill took 9.5 ms, 4.9 ms after the populate
 * (reused: 1.2 ms).  Only dense outputs (row stride D: no gaps whose pages the kernel would not
 * touch) and only the whole pages inside the thread's rows are advised (the edges fault as
 * usual); spans under POPULATE_MIN are left alone (a syscall per small call), and so are spans
 * whose first page is already resident (mincore): memory the allocator hands back from its heap
 * is usually all resident, and populating it walks every page for nothing (bf16 [8192, 1024]:
 * 0.4 ms of a 10 ms call); errors
 * (an older kernel's EINVAL, a read-only mapping) are ignored: the stores then fault as before.
 * attnres_set_populate(0) turns it off (ATTNRES_TORCH_POPULATE=0 in cpu_c.py). */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define POPULATE_MIN ((int64_t)1 << 20)
static int populate = 1;

void attnres_set_populate(int on) { populate = on; }

static void populate_rows(const job_t *j, const void *base, int64_t rs) {
#if defined(__linux__)
    const int64_t r0 = block_start(j, j->blk0), r1 = block_start(j, j->blk1);
    if (!populate || !base || r1 <= r0 || rs != j->dim) return;
    static uintptr_t page = 0;
    if (!page) {
        const long ps = sysconf(_SC_PAGESIZE);
        page = ps > 0 ? (uintptr_t)ps : 4096;
    }
    uintptr_t a = (uintptr_t)base + (uintptr_t)(r0 * rs * j->elsize);
    uintptr_t e = (uintptr_t)base + (uintptr_t)(((r1 - 1) * rs + j->dim) * j->elsize);
    a = (a + page - 1) & ~(page - 1), e &= ~(page - 1);
    if (e <= a || (int64_t)(e - a) < POPULATE_MIN) return;
    unsigned char resident = 0;
    if (mincore((void *)a, page, &resident) == 0 && (resident & 1)) return; /* reused memory */
    (void)madvise((void *)a, e - a, MADV_POPULATE_WRITE);
#else
    (void)j, (void)base, (void)rs;
#endif
}

static void *forward_worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t k = 0; k < j->nq; k++) populate_rows(j, (char *)j->out + k * j->out_qs * j->elsize, j->out_rs);
    if (j->onw) populate_rows(j, j->normed, j->normed_rs);
    double *z = (double *)malloc((size_t)(j->n * j->nq) * sizeof(double));
    float *p = (float *)malloc((size_t)j->n * sizeof(float));
    float *y = j->onw ? (float *)malloc((size_t)j->dim * sizeof(float)) : NULL;
    if (!z || !p || (j->onw && !y)) j->failed = 1;
    else if (j->dtype == DT_F32) forward_rows(DT_F32, j, z, p, y);
    else if (j->dtype == DT_BF16) forward_rows(DT_BF16, j, z, p, y);
    else forward_rows(DT_F16, j, z, p, y);
    free(z), free(p), free(y);
    return NULL;
}

static void *merge_worker(void *arg) {
    job_t *j = (job_t *)arg;
    populate_rows(j, j->out, j->out_rs);
    if (j->dtype == DT_F32) merge_rows(DT_F32, j);
    else if (j->dtype == DT_BF16) merge_rows(DT_BF16, j);
    else merge_rows(DT_F16, j);
    return NULL;
}

static void *backward_worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t i = 0; i < j->n; i++) populate_rows(j, j->d_src[i], j->d_src_rs[i]);
    double *stats = (double *)malloc((size_t)j->n * 4 * sizeof(double));
    float *sc = j->onw ? (float *)malloc((size_t)(j->n + 2 * j->dim) * sizeof(float)) : NULL;
    float *co = (float *)malloc((size_t)j->n * 3 * sizeof(float));
    void **rp = (void **)malloc((size_t)j->n * 2 * sizeof(void *));
    if (!stats || !co || !rp || (j->onw && !sc)) j->failed = 1;
    else if (j->onw && j->dtype == DT_F32) backward_rows(DT_F32, 1, j, stats, sc, co, rp);
    else if (j->onw && j->dtype == DT_BF16) backward_rows(DT_BF16, 1, j, stats, sc, co, rp);
    else if (j->onw) backward_rows(DT_F16, 1, j, stats, sc, co, rp);
    else if (j->dtype == DT_F32) backward_rows(DT_F32, 0, j, stats, NULL, co, rp);
    else if (j->dtype == DT_BF16) backward_rows(DT_BF16, 0, j, stats, NULL, co, rp);
    else backward_rows(DT_F16, 0, j, stats, NULL, co, rp);
    free(stats), free(sc), free(co), free(rp);
    return NULL;
}

static int64_t num_blocks(int64_t rows) {
    int64_t nb = (rows + MIN_BLOCK_ROWS - 1) / MIN_BLOCK_ROWS;
    return nb < 1 ? 1 : (nb > MAX_BLOCKS ? MAX_BLOCKS : nb);
}

/* Runs `work` over `proto`'s blocks on `threads` threads, each taking a contiguous run of blocks
 * (the bits do not depend on the split).  Built with -fopenmp, the threads are the OpenMP team of
 * the libgomp that torch already loaded (the same soname resolves to the loaded library), so the
 * kernel shares torch's intra-op pool: with a private pthread team, torch's OpenMP workers, still
 * spinning after the previous torch op, took the cores from it (1.3x slower back to back).
 * Without OpenMP, pthreads.  Returns 0, or -1 when a thread or its scratch could not be had. */
static int run_blocks(job_t *proto, int threads, void *(*work)(void *)) {
    const int64_t nblk = proto->nblk;
    if (threads < 1) threads = 1;
    if (threads > nblk) threads = (int)nblk;
    job_t *jobs = (job_t *)calloc((size_t)threads, sizeof(job_t));
    if (!jobs) return -1;
    for (int k = 0; k < threads; k++) {
        jobs[k] = *proto;
        jobs[k].blk0 = k * nblk / threads;
        jobs[k].blk1 = (k + 1) * nblk / threads;
    }
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int k = 0; k < threads; k++) work(&jobs[k]);
#else
    pthread_t *tids = (pthread_t *)calloc((size_t)threads, sizeof(pthread_t));
    int *started = (int *)calloc((size_t)threads, sizeof(int));
    if (!tids || !started) {
        free(jobs), free(tids), free(started);
        return -1;
    }
    for (int k = 1; k < threads; k++) started[k] = pthread_create(&tids[k], NULL, work, &jobs[k]) == 0;
    work(&jobs[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k]) pthread_join(tids[k], NULL);
        else work(&jobs[k]); /* no thread: run its blocks here */
    }
    free(tids), free(started);
#endif
    int rc = 0;
    for (int k = 0; k < threads; k++) rc |= jobs[k].failed ? -1 : 0;
    free(jobs);
    return rc;
}

/* Outputs are usually fresh allocations whose pages the kernel touches first.  On this project's
 * VMs a 4 KiB first-touch fault costs about as much as reading 10x its bytes.  Opt-in
 * (attnres_set_hugepages(1)): the 2 MiB-aligned interior of an output of >= HUGE_MIN bytes is
 * advised MADV_HUGEPAGE (one fault per 2 MiB; only pages wholly inside the output).  Off by
 * default, like PyTorch's THP_MEM_ALLOC_ENABLE: it changes how the caller's memory is backed, and
 * on these VMs it gave occasional 3x slower calls (backing huge pages) next to a 1.3x faster
 * median. */
#define HUGE_MIN ((int64_t)8 << 20)
static int hugepages = 0;

void attnres_set_hugepages(int on) { hugepages = on; }

/* The vector width of this build, in fp32 lanes (8, or 16 in the AVX-512 bf16 build). */
int attnres_vector_width(void) { return VW; }

static void advise_huge(const void *p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1), e = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
    if (hugepages && bytes >= HUGE_MIN && e > a) (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)p, (void)bytes;
#endif
}

static int64_t elsize_of(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* out [T, D] (sources' dtype), lse [T] (fp32, contiguous) and, when weights is not NULL, the
 * softmax weights [N, T] (fp32, contiguous) of that lse; when onw ([D] fp32) is not NULL also
 * out_normed [T, D] (sources' dtype, row stride normed_rs) with eps on_eps (C17).
 * Returns 0 or -1. */
int attnres_forward(int dtype, int64_t n, int64_t rows, int64_t dim, const void *const *src,
                    const int64_t *src_rs, const float *qg, int64_t qg_rs, double eps, double scale,
                    void *out, int64_t out_rs, float *lse, float *weights, const float *onw,
                    double on_eps, void *normed, int64_t normed_rs, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.n = n, j.rows = rows, j.dim = dim, j.dtype = dtype, j.elsize = elsize_of(dtype);
    j.nblk = num_blocks(rows);
    j.src = src, j.src_rs = src_rs, j.qg = qg, j.qg_rs = qg_rs, j.eps = eps, j.scale = scale;
    j.nq = 1, j.out = out, j.out_rs = out_rs, j.lse = lse, j.weights = weights;
    j.onw = onw, j.on_eps = on_eps, j.normed = normed, j.normed_rs = normed_rs;
    advise_huge(out, rows > 0 ? ((rows - 1) * out_rs + dim) * j.elsize : 0);
    if (onw) advise_huge(normed, rows > 0 ? ((rows - 1) * normed_rs + dim) * j.elsize : 0);
    return run_blocks(&j, threads, forward_worker);
}

/* Phase 1: S queries qgs [S, D] (fp32, contiguous) over N sources; out [S, T, D] with query
 * stride out_qs and row stride out_rs (sources' dtype), lse [S, T] contiguous fp32. */
int attnres_multi_forward(int dtype, int64_t n, int64_t nq, int64_t rows, int64_t dim,
                          const void *const *src, const int64_t *src_rs, const float *qgs,
                          double eps, double scale, void *out, int64_t out_qs, int64_t out_rs,
                          float *lse, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.n = n, j.rows = rows, j.dim = dim, j.dtype = dtype, j.elsize = elsize_of(dtype);
    j.nblk = num_blocks(rows);
    j.src = src, j.src_rs = src_rs, j.qg = qgs, j.qg_rs = 0, j.eps = eps, j.scale = scale;
    j.nq = nq, j.qg_qs = dim, j.out = out, j.out_qs = out_qs, j.out_rs = out_rs;
    j.lse = lse, j.lse_qs = rows;
    advise_huge(out, rows > 0 ? ((nq - 1) * out_qs + (rows - 1) * out_rs + dim) * j.elsize : 0);
    return run_blocks(&j, threads, forward_worker);
}

/* Phase 2: out [T, D] and lse [T] from out1 [T, D] (partial's dtype), lse1 [T] (fp32,
 * contiguous), partial [T, D] and qg ([D] when qg_rs == 0, else [T, D]). */
int attnres_merge_forward(int dtype, int64_t rows, int64_t dim, const void *out1, int64_t out1_rs,
                          const float *lse1, const void *partial, int64_t partial_rs,
                          const float *qg, int64_t qg_rs, double eps, double scale, void *out,
                          int64_t out_rs, float *lse, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    const void *src[1] = {partial};
    const int64_t src_rs[1] = {partial_rs};
    j.n = 1, j.rows = rows, j.dim = dim, j.dtype = dtype, j.elsize = elsize_of(dtype);
    j.nblk = num_blocks(rows);
    j.src = src, j.src_rs = src_rs, j.qg = qg, j.qg_rs = qg_rs, j.eps = eps, j.scale = scale;
    j.out1 = out1, j.out1_rs = out1_rs, j.lse1 = lse1, j.out = out, j.out_rs = out_rs, j.lse = lse;
    advise_huge(out, rows > 0 ? ((rows - 1) * out_rs + dim) * j.elsize : 0);
    return run_blocks(&j, threads, merge_worker);
}

/* Sums the [NBLK, D] partials into out [D] in block order (deterministic, thread-count free). */
static void sum_blocks(const float *partials, int64_t nblk, int64_t dim, float *out) {
    for (int64_t c = 0; c < dim; c++) out[c] = 0.0f;
    for (int64_t b = 0; b < nblk; b++) {
        const float *pb = partials + b * dim;
        for (int64_t c = 0; c < dim; c++) out[c] += pb[c];
    }
}

/* d_src N x [T, D] (sources' dtype) and d_qg: [D] when qg_rs == 0 (summed over tokens in block
 * order), else [T, D] contiguous; d_lse may be NULL.  With onw ([D] fp32, C17) the cotangent of
 * out_normed d_normed [T, D] (sources' dtype, row stride d_normed_rs) is folded in and d_onw [D]
 * (fp32) written.  Returns 0 or -1. */
int attnres_backward(int dtype, int64_t n, int64_t rows, int64_t dim, const void *const *src,
                     const int64_t *src_rs, const float *qg, int64_t qg_rs, const void *d_out, int64_t d_out_rs, const float *d_lse, double eps,
                     double scale, void *const *d_src, const int64_t *d_src_rs, float *d_qg,
                     const void *d_normed, int64_t d_normed_rs, const float *onw, double on_eps,
                     float *d_onw, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.n = n, j.rows = rows, j.dim = dim, j.dtype = dtype, j.elsize = elsize_of(dtype);
    j.nblk = num_blocks(rows);
    j.src = src, j.src_rs = src_rs, j.qg = qg, j.qg_rs = qg_rs, j.eps = eps, j.scale = scale;
    j.d_out = d_out, j.d_out_rs = d_out_rs, j.d_lse = d_lse;
    j.d_src = d_src, j.d_src_rs = d_src_rs, j.d_qg = d_qg;
    for (int64_t i = 0; i < n && rows > 0; i++) advise_huge(d_src[i], ((rows - 1) * d_src_rs[i] + dim) * j.elsize);
    j.d_normed = d_normed, j.d_normed_rs = d_normed_rs, j.onw = onw, j.on_eps = on_eps;
    if (qg_rs == 0) {
        j.partials = (float *)malloc((size_t)(j.nblk * dim) * sizeof(float));
        if (!j.partials) return -1;
    }
    if (onw) {
        j.on_partials = (float *)malloc((size_t)(j.nblk * dim) * sizeof(float));
        if (!j.on_partials) {
            free(j.partials);
            return -1;
        }
    }
    int rc = run_blocks(&j, threads, backward_worker);
    if (rc == 0 && qg_rs == 0) sum_blocks(j.partials, j.nblk, dim, d_qg);
    if (rc == 0 && onw) sum_blocks(j.on_partials, j.nblk, dim, d_onw);
    free(j.partials), free(j.on_partials);
    return rc;
}
