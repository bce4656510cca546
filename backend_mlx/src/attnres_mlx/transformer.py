"""A small decoder-only Transformer on `DepthRouter` (spec section 4, M1): every attention and
every MLP sublayer is one router layer, `f(h) = sublayer(RMSNorm(h))` (PreNorm), and the router
output goes through a final RMSNorm and the LM head.

`__call__(tokens, cache=None, schedule=...)` returns `(logits [B, T, V], cache)`; passing the
returned cache back with the next tokens (e.g. T = 1) continues the sequence: single-token
decode, with `schedule="two_phase"` for Block AttnRes (phase 1 over the cached block
representations of this step, phase 2 merges).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from attnres_numpy.config import ResidualConfig

from .router import DepthRouter

KVCache = List[Optional[Tuple[mx.array, mx.array]]]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE and a (k, v) cache `[B, H, S, Dh]`."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.rope = nn.RoPE(dim // num_heads)

    def __call__(self, x: mx.array, cache=None):
        """x `[B, T, D]`; cache (k, v) of the previous positions or None."""
        B, T, D = x.shape
        H = self.num_heads

        def split(a):
            return a.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)

        offset = 0 if cache is None else cache[0].shape[2]
        q = self.rope(split(self.q_proj(x)), offset=offset)
        k = self.rope(split(self.k_proj(x)), offset=offset)
        v = split(self.v_proj(x))
        if cache is not None:
            k, v = mx.concatenate([cache[0], k], axis=2), mx.concatenate([cache[1], v], axis=2)
        # Query i (absolute position offset + i) sees keys j <= offset + i.
        allowed = mx.arange(k.shape[2])[None, :] <= (offset + mx.arange(T))[:, None]
        y = mx.fast.scaled_dot_product_attention(q, k, v, scale=(D // H) ** -0.5, mask=allowed)
        return self.o_proj(y.transpose(0, 2, 1, 3).reshape(B, T, D)), (k, v)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(nn.gelu(self.up(x)))


class Transformer(nn.Module):
    """Embedding, `num_blocks` x (attention, MLP) sublayers routed by `config` (L = 2 x
    num_blocks router layers), final RMSNorm, LM head.  With `config.fuse_out_norm` (M15) the
    router owns the pre-norm and final-norm gains (`out_norm_weights`, eps = config.eps) and
    hands each sublayer its normed input: the model's own norms are then not created."""

    def __init__(self, config: ResidualConfig, *, vocab_size: int, dim: int, num_blocks: int,
                 num_heads: int, mlp_ratio: int = 4):
        super().__init__()
        fused = config.fuse_out_norm  # M15
        self.embed = nn.Embedding(vocab_size, dim)
        self.attn_norms = [nn.Identity() if fused else nn.RMSNorm(dim) for _ in range(num_blocks)]
        self.attns = [CausalSelfAttention(dim, num_heads) for _ in range(num_blocks)]
        self.mlp_norms = [nn.Identity() if fused else nn.RMSNorm(dim) for _ in range(num_blocks)]
        self.mlps = [MLP(dim, mlp_ratio * dim) for _ in range(num_blocks)]
        self.router = DepthRouter(config, 2 * num_blocks, dim)
        self.norm = nn.Identity() if fused else nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def sublayers(self, cache: Optional[KVCache], new_cache: KVCache):
        """The 2 x num_blocks router sublayers; attention ones read `cache` and fill `new_cache`."""
        layers = []
        for i in range(len(self.attns)):
            def attn(h, i=i):
                y, new_cache[i] = self.attns[i](self.attn_norms[i](h),
                                                None if cache is None else cache[i])
                return y

            layers += [attn, lambda h, i=i: self.mlps[i](self.mlp_norms[i](h))]
        return layers

    def __call__(self, tokens: mx.array, cache: Optional[KVCache] = None, *,
                 schedule: str = "direct", mix=None, scale=None):
        """tokens `[B, T]` -> (logits `[B, T, V]`, cache for the next call).  mix, scale: the
        router's M10 per-call inputs."""
        new_cache: KVCache = [None] * len(self.attns)
        out = self.router(self.embed(tokens), self.sublayers(cache, new_cache), schedule=schedule,
                          mix=mix, scale=scale)
        return self.head(self.norm(out)), new_cache
