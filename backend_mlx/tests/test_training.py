"""MLX training tools (`attnres_mlx.training`): the schedules against the core's exact values (int
and array steps, `mlx.optimizers.join_schedules`, as an optimizer's learning rate); the monitor's
recorded statistics (the weights of the router's own reads: fused or not, the call's scale, M6
input queries, M13 low-rank keys) against the float64 reference's depth weights, a recorded
step's output and gradients equal to an unmonitored one's and the reference's, two-phase passes,
a healthy run that answers nothing, and a constructed
collapse that triggers each policy (reset in the router and the optimizer state, also on M6
`query_weights`; lr_scale equal to the row in its own optimizer at lr * factor); the FLA / K3
converters (bitwise round trips, a forward equal to the reference, at init and trained rows)."""

import warnings

import attnres_numpy.model as ref_model
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from attnres_core import training as core
from attnres_core.config import ResidualConfig
from attnres_mlx import training as T
from attnres_mlx.modules import DepthRouter
from attnres_mlx.residual_ops import rmsnorm
from mlx.utils import tree_flatten

L, D = 3, 8

# -- schedules ---------------------------------------------------------------------------------

SCHEDULES = [(T.linear_warmup, (7,)), (T.cosine_warmup, (7,)), (T.linear_warmup, (0,)),
             (T.temperature_schedule, (0.25, 2.0, 7, "linear")),
             (T.temperature_schedule, (0.25, 2.0, 7, "cosine")),
             (T.temperature_schedule, (2.0, 0.25, 7, "geometric"))]


@pytest.mark.parametrize("make,args", SCHEDULES)
def test_schedules_equal_the_core_values(make, args):
    schedule = make(*args)
    want = [schedule.curve(s) for s in range(10)]
    assert [schedule(s) for s in range(10)] == want  # int steps: the exact float64 values
    got = np.array([schedule(mx.array(s)).item() for s in range(10)], np.float32)
    assert schedule(mx.array(3)).dtype == mx.float32
    np.testing.assert_allclose(got, np.float32(want), rtol=3e-7, atol=0)
    assert got[0] == np.float32(want[0]) and np.all(got[7:] == np.float32(want[7:]))  # exact ends


def test_schedules_drive_an_mlx_optimizer():
    warm = T.cosine_warmup(4)
    joined = optim.join_schedules([warm, optim.linear_schedule(1.0, 0.0, 10)], [4])
    assert [joined(mx.array(s)).item() for s in (0, 2, 4)] == pytest.approx([0.0, 0.5, 1.0], abs=1e-7)
    opt = optim.SGD(learning_rate=T.linear_warmup(4))
    params = {"x": mx.ones((2,))}
    seen = []
    for _ in range(6):
        params = opt.apply_gradients({"x": mx.ones((2,))}, params)
        seen.append(opt.learning_rate.item())  # the rate of the update just made
    assert seen == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert params["x"].tolist() == [1.0 - 3.5] * 2  # x -= lr_k * 1 for each update


# -- the monitor -------------------------------------------------------------------------------

def _probe(kind, seed=0, query_scale=0.3):
    rng = np.random.default_rng(seed)
    cfg = ResidualConfig.variant(kind)
    params = {k: np.asarray(v, np.float32) for k, v in cfg.init_params(L, D).items()}
    if "queries" in params:
        params["queries"] = (rng.standard_normal(params["queries"].shape) * query_scale).astype(np.float32)
        params["norm_weights"] = (params["norm_weights"]
                                  + 0.3 * rng.standard_normal(params["norm_weights"].shape)).astype(np.float32)
    w = (rng.standard_normal((L, D, D)) / 3).astype(np.float32)
    emb = rng.standard_normal((2, 5, D)).astype(np.float32)
    return cfg, params, w, emb


def _subs(w, eps):
    return [lambda h, w=w[i]: mx.tanh(rmsnorm(h, eps) @ w) for i in range(w.shape[0])]


