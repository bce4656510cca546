"""Implementation "cpu_c": the fused C kernel of the default op on the CPU (`csrc/depth_cpu.c`;
spec 2.1-2.3, C10, C15), with the fused output norm (C17) and the phase-2 merge (`merge`, no
gradient).  This module owns its support check (`refusal`), the library's build and load, its
host code and its custom-op bodies (registered by `dispatch` as `attnres::cpu_c_*`).

Each source row is read from memory once (forward: one sweep for both row sums, the weighted sum
from cache; backward: one sweep for three row sums, the gradients from cache), on
`torch.get_num_threads()` threads with thread-count-independent bits.  See the C file's header
for the tiling and the numerics.

The library is built at first use with the system C compiler (`$CC`, else `cc`) as
`-O3 -march=native -fopenmp` (see FLAG_SETS for the fallbacks), cached under `$ATTNRES_CACHE_DIR` (default `$XDG_CACHE_HOME/attnres` or
`~/.cache/attnres`) by a hash of the source, the flags, the compiler's version and this CPU's
feature flags, and loaded with ctypes (calls release the GIL).  On hosts with AVX-512 (F, BW) a
second build with 16-lane vectors (`WIDE_DEFINES`) serves bfloat16 sources; `vector_width(dtype)`
says which width serves a dtype.  `ATTNRES_TORCH_CPU_C=0` turns it
off.  Without a compiler the dispatch falls back to the chunked torch kernel (`chunked.py`);
`unavailable_reason()` says why.

On by default (`set_populate`, `ATTNRES_TORCH_POPULATE=0` to start without; Linux >= 5.14): each
thread prefaults its rows of a fresh output or gradient in one `madvise(MADV_POPULATE_WRITE)`
before writing them, instead of one first-touch fault per 4 KiB page (same data, same backing).

Opt-in (`ATTNRES_TORCH_HUGEPAGES=1` or `set_hugepages(True)`; Linux): outputs of 8 MiB or more get
`madvise(MADV_HUGEPAGE)` on their 2 MiB-aligned interior before the kernel first touches them —
fewer first-touch page faults on fresh outputs, at the cost of changing how that memory is backed
(see the C file and docs/benchmarks.md).

The `*_into` functions take 2-D views with unit stride along D (any row stride): sources N x
`[T, D]` (float32/bfloat16/float16), qg = query * gain in fp32 (`[D]` or `[T, D]`), and write
into caller-provided buffers; the op bodies at the end flatten `[..., D]` arguments to them and
allocate the outputs.  `forward_eager`, `multi_eager` and `merge_eager` make the same kernel
calls with the checks and views done once per call signature (`layout`, `merge_layout`): `ops`
calls them for repeated eager calls that need no gradient.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor

from .. import _rows
from .._args import autocast_off

NAME = "cpu_c"
#: The device the automatic choice needs every tensor on.
DEVICE_TYPE = "cpu"

SOURCE = Path(__file__).parent / "csrc" / "depth_cpu.c"
#: Tried in order: OpenMP (to share torch's libgomp thread pool, see the C file's run_blocks),
#: then pthreads, then without -march=native for compilers that lack it.
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))
#: The second build, for bfloat16 sources on hosts with AVX-512 (F and BW): 16-lane vectors (the C
#: file's VW; faster for bf16 only, so fp32 and fp16 keep the base build: docs/benchmarks.md).
#: Its row sums are blocked by 32, not 16: other last bits.
WIDE_DEFINES = ("-DATTNRES_WIDE",)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    return os.environ.get("ATTNRES_TORCH_CPU_C", "1") != "0"


def cache_dir() -> Path:
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnres"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _has_avx512bw() -> bool:
    flags = _cpu_flags().split()
    return "avx512f" in flags and "avx512bw" in flags


def _build(compiler: str, defines: tuple = ()) -> Path:
    """Compile SOURCE with `defines` (or reuse the cached build); returns the shared library's
    path and records its flags in `_state` (the base build's under "flags")."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    source = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, " ".join(flags + defines).encode(), version.encode(),
                                          _cpu_flags().encode(), platform.machine().encode()]))
        directory = cache_dir()
        target = directory / f"depth_cpu-{key.hexdigest()[:20]}.so"
        _state["wide_flags" if defines else "flags"] = flags + defines
        if target.exists():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        cmd = [compiler, *flags, *defines, "-shared", "-fPIC", "-pthread", "-std=gnu11", "-o", tmp,
               str(SOURCE), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode == 0:
            os.replace(tmp, target)  # atomic: concurrent builders each install a whole file
            return target
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}: {res.stderr.strip()[-500:]}")
    raise RuntimeError("; ".join(errors))


