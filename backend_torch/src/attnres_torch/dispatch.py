"""Which implementation runs a call: the registry of implementation objects and the choice.

`IMPLS` maps a name to its `Impl` object; when nothing is forced, `choose(call)` takes the first
one, in this order, whose device every tensor of the call is on and that supports the call:

* "triton" (`kernels/triton_depth.py`): every tensor on CUDA, Triton importable and
  `triton_depth.supports(...)` (with the fused output norm, C17: D <= 8192).
* "cpu_c" (`cpu_c.py`, `csrc/depth_cpu.c`): the fused C kernel, for the default op on the CPU
  (softmax, key norm, one head, float16/bfloat16/float32 sources with unit stride along D) when
  it could be built, with or without the fused output norm (C17); also `merge_partial` without
  gradients.
* "chunked" (`chunked.py`): the chunked torch kernel of the same calls: the fallback without a C
  compiler (or with `ATTNRES_TORCH_CPU_C=0`) and for sources strided along D.  No merge kernel
  and no fused output norm (such a call falls back to the composition).
* "composite" (`composite.py`): the plain differentiable torch composition, every call: float64,
  heads, sigmoid, no key norm, `merge_partial` with gradients, the output norm where no kernel
  serves it; also the comparison baseline.

The first three are kernels: `library.py` wraps their `forward` / `backward` / `multi_forward`
in `torch.library` custom ops (the op's `impl` string argument is the name, looked up once per
call with `kernel(name)`); `merge` (no gradient) is called by `ops.merge_partial` directly.
"composite" has no entry points here: `ops.py` calls `composite.py` so that torch autograd
records it.

`use_impl(name)` forces an implementation in the current context (a `contextvars.ContextVar`,
so threads and asyncio tasks do not see each other's forcing); a forced implementation that does
not take a call raises (`Impl.refusal`), except that `merge_partial` falls back to the composition
when the forced implementation has no merge kernel (chunked, composite) or the merge needs
gradients or is float64 (no kernel has a merge backward).  `last_impl()` / `impl_counts()` say
which implementation served the calls (kept under a lock: threads may call the ops at once).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import chunked, cpu_c

#: Source dtypes of the kernels (the compute dtype is fp32 for all three, C10).
FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MERGE = "merge_partial"


@dataclass(frozen=True)
class Call:
    """One op call as the dispatch sees it (arguments already validated).

    op: "depth_attention", "depth_attention_multi" or "merge_partial".
    sources: N x `[..., D]` (merge_partial: `[out1, partial]`).
    query: `[D]` or `[..., D]` (depth_attention_multi: the first of the `[S, D]` queries).
    norm_weight: `[D]` or None (depth_attention_multi: the first of the `[S, D]` gains).
    tensors: every tensor argument (for the device of the call).
    needs_grad: a gradient will flow (only merge_partial asks: its kernels have no backward).
    out_norm: depth_attention with the fused output norm (C17, `out_norm_weight` given).
    """

    op: str
    sources: Sequence[Tensor]
    query: Tensor
    norm_weight: Optional[Tensor]
    tensors: Sequence[Tensor]
    num_heads: int = 1
    activation: str = "softmax"
    key_norm: bool = True
    needs_grad: bool = False
    out_norm: bool = False

    @property
    def default_op(self) -> bool:
        """Softmax, key norm, one head, float16/bfloat16/float32 sources (merge: partial)."""
        return (self.activation == "softmax" and self.key_norm and self.num_heads == 1
                and self.sources[-1].dtype in FAST_DTYPES)

    def on(self, device_type: str) -> bool:
        return all(t.device.type == device_type for t in self.tensors)


# -- shared glue of the kernels -------------------------------------------------------------------

def _qg(query: Tensor, norm_weight: Optional[Tensor]) -> Tensor:
    """query * gain in fp32, `[D]` or per-token flattened to `[T, D]`."""
    q = query.float() if norm_weight is None else query.float() * norm_weight.float()
    return q if q.dim() == 1 else q.reshape(-1, q.shape[-1])


def _flat(t: Tensor) -> Tensor:
    """`[..., D]` -> `[T, D]` (a view when the strides allow it)."""
    return t.reshape(-1, t.shape[-1])


def _unit_rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`[T, D]` in `dtype` with unit stride along D (a broadcast d_out may arrive with stride 0)."""
    t = t.to(dtype)
    return t if t.numel() == 0 or t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


