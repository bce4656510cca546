"""The grid's round-3 holes (issue 33): for each category an unseen broken port slipped
through, a port with that one defect (`adapters.py`) fails exactly the cells that defect
reaches, the honest ports pass every new row, and the thin catches of round 3 are caught in
every case and dtype the defect can show in (the cases are built for it: a partial weight of
e^-20 at every token, outputs of 1e-6, merges over three blocks).  Only the rows concerned run."""

import adapters
import pytest
from attnres_conformance import cases
from attnres_conformance.runner import run_conformance

DA, MU, ME = "depth_attention", "depth_attention_multi", "merge_partial"
DTYPES = ("float64", "float32", "float16", "bfloat16")
#: Every row or case prefix added in round 3.
NEW = [f"{DA}/weights/N130", f"{DA}/weights/N300", f"{DA}/out_norm/N5-T1-", f"{DA}/out_norm/N4-Tnone",
       f"{DA}/out_norm/N5-T3-D16-x1e-06", f"{DA}/out_norm/N4-T2x3-D16-tokq-x1e-06", f"{ME}/small_partial_weight/",
       f"{DA}/forward_only/", f"{MU}/forward_only/", f"{ME}/forward_only/", f"{MU}/large_magnitude/",
       f"{ME}/large_magnitude/", "probe/call_scale/full-config_scale", "probe/block_two_phase/S2-config_scale",
       "probe/block_two_phase/S2-L5-D8-T2x3-scale1.7", "probe/low_rank_keys/block-S2-r3-two_phase-L7",
       "probe/low_rank_keys/block-S3-r5-two_phase", "determinism/depth_attention-N5-T8200",
       "determinism/depth_attention_multi-N5-S3-T8200", "determinism/merge_partial-T8200",
       f"errors/{DA}/query_none", f"errors/{MU}/queries_none", f"errors/{ME}/partial_none",
       "invariants/two_phase/N4-S2-T3-D16-eps1e-2-scale-1.5"]
#: Rows that must stay green for each broken port (and the rows the defects sit next to).
CONTROL = [f"{DA}/base/", f"{DA}/weights/N5", f"{DA}/out_norm/N5-T3-D16/", f"{ME}/base/", f"{MU}/base/",
           "probe/call_scale/", "probe/block_two_phase/", "probe/low_rank_keys/", "invariants/", "determinism/",
           f"errors/{DA}/query_shape", f"{DA}/large_magnitude/"]


def failing(report):
    """{(row, dtype, column)} of the failing cells."""
    return {(r.row, r.dtype, col) for r in report.results
            for col, c in (("forward", r.forward), ("gradient", r.gradient)) if c is not None and c.status == "fail"}


def failed_ids(report):
    return {r.id for r in report.results if r.failed}


def run(backend, dtypes=None):
    return run_conformance(backend, dtypes=dtypes, select=NEW + CONTROL)


def test_every_category_has_rows():
    ids = [c.id for c in cases.generate()]
    for prefix in NEW:
        assert any(i.startswith(prefix) for i in ids), prefix
    assert all(not c.has_gradient for c in cases.generate() if "/forward_only/" in c.id)
    # a per-call scale with a config scale != 1, direct and two-phase; the two-phase ops with each
    config_scale = [i for i in ids if "config_scale" in i]
    assert any(i.startswith("probe/call_scale/") for i in config_scale)
    assert any(i.startswith("probe/block_two_phase/") and i.split("/")[2].endswith(("scale0.6",)) for i in config_scale)


def test_honest_ports_pass_the_new_rows():
    reference = run(adapters.reference, dtypes=("float64",))
    assert not failing(reference), failing(reference)
    assert reference.summary()["pass"] > 40
    rounding = run(adapters.rounding)
    assert not failing(rounding), failing(rounding)


def test_call_scale_multiplying_config_scale_m10():
    report = run(adapters.multiplies_call_scale, dtypes=("float64",))
    assert failed_ids(report) == {"probe/call_scale/full-config_scale0.5-L5-D8-T2x3-scale1.7/float64",
                                  "probe/block_two_phase/S2-config_scale-1.5-L5-D8-T2x3-scale0.6/float64"}


@pytest.mark.parametrize("backend, expected", [
    ("two_phase_at_scale_one", {"S2-config_scale0.5-L5-D8-T2x3", "S2-L5-D8-T2x3-scale1.7",
                                "S2-config_scale-1.5-L5-D8-T2x3-scale0.6"}),
    ("two_phase_ignores_call_scale", {"S2-L5-D8-T2x3-scale1.7", "S2-config_scale-1.5-L5-D8-T2x3-scale0.6"}),
])
def test_two_phase_ops_lose_the_scale_m9_m10(backend, expected):
    report = run(getattr(adapters, backend), dtypes=("float64",))
    assert failed_ids(report) == {f"probe/block_two_phase/{label}/float64" for label in expected}


def test_weights_normalized_per_40_source_tile():
    report = run(adapters.weights_per_tile_40, dtypes=("float64",))
    assert failed_ids(report) == {f"{DA}/weights/N130-T3-D16-lse/float64"}
    assert "weights" in report.cell(f"{DA}/weights", "float64", "forward").message


