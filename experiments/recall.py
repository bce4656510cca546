"""A downstream probe where depth matters: multi-hop recall (pointer chasing) trained to a stated
stopping rule, PreNorm against AttnRes at two depths.

The task (`hop_batch`): a sequence shows one random cycle f over `nodes` of `symbols` symbol
tokens as its `nodes` pairs `x f(x)` in random order, then `queries` query blocks
`q H_2 ... H_K` (q a node, H_j a marker token).  At q the model must name f(q) (hop 1: plain
associative recall), at H_j it must name f^j(q).  The answers are never in the input, so hop j
needs j lookups chained inside the network: done by attention, hop 1 takes a binding layer and a
lookup (two attention layers) and every further hop one more.  Chance is 1 / (nodes - 1) per
answer (any node but q); ruling out q, f(q) and f^-1(q) (one lookup each) gives 1 / (nodes - 3)
on hop 2 (`shortcut_ceiling`).  A model with two attention layers can still go beyond that: its
second attention can gather the other pairs as a bag of (x, f(x)) features and its MLP pick the
one whose x is f(q), a lookup in the MLP that gets harder as the bag grows with `nodes`.

    python -m experiments.recall --out DIR                 # the probe (resumes)
    python -m experiments.recall --out DIR --report-only   # summary.md from the runs
    python -m experiments.recall --depths 1 --seeds 1 --max-steps 5 --out tiny

Every (depth, variant, seed) run trains `ExampleLM` (RoPE, no learned positions) with AdamW (linear
warmup, then a constant learning rate) on a fresh stream of sequences; for one seed every variant
and depth sees the same sequences, and every variant of one depth starts from the same sublayer,
embedding and head weights (zero-initialized Full and Block compute the PreNorm function at step
0).  Every `--eval-every` steps the model answers a fixed held-out set (`--eval-sequences`
sequences from a generator no training stream uses).  A run stops at the first of: held-out
accuracy >= `--solved` ("solved"); no gain of more than `--min-delta` over its best held-out
accuracy for `--patience` steps ("plateau"); `--max-steps` ("cap").  Its result is the held-out
accuracy at the stop, overall and per hop.

Each finished run is `OUT/runs/L<layers>-<variant>-s<seed>.json`; the same command again skips
finished runs (a saved run made with other settings stops it).  A run's training state is kept in
`OUT/state/` (git-ignored, about 10 MB a run at L = 16), written at every evaluation: an
interrupted run continues from its last evaluation, and a run that stopped at the cap continues
when the command is given a larger `--max-steps`, with the curve it would have had uninterrupted.
`OUT/summary.md` (and `recall_curves.png` with matplotlib) is written at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import study, train
from .model import ExampleLM, variant_config

#: Seed of the held-out set's generator; no training stream may use it.
HELD_OUT_SEED = 1_000_003

#: Arguments that change a run's result: a saved run made with other values is not reused.
RUN_SETTINGS = ("dim", "heads", "batch", "lr", "warmup", "max_steps", "eval_every",
                "eval_sequences", "patience", "min_delta", "solved", "nodes", "symbols", "hops",
                "queries", "block_size")

#: The stopping rule's settings: they decide where a run stops, never what it computes up to
#: there, so a saved run is reused, or continued from its state, under other values of them.
RULE_SETTINGS = ("max_steps", "patience", "min_delta", "solved")

PLOT = "recall_curves.png"


def task_shape(nodes: int, symbols: int, hops: int, queries: int) -> Tuple[int, int]:
    """(vocab_size, sequence length T) of the task: symbols + hops - 1 tokens (the symbols, then
    the markers H_2..H_K), T = 2 nodes + queries x hops.  Raises ValueError unless
    2 <= nodes <= symbols, 1 <= hops < nodes (so f^j(q) differs from q and from every other hop's
    answer) and 1 <= queries <= nodes."""
    if not (2 <= nodes <= symbols):
        raise ValueError(f"nodes, symbols: expected 2 <= nodes <= symbols, got {nodes}, {symbols}")
    if not (1 <= hops < nodes):
        raise ValueError(f"hops: expected 1 <= hops < nodes = {nodes}, got {hops}")
    if not (1 <= queries <= nodes):
        raise ValueError(f"queries: expected 1 <= queries <= nodes = {nodes}, got {queries}")
    return symbols + hops - 1, 2 * nodes + queries * hops


def hop_batch(gen: torch.Generator, batch: int, *, nodes: int, symbols: int, hops: int,
              queries: int) -> Dict[str, torch.Tensor]:
    """`batch` task sequences drawn with `gen` (see the module docstring):

    * "tokens" `[batch, T]` int64: the pairs `x f(x)` (2 nodes tokens), then per query
      `q, H_2, ..., H_K` with H_j = symbols + j - 2;
    * "answers" `[batch, queries * hops]` int64: f^j(q) for each query (outer) and hop j (inner);
    * "positions" `[queries * hops]`: the position in tokens where each answer is asked;
    * "hop" `[queries * hops]`: its hop count j (1..hops).

    The query nodes of one sequence are distinct."""
    if batch < 1:
        raise ValueError(f"batch: expected an int >= 1, got {batch}")
    task_shape(nodes, symbols, hops, queries)
    cycle = torch.rand(batch, symbols, generator=gen).argsort(1)[:, :nodes]  # f(cycle[i]) = cycle[i+1]
    order = torch.rand(batch, nodes, generator=gen).argsort(1)  # the pairs' order
    x, fx = cycle.gather(1, order), cycle.gather(1, (order + 1) % nodes)
    start = torch.rand(batch, nodes, generator=gen).argsort(1)[:, :queries]  # query indices in the cycle
    j = torch.arange(1, hops + 1)
    answers = cycle.gather(1, ((start[:, :, None] + j) % nodes).flatten(1))
    marks = (symbols + j[1:] - 2).expand(batch, queries, hops - 1)
    query = torch.cat([cycle.gather(1, start)[:, :, None], marks], 2).flatten(1)
    tokens = torch.cat([torch.stack([x, fx], 2).flatten(1), query], 1)
    positions = (2 * nodes + hops * torch.arange(queries)[:, None] + j - 1).flatten()
    return {"tokens": tokens, "answers": answers, "positions": positions,
            "hop": j.repeat(queries)}


def shortcut_ceiling(nodes: int) -> float:
    """Hop-2 accuracy reachable without chaining two lookups: q, f(q) and f^-1(q) ruled out, a
    guess among the other nodes - 3 (nodes >= 4)."""
    if nodes < 4:
        raise ValueError(f"nodes: expected >= 4 for a hop-2 shortcut ceiling, got {nodes}")
    return 1.0 / (nodes - 3)


def _task_kwargs(args: argparse.Namespace) -> dict:
    return {"nodes": args.nodes, "symbols": args.symbols, "hops": args.hops, "queries": args.queries}


def answer_logits(model: ExampleLM, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits `[B, queries * hops, vocab]` at the answer positions."""
    return model(batch["tokens"])[:, batch["positions"]]


