"""Pipeline-parallel block AttnRes over torch.distributed point-to-point ops, with the paper's
cross-stage caching (section 4.1) and interleaved virtual stages (`pipeline_plan.PipelinePlan`).

`torch.distributed.pipelining` cannot express the cache: a stage there only sees the tensors its
predecessor sends, while here a stage reuses, in a later virtual stage, blocks it received (or
produced) in an earlier one, and their gradients must flow back through that earlier
transition.  So the runner is built on `send`/`recv`.  With one stage per rank (V = 1) the cache
saves nothing (Eq. 7 = Eq. 8) and the stock stages of `stages.split_stack` move the same volume;
this runner wins with interleaved virtual stages (P = 4, V = 2: 22 d against 28 d per token).

Forward of chunk k on its stage: receive the blocks the plan says it lacks (kept in the stage's
cache as autograd leaves) and the partial sum; run the chunk's sublayers (block AttnRes, spec
M3); send on what chunk k+1's stage lacks.  Backward runs the chunks in reverse: a cached
block's leaf accumulates the gradients of every later use on the stage (and of the copies it
forwarded); once the chunk that received it has run its backward, the total goes back over the
transition it arrived on, so gradients reach the block's origin stage.

Schedules (`pipeline_schedule`): "gpipe" (all forwards, then all backwards), Megatron's "1f1b"
and "interleaved_1f1b".  Every stage follows one global order of passes and transfers (derived
identically on every rank), so blocking send/recv cannot deadlock; a transfer is received as
soon as it is produced and kept until its pass.  The cache is per microbatch and dropped after
the microbatch's last backward on the stage.  Communication does not overlap compute: the runner
provides exactness, communication volume and the schedules' memory, not throughput.

Devices and dtypes: receive buffers and zero gradients are allocated on the stage's device from
the declared `microbatch_shape` and `dtype`; every payload is checked against those before it
is sent, since the receiver cannot see what the sender holds.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ResidualStream

from ..residual_ops import TorchOps
from .comm import CommCounter, check_transfer, recv, send
from .pipeline_plan import PipelinePlan
from .pipeline_schedule import check_schedule, simulate


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
        self.inbox_blocks: Dict[int, torch.Tensor] = {}  # received, not yet consumed
        self.inbox_partial: Optional[torch.Tensor] = None
        self.grad_in_blocks: Dict[int, torch.Tensor] = {}  # gradients from chunk k + 1
        self.grad_in_partial: Optional[torch.Tensor] = None


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


def _stage_device(device, queries: torch.Tensor) -> torch.device:
    """The device this stage's tensors live on (default: the queries')."""
    device = queries.device if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _Runner:
    """One stage's part of the pipeline: chunk states, the per-microbatch cache, transfers."""

    def __init__(self, plan, rank, group, counter, shape, dtype, device, embeddings, sublayers,
                 queries, norm_weights, loss_fn, eps, scale):
        self.plan, self.rank, self.group, self.counter = plan, rank, group, counter
        self.shape, self.dtype, self.device = shape, dtype, device
        self.embeddings, self.sublayers, self.loss_fn = embeddings, sublayers, loss_fn
        self.queries, self.norm_weights, self.eps, self.scale = queries, norm_weights, eps, scale
        self.last = plan.num_chunks - 1
        self.first_chunk = rank  # this stage's lowest chunk: the last backward of a microbatch
        self.states: Dict[tuple, _ChunkState] = {}  # (m, k) -> state, alive from input to backward
        self.caches: Dict[int, Dict[int, torch.Tensor]] = {}  # m -> this stage's blocks (leaves)
        self.grads_out: Dict[tuple, List[torch.Tensor]] = {}  # (m, k) -> gradients to send back
        M = len(embeddings)
        self.losses: List[Optional[torch.Tensor]] = [None] * M
        self.emb_grads: List[Optional[torch.Tensor]] = [None] * M
        self.live: Dict[int, int] = {}  # m -> chunks of m whose forward ran, backward not yet
        self.peak_in_flight = self.peak_chunks = self.peak_received = 0

    def state(self, m: int, k: int) -> _ChunkState:
        return self.states.setdefault((m, k), _ChunkState())

    # -- transfers ---------------------------------------------------------------------------
    def _payload_names(self, m, k, backward):
        """(names of the tensors crossing transition k -> k + 1 of microbatch m, in order)."""
        arrow = f"chunk {k + 1} -> {k}" if backward else f"chunk {k} -> {k + 1}"
        what = "gradient of " if backward else ""
        names = [f"{what}block b_{j} on transition {arrow} (microbatch {m})"
                 for j in self.plan.sent(k)]
        if self.plan.partial_after(k):
            names.append(f"{what}the partial sum on transition {arrow} (microbatch {m})")
        return names

    def transfer(self, m: int, k: int, backward: bool) -> None:
        """Transition k -> k + 1 of microbatch m: the forward payload (blocks the next stage
        lacks, then the partial sum), or with backward=True their gradients coming back."""
        plan = self.plan
        src, dst = plan.stage_of(k), plan.stage_of(k + 1)
        if backward:
            src, dst = dst, src
        if self.rank not in (src, dst):
            return
        names = self._payload_names(m, k, backward)
        if self.rank == src:
            payload = self.grads_out.pop((m, k + 1)) if backward else self.outputs(m, k)
            for t, name in zip(payload, names):
                check_transfer(t, name, self.shape, self.dtype, self.device)
        if src == dst:  # one stage: the transition stays in the process (nothing on the wire)
            received = [t.detach() for t in payload]
        elif self.rank == src:
            block_cat, partial_cat = (("pp.grad_blocks", "pp.grad_partial") if backward
                                      else ("pp.blocks", "pp.partial"))
            for i, t in enumerate(payload):
                cat = block_cat if i < len(plan.sent(k)) else partial_cat
                send(t, dst, self.group, self.counter, cat)
            return
        else:  # the buffer is allocated from the declared shape, dtype and this stage's device
            received = [recv(self.shape, self.dtype, self.device, src, self.group) for _ in names]
        st = self.state(m, k if backward else k + 1)
        blocks = dict(zip(plan.sent(k), received))
        partial = received[len(blocks)] if plan.partial_after(k) else None
        if backward:
            st.grad_in_blocks, st.grad_in_partial = blocks, partial
        else:
            st.inbox_blocks, st.inbox_partial = blocks, partial

    def outputs(self, m, k) -> List[torch.Tensor]:
        """What chunk k of microbatch m sends on: the blocks chunk k + 1's stage lacks, then the
        partial sum (detached: the receiver's copies are autograd leaves)."""
        st = self.states[(m, k)]
        out = [st.blocks[j].detach() for j in self.plan.sent(k)]
        if self.plan.partial_after(k):
            out.append(st.partial_out.detach())
        return out

    # -- passes ------------------------------------------------------------------------------
    def forward(self, m: int, k: int) -> None:
        plan = self.plan
        st = self.state(m, k)
        cache = self.caches.setdefault(m, {})
        partial = None
        if k == 0:
            st.embedding = self.embeddings[m].detach().clone().requires_grad_()
            blocks = {0: st.embedding.view_as(st.embedding)}
            st.produced[0] = blocks[0]
        else:
            for j, t in st.inbox_blocks.items():
                cache[j] = st.received[j] = t.requires_grad_()
            if st.inbox_partial is not None:
                partial = st.partial_in = st.inbox_partial.requires_grad_()
            st.inbox_blocks, st.inbox_partial = {}, None
            blocks = {j: cache[j] for j in range(plan.blocks_after(k - 1))}
        st.blocks = blocks
        produced, partial, out = _run_chunk(plan, k, blocks, partial, self.sublayers, self.queries,
                                            self.norm_weights, self.eps, self.scale)
        st.produced.update(produced)
        st.partial_out = partial
        if k == self.last:
            st.loss = self.loss_fn(out, m)
            self.losses[m] = st.loss.detach()
        elif plan.cache == "all":
            for j, b in st.produced.items():
                cache[j] = b.detach().requires_grad_()
                st.produced[j] = (b, cache[j])
        self.live[m] = self.live.get(m, 0) + 1
        self.peak_in_flight = max(self.peak_in_flight, len(self.live))
        self.peak_chunks = max(self.peak_chunks, sum(self.live.values()))
        self.peak_received = max(self.peak_received,
                                 sum(len(s.received) for s in self.states.values()))

    def backward(self, m: int, k: int) -> None:
        plan = self.plan
        st = self.states.pop((m, k))
        self.live[m] -= 1
        if not self.live[m]:
            del self.live[m]
        tensors, grads = [], []
        produced_grad = {j: None for j in st.produced}
        if k == self.last:
            tensors.append(st.loss)
            grads.append(torch.ones_like(st.loss))
        else:
            for j, g in st.grad_in_blocks.items():
                if j in st.produced:
                    produced_grad[j] = g
                else:  # a cached copy forwarded on: its leaf collects the gradient
                    leaf = st.blocks[j]
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
            if plan.partial_after(k):
                tensors.append(st.partial_out)
                grads.append(st.grad_in_partial)
        for j, b in st.produced.items():
            g = produced_grad[j]
            if isinstance(b, tuple):  # cache="all": later chunks' uses of the own copy
                b, copy = b
                if copy.grad is not None:
                    g = copy.grad if g is None else g + copy.grad
            if g is not None:
                tensors.append(b)
                grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        if k == self.first_chunk:  # the microbatch's last pass on this stage: drop its cache
            self.caches.pop(m, None)
        if k == 0:
            self.emb_grads[m] = st.embedding.grad
            return
        # Unused inputs get zero gradients, on this stage's device (NCCL rejects host tensors).
        out = [self._grad_or_zeros(st.received[j].grad) for j in plan.sent(k - 1)]
        if plan.partial_after(k - 1):
            out.append(self._grad_or_zeros(st.partial_in.grad))
        self.grads_out[(m, k)] = out

    def _grad_or_zeros(self, g):
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device) if g is None else g


