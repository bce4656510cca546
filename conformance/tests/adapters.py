"""Adapters for the meta-tests, all built by wrapping the NumPy reference backend.

`rounding(inner)` is an honest low-precision port (float64 math, one final cast per output,
C10), so the suite's fp32/fp16/bf16 paths can be checked on NumPy alone.  The `Broken*`
classes each carry one deliberate bug the suite must report in the right matrix cell.
Importable as a module (the CLI and reproducer tests load them as `adapters:NAME`).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
from attnres_conformance.numerics import DTYPES, round_to
from attnres_conformance.reference_backend import ReferenceBackend
from attnres_numpy import ops
from attnres_numpy.config import VARIANT_KINDS
from attnres_numpy.tape import Tape


class Rounding:
    """Runs `inner` in float64 on the exact inputs and rounds every result once: outputs and
    gradients to their dtype, lse / weights / d_lse1 to the compute dtype."""

    def __init__(self, inner, name="rounding"):
        self.inner, self.name = inner, name

    def is_available(self):
        return True

    def capabilities(self):
        return dataclasses.replace(self.inner.capabilities(), dtypes=DTYPES)

    def versions(self):
        return self.inner.versions()

    @staticmethod
    def _upcast(name, dtype, case_dtype):
        # The case dtype (and lse1's compute dtype) runs in float64; a *different* dtype given
        # for an error test (mixed dtypes, int32) keeps its identity so the checks still fire.
        if isinstance(dtype, (list, tuple)):
            return [Rounding._upcast(name, d, case_dtype) for d in dtype]
        return "float64" if dtype == case_dtype or name == "lse1" else dtype

    def call_op(self, call):
        dt = call.dtype
        compute = "float64" if dt == "float64" else "float32"
        inner = dataclasses.replace(call, dtype="float64",
                                    input_dtypes={k: self._upcast(k, v, dt) for k, v in call.input_dtypes.items()})
        r = self.inner.call_op(inner)
        r.outputs = {k: round_to(v, compute if k in ("lse", "weights") else dt) for k, v in r.outputs.items()}
        r.grads = {k: None if v is None else [round_to(x, dt) for x in v] if isinstance(v, list)
                   else round_to(v, compute if k == "lse1" else dt) for k, v in r.grads.items()}
        r.inputs_after = {k: None if v is None else [round_to(x, dt) for x in v] if isinstance(v, list)
                          else round_to(v, compute if k == "lse1" else dt) for k, v in r.inputs_after.items()}
        return r

    def call_probe(self, call):
        r = self.inner.call_probe(dataclasses.replace(call, dtype="float64"))
        r.out = round_to(r.out, call.dtype)
        r.grads = {k: round_to(v, call.dtype) for k, v in r.grads.items()}
        return r


class BrokenEps(ReferenceBackend):
    """eps added to the rms instead of the mean square: r = 1 / (sqrt(mean(x^2)) + eps)."""

    name = "broken_eps"

    @staticmethod
    def _stats(x, q, g, *, eps, scale, num_heads, key_norm):
        r, qg, s, z = _REAL_STATS(x, q, g, eps=eps, scale=scale, num_heads=num_heads, key_norm=key_norm)
        if key_norm:
            r = 1.0 / (np.sqrt(np.mean(x * x, axis=-1)) + eps)
            z = scale * r * s
        return r, qg, s, z

    def call_op(self, call):
        with mock.patch.object(ops, "_stats", self._stats):
            return super().call_op(call)


_REAL_STATS = ops._stats


class BrokenLogitScale(ReferenceBackend):
    """An extra 1/sqrt(D) on the logits (a transformer habit the spec does not have)."""

    name = "broken_logit_scale"

    def call_op(self, call):
        x = call.inputs.get("sources", call.inputs.get("partial"))
        dim = np.shape(x[0] if isinstance(x, list) else x)[-1]
        heads = call.attrs.get("num_heads", 1)
        attrs = dict(call.attrs, scale=call.attrs.get("scale", 1.0) / np.sqrt(max(dim // heads, 1)))
        return super().call_op(dataclasses.replace(call, attrs=attrs))


class BrokenDropPast32(ReferenceBackend):
    """Silently ignores every source past index 31 (a hard-coded 32-source cap, no error)."""

    name = "broken_drop_past_32"

    def call_op(self, call):
        src = call.inputs.get("sources")
        if src is None or len(src) <= 32:
            return super().call_op(call)
        kept = src[:32]
        result = super().call_op(dataclasses.replace(call, inputs=dict(call.inputs, sources=kept)))
        result.inputs_after["sources"] = ([*result.inputs_after["sources"], *src[32:]]
                                          if isinstance(src, list) else np.asarray(src, np.float64))
        if "sources" in result.grads:
            g = result.grads["sources"]
            zeros = np.zeros_like(np.asarray(src[32:], np.float64))
            result.grads["sources"] = [*g, *zeros] if isinstance(src, list) else np.concatenate([g, zeros])
        return result


class BrokenEmbedding(ReferenceBackend):
    """The probe's depth attention never sees the embedding v_0 (once other sources exist)."""

    name = "broken_embedding"

    def call_probe(self, call):
        real = Tape.depth_attention

        def without_v0(tape, sources, stats, query, norm_weight, config, **kw):
            keep = slice(1, None) if len(sources) > 1 else slice(None)
            return real(tape, sources[keep], stats[keep], query, norm_weight, config, **kw)

        with mock.patch.object(Tape, "depth_attention", without_v0):
            return super().call_probe(call)


