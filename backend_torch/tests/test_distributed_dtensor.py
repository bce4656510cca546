"""The attnres ops on DTensors (`attnres_torch.dtensor`'s sharding strategies) on a local gloo world
of 2 CPU processes: every op on sources sharded over a token dim (even and uneven) or replicated
gives outputs placed as promised whose gathered values and gradients (random cotangents) equal the
float64 reference; D-sharded sources are redistributed to Replicate; and DTensor tensor + sequence
parallelism (`parallelize_module`, Colwise/Rowwise) of an `AttnResTransformer` block with the
router's parameters replicated gives the one-process loss and gradients."""

from __future__ import annotations

import attnres_torch
import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close, f64, rand
from attnres_numpy import ops as ref
from attnres_torch import AttnResTransformer, ResidualConfig
from attnres_torch.distributed import depth_attention_tp, run_local
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

N, SHAPE, S = 3, (4, 5, 8), 2  # sources N x [B, T, D] (T = 5: uneven shards of 3 and 2); S queries
KERNELS = ("cpu_c", "chunked")  # float32 on the CPU: the custom ops, not the composition


def _inputs():
    gen = torch.Generator().manual_seed(11)
    x = [rand(gen, SHAPE, torch.float32) for _ in range(N)]
    t = dict(x=x, q=rand(gen, SHAPE[-1:], torch.float32), qt=rand(gen, SHAPE, torch.float32),
             g=rand(gen, SHAPE[-1:], torch.float32, 0.3) + 1, w=rand(gen, SHAPE[-1:], torch.float32, 0.3) + 1,
             qs=rand(gen, (S, SHAPE[-1]), torch.float32), gs=rand(gen, (S, SHAPE[-1]), torch.float32, 0.3) + 1)
    t.update(d_out=rand(gen, SHAPE, torch.float32), d_normed=rand(gen, SHAPE, torch.float32),
             d_lse=rand(gen, SHAPE[:-1], torch.float32), d_out_s=rand(gen, (S,) + SHAPE, torch.float32),
             d_lse_s=rand(gen, (S,) + SHAPE[:-1], torch.float32))
    return t


def _full(t):
    """The global tensor of a DTensor (a list: each); a Partial one is reduced."""
    if isinstance(t, (list, tuple)):
        return [_full(a) for a in t]
    return t.full_tensor() if isinstance(t, DTensor) else t


def _leaves(mesh, t, place):
    """DTensor leaves of the token tensors (`place`) and of the replicated `[D]` / `[S, D]` ones."""
    def dt(a, p):
        return distribute_tensor(a, mesh, [p]).requires_grad_()
    rep = Replicate()
    return dict(x=[dt(a, place) for a in t["x"]], q=dt(t["q"], rep), qt=dt(t["qt"], place),
                g=dt(t["g"], rep), w=dt(t["w"], rep), qs=dt(t["qs"], rep), gs=dt(t["gs"], rep))


def _dot(mesh, y, c, place):
    """<y, c> for a DTensor y and a full cotangent c (distributed like y)."""
    return (y * distribute_tensor(c, mesh, list(y.placements))).sum()


def _check(name, got, want, dtype, grad):
    assert_close(_full(got), want, dtype, name, grad=grad)


def _placed(name, t, want):
    assert tuple(t.placements) == (want,), f"{name}: placements {t.placements}, expected {want}"


