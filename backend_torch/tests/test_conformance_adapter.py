"""The suite's torch adapter (`attnres_conformance.ports.attnres_torch`): capabilities, strided views,
inputs read back, gradients by name, native dtypes, aliases, which implementation ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attnres_conformance.backend import Backend, OpCall
from attnres_conformance.ports.attnres_torch import backend
from attnres_core.config import VARIANT_KINDS
from attnres_numpy import ops as ref
from attnres_torch import dispatch


def test_protocol_and_capabilities():
    assert isinstance(backend, Backend) and backend.name == "torch"
    caps = backend.capabilities()
    assert set(caps.dtypes) == {"float64", "float32", "float16", "bfloat16"}
    assert caps.variants == frozenset(VARIANT_KINDS) and "cpu" in caps.devices
    assert "torch" in backend.versions()


def test_fused_kernel_declared_where_one_serves():
    """`fused_kernel`: the C kernel serves the CPU (unless unavailable), Triton serves CUDA."""
    caps = backend.capabilities()
    triton = torch.cuda.is_available() and dispatch.availability()["triton"] is None
    assert caps.fused_kernel == (dispatch.availability()["cpu_c"] is None or triton)


def test_fused_kernel_true_exactly_when_it_serves_the_calls():
    """A float32 forward on the CPU runs on `cpu_c` exactly when `fused_kernel` says so, and
    `implementations_used` counts it (calls since the adapter was created)."""
    from attnres_conformance.ports.attnres_torch import AttnresTorch

    adapter = AttnresTorch()
    assert adapter.implementations_used() == {}
    fused = adapter.capabilities().fused_kernel
    adapter.call_op(OpCall("depth_attention", {"sources": [np.ones((3, 8))] * 2, "query": np.ones(8),
                                               "norm_weight": None}, dtype="float32"))
    used = adapter.implementations_used()
    assert sum(used.values()) == 1 and (used.get("cpu_c") == 1) == fused


@pytest.mark.parametrize("stacked", [False, True])
def test_strided_call_with_gradients(stacked):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 4, 6)).astype(np.float32).astype(np.float64)
    q, g = rng.standard_normal(6) * 0.5, rng.random(6) + 0.5
    d_out, d_lse = rng.standard_normal((4, 6)), rng.standard_normal(4)
    sources = xs if stacked else list(xs)
    call = OpCall("depth_attention", {"sources": sources, "query": q, "norm_weight": g},
                  attrs={"return_lse": True}, dtype="float32", strided=True,
                  cotangents={"out": d_out, "lse": d_lse})
    res = backend.call_op(call)
    r_out, r_lse = ref.depth_attention(sources, q, g, return_lse=True)
    np.testing.assert_allclose(res.outputs["out"], r_out, atol=1e-5)
    np.testing.assert_allclose(res.outputs["lse"], r_lse, atol=1e-5)
    v = ref.depth_attention_vjp(sources, q, g, d_out.astype(np.float32), d_lse.astype(np.float32))
    np.testing.assert_allclose(np.asarray(res.grads["sources"]), np.asarray(v["sources"]), atol=1e-4)
    np.testing.assert_allclose(res.grads["query"], v["query"], atol=1e-4)
    assert isinstance(res.grads["sources"], list) != stacked
    np.testing.assert_array_equal(np.asarray(res.inputs_after["sources"]), xs)


def test_bad_input_raises_framework_error():
    call = OpCall("depth_attention", {"sources": [np.ones((2, 4))], "query": np.ones(4),
                                      "norm_weight": None}, input_dtypes={"query": "int32"})
    with pytest.raises(TypeError, match="query: expected a floating"):
        backend.call_op(call)


def test_native_dtypes_and_aliases(monkeypatch):
    """C10.3 dtypes are reported before read-back; an output sharing an input's storage (C7a) is
    named in `aliases` (shown with an op that returns its source, the N = 1 shortcut C7a forbids)."""
    xs = [np.ones((2, 4))]
    call = OpCall("depth_attention", {"sources": xs, "query": np.ones(4), "norm_weight": None},
                  attrs={"return_lse": True}, dtype="bfloat16",
                  cotangents={"out": np.ones((2, 4)), "lse": np.ones(2)})
    res = backend.call_op(call)
    assert res.native_dtypes == {"out": "bfloat16", "lse": "float32", "grad.sources": ["bfloat16"],
                                 "grad.query": "bfloat16", "grad.norm_weight": None}
    assert res.aliases == ()
    from types import SimpleNamespace
    monkeypatch.setattr(backend, "ops", SimpleNamespace(depth_attention=lambda s, q, g, **kw: s[0][:1]))
    res = backend.call_op(OpCall("depth_attention", {"sources": xs, "query": np.ones(4), "norm_weight": None}))
    assert res.aliases == ("out",)
