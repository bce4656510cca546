"""Pipeline parallelism with cross-stage caching (paper 4.1) on local gloo worlds of 2 and 4
CPU processes: losses, the embedding gradient and every parameter gradient equal the float64
reference network for every cache policy and every schedule (GPipe, 1F1B, interleaved 1F1B); the
elements actually sent reproduce Eq. (7) (naive) and Eq. (8) (cached) times the tokens and D,
forward and backward, whatever the schedule; 1F1B bounds the microbatches in flight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _helpers import assert_close, f64, rand
from attnres_core.config import ResidualConfig
from attnres_numpy import model as ref
from attnres_torch.distributed import (
    CommCounter,
    PipelinePlan,
    eq7_naive,
    eq8_cached,
    run_local,
    run_pipeline,
)
from attnres_torch.distributed.pipeline_schedule import check_schedule, simulate, stage_order

D, TOKENS, M = 8, (3,), 2  # hidden size, tokens per microbatch, microbatches (default)


def _inputs(num_layers, dtype, M=M):
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


def _config(entry):
    """((P, V, N_p, S, offset), cache[, schedule[, M]]) -> (layout, cache, schedule, M)."""
    layout, cache, *rest = entry
    return layout, cache, rest[0] if rest else "gpipe", rest[1] if len(rest) > 1 else M


def _worker(rank, world, configs, dt):
    dtype = getattr(torch, dt)
    report = []
    for entry in configs:
        (p, v, n_p, s, offset), cache, schedule, M = _config(entry)
        plan = PipelinePlan.steady(p, v, n_p, s, offset=offset, cache=cache)
        L = plan.num_layers
        config = ResidualConfig(kind="block", block_size=s)
        emb, w, queries, gains, cots = _inputs(L, dtype, M)
        lw, lq, lg = (t.clone().requires_grad_() for t in (w, queries, gains))
        counter = CommCounter()
        res = run_pipeline(plan, emb if rank == 0 else [None] * M, _probe(lw, config.eps), lq, lg,
                           lambda out, m: (out.double() * cots[m]).sum(), microbatch_shape=TOKENS + (D,),
                           dtype=dtype, eps=config.eps, counter=counter, schedule=schedule)
        for t in (lw, lq, lg):  # each row's gradient lives on the stage that owns it
            dist.all_reduce(t.grad)
        params = {"queries": f64(queries), "norm_weights": f64(gains)}
        vjps = [ref.probe_vjp(config, params, f64(emb[m]), f64(w), f64(cots[m])) for m in range(M)]
        tag = f"{cache} {schedule}"
        if plan.stage_of(plan.num_chunks - 1) == rank:
            outs = [ref.probe_forward(config, params, f64(emb[m]), f64(w)) for m in range(M)]
            want = [float(np.sum(o * f64(c))) for o, c in zip(outs, cots)]
            assert_close(torch.stack(res["losses"]), want, dt, f"{tag} losses", grad=False)
        if rank == 0:
            assert_close(res["embedding_grads"], [g["embedding"] for g in vjps], dt, f"{tag} d_emb", grad=True)
        for got, key in ((lw, "sublayer_weights"), (lq, "queries"), (lg, "norm_weights")):
            assert_close(got.grad, sum(g[key] for g in vjps), dt, f"{tag} d_{key}", grad=True)
        report.append({"elements": counter.as_dict()["elements"],
                       # NumPy copies: tensors would cross the queue as shared memory.
                       "losses": f64(res["losses"]), "embedding_grads": f64(res["embedding_grads"]),
                       "peak_in_flight": res["peak_in_flight"], "peak_chunks": res["peak_chunks"],
                       "peak_received_blocks": res["peak_received_blocks"]})
    return report


def _check_volumes(reports, configs):
    for i, entry in enumerate(configs):
        (p, v, n_p, s, offset), cache, schedule, m = _config(entry)
        per_transfer = m * int(np.prod(TOKENS)) * D  # elements of one block representation
        total = {}
        for rep in reports:
            for key, n in rep[i]["elements"].items():
                total[key] = total.get(key, 0) + n
        plan = PipelinePlan.steady(p, v, n_p, s, offset=offset, cache=cache)
        blocks = {"none": eq7_naive(p, v, n_p), "received": eq8_cached(p, v, n_p),
                  "all": (p * (p - 1) // 2 + (v - 1) * p * (p - 1)) * n_p}[cache]
        assert total["pp.blocks"] == blocks * per_transfer, (cache, schedule, total)
        assert total["pp.grad_blocks"] == blocks * per_transfer, (cache, schedule, total)  # backward mirrors
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
    configs = [((4, 2, 1, 2, 1), "none"), ((4, 2, 1, 2, 1), "received"),
               ((4, 2, 1, 2, 1), "received", "interleaved_1f1b", 8),
               ((4, 1, 2, 2, 1), "received", "1f1b", 5)]
    reports = run_local(_worker, 4, configs, "float64")
    _check_volumes(reports, configs)
    # Activations held (chunk passes): GPipe all M V; 1F1B min(P - r, M); interleaved 1F1B
    # Megatron's warm-up (P - r - 1) 2 + (V - 1) P passes plus one.
    assert [rep[0]["peak_chunks"] for rep in reports] == [4] * 4
    assert [rep[3]["peak_chunks"] for rep in reports] == [min(4 - r, 5) for r in range(4)]
    assert [rep[2]["peak_chunks"] for rep in reports] == [(3 - r) * 2 + 4 + 1 for r in range(4)]
    # Microbatches in flight (the cache lives as long as its microbatch): 1F1B P - r; interleaved
    # more (a microbatch stays from its first chunk's forward to that chunk's backward).
    assert [rep[3]["peak_in_flight"] for rep in reports] == [4, 3, 2, 1]
    assert [rep[2]["peak_in_flight"] for rep in reports] == [8, 8, 7, 5]
    naive, cached = (PipelinePlan.steady(4, 2, 1, 2, cache=c) for c in ("none", "received"))
    second = range(3, 7)  # transitions into chunks 4..7 (0-based 4..7 receive from 3..6)
    assert sum(len(naive.sent(k)) for k in second) - sum(len(cached.sent(k)) for k in second) == 6


# Schedules (M = 4 microbatches): 1F1B (V = 1) and interleaved 1F1B (V = 2, 3) with every cache
# policy, against GPipe on the same layout.
SCHED_LAYOUT = (2, 2, 1, 2, 1)
CONFIGS_SCHED = ([((2, 1, 2, 2, 1), c, "1f1b", 4) for c in ("none", "received")]
                 + [(SCHED_LAYOUT, c, "interleaved_1f1b", 4) for c in ("none", "received", "all")]
                 + [((2, 3, 2, 2, 1), "received", "interleaved_1f1b", 2),
                    (SCHED_LAYOUT, "received", "gpipe", 4), (SCHED_LAYOUT, "none", "gpipe", 4)])


def test_pipeline_schedules_exact_with_caching():
    reports = run_local(_worker, 2, CONFIGS_SCHED, "float64")
    _check_volumes(reports, CONFIGS_SCHED)  # Eq. 7 / Eq. 8 whatever the schedule
    inter, gpipe = CONFIGS_SCHED.index((SCHED_LAYOUT, "received", "interleaved_1f1b", 4)), \
        CONFIGS_SCHED.index((SCHED_LAYOUT, "received", "gpipe", 4))
    # A microbatch's own gradients are summed in the same order under every schedule (its chunks'
    # backwards run in reverse chunk order on each stage): bitwise equal to GPipe.
    assert np.array_equal(reports[0][inter]["embedding_grads"], reports[0][gpipe]["embedding_grads"])
    assert np.array_equal(reports[1][inter]["losses"], reports[1][gpipe]["losses"])
    assert len(reports[0][inter]["embedding_grads"]) == len(reports[1][inter]["losses"]) == 4
    # Memory: GPipe holds all M V chunk passes; 1F1B min(P - r, M); interleaved 1F1B its warm-up
    # (P - r - 1) 2 + (V - 1) P plus one.
    assert [rep[0]["peak_chunks"] for rep in reports] == [2, 1]
    assert [rep[gpipe]["peak_chunks"] for rep in reports] == [8, 8]
    assert [rep[inter]["peak_chunks"] for rep in reports] == [5, 3]
    assert [rep[gpipe]["peak_in_flight"] for rep in reports] == [4, 4]
    assert [rep[inter]["peak_in_flight"] for rep in reports] == [4, 3]
    # The cache keeps one copy of a block a stage reads again: fewer received copies held.
    none_g = CONFIGS_SCHED.index((SCHED_LAYOUT, "none", "gpipe", 4))
    for rep in reports:
        assert rep[gpipe]["peak_received_blocks"] <= rep[none_g]["peak_received_blocks"]
    assert sum(rep[gpipe]["peak_received_blocks"] for rep in reports) < sum(
        rep[none_g]["peak_received_blocks"] for rep in reports)


def test_one_stage_plan_runs_in_process():
    # PipelinePlan((2, 2), 2, 1): one stage, two chunks. The transitions stay in the process:
    # nothing is counted on the wire, and losses and gradients equal the reference.
    configs = [((1, 2, 1, 2, 1), "received"), ((1, 2, 1, 2, 1), "none", "interleaved_1f1b"),
               ((1, 1, 2, 2, 1), "received", "1f1b"), ((1, 3, 2, 2, 0), "all")]
    reports = run_local(_worker, 1, configs, "float64")
    assert all(rep["elements"] == {} for rep in reports[0])
    assert PipelinePlan((2, 2), 2, 1).num_chunks == 2


@pytest.mark.parametrize("p,v,m", [(2, 1, 1), (2, 1, 5), (4, 1, 3), (2, 2, 4), (4, 2, 8), (3, 3, 3)])
def test_schedules_pass_order_and_bubble(p, v, m):
    plan = PipelinePlan.steady(p, v, 1, 2)
    for schedule in ("gpipe", "1f1b" if v == 1 else "interleaved_1f1b"):
        events, clock = simulate(plan, m, schedule)
        passes = [e for e in events if e[0] in ("F", "B")]
        # Every chunk pass exactly once, each stage in its own order.
        assert sorted(passes) == sorted((kind, mb, k) for kind in "FB" for mb in range(m)
                                        for k in range(plan.num_chunks))
        for r in range(p):
            assert [e for e in passes if plan.stage_of(e[2]) == r] == stage_order(plan, m, schedule, r)
        # A transfer right after the pass producing it; one per transition and direction.
        assert sum(e[0] == "send_F" for e in events) == sum(e[0] == "send_B" for e in events) \
            == m * (plan.num_chunks - 1)
        # Unit-time passes: 1F1B keeps GPipe's bubble 2 (P - 1); interleaving divides it by V
        # (the bubble is 2 (P - 1) chunk passes of 1/V of a stage each) once M >= P.
        if schedule != "gpipe" or m >= p:
            assert clock - 2 * m * v == 2 * (p - 1), (schedule, clock)


def test_schedule_errors():
    plan_v1, plan_v2 = PipelinePlan.steady(2, 1, 1, 2), PipelinePlan.steady(2, 2, 1, 2)
    with pytest.raises(ValueError, match="schedule: expected one of"):
        check_schedule("zero_bubble", plan_v1, 2)
    with pytest.raises(ValueError, match="'1f1b' runs one chunk per stage.*2 virtual stages"):
        check_schedule("1f1b", plan_v2, 2)
    with pytest.raises(ValueError, match="'interleaved_1f1b' needs virtual stages V >= 2"):
        check_schedule("interleaved_1f1b", plan_v1, 2)
    with pytest.raises(ValueError, match="multiple of the 2 stages.*got 3"):
        check_schedule("interleaved_1f1b", plan_v2, 3)
    with pytest.raises(ValueError, match="at least one microbatch"):
        check_schedule("gpipe", plan_v1, 0)


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


def _mismatch_worker(rank, world, case):
    """One run whose payload differs from the declared microbatch_shape / dtype."""
    plan = PipelinePlan((1, 2), 2, world)  # chunk 0 ends inside a block: the partial sum crosses
    gen = torch.Generator().manual_seed(3)
    w = rand(gen, (3, D, D), torch.float32, D ** -0.5)
    subs = _probe(w, 1e-6)
    if case == "sublayer_float64":  # a sublayer of another dtype: pushed in the stream's (M1a)
        subs[0] = lambda h, f=subs[0]: f(h).double()
    emb = rand(gen, (3, D), torch.float32)
    shape = (4, D) if case == "shape" else (3, D)
    dtype = torch.bfloat16 if case == "declared_bf16" else torch.float32
    run_pipeline(plan, [emb if rank == 0 else None], subs, rand(gen, (4, D), torch.float32), None,
                 lambda out, m: out.sum(), microbatch_shape=shape, dtype=dtype)
    return 0


@pytest.mark.parametrize("world,case,error", [
    # The docs example's form: a float32 stack declared bfloat16 (gloo used to SIGABRT).
    (2, "declared_bf16", r"TypeError: dtype: declared torch.bfloat16 .* embeddings\[0\] has dtype torch.float32"),
    (1, "shape", r"ValueError: microbatch_shape: declared \(4, 8\) .* embeddings\[0\] has shape \(3, 8\)"),
])
def test_transfers_are_checked_against_the_declared_shape_and_dtype(world, case, error):
    # The sender raises before anything is sent; run_local reports its traceback (and stops the
    # receiver, which would otherwise wait in recv).
    with pytest.raises(RuntimeError, match=error):
        run_local(_mismatch_worker, world, case)


@pytest.mark.parametrize("world", [1, 2])
def test_a_sublayer_of_another_dtype_joins_the_stream_in_the_stream_dtype(world):
    # M1a: every pushed v_l is cast to the stream's (the embedding's) dtype, so a float64
    # sublayer output leaves the declared float32 transfers float32 (the partial sum crossing
    # chunk 0 -> 1 included) and the run completes.
    assert run_local(_mismatch_worker, world, "sublayer_float64") == [0] * world


def test_run_pipeline_rejects_invalid_schedule_combinations():
    def worker(rank, world):
        plan = PipelinePlan((1, 2), 2, 1)  # V = 2
        args = ([torch.zeros(3, D)], _probe(torch.zeros(3, D, D), 1e-6), torch.zeros(4, D), None,
                lambda out, m: out.sum())
        kw = dict(microbatch_shape=(3, D), dtype=torch.float32)
        with pytest.raises(ValueError, match="'1f1b' runs one chunk per stage"):
            run_pipeline(plan, *args, schedule="1f1b", **kw)
        with pytest.raises(ValueError, match="schedule: expected one of"):
            run_pipeline(plan, *args, schedule="1F1B", **kw)
        with pytest.raises(ValueError, match="queries: expected on this stage's device meta"):
            run_pipeline(plan, *args, device="meta", **kw)
        with pytest.raises(TypeError, match="dtype: expected a torch.dtype"):
            run_pipeline(plan, *args, microbatch_shape=(3, D), dtype="float32")
        return 1
    assert run_local(worker, 1) == [1]
