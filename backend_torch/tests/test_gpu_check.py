"""bench/gpu_check.py and its peer adapters (bench/peers), on the CPU (issue 13, item 3).

- Fake-peer tests (always run): each adapter is given a stand-in module that records the call
  and computes, in float64, what the peer's documented signature means (read from the peers'
  released sources, versions in `peers.PEER_VERSIONS`).  They check the argument mapping (order,
  stacking, folding of gain and scale into the query, bf16 query for fast-attnres) against the
  float64 reference on the upcast inputs, and the gradient of the adapter's leaves with a random
  cotangent.  They do not run the peers' kernels: that is what the real-peer tests below and the
  GPU run do.
- Real-peer tests (skip when the peer is not importable, e.g. in CI; `bench/fetch_peers.sh` puts
  them in bench/.peers/site): FLA's mapping through FLA's own pure-torch `naive_attnres`, Liger's
  Triton kernel under TRITON_INTERPRET=1 (subprocess).
- The dry run: the whole gpu_check script on the CPU at tiny shapes (interpreted kernels), in a
  subprocess, under 90 s; no row may fail (a failure is a bug in the script, not a skip).
"""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from _helpers import assert_close, f64, rand
from attnres_numpy import ops

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import peers  # noqa: E402

N, T, D, EPS, SCALE = 3, 5, 16, 1e-6, 0.7


# ---------------------------------------------------------------- fake peers (documented semantics)

def _read64(values, w_query, w_norm, eps, scale):
    """What the peers' calls mean, in float64: values list of `[..., D]`; w_query `[D]`; w_norm
    `[D]` or None -> (out, lse)."""
    v = torch.stack([x.double() for x in values])
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    if w_norm is not None:
        k = k * w_norm.double()
    z = scale * (k * w_query.double()).sum(-1)
    return (torch.softmax(z, 0).unsqueeze(-1) * v).sum(0), torch.logsumexp(z, 0)


def fake_fla(calls):
    def fused_attnres(query, residuals, rms_weight, output_rms_weight=None, rms_eps=1e-6,
                      scale=1.0, return_weights=False, checkpoint_level=1):
        calls.append(dict(query=query, residuals=residuals, rms_weight=rms_weight,
                          output_rms_weight=output_rms_weight, rms_eps=rms_eps, scale=scale,
                          return_weights=return_weights, checkpoint_level=checkpoint_level))
        return _read64(residuals, query, rms_weight, rms_eps, scale)[0]
    return types.SimpleNamespace(fused_attnres=fused_attnres)


def fake_liger(calls):
    def liger_attn_res(V, w_query, w_norm, eps=1e-6):
        calls.append(dict(V=V, w_query=w_query, w_norm=w_norm, eps=eps))
        return _read64(list(V), w_query, w_norm, eps, 1.0)[0]
    return types.SimpleNamespace(liger_attn_res=liger_attn_res)


def fake_fast(calls):
    def attnres(values, query, *, eps=2.0 ** -23, scale=1.0):
        assert query.dtype == torch.bfloat16, "fast-attnres takes a bf16 query"
        calls.append(dict(values=values, query=query, eps=eps, scale=scale))
        return _read64(values, query, None, eps, scale)[0]
    return types.SimpleNamespace(attnres=attnres)


def fake_far(calls):
    def phase_1_batched_attention_triton_op(block_representations, pseudo_queries, eps):
        calls.append(dict(blocks=block_representations, queries=pseudo_queries, eps=eps))
        outs = [_read64(list(block_representations), w, None, eps, 1.0) for w in pseudo_queries]
        return torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs])

    def phase_2_online_softmax_merge_triton_op(partial, query, out1, lse1, eps):
        calls.append(dict(partial=partial, query=query, out1=out1, lse1=lse1, eps=eps))
        p = partial.double()
        z = ((p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps)) * query.double()).sum(-1)
        lse = torch.logaddexp(lse1.double(), z)
        return (torch.exp(lse1 - lse).unsqueeze(-1) * out1.double()
                + torch.exp(z - lse).unsqueeze(-1) * p)
    return types.SimpleNamespace(
        phase_1_batched_attention_triton_op=phase_1_batched_attention_triton_op,
        phase_2_online_softmax_merge_triton_op=phase_2_online_softmax_merge_triton_op)


