"""The MLX backend's one implementation registry: which implementation serves each op call.

The public backend contract, the same names in `attnres_torch.dispatch` and `attnres_jax.dispatch`
(`IMPLEMENTATIONS`, `availability()`, `use_impl()`, `Choice`, `last_choice()`, `impl_counts()`,
`capabilities()`; written out in `attnres_core.dispatch`, whose bookkeeping this module uses:
the forcing, the record, the refusal rule).  Here `IMPLEMENTATIONS` is "metal"
(`kernels/metal.py`, the `mx.fast.metal_kernel` kernels: Apple GPUs, every dtype but float64),
then "compiled" (`kernels/compiled.py`, the `mx.compile`d composition: everywhere); `use_impl`
takes no options.  This module supplies the implementations, their support checks, availability
and capabilities.

The ops (`ops.py`) call `choose(op, dtype)` once per call with the sources' dtype; forward and
backward of that call both run on the implementation it returns.  Under `mx.compile` a call is
chosen (and counted) when it is traced.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Dict, Iterator, Optional, Protocol, Tuple

from attnres_core import dispatch as contract
from attnres_core.dispatch import Choice

from .common import dtype_name
from .kernels import compiled, metal

#: The public ops dispatched here.
OPS = contract.OPS


class Implementation(Protocol):
    """One way to run the ops.  Every entry point takes the op's own arrays and returns results
    in their final shapes and dtypes (outputs per C10; each gradient in its input's dtype).

    attend_*: xs a list of N `[..., D]` or one stacked `[N, ..., D]`; q `[D]` or `[..., D]`
      (`[S, D]` for mode "multi"); g like q's last axes (`[D]`, `[S, D]`), never None; rs the
      cached inverse RMS given, `[..., H]` (`[..., 1]` for "multi"), in source order (one
      stacked `[N, ..., H]` where `stacked_inv_rms` is True and `st.stacked_rms` says so); ws
      the fused output norm's weight (C17): [w `[D]`] when `st.out_norm_eps` is set, else [].
      attend_forward -> (out `[..., D]` (`[S, ..., D]`), out_normed `[..., D]` (with ws),
      lse `[..., H?]` (`[S, ...]`; softmax, and for "single" only with `st.with_lse`), weights
      `[N, ..., H?]` ("single" with `st.with_weights` only)); H? is absent with one head.
      attend_backward(d_out like out, d_normed like out_normed or None, d_lse like lse or None)
      -> (d sources (a list or one stacked array, like xs), d query, d gain, [d r per cached
      r], [d w per w in ws]).
    merge_*: o1, x `[..., D]`; l1 `[...]`; q `[D]` or `[..., D]`; g `[D]`.
      merge_forward -> (out `[..., D]`, lse `[...]`); merge_backward(d_out, d_lse) ->
      (d out1, d lse1, d partial, d query, d gain).
    """

    name: str
    #: Whether the attend entry points take a stacked inverse RMS `[N, ..., H]`.
    stacked_inv_rms: bool

    def unavailable(self) -> Optional[str]:
        """None where it can run here (device, platform), else why not (one line)."""

    def unsupported(self, dtype) -> Optional[str]:
        """None where it can run a call whose sources have `dtype`, else why not."""

    def available(self) -> bool: ...

    def supports(self, dtype) -> bool: ...

    def attend_forward(self, st, xs, q, g, rs, ws) -> tuple: ...

    def attend_backward(self, st, xs, q, g, rs, ws, d_out, d_normed, d_lse) -> tuple: ...

    def merge_forward(self, eps: float, scale: float, o1, l1, x, q, g) -> tuple: ...

    def merge_backward(self, eps: float, scale: float, o1, l1, x, q, g, d_out, d_lse) -> tuple: ...


#: The implementation objects by name, in preference order.
REGISTRY: Dict[str, Implementation] = {
    impl.name: impl for impl in (metal.IMPLEMENTATION, compiled.IMPLEMENTATION)}
IMPLEMENTATIONS: Tuple[str, ...] = tuple(REGISTRY)


#: The contract's bookkeeping (`attnres_core.dispatch`): the forcing (a name) and the record.
_REGISTRY = contract.Registry("attnres_mlx", IMPLEMENTATIONS)


def _check_name(name) -> None:
    if name not in REGISTRY:
        raise ValueError(f"use_impl: expected one of {', '.join(IMPLEMENTATIONS)} or 'auto', "
                         f"got {name!r}")


def availability() -> Dict[str, Optional[str]]:
    """Every implementation name -> None where it can serve calls on this machine and install,
    else a one-line reason (e.g. metal: "not Apple silicon / Metal unavailable")."""
    return {name: impl.unavailable() for name, impl in REGISTRY.items()}


@contextlib.contextmanager
def use_impl(name: str, **options) -> Iterator[None]:
    """Force implementation `name` for the op calls made in the block ("auto": the default
    choice).  Scoped to the current context (thread, asyncio task); nests.

    A call the forced implementation cannot take raises ValueError naming the implementation,
    the op and the reason (metal where Metal is unavailable), with one documented exception:
    float64 sources under "metal" (Metal has no float64) run on "compiled", recorded in
    `last_choice()` with metal's refusal, so a forced run over mixed dtypes stays usable.
    Neither implementation takes options: any keyword raises TypeError.  An unknown name raises
    ValueError listing `IMPLEMENTATIONS`.
    """
    if options:
        raise TypeError(f"use_impl: implementation {name!r} takes no options, got "
                        f"{', '.join(sorted(options))}")
    if name != "auto":
        _check_name(name)
    with _REGISTRY.forcing(None if name == "auto" else name):
        yield


def _select(op: str, dtype) -> Tuple[Implementation, Tuple[Tuple[str, str], ...]]:
    """(implementation, refusals) for a call of `op` with sources of `dtype`; nothing recorded."""
    forced = _REGISTRY.forced()
    given = {}
    if forced is not None:
        impl = REGISTRY[forced]
        reason = impl.unsupported(dtype)
        if reason is None:
            reason = impl.unavailable()
            if reason is not None:
                raise ValueError(f"use_impl: implementation {forced!r} cannot serve {op} "
                                 f"({dtype_name(dtype)} sources): {reason}")
            return impl, _REGISTRY.refused_before(forced, f"use_impl({forced!r})")
        given[forced] = reason  # metal with float64: the documented fallback
    name, refused = _REGISTRY.auto(lambda n: REGISTRY[n].unavailable() or REGISTRY[n].unsupported(dtype),
                                   given)
    if name is None:
        raise ValueError(f"{op}: no implementation serves {dtype_name(dtype)} sources here: "
                         + "; ".join(f"{n}: {r}" for n, r in refused))
    return REGISTRY[name], refused


def choose(op: str, dtype) -> Implementation:
    """The implementation that serves this call of `op` (one of `OPS`) whose sources have
    `dtype`, recorded for `last_choice` and `impl_counts`."""
    impl, refused = _select(op, dtype)
    _REGISTRY.record(Choice(op, impl.name, refused))
    return impl


def last_choice() -> Optional[Choice]:
    """The Choice of the most recent op call in this process (None before the first)."""
    return _REGISTRY.last_choice()


def impl_counts() -> collections.Counter:
    """Op calls served per implementation since import (a copy)."""
    return _REGISTRY.impl_counts()


def capabilities() -> dict:
    """{"dtypes", "devices", "fused_kernel", "deterministic"} of the default op here: where the
    Metal kernels are available (Metal, default device the GPU) the ops run there in float16,
    bfloat16 and float32; float64 exists on MLX's CPU device only (C10)."""
    on_metal = REGISTRY["metal"].unavailable() is None
    return {"dtypes": ("float16", "bfloat16", "float32") + (() if on_metal else ("float64",)),
            "devices": ("gpu",) if on_metal else ("cpu",),
            "fused_kernel": on_metal, "deterministic": True}


__all__ = ["IMPLEMENTATIONS", "Choice", "Implementation", "availability", "capabilities", "choose",
           "impl_counts", "last_choice", "use_impl"]
