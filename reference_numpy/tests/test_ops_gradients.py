"""Central finite differences (float64) on every input of every op's hand-written VJP."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from attnres_numpy import ops

N, BATCH, D = 3, (2, 3), 4
EPS, SCALE = 1e-5, 1.3


def _split_sources(inputs, stacked):
    """Rebuild the sources argument from the per-input dict used by the gradient check."""
    if stacked:
        return inputs["sources"]
    return [inputs[f"sources[{i}]"] for i in range(N)]


def _source_inputs(x, stacked):
    return {"sources": x} if stacked else {f"sources[{i}]": x[i] for i in range(N)}


def _source_grads(g, stacked):
    return {"sources": g} if stacked else {f"sources[{i}]": g[i] for i in range(N)}


DA_CASES = [
    (stacked, per_token, with_gain, heads, activation, key_norm, with_lse)
    for stacked, per_token, with_gain, heads, activation, key_norm, with_lse in itertools.product(
        (False, True), (False, True), (False, True), (1, 2), ("softmax", "sigmoid"), (True, False),
        (False, True))
    if not (with_lse and activation == "sigmoid")
]


@pytest.mark.parametrize("stacked,per_token,with_gain,heads,activation,key_norm,with_lse", DA_CASES)
def test_depth_attention_vjp(rng, check_gradients, stacked, per_token, with_gain, heads, activation,
                             key_norm, with_lse):
    x = rng.standard_normal((N, *BATCH, D))
    query = rng.standard_normal(BATCH + (D,) if per_token else (D,))
    gain = rng.standard_normal(D) if with_gain else None
    opts = dict(eps=EPS, scale=SCALE, num_heads=heads, activation=activation, key_norm=key_norm)
    lse_shape = BATCH + ((heads,) if heads > 1 else ())
    d_out = rng.standard_normal(BATCH + (D,))
    d_lse = rng.standard_normal(lse_shape) if with_lse else None

    def loss(query, norm_weight=None, **sources):
        res = ops.depth_attention(_split_sources(sources, stacked), query, norm_weight,
                                  return_lse=with_lse, **opts)
        if with_lse:
            out, lse = res
            assert lse.shape == lse_shape
            return np.sum(out * d_out) + np.sum(lse * d_lse)
        return np.sum(res * d_out)

    src = x if stacked else [x[i] for i in range(N)]
    grad = ops.depth_attention_vjp(src, query, gain, d_out, d_lse, **opts)
    assert isinstance(grad["sources"], np.ndarray) == stacked
    if gain is None:
        assert grad["norm_weight"] is None
    inputs = {**_source_inputs(x, stacked), "query": query}
    grads = {**_source_grads(grad["sources"], stacked), "query": grad["query"]}
    if with_gain:
        inputs["norm_weight"], grads["norm_weight"] = gain, grad["norm_weight"]
    check_gradients(loss, inputs, grads)


@pytest.mark.parametrize("stacked", (False, True))
@pytest.mark.parametrize("with_gain", (False, True))
@pytest.mark.parametrize("with_lse", (False, True))
def test_depth_attention_multi_vjp(rng, check_gradients, stacked, with_gain, with_lse):
    S = 3
    x = rng.standard_normal((N, *BATCH, D))
    queries = rng.standard_normal((S, D))
    gains = rng.standard_normal((S, D)) if with_gain else None
    d_out = rng.standard_normal((S, *BATCH, D))
    d_lse = rng.standard_normal((S, *BATCH)) if with_lse else None

    def loss(queries, norm_weights=None, **sources):
        out, lse = ops.depth_attention_multi(_split_sources(sources, stacked), queries, norm_weights,
                                             eps=EPS, scale=SCALE)
        return np.sum(out * d_out) + (np.sum(lse * d_lse) if with_lse else 0.0)

    src = x if stacked else [x[i] for i in range(N)]
    grad = ops.depth_attention_multi_vjp(src, queries, gains, d_out, d_lse, eps=EPS, scale=SCALE)
    inputs = {**_source_inputs(x, stacked), "queries": queries}
    grads = {**_source_grads(grad["sources"], stacked), "queries": grad["queries"]}
    if with_gain:
        inputs["norm_weights"], grads["norm_weights"] = gains, grad["norm_weights"]
    else:
        assert grad["norm_weights"] is None
    check_gradients(loss, inputs, grads)


@pytest.mark.parametrize("per_token", (False, True))
@pytest.mark.parametrize("with_gain", (False, True))
@pytest.mark.parametrize("with_lse", (False, True))
def test_merge_partial_vjp(rng, check_gradients, per_token, with_gain, with_lse):
    out1 = rng.standard_normal(BATCH + (D,))
    lse1 = rng.standard_normal(BATCH)
    partial = rng.standard_normal(BATCH + (D,))
    query = rng.standard_normal(BATCH + (D,) if per_token else (D,))
    gain = rng.standard_normal(D) if with_gain else None
    d_out = rng.standard_normal(BATCH + (D,))
    d_lse = rng.standard_normal(BATCH) if with_lse else None

    def loss(out1, lse1, partial, query, norm_weight=None):
        res = ops.merge_partial(out1, lse1, partial, query, norm_weight, eps=EPS, scale=SCALE,
                                return_lse=with_lse)
        if with_lse:
            return np.sum(res[0] * d_out) + np.sum(res[1] * d_lse)
        return np.sum(res * d_out)

    grad = ops.merge_partial_vjp(out1, lse1, partial, query, gain, d_out, d_lse, eps=EPS, scale=SCALE)
    inputs = {"out1": out1, "lse1": lse1, "partial": partial, "query": query}
    if with_gain:
        inputs["norm_weight"] = gain
    else:
        assert grad["norm_weight"] is None
    check_gradients(loss, inputs, grad)


@pytest.mark.parametrize("error", (1e-4, -1e-4))
def test_gradient_check_rejects_a_slightly_wrong_vjp(rng, check_gradients, error):
    """The checker itself must fail on a gradient that is off by a relative 1e-4."""
    x = rng.standard_normal((N, *BATCH, D))
    query = rng.standard_normal(D)
    d_out = rng.standard_normal(BATCH + (D,))
    grad = ops.depth_attention_vjp(x, query, None, d_out)

    def loss(sources, query):
        return np.sum(ops.depth_attention(sources, query) * d_out)

    with pytest.raises(AssertionError, match="query"):
        check_gradients(loss, {"sources": x, "query": query},
                        {"sources": grad["sources"], "query": grad["query"] * (1 + error)})
