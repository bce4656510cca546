"""`run_conformance(backend) -> Report`: every case, skips, xfails, the matrix, the reproducers.

Matrix: one row per case row (an op's option group, a probe variant, errors, determinism,
invariants, golden, sweep), two columns per dtype (forward, gradient).  A cell aggregates its
cases: FAIL if any failed, XPASS if an expected failure passed (an error), pass if the rest
passed ("pass*" when some of them were skipped or xfailed), else xfail / skip; the number is
the largest `tolerances.rel_err` among its cases (none for bitwise and exception checks).
Counts (each in the report under its own name, so each adds up to what is listed): cases (one
result each: `case_summary`), checks (forward + gradient of each case: `summary`) and matrix
cells (`matrix_summary`, including the empty ones).  The legend is `legend.py`.

Skips file (a port keeps its own): one test-id prefix per line, `#` starts a comment (the
rest of the line is the reason); a line `xfail PREFIX` expects those cases to fail (if one
passes it is reported as XPASS, an error); `skip PREFIX` or a bare prefix skips them.  A
prefix that matches no case gives a warning.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import SPEC_VERSION, __version__
from . import cases as cases_mod
from .checks import NO_ERROR, Cell, check_case
from .coverage import coverage, coverage_text, gaps
from .legend import implementations_text
from .numerics import DTYPES
from .provenance import UNKNOWN, git_commit, source_file, utc_now
from .registry import BACKENDS
from .rules import explain, rule_of

SCHEMA_VERSION = 1
SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
FAILING = ("fail", "xpass")
#: "gap": a spec error a port that declares `validates_inputs=False` does not raise (reported
#: apart, not a failure).
STATUSES = ("pass", "fail", "skip", "xfail", "xpass", "gap")
#: Labels of a matrix cell (`Report.matrix_summary`), "empty" where no case fills it.
MATRIX_LABELS = ("pass", "pass*", "FAIL", "XPASS", "gap", "xfail", "skip", "empty")
#: Failure categories, in the order the report lists them (`CaseResult.category`).
CATEGORIES = ("numerical", "validation gap", "error contract", "result contract", "crash")


class BackendUnavailable(RuntimeError):
    """`backend.is_available()` is False: nothing can be checked."""


@dataclass(frozen=True)
class SkipRule:
    """One skips-file line.  prefix: a case-id prefix, a glob (with * ? or [), or `tag:NAME`
    (cases exercising that option, `cases.tags_of`: scale, eps, lse, weights, num_heads, ...)."""

    prefix: str
    mode: str  # "skip" | "xfail"
    reason: str
    line: int

    def matches(self, case) -> bool:
        if self.prefix.startswith("tag:"):
            return self.prefix[4:] in cases_mod.tags_of(case)
        if any(ch in self.prefix for ch in "*?["):
            return fnmatch.fnmatchcase(case.id, self.prefix)
        return case.id.startswith(self.prefix)


def parse_skips(text: str, source: str = "skips") -> List[SkipRule]:
    """Parse a skips file's text (see the module docstring)."""
    rules = []
    for number, raw in enumerate(text.splitlines(), 1):
        body, _, comment = raw.partition("#")
        words = body.split()
        if not words:
            continue
        mode = words[0] if words[0] in ("skip", "xfail") else "skip"
        rest = words[1:] if words[0] in ("skip", "xfail") else words
        if len(rest) != 1:
            raise ValueError(f"{source}:{number}: expected '[skip|xfail] PREFIX  # reason', got {raw.strip()!r}")
        rules.append(SkipRule(rest[0], mode, comment.strip() or f"{source}:{number}", number))
    return rules


def load_skips(path: Union[str, Path]) -> List[SkipRule]:
    return parse_skips(Path(path).read_text(), str(path))


@dataclass
class CaseResult:
    id: str
    row: str
    kind: str
    dtype: str
    device: str
    forward: Cell
    gradient: Optional[Cell]
    reproducer: Optional[str] = None
    #: How the case was fitted to the port's declared design choices (`cases.fit`).
    adapted: Tuple[str, ...] = ()

    @property
    def cells(self) -> List[Cell]:
        return [c for c in (self.forward, self.gradient) if c is not None]

    @property
    def category(self) -> Optional[str]:
        """What kind of finding a failing (or gap) case is (CATEGORIES), None for the rest."""
        bad = [c.message for c in self.cells if c.status in FAILING + ("gap",)]
        if not bad:
            return None
        text = " ".join(bad)
        if self.status == "gap":  # a spec error a port declaring validates_inputs=False does not raise
            return "validation gap"
        if self.kind in ("cotangent", "sequence"):
            return "error contract"
        if self.kind == "error":
            return "validation gap" if self.status == "gap" or all(m.startswith(NO_ERROR) for m in bad) \
                and "max_sources" not in self.id \
                else "error contract"
        if text.startswith(("raised ", "the call with cotangents raised")) or "not run: the forward" in text:
            return "crash"
        if ("C10.3" in text or "C7a" in text or "modified" in text or "native dtype" in text) and "rel_err" not in text:
            return "result contract"
        return "numerical"

    @property
    def failed(self) -> bool:
        return any(c.status in FAILING for c in self.cells)

    @property
    def status(self) -> str:
        """The case's one status: fail > xpass > xfail > pass > skip over its cells."""
        statuses = {c.status for c in self.cells}
        return next(s for s in ("fail", "xpass", "gap", "xfail", "pass", "skip") if s in statuses)

    def describe(self) -> str:
        lines = [f"{self.id} [{self.device}]"]
        worst = None
        for name, c in (("forward", self.forward), ("gradient", self.gradient)):
            if c is not None:
                err = "" if c.err is None else f" rel_err={c.err:.3g}"
                lines.append(f"  {name}: {c.status}{err}" + (f"  {c.message}" if c.message else ""))
                if c.status in FAILING and c.err is not None:
                    worst = c.err if worst is None else max(worst, c.err)
        why = explain(self.row, self.dtype, worst)
        if why:
            lines.append(f"  why: {why}")
        if self.adapted:
            lines.append(f"  adapted to the port: {'; '.join(self.adapted)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        err = lambda e: e if e is None or math.isfinite(e) else "inf"  # strict JSON has no Infinity
        cell = lambda c: None if c is None else {"status": c.status, "max_rel_err": err(c.err), "message": c.message}
        return {"id": self.id, "row": self.row, "kind": self.kind, "dtype": self.dtype, "device": self.device,
                "forward": cell(self.forward), "gradient": cell(self.gradient), "reproducer": self.reproducer,
                "adapted": list(self.adapted), "category": self.category,
                "rule": (rule_of(self.row) or (None,))[0]}


def reproducer(spec: str, case: cases_mod.Case, device: str, environment: Optional[Dict[str, str]] = None) -> str:
    """A copy-pasteable reproducer: the CLI line (with the environment the adapter declares,
    `Backend.environment()`), and a Python snippet rebuilding the inputs."""
    env = "".join(f"{k}={v} " for k, v in sorted((environment or {}).items()))
    lines = [
        f"{env}attnres-conformance --backend {spec} --device {device} --case '{case.id}'",
        f"# or, in Python (inputs rebuilt from seed {case.seed}):",
        *([f"import os; os.environ.update({dict(sorted(environment.items()))!r})  # before the port imports"]
          if environment else []),
        "from attnres_conformance.cases import get_case",
        "from attnres_conformance.checks import check_case",
        "from attnres_conformance.registry import load_backend",
        f"backend = load_backend({spec!r})",
        f"case = get_case({case.id!r}, caps=backend.capabilities())",
        f"print(check_case(backend, case, {device!r}))",
    ]
    if case.kind in ("op", "probe", "golden"):
        fn, method = ("probe_call", "call_probe") if case.golden().op == "probe" else ("op_call", "call_op")
        lines += [
            f"from attnres_conformance.checks import {fn}",
            f"call = {fn}(case.golden(), {device!r}, backward=True)  # the exact inputs and cotangents",
            f"result = backend.{method}(call)  # vs case.golden().arrays['output.out'], ['grad.<name>']",
        ]
    return "\n".join(lines)


@dataclass
class Report:
    """The results of one backend.  `to_text()` / `to_markdown()` render the matrix,
    `to_dict()` the JSON report."""

    backend: str
    spec: str
    versions: Dict[str, str]
    capabilities: dict
    devices: List[str]
    dtypes: List[str]
    quick: bool
    results: List[CaseResult] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    #: When the run started (UTC), how long it took (s), the commit of the adapter's checkout
    #: ("unknown" outside one), and the backend's `implementations_used()` counts for this run
    #: (None when it has no such method).
    date: str = ""
    wall_time: Optional[float] = None
    commit: str = UNKNOWN
    implementations: Optional[Dict[str, int]] = None
    #: How many processes ran it (`--shards`): the wall time is then the longest shard's.
    shards: int = 1
    #: (i, k): this report holds part i of k (`run_conformance(shard=...)`); None when whole.
    shard: Optional[Tuple[int, int]] = None
    #: A part's cases' places in the whole run's selection (`shard_positions`), so that
    #: `merge_shards` restores the whole run's order; None when whole.
    positions: Optional[List[int]] = None
    #: A run of selected cases only (--case / --select): coverage is not required of it.
    subset: bool = False
    #: The environment the adapter declared (`Backend.environment()`), for reproducers.
    environment: Dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.results)

    @property
    def incomplete(self) -> List[str]:
        """Why the run does not cover what a verdict needs (`coverage.gaps`), [] when it does."""
        return gaps(self.results, self.capabilities, self.subset)

    def verdict(self, accept_incomplete: bool = False) -> str:
        """FAIL (a failure), NOTHING CHECKED, INCOMPLETE (a core family never ran, unless
        accepted: then "PASS (incomplete, accepted)"), or PASS.  A pass with cases that failed as
        the skips file's xfail lines declared says so: "PASS with 3 declared expected failures"
        (a deviation the port owns is not conformance, and the verdict line is what people quote)."""
        if self.failed:
            return "FAIL"
        reasons = self.incomplete
        if reasons == ["nothing was checked"]:
            return "NOTHING CHECKED"
        if reasons and not accept_incomplete:
            return "INCOMPLETE"
        xfails = self.case_summary()["xfail"]
        declared = f" with {xfails} declared expected failure{'s' * (xfails != 1)}" if xfails else ""
        return f"PASS{declared}" + (" (incomplete, accepted)" if reasons else "")

    def ok(self, accept_incomplete: bool = False) -> bool:
        """Whether the CLI exits 0 for this report."""
        return self.verdict(accept_incomplete).startswith("PASS")

    def _results(self, device: Optional[str]) -> List[CaseResult]:
        return [r for r in self.results if device is None or r.device == device]

    def summary(self, device: Optional[str] = None) -> Dict[str, int]:
        """Checks (a case's forward and, when it has one, its gradient) by status."""
        counts = dict.fromkeys(STATUSES, 0)
        for r in self._results(device):
            for c in r.cells:
                counts[c.status] += 1
        return counts

    def case_summary(self, device: Optional[str] = None) -> Dict[str, int]:
        """Cases (one per result listed) by `CaseResult.status`: the values sum to the results."""
        counts = dict.fromkeys(STATUSES, 0)
        for r in self._results(device):
            counts[r.status] += 1
        return counts

    def matrix_summary(self, device: str) -> Dict[str, int]:
        """The matrix cells of `device` by the label shown (MATRIX_LABELS): they sum to rows x columns."""
        counts = dict.fromkeys(MATRIX_LABELS, 0)
        for row in self.rows():
            for d in self._dtypes():
                for col in ("forward", "gradient"):
                    c = self.cell(row, d, col, device)
                    counts["empty" if c is None else c.status.upper() if c.status in FAILING else c.status] += 1
        return counts

    def cell(self, row: str, dtype: str, column: str, device: Optional[str] = None) -> Optional[Cell]:
        """The aggregated matrix cell (column "forward" or "gradient"), None if no case fills it."""
        cells = [getattr(r, column) for r in self.results
                 if r.row == row and r.dtype == dtype and (device is None or r.device == device)]
        cells = [c for c in cells if c is not None]
        if not cells:
            return None
        statuses = {c.status for c in cells}
        errs = [c.err for c in cells if c.err is not None and c.status in ("pass", "fail", "xpass")]
        err = max(errs) if errs else None
        for status in ("fail", "xpass"):
            if status in statuses:
                return Cell(status, err, "; ".join(c.message for c in cells if c.status == status))
        if "pass" in statuses:
            return Cell("pass*" if statuses - {"pass"} else "pass", err)
        return Cell("xfail" if "xfail" in statuses else "skip", None)

    def rows(self) -> List[str]:
        return list(dict.fromkeys(r.row for r in self.results))

    def _dtypes(self) -> List[str]:
        return [d for d in DTYPES if d in self.dtypes]

    def _table(self, device: str) -> List[List[str]]:
        dtypes = self._dtypes()
        header = ["row"] + [f"{SHORT[d]} {col}" for d in dtypes for col in ("fwd", "grad")]
        table = [header]
        for row in self.rows():
            line = [row]
            for d in dtypes:
                for col in ("forward", "gradient"):
                    c = self.cell(row, d, col, device)
                    label = "" if c is None else c.status.upper() if c.status in FAILING else c.status
                    line.append(label if c is None or c.err is None else f"{label} {c.err:.1e}")
            table.append(line)
        return table

    def _title(self, device: str) -> List[str]:
        versions = ", ".join(f"{k} {v}" for k, v in sorted(self.versions.items()))
        cases, checks, matrix = self.case_summary(device), self.summary(device), self.matrix_summary(device)
        wall = "" if self.wall_time is None else f", {self.wall_time:.1f} s"
        if self.shards > 1:
            wall += f" ({self.shards} shards in parallel)"
        count = lambda s: ", ".join(f"{n} {k}" for k, n in s.items())  # noqa: E731
        results = self._results(device)
        reasons = gaps(results, self.capabilities, self.subset)
        verdict = self.verdict()
        verdict += "" if not reasons or self.failed else f" ({'; '.join(reasons)})"
        categories = {}
        for r in results:
            if r.category:
                categories[r.category] = categories.get(r.category, 0) + 1
        found = ", ".join(f"{categories[c]} {c}" for c in CATEGORIES if c in categories)
        adapted = sum(1 for r in results if r.adapted and r.status != "skip")
        return [f"attnres conformance: backend {self.backend} ({self.spec}) on {device}"
                f"{' [quick]' if self.quick else ''}; {versions}",
                f"verdict: {verdict}" + (f"; findings: {found}" if found else ""),
                f"coverage (cases run / cases in declared dtypes): {coverage_text(results, self.capabilities)}"
                + (f"; {adapted} cases adapted to declared design choices" if adapted else ""),
                f"run: {self.date or 'date unknown'}{wall}; commit {self.commit}; "
                f"suite {__version__} (spec {SPEC_VERSION})",
                f"implementation that ran: {implementations_text(self.implementations)}",
                f"capabilities: {self._caps_text()}",
                f"cases: {sum(cases.values())} listed: {count(cases)}",
                f"checks (forward + gradient of each case): {sum(checks.values())}: {count(checks)}",
                f"matrix cells: {len(self.rows())} rows x {2 * len(self._dtypes())} columns = "
                f"{sum(matrix.values())}: {count(matrix)}"]

    def _caps_text(self) -> str:
        caps = self.capabilities
        shown = lambda v: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)  # noqa: E731
        return "; ".join(f"{k} {shown(v)}" for k, v in caps.items())

    def _notes(self) -> List[str]:
        lines = [f"warning: {w}" for w in self.warnings]
        reasons: Dict[str, int] = {}
        for r in self.results:
            for c in r.cells:
                if c.status == "skip":
                    reasons[c.message] = reasons.get(c.message, 0) + 1
        lines += [f"skipped {n} checks: {reason}" for reason, n in sorted(reasons.items())]
        for category in CATEGORIES:
            bad = [r for r in self.results if r.category == category]
            if not bad:
                continue
            lines += ["", f"== {category}: {len(bad)} case{'s' * (len(bad) != 1)}"]
            for r in bad:
                head = "GAP" if r.status == "gap" else "FAILED"
                lines += ["", f"{head} {r.describe()}"]
                if r.failed:
                    lines += ["reproduce:", r.reproducer or ""]
        return lines

    def to_text(self) -> str:
        out = []
        for device in self.devices:
            table = self._table(device)
            widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
            out += self._title(device)
            out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
        return "\n".join(out + self._notes()) + "\n"

    def to_markdown(self) -> str:
        out = []
        for device in self.devices:
            table = self._table(device)
            title = self._title(device)
            out += [f"## {title[0]}", "", *(f"- {line}" for line in title[1:]), ""]
            out.append("| " + " | ".join(table[0]) + " |")
            out.append("|" + "---|" * len(table[0]))
            out += ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(line)) + " |"
                    for line in table[1:]]
            out.append("")
        notes = self._notes()
        if notes:
            out += ["```", *notes, "```"]
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "suite_version": __version__, "spec_version": SPEC_VERSION,
                "backend": self.backend, "spec": self.spec, "date": self.date, "commit": self.commit,
                "wall_time_s": self.wall_time, "shards": self.shards,
                "shard": None if self.shard is None else list(self.shard), "positions": self.positions,
                "versions": self.versions, "capabilities": self.capabilities,
                "implementations_used": self.implementations, "devices": self.devices,
                "dtypes": self.dtypes, "quick": self.quick, "subset": self.subset,
                "environment": self.environment, "verdict": self.verdict(), "incomplete": self.incomplete,
                "coverage": {d: coverage(self._results(d), self.capabilities) for d in self.devices},
                "summary": self.summary(),
                "case_summary": self.case_summary(), "matrix": {d: self.matrix_summary(d) for d in self.devices},
                "warnings": self.warnings, "results": [r.to_dict() for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        """The report `to_dict()` wrote (to merge reports run in separate processes)."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"report: schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        err = lambda e: float("inf") if e == "inf" else e  # noqa: E731
        cell = lambda c: None if c is None else Cell(c["status"], err(c["max_rel_err"]), c["message"])  # noqa: E731
        results = [CaseResult(r["id"], r["row"], r["kind"], r["dtype"], r["device"], cell(r["forward"]),
                              cell(r["gradient"]), r["reproducer"], tuple(r.get("adapted", ())))
                   for r in data["results"]]
        return cls(data["backend"], data["spec"], data["versions"], data["capabilities"], data["devices"],
                   data["dtypes"], data["quick"], results, list(data["warnings"]), data.get("date", ""),
                   data.get("wall_time_s"), data.get("commit", UNKNOWN), data.get("implementations_used"),
                   int(data.get("shards", 1)), None if data.get("shard") is None else tuple(data["shard"]),
                   data.get("positions"), bool(data.get("subset", False)), dict(data.get("environment", {})))


def _caps_dict(caps) -> dict:
    return {k: sorted(v) if isinstance(v, (frozenset, set)) else list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(caps).items()}


def _error_cell(exc: BaseException) -> Cell:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return Cell("fail", None, f"raised {type(exc).__name__}: {exc}{where}")


def run_case(backend, case: cases_mod.Case, device: str = "cpu", *, spec: Optional[str] = None,
             rule: Optional[SkipRule] = None, caps=None) -> CaseResult:
    """`case` must be fitted to `caps` (`cases.fit`; `generate(caps=...)` and `get_case(caps=...)` do)."""
    """Run one case (capabilities, skip/xfail rule applied) and wrap it as a CaseResult."""
    caps = caps or backend.capabilities()
    spec = spec or _spec_of(backend)
    reason = case.spec.get("skip") if case.kind == "skip" else None
    if reason is None and (case.dtype not in caps.dtypes or device not in caps.devices):
        reason = cases_mod.Requirements().missing(caps, case.dtype, device)  # before building inputs
    reason = reason or case.requirements().missing(caps, case.dtype, device)
    if reason is None and rule is not None and rule.mode == "skip":
        reason = f"skips file: {rule.reason}"
    if reason is not None:
        skip = Cell("skip", None, reason)
        return CaseResult(case.id, case.row, case.kind, case.dtype, device, skip,
                          skip if case.has_gradient else None, adapted=case.adapted)
    try:
        forward, gradient = check_case(backend, case, device, caps)
    except Exception as exc:  # noqa: BLE001 - a crashing backend is a failing cell, not a crash
        forward = _error_cell(exc)
        gradient = Cell("fail", None, "not run: the forward check raised") if case.has_gradient else None
    if gradient is None and case.has_gradient and not caps.backward:
        gradient = Cell("skip", None, "forward-only port (declared backward=False)")
    if rule is not None and rule.mode == "xfail":
        # One verdict per case: it is an expected failure when any of its cells fails (a defect in
        # the backward alone leaves the forward passing), an XPASS when none does.
        cells = [c for c in (forward, gradient) if c is not None]
        failing = [c for c in cells if c.status == "fail"]
        for c in failing:
            c.status, c.message = "xfail", f"expected failure ({rule.reason}): {c.message}"
        if not failing:
            for c in cells:
                if c.status == "pass":
                    c.status, c.message = "xpass", f"marked xfail ({rule.reason}) but passed: remove the xfail"
    result = CaseResult(case.id, case.row, case.kind, case.dtype, device, forward, gradient, adapted=case.adapted)
    if result.failed:
        result.reproducer = reproducer(spec, case, device, environment_of(backend))
    return result


def environment_of(backend) -> Dict[str, str]:
    """The environment variables the adapter needs (its optional `environment()`, e.g.
    {"TRITON_INTERPRET": "1"}), for reproducers; {} without one."""
    method = getattr(backend, "environment", None)
    return {str(k): str(v) for k, v in dict(method()).items()} if callable(method) else {}


def _spec_of(backend) -> str:
    """How a reproducer names the backend: its registry name, else the module global holding
    it (pass `spec=` to run_conformance when neither finds it)."""
    if backend.name in BACKENDS:
        return backend.name
    module = type(backend).__module__
    names = [k for k, v in vars(sys.modules.get(module, object)).items() if v is backend]
    return f"{module}:{names[0] if names else 'backend'}"


def match_rule(rules: Sequence[SkipRule], case) -> Optional[SkipRule]:
    """The rule for `case` (a Case, or a case id for prefix rules only): the longest matching
    prefix, glob or tag wins (a specific xfail inside a broad skip)."""
    if isinstance(case, str):  # an id alone: prefixes and globs (no tags without the case)
        case = cases_mod.Case(case, "skip", case.rsplit("/", 1)[-1], {})
        rules = [r for r in rules if not r.prefix.startswith("tag:")]
    hits = [r for r in rules if r.matches(case)]
    return max(hits, key=lambda r: len(r.prefix)) if hits else None


def run_conformance(backend, *, dtypes: Optional[Iterable[str]] = None,
                    devices: Optional[Iterable[str]] = None, quick: bool = False,
                    skips: Union[None, str, Path, Sequence[SkipRule]] = None,
                    case_ids: Optional[Sequence[str]] = None, select: Optional[Sequence[str]] = None,
                    spec: Optional[str] = None, vectors_dir=None,
                    progress: Optional[Callable[[int, int, str], None]] = None,
                    shard: Optional[Tuple[int, int]] = None) -> Report:
    """Run the suite on `backend` (an object implementing `Backend`).

    dtypes: default all four (those the backend does not declare are reported as skipped);
    devices: default every declared device.  quick: the reduced grid.  skips: a skips file path or
    parsed rules.  case_ids: run only these cases; select: only cases whose id starts with one
    of these prefixes.  spec: how reproducers name the backend
    (default: its registry name).  progress: called as `progress(done, total, case_id)` after
    every case (the CLI prints from it).  shard: (i, k) runs part i of k (0-based) of the
    selected cases (`shard_positions`), one part of a run split over k processes (`merge_shards`
    joins them)."""
    if not backend.is_available():
        raise BackendUnavailable(f"backend {backend.name!r}: is_available() is False here")
    start, date = time.monotonic(), utc_now()
    caps = backend.capabilities()
    dtypes = list(dtypes) if dtypes else list(DTYPES)
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"dtype: unknown {unknown}; expected some of {list(DTYPES)}")
    devices = list(devices) if devices else list(caps.devices)
    rules = load_skips(skips) if isinstance(skips, (str, Path)) else list(skips or [])
    spec = spec or _spec_of(backend)
    if case_ids:
        selected = [cases_mod.get_case(i, caps=caps, vectors_dir=vectors_dir) for i in case_ids]
    else:
        selected = cases_mod.generate(dtypes=dtypes, quick=quick, caps=caps, vectors_dir=vectors_dir)
    if select:
        selected = [c for c in selected if c.id.startswith(tuple(select))]
    if shard is not None:
        index, count = shard
        if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
            raise ValueError(f"shard: expected (i, k) with 0 <= i < k, got {shard!r}")
        group = getattr(backend, "shard_group", None)  # optional (`adapters.mlx.MLXAdapter`)
        positions = shard_positions(None if group is None else [group(c.dtype) for c in selected], len(selected),
                                    count)[index]
        selected = [selected[i] for i in positions]
    report = Report(backend.name, spec, dict(backend.versions()), _caps_dict(caps), devices, dtypes, quick,
                    date=date, commit=git_commit(source_file(backend)), shard=shard,
                    positions=None if shard is None else positions,
                    subset=bool(case_ids or select), environment=environment_of(backend))
    before = _implementations(backend, report.warnings)
    used = set()
    total, done = len(devices) * len(selected), 0
    for device in devices:
        for case in selected:
            rule = match_rule(rules, case)
            if rule is not None:
                used.add(rule)
            report.results.append(run_case(backend, case, device, spec=spec, rule=rule, caps=caps))
            done += 1
            if progress is not None:
                progress(done, total, case.id)
    report.warnings += [f"skips line {r.line}: {r.prefix!r} matches no case" for r in rules if r not in used]
    after = _implementations(backend, report.warnings)
    if after is not None:
        report.implementations = {k: n - (before or {}).get(k, 0) for k, n in after.items()
                                  if n - (before or {}).get(k, 0) > 0}
    report.wall_time = time.monotonic() - start
    return report


def _implementations(backend, warnings: List[str]) -> Optional[Dict[str, int]]:
    """The backend's optional `implementations_used() -> {implementation: calls so far}` (None
    without it; a failing one is a warning, not a crash: it only describes the run)."""
    method = getattr(backend, "implementations_used", None)
    if not callable(method):
        return None
    try:
        return {str(k): int(v) for k, v in dict(method()).items()}
    except Exception as exc:  # noqa: BLE001
        warnings.append(f"implementations_used() raised {type(exc).__name__}: {exc}")
        return None


def shard_positions(keys: Optional[Sequence[str]], total: int, count: int) -> List[List[int]]:
    """How `count` processes split `total` cases: each part's places in the run's order.
    Every count-th case, or with keys (the backend's optional `shard_group(dtype)` of each case:
    cases of one group share compiled kernels, e.g. MLX's per compute dtype) and at least `count`
    groups, every case of a group in one part, the groups largest first each to the part with the
    fewest cases so far: each kernel then compiles in one process, not in every one."""
    groups: Dict[str, List[int]] = {}
    for i, key in enumerate(keys or ()):
        groups.setdefault(key, []).append(i)
    if len(groups) < count:
        return [list(range(i, total, count)) for i in range(count)]
    parts: List[List[int]] = [[] for _ in range(count)]
    for dtype in sorted(groups, key=lambda d: (-len(groups[d]), d)):
        min(parts, key=len).extend(groups[dtype])
    return [sorted(p) for p in parts]


def merge_shards(parts: Sequence[Report]) -> Report:
    """One report from the shards of one backend's run (`run_conformance(shard=(i, k))` for
    i = 0..k-1): the results in the order of the unsharded run (by each part's `positions`), the
    implementation counts added, the wall time of the longest shard (they run at once).  A
    skips-file warning ("matches no case") is kept only if no shard used the rule."""
    if not parts:
        raise ValueError("merge_shards: no reports")
    first = parts[0]
    if any((p.backend, p.spec) != (first.backend, first.spec) for p in parts):
        raise ValueError(f"merge_shards: reports of different backends {sorted({p.spec for p in parts})}")
    if any(p.positions is None for p in parts):
        missing = [p.shard for p in parts if p.positions is None]
        raise ValueError(f"merge_shards: the reports of shards {missing} lack the places of their cases "
                         "('positions', written by every --shard run of this suite version): rerun those shards")
    results = []
    for device in first.devices:
        placed = [(pos, r) for p in parts for pos, r in zip(p.positions, (r for r in p.results if r.device == device))]
        results += [r for _, r in sorted(placed, key=lambda item: item[0])]
    warnings = []
    for w in (w for p in parts for w in p.warnings):
        unused_rule = w.startswith("skips line") and w.endswith("matches no case")
        if w not in warnings and (not unused_rule or all(w in p.warnings for p in parts)):
            warnings.append(w)
    counts = [p.implementations for p in parts if p.implementations is not None]
    implementations = None
    if counts:
        implementations = {}
        for c in counts:
            for k, n in c.items():
                implementations[k] = implementations.get(k, 0) + n
    walls = [p.wall_time for p in parts if p.wall_time is not None]
    return dataclasses.replace(first, results=results, warnings=warnings, implementations=implementations,
                               wall_time=max(walls) if walls else None, shards=len(parts), shard=None, positions=None,
                               date=min(p.date for p in parts))