def _inputs(dtype, seed=0, gain=True):
    gen = torch.Generator().manual_seed(seed)
    xs = [rand(gen, (T, D), dtype) for _ in range(N)]
    q = rand(gen, (D,), torch.float32)
    g = rand(gen, (D,), torch.float32) + 1.5 if gain else None
    return peers.Inputs(xs, q, g, EPS, SCALE)


def _ref(inp, query=None, gain="same"):
    q = inp.query if query is None else query
    g = inp.gain if gain == "same" else gain
    return ops.depth_attention(f64(inp.sources), f64(q), f64(g), eps=inp.eps, scale=inp.scale)


def _d_sources_via_leaf(ad, inp, leaf_is_stack):
    """Gradient of the adapter's first leaf with a random cotangent, against the reference VJP."""
    prep = ad.prepare(inp, requires_grad=True)
    out = ad.forward(prep)
    cot = rand(torch.Generator().manual_seed(7), (T, D), out.dtype)
    grads = torch.autograd.grad(out, prep.leaves[:1] if leaf_is_stack else prep.leaves[:N], cot)
    ref = ops.depth_attention_vjp(f64(inp.sources), f64(inp.query), f64(inp.gain), f64(cot),
                                  eps=inp.eps, scale=inp.scale)["sources"]
    got = list(grads[0].reshape(N, T, D)) if leaf_is_stack else list(grads)
    return got, ref


# ---------------------------------------------------------------- fake-peer tests

def test_fla_adapter_mapping_and_gradient():
    calls, ad = [], peers.FLA()
    ad.mod = fake_fla(calls)
    inp = _inputs(torch.float32)
    prep = ad.prepare(inp)
    out = ad.forward(prep)
    c = calls[0]
    assert c["query"] is inp.query and c["rms_weight"] is inp.gain
    assert all(a is b for a, b in zip(c["residuals"], inp.sources)), "FLA takes the list, no copy"
    assert (c["output_rms_weight"], c["rms_eps"], c["scale"], c["return_weights"],
            c["checkpoint_level"]) == (None, EPS, SCALE, False, 1)
    assert_close(out, _ref(inp), "float32", "fla out", grad=False)
    got, ref = _d_sources_via_leaf(ad, inp, leaf_is_stack=False)
    assert_close(got, ref, "float32", "fla d_sources", grad=True)


def test_fla_adapter_without_gain_passes_ones():
    calls, ad = [], peers.FLA()
    ad.mod = fake_fla(calls)
    inp = _inputs(torch.float32, seed=1, gain=False)
    out = ad.forward(ad.prepare(inp))
    assert torch.equal(calls[0]["rms_weight"], torch.ones(D))
    assert_close(out, _ref(inp), "float32", "fla out, no gain", grad=False)


def test_liger_adapter_stacks_in_prepare_and_folds_scale():
    calls, ad = [], peers.Liger()
    ad.mod = fake_liger(calls)
    inp = _inputs(torch.float32, seed=2)
    prep = ad.prepare(inp)
    assert prep.args[0].shape == (N, T, D), "stacked once, outside the timed call"
    out = ad.forward(prep)
    assert calls[0]["V"] is prep.args[0]
    torch.testing.assert_close(calls[0]["w_query"], inp.query * SCALE, rtol=0, atol=0)
    assert calls[0]["w_norm"] is inp.gain and calls[0]["eps"] == EPS
    assert_close(out, _ref(inp), "float32", "liger out", grad=False)
    got, ref = _d_sources_via_leaf(ad, inp, leaf_is_stack=True)
    assert_close(got, ref, "float32", "liger d_sources (grad of the stack)", grad=True)


def test_fast_attnres_adapter_folds_gain_into_a_bf16_query():
    calls, ad = [], peers.FastAttnRes()
    ad.mod = fake_fast(calls)
    inp = _inputs(torch.bfloat16, seed=3)
    out = ad.forward(ad.prepare(inp))
    c = calls[0]
    folded = (inp.query * inp.gain).to(torch.bfloat16)
    assert torch.equal(c["query"], folded) and c["eps"] == EPS and c["scale"] == SCALE
    assert all(a is b for a, b in zip(c["values"], inp.sources))
    # exact mapping: the reference with the bf16-rounded folded query and no gain
    assert_close(out, _ref(inp, query=folded.float(), gain=None), "float32", "fast out", grad=False)
    # and the rounding is the only difference from our read (bf16 row)
    assert_close(out, _ref(inp), "bfloat16", "fast out vs unrounded", grad=False)


