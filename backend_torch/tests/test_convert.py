"""Per-layer ownership and the PreNorm wrapper: `PerLayerRouter` computes exactly what `DepthRouter`
computes (value and every gradient, every variant, both schedules); `wrap_prenorm` wires a user's
PreNorm blocks exactly as the hand-written stream loop does, loads a PreNorm checkpoint with only
the AttnRes keys missing and matches the PreNorm model at zero init; each block carries its own
AttnRes parameters (per-layer checkpoints), runs alone on a stream, and reports hidden states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_torch import DepthRouter
from attnres_torch.convert import DepthSite, PerLayerRouter, RowStack, wrap_prenorm
from torch import nn

from examples.torch_decoder import Decoder

VARIANTS = [v for v in VARIANT_KINDS  # every variant of the spec with a row per sublayer
            if v not in ("shared_queries", "low_rank_keys")]


def _random_router(name, L, D, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = ResidualConfig.variant(name)
    stacked = DepthRouter(cfg, L, D).double()
    with torch.no_grad():
        for p in stacked.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    per_layer = PerLayerRouter(cfg, L, D, dtype=torch.float64)
    per_layer.load_stacked({k: v.detach() for k, v in stacked.named_parameters()})
    return cfg, stacked, per_layer, gen


@pytest.mark.parametrize("name", VARIANTS)
def test_per_layer_router_equals_depth_router_value_and_every_gradient(name):
    L, D = 5, 8
    cfg, stacked, per_layer, gen = _random_router(name, L, D, seed=VARIANTS.index(name))
    ws = [torch.randn(D, D, generator=gen, dtype=torch.float64) / 3 for _ in range(L)]
    schedules = ["direct", "two_phase"] if cfg.supports_two_phase else ["direct"]
    for schedule in schedules:
        stacked.schedule = per_layer.schedule = schedule
        results = []
        for router in (stacked, per_layer):
            x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                            requires_grad=True)
            w = [wi.clone().requires_grad_() for wi in ws]
            subs = [lambda h, w=wi: torch.tanh(F.rms_norm(h, (D,), eps=1e-6) @ w) for wi in w]
            y = router(x, subs)
            cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
            params = list(router.parameters())
            grads = torch.autograd.grad(y, [x, *w, *params], cot)
            results.append((y, grads[:1 + L], grads[1 + L:]))
        (ya, ga, pa), (yb, gb, pb) = results
        assert torch.equal(ya, yb)
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))
        # per-site gradients, restacked, are the stacked parameters' gradients
        names = list(dict(stacked.named_parameters()))
        for name_, grad in zip(names, pa):
            rows = [g for (n, _), g in zip(per_layer.named_parameters(), pb)
                    if n.endswith("." + {"queries": "query", "norm_weights": "norm_weight",
                                         "query_weights": "query_weight", "alphas": "alpha",
                                         "gate_weights": "gate_weight", "gate_biases": "gate_bias",
                                         "depth_weights": "depth_weight",
                                         "out_norm_weights": "out_norm_weight"}[name_])]
            assert torch.equal(torch.stack(rows), grad)
        assert len(pa) == len(names)


def test_row_stack_indexing_and_stacked_round_trip():
    rows = [torch.randn(4) for _ in range(3)]
    view = RowStack(rows)
    assert view[1] is rows[1] and view.shape == (3, 4) and len(view) == 3
    assert torch.equal(view[0:2], torch.stack(rows[:2])) and view[2, 3] == rows[2][3]
    cfg, stacked, per_layer, _ = _random_router("block", 4, 6, seed=3)
    for k, v in per_layer.stacked().items():
        assert torch.equal(v, getattr(stacked, k))


class GPT2ishBlock(nn.Module):
    """A PreNorm block in HF GPT-2's naming: ln_1, attn, ln_2, mlp (LayerNorm, not RMSNorm)."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _decoder_specs():
    return [lambda b, h, mask: b.attention(h, mask), lambda b, h, mask: b.mlp(h)]