def _query_grads(d_qg: Tensor, query: Tensor, norm_weight: Optional[Tensor]) -> List[Tensor]:
    """[d_query fp32 (query's shape), d_norm_weight fp32 `[D]`] from a CPU kernel's d(query * gain)
    (`[D]` summed over tokens, or `[T, D]` for a per-token query)."""
    dim = query.shape[-1]
    gain = torch.ones(dim, device=query.device) if norm_weight is None else norm_weight.float()
    d_query = (d_qg * gain).reshape(query.shape)
    d_gain = (d_qg * query.float().reshape(d_qg.shape)).reshape(-1, dim).sum(0)
    return [d_query, d_gain]


_triton: list = []
_triton_lock = threading.Lock()


def triton_kernels():
    """The Triton kernel module (`kernels.triton_depth`), or None when Triton is unavailable.
    Imported on first use only: importing Triton takes a while and CPU calls never need it."""
    if not _triton:
        with _triton_lock:
            if not _triton:
                from .kernels import triton_depth  # imports without Triton, then has triton None

                _triton.append(triton_depth if triton_depth.triton is not None else None)
    return _triton[0]


# -- the implementations --------------------------------------------------------------------------

class Impl:
    """One implementation.  `device_type`: the device every tensor must be on for the automatic
    choice to consider it (None: any); `refusal(call)`: None when it takes the call, else the
    error a call forced onto it raises; `merge`: the no-gradient phase-2 kernel, or None."""

    name: str = ""
    device_type: Optional[str] = None
    merge = None

    def refusal(self, call: Call) -> Optional[Exception]:
        return None

    def supports(self, call: Call) -> bool:
        return self.refusal(call) is None

    def __repr__(self) -> str:
        return f"<attnres_torch impl {self.name!r}>"


def _merge_refusal(impl: Impl, call: Call) -> Optional[Exception]:
    """The refusals every merge kernel shares (forced calls never reach them: see `choose`)."""
    if impl.merge is None:
        return ValueError(f"impl: {impl.name!r} has no merge_partial kernel")
    if call.needs_grad or not call.default_op:
        return ValueError(f"impl: {impl.name!r} merges only without gradients and for "
                          "float16/bfloat16/float32 sources")
    if any(is_traceable_wrapper_subclass(t) for t in call.tensors):  # not a custom op: raw storage
        return ValueError(f"impl: {impl.name!r} merges plain tensors only (a DTensor or other "
                          "tensor subclass takes the composition)")
    return None


