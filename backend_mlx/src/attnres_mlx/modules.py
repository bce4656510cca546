"""`mlx.nn` modules: `DepthAttention` and `DepthRouter` (spec sections 4-5, M1-M9), and
`Transformer`, a small decoder-only model on the router.

`DepthRouter` drives the user's L sublayers (callables `h [..., D] -> v [..., D]`) with any
`ResidualConfig`; its parameters are named and shaped exactly as `config.param_shapes(L, D)`
(row r = l - 1 belongs to sublayer l, row L to the output aggregation), so the probe's
parameters load 1:1 with `router.update(params)`.  The schedule is the shared
`attnres_core.schedule.ResidualStream` on `MlxOps` (`residual_ops.py`: the fused reads of small
passes, otherwise the spec's ops with each sealed source's inverse RMS computed once).

`Transformer`: every attention and every MLP sublayer is one router layer,
`f(h) = sublayer(RMSNorm(h))` (PreNorm), and the router output goes through a final RMSNorm and
the LM head.  `__call__(tokens, cache=None, schedule=...)` returns `(logits [B, T, V], cache)`;
passing the returned cache back with the next tokens (e.g. T = 1) continues the sequence:
single-token decode, with `schedule="two_phase"` for Block AttnRes (phase 1 over the cached
block representations of this step, phase 2 merges).  That cache grows by concatenation, so
every step has new shapes.  `make_cache(batch, max_len)` gives fixed-size buffers instead: with
`offset=` (a 0-d int32 array) every step has the same shapes, and `compile_step()` runs it as
one `mx.compile`d program whatever the position (no Python per read after the first trace).

A decode step's depth reads are the router's fused reads on the CPU (`residual_ops.fusable`:
two matmuls and a softmax per read over the step's stacked keys, a merge per two-phase
sublayer); on an Apple GPU they are the spec's ops, which `dispatch` serves with the Metal
kernels (one kernel launch per read), traced by the compiled step like any other primitive.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualStream, ScheduleObserver

from . import ops
from .residual_ops import MlxOps, RowCache, fusable, rmsnorm

Sublayer = Callable[[mx.array], mx.array]
KVCache = List[Optional[Tuple[mx.array, mx.array]]]


def _project(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """rmsnorm(x) @ weight in the compute dtype: `[..., D] x [D, D] -> [..., D]`."""
    normed = rmsnorm(x, eps)
    return normed @ weight.astype(normed.dtype)


class DepthAttention(nn.Module):
    """One depth-attention read with its own parameters (spec section 2).

    query="static": parameters `query [D]` (zero init) and `norm_weight [D]` (one init);
    query="input": `query_weight [D, D]` (zero init), q = rmsnorm(sources[-1]) @ query_weight.
    fuse_out_norm=True (C17, as torch's): also `out_norm [D]` (one init), the next sublayer's
    pre-norm gain fused into the op (epsilon out_norm_eps, None: eps).
    Call with a list of N sources `[..., D]` (or a stacked `[N, ..., D]`); returns `[..., D]`,
    or `(out, out_normed)` with fuse_out_norm.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                 activation: str = "softmax", key_norm: bool = True, query: str = "static",
                 fuse_out_norm: bool = False, out_norm_eps: Optional[float] = None):
        super().__init__()
        cfg = ResidualConfig(kind="full", query=query, activation=activation, key_norm=key_norm,
                             num_heads=num_heads, eps=eps, scale=scale)
        self.config = cfg
        if query == "static":
            self.query = mx.zeros((dim,))
        else:
            self.query_weight = mx.zeros((dim, dim))
        self.norm_weight = mx.ones((dim,))
        if fuse_out_norm:
            self.out_norm = mx.ones((dim,))
        elif out_norm_eps is not None:
            raise ValueError("out_norm_eps: given while fuse_out_norm is False")
        self.out_norm_eps = out_norm_eps

    def __call__(self, sources, *, return_lse: bool = False, return_weights: bool = False,
                 inv_rms=None):
        """out `[..., D]`, or `(out, out_normed?, lse?, weights?)` with fuse_out_norm / return_lse /
        return_weights (as `ops.depth_attention`); inv_rms: the sources' cached inverse RMS
        (`inverse_rms`)."""
        cfg = self.config
        q = self.query if cfg.query == "static" else _project(sources[-1], self.query_weight,
                                                              cfg.eps)
        return ops.depth_attention(sources, q, self.norm_weight, eps=cfg.eps, scale=cfg.scale,
                                   num_heads=cfg.num_heads, activation=cfg.activation,
                                   key_norm=cfg.key_norm, return_lse=return_lse,
                                   return_weights=return_weights,
                                   out_norm_weight=self.get("out_norm"),
                                   out_norm_eps=self.out_norm_eps, inv_rms=inv_rms)


