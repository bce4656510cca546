"""The fused output norm (C17, spec 2.6, issue 14 item 5): `depth_attention(...,
out_norm_weight=, out_norm_eps=)` on the XLA path and the Pallas kernels (interpret mode, tiny
shapes, NaN-poisoned outputs) against the float64 reference on upcast inputs, with random
cotangents on out, out_normed and lse, and the suite's tolerance table (`jax_helpers`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attnres_jax import depth_attention, dispatch
from attnres_jax.dispatch import Request
from attnres_jax.kernels import pallas as kernels
from attnres_jax.kernels import xla as _xla
from attnres_jax.kernels.pallas import Pallas
from attnres_numpy import ops as ref
from jax_helpers import DTYPES, assert_close, host_devices_env, precision, rounded

# The op's rounding, as users compile it (noxfile.py's tests-jax: not under its fast-compile XLA_FLAGS).
pytestmark = pytest.mark.xla_default_compile

PRECISION = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 0}


def _coarser(a: str, b: str) -> str:
    """The less precise of two dtypes (the tolerance a result computed through both is held to)."""
    return a if PRECISION[a] < PRECISION[b] else b


def _use(mode: str):
    """The block of a test mode: "xla", or the kernels in the generic ("interpret") or the TPU
    ("interpret_tpu") interpreter, tile 4, outputs poisoned (calls they cannot run: XLA)."""
    if mode == "xla":
        return dispatch.use_impl("xla")
    return dispatch.use_impl("auto", interpret={"interpret": True, "interpret_tpu": "tpu"}[mode], tile=4, poison=True)


def _case(rng, dtype, *, n=5, tokens=(2, 3), dim=8, heads=1, act="softmax", key_norm=True, per_token=False,
          stacked=False, lse=False, weights=False, eps_o=None, w_dtype=None, mode="xla", check_out=True):
    """Forward + VJP of depth_attention with the output norm under `_use(mode)`, compared
    with the reference: every output, and every gradient for random cotangents on out, out_normed
    (and lse).  Returns the jitted results (for the callers' extra checks)."""
    w_dtype = w_dtype or dtype
    ct = "float64" if dtype == "float64" else "float32"
    xs = [rounded(rng, tokens + (dim,), dtype) for _ in range(n)]
    q, q64 = rounded(rng, tokens + (dim,) if per_token else (dim,), dtype)
    g, g64 = rounded(rng, (dim,), dtype)
    w, w64 = rounded(rng, (dim,), w_dtype)
    src = jnp.stack([x for x, _ in xs]) if stacked else [x for x, _ in xs]
    src64 = np.stack([x for _, x in xs]) if stacked else [x for _, x in xs]
    kw = dict(num_heads=heads, activation=act, key_norm=key_norm, scale=0.8)
    okw = dict(kw, out_norm_eps=eps_o)

    def f(src, q, g, w):
        return depth_attention(src, q, g, return_lse=lse, return_weights=weights, out_norm_weight=w, **okw)

    with _use(mode):
        got, vjp = jax.vjp(jax.jit(f), src, q, g, w)
        d_out, d_out64 = rounded(rng, tokens + (dim,), dtype)
        d_nrm, d_nrm64 = rounded(rng, tokens + (dim,), dtype)
        d_lse = jnp.asarray(rng.standard_normal(got[2].shape), ct) if lse else None
        cots = (d_out, d_nrm) + ((d_lse,) if lse else ()) + ((jnp.zeros_like(got[-1]),) if weights else ())
        grads = vjp(cots)
    want = ref.depth_attention(src64, q64, g64, return_lse=lse, return_weights=weights, out_norm_weight=w64, **okw)
    assert len(got) == len(want) == 2 + lse + weights
    assert got[0].dtype == got[1].dtype == jnp.dtype(dtype)
    for i, (a, b) in enumerate(zip(got, want)):
        if i == 0 and not check_out:
            continue
        assert_close(a, b, dtype if i < 2 else ct, f"output {i}", grad=False)
    want_g = ref.depth_attention_vjp(src64, q64, g64, d_out64, None if d_lse is None else np.asarray(d_lse),
                                     out_norm_weight=w64, d_out_normed=d_nrm64, **okw)
    d_src, d_q, d_g, d_w = grads
    assert isinstance(d_src, list) != stacked
    assert_close(np.stack(d_src), np.stack(want_g["sources"]), dtype, "d_sources", grad=True)
    assert_close(d_q, want_g["query"], dtype, "d_query", grad=True)
    assert_close(d_g, want_g["norm_weight"], dtype, "d_norm_weight", grad=True)
    assert d_w.dtype == w.dtype and d_w.shape == (dim,)
    assert_close(d_w, want_g["out_norm_weight"], _coarser(w_dtype, dtype), "d_out_norm_weight", grad=True)
    return got, grads


# (heads, activation, key_norm, per-token query, stacked, lse, weights, out_norm_eps): every option
# on and off at least once.
OPTIONS = [
    (1, "softmax", True, False, False, True, True, None),
    (2, "softmax", True, True, True, True, False, 1e-3),
    (4, "sigmoid", False, False, False, False, True, None),
    (1, "sigmoid", True, True, True, False, False, 0.5),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(map(str, o)))
def test_xla_matches_reference(rng, dtype, options):
    heads, act, key_norm, per_token, stacked, lse, weights, eps_o = options
    with precision(dtype):
        kernels.CALLS.clear()
        _case(rng, dtype, heads=heads, act=act, key_norm=key_norm, per_token=per_token, stacked=stacked,
              lse=lse, weights=weights, eps_o=eps_o)
        assert not kernels.CALLS  # the XLA path ran


@pytest.mark.parametrize("dtype, w_dtype", [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "float64")])
def test_weight_in_its_own_dtype(rng, dtype, w_dtype):
    with precision(w_dtype if w_dtype == "float64" else dtype):
        _case(rng, dtype, w_dtype=w_dtype, lse=True)


