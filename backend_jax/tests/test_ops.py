"""The ops and their custom VJPs vs the float64 NumPy reference on upcast inputs (spec 2-3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attnres_conformance.tolerances import TOLERANCES
from attnres_jax import depth_attention, depth_attention_multi, merge_partial
from attnres_numpy import ops as ref
from jax_helpers import DTYPES, assert_close, precision, rounded

# The op's rounding, as users compile it (noxfile.py's tests-jax: not under its fast-compile XLA_FLAGS).
pytestmark = pytest.mark.xla_default_compile

# (num_heads, activation, key_norm, per-token query, stacked, gain, lse, weights): every option
# appears on and off at least once.
DA_OPTIONS = [
    (1, "softmax", True, False, False, True, True, True),
    (2, "softmax", True, True, True, True, True, False),
    (2, "sigmoid", True, False, False, True, False, True),
    (1, "sigmoid", False, True, True, False, False, False),
    (1, "softmax", False, False, True, False, True, True),
    (4, "softmax", True, True, False, False, False, True),
]


def _da_case(rng, dtype, n, tokens, dim, heads, act, key_norm, per_token, stacked, gain, lse, weights):
    """Run forward + VJP (random cotangents) of depth_attention; compare with the reference."""
    xs = [rounded(rng, tokens + (dim,), dtype) for _ in range(n)]
    q, q64 = rounded(rng, tokens + (dim,) if per_token else (dim,), dtype)
    g, g64 = rounded(rng, (dim,), dtype) if gain else (None, None)
    src = jnp.stack([x for x, _ in xs]) if stacked else [x for x, _ in xs]
    src64 = np.stack([x for _, x in xs]) if stacked else [x for _, x in xs]
    kw = dict(num_heads=heads, activation=act, key_norm=key_norm, scale=0.8)

    def f(src, q, g):
        return depth_attention(src, q, g, return_lse=lse, return_weights=weights, **kw)

    got, vjp = jax.vjp(jax.jit(f), src, q, g)
    want = ref.depth_attention(src64, q64, g64, return_lse=lse, return_weights=weights, **kw)
    got, want = (got, want) if (lse or weights) else ((got,), (want,))
    assert got[0].dtype == jnp.dtype(dtype)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, dtype if i == 0 else "float64" if dtype == "float64" else "float32", f"output {i}", grad=False)
        if i > 0:
            assert a.dtype == (jnp.float64 if dtype == "float64" else jnp.float32)
    d_out, d_out64 = rounded(rng, tokens + (dim,), dtype)
    ct = jnp.float64 if dtype == "float64" else jnp.float32
    d_lse = jnp.asarray(rng.standard_normal(got[1].shape), ct) if lse else None
    cots = [d_out] + ([d_lse] if lse else []) + ([jnp.zeros_like(got[-1])] if weights else [])
    d_src, d_q, d_g = vjp(tuple(cots) if len(cots) > 1 else cots[0])
    want_g = ref.depth_attention_vjp(src64, q64, g64, d_out64, None if d_lse is None else np.asarray(d_lse), **kw)
    assert_close(np.stack(d_src), np.stack(want_g["sources"]), dtype, "d_sources", grad=True)
    assert isinstance(d_src, list) != stacked
    assert_close(d_q, want_g["query"], dtype, "d_query", grad=True)
    assert d_q.dtype == q.dtype
    if gain:
        assert_close(d_g, want_g["norm_weight"], dtype, "d_norm_weight", grad=True)
    else:
        assert d_g is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", DA_OPTIONS, ids=lambda o: "-".join(map(str, o)))
def test_depth_attention_matches_reference(rng, dtype, options):
    with precision(dtype):
        _da_case(rng, dtype, 5, (2, 3), 8, *options)


@pytest.mark.parametrize("n, tokens, dim", [(1, (4,), 7), (2, (), 5), (33, (3,), 12)])
def test_depth_attention_shapes(rng, n, tokens, dim):
    _da_case(rng, "float32", n, tokens, dim, 1, "softmax", True, False, False, True, True, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_matches_reference(rng, dtype):
    with precision(dtype):
        xs = [rounded(rng, (2, 3, 8), dtype) for _ in range(4)]
        qs, qs64 = rounded(rng, (3, 8), dtype)
        gs, gs64 = rounded(rng, (3, 8), "float32")  # gain in its own dtype
        f = jax.jit(lambda s, q, g: depth_attention_multi(s, q, g, scale=1.3))
        (out, lse), vjp = jax.vjp(f, [x for x, _ in xs], qs, gs)
        src64 = [x for _, x in xs]
        want_out, want_lse = ref.depth_attention_multi(src64, qs64, gs64, scale=1.3)
        assert out.dtype == jnp.dtype(dtype) and out.shape == (3, 2, 3, 8)
        assert_close(out, want_out, dtype, "out", grad=False)
        assert_close(lse, want_lse, "float64" if dtype == "float64" else "float32", "lse", grad=False)
        d_out, d_out64 = rounded(rng, out.shape, dtype)
        d_lse = jnp.asarray(rng.standard_normal(lse.shape), lse.dtype)
        d_src, d_q, d_g = vjp((d_out, d_lse))
        want = ref.depth_attention_multi_vjp(src64, qs64, gs64, d_out64, np.asarray(d_lse), scale=1.3)
        assert_close(np.stack(d_src), np.stack(want["sources"]), dtype, "d_sources", grad=True)
        assert_close(d_q, want["queries"], dtype, "d_queries", grad=True)
        assert d_g.dtype == jnp.float32
        assert_close(d_g, want["norm_weights"], "float32", "d_norm_weights", grad=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token, gain", [(False, True), (True, False)])
def test_merge_matches_reference(rng, dtype, per_token, gain):
    with precision(dtype):
        ct = "float64" if dtype == "float64" else "float32"
        o1, o164 = rounded(rng, (2, 3, 8), dtype)
        l1, l164 = rounded(rng, (2, 3), ct)
        p, p64 = rounded(rng, (2, 3, 8), dtype)
        q, q64 = rounded(rng, (2, 3, 8) if per_token else (8,), dtype)
        g, g64 = rounded(rng, (8,), dtype) if gain else (None, None)
        f = jax.jit(lambda *a: merge_partial(*a, scale=0.9, return_lse=True))
        (out, lse), vjp = jax.vjp(f, o1, l1, p, q, g)
        want_out, want_lse = ref.merge_partial(o164, l164, p64, q64, g64, scale=0.9, return_lse=True)
        assert out.dtype == jnp.dtype(dtype) and lse.dtype == jnp.dtype(ct)
        assert_close(out, want_out, dtype, "out", grad=False)
        assert_close(lse, want_lse, ct, "lse", grad=False)
        d_out, d_out64 = rounded(rng, out.shape, dtype)
        d_lse, d_lse64 = rounded(rng, lse.shape, ct)
        got = vjp((d_out, d_lse))
        want = ref.merge_partial_vjp(o164, l164, p64, q64, g64, d_out64, d_lse64, scale=0.9)
        for name, value in zip(("out1", "lse1", "partial", "query", "norm_weight"), got):
            if want[name] is None:
                assert value is None
            else:
                assert_close(value, want[name], dtype, f"d_{name}", grad=True)


def test_two_phase_ops_equal_direct(rng):
    """merge_partial(multi(sources)[s], partial) == depth_attention(sources + [partial]) (spec 3)."""
    xs = [jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) for _ in range(3)]
    partial = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    qs, gs = (jnp.asarray(rng.standard_normal((2, 8)), jnp.float32) for _ in range(2))
    out1, lse1 = depth_attention_multi(xs, qs, gs)
    for s in range(2):
        merged, lse = merge_partial(out1[s], lse1[s], partial, qs[s], gs[s], return_lse=True)
        direct, lse_d = depth_attention(xs + [partial], qs[s], gs[s], return_lse=True)
        np.testing.assert_allclose(merged, direct, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, lse_d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_source_is_identity(rng, dtype):
    with precision(dtype):
        x, _ = rounded(rng, (3, 7), dtype, scale=100.0)
        q, _ = rounded(rng, (7,), dtype)
        out = jax.jit(lambda x, q: depth_attention([x], q))(x, q)
        assert out.dtype == x.dtype
        assert np.array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)))


@pytest.mark.parametrize("op", ["depth_attention", "merge_partial"])
def test_huge_magnitudes_keep_gradients_finite(rng, op):
    """|x| = 1e30 in float32: mean(x^2) overflows (r = 0), yet c s r^3 is formed from bounded
    factors, so every gradient stays finite (spec C12 asks only for finiteness here)."""
    xs = [jnp.asarray(rng.standard_normal((3, 64)) * 1e30, jnp.float32) for _ in range(3)]
    q = jnp.asarray(rng.standard_normal(64), jnp.float32)
    if op == "depth_attention":
        f = lambda xs, q: depth_attention(xs, q, return_lse=True)  # noqa: E731
    else:
        f = lambda xs, q: merge_partial(xs[0], jnp.zeros(3), xs[1], q, return_lse=True)  # noqa: E731
    out, vjp = jax.vjp(jax.jit(f), xs, q)
    grads = vjp((jnp.asarray(rng.standard_normal((3, 64)), jnp.float32), jnp.ones(3, jnp.float32)))
    for leaf in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_comparison_is_tight_enough_to_fail(rng):
    """The comparison (the suite's metric; float32 value column, which these tests also apply to
    float32 gradients) passes the op and rejects a result whose every element is off by 3 rtol."""
    xs, x64 = rounded(rng, (3, 4, 8), "float32")
    q, q64 = rounded(rng, (8,), "float32")
    out, want = depth_attention(xs, q), ref.depth_attention(x64, q64)
    assert_close(out, want, "float32", "out", grad=False)
    for grad in (False, True):
        with pytest.raises(AssertionError, match="rel_err"):
            assert_close(out, want * (1 + 3 * TOLERANCES["float32"].value), "float32", "out", grad=grad)
