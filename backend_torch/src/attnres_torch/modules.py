"""`torch.nn` modules: `DepthAttention`, `DepthRouter` (every residual variant of spec sections
4-5 around the user's own sublayers) and a small drop-in PreNorm Transformer.

Converting an existing PreNorm model takes a few lines: keep every sublayer's own pre-norm and
replace the residual additions by the router::

    # before:  for f in sublayers: h = h + f(h)            (f = attention or MLP with its pre-norm)
    router = DepthRouter(ResidualConfig.variant("block", block_size=4), len(sublayers), dim)
    h = router(embedding, sublayers)                        # or, step by step:
    stream = router.stream(embedding)
    for f in sublayers:
        stream.push(f(stream.input()))
    h = stream.output()                                     # then the model's final norm + head

Parameters are named and shaped as `ResidualConfig.param_shapes(L, D)` ("queries" `[L+1, D]`,
"norm_weights" `[L+1, D]`, ...), so reference parameters load 1:1 via `load_state_dict`.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from attnres_numpy.config import ResidualConfig
from torch import nn

from .ops import depth_attention, depth_attention_multi, merge_partial


class DepthAttention(nn.Module):
    """One depth-attention layer (spec 4): pseudo-query `[D]` (zero-initialized, M8) and key-norm
    gain `[D]` (ones).  forward(sources N x `[..., D]` or `[N, ..., D]`) -> `[..., D]`."""

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                 activation: str = "softmax", key_norm: bool = True):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.options = dict(eps=eps, scale=scale, num_heads=num_heads, activation=activation,
                            key_norm=key_norm)

    def forward(self, sources, return_lse: bool = False):
        return depth_attention(sources, self.query, self.norm_weight, return_lse=return_lse,
                               **self.options)


class DepthRouter(nn.Module):
    """Forms every sublayer's input from earlier outputs per a `ResidualConfig` (spec 4-5).

    Args:
      config: the residual scheme (any of the 11 variants).
      num_layers: L, the number of sublayers (attention and MLP count separately, M1).
      dim: D.
      schedule: "direct", "two_phase" (Block AttnRes only: softmax, key norm, one head, static
        query), or None: two-phase in eval mode when the config allows it, direct otherwise.
    """

    def __init__(self, config: ResidualConfig, num_layers: int, dim: int,
                 schedule: Optional[str] = None):
        super().__init__()
        if schedule is not None:
            config.check_schedule(schedule)
        self.config, self.num_layers, self.dim, self.schedule = config, num_layers, dim, schedule
        for name, value in config.init_params(num_layers, dim).items():
            self.register_parameter(name, nn.Parameter(torch.tensor(value, dtype=torch.float32)))

    def active_schedule(self) -> str:
        if self.schedule is not None:
            return self.schedule
        return "two_phase" if not self.training and self.config.supports_two_phase else "direct"

    def stream(self, embedding: torch.Tensor) -> "RouterStream":
        """Start a pass: embedding `[..., D]` is v_0."""
        return RouterStream(self, embedding)

    def forward(self, embedding: torch.Tensor, sublayers: Sequence[Callable]) -> torch.Tensor:
        """Run L sublayers (callables `[..., D]` -> `[..., D]`); returns the output `[..., D]`
        before any final norm."""
        if len(sublayers) != self.num_layers:
            raise ValueError(f"sublayers: expected {self.num_layers} sublayers, got {len(sublayers)}")
        stream = self.stream(embedding)
        for f in sublayers:
            stream.push(f(stream.input()))
        return stream.output()


def _rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without gain (query input norm, gate input norm)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


class RouterStream:
    """The state one forward pass threads (spec 4-5): the current h (standard/scalar/gated), the
    layer outputs v_0.. (static/full/window), or the completed blocks b_0.. and the partial sum
    (block); `input()` gives h_l for the next sublayer l, `push(v_l)` records its output."""

    def __init__(self, router: DepthRouter, embedding: torch.Tensor):
        self.router, self.cfg = router, router.config
        self.layer = 1
        self.h = embedding
        self.values: List[torch.Tensor] = [embedding]  # v_0..v_{l-1} (static/full/window)
        self.blocks: List[torch.Tensor] = [embedding]  # b_0..     (block)
        self.partial: Optional[torch.Tensor] = None
        self.phase1 = None  # (out1 [S, ..., D], lse1 [S, ...], first row) of the current block
        self.two_phase = router.active_schedule() == "two_phase"

    # -- helpers -----------------------------------------------------------------------------
    def _query(self, row: int, sources: List[torch.Tensor]) -> torch.Tensor:
        if self.cfg.query == "static":
            return self.router.queries[row]
        return _rmsnorm(sources[-1], self.cfg.eps) @ self.router.query_weights[row].to(sources[-1].dtype)

    def _attend(self, row: int, sources: List[torch.Tensor]) -> torch.Tensor:
        c = self.cfg
        return depth_attention(sources, self._query(row, sources), self.router.norm_weights[row],
                               eps=c.eps, scale=c.scale, num_heads=c.num_heads,
                               activation=c.activation, key_norm=c.key_norm)

    def _sources(self, layer: int) -> List[torch.Tensor]:
        """Sources of sublayer `layer` (L + 1 = the output aggregation)."""
        if self.cfg.kind == "full":
            return self.values
        if self.cfg.kind == "window":
            lo = max(1, layer - self.cfg.window)
            return [self.values[0]] + self.values[lo:layer]
        return self.blocks if self.partial is None else self.blocks + [self.partial]

    def _block_end(self, layer: int) -> bool:
        return layer % self.cfg.block_size == 0 or layer == self.router.num_layers

    # -- the protocol ------------------------------------------------------------------------
    def input(self) -> torch.Tensor:
        """h_l `[..., D]` for the next sublayer l."""
        kind, row = self.cfg.kind, self.layer - 1
        if kind in ("standard", "scalar", "gated"):
            return self.h
        if kind == "static":
            w = self.router.depth_weights[row]
            return sum(w[i] * v for i, v in enumerate(self.values))
        if kind == "block" and self.two_phase:
            return self._two_phase_input(row)
        return self._attend(row, self._sources(self.layer))

    def _two_phase_input(self, row: int) -> torch.Tensor:
        """Spec 3: phase 1 once per block for all its sublayers, phase 2 merged per sublayer."""
        r = self.router
        if self.partial is None:
            last = min(self.layer + self.cfg.block_size - 1, r.num_layers)
            out1, lse1 = depth_attention_multi(self.blocks, r.queries[row:last],
                                               r.norm_weights[row:last], eps=self.cfg.eps,
                                               scale=self.cfg.scale)
            self.phase1 = (out1, lse1, row)
            return out1[0]
        out1, lse1, first = self.phase1
        return merge_partial(out1[row - first], lse1[row - first], self.partial, r.queries[row],
                             r.norm_weights[row], eps=self.cfg.eps, scale=self.cfg.scale)

    def push(self, v: torch.Tensor) -> None:
        """Record v_l `[..., D]`, the output of sublayer l."""
        kind, row, l = self.cfg.kind, self.layer - 1, self.layer
        if l > self.router.num_layers:
            raise ValueError(f"push: all {self.router.num_layers} sublayers were already pushed")
        if kind == "standard":
            self.h = self.h + v
        elif kind == "scalar":
            self.h = self.h + self.router.alphas[row] * v
        elif kind == "gated":
            r, dtype = self.router, self.h.dtype
            gate = _rmsnorm(self.h, self.cfg.eps) @ r.gate_weights[row].to(dtype) + r.gate_biases[row].to(dtype)
            self.h = self.h + torch.sigmoid(gate) * v
        elif kind == "block":
            self.partial = v if self.partial is None else self.partial + v
            if self._block_end(l):
                self.blocks = self.blocks + [self.partial]
                self.partial = None
        else:
            self.values = self.values + [v]
        self.layer += 1

    def output(self) -> torch.Tensor:
        """The output `[..., D]` after all L sublayers (before any final norm)."""
        if self.layer != self.router.num_layers + 1:
            raise ValueError(f"output: {self.layer - 1} of {self.router.num_layers} sublayers pushed")
        kind, row = self.cfg.kind, self.router.num_layers
        if kind in ("standard", "scalar", "gated"):
            return self.h
        if kind == "static":
            w = self.router.depth_weights[row]
            return sum(w[i] * v for i, v in enumerate(self.values))
        return self._attend(row, self._sources(self.layer))


class PreNorm(nn.Module):
    """A sublayer with its own pre-norm: f(h) = fn(RMSNorm(h))."""

    def __init__(self, dim: int, fn: nn.Module, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.fn = fn

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(h))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on `[B, T, D]`."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class AttnResTransformer(nn.Module):
    """A small PreNorm Transformer with a `DepthRouter` in place of the residual stream.

    tokens `[B, T]` (int64) -> logits `[B, T, vocab_size]`.  `num_blocks` Transformer blocks give
    L = 2 * num_blocks sublayers (attention, MLP), each with its own pre-norm; then a final
    RMSNorm and the LM head.  `ResidualConfig(kind="standard")` is the plain PreNorm baseline.
    """

    def __init__(self, vocab_size: int, dim: int, num_blocks: int, num_heads: int,
                 config: ResidualConfig, *, mlp_ratio: int = 4, eps: float = 1e-6,
                 schedule: Optional[str] = None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        sublayers = []
        for _ in range(num_blocks):
            sublayers.append(PreNorm(dim, CausalSelfAttention(dim, num_heads), eps))
            sublayers.append(PreNorm(dim, MLP(dim, mlp_ratio * dim), eps))
        self.sublayers = nn.ModuleList(sublayers)
        self.router = DepthRouter(config, len(sublayers), dim, schedule=schedule)
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=1.0 / math.sqrt(dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.router(self.embed(tokens), list(self.sublayers))
        return self.head(self.norm(h))
