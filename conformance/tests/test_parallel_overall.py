"""The overall progress line of a multi-backend run (`parallel.Overall`) and the job's total wall
time (the last stderr line of `attnres-conformance`)."""

import io
import os
import re
import subprocess
import sys

from attnres_conformance.parallel import CHILD_ENV, PROGRESS_LINE, Overall
from test_cli import cli

OVERALL = re.compile(r"^attnres-conformance: overall: backends (\d+)/(\d+) done, (\d+)% of cases, "
                     r"(\d+) s elapsed, about (\d+) s left$", re.M)
TOTAL = re.compile(r"^attnres-conformance: total wall time (\d+\.\d) s \((\d+) backends?\)$")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_overall_figures_from_the_runs_progress():
    """Two numpy shards and two JAX shards, two at a time: the cases and ETA of the JAX shard not
    started yet come from its started sibling (200 cases at 2 s each), queued on the first free slot."""
    clock, out = Clock(), io.StringIO()
    overall = Overall(["numpy", "jax"], shards=2, jobs=2, stream=out, clock=clock)
    overall.emit()
    assert out.getvalue() == ""  # nothing reported yet: no line
    overall.started(0)
    overall.started(1)
    overall.progress(1, 100, 100, 10.0, 0.0)
    overall.finish(1)
    overall.progress(0, 50, 100, 5.0, 5.0)
    overall.started(2)
    overall.progress(2, 10, 200, 20.0, 380.0)
    clock.now += 30
    # cases: 50 + 100 + 10 of 100 + 100 + 200 + 200 (guessed) = 160/600; left: max(380, 5 + 200 * 2)
    assert overall.line() == ("attnres-conformance: overall: backends 0/2 done, 27% of cases, "
                              "30 s elapsed, about 405 s left")
    overall.finish(0)
    # numpy done; the waiting JAX shard takes the freed slot: max(380, 0 + 400)
    assert overall.line() == ("attnres-conformance: overall: backends 1/2 done, 35% of cases, "
                              "30 s elapsed, about 400 s left")
    overall.started(3)
    overall.progress(3, 100, 200, 190.0, 190.0)
    overall.progress(2, 150, 200, 300.0, 100.0)
    overall.finish(2)
    clock.now += 300
    assert overall.line() == ("attnres-conformance: overall: backends 1/2 done, 83% of cases, "
                              "330 s elapsed, about 190 s left")
    overall.finish(3)
    assert overall.line().startswith("attnres-conformance: overall: backends 2/2 done, 100% of cases, ")
    assert overall.line().endswith("about 0 s left")


def test_overall_line_is_throttled():
    clock, out = Clock(), io.StringIO()
    overall = Overall(["a", "b"], jobs=1, every=10.0, stream=out, clock=clock)
    overall.progress(0, 1, 4, 2.0, 6.0)
    overall.emit()  # the first figure: printed
    clock.now += 9
    overall.progress(0, 3, 4, 6.0, 2.0)
    overall.emit()  # 9 s later: not yet
    clock.now += 1
    overall.emit()  # 10 s: printed
    overall.emit(force=True)
    lines = out.getvalue().splitlines()
    # the first: 1 of 8 cases (b guessed like a), left 6 s + 4 cases of b at 2 s each
    assert lines[0] == "attnres-conformance: overall: backends 0/2 done, 12% of cases, 0 s elapsed, about 14 s left"
    assert lines[1] == "attnres-conformance: overall: backends 0/2 done, 38% of cases, 10 s elapsed, about 10 s left"
    assert len(lines) == 3 and lines[2] == lines[1]


def test_progress_line_is_read_back():
    """The children's own lines (cli.Progress) are what the parent parses."""
    from attnres_conformance.cli import Progress

    out = io.StringIO()
    Progress("jax [shard 1/2]", stream=out)(3, 40, "probe/mix/x")
    match = PROGRESS_LINE.match(out.getvalue())
    assert match and (match["done"], match["total"]) == ("3", "40"), out.getvalue()


def _total(stderr):
    last = stderr.rstrip("\n").splitlines()[-1]
    match = TOTAL.match(last)
    assert match, last
    return float(match[1]), int(match[2])


def test_serial_run_prints_overall_line_and_total():
    select = ["--select", "probe/mix", "--dtype", "float64"]
    run = cli("--backend", "numpy", "--backend", "numpy", *select)
    assert run.returncode == 0, run.stderr
    lines = OVERALL.findall(run.stderr)
    assert lines and lines[0][:2] == ("0", "2"), run.stderr  # printed at the first case
    assert all(0 <= int(pct) <= 100 for _, _, pct, _, _ in lines)
    total, backends = _total(run.stderr)
    in_all = float(re.search(r"summary \(2 backends, ([\d.]+) s in all\)", run.stdout)[1])
    assert backends == 2 and total >= in_all
    quiet = cli("--backend", "numpy", "--backend", "numpy", *select, "--no-progress")
    assert quiet.returncode == 0 and "overall:" not in quiet.stderr
    assert _total(quiet.stderr)[1] == 2  # the total is a result, not progress: always printed
    single = cli("--backend", "numpy", *select)
    assert "overall:" not in single.stderr and _total(single.stderr)[1] == 1


def test_parallel_run_prints_overall_line_and_total():
    select = ["--select", "depth_attention/base/", "--dtype", "float64"]
    run = cli("--backend", "numpy", "--backend", "adapters:broken_norm_weight_grad", *select,
              "--jobs", "2", "--shards", "2")
    assert run.returncode == 1, run.stdout + run.stderr  # the broken adapter fails its gradients
    lines = OVERALL.findall(run.stderr)
    assert lines and lines[0][:2] == ("0", "2"), run.stderr  # printed at the first child's first case
    assert "[shard 1/2]: done in" in run.stderr  # the children's own lines still pass through
    total, backends = _total(run.stderr)
    assert backends == 2 and total > 0 and run.stderr.count("total wall time") == 1  # not the children's
    quiet = cli("--backend", "numpy", "--backend", "numpy", *select, "--jobs", "2", "--no-progress")
    assert quiet.returncode == 0 and "overall:" not in quiet.stderr and "cases (" not in quiet.stderr


def test_each_child_of_a_parallel_run_knows_its_run(tmp_path):
    """Every child of a `--jobs` run gets its run's place in the job (0, 1, ...) in
    `ATTNRES_CONFORMANCE_RUN` (parallel.CHILD_ENV), one value per process: adapters.mlx keeps
    MLX's kernel directory apart by it (MLX's CPU compiler is not safe for two processes)."""
    (tmp_path / "runspy.py").write_text(
        "import os, pathlib\n"
        "from attnres_conformance.adapters.numpy import backend  # noqa: F401\n"
        "pathlib.Path(__file__).with_name('run-' + os.environ.get('ATTNRES_CONFORMANCE_RUN', 'parent')).touch()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop(CHILD_ENV, None)
    run = subprocess.run([sys.executable, "-m", "attnres_conformance.cli", "--backend", "runspy:backend",
                          "--backend", "runspy:backend", "--case", "depth_attention/base/N5-T3-D16/float64",
                          "--jobs", "2", "--shards", "2", "--no-progress"], capture_output=True, text=True,
                         env=env, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    children = sorted(p.name for p in tmp_path.glob("run-*") if p.name != "run-parent")
    assert children == ["run-0", "run-1", "run-2", "run-3"], children  # 2 backends x 2 shards
