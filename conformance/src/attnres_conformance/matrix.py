"""The support matrix: per backend, what passed forward and backward, in which dtypes, through which
implementation and on which hardware, rendered as Markdown from conformance reports.

Two steps, so the documentation is regenerated from a small committed file, not from a run:

- `snapshot(documents)`: conformance JSON documents (`attnres-conformance --json FILE`, one or
  several backends each) -> a small dict (`docs/data/support.json` in the repository): per backend
  the run's date, commit, grid (quick or full), versions, declared dtypes, the implementations that
  ran, the host that ran it, and the check counts by dtype, column (forward, gradient) and status.
  Paths a CPU run cannot reach (GPU kernels; `not_run`) are kept by hand in the same file and
  carried over from the previous snapshot.
- `render(snapshot, detail=)`: the Markdown the documents hold between `BEGIN` and `END`
  (`<!-- matrix:begin -->`; `<!-- matrix:begin detail -->` adds the per-dtype table).

From the command line, refresh the snapshot from reports and rewrite every marked block::

    nox -s conformance -- --quick      # or any attnres-conformance --json run(s)
    python -m attnres_conformance.matrix --reports reports/conformance-quick.json \\
        --snapshot docs/data/support.json --write README.md --write docs/status.md

Without `--reports` it re-renders the blocks from the snapshot; `--check` writes nothing and
exits 1 when a block differs from what the snapshot gives.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from .numerics import DTYPES

SNAPSHOT_VERSION = 1
BEGIN = "<!-- matrix:begin{mode} -->"
END = "<!-- matrix:end -->"
#: A marked block: its mode ("" or " detail") and its body.
BLOCK = re.compile(r"<!-- matrix:begin( detail)? -->\n(.*?)<!-- matrix:end -->", re.S)
SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
COLUMNS = ("forward", "gradient")
STATUSES = ("pass", "fail", "xpass", "xfail", "skip")


def host() -> Dict[str, object]:
    """The machine this process runs on: architecture, OS, CPU model (from /proc/cpuinfo where
    there is one), logical cores."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"machine": platform.machine(), "system": platform.system(), "cpu": model or "unknown CPU",
            "cores": os.cpu_count()}


def _summarize(report: dict, machine: Dict[str, object]) -> dict:
    """One backend's entry of the snapshot, from its report (`runner.Report.to_dict()`)."""
    checks: Dict[str, Dict[str, Dict[str, int]]] = {}
    for result in report["results"]:
        by_column = checks.setdefault(result["dtype"], {c: dict.fromkeys(STATUSES, 0) for c in COLUMNS})
        for column in COLUMNS:
            cell = result[column]
            if cell is not None:
                by_column[column][cell["status"]] += 1
    return {"backend": report["backend"], "spec": report["spec"], "date": report["date"],
            "commit": report["commit"], "quick": report["quick"], "versions": report["versions"],
            "devices": report["devices"], "declared_dtypes": report["capabilities"]["dtypes"],
            "implementations_used": report["implementations_used"], "host": machine,
            "checks": {d: checks[d] for d in DTYPES if d in checks}}


def snapshot(documents: Iterable[dict], *, machine: Optional[Dict[str, object]] = None,
             not_run: Sequence[dict] = ()) -> dict:
    """The snapshot of conformance JSON documents (each `{"reports": [...]}` as `--json` writes
    it).  machine: the host that ran them (default: this one, `host()`); not_run: the hand-kept
    rows of paths no report covers (`{"backend", "path", "forward", "backward", "dtypes",
    "hardware"}`).  A backend reported twice is a ValueError."""
    machine = host() if machine is None else machine
    backends: List[dict] = []
    for document in documents:
        for report in document["reports"]:
            if report.get("shard") is not None:
                raise ValueError(f"reports: backend {report['spec']!r} is one shard of a run; "
                                 "merge the shards first (attnres-conformance --merge ... --json FILE)")
            if any(b["spec"] == report["spec"] for b in backends):
                raise ValueError(f"reports: backend {report['spec']!r} appears twice")
            backends.append(_summarize(report, machine))
    if not backends:
        raise ValueError("reports: no backend report in the documents given")
    return {"snapshot_version": SNAPSHOT_VERSION, "backends": backends, "not_run": [dict(r) for r in not_run]}


