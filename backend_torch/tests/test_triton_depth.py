"""Triton depth-attention kernels against the float64 reference, on CPU under TRITON_INTERPRET=1
(set before Triton is imported: `test_triton_subprocess.py` runs this module in a subprocess, so
the interpreter never leaks into other test modules; `TRITON_INTERPRET=1 pytest` on this file
runs it directly).

Every call runs with NaN-poisoned output/workspace buffers (`_alloc` patched), counts its kernel
launches (`_launch` patched; the pointer-table fills, which a cached table skips, apart), and compares every output and every gradient (random cotangents,
d_lse included) with `attnres_numpy.ops` on the float64 upcast of the same inputs.  Tilings are
forced small so that tiny shapes still cover several D tiles, several query groups, several row
blocks per backward program and several backward programs.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before Triton is imported: test_triton_subprocess.py "
                "runs this module in such a subprocess", allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

import attnres_torch as at  # noqa: E402
from _helpers import assert_close, compute_dtype, f64, leaves, rand  # noqa: E402
from attnres_numpy import ops  # noqa: E402
from attnres_torch.kernels import triton_depth as td  # noqa: E402

pytestmark = pytest.mark.triton

EPS, SCALE = 1e-6, 0.7

# (max D tile, tile elements, backward programs, forward programs, narrowest hoisted qg): one
# tile in registers; D walked in 16-wide tiles with 1-row blocks shared by 2 backward and 3
# forward programs; 2-row blocks, one backward program, 2 forward programs (the persistent grids
# loop) that load a shared qg once.
TILINGS = {"one_tile": (16384, 8192, 1024, 264, 1024), "d_tiles": (16, 16, 2, 3, 1024),
           "row_blocks": (16384, 16, 1, 2, 1)}
VARIANTS = [(False, True), (True, True), (False, False)]  # (per-token query, gain)
DEPTH_CASES = ([("one_tile", n, d, pt, g) for n, d in [(1, 7), (2, 1), (3, 33), (9, 7)]
                for pt, g in VARIANTS]
               + [("d_tiles", 2, 33, pt, g) for pt, g in VARIANTS] + [("d_tiles", 9, 33, True, True)]
               + [("row_blocks", n, d, pt, g) for n, d in [(3, 7), (9, 1)] for pt, g in VARIANTS])


@pytest.fixture
def kernels(monkeypatch, request):
    """Poisoned buffers + launch counter; `request.param` (optional) names a tiling."""
    name = getattr(request, "param", "one_tile")
    max_d, elems, progs, fwd_progs, hoist_min_d = TILINGS[name]
    monkeypatch.setattr(td, "_MAX_BLOCK_D", max_d)
    monkeypatch.setattr(td, "_TILE_ELEMS", elems)
    monkeypatch.setattr(td, "_BWD_PROGRAMS", progs)
    monkeypatch.setattr(td, "_FWD_PROGRAMS", fwd_progs)
    monkeypatch.setattr(td, "_HOIST_MIN_D", hoist_min_d)
    monkeypatch.setattr(td, "_alloc", lambda shape, dtype, device: torch.full(
        shape, float("nan"), dtype=dtype, device=device))
    launches, fills = [], []
    real = td._launch

    def spy(kernel, grid, *args, **meta):  # table fills apart: a cache hit launches none
        (fills if kernel is td._fill_table_kernel else launches).append(kernel.fn.__name__)
        real(kernel, grid, *args, **meta)

    monkeypatch.setattr(td, "_launch", spy)
    return launches


def _no_nan(*ts):
    for t in ts:
        if t is not None:
            assert not torch.isnan(t).any(), "a poisoned element was never written"


def _sources(gen, n, shape, dtype, layout):
    """N sources `shape`: contiguous, row-strided slices of a wider tensor, or transposed."""
    if layout == "contiguous":
        return [rand(gen, shape, dtype) for _ in range(n)]
    if layout == "sliced":  # row stride D + 3, unit column stride: passed without a copy
        return [rand(gen, shape[:-1] + (shape[-1] + 3,), dtype)[..., 1:shape[-1] + 1]
                for _ in range(n)]
    return [rand(gen, shape[::-1], dtype).permute(*range(len(shape) - 1, -1, -1))
            for _ in range(n)]  # no unit column stride: the kernel module copies the row view


def _check_depth(gen, n, shape, dtype, *, per_token, gain, layout, launches):
    dim = shape[-1]
    name = str(dtype).replace("torch.", "")
    xs = _sources(gen, n, shape, dtype, layout)
    q = rand(gen, shape if per_token else (dim,), torch.float32)
    g = rand(gen, (dim,), torch.float32) + 1.0 if gain else None
    before = [x.clone() for x in xs] + [q.clone()]
    out, lse = td.forward(xs, q, g, EPS, SCALE)
    d_out = rand(gen, shape, dtype)
    d_lse = rand(gen, shape[:-1], torch.float32)
    d_src, d_q, d_g = td.backward(xs, q, g, out, lse, d_out, d_lse, EPS, SCALE)
    assert launches.count("_depth_fwd_kernel") == 1 and launches.count("_depth_bwd_kernel") == 1
    _no_nan(out, lse, *d_src, d_q, d_g)
    for a, b in zip(xs + [q], before):
        assert torch.equal(a, b), "an input was modified"
    ref_out, ref_lse = ops.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=SCALE,
                                           return_lse=True)
    ref = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), f64(d_lse), eps=EPS,
                                  scale=SCALE)
    assert out.dtype == dtype and lse.dtype == torch.float32 and d_q.dtype == torch.float32
    assert all(d.dtype == dtype and d.shape == shape for d in d_src)
    assert_close(out, ref_out, name, "out", grad=False)
    assert_close(lse, ref_lse, compute_dtype(name), "lse", grad=False)
    assert_close(d_src, ref["sources"], name, "d_sources", grad=True)
    assert_close(d_q, ref["query"], name, "d_query", grad=True)
    if gain:
        assert_close(d_g, ref["norm_weight"], name, "d_norm_weight", grad=True)
    else:
        assert d_g is None
    return out, lse, d_src, d_q, d_g


@pytest.mark.parametrize("kernels,n,dim,per_token,gain", DEPTH_CASES, indirect=["kernels"])
def test_depth_attention_fp32_matches_reference(kernels, n, dim, per_token, gain):
    gen = torch.Generator().manual_seed(100 * n + dim)
    _check_depth(gen, n, (5, dim), torch.float32, per_token=per_token, gain=gain,
                 layout="contiguous", launches=kernels)


@pytest.mark.parametrize("kernels", ["one_tile", "d_tiles"], indirect=True)
@pytest.mark.parametrize("layout", ["sliced", "transposed"])
@pytest.mark.parametrize("per_token", [False, True])
def test_non_contiguous_sources_and_token_axes(kernels, layout, per_token):
    gen = torch.Generator().manual_seed(7)
    _check_depth(gen, 3, (2, 2, 33), torch.float32, per_token=per_token, gain=True, layout=layout,
                 launches=kernels)


@pytest.mark.parametrize("kernels", ["one_tile", "d_tiles"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_reference_on_upcast_inputs(kernels, dtype):
    gen = torch.Generator().manual_seed(11)
    _check_depth(gen, 3, (4, 33), dtype, per_token=False, gain=True, layout="sliced",
                 launches=kernels)


def test_single_source_returns_it_exactly(kernels):
    x = rand(torch.Generator().manual_seed(3), (4, 7), torch.bfloat16)
    out, _ = td.forward([x], torch.ones(7), None, EPS, SCALE)
    assert torch.equal(out, x)


@pytest.mark.parametrize("kernels", ["d_tiles", "row_blocks"], indirect=True)
def test_forward_backward_bitwise_deterministic(kernels):
    results = []
    for _ in range(2):  # the same inputs twice
        kernels.clear()
        results.append(_check_depth(torch.Generator().manual_seed(5), 3, (5, 33), torch.float32,
                                    per_token=False, gain=True, layout="contiguous",
                                    launches=kernels))
    (o1, l1, s1, q1, w1), (o2, l2, s2, q2, w2) = results
    assert torch.equal(o1, o2) and torch.equal(l1, l2) and torch.equal(q1, q2)
    assert torch.equal(w1, w2) and all(torch.equal(a, b) for a, b in zip(s1, s2))


@pytest.mark.parametrize("kernels,gain", [(t, True) for t in TILINGS] + [("one_tile", False)],
                         indirect=["kernels"])
@pytest.mark.parametrize("n,num_q,dim", [(1, 1, 1), (3, 5, 33), (9, 3, 7)])
def test_multi_matches_reference(kernels, n, num_q, dim, gain):
    gen = torch.Generator().manual_seed(n * num_q + dim)
    xs = _sources(gen, n, (5, dim), torch.float32, "sliced")
    qs = rand(gen, (num_q, dim), torch.float32)
    gs = rand(gen, (num_q, dim), torch.float32) + 1.0 if gain else None
    out, lse = td.multi_forward(xs, qs, gs, EPS, SCALE)
    split = -(-num_q // td._tiles(5, dim, num_q)[1]) > 1  # one tile cannot hold every query
    assert kernels == (["_phase1_logits_kernel", "_weighted_sum_kernel"] if split else ["_depth_fwd_kernel"])
    _no_nan(out, lse)
    ref_out, ref_lse = ops.depth_attention_multi(f64(xs), f64(qs), f64(gs), eps=EPS, scale=SCALE)
    assert_close(out, ref_out, "float32", "out", grad=False)
    assert_close(lse, ref_lse, "float32", "lse", grad=False)


@pytest.mark.parametrize("kernels,per_token,dtype",
                         [("one_tile", pt, dt) for pt in (False, True)
                          for dt in (torch.float32, torch.bfloat16)]
                         + [("d_tiles", False, torch.float32), ("d_tiles", True, torch.bfloat16)],
                         indirect=["kernels"])
def test_merge_matches_reference_and_direct(kernels, per_token, dtype):
    gen = torch.Generator().manual_seed(13)
    name = str(dtype).replace("torch.", "")
    shape, num_q = (5, 33), 2
    xs = _sources(gen, 3, shape, dtype, "sliced")
    qs = rand(gen, (num_q, 33), torch.float32)
    gs = rand(gen, (num_q, 33), torch.float32) + 1.0
    partial = rand(gen, shape, dtype)
    out1, lse1 = td.multi_forward(xs, qs, gs, EPS, SCALE)
    for s in range(num_q):
        q = rand(gen, shape, torch.float32) if per_token else qs[s]
        if per_token:  # phase 1 of a per-token query: the single-query forward
            o1, l1 = td.forward(xs, q, gs[s], EPS, SCALE)
        else:
            o1, l1 = out1[s], lse1[s]
        kernels.clear()
        out, lse = td.merge_forward(o1, l1, partial, q, gs[s], EPS, SCALE)
        assert kernels == ["_merge_kernel"]
        _no_nan(out, lse)
        ref_out, ref_lse = ops.merge_partial(f64(o1), f64(l1), f64(partial), f64(q), f64(gs[s]),
                                             eps=EPS, scale=SCALE, return_lse=True)
        assert_close(out, ref_out, name, "merge out", grad=False)
        assert_close(lse, ref_lse, compute_dtype(name), "merge lse", grad=False)
        direct_out, direct_lse = ops.depth_attention(f64(xs + [partial]), f64(q), f64(gs[s]),
                                                     eps=EPS, scale=SCALE, return_lse=True)
        assert_close(out, direct_out, name, "merge(multi) vs direct out", grad=False)
        assert_close(lse, direct_lse, compute_dtype(name), "merge(multi) vs direct lse", grad=False)


def test_supports():
    xs = [torch.randn(3, 8), torch.randn(3, 8)]
    q, g = torch.randn(8), torch.randn(8)
    opts = dict(num_heads=1, activation="softmax", key_norm=True)
    assert td.supports(xs, q, g, **opts)
    assert td.supports(xs, torch.randn(3, 8), None, **opts)
    assert not td.supports(xs, q, g, **dict(opts, num_heads=2))
    assert not td.supports(xs, q, g, **dict(opts, activation="sigmoid"))
    assert not td.supports(xs, q, g, **dict(opts, key_norm=False))
    assert not td.supports([x.double() for x in xs], q, g, **opts)
    assert not td.supports([xs[0], xs[1].half()], q, g, **opts)
    assert not td.supports([xs[0], torch.randn(2, 8)], q, g, **opts)
    assert not td.supports(xs, torch.randn(5), g, **opts)


# -- issue 17's numerical defects (see test_numerics_defects.py for the CPU implementations) ------

@pytest.mark.parametrize("kernels", ["one_tile", "d_tiles"], indirect=True)
@pytest.mark.parametrize("n", [1, 4])
def test_weights_at_large_logits_are_the_p_of_the_lse(kernels, n):
    """return_weights: the kernel's own p (same logits, max and sum as lse): exactly 1 at N = 1,
    summing to 1, within the fp32 tolerance at |z| ~ 50-300."""
    gen = torch.Generator().manual_seed(5)
    dim = 512
    xs = [rand(gen, (3, dim), torch.float32) for _ in range(n)]
    q = rand(gen, (dim,), torch.float32, scale=8.0)
    out, lse, w = td.forward(xs, q, None, EPS, 1.0, with_weights=True)
    _no_nan(out, lse, w)
    ref_out, ref_lse, ref_w = ops.depth_attention(f64(xs), f64(q), None, eps=EPS, scale=1.0,
                                                  return_lse=True, return_weights=True)
    assert float(abs(ref_lse).max()) > 50
    assert w.shape == (n, 3) and w.dtype == torch.float32
    if n == 1:
        assert torch.equal(w, torch.ones_like(w)) and torch.equal(out, xs[0])
    assert float((w.double().sum(0) - 1).abs().max()) <= 1e-6
    assert_close(w, ref_w, "float32", "weights", grad=False)
    assert_close(lse, ref_lse, "float32", "lse", grad=False)
    assert_close(out, ref_out, "float32", "out", grad=False)


@pytest.mark.parametrize("kernels", ["one_tile", "d_tiles"], indirect=True)
@pytest.mark.parametrize("magnitude", [1e18, 1e25])
def test_huge_fp32_sources_keep_their_key_norm(kernels, magnitude):
    """C10.6: the fp32 sum of squares overflows from |x| ~ 1.8e19; the key norm must not go to 0
    (uniform weights).  Forward, merge and gradients against the reference on both sides."""
    gen = torch.Generator().manual_seed(6)
    dim = 33
    xs = [rand(gen, (4, dim), torch.float32, scale=magnitude) for _ in range(3)]
    q = rand(gen, (dim,), torch.float32, scale=0.2)
    g = rand(gen, (dim,), torch.float32, scale=0.1) + 1.0
    out, lse, w = td.forward(xs, q, g, EPS, 1.0, with_weights=True)
    ref_out, ref_lse, ref_w = ops.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=1.0,
                                                  return_lse=True, return_weights=True)
    assert_close(w, ref_w, "float32", "weights", grad=False)
    assert_close(lse, ref_lse, "float32", "lse", grad=False)
    assert_close(out / magnitude, ref_out / magnitude, "float32", "out", grad=False)
    d_out = rand(gen, (4, dim), torch.float32)
    d_src, d_q, d_g = td.backward(xs, q, g, out, lse, d_out, None, EPS, 1.0)
    ref = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), None, eps=EPS, scale=1.0)
    assert_close(d_src, ref["sources"], "float32", "d_sources", grad=True)
    assert_close([d_q / magnitude, d_g / magnitude],
                 [ref["query"] / magnitude, ref["norm_weight"] / magnitude], "float32", "d_qg", grad=True)
    m_out, m_lse = td.merge_forward(out, lse, xs[0], q, g, EPS, 1.0)
    r_m_out, r_m_lse = ops.merge_partial(f64(out), f64(lse), f64(xs[0]), f64(q), f64(g), eps=EPS,
                                         scale=1.0, return_lse=True)
    assert_close(m_lse, r_m_lse, "float32", "merge lse", grad=False)
    assert_close(m_out / magnitude, r_m_out / magnitude, "float32", "merge out", grad=False)


# -- the fused output norm (C17, spec 2.6; test_out_norm.py covers the CPU implementations) ------

ON_EPS = 1e-5


def _check_out_norm(gen, n, shape, dtype, *, per_token, gain, launches, magnitude=1.0):
    """td.forward / td.backward with out_norm against the reference (every output, every
    gradient, random cotangents on out, out_normed and lse); returns the results."""
    dim = shape[-1]
    name = str(dtype).replace("torch.", "")
    xs = _sources(gen, n, shape, dtype, "sliced")
    if magnitude != 1.0:
        xs = [(x.double() * magnitude).to(dtype) for x in xs]
    q = rand(gen, shape if per_token else (dim,), torch.float32, 0.5)
    g = rand(gen, (dim,), torch.float32) + 1.0 if gain else None
    w = rand(gen, (dim,), torch.float32) + 1.0
    before = [x.clone() for x in xs] + [q.clone(), w.clone()]
    out, lse, weights, normed = td.forward(xs, q, g, EPS, SCALE, out_norm=(w, ON_EPS))
    assert weights is None and normed.dtype == dtype and normed.shape == shape
    d_out, d_normed = rand(gen, shape, dtype), rand(gen, shape, dtype)
    d_lse = rand(gen, shape[:-1], torch.float32)
    d_src, d_q, d_g, d_w = td.backward(xs, q, g, out, lse, d_out, d_lse, EPS, SCALE,
                                       out_norm=(w, ON_EPS, d_normed))
    assert launches.count("_depth_fwd_kernel") == 1 and launches.count("_depth_bwd_kernel") == 1
    _no_nan(out, normed, lse, *d_src, d_q, d_g, d_w)
    for a, b in zip(xs + [q, w], before):
        assert torch.equal(a, b), "an input was modified"
    opts = dict(eps=EPS, scale=SCALE, out_norm_weight=f64(w), out_norm_eps=ON_EPS)
    r_out, r_normed, r_lse = ops.depth_attention(f64(xs), f64(q), f64(g), return_lse=True, **opts)
    v = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), f64(d_lse),
                                d_out_normed=f64(d_normed), **opts)
    assert_close(out / magnitude, r_out / magnitude, name, "out", grad=False)
    assert_close(normed, r_normed, name, "out_normed", grad=False)
    assert_close(lse, r_lse, compute_dtype(name), "lse", grad=False)
    assert_close(d_src, v["sources"], name, "d_sources", grad=True)
    if magnitude == 1.0:
        assert_close(d_q, v["query"], "float32", "d_query", grad=True)
        if gain:
            assert_close(d_g, v["norm_weight"], "float32", "d_norm_weight", grad=True)
    assert_close(d_w, v["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)
    return out, normed, lse, d_src, d_q, d_w


@pytest.mark.parametrize("kernels", ["one_tile", "row_blocks"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,dim,per_token,gain", [(1, 7, False, True), (3, 33, True, True),
                                                  (4, 1, False, False), (9, 20, True, False)])
def test_out_norm_matches_reference(kernels, dtype, n, dim, per_token, gain):
    gen = torch.Generator().manual_seed(n * 7 + dim)
    _check_out_norm(gen, n, (5, dim), dtype, per_token=per_token, gain=gain, launches=kernels)


@pytest.mark.parametrize("kernels", ["one_tile", "row_blocks"], indirect=True)
@pytest.mark.parametrize("per_token", [False, True])
def test_out_norm_partial_in_the_workspace_row(kernels, monkeypatch, per_token):
    """Rows wider than `_ON_REG_MAX_D`: d_out_norm_weight is summed in the program's workspace row
    (ON_IN_WS), across several row blocks per program with the row_blocks tiling."""
    monkeypatch.setattr(td, "_ON_REG_MAX_D", 16)
    gen = torch.Generator().manual_seed(21)
    _check_out_norm(gen, 3, (7, 33), torch.bfloat16, per_token=per_token, gain=True, launches=kernels)


@pytest.mark.parametrize("kernels", ["one_tile"], indirect=True)
def test_out_norm_huge_values_and_bits_repeat(kernels):
    """C10.6: |out| ~ 1e25 squares to inf in fp32; out_normed and its gradients stay right.
    C15: the same inputs twice give the same bits."""
    runs = []
    for _ in range(2):
        kernels.clear()
        runs.append(_check_out_norm(torch.Generator().manual_seed(4), 3, (6, 33), torch.float32,
                                    per_token=False, gain=True, launches=kernels, magnitude=1e25))
    (o1, n1, l1, s1, q1, w1), (o2, n2, l2, s2, q2, w2) = runs
    assert all(torch.equal(a, b) for a, b in zip([o1, n1, l1, q1, w1, *s1], [o2, n2, l2, q2, w2, *s2]))


@pytest.mark.parametrize("kernels", ["one_tile", "row_blocks"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_out_norm_single_source_gradients_are_exact(kernels, dtype, per_token):
    """C6 with the output norm: at N = 1 the weight is 1 whatever the query, so d_query and
    d_norm_weight are exactly 0 and d_sources is the folded cotangent d_out + d_y, as the
    composition gives it (its delta is <go, x_0> itself, not the algebraic <d_y, y>)."""
    gen = torch.Generator().manual_seed(33)
    shape = (5, 12)
    xs = _sources(gen, 1, shape, dtype, "contiguous")
    q = rand(gen, shape if per_token else (12,), torch.float32)
    g, w = rand(gen, (12,), torch.float32) + 1.0, rand(gen, (12,), torch.float32) + 1.0
    out, lse, _, normed = td.forward(xs, q, g, EPS, SCALE, out_norm=(w, ON_EPS))
    assert torch.equal(out, xs[0])
    d_out, d_normed = rand(gen, shape, dtype), rand(gen, shape, dtype)
    d_src, d_q, d_g, d_w = td.backward(xs, q, g, out, lse, d_out, None, EPS, SCALE,
                                       out_norm=(w, ON_EPS, d_normed))
    assert torch.count_nonzero(d_q) == 0 and torch.count_nonzero(d_g) == 0, (d_q.abs().max(), d_g.abs().max())
    x = f64(xs)[0]
    v = ops.depth_attention_vjp([x], f64(q), f64(g), f64(d_out), d_out_normed=f64(d_normed), eps=EPS,
                                scale=SCALE, out_norm_weight=f64(w), out_norm_eps=ON_EPS)
    assert_close(d_src, v["sources"], str(dtype).replace("torch.", ""), "d_sources", grad=True)
    assert_close(d_w, v["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)


@pytest.mark.parametrize("kernels", ["d_tiles"], indirect=True)
def test_out_norm_needs_one_tile(kernels):
    """Rows wider than one backward tile: not supported, so the dispatch refuses a forced call
    (and never chooses Triton for it automatically)."""
    xs = [torch.randn(3, 33) for _ in range(2)]
    q, w = torch.randn(33), torch.rand(33) + 0.5
    opts = dict(num_heads=1, activation="softmax", key_norm=True)
    assert td.supports(xs, q, None, **opts) and not td.supports(xs, q, None, out_norm=True, **opts)
    with at.use_impl("triton"), pytest.raises(ValueError, match="triton"):
        at.depth_attention(xs, q, out_norm_weight=w)


@pytest.mark.parametrize("kernels", ["one_tile"], indirect=True)
def test_out_norm_through_the_op_and_autograd(kernels):
    """`at.depth_attention(..., out_norm_weight=)` forced onto Triton: the custom op and its
    autograd (d_out_norm_weight included), return_weights, last_impl."""
    gen = torch.Generator().manual_seed(9)
    xs = _sources(gen, 3, (2, 3, 16), torch.bfloat16, "contiguous")
    q, g = rand(gen, (16,), torch.float32, 0.5), rand(gen, (16,), torch.float32) + 1.0
    w = rand(gen, (16,), torch.float32) + 1.0
    lx, lq, lg, lw = leaves(xs), leaves(q), leaves(g), leaves(w)
    with at.use_impl("triton"):
        out, normed, weights = at.depth_attention(lx, lq, lg, out_norm_weight=lw, out_norm_eps=ON_EPS,
                                                  return_weights=True)
    assert at.last_impl() == "triton"
    d_normed = rand(gen, normed.shape, torch.bfloat16)
    grads = torch.autograd.grad(normed, lx + [lq, lg, lw], d_normed)
    opts = dict(eps=1e-6, out_norm_weight=f64(w), out_norm_eps=ON_EPS)
    r_out, r_normed, r_w = ops.depth_attention(f64(xs), f64(q), f64(g), return_weights=True, **opts)
    v = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), None, d_out_normed=f64(d_normed), **opts)
    assert_close(normed, r_normed, "bfloat16", "out_normed", grad=False)
    assert_close(weights, r_w, "float32", "weights", grad=False)
    assert_close(list(grads[:3]), v["sources"], "bfloat16", "d_sources", grad=True)
    assert_close(grads[3], v["query"], "float32", "d_query", grad=True)
    assert_close(grads[4], v["norm_weight"], "float32", "d_norm_weight", grad=True)
    assert_close(grads[5], v["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)


# -- pointer / stride tables: written on the device, cached in eager mode, fresh in a capture -----

TABLE_VALUES = (0, 1, 2**31 - 1, 2**31, 2**47 + 12345, 2**62 - 1, 17, 4096)


@pytest.fixture
def tables(monkeypatch, kernels):
    """A cold table cache, table buffers poisoned with -7 (no value is negative), and the
    fill launches (`kernels` records them apart)."""
    monkeypatch.setattr(td, "_TABLES", type(td._TABLES)())
    monkeypatch.setattr(td, "_alloc_table", lambda num, device: torch.full(
        (num,), -7, dtype=torch.int64, device=device))
    fills = []
    real = td._launch

    def spy(kernel, grid, *args, **meta):
        if kernel is td._fill_table_kernel:
            fills.append(args[1:3])  # (start, count)
        real(kernel, grid, *args, **meta)

    monkeypatch.setattr(td, "_launch", spy)
    return fills


@pytest.mark.parametrize("num", [1, 8, 15, 16, 17, 40])
def test_fill_table_writes_every_value(tables, num):
    values = tuple(TABLE_VALUES[i % len(TABLE_VALUES)] ^ (i // len(TABLE_VALUES))
                   for i in range(num))
    table = td._device_table(values, "cpu")
    assert table.dtype == torch.int64 and table.tolist() == list(values)
    assert tables == [(s, min(16, num - s)) for s in range(0, num, 16)]
    for bad in (-1, 2**62):
        with pytest.raises(ValueError, match="table values"):
            td._device_table((bad,), "cpu")


def test_tables_are_cached_least_recently_used_first_out(tables, monkeypatch):
    monkeypatch.setattr(td, "_MAX_TABLES", 3)
    a, b, c, d = [(i, 100 + i) for i in range(4)]
    ta, tb = td._device_table(a, "cpu"), td._device_table(b, "cpu")
    td._device_table(c, "cpu")
    assert td._device_table(a, "cpu") is ta and len(tables) == 3  # a hit: no fill, a is newest
    td._device_table(d, "cpu")                                     # evicts b, the least recent
    assert td._device_table(a, "cpu") is ta and len(tables) == 4
    assert td._device_table(b, "cpu") is not tb and len(tables) == 5
    assert len(td._TABLES) == 3


def test_capture_fills_a_fresh_table_per_call_and_caches_none(tables, kernels, monkeypatch):
    """While a CUDA graph is captured (simulated: `_capturing` patched) every call fills its own
    tables, after the cache was warmed by the same call in eager mode, and the results equal the
    eager ones bit for bit (and the float64 reference, through `_check_depth`)."""
    gen = torch.Generator().manual_seed(5)
    xs = _sources(gen, 3, (4, 7), torch.bfloat16, "sliced")
    q, g = rand(gen, (7,), torch.float32), rand(gen, (7,), torch.float32) + 1.0
    d_out = rand(gen, (4, 7), torch.bfloat16)
    eager = td.backward(xs, q, g, *td.forward(xs, q, g, EPS, SCALE), d_out, None, EPS, SCALE)
    cached, eager_fills = dict(td._TABLES), len(tables)
    assert eager_fills == 3  # source pointers, strides, gradient pointers
    monkeypatch.setattr(td, "_capturing", lambda device: True)
    for call in range(2):
        got = td.backward(xs, q, g, *td.forward(xs, q, g, EPS, SCALE), d_out, None, EPS, SCALE)
        assert len(tables) == eager_fills + 5 * (call + 1)  # fwd: 2 tables, bwd: 3, none reused
        assert all(torch.equal(a, b) for a, b in zip(got[0], eager[0]))
        assert torch.equal(got[1], eager[1]) and torch.equal(got[2], eager[2])
    assert dict(td._TABLES) == cached
    kernels.clear()
    _check_depth(gen, 2, (3, 33), torch.float32, per_token=True, gain=True, layout="contiguous",
                 launches=kernels)


def test_no_host_data_enters_the_path(tables):
    """Forward, backward, phase 1 and merge with a cold table cache run no op that makes a
    tensor from host data (`lift_fresh`, the copy behind `torch.tensor(values, device=...)`)
    or reads a tensor's value on the host (`_local_scalar_dense`: `.item()`, `bool(t)`), so
    nothing waits for the device and a CUDA graph can capture every call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    forbidden = {"lift_fresh", "lift_fresh_copy", "_local_scalar_dense"}
    gen = torch.Generator().manual_seed(6)
    xs = _sources(gen, 3, (4, 7), torch.float32, "sliced")
    qs, gs = rand(gen, (2, 7), torch.float32), rand(gen, (2, 7), torch.float32) + 1.0
    with Ops() as seen:
        out, lse = td.forward(xs, qs[0], gs[0], EPS, SCALE)
        td.backward(xs, qs[0], gs[0], out, lse, out, lse, EPS, SCALE)
        out1, lse1 = td.multi_forward(xs, qs, gs, EPS, SCALE)
        td.merge_forward(out1[0], lse1[0], xs[0], qs[0], gs[0], EPS, SCALE)
    assert len(tables) >= 3 and "empty" in seen.names and not seen.names & forbidden, seen.names
    with Ops() as control:  # the check can fail: the copy the tables replaced is seen
        torch.tensor([1, 2], dtype=torch.int64)
        bool(out.sum() > 0)
    assert {"lift_fresh", "_local_scalar_dense"} <= control.names


