"""Naive low-precision compositions, for FlashAttention's adaptive rule (`tolerances`).

`depth_attention` / `depth_attention_multi`: the reference's math (`attnres_numpy.ops`) written
as elementary steps, with the result of every step rounded to the low precision `dtype`
(`numerics.round_to`; bf16 and fp16 are emulated in float64 + rounding), as a port with no
fp32 intermediates would compute it.  `probe`: the reference's probe network with every
primitive rounded, as a port running the model in the dtype computes it.
Shapes as in the reference: sources `[N, ..., D]`, query `[D]` or `[..., D]`, gain `[D]`.
"""

from __future__ import annotations

import numpy as np

from .numerics import round_to


def depth_attention(sources, query, norm_weight, d_out, *, dtype: str, eps=1e-6, scale=1.0,
                    num_heads=1, activation="softmax", key_norm=True, d_lse=None,
                    out_norm_weight=None, out_norm_eps=None, d_out_normed=None) -> dict:
    """Forward and VJP with every intermediate rounded to `dtype`.

    Returns {"out" `[..., D]`, "sources" `[N, ..., D]`, "query", "norm_weight" (or None)}, and
    with out_norm_weight (C17) "out_normed" and "out_norm_weight" (its gradient for d_out_normed).
    Overflow to inf (and inf - inf) is part of what low precision does: it propagates."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _depth_attention(sources, query, norm_weight, d_out, dtype, eps, scale, num_heads,
                                activation, key_norm, d_lse, out_norm_weight,
                                eps if out_norm_eps is None else out_norm_eps, d_out_normed)


def _depth_attention(sources, query, norm_weight, d_out, dtype, eps, scale, num_heads, activation,
                     key_norm, d_lse, out_norm_weight, out_norm_eps, d_out_normed):
    rd = lambda x: round_to(x, dtype)
    x = np.asarray(sources, dtype=np.float64)
    dim = x.shape[-1]
    heads = lambda a: a.reshape(a.shape[:-1] + (num_heads, dim // num_heads))
    xh = heads(x)  # [N, ..., H, Dh]
    qh = heads(np.asarray(query, dtype=np.float64))
    g = np.ones(dim) if norm_weight is None else np.asarray(norm_weight, dtype=np.float64)
    gh = heads(g)
    dh = xh.shape[-1]
    if key_norm:
        ms = rd(rd(np.sum(rd(xh * xh), axis=-1)) / dh)
        r = rd(1.0 / rd(np.sqrt(rd(ms + eps))))
    else:
        r = np.ones(xh.shape[:-1])
    qg = rd(qh * gh)
    s = rd(np.sum(rd(qg * xh), axis=-1))
    z = rd(scale * rd(r * s))
    if activation == "sigmoid":
        p = rd(1.0 / rd(1.0 + rd(np.exp(-z))))
    else:
        e = rd(np.exp(rd(z - np.max(z, axis=0, keepdims=True))))
        p = rd(e / rd(np.sum(e, axis=0, keepdims=True)))
    out = rd(np.sum(rd(p[..., None] * xh), axis=0))  # [..., H, Dh]
    extra = {}
    go_full = np.asarray(d_out, dtype=np.float64)
    if out_norm_weight is not None:  # C17, over all D, from the rounded out
        y = out.reshape(x.shape[1:])
        w = np.asarray(out_norm_weight, dtype=np.float64)
        rho = rd(1.0 / rd(np.sqrt(rd(rd(rd(np.sum(rd(y * y), axis=-1)) / dim) + out_norm_eps))))[..., None]
        y_hat = rd(rho * y)
        extra["out_normed"] = rd(y_hat * w)
        gn = np.zeros(y.shape) if d_out_normed is None else np.asarray(d_out_normed, dtype=np.float64)
        a = rd(gn * w)
        dot = rd(rd(np.sum(rd(a * y_hat), axis=-1, keepdims=True)) / dim)
        go_full = rd(go_full + rd(rho * rd(a - rd(y_hat * dot))))
        extra["out_norm_weight"] = rd(np.sum(rd(gn * y_hat).reshape(-1, dim), axis=0))

    go = heads(go_full)
    dp = rd(np.sum(rd(go[None] * xh), axis=-1))
    if activation == "softmax":
        dz = rd(p * rd(dp - rd(np.sum(rd(go * out), axis=-1))[None]))
        if d_lse is not None:
            dl = np.asarray(d_lse, dtype=np.float64)
            dz = rd(dz + rd(p * (dl if num_heads > 1 else dl[..., None])[None]))
    else:
        dz = rd(dp * rd(p * rd(1.0 - p)))
    if key_norm:
        dkey = rd(scale * rd(rd(r[..., None] * qg[None]) - rd(rd(rd(s * rd(r * rd(r * r))) / dh)[..., None] * xh)))
    else:
        dkey = rd(scale * np.broadcast_to(qg[None], xh.shape))
    dx = rd(rd(p[..., None] * go[None]) + rd(dz[..., None] * dkey))
    dqg = rd(np.sum(rd(rd(dz * rd(scale * r))[..., None] * xh), axis=0))
    tok_axes = tuple(range(x.ndim - 2))
    dq = rd(dqg * gh)
    dg = rd(np.sum(rd(dqg * qh), axis=tok_axes))
    if np.ndim(query) == 1:
        dq = rd(np.sum(dq, axis=tok_axes))
    return {
        "out": out.reshape(x.shape[1:]),
        "sources": dx.reshape(x.shape),
        "query": dq.reshape(np.shape(query)),
        "norm_weight": None if norm_weight is None else dg.reshape(dim),
        **extra,
    }


def depth_attention_multi(sources, queries, norm_weights, d_out, d_lse, *, dtype: str, eps=1e-6,
                          scale=1.0) -> dict:
    """Phase 1 as S naive single-query calls (source gradients summed in `dtype`).

    Returns {"out" `[S, ..., D]`, "sources" `[N, ..., D]`, "queries", "norm_weights"}."""
    rows = [depth_attention(sources, queries[i], None if norm_weights is None else norm_weights[i],
                            d_out[i], dtype=dtype, eps=eps, scale=scale,
                            d_lse=None if d_lse is None else d_lse[i])
            for i in range(np.shape(queries)[0])]
    d_src = rows[0]["sources"]
    for row in rows[1:]:
        d_src = round_to(d_src + row["sources"], dtype)
    return {
        "out": np.stack([row["out"] for row in rows]),
        "sources": d_src,
        "queries": np.stack([row["query"] for row in rows]),
        "norm_weights": None if norm_weights is None else np.stack([row["norm_weight"] for row in rows]),
    }


def probe(golden, *, backward: bool) -> dict:
    """The probe network of a golden case (op "probe") with every primitive's result, forward
    and backward, rounded to the case dtype: the reference's own schedule
    (`attnres_core.schedule`) on a float64 tape whose every step rounds.  Returns {"out", and
    with `backward` one entry per gradient name of the golden case}."""
    from attnres_core.config import ResidualConfig
    from attnres_core.probe import probe_sublayers
    from attnres_core.schedule import run_schedule
    from attnres_numpy.model import sublayers_in
    from attnres_numpy.tape import Tape

    dtype = golden.dtype
    a = golden.arrays
    config = ResidualConfig.from_dict(golden.attrs["config"])
    params = {k[len("input."):]: v for k, v in a.items()
              if k.startswith("input.") and k not in ("input.embedding", "input.sublayer_weights")}
    tape = Tape(params, record=backward, transform=lambda v: round_to(v, dtype))
    emb, w = tape.var(a["input.embedding"]), tape.var(a["input.sublayer_weights"])

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # M1a: sublayers returning another dtype (their v_l rounded to it) on the same tape.
        sublayers = sublayers_in(tape, probe_sublayers(config, tape, w), golden.attrs.get("sublayer_dtype"))
        out = run_schedule(config, tape, emb, sublayers, schedule=golden.attrs["schedule"],
                           mix=golden.attrs.get("mix"), scale=golden.attrs.get("scale"))
        result = {"out": out.value}
        if backward:
            wrt = [emb, w, *tape.leaves.values()]
            grads = tape.gradients(out, a["cotangent.out"], wrt)
            result.update(zip(["embedding", "sublayer_weights", *tape.leaves], grads))
    return result
