"""The report folder of `experiments.train`, drawn from its metrics (the runs' losses and
`DepthMonitor` histories):

* `metrics.json` — everything measured (written by `train` as it goes);
* `summary.md` — the numbers: final validation loss per variant (mean, std, per seed, paired
  difference to "standard"), per-layer magnitudes, depth-weight entropy, timings;
* `loss_curves.png` — training and validation loss per variant;
* `magnitudes.png` — per-sublayer output RMS, input RMS and gradient norm (the paper's Fig. 5 view);
* `depth_weights_<variant>.png` — depth-attention weights, one row per sublayer (Fig. 8 view).

Plots need matplotlib (`pip install matplotlib`; from a checkout `pip install -e 'backend_torch[plots]'`),
imported only when drawing; without it `train` writes metrics.json and summary.md and says so.
Regenerate a report from its metrics with `python -m experiments.report DIR`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

PLOT_FILES = ("loss_curves.png", "magnitudes.png")


def require_matplotlib():
    """Import matplotlib's pyplot with the non-interactive Agg backend, or raise a clear error."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the AttnRes report plots need matplotlib: pip install matplotlib "
                          "(or pass --no-plots for metrics.json and summary.md only)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _by_variant(meta: dict) -> Dict[str, List[dict]]:
    runs: Dict[str, List[dict]] = {}
    for run in meta["runs"]:
        runs.setdefault(run["variant"], []).append(run)
    return runs