@torch.no_grad()
def evaluate(model: ExampleLM, held_out: Dict[str, torch.Tensor], hops: int,
             chunk: int = 256) -> dict:
    """Held-out {"acc": greedy-answer accuracy over every answer, "by_hop": the same per hop
    1..hops, "loss": mean cross-entropy of the answers} in eval mode; the model's mode is kept."""
    was_training = model.training
    model.eval()
    try:
        right, losses = [], []
        for i in range(0, held_out["tokens"].shape[0], chunk):
            part = {**held_out, "tokens": held_out["tokens"][i:i + chunk]}
            answers = held_out["answers"][i:i + chunk]
            logits = answer_logits(model, part)
            right.append(logits.argmax(-1) == answers)
            losses.append(F.cross_entropy(logits.flatten(0, 1), answers.flatten(), reduction="sum"))
    finally:
        model.train(was_training)
    right_t = torch.cat(right).float()
    by_hop = [right_t[:, held_out["hop"] == j].mean().item() for j in range(1, hops + 1)]
    return {"acc": right_t.mean().item(), "by_hop": by_hop,
            "loss": float(sum(losses)) / right_t.numel()}


def _lr(step: int, warmup: int, peak: float) -> float:
    """Linear warmup over `warmup` steps, then the constant peak."""
    return peak * min(1.0, (step + 1) / max(1, warmup))


