"""Converting a realistic PreNorm decoder to Block AttnRes, in MLX (`mlx.nn`).

A PreNorm decoder block is `h = h + attn(norm(h), mask)` then `h = h + mlp(norm(h))`.  AttnRes
keeps both sublayers as they are (each with its own pre-norm) and hands them to
`attnres_mlx.DepthRouter`, which replaces the additions.  The router is the only new module, so a
PreNorm model's weights load with `model.update(prenorm.parameters())`, and with the router's
zero-initialized pseudo-queries the converted model computes the same logits.

    python examples/mlx_decoder.py
"""

from __future__ import annotations

import sys
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from attnres_core.config import ResidualConfig
from attnres_mlx import DepthRouter


class Attention(nn.Module):
    """Multi-head self-attention with its own pre-norm; `mask [T, T]` (additive, -inf = masked)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.num_heads = num_heads

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        b, t, d = h.shape
        q, k, v = (x.reshape(b, t, self.num_heads, -1).transpose(0, 2, 1, 3)
                   for x in mx.split(self.qkv(self.norm(h)), 3, axis=-1))
        y = mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
        return self.out(y.transpose(0, 2, 1, 3).reshape(b, t, d))


class MLP(nn.Module):
    """SwiGLU MLP with its own pre-norm."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def __call__(self, h: mx.array) -> mx.array:
        x = self.norm(h)
        return self.down(nn.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nn.Module):
    """The usual PreNorm block; AttnRes calls its two sublayers one by one instead."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.attention = Attention(dim, num_heads)
        self.mlp = MLP(dim, 4 * dim)

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        h = h + self.attention(h, mask)
        return h + self.mlp(h)


class Decoder(nn.Module):
    """tokens `[B, T]` -> logits `[B, T, vocab]`; `residual=None` is the PreNorm model, a
    `ResidualConfig` its AttnRes conversion (L = 2 * num_blocks sublayers)."""

    def __init__(self, vocab: int, dim: int, num_blocks: int, num_heads: int,
                 residual: Optional[ResidualConfig] = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = [DecoderBlock(dim, num_heads) for _ in range(num_blocks)]
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        if residual is not None:
            self.router = DepthRouter(residual, 2 * num_blocks, dim)

    def __call__(self, tokens: mx.array) -> mx.array:
        mask = nn.MultiHeadAttention.create_additive_causal_mask(tokens.shape[1])   # causal
        h = self.embed(tokens)
        if "router" not in self:                                     # PreNorm: h = h + f(h)
            for block in self.blocks:
                h = block(h, mask)
        else:                                                        # Block AttnRes
            sublayers = []
            for block in self.blocks:
                sublayers += [lambda h, b=block: b.attention(h, mask), lambda h, b=block: b.mlp(h)]
            h = self.router(h, sublayers)
        return self.head(self.norm(h))


def _loss(model: Decoder, text: mx.array) -> mx.array:
    logits = model(text[:, :-1])
    return nn.losses.cross_entropy(logits, text[:, 1:], reduction="mean")


def main(argv: Optional[List[str]] = None) -> int:
    mx.random.seed(0)
    prenorm = Decoder(256, 64, 4, 4)
    model = Decoder(256, 64, 4, 4, ResidualConfig(kind="block", block_size=4))
    model.update(prenorm.parameters())       # the PreNorm weights; the router keeps its init
    tokens = mx.random.randint(0, 256, (2, 32))
    diff = mx.abs(model(tokens) - prenorm(tokens)).max().item()
    router_params = sum(v.size for _, v in nn.utils.tree_flatten(model.router.parameters()))
    print(f"logits {tuple(model(tokens).shape)}; router parameters {router_params}; "
          f"max |AttnRes - PreNorm| at init {diff:.1e} (zero queries: the same function up to rounding)")
    text = mx.array(list(b"def f(x):\n    return x + 1\n" * 8))[None]    # [1, 224] bytes
    optimizer = optim.AdamW(learning_rate=3e-3)
    loss_and_grad = nn.value_and_grad(model, _loss)
    for step in range(20):
        loss, grads = loss_and_grad(model, text)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        if step in (0, 19):
            print(f"step {step + 1:2d}: loss {loss.item():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
