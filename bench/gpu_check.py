"""GPU check of the Triton depth-attention kernels: one prepared script for a CUDA session (H200).

    python bench/gpu_check.py [--iters 20] [--warmup 5] [--skip-compile] [--skip-peers]
                              [--out bench/results/triton.md]
    TRITON_INTERPRET=1 python bench/gpu_check.py --device cpu --quick   # dry run of the logic

1. Correctness on the device against the float64 reference (`attnres_numpy.ops`) on the upcast
   inputs, at small shapes: forward, backward (random d_out and d_lse), phase 1 (multi), phase 2
   (merge); fp32/bf16/fp16; N in {1, 2, 9, 33}; D in {1, 7, 123, 1000, 4096, 20000} (20000
   walks D in tiles); shared and per-token queries;
   unaligned row-strided sources; NaN-poisoned output buffers; bitwise repeatability.
2. Timings (CUDA events, median of --iters after --warmup):
   - forward, N=9 x T=8192 x D=7168 bf16;
   - forward+backward, N=10 x T=32768 x D=4096 bf16;
   - one two-phase block (8 cached blocks, 12 sublayers): phase 1 + 11 merges against 12
     independent depth-attention reads (both include the partial-sum update), T=8192, D=7168;
   each against the naive eager composition, `torch.compile` of it, and peers when importable
   (fla fused_attnres, liger, fast-attnres, flash-attn-res).  GB/s are on the minimal bytes of
   each operation, also as a fraction of the measured copy bandwidth (`dst.copy_(src)`).
3. Distributed smoke (`attnres_torch.distributed.smoke`, in a child process): a torch.distributed
   world of size 1 on NCCL; tensor parallelism, the sequence-sharded prefill and the pipeline
   (gpipe, 1f1b, interleaved_1f1b) against the float64 reference under a device-mixing detector.
   Prints PASS / FAIL / SKIPPED with the reason; --skip-distributed leaves it out.
Prints a markdown table (and writes it to --out).  Exit status: 0 all correct, 1 a correctness
failure (kernels or distributed smoke), 2 no usable device.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
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
    p.add_argument("--iters", type=int, default=20, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    p.add_argument("--quick", action="store_true", help="tiny shapes everywhere (dry run)")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile rows")
    p.add_argument("--skip-peers", action="store_true", help="no peer-library rows")
    p.add_argument("--skip-timing", action="store_true", help="correctness only")
    p.add_argument("--skip-distributed", action="store_true", help="no distributed (NCCL) smoke test")
    p.add_argument("--out", type=Path, help="also write the markdown report here")
    return p.parse_args(argv)


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

    def close(self, got, ref, dtype_name, what):
        try:
            self.h.assert_close(_cpu(got), ref, dtype_name, what)
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
        self.close(lse, ref_lse, name, f"{tag}: lse")
        self.close(d_src, ref["sources"], name, f"{tag}: d_sources")
        self.close(d_q, ref["query"], name, f"{tag}: d_query")
        if gain:
            self.close(d_g, ref["norm_weight"], name, f"{tag}: d_norm_weight")

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
        self.close(lse1, r_lse, name, f"{tag}: multi lse")
        partial = self.rand(gen, shape, dtype)
        for s in range(num_q):
            out, lse = td.merge_forward(out1[s], lse1[s], partial, qs[s], gs[s], EPS, SCALE)
            d_out, d_lse = ops.depth_attention(f64(xs + [partial]), f64(qs[s]), f64(gs[s]),
                                               eps=EPS, scale=SCALE, return_lse=True)
            self.close(out, d_out, name, f"{tag}: merge(multi) vs direct out, query {s}")
            self.close(lse, d_lse, name, f"{tag}: merge(multi) vs direct lse, query {s}")
            m_out, m_lse = ops.merge_partial(f64(out1[s]), f64(lse1[s]), f64(partial), f64(qs[s]),
                                             f64(gs[s]), eps=EPS, scale=SCALE, return_lse=True)
            self.close(out, m_out, name, f"{tag}: merge out, query {s}")
            self.close(lse, m_lse, name, f"{tag}: merge lse, query {s}")

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

def naive(sources, q, g, eps=EPS, scale=SCALE):
    """The op composed from eager PyTorch ops (stacks the sources; fp32 math)."""
    import torch
    x = torch.stack(sources).float()                                   # [N, T, D]
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    z = scale * (x * r * (q.float() * g.float())).sum(-1)              # [N, T]
    out = (torch.softmax(z, 0).unsqueeze(-1) * x).sum(0)
    return out.to(sources[0].dtype), torch.logsumexp(z, 0)


class Timer:
    def __init__(self, torch, device, iters, warmup):
        self.torch, self.device, self.iters, self.warmup = torch, device, iters, warmup

    def __call__(self, fn):
        """Median milliseconds of fn()."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def peer_functions():
    """(name, callable, wants a stacked [N, ..., D] tensor) for every importable peer."""
    found = []
    candidates = [("fla fused_attnres", "fla.ops.attnres", "fused_attnres", False),
                  ("liger attn_res", "liger_kernel.transformers.functional", "liger_attn_res", True),
                  ("fast-attnres", "fast_attnres", None, False),
                  ("flash-attn-res", "flash_attn_res", None, True)]
    for name, module, attr, stacked in candidates:
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            found.append((name, None, f"not importable ({type(e).__name__})"))
            continue
        fn = getattr(mod, attr, None) if attr else next(
            (getattr(mod, a) for a in dir(mod) if "attn" in a.lower() and callable(getattr(mod, a))
             and not a.startswith("_")), None)
        found.append((name, fn, stacked) if fn else (name, None, f"no callable in {module}"))
    return found


