"""Transforms: small functions over a case, applied to the suite's numerical cases (issue 44, item 1).

The way PyTorch's OpInfo applies layouts and dtypes to every sample, each `Transform` turns an
op case into a new one that checks the same rule under one more condition:

* layouts (the values unchanged, the native inputs built as views by `Adapter.layout_array`):
  every input channel-strided (the output norm's gain and a merge's per-token query included),
  token-strided, source-strided (stacked sources and phase 1's queries), a stacked array stored
  transposed, every input at a storage offset, a per-token query expanded (stride 0) from one row;
* per-input dtypes (C10.1, C10.3): the query, the key-norm gain, the output norm's gain (the norm
  added to the case) and merge's lse1 in another dtype than the sources;
* batch shapes: a decode batch `[B = 4, 1, D]`, no token axes `[D]`;
* special values: a zero query with every gradient (M8's initialization), a logit scale of 0, a
  negative scale at large logits (C10.4), a NaN and an Inf token with every output (the output
  norm, lse and weights added; C12).

Each transform runs on the first case of each of `BASE_ROWS`, in every dtype for the
dtype-dependent ones and in `FORM_DTYPES` for the rest (their defects do not depend on the dtype);
under --quick on `QUICK_BASE_ROWS` in one dtype (float32 where the port declares it).  A transformed case is an ordinary case: its id is
`transforms/<transform>/<base row with / as .>.<label>/<dtype>` (its matrix row
`transforms/<transform>`, its coverage family "transforms: <group>", its skip tag
`tag:<transform>`), it needs what its base needs plus what the transform needs (a layout needs
the "strided" option), and `cases.fit` adapts it to the port's declared choices like any other
(an lse the port lacks is left out; the transform's own point, e.g. a scale of 0, is never).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
from attnres_core.validation import compute_dtype_for

#: Rows whose first case each transform applies to (full grid), and under --quick.
BASE_ROWS = ("depth_attention/base", "depth_attention/per_token_query", "depth_attention/heads",
             "depth_attention/stacked", "depth_attention/combo", "depth_attention/out_norm",
             "depth_attention_multi/base", "depth_attention_multi/stacked", "merge_partial/lse",
             "merge_partial/per_token_query")
QUICK_BASE_ROWS = ("depth_attention/combo", "depth_attention/out_norm", "depth_attention_multi/stacked",
                   "merge_partial/per_token_query")
#: Dtypes of the transforms whose defect does not depend on the dtype (layouts, shapes, ...).
FORM_DTYPES = ("float64", "float32")
#: The other dtype of a per-input dtype transform, by the case's dtype.
OTHER_DTYPE = {"float64": "float32", "float32": "float64", "float16": "float32", "bfloat16": "float32"}
#: The largest logit of the negative-scale case (as `cases.LARGE_LOGITS`; 1000 in float64).
LARGE_LOGITS = 120.0
#: Transform groups, as the coverage line names them.
GROUPS = ("layouts", "dtypes", "batch shapes", "special values")


@dataclass(frozen=True)
class Transform:
    """name; group (GROUPS); rule (the spec rule it exercises); why (for the failure line);
    every_dtype: run in every dtype (else FORM_DTYPES); apply(case) -> the new spec or None when
    it does not apply to that case."""

    name: str
    group: str
    rule: str
    why: str
    every_dtype: bool
    apply: Callable[["object"], Optional[dict]]


# -- helpers over a case's spec ------------------------------------------------------------------------
def _op(case) -> str:
    return {"da": "depth_attention", "multi": "depth_attention_multi", "merge": "merge_partial"}[case.spec["builder"]]


def _kw(case) -> dict:
    return dict(case.spec["kwargs"])


def _spec(case, *, kwargs=None, extra=(), **changes) -> dict:
    spec = dict(case.spec, **changes)
    if kwargs is not None:
        spec["kwargs"] = kwargs
    spec["extra_options"] = tuple(sorted(set(case.spec.get("extra_options", ())) | set(extra)))
    return spec


def _tokens(kw) -> tuple:
    return tuple(kw.get("tokens", ()))


def _post(case, *steps) -> tuple:
    return tuple(case.spec.get("post", ())) + steps


# -- layouts -------------------------------------------------------------------------------------------
def _channel_strided(case):
    return _spec(case, strided=True, extra=("strided",))


def _token_strided(case):
    op, kw = _op(case), _kw(case)
    if not _tokens(kw):
        return None
    layouts = {}
    if op == "merge_partial":
        layouts = {"out1": ("token_strided", 0), "partial": ("token_strided", 0), "lse1": ("token_strided", 0)}
        if kw.get("token_query"):
            layouts["query"] = ("token_strided", 0)
    else:
        stacked = kw.get("layout") == "stacked"
        layouts["sources"] = ("token_strided", 1 if stacked else 0)
        if kw.get("token_query"):
            layouts["query"] = ("token_strided", 0)
    return _spec(case, layouts=layouts, extra=("strided",))


def _source_strided(case):
    op, kw = _op(case), _kw(case)
    layouts = {}
    if kw.get("layout") == "stacked":
        layouts["sources"] = ("source_strided", 0)
    if op == "depth_attention_multi":
        layouts.update(queries=("source_strided", 0), norm_weights=("source_strided", 0))
    if not layouts:
        return None
    return _spec(case, layouts=layouts, extra=("strided",) + (("stacked",) if "sources" in layouts else ()))


def _transposed(case):
    kw = _kw(case)
    if kw.get("layout") != "stacked" or not _tokens(kw) or _op(case) == "merge_partial":
        return None
    return _spec(case, layouts={"sources": ("transposed", 0)}, extra=("strided", "stacked"))


def _offset(case):
    names = {"depth_attention": ("sources", "query", "norm_weight", "out_norm_weight"),
             "depth_attention_multi": ("sources", "queries", "norm_weights"),
             "merge_partial": ("out1", "lse1", "partial", "query", "norm_weight")}[_op(case)]
    return _spec(case, layouts={n: ("offset", 0) for n in names}, extra=("strided",))


def _expanded(case):
    kw = _kw(case)
    if not kw.get("token_query") or not _tokens(kw):
        return None
    return _spec(case, layouts={"query": ("expanded", 0)}, extra=("strided",), post=_post(case, ("expand_query",)))


# -- per-input dtypes ------------------------------------------------------------------------------------
def _input_dtype(name):
    def apply(case):
        kw, op = _kw(case), _op(case)
        other = OTHER_DTYPE[case.dtype]
        if name == "lse1":  # lse1 is given in kappa already: another dtype than kappa
            other = "float32" if case.dtype == "float64" else "float64"
        if name in ("norm_weight", "norm_weights") and kw.get("gain", True) is False:
            return None
        if name == "lse1" and op != "merge_partial":
            return None
        if name in ("query", "norm_weight") and op == "depth_attention_multi":
            name_ = {"query": "queries", "norm_weight": "norm_weights"}[name]
        else:
            name_ = name
        if name == "out_norm_weight":
            if op != "depth_attention":
                return None
            kw = dict(kw, out_norm=True)
        dtypes = dict(case.spec.get("input_dtypes") or {}, **{name_: other})
        point = ("gain",) if name == "norm_weight" else ()
        return _spec(case, kwargs=kw, input_dtypes=dtypes, post=_post(case, ("round_input", name_, other)),
                     point=point)
    return apply


# -- batch shapes ----------------------------------------------------------------------------------------
def _decode_batch(case):
    kw = _kw(case)
    if kw.get("nonfinite"):
        return None
    return _spec(case, kwargs=dict(kw, tokens=(4, 1)))


def _no_token_axes(case):
    kw = _kw(case)
    if kw.get("nonfinite") or not _tokens(kw):
        return None
    kw = dict(kw, tokens=())
    if "token_query" in kw:
        kw["token_query"] = False
    return _spec(case, kwargs=kw)


# -- special values --------------------------------------------------------------------------------------
def _zero_query(case):
    return _spec(case, post=_post(case, ("zero_query",)))


def _scale_zero(case):
    return _spec(case, kwargs=dict(_kw(case), scale=0.0), point=("scale",))


def _negative_scale_large_logits(case):
    kw = _kw(case)
    if kw.get("num_heads", 1) != 1 or kw.get("nonfinite"):
        return None
    z = 1000.0 if case.dtype == "float64" else LARGE_LOGITS  # float64's exp overflows past 709 only
    return _spec(case, kwargs=dict(kw, scale=-1.5, logit_max=z), point=("scale",))


def _nonfinite_every_output(case):
    kw, op = _kw(case), _op(case)
    if int(np.prod(_tokens(kw) or (0,))) < 2 or kw.get("nonfinite"):
        return None
    if op == "depth_attention":
        kw = dict(kw, out_norm=True, weights=True, lse=kw.get("activation", "softmax") == "softmax")
    return _spec(case, kwargs=kw, post=_post(case, ("poison",)))


TRANSFORMS: Tuple[Transform, ...] = (
    Transform("channel_strided", "layouts", "C7, 2.2", "every input a channel-strided view (the output norm's "
              "gain, a merge's per-token query, phase 1's gains included)", False, _channel_strided),
    Transform("token_strided", "layouts", "2.2", "inputs strided along a token axis (a KV-cache slice): a "
              "kernel that assumes rows of D contiguous elements reads other tokens", False, _token_strided),
    Transform("source_strided", "layouts", "2.2", "stacked sources (and phase 1's queries) strided along the "
              "source axis", False, _source_strided),
    Transform("transposed", "layouts", "2.2", "stacked sources stored [T, N, D] and read as [N, T, D]", False,
              _transposed),
    Transform("offset", "layouts", "2.2", "every input a view at a storage offset (a slice of a larger "
              "buffer): a kernel reading the storage's start reads the wrong rows", False, _offset),
    Transform("expanded", "layouts", "C4", "a per-token query broadcast (stride 0) from one row: its gradient "
              "is still per token", False, _expanded),
    Transform("query_dtype", "dtypes", "C10.1, C10.3", "the query in another dtype than the sources: "
              "converted to kappa, its gradient in its own dtype", True, _input_dtype("query")),
    Transform("gain_dtype", "dtypes", "C10.1, C10.3", "the key-norm gain in another dtype than the sources "
              "(bf16 activations with an fp32 gain): converted to kappa, its gradient in its own dtype",
              True, _input_dtype("norm_weight")),
    Transform("out_norm_gain_dtype", "dtypes", "C17, C10.1", "the fused output norm added, its gain in "
              "another dtype than the sources", True, _input_dtype("out_norm_weight")),
    Transform("lse1_dtype", "dtypes", "C10.1, C14", "merge's lse1 in another dtype than kappa", True,
              _input_dtype("lse1")),
    Transform("decode_batch", "batch shapes", "C2, C4", "a decode batch [B = 4, 1, D] (a per-token query "
              "is then [4, 1, D])", False, _decode_batch),
    Transform("no_token_axes", "batch shapes", "C2", "sources [D] with no token axis", False, _no_token_axes),
    Transform("zero_query", "special values", "M8, 2.3", "a zero query (every model's initialization): "
              "uniform weights, and every gradient (d_query is not zero)", False, _zero_query),
    Transform("scale_zero", "special values", "C8", "a logit scale of 0 is a valid scale (uniform weights), "
              "not a missing one", False, _scale_zero),
    Transform("negative_scale_large_logits", "special values", "C10.4", "a negative scale at logits of "
              "magnitude 120: the max subtracted is that of the scaled logits", True,
              _negative_scale_large_logits),
    Transform("nonfinite_every_output", "special values", "C12", "a NaN and an Inf token with every output "
              "(out_normed, lse, weights) and gradient: they stay in their tokens", True, _nonfinite_every_output),
)
BY_NAME: Dict[str, Transform] = {t.name: t for t in TRANSFORMS}


def transform_of(case) -> Optional[Transform]:
    """The transform that made `case` (None for the suite's other cases)."""
    return BY_NAME.get(case.spec.get("transform")) if isinstance(case.spec, dict) else None


def _label(case) -> str:
    row = case.row.replace("/", ".")
    return f"{row}.{case.id.rsplit('/', 2)[1]}"


def transform_cases(cases, dtypes, *, declared=None) -> list:
    """Every transform applied to the first case of each of `BASE_ROWS` in its dtypes: `dtypes`,
    or for the dtype-independent transforms those of them in `FORM_DTYPES` that the port declares
    (`declared`; its first declared dtype when it declares neither).  Marked quick (kept by
    `cases.quick_grid`): those of `QUICK_BASE_ROWS` in one dtype, float32 where it runs."""
    from .cases import Case

    declared = list(declared) if declared is not None else list(FORM_DTYPES)
    form = [d for d in dtypes if d in FORM_DTYPES and d in declared] or [d for d in dtypes if d in declared][:1]
    quick_dtype = "float32" if "float32" in form else (form or [None])[0]
    bases: Dict[tuple, object] = {}
    for case in cases:
        if case.row in BASE_ROWS and case.kind in ("op", "mixed_dtype") and (case.row, case.dtype) not in bases \
                and not case.spec.get("forward_only"):
            bases[(case.row, case.dtype)] = case
    out = []
    for t in TRANSFORMS:
        for row in BASE_ROWS:
            for dtype in dtypes if t.every_dtype else form:
                base = bases.get((row, dtype))
                if base is None:
                    continue
                spec = t.apply(base)
                if spec is None:
                    continue
                spec = dict(spec, transform=t.name)
                kind = "mixed_dtype" if spec.get("input_dtypes") else base.kind
                quick = row in QUICK_BASE_ROWS and dtype == quick_dtype
                out.append(Case(f"transforms/{t.name}/{_label(base)}/{dtype}", kind, dtype, spec, quick))
    return out


# -- the post steps: the golden's inputs changed, its results recomputed by the reference ------------------
def finish(golden, spec: dict):
    """`golden` after the transform's post steps (`spec["post"]`): inputs changed, then every
    output and gradient recomputed by the float64 reference from the new inputs."""
    steps = spec.get("post", ())
    if not steps:
        return golden
    a = dict(golden.arrays)
    dtypes: Dict[str, str] = {}
    for step in steps:
        kind = step[0]
        if kind == "expand_query":
            q = a["input.query"]
            a["input.query"] = np.broadcast_to(q.reshape((-1, q.shape[-1]))[0], q.shape).copy()
        elif kind == "zero_query":
            for key in ("input.query", "input.queries"):
                if key in a:
                    a[key] = np.zeros_like(a[key])
        elif kind == "round_input":
            _, name, dtype = step
            from .numerics import round_to

            if f"input.{name}" in a:
                a[f"input.{name}"] = round_to(a[f"input.{name}"], dtype)
                dtypes[name] = dtype
        elif kind == "round_sources":  # each source exact in its own dtype (C3a rows)
            from .numerics import round_to

            a["input.sources"] = np.stack([round_to(x, d) for x, d in zip(a["input.sources"], step[1])])
        elif kind == "poison":
            _poison(golden.op, a)
    return recompute(golden, a, dtypes)


def _poison(op: str, a: dict) -> None:
    """NaN at (a source, the first token, channel 0) and +Inf at (another source, the last token,
    the last channel); for merge_partial NaN in partial and in out1 (an Inf in out1 turns into
    NaN gradients where the reference has +-Inf in our torch backend's merge VJP: reported, not
    yet pinned)."""
    if op == "merge_partial":
        p, o = a["input.partial"].copy(), a["input.out1"].copy()
        p.reshape((-1, p.shape[-1]))[0, 0] = np.nan
        o.reshape((-1, o.shape[-1]))[-1, -1] = np.nan
        a["input.partial"], a["input.out1"] = p, o
        return
    x = a["input.sources"].copy()
    n = x.shape[0]
    flat = x.reshape((n, -1, x.shape[-1]))
    flat[min(1, n - 1), 0, 0] = np.nan
    flat[min(2, n - 1), -1, -1] = np.inf
    a["input.sources"] = x


def recompute(golden, arrays: dict, input_dtypes: Optional[Dict[str, str]] = None):
    """`golden` with `arrays` (inputs and cotangents) and every output and gradient recomputed by
    the float64 reference; inputs of `input_dtypes` wider than kappa are seen rounded to kappa."""
    from attnres_numpy import ops

    from .numerics import round_to

    a = dict(arrays)
    kappa = compute_dtype_for(golden.dtype)
    wider = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 1}
    seen = {}
    for key, value in a.items():
        if key.startswith("input."):
            name = key[6:]
            dt = (input_dtypes or {}).get(name)
            seen[name] = round_to(value, kappa) if dt and wider[dt] > wider[kappa] else value
    attrs = golden.attrs
    with np.errstate(all="ignore"):
        if golden.op == "depth_attention":
            x = seen["sources"]
            sources = list(x) if golden.sources_layout in ("list", "tuple") else x
            kw = {k: attrs[k] for k in ("eps", "scale", "num_heads", "activation", "key_norm", "out_norm_eps")
                  if k in attrs}
            result = ops.depth_attention(sources, seen["query"], seen.get("norm_weight"),
                                         out_norm_weight=seen.get("out_norm_weight"),
                                         return_lse=attrs.get("return_lse", False),
                                         return_weights=attrs.get("return_weights", False), **kw)
            out, *extra = result if isinstance(result, tuple) else (result,)
            a["output.out"] = out
            for name in ("out_normed", "lse", "weights"):
                if f"output.{name}" in a:
                    a[f"output.{name}"] = extra.pop(0)
            grads = ops.depth_attention_vjp(sources, seen["query"], seen.get("norm_weight"), a["cotangent.out"],
                                            a.get("cotangent.lse"), out_norm_weight=seen.get("out_norm_weight"),
                                            d_out_normed=a.get("cotangent.out_normed"), **kw)
        elif golden.op == "depth_attention_multi":
            x = seen["sources"]
            sources = list(x) if golden.sources_layout in ("list", "tuple") else x
            kw = {k: attrs[k] for k in ("eps", "scale") if k in attrs}
            a["output.out"], a["output.lse"] = ops.depth_attention_multi(sources, seen["queries"],
                                                                         seen.get("norm_weights"), **kw)
            grads = ops.depth_attention_multi_vjp(sources, seen["queries"], seen.get("norm_weights"),
                                                  a["cotangent.out"], a.get("cotangent.lse"), **kw)
        else:
            kw = {k: attrs[k] for k in ("eps", "scale") if k in attrs}
            args = (seen["out1"], seen["lse1"], seen["partial"], seen["query"], seen.get("norm_weight"))
            result = ops.merge_partial(*args, return_lse=attrs.get("return_lse", False), **kw)
            a["output.out"] = result[0] if isinstance(result, tuple) else result
            if "output.lse" in a:
                a["output.lse"] = result[1]
            grads = ops.merge_partial_vjp(*args, a["cotangent.out"], a.get("cotangent.lse"), **kw)
    for name, g in grads.items():
        if g is not None and f"input.{name}" in a:
            a[f"grad.{name}"] = np.stack(g) if isinstance(g, (list, tuple)) else np.asarray(g)
    return dataclasses.replace(golden, arrays=a)


__all__ = ["BASE_ROWS", "BY_NAME", "FORM_DTYPES", "GROUPS", "QUICK_BASE_ROWS", "TRANSFORMS", "Transform",
           "finish", "recompute", "transform_cases", "transform_of"]
