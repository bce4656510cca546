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
  probe_sublayers  the probe's sublayers as plain NumPy callables (for `stack_forward`).
  rmsnorm, rmsnorm_vjp  the gainless RMSNorm and its VJP.

The schedule is `schedule.ResidualStream` and the probe network `probe.run_probe` (both shared
with every backend); here they run on `tape.Tape`, the float64 `ResidualOps` with hand-written
VJPs: a tape that records nothing for `stack_forward` and `probe_forward`, a recording one for
`probe_vjp`.  No autodiff library is involved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Dict, List, Sequence

import numpy as np
from attnres_core import probe, validation
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ScheduleObserver, run_schedule

from .tape import Tape, Var, rmsnorm, rmsnorm_vjp

Sublayer = Callable[[np.ndarray], np.ndarray]

__all__ = ["probe_forward", "probe_sublayers", "probe_vjp", "rmsnorm", "rmsnorm_vjp", "stack_forward"]


def probe_sublayers(sublayer_weights, eps: float, *, prenorm: bool = True) -> List[Sublayer]:
    """The probe network's L sublayers `f_l(h) = tanh(rmsnorm(h, eps) @ W[l-1])` as plain NumPy
    callables (float64); prenorm=False (a config with fuse_out_norm, M15: the stream hands the
    normed input) drops the rmsnorm: `f_l(n) = tanh(n @ W[l-1])`.  The formula is
    `attnres_core.probe.probe_sublayers`, here on a tape that records nothing.

    sublayer_weights: W `[L, D, D]` (right-multiplication, `[D_in, D_out]`).  Returns L callables
    mapping `[..., D]` to `[..., D]`.
    """
    tape = Tape(record=False)
    config = ResidualConfig(eps=eps, fuse_out_norm=not prenorm)
    fs = probe.probe_sublayers(config, tape, tape.var(np.asarray(sublayer_weights, dtype=np.float64)))
    return [lambda h, f=f: f(tape.var(h)).value for f in fs]


def probe_tape_sublayers(tape: Tape, weights: Var, num_layers: int, eps: float, *,
                         prenorm: bool = True) -> list:
    """The probe's sublayers as tape primitives (differentiable): weights is W `[L, D, D]` with
    L = num_layers; prenorm as `probe_sublayers`.  `attnres_core.probe.probe_sublayers` with a
    config of that eps (and fuse_out_norm = not prenorm)."""
    if weights.shape[0] != num_layers:
        raise ValueError(f"num_layers: {num_layers}, but weights has shape {weights.shape}")
    return probe.probe_sublayers(ResidualConfig(eps=eps, fuse_out_norm=not prenorm), tape, weights)


class _WeightsCollector(ScheduleObserver):
    """Keeps every depth-attention row's weights in call order."""

    wants_weights = True

    def __init__(self):
        self.weights: list = []

    def depth_attention(self, row, labels, sources, weights):
        self.weights.append(weights)


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


# -- public API --------------------------------------------------------------------------------
def stack_forward(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Sublayer], *,
                  schedule: str = "direct", return_weights: bool = False, mix=None, scale=None):
    """Run the residual scheme `config` over user-supplied sublayers (spec section 4, M1-M9).

    Args:
      config: the residual scheme.
      params: name -> array of `config.param_shapes(L, D)` (e.g. `config.init_params(L, D)`, M8).
      embedding: v_0 `[..., D]`, any floating dtype (computed in float64).
      sublayers: L callables `h [..., D] -> v [..., D]`; sublayers[l-1] is f_l.
      schedule: "direct", or "two_phase" (M9; kind="block" with softmax, key_norm, one head and
        static queries only).
      mix, scale: M10 per-call inputs: alpha in [0, 1] blending standard and the scheme (None:
        the scheme), and a logit scale replacing config.scale (None: keep it).
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
    tape = Tape(params, record=False)
    observer = _WeightsCollector() if return_weights else None
    calls = [_checked_call(tape, f, f"sublayers[{i}]") for i, f in enumerate(sublayers)]
    out = run_schedule(config, tape, tape.var(emb), calls, schedule=schedule, observer=observer,
                       mix=mix, scale=scale)
    return (out.value, observer.weights) if return_weights else out.value


def _checked_call(tape: Tape, fn: Sublayer, name: str):
    """A user-supplied sublayer `fn(h) -> v` on a forward-only tape (it has no VJP); its output
    must keep the input's shape and be floating."""
    def call(h: Var) -> Var:
        v = np.asarray(fn(h.value.copy()))
        if v.shape != h.value.shape:
            raise ValueError(f"{name}: returned shape {v.shape}, expected the input's shape {h.value.shape}")
        validation.check_floating(name, v.dtype.name)
        return tape.var(v)
    return call