def _load(defines: tuple = ()) -> Optional[ctypes.CDLL]:
    if not enabled():
        _state["reason"] = "disabled by ATTNRES_TORCH_CPU_C=0"
        return None
    try:
        lib = ctypes.CDLL(str(_build(os.environ.get("CC", "cc"), defines)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        _state["wide_reason" if defines else "reason"] = f"could not build or load {SOURCE.name}: {exc}"
        return None
    i64, ptr, f32p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
    for fn in (lib.attnres_forward, lib.attnres_backward, lib.attnres_multi_forward,
               lib.attnres_merge_forward, lib.attnres_vector_width):
        fn.restype = ctypes.c_int
    lib.attnres_set_hugepages.argtypes = [ctypes.c_int]
    _state.setdefault("hugepages", os.environ.get("ATTNRES_TORCH_HUGEPAGES", "0") == "1")
    lib.attnres_set_hugepages(int(_state["hugepages"]))
    lib.attnres_set_populate.argtypes = [ctypes.c_int]
    _state.setdefault("populate", os.environ.get("ATTNRES_TORCH_POPULATE", "1") != "0")
    lib.attnres_set_populate(int(_state["populate"]))
    f64 = ctypes.c_double
    lib.attnres_forward.argtypes = [ctypes.c_int, i64, i64, i64, ptr, ptr, f32p, i64, f64, f64, ptr,
                                    i64, f32p, f32p, f32p, f64, ptr, i64, ctypes.c_int]
    lib.attnres_backward.argtypes = [ctypes.c_int, i64, i64, i64, ptr, ptr, f32p, i64, ptr, i64, f32p,
                                     f64, f64, ptr, ptr, f32p, ptr, i64, f32p, f64, f32p,
                                     ctypes.c_int]
    lib.attnres_multi_forward.argtypes = [ctypes.c_int, i64, i64, i64, i64, ptr, ptr, f32p, f64, f64,
                                          ptr, i64, i64, f32p, ctypes.c_int]
    lib.attnres_merge_forward.argtypes = [ctypes.c_int, i64, i64, ptr, i64, f32p, ptr, i64, f32p, i64,
                                          f64, f64, ptr, i64, f32p, ctypes.c_int]
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library (built on the first call), or None when unavailable."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
        return _state["lib"]


def _wide_library() -> Optional[ctypes.CDLL]:
    """The AVX-512 bfloat16 build (built on the first bf16 call), or None: no AVX-512 F/BW, the
    base library unavailable, or the wide build failed or came out 8 lanes wide."""
    base = library()
    with _lock:
        if "wide" not in _state:
            lib = _load(WIDE_DEFINES) if base is not None and _has_avx512bw() else None
            _state["wide"] = lib if lib is not None and lib.attnres_vector_width() == 16 else None
        return _state["wide"]


def _library_for(dtype: torch.dtype) -> ctypes.CDLL:
    """The build that serves `dtype` (the wide one for bfloat16 where it exists); raises when the
    kernel is unavailable."""
    lib = _library_or_raise()
    if dtype == torch.bfloat16:
        return _wide_library() or lib
    return lib


def vector_width(dtype: torch.dtype = torch.float32) -> Optional[int]:
    """fp32 lanes per vector of the build that serves `dtype` sources (8, or 16 for bfloat16 on
    AVX-512 hosts); None when the kernel is unavailable."""
    return None if library() is None else _library_for(dtype).attnres_vector_width()


@torch.compiler.assume_constant_result
def available() -> bool:
    """The library can be used (built on the first call).  A constant to torch.compile, which
    runs this once while tracing instead of tracing into the build."""
    return library() is not None


def set_hugepages(on: bool) -> None:
    """Advise fresh outputs of >= 8 MiB to use transparent huge pages (off by default)."""
    lib = _library_or_raise()
    _state["hugepages"] = bool(on)
    for built in (lib, _state.get("wide")):
        if built is not None:
            built.attnres_set_hugepages(int(bool(on)))


def set_populate(on: bool) -> None:
    """Prefault each thread's rows of a fresh output (or gradient) with one
    `madvise(MADV_POPULATE_WRITE)` before the kernel writes them (on by default; Linux >= 5.14,
    outputs of >= 1 MiB; `ATTNRES_TORCH_POPULATE=0` starts with it off).  It writes no data and
    leaves the memory's backing alone: it batches the first-touch faults the kernel's stores would
    take one 4 KiB page at a time (see the C file)."""
    lib = _library_or_raise()
    _state["populate"] = bool(on)
    for built in (lib, _state.get("wide")):
        if built is not None:
            built.attnres_set_populate(int(bool(on)))


def build_flags() -> Optional[tuple]:
    """The compiler flags of the loaded library (None when unavailable)."""
    return _state.get("flags") if library() is not None else None


def unavailable_reason() -> Optional[str]:
    """None when the kernel is available, else why not."""
    return None if library() is not None else _state.get("reason")


def _unit_stride(t: torch.Tensor) -> bool:
    """Unit stride along D, or nothing that a stride could mislead (D = 1, or no elements)."""
    return t.numel() == 0 or t.shape[-1] == 1 or t.stride(-1) == 1


def supports(sources: List[torch.Tensor]) -> bool:
    """The kernel takes these sources: CPU, float32/bfloat16/float16, unit stride along D, and
    the library is available."""
    return (all(s.device.type == "cpu" and s.dtype in _DTYPES and _unit_stride(s) for s in sources)
            and available())


def _pointers(tensors: List[torch.Tensor]):
    n = len(tensors)
    return ((ctypes.c_void_p * n)(*[t.data_ptr() for t in tensors]),
            (ctypes.c_int64 * n)(*[t.stride(0) for t in tensors]))


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape) -> None:
    """The ctypes boundary trusts pointers: make every layout assumption an explicit error."""
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {t.dtype} (shape {tuple(t.shape)})")
    if tuple(t.shape) != tuple(shape) or t.device.type != "cpu":
        raise ValueError(f"{name}: expected shape {tuple(shape)} on cpu, got {tuple(t.shape)} "
                         f"on {t.device}")
    if t.dim() == 2 and not _unit_stride(t):
        raise ValueError(f"{name}: expected unit stride along D, got strides {t.stride()}")
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous vector, got stride {t.stride()}")


def _check_common(sources, qg):
    rows, dim = sources[0].shape
    dtype = sources[0].dtype
    if dtype not in _DTYPES:
        raise TypeError(f"sources: dtype {dtype} is not one of {tuple(_DTYPES)}")
    for i, s in enumerate(sources):
        _check(f"sources[{i}]", s, dtype, (rows, dim))
    if qg.dim() == 1:
        _check("qg", qg, torch.float32, (dim,))
    else:
        _check("qg", qg, torch.float32, (rows, dim))
        if not qg.is_contiguous():
            raise ValueError(f"qg: expected a contiguous [T, D], got strides {qg.stride()}")
    return rows, dim, dtype


def _qg_row_stride(qg: torch.Tensor) -> int:
    return 0 if qg.dim() == 1 else qg.stride(0)


def _library_or_raise() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"cpu_c: {unavailable_reason()}")
    return lib


