"""`attnres-conformance`: run the suite on one or more backends and print the matrix.

    attnres-conformance --backend numpy
    attnres-conformance --backend torch --backend jax --quick --json report.json
    attnres-conformance --backend my_port.adapter:backend --skips my-port-skips.txt
    attnres-conformance --backend torch --case 'depth_attention/shapes/N130-T1-D4096/bfloat16'
    attnres-conformance --export-vectors DIR   # every generated case as golden vectors

Exit status: 0 when nothing failed, 1 on any failure (or XPASS), 2 on a usage error (no backend
selected, unknown backend or case, backend unavailable).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from . import SPEC_VERSION, __version__
from .numerics import DTYPES
from .registry import BACKENDS, ENV_VAR, BackendSelectionError, load_backend
from .runner import BackendUnavailable, run_conformance

QUICK_HELP = ("reduced grid for fast iteration: N in {1, 33}, D in {7, 123}, one token shape, the "
              "main option of each op, every probe variant, the spec errors, one determinism and "
              "one run per invariant, the golden vectors and a 6-example sweep")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnres-conformance", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", default=[], metavar="NAME|module:object",
                   help=f"backend to check (repeatable): one of {', '.join(BACKENDS)} or module:object "
                        f"(default: ${ENV_VAR})")
    p.add_argument("--version", action="version", version=f"attnres-conformance {__version__} (spec {SPEC_VERSION})")
    p.add_argument("--dtype", action="append", choices=DTYPES,
                   help="dtype to check (repeatable; default: all four, undeclared ones reported as skipped)")
    p.add_argument("--device", action="append", help="device (repeatable; default: every declared device)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the JSON report here")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="write the markdown matrix here")
    p.add_argument("--skips", type=Path, metavar="FILE", help="the port's skips/xfails file")
    p.add_argument("--case", action="append", metavar="ID", help="run only this case (repeatable)")
    p.add_argument("--select", action="append", metavar="PREFIX",
                   help="run only cases whose id starts with PREFIX (repeatable), e.g. probe/ or errors/")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress lines on stderr (by default: cases done, elapsed, ETA every 10 s)")
    p.add_argument("--export-vectors", type=Path, metavar="DIR",
                   help="write every generated op/probe case with its reference results as golden vectors")
    return p


def _export(directory: Path, dtypes, quick: bool) -> int:
    from attnres_numpy.vectors import write_vectors

    from .cases import generate
    # A golden id names a file: the case id with '/' replaced by '__'.
    goldens = [dataclasses.replace(c.golden(), id=c.id.replace("/", "__"))
               for c in generate(dtypes=dtypes, quick=quick) if c.kind in ("op", "probe")]
    path = write_vectors(directory, goldens)
    print(f"wrote {len(goldens)} cases to {path.parent}")
    return 0


class Progress:
    """Progress lines on stderr while a backend runs: at the first case, then at most every
    `every` seconds (cases done / total, elapsed, an ETA from the rate so far), and its wall time
    at the end."""

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
        print(f"attnres-conformance: {self.name}: done in {time.monotonic() - self.start:.0f} s",
              file=self.stream, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    dtypes = args.dtype or None
    if args.export_vectors:
        return _export(args.export_vectors, dtypes or DTYPES, args.quick)
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
    reports: List = []
    for spec in specs:
        try:
            backend = load_backend(spec)
            meter = None if args.no_progress else Progress(spec)
            report = run_conformance(backend, dtypes=dtypes, devices=args.device, quick=args.quick,
                                     skips=args.skips, case_ids=args.case, select=args.select, spec=spec,
                                     progress=meter)
            if meter is not None:
                meter.finish()
        except (BackendSelectionError, BackendUnavailable, ImportError, ValueError, OSError) as exc:
            print(f"attnres-conformance: error: {exc}", file=sys.stderr)
            return 2
        for warning in report.warnings:
            print(f"attnres-conformance: warning: {warning}", file=sys.stderr)
        print(report.to_text())
        reports.append(report)
    if args.json:
        args.json.write_text(json.dumps({"schema_version": 1, "reports": [r.to_dict() for r in reports]},
                                        indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text("\n".join(r.to_markdown() for r in reports))
    return 1 if any(r.failed for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
