"""The mutation score: how many plausible single defects the suite catches (issue 44, item 7).

`ReferencePort` is a port of the spec built on the float64 reference (`attnres_numpy.ops`)
through the public `Adapter` API, the way an outside porter plugs in: NumPy arrays as its
"framework" (float64 and float32, channel-strided views), ops called with the spec's arguments by
`Adapter.run_op`, gradients through `Adapter.vjp` (a one-op tape: the op records its own VJP, the
reference's), results rounded once to their dtypes (C10.3).  Honest, it passes every case.

A `Mutant` is one defect a real author could make, with the spec rule it breaks, injected into
that port through small hooks (the arguments it reads, a helper of the math it patches, the
outputs, cotangents or gradients it returns, the state it keeps between calls).  `run_mutants`
runs the suite's cases on each (cheap families first, stopping at the first failing case) and
returns the killed fraction and the survivors by name; `ACCEPTED` names the survivors we accept,
each with the reason.  CI runs it as `tests/test_mutation_score.py` and prints the score.

    python -m attnres_conformance.mutants          # the score, each mutant's killer, survivors

Mutants of issue 44's categories carry `first` (the category's case-id prefixes, run first) and
`must_kill`: the test checks that their killer is one of those cases, which proves the category
can fail.  A mutant killed only by crashing the harness's own hook is not counted as killed.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import numpy as np
from attnres_core.numerics import round_to_dtype
from attnres_core.validation import compute_dtype_for
from attnres_numpy import ops

from .adapters.base import Adapter
from .adapters.numpy import native
from .backend import OPS, OPTIONS, SCHEDULES, Capabilities, ProbeCall, ProbeResult

#: The probe variants the reference port runs (`ReferencePort.call_probe`): enough for the M1a
#: rows (`probe/sublayer_dtype`), whose mutants change the stream's dtype, not the scheme.
PROBE_VARIANTS = frozenset({"full", "block"})

#: Keyword arguments of the reference VJPs (the forward's return_* flags are not among them).
_VJP_ATTRS = ("eps", "scale", "num_heads", "activation", "key_norm", "out_norm_eps")
_VJPS = {"depth_attention": ops.depth_attention_vjp, "depth_attention_multi": ops.depth_attention_multi_vjp,
         "merge_partial": ops.merge_partial_vjp}
_ORDER = {"depth_attention": ("sources", "query", "norm_weight"),
          "depth_attention_multi": ("sources", "queries", "norm_weights"),
          "merge_partial": ("out1", "lse1", "partial", "query", "norm_weight")}


@dataclass
class Ctx:
    """What a hook sees: the op, "forward" (a call without cotangents) or "vjp", the port (for
    state kept between calls: `port.memo`)."""

    op: str
    mode: str
    port: "ReferencePort"


@dataclass(frozen=True)
class Mutant:
    """One plausible defect.  Hooks (each optional, each `(ctx, ...)`):
    args(ctx, named, kw) -> (named, kw): the arguments the port reads (native arrays by spec name);
    patch: ((name in attnres_numpy.ops, replacement(original) -> function), ...) while the math runs,
      `patch_in`: "both", "forward" or "backward";
    outputs(ctx, outs, named, kw) -> outs (float64 by name, before the final rounding);
    cotangents(ctx, cots, named, kw) -> cots; grads(ctx, grads, named, kw) -> grads (float64);
    cast(ctx, name, value, dtype) -> dtype: the dtype a result is rounded to;
    stream(call) -> dtype: the dtype the probe keeps its stream (and so `out`) in (M1a; the
      honest port: the embedding's, `call.dtype`)."""

    name: str
    rule: str
    category: str
    what: str
    args: Optional[Callable] = None
    patch: Tuple[Tuple[str, Callable], ...] = ()
    patch_in: str = "both"
    outputs: Optional[Callable] = None
    cotangents: Optional[Callable] = None
    grads: Optional[Callable] = None
    cast: Optional[Callable] = None
    stream: Optional[Callable] = None
    #: Case-id prefixes run first for this mutant (the category meant to kill it); with
    #: `must_kill` the killing case must be one of them (it proves the category can fail).
    first: Tuple[str, ...] = ()
    must_kill: bool = False
    #: Attributes set on the port (e.g. forward_in_gradient_call: its forward cells then come from
    #: the gradient call, and only forward-only cases exercise its forward-only program).
    port_attrs: Tuple[Tuple[str, Any], ...] = ()


HONEST = Mutant("honest", "-", "control", "the reference-based port without a defect")


class ReferencePort(Adapter):
    """The float64 reference as an outside port: see the module docstring."""

    name = "reference_port"

    def __init__(self, mutant: Mutant = HONEST):
        self.mutant = mutant
        self.name = f"reference_port[{mutant.name}]"
        self.memo: Dict[str, Any] = {}
        self.region: Optional[str] = None
        self._mode = "forward"
        self._tape = None
        self.ops = _PortOps(self)
        for key, value in mutant.port_attrs:
            setattr(self, key, value)

    # -- the framework: NumPy ----------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float64", "float32"), ops=frozenset(OPS), options=frozenset(OPTIONS),
                            variants=PROBE_VARIANTS, schedules=frozenset(SCHEDULES), call_inputs=frozenset(),
                            autocast=("bfloat16",), sublayer_dtype=True)

    def call_probe(self, call: ProbeCall) -> ProbeResult:
        """The probe network (Full and Block only) as the float64 reference computes it
        (`attnres_numpy.model`, sublayers rounded to `call.sublayer_dtype`), `out` rounded once to
        the dtype the port keeps its stream in (M1a: the embedding's; `Mutant.stream`), each
        gradient to its input's dtype."""
        from attnres_core.config import ResidualConfig
        from attnres_numpy import model

        config = ResidualConfig.from_dict(dict(call.config))
        kw = dict(schedule=call.schedule, mix=call.mix, scale=call.scale,
                  sublayer_dtype=getattr(call, "sublayer_dtype", None))
        stream = call.dtype if self.mutant.stream is None else self.mutant.stream(call)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out = model.probe_forward(config, call.params, call.embedding, call.sublayer_weights, **kw)
            grads = {} if call.cotangent is None else model.probe_vjp(
                config, call.params, call.embedding, call.sublayer_weights, call.cotangent, **kw)
        return ProbeResult(round_to_dtype(out, stream), {k: round_to_dtype(g, call.dtype) for k, g in grads.items()},
                           out_dtype=stream)

    def context(self, call):
        """An "autocast region" (C3a): recorded while the call runs; the ops widen mixed sources."""
        @contextlib.contextmanager
        def region():
            self.region = getattr(call, "autocast", None)
            try:
                yield
            finally:
                self.region = None
        return region()

    def versions(self) -> Dict[str, str]:
        return {"numpy": np.__version__, "mutant": self.mutant.name}

    def array(self, values, dtype, device, strided):
        return native(values, dtype, strided)

    def to_numpy(self, x) -> np.ndarray:
        return np.array(x, np.float64)

    def dtype_name(self, x) -> str:
        return np.asarray(x).dtype.name

    def shares_memory(self, result, argument) -> bool:
        return np.may_share_memory(result, argument)

    def forward(self, fn, leaves, key=None):
        self._mode = "forward"
        return fn(*leaves)

    def vjp(self, fn, leaves, key=None):
        self._mode, self._tape = "vjp", None
        outs = fn(*leaves)
        tape = self._tape

        def pullback(cotangents):
            grads = tape(list(cotangents))  # [(native argument, its gradient)]
            by_id = {id(a): g for a, g in grads}
            return [by_id.get(id(leaf)) for leaf in leaves]

        return outs, pullback


