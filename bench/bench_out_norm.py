"""The fused output norm (issue 14 item 5, C17) on the CPU: depth attention followed by the next
sublayer's pre-norm, unfused vs fused, paired in one run.

  unfused   out = attnres_torch.depth_attention(xs, q, g); normed = F.rms_norm(out, (D,), w, eps)
            (torch's RMSNorm reads out again and writes normed; its backward reads out and
            d_normed again and autograd adds its d_out into the op's)
  fused     out, normed = attnres_torch.depth_attention(xs, q, g, out_norm_weight=w)
            (normed written by the same kernel pass from the fp32 row; the backward folds
            d_normed into d_out per row in the kernel)
  op only   out = attnres_torch.depth_attention(xs, q, g), no norm at all (context: what the
            fusion costs on top of the op; its backward gets the cotangent of out only)

Cases: "fwd" (no autograd) and "fwdbwd" (`torch.autograd.grad` of (out, normed) with random
cotangents on both, w.r.t. the sources, query, gain and w).  Each round times one call of each
variant, alternating which goes first; medians over the rounds, and the median of the per-round
ratio.  Sources N x `[T, D]` in the dtype, query and gain fp32 `[D]`, w `[D]` in the sources'
dtype for both variants (a bf16 model's RMSNorm weight), eps = 1e-6 for both norms.

Minimum bytes (in units of one `[T, D]` array of the sources' dtype; N sources):
  fwd     unfused N + 1 (out) + 2 (norm: read out, write normed) = N + 3;  fused N + 2;  op N + 1
  fwdbwd  unfused (N + 3) + 3 (norm backward: read out, d_normed, write its d_out)
                  + 3 (autograd adds the two d_out) + 2N + 1 (op backward: sources, d_out, N grads)
          fused   (N + 2) + 2N + 2 (op backward: sources, d_out, d_normed, N grads)
          op      (N + 1) + 2N + 1
GB/s = those bytes / median time.

Usage: python bench/bench_out_norm.py [--threads 2] [--reps 9] [--sources 9 --tokens 8192
       --dim 1024] [--dtypes float32 bfloat16] [--json PATH] [--quick]
(--quick: tiny shapes and 2 rounds, to prove the script runs.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import attnres_torch as at
import torch
import torch.nn.functional as F
from bench_user_loop import cpu_model, loadavg  # the host line of every CPU bench, written once

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EPS = 1e-6


def min_bytes(case: str, variant: str, n: int, t: int, d: int, elsize: int) -> int:
    """The minimum bytes of the module docstring's table."""
    units = {("fwd", "unfused"): n + 3, ("fwd", "fused"): n + 2, ("fwd", "op only"): n + 1,
             ("fwdbwd", "unfused"): (n + 3) + 3 + 3 + 2 * n + 1,
             ("fwdbwd", "fused"): (n + 2) + 2 * n + 2, ("fwdbwd", "op only"): (n + 1) + 2 * n + 1}
    return units[(case, variant)] * t * d * elsize


def make_inputs(n, t, d, dtype):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(t, d, generator=gen).to(dtype) for _ in range(n)]
    q = torch.randn(d, generator=gen) * 0.5
    g = torch.rand(d, generator=gen) + 0.5
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    cot = (torch.randn(t, d, generator=gen).to(dtype), torch.randn(t, d, generator=gen).to(dtype))
    return xs, q, g, w, cot


def variants(xs, q, g, w, cot, case):
    """{name: callable returning (out, normed) or their gradients}."""
    d = xs[0].shape[-1]

    def unfused():
        out = at.depth_attention(xs, q, g, eps=EPS)
        return out, F.rms_norm(out, (d,), w, EPS)

    def fused():
        return at.depth_attention(xs, q, g, eps=EPS, out_norm_weight=w)

    def op_only():
        return (at.depth_attention(xs, q, g, eps=EPS),)

    if case == "fwd":
        def run(f):
            def call():
                with torch.no_grad():
                    return f()
            return call
    else:
        leaves = [x.detach().requires_grad_(True) for x in xs] + [
            t.detach().requires_grad_(True) for t in (q, g, w)]
        xs[:] = leaves[:len(xs)]
        q, g, w = leaves[len(xs):]

        def run(f):
            def call():
                res = f()
                return torch.autograd.grad(list(res), leaves, list(cot[:len(res)]),
                                           allow_unused=True, materialize_grads=True)
            return call
    return {"unfused": run(unfused), "fused": run(fused), "op only": run(op_only)}


