"""`JaxAdapter`: JAX's primitives for `base.Adapter`, with no import of any AttnRes port.

Subclass it for any JAX port (ours is `attnres_conformance.ports.attnres_jax`): declare
`capabilities()`, and set `ops` or define `depth_attention` (etc.) on the subclass, taking the
spec's arguments (see `adapters.torch` for an example).  Calls run on JAX's default device.
float64 calls (and float64/int64 overrides) run inside
`jax.enable_x64(True)`, a thread-local context, so the process-wide setting never changes.

Strided inputs: JAX arrays have no strides (XLA owns layouts), so `strided=True` builds a
`[..., 2D]` array (NaN at odd positions) and passes its `[..., ::2]` slice: this checks that a
slicing producer feeds the op correctly; it cannot exercise non-contiguous memory.

Speed: every distinct call structure compiles once under `jax.jit`, cached by the structure
(see `_compiled`), with XLA's fast-compile options (`FAST_COMPILE`), since the suite's cases
rarely share one; a gradient call is one executable (`value_and_grads`), and a gradient case
makes one call (`forward_in_gradient_call`).  JAX's persistent compilation cache applies to these
compiles when it is configured (JAX's own variables: JAX_COMPILATION_CACHE_DIR, with
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 and JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1,
since the suite's compiles are small and short; `nox -s conformance` sets them): a second run
then loads its executables instead of compiling them, about half its CPU time (tracing and
lowering still run: the cache is keyed by the lowered program).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from importlib import metadata
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from .base import Adapter

DTYPES = ("float64", "float32", "float16", "bfloat16")
#: Compiled functions kept (least recently used dropped): the suite's cases rarely share a
#: structure except in the repeated calls of one case (determinism), and an unbounded cache holds
#: every executable of a ~1000-case run (XLA ran out of memory on the 2-core CI machine).
CACHE_SIZE = 16
#: XLA options for the suite's compiles: XLA:CPU's fast-compile settings (LLVM -O0, the loop
#: emitters, one codegen module).  A case compiles once and runs on inputs of a few KB, so
#: compile time is nearly all of the run: these cut it ~3x (1.2 s -> 0.35 s of CPU for the
#: gradient program of N = 9 sources).  The program XLA optimizes is the library's, and the
#: HLO passes run; the machine code differs in rounding only (no FMA contraction at -O0), far
#: inside every tolerance.  backend_jax's tests of the op's rounding (marked
#: `xla_default_compile`) run the default compile against the float64 reference; nox's tests-jax
#: gives its other tests these options too (noxfile.py's JAX_FAST_COMPILE, the same three).
#: ATTNRES_CONFORMANCE_JAX_COMPILE=default uses XLA's defaults here too.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                "xla_cpu_parallel_codegen_split_count": 1}
COMPILE_MODES = {"fast": FAST_COMPILE, "default": None}


def compiler_options():
    """The XLA options of `ATTNRES_CONFORMANCE_JAX_COMPILE` ("fast", the default, or "default")."""
    mode = os.environ.get("ATTNRES_CONFORMANCE_JAX_COMPILE", "fast")
    if mode not in COMPILE_MODES:
        raise ValueError(f"ATTNRES_CONFORMANCE_JAX_COMPILE: expected one of {sorted(COMPILE_MODES)}, got {mode!r}")
    return COMPILE_MODES[mode]


def _x64_needed(call) -> bool:
    names = [call.dtype, getattr(call, "sublayer_dtype", None)]  # a probe's float64 sublayers (M1a)
    for value in getattr(call, "input_dtypes", {}).values():
        names.extend(value if isinstance(value, (list, tuple)) else [value])
    return any(n in ("float64", "int64") for n in names)


class JaxAdapter(Adapter):
    name = "jax-port"

    def __init__(self):
        self._counts: Dict[str, int] = {}
        self._cache: "OrderedDict[tuple, object]" = OrderedDict()
        self._impl: Dict[object, str] = {}  # full key -> "pallas" / "xla"
        self._options = compiler_options()
        self._shapes: Dict[tuple, list] = {}  # the forward's output shapes by (key, leaves, x64)

    def is_available(self) -> bool:
        try:
            return bool(jax.devices("cpu"))
        except Exception:  # noqa: BLE001 - any backend failure means "not available"
            return False

    def versions(self) -> Dict[str, str]:
        out = {}
        for dist in ("jax", "jaxlib"):
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                out[dist] = "not installed"
        return out

    def context(self, call):
        return jax.enable_x64(_x64_needed(call))

    def array(self, values, dtype, device, strided):
        # jax.device_put, not jnp.asarray: JAX 0.10's asarray of a NumPy array compiles a program
        # for each shape and dtype ("jit_stage": 126 of the 214 programs of 1/16 of the report);
        # device_put copies it to the default device without one.
        a = np.asarray(values).astype(jnp.dtype(dtype))
        if strided and a.ndim >= 1:
            padded = np.full(a.shape[:-1] + (2 * a.shape[-1],), np.nan, dtype=np.float64).astype(a.dtype)
            padded[..., ::2] = a
            return jax.device_put(padded)[..., ::2]
        return jax.device_put(a)

    def broadcast_to(self, x, shape):
        return jnp.broadcast_to(x, shape)

    def cast(self, x, dtype: str):
        return x.astype(jnp.dtype(dtype))

    def to_numpy(self, x) -> np.ndarray:
        # Read back in the compute dtype (C10): float64 stays, bf16/fp16 widen exactly to float32.
        x = np.asarray(x)
        return x.astype(np.float64 if x.dtype == np.float64 else np.float32)

    def dtype_name(self, x) -> str:
        return str(x.dtype)

    def shares_memory(self, result, argument) -> bool:
        # JAX arrays are immutable (no in-place writes exist): no result can alias an argument in
        # a way a caller could observe (C7a).
        return False

    def _count(self, full, run):
        """run() (a port that reports which implementation served a call overrides this)."""
        return run()

    def _compiled(self, kind, fn, leaves, key, make):
        """(full key, the jitted `make(fn)`): built once per (key, leaf shapes/dtypes, x64)."""
        if key is None:
            return None, jax.jit(make(fn), compiler_options=self._options)
        full = (kind, key, tuple((x.shape, str(x.dtype)) for x in leaves), jax.config.jax_enable_x64)
        if full in self._cache:
            self._cache.move_to_end(full)
        else:
            self._cache[full] = jax.jit(make(fn), compiler_options=self._options)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return full, self._cache[full]

    def forward(self, fn, leaves, key=None):
        full, run = self._compiled("forward", fn, leaves, key, lambda f: f)
        outs = self._count(full, lambda: run(*leaves))
        if full is not None:  # the gradient call of the same case needs no trace for these
            self._shapes[full[1:]] = [jax.ShapeDtypeStruct(y.shape, y.dtype) for y in outs]
            while len(self._shapes) > CACHE_SIZE:
                self._shapes.pop(next(iter(self._shapes)))
        return outs

    def value_and_grads(self, fn, leaves, cotangents, key=None):
        # One executable per structure: the outputs' abstract shapes (from the case's forward
        # call, else a trace: no compile) give the cotangents' dtypes, then the forward and the pullback compile as one program (a
        # separate pullback executable doubled the compile time of every gradient case).
        sig = None if key is None else (key, tuple((x.shape, str(x.dtype)) for x in leaves),
                                         jax.config.jax_enable_x64)
        shapes = self._shapes.get(sig) or jax.eval_shape(fn, *leaves)
        cts = tuple(cotangents(list(shapes)))
        mask = tuple(c is None for c in cts)

        def make(f):
            def value_and_grads(xs, given):
                outs, pull = jax.vjp(f, *xs)
                it = iter(given)
                full_cts = tuple(jnp.zeros_like(y) if none else next(it) for y, none in zip(outs, mask))
                return outs, pull(full_cts)
            return value_and_grads

        full, run = self._compiled("vjp", fn, leaves, (key, mask) if key is not None else None, make)
        outs, grads = self._count(full, lambda: run(tuple(leaves), tuple(c for c in cts if c is not None)))
        return outs, list(grads)