def _kappa(named: dict, op: str) -> str:
    src = named.get("partial" if op == "merge_partial" else "sources")
    first = src[0] if isinstance(src, (list, tuple)) and len(src) else src
    name = np.asarray(first).dtype.name if first is not None else "float64"
    return compute_dtype_for(name) if name in ("float64", "float32", "float16") else "float64"


def _dtype(value) -> Optional[str]:
    return None if value is None else np.asarray(value).dtype.name


class _PortOps:
    """The port's three ops: the reference's math on the arguments the port reads, results
    rounded once (C10.3), the VJP recorded on the port's tape."""

    def __init__(self, port: ReferencePort):
        self.port = port

    def depth_attention(self, sources, query, norm_weight=None, **kw):
        return self._run("depth_attention", dict(sources=sources, query=query, norm_weight=norm_weight), kw)

    def depth_attention_multi(self, sources, queries, norm_weights=None, **kw):
        return self._run("depth_attention_multi", dict(sources=sources, queries=queries,
                                                       norm_weights=norm_weights), kw)

    def merge_partial(self, out1, lse1, partial, query, norm_weight=None, **kw):
        return self._run("merge_partial", dict(out1=out1, lse1=lse1, partial=partial, query=query,
                                               norm_weight=norm_weight), kw)

    @contextlib.contextmanager
    def _patched(self, phase: str):
        m = self.port.mutant
        with contextlib.ExitStack() as stack:
            if m.patch and m.patch_in in ("both", phase):
                for attr, make in m.patch:
                    stack.enter_context(mock.patch.object(ops, attr, make(getattr(ops, attr))))
            yield

    def _run(self, op: str, given: dict, kw: dict):
        port, m = self.port, self.port.mutant
        ctx = Ctx(op, port._mode, port)
        kw = dict(kw)
        if "out_norm_weight" in kw:
            given = dict(given, out_norm_weight=kw.pop("out_norm_weight"))
        named = dict(given)
        if m.args is not None:
            named, kw = m.args(ctx, named, kw)
        x = named.get("sources")
        if port.region is not None and isinstance(x, (list, tuple)) and len({a.dtype for a in x}) > 1 \
                and all(a.dtype.kind == "f" for a in x):  # C3a: widened to the widest source
            widest = max((a.dtype for a in x), key=lambda d: d.itemsize)
            named = dict(named, sources=type(x)(a.astype(widest) for a in x))
        wrap = kw.pop("_wrap", None)
        try:
            return self._compute(op, ctx, given, named, kw)
        except (ValueError, TypeError) as exc:
            if wrap == "message":
                raise type(exc)("invalid arguments") from None
            if wrap == "type":
                raise RuntimeError(str(exc)) from None
            raise

    def _compute(self, op, ctx, given, named, kw):
        port, m = self.port, self.port.mutant
        kappa = _kappa(named, op)
        # C10.1: an input wider than kappa (a float64 query of float32 sources) is converted to it.
        read = {k: (v.astype(kappa) if isinstance(v, np.ndarray) and v.dtype.name == "float64"
                    and kappa == "float32" else v) for k, v in named.items()}
        positional = [read.get(k) for k in _ORDER[op]]
        keyword = {k: v for k, v in read.items() if k not in _ORDER[op] and v is not None}
        with self._patched("forward"):
            result = getattr(ops, op)(*positional, **keyword, **kw)
        result = result if isinstance(result, tuple) else (result,)
        names = ["out"]
        if op == "depth_attention_multi":
            names.append("lse")
        if op == "depth_attention" and read.get("out_norm_weight") is not None:
            names.append("out_normed")
        if kw.get("return_lse"):
            names.append("lse")
        if op == "depth_attention" and kw.get("return_weights"):
            names.append("weights")
        outs = dict(zip(names, result))
        port.memo["out_shapes"] = {k: np.shape(v) for k, v in outs.items()}
        if m.outputs is not None:
            outs = m.outputs(ctx, outs, named, kw)
        source = named.get("partial") if op == "merge_partial" else named.get("sources")
        source_dtype = _dtype(source[0] if isinstance(source, (list, tuple)) else source)
        port.memo["source_dtype"] = source_dtype
        final = []
        for name in outs:
            dtype = kappa if name in ("lse", "weights") else source_dtype
            if m.cast is not None:
                dtype = m.cast(ctx, name, outs[name], dtype)
            final.append(np.asarray(outs[name]).astype(dtype, copy=False))

        def rounded(name, value, arg):
            dtype = arg.dtype.name
            if m.cast is not None:
                dtype = m.cast(ctx, f"grad.{name}", value, dtype)
            return np.asarray(value).astype(dtype, copy=False)

        def tape(cotangents):
            cots = {n: (None if c is None else np.asarray(c, np.float64)) for n, c in zip(outs, cotangents)}
            cots.pop("weights", None)  # C11
            if m.cotangents is not None:
                cots = m.cotangents(ctx, cots, named, kw)
            vjp_kw = {k: v for k, v in kw.items() if k in _VJP_ATTRS}
            if cots.get("out_normed") is not None:
                vjp_kw["d_out_normed"] = cots["out_normed"]
            with self._patched("backward"):
                grads = _VJPS[op](*positional, cots.get("out"), cots.get("lse"), **keyword, **vjp_kw)
            if m.grads is not None:
                grads = m.grads(ctx, grads, named, kw)
            pairs = []  # (the native argument given, its gradient), matched by identity
            for name, arg in given.items():
                g = grads.get(name)
                if arg is None or g is None:
                    continue
                if isinstance(arg, (list, tuple)):
                    pairs += [(a, rounded(name, gi, a)) for a, gi in zip(arg, list(g))]
                else:
                    pairs.append((arg, rounded(name, g, arg)))
            return pairs

        if port._mode == "vjp":
            port._tape = tape
        return tuple(final) if len(final) > 1 else final[0]


