"""`mlx.nn` residual modules: `DepthAttention` and `DepthRouter` (spec sections 4-5, M1-M9).

`DepthRouter` drives the user's L sublayers (callables `h [..., D] -> v [..., D]`) with any
`ResidualConfig`; its parameters are named and shaped exactly as `config.param_shapes(L, D)`
(row r = l - 1 belongs to sublayer l, row L to the output aggregation), so the probe's
parameters load 1:1 with `router.update(params)`.

Every depth-attention source has its inverse RMS computed once, when it is produced (for Block
AttnRes: once per sealed block), and reused by every later read through
`ops.depth_attention(..., inv_rms=...)`; only the running intra-block partial sum is normed
inside the op.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from attnres_numpy.config import ResidualConfig

from . import ops

Sublayer = Callable[[mx.array], mx.array]


def rmsnorm(x: mx.array, eps: float) -> mx.array:
    """Gainless RMSNorm over the last axis, returned in the compute dtype (float32, or float64
    for float64 x): the router's small projections (input queries, gates) stay in it."""
    xc = x.astype(ops.compute_dtype(x.dtype))
    return xc * mx.rsqrt(mx.mean(xc * xc, axis=-1, keepdims=True) + eps)


def _project(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """rmsnorm(x) @ weight in the compute dtype: `[..., D] x [D, D] -> [..., D]`."""
    normed = rmsnorm(x, eps)
    return normed @ weight.astype(normed.dtype)


class DepthAttention(nn.Module):
    """One depth-attention read with its own parameters (spec section 2).

    query="static": parameters `query [D]` (zero init) and `norm_weight [D]` (one init);
    query="input": `query_weight [D, D]` (zero init), q = rmsnorm(sources[-1]) @ query_weight.
    Call with a list of N sources `[..., D]` (or a stacked `[N, ..., D]`); returns `[..., D]`.
    """

    def __init__(self, dim: int, *, num_heads: int = 1, eps: float = 1e-6, scale: float = 1.0,
                 activation: str = "softmax", key_norm: bool = True, query: str = "static"):
        super().__init__()
        cfg = ResidualConfig(kind="full", query=query, activation=activation, key_norm=key_norm,
                             num_heads=num_heads, eps=eps, scale=scale)
        self.config = cfg
        if query == "static":
            self.query = mx.zeros((dim,))
        else:
            self.query_weight = mx.zeros((dim, dim))
        self.norm_weight = mx.ones((dim,))

    def __call__(self, sources, inv_rms=None) -> mx.array:
        cfg = self.config
        q = self.query if cfg.query == "static" else _project(sources[-1], self.query_weight,
                                                              cfg.eps)
        return ops.depth_attention(sources, q, self.norm_weight, eps=cfg.eps, scale=cfg.scale,
                                   num_heads=cfg.num_heads, activation=cfg.activation,
                                   key_norm=cfg.key_norm, inv_rms=inv_rms)


class DepthRouter(nn.Module):
    """The residual scheme of `config` around L user sublayers of width D (spec 4-5).

    Parameters (attributes, `config.param_shapes(L, D)`, M8 init): queries `[L+1, D]` or
    query_weights `[L+1, D, D]` and norm_weights `[L+1, D]`; alphas `[L]`; gate_weights
    `[L, D, D]`, gate_biases `[L, D]`; depth_weights `[L+1, L+1]`.
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

    # -- reads -------------------------------------------------------------------------------
    def _inv_rms(self, v: mx.array) -> Optional[mx.array]:
        cfg = self.config
        return ops.inverse_rms(v, eps=cfg.eps, num_heads=cfg.num_heads) if cfg.key_norm else None

    def _read(self, sources: List[mx.array], rms: List[Optional[mx.array]], row: int) -> mx.array:
        cfg = self.config
        if cfg.query == "static":
            q = self["queries"][row]
        else:
            q = _project(sources[-1], self["query_weights"][row], cfg.eps)
        return ops.depth_attention(sources, q, self["norm_weights"][row], eps=cfg.eps,
                                   scale=cfg.scale, num_heads=cfg.num_heads,
                                   activation=cfg.activation, key_norm=cfg.key_norm,
                                   inv_rms=list(rms) if cfg.key_norm else None)

    # -- schedules ---------------------------------------------------------------------------
    def __call__(self, embedding: mx.array, sublayers: Sequence[Sublayer], *,
                 schedule: str = "direct") -> mx.array:
        """Run the scheme: embedding v_0 `[..., D]`, sublayers f_1..f_L; returns h_{L+1}
        `[..., D]` (before any final norm).  schedule="two_phase" (M9) needs kind="block",
        softmax, key_norm, one head and static queries."""
        cfg, L = self.config, self.num_layers
        if len(sublayers) != L:
            raise ValueError(f"sublayers: expected L = {L} callables, got {len(sublayers)}")
        cfg.check_schedule(schedule)
        if embedding.ndim < 1 or embedding.shape[-1] != self.dim:
            raise ValueError(f"embedding: expected shape [..., {self.dim}], got {embedding.shape}")
        if cfg.kind in ("standard", "scalar", "gated"):
            return self._additive(embedding, sublayers)
        if cfg.kind == "static":
            return self._static(embedding, sublayers)
        if cfg.kind == "block":
            return self._block(embedding, sublayers, schedule)
        return self._full_or_window(embedding, sublayers)

    def _additive(self, h, sublayers):
        """M7: h_{l+1} = h_l + c_l v_l, c_l = 1, alphas[l-1] or sigmoid(rmsnorm(h) @ W + b)."""
        kind, eps = self.config.kind, self.config.eps
        for l, f in enumerate(sublayers):
            v = f(h)
            if kind == "scalar":
                v = self["alphas"][l] * v
            elif kind == "gated":
                gate = _project(h, self["gate_weights"][l], eps)
                gate = ops.sigmoid(gate + self["gate_biases"][l].astype(gate.dtype))
                v = (gate * v.astype(gate.dtype)).astype(v.dtype)
            h = h + v
        return h

    def _static(self, embedding, sublayers):
        """M7: h_l = sum_{i<l} depth_weights[l-1, i] v_i."""
        w = self["depth_weights"]
        outputs = [embedding]

        def mix(r):
            c = ops.compute_dtype(embedding.dtype)
            h = w[r, 0].astype(c) * outputs[0].astype(c)
            for i in range(1, r + 1):
                h = h + w[r, i].astype(c) * outputs[i].astype(c)
            return h.astype(embedding.dtype)

        for l, f in enumerate(sublayers):
            outputs.append(f(mix(l)))
        return mix(self.num_layers)

    def _full_or_window(self, embedding, sublayers):
        """M2 full: sources [v_0..v_{l-1}]; M5 window: [v_0] + the W most recent (j >= 1)."""
        cfg = self.config
        outputs, rms = [embedding], [self._inv_rms(embedding)]

        def pick(seq, l):
            return [seq[0]] + seq[max(1, l - cfg.window):l] if cfg.kind == "window" else seq[:l]

        for l in range(1, self.num_layers + 1):
            v = sublayers[l - 1](self._read(pick(outputs, l), pick(rms, l), l - 1))
            outputs.append(v)
            rms.append(self._inv_rms(v))
        L = self.num_layers
        return self._read(pick(outputs, L + 1), pick(rms, L + 1), L)

    def _block(self, embedding, sublayers, schedule):
        """M3 block (direct) or M9 two-phase: phase 1 `depth_attention_multi` over the sealed
        blocks for all of a block's queries, phase 2 `merge_partial` of the partial sum."""
        cfg, L, S = self.config, self.num_layers, self.config.block_size
        blocks, rms = [embedding], [self._inv_rms(embedding)]
        for first in range(1, L + 1, S):
            layers = range(first, min(first + S - 1, L) + 1)
            if schedule == "two_phase":
                rows = slice(first - 1, layers[-1])
                out1, lse1 = ops.depth_attention_multi(
                    blocks, self["queries"][rows], self["norm_weights"][rows], eps=cfg.eps,
                    scale=cfg.scale, inv_rms=rms)
            partial = None
            for i, l in enumerate(layers):
                if schedule == "direct":
                    if partial is None:
                        h = self._read(blocks, rms, l - 1)
                    else:
                        h = self._read(blocks + [partial], rms + [None], l - 1)
                elif partial is None:
                    h = out1[0]
                else:
                    h = ops.merge_partial(out1[i], lse1[i], partial, self["queries"][l - 1],
                                          self["norm_weights"][l - 1], eps=cfg.eps,
                                          scale=cfg.scale)
                v = sublayers[l - 1](h)
                partial = v if partial is None else partial + v
            blocks.append(partial)
            rms.append(self._inv_rms(partial))
        return self._read(blocks, rms, L)
