"""GPU check of the Triton depth-attention kernels against the peers: one prepared script for the
one H200 session (issue 13, item 3), under 8 minutes.

    python bench/gpu_check.py --out-dir bench/results/h200      # the GPU run
    python bench/gpu_check.py --dry-run --out-dir /tmp/dry       # the whole script on the CPU

Peers come from `bench/.peers/site` (filled by `bench/fetch_peers.sh`; git-ignored, so a device
run carries it; put on sys.path here) or the environment; the adapters are `bench/peers` (one
class per peer, tested on the CPU).  Nothing of ours needs installing: the packages are imported
from the tree.

1. Correctness on the device against the float64 reference (`attnres_numpy.ops`) on the upcast
   inputs, at small shapes: forward, backward (random d_out and d_lse), phase 1 (multi), phase 2
   (merge); fp32/bf16/fp16; N in {1, 2, 9, 33}; D in {1, 7, 123, 1000, 4096, 20000}; shared and
   per-token queries; unaligned row-strided sources; NaN-poisoned output buffers; bitwise
   repeatability.  Then every op captured in one CUDA graph (sources made inside the capture),
   replayed on new input values against the reference, and run eagerly with a cold table cache
   under `torch.cuda.set_sync_debug_mode("error")` (a host sync raises).
2. Distributed smoke (`attnres_torch.distributed.smoke`, child process; NCCL, gloo on the CPU).
3. Timings in what is left of `--budget` (450 s for the whole run), each section under its own
   wall-clock cap (`--section-cap`), each peer under `--peer-cap` seconds in all (its compiles
   and autotuning included; past it the peer is skipped for the rest of the run, with the
   reason); the targets' cases run first:
   - forward, N=9 x T=8192 x D=7168 bf16; forward, backward-only, forward+backward at
     N=10 x T=32768 x D=4096 bf16; phase 1 (8 blocks, 12 queries) and merge at T=8192, D=7168 and
     D=4096 (flash-attn-res needs a power-of-two D); one two-phase block against 12 independent
     reads;
   - ours (the kernels, and the autograd op), the eager composite, `torch.compile` of it, FLA
     (default and Gluon), Liger, fast-attnres, flash-attn-res;
   - two numbers per row: "kernel ms" = CUDA-graph replay of the call (the mean over many
     replays between two events), or, where capture fails (autograd calls), many back-to-back
     calls between two events; "call ms" = median wall time of one call + synchronize, the
     latency a user sees; GB/s on the minimal bytes of the operation and the fraction of the copy
     bandwidth (`dst.copy_(src)`) measured in the same run;
   - every peer's output is compared with ours at the timed shape (max |peer - ours|);
   - JAX: attnres_jax impl="xla" and impl="pallas", jitted, forward and forward+backward at the
     two target shapes, in a child process (`--jax-python`; back-to-back async dispatch).
Writes `report.md` and `report.json` to --out-dir.  Exit status: 0 all correct, 1 a correctness
failure (kernels or distributed smoke), 2 no usable device.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPS, SCALE = 1e-6, 1.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs TRITON_INTERPRET=1)")
    p.add_argument("--dry-run", action="store_true",
                   help="the whole script on the CPU at tiny shapes: --device cpu --quick with "
                        "TRITON_INTERPRET=1 (set before Triton is imported)")
    p.add_argument("--quick", action="store_true", help="tiny shapes everywhere")
    p.add_argument("--out-dir", type=Path, help="write report.md and report.json here")
    p.add_argument("--target-ms", type=float, default=200.0,
                   help="device time per measurement; sets the replay count (default 200)")
    p.add_argument("--max-iters", type=int, default=200, help="most replays per measurement")
    p.add_argument("--latency-calls", type=int, default=10, help="calls timed one by one")
    p.add_argument("--section-cap", type=float, default=90.0, help="seconds per timing section")
    p.add_argument("--peer-cap", type=float, default=90.0,
                   help="seconds per peer over the whole run (compiles and autotuning included)")
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds for the whole run (default 450, under the 8 minutes): the timing "
                        "sections share what correctness and the smoke test leave (at least 60)")
    p.add_argument("--jax-python", default=sys.executable,
                   help="interpreter for the JAX section (child process; default: this one)")
    p.add_argument("--jax-child", help=argparse.SUPPRESS)
    p.add_argument("--skip-jax", action="store_true", help="no JAX (XLA, Pallas) rows")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile rows")
    p.add_argument("--skip-peers", action="store_true", help="no peer-library rows")
    p.add_argument("--skip-timing", action="store_true", help="correctness only")
    p.add_argument("--skip-distributed", action="store_true", help="no distributed smoke test")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.quick = "cpu", True
        args.target_ms, args.max_iters, args.latency_calls = 1.0, 1, 1
    return args


# ---------------------------------------------------------------- correctness

def _cpu(t):
    """Tensors (or lists of them, or None) on the host, for the NumPy comparisons."""
    if isinstance(t, (list, tuple)):
        return [_cpu(x) for x in t]
    return None if t is None else t.detach().cpu()


class Checker:
    def __init__(self, torch, td, ops, helpers, device):
        self.torch, self.td, self.ops, self.h, self.device = torch, td, ops, helpers, device
        self.failures, self.passed = [], 0

    def f64(self, t):
        return self.h.f64(_cpu(t))

    def close(self, got, ref, dtype_name, what, grad=False):
        """The suite's comparison (`_helpers.assert_close`): `dtype_name` is the result's dtype
        (the sources' for out and d_sources, "float32" for lse and fp32 parameters' gradients),
        `grad` picks the gradient column."""
        try:
            self.h.assert_close(_cpu(got), ref, dtype_name, what, grad=grad)
            self.passed += 1
        except AssertionError as e:
            self.failures.append(str(e))

    def rand(self, gen, shape, dtype):
        return self.h.rand(gen, shape, dtype).to(self.device)

    def sources(self, gen, n, shape, dtype, unaligned):
        if not unaligned:
            return [self.rand(gen, shape, dtype) for _ in range(n)]
        wide = shape[:-1] + (shape[-1] + 3,)  # row stride D + 3, base offset 1 element
        return [self.rand(gen, wide, dtype)[..., 1:shape[-1] + 1] for _ in range(n)]

    def depth(self, n, shape, dtype, per_token, gain, unaligned):
        torch, td, ops, f64 = self.torch, self.td, self.ops, self.f64
        name = str(dtype).replace("torch.", "")
        tag = f"depth N={n} {tuple(shape)} {name} per_token={per_token} gain={gain} unaligned={unaligned}"
        gen = torch.Generator().manual_seed(n * 1000 + shape[-1])
        xs = self.sources(gen, n, shape, dtype, unaligned)
        q = self.rand(gen, shape if per_token else shape[-1:], torch.float32)
        g = self.rand(gen, shape[-1:], torch.float32) + 1.0 if gain else None
        d_out = self.rand(gen, shape, dtype)
        d_lse = self.rand(gen, shape[:-1], torch.float32)
        results = []
        for _ in range(2):
            out, lse = td.forward(xs, q, g, EPS, SCALE)
            d_src, d_q, d_g = td.backward(xs, q, g, out, lse, d_out, d_lse, EPS, SCALE)
            results.append([out, lse, d_q] + list(d_src) + ([] if d_g is None else [d_g]))
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            self.failures.append(f"{tag}: repeated forward+backward not bitwise identical")
        ref_out, ref_lse = ops.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=SCALE,
                                               return_lse=True)
        ref = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), f64(d_lse), eps=EPS,
                                      scale=SCALE)
        self.close(out, ref_out, name, f"{tag}: out")
        self.close(lse, ref_lse, "float32", f"{tag}: lse")
        self.close(d_src, ref["sources"], name, f"{tag}: d_sources", grad=True)
        self.close(d_q, ref["query"], "float32", f"{tag}: d_query", grad=True)
        if gain:
            self.close(d_g, ref["norm_weight"], "float32", f"{tag}: d_norm_weight", grad=True)

    def two_phase(self, n, num_q, shape, dtype):
        torch, td, ops, f64 = self.torch, self.td, self.ops, self.f64
        name = str(dtype).replace("torch.", "")
        tag = f"two-phase N={n} S={num_q} {tuple(shape)} {name}"
        gen = torch.Generator().manual_seed(num_q * 100 + n)
        xs = self.sources(gen, n, shape, dtype, True)
        qs = self.rand(gen, (num_q, shape[-1]), torch.float32)
        gs = self.rand(gen, (num_q, shape[-1]), torch.float32) + 1.0
        out1, lse1 = td.multi_forward(xs, qs, gs, EPS, SCALE)
        r_out, r_lse = ops.depth_attention_multi(f64(xs), f64(qs), f64(gs), eps=EPS, scale=SCALE)
        self.close(out1, r_out, name, f"{tag}: multi out")
        self.close(lse1, r_lse, "float32", f"{tag}: multi lse")
        partial = self.rand(gen, shape, dtype)
        for s in range(num_q):
            out, lse = td.merge_forward(out1[s], lse1[s], partial, qs[s], gs[s], EPS, SCALE)
            d_out, d_lse = ops.depth_attention(f64(xs + [partial]), f64(qs[s]), f64(gs[s]),
                                               eps=EPS, scale=SCALE, return_lse=True)
            self.close(out, d_out, name, f"{tag}: merge(multi) vs direct out, query {s}")
            self.close(lse, d_lse, "float32", f"{tag}: merge(multi) vs direct lse, query {s}")
            m_out, m_lse = ops.merge_partial(f64(out1[s]), f64(lse1[s]), f64(partial), f64(qs[s]),
                                             f64(gs[s]), eps=EPS, scale=SCALE, return_lse=True)
            self.close(out, m_out, name, f"{tag}: merge out, query {s}")
            self.close(lse, m_lse, "float32", f"{tag}: merge lse, query {s}")

    def _graph_step(self, base, q, g, qs, gs, d_out, partial):
        """Every op once, its sources made here (`base[i] * 1`: inside a capture they are new
        allocations of the graph's pool, so every pointer table is filled by a node of it)."""
        td = self.td
        xs = [base[i] * 1 for i in range(base.shape[0])]
        out, lse = td.forward(xs, q, g, EPS, SCALE)
        d_src, d_q, d_g = td.backward(xs, q, g, out, lse, d_out, None, EPS, SCALE)
        out1, lse1 = td.multi_forward(xs, qs, gs, EPS, SCALE)
        m_out, m_lse = td.merge_forward(out1[0], lse1[0], partial, qs[0], gs[0], EPS, SCALE)
        return out, lse, d_src, d_q, d_g, out1, lse1, m_out, m_lse

    def graphs(self, quick):
        """CUDA-graph capture and no host sync (issue 13): forward, backward, phase 1 (S = 12,
        the two-pass path) and merge captured in one graph, replayed after the static inputs got
        new values, against the float64 reference; then the same calls eagerly with a cold table
        cache under `torch.cuda.set_sync_debug_mode("error")`, where any host sync raises.  On
        the CPU (dry run) the capture is simulated (`triton_depth._capturing` patched), which runs
        the tables' capture branch but no graph.  Returns a line for the report."""
        from unittest import mock
        torch, td, ops, f64 = self.torch, self.td, self.ops, self.f64
        gen = torch.Generator().manual_seed(77)
        n, shape, dtype, num_q = 3, (4, 64 if quick else 4096), torch.bfloat16, 12
        dim = shape[-1]
        base = self.rand(gen, (n,) + shape, dtype)                  # static inputs of the graph
        q, g = self.rand(gen, (dim,), torch.float32), self.rand(gen, (dim,), torch.float32) + 1.0
        qs = self.rand(gen, (num_q, dim), torch.float32)
        gs = self.rand(gen, (num_q, dim), torch.float32) + 1.0
        d_out, partial = self.rand(gen, shape, dtype), self.rand(gen, shape, dtype)
        args = (base, q, g, qs, gs, d_out, partial)
        failed = len(self.failures)
        if self.device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                           # compiles, outside the capture
                self._graph_step(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    res = self._graph_step(*args)
            except Exception as e:  # noqa: BLE001 - the finding itself
                self.failures.append(f"CUDA-graph capture of the ops: {type(e).__name__}: {e}")
                return "CUDA-graph capture: FAILED (see the failures)"
            base.copy_(self.rand(gen, (n,) + shape, dtype))         # new values, same storage
            graph.replay()
            torch.cuda.synchronize()
            how = "captured in one CUDA graph, replayed on new input values"
        else:
            with mock.patch.object(td, "_capturing", lambda device: True):
                res = self._graph_step(*args)
            how = "capture simulated on the CPU (the tables' capture branch; no graph)"
        out, lse, d_src, d_q, d_g, out1, lse1, m_out, m_lse = res
        xs = [base[i] for i in range(n)]
        tag = f"graph N={n} {shape} bf16"
        r_out, r_lse = ops.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=SCALE,
                                           return_lse=True)
        ref = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), None, eps=EPS,
                                      scale=SCALE)
        r_out1, r_lse1 = ops.depth_attention_multi(f64(xs), f64(qs), f64(gs), eps=EPS, scale=SCALE)
        r_m, r_ml = ops.merge_partial(f64(out1[0]), f64(lse1[0]), f64(partial), f64(qs[0]),
                                      f64(gs[0]), eps=EPS, scale=SCALE, return_lse=True)
        self.close(out, r_out, "bfloat16", f"{tag}: out")
        self.close(lse, r_lse, "float32", f"{tag}: lse")
        self.close(d_src, ref["sources"], "bfloat16", f"{tag}: d_sources", grad=True)
        # fp32 gradients of bf16 sources at the sources' tolerance, as test_triton_depth.py has
        # it: d_query sums terms that cancel (the weights sum to 1), so its relative error is
        # that of the terms (1.7e-4 at the dry run's shape, as before the table and grid changes)
        self.close(d_q, ref["query"], "bfloat16", f"{tag}: d_query", grad=True)
        self.close(d_g, ref["norm_weight"], "bfloat16", f"{tag}: d_norm_weight", grad=True)
        self.close(out1, r_out1, "bfloat16", f"{tag}: phase-1 out, S={num_q}")
        self.close(lse1, r_lse1, "float32", f"{tag}: phase-1 lse, S={num_q}")
        self.close(m_out, r_m, "bfloat16", f"{tag}: merge out")
        self.close(m_lse, r_ml, "float32", f"{tag}: merge lse")
        sync = "not checked (no CUDA)"
        if self.device == "cuda":
            td._TABLES.clear()                                      # every table a miss
            torch.cuda.set_sync_debug_mode("error")
            try:
                self._graph_step(*args)
                sync = "none (set_sync_debug_mode('error'), cold table cache)"
            except RuntimeError as e:
                self.failures.append(f"host sync on the eager path: {e}")
                sync = "FOUND (see the failures)"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        verdict = "ok" if len(self.failures) == failed else "FAILED"
        return f"ops {how}: {verdict}; host syncs on the eager path: {sync}"

    def run(self, quick):
        torch = self.torch
        real_alloc = self.td._alloc
        self.td._alloc = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                 device=device)
        try:
            dims = (1, 7, 33) if quick else (1, 7, 123, 1000, 4096, 20000)
            for dim in dims:
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    n = 9 if dim < 4096 else 3
                    self.depth(n, (3, dim), dtype, False, True, dim % 2 == 1)
                self.depth(2, (2, 3, dim), torch.float32, True, True, False)
                self.depth(1, (3, dim), torch.bfloat16, True, False, True)
            self.depth(2 if quick else 33, (2, 5, 64), torch.bfloat16, False, False, True)
            for dtype in (torch.float32, torch.bfloat16):
                self.two_phase(3, 5, (4, 33 if quick else 1000), dtype)
                self.two_phase(2 if quick else 8, 3 if quick else 12, (3, 64 if quick else 7168),
                               dtype)
        finally:
            self.td._alloc = real_alloc
        return self.failures


