"""The spec's probe network (spec section 6), written once over a `ResidualOps` object.

The probe is a residual scheme (section 4) over L sublayers `f_l(h) = tanh(rmsnorm(h) @ W[l-1])`,
W = sublayer_weights `[L, D, D]`; with `fuse_out_norm` (M15) the stream hands each sublayer its
normed input and `f_l(n) = tanh(n @ W[l-1])`.  This module builds those sublayers from the
primitives of an ops object (`take`, `rmsnorm`, `matmul`, `tanh`), as `schedule.ResidualStream`
builds the schedule from them, so every framework runs the same probe: the reference on its
float64 `Tape` (its VJPs give `probe_vjp`), the conformance suite on a rounding tape, and each
backend on its own ops object, either through `run_probe` or by handing `probe_sublayers` to its
router (which then runs the schedule on its own ops object).  A scheme that changes the probe's
sublayers changes it here.

Dtypes are the ops object's business (C10): the stream casts every v_l to the embedding's dtype
when it is pushed (M1a), so a sublayer may return its compute dtype.

This module is framework-neutral: it imports no array library.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from . import validation
from .config import ResidualConfig
from .schedule import ResidualOps, ScheduleObserver, run_schedule

Array = Any  # an array of the framework the ops belong to

__all__ = ["check_sublayer_weights", "probe_sublayers", "run_probe"]


def check_sublayer_weights(sublayer_weights: Array, dim: int,
                           dtype_name: Callable[[Array], str]) -> int:
    """Validate sublayer_weights W `[L, D, D]` (floating, L >= 1, D = dim); returns L."""
    validation.check_floating("sublayer_weights", dtype_name(sublayer_weights))
    shape = tuple(sublayer_weights.shape)
    if len(shape) != 3 or shape[0] < 1 or shape[1:] != (dim, dim):
        raise ValueError(f"sublayer_weights: expected shape [L, D, D] with L >= 1 and D = {dim}, "
                         f"got shape {shape}")
    return shape[0]


def probe_sublayers(config: ResidualConfig, ops: ResidualOps,
                    sublayer_weights: Array) -> List[Callable[[Array], Array]]:
    """The probe's L sublayers on `ops`: `f_l(h) = tanh(rmsnorm(h, config.eps) @ W[l-1])`, or
    `tanh(h @ W[l-1])` when config.fuse_out_norm (M15: the stream hands the normed input).

    sublayer_weights: W `[L, D, D]` (right-multiplication, `[D_in, D_out]`), an array of the
    ops' framework (a `Var` on a tape).  Returns L callables `h [..., D] -> v [..., D]`.
    """
    eps, prenorm = config.eps, not config.fuse_out_norm

    def sublayer(h, l: int):
        x = ops.rmsnorm(h, eps) if prenorm else h
        return ops.tanh(ops.matmul(x, ops.take(sublayer_weights, l)))

    return [lambda h, l=l: sublayer(h, l) for l in range(sublayer_weights.shape[0])]


def run_probe(config: ResidualConfig, ops: ResidualOps, embedding: Array, sublayer_weights: Array,
              *, schedule: str = "direct", observer: Optional[ScheduleObserver] = None,
              mix=None, scale=None) -> Array:
    """The probe network's output `[..., D]` (spec section 6: `probe_forward`) on `ops`, whose
    params hold the scheme's parameters: `schedule.run_schedule` over `probe_sublayers`.

    embedding: v_0 `[..., D]`; sublayer_weights: W `[L, D, D]`; schedule, observer, mix, scale
    as in `run_schedule` (M9, M10).  Argument checks are the caller's
    (`check_sublayer_weights`, `config.check_params`; the stream checks config and schedule).
    """
    return run_schedule(config, ops, embedding, probe_sublayers(config, ops, sublayer_weights),
                        schedule=schedule, observer=observer, mix=mix, scale=scale)
