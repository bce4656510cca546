"""DepthRouter / DepthAttention / probe network against `attnres_numpy.model`."""

import attnres_mlx as A
import attnres_numpy.model as ref_model
import attnres_numpy.ops as ref
import mlx.core as mx
import numpy as np
import pytest
from attnres_conformance.numerics import round_to
from attnres_conformance.tolerances import compare, flash_rule
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_mlx import ops, probe
from attnres_mlx.kernels import compiled
from attnres_mlx.residual_ops import MlxOps
from helpers import assert_close, rand, to_mx, to_np

L, D, BATCH = 5, 8, (2, 3)


def _probe_inputs(cfg, dtype, seed=0, num_layers=L):
    rng = np.random.default_rng(seed)
    params = {k: rand(rng, s, dtype, 0.5) for k, s in cfg.param_shapes(num_layers, D).items()}
    emb = rand(rng, BATCH + (D,), dtype)
    w = rand(rng, (num_layers, D, D), dtype, D ** -0.5)
    return rng, params, emb, w


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("variant", sorted(VARIANT_KINDS))
def test_probe_forward_and_vjp(variant, dtype):
    cfg = ResidualConfig.variant(variant)
    rng, params, emb, w = _probe_inputs(cfg, dtype)
    cot = rand(rng, BATCH + (D,), dtype)
    mparams = {k: to_mx(v, dtype) for k, v in params.items()}
    out = probe.probe_forward(cfg, mparams, to_mx(emb, dtype), to_mx(w, dtype))
    expect_out = ref_model.probe_forward(cfg, params, emb, w)
    if dtype == "bfloat16":
        # C10 rounds every sublayer output to bf16; over L layers that alone can exceed the
        # table (input_query: 0.051 vs 0.032).  FlashAttention's rule then bounds our error by
        # 2x that of the reference whose sublayer outputs are rounded the same way.
        rounded = ref_model.stack_forward(cfg, params, emb, [
            lambda h, f=f: round_to(f(h), dtype) for f in ref_model.probe_sublayers(w, cfg.eps, prenorm=not cfg.fuse_out_norm)])
        c = compare("out", to_np(out), expect_out, dtype, grad=False, override="probe")
        if not c.ok:
            c = flash_rule("out", c.err, rounded, expect_out, dtype)
        assert c.ok, c.message
    else:
        assert_close("out", out, expect_out, grad=False, override="probe")
    grads = probe.probe_vjp(cfg, mparams, to_mx(emb, dtype), to_mx(w, dtype), to_mx(cot, dtype))
    expect = ref_model.probe_vjp(cfg, params, emb, w, cot)
    assert set(grads) == set(expect)
    for name in expect:
        assert_close(f"d {name}", grads[name], expect[name], grad=True, override="probe")


@pytest.mark.parametrize("variant", ["full", "block", "multihead", "fused_out_norm"])
def test_probe_streamed_reads_forward_and_vjp(variant, monkeypatch):
    """Reads above `compiled.VECTOR_MAX_ELEMENTS` (forced here) take the list of sources with
    per-source inverse RMS and the streamed forward: values and every gradient vs float64."""
    monkeypatch.setattr(compiled, "VECTOR_MAX_ELEMENTS", 0)
    cfg = ResidualConfig.variant(variant)
    rng, params, emb, w = _probe_inputs(cfg, "float64")
    cot = rand(rng, BATCH + (D,), "float64")
    mparams = {k: to_mx(v, "float64") for k, v in params.items()}
    out = probe.probe_forward(cfg, mparams, to_mx(emb, "float64"), to_mx(w, "float64"))
    assert_close("out", out, ref_model.probe_forward(cfg, params, emb, w), grad=False,
                 override="probe")
    grads = probe.probe_vjp(cfg, mparams, to_mx(emb, "float64"), to_mx(w, "float64"),
                            to_mx(cot, "float64"))
    expect = ref_model.probe_vjp(cfg, params, emb, w, cot)
    for name in expect:
        assert_close(f"d {name}", grads[name], expect[name], grad=True, override="probe")