def test_out_norm_single_token_path_c17():
    report = run(adapters.out_norm_single_token_without_gain, dtypes=("float64",))
    assert failed_ids(report) == {f"{DA}/out_norm/N5-T1-D16/float64",
                                  f"{DA}/out_norm/N4-Tnone-D16-H2-weights-stacked/float64"}


def test_forward_only_path_checked_where_forward_in_gradient_call():
    """A port that declares `forward_in_gradient_call` has its forward-only calls checked by the
    forward_only rows (before, only the invariants and two-phase probes made such calls, and
    none of them with the output norm): a forward-only out_normed defect fails that row alone."""
    report = run(adapters.broken_forward_only_out_norm, dtypes=("float64",))
    assert failed_ids(report) == {f"{DA}/forward_only/N5-T3-D16-H2-lse-weights-outnorm/float64",
                                  f"{DA}/forward_only/N5-T2x3-D16-tokq-lse-outnorm_eps1e-2/float64"}  # issue 44 item 5
    everything = run(adapters.broken_forward_only, dtypes=("float64",))
    rows = {row for row, _, column in failing(everything)}
    assert {f"{op}/forward_only" for op in (DA, MU, ME)} <= rows
    assert all(column == "forward" for _, _, column in failing(everything))
    assert rows <= {f"{op}/forward_only" for op in (DA, MU, ME)} | {
        "invariants/identity", "invariants/two_phase", "invariants/weights_sum", "invariants/zero_query_uniform",
        "probe/block_two_phase", "probe/low_rank_keys"} | {f"sequences/{op}" for op in (DA, MU, ME)}, rows


def test_key_norm_overflow_in_the_two_phase_ops_c10_6():
    report = run_conformance(adapters.key_norm_overflow, select=[f"{MU}/large_magnitude/", f"{ME}/large_magnitude/",
                                                                  f"{MU}/base/", f"{ME}/base/"])
    assert failed_ids(report) == {f"{MU}/large_magnitude/N5-S2-T3-D64-x1e+20/float32",
                                  f"{MU}/large_magnitude/N5-S2-T3-D64-x1e+20/bfloat16",
                                  f"{ME}/large_magnitude/T3-D64-x1e+20/float32",
                                  f"{ME}/large_magnitude/T3-D64-x1e+20/bfloat16"}


@pytest.mark.parametrize("backend, ops", [("nondeterministic_past_4096", (DA, MU, ME)),
                                          ("nondeterministic_two_phase_at_large_t", (MU, ME))])
def test_nondeterministic_past_4096_tokens_c15(backend, ops):
    report = run(getattr(adapters, backend), dtypes=("float32",))
    assert failing(report) == {("determinism", "float32", "gradient")}
    labels = {DA: "depth_attention-N5-T8200-D16-lse", MU: "depth_attention_multi-N5-S3-T8200-D16",
              ME: "merge_partial-T8200-D16"}
    assert failed_ids(report) == {f"determinism/{labels[op]}/float32" for op in ops}


def test_missing_query_is_a_type_error():
    report = run(adapters.query_none_accepted, dtypes=("float64",))
    assert failed_ids(report) == {f"errors/{DA}/query_none/float64"}


# -- the thin catches, now caught in every case and dtype the defect can show in ---------------------
def test_merge_with_one_minus_w1_c10_7():
    """The partial's weight e^-20 at every token: both cases fail their gradient cell in f64,
    f32 and bf16 (fp16 cannot show it: those gradients underflow there)."""
    report = run_conformance(adapters.merge_one_minus_w1, select=[f"{ME}/"])
    row = f"{ME}/small_partial_weight"
    assert {(row, d, "gradient") for d in ("float64", "float32", "bfloat16")} <= failing(report)
    assert {f"{row}/{label}/{d}" for label in ("T3-D16-gap20", "T2x3-D16-tokq-gap20")
            for d in ("float64", "float32", "bfloat16")} <= failed_ids(report)
    assert all(column == "gradient" and r.startswith(f"{ME}/") for r, _, column in failing(report))


def test_out_norm_from_the_rounded_out_c17():
    """Outputs ~1e-6 at every token: out is subnormal in fp16, and out_normed formed from it is
    off by percents in both cases, forward and gradient; elsewhere the second rounding hides."""
    report = run_conformance(adapters.out_norm_from_rounded_out, select=[f"{DA}/out_norm/"])
    assert failed_ids(report) == {f"{DA}/out_norm/N5-T3-D16-x1e-06/float16",
                                  f"{DA}/out_norm/N4-T2x3-D16-tokq-x1e-06/float16"}
    assert failing(report) == {(f"{DA}/out_norm", "float16", "forward")}  # its VJP is the reference's


def test_low_rank_keys_two_phase_without_gains_m13():
    """Every two-phase low-rank case fails in every dtype (three cases, one to three blocks of merges)."""
    report = run_conformance(adapters.rounding_two_phase_low_rank_without_gains, select=["probe/low_rank_keys/"])
    labels = ("block-S2-r3-two_phase-L5-D8-T2x3", "block-S2-r3-two_phase-L7-D8-T2x3", "block-S3-r5-two_phase-L7-D8-T2x3")
    assert failed_ids(report) == {f"probe/low_rank_keys/{label}/{d}" for label in labels for d in DTYPES}
