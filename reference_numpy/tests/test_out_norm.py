"""The fused output norm of `depth_attention` (spec section 2.6, C17): forward against a direct
formula, the VJP (d_out_norm_weight included) against central finite differences, the edges
(N = 1, no tokens, T = 0, overflow, NaN) and the result order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from attnres_numpy import ops

N, BATCH, D = 3, (2, 3), 4
EPS, SCALE = 1e-5, 1.3


def _rmsnorm(y, eps):
    """rmsnorm over the last axis, written out directly (the reference's formula, not its code)."""
    return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps)


CASES = [
    c for c in itertools.product(
        (False, True),  # stacked
        (False, True),  # per-token query
        (1, 2),  # heads
        ("softmax", "sigmoid"),
        (False, True),  # lse (softmax only)
        (None, 0.25),  # out_norm_eps: None (= eps) or its own
        (True, False),  # a d_out cotangent (False: None, only d_out_normed)
    )
    if not (c[4] and c[3] == "sigmoid")
]


@pytest.mark.parametrize("stacked,per_token,heads,activation,with_lse,out_eps,with_d_out", CASES)
def test_out_norm_vjp_matches_finite_differences(rng, check_gradients, stacked, per_token, heads,
                                                 activation, with_lse, out_eps, with_d_out):
    x = rng.standard_normal((N, *BATCH, D))
    query = rng.standard_normal(BATCH + (D,) if per_token else (D,))
    gain = rng.standard_normal(D)
    w = 1.0 + 0.5 * rng.standard_normal(D)
    opts = dict(eps=EPS, scale=SCALE, num_heads=heads, activation=activation, out_norm_eps=out_eps)
    lse_shape = BATCH + ((heads,) if heads > 1 else ())
    d_out = rng.standard_normal(BATCH + (D,)) if with_d_out else None
    d_normed = rng.standard_normal(BATCH + (D,))
    d_lse = rng.standard_normal(lse_shape) if with_lse else None

    def loss(query, norm_weight, out_norm_weight, **sources):
        src = sources["sources"] if stacked else [sources[f"s{i}"] for i in range(N)]
        res = ops.depth_attention(src, query, norm_weight, return_lse=with_lse,
                                  out_norm_weight=out_norm_weight, **opts)
        out, normed, *rest = res
        total = np.sum(normed * d_normed) + (np.sum(out * d_out) if with_d_out else 0.0)
        return total + (np.sum(rest[0] * d_lse) if with_lse else 0.0)

    src = x if stacked else [x[i] for i in range(N)]
    grad = ops.depth_attention_vjp(src, query, gain, d_out, d_lse, out_norm_weight=w,
                                   d_out_normed=d_normed, **opts)
    assert grad["out_norm_weight"].shape == (D,)
    inputs = {"query": query, "norm_weight": gain, "out_norm_weight": w}
    grads = {k: grad[k] for k in inputs}
    if stacked:
        inputs["sources"], grads["sources"] = x, grad["sources"]
    else:
        inputs.update({f"s{i}": x[i] for i in range(N)})
        grads.update({f"s{i}": grad["sources"][i] for i in range(N)})
    check_gradients(loss, inputs, grads)


