"""An AttnRes stack under stock `torch.distributed.pipelining` (`attnres_torch.distributed.stages`):
an `AttnResTransformer`, Block (a cut inside a block: the partial sum is carried) and Full AttnRes,
split into `PipelineStage`s on a local gloo world of 2 CPU processes, under `ScheduleGPipe`,
`Schedule1F1B` (one stage per rank) and `ScheduleInterleaved1F1B` (two per rank). The losses
equal one process's bitwise, and every gradient (embedding, sublayers, head, every router row)
equals one process's mean over the microbatches bitwise (one process computing in one CPU thread,
as the ranks do: with two, the gradients differed by up to 1.2e-6 relative). Chunks that share a parameter are refused (the
`scale_grads` trap); the carried volume per token is Eq. 7's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import stock_schedule_step
from attnres_torch import AttnResTransformer, DepthRouter, ResidualConfig
from attnres_torch.distributed import (
    PipelinePlan,
    eq7_naive,
    eq8_cached,
    pipeline_stages,
    run_local,
    split_stack,
    split_transformer,
)
from torch import nn

VOCAB, M = 32, 4  # vocabulary, microbatches (2 sequences each)
CONFIGS = {"block": ResidualConfig(kind="block", block_size=2), "full": ResidualConfig(kind="full")}
# chunk sizes over L = 6 sublayers: one chunk per rank, and two per rank (interleaved)
LAYOUTS = {"gpipe": [3, 3], "1f1b": [3, 3], "interleaved": [2, 1, 2, 1]}


def _model(kind):
    torch.manual_seed(0)
    model = AttnResTransformer(VOCAB, 8, 3, 2, CONFIGS[kind])
    with torch.no_grad():  # trained-looking router rows: the depth weights are not uniform
        for p in model.router.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _data():
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (2 * M, 5), generator=gen),
            torch.randint(0, VOCAB, (2 * M, 5), generator=gen))


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _rank(rank, world, kind):
    tokens, target = _data()
    return {name: stock_schedule_step(rank, split_transformer(_model(kind), sizes), name, M, tokens,
                                      target, _loss)
            for name, sizes in LAYOUTS.items()}


@pytest.mark.parametrize("kind", ["block", "full"])
def test_stock_schedules_equal_one_process(kind):
    results = run_local(_rank, 2, kind, timeout=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_local's ranks: a CPU matmul's rounding may follow the threads
    try:
        _compare(kind, results)
    finally:
        torch.set_num_threads(threads)


def _compare(kind, results):
    model = _model(kind)
    tokens, target = _data()
    losses = []
    for m in range(M):  # one process: the mean loss over the microbatches
        loss = _loss(model(tokens[2 * m: 2 * m + 2]), target[2 * m: 2 * m + 2])
        (loss / M).backward()
        losses.append(loss.item())
    for name, sizes in LAYOUTS.items():
        chunks = split_transformer(model, sizes)
        want = {}
        for k, chunk in enumerate(chunks):
            for n, p in chunk.named_parameters():
                if n in chunk.row_params:  # the chunk's router rows: those rows of the router's grad
                    g = getattr(model.router, n).grad[chunk.row_offset: chunk.row_offset + p.shape[0]]
                else:
                    g = p.grad
                want[(k, n)] = g.numpy()
        got = {**results[0][name][1], **results[1][name][1]}
        assert got.keys() == want.keys(), name
        assert sum(p.shape[0] for c in chunks for n, p in c.named_parameters() if n == "queries") == 7
        for key, g in want.items():
            assert np.array_equal(got[key], g), (name, key, float(np.max(np.abs(got[key] - g))))
        last = (len(sizes) - 1) % 2  # the rank holding the last stage reports the losses
        assert results[last][name][0] == losses, name  # bitwise
        assert results[1 - last][name][0] == []


def test_chunk_rows_are_the_routers_rows():
    model = _model("block")
    chunks = split_transformer(model, [2, 1, 2, 1])
    rows = [(c.row_offset, c.queries.shape[0]) for c in chunks]
    assert rows == [(0, 2), (2, 1), (3, 2), (5, 2)]  # the last chunk also owns the output row L
    assert all(c.queries.data_ptr() == model.router.queries[c.row_offset].data_ptr() for c in chunks)
    with torch.no_grad():  # an optimizer's in-place step on a chunk's rows is the router's
        chunks[2].norm_weights.add_(1.0)
    assert torch.equal(model.router.state_dict()["norm_weights"][3:5], chunks[2].norm_weights)
    # the chunks hold every other parameter of the model, each once, and nothing else
    held = [p for c in chunks for n, p in c.named_parameters() if n not in c.row_params]
    others = [p for n, p in model.named_parameters() if not n.startswith("router.")]
    assert len(held) == len({id(p) for p in held}) and {id(p) for p in held} == {id(p) for p in others}


def test_shared_parameter_between_chunks_is_refused():
    router = DepthRouter(CONFIGS["block"], 4, 8)
    shared = nn.Linear(8, 8)  # one module used as sublayers 1 and 4 (tied weights)
    sublayers = [shared, nn.Linear(8, 8), nn.Linear(8, 8), shared]
    chunks = split_stack(router, sublayers, [2, 2])
    with pytest.raises(ValueError, match=r"chunk 0's sublayers.0.weight is chunk 1's sublayers.1.weight.*scaled once per stage"):
        pipeline_stages(chunks, "cpu")  # refused before any process group is needed
    # the route the users built: every stage holding the whole router
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = router
    with pytest.raises(ValueError, match="chunk 0's router.queries is chunk 1's router.queries"):
        pipeline_stages([Holder(), Holder()], "cpu")


def test_unsupported_routers_and_sizes_are_refused():
    subs = [nn.Identity()] * 4
    with pytest.raises(ValueError, match="Block or Full"):
        split_stack(DepthRouter(ResidualConfig(kind="window", window=2), 4, 8), subs, [2, 2])
    with pytest.raises(ValueError, match="query_sharing='block'.*no chunk can own"):
        split_stack(DepthRouter(ResidualConfig(kind="block", block_size=2, query_sharing="block"), 4, 8),
                    subs, [2, 2])
    with pytest.raises(ValueError, match="summing to L = 4"):
        split_stack(DepthRouter(CONFIGS["full"], 4, 8), subs, [2, 1])
    chunks = split_stack(DepthRouter(CONFIGS["full"], 4, 8), subs, [2, 2])
    with pytest.raises(ValueError, match="resumes from 3 carried tensors, got 2"):
        chunks[1](torch.zeros(3, 8), torch.zeros(3, 8))


@pytest.mark.parametrize("P, V", [(4, 1), (2, 1), (4, 2), (2, 3)])
def test_carried_volume_is_eq7(P, V):
    """What the stages send per token: every completed block to every later chunk (Eq. 7) plus a
    partial sum per transition. With one stage per rank that equals the cached runner's Eq. 8;
    interleaved schedules (V > 1) send more."""
    plan = PipelinePlan.steady(P, V, 1, 2)  # N_p = 1, chunks ending one sublayer into a block
    L = sum(plan.chunk_sizes)
    router = DepthRouter(CONFIGS["block"], L, 4)
    chunks = split_stack(router, [nn.Linear(4, 4) for _ in range(L)], list(plan.chunk_sizes))
    sent = []
    for c in chunks[:-1]:
        c.register_forward_hook(lambda m, i, out: sent.append(sum(t.numel() for t in out)))
    with torch.no_grad():
        x = torch.randn(1, 4)
        for c in chunks:
            x = c(*x) if isinstance(x, tuple) else c(x)
    per_token = sum(sent) // 4  # elements / D, one token
    assert per_token == eq7_naive(P, V, 1) + (P * V - 1)
    assert (eq7_naive(P, V, 1) == eq8_cached(P, V, 1)) == (V == 1)
    if (P, V) == (4, 2):
        assert (eq7_naive(P, V, 1), eq8_cached(P, V, 1)) == (28, 22)  # docs/distributed.md


class _Tanh(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h):
        return torch.tanh(self.lin(F.rms_norm(h, (h.shape[-1],))))


VARIANTS = {
    "block_fused": ResidualConfig(kind="block", block_size=3, fuse_out_norm=True),
    "full_input_query_sigmoid": ResidualConfig(kind="full", query="input", activation="sigmoid"),
    "block_heads_no_key_norm": ResidualConfig(kind="block", block_size=2, num_heads=2, key_norm=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunks_in_one_process_equal_the_router(variant):
    """Every supported router option through the chunks, in one process: the output and every
    gradient equal `router(embedding, sublayers)`, bitwise."""
    torch.manual_seed(0)
    router = DepthRouter(VARIANTS[variant], 7, 8)
    with torch.no_grad():
        for p in router.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    sublayers = [_Tanh(8) for _ in range(7)]
    emb = torch.randn(2, 3, 8, requires_grad=True)
    cot = torch.randn(2, 3, 8)
    (router(emb, sublayers) * cot).sum().backward()
    want = [emb.grad.clone()] + [p.grad.clone() for s in sublayers for p in s.parameters()]
    rows = {n: p.grad.clone() for n, p in router.named_parameters()}
    emb.grad = None
    for s in sublayers:
        s.zero_grad()
    chunks = split_stack(router, sublayers, [2, 1, 3, 1])
    x = (emb,)
    for c in chunks:
        x = c(*x)
        x = x if isinstance(x, tuple) else (x,)
    (x[0] * cot).sum().backward()
    got = [emb.grad] + [p.grad for s in sublayers for p in s.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for n, g in rows.items():
        assert torch.equal(torch.cat([getattr(c, n).grad for c in chunks]), g), n


def test_a_function_as_sublayer_is_refused():
    lin = nn.Linear(8, 8)
    with pytest.raises(TypeError, match=r"sublayers\[1\]: expected an nn.Module, got function.*wrap"):
        split_stack(DepthRouter(CONFIGS["full"], 2, 8), [lin, lambda h: lin(h)], [1, 1])
