"""A small decoder-only Transformer on `DepthRouter` (spec section 4, M1): every attention and
every MLP sublayer is one router layer, `f(h) = sublayer(RMSNorm(h))` (PreNorm), and the router
output goes through a final RMSNorm and the LM head.

`__call__(tokens, cache=None, schedule=...)` returns `(logits [B, T, V], cache)`; passing the
returned cache back with the next tokens (e.g. T = 1) continues the sequence: single-token
decode, with `schedule="two_phase"` for Block AttnRes (phase 1 over the cached block
representations of this step, phase 2 merges).  That cache grows by concatenation, so every
step has new shapes.  `make_cache(batch, max_len)` gives fixed-size buffers instead: with
`offset=` (a 0-d int32 array) every step has the same shapes, and `compile_step()` runs it as
one `mx.compile`d program whatever the position (no Python per read after the first trace).

A decode step's depth reads are the router's fused reads on the CPU (`router.fusable`: two
matmuls and a softmax per read over the step's stacked keys, a merge per two-phase sublayer);
on an Apple GPU they are the spec's ops, which `dispatch` serves with the Metal kernels (one
kernel launch per read), traced by the compiled step like any other primitive.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ScheduleObserver

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

    def __call__(self, x: mx.array, cache=None, offset=None):
        """x `[B, T, D]`; cache (k, v) of the previous positions or None.  With `offset` (an int
        or a 0-d integer array): cache is a fixed-size (k, v) `[B, H, S_max, Dh]`
        (`Transformer.make_cache`); positions offset..offset+T-1 are written into it and the
        keys after them are masked, so the shapes do not depend on the position."""
        B, T, D = x.shape
        H = self.num_heads

        def split(a):
            return a.reshape(B, T, H, D // H).transpose(0, 2, 1, 3)

        if offset is not None:
            return self._fixed(split, x, cache, offset)
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

    def _fixed(self, split, x, cache, offset):
        B, T, D = x.shape
        H = self.num_heads
        if cache is None or cache[0].ndim != 4 or cache[0].shape[2] < T:
            raise ValueError(f"cache: offset= needs a fixed-size (k, v) [B, {H}, S_max, "
                             f"{D // H}] from Transformer.make_cache with S_max >= T = {T}")
        off = (offset if isinstance(offset, mx.array) else mx.array(offset)).astype(mx.int32)
        q = self.rope(split(self.q_proj(x)), offset=off)
        k = self.rope(split(self.k_proj(x)), offset=off)
        start = off.reshape(1)
        k = mx.slice_update(cache[0], k.astype(cache[0].dtype), start, axes=(2,))
        v = mx.slice_update(cache[1], split(self.v_proj(x)).astype(cache[1].dtype), start,
                            axes=(2,))
        allowed = mx.arange(k.shape[2])[None, :] <= (off + mx.arange(T))[:, None]
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

    def sublayers(self, cache: Optional[KVCache], new_cache: KVCache, offset=None):
        """The 2 x num_blocks router sublayers; attention ones read `cache` and fill `new_cache`
        (offset: see `CausalSelfAttention`)."""
        layers = []
        for i in range(len(self.attns)):
            def attn(h, i=i):
                y, new_cache[i] = self.attns[i](self.attn_norms[i](h),
                                                None if cache is None else cache[i], offset)
                return y

            layers += [attn, lambda h, i=i: self.mlps[i](self.mlp_norms[i](h))]
        return layers

    def __call__(self, tokens: mx.array, cache: Optional[KVCache] = None, *, offset=None,
                 schedule: str = "direct", mix=None, scale=None,
                 observer: Optional[ScheduleObserver] = None):
        """tokens `[B, T]` -> (logits `[B, T, V]`, cache for the next call).  mix, scale: the
        router's M10 per-call inputs; observer: a `ScheduleObserver` that sees every depth read
        and sublayer (e.g. `attnres_mlx.training.DepthMonitor`).  offset: None (cache grown by concatenation), or the
        position of tokens[:, 0] (an int or a 0-d integer array) in a fixed-size cache from
        `make_cache`, which the returned cache updates in place of."""
        new_cache: KVCache = [None] * len(self.attns)
        out = self.router(self.embed(tokens), self.sublayers(cache, new_cache, offset),
                          schedule=schedule, mix=mix, scale=scale, observer=observer)
        return self.head(self.norm(out)), new_cache

    def make_cache(self, batch: int, max_len: int, dtype: mx.Dtype = mx.float32) -> KVCache:
        """A fixed-size cache: per attention sublayer zero (k, v) `[batch, H, max_len, Dh]`,
        filled by calls with `offset=`."""
        attn = self.attns[0]
        shape = (batch, attn.num_heads, max_len, self.router.dim // attn.num_heads)
        return [(mx.zeros(shape, dtype), mx.zeros(shape, dtype)) for _ in self.attns]

    def compile_step(self, **kwargs):
        """`step(tokens [B, T], cache, offset) -> (logits, cache)`: `self(tokens, cache,
        offset=offset, **kwargs)` under `mx.compile` with the model's parameters as inputs.
        With a `make_cache` cache and a 0-d int32 offset, one trace serves every position of a
        given T (`mx.compile` retraces only when the shapes change)."""
        return mx.compile(lambda tokens, cache, offset: self(tokens, cache, offset=offset,
                                                             **kwargs), inputs=self.state)
