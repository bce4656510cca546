"""M15: the fused output norm in the residual stream (spec 4.17).

The forward is checked against the spec's equations in test_model (naive_stack restates M15) and
the VJPs by finite differences in test_model_gradients; here: that the stream really takes the
normed input from the depth-attention pass where one read forms h_l, composes it elsewhere, equals
a PreNorm model with the same gains, and refuses what M15 refuses.
"""

from __future__ import annotations

import numpy as np
import pytest
from attnres_core.schedule import run_schedule
from attnres_numpy import ResidualConfig, probe_forward, probe_sublayers, rmsnorm, stack_forward
from attnres_numpy.tape import Tape

L, D = 4, 6


class SpyTape(Tape):
    """A forward tape that counts fused reads and composed norms."""

    def __init__(self, params):
        super().__init__(params, record=False)
        self.fused, self.composed = 0, 0

    def depth_attention(self, *args, out_norm_weight=None, **kw):
        self.fused += out_norm_weight is not None
        return super().depth_attention(*args, out_norm_weight=out_norm_weight, **kw)

    def rmsnorm_gain(self, x, weight, eps):
        self.composed += 1
        return super().rmsnorm_gain(x, weight, eps)


def _problem(rng, config):
    params = {name: rng.standard_normal(shape) for name, shape in config.param_shapes(L, D).items()}
    emb = rng.standard_normal((3, D))
    weights = rng.standard_normal((L, D, D)) / np.sqrt(D)
    return params, emb, weights


@pytest.mark.parametrize("config,schedule,mix,fused,composed", [
    (ResidualConfig.variant("fused_out_norm"), "direct", None, L + 1, 0),
    (ResidualConfig.variant("block", fuse_out_norm=True), "direct", None, L + 1, 0),
    # Two-phase: the block's first sublayer takes phase 1's row, the rest merges: all composed;
    # the output aggregation is one direct read.
    (ResidualConfig.variant("block", fuse_out_norm=True), "two_phase", None, 1, L),
    (ResidualConfig.variant("fused_out_norm"), "direct", 0.5, 0, L + 1),  # the blend, then the norm
    (ResidualConfig.variant("fused_out_norm"), "direct", 0.0, 0, L + 1),  # standard: no read at all
])
def test_fused_where_one_read_forms_the_input(rng, config, schedule, mix, fused, composed):
    params, emb, weights = _problem(rng, config)
    tape = SpyTape(params)
    sublayers = [lambda n, w=w: tape.var(np.tanh(n.value @ w)) for w in weights]
    out = run_schedule(config, tape, tape.var(emb), sublayers, schedule=schedule, mix=mix)
    assert (tape.fused, tape.composed) == (fused, composed)
    np.testing.assert_allclose(out.value, probe_forward(config, params, emb, weights, schedule=schedule, mix=mix),
                               rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", ("full", "block", "window", "hybrid"))
def test_equals_prenorm_model_with_the_same_gains(rng, kind):
    """M15: a PreNorm model whose sublayers and final norm carry the gains computes the same."""
    config = ResidualConfig.variant(kind, fuse_out_norm=True)
    params, emb, weights = _problem(rng, config)
    gains = params["out_norm_weights"]
    plain_config = ResidualConfig.variant(kind)
    plain = {k: v for k, v in params.items() if k != "out_norm_weights"}
    prenorm = [lambda h, l=l: np.tanh((rmsnorm(h, config.eps) * gains[l]) @ weights[l]) for l in range(L)]
    expected = rmsnorm(stack_forward(plain_config, plain, emb, prenorm), config.eps) * gains[L]
    np.testing.assert_allclose(probe_forward(config, params, emb, weights), expected, rtol=1e-13, atol=1e-13)
    assert np.abs(probe_forward(plain_config, plain, emb, weights) - expected).max() > 1e-2  # can fail


def test_init_is_ones_and_probe_drops_its_prenorm(rng):
    config = ResidualConfig.variant("fused_out_norm")
    assert config.param_shapes(L, D)["out_norm_weights"] == (L + 1, D)
    np.testing.assert_array_equal(config.init_params(L, D)["out_norm_weights"], np.ones((L + 1, D)))
    shared = ResidualConfig.variant("shared_queries", fuse_out_norm=True)  # never shared (M15)
    assert shared.param_shapes(5, D)["out_norm_weights"] == (6, D)
    w = rng.standard_normal((1, D, D))
    n = rng.standard_normal((2, D))
    np.testing.assert_array_equal(probe_sublayers(w, 1e-6, prenorm=False)[0](n), np.tanh(n @ w[0]))
    assert ResidualConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("fields,error,message", [
    (dict(kind="standard", fuse_out_norm=True), ValueError, r"fuse_out_norm: .* needs an attention kind"),
    (dict(kind="static", fuse_out_norm=True), ValueError, r"fuse_out_norm: .* got kind='static'"),
    (dict(kind="full", fuse_out_norm=1), TypeError, r"fuse_out_norm: expected a bool, got 1"),
])
def test_config_errors(fields, error, message):
    with pytest.raises(error, match=message):
        ResidualConfig(**fields)
