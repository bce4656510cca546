"""Flax NNX modules over the pure functions (needs the `flax` extra).

* `DepthAttention`: one depth-attention layer with its own pseudo-query and key-norm gain.
* `DepthRouter`: every `ResidualConfig` scheme around the user's sublayers; its parameters are
  named and shaped exactly as `ResidualConfig.param_shapes(L, D)` (so reference/probe params load
  1:1 with `load_params`) and initialized per the spec (M8, `ResidualConfig.init_params`).
* `Transformer`: a small causal decoder (attention and MLP sublayers, M1) built on the router.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from attnres_numpy.config import ResidualConfig
from flax import nnx

from .ops import depth_attention, dtype_name
from .router import HIGHEST, Sublayer, stack_apply


class DepthAttention(nnx.Module):
    """One depth-attention layer: pseudo-query `query [D]` (zero init: uniform weights, M8) and
    key-norm gain `norm_weight [D]` (ones).  `__call__(sources)` takes N x `[..., D]` or
    `[N, ..., D]` and returns `[..., D]` (and lse / weights when asked).

    fuse_out_norm=True (C17, spec 2.6): the layer also owns the next sublayer's pre-norm gain
    `out_norm [D]` (ones; eps `out_norm_eps`, None = eps) and returns `(out, out_normed, lse?,
    weights?)`, out_normed = rmsnorm(out) * out_norm from the same pass."""

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                 activation: str = "softmax", key_norm: bool = True, fuse_out_norm: bool = False,
                 out_norm_eps: Optional[float] = None, dtype=jnp.float32):
        if out_norm_eps is not None and not fuse_out_norm:
            raise ValueError("out_norm_eps: given while fuse_out_norm is False")
        self.query = nnx.Param(jnp.zeros((dim,), dtype))
        self.norm_weight = nnx.Param(jnp.ones((dim,), dtype))
        self.out_norm = nnx.Param(jnp.ones((dim,), dtype)) if fuse_out_norm else None
        self.num_heads, self.activation, self.key_norm = num_heads, activation, key_norm
        self.eps, self.scale, self.out_norm_eps = eps, scale, out_norm_eps

    def __call__(self, sources, *, return_lse: bool = False, return_weights: bool = False):
        return depth_attention(sources, self.query[...], self.norm_weight[...], eps=self.eps,
                               scale=self.scale, num_heads=self.num_heads, activation=self.activation,
                               key_norm=self.key_norm, return_lse=return_lse,
                               return_weights=return_weights,
                               out_norm_weight=None if self.out_norm is None else self.out_norm[...],
                               out_norm_eps=self.out_norm_eps)


class DepthRouter(nnx.Module):
    """The residual scheme `config` over L = num_layers sublayers of width D = dim.

    Parameters: one `nnx.Param` per name of `config.param_shapes(L, D)` (e.g. `queries [L+1, D]`,
    `norm_weights [L+1, D]`), initialized with `config.init_params`.
    `__call__(embedding [..., D], sublayers, schedule="direct") -> [..., D]` (before any final norm).
    """

    def __init__(self, config: ResidualConfig, num_layers: int, dim: int, *, dtype=jnp.float32):
        self.config, self.num_layers, self.dim = config, num_layers, dim
        self.names = tuple(config.param_shapes(num_layers, dim))
        for name, value in config.init_params(num_layers, dim).items():
            setattr(self, name, nnx.Param(jnp.asarray(value, dtype)))

    def params(self) -> dict:
        """name -> array, shaped as `config.param_shapes(L, D)`."""
        return {name: getattr(self, name)[...] for name in self.names}

    def load_params(self, params: Mapping) -> None:
        """Set every parameter from a mapping name -> array (names and shapes must match)."""
        params = {k: jnp.asarray(v) for k, v in params.items()} if isinstance(params, Mapping) else params
        self.config.check_params(params, self.num_layers, self.dim, dtype_name)
        for name in self.names:
            var = getattr(self, name)
            var[...] = params[name].astype(var[...].dtype)

    def __call__(self, embedding, sublayers: Sequence[Sublayer], *, schedule: str = "direct",
                 mix=None, scale=None):
        """mix, scale: the M10 per-call inputs of `stack_apply` (progressive introduction,
        temperature)."""
        return stack_apply(self.config, self.params(), embedding, sublayers, schedule=schedule,
                           mix=mix, scale=scale)


def _identity(h):
    """The pre-norm of a sublayer whose router hands it the normed input (M15)."""
    return h


class _Attention(nnx.Module):
    """Causal multi-head self-attention sublayer with its own pre-RMSNorm: `[B, T, D] -> [B, T, D]`."""

    def __init__(self, dim: int, num_heads: int, eps: float, rngs: nnx.Rngs, prenorm: bool = True):
        self.norm = nnx.RMSNorm(dim, epsilon=eps, rngs=rngs) if prenorm else _identity
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, precision=HIGHEST, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, precision=HIGHEST, rngs=rngs)
        self.num_heads = num_heads

    def __call__(self, h):
        b, t, d = h.shape
        q, k, v = jnp.split(self.qkv(self.norm(h)).reshape(b, t, 3, self.num_heads, -1), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, T, H, Dh]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / jnp.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=HIGHEST).reshape(b, t, d))


class _MLP(nnx.Module):
    """GELU MLP sublayer with its own pre-RMSNorm: `[..., D] -> [..., D]`."""

    def __init__(self, dim: int, hidden: int, eps: float, rngs: nnx.Rngs, prenorm: bool = True):
        self.norm = nnx.RMSNorm(dim, epsilon=eps, rngs=rngs) if prenorm else _identity
        self.up = nnx.Linear(dim, hidden, precision=HIGHEST, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, precision=HIGHEST, rngs=rngs)

    def __call__(self, h):
        return self.down(jax.nn.gelu(self.up(self.norm(h))))


class Transformer(nnx.Module):
    """A small causal decoder: tokens `[B, T]` -> logits `[B, T, vocab]`.

    num_blocks transformer blocks = L = 2 * num_blocks sublayers (attention, MLP; M1) combined by
    a `DepthRouter(config, L, dim)`, then a final RMSNorm and the LM head.  config "standard" is
    the PreNorm baseline.  With `config.fuse_out_norm` (M15) the router owns the pre-norm and
    final-norm gains (`out_norm_weights`, eps = config.eps, so `eps` must equal it) and hands each
    sublayer its normed input; the model's own norms are then not created.
    """

    def __init__(self, config: ResidualConfig, *, vocab_size: int, dim: int, num_blocks: int,
                 num_heads: int, rngs: nnx.Rngs, eps: float = 1e-6, mlp_ratio: int = 4):
        fused = config.fuse_out_norm  # M15
        if fused and eps != config.eps:
            raise ValueError(f"eps: with fuse_out_norm the router's norms use config.eps = "
                             f"{config.eps}, so the model's eps must equal it; got eps={eps}")
        self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
        sublayers = []
        for _ in range(num_blocks):
            sublayers.append(_Attention(dim, num_heads, eps, rngs, prenorm=not fused))
            sublayers.append(_MLP(dim, mlp_ratio * dim, eps, rngs, prenorm=not fused))
        self.sublayers = nnx.List(sublayers)
        self.router = DepthRouter(config, 2 * num_blocks, dim)
        self.final_norm = _identity if fused else nnx.RMSNorm(dim, epsilon=eps, rngs=rngs)
        self.head = nnx.Linear(dim, vocab_size, use_bias=False, precision=HIGHEST, rngs=rngs)

    def __call__(self, tokens, *, schedule: str = "direct", mix=None, scale=None):
        h = self.router(self.embed(tokens), list(self.sublayers), schedule=schedule, mix=mix,
                        scale=scale)
        return self.head(self.final_norm(h))
