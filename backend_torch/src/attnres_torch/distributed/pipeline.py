"""Pipeline-parallel block AttnRes over torch.distributed point-to-point ops, with the paper's
cross-stage caching (section 4.1) and interleaved virtual stages (`pipeline_plan.PipelinePlan`).

`torch.distributed.pipelining` cannot express the cache: a stage there only sees the tensors its
predecessor sends, while here a stage reuses, in a later virtual stage, blocks it received (or
produced) in an earlier one, and their gradients must flow back through that earlier
transition.  So the runner is built on `send`/`recv`.

Forward of chunk k on its stage: receive the blocks the plan says it lacks (kept in the stage's
cache as autograd leaves) and the partial sum; run the chunk's sublayers (block AttnRes, spec
M3); send on what chunk k+1's stage lacks.  Backward runs the chunks in reverse: a cached
block's leaf accumulates the gradients of every later use on the stage (and of the copies it
forwarded); once the chunk that received it has run its backward, the total goes back over the
transition it arrived on, so gradients reach the block's origin stage.

Schedule: all forwards of all microbatches, then all backwards, in global chunk order (GPipe
order, no overlap of communication and compute); correctness and communication volume, not
throughput, are what this runner provides.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from attnres_numpy.config import ResidualConfig
from attnres_numpy.schedule import ResidualStream

from ..residual_ops import TorchOps
from .comm import CommCounter, recv, send
from .pipeline_plan import PipelinePlan


class _ChunkState:
    """Autograd bookkeeping of one (microbatch, chunk) on its stage."""

    def __init__(self):
        self.received: Dict[int, torch.Tensor] = {}  # block -> leaf received at this chunk
        self.blocks: Dict[int, torch.Tensor] = {}  # block -> the copy this chunk used / sent on
        self.partial_in: Optional[torch.Tensor] = None  # leaf
        self.produced: Dict[int, torch.Tensor] = {}  # block -> graph tensor
        self.partial_out: Optional[torch.Tensor] = None
        self.loss: Optional[torch.Tensor] = None
        self.embedding: Optional[torch.Tensor] = None  # leaf (chunk 0)


def _run_chunk(plan: PipelinePlan, chunk: int, blocks: Dict[int, torch.Tensor], partial, sublayers,
               queries, norm_weights, eps, scale):
    """Sublayers of `chunk` on the shared schedule (spec M3, direct).  blocks: index -> tensor
    for b_0..b_{n-1}; partial: the running sum of the current block or None.  Returns (produced
    blocks, partial, out or None)."""
    config = ResidualConfig(kind="block", block_size=plan.block_size, eps=eps, scale=scale)
    ops = TorchOps({"queries": queries, "norm_weights": norm_weights})
    layers = list(plan.layers(chunk))
    stream = ResidualStream.resume(config, ops, num_layers=plan.num_layers, layer=layers[0] + 1,
                                   blocks=[blocks[j] for j in range(len(blocks))], partial=partial)
    first_new = len(stream.blocks)
    for layer in layers:
        stream.push(sublayers[layer](stream.input()))
    produced = {}
    for j in range(first_new, len(stream.blocks)):
        produced[j] = blocks[j] = stream.blocks[j]
    out = stream.output() if chunk == plan.num_chunks - 1 else None
    return produced, stream.partial, out


def run_pipeline(plan: PipelinePlan, embeddings: Sequence[Optional[torch.Tensor]], sublayers: Sequence[Callable],
                 queries: torch.Tensor, norm_weights: Optional[torch.Tensor], loss_fn: Callable, *,
                 microbatch_shape, dtype: torch.dtype, group=None, eps: float = 1e-6,
                 scale: float = 1.0, counter: Optional[CommCounter] = None) -> dict:
    """Forward and backward of a block AttnRes stack over the stages of `group`.

    Args:
      plan: the layout (num_stages must equal the group size); plan.block_size is S.
      embeddings: M microbatch embeddings `[..., D]` (read on stage 0 only; pass None elsewhere).
      sublayers: L callables `h -> v`; a stage only calls those of its chunks.
      queries, norm_weights: `[L + 1, D]` (norm_weights may be None); a stage reads its rows
        (row L on the last chunk's stage).  Their `.grad` (and the sublayers' parameters')
        accumulate this stage's gradients.
      loss_fn: `(out [..., D], microbatch index) -> scalar`, called on the last chunk's stage.
      microbatch_shape, dtype: the `[..., D]` shape and dtype of every transferred tensor.
      counter: optional CommCounter ("pp.blocks", "pp.partial", "pp.grad_blocks",
        "pp.grad_partial": elements this stage sent).

    Returns {"losses": [M detached losses] on the last chunk's stage,
             "embedding_grads": [M tensors] on stage 0} (empty lists elsewhere).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if plan.num_stages != world:
        raise ValueError(f"plan: num_stages={plan.num_stages} must equal the group size {world}")
    if len(sublayers) != plan.num_layers or queries.shape[0] != plan.num_layers + 1:
        raise ValueError(f"sublayers/queries: expected {plan.num_layers} sublayers and "
                         f"{plan.num_layers + 1} query rows, got {len(sublayers)} and {queries.shape[0]}")
    shape = tuple(microbatch_shape)
    last = plan.num_chunks - 1
    mine = [k for k in range(plan.num_chunks) if plan.stage_of(k) == rank]
    states: List[Dict[int, _ChunkState]] = []
    losses, emb_grads = [], []

    for m in range(len(embeddings)):
        cache: Dict[int, torch.Tensor] = {}  # this stage's blocks for microbatch m (leaves)
        states.append({})
        for k in mine:
            st = states[m][k] = _ChunkState()
            partial = None
            if k == 0:
                st.embedding = embeddings[m].detach().clone().requires_grad_()
                blocks = {0: st.embedding.view_as(st.embedding)}
                st.produced[0] = blocks[0]
            else:
                src = plan.stage_of(k - 1)
                for j in plan.sent(k - 1):
                    cache[j] = st.received[j] = recv(shape, dtype, src, group).requires_grad_()
                if plan.partial_after(k - 1):
                    partial = st.partial_in = recv(shape, dtype, src, group).requires_grad_()
                blocks = {j: cache[j] for j in range(plan.blocks_after(k - 1))}
            st.blocks = blocks
            produced, partial, out = _run_chunk(plan, k, blocks, partial, sublayers, queries,
                                                norm_weights, eps, scale)
            st.produced.update(produced)
            st.partial_out = partial
            if k == last:
                st.loss = loss_fn(out, m)
                losses.append(st.loss.detach())
                continue
            dst = plan.stage_of(k + 1)
            for j in plan.sent(k):
                send(blocks[j].detach(), dst, group, counter, "pp.blocks")
            if plan.partial_after(k):
                send(partial.detach(), dst, group, counter, "pp.partial")
            if plan.cache == "all":
                for j, b in st.produced.items():
                    cache[j] = b.detach().requires_grad_()
                    st.produced[j] = (b, cache[j])

    for m in reversed(range(len(embeddings))):
        for k in reversed(mine):
            st = states[m][k]
            tensors, grads = [], []
            produced_grad = {j: None for j in st.produced}
            if k == last:
                tensors.append(st.loss)
                grads.append(torch.ones_like(st.loss))
            else:
                src = plan.stage_of(k + 1)
                for j in plan.sent(k):
                    g = recv(shape, dtype, src, group)
                    if j in st.produced:
                        produced_grad[j] = g
                    else:  # a cached copy forwarded on: its leaf collects the gradient
                        leaf = st.blocks[j]
                        leaf.grad = g if leaf.grad is None else leaf.grad + g
                if plan.partial_after(k):
                    tensors.append(st.partial_out)
                    grads.append(recv(shape, dtype, src, group))
            for j, b in st.produced.items():
                g = produced_grad[j]
                if isinstance(b, tuple):  # cache="all": later chunks' uses of the own copy
                    b, copy = b
                    if copy.grad is not None:
                        g = copy.grad if g is None else g + copy.grad
                if g is not None:
                    tensors.append(b)
                    grads.append(g)
            torch.autograd.backward(tensors, grads)
            if k == 0:
                emb_grads.append(st.embedding.grad)
                continue
            dst = plan.stage_of(k - 1)
            for j in plan.sent(k - 1):
                leaf = st.received[j]
                send(torch.zeros(shape, dtype=dtype) if leaf.grad is None else leaf.grad, dst, group,
                     counter, "pp.grad_blocks")
            if plan.partial_after(k - 1):
                g = st.partial_in.grad
                send(torch.zeros(shape, dtype=dtype) if g is None else g, dst, group, counter,
                     "pp.grad_partial")
    return {"losses": losses, "embedding_grads": emb_grads[::-1]}
