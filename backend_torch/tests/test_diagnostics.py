"""Diagnostics record what they claim: recorded depth weights equal the float64 reference's (and sum
to 1), a uniform row has entropy log N, magnitudes and gradient norms equal direct computation,
the collapse warning fires on a crafted collapsed row (once) and not on uniform weights, and
monitoring leaves the training computation bitwise unchanged."""

from __future__ import annotations

import contextlib
import math
import warnings

import attnres_torch as at
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnres_core.config import ResidualConfig
from attnres_numpy import ops as ref
from attnres_torch.diagnostics import DepthCollapseWarning, DepthMonitor, weight_stats
from torch import nn

L, D = 3, 8


class Probe(nn.Module):
    """The spec's probe sublayer tanh(rmsnorm(h) @ W); keeps its last output."""

    def __init__(self, w: torch.Tensor, eps: float):
        super().__init__()
        self.w, self.eps, self.last = nn.Parameter(w), eps, None

    def forward(self, h):
        self.last = torch.tanh(F.rms_norm(h, (h.shape[-1],), eps=self.eps) @ self.w)
        return self.last


class Constant(nn.Module):
    """A sublayer whose output is a fixed vector for every token."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, h):
        return self.value.expand_as(h)


def _probe_model(name, seed=0, query_scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    cfg = ResidualConfig.variant(name)
    router = at.DepthRouter(cfg, L, D).double()
    with torch.no_grad():
        if hasattr(router, "queries"):
            router.queries.copy_(torch.randn(L + 1, D, generator=gen, dtype=torch.float64) * query_scale)
            router.norm_weights.add_(0.3 * torch.randn(L + 1, D, generator=gen, dtype=torch.float64))
    subs = nn.ModuleList(Probe(torch.randn(D, D, generator=gen, dtype=torch.float64) / 3, cfg.eps)
                         for _ in range(L))
    emb = torch.randn(2, 5, D, generator=gen, dtype=torch.float64)
    return cfg, router, subs, emb


def test_weight_stats_uniform_and_one_hot():
    for n in (1, 2, 7):
        s = weight_stats(torch.full((n, 4, 3), 1.0 / n))
        assert s["entropy"] == pytest.approx(math.log(n), abs=1e-12)
        assert s["max_weight"] == pytest.approx(1.0 / n, abs=1e-12)
        assert sum(s["mean_weights"]) == pytest.approx(1.0, abs=1e-12)
    one_hot = torch.zeros(5, 6)
    one_hot[2] = 1.0
    s = weight_stats(one_hot)
    assert s["entropy"] == 0.0 and s["max_weight"] == 1.0 and s["argmax"] == 2
    # sigmoid-style unnormalized weights are normalized per token first
    s = weight_stats(torch.tensor([[0.5], [0.5]]))
    assert s["mean_weights"] == [0.5, 0.5] and s["entropy"] == pytest.approx(math.log(2))


@pytest.mark.parametrize("name", ["full", "block", "window", "multihead"])
def test_recorded_weights_match_reference(name):
    cfg, router, subs, emb = _probe_model(name)
    monitor = DepthMonitor(router, subs)
    with monitor.record(7):
        out = router(emb, list(subs))
        out.square().sum().backward()
    entry = monitor.history[-1]
    assert entry["step"] == 7 and [r["row"] for r in entry["rows"]] == list(range(L + 1))
    v = [t.detach().numpy() for t in [emb] + [s.last for s in subs]]
    # block_size 2 over L = 3: blocks b1 = v1 + v2, b2 = v3; sublayer 2 (row 1) sees partial = v1
    blocks = {"b0": v[0], "b1": v[1] + v[2], "b2": v[3], "partial": v[1]}
    for r in entry["rows"]:
        xs = [v[int(lab[1:])] if lab[0] == "v" else blocks[lab] for lab in r["labels"]]
        assert ("partial" in r["labels"]) == (cfg.kind == "block" and r["row"] == 1)
        _, w = ref.depth_attention(xs, router.queries[r["row"]].detach().numpy(),
                                   router.norm_weights[r["row"]].detach().numpy(), eps=cfg.eps,
                                   num_heads=cfg.num_heads, return_weights=True)
        np.testing.assert_allclose(r["mean_weights"], w.reshape(len(xs), -1).mean(1), atol=1e-12)
        assert sum(r["mean_weights"]) == pytest.approx(1.0, abs=1e-12)
        assert len(xs) == 1 or r["max_weight"] < 0.9  # a genuinely mixed row
    expected_labels = {"full": ["v0", "v1", "v2", "v3"], "window": ["v0", "v2", "v3"],
                       "block": ["b0", "b1", "b2"], "multihead": ["b0", "b1", "b2"]}[name]
    assert entry["rows"][-1]["labels"] == expected_labels
    assert entry["output_rms"] == pytest.approx(
        [float(s.last.detach().square().mean().sqrt()) for s in subs], rel=1e-12)
    assert entry["input_rms"][0] == pytest.approx(float(emb.square().mean().sqrt()), rel=1e-12)
    assert entry["grad_norm"] == pytest.approx([float(s.w.grad.norm()) for s in subs], rel=1e-12)


def test_uniform_weights_have_entropy_log_n_and_do_not_warn():
    cfg, router, subs, emb = _probe_model("full", query_scale=0.0)
    monitor = DepthMonitor(router, subs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.record(0):
            router(emb, list(subs))
    for r in monitor.history[0]["rows"]:
        n = r["row"] + 1
        assert len(r["labels"]) == n
        assert r["entropy"] == pytest.approx(math.log(n), abs=1e-12)
        assert r["max_weight"] == pytest.approx(1.0 / n, abs=1e-12)
    assert monitor.history[0]["grad_norm"] is None  # no backward ran


def test_collapse_warning_fires_once_on_a_collapsed_row():
    router = at.DepthRouter(ResidualConfig.variant("full"), L, D)
    eye = torch.eye(D)
    subs = nn.ModuleList(Constant(3.0 * eye[l + 1]) for l in range(L))
    with torch.no_grad():
        router.queries[2] = 40.0 * eye[1]  # sublayer 3 attends over v0, v1, v2: all weight on v1
    emb = eye[0].expand(4, D)
    monitor = DepthMonitor(router, subs)
    with pytest.warns(DepthCollapseWarning, match=r"sublayer 3 \(row 2\).*3 sources \(mostly v1\)") as rec:
        with monitor.record(5):
            router(emb, list(subs))
    assert len(rec) == 1  # only the crafted row, not the uniform ones
    assert rec[0].filename == __file__  # attributed to the caller's `with monitor.record(...)`
    assert monitor.history[0]["rows"][2]["max_weight"] > 0.999
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.record(6):  # once per row and monitor
            router(emb, list(subs))


def test_monitoring_leaves_training_bitwise_unchanged_and_close_removes_hooks():
    torch.manual_seed(0)
    net = at.AttnResTransformer(40, 16, 2, 2, ResidualConfig.variant("block"))
    with torch.no_grad():
        net.router.queries.normal_()
    tokens = torch.randint(0, 40, (2, 6))

    def step():
        net.zero_grad(set_to_none=True)
        logits = net(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        return logits.detach(), [p.grad.clone() for p in net.parameters()]

    plain = step()
    monitor = DepthMonitor(net.router, net.sublayers)
    with monitor.record(0):
        watched = step()
    assert torch.equal(plain[0], watched[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1]))
    assert len(monitor.history[0]["rows"]) == 2 * 2 + 1
    monitor.close()
    assert "stream" not in vars(net.router)
    assert all(not m._forward_hooks for m in net.sublayers)


def test_non_attention_variant_records_magnitudes_only():
    cfg, router, subs, emb = _probe_model("standard")
    monitor = DepthMonitor(router, subs)
    with monitor.record(0):
        router(emb, list(subs))
    entry = monitor.history[0]
    assert entry["rows"] == [] and len(entry["output_rms"]) == L


def test_monitor_argument_errors():
    router = at.DepthRouter(ResidualConfig.variant("full"), L, D)
    with pytest.raises(ValueError, match="sublayers: expected 3"):
        DepthMonitor(router, [nn.Identity()])
    with pytest.raises(ValueError, match="collapse_threshold"):
        DepthMonitor(router, collapse_threshold=1.5)
    first = DepthMonitor(router)
    with pytest.raises(ValueError, match="already watched"):
        DepthMonitor(router)
    first.close()
    DepthMonitor(router).close()


# -- collapse responses and export ---------------------------------------------------------------

COLLAPSED_ROW = 2


def _collapsing_model(router_cls=None, seed=0):
    """A Full router (float64) whose row 2 query has a huge norm along the embedding's direction:
    row 2 (sublayer 3, sources v0, v1, v2) puts ~all its weight on v0 for every token."""
    gen = torch.Generator().manual_seed(seed)
    cfg = ResidualConfig.variant("full")
    if router_cls is None:
        router = at.DepthRouter(cfg, L, D).double()
    else:
        router = router_cls(cfg, L, D, dtype=torch.float64)
    e0 = torch.zeros(D, dtype=torch.float64)
    e0[0] = 1.0
    stacked = {"queries": 0.3 * torch.randn(L + 1, D, generator=gen, dtype=torch.float64),
               "norm_weights": 1 + 0.2 * torch.randn(L + 1, D, generator=gen, dtype=torch.float64)}
    stacked["queries"][COLLAPSED_ROW] = 60.0 * e0
    with torch.no_grad():
        if hasattr(router, "load_stacked"):
            router.load_stacked(stacked)
        else:
            router.queries.copy_(stacked["queries"])
            router.norm_weights.copy_(stacked["norm_weights"])
    subs = nn.ModuleList(Probe(torch.randn(D, D, generator=gen, dtype=torch.float64) / 3, cfg.eps)
                         for _ in range(L))
    emb = 3.0 * e0 + 0.1 * torch.randn(4, 5, D, generator=gen, dtype=torch.float64)
    return router, subs, emb


def _train(router, subs, emb, monitor, optimizer, steps, record_steps=(0,)):
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        ctx = monitor.record(step) if step in record_steps else contextlib.nullcontext()
        with ctx:
            router(emb, list(subs)).square().mean().backward()
        optimizer.step()


def test_forced_collapse_log_policy_warns_and_changes_nothing():
    router, subs, emb = _collapsing_model()
    before = router.queries.detach().clone()
    monitor = DepthMonitor(router, subs, on_collapse="log")
    with pytest.warns(DepthCollapseWarning, match=r"sublayer 3 \(row 2\).*mostly v0") as rec:
        with monitor.record(0):
            router(emb, list(subs)).sum().backward()
    assert len(rec) == 1 and "response" not in str(rec[0].message)
    entry = monitor.history[0]
    assert entry["rows"][COLLAPSED_ROW]["max_weight"] > 0.99
    assert entry["collapse"] == [{"row": COLLAPSED_ROW, "max_weight": entry["rows"][COLLAPSED_ROW]["max_weight"],
                                  "action": "logged"}]
    assert torch.equal(router.queries.detach(), before)


def test_forced_collapse_raise_policy_raises_after_recording():
    router, subs, emb = _collapsing_model()
    monitor = DepthMonitor(router, subs, on_collapse="raise")
    with pytest.raises(at.diagnostics.DepthCollapseError, match=r"step 3: sublayer 3 \(row 2\)"):
        with monitor.record(3):
            router(emb, list(subs)).sum().backward()
    assert monitor.history[0]["step"] == 3  # the collapsed record is kept


@pytest.mark.parametrize("shrink", [1.0, 0.25])
def test_forced_collapse_reset_policy_resets_query_grad_and_adam_state(shrink):
    router, subs, emb = _collapsing_model()
    optimizer = torch.optim.Adam(router.parameters(), lr=1e-2)
    _train(router, subs, emb, None, optimizer, 1, record_steps=())  # one step: Adam has state
    monitor = DepthMonitor(router, subs, on_collapse=at.diagnostics.ResetPolicy(shrink, optimizer))
    before = router.queries.detach().clone()
    with pytest.warns(DepthCollapseWarning, match=r"response \(reset\)"):
        with monitor.record(1):
            router(emb, list(subs)).square().mean().backward()
    q = router.queries.detach()
    assert torch.equal(q[COLLAPSED_ROW], before[COLLAPSED_ROW] * (1.0 - shrink))
    others = [r for r in range(L + 1) if r != COLLAPSED_ROW]
    assert torch.equal(q[others], before[others])
    assert torch.count_nonzero(router.queries.grad[COLLAPSED_ROW]) == 0
    assert torch.count_nonzero(router.queries.grad[others]) > 0
    state = optimizer.state[router.queries]
    assert torch.count_nonzero(state["exp_avg"][COLLAPSED_ROW]) == 0
    assert torch.count_nonzero(state["exp_avg_sq"][COLLAPSED_ROW]) == 0
    assert torch.count_nonzero(state["exp_avg"][others]) > 0
    with monitor.record(2):  # the next forward: uniform (shrink 1) or at least no longer collapsed
        router(emb, list(subs))
    row = monitor.history[-1]["rows"][COLLAPSED_ROW]
    if shrink == 1.0:
        assert row["entropy"] == pytest.approx(math.log(3), abs=1e-12)
        assert row["max_weight"] == pytest.approx(1 / 3, abs=1e-12)
    assert monitor.history[0]["collapse"][0]["action"] == (
        "reset to uniform" if shrink == 1.0 else "query x0.75")


@pytest.mark.parametrize("per_layer", [False, True])
def test_forced_collapse_lr_scale_equals_a_separate_param_group_with_scaled_lr(per_layer):
    """The policy's step hooks give the collapsed row exactly the trajectory of a run where that
    row sits in its own AdamW param group with lr * factor (and everything else does not change)."""
    from attnres_torch.convert import PerLayerRouter

    factor, lr, steps = 0.1, 5e-2, 4
    router, subs, emb = _collapsing_model(PerLayerRouter if per_layer else None)
    params = list(router.parameters()) + list(subs.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    monitor = DepthMonitor(router, subs, on_collapse=at.diagnostics.collapse_policy(
        "lr_scale", optimizer, factor=factor))
    start = (router.stacked()["queries"] if per_layer else router.queries).detach().clone()
    with pytest.warns(DepthCollapseWarning, match=r"response \(lr_scale\): lr x0.1"):
        _train(router, subs, emb, monitor, optimizer, steps, record_steps=(0, 2))
    assert [e["collapse"][0]["action"] for e in monitor.history] == ["lr x0.1", "lr x0.1 (already)"]

    # reference: per-layer sites, the collapsed query alone in a group with lr * factor
    ref_router, ref_subs, _ = _collapsing_model(PerLayerRouter)
    q = ref_router.row_parameter("queries", COLLAPSED_ROW)
    rest = [p for p in list(ref_router.parameters()) + list(ref_subs.parameters()) if p is not q]
    ref_opt = torch.optim.AdamW([{"params": rest}, {"params": [q], "lr": lr * factor}],
                                lr=lr, weight_decay=0.1)
    for _ in range(steps):
        ref_opt.zero_grad(set_to_none=True)
        ref_router(emb, list(ref_subs)).square().mean().backward()
        ref_opt.step()
    got = router.stacked() if per_layer else {k: v for k, v in router.named_parameters()}
    for name, value in ref_router.stacked().items():
        torch.testing.assert_close(got[name].detach(), value.detach(), atol=1e-12, rtol=1e-12)
    moved = (got["queries"].detach() - start)[COLLAPSED_ROW].abs().max()
    assert 0 < moved < lr * factor * steps * (1 + 0.1 * 60.0)  # Adam step <= lr, decay lr*wd*|q|
    for a, b in zip(subs.parameters(), ref_subs.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-12, rtol=1e-12)
    monitor.close()  # removes the hooks: a further step is a plain step
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_policy_argument_errors():
    router, subs, emb = _collapsing_model()
    with pytest.raises(ValueError, match="'lr_scale' needs the optimizer"):
        DepthMonitor(router, on_collapse="lr_scale")
    with pytest.raises(ValueError, match="on_collapse: expected one of"):
        DepthMonitor(router, on_collapse="shout")
    with pytest.raises(ValueError, match="factor"):
        at.diagnostics.LrScalePolicy(torch.optim.SGD(router.parameters(), lr=1.0), factor=0.0)
    with pytest.raises(ValueError, match="shrink"):
        at.diagnostics.ResetPolicy(shrink=1.5)
    with pytest.raises(TypeError, match="writer"):
        DepthMonitor(router, writer=object())
    other = torch.optim.SGD(subs.parameters(), lr=1.0)
    monitor = DepthMonitor(router, on_collapse=at.diagnostics.LrScalePolicy(other))
    with pytest.raises(ValueError, match="optimizer: does not hold the router's query parameter of row 2"):
        with monitor.record(0):
            router(emb, list(subs))


class FakeWriter:
    def __init__(self):
        self.scalars, self.histograms = {}, {}

    def add_scalar(self, tag, value, step):
        self.scalars[(tag, step)] = value

    def add_histogram(self, tag, values, step):
        self.histograms[(tag, step)] = values


def test_metrics_export_as_plain_dicts_and_to_a_summary_writer():
    router, subs, emb = _collapsing_model()
    writer = FakeWriter()
    monitor = DepthMonitor(router, subs, writer=writer)
    with pytest.warns(DepthCollapseWarning):
        with monitor.record(4):
            router(emb, list(subs)).sum().backward()
    entry = monitor.history[0]
    scalars = monitor.metrics()
    assert all(type(v) is float for v in scalars.values())
    for r in entry["rows"]:
        assert scalars[f"attnres/row{r['row']}/entropy"] == r["entropy"]
        assert scalars[f"attnres/row{r['row']}/max_weight"] == r["max_weight"]
        for label, w in zip(r["labels"], r["mean_weights"]):
            assert scalars[f"attnres/row{r['row']}/weight/{label}"] == w
    assert scalars["attnres/collapsed_rows"] == 1.0
    assert scalars["attnres/sublayer2/output_rms"] == entry["output_rms"][1]
    assert scalars["attnres/sublayer3/grad_norm"] == entry["grad_norm"][2]
    assert {k: v for (k, s), v in writer.scalars.items() if s == 4} == scalars
    for r in entry["rows"]:
        assert writer.histograms[(f"attnres/row{r['row']}/weights", 4)].tolist() == r["mean_weights"]
    assert writer.histograms[("attnres/entropy", 4)].tolist() == [r["entropy"] for r in entry["rows"]]


def test_tensorboard_writer_is_optional():
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"TensorBoard is not installed \(pip install tensorboard\)"):
            at.diagnostics.tensorboard_writer("/nonexistent")
        pytest.skip("tensorboard is not installed: checked the install message only")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        writer = at.diagnostics.tensorboard_writer(d)
        router, subs, emb = _collapsing_model()
        monitor = DepthMonitor(router, subs, writer=writer)
        with pytest.warns(DepthCollapseWarning):
            with monitor.record(0):
                router(emb, list(subs))
        writer.close()


@pytest.mark.parametrize("policy", ["raise", "reset"])
def test_example_trainer_collapse_policy_flag_on_a_forced_collapse(tmp_path, monkeypatch, policy):
    """`--collapse-policy` reaches the trainer's monitor: the output row's query is blown up before
    training (a huge-norm query), so the first record collapses; raise stops the run, reset puts
    the query back to zero and the run finishes with the response in its diagnostics."""
    import json

    from experiments import train

    real = train.DepthMonitor

    def forced(router, *args, **kwargs):
        with torch.no_grad():
            router.queries[-1] = 1e4 * torch.randn(router.dim, generator=torch.Generator().manual_seed(0))
        return real(router, *args, **kwargs)

    monkeypatch.setattr(train, "DepthMonitor", forced)
    argv = ["--residual", "block", "--seeds", "1", "--steps", "2", "--blocks", "2", "--dim", "16",
            "--heads", "2", "--context", "8", "--batch", "2", "--eval-every", "2", "--eval-batches", "1",
            "--corpus-bytes", "200000", "--no-plots", "--out", str(tmp_path), "--collapse-policy", policy]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DepthCollapseWarning)
        if policy == "raise":
            with pytest.raises(at.diagnostics.DepthCollapseError, match=r"the output aggregation \(row 4\)"):
                train.main(argv)
            return
        assert train.main(argv) == 0
    run = json.loads((tmp_path / "metrics.json").read_text())["runs"][0]
    first = run["diagnostics"][0]
    assert first["collapse"] == [{"row": 4, "max_weight": first["rows"][4]["max_weight"],
                                  "action": "reset to uniform"}]
    assert run["diagnostics"][-1]["rows"][4]["max_weight"] < 0.99