@pytest.mark.parametrize("num_p,dim,programs", [(1, 7, 264), (2, 33, 264), (7, 33, 3), (300, 7, 8),
                                                (300, 2100, 5), (1024, 16, 264)])
def test_reduce_sums_every_row_in_a_fixed_order(kernels, monkeypatch, num_p, dim, programs):
    """The workspace reduction (two passes when the first has several chunks) against the float64
    sum, outputs poisoned, bits repeated; the grid of each pass checked."""
    monkeypatch.setattr(td, "_REDUCE_PROGRAMS", programs)
    grids = []
    real = td._launch
    monkeypatch.setattr(td, "_launch", lambda k, grid, *a, **m: (grids.append(grid), real(k, grid, *a, **m)))
    ws = rand(torch.Generator().manual_seed(num_p + dim), (num_p, dim), torch.float32)
    before = ws.clone()
    out = td._reduce(ws)
    first = list(grids)
    _no_nan(out)
    assert torch.equal(ws, before) and torch.equal(td._reduce(ws), out)
    assert_close(out, f64(ws).sum(0), "float32", "sum of rows", grad=True)
    tiles = -(-dim // min(1024, 1 << (dim - 1).bit_length()))
    rows = -(-num_p // max(1, min(num_p, programs // tiles)))
    chunks = -(-num_p // rows)
    assert first == ([(tiles, chunks), (tiles, 1)] if chunks > 1 else [(tiles, 1)])
    assert kernels.count("_reduce_rows_kernel") == 2 * len(first)


@pytest.mark.parametrize("kernels", ["one_tile", "d_tiles"], indirect=True)
@pytest.mark.parametrize("n,num_q,dim,dtype", [(1, 12, 7, torch.float32), (8, 12, 33, torch.bfloat16),
                                               (3, 3, 7, torch.float16), (4, 17, 20, torch.float32),
                                               (2, 5, 100, torch.bfloat16)])
def test_phase1_split_reads_each_source_twice_not_s_times(kernels, n, num_q, dim, dtype):
    """`_run_phase1_split` (`_phase1_logits_kernel`, then `_weighted_sum_kernel`) called directly,
    with and without gains, one and several D steps, S above one 16-query group of the sum,
    against the float64 reference; N = 1 returns the source exactly (C6); bits repeat."""
    gen = torch.Generator().manual_seed(n * 100 + num_q + dim)
    name = str(dtype).replace("torch.", "")
    xs = _sources(gen, n, (6, dim), dtype, "sliced")
    qs = rand(gen, (num_q, dim), torch.float32)
    gs = None if num_q == 3 else rand(gen, (num_q, dim), torch.float32) + 1.0
    table = td._SourceTable(xs, dim)
    out, lse = td._run_phase1_split(table, qs, gs, num_q, EPS, SCALE)
    assert kernels == ["_phase1_logits_kernel", "_weighted_sum_kernel"]
    _no_nan(out, lse)
    ref_out, ref_lse = ops.depth_attention_multi(f64(xs), f64(qs), f64(gs), eps=EPS, scale=SCALE)
    assert_close(out, ref_out, name, "out", grad=False)
    assert_close(lse, ref_lse, "float32", "lse", grad=False)
    if n == 1:
        assert all(torch.equal(o, xs[0]) for o in out)
    again = td._run_phase1_split(table, qs, gs, num_q, EPS, SCALE)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


def test_public_call_reaches_the_triton_kernels_through_three_files():
    """The flat path (see test_dispatch.py): at every launch the stack holds ops.py (the checks),
    dispatch.py (the choice, then the run) and kernels/triton_depth.py only (support check, host
    code, kernels and custom-op bodies in one module); the backward: dispatch.py's autograd formula and
    triton_depth.py; no file twice on any stack."""
    from test_dispatch import _trace

    gen = torch.Generator().manual_seed(21)
    xs = [rand(gen, (3, 16), torch.float32).requires_grad_(True) for _ in range(2)]
    q = rand(gen, (16,), torch.float32).requires_grad_(True)
    with at.use_impl("triton"):
        stacks, seen = _trace(lambda: at.depth_attention(xs, q), [td._launch])
        out = at.depth_attention(xs, q)
    assert stacks and all(s == ["attnres_torch/ops.py", "attnres_torch/dispatch.py",
                                "attnres_torch/kernels/triton_depth.py"] for s in stacks), stacks
    assert all(len(s) == len(set(s)) for s in seen)
    stacks, seen = _trace(lambda: out.backward(torch.randn_like(out)), [td._launch])
    assert stacks and all(s == ["attnres_torch/dispatch.py", "attnres_torch/kernels/triton_depth.py"]
                          for s in stacks), stacks
    assert all(len(s) == len(set(s)) for s in seen)