# ---------------------------------------------------------------- distributed smoke

def distributed_smoke(device, timeout=600):
    """Run `python -m attnres_torch.distributed.smoke` in a child process (an NCCL hang or crash
    cannot take the rest of the check with it).  Returns (verdict, output lines):
    "PASS", "FAIL" or "SKIPPED"."""
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "backend_torch" / "src"), str(ROOT / "reference_numpy" / "src"),
         os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "attnres_torch.distributed.smoke", "--device", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "FAIL", [f"distributed smoke: timed out after {timeout} s"]
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {0: "PASS", 2: "SKIPPED"}.get(proc.returncode, "FAIL"), lines


# ---------------------------------------------------------------- timing

class Timeout(Exception):
    """A section or a peer ran past its wall-clock cap."""


class Caps:
    """Wall-clock caps: one per section, one per peer over the whole run.  `guard(peer)` arms
    SIGALRM for the smaller remaining cap (a compile or autotune loop in Python is interrupted;
    a single long C call finishes first), charges the peer for the time spent, and raises
    Timeout with the reason."""

    def __init__(self, section_cap, peer_cap, total):
        self.section_cap, self.peer_cap = section_cap, peer_cap
        self.section_end, self.section_name = float("inf"), ""
        self.peer_used = {}
        self.total, self.end = total, time.perf_counter() + total

    def start_section(self, name):
        self.section_name = name
        self.section_end = min(time.perf_counter() + self.section_cap, self.end)

    def left(self, peer):
        sec = self.section_end - time.perf_counter()
        if peer is None:
            return sec, self._section_reason()
        mine = self.peer_cap - self.peer_used.get(peer, 0.0)
        if mine < sec:
            return mine, f"{peer}: over its {self.peer_cap:.0f} s cap for the run"
        return sec, self._section_reason()

    def _section_reason(self):
        if self.section_end >= self.end:
            return f"section '{self.section_name}': timing budget of {self.total:.0f} s spent"
        return f"section '{self.section_name}' over its {self.section_cap:.0f} s cap"

    def guard(self, peer=None):
        caps = self

        class _Guard:
            def __enter__(self):
                self.t0 = time.perf_counter()
                seconds, self.reason = caps.left(peer)
                if seconds <= 0:
                    raise Timeout(self.reason)

                def alarm(signum, frame):
                    raise Timeout(self.reason)
                self.old = signal.signal(signal.SIGALRM, alarm)
                signal.setitimer(signal.ITIMER_REAL, seconds)
                return self

            def __exit__(self, *exc):
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, self.old)
                if peer is not None:
                    caps.peer_used[peer] = caps.peer_used.get(peer, 0.0) + time.perf_counter() - self.t0
                return False
        return _Guard()


