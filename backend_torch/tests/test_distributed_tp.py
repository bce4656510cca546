"""Hidden-dimension (tensor-parallel) depth attention on local gloo worlds of 2 and 3 CPU
processes: forward, lse and every gradient equal the float64 reference on upcast inputs and the
single-process `attnres_torch.depth_attention`; the all-reduces carry 2NH (forward) and NH
(backward) scalars per token."""

from __future__ import annotations

import attnres_torch
import numpy as np
import pytest
import torch
from _helpers import assert_close, f64, rand
from attnres_numpy import ops as ref
from attnres_torch.distributed import CommCounter, HiddenShard, depth_attention_tp, run_local

# (name, dtype, N, token shape, D, options, per-token query, gain)
CASES = [
    ("f64_softmax", "float64", 4, (2, 3), 10, dict(), False, True),
    ("f32_softmax", "float32", 3, (5,), 12, dict(scale=0.7, eps=1e-5), False, True),
    ("f16_softmax", "float16", 3, (4,), 9, dict(), False, True),
    ("f64_sigmoid_token_query", "float64", 3, (2, 2), 10, dict(activation="sigmoid"), True, False),
    ("f64_heads_no_key_norm", "float64", 4, (3,), 10, dict(num_heads=2, key_norm=False), False, True),
    ("f64_heads", "float64", 2, (3,), 12, dict(num_heads=3), True, True),
    ("f64_one_source", "float64", 1, (3,), 8, dict(), False, True),
]


def _inputs(case):
    name, dt, n, tok, dim, opts, per_token, gain = case
    gen = torch.Generator().manual_seed(len(name) * 1000 + n)
    dtype = getattr(torch, dt)
    xs = [rand(gen, tok + (dim,), dtype) for _ in range(n)]
    q = rand(gen, (tok + (dim,)) if per_token else (dim,), torch.float32)
    g = rand(gen, (dim,), torch.float64, 0.5) + 1 if gain else None
    d_out = rand(gen, tok + (dim,), dtype).double()  # exact in the dtype the op's cotangent has
    h = opts.get("num_heads", 1)
    lse = opts.get("activation", "softmax") == "softmax"
    d_lse = rand(gen, tok + ((h,) if h > 1 else ()), torch.float64) if lse else None
    return xs, q, g, d_out, d_lse


def _sharded_run(case, shard, counter):
    name, dt, n, tok, dim, opts, per_token, gain = case
    xs, q, g, d_out, d_lse = _inputs(case)
    lx = [shard.local(x).clone().requires_grad_() for x in xs]
    lq = shard.local(q).clone().requires_grad_()
    lg = None if g is None else shard.local(g).clone().requires_grad_()
    res = depth_attention_tp(lx, lq, lg, shard=shard, return_lse=d_lse is not None,
                             counter=counter, **opts)
    out, lse = res if d_lse is not None else (res, None)
    loss = (out.double() * shard.local(d_out)).sum()
    if lse is not None:
        loss = loss + (lse.double() * d_lse).sum()
    loss.backward()
    return out, lse, [x.grad for x in lx], lq.grad, None if lg is None else lg.grad


def _worker(rank, world):
    report = {"sizes": HiddenShard.even(10, None).sizes}
    for case in CASES:
        name, dt, n, tok, dim, opts, per_token, gain = case
        shard = HiddenShard.even(dim, None)
        counter = CommCounter()
        out, lse, dxs, dq, dg = _sharded_run(case, shard, counter)
        xs, q, g, d_out, d_lse = _inputs(case)
        assert out.dtype == xs[0].dtype and dxs[0].dtype == xs[0].dtype and dq.dtype == q.dtype
        # float64 reference on the upcast inputs, then this rank's slice.
        x64, q64, g64 = f64(xs), f64(q), f64(g)
        want = ref.depth_attention(x64, q64, g64, return_lse=d_lse is not None, **opts)
        want_out, want_lse = want if d_lse is not None else (want, None)
        vjp = ref.depth_attention_vjp(x64, q64, g64, f64(d_out), f64(d_lse), **opts)
        sl = slice(shard.offset, shard.offset + shard.local_size)
        tol = dt  # outputs and source gradients round once to the sources' dtype
        ctol = "float64" if dt == "float64" else "float32"  # compute dtype (lse, gain gradient)
        assert_close(out, want_out[..., sl], tol, f"{name} out", grad=False)
        if lse is not None:
            assert_close(lse, want_lse, ctol, f"{name} lse", grad=False)
        assert_close(dxs, [d[..., sl] for d in vjp["sources"]], tol, f"{name} d_sources", grad=True)
        assert_close(dq, vjp["query"][..., sl], "float32", f"{name} d_query", grad=True)  # query is float32
        if g is not None:
            assert_close(dg, vjp["norm_weight"][sl], ctol, f"{name} d_norm_weight", grad=True)
        # The single-process torch op on the full tensors gives the same slice.
        fx = [x.clone().requires_grad_() for x in xs]
        fq = q.clone().requires_grad_()
        res = attnres_torch.depth_attention(fx, fq, g, return_lse=d_lse is not None, **opts)
        f_out = res[0] if d_lse is not None else res
        loss = (f_out.double() * d_out).sum() + (0 if d_lse is None else (res[1].double() * d_lse).sum())
        loss.backward()
        assert_close(out, f64(f_out)[..., sl], tol, f"{name} out vs single process", grad=False)
        assert_close(dxs, [f64(x.grad)[..., sl] for x in fx], tol, f"{name} d_sources vs single", grad=True)
        assert_close(dq, f64(fq.grad)[..., sl], "float32", f"{name} d_query vs single process", grad=True)
        # Communication: scalars per token and source (and head).
        h, tokens = opts.get("num_heads", 1), int(np.prod(tok))
        per = 2 if opts.get("key_norm", True) else 1
        assert counter.elements == {"tp.forward": per * n * h * tokens, "tp.backward": n * h * tokens}, \
            (name, counter.elements)
        # Determinism: a second run is bitwise identical.
        again = _sharded_run(case, shard, None)
        assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(dxs, again[2]))
        assert torch.equal(dq, again[3])
    # Bad input: a source that is not this rank's slice.
    shard = HiddenShard.even(10, None)
    with pytest.raises(ValueError, match=r"sources\[1\].*D_r"):
        depth_attention_tp([torch.zeros(2, shard.local_size), torch.zeros(2, 10)],
                           torch.zeros(shard.local_size), shard=shard)
    with pytest.raises(ValueError, match="num_heads"):
        depth_attention_tp([torch.zeros(2, shard.local_size)], torch.zeros(shard.local_size),
                           shard=shard, num_heads=3)
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_equals_reference_and_single_process(world):
    reports = run_local(_worker, world)
    sizes = reports[0]["sizes"]
    assert sum(sizes) == 10 and len(sizes) == world



