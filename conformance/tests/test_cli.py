"""The `attnres-conformance` command line, run in a subprocess on the NumPy backends."""

import json
import os
import re
import subprocess
import sys

from attnres_conformance import SPEC_VERSION, __version__
from attnres_numpy.vectors import load_vectors
from conftest import TESTS


def cli(*args, timeout=180, backend_env=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("ATTNRES_BACKEND", None)
    if backend_env:
        env["ATTNRES_BACKEND"] = backend_env
    return subprocess.run([sys.executable, "-m", "attnres_conformance.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_no_backend_is_an_error():
    run = cli()
    assert run.returncode == 2
    assert "no backend selected" in run.stderr


def test_backend_from_the_environment():
    run = cli("--case", "invariants/identity/N1-T3-D16/float64", backend_env="numpy")
    assert run.returncode == 0 and "backend numpy (numpy)" in run.stdout


def test_unknown_backend_is_an_error():
    run = cli("--backend", "nosuch")
    assert run.returncode == 2 and "unknown name 'nosuch'" in run.stderr


def test_numpy_quick_passes_and_writes_reports(tmp_path):
    run = cli("--backend", "numpy", "--quick", "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr
    assert "attnres conformance: backend numpy (numpy) on cpu [quick]" in run.stdout
    assert "depth_attention/shapes" in run.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["schema_version"] == 1 and [r["backend"] for r in data["reports"]] == ["numpy"]
    assert data["reports"][0]["summary"]["fail"] == 0
    assert "| `probe/full` |" in (tmp_path / "r.md").read_text()


def test_failures_exit_one_and_backends_combine(tmp_path):
    run = cli("--backend", "numpy", "--backend", "adapters:broken_norm_weight_grad", "--dtype", "float64",
              "--case", "depth_attention/base/N5-T3-D16/float64", "--json", str(tmp_path / "r.json"))
    assert run.returncode == 1
    assert "FAILED depth_attention/base/N5-T3-D16/float64" in run.stdout
    assert "--backend adapters:broken_norm_weight_grad" in run.stdout
    reports = json.loads((tmp_path / "r.json").read_text())["reports"]
    assert [r["summary"]["fail"] for r in reports] == [0, 1]


def test_skips_file_warns_on_unmatched(tmp_path):
    skips = tmp_path / "skips.txt"
    skips.write_text("nothing/matches/this\n")
    run = cli("--backend", "numpy", "--case", "invariants/identity/N1-T3-D16/float64", "--skips", str(skips))
    assert run.returncode == 0
    assert "warning: skips line 1: 'nothing/matches/this' matches no case" in run.stderr


def test_unknown_case_is_an_error():
    run = cli("--backend", "numpy", "--case", "depth_attention/base/nope/float64")
    assert run.returncode == 2 and "no case named" in run.stderr


def test_export_vectors(tmp_path):
    run = cli("--export-vectors", str(tmp_path), "--quick", "--dtype", "bfloat16")
    assert run.returncode == 0, run.stderr
    vectors = load_vectors(tmp_path)
    ids = {v.id for v in vectors}
    assert "depth_attention__shapes__N33-T3-D123__bfloat16" in ids
    assert "probe__full__L5-D8-T2x3__bfloat16" in ids  # --quick: the one probe row in every dtype
    assert all(v.dtype == "bfloat16" for v in vectors) and len(vectors) >= 40


def test_progress_on_stderr_and_its_opt_out():
    """A long run is never silent: the first case, then every 10 s, then the wall time."""
    run = cli("--backend", "numpy", "--select", "probe/mix", "--dtype", "float64")
    assert run.returncode == 0, run.stderr
    lines = [l for l in run.stderr.splitlines() if l.startswith("attnres-conformance: numpy: ")]
    assert lines[0].startswith("attnres-conformance: numpy: 1/") and "cases" in lines[0], lines
    assert lines[-1].startswith("attnres-conformance: numpy: done in "), lines
    quiet = cli("--backend", "numpy", "--select", "probe/mix", "--dtype", "float64", "--no-progress")
    assert quiet.returncode == 0 and "cases (" not in quiet.stderr and "done in" not in quiet.stderr


def test_progress_meter_throttles_and_estimates():
    import io

    from attnres_conformance.cli import Progress

    out = io.StringIO()
    meter = Progress("demo", every=3600.0, stream=out)
    for done in range(1, 11):
        meter(done, 10, f"case{done}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "1/10 cases (10%)" in lines[0] and "10/10 cases (100%)" in lines[1]
    assert "about 0 s left" in lines[1]


def test_python_dash_m_and_version():
    """`python -m attnres_conformance` is the script; --version names the suite and the spec."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    version = subprocess.run([sys.executable, "-m", "attnres_conformance", "--version"], capture_output=True,
                             text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"attnres-conformance {__version__} (spec {SPEC_VERSION})"
    spec = (TESTS.parents[1] / "spec" / "SPEC.md").read_text()
    assert re.search(r"^Version (\S+) ", spec, re.M).group(1) == SPEC_VERSION
    run = subprocess.run([sys.executable, "-m", "attnres_conformance", "--backend", "numpy", "--case",
                          "invariants/identity/N1-T3-D16/float64"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and "backend numpy (numpy)" in run.stdout, run.stderr
    bad = subprocess.run([sys.executable, "-m", "attnres_conformance", "--backend", "nosuch"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "unknown name 'nosuch'" in bad.stderr


def test_summary_paths_and_merge(tmp_path):
    """The end of a run: one summary line per backend and the reports written (saying when one
    replaced an earlier file); --merge makes one report of runs made in separate processes."""
    case = "depth_attention/base/N5-T3-D16/float64"
    good = cli("--backend", "numpy", "--case", case, "--json", str(tmp_path / "a.json"),
               "--markdown", str(tmp_path / "a.md"))
    assert good.returncode == 0, good.stderr
    summary = good.stdout[good.stdout.index("attnres conformance summary (1 backend, "):]
    lines = summary.splitlines()
    assert lines[1].split()[:8] == ["backend", "verdict", "cases", "pass", "fail", "skip", "xfail", "gap"]
    assert lines[2].split()[:8] == ["numpy", "PASS", "1", "1", "0", "0", "0", "0"] and " s " in lines[2]
    assert lines[3:] == [f"report written: {tmp_path / 'a.json'}", f"report written: {tmp_path / 'a.md'}"]
    again = cli("--backend", "numpy", "--case", case, "--json", str(tmp_path / "a.json"))
    assert f"report written: {tmp_path / 'a.json'} (replaced the earlier file)" in again.stdout
    bad = cli("--backend", "adapters:broken_norm_weight_grad", "--case", case, "--json", str(tmp_path / "b.json"))
    assert bad.returncode == 1
    merged = cli("--merge", str(tmp_path / "a.json"), "--merge", str(tmp_path / "b.json"),
                 "--markdown", str(tmp_path / "all.md"), "--json", str(tmp_path / "all.json"))
    assert merged.returncode == 1, merged.stderr
    assert "attnres conformance summary (2 backends" in merged.stdout
    md = (tmp_path / "all.md").read_text()
    assert "| numpy | PASS | 1 | 1 | 0 | 0 | 0 | 0 |" in md
    assert "| adapters:broken_norm_weight_grad | FAIL | 1 | 0 | 1 | 0 | 0 | 0 |" in md
    assert [r["spec"] for r in json.loads((tmp_path / "all.json").read_text())["reports"]] == [
        "numpy", "adapters:broken_norm_weight_grad"]
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    assert cli("--merge", str(broken)).returncode == 2


def test_report_dir_names_reports_by_what_they_cover(tmp_path):
    """Before: `nox -s conformance -- torch` wrote reports/conformance.md over the four-backend one."""
    from attnres_conformance.cli import _parser, report_name

    args = lambda *a: _parser().parse_args(list(a))  # noqa: E731
    assert report_name(["numpy", "torch", "jax", "mlx"], args()) == "conformance"
    assert report_name(["mlx", "jax", "torch", "numpy"], args()) == "conformance"
    assert report_name(["torch"], args()) == "conformance-torch"
    assert report_name(["torch", "jax"], args("--quick")) == "conformance-torch-jax-quick"
    assert report_name(["numpy", "torch", "jax", "mlx"], args("--dtype", "float32")) == "conformance-subset"
    assert report_name(["my_port.adapter:backend"], args()) == "conformance-my_port.adapter_backend"
    case = "depth_attention/base/N5-T3-D16/float64"
    run = cli("--backend", "numpy", "--case", case, "--report-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conformance-numpy-subset.json", "conformance-numpy-subset.md"]
    assert f"report written: {tmp_path / 'conformance-numpy-subset.md'}\n" in run.stdout


def test_jobs_runs_backends_in_separate_processes_and_merges(tmp_path):
    case = "depth_attention/base/N5-T3-D16/float64"
    run = cli("--backend", "numpy", "--backend", "adapters:broken_norm_weight_grad", "--case", case, "--jobs", "2",
              "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "attnres-conformance: numpy: done in" in run.stderr
    assert "attnres-conformance: adapters:broken_norm_weight_grad: done in" in run.stderr
    assert "attnres-conformance: 2/2 runs done (" in run.stderr  # the overall progress
    assert f"FAILED {case}" in run.stdout and "attnres conformance summary (2 backends, " in run.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["spec"] for r in data["reports"]] == ["numpy", "adapters:broken_norm_weight_grad"]
    assert [r["case_summary"]["fail"] for r in data["reports"]] == [0, 1]
    unknown = cli("--backend", "numpy", "--backend", "nosuch", "--case", case, "--jobs", "2")
    assert unknown.returncode == 2 and "unknown name 'nosuch'" in unknown.stderr


def test_shards_split_one_backend_and_join_to_the_unsplit_report(tmp_path):
    """--jobs 2 --shards 2 runs every case once across two processes and writes the report the
    unsplit run writes (same cases in the same order, same cells); a failure in one shard fails
    the whole; a part can also be run alone with --shard and joined with --merge."""
    select = ["--select", "depth_attention/base/", "--select", "merge_partial/base/"]
    whole = cli("--backend", "adapters:broken_norm_weight_grad", *select, "--json", str(tmp_path / "whole.json"))
    split = cli("--backend", "adapters:broken_norm_weight_grad", *select, "--jobs", "2", "--shards", "2",
                "--json", str(tmp_path / "split.json"))
    assert whole.returncode == split.returncode == 1, split.stdout + split.stderr
    assert "[shard 0/2]: done in" in split.stderr and "[shard 1/2]: done in" in split.stderr
    cells = lambda r: [(x["id"], x["forward"], x["gradient"]) for x in r["results"]]  # noqa: E731
    a = json.loads((tmp_path / "whole.json").read_text())["reports"][0]
    b = json.loads((tmp_path / "split.json").read_text())["reports"][0]
    assert len(a["results"]) > 4 and cells(a) == cells(b) and a["case_summary"] == b["case_summary"]
    assert (a["shards"], b["shards"], b["shard"]) == (1, 2, None)
    assert "(2 shards in parallel)" in split.stdout
    parts = []
    for i in range(2):
        path = tmp_path / f"part{i}.json"
        cli("--backend", "adapters:broken_norm_weight_grad", *select, "--shard", f"{i}/2", "--json", str(path))
        parts.append(path)
        assert json.loads(path.read_text())["reports"][0]["shard"] == [i, 2]
    merged = cli("--merge", str(parts[1]), "--merge", str(parts[0]), "--json", str(tmp_path / "merged.json"))
    assert merged.returncode == 1
    assert cells(json.loads((tmp_path / "merged.json").read_text())["reports"][0]) == cells(a)
    bad = cli("--backend", "numpy", "--shard", "2/2")
    assert bad.returncode == 2 and "0 <= I < K" in bad.stderr


def test_quick_grid_runs_networks_in_float64_and_every_op_row_in_every_dtype():
    """--quick keeps one case per probe row and the golden vectors in float64 (plus the Full
    AttnRes probe case in every dtype); op rows marked quick keep all four dtypes; nothing outside the full grid (the
    sweep draws its own 6 examples under --quick, so it is left out here)."""
    from attnres_conformance import cases

    full = {c.id: c for c in cases.generate(sweep=False)}
    quick = cases.generate(quick=True, sweep=False)
    assert {c.id for c in quick} <= set(full)
    networks = [c for c in quick if c.kind in ("probe", "golden")]
    assert {c.dtype for c in networks if not c.id.startswith(cases.QUICK_EVERY_DTYPE_PROBE)} == {"float64"}
    assert {c.dtype for c in networks if c.id.startswith(cases.QUICK_EVERY_DTYPE_PROBE)} == set(cases.DTYPES)
    probe_rows = {c.row for c in full.values() if c.kind == "probe"}
    quick_probes = [c.row for c in quick if c.kind == "probe" and c.dtype == "float64"]
    assert sorted(quick_probes) == sorted(probe_rows)  # every probe row once, in float64
    ops = [c.id for c in full.values() if c.quick and c.kind not in ("probe", "golden")]
    assert ops == [c.id for c in quick if c.kind not in ("probe", "golden")]  # op rows: every dtype
