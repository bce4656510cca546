"""Pipeline parallelism with cross-stage caching (paper 4.1) on local gloo worlds of 2 and 4
CPU processes: losses, the embedding gradient and every parameter gradient equal the float64
reference network for every cache policy; the elements actually sent reproduce Eq. (7) (naive)
and Eq. (8) (cached) times the tokens and D, forward and backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _helpers import assert_close, f64, rand
from attnres_numpy import model as ref
from attnres_numpy.config import ResidualConfig
from attnres_torch.distributed import (
    CommCounter,
    PipelinePlan,
    eq7_naive,
    eq8_cached,
    run_local,
    run_pipeline,
)

D, TOKENS, M = 8, (3,), 2  # hidden size, tokens per microbatch, microbatches


def _inputs(num_layers, dtype):
    gen = torch.Generator().manual_seed(num_layers)
    emb = [rand(gen, TOKENS + (D,), dtype) for _ in range(M)]
    w = rand(gen, (num_layers, D, D), dtype, D ** -0.5)
    queries = rand(gen, (num_layers + 1, D), dtype, 0.5)
    gains = rand(gen, (num_layers + 1, D), dtype, 0.3) + 1
    cots = [rand(gen, TOKENS + (D,), dtype) for _ in range(M)]
    return emb, w, queries, gains, cots


def _probe(w, eps):
    def sublayer(layer):
        def f(h):
            return torch.tanh(h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) @ w[layer])
        return f
    return [sublayer(layer) for layer in range(w.shape[0])]


def _worker(rank, world, configs, dt):
    dtype = getattr(torch, dt)
    report = []
    for (p, v, n_p, s, offset), cache in configs:
        plan = PipelinePlan.steady(p, v, n_p, s, offset=offset, cache=cache)
        L = plan.num_layers
        config = ResidualConfig(kind="block", block_size=s)
        emb, w, queries, gains, cots = _inputs(L, dtype)
        lw, lq, lg = (t.clone().requires_grad_() for t in (w, queries, gains))
        counter = CommCounter()
        res = run_pipeline(plan, emb if rank == 0 else [None] * M, _probe(lw, config.eps), lq, lg,
                           lambda out, m: (out.double() * cots[m]).sum(), microbatch_shape=TOKENS + (D,),
                           dtype=dtype, eps=config.eps, counter=counter)
        for t in (lw, lq, lg):  # each row's gradient lives on the stage that owns it
            dist.all_reduce(t.grad)
        params = {"queries": f64(queries), "norm_weights": f64(gains)}
        vjps = [ref.probe_vjp(config, params, f64(emb[m]), f64(w), f64(cots[m])) for m in range(M)]
        if plan.stage_of(plan.num_chunks - 1) == rank:
            outs = [ref.probe_forward(config, params, f64(emb[m]), f64(w)) for m in range(M)]
            want = [float(np.sum(o * f64(c))) for o, c in zip(outs, cots)]
            assert_close(torch.stack(res["losses"]), want, dt, f"{cache} losses")
        if rank == 0:
            assert_close(res["embedding_grads"], [g["embedding"] for g in vjps], dt, f"{cache} d_emb")
        for got, key in ((lw, "sublayer_weights"), (lq, "queries"), (lg, "norm_weights")):
            assert_close(got.grad, sum(g[key] for g in vjps), dt, f"{cache} d_{key}")
        report.append(counter.as_dict()["elements"])
    return report


def _check_volumes(reports, configs):
    per_transfer = M * int(np.prod(TOKENS)) * D  # elements of one block representation
    for i, ((p, v, n_p, s, offset), cache) in enumerate(configs):
        total = {}
        for rep in reports:
            for key, n in rep[i].items():
                total[key] = total.get(key, 0) + n
        plan = PipelinePlan.steady(p, v, n_p, s, offset=offset, cache=cache)
        blocks = {"none": eq7_naive(p, v, n_p), "received": eq8_cached(p, v, n_p),
                  "all": (p * (p - 1) // 2 + (v - 1) * p * (p - 1)) * n_p}[cache]
        assert total["pp.blocks"] == blocks * per_transfer, (cache, total)
        assert total["pp.grad_blocks"] == blocks * per_transfer, (cache, total)  # backward mirrors
        # A partial sum crosses every transition that falls inside a block (none when offset = 0).
        partials = (p * v - 1) if offset else 0
        assert plan.partial_transfers() == partials
        assert total.get("pp.partial", 0) == total.get("pp.grad_partial", 0) == partials * per_transfer
        assert plan.block_transfers() == blocks


CONFIGS_2 = [((2, 2, 1, 2, 1), c) for c in ("none", "received", "all")] + [
    ((2, 3, 2, 2, 1), "received"), ((2, 3, 2, 2, 1), "all"), ((2, 2, 2, 2, 0), "received")]


def test_pipeline_two_stages_float64_all_policies():
    reports = run_local(_worker, 2, CONFIGS_2, "float64")
    _check_volumes(reports, CONFIGS_2)


def test_pipeline_two_stages_float32():
    configs = [((2, 2, 1, 2, 1), "received")]
    _check_volumes(run_local(_worker, 2, configs, "float32"), configs)


def test_pipeline_four_stages_figure3_layout():
    # Fig. 3: P = 4, V = 2; caching removes 6 block transfers in the second virtual stage.
    configs = [((4, 2, 1, 2, 1), "none"), ((4, 2, 1, 2, 1), "received")]
    reports = run_local(_worker, 4, configs, "float64")
    _check_volumes(reports, configs)
    naive, cached = (PipelinePlan.steady(4, 2, 1, 2, cache=c) for c in ("none", "received"))
    second = range(3, 7)  # transitions into chunks 4..7 (0-based 4..7 receive from 3..6)
    assert sum(len(naive.sent(k)) for k in second) - sum(len(cached.sent(k)) for k in second) == 6


@pytest.mark.parametrize("p,v,n_p", [(1, 3, 1), (2, 2, 1), (3, 2, 2), (4, 2, 1), (4, 4, 3), (8, 2, 1)])
def test_plan_reproduces_eqs_7_and_8(p, v, n_p):
    for s, offset in ((2, 1), (3, 2), (3, 0) if n_p > 1 else (3, 1)):
        naive = PipelinePlan.steady(p, v, n_p, s, offset=offset, cache="none")
        cached = PipelinePlan.steady(p, v, n_p, s, offset=offset, cache="received")
        assert naive.block_transfers() == eq7_naive(p, v, n_p) == p * v * (p * v - 1) // 2 * n_p
        assert cached.block_transfers() == eq8_cached(p, v, n_p)
        # Peak per-transition cost: O(C) naive vs O(P) cached.
        assert max(len(naive.sent(k)) for k in range(p * v - 1)) == (p * v - 1) * n_p
        assert max(len(cached.sent(k)) for k in range(p * v - 1)) <= p * n_p


def test_plan_rejects_bad_layouts():
    with pytest.raises(ValueError, match="chunk_sizes"):
        PipelinePlan((2, 2, 2), 2, 2)
    with pytest.raises(ValueError, match="cache"):
        PipelinePlan((2, 2), 2, 2, cache="some")
    with pytest.raises(ValueError, match="offset"):
        PipelinePlan.steady(2, 2, 1, 2, offset=2)