def call_peer(fn, stacked, xs, q, g):
    """Call a peer by parameter names (query / residuals|sources|values / weight / eps / scale)."""
    import torch
    params = list(inspect.signature(fn).parameters)
    srcs = torch.stack(xs) if stacked else xs
    kw = {}
    for p in params:
        low = p.lower()
        if "query" in low or low in ("q", "w_query", "w"):
            kw[p] = q
        elif any(k in low for k in ("resid", "source", "values", "inputs")) or low in ("v", "x", "xs"):
            kw[p] = srcs
        elif "weight" in low or "norm" in low:
            kw[p] = g
        elif "eps" in low:
            kw[p] = EPS
        elif low == "scale":
            kw[p] = SCALE
    if len(kw) < 2:
        raise TypeError(f"cannot map signature {inspect.signature(fn)}")
    return lambda: fn(**kw)


class Bench:
    """The timed cases; each case is a method so its large tensors are freed on return."""

    def __init__(self, args, torch, td, rows, notes):
        self.args, self.torch, self.td, self.rows, self.notes = args, torch, td, rows, notes
        self.dev = args.device
        self.timer = Timer(torch, self.dev, args.iters, args.warmup)
        self.compiled = None if args.skip_compile else torch.compile(naive, dynamic=False)
        self.peers = [] if args.skip_peers else peer_functions()
        self.copy_gbs = self.copy_bandwidth()

    def copy_bandwidth(self):
        """GB/s of dst.copy_(src) (read + write) on a large buffer."""
        numel = (1 << 16) if self.args.quick else (1 << 30)
        src = self.torch.empty(numel, dtype=self.torch.uint8, device=self.dev)
        dst = self.torch.empty_like(src)
        gbs = 2 * numel / (self.timer(lambda: dst.copy_(src)) * 1e-3) / 1e9
        self.notes.append(f"measured copy bandwidth (dst.copy_(src), {numel / 2**30:.2f} GiB): "
                          f"{gbs:.0f} GB/s")
        return gbs

    def sources(self, n, t, d):
        return [self.torch.randn(t, d, device=self.dev, dtype=self.torch.bfloat16)
                for _ in range(n)]

    def row(self, *row):
        self.rows.append(row)
        print("  ", " | ".join("-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
                              for v in row), flush=True)

    def add(self, case, impl, ms, nbytes, extra=""):
        gbs = nbytes / (ms * 1e-3) / 1e9
        self.row(case, impl, ms, gbs, gbs / self.copy_gbs, extra)

    def failed(self, case, impl, e):
        self.row(case, impl, None, None, None, f"failed: {type(e).__name__}: {str(e)[:80]}")

    def time(self, case, impl, fn, nbytes, extra=""):
        try:
            self.add(case, impl, self.timer(fn), nbytes, extra)
        except Exception as e:  # noqa: BLE001 - a peer or compile failure is reported, not fatal
            self.failed(case, impl, e)

    def forward(self):
        torch, td = self.torch, self.td
        n, t, d = (3, 8, 64) if self.args.quick else (9, 8192, 7168)
        case = f"forward N={n} T={t} D={d} bf16"
        xs = self.sources(n, t, d)
        q, g = torch.randn(d, device=self.dev), torch.randn(d, device=self.dev)
        nbytes = (n + 1) * t * d * 2 + t * 4            # read N sources, write out and lse
        ours = td.forward(xs, q, g, EPS, SCALE)[0]
        self.time(case, "attnres triton", lambda: td.forward(xs, q, g, EPS, SCALE), nbytes)
        self.time(case, "naive eager", lambda: naive(xs, q, g), nbytes)
        if self.compiled is not None:
            self.time(case, "naive torch.compile", lambda: self.compiled(xs, q, g), nbytes)
        for name, fn, stacked in self.peers:
            if fn is None:
                self.row(case, name, None, None, None, stacked)
                continue
            try:
                call = call_peer(fn, stacked, xs, q, g)
                res = call()
                res = res[0] if isinstance(res, (tuple, list)) else res
                diff = (res.float() - ours.float()).abs().max().item()
            except Exception as e:  # noqa: BLE001
                self.failed(case, name, e)
                continue
            self.time(case, name, call, nbytes, f"max abs(peer - ours) = {diff:.3g}")

    def forward_backward(self):
        torch, td = self.torch, self.td
        n, t, d = (3, 8, 64) if self.args.quick else (10, 32768, 4096)
        case = f"fwd+bwd N={n} T={t} D={d} bf16"
        xs = [x.requires_grad_(True) for x in self.sources(n, t, d)]
        q = torch.randn(d, device=self.dev, requires_grad=True)
        g = torch.randn(d, device=self.dev, requires_grad=True)
        d_out = torch.randn(t, d, device=self.dev, dtype=torch.bfloat16)
        # forward: read N sources, write out; backward: read N sources and d_out, write N grads
        nbytes = (n + 1) * t * d * 2 + (2 * n + 1) * t * d * 2

        def ours():
            out, lse = td.forward(xs, q, g, EPS, SCALE)
            return td.backward(xs, q, g, out, lse, d_out, None, EPS, SCALE)

        def autograd(fn):
            def run():
                out = fn(xs, q, g)
                out = out[0] if isinstance(out, (tuple, list)) else out
                return torch.autograd.grad(out, xs + [q, g], d_out)
            return run

        self.time(case, "attnres triton (kernels)", ours, nbytes)
        try:
            import attnres_torch
            self.time(case, "attnres_torch.depth_attention (autograd)", autograd(
                lambda a, b, c: attnres_torch.depth_attention(a, b, c, eps=EPS, scale=SCALE)), nbytes)
        except ImportError as e:
            self.notes.append(f"attnres_torch op row skipped: {e}")
        self.time(case, "naive eager", autograd(naive), nbytes)
        if self.compiled is not None:
            self.time(case, "naive torch.compile", autograd(self.compiled), nbytes)
        for name, fn, stacked in self.peers:
            if fn is None:
                continue
            try:
                call = call_peer(fn, stacked, xs, q, g)
            except Exception as e:  # noqa: BLE001
                self.failed(case, name, e)
                continue
            self.time(case, name, autograd(lambda a, b, c, call=call: call()), nbytes)

    def block(self):
        """One block of the two-phase schedule against independent reads (both update partial)."""
        torch, td = self.torch, self.td
        nb, s_l, t, d = (3, 4, 8, 64) if self.args.quick else (8, 12, 8192, 7168)
        case = f"block: {nb} cached blocks x {s_l} sublayers, T={t} D={d} bf16"
        blocks = self.sources(nb, t, d)
        qs, gs = torch.randn(s_l, d, device=self.dev), torch.randn(s_l, d, device=self.dev)
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
        self.time(case, "attnres two-phase (multi + merges)", two_phase, two_bytes)
        self.time(case, f"attnres {s_l} independent reads", independent, ind_bytes)
        self.notes.append("block rows: GB/s each on its own minimal bytes; the times give the speedup")


