"""Pallas kernels in interpret mode at tiny shapes vs the float64 reference.

Every call runs under `dispatch.use_impl("auto", interpret=True, tile=4, poison=True)`: T = 10
tokens give two full tiles and a partial one, and every output buffer starts NaN (aliased), so an
element a kernel never writes fails the comparison.  `kernels.CALLS` proves which kernels ran.
The last tests check the registry (`attnres_jax.dispatch`): the choice per call, the `impl=`
keyword, the ContextVar of `use_impl`, and the automatic choice for GPU/TPU requests (no device
needed).  The public contract itself is tested in `test_dispatch.py`.
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attnres_core.config import ResidualConfig
from attnres_jax import depth_attention, depth_attention_multi, dispatch, merge_partial, probe_forward
from attnres_jax.dispatch import Request
from attnres_jax.kernels import pallas as kernels
from attnres_jax.kernels.pallas import Pallas
from attnres_numpy import model as ref_model
from attnres_numpy import ops as ref
from jax.experimental import pallas as pl
from jax_helpers import assert_close, precision, rounded

pytestmark = pytest.mark.pallas
TOKENS, D = (2, 5), 8


def _interpret():
    kernels.CALLS.clear()
    return dispatch.use_impl("auto", interpret=True, tile=4, poison=True)


def _finite(tree):
    return all(bool(np.all(np.isfinite(np.asarray(a, np.float64)))) for a in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("activation, key_norm, per_token, dtype", [
    ("softmax", True, False, "float64"), ("softmax", True, False, "bfloat16"), ("softmax", False, True, "float32"),
    ("sigmoid", True, True, "float64"), ("sigmoid", False, False, "float16")])
def test_forward_and_backward_kernels(rng, dtype, activation, key_norm, per_token):
    lse = activation == "softmax"
    with precision(dtype):
        xs = [rounded(rng, TOKENS + (D,), dtype) for _ in range(3)]
        q, q64 = rounded(rng, TOKENS + (D,) if per_token else (D,), dtype)
        g, g64 = rounded(rng, (D,), dtype)
        kw = dict(activation=activation, key_norm=key_norm, scale=0.7)
        with _interpret():
            f = jax.jit(lambda s, q, g: depth_attention(s, q, g, return_lse=lse, return_weights=True, **kw))
            got, vjp = jax.vjp(f, [x for x, _ in xs], q, g)
            d_out, d_out64 = rounded(rng, TOKENS + (D,), dtype)
            d_lse = jnp.asarray(rng.standard_normal(TOKENS), got[1].dtype) if lse else None
            grads = vjp((d_out,) + ((d_lse,) if lse else ()) + (jnp.zeros_like(got[-1]),))
        assert set(kernels.CALLS) == {"attnres_forward", "attnres_backward"}
        assert _finite(got) and _finite(grads)
        src64 = [x for _, x in xs]
        want = ref.depth_attention(src64, q64, g64, return_lse=lse, return_weights=True, **kw)
        stat = "float64" if dtype == "float64" else "float32"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, dtype if i == 0 else stat, f"output {i}", grad=False)
        want_g = ref.depth_attention_vjp(src64, q64, g64, d_out64, None if d_lse is None else np.asarray(d_lse), **kw)
        assert_close(np.stack(grads[0]), np.stack(want_g["sources"]), dtype, "d_sources", grad=True)
        assert_close(grads[1], want_g["query"], dtype, "d_query", grad=True)
        assert_close(grads[2], want_g["norm_weight"], dtype, "d_norm_weight", grad=True)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_phase1_and_merge_kernels(rng, dtype):
    with precision(dtype):
        ct = "float64" if dtype == "float64" else "float32"
        xs = [rounded(rng, (10, D), dtype) for _ in range(3)]
        qs, qs64 = rounded(rng, (3, D), dtype)
        gs, gs64 = rounded(rng, (3, D), dtype)
        partial, p64 = rounded(rng, (10, D), dtype)
        with _interpret():
            out1, lse1 = jax.jit(depth_attention_multi)([x for x, _ in xs], qs, gs)
            merged = [jax.jit(lambda o, l, p, q, g: merge_partial(o, l, p, q, g, return_lse=True))(
                out1[k], lse1[k], partial, qs[k], gs[k]) for k in range(3)]
        assert set(kernels.CALLS) == {"attnres_phase1", "attnres_merge"}
        assert _finite((out1, lse1, merged))
        src64 = [x for _, x in xs]
        want_out, want_lse = ref.depth_attention_multi(src64, qs64, gs64)
        assert_close(out1, want_out, dtype, "phase-1 out", grad=False)
        assert_close(lse1, want_lse, ct, "phase-1 lse", grad=False)
        for k, (out, lse) in enumerate(merged):  # phase 2 == attention over sources + [partial]
            want = ref.depth_attention(src64 + [p64], qs64[k], gs64[k], return_lse=True)
            assert_close(out, want[0], dtype, "merged out", grad=False)
            assert_close(lse, want[1], ct, "merged lse", grad=False)


def test_merge_kernel_gradients_and_per_token_query(rng):
    with precision("float64"):
        o1, l1, p, q = (jnp.asarray(rng.standard_normal(s)) for s in ((10, D), (10,), (10, D), (10, D)))
        with _interpret():
            (out, lse), vjp = jax.vjp(lambda *a: merge_partial(*a, return_lse=True), o1, l1, p, q)
            d_out, d_lse = jnp.asarray(rng.standard_normal((10, D))), jnp.asarray(rng.standard_normal(10))
            grads = vjp((d_out, d_lse))
        assert set(kernels.CALLS) == {"attnres_merge"}
        np.testing.assert_allclose(out, ref.merge_partial(*map(np.asarray, (o1, l1, p, q))), atol=1e-12)
        want = ref.merge_partial_vjp(*map(np.asarray, (o1, l1, p, q)), None, np.asarray(d_out), np.asarray(d_lse))
        for name, value in zip(("out1", "lse1", "partial", "query"), grads):
            np.testing.assert_allclose(value, want[name], atol=1e-11)


def test_two_phase_probe_on_kernels(rng):
    config = ResidualConfig.variant("block", block_size=2)
    params = {k: rng.standard_normal(s) for k, s in config.param_shapes(4, D).items()}
    emb, w = rng.standard_normal((10, D)), rng.standard_normal((4, D, D)) / 3
    with precision("float64"), _interpret():
        out = jax.jit(lambda p, e, w: probe_forward(config, p, e, w, schedule="two_phase"))(params, emb, w)
    assert kernels.CALLS["attnres_phase1"] >= 1 and kernels.CALLS["attnres_merge"] >= 1
    np.testing.assert_allclose(out, ref_model.probe_forward(config, params, emb, w), atol=1e-11)


def test_backward_kernel_is_deterministic(rng):
    xs = [jnp.asarray(rng.standard_normal((37, D)), jnp.float32) for _ in range(5)]
    q = jnp.asarray(rng.standard_normal(D), jnp.float32)
    with _interpret():
        step = jax.jit(jax.grad(lambda xs, q: jnp.sum(depth_attention(xs, q) ** 3), argnums=(0, 1)))
        first, second = step(xs, q), step(xs, q)
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("per_token", [False, True])
def test_kernels_under_the_tpu_interpreter(rng, per_token):
    """TPU semantics (memory spaces, block rules) through `pltpu.InterpretParams` on CPU, at
    TPU-legal tiles: 8 token rows x the full D = 128 lane dimension, T = 24 (three tiles)."""
    tokens, dim = (24,), 128
    with precision("float32"):
        xs = [rounded(rng, tokens + (dim,), "float32") for _ in range(3)]
        q, q64 = rounded(rng, tokens + (dim,) if per_token else (dim,), "float32")
        g, g64 = rounded(rng, (dim,), "float32")
        qs, qs64 = rounded(rng, (2, dim), "float32")
        d_out, d_out64 = rounded(rng, tokens + (dim,), "float32")
        kernels.CALLS.clear()
        with dispatch.use_impl("auto", interpret="tpu", tile=8, poison=True):
            (out, lse), vjp = jax.vjp(lambda s, q, g: depth_attention(s, q, g, return_lse=True),
                                      [x for x, _ in xs], q, g)
            d_src, d_q, d_g = vjp((d_out, jnp.zeros_like(lse)))
            out1, lse1 = depth_attention_multi([x for x, _ in xs[:2]], qs, None)
            merged = merge_partial(out1[0], lse1[0], xs[2][0], qs[0], None)
    assert set(kernels.CALLS) == {"attnres_forward", "attnres_backward", "attnres_phase1", "attnres_merge"}
    src64 = [x for _, x in xs]
    assert_close(out, ref.depth_attention(src64, q64, g64), "float32", "out", grad=False)
    want = ref.depth_attention_vjp(src64, q64, g64, d_out64)
    assert_close(np.stack(d_src), np.stack(want["sources"]), "float32", "d_sources", grad=True)
    assert_close(d_q, want["query"], "float32", "d_query", grad=True)
    assert_close(d_g, want["norm_weight"], "float32", "d_norm_weight", grad=True)
    assert_close(merged, ref.depth_attention(src64, qs64[0]), "float32", "phase 1 + merge", grad=False)


def test_poison_catches_an_unwritten_tile():
    """The harness itself: a body that skips the last tile leaves NaN there."""
    def body(ins, outs):
        @pl.when(pl.program_id(0) < 2)
        def _():
            outs[0][...] = ins[0][...]

    x = jnp.ones((10, D), jnp.float32)
    spec = pl.BlockSpec((4, D), lambda t: (t, 0))
    (out,) = kernels._call(body, "skip_last_tile", [x], [spec], [jax.ShapeDtypeStruct((10, D), jnp.float32)],
                           [spec], 10, 4, interpret=True, poison=True)
    assert np.all(np.isfinite(out[:8])) and np.all(np.isnan(out[8:]))


# -- the packed statistics `[T, K]` (kernels.Columns): every element written, each column right ----

EPS, SCALE = 1e-6, 0.7


def _stats_reference(xs, qg):
    """float64: r `[T, N]` (spec 2.1: 1 / sqrt(mean x^2 + eps)) and s `[T, N, S]` (<x_i, qg_k>)."""
    r = np.stack([1.0 / np.sqrt(np.mean(x * x, axis=1) + EPS) for x in xs], axis=1)
    return r, np.stack([x @ qg.T for x in xs], axis=1)


def _packed(columns, t, groups):
    """The `[T, K]` the kernel must write: groups name -> `[T, count]`, pad columns exactly zero."""
    want = np.zeros((t, columns.width))
    for name, value in groups.items():
        want[:, columns.col(name):columns.col(name) + value.shape[1]] = value
    return want


def _logsumexp(z, axis):
    m = np.max(z, axis=axis, keepdims=True)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(z - m), axis=axis))


@pytest.mark.parametrize("softmax", [True, False])
def test_forward_writes_every_statistics_column(rng, softmax):
    """Poisoned (NaN) `[T, K]` output, T = 10 in tiles of 4: every element comes back written,
    pads 0, lse / r_i / s_i where `forward_columns` says (K = 8: 7 or 6 used)."""
    n, t = 3, 10
    xs, qg = [rng.standard_normal((t, D)) for _ in range(n)], rng.standard_normal((1, D))
    with precision("float64"):
        _, stats, _ = kernels.forward([jnp.asarray(x) for x in xs], jnp.asarray(qg), per_token=False, eps=EPS,
                                      scale=SCALE, softmax=softmax, key_norm=True, tb=4, ct=jnp.float64,
                                      interpret=True, poison=True)
    columns = kernels.forward_columns(n, softmax)
    r, s = _stats_reference(xs, qg)
    groups = dict(r=r, s=s[..., 0])
    if softmax:
        groups["lse"] = _logsumexp(SCALE * r * s[..., 0], axis=1)[:, None]
    assert stats.shape == (t, 8)
    np.testing.assert_allclose(np.asarray(stats), _packed(columns, t, groups), rtol=1e-12, atol=0)


def test_phase1_and_merge_write_every_statistics_column(rng):
    """As above for phase 1 (N = 3, S = 3: 15 columns in K = 16, s row-major) and the merge (lse,
    r, s, w1 in K = 4; spec 3.2: w1 = sigmoid(lse1 - z2))."""
    n, sets, t = 3, 3, 10
    xs, qg = [rng.standard_normal((t, D)) for _ in range(n)], rng.standard_normal((sets, D))
    lse1, partial = rng.standard_normal((t, 1)), rng.standard_normal((t, D))
    kw = dict(eps=EPS, scale=SCALE, tb=4, ct=jnp.float64, interpret=True, poison=True)
    with precision("float64"):
        _, stats = kernels.phase1([jnp.asarray(x) for x in xs], jnp.asarray(qg), **kw)
        _, merged = kernels.merge(jnp.asarray(partial), jnp.asarray(lse1), jnp.asarray(partial),
                                  jnp.asarray(qg[:1]), per_token=False, **kw)
    r, s = _stats_reference(xs, qg)
    want = _packed(kernels.phase1_columns(n, sets), t, dict(
        lse=_logsumexp(SCALE * r[..., None] * s, axis=1), r=r, s=s.reshape(t, n * sets)))
    assert stats.shape == (t, 16)
    np.testing.assert_allclose(np.asarray(stats), want, rtol=1e-12, atol=0)
    r2, s2 = (a[:, :1] for a in _stats_reference([partial], qg[:1]))
    z2 = SCALE * r2 * s2[..., 0]
    want = _packed(kernels.MERGE_COLUMNS, t, dict(lse=np.logaddexp(lse1, z2), r=r2, s=s2[..., 0],
                                                  w1=1.0 / (1.0 + np.exp(z2 - lse1))))
    assert merged.shape == (t, 4)
    np.testing.assert_allclose(np.asarray(merged), want, rtol=1e-12, atol=0)


def test_columns_layout():
    """Groups in order, K the used count padded to a power of two; pack / unpack invert each other."""
    columns = kernels.backward_columns(9, softmax=True)  # d_lse, p_0..8, r_0..8, s_0..8
    assert (columns.col("d_lse"), columns.col("p", 0), columns.col("r", 0), columns.col("s", 8)) == (0, 1, 10, 27)
    assert (columns.used, columns.width) == (28, 32)
    assert kernels.forward_columns(9, softmax=False).col("r", 0) == 0
    assert [kernels.phase1_columns(8, s).width for s in (1, 12)] == [32, 128]  # 17, 116 used
    with pytest.raises(IndexError):
        columns.col("p", 9)
    parts = {name: jnp.arange(10 * count, dtype=jnp.float32).reshape(10, count) + c
             for c, (name, count) in enumerate(columns.groups)}
    packed = columns.pack(jnp.float32, parts)
    assert packed.shape == (10, 32) and not np.any(np.asarray(packed[:, 28:]))
    for name, value in columns.unpack(packed).items():
        np.testing.assert_array_equal(value, parts[name])


def test_cpu_auto_mode_uses_xla(rng):
    kernels.CALLS.clear()
    xs = [jnp.asarray(rng.standard_normal((4, D)), jnp.float32) for _ in range(3)]
    jax.grad(lambda q: jnp.sum(depth_attention(xs, q)))(jnp.ones(D))
    assert jax.default_backend() != "cpu" or not kernels.CALLS
    with dispatch.use_impl("auto", interpret=True):  # multi-head calls stay on XLA under "auto"
        depth_attention(xs, jnp.ones(D), num_heads=2)
    assert not kernels.CALLS


# -- dispatch: the choice is made per call, kept by the custom VJP, never read from a global -------


def test_backward_runs_the_implementation_the_forward_chose(rng):
    """The implementation is a static argument of the custom VJP: a vjp built inside the block
    runs the backward kernel even when its backward is traced after the block has closed."""
    xs = [jnp.asarray(rng.standard_normal((10, D)), jnp.float32) for _ in range(3)]
    q = jnp.asarray(rng.standard_normal(D), jnp.float32)
    with _interpret():
        out, vjp = jax.vjp(lambda xs, q: depth_attention(xs, q), xs, q)
    assert set(kernels.CALLS) == {"attnres_forward"}
    d_xs, d_q = vjp(jnp.ones_like(out))
    assert set(kernels.CALLS) == {"attnres_forward", "attnres_backward"}
    want = ref.depth_attention_vjp([np.asarray(x, np.float64) for x in xs], np.asarray(q, np.float64), None,
                                   np.ones((10, D)))
    assert_close(np.stack(d_xs), np.stack(want["sources"]), "float32", "d_sources", grad=True)
    assert_close(d_q, want["query"], "float32", "d_query", grad=True)


def test_impl_keyword_wins_over_the_block_and_keys_the_trace(rng):
    xs = [jnp.asarray(rng.standard_normal((10, D)), jnp.float32) for _ in range(3)]
    q = jnp.asarray(rng.standard_normal(D), jnp.float32)
    f = jax.jit(lambda xs, q, impl: depth_attention(xs, q, impl=impl), static_argnums=2)
    with _interpret():
        xla = jax.grad(lambda q: jnp.sum(f(xs, q, "xla")))(q)
        assert not kernels.CALLS
        kernel = jax.grad(lambda q: jnp.sum(f(xs, q, None)))(q)
        assert set(kernels.CALLS) == {"attnres_forward", "attnres_backward"}
        kernels.CALLS.clear()
        depth_attention_multi(xs, jnp.stack([q, q]), impl="xla")
        merge_partial(xs[0], jnp.zeros(10), xs[1], q, impl="xla")
        assert not kernels.CALLS
    assert_close(kernel, xla, "float32", "d_query", grad=True)


def test_impl_pallas_where_the_kernels_cannot_run_raises(rng):
    xs = [jnp.ones((4, D), jnp.float32)] * 2
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="impl='pallas' cannot run this depth_attention call: no compiled"):
            depth_attention(xs, jnp.ones(D), impl="pallas")
    with _interpret(), pytest.raises(ValueError, match="one head"):
        depth_attention(xs, jnp.ones(D), num_heads=2, impl="pallas")
    with pytest.raises(ValueError, match="impl: expected None or one of"):
        merge_partial(xs[0], jnp.zeros(4), xs[1], jnp.ones(D), impl="triton")
    with _interpret():  # the interpreter runs what the block asked for
        depth_attention(xs, jnp.ones(D), impl="pallas")
    assert set(kernels.CALLS) == {"attnres_forward"}


def test_forced_mode_lives_in_the_callers_context(rng):
    """`use_impl` sets a ContextVar, not a process global: a call made in another context inside the
    block (another thread's or asyncio task's) makes its own automatic choice."""
    xs = [jnp.asarray(rng.standard_normal((4, D)), jnp.float32) for _ in range(2)]
    with _interpret():
        contextvars.Context().run(depth_attention, xs, jnp.ones(D))
        assert not kernels.CALLS or jax.default_backend() != "cpu"
        depth_attention(xs, jnp.ones(D))
    assert kernels.CALLS["attnres_forward"] == (1 if jax.default_backend() == "cpu" else 2)


def _request(platform, dtype="float32", dim=128, num_heads=1, num_sources=9, num_sets=1):
    return Request("depth_attention", platform, dtype, dim, num_heads, num_sources, num_sets, False)


@pytest.mark.parametrize("request_, want", [
    (_request("cpu"), None),
    (_request("gpu"), Pallas(tile=32, num_warps=16, platform="gpu")),  # a [32, 128] tile, 8 per thread
    (_request("gpu", dim=8, num_sets=1), Pallas(tile=64, num_warps=2, platform="gpu")),
    (_request("gpu", num_sets=2), None),  # phase 1: no slice primitive in the Triton lowering
    (_request("gpu", dim=96), None),  # Triton blocks: powers of two
    (_request("gpu", dim=16384), None),  # one row spills the registers (sm_90 compile)
    (_request("gpu", dtype="float64"), None),  # C10: float64 computes in float64
    (_request("tpu", dtype="bfloat16", dim=4096, num_sources=40), Pallas(tile=8, platform="tpu")),
    (_request("tpu", num_heads=2), None),
])
def test_automatic_choice_by_platform_dtype_and_shape(request_, want):
    got = dispatch.select(None, request_)
    assert got == (dispatch.REGISTRY["xla"] if want is None else want)
    with dispatch.use_impl("xla"):
        assert dispatch.select(None, request_) == dispatch.REGISTRY["xla"]
    with dispatch.use_impl("auto", interpret="tpu", tile=16, poison=True):
        forced = dispatch.select(None, request_)
    assert forced == (dispatch.REGISTRY["xla"] if request_.num_heads > 1 else
                      Pallas(interpret="tpu", tile=16, poison=True, platform=request_.platform))
    hash(got), hash(forced)  # static arguments of the custom VJP


def test_use_impl_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match=r"use_impl: expected 'auto' or one of \('pallas', 'xla'\), got 'triton'"):
        with dispatch.use_impl("triton"):
            pass
    with pytest.raises(ValueError, match="tile: expected an int >= 1"):
        with dispatch.use_impl("pallas", interpret=True, tile=0):
            pass
    with pytest.raises(ValueError, match="interpret: expected False, True or 'tpu'"):
        with dispatch.use_impl("auto", interpret="generic"):
            pass
    with pytest.raises(TypeError, match="unknown option"):
        with dispatch.use_impl("pallas", tiles=4):
            pass
    with pytest.raises(TypeError, match="'xla' takes no options"):
        with dispatch.use_impl("xla", tile=4):
            pass
