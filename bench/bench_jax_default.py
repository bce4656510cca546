"""JAX: what a user gets from `Transformer(...)` built with defaults (issue 43 item 1).

`attnres_jax.modules.Transformer` with no `scan_layers` (the default: layer-scanned for the kinds
`scan_apply` runs), dim 128, 4 heads, vocab 256, batch 4 x 64 tokens, one `nnx.jit` step with an
`nnx.Optimizer(optax.adamw)`, PreNorm ("standard") against Full and Block (S = 8).  compile =
the first call (trace + lower + XLA compile + that step), step = median wall time of `--steps`
steps after two warm-ups, the kinds of one depth taking turns step by step; ratios against
PreNorm of the same depth, in this one run.  The load (`os.getloadavg`) is printed before and
after.  `--unrolled` builds `scan_layers=False` instead (the form the default was before);
`--monitor` records a `training.DepthMonitor` in the step (its observer's statistics returned
by the step; on the scanned model they come out of the scan).

    python bench/bench_jax_default.py                      # L = 8 32 64
    python bench/bench_jax_default.py --depths 8 32 --unrolled
    python bench/bench_jax_default.py --monitor            # the monitored step
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

KINDS = ("prenorm", "full", "block")


def _config(kind: str):
    from attnres_core.config import ResidualConfig

    return {"prenorm": ResidualConfig.variant("standard"), "full": ResidualConfig.variant("full"),
            "block": ResidualConfig.variant("block", block_size=8)}[kind]


def build(kind: str, num_layers: int, unrolled: bool, monitor: bool = False, *, dim=128, heads=4, batch=4,
          seq=64, vocab=256):
    """(first-call seconds, run): `run()` takes one train step and returns its wall seconds."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from attnres_jax import training
    from attnres_jax.modules import Transformer
    from flax import nnx

    kw = {"scan_layers": False} if unrolled else {}
    model = Transformer(_config(kind), vocab_size=vocab, dim=dim, num_blocks=num_layers // 2,
                        num_heads=heads, rngs=nnx.Rngs(0), **kw)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)))
    depth = training.DepthMonitor(model.router) if monitor and kind != "prenorm" else None

    @nnx.jit
    def step(model, optimizer, tokens):
        obs = None if depth is None else depth.observer()

        def loss(model):
            logits = model(tokens[:, :-1], observer=obs)
            value = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
            return value, None if obs is None else obs.stats()

        (value, stats), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return value, stats

    def run():
        t0 = time.perf_counter()
        jax.block_until_ready(step(model, optimizer, tokens))
        return time.perf_counter() - t0

    return run(), run, model.scan_layers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--unrolled", action="store_true", help="scan_layers=False (the old default)")
    parser.add_argument("--monitor", action="store_true", help="a DepthMonitor recorded in the step")
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}")
    print("| L | scanned | compile PreNorm | compile Full (x) | compile Block (x) | step PreNorm | "
          "step Full (x) | step Block (x) |")
    print("|---|---|---|---|---|---|---|---|")
    for L in args.depths:
        runs, first, scanned = {}, {}, set()
        for kind in KINDS:
            first[kind], runs[kind], s = build(kind, L, args.unrolled, args.monitor)
            scanned.add(s)
        for run in runs.values():
            run(), run()
        times = {k: [] for k in KINDS}
        for _ in range(args.steps):
            for kind, run in runs.items():
                times[kind].append(run())
        step = {k: statistics.median(v) for k, v in times.items()}
        c0, s0 = first["prenorm"], step["prenorm"]
        print(f"| {L} | {'/'.join(map(str, sorted(scanned)))} | {c0:.1f} s | "
              f"{first['full']:.1f} s ({first['full'] / c0:.2f}x) | {first['block']:.1f} s ({first['block'] / c0:.2f}x) | "
              f"{s0 * 1e3:.0f} ms | {step['full'] * 1e3:.0f} ms ({step['full'] / s0:.2f}x) | "
              f"{step['block'] * 1e3:.0f} ms ({step['block'] / s0:.2f}x) |  load {os.getloadavg()[0]:.2f}",
              flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
