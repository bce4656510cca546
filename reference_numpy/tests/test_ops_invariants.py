"""Properties of the depth-attention ops that hold exactly or to rounding (spec sections 2-3)."""

from __future__ import annotations

import numpy as np
import pytest
from attnres_numpy import depth_attention, depth_attention_multi, merge_partial, ops

BATCH, D = (2, 3), 4


@pytest.mark.parametrize("heads", (1, 2))
@pytest.mark.parametrize("key_norm", (True, False))
@pytest.mark.parametrize("stacked", (True, False))
def test_single_source_is_identity_exactly(rng, heads, key_norm, stacked):
    x = rng.standard_normal(BATCH + (D,)) * 7.0
    src = x[None] if stacked else [x]
    out, lse, w = depth_attention(src, rng.standard_normal(D), rng.standard_normal(D), num_heads=heads,
                                  key_norm=key_norm, return_lse=True, return_weights=True)
    np.testing.assert_array_equal(out, x)
    assert np.all(w == 1.0)


@pytest.mark.parametrize("heads", (1, 2))
def test_zero_query_is_uniform_average(rng, heads):
    x = rng.standard_normal((5,) + BATCH + (D,))
    out, w = depth_attention(x, np.zeros(D), rng.standard_normal(D), num_heads=heads, return_weights=True)
    np.testing.assert_allclose(out, x.mean(axis=0), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(w, 0.2, rtol=1e-15)
    out_sig = depth_attention(x, np.zeros(D), num_heads=heads, activation="sigmoid")
    np.testing.assert_allclose(out_sig, 0.5 * x.sum(axis=0), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("heads", (1, 2))
@pytest.mark.parametrize("per_token", (False, True))
def test_weights_sum_to_one_and_match_definition(rng, heads, per_token):
    x = rng.standard_normal((4,) + BATCH + (D,))
    q = rng.standard_normal(BATCH + (D,) if per_token else (D,))
    g = rng.standard_normal(D)
    out, lse, w = depth_attention(x, q, g, num_heads=heads, scale=0.8, eps=1e-4, return_lse=True,
                                  return_weights=True)
    assert w.shape == (4,) + BATCH + ((heads,) if heads > 1 else ())
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=1e-14)
    # Spec 2.1 written out per head: z = scale * <q g, x> / rms(x), p = softmax(z).
    dh = D // heads
    xh = x.reshape(x.shape[:-1] + (heads, dh))
    qg = np.broadcast_to(q * g, BATCH + (D,)).reshape(BATCH + (heads, dh))
    z = 0.8 * np.sum(qg * xh, -1) / np.sqrt(np.mean(xh ** 2, -1) + 1e-4)
    p = np.exp(z) / np.exp(z).sum(0)
    expected_lse = np.log(np.exp(z).sum(0))
    expected_out = np.sum(p[..., None] * xh, 0).reshape(BATCH + (D,))
    squeeze = (lambda a: a) if heads > 1 else (lambda a: a[..., 0])
    np.testing.assert_allclose(w, squeeze(p), rtol=1e-13)
    np.testing.assert_allclose(lse, squeeze(expected_lse), rtol=1e-13)
    np.testing.assert_allclose(out, expected_out, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("activation", ("softmax", "sigmoid"))
def test_tokens_are_independent(rng, activation):
    """Permuting tokens of the sources and of a per-token query permutes the output (bitwise)."""
    x = rng.standard_normal((3, 7, D))
    q = rng.standard_normal((7, D))
    perm = rng.permutation(7)
    out = depth_attention(x, q, activation=activation)
    out_perm = depth_attention(x[:, perm], q[perm], activation=activation)
    np.testing.assert_array_equal(out_perm, out[perm])


@pytest.mark.parametrize("activation", ("softmax", "sigmoid"))
def test_permuting_sources_permutes_weights(rng, activation):
    x = rng.standard_normal((5,) + BATCH + (D,))
    q, g = rng.standard_normal(D), rng.standard_normal(D)
    perm = rng.permutation(5)
    out, w = depth_attention(x, q, g, activation=activation, return_weights=True)
    out_p, w_p = depth_attention([x[i] for i in perm], q, g, activation=activation, return_weights=True)
    np.testing.assert_allclose(w_p, w[perm], rtol=1e-14)
    np.testing.assert_allclose(out_p, out, rtol=1e-13, atol=1e-15)


def test_list_and_stacked_sources_agree_bitwise(rng):
    x = rng.standard_normal((4,) + BATCH + (D,))
    q, g = rng.standard_normal(D), rng.standard_normal(D)
    for heads in (1, 2):
        a = depth_attention(x, q, g, num_heads=heads, return_lse=True, return_weights=True)
        b = depth_attention(list(x), q, g, num_heads=heads, return_lse=True, return_weights=True)
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)


def test_multi_rows_equal_single_calls_bitwise(rng):
    x = rng.standard_normal((4,) + BATCH + (D,))
    queries, gains = rng.standard_normal((3, D)), rng.standard_normal((3, D))
    out, lse = depth_attention_multi(list(x), queries, gains, eps=1e-5, scale=1.7)
    for s in range(3):
        o, l = depth_attention(x, queries[s], gains[s], eps=1e-5, scale=1.7, return_lse=True)
        np.testing.assert_array_equal(out[s], o)
        np.testing.assert_array_equal(lse[s], l)


@pytest.mark.parametrize("per_token", (False, True))
@pytest.mark.parametrize("with_gain", (False, True))
def test_two_phase_equals_direct(rng, per_token, with_gain):
    """Phase 1 over N sources + merge of a partial == depth attention over N + 1 sources."""
    x = rng.standard_normal((3,) + BATCH + (D,))
    partial = rng.standard_normal(BATCH + (D,)) * 3.0
    q = rng.standard_normal(BATCH + (D,) if per_token else (D,))
    g = rng.standard_normal(D) if with_gain else None
    opts = dict(eps=1e-5, scale=1.4)
    out1, lse1 = depth_attention(x, q, g, return_lse=True, **opts)
    merged, lse = merge_partial(out1, lse1, partial, q, g, return_lse=True, **opts)
    direct, lse_direct = depth_attention(list(x) + [partial], q, g, return_lse=True, **opts)
    np.testing.assert_allclose(merged, direct, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, lse_direct, rtol=1e-13, atol=1e-14)
    if not per_token:
        o_m, l_m = depth_attention_multi(x, q[None], None if g is None else g[None], **opts)
        np.testing.assert_allclose(merge_partial(o_m[0], l_m[0], partial, q, g, **opts), direct,
                                   rtol=1e-13, atol=1e-14)


def test_float32_inputs_compute_in_float64(rng):
    """The reference upcasts: float32 inputs give the float64 result on the upcast values."""
    x = rng.standard_normal((3,) + BATCH + (D,)).astype(np.float32)
    q = rng.standard_normal(D).astype(np.float32)
    out = depth_attention(x, q)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, depth_attention(x.astype(np.float64), q.astype(np.float64)))