class Timer:
    """kernel ms: CUDA-graph replay (or back-to-back calls) between two events, mean per call;
    call ms: median of single calls each followed by a synchronize (host overhead included)."""

    def __init__(self, torch, device, target_ms, max_iters, latency_calls):
        self.torch, self.dev = torch, device
        self.target_ms, self.max_iters, self.latency_calls = target_ms, max_iters, latency_calls

    def sync(self):
        if self.dev == "cuda":
            self.torch.cuda.synchronize()

    def _graph(self, fn):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    def latency(self, fn):
        times = []
        for _ in range(self.latency_calls):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def measure(self, fn, graph=True):
        """-> dict(kernel_ms, call_ms, method, iters); fn is warmed up (compiled) first."""
        torch = self.torch
        fn()
        self.sync()
        if self.dev != "cuda":
            iters = self.max_iters
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            kernel = (time.perf_counter() - t0) * 1e3 / iters
            return dict(kernel_ms=kernel, call_ms=self.latency(fn), iters=iters,
                        method="back-to-back (host clock)")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        one = max(start.elapsed_time(end), 1e-3)
        iters = int(min(max(self.target_ms / one, 3), self.max_iters))
        run, method, g = fn, "back-to-back", None
        if graph:
            try:
                g = self._graph(fn)
                run, method = g.replay, "CUDA graph replay"
            except Exception as e:  # noqa: BLE001 - not capturable: say so, time back-to-back
                method = f"back-to-back (graph capture failed: {type(e).__name__}: {str(e)[:60]})"
                g = None
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
        run()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        kernel = start.elapsed_time(end) / iters
        del g
        return dict(kernel_ms=kernel, call_ms=self.latency(fn), iters=iters, method=method)


