"""Repeated calls of one signature (`attnres_torch.plans`): the checks and the dispatch
Choice kept per signature, and the C kernel's host code called without the custom op
(`cpu_c.forward_eager`) for eager calls that need no gradient -- the batch-1 decode read.

Checked here: that path is taken (and the custom op is not), matches the float64 reference on
upcast inputs in every output, writes every element (every `torch.empty` NaN-poisoned), gives
the bits of the custom-op path; every bad input raises the message of the full checks; the
record (`last_choice`, `impl_counts`, `use_impl`) counts every call; gradients, traces, modes,
autocast, the profiler and view bits take or see what they did before."""

from __future__ import annotations

import warnings
from collections import Counter

import attnres_torch as at
import pytest
import torch
from _helpers import assert_close, compute_dtype, f64, leaves, rand
from attnres_numpy import ops as ref
from attnres_torch import plans
from attnres_torch.kernels import cpu_c

needs_c = pytest.mark.skipif(not cpu_c.available(), reason="the C kernel could not be built")
pytestmark = needs_c

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
EPS, SCALE, ON_EPS = 1e-6, 0.8, 1e-5
#: (N, batch, D, per-token query, gain, stacked): the decode reads (T = 1 at D = 1024 / 128, N =
#: 2 / 5 / 17), D = 1, a lane tail, several tokens, a per-token query, a stacked tensor.
CASES = [(5, (1, 1), 1024, False, True, False), (2, (1,), 128, False, True, False),
         (17, (1, 1), 128, False, False, False), (1, (1,), 1, False, True, False),
         (3, (2, 5), 17, True, True, False), (4, (3,), 1000, False, True, True)]


class _Spy:
    """Counts the calls of cpu_c functions: `eager` (the direct host code) and `body` (the custom
    op's forward body), or any others named."""

    def __init__(self, monkeypatch, eager="forward_eager", body="_forward", **more):
        self.names = dict(more, eager=eager, body=body)
        self.counts = dict.fromkeys(self.names, 0)
        for label, name in self.names.items():
            monkeypatch.setattr(cpu_c, name, self._wrap(label, getattr(cpu_c, name)))

    def _wrap(self, label, fn):
        def spy(*a, **k):
            self.counts[label] += 1
            return fn(*a, **k)
        return spy

    def __getattr__(self, label):
        return self.__dict__["counts"][label]


def _poison(monkeypatch) -> list:
    """Every floating `torch.empty` returns NaNs (integer ones -1); returns the list of the
    tensors handed out."""
    real, made = torch.empty, []

    def empty(*a, **k):
        t = real(*a, **k)
        t.fill_(float("nan") if t.is_floating_point() else -1)
        made.append(t)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return made


def _inputs(seed, n, batch, dim, per_token, gain, dtype):
    gen = torch.Generator().manual_seed(seed)
    xs = [rand(gen, batch + (dim,), dtype) for _ in range(n)]
    q = torch.nn.Parameter(rand(gen, batch + (dim,) if per_token else (dim,), torch.float32, 0.5))
    g = torch.nn.Parameter(rand(gen, (dim,), torch.float32) + 1.0) if gain else None
    w = torch.nn.Parameter(rand(gen, (dim,), torch.float32) + 1.0)
    return xs, q, g, w


def _call(src, q, g, w, weights=True):
    return at.depth_attention(src, q, g, eps=EPS, scale=SCALE, return_lse=True,
                              return_weights=weights, out_norm_weight=w,
                              out_norm_eps=None if w is None else ON_EPS)


@pytest.mark.parametrize("dtype", list(NAMES))
@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}-B{'x'.join(map(str, c[1]))}-D{c[2]}"
                                             f"{'-tok' if c[3] else ''}{'-stack' if c[5] else ''}"
                                             for c in CASES])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "out_norm"])