def test_flash_attn_res_adapter_read_phase1_and_merge():
    calls, ad = [], peers.FlashAttnRes()
    ad.mod = fake_far(calls)
    inp = _inputs(torch.bfloat16, seed=4)
    prep = ad.prepare(inp)
    assert prep.args[0].shape == (N, 1, T, D) and prep.args[1].shape == (1, D)
    out = ad.forward(prep)
    assert out.shape == (T, D)
    assert_close(out, _ref(inp), "float32", "flash-attn-res read", grad=False)
    got, ref = _d_sources_via_leaf(ad, inp, leaf_is_stack=True)
    assert_close(got, ref, "bfloat16", "flash-attn-res d_sources (bf16 leaf)", grad=True)

    gen = torch.Generator().manual_seed(5)
    qs, gs = rand(gen, (4, D), torch.float32), rand(gen, (4, D), torch.float32) + 1.5
    out1, lse1 = ad.phase1(inp, qs, gs)()
    r_out, r_lse = ops.depth_attention_multi(f64(inp.sources), f64(qs), f64(gs), eps=EPS,
                                             scale=SCALE)
    assert_close(out1.reshape(4, T, D), r_out, "float32", "phase 1 out", grad=False)
    assert_close(lse1.reshape(4, T), r_lse, "float32", "phase 1 lse", grad=False)
    partial = rand(gen, (T, D), torch.bfloat16)
    m = ad.merge(out1[1].reshape(T, D), lse1[1].reshape(T), partial, qs[1], gs[1], EPS, SCALE)()
    r_m = ops.merge_partial(f64(out1[1].reshape(T, D)), f64(lse1[1].reshape(T)), f64(partial),
                            f64(qs[1]), f64(gs[1]), eps=EPS, scale=SCALE)
    assert_close(m.reshape(T, D), r_m, "float32", "merge out", grad=False)


def test_eager_composite_value_and_gradients():
    """The composite computes in fp32 (as a user would write it): float32 inputs, float32 row."""
    ad = peers.Eager()
    inp = _inputs(torch.float32, seed=6)
    prep = ad.prepare(inp, requires_grad=True)
    out = ad.forward(prep)
    assert_close(out, _ref(inp), "float32", "eager out", grad=False)
    cot = rand(torch.Generator().manual_seed(8), (T, D), torch.float32)
    grads = torch.autograd.grad(out, prep.leaves, cot)
    ref = ops.depth_attention_vjp(f64(inp.sources), f64(inp.query), f64(inp.gain), f64(cot),
                                  eps=EPS, scale=SCALE)
    assert_close(list(grads[:N]), ref["sources"], "float32", "eager d_sources", grad=True)
    assert_close(grads[N], ref["query"], "float32", "eager d_query", grad=True)
    assert_close(grads[N + 1], ref["norm_weight"], "float32", "eager d_gain", grad=True)
    gen = torch.Generator().manual_seed(9)
    qs, gs = rand(gen, (2, D), torch.float32), rand(gen, (2, D), torch.float32)
    o1, l1 = ad.phase1(inp, qs, gs)()
    r1, rl = ops.depth_attention_multi(f64(inp.sources), f64(qs), f64(gs), eps=EPS, scale=SCALE)
    assert_close(o1, r1, "float32", "eager phase 1", grad=False)
    assert_close(l1, rl, "float32", "eager phase 1 lse", grad=False)
    partial = rand(gen, (T, D), torch.float32)
    m, ml = ad.merge(o1[0], l1[0], partial, qs[0], gs[0], EPS, SCALE)()
    rm, rml = ops.merge_partial(f64(o1[0]), f64(l1[0]), f64(partial), f64(qs[0]), f64(gs[0]),
                                eps=EPS, scale=SCALE, return_lse=True)
    assert_close(m, rm, "float32", "eager merge", grad=False)
    assert_close(ml, rml, "float32", "eager merge lse", grad=False)


