"""JAX transformations, determinism, untouched inputs and error messages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attnres_jax import depth_attention, depth_attention_multi, merge_partial
from attnres_numpy import ops as ref
from jax_helpers import assert_close


def _inputs(rng, n=4, tokens=(2, 3), dim=8):
    xs = [jnp.asarray(rng.standard_normal(tokens + (dim,)), jnp.float32) for _ in range(n)]
    q = jnp.asarray(rng.standard_normal((dim,)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((dim,)), jnp.float32)
    return xs, q, g


def _loss(xs, q, g, w):
    out, lse = depth_attention(xs, q, g, num_heads=2, return_lse=True)
    return jnp.sum(out * w) + jnp.sum(lse)


def test_grad_jit_checkpoint_agree_with_reference(rng):
    xs, q, g = _inputs(rng)
    w = jnp.asarray(rng.standard_normal(xs[0].shape), jnp.float32)
    want = ref.depth_attention_vjp([np.asarray(x, np.float64) for x in xs], np.asarray(q, np.float64),
                                   np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   np.ones((2, 3, 2)), num_heads=2)
    plain = jax.grad(_loss, argnums=(0, 1, 2))(xs, q, g, w)
    jitted = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(xs, q, g, w)
    remat = jax.jit(jax.grad(jax.checkpoint(_loss), argnums=(0, 1, 2)))(xs, q, g, w)
    for grads in (plain, jitted, remat):
        assert_close(np.stack(grads[0]), np.stack(want["sources"]), "float32", "d_sources", grad=True)
        assert_close(grads[1], want["query"], "float32", "d_query", grad=True)
        assert_close(grads[2], want["norm_weight"], "float32", "d_norm_weight", grad=True)


def test_vmap_matches_batched_call(rng):
    """vmap over a leading axis of sources and a per-example pseudo-query == per-example calls."""
    xs = jnp.asarray(rng.standard_normal((4, 5, 3, 8)), jnp.float32)  # [N, B, T, D]
    qs = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)  # one query per example
    f = jax.vmap(lambda x, q: depth_attention(x, q, return_lse=True), in_axes=(1, 0))
    out, lse = jax.jit(f)(xs, qs)
    for b in range(5):
        want_out, want_lse = ref.depth_attention(np.asarray(xs[:, b], np.float64), np.asarray(qs[b], np.float64),
                                                 return_lse=True)
        np.testing.assert_allclose(out[b], want_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[b], want_lse, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x, q: jnp.sum(f(x, q)[0] ** 2), argnums=1)(xs, qs)
    for b in range(2):
        want = ref.depth_attention_vjp(np.asarray(xs[:, b], np.float64), np.asarray(qs[b], np.float64), None,
                                       2 * np.asarray(out[b], np.float64))
        assert_close(grad[b], want["query"], "float32", "d_query", grad=True)


def test_forward_backward_bitwise_deterministic(rng):
    xs, q, g = _inputs(rng, n=9, tokens=(16,), dim=64)
    w = jnp.asarray(rng.standard_normal(xs[0].shape), jnp.float32)
    step = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2)))
    first, second = step(xs, q, g, w), step(xs, q, g, w)
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_inputs_unmodified(rng):
    xs, q, g = _inputs(rng)
    before = [np.array(a) for a in (*xs, q, g)]
    jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(xs, q, g, jnp.ones_like(xs[0]))
    depth_attention_multi(xs, jnp.stack([q, q]), jnp.stack([g, g]))
    merge_partial(xs[0], jnp.zeros(xs[0].shape[:-1]), xs[1], q, g)
    for a, b in zip(before, (*xs, q, g)):
        assert np.array_equal(a, np.asarray(b))


def test_weights_not_differentiable_and_sum_to_one(rng):
    xs, q, g = _inputs(rng)
    _, weights = depth_attention(xs, q, g, return_weights=True)
    np.testing.assert_allclose(jnp.sum(weights, axis=0), 1.0, rtol=1e-6)
    grad = jax.grad(lambda q: jnp.sum(depth_attention(xs, q, g, return_weights=True)[1] ** 2))(q)
    assert np.array_equal(np.asarray(grad), np.zeros(8))


x = [jnp.full((2, 4), 0.5 + i) for i in range(3)]
q4, g4 = jnp.linspace(-1, 1, 4), jnp.ones(4)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: depth_attention([], q4), ValueError, "sources: expected N >= 1"),
    (lambda: depth_attention(jnp.zeros(3), q4), ValueError, "sources: a stacked array"),
    (lambda: depth_attention({"a": x[0]}, q4), TypeError, "sources: expected a sequence"),
    (lambda: depth_attention(x[:2] + [jnp.ones((3, 4))], q4), ValueError, r"sources\[2\]"),
    (lambda: depth_attention([x[0].astype(jnp.int32)] + x[1:], q4), TypeError, r"sources\[0\]"),
    (lambda: depth_attention([x[0].astype(jnp.float16)] + x[1:], q4), TypeError, "sources: all sources"),
    (lambda: depth_attention(x, jnp.ones(5)), ValueError, "query: expected shape"),
    (lambda: depth_attention(x, q4.astype(jnp.int32)), TypeError, "query"),
    (lambda: depth_attention(x, q4, jnp.ones(3)), ValueError, "norm_weight"),
    (lambda: depth_attention(x, q4, eps=0.0), ValueError, "eps"),
    (lambda: depth_attention(x, q4, scale=float("inf")), ValueError, "scale"),
    (lambda: depth_attention(x, q4, num_heads=3), ValueError, "num_heads"),
    (lambda: depth_attention(x, q4, activation="relu"), ValueError, "activation"),
    (lambda: depth_attention(x, q4, activation="sigmoid", return_lse=True), ValueError, "return_lse"),
    (lambda: depth_attention_multi(x, jnp.ones(4)), ValueError, "queries"),
    (lambda: depth_attention_multi(x, jnp.ones((2, 4)), jnp.ones((2, 3))), ValueError, "norm_weights"),
    (lambda: merge_partial(jnp.ones((3, 4)), jnp.zeros(2), x[1], q4), ValueError, "out1"),
    (lambda: merge_partial(x[0], jnp.zeros(3), x[1], q4), ValueError, "lse1"),
    (lambda: merge_partial(x[0].astype(jnp.float16), jnp.zeros(2), x[1], q4), TypeError, "out1"),
])
def test_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_errors_raise_at_trace_time_under_jit():
    with pytest.raises(ValueError, match="num_heads"):
        jax.jit(lambda xs, q: depth_attention(xs, q, num_heads=3))(x, q4)