def time_case(args, dtype_name, case):
    n, t, d = args.sources, args.tokens, args.dim
    dtype = DTYPES[dtype_name]
    xs, q, g, w, cot = make_inputs(n, t, d, dtype)
    calls = variants(xs, q, g, w, cot, case)
    impls = {}
    for name, call in calls.items():  # warm-up (builds the C kernel, faults the pages)
        call()
        impls[name] = at.last_impl()
    times = {name: [] for name in calls}
    ratios, overheads = [], []
    for r in range(args.reps):
        order = list(calls) if r % 2 == 0 else list(calls)[::-1]
        got = {}
        for name in order:
            t0 = time.perf_counter()
            calls[name]()
            got[name] = time.perf_counter() - t0
            times[name].append(got[name])
        ratios.append(got["unfused"] / got["fused"])
        overheads.append(got["fused"] / got["op only"])
    # the two agree (a sanity check, not the test: test_out_norm.py compares with the reference)
    a, b = calls["unfused"](), calls["fused"]()
    a, b = (a[:2], b[:2]) if case == "fwd" else (a, b)
    diff = max(float((x.double() - y.double()).abs().max() / (y.double().abs().max() + 1e-30))
               for x, y in zip(a, b))
    elsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for name in calls:
        ms = statistics.median(times[name]) * 1e3
        nbytes = min_bytes(case, name, n, t, d, elsize)
        rows.append(dict(dtype=dtype_name, case=case, variant=name, impl=impls[name], ms=ms,
                         min_bytes=nbytes, gbps=nbytes / ms / 1e6))
    saved = min_bytes(case, "unfused", n, t, d, elsize) - min_bytes(case, "fused", n, t, d, elsize)
    return rows, dict(dtype=dtype_name, case=case, speedup=statistics.median(ratios),
                      overhead=statistics.median(overheads), saved_bytes=saved, max_rel_diff=diff)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--sources", type=int, default=9)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep-large-blocks", action="store_true",
                   help="attnres_torch.cpu_alloc.keep_large_blocks() first (fresh gradients reuse pages)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.sources, args.tokens, args.dim, args.reps = 3, 64, 32, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    kept = args.keep_large_blocks and at.cpu.keep_large_blocks()
    print(f"# bench_out_norm: N={args.sources} T={args.tokens} D={args.dim}, threads "
          f"{args.threads}, {args.reps} rounds; {cpu_model()}; torch {torch.__version__}; "
          f"keep_large_blocks {kept}")
    print(f"# load average before: {loadavg()}")
    all_rows, summaries = [], []
    print("| dtype | case | variant | impl | ms (median) | min bytes (MB) | GB/s |")
    print("|---|---|---|---|---:|---:|---:|")
    for dtype_name in args.dtypes:
        for case in ("fwd", "fwdbwd"):
            rows, summary = time_case(args, dtype_name, case)
            all_rows += rows
            summaries.append(summary)
            for r in rows:
                print(f"| {r['dtype']} | {r['case']} | {r['variant']} | {r['impl']} | {r['ms']:.2f} | "
                      f"{r['min_bytes'] / 1e6:.1f} | {r['gbps']:.2f} |")
    print()
    print("| dtype | case | unfused / fused | fused / op only | bytes saved (MB) | max rel diff |")
    print("|---|---|---:|---:|---:|---:|")
    for s in summaries:
        print(f"| {s['dtype']} | {s['case']} | {s['speedup']:.3f}x | {s['overhead']:.3f}x | "
              f"{s['saved_bytes'] / 1e6:.1f} | {s['max_rel_diff']:.1e} |")
    print("(ratios: medians over the rounds of the per-round ratio; max rel diff: unfused vs fused "
          "outputs, max |a - b| / max |b|)")
    print(f"# load average after: {loadavg()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(rows=all_rows, summaries=summaries, load=loadavg(),
                                             args={k: str(v) for k, v in vars(args).items()}),
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
