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
from attnres_core.config import VARIANT_KINDS
from attnres_numpy import ops
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

    #: The dtype "out" is rounded to (None: the case dtype, C10.3).
    out_dtype = None

    def call_op(self, call):
        dt = call.dtype
        compute = "float64" if dt == "float64" else "float32"
        own = {k: (v if isinstance(v, str) else dt) for k, v in call.input_dtypes.items()}
        # C10.1: an input wider than kappa (a float64 query with float32 sources) is converted to it.
        inputs = {k: round_to(v, compute) if own.get(k) == "float64" and compute == "float32" else v
                  for k, v in call.inputs.items()}
        inner = dataclasses.replace(call, dtype="float64", inputs=inputs,
                                    input_dtypes={k: self._upcast(k, v, dt) for k, v in call.input_dtypes.items()})
        r = self.inner.call_op(inner)
        native = {}

        def rounded(key, v, dtype):
            if v is None:
                return None
            if isinstance(v, (list, tuple)):
                native[key] = [dtype] * len(v)
                return [round_to(x, dtype) for x in v]
            native[key] = dtype
            return round_to(v, dtype)

        out_dtype = self.out_dtype or dt
        r.outputs = {k: rounded(k, v, compute if k in ("lse", "weights") else out_dtype)
                     for k, v in r.outputs.items()}
        r.grads = {k: rounded(f"grad.{k}", v, own.get(k, dt)) for k, v in r.grads.items()}
        r.inputs_after = {k: None if v is None else [round_to(x, own.get(k, dt)) for x in v]
                          if isinstance(v, list) else round_to(v, own.get(k, dt)) for k, v in r.inputs_after.items()}
        for k in call.inputs:  # the converted inputs were the port's own copies; its natives are the given ones
            if inputs[k] is not call.inputs[k]:
                r.inputs_after[k] = np.asarray(call.inputs[k], np.float64).copy()
        r.native_dtypes, r.aliases = native, ()  # every result is a fresh rounded copy
        return r

    def call_probe(self, call):
        r = self.inner.call_probe(dataclasses.replace(call, dtype="float64"))
        r.out = round_to(r.out, call.dtype)
        r.out_dtype = call.dtype  # M1a: the stream (so out) in the embedding's dtype
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
    """Silently ignores every source past index `cap` - 1 (a hard-coded source cap, no error)."""

    name = "broken_drop_past_32"
    cap = 32

    def call_op(self, call):
        src, cap = call.inputs.get("sources"), self.cap
        if src is None or len(src) <= cap:
            return super().call_op(call)
        kept = src[:cap]
        result = super().call_op(dataclasses.replace(call, inputs=dict(call.inputs, sources=kept)))
        result.inputs_after["sources"] = ([*result.inputs_after["sources"], *src[cap:]]
                                          if isinstance(src, (list, tuple)) else np.asarray(src, np.float64))
        if "sources" in result.grads:
            g = result.grads["sources"]
            zeros = np.zeros_like(np.asarray(src[cap:], np.float64))
            result.grads["sources"] = [*g, *zeros] if isinstance(src, (list, tuple)) else np.concatenate([g, zeros])
        return result


class BrokenDropPast256(BrokenDropPast32):
    """A 256-source tile with no fallback: sources past index 255 are silently dropped (C16)."""

    name = "broken_drop_past_256"
    cap = 256


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


class _IgnoresParam(ReferenceBackend):
    """A port that leaves one scheme parameter, `param`, at its init value (`init(shape)`)
    instead of the learned one it is given."""

    param = ""

    @staticmethod
    def init(shape):
        raise NotImplementedError

    def call_probe(self, call):
        value = call.params.get(self.param)
        if value is None:
            return super().call_probe(call)
        params = dict(call.params, **{self.param: self.init(np.shape(value))})
        return super().call_probe(dataclasses.replace(call, params=params))