# -- hooks ---------------------------------------------------------------------------------------
def _first(x):
    """The first source of a list / tuple / stacked argument (None when there is none)."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return x[0] if len(x) else None
    return x[0] if np.ndim(x) > 1 and np.shape(x)[0] else None


def _tokens(ctx, named) -> int:
    """The number of token positions of the call."""
    x = named.get("partial") if ctx.op == "merge_partial" else _first(named.get("sources"))
    return 0 if x is None else int(np.prod(np.shape(x)[:-1]))


def _sources(fn):
    """An `args` hook rewriting the sources (list, tuple or stacked) as fn(list of sources)."""
    def hook(ctx, named, kw):
        x = named.get("sources")
        if x is None or ctx.op == "merge_partial":
            return named, kw
        if isinstance(x, np.ndarray):
            if x.ndim < 2:
                return named, kw
            new = fn(list(x))
            return dict(named, sources=np.stack(new) if new else x[:0]), kw
        return dict(named, sources=type(x)(fn(list(x)))), kw
    return hook


def _keywords(fn):
    """An `args` hook rewriting the keyword arguments as fn(ctx, kw) -> kw."""
    return lambda ctx, named, kw: (named, fn(ctx, dict(kw)))


def _raise_if(test, exc, message):
    def hook(ctx, named, kw):
        if test(ctx, named, kw):
            raise exc(message)
        return named, kw
    return hook


def _stats_with(**change):
    """A patch of the logits' statistics (`ops._stats_unguarded`): each change a function of the
    argument it replaces."""
    def make(orig):
        def f(x, q, g, *, eps, scale, key_norm):
            kw = dict(x=x, q=q, g=g, eps=eps, scale=scale, key_norm=key_norm)
            for k, fn in change.items():
                kw[k] = fn(kw)
            return orig(kw.pop("x"), kw.pop("q"), kw.pop("g"), **kw)
        return f
    return make


def _inv_rms_with(formula):
    def make(orig):
        def f(x, eps):
            with np.errstate(all="ignore"):
                return formula(x, eps)
        return f
    return make


def _first_token_query(kw):
    q = kw["q"]
    if q.ndim > 2 and q.size:  # a per-token query [..., H, Dh]: the first token's everywhere
        return np.broadcast_to(q.reshape((-1,) + q.shape[-2:])[0], q.shape)
    return q


def _rms_over_all_heads(orig):
    def f(x, q, g, *, eps, scale, key_norm):
        r, qg, s, z = orig(x, q, g, eps=eps, scale=scale, key_norm=key_norm)
        if key_norm and x.shape[-2] > 1:  # one RMS over all D, then split into heads
            r = np.broadcast_to(ops._inv_rms(x.reshape(x.shape[:-2] + (-1,)), eps)[..., None], r.shape)
            z = scale * r * s
        return r, qg, s, z
    return f


def _weights_with(softmax=None, sigmoid=None):
    def make(orig):
        def f(z, activation):
            fn = softmax if activation == "softmax" else sigmoid
            with np.errstate(all="ignore"):
                return orig(z, activation) if fn is None else fn(orig, z)
        return f
    return make


def _global_max(orig, z):
    m = np.nanmax(z) if np.any(np.isfinite(z)) else 0.0  # one max for every token
    e = np.exp(z - m)
    return e / np.sum(e, axis=0, keepdims=True)


def _lse_missing_max(orig):
    def f(z):
        m = np.max(z, axis=0)
        with np.errstate(all="ignore"):
            return np.log(np.sum(np.exp(z - m[None]), axis=0))  # m never added back
    return f


def _lse_no_max(orig):
    def f(z):
        with np.errstate(all="ignore"):
            return np.log(np.sum(np.exp(z), axis=0))
    return f


def _out_norm_half(orig):
    def f(out, eps_o):
        d = out.shape[-1]
        rho = ops._inv_rms(out[..., :max(d // 2, 1)], eps_o)  # a per-head norm (H = 2)
        return rho, rho[..., None] * out
    return f


def _merge_w2_one_minus_w1(orig):
    def f(*a):
        res = list(orig(*a))
        res[-1] = 1.0 - res[-2]  # w2 = 1 - w1: loses w2's bits when lse1 - z2 >> 1
        return tuple(res)
    return f


def _nan_to_num(ctx, named, kw):
    fix = lambda a: None if a is None else np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)  # noqa: E731
    return {k: (type(v)(fix(a) for a in v) if isinstance(v, (list, tuple)) else fix(v))
            for k, v in named.items()}, kw


def _cast_sources(ctx, named, kw):
    x = named.get("sources")
    if isinstance(x, (list, tuple)) and x:
        dt = next((a.dtype for a in x if a.dtype.kind == "f"), np.float64)
        named = dict(named, sources=type(x)(a.astype(dt) for a in x))
    return named, kw


def _write_query(ctx, named, kw):
    q = named.get("query")
    if isinstance(q, np.ndarray) and q.dtype.kind == "f" and q.size and q.flags.writeable:
        np.multiply(q, 1.0 + 2.0 ** -20, out=q)  # an in-place "pre-scale" of the query
    return named, kw


def _alias_at_n1(ctx, outs, named, kw):
    x = named.get("sources")
    if ctx.op == "depth_attention" and isinstance(x, (list, tuple)) and len(x) == 1 \
            and kw.get("activation", "softmax") == "softmax":
        outs = dict(outs, out=x[0])  # C6 says equal; C7a says a fresh array
    return outs


def _weights_off(ctx, outs, named, kw):
    if "weights" in outs:
        w = np.asarray(outs["weights"])
        outs = dict(outs, weights=w * (1.0 + 1e-3 * (w.shape[0] > 1)))
    return outs


def _out_normed_without_gain(ctx, outs, named, kw):
    w = named.get("out_norm_weight")
    if "out_normed" in outs and w is not None:
        with np.errstate(all="ignore"):
            outs = dict(outs, out_normed=np.asarray(outs["out_normed"]) / np.where(w == 0, 1, w))
    return outs


def _merge_lse_without_partial(ctx, outs, named, kw):
    if ctx.op == "merge_partial" and "lse" in outs:
        outs = dict(outs, lse=np.asarray(named["lse1"], np.float64).copy())
    return outs


def _multi_first_gain(ctx, named, kw):
    g = named.get("norm_weights")
    if ctx.op == "depth_attention_multi" and g is not None and np.ndim(g) == 2:
        named = dict(named, norm_weights=np.broadcast_to(g[:1], g.shape).copy())
    return named, kw


def _drop_cot(name):
    return lambda ctx, cots, named, kw: dict(cots, **{name: None}) if name in cots else cots


def _grads_zero(name):
    def hook(ctx, grads, named, kw):
        if grads.get(name) is not None:
            grads = dict(grads, **{name: np.zeros_like(np.asarray(grads[name]))})
        return grads
    return hook


def _d_query_mean(ctx, grads, named, kw):
    q = named.get("query")
    t = _tokens(ctx, named)
    if grads.get("query") is not None and np.ndim(q) == 1 and t > 1:
        grads = dict(grads, query=np.asarray(grads["query"]) / t)  # a mean over tokens, not a sum
    return grads


def _noise(when, on="grads", size=1e-15):
    """Results that differ by `size` (relative) between two calls (an unordered reduction)."""
    def hook(ctx, results, named, kw):
        if not when(ctx, named):
            return results
        key = "noise_" + on
        ctx.port.memo[key] = ctx.port.memo.get(key, 0) + 1
        wobble = 1.0 + size * (ctx.port.memo[key] % 2)
        name = "sources" if on == "grads" else "out"
        v = results.get(name)
        if isinstance(v, (list, tuple)):
            return dict(results, **{name: [np.asarray(a) * wobble for a in v]})
        return results if v is None else dict(results, **{name: np.asarray(v) * wobble})
    return hook


def _large_t(ctx, named):
    return _tokens(ctx, named) > 4096


def _wrap_errors(kind):
    """The port wraps the reference's errors: a generic message, or another exception type."""
    def hook(ctx, named, kw):
        return named, dict(kw, _wrap=kind)
    return hook



