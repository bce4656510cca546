"""bench/gpu_check.py and its peer adapters (bench/peers), on the CPU (issues 13 and 29).

- Fake-peer tests (always run): each adapter is given a stand-in module that records the call
  and computes, in float64, what the peer's documented signature means (read from the peers'
  released sources, versions in `peers.PEER_VERSIONS`).  They check the argument mapping (order,
  stacking, folding of gain and scale into the query, bf16 query for fast-attnres) against the
  float64 reference on the upcast inputs, and the gradient of the adapter's leaves with a random
  cotangent.  They do not run the peers' kernels: that is what the real-peer tests below and the
  GPU run do.
- The harness in process: caps (SIGALRM) that no `except Exception` swallows, a sticky device
  error ending a child, autotune trimming, the report's atomic files, the watchdog; every
  section of `Bench` in the order of `plan` (the parent fills what a dead child left from it).
- Real-peer tests (skip when the peer is not importable, e.g. in CI; `bench/fetch_peers.sh` puts
  them in bench/.peers/site): FLA's mapping through FLA's own pure-torch `naive_attnres`, Liger's
  Triton kernel under TRITON_INTERPRET=1 (subprocess).
- The dry runs: the whole gpu_check script on the CPU at tiny shapes (interpreted kernels), in a
  subprocess; no row may fail (a failure is a bug in the script, not a skip).  Then the failure
  paths with the fake peers of `gpu_check_fake_peers.py`, each in its own child: one that
  corrupts its process (a CUDA-like error and `os._exit`), one that hangs where its own caps
  cannot fire, one that raises; and a budget that runs out mid-section.  Each leaves a report
  with every row measured before it and a reason for every row after.
"""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import gpu_check  # bench/ is on sys.path (bench/tests/conftest.py)
import peers
import pytest
import torch
from attnres_numpy import ops

from backend_torch.tests._helpers import assert_close, f64, rand  # the torch tests' comparison

ROOT = Path(__file__).resolve().parents[3]
FAKE_PEERS = str(Path(__file__).with_name("gpu_check_fake_peers.py"))
_spec = importlib.util.spec_from_file_location("gpu_check_fake_peers", FAKE_PEERS)
gpu_check_fake_peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check_fake_peers)

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



# ---------------------------------------------------------------- the harness, in process

def _bench(*argv, td=None, torch_module=torch, total=60.0):
    """A Bench on the CPU at the quick shapes whose messages land in the returned list."""
    args = gpu_check.parse_args(["--device", "cpu", "--quick", "--max-iters", "1",
                                 "--latency-calls", "1", "--target-ms", "1", *argv])
    msgs = []
    bench = gpu_check.Bench(args, torch_module, td, peers,
                            lambda kind, **f: msgs.append(dict(f, t=kind)),
                            gpu_check.Caps(total, "test child"), copy_gbs=1.0)
    return bench, msgs


def _rows(msgs):
    return [m for m in msgs if m["t"] == "row"]


def test_caps_interrupt_python_code_and_say_which_cap():
    caps = gpu_check.Caps(60.0, "slow peer")
    t0 = time.perf_counter()
    with pytest.raises(gpu_check.Timeout, match="slow peer: first call over its warm-up cap"):
        with caps.guard(0.3, "slow peer: first call over its warm-up cap"):
            time.sleep(5)                      # stands in for an autotuning loop
    assert time.perf_counter() - t0 < 2
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "the alarm is disarmed"
    caps.end = time.monotonic() - 1            # the child's total spent: refused at once
    with pytest.raises(gpu_check.Timeout, match="slow peer: over its 60 s cap"):
        with caps.guard(10.0, "a warm-up cap that is not the one that binds"):
            pass


