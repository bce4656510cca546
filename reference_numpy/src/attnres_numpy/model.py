"""Float64 reference of the residual schemes over a stack of sublayers (spec sections 4-6, M1-M9).

A stack has sublayers l = 1..L (every attention and every MLP sublayer is one layer; M1).  The
embedding is `v_0 [..., D]` (any leading token shape), sublayer l maps its input `h_l [..., D]` to
its output `v_l = f_l(h_l) [..., D]`, and the residual scheme (`ResidualConfig`) decides how each
`h_l` and the stack's output `h_{L+1}` are formed from `v_0..v_{l-1}`.  Row r = l - 1 of every
parameter array belongs to sublayer l, row L to the final output aggregation (M4).

Public functions:
  stack_forward  the generic schedule driving user-supplied sublayers (callables `h -> v`).
  probe_forward  the spec's probe network, `f_l(h) = tanh(rmsnorm(h) @ W[l-1])`.
  probe_vjp      its hand-written reverse mode: every input and every parameter.
  probe_sublayers, rmsnorm, rmsnorm_vjp  the probe's building blocks.

There is one schedule (`_schedule`).  It is written against `_Tape`, a minimal reverse-mode tape
whose primitives compute with NumPy and record hand-written VJPs (the depth-attention ones are
`ops.*_vjp`).  `stack_forward` runs the schedule on a tape that records nothing; `probe_vjp` runs
it on a recording tape and walks the records backwards.  No autodiff library is involved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Dict, List, Sequence

import numpy as np

from . import ops, validation
from .config import ResidualConfig

Sublayer = Callable[[np.ndarray], np.ndarray]



# -- the probe's building blocks ---------------------------------------------------------------
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


def probe_sublayers(sublayer_weights, eps: float) -> List[Sublayer]:
    """The probe network's L sublayers `f_l(h) = tanh(rmsnorm(h, eps) @ W[l-1])`.

    sublayer_weights: W `[L, D, D]` (right-multiplication, `[D_in, D_out]`).  Returns L callables
    mapping `[..., D]` to `[..., D]`.
    """
    w = np.asarray(sublayer_weights, dtype=np.float64)
    return [lambda h, w_l=w[l]: np.tanh(rmsnorm(h, eps) @ w_l) for l in range(w.shape[0])]


# -- the tape ----------------------------------------------------------------------------------
class _Var:
    """A float64 value on a tape; `key` indexes its cotangent."""

    __slots__ = ("value", "key")

    def __init__(self, value: np.ndarray, key: int):
        self.value = value
        self.key = key


def _unbroadcast(g: np.ndarray, shape) -> np.ndarray:
    """Sum a cotangent `g` of a broadcast result back to an operand of `shape`."""
    g = np.sum(g, axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return np.sum(g, axis=axes, keepdims=True) if axes else g


class _Tape:
    """Minimal reverse-mode tape.  Each primitive returns `_Var`s and, when recording, stores
    `(inputs, outputs, vjp)` where `vjp(*output_cotangents)` returns one cotangent per input."""

    def __init__(self, record: bool):
        self.record = record
        self._nodes = []
        self._count = 0

    def var(self, value) -> _Var:
        self._count += 1
        return _Var(np.asarray(value, dtype=np.float64), self._count)

    def _op(self, inputs, values, vjp) -> List[_Var]:
        outputs = [self.var(v) for v in values]
        if self.record:
            self._nodes.append((inputs, outputs, vjp))
        return outputs

    def gradients(self, output: _Var, cotangent: np.ndarray, wrt: Sequence[_Var]) -> List[np.ndarray]:
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

    # elementwise and linear primitives
    def add(self, a: _Var, b: _Var) -> _Var:
        sa, sb = a.value.shape, b.value.shape
        return self._op([a, b], [a.value + b.value], lambda g: (_unbroadcast(g, sa), _unbroadcast(g, sb)))[0]

    def mul(self, a: _Var, b: _Var) -> _Var:
        av, bv = a.value, b.value
        return self._op([a, b], [av * bv],
                        lambda g: (_unbroadcast(g * bv, av.shape), _unbroadcast(g * av, bv.shape)))[0]

    def index(self, a: _Var, key) -> _Var:
        """`a[key]` for an int, tuple of ints or slice (no repeated elements)."""
        def vjp(g):
            full = np.zeros_like(a.value)
            full[key] = g
            return (full,)
        return self._op([a], [a.value[key]], vjp)[0]

    def rmsnorm(self, x: _Var, eps: float) -> _Var:
        return self._op([x], [rmsnorm(x.value, eps)], lambda g: (rmsnorm_vjp(x.value, g, eps),))[0]

    def matmul(self, x: _Var, w: _Var) -> _Var:
        """`x [..., D_in] @ w [D_in, D_out]`."""
        xv, wv = x.value, w.value

        def vjp(g):
            x2 = xv.reshape(-1, wv.shape[0])
            g2 = g.reshape(-1, wv.shape[1])
            return g @ wv.T, x2.T @ g2
        return self._op([x, w], [xv @ wv], vjp)[0]

    def tanh(self, x: _Var) -> _Var:
        y = np.tanh(x.value)
        return self._op([x], [y], lambda g: (g * (1.0 - y * y),))[0]

    def sigmoid(self, x: _Var) -> _Var:
        with np.errstate(over="ignore"):
            y = 1.0 / (1.0 + np.exp(-x.value))
        return self._op([x], [y], lambda g: (g * y * (1.0 - y),))[0]

    def call(self, fn: Sublayer, x: _Var, name: str) -> _Var:
        """A user-supplied sublayer `fn(h) -> v`; not differentiable (forward-only tapes)."""
        if self.record:
            raise RuntimeError("user-supplied sublayers have no VJP; use probe_vjp for gradients")
        v = np.asarray(fn(x.value.copy()))
        if v.shape != x.value.shape:
            raise ValueError(f"{name}: returned shape {v.shape}, expected the input's shape {x.value.shape}")
        validation.check_floating(name, v.dtype.name)
        return self.var(v)

    # depth-attention primitives (VJPs from ops)
    def depth_attention(self, sources: List[_Var], query: _Var, norm_weight: _Var, config: ResidualConfig):
        """Returns (out `_Var [..., D]`, weights `[N, ...]` or `[N, ..., H]`)."""
        kw = dict(eps=config.eps, scale=config.scale, num_heads=config.num_heads,
                  activation=config.activation, key_norm=config.key_norm)
        xs, q, g = [s.value for s in sources], query.value, norm_weight.value
        out, p = ops.depth_attention(xs, q, g, return_weights=True, **kw)

        def vjp(d_out):
            grad = ops.depth_attention_vjp(xs, q, g, d_out, **kw)
            return (*grad["sources"], grad["query"], grad["norm_weight"])
        return self._op([*sources, query, norm_weight], [out], vjp)[0], p

    def depth_attention_multi(self, sources: List[_Var], queries: _Var, norm_weights: _Var,
                              config: ResidualConfig):
        """Phase 1: (out `[S, ..., D]`, lse `[S, ...]`) as `_Var`s."""
        kw = dict(eps=config.eps, scale=config.scale)
        xs, q, g = [s.value for s in sources], queries.value, norm_weights.value
        out, lse = ops.depth_attention_multi(xs, q, g, **kw)

        def vjp(d_out, d_lse):
            grad = ops.depth_attention_multi_vjp(xs, q, g, d_out, d_lse, **kw)
            return (*grad["sources"], grad["queries"], grad["norm_weights"])
        return self._op([*sources, queries, norm_weights], [out, lse], vjp)

    def merge_partial(self, out1: _Var, lse1: _Var, partial: _Var, query: _Var, norm_weight: _Var,
                      config: ResidualConfig) -> _Var:
        """Phase 2: merge phase-1 stats with the intra-block partial sum; out `[..., D]`."""
        kw = dict(eps=config.eps, scale=config.scale)
        args = [a.value for a in (out1, lse1, partial, query, norm_weight)]
        out = ops.merge_partial(*args, **kw)

        def vjp(d_out):
            grad = ops.merge_partial_vjp(*args, d_out, **kw)
            return tuple(grad[k] for k in ("out1", "lse1", "partial", "query", "norm_weight"))
        return self._op([out1, lse1, partial, query, norm_weight], [out], vjp)[0]


# -- the schedule ------------------------------------------------------------------------------
def _schedule(config: ResidualConfig, tape: _Tape, params: Dict[str, _Var], embedding: _Var,
              sublayer: Callable[[int, _Var], _Var], num_layers: int, schedule: str,
              weights: list) -> _Var:
    """Run the residual scheme over L = num_layers sublayers; returns `h_{L+1}` (before any final
    norm).  `sublayer(l, h_l)` returns `v_l`.  The depth weights of every depth-attention call
    are appended to `weights` in call order (direct schedule)."""
    L, kind, eps = num_layers, config.kind, config.eps

    def row(name, r):
        return tape.index(params[name], r)

    if kind in ("standard", "scalar", "gated"):
        # M7: h_{l+1} = h_l + c_l * v_l with c_l = 1, alphas[l-1] or a sigmoid gate of rmsnorm(h_l).
        h = embedding
        for l in range(1, L + 1):
            v = sublayer(l, h)
            if kind == "scalar":
                v = tape.mul(row("alphas", l - 1), v)
            elif kind == "gated":
                logits = tape.matmul(tape.rmsnorm(h, eps), row("gate_weights", l - 1))
                v = tape.mul(tape.sigmoid(tape.add(logits, row("gate_biases", l - 1))), v)
            h = tape.add(h, v)
        return h

    outputs = [embedding]  # v_0..v_{l-1}

    if kind == "static":
        # M7: h_l = sum_{i<l} depth_weights[l-1, i] v_i (DenseFormer-style); M8 init equals standard.
        def mix(r):
            h = tape.mul(row("depth_weights", (r, 0)), outputs[0])
            for i in range(1, r + 1):
                h = tape.add(h, tape.mul(row("depth_weights", (r, i)), outputs[i]))
            return h

        for l in range(1, L + 1):
            outputs.append(sublayer(l, mix(l - 1)))
        return mix(L)

    def attend(sources, r):
        # M6: static pseudo-query row r, or q = rmsnorm(last source) @ query_weights[r] (per token).
        if config.query == "static":
            q = row("queries", r)
        else:
            q = tape.matmul(tape.rmsnorm(sources[-1], eps), row("query_weights", r))
        out, p = tape.depth_attention(sources, q, row("norm_weights", r), config)
        weights.append(p)
        return out

    if kind == "block":
        return _block_schedule(config, tape, outputs[0], sublayer, L, schedule, attend, row)

    def sources(l):
        # M2 full: [v_0..v_{l-1}].  M5 window: [v_0] + [v_j : max(1, l-W) <= j <= l-1].
        if kind == "window":
            return [outputs[0]] + outputs[max(1, l - config.window):l]
        return outputs[:l]

    for l in range(1, L + 1):
        outputs.append(sublayer(l, attend(sources(l), l - 1)))
    return attend(sources(L + 1), L)  # M4: the output aggregation is row L.


def _block_schedule(config, tape, embedding, sublayer, L, schedule, attend, row) -> _Var:
    """M3 block: b_0 = v_0; block n holds sublayers (n-1)S+1 .. min(nS, L).  Its first sublayer
    attends over [b_0..b_{n-1}], later ones over [b_0..b_{n-1}, partial]; b_n = partial.

    M9 two-phase: per block, phase 1 runs every block query over [b_0..b_{n-1}] at once
    (`depth_attention_multi`); the first sublayer takes its phase-1 output directly and later
    ones merge the partial sum (`merge_partial`).  Equal to the direct schedule.
    """
    S = config.block_size
    blocks = [embedding]
    for first in range(1, L + 1, S):
        layers = range(first, min(first + S - 1, L) + 1)
        if schedule == "two_phase":
            rows = slice(first - 1, layers[-1])
            out1, lse1 = tape.depth_attention_multi(blocks, row("queries", rows), row("norm_weights", rows),
                                                    config)
        partial = None
        for i, l in enumerate(layers):
            if schedule == "direct":
                h = attend(blocks if partial is None else blocks + [partial], l - 1)
            elif partial is None:
                h = tape.index(out1, 0)
            else:
                h = tape.merge_partial(tape.index(out1, i), tape.index(lse1, i), partial,
                                       row("queries", l - 1), row("norm_weights", l - 1), config)
            v = sublayer(l, h)
            partial = v if partial is None else tape.add(partial, v)
        blocks.append(partial)
    return attend(blocks, L)  # M4: aggregate [b_0..b_N] with row L.


# -- argument checks ---------------------------------------------------------------------------
def _check_array(name: str, value) -> np.ndarray:
    a = np.asarray(value)
    validation.check_floating(name, a.dtype.name)
    return a


def _check_call(config, embedding, schedule: str) -> np.ndarray:
    """Validate config, schedule (M9) and the embedding `[..., D]`; returns the embedding as an array."""
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    config.check_schedule(schedule)
    emb = _check_array("embedding", embedding)
    if emb.ndim < 1 or emb.shape[-1] < 1:
        raise ValueError(f"embedding: expected shape [..., D] with D >= 1, got shape {emb.shape}")
    return emb


def _check_params(config: ResidualConfig, params, num_layers: int, dim: int) -> None:
    """params must hold exactly the names and shapes of `config.param_shapes(L, D)` (M6)."""
    config.check_params(params, num_layers, dim, lambda v: np.asarray(v).dtype.name)


def _check_sublayer_weights(sublayer_weights, dim: int) -> np.ndarray:
    w = _check_array("sublayer_weights", sublayer_weights)
    if w.ndim != 3 or w.shape[0] < 1 or w.shape[1:] != (dim, dim):
        raise ValueError(f"sublayer_weights: expected shape [L, D, D] with L >= 1 and D = {dim}, got shape {w.shape}")
    return w


def _leaves(tape: _Tape, params: Mapping) -> Dict[str, _Var]:
    return {name: tape.var(value) for name, value in params.items()}


# -- public API --------------------------------------------------------------------------------
def stack_forward(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Sublayer], *,
                  schedule: str = "direct", return_weights: bool = False):
    """Run the residual scheme `config` over user-supplied sublayers (spec section 4, M1-M9).

    Args:
      config: the residual scheme.
      params: name -> array of `config.param_shapes(L, D)` (e.g. `config.init_params(L, D)`, M8).
      embedding: v_0 `[..., D]`, any floating dtype (computed in float64).
      sublayers: L callables `h [..., D] -> v [..., D]`; sublayers[l-1] is f_l.
      schedule: "direct", or "two_phase" (M9; kind="block" with softmax, key_norm, one head and
        static queries only).
      return_weights: also return the depth weights of each of the L+1 depth-attention calls
        (attention kinds, direct schedule): a list of `[N_l, ...]` (`[N_l, ..., H]` if H > 1).

    Returns:
      out `[..., D]` float64 (the stack's output before any final norm), or `(out, weights)`.
    """
    emb = _check_call(config, embedding, schedule)
    if not isinstance(sublayers, (list, tuple)) or not all(callable(f) for f in sublayers):
        raise TypeError("sublayers: expected a list or tuple of callables h -> v")
    if len(sublayers) < 1:
        raise ValueError("sublayers: expected L >= 1 sublayers, got an empty sequence")
    _check_params(config, params, len(sublayers), emb.shape[-1])
    if return_weights and not (config.is_attention and schedule == "direct"):
        raise ValueError(
            f"return_weights: depth weights exist only for attention kinds under schedule='direct'; "
            f"got kind={config.kind!r}, schedule={schedule!r}"
        )
    tape = _Tape(record=False)
    weights: list = []
    out = _schedule(config, tape, _leaves(tape, params), tape.var(emb),
                    lambda l, h: tape.call(sublayers[l - 1], h, f"sublayers[{l - 1}]"),
                    len(sublayers), schedule, weights)
    return (out.value, weights) if return_weights else out.value


def probe_forward(config: ResidualConfig, params: Mapping, embedding, sublayer_weights, *,
                  schedule: str = "direct") -> np.ndarray:
    """The spec's probe network: `stack_forward` with `probe_sublayers(sublayer_weights, config.eps)`.

    embedding `[..., D]`; sublayer_weights `[L, D, D]`.  Returns out `[..., D]` float64.
    """
    emb = _check_call(config, embedding, schedule)
    w = _check_sublayer_weights(sublayer_weights, emb.shape[-1])
    return stack_forward(config, params, embedding, probe_sublayers(w, config.eps), schedule=schedule)


def probe_vjp(config: ResidualConfig, params: Mapping, embedding, sublayer_weights, cotangent, *,
              schedule: str = "direct") -> Dict[str, np.ndarray]:
    """Hand-written reverse mode of `probe_forward` for a cotangent `[..., D]` of its output.

    Returns float64 gradients: "embedding" `[..., D]`, "sublayer_weights" `[L, D, D]`, and one
    entry per name of `config.param_shapes(L, D)` with that shape (unused entries, like the
    upper triangle of static depth weights, get 0).  Gradients flow through every source.
    schedule="two_phase" differentiates the two-phase forward (M9) with the VJPs of
    `depth_attention_multi` and `merge_partial`; it equals the direct gradient to rounding.
    """
    emb = _check_call(config, embedding, schedule)
    w = _check_sublayer_weights(sublayer_weights, emb.shape[-1])
    _check_params(config, params, w.shape[0], emb.shape[-1])
    cot = _check_array("cotangent", cotangent)
    if cot.shape != emb.shape:
        raise ValueError(f"cotangent: expected the output's shape {emb.shape}, got shape {cot.shape}")
    tape = _Tape(record=True)
    leaves = _leaves(tape, params)
    emb_var, w_var = tape.var(emb), tape.var(w)

    def sublayer(l, h):
        return tape.tanh(tape.matmul(tape.rmsnorm(h, config.eps), tape.index(w_var, l - 1)))

    out = _schedule(config, tape, leaves, emb_var, sublayer, w.shape[0], schedule, [])
    wrt = [emb_var, w_var, *leaves.values()]
    grads = tape.gradients(out, cot.astype(np.float64), wrt)
    return dict(zip(["embedding", "sublayer_weights", *leaves], grads))
