"""`MLXAdapter`: MLX's primitives for `base.Adapter`, with no import of any AttnRes port.

Subclass it for any MLX port (ours is `attnres_conformance.ports.attnres_mlx`): declare
`capabilities()`, and set `ops` or define `depth_attention` (etc.) on the subclass, taking the
spec's arguments (see `adapters.torch` for an example).  Native arrays are built on MLX's CPU
stream from float64 (so values are not rounded to float32 on the way); gradients come from
`mx.vjp`.

In a child of a parallel run (`--jobs`), MLX compiles its CPU kernels into a directory of that
child's own (`separate_kernel_directory`).
"""

from __future__ import annotations

import os
import tempfile
from importlib import metadata
from typing import Dict

import mlx.core as mx
import numpy as np

from ..parallel import CHILD_ENV
from .base import Adapter


def kernel_directory(name: str) -> str:
    """Point TMPDIR at `<tmp>/<name>` (made if missing) and return it: MLX's CPU backend compiles
    each fused kernel with g++ into $TMPDIR/mlx/<version>/cpu and loads whatever library it finds
    there, with no lock between processes, so two processes compiling one kernel at once (a cold
    directory) could load a half-written library.  Call it before any MLX kernel compiles."""
    path = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(path, exist_ok=True)
    os.environ["TMPDIR"] = path
    return path


def separate_kernel_directory() -> None:
    """In a child of a parallel run, compile into `<tmp>/attnres-conformance-mlx-<run>`
    (`kernel_directory`): each run of a job keeps its own directory, under the same name in the
    next run of that job, so reruns find their kernels compiled.  Called when this module is
    imported."""
    run = os.environ.get(CHILD_ENV)
    if run is not None and run.isdigit():
        kernel_directory(f"attnres-conformance-mlx-{run}")


separate_kernel_directory()

_NATIVE = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
           "float64": mx.float64, "bool": mx.bool_}


def native_dtype(name: str) -> mx.Dtype:
    if name in _NATIVE:
        return _NATIVE[name]
    dt = getattr(mx, name, None)
    if not isinstance(dt, mx.Dtype):
        raise ValueError(f"dtype: unknown dtype name {name!r}")
    return dt


def dtype_name(dtype: mx.Dtype) -> str:
    """"float32" for mx.float32 (MLX prints "mlx.core.float32")."""
    return str(dtype).rsplit(".", 1)[-1]


def _native(a: np.ndarray, dtype: str) -> mx.array:
    # mx.array(float64 ndarray) would round to float32 first: build float64, then cast.
    return mx.array(a, dtype=mx.float64).astype(native_dtype(dtype), stream=mx.cpu)


class MLXAdapter(Adapter):
    name = "mlx-port"

    def versions(self) -> Dict[str, str]:
        return {"mlx": metadata.version("mlx")}

    def shard_group(self, dtype: str) -> str:
        """The cases `--shards` keeps in one process (`runner.shard_positions`): those of one
        compute dtype (C10).  MLX's CPU backend compiles each fused kernel with a C++ compiler,
        once per process directory, and the float16/bfloat16/float32 cases share most of theirs
        (float32 arithmetic): split case by case, two processes compiled 436 kernels for 284
        distinct ones (1454 cases)."""
        return "float64" if dtype == "float64" else "float32"

    def array(self, values, dtype, device, strided):
        a = np.asarray(values, dtype=np.float64)
        if strided and a.ndim >= 1:
            wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],))
            wide[..., ::2] = a
            return _native(wide, dtype)[..., ::2]
        return _native(a, dtype)

    def broadcast_to(self, x, shape):
        return mx.broadcast_to(x, shape)

    def cast(self, x, dtype: str):
        return x.astype(native_dtype(dtype))

    def to_numpy(self, x) -> np.ndarray:
        if x.dtype == mx.float64:
            return np.array(x)
        return np.array(x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x)

    def dtype_name(self, x) -> str:
        return dtype_name(x.dtype)

    # MLX arrays share no memory a caller could write through: `a[i] = v` rebinds `a` to a new
    # array and never changes another array; only returning an argument object itself would let
    # a write into the result reach the argument (C7a): the default identity check.

    def vjp(self, fn, leaves, key=None):
        outs = fn(*leaves)

        def pullback(cts):
            cts = [mx.zeros_like(y) if c is None else c for y, c in zip(outs, cts)]
            _, grads = mx.vjp(lambda *xs: list(fn(*xs)), list(leaves), cts)
            return list(grads)

        return outs, pullback