def _ops_on(mesh, t, place, d):
    """Every op on sources placed `place`; d: its token dim (None: replicated).  Returns the local
    outputs and gradients of the first case (the determinism check)."""
    tok = Replicate() if d is None else Shard(d)
    lead = Replicate() if d is None else Shard(d + 1)
    red = Replicate() if d is None else Partial()
    x64, q64, qt64, g64, w64 = f64(t["x"]), f64(t["q"]), f64(t["qt"]), f64(t["g"]), f64(t["w"])
    c = {k: f64(t[k]) for k in ("d_out", "d_normed", "d_lse", "d_out_s", "d_lse_s")}

    # depth_attention: static query, gain, lse and weights; cotangents on out and lse.
    a = _leaves(mesh, t, place)
    out, lse, weights = attnres_torch.depth_attention(a["x"], a["q"], a["g"], return_lse=True,
                                                      return_weights=True)
    assert attnres_torch.last_impl() in KERNELS, attnres_torch.last_impl()
    for nm, y, p in (("out", out, tok), ("lse", lse, tok), ("weights", weights, lead)):
        _placed(nm, y, p)
    want = ref.depth_attention(x64, q64, g64, return_lse=True, return_weights=True)
    for nm, y, w, dt in zip(("out", "lse", "weights"), (out, lse, weights), want,
                            ("float32",) * 3):
        _check(f"{place} {nm}", y, w, dt, False)
    (_dot(mesh, out, t["d_out"], place) + _dot(mesh, lse, t["d_lse"], place)).backward()
    vjp = ref.depth_attention_vjp(x64, q64, g64, c["d_out"], c["d_lse"])
    _placed("d_sources", a["x"][0].grad, tok)
    _placed("d_query", a["q"].grad, red)
    _placed("d_norm_weight", a["g"].grad, red)
    _check(f"{place} d_sources", [s.grad for s in a["x"]], vjp["sources"], "float32", True)
    _check(f"{place} d_query", a["q"].grad, vjp["query"], "float32", True)
    _check(f"{place} d_norm_weight", a["g"].grad, vjp["norm_weight"], "float32", True)
    first = [out.to_local(), lse.to_local()] + [s.grad.to_local() for s in a["x"]] + [a["q"].grad.to_local()]

    # Per-token query, no gain, only out used: lse's cotangent is autograd's plain zeros.
    a = _leaves(mesh, t, place)
    out = attnres_torch.depth_attention(a["x"], a["qt"], None)
    _placed("out (per-token query)", out, tok)
    _check(f"{place} out (per-token query)", out, ref.depth_attention(x64, qt64, None), "float32", False)
    _dot(mesh, out, t["d_out"], place).backward()
    vjp = ref.depth_attention_vjp(x64, qt64, None, c["d_out"])
    _placed("d_query (per token)", a["qt"].grad, tok)
    _check(f"{place} d_sources (per-token query)", [s.grad for s in a["x"]], vjp["sources"], "float32", True)
    _check(f"{place} d_query (per token)", a["qt"].grad, vjp["query"], "float32", True)

    # The fused output norm (C17) without weights (their output is [0]), then with them (the
    # sharding cache tells the two apart); lse unused.
    a = _leaves(mesh, t, place)
    with torch.no_grad():
        out, normed = attnres_torch.depth_attention(a["x"], a["q"], a["g"], out_norm_weight=a["w"])
    _placed("out_normed (out norm, no weights)", normed, tok)
    out, normed, lse, weights = attnres_torch.depth_attention(
        a["x"], a["q"], a["g"], out_norm_weight=a["w"], return_lse=True, return_weights=True)
    assert attnres_torch.last_impl() in KERNELS, attnres_torch.last_impl()
    for nm, y, p in (("out", out, tok), ("out_normed", normed, tok), ("lse", lse, tok),
                     ("weights", weights, lead)):
        _placed(f"{nm} (out norm)", y, p)
    want = ref.depth_attention(x64, q64, g64, out_norm_weight=w64, return_lse=True, return_weights=True)
    for nm, y, w in zip(("out", "out_normed", "lse", "weights"), (out, normed, lse, weights), want):
        _check(f"{place} {nm} (out norm)", y, w, "float32", False)
    (_dot(mesh, out, t["d_out"], place) + _dot(mesh, normed, t["d_normed"], place)).backward()
    vjp = ref.depth_attention_vjp(x64, q64, g64, c["d_out"], out_norm_weight=w64,
                                  d_out_normed=c["d_normed"])
    _placed("d_out_norm_weight", a["w"].grad, red)
    _check(f"{place} d_sources (out norm)", [s.grad for s in a["x"]], vjp["sources"], "float32", True)
    for nm in ("q", "g", "w"):
        key = {"q": "query", "g": "norm_weight", "w": "out_norm_weight"}[nm]
        _check(f"{place} d_{key} (out norm)", a[nm].grad, vjp[key], "float32", True)

    # Phase 1 (leading S dim) and the phase-2 merge (no gradient: the composition; with one).
    a = _leaves(mesh, t, place)
    out1, lse1 = attnres_torch.depth_attention_multi(a["x"], a["qs"], a["gs"])
    assert attnres_torch.last_impl() in KERNELS, attnres_torch.last_impl()
    _placed("multi out", out1, lead)
    _placed("multi lse", lse1, lead)
    qs64, gs64 = f64(t["qs"]), f64(t["gs"])
    want = ref.depth_attention_multi(x64, qs64, gs64)
    _check(f"{place} multi out", out1, want[0], "float32", False)
    _check(f"{place} multi lse", lse1, want[1], "float32", False)
    (_dot(mesh, out1, t["d_out_s"], place) + _dot(mesh, lse1, t["d_lse_s"], place)).backward()
    vjp = ref.depth_attention_multi_vjp(x64, qs64, gs64, c["d_out_s"], c["d_lse_s"])
    _check(f"{place} multi d_sources", [s.grad for s in a["x"]], vjp["sources"], "float32", True)
    _check(f"{place} multi d_queries", a["qs"].grad, vjp["queries"], "float32", True)
    _check(f"{place} multi d_norm_weights", a["gs"].grad, vjp["norm_weights"], "float32", True)
    o1, l1 = out1[0].detach(), lse1[0].detach()
    with torch.no_grad():
        merged, mlse = attnres_torch.merge_partial(o1, l1, a["x"][2], a["q"], a["g"], return_lse=True)
    assert attnres_torch.last_impl() == "composite", attnres_torch.last_impl()
    want = ref.merge_partial(f64(_full(o1)), f64(_full(l1)), x64[2], q64, g64, return_lse=True)
    _placed("merge out", merged, tok)
    _check(f"{place} merge out", merged, want[0], "float32", False)
    _check(f"{place} merge lse", mlse, want[1], "float32", False)
    o1.requires_grad_()
    merged = attnres_torch.merge_partial(o1, l1, a["x"][2], a["q"], a["g"])
    _dot(mesh, merged, t["d_out"], place).backward()
    vjp = ref.merge_partial_vjp(f64(_full(o1)), f64(_full(l1)), x64[2], q64, g64, c["d_out"])
    _check(f"{place} merge d_out1", o1.grad, vjp["out1"], "float32", True)
    _check(f"{place} merge d_query", a["q"].grad, vjp["query"], "float32", True)
    return first


