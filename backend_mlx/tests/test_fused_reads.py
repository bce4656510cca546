"""The router's fused small reads (`attnres_mlx.residual_ops.fusable`, `MlxOps(fused=True)`): the path
single-token decode takes on the CPU, checked against the float64 reference (values and every
gradient with a random cotangent), with overflowing and NaN sources, and that the path is taken
exactly where `fusable` says."""

import attnres_mlx as A
import attnres_numpy.model as ref_model
import attnres_numpy.ops as ref
import mlx.core as mx
import numpy as np
import pytest
from attnres_conformance.numerics import round_to
from attnres_conformance.tolerances import compare, flash_rule
from attnres_core.config import ResidualConfig
from attnres_mlx import ops, probe
from attnres_mlx.kernels import compiled
from attnres_mlx.residual_ops import MlxOps, RowCache, fusable
from helpers import assert_close, rand, to_mx, to_np

L, D = 5, 8
FUSABLE = ["full", "block", "window", "sigmoid", "shared_queries", "hybrid",
           "compressed_history", "fused_out_norm"]


@pytest.fixture
def reads(monkeypatch):
    """Counts the fused reads, phase-1 calls and merges, and the calls of the spec's ops."""
    seen = {"fused": 0, "multi": 0, "merge": 0, "ops": 0}

    def count(name, fn):
        def wrapped(*a, **kw):
            seen[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(MlxOps, "_fused_read", count("fused", MlxOps._fused_read))
    monkeypatch.setattr(MlxOps, "_fused_multi", count("multi", MlxOps._fused_multi))
    monkeypatch.setattr(MlxOps, "_fused_merge", count("merge", MlxOps._fused_merge))
    for name in ("depth_attention", "depth_attention_multi", "merge_partial"):
        monkeypatch.setattr(ops, name, count("ops", getattr(ops, name)))
    return seen


def _inputs(cfg, dtype, batch, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rand(rng, s, dtype, 0.5) for k, s in cfg.param_shapes(L, D).items()}
    emb = rand(rng, batch + (D,), dtype)
    w = rand(rng, (L, D, D), dtype, D ** -0.5)
    cot = rand(rng, batch + (D,), dtype)
    return params, emb, w, cot


def _check_out(out, expect, cfg, params, emb, w, dtype):
    if dtype in ("bfloat16", "float16"):  # as test_router: FlashAttention's rule for L layers
        c = compare("out", to_np(out), expect, dtype, grad=False, override="probe")
        if not c.ok:
            rounded = ref_model.stack_forward(cfg, params, emb, [
                lambda h, f=f: round_to(f(h), dtype)
                for f in ref_model.probe_sublayers(w, cfg.eps, prenorm=not cfg.fuse_out_norm)])
            c = flash_rule("out", c.err, rounded, expect, dtype)
        assert c.ok, c.message
    else:
        assert_close("out", out, expect, grad=False, override="probe")


@pytest.mark.parametrize("batch", [(2, 1), (1,), (), (2, 3)], ids=["B2xT1", "T1", "none", "2x3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("variant", FUSABLE)
def test_fused_probe_matches_reference(variant, dtype, batch, reads):
    """Every fusable variant, as decode tokens (a unit axis before D: the token's own row),
    without token axes and with two: the probe's value and every gradient of a random
    cotangent against the float64 reference, through the fused reads only."""
    cfg = ResidualConfig.variant(variant)
    params, emb, w, cot = _inputs(cfg, dtype, batch)
    mparams = {k: to_mx(v, dtype) for k, v in params.items()}
    assert fusable(cfg, to_mx(emb, dtype), L)
    out = probe.probe_forward(cfg, mparams, to_mx(emb, dtype), to_mx(w, dtype))
    assert out.dtype == to_mx(emb, dtype).dtype and out.shape == emb.shape
    _check_out(out, ref_model.probe_forward(cfg, params, emb, w), cfg, params, emb, w, dtype)
    assert reads["fused"] > 0 and reads["ops"] == 0
    grads = probe.probe_vjp(cfg, mparams, to_mx(emb, dtype), to_mx(w, dtype), to_mx(cot, dtype))
    expect = ref_model.probe_vjp(cfg, params, emb, w, cot)
    assert set(grads) == set(expect)
    for name in expect:
        assert_close(f"d {name}", grads[name], expect[name], grad=True, override="probe")
    assert reads["ops"] == 0


@pytest.mark.parametrize("num_layers,block_size", [(5, 2), (6, 3), (4, 1), (3, 5)])
@pytest.mark.parametrize("batch", [(2, 1), (2, 3)], ids=["T1", "2x3"])
def test_fused_two_phase_matches_reference(num_layers, block_size, batch, reads):
    """Two-phase (M9) on the fused reads: phase 1 per block and a merge per later sublayer,
    value and every gradient against the reference's direct schedule."""
    cfg = ResidualConfig.variant("block", block_size=block_size)
    rng = np.random.default_rng(1)
    params = {k: rand(rng, s, "float32", 0.5) for k, s in cfg.param_shapes(num_layers, D).items()}
    emb, cot = rand(rng, batch + (D,), "float32"), rand(rng, batch + (D,), "float32")
    w = rand(rng, (num_layers, D, D), "float32", D ** -0.5)
    mparams = {k: to_mx(v, "float32") for k, v in params.items()}
    args = (cfg, mparams, to_mx(emb, "float32"), to_mx(w, "float32"))
    out = probe.probe_forward(*args, schedule="two_phase")
    assert_close("out", out, ref_model.probe_forward(cfg, params, emb, w), grad=False,
                 override="probe")
    blocks = -(-num_layers // block_size)
    assert reads["multi"] == blocks and reads["merge"] == num_layers - blocks
    assert reads["ops"] == 0
    grads = probe.probe_vjp(*args, to_mx(cot, "float32"), schedule="two_phase")
    expect = ref_model.probe_vjp(cfg, params, emb, w, cot)
    for name in expect:
        assert_close(f"d {name}", grads[name], expect[name], grad=True, override="probe")


@pytest.mark.parametrize("as_array", [False, True])
def test_fused_mix_and_array_scale(as_array, reads):
    """M10 per-call inputs on the fused reads: a 0-d array scale multiplies the query (the
    reads then form qg from it rather than from the parameter table)."""
    cfg = ResidualConfig.variant("full")
    params, emb, w, cot = _inputs(cfg, "float32", (3, 1), seed=2)
    mparams = {k: to_mx(v, "float32") for k, v in params.items()}
    scale = mx.array(1.6) if as_array else 1.6
    kw = dict(mix=0.35, scale=scale)
    args = (cfg, mparams, to_mx(emb, "float32"), to_mx(w, "float32"))
    expect_kw = dict(mix=0.35, scale=1.6)
    assert_close("out", probe.probe_forward(*args, **kw),
                 ref_model.probe_forward(cfg, params, emb, w, **expect_kw), grad=False,
                 override="probe")
    grads = probe.probe_vjp(*args, to_mx(cot, "float32"), **kw)
    expect = ref_model.probe_vjp(cfg, params, emb, w, cot, **expect_kw)
    for name in expect:
        assert_close(f"d {name}", grads[name], expect[name], grad=True, override="probe")
    assert reads["fused"] == 2 * (L + 1) and reads["ops"] == 0  # the forward, the vjp's pass


def _fused_read(cfg, sources, q, g, *, partial=False, weights=False):
    """One read through `MlxOps(fused=True)`: sealed sources (the last one the running partial
    sum with `partial`), the query and gain as the parameter rows the schedule hands in."""
    m = MlxOps({"queries": q[None], "norm_weights": g[None]}, RowCache(), fused=True)
    sealed = sources[:-1] if partial else sources
    stats = [m.source_stats(s, cfg) for s in sealed] + ([None] if partial else [])
    return m.depth_attention(list(sources), stats, m.param("queries", 0),
                             m.param("norm_weights", 0), cfg, return_weights=weights)


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("magnitude", [1e20, 1e30, 1e37])
def test_fused_read_overflow_safe(magnitude, partial):
    """C10.6: float32 sources whose sum of squares overflows float32 keep their weights (the
    reference's on the same inputs), and out and every gradient stay finite and right."""
    cfg = ResidualConfig.variant("full")
    rng = np.random.default_rng(3)
    src = [rand(rng, (2, 1, D), "float32") for _ in range(4)]
    src[1] = round_to(src[1] * magnitude, "float32")
    q, g = rand(rng, (D,), "float32"), rand(rng, (D,), "float32")
    cot = rand(rng, (2, 1, D), "float32")
    xs = [to_mx(s, "float32") for s in src]
    (out, weights) = _fused_read(cfg, xs, to_mx(q, "float32"), to_mx(g, "float32"),
                                 partial=partial, weights=True)
    want_out, want_w = ref.depth_attention(src, q, g, eps=cfg.eps, return_weights=True)
    np.testing.assert_allclose(to_np(weights), want_w, rtol=2e-5, atol=2e-6)
    assert_close("out", out, want_out, grad=False)

    def f(*a):
        return _fused_read(cfg, list(a[:-2]), a[-2], a[-1], partial=partial)[0]

    _, grads = mx.vjp(f, [*xs, to_mx(q, "float32"), to_mx(g, "float32")], [to_mx(cot, "float32")])
    want = ref.depth_attention_vjp(src, q, g, cot, eps=cfg.eps)
    for i, (gi, wi) in enumerate(zip(grads, want["sources"])):
        assert_close(f"d sources[{i}]", gi, wi, grad=True)
    assert_close("d query", grads[-2], want["query"], grad=True)
    assert_close("d norm_weight", grads[-1], want["norm_weight"], grad=True)


def test_fused_read_nan_stays_in_its_token():
    """C12: a NaN in one token of one source makes that token's output NaN, no other's."""
    cfg = ResidualConfig.variant("full")
    rng = np.random.default_rng(4)
    src = [rand(rng, (3, 1, D), "float32") for _ in range(3)]
    src[2][1, 0, 3] = np.nan
    q, g = rand(rng, (D,), "float32"), rand(rng, (D,), "float32")
    for partial in (False, True):
        out = to_np(_fused_read(cfg, [to_mx(s, "float32") for s in src], to_mx(q, "float32"),
                                to_mx(g, "float32"), partial=partial)[0])
        assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()
        np.testing.assert_allclose(out[[0, 2]], ref.depth_attention(src, q, g)[[0, 2]],
                                   rtol=2e-5, atol=2e-6)


def test_fusable_conditions():
    """The fused reads apply to small key-normed single-head static-query passes in float16 /
    bfloat16 / float32 on the CPU; the spec's ops read everything else."""
    x = mx.zeros((1, 1, 128))
    full = ResidualConfig.variant("full")
    assert fusable(full, x, 16) and fusable(full, x.astype(mx.bfloat16), 16)
    assert not fusable(full, x.astype(mx.float64), 16)
    for name in ("multihead", "input_query", "no_key_norm", "low_rank_keys", "standard"):
        assert not fusable(ResidualConfig.variant(name), x, 16), name
    big = compiled.VECTOR_MAX_ELEMENTS // 128  # sources of the largest read, in tokens
    assert fusable(full, mx.zeros((big // 17, 128)), 16)
    assert not fusable(full, mx.zeros((big // 17 + 1, 128)), 16)


def test_fused_reads_off_and_float64_take_the_ops(reads):
    """`DepthRouter.fused_reads = False` (and float64, which the fused reads do not take) read
    through the spec's ops; both give the fused reads' result within the float32 tolerance."""
    cfg = ResidualConfig.variant("block", block_size=2)
    params, emb, w, _ = _inputs(cfg, "float32", (2, 1), seed=5)
    r = A.DepthRouter(cfg, L, D)
    r.update({k: to_mx(v, "float32") for k, v in params.items()})
    subs = [lambda h, i=i: mx.tanh(h @ to_mx(w[i], "float32")) for i in range(L)]
    x = to_mx(emb, "float32")
    fused = r(x, subs)
    assert reads["fused"] == L + 1 and reads["ops"] == 0
    r.fused_reads = False
    spec = r(x, subs)
    assert reads["ops"] == L + 1 and reads["fused"] == L + 1
    assert "fused_reads" not in r.parameters()
    expect = ref_model.stack_forward(cfg, params, emb,
                                     [lambda h, i=i: np.tanh(h @ w[i]) for i in range(L)])
    assert_close("fused", fused, expect, grad=False, override="probe")
    assert_close("ops", spec, expect, grad=False, override="probe")


def test_fused_reads_deterministic_and_table_follows_updates():
    """The same pass twice gives the same bits (the kept qg table included); replacing the
    parameters forms a new table, equal to a fresh router's."""
    cfg = ResidualConfig.variant("full")
    params, emb, w, _ = _inputs(cfg, "float32", (1, 1), seed=6)
    r = A.DepthRouter(cfg, L, D)
    r.update({k: to_mx(v, "float32") for k, v in params.items()})
    subs = [lambda h, i=i: mx.tanh(h @ to_mx(w[i], "float32")) for i in range(L)]
    x = to_mx(emb, "float32")
    first = r(x, subs)
    mx.eval(first)
    assert mx.array_equal(r(x, subs), first).item()
    new = {k: to_mx(v * 1.5, "float32") for k, v in params.items()}
    r.update(new)
    fresh = A.DepthRouter(cfg, L, D)
    fresh.update(new)
    assert mx.array_equal(r(x, subs), fresh(x, subs)).item()
    assert not mx.array_equal(r(x, subs), first).item()
