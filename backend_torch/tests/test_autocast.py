"""Mixed precision: `torch.autocast` (CPU bfloat16 / float16), bfloat16 weights, GradScaler.

M1a: the stream keeps the embedding's dtype (every pushed v_l is cast to it) and the router's own
products run outside autocast; C3a: the bare ops widen mixed source dtypes under autocast only
and compute with autocast off.  The CUDA autocast path is the same code (device-agnostic:
`torch.is_autocast_enabled(device.type)`), not run here.
"""

from __future__ import annotations

import contextlib
import traceback

import attnres_torch as at
import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close, compute_dtype, f64, leaves, rand
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_numpy import ops as ref

L, D = 5, 8
BF16 = torch.bfloat16
ROUTER_CASES = [(name, schedule) for name in sorted(VARIANT_KINDS)
                for schedule in (("direct", "two_phase") if ResidualConfig.variant(name).supports_two_phase
                                 else ("direct",))]


def _autocast(dtype=BF16):
    return torch.autocast("cpu", dtype)


# -- the router: M1a -------------------------------------------------------------------------------

def _router_run(cfg, schedule, *, autocast, impl=None):
    """The probe-like network `tanh(h @ w_l)` (its matmul in bf16) through a router: out and
    every gradient.  autocast=True: under CPU bf16 autocast; False: no autocast, each sublayer
    casting to bf16 by hand, which is what autocast does to it."""
    torch.manual_seed(0)
    router = at.DepthRouter(cfg, L, D, schedule=schedule)
    with torch.no_grad():
        for p in router.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    w = (torch.randn(L, D, D) / 3).requires_grad_()
    emb = torch.randn(2, 3, D, requires_grad=True)
    cotangent = torch.randn(2, 3, D)
    if autocast:
        subs = [lambda h, l=l: torch.tanh(F.linear(h, w[l].T)) for l in range(L)]
    else:
        subs = [lambda h, l=l: torch.tanh(F.linear(h.to(BF16), w[l].T.to(BF16))) for l in range(L)]
    with _autocast() if autocast else contextlib.nullcontext(), \
            at.use_impl(impl) if impl else contextlib.nullcontext():
        out = router(emb, subs)
    out.backward(cotangent)
    return [out, emb.grad, w.grad] + [p.grad for p in router.parameters()]


@pytest.mark.parametrize("name,schedule", ROUTER_CASES)
def test_router_under_autocast_equals_explicit_casts(name, schedule):
    """Under autocast every router equals, bitwise (value and every gradient), the same router
    without autocast whose sublayers round to bf16 by hand: the bf16 v_l joins the float32
    stream by one cast (M1a), and nothing of the router itself runs in bf16 (its ops and
    products compute with autocast off)."""
    cfg = ResidualConfig.variant(name)
    got = _router_run(cfg, schedule, autocast=True)
    want = _router_run(cfg, schedule, autocast=False)
    assert got[0].dtype == torch.float32  # the stream keeps the embedding's dtype
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None and a.dtype == b.dtype and torch.equal(a, b), f"result {i}"


@pytest.mark.parametrize("name,schedule", [("full", "direct"), ("block", "two_phase")])
def test_router_under_autocast_chunked_kernel(name, schedule):
    """The chunked kernel computes with torch matmuls, which autocast would run in bf16: its
    op bodies run with autocast off (C10), so it equals the explicit-cast run bitwise too."""
    cfg = ResidualConfig.variant(name)
    got = _router_run(cfg, schedule, autocast=True, impl="chunked")
    want = _router_run(cfg, schedule, autocast=False, impl="chunked")
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"result {i}"


# -- the model: every variant, forward + backward ---------------------------------------------------