def stop_reason(curve: List[dict], args: argparse.Namespace) -> Optional[str]:
    """Why a run stops after the last evaluation of `curve` ([{"step", "acc", ...}] in step
    order), or None: "solved" (acc >= --solved), "plateau" (the best accuracy has not risen by
    more than --min-delta for --patience steps), "cap" (--max-steps reached)."""
    last = curve[-1]
    if last["acc"] >= args.solved:
        return "solved"
    best, best_step = curve[0]["acc"], curve[0]["step"]
    for point in curve[1:]:
        if point["acc"] > best + args.min_delta:
            best, best_step = point["acc"], point["step"]
    if last["step"] - best_step >= args.patience:
        return "plateau"
    if last["step"] >= args.max_steps:
        return "cap"
    return None


def first_stop(curve: List[dict], args: argparse.Namespace) -> Optional[Tuple[int, str]]:
    """(index into curve, reason) of the first evaluation at which the stopping rule of `args`
    stops the run of `curve`, or None if it would go on."""
    for i in range(1, len(curve)):
        reason = stop_reason(curve[:i + 1], args)
        if reason is not None:
            return i, reason
    return None


def _stop_under(curve: List[dict], args: argparse.Namespace, where: Path) -> Optional[str]:
    """The reason these settings stop a saved curve at its end, None if they let it go on;
    SystemExit if they would have stopped it before its end."""
    stop = first_stop(curve, args)
    if stop is not None and stop[0] < len(curve) - 1:
        raise SystemExit(f"{where}: trained to step {curve[-1]['step']}, past where these settings "
                         f"stop it (step {curve[stop[0]]['step']}, {stop[1]}); change --max-steps / "
                         "--patience / --min-delta / --solved, use another --out or delete it")
    return None if stop is None else stop[1]


