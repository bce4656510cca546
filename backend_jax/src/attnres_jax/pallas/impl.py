"""The Pallas implementation: `Pallas`, the entry points that lay the op's arrays out for the
kernels of `kernels` (tokens flattened to `[T, D]`, a kernel's per-token statistics packed in one
`[T, K]` array, its columns as `kernels.Columns` says) and back: the statistics are split into
the `[N, ..., 1]` / `[N, ..., S]` residuals of the `_xla` rules here, and packed again (one XLA
concatenate) for the backward kernel.

One head only (the kernels have no head axis); phase 1's backward and merge's backward are the XLA
rules of `_xla` (the kernels save the same residuals as the XLA forward).  Compiled kernels run
on GPU (Triton-lowered Pallas, D a power of two) and TPU (Mosaic) in float32 compute (C10: not for
float64 sources); the interpreters (`interpret="generic"`: `pallas_call(interpret=True)`,
`"tpu"`: JAX's TPU interpreter `pltpu.InterpretParams`) run anywhere, float64 included.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from .. import _xla
from .._args import MergeOptions, Options, Request, compute_dtype
from . import kernels

INTERPRETERS = ("off", "generic", "tpu")


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def _auto_tile(request: Request) -> int:
    """Token rows per program.  TPU: a tile of every source (plus S accumulators, plus out_normed
    or its cotangent with the output norm) within ~4 MiB of fp32 VMEM.  GPU (Triton): the values
    live in registers, so one `[TB, D]` fp32 tile is at most 4096 elements, 8 per thread at
    `_GPU_WARPS` warps (sm_90 compile of the Triton-lowered kernels at D = 4096, N = 10: TB = 1
    at 16 warps gives 64 / 94 / 32 registers for forward / backward / merge and no spills, where
    the ~4 MiB rule's TB = 16 at 4 warps spilled 127 KB / 252 KB / 26 KB per thread)."""
    if request.platform == "tpu":
        rows = (1 << 20) // max(1, request.dim * (request.num_sources + request.num_sets + request.out_norm))
        return max(8, min(256, _pow2_floor(rows)))
    return max(1, min(64, _pow2_floor(4096 // max(1, request.dim))))


_GPU_WARPS = 16  # most warps of a Triton-lowered program (512 threads)
_GPU_MAX_DIM = 8192  # widest row the GPU kernels take: at D = 16384 the sm_90 compile spills
# (forward 108 B, backward 1284 B per thread at TB = 1, 16 warps); D = 8192: forward none,
# backward 28 B


def _gpu_warps(tile: int, dim: int) -> int:
    """Warps for a `[tile, D]` tile: 8 elements per thread, at most `_GPU_WARPS`."""
    return max(1, min(_GPU_WARPS, _pow2_floor(max(1, tile * dim // 256))))


@dataclasses.dataclass(frozen=True)
class Pallas:
    """The Pallas kernels as an implementation (`pallas.dispatch.Impl`).  Hashable: a static
    argument of the custom VJPs, so a traced call is keyed by the interpreter, tile and poison."""

    name = "pallas"

    interpret: str = "off"  # one of INTERPRETERS
    tile: Optional[int] = None  # TB token rows per program (None: chosen by `resolve`)
    num_warps: Optional[int] = None  # compiled GPU (Triton) kernels: warps (None: `resolve`)
    poison: bool = False  # alias every output to a NaN-filled input (tests: unwritten -> NaN)
    platform: Optional[str] = None  # "gpu" / "tpu": picks the lowering's compiler params

    def __post_init__(self):
        if self.interpret not in INTERPRETERS:
            raise ValueError(f"interpret: expected one of {INTERPRETERS}, got {self.interpret!r}")

    def supports(self, request: Request) -> Optional[str]:
        """None if the kernels run this call, else why not."""
        if request.num_heads != 1:
            return "the kernels have one head (num_heads=1)"
        if self.interpret != "off":
            return None
        if request.platform not in ("gpu", "tpu"):
            return f"no compiled Pallas kernels on platform {request.platform!r} (GPU and TPU only)"
        if compute_dtype(request.dtype) != jnp.float32:
            return f"compiled kernels compute in float32; {request.dtype} sources compute in float64 (C10)"
        if request.platform == "gpu" and request.dim & (request.dim - 1):
            return f"Triton blocks must be powers of two (D = {request.dim})"
        if request.platform == "gpu" and request.num_sets > 1:
            return (f"phase 1 ({request.num_sets} query sets) does not lower for Triton (no slice "
                    f"primitive for the query rows)")
        if request.platform == "gpu" and request.dim > _GPU_MAX_DIM:
            return (f"a row of D = {request.dim} > {_GPU_MAX_DIM} does not fit a Triton program's "
                    f"registers (the sm_90 compile spills)")
        return None

    def resolve(self, request: Request) -> "Pallas":
        """This implementation with the tile fixed for the call."""
        tile = self.tile or (8 if self.interpret != "off" else _auto_tile(request))
        warps = self.num_warps
        if warps is None and self.interpret == "off" and request.platform == "gpu":
            warps = _gpu_warps(tile, request.dim)
        return dataclasses.replace(self, tile=tile, platform=request.platform, num_warps=warps)

    # -- entry points ------------------------------------------------------------------------

    def _kw(self, ct):
        interpret = {"off": False, "generic": True}.get(self.interpret)
        if interpret is None:
            from jax.experimental.pallas import tpu as pltpu

            interpret = pltpu.InterpretParams()
        params = None
        if interpret is False and self.platform == "gpu":  # Triton, not JAX's default Mosaic GPU
            from jax.experimental.pallas import triton as pltriton

            params = (pltriton.CompilerParams() if self.num_warps is None
                      else pltriton.CompilerParams(num_warps=self.num_warps))
        elif interpret is False and self.platform == "tpu":
            from jax.experimental.pallas import tpu as pltpu

            # The one grid axis walks token tiles, and every output block is the tile's own
            # (rows, or a per-tile partial summed outside): the programs are independent, so
            # Mosaic may split the axis over a megacore chip's two TensorCores (issue 13).
            params = pltpu.CompilerParams(dimension_semantics=("parallel",))
        return dict(tb=self.tile, ct=ct, interpret=interpret, poison=self.poison, compiler_params=params)

    def forward(self, xs: list, qs: _xla.Query, opts: Options, ct):
        """`_xla.forward` for S = 1 on the forward kernel: out `[1, ..., D]` (sources' dtype),
        lse `[..., 1]` or None, p, r, s `[N, ..., 1]`."""
        tokens, dim = xs[0].shape[:-1], xs[0].shape[-1]
        softmax = opts.activation == "softmax"
        out, stats, _ = kernels.forward([x.reshape(-1, dim) for x in xs], qs.qg.reshape(-1, dim),
                                        per_token=qs.qm is None, eps=opts.eps, scale=opts.scale, softmax=softmax,
                                        key_norm=opts.key_norm, **self._kw(ct))
        out = out.reshape((1,) + tokens + (dim,))
        return (out,) + self._forward_stats(stats, len(xs), softmax, tokens, opts)

    def _forward_stats(self, stats, n: int, softmax: bool, tokens, opts: Options):
        """The forward kernel's statistics `[T, K]` -> lse `[..., 1]` or None, p, r, s `[N, ..., 1]`."""
        cols = kernels.forward_columns(n, softmax).unpack(stats)
        lse = cols["lse"].reshape(tokens + (1,)) if softmax else None
        r, s = (cols[name].T.reshape((n,) + tokens + (1,)) for name in ("r", "s"))
        return (lse,) + self._weights(r, s, lse, opts, 1)

    def forward_normed(self, xs: list, qs: _xla.Query, opts: Options, ct, w):
        """`_xla.forward_normed` on the forward kernel (out_normed from the tile's accumulator, C17):
        as `forward`, then out_normed `[1, ..., D]` (sources' dtype) and nothing saved (the
        backward kernel recomputes out from the tiles it reads anyway)."""
        tokens, dim = xs[0].shape[:-1], xs[0].shape[-1]
        softmax = opts.activation == "softmax"
        out, stats, normed = kernels.forward(
            [x.reshape(-1, dim) for x in xs], qs.qg.reshape(-1, dim), per_token=qs.qm is None, eps=opts.eps,
            scale=opts.scale, softmax=softmax, key_norm=opts.key_norm, out_norm_weight=w.reshape(1, dim),
            out_norm_eps=opts.out_norm_eps, **self._kw(ct))
        shape = (1,) + tokens + (dim,)
        return ((out.reshape(shape),) + self._forward_stats(stats, len(xs), softmax, tokens, opts)
                + (normed.reshape(shape), None))

    def phase1(self, xs: list, qs: _xla.Query, opts: Options, ct):
        """`_xla.forward` for S pseudo-queries on the phase-1 kernel (each source tile read once):
        out `[S, ..., D]`, lse `[..., S]`, p, s `[N, ..., S]`, r `[N, ..., 1]`."""
        tokens, dim, n, sets = xs[0].shape[:-1], xs[0].shape[-1], len(xs), qs.num_sets
        outs, stats = kernels.phase1([x.reshape(-1, dim) for x in xs], qs.qg, eps=opts.eps, scale=opts.scale,
                                     **self._kw(ct))
        cols = kernels.phase1_columns(n, sets).unpack(stats)
        out = jnp.stack(outs).reshape((sets,) + tokens + (dim,))
        lse = cols["lse"].reshape(tokens + (sets,))
        r = cols["r"].T.reshape((n,) + tokens + (1,))
        s = cols["s"].reshape((-1, n, sets)).transpose(1, 0, 2).reshape((n,) + tokens + (sets,))
        return (out, lse) + self._weights(r, s, lse, opts, sets)

    @staticmethod
    def _weights(r, s, lse, opts: Options, sets: int):
        """p `[N, ..., S]` from the kernels' statistics r `[N, ..., 1]`, s `[N, ..., S]` (and lse
        `[..., S]`, None for sigmoid), then r and s."""
        z = opts.scale * _xla.tile_sets(r, sets) * s
        p = jax.nn.sigmoid(z) if lse is None else jnp.exp(z - lse[None])
        return p, r, s

    def backward(self, xs: list, qs: _xla.Query, opts: Options, ct, d_out, d_lse, p, r, s):
        """`_xla.backward` for S = 1 on the backward kernel; d_out `[1, ..., D]`."""
        return self._backward(xs, qs, opts, ct, d_out, d_lse, p, r, s)[:2]

    def backward_normed(self, xs: list, qs: _xla.Query, opts: Options, ct, d_out, d_lse, p, r, s, w, d_normed,
                        saved):
        """`_xla.backward_normed` on the backward kernel, its C17 prologue fused in (out recomputed
        in the kernel; `saved` is None).  Returns d_sources, dqg and d_out_norm_weight `[D]`."""
        return self._backward(xs, qs, opts, ct, d_out, d_lse, p, r, s,
                              dict(out_norm_weight=w.reshape(1, -1), out_norm_eps=opts.out_norm_eps,
                                   d_normed=d_normed[0].reshape(-1, xs[0].shape[-1])))

    @staticmethod
    def _backward_stats(ct, softmax: bool, d_lse, p, r, s):
        """The backward kernel's input `[T, K]` (`kernels.backward_columns`) from d_lse `[..., 1]`
        or None (zeros) and p, r, s `[N, ..., 1]`: one concatenate."""
        rows = lambda a: a.reshape(a.shape[0], -1).T  # [N, ..., 1] -> [T, N]
        parts = dict(p=rows(p), r=rows(r), s=rows(s))
        if softmax:
            parts["d_lse"] = jnp.zeros((parts["p"].shape[0], 1), ct) if d_lse is None else d_lse.reshape(-1, 1)
        return kernels.backward_columns(p.shape[0], softmax).pack(ct, parts)

    def _backward(self, xs, qs, opts, ct, d_out, d_lse, p, r, s, normed=None):
        dim = xs[0].shape[-1]
        per_token, softmax = qs.qm is None, opts.activation == "softmax"
        dxs, dqg, d_w = kernels.backward(
            [x.reshape(-1, dim) for x in xs], qs.qg.reshape(-1, dim), d_out[0].reshape(-1, dim),
            self._backward_stats(ct, softmax, d_lse, p, r, s), per_token=per_token, scale=opts.scale,
            softmax=softmax, key_norm=opts.key_norm, **(normed or {}), **self._kw(ct))
        d_sources = [dx.reshape(x.shape) for dx, x in zip(dxs, xs)]
        d_w = None if d_w is None else jnp.sum(d_w, axis=0)  # per-tile partials, in tile order
        if per_token:
            return d_sources, dqg.reshape(qs.q.shape), d_w
        return d_sources, jnp.sum(dqg, axis=0, keepdims=True), d_w  # per-tile partials, in tile order

    phase1_backward = staticmethod(_xla.backward)  # no phase-1 backward kernel

    def merge(self, opts: MergeOptions, out1, lse1, partial, query, norm_weight, ct):
        """`_xla.merge` on the merge kernel."""
        tokens, dim = partial.shape[:-1], partial.shape[-1]
        qg = query.astype(ct).reshape(-1, dim)
        if norm_weight is not None:
            qg = qg * norm_weight.astype(ct)
        out, stats = kernels.merge(out1.reshape(-1, dim), lse1.reshape(-1, 1), partial.reshape(-1, dim), qg,
                                   per_token=query.ndim > 1, eps=opts.eps, scale=opts.scale, **self._kw(ct))
        cols = kernels.MERGE_COLUMNS.unpack(stats)
        return (out.reshape(partial.shape),) + tuple(cols[name].reshape(tokens) for name in ("lse", "r", "s", "w1"))

    merge_backward = staticmethod(_xla.merge_backward)  # same residuals as the XLA forward
