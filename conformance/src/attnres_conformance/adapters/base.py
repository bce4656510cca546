"""`Adapter`: the suite's one implementation of `Backend.call_op` / `call_probe`.

A framework subclasses it and supplies a few primitives (array-api-tests / einops backend-class
style); everything else is written once here: building the inputs (dtype overrides, list /
tuple / stacked sources, strided views), naming the outputs, flattening and unflattening the
gradients, reading results and inputs back to NumPy, `native_dtypes` and `aliases` (C7a, C10.3).

Primitives (see each method): `array`, `to_numpy`, `dtype_name`, `vjp`, and `versions`; the
framework bases `adapters.torch` / `adapters.jax` / `adapters.mlx` supply them and import no
AttnRes port.  A port's adapter then declares `capabilities()` and the ops: either `ops` (a module
or object with `depth_attention`, `depth_attention_multi`, `merge_partial`) or those methods on
the adapter itself, each called with the spec's arguments (positional `sources, query,
norm_weight`, keyword `eps`, `scale`, `num_heads`, ... as declared; see `backend.OpCall`).
Optional: `arg_names` (the port's own names of the spec's arguments, for error messages),
`environment()` (variables its reproducers need), `probe`, `shares_memory`, `context`,
`implementations_used`, `shard_group(dtype)` (cases that `--shards` keeps in one process,
`runner.shard_positions`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backend import OPS, Capabilities, OpCall, OpResult, ProbeCall, ProbeResult

#: The positional arguments of each op, in the spec's order.
ARG_ORDER = {"depth_attention": ("sources", "query", "norm_weight"),
             "depth_attention_multi": ("sources", "queries", "norm_weights"),
             "merge_partial": ("out1", "lse1", "partial", "query", "norm_weight")}
#: Array arguments passed by keyword, and only when the call gives them (C17).
KEYWORD_INPUTS = {"depth_attention": ("out_norm_weight",)}


def output_names(op: str, attrs: Dict[str, Any], inputs: Optional[Dict[str, Any]] = None) -> Tuple[str, ...]:
    """The names of an op's results, in the order the op returns them (`inputs`: the call's,
    whose out_norm_weight adds "out_normed", C17)."""
    if op == "depth_attention_multi":
        return ("out", "lse")
    names = ["out"]
    if op == "depth_attention" and (inputs or {}).get("out_norm_weight") is not None:
        names.append("out_normed")
    if attrs.get("return_lse"):
        names.append("lse")
    if op == "depth_attention" and attrs.get("return_weights"):
        names.append("weights")
    return tuple(names)


def _items(value) -> list:
    """The arrays of one argument: [] for None, the elements of a list/tuple, else [value]."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def flatten(args: Dict[str, Any]) -> Tuple[list, Callable[[Sequence], Dict[str, Any]]]:
    """(leaves, rebuild): the non-None arrays of `args` in order, and the function that puts a
    list of the same length back into the same structure (tuple sources stay tuples)."""
    layout = [(name, None if v is None else (type(v), len(v)) if isinstance(v, (list, tuple)) else 1)
              for name, v in args.items()]
    leaves = [a for v in args.values() for a in _items(v)]

    def rebuild(flat: Sequence) -> Dict[str, Any]:
        flat, out = list(flat), {}
        for name, shape in layout:
            if shape is None:
                out[name] = None
            elif shape == 1:
                out[name] = flat.pop(0)
            else:
                kind, n = shape
                out[name] = kind(flat[:n])
                del flat[:n]
        return out

    return leaves, rebuild


