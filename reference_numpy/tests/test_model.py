"""Forward semantics of the residual schemes (spec sections 4-6, M1-M9).

`naive_stack` below restates the spec's definitions literally (explicit source lists, no shared
state, no tape) and serves as an independent oracle for `stack_forward` / `probe_forward`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from attnres_numpy import (
    VARIANT_KINDS,
    ResidualConfig,
    depth_attention,
    probe_forward,
    probe_sublayers,
    probe_vjp,
    rmsnorm,
    stack_forward,
)

L, TOKENS, D = 5, (2, 3), 4


def naive_stack(config, params, emb, fs):
    """The spec's equations, one sublayer at a time, written independently of model.py."""
    eps, L_ = config.eps, len(fs)

    def rms(x):
        return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps)

    if config.fuse_out_norm:  # M15 restated: fs are the sublayers without their pre-norm
        g, inner = params["out_norm_weights"], fs
        prenormed = [lambda h, l=l: inner[l](rms(h) * g[l]) for l in range(L_)]
        plain = dataclasses.replace(config, fuse_out_norm=False)
        return rms(naive_stack(plain, params, emb, prenormed)) * g[L_]

    def da(sources, r):
        # M11 restated: a shared query serves its block (or the stack); the output keeps the last row.
        if r == L_:
            r = params["norm_weights"].shape[0] - 1
        elif config.query_sharing != "none":
            r = r // config.block_size if config.query_sharing == "block" else 0
        q = params["queries"][r] if config.query == "static" else rms(sources[-1]) @ params["query_weights"][r]
        if config.key_rank is not None:  # M13 restated literally: r-dim keys, r-dim query
            P, g = params["key_projection"], params["norm_weights"][r]
            keys = [((rms(x) if config.key_norm else x) @ P) * g for x in sources]
            z = np.stack([config.scale * np.sum(q * k, axis=-1) for k in keys])
            p = (1.0 / (1.0 + np.exp(-z)) if config.activation == "sigmoid"
                 else np.exp(z - z.max(0)) / np.exp(z - z.max(0)).sum(0))
            return sum(p[i][..., None] * x for i, x in enumerate(sources))
        return depth_attention(sources, q, params["norm_weights"][r], eps=eps, scale=config.scale,
                               num_heads=config.num_heads, activation=config.activation,
                               key_norm=config.key_norm)

    v = [emb]
    if config.kind in ("standard", "scalar", "gated"):
        h = emb
        for l in range(1, L_ + 1):
            out = fs[l - 1](h)
            if config.kind == "scalar":
                out = params["alphas"][l - 1] * out
            if config.kind == "gated":
                z = rms(h) @ params["gate_weights"][l - 1] + params["gate_biases"][l - 1]
                out = out / (1.0 + np.exp(-z))
            h = h + out
        return h
    if config.kind == "static":
        for l in range(1, L_ + 2):
            h = sum(params["depth_weights"][l - 1, i] * v[i] for i in range(l))
            if l <= L_:
                v.append(fs[l - 1](h))
        return h
    if config.kind == "full":
        for l in range(1, L_ + 1):
            v.append(fs[l - 1](da(v[:l], l - 1)))
        return da(v, L_)
    if config.kind == "hybrid":  # M12: attend over the states, keep the residual path
        states = [emb]
        for l in range(1, L_ + 1):
            c = da(states, l - 1)
            states.append(c + fs[l - 1](c))
        return da(states, L_)
    if config.history == "summaries":  # M14 restated: v_0, sums of old complete blocks, the rest
        S, W = config.block_size, config.window

        def srcs(l):
            m = max(l - 1 - W, 0) // S  # complete blocks n with nS <= l - 1 - W
            sums = [sum(v[j] for j in range((n - 1) * S + 1, n * S + 1)) for n in range(1, m + 1)]
            return [v[0]] + sums + [v[j] for j in range(m * S + 1, l)]
        for l in range(1, L_ + 1):
            v.append(fs[l - 1](da(srcs(l), l - 1)))
        return da(srcs(L_ + 1), L_)
    if config.kind == "window":
        def srcs(l):
            return [v[0]] + [v[j] for j in range(max(1, l - config.window), l)]
        for l in range(1, L_ + 1):
            v.append(fs[l - 1](da(srcs(l), l - 1)))
        return da(srcs(L_ + 1), L_)
    S = config.block_size

    def block(m):  # b_m = sum of block m's outputs (m >= 1); b_0 = v_0.
        return v[0] if m == 0 else sum(v[j] for j in range((m - 1) * S + 1, min(m * S, L_) + 1))

    for l in range(1, L_ + 1):
        n = (l - 1) // S + 1
        first = (n - 1) * S + 1
        sources = [block(m) for m in range(n)]
        if l > first:
            sources.append(sum(v[j] for j in range(first, l)))
        v.append(fs[l - 1](da(sources, l - 1)))
    return da([block(m) for m in range(math.ceil(L_ / S) + 1)], L_)


