"""C17, the fused output norm: the honest ports pass its rows, and a port with one out-norm
defect (`adapters.py`) fails exactly the cells that defect reaches and no other."""

import adapters
from attnres_conformance import cases
from attnres_conformance.runner import run_conformance

DA = "depth_attention"
ROW, GOLDEN = f"{DA}/out_norm", f"golden/{DA}"
SELECT = [f"{ROW}/", f"{GOLDEN}/", f"errors/{DA}/out_norm", "determinism/depth_attention-N6-T2x3-D8-H2-outnorm",
          f"{DA}/base/", f"{DA}/heads/"]
DTYPES = ("float64", "float32", "float16", "bfloat16")


def failing(report):
    return {(r.row, r.dtype, col) for r in report.results
            for col, c in (("forward", r.forward), ("gradient", r.gradient)) if c is not None and c.status == "fail"}


def run(backend, dtypes=("float64",)):
    report = run_conformance(backend, dtypes=dtypes, select=SELECT)
    assert report.summary()["skip"] == 0
    return report


def test_rows_cover_the_option():
    ids = [c.id for c in cases.generate()]
    labels = {i.split("/")[2] for i in ids if i.startswith(f"{ROW}/")}
    for part in ("H2", "H5", "sigmoid", "tokq", "N1-", "x1e+20", "T0", "out_norm_eps", "weight_float64",
                 "D4100"):
        assert any(part in label for label in labels), part
    for dtype in DTYPES:
        assert sum(i.startswith(f"{ROW}/") and i.endswith(f"/{dtype}") for i in ids) >= 10, dtype
        assert sum(i.startswith(f"errors/{DA}/out_norm") and i.endswith(f"/{dtype}") for i in ids) == 6, dtype
    quick = {c.id for c in cases.generate(quick=True)}
    assert len([i for i in quick if i.startswith(f"{ROW}/") and i.endswith("/float32")]) == 2


def test_honest_ports_pass():
    reference = run(adapters.reference)
    assert not failing(reference), failing(reference)
    assert reference.summary()["pass"] > 20
    rounding = run(adapters.rounding, DTYPES)
    assert not failing(rounding), failing(rounding)


def test_out_normed_per_head():
    """The out-norm rows (each dtype has heads cases) and the float32 golden vector with heads
    fail in the forward column (a gradient cell judges gradients only, and this port's VJP is
    right); the H = 1 golden vectors of the other dtypes, the errors and determinism pass."""
    report = run(adapters.rounding_out_norm_per_head, DTYPES)
    cols = ("forward",)
    expected = {(ROW, d, c) for d in DTYPES for c in cols} | {(GOLDEN, "float32", c) for c in cols}
    assert failing(report) == expected
    assert "out_normed" in report.cell(ROW, "float32", "forward").message


def test_d_out_norm_weight_dropped():
    report = run(adapters.drops_out_norm_weight_grad)
    assert failing(report) == {(ROW, "float64", "gradient"), (GOLDEN, "float64", "gradient")}
    message = report.cell(ROW, "float64", "gradient").message
    assert "gradient 'out_norm_weight' missing" in message and "d_sources" not in message


def test_d_out_normed_not_folded_into_d_out():
    report = run(adapters.ignores_out_normed_cotangent)
    assert failing(report) == {(ROW, "float64", "gradient"), (GOLDEN, "float64", "gradient")}
    message = report.cell(ROW, "float64", "gradient").message
    assert "d_sources" in message and "d_out_norm_weight" not in message
