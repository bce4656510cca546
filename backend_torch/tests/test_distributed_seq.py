"""Sequence-sharded block AttnRes prefill (paper 4.2) on local gloo worlds of 2 and 4 CPU
processes: outputs and every gradient (embedding, sublayer weights, queries, norm weights) equal
the float64 reference network and the single-process run; the communication is exactly the
TP all-reduce split into reduce-scatter + all-gather."""

from __future__ import annotations

import attnres_torch
import numpy as np
import pytest
import torch
from _helpers import assert_close, f64, rand
from attnres_core.config import ResidualConfig
from attnres_numpy import model as ref
from attnres_torch.distributed import (
    CommCounter,
    all_reduce_grads,
    run_local,
    sequence_sharded_prefill,
    shard_sequence,
)

B, T, D, L, S = 2, 4, 8, 5, 2  # [B, T, D] tokens, sequence at dim 1; 5 sublayers, blocks of 2
CONFIG = ResidualConfig(kind="block", block_size=S, eps=1e-6)


def _inputs(dtype):
    gen = torch.Generator().manual_seed(7)
    emb = rand(gen, (B, T, D), dtype)
    w = rand(gen, (L, D, D), dtype, D ** -0.5)
    queries = rand(gen, (L + 1, D), dtype, 0.5)
    gains = rand(gen, (L + 1, D), dtype, 0.3) + 1
    cot = rand(gen, (B, T, D), dtype).double()
    return emb, w, queries, gains, cot


def _rms(h):
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + CONFIG.eps)


def _column_parallel_probe(w, cols):
    """f_l(h) = tanh(rmsnorm(h) @ W_l): this rank computes its output columns; the rest is 0, so
    the sum over ranks is f_l(h) (the partial form a row-parallel TP sublayer produces)."""
    def sublayer(layer):
        def f(h):
            y = torch.tanh(_rms(h) @ w[layer][:, cols])
            return torch.nn.functional.pad(y, (cols.start, D - cols.stop))
        return f
    return [sublayer(layer) for layer in range(L)]


def _worker(rank, world):
    report = {}
    for dt in ("float64", "float32"):
        emb, w, queries, gains, cot = _inputs(getattr(torch, dt))
        cols = slice(rank * D // world, (rank + 1) * D // world)
        le = shard_sequence(emb, seq_dim=1).requires_grad_()
        lw, lq, lg = (t.clone().requires_grad_() for t in (w, queries, gains))
        counter = CommCounter()
        out, blocks = sequence_sharded_prefill(le, _column_parallel_probe(lw, cols), lq, lg,
                                               block_size=S, seq_dim=1, eps=CONFIG.eps,
                                               counter=counter)
        assert len(blocks) == 1 + -(-L // S) and blocks[1].shape == (B, T // world, D)
        lcot = shard_sequence(cot, seq_dim=1)
        (out.double() * lcot).sum().backward()
        all_reduce_grads([lw, lq, lg])  # W: each rank holds the gradient of its columns only
        # float64 reference network on the upcast inputs.
        params = {"queries": f64(queries), "norm_weights": f64(gains)}
        want = ref.probe_forward(CONFIG, params, f64(emb), f64(w), schedule="two_phase")
        vjp = ref.probe_vjp(CONFIG, params, f64(emb), f64(w), f64(cot))
        tok = slice(rank * T // world, (rank + 1) * T // world)
        assert_close(out, want[:, tok], dt, f"{dt} out", grad=False)
        assert_close(le.grad, vjp["embedding"][:, tok], dt, f"{dt} d_embedding", grad=True)
        assert_close(lw.grad, vjp["sublayer_weights"], dt, f"{dt} d_sublayer_weights", grad=True)
        assert_close(lq.grad, vjp["queries"], dt, f"{dt} d_queries", grad=True)
        assert_close(lg.grad, vjp["norm_weights"], dt, f"{dt} d_norm_weights", grad=True)
        # The single-process run: the same network, all tokens, plain block schedule.
        se, sw, sq, sg = (t.clone().requires_grad_() for t in (emb, w, queries, gains))
        blocks1, partial = [se], None
        for layer in range(L):
            srcs = blocks1 if partial is None else blocks1 + [partial]
            h = attnres_torch.depth_attention(srcs, sq[layer], sg[layer], eps=CONFIG.eps)
            v = torch.tanh(_rms(h) @ sw[layer])
            partial = v if partial is None else partial + v
            if (layer + 1) % S == 0 or layer == L - 1:
                blocks1, partial = blocks1 + [partial], None
        single = attnres_torch.depth_attention(blocks1, sq[L], sg[L], eps=CONFIG.eps)
        (single.double() * cot).sum().backward()
        assert_close(out, f64(single)[:, tok], dt, f"{dt} out vs single process", grad=False)
        assert_close(le.grad, f64(se.grad)[:, tok], dt, f"{dt} d_embedding vs single process", grad=True)
        for got, single_grad, name in ((lw, sw, "W"), (lq, sq, "queries"), (lg, sg, "gains")):
            assert_close(got.grad, f64(single_grad.grad), dt, f"{dt} d_{name} vs single process", grad=True)
        report[dt] = counter.as_dict()
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_sharded_prefill_equals_reference(world):
    reports = run_local(_worker, world)
    tokens = B * T  # per microbatch, the whole sequence of every batch row
    for report in reports:
        el = report["float64"]["elements"]
        # Forward: per sublayer one reduce-scatter of the full [B, T, D] partial and one
        # all-gather of this rank's [B, T/P, D] h: the two halves of TP's all-reduce.
        assert el["seq.reduce_scatter"] == L * tokens * D
        assert el["seq.all_gather"] == L * tokens * D // world
        assert el["seq.backward"] == L * tokens * D + L * tokens * D // world


def test_shard_sequence_rejects_indivisible_lengths():
    def worker(rank, world):
        with pytest.raises(ValueError, match="must divide by the group size 2"):
            shard_sequence(torch.zeros(1, 3, 4), seq_dim=1)
        return np.int64(1)
    assert run_local(worker, 2) == [1, 1]