@pytest.mark.parametrize("n, tokens, dim, stacked", [
    (_xla.UNROLL_MAX + 2, (3,), 8, True),  # vmapped per-source path
    (_xla.UNROLL_MAX + 2, (3,), 8, False),
    (2, (), 5, False),  # no token axes
    (3, (2, 1, 2), 7, True)])
def test_shapes(rng, n, tokens, dim, stacked):
    _case(rng, "float32", n=n, tokens=tokens, dim=dim, stacked=stacked, lse=True)


@pytest.mark.parametrize("mode", ["xla", "interpret"])
def test_single_source_softmax(rng, mode):
    """C6: N = 1 softmax returns the source bitwise; out_normed is rmsnorm(source) * w."""
    x, x64 = rounded(rng, (5, 8), "bfloat16")
    q, w = jnp.ones(8), jnp.asarray(rng.standard_normal(8), jnp.float32)
    with _use(mode):
        out, normed = jax.jit(lambda s, w: depth_attention(s, q, out_norm_weight=w))([x], w)
    assert out.dtype == jnp.bfloat16 and np.array_equal(np.asarray(out), np.asarray(x))
    want = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
    assert_close(normed, want, "bfloat16", "out_normed", grad=False)


# -- Pallas (interpret mode, tile 4 over T = 10 tokens: two full tiles and a partial one) ---------


@pytest.mark.parametrize("dtype, act, key_norm, per_token, eps_o", [
    ("float64", "softmax", True, False, None), ("bfloat16", "softmax", True, True, 1e-2),
    ("float32", "sigmoid", False, False, None), ("float16", "sigmoid", True, True, None)])
def test_pallas_kernels_match_reference(rng, dtype, act, key_norm, per_token, eps_o):
    with precision(dtype):
        kernels.CALLS.clear()
        _case(rng, dtype, n=3, tokens=(2, 5), act=act, key_norm=key_norm, per_token=per_token,
              lse=act == "softmax", weights=True, eps_o=eps_o, mode="interpret")
    assert set(kernels.CALLS) == {"attnres_forward_normed", "attnres_backward_normed"}


def test_pallas_under_the_tpu_interpreter(rng):
    kernels.CALLS.clear()
    _case(rng, "float32", n=3, tokens=(16,), lse=True, mode="interpret_tpu")
    assert set(kernels.CALLS) == {"attnres_forward_normed", "attnres_backward_normed"}


def test_pallas_multi_head_falls_back_to_xla_and_says_why(rng):
    xs = [jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) for _ in range(2)]
    q, w = jnp.ones(8), jnp.ones(8)
    kernels.CALLS.clear()
    with _use("interpret"):
        depth_attention(xs, q, num_heads=2, out_norm_weight=w)
        assert not kernels.CALLS
        with pytest.raises(ValueError, match=r"impl='pallas' cannot run .*num_heads=1"):
            depth_attention(xs, q, num_heads=2, out_norm_weight=w, impl="pallas")


def test_automatic_tile_counts_the_output_norm():
    base = Request("depth_attention", "gpu", "bfloat16", 4096, 1, 10, 1, False)
    plain = dispatch.select(None, base)
    fused = dispatch.select(None, base._replace(out_norm=True))
    assert isinstance(fused, Pallas) and isinstance(plain, Pallas) and fused.tile <= plain.tile


# -- transformations, numerics, errors ----------------------------------------------------------------