def _check_probe(config, params, embedding, sublayer_weights, schedule: str) -> tuple:
    """(embedding, sublayer_weights) as arrays, after the probe's argument checks (spec 7)."""
    emb = _check_call(config, embedding, schedule)
    w = _check_array("sublayer_weights", sublayer_weights)
    probe.check_sublayer_weights(w, emb.shape[-1], lambda a: a.dtype.name)
    _check_params(config, params, w.shape[0], emb.shape[-1])
    return emb, w


def sublayers_in(tape: Tape, sublayers: Sequence[Callable], dtype) -> List[Callable]:
    """`sublayers` each returning its v rounded to `dtype` (a cast, cotangent rounded back:
    `Tape.round_to`); None: unchanged.  The probe's `sublayer_dtype` (M1a)."""
    if dtype is None:
        return list(sublayers)
    validation.check_floating("sublayer_dtype", dtype)
    return [lambda h, f=f: tape.round_to(f(h), dtype) for f in sublayers]


def _probe_on_tape(config, params, emb, w, *, record: bool, schedule: str, mix, scale,
                   sublayer_dtype=None) -> tuple:
    """(tape, out, embedding Var, weights Var): the probe network (checked arguments) on a Tape."""
    tape = Tape(params, record=record)
    emb_var, w_var = tape.var(emb), tape.var(w)
    sublayers = sublayers_in(tape, probe.probe_sublayers(config, tape, w_var), sublayer_dtype)
    out = run_schedule(config, tape, emb_var, sublayers, schedule=schedule, mix=mix, scale=scale)
    return tape, out, emb_var, w_var


def probe_forward(config: ResidualConfig, params: Mapping, embedding, sublayer_weights, *,
                  schedule: str = "direct", mix=None, scale=None, sublayer_dtype=None) -> np.ndarray:
    """The spec's probe network (`attnres_core.probe.run_probe` on a float64 tape).

    embedding `[..., D]`; sublayer_weights `[L, D, D]`; schedule, mix, scale as in
    `stack_forward`; sublayer_dtype: None, or the dtype every sublayer returns (its v_l rounded
    to it; M1a: the stream's dtype is the embedding's, which float64 does not model).  Returns
    out `[..., D]` float64.
    """
    emb, w = _check_probe(config, params, embedding, sublayer_weights, schedule)
    return _probe_on_tape(config, params, emb, w, record=False, schedule=schedule, mix=mix,
                          scale=scale, sublayer_dtype=sublayer_dtype)[1].value


def probe_vjp(config: ResidualConfig, params: Mapping, embedding, sublayer_weights, cotangent, *,
              schedule: str = "direct", mix=None, scale=None, sublayer_dtype=None) -> Dict[str, np.ndarray]:
    """Hand-written reverse mode of `probe_forward` for a cotangent `[..., D]` of its output.

    Returns float64 gradients: "embedding" `[..., D]`, "sublayer_weights" `[L, D, D]`, and one
    entry per name of `config.param_shapes(L, D)` with that shape (unused entries, like the
    upper triangle of static depth weights, get 0).  Gradients flow through every source.
    schedule="two_phase" differentiates the two-phase forward (M9) with the VJPs of
    `depth_attention_multi` and `merge_partial`; it equals the direct gradient to rounding.
    """
    emb, w = _check_probe(config, params, embedding, sublayer_weights, schedule)
    cot = _check_array("cotangent", cotangent)
    if cot.shape != emb.shape:
        raise ValueError(f"cotangent: expected the output's shape {emb.shape}, got shape {cot.shape}")
    tape, out, emb_var, w_var = _probe_on_tape(config, params, emb, w, record=True,
                                               schedule=schedule, mix=mix, scale=scale,
                                               sublayer_dtype=sublayer_dtype)
    wrt = [emb_var, w_var, *tape.leaves.values()]
    grads = tape.gradients(out, cot.astype(np.float64), wrt)
    return dict(zip(["embedding", "sublayer_weights", *tape.leaves], grads))
