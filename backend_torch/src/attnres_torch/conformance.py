"""Conformance adapter: `attnres_conformance.backend.Backend` for attnres_torch (name "torch").

It speaks NumPy at the boundary: builds torch tensors of the requested dtype on the requested
device (non-contiguous views, slices of a wider tensor, when `strided`), runs the op or the
probe network through `DepthRouter`, and returns float32/float64 NumPy arrays plus the native
inputs read back after the call.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Dict, List

import numpy as np
import torch
import torch.nn.functional as F
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

from . import cpu_c, dispatch, ops
from .modules import DepthRouter

_OPS = {"depth_attention": ops.depth_attention, "depth_attention_multi": ops.depth_attention_multi,
        "merge_partial": ops.merge_partial}
_ARG_ORDER = {"depth_attention": ("sources", "query", "norm_weight"),
              "depth_attention_multi": ("sources", "queries", "norm_weights"),
              "merge_partial": ("out1", "lse1", "partial", "query", "norm_weight")}


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: unknown torch dtype name {name!r}")
    return dtype


def _tensor(a: np.ndarray, dtype: torch.dtype, device: str, strided: bool, grad: bool) -> torch.Tensor:
    """A native tensor holding `a`; with `strided`, every other element of a wider last axis."""
    base = torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
    if strided and base.dim() >= 1:
        wide = torch.zeros(base.shape[:-1] + (2 * base.shape[-1],), dtype=dtype, device=device)
        wide[..., ::2] = base
        base = wide[..., ::2]
    base = base.detach()
    return base.requires_grad_(True) if grad and (dtype.is_floating_point) else base


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32).numpy()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _span(t: torch.Tensor):
    """(device, first byte, end byte) of the storage behind `t`."""
    storage = t.untyped_storage()
    return t.device, storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _aliases(named: List[tuple], native: Dict[str, Any]) -> tuple:
    """Names of the (name, tensor) results whose storage overlaps any native input's (C7a)."""
    spans = [_span(t) for v in native.values() if v is not None
             for t in (v if isinstance(v, list) else [v])]
    out = []
    for name, t in named:
        dev, lo, hi = _span(t)
        if name not in out and any(d == dev and lo < h and l < hi for d, l, h in spans):
            out.append(name)
    return tuple(out)


def _as_numpy(value):
    if value is None:
        return None
    if isinstance(value, list):
        return [_numpy(t) for t in value]
    return _numpy(value)


