"""Modules: the router against the reference probe network for every variant (value and every
gradient), two-phase == direct, zero-init Block/Full == PreNorm after the final norm."""

from __future__ import annotations

import attnres_torch as at
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_numpy import model

L, D = 5, 8


def _probe(router, emb, w, eps, **call):
    """The probe network (spec 6); M15: the stream hands a fused router's sublayers the normed input."""
    norm = (lambda h: h) if router.config.fuse_out_norm else (lambda h: F.rms_norm(h, (D,), eps=eps))
    subs = [lambda h, l=l: torch.tanh(norm(h) @ w[l]) for l in range(L)]
    return router(emb, subs, **call)


@pytest.mark.parametrize("name", sorted(VARIANT_KINDS))
@pytest.mark.parametrize("dname", ["float64", "float32"])
def test_router_matches_reference_probe(name, dname):
    dtype = torch.float64 if dname == "float64" else torch.float32
    cfg = ResidualConfig.variant(name)
    rng = np.random.default_rng(sorted(VARIANT_KINDS).index(name))
    params = {k: rng.standard_normal(s) * 0.5 for k, s in cfg.param_shapes(L, D).items()}
    emb_np = rng.standard_normal((2, 3, D))
    w_np = rng.standard_normal((L, D, D)) / 3
    ct = rng.standard_normal((2, 3, D))
    router = at.DepthRouter(cfg, L, D).to(dtype)
    assert {k: tuple(v.shape) for k, v in router.state_dict().items()} == cfg.param_shapes(L, D)
    router.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    emb = torch.tensor(emb_np, dtype=dtype, requires_grad=True)
    w = torch.tensor(w_np, dtype=dtype, requires_grad=True)
    out = _probe(router, emb, w, cfg.eps)
    out.backward(torch.tensor(ct, dtype=dtype))
    assert_close(out, model.probe_forward(cfg, params, emb_np, w_np), dname, "out", grad=False)
    grads = model.probe_vjp(cfg, params, emb_np, w_np, ct)
    assert_close(emb.grad, grads["embedding"], dname, "d_embedding", grad=True)
    assert_close(w.grad, grads["sublayer_weights"], dname, "d_sublayer_weights", grad=True)
    for k in params:
        assert_close(getattr(router, k).grad, grads[k], dname, f"d_{k}", grad=True)


@pytest.mark.parametrize("name,schedule,mix,scale", [
    ("full", "direct", 0.35, None), ("block", "direct", 0.6, 1.7), ("block", "two_phase", 0.25, 0.5),
    ("window", "direct", 0.0, None), ("input_query", "direct", 1.0, 2.0)])
def test_router_mix_and_scale_match_reference(name, schedule, mix, scale):
    """M10 per-call inputs: value and every gradient against the float64 reference."""
    cfg = ResidualConfig.variant(name)
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(s) * 0.5 for k, s in cfg.param_shapes(L, D).items()}
    emb_np, w_np, ct = rng.standard_normal((2, 3, D)), rng.standard_normal((L, D, D)) / 3, rng.standard_normal((2, 3, D))
    router = at.DepthRouter(cfg, L, D, schedule=schedule).to(torch.float64)
    router.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    emb = torch.tensor(emb_np, requires_grad=True)
    w = torch.tensor(w_np, requires_grad=True)
    out = _probe(router, emb, w, cfg.eps, mix=mix, scale=scale)
    assert_close(out, model.probe_forward(cfg, params, emb_np, w_np, schedule=schedule, mix=mix, scale=scale),
                 "float64", "out", grad=False)
    out.backward(torch.tensor(ct))
    grads = model.probe_vjp(cfg, params, emb_np, w_np, ct, schedule=schedule, mix=mix, scale=scale)
    assert_close(emb.grad, grads["embedding"], "float64", "d_embedding", grad=True)
    assert_close(w.grad, grads["sublayer_weights"], "float64", "d_sublayer_weights", grad=True)
    for k in params:
        got = getattr(router, k).grad
        if mix == 0.0:  # M10: no depth attention, so no gradient reaches its parameters
            assert got is None and not grads[k].any()
        else:
            assert_close(got, grads[k], "float64", f"d_{k}", grad=True)


