"""Central finite differences (float64) of the probe network against the hand-written probe_vjp:
every variant, the embedding, the sublayer weights and every parameter (random nonzero values).

Also M10, the progressive-introduction mix and the per-call scale: exact ends (alpha = 0 is the
standard scheme with no depth attention, alpha = 1 the scheme), the blend in between restated
literally, finite-difference gradients with a mix (direct and two-phase), the per-call scale
equal to a config with that scale, and the errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from attnres_numpy import (
    VARIANT_KINDS,
    ResidualConfig,
    probe_forward,
    probe_sublayers,
    probe_vjp,
    stack_forward,
)

L, TOKENS, D = 5, (2, 3), 4

CONFIGS = [(name, ResidualConfig.variant(name)) for name in VARIANT_KINDS]
# Block with S = 1, 2, 4 over L = 5 (S = 2 and 4 leave an uneven last block), windows W = 1, 3, 9,
# and a non-default eps / scale.
CONFIGS += [(f"block_S{s}", ResidualConfig.variant("block", block_size=s)) for s in (1, 2, 4)]
CONFIGS += [(f"window_W{w}", ResidualConfig.variant("window", window=w)) for w in (1, 3, 9)]
CONFIGS += [
    ("input_query_block", ResidualConfig(kind="block", block_size=2, query="input")),
    ("multihead_input_sigmoid", ResidualConfig(kind="full", num_heads=2, query="input", activation="sigmoid")),
    ("no_key_norm_window", ResidualConfig(kind="window", window=2, key_norm=False)),
    ("full_eps_scale", ResidualConfig(kind="full", eps=1e-3, scale=0.5)),
    ("gated_eps", ResidualConfig(kind="gated", eps=1e-2)),
    # M11 shared queries: per block (S = 2, 3 over L = 5), for the stack, with input queries.
    ("shared_block_S3", ResidualConfig(kind="block", block_size=3, query_sharing="block")),
    ("shared_stack_window", ResidualConfig(kind="window", window=2, query_sharing="stack")),
    ("shared_block_input", ResidualConfig(kind="block", block_size=2, query_sharing="block", query="input")),
    # M12 hybrid with the state as the query, and with one query for the stack.
    ("hybrid_input", ResidualConfig(kind="hybrid", query="input")),
    ("hybrid_shared_sigmoid", ResidualConfig(kind="hybrid", query_sharing="stack", activation="sigmoid")),
    # M13 low-rank keys (r < D = 4): static and input queries, block, sigmoid without key norm,
    # hybrid with one query for the stack.
    ("low_rank_full_r1", ResidualConfig(kind="full", key_rank=1)),
    ("low_rank_input_window", ResidualConfig(kind="window", window=2, key_rank=2, query="input")),
    ("low_rank_block_S2", ResidualConfig(kind="block", block_size=2, key_rank=3, scale=0.8)),
    ("low_rank_sigmoid_raw", ResidualConfig(kind="full", key_rank=2, activation="sigmoid", key_norm=False)),
    ("low_rank_hybrid_stack", ResidualConfig(kind="hybrid", key_rank=2, query_sharing="stack", query="input")),
    # M14 compressed history: S = 2 and 3 beyond windows W = 1, 2; input queries; low-rank keys.
    ("summaries_W2_S2", ResidualConfig(kind="window", window=2, block_size=2, history="summaries")),
    ("summaries_W1_S3_input", ResidualConfig(kind="window", window=1, block_size=3, history="summaries",
                                             query="input")),
    ("summaries_low_rank_sigmoid", ResidualConfig(kind="window", window=1, block_size=2, history="summaries",
                                                  key_rank=2, activation="sigmoid")),
    # M15 fused output norm: every attention kind, heads, low-rank keys, shared queries.
    ("fused_block_S2", ResidualConfig(kind="block", block_size=2, fuse_out_norm=True)),
    ("fused_hybrid_input", ResidualConfig(kind="hybrid", query="input", fuse_out_norm=True)),
    ("fused_window_heads_sigmoid", ResidualConfig(kind="window", window=2, num_heads=2, activation="sigmoid",
                                                  fuse_out_norm=True)),
    ("fused_low_rank_stack", ResidualConfig(kind="full", key_rank=2, query_sharing="stack", fuse_out_norm=True)),
    ("fused_summaries", ResidualConfig(kind="window", window=1, block_size=2, history="summaries",
                                       fuse_out_norm=True)),
]


def random_problem(rng, config, num_layers=L, tokens=TOKENS, dim=D):
    """Random embedding, sublayer weights `[L, D, D]`, nonzero params and a cotangent."""
    emb = rng.standard_normal(tokens + (dim,))
    weights = rng.standard_normal((num_layers, dim, dim)) / np.sqrt(dim)
    params = {name: rng.standard_normal(shape) * (0.5 if len(shape) == 3 else 1.0)
              for name, shape in config.param_shapes(num_layers, dim).items()}
    cot = rng.standard_normal(emb.shape)
    return emb, weights, params, cot


def check_probe_gradients(rng, check_gradients, config, schedule="direct", num_layers=L):
    emb, weights, params, cot = random_problem(rng, config, num_layers)
    grads = probe_vjp(config, params, emb, weights, cot, schedule=schedule)
    assert sorted(grads) == sorted(["embedding", "sublayer_weights", *params])
    for name, value in grads.items():
        assert value.dtype == np.float64, name

    def loss(embedding, sublayer_weights, **p):
        return np.sum(cot * probe_forward(config, p, embedding, sublayer_weights, schedule=schedule))

    check_gradients(loss, {"embedding": emb, "sublayer_weights": weights, **params}, grads)
    return grads


@pytest.mark.parametrize("name,config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_probe_vjp_matches_finite_differences(rng, check_gradients, name, config):
    grads = check_probe_gradients(rng, check_gradients, config)
    if config.kind == "static":
        # Upper-triangle depth weights are unused: exactly zero gradient.
        assert np.all(np.triu(grads["depth_weights"], 1) == 0)


@pytest.mark.parametrize("block_size", (1, 2, 3, 4, 6))
@pytest.mark.parametrize("sharing,key_rank,fuse", [("none", None, False), ("block", None, False),
                                                   ("none", 2, False), ("none", None, True)])
def test_two_phase_vjp_matches_finite_differences(rng, check_gradients, block_size, sharing, key_rank, fuse):
    config = ResidualConfig.variant("block", block_size=block_size, query_sharing=sharing,
                                    key_rank=key_rank,  # M13: phase 1 with effective queries
                                    fuse_out_norm=fuse)  # M15: the merge's norm composed
    check_probe_gradients(rng, check_gradients, config, schedule="two_phase")


@pytest.mark.parametrize("block_size", (1, 2, 4))
def test_two_phase_vjp_equals_direct_with_one_query_for_the_stack(rng, block_size):
    """M11 'stack': one query row serves every phase 1 and every merge.  (Its finite differences
    at h = 1e-6 carry ~2e-6 truncation error here, since every sublayer's logits move with the
    one shared row: the direct VJP is finite-difference checked in CONFIGS; this pins the
    two-phase VJP to it.)"""
    config = ResidualConfig.variant("block", block_size=block_size, query_sharing="stack")
    emb, weights, params, cot = random_problem(rng, config)
    direct = probe_vjp(config, params, emb, weights, cot)
    two_phase = probe_vjp(config, params, emb, weights, cot, schedule="two_phase")
    for name, value in direct.items():
        np.testing.assert_allclose(two_phase[name], value, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("name", ("full", "block", "gated", "static"))
def test_single_layer_and_single_token(rng, check_gradients, name):
    """L = 1 and an embedding without token axes (`[D]`)."""
    config = ResidualConfig.variant(name)
    emb, weights, params, cot = random_problem(rng, config, num_layers=1, tokens=())
    grads = probe_vjp(config, params, emb, weights, cot)

    def loss(embedding, sublayer_weights, **p):
        return np.sum(cot * probe_forward(config, p, embedding, sublayer_weights))

    check_gradients(loss, {"embedding": emb, "sublayer_weights": weights, **params}, grads)


# -- M10: mix and per-call scale ------------------------------------------------------------
MIXED = [ResidualConfig.variant(n) for n in ("full", "block", "window", "input_query", "multihead")]


@pytest.mark.parametrize("config", MIXED, ids=lambda c: f"{c.kind}-{c.query}-H{c.num_heads}")
def test_mix_ends_are_exact(rng, config):
    emb, weights, params, _ = random_problem(rng, config)
    plain = probe_forward(config, params, emb, weights)
    np.testing.assert_array_equal(probe_forward(config, params, emb, weights, mix=1.0), plain)
    standard = probe_forward(ResidualConfig(kind="standard", eps=config.eps), {}, emb, weights)
    np.testing.assert_array_equal(probe_forward(config, params, emb, weights, mix=0.0), standard)
    assert np.abs(plain - standard).max() > 1e-3  # the two ends differ: the test can fail


@pytest.mark.parametrize("config", MIXED[:3], ids=lambda c: c.kind)
def test_mix_blends_every_input_literally(rng, config):
    """h_l = (1 - a) s_l + a * DA(...) restated with explicit lists (no shared schedule)."""
    from attnres_numpy import depth_attention

    alpha = 0.3
    emb, weights, params, _ = random_problem(rng, config)
    fs = probe_sublayers(weights, config.eps)
    L = len(fs)

    def sources(outputs, l, partial_blocks):
        if config.kind == "full":
            return outputs[:l]
        if config.kind == "window":
            return [outputs[0]] + outputs[max(1, l - config.window):l]
        return partial_blocks

    outputs, blocks, partial = [emb], [emb], None
    S = config.block_size or 1

    def attend(srcs, r):
        return depth_attention(srcs, params["queries"][r], params["norm_weights"][r], eps=config.eps)

    for l in range(1, L + 2):
        srcs = sources(outputs, l, blocks + ([] if partial is None else [partial]))
        h = (1 - alpha) * sum(outputs[:l]) + alpha * attend(srcs, l - 1)
        if l == L + 1:
            expected = h
            break
        v = fs[l - 1](h)
        outputs.append(v)
        partial = v if partial is None else partial + v
        if l % S == 0 or l == L:
            blocks, partial = blocks + [partial], None
    got = probe_forward(config, params, emb, weights, mix=alpha)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config,schedule,alpha", [
    (ResidualConfig.variant("full"), "direct", 0.3),
    (ResidualConfig.variant("hybrid"), "direct", 0.55),
    (ResidualConfig.variant("block", block_size=2), "direct", 0.7),
    (ResidualConfig.variant("block", block_size=2), "two_phase", 0.45),
    (ResidualConfig.variant("input_query"), "direct", 0.2),
    (ResidualConfig.variant("block"), "direct", 0.0),
    (ResidualConfig.variant("fused_out_norm"), "direct", 0.35),  # M15: blend, then the norm
    (ResidualConfig.variant("block", fuse_out_norm=True), "two_phase", 0.6),
    (ResidualConfig.variant("block", fuse_out_norm=True), "direct", 0.0),
])
def test_mix_vjp_matches_finite_differences(rng, check_gradients, config, schedule, alpha):
    emb, weights, params, cot = random_problem(rng, config)
    grads = probe_vjp(config, params, emb, weights, cot, schedule=schedule, mix=alpha)

    def loss(embedding, sublayer_weights, **p):
        return np.sum(cot * probe_forward(config, {**params, **p}, embedding, sublayer_weights,
                                          schedule=schedule, mix=alpha))

    if alpha == 0.0:  # M10: no depth attention at alpha = 0, so its parameters get zeros
        attention = [n for n in params if n != "out_norm_weights"]  # M15's norm still applies
        assert all(np.all(grads[n] == 0) for n in attention)
        checked = {"embedding": emb, "sublayer_weights": weights,
                   **{n: v for n, v in params.items() if n not in attention}}
    else:
        checked = {"embedding": emb, "sublayer_weights": weights, **params}
    check_gradients(loss, checked, {k: grads[k] for k in checked})


def test_two_phase_mix_equals_direct(rng):
    config = ResidualConfig.variant("block", block_size=3)
    emb, weights, params, _ = random_problem(rng, config)
    np.testing.assert_allclose(probe_forward(config, params, emb, weights, schedule="two_phase", mix=0.6),
                               probe_forward(config, params, emb, weights, mix=0.6), rtol=1e-12, atol=1e-12)


def test_call_scale_equals_config_scale(rng):
    config = ResidualConfig.variant("block", block_size=2)
    emb, weights, params, _ = random_problem(rng, config)
    want = probe_forward(dataclasses.replace(config, scale=2.5), params, emb, weights)
    np.testing.assert_array_equal(probe_forward(config, params, emb, weights, scale=2.5), want)
    assert np.abs(want - probe_forward(config, params, emb, weights)).max() > 1e-6


@pytest.mark.parametrize("kw,match", [
    (dict(mix=1.5), "mix: expected a real number in \\[0, 1\\]"),
    (dict(mix=-0.1), "mix: expected a real number in \\[0, 1\\]"),
    (dict(mix=True), "mix: expected a real number"),
    (dict(mix="half"), "mix: expected a real number"),
    (dict(scale=float("nan")), "scale: expected a finite real number"),
    (dict(scale="2"), "scale: expected a finite real number"),
])
def test_call_input_errors(rng, kw, match):
    config = ResidualConfig.variant("full")
    emb, weights, params, _ = random_problem(rng, config)
    with pytest.raises(ValueError, match=match):
        probe_forward(config, params, emb, weights, **kw)


def test_mix_needs_an_attention_kind(rng):
    emb, weights, _, _ = random_problem(rng, ResidualConfig(kind="standard"))
    with pytest.raises(ValueError, match="mix: .* attention kind"):
        stack_forward(ResidualConfig(kind="standard"), {}, emb, probe_sublayers(weights, 1e-6), mix=0.5)
