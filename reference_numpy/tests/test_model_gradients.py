"""Central finite differences (float64) of the probe network against the hand-written probe_vjp:
every variant, the embedding, the sublayer weights and every parameter (random nonzero values)."""

from __future__ import annotations

import numpy as np
import pytest
from attnres_numpy import VARIANT_KINDS, ResidualConfig, probe_forward, probe_vjp

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
def test_two_phase_vjp_matches_finite_differences(rng, check_gradients, block_size):
    check_probe_gradients(rng, check_gradients, ResidualConfig.variant("block", block_size=block_size),
                          schedule="two_phase")


@pytest.mark.parametrize("name", ("full", "block", "gated", "static"))
def test_single_layer_and_single_token(rng, check_gradients, name):
    """L = 1 and an embedding without token axes (`[D]`)."""
    config = ResidualConfig.variant(name)
    emb, weights, params, cot = random_problem(rng, config, num_layers=1, tokens=())
    grads = probe_vjp(config, params, emb, weights, cot)

    def loss(embedding, sublayer_weights, **p):
        return np.sum(cot * probe_forward(config, p, embedding, sublayer_weights))

    check_gradients(loss, {"embedding": emb, "sublayer_weights": weights, **params}, grads)