def _ops_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    t = _inputs()
    for place, d in ((Shard(0), 0), (Shard(1), 1), (Replicate(), None)):
        first = _ops_on(mesh, t, place, d)
        again = _ops_on(mesh, t, place, d)  # determinism: forward + backward bitwise identical
        assert all(torch.equal(u, v) for u, v in zip(first, again)), f"{place}: not deterministic"

    # D-sharded sources (no local strategy): DTensor all-gathers them to Replicate; the values
    # and gradients stay exact.
    a = _leaves(mesh, t, Shard(2))
    x64, q64, g64 = f64(t["x"]), f64(t["q"]), f64(t["g"])
    out, lse = attnres_torch.depth_attention(a["x"], a["q"], a["g"], return_lse=True)
    _placed("out (D-sharded sources)", out, Replicate())
    _placed("lse (D-sharded sources)", lse, Replicate())
    want = ref.depth_attention(x64, q64, g64, return_lse=True)
    _check("Shard(2) out", out, want[0], "float32", False)
    _check("Shard(2) lse", lse, want[1], "float32", False)
    (_dot(mesh, out, t["d_out"], None) + _dot(mesh, lse, t["d_lse"], None)).backward()
    vjp = ref.depth_attention_vjp(x64, q64, g64, f64(t["d_out"]), f64(t["d_lse"]))
    _check("Shard(2) d_sources", [s.grad for s in a["x"]], vjp["sources"], "float32", True)
    _check("Shard(2) d_query", a["q"].grad, vjp["query"], "float32", True)
    _check("Shard(2) d_norm_weight", a["g"].grad, vjp["norm_weight"], "float32", True)

    # The all-reduce form on the same D-sharded DTensors: depth_attention_tp without shard=.
    a = _leaves(mesh, t, Shard(2))
    a.update({k: distribute_tensor(t[k], mesh, [Shard(0)]).requires_grad_() for k in ("q", "g", "w")})
    out, normed, lse = depth_attention_tp(a["x"], a["q"], a["g"], out_norm_weight=a["w"], return_lse=True)
    for nm, y, p in (("out", out, Shard(2)), ("out_normed", normed, Shard(2)), ("lse", lse, Replicate())):
        _placed(f"{nm} (depth_attention_tp)", y, p)
    w64 = f64(t["w"])
    want = ref.depth_attention(x64, q64, g64, out_norm_weight=w64, return_lse=True)
    for nm, y, w in zip(("out", "out_normed", "lse"), (out, normed, lse), want):
        _check(f"depth_attention_tp {nm}", y, w, "float32", False)
    (_dot(mesh, out, t["d_out"], None) + _dot(mesh, normed, t["d_normed"], None)
     + (lse * distribute_tensor(t["d_lse"], mesh, [Replicate()])).sum()).backward()
    vjp = ref.depth_attention_vjp(x64, q64, g64, f64(t["d_out"]), f64(t["d_lse"]), out_norm_weight=w64,
                                  d_out_normed=f64(t["d_normed"]))
    _check("depth_attention_tp d_sources", [s.grad for s in a["x"]], vjp["sources"], "float32", True)
    for nm, key in (("q", "query"), ("g", "norm_weight"), ("w", "out_norm_weight")):
        _placed(f"d_{key} (depth_attention_tp)", a[nm].grad, Shard(0))
        _check(f"depth_attention_tp d_{key}", a[nm].grad, vjp[key], "float32", True)
    b = _leaves(mesh, t, Shard(1))
    with pytest.raises(TypeError, match=r"sources\[0\]: without shard=.*Shard\(-1\)"):
        depth_attention_tp(b["x"], b["q"], b["g"])
    return True