# -- C17: the fused output norm over hidden shards ---------------------------------------------------
# (name, dtype, N, token shape, D, options, out_norm_eps)
OUT_NORM_CASES = [
    ("f64_heads", "float64", 3, (2, 3), 12, dict(num_heads=3), None),
    ("f32_eps", "float32", 4, (5,), 10, dict(eps=1e-5), 1e-3),
    ("bf16", "bfloat16", 3, (4,), 9, dict(), None),
]


def _worker_out_norm(rank, world):
    """out, out_normed, lse and every gradient (random cotangents on all three outputs) against
    the float64 reference's slice; 2NH + T scalars per token forward, NH + T backward; bitwise
    repeatable."""
    for name, dt, n, tok, dim, opts, on_eps in OUT_NORM_CASES:
        gen = torch.Generator().manual_seed(len(name) * 77 + n)
        dtype = getattr(torch, dt)
        xs = [rand(gen, tok + (dim,), dtype) for _ in range(n)]
        q, g = rand(gen, (dim,), torch.float32), rand(gen, (dim,), torch.float32, 0.5) + 1
        w = rand(gen, (dim,), torch.float32, 0.3) + 1
        h = opts.get("num_heads", 1)
        d_out, d_normed = rand(gen, tok + (dim,), dtype).double(), rand(gen, tok + (dim,), dtype).double()
        d_lse = rand(gen, tok + ((h,) if h > 1 else ()), torch.float64)
        shard = HiddenShard.even(dim, None)
        sl = slice(shard.offset, shard.offset + shard.local_size)

        def run(counter):
            lx = [shard.local(x).clone().requires_grad_() for x in xs]
            lq, lg, lw = (shard.local(t).clone().requires_grad_() for t in (q, g, w))
            out, normed, lse = depth_attention_tp(lx, lq, lg, shard=shard, return_lse=True, counter=counter,
                                                  out_norm_weight=lw, out_norm_eps=on_eps, **opts)
            loss = ((out.double() * d_out[..., sl]).sum() + (normed.double() * d_normed[..., sl]).sum()
                    + (lse.double() * d_lse).sum())
            loss.backward()
            return out, normed, lse, [x.grad for x in lx], lq.grad, lg.grad, lw.grad

        counter = CommCounter()
        out, normed, lse, dxs, dq, dg, dw = run(counter)
        assert normed.dtype == dtype and dw.dtype == w.dtype
        x64, q64, g64, w64 = f64(xs), f64(q), f64(g), f64(w)
        want_out, want_normed, want_lse = ref.depth_attention(
            x64, q64, g64, return_lse=True, out_norm_weight=w64, out_norm_eps=on_eps, **opts)
        vjp = ref.depth_attention_vjp(x64, q64, g64, f64(d_out), f64(d_lse), out_norm_weight=w64,
                                      out_norm_eps=on_eps, d_out_normed=f64(d_normed), **opts)
        ctol = "float64" if dt == "float64" else "float32"
        assert_close(out, want_out[..., sl], dt, f"{name} out", grad=False)
        assert_close(normed, want_normed[..., sl], dt, f"{name} out_normed", grad=False)
        assert_close(lse, want_lse, ctol, f"{name} lse", grad=False)
        assert_close(dxs, [d[..., sl] for d in vjp["sources"]], dt, f"{name} d_sources", grad=True)
        assert_close(dq, vjp["query"][sl], "float32", f"{name} d_query", grad=True)
        assert_close(dg, vjp["norm_weight"][sl], "float32", f"{name} d_norm_weight", grad=True)
        assert_close(dw, vjp["out_norm_weight"][sl], "float32", f"{name} d_out_norm_weight", grad=True)
        tokens = int(np.prod(tok))
        assert counter.elements == {"tp.forward": (2 * n * h + 1) * tokens,
                                    "tp.backward": (n * h + 1) * tokens}, (name, counter.elements)
        again = run(None)
        assert torch.equal(normed, again[1]) and torch.equal(dw, again[6])
        assert all(torch.equal(a, b) for a, b in zip(dxs, again[3]))
    shard = HiddenShard.even(10, None)
    with pytest.raises(ValueError, match="out_norm_weight"):
        depth_attention_tp([torch.zeros(2, shard.local_size)], torch.zeros(shard.local_size), shard=shard,
                           out_norm_weight=torch.ones(10))
    return {}


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_fused_output_norm(world):
    run_local(_worker_out_norm, world)
