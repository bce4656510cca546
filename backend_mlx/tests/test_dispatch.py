"""The public backend contract (`attnres_mlx.dispatch`)."""

import mlx.core as mx
import numpy as np
import pytest
from attnres_mlx import dispatch, ops
from attnres_mlx.kernels import metal

D = 8


def _args(dtype=mx.float32):
    x = mx.array(np.linspace(-1.0, 1.0, 2 * D).reshape(2, D)).astype(dtype)
    return [x, 2 * x], mx.zeros((D,), dtype=dtype)


def _every_op(dtype=mx.float32):
    """One call of each op; returns the Choice each recorded."""
    sources, q = _args(dtype)
    choices = []
    mx.eval(ops.depth_attention(sources, q))
    choices.append(dispatch.last_choice())
    out1, lse1 = ops.depth_attention_multi(sources, mx.zeros((2, D), dtype=dtype))
    mx.eval(out1, lse1)
    choices.append(dispatch.last_choice())
    mx.eval(ops.merge_partial(out1[0], lse1[0], sources[0], q))
    choices.append(dispatch.last_choice())
    return choices


def test_availability_and_capabilities():
    avail = dispatch.availability()
    assert tuple(avail) == dispatch.IMPLEMENTATIONS == ("metal", "compiled")
    assert avail["compiled"] is None
    on_metal = mx.metal.is_available() and mx.default_device() == mx.gpu
    assert (avail["metal"] is None) == on_metal
    if not mx.metal.is_available():
        assert avail["metal"] == "not Apple silicon / Metal unavailable"
    caps = dispatch.capabilities()
    assert set(caps) == {"dtypes", "devices", "fused_kernel", "deterministic"}
    assert caps["fused_kernel"] is on_metal and caps["deterministic"] is True
    assert caps["devices"] == (("gpu",) if on_metal else ("cpu",))
    assert ("float64" in caps["dtypes"]) is not on_metal
    assert {"float16", "bfloat16", "float32"} <= set(caps["dtypes"])


def test_every_op_records_its_choice_and_count():
    before = dispatch.impl_counts()
    with dispatch.use_impl("compiled"):
        choices = _every_op()
    assert [c.op for c in choices] == list(dispatch.OPS)
    assert {c.impl for c in choices} == {"compiled"}
    after = dispatch.impl_counts()
    assert after["compiled"] - before["compiled"] == 3
    assert after["metal"] == before["metal"]
    after["compiled"] += 100  # a copy: the registry's counts are not reachable from outside
    assert dispatch.impl_counts()["compiled"] == before["compiled"] + 3


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the refusal where Metal is absent")
def test_forced_metal_without_metal_raises_naming_it():
    sources, q = _args()
    with dispatch.use_impl("metal"):
        with pytest.raises(ValueError, match="use_impl: implementation 'metal' cannot serve "
                                             "depth_attention \\(float32 sources\\): not Apple "
                                             "silicon / Metal unavailable"):
            ops.depth_attention(sources, q)
        out1 = mx.zeros((2, D))
        with pytest.raises(ValueError, match="'metal' cannot serve merge_partial"):
            ops.merge_partial(out1, mx.zeros((2,)), sources[0], q)


def test_forced_metal_leaves_float64_to_compiled(monkeypatch):
    """The documented exception: float64 under use_impl("metal") runs on compiled, with metal's
    refusal recorded (Metal made available here so only the dtype refuses)."""
    monkeypatch.setattr(metal.IMPLEMENTATION, "unavailable", lambda: None)
    with dispatch.use_impl("metal"), mx.stream(mx.cpu):
        choices = _every_op(mx.float64)
    for choice in choices:
        assert choice.impl == "compiled"
        assert choice.refused == (("metal", "Metal has no float64 (C10)"),)