class _Model(nn.Module):
    """The probe as an MLX model: a router and its sublayer weights `[L, D, D]`."""

    def __init__(self, cfg, params, w):
        super().__init__()
        self.router = DepthRouter(cfg, w.shape[0], w.shape[1])
        T.load_into(self.router, params)
        self.w = mx.array(w)

    def __call__(self, emb, observer=None, scale=None, schedule="direct"):
        return self.router(emb, _subs(self.w, self.router.config.eps), observer=observer, scale=scale,
                           schedule=schedule)


@pytest.mark.parametrize("kind,scale,fused", [("full", None, True), ("full", None, False), ("block", 2.5, True),
                                              ("multihead", None, False)])
def test_recorded_statistics_match_the_reference_weights(kind, scale, fused):
    """The weights the pass's ops returned (fused reads or not), with the pass's own scale
    (block: 2.5 given to the call only, not to the record)."""
    cfg, params, w, emb = _probe(kind)
    model = _Model(cfg, params, w)
    model.router.fused_reads = fused
    monitor = T.DepthMonitor(model.router)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.record(4):
            model(mx.array(emb), monitor.observer, scale=scale)
            model(mx.array(emb), monitor.observer, scale=scale)  # two passes: averaged
            monitor.set_grad_norm([1.0, 2.0, 3.0])
    entry = monitor.history[0]
    assert entry["grad_norm"] == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="only inside"):
        monitor.set_grad_norm([1.0] * L)
    w64 = {k: v.astype(np.float64) for k, v in params.items()}
    _, weights = ref_model.stack_forward(cfg, w64, emb.astype(np.float64),
                                         ref_model.probe_sublayers(w.astype(np.float64), cfg.eps),
                                         return_weights=True, scale=scale)
    assert entry["step"] == 4 and [r["row"] for r in entry["rows"]] == list(range(L + 1))
    for r, ref_w in zip(entry["rows"], weights):
        want = core.weight_stats(ref_w)
        np.testing.assert_allclose(r["mean_weights"], want["mean_weights"], rtol=0, atol=2e-6)
        assert r["entropy"] == pytest.approx(want["entropy"], abs=2e-6)
        assert r["max_weight"] == pytest.approx(want["max_weight"], abs=2e-6)
    assert entry["rows"][-1]["labels"] == (["v0", "v1", "v2", "v3"] if kind == "full" else ["b0", "b1", "b2"])
    assert entry["input_rms"][0] == pytest.approx(float(np.sqrt(np.mean(emb.astype(np.float64) ** 2))), rel=1e-6)
    assert entry["collapse"] == [] and max(r["max_weight"] for r in entry["rows"][1:]) < 0.9


COLLAPSED_ROW = 2


def _collapsing(seed=0):
    """A Full probe whose row 2 query is huge along the embedding's direction: row 2 (sublayer
    3, sources v0, v1, v2) puts ~all its weight on v0."""
    cfg, params, w, _ = _probe("full", seed)
    e0 = np.zeros(D, np.float32)
    e0[0] = 1.0
    params["queries"][COLLAPSED_ROW] = 60.0 * e0
    emb = (3.0 * e0 + 0.1 * np.random.default_rng(seed + 1).standard_normal((4, 5, D))).astype(np.float32)
    return cfg, params, w, mx.array(emb)


def _train(model, monitor, optimizer, emb, steps, record_steps=(0,)):
    loss_and_grad = nn.value_and_grad(model, lambda m, e: mx.mean(m(e, monitor.observer) ** 2))
    for step in range(steps):
        if step in record_steps:
            with monitor.record(step):
                _, grads = loss_and_grad(model, emb)
        else:
            _, grads = loss_and_grad(model, emb)
        monitor.apply_update(optimizer, model, grads)
        mx.eval(model.parameters(), optimizer.state)


@pytest.mark.parametrize("policy", ["log", "raise", "lr_scale", "reset"])
def test_a_healthy_run_answers_nothing(policy):
    cfg, params, w, emb = _collapsing()
    params["queries"][COLLAPSED_ROW] = 0.3
    model = _Model(cfg, params, w)
    monitor = T.DepthMonitor(model.router, on_collapse=policy)
    before = np.array(model.router.queries)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, monitor, optim.Adam(1e-2), emb, 3, record_steps=(0, 1, 2))
    assert all(e["collapse"] == [] for e in monitor.history) and len(monitor.history) == 3
    assert not np.array_equal(np.array(model.router.queries), before)  # it trained


