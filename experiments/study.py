"""The depth study: does AttnRes help more as the model gets deeper, and at what cost?

Trains the example byte-level LM (`experiments.train.train_model`, same data, same pairing: for one
seed every variant starts from the same sublayer / embedding / head weights and sees the same
batches) for every residual variant x shape x seed, where the shapes are a depth sweep at fixed
width (`--depths` blocks at `--dim`) plus `--matched` shapes (BLOCKSxDIM, e.g. shallow-wide with
about the parameters of the deepest sweep shape).  Each run also gets

* the copy probe (`experiments.probes.copy_accuracy`: held-out text shown twice, accuracy on the
  second copy),
* its dilution measures at the last step (`DepthMonitor`: input RMS growth, per-sublayer output
  share, gradient norm per sublayer),
* its cost: training step time, training memory, batch-1 decode latency (Block: two-phase and
  direct schedules).

    python -m experiments.study --out /tmp/study                # the full study
    python -m experiments.study --depths 2,4 --dim 32 --steps 20 --seeds 1 --out s
    python -m experiments.study --out /tmp/study --report-only  # report what is done

Each finished run is saved as `OUT/runs/<blocks>x<dim>-<variant>-s<seed>.json`; running the same
command again skips finished runs (an interrupted study continues).  The report (`summary.md`,
PNGs: `experiments.study_report`) is written at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from . import probes, study_report, train
from .data import fixed_batches, load_stdlib_corpus, random_batch
from .model import variant_config

#: The study's default variants: the baseline, the paper's two schemes, their simple relatives.
DEFAULT_VARIANTS = "standard,full,block,scalar,gated,window,hybrid"

#: Arguments that change a run's result: a saved run made with other values is not reused.
RUN_SETTINGS = ("steps", "batch", "context", "heads", "lr", "block_size", "window", "eval_every",
                "eval_batches", "diag_every", "corpus_bytes", "probe_sequences", "probe_length")


def _ints(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints >= 1, got {text!r}")
    return values


def _shapes(text: str) -> List[Tuple[int, int]]:
    shapes = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        try:
            blocks, dim = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected BLOCKSxDIM items (e.g. 8x128), got {item!r}") from None
        if blocks < 1 or dim < 1:
            raise argparse.ArgumentTypeError(f"expected BLOCKSxDIM >= 1, got {item!r}")
        shapes.append((blocks, dim))
    return shapes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--residual", type=train._variants, default=train._variants(DEFAULT_VARIANTS),
                   help=f"comma list of residual variants (default: {DEFAULT_VARIANTS})")
    p.add_argument("--depths", type=_ints, default=[4, 8, 16, 32],
                   help="depth sweep, in Transformer blocks (L = 2 x blocks; default 4,8,16,32)")
    p.add_argument("--dim", type=int, default=64, help="d_model of the depth sweep (64)")
    p.add_argument("--matched", type=_shapes, default=[(8, 128)],
                   help="extra BLOCKSxDIM shapes for the width-vs-depth comparison at a matched "
                        "parameter count (default 8x128, about the parameters of 32x64; '' for none)")
    p.add_argument("--seeds", type=train._seeds, default=list(range(3)),
                   help="a count N (seeds 0..N-1) or a comma list (default: 3)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (200)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (8)")
    p.add_argument("--context", type=int, default=64, help="sequence length in bytes (64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (3e-3)")
    p.add_argument("--block-size", type=int, default=4, help="sublayers per block for 'block' (4)")
    p.add_argument("--window", type=int, default=4, help="recent outputs attended by 'window' (4)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between validation losses (50)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (8)")
    p.add_argument("--diag-every", type=int, default=100, help="steps between diagnostics records (100)")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="bytes of stdlib source read (4e6)")
    p.add_argument("--probe-sequences", type=int, default=64, help="held-out copy-probe sequences (64)")
    p.add_argument("--probe-length", type=int, default=32,
                   help="bytes shown before the copy; 2 x this must be <= --context (32)")
    p.add_argument("--latency-reps", type=int, default=10, help="timed decode steps per schedule (10)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 keeps torch's default (1)")
    p.add_argument("--out", type=Path, default=Path("attnres-study"), help="output folder (./attnres-study)")
    p.add_argument("--report-only", action="store_true", help="write the report from the saved runs only")
    p.add_argument("--no-plots", action="store_true", help="summary.md only")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("dim", "steps", "batch", "context", "heads", "block_size", "window", "eval_every",
                 "eval_batches", "diag_every", "probe_sequences", "latency_reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.probe_length < 2 or 2 * args.probe_length > args.context:
        raise SystemExit(f"--probe-length: expected 2 <= 2 x length <= --context {args.context}, "
                         f"got {args.probe_length}")
    for blocks, dim in shapes_of(args):
        if dim % args.heads:
            raise SystemExit(f"--heads {args.heads} does not divide d_model {dim} (shape {blocks}x{dim})")


def shapes_of(args: argparse.Namespace) -> List[Tuple[int, int]]:
    """The study's (blocks, dim) shapes: the depth sweep, then the matched shapes not in it."""
    sweep = [(b, args.dim) for b in args.depths]
    return sweep + [s for s in args.matched if s not in sweep]


