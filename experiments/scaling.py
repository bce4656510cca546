"""The compute-scaling sweep: the paper's scaling-law comparison (Block AttnRes reaches the loss
of a PreNorm baseline trained with about 1.25x the compute) in miniature, on one CPU thread.

A ladder of model sizes (`--sizes`, BLOCKSxDIM: depth and width grown together at d / L_b = 16,
heads = d / `--head-dim`, as the paper grows L_b and d_model together with H = L_b), each size
trained with every variant (`--residual`: PreNorm "standard", "block", "full") and `--seeds`
seeds at the smallest `--multi-seed-sizes` sizes (one seed above).  Every run sees the same
number of training tokens per non-embedding parameter (`--tokens-per-param`, counted on the
PreNorm model of its size, so the variants of a size see the same batches), on the byte-level
corpus of `experiments.corpus` (the standard library and a few installed packages, held-out files
for validation).  The runs are `experiments.train.train_model`'s, paired like the trainer's: for one
seed every variant starts from the same sublayer, embedding and head weights.

* **Learning rate**: first a sweep of `--lr-sweep` peak values at `--lr-size` (every variant,
  seed 0, saved like every run); the value with the lowest PreNorm validation loss is then used
  for every variant, the paper's choice (hyperparameters tuned for the baseline, shared by all),
  and scaled to the other sizes by lr(d) = lr_best * d_sweep / d (`--lr BASE` skips the sweep).
  While the best value lies on an edge of the grid, the next value beyond it is tried (the
  grid's spacing there), up to `--lr-extend` per side.
* **Compute** per run: C = 6 * N * tokens, N the run's non-embedding parameters (everything but
  the token and position embeddings and the LM head), tokens = steps * batch * context.  The
  measured wall time and load average are recorded beside it.
* **Report** (`experiments.scaling_report`): a fit loss(C) = a * C^-b + c per variant, the compute
  multiplier of Block and Full against PreNorm at equal loss with a paired bootstrap interval,
  and the paper's figure (loss against compute, log x, fitted curves); summary.md, summary.json.

    python -m experiments.scaling --out DIR --plan          # measure, estimate, train nothing
    python -m experiments.scaling --out DIR                 # lr sweep, then sizes small to large
    python -m experiments.scaling --out DIR --report-only   # redraw from the finished runs

Each finished run is saved as `DIR/runs/<blocks>x<dim>-<variant>-s<seed>.json` (the sweep's as
`DIR/runs/lr<lr>-<blocks>x<dim>-<variant>-s0.json`); the same command again skips them, so an
interrupted sweep continues.  A saved run recorded with other settings or on another corpus
(its SHA-256) is refused, never mixed in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import scaling_report, study, train
from .corpus import DEFAULT_PACKAGES, Corpus, default_sources, load_corpus
from .data import fixed_batches, random_batch
from .model import ExampleLM, variant_config

DEFAULT_SIZES = "2x32,3x48,4x64,5x80,6x96"
DEFAULT_VARIANTS = "standard,block,full"
DEFAULT_LR_SWEEP = "2e-3,4e-3,8e-3,1.6e-2"
#: Parameter names outside the non-embedding count N.
EMBEDDING_PREFIXES = ("embed.", "pos.", "head.")
#: Rough per-step cost of each variant relative to PreNorm (only for the progress bar's ETA).
_COST = {"standard": 1.0, "block": 1.2, "full": 1.3}


def _floats(text: str) -> List[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers > 0, got {text!r}")
    return values


def _shape(text: str) -> Tuple[int, int]:
    shapes = study._shapes(text)
    if len(shapes) != 1:
        raise argparse.ArgumentTypeError(f"expected one BLOCKSxDIM shape, got {text!r}")
    return shapes[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("attnres-scaling"), help="output folder (./attnres-scaling)")
    p.add_argument("--sizes", type=study._shapes, default=study._shapes(DEFAULT_SIZES),
                   help=f"the size ladder, BLOCKSxDIM items (default {DEFAULT_SIZES})")
    p.add_argument("--residual", type=train._variants, default=train._variants(DEFAULT_VARIANTS),
                   help=f"comma list of variants, 'standard' among them (default {DEFAULT_VARIANTS})")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 at the smallest sizes (2)")
    p.add_argument("--multi-seed-sizes", type=int, default=3,
                   help="how many of the smallest sizes get --seeds seeds; the rest get seed 0 (3)")
    p.add_argument("--tokens-per-param", type=float, default=30.0,
                   help="training tokens per non-embedding parameter of the size's PreNorm model (30)")
    p.add_argument("--context", type=int, default=64, help="sequence length in bytes (64)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (32)")
    p.add_argument("--head-dim", type=int, default=16, help="d_model / heads (16)")
    p.add_argument("--block-size", type=int, default=2,
                   help="sublayers per Block AttnRes block (2: one block per Transformer block)")
    p.add_argument("--lr-sweep", type=_floats, default=_floats(DEFAULT_LR_SWEEP),
                   help=f"peak learning rates tried at --lr-size (default {DEFAULT_LR_SWEEP})")
    p.add_argument("--lr-size", type=_shape, default=None,
                   help="BLOCKSxDIM of the lr sweep (default: the second-smallest size)")
    p.add_argument("--lr-extend", type=int, default=2,
                   help="while the best PreNorm lr is at an edge of the sweep's grid, try the next value "
                        "beyond it (the grid's spacing at that edge), up to this many per side (2)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak lr at --lr-size, skipping the sweep (default: the sweep's best for PreNorm)")
    p.add_argument("--evals", type=int, default=8, help="validation points per run after step 0 (8)")
    p.add_argument("--eval-batches", type=int, default=32, help="fixed held-out validation batches (32)")
    p.add_argument("--packages", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                   default=list(DEFAULT_PACKAGES),
                   help=f"installed packages read besides the standard library (default {','.join(DEFAULT_PACKAGES)})")
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="read the text files of this folder instead of the standard library and --packages")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out (0.05)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 keeps torch's default (1)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the fits (1000)")
    p.add_argument("--plan", action="store_true",
                   help="measure the step time of every (size, variant) and print the sweep's time estimate; "
                        "trains nothing (writes DIR/plan.json)")
    p.add_argument("--plan-steps", type=int, default=5, help="timed steps per (size, variant) for --plan (5)")
    p.add_argument("--report-only", action="store_true", help="write the report from the saved runs only")
    p.add_argument("--no-plots", action="store_true", help="summary.md and summary.json only")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("seeds", "multi_seed_sizes", "context", "batch", "head_dim", "block_size", "evals",
                 "eval_batches", "bootstrap", "plan_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.tokens_per_param <= 0:
        raise SystemExit(f"--tokens-per-param: expected a number > 0, got {args.tokens_per_param}")
    if args.lr_extend < 0:
        raise SystemExit(f"--lr-extend: expected an int >= 0, got {args.lr_extend}")
    if args.lr is not None and args.lr <= 0:
        raise SystemExit(f"--lr: expected a number > 0, got {args.lr}")
    if "standard" not in args.residual:
        raise SystemExit(f"--residual: the PreNorm baseline 'standard' must be among {args.residual}")
    if not args.sizes:
        raise SystemExit("--sizes: expected at least one BLOCKSxDIM size")
    for blocks, dim in args.sizes + [lr_size(args)]:
        if dim % args.head_dim:
            raise SystemExit(f"--head-dim {args.head_dim} does not divide d_model {dim} (size {blocks}x{dim})")


def lr_size(args: argparse.Namespace) -> Tuple[int, int]:
    """The (blocks, dim) of the lr sweep: --lr-size, else the second-smallest size."""
    if args.lr_size is not None:
        return args.lr_size
    ladder = sorted_sizes(args)
    return ladder[1] if len(ladder) > 1 else ladder[0]


def nonembedding_params(model: torch.nn.Module) -> int:
    """N: the parameters outside the token and position embeddings and the LM head."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith(EMBEDDING_PREFIXES))