class IgnoresKeyProjection(_IgnoresParam):
    """M13: keys are the first r channels of the normed sources (the init P = I[:, :r]), not
    `(rmsnorm(v) * g) @ key_projection` with the learned projection."""

    name = "ignores_key_projection"
    param = "key_projection"

    @staticmethod
    def init(shape):
        return np.eye(*shape)


class DropsSummaries(ReferenceBackend):
    """M14: outputs older than the window are dropped (the plain window, M5) instead of kept as
    block sums."""

    name = "drops_summaries"

    def call_probe(self, call):
        if call.config.get("history") != "summaries":
            return super().call_probe(call)
        config = dict(call.config, history="drop", block_size=None)
        return super().call_probe(dataclasses.replace(call, config=config))


class IgnoresOutNormWeights(_IgnoresParam):
    """M15: the stream norms every sublayer input and the output without the learned gains
    (out_norm_weights left at their init, ones)."""

    name = "ignores_out_norm_weights"
    param = "out_norm_weights"

    @staticmethod
    def init(shape):
        return np.ones(shape)


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


# -- the holes of issue 17: each adapter carries one defect a port was seen to have -----------------
def _token_count(call) -> int:
    x = call.inputs.get("sources", call.inputs.get("partial"))
    shape = np.shape(x[0]) if isinstance(x, (list, tuple)) else np.shape(x)[call.op != "merge_partial":]
    return int(np.prod(shape[:-1]))


class NanToNum(ReferenceBackend):
    """Inspects values (C12): replaces NaN / Inf in every input by 0 before the op."""

    name = "nan_to_num"

    def call_op(self, call):
        clean = lambda v: None if v is None else (type(v)(np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in v)
                                                  if isinstance(v, (list, tuple))
                                                  else np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0))
        result = super().call_op(dataclasses.replace(call, inputs={k: clean(v) for k, v in call.inputs.items()}))
        result.inputs_after = {k: None if v is None else [np.asarray(x, np.float64) for x in v]
                               if isinstance(v, (list, tuple)) else np.asarray(v, np.float64)
                               for k, v in call.inputs.items()}
        return result


_REAL_WEIGHTS, _REAL_LSE = ops._weights, ops._lse


class GlobalMax(ReferenceBackend):
    """Subtracts one maximum over every token instead of each token's own (exact for finite
    logits), so one token's NaN reaches every token (C12: only the affected tokens)."""

    name = "global_max"

    @staticmethod
    def _weights(z, activation):
        if activation == "sigmoid":
            return _REAL_WEIGHTS(z, activation)
        with np.errstate(invalid="ignore", over="ignore"):
            e = np.exp(z - np.max(z))
            return e / np.sum(e, axis=0, keepdims=True)

    def call_op(self, call):
        with mock.patch.object(ops, "_weights", self._weights):
            return super().call_op(call)


class NoMaxSubtraction(Rounding):
    """An honest low-precision port except that its softmax and lse exponentiate the raw logits
    in kappa (no max subtraction, C10.4): exp overflows past 88 in float32, 709 in float64."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="no_max_subtraction")

    def call_op(self, call):
        kappa = np.float64 if call.dtype == "float64" else np.float32

        def weights(z, activation):
            if activation == "sigmoid":
                return _REAL_WEIGHTS(z, activation)
            with np.errstate(invalid="ignore", over="ignore"):
                e = np.exp(z.astype(kappa)).astype(np.float64)
                return e / np.sum(e, axis=0, keepdims=True)

        def lse(z):
            with np.errstate(over="ignore", divide="ignore"):
                return np.log(np.sum(np.exp(z.astype(kappa)).astype(np.float64), axis=0))

        with mock.patch.object(ops, "_weights", weights), mock.patch.object(ops, "_lse", lse):
            return super().call_op(call)


class RmsOverFirst4096(ReferenceBackend):
    """The key norm's mean square runs over the first 4096 channels only (a fixed-width tile)."""

    name = "rms_over_first_4096"

    @staticmethod
    def _stats(x, q, g, *, eps, scale, num_heads, key_norm):
        r, qg, s, z = _REAL_STATS(x, q, g, eps=eps, scale=scale, num_heads=num_heads, key_norm=key_norm)
        if key_norm and x.shape[-1] > 4096:
            r = 1.0 / np.sqrt(np.mean(x[..., :4096] ** 2, axis=-1) + eps)
            z = scale * r * s
        return r, qg, s, z

    def call_op(self, call):
        with mock.patch.object(ops, "_stats", self._stats):
            return super().call_op(call)


