"""Golden test vectors (spec/VECTORS.md): case definitions, generator and reader.

A golden case is one call of a spec op (or one run of the probe network) with inputs exactly
representable in a low-precision dtype, a random cotangent for every differentiable output, and
the float64 reference's outputs and gradients.  `golden_cases()` is the committed definition;
`python -m attnres_numpy.vectors OUTDIR` writes it as `OUTDIR/manifest.json` plus one
`OUTDIR/<id>.npz` per case, byte-for-byte reproducibly (no timestamps anywhere).

Array keys of `GoldenCase.arrays` (every array is stored as float64):
    "input.<name>"      an op argument (sources always stacked `[N, ..., D]`, whatever the layout;
                        a None argument is absent); for probe cases "input.embedding",
                        "input.sublayer_weights" and "input.<param name>"
    "cotangent.<name>"  the cotangent of output <name> ("out", "out_normed", "lse")
    "output.<name>"     float64 reference output ("out", "out_normed", "lse", "weights")
    "grad.<name>"       float64 reference gradient of input <name>
Inputs and cotangents hold values exactly representable in `value_dtypes(case)[key]`: the case
dtype, except lse-typed arrays ("input.lse1", "cotangent.lse"), which are in the compute dtype
(C10: float32, or float64 for float64 cases).
"""

from __future__ import annotations

import io
import json
import os
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
from attnres_core.config import ResidualConfig
from attnres_core.numerics import DTYPES, compute_dtype_for, round_to_dtype  # noqa: F401  (public here too)

from . import __version__, model, ops

SCHEMA_VERSION = 1
GENERATOR = "attnres_numpy.vectors"
OPS = ("depth_attention", "depth_attention_multi", "merge_partial", "probe")
SHORT_DTYPE = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
MANIFEST = "manifest.json"
ENV_VAR = "ATTNRES_VECTORS"

#: Keys whose values live in the compute dtype rather than the case dtype (C10).
_COMPUTE_DTYPE_KEYS = ("input.lse1", "cotangent.lse")


@dataclass
class GoldenCase:
    """One golden vector.

    id: readable and unique, e.g. "depth_attention_N33_D7_T5_f32_list_lse".
    op: one of OPS.  attrs: the op's keyword arguments; for "probe": {"config":
      ResidualConfig.to_dict(), "schedule": "direct" | "two_phase", "variant": the
      `config.VARIANT_KINDS` name the config was made from}.
    dtype: the dtype every input is exactly representable in (see `value_dtypes`).
    sources_layout: "list" or "stacked" (how a port passes the sources), None without sources.
    seed: the seed the inputs were drawn from.  tolerance_class: the dtype whose tolerances apply.
    arrays: float64 arrays keyed as in the module docstring.
    """

    id: str
    op: str
    attrs: dict
    dtype: str
    sources_layout: Optional[str]
    seed: int
    tolerance_class: str
    arrays: Dict[str, np.ndarray]


def value_dtypes(case: GoldenCase) -> Dict[str, str]:
    """The dtype each array's values are exactly representable in: inputs and cotangents in the
    case dtype (lse-typed ones in the compute dtype), outputs and gradients "float64"."""
    compute = compute_dtype_for(case.dtype)
    result = {}
    for key in case.arrays:
        if key.startswith(("output.", "grad.")):
            result[key] = "float64"
        else:
            result[key] = compute if key in _COMPUTE_DTYPE_KEYS else case.dtype
    return result


# -- case definitions ------------------------------------------------------------------------


def _seed(case_id: str) -> int:
    """A seed fixed by the id alone, so adding or reordering cases changes no other case."""
    return zlib.crc32(case_id.encode()) & 0x7FFFFFFF


def _tokens_tag(tokens: Sequence[int]) -> str:
    return "x".join(str(t) for t in tokens) if tokens else "none"


