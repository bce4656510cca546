"""`attnres-conformance --jobs N [--shards K]`: several backends (and K parts of each) at once,
each in its own process.

Each backend runs as `python -m attnres_conformance --backend NAME --json FILE <the other
options>`, with `--shard i/K` for its i-th part when it is split; its progress lines (stderr)
pass through line by line (each names its backend; not its total wall time line), and its stdout is kept for when it fails to
produce a report; a line says each time a run ends ("3/8 runs done").  From the children's
progress lines the parent prints one overall line (`Overall`) at the first of them and then at
most every 10 s, e.g.

    attnres-conformance: overall: backends 2/4 done, 61% of cases, 95 s elapsed, about 60 s left

(--no-progress silences the children's lines and so this one).  The CLI then merges the JSON
reports into one (`--merge`).  Processes, not threads: the frameworks keep global state (JAX's
compilation cache, torch's thread pool) and a crash in one must not take the others down.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: Options of the parent that a child must not get: it runs one backend and writes one JSON.
PARENT_ONLY = ("--backend", "--jobs", "--shards", "--json", "--markdown", "--report-dir", "--merge")

#: Set in each child's environment: its run's place in the job (0, 1, ...), so that an adapter can
#: keep per-process state apart (`adapters.mlx`: MLX's kernel directory).
CHILD_ENV = "ATTNRES_CONFORMANCE_RUN"
#: How the CLI's last stderr line starts (the command's wall time); a child's is not forwarded.
TOTAL_LINE = "attnres-conformance: total wall time "
#: A child's progress line (`cli.Progress`): cases done / total, elapsed and ETA in seconds.
PROGRESS_LINE = re.compile(r"^attnres-conformance: .+?: (?P<done>\d+)/(?P<total>\d+) cases \(\d+%\), "
                           r"(?P<elapsed>\d+) s, about (?P<eta>\d+) s left")


@dataclass
class ChildRun:
    spec: str
    shard: int  # 0-based part of the backend's cases (0 when not split)
    returncode: int
    json: Path
    stdout: str


@dataclass
class _Part:
    backend: int  # its backend's place in the job (a backend may be named twice)
    spec: str
    started: bool = False
    finished: bool = False
    done: int = 0
    total: Optional[int] = None
    elapsed: float = 0.0  # the run's own seconds at its last progress line
    eta: float = 0.0  # the run's own ETA at its last progress line


@dataclass
class Overall:
    """One progress line over every run of a multi-backend job (the `--jobs` children, or the
    backends of a serial run): backends done, % of cases, elapsed, about how long is left.

    The runs are each backend of `specs` split into `shards` parts (run i is part i % shards of
    backend i // shards), in the order they start; `jobs` how many run at once.  A run reports with `progress(i, done, total, elapsed, eta)` (its own figures)
    and `finish(i)`.  Unknown figures are estimated: a run not yet seen has as many cases
    as its backend's other shards (else the mean of the runs seen), and the seconds per case of its backend's other shards, else of
    every case seen so far; what is left is the runs' own ETAs plus the unstarted runs placed on
    the first free of `jobs` slots, in order.  `emit()` prints the line at the first call with a
    figure, then at most every `every` seconds (`force` prints it anyway)."""

    specs: Sequence[str]
    shards: int = 1
    jobs: int = 1
    every: float = 10.0
    stream: object = None
    clock: Callable[[], float] = time.monotonic
    parts: List[_Part] = field(init=False)
    start: float = field(init=False)
    last: Optional[float] = field(init=False, default=None)

    def __post_init__(self):
        self.parts = [_Part(b, s) for b, s in enumerate(self.specs) for _ in range(self.shards)]
        self.start = self.clock()
        self._lock = threading.Lock()

    def started(self, i: int) -> None:
        with self._lock:
            self.parts[i].started = True

    def progress(self, i: int, done: int, total: int, elapsed: float, eta: float) -> None:
        with self._lock:
            part = self.parts[i]
            part.started, part.done, part.total, part.elapsed, part.eta = True, done, total, elapsed, eta

    def finish(self, i: int) -> None:
        with self._lock:
            part = self.parts[i]
            part.started = part.finished = True
            if part.total is not None:
                part.done, part.eta = part.total, 0.0

    def figures(self) -> Optional[Tuple[int, int, float, float, float]]:
        """(backends done, backends, fraction of cases done, seconds elapsed, seconds left), or
        None before any run reported a case."""
        with self._lock:
            seen = [p for p in self.parts if p.total is not None]
            if not seen:
                return None

            def guess(spec: str) -> float:  # the cases of a run not seen yet: its backend's other shards
                own = [p.total for p in seen if p.spec == spec] or [p.total for p in seen]
                return sum(own) / len(own)

            totals = [p.total if p.total is not None else guess(p.spec) for p in self.parts]
            done = sum(p.total if p.finished and p.total is not None else p.done for p in self.parts)
            rated = [p for p in seen if p.done > 0]
            overall_rate = (sum(p.elapsed for p in rated) / sum(p.done for p in rated)) if rated else 0.0

            def rate(spec: str) -> float:
                own = [p for p in rated if p.spec == spec]
                return sum(p.elapsed for p in own) / sum(p.done for p in own) if own else overall_rate

            slots: List[float] = []
            waiting: List[float] = []
            for p, total in zip(self.parts, totals):
                if p.finished:
                    continue
                if p.started and p.total is not None and p.done > 0:
                    slots.append(p.eta)
                else:
                    (slots if p.started else waiting).append((total - p.done) * rate(p.spec))
            slots += [0.0] * max(0, self.jobs - len(slots))
            for seconds in waiting:  # each unstarted run on the slot that frees first
                slots.sort()
                slots[0] += seconds
            left = max(slots) if slots else 0.0
            backends: Dict[int, bool] = {}
            for p in self.parts:
                backends[p.backend] = backends.get(p.backend, True) and p.finished
            return (sum(backends.values()), len(backends), done / max(1.0, sum(totals)),
                    self.clock() - self.start, left)

    def line(self) -> Optional[str]:
        figures = self.figures()
        if figures is None:
            return None
        finished, backends, fraction, elapsed, left = figures
        return (f"attnres-conformance: overall: backends {finished}/{backends} done, {100 * fraction:.0f}% of "
                f"cases, {elapsed:.0f} s elapsed, about {left:.0f} s left")

    def emit(self, force: bool = False) -> None:
        now = self.clock()
        if not force and self.last is not None and now - self.last < self.every:
            return
        text = self.line()
        if text is None:
            return
        self.last = now
        print(text, file=sys.stderr if self.stream is None else self.stream, flush=True)


def child_argv(argv: Sequence[str]) -> List[str]:
    """`argv` without the parent-only options (`--opt VALUE` and `--opt=VALUE` forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in PARENT_ONLY:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_children(specs: Sequence[str], argv: Sequence[str], jobs: int, workdir: Path,
                 shards: int = 1, overall: Optional[Overall] = None) -> List[ChildRun]:
    """Run one child per backend spec and shard (`shards` parts each: `--shard i/shards`), at most
    `jobs` at a time; results in the order of `specs`, then shard.  The children's stderr is
    forwarded line by line; `overall` (made with the runs' specs in that order and `jobs`), when
    given (`Overall(specs, shards, jobs)`), is fed from their progress lines and emits the overall line."""
    rest = child_argv(argv)
    work = [(spec, i) for spec in specs for i in range(shards)]

    def forward(index: int, stream) -> None:
        for text in stream:
            if text.startswith(TOTAL_LINE):  # a child's own total: the parent prints the job's
                continue
            with lock:
                sys.stderr.write(text)
                sys.stderr.flush()
            match = PROGRESS_LINE.match(text) if overall is not None else None
            if match:
                overall.progress(index, int(match["done"]), int(match["total"]), float(match["elapsed"]),
                                 float(match["eta"]))
                with lock:
                    overall.emit()

    def one(item) -> ChildRun:
        index, (spec, part) = item
        report = workdir / f"{index}.json"
        split = ["--shard", f"{part}/{shards}"] if shards > 1 else []
        if overall is not None:
            overall.started(index)
        proc = subprocess.Popen([sys.executable, "-m", "attnres_conformance", "--backend", spec, "--json",
                                 str(report), *split, *rest], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, CHILD_ENV: str(index)})
        reader = threading.Thread(target=forward, args=(index, proc.stderr), daemon=True)
        reader.start()
        stdout = proc.stdout.read()
        returncode = proc.wait()
        reader.join()
        if overall is not None:
            overall.finish(index)
        with lock:
            finished.append(spec)
            part_text = f" shard {part + 1}/{shards}" if shards > 1 else ""
            print(f"attnres-conformance: {len(finished)}/{len(work)} runs done ({spec}{part_text}, "
                  f"exit {returncode}) after {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        return ChildRun(spec, part, returncode, report, stdout)

    finished: List[str] = []
    lock, start = threading.Lock(), time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, enumerate(work)))