@pytest.mark.parametrize("adapter, dtype, d, per_token, reason", [
    (peers.FLA, torch.bfloat16, D, False, "CUDA tensors only"),
    (peers.FastAttnRes, torch.bfloat16, D, False, "CUDA tensors only"),
    (peers.Liger, torch.float32, D, True, "per-token queries"),
    (peers.FlashAttnRes, torch.float32, D, False, "bf16 only"),
    (peers.FlashAttnRes, torch.bfloat16, 48, False, "power-of-two D only"),
])
def test_unsupported_calls_say_why(adapter, dtype, d, per_token, reason):
    gen = torch.Generator().manual_seed(10)
    xs = [rand(gen, (T, d), dtype) for _ in range(N)]
    q = rand(gen, (T, d) if per_token else (d,), torch.float32)
    with pytest.raises(peers.Unsupported, match=reason):
        adapter().check(peers.Inputs(xs, q, None, EPS, SCALE))


def test_missing_peer_is_unsupported_not_an_error():
    ad = peers.Liger()
    ad.module = "attnres_no_such_peer_module"
    with pytest.raises(peers.Unsupported, match="not importable: ModuleNotFoundError"):
        ad.load()


def test_environment_is_set_only_around_the_calls():
    ad = peers.FLAGluon()
    before = os.environ.get("FLA_ATTNRES_GLUON")
    with ad.environment():
        assert os.environ["FLA_ATTNRES_GLUON"] == "1"
    assert os.environ.get("FLA_ATTNRES_GLUON") == before


def test_peer_cap_interrupts_a_slow_peer_and_keeps_it_out():
    import gpu_check
    caps = gpu_check.Caps(section_cap=60.0, peer_cap=0.3, total=60.0)
    caps.start_section("forward")
    t0 = time.perf_counter()
    with pytest.raises(gpu_check.Timeout, match="slow peer: over its 0 s cap"):
        with caps.guard("slow peer"):
            time.sleep(5)                      # stands in for an autotuning loop
    assert time.perf_counter() - t0 < 2
    with pytest.raises(gpu_check.Timeout, match="slow peer"):
        with caps.guard("slow peer"):          # its cap is spent: refused at once
            pass
    with caps.guard("other peer"):             # the others keep theirs
        pass
    caps.start_section("merge")
    caps.section_end = time.perf_counter() - 1
    with pytest.raises(gpu_check.Timeout, match="section 'merge'"):
        with caps.guard(None):
            pass


class _FakeCuda:
    """The `torch.cuda` calls gpu_check's Timer makes, on the host clock: lets the CPU run the CUDA
    branch of `Timer.measure` (graph capture, its fallback, events) that the dry run cannot."""

    def __init__(self, capture_fails):
        self.capture_fails, self.captures, self.syncs = capture_fails, 0, 0
        cuda = self

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                self.t = time.perf_counter()

            def synchronize(self):
                cuda.syncs += 1

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        class Stream:
            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def replay(self):
                self.fn()

        self.Event, self.Stream, self.CUDAGraph = Event, Stream, CUDAGraph

    def synchronize(self):
        self.syncs += 1

    def current_stream(self):
        return self.Stream()

    def stream(self, s):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def graph(self, g):
        self.captures += 1
        if self.capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield
        g.fn = self.last_fn                     # replay re-runs the captured call


@pytest.mark.parametrize("capture_fails", [False, True])
def test_timer_cuda_branch_graph_replay_and_fallback(capture_fails):
    import gpu_check
    cuda = _FakeCuda(capture_fails)
    calls = []

    def fn():
        calls.append(1)
        cuda.last_fn = fn
    timer = gpu_check.Timer(types.SimpleNamespace(cuda=cuda), "cuda", target_ms=5.0, max_iters=7,
                            latency_calls=3)
    m = timer.measure(fn, graph=True)
    assert cuda.captures == 1 and m["iters"] == 7 and m["kernel_ms"] >= 0 and m["call_ms"] >= 0
    if capture_fails:
        assert m["method"].startswith("back-to-back (graph capture failed: RuntimeError")
    else:
        assert m["method"] == "CUDA graph replay"
    # warm-up 1 + one-call estimate 1 + side-stream warm-up 2 (+1 captured) + 1 + 7 timed + 3 latency
    assert len(calls) == (1 + 1 + 2 + (0 if capture_fails else 1) + 1 + 7 + 3)
    m = timer.measure(fn, graph=False)
    assert m["method"] == "back-to-back" and cuda.captures == 1


