"""The framework-neutral training tools (`attnres_core.training`): the curves' exact values and
their array form, the collapse statistics against hand-computed values and the float64
reference's weights, the records and collapse rule of `DepthMonitorBase` with each policy
decision, and the FLA / K3 key mappings (names, shapes, transposes, bitwise round trips)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from attnres_core import training as T
from attnres_core.config import ResidualConfig
from attnres_numpy import ops as ref

# -- curves ----------------------------------------------------------------------------------


def test_curve_values_at_chosen_steps():
    a = T.LinearWarmup(4)
    assert [a(s) for s in range(7)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    c = T.CosineWarmup(4)
    assert c(0) == 0.0 and c(4) == 1.0 and c(9) == 1.0
    assert c(1) == 0.5 * (1.0 - math.cos(math.pi / 4)) and c(2) == 0.5 * (1.0 - math.cos(math.pi / 2))
    for kind, mid in (("linear", 2.5), ("cosine", 2.5), ("geometric", 2.0)):
        t = T.TemperatureSchedule(1.0, 4.0, 10, kind)
        assert t(0) == 1.0 and t(10) == 4.0 and t(11) == 4.0
        assert t(5) == pytest.approx(mid, rel=1e-15)
    assert T.TemperatureSchedule(0.25, 1.0, 4, "geometric")(1) == 0.25 * 4.0 ** 0.25
    assert T.TemperatureSchedule(2.0, 0.5, 0)(0) == 0.5 and T.LinearWarmup(0)(0) == 1.0


@pytest.mark.parametrize("schedule", [T.LinearWarmup(7), T.CosineWarmup(7), T.LinearWarmup(0),
                                      T.TemperatureSchedule(0.25, 2.0, 7, "linear"),
                                      T.TemperatureSchedule(0.25, 2.0, 7, "cosine"),
                                      T.TemperatureSchedule(2.0, 0.25, 7, "geometric")],
                         ids=repr)
def test_array_curve_equals_the_scalar_curve(schedule):
    """curve(step, numpy) on an int array gives the scalar values (end points bitwise; float64
    inside to the last bits: numpy's cos may round differently from math.cos)."""
    steps = np.arange(12)
    got = schedule.curve(steps, np)
    want = np.array([schedule(int(s)) for s in steps])
    assert got.shape == (12,) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    assert got[0] == want[0] and np.all(got[7:] == want[7:])  # exact ends
    assert float(schedule.curve(np.int32(3), np)) == pytest.approx(schedule(3), rel=1e-15)


def test_curve_errors_name_the_argument():
    with pytest.raises(ValueError, match="steps: expected an int >= 0"):
        T.LinearWarmup(-1)
    with pytest.raises(ValueError, match="step: expected an int >= 0"):
        T.CosineWarmup(3)(np.float64(1.0))
    with pytest.raises(ValueError, match="kind='geometric' needs start > 0"):
        T.TemperatureSchedule(-1.0, 2.0, 3, "geometric")


# -- statistics and the collapse rule ------------------------------------------------------------


def test_weight_statistics_hand_values_and_reference_weights():
    w = np.array([[0.5, 0.1], [0.25, 0.1], [0.25, 0.8]])  # [N=3, tokens=2]
    s = T.weight_stats(w)
    assert s["mean_weights"] == pytest.approx([0.3, 0.175, 0.525], abs=1e-15)
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    h1 = -(2 * 0.1 * math.log(0.1) + 0.8 * math.log(0.8))
    assert s["entropy"] == pytest.approx((h0 + h1) / 2, rel=1e-14)
    assert s["max_weight"] == pytest.approx(0.65, rel=1e-15) and s["argmax"] == 2
    one_hot = np.zeros((4, 5))
    one_hot[1] = 1.0
    s = T.weight_stats(one_hot)
    assert s["entropy"] == 0.0 and s["max_weight"] == 1.0 and s["argmax"] == 1  # 0 log 0 = 0
    assert T.weight_stats(np.full((2, 3), 7.0))["mean_weights"] == [0.5, 0.5]  # normalized first
    # the reference's weights of a real read: entropy / max from them, rows sum to 1
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 4, 8)) for _ in range(5)]
    _, weights = ref.depth_attention(xs, rng.standard_normal(8), 1 + rng.standard_normal(8) * 0.2,
                                     return_weights=True)
    s = T.weight_stats(weights)
    p = weights.reshape(5, -1)
    assert sum(s["mean_weights"]) == pytest.approx(1.0, abs=1e-14)
    assert s["max_weight"] == pytest.approx(p.max(0).mean(), rel=1e-14)
    assert s["entropy"] == pytest.approx(float(np.mean(-(p * np.log(p)).sum(0))), rel=1e-13)


