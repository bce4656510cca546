"""Residual schemes over a stack of sublayers, as pure JAX functions (spec sections 4-6, M1-M9).

`stack_apply(config, params, embedding, sublayers)` drives user-supplied sublayers (callables
`h [..., D] -> v [..., D]`, from any JAX library: Flax, Equinox, Haiku or plain functions over
pytrees) with the residual scheme `config` (`attnres_numpy.config.ResidualConfig`).  params is a
dict name -> array shaped exactly as `config.param_shapes(L, D)`; row r = l - 1 belongs to
sublayer l and row L to the output aggregation (M4).  Everything here is differentiable and works
under `jit`, `grad`, `vmap` and `checkpoint`.

`probe_forward` is the spec's probe network (`f_l(h) = tanh(rmsnorm(h) @ W[l-1])`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from attnres_numpy import validation
from attnres_numpy.config import ResidualConfig

from .ops import depth_attention, depth_attention_multi, dtype_name, merge_partial

Sublayer = Callable[[jax.Array], jax.Array]
HIGHEST = jax.lax.Precision.HIGHEST


def rmsnorm(x, eps: float):
    """Gainless RMSNorm over the last axis, statistics in float32 (float64 for float64 x).
    x `[..., D]` -> `[..., D]` in x's dtype."""
    ct = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    xc = x.astype(ct)
    return (xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def matmul(x, w):
    """Right-multiplication `x [..., D_in] @ w [D_in, D_out]` at full precision."""
    return jnp.matmul(x, w.astype(x.dtype), precision=HIGHEST)


def _check(config, params, embedding, num_layers: int, schedule: str) -> None:
    """Config, schedule (M9), embedding `[..., D]` and params names/shapes (M6), at trace time."""
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    config.check_schedule(schedule)
    validation.check_floating("embedding", dtype_name(embedding))
    if embedding.ndim < 1 or embedding.shape[-1] < 1:
        raise ValueError(f"embedding: expected shape [..., D] with D >= 1, got shape {embedding.shape}")
    config.check_params(params, num_layers, embedding.shape[-1], dtype_name)


def stack_apply(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Sublayer], *,
                schedule: str = "direct"):
    """Run the residual scheme `config` over L user-supplied sublayers (spec section 4).

    Args:
      config: the residual scheme.  params: name -> array of `config.param_shapes(L, D)`.
      embedding: v_0 `[..., D]`.  sublayers: L callables `h [..., D] -> v [..., D]`.
      schedule: "direct" or "two_phase" (M9, see `ResidualConfig.supports_two_phase`); both give the same out.

    Returns: out `[..., D]` (h_{L+1}, before any final norm) in the embedding's dtype.
    """
    if not isinstance(sublayers, (list, tuple)) or not all(callable(f) for f in sublayers):
        raise TypeError("sublayers: expected a list or tuple of callables h -> v")
    if len(sublayers) < 1:
        raise ValueError("sublayers: expected L >= 1 sublayers, got an empty sequence")
    embedding = jnp.asarray(embedding)
    params = {k: jnp.asarray(v) for k, v in params.items()} if isinstance(params, Mapping) else params
    _check(config, params, embedding, len(sublayers), schedule)
    L, kind, eps = len(sublayers), config.kind, config.eps
    dt = embedding.dtype

    def row(name, r):
        return params[name][r].astype(dt)

    if kind in ("standard", "scalar", "gated"):
        # M7: h_{l+1} = h_l + c_l v_l, c_l = 1, alphas[l-1] or sigmoid(rmsnorm(h_l) @ W + b).
        h = embedding
        for l in range(1, L + 1):
            v = sublayers[l - 1](h)
            if kind == "scalar":
                v = row("alphas", l - 1) * v
            elif kind == "gated":
                gate = matmul(rmsnorm(h, eps), row("gate_weights", l - 1)) + row("gate_biases", l - 1)
                v = jax.nn.sigmoid(gate) * v
            h = h + v
        return h

    outputs = [embedding]  # v_0..v_{l-1}

    if kind == "static":
        # M7: h_l = sum_{i<l} depth_weights[l-1, i] v_i (upper triangle unused).
        def mix(r):
            return sum(row("depth_weights", (r, i)) * outputs[i] for i in range(r + 1))

        for l in range(1, L + 1):
            outputs.append(sublayers[l - 1](mix(l - 1)))
        return mix(L)

    def attend(sources, r):
        # M6: static pseudo-query row r, or q = rmsnorm(last source) @ query_weights[r] (per token).
        if config.query == "static":
            q = params["queries"][r]
        else:
            q = matmul(rmsnorm(sources[-1], eps), row("query_weights", r))
        return depth_attention(list(sources), q, params["norm_weights"][r], eps=eps, scale=config.scale,
                               num_heads=config.num_heads, activation=config.activation,
                               key_norm=config.key_norm)

    if kind == "block":
        return _block(config, params, embedding, sublayers, schedule, attend)

    for l in range(1, L + 1):
        if kind == "window":  # M5: [v_0] + [v_j : max(1, l-W) <= j <= l-1]
            sources = [outputs[0]] + outputs[max(1, l - config.window):l]
        else:  # M2 full: [v_0..v_{l-1}]
            sources = outputs[:l]
        outputs.append(sublayers[l - 1](attend(sources, l - 1)))
    last = [outputs[0]] + outputs[max(1, L + 1 - config.window):] if kind == "window" else outputs
    return attend(last, L)  # M4: the output aggregation is row L.