class TorchBackend:
    """The attnres_torch adapter (ops dispatched exactly as users get them)."""

    name = "torch"

    def is_available(self) -> bool:
        return True

    def devices(self) -> tuple:
        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=("float64", "float32", "float16", "bfloat16"),
            devices=self.devices(),
            ops=frozenset(OPS),
            options=frozenset(OPTIONS),
            variants=frozenset(VARIANT_KINDS),
            schedules=frozenset(SCHEDULES),
            # A fused kernel serves the default op on a declared device: the C kernel on the CPU
            # (unless it could not be built or ATTNRES_TORCH_CPU_C=0: then the chunked torch
            # kernel, not fused), the Triton kernels on CUDA.
            fused_kernel=cpu_c.available() or (torch.cuda.is_available()
                                               and dispatch.triton_kernels() is not None),
            deterministic=True,
        )

    def versions(self) -> Dict[str, str]:
        out = {"torch": torch.__version__}
        for dist in ("attnres-torch", "triton"):
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
        return out

    # -- ops -----------------------------------------------------------------------------------
    def _inputs(self, call: OpCall, grad: bool) -> Dict[str, Any]:
        native = {}
        for name in _ARG_ORDER[call.op]:
            value = call.inputs.get(name)
            if value is None:
                native[name] = None
                continue
            override = call.input_dtypes.get(name, call.dtype)
            if isinstance(value, (list, tuple)):
                names = override if isinstance(override, (list, tuple)) else [override] * len(value)
                native[name] = [_tensor(np.asarray(v), _torch_dtype(d), call.device, call.strided, grad)
                                for v, d in zip(value, names)]
            else:
                native[name] = _tensor(np.asarray(value), _torch_dtype(override), call.device,
                                       call.strided, grad)
        return native

    def call_op(self, call: OpCall) -> OpResult:
        if call.op not in _OPS:
            raise ValueError(f"op: expected one of {OPS}, got {call.op!r}")
        grad = call.cotangents is not None
        native = self._inputs(call, grad)
        args = [native[n] for n in _ARG_ORDER[call.op]]
        attrs = dict(call.attrs)
        with torch.enable_grad():
            result = _OPS[call.op](*args, **attrs)
        outputs = self._outputs(call, result)
        native_grads = self._grads(call, native, outputs) if grad else {}
        fresh = list(outputs.items()) + [(f"grad.{k}", g) for k, v in native_grads.items()
                                         if v is not None for g in (v if isinstance(v, list) else [v])]
        dtypes = {k: _dtype_name(v) for k, v in outputs.items()}
        dtypes.update({f"grad.{k}": (None if v is None else [_dtype_name(g) for g in v]
                                     if isinstance(v, list) else _dtype_name(v))
                       for k, v in native_grads.items()})
        grads = {k: None if v is None else ([_numpy(g) for g in v] if isinstance(v, list) else _numpy(v))
                 for k, v in native_grads.items()}
        return OpResult(outputs={k: _numpy(v) for k, v in outputs.items()}, grads=grads,
                        inputs_after={k: _as_numpy(v) for k, v in native.items()},
                        native_dtypes=dtypes, aliases=_aliases(fresh, native))

    @staticmethod
    def _outputs(call: OpCall, result) -> Dict[str, torch.Tensor]:
        if call.op == "depth_attention_multi":
            return {"out": result[0], "lse": result[1]}
        names = ["out"]
        if call.attrs.get("return_lse"):
            names.append("lse")
        if call.attrs.get("return_weights"):
            names.append("weights")
        result = result if isinstance(result, tuple) else (result,)
        return dict(zip(names, result))

    @staticmethod
    def _grads(call: OpCall, native: Dict[str, Any], outputs: Dict[str, torch.Tensor]):
        """Native gradients by input name (a list for list sources; None for a None input)."""
        ys, cts = [], []
        for key, ct in call.cotangents.items():
            if ct is not None and key in outputs:
                y = outputs[key]
                ys.append(y)
                cts.append(torch.from_numpy(np.asarray(ct)).to(device=y.device, dtype=y.dtype))
        leaves: List[torch.Tensor] = []
        for value in native.values():
            if isinstance(value, list):
                leaves.extend(value)
            elif value is not None:
                leaves.append(value)
        got = iter(torch.autograd.grad(ys, leaves, cts, allow_unused=True))

        def take(t):
            g = next(got)  # an unused input has a zero gradient
            return torch.zeros_like(t).detach() if g is None else g

        grads = {}
        for name, value in native.items():
            if value is None:
                grads[name] = None
            elif isinstance(value, list):
                grads[name] = [take(t) for t in value]
            else:
                grads[name] = take(value)
        return grads

    # -- probe ---------------------------------------------------------------------------------
    def call_probe(self, call: ProbeCall) -> ProbeResult:
        config = ResidualConfig.from_dict(call.config)
        dtype, device = _torch_dtype(call.dtype), call.device
        weights = np.asarray(call.sublayer_weights)
        embedding = np.asarray(call.embedding)
        num_layers, dim = weights.shape[0], embedding.shape[-1]
        router = DepthRouter(config, num_layers, dim, schedule=call.schedule).to(device=device, dtype=dtype)
        router.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in call.params.items()})
        grad = call.cotangent is not None
        emb = _tensor(embedding, dtype, device, False, grad)
        w = _tensor(weights, dtype, device, False, grad)
        sublayers = [lambda h, l=l: torch.tanh(F.rms_norm(h, (dim,), eps=config.eps) @ w[l])
                     for l in range(num_layers)]
        with torch.enable_grad():
            out = router(emb, sublayers, mix=call.mix, scale=call.scale)
        if not grad:
            return ProbeResult(out=_numpy(out))
        names = list(router.state_dict().keys())
        params = [getattr(router, n) for n in names]
        ct = torch.from_numpy(np.asarray(call.cotangent)).to(device=device, dtype=out.dtype)
        grads = torch.autograd.grad([out], [emb, w, *params], [ct], allow_unused=True)
        result = {}
        for name, t, g in zip(["embedding", "sublayer_weights", *names], [emb, w, *params], grads):
            result[name] = np.zeros(t.shape) if g is None else _numpy(g)
        return ProbeResult(out=_numpy(out), grads=result)


backend = TorchBackend()
