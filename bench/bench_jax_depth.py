"""JAX at depth: compile time and steady step time of the NNX `Transformer` train step.

The model of issue 32: `attnres_jax.modules.Transformer` (dim 128, 4 heads, MLP ratio 4, vocab
256), batch 4 x 64 tokens, one `jax.jit` AdamW step (optax), PreNorm ("standard") against Full
and Block (S = 8), L = 2 x num_blocks sublayers, unrolled (`stack_apply`) and layer-scanned
(`scan_layers=True`: Full's backward "fused", Block's "replay"; "scanned-replay" /
"scanned-carry": the same with `scan_backward=` "replay" / "scan", the latter lax.scan's own
autodiff of the shared schedule, Full's default before the fused backward).  compile = lower +
XLA compile of the step; step = median wall time of `--steps` steps after two warm-up steps,
the kinds of one form and depth taking turns step by step, with the process CPU time per step
(all threads) beside it: on a shared machine it moves less with the load than the wall time.
Ratios are against PreNorm of the same form, in this one run.  The machine load
(`os.getloadavg`) is printed before and after, and beside each row.

    python bench/bench_jax_depth.py                         # L = 8 16 32 64, both forms
    python bench/bench_jax_depth.py --depths 8 16 --forms scanned --steps 5
    python bench/bench_jax_depth.py --depths 32 --forms scanned-replay scanned-carry  # the two backwards
    python bench/bench_jax_depth.py --depths 8 32 --forms unrolled scanned --eager torch mlx  # side by side

Unrolled Full/Block compile grows with L (the issue measured Full L = 64 > 900 s), so the
unrolled form runs up to `--unrolled-max` (default 32) sublayers.  `--eager torch mlx` adds the
same model and step in PyTorch (`AttnResTransformer`) and MLX (`Transformer`), eager, each run by
its own interpreter (.nox/tests-torch, .nox/tests-mlx); their "compile" column is the first step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
from attnres_core.config import ResidualConfig

ROOT = Path(__file__).resolve().parents[1]

KINDS = {
    "prenorm": ResidualConfig.variant("standard"),
    "full": ResidualConfig.variant("full"),
    "block": ResidualConfig.variant("block", block_size=8),
}


FORMS = {"unrolled": {"scan_layers": False},
         "scanned": {"scan_layers": True},  # the default backward: full fused, block replayed
         "scanned-replay": {"scan_layers": True, "scan_backward": "replay"},  # the final buffer, steps replayed
         "scanned-carry": {"scan_layers": True, "scan_backward": "scan"}}  # lax.scan keeps every carry


def adamw_step(graphdef, tx):
    """`step(params, opt_state, tokens [B, T + 1]) -> (loss, params, opt_state)`: next-token cross
    entropy of the NNX model `graphdef` over its parameters, one optax `tx` update (to be jitted)."""
    import jax
    import optax
    from flax import nnx

    def step(params, opt_state, tokens):
        def loss(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    return step


def compile_step(kind: str, num_layers: int, form: str, *, dim=128, heads=4, batch=4, seq=64, vocab=256):
    """(compile seconds, run): `run()` takes one train step of the configuration and returns its
    (wall, process CPU) seconds."""
    import jax
    import jax.numpy as jnp
    import optax
    from attnres_jax.modules import Transformer
    from flax import nnx

    model = Transformer(KINDS[kind], vocab_size=vocab, dim=dim, num_blocks=num_layers // 2, num_heads=heads,
                        rngs=nnx.Rngs(0), **FORMS[form])
    graphdef, params = nnx.split(model)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)))

    step = adamw_step(graphdef, tx)

    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
    compile_s = time.perf_counter() - t0
    state = [params, opt_state]

    def run():
        t0, c0 = time.perf_counter(), time.process_time()
        value, state[0], state[1] = compiled(state[0], state[1], tokens)
        jax.block_until_ready((value, state[0]))
        return time.perf_counter() - t0, time.process_time() - c0

    return compile_s, run


def measure(kinds, num_layers: int, form: str, steps: int) -> dict:
    """kind -> compile seconds, median / fastest step seconds and median process CPU seconds per
    step.  The kinds' steps take turns (two warm-ups each, then `steps` rounds of one step per
    kind), so a change of the machine's load falls on all of them alike."""
    runs, out = {}, {}
    for kind in kinds:
        compile_s, runs[kind] = compile_step(kind, num_layers, form)
        out[kind] = {"compile": compile_s}
    for run in runs.values():
        run(), run()
    times = {kind: [] for kind in kinds}
    for _ in range(steps):
        for kind, run in runs.items():
            times[kind].append(run())
    for kind, ts in times.items():
        wall, cpu = zip(*ts)
        out[kind].update(step=statistics.median(wall), fastest=min(wall), cpu=statistics.median(cpu))
    return out


def _timed(step, steps: int) -> dict:
    """First step's seconds ("compile": eager frameworks have none, the first step warms up),
    then the median and fastest of `steps` steps after one more warm-up."""
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"compile": first, "step": statistics.median(times), "fastest": min(times)}


