"""Bad input raises ValueError / TypeError naming the argument (spec "Errors", C1-C14); inputs are
never modified; NaN / Inf propagate without raising (C12)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from attnres_numpy import (
    ResidualConfig,
    depth_attention,
    depth_attention_multi,
    depth_attention_multi_vjp,
    depth_attention_vjp,
    merge_partial,
    merge_partial_vjp,
    ops,
    probe_forward,
    probe_sublayers,
    probe_vjp,
    stack_forward,
)

D = 4
X = np.arange(2 * 3 * D, dtype=np.float64).reshape(2, 3, D) / 10.0  # N = 2 sources [3, D]
Q = np.linspace(-1, 1, D)
G = np.linspace(0.5, 1.5, D)
ROW = np.ones((3, D))

# (call, error type, message start).  Every call goes through a public op.
DA_ERRORS = [
    (lambda: depth_attention([], Q), ValueError, "sources: expected N >= 1"),
    (lambda: depth_attention(np.zeros((0, 3, D)), Q), ValueError, "sources: expected N >= 1"),
    (lambda: depth_attention(np.zeros(3), Q), ValueError, "sources: a stacked array"),
    (lambda: depth_attention([np.float64(1.0)], Q), ValueError, r"sources\[0\]: expected shape"),
    (lambda: depth_attention([ROW, np.ones((2, D))], Q), ValueError, r"sources\[1\]: shape"),
    (lambda: depth_attention([np.ones((3, 0))], np.ones(0)), ValueError, "sources: expected D >= 1"),
    (lambda: depth_attention([ROW.astype(np.int64)], Q), TypeError, r"sources\[0\]: expected a floating"),
    (lambda: depth_attention([ROW, ROW.astype(np.float32)], Q), TypeError, "sources: all sources must share"),
    (lambda: depth_attention([ROW, ROW.astype(bool)], Q), TypeError, r"sources\[1\]: expected a floating"),
    (lambda: depth_attention("abc", Q), TypeError, "sources: expected a sequence"),
    (lambda: depth_attention(X.astype(np.complex64), Q), TypeError, r"sources\[0\]: expected a floating"),
    (lambda: depth_attention(X, np.arange(D)), TypeError, "query: expected a floating"),
    (lambda: depth_attention(X, np.ones(D + 1)), ValueError, r"query: expected shape \[D\]"),
    (lambda: depth_attention(X, np.ones((2, D))), ValueError, "query: expected shape"),
    (lambda: depth_attention(X, np.ones((1, 3, D))), ValueError, "query: expected shape"),
    (lambda: depth_attention(X, Q, np.ones(D + 1)), ValueError, r"norm_weight: expected shape \[D\]"),
    (lambda: depth_attention(X, Q, np.ones((3, D))), ValueError, "norm_weight: expected shape"),
    (lambda: depth_attention(X, Q, np.ones(D, dtype=np.int32)), TypeError, "norm_weight: expected a floating"),
    (lambda: depth_attention(X, Q, eps=0.0), ValueError, "eps: expected eps > 0"),
    (lambda: depth_attention(X, Q, eps=-1e-6), ValueError, "eps: expected eps > 0"),
    (lambda: depth_attention(X, Q, eps=float("nan")), ValueError, "eps: expected a finite"),
    (lambda: depth_attention(X, Q, eps="1e-6"), TypeError, "eps: expected a real"),
    (lambda: depth_attention(X, Q, eps=True), TypeError, "eps: expected a real"),
    (lambda: depth_attention(X, Q, scale=float("inf")), ValueError, "scale: expected a finite"),
    (lambda: depth_attention(X, Q, scale=None), TypeError, "scale: expected a real"),
    (lambda: depth_attention(X, Q, num_heads=0), ValueError, "num_heads: expected num_heads >= 1"),
    (lambda: depth_attention(X, Q, num_heads=2.0), TypeError, "num_heads: expected an int"),
    (lambda: depth_attention(X, Q, num_heads=True), TypeError, "num_heads: expected an int"),
    (lambda: depth_attention(X, Q, num_heads=3), ValueError, "num_heads: D = 4 is not divisible"),
    (lambda: depth_attention(X, Q, activation="relu"), ValueError, "activation: expected one of"),
    (lambda: depth_attention(X, Q, key_norm=1), TypeError, "key_norm: expected a bool"),
    (lambda: depth_attention(X, Q, activation="sigmoid", return_lse=True), ValueError, "return_lse:"),
    (lambda: depth_attention_vjp(X, Q, None, ROW, np.ones(3), activation="sigmoid"), ValueError, "return_lse:"),
    (lambda: depth_attention_vjp([], Q, None, ROW), ValueError, "sources: expected N >= 1"),
    (lambda: depth_attention_vjp(X, Q, np.ones(2), ROW), ValueError, "norm_weight: expected shape"),
    # C17: the fused output norm's gain and eps
    (lambda: depth_attention(X, Q, out_norm_weight=np.ones(D + 1)), ValueError,
     r"out_norm_weight: expected shape \[D\]"),
    (lambda: depth_attention(X, Q, out_norm_weight=np.ones((1, D))), ValueError, "out_norm_weight: expected shape"),
    (lambda: depth_attention(X, Q, out_norm_weight=np.ones(D, dtype=np.int32)), TypeError,
     "out_norm_weight: expected a floating"),
    (lambda: depth_attention(X, Q, out_norm_weight=G, out_norm_eps=0.0), ValueError,
     "out_norm_eps: expected out_norm_eps > 0"),
    (lambda: depth_attention(X, Q, out_norm_weight=G, out_norm_eps=-1e-6), ValueError,
     "out_norm_eps: expected out_norm_eps > 0"),
    (lambda: depth_attention(X, Q, out_norm_weight=G, out_norm_eps=float("inf")), ValueError,
     "out_norm_eps: expected a finite"),
    (lambda: depth_attention(X, Q, out_norm_weight=G, out_norm_eps=True), TypeError, "out_norm_eps: expected a real"),
    (lambda: depth_attention(X, Q, out_norm_weight=G, out_norm_eps="1e-6"), TypeError,
     "out_norm_eps: expected a real"),
    (lambda: depth_attention(X, Q, out_norm_eps=1e-5), ValueError, "out_norm_eps: given .* out_norm_weight is None"),
    (lambda: depth_attention_vjp(X, Q, None, ROW, out_norm_eps=1e-5), ValueError, "out_norm_eps: given"),
    (lambda: depth_attention_vjp(X, Q, None, ROW, d_out_normed=ROW), ValueError,
     "d_out_normed: given while out_norm_weight is None"),
    (lambda: depth_attention_vjp(X, Q, None, ROW, out_norm_weight=G, d_out_normed=np.ones(D)), ValueError,
     "d_out_normed: expected the output's shape"),
    (lambda: depth_attention_vjp(X, Q, None, ROW, out_norm_weight=np.ones(2)), ValueError,
     "out_norm_weight: expected shape"),
]

MULTI_ERRORS = [
    (lambda: depth_attention_multi([], np.ones((2, D))), ValueError, "sources: expected N >= 1"),
    (lambda: depth_attention_multi([ROW, ROW[:2]], np.ones((2, D))), ValueError, r"sources\[1\]: shape"),
    (lambda: depth_attention_multi(X.astype(np.int16), np.ones((2, D))), TypeError, r"sources\[0\]:"),
    (lambda: depth_attention_multi(X, Q), ValueError, r"queries: expected shape \[S, D\]"),
    (lambda: depth_attention_multi(X, np.ones((2, D + 1))), ValueError, "queries: expected shape"),
    (lambda: depth_attention_multi(X, np.ones((0, D))), ValueError, "queries: expected shape"),
    (lambda: depth_attention_multi(X, np.ones((2, D), dtype=np.int64)), TypeError, "queries: expected a floating"),
    (lambda: depth_attention_multi(X, np.ones((2, D)), np.ones((3, D))), ValueError, "norm_weights: expected shape"),
    (lambda: depth_attention_multi(X, np.ones((2, D)), np.ones(D)), ValueError, "norm_weights: expected shape"),
    (lambda: depth_attention_multi(X, np.ones((2, D)), np.ones((2, D), dtype=np.int8)), TypeError,
     "norm_weights: expected a floating"),
    (lambda: depth_attention_multi(X, np.ones((2, D)), eps=0), ValueError, "eps:"),
    (lambda: depth_attention_multi(X, np.ones((2, D)), scale=float("nan")), ValueError, "scale:"),
    (lambda: depth_attention_multi_vjp(X, np.ones((2, D + 1)), None, np.ones((2, 3, D))), ValueError, "queries:"),
]

LSE = np.zeros(3)
MERGE_ERRORS = [
    (lambda: merge_partial(ROW.astype(np.int32), LSE, ROW, Q), TypeError, "out1: expected a floating"),
    (lambda: merge_partial(ROW, LSE.astype(np.int32), ROW, Q), TypeError, "lse1: expected a floating"),
    (lambda: merge_partial(ROW, LSE, ROW.astype(np.int32), Q), TypeError, "partial: expected a floating"),
    (lambda: merge_partial(np.float64(1), np.float64(0), np.float64(1), Q), ValueError, "partial: expected shape"),
    (lambda: merge_partial(ROW[:2], LSE, ROW, Q), ValueError, "out1: shape"),
    (lambda: merge_partial(ROW.astype(np.float32), LSE, ROW, Q), TypeError, "out1: dtype"),
    (lambda: merge_partial(ROW, np.zeros(2), ROW, Q), ValueError, "lse1: expected shape"),
    (lambda: merge_partial(ROW, np.zeros((3, 1)), ROW, Q), ValueError, "lse1: expected shape"),
    (lambda: merge_partial(ROW, LSE, ROW, np.ones(D + 1)), ValueError, "query: expected shape"),
    (lambda: merge_partial(ROW, LSE, ROW, Q.astype(np.int64)), TypeError, "query: expected a floating"),
    (lambda: merge_partial(ROW, LSE, ROW, Q, np.ones(2)), ValueError, "norm_weight: expected shape"),
    (lambda: merge_partial(ROW, LSE, ROW, Q, np.ones(D, dtype=np.int16)), TypeError, "norm_weight: expected a floating"),
    (lambda: merge_partial(np.ones((3, 0)), LSE, np.ones((3, 0)), np.ones(0)), ValueError, "partial: expected shape"),
    (lambda: merge_partial(ROW, LSE, ROW.astype(np.complex128), Q), TypeError, "partial: expected a floating"),
    (lambda: merge_partial(ROW, LSE, ROW, Q, eps=-1.0), ValueError, "eps:"),
    (lambda: merge_partial(ROW, LSE, ROW, Q, scale="x"), TypeError, "scale:"),
    (lambda: merge_partial_vjp(ROW, np.zeros(2), ROW, Q, None, ROW), ValueError, "lse1: expected shape"),
]


@pytest.mark.parametrize("call,error,message", DA_ERRORS + MULTI_ERRORS + MERGE_ERRORS,
                         ids=[f"case{i}" for i in range(len(DA_ERRORS + MULTI_ERRORS + MERGE_ERRORS))])
def test_ops_reject_bad_input(call, error, message):
    with pytest.raises(error, match="^" + message):
        call()


# -- model-level checks --------------------------------------------------------------------------
L = 3
BLOCK = ResidualConfig.variant("block")
EMB = np.linspace(-1, 1, 2 * D).reshape(2, D)
W = np.linspace(-0.5, 0.5, L * D * D).reshape(L, D, D)


def _params(config=BLOCK, num_layers=L):
    return config.init_params(num_layers, D)


MODEL_ERRORS = [
    (lambda: probe_forward(BLOCK.to_dict(), _params(), EMB, W), TypeError, "config: expected a ResidualConfig"),
    (lambda: probe_forward(BLOCK, _params(), EMB, W, schedule="fast"), ValueError, "schedule: expected one of"),
    (lambda: probe_forward(ResidualConfig(kind="full"), _params(ResidualConfig(kind="full")), EMB, W,
                           schedule="two_phase"), ValueError, "schedule: 'two_phase' needs"),
    (lambda: probe_forward(ResidualConfig(kind="block", block_size=2, num_heads=2),
                           _params(ResidualConfig(kind="block", block_size=2, num_heads=2)), EMB, W,
                           schedule="two_phase"), ValueError, "schedule: 'two_phase' needs"),
    (lambda: probe_forward(BLOCK, {"queries": _params()["queries"]}, EMB, W), ValueError, "params: expected names"),
    (lambda: probe_forward(BLOCK, {**_params(), "alphas": np.ones(L)}, EMB, W), ValueError, "params: expected names"),
    (lambda: probe_forward(BLOCK, _params(num_layers=L + 1), EMB, W), ValueError,
     r"params\['queries'\]: expected shape \(4, 4\) for L = 3"),
    (lambda: probe_forward(BLOCK, {**_params(), "norm_weights": np.ones((L + 1, D), dtype=np.int64)}, EMB, W),
     TypeError, r"params\['norm_weights'\]: expected a floating"),
    (lambda: probe_forward(BLOCK, list(_params().items()), EMB, W), TypeError, "params: expected a mapping"),
    (lambda: probe_forward(BLOCK, _params(), EMB.astype(np.int64), W), TypeError, "embedding: expected a floating"),
    (lambda: probe_forward(BLOCK, _params(), np.float64(1.0), W), ValueError, "embedding: expected shape"),
    (lambda: probe_forward(BLOCK, _params(), np.ones((2, D + 2)), W), ValueError, "sublayer_weights: expected shape"),
    (lambda: probe_forward(BLOCK, _params(), EMB, W[0]), ValueError, "sublayer_weights: expected shape"),
    (lambda: probe_forward(BLOCK, _params(), EMB, W[:0]), ValueError, "sublayer_weights: expected shape"),
    (lambda: probe_forward(BLOCK, _params(), EMB, W.astype(np.int32)), TypeError, "sublayer_weights: expected a"),
    (lambda: probe_forward(ResidualConfig.variant("multihead"), _params(ResidualConfig(kind="block", block_size=2),
                                                                        ), np.ones((2, 3)), np.ones((L, 3, 3))),
     ValueError, "num_heads: D = 3"),
    (lambda: probe_vjp(BLOCK, _params(), EMB, W, np.ones((3, D))), ValueError, "cotangent: expected the output"),
    (lambda: probe_vjp(BLOCK, _params(), EMB, W, np.ones((2, D), dtype=np.int32)), TypeError, "cotangent:"),
    (lambda: probe_vjp(BLOCK, _params(num_layers=2), EMB, W, EMB), ValueError, r"params\['queries'\]"),
    (lambda: stack_forward(BLOCK, _params(), EMB, []), ValueError, "sublayers: expected L >= 1"),
    (lambda: stack_forward(BLOCK, _params(), EMB, [np.tanh] * 2), ValueError,
     r"params\['queries'\]: expected shape \(3, 4\) for L = 2"),
    (lambda: stack_forward(BLOCK, _params(), EMB, np.tanh), TypeError, "sublayers: expected a list"),
    (lambda: stack_forward(BLOCK, _params(), EMB, [np.tanh, np.tanh, 3]), TypeError, "sublayers: expected a list"),
    (lambda: stack_forward(BLOCK, _params(), EMB, [np.tanh, lambda h: h[..., :2], np.tanh]), ValueError,
     r"sublayers\[1\]: returned shape \(2, 2\)"),
    (lambda: stack_forward(BLOCK, _params(), EMB, [np.tanh, np.tanh, lambda h: (h > 0)]), TypeError,
     r"sublayers\[2\]: expected a floating"),
    (lambda: stack_forward(ResidualConfig(kind="standard"), {}, EMB, [np.tanh], return_weights=True), ValueError,
     "return_weights: depth weights exist only"),
    (lambda: stack_forward(BLOCK, _params(), EMB, [np.tanh] * 3, schedule="two_phase", return_weights=True),
     ValueError, "return_weights:"),
]


@pytest.mark.parametrize("call,error,message", MODEL_ERRORS, ids=[f"case{i}" for i in range(len(MODEL_ERRORS))])
def test_model_rejects_bad_input(call, error, message):
    with pytest.raises(error, match="^" + message):
        call()


# -- inputs are never modified -------------------------------------------------------------------
def _all_calls(rng):
    x = rng.standard_normal((3, 2, D))
    q, g, qs, gs = rng.standard_normal(D), rng.standard_normal(D), rng.standard_normal((2, D)), rng.standard_normal((2, D))
    d, dl = rng.standard_normal((2, D)), rng.standard_normal(2)
    p, l1 = rng.standard_normal((2, D)), rng.standard_normal(2)
    cfg = ResidualConfig.variant("block", block_size=2)
    emb, w = rng.standard_normal((2, D)), rng.standard_normal((L, D, D))
    params = {k: rng.standard_normal(s) for k, s in cfg.param_shapes(L, D).items()}
    return [
        (depth_attention, (x, q, g), dict(return_lse=True, return_weights=True)),
        (depth_attention, (list(x), x[0], g), dict(num_heads=2)),
        (depth_attention_vjp, (x, q, g, d, dl), {}),
        (depth_attention_vjp, (list(x), q, None, d), dict(activation="sigmoid", key_norm=False)),
        (depth_attention, (x, q, g), dict(out_norm_weight=g, return_lse=True)),  # C17
        (depth_attention_vjp, (list(x), q, g, d, dl), dict(out_norm_weight=g, d_out_normed=d)),
        (depth_attention_multi, (x, qs, gs), {}),
        (depth_attention_multi_vjp, (list(x), qs, gs, rng.standard_normal((2, 2, D)), rng.standard_normal((2, 2))), {}),
        (merge_partial, (d, l1, p, q, g), dict(return_lse=True)),
        (merge_partial_vjp, (d, l1, p, p, g, d, dl), {}),
        (probe_forward, (cfg, params, emb, w), dict(schedule="two_phase")),
        (probe_vjp, (cfg, params, emb, w, d), {}),
        (probe_vjp, (cfg, params, emb, w, d), dict(schedule="two_phase")),
        (stack_forward, (cfg, params, emb, probe_sublayers(w, 1e-6)), dict(return_weights=True)),
    ]


def _unchanged(args, before) -> bool:
    """Bitwise comparison of every array among the arguments (also inside lists and dicts)."""
    for a, b in zip(args, before):
        if isinstance(a, dict):
            if a.keys() != b.keys() or not all(np.array_equal(a[k], b[k]) for k in b):
                return False
        elif isinstance(a, list) and all(isinstance(u, np.ndarray) for u in a):
            if len(a) != len(b) or not all(np.array_equal(u, v) for u, v in zip(a, b)):
                return False
        elif isinstance(a, np.ndarray) and not np.array_equal(a, b):
            return False
    return True


def _result_arrays(result):
    items = result.values() if isinstance(result, dict) else result if isinstance(result, tuple) else [result]
    for item in items:
        for arr in item if isinstance(item, list) else [item]:
            if isinstance(arr, np.ndarray):
                yield arr


def test_inputs_are_never_modified(rng):
    """No call writes into its inputs, and no result aliases an input: poisoning every returned
    array with NaN afterwards leaves the inputs bitwise intact."""
    for fn, args, kwargs in _all_calls(rng):
        before = copy.deepcopy(args)
        result = fn(*args, **kwargs)
        assert _unchanged(args, before), fn.__name__
        for arr in _result_arrays(result):
            arr[...] = np.nan
        assert _unchanged(args, before), f"{fn.__name__}: a result aliases an input"


# -- NaN / Inf propagate (C12) -------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("bad", (np.nan, np.inf, -np.inf))
@pytest.mark.parametrize("activation", ("softmax", "sigmoid"))
def test_nonfinite_sources_propagate(rng, bad, activation):
    x = rng.standard_normal((3, 4, D))
    x[1, 2, 0] = bad  # one element of token 2
    q = rng.standard_normal(D)
    out = depth_attention(x, q, activation=activation)
    assert not np.all(np.isfinite(out[2]))
    assert np.all(np.isfinite(np.delete(out, 2, axis=0)))
    grads = depth_attention_vjp(x, q, None, np.ones((4, D)), activation=activation)
    assert np.all(np.isfinite(np.delete(grads["sources"], 2, axis=1)))
    o1, l1 = depth_attention_multi(x, q[None])
    assert not np.isfinite(l1[0, 2]) or not np.all(np.isfinite(o1[0, 2]))
    merged = merge_partial(o1[0], l1[0], x[0], q)
    assert not np.all(np.isfinite(merged[2])) and np.all(np.isfinite(np.delete(merged, 2, axis=0)))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_query_and_embedding_propagate(rng):
    x = rng.standard_normal((3, 4, D))
    out = depth_attention(x, np.full(D, np.nan))
    assert np.all(np.isnan(out))
    cfg = ResidualConfig.variant("full")
    emb = rng.standard_normal((4, D))
    emb[1, 3] = np.nan
    out = probe_forward(cfg, cfg.init_params(L, D), emb, rng.standard_normal((L, D, D)))
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(np.delete(out, 1, axis=0)))


@pytest.mark.parametrize(
    "call",
    [
        lambda x, q: ops.depth_attention_vjp(x, q, None, np.ones(4)),
        lambda x, q: ops.depth_attention_vjp(x, q, None, np.ones((3, 4)), np.ones(2)),
        lambda x, q: ops.depth_attention_multi_vjp(x, q[None], None, np.ones((2, 3, 4))),
        lambda x, q: ops.merge_partial_vjp(x[0], np.zeros(3), x[1], q, None, np.ones((4,))),
    ],
    ids=["d_out-broadcast", "d_lse-shape", "multi-d_out-rows", "merge-d_out"],
)
def test_vjp_cotangent_shape_is_checked(call):
    """A cotangent must have exactly its output's shape; nothing is silently broadcast."""
    x = np.ones((2, 3, 4))
    q = np.zeros(4)
    with pytest.raises(ValueError, match=r"^d_(out|lse): expected the output's shape"):
        call(x, q)


