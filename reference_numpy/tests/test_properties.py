"""Property tests over random geometries (hypothesis draws shapes and options, NumPy the values)."""

from __future__ import annotations

import numpy as np
from attnres_numpy import ResidualConfig, depth_attention, merge_partial, probe_forward, probe_vjp
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def geometry(draw):
    heads = draw(st.sampled_from((1, 2, 3)))
    tokens = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    return dict(n=draw(st.integers(1, 5)), tokens=tokens, dim=heads * draw(st.integers(1, 3)), heads=heads,
                key_norm=draw(st.booleans()), per_token=draw(st.booleans()) and len(tokens) > 0,
                seed=draw(st.integers(0, 2 ** 32 - 1)))


@SETTINGS
@given(geometry())
def test_softmax_geometry(g):
    """Weights sum to 1 per token and head; list and stacked sources agree bitwise; N = 1 is the
    identity; with one head and key norm, merging a partial equals attending over it (M9)."""
    rng = np.random.default_rng(g["seed"])
    x = rng.standard_normal((g["n"],) + g["tokens"] + (g["dim"],))
    q = rng.standard_normal(g["tokens"] + (g["dim"],) if g["per_token"] else (g["dim"],))
    gain = rng.standard_normal(g["dim"])
    opts = dict(num_heads=g["heads"], key_norm=g["key_norm"])
    out, lse, w = depth_attention(x, q, gain, return_lse=True, return_weights=True, **opts)
    out_l, lse_l, w_l = depth_attention(list(x), q, gain, return_lse=True, return_weights=True, **opts)
    heads = (g["heads"],) if g["heads"] > 1 else ()
    assert out.shape == x.shape[1:] and w.shape == (g["n"],) + g["tokens"] + heads
    assert lse.shape == g["tokens"] + heads
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=1e-13)
    for a, b in ((out, out_l), (lse, lse_l), (w, w_l)):
        np.testing.assert_array_equal(a, b)
    if g["n"] == 1:
        np.testing.assert_array_equal(out, x[0])
    if g["heads"] == 1 and g["key_norm"]:
        partial = rng.standard_normal(x.shape[1:]) * 2.0
        direct = depth_attention(list(x) + [partial], q, gain)
        np.testing.assert_allclose(merge_partial(out, lse, partial, q, gain), direct, rtol=1e-12, atol=1e-13)


@SETTINGS
@given(st.integers(1, 7), st.integers(1, 8), st.lists(st.integers(1, 3), max_size=2), st.integers(0, 2 ** 32 - 1))
def test_two_phase_model_equals_direct(num_layers, block_size, tokens, seed):
    rng = np.random.default_rng(seed)
    dim = 3
    config = ResidualConfig(kind="block", block_size=block_size)
    emb = rng.standard_normal(tuple(tokens) + (dim,))
    weights = rng.standard_normal((num_layers, dim, dim))
    params = {k: rng.standard_normal(s) for k, s in config.param_shapes(num_layers, dim).items()}
    cot = rng.standard_normal(emb.shape)
    np.testing.assert_allclose(probe_forward(config, params, emb, weights, schedule="two_phase"),
                               probe_forward(config, params, emb, weights), rtol=1e-12, atol=1e-13)
    direct = probe_vjp(config, params, emb, weights, cot)
    two_phase = probe_vjp(config, params, emb, weights, cot, schedule="two_phase")
    for name in direct:
        np.testing.assert_allclose(two_phase[name], direct[name], rtol=1e-11, atol=1e-12, err_msg=name)
