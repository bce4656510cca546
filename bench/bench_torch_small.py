"""The fixed cost of one small torch depth-attention call (T = 1: one decode step's read).

Per call, in microseconds, for N sources `[1, 1, D]` fp32 with a pseudo-query and gain `[D]`
(`nn.Parameter`s, as a router holds them), under `torch.no_grad()` unless the row says grad:

  default             attnres_torch.depth_attention as dispatched (repeated calls take the plan
                      kept for their signature: `plans.MEMO`, the C kernel's host code directly)
  previous            the same with `plans.MEMO = False`: every call validates, chooses and runs
                      through the custom op, the path of every call before plans were kept
  composite           the same call under `dispatch.use_impl("composite")`
  forward_into        `cpu_c.forward_into` on prepared `[T, D]` views, qg and outputs: the C
                      kernel and its host checks, nothing of the op around it
  C call              the ctypes call of the kernel alone on prepared pointers (the floor)
  grad default        default with grad enabled and the query requiring grad (forward only: the
                      custom op, its autograd node; the plan skips the checks and the choice)
  grad previous       the same with `plans.MEMO = False`
  multi / merge       the two-phase decode's calls as dispatched: `depth_attention_multi` with
                      S = 4 queries over the N sources, `merge_partial` of one phase-1 result
                      with a partial sum (no grad); "... previous" with `plans.MEMO = False`

Rows are interleaved: each round times a block of calls of every row in turn, and each ratio
(previous / default, default / C call) is taken per round and its median reported beside the
median times, so a load change between rounds moves both sides of a ratio.  The load average is
printed before and after.

Usage: python bench/bench_torch_small.py [--sources 2 5 17] [--dims 1024 128] [--rounds 9]
       [--calls 400] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from attnres_torch import _rows, dispatch, ops, plans
from attnres_torch.kernels import cpu_c

ROWS = ("default", "previous", "composite", "forward_into", "C call", "grad default",
        "grad previous", "multi", "multi previous", "merge", "merge previous")


def load() -> str:
    return "load %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0)


def calls(n: int, d: int) -> dict:
    """Row name -> a no-argument function making one call (its context set inside)."""
    gen = torch.Generator().manual_seed(n * 10_000 + d)
    src = [torch.randn((1, 1, d), generator=gen) for _ in range(n)]
    q = torch.nn.Parameter(torch.randn(d, generator=gen) * 0.1)
    g = torch.nn.Parameter(torch.ones(d))
    flat = [s.view(1, d) for s in src]
    qg, out, lse = _rows.qg(q, g).detach(), torch.empty(1, d), torch.empty(1)

    def default():
        with torch.no_grad():
            return ops.depth_attention(src, q, g)

    def composite():
        with torch.no_grad(), dispatch.use_impl("composite"):
            return ops.depth_attention(src, q, g)

    def kernel():
        cpu_c.forward_into(flat, qg, 1e-6, 1.0, out, lse)

    lib, (ptrs, strides) = cpu_c.library(), cpu_c._pointers(flat)
    args = (0, n, 1, d, ptrs, strides, qg.data_ptr(), 0, 1e-6, 1.0, out.data_ptr(), d,
            lse.data_ptr(), None, None, 0.0, None, 0, torch.get_num_threads())

    def c_call():
        lib.attnres_forward(*args)

    def grad():
        return ops.depth_attention(src, q, g)

    qs, gs = torch.randn((4, d), generator=gen) * 0.1, torch.ones(4, d)
    with torch.no_grad():
        out1, lse1 = ops.depth_attention(src, q, g, return_lse=True)
    partial = torch.randn((1, 1, d), generator=gen)

    def multi():
        with torch.no_grad():
            return ops.depth_attention_multi(src, qs, gs)

    def merge():
        with torch.no_grad():
            return ops.merge_partial(out1, lse1, partial, q, g)

    return {"default": (default, True), "previous": (default, False),
            "composite": (composite, True), "forward_into": (kernel, True),
            "C call": (c_call, True),
            "grad default": (grad, True), "grad previous": (grad, False),
            "multi": (multi, True), "multi previous": (multi, False),
            "merge": (merge, True), "merge previous": (merge, False)}


def block(fn, memo: bool, k: int) -> float:
    """Microseconds per call over k calls (after one untimed call)."""
    plans.MEMO = memo
    try:
        fn()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        return (time.perf_counter() - t0) / k * 1e6
    finally:
        plans.MEMO = True


def check_same_bits(rows: dict) -> None:
    """The default and the previous path give the same bits (and the same impl)."""
    for name in ("default", "multi", "merge"):
        fn = rows[name][0]
        plans.MEMO = False
        try:
            before, impl = fn(), dispatch.last_impl()
        finally:
            plans.MEMO = True
        fn()
        after = fn()
        before, after = ((before,), (after,)) if torch.is_tensor(before) else (before, after)
        if not all(map(torch.equal, before, after)) or dispatch.last_impl() != impl:
            raise SystemExit(f"{name}: the kept plan changed the result or the implementation")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, nargs="+", default=[2, 5, 17])
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 128])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_c.available():
        raise SystemExit(f"no C kernel: {cpu_c.unavailable_reason()}")
    meta = {"torch": torch.__version__, "threads": args.threads, "load_before": load()}
    print(f"torch {torch.__version__}, {args.threads} threads; {meta['load_before']}")
    results = []
    for d in args.dims:
        for n in args.sources:
            rows = calls(n, d)
            check_same_bits(rows)
            times = {name: [] for name in ROWS}
            for _ in range(args.rounds):
                for name in ROWS:
                    fn, memo = rows[name]
                    times[name].append(block(fn, memo, args.calls))
            med = {name: statistics.median(v) for name, v in times.items()}
            ratio = {
                "previous/default": statistics.median(
                    p / c for p, c in zip(times["previous"], times["default"])),
                "default/C call": statistics.median(
                    c / k for c, k in zip(times["default"], times["C call"])),
                "grad previous/default": statistics.median(
                    p / c for p, c in zip(times["grad previous"], times["grad default"])),
                "multi previous/default": statistics.median(
                    p / c for p, c in zip(times["multi previous"], times["multi"])),
                "merge previous/default": statistics.median(
                    p / c for p, c in zip(times["merge previous"], times["merge"])),
            }
            results.append({"N": n, "D": d, "us": med, "ratios": ratio})
            print(f"N = {n:2d}, D = {d:4d}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + " us; " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    meta["load_after"] = load()
    print(meta["load_after"])
    report = {"meta": meta, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