class Adapter:
    """A `Backend` built from a framework's primitives (subclass it; see the module docstring)."""

    name = "adapter"
    #: Module (or object) with `depth_attention`, `depth_attention_multi`, `merge_partial`; None:
    #: the adapter's own methods of those names.
    ops: Any = None
    #: The port's names of the spec's arguments where they differ ({"sources": "xs"}): error
    #: cases look for these names in the messages (`checks.argument_name`).
    arg_names: Dict[str, str] = {}

    # -- primitives a framework supplies -------------------------------------------------------
    def capabilities(self) -> Capabilities:
        raise NotImplementedError

    def versions(self) -> Dict[str, str]:
        raise NotImplementedError

    def is_available(self) -> bool:
        return True

    def environment(self) -> Dict[str, str]:
        """Environment variables the port needs set before it is imported (e.g.
        {"TRITON_INTERPRET": "1"}): reproducers print them."""
        return {}

    def array(self, values: np.ndarray, dtype: str, device: str, strided: bool):
        """A native array of dtype name `dtype` on `device` holding `values` (float64 NumPy,
        exactly representable in `dtype`); with `strided` and ndim >= 1 a non-contiguous view
        (e.g. every other element of a buffer twice as wide in the last axis)."""
        raise NotImplementedError

    def to_numpy(self, x) -> np.ndarray:
        """`x` read back: float64 stays float64, other floating dtypes come back float32."""
        raise NotImplementedError

    def dtype_name(self, x) -> str:
        """The dtype name of a native array ("bfloat16", "float32", ...)."""
        raise NotImplementedError

    def vjp(self, fn: Callable, leaves: list, key=None) -> Tuple[tuple, Callable[[list], list]]:
        """(outputs, pullback): `outputs = fn(*leaves)` (a tuple of native arrays) and
        `pullback(cotangents)` -> one gradient per leaf (None: zero).  A cotangent is a native
        array of its output's dtype, or None for an output that gets none (weights, C11).
        key: hashable; calls with equal keys and equal leaf shapes/dtypes run the same `fn`
        (a framework that compiles may cache on it)."""
        raise NotImplementedError

    def value_and_grads(self, fn: Callable, leaves: list, cotangents: Callable[[list], list],
                        key=None) -> Tuple[tuple, list]:
        """(outputs, gradients) in one go: `cotangents(outputs)` builds the cotangents from the
        outputs (only their dtypes are read: `dtype_name` must accept what is passed).  The
        default calls `vjp` and its pullback; a compiling framework may override it to build the
        cotangents from the outputs' abstract shapes first and compile the forward and the
        pullback as one program (JAX: one executable per case instead of two)."""
        outs, pullback = self.vjp(fn, leaves, key)
        return outs, pullback(cotangents(list(outs)))

    def probe(self, config, params: Dict[str, Any], embedding, sublayer_weights, *, schedule: str,
              mix, scale):
        """The spec's probe network (section 6) on native arrays -> `out` `[..., D]`.  A port that
        declares `Capabilities(sublayer_dtype=True)` also takes `sublayer_dtype` (a dtype name,
        passed only when the call has one): its sublayers then return `cast(f_l(h), dtype)`
        (`sublayers_in`; M1a: the stream casts them back to the embedding's dtype)."""
        raise NotImplementedError

    def cast(self, x, dtype: str):
        """Native `x` cast to the dtype named `dtype` (differentiable; the default is the
        `astype` of NumPy, JAX and MLX arrays; torch's adapter uses `.to`)."""
        return x.astype(dtype)

    def sublayers_in(self, sublayers: list, dtype: Optional[str]) -> list:
        """`sublayers` (callables h -> v) returning `cast(v, dtype)` (None: unchanged): the
        probe's sublayers of `ProbeCall.sublayer_dtype` (M1a)."""
        if dtype is None:
            return list(sublayers)
        return [lambda h, f=f: self.cast(f(h), dtype) for f in sublayers]

    def shares_memory(self, result, argument) -> bool:
        """Whether a write into `result` could change `argument` (C7a).  The default, object
        identity, is exact for frameworks without views; frameworks with views override it."""
        return result is argument

    def context(self, call) -> contextlib.AbstractContextManager:
        """A context every call runs in (JAX: float64 enabled for float64 calls)."""
        return contextlib.nullcontext()

    def forward(self, fn: Callable, leaves: list, key=None) -> tuple:
        """`fn(*leaves)` without gradients (key: as in `vjp`)."""
        return fn(*leaves)

    def broadcast_to(self, x, shape):
        """A broadcast (stride-0 where the framework has strides) view of native `x` with `shape`
        (the "expanded" layout).  The default finds the framework's own: torch's `expand`, else the
        `broadcast_to` of the array's module (NumPy, JAX, MLX); override it for others."""
        if hasattr(x, "expand") and not isinstance(x, np.ndarray):
            return x.expand(*shape)
        if isinstance(x, np.ndarray):
            return np.broadcast_to(x, shape)
        import importlib

        module = importlib.import_module(type(x).__module__.split(".")[0])
        for name in ("numpy", "core"):  # jax.numpy, mlx.core
            fn = getattr(getattr(module, name, None), "broadcast_to", None)
            if fn is not None:
                return fn(x, shape)
        return module.broadcast_to(x, shape)

    def layout_array(self, values: np.ndarray, dtype: str, device: str, layout: str, axis: int = 0):
        """`values` as a native array in `layout` (`backend.LAYOUTS`; `axis`: the token / source
        axis it applies to), built from `array`, basic indexing, `swapaxes` and `broadcast_to`, so
        a framework base needs nothing more.  Arrays too small for the layout come back plain."""
        v = np.asarray(values, np.float64)
        if layout == "channel_strided" or v.ndim == 0:
            return self.array(v, dtype, device, layout == "channel_strided")
        if layout == "offset":  # a contiguous view one row (element, for 1-D) into its buffer
            buf = np.concatenate([np.zeros((1,) + v.shape[1:]), v])
            return self.array(buf, dtype, device, False)[1:]
        if layout in ("token_strided", "source_strided") and axis < v.ndim:
            shape = list(v.shape)
            shape[axis] *= 2
            index = tuple(slice(None, None, 2) if i == axis else slice(None) for i in range(v.ndim))
            buf = np.zeros(shape)
            buf[index] = v
            return self.array(buf, dtype, device, False)[index]
        if layout == "transposed" and v.ndim >= 2:  # stored [A1, A0, ...], read as [A0, A1, ...]
            return self.array(np.ascontiguousarray(np.swapaxes(v, 0, 1)), dtype, device, False).swapaxes(0, 1)
        if layout == "expanded" and v.ndim >= 2:  # one row broadcast over every leading axis
            row = self.array(v.reshape((-1, v.shape[-1]))[0], dtype, device, False)
            return self.broadcast_to(row, v.shape)
        return self.array(v, dtype, device, False)

    # -- written once --------------------------------------------------------------------------
    def _one(self, value, dtype, call, layout):
        value = np.asarray(value, np.float64) if _floating(value) else np.asarray(value)
        if layout is not None and _floating(value):
            return self.layout_array(value, dtype, call.device, *layout)
        return self.array(value, dtype, call.device, call.strided)

    def _native(self, value, dtype, call, name: Optional[str] = None) -> Any:
        if value is None:
            return None
        layout = (getattr(call, "layouts", None) or {}).get(name)
        if isinstance(value, (list, tuple)):
            dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(value)
            return type(value)(self._one(v, d, call, layout) for v, d in zip(value, dtypes))
        return self._one(value, dtype, call, layout)

    def native_inputs(self, call: OpCall) -> Dict[str, Any]:
        """Native arguments by name, in the op's order (sources keep their list/tuple/stacked form),
        then the keyword inputs the call gives (`KEYWORD_INPUTS`); each in its layout
        (`OpCall.strided`, `OpCall.layouts`)."""
        names = ARG_ORDER[call.op] + tuple(k for k in KEYWORD_INPUTS.get(call.op, ())
                                           if call.inputs.get(k) is not None)
        return {name: self._native(call.inputs.get(name), call.input_dtypes.get(name, call.dtype), call, name)
                for name in names}

    def run_op(self, call: OpCall, args: Dict[str, Any], names: Tuple[str, ...]):
        """(outputs by name, gradients by argument name or {}) as native arrays."""
        op = getattr(self if self.ops is None else self.ops, call.op, None)
        if op is None:
            raise NotImplementedError(f"{type(self).__name__} has no {call.op} (declare the ops it has in "
                                      "Capabilities.ops)")
        attrs = self.declared_attrs(call)
        leaves, rebuild = flatten(args)

        def fn(*flat):
            args_, kwargs = split_arguments(call.op, rebuild(flat))
            result = op(*args_, **kwargs, **attrs)
            return tuple(result) if isinstance(result, tuple) else (result,)

        key = ("op", call.op, repr(sorted(attrs.items())), _layout(args))
        if call.cotangents is None:
            return dict(zip(names, self.forward(fn, leaves, key))), {}

        def cotangents(outs):
            return [None if name == "weights" or call.cotangents.get(name) is None  # C11
                    else self.array(np.asarray(call.cotangents[name], np.float64),
                                    (getattr(call, "cotangent_dtypes", None) or {}).get(name) or self.dtype_name(y),
                                    call.device, False)
                    for name, y in zip(names, outs)]

        outs, grads = self.value_and_grads(fn, leaves, cotangents, key)
        return dict(zip(names, outs)), rebuild(grads)

    def declared_attrs(self, call: OpCall) -> Dict[str, Any]:
        """The call's keyword arguments less those of options the port does not declare while
        they hold the spec's default (num_heads=1, activation="softmax", key_norm=True,
        return_lse / return_weights False), and less a fixed scale / eps: a port's function is
        called with the keywords of its own API only."""
        caps = self.capabilities()
        attrs = dict(call.attrs)
        for key, default, option in (("num_heads", 1, "num_heads"), ("activation", "softmax", "sigmoid"),
                                     ("key_norm", True, "no_key_norm"), ("return_lse", False, "lse"),
                                     ("return_weights", False, "weights")):
            if option not in caps.options and key in attrs and attrs[key] == default:
                del attrs[key]
        for key, fixed in (("scale", caps.scale), ("eps", caps.eps)):
            if fixed is not None and attrs.get(key) == fixed:
                del attrs[key]
        if call.op == "merge_partial" and not caps.merge_lse and attrs.get("return_lse") is False:
            del attrs["return_lse"]
        return attrs

    def call_op(self, call: OpCall) -> OpResult:
        if call.op not in OPS:
            raise ValueError(f"op: expected one of {OPS}, got {call.op!r}")
        names = output_names(call.op, call.attrs, call.inputs)
        if "out_normed" in names and tuple(self.capabilities().out_norm_outputs) == ("out_normed",):
            names = tuple(n for n in names if n != "out")  # a fused norm that returns out_normed only
        with self.context(call):
            args = self.native_inputs(call)
            outputs, grads = self.run_op(call, args, names)
            return self._result(args, outputs, grads)

    def _result(self, args, outputs, grads) -> OpResult:
        # A None gradient of a given argument is a zero gradient (of the argument's dtype).
        dtypes = {k: self.dtype_name(v) for k, v in outputs.items()}
        read = {}
        for name, value in grads.items():
            if args.get(name) is None:
                dtypes[f"grad.{name}"], read[name] = None, None
                continue
            given = _items(args[name])
            pairs = list(zip([None] * len(given) if value is None else _items(value), given))
            names = [self.dtype_name(a if g is None else g) for g, a in pairs]
            arrays = [np.zeros(np.shape(self.to_numpy(a))) if g is None else self.to_numpy(g)
                      for g, a in pairs]
            many = isinstance(args[name], (list, tuple))
            dtypes[f"grad.{name}"] = names if many else names[0]
            read[name] = arrays if many else arrays[0]
        results = list(outputs.items()) + [(f"grad.{k}", g) for k, v in grads.items()
                                           for g in _items(v) if g is not None]
        natives = [a for v in args.values() for a in _items(v)]
        aliases = []
        for name, r in results:
            if name not in aliases and any(self.shares_memory(r, a) for a in natives):
                aliases.append(name)
        return OpResult(
            outputs={k: self.to_numpy(v) for k, v in outputs.items()}, grads=read,
            inputs_after={k: None if v is None else ([self.to_numpy(a) for a in v]
                                                     if isinstance(v, (list, tuple)) else self.to_numpy(v))
                          for k, v in args.items()},
            native_dtypes=dtypes, aliases=tuple(aliases))

    def call_probe(self, call: ProbeCall) -> ProbeResult:
        from attnres_core.config import ResidualConfig

        config = ResidualConfig.from_dict(dict(call.config))
        with self.context(call):
            names = sorted(call.params)
            leaves = [self.array(np.asarray(a, np.float64), call.dtype, call.device, False)
                      for a in [call.embedding, call.sublayer_weights, *(call.params[n] for n in names)]]

            sublayer_dtype = getattr(call, "sublayer_dtype", None)
            extra = {} if sublayer_dtype is None else {"sublayer_dtype": sublayer_dtype}  # M1a

            def fn(emb, w, *values):
                return (self.probe(config, dict(zip(names, values)), emb, w, schedule=call.schedule,
                                   mix=call.mix, scale=call.scale, **extra),)

            key = ("probe", repr(sorted(call.config.items())), tuple(names), call.schedule, call.mix,
                   call.scale, sublayer_dtype)
            if call.cotangent is None:
                out = self.forward(fn, leaves, key)[0]
                return ProbeResult(out=self.to_numpy(out), out_dtype=self.dtype_name(out))
            (out,), grads = self.value_and_grads(
                fn, leaves, lambda outs: [self.array(np.asarray(call.cotangent, np.float64),
                                                     self.dtype_name(outs[0]), call.device, False)], key)
            keys = ["embedding", "sublayer_weights", *names]
            return ProbeResult(out=self.to_numpy(out), out_dtype=self.dtype_name(out), grads={
                k: np.zeros(np.shape(self.to_numpy(a))) if g is None else self.to_numpy(g)
                for k, g, a in zip(keys, grads, leaves)})