def _fake_td():
    """Our kernels' host API (`triton_depth`) stood in for by the composites, so Bench's sections
    run on the CPU without the interpreter."""
    def backward(xs, q, g, out, lse, d_out, d_lse, eps, scale):
        leaves = [x.detach().requires_grad_(True) for x in xs] + [
            q.detach().requires_grad_(True), g.detach().requires_grad_(True)]
        o = peers.naive(leaves[:-2], leaves[-2], leaves[-1], eps, scale)[0]
        grads = torch.autograd.grad(o, leaves, d_out)
        return list(grads[:-2]), grads[-2], grads[-1]
    return types.SimpleNamespace(
        forward=lambda xs, q, g, eps, scale: peers.naive(xs, q, g, eps, scale),
        backward=backward,
        multi_forward=lambda xs, qs, gs, eps, scale: peers.naive_multi(xs, qs, gs, eps, scale),
        merge_forward=peers.naive_merge)


def test_bench_sections_with_every_peer_present(monkeypatch):
    """Every timing section of Bench with every peer "installed" (the fake modules above; their
    CUDA-only checks lifted): no row fails, each peer is timed where it can express the call and
    skipped with its reason where not (flash-attn-res at D = 48)."""
    import gpu_check
    fakes = {peers.FLA: fake_fla, peers.Liger: fake_liger, peers.FastAttnRes: fake_fast,
             peers.FlashAttnRes: fake_far}

    def adapters():
        out = []
        for cls in (peers.Eager, peers.FLA, peers.Liger, peers.FastAttnRes, peers.FlashAttnRes):
            ad = cls()
            ad.cuda_only = False
            if cls in fakes:
                ad.mod = fakes[cls]([])
            out.append(ad)
        return out
    monkeypatch.setattr(peers, "all_adapters", adapters)
    args = gpu_check.parse_args(["--device", "cpu", "--quick", "--skip-jax", "--skip-compile",
                                 "--max-iters", "1", "--latency-calls", "1", "--target-ms", "1"])
    bench = gpu_check.Bench(args, torch, _fake_td(), peers, timing_budget=120.0)
    bench.run()
    rows = bench.rows
    assert not [r for r in rows if r["status"] == "failed"], [r for r in rows if r["status"] == "failed"]
    ok = {(r["section"], r["case"], r["impl"]) for r in rows if r["status"] == "ok"}
    for name in ("fla fused_attnres", "liger attn_res", "fast-attnres", "flash-attn-res"):
        for sec in ("forward", "backward only", "forward+backward"):
            assert (sec, "N=3 T=8 D=64 bf16", name) in ok, (sec, name)
    for sec in ("phase 1", "merge"):
        assert (sec, "3 blocks x 4 queries, T=8 D=64 bf16", "flash-attn-res") in ok
        (skip,) = [r for r in rows if r["section"] == sec and r["impl"] == "flash-attn-res"
                   and "D=48" in r["case"]]
        assert skip["status"] == "skipped" and "power-of-two D" in skip["note"]
    diffs = [r["note"] for r in rows if r["impl"] == "flash-attn-res" and r["status"] == "ok"
             and r["section"] in ("forward", "phase 1", "merge")]
    assert diffs and all("max |out - ours|" in n for n in diffs)


# ---------------------------------------------------------------- real peers

peers.add_peer_site()


def _importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(not _importable("fla"), reason="flash-linear-attention (fla-core) not "
                    "importable: run bench/fetch_peers.sh")
@pytest.mark.parametrize("gain", [True, False])
def test_fla_mapping_through_fla_naive_reference(gain):
    """FLA's own pure-torch reference has fused_attnres's signature: the adapter's call through it
    equals our float64 reference (float32 inputs)."""
    naive = pytest.importorskip("fla.ops.attnres").naive_attnres
    ad = peers.FLA()
    calls = []

    def fused_attnres(*args):  # naive_attnres has no checkpoint_level (a memory knob only)
        calls.append(args[7])
        return naive(*args[:7])
    ad.mod = types.SimpleNamespace(fused_attnres=fused_attnres)
    inp = _inputs(torch.float32, seed=11, gain=gain)
    assert_close(ad.forward(ad.prepare(inp)), _ref(inp), "float32", "fla naive_attnres", grad=False)
    assert calls == [1]


