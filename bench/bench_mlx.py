"""MLX benchmark: `attnres_mlx.depth_attention` (custom VJP over the mx.compile'd composition) against
the naive uncompiled composition of the same math, forward and forward+backward, on this
machine's CPU (or Metal where available).

    python bench/bench_mlx.py [--reps 10] [--out bench/results/mlx.md]
    python bench/bench_mlx.py --decode [--layers 16 32] [--reps 7]
    python bench/bench_mlx.py --prefill [--layers 16 32 64] [--tokens 64] [--reps 7]

`--decode`: batch-1 single-token decode of `attnres_mlx.Transformer` (`--dim`, default 128; 4 heads, a
32-token prompt, 16 x reps new tokens) with PreNorm (kind standard), Full and Block (S = 8) at
L sublayers, eager (cache grown by concatenation) and `compile_step` (fixed-size cache, one
trace), direct and (Block) two-phase; the models take turns token by token in one process, so
each ratio to PreNorm is measured under the same load.  Per token: the wall time and the
process CPU time (all threads; less sensitive to other jobs on a shared machine).

`--prefill`: the same models' eager prefill of `--tokens` tokens (batch 1), Block S = 8 direct
against two-phase: the first call (tracing and compiling included) and the median of reps
later calls, the schemes taking turns call by call.

Reported per shape: median wall time, achieved GB/s on the minimal bytes (read N sources, write
out; backward also reads d_out and writes N source gradients), that as a fraction of the
measured copy bandwidth, peak memory (MLX allocator), and the speedup naive / ours measured in
the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import attnres_mlx as A
import mlx.core as mx

SHAPES = [  # (N sources, tokens, D, dtype)
    (4, 2048, 512, mx.float32),
    (8, 2048, 1024, mx.float32),
    (16, 1024, 1024, mx.float32),
    (8, 2048, 1024, mx.bfloat16),
]


def naive(xs, q, g, eps=1e-6):
    """The same op composed from plain MLX ops, uncompiled (stacks the sources)."""
    x = mx.stack(xs).astype(mx.float32)
    r = mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    z = mx.sum(x * r * (q * g).astype(mx.float32), axis=-1)
    p = mx.softmax(z, axis=0)
    return mx.sum(p[..., None] * x, axis=0).astype(xs[0].dtype)


def ours(xs, q, g):
    return A.depth_attention(xs, q, g)


def _time(fn, args, reps):
    mx.eval(fn(*args))  # warm-up (traces and compiles)
    times = []
    mx.reset_peak_memory()
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), mx.get_peak_memory()


def _copy_bandwidth(reps):
    """GB/s of a plain 256 MB float32 copy (read + write)."""
    x = mx.random.normal((64 * 1024 * 1024,))
    mx.eval(x)
    t, _ = _time(lambda a: a + 0.0, (x,), reps)
    return 2 * x.nbytes / t / 1e9


def _fwd_bwd(fn):
    def loss(xs, q, g, cot):
        return mx.sum(fn(xs, q, g).astype(mx.float32) * cot)
    grad = mx.grad(loss, argnums=(0, 1, 2))
    return lambda xs, q, g, cot: grad(xs, q, g, cot)


def _decode_models(num_layers, dim):
    from attnres_core.config import ResidualConfig
    configs = {"PreNorm": ResidualConfig.variant("standard"),
               "Full": ResidualConfig.variant("full"),
               "Block S=8": ResidualConfig.variant("block", block_size=8)}
    models = {}
    for name, cfg in configs.items():
        mx.random.seed(0)
        model = A.Transformer(cfg, vocab_size=256, dim=dim, num_blocks=num_layers // 2,
                              num_heads=4)
        mx.eval(model.parameters())
        models[name] = model
    return models


class _Decoder:
    """One model decoding one sequence step by step: `step()` times one token (seconds)."""

    def __init__(self, model, mode, schedule, prompt, max_len):
        self.model, self.mode, self.schedule = model, mode, schedule
        tokens = mx.array([[1] * prompt])
        if mode == "compiled":
            self.fn = model.compile_step(schedule=schedule)
            logits, self.cache = self.fn(tokens, model.make_cache(1, max_len), mx.array(0))
        else:
            logits, self.cache = model(tokens, schedule=schedule)
        self.pos = prompt
        self.tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(self.tok, self.cache)

    def step(self):
        """(wall, process CPU) seconds of one token."""
        t0, c0 = time.perf_counter(), time.process_time()
        if self.mode == "compiled":
            logits, self.cache = self.fn(self.tok, self.cache, mx.array(self.pos))
        else:
            logits, self.cache = self.model(self.tok, self.cache, schedule=self.schedule)
        self.tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(self.tok, self.cache)
        self.pos += 1
        return time.perf_counter() - t0, time.process_time() - c0


def decode_main(args):
    load_before = os.getloadavg()[0]
    rows = []
    prompt, steps = 32, 16 * args.reps
    for num_layers in args.layers:
        models = _decode_models(num_layers, args.dim)
        keys = [(name, mode, "direct") for name in models for mode in ("eager", "compiled")]
        keys += [(name, mode, "two_phase") for name in models if name.startswith("Block")
                 for mode in ("eager", "compiled")]
        decoders = {k: _Decoder(models[k[0]], k[1], k[2], prompt, prompt + steps + 4)
                    for k in keys}
        for d in decoders.values():  # the T = 1 trace / compiles
            d.step()
        times = {k: [] for k in keys}
        cpu = {k: [] for k in keys}
        for _ in range(steps - 1):  # round robin, one token each: every ratio under one load
            for k, d in decoders.items():
                wall, used = d.step()
                times[k].append(wall)
                cpu[k].append(used)
        for key in keys:
            name, mode, schedule = key
            med, best = statistics.median(times[key]), min(times[key])
            base, cbase = times["PreNorm", mode, "direct"], cpu["PreNorm", mode, "direct"]
            cmed = statistics.median(cpu[key])
            rows.append(f"| {num_layers} | {args.dim} | {name} | {mode} | {schedule} | "
                        f"{med * 1e3:.2f} | "
                        f"{med / statistics.median(base):.2f}x | {best / min(base):.2f}x | "
                        f"{cmed * 1e3:.2f} | {cmed / statistics.median(cbase):.2f}x |")
            print(rows[-1], flush=True)
    print(f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after; "
          f"mlx {mx.__version__}; per-token median and fastest of {steps - 1} tokens, models "
          "taking turns token by token")
    print("| L | D | scheme | path | schedule | ms/token (median) | / PreNorm (median) | "
          "/ PreNorm (fastest) | CPU ms/token (median) | CPU / PreNorm |\n"
          "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def prefill_main(args):
    load_before = os.getloadavg()[0]
    rows = []
    tokens = mx.array([[1] * args.tokens])
    for num_layers in args.layers:
        models = _decode_models(num_layers, args.dim)
        keys = [("PreNorm", "direct"), ("Full", "direct"), ("Block S=8", "direct"),
                ("Block S=8", "two_phase")]
        first, times = {}, {k: [] for k in keys}
        for key in keys:  # the first call: traces and compiles the reads' functions
            t0 = time.perf_counter()
            mx.eval(models[key[0]](tokens, schedule=key[1])[0])
            first[key] = time.perf_counter() - t0
        for _ in range(args.reps):
            for key in keys:
                t0 = time.perf_counter()
                mx.eval(models[key[0]](tokens, schedule=key[1])[0])
                times[key].append(time.perf_counter() - t0)
        for key in keys:
            med = statistics.median(times[key])
            rows.append(f"| {num_layers} | {args.tokens} | {key[0]} | {key[1]} | "
                        f"{first[key] * 1e3:.0f} | {med * 1e3:.1f} | "
                        f"{med / statistics.median(times['PreNorm', 'direct']):.2f}x |")
            print(rows[-1], flush=True)
    print(f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after; "
          f"mlx {mx.__version__}; eager prefill, batch 1, D = {args.dim}, median of {args.reps}")
    print("| L | T | scheme | schedule | first call ms | ms (median) | / PreNorm |\n"
          "|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mlx.md")
    ap.add_argument("--decode", action="store_true", help="the decode benchmark (see above)")
    ap.add_argument("--layers", type=int, nargs="+", default=[16],
                    help="--decode/--prefill: sublayer counts L (even)")
    ap.add_argument("--dim", type=int, default=128, help="--decode/--prefill: model width D")
    ap.add_argument("--prefill", action="store_true", help="the prefill benchmark (see above)")
    ap.add_argument("--tokens", type=int, default=64, help="--prefill: prompt length T")
    args = ap.parse_args()
    if args.decode:
        return decode_main(args)
    if args.prefill:
        return prefill_main(args)
    load_before = os.getloadavg()[0]
    copy_bw = _copy_bandwidth(args.reps)
    device = "Metal GPU" if mx.metal.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    rows = []
    for n, tokens, dim, dtype in SHAPES:
        mx.random.seed(0)
        xs = [mx.random.normal((tokens, dim)).astype(dtype) for _ in range(n)]
        q, g = mx.random.normal((dim,)) * 0.1, mx.random.normal((dim,)) * 0.1 + 1.0
        cot = mx.random.normal((tokens, dim))
        mx.eval(xs, q, g, cot)
        src_bytes = n * xs[0].nbytes
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd":
                fns, call, nbytes = (naive, ours), (xs, q, g), src_bytes + xs[0].nbytes
            else:
                fns, call = (_fwd_bwd(naive), _fwd_bwd(ours)), (xs, q, g, cot)
                # fwd+bwd minimal traffic: read sources twice (fwd, bwd), read d_out, write out
                # and the N source gradients.
                nbytes = 2 * src_bytes + 2 * xs[0].nbytes + src_bytes
            (t_naive, m_naive), (t_ours, m_ours) = (_time(f, call, args.reps) for f in fns)
            gbs = nbytes / t_ours / 1e9
            rows.append(f"| {mode} | {n} | {tokens} | {dim} | {str(dtype).split('.')[-1]} | "
                        f"{t_naive * 1e3:.2f} | {t_ours * 1e3:.2f} | {t_naive / t_ours:.2f}x | "
                        f"{gbs:.2f} | {gbs / copy_bw:.0%} | {m_naive / 2**20:.0f} | "
                        f"{m_ours / 2**20:.0f} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "## MLX backend (`bench/bench_mlx.py`)",
        "",
        f"Device: {device}, 2 cores shared, mlx {mx.__version__}; date 2026-11-30; "
        f"median of {args.reps} runs after one warm-up; measured copy bandwidth "
        f"{copy_bw:.1f} GB/s (256 MB float32 `a + 0`); 1-minute load average "
        f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after the run (the machine is "
        "shared: absolute times and GB/s are noisy; each ratio is measured in the same run).",
        "",
        "`naive` = the op composed from plain MLX ops, uncompiled (stacks the sources); "
        "`ours` = `attnres_mlx.depth_attention` on a list of sources (custom VJP over the "
        "`mx.compile`d composition; no Metal here).  Sources `[tokens, D]`, pseudo-query and gain "
        "float32, softmax, key norm.  GB/s on the minimal bytes (fwd: read N sources + write "
        "out; fwd+bwd: read sources twice, read d_out, write out and N gradients).  Peak = MLX "
        "allocator peak (MiB) during the timed runs.",
        "",
        "| pass | N | tokens | D | dtype | naive ms | ours ms | speedup | ours GB/s | of copy BW "
        "| naive peak MiB | ours peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
