"""The suite against the honest reference and deliberately broken adapters (`adapters.py`):
each bug must be reported failing in the right matrix cell, and nowhere it cannot show."""

import adapters
import pytest
from attnres_conformance.runner import run_conformance

F64 = ("float64",)


def status(report, row, dtype, column):
    cell = report.cell(row, dtype, column)
    assert cell is not None, f"no case fills {row} {dtype} {column}"
    return cell.status


def failing_rows(report):
    return {(r.row, r.dtype, col) for r in report.results
            for col, c in (("forward", r.forward), ("gradient", r.gradient)) if c is not None and c.status == "fail"}


@pytest.fixture(scope="module")
def reference_report():
    return run_conformance(adapters.reference, dtypes=F64)


def test_reference_passes_everything(reference_report):
    summary = reference_report.summary()
    assert summary["fail"] == 0 and summary["xpass"] == 0, failing_rows(reference_report)
    assert summary["pass"] > 200
    # float64 only: the reference declares every op, option and variant (not an autocast region, C3a,
    # nor a second dtype for its probe sublayers to return, M1a)
    assert not [r.id for r in reference_report.results if r.status == "skip"
                and not r.id.startswith(("autocast/", "probe/sublayer_dtype/"))]
    rows = set(reference_report.rows())
    for row in ("depth_attention/shapes", "depth_attention/large_magnitude", "probe/block_two_phase",
                "probe/multihead", "errors/merge_partial", "determinism", "invariants/two_phase",
                "golden/probe", "sweep/depth_attention"):
        assert row in rows


def test_honest_low_precision_port_passes_every_dtype():
    report = run_conformance(adapters.rounding)
    assert not report.failed, failing_rows(report)
    for dtype in ("float32", "float16", "bfloat16"):
        assert status(report, "depth_attention/shapes", dtype, "gradient") == "pass"
        assert status(report, "probe/gated", dtype, "gradient") == "pass"


def test_eps_in_the_wrong_place():
    report = run_conformance(adapters.rounding_broken_eps, quick=True, dtypes=("float64", "float32"))
    # eps = 1e-2: the bug is 0.7 % of the output; at eps = 1e-6 it hides under fp32's tolerance.
    assert status(report, "depth_attention/eps_scale", "float32", "forward") == "fail"
    assert status(report, "depth_attention/base", "float32", "forward") == "pass"
    # All-zero sources: out = 0 either way, but r = 1/eps instead of 1/sqrt(eps) in the VJP.
    assert status(report, "depth_attention/zero_sources", "float32", "forward") == "pass"
    assert status(report, "depth_attention/zero_sources", "float32", "gradient") == "fail"
    assert status(report, "depth_attention/base", "float64", "forward") == "fail"
    assert status(report, "probe/standard", "float64", "forward") == "pass"  # no depth attention there


def test_logit_scale():
    report = run_conformance(adapters.broken_logit_scale, quick=True, dtypes=F64)
    for row in ("depth_attention/base", "depth_attention_multi/base", "merge_partial/base",
                "golden/depth_attention"):
        assert status(report, row, "float64", "forward") == "fail", row
    # N = 1: out is scale-free (C6), lse = z_0 is not.
    identity = {r.id: r.forward for r in report.results if r.row == "invariants/identity"}
    assert identity["invariants/identity/N1-T3-D16/float64"].status == "pass"
    assert "lse = z_0" in identity["invariants/identity/N1-T3-D16-lse-weights/float64"].message


def test_source_dropped_past_index_32():
    report = run_conformance(adapters.broken_drop_past_32, quick=True, dtypes=F64)
    assert status(report, "depth_attention/shapes", "float64", "forward") == "fail"  # N = 33
    assert status(report, "depth_attention_multi/shapes", "float64", "gradient") == "fail"
    for row in ("depth_attention/base", "depth_attention/heads", "merge_partial/base"):
        assert status(report, row, "float64", "forward") == "pass", row
    failed = {r.id for r in report.results if r.failed}
    assert failed and all("N33" in i or "N130" in i or "N40" in i for i in failed), failed


