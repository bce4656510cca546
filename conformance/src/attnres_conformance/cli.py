"""`attnres-conformance`: run the suite on one or more backends and print the matrix.

    attnres-conformance --backend numpy
    attnres-conformance --backend torch --backend jax --quick --json report.json
    attnres-conformance --backend my_port.adapter:backend --skips my-port-skips.txt
    attnres-conformance --backend torch --case 'depth_attention/shapes/N130-T1-D4096/bfloat16'
    attnres-conformance --export-vectors DIR   # every generated case as golden vectors
    attnres-conformance --merge a.json --merge b.json --markdown all.md   # one report of several runs
    attnres-conformance --backend numpy --backend torch --jobs 2 --report-dir reports
    python -m attnres_conformance ...          # the same command

While it runs: per backend, cases done / total, elapsed and an ETA on stderr (at the first case,
then every 10 s; --no-progress silences it), and each backend's wall time; with more than one
backend (or one split by --jobs/--shards), also one overall line, at the first case and then at
most every 10 s (`parallel.Overall`):

    attnres-conformance: overall: backends 2/4 done, 61% of cases, 95 s elapsed, about 60 s left

At the end, on stdout: each backend's matrix, one summary line per backend (cases, pass, fail,
skip, xfail, wall time, the implementation that ran) and the paths of the reports written; then,
as the last line on stderr (with the other timing lines, so stdout stays the report), the whole
command's wall time, start to exit, starting the processes, merging and writing included:

    attnres-conformance: total wall time 231.4 s (4 backends)

--report-dir DIR names the reports by what they cover: DIR/conformance.md and .json only for the
full run (every registered backend, every case); otherwise e.g. conformance-torch-jax.md,
with "-quick" for --quick and "-subset" for --case/--select/--dtype/--device.  Replacing an
earlier file is said, never silent.  --jobs N runs N backends at once, each in its own process.

Exit status: 0 when nothing failed and the run covered what a verdict needs, 1 on any failure
(or XPASS), on a run that checked nothing, or on an incomplete one (a core family ran no case:
see `coverage.py`; --accept-incomplete accepts it), 2 on a usage error (no backend selected,
unknown backend or case, backend unavailable).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

from . import SPEC_VERSION, __version__
from .legend import document_dict, document_markdown, summary_text
from .numerics import DTYPES
from .registry import BACKENDS, ENV_VAR, BackendSelectionError, load_backend
from .runner import BackendUnavailable, Report, merge_shards, run_conformance

QUICK_HELP = ("reduced grid for fast iteration: N in {1, 33}, D in {7, 123}, one token shape, the "
              "main option of each op, one case per probe row and the golden vectors in float64 (the "
              "Full AttnRes probe in every dtype), the spec errors, one determinism and one run per "
              "invariant, and a 6-example sweep")


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: --jobs re-runs the command line per backend, dropping whole option names.
    p = argparse.ArgumentParser(prog="attnres-conformance", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--backend", action="append", default=[], metavar="NAME|module:object",
                   help=f"backend to check (repeatable): one of {', '.join(BACKENDS)} or module:object "
                        f"(default: ${ENV_VAR})")
    p.add_argument("--version", action="version", version=f"attnres-conformance {__version__} (spec {SPEC_VERSION})")
    p.add_argument("--dtype", action="append", choices=DTYPES,
                   help="dtype to check (repeatable; default: all four, undeclared ones reported as skipped)")
    p.add_argument("--device", action="append", help="device (repeatable; default: every declared device)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the JSON report here")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="write the markdown report here")
    p.add_argument("--report-dir", type=Path, metavar="DIR",
                   help="write both reports into DIR, named by the backends they cover (see above)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run up to N backends at once, each in its own process (default 1)")
    p.add_argument("--shards", type=int, default=1, metavar="K",
                   help="with --jobs: split each backend's cases over K processes (default 1)")
    p.add_argument("--shard", type=_shard, metavar="I/K",
                   help="run only part I of K (0-based: every K-th case from the I-th); --merge joins "
                        "the parts' JSON reports of one backend into one report")
    p.add_argument("--skips", type=Path, metavar="FILE", help="the port's skips/xfails file")
    p.add_argument("--case", action="append", metavar="ID", help="run only this case (repeatable)")
    p.add_argument("--select", action="append", metavar="PREFIX",
                   help="run only cases whose id starts with PREFIX (repeatable), e.g. probe/ or errors/")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--accept-incomplete", action="store_true",
                   help="exit 0 although a core family (shapes incl. N > 32 and N >= 130, magnitudes, non-finite, "
                        "gradients) ran nothing for what the port declares; the verdict still says INCOMPLETE")
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress lines on stderr (by default: cases done, elapsed, ETA every 10 s)")
    p.add_argument("--merge", action="append", type=Path, metavar="JSON",
                   help="instead of running: read this JSON report (repeatable) and write/print them as one")
    p.add_argument("--export-vectors", type=Path, metavar="DIR",
                   help="write every generated op/probe case with its reference results as golden vectors")
    return p


def _shard(text: str):
    """"I/K" -> (I, K) with 0 <= I < K."""
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/K (e.g. 0/2), got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < K, got {text!r}")
    return index, count


def _export(directory: Path, dtypes, quick: bool) -> int:
    from attnres_numpy.vectors import write_vectors

    from .cases import generate
    # A golden id names a file: the case id with '/' replaced by '__'.
    goldens = [dataclasses.replace(c.golden(), id=c.id.replace("/", "__"))
               for c in generate(dtypes=dtypes, quick=quick) if c.kind in ("op", "probe")]
    path = write_vectors(directory, goldens)
    print(f"wrote {len(goldens)} cases to {path.parent}")
    return 0


def _feeding(meter: "Progress", overall, index: int):
    """A progress callback that prints `meter`'s line and feeds run `index` of `overall`."""
    def progress(done: int, total: int, case_id: str) -> None:
        meter(done, total, case_id)
        elapsed = time.monotonic() - meter.start
        overall.progress(index, done, total, elapsed, elapsed / done * (total - done))
        overall.emit()
    return progress


