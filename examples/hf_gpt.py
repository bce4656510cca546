"""Converting a Hugging Face-style GPT-2 module to Block AttnRes without rewriting its blocks.

The model below is built locally (no download, no `transformers` needed) in the layout of HF's
GPT-2: `transformer.wte`, `.wpe`, `.h` (blocks with `ln_1`, `attn`, `ln_2`, `mlp`, each block
returning a tuple), `.ln_f`, and `lm_head`.  `to_attnres` converts an instance in place:

1. `wrap_prenorm(model.transformer.h, config, sublayers="gpt2")` wires the existing blocks as
   2 x n_layer AttnRes sublayers `attn(ln_1(.))`, `mlp(ln_2(.))`; with per-layer ownership each
   block gets its own `attnres` parameters, so its checkpoint keys stay `transformer.h.{i}.*`;
2. the transformer's forward is swapped for one that calls the stack where the block loop was
   (embeddings and `ln_f` unchanged).  That is the only new code; the blocks are untouched.

A PreNorm checkpoint loads into the converted model with `strict=False` (missing: only the
`attnres` keys), and at zero-initialized queries the logits equal the PreNorm model's up to
LayerNorm's eps (uniform depth weights divide the state by the number of sources, which a norm
undoes exactly only with eps = 0).

    python examples/hf_gpt.py
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from attnres_torch import ResidualConfig
from attnres_torch.convert import wrap_prenorm
from torch import nn


@dataclass
class GPT2Config:
    vocab_size: int = 256
    n_positions: int = 64
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head

    def forward(self, x: torch.Tensor):
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for t in self.c_attn(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        return self.c_proj(y), None  # HF attention modules return (output, attention weights)


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))[0]
        return (hidden_states + self.mlp(self.ln_2(hidden_states)),)


class GPT2Model(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, output_hidden_states: bool = False) -> dict:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        all_hidden = []
        for block in self.h:
            all_hidden.append(hidden_states)
            hidden_states = block(hidden_states)[0]
        hidden_states = self.ln_f(hidden_states)
        all_hidden.append(hidden_states)
        return {"last_hidden_state": hidden_states,
                "hidden_states": tuple(all_hidden) if output_hidden_states else None}


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        for block in self.transformer.h:  # GPT-2's scaled init of the residual projections
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, input_ids: torch.Tensor, output_hidden_states: bool = False) -> dict:
        out = self.transformer(input_ids, output_hidden_states=output_hidden_states)
        return {"logits": self.lm_head(out["last_hidden_state"]), "hidden_states": out["hidden_states"]}


def _attnres_forward(self: GPT2Model, input_ids: torch.Tensor, output_hidden_states: bool = False,
                     mix: Optional[float] = None, scale: Optional[float] = None) -> dict:
    """GPT2Model.forward with the block loop replaced by the AttnRes stack."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    h, states = self.attnres(self.wte(input_ids) + self.wpe(positions), output_hidden_states=True,
                             mix=mix, scale=scale)
    h = self.ln_f(h)
    return {"last_hidden_state": h,
            "hidden_states": states[:-1] + (h,) if output_hidden_states else None}


def to_attnres(model: GPT2LMHeadModel, config: ResidualConfig, *, per_layer: bool = True,
               dtype=None) -> GPT2LMHeadModel:
    """Convert `model` in place: its blocks become AttnRes sublayers (see the module docstring).
    hidden_states are then each block's depth-attended input and the final normed state."""
    transformer = model.transformer
    stack = wrap_prenorm(transformer.h, config, sublayers="gpt2", per_layer=per_layer, dtype=dtype)
    # the stack refers to the same blocks: keep them registered under `h` only (checkpoint keys
    # unchanged) and the stack's own parameters (the output row) under `attnres_output`
    object.__setattr__(transformer, "attnres", stack)
    if per_layer:
        transformer.attnres_output = stack.attnres_output
    else:
        transformer.attnres_router = stack.router
    transformer.forward = types.MethodType(_attnres_forward, transformer)
    return model


def main(argv: Optional[List[str]] = None) -> int:
    torch.manual_seed(0)
    config = GPT2Config()
    prenorm = GPT2LMHeadModel(config)
    model = to_attnres(GPT2LMHeadModel(config), ResidualConfig(kind="block", block_size=4))
    missing = model.load_state_dict(prenorm.state_dict(), strict=False).missing_keys
    print(f"PreNorm checkpoint loaded; new keys: {len(missing)} ({missing[0]}, ..., {missing[-1]})")
    tokens = torch.randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        diff = (model(tokens)["logits"] - prenorm(tokens)["logits"]).abs().max().item()
        states = model(tokens, output_hidden_states=True)["hidden_states"]
    scale = prenorm(tokens)["logits"].abs().max().item()
    print(f"max |AttnRes - PreNorm| logits at init {diff:.1e} of {scale:.1e} (zero queries: the same "
          f"function up to LayerNorm's eps on the averaged state); {len(states)} hidden states")
    text = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 2))[None]   # [1, 54] bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(20):
        logits = model(text[:, :-1])["logits"]
        loss = F.cross_entropy(logits.flatten(0, 1), text[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (0, 19):
            print(f"step {step + 1:2d}: loss {loss.item():.3f}")
    layer0 = model.transformer.h[0].state_dict()
    print(f"block 0 checkpoint keys with AttnRes rows: {[k for k in layer0 if 'attnres' in k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
