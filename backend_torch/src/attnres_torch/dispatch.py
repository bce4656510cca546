"""Which implementation runs a call: "triton", "cpu_c", "cpu" or "composite".

* "triton": every tensor on CUDA, Triton importable and `kernels.triton_depth.supports(...)`.
* "cpu_c": the fused C kernel (`cpu_c.py`, `csrc/depth_cpu.c`) for the default op on the CPU
  (softmax, key norm, one head, float16/bfloat16/float32 sources with unit stride along D) when
  it could be built (and `merge_partial` without gradients).
* "cpu": the chunked torch kernel (`cpu_kernel.py`) for the same calls: the fallback without a
  C compiler (or with `ATTNRES_TORCH_CPU_C=0`) and for sources strided along D.
* "composite": the plain differentiable torch composition (`composite.py`): float64, heads,
  sigmoid, no key norm; also the comparison baseline.

`use_impl(name)` forces an implementation (tests; the Triton tests run it on CPU tensors under
TRITON_INTERPRET=1).  `last_impl()` / `impl_counts()` let tests prove which one ran.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections import Counter
from typing import Iterator, Optional

import torch

from . import cpu_c

IMPLS = ("triton", "cpu_c", "cpu", "composite")

_forced: list = []
_counts: Counter = Counter()
_last: list = [None]
_triton: list = []


def triton_kernels():
    """The Triton kernel module, or None when Triton (or the module) is unavailable."""
    if not _triton:
        module = None
        if importlib.util.find_spec("triton") is not None:
            try:
                module = importlib.import_module("attnres_torch.kernels.triton_depth")
            except ImportError:
                module = None
        _triton.append(module)
    return _triton[0]


@contextlib.contextmanager
def use_impl(name: str) -> Iterator[None]:
    """Force every op call inside the block to use implementation `name` (one of IMPLS)."""
    if name not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def forced() -> Optional[str]:
    return _forced[-1] if _forced else None


def record(name: str) -> str:
    """Note that `name` ran (skipped while torch.compile traces: it is a Python side effect)."""
    if not torch.compiler.is_compiling():
        _counts[name] += 1
        _last[0] = name
    return name


def last_impl() -> Optional[str]:
    return _last[0]


def impl_counts() -> Counter:
    """A copy of how many calls each implementation served."""
    return Counter(_counts)


def choose(tensors, *, default_op: bool, triton_supports, cpu_c_supports=None) -> str:
    """Pick the implementation for one call.

    tensors: every tensor argument; default_op: the call is softmax, key-normed, single head with
    float16/bfloat16/float32 sources; triton_supports / cpu_c_supports: no-argument callables
    asking that kernel whether it takes this call (cpu_c_supports None: the op has no C kernel).
    """
    name = forced()
    if name == "triton":
        if triton_kernels() is None:
            raise RuntimeError("impl: 'triton' was forced but attnres_torch.kernels.triton_depth "
                               "cannot be imported")
        if not triton_supports():
            raise ValueError("impl: 'triton' was forced but the Triton kernels do not support "
                             "this call (see kernels.triton_depth.supports)")
        return name
    if name in ("cpu", "cpu_c") and not default_op:
        raise ValueError(f"impl: {name!r} was forced but the CPU kernels cover only softmax, "
                         "key_norm, num_heads=1 and float16/bfloat16/float32 sources")
    if name == "cpu_c" and (cpu_c_supports is None or not cpu_c_supports()):
        raise ValueError("impl: 'cpu_c' was forced but the C kernel does not take this call "
                         f"(C kernel for this op: {cpu_c_supports is not None}; "
                         f"library: {cpu_c.unavailable_reason() or 'available'}; it needs CPU "
                         "sources with unit stride along D)")
    if name is not None:
        return name
    if all(t.is_cuda for t in tensors) and triton_kernels() is not None and triton_supports():
        return "triton"
    if default_op and all(t.device.type == "cpu" for t in tensors):
        return "cpu_c" if cpu_c_supports is not None and cpu_c_supports() else "cpu"
    return "composite"