def test_ops_on_dtensors_equal_reference():
    assert run_local(_ops_worker, 2) == [True, True]


# -- DTensor tensor + sequence parallelism of one Transformer block --------------------------------

V, D, H, B, T = 32, 16, 2, 2, 6
#: Loss and gradients of the 2-rank run against the one-process run (float32; the TP matmuls
#: and the sequence-sharded sums add in another order): max |difference| / max |one-process|.
TP_RTOL = 1e-5


def _model(kind):
    torch.manual_seed(0)
    model = AttnResTransformer(V, D, 1, H, ResidualConfig.variant(kind, block_size=2)
                               if kind == "block" else ResidualConfig.variant(kind))
    with torch.no_grad():  # nonzero pseudo-queries: depth weights far from uniform
        for p in model.router.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _qkv_rows(world):
    """Rows of the fused qkv weight in rank-major order [q_r, k_r, v_r]: ColwiseParallel's
    contiguous split then gives each rank the q, k and v of its own heads."""
    per = D // world
    return torch.cat([torch.arange(c * D + r * per, c * D + (r + 1) * per)
                      for r in range(world) for c in range(3)])


def _parallelize(model, mesh, world):
    """Megatron tensor + sequence parallelism: the residual stream (embedding, every sublayer
    output, hence every depth-attention source) is a DTensor sharded over the sequence, the
    router's and the norms' parameters are replicated DTensors, attention heads and MLP columns
    are split."""
    from torch.distributed.tensor import distribute_module

    attn = model.sublayers[0].fn
    with torch.no_grad():
        attn.qkv.weight.copy_(attn.qkv.weight[_qkv_rows(world)])
    attn.num_heads = H // world
    seq = Shard(1)
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
        "sublayers.0.norm": SequenceParallel(),
        "sublayers.0.fn.qkv": ColwiseParallel(input_layouts=seq),
        "sublayers.0.fn.proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "sublayers.1.norm": SequenceParallel(),
        "sublayers.1.fn.up": ColwiseParallel(input_layouts=seq),
        "sublayers.1.fn.down": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    })
    distribute_module(model.router, mesh)  # the router's parameters: replicated DTensors
    return model


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _tp_worker(rank, world, kind):
    mesh = init_device_mesh("cpu", (world,))
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    one = _model(kind)
    loss1 = F.cross_entropy(one(tokens).flatten(0, 1), tokens.flatten())
    loss1.backward()
    tp = _parallelize(_model(kind), mesh, world)
    seen = []
    tp.router.register_forward_hook(lambda m, i, o: seen.append(tuple(o.placements)))
    loss = F.cross_entropy(tp(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    assert seen == [(Shard(1),)], seen  # the router ran on sequence-sharded DTensors
    report = {"loss": abs(loss.item() - loss1.item()) / abs(loss1.item())}
    grads1 = {n: p.grad for n, p in one.named_parameters()}
    grads1["sublayers.0.fn.qkv.weight"] = grads1["sublayers.0.fn.qkv.weight"][_qkv_rows(world)]
    for n, p in tp.named_parameters():
        assert isinstance(p, DTensor), n
        if n.startswith("router."):
            assert p.placements == (Replicate(),) and p.grad.placements == (Partial(),), n
        report[n] = _rel(p.grad.full_tensor(), grads1[n])
    if kind == "block":  # eval: the two-phase schedule (phase 1 + merge) on the sharded stream
        one.eval(), tp.eval()
        with torch.no_grad():
            report["eval logits"] = _rel(tp(tokens), one(tokens))
        assert tp.router.active_schedule() == "two_phase"
    return report


@pytest.mark.parametrize("kind", ["block", "full"])
def test_tensor_sequence_parallel_block_equals_one_process(kind):
    reports = run_local(_tp_worker, 2, kind)
    for report in reports:
        assert len(report) > 10, report
        bad = {k: v for k, v in report.items() if not v <= TP_RTOL}
        assert not bad, bad
