"""A minimal float64 reverse-mode tape: the reference's `ResidualOps` (no autodiff library).

`Tape(params, record=...)` holds the scheme's parameters as leaves and implements every
primitive of `schedule.ResidualOps` on `Var`s: it computes with NumPy in float64 and, when
recording, stores `(inputs, outputs, vjp)` with a hand-written VJP (the depth-attention ones are
`ops.*_vjp`).  `gradients` walks the records backwards.

`transform` (optional) is applied to every primitive's result and to every cotangent it hands
back; the conformance suite passes a rounding to the case dtype to get the reference "with every
step rounded".
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
from attnres_core.config import ResidualConfig
from attnres_core.numerics import round_to_dtype, sum_to_axes
from attnres_core.schedule import ResidualOps

from . import ops


def rmsnorm(x, eps: float) -> np.ndarray:
    """Gainless RMSNorm over the last axis: `x / sqrt(mean(x ** 2) + eps)`; x `[..., D]`."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rmsnorm_vjp(x, cotangent, eps: float) -> np.ndarray:
    """VJP of `rmsnorm`: with r = 1/sqrt(mean(x^2) + eps), y = r x, dx = r (dy - y mean(dy * y)).

    x and cotangent `[..., D]`; returns dx `[..., D]`.
    """
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(cotangent, dtype=np.float64)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x * r
    return r * (dy - y * np.mean(dy * y, axis=-1, keepdims=True))


def sum_to_shape(g: np.ndarray, shape) -> np.ndarray:
    """Sum a cotangent `g` of a broadcast result back to an operand of `shape`."""
    lead, keep = sum_to_axes(g.shape, shape)
    return np.sum(np.sum(g, axis=lead), axis=keep, keepdims=True)


class Var:
    """A float64 value on a tape; `key` indexes its cotangent."""

    __slots__ = ("value", "key")

    def __init__(self, value: np.ndarray, key: int):
        self.value = value
        self.key = key

    @property
    def shape(self) -> tuple:
        return self.value.shape


