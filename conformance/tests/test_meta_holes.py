"""The grid's former holes (issue 17): for each category a broken port slipped through, a port
with that one defect (`adapters.py`) fails in its own cell and nowhere else, and the honest
ports pass.  Runs only the rows concerned (plus control rows), so it stays fast."""

import adapters
import pytest
from attnres_conformance import cases
from attnres_conformance.runner import run_conformance

DA, MU, ME = "depth_attention", "depth_attention_multi", "merge_partial"
#: Every row added for the holes, and rows that must stay green for each broken port.
NEW = [f"{DA}/nonfinite/", f"{MU}/nonfinite/", f"{ME}/nonfinite/", f"{DA}/large_logits/", f"{MU}/large_logits/",
       f"{ME}/large_logits/", f"{ME}/eps_scale/", f"{DA}/large/", f"{MU}/large/", f"{ME}/large/",
       f"{DA}/empty_tokens/", f"{MU}/empty_tokens/", f"{ME}/empty_tokens/", f"{DA}/tuple_sources/",
       f"{MU}/tuple_sources/", f"{DA}/query_dtype/", f"{MU}/query_dtype/", f"errors/{ME}/", "determinism/",
       "invariants/"]
CONTROL = [f"{DA}/base/", f"{DA}/weights/", f"{MU}/base/", f"{ME}/base/", f"{DA}/shapes/N33-T3-D7/"]
#: The numpy reference's adapter returns d_query in float64 for a float32 query (C10.3 wants the
#: query's dtype); the backend-agnostic runs below leave that one cell out.

def failing(report):
    """{(row, dtype, column)} of the failing cells."""
    return {(r.row, r.dtype, col) for r in report.results
            for col, c in (("forward", r.forward), ("gradient", r.gradient)) if c is not None and c.status == "fail"}


def run(backend, dtypes=None, extra=()):
    return run_conformance(backend, dtypes=dtypes, select=NEW + CONTROL + list(extra))


def both(row, dtypes):
    return {(row, d, col) for d in dtypes for col in ("forward", "gradient")}


def test_every_hole_has_rows_in_every_op():
    ids = [c.id for c in cases.generate()]
    for prefix in NEW:
        assert any(i.startswith(prefix) for i in ids), prefix
    large = [i for i in ids if "/large/" in i]
    for op in (DA, MU):  # one case per op large in each axis (C16): N, D, tokens
        assert any(i.startswith(f"{op}/large/N300-") for i in large), op
        assert any(i.startswith(f"{op}/large/") and "-D4100/" in i for i in large), op
        assert any(i.startswith(f"{op}/large/") and "-T4096-" in i for i in large), op
    assert {f"{ME}/large/T2-D4100/float32", f"{ME}/large/T4096-D8/float32"} <= set(large)
    assert any(i.startswith("determinism/") and "T4096" in i for i in ids)
    for op in (DA, MU, ME):
        assert any(i.startswith(f"{op}/empty_tokens/") and "T0-" in i for i in ids), op


def test_honest_ports_pass_the_new_rows():
    rounding = run(adapters.rounding)
    assert not failing(rounding), failing(rounding)
    reference = run(adapters.reference, dtypes=("float64",))
    assert not failing(reference), failing(reference)
    assert reference.summary()["pass"] > 40


def test_nonfinite_inputs_replaced_c12():
    report = run(adapters.nan_to_num, dtypes=("float64",))
    assert failing(report) == (both(f"{DA}/nonfinite", ["float64"]) | both(f"{MU}/nonfinite", ["float64"])
                               | both(f"{ME}/nonfinite", ["float64"]))
    bad = next(r for r in report.results if r.id.startswith(f"{DA}/nonfinite/N4-T4"))
    assert "non-finite mismatches" in bad.forward.message