class KeyNormOverflow(Rounding):
    """An honest low-precision port except that its float32 key norm sums x^2 without
    rescaling: past |x| ~ 1e19 the mean square overflows, r = 0 and the weights go uniform
    (finite, wrong)."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="key_norm_overflow")

    @staticmethod
    def _stats(x, q, g, *, eps, scale, num_heads, key_norm):
        r, qg, s, z = _REAL_STATS(x, q, g, eps=eps, scale=scale, num_heads=num_heads, key_norm=key_norm)
        if key_norm:
            with np.errstate(over="ignore"):
                ms = np.mean(np.square(x.astype(np.float32)), axis=-1, dtype=np.float32)
            r = 1.0 / np.sqrt(ms.astype(np.float64) + eps)
            z = scale * r * s
        return r, qg, s, z

    def call_op(self, call):
        if call.dtype == "float64":
            return super().call_op(call)
        with mock.patch.object(ops, "_stats", self._stats):
            return super().call_op(call)


class NondeterministicAtLargeT(Rounding):
    """An honest float32-capable port whose d_query changes by an ulp run to run once there are
    4096 tokens or more (a reduction split over threads only at production sizes)."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="nondeterministic_at_large_t")

    def call_op(self, call):
        result = super().call_op(call)
        if _token_count(call) >= 4096:
            for key in ("query", "queries"):
                g = result.grads.get(key)
                if g is not None:
                    noise = 1.0 + 1e-6 * np.random.default_rng().standard_normal(g.shape)
                    result.grads[key] = round_to(g * noise, call.input_dtypes.get(key, call.dtype))
        return result


class RejectsEmptyTokens(ReferenceBackend):
    """Its VJP divides by the token count (JAX's multi VJP did): T = 0 raises ZeroDivisionError."""

    name = "rejects_empty_tokens"

    def call_op(self, call):
        if call.cotangents is not None and _token_count(call) == 0:
            raise ZeroDivisionError("division by zero")
        return super().call_op(call)


class RejectsTuples(ReferenceBackend):
    """Accepts sources as a list or stacked array only (section 1: a tuple is a list)."""

    name = "rejects_tuples"

    def call_op(self, call):
        if isinstance(call.inputs.get("sources"), tuple):
            raise TypeError("sources: expected a list or an array, got tuple")
        return super().call_op(call)


