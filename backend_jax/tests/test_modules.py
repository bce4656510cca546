"""Flax NNX modules: parameter layout, probe parity, zero-init == PreNorm, two-phase."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_jax import probe_sublayers
from attnres_jax.modules import DepthAttention, DepthRouter, Transformer
from attnres_numpy import model as ref
from attnres_numpy import ops as ref_ops
from flax import nnx
from jax_helpers import precision

L, D = 4, 8


@pytest.mark.parametrize("variant", sorted(VARIANT_KINDS))
def test_router_params_named_and_shaped_as_config(variant):
    config = ResidualConfig.variant(variant)
    router = DepthRouter(config, L, D)
    params = router.params()
    assert {k: v.shape for k, v in params.items()} == config.param_shapes(L, D)
    for name, value in config.init_params(L, D).items():  # M8 initialization
        np.testing.assert_array_equal(params[name], value)
    assert set(nnx.state(router, nnx.Param).keys()) == set(config.param_shapes(L, D))


@pytest.mark.parametrize("variant", ["block", "input_query", "gated"])
def test_router_loads_probe_params_and_matches_reference(rng, variant):
    config = ResidualConfig.variant(variant)
    params = {k: rng.standard_normal(s) for k, s in config.param_shapes(L, D).items()}
    emb, w = rng.standard_normal((3, D)), rng.standard_normal((L, D, D)) / np.sqrt(D)
    with precision("float64"):
        router = DepthRouter(config, L, D, dtype=jnp.float64)
        router.load_params(params)
        cot = rng.standard_normal(emb.shape)

        def loss(r):
            out = r(jnp.asarray(emb), probe_sublayers(jnp.asarray(w), config.eps))
            return jnp.sum(out * cot), out

        grads, out = nnx.jit(nnx.grad(loss, has_aux=True))(router)
    np.testing.assert_allclose(out, ref.probe_forward(config, params, emb, w), rtol=1e-12, atol=1e-12)
    want = ref.probe_vjp(config, params, emb, w, cot)
    for name in params:
        np.testing.assert_allclose(grads[name][...], want[name], rtol=1e-10, atol=1e-12)


def test_router_load_params_rejects_bad_shapes():
    router = DepthRouter(ResidualConfig.variant("full"), L, D)
    with pytest.raises(ValueError, match=r"params\['queries'\]"):
        router.load_params({"queries": np.zeros((L, D)), "norm_weights": np.ones((L + 1, D))})


def test_depth_attention_module(rng):
    layer = DepthAttention(D, num_heads=2, activation="sigmoid", scale=0.5)
    layer.query[...] = jnp.asarray(rng.standard_normal(D), jnp.float32)
    xs = [jnp.asarray(rng.standard_normal((3, D)), jnp.float32) for _ in range(3)]
    want = ref_ops.depth_attention([np.asarray(x, np.float64) for x in xs], np.asarray(layer.query[...], np.float64),
                                   np.ones(D), num_heads=2, activation="sigmoid", scale=0.5)
    np.testing.assert_allclose(layer(xs), want, rtol=1e-5, atol=1e-6)


def _model(config, eps=1e-12, **kw):
    return Transformer(config, vocab_size=32, dim=16, num_blocks=2, num_heads=2, rngs=nnx.Rngs(0), eps=eps, **kw)


def test_zero_init_equals_prenorm_after_final_norm():
    """Zero queries give uniform depth weights: h_l is the PreNorm sum divided by the source
    count, which every (scale-invariant) RMSNorm removes (eps = 1e-12).  Full and Block (S = 3
    over L = 4 sublayers: a short last block) share the baseline's sublayer weights."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 5)))
    forward = nnx.jit(lambda m, t: m(t))
    baseline = forward(_model(ResidualConfig.variant("standard")), tokens)
    for config in (ResidualConfig.variant("full"), ResidualConfig.variant("block", block_size=3)):
        logits = forward(_model(config), tokens)
        np.testing.assert_allclose(logits, baseline, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(baseline))))


def test_transformer_two_phase_equals_direct(rng):
    model = _model(ResidualConfig.variant("block", block_size=2), eps=1e-6)
    state = nnx.state(model.router, nnx.Param)
    for name in ("queries", "norm_weights"):
        state[name][...] = jnp.asarray(rng.standard_normal(state[name][...].shape), jnp.float32)
    nnx.update(model.router, state)
    tokens = jnp.asarray(rng.integers(0, 32, (2, 5)))
    direct = nnx.jit(lambda m, t: m(t))(model, tokens)
    two_phase = nnx.jit(lambda m, t: m(t, schedule="two_phase"))(model, tokens)
    np.testing.assert_allclose(two_phase, direct, rtol=1e-5, atol=1e-5)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(tokens, schedule="two_phase") ** 2)))(model)
    assert float(jnp.max(jnp.abs(grads["router"]["queries"][...]))) > 0


def test_fused_output_norm_model_equals_prenorm_model(rng):
    """M15: with fuse_out_norm the router's gains replace the sublayers' and the final norm's
    (the model creates none of its own); copying those gains in gives the PreNorm-gain model's
    logits."""
    plain = _model(ResidualConfig.variant("block", block_size=2), eps=1e-6, scan_layers=False)
    fused = _model(ResidualConfig.variant("block", block_size=2, fuse_out_norm=True), eps=1e-6,
                   scan_layers=False)
    assert all(s.norm is not None and not isinstance(s.norm, nnx.RMSNorm) for s in fused.sublayers)
    for name in ("queries", "norm_weights"):
        value = jnp.asarray(rng.standard_normal(getattr(plain.router, name)[...].shape), jnp.float32)
        getattr(plain.router, name)[...] = value
        getattr(fused.router, name)[...] = value
    gains = []
    for norm in [s.norm for s in plain.sublayers] + [plain.final_norm]:
        norm.scale[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(norm.scale[...].shape), jnp.float32)
        gains.append(norm.scale[...])
    fused.router.out_norm_weights[...] = jnp.stack(gains)
    for a, b in zip(plain.sublayers, fused.sublayers):
        for attr in ("qkv", "out", "up", "down"):
            if hasattr(a, attr):
                setattr(b, attr, getattr(a, attr))
    fused.embed, fused.head = plain.embed, plain.head
    tokens = jnp.asarray(rng.integers(0, 32, (2, 5)))
    want = nnx.jit(lambda m, t: m(t))(plain, tokens)
    got = nnx.jit(lambda m, t: m(t))(fused, tokens)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="eps: with fuse_out_norm"):
        _model(ResidualConfig.variant("fused_out_norm"), eps=1e-5)