def test_router_mix_errors():
    router = at.DepthRouter(ResidualConfig.variant("full"), L, D)
    with pytest.raises(ValueError, match="mix: expected a real number in"):
        router.stream(torch.zeros(D), mix=1.2)
    with pytest.raises(ValueError, match="scale: expected a finite real"):
        router.stream(torch.zeros(D), scale=float("inf"))
    with pytest.raises(ValueError, match="mix: .*attention kind"):
        at.DepthRouter(ResidualConfig(kind="gated"), L, D).stream(torch.zeros(D), mix=0.5)


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_two_phase_equals_direct_and_reference(block_size):
    cfg = ResidualConfig.variant("block", block_size=block_size)
    rng = np.random.default_rng(block_size)
    params = {k: rng.standard_normal(s) * 0.5 for k, s in cfg.param_shapes(L, D).items()}
    emb_np, w_np = rng.standard_normal((4, D)), rng.standard_normal((L, D, D)) / 3
    outs = {}
    for schedule in ("direct", "two_phase"):
        router = at.DepthRouter(cfg, L, D, schedule=schedule)
        router.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
        with torch.no_grad():
            outs[schedule] = _probe(router, torch.tensor(emb_np, dtype=torch.float32),
                                    torch.tensor(w_np, dtype=torch.float32), cfg.eps)
    ref = model.probe_forward(cfg, params, emb_np, w_np, schedule="two_phase")
    assert_close(outs["two_phase"], ref, "float32", "two_phase", grad=False)
    torch.testing.assert_close(outs["two_phase"], outs["direct"], atol=2e-6, rtol=2e-6)


def test_eval_mode_uses_two_phase():
    router = at.DepthRouter(ResidualConfig.variant("block"), L, D)
    assert router.active_schedule() == "direct"
    router.eval()
    assert router.active_schedule() == "two_phase"
    with pytest.raises(ValueError, match="two_phase"):
        at.DepthRouter(ResidualConfig.variant("full"), L, D, schedule="two_phase")


@pytest.mark.parametrize("variant", ["full", "block"])
def test_zero_init_equals_prenorm_after_final_norm(variant):
    torch.manual_seed(0)
    base = at.AttnResTransformer(50, 16, 3, 2, ResidualConfig(kind="standard"), eps=1e-12)
    model_ = at.AttnResTransformer(50, 16, 3, 2, ResidualConfig.variant(variant), eps=1e-12)
    state = {k: v for k, v in base.state_dict().items() if not k.startswith("router.")}
    model_.load_state_dict(state, strict=False)
    tokens = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model_(tokens), base(tokens), atol=1e-4, rtol=1e-4)


def test_transformer_trains_and_two_phase_eval_matches():
    torch.manual_seed(1)
    net = at.AttnResTransformer(30, 16, 2, 2, ResidualConfig.variant("block", block_size=2))
    tokens = torch.randint(0, 30, (2, 6))
    loss = F.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad is not None for p in net.parameters())
    with torch.no_grad():
        net.router.queries.normal_()
        direct = net(tokens)
        net.eval()
        two_phase = net(tokens)
    torch.testing.assert_close(two_phase, direct, atol=1e-5, rtol=1e-5)


def test_depth_attention_module_init_and_call():
    layer = at.DepthAttention(8)
    assert torch.equal(layer.query, torch.zeros(8)) and torch.equal(layer.norm_weight, torch.ones(8))
    xs = [torch.randn(3, 8) for _ in range(4)]
    torch.testing.assert_close(layer(xs), sum(xs) / 4)  # zero query: uniform weights


def test_depth_attention_module_repr_shows_dim_and_changed_options():
    assert repr(at.DepthAttention(64)) == "DepthAttention(64)"
    layer = at.DepthAttention(16, num_heads=2, activation="sigmoid", fuse_out_norm=True, out_norm_eps=1e-5)
    assert repr(layer) == "DepthAttention(16, num_heads=2, activation='sigmoid', fuse_out_norm=True, out_norm_eps=1e-05)"
    assert at.DepthAttention(8, eps=1e-5, scale=0.5, key_norm=False).extra_repr() == \
        "8, eps=1e-05, scale=0.5, key_norm=False"


def test_depth_attention_module_returns_lse_and_weights():
    # return_lse / return_weights: keyword-only, as in depth_attention (conformance signatures.json)
    from attnres_numpy import ops

    g = torch.Generator().manual_seed(3)
    layer = at.DepthAttention(8, num_heads=2, scale=0.7, eps=1e-5)
    with torch.no_grad():
        layer.query.copy_(torch.randn(8, generator=g))
        layer.norm_weight.copy_(1 + 0.3 * torch.randn(8, generator=g))
    xs = [torch.randn(3, 8, generator=g) for _ in range(4)]
    out, lse, weights = layer(xs, return_lse=True, return_weights=True)
    ref = ops.depth_attention([x.double().numpy() for x in xs], layer.query.detach().double().numpy(),
                              layer.norm_weight.detach().double().numpy(), num_heads=2, scale=0.7,
                              eps=1e-5, return_lse=True, return_weights=True)
    for got, want in zip((out, lse, weights), ref):
        assert_close(got, want, "float32", grad=False)
    with pytest.raises(TypeError):
        layer(xs, True)


