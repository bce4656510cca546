"""The fused C kernels (`kernels/cpu_c.py`, `kernels/csrc/depth_cpu.c`: forward, backward,
phase 1, merge): built here, chosen by the dispatch, write every element (NaN-poisoned buffers),
match the float64 reference at block/tile/lane edges, give the same bits on any thread count, and
fall back to the chunked kernel without a compiler."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import attnres_torch as at
import numpy as np
import pytest
import torch
from _helpers import assert_close, compute_dtype, f64, rand
from attnres_numpy import ops as ref
from attnres_torch.kernels import cpu_c

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: (N, T, D): one source; lane tail (D % 16); D = 1; past one 512-column tile with a tail;
#: T past 256 blocks of 16 rows (the block cap, uneven blocks); N past 32.
SHAPES = [(1, 3, 7), (3, 5, 17), (2, 9, 1), (4, 6, 1000), (3, 4133, 5), (33, 3, 64)]


def test_kernel_is_built_on_this_machine():
    """CI and the benchmarks need the C path: a missing compiler must fail here, not fall back
    silently."""
    assert cpu_c.unavailable_reason() is None
    x = [torch.randn(4, 8) for _ in range(2)]
    before = at.impl_counts()["cpu_c"]
    at.depth_attention(x, torch.randn(8))
    assert at.last_impl() == "cpu_c" and at.impl_counts()["cpu_c"] == before + 1


def _rows_of(t: torch.Tensor, pad: int) -> torch.Tensor:
    """t `[T, D]` stored inside wider rows `[T, D + pad]` (row stride D + pad, unit stride)."""
    wide = torch.full((t.shape[0], t.shape[1] + pad), float("nan"), dtype=t.dtype)
    wide[:, pad // 2: pad // 2 + t.shape[1]] = t
    return wide[:, pad // 2: pad // 2 + t.shape[1]]


@pytest.mark.parametrize("dtype", list(NAMES))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{n}-T{t}-D{d}" for n, t, d in SHAPES])
@pytest.mark.parametrize("per_token", [False, True])
def test_forward_backward_write_every_element(dtype, shape, per_token):
    n, t, d = shape
    gen = torch.Generator().manual_seed(n * 1000 + d)
    xs = [_rows_of(rand(gen, (t, d), dtype), 6) for _ in range(n)]  # row-strided in NaN padding
    qg = rand(gen, (t, d) if per_token else (d,), torch.float32, 0.5)
    out = _rows_of(torch.full((t, d), float("nan"), dtype=dtype), 4)
    lse = torch.full((t,), float("nan"))
    cpu_c.forward_into(xs, qg, 1e-6, 0.9, out, lse)
    r_out, r_lse = ref.depth_attention(f64(xs), f64(qg), None, scale=0.9, return_lse=True)
    name = NAMES[dtype]
    assert_close(out, r_out, name, "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(name), "lse", grad=False)
    d_out = rand(gen, (t, d), dtype)
    d_lse = rand(gen, (t,), torch.float32)
    d_src = [_rows_of(torch.full((t, d), float("nan"), dtype=dtype), 2) for _ in xs]
    d_qg = cpu_c.backward_into(xs, qg, lse, d_out, d_lse, 1e-6, 0.9, d_src)
    v = ref.depth_attention_vjp(f64(xs), f64(qg), None, f64(d_out), f64(d_lse), scale=0.9)
    assert_close(d_src, v["sources"], name, "d_sources", grad=True)
    assert_close(d_qg, v["query"], name, "d_qg", grad=True)
    d_src_no_lse = [torch.full((t, d), float("nan"), dtype=dtype) for _ in xs]
    d_qg = cpu_c.backward_into(xs, qg, lse, d_out, None, 1e-6, 0.9, d_src_no_lse)
    v = ref.depth_attention_vjp(f64(xs), f64(qg), None, f64(d_out), None, scale=0.9)
    assert_close(d_src_no_lse, v["sources"], name, "d_sources (no d_lse)", grad=True)
    assert_close(d_qg, v["query"], name, "d_qg (no d_lse)", grad=True)


MULTI_SHAPES = [(1, 1, 3, 7), (3, 4, 5, 17), (2, 12, 600, 1000), (5, 3, 4133, 5)]


@pytest.mark.parametrize("dtype", list(NAMES))
@pytest.mark.parametrize("shape", MULTI_SHAPES, ids=[f"N{n}-S{q}-T{t}-D{d}" for n, q, t, d in MULTI_SHAPES])
def test_phase1_writes_every_element(dtype, shape):
    n, num_q, t, d = shape
    gen = torch.Generator().manual_seed(n * 100 + num_q)
    xs = [_rows_of(rand(gen, (t, d), dtype), 6) for _ in range(n)]
    qgs = rand(gen, (num_q, d), torch.float32, 2.0 / d ** 0.5)
    out = torch.full((num_q, t, d), float("nan"), dtype=dtype)
    lse = torch.full((num_q, t), float("nan"))
    cpu_c.multi_forward_into(xs, qgs, 1e-6, 0.9, out, lse)
    r_out, r_lse = ref.depth_attention_multi(f64(xs), f64(qgs), None, scale=0.9)
    assert_close(out, r_out, NAMES[dtype], "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(NAMES[dtype]), "lse", grad=False)


@pytest.mark.parametrize("dtype", list(NAMES))
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("t,d", [(3, 7), (4133, 24), (5, 1000)])
def test_merge_writes_every_element(dtype, per_token, t, d):
    gen = torch.Generator().manual_seed(t + d)
    out1 = _rows_of(rand(gen, (t, d), dtype), 4)
    partial = _rows_of(rand(gen, (t, d), dtype), 2)
    lse1 = rand(gen, (t,), torch.float32, 3.0)
    qg = rand(gen, (t, d) if per_token else (d,), torch.float32, 2.0 / d ** 0.5)
    out = _rows_of(torch.full((t, d), float("nan"), dtype=dtype), 6)
    lse = torch.full((t,), float("nan"))
    cpu_c.merge_forward_into(out1, lse1, partial, qg, 1e-6, 0.9, out, lse)
    r_out, r_lse = ref.merge_partial(f64(out1), f64(lse1), f64(partial), f64(qg), None, scale=0.9,
                                     return_lse=True)
    assert_close(out, r_out, NAMES[dtype], "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(NAMES[dtype]), "lse", grad=False)


def test_two_phase_on_the_c_kernels_equals_direct():
    gen = torch.Generator().manual_seed(5)
    blocks = [rand(gen, (2, 40, 96), torch.bfloat16) for _ in range(4)]
    partial = rand(gen, (2, 40, 96), torch.bfloat16)
    qs, gs = rand(gen, (3, 96), torch.float32, 0.2), torch.rand(3, 96, generator=gen) + 0.5
    with torch.no_grad():
        out1, lse1 = at.depth_attention_multi(blocks, qs, gs)
        assert at.last_impl() == "cpu_c"
        for s in range(3):
            merged = at.merge_partial(out1[s], lse1[s], partial, qs[s], gs[s])
            assert at.last_impl() == "cpu_c"
            r = ref.depth_attention(f64(blocks + [partial]), f64(qs[s]), f64(gs[s]))
            assert_close(merged, r, "bfloat16", "merged", grad=False)


def _fwd_bwd(xs, qg, d_out):
    out, lse = torch.empty_like(xs[0]), torch.empty(xs[0].shape[0])
    cpu_c.forward_into(xs, qg, 1e-6, 1.0, out, lse)
    d_src = [torch.empty_like(x) for x in xs]
    d_qg = cpu_c.backward_into(xs, qg, lse, d_out, None, 1e-6, 1.0, d_src)
    m_out, m_lse = torch.empty(3, *xs[0].shape), torch.empty(3, xs[0].shape[0])
    cpu_c.multi_forward_into(xs, torch.stack([qg.reshape(-1, qg.shape[-1])[0]] * 3) * torch.arange(
        1.0, 4.0)[:, None], 1e-6, 1.0, m_out, m_lse)
    g_out, g_lse = torch.empty_like(xs[0]), torch.empty(xs[0].shape[0])
    cpu_c.merge_forward_into(out, lse, xs[1], qg, 1e-6, 1.0, g_out, g_lse)
    return [out, lse, d_qg, m_out, m_lse, g_out, g_lse] + d_src


@pytest.mark.parametrize("per_token", [False, True])
def test_bits_do_not_depend_on_the_thread_count(per_token):
    """C15: rows are cut into blocks fixed by T; threads take runs of blocks; the shared query's
    gradient is summed block by block in block order."""
    gen = torch.Generator().manual_seed(8)
    xs = [rand(gen, (1037, 40), torch.float32) for _ in range(5)]
    qg = rand(gen, (1037, 40) if per_token else (40,), torch.float32, 0.5)
    d_out = rand(gen, (1037, 40), torch.float32)
    threads = torch.get_num_threads()
    try:
        runs = []
        for k in (1, 2, 3, 7):
            torch.set_num_threads(k)
            runs.append(_fwd_bwd(xs, qg, d_out))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not cpu_c._has_avx512bw(), reason="the 16-lane build needs AVX-512 F and BW")
@pytest.mark.parametrize("per_token", [False, True])
def test_bfloat16_runs_on_the_16_lane_build_with_thread_independent_bits(per_token):
    """On AVX-512 hosts bf16 sources take the 16-lane build (row sums blocked by 32: D = 1000
    has a 32-lane body and an 8-element tail), fp32/fp16 the 8-lane one; C15 holds for it.
    (Its values against the float64 reference: the bf16 cases of the tests above, which
    dispatch to it.)"""
    assert (cpu_c.vector_width(torch.bfloat16), cpu_c.vector_width(torch.float32),
            cpu_c.vector_width(torch.float16)) == (16, 8, 8)
    gen = torch.Generator().manual_seed(9)
    xs = [rand(gen, (517, 1000), torch.bfloat16) for _ in range(4)]
    qg = rand(gen, (517, 1000) if per_token else (1000,), torch.float32, 0.05)
    d_out = rand(gen, (517, 1000), torch.bfloat16)

    def run():
        out, lse = torch.full_like(xs[0], float("nan")), torch.full((517,), float("nan"))
        cpu_c.forward_into(xs, qg, 1e-6, 1.0, out, lse)
        d_src = [torch.full_like(x, float("nan")) for x in xs]
        d_qg = cpu_c.backward_into(xs, qg, lse, d_out, None, 1e-6, 1.0, d_src)
        return [out, lse, d_qg] + d_src

    threads = torch.get_num_threads()
    try:
        runs = []
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            runs.append(run())
    finally:
        torch.set_num_threads(threads)
    assert all(bool(t.isfinite().all()) for t in runs[0])  # every element written
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_huge_page_advice_changes_no_bits():
    """Opt-in MADV_HUGEPAGE on outputs >= 8 MiB (here [2048, 1040] fp32 = 8.1 MiB, a 2 MiB-aligned
    interior exists): same bits as without."""
    gen = torch.Generator().manual_seed(6)
    xs = [rand(gen, (2048, 1040), torch.float32) for _ in range(3)]
    qg, d_out = rand(gen, (1040,), torch.float32, 0.05), rand(gen, (2048, 1040), torch.float32)
    plain = _fwd_bwd(xs, qg, d_out)
    cpu_c.set_hugepages(True)
    try:
        huge = _fwd_bwd(xs, qg, d_out)
    finally:
        cpu_c.set_hugepages(False)
    for a, b in zip(plain, huge):
        assert torch.equal(a, b)


def test_populate_changes_no_bits():
    """The default MADV_POPULATE_WRITE of fresh outputs and gradients (>= 1 MiB: here
    [1024, 1040] fp32 = 4.1 MiB, split over the threads) gives the same bits as without it, and
    the switch reaches the library."""
    gen = torch.Generator().manual_seed(7)
    xs = [rand(gen, (1024, 1040), torch.float32) for _ in range(3)]
    qg, d_out = rand(gen, (1040,), torch.float32, 0.05), rand(gen, (1024, 1040), torch.float32)
    assert cpu_c.library() is not None and cpu_c._state["populate"] is True  # on by default
    populated = _fwd_bwd(xs, qg, d_out)
    cpu_c.set_populate(False)
    try:
        assert cpu_c._state["populate"] is False
        plain = _fwd_bwd(xs, qg, d_out)
    finally:
        cpu_c.set_populate(True)
    for a, b in zip(plain, populated):
        assert torch.equal(a, b)


def test_specials_propagate_per_token_and_large_values_stay_finite():
    """C12: a NaN or Inf in one token's source reaches that token only; |x| = 1e30 overflows the
    fp32 sum of squares (r = 0) but every output stays finite."""
    xs = [torch.randn(5, 33) for _ in range(3)]
    xs[1][2, 3] = float("nan")
    xs[2][4, 0] = float("inf")
    out, lse = torch.empty(5, 33), torch.empty(5)
    cpu_c.forward_into(xs, torch.randn(33), 1e-6, 1.0, out, lse)
    assert torch.isnan(out[2]).all() and not torch.isfinite(out[4]).all()
    assert torch.isfinite(out[[0, 1, 3]]).all()
    big = [torch.randn(3, 64) * 1e30 for _ in range(5)]
    out, lse = torch.empty(3, 64), torch.empty(3)
    cpu_c.forward_into(big, torch.randn(64), 1e-6, 1.0, out, lse)
    d_src = [torch.empty(3, 64) for _ in big]
    d_qg = cpu_c.backward_into(big, torch.randn(64), lse, torch.randn(3, 64), None, 1e-6, 1.0, d_src)
    assert all(torch.isfinite(t).all() for t in [out, lse, d_qg] + d_src)


def test_bad_buffers_are_named():
    xs = [torch.randn(4, 8) for _ in range(2)]
    q = torch.randn(8)
    with pytest.raises(TypeError, match="out: expected torch.float32, got torch.bfloat16"):
        cpu_c.forward_into(xs, q, 1e-6, 1.0, torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(4))
    with pytest.raises(ValueError, match=r"sources\[1\]: expected unit stride"):
        cpu_c.forward_into([xs[0], torch.randn(4, 16)[:, ::2]], q, 1e-6, 1.0, torch.empty(4, 8),
                           torch.empty(4))
    with pytest.raises(ValueError, match=r"lse: expected shape \(4,\) on cpu, got \(5,\)"):
        cpu_c.forward_into(xs, q, 1e-6, 1.0, torch.empty(4, 8), torch.empty(5))
    with pytest.raises(ValueError, match=r"d_sources\[0\]: expected"):
        cpu_c.backward_into(xs, q, torch.zeros(4), torch.randn(4, 8), None, 1e-6, 1.0,
                            [torch.empty(4, 7), torch.empty(4, 8)])


def test_broadcast_cotangent_through_autograd():
    """`out.sum()` hands the backward a stride-0 d_out: it is made unit-stride, not misread."""
    gen = torch.Generator().manual_seed(2)
    xs = [rand(gen, (6, 12), torch.float32).requires_grad_(True) for _ in range(3)]
    q = rand(gen, (12,), torch.float32, 0.5).requires_grad_(True)
    at.depth_attention(xs, q).sum().backward()
    assert at.last_impl() == "cpu_c"
    v = ref.depth_attention_vjp(f64(xs), f64(q), None, np.ones((6, 12)))
    assert_close([x.grad for x in xs], v["sources"], "float32", "d_sources", grad=True)
    assert_close(q.grad, v["query"], "float32", "d_query", grad=True)


@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
def test_zero_tokens(impl):
    """T = 0: empty outputs and gradients, zero query/gain gradients, on both CPU kernels."""
    xs = [torch.randn(0, 8, requires_grad=True) for _ in range(3)]
    q, g = torch.randn(8, requires_grad=True), torch.ones(8, requires_grad=True)
    with at.use_impl(impl):
        out, lse = at.depth_attention(xs, q, g, return_lse=True)
        assert at.last_impl() == impl
        (out.sum() + lse.sum()).backward()  # stride-0 cotangents of an empty tensor
        out1, lse1 = at.depth_attention_multi([x.detach() for x in xs], torch.randn(2, 8))
    assert out.shape == (0, 8) and lse.shape == (0,) and out1.shape == (2, 0, 8)
    assert all(x.grad.shape == (0, 8) for x in xs)
    assert torch.equal(q.grad, torch.zeros(8)) and torch.equal(g.grad, torch.zeros(8))


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=300)


_PROBE = """
    import torch, attnres_torch as at
    from attnres_torch.kernels import cpu_c
    at.depth_attention([torch.randn(3, 8) for _ in range(2)], torch.randn(8))
    print(at.last_impl(), '|', cpu_c.unavailable_reason())