def render(rows, notes, device_name, failures, passed):
    lines = [f"### Triton depth-attention kernels on {device_name}", "",
             f"Correctness vs float64 reference: {passed} comparisons passed, "
             f"{len(failures)} failures.", ""]
    lines += ["| case | implementation | median ms | GB/s (minimal bytes) | fraction of copy BW | note |",
              "|---|---|---:|---:|---:|---|"]
    for case, impl, ms, gbs, frac, extra in rows:
        if ms is None:
            lines.append(f"| {case} | {impl} | – | – | – | {extra} |")
        else:
            lines.append(f"| {case} | {impl} | {ms:.3f} | {gbs:.0f} | {frac:.2f} | {extra} |")
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --device cpu with TRITON_INTERPRET=1 for a dry run)")
        return 2
    for sub in ("reference_numpy/src", "backend_torch/src", "backend_torch/tests"):
        sys.path.insert(0, str(ROOT / sub))
    import _helpers
    from attnres_numpy import ops
    from attnres_torch.kernels import triton_depth as td
    probe = [torch.zeros(2, 4, device=args.device)]
    if not td.supports(probe, torch.zeros(4, device=args.device), None, num_heads=1,
                       activation="softmax", key_norm=True):
        print("gpu_check: the Triton kernels do not support this device (Triton missing, or a CPU "
              "run without TRITON_INTERPRET=1)")
        return 2
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (interpreter)"
    t0 = time.perf_counter()
    checker = Checker(torch, td, ops, _helpers, args.device)
    failures = checker.run(args.quick)
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
        bench = Bench(args, torch, td, rows, notes)
        bench.forward()
        bench.forward_backward()
        bench.block()
    if dist_verdict is not None:
        notes.append(f"distributed smoke (torch.distributed world of 1, "
                     f"{'NCCL' if args.device == 'cuda' else 'gloo'}): {dist_verdict}")
    report = render(rows, notes, device_name, failures, checker.passed)
    print(report)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")
    return 1 if failures or dist_verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