def test_repeated_call_takes_the_host_code_writes_everything_and_matches(monkeypatch, dtype, case,
                                                                         fused):
    n, batch, dim, per_token, gain, stacked = case
    xs, q, g, w = _inputs(n * 1000 + dim, n, batch, dim, per_token, gain, dtype)
    w = w if fused else None
    src = torch.stack(xs) if stacked else xs
    with torch.no_grad():
        plans.MEMO = False
        try:
            before = _call(src, q, g, w)  # the custom-op path, every call
        finally:
            plans.MEMO = True
        _call(src, q, g, w)  # the first call of the signature: full path, plan kept
        spy = _Spy(monkeypatch)
        made = _poison(monkeypatch)
        got = _call(src, q, g, w)
        monkeypatch.undo()
    assert (spy.eager, spy.body) == (1, 0)
    poisoned = {t.data_ptr() for t in made}
    assert all(a.data_ptr() in poisoned for a in got)  # every output was a NaN buffer
    r = ref.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=SCALE, return_lse=True,
                            return_weights=True, out_norm_weight=f64(w),
                            out_norm_eps=None if w is None else ON_EPS)
    name = NAMES[dtype]
    what = ["out"] + (["out_normed"] if fused else []) + ["lse", "weights"]
    for label, a, b, x in zip(what, got, before, r):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), label
        assert torch.equal(a, b), f"{label}: other bits than the custom-op path"
        kind = name if label in ("out", "out_normed") else compute_dtype(name)
        assert_close(a, x, kind, label, grad=False)
    assert got[-1].shape == (n,) + batch


#: (batch, D, per-token merge query, stacked phase-1 sources)
PHASE_CASES = [((1, 1), 1024, False, False), ((1,), 128, False, True), ((3, 5), 17, True, True)]


@pytest.mark.parametrize("dtype", list(NAMES))
@pytest.mark.parametrize("case", PHASE_CASES, ids=["T1-D1024", "T1-D128-stack", "T15-D17-tok"])
def test_repeated_phase_calls_take_the_host_code_write_everything_and_match(monkeypatch, dtype,
                                                                            case):
    """Phase 1 (`depth_attention_multi`) and the merge (`merge_partial`) of the two-phase decode:
    the same as `depth_attention`'s repeated calls."""
    batch, dim, per_token, stacked = case
    gen = torch.Generator().manual_seed(dim)
    xs = [rand(gen, batch + (dim,), dtype) for _ in range(4)]
    qs, gs = rand(gen, (3, dim), torch.float32, 0.5), rand(gen, (3, dim), torch.float32) + 1.0
    out1, partial = rand(gen, batch + (dim,), dtype), rand(gen, batch + (dim,), dtype)
    lse1 = rand(gen, batch, torch.float32)
    q = rand(gen, batch + (dim,) if per_token else (dim,), torch.float32, 0.5)
    g = rand(gen, (dim,), torch.float32) + 1.0
    src = torch.stack(xs) if stacked else xs

    def calls():
        return (at.depth_attention_multi(src, qs, gs, scale=SCALE)
                + at.merge_partial(out1, lse1, partial, q, g, scale=SCALE, return_lse=True))

    with torch.no_grad():
        plans.MEMO = False
        try:
            before = calls()
        finally:
            plans.MEMO = True
        calls()
        spy = _Spy(monkeypatch, eager="multi_eager", body="multi_forward_into",
                   merge="merge_eager", merge_into="merge_forward_into")
        counts = at.impl_counts()
        made = _poison(monkeypatch)
        got = calls()
        monkeypatch.undo()
    assert spy.counts == {"eager": 1, "body": 0, "merge": 1, "merge_into": 0}
    assert at.impl_counts() - counts == Counter(cpu_c=2)
    poisoned = {t.data_ptr() for t in made}
    assert all(a.data_ptr() in poisoned for a in got)
    r = (ref.depth_attention_multi(f64(xs), f64(qs), f64(gs), scale=SCALE)
         + ref.merge_partial(*f64([out1, lse1, partial, q, g]), scale=SCALE, return_lse=True))
    name = NAMES[dtype]
    for label, a, b, x in zip(("out", "lse", "merged out", "merged lse"), got, before, r):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), label
        assert torch.equal(a, b), f"{label}: other bits than before"
        assert_close(a, x, name if "out" in label else compute_dtype(name), label, grad=False)
    for _ in range(2):  # the same signature with a gradient: the composition's merge
        ins = leaves([out1, lse1, partial, q, g])
        out = at.merge_partial(*ins, scale=SCALE)
        assert at.last_impl() == "composite" and out.requires_grad