@pytest.mark.parametrize("num_layers,block_size", [(5, 2), (6, 3), (4, 1), (3, 5)])
def test_two_phase_equals_direct(num_layers, block_size):
    """Two-phase (phase 1 multi + merge) vs the reference's direct schedule, forward and VJP."""
    cfg = ResidualConfig.variant("block", block_size=block_size)
    rng, params, emb, w = _probe_inputs(cfg, "float64", 1, num_layers)
    cot = rand(rng, BATCH + (D,), "float64")
    mparams = {k: to_mx(v, "float64") for k, v in params.items()}
    out = probe.probe_forward(cfg, mparams, to_mx(emb, "float64"), to_mx(w, "float64"),
                              schedule="two_phase")
    assert_close("out", out, ref_model.probe_forward(cfg, params, emb, w), grad=False)
    grads = probe.probe_vjp(cfg, mparams, to_mx(emb, "float64"), to_mx(w, "float64"),
                            to_mx(cot, "float64"), schedule="two_phase")
    expect = ref_model.probe_vjp(cfg, params, emb, w, cot)
    for name in expect:
        assert_close(f"d {name}", grads[name], expect[name], grad=True)


@pytest.mark.parametrize("variant", sorted(VARIANT_KINDS))
def test_parameters_named_as_param_shapes(variant):
    cfg = ResidualConfig.variant(variant)
    router = A.DepthRouter(cfg, L, D)
    got = {k: tuple(v.shape) for k, v in router.parameters().items()}
    assert got == cfg.param_shapes(L, D)
    for name, value in cfg.init_params(L, D).items():
        np.testing.assert_array_equal(to_np(router[name]), value)


@pytest.mark.parametrize("kind", ["full", "block"])
def test_zero_init_equals_prenorm_after_final_norm(kind):
    """M8: with zero queries the depth weights are uniform, every h_l is a positive multiple of
    the standard residual stream, and PreNorm sublayers cannot tell: equal after a final norm."""
    eps = 1e-30
    cfg = ResidualConfig(kind=kind, block_size=2 if kind == "block" else None, eps=eps)
    base = ResidualConfig(kind="standard", eps=eps)
    _, _, emb, w = _probe_inputs(cfg, "float64", 2, 6)
    e, wm = to_mx(emb, "float64"), to_mx(w, "float64")
    out = probe.probe_forward(cfg, {k: to_mx(v, "float64") for k, v in
                                    cfg.init_params(6, D).items()}, e, wm)
    out_std = probe.probe_forward(base, {}, e, wm)
    normed, normed_std = ref_model.rmsnorm(to_np(out), eps), ref_model.rmsnorm(to_np(out_std), eps)
    np.testing.assert_allclose(normed, normed_std, rtol=1e-10, atol=1e-12)
    assert np.abs(to_np(out) - to_np(out_std)).max() > 1e-3  # not trivially the same stream


@pytest.mark.parametrize("stacked", [False, True], ids=["streamed", "stacked"])
def test_block_inverse_rms_computed_once_per_block(monkeypatch, stacked):
    """Each sealed block's inverse RMS is computed once and reused by every later read.  Small
    reads (stacked) also take the running partial sum's inverse RMS, once per read that has
    one (sublayers 2, 4, 6 of the direct schedule); large reads norm it inside the op."""
    cfg = ResidualConfig.variant("block", block_size=2)
    num_layers = 6
    _, params, emb, w = _probe_inputs(cfg, "float64", 3, num_layers)
    calls = []
    real = ops.inverse_rms

    def spy(x, **kw):
        calls.append(x.shape)
        return real(x, **kw)

    monkeypatch.setattr(ops, "inverse_rms", spy)
    if not stacked:
        monkeypatch.setattr(compiled, "VECTOR_MAX_ELEMENTS", 0)
    mparams = {k: to_mx(v, "float64") for k, v in params.items()}
    for schedule in ("direct", "two_phase"):
        calls.clear()
        out = probe.probe_forward(cfg, mparams, to_mx(emb, "float64"), to_mx(w, "float64"),
                                  schedule=schedule)
        partial_reads = 3 if stacked and schedule == "direct" else 0
        # b_0 and the three sealed blocks
        assert len(calls) == 1 + num_layers // 2 + partial_reads
        np.testing.assert_allclose(to_np(out), ref_model.probe_forward(cfg, params, emb, w),
                                   rtol=1e-12, atol=1e-12)


