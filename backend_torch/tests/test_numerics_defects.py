"""Regression tests of the numerical defects of issue 17, on every CPU implementation ("cpu_c",
"chunked", "composite"; the Triton kernels get the same checks in `test_triton_depth.py`, under
the interpreter).  Each compares with the float64 reference on the upcast inputs.

* return_weights at large logits (|z| ~ 50-300): the weights are the p of the kernel's own lse
  (exactly 1 at N = 1, summing to 1), within the fp32 tolerance of the reference's.
* fp32 sources beyond the fp32 range of the sum of squares (|x| >= ~1.8e19, C10.6): the key norm
  is scale-invariant, so forward and gradients equal the reference's.
* source gradients of huge sources (|x| ~ 1e14 .. 1e30; `s r^3` underflows in fp32).
* empty token axis (T = 0), forward and backward, list and stacked sources, per-token query.
* wrong-shape cotangents raise torch autograd's RuntimeError (spec section 7).
* every result is a fresh tensor, even at N = 1 (C7a).
* merge_partial at lse1 - z2 = 12: the partial's weight from its own logistic (spec 3.2), in
  the composition's gradients and the C and Triton (interpreted) forwards.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import attnres_torch as at
import numpy as np
import pytest
import torch
from _helpers import f64, leaves
from attnres_conformance.tolerances import TOLERANCES
from attnres_numpy import ops as ref
from attnres_torch.kernels import cpu_c

IMPLS = ["cpu_c", "chunked", "composite"]


def _impl(name):
    if name == "cpu_c" and not cpu_c.available():
        pytest.skip(f"C kernel unavailable: {cpu_c.unavailable_reason()}")
    return at.dispatch.use_impl(name)


def _rel(got, want) -> float:
    """The suite's metric: max |got - want| / (|want| + rms(want))."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    floor = max(float(np.sqrt(np.mean(want ** 2))), np.finfo(np.float32).tiny)
    return float(np.max(np.abs(got - want) / (np.abs(want) + floor)))


def _large_logit_inputs(n, dim=4096, tokens=6, seed=0):
    """fp32 sources `[tokens, dim]` and a query whose logits reach |z| ~ 50-300 at scale 1."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, dim, generator=gen) for _ in range(n)]
    q = torch.randn(dim, generator=gen) * 3.0
    g = 1.0 + 0.1 * torch.randn(dim, generator=gen)
    return xs, q, g


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_weights_at_large_logits_are_the_p_of_the_lse(impl, n):
    xs, q, g = _large_logit_inputs(n)
    z = ref.depth_attention(f64(xs), f64(q), f64(g), return_lse=True)[1]
    assert np.abs(z).max() > 50  # the regime of the defect (z = lse at N = 1)
    with _impl(impl):
        out, lse, w = at.depth_attention(xs, q, g, return_lse=True, return_weights=True)
    assert w.shape == (n, 6) and w.dtype == torch.float32
    if n == 1:
        assert torch.equal(w, torch.ones_like(w)), w  # C6: p = 1 exactly
        assert torch.equal(out, xs[0])
    assert float((w.double().sum(0) - 1).abs().max()) <= 1e-6
    r_out, r_lse, r_w = ref.depth_attention(f64(xs), f64(q), f64(g), return_lse=True,
                                            return_weights=True)
    tol = TOLERANCES["float32"].value
    assert _rel(f64(w), r_w) <= tol, _rel(f64(w), r_w)
    assert _rel(f64(lse), r_lse) <= tol
    assert _rel(f64(out), r_out) <= tol


def _huge(n, magnitude, dim=64, tokens=3, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(tokens, dim, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
          for _ in range(n)]
    q = 0.2 * torch.randn(dim, generator=gen)  # |z| <~ 4: no fp32 cancellation in dz (p ~ 1)
    g = 1.0 + 0.1 * torch.randn(dim, generator=gen)
    d_out = torch.randn(tokens, dim, generator=gen)
    d_lse = torch.randn(tokens, generator=gen)
    return xs, q, g, d_out, d_lse


def _check_against_reference(impl, xs, q, g, d_out, d_lse):
    """Forward (out, lse, weights) and every gradient within the suite's fp32 tolerances."""
    xl, ql, gl = leaves(xs), leaves(q), leaves(g)
    with _impl(impl):
        out, lse, w = at.depth_attention(xl, ql, gl, return_lse=True, return_weights=True)
    *d_src, d_q, d_g = torch.autograd.grad((out, lse), (*xl, ql, gl),
                                           (d_out.to(out.dtype), d_lse))
    r_out, r_lse, r_w = ref.depth_attention(f64(xs), f64(q), f64(g), return_lse=True,
                                            return_weights=True)
    r_grads = ref.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out.to(out.dtype)), f64(d_lse))
    tol = TOLERANCES[str(out.dtype).replace("torch.", "")]
    for name, got, want in [("out", out, r_out), ("lse", lse, r_lse), ("weights", w, r_w)]:
        rtol = tol.value if name == "out" else TOLERANCES["float32"].value
        assert _rel(f64(got), want) <= rtol, (name, _rel(f64(got), want))
    got_grads = list(d_src) + [d_q, d_g]
    want_grads = list(r_grads["sources"]) + [r_grads["query"], r_grads["norm_weight"]]
    for i, (got, want) in enumerate(zip(got_grads, want_grads)):
        assert torch.isfinite(got).all(), i
        gtol = tol.grad if i < len(xs) else TOLERANCES["float32"].grad
        assert _rel(f64(got), want) <= gtol, (i, _rel(f64(got), want))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("magnitude", [1e18, 1e19, 1e25, 1e30])
