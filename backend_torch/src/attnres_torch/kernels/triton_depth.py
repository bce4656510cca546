"""Host side of the Triton depth-attention kernels (`_depth_kernels.py`): argument layout, tile
choice, launches.  Imports without Triton; `supports(...)` is then False.

The arguments arrive validated (`attnres_torch.ops`, with `attnres_numpy.validation`); the "triton"
implementation object of `attnres_torch.dispatch` asks `supports(...)` before calling.  Shapes:
N sources `[..., D]` of one shape and dtype (any strides; a source is passed as a `[T, D]` row
view with unit column stride, copied only when no such view exists), query `[D]` or `[..., D]`,
norm_weight `[D]` or None.  The token axes flatten to T rows.

Test hooks: every output and workspace buffer comes from `_alloc`, every pointer / stride table
from `_alloc_table`, and every launch goes through `_launch`; `_MAX_BLOCK_D`, `_TILE_ELEMS`,
`_BWD_PROGRAMS`, `_REDUCE_PROGRAMS`, `_FWD_PROGRAMS` and `_HOIST_MIN_D` set the tiling; `_capturing` says
whether a CUDA graph is being captured.
"""

from __future__ import annotations

import collections
import os
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    from . import _depth_kernels as _k
except ImportError:  # Triton is optional: supports() is False without it.
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK_D = 16384     # widest D tile held in registers; wider rows walk D in tiles
_TILE_ELEMS = 8192       # elements of one [BLOCK_T, BLOCK_S, BLOCK_D] tile (sets BLOCK_T, BLOCK_S)
_BWD_PROGRAMS = 1024     # most backward programs, i.e. rows of the partial-sum workspace
_REDUCE_PROGRAMS = 264   # programs of the workspace reduction's first pass (2 per H200 SM)
_FWD_PROGRAMS = 264      # most programs of the forward's persistent grid (2 per H200 SM)
_HOIST_MIN_D = 1024      # narrowest D tile whose shared qg the forward loads once per program
_LOGITS_MAX_S = 64       # most queries of the two-pass phase 1 (its [64, S] fp32 dot tile)
_ON_REG_MAX_D = 4096     # output norm backward: widest tile summing d_out_norm_weight in registers


