"""The fused output norm (C17, spec 2.6): `depth_attention(..., out_norm_weight=, out_norm_eps=)`
returns out_normed = rmsnorm(out) * w from the same pass; forward and every gradient (d
out_norm_weight included, random cotangents on out, out_normed and lse) against the float64
reference on the upcast inputs.  These run on the automatic choice (the compiled path here);
`test_metal_emulated.py` runs them through the Metal kernels' emulator and `test_metal.py` on
real Metal."""

import attnres_mlx as A
import attnres_numpy.ops as ref
import mlx.core as mx
import numpy as np
import pytest
from attnres_mlx import dispatch
from helpers import DTYPES, MX, assert_close, rand, to_mx, to_np
from test_ops import BATCH, CASES, D, _attention_case, _compute

#: Per case: out_norm_eps (None: eps) and the out-norm weight's dtype (None: the sources').
OUT_NORM = {case: (None, None) for case in CASES}
OUT_NORM.update({"eps_scale": (1e-3, None), "no_gain": (None, "float32"),
                 "heads_per_token": (0.5, None)})


def run(case, dtype, stacked, *, seed=0, scale=1.0, with_out_cot=True):
    """The op (sources drawn at `scale`) and its VJP with random cotangents on out (unless
    with_out_cot is False: zero), out_normed and lse; checked against the reference.  Returns
    (outputs, gradients) for bitwise comparisons."""
    rng = np.random.default_rng(seed + abs(hash((case, dtype))) % 2**31)
    sources, query, gain, opts = _attention_case(rng, dtype, case)
    sources = [rand(rng, s.shape, dtype, scale) for s in sources] if scale != 1.0 else sources
    eps_o, w_dtype = OUT_NORM[case]
    w = rand(rng, (D,), w_dtype or dtype)
    heads = opts.get("num_heads", 1)
    cot_out = rand(rng, BATCH + (D,), dtype) if with_out_cot else np.zeros(BATCH + (D,))
    cot_normed = rand(rng, BATCH + (D,), dtype)
    cot_lse = rand(rng, BATCH + ((heads,) if heads > 1 else ()), _compute(dtype))
    n = 1 if stacked else len(sources)
    primals = ([to_mx(np.stack(sources), dtype)] if stacked else
               [to_mx(s, dtype) for s in sources]) + [to_mx(query, dtype)]
    primals += [to_mx(gain, dtype)] if gain is not None else []
    primals.append(to_mx(w, w_dtype or dtype))
    kw = dict(opts, out_norm_weight=None, out_norm_eps=eps_o)

    def f(*flat):
        x = flat[0] if stacked else list(flat[:n])
        return list(A.depth_attention(x, flat[n], flat[n + 1] if gain is not None else None,
                                      **dict(kw, out_norm_weight=flat[-1])))

    outs = f(*primals)
    cots = [to_mx(cot_out, dtype), to_mx(cot_normed, dtype)]
    if opts.get("return_lse"):
        cots.append(mx.array(cot_lse, dtype=mx.float64).astype(outs[2].dtype))
    if opts.get("return_weights"):
        cots.append(mx.zeros_like(outs[-1]))
    _, grads = mx.vjp(f, primals, cots)

    expect = ref.depth_attention(sources, query, gain, **dict(kw, out_norm_weight=w))
    names = ["out", "out_normed"] + ["lse"] * bool(opts.get("return_lse")) + [
        "weights"] * bool(opts.get("return_weights"))
    assert len(outs) == len(expect) == len(names)
    assert outs[0].dtype == outs[1].dtype == MX[dtype]
    for name, a, r in zip(names, outs, expect):
        assert_close(name, a, r, grad=False)
    vjp_opts = {k: v for k, v in kw.items() if k not in ("return_lse", "return_weights")}
    g = ref.depth_attention_vjp(sources, query, gain, cot_out,
                                cot_lse if opts.get("return_lse") else None,
                                d_out_normed=cot_normed, **dict(vjp_opts, out_norm_weight=w))
    d_sources = grads[0] if stacked else mx.stack(grads[:n])
    assert_close("d sources", d_sources, np.stack(g["sources"]), grad=True)
    assert_close("d query", grads[n], g["query"], grad=True)
    if gain is not None:
        assert_close("d norm_weight", grads[n + 1], g["norm_weight"], grad=True)
    assert grads[-1].dtype == MX[w_dtype or dtype] and grads[-1].shape == (D,)
    assert_close("d out_norm_weight", grads[-1], g["out_norm_weight"], grad=True)
    return outs, grads


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_out_norm_forward_and_vjp(case, dtype, stacked):
    run(case, dtype, stacked)