class Progress:
    """Progress lines on stderr while a backend runs: at the first case, then at most every
    `every` seconds (cases done / total, elapsed, an ETA from the rate so far), and its wall time
    at the end.  `parallel.PROGRESS_LINE` reads these lines back (the --jobs parent's overall line)."""

    def __init__(self, name: str, every: float = 10.0, stream=None):
        self.name, self.every = name, every
        self.stream = sys.stderr if stream is None else stream
        self.start = time.monotonic()
        self.last = None

    def __call__(self, done: int, total: int, case_id: str) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last < self.every and done < total:
            return
        self.last = now
        elapsed = now - self.start
        eta = elapsed / done * (total - done)
        print(f"attnres-conformance: {self.name}: {done}/{total} cases ({100 * done // total}%), "
              f"{elapsed:.0f} s, about {eta:.0f} s left (last: {case_id})", file=self.stream, flush=True)

    def finish(self) -> None:
        print(f"attnres-conformance: {self.name}: done in {time.monotonic() - self.start:.1f} s",
              file=self.stream, flush=True)


def _write(path: Path, text: str) -> str:
    """Write a report; the line saying where, and that an earlier file was replaced."""
    replaced = path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return f"{path}{' (replaced the earlier file)' if replaced else ''}"


def _finish(reports: List[Report], args, wall_time: Optional[float]) -> int:
    """The cross-backend summary and the reports written; the exit status."""
    print(f"\nattnres conformance summary ({len(reports)} backend{'s' * (len(reports) != 1)}"
          + ("" if wall_time is None else f", {wall_time:.1f} s in all") + "):")
    print(summary_text(reports), end="")
    written = []
    if args.json:
        written.append(_write(args.json, json.dumps(document_dict(reports, wall_time), indent=1) + "\n"))
    if args.markdown:
        written.append(_write(args.markdown, document_markdown(reports, wall_time)))
    for line in written:
        print(f"report written: {line}")
    bad = [r for r in reports if not r.ok(args.accept_incomplete)]
    for r in bad:
        if not r.failed:
            print(f"attnres-conformance: {r.spec}: verdict {r.verdict()}: {'; '.join(r.incomplete)}"
                  + ("" if r.incomplete == ["nothing was checked"] else
                     " (declare more, or pass --accept-incomplete to accept a partial check)"), file=sys.stderr)
    return 1 if bad else 0


def report_name(specs: Sequence[str], args) -> str:
    """"conformance" for the full run over every registered backend, else named by what it covers."""
    name = "conformance"
    if sorted(specs) != sorted(BACKENDS):
        name += "-" + "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", s) for s in specs)
    if args.quick:
        name += "-quick"
    if args.case or args.select or args.dtype or args.device:
        name += "-subset"
    return name


def _parallel(specs: Sequence[str], argv: Sequence[str], args) -> int:
    from .parallel import Overall, run_children

    start = time.monotonic()
    overall = None if args.no_progress else Overall(specs, shards=args.shards, jobs=args.jobs)
    with tempfile.TemporaryDirectory(prefix="attnres-conformance-") as tmp:
        runs = run_children(specs, argv, args.jobs, Path(tmp), shards=args.shards, overall=overall)
        for run in runs:
            if run.returncode not in (0, 1) or not run.json.is_file():
                print(run.stdout, end="")
                part = f" (shard {run.shard}/{args.shards})" if args.shards > 1 else ""
                print(f"attnres-conformance: error: backend {run.spec}{part}: exit status {run.returncode}, "
                      "no report", file=sys.stderr)
                return 2
        return _merge([run.json for run in runs], args, time.monotonic() - start)