"""


def test_builds_into_the_cache_dir(tmp_path):
    res = _python(_PROBE, ATTNRES_CACHE_DIR=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("|")[0].strip() == "cpu_c"
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]  # one library, no temp files left


def test_openmp_build_shares_torchs_libgomp():
    """Built with -fopenmp, the kernel's threads come from the libgomp torch already loaded: one
    OpenMP runtime in the process, not a second team competing for the cores."""
    assert cpu_c.build_flags()[-1] == "-fopenmp"
    at.depth_attention([torch.randn(64, 8) for _ in range(2)], torch.randn(8))
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_portable_build_without_march_native(tmp_path):
    """The second flag set (no -march=native: SSE2 on x86-64, no F16C) builds a correct kernel."""
    code = """
        import numpy as np, torch
        from attnres_torch.kernels import cpu_c
        from attnres_numpy import ops as ref
        cpu_c.FLAG_SETS = (("-O3",),)
        gen = torch.Generator().manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
            xs = [torch.randn(37, 100, generator=gen).to(dtype) for _ in range(5)]
            qg = torch.randn(100, generator=gen) * 0.2
            out, lse = torch.full((37, 100), float("nan"), dtype=dtype), torch.empty(37)
            cpu_c.forward_into(xs, qg, 1e-6, 1.0, out, lse)
            r = ref.depth_attention([x.double().numpy() for x in xs], qg.double().numpy(), None)
            err = np.abs(out.double().numpy() - r).max() / (1 + np.abs(r).max())
            assert err < tol, (dtype, err)
        print("ok", cpu_c.library()._name)
    """
    res = _python(code, ATTNRES_CACHE_DIR=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok") and str(tmp_path) in res.stdout


@pytest.mark.parametrize("env,reason", [({"ATTNRES_TORCH_CPU_C": "0"}, "disabled"),
                                        ({"CC": "/nonexistent/cc"}, "could not build")])
def test_falls_back_to_the_chunked_kernel(tmp_path, env, reason):
    res = _python(_PROBE, ATTNRES_CACHE_DIR=str(tmp_path), **env)
    assert res.returncode == 0, res.stderr
    impl, why = (s.strip() for s in res.stdout.split("|"))
    assert impl == "chunked" and reason in why
