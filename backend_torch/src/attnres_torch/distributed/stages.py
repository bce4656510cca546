"""An AttnRes stack cut into stock `torch.distributed.pipelining` stages.

A stock pipeline stage sees only what its predecessor sends.  AttnRes needs more than the hidden
state at a cut: Block AttnRes reads the completed blocks b_0..b_{n-1} and the open partial sum,
Full AttnRes every output v_0..v_{l-1}.  So a chunk of the stack sends all of them on, as the
extra outputs of its stage (a tuple of tensors, which `PipelineStage` sends and whose gradients
it returns), and the next chunk resumes the residual stream from them.  For one stage per rank
(GPipe, 1F1B) this moves exactly what the cached point-to-point runner moves (`run_pipeline`,
paper Eq. 8); interleaved schedules send every block again to every later chunk (Eq. 7).

    chunks = split_stack(model.router, model.sublayers, [3, 3], pre=model.embed,
                         post=nn.Sequential(model.norm, model.head))   # or split_transformer
    stages = pipeline_stages(chunks, device)          # this rank's PipelineStage(s)
    schedule = ScheduleGPipe(stages[0], n_microbatches, loss_fn=loss_fn)

Parameters: a chunk owns its sublayers, `pre` on the first chunk, `post` on the last, and as its
own `nn.Parameter`s the router rows its sublayers read (router row `row_offset + i` is the
chunk's row i, a view of the router's storage); `pipeline_stages` refuses chunks that share a
parameter.  Why, and what a transition carries: docs/distributed.md ("Parameters", "The
shared-parameter trap").

Supported: `kind="block"` and `"full"` with per-sublayer rows (`query_sharing="none"`, no
`key_rank`), static or input-dependent queries, any activation, heads and `fuse_out_norm`.  The
chunks run the direct schedule (training and evaluation give the same function, spec M9).
`resume_stream` / `carried_tensors` are the cut's two sides; `split_hf` (hf_stages.py) cuts a
converted Hugging Face model with them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from attnres_core.schedule import ResidualStream
from torch import nn

from ..modules import DepthRouter
from ..residual_ops import TorchOps

#: The router parameters with one row per sublayer (and one for the output): what a chunk owns.
ROW_PARAMS = ("queries", "query_weights", "norm_weights", "out_norm_weights")


class _Rows:
    """Rows [offset, offset + n) of a router parameter, indexed by the router's row numbers."""

    def __init__(self, param: torch.Tensor, offset: int):
        self.param, self.offset = param, offset

    def __getitem__(self, index):
        if not isinstance(index, int) or not 0 <= index - self.offset < self.param.shape[0]:
            raise IndexError(f"row {index!r}: this chunk owns the router rows {self.offset}.."
                             f"{self.offset + self.param.shape[0] - 1}")
        return self.param[index - self.offset]


def carried_count(config, layer: int) -> int:
    """How many tensors a cut before sublayer `layer` (1-based) carries: Block AttnRes the
    completed blocks and, inside a block, the partial sum; Full AttnRes v_0..v_{layer-1}."""
    if config.kind == "block":
        return (layer - 1) // config.block_size + 1 + ((layer - 1) % config.block_size != 0)
    return layer