def _model(name, dtype=torch.float32):
    cfg = ResidualConfig.variant(name)
    torch.manual_seed(sorted(VARIANT_KINDS).index(name))
    model = at.AttnResTransformer(32, 16, 2, 2, cfg, eps=cfg.eps)
    with torch.no_grad():  # queries away from their zero init, so the weights are not uniform
        for p in model.router.parameters():  # matrices [R, D, D] at a 1/sqrt(D) scale
            p.add_(torch.randn_like(p) * (0.3 if p.dim() < 3 else 0.3 / p.shape[-2] ** 0.5))
    return model.to(dtype)


def _loss_and_grads(model, tokens, autocast_dtype=None):
    model.zero_grad()
    with _autocast(autocast_dtype) if autocast_dtype else contextlib.nullcontext():
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    return logits, loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", sorted(VARIANT_KINDS))
def test_model_forward_backward_under_autocast(name, mode):
    """Every variant of `AttnResTransformer` (eval: Block's two-phase schedule) trains under CPU
    bf16 autocast; loss and every gradient against the same model in float32 without autocast,
    with the bf16 rules (the probe's factor 4 on the table: L = 4 sublayers each rounding)."""
    model = _model(name)
    getattr(model, mode)()
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = _loss_and_grads(model, tokens, BF16)
    assert logits.dtype == BF16  # the LM head is autocast's; the stream under it is float32
    _, ref_loss, ref_grads = _loss_and_grads(model, tokens)
    assert abs(loss.item() - ref_loss.item()) <= 4 * 8e-3 * abs(ref_loss.item())
    for n, g in grads.items():
        assert g is not None and g.dtype == torch.float32, n
        err = (g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)
        assert err <= 4 * 3e-2, f"d_{n}: {err:.3g}"


def test_model_under_autocast_is_deterministic():
    """C15: repeated forward + backward under autocast are bitwise identical."""
    model = _model("block")
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(2))
    first = _loss_and_grads(model, tokens, BF16)
    again = _loss_and_grads(model, tokens, BF16)
    assert torch.equal(first[0], again[0])
    assert all(torch.equal(first[2][n], again[2][n]) for n in first[2])


@pytest.mark.parametrize("name", sorted(VARIANT_KINDS))
def test_model_in_bfloat16_weights(name):
    """model.to(bfloat16), no autocast: a bf16 stream end to end; every gradient bf16, close to
    the float32 model holding the same (bf16) weights."""
    model = _model(name, BF16)
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    logits, loss, grads = _loss_and_grads(model, tokens)
    assert logits.dtype == BF16
    model32 = _model(name, BF16).float()
    _, ref_loss, ref_grads = _loss_and_grads(model32, tokens)
    assert abs(loss.item() - ref_loss.item()) <= 4 * 8e-3 * abs(ref_loss.item())
    for n, g in grads.items():
        assert g is not None and g.dtype == BF16 and torch.isfinite(g).all(), n
        err = ((g.float() - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)).item()
        assert err <= 4 * 3e-2, f"d_{n}: {err:.3g}"


# -- the bare ops: C3a -----------------------------------------------------------------------------

MIXED = [  # (source dtypes, the widened dtype)
    ((BF16, torch.float32, torch.float16, torch.float32), torch.float32),
    ((torch.float16, BF16), torch.float32),  # promote_types(fp16, bf16) = fp32
    ((BF16, torch.float64, torch.float32), torch.float64),
]


def _mixed_sources(gen, dtypes, shape=(3, 5, 16)):
    return [rand(gen, shape, dt) for dt in dtypes]


def _dname(dtype):
    return str(dtype).replace("torch.", "")


@pytest.mark.parametrize("impl,case", [(impl, case) for case, (_, wide) in enumerate(MIXED)
                                       for impl in ("cpu_c", "chunked", "composite")
                                       if wide != torch.float64 or impl == "composite"])
