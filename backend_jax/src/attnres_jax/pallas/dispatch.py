"""Which path runs an op: a Pallas kernel (GPU: Triton-lowered Pallas; TPU: Mosaic) or XLA.

`plan(kind, ...)` is asked at trace time by `attnres_jax.ops`; it returns a `Plan` (run the
kernel) or None (the XLA path).  Mode "auto" (default) picks by `jax.default_backend()`:
gpu and tpu run kernels where they apply (one head; not float64; on GPU, D a power of two),
every other platform uses XLA.  `use("interpret", tile=8)` forces the kernels in Pallas interpret
mode on any platform (tests); `use("interpret_tpu")` does the same through JAX's TPU interpreter
(`pltpu.InterpretParams`: TPU memory spaces and semantics, simulated on CPU); `use("xla")` forces
XLA.  `CALLS` counts the `pallas_call`s built
(by kernel name, at trace time) so tests can prove a kernel ran.

Status: the kernels are tested in the generic and the TPU interpreter only; the Triton and Mosaic
lowerings have not
been compiled or run on a GPU/TPU yet.  Multi-head calls, and the backward of phase 1, always
run on XLA.
"""

from __future__ import annotations

import collections
import contextlib
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

MODES = ("auto", "interpret", "interpret_tpu", "xla")

#: Spy: kernel name -> number of `pallas_call`s built (counted when traced, in `kernels._call`).
CALLS: collections.Counter = collections.Counter()


class Plan(NamedTuple):
    tile: int  # TB: token rows per program
    interpret: object  # False (compile), True (generic interpreter) or pltpu.InterpretParams
    poison: bool  # alias every output to a NaN-filled input (tests)


_settings = {"mode": "auto", "tile": None, "poison": False}


@contextlib.contextmanager
def use(mode: str, *, tile: Optional[int] = None, poison: bool = False):
    """Force a dispatch mode inside the block (trace time): one of MODES."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if tile is not None and (not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile: expected an int >= 1 or None, got {tile!r}")
    saved = dict(_settings)
    _settings.update(mode=mode, tile=tile, poison=poison)
    try:
        yield
    finally:
        _settings.clear()
        _settings.update(saved)


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def plan(*, num_heads: int, dim: int, dtype, num_sources: int, num_sets: int = 1) -> Optional[Plan]:
    """The kernel plan for one op call, or None for the XLA path."""
    mode = _settings["mode"]
    if mode == "xla" or num_heads != 1:
        return None
    if mode == "interpret":
        return Plan(_settings["tile"] or 8, True, _settings["poison"])
    if mode == "interpret_tpu":
        from jax.experimental.pallas import tpu as pltpu

        return Plan(_settings["tile"] or 8, pltpu.InterpretParams(), _settings["poison"])
    platform = jax.default_backend()
    if platform not in ("gpu", "tpu") or jnp.dtype(dtype) == jnp.float64:
        return None
    if platform == "gpu" and dim & (dim - 1):
        return None  # Triton blocks must be powers of two
    # Keep a tile of every source (plus S accumulators) within ~4 MiB of fp32.
    rows = (1 << 20) // max(1, dim * (num_sources + num_sets))
    tile = max(8, min(256, _pow2_floor(rows))) if platform == "tpu" else max(1, min(64, _pow2_floor(rows)))
    return Plan(_settings["tile"] or tile, False, _settings["poison"])
