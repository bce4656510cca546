"""The CPU allocator setting of training/inference loops: keep freed large blocks in the process
(opt-in, glibc only).

PyTorch's CPU allocator takes its buffers from the C library's `malloc`.  glibc serves a block
of 32 MiB or more (one fp32 `[8192, 1024]` gradient) with a fresh `mmap` and gives it back with
`munmap` when the tensor dies, so every step of a loop pays the page faults of first touching
every fresh output and gradient again (docs/benchmarks.md has the cost measured).  Smaller blocks are already reused: glibc raises its mmap threshold to the size of a freed
block up to 32 MiB, which is why bf16 (16 MiB blocks) pays far less.

`keep_large_blocks()` tells glibc (through `mallopt`) to serve every block from its heap
(`M_MMAP_MAX = 0`) and not to return the heap's free top to the system below 2 GiB
(`M_TRIM_THRESHOLD = 2**31 - 1`, mallopt's largest): a freed gradient's pages stay mapped, and the next
step's gradients reuse them without faults.  The cost: the process keeps its peak heap resident
(memory freed by any library is reused by this process, never returned to the OS) and large
blocks share the heap with small ones (fragmentation).  It is process-wide, never done at
import, and only on glibc (`keep_large_blocks` returns False elsewhere: musl, macOS, Windows,
or a process whose malloc is replaced, e.g. jemalloc through LD_PRELOAD, where mallopt is
glibc's but unused).  Threads other than the main one allocate from per-thread arenas whose
heaps are 64 MiB at most; glibc still maps their larger blocks with `mmap`.  The autograd engine
runs CPU backward functions on the thread that called `backward()`/`autograd.grad`, so a
single-threaded training loop is covered.

`keep_large_blocks(False)` restores glibc's default values (mmap for blocks >= 128 KiB, trim
above 128 KiB) for later frees and allocations, but not glibc's dynamic threshold, which any
`mallopt` of these parameters switches off for the rest of the process; memory already in the
heap stays there until the heap's top is free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional

__all__ = ["keep_large_blocks", "large_blocks_kept"]

# glibc <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_MMAP_MAX, _DEFAULT_THRESHOLD = 65536, 128 * 1024
_INT_MAX = 2**31 - 1

_state = {"kept": False}


def _glibc() -> Optional[ctypes.CDLL]:
    """The process's glibc (None on any other C library)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    if not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_large_blocks(on: bool = True) -> bool:
    """Keep freed large blocks in this process's heap so that fresh outputs and gradients reuse
    already-faulted pages (on=True), or restore glibc's default mmap/trim values (on=False).

    Process-wide and opt-in; see the module docstring for what it costs.  Returns True when
    glibc accepted the setting, False when this is not glibc (nothing changed).
    """
    if not isinstance(on, bool):
        raise TypeError(f"on: expected a bool, got {type(on).__name__}")
    libc = _glibc()
    if libc is None:
        return False
    if on:
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    else:
        ok = (libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX) == 1
              and libc.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD) == 1)
    if ok:
        _state["kept"] = on
    return ok


def large_blocks_kept() -> bool:
    """Whether `keep_large_blocks(True)` is in effect (set through this module)."""
    return _state["kept"]
