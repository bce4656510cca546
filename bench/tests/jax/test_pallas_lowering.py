"""Every Pallas kernel lowers for TPU and GPU at the benchmark shapes, or the dispatch plan
(`Pallas().supports`) routes the shape to XLA: tested both ways (`bench/kernel_report.py`,
issue 13).  Lowered on the CPU for abstract bf16 inputs with
`jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`, no device needed.

* The plan accepts the shape -> the kernel must lower, with the tile and settings the resolved
  `Pallas` passes to it, with the lowering `pallas_call` uses for the kernels as they are called (on cuda: JAX's default, which
  is Mosaic GPU unless `jax_pallas_use_mosaic_gpu` is False).
* The plan refuses the shape -> the lowering the plan's reason is about must refuse it too
  (TPU: Mosaic; GPU: the Triton lowering, whose power-of-two rule the plan states).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

import kernel_report as report  # noqa: E402  (bench/ is on sys.path: bench/tests/conftest.py)

CASES = report.PALLAS_CASES


def _check(case, plan_platform, platform, refusal_lowering):
    reason, impl = report.pallas_plan(case, plan_platform)
    if reason is None:
        err = report.pallas_lower(case, platform, impl)
        assert err is None, (f"plan runs {case.name} on {plan_platform} with the Pallas kernel "
                             f"(TB = {impl.tile}), but the {platform} lowering refuses it: {err}")
    else:
        err = report.pallas_lower(case, platform, impl, refusal_lowering)
        assert err is not None, (f"plan routes {case.name} on {plan_platform} to XLA ({reason}), "
                                 f"but the kernel lowers for {platform} (TB = {impl.tile})")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tpu_lowering_matches_plan(case):
    _check(case, "tpu", "tpu", None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_lowering_matches_plan(case):
    _check(case, "gpu", "cuda", False)


def test_plan_refusal_is_exercised():
    # The "refused" branch above must run for at least one benchmark shape (D = 7168 on GPU).
    assert any(report.pallas_plan(c, "gpu")[0] is not None for c in CASES)
    assert any(report.pallas_plan(c, "gpu")[0] is None for c in CASES)


# -- the fused output norm (C17): the kernels' out-norm variants at the same shapes ---------------

NORMED_CASES = [c for c in CASES if c.kernel in ("forward", "backward")]


@pytest.fixture
def normed_kernels(monkeypatch):
    """`report.pallas_lower` lowers the out-norm variants: kernels.forward / backward called with
    out_norm_weight `[1, D]` (and d_normed `[T, D]` bf16), built inside the trace."""
    import jax.numpy as jnp
    from attnres_jax.kernels import pallas as kernels

    forward, backward = kernels.forward, kernels.backward

    def normed_forward(xs, qg, **kw):
        return forward(xs, qg, out_norm_weight=jnp.ones((1, qg.shape[1]), jnp.float32), out_norm_eps=1e-5, **kw)

    def normed_backward(xs, qg, d_out, *args, **kw):
        return backward(xs, qg, d_out, *args, out_norm_weight=jnp.ones((1, qg.shape[1]), jnp.float32),
                        out_norm_eps=1e-5, d_normed=jnp.zeros(d_out.shape, d_out.dtype), **kw)

    monkeypatch.setattr(kernels, "forward", normed_forward)
    monkeypatch.setattr(kernels, "backward", normed_backward)


def _check_normed(case, plan_platform, platform, refusal_lowering):
    from attnres_jax.kernels import pallas as kernels
    from attnres_jax.kernels.pallas import Pallas

    request = report.pallas_request(case, plan_platform)._replace(out_norm=True)
    reason, impl = Pallas().supports(request), Pallas().resolve(request)
    kernels.CALLS.clear()
    err = report.pallas_lower(case, platform, impl, None if reason is None else refusal_lowering)
    assert set(kernels.CALLS) == {f"attnres_{case.kernel}_normed"}  # the out-norm variant was built
    if reason is None:
        assert err is None, f"out-norm {case.name} on {platform} (TB = {impl.tile}): {err}"
    else:
        assert err is not None, f"plan refuses out-norm {case.name} on {plan_platform} ({reason}), but it lowers"


@pytest.mark.parametrize("case", NORMED_CASES, ids=lambda c: c.name)
def test_out_norm_tpu_lowering_matches_plan(case, normed_kernels):
    _check_normed(case, "tpu", "tpu", None)


@pytest.mark.parametrize("case", NORMED_CASES, ids=lambda c: c.name)
def test_out_norm_gpu_lowering_matches_plan(case, normed_kernels):
    _check_normed(case, "gpu", "cuda", False)


def test_tpu_grid_is_parallel():
    """The compiled TPU kernels declare their one grid axis (token tiles) parallel, so a megacore
    chip may split it over both TensorCores; each kernel's output blocks are the tile's own
    (rows, or one per-tile partial).  The lowering tests above lower every benchmark shape with
    these parameters."""
    from attnres_jax.kernels import pallas as kernels
    from attnres_jax.kernels.pallas import Pallas

    params = Pallas(platform="tpu", tile=8).kernel_options(None)["compiler_params"]
    assert tuple(params.dimension_semantics) == ("parallel",)
    assert Pallas(platform="gpu", tile=8).kernel_options(None)["compiler_params"].__class__.__name__ == "CompilerParams"
    assert Pallas(interpret="generic", tile=8).kernel_options(None)["compiler_params"] is None
    assert kernels._rows(8, 16).index_map(3) == (3, 0)  # tile t writes rows 8t .. 8t + 7 only


# -- lane-dense statistics: no `[T, 1]` column crosses a kernel's boundary ---------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tpu_kernels_move_no_narrow_statistics(case):
    """Each kernel's per-token statistics travel packed in one `[T, K]` array (`kernels.Columns`):
    on TPU a `[T, 1]` f32 array is padded 128x by the (8, 128) tiling (4 MiB at T = 8192).  The
    lowered custom call has no result whose last dim is 1, and at most one such operand (the
    merge's lse1, given by its caller); the old layout wrote 19 at N = 9, phase 1 116 at S = 12."""
    reason, impl = report.pallas_plan(case, "tpu")
    assert reason is None
    lowered, err = report.pallas_lowering(case, "tpu", impl)
    assert err is None, err
    ins, outs = report.pallas_narrow(lowered)
    assert outs == 0, f"{case.name}: {outs} results [T, 1]"
    assert ins == (1 if case.kernel == "merge" else 0), f"{case.name}: {ins} operands [T, 1]"


def test_narrow_count_sees_columns():
    """`pallas_narrow` counts `[*, 1]` operands and results of the custom call (the check above can fail)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref, c_ref):
        o_ref[...] = x_ref[...]
        c_ref[...] = jnp.sum(x_ref[...], axis=1, keepdims=True)

    spec, col = pl.BlockSpec((8, 128), lambda t: (t, 0)), pl.BlockSpec((8, 1), lambda t: (t, 0))
    f = lambda x: pl.pallas_call(kernel, grid=(2,), in_specs=[spec], out_specs=[spec, col],
                                 out_shape=[jax.ShapeDtypeStruct((16, 128), jnp.float32),
                                            jax.ShapeDtypeStruct((16, 1), jnp.float32)])(x)
    lowered = jax.jit(f).trace(jax.ShapeDtypeStruct((16, 128), jnp.float32)).lower(lowering_platforms=("tpu",))
    assert report.pallas_narrow(lowered) == (0, 1)


def test_gpu_kernels_compile_for_sm90_without_spills(tmp_path):
    """The Triton-lowered kernels the GPU plan runs at the benchmark shapes, compiled for sm_90 by
    Triton's own compiler and the ptxas of its wheel (the kernel IR taken from the lowered call,
    compiled in the torch env, which has Triton): no spills, 16-byte global loads.  The plan's
    earlier tile (TB = 16 rows at 4 warps at D = 4096) spilled 127 KB per thread in the forward."""
    import subprocess

    python = report._env_python("tests-torch")
    probe = subprocess.run([python, "-c", "import triton.backends.nvidia.compiler"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"{python} has no Triton with its CUDA backend to compile the Triton-lowered "
                    f"kernels (`nox -s tests-torch` makes that env)")
    rows = report.pallas_rows(CASES, targets=[t for t in report.PALLAS_TARGETS if t[3] is False],
                              torch_python=python, ir_dir=str(tmp_path))
    compiled = [r for r in rows if r.get("sm90")]
    assert {r["kernel"] for r in compiled} == {"forward", "backward", "merge"}, rows
    bad = [(r["case"], r["tile"], r["num_warps"], r["sm90"]) for r in compiled
           if "error" in r["sm90"] or r["sm90"]["spill_stores"] or r["sm90"]["spill_loads"]
           or max(map(int, r["sm90"]["loads"]), default=0) < 16]
    assert not bad, bad