def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: List[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _mean_std(xs: List[float], signed: bool = False) -> str:
    """"m ± s" over seeds; just "m" for one seed (a standard deviation of one value says nothing)."""
    mean = f"{_mean(xs):+.4f}" if signed else f"{_mean(xs):.4f}"
    return f"{mean} ± {_std(xs):.4f}" if len(xs) > 1 else mean


def step_label(meta: dict, run: dict) -> str:
    """The last diagnostics record's training step, counted from 1 ("step 30 of 30")."""
    return f"step {_final(run)['step'] + 1} of {meta['args']['steps']}"


def _final(run: dict) -> dict:
    """The last diagnostics record of a run."""
    return run["diagnostics"][-1]


def _layer_mean(runs: List[dict], key: str) -> Optional[List[float]]:
    """Per-sublayer `key` of the final record, averaged over seeds (None if not recorded)."""
    rows = [_final(r)[key] for r in runs if _final(r)[key] is not None]
    return [_mean(col) for col in zip(*rows)] if rows else None


def sublayer_name(row: int, num_layers: int) -> str:
    """Row r of the example model: sublayer r + 1, attention for even r, MLP for odd r; row L is
    the output aggregation."""
    if row == num_layers:
        return "output"
    return f"{'attn' if row % 2 == 0 else 'mlp'} {row // 2 + 1}"


# -- summary ---------------------------------------------------------------------------------
def summary_markdown(meta: dict) -> str:
    a, runs = meta["args"], _by_variant(meta)
    L = 2 * a["blocks"]
    c = meta["corpus"]
    lines = [
        "# AttnRes example run", "",
        f"Model: byte-level GPT-style LM, {a['blocks']} Transformer blocks (L = {L} sublayers), "
        f"d_model {a['dim']}, {a['heads']} heads, context {a['context']}, batch {a['batch']}; "
        f"{a['steps']} AdamW steps at peak lr {a['lr']}; block size {a['block_size']}, window "
        f"{a['window']}.  torch {meta['torch']}, {meta['threads']} thread(s).",
        f"Data: {c['files']} top-level `.py` files of the Python {c['python']} standard library "
        f"({c['train_bytes']} train bytes, {c['val_bytes']} validation bytes, split by file).",
        f"Total wall time: {meta['total_wall_s']:.0f} s for {len(meta['runs'])} runs.", "",
        "## Validation loss (nats per byte, after the last step)", "",
        f"| variant | {'mean ± std' if len(meta['args']['seeds']) > 1 else 'loss'} | per seed | minus standard (paired) | at step 0 | params (router) "
        "| s / step | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {r["seed"]: r["val"][-1]["loss"] for r in runs.get("standard", [])}
    for variant, rs in runs.items():
        finals = [r["val"][-1]["loss"] for r in rs]
        paired = [r["val"][-1]["loss"] - base[r["seed"]] for r in rs if r["seed"] in base]
        diff = (f"{_mean_std(paired, signed=True)} ({sum(d < 0 for d in paired)}/{len(paired)} lower)"
                if paired and variant != "standard" else "—")
        lines.append(
            f"| {variant} | {_mean_std(finals)} | "
            f"{', '.join(f'{x:.4f}' for x in finals)} | {diff} | "
            f"{_mean([r['val'][0]['loss'] for r in rs]):.4f} | {rs[0]['params']} ({rs[0]['router_params']}) | "
            f"{_mean([r['step_s'] for r in rs]):.3f} | {_mean([r['wall_s'] for r in rs]):.0f} |")
    last = step_label(meta, meta["runs"][0])
    lines += ["", f"## Per-layer view at the last step ({last}, mean over seeds)", "",
              "Output RMS = RMS of sublayer output v_l; input RMS = RMS of its input h_l; gradient "
              "norm = L2 norm of the sublayer's parameter gradients (before clipping).", "",
              "| variant | output RMS first → last | input RMS first → last | grad norm first → last "
              "(max/min) | depth entropy / log N | max weight (row) |",
              "|---|---|---|---|---|---|"]
    for variant, rs in runs.items():
        out, inp, grad = (_layer_mean(rs, k) for k in ("output_rms", "input_rms", "grad_norm"))
        rows = _final(rs[0])["rows"]
        if rows:
            ent = _mean([_mean([row["entropy"] / math.log(len(row["labels"]))
                                for row in _final(r)["rows"] if len(row["labels"]) > 1]) for r in rs])
            worst = max((row for r in rs for row in _final(r)["rows"] if len(row["labels"]) > 1),
                        key=lambda row: row["max_weight"])
            depth = (f"{ent:.3f}", f"{worst['max_weight']:.3f} ({sublayer_name(worst['row'], L)})")
        else:
            depth = ("—", "—")
        lines.append(f"| {variant} | {out[0]:.3g} → {out[-1]:.3g} | {inp[0]:.3g} → {inp[-1]:.3g} | "
                     f"{grad[0]:.3g} → {grad[-1]:.3g} ({max(grad) / min(grad):.1f}) | {depth[0]} | {depth[1]} |")
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------
def _smooth(xs: List[float], k: int) -> List[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot_losses(meta: dict, path: Path) -> None:
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for i, (variant, rs) in enumerate(_by_variant(meta).items()):
        color = f"C{i}"
        k = max(1, len(rs[0]["train_loss"]) // 20)
        ax1.plot(_smooth([_mean(col) for col in zip(*[r["train_loss"] for r in rs])], k),
                 color=color, label=variant)
        steps = [v["step"] for v in rs[0]["val"]]
        for r in rs:
            ax2.plot(steps, [v["loss"] for v in r["val"]], color=color, alpha=0.25, lw=0.8)
        ax2.plot(steps, [_mean(col) for col in zip(*[[v["loss"] for v in r["val"]] for r in rs])],
                 color=color, marker="o", ms=3, label=variant)
    ax1.set(title="training loss (moving mean, mean over seeds)", xlabel="step", ylabel="nats / byte")
    ax2.set(title="validation loss (thin: seeds)", xlabel="step", ylabel="nats / byte")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def log_ticks(lo: float, hi: float) -> List[float]:
    """Round tick values in [lo, hi] for a log axis: 1-2-5 per decade, or finer (1, 1.5, 2, 3, 4,
    5, 7) when the range is too short for three of those."""
    out: List[float] = []
    for mantissas in ((1.0,), (1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0)):
        values = (float(f"{m * 10.0 ** k:.6g}")
                  for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                  for m in mantissas)
        out = [v for v in values if lo <= v <= hi]
        if len(out) >= 3:
            break
    return out


def _integer_and_log_axes(ax) -> None:
    """Whole-number sublayer ticks on x; plain-number round ticks on the log y axis."""
    from matplotlib import ticker

    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(ticker.FixedLocator(log_ticks(*ax.get_ylim())))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.tick_params(labelsize=8)


def plot_magnitudes(meta: dict, path: Path) -> None:
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    titles = {"output_rms": "output magnitude (RMS of v_l)", "input_rms": "input magnitude (RMS of h_l)",
              "grad_norm": "gradient norm of sublayer l"}
    for i, (variant, rs) in enumerate(_by_variant(meta).items()):
        for ax, key in zip(axes, titles):
            values = _layer_mean(rs, key)
            ax.plot(range(1, len(values) + 1), values, color=f"C{i}", marker=".", label=variant)
    for ax, (key, title) in zip(axes, titles.items()):
        ax.set(title=title, xlabel="sublayer l", yscale="log")
        ax.title.set_fontsize(10)
        _integer_and_log_axes(ax)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"per-sublayer magnitudes at the last recorded {step_label(meta, meta['runs'][0])} "
                 "(mean over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _label_key(label: str):
    return (2, 0) if label == "partial" else (1 if label[0] == "b" else 0, int(label[1:]))


def plot_depth_weights(meta: dict, variant: str, path: Path) -> None:
    """Heatmap of the final record's mean depth weights, rows = sublayers, mean over seeds."""
    plt = require_matplotlib()
    import numpy as np

    rs = _by_variant(meta)[variant]
    L = 2 * meta["args"]["blocks"]
    rows = [_final(r)["rows"] for r in rs]
    columns = sorted({lab for row in rows[0] for lab in row["labels"]}, key=_label_key)
    grid = np.full((len(rows[0]), len(columns)), np.nan)
    for i, row in enumerate(rows[0]):
        for j, lab in enumerate(row["labels"]):
            grid[i, columns.index(lab)] = _mean([rr[i]["mean_weights"][j] for rr in rows])
    fig, ax = plt.subplots(figsize=(0.32 * len(columns) + 2.6, 0.24 * len(grid) + 1.4))
    im = ax.imshow(grid, cmap="viridis", vmin=0.0, aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=90, fontsize=7)
    ax.set_yticks(range(len(grid)), [sublayer_name(row["row"], L) for row in rows[0]], fontsize=7)
    ax.set(xlabel="source", ylabel="sublayer (row)",
           title=f"{variant}: depth weights, {step_label(meta, rs[0])}")
    ax.title.set_fontsize(9)
    cbar = fig.colorbar(im, ax=ax, fraction=0.05)
    cbar.set_label("weight (mean over tokens and seeds)", fontsize=8)
    cbar.ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(out: Path, meta: dict, *, plots: bool = True) -> List[Path]:
    """Write metrics.json, summary.md and (plots=True) the figures into `out`; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "metrics.json", out / "summary.md"]
    written[0].write_text(json.dumps(meta))
    written[1].write_text(summary_markdown(meta))
    if plots:
        plot_losses(meta, out / PLOT_FILES[0])
        plot_magnitudes(meta, out / PLOT_FILES[1])
        written += [out / name for name in PLOT_FILES]
        for variant, rs in _by_variant(meta).items():
            if _final(rs[0])["rows"]:
                written.append(out / f"depth_weights_{variant}.png")
                plot_depth_weights(meta, variant, written[-1])
    return written


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.report",
                                description="Redraw a report folder from its metrics.json.")
    p.add_argument("folder", type=Path)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    meta = json.loads((args.folder / "metrics.json").read_text())
    for path in write_report(args.folder, meta, plots=not args.no_plots):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