def _done(rc: int, name: str) -> None:
    if rc:
        raise MemoryError(f"cpu_c: {name} could not allocate its scratch or threads")


def _check_out_norm(w: torch.Tensor, dim: int) -> None:
    """The output norm's gain (C17): a contiguous fp32 `[D]`."""
    _check("out_norm_weight", w, torch.float32, (dim,))


@torch.no_grad()
def forward_into(sources: List[torch.Tensor], qg: torch.Tensor, eps: float, scale: float,
                 out: torch.Tensor, lse: torch.Tensor,
                 weights: Optional[torch.Tensor] = None,
                 out_norm: Optional[tuple] = None) -> None:
    """out `[T, D]` (sources' dtype) and lse `[T]` (fp32, contiguous) of depth attention; with
    `weights` (`[N, T]` fp32, contiguous) also the softmax weights, taken from the same logits,
    max and sum as lse (so they sum to 1 and are exactly 1 at N = 1).  With
    `out_norm = (w [D] fp32 contiguous, eps_o, out_normed [T, D] sources' dtype)` the same pass
    also writes out_normed = rmsnorm(y) * w of the row's fp32 accumulator y (C17)."""
    rows, dim, dtype = _check_common(sources, qg)
    onw, on_eps, normed = out_norm if out_norm is not None else (None, 0.0, None)
    if out_norm is not None:
        _check_out_norm(onw, dim)
        _check("out_normed", normed, dtype, (rows, dim))
    lib = _library_for(dtype)
    _check("out", out, dtype, (rows, dim))
    _check("lse", lse, torch.float32, (rows,))
    if weights is not None:
        _check("weights", weights, torch.float32, (len(sources), rows))
        if not weights.is_contiguous():
            raise ValueError(f"weights: expected a contiguous [N, T], got strides {weights.stride()}")
    src, src_rs = _pointers(sources)
    rc = lib.attnres_forward(_DTYPES[dtype], len(sources), rows, dim, src, src_rs, qg.data_ptr(),
                             _qg_row_stride(qg), eps, scale, out.data_ptr(), out.stride(0),
                             lse.data_ptr(), None if weights is None else weights.data_ptr(),
                             None if onw is None else onw.data_ptr(), float(on_eps),
                             None if normed is None else normed.data_ptr(),
                             0 if normed is None else normed.stride(0), torch.get_num_threads())
    _done(rc, "attnres_forward")