def _block(config, params, embedding, sublayers, schedule, attend):
    """M3 block: b_0 = v_0; block n holds sublayers (n-1)S+1 .. min(nS, L); its first sublayer
    attends over [b_0..b_{n-1}], later ones over [b_0..b_{n-1}, partial]; b_n = partial.

    M9 two-phase: per block, phase 1 runs all the block's queries over [b_0..b_{n-1}] at once
    (`depth_attention_multi`); the first sublayer takes its phase-1 output directly and later
    ones merge the partial sum (`merge_partial`).
    """
    L, S = len(sublayers), config.block_size
    kw = dict(eps=config.eps, scale=config.scale)
    blocks = [embedding]
    for first in range(1, L + 1, S):
        layers = range(first, min(first + S - 1, L) + 1)
        if schedule == "two_phase":
            rows = slice(first - 1, layers[-1])
            out1, lse1 = depth_attention_multi(blocks, params["queries"][rows],
                                               params["norm_weights"][rows], **kw)
        partial = None
        for i, l in enumerate(layers):
            if schedule == "direct":
                h = attend(blocks if partial is None else blocks + [partial], l - 1)
            elif partial is None:
                h = out1[0]
            else:
                h = merge_partial(out1[i], lse1[i], partial, params["queries"][l - 1],
                                  params["norm_weights"][l - 1], **kw)
            v = sublayers[l - 1](h)
            partial = v if partial is None else partial + v
        blocks.append(partial)
    return attend(blocks, L)  # M4: aggregate [b_0..b_N] with row L.


def probe_sublayers(sublayer_weights, eps: float) -> list:
    """The probe's L sublayers `f_l(h) = tanh(rmsnorm(h, eps) @ W[l-1])`; W `[L, D, D]`."""
    return [lambda h, w=sublayer_weights[l]: jnp.tanh(matmul(rmsnorm(h, eps), w))
            for l in range(sublayer_weights.shape[0])]


def probe_forward(config: ResidualConfig, params: Mapping, embedding, sublayer_weights, *,
                  schedule: str = "direct"):
    """The spec's probe network (spec section 6): embedding `[..., D]`, sublayer_weights
    `[L, D, D]`; returns out `[..., D]`."""
    w = jnp.asarray(sublayer_weights)
    embedding = jnp.asarray(embedding)
    validation.check_floating("sublayer_weights", dtype_name(w))
    dim = embedding.shape[-1] if embedding.ndim else 0
    if w.ndim != 3 or w.shape[0] < 1 or w.shape[1:] != (dim, dim):
        raise ValueError(f"sublayer_weights: expected shape [L, D, D] with L >= 1 and D = {dim}, "
                         f"got shape {w.shape}")
    return stack_apply(config, params, embedding, probe_sublayers(w, config.eps), schedule=schedule)