def test_router_read_equals_direct_op():
    """A schedule read through `MlxOps` with cached inverse RMS equals the op called directly on
    the sources."""
    cfg = ResidualConfig.variant("multihead")
    rng, params, emb, w = _probe_inputs(cfg, "float64", 4)
    router = A.DepthRouter(cfg, L, D, dtype=mx.float64)
    router.update({k: to_mx(v, "float64") for k, v in params.items()})
    srcs = [to_mx(rand(rng, BATCH + (D,), "float64"), "float64") for _ in range(3)]
    rms = [ops.inverse_rms(s, eps=cfg.eps, num_heads=2) for s in srcs[:2]] + [None]
    mlx_ops = MlxOps({"queries": router["queries"], "norm_weights": router["norm_weights"]})
    got, weights = mlx_ops.depth_attention(srcs, rms, mlx_ops.param("queries", 2),
                                           mlx_ops.param("norm_weights", 2), cfg,
                                           return_weights=False)
    assert weights is None
    direct = A.depth_attention(srcs, router["queries"][2], router["norm_weights"][2],
                               eps=cfg.eps, num_heads=2)
    np.testing.assert_allclose(to_np(got), to_np(direct), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("query", ["static", "input"])
def test_depth_attention_module(query):
    rng = np.random.default_rng(5)
    m = A.DepthAttention(D, num_heads=2, query=query, eps=1e-5)
    weight = rand(rng, (D,) if query == "static" else (D, D), "float32")
    gain = rand(rng, (D,), "float32")
    m.update({"query" if query == "static" else "query_weight": to_mx(weight, "float32"),
              "norm_weight": to_mx(gain, "float32")})
    sources = [rand(rng, BATCH + (D,), "float32") for _ in range(3)]
    q = weight if query == "static" else ref_model.rmsnorm(sources[-1], 1e-5) @ weight
    out = m([to_mx(s, "float32") for s in sources])
    assert_close("out", out, ref.depth_attention(sources, q, gain, eps=1e-5, num_heads=2),
                 grad=False)
    # return_lse / return_weights: keyword-only, as in depth_attention (conformance signatures.json)
    got = m([to_mx(s, "float32") for s in sources], return_lse=True, return_weights=True)
    want = ref.depth_attention(sources, q, gain, eps=1e-5, num_heads=2, return_lse=True,
                               return_weights=True)
    for name, g, w in zip(("out", "lse", "weights"), got, want):
        assert_close(name, g, w, grad=False)


def test_router_errors():
    cfg = ResidualConfig.variant("full")
    router = A.DepthRouter(cfg, 2, D)
    x = mx.zeros((2, D))
    with pytest.raises(ValueError, match="sublayers: expected L = 2 callables, got 1"):
        router(x, [lambda h: h])
    with pytest.raises(ValueError, match="schedule: 'two_phase' needs kind='block'"):
        router(x, [lambda h: h] * 2, schedule="two_phase")
    with pytest.raises(ValueError, match=r"embedding: expected shape \[..., 8\]"):
        router(mx.zeros((2, 4)), [lambda h: h] * 2)
    with pytest.raises(TypeError, match="config: expected a ResidualConfig"):
        A.DepthRouter(cfg.to_dict(), 2, D)


@pytest.mark.parametrize("variant,schedule,mix", [
    ("full", "direct", 0.35), ("block", "two_phase", 0.6), ("window", "direct", 0.0),
    ("input_query", "direct", 0.8)])
@pytest.mark.parametrize("as_array", [False, True])
def test_mix_and_scale_match_reference(variant, schedule, mix, as_array):
    """M10 per-call inputs (a float alpha and scale, or 0-d arrays as under mx.compile): value
    and every gradient against the float64 reference."""
    cfg = ResidualConfig.variant(variant)
    rng, params, emb, w = _probe_inputs(cfg, "float64")
    cot = rand(rng, BATCH + (D,), "float64")
    mparams = {k: to_mx(v, "float64") for k, v in params.items()}
    alpha = mx.array(mix, dtype=mx.float64) if as_array else mix
    scale = mx.array(1.6, dtype=mx.float64) if as_array else 1.6
    kw = dict(schedule=schedule, scale=1.6)
    mkw = dict(schedule=schedule, scale=scale)
    out = probe.probe_forward(cfg, mparams, to_mx(emb, "float64"), to_mx(w, "float64"), mix=alpha, **mkw)
    assert out.dtype == mx.float64
    np.testing.assert_allclose(to_np(out), ref_model.probe_forward(cfg, params, emb, w, mix=mix, **kw),
                               rtol=1e-11, atol=1e-12)
    grads = probe.probe_vjp(cfg, mparams, to_mx(emb, "float64"), to_mx(w, "float64"), to_mx(cot, "float64"),
                            mix=alpha, **mkw)
    expect = ref_model.probe_vjp(cfg, params, emb, w, cot, mix=mix, **kw)
    for name in expect:
        np.testing.assert_allclose(to_np(grads[name]), expect[name], rtol=1e-10, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("variant", ["full", "block"])
def test_scale_traces_under_compile(variant):
    """scale= as a 0-d input of an mx.compile'd pass (a temperature schedule's value) is traced,
    not frozen at the first value: each value gives the eager float pass's output."""
    cfg = ResidualConfig.variant(variant)
    rng, params, emb, w = _probe_inputs(cfg, "float32")
    router = A.DepthRouter(cfg, L, D)
    router.update({k: to_mx(v, "float32") for k, v in params.items()})
    subs = [lambda h, i=i: mx.tanh(h @ to_mx(w[i], "float32")) for i in range(L)]
    x = to_mx(emb, "float32")
    step = mx.compile(lambda x, s: router(x, subs, scale=s))
    outs = []
    for s in (0.5, 1.6, 3.0):
        got, want = step(x, mx.array(s)), router(x, subs, scale=s)
        np.testing.assert_allclose(to_np(got), to_np(want), rtol=1e-6, atol=1e-6)
        outs.append(to_np(got))
    assert np.abs(outs[0] - outs[2]).max() > 1e-3  # the scale reached the weights


def test_row_cache_follows_parameter_updates():
    """The router keeps the rows it cut from its parameters between calls (decode reads the same
    rows every token) and cuts fresh ones once a parameter is replaced (a training update); the
    cache is no parameter."""
    cfg = ResidualConfig.variant("full")
    rng, params, emb, w = _probe_inputs(cfg, "float32")
    router = A.DepthRouter(cfg, L, D)
    subs = [lambda h, i=i: mx.tanh(h @ to_mx(w[i], "float32")) for i in range(L)]
    x = to_mx(emb, "float32")
    router.update({k: to_mx(v, "float32") for k, v in params.items()})
    first = router(x, subs)
    row = router._rows._rows["queries", 0][1]
    assert mx.array_equal(router(x, subs), first).item()
    assert router._rows._rows["queries", 0][1] is row  # reused
    new = {k: to_mx(v * 1.5, "float32") for k, v in params.items()}
    router.update(new)
    fresh = A.DepthRouter(cfg, L, D)
    fresh.update(new)
    assert mx.array_equal(router(x, subs), fresh(x, subs)).item()
    assert not mx.array_equal(router(x, subs), first).item()
    assert set(router.parameters()) == set(cfg.param_shapes(L, D))


def test_probe_is_the_shared_one_and_checks_its_weights():
    """The probe's sublayers are `attnres_core.probe`'s on `MlxOps` (`probe.probe_sublayers`
    included); sublayer_weights not `[L, D, D]` raises naming it."""
    cfg = ResidualConfig.variant("fused_out_norm", eps=1e-3)
    _, _, emb, w = _probe_inputs(cfg, "float64")
    h, wm = to_mx(emb, "float64"), to_mx(w, "float64")
    with mx.stream(mx.cpu):
        fs = probe.probe_sublayers(wm, 1e-3, prenorm=False)
        np.testing.assert_allclose(to_np(fs[1](h)), np.tanh(emb @ w[1]), rtol=1e-14, atol=1e-15)
        fs = probe.probe_sublayers(wm, 1e-3)
        np.testing.assert_allclose(to_np(fs[1](h)), ref_model.probe_sublayers(w, 1e-3)[1](emb),
                                   rtol=1e-14, atol=1e-15)
        params = {k: to_mx(v, "float64") for k, v in cfg.init_params(L, D).items()}
        with pytest.raises(ValueError, match=r"sublayer_weights: expected shape \[L, D, D\] with "
                                             r"L >= 1 and D = 8, got shape \(5, 8, 4\)"):
            probe.probe_forward(cfg, params, h, wm[..., :4])
        with pytest.raises(TypeError, match="sublayer_weights"):
            probe.probe_forward(cfg, params, h, wm.astype(mx.int32))
        with pytest.raises(TypeError, match="config: expected a ResidualConfig"):
            probe.probe_forward(cfg.to_dict(), params, h, wm)