@torch.no_grad()
def backward_into(sources: List[torch.Tensor], qg: torch.Tensor, lse: torch.Tensor,
                  d_out: torch.Tensor, d_lse: Optional[torch.Tensor], eps: float, scale: float,
                  d_sources: List[torch.Tensor], out_norm: Optional[tuple] = None):
    """Writes d_sources N x `[T, D]` (sources' dtype); returns d(qg) in fp32 (`[D]` summed over
    tokens, or `[T, D]` for a per-token query).  d_out `[T, D]` in the sources' dtype, d_lse `[T]`
    fp32 contiguous or None.  `lse` is checked but not read (the interface of
    `chunked.backward_into`): the kernel recomputes the weights from the logits in float64.
    With `out_norm = (w [D] fp32 contiguous, eps_o, d_out_normed [T, D] sources' dtype)` (C17)
    the kernel recomputes y in fp32 per row, folds d_out_normed into d_out and returns
    (d(qg), d_out_norm_weight `[D]` fp32)."""
    rows, dim, dtype = _check_common(sources, qg)
    onw, on_eps, d_normed = out_norm if out_norm is not None else (None, 0.0, None)
    d_onw = None
    if out_norm is not None:
        _check_out_norm(onw, dim)
        _check("d_out_normed", d_normed, dtype, (rows, dim))
        d_onw = torch.empty(dim, dtype=torch.float32)
    lib = _library_for(dtype)
    _check("lse", lse, torch.float32, (rows,))
    _check("d_out", d_out, dtype, (rows, dim))
    if d_lse is not None:
        _check("d_lse", d_lse, torch.float32, (rows,))
    for i, d in enumerate(d_sources):
        _check(f"d_sources[{i}]", d, dtype, (rows, dim))
    d_qg = torch.empty(qg.shape, dtype=torch.float32)
    src, src_rs = _pointers(sources)
    dst, dst_rs = _pointers(d_sources)
    rc = lib.attnres_backward(_DTYPES[dtype], len(sources), rows, dim, src, src_rs, qg.data_ptr(),
                              _qg_row_stride(qg), d_out.data_ptr(), d_out.stride(0),
                              None if d_lse is None else d_lse.data_ptr(), eps, scale, dst, dst_rs,
                              d_qg.data_ptr(), None if d_normed is None else d_normed.data_ptr(),
                              0 if d_normed is None else d_normed.stride(0),
                              None if onw is None else onw.data_ptr(), float(on_eps),
                              None if d_onw is None else d_onw.data_ptr(), torch.get_num_threads())
    _done(rc, "attnres_backward")
    return d_qg if out_norm is None else (d_qg, d_onw)


