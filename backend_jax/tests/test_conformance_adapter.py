"""The suite's JAX adapter (`attnres_conformance.ports.attnres_jax`) honours the `Backend` protocol."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from attnres_conformance.backend import OPS, OPTIONS, Backend, OpCall, ProbeCall
from attnres_conformance.ports.attnres_jax import backend
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_numpy import model as ref_model
from attnres_numpy import ops as ref


def test_protocol_and_capabilities():
    assert isinstance(backend, Backend) and backend.name == "jax" and backend.is_available()
    caps = backend.capabilities()
    assert set(caps.dtypes) == {"float64", "float32", "float16", "bfloat16"}
    assert caps.ops == frozenset(OPS) and caps.options == frozenset(OPTIONS)
    assert caps.variants == frozenset(VARIANT_KINDS) and caps.deterministic
    assert {"jax", "attnres_jax"} <= set(backend.versions())


@pytest.mark.parametrize("dtype, strided, stacked", [("float64", True, False), ("float32", False, True),
                                                     ("bfloat16", True, True)])
def test_call_op_depth_attention(rng, dtype, strided, stacked):
    def draw(shape):  # float64 values exactly representable in dtype (as the suite sends them)
        return np.asarray(rng.standard_normal(shape).astype(jax.numpy.dtype(dtype)), np.float64)

    xs = [draw((3, 8)) for _ in range(4)]
    q, g = draw(8), None
    d_out, d_lse = draw((3, 8)), rng.standard_normal((3, 2)).astype(np.float32).astype(np.float64)
    sources = np.stack(xs) if stacked else xs
    call = OpCall("depth_attention", dict(sources=sources, query=q, norm_weight=g),
                  dict(num_heads=2, return_lse=True, return_weights=True), dtype=dtype, strided=strided,
                  cotangents={"out": d_out, "lse": d_lse})
    x64_before = jax.config.jax_enable_x64
    result = backend.call_op(call)
    assert jax.config.jax_enable_x64 == x64_before  # x64 only inside the call
    kappa = "float64" if dtype == "float64" else "float32"  # C10.3: lse/weights in kappa
    assert result.native_dtypes == {"out": dtype, "lse": kappa, "weights": kappa, "grad.sources":
                                    dtype if stacked else [dtype] * 4, "grad.query": dtype,
                                    "grad.norm_weight": None}
    assert result.aliases == ()
    want = ref.depth_attention(sources, q, g, num_heads=2, return_lse=True, return_weights=True)
    tol = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2}[dtype]
    for name, value in zip(("out", "lse", "weights"), want):
        assert result.outputs[name].dtype == (np.float64 if dtype == "float64" else np.float32)
        np.testing.assert_allclose(result.outputs[name], value, atol=tol * 4)
    grads = ref.depth_attention_vjp(sources, q, g, d_out, d_lse, num_heads=2)
    assert isinstance(result.grads["sources"], list) != stacked
    np.testing.assert_allclose(np.stack(result.grads["sources"]), np.stack(grads["sources"]), atol=tol * 10)
    np.testing.assert_allclose(result.grads["query"], grads["query"], atol=tol * 30)
    assert result.grads["norm_weight"] is None
    np.testing.assert_array_equal(np.stack(result.inputs_after["sources"]), np.stack(xs))


def test_call_op_errors_propagate():
    call = OpCall("depth_attention", dict(sources=[np.ones((2, 4))] * 3, query=np.ones(4), norm_weight=None),
                  {}, input_dtypes={"query": "int32"})
    with pytest.raises(TypeError, match="query"):
        backend.call_op(call)
    call = OpCall("merge_partial", dict(out1=np.ones((3, 4)), lse1=np.zeros(2), partial=np.ones((2, 4)),
                                        query=np.ones(4), norm_weight=None), {})
    with pytest.raises(ValueError, match="out1"):
        backend.call_op(call)


def test_call_op_multi_and_merge(rng):
    xs = [rng.standard_normal((3, 8)) for _ in range(4)]
    qs, gs = rng.standard_normal((2, 8)), rng.standard_normal((2, 8))
    d_out, d_lse = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3))
    res = backend.call_op(OpCall("depth_attention_multi", dict(sources=xs, queries=qs, norm_weights=gs),
                                 dict(scale=0.5), dtype="float64", cotangents={"out": d_out, "lse": d_lse}))
    want = ref.depth_attention_multi_vjp(xs, qs, gs, d_out, d_lse, scale=0.5)
    np.testing.assert_allclose(res.outputs["out"], ref.depth_attention_multi(xs, qs, gs, scale=0.5)[0], atol=1e-12)
    np.testing.assert_allclose(res.grads["queries"], want["queries"], atol=1e-11)
    res = backend.call_op(OpCall("merge_partial", dict(out1=xs[0], lse1=rng.standard_normal(3), partial=xs[1],
                                                       query=qs[0], norm_weight=gs[0]),
                                 dict(return_lse=True), dtype="float32", strided=True,
                                 cotangents={"out": d_out[0], "lse": d_lse[0]}))
    assert set(res.grads) == {"out1", "lse1", "partial", "query", "norm_weight"}
    assert set(res.outputs) == {"out", "lse"}


@pytest.mark.parametrize("schedule", ["direct", "two_phase"])
def test_call_probe(rng, schedule):
    config = ResidualConfig.variant("block", block_size=2)
    params = {k: rng.standard_normal(s) for k, s in config.param_shapes(4, 8).items()}
    emb, w, cot = rng.standard_normal((3, 8)), rng.standard_normal((4, 8, 8)) / 3, rng.standard_normal((3, 8))
    res = backend.call_probe(ProbeCall(config.to_dict(), params, emb, w, dtype="float64", schedule=schedule,
                                       cotangent=cot))
    np.testing.assert_allclose(res.out, ref_model.probe_forward(config, params, emb, w), atol=1e-12)
    want = ref_model.probe_vjp(config, params, emb, w, cot)
    assert set(res.grads) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(res.grads[name], value, atol=1e-10)


def test_compiled_once_per_structure_and_counted(rng):
    """Equal call structures reuse one compiled function (the suite's speed); other shapes or
    attrs compile anew; every op call is counted under the implementation that ran (xla here)."""
    from attnres_conformance.ports.attnres_jax import AttnresJax

    adapter = AttnresJax()

    def call(d, scale=1.0, cot=True):
        xs = [rng.standard_normal((3, d)) for _ in range(2)]
        return OpCall("depth_attention", dict(sources=xs, query=rng.standard_normal(d), norm_weight=None),
                      dict(scale=scale), dtype="float32",
                      cotangents={"out": rng.standard_normal((3, d))} if cot else None)

    first = adapter.call_op(call(8))
    assert len(adapter._cache) == 1  # the forward and the pullback: one program
    second = adapter.call_op(call(8))
    assert len(adapter._cache) == 1 and not np.array_equal(first.outputs["out"], second.outputs["out"])
    adapter.call_op(call(8, scale=2.0))
    adapter.call_op(call(4))
    adapter.call_op(call(4, cot=False))
    assert len(adapter._cache) == 4
    assert adapter.implementations_used() == {"xla": 5}


def test_compile_options(monkeypatch):
    """The suite compiles with XLA's fast-compile options unless told otherwise; a bad value is an
    error naming the variable, never a silent default."""
    from attnres_conformance.adapters import jax as adapter_mod

    monkeypatch.delenv("ATTNRES_CONFORMANCE_JAX_COMPILE", raising=False)
    assert adapter_mod.compiler_options() == adapter_mod.FAST_COMPILE
    monkeypatch.setenv("ATTNRES_CONFORMANCE_JAX_COMPILE", "default")
    assert adapter_mod.compiler_options() is None
    monkeypatch.setenv("ATTNRES_CONFORMANCE_JAX_COMPILE", "O0")
    with pytest.raises(ValueError, match="ATTNRES_CONFORMANCE_JAX_COMPILE"):
        adapter_mod.JaxAdapter()
