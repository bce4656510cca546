"""The error metric, FlashAttention's rule, and the naive low-precision composition."""

import numpy as np
import pytest
from attnres_conformance import naive
from attnres_conformance.numerics import round_to
from attnres_conformance.tolerances import TOLERANCES, compare, flash_rule, rel_err
from attnres_numpy import ops


def test_rel_err():
    r = np.array([1.0, -2.0, 0.0, 4.0])
    assert rel_err(r, r, 1e-30) == (0.0, "")
    err, msg = rel_err(r + np.array([0, 0, 1e-3, 0]), r, 1e-30)
    assert err == pytest.approx(1e-3 / np.sqrt(np.mean(r ** 2)))  # an exact zero is judged on the RMS
    assert "(2,)" in msg
    assert rel_err(np.zeros(3), np.zeros(3), 1e-30)[0] == 0.0
    assert rel_err(np.array([1e-20]), np.zeros(1), 1e-30)[0] == pytest.approx(1e10)


def test_non_finite_must_match():
    ref = np.array([1.0, np.inf, np.nan])
    assert rel_err(ref.copy(), ref, 1e-30)[0] == 0.0
    err, msg = rel_err(np.array([np.nan, np.inf, np.nan]), ref, 1e-30)
    assert err == np.inf and "1 non-finite mismatches" in msg
    assert rel_err(np.array([1.0, -np.inf, np.nan]), ref, 1e-30)[0] == np.inf
    assert not compare("out", np.ones(2), np.ones(3), "float32", grad=False).ok  # shape mismatch


def test_table_is_ordered():
    dtypes = ["float64", "float32", "float16", "bfloat16"]
    for looser, tighter in zip(dtypes[1:], dtypes):
        assert TOLERANCES[looser].value > TOLERANCES[tighter].value
    assert all(t.grad > t.value for t in TOLERANCES.values())


def _case(rng, n=6, tokens=(3,), dim=16, heads=2):
    x = rng.standard_normal((n,) + tokens + (dim,))
    q = rng.standard_normal(tokens + (dim,)) / 2
    g = 1 + 0.3 * rng.standard_normal(dim)
    return x, q, g, rng.standard_normal(tokens + (dim,)), rng.standard_normal(tokens + (heads,))


@pytest.mark.parametrize("activation,key_norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
def test_naive_in_float64_is_the_reference(activation, key_norm):
    x, q, g, d_out, d_lse = _case(np.random.default_rng(0))
    kw = dict(eps=1e-3, scale=0.7, num_heads=2, activation=activation, key_norm=key_norm)
    d_lse = d_lse if activation == "softmax" else None
    got = naive.depth_attention(x, q, g, d_out, dtype="float64", d_lse=d_lse, **kw)
    ref = ops.depth_attention_vjp(x, q, g, d_out, d_lse, **kw)
    np.testing.assert_allclose(got["out"], ops.depth_attention(x, q, g, **kw), rtol=1e-12, atol=1e-12)
    for name in ("sources", "query", "norm_weight"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-10, atol=1e-12)


def test_flash_rule_separates_one_cast_from_naive():
    rng = np.random.default_rng(1)
    x, q, g, d_out, _ = _case(rng, n=33, dim=64, heads=1)
    x, q, g = (round_to(a, "bfloat16") for a in (x, q, g))
    q = q[0]
    ref = ops.depth_attention(x, q, g)
    lowp = naive.depth_attention(x, q, g, d_out[0], dtype="bfloat16")["out"]
    one_cast = round_to(ref, "bfloat16")
    naive_err = rel_err(lowp, ref, 1e-30)[0]
    assert naive_err > rel_err(one_cast, ref, 1e-30)[0]
    assert flash_rule("out", rel_err(one_cast, ref, 1e-30)[0], lowp, ref, "bfloat16").ok
    assert not flash_rule("out", 3 * naive_err + 0.01, lowp, ref, "bfloat16").ok
