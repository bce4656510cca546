"""Which implementation runs an op: the Pallas kernels (GPU: Triton-lowered Pallas; TPU: Mosaic)
or XLA, chosen once per public call from explicit inputs.

Implementations (`REGISTRY`, in order of preference) are hashable objects with
`supports(request)` (None, or why not), `resolve(request)` (the object with everything fixed for
the call, e.g. the tile) and the entry points `forward`, `backward`, `phase1`, `phase1_backward`,
`merge`, `merge_backward`:

  pallas  `pallas.impl.Pallas`: one head; compiled on gpu/tpu (not float64; on GPU, D a power of
          two), or in an interpreter on any platform
  xla     `_xla.Xla`: every call

`select(impl, request)` is called by each public op of `attnres_jax.ops` when it is called (with
`impl=None|"xla"|"pallas"`, its keyword); the chosen object is a static (nondiff) argument of the
op's custom VJP, so the forward and the backward run the same implementation and what was traced
is keyed by it.  `impl=None` picks the first implementation in `REGISTRY` that supports the call
(on CPU: XLA); `impl="xla"` or `"pallas"` forces one (ValueError if it cannot run the call).

`use(mode, tile=, poison=)` forces a choice for the calls made inside the block (tests):
"interpret" runs the kernels in Pallas interpret mode on any platform, "interpret_tpu" through
JAX's TPU interpreter (`pltpu.InterpretParams`: TPU memory spaces and semantics, simulated on CPU),
"xla" forces XLA, "auto" the default.  It sets a `contextvars.ContextVar` (per thread and per
asyncio task) read when a public op is called, i.e. at trace time: a function jitted inside the
block keeps its choice when the cached trace is called outside it (jit keys its cache by its
arguments, not by this context).  To make the choice part of a jit key, pass `impl=` as a static
argument instead.  Calls the forced implementation cannot run (multi-head under "interpret") fall
back to XLA; an explicit `impl=` keyword wins over the block.

`kernels.CALLS` counts the `pallas_call`s built (by kernel name, at trace time) so tests can prove
a kernel ran.

Status: the kernels are tested in the generic and the TPU interpreter only; the Triton and Mosaic
lowerings have not been compiled or run on a GPU/TPU yet.  Multi-head calls always run on XLA.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, NamedTuple, Optional, Protocol, Union

from .._args import Request
from .._xla import XLA, Xla
from .impl import Pallas

MODES = ("auto", "interpret", "interpret_tpu", "xla")


class Impl(Protocol):
    """An implementation of the ops (see the module docstring for the entry points)."""

    name: str

    def supports(self, request: Request) -> Optional[str]: ...

    def resolve(self, request: Request) -> "Impl": ...


#: The implementations in order of preference for `impl=None`.
REGISTRY: Dict[str, Union[Pallas, Xla]] = {"pallas": Pallas(), "xla": XLA}


class _Forced(NamedTuple):
    mode: str  # one of MODES
    tile: Optional[int]
    poison: bool


_FORCED: contextvars.ContextVar[Optional[_Forced]] = contextvars.ContextVar("attnres_jax_impl", default=None)


@contextlib.contextmanager
def use(mode: str, *, tile: Optional[int] = None, poison: bool = False):
    """Force a dispatch mode (one of MODES) for the public ops called inside the block; `tile` and
    `poison` configure the kernels.  Read when an op is called: see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if tile is not None and (not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile: expected an int >= 1 or None, got {tile!r}")
    token = _FORCED.set(_Forced(mode, tile, bool(poison)))
    try:
        yield
    finally:
        _FORCED.reset(token)


def _configured(name: str, forced: Optional[_Forced]):
    """REGISTRY[name] with the kernel settings of the enclosing `use` block."""
    impl = REGISTRY[name]
    if name != "pallas" or forced is None:
        return impl
    interpret = {"interpret": "generic", "interpret_tpu": "tpu"}.get(forced.mode, impl.interpret)
    return Pallas(interpret=interpret, tile=forced.tile, poison=forced.poison)


def select(impl: Optional[str], request: Request):
    """The implementation that runs one public call, resolved for it (hashable).

    impl: None (automatic: the `use` block if any, else the first of `REGISTRY` that supports
    the call), "xla" or "pallas" (forced; ValueError if it cannot run the call).
    """
    forced = _FORCED.get()
    if impl is not None:
        if impl not in REGISTRY:
            raise ValueError(f"impl: expected None or one of {tuple(REGISTRY)}, got {impl!r}")
        chosen = _configured(impl, forced)
        reason = chosen.supports(request)
        if reason is not None:
            raise ValueError(f"impl={impl!r} cannot run this {request.op} call: {reason}")
        return chosen.resolve(request)
    names = ("xla",) if forced is not None and forced.mode == "xla" else tuple(REGISTRY)
    for name in names:
        chosen = _configured(name, forced)
        if chosen.supports(request) is None:
            return chosen.resolve(request)
    raise AssertionError("XLA supports every call")  # pragma: no cover