class TritonImpl(Impl):
    """The Triton kernels (`kernels/triton_depth.py`) on CUDA (on the CPU only under
    TRITON_INTERPRET=1, when forced)."""

    name, device_type = "triton", "cuda"

    def refusal(self, call: Call) -> Optional[Exception]:
        if call.op == MERGE and (err := _merge_refusal(self, call)) is not None:
            return err
        kernels = triton_kernels()
        if kernels is None:
            return RuntimeError("impl: 'triton' was forced but attnres_torch.kernels.triton_depth "
                                "cannot be imported")
        sources = call.sources[-1:] if call.op == MERGE else call.sources  # merge: the partial sum
        if not kernels.supports(sources, call.query, call.norm_weight, num_heads=call.num_heads,
                                activation=call.activation, key_norm=call.key_norm,
                                out_norm=call.out_norm):
            return ValueError("impl: 'triton' was forced but the Triton kernels do not support "
                              "this call (see kernels.triton_depth.supports)")
        return None

    @staticmethod
    def forward(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor], eps: float,
                scale: float, with_weights: bool = False) -> Tuple[Tensor, ...]:
        """out `[..., D]` (sources' dtype), lse `[...]` fp32 (spec 2.1), and with `with_weights`
        the weights `[N, ...]` fp32 of that lse."""
        res = triton_kernels().forward(sources, query, norm_weight, eps, scale,
                                       with_weights=with_weights)
        return tuple(t.contiguous() for t in res)

    @staticmethod
    def backward(sources, query, norm_weight, out, lse, d_out, d_lse, eps, scale) -> List[Tensor]:
        """[d_source_0 .. d_source_{N-1} (sources' dtype), d_query fp32 (query's shape),
        d_norm_weight fp32 `[D]`] (spec 2.3)."""
        d_src, d_q, d_g = triton_kernels().backward(sources, query, norm_weight, out, lse, d_out,
                                                    d_lse, eps, scale)
        if d_g is None:
            d_g = torch.zeros(query.shape[-1], dtype=torch.float32, device=query.device)
        return [d.contiguous() for d in d_src] + [d_q.float().contiguous(), d_g.float().contiguous()]

    @staticmethod
    def out_norm_forward(sources, query, norm_weight, out_norm_weight, eps, scale, out_norm_eps,
                         with_weights=False) -> Tuple[Optional[Tensor], ...]:
        """C17: (out, out_normed `[..., D]` sources' dtype, lse `[...]` fp32, weights `[N, ...]`
        fp32 or None), out_normed from the forward kernel's own fp32 accumulator."""
        res = triton_kernels().forward(sources, query, norm_weight, eps, scale,
                                       with_weights=with_weights,
                                       out_norm=(out_norm_weight, out_norm_eps))
        out, lse, w, normed = res
        return out, normed, lse, w

    @staticmethod
    def out_norm_backward(sources, query, norm_weight, out_norm_weight, out, lse, d_out, d_normed,
                          d_lse, eps, scale, out_norm_eps) -> List[Tensor]:
        """C17 VJP: `backward`'s list + d_out_norm_weight fp32 `[D]`."""
        d_src, d_q, d_g, d_w = triton_kernels().backward(
            sources, query, norm_weight, out, lse, d_out, d_lse, eps, scale,
            out_norm=(out_norm_weight, out_norm_eps, d_normed))
        if d_g is None:
            d_g = torch.zeros(query.shape[-1], dtype=torch.float32, device=query.device)
        return ([d.contiguous() for d in d_src]
                + [d_q.float().contiguous(), d_g.float().contiguous(), d_w.float().contiguous()])

    @staticmethod
    def multi_forward(sources, queries, norm_weights, eps, scale) -> Tuple[Tensor, Tensor]:
        """Phase 1 (spec 3.1): queries `[S, D]` -> out `[S, ..., D]`, lse `[S, ...]` fp32."""
        out, lse = triton_kernels().multi_forward(sources, queries, norm_weights, eps, scale)
        return out.contiguous(), lse.contiguous()

    @staticmethod
    def merge(out1, lse1, partial, query, norm_weight, eps, scale) -> Tuple[Tensor, Tensor]:
        """Phase 2 (spec 3.2), no gradient: out `[..., D]` (partial's dtype), lse `[...]` fp32."""
        return triton_kernels().merge_forward(out1, lse1, partial, query, norm_weight, eps, scale)