def run_key(blocks: int, dim: int, variant: str, seed: int) -> str:
    return f"{blocks}x{dim}-{variant}-s{seed}"


def settings_of(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in RUN_SETTINGS}


def _trainer_args(args: argparse.Namespace, blocks: int, dim: int) -> argparse.Namespace:
    """The trainer's arguments (its defaults, then this study's values) for one shape."""
    targs = train.build_parser().parse_args([])
    for name in ("steps", "batch", "context", "heads", "lr", "block_size", "window", "eval_every",
                 "eval_batches", "diag_every"):
        setattr(targs, name, getattr(args, name))
    targs.blocks, targs.dim = blocks, dim
    return targs


def cost_weight(variant: str, blocks: int, dim: int) -> int:
    """Rough relative cost of one step (for the ETA): linear in depth and width, with the depth
    attention's extra cost (Full-like O(L^2) mixing, Block/window less)."""
    kind = variant_config(variant, 2 * blocks).kind
    L = 2 * blocks
    extra = 4 * L // 32 if kind in ("full", "hybrid", "static") else 4 * L // 80 if kind in ("block", "window") else 0
    return blocks * max(1, dim // 64) * (4 + extra)


class _Weighted:
    """A progress bar view that counts each step of one run as `weight` units (so the ETA of a
    sweep with runs of very different costs is roughly right) and prefixes the run's name."""

    def __init__(self, bar, weight: int, prefix: str):
        self.bar, self.weight, self.prefix = bar, weight, prefix

    def set_description(self, desc: str) -> None:
        self.bar.set_description(f"{self.prefix} {desc}")

    def set_postfix_str(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def update(self, n: int = 1) -> None:
        self.bar.update(n * self.weight)


def one_run(args: argparse.Namespace, blocks: int, dim: int, variant: str, seed: int, corpus,
            val_batches, probe_seqs, progress) -> dict:
    """Train one (shape, variant, seed) and measure it; returns the JSON-ready record."""
    targs = _trainer_args(args, blocks, dim)
    model, run = train.train_model(variant, seed, targs, corpus, val_batches, progress)
    run.update(blocks=blocks, dim=dim, settings=settings_of(args), probe=probes.copy_accuracy(model, probe_seqs))
    batch = random_batch(corpus.train, args.batch, args.context, torch.Generator().manual_seed(seed))
    run["memory"] = probes.training_memory(model, batch)
    schedules = ["direct"] + (["two_phase"] if model.router.config.supports_two_phase else [])
    run["decode_s"] = {s: probes.decode_latency(model, args.context, s, reps=args.latency_reps)
                       for s in schedules}
    return run


def load_runs(out: Path) -> List[dict]:
    """Every saved run of a study folder (sorted by file name)."""
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def _save(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # atomic: an interrupted write never leaves a half run behind


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    plots = not args.no_plots and train._plots_available()
    if not args.report_only:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        todo, settings = [], settings_of(args)
        for seed in args.seeds:  # seed outermost: an interrupted study has whole seeds done
            for blocks, dim in shapes_of(args):
                for variant in args.residual:
                    path = runs_dir / f"{run_key(blocks, dim, variant, seed)}.json"
                    if path.exists():
                        saved = json.loads(path.read_text()).get("settings")
                        if saved != settings:
                            raise SystemExit(f"{path}: saved with other settings {saved}, now {settings}; "
                                             "use another --out or delete it")
                        continue
                    todo.append((blocks, dim, variant, seed, path))
        total = len(shapes_of(args)) * len(args.residual) * len(args.seeds)
        train._say(f"attnres depth study: {total} runs, {total - len(todo)} already done in "
                   f"{runs_dir}/; reading the corpus ...")
        corpus = load_stdlib_corpus(args.corpus_bytes)
        val_batches = fixed_batches(corpus.val, args.eval_batches, args.batch, args.context)
        probe_seqs = probes.copy_windows(corpus.val, args.probe_sequences, args.probe_length)
        meta_path = args.out / "study.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"sessions": []}
        meta.update(corpus=corpus.describe(), torch=torch.__version__, cpu=_cpu_model(),
                    cpus=os.cpu_count(), threads=torch.get_num_threads(),
                    cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        meta["sessions"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                 "argv": sys.argv[1:] if argv is None else list(argv), "runs": len(todo)})
        meta_path.write_text(json.dumps(meta, indent=1))
        bar = train._progress(sum(args.steps * cost_weight(v, b, d) for b, d, v, _, _ in todo) or 1)
        try:
            for i, (blocks, dim, variant, seed, path) in enumerate(todo):
                view = _Weighted(bar, cost_weight(variant, blocks, dim),
                                 f"run {i + 1}/{len(todo)} {blocks}x{dim}")
                _save(path, one_run(args, blocks, dim, variant, seed, corpus, val_batches,
                                    probe_seqs, view))
        finally:
            bar.close()
    written = study_report.write(args.out, load_runs(args.out), args, plots=plots)
    train._say(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
