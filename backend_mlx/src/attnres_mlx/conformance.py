"""The conformance adapter: `backend` implements `attnres_conformance.backend.Backend` for MLX.

It speaks NumPy at the boundary: float64 inputs (already rounded to the call's dtype) become
native MLX arrays of the requested dtypes (non-contiguous views, made by slicing a wider array,
when `strided`), the op and its VJP run through `mx.vjp`, and results come back as float32 (or
float64) NumPy arrays, together with every native input read back after the call.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np
from attnres_conformance.backend import (
    OPS,
    OPTIONS,
    SCHEDULES,
    Capabilities,
    OpCall,
    OpResult,
    ProbeCall,
    ProbeResult,
)
from attnres_numpy.config import VARIANT_KINDS, ResidualConfig

from . import metal, ops, probe
from .ops import dtype_name

_NATIVE = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
           "float64": mx.float64, "bool": mx.bool_}


def _native_dtype(name: str) -> mx.Dtype:
    if name in _NATIVE:
        return _NATIVE[name]
    dt = getattr(mx, name, None)
    if not isinstance(dt, mx.Dtype):
        raise ValueError(f"dtype: unknown dtype name {name!r}")
    return dt


def _native(a: np.ndarray, dtype: str) -> mx.array:
    # mx.array(float64 ndarray) would round to float32 first: build float64, then cast.
    return mx.array(a, dtype=mx.float64).astype(_native_dtype(dtype), stream=mx.cpu)


def _to_mx(a: np.ndarray, dtype: str, strided: bool) -> mx.array:
    """A native array of `dtype` holding `a`; a strided view of a twice-as-wide array if asked."""
    a = np.asarray(a, dtype=np.float64)
    if strided and a.ndim >= 1:
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],))
        wide[..., ::2] = a
        return _native(wide, dtype)[..., ::2]
    return _native(a, dtype)


def _to_np(a: mx.array) -> np.ndarray:
    if a.dtype == mx.float64:
        return np.array(a)
    return np.array(a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a)


class MLXBackend:
    """Adapter object (see module docstring)."""

    name = "mlx"

    def is_available(self) -> bool:
        return True

    def capabilities(self) -> Capabilities:
        # Where the Metal kernels are available (Metal, default device the GPU) the ops run
        # there; float64 exists on MLX's CPU device only (C10).
        on_metal = metal.IMPLEMENTATION.available()
        dtypes = ("float16", "bfloat16", "float32") + (() if on_metal else ("float64",))
        return Capabilities(
            dtypes=dtypes, devices=("gpu",) if on_metal else ("cpu",), ops=frozenset(OPS),
            options=frozenset(OPTIONS), variants=frozenset(VARIANT_KINDS),
            schedules=frozenset(SCHEDULES), fused_kernel=on_metal, deterministic=True)

    def versions(self) -> Dict[str, str]:
        from . import __version__
        return {"mlx": metadata.version("mlx"), "attnres_mlx": __version__}

    # -- ops -----------------------------------------------------------------------------------
    def _input(self, call: OpCall, name: str, value, index=None):
        override = call.input_dtypes.get(name, call.dtype)
        if isinstance(override, (list, tuple)):
            override = override[index]
        return _to_mx(value, override, call.strided)

    def call_op(self, call: OpCall) -> OpResult:
        names: List[str] = []  # flat order of the differentiable native inputs
        natives: List[mx.array] = []
        layout: Dict[str, Any] = {}
        for name, value in call.inputs.items():
            if value is None:
                layout[name] = None
            elif name == "sources" and isinstance(value, (list, tuple)):
                arrays = [self._input(call, name, v, i) for i, v in enumerate(value)]
                layout[name] = list(range(len(natives), len(natives) + len(arrays)))
                natives.extend(arrays)
            else:
                layout[name] = len(natives)
                natives.append(self._input(call, name, value))
            names.append(name)
        op = getattr(ops, call.op)
        attrs = dict(call.attrs)

        def unpack(flat):
            kw = {}
            for name in names:
                where = layout[name]
                kw[name] = None if where is None else (
                    [flat[i] for i in where] if isinstance(where, list) else flat[where])
            return kw

        def run(*flat):
            result = op(**unpack(flat), **attrs)
            return list(result) if isinstance(result, tuple) else [result]

        keys = ["out"]
        if call.op == "depth_attention_multi" or attrs.get("return_lse"):
            keys.append("lse")
        if attrs.get("return_weights"):
            keys.append("weights")
        outs = run(*natives)
        grads, native_dtypes = {}, {k: dtype_name(o.dtype) for k, o in zip(keys, outs)}
        if call.cotangents is not None:
            def cot(key, like):
                # Depth weights are not differentiable (C11): a zero cotangent.
                given = call.cotangents.get(key) if key != "weights" else None
                return mx.zeros_like(like) if given is None else _native(given, dtype_name(like.dtype))
            _, flat_grads = mx.vjp(run, natives, [cot(k, o) for k, o in zip(keys, outs)])
            for name, g in unpack(flat_grads).items():
                grads[name] = None if g is None else (
                    [_to_np(x) for x in g] if isinstance(g, list) else _to_np(g))
                native_dtypes[f"grad.{name}"] = None if g is None else (
                    [dtype_name(x.dtype) for x in g] if isinstance(g, list) else dtype_name(g.dtype))
        after = unpack(natives)
        # MLX arrays share no memory a caller could write through: `a[i] = v` rebinds `a` to a
        # new array and never changes another array.  Only returning an input object itself
        # would let a write into the result reach the argument (C7a), so that is what is checked.
        aliases = tuple(k for k, o in zip(keys, outs) if any(o is x for x in natives))
        return OpResult(
            native_dtypes=native_dtypes, aliases=aliases,
            outputs={k: _to_np(o) for k, o in zip(keys, outs)},
            grads=grads,
            inputs_after={k: None if v is None else ([_to_np(x) for x in v] if isinstance(v, list)
                                                     else _to_np(v)) for k, v in after.items()})

    # -- probe ---------------------------------------------------------------------------------
    def call_probe(self, call: ProbeCall) -> ProbeResult:
        config = ResidualConfig.from_dict(dict(call.config))
        dt = call.dtype
        params = {k: _to_mx(v, dt, False) for k, v in call.params.items()}
        emb = _to_mx(call.embedding, dt, False)
        w = _to_mx(call.sublayer_weights, dt, False)
        kw = dict(schedule=call.schedule, mix=call.mix, scale=call.scale)
        if call.cotangent is None:
            return ProbeResult(out=_to_np(probe.probe_forward(config, params, emb, w, **kw)))
        out = probe.probe_forward(config, params, emb, w, **kw)
        grads = probe.probe_vjp(config, params, emb, w, _to_mx(call.cotangent, dt, False), **kw)
        return ProbeResult(out=_to_np(out), grads={k: _to_np(g) for k, g in grads.items()})


backend = MLXBackend()