class RejectsQueryDtype(Rounding):
    """An honest port except that it requires the query in the sources' dtype (C10.1 allows any
    floating dtype)."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="rejects_query_dtype")

    def call_op(self, call):
        for key in ("query", "queries"):
            if call.input_dtypes.get(key, call.dtype) != call.dtype and key in call.inputs:
                raise TypeError(f"{key}: dtype {call.input_dtypes[key]} differs from the sources' {call.dtype}")
        return super().call_op(call)


class Float32Out(Rounding):
    """An honest port except that `out` comes back in float32 for fp16 / bf16 sources (C10.3:
    the sources' dtype); values are *more* accurate, so only the dtype check can see it."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="float32_out")

    def call_op(self, call):
        self.out_dtype = "float32" if call.dtype in ("float16", "bfloat16") else None
        return super().call_op(call)


class AliasesAtN1(ReferenceBackend):
    """At N = 1 depth_attention returns the source array itself as `out` (C6 holds bitwise, but
    writing into the result would change the input: C7a)."""

    name = "aliases_at_n1"

    def call_op(self, call):
        real = ops.depth_attention

        def same_array(sources, *args, **kwargs):
            result = real(sources, *args, **kwargs)
            if len(sources) == 1 and kwargs.get("activation", "softmax") == "softmax":
                return (sources[0], *result[1:]) if isinstance(result, tuple) else sources[0]
            return result

        with mock.patch.object(ops, "depth_attention", same_array):
            return super().call_op(call)


class WeightsFromSeparatePass(Rounding):
    """An honest low-precision port except that `return_weights` recomputes the logits in a
    separate float32 pass and subtracts the kernel's lse (the torch fast paths' defect): at
    N = 1 the weights miss 1 by the two passes' rounding difference."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="weights_from_separate_pass")

    def call_op(self, call):
        result = super().call_op(call)
        a = call.attrs
        if call.op != "depth_attention" or "weights" not in result.outputs or a.get("num_heads", 1) != 1 \
                or a.get("activation", "softmax") != "softmax" or not a.get("key_norm", True) or call.dtype == "float64":
            return result
        f = np.float32
        x = np.stack([np.asarray(v, f) for v in call.inputs["sources"]])
        g = np.ones(x.shape[-1], f) if call.inputs["norm_weight"] is None else np.asarray(call.inputs["norm_weight"], f)
        r = f(1) / np.sqrt(np.mean(x * x, axis=-1) + f(a.get("eps", 1e-6)))
        z = f(a.get("scale", 1.0)) * r * np.sum(np.asarray(call.inputs["query"], f) * g * x, axis=-1)
        x64 = np.stack([np.asarray(v, np.float64) for v in call.inputs["sources"]])
        lse = ops.depth_attention(x64, np.asarray(call.inputs["query"], np.float64),
                                  call.inputs["norm_weight"], **dict(a, return_weights=False, return_lse=True))[1]
        result.outputs["weights"] = round_to(np.exp(z.astype(np.float64) - lse), "float32")
        return result


class MergeIgnoresEpsScale(ReferenceBackend):
    """merge_partial runs with the default eps and scale whatever the call says."""

    name = "merge_ignores_eps_scale"

    def call_op(self, call):
        if call.op == "merge_partial":
            call = dataclasses.replace(call, attrs={k: v for k, v in call.attrs.items() if k not in ("eps", "scale")})
        return super().call_op(call)


class MergeUncheckedNormWeight(ReferenceBackend):
    """merge_partial never validates norm_weight: a wrong-shape one is dropped (gain 1), an
    integer one used as floats (no error, C5)."""

    name = "merge_unchecked_norm_weight"

    def call_op(self, call):
        g = call.inputs.get("norm_weight")
        if call.op == "merge_partial" and g is not None and call.inputs.get("partial") is not None:
            dim = np.shape(call.inputs["partial"])[-1]
            inputs = dict(call.inputs, norm_weight=g if np.shape(g) == (dim,) else None)
            dtypes = {k: v for k, v in call.input_dtypes.items() if k != "norm_weight"}
            call = dataclasses.replace(call, inputs=inputs, input_dtypes=dtypes)
        return super().call_op(call)


class OutNormPerHead(ReferenceBackend):
    """C17's out_normed normalized over each head's channels instead of all D (gradients right)."""

    name = "out_norm_per_head"

    def call_op(self, call):
        result = super().call_op(call)
        heads = call.attrs.get("num_heads", 1)
        if result.outputs.get("out_normed") is not None and heads > 1:
            out = result.outputs["out"]
            y = out.reshape(out.shape[:-1] + (heads, out.shape[-1] // heads))
            eps = call.attrs.get("out_norm_eps") or call.attrs.get("eps", 1e-6)
            y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)
            result.outputs["out_normed"] = y.reshape(out.shape) * call.inputs["out_norm_weight"]
        return result


class DropsOutNormWeightGrad(ReferenceBackend):
    """No gradient for out_norm_weight (read as zero, as a None gradient is): forward right."""

    name = "drops_out_norm_weight_grad"

    def call_op(self, call):
        result = super().call_op(call)
        if "out_norm_weight" in result.grads:
            result.grads["out_norm_weight"] = None
        return result


class IgnoresOutNormedCotangent(ReferenceBackend):
    """The backward never folds d_out_normed into d_out (a kernel without the C17 prologue):
    d_out_norm_weight right, every other gradient as if out_normed had no cotangent."""

    name = "ignores_out_normed_cotangent"

    def call_op(self, call):
        result = super().call_op(call)
        if call.cotangents and call.cotangents.get("out_normed") is not None:
            plain = dict(call.cotangents, out_normed=np.zeros_like(call.cotangents["out_normed"]))
            wrong = super().call_op(dataclasses.replace(call, cotangents=plain))
            result.grads = dict(wrong.grads, out_norm_weight=result.grads["out_norm_weight"])
        return result


# -- round 3 (issue 33): each adapter carries one defect the grid did not see -----------------------
class MultipliesCallScale(ReferenceBackend):
    """M10: the per-call scale multiplies config.scale instead of replacing it (equal when the
    config's scale is 1)."""

    name = "multiplies_call_scale"

    def call_probe(self, call):
        if call.scale is None:
            return super().call_probe(call)
        return super().call_probe(dataclasses.replace(call, scale=call.scale * call.config.get("scale", 1.0)))


class _TwoPhaseScale(ReferenceBackend):
    """The two-phase ops (phase 1 and every merge) of the probe run at `scale(call)` instead of
    the call's effective scale; the direct calls (the output aggregation) keep it."""

    def scale(self, call):
        raise NotImplementedError

    def call_probe(self, call):
        if call.schedule != "two_phase":
            return super().call_probe(call)
        wrong = self.scale(call)
        multi, merge = Tape.depth_attention_multi, Tape.merge_partial

        def multi_at(tape, sources, stats, queries, norm_weights, config):
            return multi(tape, sources, stats, queries, norm_weights, dataclasses.replace(config, scale=wrong))

        def merge_at(tape, out1, lse1, partial, query, norm_weight, config):
            return merge(tape, out1, lse1, partial, query, norm_weight, dataclasses.replace(config, scale=wrong))

        with mock.patch.object(Tape, "depth_attention_multi", multi_at), \
                mock.patch.object(Tape, "merge_partial", merge_at):
            return super().call_probe(call)


class TwoPhaseAtScaleOne(_TwoPhaseScale):
    """Phase 1 and the merges run at scale 1 whatever the config or the call says."""

    name = "two_phase_at_scale_one"

    def scale(self, call):
        return 1.0


class TwoPhaseIgnoresCallScale(_TwoPhaseScale):
    """Phase 1 and the merges keep config.scale: the per-call scale reaches the direct calls only."""

    name = "two_phase_ignores_call_scale"

    def scale(self, call):
        return call.config.get("scale", 1.0)


class TwoPhaseLowRankWithoutGains(ReferenceBackend):
    """M13 under two-phase: the stream forms the effective query without the row gains,
    q_r @ P^T instead of (q_r g_r) @ P^T (the gains left at their init, ones)."""

    name = "two_phase_low_rank_without_gains"

    def call_probe(self, call):
        if call.schedule != "two_phase" or call.config.get("key_rank") is None:
            return super().call_probe(call)
        params = dict(call.params, norm_weights=np.ones(np.shape(call.params["norm_weights"])))
        return super().call_probe(dataclasses.replace(call, params=params))


class WeightsPerTile40(ReferenceBackend):
    """return_weights normalized within tiles of 40 sources (each tile's softmax on its own),
    not over all N: exact up to 40 sources; out and lse right."""

    name = "weights_per_tile_40"

    def call_op(self, call):
        result = super().call_op(call)
        w = result.outputs.get("weights")
        if w is not None and w.shape[0] > 40 and call.attrs.get("activation", "softmax") == "softmax":
            w = np.array(w)
            for start in range(0, w.shape[0], 40):
                tile = w[start:start + 40]
                w[start:start + 40] = tile / np.sum(tile, axis=0, keepdims=True)
            result.outputs["weights"] = w
        return result


class OutNormSingleTokenWithoutGain(ReferenceBackend):
    """C17: a single-token path (T = 1 or no token axes, as in decode) returns rmsnorm(out)
    without the out_norm_weight gain; gradients right."""

    name = "out_norm_single_token_without_gain"

    def call_op(self, call):
        result = super().call_op(call)
        if result.outputs.get("out_normed") is not None and _token_count(call) == 1:
            result.outputs["out_normed"] = result.outputs["out_normed"] / np.asarray(call.inputs["out_norm_weight"])
        return result


class OutNormFromRoundedOut(Rounding):
    """An honest low-precision port except that out_normed is computed from out after its
    rounding to the sources' dtype (C17: from out in kappa): two roundings, and in fp16 the
    subnormal out of small outputs keeps only a few bits."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="out_norm_from_rounded_out")

    def call_op(self, call):
        result = super().call_op(call)
        normed = result.outputs.get("out_normed")
        if normed is not None:
            y = np.asarray(result.outputs["out"], np.float64)  # already rounded to the dtype
            eps = call.attrs.get("out_norm_eps") or call.attrs.get("eps", 1e-6)
            w = round_to(np.asarray(call.inputs["out_norm_weight"], np.float64), "float32" if call.dtype != "float64"
                         else "float64")
            result.outputs["out_normed"] = round_to(y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps) * w,
                                                    call.dtype)
        return result


class MergeOneMinusW1(Rounding):
    """An honest low-precision port except that merge_partial forms w2 = 1 - w1 in kappa (C10.7:
    its own logistic): a tiny partial weight and every gradient through it are lost."""

    def __init__(self):
        super().__init__(ReferenceBackend(), name="merge_one_minus_w1")

    def call_op(self, call):
        kappa = np.float64 if call.dtype == "float64" else np.float32
        real = ops._merge_prepare

        def prepare(*args):
            geo, o1, x, q, g, r, qg, s, z2, l1, w1, w2 = real(*args)
            w1k = w1.astype(kappa)
            return geo, o1, x, q, g, r, qg, s, z2, l1, w1k.astype(np.float64), (1 - w1k).astype(np.float64)

        with mock.patch.object(ops, "_merge_prepare", prepare):
            return super().call_op(call)


class BrokenForwardOnly(ReferenceBackend):
    """Declares `forward_in_gradient_call` (its forward-only program runs the forward of its
    gradient program) but its forward-only calls are off by 1e-3 relative: a separate,
    differently compiled forward program that the declaration hides."""

    name = "broken_forward_only"
    forward_in_gradient_call = True

    def call_op(self, call):
        result = super().call_op(call)
        if call.cotangents is None:
            result.outputs = {k: None if v is None else v * (1 + 1e-3) for k, v in result.outputs.items()}
        return result

    def call_probe(self, call):
        result = super().call_probe(call)
        if call.cotangent is None:
            result.out = result.out * (1 + 1e-3)
        return result


class BrokenForwardOnlyOutNorm(BrokenForwardOnly):
    """As `BrokenForwardOnly`, but only out_normed (C17) of a forward-only call is off: no
    invariant or two-phase probe reads that output from a forward-only call."""

    name = "broken_forward_only_out_norm"

    def call_op(self, call):
        result = ReferenceBackend.call_op(self, call)
        if call.cotangents is None and result.outputs.get("out_normed") is not None:
            result.outputs["out_normed"] = result.outputs["out_normed"] * (1 + 1e-3)
        return result

    def call_probe(self, call):
        return ReferenceBackend.call_probe(self, call)


class NondeterministicPast(Rounding):
    """An honest port whose d_query / d_queries changes run to run past `tokens` token positions
    in the ops `ops` (a reduction split over threads only at large sizes)."""

    def __init__(self, name, tokens, ops_):
        super().__init__(ReferenceBackend(), name=name)
        self.tokens, self.ops = tokens, ops_

    def call_op(self, call):
        result = super().call_op(call)
        if call.op in self.ops and _token_count(call) > self.tokens:
            for key in ("query", "queries"):
                g = result.grads.get(key)
                if g is not None:
                    noise = 1.0 + 1e-6 * np.random.default_rng().standard_normal(np.shape(g))
                    result.grads[key] = round_to(g * noise, call.input_dtypes.get(key, call.dtype))
        return result


class QueryNoneAccepted(ReferenceBackend):
    """Reads a missing query (None) as a zero query (uniform weights) instead of raising."""

    name = "query_none_accepted"

    def call_op(self, call):
        if call.inputs.get("query", 0) is None:
            dim = np.shape(call.inputs["sources"][0])[-1]
            call = dataclasses.replace(call, inputs=dict(call.inputs, query=np.zeros(dim)))
        return super().call_op(call)


reference = ReferenceBackend()
rounding = Rounding(ReferenceBackend())
broken_eps = BrokenEps()
broken_logit_scale = BrokenLogitScale()
broken_drop_past_32 = BrokenDropPast32()
broken_embedding = BrokenEmbedding()
broken_norm_weight_grad = BrokenNormWeightGrad()
ignores_mix = IgnoresMix()
ignores_call_scale = IgnoresCallScale()
ignores_key_projection = IgnoresKeyProjection()
drops_summaries = DropsSummaries()
ignores_out_norm_weights = IgnoresOutNormWeights()
no_call_inputs = NoCallInputs()
nondeterministic_backward = NondeterministicBackward()
rounding_broken_eps = Rounding(BrokenEps(), name="rounding_broken_eps")
mutates_input = MutatesInput()
fewer_options = FewerOptions()
rounding_overflowing_backward = Rounding(OverflowingBackward(), name="rounding_overflowing_backward")
nan_to_num = NanToNum()
global_max = GlobalMax()
no_max_subtraction = NoMaxSubtraction()
rounding_drop_past_256 = Rounding(BrokenDropPast256(), name="rounding_drop_past_256")
rounding_rms_over_first_4096 = Rounding(RmsOverFirst4096(), name="rounding_rms_over_first_4096")
nondeterministic_at_large_t = NondeterministicAtLargeT()
rejects_empty_tokens = RejectsEmptyTokens()
rejects_tuples = RejectsTuples()
rejects_query_dtype = RejectsQueryDtype()
float32_out = Float32Out()
aliases_at_n1 = AliasesAtN1()
weights_from_separate_pass = WeightsFromSeparatePass()
merge_ignores_eps_scale = MergeIgnoresEpsScale()
merge_unchecked_norm_weight = MergeUncheckedNormWeight()
key_norm_overflow = KeyNormOverflow()
rounding_out_norm_per_head = Rounding(OutNormPerHead(), name="rounding_out_norm_per_head")
drops_out_norm_weight_grad = DropsOutNormWeightGrad()
ignores_out_normed_cotangent = IgnoresOutNormedCotangent()
multiplies_call_scale = MultipliesCallScale()
two_phase_at_scale_one = TwoPhaseAtScaleOne()
two_phase_ignores_call_scale = TwoPhaseIgnoresCallScale()
two_phase_low_rank_without_gains = TwoPhaseLowRankWithoutGains()
weights_per_tile_40 = WeightsPerTile40()
out_norm_single_token_without_gain = OutNormSingleTokenWithoutGain()
out_norm_from_rounded_out = OutNormFromRoundedOut()
merge_one_minus_w1 = MergeOneMinusW1()
broken_forward_only = BrokenForwardOnly()
broken_forward_only_out_norm = BrokenForwardOnlyOutNorm()
nondeterministic_past_4096 = NondeterministicPast("nondeterministic_past_4096", 4096,
                                                  ("depth_attention", "depth_attention_multi", "merge_partial"))
nondeterministic_two_phase_at_large_t = NondeterministicPast("nondeterministic_two_phase_at_large_t", 4095,
                                                             ("depth_attention_multi", "merge_partial"))
query_none_accepted = QueryNoneAccepted()
rounding_two_phase_low_rank_without_gains = Rounding(TwoPhaseLowRankWithoutGains(),
                                                     name="rounding_two_phase_low_rank_without_gains")