@torch.no_grad()
def multi_forward_into(sources: List[torch.Tensor], qgs: torch.Tensor, eps: float, scale: float,
                       out: torch.Tensor, lse: torch.Tensor) -> None:
    """Phase 1 (spec 3.1): S pseudo-queries qgs `[S, D]` (fp32, contiguous) over N x `[T, D]`,
    each source row read from memory once for all S; writes out `[S, T, D]` (sources' dtype, unit
    stride along D) and lse `[S, T]` (fp32, contiguous)."""
    rows, dim, dtype = _check_common(sources, qgs[0])
    lib = _library_for(dtype)
    num_q = qgs.shape[0]
    _check("qgs", qgs, torch.float32, (num_q, dim))
    if not qgs.is_contiguous():
        raise ValueError(f"qgs: expected a contiguous [S, D], got strides {qgs.stride()}")
    _check("out", out, dtype, (num_q, rows, dim))
    if dim > 1 and out.stride(-1) != 1:
        raise ValueError(f"out: expected unit stride along D, got strides {out.stride()}")
    _check("lse", lse, torch.float32, (num_q, rows))
    if not lse.is_contiguous():
        raise ValueError(f"lse: expected a contiguous [S, T], got strides {lse.stride()}")
    src, src_rs = _pointers(sources)
    rc = lib.attnres_multi_forward(_DTYPES[dtype], len(sources), num_q, rows, dim, src, src_rs,
                                   qgs.data_ptr(), eps, scale, out.data_ptr(), out.stride(0),
                                   out.stride(1), lse.data_ptr(), torch.get_num_threads())
    _done(rc, "attnres_multi_forward")


@torch.no_grad()
def merge_forward_into(out1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor,
                       qg: torch.Tensor, eps: float, scale: float, out: torch.Tensor,
                       lse: torch.Tensor) -> None:
    """Phase 2 (spec 3.2): out `[T, D]` (partial's dtype) and lse `[T]` (fp32) from phase 1's
    out1 `[T, D]` and lse1 `[T]` (fp32, contiguous), the partial sum `[T, D]` and qg (`[D]` or
    `[T, D]`, fp32)."""
    rows, dim, dtype = _check_common([partial], qg)
    lib = _library_for(dtype)
    _check("out1", out1, dtype, (rows, dim))
    _check("lse1", lse1, torch.float32, (rows,))
    _check("out", out, dtype, (rows, dim))
    _check("lse", lse, torch.float32, (rows,))
    rc = lib.attnres_merge_forward(_DTYPES[dtype], rows, dim, out1.data_ptr(), out1.stride(0),
                                   lse1.data_ptr(), partial.data_ptr(), partial.stride(0),
                                   qg.data_ptr(), _qg_row_stride(qg), eps, scale, out.data_ptr(),
                                   out.stride(0), lse.data_ptr(), torch.get_num_threads())
    _done(rc, "attnres_merge_forward")


# -- the implementation: support check, custom-op bodies, merge -----------------------------------

def refusal(call) -> Optional[str]:
    """None when the C kernel takes `call` (a `dispatch.Call`), else why not."""
    if not call.default_op:
        return ("the C kernel covers only softmax, key_norm, num_heads=1 and "
                "float16/bfloat16/float32 sources")
    sources = call.sources
    if call.op == "merge_partial":  # (under torch.compile: the composition, `dispatch._refusal`)
        if call.device_types != {"cpu"} or sources[0].dtype != sources[1].dtype:
            sources = []  # reported by the message below
    if not sources or not supports(sources):
        return ("the C kernel does not take this call (library: "
                f"{unavailable_reason() or 'available'}; it needs CPU sources with unit stride "
                "along D)")
    return None


def _forward(sources, query, norm_weight, eps, scale, with_weights, out_norm):
    """(out, out_normed or None, lse, weights or None); `out_norm` = (gain, eps_o) or None."""
    out, normed, lse, weights = _rows.forward_outputs(sources, with_weights, out_norm is not None)
    extra = None if out_norm is None else (out_norm[0].float().contiguous(), out_norm[1],
                                           _rows.flat(normed))
    with autocast_off(out.device):
        forward_into([_rows.flat(s) for s in sources], _rows.qg(query, norm_weight), eps, scale,
                     _rows.flat(out), lse.view(-1),
                     None if weights is None else weights.view(len(sources), -1), extra)
    return out, normed, lse, weights


