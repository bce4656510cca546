"""The layer-scanned Full AttnRes stack with its own backward (`scan_apply(backward="fused")`).

Spec M2 over a history buffer `X [..., L + 1, D]` (row j = v_j, in the stream's dtype; the rows
sit beside the channels) read by every sublayer l through the masked prefix read of rows
0..l-1 (section 2.1, one query set):

    r_i = 1 / sqrt(mean(x_i ** 2) + eps)   (per head; 1 without key norm)
    s_i = <qg_l, x_i>,  z_i = scale * r_i * s_i,  p = softmax_i(z) or sigmoid(z_i),  rows i >= l: p_i = 0
    h_l = sum_i p_i x_i

What makes it cheap at depth, against `lax.scan`'s own autodiff of the shared schedule:
  - r_i is computed once, when row i is written, into a side buffer `[..., L + 1, H]`; no read
    re-normalizes the history, and dL/dr_i, accumulated over the reads as u_i = r_i dL/dr_i
    `[..., L + 1, H]`, reaches v_i once, at its write step in the backward;
  - the forward keeps the final buffer only (rows are written once, so every read's rows are
    the final buffer's first l rows; the later rows are masked, weight and gradient exactly 0),
    plus per read its weights p and logits z `[..., R', H]` and per sublayer JAX's own VJP
    residuals of the sublayer (or, with remat="recompute", only its input);
  - the backward is one reverse scan whose carry is the buffer's cotangent `[..., L + 1, D]`:
    each read adds p_i g + (dL/ds_i) qg to its rows (no masked-zero buffer per step); the
    queries' gradients sum_i (dL/ds_i) x_i of all reads of a stage are one contraction at the
    end of the stage;
  - per token, the logits, the output sum and <g, x_i> are matrix-vector products over the rows,
    one dot each; a scan step reads the buffer it entered with (plus its own earlier outputs)
    and writes its rows once, at its end.
Passes over the history per sublayer: two in the forward (logits, output sum), two in the
backward (<g, x_i>, the cotangent update).  `stages` splits the scan into consecutive scans
whose buffers hold only the rows written so far (as in `scan_apply`).

Numerics (C10): every statistic in the compute dtype, the read's output rounded once to the
stream's dtype.  Not here (`scan_apply` runs them on the shared schedule): input-dependent queries,
M13 low-rank keys, mix = 0, remat="offload".
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from attnres_core.config import ResidualConfig

from ._args import Options, compute_dtype
from ._math import HIGHEST
from .kernels.xla import _head_rms, out_norm
from .residual_ops import JaxOps

#: The memory modes the fused backward runs (None: keep each sublayer's VJP residuals;
#: "recompute": keep its input and recompute its VJP in the backward).
REMATS = (None, "recompute")


def unsupported(config: ResidualConfig, mix, remat) -> Optional[str]:
    """None where `full_scan` runs this call, else why not (one line).  mix as
    `attnres_core.schedule.check_mix` returns it."""
    if config.kind != "full":
        return f"kind={config.kind!r} (it runs kind='full')"
    if config.query != "static":
        return f"query={config.query!r} (it runs static pseudo-queries)"
    if config.key_rank is not None:
        return f"key_rank={config.key_rank} (M13 low-rank keys)"
    if isinstance(mix, float) and mix == 0.0:
        return "mix=0 (no depth attention at all)"
    if remat not in REMATS:
        return f"remat={remat!r} (it runs remat None or 'recompute')"
    return None


def _spread(v, num_heads: int, dim: int):
    """Per-head values `[..., H]` -> broadcastable to `[..., D]` (`[..., 1]` for one head)."""
    if num_heads == 1:
        return v
    return jnp.repeat(v, dim // num_heads, axis=-1)


def full_scan(config: ResidualConfig, embedding, qg, sublayers: Sequence[Callable], layer_params, *,
              out_norm_weights=None, mix=None, stages: int = 1, unroll: int = 1,
              remat: Optional[str] = None):
    """h_{L+1} of the Full AttnRes stack, scanned: `scan_apply`'s result for kind="full".

    Args:
      config: kind "full", static queries, no key_rank, with any per-call scale already applied
        (`attnres_core.schedule.call_scale`).
      embedding: v_0 `[..., D]`.
      qg: `[L + 1, D]` in the compute dtype: row l - 1 = query * norm_weight (times an array
        call scale) of sublayer l's read, row L the output's (M4, M11 rows already gathered).
      sublayers: P callables `f_j(p, h [..., D]) -> v [..., D]`.
      layer_params: pytree of leaves `[n, ...]`, L = n * P.
      out_norm_weights: `[R, D]` (M15, `config.fuse_out_norm`) or None.
      mix: None, a float in (0, 1) or a 0-d array (M10, as `check_mix` returns it).
      stages, unroll: as in `scan_apply`.  remat: None or "recompute".

    Returns: out `[..., D]` in the embedding's dtype.
    """
    leaves = jax.tree_util.tree_leaves(layer_params)
    n, period = leaves[0].shape[0], len(sublayers)
    num_layers = n * period
    sdt, dim = embedding.dtype, embedding.shape[-1]
    ct = compute_dtype(sdt)
    heads, head_dim = config.num_heads, dim // config.num_heads
    softmax, key_norm = config.activation == "softmax", config.key_norm
    opts = Options(float(config.eps), float(config.scale), heads, config.activation, key_norm, multi=False)
    fuse = config.fuse_out_norm
    static_alpha = mix if isinstance(mix, float) else None
    traced_alpha = None if mix is None or static_alpha is not None else mix
    blend_alpha = mix is not None
    bounds = [n * (s + 1) // stages for s in range(stages)]
    starts = [0] + bounds[:-1]
    sizes = [stop * period + 1 for stop in bounds]  # the buffer rows up to each stage's last write

    # Closed-over traced values of the user's sublayers become explicit arguments (their
    # gradients flow), as the custom VJP differentiates only its arguments.
    p0 = jax.tree_util.tree_map(lambda x: x[0], layer_params)
    h0 = jnp.zeros(embedding.shape, sdt)
    converted = [jax.closure_convert(f, p0, h0) for f in sublayers]
    fns = [c[0] for c in converted]
    consts = tuple(tuple(c[1]) for c in converted)

    ops = JaxOps()  # the schedule's primitives (blend, composed M15 norm)

    def rms(v):
        """r of one row `[..., D]` -> `[..., H]` (overflow-safe, C10.6)."""
        return _head_rms(v.astype(ct), opts, v)

    def dot(spec, a, b):
        return jnp.einsum(spec, a, b, precision=HIGHEST)

    def by_head(x):
        """`[..., D]` -> `[..., H, Dh]` (several heads)."""
        return x.reshape(x.shape[:-1] + (heads, head_dim))

    # Rows of the buffer sit beside the channels, `[..., R, D]`: every contraction of a read is
    # then a matrix-vector product per token (logits, output sum, <g, x_i>) that XLA:CPU runs
    # as one dot, where the rows-first layout took a reduce or a chain of adds per row.
    def read(rows, r_rows, count, q, extras=()):
        """The masked read of the first `count` rows of `rows [..., R', D]` and then of `extras`,
        the (v, r) `[..., D]`, `[..., H]` of rows count, count + 1, ... not yet in `rows` (the
        scan step's earlier sublayers: the step reads the buffer it entered with and writes its
        rows once, at its end, so no read waits on a write).  Returns h in ct `[..., D]` and p,
        z `[..., R', H]` of the read over rows 0..count + len(extras) - 1 (the extras' at their
        rows, 0 above)."""
        x = rows.astype(ct)
        if heads == 1:
            s = dot("...rd,d->...r", x, q)[..., None]
        else:
            s = dot("...rhd,hd->...rh", by_head(x), by_head(q))
        z = opts.scale * r_rows * s if key_norm else opts.scale * s
        zx = []
        for v, rv in extras:
            vc = v.astype(ct)
            sv = jnp.sum(vc * q, axis=-1, keepdims=True) if heads == 1 else jnp.sum(by_head(vc) * by_head(q), -1)
            zx.append(opts.scale * rv * sv if key_norm else opts.scale * sv)
        valid = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 2) < count
        if softmax:  # C10.4: subtract the maximum
            zm = jnp.where(valid, z, -jnp.inf)
            m = jnp.max(zm, axis=-2)
            for zk in zx:
                m = jnp.maximum(m, zk)
            e = jnp.exp(zm - m[..., None, :])
            ex = [jnp.exp(zk - m) for zk in zx]
            total = jnp.sum(e, axis=-2)
            for ek in ex:
                total = total + ek
            p = e / total[..., None, :]
            px = [ek / total for ek in ex]
        else:
            p = jnp.where(valid, jax.nn.sigmoid(z), 0.0)
            px = [jax.nn.sigmoid(zk) for zk in zx]
        if heads == 1:
            y = dot("...r,...rd->...d", p[..., 0], x)
        else:
            y = dot("...rh,...rhd->...hd", p, by_head(x)).reshape(x.shape[:-2] + (dim,))
        for k, (v, _) in enumerate(extras):
            y = y + _spread(px[k], heads, dim) * v.astype(ct)
            p, z = put_row(p, count + k, px[k]), put_row(z, count + k, zx[k])
        return y, p, z

    def read_vjp(rows, r_rows, q, p, z, dy):
        """(cotangent added to the rows `[..., R', D]`, to u `[..., R', H]`, dL/ds `[..., R', H]`)."""
        x = rows.astype(ct)
        if heads == 1:
            dp = dot("...rd,...d->...r", x, dy)[..., None]
        else:
            dp = dot("...rhd,...hd->...rh", by_head(x), by_head(dy))
        dz = p * (dp - jnp.sum(p * dp, axis=-2, keepdims=True)) if softmax else dp * p * (1.0 - p)
        ds = opts.scale * dz * r_rows if key_norm else opts.scale * dz
        d_rows = _spread(p, heads, dim) * dy[..., None, :] + _spread(ds, heads, dim) * q
        return d_rows, dz * z, ds

    def light(j, row, y, standard, p, onw, alpha, c):
        """Sublayer l = row + 1 from its read y (ct): the read's rounding, the M10 blend, the M15
        norm, f_j, M1a: (v_l, the M10 PreNorm sum after it)."""
        out = y.astype(sdt)  # C10: the read's one final cast
        a = static_alpha if traced_alpha is None else alpha
        h = ops.blend(standard, out, a) if blend_alpha else out
        if fuse:
            w = jax.lax.dynamic_index_in_dim(onw, row, 0, keepdims=False)
            if blend_alpha:  # M15 composed on the blended input
                h = ops.rmsnorm_gain(h, w, config.eps)
            else:  # C17: from the read's output in the compute dtype, before its rounding
                h = out_norm(y, w.astype(ct), config.eps)[0].astype(sdt)
        if j is None:
            return h, standard
        v = fns[j](p, h, *c).astype(sdt)
        return v, (None if standard is None else standard + v)

    def take(x, i):
        return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)

    def put(x, i, v):
        return jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), i, 0)

    def row(x, i):
        """Row i of a buffer or statistic `[..., R, C]` -> `[..., C]`."""
        return jax.lax.dynamic_index_in_dim(x, i, x.ndim - 2, keepdims=False)

    def put_row(x, i, v):
        return jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), i, x.ndim - 2)

    def rows_of(x, size):
        """The first `size` rows of `[..., R, C]`."""
        return jax.lax.slice_in_dim(x, 0, size, axis=x.ndim - 2)

    def write_rows(x, first, values):
        """x `[..., R, C]` with rows first, first + 1, ... replaced by values `[..., C]`: one
        select over x (a dynamic-update-slice of a buffer the step's dots read makes XLA:CPU
        copy the buffer twice)."""
        index = jax.lax.broadcasted_iota(jnp.int32, x.shape[-2:-1] + (1,), 0) - first
        for k, v in enumerate(values):
            x = jnp.where(index == k, v.astype(x.dtype)[..., None, :], x)
        return x

    def grow(x, size):
        """x `[..., R', C]` with zero rows appended up to `size` (once per stage)."""
        return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, size - x.shape[-2]), (0, 0)])

    def forward(emb, qg, layer_params, onw, alpha, consts):
        # Each stage's scan carries exactly the rows its sublayers touch (every read attends the
        # whole carried buffer, masked; a slice inside the scan would be a copy per read).
        buf = put_row(jnp.zeros(emb.shape[:-1] + (sizes[0], dim), sdt), 0, emb)
        r = jnp.zeros(emb.shape[:-1] + (sizes[0], heads), ct)
        if key_norm:
            r = put_row(r, 0, rms(emb))
        standard = emb if blend_alpha else None
        stage_saved = []
        for start, stop, size in zip(starts, bounds, sizes):
            buf, r = grow(buf, size), grow(r, size)

            def body(carry, i):
                buf, r, standard = carry
                p = jax.tree_util.tree_map(lambda x: take(x, i), layer_params)
                saved, new = [], []
                entry = i * period + 1  # the rows < entry are written
                for j in range(period):
                    layer = entry + j
                    y, w, z = read(buf, r, entry, take(qg, layer - 1), new)
                    args = (y, standard, p, onw, alpha, consts[j])
                    fn = lambda *a, j=j, row=layer - 1: light(j, row, *a)  # noqa: E731
                    if remat is None:
                        (v, standard), vjp = jax.vjp(fn, *args)
                        saved.append((vjp, w, z))
                    else:
                        v, standard = fn(*args)
                        saved.append(((y, args[1]), w, z))
                    new.append((v, rms(v) if key_norm else None))
                # The step's rows, written once at its end (a write read by a later dot of the
                # same step made XLA:CPU copy the whole buffer for each).
                buf = write_rows(buf, entry, [v for v, _ in new])
                if key_norm:
                    r = write_rows(r, entry, [rv for _, rv in new])
                return (buf, r, standard), saved

            (buf, r, standard), saved = jax.lax.scan(
                body, (buf, r, standard), jnp.arange(start, stop, dtype=jnp.int32), unroll=unroll)
            stage_saved.append(saved)
        y, w, z = read(buf, r, num_layers + 1, qg[num_layers])
        out, vjp_out = jax.vjp(lambda y, s, onw, a: light(None, num_layers, y, s, None, onw, a, ())[0],
                               y, standard, onw, alpha)
        return out, (buf, r, qg, stage_saved, vjp_out, w, z, layer_params, onw, alpha, consts)

    @jax.custom_vjp
    def run(emb, qg, layer_params, onw, alpha, consts):
        return forward(emb, qg, layer_params, onw, alpha, consts)[0]

    def run_fwd(emb, qg, layer_params, onw, alpha, consts):
        return forward(emb, qg, layer_params, onw, alpha, consts)

    def run_bwd(res, d_out):
        buf, r, qg, stage_saved, vjp_out, w, z, layer_params, onw, alpha, consts = res
        dy, d_std, d_onw, d_alpha = vjp_out(d_out)
        d_buf, u, ds_out = read_vjp(buf, r, qg[num_layers], w, z, dy)  # the buffer's and u's first terms
        d_qg_rows = [_contract(ds_out[None], buf.astype(ct), heads)]
        d_light = (d_onw, d_alpha, jax.tree_util.tree_map(jnp.zeros_like, consts))
        d_layer = jax.tree_util.tree_map(jnp.zeros_like, layer_params)  # written step by step, in place
        for start, stop, size, saved in reversed(list(zip(starts, bounds, sizes, stage_saved))):
            # the later rows are complete (their writers are done); the stage's rows, once per stage
            d_buf, u, x_s, r_s = (rows_of(a, size) for a in (d_buf, u, buf, r))

            def body(carry, xs, x_s=x_s, r_s=r_s):
                d_buf, u, d_std, d_light, d_layer = carry
                i, saved = xs
                d_p, dss = None, []
                for j in reversed(range(period)):
                    layer = i * period + j + 1
                    kept, w, z = saved[j]
                    dv = row(d_buf, layer)
                    if key_norm:  # dL/dr_l r_l = u_l reaches v_l: - u r (r x) / Dh (no r^3)
                        rl = row(r_s, layer)
                        dv = dv - _spread(row(u, layer) * rl / head_dim, heads, dim) * (
                            _spread(rl, heads, dim) * row(x_s, layer).astype(ct))
                    if remat is None:
                        vjp = kept
                    else:
                        y, standard = kept
                        p = jax.tree_util.tree_map(lambda x: take(x, i), layer_params)
                        fn = lambda *a, j=j, row=layer - 1: light(j, row, *a)  # noqa: E731
                        _, vjp = jax.vjp(fn, y, standard, p, onw, alpha, consts[j])
                    dy, d_std, dp_j, d_onw, d_alpha, d_c = vjp((dv.astype(sdt), d_std))
                    d_p = dp_j if d_p is None else jax.tree_util.tree_map(jnp.add, d_p, dp_j)
                    d_light = _accumulate(d_light, j, d_onw, d_alpha, d_c)
                    d_rows, du, ds = read_vjp(x_s, r_s, take(qg, layer - 1), w, z, dy)
                    d_buf, u = d_buf + d_rows, u + du
                    dss.append(ds)
                d_layer = jax.tree_util.tree_map(lambda acc, g: put(acc, i, g), d_layer, d_p)
                return (d_buf, u, d_std, d_light, d_layer), jnp.stack(dss[::-1])

            (d_buf, u, d_std, d_light, d_layer), ds = jax.lax.scan(
                body, (d_buf, u, d_std, d_light, d_layer), (jnp.arange(start, stop, dtype=jnp.int32), saved),
                reverse=True, unroll=unroll)
            # the stage's query gradients: sum over rows and tokens of dL/ds_i x_i, one contraction
            d_qg_rows.append(_contract(ds.reshape((-1,) + ds.shape[2:]), x_s.astype(ct), heads))
        d_emb = row(d_buf, 0)
        if key_norm:
            r0 = row(r, 0)
            d_emb = d_emb - _spread(row(u, 0) * r0 / head_dim, heads, dim) * (_spread(r0, heads, dim)
                                                                              * row(buf, 0).astype(ct))
        if d_std is not None:  # M10: v_0 starts the PreNorm sum
            d_emb = d_emb + d_std.astype(ct)
        d_qg = jnp.concatenate(d_qg_rows[:0:-1] + [d_qg_rows[0]], axis=0)
        d_onw, d_alpha, d_c = d_light
        return d_emb.astype(sdt), d_qg.astype(qg.dtype), d_layer, d_onw, d_alpha, d_c

    run.defvjp(run_fwd, run_bwd)
    return run(embedding, qg, layer_params, out_norm_weights, traced_alpha, consts)


def _accumulate(d_light: tuple, j: int, d_onw, d_alpha, d_c) -> tuple:
    """(d out_norm_weights, d alpha, d consts per sublayer) plus sublayer j's (None: unused)."""
    acc_onw, acc_alpha, acc_c = d_light
    add = lambda a, b: None if a is None else a + b  # noqa: E731
    acc_c = tuple(jax.tree_util.tree_map(jnp.add, acc_c[k], d_c) if k == j else acc_c[k]
                  for k in range(len(acc_c)))
    return add(acc_onw, d_onw), add(acc_alpha, d_alpha), acc_c


def _contract(ds, x, heads: int):
    """d qg `[M, D]` = sum over tokens and rows i of ds[m, ..., i] x_i: ds `[M, ..., R', H]`,
    x `[..., R', D]` (compute dtype)."""
    axes = tuple(range(1, ds.ndim - 1))  # the tokens and the rows
    if heads == 1:
        return jnp.tensordot(ds[..., 0], x, axes=(axes, tuple(range(x.ndim - 1))), precision=HIGHEST)
    xh = x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads))
    out = jnp.einsum(ds, (0,) + axes + (ds.ndim - 1,), xh, axes + (ds.ndim - 1, ds.ndim),
                     (0, ds.ndim - 1, ds.ndim), precision=HIGHEST)
    return out.reshape(out.shape[0], -1)