class CpuKernelImpl(Impl):
    """A CPU kernel module with the `forward_into` / `backward_into` / `multi_forward_into`
    interface on `[T, D]` row views (`chunked.py`, `cpu_c.py`): allocates the outputs and flattens
    the token axes around it."""

    device_type = "cpu"

    def __init__(self, name: str, module, out_norm: bool = False):
        self.name, self.kernels, self.out_norm = name, module, out_norm

    def refusal(self, call: Call) -> Optional[Exception]:
        if call.op == MERGE and (err := _merge_refusal(self, call)) is not None:
            return err
        if not call.default_op:
            return ValueError(f"impl: {self.name!r} was forced but the CPU kernels cover only "
                              "softmax, key_norm, num_heads=1 and float16/bfloat16/float32 sources")
        if call.out_norm and not self.out_norm:
            return ValueError(f"impl: {self.name!r} was forced but it has no fused output norm "
                              "(out_norm_weight, C17); the composition serves such calls")
        return None

    def _forward(self, sources, query, norm_weight, eps, scale, with_weights, out_norm):
        """(out, out_normed or None, lse, weights or None); `out_norm` = (gain, eps_o) or None."""
        x0 = sources[0]
        out = torch.empty(x0.shape, dtype=x0.dtype, device=x0.device)
        lse = torch.empty(x0.shape[:-1], dtype=torch.float32, device=x0.device)
        weights = (torch.empty((len(sources),) + tuple(x0.shape[:-1]), dtype=torch.float32,
                               device=x0.device) if with_weights else None)
        normed, extra = None, {}
        if out_norm is not None:  # only kernels with the output norm take the argument
            normed = torch.empty(x0.shape, dtype=x0.dtype, device=x0.device)
            extra["out_norm"] = (out_norm[0].float().contiguous(), out_norm[1], _flat(normed))
        self.kernels.forward_into([_flat(s) for s in sources], _qg(query, norm_weight).contiguous(),
                                  eps, scale, _flat(out), lse.view(-1),
                                  None if weights is None else weights.view(len(sources), -1),
                                  **extra)
        return out, normed, lse, weights

    def forward(self, sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                eps: float, scale: float, with_weights: bool = False) -> Tuple[Tensor, ...]:
        """out `[..., D]` (sources' dtype), lse `[...]` fp32 (spec 2.1), and with `with_weights`
        the weights `[N, ...]` fp32 of that lse (written by the kernel from the same logits)."""
        out, _, lse, weights = self._forward(sources, query, norm_weight, eps, scale, with_weights,
                                             None)
        return (out, lse) if weights is None else (out, lse, weights)

    def out_norm_forward(self, sources, query, norm_weight, out_norm_weight, eps, scale,
                         out_norm_eps, with_weights=False) -> Tuple[Optional[Tensor], ...]:
        """C17: (out, out_normed `[..., D]` sources' dtype, lse `[...]` fp32, weights `[N, ...]`
        fp32 or None); the kernel writes out_normed from the row's fp32 accumulator."""
        return self._forward(sources, query, norm_weight, eps, scale, with_weights,
                             (out_norm_weight, out_norm_eps))

    def _backward(self, sources, query, norm_weight, lse, d_out, d_lse, eps, scale, out_norm):
        """[d_sources.., d_query, d_norm_weight] (+ [d_out_norm_weight] with `out_norm` =
        (gain, eps_o, d_out_normed))."""
        dtype = sources[0].dtype
        d_src = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in sources]
        extra = {} if out_norm is None else {"out_norm": (
            out_norm[0].float().contiguous(), out_norm[1], _unit_rows(_flat(out_norm[2]), dtype))}
        res = self.kernels.backward_into(
            [_flat(s) for s in sources], _qg(query, norm_weight).contiguous(),
            lse.reshape(-1).contiguous(), _unit_rows(_flat(d_out), dtype),
            None if d_lse is None else d_lse.reshape(-1).float().contiguous(), eps, scale,
            [_flat(d) for d in d_src], **extra)
        if out_norm is None:
            return d_src + _query_grads(res, query, norm_weight)
        return d_src + _query_grads(res[0], query, norm_weight) + [res[1]]

    def backward(self, sources, query, norm_weight, out, lse, d_out, d_lse, eps,
                 scale) -> List[Tensor]:
        """[d_source_0 .. d_source_{N-1} (sources' dtype), d_query fp32 (query's shape),
        d_norm_weight fp32 `[D]`] (spec 2.3); the kernel returns d(query * gain)."""
        return self._backward(sources, query, norm_weight, lse, d_out, d_lse, eps, scale, None)

    def out_norm_backward(self, sources, query, norm_weight, out_norm_weight, out, lse, d_out,
                          d_normed, d_lse, eps, scale, out_norm_eps) -> List[Tensor]:
        """C17 VJP: `backward`'s list + d_out_norm_weight fp32 `[D]`.  The kernel recomputes y
        per row in fp32 (the saved out is rounded for low-precision sources) and folds
        d_out_normed into d_out in the same pass (csrc/depth_cpu.c)."""
        return self._backward(sources, query, norm_weight, lse, d_out, d_lse, eps, scale,
                              (out_norm_weight, out_norm_eps, d_normed))

    def multi_forward(self, sources, queries, norm_weights, eps, scale) -> Tuple[Tensor, Tensor]:
        """Phase 1 (spec 3.1): queries `[S, D]` -> out `[S, ..., D]`, lse `[S, ...]` fp32."""
        x0 = sources[0]
        num_q = queries.shape[0]
        out = torch.empty((num_q,) + tuple(x0.shape), dtype=x0.dtype, device=x0.device)
        lse = torch.empty((num_q,) + tuple(x0.shape[:-1]), dtype=torch.float32, device=x0.device)
        qgs = queries.float() if norm_weights is None else queries.float() * norm_weights.float()
        self.kernels.multi_forward_into([_flat(s) for s in sources], qgs.contiguous(), eps, scale,
                                        out.view(num_q, -1, x0.shape[-1]), lse.view(num_q, -1))
        return out, lse