@pytest.mark.parametrize("case", ["heads_per_token", "sigmoid"])
def test_out_unchanged_by_the_option(case, dtype="bfloat16"):
    """C17: out (and lse, weights) with the option are the bits of the call without it."""
    rng = np.random.default_rng(2)
    sources, query, gain, opts = _attention_case(rng, dtype, case)
    args = ([to_mx(s, dtype) for s in sources], to_mx(query, dtype),
            None if gain is None else to_mx(gain, dtype))
    plain = A.depth_attention(*args, **opts)
    plain = plain if isinstance(plain, tuple) else (plain,)
    fused = A.depth_attention(*args, **opts, out_norm_weight=to_mx(rand(rng, (D,), dtype), dtype))
    assert len(fused) == len(plain) + 1
    for a, b in zip(plain, fused[:1] + fused[2:]):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_out_normed_has_a_cotangent(dtype):
    """mx.grad of a loss of out_normed alone (out's cotangent is zero) under mx.compile."""
    run("heads", dtype, False, with_out_cot=False)
    rng = np.random.default_rng(3)
    sources = [rand(rng, BATCH + (D,), dtype) for _ in range(3)]
    q, w, cot = rand(rng, (D,), dtype), rand(rng, (D,), dtype), rand(rng, BATCH + (D,), dtype)

    def loss(xs, w):
        _, normed = A.depth_attention(xs, to_mx(q, dtype), out_norm_weight=w, num_heads=2)
        return (normed.astype(mx.float32) * to_mx(cot, "float32")).sum()

    grads = mx.compile(mx.grad(loss, argnums=(0, 1)))([to_mx(s, dtype) for s in sources],
                                                       to_mx(w, dtype))
    r = ref.depth_attention_vjp(sources, q, None, None, num_heads=2, out_norm_weight=w,
                                d_out_normed=cot)
    for i in range(3):
        assert_close(f"d sources[{i}]", grads[0][i], r["sources"][i], grad=True)
    assert_close("d out_norm_weight", grads[1], r["out_norm_weight"], grad=True)


def test_only_out_has_a_cotangent():
    """A loss of out alone: the gradients are the bits of the call without the option (the d_y
    prologue adds zeros), and d out_norm_weight is zero."""
    rng = np.random.default_rng(10)
    xs = [to_mx(rand(rng, BATCH + (D,), "float32"), "float32") for _ in range(3)]
    q, w = to_mx(rand(rng, (D,), "float32"), "float32"), to_mx(rand(rng, (D,), "float32"),
                                                                "float32")
    fused = mx.grad(lambda xs, w: A.depth_attention(xs, q, out_norm_weight=w, num_heads=2)[0]
                    .sum(), argnums=(0, 1))(xs, w)
    plain = mx.grad(lambda xs: A.depth_attention(xs, q, num_heads=2).sum())(xs)
    for a, b in zip(fused[0], plain):
        assert mx.array_equal(a, b).item()
    assert mx.array_equal(fused[1], mx.zeros((D,))).item()


def test_empty_token_axis():
    """T = 0: out_normed `[2, 0, D]`, and d out_norm_weight is a zero `[D]`."""
    xs = [mx.zeros((2, 0, D)) for _ in range(3)]
    w = mx.ones((D,))
    (out, normed), grads = mx.vjp(
        lambda *a: list(A.depth_attention(list(a[:3]), mx.ones((D,)), out_norm_weight=a[3],
                                          num_heads=2)),
        xs + [w], [mx.zeros((2, 0, D)), mx.zeros((2, 0, D))])
    assert out.shape == normed.shape == (2, 0, D)
    assert [g.shape for g in grads[:3]] == [(2, 0, D)] * 3
    assert mx.array_equal(grads[3], mx.zeros((D,))).item()


