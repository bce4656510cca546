"""The mlx.nn decoder example: PreNorm -> Block AttnRes keeps the function at init, the weights
load with Module.update, and the example's training loop lowers the loss."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from attnres_core.config import ResidualConfig

from examples import mlx_decoder as decoder


@pytest.mark.parametrize("config", [ResidualConfig(kind="full"), ResidualConfig(kind="block", block_size=2)])
def test_conversion_is_prenorm_at_init(config):
    mx.random.seed(0)
    prenorm = decoder.Decoder(64, 16, 2, 2)
    model = decoder.Decoder(64, 16, 2, 2, config)
    model.update(prenorm.parameters())
    tokens = mx.random.randint(0, 64, (2, 8))
    ref = prenorm(tokens)
    assert model(tokens).shape == (2, 8, 64)
    assert mx.abs(model(tokens) - ref).max().item() <= 1e-4 * (1 + mx.abs(ref).max().item())
    model.router.queries = model.router.queries + 0.5  # negative control
    assert mx.abs(model(tokens) - ref).max().item() > 1e-3


def test_example_main_trains(capsys):
    assert decoder.main([]) == 0
    out = capsys.readouterr().out
    first, last = (float(x) for x in re.findall(r"loss ([0-9.]+)", out))
    assert "logits (2, 32, 256); router parameters 1152" in out and last < first - 1.0