def test_embedding_left_out_of_the_probe():
    report = run_conformance(adapters.broken_embedding, quick=True, dtypes=F64)
    for row in ("probe/full", "probe/block", "probe/window", "probe/block_two_phase", "golden/probe"):
        assert status(report, row, "float64", "forward") == "fail", row
    for row in ("probe/standard", "probe/scalar", "probe/gated", "probe/static", "depth_attention/base"):
        assert status(report, row, "float64", "forward") == "pass", row
    assert {row for row, _, _ in failing_rows(report)} == {
        "probe/full", "probe/block", "probe/window", "probe/block_two_phase", "probe/input_query",
        "probe/sigmoid", "probe/no_key_norm", "probe/multihead", "golden/probe",
        "probe/mix", "probe/call_scale",  # M10 rows run depth attention too (but alpha = 0: below)
        "probe/shared_queries", "probe/hybrid", "probe/low_rank_keys", "probe/compressed_history",
        "probe/fused_out_norm"}
    assert status(report, "probe/mix", "float64", "forward") == "fail"
    assert not any("mix0/" in r.id for r in report.results if r.failed)  # alpha = 0: no DA


def test_wrong_norm_weight_gradient():
    report = run_conformance(adapters.broken_norm_weight_grad, quick=True, dtypes=F64)
    assert status(report, "depth_attention/base", "float64", "gradient") == "fail"
    assert status(report, "depth_attention/base", "float64", "forward") == "pass"
    assert status(report, "depth_attention/no_gain", "float64", "gradient") == "pass"  # no norm weight
    assert all(col == "gradient" for _, _, col in failing_rows(report))
    bad = next(r for r in report.results if r.row == "depth_attention/base")
    assert "d_norm_weight" in bad.gradient.message and "d_query" not in bad.gradient.message


def test_nondeterministic_backward():
    report = run_conformance(adapters.nondeterministic_backward, quick=True, dtypes=F64)
    assert status(report, "determinism", "float64", "gradient") == "fail"
    assert status(report, "determinism", "float64", "forward") == "pass"
    assert failing_rows(report) == {("determinism", "float64", "gradient")}  # noise within tolerance


def test_input_modified_in_place():
    report = run_conformance(adapters.mutates_input, quick=True, dtypes=F64)
    assert status(report, "depth_attention/base", "float64", "forward") == "fail"
    assert "modified" in report.cell("depth_attention/base", "float64", "forward").message
    assert status(report, "depth_attention_multi/base", "float64", "forward") == "pass"  # no 'query' there


def test_capabilities_skip_and_limits():
    report = run_conformance(adapters.fewer_options, quick=True, dtypes=F64)
    assert status(report, "depth_attention/sigmoid", "float64", "forward") == "skip"
    assert status(report, "probe/sigmoid", "float64", "gradient") == "skip"
    skip = report.cell("depth_attention/sigmoid", "float64", "forward")
    assert skip.err is None
    assert any("sigmoid not declared" in r.forward.message for r in report.results if r.row == "depth_attention/sigmoid")
    # The declared max_sources = 40: N = 40 runs, N = 41 must raise; this adapter never raises.
    assert status(report, "depth_attention/limits", "float64", "forward") == "pass"
    limit = next(r for r in report.results if r.id == "errors/depth_attention/max_sources_plus_1/float64")
    assert limit.forward.status == "fail" and "no error raised" in limit.forward.message
    assert failing_rows(report) == {("errors/depth_attention", "float64", "forward")}


def test_large_magnitudes_must_stay_finite():
    report = run_conformance(adapters.rounding_overflowing_backward, select=["depth_attention/large_magnitude/"])
    failed = {(r.id, col) for r in report.results for col, c in (("fwd", r.forward), ("grad", r.gradient))
              if c.status == "fail"}
    assert failed == {("depth_attention/large_magnitude/N5-T3-D64-x1e+30/float32", "grad"),
                      ("depth_attention/large_magnitude/N5-T3-D64-x1e+30/bfloat16", "grad"),
                      ("depth_attention/large_magnitude/N5-T3-D64-x1e+20/float32", "grad"),
                      ("depth_attention/large_magnitude/N5-T3-D64-x1e+20/bfloat16", "grad"),
                      ("depth_attention/large_magnitude/N5-T3-D64-x1e+100/float64", "grad")}
    bad = next(r for r in report.results if r.id.endswith("x1e+30/float32"))
    assert "non-finite" in bad.gradient.message


