"""The probe network for every variant, both schedules, and user sublayers (spec 4-6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_jax import probe_forward, stack_apply
from attnres_numpy import model as ref
from jax_helpers import assert_close, precision

L, D = 5, 8


def _probe_inputs(rng, config, dtype):
    params = {k: rng.standard_normal(s) * 0.5 for k, s in config.param_shapes(L, D).items()}
    emb = rng.standard_normal((2, 3, D))
    w = rng.standard_normal((L, D, D)) / np.sqrt(D)
    cast = lambda a: jnp.asarray(a, jnp.dtype(dtype))  # noqa: E731
    native = ({k: cast(v) for k, v in params.items()}, cast(emb), cast(w))
    upcast = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), native)
    return native, upcast


# Every variant in float64; the float32 glue (casts, fp32 statistics) on three of them.
PROBE_CASES = [(v, "float64") for v in sorted(VARIANT_KINDS)] + [
    (v, "float32") for v in ("block", "input_query", "multihead")]


@pytest.mark.parametrize("variant, dtype", PROBE_CASES)
def test_probe_matches_reference(rng, variant, dtype):
    config = ResidualConfig.variant(variant)
    with precision(dtype):
        (params, emb, w), (p64, e64, w64) = _probe_inputs(rng, config, dtype)
        f = jax.jit(lambda p, e, w: probe_forward(config, p, e, w))
        out, vjp = jax.vjp(f, params, emb, w)
        assert_close(out, ref.probe_forward(config, p64, e64, w64), dtype, "out", grad=False)
        cot = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
        want = ref.probe_vjp(config, p64, e64, w64, np.asarray(cot, np.float64))
        d_params, d_emb, d_w = vjp(cot)
        assert_close(d_emb, want["embedding"], dtype, "embedding", grad=True)
        assert_close(d_w, want["sublayer_weights"], dtype, "sublayer_weights", grad=True)
        assert set(d_params) == set(config.param_shapes(L, D))
        for name, value in d_params.items():
            assert_close(value, want[name], dtype, name, grad=True)


@pytest.mark.parametrize("block_size", [2, 3])  # L = 5: blocks (2, 2, 1) and (3, 2)
def test_two_phase_equals_direct(rng, block_size):
    config = ResidualConfig.variant("block", block_size=block_size)
    assert config.supports_two_phase
    with precision("float64"):
        (params, emb, w), (p64, e64, w64) = _probe_inputs(rng, config, "float64")
        cot = jnp.asarray(rng.standard_normal(emb.shape))
        results = {}
        for schedule in ("direct", "two_phase"):
            f = jax.jit(lambda p, e, w, s=schedule: probe_forward(config, p, e, w, schedule=s))
            out, vjp = jax.vjp(f, params, emb, w)
            results[schedule] = (out, vjp(cot))
        np.testing.assert_allclose(results["two_phase"][0], results["direct"][0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(results["two_phase"][0], ref.probe_forward(config, p64, e64, w64,
                                                                              schedule="two_phase"), atol=1e-12)
        for a, b in zip(jax.tree_util.tree_leaves(results["two_phase"][1]),
                        jax.tree_util.tree_leaves(results["direct"][1])):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_stack_apply_with_user_sublayers(rng):
    """Arbitrary callables (here: plain pytrees of weights) driven by the schedule."""
    config = ResidualConfig.variant("window", window=2)
    mats = [rng.standard_normal((D, D)) / np.sqrt(D) for _ in range(L)]
    params = {k: rng.standard_normal(s) for k, s in config.param_shapes(L, D).items()}
    emb = rng.standard_normal((4, D))
    with precision("float64"):
        subs = [lambda h, m=jnp.asarray(m): jax.nn.relu(h @ m) + 0.1 * h for m in mats]
        out = jax.jit(lambda p, e: stack_apply(config, p, e, subs))(params, jnp.asarray(emb))
    ref_subs = [lambda h, m=m: np.maximum(h @ m, 0) + 0.1 * h for m in mats]
    np.testing.assert_allclose(out, ref.stack_forward(config, params, emb, ref_subs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, exc, match", [
    (dict(schedule="two_phase"), ValueError, "schedule: 'two_phase' needs"),
    (dict(schedule="fast"), ValueError, "schedule: expected one of"),
    (dict(params={"queries": np.zeros((L + 1, D))}), ValueError, "params: expected names"),
    (dict(params={"queries": np.zeros((L, D)), "norm_weights": np.ones((L + 1, D))}), ValueError,
     r"params\['queries'\]: expected shape"),
    (dict(sublayers=[]), ValueError, "sublayers"),
    (dict(config="full"), TypeError, "config"),
])
def test_stack_errors(change, exc, match):
    args = dict(config=ResidualConfig.variant("full"), params=ResidualConfig.variant("full").init_params(L, D),
                embedding=np.ones((2, D), np.float32), sublayers=[jnp.tanh] * L, schedule="direct")
    args.update(change)
    with pytest.raises(exc, match=match):
        stack_apply(args["config"], args["params"], args["embedding"], args["sublayers"], schedule=args["schedule"])


@pytest.mark.parametrize("variant, schedule, mix, traced", [
    ("full", "direct", 0.35, False), ("block", "two_phase", 0.6, True), ("window", "direct", 0.0, False),
    ("block", "direct", 0.0, True), ("input_query", "direct", 0.8, True)])
def test_mix_and_scale_match_reference(rng, variant, schedule, mix, traced):
    """M10: a Python-float alpha (static) or a traced one (one jit for every alpha), with a
    per-call scale: value and every gradient against the float64 reference."""
    config = ResidualConfig.variant(variant)
    scale = 1.6
    with precision("float64"):
        (params, emb, w), (p64, e64, w64) = _probe_inputs(rng, config, "float64")
        if traced:
            f = jax.jit(lambda p, e, w, a: probe_forward(config, p, e, w, schedule=schedule, mix=a, scale=scale))
            out, vjp = jax.vjp(lambda p, e, w: f(p, e, w, jnp.asarray(mix)), params, emb, w)
        else:
            f = jax.jit(lambda p, e, w: probe_forward(config, p, e, w, schedule=schedule, mix=mix, scale=scale))
            out, vjp = jax.vjp(f, params, emb, w)
        kw = dict(schedule=schedule, mix=mix, scale=scale)
        assert_close(out, ref.probe_forward(config, p64, e64, w64, **kw), "float64", "out", grad=False)
        cot = jnp.asarray(rng.standard_normal(out.shape))
        want = ref.probe_vjp(config, p64, e64, w64, np.asarray(cot), **kw)
        d_params, d_emb, d_w = vjp(cot)
        assert_close(d_emb, want["embedding"], "float64", "embedding", grad=True)
        assert_close(d_w, want["sublayer_weights"], "float64", "sublayer_weights", grad=True)
        for name, value in d_params.items():
            if mix == 0.0:  # M10: no gradient reaches the depth attention at alpha = 0
                assert not np.any(np.asarray(value)) and not np.any(want[name]), name
            else:
                assert_close(value, want[name], "float64", name, grad=True)


def test_mix_errors():
    config = ResidualConfig.variant("full")
    params = {k: jnp.zeros(s) for k, s in config.param_shapes(1, D).items()}
    f = [lambda h: h]
    with pytest.raises(ValueError, match="mix: expected a real number in"):
        stack_apply(config, params, jnp.ones(D), f, mix=-0.5)
    with pytest.raises(ValueError, match="scale: expected a finite real"):
        stack_apply(config, params, jnp.ones(D), f, scale=float("nan"))
    with pytest.raises(ValueError, match="mix: .*attention kind"):
        stack_apply(ResidualConfig(kind="standard"), {}, jnp.ones(D), f, mix=0.5)