def build_model(args: argparse.Namespace, blocks: int, dim: int, variant: str) -> ExampleLM:
    """The model `train.train_model` builds for this size and variant (for counting and timing)."""
    config = variant_config(variant, 2 * blocks, block_size=args.block_size)
    return ExampleLM(config, dim=dim, num_blocks=blocks, num_heads=dim // args.head_dim,
                     context=args.context)


_PARAMS: Dict[tuple, int] = {}


def size_params(args: argparse.Namespace, blocks: int, dim: int, variant: str = "standard") -> int:
    """N of the model of this size and variant (counted once per shape and settings)."""
    key = (blocks, dim, variant, args.head_dim, args.block_size, args.context)
    if key not in _PARAMS:
        _PARAMS[key] = nonembedding_params(build_model(args, blocks, dim, variant))
    return _PARAMS[key]


def sorted_sizes(args: argparse.Namespace) -> List[Tuple[int, int]]:
    """The ladder, smallest non-embedding parameter count first (duplicates dropped)."""
    unique = list(dict.fromkeys(args.sizes))
    return sorted(unique, key=lambda s: (size_params(args, *s), s))


def steps_for(args: argparse.Namespace, blocks: int, dim: int) -> int:
    """Optimizer steps of every run of a size: tokens-per-param x N(PreNorm) / tokens per step."""
    return max(1, round(args.tokens_per_param * size_params(args, blocks, dim) / (args.batch * args.context)))