def test_grad_and_vmap(rng):
    """jax.grad of a loss over both outputs, vmapped over a leading batch axis of the sources."""
    xs, x64 = rounded(rng, (3, 4, 2, 8), "float32")  # [B, N, T, D]
    q, q64 = rounded(rng, (8,), "float32")
    w, w64 = rounded(rng, (8,), "float32")
    c1, c2 = rng.standard_normal((3, 2, 8)), rng.standard_normal((3, 2, 8))

    def one(s, q, w):
        out, normed = depth_attention(s, q, out_norm_weight=w, out_norm_eps=1e-4)
        return out, normed

    def loss(xs, q, w):
        out, normed = jax.vmap(one, in_axes=(0, None, None))(xs, q, w)
        return jnp.sum(out * c1) + jnp.sum(normed * c2)

    (out, normed) = jax.jit(jax.vmap(one, in_axes=(0, None, None)))(xs, q, w)
    d_x, d_q, d_w = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xs, q, w)
    want_q, want_w = np.zeros(8), np.zeros(8)
    for b in range(3):
        o64, n64 = ref.depth_attention(x64[b], q64, out_norm_weight=w64, out_norm_eps=1e-4)
        assert_close(out[b], o64, "float32", "out", grad=False)
        assert_close(normed[b], n64, "float32", "out_normed", grad=False)
        g = ref.depth_attention_vjp(x64[b], q64, None, c1[b], out_norm_weight=w64, out_norm_eps=1e-4,
                                    d_out_normed=c2[b])
        assert_close(d_x[b], g["sources"], "float32", "d_sources", grad=True)
        want_q, want_w = want_q + g["query"], want_w + g["out_norm_weight"]
    assert_close(d_q, want_q, "float32", "d_query", grad=True)
    assert_close(d_w, want_w, "float32", "d_out_norm_weight", grad=True)