def test_a_cap_is_not_swallowed_by_except_exception():
    """A cap that fires inside code catching Exception (a capture fallback, a peer's retry
    loop) still ends the call: a 0.5 s cap once let such a call run 1.56 s, timed as "ok"."""
    caps, swallowed = gpu_check.Caps(60.0, "peer"), []
    t0 = time.perf_counter()
    with pytest.raises(gpu_check.Timeout):
        with caps.guard(0.5, "peer: warm-up cap"):
            for _ in range(40):
                try:
                    time.sleep(0.05)
                except Exception as e:  # noqa: BLE001 - what a peer's own code may do
                    swallowed.append(e)
    assert not swallowed and time.perf_counter() - t0 < 1.2


@pytest.mark.parametrize("handler", ["swallow", "replace"])
def test_a_cap_that_fired_stays_fired(handler):
    """Code that swallows even BaseException, or raises another error while unwinding (as a
    CUDA-graph capture's exit can): the cap fires again every REARM_S seconds and once more when
    the block ends, so the call is still reported as over its cap."""
    caps, seen = gpu_check.Caps(60.0, "peer"), []
    t0 = time.perf_counter()
    with pytest.raises(gpu_check.Timeout, match="warm-up cap"):
        with caps.guard(0.2, "peer: warm-up cap"):
            for _ in range(8):
                try:
                    time.sleep(0.05)
                except BaseException as e:  # noqa: BLE001
                    seen.append(type(e).__name__)
                    if handler == "replace":
                        raise RuntimeError("capture invalidated") from None
    assert seen == ["Timeout"] and time.perf_counter() - t0 < 1.0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_bench_warmup_cap_ends_the_peer_and_says_so_in_its_later_rows():
    bench, msgs = _bench("--warmup-cap", "0.3")

    def autotuning():                          # catches what it can, as autotuners do
        for _ in range(100):
            try:
                time.sleep(0.05)
            except Exception:  # noqa: BLE001, S110
                pass
        return (lambda: None), ""
    t0 = time.perf_counter()
    bench.time("forward", "c", "slow peer", autotuning, 1)
    bench.time("merge", "c", "slow peer", lambda: ((lambda: None), ""), 1)
    assert time.perf_counter() - t0 < 2
    first, second = _rows(msgs)
    assert first["status"] == "timeout" and "0 s warm-up cap" in first["note"], first
    assert second["status"] == "skipped" and "warm-up cap" in second["note"], second
    assert [m["t"] for m in msgs] == ["start", "row", "row"], "no start for a row not attempted"


class _LostCuda:
    """`torch.cuda` after a sticky error: synchronize (or empty_cache) raises, as every later
    call in a process whose CUDA context is broken does."""

    def __init__(self, where):
        self.where = where

    def synchronize(self):
        if self.where == "synchronize":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def empty_cache(self):
        if self.where == "empty_cache":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("where", ["synchronize", "empty_cache"])
def test_bench_sticky_device_error_ends_the_child_after_its_row(where):
    bench, msgs = _bench(torch_module=types.SimpleNamespace(cuda=_LostCuda(where)))
    bench.dev = "cuda"

    def launch():
        raise RuntimeError("fake peer: an illegal memory access")
    with pytest.raises(gpu_check.DeviceLost, match="illegal memory access"):
        bench.time("forward", "c", "bad peer", launch, 1)
    (row,) = _rows(msgs)
    assert row["status"] == "failed" and "fake peer" in row["note"]
    if where == "synchronize":
        assert "device state lost" in row["note"]
    # a failure that leaves the device usable is the row's alone
    bench, msgs = _bench(torch_module=types.SimpleNamespace(cuda=_LostCuda(None)))
    bench.dev = "cuda"
    bench.time("forward", "c", "bad peer", launch, 1)
    assert _rows(msgs)[0]["status"] == "failed"


def test_spread_keeps_the_first_and_last_and_spaces_the_rest():
    assert gpu_check.spread(range(24), 3) == [0, 12, 23]
    assert gpu_check.spread(range(6), 4) == [0, 2, 3, 5]
    assert gpu_check.spread(range(5), 1) == [2]
    assert gpu_check.spread(range(2), 3) == [0, 1]
    assert gpu_check.spread(range(5), 0) == [0, 1, 2, 3, 4]