def _draw_sources(rng, n: int, shape: tuple, dtype: str, magnitude: float = 1.0,
                  zero: bool = False) -> np.ndarray:
    """`[n, *shape]` with one magnitude per source (spread e^N(0,1)), so the key norm matters.

    magnitude != 1: entries of size ~magnitude (normals clipped at 3 sigma, so a magnitude chosen
    below a dtype's range stays finite after rounding); zero: all-zero sources."""
    if zero:
        return np.zeros((n,) + shape)
    if magnitude != 1.0:
        return round_to_dtype(magnitude * np.clip(rng.standard_normal((n,) + shape), -3, 3), dtype)
    # The magnitudes are rounded to float32: np.exp may differ by an ulp between CPUs (SIMD
    # paths), and a float32 value times a float64 normal is exact, so every machine regenerates
    # the committed inputs bit for bit.
    mag = round_to_dtype(np.exp(rng.standard_normal(n)), "float32").reshape((n,) + (1,) * len(shape))
    return round_to_dtype(rng.standard_normal((n,) + shape) * mag, dtype)


def _draw_query(rng, shape: tuple, dim: int, dtype: str, spread: float = 2.0) -> np.ndarray:
    """Logits z ~ N(0, spread^2) against unit-RMS keys."""
    return round_to_dtype(rng.standard_normal(shape) * spread / np.sqrt(dim), dtype)


def _draw_gain(rng, shape: tuple, dtype: str) -> np.ndarray:
    return round_to_dtype(1.0 + 0.25 * rng.standard_normal(shape), dtype)


def _draw_cotangent(rng, shape: tuple, dtype: str) -> np.ndarray:
    return round_to_dtype(rng.standard_normal(shape), dtype)


def _stack(sources) -> np.ndarray:
    return sources if isinstance(sources, np.ndarray) else np.stack(sources)


