"""The float64 NumPy reference (`attnres_numpy`) as a `Backend` (registry name "numpy").

It lets the suite run end to end on NumPy alone, and the meta-tests subclass it to build
deliberately broken ports.  NumPy has no autodiff: `run_op` / `call_probe` use the reference's
own VJPs instead of `Adapter.vjp`.
"""

from __future__ import annotations

from typing import Any, Dict

import attnres_numpy
import numpy as np
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_numpy import model, ops

from ..backend import Capabilities, OpCall, ProbeCall, ProbeResult
from .base import Adapter, split_arguments

#: NumPy dtypes this adapter can build (int32 / float16 / float32 only for the error tests).
NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "int32": np.int32,
                "bool": np.bool_}
#: Keyword arguments of the VJPs (the forward's return_* flags are not among them).
VJP_ATTRS = ("eps", "scale", "num_heads", "activation", "key_norm", "out_norm_eps")
_VJPS = {"depth_attention": "depth_attention_vjp", "depth_attention_multi": "depth_attention_multi_vjp",
         "merge_partial": "merge_partial_vjp"}


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


def _round_like(grad, arg):
    """The float64 gradient rounded once to its argument's dtype (C10.3: a float32 query of
    float64 sources gets a float32 gradient); lists (list / tuple sources) element by element."""
    if grad is None or arg is None:
        return grad
    if isinstance(arg, (list, tuple)):
        return [_round_like(g, a) for g, a in zip(grad, arg)]
    return np.asarray(grad).astype(np.asarray(arg).dtype)


class NumpyAdapter(Adapter):
    """`attnres_numpy` behind the `Backend` protocol (float64 only: it is the oracle)."""

    name = "numpy"
    ops = ops

    def __init__(self):
        self._calls = 0

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float64",), variants=frozenset(VARIANT_KINDS), sublayer_dtype=True)

    def versions(self) -> Dict[str, str]:
        return {"numpy": np.__version__, "attnres_numpy": attnres_numpy.__version__}

    def implementations_used(self) -> Dict[str, int]:
        return {"reference": self._calls} if self._calls else {}

    def array(self, values, dtype, device, strided):
        return native(values, dtype, strided)

    def to_numpy(self, x) -> np.ndarray:
        return np.array(x, np.float64)

    def dtype_name(self, x) -> str:
        return np.asarray(x).dtype.name

    def shares_memory(self, result, argument) -> bool:
        # NumPy arrays are mutable and views are common: any overlap of their buffers counts.
        return np.may_share_memory(result, argument)

    def run_op(self, call: OpCall, args: Dict[str, Any], names):
        self._calls += 1
        attrs = dict(call.attrs)
        positional, keyword = split_arguments(call.op, args)
        result = getattr(ops, call.op)(*positional, **keyword, **attrs)
        outputs = dict(zip(names, result if isinstance(result, tuple) else (result,)))
        if call.cotangents is None:
            return outputs, {}
        cot = call.cotangents
        vjp_attrs = {k: v for k, v in attrs.items() if k in VJP_ATTRS}
        if cot.get("out_normed") is not None:  # C17
            vjp_attrs["d_out_normed"] = cot["out_normed"]
        grads = getattr(ops, _VJPS[call.op])(*positional, cot["out"], cot.get("lse"), **keyword, **vjp_attrs)
        return outputs, {name: _round_like(grads.get(name), args[name]) for name in args}

    def call_probe(self, call: ProbeCall) -> ProbeResult:
        self._calls += 1
        config = ResidualConfig.from_dict(call.config)
        kw = dict(schedule=call.schedule, mix=call.mix, scale=call.scale,
                  sublayer_dtype=getattr(call, "sublayer_dtype", None))  # M1a: v_l rounded to it
        out = model.probe_forward(config, call.params, call.embedding, call.sublayer_weights, **kw)
        grads = {}
        if call.cotangent is not None:
            grads = model.probe_vjp(config, call.params, call.embedding, call.sublayer_weights,
                                    call.cotangent, **kw)
        return ProbeResult(out, grads, out_dtype=call.dtype)  # the stream's dtype: the embedding's


backend = NumpyAdapter()
