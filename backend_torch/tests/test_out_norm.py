"""The fused output norm (C17, spec 2.6: `out_norm_weight` / `out_norm_eps`) of the torch backend:
the composition and the C kernel against the float64 reference on upcast inputs (values and every
gradient, random cotangents on out AND out_normed), NaN-poisoned kernel buffers, bitwise
determinism, the dispatch's fallbacks, errors, and the `torch.library` op.  The Triton kernel's
out norm runs in `test_triton_depth.py` (interpreted, in its own subprocess)."""

from __future__ import annotations

import attnres_torch as at
import pytest
import torch
from _helpers import DTYPES, assert_close, compute_dtype, f64, leaves, rand
from attnres_numpy import ops as ref
from attnres_torch import dispatch
from attnres_torch.kernels import cpu_c

EPS, SCALE, ON_EPS = 1e-6, 0.7, 1e-5

needs_c = pytest.mark.skipif(not cpu_c.available(), reason="the C kernel could not be built")


def _inputs(gen, n, shape, dtype, *, per_token, gain, scale=1.0):
    dim = shape[-1]
    xs = [rand(gen, shape, dtype, scale) for _ in range(n)]
    q = rand(gen, shape if per_token else (dim,), torch.float32, 0.5)
    g = rand(gen, (dim,), torch.float32) + 1.0 if gain else None
    w = rand(gen, (dim,), torch.float32) + 1.0
    return xs, q, g, w


def _run(impl, xs, q, g, w, *, stacked=False, d_lse=True, on_eps=ON_EPS, num_heads=1,
         activation="softmax", key_norm=True, cot_out=True, cot_normed=True, seed=0):
    """One forward + backward through `at.depth_attention` under `use_impl(impl)`; compares with
    the float64 reference and returns (out, normed, lse, grads)."""
    dtype = xs[0].dtype
    name = str(dtype).replace("torch.", "")
    shape = xs[0].shape
    before = [t.clone() for t in xs + [q, w] + ([] if g is None else [g])]
    lx, lq, lg, lw = leaves(xs), leaves(q), leaves(g), leaves(w)
    src = torch.stack(lx) if stacked else lx
    softmax = activation == "softmax"
    with at.use_impl(impl):
        res = at.depth_attention(src, lq, lg, eps=EPS, scale=SCALE, num_heads=num_heads,
                                 activation=activation, key_norm=key_norm, return_lse=softmax,
                                 out_norm_weight=lw, out_norm_eps=on_eps)
    assert at.last_impl() == impl
    out, normed = res[0], res[1]
    lse = res[2] if softmax else None
    assert out.dtype == dtype and normed.dtype == dtype and out.shape == normed.shape == shape
    gen = torch.Generator().manual_seed(seed)
    d_out = rand(gen, shape, dtype) if cot_out else None
    d_normed = rand(gen, shape, dtype) if cot_normed else None
    dl = rand(gen, lse.shape, lse.dtype) if softmax and d_lse else None
    pairs = [(t, c) for t, c in ((out, d_out), (normed, d_normed), (lse, dl)) if c is not None]
    inputs = ([src] if stacked else lx) + [lq, lw] + ([] if lg is None else [lg])
    grads = torch.autograd.grad([t for t, _ in pairs], inputs, [c for _, c in pairs],
                                allow_unused=True, materialize_grads=True)  # unused: zeros
    for a, b in zip(xs + [q, w] + ([] if g is None else [g]), before):
        assert torch.equal(a, b), "an input was modified"
    opts = dict(eps=EPS, scale=SCALE, num_heads=num_heads, activation=activation,
                key_norm=key_norm, out_norm_weight=f64(w), out_norm_eps=on_eps)
    r = ref.depth_attention(f64(xs), f64(q), f64(g), return_lse=softmax, **opts)
    assert_close(out, r[0], name, "out", grad=False)
    assert_close(normed, r[1], name, "out_normed", grad=False)
    if softmax:
        assert_close(lse, r[2], compute_dtype(name), "lse", grad=False)
    v = ref.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), f64(dl),
                                d_out_normed=f64(d_normed), **opts)
    d_src = list(grads[0].unbind(0)) if stacked else list(grads[:len(xs)])
    rest = grads[1:] if stacked else grads[len(xs):]
    assert_close(d_src, v["sources"], name, "d_sources", grad=True)
    # query, gains: float32 parameters, their gradients in the compute dtype's row
    cname = compute_dtype(name)
    assert_close(rest[0], v["query"], cname, "d_query", grad=True)
    assert_close(rest[1], v["out_norm_weight"], cname, "d_out_norm_weight", grad=True)
    if g is not None:
        assert_close(rest[2], v["norm_weight"], cname, "d_norm_weight", grad=True)
    return out, normed, lse, grads