class Bench:
    """The timed sections; each case is a method so its large tensors are freed on return."""

    def __init__(self, args, torch, td, peers, timing_budget):
        self.args, self.torch, self.td, self.peers = args, torch, td, peers
        self.dev = args.device
        self.rows, self.notes = [], []
        self.timer = Timer(torch, self.dev, args.target_ms, args.max_iters, args.latency_calls)
        self.caps = Caps(args.section_cap, args.peer_cap, timing_budget)
        self.dead = {}                                  # peer name -> why it is skipped from now on
        adapters = [peers.Eager()] + ([] if args.skip_compile else [peers.Compiled()])
        if not args.skip_peers:
            adapters += [a for a in peers.all_adapters() if type(a) not in (peers.Eager, peers.Compiled)]
        self.adapters = adapters
        self.copy_gbs = self.copy_bandwidth()

    # ---- bookkeeping

    def copy_bandwidth(self):
        """GB/s of dst.copy_(src) (read + write) on a large buffer, by the same timer."""
        numel = (1 << 16) if self.args.quick else (1 << 30)
        src = self.torch.empty(numel, dtype=self.torch.uint8, device=self.dev)
        dst = self.torch.empty_like(src)
        m = self.timer.measure(lambda: dst.copy_(src))
        gbs = 2 * numel / (m["kernel_ms"] * 1e-3) / 1e9
        self.notes.append(f"measured copy bandwidth (dst.copy_(src), {numel / 2**30:.3g} GiB, "
                          f"{m['method']}): {gbs:.0f} GB/s")
        return gbs

    def row(self, section, case, impl, status, m=None, nbytes=None, note=""):
        r = dict(section=section, case=case, impl=impl, status=status, note=note, kernel_ms=None,
                 call_ms=None, gbs=None, frac_copy=None, method=None, iters=None, bytes=nbytes)
        if m is not None:
            r.update(m)
            r["gbs"] = nbytes / (m["kernel_ms"] * 1e-3) / 1e9
            r["frac_copy"] = r["gbs"] / self.copy_gbs
        self.rows.append(r)
        shown = (f"{r['kernel_ms']:.4g} ms kernel, {r['call_ms']:.4g} ms call, {r['gbs']:.0f} GB/s "
                 f"({r['frac_copy']:.2f} of copy), {r['method']}" if m else status)
        print(f"  [{section}] {case} | {impl}: {shown}{' | ' + note if note else ''}", flush=True)

    def time(self, section, case, impl, make, nbytes, graph=True, peer=None, note=""):
        """make() builds the call (untimed; may raise peers.Unsupported); then it is timed."""
        Unsupported = self.peers.Unsupported
        if peer is not None and peer in self.dead:
            return self.row(section, case, impl, "skipped", note=self.dead[peer])
        try:
            with self.caps.guard(peer):
                fn, extra = make()
                m = self.timer.measure(fn, graph)
            self.row(section, case, impl, "ok", m, nbytes, "; ".join(x for x in (note, extra) if x))
        except Unsupported as e:
            self.row(section, case, impl, "skipped", note=str(e))
        except Timeout as e:
            if peer is not None and not str(e).startswith("section"):
                self.dead[peer] = str(e)
            self.row(section, case, impl, "skipped", note=str(e))
        except Exception as e:  # noqa: BLE001 - a peer or compile failure is reported, not fatal
            self.row(section, case, impl, "failed", note=f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            if self.dev == "cuda":
                self.torch.cuda.empty_cache()

    def sources(self, n, t, d, requires_grad=False):
        torch = self.torch
        return [torch.randn(t, d, device=self.dev, dtype=torch.bfloat16).requires_grad_(requires_grad)
                for _ in range(n)]

    def inputs(self, n, t, d):
        torch = self.torch
        xs = self.sources(n, t, d)
        q = torch.randn(d, device=self.dev)
        g = torch.rand(d, device=self.dev) + 0.5
        return self.peers.Inputs(xs, q, g, EPS, SCALE)

    def _diff(self, out, ours):
        """max |out - ours|; a peer's extra unit axes (flash-attn-res's B = 1) are dropped, any
        other shape difference is a failure (never a broadcast)."""
        out = out[0] if isinstance(out, (tuple, list)) else out
        if out.numel() != ours.numel():
            raise ValueError(f"output shape {tuple(out.shape)} != ours {tuple(ours.shape)}")
        diff = (out.reshape(ours.shape).float() - ours.float()).abs().max().item()
        return f"max |out - ours| = {diff:.3g}"

    def _peer_forward(self, ad, inp, ours, requires_grad=False):
        def make():
            ad.load()
            ad.check(inp)
            prep = ad.prepare(inp, requires_grad)
            note = self._diff(ad.forward(prep), ours)
            return (lambda: ad.forward(prep)), note + (f"; {ad.notes}" if ad.notes else "")
        return make

    # ---- sections

    def forward(self, n, t, d):
        td, sec = self.td, "forward"
        case = f"N={n} T={t} D={d} bf16"
        self.caps.start_section(f"{sec} {case}")
        inp = self.inputs(n, t, d)
        xs, q, g = inp.sources, inp.query, inp.gain
        nbytes = (n + 1) * t * d * 2 + t * 4            # read N sources, write out and lse
        ours = td.forward(xs, q, g, EPS, SCALE)[0]
        self.time(sec, case, "attnres triton kernels",
                  lambda: ((lambda: td.forward(xs, q, g, EPS, SCALE)), ""), nbytes)
        self.time(sec, case, "attnres_torch.depth_attention", lambda: (
            (lambda: self.op(xs, q, g)), ""), nbytes)
        for ad in self.adapters:
            with ad.environment():
                self.time(sec, case, ad.name, self._peer_forward(ad, inp, ours), nbytes, peer=ad.name)

    def op(self, xs, q, g):
        import attnres_torch
        return attnres_torch.depth_attention(xs, q, g, eps=EPS, scale=SCALE)

    def training(self, n, t, d):
        """backward-only and forward+backward (random d_out; gradients of every leaf)."""
        torch, td = self.torch, self.td
        case = f"N={n} T={t} D={d} bf16"
        self.caps.start_section(f"backward {case}")
        inp = self.inputs(n, t, d)
        xs, q, g = inp.sources, inp.query, inp.gain
        d_out = torch.randn(t, d, device=self.dev, dtype=torch.bfloat16)
        fwd_bytes = (n + 1) * t * d * 2
        bwd_bytes = (2 * n + 1) * t * d * 2            # read N sources and d_out, write N grads
        out, lse = td.forward(xs, q, g, EPS, SCALE)

        def ours_fb():
            o, s = td.forward(xs, q, g, EPS, SCALE)
            return td.backward(xs, q, g, o, s, d_out, None, EPS, SCALE)

        def autograd_make(ad, fwd_too):
            def make():
                ad.load()
                ad.check(inp)
                prep = ad.prepare(inp, requires_grad=True)
                if fwd_too:
                    def fn():
                        return torch.autograd.grad(ad.forward(prep), prep.leaves, d_out)
                    return fn, ad.notes
                o = ad.forward(prep)
                return (lambda: torch.autograd.grad(o, prep.leaves, d_out, retain_graph=True)), \
                    ad.notes
            return make

        op = _OpAdapter(self)
        for sec, nbytes, fwd_too in (("backward only", bwd_bytes, False),
                                     ("forward+backward", fwd_bytes + bwd_bytes, True)):
            self.caps.start_section(f"{sec} {case}")
            if fwd_too:
                self.time(sec, case, "attnres triton kernels", lambda: (ours_fb, ""), nbytes)
            else:
                self.time(sec, case, "attnres triton kernels", lambda: (
                    (lambda: td.backward(xs, q, g, out, lse, d_out, None, EPS, SCALE)), ""), nbytes)
            # autograd calls: back-to-back for backward only (a backward recorded outside a
            # capture runs on the legacy stream); forward+backward tries a graph
            for ad in [op] + self.adapters:
                with ad.environment():
                    self.time(sec, case, ad.name, autograd_make(ad, fwd_too), nbytes,
                              graph=fwd_too, peer=None if ad is op else ad.name)

    def two_phase(self, nb, s_l, t, d):
        """phase 1 (S queries over nb blocks) and one merge, ours against the peers with those
        entry points (flash-attn-res, the composites)."""
        torch, td = self.torch, self.td
        case = f"{nb} blocks x {s_l} queries, T={t} D={d} bf16"
        inp = self.inputs(nb, t, d)
        qs, gs = torch.randn(s_l, d, device=self.dev), torch.rand(s_l, d, device=self.dev) + 0.5
        tdb = t * d * 2
        out1, lse1 = td.multi_forward(inp.sources, qs, gs, EPS, SCALE)
        partial = self.sources(1, t, d)[0]
        with_p1 = [a for a in self.adapters if type(a).phase1 is not self.peers.Adapter.phase1]
        with_merge = [a for a in self.adapters if type(a).merge is not self.peers.Adapter.merge]

        def make(ad, kind):
            def build():
                ad.load()
                if kind == "phase 1":
                    fn = ad.phase1(inp, qs, gs)
                    return fn, self._diff(fn(), out1)
                fn = ad.merge(out1[1], lse1[1], partial, qs[1], gs[1], EPS, SCALE)
                return fn, self._diff(fn(), ours_merge)
            return build

        ours_merge = td.merge_forward(out1[1], lse1[1], partial, qs[1], gs[1], EPS, SCALE)[0]
        for kind, nbytes, ours, ads in (
                ("phase 1", (nb + s_l) * tdb,
                 lambda: td.multi_forward(inp.sources, qs, gs, EPS, SCALE), with_p1),
                ("merge", 3 * tdb,
                 lambda: td.merge_forward(out1[1], lse1[1], partial, qs[1], gs[1], EPS, SCALE),
                 with_merge)):
            self.caps.start_section(f"{kind} {case}")
            self.time(kind, case, "attnres triton kernels", lambda ours=ours: (ours, ""), nbytes)
            for ad in ads:
                with ad.environment():
                    self.time(kind, case, ad.name, make(ad, kind), nbytes, peer=ad.name)

    def block(self, nb, s_l, t, d):
        """One block of the two-phase schedule against independent reads (both update partial)."""
        td = self.td
        sec, case = "block", f"{nb} cached blocks x {s_l} sublayers, T={t} D={d} bf16"
        self.caps.start_section(f"{sec} {case}")
        blocks = self.sources(nb, t, d)
        qs = self.torch.randn(s_l, d, device=self.dev)
        gs = self.torch.rand(s_l, d, device=self.dev) + 0.5
        updates = self.sources(s_l, t, d)                              # stand-ins for f_l(h_l)
        tdb = t * d * 2

        def two_phase():
            out1, lse1 = td.multi_forward(blocks, qs, gs, EPS, SCALE)
            partial = updates[0]
            td.merge_forward(out1[1], lse1[1], partial, qs[1], gs[1], EPS, SCALE)
            for i in range(2, s_l):
                partial = partial + updates[i - 1]
                td.merge_forward(out1[i], lse1[i], partial, qs[i], gs[i], EPS, SCALE)

        def independent():
            td.forward(blocks, qs[0], gs[0], EPS, SCALE)
            partial = updates[0]
            for i in range(1, s_l):
                if i > 1:
                    partial = partial + updates[i - 1]
                td.forward(blocks + [partial], qs[i], gs[i], EPS, SCALE)

        # minimal bytes: phase 1 reads nb blocks and writes s_l outputs; the first merge reads
        # out1 and partial and writes out; each later one adds the update to partial (read 2,
        # write 1) and merges (read 2, write 1).  Independent: read nb (+1) sources, write out;
        # an add: 3.
        two_bytes = (nb + s_l) * tdb + 3 * tdb + (s_l - 2) * 6 * tdb
        ind_bytes = sum((nb + (i > 0) + 1) * tdb for i in range(s_l)) + (s_l - 2) * 3 * tdb
        self.time(sec, case, "attnres two-phase (multi + merges)", lambda: (two_phase, ""), two_bytes)
        self.time(sec, case, f"attnres {s_l} independent reads", lambda: (independent, ""), ind_bytes)
        self.notes.append("block rows: GB/s each on its own minimal bytes; the kernel-ms ratio is "
                          "the two-phase speedup (target >= 1.5x)")

    def run(self):
        """The targets' cases first (the budget may run out before the last sections)."""
        q = self.args.quick
        self.forward(*((3, 8, 64) if q else (9, 8192, 7168)))
        self.training(*((3, 8, 64) if q else (10, 32768, 4096)))
        self.block(*((3, 4, 8, 64) if q else (8, 12, 8192, 7168)))
        if not self.args.skip_jax:
            self.jax()
        self.forward(*((3, 8, 64) if q else (10, 32768, 4096)))
        self.two_phase(*((3, 4, 8, 48) if q else (8, 12, 8192, 7168)))
        self.two_phase(*((3, 4, 8, 64) if q else (8, 12, 8192, 4096)))

    def jax(self):
        """attnres_jax (impl "xla" and "pallas"), jitted, in a child process (JAX and torch in one
        process would fight over the GPU's memory; XLA_PYTHON_CLIENT_PREALLOCATE=false there):
        forward at the forward shape, forward+backward (VJP of every source, query and gain) at
        the training shape.  Its rows arrive as JSON lines."""
        import subprocess
        self.caps.start_section("jax")
        if self.dev == "cuda":
            self.torch.cuda.empty_cache()              # hand torch's cached blocks back for JAX
        seconds, reason = self.caps.left(None)
        if seconds <= 5:
            return self.row("jax", "-", "attnres_jax", "skipped", note=reason)
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(
            [str(ROOT / "backend_jax" / "src"), str(ROOT / "reference_numpy" / "src"),
             os.environ.get("PYTHONPATH", "")]))
        env.pop("TRITON_INTERPRET", None)
        cmd = [self.args.jax_python, str(Path(__file__).resolve()), "--jax-child",
               "quick" if self.args.quick else "full", "--device", self.dev,
               "--target-ms", str(self.args.target_ms), "--max-iters", str(self.args.max_iters),
               "--latency-calls", str(self.args.latency_calls)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=seconds)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = reason, "timeout"
        got = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("ROW: ")]
        for r in got:
            m = r.pop("m", None)
            self.row("jax " + r["section"], r["case"], r["impl"], r["status"], m, r["bytes"],
                     r["note"])
        if rc != 0:
            tail = " | ".join((err or "").strip().splitlines()[-3:])[:300]
            self.row("jax", "-", "attnres_jax child", "skipped" if "No module named 'jax'" in tail
                     else "failed", note=f"exit {rc}: {tail}")