def test_bits_equal_the_gradient_path_and_gradients_are_unchanged(monkeypatch):
    """With a gradient the call takes the custom op (plan kept, checks skipped); its values
    are the host code's bits, its gradients those of the full path (random cotangents)."""
    xs, q, g, w = _inputs(7, 5, (1, 1), 1024, False, True, torch.float32)
    with torch.no_grad():
        _call(xs, q, g, w)
        fast = _call(xs, q, g, w)
    gen = torch.Generator().manual_seed(3)
    cots = [rand(gen, t.shape, t.dtype) for t in fast[:3]]
    grads = []
    for memo in (False, True, True):
        plans.MEMO = memo
        try:
            spy = _Spy(monkeypatch)
            lx, lq, lg, lw = leaves(xs), leaves(q), leaves(g), leaves(w)
            res = _call(lx, lq, lg, lw)
            monkeypatch.undo()
        finally:
            plans.MEMO = True
        assert (spy.eager, spy.body) == (0, 1)
        for a, b in zip(res, fast):
            assert torch.equal(a.detach(), b)
        torch.autograd.backward(list(res[:3]), cots)
        grads.append([t.grad for t in lx + [lq, lg, lw]])
    v = ref.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(cots[0]), f64(cots[2]), eps=EPS,
                                scale=SCALE, out_norm_weight=f64(w), out_norm_eps=ON_EPS,
                                d_out_normed=f64(cots[1]))
    for got in grads[1:]:
        for a, b in zip(got, grads[0]):
            assert torch.equal(a, b)
    assert_close(grads[1][:5], v["sources"], "float32", "d_sources", grad=True)
    assert_close(grads[1][5], v["query"], "float32", "d_query", grad=True)
    assert_close(grads[1][6], v["norm_weight"], "float32", "d_norm_weight", grad=True)
    assert_close(grads[1][7], v["out_norm_weight"], "float32", "d_out_norm_weight", grad=True)


def _bad_calls(x, q):
    """(call, error type, message pattern) of bad inputs that share everything but one argument
    with a good call of kept plan (`x` `[1, 1, 8]`, `q` `[8]`)."""
    da = at.depth_attention
    return [
        (lambda: da([x, x], q, eps=True), TypeError, "eps: expected a real number"),
        (lambda: da([x, x], q, key_norm=1), TypeError, "key_norm: expected a bool"),
        (lambda: da([x, x], q, num_heads=True), TypeError, "num_heads: expected an int"),
        (lambda: da([x, x], q, scale=float("nan")), ValueError, "scale: expected a finite"),
        (lambda: da([x, x], q, eps=0.0), ValueError, "eps > 0"),
        (lambda: da([x, x], q, activation="relu"), ValueError, "activation"),
        (lambda: da([x, x], q, save="all"), ValueError, "save: expected one of"),
        (lambda: da([x, x], q, out_norm_eps=1e-5), ValueError, "out_norm_eps: given"),
        (lambda: da([x, x], q, out_norm_weight=q[:4]), ValueError, "out_norm_weight: expected"),
        (lambda: da([x, x], q[:4]), ValueError, "query: expected shape"),
        (lambda: da([x, x], q.int()), TypeError, "query: expected a floating"),
        (lambda: da([x, x], q.double()), None, None),  # valid: a float64 query
        (lambda: da([x, x.double()], q), TypeError, "share one dtype"),
        (lambda: da([x, x.int()], q), TypeError, r"sources\[1\]: expected a floating"),
        (lambda: da([x, x[..., :4]], q), ValueError, r"sources\[1\]: shape"),
        (lambda: da([x, x.numpy()], q), TypeError, r"sources\[1\]: expected a torch"),
        (lambda: da([x, x], q.detach().numpy()), TypeError, "query: expected a torch.Tensor"),
        (lambda: da([x, x], q.to("meta")), ValueError, "every tensor must be on one device"),
        (lambda: da({"x": x}, q), TypeError, "sources: expected a sequence"),
        (lambda: da(iter([x, x]), q), TypeError, "sources: expected a sequence"),
        (lambda: da([], q), ValueError, "N >= 1"),
        (lambda: da([x, x], q, activation="sigmoid", return_lse=True), ValueError, "return_lse"),
        (lambda: da([x, x], q, num_heads=3), ValueError, "not divisible"),
    ]