def random_problem(rng, config, num_layers=L, tokens=TOKENS):
    emb = rng.standard_normal(tokens + (D,))
    weights = rng.standard_normal((num_layers, D, D)) / np.sqrt(D)
    params = {name: rng.standard_normal(shape) * (0.5 if len(shape) == 3 else 1.0)
              for name, shape in config.param_shapes(num_layers, D).items()}
    return emb, weights, params


CONFIGS = [ResidualConfig.variant(name) for name in VARIANT_KINDS]
CONFIGS += [ResidualConfig.variant("block", block_size=s) for s in (1, 3, 4, 5, 7)]
CONFIGS += [ResidualConfig.variant("window", window=w) for w in (1, 3, 6)]
CONFIGS += [ResidualConfig(kind="block", block_size=2, query="input", num_heads=2, activation="sigmoid")]
# M13 low-rank keys (r < D) with every attention kind and option they combine with.
CONFIGS += [ResidualConfig(kind="full", key_rank=2), ResidualConfig(kind="full", key_rank=1, query="input"),
            ResidualConfig(kind="block", block_size=2, key_rank=3, activation="sigmoid"),
            ResidualConfig(kind="window", window=2, key_rank=2, key_norm=False, scale=0.7),
            ResidualConfig(kind="hybrid", key_rank=3, query="input", query_sharing="stack")]
# M14 compressed history: windows and summary blocks, S = 1 (= full), S beyond L (never summarizes).
CONFIGS += [ResidualConfig(kind="window", window=w, block_size=s, history="summaries")
            for w, s in ((1, 1), (1, 3), (2, 2), (3, 2), (1, 9))]
CONFIGS += [ResidualConfig(kind="window", window=1, block_size=2, history="summaries", query="input",
                           key_rank=2)]
