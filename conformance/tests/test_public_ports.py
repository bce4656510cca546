"""The public ports' adapters (`attnres_conformance.ports.{fla,attn_res,liger}`) and the compliance
table (`ports.compliance`, docs/ports.md).

The adapter tests need their port: `nox -s ports` installs the pinned releases and runs this
file; elsewhere each skips with the install line.  The table, its checks and the validation-gap
rule they rely on run everywhere, on stand-in ports built from the NumPy reference."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from importlib import metadata

import numpy as np
import pytest
from attnres_conformance.adapters.numpy import NumpyAdapter
from attnres_conformance.backend import Capabilities
from attnres_conformance.ports import compliance
from attnres_conformance.runner import parse_skips, run_conformance

PORTS = {p.key: p for p in compliance.PORTS}
SMALL = ["depth_attention/base/", "depth_attention/sources_past_32/"]


def _require(port_key: str, module: str):
    """The adapter module of a port, or a skip naming what to install."""
    port = PORTS[port_key]
    top = {"fla": "fla", "attn_res": "attn_res", "liger": "liger_kernel", "mlx_lm_k3": "mlx_lm"}[port.module]
    framework = "mlx" if port.module == "mlx_lm_k3" else "torch"
    if importlib.util.find_spec(framework) is None or importlib.util.find_spec(top) is None:
        with_torch = "" if framework == "mlx" else " with torch==2.13.0"
        pytest.skip(f"{port.package} is not installed here: `{port.install}`{with_torch} "
                    f"(`nox -s ports` installs every pinned port and runs this file)")
    return importlib.import_module(f"attnres_conformance.ports.{module}")


def _ran(report):
    return [r for r in report.results if r.status != "skip"]


# -- the adapters, where their port is installed ---------------------------------------------------
def test_fla_naive_adapter():
    adapter = _require("fla-0.6.0", "fla")
    caps = adapter.backend.capabilities()
    assert "float64" not in caps.dtypes and caps.out_norm_outputs == ("out_normed",) and not caps.validates_inputs
    report = run_conformance(adapter.backend, dtypes=["float32"], select=SMALL + ["depth_attention/out_norm/N5-T3-D16/"],
                             skips=parse_skips(adapter.SKIPS))
    assert len(_ran(report)) >= 4 and report.verdict() == "PASS", report.to_text()


def test_attn_res_adapter_serves_gain_and_scale_through_the_query():
    adapter = _require("attn-res-0.1.0", "attn_res")
    report = run_conformance(adapter.backend, dtypes=["float32"],
                             select=SMALL + ["depth_attention/eps_scale/", "depth_attention/stacked/"])
    assert len(_ran(report)) >= 5 and report.verdict() == "PASS", report.to_text()
    scaled = [r for r in report.results if r.row == "depth_attention/eps_scale" and r.status == "pass"]
    assert scaled and all(r.gradient.status == "pass" for r in scaled)  # d_query, d_norm_weight by the fold


def test_liger_adapter_and_the_release_installed():
    adapter = _require("liger-kernel-0.8.5", "liger")
    if not adapter.backend.is_available():
        pytest.skip("Liger-kernel's Triton kernels need CUDA or TRITON_INTERPRET=1 set before Triton is imported")
    assert adapter.backend.environment() in ({}, {"TRITON_INTERPRET": "1"})
    version = metadata.version("liger-kernel")
    report = run_conformance(adapter.backend, dtypes=["float32"], select=SMALL)
    past_32 = [r for r in report.results if r.row == "depth_attention/sources_past_32"]
    assert past_32 and all(r.status != "skip" for r in past_32)
    if version == "0.8.3":  # every source past 32 dropped
        assert all(r.failed for r in past_32) and report.verdict() == "FAIL"
    else:
        assert report.verdict() == "PASS", report.to_text()


def test_liger_declared_deviations_still_run_and_fail():
    """The adapter's xfail lines (C10.2 in float16, C10.6 at |x| >= 1e15): each case runs and fails
    as declared (a fix would be an XPASS), and the verdict names them."""
    adapter = _require("liger-kernel-0.8.5", "liger")
    if not adapter.backend.is_available():
        pytest.skip("Liger-kernel's Triton kernels need CUDA or TRITON_INTERPRET=1 set before Triton is imported")
    rules = parse_skips(adapter.SKIPS)
    assert {r.mode for r in rules} == {"xfail"} and all(r.reason.startswith(("C10.2:", "C10.6:")) for r in rules)
    report = run_conformance(adapter.backend, dtypes=["float32", "float16"], quick=True, skips=rules,
                             select=["depth_attention/base/N5-T3-D16/float16", "depth_attention/large_magnitude/"])
    xfails = [r for r in report.results if r.status == "xfail"]
    assert len(xfails) == 4 and not report.failed, report.to_text()
    assert report.verdict() == "PASS with 4 declared expected failures"


def test_mlx_lm_kimi_k3_adapter():
    adapter = _require("mlx-lm-0.32.2", "mlx_lm_k3")
    report = run_conformance(adapter.backend, dtypes=["float32"], select=SMALL + ["depth_attention/eps_scale/"])
    assert len(_ran(report)) >= 5 and report.verdict() == "PASS", report.to_text()


# -- what the table relies on, on stand-ins ----------------------------------------------------------
class Unchecked(NumpyAdapter):
    """A port that checks no argument: a bad call fails inside its framework, with its own error."""

    name = "unchecked"

    def capabilities(self):
        return Capabilities(dtypes=("float64",), ops=frozenset({"depth_attention"}), options=frozenset(),
                            validates_inputs=False)

    def call_op(self, call):
        try:
            return super().call_op(call)
        except (TypeError, ValueError) as exc:
            raise RuntimeError(f"internal: {exc}".replace("sources", "xs").replace("query", "q")) from None


def test_a_port_without_argument_checks_gets_validation_gaps_not_failures():
    report = run_conformance(Unchecked(), dtypes=["float64"], select=["errors/depth_attention/", "sequences/depth_attention/"])
    ran = _ran(report)
    assert ran and not report.failed, [r.forward.message for r in report.results if r.failed]
    assert {r.status for r in ran} == {"gap"} and {r.category for r in ran} == {"validation gap"}
    assert any("raised RuntimeError" in r.forward.message for r in ran)  # what it did is still said
    assert any(r.kind == "sequence" for r in ran)  # invalid scalars after valid calls: gaps too


class StandIn(NumpyAdapter):
    """The reference posing as a pinned port release (its versions), optionally dropping every
    source past 32 as Liger-kernel 0.8.3 did."""

    def __init__(self, port, truncate=False):
        super().__init__()
        self.port, self.truncate, self.name = port, truncate, port.key

    def capabilities(self):
        return Capabilities(dtypes=("float64",), ops=frozenset({"depth_attention"}), options=frozenset())

    def versions(self):
        return {self.port.package: self.port.version}

    def run_op(self, call, args, names):
        src = args["sources"]
        if self.truncate and isinstance(src, list) and len(src) > 32:
            outs, grads = super().run_op(call, dict(args, sources=src[:32]), names)
            if grads:
                grads["sources"] = list(grads["sources"]) + [np.zeros_like(s) for s in src[32:]]
            return outs, grads
        return super().run_op(call, args, names)


@pytest.fixture
def stand_in_reports(monkeypatch, tmp_path):
    monkeypatch.setattr(compliance, "skips_of", lambda port: "")  # the real adapters import torch
    reports = {}
    for port in compliance.PORTS:
        backend = StandIn(port, truncate=port.key == "liger-kernel-0.8.3")
        report = run_conformance(backend, dtypes=["float64"], select=SMALL + ["depth_attention/shapes/N33-T3-D7"])
        (tmp_path / f"{port.key}.json").write_text(json.dumps({"reports": [report.to_dict()]}))
    for key, report in compliance.load_all(tmp_path).items():  # through the JSON, as the session reads them
        reports[key] = report
    return reports


def test_the_table_is_rendered_from_the_reports(stand_in_reports):
    text = compliance.render(stand_in_reports)
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert len(rows) == len(compliance.PORTS)
    truncated = next(line for line in rows if "liger-kernel 0.8.3" in line)
    assert "**FAIL**" in truncated and "FAIL, off by" in truncated and "C1, C16 (" in truncated
    fixed = next(line for line in rows if "liger-kernel 0.8.4" in line)
    assert "**PASS**" in fixed and "pass, within" in fixed
    assert "coverage (cases run / cases in declared dtypes): " in text and "- install: `pip install" in text


def test_the_checks_bite(stand_in_reports, tmp_path):
    """A verdict or a documented defect that changes, a fixed rule that fails again, a wrong
    release, a table that differs: each is a failure of the session, with the reason."""
    problems = [p for port in compliance.PORTS for p in compliance.expectation_errors(port, stand_in_reports[port.key])]
    assert any(p.startswith("fla-0.6.0: verdict PASS, expected FAIL") for p in problems)
    assert any("attn-res-0.1.0: expected failures of" in p for p in problems)
    # a stand-in that passes outright is not the declared deviations the pin expects
    assert any(p.startswith("liger-kernel-0.8.4: verdict PASS, expected PASS with 4 declared expected failures")
               for p in problems)
    swapped = dict(stand_in_reports)
    swapped["liger-kernel-0.8.4"] = stand_in_reports["liger-kernel-0.8.3"]
    assert any("which this release does not break" in p
               for p in compliance.expectation_errors(PORTS["liger-kernel-0.8.4"], swapped["liger-kernel-0.8.4"]))
    assert compliance.contrast_errors(swapped) == ["liger-kernel-0.8.4 must not fail C1, C16"]
    assert compliance.contrast_errors(stand_in_reports) == []
    wrong = dataclasses.replace(PORTS["fla-0.6.0"], version="9.9")
    assert any("pinned 9.9" in p for p in compliance.expectation_errors(wrong, stand_in_reports["fla-0.6.0"]))
    table = tmp_path / "ports.md"
    assert "differs from this run's table" in compliance.table_problem(table, stand_in_reports)
    assert compliance.table_problem(table, stand_in_reports, write=True) is None
    assert compliance.table_problem(table, stand_in_reports) is None
    table.write_text(table.read_text().replace("**FAIL**", "**PASS**", 1))
    assert "differs" in compliance.table_problem(table, stand_in_reports)
    missing = {k: v for k, v in stand_in_reports.items() if k != "attn-res-0.1.0"}
    assert "no report of attn-res-0.1.0" in compliance.table_problem(table, missing)


def test_the_committed_table_names_every_pinned_port():
    """docs/ports.md is generated (`nox -s ports` checks it equals its run's table): every pinned
    port has its row, and the noxfile installs the pins the table names."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    text = open(os.path.join(root, "docs", "ports.md")).read()
    nox_text = open(os.path.join(root, "noxfile.py")).read()
    assert text.startswith("# Public ports: compliance table") and "Do not edit by hand" in text
    for port in compliance.PORTS:
        assert f"| {port.package} {port.version} |" in text
        if not port.separate:
            assert f'"{port.package}=={port.version}"' in nox_text
