"""Every distributed path keeps its tensors on the inputs' device (issue 20).

A CPU machine has a second device: `meta`.  A local gloo world of 2 processes runs tensor
parallelism, the sequence-sharded prefill and the pipeline (every schedule and cache policy, a
one-stage plan on a sub-group) with every input on `meta`, under `DeviceMixingDetector("meta")`:
any op, forward or backward, whose operands mix devices or that reads or creates a tensor off
`meta` (a CPU buffer, a CPU head map) is recorded.  torch's c10d ops accept meta tensors and move
nothing, so the real send/recv/all-reduce calls run.  The detector is shown to catch the bugs the
issue names (a device-less head map, a CPU allocation) so that the clean run means something.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from attnres_torch.distributed import (
    CommCounter,
    HiddenShard,
    PipelinePlan,
    all_reduce_grads,
    depth_attention_tp,
    run_local,
    run_pipeline,
    sequence_sharded_prefill,
    shard_sequence,
)
from attnres_torch.distributed import tensor_parallel as tp_module

from experiments.distributed_smoke import DeviceMixingDetector

META = torch.device("meta")
D = 10


def _probe(w):
    def layer(i):
        return lambda h: torch.tanh(h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) @ w[i])
    return [layer(i) for i in range(w.shape[0])]


def _leaf(*shape):
    return torch.randn(*shape, device=META).requires_grad_()


def _checked(results, name, fn):
    """Run fn under the detector; record (violations, ops, exception) for the path `name`."""
    det = DeviceMixingDetector(META)
    error = None
    try:
        with det:
            fn()
    except Exception as e:  # noqa: BLE001 - a broken path is reported by the test, not here
        error = f"{type(e).__name__}: {e}"
    results[name] = {"violations": det.violations, "ops": det.ops, "error": error}


def _tp_paths(results, shard):
    for name, opts in (("tp heads straddling ranks", dict(num_heads=5)),
                       ("tp sigmoid, no key norm", dict(activation="sigmoid", key_norm=False)),
                       ("tp per-token query", dict())):
        xs = [_leaf(2, 3, shard.local_size) for _ in range(3)]
        q = _leaf(2, 3, shard.local_size) if name.endswith("query") else _leaf(shard.local_size)
        g = _leaf(shard.local_size)

        def run(xs=xs, q=q, g=g, opts=opts):
            lse_too = opts.get("activation", "softmax") == "softmax"
            res = depth_attention_tp(xs, q, g, shard=shard, return_lse=lse_too, **opts)
            outs = list(res) if lse_too else [res]
            assert all(t.device == META for t in outs)
            torch.autograd.backward(outs, [torch.randn_like(t) for t in outs])
            assert all(t.grad.device == META for t in xs + [q, g])
        _checked(results, name, run)


def _seq_path(results):
    L = 5
    emb, w, queries, gains = _leaf(2, 4, D), _leaf(L, D, D), _leaf(L + 1, D), _leaf(L + 1, D)

    def run():
        le = shard_sequence(emb, seq_dim=1)
        out, blocks = sequence_sharded_prefill(le, _probe(w), queries, gains, block_size=2, seq_dim=1)
        assert out.device == META and all(b.device == META for b in blocks)
        (out * torch.randn_like(out)).sum().backward()
        all_reduce_grads([w, queries, gains])
        assert all(t.grad.device == META for t in (emb, w, queries, gains))
    _checked(results, "sequence-sharded prefill", run)


def _pipeline_path(results, name, plan, schedule, group=None, rank=0, M=2):
    L = plan.num_layers
    w, queries, gains = _leaf(L, D, D), _leaf(L + 1, D), _leaf(L + 1, D)
    embs = [_leaf(3, D) for _ in range(M)]
    counter = CommCounter()

    def run():
        res = run_pipeline(plan, embs if rank == 0 else [None] * M, _probe(w), queries, gains,
                           lambda out, m: (out * 2).sum(), microbatch_shape=(3, D), dtype=torch.float32,
                           schedule=schedule, group=group, counter=counter)
        assert all(t.device == META for t in res["losses"] + res["embedding_grads"])
    _checked(results, name, run)
    results[name]["sent"] = sum(counter.elements.values())


def _meta_worker(rank, world, broken=None):
    if broken == "head_map":  # the bug of issue 20, item 1: the map always on the default device
        def head_map(self, num_heads, dtype, device=None):
            heads = torch.arange(self.offset, self.offset + self.local_size) // (self.dim // num_heads)
            return torch.nn.functional.one_hot(heads, num_heads).to(dtype)
        tp_module.HiddenShard.head_map = head_map
    results = {}
    _tp_paths(results, HiddenShard.even(D))
    if broken:
        return results
    _seq_path(results)
    for cache in ("none", "received", "all"):
        for schedule in ("gpipe", "interleaved_1f1b"):
            plan = PipelinePlan.steady(2, 2, 1, 2, cache=cache)
            _pipeline_path(results, f"pipeline P=2 V=2 {cache} {schedule}", plan, schedule, rank=rank)
    _pipeline_path(results, "pipeline P=2 V=1 1f1b", PipelinePlan.steady(2, 1, 2, 2), "1f1b", rank=rank, M=3)
    groups = [dist.new_group([r]) for r in range(world)]  # each rank: a one-stage pipeline
    _pipeline_path(results, "pipeline P=1 V=2 (one stage, in process)", PipelinePlan((2, 2), 2, 1),
                   "gpipe", group=groups[rank])
    return results


def test_every_distributed_path_stays_on_the_inputs_device():
    reports = run_local(_meta_worker, 2)
    for rank, results in enumerate(reports):
        assert len(results) == 12  # 3 TP, 1 sequence, 8 pipeline paths
        for name, r in results.items():
            assert r["error"] is None, (rank, name, r["error"])
            assert r["violations"] == [], (rank, name, r["violations"][:5])
            assert r["ops"] > 20, (rank, name, r["ops"])  # the detector saw the path's ops
        # The pipelines really sent (meta payloads move nothing, but send ran); one stage sends nothing.
        assert all(r["sent"] > 0 for n, r in results.items() if n.startswith("pipeline P=2"))
        assert results["pipeline P=1 V=2 (one stage, in process)"]["sent"] == 0


def test_detector_catches_a_host_head_map():
    # Reintroduce issue 20's bug 1: the detector (or the op) must report it on every TP path.
    reports = run_local(_meta_worker, 2, "head_map")
    for results in reports:
        for name, r in results.items():
            assert any("cpu" in v and "meta" in v for v in r["violations"]), (name, r)


def test_detector_rules():
    x = torch.ones(2, 3, device=META)
    with DeviceMixingDetector() as det:
        x @ torch.ones(3, 2)  # mixed operands (meta accepts them silently; CUDA would raise)
        x * torch.tensor(2.0)  # a 0-dim CPU scalar, as CUDA ops accept
        torch.empty(2, 3, device=META).copy_(torch.ones(2, 3))  # a device move is not mixing
    assert len(det.violations) == 1 and "meta" in det.violations[0] and "cpu" in det.violations[0]
    with DeviceMixingDetector(META) as det:
        torch.empty(3, 4)  # allocated on the default device: stray
        torch.empty(3, 4, device=META)
    assert len(det.violations) == 1 and "expected meta" in det.violations[0]