def _alloc(shape, dtype, device) -> Tensor:
    """Every output and workspace buffer (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch(kernel, grid, *args, **meta) -> None:
    """Every kernel launch (tests count them)."""
    kernel[grid](*args, **meta)


def supports(sources, query, norm_weight, *, num_heads, activation, key_norm,
             out_norm=False) -> bool:
    """True when these kernels compute this call: Triton importable; every tensor on CUDA (or on
    CPU under TRITON_INTERPRET=1); softmax, key_norm, one head; fp16/bf16/fp32 sources of one
    shape and dtype with D >= 1; query `[D]` or shaped like a source; norm_weight `[D]` or None.
    With the fused output norm (`out_norm`, C17) also D <= `_MAX_BLOCK_D // 2` (8192): the
    backward's d_y prologue needs the whole row in one tile (wider rows fall back to the
    composition)."""
    if triton is None or activation != "softmax" or not key_norm or num_heads != 1:
        return False
    sources = list(sources)
    if not sources or not all(isinstance(s, Tensor) for s in sources):
        return False
    x0 = sources[0]
    tensors = sources + [query] + ([] if norm_weight is None else [norm_weight])
    if not all(t.is_cuda for t in tensors) and not (_INTERPRET and all(t.device.type == "cpu"
                                                                       for t in tensors)):
        return False
    if x0.dtype not in _DTYPES or x0.ndim < 1 or x0.shape[-1] < 1:
        return False
    if any(s.dtype != x0.dtype or s.shape != x0.shape for s in sources):
        return False
    dim = x0.shape[-1]
    if out_norm and _pow2(dim) > _MAX_BLOCK_D // 2:
        return False
    if not query.is_floating_point() or tuple(query.shape) not in ((dim,), tuple(x0.shape)):
        return False
    return norm_weight is None or (norm_weight.is_floating_point()
                                   and tuple(norm_weight.shape) == (dim,))


def _elt(dtype: torch.dtype):
    """The Triton element type of a source dtype."""
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _rows(t: Tensor, dim: int) -> Tensor:
    """`[..., D]` -> `[T, D]` with unit column stride: a view when one exists, else a copy."""
    v = t.reshape(-1, dim)
    return v if v.stride(1) == 1 or dim == 1 else v.contiguous()


def _tiles(num_rows: int, dim: int, num_queries: int = 1, share: int = 1):
    """(BLOCK_T, BLOCK_S, BLOCK_D, ONE_TILE, num_warps) for `[BLOCK_T, BLOCK_S, BLOCK_D]` tiles of
    at most `_TILE_ELEMS // share` elements (the backward keeps about twice as many tiles live)."""
    elems = max(1, _TILE_ELEMS // share)
    block_d = min(_pow2(dim), _MAX_BLOCK_D // share)
    per_thread = 16 if block_d >= 64 else 4          # narrow rows: per-row state dominates
    elems = min(elems, 512 * per_thread // share)
    block_s = min(_pow2(num_queries), max(1, elems // block_d))
    block_t = min(_pow2(num_rows), max(1, elems // (block_d * block_s)))
    num_warps = min(16, max(1, min(block_t * block_s * block_d, elems) // (32 * per_thread)))
    return block_t, block_s, block_d, block_d >= dim, num_warps


# -- pointer / row-stride tables ------------------------------------------------------------------
#
# The kernels read N source pointers and row strides from int64 device tables.  A table is
# written on the device by `_fill_table_kernel` from kernel arguments, never copied from the host:
# no blocking copy and no host sync on any path, so every op can be captured in a CUDA graph.
#   * Eager: tables are cached by (device, stream, values), least recently used out of
#     `_MAX_TABLES`.  A table is filled and read on one stream, so the caching allocator may
#     reuse an evicted table's block only after the kernels already queued on that stream.
#   * While the current stream is capturing a CUDA graph: a fresh table per call, never cached.
#     It is an intermediate of the graph like any other: its fill is a node of the graph,
#     replayed before the kernel that reads it, and its block returns to the graph's pool in
#     stream order.  (A cached table could be evicted and its memory reused while the graph
#     still reads it; a table filled inside a capture holds its values only once the graph ran.)

_TABLES: "collections.OrderedDict[tuple, Tensor]" = collections.OrderedDict()
_MAX_TABLES = 4096       # x (512 B, the allocator's smallest block): at most 2 MiB per device
_HALF = 1 << 31          # a value travels as two i32 halves below 2^31 (`_fill_table_kernel`)


def _alloc_table(num: int, device) -> Tensor:
    """Every table's buffer (tests poison it)."""
    return torch.empty((num,), dtype=torch.int64, device=device)