def test_vmap_forward_and_grad():
    """vmap over a leading axis: out_normed, and vmap(grad) of out_normed's sum per row."""
    rng = np.random.default_rng(9)
    sources = [rand(rng, (4, 3, D), "float32") for _ in range(3)]
    q, w = rand(rng, (D,), "float32"), rand(rng, (D,), "float32")
    xs, qm, wm = [to_mx(s, "float32") for s in sources], to_mx(q, "float32"), to_mx(w, "float32")
    _, normed = mx.vmap(lambda xs: A.depth_attention(xs, qm, out_norm_weight=wm, num_heads=2))(xs)
    assert_close("out_normed", normed, ref.depth_attention(
        sources, q, out_norm_weight=w, num_heads=2)[1], grad=False)

    def row_loss(xs, w):
        return A.depth_attention(xs, qm, out_norm_weight=w, num_heads=2)[1].sum()

    grads = mx.vmap(mx.grad(row_loss, argnums=(0, 1)), in_axes=(0, None))(xs, wm)
    for b in range(4):
        r = ref.depth_attention_vjp([s[b] for s in sources], q, None, None, num_heads=2,
                                    out_norm_weight=w, d_out_normed=np.ones((3, D)))
        for i in range(3):
            assert_close(f"d sources[{i}][{b}]", grads[0][i][b], r["sources"][i], grad=True)
        assert_close(f"d out_norm_weight[{b}]", grads[1][b], r["out_norm_weight"], grad=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_source_softmax(dtype):
    """N = 1 softmax: out is the source bitwise (C6); out_normed is rmsnorm(source) * w."""
    rng = np.random.default_rng(4)
    x, q, w = (rand(rng, BATCH + (D,), dtype, 3.0), rand(rng, (D,), dtype),
               rand(rng, (D,), dtype))
    out, normed = A.depth_attention([to_mx(x, dtype)], to_mx(q, dtype),
                                    out_norm_weight=to_mx(w, dtype), out_norm_eps=1e-5)
    assert mx.array_equal(out, to_mx(x, dtype)).item()
    rms = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w
    assert_close("out_normed", normed, rms, grad=False)


@pytest.mark.parametrize("magnitude", [1e19, 1e30])
def test_huge_out_is_normed_without_overflow(magnitude):
    """fp32 out beyond the range of its sum of squares (|y| >= ~1.8e19): out_normed and every
    gradient stay finite and right (the scaled-sum path of C17/C10.6)."""
    outs, grads = run("heads", "float32", False, seed=5, scale=magnitude)
    assert np.isfinite(to_np(outs[1])).all() and np.isfinite(to_np(grads[-1])).all()


def test_nonfinite_propagates():
    """C12: a NaN / inf in a source makes that token's out_normed row NaN (all D channels), as
    in the reference; other tokens are untouched."""
    rng = np.random.default_rng(6)
    sources = [rand(rng, (4, D), "float32") for _ in range(3)]
    sources[1][1, 2], sources[2][3, 0] = np.nan, np.inf
    q, w = rand(rng, (D,), "float32"), rand(rng, (D,), "float32")
    _, normed = A.depth_attention([to_mx(s, "float32") for s in sources], to_mx(q, "float32"),
                                  out_norm_weight=to_mx(w, "float32"))
    _, expect = ref.depth_attention(sources, q, out_norm_weight=w)
    assert np.isnan(to_np(normed)[[1, 3]]).all() and np.isfinite(to_np(normed)[[0, 2]]).all()
    assert_close("out_normed", normed, expect, grad=False)


def test_deterministic_and_inputs_unmodified():
    rng = np.random.default_rng(7)
    sources = [to_mx(rand(rng, BATCH + (D,), "float32"), "float32") for _ in range(3)]
    q, w = to_mx(rand(rng, (D,), "float32"), "float32"), to_mx(rand(rng, (D,), "float32"),
                                                                "float32")
    copies = [np.array(a) for a in sources + [q, w]]

    def loss(xs, q, w):
        out, normed = A.depth_attention(xs, q, out_norm_weight=w, num_heads=2)
        return (out * normed).sum()

    runs = [mx.value_and_grad(loss, argnums=(0, 1, 2))(sources, q, w) for _ in range(2)]
    mx.eval(runs)
    first, second = (mx.concatenate([v.reshape(-1), *(x.reshape(-1) for x in g[0]), g[1], g[2]])
                     for v, g in runs)
    assert mx.array_equal(first, second).item()
    for a, c in zip(sources + [q, w], copies):
        np.testing.assert_array_equal(np.array(a), c)


def test_errors():
    x = [mx.ones((2, D)), mx.ones((2, D))]
    q = mx.zeros((D,))
    with pytest.raises(ValueError, match=r"out_norm_weight: expected shape \[D\] = \(8,\)"):
        A.depth_attention(x, q, out_norm_weight=mx.ones((D + 1,)))
    with pytest.raises(TypeError, match="out_norm_weight: expected a floating dtype"):
        A.depth_attention(x, q, out_norm_weight=mx.ones((D,), dtype=mx.int32))
    with pytest.raises(TypeError, match="out_norm_weight: expected an mlx.core.array"):
        A.depth_attention(x, q, out_norm_weight=np.ones(D))
    with pytest.raises(ValueError, match="out_norm_eps: given .* while out_norm_weight is None"):
        A.depth_attention(x, q, out_norm_eps=1e-5)
    for bad, err in ((0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                     (True, TypeError), ("1e-5", TypeError)):
        with pytest.raises(err, match="out_norm_eps"):
            A.depth_attention(x, q, out_norm_weight=mx.ones((D,)), out_norm_eps=bad)


def test_dispatch_says_which_implementation_runs():
    """The automatic choice serves every out-norm call (Metal on Apple GPUs, else compiled;
    float64 always compiled), and `dispatch.last_choice` says which one did."""
    automatic = "metal" if dispatch.availability()["metal"] is None else "compiled"
    for dtype in DTYPES:
        with mx.stream(mx.cpu if dtype == "float64" else mx.default_stream(mx.default_device())):
            run("plain", dtype, False)
        assert dispatch.last_choice().impl == ("compiled" if dtype == "float64" else automatic)
    with dispatch.use_impl("compiled"):
        run("plain", "float32", False)
        assert dispatch.last_choice() == ("depth_attention", "compiled",
                                          (("metal", "not forced (use_impl('compiled'))"),))


def test_module_out_norm():
    """DepthAttention(fuse_out_norm=True) (as torch's): a `[D]` parameter out_norm initialized
    to ones, returning (out, out_normed) as the op does with it; its gradient reaches it."""
    layer = A.DepthAttention(D, num_heads=2, fuse_out_norm=True, out_norm_eps=1e-4)
    assert "out_norm" not in A.DepthAttention(D).parameters()
    with pytest.raises(ValueError, match="out_norm_eps: given while fuse_out_norm is False"):
        A.DepthAttention(D, out_norm_eps=1e-4)
    np.testing.assert_array_equal(to_np(layer.out_norm), np.ones(D))
    rng = np.random.default_rng(8)
    params = {k: to_mx(rand(rng, v.shape, "float32"), "float32")
              for k, v in layer.parameters().items()}
    layer.update(params)
    sources = [rand(rng, BATCH + (D,), "float32") for _ in range(3)]
    out, normed, lse = layer([to_mx(s, "float32") for s in sources], return_lse=True)
    p = {k: to_np(v) for k, v in params.items()}
    expect = ref.depth_attention(sources, p["query"], p["norm_weight"], num_heads=2,
                                 out_norm_weight=p["out_norm"], out_norm_eps=1e-4,
                                 return_lse=True)
    for name, a, r in zip(["out", "out_normed", "lse"], (out, normed, lse), expect):
        assert_close(name, a, r, grad=False)
    cot = rand(rng, BATCH + (D,), "float32")

    def loss(params):
        layer.update(params)
        return (layer([to_mx(s, "float32") for s in sources])[1] * to_mx(cot, "float32")).sum()

    grads = mx.grad(loss)(params)
    r = ref.depth_attention_vjp(sources, p["query"], p["norm_weight"], None, num_heads=2,
                                out_norm_weight=p["out_norm"], out_norm_eps=1e-4,
                                d_out_normed=cot)
    for name in ("query", "norm_weight"):
        assert_close(f"d {name}", grads[name], r[name], grad=True)
    assert_close("d out_norm", grads["out_norm"], r["out_norm_weight"], grad=True)