# -- hooks of the transforms' mutants (issue 44 item 1) ------------------------------------------
def _owner(x: np.ndarray) -> np.ndarray:
    while isinstance(x.base, np.ndarray):
        x = x.base
    return x


def _raw(x, keep_offset: bool = True):
    """`x` as a kernel that takes its data pointer and assumes C-contiguous rows reads it (from
    the view's first element, or with `keep_offset=False` from its buffer's start)."""
    if not isinstance(x, np.ndarray) or x.base is None or x.size == 0:
        return x
    owner = _owner(x)
    flat = np.ascontiguousarray(owner).reshape(-1)
    start = 0
    if keep_offset:
        start = (x.__array_interface__["data"][0] - owner.__array_interface__["data"][0]) // x.itemsize
    vals = flat[start:start + x.size]
    if vals.size < x.size:
        vals = np.concatenate([vals, np.zeros(x.size - vals.size, vals.dtype)])
    return vals.reshape(x.shape).copy()


def _each(named, fn, names=None):
    out = {}
    for k, v in named.items():
        if names is not None and k not in names:
            out[k] = v
        elif isinstance(v, (list, tuple)):
            out[k] = type(v)(fn(a) for a in v)
        else:
            out[k] = fn(v)
    return out


def _rows_assumed_contiguous(ctx, named, kw):
    """`.contiguous()` only when the channel stride is not 1: other strides read as C order."""
    def fix(x):
        if isinstance(x, np.ndarray) and x.ndim >= 2 and x.strides[-1] == x.itemsize and not x.flags.c_contiguous \
                and all(st != 0 for st in x.strides):
            return _raw(x)
        return x
    return _each(named, fix), kw


def _offset_ignored(ctx, named, kw):
    """A contiguous view read from its buffer's start (the storage's pointer, not the view's)."""
    def fix(x):
        if isinstance(x, np.ndarray) and x.flags.c_contiguous and x.base is not None and \
                x.__array_interface__["data"][0] != _owner(x).__array_interface__["data"][0]:
            return _raw(x, keep_offset=False)
        return x
    return _each(named, fix), kw


def _strides_ignored(name, op=None, ndim=1):
    def hook(ctx, named, kw):
        x = named.get(name)
        if (op is None or ctx.op == op) and isinstance(x, np.ndarray) and x.ndim >= ndim and not x.flags.c_contiguous:
            named = dict(named, **{name: _raw(x)})
        return named, kw
    return hook


def _expanded_as_static(ctx, named, kw):
    q = named.get("query")
    if isinstance(q, np.ndarray) and q.ndim > 1 and q.size and all(st == 0 for st in q.strides[:-1]):
        named = dict(named, query=np.array(q.reshape((-1, q.shape[-1]))[0]))  # the static fast path
    return named, kw


def _mixed_gain_rejected(ctx, named, kw):
    g = named.get("norm_weights" if ctx.op == "depth_attention_multi" else "norm_weight")
    src = named.get("partial") if ctx.op == "merge_partial" else _first(named.get("sources"))
    if isinstance(g, np.ndarray) and src is not None and g.dtype.kind == "f" and np.asarray(src).dtype.kind == "f" \
            and g.dtype != np.asarray(src).dtype:
        raise TypeError("norm_weight: dtype must equal the sources' dtype")
    return named, kw


def _decode_first_row(kw):
    q = kw["q"]
    if q.ndim >= 4 and q.shape[-3] == 1 and q.size:  # [B, 1, H, Dh]: the batch-1 decode path
        return np.broadcast_to(q.reshape((-1,) + q.shape[-2:])[0], q.shape)
    return q


def _scalar_lse1_rejected(ctx, named, kw):
    if ctx.op == "merge_partial" and isinstance(named.get("lse1"), np.ndarray) and named["lse1"].ndim == 0:
        raise ValueError("lse1: expected at least one token axis")
    return named, kw


def _zero_query_fast_path(ctx, grads, named, kw):
    q = named.get("queries" if ctx.op == "depth_attention_multi" else "query")
    if isinstance(q, np.ndarray) and q.size and not np.any(q):  # uniform weights, "nothing to learn"
        for name in ("query", "queries", "norm_weight", "norm_weights"):
            if grads.get(name) is not None:
                grads = dict(grads, **{name: np.zeros_like(np.asarray(grads[name]))})
    return grads


def _negative_scale_max_of_s():
    """The max subtracted is scale * max(s): the min of z when scale < 0 (overflow at large logits)."""
    state = {"scale": 1.0}

    def stats(orig):
        def f(x, q, g, *, eps, scale, key_norm):
            state["scale"] = scale
            return orig(x, q, g, eps=eps, scale=scale, key_norm=key_norm)
        return f

    def weights(orig):
        def f(z, activation):
            if activation != "softmax" or state["scale"] >= 0:
                return orig(z, activation)
            with np.errstate(all="ignore"):
                e = np.exp(z - np.min(z, axis=0, keepdims=True))
                return e / np.sum(e, axis=0, keepdims=True)
        return f

    def lse(orig):
        def f(z):
            if state["scale"] >= 0:
                return orig(z)
            m = np.min(z, axis=0)
            with np.errstate(all="ignore"):
                return m + np.log(np.sum(np.exp(z - m[None]), axis=0))
        return f

    return (("_stats_unguarded", stats), ("_weights", weights), ("_lse", lse))


def _out_norm_nan_guard(orig):
    def f(out, eps_o):
        return orig(np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0), eps_o)  # "guards" the norm
    return f



def _broadcast_cotangents(ctx, cots, named, kw):
    """Cotangents broadcast to their output's shape before the VJP (a silent broadcast)."""
    shapes = ctx.port.memo.get("out_shapes", {})

    def fit(k, v):
        if v is None or k not in shapes or v.shape == shapes[k]:
            return v
        try:
            return np.broadcast_to(v, shapes[k]).copy()
        except ValueError:
            return v  # not broadcastable: the reference's own check names it
    return {k: fit(k, v) for k, v in cots.items()}