def _capturing(device) -> bool:
    """True while the current CUDA stream of `device` is capturing a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _fill_table(values: Tuple[int, ...], device) -> Tensor:
    """A fresh int64 `[len(values)]` table on `device`, written by ceil(N / 16) launches of
    `_fill_table_kernel` on the current stream."""
    if any(not 0 <= v < _HALF * _HALF for v in values):
        raise ValueError(f"table values must lie in [0, 2^62), got {values}")
    table = _alloc_table(len(values), device)
    slots = _k.TABLE_SLOTS
    for start in range(0, len(values), slots):
        chunk = values[start:start + slots]
        halves = [h for v in chunk + (0,) * (slots - len(chunk)) for h in (v // _HALF, v % _HALF)]
        _launch(_k._fill_table_kernel, (1,), table, start, len(chunk), *halves, SLOTS=slots,
                num_warps=1)
    return table


def _device_table(values: Sequence[int], device) -> Tensor:
    """An int64 device tensor holding `values` (pointers or row strides).  Cached by value in
    eager mode (safe: a table holds plain numbers, valid for whatever tensor sits at those
    addresses at launch); fresh while capturing a CUDA graph (see above)."""
    values = tuple(int(v) for v in values)
    device = torch.device(device)
    if _capturing(device):
        return _fill_table(values, device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (str(device), stream, values)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    table = _TABLES[key] = _fill_table(values, device)
    if len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return table


class _SourceTable:
    """Pointer / row-stride tables of N `[T, D]` source views (kept alive with the views)."""

    def __init__(self, sources: Sequence[Tensor], dim: int):
        self.views = [_rows(s, dim) for s in sources]
        dev = self.views[0].device
        self.ptrs = _device_table([v.data_ptr() for v in self.views], dev)
        self.strides = _device_table([v.stride(0) for v in self.views], dev)
        self.dtype = self.views[0].dtype
        self.vec = 16 // self.views[0].element_size()
        self.aligned = all(v.data_ptr() % 16 == 0 and v.stride(0) % self.vec == 0 for v in self.views)
        self.elt = _elt(self.dtype)


def _as_list(sources) -> List[Tensor]:
    return list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)


def _run_forward(table: _SourceTable, q: Tensor, q_stride: int, g: Optional[Tensor], g_stride: int,
                 num_queries: int, per_token: bool, eps: float, scale: float,
                 with_weights: bool = False, out_norm: Optional[tuple] = None):
    """out `[S, T, D]` (source dtype), lse `[S, T]` fp32, weights `[N, S, T]` fp32 of that lse
    (None unless `with_weights`), out_normed `[S, T, D]` (source dtype; None unless `out_norm`
    = (gain `[D]`, eps_o), S = 1)."""
    x0 = table.views[0]
    num_rows, dim = x0.shape
    dev = x0.device
    out = _alloc((num_queries, num_rows, dim), table.dtype, dev)
    lse = _alloc((num_queries, num_rows), torch.float32, dev)
    w = (_alloc((len(table.views), num_queries, num_rows), torch.float32, dev) if with_weights
         else None)
    onw = None if out_norm is None else out_norm[0].float().contiguous()
    normed = None if out_norm is None else _alloc((num_queries, num_rows, dim), table.dtype, dev)
    if num_rows == 0:
        return out, lse, w, normed
    bt, bs, bd, one_tile, warps = _tiles(num_rows, dim, num_queries)
    if out_norm is not None and not (one_tile and num_queries == 1):
        raise ValueError(f"out_norm_weight: the Triton output norm needs one query and D <= "
                         f"{_MAX_BLOCK_D // 2} (one tile), got S = {num_queries}, D = {dim}")
    acc = out if one_tile else _alloc((num_queries, num_rows, dim), torch.float32, dev)
    num_tiles = triton.cdiv(num_queries, bs) * triton.cdiv(num_rows, bt)
    grid = (min(num_tiles, _FWD_PROGRAMS),)                       # persistent: programs loop
    # A shared query's qg tile is loaded once per program where it is worth it (>= 4 KiB of fp32;
    # sm_90 at D = 7168: 91 -> 83 registers).  Not for narrow rows: there it is a few bytes and
    # ptxas spilled the hoisted tile at D = 7 (256-row tiles).
    hoist = one_tile and not per_token and bs >= num_queries and bd >= _HOIST_MIN_D
    _launch(_k._depth_fwd_kernel, grid, table.ptrs, table.strides, q, q_stride,
            q if g is None else g, g_stride, out, lse, acc, lse if w is None else w,
            lse if onw is None else onw, out if normed is None else normed,
            0.0 if out_norm is None else float(out_norm[1]),
            len(table.views), num_rows, num_queries, dim, float(eps), float(scale), ELT=table.elt,
            VEC=table.vec, ALIGNED=table.aligned, PER_TOKEN=per_token, HAS_GAIN=g is not None,
            BLOCK_T=bt, BLOCK_S=bs, BLOCK_D=bd, ONE_TILE=one_tile, WEIGHTS=w is not None,
            OUT_NORM=out_norm is not None, HOIST_QG=hoist, num_warps=warps)
    return out, lse, w, normed


def _vec(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def forward(sources, query: Tensor, norm_weight: Optional[Tensor], eps: float,
            scale: float, with_weights: bool = False,
            out_norm: Optional[tuple] = None) -> Tuple[Tensor, ...]:
    """Depth attention (spec 2.1): out `[..., D]` in the sources' dtype, lse `[...]` fp32, and
    with `with_weights` the softmax weights `[N, ...]` fp32 of that lse (same logits, max, sum).
    With `out_norm = (out_norm_weight [D], eps_o)` (C17): (out, lse, weights or None,
    out_normed `[..., D]` in the sources' dtype, written by the same kernel pass)."""
    sources = _as_list(sources)
    shape, dim = sources[0].shape, sources[0].shape[-1]
    table = _SourceTable(sources, dim)
    per_token = query.ndim > 1
    q = _rows(query, dim) if per_token else query.contiguous()
    out, lse, w, normed = _run_forward(table, q, q.stride(0) if per_token else 0, _vec(norm_weight),
                                       0, 1, per_token, eps, scale, with_weights, out_norm)
    if out_norm is not None:
        w = None if w is None else w.view((len(sources),) + tuple(shape[:-1]))
        return out.view(shape), lse.view(shape[:-1]), w, normed.view(shape)
    if w is None:
        return out.view(shape), lse.view(shape[:-1])
    return out.view(shape), lse.view(shape[:-1]), w.view((len(sources),) + tuple(shape[:-1]))


def multi_forward(sources, queries: Tensor, norm_weights: Optional[Tensor], eps: float,
                  scale: float) -> Tuple[Tensor, Tensor]:
    """Phase 1 (spec 3.1): queries `[S, D]`, norm_weights `[S, D]` or None ->
    out `[S, ..., D]` (sources' dtype), lse `[S, ...]` fp32.  Each source is read once when one
    tile holds every query, else twice (`_run_phase1_split`), never S times."""
    sources = _as_list(sources)
    shape, dim = sources[0].shape, sources[0].shape[-1]
    num_q = queries.shape[0]
    table = _SourceTable(sources, dim)
    q = queries.contiguous()
    g = _vec(norm_weights)
    num_rows = table.views[0].shape[0]
    if triton.cdiv(num_q, _tiles(num_rows, dim, num_q)[1]) > 1 and num_q <= _LOGITS_MAX_S:
        out, lse = _run_phase1_split(table, q, g, num_q, eps, scale)
    else:
        out, lse, _, _ = _run_forward(table, q, dim, g, dim, num_q, False, eps, scale)
    return out.view((num_q,) + tuple(shape)), lse.view((num_q,) + tuple(shape[:-1]))


def _logit_tiles(num_rows: int, dim: int, num_queries: int):
    """(BLOCK_T, BLOCK_S, BLOCK_D, num_warps) of `_phase1_logits_kernel`: `tl.dot` needs every
    block >= 16; up to 64 rows share each qg tile (fewer where that leaves an H200 SM idle:
    32 at T = 8192), D walked in 64-column steps."""
    block_t = next((bt for bt in (64, 32) if triton.cdiv(num_rows, bt) >= 132), 16)
    block_t = min(block_t, max(16, _pow2(num_rows)))
    block_s = max(16, _pow2(num_queries))
    block_d = min(64, max(16, _pow2(dim)))
    return block_t, block_s, block_d, 4


def _sum_tiles(num_rows: int, dim: int, num_queries: int):
    """(BLOCK_T, BLOCK_S, BLOCK_D, num_warps) of `_weighted_sum_kernel`: one row, up to 16
    queries, D in tiles of up to 512 at 8 columns per thread (16-byte bf16 loads; the fp32
    accumulator is 16 x 8 registers per thread; sm_90: 164 registers and 6 CTAs per SM with
    Triton 3.9, 255 and 4 with Triton 3.6).  Writes dominate this kernel: S outputs per element
    read."""
    block_s = min(_pow2(num_queries), 16)
    block_d = min(_pow2(dim), 512, max(1, _TILE_ELEMS // 16))
    return 1, block_s, block_d, max(1, block_d // 256)


def _run_phase1_split(table: _SourceTable, q: Tensor, g: Optional[Tensor], num_queries: int,
                      eps: float, scale: float) -> Tuple[Tensor, Tensor]:
    """Phase 1 when the single-pass forward would split the S queries into several groups, each
    reading every source again (at D = 7168 a row fills the tile, so S = 12 meant 12 reads):
    pass 1, `_phase1_logits_kernel`, reads each source once for all S queries and writes lse
    `[S, T]` and the weights p `[N, S, T]` fp32; pass 2, `_weighted_sum_kernel`, reads each
    source once more and writes out `[S, T, D]`.  Two reads instead of S."""
    x0 = table.views[0]
    num_rows, dim = x0.shape
    dev, n = x0.device, len(table.views)
    out = _alloc((num_queries, num_rows, dim), table.dtype, dev)
    lse = _alloc((num_queries, num_rows), torch.float32, dev)
    w = _alloc((n, num_queries, num_rows), torch.float32, dev)
    if num_rows == 0:
        return out, lse
    qg = (q.float() * g.float() if g is not None else q.float()).contiguous()   # [S, D] fp32
    bt, bs, bd, warps = _logit_tiles(num_rows, dim, num_queries)
    _launch(_k._phase1_logits_kernel, (triton.cdiv(num_rows, bt),), table.ptrs, table.strides, qg,
            lse, w, n, num_rows, num_queries, dim, float(eps), float(scale), ELT=table.elt,
            VEC=table.vec, ALIGNED=table.aligned, BLOCK_T=bt, BLOCK_S=bs, BLOCK_D=bd,
            num_warps=warps)
    bt, bs, bd, warps = _sum_tiles(num_rows, dim, num_queries)
    grid = (triton.cdiv(num_queries, bs) * triton.cdiv(num_rows, bt) * triton.cdiv(dim, bd),)
    _launch(_k._weighted_sum_kernel, grid, table.ptrs, table.strides, w, out, n, num_rows,
            num_queries, dim, ELT=table.elt, VEC=table.vec, ALIGNED=table.aligned, BLOCK_T=bt,
            BLOCK_S=bs, BLOCK_D=bd, num_warps=warps)
    return out, lse


def _reduce(ws: Tensor) -> Tensor:
    """`[P, D]` fp32 -> `[D]`: a fixed two-level order (deterministic, no atomics).  Pass 1 sums
    chunks of `rows` consecutive rows into `[C, D]` on a (column tiles x C) grid of about
    `_REDUCE_PROGRAMS` programs; pass 2 sums the C chunk rows in order (one pass when C = 1)."""
    num_p, dim = ws.shape
    block = min(_pow2(dim), 1024)
    tiles = triton.cdiv(dim, block)
    rows = triton.cdiv(num_p, max(1, min(num_p, _REDUCE_PROGRAMS // tiles)))
    chunks = triton.cdiv(num_p, rows)
    if chunks > 1:
        part = _alloc((chunks, dim), torch.float32, ws.device)
        _launch(_k._reduce_rows_kernel, (tiles, chunks), ws, part, num_p, dim, rows, BLOCK_D=block)
        ws, num_p = part, chunks
    out = _alloc((dim,), torch.float32, ws.device)
    _launch(_k._reduce_rows_kernel, (tiles, 1), ws, out, num_p, dim, num_p, BLOCK_D=block)
    return out


def backward_reads_out(dtype: torch.dtype, out_norm: bool = False) -> bool:
    """Whether `backward` reads the forward's `out`: only for fp32 sources without the fused
    output norm (delta = <d_out, out>); otherwise it recomputes what it needs from the sources
    and takes out=None."""
    return dtype == torch.float32 and not out_norm


def backward(sources, query: Tensor, norm_weight: Optional[Tensor], out: Optional[Tensor],
             lse: Tensor, d_out: Tensor, d_lse: Optional[Tensor], eps: float, scale: float,
             out_norm: Optional[tuple] = None):
    """VJP (spec 2.3) -> (d_sources: list `[..., D]` in the sources' dtype, d_query fp32 shaped
    like query, d_norm_weight fp32 `[D]` or None).  `out`/`lse` are the forward's results; `out`
    is read only where `backward_reads_out` says so (fp32 sources; a low-precision `out` is
    rounded, so delta is recomputed from the sources) and may be None elsewhere.
    With `out_norm = (out_norm_weight [D], eps_o, d_out_normed [..., D])` (C17; one tile) the
    kernel folds d_out_normed into d_out (y recomputed in fp32) and the result gets a fourth
    entry, d_out_norm_weight fp32 `[D]`."""
    sources = _as_list(sources)
    shape, dim = sources[0].shape, sources[0].shape[-1]
    table = _SourceTable(sources, dim)
    num_rows = table.views[0].shape[0]
    dev = table.views[0].device
    per_token = query.ndim > 1
    has_gain = norm_weight is not None
    q = _rows(query, dim) if per_token else query.contiguous()
    g = _vec(norm_weight)
    d_src = [_alloc(tuple(shape), table.dtype, dev) for _ in sources]
    d_ptrs = _device_table([d.data_ptr() for d in d_src], dev)
    dq = _alloc((num_rows, dim), torch.float32, dev) if per_token else None
    bt, _, bd, one_tile, warps = _tiles(num_rows, dim, share=2)
    if out_norm is not None and not one_tile:
        raise ValueError(f"out_norm_weight: the Triton output norm needs D <= {_MAX_BLOCK_D // 2} "
                         f"(one tile), got D = {dim}")
    num_blocks = triton.cdiv(num_rows, bt)
    num_programs = max(1, min(num_blocks, _BWD_PROGRAMS))
    ws = _alloc((num_programs, dim), torch.float32, dev)
    on_ws = None if out_norm is None else _alloc((num_programs, dim), torch.float32, dev)
    onw = None if out_norm is None else out_norm[0].float().contiguous()
    dn = None if out_norm is None else _rows(out_norm[2], dim)
    reads_out = backward_reads_out(table.dtype, out_norm is not None)
    if reads_out and out is None:
        raise ValueError("out: the fp32 backward reads the forward's out; got None")
    go2 = _rows(d_out, dim)
    o2 = _rows(out, dim) if reads_out else go2  # unread where reads_out is False
    lse1 = lse.reshape(-1).float().contiguous()
    dl = None if d_lse is None else d_lse.reshape(-1).float().contiguous()
    if num_rows:
        _launch(_k._depth_bwd_kernel, (num_programs,), table.ptrs, table.strides, d_ptrs, q,
                q.stride(0) if per_token else 0, q if g is None else g, o2, o2.stride(0), go2,
                go2.stride(0), lse1, lse1 if dl is None else dl, q if dq is None else dq, ws,
                lse1 if onw is None else onw, go2 if dn is None else dn,
                0 if dn is None else dn.stride(0), ws if on_ws is None else on_ws,
                0.0 if out_norm is None else float(out_norm[1]),
                len(sources), num_rows, dim, float(eps), float(scale), num_blocks, ELT=table.elt,
                VEC=table.vec, ALIGNED=table.aligned, PER_TOKEN=per_token, HAS_GAIN=has_gain,
                HAS_DLSE=dl is not None,
                DELTA_FROM_OUT=reads_out, BLOCK_T=bt, BLOCK_D=bd, ONE_TILE=one_tile,
                OUT_NORM=out_norm is not None,
                ON_IN_WS=out_norm is not None and bd > _ON_REG_MAX_D, num_warps=warps)
    else:
        ws.zero_()
        if on_ws is not None:
            on_ws.zero_()
        if dq is not None:
            dq.zero_()
    if per_token:
        d_query = dq.view(query.shape)
        d_gain = _reduce(ws) if has_gain else None
    else:
        dqg = _reduce(ws)                                    # sum_t dqg_t
        d_query = dqg * g.float() if has_gain else dqg
        d_gain = dqg * q.float() if has_gain else None
    if out_norm is not None:
        return d_src, d_query, d_gain, _reduce(on_ws)
    return d_src, d_query, d_gain


def merge_forward(out1: Tensor, lse1: Tensor, partial: Tensor, query: Tensor,
                  norm_weight: Optional[Tensor], eps: float, scale: float) -> Tuple[Tensor, Tensor]:
    """Phase 2 (spec 3.2): merge phase-1 out1 `[..., D]` / lse1 `[...]` with partial `[..., D]`
    -> out `[..., D]` (partial's dtype), lse `[...]` fp32."""
    dim = partial.shape[-1]
    shape = partial.shape
    dev = partial.device
    per_token = query.ndim > 1
    q = _rows(query, dim) if per_token else query.contiguous()
    g = _vec(norm_weight)
    o1, b = _rows(out1, dim), _rows(partial, dim)
    l1 = lse1.reshape(-1).float().contiguous()
    num_rows = b.shape[0]
    out = _alloc(tuple(shape), partial.dtype, dev)
    lse = _alloc(tuple(shape[:-1]), torch.float32, dev)
    if num_rows:
        bt, _, bd, one_tile, warps = _tiles(num_rows, dim)
        _launch(_k._merge_kernel, (triton.cdiv(num_rows, bt),), o1, o1.stride(0), l1, b,
                b.stride(0), q, q.stride(0) if per_token else 0, q if g is None else g, out, lse,
                num_rows, dim, float(eps), float(scale), ELT=_elt(partial.dtype),
                HAS_GAIN=g is not None, BLOCK_T=bt, BLOCK_D=bd, ONE_TILE=one_tile, num_warps=warps)
    return out, lse