@pytest.mark.parametrize("fields,message", [
    (dict(kind="full", query_sharing="block"), "query_sharing: 'block' shares a query per block"),
    (dict(kind="block", block_size=2, query_sharing="layer"), "query_sharing: expected one of"),
    (dict(kind="scalar", query_sharing="stack"), "query_sharing must keep their defaults"),
])
def test_query_sharing_errors(fields, message):
    """M11: sharing needs an attention kind (per block: kind='block'); unknown modes refused."""
    with pytest.raises(ValueError, match=message):
        ResidualConfig(**fields)


def test_shared_query_rows():
    """M11: rows are ceil(L / S) + 1 per block, 2 for the stack; the output keeps the last."""
    block = ResidualConfig(kind="block", block_size=2, query_sharing="block")
    assert block.param_shapes(5, D)["queries"] == (4, D)
    assert [block.query_row(l, 5) for l in range(1, 7)] == [0, 0, 1, 1, 2, 3]
    stack = ResidualConfig(kind="window", window=1, query_sharing="stack", query="input")
    assert stack.param_shapes(5, D) == {"query_weights": (2, D, D), "norm_weights": (2, D)}
    assert [stack.query_row(l, 5) for l in range(1, 7)] == [0, 0, 0, 0, 0, 1]
    assert ResidualConfig.from_dict(block.to_dict()) == block


