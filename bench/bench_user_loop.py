"""Depth attention on the CPU as a user's training / inference loop sees it (issue 19).

One call per step on a list of N sources `[T, D]`, pseudo-query and gain `[D]` fp32; every call
gets a fresh output, and under autograd N fresh source gradients (`torch.autograd.grad` /
`jax.vjp` / `mx.vjp` with a random cotangent), exactly as the frameworks hand them back.  Peers
run in the same run, call by call:

  torch ours          attnres_torch.depth_attention as dispatched (`last_impl()` recorded)
  torch ours keep     the same in a process where `attnres_torch.cpu_alloc.keep_large_blocks()` ran
  torch ours out=     inference only: the kernel writing into one reused output buffer
                      (`cpu_c.forward_into`: what an `out=` argument could give at most)
  torch composite     the plain differentiable torch composition (attnres_torch.kernels.composite)
  jax xla             attnres_jax.depth_attention(impl="xla") under jax.jit (own venv)
  mlx compiled        attnres_mlx.depth_attention on its compiled implementation (own venv)

plus, in every torch process, the floors that include the mandatory writes:
  floor               forward: read every source once (`x.sum()` each) + write one fresh
                      `[T, D]` output (`torch.empty(...).fill_(1)`); forward+backward: read the
                      sources twice and d_out once + write one fresh output and N fresh gradients
  copy                `dst.copy_(src)` of N `[T, D]` buffers into a reused buffer (bandwidth)
The floors use the allocator of their process, so the "keep" process's floor is the floor of a
loop whose fresh buffers are reused by malloc.

Every row is a persistent worker process (`--worker ...`, one per framework and allocator
setting); the driver (any Python) sends "time one call of row R" to each in turn, so the k-th
call of every row happens in the same round, seconds apart: each ratio (row / floor of its own
process, JAX time / row time) is taken per round and its median reported, next to the medians
of the times.  Each worker times its own call (perf_counter around the call and, for JAX/MLX, the
wait for the result).

Usage: python bench/bench_user_loop.py [--reps 7] [--threads 2] [--dtypes float32 bfloat16]
       [--sources 9 --tokens 8192 --dim 1024] [--torch-python P] [--jax-python P]
       [--mlx-python P] [--json bench/results/user-loop.json] [--out bench/results/user-loop.md]
(defaults: the interpreters of .nox/tests-{torch,jax,mlx}; a missing one drops its rows.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("fwd", "fwdbwd")


# ---------------------------------------------------------------------------------------------
# inputs: the same values in every framework (numpy, seeded)

def np_inputs(n, t, d):
    import numpy as np

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((t, d), dtype=np.float32) for _ in range(n)]
    q = (rng.standard_normal(d, dtype=np.float32) * 0.05).astype(np.float32)
    g = (rng.random(d, dtype=np.float32) + 0.5).astype(np.float32)
    d_out = rng.standard_normal((t, d), dtype=np.float32)
    return xs, q, g, d_out


# ---------------------------------------------------------------------------------------------
# workers: each returns {row name: zero-argument callable that runs one call to completion}

def torch_rows(args, case, dtype_name, keep):
    import attnres_torch as at
    import torch
    from attnres_torch.kernels import composite, cpu_c

    torch.set_num_threads(args.threads)
    kept = None
    if keep:
        from attnres_torch import cpu_alloc

        kept = cpu_alloc.keep_large_blocks()  # False off glibc: the "keep" rows are then plain ones
    dtype = getattr(torch, dtype_name)
    n, t, d = args.sources, args.tokens, args.dim
    xs_np, q_np, g_np, do_np = np_inputs(n, t, d)
    xs = [torch.from_numpy(x).to(dtype) for x in xs_np]
    q, g = torch.from_numpy(q_np), torch.from_numpy(g_np)
    d_out = torch.from_numpy(do_np).to(dtype)
    copy_src = torch.cat([x.reshape(-1) for x in xs])
    copy_dst = torch.empty_like(copy_src)
    rows, info = {}, {}
    tag = "torch keep" if keep else "torch"

    def fresh():
        return torch.empty(t, d, dtype=dtype).fill_(1)

    if case == "fwd":
        def floor():
            for x in xs:
                x.sum()
            fresh()

        def ours():
            with torch.no_grad():
                at.depth_attention(xs, q, g)

        rows[f"{tag}: floor (read N + write fresh out)"] = floor
        rows[f"{tag}: ours"] = ours
        if not keep:
            out, lse = torch.empty(t, d, dtype=dtype), torch.empty(t, dtype=torch.float32)
            qg = (q * g).contiguous()

            def ours_out():
                cpu_c.forward_into(xs, qg, 1e-6, 1.0, out, lse)

            def comp():
                with torch.no_grad():
                    composite.depth_attention(xs, q, g, eps=1e-6, scale=1.0, num_heads=1,
                                              activation="softmax", key_norm=True)

            if cpu_c.available():
                rows[f"{tag}: ours, reused out buffer (C entry point)"] = ours_out
            rows[f"{tag}: composite"] = comp
            rows[f"{tag}: copy"] = lambda: copy_dst.copy_(copy_src)
    else:
        xg = [x.clone().requires_grad_() for x in xs]
        qg_, gg = q.clone().requires_grad_(), g.clone().requires_grad_()

        def floor():
            for x in xs:
                x.sum()
            fresh()
            for x in xs:
                x.sum()
            d_out.sum()
            for _ in range(n):
                fresh()

        def ours():
            torch.autograd.grad(at.depth_attention(xg, qg_, gg), xg + [qg_, gg], d_out)

        def comp():
            out = composite.depth_attention(xg, qg_, gg, eps=1e-6, scale=1.0, num_heads=1,
                                            activation="softmax", key_norm=True)[0]
            torch.autograd.grad(out, xg + [qg_, gg], d_out)

        rows[f"{tag}: floor (read 2N+1 + write N+1 fresh)"] = floor
        rows[f"{tag}: ours"] = ours
        if not keep:
            rows[f"{tag}: composite"] = comp
            rows[f"{tag}: copy"] = lambda: copy_dst.copy_(copy_src)
    ours()
    info["impl"] = at.last_impl()
    info["version"] = torch.__version__
    info["threads"] = torch.get_num_threads()
    info["build_flags"] = " ".join(cpu_c.build_flags() or ())
    info["vector_width"] = cpu_c.vector_width(dtype)
    if keep:
        info["large_blocks_kept"] = kept
    return rows, info


def jax_rows(args, case, dtype_name):
    import jax
    import jax.numpy as jnp
    from attnres_jax import depth_attention

    xs_np, q_np, g_np, do_np = np_inputs(args.sources, args.tokens, args.dim)
    dtype = getattr(jnp, dtype_name)
    xs = [jnp.asarray(x).astype(dtype) for x in xs_np]
    q, g, d_out = jnp.asarray(q_np), jnp.asarray(g_np), jnp.asarray(do_np).astype(dtype)

    def fn(xs, q, g):
        return depth_attention(xs, q, g, impl="xla")

    if case == "fwd":
        f = jax.jit(fn)

        def run():
            jax.block_until_ready(f(xs, q, g))
    else:
        @jax.jit
        def step(xs, q, g, d_out):
            _, vjp = jax.vjp(fn, xs, q, g)
            return vjp(d_out)

        def run():
            jax.block_until_ready(step(xs, q, g, d_out))
    return {"jax xla (jit)": run}, {"impl": "xla", "version": jax.__version__,
                                   "devices": str(jax.devices())}


def mlx_rows(args, case, dtype_name):
    import attnres_mlx as A
    import mlx.core as mx
    from attnres_mlx import dispatch

    xs_np, q_np, g_np, do_np = np_inputs(args.sources, args.tokens, args.dim)
    dtype = getattr(mx, dtype_name)
    xs = [mx.array(x).astype(dtype) for x in xs_np]
    q, g, d_out = mx.array(q_np), mx.array(g_np), mx.array(do_np).astype(dtype)
    mx.eval(xs, q, g, d_out)
    mx.eval(A.depth_attention(xs, q, g))
    impl = dispatch.last_choice().impl  # the implementation that served the call (the contract)
    n = len(xs)

    def fn(*a):  # mx.vjp takes a flat list of primals
        return [A.depth_attention(list(a[:n]), a[n], a[n + 1])]

    if case == "fwd":
        def run():
            mx.eval(A.depth_attention(xs, q, g))
    else:
        def run():
            _, grads = mx.vjp(fn, [*xs, q, g], [d_out])
            mx.eval(grads)
    return {"mlx compiled": run}, {"impl": impl, "version": mx.__version__}


def worker(args):
    """Line protocol on stdin/stdout: {"cmd": "setup", "case", "dtype"} -> {"rows", "info"};
    {"cmd": "time", "row"} -> {"s"}; {"cmd": "quit"}."""
    rows = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "setup":
            rows = {}  # drop the previous case's buffers first
            import gc

            gc.collect()
            if args.worker in ("torch", "torch-keep"):
                rows, info = torch_rows(args, msg["case"], msg["dtype"], args.worker == "torch-keep")
            elif args.worker == "jax":
                rows, info = jax_rows(args, msg["case"], msg["dtype"])
            else:
                rows, info = mlx_rows(args, msg["case"], msg["dtype"])
            for fn in rows.values():  # warm-up: compile, fault in the heap
                fn()
                fn()
            reply = {"rows": list(rows), "info": info}
        else:
            fn = rows[msg["row"]]
            t0 = time.perf_counter()
            fn()
            reply = {"s": time.perf_counter() - t0}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# driver

class Worker:
    def __init__(self, name, python, args):
        cmd = [python, str(Path(__file__).resolve()), "--worker", name, "--threads", str(args.threads),
               "--sources", str(args.sources), "--tokens", str(args.tokens), "--dim", str(args.dim)]
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=str(ROOT))

    def ask(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait()


def loadavg():
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def min_bytes(case, n, t, d, elsize):
    """Forward: N source reads + 1 output write; forward+backward: 2N + 1 reads (sources twice,
    d_out) and N + 1 writes (out, N gradients)."""
    return (n + 1 if case == "fwd" else 3 * n + 2) * t * d * elsize


def run_case(workers, case, dtype, args):
    rows, info = [], {}
    for w in workers:
        reply = w.ask(cmd="setup", case=case, dtype=dtype)
        rows += [(w, r) for r in reply["rows"]]
        info[w.name] = reply["info"]
    times = {r: [] for _, r in rows}
    for _ in range(args.reps):
        for w, r in rows:
            time.sleep(args.gap)  # the previous call's spinning pool threads (OpenMP, Eigen) park
            times[r].append(w.ask(cmd="time", row=r)["s"])
    return times, info


def summarize(case, dtype, times, args):
    n, t, d = args.sources, args.tokens, args.dim
    es = 4 if dtype == "float32" else 2
    nbytes = min_bytes(case, n, t, d, es)
    copy = times.get("torch: copy")
    copy_gbs = (2 * n * t * d * es / statistics.median(copy) / 1e9) if copy else None
    jax_t = times.get("jax xla (jit)")
    plain = times.get("torch: ours")
    out = []
    for name, ts in times.items():
        if name.endswith(": copy"):
            continue
        proc = name.split(":")[0] if ":" in name else None
        floor = next((v for k, v in times.items() if proc and k.startswith(proc + ": floor")), None)
        med = statistics.median(ts)
        gbs = nbytes / med / 1e9
        row = dict(row=name, ms=med * 1e3, ms_min=min(ts) * 1e3, ms_max=max(ts) * 1e3, gbs=gbs,
                   copy_frac=None if copy_gbs is None else gbs / copy_gbs,
                   per_floor=None if floor is None or ": floor" in name else
                   statistics.median(a / b for a, b in zip(ts, floor)),
                   jax_over_row=None if jax_t is None else
                   statistics.median(j / a for j, a in zip(jax_t, ts)),
                   plain_over_row=None if plain is None or ": floor" in name else
                   statistics.median(p / a for p, a in zip(plain, ts)))
        out.append(row)
    return out, copy_gbs


def markdown(results, meta, args):
    lines = [
        "## CPU, the user's loop (`bench/bench_user_loop.py`, issue 19)",
        "",
        f"Host: {meta['cpu']} ({os.cpu_count()} CPUs), {meta['date']}, load average "
        f"{meta['load_before']} before / {meta['load_after']} after; {args.threads} threads; "
        f"median of {args.reps} calls per row, all rows called in turn (round-robin over worker "
        "processes); ratios are medians of per-round ratios.",
        f"Versions: {meta['versions']}.",
        f"Shape: N = {args.sources} sources `[{args.tokens}, {args.dim}]`, query and gain `[{args.dim}]` "
        "fp32; forward without grad (fresh output), forward+backward = `autograd.grad` / `jax.vjp` / "
        "`mx.vjp` of every source, query and gain with a random cotangent (fresh gradients).",
        "Minimal bytes: forward (N + 1) `[T, D]`, forward+backward (3N + 2) `[T, D]` (2N + 1 reads, "
        "N + 1 writes). `/ floor`: per-round ratio to the floor row of the same process. "
        "`JAX / row`, `ours / row`: per-round time of JAX, of torch's plain `ours`, over this "
        "row's (> 1: the row is faster).",
        "",
    ]
    for (case, dtype), (rows, copy_gbs) in results.items():
        title = "forward" if case == "fwd" else "forward + backward"
        cg = "n/a" if copy_gbs is None else f"{copy_gbs:.1f} GB/s"
        lines += [f"### {title}, {dtype} (copy bandwidth in this run: {cg})", "",
                  "| row | ms (median) | min-max ms | GB/s | % copy bw | / floor | JAX / row | "
                  "ours / row |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            def f(v, fmt):
                return "" if v is None else fmt.format(v)
            lines.append(f"| {r['row']} | {r['ms']:.1f} | {r['ms_min']:.1f}-{r['ms_max']:.1f} | "
                         f"{r['gbs']:.1f} | {f(r['copy_frac'] and 100 * r['copy_frac'], '{:.0f}%')} | "
                         f"{f(r['per_floor'], '{:.2f}x')} | {f(r['jax_over_row'], '{:.2f}x')} | "
                         f"{f(r['plain_over_row'], '{:.2f}x')} |")
        lines.append("")
    lines.append(f"Implementations: {meta['impls']}.")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=("torch", "torch-keep", "jax", "mlx"), help=argparse.SUPPRESS)
    ap.add_argument("--sources", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gap", type=float, default=0.2,
                    help="seconds of sleep before each call (other processes' pools go idle)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--peers", nargs="+", default=["torch", "torch-keep", "jax", "mlx"])
    ap.add_argument("--torch-python", default=str(ROOT / ".nox/tests-torch/bin/python"))
    ap.add_argument("--jax-python", default=str(ROOT / ".nox/tests-jax/bin/python"))
    ap.add_argument("--mlx-python", default=str(ROOT / ".nox/tests-mlx/bin/python"))
    ap.add_argument("--json", default=str(ROOT / "bench/results/user-loop.json"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/user-loop.md"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    pythons = {"torch": args.torch_python, "torch-keep": args.torch_python, "jax": args.jax_python,
               "mlx": args.mlx_python}
    workers = [Worker(p, pythons[p], args) for p in args.peers if Path(pythons[p]).exists()]
    meta = dict(cpu=cpu_model(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                load_before=loadavg())
    results, raw, infos = {}, {}, {}
    try:
        for dtype in args.dtypes:
            for case in args.cases:
                times, info = run_case(workers, case, dtype, args)
                results[(case, dtype)] = summarize(case, dtype, times, args)
                raw[f"{case}/{dtype}"] = times
                infos[f"{case}/{dtype}"] = info
                print(f"{case} {dtype}: " + ", ".join(
                    f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items()),
                    file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.close()
    meta["load_after"] = loadavg()
    first = next(iter(infos.values()))
    meta["versions"] = ", ".join(f"{k} {v.get('version')}" for k, v in first.items())
    meta["impls"] = "; ".join(
        f"{k} {case}: {v.get('impl')}" + (f" ({v['build_flags']}, {v['vector_width']} lanes)"
                                          if v.get("build_flags") else "")
        + ("" if v.get("large_blocks_kept", True) else " (keep_large_blocks unavailable: plain)")
        for case, info in infos.items() if case.startswith("fwd/") for k, v in info.items()
        if k.startswith("torch") or case == next(iter(infos)))
    text = markdown(results, meta, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.json).write_text(json.dumps(dict(meta=meta, args=vars(args), times=raw, info=infos,
                                               rows={f"{c}/{d}": r[0] for (c, d), r in results.items()}),
                                          indent=1))
    print(text)


if __name__ == "__main__":
    main()