def test_depth_attention_mixed_sources_under_autocast(impl, case):
    """Mixed source dtypes under autocast: out in the widest dtype, lse in its compute dtype,
    each source's gradient in its own dtype; all against the float64 reference on the upcast
    inputs (a random cotangent for out and lse).  float64 has no kernel: the composition only."""
    dtypes, wide = MIXED[case]
    gen = torch.Generator().manual_seed(10 + case)
    xs = _mixed_sources(gen, dtypes)
    q, g = rand(gen, (16,), torch.float32, 0.5), rand(gen, (16,), torch.float32).abs() + 0.5
    xs_l, q_l, g_l = leaves(xs), leaves(q), leaves(g)
    with _autocast(), at.use_impl(impl):
        out, lse = at.depth_attention(xs_l, q_l, g_l, return_lse=True)
    assert at.last_impl() == impl and out.dtype == wide
    d_out, d_lse = rand(gen, out.shape, out.dtype), rand(gen, lse.shape, lse.dtype)
    torch.autograd.backward([out, lse], [d_out, d_lse])
    r_out, r_lse = ref.depth_attention(f64(xs), f64(q), f64(g), return_lse=True)
    assert_close(out, r_out, _dname(wide), "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(_dname(wide)), "lse", grad=False)
    v = ref.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), f64(d_lse))
    for i, x in enumerate(xs_l):
        assert x.grad.dtype == x.dtype
        assert_close(x.grad, v["sources"][i], _dname(x.dtype), f"d_sources[{i}]", grad=True)
    assert_close(q_l.grad, v["query"], "float32", "d_query", grad=True)
    assert_close(g_l.grad, v["norm_weight"], "float32", "d_norm_weight", grad=True)


@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
def test_kernels_keep_float32_under_autocast(impl):
    """One dtype under autocast (nothing to widen): the kernel still computes in float32 (C10).
    The chunked kernel's matmuls ran in bf16 under autocast before their bodies disabled it."""
    gen = torch.Generator().manual_seed(4)
    xs = [rand(gen, (4, 7, 64), torch.float32) for _ in range(5)]
    q, g = rand(gen, (64,), torch.float32), rand(gen, (64,), torch.float32).abs() + 0.5
    xs_l, q_l = leaves(xs), leaves(q)
    with _autocast(), at.use_impl(impl):
        out, lse = at.depth_attention(xs_l, q_l, g, return_lse=True)
    d_out = rand(gen, out.shape, out.dtype)
    out.backward(d_out)
    assert_close(out, ref.depth_attention(f64(xs), f64(q), f64(g)), "float32", "out", grad=False)
    v = ref.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out))
    assert_close([x.grad for x in xs_l], v["sources"], "float32", "d_sources", grad=True)
    assert_close(q_l.grad, v["query"], "float32", "d_query", grad=True)


def test_options_under_autocast():
    """Heads and sigmoid (the composition) with mixed sources under autocast."""
    gen = torch.Generator().manual_seed(5)
    xs = _mixed_sources(gen, (torch.float32, BF16, BF16))
    q = rand(gen, (3, 5, 16), BF16, 0.5)  # a per-token query of yet another dtype (C10.1)
    opts = dict(num_heads=2, activation="sigmoid")
    xs_l, q_l = leaves(xs), leaves(q)
    with _autocast():
        out = at.depth_attention(xs_l, q_l, **opts)
    d_out = rand(gen, out.shape, out.dtype)
    out.backward(d_out)
    assert_close(out, ref.depth_attention(f64(xs), f64(q), None, **opts), "float32", "out", grad=False)
    v = ref.depth_attention_vjp(f64(xs), f64(q), None, f64(d_out), **opts)
    for i, x in enumerate(xs_l):
        assert_close(x.grad, v["sources"][i], _dname(x.dtype), f"d_sources[{i}]", grad=True)
    assert q_l.grad.dtype == BF16
    assert_close(q_l.grad, v["query"], "bfloat16", "d_query", grad=True)