def measure_torch(kind: str, num_layers: int, steps: int, *, dim=128, heads=4, batch=4, seq=64,
                  vocab=256) -> dict:
    """The same model and step in PyTorch, eager: `attnres_torch.AttnResTransformer` (the C kernel
    on the CPU), AdamW, cross-entropy, backward, optimizer step."""
    import torch
    from attnres_torch.modules import AttnResTransformer

    torch.manual_seed(0)
    model = AttnResTransformer(vocab, dim, num_layers // 2, heads, KINDS[kind])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)))

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
        opt.step()

    return _timed(step, steps)


def measure_mlx(kind: str, num_layers: int, steps: int, *, dim=128, heads=4, batch=4, seq=64,
                vocab=256) -> dict:
    """The same model and step in MLX, eager (no `mx.compile`): `attnres_mlx.Transformer`,
    `nn.value_and_grad`, AdamW, `mx.eval` of the loss, parameters and optimizer state."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from attnres_mlx import Transformer

    mx.random.seed(0)
    model = Transformer(KINDS[kind], vocab_size=vocab, dim=dim, num_blocks=num_layers // 2, num_heads=heads)
    opt = optim.AdamW(learning_rate=1e-3)
    tokens = mx.array(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)))

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x)[0], y).mean()

    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step():
        loss, grads = value_and_grad(model, tokens[:, :-1], tokens[:, 1:])
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)

    return _timed(step, steps)


EAGER = {"torch": measure_torch, "mlx": measure_mlx}


def in_child(framework: str, kind: str, num_layers: int, steps: int) -> dict:
    """One eager configuration measured by the framework's own interpreter
    (`.nox/tests-<framework>/bin/python`, or ATTNRES_BENCH_<FRAMEWORK>_PYTHON)."""
    python = os.environ.get(f"ATTNRES_BENCH_{framework.upper()}_PYTHON",
                            str(ROOT / ".nox" / f"tests-{framework}" / "bin" / "python"))
    out = subprocess.run([python, __file__, "--child", framework, kind, str(num_layers), str(steps)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def load() -> str:
    return "load %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--forms", nargs="+", default=["unrolled", "scanned"], choices=list(FORMS))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--unrolled-max", type=int, default=32)
    ap.add_argument("--eager", nargs="*", default=[], choices=list(EAGER),
                    help="also the same model in these frameworks, eager, each in its own interpreter")
    ap.add_argument("--child", nargs=4, metavar=("FRAMEWORK", "KIND", "L", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        framework, kind, num_layers, steps = args.child
        print(json.dumps(EAGER[framework](kind, int(num_layers), int(steps))))
        return
    import jax
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"jax {jax.__version__} {jax.default_backend()}, {load()}")
    rows = {}
    for form in args.forms:
        for L in args.depths:
            if form == "unrolled" and L > args.unrolled_max:
                continue
            measured = measure(args.kinds, L, form, args.steps)
            for kind in args.kinds:
                r = rows[form, L, kind] = measured[kind]
                print(f"  {form:13s} L={L:3d} {kind:8s} compile {r['compile']:7.2f} s  step "
                      f"{1e3 * r['step']:8.1f} ms (fastest {1e3 * r['fastest']:7.1f}, process CPU "
                      f"{1e3 * r['cpu']:7.1f})  {load()}", flush=True)
    for framework in args.eager:
        form = f"{framework} eager"
        for L in args.depths:
            for kind in args.kinds:
                try:
                    r = in_child(framework, kind, L, args.steps)
                except (OSError, subprocess.CalledProcessError) as e:
                    print(f"  {form}: skipped ({type(e).__name__}: {getattr(e, 'stderr', '') or e})"[:300])
                    break
                rows[form, L, kind] = r
                print(f"  {form:13s} L={L:3d} {kind:8s} first  {r['compile']:7.2f} s  step "
                      f"{1e3 * r['step']:8.1f} ms (fastest {1e3 * r['fastest']:7.1f})", flush=True)
    forms = list(args.forms) + [f"{f} eager" for f in args.eager]
    print(f"# after: {load()}")
    print("\n| form | L | compile PreNorm | compile Full (x) | compile Block (x) | step PreNorm | "
          "step Full (x) | step Block (x) |")
    print("|---|---|---|---|---|---|---|---|")
    for form in forms:
        for L in args.depths:
            if (form, L, "prenorm") not in rows:
                continue
            base = rows[form, L, "prenorm"]
            cells = [form, str(L), f"{base['compile']:.1f} s"]
            for kind in ("full", "block"):
                r = rows.get((form, L, kind))
                cells.append("—" if r is None else f"{r['compile']:.1f} s ({r['compile'] / base['compile']:.2f}x)")
            cells.append(f"{1e3 * base['step']:.0f} ms")
            for kind in ("full", "block"):
                r = rows.get((form, L, kind))
                cells.append("—" if r is None else f"{1e3 * r['step']:.0f} ms ({r['step'] / base['step']:.2f}x)")
            print("| " + " | ".join(cells) + " |")
    cpu = [f"{form} L={L}: " + ", ".join(f"{kind} {rows[form, L, kind]['cpu'] / rows[form, L, 'prenorm']['cpu']:.2f}x"
                                          for kind in ("full", "block") if (form, L, kind) in rows)
           for form in args.forms for L in args.depths if "cpu" in rows.get((form, L, "prenorm"), {})]
    if cpu:
        print("\nprocess CPU per step against PreNorm's: " + "; ".join(cpu))
    scanned = [L for L in args.depths if ("scanned", L, "full") in rows]
    if len(scanned) > 1:
        lo, hi = min(scanned), max(scanned)
        print(f"\nscanned Full compile, L = {hi} / L = {lo}: "
              f"{rows['scanned', hi, 'full']['compile'] / rows['scanned', lo, 'full']['compile']:.2f}x")


if __name__ == "__main__":
    main()