def test_nonfinite_spreading_to_other_tokens_c12():
    """One max over every token: exact for moderate finite logits, but one token's NaN reaches
    all (and tokens whose logits sit ~745 below another token's underflow to 0 / 0)."""
    report = run(adapters.global_max, dtypes=("float64",))
    rows = {row for row, _, _ in failing(report)}
    assert {f"{DA}/nonfinite", f"{MU}/nonfinite"} <= rows
    assert rows <= {f"{DA}/nonfinite", f"{MU}/nonfinite", f"{DA}/empty_tokens", f"{MU}/empty_tokens",
                    f"{DA}/large_logits"}, rows
    assert {r.id for r in report.results if r.failed and r.row == f"{DA}/large_logits"} <= {
        f"{DA}/large_logits/N5-T3-D64-z1000/float64"}
    clean = [r for r in report.results if r.row in (f"{DA}/base", f"{ME}/nonfinite")]
    assert clean and not any(r.failed for r in clean)


def test_softmax_without_max_subtraction_c10_4():
    report = run(adapters.no_max_subtraction)
    rows = {(row, d) for row, d, _ in failing(report)}
    for d in ("float64", "float32", "float16", "bfloat16"):
        assert (f"{DA}/large_logits", d) in rows, d
    for d in ("float32", "float16", "bfloat16"):  # exp(120) overflows float32 at N = 1 too
        assert ("invariants/identity", d) in rows and ("invariants/weights_sum", d) in rows, d
    assert (f"{MU}/large_logits", "float32") in rows
    assert {row for row, _ in rows} <= {f"{DA}/large_logits", f"{MU}/large_logits", "invariants/identity",
                                        "invariants/weights_sum"}, rows
    bad = next(r for r in report.results if r.id == f"{DA}/large_logits/N5-T3-D64-z120/float32")
    assert "non-finite" in bad.forward.message


def test_weights_from_a_separate_pass_c6():
    """At N = 1 weights must be exactly 1 (and lse = z_0): the torch fast paths' defect."""
    report = run(adapters.weights_from_separate_pass)
    assert failing(report) == {("invariants/identity", d, "forward") for d in ("float32", "float16", "bfloat16")}
    bad = next(r for r in report.results if r.failed)
    assert "weights exactly 1" in bad.forward.message


def test_merge_partial_ignores_eps_and_scale():
    report = run(adapters.merge_ignores_eps_scale, dtypes=("float64",))
    assert failing(report) == both(f"{ME}/eps_scale", ["float64"]) | {(f"errors/{ME}", "float64", "forward"),
                                                                     ("invariants/two_phase", "float64", "forward")}
    assert {r.id for r in report.results if r.failed and r.row == "invariants/two_phase"} == {
        "invariants/two_phase/N4-S2-T3-D16-eps1e-2-scale-1.5/float64"}  # its merges run at the defaults
    errors = {r.id for r in report.results if r.failed and r.row == f"errors/{ME}"}
    assert errors == {f"errors/{ME}/scale_nan/float64", f"errors/{ME}/eps_zero/float64"}


def test_merge_partial_norm_weight_unchecked():
    report = run(adapters.merge_unchecked_norm_weight, dtypes=("float64",))
    assert failing(report) == {(f"errors/{ME}", "float64", "forward")}
    assert {r.id for r in report.results if r.failed} == {f"errors/{ME}/norm_weight_shape/float64",
                                                          f"errors/{ME}/norm_weight_int/float64"}


def test_silent_cap_past_256_sources_c16():
    report = run(adapters.rounding_drop_past_256, dtypes=("float32",))
    assert failing(report) == (both(f"{DA}/large", ["float32"]) | both(f"{MU}/large", ["float32"])
                               | both(f"{DA}/weights", ["float32"]))
    assert {r.id for r in report.results if r.failed} == {f"{DA}/large/N300-T2-D8/float32",
                                                          f"{MU}/large/N300-S2-T2-D8/float32",
                                                          f"{DA}/weights/N300-T2-D8/float32"}


def test_key_norm_over_the_first_4096_channels_only():
    report = run(adapters.rounding_rms_over_first_4096, dtypes=("float32",))
    assert failing(report) == (both(f"{DA}/large", ["float32"]) | both(f"{MU}/large", ["float32"])
                               | both(f"{ME}/large", ["float32"]))
    assert all("D4100" in r.id for r in report.results if r.failed)


