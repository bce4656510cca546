"""A/B of `attnres_jax.depth_attention` between source trees: the jitted forward or forward +
backward (`jax.vjp` with a fixed random cotangent) of N sources `[T, D]`, one persistent worker
process per tree, called in alternating rounds (A B A B ...), so every ratio is the median of
per-round ratios measured seconds apart under the same load.  Each worker also hashes its
outputs: trees whose results are bitwise the same print the same digest.

A tree is a checkout (or `git archive` of one): its `backend_jax/src` and `core/src` go first on
the worker's PYTHONPATH, everything else (jax, numpy) comes from the interpreter.

    git archive HEAD~1 backend_jax/src core/src | tar -x -C /tmp/before
    .nox/tests-jax/bin/python bench/ab_jax_op.py --trees /tmp/before . --case fwdbwd --rounds 15
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(args) -> None:
    """Line protocol: prints {"digest", "impl"} once compiled, then {"s"} per line read."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from attnres_jax import depth_attention

    rng = np.random.default_rng(0)
    dtype = getattr(jnp, args.dtype)
    shape = (args.tokens, args.dim)
    xs = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype) for _ in range(args.sources)]
    q = jnp.asarray(0.05 * rng.standard_normal(args.dim, dtype=np.float32))
    g = jnp.asarray(rng.random(args.dim, dtype=np.float32) + 0.5)
    d_out = jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    def op(xs, q, g):
        return depth_attention(xs, q, g, impl="xla")

    if args.case == "fwd":
        step = jax.jit(lambda xs, q, g, d: op(xs, q, g))
    else:
        @jax.jit
        def step(xs, q, g, d):
            _, pull = jax.vjp(op, xs, q, g)
            return pull(d)

    out = jax.block_until_ready(step(xs, q, g, d_out))
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(out):
        digest.update(np.asarray(leaf).tobytes())
    jax.block_until_ready(step(xs, q, g, d_out))
    print(json.dumps({"digest": digest.hexdigest()[:16]}), flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        jax.block_until_ready(step(xs, q, g, d_out))
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


def start(tree: Path, args) -> subprocess.Popen:
    path = os.pathsep.join(str(tree / p) for p in ("backend_jax/src", "core/src"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
    argv = [args.python, str(Path(__file__).resolve()), "--worker", "--case", args.case, "--dtype", args.dtype,
            "--tokens", str(args.tokens), "--dim", str(args.dim), "--sources", str(args.sources)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def read(proc: subprocess.Popen, tree: Path) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"ab_jax_op: the worker of {tree} died (exit {proc.wait()})")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trees", nargs="+", type=Path, default=[Path(".")], help="source trees; the first is the base")
    ap.add_argument("--case", choices=("fwd", "fwdbwd"), default="fwdbwd")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--sources", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--gap", type=float, default=0.2, help="seconds of sleep before each call")
    ap.add_argument("--python", default=sys.executable, help="the workers' interpreter")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    trees = [t.resolve() for t in args.trees]
    missing = [str(t) for t in trees if not (t / "backend_jax/src/attnres_jax").is_dir()]
    if missing:
        raise SystemExit(f"ab_jax_op: no backend_jax/src/attnres_jax in {', '.join(missing)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"{args.case} {args.dtype} N = {args.sources} [{args.tokens}, {args.dim}], {args.rounds} rounds", flush=True)
    procs = []
    try:
        for tree in trees:  # compiled one after the other: no compile beside a timed call
            procs.append(start(tree, args))
            ready = read(procs[-1], tree)
            print(f"{tree}: ready, outputs {ready['digest']}", flush=True)
        times = [[] for _ in trees]
        for _ in range(args.rounds):
            for k, (tree, proc) in enumerate(zip(trees, procs)):
                time.sleep(args.gap)
                proc.stdin.write("time\n")
                proc.stdin.flush()
                times[k].append(read(proc, tree)["s"])
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait()
    for tree, ts in zip(trees, times):
        ratio = statistics.median(a / b for a, b in zip(ts, times[0]))
        print(f"{tree}: median {1e3 * statistics.median(ts):.1f} ms, min {1e3 * min(ts):.1f} ms, "
              f"/ first {ratio:.3f}")


if __name__ == "__main__":
    main()