def _backward(sources, query, norm_weight, lse, d_out, d_lse, eps, scale, out_norm):
    """[d_sources.., d_query, d_norm_weight] (+ [d_out_norm_weight] with `out_norm` =
    (gain, eps_o, d_out_normed))."""
    dtype = sources[0].dtype
    d_src = _rows.source_grads(sources)
    extra = None if out_norm is None else (out_norm[0].float().contiguous(), out_norm[1],
                                           _rows.unit_rows(_rows.flat(out_norm[2]), dtype))
    with autocast_off(query.device):
        res = backward_into([_rows.flat(s) for s in sources], _rows.qg(query, norm_weight),
                            lse.reshape(-1).contiguous(), _rows.unit_rows(_rows.flat(d_out), dtype),
                            None if d_lse is None else d_lse.reshape(-1).float().contiguous(), eps,
                            scale, [_rows.flat(d) for d in d_src], extra)
    if out_norm is None:
        return d_src + _rows.query_grads(res, query, norm_weight)
    return d_src + _rows.query_grads(res[0], query, norm_weight) + [res[1]]


def depth_attention(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor], eps: float,
                    scale: float, save: str) -> tuple[Tensor, Tensor]:
    """out `[..., D]` (sources' dtype), lse `[...]` fp32 (spec 2.1)."""
    out, _, lse, _ = _forward(sources, query, norm_weight, eps, scale, False, None)
    return out, lse


def depth_attention_weights(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                            eps: float, scale: float, save: str) -> tuple[Tensor, Tensor, Tensor]:
    """`depth_attention` plus the weights `[N, ...]` fp32 of that lse (written by the kernel from
    the same logits)."""
    out, _, lse, weights = _forward(sources, query, norm_weight, eps, scale, True, None)
    return out, lse, weights


def depth_attention_backward(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                             out: Optional[Tensor], lse: Tensor, d_out: Tensor,
                             d_lse: Optional[Tensor], eps: float, scale: float) -> List[Tensor]:
    """[d_source_0 .. d_source_{N-1} (sources' dtype), d_query fp32 (query's shape),
    d_norm_weight fp32 `[D]`] (spec 2.3); the kernel returns d(query * gain), `out` is not
    read."""
    return _backward(sources, query, norm_weight, lse, d_out, d_lse, eps, scale, None)


def depth_attention_multi(sources: List[Tensor], queries: Tensor, norm_weights: Optional[Tensor],
                          eps: float, scale: float, save: str) -> tuple[Tensor, Tensor]:
    """Phase 1 (spec 3.1): queries `[S, D]` -> out `[S, ..., D]`, lse `[S, ...]` fp32."""
    return _rows.multi(multi_forward_into, sources, queries, norm_weights, eps, scale)


def depth_attention_out_norm(sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor],
                             out_norm_weight: Tensor, eps: float, scale: float, out_norm_eps: float,
                             with_weights: bool, save: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """C17: (out, out_normed `[..., D]` sources' dtype, lse `[...]` fp32, weights `[N, ...]` fp32
    or `[0]`); the kernel writes out_normed from the row's fp32 accumulator."""
    out, normed, lse, w = _forward(sources, query, norm_weight, eps, scale, with_weights,
                                   (out_norm_weight, out_norm_eps))
    return out, normed, lse, lse.new_empty((0,)) if w is None else w


def depth_attention_out_norm_backward(
        sources: List[Tensor], query: Tensor, norm_weight: Optional[Tensor], out_norm_weight: Tensor,
        out: Optional[Tensor], lse: Tensor, d_out: Tensor, d_out_normed: Tensor,
        d_lse: Optional[Tensor], eps: float, scale: float, out_norm_eps: float) -> List[Tensor]:
    """C17 VJP: `depth_attention_backward`'s list + d_out_norm_weight fp32 `[D]`.  The kernel
    recomputes y per row in fp32 (the saved out is rounded for low-precision sources) and folds
    d_out_normed into d_out in the same pass (csrc/depth_cpu.c)."""
    return _backward(sources, query, norm_weight, lse, d_out, d_lse, eps, scale,
                     (out_norm_weight, out_norm_eps, d_out_normed))