@pytest.mark.parametrize("per_layer", [True, False])
def test_wrap_prenorm_equals_hand_wired_stream_and_prenorm_at_init(per_layer):
    torch.manual_seed(0)
    cfg = ResidualConfig(kind="block", block_size=4)
    hand = Decoder(vocab=50, dim=16, num_blocks=3, num_heads=2, residual=cfg)
    with torch.no_grad():
        hand.router.queries.normal_()
        hand.router.norm_weights.add_(0.3 * torch.randn_like(hand.router.norm_weights))
    prenorm = Decoder(vocab=50, dim=16, num_blocks=3, num_heads=2)
    prenorm.load_state_dict(hand.state_dict(), strict=False)
    stack = wrap_prenorm(prenorm.blocks, cfg, 16, sublayers=_decoder_specs(), per_layer=per_layer)
    router = stack.depth_router
    if per_layer:
        router.load_stacked({"queries": hand.router.queries.detach(),
                             "norm_weights": hand.router.norm_weights.detach()})
        assert stack.router is None and "attnres.0.query" in prenorm.blocks[1].state_dict()
    else:
        stack.router.load_state_dict(hand.router.state_dict())
    tokens = torch.randint(0, 50, (2, 7))
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    emb = hand.embed(tokens)
    out = stack(emb, mask=mask)
    expected = hand.norm(out)
    assert torch.allclose(hand.head(expected), hand(tokens), atol=1e-6, rtol=0)
    # gradients reach the user's blocks and the router's parameters
    out.square().sum().backward()
    assert all(p.grad is not None for p in prenorm.blocks.parameters())


def test_gpt2_layout_detected_prenorm_checkpoint_loads_and_matches_at_init():
    torch.manual_seed(1)
    D = 12
    # float64 and a tiny LayerNorm eps: the equality at init is exact up to eps and rounding
    prenorm_blocks = nn.ModuleList(GPT2ishBlock(D, eps=1e-12) for _ in range(3)).double()
    blocks = nn.ModuleList(GPT2ishBlock(D, eps=1e-12) for _ in range(3)).double()
    stack = wrap_prenorm(blocks, ResidualConfig(kind="full"), dtype="model")  # layout "gpt2", D from ln_1
    assert stack.depth_router.num_layers == 6 and stack.depth_router.dim == D
    result = stack.load_state_dict({"blocks." + k: v for k, v in prenorm_blocks.state_dict().items()},
                                   strict=False)
    assert sorted(result.missing_keys) == sorted(
        [f"blocks.{i}.attnres.{j}.{n}" for i in range(3) for j in range(2) for n in ("query", "norm_weight")]
        + ["attnres_output.query", "attnres_output.norm_weight"])
    x = torch.randn(2, 5, D, dtype=torch.float64)
    h = x
    for b in prenorm_blocks:
        h = b(h)
    ln = nn.LayerNorm(D, eps=1e-12).double()
    # zero queries: uniform weights scale the PreNorm state by 1/N, which LayerNorm undoes
    assert torch.allclose(ln(stack(x)), ln(h), atol=1e-9, rtol=0)


def test_per_layer_checkpoint_one_layer_alone_and_hidden_states():
    torch.manual_seed(2)
    D, cfg = 8, ResidualConfig(kind="block", block_size=2)

    def build():
        torch.manual_seed(5)  # same block weights in both models
        return wrap_prenorm([GPT2ishBlock(D) for _ in range(4)], cfg, sublayers="gpt2")

    a, b = build(), build()
    with torch.no_grad():
        for p in [s.query for s in a.depth_router.site_list()]:
            p.normal_()
    x = torch.randn(3, D)
    assert not torch.allclose(a(x), b(x))
    for i in range(4):  # per-layer checkpoints: each block's state_dict carries its AttnRes rows
        b.blocks[i].load_state_dict(a.blocks[i].state_dict())
    b.attnres_output.load_state_dict(a.attnres_output.state_dict())
    assert torch.equal(a(x), b(x))
    # one layer at a time on a stream is the forward; hidden states are each block's first input
    stream = a.depth_router.stream(x)
    firsts = [a.layer(i, stream) for i in range(4)]
    out = stream.output()
    y, states = a(x, output_hidden_states=True)
    assert torch.equal(out, y) and len(states) == 5 and torch.equal(states[-1], y)
    assert torch.equal(states[0], x)  # sublayer 1 attends over the embedding alone
    assert all(torch.equal(s, f) for s, f in zip(states, firsts))


