"""The suite as an outside porter meets it: a port with minimal capabilities (depth_attention only,
no lse / weights / stacked / strided) still runs the shape grid, magnitudes, non-finite inputs
and gradients (degraded, not skipped), the verdict states its coverage, design choices are
declared, error cases ask the port's own API in its own names, and a silent source cap is named
as one."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from attnres_conformance.adapters.numpy import NumpyAdapter
from attnres_conformance.backend import Capabilities
from attnres_conformance.runner import run_conformance

F64 = ("float64",)
MINIMAL = Capabilities(dtypes=F64, ops=frozenset({"depth_attention"}), options=frozenset())


class MinimalPort(NumpyAdapter):
    """The reference behind a minimal declaration; the op is called with only the keywords of
    the port's API (`Adapter.declared_attrs`), which the test checks."""

    name = "minimal"
    caps = MINIMAL
    seen: set = set()

    def capabilities(self):
        return self.caps

    def run_op(self, call, args, names):
        attrs = self.declared_attrs(call)
        MinimalPort.seen |= set(attrs)
        return super().run_op(dataclasses.replace(call, attrs=attrs), args, names)


class Truncating(MinimalPort):
    """Drops every source past 32, forward and backward (Liger-kernel 0.8.3's defect)."""

    def run_op(self, call, args, names):
        src = args["sources"]
        if isinstance(src, list) and len(src) > 32:
            outs, grads = super().run_op(call, dict(args, sources=src[:32]), names)
            if grads:
                grads["sources"] = list(grads["sources"]) + [np.zeros_like(s) for s in src[32:]]
            return outs, grads
        return super().run_op(call, args, names)


class RenamedArguments(MinimalPort):
    """Raises the spec's errors with its own argument name "xs" for "sources"."""

    arg_names = {"sources": "xs"}

    def call_op(self, call):
        try:
            return super().call_op(call)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("sources", "xs")) from None


class Limited(MinimalPort):
    """Forward only, at most 8 sources, enforced with a ValueError (C16)."""

    caps = dataclasses.replace(MINIMAL, max_sources=8, backward=False)

    def run_op(self, call, args, names):
        if len(args["sources"]) > 8:
            raise ValueError(f"sources: at most 8 sources, got {len(args['sources'])}")
        return super().run_op(call, args, names)


def ran(report, row):
    return [r for r in report.results if r.row == row and r.status != "skip"]


def test_minimal_port_runs_the_core_families_and_passes():
    MinimalPort.seen = set()
    report = run_conformance(MinimalPort(), dtypes=F64)
    assert not report.failed, [r.id for r in report.results if r.failed]
    assert report.verdict() == "PASS" and report.incomplete == []
    # The shape grid (24 cases, N up to 130), magnitudes, non-finite and large sizes run without lse.
    assert len(ran(report, "depth_attention/shapes")) == 24
    for row in ("depth_attention/large_magnitude", "depth_attention/nonfinite", "depth_attention/large_logits",
                "depth_attention/sources_past_32"):
        assert ran(report, row), row
    adapted = [r for r in ran(report, "depth_attention/shapes") if r.adapted]
    assert adapted and all("without lse" in r.adapted[0] for r in adapted)
    # The rows whose point is lse or weights are skipped with the reason, not degraded.
    assert not ran(report, "depth_attention/lse") and not ran(report, "invariants/weights_sum")
    # The port's function saw only keywords of its API (no num_heads, activation, return_lse ...).
    assert MinimalPort.seen <= {"eps", "scale"}
    text = report.to_text()
    assert "verdict: PASS" in text and "coverage (cases run / cases in declared dtypes): every-port rows" in text


def test_silent_source_cap_fails_with_its_rule():
    report = run_conformance(Truncating(), dtypes=F64, quick=True)
    failed = {r.row for r in report.results if r.failed}
    assert "depth_attention/sources_past_32" in failed and "depth_attention/shapes" in failed
    assert report.verdict() == "FAIL"
    sentinel = next(r for r in report.results if r.row == "depth_attention/sources_past_32" and r.failed)
    assert "C1, C16" in sentinel.describe() and sentinel.category == "numerical"


@pytest.mark.parametrize("port, says", [(Truncating, "silently drops every source past 32"),
                                        (MinimalPort, "computes all 33 sources correctly")])