@pytest.mark.parametrize("fields,error,message", [
    (dict(kind="full", key_rank=0), ValueError, r"key_rank: expected an int >= 1"),
    (dict(kind="full", key_rank=2.0), TypeError, r"key_rank: expected an int or None, got float"),
    (dict(kind="full", key_rank=True), TypeError, r"key_rank: expected an int or None, got bool"),
    (dict(kind="standard", key_rank=2), ValueError, r"key_rank and query_sharing must keep their defaults"),
    (dict(kind="block", block_size=2, num_heads=2, key_rank=2), ValueError, r"key_rank: .* need\s+num_heads=1"),
])
def test_key_rank_errors(fields, error, message):
    """M13: key_rank is None or an int >= 1 on a one-head attention kind."""
    with pytest.raises(error, match=message):
        ResidualConfig(**fields)


def test_key_rank_above_width_is_refused_where_D_is_known():
    config = ResidualConfig(kind="full", key_rank=5)
    assert config.param_shapes(5, 5)["key_projection"] == (5, 5)
    with pytest.raises(ValueError, match=r"key_rank: expected 1 <= key_rank <= D = 4, got 5"):
        config.param_shapes(3, 4)


@pytest.mark.parametrize("fields,message", [
    (dict(kind="window", window=2, history="old"), r"history: expected one of \('drop', 'summaries'\)"),
    (dict(kind="full", history="summaries"), r"history: 'summaries' .* needs kind='window'; got kind='full'"),
    (dict(kind="block", block_size=2, history="summaries"), r"history: .* got kind='block'"),
    (dict(kind="window", window=2, history="summaries"), r"block_size: history='summaries' needs block_size >= 1, got None"),
    (dict(kind="window", window=2, block_size=0, history="summaries"), r"block_size: history='summaries' needs"),
    (dict(kind="window", window=2, block_size=2), r"block_size: only meaningful for kind='block' \(or kind='window' with"),
])
def test_history_errors(fields, message):
    """M14: summaries need kind='window' and a block size; block_size without them is refused."""
    with pytest.raises(ValueError, match=message):
        ResidualConfig(**fields)


def test_compressed_history_has_no_two_phase_schedule(rng):
    config = ResidualConfig.variant("compressed_history")
    with pytest.raises(ValueError, match="schedule: 'two_phase' needs kind='block'"):
        probe_forward(config, config.init_params(3, 4), np.ones(4), np.zeros((3, 4, 4)), schedule="two_phase")
    assert ResidualConfig.from_dict(config.to_dict()) == config
    low = ResidualConfig.variant("low_rank_keys")
    assert ResidualConfig.from_dict(low.to_dict()) == low
