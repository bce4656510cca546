"""The Metal kernels' logic, run through the real dispatch in `ops` with `mx.fast.metal_kernel`
replaced by the C++ emulator (`metal_emulator.py`): float32 vs the float64 reference.

This is what is verifiable on Linux; the same checks against real Metal are `test_metal.py`."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
import test_ops
import test_out_norm
import test_router
from attnres_mlx import dispatch, ops
from attnres_mlx.kernels import metal
from metal_emulator import Emulator

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


def _clear_caches():
    """The kernel caches hold kernels built by whichever `mx.fast.metal_kernel` was installed."""
    for fn in (metal._attend_kernel, metal._merge_kernel):
        fn.cache_clear()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("metal-emu"))


@pytest.fixture
def emulator(monkeypatch, workdir):
    """`mx.fast.metal_kernel` replaced by the emulator (the implementation is not forced)."""
    emu = Emulator(workdir)
    monkeypatch.setattr(mx.fast, "metal_kernel", emu.metal_kernel)
    monkeypatch.setattr(metal, "INIT_VALUE", float("nan"))
    _clear_caches()
    yield emu
    _clear_caches()


@pytest.fixture
def emulated(emulator, monkeypatch):
    """The emulator, and every call Metal supports (all but float64) forced onto the kernels
    (Metal reported available: the emulator stands in for it)."""
    monkeypatch.setattr(metal.IMPLEMENTATION, "unavailable", lambda: None)
    with dispatch.use_impl("metal"):
        yield emulator


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("case", sorted(test_ops.CASES))
def test_attend_kernels(emulated, case, stacked):
    test_ops.test_depth_attention_forward_and_vjp(case, "float32", stacked, "vectorized")
    assert emulated.calls["attnres_attend_fwd"] >= 1
    assert emulated.calls["attnres_attend_bwd"] >= 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_attend_kernels_low_precision_storage(emulated, dtype):
    test_ops.test_depth_attention_forward_and_vjp("heads", dtype, False, "vectorized")
    assert emulated.calls["attnres_attend_bwd"] >= 1


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("case", ["plain", "heads", "heads_per_token", "sigmoid", "no_key_norm",
                                  "eps_scale", "one_source"])
def test_out_norm_kernels(emulated, case, stacked):
    """C17 through the kernels: out_normed from the forward pass, the d_y prologue and d w in
    the backward pass (one threadgroup per token serves its H heads), NaN-poisoned outputs."""
    test_out_norm.run(case, "float32", stacked)  # the forward runs eagerly and inside mx.vjp
    assert emulated.calls["attnres_attend_fwd"] == 2 and emulated.calls["attnres_attend_bwd"] == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_out_norm_kernels_low_precision(emulated, dtype):
    test_out_norm.run("heads_per_token", dtype, False)
    test_out_norm.run("no_gain", dtype, True)  # a float32 out-norm weight with dtype sources
    assert emulated.calls["attnres_attend_bwd"] == 2


def test_out_norm_kernels_wide_heads(emulated, monkeypatch):
    """Dh = 40 (K = 2 channels per lane, lanes 8..31 masked in the second), H = 2, D = 80."""
    monkeypatch.setattr(test_out_norm, "D", 80)
    monkeypatch.setattr(test_out_norm, "BATCH", (2,))
    monkeypatch.setattr(test_ops, "D", 80)
    monkeypatch.setattr(test_ops, "BATCH", (2,))
    test_out_norm.run("heads", "float32", False)
    assert emulated.calls["attnres_attend_bwd"] == 1


@pytest.mark.parametrize("magnitude", [1e19, 1e30])
def test_out_norm_kernels_huge_out(emulated, magnitude):
    test_out_norm.run("heads", "float32", False, seed=5, scale=magnitude)
    assert emulated.calls["attnres_attend_bwd"] == 1


@pytest.mark.parametrize("case", ["heads_per_token", "sigmoid"])
def test_out_norm_kernels_leave_out_unchanged(emulated, case):
    test_out_norm.test_out_unchanged_by_the_option(case)
    assert emulated.calls["attnres_attend_fwd"] == 2


def test_out_norm_kernels_only_out_has_a_cotangent(emulated):
    test_out_norm.test_only_out_has_a_cotangent()
    assert emulated.calls["attnres_attend_bwd"] == 2


def test_out_norm_kernels_empty_token_axis(emulated):
    test_out_norm.test_empty_token_axis()
    assert emulated.calls["attnres_attend_bwd"] == 1


def test_out_norm_kernels_deterministic(emulated):
    first = test_out_norm.run("heads_per_token", "float32", False)
    second = test_out_norm.run("heads_per_token", "float32", False)
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert mx.array_equal(a, b).item()
    assert emulated.calls["attnres_attend_bwd"] == 2


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_multi_kernels(emulated, stacked):
    test_ops.test_depth_attention_multi("float32", stacked, True)
    assert emulated.calls["attnres_attend_fwd"] >= 1 and emulated.calls["attnres_attend_bwd"] >= 1


@pytest.mark.parametrize("per_token", [False, True], ids=["pseudo", "per_token"])
def test_merge_kernels(emulated, per_token):
    test_ops.test_merge_partial("float32", per_token, True)
    assert emulated.calls["attnres_merge_fwd"] >= 1 and emulated.calls["attnres_merge_bwd"] >= 1


def test_two_phase_probe_through_kernels(emulated):
    """Phase 1 and merge kernels inside the two-phase schedule (float32 vs the reference)."""
    cfg = test_router.ResidualConfig.variant("block", block_size=3)
    rng, params, emb, w = test_router._probe_inputs(cfg, "float32", 1, 6)
    mparams = {k: test_ops.to_mx(v, "float32") for k, v in params.items()}
    out = test_router.probe.probe_forward(cfg, mparams, test_ops.to_mx(emb, "float32"),
                                          test_ops.to_mx(w, "float32"), schedule="two_phase")
    test_ops.assert_close("out", out, test_router.ref_model.probe_forward(cfg, params, emb, w),
                          grad=False, override="probe")
    assert emulated.calls["attnres_merge_fwd"] >= 1 and emulated.calls["attnres_attend_fwd"] >= 1


@pytest.mark.parametrize("one_array", [False, True], ids=["list", "one_stacked_array"])
def test_cached_inverse_rms_kernels(emulated, one_array):
    """Cached r through the kernels (float32 here: the emulator has no float64); one stacked
    `[N, ..., H]` r for stacked sources reaches the kernels as one r per source."""
    rng = np.random.default_rng(7)
    sources = [test_ops.rand(rng, (2, 3, 8), "float32") for _ in range(3)]
    query, gain = test_ops.rand(rng, (8,), "float32"), test_ops.rand(rng, (8,), "float32")
    cot = test_ops.rand(rng, (2, 3, 8), "float32")
    xs = ([test_ops.to_mx(np.stack(sources), "float32")] if one_array
          else [test_ops.to_mx(s, "float32") for s in sources])

    def f(*xs):
        if one_array:
            x, rms = xs[0], ops.inverse_rms(xs[0], num_heads=2)
        else:
            x, rms = list(xs), [ops.inverse_rms(x, num_heads=2) for x in xs[:-1]] + [None]
        return [ops.depth_attention(x, test_ops.to_mx(query, "float32"),
                                    test_ops.to_mx(gain, "float32"), num_heads=2, inv_rms=rms)]

    outs, grads = mx.vjp(f, xs, [test_ops.to_mx(cot, "float32")])
    test_ops.assert_close("out", outs[0], test_ops.ref.depth_attention(
        sources, query, gain, num_heads=2), grad=False)
    g = test_ops.ref.depth_attention_vjp(sources, query, gain, cot, num_heads=2)
    for i in range(3):
        test_ops.assert_close(f"d sources[{i}]", grads[0][i] if one_array else grads[i],
                              g["sources"][i], grad=True)
    assert emulated.calls["attnres_attend_fwd"] >= 1


@pytest.mark.parametrize("variant", ["multihead", "input_query", "sigmoid"])
def test_probe_through_kernels(emulated, variant):
    """Cached block r, partial sums, per-token queries, sigmoid: every parameter gradient."""
    test_router.test_probe_forward_and_vjp(variant, "float32")
    assert emulated.calls["attnres_attend_bwd"] >= 1


def test_backward_runs_where_the_forward_chose(emulator, monkeypatch):
    """The implementation is chosen once per call: a backward computed after the forcing
    context has closed still runs the kernels its forward ran (and is correct)."""
    rng = np.random.default_rng(8)
    sources = [test_ops.rand(rng, (2, 3, 8), "float32") for _ in range(3)]
    query, cot = test_ops.rand(rng, (8,), "float32"), test_ops.rand(rng, (2, 3, 8), "float32")

    def f(*xs):
        with dispatch.use_impl("metal"):
            return [ops.depth_attention(list(xs), test_ops.to_mx(query, "float32"))]

    with monkeypatch.context() as m:
        m.setattr(metal.IMPLEMENTATION, "unavailable", lambda: None)  # the emulator stands in
        outs, grads = mx.vjp(f, [test_ops.to_mx(s, "float32") for s in sources],
                             [test_ops.to_mx(cot, "float32")])
        assert dispatch.last_choice().impl == "metal"
    mx.eval(outs, grads)  # evaluated after the forcing context has closed
    assert emulator.calls["attnres_attend_fwd"] == 1 and emulator.calls["attnres_attend_bwd"] == 1
    g = test_ops.ref.depth_attention_vjp(sources, query, None, cot)
    for i in range(3):
        test_ops.assert_close(f"d sources[{i}]", grads[i], g["sources"][i], grad=True)


def test_forced_metal_leaves_float64_to_the_compiled_path(emulated):
    with mx.stream(mx.cpu):  # float64 exists on the CPU device only
        x = mx.ones((2, 8), dtype=mx.float64)
        mx.eval(ops.depth_attention([x, x], mx.zeros((8,), dtype=mx.float64)))
    assert not emulated.calls
    assert dispatch.last_choice().impl == "compiled"
    x = mx.ones((2, 8), dtype=mx.bfloat16)
    mx.eval(ops.depth_attention([x, x], mx.zeros((8,), dtype=mx.bfloat16)))
    assert dispatch.last_choice().impl == "metal" and emulated.calls["attnres_attend_fwd"] == 1