class BrokenNormWeightGrad(ReferenceBackend):
    """Returns twice the norm-weight gradient (forward is right)."""

    name = "broken_norm_weight_grad"

    def call_op(self, call):
        result = super().call_op(call)
        for key in ("norm_weight", "norm_weights"):
            if result.grads.get(key) is not None:
                result.grads[key] = 2.0 * result.grads[key]
        return result


class IgnoresMix(ReferenceBackend):
    """Drops the M10 mix (runs the plain scheme) but honours the per-call scale."""

    name = "ignores_mix"

    def call_probe(self, call):
        return super().call_probe(dataclasses.replace(call, mix=None))


class IgnoresCallScale(ReferenceBackend):
    """Drops the M10 per-call scale (keeps the config's) but honours the mix."""

    name = "ignores_call_scale"

    def call_probe(self, call):
        return super().call_probe(dataclasses.replace(call, scale=None))


class NoCallInputs(ReferenceBackend):
    """Declares no M10 call inputs: their rows must be skipped with the reason, not failed."""

    name = "no_call_inputs"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), call_inputs=frozenset())


class NondeterministicBackward(ReferenceBackend):
    """Adds fresh tiny noise (1e-13 relative, far inside every tolerance) to d_query per call,
    like an atomic-add reduction whose order changes run to run."""

    name = "nondeterministic_backward"

    def call_op(self, call):
        result = super().call_op(call)
        for key in ("query", "queries"):
            g = result.grads.get(key)
            if g is not None:
                result.grads[key] = g * (1.0 + 1e-13 * np.random.default_rng().standard_normal(g.shape))
        return result


class MutatesInput(ReferenceBackend):
    """Scales its query input in place after the call (inputs must never be modified)."""

    name = "mutates_input"

    def call_op(self, call):
        result = super().call_op(call)
        q = call.inputs.get("query")
        if isinstance(q, np.ndarray) and q.size:
            q *= 2.0
        return result


class FewerOptions(ReferenceBackend):
    """Declares no sigmoid, at most 40 sources, and does not enforce that limit."""

    name = "fewer_options"

    def capabilities(self):
        caps = super().capabilities()
        return dataclasses.replace(caps, options=caps.options - {"sigmoid"}, max_sources=40,
                                   variants=frozenset(VARIANT_KINDS) - {"sigmoid"})


class OverflowingBackward(ReferenceBackend):
    """Source gradients overflow to inf once |x| > 1e20 (mean(x^2) in fp32 without rescaling)."""

    name = "overflowing_backward"

    def call_op(self, call):
        result = super().call_op(call)
        src = call.inputs.get("sources")
        if result.grads.get("sources") is not None and np.max(np.abs(np.asarray(src, np.float64))) > 1e20:
            g = result.grads["sources"]
            result.grads["sources"] = [x * np.inf for x in g] if isinstance(g, list) else g * np.inf
        return result


reference = ReferenceBackend()
rounding = Rounding(ReferenceBackend())
broken_eps = BrokenEps()
broken_logit_scale = BrokenLogitScale()
broken_drop_past_32 = BrokenDropPast32()
broken_embedding = BrokenEmbedding()
broken_norm_weight_grad = BrokenNormWeightGrad()
ignores_mix = IgnoresMix()
ignores_call_scale = IgnoresCallScale()
no_call_inputs = NoCallInputs()
nondeterministic_backward = NondeterministicBackward()
rounding_broken_eps = Rounding(BrokenEps(), name="rounding_broken_eps")
mutates_input = MutatesInput()
fewer_options = FewerOptions()
rounding_overflowing_backward = Rounding(OverflowingBackward(), name="rounding_overflowing_backward")