def _entry(step, max_weights, labels=("v0", "v1", "v2")):
    rows = []
    for r, m in enumerate(max_weights):
        n = len(labels) if r else 1
        rows.append({"row": r, "labels": list(labels[:n]), "mean_weights": [m] + [(1 - m) / max(n - 1, 1)] * (n - 1),
                     "entropy": 0.0, "max_weight": m, "argmax": 0})
    return {"step": step, "rows": rows}


def test_collapse_rule():
    entry = _entry(3, [1.0, 0.5, 0.995, 0.99])
    events = T.collapse_events(entry, 0.99)
    assert [(e.row, e.max_weight, e.num_sources, e.label) for e in events] == [(2, 0.995, 3, "v0")]
    assert T.collapse_events(entry, 0.999) == []  # row 0 has one source: never collapsed


class _Resets(T.ResetRule):
    def __init__(self, shrink):
        super().__init__(shrink)
        self.calls = []

    def reset_row(self, monitor, query_row):
        self.calls.append(query_row)


def _monitor(policy, num_layers=3, config=None):
    return T.DepthMonitorBase(config or ResidualConfig.variant("full"), num_layers, policy=policy)


def _record(monitor, step, row2_max):
    monitor.start_record(step)
    for r in range(4):
        labels = [f"v{i}" for i in range(r + 1)]
        m = row2_max if r == 2 else 1.0 / (r + 1)
        for scale in (0.98, 1.02):  # two forward passes: averaged
            mw = [m * scale] + [(1 - m * scale) / max(r, 1)] * r
            monitor.add_row(r, labels, {"mean_weights": mw, "entropy": 0.1 * scale, "max_weight": m * scale})
    for layer in (1, 2, 3):
        monitor.add_sublayer(layer, 2.0, 0.5 * layer)
    entry = monitor.build_entry(magnitudes=True)
    monitor.stop_record()
    return monitor.commit(entry)