class _OpAdapter:
    """Our public autograd op, timed through the same autograd path as the peers."""
    name, notes, env = "attnres_torch.depth_attention (autograd)", "", {}

    def __init__(self, bench):
        self.bench = bench

    def load(self):
        pass

    def check(self, inp):
        pass

    def prepare(self, inp, requires_grad=False):
        from peers import Prepared  # noqa: PLC0415 - bench/ is on sys.path in main()
        xs = [s.detach().requires_grad_(requires_grad) for s in inp.sources]
        q, g = (t.detach().requires_grad_(requires_grad) for t in (inp.query, inp.gain))
        return Prepared((xs, q, g), leaves=xs + [q, g])

    def forward(self, prep):
        return self.bench.op(*prep.args)

    def environment(self):
        import contextlib
        return contextlib.nullcontext()


# ---------------------------------------------------------------- JAX child

def jax_child(args):
    """The JAX section's child process: prints one `ROW: {json}` line per measurement."""
    import jax
    import jax.numpy as jnp
    from attnres_jax import depth_attention

    dev = jax.devices("gpu")[0] if args.device == "cuda" else jax.devices("cpu")[0]
    quick = args.jax_child == "quick"

    def timed(fn, *xs):
        jax.block_until_ready(fn(*xs))                   # compile
        t0 = time.perf_counter()
        one = jax.block_until_ready(fn(*xs))
        one = (time.perf_counter() - t0) * 1e3
        iters = int(min(max(args.target_ms / max(one, 1e-3), 3), args.max_iters))
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn(*xs)
        jax.block_until_ready(r)
        kernel = (time.perf_counter() - t0) * 1e3 / iters
        lat = []
        for _ in range(args.latency_calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*xs))
            lat.append((time.perf_counter() - t0) * 1e3)
        return dict(kernel_ms=kernel, call_ms=statistics.median(lat), iters=iters,
                    method="back-to-back, async dispatch (host clock)")

    def emit(section, case, impl, status, m=None, nbytes=None, note=""):
        print("ROW: " + json.dumps(dict(section=section, case=case, impl=impl, status=status, m=m,
                                        bytes=nbytes, note=note)), flush=True)

    key = jax.random.PRNGKey(0)
    for section, (n, t, d) in (("forward", (3, 8, 64) if quick else (9, 8192, 7168)),
                               ("forward+backward", (3, 8, 64) if quick else (10, 32768, 4096))):
        case = f"N={n} T={t} D={d} bf16"
        ks = jax.random.split(key, n + 3)
        xs = [jax.device_put(jax.random.normal(k, (t, d), jnp.bfloat16), dev) for k in ks[:n]]
        q = jax.device_put(jax.random.normal(ks[n], (d,), jnp.float32), dev)
        g = jax.device_put(jax.random.uniform(ks[n + 1], (d,), jnp.float32) + 0.5, dev)
        cot = jax.device_put(jax.random.normal(ks[n + 2], (t, d), jnp.bfloat16), dev)
        fwd_bytes = (n + 1) * t * d * 2
        for impl in ("xla", "pallas"):
            def f(xs, q, g, impl=impl):
                return depth_attention(xs, q, g, eps=EPS, scale=SCALE, impl=impl)
            if section == "forward":
                fn, nbytes = jax.jit(f), fwd_bytes
            else:
                def fb(xs, q, g, f=f):
                    out, pull = jax.vjp(f, xs, q, g)
                    return pull(cot)
                fn, nbytes = jax.jit(fb), fwd_bytes + (2 * n + 1) * t * d * 2
            try:
                emit(section, case, f"attnres_jax impl={impl}", "ok", timed(fn, xs, q, g), nbytes)
            except ValueError as e:       # the implementation cannot run this call: a skip
                emit(section, case, f"attnres_jax impl={impl}", "skipped", note=str(e)[:200])
            except Exception as e:  # noqa: BLE001
                emit(section, case, f"attnres_jax impl={impl}", "failed",
                     note=f"{type(e).__name__}: {str(e)[:200]}")
    return 0