LIGER_SCRIPT = r"""
import sys, torch
sys.path[:0] = [{bench!r}, {tests!r}, {ref!r}]
import peers
peers.add_peer_site()
from _helpers import assert_close, f64, rand
from attnres_numpy import ops
ad = peers.Liger()
ad.load()
gen = torch.Generator().manual_seed(12)
for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
    xs = [rand(gen, (5, 48), dtype) for _ in range(3)]
    q, g = rand(gen, (48,), torch.float32), rand(gen, (48,), torch.float32) + 1.5
    inp = peers.Inputs(xs, q, g, 1e-6, 0.7)
    ad.check(inp)
    prep = ad.prepare(inp, requires_grad=True)
    out = ad.forward(prep)
    assert_close(out, ops.depth_attention(f64(xs), f64(q), f64(g), eps=1e-6, scale=0.7), name,
                 "liger interpreted", grad=False)
    cot = rand(gen, (5, 48), dtype)
    (dv,) = torch.autograd.grad(out, prep.leaves[:1], cot)
    ref = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(cot), eps=1e-6, scale=0.7)
    assert_close(list(dv), ref["sources"], name, "liger interpreted d_sources", grad=True)
print("liger ok")
"""


@pytest.mark.triton
@pytest.mark.skipif(not _importable("liger_kernel") or not _importable("triton"),
                    reason="liger-kernel or triton not importable: run bench/fetch_peers.sh")
def test_liger_kernel_interpreted_against_float64_reference():
    script = LIGER_SCRIPT.format(bench=str(ROOT / "bench"), tests=str(Path(__file__).parent),
                                 ref=str(ROOT / "reference_numpy" / "src"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0 and "liger ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ---------------------------------------------------------------- the dry run

@pytest.mark.triton
@pytest.mark.skipif(not _importable("triton"), reason="Triton is not installed")
def test_gpu_check_dry_run(tmp_path):
    """The whole script on the CPU at tiny shapes: correctness (interpreted kernels), distributed
    smoke on gloo, every timing section; JSON and markdown written; no row failed."""
    # as on the GPU machine, none of our packages is installed: the editable installs' src
    # folders are taken off sys.path before the script runs (it must find them in the tree)
    script = str(ROOT / "bench" / "gpu_check.py")
    wrapper = ("import runpy, sys; from pathlib import Path; "
               f"root = Path({str(ROOT)!r}); "
               "sys.path[:] = [p for p in sys.path if not (Path(p).name == 'src' and "
               "root in Path(p).parents)]; "
               f"sys.argv = [{script!r}, '--dry-run', '--out-dir', {str(tmp_path)!r}]; "
               f"runpy.run_path({script!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True,
                          timeout=150)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.md").read_text().startswith("### Depth attention on CPU")
    assert report["correctness"]["passed"] > 100 and not report["correctness"]["failures"]
    assert report["distributed"] == "PASS"
    rows = report["rows"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert not failed, f"rows failed in the dry run (a bug in the script): {failed}"
    sections = {r["section"] for r in rows}
    torch_sections = {"forward", "backward only", "forward+backward", "phase 1", "merge", "block"}
    assert torch_sections <= sections, sections
    # the JAX section runs in a child (this interpreter: rows, or one row saying jax is absent)
    assert sections - torch_sections <= {"jax", "jax forward", "jax forward+backward"}, sections
    for r in rows:
        if r["status"] == "ok":
            assert r["kernel_ms"] > 0 and r["call_ms"] > 0 and r["gbs"] > 0, r
        else:
            assert r["status"] == "skipped" and r["note"], r
    ours = [r for r in rows if r["impl"] == "attnres triton kernels"]
    assert len(ours) == 8 and all(r["status"] == "ok" for r in ours), ours
    assert report["total_s"] < 90, f"dry run took {report['total_s']:.0f} s (budget 90 s)"