def _unclear_cotangent_error(ctx, cots, named, kw):
    shapes = ctx.port.memo.get("out_shapes", {})
    if any(v is not None and k in shapes and v.shape != shapes[k] for k, v in cots.items()):
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    return cots



def _signature(ctx, named):
    x = named.get("partial") if ctx.op == "merge_partial" else named.get("sources")
    first = x[0] if isinstance(x, (list, tuple)) and len(x) else x
    return (ctx.op, np.shape(first), _dtype(first) if first is not None else None,
            len(x) if isinstance(x, (list, tuple)) else None)


def _plan_cache_skips_checks(ctx, named, kw):
    """A per-signature plan cache: after a successful call, a repeat skips the scalar checks."""
    if _signature(ctx, named) in ctx.port.memo.get("plans", set()):
        kw = dict(kw)
        if "eps" in kw and not (isinstance(kw["eps"], float) and kw["eps"] > 0):
            kw["eps"] = 1e-6
        if "scale" in kw and not (isinstance(kw["scale"], float) and np.isfinite(kw["scale"])):
            kw["scale"] = 1.0
    ctx.port.memo.setdefault("pending", []).append(_signature(ctx, named))
    return named, kw


def _plan_recorded(ctx, outs, named, kw):
    ctx.port.memo.setdefault("plans", set()).add(_signature(ctx, named))
    return outs


def _scale_baked_in(ctx, named, kw):
    """The logit scale baked into a per-signature plan by its first call."""
    plans = ctx.port.memo.setdefault("scales", {})
    if isinstance(kw.get("scale"), float) and np.isfinite(kw["scale"]):
        kw = dict(kw, scale=plans.setdefault(_signature(ctx, named), kw["scale"]))
    return named, kw


def _in_forward(hook):
    """`hook` in the forward-only program only (a call without cotangents)."""
    return lambda ctx, named, kw: hook(ctx, named, kw) if ctx.mode == "forward" else (named, kw)


def _first_token_query_arg(ctx, named, kw):
    q = named.get("query")
    if isinstance(q, np.ndarray) and q.ndim > 1 and q.size:
        named = dict(named, query=np.broadcast_to(q.reshape((-1, q.shape[-1]))[0], q.shape).copy())
    return named, kw



def _widest_of(*dtypes) -> str:
    return max((d for d in dtypes if d is not None), key=("bfloat16", "float16", "float32", "float64").index)


def _autocast_first_dtype(ctx, named, kw):
    """C3a done wrong: under autocast the sources are cast to the first one's dtype, not the widest."""
    x = named.get("sources")
    if ctx.port.region is not None and isinstance(x, (list, tuple)) and x:
        named = dict(named, sources=type(x)(a.astype(x[0].dtype) for a in x))
    return named, kw