def test_multi_mixed_sources_under_autocast():
    gen = torch.Generator().manual_seed(6)
    xs = _mixed_sources(gen, (BF16, torch.float32, BF16, torch.float16))
    qs, gs = rand(gen, (3, 16), torch.float32, 0.5), rand(gen, (3, 16), torch.float32).abs() + 0.5
    xs_l, qs_l, gs_l = leaves(xs), leaves(qs), leaves(gs)
    with _autocast():
        out, lse = at.depth_attention_multi(xs_l, qs_l, gs_l)
    assert out.dtype == torch.float32 and at.last_impl() == "cpu_c"
    d_out, d_lse = rand(gen, out.shape, out.dtype), rand(gen, lse.shape, lse.dtype)
    torch.autograd.backward([out, lse], [d_out, d_lse])
    r_out, r_lse = ref.depth_attention_multi(f64(xs), f64(qs), f64(gs))
    assert_close(out, r_out, "float32", "out", grad=False)
    assert_close(lse, r_lse, "float32", "lse", grad=False)
    v = ref.depth_attention_multi_vjp(f64(xs), f64(qs), f64(gs), f64(d_out), f64(d_lse))
    for i, x in enumerate(xs_l):
        assert_close(x.grad, v["sources"][i], _dname(x.dtype), f"d_sources[{i}]", grad=True)
    assert_close(qs_l.grad, v["queries"], "float32", "d_queries", grad=True)
    assert_close(gs_l.grad, v["norm_weights"], "float32", "d_norm_weights", grad=True)


@pytest.mark.parametrize("grad", [True, False])
def test_merge_mixed_under_autocast(grad):
    """out1 in bf16 (a bf16 phase 1), partial in float32: widened to float32; with gradients
    (the composition) and without (the fused kernel)."""
    gen = torch.Generator().manual_seed(7)
    out1, partial = rand(gen, (4, 9, 12), BF16), rand(gen, (4, 9, 12), torch.float32)
    lse1, q = rand(gen, (4, 9), torch.float32), rand(gen, (12,), torch.float32, 0.5)
    g = rand(gen, (12,), torch.float32).abs() + 0.5
    ins = leaves([out1, lse1, partial, q, g]) if grad else [out1, lse1, partial, q, g]
    with _autocast():
        out, lse = at.merge_partial(*ins, return_lse=True)
    assert out.dtype == torch.float32
    assert at.last_impl() == ("composite" if grad else "cpu_c")
    r_out, r_lse = ref.merge_partial(*f64([out1, lse1, partial, q, g]), return_lse=True)
    assert_close(out, r_out, "float32", "out", grad=False)
    assert_close(lse, r_lse, "float32", "lse", grad=False)
    if grad:
        d_out, d_lse = rand(gen, out.shape, out.dtype), rand(gen, lse.shape, lse.dtype)
        torch.autograd.backward([out, lse], [d_out, d_lse])
        v = ref.merge_partial_vjp(*f64([out1, lse1, partial, q, g]), f64(d_out), f64(d_lse))
        for name, t in zip(("out1", "lse1", "partial", "query", "norm_weight"), ins):
            assert t.grad.dtype == t.dtype
            assert_close(t.grad, v[name], _dname(t.dtype), f"d_{name}", grad=True)


def test_mixed_sources_outside_autocast_still_raise():
    """C3 / C14 outside autocast, and under autocast for a device type that is not enabled."""
    gen = torch.Generator().manual_seed(8)
    xs = _mixed_sources(gen, (BF16, torch.float32))
    q = rand(gen, (16,), torch.float32)
    for ctx in (torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False)):
        with ctx:
            with pytest.raises(TypeError, match=r"sources: all sources must share one dtype"):
                at.depth_attention(xs, q)
            with pytest.raises(TypeError, match=r"sources: all sources must share one dtype"):
                at.depth_attention_multi(xs, q[None])
            with pytest.raises(TypeError, match=r"out1: dtype bfloat16 differs from partial dtype float32"):
                at.merge_partial(xs[0], q.new_zeros(3, 5), xs[1], q)
    with _autocast(), pytest.raises(TypeError, match=r"sources\[1\]"):  # non-floating: never widened
        at.depth_attention([xs[1], xs[1].to(torch.int32)], q)