class StackChunk(nn.Module):
    """Sublayers `first`..`last` (1-based) of an AttnRes stack, as the module of one pipeline stage.

    forward(*inputs): the first chunk takes what `pre` takes (or the embedding v_0 `[..., D]`),
    a later chunk the tensors its predecessor returned; it returns the carried tensors (a tuple,
    `carried_count(config, last + 1)` of them), the last chunk `post(h)` (or h, the stack's
    output before any final norm)."""

    def __init__(self, router: DepthRouter, sublayers: Sequence[nn.Module], first: int, last: int,
                 pre: Optional[nn.Module] = None, post: Optional[nn.Module] = None):
        super().__init__()
        self.config, self.num_layers, self.first, self.last = router.config, router.num_layers, first, last
        self.is_first, self.is_last = first == 1, last == router.num_layers
        self.pre = pre if self.is_first else None
        self.post = post if self.is_last else None
        self.sublayers = nn.ModuleList(sublayers)
        self.save = router.save
        self.row_offset = first - 1
        stop = last + 1 if self.is_last else last  # the last chunk also reads the output row L
        self.row_params = []
        for name in ROW_PARAMS:
            p = getattr(router, name, None)
            if p is None:
                continue
            self.register_parameter(name, nn.Parameter(p.detach()[first - 1:stop]))
            self.row_params.append(name)

    def extra_repr(self) -> str:
        return f"sublayers {self.first}..{self.last} of {self.num_layers}, kind={self.config.kind!r}"

    def _ops(self) -> TorchOps:
        return TorchOps({n: _Rows(getattr(self, n), self.row_offset) for n in self.row_params},
                        save=self.save)

    def _stream(self, inputs) -> ResidualStream:
        cfg, L, ops = self.config, self.num_layers, self._ops()
        if self.is_first:
            emb = self.pre(*inputs) if self.pre is not None else _one(inputs)
            return ResidualStream(cfg, ops, emb, num_layers=L, schedule="direct")
        want = carried_count(cfg, self.first)
        if len(inputs) != want:
            raise ValueError(f"inputs: the chunk of sublayers {self.first}..{self.last} resumes "
                             f"from {want} carried tensors, got {len(inputs)}")
        return resume_stream(cfg, ops, L, self.first, inputs)

    def forward(self, *inputs):
        stream = self._stream(inputs)
        for f in self.sublayers:
            stream.push(f(stream.input()))
        if self.is_last:
            h = stream.output()
            return self.post(h) if self.post is not None else h
        return carried_tensors(stream)


def resume_stream(config, ops, num_layers: int, layer: int, carried: Sequence[torch.Tensor]) -> ResidualStream:
    """The direct-schedule stream before sublayer `layer` (1-based), from the `carried_count(config,
    layer)` tensors a cut there carries (`carried_tensors` of the stream that ran sublayers
    1..layer - 1)."""
    if config.kind == "block":
        sealed = (layer - 1) % config.block_size == 0
        blocks, partial = (carried, None) if sealed else (carried[:-1], carried[-1])
        return ResidualStream.resume(config, ops, num_layers=num_layers, layer=layer,
                                     blocks=list(blocks), partial=partial)
    stream = ResidualStream(config, ops, carried[0], num_layers=num_layers, schedule="direct")
    stream.layer = layer  # Full AttnRes: the outputs v_0..v_{layer-1} so far
    stream.values = list(carried)
    stream.value_stats = [stream._stats(v) for v in carried]
    stream.value_labels = [f"v{j}" for j in range(len(carried))]
    return stream


def carried_tensors(stream: ResidualStream) -> tuple:
    """What a cut after the stream's last pushed sublayer carries: Block the completed blocks and
    the open partial sum (if any), Full every output v_0..v_{l-1}."""
    if stream.config.kind == "block":
        return tuple(stream.blocks) + (() if stream.partial is None else (stream.partial,))
    return tuple(stream.values)


def _one(inputs):
    if len(inputs) != 1:
        raise ValueError(f"inputs: the first chunk takes the embedding v_0, got {len(inputs)} tensors")
    return inputs[0]


def check_router(router: DepthRouter) -> None:
    """Refuses a router whose parameters are not one row per sublayer (what a chunk can own)."""
    cfg = router.config
    if cfg.kind not in ("block", "full"):
        raise ValueError(f"router: pipeline stages carry Block or Full AttnRes, got kind={cfg.kind!r}")
    if cfg.query_sharing != "none" or cfg.key_rank is not None:
        raise ValueError(f"router: query_sharing={cfg.query_sharing!r} and key_rank={cfg.key_rank!r} "
                         f"share parameter rows across sublayers, so no chunk can own them; use "
                         f"query_sharing='none' and key_rank=None")
    extra = set(dict(router.named_parameters())) - set(ROW_PARAMS)
    if extra:
        raise ValueError(f"router: parameters {sorted(extra)} are not per-sublayer rows")