MUTANTS: List[Mutant] = [
    # -- the forward's math (2.1) -----------------------------------------------------------------
    Mutant("eps_outside_sqrt", "2.1", "forward", "r = 1 / (sqrt(mean x^2) + eps)",
           patch=(("_inv_rms", _inv_rms_with(lambda x, e: 1.0 / (np.sqrt(np.mean(x * x, -1)) + e))),)),
    Mutant("rms_sum_not_mean", "2.1", "forward", "the key norm's sum of squares not divided by D",
           patch=(("_inv_rms", _inv_rms_with(lambda x, e: 1.0 / np.sqrt(np.sum(x * x, -1) + e))),)),
    Mutant("rms_over_all_heads", "4.11, 2.1", "forward", "one key-norm RMS over all D, not per head",
           patch=(("_stats_unguarded", _rms_over_all_heads),)),
    Mutant("abs_scale", "2.1, C8", "forward", "a negative logit scale taken as its absolute value",
           patch=(("_stats_unguarded", _stats_with(scale=lambda k: abs(k["scale"]))),)),
    Mutant("gain_dropped", "2.1, C5", "forward", "norm_weight accepted and ignored",
           patch=(("_stats_unguarded", _stats_with(g=lambda k: np.ones_like(k["g"]))),)),
    Mutant("key_norm_always", "C9, 4.10", "forward", "key_norm=False ignored: keys always normalized",
           patch=(("_stats_unguarded", _stats_with(key_norm=lambda k: True)),)),
    Mutant("first_token_query", "C4", "forward", "a per-token query read at its first token only",
           patch=(("_stats_unguarded", _stats_with(q=_first_token_query)),)),
    Mutant("sigmoid_normalized", "2.1, C9", "forward", "sigmoid weights renormalized to sum to 1",
           patch=(("_weights", _weights_with(sigmoid=lambda o, z: o(z, "sigmoid") / np.sum(
               o(z, "sigmoid"), axis=0, keepdims=True))),)),
    Mutant("sigmoid_as_softmax", "2.1, C9", "forward", "activation='sigmoid' computes a softmax",
           patch=(("_weights", _weights_with(sigmoid=lambda o, z: o(z, "softmax"))),)),
    Mutant("lse_without_max", "2.1", "forward", "lse = log sum exp(z - m), m never added back",
           patch=(("_lse", _lse_missing_max),)),
    Mutant("eps_ignored", "2.1, C8", "forward", "eps fixed at 1e-6 whatever the call says",
           args=_keywords(lambda ctx, kw: dict(kw, eps=1e-6) if isinstance(kw.get("eps"), float) and kw["eps"] > 0
                          else kw)),
    Mutant("out_norm_half", "C17", "forward", "the output norm's RMS over the first half of D (per head)",
           patch=(("_out_norm", _out_norm_half),)),
    Mutant("out_norm_eps_ignored", "C17", "forward", "out_norm_eps ignored (the key norm's eps used)",
           args=lambda ctx, n, kw: (n, {k: v for k, v in kw.items() if k != "out_norm_eps"
                                        or n.get("out_norm_weight") is None})),
    Mutant("out_normed_without_gain", "C17", "forward", "out_normed without out_norm_weight's gain",
           outputs=_out_normed_without_gain),
    Mutant("merge_ignores_eps_scale", "3.2", "forward", "merge_partial computes at eps = 1e-6, scale = 1",
           args=_keywords(lambda ctx, kw: dict(kw, eps=1e-6, scale=1.0) if ctx.op == "merge_partial"
                          and all(isinstance(kw.get(k, 1.0), float) and np.isfinite(kw.get(k, 1.0))
                                  for k in ("eps", "scale")) and kw.get("eps", 1.0) > 0 else kw)),
    Mutant("merge_lse_without_partial", "3.2", "forward", "merge's lse returns lse1 (the partial's term lost)",
           outputs=_merge_lse_without_partial),
    Mutant("multi_first_gain", "3.1", "forward", "phase 1 applies the first query's gain to every query",
           args=_multi_first_gain),
    Mutant("weights_off", "C11", "forward", "weights from a separate pass, off by 0.1 %", outputs=_weights_off),
    # -- numerics (2.4) ---------------------------------------------------------------------------
    Mutant("no_max_subtraction", "C10.4", "numerics", "softmax and lse without max subtraction",
           patch=(("_weights", _weights_with(softmax=lambda o, z: np.exp(z) / np.sum(np.exp(z), 0, keepdims=True))),
                  ("_lse", _lse_no_max))),
    Mutant("global_max", "C10.4, C12", "numerics", "one max over every token (underflow; non-finite spreads)",
           patch=(("_weights", _weights_with(softmax=_global_max)),)),
    Mutant("key_norm_f32_sum", "C10.6", "numerics", "the key norm's mean square summed in float32, unscaled",
           patch=(("_inv_rms", _inv_rms_with(lambda x, e: 1.0 / np.sqrt(np.mean(
               np.float32(x) ** 2, -1, dtype=np.float32).astype(np.float64) + e))),)),
    Mutant("merge_w2_one_minus_w1", "C10.7", "numerics", "merge's w2 = 1 - w1",
           patch=(("_merge_prepare", _merge_w2_one_minus_w1),)),
    # -- sizes (C16) ------------------------------------------------------------------------------
    Mutant("drop_past_32", "C16", "sizes", "every source past 32 silently dropped", args=_sources(lambda xs: xs[:32])),
    Mutant("drop_past_128", "C16", "sizes", "every source past 128 silently dropped",
           args=_sources(lambda xs: xs[:128])),
    Mutant("empty_tokens_rejected", "C2", "shapes", "an empty token axis raises",
           args=_raise_if(lambda ctx, n, kw: _tokens(ctx, n) == 0 and _first(n.get("sources", n.get("partial")))
                          is not None, ValueError, "sources: empty token axis")),
    Mutant("tuple_sources_rejected", "C1", "shapes", "tuple sources raise a TypeError",
           args=_raise_if(lambda ctx, n, kw: isinstance(n.get("sources"), tuple), TypeError,
                          "sources: expected a list")),
    # -- non-finite values (C12) ------------------------------------------------------------------
    Mutant("nan_to_num", "C12", "non-finite", "NaN / Inf inputs replaced by 0", args=_nan_to_num),
    # -- the backward (2.3) -----------------------------------------------------------------------
    Mutant("d_lse_ignored", "2.3", "gradient", "the lse cotangent never reaches dz", cotangents=_drop_cot("lse")),
    Mutant("d_out_normed_ignored", "C17", "gradient", "the out_normed cotangent ignored",
           cotangents=_drop_cot("out_normed")),
    Mutant("d_norm_weight_zero", "2.3", "gradient", "no gradient for the gain (held constant)",
           grads=_grads_zero("norm_weight")),
    Mutant("d_out_norm_weight_zero", "C17", "gradient", "no gradient for the output norm's gain",
           grads=_grads_zero("out_norm_weight")),
    Mutant("d_lse1_zero", "3.2", "gradient", "merge_partial returns no gradient for lse1", grads=_grads_zero("lse1")),
    Mutant("d_query_mean", "2.3", "gradient", "d_query of a [D] query averaged over tokens, not summed",
           grads=_d_query_mean),
    Mutant("recompute_without_gain", "2.3, 2.4.8", "gradient", "the backward recomputes the logits without the gain",
           patch=(("_stats_unguarded", _stats_with(g=lambda k: np.ones_like(k["g"]))),), patch_in="backward"),
    Mutant("recompute_default_eps", "2.3, 2.4.8", "gradient", "the backward recomputes the key norm at eps = 1e-6",
           patch=(("_inv_rms", lambda orig: lambda x, eps: orig(x, 1e-6)),), patch_in="backward"),
    # -- the result contract (C7, C7a, C10.1, C10.3) ----------------------------------------------
    Mutant("alias_at_n1", "C7a", "contract", "N = 1 returns the source object itself", outputs=_alias_at_n1),
    Mutant("query_written", "C7", "contract", "the query pre-scaled in place", args=_write_query),
    Mutant("lse_in_float16", "C10.3", "contract", "lse and weights rounded to float16",
           cast=lambda ctx, name, v, dt: "float16" if name in ("lse", "weights") else dt),
    Mutant("out_in_float64", "C10.3", "contract", "out returned float64 (never rounded back)",
           cast=lambda ctx, name, v, dt: "float64" if name == "out" else dt),
    Mutant("d_query_in_sources_dtype", "C10.3", "contract", "the query's gradient in the sources' dtype",
           cast=lambda ctx, name, v, dt: ctx.port.memo.get("source_dtype", dt) if name == "grad.query" else dt),
    Mutant("query_dtype_rejected", "C10.1", "contract", "a query of another dtype than the sources raises",
           args=_raise_if(lambda ctx, n, kw: ctx.op == "depth_attention" and isinstance(n.get("query"), np.ndarray)
                          and _first(n.get("sources")) is not None and n["query"].dtype.kind == "f"
                          and np.asarray(_first(n["sources"])).dtype.kind == "f"
                          and n["query"].dtype != np.asarray(_first(n["sources"])).dtype, TypeError,
                          "query: dtype differs from the sources'")),
    # -- validation (section 7) -------------------------------------------------------------------
    Mutant("eps_clamped", "C8", "validation", "eps <= 0 or NaN clamped to 1e-6 instead of a ValueError",
           args=_keywords(lambda ctx, kw: {k: (1e-6 if k in ("eps", "out_norm_eps") and isinstance(v, float)
                                               and not v > 0 else v) for k, v in kw.items()})),
    Mutant("int_sources_cast", "C3", "validation", "int / mixed-dtype sources cast instead of a TypeError",
           args=_cast_sources),
    Mutant("heads_floor", "C9", "validation", "num_heads that does not divide D falls back to one head",
           args=lambda ctx, n, kw: (n, dict(kw, num_heads=1) if isinstance(kw.get("num_heads"), int)
                                    and _first(n.get("sources")) is not None and kw["num_heads"] > 0
                                    and np.shape(_first(n["sources"]))[-1] % kw["num_heads"] else kw)),
    Mutant("unknown_activation_softmax", "C9", "validation", "an unknown activation computes a softmax",
           args=_keywords(lambda ctx, kw: dict(kw, activation="softmax") if kw.get("activation") not in
                          (None, "softmax", "sigmoid") else kw)),
    Mutant("key_norm_truthy", "C9", "validation", "key_norm=1 accepted as True",
           args=_keywords(lambda ctx, kw: dict(kw, key_norm=bool(kw["key_norm"])) if "key_norm" in kw else kw)),
    Mutant("generic_error_message", "7", "validation", "errors re-raised without the argument's name",
           args=_wrap_errors("message")),
    Mutant("errors_as_runtime_error", "7", "validation", "errors re-raised as RuntimeError",
           args=_wrap_errors("type")),
    # -- determinism (C15) ------------------------------------------------------------------------
    Mutant("nondeterministic_backward", "C15", "determinism", "d_sources differs by 1e-15 between calls",
           grads=_noise(lambda ctx, named: True)),
    Mutant("nondeterministic_backward_large_t", "C15", "determinism",
           "d_sources differs between calls past 4096 positions (a split reduction)", grads=_noise(_large_t, size=2.0 ** -20)),
    Mutant("nondeterministic_forward_large_t", "C15", "determinism", "out differs between calls past 4096 positions",
           outputs=_noise(_large_t, on="outputs", size=2.0 ** -20)),
    # -- the transforms' categories (issue 44 item 1): each must be killed by its transform ---------
    Mutant("rows_assumed_contiguous", "2.2", "layouts", "`.contiguous()` only when the channel stride is not 1",
           args=_rows_assumed_contiguous, first=("transforms/token_strided", "transforms/source_strided",
                                                 "transforms/transposed"), must_kill=True),
    Mutant("storage_offset_ignored", "2.2", "layouts", "a view read from its storage's start, not its offset",
           args=_offset_ignored, first=("transforms/offset",), must_kill=True),
    Mutant("out_norm_weight_strides_ignored", "C17, 2.2", "layouts", "a strided out_norm_weight read as contiguous",
           args=_strides_ignored("out_norm_weight"), first=("transforms/channel_strided",), must_kill=True),
    Mutant("merge_token_query_strides_ignored", "C4, 2.2", "layouts",
           "merge_partial reads a strided per-token query as contiguous",
           args=_strides_ignored("query", "merge_partial", ndim=2),
           first=("transforms/channel_strided", "transforms/token_strided"), must_kill=True),
    Mutant("expanded_query_as_static", "C4", "layouts", "a stride-0 per-token query takes the static-query path",
           args=_expanded_as_static, first=("transforms/expanded",), must_kill=True),
    Mutant("mixed_gain_rejected", "C10.1", "dtypes", "a gain of another dtype than the sources raises",
           args=_mixed_gain_rejected, first=("transforms/gain_dtype",), must_kill=True),
    Mutant("d_norm_weight_in_sources_dtype", "C10.3", "dtypes", "the gain's gradient in the sources' dtype",
           cast=lambda ctx, name, v, dt: ctx.port.memo.get("source_dtype", dt)
           if name in ("grad.norm_weight", "grad.norm_weights") else dt,
           first=("transforms/gain_dtype",), must_kill=True),
    Mutant("d_lse1_in_partial_dtype", "C10.3, C14", "dtypes", "lse1's gradient in the partial's dtype",
           cast=lambda ctx, name, v, dt: ctx.port.memo.get("source_dtype", dt) if name == "grad.lse1" else dt,
           first=("transforms/lse1_dtype",), must_kill=True),
    Mutant("decode_query_first_row", "C4", "batch shapes", "a [B, 1, D] query read as batch 1 (its first row)",
           patch=(("_stats_unguarded", _stats_with(q=_decode_first_row)),), first=("transforms/decode_batch",),
           must_kill=True),
    Mutant("merge_scalar_lse1_rejected", "C2, C14", "batch shapes", "merge_partial without token axes raises",
           args=_scalar_lse1_rejected, first=("transforms/no_token_axes",), must_kill=True),
    Mutant("cotangents_broadcast", "2.3", "cotangents", "a cotangent broadcast silently to its output's shape",
           cotangents=_broadcast_cotangents, first=("cotangents/",), must_kill=True),
    Mutant("unclear_cotangent_error", "2.3, 7", "cotangents",
           "a wrong-shaped cotangent fails deep in the backward with an error that names nothing",
           cotangents=_unclear_cotangent_error, first=("cotangents/",), must_kill=True),
    Mutant("plan_cache_skips_checks", "C8, 7", "sequences",
           "a per-signature plan cache skips the eps / scale checks after a successful call",
           args=_plan_cache_skips_checks, outputs=_plan_recorded, first=("sequences/",), must_kill=True),
    Mutant("scale_baked_in_plan", "C8, M10", "sequences", "the first call's scale baked into a per-signature plan",
           args=_scale_baked_in, first=("sequences/",), must_kill=True),
    Mutant("forward_only_first_token_query", "C4", "forward-only",
           "the forward-only program reads a per-token query at its first token",
           args=_in_forward(_first_token_query_arg), port_attrs=(("forward_in_gradient_call", True),),
           first=("depth_attention/forward_only", "merge_partial/forward_only"), must_kill=True),
    Mutant("forward_only_out_norm_eps_ignored", "C17", "forward-only", "the forward-only program ignores out_norm_eps",
           args=_in_forward(lambda ctx, n, kw: (n, {k: v for k, v in kw.items() if k != "out_norm_eps"
                                                    or n.get("out_norm_weight") is None})),
           port_attrs=(("forward_in_gradient_call", True),), first=("depth_attention/forward_only",),
           must_kill=True),
    Mutant("forward_only_sigmoid_as_softmax", "C9", "forward-only",
           "the forward-only program computes a softmax for activation='sigmoid'",
           args=_in_forward(lambda ctx, n, kw: (n, dict(kw, activation="softmax") if kw.get("activation") == "sigmoid"
                                                else kw)),
           port_attrs=(("forward_in_gradient_call", True),), first=("depth_attention/forward_only",),
           must_kill=True),
    Mutant("out_norm_eps_defaults_1e-6", "C17", "combinations",
           "without out_norm_eps the output norm uses 1e-6, not the key norm's eps",
           args=lambda ctx, n, kw: (n, dict(kw, out_norm_eps=1e-6) if n.get("out_norm_weight") is not None
                                    and "out_norm_eps" not in kw else kw),
           first=("covering/",), must_kill=True),
    Mutant("sigmoid_ignores_scale", "2.1, C9", "combinations", "the sigmoid path ignores the logit scale",
           args=_keywords(lambda ctx, kw: dict(kw, scale=1.0) if kw.get("activation") == "sigmoid"
                          and isinstance(kw.get("scale"), float) and np.isfinite(kw["scale"]) else kw),
           first=("covering/",), must_kill=True),
    Mutant("autocast_first_source_dtype", "C3a", "autocast",
           "inside autocast, mixed sources cast to the first source's dtype instead of the widest",
           args=_autocast_first_dtype, first=("autocast/",), must_kill=True),
    Mutant("stream_in_sublayer_dtype", "M1a", "stream dtype",
           "the residual stream (and out) takes the dtype its sublayers return, not the embedding's",
           stream=lambda call: getattr(call, "sublayer_dtype", None) or call.dtype,
           first=("probe/sublayer_dtype",), must_kill=True),
    Mutant("stream_widest_dtype", "M1a", "stream dtype",
           "the stream promotes to the widest dtype seen (the embedding's or a sublayer's)",
           stream=lambda call: _widest_of(call.dtype, getattr(call, "sublayer_dtype", None)),
           first=("probe/sublayer_dtype",), must_kill=True),
    Mutant("scale_or_one", "C8, M10", "special values", "`scale or 1.0`: a scale of 0 computes at scale 1",
           args=_keywords(lambda ctx, kw: dict(kw, scale=kw["scale"] or 1.0) if "scale" in kw else kw),
           first=("transforms/scale_zero",), must_kill=True),
    Mutant("zero_query_fast_path", "M8, 2.3", "special values",
           "a zero query's uniform-weights fast path returns zero query / gain gradients",
           grads=_zero_query_fast_path, first=("transforms/zero_query",), must_kill=True),
    Mutant("negative_scale_max_of_s", "C10.4", "special values",
           "the max subtracted is scale * max(s): the min of z for a negative scale",
           patch=_negative_scale_max_of_s(), first=("transforms/negative_scale_large_logits",), must_kill=True),
    Mutant("out_norm_nan_guard", "C12, C17", "special values", "the output norm computed from nan_to_num(out)",
           patch=(("_out_norm", _out_norm_nan_guard),), first=("transforms/nonfinite_every_output",),
           must_kill=True),
]