# ---------------------------------------------------------------- report

def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def render(meta, rows, notes, failures, passed):
    lines = [f"### Depth attention on {meta['device']} ({meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; peers: "
             + ", ".join(f"{k} {v}" for k, v in meta["peers"].items()), "",
             f"Correctness vs float64 reference: {passed} comparisons passed, "
             f"{len(failures)} failures.", "",
             "| section | case | implementation | kernel ms | call ms | GB/s (minimal bytes) "
             "| fraction of copy BW | timing | note |",
             "|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        status = "" if r["status"] == "ok" else f"**{r['status']}**: "
        lines.append(f"| {r['section']} | {r['case']} | {r['impl']} | {_fmt(r['kernel_ms'], '.4g')} "
                     f"| {_fmt(r['call_ms'], '.4g')} | {_fmt(r['gbs'], '.4g')} "
                     f"| {_fmt(r['frac_copy'], '.2f')} | {r['method'] or ''} "
                     f"| {status}{r['note']} |")
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def peer_status(peers):
    """name -> version or why it is absent (import attempted once per adapter)."""
    out = {}
    for ad in peers.all_adapters():
        if ad.module is None or ad.name in out:
            continue
        try:
            ad.load()
            from importlib.metadata import version
            out[ad.name] = version(ad.dist)
        except peers.Unsupported as e:
            out[ad.name] = str(e)
        except Exception as e:  # noqa: BLE001 - importable, but no distribution metadata
            out[ad.name] = f"version unknown ({type(e).__name__})"
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.jax_child:
        return jax_child(args)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"           # before anything imports Triton
    t0 = time.perf_counter()
    # nothing of ours is installed on the GPU machine: every package from the tree
    # (_helpers compares with the suite's tolerance table, attnres_conformance)
    for sub in ("conformance/src", "reference_numpy/src", "backend_torch/src",
                "backend_torch/tests", "bench"):
        sys.path.insert(0, str(ROOT / sub))
    import peers
    site = peers.add_peer_site()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (--dry-run runs the whole script on the CPU)")
        return 2
    import _helpers
    from attnres_numpy import ops
    from attnres_torch.kernels import triton_depth as td
    probe = [torch.zeros(2, 4, device=args.device)]
    if not td.supports(probe, torch.zeros(4, device=args.device), None, num_heads=1,
                       activation="softmax", key_norm=True):
        print("gpu_check: the Triton kernels do not support this device (Triton missing, or a CPU "
              "run without TRITON_INTERPRET=1)")
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "CPU (interpreter)",
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                triton=triton_version, peer_site=str(peers.PEER_SITE) if site else None,
                peers={} if args.skip_peers else peer_status(peers),
                args={k: str(v) for k, v in vars(args).items()})
    print(f"peers: {meta['peers']} (site {meta['peer_site']})")
    checker = Checker(torch, td, ops, _helpers, args.device)
    failures = checker.run(args.quick)
    graph_note = checker.graphs(args.quick)
    print(graph_note)
    print(f"correctness: {checker.passed} passed, {len(failures)} failed "
          f"({time.perf_counter() - t0:.1f} s)")
    for f in failures:
        print("  FAIL", f)
    dist_verdict = None
    if not args.skip_distributed:
        t1 = time.perf_counter()
        dist_verdict, dist_lines = distributed_smoke(args.device)
        for line in dist_lines[-40:]:
            print("  ", line)
        print(f"distributed smoke: {dist_verdict} ({time.perf_counter() - t1:.1f} s)")
    rows, notes = [], []
    if not args.skip_timing:
        bench = Bench(args, torch, td, peers, max(args.budget - (time.perf_counter() - t0), 60.0))
        bench.run()
        rows, notes = bench.rows, bench.notes
    notes.append(graph_note)
    if dist_verdict is not None:
        notes.append(f"distributed smoke (torch.distributed world of 1, "
                     f"{'NCCL' if args.device == 'cuda' else 'gloo'}): {dist_verdict}")
    report = render(meta, rows, notes, failures, checker.passed)
    total = time.perf_counter() - t0
    print(report)
    print(f"\ntotal {total:.1f} s")
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "report.md").write_text(report + f"\n\ntotal {total:.1f} s\n")
        (args.out_dir / "report.json").write_text(json.dumps(dict(
            meta=meta, correctness=dict(passed=checker.passed, failures=failures),
            distributed=dist_verdict, copy_gbs=getattr(locals().get("bench"), "copy_gbs", None),
            rows=rows, notes=notes, total_s=total), indent=1) + "\n")
    return 1 if failures or dist_verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
