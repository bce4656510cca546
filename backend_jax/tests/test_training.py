"""JAX training tools (`attnres_jax.training`): the optax-style schedules against the core's exact
values (eager, under jit, inside `optax.join_schedules`, traced into the model without
recompiles); the monitor's recorded statistics against the float64 reference's depth weights, a
healthy run that answers nothing, and a constructed collapse that triggers each policy (reset in
the NNX and optimizer state, lr_scale equal to a run with the row in its own lower-lr group);
the FLA / K3 converters (bitwise round trips, a forward equal to the reference, saved and
restored through nnx.state / nnx.update and orbax)."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from attnres_core import training as core
from attnres_core.config import ResidualConfig
from attnres_jax import stack as R
from attnres_jax import training as T
from attnres_jax.modules import DepthRouter, Transformer
from attnres_numpy import model as ref_model
from flax import nnx

L, D = 3, 8

# -- schedules ---------------------------------------------------------------------------------

SCHEDULES = [(T.linear_warmup, (7,)), (T.cosine_warmup, (7,)), (T.linear_warmup, (0,)),
             (T.temperature_schedule, (0.25, 2.0, 7, "linear")),
             (T.temperature_schedule, (0.25, 2.0, 7, "cosine")),
             (T.temperature_schedule, (2.0, 0.25, 7, "geometric"))]


@pytest.mark.parametrize("make,args", SCHEDULES)
def test_schedules_equal_the_core_values_eager_and_jitted(make, args):
    schedule = make(*args)
    steps = np.arange(10)
    want = np.array([schedule.curve(int(s)) for s in steps])
    for f in (schedule, jax.jit(schedule)):
        got = np.array([f(jnp.int32(s)) for s in steps])
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=3e-7, atol=0)
        assert got[0] == np.float32(want[0]) and np.all(got[7:] == np.float32(want[7:]))  # exact ends
    assert float(schedule(3)) == pytest.approx(schedule.curve(3), rel=3e-7)  # a Python count


def test_schedules_join_with_optax_and_trace_into_the_model():
    warm = T.cosine_warmup(4)
    joined = optax.join_schedules([warm, optax.constant_schedule(1.0)], [4])
    assert [float(joined(i)) for i in (0, 4, 9)] == [0.0, 1.0, 1.0]
    assert float(joined(2)) == pytest.approx(0.5, abs=1e-7)
    model = Transformer(ResidualConfig.variant("block"), vocab_size=13, dim=D, num_blocks=2,
                        num_heads=2, rngs=nnx.Rngs(0))
    q = model.router.queries
    q[...] = jnp.asarray(np.random.default_rng(0).standard_normal(q[...].shape), jnp.float32)
    alpha, temp = T.linear_warmup(4), T.temperature_schedule(0.5, 2.0, 4, "geometric")
    traces = []

    @nnx.jit
    def logits(model, tokens, count):
        traces.append(1)
        return model(tokens, mix=alpha(count), scale=temp(count))

    tokens = jnp.arange(12).reshape(2, 6) % 13
    for count in (0, 2, 5):  # start, inside, past the end
        got = logits(model, tokens, jnp.int32(count))
        want = model(tokens, mix=alpha.curve(count), scale=temp.curve(count))  # Python floats
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert len(traces) == 1  # one compiled step served every alpha and temperature


# -- the monitor -------------------------------------------------------------------------------

def _probe(kind, seed=0, query_scale=0.3):
    rng = np.random.default_rng(seed)
    cfg = ResidualConfig.variant(kind)
    params = {k: np.asarray(v, np.float64) for k, v in cfg.init_params(L, D).items()}
    if "queries" in params:
        params["queries"] = rng.standard_normal(params["queries"].shape) * query_scale
        params["norm_weights"] = params["norm_weights"] + 0.3 * rng.standard_normal(params["norm_weights"].shape)
    w = rng.standard_normal((L, D, D)) / 3
    emb = rng.standard_normal((2, 5, D))
    return cfg, params, w, emb


@pytest.mark.parametrize("kind", ["full", "block", "multihead"])
def test_recorded_statistics_match_the_reference_weights(kind):
    cfg, params, w, emb = _probe(kind)
    with jax.enable_x64(True):
        router = DepthRouter(cfg, L, D, dtype=jnp.float64)
        router.load_params(params)
        monitor = T.DepthMonitor(router)

        @jax.jit
        def run(emb, w):
            obs = monitor.observer()
            out = router(emb, R.probe_sublayers(w, cfg.eps), observer=obs)
            return out, obs.stats()

        _, stats = run(jnp.asarray(emb), jnp.asarray(w))
        _, stats2 = run(jnp.asarray(emb), jnp.asarray(w))  # a cached call: labels kept
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            entry = monitor.update(7, stats2)
    _, weights = ref_model.stack_forward(cfg, params, emb, ref_model.probe_sublayers(w, cfg.eps),
                                         return_weights=True)
    assert entry["step"] == 7 and [r["row"] for r in entry["rows"]] == list(range(L + 1))
    for r, ref_w in zip(entry["rows"], weights):
        want = core.weight_stats(ref_w)
        np.testing.assert_allclose(r["mean_weights"], want["mean_weights"], rtol=0, atol=1e-12)
        assert r["entropy"] == pytest.approx(want["entropy"], abs=1e-12)
        assert r["max_weight"] == pytest.approx(want["max_weight"], abs=1e-12)
        assert len(r["labels"]) == ref_w.shape[0]
    assert entry["rows"][-1]["labels"] == (["v0", "v1", "v2", "v3"] if kind == "full" else ["b0", "b1", "b2"])
    assert entry["collapse"] == [] and max(r["max_weight"] for r in entry["rows"][1:]) < 0.9
    h = [emb]
    for layer in range(L):  # the sublayer magnitudes: input h_l, output v_l
        assert entry["input_rms"][layer] > 0
    assert entry["input_rms"][0] == pytest.approx(float(np.sqrt(np.mean(h[0] ** 2))), rel=1e-12)


COLLAPSED_ROW = 2


def _collapsing(seed=0):
    """A Full probe (float32) whose row 2 query is huge along the embedding's direction: row 2
    (sublayer 3, sources v0, v1, v2) puts ~all its weight on v0."""
    cfg, params, w, emb = _probe("full", seed)
    e0 = np.zeros(D)
    e0[0] = 1.0
    params["queries"][COLLAPSED_ROW] = 60.0 * e0
    emb = 3.0 * e0 + 0.1 * np.random.default_rng(seed + 1).standard_normal((4, 5, D))
    return cfg, {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}, jnp.asarray(w, jnp.float32), \
        jnp.asarray(emb, jnp.float32)


class _Model(nnx.Module):
    """The probe as an NNX model: a router and its sublayer weights."""

    def __init__(self, cfg, params, w):
        self.router = DepthRouter(cfg, L, D)
        self.router.load_params(params)
        self.w = nnx.Param(w)

    def __call__(self, emb, observer=None):
        return self.router(emb, R.probe_sublayers(self.w[...], self.router.config.eps), observer=observer)


def _step_fn(monitor):
    @nnx.jit
    def step(model, optimizer, emb, factors):
        obs = monitor.observer()

        def loss_fn(model):
            return jnp.mean(model(emb, obs) ** 2), obs.stats()

        (loss, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads, query_lr_factors=factors)
        return loss, stats

    return step


@pytest.mark.parametrize("policy", ["log", "raise", "lr_scale", "reset"])
def test_a_healthy_run_answers_nothing(policy):
    cfg, params, w, emb = _collapsing()
    params = {**params, "queries": params["queries"].at[COLLAPSED_ROW].set(0.3)}
    model = _Model(cfg, params, w)
    optimizer = nnx.Optimizer(model, optax.chain(optax.adam(1e-2), T.query_lr_scale()), wrt=nnx.Param)
    monitor = T.DepthMonitor(model.router, on_collapse=policy, optimizer=optimizer)
    step = _step_fn(monitor)
    before = np.asarray(model.router.queries[...])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            _, stats = step(model, optimizer, emb, monitor.lr_factors())
            entry = monitor.update(i, stats)
            assert entry["collapse"] == []
    assert np.all(np.asarray(monitor.lr_factors()) == 1.0)
    assert not np.array_equal(np.asarray(model.router.queries[...]), before)  # it trained


def test_forced_collapse_log_and_raise():
    cfg, params, w, emb = _collapsing()
    model = _Model(cfg, params, w)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    monitor = T.DepthMonitor(model.router, on_collapse="log")
    step = _step_fn(monitor)
    _, stats = step(model, optimizer, emb, None)
    with pytest.warns(T.DepthCollapseWarning, match=r"sublayer 3 \(row 2\).*3 sources \(mostly v0\)") as rec:
        entry = monitor.update(0, stats)
    assert rec[0].filename == __file__ and len(rec) == 1
    assert entry["collapse"] == [{"row": 2, "max_weight": entry["rows"][2]["max_weight"], "action": "logged"}]
    assert entry["rows"][2]["max_weight"] > 0.99
    monitor = T.DepthMonitor(model.router, on_collapse="raise")
    _, stats = _step_fn(monitor)(model, optimizer, emb, None)
    with pytest.raises(T.DepthCollapseError, match=r"step 3: sublayer 3 \(row 2\)"):
        monitor.update(3, stats)
    assert monitor.history[0]["step"] == 3


@pytest.mark.parametrize("shrink", [1.0, 0.25])
def test_forced_collapse_reset_rezeroes_the_row_in_the_nnx_and_optimizer_state(shrink):
    cfg, params, w, emb = _collapsing()
    model = _Model(cfg, params, w)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    monitor = T.DepthMonitor(model.router, on_collapse=T.ResetPolicy(shrink, optimizer, path=("router",)))
    step = _step_fn(monitor)
    _, stats = step(model, optimizer, emb, None)
    before = np.asarray(model.router.queries[...])
    adam = optimizer.opt_state[0]
    gains_state = [np.asarray(m["router"]["norm_weights"][...]) for m in (adam.mu, adam.nu)]
    with pytest.warns(T.DepthCollapseWarning, match=r"response \(reset\)"):
        entry = monitor.update(0, stats)
    assert entry["collapse"][0]["action"] == ("reset to uniform" if shrink == 1.0 else "query x0.75")
    q = np.asarray(model.router.queries[...])
    others = [r for r in range(L + 1) if r != COLLAPSED_ROW]
    np.testing.assert_array_equal(q[COLLAPSED_ROW], before[COLLAPSED_ROW] * np.float32(1.0 - shrink))
    np.testing.assert_array_equal(q[others], before[others])
    for moment, gains in zip((adam.mu, adam.nu), gains_state):
        m = np.asarray(moment["router"]["queries"][...])
        assert np.count_nonzero(m[COLLAPSED_ROW]) == 0 and np.count_nonzero(m[others]) > 0
        np.testing.assert_array_equal(np.asarray(moment["router"]["norm_weights"][...]), gains)  # same shape, kept
    if shrink == 1.0:  # the next pass: the row is the uniform average again
        _, stats = step(model, optimizer, emb, None)
        row = monitor.update(1, stats)["rows"][COLLAPSED_ROW]
        assert row["max_weight"] == pytest.approx(1 / 3, abs=2e-2)
    with pytest.raises(ValueError, match="optimizer: holds no state for the router's 'queries'"):
        T.ResetPolicy(optimizer=optimizer, path=("elsewhere",)).reset_row(monitor, 0)


def test_forced_collapse_lr_scale_equals_the_row_in_its_own_lower_lr_group():
    """`query_lr_scale` with the monitor's factors gives the collapsed row exactly the trajectory
    of a run where that row is its own parameter under adamw(lr * factor)."""
    factor, lr, steps = 0.1, 5e-2, 4
    cfg, params, w, emb = _collapsing()
    model = _Model(cfg, params, w)
    tx = optax.chain(optax.adamw(lr, weight_decay=0.1), T.query_lr_scale(path=("router",)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    monitor = T.DepthMonitor(model.router, on_collapse=T.collapse_policy("lr_scale", factor=factor))
    step = _step_fn(monitor)
    for i in range(steps):
        _, stats = step(model, optimizer, emb, monitor.lr_factors())
        if i == 0:
            with pytest.warns(T.DepthCollapseWarning, match=r"response \(lr_scale\): lr x0.1"):
                monitor.update(i, stats)
    assert np.asarray(monitor.lr_factors()).tolist() == [1.0, 1.0, np.float32(factor), 1.0]

    # reference: step 0 at lr for every row, then the row alone in a group at lr * factor
    def loss(p):
        q = jnp.concatenate([p["top"], p["row"][None], p["bottom"]])
        out = R.stack_apply(cfg, {"queries": q, "norm_weights": p["norm_weights"]}, emb,
                            R.probe_sublayers(p["w"], cfg.eps))
        return jnp.mean(out ** 2)

    q0 = params["queries"]
    p = {"top": q0[:COLLAPSED_ROW], "row": q0[COLLAPSED_ROW], "bottom": q0[COLLAPSED_ROW + 1:],
         "norm_weights": params["norm_weights"], "w": w}
    labels = {k: "slow" if k == "row" else "main" for k in p}

    def run(schedule_slow):
        tx = optax.multi_transform({"main": optax.adamw(lr, weight_decay=0.1),
                                    "slow": optax.adamw(schedule_slow, weight_decay=0.1)}, labels)

        @jax.jit
        def ref_step(x, state):
            updates, state = tx.update(jax.grad(loss)(x), state, x)
            return optax.apply_updates(x, updates), state

        state, x = tx.init(p), dict(p)
        for _ in range(steps):
            x, state = ref_step(x, state)
        return x

    ref = run(optax.join_schedules([optax.constant_schedule(lr), optax.constant_schedule(lr * factor)], [1]))
    got_q = np.asarray(model.router.queries[...])
    np.testing.assert_allclose(got_q[COLLAPSED_ROW], np.asarray(ref["row"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_q[:COLLAPSED_ROW], np.asarray(ref["top"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.w[...]), np.asarray(ref["w"]), rtol=1e-5, atol=1e-6)
    unscaled = run(lr)  # and the factor made a difference
    assert np.abs(np.asarray(unscaled["row"]) - got_q[COLLAPSED_ROW]).max() > 10 * lr * factor * 1e-2


def test_the_documented_transformer_step_records_every_row():
    """The docs' flow on the NNX Transformer: observer through `Transformer(observer=)` inside
    one `nnx.jit` AdamW step (two forward passes, averaged), `update` on the host, the
    `query_lr_scale` transform in the chain; the recorded rows equal a direct eager pass's."""
    model = Transformer(ResidualConfig.variant("block"), vocab_size=13, dim=D, num_blocks=2,
                        num_heads=2, rngs=nnx.Rngs(1))
    q = model.router.queries
    q[...] = jnp.asarray(np.random.default_rng(1).standard_normal(q[...].shape), jnp.float32)
    tx = optax.chain(optax.adamw(1e-3), T.query_lr_scale(path=("router",)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    monitor = T.DepthMonitor(model.router, on_collapse="raise")
    tokens = jnp.arange(12).reshape(2, 6) % 13

    eager = monitor.observer()
    model(tokens, observer=eager)
    want = monitor.update(-1, eager.stats())

    @nnx.jit
    def train_step(model, optimizer, tokens, factors):
        obs = monitor.observer()

        def loss_fn(model):
            loss = jnp.mean(model(tokens, observer=obs) ** 2) + jnp.mean(model(tokens, observer=obs))
            return loss, obs.stats()

        (value, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads, query_lr_factors=factors)
        return value, stats

    _, stats = train_step(model, optimizer, tokens, monitor.lr_factors())
    entry = monitor.update(0, stats)
    assert [r["row"] for r in entry["rows"]] == list(range(5)) and entry["collapse"] == []
    for got, ref in zip(entry["rows"], want["rows"]):
        assert got["labels"] == ref["labels"]
        np.testing.assert_allclose(got["mean_weights"], ref["mean_weights"], rtol=1e-5, atol=1e-6)
    assert len(entry["input_rms"]) == 4 and all(x > 0 for x in entry["output_rms"])


def test_policy_argument_errors():
    router = DepthRouter(ResidualConfig.variant("full"), L, D)
    with pytest.raises(ValueError, match="on_collapse: expected one of"):
        T.DepthMonitor(router, on_collapse="shout")
    with pytest.raises(ValueError, match="factor"):
        T.LrScalePolicy(0.0)
    with pytest.raises(ValueError, match="shrink"):
        T.ResetPolicy(1.5)
    with pytest.raises(TypeError, match="optimizer: expected an nnx.Optimizer"):
        T.ResetPolicy(optimizer=optax.adam(1e-3))
    with pytest.raises(ValueError, match="collapse_threshold"):
        T.DepthMonitor(router, collapse_threshold=0.0)


# -- converters --------------------------------------------------------------------------------

def _k3_state_dict(n, seed):
    rng = np.random.default_rng(seed)
    rows = {"queries": rng.standard_normal((2 * n + 1, D)).astype(np.float32),
            "norm_weights": (1 + 0.3 * rng.standard_normal((2 * n + 1, D))).astype(np.float32)}
    return rows, core.to_k3(rows, proj_layout="einsum")  # tpu-inference's [D, 1] kernels


@pytest.mark.parametrize("init", [True, False])
def test_k3_and_fla_converters_round_trip_and_equal_the_reference(init, tmp_path):
    n, block = 2, 1
    cfg = T.k3_config(block)
    rows, sd = _k3_state_dict(n, seed=4)
    if init:  # the converted router at init is the M8 init
        rows = {k: np.asarray(v, np.float32) for k, v in cfg.init_params(2 * n, D).items()}
        sd = core.to_k3(rows, proj_layout="einsum")
    router = DepthRouter(cfg, 2 * n, D)
    T.load_into(router, T.from_k3({**sd, "model.embed_tokens.weight": np.zeros((3, D))}))
    for k, v in T.to_k3(router, proj_layout="einsum").items():
        assert v.shape == sd[k].shape and np.array_equal(np.asarray(v), sd[k]), k
    fla = T.to_fla(router)
    assert fla["model.layers.1.attn_res_proj.weight"].shape == (1, D)
    assert all(np.array_equal(np.asarray(T.from_fla(fla)[k]), rows[k]) for k in rows)

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((2 * n, D, D)) / 3).astype(np.float32)
    emb = rng.standard_normal((2, 4, D)).astype(np.float32)
    want = ref_model.stack_forward(cfg, rows, emb, ref_model.probe_sublayers(w, cfg.eps))
    fwd = jax.jit(lambda params, e, w: R.stack_apply(cfg, params, e, R.probe_sublayers(w, cfg.eps)))
    got = fwd(router.params(), emb, w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)

    # saved and restored: nnx.state / nnx.update, and through orbax on disk
    fresh = DepthRouter(cfg, 2 * n, D)
    nnx.update(fresh, nnx.state(router))
    assert np.array_equal(np.asarray(fwd(fresh.params(), emb, w)), np.asarray(got))
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "router", nnx.state(router))
        ckpt.wait_until_finished()
        restored_router = DepthRouter(cfg, 2 * n, D)
        restored = ckpt.restore(tmp_path / "router", nnx.state(restored_router))
    nnx.update(restored_router, restored)
    for k, v in T.to_k3(restored_router, proj_layout="einsum").items():
        assert np.array_equal(np.asarray(v), sd[k]), k
    again = fwd(restored_router.params(), emb, w)
    assert np.array_equal(np.asarray(again), np.asarray(got))
    if not init:
        assert np.abs(np.asarray(got) - want).max() < 1e-4 and math.isfinite(float(jnp.abs(got).max()))
