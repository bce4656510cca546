"""The ops (values and every gradient with random cotangents) against the float64 NumPy
reference on upcast inputs, on both CPU kernels ("cpu_c", "chunked") and the "composite" path."""

from __future__ import annotations

import attnres_torch as at
import pytest
import torch
from _helpers import DTYPES, assert_close, compute_dtype, f64, leaves, rand
from attnres_conformance.tolerances import TOLERANCES
from attnres_numpy import ops as ref

FAST = ("float32", "float16", "bfloat16")
CASES = [  # (N, batch, D, per-token query, gain)
    (1, (5,), 7, False, True),
    (3, (2, 33), 123, True, True),
    (33, (4,), 1, False, False),
    (130, (3,), 7, False, True),
    (4, (3,), 1000, True, False),
]
IMPL_DTYPES = ([(impl, d) for impl in ("cpu_c", "chunked", "composite") for d in FAST]
               + [("composite", "float64")])


def _inputs(seed, n, batch, dim, per_token, gain, dtype):
    gen = torch.Generator().manual_seed(seed)
    xs = [rand(gen, batch + (dim,), dtype) for _ in range(n)]
    q = rand(gen, (batch + (dim,)) if per_token else (dim,), dtype, 0.5)
    g = (torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if gain else None
    return gen, xs, q, g


def _run_vs_reference(xs_in, q, g, impl, dname, **opts):
    """Forward + backward through attnres_torch and the float64 reference, compared."""
    gen = torch.Generator().manual_seed(99)
    xs_l, q_l, g_l = leaves(xs_in), leaves(q), leaves(g)
    lse_wanted = opts.get("activation", "softmax") == "softmax"
    with at.use_impl(impl):
        res = at.depth_attention(xs_l, q_l, g_l, return_lse=lse_wanted, **opts)
        assert at.last_impl() == impl
    out, lse = res if lse_wanted else (res, None)
    assert out.dtype == (xs_l[0].dtype if isinstance(xs_l, list) else xs_l.dtype)
    d_out = rand(gen, out.shape, out.dtype)
    d_lse = None if lse is None else rand(gen, lse.shape, lse.dtype)
    torch.autograd.backward([out] + ([lse] if lse is not None else []),
                            [d_out] + ([d_lse] if lse is not None else []))
    r = ref.depth_attention(f64(xs_in), f64(q), f64(g), return_lse=lse_wanted, **opts)
    r_out, r_lse = r if lse_wanted else (r, None)
    assert_close(out, r_out, dname, "out", grad=False)
    if lse is not None:
        assert lse.dtype == (torch.float64 if dname == "float64" else torch.float32)
        assert_close(lse, r_lse, compute_dtype(dname), "lse", grad=False)
    v = ref.depth_attention_vjp(f64(xs_in), f64(q), f64(g), f64(d_out), f64(d_lse), **opts)
    grads = [x.grad for x in xs_l] if isinstance(xs_l, list) else xs_l.grad
    assert_close(grads, v["sources"], dname, "d_sources", grad=True)
    assert q_l.grad.dtype == q.dtype
    assert_close(q_l.grad, v["query"], dname, "d_query", grad=True)
    if g is not None:
        assert_close(g_l.grad, v["norm_weight"], dname, "d_norm_weight", grad=True)
    return out


@pytest.mark.parametrize("impl,dname", IMPL_DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_depth_attention_matches_reference(impl, dname, case):
    n, batch, dim, per_token, gain = CASES[case]
    _, xs, q, g = _inputs(case, n, batch, dim, per_token, gain, DTYPES[dname])
    out = _run_vs_reference(xs, q, g, impl, dname)
    if n == 1:  # C7: one source returns it exactly
        assert torch.equal(out, xs[0])


@pytest.mark.parametrize("dname", ["float32", "bfloat16"])
def test_stacked_equals_list_and_reference(dname):
    _, xs, q, g = _inputs(5, 6, (9,), 16, False, True, DTYPES[dname])
    stacked = torch.stack(xs)
    with at.use_impl("chunked"):
        a = at.depth_attention(xs, q, g)
        b = at.depth_attention(stacked, q, g)
    assert torch.equal(a, b)
    _run_vs_reference(stacked, q, g, "chunked", dname)


@pytest.mark.parametrize("impl", ["cpu_c", "chunked", "composite"])
def test_row_strided_inputs(impl):
    """Sources, query and gain that are slices of wider rows (unit stride along D): every fast
    path reads them in place."""
    gen = torch.Generator().manual_seed(3)
    xs = [rand(gen, (7, 40), torch.float32)[:, 5:29] for _ in range(4)]
    q = rand(gen, (7, 40), torch.float32)[:, 3:27]
    assert not xs[0].is_contiguous() and xs[0].stride() == (40, 1)
    _run_vs_reference(xs, q, None, impl, "float32")


@pytest.mark.parametrize("impl", ["chunked", "composite"])
def test_strided_inputs(impl):
    gen = torch.Generator().manual_seed(3)
    wide = [rand(gen, (7, 2 * 24), torch.float32) for _ in range(4)]
    xs = [w[:, ::2] for w in wide]  # non-contiguous [7, 24]
    q = rand(gen, (7, 48), torch.float32)[:, 1::2]
    g = (torch.rand(48, generator=gen) + 0.5)[::2]
    assert not xs[0].is_contiguous() and not q.is_contiguous() and not g.is_contiguous()
    _run_vs_reference(xs, q, g, impl, "float32")
    if impl == "chunked":  # the C kernel needs unit stride along D: the dispatch passes to "chunked"
        at.depth_attention(xs, q, g)
        assert at.last_impl() == "chunked"


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("opts", [dict(num_heads=2), dict(activation="sigmoid"),
                                  dict(key_norm=False), dict(eps=1e-2, scale=0.7),
                                  dict(num_heads=4, activation="sigmoid", key_norm=False)],
                         ids=["heads", "sigmoid", "no_key_norm", "eps_scale", "all"])
def test_options_match_reference(dname, opts):
    _, xs, q, g = _inputs(11, 5, (2, 3), 16, True, True, DTYPES[dname])
    default_op = opts.get("num_heads", 1) == 1 and "activation" not in opts and "key_norm" not in opts
    impl = "cpu_c" if default_op and dname != "float64" else "composite"
    at.depth_attention(xs, q, g, **opts)
    assert at.last_impl() == impl  # the dispatch picks it by itself
    _run_vs_reference(xs, q, g, impl, dname, **opts)


@pytest.mark.parametrize("impl,heads", [("cpu_c", 1), ("chunked", 1), ("composite", 1), ("composite", 2)])
def test_return_weights(impl, heads):
    _, xs, q, g = _inputs(4, 5, (6,), 8, False, True, torch.float32)
    with at.use_impl(impl):
        out, lse, w = at.depth_attention(xs, q, g, num_heads=heads, return_lse=True,
                                         return_weights=True)
    r_out, r_lse, r_w = ref.depth_attention(f64(xs), f64(q), f64(g), num_heads=heads,
                                            return_lse=True, return_weights=True)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert_close(w, r_w, "float32", "weights", grad=False)
    assert_close(lse, r_lse, "float32", "lse", grad=False)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("gain", [True, False])
def test_multi_matches_reference(dname, gain):
    dtype = DTYPES[dname]
    gen = torch.Generator().manual_seed(21)
    xs = [rand(gen, (3, 11, 37), dtype) for _ in range(4)]
    qs = rand(gen, (3, 37), dtype, 0.5)
    gs = (torch.rand(3, 37, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if gain else None
    xs_l, qs_l, gs_l = leaves(xs), leaves(qs), leaves(gs)
    out, lse = at.depth_attention_multi(xs_l, qs_l, gs_l)
    assert at.last_impl() == ("composite" if dname == "float64" else "cpu_c")
    d_out, d_lse = rand(gen, out.shape, out.dtype), rand(gen, lse.shape, lse.dtype)
    torch.autograd.backward([out, lse], [d_out, d_lse])
    r_out, r_lse = ref.depth_attention_multi(f64(xs), f64(qs), f64(gs))
    assert_close(out, r_out, dname, "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(dname), "lse", grad=False)
    v = ref.depth_attention_multi_vjp(f64(xs), f64(qs), f64(gs), f64(d_out), f64(d_lse))
    assert_close([x.grad for x in xs_l], v["sources"], dname, "d_sources", grad=True)
    assert_close(qs_l.grad, v["queries"], dname, "d_queries", grad=True)
    if gain:
        assert_close(gs_l.grad, v["norm_weights"], dname, "d_norm_weights", grad=True)


def _merge_inputs(seed, dtype, batch, dim, per_token, lse_dtype):
    """(gen, out1, lse1, partial, query, gain) for merge_partial: `batch + (dim,)` tensors."""
    gen = torch.Generator().manual_seed(seed)
    out1, partial = rand(gen, batch + (dim,), dtype), rand(gen, batch + (dim,), dtype)
    lse1 = rand(gen, batch, lse_dtype)
    q = rand(gen, batch + (dim,) if per_token else (dim,), dtype, 0.5)
    g = (torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    return gen, out1, lse1, partial, q, g


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("per_token", [False, True])
def test_merge_matches_reference(dname, per_token):
    dtype = DTYPES[dname]
    gen, out1, lse1, partial, q, g = _merge_inputs(
        8, dtype, (4, 9), 12, per_token, torch.float64 if dname == "float64" else torch.float32)
    ins = leaves([out1, lse1, partial, q, g])
    out, lse = at.merge_partial(*ins, return_lse=True)
    d_out, d_lse = rand(gen, out.shape, out.dtype), rand(gen, lse.shape, lse.dtype)
    torch.autograd.backward([out, lse], [d_out, d_lse])
    r_out, r_lse = ref.merge_partial(*f64([out1, lse1, partial, q, g]), return_lse=True)
    assert_close(out, r_out, dname, "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(dname), "lse", grad=False)
    v = ref.merge_partial_vjp(*f64([out1, lse1, partial, q, g]), f64(d_out), f64(d_lse))
    for name, t in zip(("out1", "lse1", "partial", "query", "norm_weight"), ins):
        assert_close(t.grad, v[name], dname, f"d_{name}", grad=True)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("per_token", [False, True])
def test_merge_without_grad_takes_the_fused_kernel(dname, per_token):
    dtype = DTYPES[dname]
    # lse1 in float64 whatever the other dtypes: any floating dtype is accepted (C14)
    _, out1, lse1, partial, q, g = _merge_inputs(9, dtype, (3, 7), 37, per_token, torch.float64)
    with torch.no_grad():
        out, lse = at.merge_partial(out1, lse1, partial, q, g, return_lse=True)
    assert at.last_impl() == ("composite" if dname == "float64" else "cpu_c")
    r_out, r_lse = ref.merge_partial(*f64([out1, lse1, partial, q, g]), return_lse=True)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dname == "float64" else torch.float32)
    assert_close(out, r_out, dname, "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(dname), "lse", grad=False)


def test_two_phase_ops_equal_direct():
    gen = torch.Generator().manual_seed(2)
    xs = [rand(gen, (5, 20), torch.float32) for _ in range(3)]
    partial = rand(gen, (5, 20), torch.float32)
    qs, gs = rand(gen, (2, 20), torch.float32), torch.rand(2, 20, generator=gen) + 0.5
    out1, lse1 = at.depth_attention_multi(xs, qs, gs)
    for s in range(2):
        merged, lse = at.merge_partial(out1[s], lse1[s], partial, qs[s], gs[s], return_lse=True)
        direct, d_lse = at.depth_attention(xs + [partial], qs[s], gs[s], return_lse=True)
        torch.testing.assert_close(merged, direct, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, d_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["cpu_c", "chunked", "composite"])
def test_deterministic_and_inputs_unmodified(impl):
    _, xs, q, g = _inputs(13, 7, (300,), 64, False, True, torch.float32)
    copies = [t.clone() for t in xs + [q, g]]

    def run():
        xs_l, q_l, g_l = leaves(xs), leaves(q), leaves(g)
        with at.use_impl(impl):
            out, lse = at.depth_attention(xs_l, q_l, g_l, return_lse=True)
        (out * torch.arange(64.0)).sum().add(lse.sum()).backward()
        return [out, lse] + [x.grad for x in xs_l] + [q_l.grad, g_l.grad]

    a, b = run(), run()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for t, c in zip(xs + [q, g], copies):
        assert torch.equal(t, c)


@pytest.mark.parametrize("call,err,match", [
    (lambda x, q: at.depth_attention([], q), ValueError, "N >= 1"),
    (lambda x, q: at.depth_attention({"x": x}, q), TypeError, "sources: expected a sequence"),
    (lambda x, q: at.depth_attention([x, x[:2]], q), ValueError, r"sources\[1\]: shape"),
    (lambda x, q: at.depth_attention([x, x.double()], q), TypeError, "share one dtype"),
    (lambda x, q: at.depth_attention([x.int()], q), TypeError, r"sources\[0\]: expected a floating"),
    (lambda x, q: at.depth_attention([x], q[:3]), ValueError, "query: expected shape"),
    (lambda x, q: at.depth_attention([x], q.int()), TypeError, "query: expected a floating"),
    (lambda x, q: at.depth_attention([x], q, q[:2]), ValueError, "norm_weight: expected shape"),
    (lambda x, q: at.depth_attention([x], q, eps=0.0), ValueError, "eps"),
    (lambda x, q: at.depth_attention([x], q, num_heads=3), ValueError, "not divisible"),
    (lambda x, q: at.depth_attention([x], q, activation="relu"), ValueError, "activation"),
    (lambda x, q: at.depth_attention([x], q, activation="sigmoid", return_lse=True), ValueError,
     "return_lse"),
    (lambda x, q: at.depth_attention([x], q.numpy()), TypeError, "query: expected a torch.Tensor"),
    (lambda x, q: at.depth_attention([x, x.numpy()], q), TypeError, r"sources\[1\]: expected a torch"),
    (lambda x, q: at.depth_attention([x], q.to("meta")), ValueError, "every tensor must be on one device"),
    (lambda x, q: at.depth_attention_multi([x], q), ValueError, r"queries: expected shape \[S, D\]"),
    (lambda x, q: at.merge_partial(x, x[:, 0], x[:2], q), ValueError, "out1: shape"),
])
def test_errors(call, err, match):
    x, q = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(err, match=match):
        call(x, q)


def test_forcing_cpu_on_unsupported_call_raises():
    x, q = torch.randn(4, 8), torch.randn(8)
    with at.use_impl("chunked"), pytest.raises(ValueError, match="impl: 'chunked'"):
        at.depth_attention([x], q, num_heads=2)
    with at.use_impl("cpu_c"), pytest.raises(ValueError, match="impl: 'cpu_c'.*unit stride"):
        at.depth_attention([torch.randn(4, 16)[:, ::2]], q)
    with at.use_impl("cpu_c"), pytest.raises(ValueError, match="impl: 'cpu_c'"):
        at.depth_attention_multi([torch.randn(4, 16)[:, ::2]], q[None])
    with pytest.raises(ValueError, match="impl: expected one of"):
        with at.use_impl("fast"):
            pass


def test_tolerances_are_tight_enough_to_fail():
    """The comparison (the suite's metric and float32 value row) rejects a result whose every
    element is off by 3 rtol relative (the check can fail)."""
    _, xs, q, g = _inputs(1, 3, (4,), 8, False, True, torch.float32)
    out = at.depth_attention(xs, q, g)
    r = ref.depth_attention(f64(xs), f64(q), f64(g))
    assert_close(out, r, "float32", grad=False)
    with pytest.raises(AssertionError, match="rel_err"):
        assert_close(out, r * (1 + 3 * TOLERANCES["float32"].value), "float32", grad=False)


def test_forcing_is_per_thread_and_every_call_is_counted():
    """`use_impl` is a context variable (one thread's forcing is not another's) and the
    counters behind `impl_counts` lose no call when threads run the ops at once."""
    import threading

    xs, q = [torch.randn(4, 8) for _ in range(3)], torch.randn(8)
    names, calls, seen = ("cpu_c", "chunked", "composite"), 50, {}
    start = threading.Barrier(len(names))

    def worker(name):
        with at.use_impl(name):
            start.wait()
            for _ in range(calls):
                at.depth_attention(xs, q)
                seen.setdefault(name, set()).add(at.dispatch.forced())

    before = at.impl_counts()
    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = at.impl_counts()
    assert seen == {n: {n} for n in names}
    assert all(after[n] - before[n] == calls for n in names)
    assert at.dispatch.forced() is None


def test_merge_partial_goes_through_the_dispatch_choice():
    """Forced: a kernel with a merge serves it or raises its refusal; an implementation
    without one (chunked, composite) and a merge needing gradients get the composition."""
    xs, q = [torch.randn(4, 8) for _ in range(3)], torch.randn(8)
    with torch.no_grad():
        out1, lse1 = at.depth_attention_multi(xs, torch.randn(2, 8))
        for name, want in (("cpu_c", "cpu_c"), ("chunked", "composite"), ("composite", "composite")):
            with at.use_impl(name):
                at.merge_partial(out1[0], lse1[0], xs[0], q)
            assert at.last_impl() == want
        with at.use_impl("cpu_c"), pytest.raises(ValueError, match="impl: 'cpu_c'.*unit stride"):
            at.merge_partial(out1[0], lse1[0], torch.randn(4, 16)[:, ::2], q)
    with at.use_impl("cpu_c"):
        at.merge_partial(out1[0], lse1[0], xs[0], q.requires_grad_(True))
    assert at.last_impl() == "composite"
