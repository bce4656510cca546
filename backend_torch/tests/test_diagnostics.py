"""Diagnostics record what they claim: recorded depth weights equal the float64 reference's (and sum
to 1), a uniform row has entropy log N, magnitudes and gradient norms equal direct computation,
the collapse warning fires on a crafted collapsed row (once) and not on uniform weights, and
monitoring leaves the training computation bitwise unchanged."""

from __future__ import annotations

import math
import warnings

import attnres_torch as at
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnres_numpy import ops as ref
from attnres_numpy.config import ResidualConfig
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
