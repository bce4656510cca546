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

import inspect
import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualStream, ScheduleObserver
from torch import nn

from . import _fsdp, dispatch
from .ops import depth_attention
from .residual_ops import TorchOps


class DepthAttention(nn.Module):
    """One depth-attention layer (spec 4): pseudo-query `[D]` (zero-initialized, M8) and key-norm
    gain `[D]` (ones).  forward(sources N x `[..., D]` or `[N, ..., D]`) -> `[..., D]`, or
    `(out, lse?, weights?)` with return_lse / return_weights (as `depth_attention`).

    fuse_out_norm=True (C17, spec 2.6): the layer also owns the next sublayer's pre-norm gain
    `out_norm` `[D]` (ones, like nn.RMSNorm's weight; eps `out_norm_eps`, None = eps) and returns
    `(out, out_normed, lse?, weights?)`: out_normed = rmsnorm(out) * out_norm from the same pass,
    so that sublayer takes out_normed in place of its own RMSNorm(out).

    save: what the backward keeps ("auto", "out", "stats"; `depth_attention`'s `save`)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                 activation: str = "softmax", key_norm: bool = True, fuse_out_norm: bool = False,
                 out_norm_eps: Optional[float] = None, save: str = "auto"):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.out_norm = nn.Parameter(torch.ones(dim)) if fuse_out_norm else None
        if out_norm_eps is not None and not fuse_out_norm:
            raise ValueError("out_norm_eps: given while fuse_out_norm is False")
        dispatch.check_save(save)
        self.options = dict(eps=eps, scale=scale, num_heads=num_heads, activation=activation,
                            key_norm=key_norm, save=save)
        if fuse_out_norm:
            self.options["out_norm_eps"] = out_norm_eps

    def extra_repr(self) -> str:
        """`dim` and every option that differs from its default, e.g. `64, num_heads=2`."""
        given = dict(self.options, fuse_out_norm=self.out_norm is not None)
        defaults = inspect.signature(DepthAttention.__init__).parameters
        changed = [f"{k}={given[k]!r}" for k in defaults if k in given and given[k] != defaults[k].default]
        return ", ".join([str(self.query.shape[0])] + changed)

    def forward(self, sources, *, return_lse: bool = False, return_weights: bool = False):
        return depth_attention(sources, self.query, self.norm_weight, return_lse=return_lse,
                               return_weights=return_weights, out_norm_weight=self.out_norm,
                               **self.options)


class DepthRouter(nn.Module):
    """Forms every sublayer's input from earlier outputs per a `ResidualConfig` (spec 4-5).

    Args:
      config: the residual scheme (any variant of the spec, `ResidualConfig.variant`).
      num_layers: L, the number of sublayers (attention and MLP count separately, M1).
      dim: D.
      schedule: "direct", "two_phase" (Block AttnRes only: softmax, key norm, one head, static
        query), or None: two-phase in eval mode when the config allows it, direct otherwise.
      save: what the depth-attention ops keep for the backward ("auto", "out", "stats";
        `depth_attention`'s `save`).
    """

    def __init__(self, config: ResidualConfig, num_layers: int, dim: int,
                 schedule: Optional[str] = None, save: str = "auto"):
        super().__init__()
        if schedule is not None:
            config.check_schedule(schedule)
        dispatch.check_save(save)
        self.config, self.num_layers, self.dim, self.schedule = config, num_layers, dim, schedule
        self.save = save
        for name, value in config.init_params(num_layers, dim).items():
            self.register_parameter(name, nn.Parameter(torch.tensor(value, dtype=torch.float32)))

    #: An optional `attnres_core.schedule.ScheduleObserver` that every pass reports to (set by
    #: `DepthMonitor`); while it wants depth weights the router runs its direct schedule.
    observer: Optional[ScheduleObserver] = None
    #: What the depth-attention ops keep for the backward (`depth_attention`'s `save`); an
    #: attribute, so a router built elsewhere (`attnres_torch.hf`, `convert`) can be set too.
    save: str = "auto"

    def active_schedule(self) -> str:
        if self.schedule is not None:
            return self.schedule
        return "two_phase" if not self.training and self.config.supports_two_phase else "direct"

    def stream(self, embedding: torch.Tensor, *, mix: Optional[float] = None,
               scale: Optional[float] = None) -> ResidualStream:
        """Start a pass: embedding `[..., D]` is v_0.  The stream (`attnres_core.schedule`) gives
        `input()` (h_l for the next sublayer), `push(v_l)` and `output()` (h_{L+1}).

        mix: M10 progressive introduction, alpha in [0, 1] (None = 1): every input is
          `(1 - alpha) * standard + alpha * attnres`; 0 is exactly the PreNorm baseline.
        scale: M10 logit scale for this pass (a temperature schedule; None = config.scale).

        Under FSDP2 (a process group up), a sublayer called outside the forward of an FSDP2 module
        whose parameters are still sharded (`fully_shard(block)` on this route) raises a
        ValueError naming the fix, `fully_shard([block.attention, block.mlp])`.
        """
        if _fsdp.active():
            _fsdp.guard(self)
        observer = self.observer
        schedule = self.active_schedule()
        if observer is not None and observer.wants_weights:
            schedule = "direct"  # two-phase never forms the weights (spec 3: same result)
        params = {name: getattr(self, name) for name in self.config.param_shapes(self.num_layers, self.dim)}
        return ResidualStream(self.config, TorchOps(params, save=self.save), embedding,
                              num_layers=self.num_layers, schedule=schedule, observer=observer,
                              mix=mix, scale=scale)

    def forward(self, embedding: torch.Tensor, sublayers: Sequence[Callable], *,
                mix: Optional[float] = None, scale: Optional[float] = None) -> torch.Tensor:
        """Run L sublayers (callables `[..., D]` -> `[..., D]`); returns the output `[..., D]`
        before any final norm.  mix, scale: the M10 per-call inputs (see `stream`)."""
        if len(sublayers) != self.num_layers:
            raise ValueError(f"sublayers: expected {self.num_layers} sublayers, got {len(sublayers)}")
        stream = self.stream(embedding, mix=mix, scale=scale)
        for f in sublayers:
            stream.push(f(stream.input()))
        return stream.output()


class PreNorm(nn.Module):
    """A sublayer with its own pre-norm: f(h) = fn(RMSNorm(h))."""

    def __init__(self, dim: int, fn: nn.Module, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.fn = fn

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(h))


def apply_rope(x: torch.Tensor, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (RoFormer) on `[..., T, Dh]` (Dh even): the pair (x_i, x_{i+Dh/2})
    of the token at position p = offset + t is rotated by the angle p * base^(-2i/Dh).  Rotations
    preserve norms, and <rope(q, m), rope(k, n)> depends on m - n only (the relative position)."""
    T, dh = x.shape[-2], x.shape[-1]
    if dh % 2:
        raise ValueError(f"x: RoPE needs an even last dimension, got shape {tuple(x.shape)}")
    inv = base ** (-torch.arange(0, dh // 2, device=x.device, dtype=torch.float64) / (dh // 2))
    pos = torch.arange(offset, offset + T, device=x.device, dtype=torch.float64)
    angle = torch.outer(pos, inv)  # [T, Dh/2], float64 so long positions keep their precision
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on `[B, T, D]`; rope=True rotates queries and keys by
    their positions (`apply_rope`; `offset` is the first token's position)."""

    def __init__(self, dim: int, num_heads: int, rope: bool = False):
        super().__init__()
        self.num_heads, self.rope = num_heads, rope
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        if self.rope:
            q, k = apply_rope(q, offset), apply_rope(k, offset)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


#: The position options of `AttnResTransformer`.
POSITIONALS = ("rope", "learned", None)


class AttnResTransformer(nn.Module):
    """A small PreNorm Transformer with a `DepthRouter` in place of the residual stream.

    tokens `[B, T]` (int64) -> logits `[B, T, vocab_size]`.  `num_blocks` Transformer blocks give
    L = 2 * num_blocks sublayers (attention, MLP), each with its own pre-norm; then a final
    RMSNorm and the LM head.  `ResidualConfig(kind="standard")` is the plain PreNorm baseline.
    With `config.fuse_out_norm` (M15) the router owns those norms' gains (`out_norm_weights`,
    ones at init like `nn.RMSNorm`'s) and hands every sublayer its normed input from the
    depth-attention pass: the sublayers are then the bare attention / MLP, `norm` is the
    identity, and the norms' eps is `config.eps` (so `eps` must equal it).

    positional: None (default: no position information beyond the causal mask), "rope" (rotary
      embeddings on every attention's queries and keys, no parameters) or "learned" (a
      `pos = nn.Embedding(context, dim)` table added to the token embedding; needs `context`,
      the longest T).  The learned table is created last, so the other weights of a seed are the
      same with and without it.
    """

    def __init__(self, vocab_size: int, dim: int, num_blocks: int, num_heads: int,
                 config: ResidualConfig, *, mlp_ratio: int = 4, eps: float = 1e-6,
                 schedule: Optional[str] = None, positional: Optional[str] = None,
                 context: Optional[int] = None):
        super().__init__()
        if positional not in POSITIONALS:
            raise ValueError(f"positional: expected one of {POSITIONALS}, got {positional!r}")
        if positional == "learned" and (not isinstance(context, int) or context < 1):
            raise ValueError(f"context: positional='learned' needs an int context >= 1, got {context!r}")
        if positional == "rope" and (dim // num_heads) % 2:
            raise ValueError(f"dim, num_heads: RoPE needs an even head size, got dim {dim} / "
                             f"num_heads {num_heads}")
        fused = config.fuse_out_norm  # M15: the router norms every sublayer input and the output
        if fused and eps != config.eps:
            raise ValueError(f"eps: with fuse_out_norm the router's norms use config.eps = "
                             f"{config.eps}, so the model's eps must equal it; got eps={eps}")
        self.positional, self.context = positional, context
        self.embed = nn.Embedding(vocab_size, dim)
        prenorm = (lambda fn: fn) if fused else (lambda fn: PreNorm(dim, fn, eps))
        sublayers = []
        for _ in range(num_blocks):
            sublayers.append(prenorm(CausalSelfAttention(dim, num_heads, rope=positional == "rope")))
            sublayers.append(prenorm(MLP(dim, mlp_ratio * dim)))
        self.sublayers = nn.ModuleList(sublayers)
        self.router = DepthRouter(config, len(sublayers), dim, schedule=schedule)
        self.norm = nn.Identity() if fused else nn.RMSNorm(dim, eps=eps)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=1.0 / math.sqrt(dim))
        if positional == "learned":
            self.pos = nn.Embedding(context, dim)
            nn.init.normal_(self.pos.weight, std=1.0 / math.sqrt(dim))

    def forward(self, tokens: torch.Tensor, *, mix: Optional[float] = None,
                scale: Optional[float] = None) -> torch.Tensor:
        """tokens `[B, T]` (T <= context for positional="learned") -> logits `[B, T, vocab]`.
        mix, scale: the router's M10 per-call inputs (progressive introduction, temperature)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [B, T], got shape {tuple(tokens.shape)}")
        h = self.embed(tokens)
        if self.positional == "learned":
            if tokens.shape[1] > self.context:
                raise ValueError(f"tokens: expected [B, T] with T <= context = {self.context}, "
                                 f"got shape {tuple(tokens.shape)}")
            h = h + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        h = self.router(h, list(self.sublayers), mix=mix, scale=scale)
        return self.head(self.norm(h))