@pytest.mark.parametrize("heads", (1, 2))
@pytest.mark.parametrize("activation", ("softmax", "sigmoid"))
def test_forward_is_rmsnorm_of_out_over_all_channels(rng, heads, activation):
    """out_normed = rmsnorm(out) * w over all D channels (not per head), eps_o = eps by default;
    out is unchanged by the option; the result order is (out, out_normed, lse, weights)."""
    x = rng.standard_normal((N, *BATCH, D))
    q, w = rng.standard_normal(D), rng.standard_normal(D)
    kw = dict(num_heads=heads, activation=activation, eps=EPS, return_weights=True)
    out, weights = ops.depth_attention(x, q, **kw)
    res = ops.depth_attention(x, q, out_norm_weight=w, **kw)
    assert len(res) == 3
    np.testing.assert_array_equal(res[0], out)
    np.testing.assert_array_equal(res[2], weights)
    np.testing.assert_allclose(res[1], _rmsnorm(out, EPS) * w, rtol=1e-14, atol=1e-15)
    # eps_o given: its own eps, not the key norm's
    other = ops.depth_attention(x, q, out_norm_weight=w, out_norm_eps=0.5, **kw)[1]
    np.testing.assert_allclose(other, _rmsnorm(out, 0.5) * w, rtol=1e-14, atol=1e-15)
    if heads > 1:  # a per-head norm would differ
        per_head = _rmsnorm(out.reshape(BATCH + (heads, D // heads)), EPS).reshape(out.shape) * w
        assert np.max(np.abs(per_head - res[1])) > 1e-3
    if activation == "softmax":
        full = ops.depth_attention(x, q, out_norm_weight=w, return_lse=True, **kw)
        assert len(full) == 4
        np.testing.assert_array_equal(full[1], res[1])
        np.testing.assert_array_equal(full[2], ops.depth_attention(x, q, return_lse=True, **kw)[1])


def test_single_source_is_rmsnorm_of_the_source(rng):
    """N = 1 softmax: out is the source (C6), so out_normed is rmsnorm(source) * w."""
    x = rng.standard_normal((1, 5, 8))
    w = rng.standard_normal(8)
    out, normed = ops.depth_attention(x, rng.standard_normal(8), out_norm_weight=w)
    np.testing.assert_array_equal(out, x[0])
    np.testing.assert_allclose(normed, _rmsnorm(x[0], 1e-6) * w, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("tokens", ((), (0,), (2, 0)))
def test_no_and_empty_token_axes(rng, tokens):
    """No token axes: one row; T = 0: empty results and a zero d_out_norm_weight of shape [D]."""
    x = rng.standard_normal((N,) + tokens + (D,))
    q, w = rng.standard_normal(D), rng.standard_normal(D)
    out, normed = ops.depth_attention(list(x), q, out_norm_weight=w)
    assert normed.shape == tokens + (D,)
    np.testing.assert_allclose(normed, _rmsnorm(out, 1e-6) * w, rtol=1e-14, atol=1e-15)
    d = rng.standard_normal(tokens + (D,))
    grad = ops.depth_attention_vjp(list(x), q, None, d, out_norm_weight=w, d_out_normed=d)
    assert grad["out_norm_weight"].shape == (D,)
    if 0 in tokens:
        np.testing.assert_array_equal(grad["out_norm_weight"], np.zeros(D))
    else:
        np.testing.assert_allclose(grad["out_norm_weight"], d * _rmsnorm(out, 1e-6), rtol=1e-14)


def test_without_the_option_nothing_changes(rng):
    """out_norm_weight=None: the old results and no "out_norm_weight" key (callers mapping every
    key onto an argument keep working); a zero d_out_normed adds nothing to the gradients."""
    x = rng.standard_normal((N, *BATCH, D))
    q, g, w = rng.standard_normal(D), rng.standard_normal(D), rng.standard_normal(D)
    d = rng.standard_normal(BATCH + (D,))
    plain = ops.depth_attention_vjp(x, q, g, d)
    assert set(plain) == {"sources", "query", "norm_weight"}
    fused = ops.depth_attention_vjp(x, q, g, d, out_norm_weight=w)
    for key in ("sources", "query", "norm_weight"):
        np.testing.assert_array_equal(fused[key], plain[key])
    np.testing.assert_array_equal(fused["out_norm_weight"], np.zeros(D))


@pytest.mark.parametrize("power", (600, 1000))
def test_overflow_safe_for_finite_inputs(rng, power):
    """C10.6: float64 sources past 1e154 (sum of squares overflows) give the out_normed, depth
    weights and d_out_norm_weight of the same sources scaled down by 2^power (exactly)."""
    x = rng.standard_normal((N, *BATCH, D))
    q, w = rng.standard_normal(D), rng.standard_normal(D)
    big = np.ldexp(x, power)
    small_res = ops.depth_attention(x, q, out_norm_weight=w, return_weights=True, eps=1e-300)
    big_res = ops.depth_attention(big, q, out_norm_weight=w, return_weights=True, eps=1e-300)
    np.testing.assert_allclose(big_res[1], small_res[1], rtol=1e-13)
    np.testing.assert_allclose(big_res[2], small_res[2], rtol=1e-13)
    d = rng.standard_normal(BATCH + (D,))
    g_small = ops.depth_attention_vjp(x, q, None, None, out_norm_weight=w, d_out_normed=d, eps=1e-300)
    g_big = ops.depth_attention_vjp(big, q, None, None, out_norm_weight=w, d_out_normed=d, eps=1e-300)
    np.testing.assert_allclose(g_big["out_norm_weight"], g_small["out_norm_weight"], rtol=1e-13)


def test_nonfinite_propagates_per_token(rng):
    """C12: a NaN in token 1 makes that token's out_normed NaN, the others finite; the gradient
    summed over tokens (d_out_norm_weight) is then NaN."""
    x = rng.standard_normal((N, 3, D))
    x[2, 1, 0] = np.nan
    w = rng.standard_normal(D)
    _, normed = ops.depth_attention(x, rng.standard_normal(D), out_norm_weight=w)
    assert np.all(np.isnan(normed[1]))
    assert np.all(np.isfinite(normed[[0, 2]]))
    grad = ops.depth_attention_vjp(x, np.ones(D), None, None, out_norm_weight=w,
                                   d_out_normed=np.ones((3, D)))
    assert np.all(np.isnan(grad["out_norm_weight"]))
    assert np.all(np.isfinite(grad["sources"][:, [0, 2]]))


def test_spec_worked_example():
    """The fused-output-norm line of spec section 2.5 (6 decimals)."""
    x = [np.array(r, float) for r in ([1, 2, 3, 4], [-2, 0, 2, 1], [0.5, -1, 0, 3])]
    q, g, w = np.array([0.5, -0.25, 1, 0]), np.array([1, 2, 1, 0.5]), np.array([1, 0.5, 2, -1.0])
    _, normed = ops.depth_attention(x, q, g, out_norm_weight=w)
    np.testing.assert_allclose(normed, [-0.059046, 0.165145, 2.218623, -1.629984], atol=5e-7)
    grad = ops.depth_attention_vjp(x, q, g, np.array([1, 0, -1, 0.5]), 0.25, out_norm_weight=w,
                                   d_out_normed=np.array([0.5, 1, 0, -1.0]))
    np.testing.assert_allclose(grad["out_norm_weight"], [-0.029523, 0.330290, 0, -1.629984], atol=5e-7)