class DepthRouter(nn.Module):
    """The residual scheme of `config` around L user sublayers of width D (spec 4-5).

    Parameters (attributes, `config.param_shapes(L, D)`, M8 init): queries `[L+1, D]` or
    query_weights `[L+1, D, D]` and norm_weights `[L+1, D]`; alphas `[L]`; gate_weights
    `[L, D, D]`, gate_biases `[L, D]`; depth_weights `[L+1, L+1]`.

    `fused_reads` (a plain attribute, default True): passes take the fused reads where
    `fusable` allows; False keeps the spec's ops for every read (their arithmetic, e.g. to
    reproduce another implementation of the same ops bit for bit).
    """

    def __init__(self, config: ResidualConfig, num_layers: int, dim: int, *,
                 dtype: mx.Dtype = mx.float32):
        super().__init__()
        if not isinstance(config, ResidualConfig):
            raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
        self.config = config
        self.num_layers = int(num_layers)
        self.dim = int(dim)
        for name, value in config.init_params(num_layers, dim).items():
            setattr(self, name, mx.array(value).astype(dtype))
        self.fused_reads = True

    # -- the schedule ------------------------------------------------------------------------
    def stream(self, embedding: mx.array, *, schedule: str = "direct",
               observer: Optional[ScheduleObserver] = None, mix=None,
               scale: Optional[float] = None) -> ResidualStream:
        """Start a pass step by step: embedding v_0 `[..., D]`; the stream
        (`attnres_core.schedule`) gives `input()`, `push(v_l)` and `output()`.  mix (alpha in
        [0, 1]: progressive introduction; a Python float, or a 0-d array under `mx.compile`) and
        scale (this call's logit scale) are the M10 per-call inputs.  The pass takes the fused
        reads where `fusable` says so (`residual_ops`).  An observer that wants the depth
        weights (a recording `DepthMonitor`) gets a direct pass whatever `schedule` says."""
        if embedding.ndim < 1 or embedding.shape[-1] != self.dim:
            raise ValueError(f"embedding: expected shape [..., {self.dim}], got {embedding.shape}")
        params = {name: self[name] for name in self.config.param_shapes(self.num_layers, self.dim)}
        if not isinstance(self.__dict__.get("_rows"), RowCache):
            object.__setattr__(self, "_rows", RowCache())  # a plain attribute, not a parameter
        fused = self.fused_reads and fusable(self.config, embedding, self.num_layers)
        if observer is not None and observer.wants_weights:
            schedule = "direct"  # two-phase never forms the weights (spec 3: the same result), as torch's
        return ResidualStream(self.config, MlxOps(params, self._rows, fused=fused), embedding,
                              num_layers=self.num_layers,
                              schedule=schedule, observer=observer, mix=mix, scale=scale)

    def __call__(self, embedding: mx.array, sublayers: Sequence[Sublayer], *,
                 schedule: str = "direct", observer: Optional[ScheduleObserver] = None,
                 mix=None, scale: Optional[float] = None) -> mx.array:
        """Run the scheme: embedding v_0 `[..., D]`, sublayers f_1..f_L; returns h_{L+1}
        `[..., D]` (before any final norm).  schedule="two_phase" (M9) needs kind="block",
        softmax, key_norm, one head and static queries."""
        L = self.num_layers
        if len(sublayers) != L:
            raise ValueError(f"sublayers: expected L = {L} callables, got {len(sublayers)}")
        self.config.check_schedule(schedule)
        stream = self.stream(embedding, schedule=schedule, observer=observer, mix=mix, scale=scale)
        for f in sublayers:
            stream.push(f(stream.input()))
        return stream.output()


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
