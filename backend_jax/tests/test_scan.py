"""The layer-scanned stack (`scan_apply`, `Transformer(scan_layers=True)`), the masked read
(`depth_attention(num_valid=)`), traced per-call scales, remat policies and the NNX observer:
each against the float64 reference, values and every gradient with a random cotangent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ScheduleObserver
from attnres_jax import depth_attention, rmsnorm, scan_apply, stack_apply
from attnres_jax.modules import DepthRouter, Transformer
from attnres_jax.residual_ops import matmul
from attnres_jax.stack import remat_policy
from attnres_numpy import model as ref
from attnres_numpy import ops as ref_ops
from flax import nnx
from jax_helpers import precision

L, D = 5, 8
SCANNED = ["full", "block", "standard", "scalar", "gated", "input_query", "fused_out_norm", "multihead",
           "sigmoid", "no_key_norm", "shared_queries", "low_rank_keys"]


def _probe_layer(config):
    """The probe's sublayer as `f(W_l, h)` (spec section 6)."""
    prenorm = not config.fuse_out_norm  # M15: the stream hands the normed input
    return lambda w, h: jnp.tanh(matmul(rmsnorm(h, config.eps) if prenorm else h, w))


def _problem(rng, config, num_layers=L):
    params = {k: rng.standard_normal(s) for k, s in config.param_shapes(num_layers, D).items()}
    emb = rng.standard_normal((2, 3, D))
    w = rng.standard_normal((num_layers, D, D)) / np.sqrt(D)
    return params, emb, w, rng.standard_normal(emb.shape)