def _bad_phase_calls(x, q):
    """The same for `depth_attention_multi` and `merge_partial` (`x` `[1, 1, 8]`, `q` `[8]`)."""
    qs, lse = torch.stack([q, q]), torch.zeros(1, 1)
    multi, merge = at.depth_attention_multi, at.merge_partial
    return [
        (lambda: multi([x, x], q), ValueError, r"queries: expected shape \[S, D\]"),
        (lambda: multi([x, x], qs, qs[:1]), ValueError, "norm_weights: expected shape"),
        (lambda: multi([x, x], qs, eps=True), TypeError, "eps: expected a real number"),
        (lambda: multi([x, x], qs, save=None), ValueError, "save: expected one of"),
        (lambda: multi([x, x.int()], qs), TypeError, r"sources\[1\]: expected a floating"),
        (lambda: merge(x, lse, x, q, eps=True), TypeError, "eps: expected a real number"),
        (lambda: merge(x, lse, x, q, scale=float("inf")), ValueError, "scale: expected a finite"),
        (lambda: merge(x, lse[0], x, q), ValueError, "lse1"),
        (lambda: merge(x, lse, x[..., :4], q), ValueError, "partial"),
        (lambda: merge(x, lse, x.double(), q), TypeError, ""),
        (lambda: merge(x, lse, x, q[:4]), ValueError, "query"),
        (lambda: merge(x, lse, x, q, q[:4]), ValueError, "norm_weight"),
        (lambda: merge(x.numpy(), lse, x, q), TypeError, "out1: expected a torch.Tensor"),
        (lambda: merge(x, lse, x, q, q.to("meta")), ValueError, "one device"),
    ]