def merge(out1: Tensor, lse1: Tensor, partial: Tensor, query: Tensor,
          norm_weight: Optional[Tensor], eps: float, scale: float) -> tuple[Tensor, Tensor]:
    """Phase 2 (spec 3.2), no gradient: out `[..., D]` in partial's dtype and lse `[...]` fp32,
    one pass over out1 and partial.  Not a custom op: `refusal` keeps it out of torch.compile
    traces."""
    out = torch.empty(partial.shape, dtype=partial.dtype)
    lse = torch.empty(partial.shape[:-1], dtype=torch.float32)
    merge_forward_into(_rows.flat(out1), lse1.float().reshape(-1).contiguous(), _rows.flat(partial),
                       _rows.qg(query, norm_weight), eps, scale, _rows.flat(out), lse.view(-1))
    return out, lse


# -- the eager call without the custom op (`ops`' memoized path) ---------------------------------

class Layout(NamedTuple):
    """What `forward_into` checks on every call, checked once for a call signature (the
    sources' shape, strides and dtype, the query's form): `forward_eager`'s constants."""

    lib: ctypes.CDLL
    code: int  # the kernel's dtype code
    dtype: torch.dtype
    num: int  # N
    rows: int  # T
    dim: int  # D
    shape: tuple  # out and out_normed `[..., D]`
    lse_shape: tuple  # `[...]`
    weights_shape: tuple  # `[N, ...]`
    pointers: type  # ctypes.c_void_p * N
    row_strides: ctypes.Array  # each source's `[T, D]` row stride (read only by the kernel)
    offsets: Optional[tuple]  # a stacked `[N, ..., D]` tensor: byte offset of each source


def layout(sources: List[Tensor], stacked: Optional[Tensor]) -> Optional[Layout]:
    """The constants of `forward_eager` for sources N x `[..., D]` (the unbound `stacked` tensor,
    or None for a list) that this kernel serves, checked as `forward_into` checks them; None
    where `forward_eager` does not apply: no tokens, or a source whose `[T, D]` rows are no view
    of it (`_rows.flat` copies those).  Depends only on the sources' shapes, strides and dtype."""
    flats = [_rows.flat(s) for s in sources]
    if flats[0].numel() == 0 or any(f.data_ptr() != s.data_ptr() for f, s in zip(flats, sources)):
        return None
    rows, dim = flats[0].shape
    dtype = flats[0].dtype
    if dtype not in _DTYPES:
        return None
    for i, f in enumerate(flats):
        _check(f"sources[{i}]", f, dtype, (rows, dim))
    num = len(sources)
    offsets = None if stacked is None else tuple(s.data_ptr() - stacked.data_ptr() for s in sources)
    x0 = sources[0]
    return Layout(_library_for(dtype), _DTYPES[dtype], dtype, num, rows, dim, tuple(x0.shape),
                  tuple(x0.shape[:-1]), (num,) + tuple(x0.shape[:-1]), ctypes.c_void_p * num,
                  (ctypes.c_int64 * num)(*[f.stride(0) for f in flats]), offsets)


def _laid_pointers(lay: Layout, sources):
    """The sources' data pointers (a list, or the stacked tensor `lay` was taken from)."""
    if lay.offsets is None:
        return lay.pointers(*[s.data_ptr() for s in sources])
    base = sources.data_ptr()
    return lay.pointers(*[base + o for o in lay.offsets])


def forward_eager(lay: Layout, sources, query: Tensor, norm_weight: Optional[Tensor], eps: float,
                  scale: float, with_weights: bool, out_norm: Optional[tuple]):
    """`_forward` (the body of the forward ops) for sources of layout `lay` (a list, or the
    stacked tensor `lay` was taken from), without the custom op: for `ops`' eager calls that
    need no gradient.  The same kernel on the same pointers, so the same bits.  Returns (out,
    out_normed or None, lse, weights `[N, ...]` or None); `out_norm` = (gain, eps_o) or None."""
    ptrs = _laid_pointers(lay, sources)
    qg = _rows.qg(query, norm_weight)
    out = torch.empty(lay.shape, dtype=lay.dtype)
    lse = torch.empty(lay.lse_shape, dtype=torch.float32)
    weights = torch.empty(lay.weights_shape, dtype=torch.float32) if with_weights else None
    normed = onw = None
    if out_norm is not None:
        onw = out_norm[0].float().contiguous()
        normed = torch.empty(lay.shape, dtype=lay.dtype)
    rc = lay.lib.attnres_forward(
        lay.code, lay.num, lay.rows, lay.dim, ptrs, lay.row_strides, qg.data_ptr(),
        _qg_row_stride(qg), eps, scale, out.data_ptr(), lay.dim, lse.data_ptr(),
        None if weights is None else weights.data_ptr(), None if onw is None else onw.data_ptr(),
        0.0 if out_norm is None else float(out_norm[1]),
        None if normed is None else normed.data_ptr(), 0 if normed is None else lay.dim,
        torch.get_num_threads())
    _done(rc, "attnres_forward")
    return out, normed, lse, weights


