"""The float64 NumPy reference itself as a `Backend` (registry name "numpy").

It lets the suite run end to end on NumPy alone, and it is what the meta-tests wrap to build
deliberately broken adapters.  It is also the smallest complete adapter: a port's adapter has
the same shape (build native arrays, call the op and its VJP, read inputs back).
"""

from __future__ import annotations

from typing import Any, Dict

import attnres_numpy
import numpy as np
from attnres_numpy import model, ops
from attnres_numpy.config import VARIANT_KINDS, ResidualConfig

from .backend import Capabilities, OpCall, OpResult, ProbeCall, ProbeResult

#: NumPy dtypes this adapter can build (int32 / float16 / float32 only for the error tests).
NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "int32": np.int32,
                "bool": np.bool_}
#: Keyword arguments of the VJPs (the forward's return_* flags are not among them).
VJP_ATTRS = ("eps", "scale", "num_heads", "activation", "key_norm")


def native(value, dtype: str, strided: bool = False) -> np.ndarray:
    """A NumPy array of `dtype` holding `value`; a non-contiguous view of it when `strided`
    (every other element of a buffer twice as wide in the last axis)."""
    if dtype not in NUMPY_DTYPES:
        raise TypeError(f"the NumPy reference cannot build {dtype} arrays")
    a = np.asarray(value, dtype=NUMPY_DTYPES[dtype])
    if not strided or a.ndim == 0:
        return a.copy()
    buf = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype)
    view = buf[..., ::2]
    view[...] = a
    return view


def _native_inputs(call: OpCall) -> Dict[str, Any]:
    inputs = {}
    for name, value in call.inputs.items():
        dtype = call.input_dtypes.get(name, call.dtype)
        if value is None:
            inputs[name] = None
        elif isinstance(value, (list, tuple)):
            dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(value)
            inputs[name] = [native(v, d, call.strided) for v, d in zip(value, dtypes)]
        else:
            inputs[name] = native(value, dtype, call.strided)
    return inputs


def _read_back(inputs: Dict[str, Any]) -> Dict[str, Any]:
    return {k: None if v is None else ([np.array(s, np.float64) for s in v] if isinstance(v, list)
                                       else np.array(v, np.float64))
            for k, v in inputs.items()}


def _flat(outputs: Dict[str, Any], grads: Dict[str, Any]):
    """(name, array) of every result: outputs by name, gradients as "grad.<input>"."""
    pairs = list(outputs.items())
    for k, v in grads.items():
        if v is not None:
            pairs.extend((f"grad.{k}", g) for g in (v if isinstance(v, list) else [v]))
    return pairs


def _native_dtypes(outputs: Dict[str, Any], grads: Dict[str, Any]) -> Dict[str, Any]:
    dtypes = {k: np.asarray(v).dtype.name for k, v in outputs.items()}
    dtypes.update({f"grad.{k}": None if v is None else ([np.asarray(g).dtype.name for g in v]
                                                        if isinstance(v, list) else np.asarray(v).dtype.name)
                   for k, v in grads.items()})
    return dtypes


def _aliases(outputs: Dict[str, Any], grads: Dict[str, Any], inputs: Dict[str, Any]) -> tuple:
    """Names of the results whose memory may overlap a native input's (C7a; NumPy arrays are
    mutable, so a view of an input would be a real alias)."""
    natives = [a for v in inputs.values() if v is not None for a in (v if isinstance(v, list) else [v])]
    names = []
    for name, value in _flat(outputs, grads):
        if name not in names and any(np.may_share_memory(value, a) for a in natives):
            names.append(name)
    return tuple(names)


class ReferenceBackend:
    """`attnres_numpy` behind the `Backend` protocol (float64 only: it is the oracle)."""

    name = "numpy"

    def is_available(self) -> bool:
        return True

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float64",), variants=frozenset(VARIANT_KINDS))

    def versions(self) -> Dict[str, str]:
        return {"numpy": np.__version__, "attnres_numpy": attnres_numpy.__version__}

    def call_op(self, call: OpCall) -> OpResult:
        x = _native_inputs(call)
        attrs, cot = dict(call.attrs), call.cotangents
        vjp_attrs = {k: v for k, v in attrs.items() if k in VJP_ATTRS}
        grads: Dict[str, Any] = {}
        if call.op == "depth_attention":
            result = ops.depth_attention(x["sources"], x["query"], x["norm_weight"], **attrs)
            out, *extra = result if isinstance(result, tuple) else (result,)
            outputs = {"out": out}
            if attrs.get("return_lse"):
                outputs["lse"] = extra.pop(0)
            if attrs.get("return_weights"):
                outputs["weights"] = extra.pop(0)
            if cot is not None:
                grads = ops.depth_attention_vjp(x["sources"], x["query"], x["norm_weight"], cot["out"],
                                                cot.get("lse"), **vjp_attrs)
        elif call.op == "depth_attention_multi":
            out, lse = ops.depth_attention_multi(x["sources"], x["queries"], x["norm_weights"], **attrs)
            outputs = {"out": out, "lse": lse}
            if cot is not None:
                grads = ops.depth_attention_multi_vjp(x["sources"], x["queries"], x["norm_weights"],
                                                      cot["out"], cot.get("lse"), **vjp_attrs)
        elif call.op == "merge_partial":
            args = [x[k] for k in ("out1", "lse1", "partial", "query", "norm_weight")]
            result = ops.merge_partial(*args, **attrs)
            outputs = dict(zip(("out", "lse"), result)) if attrs.get("return_lse") else {"out": result}
            if cot is not None:
                grads = ops.merge_partial_vjp(*args, cot["out"], cot.get("lse"), **vjp_attrs)
        else:
            raise ValueError(f"op: unknown op {call.op!r}")
        return OpResult(outputs, grads, _read_back(x), native_dtypes=_native_dtypes(outputs, grads),
                        aliases=_aliases(outputs, grads, x))

    def call_probe(self, call: ProbeCall) -> ProbeResult:
        config = ResidualConfig.from_dict(call.config)
        out = model.probe_forward(config, call.params, call.embedding, call.sublayer_weights,
                                  schedule=call.schedule, mix=call.mix, scale=call.scale)
        grads = {}
        if call.cotangent is not None:
            grads = model.probe_vjp(config, call.params, call.embedding, call.sublayer_weights,
                                    call.cotangent, schedule=call.schedule, mix=call.mix, scale=call.scale)
        return ProbeResult(out, grads)


backend = ReferenceBackend()
