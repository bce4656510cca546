"""The Flax NNX decoder example: PreNorm -> Block AttnRes keeps the function at init, the weights
load with nnx.update, and the converted model trains under nnx.jit (kept small: ~5 s)."""

from __future__ import annotations

import pytest

pytest.importorskip("flax", reason="the example needs the flax extra")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from attnres_core.config import ResidualConfig  # noqa: E402
from flax import nnx  # noqa: E402

from examples.jax_decoder import Decoder, train_step  # noqa: E402


def _pair(config):
    prenorm = Decoder(64, 16, 2, 2, rngs=nnx.Rngs(0))
    model = Decoder(64, 16, 2, 2, config, rngs=nnx.Rngs(1))
    nnx.update(model, nnx.state(prenorm))
    return prenorm, model


@pytest.mark.parametrize("config", [ResidualConfig(kind="full"), ResidualConfig(kind="block", block_size=2)])
def test_conversion_is_prenorm_at_init(config):
    prenorm, model = _pair(config)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 64)
    ref = prenorm(tokens)
    assert model(tokens).shape == (2, 8, 64)
    assert float(jnp.abs(model(tokens) - ref).max()) <= 1e-4 * (1 + float(jnp.abs(ref).max()))
    model.router.queries[...] = model.router.queries[...] + 0.5  # negative control
    assert float(jnp.abs(model(tokens) - ref).max()) > 1e-3


def test_converted_model_trains():
    _, model = _pair(ResidualConfig(kind="block", block_size=2))
    text = jnp.array(list(b"abcabcabcabcabcabc"))[None] % 64
    losses = [float(train_step(model, text)) for _ in range(6)]
    assert losses[-1] < losses[0]
    assert float(jnp.abs(model.router.queries[...]).max()) > 0  # the router learns too
