"""Train the example byte-level LM on the Python standard library's sources, one run per residual
variant and seed, on the CPU, and write a report folder (loss curves, per-layer magnitudes and
gradient norms, depth-weight heatmaps, summary.md, metrics.json).

    python -m experiments.train                          # standard vs full vs block, 3 seeds
    python -m experiments.train --residual block,window --seeds 1 --steps 50 --out rep

Every variant of a seed starts from the same sublayer / embedding / head weights and sees the same
batches, so the runs are paired: at step 0 the zero-initialized Full and Block models compute the
same function as the standard PreNorm model (same loss), and any later difference is the residual
scheme's doing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from attnres_torch.diagnostics import POLICIES, DepthCollapseWarning, DepthMonitor, collapse_policy
from attnres_torch.training import MIX_SCHEDULES, TemperatureSchedule

from . import report
from .data import fixed_batches, load_stdlib_corpus, random_batch
from .model import VARIANTS, ExampleLM, variant_config


def _variants(text: str) -> List[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown residual variant(s) {unknown or text!r}; "
                                         f"choose from {', '.join(VARIANTS)}")
    return names


def _seeds(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds: expected a count or a comma list of ints, got {text!r}")
    if len(values) == 1:
        if values[0] < 1:
            raise argparse.ArgumentTypeError(f"--seeds: a count must be >= 1, got {values[0]}")
        return list(range(values[0]))
    return values


def _temperature(text: str) -> TemperatureSchedule:
    try:
        return TemperatureSchedule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--temperature-schedule: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--residual", type=_variants, default=_variants("standard,full,block"),
                   help=f"comma list of residual variants: {', '.join(VARIANTS)} "
                        "(default: standard,full,block)")
    p.add_argument("--seeds", type=_seeds, default=list(range(3)),
                   help="a count N (seeds 0..N-1) or a comma list of seeds (default: 3)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default: 120)")
    p.add_argument("--out", type=Path, default=Path("attnres-report"),
                   help="report folder (default: ./attnres-report)")
    p.add_argument("--blocks", type=int, default=8, help="Transformer blocks; L = 2 x blocks sublayers (8)")
    p.add_argument("--dim", type=int, default=256, help="d_model (256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--context", type=int, default=64, help="sequence length in bytes (64)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (4)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (3e-3)")
    p.add_argument("--block-size", type=int, default=4,
                   help="sublayers per block for 'block', outputs per summary for 'compressed_history' (4)")
    p.add_argument("--window", type=int, default=4,
                   help="recent outputs attended by 'window', kept whole by 'compressed_history' (4)")
    p.add_argument("--key-rank", type=int, default=16,
                   help="r of 'low_rank_keys': keys and queries in r <= dim dimensions (16)")
    p.add_argument("--eval-every", type=int, default=20, help="steps between validation losses (20)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (8)")
    p.add_argument("--diag-every", type=int, default=None,
                   help="steps between diagnostics records (default: --eval-every)")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="bytes of stdlib source read (4e6)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; 0 keeps torch's default (default: 1, which was 5-10x "
                        "faster than 2 threads on a busy 2-core machine)")
    p.add_argument("--introduce-steps", type=int, default=0,
                   help="progressive introduction (attention variants): blend from the PreNorm sum "
                        "(mix 0) to AttnRes (mix 1) over this many steps (default 0: off)")
    p.add_argument("--introduce-kind", choices=sorted(MIX_SCHEDULES), default="linear",
                   help="shape of the --introduce-steps ramp (default: linear)")
    p.add_argument("--temperature-schedule", type=_temperature, default=None,
                   metavar="START:END:STEPS[:KIND]",
                   help="depth-attention logit scale from START to END over STEPS steps, KIND "
                        "linear|cosine|geometric (attention variants; default: the config's scale)")
    p.add_argument("--collapse-policy", choices=POLICIES, default="log",
                   help="response when a depth-attention row collapses (checked at each diagnostics "
                        "record): log (a note), lr_scale (that query's lr x0.1), reset (query to "
                        "uniform, its Adam state zeroed) or raise (stop the run); default: log")
    p.add_argument("--no-plots", action="store_true",
                   help="write metrics.json and summary.md only (the default when matplotlib is missing)")
    return p


def _say(text: str) -> None:
    """A status line on stderr (kept apart from a tqdm bar when tqdm is installed)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(text, file=sys.stderr, flush=True)
    else:
        tqdm.write(text, file=sys.stderr)