def train_run(variant: str, blocks: int, seed: int, args: argparse.Namespace,
              held_out: Dict[str, torch.Tensor], progress, state: Optional[Path] = None) -> dict:
    """Train one (depth, variant, seed) to the stopping rule; returns its JSON-ready record.

    state: a file for the run's training state (model, AdamW, data generator, curve), written at
    every evaluation; when it exists the run continues from it (after an interruption, or when a
    changed stopping rule lets it go on), which gives the run an uninterrupted one would (the
    learning rate does not depend on the rule)."""
    if seed == HELD_OUT_SEED:
        raise ValueError(f"seed: {HELD_OUT_SEED} is the held-out set's seed; choose another")
    vocab, T = task_shape(**_task_kwargs(args))
    layers = 2 * blocks
    config = variant_config(variant, layers, block_size=args.block_size)
    torch.manual_seed(seed)
    model = ExampleLM(config, vocab_size=vocab, dim=args.dim, num_blocks=blocks,
                      num_heads=args.heads, context=T, positional="rope")
    optimizer = train._optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(seed)
    step, step_time, wall, loads = 0, 0.0, 0.0, []
    if state is not None and state.exists():
        saved = torch.load(state, weights_only=True)
        if _training(saved["settings"]) != _training(settings_of(args)):
            raise SystemExit(f"{state}: saved with other settings {saved['settings']}, now "
                             f"{settings_of(args)}; use another --out or delete it")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        gen.set_state(saved["gen"])
        step, step_time, wall, loads, curve = (saved["step"], saved["step_time"], saved["wall_s"],
                                               saved["load"], saved["curve"])
        reason = _stop_under(curve, args, state)
    else:
        curve = [{"step": 0, "train_loss": None, **evaluate(model, held_out, args.hops)}]
        reason = None
    loads = loads + [os.getloadavg()[0]]
    start, losses = time.perf_counter(), []
    progress.set_description(f"L={layers} {variant} seed {seed}")
    while reason is None:
        batch = hop_batch(gen, args.batch, **_task_kwargs(args))
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.warmup, args.lr)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(answer_logits(model, batch).flatten(0, 1), batch["answers"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step_time += time.perf_counter() - t0
        losses.append(loss.item())
        step += 1
        progress.update(1)
        if step % args.eval_every == 0 or step >= args.max_steps:
            curve.append({"step": step, "train_loss": sum(losses) / len(losses),
                          **evaluate(model, held_out, args.hops)})
            losses = []
            reason = stop_reason(curve, args)
            by_hop = " ".join(f"{a:.2f}" for a in curve[-1]["by_hop"])
            progress.set_postfix_str(f"held-out acc {curve[-1]['acc']:.3f} (by hop {by_hop}) "
                                     f"at step {step}")
            if state is not None:
                _save_state(state, {"settings": settings_of(args), "step": step, "curve": curve,
                                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "gen": gen.get_state(), "step_time": step_time,
                                    "wall_s": wall + time.perf_counter() - start,
                                    "load": loads + [os.getloadavg()[0]]})
    progress.update(max(0, args.max_steps - step))  # a run that stopped early frees its share
    return {"variant": variant, "blocks": blocks, "layers": layers, "seed": seed,
            "settings": settings_of(args), "config": config.to_dict(),
            "params": sum(p.numel() for p in model.parameters()),
            "router_params": sum(p.numel() for p in model.router.parameters()),
            "curve": curve, "final": curve[-1], "stop": {"step": step, "reason": reason},
            "wall_s": wall + time.perf_counter() - start, "step_s": step_time / max(1, step),
            "load": loads + [os.getloadavg()[0]]}


def _training(settings: dict) -> dict:
    """The settings that change what a run computes (all but the stopping rule's)."""
    return {k: v for k, v in settings.items() if k not in RULE_SETTINGS}


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def cost_weight(variant: str, blocks: int) -> int:
    """Rough relative cost of one training step (for the ETA only): a fixed part per step, a part
    per block, and the depth attention's extra for Full (most) and Block."""
    extra = {"full": 6, "block": 3}.get(variant_config(variant, 2 * blocks).kind, 0)
    return 4 + blocks * (10 + extra)


def settings_of(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in RUN_SETTINGS}


def run_key(layers: int, variant: str, seed: int) -> str:
    return f"L{layers}-{variant}-s{seed}"


def load_runs(out: Path) -> List[dict]:
    """Every saved run of a probe folder (sorted by file name)."""
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def _save(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # atomic: an interrupted write never leaves a half run behind


# ---------------------------------------------------------------------------------------- report

def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs)


def _cell(xs: List[float], signed: bool = False, pct: bool = True) -> str:
    """"m ± s (a, b, ...)" over seeds in percent; one seed: just its value."""
    scale = 100.0 if pct else 1.0
    fmt = "{:+.1f}" if signed else "{:.1f}"
    mean = fmt.format(scale * _mean(xs))
    if len(xs) < 2:
        return mean
    sd = math.sqrt(sum((x - _mean(xs)) ** 2 for x in xs) / (len(xs) - 1))
    return f"{mean} ± {scale * sd:.1f} ({', '.join(fmt.format(scale * x) for x in xs)})"


def _groups(runs: List[dict]) -> Dict[Tuple[int, str], List[dict]]:
    groups: Dict[Tuple[int, str], List[dict]] = {}
    for r in sorted(runs, key=lambda r: r["seed"]):
        groups.setdefault((r["layers"], r["variant"]), []).append(r)
    return groups


def _variants(runs: List[dict]) -> List[str]:
    seen = list(dict.fromkeys(r["variant"] for r in runs))
    order = ["standard", "full", "block"]
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def steps_to(run: dict, hop: int, level: float) -> Optional[int]:
    """The first evaluated step at which held-out accuracy on `hop` (1-based) reaches `level`,
    or None if the run never does."""
    return next((p["step"] for p in run["curve"] if p["by_hop"][hop - 1] >= level), None)


#: Held-out accuracies of the last hop whose first steps the summary reports (learning speed).
SPEED_LEVELS = (0.5, 0.9)


def summary_markdown(runs: List[dict], meta: Optional[dict] = None) -> str:
    """The probe's summary.md: the task and rule, then one row per (depth, variant)."""
    groups, variants = _groups(runs), _variants(runs)
    s = runs[0]["settings"]
    seeds = sorted({r["seed"] for r in runs})
    chance = 1.0 / (s["nodes"] - 1)
    levels = " / ".join(f"{100 * lv:.0f}" for lv in SPEED_LEVELS)
    lines = ["# Multi-hop recall probe (experiments.recall)", "",
             f"{len(runs)} runs: variants {', '.join(variants)}; depths "
             f"{', '.join(f'L = {L}' for L in sorted({r['layers'] for r in runs}))} sublayers at "
             f"d = {s['dim']} ({s['heads']} heads, RoPE); seeds {', '.join(map(str, seeds))}.", "",
             f"Task: one random cycle over {s['nodes']} of {s['symbols']} symbols shown as "
             f"{s['nodes']} pairs in random order, then {s['queries']} queries, each answered at "
             f"hops 1..{s['hops']} (T = {2 * s['nodes'] + s['queries'] * s['hops']}); chance "
             f"{100 * chance:.1f} % per answer"
             + (f"; without chaining two lookups, hop 2 can reach {100 * shortcut_ceiling(s['nodes']):.1f} % "
                "(q, f(q), f^-1(q) ruled out)" if s["hops"] >= 2 and s["nodes"] >= 4 else "")
             + f".  Batch {s['batch']} sequences, AdamW lr {s['lr']} "
             f"after {s['warmup']} warmup steps.  Held-out set: {s['eval_sequences']} sequences "
             f"from a generator no training stream uses, evaluated every {s['eval_every']} steps.",
             "",
             f"Stopping rule: solved (held-out accuracy >= {100 * s['solved']:.0f} %), plateau "
             f"(no gain over the best of more than {100 * s['min_delta']:.1f} points for "
             f"{s['patience']} steps) or the cap of {max(r['settings']['max_steps'] for r in runs)} steps, whichever comes first.",
             "", "Accuracies in %: mean ± standard deviation over seeds (each seed in brackets); "
             "Δ = the run minus the PreNorm (standard) run of the same seed and depth.  "
             f"Steps to {levels} %: the first evaluations at which hop {s['hops']} reached "
             f"{levels} % held-out accuracy, per seed (— never).", ""]
    head = (["L", "variant", "params", "steps (stop)", "held-out acc"]
            + [f"hop {j}" for j in range(1, s["hops"] + 1)] + ["Δ acc vs PreNorm", f"steps to hop {s['hops']} {levels} %", "ms / step"])
    rows = []
    for L in sorted({k[0] for k in groups}):
        base = {r["seed"]: r["final"]["acc"] for r in groups.get((L, "standard"), [])}
        for v in variants:
            rs = groups.get((L, v), [])
            if not rs:
                continue
            gaps = [r["final"]["acc"] - base[r["seed"]] for r in rs if r["seed"] in base]
            stops = ", ".join(f"{r['stop']['step']} ({r['stop']['reason']})" for r in rs)
            rows.append([str(L), v, str(rs[0]["params"]), stops, _cell([r["final"]["acc"] for r in rs])]
                        + [_cell([r["final"]["by_hop"][j] for r in rs]) for j in range(s["hops"])]
                        + ["—" if v == "standard" or not gaps else _cell(gaps, signed=True),
                           ", ".join(" / ".join(str(steps_to(r, s["hops"], lv) or "—") for lv in SPEED_LEVELS)
                                     for r in rs),
                           f"{1e3 * _mean([r['step_s'] for r in rs]):.0f}"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    loads = [x for r in runs for x in r.get("load", [])]
    threads = "" if meta is None else f" on {meta.get('threads')} torch thread(s)"
    lines += ["", f"Step times{threads}; 1-minute load average {min(loads):.1f} to {max(loads):.1f} "
              f"during the runs; {sum(r['wall_s'] for r in runs) / 60:.1f} min of training in all."
              if loads else ""]
    if meta:
        lines += [f"Machine: {meta.get('cpu')} ({meta.get('cpus')} CPUs), torch {meta.get('torch')}."]
    return "\n".join(lines) + "\n"


def write_report(out: Path, runs: List[dict], *, plots: bool = True) -> List[Path]:
    """summary.md (and recall_curves.png: held-out accuracy per hop against step, one panel per
    depth, with plots) from the saved runs; returns the files written."""
    meta_path = out / "recall.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    (out / "summary.md").write_text(summary_markdown(runs, meta))
    written = [out / "summary.md"]
    if not plots:
        return written
    from .report import require_matplotlib

    plt = require_matplotlib()
    groups, variants = _groups(runs), _variants(runs)
    depths = sorted({k[0] for k in groups})
    hops = runs[0]["settings"]["hops"]
    fig, axes = plt.subplots(1, len(depths), figsize=(5.5 * len(depths), 4), squeeze=False)
    colors = {v: f"C{i}" for i, v in enumerate(variants)}
    styles = ["-", "--", ":", "-."]
    for ax, L in zip(axes[0], depths):
        for v in variants:
            for r in groups.get((L, v), []):
                steps = [p["step"] for p in r["curve"]]
                for j in range(hops):
                    ax.plot(steps, [100 * p["by_hop"][j] for p in r["curve"]], styles[j % 4],
                            color=colors[v], lw=1, alpha=0.8,
                            label=f"{v}, hop {j + 1}" if r["seed"] == groups[(L, v)][0]["seed"] else None)
        nodes = runs[0]["settings"]["nodes"]
        ax.axhline(100 / (nodes - 1), color="grey", lw=0.5, label="chance")
        if hops >= 2 and nodes >= 4:
            ax.axhline(100 * shortcut_ceiling(nodes), color="grey", lw=0.5, ls=":",
                       label="hop 2 with q, f(q), f^-1(q) ruled out")
        ax.set(title=f"L = {L} sublayers", xlabel="step", ylabel="held-out accuracy (%)", ylim=(0, 100))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / PLOT, dpi=110)
    plt.close(fig)
    return written + [out / PLOT]


# ------------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.recall", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--residual", type=train._variants, default=train._variants("standard,full,block"),
                   help="comma list of residual variants (default: standard,full,block)")
    p.add_argument("--depths", type=study._ints, default=[2, 8],
                   help="Transformer blocks per depth, L = 2 x blocks sublayers (default 2,8: L = 4, 16)")
    p.add_argument("--seeds", type=train._seeds, default=[0, 1],
                   help="a count N (seeds 0..N-1) or a comma list (default: 2)")
    p.add_argument("--dim", type=int, default=64, help="d_model (64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (32)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate after warmup (3e-3)")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps (100)")
    p.add_argument("--max-steps", type=int, default=3000, help="step cap per run (3000)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations (100)")
    p.add_argument("--eval-sequences", type=int, default=512, help="held-out sequences (512)")
    p.add_argument("--patience", type=int, default=1000,
                   help="steps without a gain of more than --min-delta that stop a run (1000)")
    p.add_argument("--min-delta", type=float, default=0.01,
                   help="held-out accuracy gain that counts as progress (0.01 = 1 point)")
    p.add_argument("--solved", type=float, default=0.99, help="held-out accuracy that stops a run (0.99)")
    p.add_argument("--nodes", type=int, default=5, help="nodes of the cycle, pairs shown (5)")
    p.add_argument("--symbols", type=int, default=12, help="symbol tokens the nodes are drawn from (12)")
    p.add_argument("--hops", type=int, default=2, help="hops asked per query, 1..K (2)")
    p.add_argument("--queries", type=int, default=5, help="queries per sequence (5)")
    p.add_argument("--block-size", type=int, default=4, help="sublayers per block for 'block' (4)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 keeps torch's default (1)")
    p.add_argument("--out", type=Path, default=Path("attnres-recall"), help="output folder (./attnres-recall)")
    p.add_argument("--report-only", action="store_true", help="write the report from the saved runs only")
    p.add_argument("--no-plots", action="store_true", help="summary.md only")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("dim", "heads", "batch", "max_steps", "eval_every", "eval_sequences", "patience",
                 "block_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup: expected an int >= 0, got {args.warmup}")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        raise SystemExit(f"--heads {args.heads}: must divide --dim {args.dim} into even head sizes (RoPE)")
    if HELD_OUT_SEED in args.seeds:
        raise SystemExit(f"--seeds: {HELD_OUT_SEED} is the held-out set's seed")
    try:
        task_shape(**_task_kwargs(args))
    except ValueError as e:
        raise SystemExit(f"task: {e}") from None


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
        state_dir = args.out / "state"
        state_dir.mkdir(exist_ok=True)
        (state_dir / ".gitignore").write_text("# training states to resume or extend runs (large)\n*\n")
        for seed in args.seeds:  # seed outermost: an interrupted probe has whole seeds done
            for blocks in args.depths:
                for variant in args.residual:
                    key = run_key(2 * blocks, variant, seed)
                    path, state = runs_dir / f"{key}.json", state_dir / f"{key}.pt"
                    done = 0
                    if path.exists():
                        record = json.loads(path.read_text())
                        if _training(record["settings"]) != _training(settings):
                            raise SystemExit(f"{path}: saved with other settings {record['settings']}, "
                                             f"now {settings}; use another --out or delete it")
                        reason = _stop_under(record["curve"], args, path)
                        if reason is not None:  # finished under these settings too
                            if record["settings"] != settings or record["stop"]["reason"] != reason:
                                record.update(settings=settings, stop={**record["stop"], "reason": reason})
                                _save(path, record)  # the same run, stopped by these settings
                            continue
                        done = record["stop"]["step"] if state.exists() else 0  # else: trained again
                    elif state.exists():
                        done = torch.load(state, weights_only=True)["step"]
                    todo.append((blocks, variant, seed, path, state, done))
        total = len(args.depths) * len(args.residual) * len(args.seeds)
        train._say(f"attnres recall probe: {total} runs, {total - len(todo)} already done in {runs_dir}/, "
                   f"{sum(1 for *_, d in todo if d)} continued from their saved state")
        held_out = hop_batch(torch.Generator().manual_seed(HELD_OUT_SEED), args.eval_sequences,
                             **_task_kwargs(args))
        meta_path = args.out / "recall.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"sessions": []}
        meta.update(torch=torch.__version__, cpu=study._cpu_model(), cpus=os.cpu_count(),
                    threads=torch.get_num_threads())
        meta["sessions"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                 "argv": sys.argv[1:] if argv is None else list(argv),
                                 "runs": len(todo), "load": os.getloadavg()[0]})
        meta_path.write_text(json.dumps(meta, indent=1))
        weight = {(b, v): cost_weight(v, b) for b, v, *_ in todo}
        bar = train._progress(sum((args.max_steps - d) * weight[(b, v)] for b, v, _, _, _, d in todo) or 1)
        try:
            for i, (blocks, variant, seed, path, state, _) in enumerate(todo):
                view = study._Weighted(bar, weight[(blocks, variant)], f"run {i + 1}/{len(todo)}")
                _save(path, train_run(variant, blocks, seed, args, held_out, view, state))
        finally:
            bar.close()
        meta["sessions"][-1].update(finished=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                    load_end=os.getloadavg()[0])
        meta_path.write_text(json.dumps(meta, indent=1))
    runs = load_runs(args.out)
    if not runs:
        raise SystemExit(f"{runs_dir}: no finished runs to report")
    written = write_report(args.out, runs, plots=plots)
    train._say(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
