"""The conformance adapter (`attnres_conformance.backend.Backend`) for JAX: `backend`.

Every call runs under `jax.jit` on the CPU device.  float64 calls (and float64/int64 dtype
overrides) run inside `jax.enable_x64(True)`, a thread-local context that also keys JAX's
compilation caches, so the adapter never changes the process-wide setting.

Strided inputs: JAX arrays have no strides (XLA owns layouts), so `strided=True` builds each
input of ndim >= 1 as a `[..., 2D]` array holding the values at even positions of the last axis
(NaN at odd positions) and takes `x[..., ::2]` inside the jitted call.  This checks that a
slicing producer feeds the op correctly; it cannot exercise non-contiguous memory.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Dict

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

DTYPES = ("float64", "float32", "float16", "bfloat16")


def _x64_needed(call) -> bool:
    names = [call.dtype]
    for value in getattr(call, "input_dtypes", {}).values():
        names.extend(value if isinstance(value, (list, tuple)) else [value])
    return any(n in ("float64", "int64") for n in names)


def _to_numpy(x) -> np.ndarray:
    """Read back in the compute dtype (C10): float64 stays float64, every other dtype reads back
    as float32 (bf16/fp16 exactly)."""
    from ._args import compute_dtype

    x = np.asarray(x)
    return x.astype(compute_dtype(x.dtype))


def _native(values, dtype: str, strided: bool):
    import jax.numpy as jnp

    a = np.asarray(values, dtype=np.float64).astype(jnp.dtype(dtype))
    if strided and a.ndim >= 1:
        padded = np.full(a.shape[:-1] + (2 * a.shape[-1],), np.nan, dtype=np.float64).astype(a.dtype)
        padded[..., ::2] = a
        a = padded
    return jnp.asarray(a)


def _view(x, strided: bool):
    return x[..., ::2] if strided and x is not None and x.ndim >= 1 else x


class JaxBackend:
    """Adapter of `attnres_jax` for the conformance suite (name "jax")."""

    name = "jax"

    def is_available(self) -> bool:
        try:
            import jax

            return bool(jax.devices("cpu"))
        except Exception:  # noqa: BLE001 - any import or backend failure means "not available"
            return False

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=DTYPES,
            devices=("cpu",),
            ops=frozenset(OPS),
            options=frozenset(OPTIONS),
            variants=frozenset(VARIANT_KINDS),
            schedules=frozenset(SCHEDULES),
            fused_kernel=False,
            deterministic=True,
        )

    def versions(self) -> Dict[str, str]:
        from . import __version__

        out = {"attnres_jax": __version__}
        for dist in ("jax", "jaxlib", "flax"):
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                out[dist] = "not installed"
        return out

    # -- ops -------------------------------------------------------------------------------
    def _inputs(self, call: OpCall) -> Dict[str, Any]:
        """Native arrays by argument name (sources keep their list/stacked form)."""
        native = {}
        for name, value in call.inputs.items():
            dtype = call.input_dtypes.get(name, call.dtype)
            if value is None:
                native[name] = None
            elif name == "sources" and isinstance(value, (list, tuple)):
                dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(value)
                native[name] = [_native(v, d, call.strided) for v, d in zip(value, dtypes)]
            else:
                native[name] = _native(value, dtype, call.strided)
        return native

    def call_op(self, call: OpCall) -> OpResult:
        import jax

        with jax.enable_x64(_x64_needed(call)):
            return self._call_op(call)

    def _call_op(self, call: OpCall) -> OpResult:
        import jax
        import jax.numpy as jnp

        from . import ops
        from ._args import compute_dtype

        if call.op not in OPS:
            raise ValueError(f"op: expected one of {OPS}, got {call.op!r}")
        native = self._inputs(call)
        attrs = dict(call.attrs)
        strided = call.strided

        def outputs(inputs):
            if call.op == "depth_attention":
                res = ops.depth_attention(inputs["sources"], inputs["query"], inputs["norm_weight"], **attrs)
                names = ["out"] + (["lse"] if attrs.get("return_lse") else []) + (
                    ["weights"] if attrs.get("return_weights") else [])
            elif call.op == "depth_attention_multi":
                res = ops.depth_attention_multi(inputs["sources"], inputs["queries"], inputs["norm_weights"],
                                                **attrs)
                names = ["out", "lse"]
            else:
                res = ops.merge_partial(inputs["out1"], inputs["lse1"], inputs["partial"], inputs["query"],
                                        inputs["norm_weight"], **attrs)
                names = ["out", "lse"] if attrs.get("return_lse") else ["out"]
            res = res if isinstance(res, tuple) else (res,)
            return dict(zip(names, res))

        def run(native_inputs, cotangents):
            inputs = jax.tree_util.tree_map(lambda x: _view(x, strided), native_inputs)
            if cotangents is None:
                return outputs(inputs), None
            outs, vjp = jax.vjp(outputs, inputs)
            cts = {k: (cotangents[k].astype(v.dtype) if k in cotangents else jnp.zeros_like(v))
                   for k, v in outs.items()}
            return outs, vjp(cts)[0]

        cotangents = None
        if call.cotangents is not None:
            cotangents = {k: jnp.asarray(np.asarray(v, dtype=np.float64).astype(compute_dtype(call.dtype)))
                          for k, v in call.cotangents.items() if v is not None}  # C10: in kappa
        outs, grads = jax.jit(run)(native, cotangents)
        # JAX arrays are immutable (no in-place writes exist), so no result can alias an input
        # in a way a caller could observe (C7a): `aliases` stays empty.
        result = OpResult(outputs={k: _to_numpy(v) for k, v in outs.items()},
                          native_dtypes={k: str(v.dtype) for k, v in outs.items()})
        if grads is not None:
            result.grads = {k: (None if v is None else [_to_numpy(a) for a in v] if isinstance(v, list)
                                else _to_numpy(v)) for k, v in grads.items()}
            result.native_dtypes.update({
                f"grad.{k}": (None if v is None else [str(a.dtype) for a in v] if isinstance(v, list)
                              else str(v.dtype)) for k, v in grads.items()})
        result.inputs_after = {
            k: (None if v is None else [_to_numpy(_view(a, strided)) for a in v] if isinstance(v, list)
                else _to_numpy(_view(v, strided))) for k, v in native.items()}
        return result

    # -- probe network ---------------------------------------------------------------------
    def call_probe(self, call: ProbeCall) -> ProbeResult:
        import jax

        with jax.enable_x64(call.dtype == "float64"):
            return self._call_probe(call)

    def _call_probe(self, call: ProbeCall) -> ProbeResult:
        import jax

        from .router import probe_forward

        config = ResidualConfig.from_dict(call.config)
        params = {k: _native(v, call.dtype, False) for k, v in call.params.items()}
        emb = _native(call.embedding, call.dtype, False)
        w = _native(call.sublayer_weights, call.dtype, False)

        def forward(emb, w, params):
            return probe_forward(config, params, emb, w, schedule=call.schedule, mix=call.mix,
                                 scale=call.scale)

        if call.cotangent is None:
            return ProbeResult(out=_to_numpy(jax.jit(forward)(emb, w, params)))

        def with_grads(emb, w, params, cot):
            out, vjp = jax.vjp(forward, emb, w, params)
            return out, vjp(cot.astype(out.dtype))

        cot = _native(call.cotangent, call.dtype, False)
        out, (d_emb, d_w, d_params) = jax.jit(with_grads)(emb, w, params, cot)
        grads = {"embedding": _to_numpy(d_emb), "sublayer_weights": _to_numpy(d_w)}
        grads.update({k: _to_numpy(v) for k, v in d_params.items()})
        return ProbeResult(out=_to_numpy(out), grads=grads)


backend = JaxBackend()