def test_key_norm_overflowing_in_float32():
    """mean(x^2) overflows float32 past |x| ~ 1e19: finite but uniform weights; the 1e20 rows
    hold values to the tolerance (the 1e30 rows check finiteness only, so this passes there)."""
    report = run_conformance(adapters.key_norm_overflow, select=["depth_attention/large_magnitude/"])
    failed = {r.id for r in report.results if r.failed}
    assert failed == {f"{DA}/large_magnitude/N5-T3-D64-x1e+20/float32", f"{DA}/large_magnitude/N5-T3-D64-x1e+20/bfloat16"}
    assert report.summary()["pass"] >= 12


def test_nondeterministic_only_at_large_token_counts_c15():
    report = run(adapters.nondeterministic_at_large_t, dtypes=("float32",))
    assert failing(report) == {("determinism", "float32", "gradient")}
    assert {r.id for r in report.results if r.failed} == {  # and the rows past 4096 (test_meta_round3)
        "determinism/depth_attention-N5-T4096-D16-lse/float32", "determinism/depth_attention-N5-T8200-D16-lse/float32",
        "determinism/depth_attention_multi-N5-S3-T8200-D16/float32", "determinism/merge_partial-T8200-D16/float32"}


def test_empty_token_axis_rejected():
    """A VJP that crashes at T = 0 (the forward works): the gradient cells fail, not the forward."""
    report = run(adapters.rejects_empty_tokens, dtypes=("float64",))
    assert failing(report) == {(f"{op}/empty_tokens", "float64", "gradient") for op in (DA, MU, ME)}
    bad = next(r for r in report.results if r.failed)
    assert bad.forward.status == "pass" and "ZeroDivisionError" in bad.gradient.message


def test_tuple_sources_rejected():
    report = run(adapters.rejects_tuples, dtypes=("float64",))
    assert failing(report) == both(f"{DA}/tuple_sources", ["float64"]) | both(f"{MU}/tuple_sources", ["float64"])


def test_query_in_another_dtype_rejected_c10_1():
    report = run(adapters.rejects_query_dtype)
    expected = both(f"{DA}/query_dtype", ["float64", "float32", "float16", "bfloat16"])
    assert failing(report) == expected | both(f"{MU}/query_dtype", ["float32"])


def test_out_returned_in_float32_for_low_precision_c10_3():
    report = run(adapters.float32_out, dtypes=("float32", "bfloat16"))
    bad = failing(report)
    assert bad and all(d == "bfloat16" for _, d, _ in bad), bad
    assert (f"{DA}/base", "bfloat16", "forward") in bad and (f"{ME}/base", "bfloat16", "forward") in bad
    # A gradient cell judges gradients only: the out dtype of the gradient call is the forward's finding.
    assert (f"{ME}/base", "bfloat16", "gradient") not in bad
    cell = report.cell(f"{DA}/base", "bfloat16", "forward")
    assert "C10.3: 'out' is float32, expected bfloat16" in cell.message and "rel_err" not in cell.message


def test_out_aliasing_the_source_at_n1_c7a():
    report = run(adapters.aliases_at_n1, dtypes=("float64",), extra=[f"{DA}/shapes/N1-T3-D7/"])
    assert failing(report) == {("invariants/identity", "float64", "forward"),
                               (f"{DA}/shapes", "float64", "forward")}  # gradients judge gradients only
    assert "C7a: 'out' share" in report.cell("invariants/identity", "float64", "forward").message


@pytest.mark.parametrize("backend", ["rounding", "reference"])
def test_missing_native_dtypes_is_a_failure_with_a_clear_message(backend, monkeypatch):
    inner = getattr(adapters, backend)
    real = type(inner).call_op

    def unreported(self, call):
        result = real(self, call)
        result.native_dtypes = {}
        return result

    monkeypatch.setattr(type(inner), "call_op", unreported)
    report = run_conformance(inner, dtypes=("float64",), select=[f"{DA}/base/"])
    cell = report.cell(f"{DA}/base", "float64", "forward")
    assert cell.status == "fail" and "adapter did not report the native dtype of 'out'" in cell.message