def test_mix_ignored():
    """M10: a port that runs the plain scheme whatever alpha fails the blended rows and the
    alpha = 0 row, and nothing else (alpha = 1 is the plain scheme)."""
    report = run_conformance(adapters.ignores_mix, dtypes=F64)  # every probe case: --quick runs one per row
    rows = {row for row, _, _ in failing_rows(report)}
    assert rows == {"probe/mix", "probe/call_scale", "golden/probe"}, rows
    failed = {r.id for r in report.results if r.failed}
    assert all("mix" in i for i in failed), failed
    assert not any("mix1" in i for i in failed), failed


def test_call_scale_ignored():
    report = run_conformance(adapters.ignores_call_scale, quick=True, dtypes=F64)
    rows = {row for row, _, _ in failing_rows(report)}
    assert rows == {"probe/call_scale"}, rows  # (its golden vector is float32, not in this run)
    failed = {r.id for r in report.results if r.failed}
    assert all("scale" in i or "_cs" in i for i in failed), failed


def test_undeclared_call_inputs_are_skipped_with_the_reason():
    report = run_conformance(adapters.no_call_inputs, quick=True, dtypes=F64)
    assert report.summary()["fail"] == 0, failing_rows(report)
    cells = [c for r in report.results if r.row in ("probe/mix", "probe/call_scale") for c in r.cells]
    assert cells and all(c.status == "skip" and "call input" in c.message for c in cells), cells


def test_key_projection_ignored():
    """M13: a port whose keys are the first r normed channels (the init projection) instead of
    the learned key_projection fails every low-rank row, direct, two-phase and blended, and no
    other row."""
    report = run_conformance(adapters.ignores_key_projection, dtypes=F64)  # every probe case: --quick runs one per row
    rows = {row for row, _, _ in failing_rows(report)}
    # probe/fused_out_norm: its low-rank case (M15 over M13)
    assert rows == {"probe/low_rank_keys", "probe/mix", "golden/probe", "probe/fused_out_norm"}, rows
    failed = {r.id for r in report.results if r.failed}
    assert all("low_rank" in i or "r3" in i or "_r4" in i for i in failed), failed
    for label in ("L5-D8-T2x3", "input-r3-L5-D8-T2x3", "block-S2-r3-two_phase-L5-D8-T2x3",
                  "window-W2-r2-sigmoid-L5-D8-T2x3"):
        cell = next(r for r in report.results if r.id == f"probe/low_rank_keys/{label}/float64")
        assert cell.forward.status == "fail", label


def test_summaries_dropped():
    """M14: a port that drops the outputs older than the window (the plain window rule, M5)
    fails every compressed-history row (S = 1 too: there each output beyond the window is kept
    as a summary of one) and its golden vectors, and nothing else."""
    report = run_conformance(adapters.drops_summaries, dtypes=F64)  # every probe case: --quick runs one per row
    rows = {row for row, _, _ in failing_rows(report)}
    # probe/fused_out_norm: its compressed-history case (M15 over M14)
    assert rows == {"probe/compressed_history", "golden/probe", "probe/fused_out_norm"}, rows
    failed = {r.id for r in report.results if r.failed}
    assert all("compressed_history" in i or "/summaries-" in i for i in failed), failed
    cells = [r for r in report.results if r.row == "probe/compressed_history"]
    assert len(cells) == 5 and all(r.forward.status == "fail" for r in cells), cells


def test_out_norm_weights_ignored():
    """M15: a port that norms the sublayer inputs and the output without the learned gains fails
    every fused-output-norm case (direct, two-phase, blended, alpha = 0) and its golden vectors,
    and nothing else."""
    report = run_conformance(adapters.ignores_out_norm_weights, dtypes=F64)
    rows = {row for row, _, _ in failing_rows(report)}
    assert rows == {"probe/fused_out_norm", "probe/block_two_phase", "probe/mix", "golden/probe"}, rows
    failed = {r.id for r in report.results if r.failed}
    assert all("fused_out_norm" in i or "outnorm" in i for i in failed), failed
    fused = [r for r in report.results if r.row.startswith("probe/") and "fused_out_norm" in r.id]
    assert len(fused) == 9 and all(r.forward.status == "fail" for r in fused), fused