def _count(counts: Dict[str, int]) -> str:
    """`{"pass": 370, "skip": 5, ...}` -> "370/375 pass, 5 skip" ("**2 FAIL**" first when any failed)."""
    total = sum(counts.values())
    bad = counts["fail"] + counts["xpass"]
    parts = [f"**{bad} FAIL**"] if bad else []
    parts.append(f"{counts['pass']}/{total} pass")
    parts += [f"{counts[s]} {s}" for s in ("xfail", "skip") if counts[s]]
    return ", ".join(parts) if total else "none"


def _total(entry: dict, column: str, dtype: Optional[str] = None) -> Dict[str, int]:
    total = dict.fromkeys(STATUSES, 0)
    for d, by_column in entry["checks"].items():
        if dtype is None or d == dtype:
            for status, n in by_column[column].items():
                total[status] += n
    return total


def _undeclared_skips(entry: dict, column: str) -> int:
    """The checks skipped in dtypes the backend does not declare (numpy's reference runs float64
    only): not a gap, so the summary row leaves them out and the footnote counts them."""
    return sum(by_column[column]["skip"] for d, by_column in entry["checks"].items()
               if d not in entry["declared_dtypes"])


def _row_total(entry: dict, column: str) -> Dict[str, int]:
    """A column's counts over every dtype, less the skips in undeclared dtypes (a check that ran
    in an undeclared dtype still counts, so a failure there still shows)."""
    total = _total(entry, column)
    total["skip"] -= _undeclared_skips(entry, column)
    return total


def _hardware(entry: dict) -> str:
    machine = entry["host"]
    return (f"{', '.join(entry['devices'])}: {machine['cpu']}, {machine['cores']} cores "
            f"({machine['machine']} {machine['system']})")


def _implementations(used: Optional[Dict[str, int]]) -> str:
    if used is None:
        return "not reported"
    return ", ".join(f"`{name}` ({n})" for name, n in sorted(used.items(), key=lambda kv: (-kv[1], kv[0])))


