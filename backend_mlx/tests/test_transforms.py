"""mx.compile / mx.grad / mx.vmap, determinism, unmodified inputs and error messages."""

import attnres_mlx as A
import attnres_numpy.ops as ref
import mlx.core as mx
import numpy as np
import pytest
from attnres_conformance.numerics import round_to
from helpers import assert_close, rand, to_mx, to_np

D, N = 8, 3


def _inputs(seed=0, batch=(4, 3), dtype="float32"):
    rng = np.random.default_rng(seed)
    sources = [rand(rng, batch + (D,), dtype) for _ in range(N)]
    return rng, sources, rand(rng, (D,), dtype), rand(rng, (D,), dtype)


def test_compile_forward_and_grad():
    rng, sources, q, g = _inputs()
    cot = rand(rng, (4, 3, D), "float32")
    xs, qm, gm = [to_mx(s, "float32") for s in sources], to_mx(q, "float32"), to_mx(g, "float32")

    def loss(xs, q, g):
        out, lse = A.depth_attention(xs, q, g, return_lse=True)
        return (out * to_mx(cot, "float32")).sum() + lse.sum()

    out = mx.compile(lambda xs, q, g: A.depth_attention(xs, q, g))(xs, qm, gm)
    assert_close("out", out, ref.depth_attention(sources, q, g), grad=False)
    grads = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(xs, qm, gm)
    r = ref.depth_attention_vjp(sources, q, g, cot, np.ones((4, 3)))
    for i in range(N):
        assert_close(f"d sources[{i}]", grads[0][i], r["sources"][i], grad=True)
    assert_close("d query", grads[1], r["query"], grad=True)
    assert_close("d norm_weight", grads[2], r["norm_weight"], grad=True)


@pytest.mark.parametrize("per_token", [False, True], ids=["pseudo", "per_token"])
def test_vmap_forward_and_grad(per_token):
    """vmap over a leading axis equals the op on that axis as a token axis; vmap(grad) equals
    the per-row reference VJP."""
    rng, sources, q, g = _inputs(1)
    if per_token:
        q = rand(rng, (4, 3, D), "float32")
    xs, qm, gm = [to_mx(s, "float32") for s in sources], to_mx(q, "float32"), to_mx(g, "float32")
    q_axis = 0 if per_token else None
    out = mx.vmap(lambda xs, q: A.depth_attention(xs, q, gm, num_heads=2),
                  in_axes=(0, q_axis))(xs, qm)
    assert_close("out", out, ref.depth_attention(sources, q, g, num_heads=2), grad=False)

    def row_loss(xs, q):
        return A.depth_attention(xs, q, gm, num_heads=2).sum()

    grads = mx.vmap(mx.grad(row_loss, argnums=(0, 1)), in_axes=(0, q_axis))(xs, qm)
    for b in range(4):
        r = ref.depth_attention_vjp([s[b] for s in sources], q[b] if per_token else q, g,
                                    np.ones((3, D)), num_heads=2)
        for i in range(N):
            assert_close(f"d sources[{i}][{b}]", grads[0][i][b], r["sources"][i], grad=True)
        assert_close(f"d query[{b}]", grads[1][b], r["query"], grad=True)


def test_vmap_two_phase_ops():
    rng, sources, _, _ = _inputs(2)
    queries = rand(rng, (2, D), "float32")
    xs, qs = [to_mx(s, "float32") for s in sources], to_mx(queries, "float32")
    out, lse = mx.vmap(lambda xs: A.depth_attention_multi(xs, qs))(xs)
    r_out, r_lse = ref.depth_attention_multi(sources, queries)
    assert_close("out", out, np.moveaxis(r_out, 0, 1), grad=False)
    assert_close("lse", lse, np.moveaxis(r_lse, 0, 1), grad=False)
    partial = rand(rng, (4, 3, D), "float32")
    out1, lse1 = round_to(r_out[0], "float32"), round_to(r_lse[0], "float32")
    merged = mx.vmap(lambda o, l, p: A.merge_partial(o, l, p, qs[0]))(
        to_mx(out1, "float32"), to_mx(lse1, "float32"), to_mx(partial, "float32"))
    assert_close("merged", merged, ref.merge_partial(out1, lse1, partial, queries[0]),
                 grad=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_and_inputs_unmodified(dtype):
    rng, sources, q, g = _inputs(3, dtype=dtype)
    xs, qm, gm = [to_mx(s, dtype) for s in sources], to_mx(q, dtype), to_mx(g, dtype)
    before = [to_np(a) for a in xs + [qm, gm]]

    def run():
        return mx.vjp(lambda *a: [A.depth_attention(list(a[:N]), a[N], a[N + 1])],
                      xs + [qm, gm], [mx.ones((4, 3, D), dtype=xs[0].dtype)])

    (o1,), g1 = run()
    (o2,), g2 = run()
    assert mx.array_equal(o1, o2).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(g1, g2))
    for a, b in zip(xs + [qm, gm], before):
        np.testing.assert_array_equal(to_np(a), b)