class CpuCImpl(CpuKernelImpl):
    """The fused C kernel (`cpu_c.py`): also needs the built library and CPU sources with unit
    stride along D, and has the phase-2 merge."""

    def __init__(self):
        super().__init__("cpu_c", cpu_c, out_norm=True)

    def refusal(self, call: Call) -> Optional[Exception]:
        err = super().refusal(call)
        if err is not None:
            return err
        sources = call.sources
        if call.op == MERGE:
            if torch.compiler.is_compiling():  # a ctypes call: torch.compile traces the composition
                return ValueError("impl: 'cpu_c' was forced but its merge_partial is a ctypes call "
                                  "that torch.compile cannot trace")
            if not call.on("cpu") or sources[0].dtype != sources[1].dtype:
                sources = []  # reported by the message below
        if not sources or not cpu_c.supports(sources):
            return ValueError("impl: 'cpu_c' was forced but the C kernel does not take this call "
                              f"(library: {cpu_c.unavailable_reason() or 'available'}; it needs "
                              "CPU sources with unit stride along D)")
        return None

    def merge(self, out1: Tensor, lse1: Tensor, partial: Tensor, query: Tensor,
              norm_weight: Optional[Tensor], eps: float, scale: float) -> Tuple[Tensor, Tensor]:
        """Phase 2 (spec 3.2), no gradient: out `[..., D]` in partial's dtype and lse `[...]`
        fp32, one pass over out1 and partial.  Not a custom op: `refusal` keeps it out of
        torch.compile traces."""
        out = torch.empty(partial.shape, dtype=partial.dtype)
        lse = torch.empty(partial.shape[:-1], dtype=torch.float32)
        cpu_c.merge_forward_into(_flat(out1), lse1.float().reshape(-1).contiguous(), _flat(partial),
                                 _qg(query, norm_weight).contiguous(), eps, scale, _flat(out),
                                 lse.view(-1))
        return out, lse


class CompositeImpl(Impl):
    """The differentiable composition (`composite.py`): takes every call; `ops.py` runs it
    itself (autograd records it), so it has no kernel entry points."""

    name = "composite"