def test_d_out_normed_alone(rng):
    """Only out_normed is used (d_out is zero): the gradients are the d_y prologue's."""
    xs, x64 = rounded(rng, (3, 4, 8), "float32")
    q, q64 = rounded(rng, (8,), "float32")
    w, w64 = rounded(rng, (8,), "float32")
    c = rng.standard_normal((4, 8))
    d_x, d_w = jax.grad(lambda xs, w: jnp.sum(depth_attention(xs, q, out_norm_weight=w)[1] * c), argnums=(0, 1))(xs, w)
    want = ref.depth_attention_vjp(x64, q64, None, None, out_norm_weight=w64, d_out_normed=c)
    assert_close(d_x, want["sources"], "float32", "d_sources", grad=True)
    assert_close(d_w, want["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)


@pytest.mark.parametrize("mode", ["xla", "interpret"])
def test_overflow_safe_and_nonfinite_tokens(rng, mode):
    """C10.6: sources of magnitude 1e20 (mean(out^2) overflows float32) keep a finite out_normed;
    C12: a NaN token stays NaN in that token only."""
    xs = rng.standard_normal((2, 5, 8))
    xs[:, 1] *= 1e20
    xs[0, 3, 2] = np.nan
    x = jnp.asarray(xs, jnp.float32)
    x64 = np.asarray(x, np.float64)
    q, w = jnp.asarray(rng.standard_normal(8), jnp.float32), jnp.asarray(rng.standard_normal(8), jnp.float32)
    with _use(mode):
        out, normed = jax.jit(lambda x, q, w: depth_attention(x, q, out_norm_weight=w))(x, q, w)
    want_out, want = ref.depth_attention(x64, np.asarray(q, np.float64), out_norm_weight=np.asarray(w, np.float64))
    assert np.all(np.isfinite(np.asarray(normed)[1])) and np.abs(np.asarray(out)[1]).max() > 1e19
    assert np.isnan(np.asarray(normed)[3]).all() and np.isfinite(np.delete(np.asarray(normed), 3, 0)).all()
    assert_close(normed, want, "float32", "out_normed", grad=False)
    assert_close(out, want_out, "float32", "out", grad=False)


def test_out_unchanged_by_the_option(rng):
    """C17: `out` is the same array with and without the output norm (same pass, same rounding)."""
    xs = [jnp.asarray(rng.standard_normal((3, 8)), jnp.bfloat16) for _ in range(4)]
    q = jnp.asarray(rng.standard_normal(8), jnp.float32)
    plain = jax.jit(lambda s: depth_attention(s, q))(xs)
    fused = jax.jit(lambda s: depth_attention(s, q, out_norm_weight=jnp.ones(8))[0])(xs)
    assert np.array_equal(np.asarray(plain, np.float32), np.asarray(fused, np.float32))


@pytest.mark.parametrize("mode", ["xla", "interpret"])
def test_deterministic_and_inputs_unmodified(rng, mode):
    xs = rng.standard_normal((3, 10, 8)).astype(np.float32)
    q, w = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    c1, c2 = rng.standard_normal((10, 8)), rng.standard_normal((10, 8))
    copies = [a.copy() for a in (xs, q, w)]

    def loss(xs, q, w):
        out, normed = depth_attention(xs, q, out_norm_weight=w)
        return jnp.sum(out * c1) + jnp.sum(normed * c2)

    with _use(mode):
        runs = [jax.grad(loss, argnums=(0, 1, 2))(xs, q, w) for _ in range(2)]
    for a, b in zip(*runs):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip((xs, q, w), copies):
        assert np.array_equal(a, b)


def test_errors():
    xs, q = [jnp.ones((2, 8))] * 2, jnp.ones(8)
    with pytest.raises(ValueError, match="out_norm_eps.*out_norm_weight"):
        depth_attention(xs, q, out_norm_eps=1e-3)
    with pytest.raises(ValueError, match="out_norm_weight"):
        depth_attention(xs, q, out_norm_weight=jnp.ones(7))
    with pytest.raises(TypeError, match="out_norm_weight"):
        depth_attention(xs, q, out_norm_weight=jnp.ones(8, jnp.int32))
    for bad, err in ((True, TypeError), (0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError)):
        with pytest.raises(err, match="out_norm_eps"):
            depth_attention(xs, q, out_norm_weight=jnp.ones(8), out_norm_eps=bad)


def test_module_fuse_out_norm(rng):
    """modules.DepthAttention(fuse_out_norm=True) owns `out_norm [D]` (ones) and returns
    (out, out_normed); its gradient is the reference's d_out_norm_weight."""
    from attnres_jax.modules import DepthAttention
    from flax import nnx

    xs, x64 = rounded(rng, (3, 4, 8), "float32")
    c1, c2 = rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    layer = DepthAttention(8, fuse_out_norm=True, out_norm_eps=1e-4)
    layer.query[...] = jnp.asarray(rng.standard_normal(8), jnp.float32)
    assert np.array_equal(np.asarray(layer.out_norm[...]), np.ones(8))
    out, normed = layer(xs)
    q64 = np.asarray(layer.query[...], np.float64)
    want = ref.depth_attention(x64, q64, np.ones(8), out_norm_weight=np.ones(8), out_norm_eps=1e-4)
    assert_close(out, want[0], "float32", "out", grad=False)
    assert_close(normed, want[1], "float32", "out_normed", grad=False)
    grads = nnx.grad(lambda m: jnp.sum(m(xs)[0] * c1) + jnp.sum(m(xs)[1] * c2))(layer)
    want_g = ref.depth_attention_vjp(x64, q64, np.ones(8), c1, out_norm_weight=np.ones(8), out_norm_eps=1e-4,
                                     d_out_normed=c2)
    assert_close(grads.out_norm[...], want_g["out_norm_weight"], "float32", "d_out_norm", grad=True)
    assert DepthAttention(8).out_norm is None and DepthAttention(8)(xs).shape == (4, 8)
    with pytest.raises(ValueError, match="out_norm_eps"):
        DepthAttention(8, out_norm_eps=1e-4)


SHARD_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from attnres_jax import depth_attention
from attnres_numpy import ops as ref
from jax_helpers import assert_close
mesh = Mesh(np.array(jax.devices()), ("seq",))
rng = np.random.default_rng(0)
xs = rng.standard_normal((3, 8, 16)).astype(np.float32)
q, w = (rng.standard_normal(16).astype(np.float32) for _ in range(2))
c1, c2 = rng.standard_normal((2, 8, 16)).astype(np.float32)

def local(xs, q, w, c1, c2):
    out, normed = depth_attention(xs, q, out_norm_weight=w)
    return jax.lax.psum(jnp.sum(out * c1) + jnp.sum(normed * c2), "seq")

tok = P(None, "seq", None)
f = jax.shard_map(local, mesh=mesh, in_specs=(tok, P(), P(), P("seq", None), P("seq", None)), out_specs=P())
dx, dq, dw = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(xs, q, w, c1, c2)
x64, q64, w64 = (a.astype(np.float64) for a in (xs, q, w))
want = ref.depth_attention_vjp(x64, q64, None, c1.astype(np.float64), out_norm_weight=w64,
                               d_out_normed=c2.astype(np.float64))
assert_close(dx, want["sources"], "float32", "d_sources", grad=True)
assert_close(dq, want["query"], "float32", "d_query", grad=True)
assert_close(dw, want["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)
print("SHARD-OK")
"""


def test_shard_map_gradient_of_the_replicated_gain():
    """Under shard_map over tokens, d_out_norm_weight of a replicated gain is the sum over the
    shards (`dispatch._like_primals`), equal to the reference's."""
    import os
    import subprocess
    import sys

    env = host_devices_env(4, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", SHARD_SCRIPT], capture_output=True, text=True, env=env, timeout=170)
    assert proc.returncode == 0 and "SHARD-OK" in proc.stdout, proc.stdout + proc.stderr