def test_monitor_records_average_and_a_healthy_run_does_not_warn():
    for policy in (T.LogPolicy(), T.RaisePolicy(), T.LrScaleRule(0.5), _Resets(1.0)):
        monitor = _monitor(policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            entry = _record(monitor, 0, 0.5)
        assert entry["collapse"] == [] and monitor.history == [entry]
        assert entry["rows"][2]["max_weight"] == pytest.approx(0.5, rel=1e-15)
        assert entry["rows"][2]["entropy"] == pytest.approx(0.1, rel=1e-15)
        assert entry["output_rms"] == [0.5, 1.0, 1.5] and entry["input_rms"] == [2.0] * 3
        assert monitor.metrics()["attnres/sublayer3/output_rms"] == 1.5
    assert getattr(policy, "calls") == []


def test_each_policy_decides_on_a_constructed_collapse():
    monitor = _monitor(T.LogPolicy())
    with pytest.warns(T.DepthCollapseWarning, match=r"step 4: sublayer 3 \(row 2\).*3 sources \(mostly v0\)") as rec:
        entry = _record(monitor, 4, 0.999)
    assert rec[0].filename == __file__ and "response" not in str(rec[0].message)
    assert entry["collapse"] == [{"row": 2, "max_weight": entry["rows"][2]["max_weight"], "action": "logged"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per row and monitor
        assert _record(monitor, 5, 0.999)["collapse"][0]["action"] == "logged"

    monitor = _monitor(T.RaisePolicy())
    with pytest.raises(T.DepthCollapseError, match=r"step 1: sublayer 3 \(row 2\)"):
        _record(monitor, 1, 0.999)
    assert monitor.history[0]["step"] == 1

    rule = T.LrScaleRule(0.25)
    monitor = _monitor(rule)
    with pytest.warns(T.DepthCollapseWarning, match=r"response \(lr_scale\): lr x0.25"):
        _record(monitor, 0, 0.999)
    assert _record(monitor, 1, 0.999)["collapse"][0]["action"] == "lr x0.25 (already)"
    assert rule.factors == {2: 0.25} and rule.row_factors(4).tolist() == [1.0, 1.0, 0.25, 1.0]

    rule = _Resets(0.25)
    monitor = _monitor(rule)
    with pytest.warns(T.DepthCollapseWarning, match=r"response \(reset\): query x0.75"):
        _record(monitor, 0, 0.999)
    _record(monitor, 1, 0.999)
    assert rule.calls == [2, 2] and rule.keep == 0.75  # every collapsed record

    # M11: with block-shared queries the policy acts on the shared row
    shared = ResidualConfig(kind="block", block_size=2, query_sharing="block")
    rule = T.LrScaleRule(0.5)
    monitor = _monitor(rule, config=shared)
    with pytest.warns(T.DepthCollapseWarning):
        _record(monitor, 0, 0.999)
    assert rule.factors == {1: 0.5} and monitor.query_row(3) == 2


def test_policy_factory_and_errors():
    made = T.make_policy("reset", {"reset": _Resets}, shrink=0.5)
    assert isinstance(made, _Resets) and made.shrink == 0.5
    assert isinstance(T.make_policy("raise", {}), T.RaisePolicy)
    with pytest.raises(ValueError, match="on_collapse: expected one of"):
        T.make_policy("lr_scale", {})
    with pytest.raises(ValueError, match="factor: expected a finite real number > 0"):
        T.LrScaleRule(0.0)
    with pytest.raises(ValueError, match=r"shrink: expected a real number in \(0, 1\]"):
        T.ResetRule(1.5)
    with pytest.raises(ValueError, match="collapse_threshold"):
        _monitor(T.LogPolicy()).__init__(ResidualConfig.variant("full"), 3, collapse_threshold=1.0,
                                         policy=T.LogPolicy())
    monitor = _monitor(T.LogPolicy())
    monitor.start_record(0)
    with pytest.raises(RuntimeError, match="records do not nest"):
        monitor.start_record(1)


# -- checkpoint mappings ----------------------------------------------------------------------

D = 6


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"queries": rng.standard_normal((2 * n + 1, D)),
            "norm_weights": 1 + 0.3 * rng.standard_normal((2 * n + 1, D))}


def test_fla_and_k3_names_shapes_and_bitwise_round_trips():
    rows = _rows(2)
    fla = T.to_fla(rows)
    assert sorted(fla) == sorted(
        [f"model.layers.{i}.{s}_{w}.weight" for i in range(2) for s in ("attn_res", "mlp_res") for w in ("proj", "norm")]
        + ["model.res_proj.weight", "model.res_norm.weight"])
    assert fla["model.layers.1.mlp_res_proj.weight"].shape == (1, D)
    assert np.array_equal(fla["model.layers.1.mlp_res_proj.weight"][0], rows["queries"][3])
    assert np.array_equal(fla["model.res_norm.weight"], rows["norm_weights"][4])
    tpu = T.to_k3(rows, proj_layout="einsum", prefix="")
    assert tpu["layers.0.self_attention_res_proj.weight"].shape == (D, 1)
    assert np.array_equal(tpu["output_attn_res_proj.weight"][:, 0], rows["queries"][4])
    raw = {k.replace("_proj.weight", ".proj_weight").replace("_norm.weight", ".norm_weight"): v
           for k, v in T.to_k3(rows).items()}
    for back in (T.from_fla(fla), T.from_k3(tpu, prefix=""), T.from_k3(raw),
                 T.from_k3({**T.to_k3(rows), "model.embed_tokens.weight": np.zeros((3, D))})):
        assert all(np.array_equal(back[k], rows[k]) for k in rows)
    fla["model.res_norm.weight"][0] = 99.0  # written rows are copies
    assert rows["norm_weights"][4, 0] != 99.0
    assert T.fla_config(1).kind == "full" and T.fla_config(4).block_size == 4
    assert T.k3_config(3) == ResidualConfig(kind="block", block_size=6, eps=1e-5)


def test_mapping_is_generic_in_the_array_type():
    """The caller's as_array / stack / copy decide the array type (here: lists in, a custom stack)."""
    rows = _rows(1, seed=2)
    listed = {k: v.tolist() for k, v in T.to_fla(rows).items()}
    got = T.from_fla(listed, as_array=np.asarray, stack=lambda xs: np.stack(xs).astype(np.float32))
    assert got["queries"].dtype == np.float32
    np.testing.assert_array_equal(got["queries"], rows["queries"].astype(np.float32))


def test_mapping_errors():
    rows = _rows(2)
    sd = T.to_fla(rows)
    with pytest.raises(ValueError, match=r"state_dict\['model.layers.0.attn_res_norm.weight'\]: expected shape \[D\]"):
        T.from_fla({**sd, "model.layers.0.attn_res_norm.weight": np.zeros((1, D))})
    with pytest.raises(ValueError, match=r"with D = 6, got \(7,\)"):
        T.from_fla({**sd, "model.res_proj.weight": np.zeros(7)})
    with pytest.raises(TypeError, match="state_dict: expected a mapping"):
        T.from_fla([1, 2])
    with pytest.raises(ValueError, match=r"missing \['norm_weights'\]"):
        T.to_k3({"queries": rows["queries"]})
    with pytest.raises(ValueError, match="proj_layout: expected 'linear' or 'einsum'"):
        T.to_k3(rows, proj_layout="t")