def _merge(paths: Sequence[Path], args, wall_time: Optional[float] = None) -> int:
    reports: List[Report] = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            reports += [Report.from_dict(r) for r in data["reports"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"attnres-conformance: error: --merge {path}: {exc!r}", file=sys.stderr)
            return 2
    try:
        reports = _join_shards(reports)
    except ValueError as exc:
        print(f"attnres-conformance: error: --merge: {exc}", file=sys.stderr)
        return 2
    for report in reports:
        print(report.to_text())
    return _finish(reports, args, wall_time)


def _join_shards(reports: List[Report]) -> List[Report]:
    """Reports of one backend's shards (`shard` recorded, in order) joined into one."""
    out: List[Report] = []
    groups: dict = {}
    for report in reports:
        part = report.shard
        if part is None:
            out.append(report)
            continue
        key = (report.spec, part[1])
        if key not in groups:
            groups[key] = [None] * part[1]
            out.append(key)
        groups[key][part[0]] = report
    joined = []
    for item in out:
        if isinstance(item, Report):
            joined.append(item)
            continue
        parts = groups[item]
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise ValueError(f"backend {item[0]}: shards {missing} of {item[1]} missing")
        joined.append(merge_shards(parts))
    return joined


def main(argv: Optional[Sequence[str]] = None) -> int:
    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    dtypes = args.dtype or None
    if args.export_vectors:
        return _export(args.export_vectors, dtypes or DTYPES, args.quick)
    if args.merge:
        return _merge(args.merge, args)
    if args.list:
        from .cases import generate
        ids = [c.id for c in generate(dtypes=dtypes or DTYPES, quick=args.quick)]
        print("\n".join(i for i in ids if not args.select or i.startswith(tuple(args.select))))
        return 0
    specs = args.backend or ([os.environ[ENV_VAR]] if os.environ.get(ENV_VAR) else [])
    if not specs:
        print("attnres-conformance: error: no backend selected; pass --backend NAME "
              f"(one of {', '.join(BACKENDS)}) or --backend module:object, or set ${ENV_VAR}", file=sys.stderr)
        return 2
    if args.report_dir:
        name = report_name(specs, args)
        args.json = args.json or args.report_dir / f"{name}.json"
        args.markdown = args.markdown or args.report_dir / f"{name}.md"
    if args.shards < 1:
        print(f"attnres-conformance: error: --shards: expected K >= 1, got {args.shards}", file=sys.stderr)
        return 2
    if args.jobs > 1 and (len(specs) > 1 or args.shards > 1):
        status = _parallel(specs, argv, args)
    else:
        status = _serial(specs, args, dtypes)
    if status != 2:
        from .parallel import TOTAL_LINE
        print(f"{TOTAL_LINE}{time.monotonic() - started:.1f} s "
              f"({len(specs)} backend{'s' * (len(specs) != 1)})", file=sys.stderr, flush=True)
    return status


def _serial(specs: Sequence[str], args, dtypes) -> int:
    """The backends one after another in this process."""
    from .parallel import Overall

    reports: List[Report] = []
    start = time.monotonic()
    overall = Overall(specs) if len(specs) > 1 and not args.no_progress else None
    for number, spec in enumerate(specs, 1):
        try:
            backend = load_backend(spec)
            part = "" if args.shard is None else f" [shard {args.shard[0]}/{args.shard[1]}]"
            part += f" (backend {number}/{len(specs)})" if len(specs) > 1 else ""
            meter = None if args.no_progress else Progress(spec + part)
            report = run_conformance(backend, dtypes=dtypes, devices=args.device, quick=args.quick,
                                     skips=args.skips, case_ids=args.case, select=args.select, spec=spec,
                                     progress=meter if overall is None else _feeding(meter, overall, number - 1),
                                     shard=args.shard)
            if meter is not None:
                meter.finish()
            if overall is not None:
                overall.finish(number - 1)
        except (BackendSelectionError, BackendUnavailable, ImportError, ValueError, OSError) as exc:
            print(f"attnres-conformance: error: {exc}", file=sys.stderr)
            return 2
        for warning in report.warnings:
            print(f"attnres-conformance: warning: {warning}", file=sys.stderr)
        print(report.to_text())
        reports.append(report)
    return _finish(reports, args, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