def multi_eager(lay: Layout, sources, queries: Tensor, norm_weights: Optional[Tensor], eps: float,
                scale: float):
    """`depth_attention_multi` (the op body) for sources of layout `lay` without the custom op,
    as `forward_eager`: (out `[S, ..., D]`, lse `[S, ...]` fp32)."""
    ptrs = _laid_pointers(lay, sources)
    num_q = queries.shape[0]
    qgs = _rows.qg(queries, norm_weights)
    out = torch.empty((num_q,) + lay.shape, dtype=lay.dtype)
    lse = torch.empty((num_q,) + lay.lse_shape, dtype=torch.float32)
    rc = lay.lib.attnres_multi_forward(lay.code, lay.num, num_q, lay.rows, lay.dim, ptrs,
                                       lay.row_strides, qgs.data_ptr(), eps, scale, out.data_ptr(),
                                       lay.rows * lay.dim, lay.dim, lse.data_ptr(),
                                       torch.get_num_threads())
    _done(rc, "attnres_multi_forward")
    return out, lse


class MergeLayout(NamedTuple):
    """`merge_forward_into`'s checks of out1 and partial, done once for a call signature."""

    lib: ctypes.CDLL
    code: int
    dtype: torch.dtype
    rows: int
    dim: int
    shape: tuple  # out `[..., D]`
    lse_shape: tuple
    out1_stride: int  # row strides of the `[T, D]` views
    partial_stride: int


def merge_layout(out1: Tensor, partial: Tensor) -> Optional[MergeLayout]:
    """`merge_eager`'s constants for out1 and partial `[..., D]` (one dtype, validated), or None:
    no tokens, or rows that are no view (`_rows.flat` copies those)."""
    f1, fp = _rows.flat(out1), _rows.flat(partial)
    if (fp.numel() == 0 or f1.data_ptr() != out1.data_ptr() or fp.data_ptr() != partial.data_ptr()
            or partial.dtype not in _DTYPES):
        return None
    rows, dim = fp.shape
    _check("out1", f1, partial.dtype, (rows, dim))
    _check("partial", fp, partial.dtype, (rows, dim))
    return MergeLayout(_library_for(partial.dtype), _DTYPES[partial.dtype], partial.dtype, rows, dim,
                       tuple(partial.shape), tuple(partial.shape[:-1]), f1.stride(0), fp.stride(0))


def merge_eager(lay: MergeLayout, out1: Tensor, lse1: Tensor, partial: Tensor, query: Tensor,
                norm_weight: Optional[Tensor], eps: float, scale: float) -> tuple[Tensor, Tensor]:
    """`merge` for out1 and partial of layout `lay`: the same kernel call without the checks
    and views that `lay` holds."""
    out = torch.empty(lay.shape, dtype=lay.dtype)
    lse = torch.empty(lay.lse_shape, dtype=torch.float32)
    lse1 = lse1.float().reshape(-1).contiguous()
    qg = _rows.qg(query, norm_weight)
    rc = lay.lib.attnres_merge_forward(lay.code, lay.rows, lay.dim, out1.data_ptr(), lay.out1_stride,
                                       lse1.data_ptr(), partial.data_ptr(), lay.partial_stride,
                                       qg.data_ptr(), _qg_row_stride(qg), eps, scale,
                                       out.data_ptr(), lay.dim, lse.data_ptr(),
                                       torch.get_num_threads())
    _done(rc, "attnres_merge_forward")
    return out, lse


def reads_out(dtype: torch.dtype, out_norm: bool) -> bool:
    return False  # delta is recomputed from the sources (in float64 per row)