@pytest.mark.parametrize("grad", [False, True])
def test_bad_inputs_raise_the_checks_messages_after_a_kept_plan(grad):
    x, q = torch.randn(1, 1, 8), torch.randn(8, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        for kw in ({}, {"eps": 1}, {"num_heads": 1}, {"key_norm": True}, {"scale": 1.0}):
            for _ in range(2):  # plans for every good neighbour
                at.depth_attention([x, x], q, **kw)
                at.depth_attention_multi([x, x], torch.stack([q, q]), eps=kw.get("eps", 1e-6))
                at.merge_partial(x, torch.zeros(1, 1), x, q, q, eps=kw.get("eps", 1e-6))
        for i, (call, err, match) in enumerate(_bad_calls(x, q) + _bad_phase_calls(x, q)):
            kept = set(plans._PLANS)
            outcomes = []
            for memo in (True, False):
                plans.MEMO = memo
                try:
                    try:
                        call()
                        outcomes.append(None)
                    except (TypeError, ValueError) as exc:
                        outcomes.append((type(exc), str(exc)))
                finally:
                    plans.MEMO = True
            assert outcomes[0] == outcomes[1], i
            if err is None:
                assert outcomes[0] is None, (i, outcomes[0])
            else:
                assert outcomes[0] is not None and outcomes[0][0] is err, (i, outcomes[0])
                assert pytest.raises(err, call).match(match)
                assert set(plans._PLANS) == kept, i  # no plan for a bad call


def test_the_record_counts_every_kept_call_and_follows_use_impl(monkeypatch):
    xs, q, g, _ = _inputs(11, 3, (1, 1), 64, False, True, torch.float32)
    with torch.no_grad():
        at.depth_attention(xs, q, g)
        auto = at.dispatch.last_choice()
        spy = _Spy(monkeypatch)
        counts = at.impl_counts()
        for _ in range(5):
            at.depth_attention(xs, q, g)
            assert at.dispatch.last_choice() == auto
        assert at.impl_counts() - counts == Counter(cpu_c=5)
        assert spy.eager == 5
        for name in ("cpu_c", "chunked", "composite"):
            with at.use_impl(name):
                plans.MEMO = False
                try:
                    full = at.depth_attention(xs, q, g)
                    choice = at.dispatch.last_choice()
                finally:
                    plans.MEMO = True
                at.depth_attention(xs, q, g)  # the forcing is part of the signature: a new plan
                counts, eager = at.impl_counts(), spy.eager
                for _ in range(3):
                    kept = at.depth_attention(xs, q, g)
                    assert at.dispatch.last_choice() == choice and choice.impl == name
                assert torch.equal(kept, full)
            assert at.impl_counts() - counts == Counter({name: 3})
            assert spy.eager - eager == (3 if name == "cpu_c" else 0)
            assert [n for n, _ in choice.refused] + [name] == list(
                at.dispatch.IMPLEMENTATIONS[:at.dispatch.IMPLEMENTATIONS.index(name) + 1])
            assert all(r == f"not forced (use_impl({name!r}))" for _, r in choice.refused)
        at.depth_attention(xs, q, g)
        assert at.dispatch.last_choice() == auto


def test_traces_modes_and_transforms_take_the_custom_op(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops_seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops_seen.append(str(func))
            return func(*args, **(kwargs or {}))

    xs, q, g, _ = _inputs(5, 4, (1, 1), 32, False, True, torch.float32)
    # a compiled call of at most COMPILED_ROWS_MAX rows without gradient is traced as the
    # composition (test_hf_compile.py): the compiled call below is one of more rows
    rows = [torch.cat([x] * (at.dispatch.COMPILED_ROWS_MAX + 1), 1) for x in xs]
    with torch.no_grad():
        want = at.depth_attention(xs, q, g)
        at.depth_attention(xs, q, g)
        want_rows = at.depth_attention(rows, q, g)
        spy = _Spy(monkeypatch)
        with Seen() as mode:
            assert torch.equal(at.depth_attention(xs, q, g), want)
        assert any("attnres.cpu_c_depth_attention" in s for s in mode.ops_seen)
        def four(a, b, c, d, query, gain):
            return at.depth_attention([a, b, c, d], query, gain)

        with warnings.catch_warnings():  # jit.trace is deprecated; its tracer warns on shapes
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(four, (*xs, q.detach(), g.detach()), check_trace=False)
        assert "attnres::cpu_c_depth_attention" in str(traced.graph)
        compiled = torch.compile(lambda s, a, b: at.depth_attention(s, a, b), backend="eager",
                                 fullgraph=True)
        assert torch.equal(compiled(rows, q, g), want_rows)
    assert spy.eager == 0 and spy.body >= 3
    with torch.no_grad():
        assert torch.equal(at.depth_attention(xs, q, g), want)
    assert spy.eager == 1


def test_profiler_sees_the_op_name():
    xs, q, g, _ = _inputs(6, 2, (1,), 16, False, True, torch.float32)
    with torch.no_grad():
        at.depth_attention(xs, q, g)
        with torch.profiler.profile() as prof:
            at.depth_attention(xs, q, g, return_weights=True)
    names = [e.key for e in prof.key_averages()]
    assert "attnres::cpu_c_depth_attention_weights" in names, names


def test_autocast_promotion_keeps_no_plan_and_one_dtype_keeps_its_bits(monkeypatch):
    """C3a: mixed source dtypes under autocast are promoted on every call (no plan: the key
    holds the dtypes given); one dtype under autocast is the plan of the same call outside."""
    gen = torch.Generator().manual_seed(2)
    x32, x16 = rand(gen, (1, 1, 64), torch.float32), rand(gen, (1, 1, 64), torch.bfloat16)
    q = rand(gen, (64,), torch.float32)
    with torch.no_grad():
        plain = at.depth_attention([x32, x16.float()], q)
        at.depth_attention([x32, x16.float()], q)
        spy = _Spy(monkeypatch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept = set(plans._PLANS)
            for _ in range(2):
                assert torch.equal(at.depth_attention([x32, x16], q), plain)
            assert set(plans._PLANS) == kept and spy.eager == 0
            assert torch.equal(at.depth_attention([x32, x16.float()], q), plain)
            assert spy.eager == 1


def test_view_bits_and_rows_that_are_no_view():
    """A negative view (its bit resolved by the custom op's dispatch) and sources whose `[T,
    D]` rows are no view of them (`_rows.flat` copies) take the custom op, with their values."""
    gen = torch.Generator().manual_seed(4)
    x, q = rand(gen, (1, 16), torch.float32), rand(gen, (16,), torch.float32)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(at.depth_attention([x, torch._neg_view(x)], q),
                               at.depth_attention([x, -x], q))
            assert torch.equal(at.depth_attention([x, x], torch._neg_view(q)),
                               at.depth_attention([x, x], -q))
        xs = [rand(gen, (3, 2, 8), torch.float32).transpose(0, 1) for _ in range(3)]
        want = at.depth_attention([x.contiguous() for x in xs], q[:8])
        for _ in range(2):
            assert torch.equal(at.depth_attention(xs, q[:8]), want)
        key = next(k for k in reversed(plans._PLANS)
                   if k[0] == "depth_attention" and k[2][0][1] == xs[0].stride())
        assert plans._PLANS[key].layout is None


def test_a_tensor_subclass_gets_no_plan_and_sees_what_it_saw():
    class Logged(torch.Tensor):
        calls: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    gen = torch.Generator().manual_seed(8)
    xs = [rand(gen, (1, 1, 16), torch.float32) for _ in range(3)]
    q = rand(gen, (16,), torch.float32).as_subclass(Logged)
    seen, kept = [], set(plans._PLANS)
    with torch.no_grad():
        for memo in (False, True, True):
            plans.MEMO = memo
            try:
                Logged.calls.clear()
                out = at.depth_attention(xs, q)
            finally:
                plans.MEMO = True
            seen.append(list(Logged.calls))
            assert torch.equal(out.as_subclass(torch.Tensor), at.depth_attention(xs, q.as_subclass(
                torch.Tensor)))
    assert seen[0] == seen[1] == seen[2] and seen[0]
    assert plans.key("depth_attention", xs, (q, None, None), ()) is None
    assert plans.key("depth_attention", xs, (q.as_subclass(torch.Tensor), None, None), ())
    assert len(set(plans._PLANS) - kept) <= 1  # the plain query's plan only


def test_the_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(plans, "_MAX_PLANS", 3)
    plans._PLANS.clear()
    q = torch.randn(8)
    with torch.no_grad():
        for t in range(1, 6):
            at.depth_attention([torch.randn(t, 8)], q)
            assert len(plans._PLANS) <= 3
    assert len(plans._PLANS) == 2


def test_merge_of_a_negative_view_is_the_reference():
    """`torch._neg_view` keeps the negated values in storage with a view bit; the merge kernel
    reads raw storage, so such an input takes the composition (it gave 3.0 off before), first
    call and repeated, and the result is the float64 reference's."""
    g = torch.Generator().manual_seed(5)
    f32 = torch.float32
    out1, partial = rand(g, (3, 16), f32), rand(g, (3, 16), f32)
    lse1, q, w = rand(g, (3,), f32), rand(g, (16,), f32, 0.3), 1 + rand(g, (16,), f32, 0.1)
    want = ref.merge_partial(*f64([out1, lse1, partial, q, w]), scale=SCALE)
    for which in ("out1", "partial"):
        ins = {"out1": out1, "partial": partial}
        ins[which] = torch._neg_view(-ins[which])
        assert ins[which].is_neg()
        for _ in range(2):
            with torch.no_grad():
                got = at.merge_partial(ins["out1"], lse1, ins["partial"], q, w, scale=SCALE)
            assert at.dispatch.last_choice().impl == "composite", which
            assert_close(got, want, "float32", which, grad=False)