# M15 fused output norm with every attention kind and the options it meets.
CONFIGS += [ResidualConfig(kind="block", block_size=2, fuse_out_norm=True),
            ResidualConfig(kind="hybrid", query="input", fuse_out_norm=True),
            ResidualConfig(kind="window", window=2, num_heads=2, activation="sigmoid", fuse_out_norm=True),
            ResidualConfig(kind="full", key_rank=2, query_sharing="stack", fuse_out_norm=True),
            ResidualConfig(kind="window", window=1, block_size=2, history="summaries", fuse_out_norm=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_probe_forward_matches_spec_equations(rng, config):
    emb, weights, params = random_problem(rng, config)
    fs = probe_sublayers(weights, config.eps, prenorm=not config.fuse_out_norm)
    expected = naive_stack(config, params, emb, fs)
    out = probe_forward(config, params, emb, weights)
    assert out.shape == emb.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("kind", ("standard", "gated", "static", "full", "block", "window"))
def test_stack_forward_drives_arbitrary_sublayers(rng, kind):
    """Sublayers are any callables h -> v (here not the probe: sin/cos mixes of their input)."""
    config = ResidualConfig.variant(kind)
    emb, _, params = random_problem(rng, config)
    mats = rng.standard_normal((L, D, D))
    fs = [lambda h, m=m, k=k: np.sin(h @ m) + 0.1 * k * np.cos(h) for k, m in enumerate(mats)]
    np.testing.assert_allclose(stack_forward(config, params, emb, fs), naive_stack(config, params, emb, fs),
                               rtol=1e-13, atol=1e-14)


def test_probe_sublayer_definition(rng):
    w = rng.standard_normal((2, D, D))
    h = rng.standard_normal(TOKENS + (D,))
    f = probe_sublayers(w, 1e-3)
    assert len(f) == 2
    expected = np.tanh((h / np.sqrt(np.mean(h ** 2, -1, keepdims=True) + 1e-3)) @ w[1])
    np.testing.assert_allclose(f[1](h), expected, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(rmsnorm(h, 1e-3), h / np.sqrt(np.mean(h * h, -1, keepdims=True) + 1e-3))


def test_block_size_one_equals_full_bitwise(rng):
    full, block = ResidualConfig(kind="full"), ResidualConfig(kind="block", block_size=1)
    emb, weights, params = random_problem(rng, full)
    cot = rng.standard_normal(emb.shape)
    np.testing.assert_array_equal(probe_forward(block, params, emb, weights),
                                  probe_forward(full, params, emb, weights))
    g_block, g_full = probe_vjp(block, params, emb, weights, cot), probe_vjp(full, params, emb, weights, cot)
    for name in g_full:
        np.testing.assert_array_equal(g_block[name], g_full[name])


def test_window_covering_all_layers_equals_full_bitwise(rng):
    full, window = ResidualConfig(kind="full"), ResidualConfig(kind="window", window=L)
    emb, weights, params = random_problem(rng, full)
    np.testing.assert_array_equal(probe_forward(window, params, emb, weights),
                                  probe_forward(full, params, emb, weights))


@pytest.mark.parametrize("block_size", (1, 2, 3, 4, 5, 8))
def test_two_phase_equals_direct(rng, block_size):
    """M9 at model level: forward and every gradient agree to rounding."""
    config = ResidualConfig.variant("block", block_size=block_size, eps=1e-5, scale=1.2)
    emb, weights, params = random_problem(rng, config)
    cot = rng.standard_normal(emb.shape)
    np.testing.assert_allclose(probe_forward(config, params, emb, weights, schedule="two_phase"),
                               probe_forward(config, params, emb, weights), rtol=1e-13, atol=1e-14)
    direct = probe_vjp(config, params, emb, weights, cot)
    two_phase = probe_vjp(config, params, emb, weights, cot, schedule="two_phase")
    for name in direct:
        np.testing.assert_allclose(two_phase[name], direct[name], rtol=1e-12, atol=1e-13, err_msg=name)


def test_two_phase_with_user_sublayers(rng):
    config = ResidualConfig.variant("block", block_size=3)
    emb, _, params = random_problem(rng, config)
    mats = rng.standard_normal((L, D, D))
    fs = [lambda h, m=m: np.sin(h @ m) for m in mats]
    np.testing.assert_allclose(stack_forward(config, params, emb, fs, schedule="two_phase"),
                               stack_forward(config, params, emb, fs), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("kind,block_size", [("full", None), ("block", 2), ("block", 3)])
@pytest.mark.parametrize("activation", ("softmax", "sigmoid"))
@pytest.mark.parametrize("gains", ("init", "random"))
def test_zero_queries_compute_the_prenorm_baseline(rng, kind, block_size, activation, gains):
    """Zero pseudo-queries make every aggregation a uniform average (softmax) or half the sum
    (sigmoid) of sources that add up to the standard residual stream, so with a tiny eps
    (scale-invariant rmsnorm) the model equals the standard PreNorm stack with the same
    sublayer weights after a final rmsnorm.  eps = 1e-15 perturbs each norm by ~eps / mean(h^2);
    over 1200 random cases the largest difference was 1.1e-12 (1.1e-9 with eps = 1e-12), so the
    tolerance is rtol = atol = 1e-10."""
    eps = 1e-15
    config = ResidualConfig(kind=kind, block_size=block_size, activation=activation, eps=eps)
    standard = ResidualConfig(kind="standard", eps=eps)
    emb, weights, _ = random_problem(rng, config)
    params = config.init_params(L, D)
    assert not params["queries"].any()
    if gains == "random":
        params["norm_weights"] = rng.standard_normal((L + 1, D))
    ours = rmsnorm(probe_forward(config, params, emb, weights), eps)
    base = rmsnorm(probe_forward(standard, {}, emb, weights), eps)
    np.testing.assert_allclose(ours, base, rtol=1e-10, atol=1e-10)


def test_static_init_equals_standard_exactly(rng):
    static = ResidualConfig(kind="static")
    emb, weights, _ = random_problem(rng, static, num_layers=6)
    params = static.init_params(6, D)
    np.testing.assert_array_equal(probe_forward(static, params, emb, weights),
                                  probe_forward(ResidualConfig(kind="standard"), {}, emb, weights))


def test_scalar_and_gated_reduce_to_standard(rng):
    """alphas = 1 is standard exactly; a saturated gate (bias 800) is standard to rounding."""
    emb, weights, _ = random_problem(rng, ResidualConfig(kind="standard"))
    base = probe_forward(ResidualConfig(kind="standard"), {}, emb, weights)
    scalar = ResidualConfig(kind="scalar")
    np.testing.assert_array_equal(probe_forward(scalar, scalar.init_params(L, D), emb, weights), base)
    gated = ResidualConfig(kind="gated")
    params = {"gate_weights": np.zeros((L, D, D)), "gate_biases": np.full((L, D), 800.0)}
    np.testing.assert_array_equal(probe_forward(gated, params, emb, weights), base)
    # The M8 init (zero gate params) halves every update.
    half = probe_forward(scalar, {"alphas": np.full(L, 0.5)}, emb, weights)
    np.testing.assert_array_equal(probe_forward(gated, gated.init_params(L, D), emb, weights), half)


@pytest.mark.parametrize("name", ("full", "block", "window", "multihead", "sigmoid"))
def test_model_tokens_are_independent(rng, name):
    config = ResidualConfig.variant(name)
    emb, weights, params = random_problem(rng, config, tokens=(7,))
    perm = rng.permutation(7)
    np.testing.assert_allclose(probe_forward(config, params, emb[perm], weights),
                               probe_forward(config, params, emb, weights)[perm], rtol=1e-14, atol=1e-15)


def test_token_shape_is_free(rng):
    """Any leading token shape: [D], [T, D], [B, T, D] give the same per-token results."""
    config = ResidualConfig.variant("input_query")
    emb, weights, params = random_problem(rng, config, tokens=(2, 3))
    out = probe_forward(config, params, emb, weights)
    np.testing.assert_allclose(probe_forward(config, params, emb.reshape(6, D), weights), out.reshape(6, D),
                               rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(probe_forward(config, params, emb[1, 2], weights), out[1, 2],
                               rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("config,counts", [
    (ResidualConfig(kind="full"), [1, 2, 3, 4, 5, 6]),
    (ResidualConfig(kind="window", window=2), [1, 2, 3, 3, 3, 3]),
    (ResidualConfig(kind="block", block_size=2), [1, 2, 2, 3, 3, 4]),
    (ResidualConfig(kind="block", block_size=2, num_heads=2), [1, 2, 2, 3, 3, 4]),
])
def test_return_weights(rng, config, counts):
    emb, weights, params = random_problem(rng, config)
    fs = probe_sublayers(weights, config.eps)
    out, ws = stack_forward(config, params, emb, fs, return_weights=True)
    np.testing.assert_array_equal(out, stack_forward(config, params, emb, fs))
    heads = (config.num_heads,) if config.num_heads > 1 else ()
    assert [w.shape for w in ws] == [(n,) + TOKENS + heads for n in counts]
    for w in ws:
        np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=1e-14)


def test_low_precision_embedding_is_upcast(rng):
    config = ResidualConfig.variant("block")
    emb, weights, params = random_problem(rng, config)
    emb32 = emb.astype(np.float32)
    np.testing.assert_array_equal(probe_forward(config, params, emb32, weights),
                                  probe_forward(config, params, emb32.astype(np.float64), weights))


# -- M13 low-rank keys ---------------------------------------------------------------------------
def test_low_rank_keys_init_keeps_uniform_weights_and_projection_identity_columns(rng):
    """M8 with M13: queries zero (uniform weights, the same model as full AttnRes at init) and
    key_projection = I[:, :r] (not zero, so the queries get a gradient from the first step)."""
    config = ResidualConfig(kind="full", key_rank=3)
    params = config.init_params(L, D)
    assert config.param_shapes(L, D) == {"queries": (L + 1, 3), "norm_weights": (L + 1, 3),
                                         "key_projection": (D, 3)}
    np.testing.assert_array_equal(params["key_projection"], np.eye(D)[:, :3])
    emb, weights, _ = random_problem(rng, config)
    full = ResidualConfig(kind="full")
    np.testing.assert_allclose(probe_forward(config, params, emb, weights),
                               probe_forward(full, full.init_params(L, D), emb, weights), rtol=1e-14, atol=1e-15)
    grads = probe_vjp(config, params, emb, weights, rng.standard_normal(emb.shape))
    assert np.abs(grads["queries"]).min(axis=1).max() > 0  # every query row learns


def test_low_rank_keys_with_identity_projection_equal_full_rank(rng):
    """key_rank = D with P = I is the full-rank scheme with the same queries (q = P q_r = q_r)."""
    low, full = ResidualConfig(kind="window", window=2, key_rank=D, query="input"), \
        ResidualConfig(kind="window", window=2, query="input")
    emb, weights, params = random_problem(rng, full)
    np.testing.assert_allclose(probe_forward(low, {**params, "key_projection": np.eye(D)}, emb, weights),
                               probe_forward(full, params, emb, weights), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("block_size", (1, 2, 3))
def test_low_rank_keys_two_phase_equals_direct(rng, block_size):
    """M13 under M9: phase 1 takes the block's effective queries q_r P^T `[S, D]`."""
    config = ResidualConfig(kind="block", block_size=block_size, key_rank=2)
    emb, weights, params = random_problem(rng, config)
    cot = rng.standard_normal(emb.shape)
    np.testing.assert_allclose(probe_forward(config, params, emb, weights, schedule="two_phase"),
                               probe_forward(config, params, emb, weights), rtol=1e-13, atol=1e-14)
    direct = probe_vjp(config, params, emb, weights, cot)
    two_phase = probe_vjp(config, params, emb, weights, cot, schedule="two_phase")
    for name in direct:
        np.testing.assert_allclose(two_phase[name], direct[name], rtol=1e-12, atol=1e-13, err_msg=name)


# -- M14 compressed history ----------------------------------------------------------------------
class _Labels:
    wants_weights = False

    def __init__(self):
        self.reads = []

    def depth_attention(self, row, labels, sources, weights):
        self.reads.append(labels)

    def sublayer(self, layer, h, v):
        pass


def test_compressed_history_sources_and_count():
    """M14 with W = 1, S = 2 over L = 7: each read sees v_0, the sums of the complete blocks
    with nS <= l - 1 - W, then every later output; at most 1 + floor((l-1-W)/S) + W + S - 1
    arrays instead of l."""
    from attnres_core.schedule import run_schedule
    from attnres_numpy.tape import Tape

    config = ResidualConfig(kind="window", window=1, block_size=2, history="summaries")
    L7 = 7
    tape = Tape(config.init_params(L7, D), record=False)
    seen = _Labels()
    run_schedule(config, tape, tape.var(np.ones(D)), [lambda h: h] * L7, observer=seen)
    assert seen.reads == [
        ["v0"], ["v0", "v1"], ["v0", "v1", "v2"], ["v0", "b1", "v3"], ["v0", "b1", "v3", "v4"],
        ["v0", "b1", "b2", "v5"], ["v0", "b1", "b2", "v5", "v6"], ["v0", "b1", "b2", "b3", "v7"]]
    W, S = 1, 2
    for l, labels in enumerate(seen.reads, start=1):
        assert len(labels) <= 1 + max(l - 1 - W, 0) // S + W + S - 1


def test_compressed_history_reduces_to_window_and_full(rng):
    """S = 1 is full AttnRes (a block of one output is the output); a summary block longer
    than L is never complete, so nothing is summarized (full again)."""
    full = ResidualConfig(kind="full")
    emb, weights, params = random_problem(rng, full)
    want = probe_forward(full, params, emb, weights)
    for s in (1, L + 1):
        config = ResidualConfig(kind="window", window=2, block_size=s, history="summaries")
        np.testing.assert_array_equal(probe_forward(config, params, emb, weights), want)