def _assert_grads(got, want, params):
    g_params, g_emb, g_w = got
    np.testing.assert_allclose(g_emb, want["embedding"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_w, want["sublayer_weights"], rtol=1e-10, atol=1e-12)
    for name in params:
        np.testing.assert_allclose(g_params[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("variant", SCANNED)
def test_scan_apply_matches_reference(rng, variant):
    config = ResidualConfig.variant(variant)
    params, emb, w, cot = _problem(rng, config)
    f = _probe_layer(config)
    with precision("float64"):
        def loss(params, emb, w):
            out = scan_apply(config, params, emb, [f], w)
            return jnp.sum(out * cot), out

        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(params, emb, w)
    np.testing.assert_allclose(out, ref.probe_forward(config, params, emb, w), rtol=1e-12, atol=1e-12)
    _assert_grads(grads, ref.probe_vjp(config, params, emb, w, cot), params)


@pytest.mark.parametrize("variant", ["full", "block"])
def test_scan_period_two_mix_and_remat_match_reference(rng, variant):
    """Two sublayers per scan step (L = 6 = 3 x 2), a traced mix, the recompute policy and one or
    three scan stages: the same function (M10 blend) as the reference's unrolled stream."""
    config = ResidualConfig.variant(variant, block_size=4) if variant == "block" else ResidualConfig.variant(variant)
    params, emb, w, cot = _problem(rng, config, num_layers=6)
    f = _probe_layer(config)
    pairs = w.reshape(3, 2, D, D)
    sublayers = [lambda p, h: f(p[0], h), lambda p, h: f(p[1], h)]
    want_out = ref.probe_forward(config, params, emb, w, mix=0.3)
    want = ref.probe_vjp(config, params, emb, w, cot, mix=0.3)
    for remat, stages in ((None, None), ("recompute", 1)):
        with precision("float64"):
            def loss(params, emb, pairs, alpha):
                out = scan_apply(config, params, emb, sublayers, pairs, mix=alpha, remat=remat, stages=stages)
                return jnp.sum(out * cot), out

            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
            (g_params, g_emb, g_pairs), out = step(params, emb, pairs, jnp.asarray(0.3))
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
        _assert_grads((g_params, g_emb, np.reshape(g_pairs, w.shape)), want, params)


def test_masked_read_is_the_prefix_read(rng):
    """num_valid = n: exactly the read of the first n rows; the masked rows (finite garbage)
    get weight 0 and gradient exactly 0, and no gradient flows from them."""
    with precision("float64"):
        buf = jnp.asarray(rng.standard_normal((6, 3, D)))
        q, g, cot = (jnp.asarray(rng.standard_normal(s)) for s in ((D,), (D,), (3, D)))
        for n in (1, 3, 6):
            def masked(buf, q, g):
                out, w = depth_attention(buf, q, g, num_valid=n, return_weights=True)
                return jnp.sum(out * cot), w

            def prefix(buf, q, g):
                return jnp.sum(depth_attention(buf[:n], q, g) * cot)

            (got, w), d_got = jax.jit(jax.value_and_grad(masked, argnums=(0, 1, 2), has_aux=True))(buf, q, g)
            want, d_want = jax.jit(jax.value_and_grad(prefix, argnums=(0, 1, 2)))(buf, q, g)
            traced = jax.jit(lambda buf, k: depth_attention(buf, q, g, num_valid=k))(buf, jnp.asarray(n))
            xs = np.asarray(buf)[:n]
            np.testing.assert_allclose(traced,
                                       ref_ops.depth_attention(list(xs), np.asarray(q), np.asarray(g)),
                                       rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
            assert np.all(np.asarray(w)[n:] == 0.0)
            np.testing.assert_allclose(d_got[0][:n], d_want[0][:n], rtol=1e-12, atol=1e-13)
            assert np.all(np.asarray(d_got[0])[n:] == 0.0)
            for a, b in zip(d_got[1:], d_want[1:]):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def test_masked_read_rejects_lists_and_pallas(rng):
    xs = [jnp.ones((2, D))] * 3
    with pytest.raises(ValueError, match="num_valid: needs the sources stacked"):
        depth_attention(xs, jnp.zeros(D), num_valid=2)
    with pytest.raises(ValueError, match="impl='pallas' cannot run a masked read"):
        depth_attention(jnp.stack(xs), jnp.zeros(D), num_valid=2, impl="pallas")
    with pytest.raises(ValueError, match="num_valid: expected an int or a 0-d integer array"):
        depth_attention(jnp.stack(xs), jnp.zeros(D), num_valid=jnp.ones(2, jnp.int32))


def test_scan_apply_rejects_unsupported():
    emb, w = jnp.ones((2, D)), jnp.ones((L, D, D))
    f = _probe_layer(ResidualConfig.variant("full"))
    config = ResidualConfig.variant("window")
    with pytest.raises(ValueError, match="config: the fixed-shape stream runs kinds"):
        scan_apply(config, config.init_params(L, D), emb, [f], w)
    full = ResidualConfig.variant("full")
    with pytest.raises(ValueError, match="layer_params: expected a pytree of arrays stacked"):
        scan_apply(full, full.init_params(L, D), emb, [f], (w, jnp.ones((L + 1, D))))
    with pytest.raises(ValueError, match="remat: expected one of"):
        remat_policy("sometimes")
    with pytest.raises(ValueError, match=r"stages: expected an int in \[1, 5\]"):
        scan_apply(full, full.init_params(L, D), emb, [f], w, stages=6)


@pytest.mark.parametrize("scanned", [False, True])
def test_traced_scale_one_compile_and_reference(rng, scanned):
    """A 0-d array scale traces under jit (one compile for every temperature), gives the
    reference's result with that scale, and is differentiable (central difference)."""
    config = ResidualConfig.variant("block")
    params, emb, w, cot = _problem(rng, config)
    f = _probe_layer(config)
    traces = []
    with precision("float64"):
        def run(params, emb, w, scale):
            traces.append(1)
            if scanned:
                return scan_apply(config, params, emb, [f], w, scale=scale)
            return stack_apply(config, params, emb, [lambda h, i=i: f(w[i], h) for i in range(L)], scale=scale)

        loss = jax.jit(lambda s: jnp.sum(run(params, emb, w, s) * cot))
        for s in (0.5, 2.0):
            out = jax.jit(run)(params, emb, w, jnp.asarray(s))
            np.testing.assert_allclose(out, ref.probe_forward(config, params, emb, w, scale=s),
                                       rtol=1e-12, atol=1e-12)
        assert len(traces) == 1
        d = jax.grad(lambda s: loss(s))(jnp.asarray(1.5))
        fd = (loss(jnp.asarray(1.5 + 1e-6)) - loss(jnp.asarray(1.5 - 1e-6))) / 2e-6
        np.testing.assert_allclose(d, fd, rtol=1e-6)
    with pytest.raises(ValueError, match="scale: expected a finite real number or None"):
        stack_apply(config, params, emb, [lambda h, i=i: f(w[i], h) for i in range(L)], scale=float("nan"))


@pytest.mark.parametrize("kind", ["full", "block"])
def test_transformer_scan_layers_equals_unrolled(rng, kind):
    """Same rngs, same weights: the scanned Transformer gives the unrolled one's logits and every
    gradient (float64), with random router parameters and a traced temperature."""
    config = ResidualConfig.variant(kind, block_size=2) if kind == "block" else ResidualConfig.variant(kind)
    tokens = jnp.asarray(rng.integers(0, 13, (2, 6)))
    with precision("float64"):
        models = [Transformer(config, vocab_size=13, dim=D, num_blocks=2, num_heads=2, rngs=nnx.Rngs(0),
                              scan_layers=s, param_dtype=jnp.float64) for s in (False, True)]
        router = {k: rng.standard_normal(v.shape) for k, v in models[0].router.params().items()}
        for m in models:
            m.router.load_params(router)
        cot = jnp.asarray(rng.standard_normal((2, 6, 13)))

        def loss(m, scale):
            out = m(tokens, scale=scale if config.is_attention else None)
            return jnp.sum(out * cot), out

        results = [nnx.jit(nnx.grad(loss, has_aux=True))(m, jnp.asarray(0.7)) for m in models]
    (g0, out0), (g1, out1) = results
    np.testing.assert_allclose(out1, out0, rtol=1e-12, atol=1e-12)
    for name in router:
        np.testing.assert_allclose(g1["router"][name][...], g0["router"][name][...], rtol=1e-10, atol=1e-12)
    flat0 = nnx.to_flat_state(nnx.state(g0))
    for path, var in nnx.to_flat_state(nnx.state(g1)):
        if path[0] != "blocks":
            continue
        block, sub = path[1], path[2:]
        for i in range(2):
            want = dict(flat0)[("sublayers", 2 * i + (block == "mlp")) + sub]
            np.testing.assert_allclose(var[...][i], want[...], rtol=1e-10, atol=1e-12, err_msg=str(path))
    assert models[1].blocks.attention.qkv.kernel.get_metadata()["out_sharding"] == (None, None, "model")


def test_transformer_scans_by_default_where_the_kind_allows():
    """scan_layers=None (the default) scans the kinds `scan_apply` runs (`SCAN_KINDS`, the one
    definition `checkpoint_hf` shares) and unrolls the others; True on such a kind is refused,
    naming scan_layers=False (construction only: nothing compiles)."""
    from attnres_jax import checkpoint_hf
    from attnres_jax.stack import SCAN_KINDS

    assert checkpoint_hf.SCAN_KINDS is SCAN_KINDS
    build = lambda config, **kw: Transformer(config, vocab_size=7, dim=D, num_blocks=2, num_heads=2,  # noqa: E731
                                             rngs=nnx.Rngs(0), **kw)
    for kind in SCAN_KINDS:
        model = build(ResidualConfig.variant(kind))
        assert model.scan_layers is True and model.blocks.mlp.up.kernel[...].shape[0] == 2, kind
    assert len(build(ResidualConfig.variant("full"), scan_layers=False).sublayers) == 4
    window = ResidualConfig(kind="window", window=2)
    model = build(window)
    assert model.scan_layers is False and len(model.sublayers) == 4
    with pytest.raises(ValueError, match=r"scheme 'window' runs unrolled \(scan_layers=False"):
        build(window, scan_layers=True)


@pytest.mark.parametrize("kind", ["full", "block"])
def test_transformer_scan_layers_with_a_monitor_and_two_phase(rng, kind):
    """The scanned Transformer (the default) takes a `DepthMonitor`'s observer inside nnx.jit:
    the statistics come out of the scan (issue 43 item 2: stacked over the steps, the program one
    block whatever L is) and equal the unrolled model's (same rngs, same weights; float32
    rounding), rows, labels and sublayers, as do the logits (a recorded gradient step:
    test_training's documented step).  schedule="two_phase" runs the stacked weights unrolled."""
    from attnres_jax import training as T

    config = ResidualConfig.variant(kind, block_size=3) if kind == "block" else ResidualConfig.variant(kind)
    tokens = jnp.asarray(rng.integers(0, 13, (2, 6)))
    models = [Transformer(config, vocab_size=13, dim=D, num_blocks=2, num_heads=2, rngs=nnx.Rngs(0),
                          scan_layers=s) for s in (False, None)]
    assert models[1].scan_layers
    router = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in models[0].router.params().items()}
    history = []
    for m in models:
        m.router.load_params(router)
        monitor = T.DepthMonitor(m.router)

        @nnx.jit
        def step(m, t):
            obs = monitor.observer()
            return m(t, observer=obs), obs.stats()

        logits, stats = step(m, tokens)
        history.append((logits, monitor.update(0, stats), stats))
    (l0, e0, s0), (l1, e1, s1) = history
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
    assert sorted(s1["rows"]) == sorted(s0["rows"]) == list(range(2 * 2 + 1))
    assert sorted(s1["sublayers"]) == sorted(s0["sublayers"]) == [1, 2, 3, 4]
    assert jax.tree.structure(s1) == jax.tree.structure(s0)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert [r["labels"] for r in e1["rows"]] == [r["labels"] for r in e0["rows"]]
    assert e1.keys() == e0.keys()
    if kind == "block":
        two = [nnx.jit(lambda m, t: m(t, schedule="two_phase"))(m, tokens) for m in models]
        np.testing.assert_allclose(two[1], two[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(two[1], l1, rtol=1e-4, atol=1e-5)


def test_the_recorded_scanned_step_is_one_block_whatever_the_depth():
    """The monitored scanned forward holds one block's sublayers (the statistics come out of the
    scan as its outputs): its jaxpr has as many matrix products at L = 8 as at L = 16 (Full: 4
    stages, one body each; traced, not compiled)."""
    from attnres_jax import training as T
    from jax.extend import core as jax_core

    def products(num_blocks):
        model = Transformer(ResidualConfig.variant("full"), vocab_size=13, dim=D, num_blocks=num_blocks,
                            num_heads=2, rngs=nnx.Rngs(0))
        monitor = T.DepthMonitor(model.router)
        graphdef, state = nnx.split(model)

        def forward(state, tokens):
            obs = monitor.observer()
            return nnx.merge(graphdef, state)(tokens, observer=obs), obs.stats()

        jaxpr = jax.make_jaxpr(forward)(state, jnp.zeros((1, 4), jnp.int32))

        def count(jaxpr):
            n = 0
            for eqn in jaxpr.eqns:
                n += eqn.primitive.name == "dot_general"
                for sub in jax_core.jaxprs_in_params(eqn.params):
                    n += count(sub)
            return n

        return count(jaxpr.jaxpr), len(monitor._labels)

    (small, rows8), (deep, rows16) = products(4), products(8)
    assert (rows8, rows16) == (9, 17)
    assert small == deep


class _Rows(ScheduleObserver):
    wants_weights = True

    def __init__(self):
        self.rows, self.layers = [], []

    def depth_attention(self, row, labels, sources, weights):
        self.rows.append((row, tuple(labels), weights.shape))

    def sublayer(self, layer, h, v):
        self.layers.append(layer)


def test_nnx_router_and_transformer_take_the_observer():
    config = ResidualConfig.variant("block", block_size=2)
    model = Transformer(config, vocab_size=7, dim=D, num_blocks=1, num_heads=2, rngs=nnx.Rngs(0))
    seen = _Rows()
    model(jnp.zeros((1, 3), jnp.int32), observer=seen)
    assert seen.layers == [1, 2]
    assert [r for r, _, _ in seen.rows] == [0, 1, 2]
    assert seen.rows[1][1] == ("b0", "partial") and seen.rows[1][2] == (2, 1, 3)
    router, seen = DepthRouter(config, 2, D), _Rows()
    router(jnp.ones((3, D)), [jnp.tanh, jnp.sin], observer=seen)
    assert seen.layers == [1, 2] and len(seen.rows) == 3


def _saved_bytes(fn, *args) -> int:
    """Bytes of the residuals a `jax.vjp` closure keeps (traced only, `jax.eval_shape`: their
    shapes, without running the forward op by op)."""
    leaves = jax.eval_shape(lambda *a: [x for x in jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1])
                                        if hasattr(x, "dtype")], *args)
    return sum(x.size * x.dtype.itemsize for x in leaves)


@pytest.mark.parametrize("remat", ["recompute", "offload"])
def test_remat_keeps_the_sources_and_the_function(rng, remat):
    """Unrolled under "recompute"/"offload": the residuals are the sources v_0..v_L, the weights
    and the router's parameters (within 10 %), against several times that without; the
    gradients are unchanged (float64, 1e-12)."""
    config = ResidualConfig.variant("full")
    n, t, hidden = 4, 64, 4 * D
    with precision("float64"):
        params = {k: jnp.asarray(v) for k, v in _problem(rng, config, n)[0].items()}
        emb = jnp.asarray(rng.standard_normal((t, D)))
        ws = tuple(jnp.asarray(rng.standard_normal(s) / 4) for s in ((n, D, hidden), (n, hidden, D)))

        def run(emb, ws, mode):
            layer = lambda i: lambda h: matmul(jax.nn.gelu(matmul(rmsnorm(h, 1e-6), ws[0][i])), ws[1][i])
            return stack_apply(config, params, emb, [layer(i) for i in range(n)], remat=mode)

        sources = (n + 1) * t * D * 8
        inputs = sum(x.size * 8 for x in jax.tree_util.tree_leaves((params, ws)))
        kept = _saved_bytes(lambda e, w: run(e, w, remat), emb, ws)
        assert sources + inputs <= kept <= 1.1 * (sources + inputs), (kept, sources, inputs)
        assert _saved_bytes(lambda e, w: run(e, w, None), emb, ws) > 3 * (sources + inputs)
        g = [jax.jit(jax.grad(lambda e, w: jnp.sum(run(e, w, m) ** 2), argnums=(0, 1)))(emb, ws)
             for m in (None, remat)]
    for a, b in zip(jax.tree_util.tree_leaves(g[0]), jax.tree_util.tree_leaves(g[1])):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def _scan_saved_bytes(config, params, emb, sublayers, layer_params, backward):
    return _saved_bytes(lambda e, p: scan_apply(config, params, e, sublayers, p, backward=backward, stages=1),
                        emb, layer_params)


@pytest.mark.heavy
@pytest.mark.parametrize("variant", ["full", "block"])
def test_replayed_backward_keeps_one_buffer(rng, variant):
    """backward="replay" (block's default): the forward keeps the final buffer, the layer weights and
    the per-step entries (block: the open partial row), O(L) rows, where lax.scan's own autodiff
    keeps a buffer per step (O(L^2)); both give the reference's gradients (float64, 1e-10).
    Measured at n = 16 (D = 8, 32 tokens): full 95 KB against 998 KB, block 70 KB against 400 KB."""
    n, t = 16, 32
    config = ResidualConfig.variant(variant, block_size=4) if variant == "block" else ResidualConfig.variant(variant)
    with precision("float64"):
        params, _, w, _ = _problem(rng, config, n)
        emb = jnp.asarray(rng.standard_normal((t, D)))
        f = _probe_layer(config)
        rows = n + 1 if variant == "full" else n // 4 + 1
        buffer = rows * t * D * 8
        weights = w.size * 8
        entries = 0 if variant == "full" else n * t * D * 8  # the partial row at each step's entry
        kept = _scan_saved_bytes(config, params, emb, [f], jnp.asarray(w), "replay")
        plain = _scan_saved_bytes(config, params, emb, [f], jnp.asarray(w), "scan")
        # the scan's final buffer and the output read's own copy of it, + small per-row stats
        assert kept <= 2 * buffer + weights + entries + 32 * 1024, (kept, buffer, weights, entries)
        assert plain > 2 * kept, (plain, kept)
        cot = rng.standard_normal((t, D))
        grads = {}
        for backward in ("replay", "scan"):
            def loss(params, emb, w):
                return jnp.sum(scan_apply(config, params, emb, [f], w, backward=backward) * cot)
            grads[backward] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, emb, w)
    want = ref.probe_vjp(config, params, np.asarray(emb), w, cot)
    for backward, got in grads.items():
        _assert_grads(got, want, params)


def test_replay_block_steps_across_block_boundaries_and_closures(rng):
    """Three sublayers per scan step with blocks of 4 (a step opens, continues and closes blocks)
    and sublayers that close over a traced gain c: values and gradients (c's too:
    d/dc = sum_l <dW_l, W_l> / c of the reference's probe with weights c W) are the reference's."""
    config = ResidualConfig.variant("block", block_size=4)
    params, emb, w, cot = _problem(rng, config, num_layers=6)
    c0 = 0.7
    want_out = ref.probe_forward(config, params, emb, w * c0)
    want = ref.probe_vjp(config, params, emb, w * c0, cot)
    f = _probe_layer(config)
    with precision("float64"):
        def loss(params, emb, triples, c):
            sublayers = [lambda p, h, j=j: f(p[j] * c, h) for j in range(3)]
            out = scan_apply(config, params, emb, sublayers, triples, mix=None)
            return jnp.sum(out * cot), out

        (g_params, g_emb, g_w, g_c), out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            params, emb, w.reshape(2, 3, D, D), jnp.asarray(c0))
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    want_w = want["sublayer_weights"]
    np.testing.assert_allclose(np.reshape(g_w, w.shape), want_w * c0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_c, np.sum(want_w * w), rtol=1e-10)
    np.testing.assert_allclose(g_emb, want["embedding"], rtol=1e-10, atol=1e-12)
    for name in params:
        np.testing.assert_allclose(g_params[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_scan_apply_rejects_an_unknown_backward(rng):
    config = ResidualConfig.variant("full")
    params, emb, w, _ = _problem(rng, config)
    with pytest.raises(ValueError, match="backward: expected one of"):
        scan_apply(config, params, emb, [_probe_layer(config)], w, backward="carry")
    with pytest.raises(ValueError, match="backward: expected one of"):
        scan_apply(config, params, emb, [_probe_layer(config)], w, backward=True)
    block = ResidualConfig.variant("block", block_size=2)  # replayed by default: remat still checked
    with pytest.raises(ValueError, match="remat: expected one of"):
        scan_apply(block, block.init_params(L, D), emb, [_probe_layer(block)], w, remat="bogus")