class _PlainProgress:
    """Fallback progress bar when tqdm is not installed: a line (done/total, elapsed, ETA at the
    mean rate so far) after the first step, every ~5% of the work, and at least every `interval`
    seconds."""

    def __init__(self, total: int, interval: float = 10.0):
        self.total, self.n, self.every, self.interval = total, 0, max(1, total // 20), interval
        self.desc, self.postfix, self.start = "", "", time.perf_counter()
        self.last = self.start

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.n == 1 or self.n % self.every == 0 or self.n == self.total or now - self.last >= self.interval:
            self.last = now
            elapsed = now - self.start
            eta = elapsed / self.n * (self.total - self.n)
            print(f"[{self.n:.0f}/{self.total:.0f} {100 * self.n / self.total:3.0f}% {elapsed:.0f}s, "
                  f"ETA {eta:.0f}s] "
                  f"{self.desc} {self.postfix}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)


def _lr(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 10% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def _logits(model: ExampleLM, tokens: torch.Tensor, mix=None, scale=None) -> torch.Tensor:
    """The model's logits with the router's M10 per-call inputs (mix, scale; None: plain)."""
    return model(tokens, mix=mix, scale=scale)


def _loss(model: ExampleLM, batch: torch.Tensor, mix=None, scale=None) -> torch.Tensor:
    logits = _logits(model, batch[:, :-1], mix, scale)
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _stability(config, args: argparse.Namespace):
    """(mix schedule or None, scale schedule or None) of a run: both only for attention variants
    (the standard, scalar, gated and static baselines have no depth attention to introduce)."""
    if not config.is_attention:
        return None, None
    mix = MIX_SCHEDULES[args.introduce_kind](args.introduce_steps) if args.introduce_steps > 0 else None
    return mix, args.temperature_schedule


@torch.no_grad()
def evaluate(model: ExampleLM, batches: List[torch.Tensor], mix=None, scale=None) -> float:
    """Mean validation loss (nats per byte) in eval mode (Block uses its two-phase schedule);
    mix, scale: the M10 inputs the model is currently trained with (None: plain)."""
    model.eval()
    loss = sum(float(_loss(model, b, mix, scale)) for b in batches) / len(batches)
    model.train()
    return loss


def _optimizer(model: ExampleLM, lr: float) -> torch.optim.Optimizer:
    """AdamW; weight decay 0.1 on the sublayer / head matrices, none on embeddings, norms and the
    residual scheme's parameters."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2
             and not n.startswith(("router.", "embed.", "pos."))]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def train_run(variant: str, seed: int, args: argparse.Namespace, corpus, val_batches, progress) -> dict:
    """One training run; returns its metrics (losses, timings, diagnostics history)."""
    return train_model(variant, seed, args, corpus, val_batches, progress)[1]


def train_model(variant: str, seed: int, args: argparse.Namespace, corpus, val_batches,
                progress) -> Tuple[ExampleLM, dict]:
    """One training run; returns (the trained model, its metrics as `train_run`)."""
    num_layers = 2 * args.blocks
    config = variant_config(variant, num_layers, block_size=args.block_size, window=args.window,
                            key_rank=getattr(args, "key_rank", None))
    torch.manual_seed(seed)
    model = ExampleLM(config, dim=args.dim, num_blocks=args.blocks, num_heads=args.heads,
                      context=args.context)
    optimizer = _optimizer(model, args.lr)
    monitor = DepthMonitor(model.router, model.sublayers,
                           on_collapse=collapse_policy(args.collapse_policy, optimizer))
    gen = torch.Generator().manual_seed(seed)
    diag_every = args.diag_every or args.eval_every
    mix_at, scale_at = _stability(config, args)
    train_loss, val = [], [{"step": 0, "loss": evaluate(
        model, val_batches, None if mix_at is None else mix_at(0),
        None if scale_at is None else scale_at(0))}]
    mixes, scales = [], []
    step_time = 0.0
    start = time.perf_counter()
    progress.set_description(f"{variant} seed {seed}")
    for step in range(args.steps):
        batch = random_batch(corpus.train, args.batch, args.context, gen)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.steps, args.lr)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        mix = None if mix_at is None else mix_at(step)
        scale = None if scale_at is None else scale_at(step)
        mixes.append(mix)
        scales.append(scale)
        if step % diag_every == 0 or step == args.steps - 1:
            with monitor.record(step):
                loss = _loss(model, batch, mix, scale)
                loss.backward()
        else:
            loss = _loss(model, batch, mix, scale)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step_time += time.perf_counter() - t0
        train_loss.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            val.append({"step": step + 1, "loss": evaluate(
                model, val_batches, None if mix_at is None else mix_at(step + 1),
                None if scale_at is None else scale_at(step + 1))})
        # the validation loss is measured every --eval-every steps: say at which step
        progress.set_postfix_str(f"loss {train_loss[-1]:.3f}, val {val[-1]['loss']:.3f} at step {val[-1]['step']}")
        progress.update(1)
    monitor.close()
    return model, {"variant": variant, "seed": seed, "config": config.to_dict(),
            "params": sum(p.numel() for p in model.parameters()),
            "router_params": sum(p.numel() for p in model.router.parameters()),
            "train_loss": train_loss, "val": val, "wall_s": time.perf_counter() - start,
            "step_s": step_time / max(1, args.steps), "diagnostics": monitor.history,
            "mix": mixes if mix_at is not None else None,
            "scale": scales if scale_at is not None else None}


def _readable_collapse_warnings(show):
    """A `warnings.showwarning` that prints `DepthCollapseWarning`s as one readable line (not
    Python's `file:line: DepthCollapseWarning` and a source line) and passes the rest to `show`."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DepthCollapseWarning):
            _say(f"note: {message}")
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def _plots_available() -> bool:
    try:
        report.require_matplotlib()
    except ImportError:
        return False
    return True


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "blocks", "dim", "heads", "context", "batch", "eval_every", "eval_batches",
                 "diag_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.introduce_steps < 0:
        raise SystemExit(f"--introduce-steps: expected an int >= 0, got {args.introduce_steps}")
    plots = not args.no_plots and _plots_available()
    if not args.no_plots and not plots:
        _say("matplotlib is not installed: writing metrics.json and summary.md without figures "
             "(`pip install matplotlib`, then `python -m experiments.report "
             f"{args.out}` draws them from the metrics)")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    runs = len(args.residual) * len(args.seeds)
    _say(f"attnres example: {runs} run(s) ({', '.join(args.residual)} x {len(args.seeds)} seed(s)) "
         f"of {args.steps} steps, report in {args.out}/; reading the corpus ...")
    corpus = load_stdlib_corpus(args.corpus_bytes)
    val_batches = fixed_batches(corpus.val, args.eval_batches, args.batch, args.context)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"args": {k: (str(v) if isinstance(v, (Path, TemperatureSchedule)) else v)
                     for k, v in vars(args).items()},
            "corpus": corpus.describe(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "runs": []}
    _say(f"corpus: {corpus.describe()['files']} files of the Python {corpus.describe()['python']} "
         f"standard library, {corpus.train.numel()} train / {corpus.val.numel()} validation bytes; "
         "training (the first step includes the CPU kernel's one-time build) ...")
    progress = _progress(runs * args.steps)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():  # restores warnings.showwarning on exit
            warnings.showwarning = _readable_collapse_warnings(warnings.showwarning)
            for seed in args.seeds:
                for variant in args.residual:
                    meta["runs"].append(train_run(variant, seed, args, corpus, val_batches, progress))
                    meta["total_wall_s"] = time.perf_counter() - start
                    (args.out / "metrics.json").write_text(json.dumps(meta))
    finally:
        progress.close()
    written = report.write_report(args.out, meta, plots=plots)
    print(f"wrote {', '.join(str(p) for p in written)} in {meta['total_wall_s']:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