def test_forced_collapse_log_and_raise():
    cfg, params, w, emb = _collapsing()
    model = _Model(cfg, params, w)
    monitor = T.DepthMonitor(model.router, on_collapse="log")
    before = np.array(model.router.queries)
    with pytest.warns(T.DepthCollapseWarning, match=r"sublayer 3 \(row 2\).*3 sources \(mostly v0\)") as rec:
        with monitor.record(0):
            model(emb, monitor.observer)
    assert rec[0].filename == __file__ and len(rec) == 1
    entry = monitor.history[0]
    assert entry["rows"][2]["max_weight"] > 0.99
    assert entry["collapse"] == [{"row": 2, "max_weight": entry["rows"][2]["max_weight"], "action": "logged"}]
    assert np.array_equal(np.array(model.router.queries), before)
    monitor = T.DepthMonitor(model.router, on_collapse="raise")
    with pytest.raises(T.DepthCollapseError, match=r"step 3: sublayer 3 \(row 2\)"):
        with monitor.record(3):
            model(emb, monitor.observer)
    assert monitor.history[0]["step"] == 3


@pytest.mark.parametrize("shrink", [1.0, 0.25])
def test_forced_collapse_reset_rezeroes_the_row_its_gradient_and_adam_state(shrink):
    cfg, params, w, emb = _collapsing()
    model = _Model(cfg, params, w)
    optimizer = optim.Adam(1e-2)
    monitor = T.DepthMonitor(model.router, on_collapse=T.ResetPolicy(shrink))
    _train(model, monitor, optimizer, emb, 1, record_steps=())  # Adam has state
    before = np.array(model.router.queries)
    loss_and_grad = nn.value_and_grad(model, lambda m, e: mx.mean(m(e, monitor.observer) ** 2))
    with pytest.warns(T.DepthCollapseWarning, match=r"response \(reset\)"):
        with monitor.record(1):
            _, grads = loss_and_grad(model, emb)
    assert monitor.history[0]["collapse"][0]["action"] == ("reset to uniform" if shrink == 1.0 else "query x0.75")
    q = np.array(model.router.queries)
    others = [r for r in range(L + 1) if r != COLLAPSED_ROW]
    np.testing.assert_array_equal(q[COLLAPSED_ROW], before[COLLAPSED_ROW] * np.float32(1.0 - shrink))
    np.testing.assert_array_equal(q[others], before[others])
    monitor.apply_update(optimizer, model, grads)
    assert np.count_nonzero(np.array(grads["router"]["queries"])[COLLAPSED_ROW]) == 0
    assert np.count_nonzero(np.array(grads["router"]["queries"])[others]) > 0
    state = optimizer.state["router"]["queries"]
    for moment in ("m", "v"):  # zeroed before the update, which then saw a zero gradient
        m = np.array(state[moment])
        assert np.count_nonzero(m[COLLAPSED_ROW]) == 0 and np.count_nonzero(m[others]) > 0
    np.testing.assert_array_equal(np.array(model.router.queries)[COLLAPSED_ROW], q[COLLAPSED_ROW])
    if shrink == 1.0:  # the next pass: the row is the uniform average again
        with monitor.record(2):
            model(emb, monitor.observer)
        assert monitor.history[-1]["rows"][COLLAPSED_ROW]["max_weight"] == pytest.approx(1 / 3, abs=1e-6)


