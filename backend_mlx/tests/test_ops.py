"""Every op, option and dtype, forward and every gradient, against the float64 reference."""

import threading

import attnres_mlx as A
import attnres_numpy.ops as ref
import mlx.core as mx
import numpy as np
import pytest
from attnres_mlx import dispatch, ops
from attnres_mlx.kernels import compiled
from helpers import DTYPES, MX, assert_close, rand, to_mx, to_np

BATCH, D, N = (2, 3), 8, 3

CASES = {
    "plain": dict(return_lse=True, return_weights=True),
    "per_token": dict(per_token=True, return_lse=True),
    "heads": dict(num_heads=2, return_lse=True, return_weights=True),
    "heads_per_token": dict(num_heads=4, per_token=True, return_lse=True),
    "sigmoid": dict(activation="sigmoid", return_weights=True),
    "no_key_norm": dict(key_norm=False, return_lse=True),
    "no_gain": dict(gain=False, return_lse=True),
    "eps_scale": dict(eps=1e-2, scale=-0.7, return_lse=True),
    "one_source": dict(num_sources=1, return_lse=True),
}


def _compute(dtype):
    return "float64" if dtype == "float64" else "float32"


def _attention_case(rng, dtype, case):
    opts = dict(CASES[case])
    per_token, gain = opts.pop("per_token", False), opts.pop("gain", True)
    n = opts.pop("num_sources", N)
    sources = [rand(rng, BATCH + (D,), dtype) for _ in range(n)]
    query = rand(rng, BATCH + (D,) if per_token else (D,), dtype)
    gain = rand(rng, (D,), dtype) if gain else None
    return sources, query, gain, opts


def _run(sources, query, gain, opts, dtype, stacked, cot_out, cot_lse, query_dtype=None):
    """Forward outputs and VJP of the MLX op on native copies of the given float64 values."""
    srcs = [to_mx(np.stack(sources), dtype)] if stacked else [to_mx(s, dtype) for s in sources]
    q = to_mx(query, query_dtype or dtype)
    g = None if gain is None else to_mx(gain, query_dtype or dtype)
    n = len(srcs)

    def f(*flat):
        x = flat[0] if stacked else list(flat[:n])
        res = A.depth_attention(x, flat[n], flat[n + 1] if g is not None else None, **opts)
        return list(res) if isinstance(res, tuple) else [res]

    primals = srcs + [q] + ([g] if g is not None else [])
    outs = f(*primals)
    cots = [to_mx(cot_out, dtype)]
    if opts.get("return_lse"):
        cots.append(mx.array(cot_lse, dtype=mx.float64).astype(outs[1].dtype))
    if opts.get("return_weights"):
        cots.append(mx.zeros_like(outs[-1]))
    _, grads = mx.vjp(f, primals, cots)
    return outs, grads