def test_inputs_unmodified_under_autocast():
    """C7: the widening casts copies; the caller's sources keep their dtype and values."""
    gen = torch.Generator().manual_seed(9)
    xs = _mixed_sources(gen, (BF16, torch.float32))
    before = [x.clone() for x in xs]
    with _autocast():
        at.depth_attention(xs, rand(gen, (16,), torch.float32))
    assert all(x.dtype == b.dtype and torch.equal(x, b) for x, b in zip(xs, before))


# -- torch.compile, GradScaler ----------------------------------------------------------------------

def test_compile_fullgraph_under_autocast():
    """A model with a Block router and the bare op on mixed sources, compiled with
    fullgraph=True (0 graph breaks) under autocast, equals eager under autocast."""
    torch._dynamo.reset()
    torch.manual_seed(11)
    router = at.DepthRouter(ResidualConfig.variant("block", block_size=2), 4, 16)
    with torch.no_grad():
        router.queries.normal_()
    lin = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
    q = torch.randn(16)

    def model(x):
        h = router(x, [lambda h, f=f: torch.tanh(f(h)) for f in lin])
        return at.depth_attention([h, lin[0](h)], q)  # mixed: float32 stream, bf16 linear output

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 16)
    with _autocast():
        y = compiled(x)
        want = model(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
    y.sum().backward()
    assert torch.isfinite(router.queries.grad).all() and torch.isfinite(lin[0].weight.grad).all()


def test_grad_scaler_fp16_cpu():
    """fp16 autocast with `torch.amp.GradScaler("cpu")`: the unscaled gradients equal those of
    the run without the scaler (fp16 rules), and an overflowing scale makes the scaler skip the
    step (the inf reaches every gradient through the ops, C12) and halve the scale."""
    model = _model("block")
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(12))
    _, _, plain = _loss_and_grads(model, tokens, torch.float16)
    plain = {n: g.clone() for n, g in plain.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for init_scale, finite in ((2.0 ** 12, True), (2.0 ** 100, False)):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        model.zero_grad()
        with _autocast(torch.float16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert moved == finite and scaler.get_scale() == (init_scale if finite else init_scale / 2)
        if finite:
            for n, p in model.named_parameters():
                err = ((p.grad - plain[n]).abs().max() / plain[n].abs().max().clamp_min(1e-30)).item()
                assert err <= 4e-3 * 4, f"d_{n}: {err:.3g}"
            with torch.no_grad():
                for b, p in zip(before, model.parameters()):
                    p.copy_(b)  # the second run starts from the same weights
        else:
            assert not torch.isfinite(model.router.queries.grad).all()


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("shape", [(4, 1), (), (5,)])
def test_wrong_shape_d_lse_is_torch_autodiff_error(first, shape):
    """Spec 7: a cotangent whose shape differs from its output's raises torch's own autodiff
    RuntimeError before the op's code sees it: no frame of attnres_torch is in the traceback.
    Listed first, torch names the shapes; listed after d_out, torch 2.13's message is its own
    bug (`_make_grads` looks the cotangent up with `==`), still raised before attnres runs."""
    xs = [torch.randn(4, 6, requires_grad=True) for _ in range(3)]
    out, lse = at.depth_attention(xs, torch.randn(6), return_lse=True)
    outs, cots = [lse, out], [torch.randn(shape), torch.randn(4, 6)]
    if not first:
        outs, cots = outs[::-1], cots[::-1]
    with pytest.raises(RuntimeError) as info:
        torch.autograd.grad(outs, xs, cots)
    frames = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert not any("attnres_torch" in f for f in frames), frames
    if first:
        assert "Mismatch in shape: grad_output[0]" in str(info.value)