# -- the harness -----------------------------------------------------------------------------------
#: Survivors we accept, each with the reason (a surviving mutant not named here fails CI).
ACCEPTED: Dict[str, str] = {}
#: The latest `run_mutants` result in this process (pytest's terminal summary prints it).
last_score: Optional["Score"] = None
#: The score CI requires.
REQUIRED_SCORE = 0.95


@dataclass
class MutantResult:
    mutant: Mutant
    killed_by: Optional[str]
    message: str = ""
    cases_run: int = 0
    seconds: float = 0.0

    @property
    def killed(self) -> bool:
        return self.killed_by is not None


@dataclass
class Score:
    results: List[MutantResult] = field(default_factory=list)
    control: Optional[str] = None  # the honest port's first failing case (None: it passed)
    seconds: float = 0.0

    @property
    def killed(self) -> int:
        return sum(r.killed for r in self.results)

    @property
    def fraction(self) -> float:
        return self.killed / len(self.results) if self.results else 0.0

    @property
    def survivors(self) -> List[str]:
        return [r.mutant.name for r in self.results if not r.killed]

    def text(self, verbose: bool = False) -> str:
        lines = [f"mutation score: {self.killed}/{len(self.results)} killed ({100 * self.fraction:.1f} %), "
                 f"{self.seconds:.1f} s; honest control: {'passed' if self.control is None else 'FAILED at ' + self.control}"]
        for r in self.results:
            status = f"killed by {r.killed_by}" if r.killed else "SURVIVED" + (
                f" (accepted: {ACCEPTED[r.mutant.name]})" if r.mutant.name in ACCEPTED else "")
            lines.append(f"  {r.mutant.name:34s} {r.mutant.rule:12s} {r.mutant.category:15s} {status}")
            if verbose and r.message:
                lines.append(f"      {r.message[:240]}")
        if self.survivors:
            lines.append("survivors: " + ", ".join(self.survivors))
        return "\n".join(lines)