class Tape(ResidualOps):
    """Reverse-mode tape and float64 `ResidualOps`.

    Args:
      params: name -> array, the scheme's parameters (leaves: `self.leaves[name]`).
      record: store VJPs (False: a forward-only tape).
      transform: optional `array -> array` applied to every result and cotangent.
    """

    def __init__(self, params: Mapping = (), *, record: bool,
                 transform: Optional[Callable[[np.ndarray], np.ndarray]] = None):
        self.record = record
        self.transform = transform
        self._nodes = []
        self._count = 0
        self.leaves: Dict[str, Var] = {name: self.var(value) for name, value in dict(params).items()}

    def var(self, value) -> Var:
        self._count += 1
        return Var(np.asarray(value, dtype=np.float64), self._count)

    def _op(self, inputs, values, vjp) -> List[Var]:
        t = self.transform
        if t is not None:
            values = [t(v) for v in values]
            plain_vjp = vjp
            vjp = lambda *cots: [t(g) for g in plain_vjp(*cots)]  # noqa: E731
        outputs = [self.var(v) for v in values]
        if self.record:
            self._nodes.append((inputs, outputs, vjp))
        return outputs

    def gradients(self, output: Var, cotangent: np.ndarray, wrt: Sequence[Var]) -> List[np.ndarray]:
        """Reverse sweep: cotangents of `wrt` given `cotangent` on `output` (zeros if unused)."""
        grads = {output.key: cotangent}
        for inputs, outputs, vjp in reversed(self._nodes):
            cots = [grads.get(o.key) for o in outputs]
            if all(c is None for c in cots):
                continue
            cots = [np.zeros_like(o.value) if c is None else c for o, c in zip(outputs, cots)]
            for x, g in zip(inputs, vjp(*cots)):
                grads[x.key] = g if x.key not in grads else grads[x.key] + g
        return [grads[w.key] if w.key in grads else np.zeros_like(w.value) for w in wrt]

    # -- elementwise and linear primitives -------------------------------------------------------
    def param(self, name: str, index, *, like=None) -> Var:
        return self.index(self.leaves[name], index)

    def cast_like(self, x: Var, like: Var) -> Var:
        """x itself: every value on the tape is float64 (M1a holds trivially)."""
        return x

    def round_to(self, x: Var, dtype: str) -> Var:
        """x rounded to `dtype` (a cast to it, M1a), and its cotangent rounded to `dtype` on the way
        back: a value of that dtype receives a cotangent of that dtype."""
        return self._op([x], [round_to_dtype(x.value, dtype)], lambda g: (round_to_dtype(g, dtype),))[0]

    def add(self, a: Var, b: Var) -> Var:
        sa, sb = a.value.shape, b.value.shape
        return self._op([a, b], [a.value + b.value],
                        lambda g: (sum_to_shape(g, sa), sum_to_shape(g, sb)))[0]

    def mul(self, a: Var, b: Var) -> Var:
        av, bv = a.value, b.value
        return self._op([a, b], [av * bv],
                        lambda g: (sum_to_shape(g * bv, av.shape), sum_to_shape(g * av, bv.shape)))[0]

    def blend(self, standard: Var, attended: Var, alpha: float) -> Var:
        """M10: `(1 - alpha) standard + alpha attended`; alpha is not differentiated."""
        value = standard.value * (1.0 - alpha) + attended.value * alpha
        return self._op([standard, attended], [value], lambda g: (g * (1.0 - alpha), g * alpha))[0]

    def index(self, a: Var, key) -> Var:
        """`a[key]` for an int, tuple of ints or slice (no repeated elements)."""
        def vjp(g):
            full = np.zeros_like(a.value)
            full[key] = g
            return (full,)
        return self._op([a], [a.value[key]], vjp)[0]

    take = index

    def rmsnorm(self, x: Var, eps: float) -> Var:
        return self._op([x], [rmsnorm(x.value, eps)], lambda g: (rmsnorm_vjp(x.value, g, eps),))[0]

    def rmsnorm_gain(self, x: Var, weight: Var, eps: float) -> Var:
        """M15 composed: `rmsnorm(x) * weight` as one primitive (one rounding, as a fused norm)."""
        y = rmsnorm(x.value, eps)
        w = weight.value
        return self._op([x, weight], [y * w],
                        lambda g: (rmsnorm_vjp(x.value, g * w, eps), sum_to_shape(g * y, w.shape)))[0]

    def matmul(self, x: Var, w: Var) -> Var:
        """`x [..., D_in] @ w [D_in, D_out]`."""
        xv, wv = x.value, w.value

        def vjp(g):
            x2 = xv.reshape(-1, wv.shape[0])
            g2 = g.reshape(-1, wv.shape[1])
            return g @ wv.T, x2.T @ g2
        return self._op([x, w], [xv @ wv], vjp)[0]

    def transpose(self, w: Var) -> Var:
        """`w.T` of a matrix `[a, b]` (M13); its VJP transposes the cotangent back."""
        return self._op([w], [w.value.T.copy()], lambda g: (g.T.copy(),))[0]

    def tanh(self, x: Var) -> Var:
        """`tanh(x)`; its VJP is `dy (1 - y^2)` (spec section 6)."""
        y = np.tanh(x.value)
        return self._op([x], [y], lambda g: (g * (1.0 - y * y),))[0]

    def sigmoid(self, x: Var) -> Var:
        with np.errstate(over="ignore"):
            y = 1.0 / (1.0 + np.exp(-x.value))
        return self._op([x], [y], lambda g: (g * y * (1.0 - y),))[0]

    # -- depth-attention primitives (VJPs from ops) ------------------------------------------------
    def depth_attention(self, sources: List[Var], stats, query: Var, norm_weight: Var,
                        config: ResidualConfig, *, return_weights: bool = False,
                        out_norm_weight: Optional[Var] = None):
        """(out `Var [..., D]`, weights `[N, ...]` or `[N, ..., H]` (plain arrays) or None);
        with out_norm_weight (M15): (out, out_normed, weights), both outputs `Var`s."""
        kw = dict(eps=config.eps, scale=config.scale, num_heads=config.num_heads,
                  activation=config.activation, key_norm=config.key_norm)
        if out_norm_weight is not None:
            return self._depth_attention_out_norm(sources, query, norm_weight, out_norm_weight, kw,
                                                  return_weights)
        xs, q, g = [s.value for s in sources], query.value, _value(norm_weight)
        out, p = ops.depth_attention(xs, q, g, return_weights=True, **kw)

        def vjp(d_out):
            grad = ops.depth_attention_vjp(xs, q, g, d_out, **kw)
            return (*grad["sources"], grad["query"], *_gain_grad(grad["norm_weight"], g))
        out = self._op([*sources, query, *_gain_input(norm_weight)], [out], vjp)[0]
        return out, (p if return_weights else None)

    def _depth_attention_out_norm(self, sources, query, norm_weight, out_norm_weight, kw,
                                  return_weights: bool):
        """C17 on the tape: out and out_normed from one op, its VJP taking both cotangents."""
        xs, q, g, w = [s.value for s in sources], query.value, _value(norm_weight), out_norm_weight.value
        out, normed, p = ops.depth_attention(xs, q, g, return_weights=True, out_norm_weight=w, **kw)

        def vjp(d_out, d_normed):
            grad = ops.depth_attention_vjp(xs, q, g, d_out, out_norm_weight=w, d_out_normed=d_normed, **kw)
            return (*grad["sources"], grad["query"], *_gain_grad(grad["norm_weight"], g),
                    grad["out_norm_weight"])
        out, normed = self._op([*sources, query, *_gain_input(norm_weight), out_norm_weight],
                               [out, normed], vjp)
        return out, normed, (p if return_weights else None)

    def depth_attention_multi(self, sources: List[Var], stats, queries: Var, norm_weights: Var,
                              config: ResidualConfig):
        """Phase 1: (out `[S, ..., D]`, lse `[S, ...]`) as `Var`s."""
        kw = dict(eps=config.eps, scale=config.scale)
        xs, q, g = [s.value for s in sources], queries.value, _value(norm_weights)
        out, lse = ops.depth_attention_multi(xs, q, g, **kw)

        def vjp(d_out, d_lse):
            grad = ops.depth_attention_multi_vjp(xs, q, g, d_out, d_lse, **kw)
            return (*grad["sources"], grad["queries"], *_gain_grad(grad["norm_weights"], g))
        out, lse = self._op([*sources, queries, *_gain_input(norm_weights)], [out, lse], vjp)
        return out, lse

    def merge_partial(self, out1: Var, lse1: Var, partial: Var, query: Var, norm_weight: Var,
                      config: ResidualConfig) -> Var:
        """Phase 2: merge phase-1 stats with the intra-block partial sum; out `[..., D]`."""
        kw = dict(eps=config.eps, scale=config.scale)
        args = [a.value for a in (out1, lse1, partial, query)] + [_value(norm_weight)]
        out = ops.merge_partial(*args, **kw)

        def vjp(d_out):
            grad = ops.merge_partial_vjp(*args, d_out, **kw)
            return (*(grad[k] for k in ("out1", "lse1", "partial", "query")),
                    *_gain_grad(grad["norm_weight"], args[-1]))
        return self._op([out1, lse1, partial, query, *_gain_input(norm_weight)], [out], vjp)[0]


# -- a gainless key norm (norm_weight None: M13 hands the gain to the query) -------------------------
def _value(var: Optional[Var]):
    return None if var is None else var.value


def _gain_input(var: Optional[Var]) -> list:
    """The gain as a tape input: [var], or [] for None."""
    return [] if var is None else [var]


def _gain_grad(grad, gain) -> tuple:
    """The gain's cotangent as the VJP's last output: (grad,), or () without a gain."""
    return () if gain is None else (grad,)