def split_arguments(op: str, named: Dict[str, Any]) -> Tuple[list, Dict[str, Any]]:
    """(positional, keyword) arguments of `op` from arguments by name (`ARG_ORDER`, then
    `KEYWORD_INPUTS`)."""
    return [named.get(k) for k in ARG_ORDER[op]], {k: v for k, v in named.items() if k not in ARG_ORDER[op]}


def _layout(args: Dict[str, Any]) -> tuple:
    """The structure of the arguments: per name None, "array", or (list|tuple, length)."""
    return tuple((k, None if v is None else (type(v).__name__, len(v)) if isinstance(v, (list, tuple))
                  else "array") for k, v in args.items())


def _floating(value) -> bool:
    return np.asarray(value).dtype.kind == "f"


def implementation_counts(now: Dict[str, int], since: Optional[Dict[str, int]]) -> Dict[str, int]:
    """Calls per implementation in `now` minus those already in `since` (zeros dropped)."""
    since = since or {}
    return {k: int(v) - int(since.get(k, 0)) for k, v in now.items() if int(v) - int(since.get(k, 0)) > 0}


__all__: List[str] = ["ARG_ORDER", "KEYWORD_INPUTS", "Adapter", "flatten", "implementation_counts", "output_names",
                      "split_arguments"]