def lr_for(args: argparse.Namespace, base: float, dim: int) -> float:
    """The stated rule: lr(d) = base * d_sweep / d (base: the peak lr at the sweep's size)."""
    return float(f"{base * lr_size(args)[1] / dim:.6g}")


def run_key(blocks: int, dim: int, variant: str, seed: int, sweep_lr: Optional[float] = None) -> str:
    key = f"{blocks}x{dim}-{variant}-s{seed}"
    return key if sweep_lr is None else f"lr{sweep_lr:g}-{key}"


def common_settings(args: argparse.Namespace, corpus: Corpus) -> dict:
    """The settings every run of one sweep shares; a saved run that differs in any is refused."""
    return {"context": args.context, "batch": args.batch, "tokens_per_param": args.tokens_per_param,
            "head_dim": args.head_dim, "block_size": args.block_size, "evals": args.evals,
            "eval_batches": args.eval_batches, "lr_size": list(lr_size(args)),
            "lr_rule": "lr(d) = lr_base * d_lr_size / d", "corpus_sha256": corpus.sha256(),
            "torch": torch.__version__, "python": corpus.python}


def run_settings(args, common: dict, blocks: int, dim: int, variant: str, seed: int, lr: float,
                 kind: str) -> dict:
    return dict(common, kind=kind, blocks=blocks, dim=dim, heads=dim // args.head_dim, variant=variant,
                seed=seed, lr=lr, steps=steps_for(args, blocks, dim))


def _differences(saved: dict, expected: dict, keys: Optional[Sequence[str]] = None) -> List[str]:
    keys = sorted(set(saved) | set(expected)) if keys is None else keys
    return [f"{k}: saved {saved.get(k)!r}, now {expected.get(k)!r}" for k in keys
            if saved.get(k) != expected.get(k)]


def refuse_if_mismatched(path: Path, record: dict, expected: dict,
                         keys: Optional[Sequence[str]] = None) -> None:
    """SystemExit naming what differs when the saved run `record` was not made with `expected`
    (only `keys` of it when given)."""
    diff = _differences(record.get("settings", {}), expected, keys)
    if not diff:
        return
    corpus = any(d.startswith(("corpus_sha256", "torch", "python")) for d in diff)
    why = ("it was trained on another corpus or software (the environment's Python or packages "
           f"differ: saved sources {[(s['name'], s['version']) for s in record.get('corpus', {}).get('sources', [])]})"
           if corpus else "it was recorded with other settings")
    raise SystemExit(f"{path}: {why}: {'; '.join(diff)}.  Not mixing it into this sweep: use another "
                     "--out, or delete the file to retrain it.")


