"""What a run covered, and the verdict that says so.

Every result belongs to one family (`family_of`); a family's coverage is the number of its cases
that ran out of those in the port's declared dtypes and devices (a dtype the port never declared
is not a gap in its coverage: the report lists it apart).  The gradient column is a family of its
own.  A full run (no --case / --select) in which a core family ran nothing, or no case past 32
or from 130 sources ran, is *incomplete*: the verdict says which, and the CLI exits 1 unless the
user passes --accept-incomplete.  A run that checked nothing is never a pass.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Sequence, Tuple


def _transform_group(row: str) -> str:
    """The group of a transform row (`transforms/<name>`), "" for other rows."""
    if not row.startswith("transforms/"):
        return ""
    from .transforms import BY_NAME

    t = BY_NAME.get(row.split("/")[1])
    return t.group if t is not None else "layouts"


#: (family, predicate on the row), first match wins; "options" takes the rest.
FAMILIES: List[Tuple[str, Callable[[str], bool]]] = [
    ("every-port rows", lambda r: r.endswith("/sources_past_32")),
    ("shapes", lambda r: r.endswith(("/shapes", "/limits"))),
    ("token shapes", lambda r: r.endswith(("/odd_tokens", "/empty_tokens"))),
    ("magnitudes", lambda r: r.endswith(("/large_magnitude", "/large_logits", "/zero_sources",
                                         "/small_partial_weight"))),
    ("non-finite", lambda r: r.endswith("/nonfinite")),
    ("sizes", lambda r: r.endswith("/large")),
    ("layouts", lambda r: r.endswith(("/stacked", "/strided", "/tuple_sources"))),
    ("output norm", lambda r: r.endswith("/out_norm")),
    ("probe", lambda r: r.startswith("probe/")),
    ("errors", lambda r: r.startswith("errors/")),
    ("cotangents", lambda r: r.startswith("cotangents/")),
    ("sequences", lambda r: r.startswith("sequences/")),
    ("covering arrays", lambda r: r.startswith("covering/")),
    ("autocast", lambda r: r.startswith("autocast/")),
    ("determinism", lambda r: r.startswith("determinism")),
    ("invariants", lambda r: r.startswith("invariants/")),
    ("golden", lambda r: r.startswith("golden/")),
    ("sweep", lambda r: r.startswith("sweep/")),
    # issue 44's transforms (`transforms.py`), by group
    *((f"transforms: {group}", lambda r, g=group: _transform_group(r) == g)
      for group in ("layouts", "dtypes", "batch shapes", "special values")),
]
GRADIENTS = "gradients"
#: Families a full run must have run at least one case of (gradients: unless forward-only).
CORE = ("shapes", "magnitudes", "non-finite", GRADIENTS)
#: N thresholds a full run must have crossed (a silent source cap at 32, a tile at 128).
N_PAST = (33, 130)
_N = re.compile(r"(?:^|[-/])N(\d+)-")


def family_of(row: str) -> str:
    return next((name for name, match in FAMILIES if match(row)), "options")


def _declared(result, caps: dict) -> bool:
    """Whether the result's dtype and device are ones the port declared."""
    return result.dtype in caps.get("dtypes", ()) and result.device in caps.get("devices", (result.device,))


def coverage(results: Sequence, caps: dict) -> Dict[str, Dict[str, int]]:
    """{family: {"run": cases that ran, "total": cases in declared dtypes}} in FAMILIES order,
    then "gradients" (gradient cells), and "largest N run"."""
    out: Dict[str, Dict[str, int]] = {name: {"run": 0, "total": 0} for name, _ in FAMILIES}
    out["options"] = {"run": 0, "total": 0}
    out[GRADIENTS] = {"run": 0, "total": 0}
    for r in results:
        if not _declared(r, caps):
            continue
        family = out[family_of(r.row)]
        family["total"] += 1
        family["run"] += r.forward.status != "skip"
        family["xfail"] = family.get("xfail", 0) + (r.status == "xfail")
        if r.gradient is not None:
            out[GRADIENTS]["total"] += 1
            out[GRADIENTS]["run"] += r.gradient.status != "skip"
            out[GRADIENTS]["xfail"] = out[GRADIENTS].get("xfail", 0) + (r.gradient.status == "xfail")
    return {k: v for k, v in out.items() if v["total"] or k in CORE}


def _checked(result) -> bool:
    """Whether the case ran and was judged by the spec: not skipped, not a declared xfail."""
    return result.forward.status not in ("skip", "xfail") and result.status != "xfail"


def largest_n(results: Sequence) -> int:
    """The largest N among the op cases that ran and were judged (0 when none; xfails do not count)."""
    ns = [int(m.group(1)) for r in results if _checked(r) and r.kind in ("op", "mixed_dtype")
          for m in [_N.search(r.id)] if m]
    return max(ns, default=0)


def gaps(results: Sequence, caps: dict, subset: bool) -> List[str]:
    """Why a run is incomplete ([] when it is not): core families that ran nothing, N thresholds
    never crossed.  A subset run (--case / --select) is judged only on having run anything."""
    cov = coverage(results, caps)
    if not any(v["run"] for v in cov.values()):
        return ["nothing was checked"]
    if subset:
        return []
    missing = []
    for name in CORE:
        if name == GRADIENTS and not caps.get("backward", True):
            continue
        family = cov.get(name, {"run": 0})
        if family["run"] == 0:
            missing.append(f"no {name} case ran")
        elif family["run"] == family.get("xfail", 0):
            missing.append(f"every {name} case that ran is a declared expected failure")
    n = largest_n(results)
    for threshold in N_PAST:
        if n < threshold:
            missing.append(f"no case with N >= {threshold} ran (largest N run: {n})")
    return missing


def coverage_text(results: Sequence, caps: dict) -> str:
    cov = coverage(results, caps)
    parts = [f"{name} {v['run']}/{v['total']}" + (f" ({v['xfail']} xfail)" if v.get("xfail") else "")
             for name, v in cov.items()]
    return ", ".join(parts) + f"; largest N run {largest_n(results)}"
