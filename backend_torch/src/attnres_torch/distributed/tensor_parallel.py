"""Hidden-dimension (tensor-parallel) sharding of depth attention (spec section 2).

Each rank of `group` holds a contiguous slice `[offset, offset + D_r)` of the hidden dimension
of every source, of the query and of the key-norm gain.  Per token, head h and source i:

    forward   all-reduce (SUM) of the partial  s_i = <q g, x_i>  and  ss_i = sum x_i^2
              (2 N H scalars per token; N H without key norm), then z, p, lse are computed
              identically on every rank and  out[local] = sum_i p_i x_i[local]  stays local.
    backward  all-reduce (SUM) of the partial  dz_i = p_i (<g_out, x_i> - <g_out, out>)
              (N H scalars per token; sigmoid: <g_out, x_i> p_i (1 - p_i)); every gradient
              (local slices of sources, query and gain) is then local.

With `out_norm_weight` (C17) the fused output norm `rmsnorm(out) * w` over all D adds one
all-reduce of one scalar per token each way (the sum of squares of out, and the backward's
`<d_out_normed * w, out>`).

Convention: `out` and every gradient of a sharded input are sharded like the inputs; `lse` is
replicated (every rank holds the same value) and so is its cotangent: d_lse is added once,
after the reduction.  Numerics follow C10 (compute in float32, float64 for float64 sources,
one final cast), with autocast disabled inside, as in the ops (C3a).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from attnres_core import validation

from .._args import (
    Sources,
    autocast_off,
    check_same_device,
    compute_dtype,
    dtype_name,
    optional_tensor,
    require_tensor,
    split_sources,
)
from .comm import CommCounter, all_reduce_sum


@dataclass(frozen=True)
class HiddenShard:
    """Layout of a hidden dimension D split into contiguous per-rank slices.

    sizes: D_r for every rank of `group` (sum = D); `group`: the process group (None = world).
    """

    sizes: tuple
    group: object = None

    @classmethod
    def even(cls, dim: int, group=None) -> "HiddenShard":
        """Split D as evenly as possible (the first D mod P ranks get one more channel)."""
        world = dist.get_world_size(group)
        if not isinstance(dim, int) or dim < world:
            raise ValueError(f"dim: expected an int >= the group size {world}, got {dim!r}")
        return cls(tuple(dim // world + (r < dim % world) for r in range(world)), group)

    @property
    def dim(self) -> int:
        return sum(self.sizes)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def local_size(self) -> int:
        return self.sizes[self.rank]

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice `[..., D_r]` of a full `[..., D]` tensor (a view)."""
        return full[..., self.offset: self.offset + self.local_size]

    def head_map(self, num_heads: int, dtype, device=None) -> torch.Tensor:
        """`[D_r, H]` 0/1 matrix on `device` (None: the default device): local channel c belongs
        to head (offset + c) // (D / H).  Built on the sources' device, since it multiplies them."""
        heads = torch.arange(self.offset, self.offset + self.local_size, device=device)
        heads = heads // (self.dim // num_heads)
        # A comparison, not one_hot: one_hot reads the values (a host sync; impossible on meta).
        return (heads.unsqueeze(1) == torch.arange(num_heads, device=device)).to(dtype)