def split_stack(router: DepthRouter, sublayers: Sequence[nn.Module], sizes: Sequence[int], *,
                pre: Optional[nn.Module] = None, post: Optional[nn.Module] = None) -> List[StackChunk]:
    """The stack `router(pre(x), sublayers)` then `post`, cut into len(sizes) chunks of
    sizes[k] consecutive sublayers (summing to L), for `torch.distributed.pipelining`.

    sublayers: the router's L sublayers, modules `[..., D] -> [..., D]` (their parameters belong to
      their chunk; a plain function or lambda is refused, since the parameters it closes over would
      be neither scaled by the schedule nor stepped by the stage's optimizer).
    pre: the first chunk's module before the stack (an embedding: tokens -> v_0), or None.
    post: the last chunk's module after it (the final norm and head), or None.
    Returns one `StackChunk` per chunk, chunk k for `PipelineStage(chunks[k], k, len(sizes), ...)`
    (`pipeline_stages` builds this rank's)."""
    check_router(router)
    L = router.num_layers
    for what, m in [(f"sublayers[{i}]", f) for i, f in enumerate(sublayers)] + [("pre", pre), ("post", post)]:
        if m is not None and not isinstance(m, nn.Module):
            raise TypeError(f"{what}: expected an nn.Module, got {type(m).__name__}; a chunk must own "
                            f"the parameters it uses (the schedules scale and the optimizer steps "
                            f"`stage.submod.parameters()`), which a function or lambda hides: wrap "
                            f"it in a module that holds them")
    if len(sublayers) != L:
        raise ValueError(f"sublayers: the router has {L} sublayers, got {len(sublayers)}")
    if (not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
            or sum(sizes) != L):
        raise ValueError(f"sizes: expected ints >= 1 summing to L = {L}, got {list(sizes)!r}")
    chunks, first = [], 1
    for s in sizes:
        chunks.append(StackChunk(router, sublayers[first - 1:first - 1 + s], first, first + s - 1,
                                 pre=pre, post=post))
        first += s
    return chunks


class _Embed(nn.Module):
    """AttnResTransformer's token (and learned position) embedding: tokens -> v_0."""

    def __init__(self, model):
        super().__init__()
        self.embed = model.embed
        self.pos = getattr(model, "pos", None) if model.positional == "learned" else None
        self.context = model.context

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.pos is not None:
            if tokens.shape[1] > self.context:
                raise ValueError(f"tokens: expected [B, T] with T <= context = {self.context}, "
                                 f"got shape {tuple(tokens.shape)}")
            h = h + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return h


def split_transformer(model, sizes: Sequence[int]) -> List[StackChunk]:
    """`split_stack` of an `AttnResTransformer`: chunk 0 embeds the tokens `[B, T]`, the last
    chunk returns the logits (final norm and head)."""
    return split_stack(model.router, list(model.sublayers), sizes, pre=_Embed(model),
                       post=nn.Sequential(model.norm, model.head))


def shared_parameters(modules: Sequence[nn.Module]) -> List[tuple]:
    """(name in module i, i, name in module j, j) for every parameter two modules share."""
    seen, shared = {}, []
    for i, m in enumerate(modules):
        for name, p in m.named_parameters(remove_duplicate=False):
            if id(p) in seen and seen[id(p)][1] != i:
                shared.append(seen[id(p)] + (name, i))
            else:
                seen.setdefault(id(p), (name, i))
    return shared


def pipeline_stages(chunks: Sequence[nn.Module], device, *, group=None) -> list:
    """This rank's `torch.distributed.pipelining.PipelineStage`s: chunk k runs on rank
    k mod P of `group` (P ranks; the layout of `ScheduleInterleaved1F1B`, and of `ScheduleGPipe`
    / `Schedule1F1B` with one chunk per rank).  Pass the list to an interleaved schedule, its
    one element to a single-stage one.

    Refuses (ValueError) chunks that share a parameter: the schedules divide every stage's
    gradients by the microbatch count (`scale_grads`), so a parameter in two stages of one rank
    is divided twice, and one in stages of two ranks gets two partial gradients nobody sums."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    shared = shared_parameters(chunks)
    if shared:
        a, i, b, j = shared[0]
        raise ValueError(f"chunks: chunk {i}'s {a} is chunk {j}'s {b} (and {len(shared) - 1} more "
                         f"shared); under stock pipelining its gradient would be scaled once per "
                         f"stage and never summed across ranks: untie it, or keep the modules that "
                         f"share it in one chunk")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n = len(chunks)
    if n % world:
        raise ValueError(f"chunks: {n} chunks on {world} ranks; stock schedules need the same "
                         f"number of stages on every rank (a multiple of {world})")
    return [PipelineStage(chunks[k], k, n, torch.device(device), group=group)
            for k in range(rank, n, world)]
