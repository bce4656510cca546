"""Skips files, the report (matrix and JSON schema) and the reproducers."""

import json
import os
import subprocess
import sys

import adapters
import pytest
from attnres_conformance.runner import load_skips, parse_skips, run_conformance
from conftest import TESTS

BASE = "depth_attention/base/N5-T3-D16/float64"
SHAPES = "depth_attention/shapes/N33-T3-D7/float64"


def test_parse_skips():
    rules = parse_skips("# a comment line\n\nprobe/  # not ported yet\nxfail depth_attention/shapes/N33 # bug 12\n"
                        "skip errors/merge_partial\n")
    assert [(r.prefix, r.mode, r.reason) for r in rules] == [
        ("probe/", "skip", "not ported yet"), ("depth_attention/shapes/N33", "xfail", "bug 12"),
        ("errors/merge_partial", "skip", "skips:5")]
    with pytest.raises(ValueError, match="skips:1"):
        parse_skips("xfail a b\n")


def test_skip_xfail_and_unmatched(tmp_path):
    path = tmp_path / "port-skips.txt"
    path.write_text("probe/  # not ported\nxfail depth_attention/shapes/N33  # dropped sources\n"
                    "no/such/case\nxfail depth_attention_multi/shapes/N33\nxfail golden/depth_attention/depth_attention_N33\n"
                    "xfail depth_attention/sources_past_32/N  # drops past 32: N33 and N130\n")
    report = run_conformance(adapters.broken_drop_past_32, quick=True, dtypes=("float64",), skips=path)
    assert not report.failed
    probe = next(r for r in report.results if r.row == "probe/full")
    assert probe.forward.status == "skip" and "not ported" in probe.forward.message
    xf = next(r for r in report.results if r.id == SHAPES)
    assert xf.forward.status == "xfail" and "dropped sources" in xf.forward.message
    assert report.warnings == ["skips line 3: 'no/such/case' matches no case"]
    assert report.cell("depth_attention/shapes", "float64", "forward").status == "pass*"


def test_xfail_that_passes_is_an_error(tmp_path):
    path = tmp_path / "skips.txt"
    path.write_text(f"xfail {BASE}\n")
    report = run_conformance(adapters.reference, case_ids=[BASE], skips=load_skips(path))
    assert report.failed
    assert report.results[0].forward.status == "xpass"
    assert "XPASS" in report.to_text()


def test_report_json_schema():
    report = run_conformance(adapters.broken_norm_weight_grad, case_ids=[BASE, "errors/depth_attention/eps_nan/float64",
                                                                         "depth_attention/base/N5-T3-D16/float32"])
    data = json.loads(report.to_json())
    assert data["schema_version"] == 1 and data["suite_version"] == "0.1.0"
    assert data["backend"] == "broken_norm_weight_grad"
    assert data["versions"]["attnres_numpy"] == "0.1.0"
    assert data["devices"] == ["cpu"] and "float64" in data["capabilities"]["dtypes"]
    assert data["summary"] == {"pass": 2, "fail": 1, "skip": 2, "xfail": 0, "xpass": 0, "gap": 0}
    keys = {"id", "row", "kind", "dtype", "device", "forward", "gradient", "reproducer", "adapted", "category", "rule"}
    assert all(set(r) == keys for r in data["results"])
    failed, error, skipped = data["results"]
    assert failed["gradient"]["status"] == "fail" and failed["gradient"]["max_rel_err"] > 0.1
    assert failed["forward"] == {"status": "pass", "max_rel_err": 0.0, "message": ""}
    assert failed["reproducer"].startswith("attnres-conformance --backend adapters:broken_norm_weight_grad")
    assert error["gradient"] is None and error["reproducer"] is None
    assert skipped["forward"]["status"] == "skip" and "float32 not declared" in skipped["forward"]["message"]


def test_matrix_layout():
    report = run_conformance(adapters.reference, quick=True, dtypes=("float64", "bfloat16"))
    lines = report.to_text().splitlines()
    header = next(line for line in lines if line.startswith("row "))
    assert header.split() == ["row", "f64", "fwd", "f64", "grad", "bf16", "fwd", "bf16", "grad"]
    base = next(line for line in lines if line.startswith("depth_attention/base "))
    assert base.split() == ["depth_attention/base", "pass", "0.0e+00", "pass", "0.0e+00", "skip", "skip"]
    md = report.to_markdown()
    assert "| row | f64 fwd | f64 grad | bf16 fwd | bf16 grad |" in md
    assert "| `depth_attention/base` | pass 0.0e+00 | pass 0.0e+00 | skip | skip |" in md


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


