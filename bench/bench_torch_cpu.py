"""CPU benchmark of attnres_torch's depth attention (default op: softmax, key norm, one head).

Compares, in one run on the same inputs (N sources `[T, D]` fp32, pseudo-query `[D]`, gain `[D]`):
  ours      attnres_torch.depth_attention as dispatched (the fused C kernel, dispatch "cpu_c")
  ours+thp  the same with the C kernel's opt-in huge-page advice on fresh outputs
            (`attnres_torch.kernels.cpu_c.set_hugepages(True)`, as `ATTNRES_TORCH_HUGEPAGES=1`)
  chunked   the same op forced onto the chunked torch kernel (dispatch "chunked": the fallback
            without a C compiler)
  naive     the plain eager composition (attnres_torch.kernels.composite: stack, fp32 math, autograd)
  compiled  torch.compile (inductor) of that composition
  fla       FLA's pure-PyTorch `naive_attnres` (fla/ops/attnres/naive.py, loaded by file path;
            same semantics: fp32 math, RMSNorm keys with gain, softmax over depth, static query)
plus the floors: reading every source once (`sum` of each) and `dst.copy_(src)` bandwidth.
Reports median times, achieved GB/s on the minimal bytes and the fraction of copy bandwidth,
and (each in a fresh subprocess) the peak resident memory that fwd+bwd adds beyond its
mandatory outputs.

Usage: python bench/bench_torch_cpu.py [--tokens 8192] [--dim 1024] [--sources 9] [--reps 5]
       [--out bench/results/torch-cpu.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import attnres_torch as at
import torch
from attnres_torch.kernels import composite, cpu_c

#: ours+thp last: in one run everything measured after the huge-page row was slower (the
#: chunked bfloat16 forward 3x), so nothing else follows it.
IMPLS = ("ours", "chunked", "naive", "compiled", "fla", "ours+thp")


def load_fla_naive():
    """`naive_attnres` from FLA's file, without importing the fla package (Triton-heavy)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "attnres" / "naive.py"
    if not path.exists():
        return None
    mod_spec = importlib.util.spec_from_file_location("fla_attnres_naive", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.naive_attnres


def naive(xs, q, g):
    return composite.depth_attention(xs, q, g, eps=1e-6, scale=1.0, num_heads=1,
                                     activation="softmax", key_norm=True)[0]


def make_fn(name):
    if name == "ours":
        return lambda xs, q, g: at.depth_attention(xs, q, g)
    if name == "ours+thp":  # on until main() turns it off after this row (forward and backward)
        cpu_c.set_hugepages(True)
        return lambda xs, q, g: at.depth_attention(xs, q, g)
    if name == "chunked":
        def chunked(xs, q, g):
            with at.use_impl("chunked"):
                return at.depth_attention(xs, q, g)
        return chunked
    if name == "naive":
        return naive
    if name == "compiled":
        return torch.compile(naive)
    fla = load_fla_naive()
    if fla is None:
        return None
    return lambda xs, q, g: fla(q, xs, g, rms_eps=1e-6)


def inputs(n, t, d, grad):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(t, d, generator=gen).requires_grad_(grad) for _ in range(n)]
    q = (torch.randn(d, generator=gen) * 0.05).requires_grad_(grad)
    g = (torch.rand(d, generator=gen) + 0.5).requires_grad_(grad)
    return xs, q, g


