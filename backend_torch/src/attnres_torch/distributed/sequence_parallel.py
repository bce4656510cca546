"""Sequence-sharded block AttnRes prefill (paper section 4.2, Algorithm 1; spec section 3).

The block representations `b_0..b_n` live sharded along the sequence: rank r of `group` holds
tokens `[r T/P, (r+1) T/P)` of each (`N T/P D` elements per device instead of `N T D`).

Per block, phase 1 (`depth_attention_multi`) runs on the local shards with no communication.
The sublayers are tensor-parallel: each rank's sublayer returns its partial contribution
`y_r [T, ..., D]` (sum over ranks = f_l(h), as a row-parallel linear leaves it).  Where plain
TP would all-reduce `y_r`, the all-reduce is split into its two halves (section 4.2):
reduce-scatter `y_r` along the sequence -> add to the local partial sum -> phase-2 merge
(`merge_partial`) on the local tokens -> all-gather `h` along the sequence for the next
sublayer.  AttnRes thus adds no communication beyond the TP all-reduce it replaces.

Everything is differentiable; the backward of the all-gather is a reduce-scatter and vice versa.
Replicated parameters (queries, norm weights) receive per-rank partial gradients: sum them over
the group (`all_reduce_grads`), as for any sequence-parallel parameter.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualStream

from .._args import check_same_device
from ..residual_ops import TorchOps
from .comm import CommCounter, all_gather_dim0, all_reduce_sum, reduce_scatter_dim0


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return all_gather_dim0(x, group, counter, "seq.all_gather")

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim0(g, ctx.group, ctx.counter, "seq.backward"), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return reduce_scatter_dim0(x, group, counter, "seq.reduce_scatter")

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group, ctx.counter, "seq.backward"), None, None


def gather_sequence(x: torch.Tensor, *, group=None, seq_dim: int = 0,
                    counter: Optional[CommCounter] = None) -> torch.Tensor:
    """Local shard `[.., T/P, .., D]` -> full `[.., T, .., D]` (differentiable all-gather)."""
    return _AllGatherSeq.apply(x.movedim(seq_dim, 0), group, counter).movedim(0, seq_dim)


def scatter_sequence(y: torch.Tensor, *, group=None, seq_dim: int = 0,
                     counter: Optional[CommCounter] = None) -> torch.Tensor:
    """Per-rank partial `[.., T, .., D]` -> this rank's tokens of the sum over ranks
    `[.., T/P, .., D]` (differentiable reduce-scatter)."""
    return _ReduceScatterSeq.apply(y.movedim(seq_dim, 0), group, counter).movedim(0, seq_dim)


def sequence_sharded_prefill(embedding: torch.Tensor, sublayers: Sequence[Callable], queries: torch.Tensor,
                             norm_weights: Optional[torch.Tensor], *, block_size: int, group=None,
                             seq_dim: int = 0, eps: float = 1e-6, scale: float = 1.0,
                             counter: Optional[CommCounter] = None
                             ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Block AttnRes forward (two-phase schedule) with sequence-sharded block representations.

    Args:
      embedding: this rank's tokens of v_0 = b_0, `[.., T/P, .., D]` (sequence at `seq_dim`).
      sublayers: L callables `h [.., T, .., D] -> y_r [.., T, .., D]`, this rank's TP partial of
        f_l(h) (the sum over the group's ranks is f_l(h)).
      queries, norm_weights: `[L + 1, D]` (norm_weights may be None), replicated; row L is the
        output aggregation.
      block_size: S sublayers per block (the last block may be shorter).
    Returns:
      (out `[.., T/P, .., D]`: this rank's tokens of `DA([b_0..b_N], queries[L], ...)`,
       blocks: the local shards of `[b_0..b_N]`).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
    num_layers = len(sublayers)
    if queries.dim() != 2 or queries.shape[0] != num_layers + 1:
        raise ValueError(f"queries: expected shape [L + 1, D] = [{num_layers + 1}, D] for "
                         f"{num_layers} sublayers, got shape {tuple(queries.shape)}")
    # One device for the stream: the collectives allocate on their input's device.
    check_same_device([("embedding", embedding), ("queries", queries), ("norm_weights", norm_weights)])
    config = ResidualConfig(kind="block", block_size=block_size, eps=eps, scale=scale)
    ops = TorchOps({"queries": queries, "norm_weights": norm_weights})
    # Phase 1 runs on the local shards of b_0..b_{n-1} (no comm), phase 2 on the local tokens;
    # each sublayer sees the gathered sequence and its partial output is reduce-scattered.
    stream = ResidualStream(config, ops, embedding, num_layers=num_layers, schedule="two_phase")
    for f in sublayers:
        h_full = gather_sequence(stream.input(), group=group, seq_dim=seq_dim, counter=counter)
        stream.push(scatter_sequence(f(h_full), group=group, seq_dim=seq_dim, counter=counter))
    return stream.output(), stream.blocks


def all_reduce_grads(params: Sequence[torch.Tensor], *, group=None,
                     counter: Optional[CommCounter] = None) -> None:
    """Sum the `.grad` of replicated parameters over the group (in place)."""
    for p in params:
        if p.grad is not None:
            all_reduce_sum(p.grad, group, counter, "seq.param_grads")


def shard_sequence(x: torch.Tensor, *, group=None, seq_dim: int = 0) -> torch.Tensor:
    """This rank's contiguous tokens of a full `[.., T, .., D]` tensor (T must divide by P)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[seq_dim] % world:
        raise ValueError(f"x: the sequence length {x.shape[seq_dim]} (dim {seq_dim} of shape "
                         f"{tuple(x.shape)}) must divide by the group size {world}")
    return x.chunk(world, dim=seq_dim)[rank].contiguous()