def test_router_errors():
    router = at.DepthRouter(ResidualConfig.variant("full"), 2, 4)
    with pytest.raises(ValueError, match="expected 2 sublayers"):
        router(torch.randn(4), [torch.tanh])
    stream = router.stream(torch.randn(4))
    with pytest.raises(ValueError, match="0 of 2 sublayers"):
        stream.output()


# -- AttnResTransformer positional option ----------------------------------------------------
def test_rope_scores_depend_on_relative_position_only():
    # <rope(q, m), rope(k, n)> = f(q, k, m - n): shifting every position by s keeps the scores,
    # and the rotation keeps norms.  float64, so equality up to rounding.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 7, 16, generator=g, dtype=torch.float64).unbind(0)
    scores = at.modules.apply_rope(q) @ at.modules.apply_rope(k).transpose(-1, -2)
    for s in (1, 5, 1000):
        shifted = at.modules.apply_rope(q, s) @ at.modules.apply_rope(k, s).transpose(-1, -2)
        torch.testing.assert_close(shifted, scores, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(at.modules.apply_rope(q, 3).norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=0)
    # it is a position encoding: absolute scores change with the rotation, position 0 is the identity
    assert not torch.allclose(scores, q @ k.transpose(-1, -2), atol=1e-3)
    assert torch.equal(at.modules.apply_rope(q[..., :1, :]), q[..., :1, :])
    with pytest.raises(ValueError, match="even last dimension"):
        at.modules.apply_rope(torch.zeros(2, 3, 5))


def test_rope_attention_is_shift_invariant_and_transformer_uses_it():
    torch.manual_seed(0)
    attn = at.modules.CausalSelfAttention(16, 2, rope=True).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(attn(x, offset=11), attn(x), rtol=1e-9, atol=1e-12)
    cfg = ResidualConfig.variant("block")
    torch.manual_seed(1)
    plain = at.AttnResTransformer(40, 16, 2, 2, cfg)
    torch.manual_seed(1)
    rope = at.AttnResTransformer(40, 16, 2, 2, cfg, positional="rope")
    # same parameters (RoPE has none), same weights for a seed, different function
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in rope.named_parameters()]
    rope.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 40, (2, 9))
    assert rope(tokens).shape == (2, 9, 40)
    assert not torch.allclose(rope(tokens), plain(tokens), atol=1e-4)
    # without positions the causal model cannot tell order apart beyond the mask: a sequence of
    # one repeated token gives the same logits at every position; RoPE alone does not change that
    # (relative positions only), but the learned table does
    same = torch.full((1, 5), 7)
    torch.testing.assert_close(plain(same)[0], plain(same)[0, :1].expand(5, -1), rtol=1e-5, atol=1e-5)


def test_learned_positions_shape_params_and_errors():
    cfg = ResidualConfig.variant("full")
    torch.manual_seed(2)
    plain = at.AttnResTransformer(40, 16, 2, 2, cfg)
    torch.manual_seed(2)
    learned = at.AttnResTransformer(40, 16, 2, 2, cfg, positional="learned", context=12)
    assert learned.pos.weight.shape == (12, 16)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(learned) == n(plain) + 12 * 16 and not hasattr(plain, "pos")
    # the table is created last: every other weight of the seed is unchanged
    for name, value in plain.state_dict().items():
        assert torch.equal(learned.state_dict()[name], value), name
    same = torch.full((1, 5), 7)
    out = learned(same)[0]
    assert out.shape == (5, 40) and not torch.allclose(out, out[:1].expand(5, -1), atol=1e-4)
    with pytest.raises(ValueError, match=r"T <= context = 12.*\(1, 13\)"):
        learned(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match="context"):
        at.AttnResTransformer(40, 16, 2, 2, cfg, positional="learned")
    with pytest.raises(ValueError, match="positional"):
        at.AttnResTransformer(40, 16, 2, 2, cfg, positional="alibi")
    with pytest.raises(ValueError, match="even head size"):
        at.AttnResTransformer(40, 12, 2, 4, cfg, positional="rope")
