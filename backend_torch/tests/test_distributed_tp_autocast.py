"""`depth_attention_tp` inside `torch.autocast("cpu", torch.bfloat16)` on 2 gloo ranks: its
float32 products stay float32 (C10), so out, lse and every gradient equal the float64 reference
at the float32/float16 tolerance and, bitwise, the run outside autocast (the harness of
`test_distributed_tp.py`)."""

from __future__ import annotations

import torch
from _helpers import assert_close, f64
from attnres_numpy import ops as ref
from attnres_torch.distributed import HiddenShard, depth_attention_tp, run_local
from test_distributed_tp import CASES, _inputs, _sharded_run

#: The cases whose compute dtype autocast would lower (float32 products; float64 it leaves).
AUTOCAST_CASES = [c for c in CASES if c[0] in ("f32_softmax", "f16_softmax")]


def _worker(rank, world):
    for case in AUTOCAST_CASES:
        name, dt, n, tok, dim, opts, per_token, gain = case
        shard = HiddenShard.even(dim, None)
        plain = _sharded_run(case, shard, None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, lse, dxs, dq, dg = _sharded_run(case, shard, None)
        assert out.dtype == getattr(torch, dt) and lse.dtype == torch.float32
        xs, q, g, d_out, d_lse = _inputs(case)
        x64, q64, g64 = f64(xs), f64(q), f64(g)
        want_out, want_lse = ref.depth_attention(x64, q64, g64, return_lse=True, **opts)
        vjp = ref.depth_attention_vjp(x64, q64, g64, f64(d_out), f64(d_lse), **opts)
        sl = slice(shard.offset, shard.offset + shard.local_size)
        assert_close(out, want_out[..., sl], dt, f"{name} out", grad=False)
        assert_close(lse, want_lse, "float32", f"{name} lse", grad=False)
        assert_close(dxs, [d[..., sl] for d in vjp["sources"]], dt, f"{name} d_sources", grad=True)
        assert_close(dq, vjp["query"][..., sl], "float32", f"{name} d_query", grad=True)
        assert_close(dg, vjp["norm_weight"][sl], "float32", f"{name} d_norm_weight", grad=True)
        for got, want in zip((out, lse, *dxs, dq, dg), (plain[0], plain[1], *plain[2], *plain[3:])):
            assert torch.equal(got, want), f"{name}: autocast changed a result"
    # the fused output norm (C17) under autocast: bitwise the plain run
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, 10, generator=gen) for _ in range(3)]
    q, g, w = (torch.randn(10, generator=gen) for _ in range(3))
    shard = HiddenShard.even(10, None)

    def run():
        lx = [shard.local(x).clone().requires_grad_() for x in xs]
        lq, lg, lw = (shard.local(t).clone().requires_grad_() for t in (q, g, w))
        out, normed, lse = depth_attention_tp(lx, lq, lg, shard=shard, return_lse=True,
                                              out_norm_weight=lw)
        (out.sum() + (normed * normed).sum() + lse.sum()).backward()
        return [out, normed, lse] + [t.grad for t in lx + [lq, lg, lw]]

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = run()
    assert all(torch.equal(a, b) for a, b in zip(auto, plain)), "autocast changed the fused norm"
    return {}


def test_tensor_parallel_under_autocast_matches_reference():
    run_local(_worker, 2)