@pytest.fixture(params=["vectorized", "streamed"])
def forward_layout(request, monkeypatch):
    """Both forward layouts of the compiled implementation: these small calls take the
    vectorized one; a threshold of 0 sends them source by source, as large calls go."""
    if request.param == "streamed":
        monkeypatch.setattr(compiled, "VECTOR_MAX_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("dtype,forward_layout",  # the streamed layout: float32/64 (CI time)
                         [(d, "vectorized") for d in DTYPES]
                         + [(d, "streamed") for d in ("float32", "float64")],
                         indirect=["forward_layout"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_depth_attention_forward_and_vjp(case, dtype, stacked, forward_layout):
    rng = np.random.default_rng(abs(hash((case, dtype))) % 2**32)
    sources, query, gain, opts = _attention_case(rng, dtype, case)
    heads = opts.get("num_heads", 1)
    lse_shape = BATCH + ((heads,) if heads > 1 else ())
    cot_out, cot_lse = rand(rng, BATCH + (D,), dtype), rand(rng, lse_shape, _compute(dtype))
    outs, grads = _run(sources, query, gain, opts, dtype, stacked, cot_out, cot_lse)

    expect = ref.depth_attention(sources, query, gain, **opts)
    expect = list(expect) if isinstance(expect, tuple) else [expect]
    assert outs[0].dtype == MX[dtype]
    for name, a, r in zip(["out", "lse", "weights"] if opts.get("return_lse") else
                          ["out", "weights"], outs, expect):
        assert_close(name, a, r, grad=False)
    vjp_opts = {k: v for k, v in opts.items() if k not in ("return_lse", "return_weights")}
    g = ref.depth_attention_vjp(sources, query, gain, cot_out,
                                cot_lse if opts.get("return_lse") else None, **vjp_opts)
    n = 1 if stacked else len(sources)
    if stacked:
        assert grads[0].shape == (len(sources),) + BATCH + (D,)
        assert_close("d sources", grads[0], np.stack(g["sources"]), grad=True)
    for i in range(n if not stacked else 0):
        assert_close(f"d sources[{i}]", grads[i], g["sources"][i], grad=True)
    assert_close("d query", grads[n], g["query"], grad=True)
    if gain is not None:
        assert_close("d norm_weight", grads[n + 1], g["norm_weight"], grad=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_query_dtype(dtype):
    """query / norm_weight may be float32 with low-precision sources; grads keep their dtypes."""
    rng = np.random.default_rng(1)
    sources, query, gain, opts = _attention_case(rng, dtype, "plain")
    query, gain = rand(rng, (D,), "float32"), rand(rng, (D,), "float32")
    cot_out, cot_lse = rand(rng, BATCH + (D,), dtype), rand(rng, BATCH, "float32")
    outs, grads = _run(sources, query, gain, opts, dtype, False, cot_out, cot_lse, "float32")
    assert_close("out", outs[0], ref.depth_attention(sources, query, gain), grad=False)
    g = ref.depth_attention_vjp(sources, query, gain, cot_out, cot_lse)
    assert grads[N].dtype == mx.float32 and grads[N + 1].dtype == mx.float32
    assert_close("d query", grads[N], g["query"], grad=True)
    assert_close("d norm_weight", grads[N + 1], g["norm_weight"], grad=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_source_returns_it_exactly(dtype):
    rng = np.random.default_rng(2)
    x = to_mx(rand(rng, BATCH + (D,), dtype, scale=3.0), dtype)
    q = to_mx(rand(rng, (D,), dtype), dtype)
    out = A.depth_attention([x], q)
    assert out.dtype == x.dtype and mx.array_equal(out, x).item()


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gain", [True, False], ids=["gain", "no_gain"])
def test_depth_attention_multi(dtype, stacked, gain):
    rng = np.random.default_rng(3)
    S = 3
    sources = [rand(rng, BATCH + (D,), dtype) for _ in range(N)]
    queries = rand(rng, (S, D), dtype)
    gains = rand(rng, (S, D), dtype) if gain else None
    cot_out = rand(rng, (S,) + BATCH + (D,), dtype)
    cot_lse = rand(rng, (S,) + BATCH, _compute(dtype))
    srcs = [to_mx(np.stack(sources), dtype)] if stacked else [to_mx(s, dtype) for s in sources]
    primals = srcs + [to_mx(queries, dtype)] + ([to_mx(gains, dtype)] if gain else [])
    n = len(srcs)

    def f(*flat):
        x = flat[0] if stacked else list(flat[:n])
        return list(A.depth_attention_multi(x, flat[n], flat[n + 1] if gain else None))

    outs = f(*primals)
    _, grads = mx.vjp(f, primals, [to_mx(cot_out, dtype),
                                   mx.array(cot_lse, dtype=mx.float64).astype(outs[1].dtype)])
    r_out, r_lse = ref.depth_attention_multi(sources, queries, gains)
    assert outs[0].dtype == MX[dtype]
    assert outs[1].dtype == (mx.float64 if dtype == "float64" else mx.float32)
    assert_close("out", outs[0], r_out, grad=False)
    assert_close("lse", outs[1], r_lse, grad=False)
    g = ref.depth_attention_multi_vjp(sources, queries, gains, cot_out, cot_lse)
    d_sources = grads[0] if stacked else mx.stack(grads[:N])
    assert_close("d sources", d_sources, np.stack(g["sources"]), grad=True)
    assert_close("d queries", grads[n], g["queries"], grad=True)
    if gain:
        assert_close("d norm_weights", grads[n + 1], g["norm_weights"], grad=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token", [False, True], ids=["pseudo", "per_token"])
@pytest.mark.parametrize("gain", [True, False], ids=["gain", "no_gain"])
def test_merge_partial(dtype, per_token, gain):
    rng = np.random.default_rng(4)
    c = _compute(dtype)
    out1, partial = rand(rng, BATCH + (D,), dtype), rand(rng, BATCH + (D,), dtype)
    lse1 = rand(rng, BATCH, c)
    query = rand(rng, BATCH + (D,) if per_token else (D,), dtype)
    nw = rand(rng, (D,), dtype) if gain else None
    cot_out, cot_lse = rand(rng, BATCH + (D,), dtype), rand(rng, BATCH, c)
    primals = [to_mx(out1, dtype), to_mx(lse1, c), to_mx(partial, dtype), to_mx(query, dtype)]
    primals += [to_mx(nw, dtype)] if gain else []

    def f(*a):
        return list(A.merge_partial(*a[:4], a[4] if gain else None, return_lse=True, eps=1e-5,
                                    scale=0.8))

    outs = f(*primals)
    _, grads = mx.vjp(f, primals, [to_mx(cot_out, dtype), to_mx(cot_lse, c)])
    r_out, r_lse = ref.merge_partial(out1, lse1, partial, query, nw, eps=1e-5, scale=0.8,
                                     return_lse=True)
    assert_close("out", outs[0], r_out, grad=False)
    assert_close("lse", outs[1], r_lse, grad=False)
    g = ref.merge_partial_vjp(out1, lse1, partial, query, nw, cot_out, cot_lse, eps=1e-5,
                              scale=0.8)
    for name, grad in zip(["out1", "lse1", "partial", "query", "norm_weight"], grads):
        assert_close(f"d {name}", grad, g[name], grad=True)


def test_two_phase_ops_equal_direct():
    """merge_partial(depth_attention_multi(sources), partial) == depth_attention(sources+[p])."""
    rng = np.random.default_rng(5)
    srcs = [to_mx(rand(rng, BATCH + (D,), "float64"), "float64") for _ in range(N)]
    partial = to_mx(rand(rng, BATCH + (D,), "float64"), "float64")
    qs, gs = to_mx(rand(rng, (2, D), "float64"), "float64"), to_mx(rand(rng, (2, D), "float64"),
                                                                    "float64")
    out1, lse1 = A.depth_attention_multi(srcs, qs, gs)
    for s in range(2):
        two, lse = A.merge_partial(out1[s], lse1[s], partial, qs[s], gs[s], return_lse=True)
        one, lse_direct = A.depth_attention(srcs + [partial], qs[s], gs[s], return_lse=True)
        np.testing.assert_allclose(to_np(two), to_np(one), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(to_np(lse), to_np(lse_direct), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("cached", [(True, True, False), (True, False, True), "one_array"],
                         ids=["leading", "mixed", "one_array"])
@pytest.mark.parametrize("num_heads", [1, 2])
def test_cached_inverse_rms_equals_direct(num_heads, cached, stacked, forward_layout):
    """depth_attention(..., inv_rms=[r, None, ...]) equals the op and the reference, including
    the gradient that flows into the sources through the cached r (lists and stacked sources,
    cached r on any subset of them; stacked sources also with one stacked `[N, ..., H]` r)."""
    if cached == "one_array" and not stacked:
        with pytest.raises(ValueError, match="inv_rms: one stacked array"):
            xs = [mx.zeros(BATCH + (D,)) for _ in range(N)]
            A.depth_attention(xs, mx.zeros((D,)), inv_rms=mx.ones((N,) + BATCH + (1,)))
        return
    rng = np.random.default_rng(6)
    sources = [rand(rng, BATCH + (D,), "float64") for _ in range(N)]
    query, gain = rand(rng, (D,), "float64"), rand(rng, (D,), "float64")
    cot = rng.standard_normal(BATCH + (D,))

    def f(*xs):
        x = xs[0] if stacked else list(xs)
        if cached == "one_array":
            rms = A.inverse_rms(x, num_heads=num_heads)
        else:
            rms = [A.inverse_rms(x[i], num_heads=num_heads) if c else None
                   for i, c in enumerate(cached)]
        return [A.depth_attention(x, to_mx(query, "float64"), to_mx(gain, "float64"),
                                  num_heads=num_heads, inv_rms=rms)]

    xs = [to_mx(np.stack(sources), "float64")] if stacked else [to_mx(s, "float64")
                                                                   for s in sources]
    outs, grads = mx.vjp(f, xs, [to_mx(cot, "float64")])
    np.testing.assert_allclose(to_np(outs[0]), ref.depth_attention(
        sources, query, gain, num_heads=num_heads), rtol=1e-12, atol=1e-12)
    g = ref.depth_attention_vjp(sources, query, gain, cot, num_heads=num_heads)
    d_sources = grads[0] if stacked else grads
    for i in range(N):
        np.testing.assert_allclose(to_np(d_sources[i]), g["sources"][i], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["plain", "heads_per_token", "sigmoid", "no_key_norm"])
def test_stacked_and_list_sources_agree_bitwise(case, dtype):
    """One stacked array and a list of the same sources give the same bits: forward and every
    gradient (the stacked gradient is one array, never a stack of per-source gradients)."""
    rng = np.random.default_rng(9)
    sources, query, gain, opts = _attention_case(rng, dtype, case)
    cot_out, cot_lse = rand(rng, BATCH + (D,), dtype), None
    if opts.get("return_lse"):
        heads = opts.get("num_heads", 1)
        cot_lse = rand(rng, BATCH + ((heads,) if heads > 1 else ()), "float32")
    outs_l, grads_l = _run(sources, query, gain, opts, dtype, False, cot_out, cot_lse)
    outs_s, grads_s = _run(sources, query, gain, opts, dtype, True, cot_out, cot_lse)
    for a, b in zip(outs_l, outs_s):
        assert mx.array_equal(a, b).item()
    assert mx.array_equal(mx.stack(grads_l[:N]), grads_s[0]).item()
    for a, b in zip(grads_l[N:], grads_s[1:]):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_compute_dtype(dtype):
    """C10: float64 stays float64, everything else computes in float32."""
    assert ops.dtype_name(MX[dtype]) == dtype
    assert ops.compute_dtype(MX[dtype]) == MX[_compute(dtype)]


def test_implementation_choice_and_scoped_override():
    """The automatic choice, `dispatch.use_impl` as a context-local override, and the Choice
    each call records (what served it, and why each earlier implementation did not)."""
    automatic = "metal" if dispatch.availability()["metal"] is None else "compiled"
    assert dispatch.IMPLEMENTATIONS == ("metal", "compiled")
    x, q = mx.ones((2, D)), mx.zeros((D,))

    def served(dtype=mx.float32):
        mx.eval(ops.depth_attention([x.astype(dtype), x.astype(dtype)], q.astype(dtype)))
        return dispatch.last_choice()

    assert served().impl == automatic
    with mx.stream(mx.cpu):  # float64 exists on the CPU device only
        choice = served(mx.float64)
    assert choice.op == "depth_attention" and choice.impl == "compiled"
    assert dict(choice.refused)["metal"]  # unavailable here, or no float64 on Metal
    with dispatch.use_impl("compiled"):
        assert served() == dispatch.Choice("depth_attention", "compiled",
                                           (("metal", "not forced (use_impl('compiled'))"),))
        seen = []
        thread = threading.Thread(target=lambda: seen.append(served().impl))
        thread.start()
        thread.join()
        assert seen == [automatic]  # another thread's context keeps the automatic choice
        with dispatch.use_impl("auto"):
            assert served().impl == automatic
        assert served().impl == "compiled"
    assert served().impl == automatic
    with pytest.raises(ValueError, match="use_impl: expected one of metal, compiled or 'auto', "
                                         "got 'cuda'"):
        with dispatch.use_impl("cuda"):
            pass
    with pytest.raises(TypeError, match="use_impl: implementation 'compiled' takes no options, "
                                        "got tile"):
        with dispatch.use_impl("compiled", tile=4):
            pass