def test_reproducer_runs():
    report = run_conformance(adapters.broken_logit_scale, case_ids=[BASE], spec="adapters:broken_logit_scale")
    snippet = report.results[0].reproducer
    cli_line, python = snippet.split("\n", 1)
    assert cli_line == f"attnres-conformance --backend adapters:broken_logit_scale --device cpu --case '{BASE}'"
    run = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, env=_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert "status='fail'" in run.stdout and "rel_err" in run.stdout
    cli = subprocess.run(cli_line.replace("attnres-conformance", f"{sys.executable} -m attnres_conformance.cli"),
                         shell=True, capture_output=True, text=True, env=_env(), timeout=120)
    assert cli.returncode == 1 and f"FAILED {BASE}" in cli.stdout


def test_xfail_is_per_case_and_named_in_the_verdict(tmp_path):
    """A case whose gradient alone fails, marked xfail: the failing gradient is the expected
    failure and its passing forward stays a pass (not an XPASS); the verdict names the declaration."""
    path = tmp_path / "skips.txt"
    path.write_text(f"xfail {BASE}  # the gain's gradient is wrong (known)\n")
    report = run_conformance(adapters.broken_norm_weight_grad, case_ids=[BASE], skips=load_skips(path))
    (result,) = report.results
    assert (result.forward.status, result.gradient.status, result.status) == ("pass", "xfail", "xfail")
    assert "the gain's gradient is wrong (known)" in result.gradient.message
    assert not report.failed and report.ok()
    assert report.verdict() == "PASS with 1 declared expected failure"
    assert "verdict: PASS with 1 declared expected failure" in report.to_text()


def test_xfailed_core_rows_leave_the_run_incomplete(tmp_path):
    """Every case past 32 sources declared an expected failure: nothing past 32 was judged, so the
    run is INCOMPLETE (exit 1), never PASS, and the coverage line counts the xfails."""
    path = tmp_path / "skips.txt"
    path.write_text("xfail depth_attention*/*/N33-*  # drops past 32\nxfail depth_attention*/*/N130-*  # drops past 32\n"
                    "xfail golden/*_N33*  # drops past 32\n")
    report = run_conformance(adapters.broken_drop_past_32, quick=True, dtypes=("float64",), skips=path)
    assert not report.failed, report.to_text()
    assert report.verdict() == "INCOMPLETE" and not report.ok()
    assert any(reason.startswith("no case with N >= 33 ran") for reason in report.incomplete)
    assert "every-port rows 2/2 (2 xfail)" in report.to_text()


def test_shards_keep_each_group_in_one_process_and_merge_in_run_order():
    """`--shards`: every k-th case, or with the backend's `shard_group` (MLX: its kernels are
    shared by the cases of one compute dtype; split by case, both processes compiled most of
    them) each group in one process, groups dealt largest first to the part with the fewest
    cases, every k-th case again with fewer groups than parts.  `merge_shards` puts the results
    back in the order of the whole run, whatever the order of the parts."""
    from attnres_conformance.runner import CaseResult, Cell, Report, merge_shards, shard_positions

    dtypes = ["float64", "float32", "float64", "bfloat16", "float32", "float64"]
    assert shard_positions(None, 6, 2) == [[0, 2, 4], [1, 3, 5]]
    assert shard_positions(dtypes, 6, 2) == [[0, 2, 5], [1, 3, 4]]
    assert shard_positions(dtypes, 6, 4) == [[0, 4], [1, 5], [2], [3]]  # 3 groups for 4 parts
    for keys in (None, dtypes * 7):
        for count in (1, 2, 3, 5):
            parts = shard_positions(keys, 42, count)
            assert sorted(i for p in parts for i in p) == list(range(42)) and all(p == sorted(p) for p in parts)

    def report(ids, shard=None, positions=None):
        results = [CaseResult(f"op/{i}/{dtypes[i]}", "op", "op", dtypes[i], "cpu", Cell("pass", 0.0), None) for i in ids]
        return Report("fake", "fake", {}, {"dtypes": sorted(set(dtypes)), "devices": ["cpu"]}, ["cpu"], sorted(set(dtypes)),
                      True, results, date="2026-12-07T00:00:00Z", shard=shard, positions=positions)

    parts = [report(p, (i, 2), p) for i, p in enumerate(shard_positions(dtypes, 6, 2))]
    parts = [Report.from_dict(json.loads(p.to_json())) for p in parts]  # positions survive the JSON
    merged = merge_shards(parts[::-1])
    assert [r.id for r in merged.results] == [r.id for r in report(range(6)).results]
    assert (merged.shards, merged.shard, merged.positions) == (2, None, None)
    with pytest.raises(ValueError, match="places of their cases"):
        merge_shards([report([0, 2, 5], (0, 2)), parts[1]])