TRITON, CPU_C, CHUNKED, COMPOSITE = (TritonImpl(), CpuCImpl(), CpuKernelImpl("chunked", chunked),
                                     CompositeImpl())
#: Every implementation by name, in the order of the automatic choice.
IMPLS = {impl.name: impl for impl in (TRITON, CPU_C, CHUNKED, COMPOSITE)}
#: Removed names, accepted with a DeprecationWarning for one release: "cpu" was the chunked
#: kernel's name until the C kernel ("cpu_c") joined it.
DEPRECATED_NAMES = {"cpu": "chunked"}


def _current_name(name, stacklevel: int):
    """`name`, or the name it was renamed to (with a DeprecationWarning)."""
    new = DEPRECATED_NAMES.get(name) if isinstance(name, str) else None
    if new is None:
        return name
    warnings.warn(f'impl "{name}" is deprecated and will be removed in the next release: use "{new}"',
                  DeprecationWarning, stacklevel=stacklevel + 1)
    return new


def kernel(name: str) -> Impl:
    """The kernel implementation a custom op's `impl` argument names ("triton", "cpu_c" or
    "chunked")."""
    impl = IMPLS.get(_current_name(name, 2))
    if impl is None or impl is COMPOSITE:
        raise ValueError(f"impl: expected one of {tuple(n for n in IMPLS if n != 'composite')} "
                         f"for a custom op, got {name!r}")
    return impl


# -- forcing and the record -----------------------------------------------------------------------

_forced: contextvars.ContextVar = contextvars.ContextVar("attnres_torch_impl", default=None)


@contextlib.contextmanager
def use_impl(name: str) -> Iterator[None]:
    """Force every op call inside the block (in this thread / task) to use implementation `name`
    (one of IMPLS; tests, and the Triton tests on CPU tensors under TRITON_INTERPRET=1; a
    `DEPRECATED_NAMES` entry warns and forces its new name)."""
    name = _current_name(name, 3)  # the caller's `with` line: contextmanager's __enter__ between
    if name not in IMPLS:
        raise ValueError(f"impl: expected one of {tuple(IMPLS)}, got {name!r}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


@torch.compiler.assume_constant_result
def forced() -> Optional[str]:
    """The name forced by the innermost `use_impl`, or None.  A constant to torch.compile (it
    cannot trace a ContextVar): a trace keeps the forcing in effect while it was traced."""
    return _forced.get()


_lock = threading.Lock()
_counts: Counter = Counter()
_last: List[Optional[str]] = [None]


def record(impl: Impl) -> Impl:
    """Note that `impl` serves a call (skipped while torch.compile traces: a Python side effect)."""
    if not torch.compiler.is_compiling():
        with _lock:
            _counts[impl.name] += 1
            _last[0] = impl.name
    return impl


def last_impl() -> Optional[str]:
    """The name of the implementation of the last call (any thread)."""
    with _lock:
        return _last[0]


def impl_counts() -> Counter:
    """A copy of how many calls each implementation served."""
    with _lock:
        return Counter(_counts)


def choose(call: Call) -> Impl:
    """The implementation of `call` (recorded for `last_impl` / `impl_counts`).

    Forced: that implementation, or its refusal raised; merge_partial under a forced
    implementation without a merge kernel, or with gradients or float64, is the composition's.
    Otherwise: the first of IMPLS whose device every tensor is on and that supports the call.
    """
    name = forced()
    if name is not None:
        impl = IMPLS[name]
        if call.op == MERGE and (impl.merge is None or call.needs_grad or not call.default_op):
            return record(COMPOSITE)
        err = impl.refusal(call)
        if err is not None:
            raise err
        return record(impl)
    for impl in IMPLS.values():
        if (impl.device_type is None or call.on(impl.device_type)) and impl.supports(call):
            return record(impl)
    raise AssertionError("unreachable: the composition takes every call")
