"""FSDP2 per layer on your own converted model (docs/usage.md, "Converting a real model"), on a
local gloo world of 2 CPU processes against one process.

The own-model route calls `block.attention` and `block.mlp` through the router's stream and never
`block.forward`, so `fully_shard(block)` installs its unshard hook where nothing calls it: torch
would fail inside the sublayer ("got mixed torch.Tensor and DTensor"); the router's stream refuses
it first with a ValueError that names the fix. The recipe that
works shards what the router calls, both sublayers of a block as one FSDP2 group,
`fully_shard([block.attention, block.mlp])` (one all-gather per block, as `fully_shard(block)`),
then the root. Its loss, every gradient and a second step after AdamW equal the one-process run."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnres_torch import ResidualConfig
from attnres_torch.distributed import run_local

from examples.torch_decoder import Decoder

CONFIGS = {"block": ResidualConfig(kind="block", block_size=2), "full": ResidualConfig(kind="full")}


def _model(kind):
    torch.manual_seed(0)
    model = Decoder(64, 16, 3, 2, CONFIGS[kind])
    with torch.no_grad():  # trained-looking router rows: the depth weights are not uniform
        for p in model.router.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _tokens():
    return torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))


def _loss(model, tokens):
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _two_steps(model, tokens, scale=1.0):
    """Loss, gradients, one AdamW step, the second loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = _loss(model, tokens)
    (loss * scale).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    return loss.item(), grads, _loss(model, tokens).item()


def _rank(rank, world, kind):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    tokens = _tokens()[2 * rank: 2 * rank + 2]
    # the plain per-block recipe: the block's hook never runs, so the first sublayer would meet
    # sharded weights; the router's guard refuses it before torch's "mixed torch.Tensor and DTensor"
    naive = _model(kind)
    for block in naive.blocks:
        fully_shard(block)
    fully_shard(naive)
    with pytest.raises(ValueError, match=re.escape("fully_shard([block.attention, block.mlp])")) as e:
        naive(tokens)
    naive_error = str(e.value)
    # the recipe that works: one FSDP2 group per block over the sublayers the router calls
    model = _model(kind)
    for block in model.blocks:
        fully_shard([block.attention, block.mlp])
    fully_shard(model)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    loss, grads, second = _two_steps(model, tokens)
    grads = {n: g.full_tensor().numpy() for n, g in grads.items()}
    return naive_error, sharded, loss, grads, second


@pytest.mark.parametrize("kind", ["block", "full"])
def test_fsdp2_per_block_on_own_model_equals_one_process(kind):
    results = run_local(_rank, 2, kind, timeout=300)
    model = _model(kind)
    tokens = _tokens()
    # one process: the same two micro-batches, the mean of their gradients, then one AdamW step
    losses = []
    for r in range(2):
        loss = _loss(model, tokens[2 * r: 2 * r + 2])
        (loss / 2).backward()
        losses.append(loss.item())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    seconds = [_loss(model, tokens[2 * r: 2 * r + 2]).item() for r in range(2)]
    for r, (naive_error, sharded, loss, got, second) in enumerate(results):
        assert naive_error.startswith("FSDP2: blocks.0.attention ran outside the forward of its "
                                      "FSDP2 module 'blocks.0' (DecoderBlock)"), naive_error
        assert sharded
        assert loss == pytest.approx(losses[r], rel=1e-6)
        assert second == pytest.approx(seconds[r], rel=1e-6)
        assert got.keys() == grads.keys() and any(n.startswith("router.") for n in got)
        for name, g in grads.items():
            np.testing.assert_allclose(got[name], g.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