def _thin(xs: List[float], points: int = 100) -> Tuple[int, List[float]]:
    """(k, means of consecutive chunks of k values), at most `points` of them."""
    k = max(1, -(-len(xs) // points))
    return k, [sum(xs[i:i + k]) / len(xs[i:i + k]) for i in range(0, len(xs), k)]


def _trainer_args(args: argparse.Namespace, blocks: int, dim: int, lr: float) -> argparse.Namespace:
    targs = train.build_parser().parse_args([])
    steps = steps_for(args, blocks, dim)
    targs.steps, targs.batch, targs.context, targs.lr = steps, args.batch, args.context, lr
    targs.blocks, targs.dim, targs.heads, targs.block_size = blocks, dim, dim // args.head_dim, args.block_size
    targs.eval_every = max(1, steps // args.evals)
    targs.diag_every = steps  # DepthMonitor records the first and the last step only
    return targs


def one_run(args, blocks: int, dim: int, variant: str, seed: int, lr: float, settings: dict,
            corpus: Corpus, val_batches, progress) -> dict:
    """Train one run and return its JSON-ready record."""
    load_before, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    targs = _trainer_args(args, blocks, dim, lr)
    model, run = train.train_model(variant, seed, targs, corpus, val_batches, progress)
    n = nonembedding_params(model)
    tokens = targs.steps * args.batch * args.context
    every, curve = _thin(run.pop("train_loss"))
    run.update(blocks=blocks, dim=dim, heads=targs.heads, layers=2 * blocks, lr=lr, steps=targs.steps,
               nonembedding_params=n, tokens=tokens, tokens_per_param_actual=tokens / n,
               compute=6 * n * tokens, train_loss=curve, train_loss_every=every,
               diagnostics=run["diagnostics"][-1:], settings=settings, started=started,
               finished=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               load_before=list(load_before), load_after=list(os.getloadavg()),
               threads=torch.get_num_threads(), cpu=study._cpu_model(), torch=torch.__version__,
               corpus={"sha256": corpus.sha256(),
                       "sources": [{"name": s["name"], "version": s["version"]} for s in corpus.sources]})
    return run


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def load_runs(out: Path) -> List[dict]:
    """Every saved run of a sweep folder (sorted by file name), each with its file name."""
    return [dict(_load(p), file=p.name) for p in sorted((out / "runs").glob("*.json"))]


def best_lr(records: List[dict]) -> Optional[float]:
    """The sweep lr with the lowest final PreNorm validation loss (None without PreNorm runs; a
    NaN loss never wins)."""
    base = [(r["val"][-1]["loss"], r["lr"]) for r in records if r["variant"] == "standard"]
    base = [(loss if loss == loss else float("inf"), lr) for loss, lr in base]
    return min(base)[1] if base else None


def next_lr(grid: Sequence[float], best: Optional[float], added: Dict[str, int], limit: int) -> Optional[float]:
    """The lr to add to the sweep's `grid` when `best` lies on its edge: one grid step beyond it
    (the ratio of the two outermost values on that side), while fewer than `limit` values were
    added on that side (`added`: {"low": n, "high": n}, updated); None when the optimum is inside
    the grid, the limit is reached or the grid has fewer than 2 values."""
    values = sorted(set(grid))
    if best is None or len(values) < 2 or values[0] < best < values[-1]:
        return None
    side = "high" if best == values[-1] else "low"
    if added.get(side, 0) >= limit:
        return None
    added[side] = added.get(side, 0) + 1
    ratio = values[-1] / values[-2] if side == "high" else values[1] / values[0]
    return float(f"{(best * ratio if side == 'high' else best / ratio):.6g}")


def _corpus(args: argparse.Namespace) -> Corpus:
    if args.corpus_root is not None:
        return load_corpus([("root", args.corpus_root, "local")], val_fraction=args.val_fraction)
    return load_corpus(default_sources(args.packages), val_fraction=args.val_fraction)


def _weight(args, blocks: int, dim: int, variant: str) -> int:
    """Rough relative cost of one step (for the ETA): blocks x dim, which followed the measured
    CPU time per step of the default ladder within 15 % (small models are less efficient per
    parameter than N would say)."""
    return max(1, round(blocks * dim * _COST.get(variant, 1.5) * args.batch * args.context / 2048))


def _seeds_at(args, index: int) -> List[int]:
    return list(range(args.seeds)) if index < args.multi_seed_sizes else [0]


def plan(args: argparse.Namespace, corpus: Corpus) -> dict:
    """Time `--plan-steps` training steps of every (size, variant) and estimate the sweep's time."""
    gen = torch.Generator().manual_seed(0)
    rows, total, total_cpu = [], 0.0, 0.0
    load_before = os.getloadavg()
    sweep = lr_size(args)
    ladder = sorted_sizes(args)
    for index, (blocks, dim) in enumerate(dict.fromkeys(ladder + [sweep])):
        steps = steps_for(args, blocks, dim)
        runs_here = len(_seeds_at(args, index)) if (blocks, dim) in ladder else 0
        sweep_runs = len(args.lr_sweep) if (blocks, dim) == sweep and args.lr is None else 0
        if (blocks, dim) == sweep and sweep_runs and runs_here:
            runs_here -= 1  # seed 0 at the best lr is the sweep's run
        row = {"blocks": blocks, "dim": dim, "nonembedding_params": size_params(args, blocks, dim),
               "steps": steps, "tokens": steps * args.batch * args.context, "step_s": {}, "run_s": {},
               "cpu_step_s": {}, "cpu_run_s": {}}
        for variant in args.residual:
            torch.manual_seed(0)
            model = build_model(args, blocks, dim, variant)
            opt = train._optimizer(model, 1e-3)
            times, cpu = [], []
            for i in range(args.plan_steps + 2):
                batch = random_batch(corpus.train, args.batch, args.context, gen)
                t0, c0 = time.perf_counter(), time.process_time()
                opt.zero_grad(set_to_none=True)
                train._loss(model, batch).backward()
                opt.step()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            step_s, cpu_s = sorted(times)[len(times) // 2], sorted(cpu)[len(cpu) // 2]
            # validation: (evals + 1) x eval_batches forward passes, about a third of a step each
            per_run = steps + (args.evals + 1) * args.eval_batches / 3
            row["step_s"][variant], row["run_s"][variant] = step_s, step_s * per_run
            row["cpu_step_s"][variant], row["cpu_run_s"][variant] = cpu_s, cpu_s * per_run
            total += step_s * per_run * (runs_here + sweep_runs)
            total_cpu += cpu_s * per_run * (runs_here + sweep_runs)
            train._say(f"plan {blocks}x{dim} {variant}: {1e3 * step_s:.1f} ms/step ({1e3 * cpu_s:.1f} ms "
                       f"CPU), ~{step_s * per_run / 60:.1f} min/run")
        row["runs"], row["sweep_runs"] = runs_here, sweep_runs
        row["size_s"] = sum(row["run_s"].values()) * (runs_here + sweep_runs)
        row["size_cpu_s"] = sum(row["cpu_run_s"].values()) * (runs_here + sweep_runs)
        rows.append(row)
    return {"sizes": rows, "total_s": total, "total_cpu_s": total_cpu, "load_before": list(load_before),
            "load_after": list(os.getloadavg()), "threads": torch.get_num_threads(),
            "cpu": study._cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _plan_table(p: dict) -> str:
    names = ", ".join(p["sizes"][0]["step_s"])
    lines = [f"| size | N (non-emb.) | steps | tokens | ms/step wall ({names}) | ms/step CPU | "
             "runs (+ sweep) | est. hours wall | est. CPU-hours |", "|---|---|---|---|---|---|---|---|---|"]
    for r in p["sizes"]:
        ms = " / ".join(f"{1e3 * s:.0f}" for s in r["step_s"].values())
        cpu = " / ".join(f"{1e3 * s:.0f}" for s in r["cpu_step_s"].values())
        lines.append(f"| {r['blocks']}x{r['dim']} | {r['nonembedding_params']:,} | {r['steps']:,} | "
                     f"{r['tokens']:,} | {ms} | {cpu} | {r['runs']} x {len(r['step_s'])} (+ {r['sweep_runs']} x "
                     f"{len(r['step_s'])}) | {r['size_s'] / 3600:.2f} | {r['size_cpu_s'] / 3600:.2f} |")
    return "\n".join(lines + [f"\nTotal: {p['total_s'] / 3600:.2f} h wall, {p['total_cpu_s'] / 3600:.2f} "
                              f"CPU-hours on {p['threads']} thread(s), load {p['load_before'][0]:.1f} before, "
                              f"{p['load_after'][0]:.1f} after ({p['cpu']}, {p['date']})."])


def _report(args, plots: bool) -> List[Path]:
    return scaling_report.write(args.out, load_runs(args.out), args, plots=plots)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    plots = not args.no_plots and train._plots_available()
    if args.report_only:
        written = _report(args, plots)
        train._say(f"wrote {', '.join(str(p) for p in written)}")
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    train._say("attnres scaling sweep: reading the corpus ...")
    corpus = _corpus(args)
    d = corpus.describe()
    train._say(f"corpus: {d['train']['files']} training files ({d['train']['bytes']:,} bytes), "
               f"{d['val']['files']} validation files ({d['val']['bytes']:,} bytes), "
               f"{d['duplicates_dropped']} duplicates dropped; sources "
               + ", ".join(f"{s['name']} {s['version']}" for s in d["sources"]))
    if args.plan:
        p = plan(args, corpus)
        (args.out / "plan.json").write_text(json.dumps(p, indent=1))
        print(_plan_table(p))
        return 0
    common = common_settings(args, corpus)
    sweep_size = lr_size(args)
    ladder = sorted_sizes(args)
    fixed = list(common)  # the keys every saved run must share with this sweep
    for path in sorted(runs_dir.glob("*.json")):
        refuse_if_mismatched(path, _load(path), common, fixed)

    todo_sweep, sweep_done = [], []
    if args.lr is None:
        for lr in args.lr_sweep:
            for variant in args.residual:
                b, dim = sweep_size
                path = runs_dir / f"{run_key(b, dim, variant, 0, lr)}.json"
                expected = run_settings(args, common, b, dim, variant, 0, lr, "lr_sweep")
                if path.exists():
                    refuse_if_mismatched(path, _load(path), expected)
                    sweep_done.append(_load(path))
                else:
                    todo_sweep.append((b, dim, variant, 0, lr, expected, path))
    todo_ladder = []
    for index, (b, dim) in enumerate(ladder):
        for seed in _seeds_at(args, index):
            for variant in args.residual:
                path = runs_dir / f"{run_key(b, dim, variant, seed)}.json"
                if not path.exists():
                    todo_ladder.append((b, dim, variant, seed, path))
    total = (len(args.lr_sweep) * len(args.residual) if args.lr is None else 0) \
        + sum(len(_seeds_at(args, i)) for i in range(len(ladder))) * len(args.residual)
    train._say(f"{total} runs ({len(args.lr_sweep) if args.lr is None else 0} sweep lrs x "
               f"{len(args.residual)} variants at {sweep_size[0]}x{sweep_size[1]}, then sizes "
               f"{', '.join(f'{b}x{d}' for b, d in ladder)}), "
               f"{total - len(todo_sweep) - len(todo_ladder)} already done in {runs_dir}/")
    meta_path = args.out / "sweep.json"
    meta = _load(meta_path) if meta_path.exists() else {"sessions": []}
    meta.update(corpus=d, settings=common, cpu=study._cpu_model(), cpus=os.cpu_count(),
                threads=torch.get_num_threads())
    for src in meta["corpus"]["sources"]:
        src.pop("root", None)  # machine-specific
    meta["sessions"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                             "argv": sys.argv[1:] if argv is None else list(argv),
                             "runs": len(todo_sweep) + len(todo_ladder)})
    meta_path.write_text(json.dumps(meta, indent=1))

    val_batches = fixed_batches(corpus.val, args.eval_batches, args.batch, args.context)
    units = sum(steps_for(args, b, dim) * _weight(args, b, dim, v) for b, dim, v, *_ in todo_sweep + todo_ladder)
    bar = train._progress(units or 1)
    count = len(todo_sweep) + len(todo_ladder)
    try:
        with warnings.catch_warnings():  # restores warnings.showwarning on exit
            warnings.showwarning = train._readable_collapse_warnings(warnings.showwarning)
            for i, (b, dim, variant, seed, lr, expected, path) in enumerate(todo_sweep):
                view = study._Weighted(bar, _weight(args, b, dim, variant),
                                       f"run {i + 1}/{count} lr sweep {lr:g} {b}x{dim}")
                record = one_run(args, b, dim, variant, seed, lr, expected, corpus, val_batches, view)
                study._save(path, record)
                sweep_done.append(record)
            grid, added = list(args.lr_sweep), {}
            while args.lr is None:  # the optimum on the grid's edge: one more value beyond it
                lr = next_lr(grid, best_lr(sweep_done), added, args.lr_extend)
                if lr is None:
                    break
                grid.append(lr)
                b, dim = sweep_size
                train._say(f"lr sweep: the best PreNorm lr is on the grid's edge; trying {lr:g}")
                for variant in args.residual:
                    path = runs_dir / f"{run_key(b, dim, variant, 0, lr)}.json"
                    expected = run_settings(args, common, b, dim, variant, 0, lr, "lr_sweep")
                    if path.exists():
                        refuse_if_mismatched(path, _load(path), expected)
                        sweep_done.append(_load(path))
                        continue
                    weight = _weight(args, b, dim, variant)
                    bar.total += steps_for(args, b, dim) * weight
                    view = study._Weighted(bar, weight, f"extra run lr sweep {lr:g} {b}x{dim}")
                    record = one_run(args, b, dim, variant, 0, lr, expected, corpus, val_batches, view)
                    study._save(path, record)
                    sweep_done.append(record)
            base = args.lr if args.lr is not None else best_lr(sweep_done)
            if base is None:
                raise SystemExit("the lr sweep has no PreNorm ('standard') run to choose the lr from")
            if args.lr is None:
                train._say(f"lr sweep: best PreNorm peak lr {base:g} at {sweep_size[0]}x{sweep_size[1]}; "
                           f"ladder lr = {base:g} x {sweep_size[1]} / d")
            for index, (b, dim) in enumerate(ladder):  # every saved ladder run has the chosen lr
                for seed in _seeds_at(args, index):
                    for variant in args.residual:
                        path = runs_dir / f"{run_key(b, dim, variant, seed)}.json"
                        if path.exists():
                            refuse_if_mismatched(path, _load(path), run_settings(
                                args, common, b, dim, variant, seed, lr_for(args, base, dim), "ladder"))
            for i, (b, dim, variant, seed, path) in enumerate(todo_ladder, start=len(todo_sweep)):
                lr = lr_for(args, base, dim)
                expected = run_settings(args, common, b, dim, variant, seed, lr, "ladder")
                weight = _weight(args, b, dim, variant)
                source = runs_dir / f"{run_key(b, dim, variant, seed, lr)}.json"
                if args.lr is None and (b, dim) == sweep_size and seed == 0 and source.exists():
                    record = dict(_load(source), settings=expected, from_sweep=source.name)
                    bar.update(steps_for(args, b, dim) * weight)  # the sweep's run at the chosen lr
                else:
                    view = study._Weighted(bar, weight, f"run {i + 1}/{count} {b}x{dim}")
                    record = one_run(args, b, dim, variant, seed, lr, expected, corpus, val_batches, view)
                study._save(path, record)
                try:  # keep the report current; a failing figure must not stop a long sweep
                    _report(args, plots)
                except Exception as err:  # noqa: BLE001 - reported, and the sweep goes on
                    train._say(f"report failed ({type(err).__name__}: {err}); --report-only retries")
    finally:
        bar.close()
    written = _report(args, plots)
    train._say(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