def test_dtype_model_gives_bf16_parameters_and_a_bf16_forward_close_to_fp32():
    torch.manual_seed(3)
    D = 16
    blocks32 = [GPT2ishBlock(D) for _ in range(2)]
    blocks16 = [GPT2ishBlock(D).to(torch.bfloat16) for _ in range(2)]
    for b16, b32 in zip(blocks16, blocks32):
        b16.load_state_dict(b32.state_dict())
    s32 = wrap_prenorm(blocks32, ResidualConfig(kind="full"))
    s16 = wrap_prenorm(blocks16, ResidualConfig(kind="full"), dtype="model")
    assert all(p.dtype == torch.bfloat16 for p in s16.depth_router.site_list()[0].parameters())
    assert all(p.dtype == torch.float32 for p in s32.depth_router.site_list()[0].parameters())
    x = torch.randn(2, 4, D)
    y16 = s16(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert torch.allclose(y16.float(), s32(x), atol=0.1, rtol=0.05)


def test_wrapper_and_router_argument_errors():
    D = 8
    with pytest.raises(ValueError, match="sublayers: none of the known layouts"):
        wrap_prenorm([nn.Linear(D, D)], ResidualConfig(kind="full"), D)
    with pytest.raises(ValueError, match="unknown layout 'bert'"):
        wrap_prenorm([GPT2ishBlock(D)], ResidualConfig(kind="full"), sublayers="bert")
    with pytest.raises(ValueError, match="has no attribute 'ln_3'"):
        wrap_prenorm([GPT2ishBlock(D)], ResidualConfig(kind="full"), sublayers=[("ln_3", "attn")])
    with pytest.raises(TypeError, match="dtype"):
        wrap_prenorm([GPT2ishBlock(D)], ResidualConfig(kind="full"), dtype="half")
    blocks = [GPT2ishBlock(D)]
    wrap_prenorm(blocks, ResidualConfig(kind="full"))
    with pytest.raises(ValueError, match="already has an 'attnres'"):
        wrap_prenorm(blocks, ResidualConfig(kind="full"))
    with pytest.raises(ValueError, match="sites: expected 4 DepthSite"):
        PerLayerRouter(ResidualConfig(kind="full"), 3, D, sites=[DepthSite({})])
    router = PerLayerRouter(ResidualConfig(kind="full"), 3, D)
    with pytest.raises(ValueError, match=r"params\['queries'\]: expected shape \(4, 8\), got \(3, 8\)"):
        router.load_stacked({"queries": torch.zeros(3, D), "norm_weights": torch.ones(4, D)})
    with pytest.raises(ValueError, match="params: expected names"):
        router.load_stacked({"queries": torch.zeros(4, D)})
    if "shared_queries" in VARIANT_KINDS:
        with pytest.raises(ValueError, match="query_sharing='block' shares rows"):
            PerLayerRouter(ResidualConfig.variant("shared_queries"), 3, D)
        stack = wrap_prenorm([GPT2ishBlock(D)], ResidualConfig.variant("shared_queries"), per_layer=False)
        assert stack(torch.randn(2, D)).shape == (2, D)
    with pytest.raises(ValueError, match=r"key_rank=4 adds one key_projection \[D, r\] shared"):
        PerLayerRouter(ResidualConfig.variant("low_rank_keys"), 3, D)
    stack = wrap_prenorm([GPT2ishBlock(D)], ResidualConfig.variant("low_rank_keys"), per_layer=False)
    assert stack(torch.randn(2, D)).shape == (2, D)


@pytest.mark.parametrize("per_layer", [True, False])
def test_hf_gpt_example_converts_in_place_and_matches_prenorm_at_init(per_layer):
    from examples import hf_gpt

    config = hf_gpt.GPT2Config(n_embd=32, n_layer=3, n_head=2, layer_norm_epsilon=1e-12)
    torch.manual_seed(0)
    prenorm = hf_gpt.GPT2LMHeadModel(config).double()
    model = hf_gpt.to_attnres(hf_gpt.GPT2LMHeadModel(config).double(),
                              ResidualConfig(kind="block", block_size=2), per_layer=per_layer,
                              dtype=torch.float64)
    missing = model.load_state_dict(prenorm.state_dict(), strict=False).missing_keys
    assert all("attnres" in k for k in missing) and missing
    assert all(k in model.state_dict() for k in prenorm.state_dict())  # PreNorm keys unchanged
    tokens = torch.randint(0, config.vocab_size, (2, 9))
    out = model(tokens, output_hidden_states=True)
    torch.testing.assert_close(out["logits"], prenorm(tokens)["logits"], atol=1e-9, rtol=1e-9)
    assert len(out["hidden_states"]) == config.n_layer + 1
    out["logits"].sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "attnres" in n and "query" in n)


def test_wrap_prenorm_refuses_the_fused_output_norm():
    """M15 moves each sublayer's pre-norm gain into the scheme; wrap_prenorm keeps the blocks'
    norms, so it refuses the option by name instead of norming twice."""
    with pytest.raises(ValueError, match=r"config: fuse_out_norm=True .* wrap_prenorm keeps the blocks' own norms"):
        wrap_prenorm([GPT2ishBlock(8)], ResidualConfig.variant("fused_out_norm"))
