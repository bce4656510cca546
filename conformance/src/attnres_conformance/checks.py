"""Running one case against a backend: `check_case(backend, case, device) -> (forward, gradient)`.

Each check returns two `Cell`s, the matrix cells of the case: forward (outputs) and gradient
(every gradient, from a call with random cotangents), or None where the case has no gradient
column.  A cell passes only when every comparison passes; its `err` is the largest
`tolerances.rel_err` among them (None for checks that compare bitwise or by exception).
"""

from __future__ import annotations

import builtins
import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
from attnres_core.validation import compute_dtype_for
from attnres_numpy import ops

from . import naive
from .backend import OpCall, ProbeCall
from .cases import Case
from .numerics import round_to
from .tolerances import Comparison, attainable, compare, flash_rule

#: Spec argument names of each op, in call order (out_norm_weight: a keyword argument, in a
#: call's inputs only where the case gives it, C17).
INPUTS = {
    "depth_attention": ("sources", "query", "norm_weight", "out_norm_weight"),
    "depth_attention_multi": ("sources", "queries", "norm_weights"),
    "merge_partial": ("out1", "lse1", "partial", "query", "norm_weight"),
}
#: Outputs and gradients that live in the compute dtype rather than the case dtype (C10).
COMPUTE_DTYPE = ("lse", "weights", "lse1")
LOW_PRECISION = ("float16", "bfloat16")


@dataclass
class Cell:
    """One matrix cell of one case.  status: pass | fail | skip | xfail | xpass."""

    status: str
    err: Optional[float] = None
    message: str = ""


def _cell(comparisons: List[Comparison], failures: List[str]) -> Cell:
    failures = failures + [f"{c.name}: rel_err {c.err:.3g} > {c.rtol:.3g}" + (f" ({c.message})" if c.message else "")
                           for c in comparisons if not c.ok]
    err = max((c.err for c in comparisons), default=None)
    return Cell("fail" if failures else "pass", err, "; ".join(failures))


def _array_dtype(golden, name: str) -> str:
    return compute_dtype_for(golden.tolerance_class) if name in COMPUTE_DTYPE else golden.tolerance_class


# -- calls ---------------------------------------------------------------------------------------
def op_call(golden, device: str = "cpu", *, backward: bool, strided: bool = False,
            input_dtypes: Optional[dict] = None, layouts: Optional[dict] = None,
            autocast: Optional[str] = None) -> OpCall:
    """The backend call of an op golden case (fresh copies of its inputs); sources as a list,
    tuple or stacked array as the case says.  input_dtypes: per-input dtypes other than the
    case's (a query in its own dtype, C10.1)."""
    a = golden.arrays
    inputs = {}
    for name in INPUTS[golden.op]:
        value = a.get(f"input.{name}")
        if value is not None and name == "sources" and golden.sources_layout in ("list", "tuple"):
            inputs[name] = (list if golden.sources_layout == "list" else tuple)(s.copy() for s in value)
        elif value is not None or name != "out_norm_weight":
            inputs[name] = None if value is None else value.copy()
    compute = compute_dtype_for(golden.dtype)
    input_dtypes = dict({"lse1": compute} if golden.op == "merge_partial" and compute != golden.dtype else {},
                        **(input_dtypes or {}))
    cot = ({k.split(".", 1)[1]: v.copy() for k, v in a.items() if k.startswith("cotangent.")}
           if backward else None)
    return OpCall(golden.op, inputs, dict(golden.attrs), golden.dtype, input_dtypes, device, strided, cot,
                  layouts=dict(layouts or {}), autocast=autocast)


def probe_call(golden, device: str = "cpu", *, backward: bool) -> ProbeCall:
    """The backend call of a probe golden case."""
    a = golden.arrays
    params = {k.split(".", 1)[1]: v.copy() for k, v in a.items()
              if k.startswith("input.") and k not in ("input.embedding", "input.sublayer_weights")}
    return ProbeCall(dict(golden.attrs["config"]), params, a["input.embedding"].copy(),
                     a["input.sublayer_weights"].copy(), golden.dtype, device, golden.attrs["schedule"],
                     a["cotangent.out"].copy() if backward else None,
                     mix=golden.attrs.get("mix"), scale=golden.attrs.get("scale"),
                     sublayer_dtype=golden.attrs.get("sublayer_dtype"))


def _call(backend, golden, device, *, backward, strided=False, input_dtypes=None):
    if golden.op == "probe":
        call = probe_call(golden, device, backward=backward)
        return call, backend.call_probe(call)
    call = op_call(golden, device, backward=backward, strided=strided, input_dtypes=input_dtypes)
    return call, backend.call_op(call)