@pytest.mark.parametrize("magnitude", [1e110, 1e160, 1e250])
def test_gradients_are_scale_invariant_where_r_cubed_underflows(rng, magnitude):
    """C10.6: with the key norm, d_sources of c * x equal those of x (the logits are scale-free,
    out and dz scale with c, the key term with 1/c).  Past |x| ~ 1e102, r^3 underflows float64,
    so `s * r ** 3` dropped the term (seen failing); ((s r) r / Dh)(r x) keeps it.  Also the merge.
    eps = 1e-30: negligible at both scales (at 1e-6 the unscaled call differs by ~1e-6)."""
    xs = rng.standard_normal((3, 4, 8))
    q, g, d_out = rng.standard_normal(8), 1 + 0.1 * rng.standard_normal(8), rng.standard_normal((4, 8))
    want = ops.depth_attention_vjp(list(xs), q, g, d_out, num_heads=2, eps=1e-30)
    got = ops.depth_attention_vjp(list(xs * magnitude), q, g, d_out, num_heads=2, eps=1e-30)
    np.testing.assert_allclose(np.stack(got["sources"]), np.stack(want["sources"]), rtol=1e-10, atol=0)
    out1, lse1 = ops.depth_attention(list(xs[:2]), q, g, return_lse=True, eps=1e-30)
    want = ops.merge_partial_vjp(out1, lse1, xs[2], q, g, d_out, eps=1e-30)
    got = ops.merge_partial_vjp(out1 * magnitude, lse1, xs[2] * magnitude, q, g, d_out, eps=1e-30)
    np.testing.assert_allclose(got["partial"], want["partial"], rtol=1e-10, atol=0)