def median_time(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_ratios(fn, floor, pairs):
    """time(fn) / time(floor) over `pairs` back-to-back pairs (one warm-up each): the machine's
    bandwidth drifts between runs, a pair sees one state.  Returns (median, min, max)."""
    fn(), floor()
    ratios = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        floor()
        t1 = time.perf_counter()
        fn()
        ratios.append((time.perf_counter() - t1) / (t1 - t0))
    return statistics.median(ratios), min(ratios), max(ratios)


def copy_bandwidth(numel, reps):
    """GB/s of `dst.copy_(src)` on a `[numel]` fp32 buffer (bytes read + written)."""
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    return 2 * numel * 4 / median_time(lambda: dst.copy_(src), reps) / 1e9


def backward_time(fn, xs, q, g, d_out, reps):
    """Median time of the backward alone (one forward graph, retained)."""
    out = fn(xs, q, g)
    return median_time(lambda: torch.autograd.grad(out, xs + [q, g], d_out, retain_graph=True), reps)


def peak_extra(name, n, t, d):
    """Run fwd+bwd of `name` in a fresh process (after one warm-up call); returns the peak
    resident memory added during the call, sampled every 0.5 ms from /proc/self/statm, in units
    of one [T, D] fp32 buffer."""
    code = f"""
import threading, time, torch, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import bench_torch_cpu as b
torch.set_num_threads({torch.get_num_threads()})
fn = b.make_fn({name!r})
xs, q, g = b.inputs({n}, {t}, {d}, True)
d_out = torch.randn({t}, {d})
torch.autograd.grad(fn(xs, q, g), xs + [q, g], d_out)
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
peak, done = [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)
base = rss()
th = threading.Thread(target=sample)
th.start()
grads = torch.autograd.grad(fn(xs, q, g), xs + [q, g], d_out)
done.append(1)
th.join()
print(max(0, peak[0] - base))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode:
        return None
    return int(res.stdout.split()[-1]) / (t * d * 4)


def dtype_section(n, t, d, reps):
    """Forward only, per storage dtype: ours (C kernel) and chunked against the read-once floor
    of that dtype's sources.  Returns markdown lines."""
    lines = [f"### Forward per dtype, CPU: N = {n} x `[{t}, {d}]`, no grad", "",
             "| dtype | read floor ms | ours ms | ours / floor | chunked ms | chunked / floor |",
             "|---|---:|---:|---:|---:|---:|"]
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = [torch.randn(t, d, generator=gen).to(dtype) for _ in range(n)]
        q, g = torch.randn(d, generator=gen) * 0.05, torch.rand(d, generator=gen) + 0.5
        with torch.no_grad():
            floor = median_time(lambda: [x.sum() for x in xs], reps)
            ours = median_time(lambda: at.depth_attention(xs, q, g), reps)
            with at.use_impl("chunked"):
                chunked = median_time(lambda: at.depth_attention(xs, q, g), reps)
        lines.append(f"| {str(dtype).split('.')[-1]} | {floor * 1e3:.1f} | {ours * 1e3:.1f} | "
                     f"{ours / floor:.2f}x | {chunked * 1e3:.1f} | {chunked / floor:.2f}x |")
    return lines + [""]


def block_section(blocks_n, sublayers, t, d, reps, copy_gbs):
    """One block of the two-phase schedule on the CPU (inference, no grad), as in
    bench/gpu_check.py: `blocks_n` cached block sums, `sublayers` queries; sublayer i attends over
    the blocks plus the running partial sum (none for i = 0), and the partial then grows by a
    stand-in update.  Rows: two-phase (phase 1 once for all queries, then `merge_partial` per
    sublayer) vs the same outputs from independent `depth_attention` calls, the naive composition
    and torch.compile of it.  Timed as inference runs it: each sublayer's output is dropped after
    use (phase 1's `[S, T, D]` output lives for the whole block).  Returns markdown lines."""
    gen = torch.Generator().manual_seed(1)
    blocks = [torch.randn(t, d, generator=gen) for _ in range(blocks_n)]
    updates = [torch.randn(t, d, generator=gen) for _ in range(sublayers)]
    qs = torch.randn(sublayers, d, generator=gen) * 0.05
    gs = torch.rand(sublayers, d, generator=gen) + 0.5

    def two_phase(keep):
        out1, lse1 = at.depth_attention_multi(blocks, qs, gs)
        outs, partial = [out1[0]], updates[0]
        for i in range(1, sublayers):
            out = at.merge_partial(out1[i], lse1[i], partial, qs[i], gs[i])
            if keep:
                outs.append(out)
            partial = partial + updates[i]
        return outs

    def independent(fn):
        def run(keep):
            outs, partial = [fn(blocks, qs[0], gs[0])], updates[0]
            for i in range(1, sublayers):
                out = fn(blocks + [partial], qs[i], gs[i])
                if keep:
                    outs.append(out)
                partial = partial + updates[i]
            return outs
        return run

    compiled = torch.compile(naive)
    impls = {"ours two-phase (multi + merges)": two_phase,
             "ours independent reads": independent(lambda xs, q, g: at.depth_attention(xs, q, g)),
             "naive independent reads": independent(naive),
             "compiled independent reads": independent(compiled)}
    ref = two_phase(True)
    buf = t * d * 4
    # minimal bytes (the partial-sum updates excluded, same in every row): the blocks read once,
    # each sublayer's partial read once (from sublayer 1 on), every output written once.
    nbytes = (blocks_n + (sublayers - 1) + sublayers) * buf
    lines = [
        f"### Two-phase block, CPU: {blocks_n} cached blocks x {sublayers} sublayers, "
        f"`[{t}, {d}]` fp32, no grad",
        "",
        f"Minimal bytes {nbytes / 2**20:.0f} MiB (blocks read once, partials read once, outputs "
        "written once; the partial-sum updates, identical in every row, excluded). Two-phase "
        "also writes and re-reads phase 1's S outputs, which this count leaves out.",
        "",
        "| impl | ms | GB/s (min bytes) | % copy bw | max abs diff vs two-phase |",
        "|---|---:|---:|---:|---:|",
    ]
    times = {}
    with torch.no_grad():
        for name, fn in impls.items():
            got = fn(True)
            diff = max(float((a - b).abs().max()) for a, b in zip(got, ref))
            times[name] = median_time(lambda: fn(False), reps)  # each output dropped after use
            gbs = nbytes / times[name] / 1e9
            lines.append(f"| {name} | {times[name] * 1e3:.1f} | {gbs:.2f} | "
                         f"{100 * gbs / copy_gbs:.0f}% | {diff:.1e} |")
    base = times["ours two-phase (multi + merges)"]
    lines += ["", "Ratios (this run): " + ", ".join(
        f"{name} / two-phase {times[name] / base:.2f}x" for name in list(impls)[1:]), ""]
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--sources", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the 2 shared cores are oversubscribed, "
                         "where OpenMP barriers make 2 threads far slower)")
    ap.add_argument("--block", type=int, nargs=4, default=(8, 12, 2048, 1024),
                    metavar=("BLOCKS", "SUBLAYERS", "TOKENS", "DIM"),
                    help="the two-phase block section's shape (0 0 0 0 skips it)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "torch-cpu.md"))
    args = ap.parse_args()
    n, t, d, reps = args.sources, args.tokens, args.dim, args.reps
    torch.set_num_threads(args.threads)
    buf_bytes = t * d * 4
    xs, q, g = inputs(n, t, d, True)
    d_out = torch.randn(t, d)

    copy_gbs = copy_bandwidth(n * t * d, reps)
    with torch.no_grad():
        read_s = median_time(lambda: [x.sum() for x in xs], reps)
        # what every backward pays to hand back N fresh gradients: allocate and first-touch them
        grads_s = median_time(lambda: [torch.empty(t, d).fill_(0.0) for _ in range(n)], reps)

    # Measured before any huge-page run (see IMPLS) and before the slow impls churn the heap.
    with torch.no_grad():
        paired = paired_ratios(lambda: at.depth_attention(xs, q, g), lambda: [x.sum() for x in xs],
                               4 * reps)
    extra_sections = dtype_section(n, t, d, reps)
    if all(args.block):
        extra_sections += block_section(*args.block, reps, copy_gbs)
        torch._dynamo.reset()  # the block section compiled `naive` without grad; start afresh

    rows = {}
    fwd_bytes = (n + 1) * buf_bytes  # each source read once + out written once
    bwd_bytes = (2 * n + 1) * buf_bytes  # sources + d_out read once, every d_source written once
    for name in IMPLS:
        fn = make_fn(name)
        if fn is None:
            continue
        with torch.no_grad():
            fwd = median_time(lambda: fn(xs, q, g), reps)
        bwd = backward_time(fn, xs, q, g, d_out, reps)
        both = median_time(lambda: torch.autograd.grad(fn(xs, q, g), xs + [q, g], d_out), reps)
        rows[name] = dict(fwd=fwd, bwd=bwd, both=both)
        cpu_c.set_hugepages(False)
        if name == "ours":
            rows[name]["impl"] = at.last_impl()
    for name in rows:
        rows[name]["peak_extra_buffers"] = peak_extra(name, n, t, d)

    ours = rows["ours"]
    lines = [
        "## attnres_torch CPU fast path (bench/bench_torch_cpu.py)",
        "",
        f"Machine: {os.cpu_count()}-core {platform.processor() or platform.machine()} VM shared with "
        f"other jobs (numbers are noisy; ratios come from one run), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, date 2026-11-30.",
        f"Shape: N = {n} sources `[{t}, {d}]` fp32, pseudo-query `[{d}]`, gain `[{d}]`; median of "
        f"{reps} runs after one warm-up.",
        "",
        f"Floors: read every source once (`sum` each) {read_s * 1e3:.1f} ms "
        f"({n * buf_bytes / read_s / 1e9:.2f} GB/s); copy bandwidth (`dst.copy_(src)`, "
        f"{n * buf_bytes / 2**20:.0f} MiB) {copy_gbs:.2f} GB/s (read + write); allocating and "
        f"first-touching N fresh `[T, D]` fp32 gradient buffers (`torch.empty(...).fill_(0)`) "
        f"{grads_s * 1e3:.1f} ms.",
        "",
        "| impl | fwd ms | bwd ms | fwd+bwd ms | fwd GB/s (min bytes) | fwd % copy bw | "
        "bwd GB/s | bwd % copy bw | fwd+bwd peak extra ([T, D] fp32 buffers) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        fg, bg = fwd_bytes / r["fwd"] / 1e9, bwd_bytes / r["bwd"] / 1e9
        pe = r["peak_extra_buffers"]
        lines.append(
            f"| {name} | {r['fwd'] * 1e3:.1f} | {r['bwd'] * 1e3:.1f} | {r['both'] * 1e3:.1f} | "
            f"{fg:.2f} | {100 * fg / copy_gbs:.0f}% | {bg:.2f} | {100 * bg / copy_gbs:.0f}% | "
            f"{'n/a' if pe is None else f'{pe:.1f}'} |")
    lines += ["", "Ratios (this run):", ""]
    for other in ("chunked", "naive", "compiled", "fla"):
        if other in rows:
            r = rows[other]
            lines.append(f"- vs {other}: forward {r['fwd'] / ours['fwd']:.1f}x, backward "
                         f"{r['bwd'] / ours['bwd']:.1f}x, fwd+bwd {r['both'] / ours['both']:.1f}x faster")
    lines.append(f"- ours forward / read-once floor: {ours['fwd'] / read_s:.2f}x")
    med, lo, hi = paired
    lines.append(f"- ours forward / read-once floor, {4 * reps} back-to-back pairs: median "
                 f"{med:.2f}x (min {lo:.2f}x, max {hi:.2f}x)")
    if "ours+thp" in rows:
        r = rows["ours+thp"]
        lines.append(f"- ours+thp forward / read-once floor: {r['fwd'] / read_s:.2f}x; ours / ours+thp: "
                     f"forward {ours['fwd'] / r['fwd']:.2f}x, backward {ours['bwd'] / r['bwd']:.2f}x, "
                     f"fwd+bwd {ours['both'] / r['both']:.2f}x")
    if "chunked" in rows:
        lines.append(f"- chunked forward / read-once floor: {rows['chunked']['fwd'] / read_s:.2f}x")
    lines += [
        "",
        f"Minimal bytes: forward (N+1) [T, D] fp32 = {fwd_bytes / 2**20:.0f} MiB; backward (2N+1) "
        f"[T, D] = {bwd_bytes / 2**20:.0f} MiB. Peak extra = peak RSS of a fresh process during "
        "fwd+bwd minus its RSS after creating the inputs, in units of one [T, D] fp32 buffer "
        f"({buf_bytes / 2**20:.0f} MiB), minus nothing: it includes the mandatory out (1) and the N "
        f"source gradients (N = {n}), so the avoidable part is the value minus {n + 1}.",
        "Analytic count for ours: the backward allocates the N source gradients (outputs), per "
        "thread 4N float64 statistics and, for a shared query, `[min(ceil(T / 16), 256), D]` "
        "fp32 per-block d_query partials (1 MiB at D = 1024): no `[T, D]` fp32 temporary (0 of "
        "the 2 allowed); it saves only references to the inputs, out and the fp32 lse `[T]`. "
        "The chunked kernel allocates three `[C, D]` fp32 chunk buffers (C = 2 MiB / (4 D)).",
        "FLA `naive_attnres` semantics match the spec's default op (fp32 math, RMSNorm keys with "
        "gain, softmax over depth, `[D]` query, scale 1; no lse).",
        f"ours ran on dispatch impl: {ours.get('impl')}.",
        "",
    ]
    lines += extra_sections
    text = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
