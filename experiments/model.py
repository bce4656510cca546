"""The example language model: `AttnResTransformer` with learned position embeddings.

tokens `[B, T]` (int64 bytes) -> logits `[B, T, vocab_size]`.  L = 2 * num_blocks PreNorm
sublayers (causal self-attention, MLP), the `DepthRouter` of the chosen residual variant in place of
the residual additions, then the final RMSNorm and the LM head.  The residual scheme is the only
thing that differs between variants: the parameters outside the router consume the random
generator identically for every variant, so one seed gives every variant the same initial
sublayer, embedding and head weights.
"""

from __future__ import annotations

from typing import Optional

import torch
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_torch.modules import AttnResTransformer

#: Every named residual variant of the spec (`ResidualConfig.variant`).
VARIANTS = tuple(VARIANT_KINDS)


def variant_config(name: str, num_layers: int, *, block_size: int = 4, window: int = 4,
                   key_rank: Optional[int] = None) -> ResidualConfig:
    """The `ResidualConfig` of a named variant (see `VARIANTS`) for L = num_layers sublayers;
    block_size and window apply to "block"/"multihead", "window" and "compressed_history" (its
    summary blocks, M14) only (clamped to L); key_rank to "low_rank_keys" (M13; None keeps the
    variant's r = 4; it must not exceed the model's width)."""
    if name not in VARIANT_KINDS:
        raise ValueError(f"variant: unknown name {name!r}; known: {', '.join(VARIANTS)}")
    fields = VARIANT_KINDS[name]
    kind = fields["kind"]
    overrides = {}
    if kind == "block" or fields.get("history") == "summaries":
        overrides["block_size"] = min(block_size, num_layers)
    if kind == "window":
        overrides["window"] = min(window, num_layers)
    if fields.get("key_rank") is not None and key_rank is not None:
        overrides["key_rank"] = key_rank
    return ResidualConfig.variant(name, **overrides)


class ExampleLM(AttnResTransformer):
    """GPT-style byte-level LM over any residual variant: `AttnResTransformer` with learned
    position embeddings (`positional="learned"`, table `pos` `[context, dim]`) by default.

    Args:
      config: the residual scheme.
      vocab_size, dim, num_blocks, num_heads, mlp_ratio, eps: as `AttnResTransformer`
        (L = 2 * num_blocks sublayers).
      context: the longest sequence T.
      schedule: the router's schedule (None: two-phase Block inference in eval mode).
      positional: "learned" (default), "rope" or None (see `AttnResTransformer`).
    """

    def __init__(self, config: ResidualConfig, *, vocab_size: int = 256, dim: int = 256,
                 num_blocks: int = 8, num_heads: int = 4, context: int = 128, mlp_ratio: int = 4,
                 eps: float = 1e-6, schedule=None, positional: Optional[str] = "learned"):
        super().__init__(vocab_size, dim, num_blocks, num_heads, config, mlp_ratio=mlp_ratio,
                         eps=eps, schedule=schedule, positional=positional, context=context)

    def forward(self, tokens: torch.Tensor, *, mix=None, scale=None) -> torch.Tensor:
        """tokens `[B, T]`, T <= context -> logits `[B, T, vocab_size]`.  mix, scale: the
        router's M10 per-call inputs (progressive introduction, temperature; None: plain)."""
        if tokens.dim() != 2 or tokens.shape[1] > self.context:
            raise ValueError(f"tokens: expected [B, T] with T <= context = {self.context}, "
                             f"got shape {tuple(tokens.shape)}")
        return super().forward(tokens, mix=mix, scale=scale)