def _np_and_mx(shape, dtype="float32"):
    a = np.zeros(shape, dtype=np.dtype(dtype))
    return a, mx.array(a)


BAD = {
    "empty": lambda x, q, g: (([], q, None), {}),
    "shape_mismatch": lambda x, q, g: (([x, x[..., :4]], q, None), {}),
    "query_shape": lambda x, q, g: (([x, x], q[:4], None), {}),
    "gain_shape": lambda x, q, g: (([x, x], q, g[:3]), {}),
    "eps": lambda x, q, g: (([x, x], q, None), dict(eps=0.0)),
    "heads": lambda x, q, g: (([x, x], q, None), dict(num_heads=3)),
    "lse_sigmoid": lambda x, q, g: (([x, x], q, None), dict(activation="sigmoid",
                                                             return_lse=True)),
    "activation": lambda x, q, g: (([x, x], q, None), dict(activation="relu")),
    "scale_type": lambda x, q, g: (([x, x], q, None), dict(scale="1")),
    "stacked_1d": lambda x, q, g: ((x[0], q, None), {}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_errors_match_reference(case):
    """Same exception type and message as the NumPy reference (shared checks)."""
    x_np, x = _np_and_mx((2, 8))
    q_np, q = _np_and_mx((8,))
    g_np, g = _np_and_mx((8,))
    (args_np, kw) = BAD[case](x_np, q_np, g_np)
    (args, _) = BAD[case](x, q, g)
    with pytest.raises((ValueError, TypeError)) as expected:
        ref.depth_attention(*args_np, **kw)
    with pytest.raises(expected.type) as got:
        A.depth_attention(*args, **kw)
    assert str(got.value) == str(expected.value)


def test_dtype_errors():
    x = mx.zeros((2, 8))
    with pytest.raises(TypeError, match="query: expected a floating dtype.*got int32"):
        A.depth_attention([x, x], mx.zeros((8,), dtype=mx.int32))
    with pytest.raises(TypeError, match="sources: all sources must share one dtype"):
        A.depth_attention([x, x.astype(mx.float16)], mx.zeros((8,)))
    with pytest.raises(TypeError, match="sources: expected a list/tuple"):
        A.depth_attention({"a": x}, mx.zeros((8,)))
    with pytest.raises(TypeError, match=r"sources\[1\]: expected an mlx.core.array"):
        A.depth_attention([x, np.zeros((2, 8))], mx.zeros((8,)))


def test_multi_merge_and_inv_rms_errors():
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError, match=r"queries: expected shape \[S, D\]"):
        A.depth_attention_multi([x], mx.zeros((8,)))
    with pytest.raises(ValueError, match=r"norm_weights: expected shape \(2, 8\)"):
        A.depth_attention_multi([x], mx.zeros((2, 8)), mx.zeros((3, 8)))
    with pytest.raises(ValueError, match=r"lse1: expected shape \(2,\)"):
        A.merge_partial(x, mx.zeros((3,)), x, mx.zeros((8,)))
    with pytest.raises(TypeError, match="out1: dtype float16 differs from partial dtype float32"):
        A.merge_partial(x.astype(mx.float16), mx.zeros((2,)), x, mx.zeros((8,)))
    with pytest.raises(ValueError, match=r"inv_rms\[0\]: expected a floating array of shape"):
        A.depth_attention([x, x], mx.zeros((8,)), inv_rms=[mx.zeros((2,)), None])
    with pytest.raises(ValueError, match="inv_rms: cached inverse RMS needs key_norm=True"):
        A.depth_attention([x, x], mx.zeros((8,)), key_norm=False, inv_rms=[None, None])