def test_a_declared_limit_not_enforced_says_what_the_port_did(port, says):
    capped = type("Capped", (port,), {"caps": dataclasses.replace(MINIMAL, max_sources=32)})()
    report = run_conformance(capped, dtypes=F64, select=["errors/depth_attention/max_sources_plus_1"])
    (result,) = report.results
    assert result.failed and says in result.forward.message


def test_incomplete_and_nothing_checked_are_not_a_pass():
    report = run_conformance(Limited(), dtypes=F64, quick=True)
    assert not report.failed and report.verdict() == "INCOMPLETE" and not report.ok()
    assert any("N >= 33" in reason for reason in report.incomplete)
    assert report.ok(accept_incomplete=True)
    nothing = type("Nothing", (MinimalPort,), {"caps": dataclasses.replace(MINIMAL, ops=frozenset())})()
    report = run_conformance(nothing, dtypes=F64, quick=True)
    assert report.verdict() == "NOTHING CHECKED" and not report.ok(accept_incomplete=True)


def test_errors_in_the_ports_own_names_and_api():
    report = run_conformance(RenamedArguments(), dtypes=F64, select=["errors/"])
    errors = [r for r in report.results if r.status != "skip"]
    assert errors and not report.failed, [r.forward.message for r in report.results if r.failed]
    skipped = {r.id.split("/")[2] for r in report.results if r.status == "skip"}
    assert {"heads_zero", "activation", "key_norm_int", "stacked_1d"} <= skipped  # options never declared
    plain = type("Plain", (RenamedArguments,), {"arg_names": {}})()
    report = run_conformance(plain, dtypes=F64, select=["errors/depth_attention/empty_sources"])
    assert report.failed and report.results[0].category == "error contract"


def test_design_choices_fit_the_cases():
    """A port with a fixed scale 1 and no gain: cases run at scale 1 without norm_weight; the
    rows about the scale are skipped with the reason."""
    caps = dataclasses.replace(MINIMAL, scale=1.0, gain=False)
    report = run_conformance(type("Fixed", (MinimalPort,), {"caps": caps})(), dtypes=F64, quick=True)
    assert not report.failed and report.verdict() == "PASS"
    skipped = [r for r in report.results if r.row == "depth_attention/eps_scale"]
    assert skipped and all(r.status == "skip" and "fixed at 1" in r.forward.message for r in skipped)
    sweep_like = [r for r in report.results if r.status != "skip" and r.adapted]
    assert any("without norm_weight" in note for r in sweep_like for note in r.adapted)


def test_cli_finds_an_adapter_module_in_the_current_directory(tmp_path):
    """`attnres-conformance --backend my_port:backend` from the folder holding my_port.py, as the
    porting guide says (console scripts do not put the current directory on sys.path)."""
    (tmp_path / "my_port.py").write_text(textwrap.dedent("""
        from attnres_conformance.adapters.numpy import NumpyAdapter
        backend = NumpyAdapter()
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTNRES_BACKEND")}
    code = "import sys; from attnres_conformance.cli import main; sys.path[:] = [p for p in sys.path if p]; " \
           "sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "--backend", "my_port:backend", "--quick", "--dtype",
                           "float64", "--select", "depth_attention/base", "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "verdict: PASS" in proc.stdout


@pytest.mark.parametrize("options, outputs", [(frozenset(), ("out", "out_normed")),
                                              (frozenset({"out_norm"}), ("out_normed",))])
def test_cotangent_rows_run_without_a_fused_norm_the_port_lacks_or_hides_out_behind(options, outputs):
    """The bad-cotangent rows of 'out' and 'lse' carry the fused norm as an extra: a port without
    the option, or whose fused norm returns out_normed alone (FLA's), runs them without it
    (adapted, not skipped); the out_normed row stays the norm's, skipped where it is undeclared."""
    port = MinimalPort()
    port.caps = dataclasses.replace(MINIMAL, options=options | {"lse"}, out_norm_outputs=outputs)
    report = run_conformance(port, select=["cotangents/depth_attention/"], dtypes=F64)
    by_output = {}
    for r in report.results:
        by_output.setdefault(r.id.split("/")[2].split("-")[0], []).append(r)
    adapted = ("out", "lse") if "out_norm" not in options else ("out",)  # lse exists beside out_normed
    for output in ("out", "lse"):
        assert all(r.status == "pass" and any("without out_norm" in a for a in r.adapted) == (output in adapted)
                   for r in by_output[output]), report.to_text()
    normed = by_output["out_normed"]
    assert all(r.status == ("pass" if "out_norm" in options else "skip") for r in normed), report.to_text()