def _snapshot(value):
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_snapshot(v) for v in value]
    return value.copy() if isinstance(value, np.ndarray) else value


def _same(a, b) -> bool:
    """Bitwise equality of arrays, lists of arrays and dicts of them (NaN equals NaN)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.astype(np.float64), b.astype(np.float64), equal_nan=True)


def _untouched(call, before, result) -> List[str]:
    """Inputs handed over unchanged, and the native inputs read back equal to them."""
    failures = []
    given = call.inputs if isinstance(call, OpCall) else dict(call.params, embedding=call.embedding,
                                                               sublayer_weights=call.sublayer_weights)
    before = before if isinstance(call, OpCall) else dict(before.params, embedding=before.embedding,
                                                          sublayer_weights=before.sublayer_weights)
    for name, value in given.items():
        if not _same(value, before[name]):
            failures.append(f"the adapter modified the NumPy input {name!r}")
    if isinstance(call, OpCall):
        after = getattr(result, "inputs_after", {}) or {}
        for name, value in before.items():
            if value is None:
                continue
            if name not in after:
                failures.append(f"inputs_after[{name!r}] missing (the adapter must read inputs back)")
            elif not _same(after[name], value):
                failures.append(f"input {name!r} was modified by the op")
    return failures


def expected_dtypes(call: OpCall) -> dict:
    """C10.3: the dtype of every result of `call`: "out" in the sources' dtype (merge_partial:
    the partial's; "out_normed" too), "lse" / "weights" in kappa, "grad.<input>" in that input's dtype (a list
    for list / tuple sources)."""
    source = "partial" if call.op == "merge_partial" else "sources"
    src = call.input_dtypes.get(source, call.dtype)
    if getattr(call, "autocast", None) is not None:  # C3a: the widest of the sources (merge: out1, partial)
        given = list(src) if isinstance(src, (list, tuple)) else [src]
        if call.op == "merge_partial":
            given.append(call.input_dtypes.get("out1", call.dtype))
        src = _widest(given)
    src = src[0] if isinstance(src, (list, tuple)) else src
    kappa = compute_dtype_for(src)
    expected = {"out": src, "out_normed": src, "lse": kappa, "weights": kappa}
    for name, value in call.inputs.items():
        if value is not None:
            dtype = call.input_dtypes.get(name, call.dtype)
            if name == "sources" and isinstance(value, (list, tuple)) and isinstance(dtype, str):
                dtype = [dtype] * len(value)
            expected[f"grad.{name}"] = dtype
    return expected


def _probe_contract(call: ProbeCall, result) -> List[str]:
    """M1a: the probe's `out` is in the embedding's dtype (the call's), whatever dtype its
    sublayers return; a port that does not report it (`ProbeResult.out_dtype` None) fails only
    the rows whose point it is (`ProbeCall.sublayer_dtype`)."""
    got = getattr(result, "out_dtype", None)
    if got is None:
        return ([] if getattr(call, "sublayer_dtype", None) is None else
                ["ProbeResult.out_dtype not reported: the stream's dtype (M1a) cannot be checked"])
    if got != call.dtype:
        return [f"out is {got}, expected the embedding's dtype {call.dtype} (M1a: the stream keeps it"
                + (f"; the sublayers returned {call.sublayer_dtype})" if getattr(call, "sublayer_dtype", None)
                   else ")")]
    return []


def _widest(dtypes) -> str:
    """C3a's widening: the widest dtype; float16 with bfloat16 gives float32."""
    dtypes = set(dtypes)
    if {"float16", "bfloat16"} <= dtypes:
        dtypes.add("float32")
    return max(dtypes, key=("bfloat16", "float16", "float32", "float64").index)


def _narrowest(dtypes) -> str:
    return min(set(dtypes), key=("bfloat16", "float16", "float32", "float64").index)


def _contract(call: OpCall, result, backward: bool, grads_only: bool = False) -> List[str]:
    """C10.3 (every result in its dtype, as the adapter reports it before read-back) and C7a (no
    result shares memory with an input)."""
    failures = []
    reported = getattr(result, "native_dtypes", None) or {}
    expected = expected_dtypes(call)
    names = [] if grads_only else [k for k in result.outputs if result.outputs[k] is not None]
    if backward:
        names += [f"grad.{k}" for k, v in result.grads.items() if v is not None]
    for name in names:
        want = expected.get(name)
        if want is None:
            continue
        if reported.get(name) is None:
            failures.append(f"adapter did not report the native dtype of {name!r} (OpResult.native_dtypes, C10.3)")
            continue
        got = reported[name]
        if isinstance(want, list):
            got = [got] * len(want) if isinstance(got, str) else list(got)
        if got != want:
            failures.append(f"C10.3: {name!r} is {got}, expected {want}")
    aliased = [a for a in getattr(result, "aliases", ())
               if (backward or not a.startswith("grad.")) and not (grads_only and not a.startswith("grad."))]
    if aliased:
        failures.append(f"C7a: {', '.join(map(repr, aliased))} share memory with an input (results must be fresh)")
    return failures


def _stacked(value):
    return np.stack([np.asarray(v) for v in value]) if isinstance(value, (list, tuple)) else value


def _compare_outputs(golden, result, override) -> Tuple[List[Comparison], List[str]]:
    outputs = result.outputs if hasattr(result, "outputs") else {"out": result.out}
    comps, failures = [], []
    for key, ref in golden.arrays.items():
        if key.startswith("output."):
            name = key.split(".", 1)[1]
            if outputs.get(name) is None:
                failures.append(f"output {name!r} missing")
            else:
                comps.append(compare(name, outputs[name], ref, _array_dtype(golden, name), grad=False,
                                     override=override))
    return comps, failures


def _compare_grads(golden, result, override, input_dtypes=None) -> Tuple[List[Comparison], List[str]]:
    """Every gradient vs the reference, each held to its input's dtype (C10.3: a float32 query's
    gradient is float32 whatever the sources' dtype), or to kappa's when the input is wider (a
    float64 query's gradient is computed in float32 for float32 sources, C10.1)."""
    comps, failures = [], []
    kappa = compute_dtype_for(golden.dtype)
    input_dtypes = {k: kappa if v == "float64" else v for k, v in (input_dtypes or {}).items()}
    for key, ref in golden.arrays.items():
        if key.startswith("grad."):
            name = key.split(".", 1)[1]
            got = result.grads.get(name)
            if got is None:
                failures.append(f"gradient {name!r} missing")
                continue
            if name == "sources" and golden.op != "probe" and golden.sources_layout in ("list", "tuple") \
                    and not isinstance(got, (list, tuple)):
                failures.append(f"gradient 'sources' must be a list when sources were given as a "
                                f"{golden.sources_layout}")
                continue
            dtype = input_dtypes.get(name) if isinstance(input_dtypes.get(name), str) else None
            if isinstance(input_dtypes.get(name), (list, tuple)):  # per-source dtypes (C3a): the narrowest's tolerance
                dtype = _narrowest(input_dtypes[name])
            comps.append(compare(f"d_{name}", _stacked(got), ref, dtype or _array_dtype(golden, name), grad=True,
                                 override=override, floor=condition_floor(golden, name)))
    return comps, failures


def condition_floor(golden, name: str):
    """For d_query / d_norm_weight of depth_attention: the sum of the magnitudes of the terms
    their reference sums, sum_i |dz_i| |s r_i x_i| |g| (|q| for the gain), elementwise.  These
    gradients are sums of terms that cancel (the softmax's dz_i sum to about 0): at N = 2, D = 1,
    or at a logit gap of 120 without a d_lse cotangent, the result is far smaller than its terms,
    and an honest float32 port's error, a rounding of the terms, exceeds the array's own RMS.
    For d_sources the dz_i terms of each source's own gradient, |dz_i| |s| r_i (|qg| + r_i^2
    |s_i| |x_i| / Dh), with |dz_i| = p_i (|dp_i| + |<g, out>|): at a dominant weight short of 1
    (p = 0.9997 at logits of 120) dz_i is a difference far below its terms, and a float32 lse
    (spec: lse stays in kappa) rounds p_i by an ulp of the logits.
    Measured against this floor, a rounding-level error passes and a wrong term (an O(1) part
    of the terms) still fails.  None elsewhere."""
    if golden.op != "depth_attention" or name not in ("query", "norm_weight", "sources"):
        return None
    a, at = golden.arrays, golden.attrs
    x, q, g = a["input.sources"], a["input.query"], a.get("input.norm_weight")
    if name == "norm_weight" and g is None:
        return None
    kw = {k: at[k] for k in ("eps", "scale", "num_heads", "activation", "key_norm") if k in at}
    h, s = int(kw.get("num_heads", 1)), float(kw.get("scale", 1.0))
    with np.errstate(all="ignore"):
        out, w = ops.depth_attention(list(x), q, g, return_weights=True, **kw)
        d = x.shape[-1]
        xh = x.reshape(x.shape[:-1] + (h, d // h))
        r = 1.0 / np.sqrt(np.mean(xh ** 2, axis=-1, keepdims=True) + kw.get("eps", 1e-6)) \
            if kw.get("key_norm", True) else np.ones(xh.shape[:-1] + (1,))
        dout = a["cotangent.out"].reshape(out.shape[:-1] + (h, d // h))
        outh = out.reshape(dout.shape)
        wh = np.abs(w).reshape(xh.shape[:-1])
        dz = wh * (np.abs(np.sum(dout * xh, -1)) + np.abs(np.sum(dout * outh, -1)))
        if a.get("cotangent.lse") is not None:
            dz = dz + wh * np.abs(a["cotangent.lse"]).reshape(wh.shape[1:])
        if name == "sources":  # d_x_i's dz_i terms: a_i qg - b_i x_i, a_i = s dz_i r_i, b_i = a_i s_i r_i^2 / Dh
            qg = q * g if g is not None else q
            qgh = np.abs(qg.reshape(qg.shape[:-1] + (h, d // h)))
            norm = (r ** 2 * np.abs(np.sum(xh * qg.reshape(qgh.shape), -1, keepdims=True)) * np.abs(xh) / (d // h)
                    if kw.get("key_norm", True) else 0.0)
            terms = dz[..., None] * abs(s) * r * (qgh + norm)
            return np.nan_to_num(terms.reshape(x.shape), nan=0.0, posinf=0.0)
        terms = (dz[..., None] * abs(s) * np.abs(xh * r)).reshape(x.shape)
        other = np.abs(g) if name == "query" and g is not None else np.abs(q) if name == "norm_weight" else 1.0
        terms = terms * other
        total = terms.sum(axis=0)
        if name == "norm_weight" or q.ndim == 1:
            total = total.reshape(-1, d).sum(axis=0)
    return np.nan_to_num(total, nan=0.0, posinf=0.0)


def _naive(golden) -> dict:
    """The naive low-precision composition of a depth_attention / multi golden case."""
    a, attrs = golden.arrays, golden.attrs
    if golden.op == "depth_attention":
        kw = {k: attrs[k] for k in ("eps", "scale", "num_heads", "activation", "key_norm")}
        return naive.depth_attention(a["input.sources"], a["input.query"], a.get("input.norm_weight"),
                                     a["cotangent.out"], dtype=golden.dtype, d_lse=a.get("cotangent.lse"),
                                     out_norm_weight=a.get("input.out_norm_weight"),
                                     out_norm_eps=attrs.get("out_norm_eps"),
                                     d_out_normed=a.get("cotangent.out_normed"), **kw)
    return naive.depth_attention_multi(a["input.sources"], a["input.queries"], a.get("input.norm_weights"),
                                       a["cotangent.out"], a["cotangent.lse"], dtype=golden.dtype,
                                       eps=attrs["eps"], scale=attrs["scale"])


def _flash(golden, comps: List[Comparison], naive_result: Optional[dict]) -> List[Comparison]:
    """FlashAttention's rule for every low-precision array among `comps`."""
    if naive_result is None:
        return []
    rules = []
    for c in comps:
        name = c.name[2:] if c.name.startswith("d_") else c.name
        ref = golden.arrays.get(f"{'grad' if c.name.startswith('d_') else 'output'}.{name}")
        if naive_result.get(name) is not None and name not in COMPUTE_DTYPE:
            rules.append(flash_rule(c.name, c.err, naive_result[name], ref, golden.dtype))
    return rules


def _attainable(golden, c: Comparison, naive_probe: dict) -> Comparison:
    grad = c.name.startswith("d_")
    name = c.name[2:] if grad else c.name
    ref = golden.arrays[f"{'grad' if grad else 'output'}.{name}"]
    return attainable(c, naive_probe[name], ref, golden.dtype)


# -- checks by kind ------------------------------------------------------------------------------
def _finite(name, value) -> List[str]:
    v = _stacked(value)
    return [] if v is None or np.all(np.isfinite(np.asarray(v, dtype=np.float64))) else \
        [f"{name}: {int(np.sum(~np.isfinite(np.asarray(v, dtype=np.float64))))} non-finite values"]


def check_reference(backend, golden, device, *, strided=False, check="tolerance", override=None,
                    gradient=True, input_dtypes=None, layouts=None, autocast=None) -> Tuple[Cell, Optional[Cell]]:
    """Forward (a call without cotangents) and gradient (a call with them) vs the reference;
    for ops also the result dtypes (C10.3) and no aliasing (C7a).

    A backend that declares `forward_in_gradient_call = True` (its forward-only program runs the
    same code as the forward of its gradient program; see `adapters.jax`) gets one call per
    gradient case: the forward cell reads that call's outputs.  If that call raises, the forward
    runs on its own, so a broken backward never hides the forward's status.  The forward-only
    program is still checked: `forward_only` cases have no gradient (`gradient=False`)."""
    if override is None and golden.op == "probe":
        override = "probe"
    flash = (check == "tolerance" and golden.dtype in LOW_PRECISION
             and golden.op in ("depth_attention", "depth_attention_multi"))
    naive_result = _naive(golden) if flash else None
    naive_probe = (naive.probe(golden, backward=gradient) if golden.op == "probe" and golden.dtype in LOW_PRECISION
                   and check == "tolerance" else None)

    def run(backward: bool):
        call = (op_call(golden, device, backward=backward, strided=strided, input_dtypes=input_dtypes,
                        layouts=layouts, autocast=autocast)
                if golden.op != "probe" else probe_call(golden, device, backward=backward))
        before = _snapshot(call.inputs) if isinstance(call, OpCall) else _snapshot(call)
        result = backend.call_op(call) if isinstance(call, OpCall) else backend.call_probe(call)
        return call, before, result

    def cell(call, before, result, backward: bool) -> Cell:
        """The forward (outputs) or gradient (gradients only: an output of the gradient call that
        misses is the forward cell's finding, not this one's) cell of one call's result."""
        failures = _untouched(call, before, result)
        if isinstance(call, OpCall):
            failures += _contract(call, result, backward, grads_only=backward)
        elif not backward:
            failures += _probe_contract(call, result)
        if backward:
            comps, missing = _compare_grads(golden, result, override, input_dtypes)
        else:
            comps, missing = _compare_outputs(golden, result, override)
        if check == "finite":
            outputs = {} if backward else result.outputs if hasattr(result, "outputs") else {"out": result.out}
            arrays = dict(outputs, **{f"d_{k}": v for k, v in (result.grads.items() if backward else ())})
            failures += missing + [f for k, v in arrays.items() for f in _finite(k, v)]
            return Cell("fail" if failures else "pass", None, "; ".join(failures))
        if naive_probe is not None:
            comps = [_attainable(golden, c, naive_probe) for c in comps]
        comps += _flash(golden, [c for c in comps if backward == c.name.startswith("d_")], naive_result)
        return _cell(comps, failures + missing)

    if gradient and getattr(backend, "forward_in_gradient_call", False):
        try:
            done = run(True)
        except Exception:  # noqa: BLE001 - judged below by the separate calls
            pass
        else:
            return cell(*done, False), cell(*done, True)
    forward = cell(*run(False), False)  # a raising forward is the caller's error cell
    if not gradient:
        return forward, None
    try:
        return forward, cell(*run(True), True)
    except Exception as exc:  # noqa: BLE001 - a crash in the VJP fails the gradient cell only
        return forward, Cell("fail", None, f"the call with cotangents raised {type(exc).__name__}: {exc}")


def argument_name(backend, spec_name: str) -> str:
    """The port's own name for a spec argument (`backend.arg_names`, e.g. {"sources": "xs"});
    "sources[2]" maps its base name."""
    names = getattr(backend, "arg_names", None) or {}
    base, bracket, rest = spec_name.partition("[")
    return names.get(spec_name) or (names.get(base, base) + bracket + rest)


#: The message prefix of an error case that raised nothing (a validation gap when the port
#: declares `validates_inputs=False`; `runner.category_of` files it apart from numerics).
NO_ERROR = "no error raised"


def check_error(backend, case: Case, device, caps=None) -> Cell:
    """A spec error: the right exception type, the argument named in the message (in the port's
    own name, `argument_name`), inputs untouched.  A declared-limit case (N = max_sources + 1)
    that raises nothing is judged by its result: dropped sources, or a limit that is not one."""
    s = case.spec
    call = OpCall(s["op"], _snapshot(s["inputs"]), dict(s["attrs"]), case.dtype, dict(s["input_dtypes"]), device)
    before = _snapshot(call.inputs)
    expected = getattr(builtins, s["exception"])
    arg = argument_name(backend, s["argument"])
    failures = []
    try:
        result = backend.call_op(call)
        failures.append(f"{NO_ERROR}; expected {s['exception']} naming {arg!r}")
        if s.get("limit") is not None:
            failures[-1] += "; " + _past_limit(call, result, s["limit"])
    except expected as exc:
        if arg not in str(exc):
            failures.append(f"{s['exception']} message does not name {arg!r}: {exc}")
    except Exception as exc:  # noqa: BLE001 - the wrong type is the finding
        failures.append(f"raised {type(exc).__name__} ({exc}); expected {s['exception']} naming {arg!r}")
    if not _same(call.inputs, before):
        failures.append("the adapter modified its NumPy inputs")
    status = "fail" if failures else "pass"
    # A port that declares it checks no arguments: a spec error it does not raise, or that only
    # its framework raises (another type, another message), is a gap; modified inputs still fail.
    if failures and caps is not None and not caps.validates_inputs and s.get("limit") is None \
            and not any(f.startswith("the adapter modified") for f in failures):
        status = "gap"
    return Cell(status, None, "; ".join(failures))


def _past_limit(call: OpCall, result, limit: int) -> str:
    """What a port that computed N = limit + 1 sources did: compared with the reference over all
    N sources, and over the first `limit` only."""
    out = getattr(result, "outputs", {}).get("out")
    if out is None:
        return "and it returned no 'out' to judge"
    x, q = call.inputs["sources"], call.inputs["query"]
    dtype = call.dtype
    every = ops.depth_attention(list(x), q, None)
    first = ops.depth_attention(list(x[:limit]), q, None)
    if compare("out", out, every, dtype, grad=False).ok:
        return (f"it computes all {limit + 1} sources correctly: the declared max_sources = {limit} is "
                "not a limit (raise it, or enforce it with a ValueError)")
    if compare("out", out, first, dtype, grad=False).ok:
        return f"it silently drops every source past {limit} (C16: raise a ValueError instead)"
    return f"its result matches neither all {limit + 1} sources nor the first {limit} (C16)"


def check_determinism(backend, case: Case, device, *, gradient: bool = True) -> Tuple[Cell, Optional[Cell]]:
    """Two identical runs give bitwise equal outputs (forward) and gradients (gradient; None
    without: a forward-only port)."""
    golden = case.golden()
    cells = []
    for backward in (False, True)[:1 + gradient]:
        runs = [_call(backend, golden, device, backward=backward,
                      input_dtypes=case.spec.get("input_dtypes"))[1] for _ in range(2)]
        what, first, second = (("gradient", runs[0].grads, runs[1].grads) if backward else
                               ("output", *[r.outputs if hasattr(r, "outputs") else {"out": r.out} for r in runs]))
        failures = [f"{what} {k!r} differs between two identical runs" for k in first
                    if not _same(first[k], second.get(k))]
        cells.append(Cell("fail" if failures else "pass", None, "; ".join(failures)))
    return cells[0], (cells[1] if gradient else None)


def _two_phase(backend, golden, device, caps) -> Cell:
    """Phase 1 + merge on the backend equals the backend's direct call, and the reference (lse
    too, where the port's merge returns it and its depth_attention declares lse)."""
    a, dtype = golden.arrays, golden.dtype
    compute = compute_dtype_for(dtype)
    x, qs, gs = a["input.sources"], a["input.queries"], a.get("input.norm_weights")
    rng = np.random.default_rng(golden.seed)
    partial = round_to(rng.standard_normal(x.shape[1:]), dtype)
    src = list(x) if golden.sources_layout == "list" else x
    phase1 = backend.call_op(OpCall("depth_attention_multi", dict(sources=src, queries=qs, norm_weights=gs),
                                    dict(golden.attrs), dtype, device=device)).outputs
    comps = []
    with_lse = caps.merge_lse and "lse" in caps.options
    for s in range(qs.shape[0]):
        g = None if gs is None else gs[s]
        merged = backend.call_op(OpCall(
            "merge_partial", dict(out1=np.asarray(phase1["out"][s], np.float64),
                                  lse1=np.asarray(phase1["lse"][s], np.float64), partial=partial,
                                  query=qs[s], norm_weight=g),
            dict(golden.attrs, return_lse=with_lse), dtype, {"lse1": compute} if compute != dtype else {},
            device)).outputs
        whole = [*x, partial] if golden.sources_layout == "list" else np.concatenate([x, partial[None]])
        direct = backend.call_op(OpCall("depth_attention", dict(sources=whole, query=qs[s], norm_weight=g),
                                        dict(golden.attrs, **({"return_lse": True} if with_lse else {})), dtype,
                                        device=device)).outputs
        ref_out, ref_lse = ops.depth_attention([*x, partial], qs[s], g, return_lse=True, **golden.attrs)
        for name, ref in (("out", ref_out), ("lse", ref_lse))[:1 + with_lse]:
            dt = compute if name == "lse" else dtype
            comps += [compare(f"two-phase {name}[{s}] vs direct", merged[name], direct[name], dt, grad=False,
                              override="two_phase_vs_direct"),
                      compare(f"two-phase {name}[{s}] vs reference", merged[name], ref, dt, grad=False,
                              override="two_phase")]
    return _cell(comps, [])


def _identity(golden, call: OpCall, result) -> Cell:
    """C6 at N = 1: out is the source bitwise, weights are exactly 1, lse is z_0 (the
    reference's lse, to tolerance); C7a: out is a fresh array even though it equals the source."""
    failures, comps = _contract(call, result, backward=False), []
    out = result.outputs.get("out")
    if out is None or not _same(np.asarray(out, np.float64), golden.arrays["input.sources"][0]):
        failures.append("N = 1 must return the source exactly (C6)")
    if "output.weights" in golden.arrays:
        w = result.outputs.get("weights")
        if w is None or not _same(np.asarray(w, np.float64), np.ones(golden.arrays["output.weights"].shape)):
            bad = "missing" if w is None else f"in [{np.min(w):.9g}, {np.max(w):.9g}]"
            failures.append(f"N = 1 must give weights exactly 1 (C6); got {bad}")
    if "output.lse" in golden.arrays:
        lse = result.outputs.get("lse")
        if lse is None:
            failures.append("output 'lse' missing")
        else:
            comps.append(compare("lse = z_0", lse, golden.arrays["output.lse"],
                                 compute_dtype_for(golden.dtype), grad=False))
    cell = _cell(comps, failures)
    if cell.err is None and cell.status == "pass":
        cell.err = 0.0
    return cell


def check_invariant(backend, case: Case, device, caps=None) -> Cell:
    golden, inv = case.golden(), case.spec["invariant"]
    if inv == "two_phase":
        return _two_phase(backend, golden, device, caps or backend.capabilities())
    call = op_call(golden, device, backward=False)
    result = backend.call_op(call)
    if inv == "identity":
        return _identity(golden, call, result)
    w = np.asarray(result.outputs["weights"], dtype=np.float64)
    compute = compute_dtype_for(golden.dtype)
    if inv == "weights_sum":
        c = compare("sum_i weights", np.sum(w, axis=0), np.ones(w.shape[1:]), compute, grad=False)
    else:  # zero_query_uniform: zero logits give uniform weights (the spec's init, M8)
        c = compare("weights (zero query)", w, np.full(w.shape, 1.0 / w.shape[0]), compute, grad=False)
    return _cell([c], [])


#: Words a clear cotangent error names (the cotangent's own name is added per case): the spec's
#: d_<output>, or a framework's own autodiff check (torch's grad_output, JAX's and MLX's VJP).
_COTANGENT_WORDS = ("cotangent", "grad_output", "VJP", "vjp")


def check_cotangent(backend, case: Case, device, caps=None) -> Cell:
    """A bad cotangent for one output (`cases.COTANGENT_VARIANTS`): a wrong or broadcastable
    shape must raise an error naming the cotangent (its output's name, d_<name>, "cotangent" or
    the framework's "grad_output"); a wrong dtype may raise so, or be cast: then every gradient
    must equal the port's own for the same values in the output's dtype (exact in both)."""
    from .transforms import OTHER_DTYPE

    golden, s = case.golden(), case.spec
    name, variant = s["output"], s["variant"]
    call = op_call(golden, device, backward=True)
    if name not in (call.cotangents or {}):
        return Cell("skip", None, f"the case has no {name!r} output to take a cotangent of")
    good = np.asarray(call.cotangents[name])
    what = f"a {variant.replace('_', ' ')} cotangent for {name!r}"
    if variant == "wrong_dtype":
        other = OTHER_DTYPE[case.dtype]
        bad = round_to(good, other)
        call.cotangents[name], call.cotangent_dtypes = bad.copy(), {name: other}
        what += f" ({other}, the output is {case.dtype if name not in COMPUTE_DTYPE else _array_dtype(golden, name)})"
    else:
        shape = good.shape[:-1] + (good.shape[-1] + 1,) if variant == "wrong_shape" and good.ndim else \
            (good.shape + (2,) if variant == "wrong_shape" else (1,) + good.shape[1:])
        bad = np.ones(shape)
        call.cotangents[name] = bad
        what += f" (shape {shape}, the output is {good.shape})"
    try:
        result = backend.call_op(call)
    except Exception as exc:  # noqa: BLE001 - judged by its message
        text = str(exc)
        if any(w in text for w in _COTANGENT_WORDS) or f"d_{name}" in text or f"'{name}'" in text:
            return Cell("pass", None, "")
        return Cell("fail", None, f"{what} raised an unclear {type(exc).__name__} (it names no cotangent): {text[:200]}")
    if variant != "wrong_dtype":
        return Cell("fail", None, f"{what} was accepted (broadcast or truncated silently): expected an error naming it")
    # Accepted: it must equal the port's own call with the same values in the output's dtype (the
    # row judges the cotangent's handling; the gradients' correctness is every other row's).
    same = op_call(golden, device, backward=True)
    same.cotangents[name] = bad.copy()
    own = backend.call_op(same)
    comps = []
    for key, want in own.grads.items():
        got = result.grads.get(key)
        if want is None or got is None:
            continue
        comps.append(compare(f"d_{key}", _stacked(got), _stacked(want), golden.tolerance_class, grad=True))
    cell = _cell(comps, [])
    if cell.status == "fail":
        cell.message = f"{what} was accepted, but its gradients differ from those of the cast cotangent: {cell.message}"
    return cell


def check_sequence(backend, case: Case, device, caps=None) -> Cell:
    """The case's op called on the same inputs (one signature) step by step with changed scalars:
    each valid step equals the reference at its own attrs, each invalid one raises its error naming
    the argument, also after valid calls (`cases.SEQUENCES`)."""
    from .transforms import recompute

    golden = case.golden()
    failures, comps = [], []
    # A port that declares no argument checks: a missing or framework-raised error is a gap (as in
    # `check_error`); its valid steps are still compared.
    unchecked = caps is not None and not caps.validates_inputs
    gaps: List[str] = []
    for i, (change, expect) in enumerate(case.spec["steps"], 1):
        attrs = dict(golden.attrs, **change)
        call = op_call(golden, device, backward=False)
        call.attrs = attrs
        step = f"call {i} ({', '.join(f'{k}={v:g}' for k, v in change.items())})"
        if expect == "ok":
            try:
                result = backend.call_op(call)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{step} raised {type(exc).__name__}: {exc}")
                continue
            ref = recompute(dataclasses.replace(golden, attrs=attrs), golden.arrays).arrays["output.out"]
            comps.append(compare(f"out of {step}", result.outputs.get("out"), ref, golden.tolerance_class, grad=False))
            continue
        exc_name, arg = expect
        arg = argument_name(backend, arg)
        found = gaps if unchecked else failures
        try:
            backend.call_op(call)
            found.append(f"{step} after valid calls of the same signature: {NO_ERROR}; expected {exc_name} "
                         f"naming {arg!r} (a per-signature plan cache must not skip the scalar checks)")
        except getattr(builtins, exc_name) as exc:
            if arg not in str(exc):
                found.append(f"{step}: {exc_name} message does not name {arg!r}: {exc}")
        except Exception as exc:  # noqa: BLE001
            found.append(f"{step} raised {type(exc).__name__} ({exc}); expected {exc_name} naming {arg!r}")
    cell = _cell(comps, failures)
    if gaps and cell.status == "pass":
        return Cell("gap", cell.err, "; ".join(gaps))
    return cell


def check_case(backend, case: Case, device: str = "cpu", caps=None) -> Tuple[Cell, Optional[Cell]]:
    """Run one case; returns (forward cell, gradient cell or None: none for the case, or a
    forward-only port, `Capabilities.backward`)."""
    caps = caps or backend.capabilities()
    if case.kind == "error":
        return check_error(backend, case, device, caps), None
    if case.kind == "sequence":
        return check_sequence(backend, case, device, caps), None
    if case.kind == "cotangent":
        if not caps.backward:
            return Cell("skip", None, "forward-only port (declared backward=False)"), None
        return check_cotangent(backend, case, device, caps), None
    if case.kind == "determinism":
        return check_determinism(backend, case, device, gradient=caps.backward)
    if case.kind == "invariant":
        return check_invariant(backend, case, device, caps), None
    spec = case.spec
    return check_reference(backend, case.golden(), device, strided=spec.get("strided", False),
                           check=spec.get("check", "tolerance"), override=spec.get("override"),
                           gradient=case.has_gradient and caps.backward, input_dtypes=spec.get("input_dtypes"),
                           layouts=spec.get("layouts"), autocast=spec.get("autocast"))
