"""The real Metal kernels (Apple silicon only; skipped elsewhere by conftest.py).

NOT RUN where this was written (Linux, no Metal).  Same checks as `test_metal_emulated.py`,
against the float64 reference, with NaN-poisoned outputs and a spy proving the kernels ran."""

from collections import Counter

import mlx.core as mx
import pytest
import test_ops
import test_out_norm
import test_router
from attnres_mlx import dispatch, ops
from attnres_mlx.kernels import metal

pytestmark = pytest.mark.metal


@pytest.fixture
def kernels(monkeypatch):
    calls = Counter()
    launch = metal._launch

    def spy(kernel, *args, **kw):
        calls[kernel] += 1
        return launch(kernel, *args, **kw)

    monkeypatch.setattr(metal, "_launch", spy)
    monkeypatch.setattr(metal, "INIT_VALUE", float("nan"))
    for fn in (metal._attend_kernel, metal._merge_kernel):
        fn.cache_clear()
    yield calls
    for fn in (metal._attend_kernel, metal._merge_kernel):
        fn.cache_clear()


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", sorted(test_ops.CASES))
def test_attend_kernels(kernels, case, dtype, stacked):
    test_ops.test_depth_attention_forward_and_vjp(case, dtype, stacked)
    assert sum(kernels.values()) >= 2  # forward and backward launches


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", ["plain", "heads", "heads_per_token", "sigmoid", "no_gain",
                                  "one_source"])
def test_out_norm_kernels(kernels, case, dtype, stacked):
    """C17: out_normed from the forward kernel, the d_y prologue and d w from the backward."""
    test_out_norm.run(case, dtype, stacked)
    test_out_norm.run("heads", "float32", False, seed=5, scale=1e30)  # the scaled-sum path
    assert sum(kernels.values()) >= 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_phase_kernels(kernels, dtype):
    test_ops.test_depth_attention_multi(dtype, False, True)
    test_ops.test_merge_partial(dtype, True, True)
    assert sum(kernels.values()) >= 4


@pytest.mark.parametrize("variant", ["multihead", "input_query", "sigmoid", "block"])
def test_probe_through_kernels(kernels, variant):
    test_router.test_probe_forward_and_vjp(variant, "float32")
    assert sum(kernels.values()) >= 2


def test_metal_is_the_automatic_choice_on_the_gpu():
    assert mx.default_device() == mx.gpu
    assert dispatch.availability() == {"metal": None, "compiled": None}
    x = mx.ones((2, 8))
    mx.eval(ops.depth_attention([x, x], mx.zeros((8,))))
    assert dispatch.last_choice() == ("depth_attention", "metal", ())
    with mx.stream(mx.cpu):
        x = mx.ones((2, 8), dtype=mx.float64)
        mx.eval(ops.depth_attention([x, x], mx.zeros((8,), dtype=mx.float64)))
    assert dispatch.last_choice().refused == (("metal", "Metal has no float64 (C10)"),)


def test_kernels_deterministic(kernels):
    test_transforms = pytest.importorskip("test_transforms")
    test_transforms.test_deterministic_and_inputs_unmodified("float32")
    assert sum(kernels.values()) >= 2
    assert mx.metal.is_available()
