"""The chunked torch kernel ("chunked"): chosen by the dispatch, writes every element (NaN-poisoned
buffers), handles chunk remainders, and matches the float64 reference."""

from __future__ import annotations

import attnres_torch as at
import pytest
import torch
from _helpers import assert_close, compute_dtype, f64, rand
from attnres_numpy import ops as ref
from attnres_torch.kernels import chunked


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows at D = 20 (so T = 10 leaves a remainder chunk of 1 row)."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 3 * 4 * 20)


def _case(per_token: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(4)
    xs = [rand(gen, (10, 20), dtype) for _ in range(5)]
    q = rand(gen, (10, 20) if per_token else (20,), torch.float32, 0.5)
    g = torch.rand(20, generator=gen) + 0.5
    return gen, xs, q, g


def test_dispatch_picks_chunked_kernel_for_d_strided_sources():
    x = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]
    before = at.impl_counts()["chunked"]
    strided = [torch.randn(4, 16)[:, ::2] for _ in range(3)]
    at.depth_attention_multi(strided, torch.randn(2, 8))
    assert at.last_impl() == "chunked" and at.impl_counts()["chunked"] == before + 1
    at.depth_attention(strided, torch.randn(8))
    assert at.last_impl() == "chunked" and at.impl_counts()["chunked"] == before + 2
    at.depth_attention([t.double() for t in x], torch.randn(8))
    assert at.last_impl() == "composite"


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_write_every_element(small_chunks, per_token, dtype):
    gen, xs, q, g = _case(per_token, dtype)
    qg = q * g
    out = torch.full((10, 20), float("nan"), dtype=dtype)
    lse = torch.full((10,), float("nan"))
    chunked.forward_into(xs, qg, 1e-6, 1.0, out, lse)
    r_out, r_lse = ref.depth_attention(f64(xs), f64(qg), None, return_lse=True)
    name = "float32" if dtype == torch.float32 else "bfloat16"
    assert_close(out, r_out, name, "out", grad=False)
    assert_close(lse, r_lse, compute_dtype(name), "lse", grad=False)
    d_out = rand(gen, (10, 20), dtype)
    d_src = [torch.full((10, 20), float("nan"), dtype=dtype) for _ in xs]
    d_qg = chunked.backward_into(xs, qg, lse, d_out, None, 1e-6, 1.0, d_src)
    v = ref.depth_attention_vjp(f64(xs), f64(qg), None, f64(d_out))
    assert_close(d_src, v["sources"], name, "d_sources", grad=True)
    assert_close(d_qg, v["query"], name, "d_qg", grad=True)


def test_multi_forward_writes_every_element(small_chunks):
    gen, xs, _, _ = _case(False)
    qgs = rand(gen, (3, 20), torch.float32, 0.5)
    out = torch.full((3, 10, 20), float("nan"))
    lse = torch.full((3, 10), float("nan"))
    chunked.multi_forward_into(xs, qgs, 1e-6, 1.0, out, lse)
    r_out, r_lse = ref.depth_attention_multi(f64(xs), f64(qgs))
    assert_close(out, r_out, "float32", "out", grad=False)
    assert_close(lse, r_lse, "float32", "lse", grad=False)


def test_public_op_with_remainder_chunks(small_chunks):
    gen, xs, q, g = _case(True)
    with at.use_impl("chunked"):
        out, lse = at.depth_attention(xs, q, g, return_lse=True)
    r_out, r_lse = ref.depth_attention(f64(xs), f64(q), f64(g), return_lse=True)
    assert_close(out, r_out, "float32", "out", grad=False)
    assert_close(lse, r_lse, "float32", "lse", grad=False)


def test_nan_propagates_per_token():
    """C12: a NaN in one token's source gives NaN for that token only."""
    xs = [torch.randn(4, 8) for _ in range(3)]
    xs[1][2, 3] = float("nan")
    out = at.depth_attention(xs, torch.randn(8))
    assert torch.isnan(out[2]).all() and torch.isfinite(out[[0, 1, 3]]).all()