def _dtypes(entry: dict) -> str:
    shown = []
    for d in DTYPES:
        if d not in entry["declared_dtypes"]:
            continue
        counts = [_total(entry, c, d) for c in COLUMNS]
        bad = any(c["fail"] + c["xpass"] for c in counts)
        shown.append(f"{SHORT[d]}{' **FAIL**' if bad else ''}")
    return " ".join(shown)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def render(data: dict, *, detail: bool = False) -> str:
    """The Markdown of the matrix: one row per backend report (forward and gradient checks, the
    dtypes declared, the implementations that ran with their call counts, the host), then the
    hand-kept rows of paths no report covers; `detail` adds one row per backend and dtype."""
    if data.get("snapshot_version") != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot: snapshot_version {data.get('snapshot_version')!r}, expected {SNAPSHOT_VERSION}")
    backends = data["backends"]
    header = ["backend", "implementation that ran (calls)", "forward", "backward", "dtypes", "hardware that ran it"]
    rows = [[f"`{b['spec']}`", _implementations(b["implementations_used"]), _count(_row_total(b, "forward")),
             _count(_row_total(b, "gradient")), _dtypes(b), _hardware(b)] for b in backends]
    rows += [[f"`{r['backend']}`", r["path"], r["forward"], r["backward"], r["dtypes"], r["hardware"]]
             for r in data["not_run"]]
    grids = sorted({"quick (`--quick`)" if b["quick"] else "full" for b in backends})
    dates = sorted(b["date"][:10] for b in backends)
    commits = sorted({b["commit"][:12] for b in backends})
    versions = "; ".join(f"{b['spec']}: " + ", ".join(f"{k} {v}" for k, v in sorted(b["versions"].items()))
                         for b in backends)
    out = _table(header, rows)
    out += ["", f"Counts are conformance checks (a case's forward, and its gradient where it has one) against "
                f"the float64 reference, from the {' and '.join(grids)} grid of `attnres-conformance` run on "
                f"{', '.join(dict.fromkeys(dates))} at commit {', '.join(commits)} ({versions}). "
                "Rows without counts are paths no report covers: how they were checked instead."]
    undeclared = [f"`{b['spec']}` declares {' '.join(SHORT[d] for d in DTYPES if d in b['declared_dtypes'])} only: "
                  f"its {_undeclared_skips(b, 'forward')} forward and {_undeclared_skips(b, 'gradient')} gradient "
                  "checks in other dtypes are skipped and not counted above"
                  for b in backends if _undeclared_skips(b, "forward") + _undeclared_skips(b, "gradient")]
    if undeclared:
        out[-1] += " " + "; ".join(undeclared) + "."
    if detail:
        rows = []
        for b in backends:
            for d in DTYPES:
                if d in b["checks"]:
                    rows.append([f"`{b['spec']}`", SHORT[d], _count(_total(b, "forward", d)),
                                 _count(_total(b, "gradient", d))])
        out += ["", *_table(["backend", "dtype", "forward", "backward"], rows)]
    return "\n".join(out) + "\n"


def blocks(text: str) -> List[tuple]:
    """The marked blocks of a document: (detail?, body) in order."""
    return [(bool(m.group(1)), m.group(2)) for m in BLOCK.finditer(text)]


def rewrite(text: str, data: dict) -> str:
    """`text` with every marked block's body replaced by what `data` renders (ValueError when
    there is none: a document registered for the matrix must hold its markers)."""
    if not BLOCK.search(text):
        raise ValueError(f"no {BEGIN.format(mode='')} ... {END} block")
    return BLOCK.sub(lambda m: f"{BEGIN.format(mode=m.group(1) or '')}\n{render(data, detail=bool(m.group(1)))}{END}",
                     text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnres_conformance.matrix",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reports", type=Path, action="append", default=[], metavar="JSON",
                   help="conformance JSON report(s) to rebuild the snapshot from (repeatable)")
    p.add_argument("--snapshot", type=Path, required=True, metavar="FILE",
                   help="the snapshot: written from --reports (its not_run rows kept), else read")
    p.add_argument("--write", type=Path, action="append", default=[], metavar="MD",
                   help="a Markdown file whose marked blocks are rewritten (repeatable)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block differs")
    args = p.parse_args(argv)
    try:
        old = json.loads(args.snapshot.read_text()) if args.snapshot.is_file() else None
        if args.reports:
            data = snapshot([json.loads(path.read_text()) for path in args.reports],
                            not_run=(old or {}).get("not_run", ()))
        elif old is None:
            raise ValueError(f"--snapshot {args.snapshot}: no such file (give --reports to create it)")
        else:
            data = old
        texts = {path: path.read_text() for path in args.write}
        new = {path: rewrite(text, data) for path, text in texts.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"attnres-conformance matrix: error: {exc}", file=sys.stderr)
        return 2
    stale = [path for path in args.write if new[path] != texts[path]]
    if args.check:
        if args.reports and data != old:
            stale.insert(0, args.snapshot)
        for path in stale:
            print(f"out of date: {path}", file=sys.stderr)
        return 1 if stale else 0
    if args.reports:
        args.snapshot.parent.mkdir(parents=True, exist_ok=True)
        args.snapshot.write_text(json.dumps(data, indent=1) + "\n")
        print(f"snapshot written: {args.snapshot}")
    for path in stale:
        path.write_text(new[path])
        print(f"matrix rewritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