def _autocast_off(method):
    """An autograd Function's forward or backward, run with autocast disabled on the device of its
    first tensor argument (C10: its float32 products stay float32 inside `torch.autocast`, as in
    the ops, C3a)."""

    @functools.wraps(method)
    def run(ctx, *args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with autocast_off(device):
            return method(ctx, *args)

    return run


class _ShardedDepthAttention(torch.autograd.Function):
    """Inputs: (opts, query, norm_weight, *sources); outputs (out `[..., D_r]` in the compute
    dtype, unrounded: the caller casts it, and the fused output norm reads it; lse `[..., H]`)."""

    @staticmethod
    @_autocast_off
    def forward(ctx, opts, query, norm_weight, *xs):
        shard, eps, scale, h, activation, key_norm, counter = opts
        cd = compute_dtype(xs[0].dtype)
        m = shard.head_map(h, cd, xs[0].device)  # [D_r, H], on the sources' device
        x = torch.stack([s.to(cd) for s in xs])  # [N, ..., D_r]
        qg = query.to(cd) if norm_weight is None else query.to(cd) * norm_weight.to(cd)
        partial = [(x * qg) @ m]  # s_i per head, [N, ..., H]
        if key_norm:
            partial.append(x.square() @ m)  # ss_i per head
        stats = all_reduce_sum(torch.stack(partial).contiguous(), shard.group, counter, "tp.forward")
        dh = shard.dim // h
        s = stats[0]
        r = torch.rsqrt(stats[1] / dh + eps) if key_norm else torch.ones_like(s)
        z = scale * r * s
        p = torch.softmax(z, 0) if activation == "softmax" else torch.sigmoid(z)
        out = ((p @ m.T) * x).sum(0)  # [..., D_r]
        lse = torch.logsumexp(z, 0) if activation == "softmax" else torch.zeros_like(z[0])
        ctx.opts = opts
        ctx.save_for_backward(query, norm_weight, x, qg, m, s, r, p, out)
        ctx.dtypes = [t.dtype for t in xs]
        return out, lse

    @staticmethod
    @_autocast_off
    def backward(ctx, d_out, d_lse):
        shard, eps, scale, h, activation, key_norm, counter = ctx.opts
        query, norm_weight, x, qg, m, s, r, p, out = ctx.saved_tensors
        cd = x.dtype
        g = d_out.to(cd)
        dp = (g * x) @ m  # [N, ..., H], partial <g_out, x_i>
        if activation == "softmax":
            dz = p * (dp - ((g * out) @ m).unsqueeze(0))
        else:
            dz = dp * p * (1 - p)
        dz = all_reduce_sum(dz.contiguous(), shard.group, counter, "tp.backward")
        if activation == "softmax":
            dz = dz + p * d_lse.to(cd).unsqueeze(0)  # replicated cotangent: added once
        dh = shard.dim // h
        dzc, pc, rc = dz @ m.T, p @ m.T, r @ m.T  # per channel [N, ..., D_r]
        if key_norm:
            dkey = scale * (rc * qg - ((s * r ** 3) @ m.T) * x / dh)
        else:
            dkey = scale * qg.expand_as(x)
        dx = pc * g + dzc * dkey
        dqg = (dzc * scale * rc * x).sum(0)  # [..., D_r]
        tok = tuple(range(dqg.dim() - 1))
        dq = dqg if norm_weight is None else dqg * norm_weight.to(cd)
        dq = dq if query.dim() > 1 else dq.sum(tok)
        dg = None if norm_weight is None else (dqg * query.to(cd)).sum(tok).to(norm_weight.dtype)
        d_sources = [dx[i].to(dt) for i, dt in enumerate(ctx.dtypes)]
        return (None, dq.to(query.dtype), dg, *d_sources)


class _ShardedOutNorm(torch.autograd.Function):
    """C17 on hidden shards: (opts, out `[..., D_r]` compute dtype, weight `[D_r]`) ->
    `rmsnorm(out) * weight` over all D channels, `[..., D_r]` in opts' dtype."""

    @staticmethod
    @_autocast_off
    def forward(ctx, opts, out, weight):
        shard, eps, counter, dtype = opts
        ss = all_reduce_sum(out.square().sum(-1, keepdim=True).contiguous(), shard.group, counter,
                            "tp.forward")  # [..., 1]: one scalar per token
        r = torch.rsqrt(ss / shard.dim + eps)
        w = weight.to(out.dtype)
        ctx.opts, ctx.weight_dtype = opts, weight.dtype
        ctx.save_for_backward(out, r, w)
        return (out * r * w).to(dtype)

    @staticmethod
    @_autocast_off
    def backward(ctx, d_normed):
        shard, eps, counter, dtype = ctx.opts
        out, r, w = ctx.saved_tensors
        dy = d_normed.to(out.dtype)
        g = dy * w
        dot = all_reduce_sum((g * out).sum(-1, keepdim=True).contiguous(), shard.group, counter,
                             "tp.backward")  # <g, out> over all D, one scalar per token
        d_out = r * g - out * (r ** 3) * dot / shard.dim
        d_weight = (dy * out * r).reshape(-1, out.shape[-1]).sum(0).to(ctx.weight_dtype)
        return None, d_out, d_weight


def _from_dtensors(sources, query, norm_weight, out_norm_weight, **options):
    """`depth_attention_tp` on DTensors sharded over their last dim D on a 1-D mesh: the layout
    (`HiddenShard`) comes from the mesh and DTensor's chunking; the results are DTensors (out and
    out_normed Shard on D, lse Replicate)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    xs = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    named = [("sources[%d]" % i, x) for i, x in enumerate(xs)] + [("query", query)]
    named += [(n, t) for n, t in (("norm_weight", norm_weight), ("out_norm_weight", out_norm_weight))
              if t is not None]
    mesh = xs[0].device_mesh if isinstance(xs[0], DTensor) else None
    for name, t in named:
        if not (isinstance(t, DTensor) and t.device_mesh == mesh and mesh.ndim == 1
                and t.placements == (Shard(t.dim() - 1),)):
            got = (f"placements {t.placements} on a {t.device_mesh.ndim}-D mesh"
                   if isinstance(t, DTensor) else type(t).__name__)
            raise TypeError(f"{name}: without shard=, expected a DTensor sharded over its last dim "
                            f"(Shard(-1)) on the 1-D mesh of sources[0], got {got}")
    dim, world = xs[0].shape[-1], mesh.size()
    chunk = -(-dim // world)  # DTensor's Shard splits like torch.chunk
    shard = HiddenShard(tuple(max(0, min(chunk, dim - r * chunk)) for r in range(world)),
                        mesh.get_group())
    local = (lambda t: None if t is None else t.to_local())
    res = depth_attention_tp(
        [x.to_local() for x in xs] if isinstance(sources, (list, tuple)) else xs[0].to_local(),
        query.to_local(), local(norm_weight), shard=shard, out_norm_weight=local(out_norm_weight),
        **options)
    res = res if isinstance(res, tuple) else (res,)
    shape = xs[0].shape if isinstance(sources, (list, tuple)) else xs[0].shape[1:]
    wrapped = [DTensor.from_local(r, mesh, [Shard(r.dim() - 1)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())
               for r in res[: 1 + (out_norm_weight is not None)]]
    wrapped += [DTensor.from_local(r, mesh, [Replicate()], run_check=False) for r in res[len(wrapped):]]
    return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)


def depth_attention_tp(sources: Sources, query: torch.Tensor, norm_weight: Optional[torch.Tensor] = None,
                       *, shard: Optional[HiddenShard] = None, eps: float = 1e-6, scale: float = 1.0,
                       num_heads: int = 1, activation: str = "softmax", key_norm: bool = True,
                       return_lse: bool = False, counter: Optional[CommCounter] = None,
                       out_norm_weight: Optional[torch.Tensor] = None,
                       out_norm_eps: Optional[float] = None):
    """Depth attention with the hidden dimension sharded over `shard.group`.

    Args:
      sources: N local slices `[..., D_r]` (list) or one stacked `[N, ..., D_r]` tensor.
      query: local slice `[D_r]` (pseudo-query) or `[..., D_r]` (per-token query).
      norm_weight: local slice `[D_r]` of the key-norm gain, or None.
      shard: the layout (`HiddenShard.even(D, group)`); D = shard.dim must divide by num_heads.
        None: every tensor is a DTensor sharded over its last dim D (`Shard(-1)`) on one 1-D mesh;
        the layout is the DTensor's, and the results are DTensors (out, out_normed `Shard(-1)`,
        lse `Replicate()`): the all-reduce form, where DTensor itself would all-gather D.
      eps, scale, num_heads, activation, key_norm: spec options (same meaning as
        `attnres_torch.depth_attention` on the full tensors).
      counter: optional `CommCounter` (categories "tp.forward", "tp.backward").
      out_norm_weight: local slice `[D_r]` of the fused output norm's gain (C17), or None;
        out_norm_eps: its eps (None: eps).  The norm is over all D channels.

    Returns out `[..., D_r]` (this rank's slice of the full op's output, sources' dtype), or
    `(out, out_normed?, lse?)`: out_normed `[..., D_r]` (sources' dtype) with out_norm_weight,
    the replicated lse `[...]` (`[..., H]` if H > 1; compute dtype) with return_lse.
    """
    if shard is None:
        return _from_dtensors(sources, query, norm_weight, out_norm_weight, eps=eps, scale=scale,
                              num_heads=num_heads, activation=activation, key_norm=key_norm,
                              return_lse=return_lse, counter=counter, out_norm_eps=out_norm_eps)
    xs, stacked, shapes, dtypes = split_sources(sources)
    query = require_tensor("query", query)
    norm_weight = optional_tensor("norm_weight", norm_weight)
    out_norm_weight = optional_tensor("out_norm_weight", out_norm_weight)
    if not isinstance(shard, HiddenShard):
        raise TypeError(f"shard: expected a HiddenShard, got {type(shard).__name__}")
    d_r, dim = shard.local_size, shard.dim
    local = [("sources[%d]" % i, s) for i, s in enumerate(shapes)] + [("query", tuple(query.shape))]
    if norm_weight is not None:
        local.append(("norm_weight", tuple(norm_weight.shape)))
    if out_norm_weight is not None:
        local.append(("out_norm_weight", tuple(out_norm_weight.shape)))
    for name, shape in local:
        if len(shape) == 0 or shape[-1] != d_r:
            raise ValueError(f"{name}: expected a last dimension equal to this rank's hidden slice "
                             f"D_r = {d_r} (of D = {dim}), got shape {shape}")

    def full(shape):
        return tuple(shape[:-1]) + (dim,)

    geo = validation.check_depth_attention(
        [full(s) for s in shapes], dtypes, full(query.shape), dtype_name(query),
        None if norm_weight is None else full(norm_weight.shape),
        None if norm_weight is None else dtype_name(norm_weight), stacked=stacked, eps=eps,
        scale=scale, num_heads=num_heads, activation=activation, key_norm=key_norm,
        return_lse=return_lse,
        out_norm_weight_shape=None if out_norm_weight is None else full(out_norm_weight.shape),
        out_norm_weight_dtype=None if out_norm_weight is None else dtype_name(out_norm_weight),
        out_norm_eps=out_norm_eps)
    # One device for every operand (the head map is built on it): NCCL needs the GPU's tensors.
    check_same_device([("sources[%d]" % i, x) for i, x in enumerate(xs)]
                      + [("query", query), ("norm_weight", norm_weight),
                         ("out_norm_weight", out_norm_weight)])
    opts = (shard, float(eps), float(scale), geo.num_heads, activation, key_norm, counter)
    out_c, lse = _ShardedDepthAttention.apply(opts, query, norm_weight, *xs)
    results = [out_c.to(xs[0].dtype)]
    if out_norm_weight is not None:
        norm_opts = (shard, float(geo.out_norm_eps), counter, xs[0].dtype)
        results.append(_ShardedOutNorm.apply(norm_opts, out_c, out_norm_weight))
    if return_lse:
        results.append(lse[..., 0] if geo.num_heads == 1 else lse)
    return results[0] if len(results) == 1 else tuple(results)