IMPLS = ["composite", pytest.param("cpu_c", marks=needs_c)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("per_token,gain", [(False, True), (True, False), (True, True)])
def test_matches_reference(impl, dtype, per_token, gain):
    gen = torch.Generator().manual_seed(len(dtype) * 10 + per_token * 2 + gain)
    xs, q, g, w = _inputs(gen, 4, (3, 5, 40), DTYPES[dtype], per_token=per_token, gain=gain)
    _run(impl, xs, q, g, w, seed=1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("n,t,d", [(1, 4, 7), (2, 37, 1), (9, 40, 33), (3, 70, 130)])
def test_shapes_stacked_and_list_sources(impl, stacked, n, t, d):
    gen = torch.Generator().manual_seed(n * t + d)
    xs, q, g, w = _inputs(gen, n, (t, d), torch.float32, per_token=False, gain=True)
    _run(impl, xs, q, g, w, stacked=stacked, seed=2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cot_out,cot_normed,d_lse", [(False, True, False), (True, False, False),
                                                      (False, True, True)])
def test_partial_cotangents(impl, cot_out, cot_normed, d_lse):
    """Absent cotangents are zeros: out_normed alone (the usual use), out alone, and lse."""
    gen = torch.Generator().manual_seed(31)
    xs, q, g, w = _inputs(gen, 3, (6, 24), torch.bfloat16, per_token=False, gain=True)
    _run(impl, xs, q, g, w, cot_out=cot_out, cot_normed=cot_normed, d_lse=d_lse, seed=3)


@pytest.mark.parametrize("num_heads,activation,key_norm", [(2, "softmax", True), (1, "sigmoid", True),
                                                           (4, "sigmoid", False), (1, "softmax", False)])
def test_options_only_the_composition_serves(num_heads, activation, key_norm):
    """Heads, sigmoid, no key norm: the norm is over all D channels whatever num_heads."""
    gen = torch.Generator().manual_seed(num_heads)
    xs, q, g, w = _inputs(gen, 3, (5, 16), torch.float32, per_token=True, gain=True)
    _run("composite", xs, q, g, w, num_heads=num_heads, activation=activation, key_norm=key_norm)
    # the automatic choice falls back to the composition and says so
    at.depth_attention(xs, q, g, num_heads=num_heads, activation=activation, key_norm=key_norm,
                       out_norm_weight=w)
    assert at.last_impl() == "composite"


def test_float64_composition():
    gen = torch.Generator().manual_seed(64)
    xs, q, g, w = _inputs(gen, 4, (2, 3, 9), torch.float64, per_token=True, gain=True)
    _run("composite", xs, q.double(), g.double(), w.double(), stacked=True, on_eps=None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_values_stay_finite(impl, dtype):
    """C10.6 for the output norm: |out| ~ 1e25 squares to inf in fp32; out_normed stays finite
    and right (the C kernel re-sums in float64, the composition scales by a power of two)."""
    gen = torch.Generator().manual_seed(5)
    xs, q, g, w = _inputs(gen, 3, (4, 33), dtype, per_token=False, gain=False, scale=1e25)
    out, normed, _, _ = _run(impl, xs, q, g, w, seed=4)
    assert torch.isfinite(normed).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_single_source(impl):
    """N = 1 softmax: out is the source bitwise (C6), out_normed its rmsnorm * w."""
    gen = torch.Generator().manual_seed(6)
    xs, q, g, w = _inputs(gen, 1, (5, 12), torch.bfloat16, per_token=False, gain=True)
    out, normed, _, _ = _run(impl, xs, q, g, w)
    assert torch.equal(out, xs[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_propagate_per_token(impl):
    """C12: a NaN or Inf in one token's sources makes that token's out_normed NaN; others are
    untouched."""
    gen = torch.Generator().manual_seed(7)
    xs, q, g, w = _inputs(gen, 3, (4, 16), torch.float32, per_token=False, gain=True)
    xs[1][1, 3] = float("nan")
    xs[2][2, 5] = float("inf")
    with at.use_impl(impl):
        out, normed = at.depth_attention(xs, q, g, out_norm_weight=w)
    assert torch.isnan(normed[1]).all() and torch.isnan(normed[2]).all()
    keep = [0, 3]
    r = ref.depth_attention(f64([x[keep] for x in xs]), f64(q), f64(g), out_norm_weight=f64(w))
    assert_close(normed[keep], r[1], "float32", "finite tokens", grad=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_return_weights_and_lse_order(impl):
    gen = torch.Generator().manual_seed(8)
    xs, q, g, w = _inputs(gen, 3, (4, 16), torch.float32, per_token=False, gain=True)
    with at.use_impl(impl):
        out, normed, lse, weights = at.depth_attention(xs, q, g, out_norm_weight=w,
                                                       return_lse=True, return_weights=True)
        out2, normed2, weights2 = at.depth_attention(xs, q, g, out_norm_weight=w,
                                                     return_weights=True)
    r_out, r_normed, r_lse, r_w = ref.depth_attention(f64(xs), f64(q), f64(g), out_norm_weight=f64(w),
                                                      return_lse=True, return_weights=True)
    assert_close(normed, r_normed, "float32", "out_normed", grad=False)
    assert_close(lse, r_lse, "float32", "lse", grad=False)
    assert_close(weights, r_w, "float32", "weights", grad=False)
    assert torch.equal(normed, normed2) and torch.equal(weights, weights2)
    assert not weights.requires_grad


# -- the C kernel directly: poisoned buffers, bits -------------------------------------------------

def _poison(shape, dtype):
    """A `[T, D]` NaN buffer inside wider rows (row stride D + 3, unit stride along D)."""
    wide = torch.full((shape[0], shape[1] + 3), float("nan"), dtype=dtype)
    return wide[:, 1:shape[1] + 1]


def _c_fwd_bwd(xs, qg, w, d_out, d_normed, d_lse):
    t, d = xs[0].shape
    dtype = xs[0].dtype
    out, normed, lse = _poison((t, d), dtype), _poison((t, d), dtype), torch.full((t,), float("nan"))
    cpu_c.forward_into(xs, qg, EPS, SCALE, out, lse, None, (w, ON_EPS, normed))
    d_src = [_poison((t, d), dtype) for _ in xs]
    d_qg, d_w = cpu_c.backward_into(xs, qg, lse, d_out, d_lse, EPS, SCALE, d_src,
                                    (w, ON_EPS, d_normed))
    return [out, normed, lse, *d_src, d_qg, d_w]


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("n,t,d", [(1, 3, 1), (3, 37, 17), (9, 5, 1030)])
def test_c_kernel_writes_every_element(dtype, per_token, n, t, d):
    gen = torch.Generator().manual_seed(n + t + d)
    xs = [rand(gen, (t, d), dtype) for _ in range(n)]
    qg = rand(gen, (t, d) if per_token else (d,), torch.float32, 0.5)
    w = rand(gen, (d,), torch.float32) + 1.0
    d_out, d_normed = rand(gen, (t, d), dtype), rand(gen, (t, d), dtype)
    d_lse = rand(gen, (t,), torch.float32)
    out, normed, lse, *rest = _c_fwd_bwd(xs, qg, w, d_out, d_normed, d_lse)
    d_src, d_qg, d_w = rest[:n], rest[n], rest[n + 1]
    name = str(dtype).replace("torch.", "")
    opts = dict(eps=EPS, scale=SCALE, out_norm_weight=f64(w), out_norm_eps=ON_EPS)
    r = ref.depth_attention(f64(xs), f64(qg), None, return_lse=True, **opts)
    v = ref.depth_attention_vjp(f64(xs), f64(qg), None, f64(d_out), f64(d_lse),
                                d_out_normed=f64(d_normed), **opts)
    assert_close(out, r[0], name, "out", grad=False)
    assert_close(normed, r[1], name, "out_normed", grad=False)
    assert_close(lse, r[2], "float32", "lse", grad=False)
    assert_close(d_src, v["sources"], name, "d_sources", grad=True)
    assert_close(d_qg, v["query"], "float32", "d_qg", grad=True)
    assert_close(d_w, v["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_bits_repeat_and_do_not_depend_on_the_thread_count(dtype):
    """C15: d_out_norm_weight is summed per block, then over blocks in block order."""
    gen = torch.Generator().manual_seed(9)
    xs = [rand(gen, (1037, 40), dtype) for _ in range(5)]
    qg = rand(gen, (40,), torch.float32, 0.5)
    w = rand(gen, (40,), torch.float32) + 1.0
    d_out, d_normed = rand(gen, (1037, 40), dtype), rand(gen, (1037, 40), dtype)
    threads = torch.get_num_threads()
    try:
        runs = []
        for k in (1, 2, 2, 3):
            torch.set_num_threads(k)
            runs.append(_c_fwd_bwd(xs, qg, w, d_out, d_normed, None))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@needs_c
def test_c_kernel_out_equals_the_plain_kernel_bitwise():
    """The output norm adds outputs only: out and lse are the plain kernel's bits."""
    gen = torch.Generator().manual_seed(10)
    xs, q, g, w = _inputs(gen, 4, (9, 33), torch.bfloat16, per_token=False, gain=True)
    with at.use_impl("cpu_c"):
        out, lse = at.depth_attention(xs, q, g, return_lse=True)
        out2, _, lse2 = at.depth_attention(xs, q, g, return_lse=True, out_norm_weight=w)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# -- dispatch, errors, the custom op -------------------------------------------------------------

@needs_c
def test_dispatch_chooses_and_falls_back():
    gen = torch.Generator().manual_seed(11)
    xs, q, g, w = _inputs(gen, 3, (4, 16), torch.float32, per_token=False, gain=True)
    at.depth_attention(xs, q, g, out_norm_weight=w)
    assert at.last_impl() == "cpu_c"
    strided = [x.t().contiguous().t() for x in xs]  # stride along D != 1: cpu_c cannot take it,
    at.depth_attention(strided, q, g, out_norm_weight=w)  # chunked has no output norm
    assert at.last_impl() == "composite"
    with at.use_impl("chunked"), pytest.raises(ValueError, match="no fused output norm"):
        at.depth_attention(xs, q, g, out_norm_weight=w)
    with at.use_impl("chunked"):  # without the output norm chunked still serves the call
        at.depth_attention(xs, q, g)
    assert at.last_impl() == "chunked"


def test_errors_name_the_arguments():
    xs = [torch.randn(2, 8) for _ in range(2)]
    q = torch.randn(8)
    with pytest.raises(ValueError, match="out_norm_eps.*out_norm_weight"):
        at.depth_attention(xs, q, out_norm_eps=1e-5)
    with pytest.raises(ValueError, match="out_norm_weight"):
        at.depth_attention(xs, q, out_norm_weight=torch.ones(7))
    with pytest.raises(TypeError, match="out_norm_weight"):
        at.depth_attention(xs, q, out_norm_weight=torch.ones(8, dtype=torch.int32))
    with pytest.raises(TypeError, match="out_norm_weight"):
        at.depth_attention(xs, q, out_norm_weight=[1.0] * 8)
    for bad, err in ((0.0, ValueError), (-1e-6, ValueError), (float("inf"), ValueError),
                     (True, TypeError), ("1e-6", TypeError)):
        with pytest.raises(err, match="out_norm_eps"):
            at.depth_attention(xs, q, out_norm_weight=torch.ones(8), out_norm_eps=bad)


@needs_c
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("with_weights", [False, True])
def test_opcheck(per_token, with_weights):
    xs = [torch.randn(4, 6, requires_grad=True) for _ in range(3)]
    q = torch.randn((4, 6) if per_token else (6,), requires_grad=True)
    g = (torch.rand(6) + 0.5).requires_grad_(True)
    w = (torch.rand(6) + 0.5).requires_grad_(True)
    torch.library.opcheck(dispatch.OPS["cpu_c"].depth_attention_out_norm,
                          (xs, q, g, w, 1e-6, 1.0, 1e-5, with_weights, "out"))
    xs = [x.detach() for x in xs]
    out, _, lse, _ = dispatch.OPS["cpu_c"].depth_attention_out_norm(xs, q.detach(), g.detach(), w.detach(),
                                                        1e-6, 1.0, 1e-5, False, "out")
    torch.library.opcheck(dispatch.OPS["cpu_c"].depth_attention_out_norm_backward,
                          (xs, q.detach(), g.detach(), w.detach(), out, lse, torch.randn(4, 6),
                           torch.randn(4, 6), torch.randn(4), 1e-6, 1.0, 1e-5))


@needs_c
def test_compile_fullgraph():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    xs, q, g, w = _inputs(gen, 3, (4, 16), torch.float32, per_token=False, gain=True)

    def f(xs, q, g, w):
        out, normed = at.depth_attention(xs, q, g, out_norm_weight=w)
        return out, normed

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    lw = leaves(w)
    out, normed = compiled(xs, q, g, lw)
    r = ref.depth_attention(f64(xs), f64(q), f64(g), out_norm_weight=f64(w))
    assert_close(normed, r[1], "float32", "compiled out_normed", grad=False)
    d_normed = rand(gen, normed.shape, torch.float32)
    (d_w,) = torch.autograd.grad(normed, lw, d_normed)
    v = ref.depth_attention_vjp(f64(xs), f64(q), f64(g), None, d_out_normed=f64(d_normed),
                                out_norm_weight=f64(w))
    assert_close(d_w, v["out_norm_weight"], "float32", "compiled d_out_norm_weight", grad=True)


def test_depth_attention_module_option():
    """`DepthAttention(fuse_out_norm=True)`: an `out_norm` gain `[D]` (ones) and (out, out_normed)."""
    gen = torch.Generator().manual_seed(13)
    plain = at.DepthAttention(16)
    layer = at.DepthAttention(16, fuse_out_norm=True, out_norm_eps=1e-5)
    assert "out_norm" not in plain.state_dict() and torch.equal(layer.out_norm, torch.ones(16))
    with torch.no_grad():
        layer.query.normal_(generator=gen)
        layer.out_norm.add_(rand(gen, (16,), torch.float32, 0.1))
    xs = [rand(gen, (2, 3, 16), torch.float32) for _ in range(3)]
    out, normed = layer(xs)
    r = ref.depth_attention(f64(xs), f64(layer.query), f64(layer.norm_weight),
                            out_norm_weight=f64(layer.out_norm), out_norm_eps=1e-5)
    assert_close(normed, r[1], "float32", "module out_normed", grad=False)
    normed.square().sum().backward()
    assert layer.out_norm.grad is not None and torch.isfinite(layer.out_norm.grad).all()
    with pytest.raises(ValueError, match="out_norm_eps"):
        at.DepthAttention(16, out_norm_eps=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_tokens_and_a_broadcast_cotangent(impl):
    """T = 0 gives empty outputs and zero gain gradients; `normed.sum()` hands the backward a
    stride-0 cotangent (made unit-stride for the kernel)."""
    gen = torch.Generator().manual_seed(14)
    q, w = leaves(rand(gen, (8,), torch.float32)), leaves(rand(gen, (8,), torch.float32) + 1.0)
    empty = leaves([torch.empty(0, 8) for _ in range(3)])
    with at.use_impl(impl):
        out, normed = at.depth_attention(empty, q, out_norm_weight=w)
    assert out.shape == normed.shape == (0, 8)
    grads = torch.autograd.grad(normed.sum(), empty + [q, w])
    assert all(g.shape == (0, 8) for g in grads[:3])
    assert torch.equal(grads[4], torch.zeros(8))
    xs = [rand(gen, (4, 8), torch.float32) for _ in range(3)]
    lx = leaves(xs)
    with at.use_impl(impl):
        _, normed = at.depth_attention(lx, q, out_norm_weight=w)
    grads = torch.autograd.grad(normed.sum(), lx + [w])
    v = ref.depth_attention_vjp(f64(xs), f64(q), None, None, out_norm_weight=f64(w),
                                d_out_normed=torch.ones(4, 8, dtype=torch.float64).numpy())
    assert_close(list(grads[:3]), v["sources"], "float32", "d_sources", grad=True)
    assert_close(grads[3], v["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)


# -- M15: the fused output norm inside the residual stream -----------------------------------------
@pytest.mark.parametrize("kind", ("full", "block", "hybrid"))
def test_fused_model_equals_prenorm_model_and_uses_the_fused_op(kind):
    """`AttnResTransformer` with fuse_out_norm (M15) computes the PreNorm-gain model with the
    gains moved into the router (value and every gradient, a random cotangent), and every
    direct read asks the op for its out norm (the C kernel's fused pass on this CPU)."""
    from attnres_torch import dispatch

    torch.manual_seed(0)
    extra = {"block_size": 2} if kind == "block" else {}
    plain_cfg = at.ResidualConfig(kind=kind, **extra)
    fused_cfg = at.ResidualConfig(kind=kind, fuse_out_norm=True, **extra)
    plain = at.AttnResTransformer(40, 16, 2, 2, plain_cfg).double()
    torch.manual_seed(0)
    fused = at.AttnResTransformer(40, 16, 2, 2, fused_cfg).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random gains and queries, one set for both models
        for name, p in plain.router.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5 + (name == "norm_weights"))
            getattr(fused.router, name).copy_(p)
        gains = [s.norm.weight for s in plain.sublayers] + [plain.norm.weight]
        for g in gains:
            g.copy_(1.0 + 0.3 * torch.randn(g.shape, generator=gen, dtype=g.dtype))
        fused.router.out_norm_weights.copy_(torch.stack(gains))
        for a, b in zip(plain.sublayers, fused.sublayers):
            b.load_state_dict(a.fn.state_dict())
        fused.embed.weight.copy_(plain.embed.weight)
        fused.head.weight.copy_(plain.head.weight)
    tokens = torch.randint(0, 40, (2, 5), generator=gen)
    cot = torch.randn(2, 5, 40, generator=gen, dtype=torch.float64)
    before = dispatch.impl_counts()
    y_fused = fused(tokens)
    calls = sum((dispatch.impl_counts() - before).values())
    y_plain = plain(tokens)
    torch.testing.assert_close(y_fused, y_plain, rtol=1e-12, atol=1e-12)
    assert calls >= 2 * 2 + 1  # one op call per read (L = 4 sublayers and the output)
    g_fused = torch.autograd.grad(y_fused, [fused.router.out_norm_weights, fused.router.queries,
                                            fused.embed.weight], cot)
    g_plain = torch.autograd.grad(y_plain, [*gains, plain.router.queries, plain.embed.weight], cot)
    torch.testing.assert_close(g_fused[0], torch.stack(g_plain[:5]), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_fused[1], g_plain[5], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_fused[2], g_plain[6], rtol=1e-10, atol=1e-12)


def test_fused_stream_passes_the_gain_to_the_op(monkeypatch):
    """The stream's direct reads call `ops.depth_attention(..., out_norm_weight=row)`."""
    from attnres_torch import residual_ops

    seen = []
    real = residual_ops.ops.depth_attention

    def spy(*args, out_norm_weight=None, **kw):
        seen.append(out_norm_weight)
        return real(*args, out_norm_weight=out_norm_weight, **kw)

    monkeypatch.setattr(residual_ops.ops, "depth_attention", spy)
    router = at.DepthRouter(at.ResidualConfig(kind="full", fuse_out_norm=True), 3, 8)
    with torch.no_grad():
        router.out_norm_weights.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8))
    router(torch.randn(2, 8), [torch.tanh] * 3)
    assert len(seen) == 4 and all(torch.equal(w, router.out_norm_weights[r]) for r, w in enumerate(seen))


def test_fused_model_refuses_a_different_eps():
    with pytest.raises(ValueError, match=r"eps: with fuse_out_norm .* config.eps = 1e-06"):
        at.AttnResTransformer(40, 16, 1, 2, at.ResidualConfig(kind="full", fuse_out_norm=True), eps=1e-5)
