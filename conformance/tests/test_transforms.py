"""Issue 44 item 1: the transforms (`attnres_conformance.transforms`) over the suite's cases."""

import dataclasses

import numpy as np
from attnres_conformance import cases, transforms
from attnres_conformance.adapters.numpy import NumpyAdapter
from attnres_conformance.coverage import coverage_text
from attnres_conformance.mutants import ReferencePort
from attnres_conformance.runner import run_conformance


def test_every_transform_makes_cases_and_quick_is_a_subset():
    full = [c for c in cases.generate(sweep=False) if c.id.startswith("transforms/")]
    made = {c.spec["transform"] for c in full}
    assert made == set(transforms.BY_NAME)
    quick = [c for c in cases.generate(quick=True, sweep=False) if c.id.startswith("transforms/")]
    assert {c.id for c in quick} <= {c.id for c in full}
    assert {c.spec["transform"] for c in quick} == set(transforms.BY_NAME)  # a smoke test of each
    assert {c.dtype for c in quick} == {"float32"}


def test_layout_array_builds_the_views_it_names():
    port = NumpyAdapter()
    v = np.arange(24.0).reshape(2, 3, 4)
    for layout, axis, check in (
            ("token_strided", 1, lambda a: a.strides[1] == 2 * 4 * 8),
            ("source_strided", 0, lambda a: a.strides[0] == 2 * 12 * 8),
            ("transposed", 0, lambda a: a.strides[0] < a.strides[1]),
            ("offset", 0, lambda a: a.__array_interface__["data"][0] != a.base.__array_interface__["data"][0]),
            ("channel_strided", 0, lambda a: a.strides[-1] == 16)):
        a = port.layout_array(v, "float64", "cpu", layout, axis)
        assert np.array_equal(a, v) and check(a), layout
    q = np.broadcast_to(np.arange(4.0), (2, 3, 4))
    e = port.layout_array(q, "float64", "cpu", "expanded")
    assert np.array_equal(e, q) and e.strides[:2] == (0, 0)


def test_transform_results_are_reported_by_family_and_respect_capabilities():
    caps = ReferencePort().capabilities()
    no_strides = dataclasses.replace(caps, options=caps.options - {"strided"}, scale=1.0)

    class Port(ReferencePort):
        def capabilities(self):
            return no_strides

    report = run_conformance(Port(), dtypes=("float64",), quick=True, select=["transforms/"])
    assert not report.failed
    text = coverage_text(report.results, report.capabilities)
    assert "transforms: layouts 0/" in text and "transforms: special values" in text
    skipped = {r.id.split("/")[1]: r.forward.message for r in report.results if r.status == "skip"}
    assert "option strided not declared" in skipped["offset"]
    assert "fixed at 1" in skipped["scale_zero"]  # the transform's point is never adapted away
    ran = {r.id.split("/")[1] for r in report.results if r.status == "pass"}
    assert {"decode_batch", "zero_query", "gain_dtype"} <= ran
