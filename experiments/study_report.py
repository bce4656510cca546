"""The report of the depth study (`experiments.study`): `summary.md` and PNGs drawn
from the saved runs.

* `gap_vs_depth.png` — final validation loss minus the paired standard run (same seed, same
  shape) against depth, mean over seeds with each seed as a dot;
* `pareto.png` — final validation loss against training step time, training memory and batch-1
  decode latency, one point per (shape, variant);
* `copy_vs_depth.png` — copy-probe accuracy (second copy) against depth;
* `dilution_vs_depth.png` — input RMS growth, the deepest half's share of the sublayer output
  RMS and the gradient-norm spread across sublayers, against depth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

from .report import _mean, _mean_std, _std, log_ticks, require_matplotlib

PLOTS = ("gap_vs_depth.png", "pareto.png", "copy_vs_depth.png", "dilution_vs_depth.png")


def _groups(runs: List[dict]) -> Dict[Tuple[int, int, str], List[dict]]:
    """{(blocks, dim, variant): runs sorted by seed}."""
    groups: Dict[Tuple[int, int, str], List[dict]] = {}
    for r in sorted(runs, key=lambda r: r["seed"]):
        groups.setdefault((r["blocks"], r["dim"], r["variant"]), []).append(r)
    return groups


def final_loss(run: dict) -> float:
    return run["val"][-1]["loss"]


def dilution(run: dict) -> Dict[str, float]:
    """A run's dilution measures at its last diagnostics record: input RMS growth (last / first
    sublayer input RMS), deep-half share (the deepest half of the sublayers' share of the summed
    output RMS; 0.5 = even), gradient spread (max / min sublayer gradient norm)."""
    last = run["diagnostics"][-1]
    inp, out, grad = last["input_rms"], last["output_rms"], last["grad_norm"]
    half = len(out) // 2
    return {"input_growth": inp[-1] / inp[0], "deep_share": sum(out[half:]) / sum(out),
            "grad_spread": max(grad) / min(grad)}


def paired_gaps(groups, blocks: int, dim: int, variant: str) -> List[float]:
    """Final loss of `variant` minus the standard run of the same seed and shape."""
    base = {r["seed"]: final_loss(r) for r in groups.get((blocks, dim, "standard"), [])}
    return [final_loss(r) - base[r["seed"]] for r in groups.get((blocks, dim, variant), [])
            if r["seed"] in base]


def _shapes(groups, dim: int) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """(every shape: the depth sweep at `dim` by depth, then the others; the sweep alone)."""
    every = sorted({(b, d) for b, d, _ in groups})
    sweep = [s for s in every if s[1] == dim]
    return sweep + [s for s in every if s[1] != dim], sweep


def _variants(runs: List[dict]) -> List[str]:
    seen: List[str] = []
    for r in runs:
        if r["variant"] not in seen:
            seen.append(r["variant"])
    order = ["standard", "full", "block"]
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def summary_markdown(runs: List[dict], dim: int) -> str:
    groups, variants = _groups(runs), _variants(runs)
    shapes, sweep = _shapes(groups, dim)
    s0 = runs[0]["settings"]
    seeds = sorted({r["seed"] for r in runs})
    lines = ["# AttnRes depth study", "",
             f"{len(runs)} runs: variants {', '.join(variants)}; shapes "
             f"{', '.join(f'{b}x{d}' for b, d in shapes)} (blocks x d_model, L = 2 x blocks); seeds "
             f"{', '.join(map(str, seeds))}.  {s0['steps']} AdamW steps of {s0['batch']} x "
             f"{s0['context']} bytes, peak lr {s0['lr']}, {s0['heads']} heads, Block size "
             f"{s0['block_size']}, window {s0['window']}.  Validation: {s0['eval_batches']} fixed "
             "held-out batches, nats per byte.", ""]

    def cell(xs: List[float], signed: bool = False) -> str:
        return _mean_std(xs, signed) if xs else "—"

    lines += [f"## Validation loss minus standard (paired by seed), depth sweep at d = {dim}", "",
              "mean ± std over seeds (lower is better; in brackets: seeds below standard / seeds)", ""]
    rows = []
    for v in variants:
        row = [v]
        for b, d in sweep:
            if v == "standard":
                row.append(cell([final_loss(r) for r in groups.get((b, d, v), [])]) + " (loss)")
            else:
                g = paired_gaps(groups, b, d, v)
                row.append(f"{cell(g, True)} ({sum(x < 0 for x in g)}/{len(g)})" if g else "—")
        rows.append(row)
    lines += _table(["variant"] + [f"{b} blocks (L={2 * b})" for b, _ in sweep], rows)

    lines += ["", "## Every shape: loss, copy probe, cost", "",
              "copy = greedy next-byte accuracy on the second copy of a held-out window shown twice; "
              "first = the same on the first copy (plain LM).  Memory = weights, gradients, AdamW "
              "state + saved activations of one training step.  Decode = batch-1 latency per byte "
              "(full-window recompute, no KV cache), direct / two-phase schedule.", ""]
    rows = []
    for (b, d) in shapes:
        for v in variants:
            rs = groups.get((b, d, v), [])
            if not rs:
                continue
            dec = rs[0]["decode_s"]
            decode = " / ".join(f"{1e3 * _mean([r['decode_s'][s] for r in rs]):.1f}" for s in dec)
            rows.append([f"{b}x{d}", v, str(rs[0]["params"]), cell([final_loss(r) for r in rs]),
                         cell([r["probe"]["copy"] for r in rs]), cell([r["probe"]["first"] for r in rs]),
                         f"{1e3 * _mean([r['step_s'] for r in rs]):.0f}",
                         f"{_mean([r['memory']['total'] for r in rs]) / 2 ** 20:.1f}", decode])
    lines += _table(["shape", "variant", "params", "val loss", "copy acc", "first acc",
                     "ms / step", "memory MiB", "decode ms (direct / two-phase)"], rows)

    lines += ["", "## Dilution at the last step (mean over seeds)", "",
              "input growth = RMS of the last sublayer's input / the first's; deep share = the deepest "
              "half of the sublayers' share of the summed output RMS (0.5 = even); grad spread = "
              "max / min sublayer gradient norm.", ""]
    rows = []
    for (b, d) in shapes:
        for v in variants:
            rs = groups.get((b, d, v), [])
            if rs:
                m = [dilution(r) for r in rs]
                rows.append([f"{b}x{d}", v] + [f"{_mean([x[k] for x in m]):.3g}"
                                               for k in ("input_growth", "deep_share", "grad_spread")])
    lines += _table(["shape", "variant", "input growth", "deep share", "grad spread"], rows)
    return "\n".join(lines) + "\n"


def _color(variants: List[str], v: str):
    """One color per variant, the same in every figure."""
    from matplotlib import colormaps

    return colormaps["tab10"](variants.index(v) % 10)


def _round_log_axis(axis, lo: float, hi: float) -> None:
    """Plain-number round ticks (`report.log_ticks`) on a log axis spanning [lo, hi]."""
    from matplotlib import ticker

    axis.set_major_locator(ticker.FixedLocator(log_ticks(lo, hi) or [lo, hi]))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _plot_vs_depth(ax, groups, variants, shown, sweep, value, label):
    """Mean ± std over seeds of value(blocks, dim, variant) (a list per seed) against L, each
    seed as a dot, for the `shown` variants."""
    from matplotlib import ticker

    for v in shown:
        xs, ms, ss, color = [], [], [], _color(variants, v)
        for b, d in sweep:
            vals = value(b, d, v)
            if vals:
                xs.append(2 * b)
                ms.append(_mean(vals))
                ss.append(_std(vals))
                ax.scatter([2 * b] * len(vals), vals, s=9, alpha=0.45, color=color)
        if xs:
            ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=v, color=color)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(ticker.FixedLocator([2 * b for b, _ in sweep]))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("sublayers L (depth)")
    ax.set_ylabel(label)


def write(out: Path, runs: List[dict], args, *, plots: bool = True) -> List[Path]:
    """Write `summary.md` (and the PNGs when `plots`) for `runs` into `out`; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    if not runs:
        path = out / "summary.md"
        path.write_text("# AttnRes depth study\n\nNo finished runs yet.\n")
        return [path]
    path = out / "summary.md"
    path.write_text(summary_markdown(runs, args.dim))
    written = [path]
    if not plots:
        return written
    plt = require_matplotlib()
    groups, variants = _groups(runs), _variants(runs)
    shapes, sweep = _shapes(groups, args.dim)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _plot_vs_depth(ax, groups, variants, [v for v in variants if v != "standard"], sweep,
                   lambda b, d, v: paired_gaps(groups, b, d, v), "val loss − standard (paired, nats/byte)")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_title(f"Loss gap to PreNorm vs depth (d = {args.dim}; mean ± std, dots = seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOTS[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    costs = [("ms / training step", lambda rs: 1e3 * _mean([r["step_s"] for r in rs])),
             ("training memory (MiB)", lambda rs: _mean([r["memory"]["total"] for r in rs]) / 2 ** 20),
             ("decode ms / byte, batch 1 (fastest schedule)",
              lambda rs: 1e3 * _mean([min(r["decode_s"].values()) for r in rs]))]
    markers = "os^vDP*Xph<>"
    for ax, (label, cost) in zip(axes, costs):
        for i, v in enumerate(variants):
            pts = [(cost(groups[(b, d, v)]), _mean([final_loss(r) for r in groups[(b, d, v)]]), f"{b}x{d}")
                   for b, d in shapes if (b, d, v) in groups]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)],
                           label=v, color=_color(variants, v))
                if v == "standard":
                    for x, y, name in pts:
                        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        _round_log_axis(ax.xaxis, *ax.get_xlim())
        ax.set_xlabel(label)
    axes[0].set_ylabel("final val loss (nats/byte)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Quality vs cost, one point per (shape, variant), mean over seeds; labels: standard's BLOCKSxDIM (lower left is better)")
    fig.tight_layout()
    fig.savefig(out / PLOTS[1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _plot_vs_depth(ax, groups, variants, variants, sweep,
                   lambda b, d, v: [r["probe"]["copy"] for r in groups.get((b, d, v), [])],
                   "copy-probe accuracy (second copy)")
    ax.set_title(f"Exact in-context copy of held-out text vs depth (d = {args.dim})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOTS[2], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, label) in zip(axes, [("input_growth", "input RMS growth (last / first sublayer)"),
                                       ("deep_share", "deepest half's share of output RMS"),
                                       ("grad_spread", "grad norm max / min over sublayers")]):
        _plot_vs_depth(ax, groups, variants, variants, sweep,
                       lambda b, d, v, key=key: [dilution(r)[key] for r in groups.get((b, d, v), [])], label)
        if key != "deep_share":
            ax.set_yscale("log")
            _round_log_axis(ax.yaxis, *ax.get_ylim())
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Dilution measures at the last step vs depth (d = {args.dim})")
    fig.tight_layout()
    fig.savefig(out / PLOTS[3], dpi=110)
    plt.close(fig)
    return written + [out / p for p in PLOTS]
