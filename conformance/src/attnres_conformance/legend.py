"""What a report's cells mean (the legend, from the live tolerance table), the one-line-per-
backend summary of a run over several backends, and the whole document of such a run (markdown
and JSON).  Rendering only: `runner.Report` holds the data of one backend."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from . import SPEC_VERSION, __version__
from .tolerances import FLASH_FACTOR, OVERRIDES, TOLERANCES

METRIC = ("the largest relative error among the cell's cases and compared arrays (outputs, lse and weights in "
          "the forward column; every input's gradient in the gradient column): "
          "rel_err(a, r) = max_i |a_i - r_i| / (|r_i| + max(rms(r), atol)), against the float64 reference "
          "run on the same (upcast) inputs (`attnres_conformance.tolerances.rel_err`)")
TOLERANCE = ("each array is held to the rtol of its own dtype's row (lse and weights: the compute dtype's), "
             "value column forward, gradient column backward; rows named in the overrides use that factor; "
             f"fp16/bf16 ops must also stay within {FLASH_FACTOR:g} x the error of the same op composed naively "
             "in the low precision, plus one ulp (FlashAttention's rule; for probe networks that bound replaces "
             "the table where it is looser)")
STATUSES = {
    "pass": "every case of the cell ran and passed",
    "pass*": "the cases that ran passed; others of the cell were skipped or xfailed (see the notes)",
    "FAIL": "at least one case failed: message and reproducer under the matrix",
    "XPASS": "a case marked xfail in the skips file passed: an error, remove the xfail line",
    "gap": "a spec error the port does not raise, reported as a validation gap because it declares "
           "validates_inputs=False (not a failure)",
    "xfail": "every case that ran failed as the skips file expects",
    "skip": "nothing ran: not declared in the capabilities, or the skips file (reasons in the notes)",
    "(empty)": "no case of this row exists for this dtype and column (e.g. forward-only rows have no gradient)",
    "(no number)": "a check without an error to measure: bitwise determinism, a raised exception",
}


def legend_dict() -> dict:
    """The legend as data (the JSON report's "legend")."""
    return {"number": METRIC, "tolerance": TOLERANCE,
            "rtol": {d: {"value": t.value, "gradient": t.grad} for d, t in TOLERANCES.items()},
            "overrides": {name: {"factor": f, "reason": why} for name, (f, why) in OVERRIDES.items()},
            "statuses": dict(STATUSES)}


def legend_markdown() -> str:
    lines = ["## Legend", "", f"- **The number in a cell**: {METRIC}.", f"- **Tolerance**: {TOLERANCE}.", "",
             "| dtype | rtol value | rtol gradient |", "|---|---|---|"]
    lines += [f"| {d} | {t.value:g} | {t.grad:g} |" for d, t in TOLERANCES.items()]
    lines += ["", "Overrides (factor on the table): "
              + "; ".join(f"`{name}` x{f:g} ({why})" for name, (f, why) in OVERRIDES.items()) + ".", ""]
    lines += [f"- `{label}`: {meaning}" for label, meaning in STATUSES.items()]
    return "\n".join(lines) + "\n"


SUMMARY_HEADER = ["backend", "verdict", "cases", "pass", "fail", "skip", "xfail", "gap", "wall time",
                  "implementation that ran"]


def implementations_text(used: Optional[Dict[str, int]]) -> str:
    """`{"cpu_c": 40, "chunked": 2}` -> "cpu_c (40 calls), chunked (2 calls)"; None -> "not reported"."""
    if used is None:
        return "not reported (the backend has no implementations_used())"
    if not used:
        return "none recorded"
    return ", ".join(f"{name} ({n} call{'s' * (n != 1)})" for name, n in sorted(used.items(), key=lambda kv: -kv[1]))


def summary_rows(reports: Sequence) -> List[List[str]]:
    """One row per report: backend, verdict, cases, pass, fail (XPASS included), skip, xfail, gap,
    wall time, implementation; pass + fail + skip + xfail + gap = cases."""
    rows = [list(SUMMARY_HEADER)]
    for r in reports:
        s = r.case_summary()
        wall = "" if r.wall_time is None else f"{r.wall_time:.1f} s"
        rows.append([r.spec, r.verdict(), str(sum(s.values())), str(s["pass"]), str(s["fail"] + s["xpass"]),
                     str(s["skip"]), str(s["xfail"]), str(s["gap"]), wall, implementations_text(r.implementations)])
    return rows


def summary_text(reports: Sequence) -> str:
    rows = summary_rows(reports)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows) + "\n"


def summary_markdown(reports: Sequence) -> str:
    rows = summary_rows(reports)
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(out) + "\n"


def _run_lines(reports: Sequence, wall_time: Optional[float]) -> List[str]:
    dates = sorted(r.date for r in reports if r.date)
    commits = sorted({r.commit for r in reports})
    wall = "unknown" if wall_time is None else f"{wall_time:.1f} s"
    return [f"date: {dates[0] if dates else 'unknown'} (UTC)", f"commit: {', '.join(commits) or 'unknown'}",
            f"suite: attnres-conformance {__version__} (spec {SPEC_VERSION})", f"wall time: {wall} in all",
            f"backends: {', '.join(r.spec for r in reports)}{' [quick]' if any(r.quick for r in reports) else ''}"]


def document_markdown(reports: Sequence, wall_time: Optional[float] = None) -> str:
    """The markdown report of one run: date, commit, versions, wall time, the cross-backend
    summary, the legend, then each backend's matrix."""
    out = ["# attnres conformance report", "", *(f"- {line}" for line in _run_lines(reports, wall_time)), "",
           "## Summary", "", summary_markdown(reports), legend_markdown()]
    out += [r.to_markdown() for r in reports]
    return "\n".join(out)


def document_dict(reports: Sequence, wall_time: Optional[float] = None) -> dict:
    """The JSON report of one run (schema_version 1; every key of the first version kept)."""
    dates = sorted(r.date for r in reports if r.date)
    return {"schema_version": 1, "suite_version": __version__, "spec_version": SPEC_VERSION,
            "date": dates[0] if dates else None, "commit": ", ".join(sorted({r.commit for r in reports})),
            "wall_time_s": wall_time, "legend": legend_dict(), "reports": [r.to_dict() for r in reports]}