def _logits_to(target: float, q: np.ndarray, x: np.ndarray, g, *, eps: float, scale: float,
               key_norm: bool, dtype: str, multi: bool = False) -> np.ndarray:
    """The query (H = 1; `[D]`, `[..., D]`, or `[S, D]` queries when `multi`; x `[N, ..., D]`) rescaled so that the
    logit of largest magnitude over every source, token (and query) is `target`, then rounded
    to `dtype` (so the largest logit is `target` up to that rounding)."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps) if key_norm else np.ones(x.shape[:-1])
    u = q * (1.0 if g is None else g)
    if multi:  # [S, D] queries: z [S, N, ...]
        z = scale * r[None] * np.einsum("sd,n...d->sn...", u, x)
    else:
        z = scale * r * np.sum(u * x, axis=-1)
    worst = z.flat[np.argmax(np.abs(z))]
    return round_to_dtype(q * (target / worst), dtype)


def _layout(x: np.ndarray, layout: str):
    """`[N, ..., D]` in the form a port is given: a list, a tuple or the stacked array."""
    return list(x) if layout == "list" else tuple(x) if layout == "tuple" else x


def _poison(arrays: Dict[str, np.ndarray], nonfinite) -> list:
    """Copies of `arrays` (in order) with each `(name, index, value)` of `nonfinite` written in."""
    arrays = {k: v.copy() for k, v in arrays.items()}
    for name, index, value in nonfinite:
        arrays[name][tuple(index)] = value
    return list(arrays.values())


def depth_attention_case(n, dim, tokens=(5,), dtype="float32", layout="list", *, num_heads=1,
                         activation="softmax", key_norm=True, token_query=False, gain=True,
                         lse=False, weights=False, eps=1e-6, scale=1.0, spread=2.0,
                         tag="", case_id=None, magnitude=1.0, zero_sources=False,
                         zero_query=False, query_dtype=None, nonfinite=(), logit_max=None,
                         out_norm=False, out_norm_eps=None, out_norm_dtype=None) -> GoldenCase:
    """A `depth_attention` case: n sources `[*tokens, dim]`, id built from every option (plus
    `tag` for the eps/scale/spread knobs).  spread: the std of the logits the query produces.

    case_id: an id chosen by the caller (the conformance suite's grid) instead of the built one;
    magnitude / zero_sources: see `_draw_sources`; zero_query: an all-zero query (uniform weights).
    layout: "list", "tuple" or "stacked" (how the sources are passed).
    query_dtype: the query's own dtype when it differs from the sources' (C10.1): its values are
      drawn exact in it, and the reference sees them converted to the compute dtype.
    nonfinite: `(name, index, value)` entries written into the drawn inputs ("sources" indexed
      `[N, ..., D]`, "query") before the reference runs (C12).
    logit_max: the query rescaled so that the largest logit is this (H = 1; C10.4's large logits).
    out_norm: the fused output norm (C17): an out_norm_weight `[D]` ("input.out_norm_weight",
      drawn from its own stream, so the other inputs equal those of the case without it), output
      and cotangent "out_normed", gradient "out_norm_weight"; out_norm_eps: its eps (an attr,
      only when given); out_norm_dtype: the weight's own dtype (seen converted to kappa, C10.1).
    """
    tokens = tuple(tokens)
    parts = [f"depth_attention_N{n}_D{dim}_T{_tokens_tag(tokens)}_{SHORT_DTYPE[dtype]}_{layout}"]
    parts += [f"H{num_heads}"] * (num_heads > 1) + ["sigmoid"] * (activation == "sigmoid")
    parts += ["nokeynorm"] * (not key_norm) + ["tokq"] * token_query + ["nogain"] * (not gain)
    parts += ["lse"] * lse + ["weights"] * weights + ["outnorm"] * out_norm
    if out_norm_eps is not None:
        parts.append(f"outnormeps{out_norm_eps:g}")
    parts += [tag] * bool(tag)
    case_id = case_id or "_".join(parts)
    seed = _seed(case_id)
    rng = np.random.default_rng(seed)
    compute = compute_dtype_for(dtype)
    x = _draw_sources(rng, n, tokens + (dim,), dtype, magnitude, zero_sources)
    q = _draw_query(rng, tokens + (dim,) if token_query else (dim,), dim, query_dtype or dtype, spread)
    q = np.zeros_like(q) if zero_query else q
    g = _draw_gain(rng, (dim,), dtype) if gain else None
    if logit_max is not None:
        q = _logits_to(logit_max, q, x, g, eps=eps, scale=scale, key_norm=key_norm, dtype=query_dtype or dtype)
    x, q = _poison(dict(sources=x, query=q), nonfinite)
    q_seen = round_to_dtype(q, compute) if query_dtype else q  # C10.1: converted to kappa
    attrs = dict(eps=eps, scale=scale, num_heads=num_heads, activation=activation,
                 key_norm=key_norm, return_lse=lse, return_weights=weights)
    if out_norm_eps is not None:
        attrs["out_norm_eps"] = out_norm_eps
    w = w_seen = None
    if out_norm:  # C17; its own stream: the case's other draws are unchanged
        w = _draw_gain(np.random.default_rng([seed, 17]), (dim,), out_norm_dtype or dtype)
        w_seen = round_to_dtype(w, compute) if out_norm_dtype else w  # C10.1: converted to kappa
    sources = _layout(x, layout)
    result = ops.depth_attention(sources, q_seen, g, out_norm_weight=w_seen, **attrs)
    out, *extra = result if isinstance(result, tuple) else (result,)
    arrays = {"input.sources": x, "input.query": q, "output.out": out}
    if g is not None:
        arrays["input.norm_weight"] = g
    if out_norm:
        arrays["input.out_norm_weight"] = w
        arrays["output.out_normed"] = extra.pop(0)
    if lse:
        arrays["output.lse"] = extra.pop(0)
        arrays["cotangent.lse"] = _draw_cotangent(rng, arrays["output.lse"].shape, compute)
    if weights:
        arrays["output.weights"] = extra.pop(0)
    arrays["cotangent.out"] = _draw_cotangent(rng, out.shape, dtype)
    if out_norm:
        arrays["cotangent.out_normed"] = _draw_cotangent(np.random.default_rng([seed, 18]), out.shape, dtype)
    grads = ops.depth_attention_vjp(
        sources, q_seen, g, arrays["cotangent.out"], arrays.get("cotangent.lse"), eps=eps, scale=scale,
        num_heads=num_heads, activation=activation, key_norm=key_norm, out_norm_weight=w_seen,
        out_norm_eps=out_norm_eps, d_out_normed=arrays.get("cotangent.out_normed"))
    arrays["grad.sources"] = _stack(grads["sources"])
    arrays["grad.query"] = grads["query"]
    if g is not None:
        arrays["grad.norm_weight"] = grads["norm_weight"]
    if out_norm:
        arrays["grad.out_norm_weight"] = grads["out_norm_weight"]
    return GoldenCase(case_id, "depth_attention", attrs, dtype, layout, seed, dtype, arrays)


def multi_case(n, num_queries, dim, tokens=(4,), dtype="float32", layout="list", *, gain=True,
               eps=1e-6, scale=1.0, case_id=None, spread=2.0, query_dtype=None,
               nonfinite=(), logit_max=None, magnitude=1.0) -> GoldenCase:
    """A `depth_attention_multi` case: S = num_queries pseudo-queries over n sources.

    spread, query_dtype (the queries' own dtype), nonfinite ("sources", "queries"), logit_max,
    magnitude: as in `depth_attention_case`."""
    tokens = tuple(tokens)
    case_id = case_id or (f"depth_attention_multi_N{n}_S{num_queries}_D{dim}_T{_tokens_tag(tokens)}_"
               f"{SHORT_DTYPE[dtype]}_{layout}" + "_nogain" * (not gain))
    seed = _seed(case_id)
    rng = np.random.default_rng(seed)
    x = _draw_sources(rng, n, tokens + (dim,), dtype, magnitude)
    qs = _draw_query(rng, (num_queries, dim), dim, query_dtype or dtype, spread)
    gs = _draw_gain(rng, (num_queries, dim), dtype) if gain else None
    if logit_max is not None:
        qs = _logits_to(logit_max, qs, x, gs, eps=eps, scale=scale, key_norm=True,
                        dtype=query_dtype or dtype, multi=True)
    x, qs = _poison(dict(sources=x, queries=qs), nonfinite)
    qs_seen = round_to_dtype(qs, compute_dtype_for(dtype)) if query_dtype else qs  # C10.1
    sources = _layout(x, layout)
    out, lse = ops.depth_attention_multi(sources, qs_seen, gs, eps=eps, scale=scale)
    d_out = _draw_cotangent(rng, out.shape, dtype)
    d_lse = _draw_cotangent(rng, lse.shape, compute_dtype_for(dtype))
    grads = ops.depth_attention_multi_vjp(sources, qs_seen, gs, d_out, d_lse, eps=eps, scale=scale)
    arrays = {"input.sources": x, "input.queries": qs, "output.out": out, "output.lse": lse,
              "cotangent.out": d_out, "cotangent.lse": d_lse,
              "grad.sources": _stack(grads["sources"]), "grad.queries": grads["queries"]}
    if gs is not None:
        arrays["input.norm_weights"] = gs
        arrays["grad.norm_weights"] = grads["norm_weights"]
    return GoldenCase(case_id, "depth_attention_multi", dict(eps=eps, scale=scale), dtype, layout,
                      seed, dtype, arrays)


def merge_case(dim, tokens=(5,), dtype="float32", *, token_query=False, gain=True, lse=True,
               eps=1e-6, scale=1.0, case_id=None, spread=2.0, nonfinite=(), logit_max=None,
               magnitude=1.0, partial_gap=None) -> GoldenCase:
    """A `merge_partial` case: out1/lse1 are a real phase 1 over 3 sources (rounded), plus a partial.

    spread, magnitude: as in `depth_attention_case`; logit_max: the query rescaled so that the partial's
    logit of largest magnitude is this (so with a positive one the partial's weight is not
    negligible everywhere, and lse >= logit_max); nonfinite: `(name, index, value)` written into "out1",
    "partial" or "query" before the merge's reference runs (C12); partial_gap: lse1 set to
    z2 + partial_gap at every token (the partial's weight e^-gap everywhere, C10.7)."""
    tokens = tuple(tokens)
    case_id = case_id or (f"merge_partial_D{dim}_T{_tokens_tag(tokens)}_{SHORT_DTYPE[dtype]}"
               + "_tokq" * token_query + "_nogain" * (not gain) + "_lse" * lse)
    seed = _seed(case_id)
    rng = np.random.default_rng(seed)
    compute = compute_dtype_for(dtype)
    x = _draw_sources(rng, 4, tokens + (dim,), dtype, magnitude)  # 3 phase-1 sources and the partial
    q = _draw_query(rng, tokens + (dim,) if token_query else (dim,), dim, dtype, spread)
    g = _draw_gain(rng, (dim,), dtype) if gain else None
    if logit_max is not None:
        q = _logits_to(logit_max, q, x[3:], g, eps=eps, scale=scale, key_norm=True, dtype=dtype)
    o1, l1 = ops.depth_attention(list(x[:3]), q, g, eps=eps, scale=scale, return_lse=True)
    if partial_gap is not None:  # lse1 = z2 + gap: z2 of the partial, the merge's own logit
        l1 = ops.depth_attention([x[3]], q, g, eps=eps, scale=scale, return_lse=True)[1] + partial_gap
    o1, l1, partial = round_to_dtype(o1, dtype), round_to_dtype(l1, compute), x[3]
    o1, partial, q = _poison(dict(out1=o1, partial=partial, query=q), nonfinite)
    attrs = dict(eps=eps, scale=scale, return_lse=lse)
    result = ops.merge_partial(o1, l1, partial, q, g, **attrs)
    out = result[0] if lse else result
    arrays = {"input.out1": o1, "input.lse1": l1, "input.partial": partial, "input.query": q,
              "output.out": out, "cotangent.out": _draw_cotangent(rng, out.shape, dtype)}
    if g is not None:
        arrays["input.norm_weight"] = g
    if lse:
        arrays["output.lse"] = result[1]
        arrays["cotangent.lse"] = _draw_cotangent(rng, result[1].shape, compute)
    grads = ops.merge_partial_vjp(o1, l1, partial, q, g, arrays["cotangent.out"],
                                  arrays.get("cotangent.lse"), eps=eps, scale=scale)
    for name, value in grads.items():
        if value is not None:
            arrays[f"grad.{name}"] = value
    return GoldenCase(case_id, "merge_partial", attrs, dtype, None, seed, dtype, arrays)


def _draw_params(rng, config: ResidualConfig, num_layers: int, dim: int, dtype: str):
    """Random (not init-valued) parameters, so every parameter's gradient is exercised."""
    params = {}
    for name, shape in config.param_shapes(num_layers, dim).items():
        if name in ("norm_weights", "alphas", "out_norm_weights"):
            value = 1.0 + 0.25 * rng.standard_normal(shape)
        elif name == "queries":
            value = rng.standard_normal(shape) * 2.0 / np.sqrt(dim)
        elif name in ("query_weights", "gate_weights"):
            value = rng.standard_normal(shape) / np.sqrt(dim)
        elif name == "key_projection":  # M13: q_r @ P^T as large as a full-rank query
            value = rng.standard_normal(shape) / np.sqrt(shape[1])
        else:  # gate_biases, depth_weights (the unused upper triangle too: its gradient is 0)
            value = 0.5 + 0.5 * rng.standard_normal(shape)
        params[name] = round_to_dtype(value, dtype)
    return params


def probe_case(variant: str, num_layers=5, dim=8, tokens=(3,), dtype="float32", *,
               schedule="direct", case_id=None, mix=None, call_scale=None, sublayer_dtype=None,
               **overrides) -> GoldenCase:
    """A probe-network case (spec section 6) of a named variant; two_phase is forward only.
    mix / call_scale: the M10 call inputs (attrs "mix" / "scale" when given).  sublayer_dtype:
    the dtype every sublayer returns (M1a; attr "sublayer_dtype" when given): the reference
    rounds each v_l to it, and the case's tolerance class is the narrower of it and `dtype`."""
    config = ResidualConfig.variant(variant, **overrides)
    tokens = tuple(tokens)
    knobs = (f"_W{config.window}" * (config.kind == "window") + f"_S{config.block_size}" * (config.block_size is not None)
             + f"_r{config.key_rank}" * (config.key_rank is not None)
             + "_outnorm" * (config.fuse_out_norm and variant != "fused_out_norm"))
    case_id = case_id or (f"probe_{variant}{knobs}_L{num_layers}_D{dim}_T{_tokens_tag(tokens)}_{SHORT_DTYPE[dtype]}"
               + "_two_phase" * (schedule == "two_phase")
               + (f"_mix{mix:g}" if mix is not None else "") + (f"_cs{call_scale:g}" if call_scale is not None else "")
               + (f"_sub{SHORT_DTYPE[sublayer_dtype]}" if sublayer_dtype is not None else ""))
    call = {k: v for k, v in (("mix", mix), ("scale", call_scale)) if v is not None}
    ref = dict(call, **({} if sublayer_dtype is None else {"sublayer_dtype": sublayer_dtype}))
    seed = _seed(case_id)
    rng = np.random.default_rng(seed)
    params = _draw_params(rng, config, num_layers, dim, dtype)
    emb = round_to_dtype(rng.standard_normal(tokens + (dim,)), dtype)
    weights = round_to_dtype(rng.standard_normal((num_layers, dim, dim)) * 1.5 / np.sqrt(dim), dtype)
    arrays = {"input.embedding": emb, "input.sublayer_weights": weights}
    arrays.update({f"input.{k}": v for k, v in params.items()})
    arrays["output.out"] = model.probe_forward(config, params, emb, weights, schedule=schedule, **ref)
    if schedule == "direct":
        arrays["cotangent.out"] = _draw_cotangent(rng, arrays["output.out"].shape, dtype)
        grads = model.probe_vjp(config, params, emb, weights, arrays["cotangent.out"], **ref)
        arrays.update({f"grad.{k}": v for k, v in grads.items()})
    attrs = {"config": config.to_dict(), "schedule": schedule, "variant": variant, **ref}
    order = ("bfloat16", "float16", "float32", "float64")
    tolerance_class = dtype if sublayer_dtype is None else min(dtype, sublayer_dtype, key=order.index)
    return GoldenCase(case_id, "probe", attrs, dtype, None, seed, tolerance_class, arrays)


def golden_cases() -> List[GoldenCase]:
    """The committed golden set (spec/vectors): every op, option, layout and dtype, and every
    probe variant, at tiny shapes.  Each line says what it stresses."""
    da, f16, bf16, f64 = depth_attention_case, "float16", "bfloat16", "float64"
    return [
        da(1, 7, lse=True, weights=True),  # C6: N = 1 returns the source exactly
        da(1, 123, (2, 3), bf16, "stacked"),  # C6 in low precision, stacked
        da(2, 1, (3,), "float32", "stacked", lse=True),  # D = 1: every key is +-1 after the norm
        da(2, 123, (2, 3), f16, "list"),  # odd D, fp16
        da(33, 7, (5,), "float32", "list", lse=True),  # N just above a power of two
        da(33, 123, (2,), bf16, "stacked", lse=True),
        da(33, 7, (2, 3), f64, "list", lse=True, weights=True),  # fp64 computes in fp64 (C10)
        da(130, 7, (3,), "float32", "stacked", lse=True),  # N above every peer's cap (no caps)
        da(130, 1, (2,), bf16, "list"),
        da(3, 7, (), "float32", "stacked"),  # no token axes: sources [D]
        da(3, 7, (5,), "float32", "list", gain=False),  # norm_weight = None
        da(5, 7, (4,), "float32", "list", eps=1e-5, scale=0.375, tag="epsscale"),  # non-default eps, scale
        da(6, 7, (4,), "float32", "stacked", lse=True, spread=30.0, tag="peaked"),  # |z| ~ 30: stable softmax/lse
        da(5, 8, (4,), "float32", "list", num_heads=2, lse=True, weights=True),  # heads: lse/weights [..., H]
        da(4, 123, (2,), bf16, "stacked", num_heads=3, lse=True),  # odd head dim 41
        da(6, 7, (4,), "float32", "list", activation="sigmoid", weights=True),
        da(6, 8, (2, 3), f16, "stacked", activation="sigmoid", num_heads=2),
        da(5, 7, (4,), "float32", "list", key_norm=False, lse=True),
        da(5, 7, (4,), bf16, "stacked", key_norm=False, activation="sigmoid"),
        da(4, 7, (2, 3), "float32", "list", token_query=True, lse=True),  # C4 per-token query
        da(4, 8, (5,), f16, "stacked", token_query=True, num_heads=2, gain=False),
        da(4, 7, (3,), f64, "stacked", token_query=True, key_norm=False, lse=True),
        # C17 fused output norm: over all D with heads; sigmoid with its own eps; N = 1
        # (rmsnorm of the source); per-token query with weights in fp16
        da(5, 8, (4,), "float32", "list", num_heads=2, lse=True, out_norm=True),
        da(4, 7, (2, 3), bf16, "stacked", activation="sigmoid", out_norm=True, out_norm_eps=1e-3),
        da(1, 7, (3,), f64, "list", lse=True, weights=True, out_norm=True),
        da(3, 123, (2,), f16, "list", token_query=True, weights=True, out_norm=True),
        multi_case(1, 3, 7),  # phase 1 over the embedding only
        multi_case(33, 4, 7, (3,), bf16, "stacked"),
        multi_case(5, 2, 123, (2,), f64, gain=False),
        multi_case(2, 1, 1, (3,), f16, "stacked"),
        merge_case(7),
        merge_case(123, (2, 3), bf16, token_query=True, lse=False),
        merge_case(1, (3,), f16, gain=False),
        merge_case(7, (4,), f64, token_query=True),
        *[probe_case(v) for v in ("standard", "scalar", "gated", "static", "full", "block",
                                  "window", "input_query", "sigmoid", "no_key_norm", "multihead",
                                  "shared_queries", "hybrid", "low_rank_keys", "compressed_history",
                                  "fused_out_norm")],
        # M15: the norm composed after a blend and after two-phase merges; hybrid in bf16.
        probe_case("fused_out_norm", mix=0.4, dtype=f64),
        probe_case("block", fuse_out_norm=True, schedule="two_phase"),
        probe_case("hybrid", fuse_out_norm=True, dtype=bf16),
        probe_case("low_rank_keys", key_rank=3, dtype=f64),  # M13: r = 3 of D = 8
        # M14 over L = 7: summaries b_1, b_2 of S = 2 beyond W = 2.
        probe_case("compressed_history", num_layers=7, window=2, dtype=f64),
        probe_case("hybrid", mix=0.5, dtype=f64),  # M12 with the M10 blend
        probe_case("shared_queries", schedule="two_phase"),  # M11: one phase-1 query per block
        probe_case("block", block_size=1),  # S = 1 equals full
        probe_case("block", block_size=4),  # blocks of 4 and 1
        probe_case("block", num_layers=4, block_size=4),  # one block covering every sublayer
        probe_case("window", window=1),
        probe_case("full", dtype=f64),
        probe_case("block", dtype=bf16),
        probe_case("block", schedule="two_phase"),  # blocks 2, 2, 1
        probe_case("block", block_size=4, schedule="two_phase"),
        probe_case("block", block_size=1, schedule="two_phase"),
        probe_case("full", mix=0.3),  # M10: a blend of standard and depth attention
        probe_case("block", mix=0.0, dtype=f64),  # M10: alpha = 0 is exactly the standard scheme
        probe_case("window", mix=0.75, dtype=bf16),
        probe_case("block", block_size=4, mix=0.6, call_scale=1.5),  # M10: per-call scale too
        probe_case("block", mix=0.4, schedule="two_phase"),
    ]


# -- files -----------------------------------------------------------------------------------


def _write_npz(path: Path, arrays: Dict[str, np.ndarray]) -> None:
    """An .npz np.load reads, with fixed zip dates so equal arrays give equal bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key], dtype="<f8"),
                                      allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def manifest_entry(case: GoldenCase) -> dict:
    return {
        "id": case.id, "op": case.op, "attrs": case.attrs, "dtype": case.dtype,
        "sources_layout": case.sources_layout, "seed": case.seed,
        "tolerance_class": case.tolerance_class,
        "shapes": {k: list(v.shape) for k, v in sorted(case.arrays.items())},
        "dtypes": dict(sorted(value_dtypes(case).items())),
        "file": f"{case.id}.npz",
    }


def write_vectors(directory, cases: Sequence[GoldenCase]) -> Path:
    """Write `manifest.json` and one `<id>.npz` per case; remove stale .npz files.  Returns the
    manifest path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = [c.id for c in cases]
    if len(set(ids)) != len(ids):
        raise ValueError(f"cases: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "reference_version": __version__,
        "generator": GENERATOR,
        "cases": [manifest_entry(c) for c in cases],
    }
    for case in cases:
        _write_npz(directory / f"{case.id}.npz", case.arrays)
    for stale in sorted(set(p.name for p in directory.glob("*.npz")) - {f"{i}.npz" for i in ids}):
        (directory / stale).unlink()
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def load_manifest(directory) -> dict:
    manifest = json.loads((Path(directory) / MANIFEST).read_text())
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{directory}/{MANIFEST}: schema_version {manifest.get('schema_version')!r} "
                         f"is not the supported {SCHEMA_VERSION}")
    return manifest


def load_vectors(directory) -> List[GoldenCase]:
    """Read a vector directory back into cases (checks every file against the manifest)."""
    directory = Path(directory)
    cases = []
    for entry in load_manifest(directory)["cases"]:
        with np.load(directory / entry["file"], allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        shapes = {k: list(v.shape) for k, v in arrays.items()}
        if shapes != entry["shapes"]:
            raise ValueError(f"{entry['file']}: arrays {shapes} do not match the manifest {entry['shapes']}")
        cases.append(GoldenCase(entry["id"], entry["op"], entry["attrs"], entry["dtype"],
                                entry["sources_layout"], entry["seed"], entry["tolerance_class"], arrays))
    return cases


def default_vectors_dir() -> Optional[Path]:
    """Where the golden vectors are, in this order (None if nowhere):

    1. $ATTNRES_VECTORS (None if it holds no manifest: a wrong path is never silently replaced);
    2. the first `spec/vectors` holding a manifest found walking up from the cwd (a checkout);
    3. the copy shipped as package data of the installed suite, `attnres_conformance/golden/`
       (in a checkout `spec/vectors` links to that folder), found without importing the suite,
       so a port installed from wheels checks the vectors outside any checkout;
    4. `spec/vectors` walking up from this file (an editable checkout without the suite).
    """
    import importlib.util  # here, not at the top: only this lookup needs it

    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env) if (Path(env) / MANIFEST).is_file() else None
    candidates = [folder / "spec" / "vectors" for folder in (Path.cwd(), *Path.cwd().parents)]
    suite = importlib.util.find_spec("attnres_conformance")
    candidates += [Path(loc) / "golden" for loc in ((suite and suite.submodule_search_locations) or ())]
    here = Path(__file__).resolve().parent
    candidates += [folder / "spec" / "vectors" for folder in (here, *here.parents)]
    return next((c for c in candidates if (c / MANIFEST).is_file()), None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        print("usage: python -m attnres_numpy.vectors OUTDIR", file=sys.stderr)
        return 2
    cases = golden_cases()
    path = write_vectors(argv[0], cases)
    size = sum(p.stat().st_size for p in path.parent.iterdir() if p.is_file())
    print(f"wrote {len(cases)} cases to {path.parent} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
