"""The probe network written once (`attnres_core.probe`): it runs on any `ResidualOps` object.

A plain-NumPy ops object with no tape (as a third-party port would write one, on the reference's
own depth-attention ops) runs the same probe as `probe_forward` for every variant and schedule;
the primitive the probe added (`tanh`) has its VJP checked by finite differences; the shared
sublayer-weight checks raise what the spec says."""

from __future__ import annotations

import numpy as np
import pytest
from attnres_core import probe
from attnres_core.schedule import ResidualOps, split_result
from attnres_numpy import VARIANT_KINDS, ResidualConfig, probe_forward, probe_sublayers, rmsnorm
from attnres_numpy import ops as ref
from attnres_numpy.tape import Tape

L, D = 4, 4


class PlainOps(ResidualOps):
    """float64 NumPy arrays, no tape: the primitives a port supplies, nothing else."""

    def rmsnorm(self, x, eps):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def matmul(self, x, w):
        return x @ w

    def sigmoid(self, x):
        return 1.0 / (1.0 + np.exp(-x))

    def tanh(self, x):
        return np.tanh(x)

    def depth_attention(self, sources, stats, query, norm_weight, config, *, return_weights,
                        out_norm_weight=None):
        kw = dict(eps=config.eps, scale=config.scale, num_heads=config.num_heads,
                  activation=config.activation, key_norm=config.key_norm)
        if out_norm_weight is not None:
            kw["out_norm_weight"] = out_norm_weight
        result = ref.depth_attention(list(sources), query, norm_weight,
                                     return_weights=return_weights, **kw)
        return split_result(result, out_norm_weight, return_weights)

    def depth_attention_multi(self, sources, stats, queries, norm_weights, config):
        return ref.depth_attention_multi(list(sources), queries, norm_weights, eps=config.eps,
                                         scale=config.scale)

    def merge_partial(self, out1, lse1, partial, query, norm_weight, config):
        return ref.merge_partial(out1, lse1, partial, query, norm_weight, eps=config.eps,
                                 scale=config.scale)


def _problem(rng, config):
    params = {name: 0.5 * rng.standard_normal(shape)
              for name, shape in config.param_shapes(L, D).items()}
    return params, rng.standard_normal((2, 3, D)), rng.standard_normal((L, D, D)) / np.sqrt(D)


CALLS = [(name, "direct", None) for name in VARIANT_KINDS]
CALLS += [("block", "two_phase", None), ("full", "direct", 0.4), ("fused_out_norm", "direct", 0.4)]


@pytest.mark.parametrize("name,schedule,mix", CALLS)
def test_run_probe_on_a_plain_ops_object_is_probe_forward(rng, name, schedule, mix):
    config = ResidualConfig.variant(name)
    params, emb, weights = _problem(rng, config)
    out = probe.run_probe(config, PlainOps(params), emb, weights, schedule=schedule,
                          mix=None if not config.is_attention else mix)
    expected = probe_forward(config, params, emb, weights, schedule=schedule,
                             mix=None if not config.is_attention else mix)
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-14)
    assert np.abs(expected - emb).max() > 1e-3  # the sublayers did something


@pytest.mark.parametrize("fuse", [False, True])
def test_probe_sublayers_are_the_spec_formula(rng, fuse):
    """f_l(h) = tanh(rmsnorm(h) @ W[l-1]); with fuse_out_norm (M15) tanh(h @ W[l-1])."""
    config = ResidualConfig(kind="full", eps=1e-3, fuse_out_norm=fuse)
    _, h, weights = _problem(rng, config)
    fs = probe.probe_sublayers(config, PlainOps(), weights)
    assert len(fs) == L
    for l, f in enumerate(fs):
        x = h if fuse else rmsnorm(h, 1e-3)
        np.testing.assert_array_equal(f(h), np.tanh(x @ weights[l]))
    # the NumPy callables of attnres_numpy.model are the same formula
    np.testing.assert_array_equal(probe_sublayers(weights, 1e-3, prenorm=not fuse)[2](h), fs[2](h))


def test_tape_tanh_vjp_by_finite_differences(rng, check_gradients):
    x, cot = rng.standard_normal((3, D)), rng.standard_normal((3, D))

    def loss(x):
        return float(np.sum(np.tanh(x) * cot))

    tape = Tape(record=True)
    xv = tape.var(x)
    y = tape.tanh(xv)
    np.testing.assert_array_equal(y.value, np.tanh(x))
    (grad,) = tape.gradients(y, cot, [xv])
    check_gradients(loss, {"x": x}, {"x": grad})


def test_the_base_ops_object_lacks_tanh():
    """tanh has no framework-neutral spelling: a port's ops object must supply it."""
    with pytest.raises(NotImplementedError):
        ResidualOps().tanh(np.zeros(2))


@pytest.mark.parametrize("weights,err,message", [
    (np.zeros((2, D, D), np.int32), TypeError, "sublayer_weights"),
    (np.zeros((D, D)), ValueError, r"sublayer_weights: expected shape \[L, D, D\] with L >= 1 "
                                   r"and D = 4, got shape \(4, 4\)"),
    (np.zeros((0, D, D)), ValueError, r"got shape \(0, 4, 4\)"),
    (np.zeros((2, D, D + 1)), ValueError, r"got shape \(2, 4, 5\)"),
])
def test_check_sublayer_weights(weights, err, message):
    with pytest.raises(err, match=message):
        probe.check_sublayer_weights(weights, D, lambda a: a.dtype.name)
    ok = np.zeros((3, D, D))
    assert probe.check_sublayer_weights(ok, D, lambda a: a.dtype.name) == 3


@pytest.mark.parametrize("schedule", ["direct", "two_phase"])
def test_sublayer_dtype_rounds_each_v_and_its_cotangent(rng, schedule):
    """M1a's probe rows (`sublayer_dtype`): each v_l rounded to that dtype, as the plain-ops probe
    with rounded sublayers; float64 sublayers change nothing; the VJP rounds each v_l's cotangent."""
    from attnres_core.numerics import round_to_dtype
    from attnres_core.schedule import run_schedule
    from attnres_numpy import model

    config = ResidualConfig.variant("block", block_size=2)
    params, emb, weights = _problem(rng, config)
    plain = probe.probe_sublayers(config, PlainOps(params), weights)
    rounded = [lambda h, f=f: round_to_dtype(f(h), "bfloat16") for f in plain]
    expect = run_schedule(config, PlainOps(params), emb, rounded, schedule=schedule)
    got = probe_forward(config, params, emb, weights, schedule=schedule, sublayer_dtype="bfloat16")
    np.testing.assert_allclose(got, expect, rtol=1e-12, atol=1e-12)
    same = probe_forward(config, params, emb, weights, schedule=schedule, sublayer_dtype="float64")
    np.testing.assert_array_equal(same, probe_forward(config, params, emb, weights, schedule=schedule))
    assert np.max(np.abs(got - same)) > 1e-4  # bf16-sized: the rounding happened
    if schedule == "direct":
        cot = rng.standard_normal(emb.shape)
        g = model.probe_vjp(config, params, emb, weights, cot, sublayer_dtype="bfloat16")
        g64 = model.probe_vjp(config, params, emb, weights, cot)
        rel = np.max(np.abs(g["embedding"] - g64["embedding"])) / np.max(np.abs(g64["embedding"]))
        assert 1e-5 < rel < 5e-2
    with pytest.raises(TypeError, match="sublayer_dtype"):
        probe_forward(config, params, emb, weights, sublayer_dtype="int32")