def run_pipeline(plan: PipelinePlan, embeddings: Sequence[Optional[torch.Tensor]], sublayers: Sequence[Callable],
                 queries: torch.Tensor, norm_weights: Optional[torch.Tensor], loss_fn: Callable, *,
                 microbatch_shape, dtype: torch.dtype, group=None, eps: float = 1e-6,
                 scale: float = 1.0, counter: Optional[CommCounter] = None,
                 schedule: str = "gpipe", device=None) -> dict:
    """Forward and backward of a block AttnRes stack over the stages of `group`.

    Args:
      plan: the layout (num_stages must equal the group size); plan.block_size is S.  One stage
        (num_stages = 1) runs every chunk in this process: its transitions move no data.
      embeddings: M microbatch embeddings `microbatch_shape` = `[..., D]` (read on stage 0 only;
        pass None elsewhere, but the same M everywhere).
      sublayers: L callables `h [..., D] -> v [..., D]`; a stage only calls those of its chunks.
      queries, norm_weights: `[L + 1, D]` (norm_weights may be None); a stage reads its rows
        (row L on the last chunk's stage).  Their `.grad` (and the sublayers' parameters')
        accumulate this stage's gradients.
      loss_fn: `(out [..., D], microbatch index) -> scalar`, called on the last chunk's stage.
      microbatch_shape, dtype: the `[..., D]` shape and dtype of every transferred tensor (the
        stack's activation dtype).  Receive buffers are allocated from them, and every payload
        is checked against them before it is sent (ValueError / TypeError on a mismatch).
      counter: optional CommCounter ("pp.blocks", "pp.partial", "pp.grad_blocks",
        "pp.grad_partial": elements this stage sent).
      schedule: "gpipe" (all forwards, then all backwards), "1f1b" (V = 1) or
        "interleaved_1f1b" (V >= 2, M a multiple of P); see `pipeline_schedule`.
      device: this stage's device (default: queries.device); buffers are allocated there.

    Returns {"losses": [M detached losses] on the last chunk's stage,
             "embedding_grads": [M tensors] on stage 0} (empty lists elsewhere), and this
    stage's "peak_chunks" (most chunk passes whose activations it held at once),
    "peak_in_flight" (most microbatches among them: the cache is per microbatch) and
    "peak_received_blocks" (most received block copies it held at once).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(plan, PipelinePlan):
        raise TypeError(f"plan: expected a PipelinePlan, got {type(plan).__name__}")
    if plan.num_stages != world:
        raise ValueError(f"plan: num_stages={plan.num_stages} must equal the group size {world}")
    if len(sublayers) != plan.num_layers or queries.dim() != 2 or queries.shape[0] != plan.num_layers + 1:
        raise ValueError(f"sublayers/queries: expected {plan.num_layers} sublayers and queries of "
                         f"shape [{plan.num_layers + 1}, D], got {len(sublayers)} sublayers and "
                         f"shape {tuple(queries.shape)}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    shape = tuple(microbatch_shape)
    if not shape or shape[-1] != queries.shape[1]:
        raise ValueError(f"microbatch_shape: expected [..., D] with D = {queries.shape[1]} (the "
                         f"queries' last dimension), got {shape}")
    num_micro = len(embeddings)
    check_schedule(schedule, plan, num_micro)
    device = _stage_device(device, queries)
    for name, t in (("queries", queries), ("norm_weights", norm_weights)):
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected on this stage's device {device}, got {t.device}")
    if rank == plan.stage_of(0):  # the embeddings enter the pipeline here: check them first
        for m, e in enumerate(embeddings):
            check_transfer(e, f"embeddings[{m}]", shape, dtype, device)
    runner = _Runner(plan, rank, group, counter, shape, dtype, device, embeddings, sublayers,
                     queries, norm_weights, loss_fn, eps, scale)
    events, _ = simulate(plan, num_micro, schedule)
    for kind, m, k in events:
        if kind == "send_F":
            runner.transfer(m, k, backward=False)
        elif kind == "send_B":
            runner.transfer(m, k - 1, backward=True)
        elif plan.stage_of(k) == rank:
            (runner.forward if kind == "F" else runner.backward)(m, k)
    last = plan.stage_of(plan.num_chunks - 1) == rank
    return {"losses": runner.losses if last else [],
            "embedding_grads": runner.emb_grads if rank == plan.stage_of(0) else [],
            "peak_chunks": runner.peak_chunks, "peak_in_flight": runner.peak_in_flight,
            "peak_received_blocks": runner.peak_received}
