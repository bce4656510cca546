"""The Transformer on DepthRouter: prefill + single-token decode (two-phase) vs the reference."""

import attnres_mlx as A
import attnres_numpy.model as ref_model
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from attnres_core.config import ResidualConfig
from helpers import assert_close, to_mx, to_np

V, D, BLOCKS, T = 11, 16, 3, 6


def _model(cfg):
    mx.random.seed(0)
    model = A.Transformer(cfg, vocab_size=V, dim=D, num_blocks=BLOCKS, num_heads=2)
    rng = np.random.default_rng(0)
    # Non-zero router parameters so that depth attention is not uniform.
    model.router.update({k: to_mx(rng.standard_normal(v.shape) * 0.5, "float32")
                         for k, v in model.router.parameters().items()})
    return model


def _reference_logits(model, cfg, tokens):
    """float64 reference schedule (`stack_forward`) driving the model's own sublayers (run in
    MLX float32 on the whole sequence, no cache), then final norm and head."""
    emb = to_np(model.embed(tokens))
    new_cache = [None] * BLOCKS
    subs = [lambda h, f=f: to_np(f(to_mx(h, "float32")))
            for f in model.sublayers(None, new_cache)]
    params = {k: to_np(v) for k, v in model.router.parameters().items()}
    out = ref_model.stack_forward(cfg, params, emb, subs)
    return to_np(model.head(model.norm(to_mx(out, "float32"))))


@pytest.mark.parametrize("schedule", ["direct", "two_phase"])
@pytest.mark.parametrize("block_size,fuse", [(2, False), (4, False), (2, True)])
def test_prefill_and_decode_match_reference(schedule, block_size, fuse):
    """fuse: M15, the router norms every sublayer input and the output with its own gains (the
    model then has no norms of its own; the reference's schedule applies M15 itself)."""
    cfg = ResidualConfig.variant("block", block_size=block_size, fuse_out_norm=fuse)
    model = _model(cfg)
    if fuse:
        assert isinstance(model.norm, nn.Identity) and "out_norm_weights" in model.router.parameters()
    tokens = mx.array(np.random.default_rng(1).integers(0, V, size=(2, T)))
    expect = _reference_logits(model, cfg, tokens)

    logits, cache = model(tokens[:, :3], schedule=schedule)
    steps = [logits]
    for t in range(3, T):  # single-token decode with the cached keys/values
        step, cache = model(tokens[:, t:t + 1], cache, schedule=schedule)
        steps.append(step)
    assert cache[0][0].shape[2] == T
    assert_close("logits", mx.concatenate(steps, axis=1), expect, grad=False, override="probe")


def test_full_forward_and_grad_run_for_every_kind():
    """A training step's gradient reaches the router parameters for the attention kinds."""
    tokens = mx.array(np.random.default_rng(2).integers(0, V, size=(2, T)))
    for name in ("full", "block", "window", "input_query", "multihead", "fused_out_norm"):
        model = _model(ResidualConfig.variant(name))

        def loss(params):
            model.update(params)
            logits, _ = model(tokens[:, :-1])
            return mx.mean(mx.logsumexp(logits, axis=-1) - mx.take_along_axis(
                logits, tokens[:, 1:, None], axis=-1)[..., 0])

        grads = mx.grad(loss)(model.trainable_parameters())
        router_grads = grads["router"]
        assert all(float(mx.abs(g).max()) > 0 for g in router_grads.values()), name


@pytest.mark.parametrize("variant,schedule", [("full", "direct"), ("block", "direct"),
                                              ("block", "two_phase"), ("standard", "direct")])
def test_fixed_cache_and_compiled_step_match_reference(variant, schedule):
    """make_cache + offset= (eager and under compile_step): prefill then single-token decode
    give the float64 reference's logits; the compiled step is traced once for every T = 1
    position (the offset is an array) and equals the eager fixed-cache step."""
    cfg = ResidualConfig.variant(variant)
    model = _model(cfg)
    tokens = mx.array(np.random.default_rng(1).integers(0, V, size=(2, T)))
    expect = _reference_logits(model, cfg, tokens)
    traces = []
    step = model.compile_step(schedule=schedule)
    traced = mx.compile(lambda t, c, o: (traces.append(1), model(t, c, offset=o,
                                                                 schedule=schedule))[1],
                        inputs=model.state)
    for run in (step, traced, None):
        cache = model.make_cache(2, T + 2)
        steps = []
        for t0, t1 in [(0, 3)] + [(t, t + 1) for t in range(3, T)]:
            chunk, off = tokens[:, t0:t1], mx.array(t0)
            logits, cache = (run(chunk, cache, off) if run is not None
                             else model(chunk, cache, offset=off, schedule=schedule))
            steps.append(logits)
        assert_close("logits", mx.concatenate(steps, axis=1), expect, grad=False,
                     override="probe")
    assert len(traces) == 2  # T = 3 prefill, then one trace for every T = 1 step
    with pytest.raises(ValueError, match="cache: offset= needs a fixed-size"):
        model(tokens[:, :1], None, offset=0)


@pytest.mark.parametrize("kind", ["full", "block"])
def test_transformer_observer_sees_every_read_with_the_reference_weights(kind):
    """`Transformer(..., observer=)` reaches the router: every depth read (L + 1 rows) is seen,
    and with `wants_weights` its weights are the float64 reference's weights of the same
    sources and query (MlxOps hands the ops' weights through)."""
    from attnres_core.schedule import ScheduleObserver
    from attnres_numpy import ops as ref_ops

    cfg = ResidualConfig.variant(kind, block_size=2) if kind == "block" else ResidualConfig.variant(kind)
    model = _model(cfg)

    class Seen(ScheduleObserver):
        wants_weights = True

        def __init__(self):
            self.rows, self.layers = [], []

        def depth_attention(self, row, labels, sources, weights):
            self.rows.append((row, [to_np(s) for s in sources], to_np(weights)))

        def sublayer(self, layer, h, v):
            self.layers.append(layer)

    seen = Seen()
    tokens = mx.array(np.random.default_rng(1).integers(0, V, (2, T)))
    model(tokens, observer=seen)
    L = 2 * BLOCKS
    assert seen.layers == list(range(1, L + 1))
    assert [r for r, _, _ in seen.rows] == list(range(L + 1))
    params = {k: to_np(v) for k, v in model.router.parameters().items()}
    for row, sources, weights in seen.rows:
        _, want = ref_ops.depth_attention(sources, params["queries"][row], params["norm_weights"][row],
                                          eps=cfg.eps, return_weights=True)
        assert weights.shape == want.shape and np.all(np.isfinite(weights))
        np.testing.assert_allclose(weights, want, rtol=2e-5, atol=2e-6, err_msg=f"row {row}")