def test_key_norm_does_not_overflow_for_huge_fp32_sources(impl, magnitude):
    """Both sides of the fp32 overflow of sum(x^2) (~1.8e19): the results do not change with the
    sources' scale (C10.6)."""
    _check_against_reference(impl, *_huge(3, magnitude))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("magnitude,dtype", [(1e14, torch.float32), (1e20, torch.float32),
                                             (1e14, torch.bfloat16), (1e30, torch.bfloat16)])
def test_source_gradients_of_huge_sources(impl, magnitude, dtype):
    _check_against_reference(impl, *_huge(3, magnitude, dtype=dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_empty_token_axis(impl, stacked, per_token):
    dim = 8
    xs = [torch.randn(2, 0, dim) for _ in range(3)]
    q = torch.randn(2, 0, dim) if per_token else torch.randn(dim)
    g = torch.rand(dim)
    src = leaves(torch.stack(xs)) if stacked else leaves(xs)
    ql, gl = leaves(q), leaves(g)
    with _impl(impl):
        out, lse, w = at.depth_attention(src, ql, gl, return_lse=True, return_weights=True)
        assert out.shape == (2, 0, dim) and lse.shape == (2, 0) and w.shape == (3, 2, 0)
        *d_src, d_q, d_g = torch.autograd.grad((out, lse), (*([src] if stacked else src), ql, gl),
                                               (torch.ones_like(out), torch.ones_like(lse)))
        m_out, m_lse = at.depth_attention_multi(src, torch.randn(4, dim), None)
        assert m_out.shape == (4, 2, 0, dim) and m_lse.shape == (4, 2, 0)
        mg = at.merge_partial(torch.randn(2, 0, dim), torch.randn(2, 0), torch.randn(2, 0, dim),
                              q, g)
        assert mg.shape == (2, 0, dim)
    shapes = [tuple(d.shape) for d in d_src]
    assert shapes == ([(2, 0, dim)] * 3 if not stacked else [(3, 2, 0, dim)])
    assert d_q.shape == q.shape and d_g.shape == (dim,) and torch.equal(d_g, torch.zeros(dim))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", ["d_out", "d_lse"])
def test_wrong_shape_cotangent_raises_autograds_error(impl, bad):
    """Spec section 7: a cotangent of another shape than its output raises the framework's own
    error first; in torch, autograd's RuntimeError naming both shapes."""
    xs = leaves([torch.randn(4, 8) for _ in range(2)])
    with _impl(impl):
        out, lse = at.depth_attention(xs, torch.randn(8), return_lse=True)
    cots = {"d_out": torch.ones(4, 8), "d_lse": torch.ones(4)}
    cots[bad] = torch.ones(5, 8) if bad == "d_out" else torch.ones(5)
    with pytest.raises(RuntimeError) as info:
        torch.autograd.grad((out, lse), xs, (cots["d_out"], cots["d_lse"]))
    frames = [str(entry.path) for entry in info.traceback]
    assert not any("attnres_torch" in f for f in frames), frames  # raised before our backward


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stacked", [False, True])
def test_results_never_alias_inputs_at_n1(impl, stacked):
    """C7a: out equals the source at N = 1 (C6) but is a fresh tensor; so are lse, weights and
    every gradient; writing into out leaves the source unchanged."""
    x = torch.randn(1, 5, 8) if stacked else [torch.randn(5, 8)]
    src = leaves(x)
    q, g = leaves(torch.randn(8)), leaves(torch.rand(8))
    with _impl(impl):
        out, lse, w = at.depth_attention(src, q, g, return_lse=True, return_weights=True)
        grads = torch.autograd.grad((out, lse), (*([src] if stacked else src), q, g),
                                    (torch.ones_like(out), torch.ones_like(lse)))
    inputs = {_storage(t) for t in ([src] if stacked else src) + [q, g]}
    results = [out, lse, w, *grads]
    for i, t in enumerate(results):
        assert _storage(t) not in inputs, f"result {i} shares memory with an input"
    before = src[0].detach().clone()
    assert torch.equal(out, before), "N = 1: out is not the source (C6)"
    out.detach().add_(1.0)
    assert torch.equal(src[0].detach(), before)


def _dominant_phase1_merge(out1_scale, gap=12.0, tokens=3, dim=16, seed=3):
    """merge_partial inputs with lse1 - z2 = gap (the partial's weight w2 ~ e^-gap): fp32
    out1 `[tokens, dim]` (times out1_scale), lse1 `[tokens]`, partial `[tokens, dim]`, query and
    gain `[dim]`, d_out `[tokens, dim]`, d_lse `[tokens]`."""
    gen = torch.Generator().manual_seed(seed)
    partial = torch.randn(tokens, dim, generator=gen)
    q = torch.randn(dim, generator=gen)
    g = 1.0 + 0.1 * torch.randn(dim, generator=gen)
    z2 = ref.depth_attention([f64(partial)], f64(q), f64(g), return_lse=True)[1]  # N = 1: lse = z
    lse1 = torch.from_numpy(z2 + gap).float()
    out1 = torch.randn(tokens, dim, generator=gen) * out1_scale
    return out1, lse1, partial, q, g, torch.randn(tokens, dim, generator=gen), torch.randn(tokens,
                                                                                          generator=gen)


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_partial_weight_is_its_own_logistic(impl):
    """lse1 - z2 = 12: w2 = 1 - w1 would keep ~1% of w2's bits (spec 3.2; reference
    `_merge_prepare`); d_partial, d_query, d_lse1 within the fp32 gradient tolerance."""
    out1, lse1, partial, q, g, d_out, d_lse = _dominant_phase1_merge(1.0)
    ins = leaves([out1, lse1, partial, q, g])
    with _impl(impl):
        out, lse = at.merge_partial(*ins, return_lse=True)
    grads = torch.autograd.grad((out, lse), ins, (d_out, d_lse))
    r = ref.merge_partial_vjp(*f64([out1, lse1, partial, q, g]), f64(d_out), f64(d_lse))
    tol = TOLERANCES["float32"].grad
    for name, got in zip(["out1", "lse1", "partial", "query", "norm_weight"], grads):
        assert _rel(f64(got), r[name]) <= tol, (name, _rel(f64(got), r[name]))


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_partial_forward_weight_is_its_own_logistic(impl):
    """The no-gradient kernels' forward: with out1 = 0, out = w2 partial shows w2's bits."""
    out1, lse1, partial, q, g, _, _ = _dominant_phase1_merge(0.0)
    with _impl(impl), torch.no_grad():
        out = at.merge_partial(out1, lse1, partial, q, g)
    want = ref.merge_partial(*f64([out1, lse1, partial, q, g]))
    assert _rel(f64(out), want) <= TOLERANCES["float32"].value, _rel(f64(out), want)


_TRITON_MERGE_CHECK = """
import numpy as np, torch
from attnres_numpy import ops as ref
from attnres_torch.kernels import triton_depth as td
from test_numerics_defects import _dominant_phase1_merge, _rel
from _helpers import f64
for td._MAX_BLOCK_D, td._TILE_ELEMS in ((16384, 8192), (16, 16)):  # one tile; D walked in tiles
    for dim in (16, 33):
        out1, lse1, partial, q, g, _, _ = _dominant_phase1_merge(0.0, dim=dim)
        out, _ = td.merge_forward(out1, lse1, partial, q, g, 1e-6, 1.0)
        print(_rel(f64(out), ref.merge_partial(*f64([out1, lse1, partial, q, g]))))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_merge_forward_weight_is_its_own_logistic():
    """The Triton `_merge_kernel` under TRITON_INTERPRET=1 (a fresh interpreter: Triton reads it
    at import), out1 = 0 so that out = w2 partial shows w2's bits."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_MERGE_CHECK], cwd=Path(__file__).parent,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = [float(x) for x in proc.stdout.split()]
    assert len(errs) == 4 and max(errs) <= TOLERANCES["float32"].value, errs