def test_autotune_trim_keeps_k_configs_on_first_run_and_reports_them():
    def attnres_fwd_kernel():
        pass

    class Tuner:                               # the Autotuner attributes AutotuneTrim touches
        def __init__(self, n):
            self.configs, self.cache, self.base_fn = [f"cfg{i}" for i in range(n)], {"k": 1}, \
                attnres_fwd_kernel

        def run(self, *args, **kwargs):
            return list(self.configs)
    run, msgs = Tuner.run, []
    big, small = Tuner(24), Tuner(2)
    with gpu_check.AutotuneTrim(3, lambda kind, **f: msgs.append(dict(f, t=kind)), "peer",
                                cls=Tuner):
        assert big.run() == ["cfg0", "cfg12", "cfg23"] and big.cache == {}
        big.configs.append("cfg24")            # trimmed once, on the first run only
        assert big.run() == ["cfg0", "cfg12", "cfg23", "cfg24"]
        assert small.run() == ["cfg0", "cfg1"]
    assert Tuner.run is run
    assert msgs == [dict(t="autotune", impl="peer", kernel="attnres_fwd_kernel", before=24,
                         kept=["cfg0", "cfg12", "cfg23"])]
    triton = pytest.importorskip("triton")
    autotuner = triton.runtime.autotuner.Autotuner
    real = autotuner.run
    with gpu_check.AutotuneTrim(3, lambda kind, **f: None, "peer"):
        assert autotuner.run is not real       # Triton's own class by default
    with gpu_check.AutotuneTrim(0, lambda kind, **f: None, "peer"):
        assert autotuner.run is real           # 0: the full lists
    assert autotuner.run is real


def _report(tmp_path):
    return gpu_check.Report(tmp_path, dict(date="2026-12-01"), ({("forward", "c"): 0}, {"ours": 0}))


def test_report_files_rewritten_atomically_after_each_row(tmp_path):
    rep = _report(tmp_path)
    rep.add_row("ours", dict(section="forward", case="c", impl="ours", status="ok", kernel_ms=2.0,
                             call_ms=2.5, bytes=8e9, method="CUDA graph replay"))
    rep.copy_gbs = 8000.0
    rep.add_row("peer", dict(section="forward", case="c", impl="peer", status="failed", note="x|y"))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["log.txt", "report.json", "report.md", "rows.jsonl"], files
    js = json.loads((tmp_path / "report.json").read_text())
    assert [r["impl"] for r in js["rows"]] == ["ours", "peer"]
    assert js["rows"][0]["gbs"] == pytest.approx(4000.0) and js["rows"][0]["frac_copy"] == 0.5
    lines = [json.loads(ln) for ln in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["impl"] for r in lines] == ["ours", "peer"]
    md = (tmp_path / "report.md").read_text()
    assert "| forward | c | ours | 2 | 2.5 | 4000 | 0.50 | CUDA graph replay |" in md
    assert "**failed**: x/y |" in md, "a note's '|' would break the table"


