"""Converting a realistic PreNorm decoder to Block AttnRes, in PyTorch.

A PreNorm decoder block is `h = h + attn(norm(h), mask)` then `h = h + mlp(norm(h))`.  AttnRes
keeps the two sublayers exactly as they are (each with its own pre-norm) and replaces the two
additions: the model feeds each sublayer `stream.input()` and hands its output to
`stream.push(...)`, and `stream.output()` replaces the last `h`.  Everything outside the router
keeps its name, so a PreNorm checkpoint loads into the converted model with `strict=False` (only
the router's parameters are new), and with the router's zero-initialized pseudo-queries the
converted model computes the same logits as the PreNorm one (uniform depth weights divide the
stream by a positive number, which the next RMSNorm undoes).

    python examples/torch_decoder.py
"""

from __future__ import annotations

import sys
from typing import List, Optional

import torch
import torch.nn.functional as F
from attnres_torch import DepthRouter, ResidualConfig
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention with its own pre-norm; `mask [T, T]` (True = may attend)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.num_heads = num_heads

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for t in self.qkv(self.norm(h)).chunk(3, dim=-1))   # [B, H, T, Dh]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """SwiGLU MLP with its own pre-norm."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nn.Module):
    """The usual PreNorm block; AttnRes calls its two sublayers one by one instead of forward."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.attention = Attention(dim, num_heads)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(h, mask)
        return h + self.mlp(h)


class Decoder(nn.Module):
    """tokens `[B, T]` -> logits `[B, T, vocab]`; `residual=None` is the PreNorm model, a
    `ResidualConfig` its AttnRes conversion (L = 2 * num_blocks sublayers)."""

    def __init__(self, vocab: int, dim: int, num_blocks: int, num_heads: int,
                 residual: Optional[ResidualConfig] = None):
        super().__init__()
        if residual is not None and residual.fuse_out_norm:
            raise ValueError("residual: this example's sublayers keep their own pre-norms, so "
                             "fuse_out_norm=True (M15) would norm twice; see AttnResTransformer")
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, num_heads) for _ in range(num_blocks))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.router = None if residual is None else DepthRouter(residual, 2 * num_blocks, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()  # causal
        h = self.embed(tokens)
        if self.router is None:                          # PreNorm: h = h + f(h), twice per block
            for block in self.blocks:
                h = block(h, mask)
        else:                                            # Block AttnRes: the router mixes depth
            stream = self.router.stream(h)
            for block in self.blocks:
                stream.push(block.attention(stream.input(), mask))
                stream.push(block.mlp(stream.input()))
            h = stream.output()
        return self.head(self.norm(h))


def convert(prenorm: Decoder, residual: ResidualConfig) -> Decoder:
    """A copy of `prenorm` with the residual scheme `residual` (new router, same other weights)."""
    attn = Decoder(prenorm.embed.num_embeddings, prenorm.embed.embedding_dim, len(prenorm.blocks),
                   prenorm.blocks[0].attention.num_heads, residual)
    missing = attn.load_state_dict(prenorm.state_dict(), strict=False).missing_keys
    assert all(k.startswith("router.") for k in missing), missing
    return attn


def main(argv: Optional[List[str]] = None) -> int:
    torch.manual_seed(0)
    prenorm = Decoder(vocab=256, dim=64, num_blocks=4, num_heads=4)
    model = convert(prenorm, ResidualConfig(kind="block", block_size=4))   # 8 sublayers, 2 blocks
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        diff = (model(tokens) - prenorm(tokens)).abs().max().item()
    print(f"logits {tuple(model(tokens).shape)}; router parameters "
          f"{sum(p.numel() for p in model.router.parameters())}; "
          f"max |AttnRes - PreNorm| at init {diff:.1e} (zero queries: the same function up to rounding)")
    text = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 8))[None]    # [1, 224] bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(20):
        logits = model(text[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), text[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (0, 19):
            print(f"step {step + 1:2d}: loss {loss.item():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
