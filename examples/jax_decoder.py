"""Converting a realistic PreNorm decoder to Block AttnRes, in JAX with Flax NNX.

A PreNorm decoder block is `h = h + attn(norm(h), mask)` then `h = h + mlp(norm(h))`.  AttnRes
keeps both sublayers as they are (each with its own pre-norm) and hands them to
`attnres_jax.modules.DepthRouter`, which replaces the additions.  The router is the only new
module: `nnx.update(converted, nnx.state(prenorm))` loads a PreNorm model's weights, and with the
router's zero-initialized pseudo-queries the converted model computes the same logits.
Without Flax, `attnres_jax.stack_apply(config, params, embedding, sublayers)` is the same wiring
as a pure function.

    python examples/jax_decoder.py   # needs attnres-jax[flax]
"""

from __future__ import annotations

import sys
from typing import List, Optional

import jax
import jax.numpy as jnp
from attnres_core.config import ResidualConfig
from attnres_jax.modules import DepthRouter
from flax import nnx


class Attention(nnx.Module):
    """Multi-head self-attention with its own pre-norm; `mask [T, T]` (True = may attend)."""

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(dim, epsilon=1e-6, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.num_heads = num_heads

    def __call__(self, h, mask):
        b, t, d = h.shape
        q, k, v = (x.reshape(b, t, self.num_heads, -1) for x in jnp.split(self.qkv(self.norm(h)), 3, -1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))


class MLP(nnx.Module):
    """SwiGLU MLP with its own pre-norm."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(dim, epsilon=1e-6, rngs=rngs)
        self.gate = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, h):
        x = self.norm(h)
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nnx.Module):
    """The usual PreNorm block; AttnRes calls its two sublayers one by one instead."""

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        self.attention = Attention(dim, num_heads, rngs=rngs)
        self.mlp = MLP(dim, 4 * dim, rngs=rngs)

    def __call__(self, h, mask):
        h = h + self.attention(h, mask)
        return h + self.mlp(h)


class Decoder(nnx.Module):
    """tokens `[B, T]` -> logits `[B, T, vocab]`; `residual=None` is the PreNorm model, a
    `ResidualConfig` its AttnRes conversion (L = 2 * num_blocks sublayers)."""

    def __init__(self, vocab: int, dim: int, num_blocks: int, num_heads: int,
                 residual: Optional[ResidualConfig] = None, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(dim, num_heads, rngs=rngs) for _ in range(num_blocks)])
        self.norm = nnx.RMSNorm(dim, epsilon=1e-6, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)
        self.router = None if residual is None else DepthRouter(residual, 2 * num_blocks, dim)

    def __call__(self, tokens):
        t = tokens.shape[1]
        mask = jnp.tril(jnp.ones((t, t), bool))                      # causal
        h = self.embed(tokens)
        if self.router is None:                                      # PreNorm: h = h + f(h)
            for block in self.blocks:
                h = block(h, mask)
        else:                                                        # Block AttnRes
            sublayers = []
            for block in self.blocks:
                sublayers += [lambda h, b=block: b.attention(h, mask), lambda h, b=block: b.mlp(h)]
            h = self.router(h, sublayers)
        return self.head(self.norm(h))


def _loss(model: Decoder, text):
    logits = model(text[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), text[:, 1:, None], -1))


@nnx.jit
def train_step(model: Decoder, text, lr: float = 0.3):
    """One plain SGD step (any optax optimizer works the same way through `nnx.Optimizer`)."""
    loss, grads = nnx.value_and_grad(_loss)(model, text)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss


def main(argv: Optional[List[str]] = None) -> int:
    prenorm = Decoder(256, 64, 4, 4, rngs=nnx.Rngs(0))
    model = Decoder(256, 64, 4, 4, ResidualConfig(kind="block", block_size=4), rngs=nnx.Rngs(1))
    nnx.update(model, nnx.state(prenorm))      # the PreNorm weights; the router keeps its init
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
    diff = float(jnp.abs(model(tokens) - prenorm(tokens)).max())
    router_params = sum(p.size for p in model.router.params().values())
    print(f"logits {model(tokens).shape}; router parameters {router_params}; "
          f"max |AttnRes - PreNorm| at init {diff:.1e} (zero queries: the same function up to rounding)")
    text = jnp.array(list(b"def f(x):\n    return x + 1\n" * 8))[None]   # [1, 224] bytes
    for step in range(20):
        loss = train_step(model, text)
        if step in (0, 19):
            print(f"step {step + 1:2d}: loss {float(loss):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