def test_forced_collapse_lr_scale_equals_the_row_in_its_own_optimizer():
    """apply_update with lr_scale gives the collapsed row exactly the trajectory of a run where
    the row is its own parameter under AdamW(lr * factor), everything else under AdamW(lr)."""
    factor, lr, steps = 0.1, 5e-2, 4
    cfg, params, w, emb = _collapsing()
    model = _Model(cfg, params, w)
    monitor = T.DepthMonitor(model.router, on_collapse=T.collapse_policy("lr_scale", factor=factor))
    with pytest.warns(T.DepthCollapseWarning, match=r"response \(lr_scale\): lr x0.1"):
        _train(model, monitor, optim.AdamW(lr, weight_decay=0.1), emb, steps, record_steps=(0,))
    assert monitor.history[0]["collapse"][0]["action"] == "lr x0.1"
    assert monitor.policy.factors == {COLLAPSED_ROW: factor}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", T.DepthCollapseWarning)  # other rows may collapse by now
        with monitor.record(steps):
            model(emb, monitor.observer)
    assert {c["row"]: c["action"] for c in monitor.history[1]["collapse"]}[COLLAPSED_ROW] == "lr x0.1 (already)"

    def loss(p):
        q = mx.concatenate([p["top"], p["row"][None], p["bottom"]])
        router = DepthRouter(cfg, L, D)
        router.update({"queries": q, "norm_weights": p["norm_weights"]})
        return mx.mean(router(emb, _subs(p["w"], cfg.eps)) ** 2)

    q0 = mx.array(params["queries"])
    p = {"top": q0[:COLLAPSED_ROW], "row": q0[COLLAPSED_ROW], "bottom": q0[COLLAPSED_ROW + 1:],
         "norm_weights": mx.array(params["norm_weights"]), "w": mx.array(w)}
    main, slow = optim.AdamW(lr, weight_decay=0.1), optim.AdamW(lr * factor, weight_decay=0.1)
    for _ in range(steps):
        grads = mx.grad(loss)(p)
        rest = main.apply_gradients({k: g for k, g in grads.items() if k != "row"},
                                    {k: v for k, v in p.items() if k != "row"})
        p = {**rest, **slow.apply_gradients({"row": grads["row"]}, {"row": p["row"]})}
    got = np.array(model.router.queries)
    np.testing.assert_allclose(got[COLLAPSED_ROW], np.array(p["row"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:COLLAPSED_ROW], np.array(p["top"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(model.w), np.array(p["w"]), rtol=1e-5, atol=1e-6)
    moved = np.abs(got[COLLAPSED_ROW] - params["queries"][COLLAPSED_ROW]).max()
    assert 0 < moved < lr * factor * steps * (1 + 0.1 * 60.0)


def test_monitor_and_policy_errors():
    router = DepthRouter(ResidualConfig.variant("full"), L, D)
    with pytest.raises(ValueError, match="on_collapse: expected one of"):
        T.DepthMonitor(router, on_collapse="shout")
    with pytest.raises(ValueError, match="factor"):
        T.LrScalePolicy(0.0)
    with pytest.raises(ValueError, match="shrink"):
        T.collapse_policy("reset", shrink=0.0)
    monitor = T.DepthMonitor(router)
    with pytest.raises(ValueError, match="model: does not hold the monitored router's 'queries'"):
        monitor.apply_update(optim.SGD(1.0), DepthRouter(ResidualConfig.variant("full"), L, D), {})


def _randomized(kind, num_layers, dim, seed):
    """A variant's parameters at init plus noise (every row's weights away from uniform), the
    probe's sublayer weights and an embedding `[2, 3, dim]` (T = 3), float32."""
    rng = np.random.default_rng(seed)
    cfg = ResidualConfig.variant(kind)
    params = {k: (np.asarray(v, np.float32) + 0.2 * rng.standard_normal(np.shape(v))).astype(np.float32)
              for k, v in cfg.init_params(num_layers, dim).items()}
    w = (rng.standard_normal((num_layers, dim, dim)) / 3).astype(np.float32)
    emb = rng.standard_normal((2, 3, dim)).astype(np.float32)
    return cfg, params, w, emb


@pytest.mark.parametrize("kind", ["input_query", "low_rank_keys", "full"])
def test_monitor_takes_the_weights_of_input_queries_and_low_rank_keys(kind):
    """M6 input-dependent queries and M13 low-rank keys (D = 16, L = 4, T = 3): the recorded
    statistics are the float64 reference's weights' (upcast inputs); the recorded pass's output
    and gradients (random cotangent; router parameters, sublayer weights, embedding) are those
    of an unmonitored pass bit for bit, and the reference's (`probe_vjp`)."""
    num_layers, dim = 4, 16
    cfg, params, w, emb = _randomized(kind, num_layers, dim, seed=3)
    cot = np.random.default_rng(4).standard_normal(emb.shape).astype(np.float32)
    model = _Model(cfg, params, w)
    monitor = T.DepthMonitor(model.router)

    def step(observer):
        def loss(tree, e):
            model.update(tree)
            return mx.sum(model(e, observer) * mx.array(cot))
        value, grads = mx.value_and_grad(loss, argnums=(0, 1))(model.trainable_parameters(), mx.array(emb))
        mx.eval(value, grads)
        return value, grads

    plain_value, (plain_tree, plain_emb) = step(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with monitor.record(0):
            value, (tree, g_emb) = step(monitor.observer)
    assert value.item() == plain_value.item()
    assert np.array_equal(np.array(g_emb), np.array(plain_emb))
    for (name, g), (_, g0) in zip(tree_flatten(tree), tree_flatten(plain_tree)):
        assert np.array_equal(np.array(g), np.array(g0)), name

    w64 = {k: v.astype(np.float64) for k, v in params.items()}
    emb64, sub64 = emb.astype(np.float64), w.astype(np.float64)
    _, weights = ref_model.stack_forward(cfg, w64, emb64, ref_model.probe_sublayers(sub64, cfg.eps),
                                         return_weights=True)
    entry = monitor.history[0]
    assert [r["row"] for r in entry["rows"]] == list(range(num_layers + 1))
    for r, ref_w in zip(entry["rows"], weights):
        want = core.weight_stats(ref_w)
        np.testing.assert_allclose(r["mean_weights"], want["mean_weights"], rtol=0, atol=3e-6)
        assert r["entropy"] == pytest.approx(want["entropy"], abs=3e-6)
        assert r["max_weight"] == pytest.approx(want["max_weight"], abs=3e-6)
    assert all(r["max_weight"] > 1 / len(r["labels"]) + 0.02 for r in entry["rows"][1:])  # not M8's uniform

    ref = ref_model.probe_vjp(cfg, w64, emb64, sub64, cot.astype(np.float64))
    got = dict(tree_flatten(tree))
    np.testing.assert_allclose(np.array(got["w"]), ref["sublayer_weights"], rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np.array(g_emb), ref["embedding"], rtol=1e-4, atol=2e-5)
    for name in cfg.param_shapes(num_layers, dim):
        np.testing.assert_allclose(np.array(got[f"router.{name}"]), ref[name], rtol=1e-4, atol=2e-5,
                                   err_msg=name)


def test_input_query_reset_zeroes_the_query_weights_row():
    """reset on M6 queries acts on `query_weights` `[R, D, D]`: the row is zeroed (its next
    read is the uniform average), and apply_update zeroes its gradient and Adam moments."""
    cfg, params, w, emb = _randomized("input_query", L, D, seed=5)
    model = _Model(cfg, params, w)
    monitor = T.DepthMonitor(model.router, on_collapse="reset")
    optimizer = optim.Adam(1e-2)
    _train(model, monitor, optimizer, mx.array(emb), 1, record_steps=())  # Adam has state
    before = np.array(model.router.query_weights)
    monitor.policy.reset_row(monitor, COLLAPSED_ROW)
    q = np.array(model.router.query_weights)
    others = [r for r in range(L + 1) if r != COLLAPSED_ROW]
    assert np.count_nonzero(q[COLLAPSED_ROW]) == 0 and np.array_equal(q[others], before[others])
    _, grads = nn.value_and_grad(model, lambda m, e: mx.mean(m(e) ** 2))(model, mx.array(emb))
    monitor.apply_update(optimizer, model, grads)
    assert np.count_nonzero(np.array(grads["router"]["query_weights"])[COLLAPSED_ROW]) == 0
    for moment in ("m", "v"):
        assert np.count_nonzero(np.array(optimizer.state["router"]["query_weights"][moment])[COLLAPSED_ROW]) == 0
    with monitor.record(1):
        model(mx.array(emb), monitor.observer)
    row = monitor.history[-1]["rows"][COLLAPSED_ROW]
    np.testing.assert_allclose(row["mean_weights"], [1 / 3] * 3, rtol=0, atol=1e-6)


def test_two_phase_under_a_record_runs_direct_and_outside_runs_unobserved():
    """The observer wants weights only while recording: a two-phase pass (M9) outside a record
    equals the unobserved one and records nothing; inside one the router runs it as a direct
    pass (as torch's router does), whose output is the two-phase one's (spec 3) and whose
    entry is the direct pass's, row for row."""
    cfg, params, w, emb = _probe("block")
    model = _Model(cfg, params, w)
    monitor = T.DepthMonitor(model.router)
    x = mx.array(emb)
    plain = np.array(model(x, schedule="two_phase"))
    assert np.array_equal(np.array(model(x, monitor.observer, schedule="two_phase")), plain)
    assert monitor.history == []
    with monitor.record(0):
        recorded = np.array(model(x, monitor.observer, schedule="two_phase"))
    direct = np.array(model(x))
    assert np.array_equal(recorded, direct)
    np.testing.assert_allclose(recorded, plain, rtol=1e-5, atol=1e-6)
    with monitor.record(1):
        model(x, monitor.observer)
    assert [r["row"] for r in monitor.history[0]["rows"]] == list(range(L + 1))
    assert monitor.history[0]["rows"] == monitor.history[1]["rows"]


# -- converters --------------------------------------------------------------------------------

@pytest.mark.parametrize("init", [True, False])
def test_converters_round_trip_and_equal_the_reference(init):
    n = 2
    cfg = T.fla_config(4)
    rng = np.random.default_rng(3)
    rows = {k: np.asarray(v, np.float32) for k, v in cfg.init_params(2 * n, D).items()}
    if not init:
        rows = {"queries": rng.standard_normal((2 * n + 1, D)).astype(np.float32),
                "norm_weights": (1 + 0.3 * rng.standard_normal((2 * n + 1, D))).astype(np.float32)}
    fla = core.to_fla(rows)
    router = DepthRouter(cfg, 2 * n, D)
    T.load_into(router, T.from_fla({**fla, "model.embeddings.weight": np.zeros((3, D), np.float32)}))
    for k, v in T.to_fla(router).items():
        assert v.shape == fla[k].shape and np.array_equal(np.array(v), fla[k]), k
    k3 = T.to_k3(router, proj_layout="einsum")
    assert k3["model.layers.0.mlp_res_proj.weight"].shape == (D, 1)
    assert all(np.array_equal(np.array(T.from_k3(k3)[k]), rows[k]) for k in rows)
    w = (rng.standard_normal((2 * n, D, D)) / 3).astype(np.float32)
    emb = rng.standard_normal((2, 4, D)).astype(np.float32)
    want = ref_model.stack_forward(cfg, {k: v.astype(np.float64) for k, v in rows.items()},
                                   emb.astype(np.float64), ref_model.probe_sublayers(w.astype(np.float64), cfg.eps))
    got = np.array(router(mx.array(emb), _subs(mx.array(w), cfg.eps)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match=r"params\['queries'\]: expected shape"):
        T.load_into(router, {"queries": np.zeros((3, D)), "norm_weights": np.zeros((2 * n + 1, D))})


def test_a_compiled_step_is_refused_with_the_fix_not_recorded_empty():
    """mx.compile traces the observer once (placeholder arrays) and then replays the graph
    without calling it: the record refuses both, naming the fix, instead of a cryptic eval error
    or an entry with no rows; the eager step still records."""
    cfg, params, w, emb = _probe("full")
    model = _Model(cfg, params, w)
    monitor = T.DepthMonitor(model.router)
    step = mx.compile(lambda e: model(e, monitor.observer))
    for n in range(3):  # the trace, then the replays
        with pytest.raises(RuntimeError, match=r"mx\.compile.*run the steps you record eagerly"):
            with monitor.record(n):
                mx.eval(step(mx.array(emb)))
    assert monitor.history == [] and not monitor.recording
    with monitor.record(3):
        model(mx.array(emb), monitor.observer)
    assert len(monitor.history) == 1 and len(monitor.history[0]["rows"]) == L + 1