def test_watchdog_writes_the_partial_report_and_kills_the_running_child(tmp_path):
    rep = _report(tmp_path)
    rep.add_row("peer", dict(section="forward", case="c", impl="peer", status="ok", kernel_ms=1.0,
                             call_ms=1.0, bytes=10, method="m"))
    rep.current = "peer: backward only, c, peer"
    children, codes = gpu_check.Children(), []
    proc = children.start([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    dog = gpu_check.Watchdog(rep, children, time.monotonic() + 0.3, 0.3, grace=0.3,
                             exit=codes.append)
    dog.start()                                # the main thread never finishes: no dog.stop()
    assert proc.wait(timeout=20) == -signal.SIGKILL
    dog.join(timeout=20)
    assert codes == [3], "the process is ended when the main thread does not finish"
    js = json.loads((tmp_path / "report.json").read_text())
    assert js["partial"] == "the run's 0 s budget ran out during peer: backward only, c, peer"
    assert [r["status"] for r in js["rows"]] == ["ok"]
    assert "PARTIAL REPORT" in (tmp_path / "report.md").read_text()
    assert "the main thread did not finish" in js["notes"][-1]


class _FakeCuda:
    """The `torch.cuda` calls gpu_check's Timer makes, on the host clock: lets the CPU run the CUDA
    branch of `Timer.measure` (graph capture, its fallback, events) that the dry run cannot."""

    def __init__(self, capture_fails, capture_error=None):
        self.capture_fails, self.captures, self.syncs = capture_fails, 0, 0
        self.capture_error = capture_error or RuntimeError(
            "operation not permitted when stream is capturing")
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
            raise self.capture_error
        yield
        g.fn = self.last_fn                     # replay re-runs the captured call


@pytest.mark.parametrize("capture_fails", [False, True])
def test_timer_cuda_branch_graph_replay_and_fallback(capture_fails):
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




def test_timer_does_not_swallow_a_cap_fired_in_graph_capture():
    """The capture's fallback (`except Exception`: time back-to-back) lets a cap through."""
    cuda = _FakeCuda(True, gpu_check.Timeout("peer: over its 75 s cap"))

    def fn():
        cuda.last_fn = fn
    timer = gpu_check.Timer(types.SimpleNamespace(cuda=cuda), "cuda", target_ms=5.0, max_iters=7,
                            latency_calls=3)
    with pytest.raises(gpu_check.Timeout, match="75 s cap"):
        timer.measure(fn, graph=True)


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



def test_bench_sections_in_plan_order_with_every_peer_present():
    """Every timing section of Bench, ours and each peer "installed" (the fake modules above;
    their CUDA-only checks lifted): no row fails, each peer is timed where it can express the
    call and skipped with its reason where not (flash-attn-res at D = 48), and the rows come in
    the order of `plan` (from which the parent fills in what a child that died left)."""
    fakes = {peers.FLA: fake_fla, peers.Liger: fake_liger, peers.FastAttnRes: fake_fast,
             peers.FlashAttnRes: fake_far}
    adapters = []
    for cls in (peers.Eager, peers.FLA, peers.Liger, peers.FastAttnRes, peers.FlashAttnRes):
        ad = cls()
        ad.cuda_only = False
        if cls in fakes:
            ad.mod = fakes[cls]([])
        adapters.append(ad)
    bench, msgs = _bench(td=_fake_td(), total=120.0)
    bench.run_ours()
    for ad in adapters:
        bench.run_peer(ad)
    rows = _rows(msgs)
    assert [(r["section"], r["case"], r["impl"]) for r in rows] == gpu_check.plan(True) + [
        key for ad in adapters for key in gpu_check.plan(True, peers, ad)]
    assert not [r for r in rows if r["status"] == "failed"], [r for r in rows if r["status"] == "failed"]
    ok = {(r["section"], r["case"], r["impl"]) for r in rows if r["status"] == "ok"}
    for name in ("fla fused_attnres", "liger attn_res", "fast-attnres", "flash-attn-res"):
        for sec, case in (("forward", "N=3 T=8 D=64 bf16"), ("backward only", "N=4 T=8 D=64 bf16"),
                          ("forward+backward", "N=4 T=8 D=64 bf16")):
            assert (sec, case, name) in ok, (sec, name)
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
sys.path[:0] = [{bench!r}, {tests!r}, {ref!r}, {core!r}]
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
    script = LIGER_SCRIPT.format(bench=str(ROOT / "bench"), tests=str(ROOT / "backend_torch" / "tests"),
                                 ref=str(ROOT / "reference_numpy" / "src"), core=str(ROOT / "core" / "src"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0 and "liger ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]



# ---------------------------------------------------------------- the dry runs


def _dry_run(tmp_path, *argv, env=None, timeout=240):
    """gpu_check --dry-run in a subprocess, as on the GPU machine: none of our packages is
    installed (the editable installs' src folders are taken off sys.path first: the script
    must find them in the tree) -> (process, report.json, rows.jsonl rows, report.md)."""
    script = str(ROOT / "bench" / "gpu_check.py")
    wrapper = ("import runpy, sys; from pathlib import Path; "
               f"root = Path({str(ROOT)!r}); "
               "sys.path[:] = [p for p in sys.path if not (Path(p).name == 'src' and "
               "root in Path(p).parents)]; "
               f"sys.argv = [{script!r}, '--dry-run', '--out-dir', {str(tmp_path)!r}, *{list(argv)!r}]; "
               f"runpy.run_path({script!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))
    report = json.loads((tmp_path / "report.json").read_text())
    lines = [json.loads(ln) for ln in (tmp_path / "rows.jsonl").read_text().splitlines()]
    return proc, report, lines, (tmp_path / "report.md").read_text()


def _by_key(rows):
    keyed = {}
    for r in rows:
        key = (r["section"], r["case"], r["impl"])
        assert key not in keyed, f"two rows for {key}"
        keyed[key] = r
    return keyed


@pytest.mark.triton
@pytest.mark.skipif(not _importable("triton"), reason="Triton is not installed")
def test_gpu_check_dry_run(tmp_path):
    """The whole script on the CPU at tiny shapes: correctness (interpreted kernels), ours,
    the distributed smoke on gloo, every peer that imports, JAX; the files written; no row
    failed; our rows first."""
    proc, report, lines, md = _dry_run(tmp_path)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert md.startswith("### Depth attention on CPU") and "PARTIAL" not in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "report.json", "report.md",
                                                          "rows.jsonl"]
    c = report["correctness"]
    assert c["complete"] and c["run"] == c["cases"] and c["passed"] > 100 and not c["failures"]
    assert report["distributed"] == "PASS" and report["partial"] is None
    rows = report["rows"]
    assert sorted(map(json.dumps, rows)) == sorted(map(json.dumps, lines)), "rows.jsonl = report.json"
    keyed = _by_key(rows)
    failed = [r for r in rows if r["status"] not in ("ok", "skipped")]
    assert not failed, f"rows failed in the dry run (a bug in the script): {failed}"
    assert set(gpu_check.plan(True)) | set(gpu_check.jax_plan(True)) <= set(keyed)
    for r in rows:
        if r["status"] == "ok":
            assert r["kernel_ms"] > 0 and r["call_ms"] > 0 and r["gbs"] > 0, r
        else:
            assert r["note"], r
    ours = [r for r in rows if r["impl"] == gpu_check.OURS]
    assert len(ours) == 8 and all(r["status"] == "ok" for r in ours), ours
    phases = [p["name"] for p in report["phases"]]
    assert phases[:3] == ["correctness", "ours", "distributed smoke"] and phases[-1] == "jax"
    assert {"eager composite", "torch.compile composite"} <= set(phases)
    assert lines[0]["impl"] in (gpu_check.OURS, gpu_check.OP), "our rows first"
    assert report["total_s"] < 240, f"dry run took {report['total_s']:.0f} s"


@pytest.mark.triton
@pytest.mark.skipif(not _importable("triton"), reason="Triton is not installed")
def test_gpu_check_dry_run_failing_peers_end_one_child_each(tmp_path):
    """A peer that breaks its process (a CUDA-like error and `os._exit(134)`), one that hangs
    where its own caps cannot fire (killed 3 s past its 8 s cap), one that raises: each keeps the
    rows it measured, says what ended it at the row it was measuring and marks the rest "not
    run"; the peers after it still run."""
    proc, report, lines, md = _dry_run(
        tmp_path, "--skip-correctness", "--skip-distributed", "--skip-jax", "--skip-ours",
        "--peers-module", FAKE_PEERS, "--peer-cap", "8",
        env={"GPU_CHECK_FAKE_PEERS": "corrupt,hang,raises"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = _by_key(report["rows"])
    assert sorted(map(json.dumps, report["rows"])) == sorted(map(json.dumps, lines))
    fwd, train = "N=3 T=8 D=64 bf16", "N=4 T=8 D=64 bf16"
    phases = {p["name"]: p for p in report["phases"]}
    for mode, status, why in (("corrupt", "failed", "exited with status 134: RuntimeError: CUDA "
                                                    "error: an illegal memory access"),
                              ("hang", "killed", "no answer 8 s after its start-up, killed")):
        name = f"fake {mode}"
        planned = gpu_check.plan(True, peers, gpu_check_fake_peers.make(mode))
        assert rows[("forward", fwd, name)]["status"] == "ok", "the row measured before"
        assert rows[("forward", fwd, name)]["kernel_ms"] > 0
        cut = rows[("backward only", train, name)]
        assert cut["status"] == status and why in cut["note"], cut
        for key in planned[2:]:
            assert rows[key]["status"] == "not run" and why in rows[key]["note"], rows[key]
        assert phases[name]["status"] == status and why in phases[name]["note"]
        assert f"**{status}**: " in md
    assert 8 <= phases["fake hang"]["seconds"] < 60
    raises = "fake raises"
    assert rows[("forward", fwd, raises)]["status"] == "failed"
    assert "fake peer: kernel launch failed" in rows[("forward", fwd, raises)]["note"]
    p1 = [r for (sec, _, impl), r in rows.items() if impl == raises and sec in ("phase 1", "merge")]
    assert len(p1) == 4 and all(r["status"] == "ok" for r in p1), "the run went on after both"
    assert report["partial"] is None and phases[raises]["status"] == "ok"


@pytest.mark.triton
@pytest.mark.skipif(not _importable("triton"), reason="Triton is not installed")
def test_gpu_check_dry_run_budget_runs_out_mid_section(tmp_path):
    """The budget runs out while a peer hangs in its second section: the watchdog kills it and
    writes the partial report (exit 3), with the row measured before, the row it cut and every
    later row, the peers not started included, "not run"."""
    proc, report, lines, md = _dry_run(
        tmp_path, "--skip-correctness", "--skip-distributed", "--skip-ours", "--budget", "20",
        "--peers-module", FAKE_PEERS, "--peer-cap", "100",
        env={"GPU_CHECK_FAKE_PEERS": "hang,raises"})
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-4000:]
    assert report["partial"] == ("the run's 20 s budget ran out during fake hang: backward only, "
                                 "N=4 T=8 D=64 bf16, fake hang")
    assert md.startswith("### ") and "**PARTIAL REPORT: the run's 20 s budget ran out" in md
    rows = _by_key(report["rows"])
    assert sorted(map(json.dumps, report["rows"])) == sorted(map(json.dumps, lines))
    hang = gpu_check.plan(True, peers, gpu_check_fake_peers.make("hang"))
    assert rows[hang[0]]["status"] == "ok" and rows[hang[0]]["kernel_ms"] > 0
    assert rows[hang[1]]["status"] == "killed" and "budget ran out" in rows[hang[1]]["note"]
    assert all(rows[k]["status"] == "not run" for k in hang[2:])
    later = gpu_check.plan(True, peers, gpu_check_fake_peers.make("raises")) + \
        gpu_check.jax_plan(True)
    assert all(rows[k]["status"] == "not run" and "budget" in rows[k]["note"] for k in later)
    assert [(p["name"], p["status"]) for p in report["phases"]] == [
        ("fake hang", "killed"), ("fake raises", "not run"), ("jax", "not run")]
    assert report["total_s"] < 20 + gpu_check.WATCHDOG_GRACE


def test_gpu_check_runs_the_smoke_capped_inside_its_budget():
    """gpu_check runs experiments/distributed_smoke.py as a child process (its dry run above checks
    the gloo verdict is PASS); here: it is on by default and its cap is at most 120 s."""
    args = gpu_check.parse_args([])
    assert not args.skip_distributed and 0 < args.smoke_cap <= gpu_check.SMOKE_CAP_MAX == 120.0
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--smoke-cap", "121"])