#: A failure message that means a hook of the harness crashed, not that the suite caught a defect.
_HARNESS_ERROR = re.compile(r"raised (IndexError|KeyError|AttributeError|NameError|UnboundLocalError|"
                            r"AssertionError|ZeroDivisionError|IndentationError)")


def _cost(case) -> float:
    """A rough cost of a case: cheap families first (errors, small shapes), large sizes last."""
    if case.kind == "error":
        return 0.0
    kw = case.spec.get("kwargs", {}) if isinstance(case.spec, dict) else {}
    n = kw.get("n", 2) * kw.get("s", 1)
    t = int(np.prod(kw.get("tokens", (1,)) or (1,)))
    cost = float(n * max(t, 1) * kw.get("dim", 8))
    if case.kind == "determinism":
        cost *= 4
    if case.kind == "golden":
        cost = 2000.0
    if case.kind == "probe":  # a whole network: after the op rows (the M1a mutants run theirs first)
        cost = 1000.0
    return cost


def suite_cases(port: Optional[ReferencePort] = None, *, quick: bool = False) -> list:
    """The suite's cases for the reference port (fitted to its capabilities), cheapest first."""
    from . import cases as cases_mod

    port = port or ReferencePort()
    caps = port.capabilities()
    cases = cases_mod.generate(dtypes=caps.dtypes, quick=quick, caps=caps)
    return sorted(cases, key=_cost)


def run_one(mutant: Mutant, cases: Sequence, *, stop_at_first: bool = True) -> MutantResult:
    """Run `cases` on the port carrying `mutant`; killed at the first failing case."""
    from .runner import run_case

    port = ReferencePort(mutant)
    caps = port.capabilities()
    start = time.monotonic()
    ordered = list(cases)
    if mutant.first:
        head = [c for c in ordered if c.id.startswith(mutant.first)]
        ordered = head + [c for c in ordered if not c.id.startswith(mutant.first)]
    run = 0
    for case in ordered:
        result = run_case(port, case, "cpu", spec=f"attnres_conformance.mutants:{mutant.name}", caps=caps)
        run += result.status != "skip"
        if result.failed or result.status == "gap":
            message = "; ".join(c.message for c in result.cells if c.status in ("fail", "xpass", "gap"))
            if _HARNESS_ERROR.search(message):  # a hook of the harness crashed: not a kill
                return MutantResult(mutant, None, f"harness error at {case.id}: {message[:300]}", run,
                                    time.monotonic() - start)
            return MutantResult(mutant, case.id, message[:300], run, time.monotonic() - start)
    return MutantResult(mutant, None, "", run, time.monotonic() - start)


def run_mutants(mutants: Sequence[Mutant] = None, *, quick: bool = False,
                progress: Optional[Callable[[str], None]] = None) -> Score:
    """The honest control on every case, then each mutant until its first failing case."""
    start = time.monotonic()
    mutants = MUTANTS if mutants is None else list(mutants)
    cases = suite_cases(quick=quick)
    control = run_one(HONEST, cases)
    score = Score(control=control.killed_by)
    for m in mutants:
        r = run_one(m, cases)
        score.results.append(r)
        if progress is not None:
            progress(f"{m.name}: {'killed by ' + r.killed_by if r.killed else 'SURVIVED'} ({r.seconds:.1f} s)")
    score.seconds = time.monotonic() - start
    global last_score
    last_score = score
    return score


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attnres_conformance.mutants", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the --quick grid only")
    parser.add_argument("--only", nargs="*", help="these mutants only")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each mutant as it finishes")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    score = run_mutants(chosen, quick=args.quick,
                        progress=(lambda s: print(s, file=sys.stderr)) if args.verbose else None)
    print(score.text(args.verbose))
    bad = [s for s in score.survivors if s not in ACCEPTED]
    return 0 if score.control is None and not bad and score.fraction >= REQUIRED_SCORE else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ACCEPTED", "HONEST", "MUTANTS", "Ctx", "Mutant", "MutantResult", "ReferencePort", "Score",
           "main", "run_mutants", "run_one", "suite_cases"]
