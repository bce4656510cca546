"""The report of the compute-scaling sweep (`experiments.scaling`): fits, compute
multipliers, `summary.md`, `summary.json` and PNGs drawn from the saved runs.

* **Fit** per variant, over the ladder runs' (compute C, final validation loss) points:
  loss(C) = a * (C / 1e12)^-b + c (C in FLOPs, so a is the reducible loss at 1 TFLOP).  numpy
  only: for each asymptote c on a grid below the smallest loss, log(loss - c) = log a - b log C is
  a linear least-squares problem; the c with the smallest squared error in loss is refined on a
  finer grid around it, twice.  The paper's own form, a pure power law (c = 0), is fitted beside.
* **Compute multiplier** of a variant X against PreNorm at equal loss: m(C) = C_PreNorm(L_X(C)) / C,
  the compute PreNorm's fit needs to reach the loss X's fit reaches with C (infinite when that
  loss is below PreNorm's asymptote c).  Reported at the largest size's compute and at each size.
* **Bootstrap**: the runs are resampled in pairs, (size, seed) units with replacement (a unit
  brings its PreNorm and its X run, so the pairing by seed is kept), both variants refitted, m
  recomputed; 95 % percentile interval.  Draws with fewer than 3 distinct sizes are redrawn.
* `scaling.png` — the paper's figure: loss against compute (log x), one dot per run, the fitted
  curves; beside it the paired loss difference to PreNorm per size.  `lr_sweep.png` — final loss
  against the sweep's learning rates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .report import _mean, _mean_std, require_matplotlib

PLOTS = ("scaling.png", "lr_sweep.png")
#: Compute unit of the fits' `a` (FLOPs).
UNIT = 1e12
BASELINE = "standard"


def fit_power_law(compute: Sequence[float], loss: Sequence[float], *, asymptote: bool = True,
                  grid: int = 400, refinements: int = 2) -> dict:
    """Least-squares fit of loss = a * (compute / UNIT)^-b + c (c = 0 when not `asymptote`).

    compute, loss: `[n]` positive values, at least 3 distinct compute values (2 with
    asymptote=False).  Returns {"a", "b", "c", "rms"} (rms: the root-mean-square residual in loss).
    """
    C, L = np.asarray(compute, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if C.shape != L.shape or C.ndim != 1:
        raise ValueError(f"compute, loss: expected two [n] arrays, got shapes {C.shape}, {L.shape}")
    if not (np.all(np.isfinite(C)) and np.all(C > 0) and np.all(np.isfinite(L)) and np.all(L > 0)):
        raise ValueError("compute, loss: expected finite positive values")
    need = 3 if asymptote else 2
    if len(np.unique(C)) < need:
        raise ValueError(f"compute: a fit with{'' if asymptote else 'out'} the asymptote c needs "
                         f"{need} distinct values, got {len(np.unique(C))}")
    x = np.log(C / UNIT)
    xc = x - x.mean()
    var = float(xc @ xc)

    def solve(cs: np.ndarray):
        y = np.log(L[None, :] - cs[:, None])  # [G, n]
        slope = (y - y.mean(axis=1, keepdims=True)) @ xc / var  # = -b
        log_a = y.mean(axis=1) - slope * x.mean()
        pred = cs[:, None] + np.exp(log_a[:, None] + slope[:, None] * x[None, :])
        sse = ((pred - L[None, :]) ** 2).sum(axis=1)
        return sse, log_a, -slope

    if not asymptote:
        sse, log_a, b = solve(np.zeros(1))
        best_c, i = 0.0, 0
    else:
        top = float(L.min()) * (1 - 1e-9)
        cs = np.linspace(0.0, top, grid)
        for _ in range(refinements + 1):
            sse, log_a, b = solve(cs)
            i = int(np.nanargmin(sse))
            lo, hi = cs[max(i - 1, 0)], cs[min(i + 1, len(cs) - 1)]
            best_c = float(cs[i])
            cs = np.linspace(lo, hi, grid)
        sse, log_a, b = solve(np.array([best_c]))
        i = 0
    return {"a": float(np.exp(log_a[i])), "b": float(b[i]), "c": best_c,
            "rms": float(math.sqrt(sse[i] / len(L)))}


def predict(fit: dict, compute) -> np.ndarray:
    """The fitted loss at `compute` (FLOPs)."""
    return fit["c"] + fit["a"] * (np.asarray(compute, dtype=np.float64) / UNIT) ** -fit["b"]


def compute_for_loss(fit: dict, loss: float) -> float:
    """The compute (FLOPs) at which `fit` reaches `loss`: inf when loss <= c, nan when the fit does
    not decrease (b <= 0)."""
    if fit["b"] <= 0 or fit["a"] <= 0:
        return float("nan")
    if loss <= fit["c"]:
        return float("inf")
    return float(UNIT * ((loss - fit["c"]) / fit["a"]) ** (-1.0 / fit["b"]))


def multiplier(base: dict, other: dict, compute: float) -> float:
    """How much compute the `base` fit needs to reach the loss `other` reaches with `compute`,
    divided by `compute` (> 1: `other` is ahead)."""
    return compute_for_loss(base, float(predict(other, compute))) / compute


def final_loss(run: dict) -> float:
    return run["val"][-1]["loss"]


def _ok(run: dict) -> bool:
    return math.isfinite(final_loss(run))


def ladder_runs(runs: List[dict]) -> List[dict]:
    return [r for r in runs if r.get("settings", {}).get("kind") == "ladder"]


def sweep_runs(runs: List[dict]) -> List[dict]:
    return [r for r in runs if r.get("settings", {}).get("kind") == "lr_sweep"]


def _variants(runs: List[dict]) -> List[str]:
    seen = list(dict.fromkeys(r["variant"] for r in runs))
    order = [BASELINE, "block", "full"]
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def _sizes(runs: List[dict]) -> List[Tuple[int, int]]:
    """(blocks, dim) by non-embedding parameters of the PreNorm model, smallest first."""
    n: Dict[Tuple[int, int], int] = {}
    for r in runs:
        n.setdefault((r["blocks"], r["dim"]), r["nonembedding_params"])
    return sorted(n, key=lambda s: (n[s], s))


def _units(runs: List[dict], variant: str) -> Dict[Tuple[int, int, int], Tuple[dict, dict]]:
    """{(blocks, dim, seed): (PreNorm run, `variant` run)} for the pairs where both finished."""
    by = {(r["blocks"], r["dim"], r["seed"], r["variant"]): r for r in runs if _ok(r)}
    return {(b, d, s): (by[(b, d, s, BASELINE)], by[(b, d, s, variant)])
            for (b, d, s, v) in by if v == variant and (b, d, s, BASELINE) in by}


def _fit_runs(rs: List[dict], asymptote: bool = True) -> Optional[dict]:
    try:
        return fit_power_law([r["compute"] for r in rs], [final_loss(r) for r in rs], asymptote=asymptote)
    except ValueError:
        return None


def _quantiles(values: List[float]) -> Optional[List[float]]:
    """[2.5 %, 97.5 %] of the defined (not NaN) values, inf allowed; None when none is defined."""
    v = np.array([x for x in values if not math.isnan(x)])
    if not len(v):
        return None
    return [float(np.percentile(v, q, method="nearest")) for q in (2.5, 97.5)]


def compare(runs: List[dict], variant: str, *, draws: int = 1000, seed: int = 0,
            asymptote: bool = True) -> Optional[dict]:
    """The compute multiplier of `variant` against PreNorm over the paired ladder runs: at the
    largest size's compute and at each size's, with bootstrap intervals (see the module
    docstring).  None when fewer than 3 sizes (2 without the asymptote) have a finished pair."""
    units = _units(runs, variant)
    keys = sorted(units)
    need = 3 if asymptote else 2
    if len({(b, d) for b, d, _ in keys}) < need:
        return None
    base_fit = _fit_runs([units[k][0] for k in keys], asymptote)
    other_fit = _fit_runs([units[k][1] for k in keys], asymptote)
    if base_fit is None or other_fit is None:
        return None
    sizes = [s for s in _sizes([units[k][1] for k in keys])]
    at = {s: _mean([units[k][1]["compute"] for k in keys if k[:2] == s]) for s in sizes}
    points = list(at.values())
    point = [multiplier(base_fit, other_fit, c) for c in points]
    rng = np.random.default_rng(seed)
    boot: List[List[float]] = []
    attempts = 0
    while len(boot) < draws and attempts < 20 * draws:
        attempts += 1
        pick = [keys[i] for i in rng.integers(0, len(keys), len(keys))]
        if len({k[:2] for k in pick}) < need:
            continue
        bf = _fit_runs([units[k][0] for k in pick], asymptote)
        of = _fit_runs([units[k][1] for k in pick], asymptote)
        if bf is None or of is None:
            continue
        boot.append([multiplier(bf, of, c) for c in points])
    columns = list(zip(*boot)) if boot else [[] for _ in points]
    return {"variant": variant, "pairs": len(keys), "fit_baseline": base_fit, "fit": other_fit,
            "sizes": [f"{b}x{d}" for b, d in sizes], "compute": points,
            "multiplier": point, "interval": [_quantiles(list(c)) for c in columns],
            "largest": {"size": f"{sizes[-1][0]}x{sizes[-1][1]}", "compute": points[-1],
                        "loss": float(predict(other_fit, points[-1])), "multiplier": point[-1],
                        "interval": _quantiles(list(columns[-1]))},
            "range": [min(point), max(point)], "draws": len(boot),
            "undefined_draws": sum(math.isnan(x) for x in (columns[-1] if boot else []))}


def _fmt_m(m: float) -> str:
    if math.isnan(m):
        return "undefined"
    return "∞" if math.isinf(m) else f"{m:.2f}x"


def _fmt_interval(iv: Optional[List[float]]) -> str:
    return "—" if iv is None else f"[{_fmt_m(iv[0])}, {_fmt_m(iv[1])}]"


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _sci(x: float) -> str:
    return f"{x:.3g}"


def analyse(runs: List[dict], *, draws: int = 1000) -> dict:
    """Every number of the report, JSON-ready."""
    ladder = ladder_runs(runs)
    variants = _variants(ladder)
    fits = {v: _fit_runs([r for r in ladder if r["variant"] == v and _ok(r)]) for v in variants}
    fits0 = {v: _fit_runs([r for r in ladder if r["variant"] == v and _ok(r)], False) for v in variants}
    comparisons = {v: compare(ladder, v, draws=draws) for v in variants if v != BASELINE}
    comparisons0 = {v: compare(ladder, v, draws=draws, asymptote=False) for v in variants if v != BASELINE}
    sweep = sweep_runs(runs)
    lrs = sorted({r["lr"] for r in sweep})
    best = None
    if sweep:
        base = [(final_loss(r) if _ok(r) else math.inf, r["lr"]) for r in sweep if r["variant"] == BASELINE]
        best = min(base)[1] if base else None
    return {"runs": len(ladder), "sweep_runs": len(sweep), "variants": variants,
            "diverged": [r.get("file", "") for r in runs if not _ok(r)],
            "fits": fits, "fits_no_asymptote": fits0, "comparisons": comparisons,
            "comparisons_no_asymptote": comparisons0, "lr_sweep": lrs, "best_lr": best,
            "best_lr_at_edge": best is not None and len(lrs) > 1 and best in (lrs[0], lrs[-1])}


def summary_markdown(runs: List[dict], result: dict) -> str:
    ladder = ladder_runs(runs)
    lines = ["# AttnRes compute-scaling sweep", ""]
    if not ladder and not sweep_runs(runs):
        return "\n".join(lines + ["No finished runs yet."]) + "\n"
    s0 = (ladder or runs)[0]["settings"]
    lines += [f"{result['runs']} ladder runs and {result['sweep_runs']} lr-sweep runs.  Every run: "
              f"{s0['tokens_per_param']:g} training tokens per non-embedding parameter (of the size's "
              f"PreNorm model), batches of {s0['batch']} x {s0['context']} bytes, AdamW, warmup 10 % then "
              f"cosine to 10 %, d / heads = {s0['head_dim']}, Block size {s0['block_size']} sublayers.  "
              f"Validation: {s0['eval_batches']} fixed batches of held-out files, nats per byte.  Compute "
              "C = 6 * N * tokens (N: non-embedding parameters).  Corpus SHA-256 (train) "
              f"{s0['corpus_sha256']['train'][:12]}…; torch {s0['torch']}, Python {s0['python']}.", ""]
    if result["diverged"]:
        lines += [f"Runs with a non-finite loss (left out of every fit): {', '.join(result['diverged'])}.", ""]
    sweep = sweep_runs(runs)
    if sweep:
        variants = _variants(sweep)
        by = {(r["lr"], r["variant"]): final_loss(r) for r in sweep}
        size = f"{sweep[0]['blocks']}x{sweep[0]['dim']}"
        lines += [f"## Learning-rate sweep at {size} (seed 0)", "",
                  f"Chosen: the lowest PreNorm loss of the {sum(r['variant'] == BASELINE for r in sweep)} "
                  f"PreNorm sweep runs finished, peak lr {result['best_lr']:g} at {size}, used for every "
                  f"variant and scaled as {s0['lr_rule']}."
                  + ("  **It is at the edge of the grid**: the optimum may lie outside it."
                     if result["best_lr_at_edge"] else ""), ""]
        rows = [[f"{lr:g}"] + [f"{by[(lr, v)]:.4f}" if (lr, v) in by else "—" for v in variants]
                for lr in result["lr_sweep"]]
        lines += _table(["peak lr"] + variants, rows) + [""]
    if not ladder:
        return "\n".join(lines) + "\n"
    variants = result["variants"]
    sizes = _sizes(ladder)
    lines += ["## Sizes", ""]
    rows = []
    for b, d in sizes:
        rs = [r for r in ladder if (r["blocks"], r["dim"]) == (b, d)]
        base = [r for r in rs if r["variant"] == BASELINE] or rs
        wall = {v: _mean([r["wall_s"] for r in rs if r["variant"] == v]) for v in variants
                if any(r["variant"] == v for r in rs)}
        rows.append([f"{b}x{d}", str(2 * b), str(base[0]["heads"]), f"{base[0]['nonembedding_params']:,}",
                     f"{base[0]['lr']:.3g}", f"{base[0]['steps']:,}", f"{base[0]['tokens']:,}",
                     _sci(base[0]["compute"]), str(len({r["seed"] for r in rs})),
                     " / ".join(f"{w / 60:.3g}" for w in wall.values())])
    lines += _table(["size", "L", "heads", "N (PreNorm)", "peak lr", "steps", "tokens", "C (FLOPs)",
                     "seeds", "wall min / run (" + ", ".join(variants) + ")"], rows)
    lines += ["", "## Final validation loss", "",
              "mean ± std over seeds; in brackets the difference to PreNorm, paired by seed.", ""]
    rows = []
    for b, d in sizes:
        row = [f"{b}x{d}"]
        for v in variants:
            rs = [r for r in ladder if (r["blocks"], r["dim"], r["variant"]) == (b, d, v) and _ok(r)]
            if not rs:
                row.append("—")
                continue
            cell = _mean_std([final_loss(r) for r in rs])
            if v != BASELINE:
                gaps = [final_loss(o) - final_loss(p) for (bb, dd, _), (p, o) in _units(ladder, v).items()
                        if (bb, dd) == (b, d)]
                if gaps:
                    cell += f" ({_mean_std(gaps, signed=True)})"
            row.append(cell)
        rows.append(row)
    lines += _table(["size"] + variants, rows)
    lines += ["", "## Fits: loss(C) = a * (C / 1e12 FLOPs)^-b + c", ""]
    rows = []
    for v in variants:
        f, f0 = result["fits"].get(v), result["fits_no_asymptote"].get(v)
        rows.append([v] + ([_sci(f["a"]), _sci(f["b"]), _sci(f["c"]), _sci(f["rms"])] if f else ["—"] * 4)
                    + ([f"{_sci(f0['a'])} · C^-{_sci(f0['b'])}", _sci(f0["rms"])] if f0 else ["—"] * 2))
    lines += _table(["variant", "a", "b", "c", "rms residual", "c = 0 (paper's form)", "rms residual"], rows)
    lines += ["", "## Compute multiplier against PreNorm at equal loss", "",
              "m = the compute PreNorm's fit needs for the loss the variant's fit reaches, over the "
              "variant's compute (> 1: the variant is ahead); 95 % paired bootstrap interval.  The paper: "
              "Block 1.25x.", ""]
    for label, key in (("loss(C) = a C^-b + c", "comparisons"), ("c = 0 (the paper's fit)", "comparisons_no_asymptote")):
        rows = []
        for v, comp in result[key].items():
            if comp is None:
                rows.append([v, "— (fewer than the sizes a fit needs)", "", ""])
                continue
            big = comp["largest"]
            rows.append([v, f"{_fmt_m(big['multiplier'])} {_fmt_interval(big['interval'])} at {big['size']} "
                            f"(loss {big['loss']:.4f})",
                         f"{_fmt_m(comp['range'][0])} – {_fmt_m(comp['range'][1])}",
                         "; ".join(f"{s} {_fmt_m(m)} {_fmt_interval(iv)}" for s, m, iv in
                                   zip(comp["sizes"], comp["multiplier"], comp["interval"]))])
        lines += [f"**{label}**", ""] + _table(["variant", "at the largest size", "over the sizes",
                                                 "per size"], rows) + [""]
    return "\n".join(lines) + "\n"


def _color(variants: List[str], v: str):
    from matplotlib import colormaps

    return colormaps["tab10"](variants.index(v) % 10)


def plot_scaling(runs: List[dict], result: dict, path: Path) -> None:
    plt = require_matplotlib()
    ladder = [r for r in ladder_runs(runs) if _ok(r)]
    variants = result["variants"]
    fig, (ax, gap) = plt.subplots(1, 2, figsize=(13, 4.8))
    cs = [r["compute"] for r in ladder]
    grid = np.geomspace(min(cs) / 1.3, max(cs) * 1.3, 200)
    for v in variants:
        rs = [r for r in ladder if r["variant"] == v]
        color = _color(variants, v)
        ax.scatter([r["compute"] for r in rs], [final_loss(r) for r in rs], s=16, color=color, alpha=0.7)
        f = result["fits"].get(v)
        label = v if f is None else f"{v}: {f['a']:.3g}·(C/1e12)^-{f['b']:.3g} + {f['c']:.3g}"
        if f is not None:
            ax.plot(grid, predict(f, grid), color=color, label=label)
        else:
            ax.plot([], [], color=color, label=label)
        if v != BASELINE:
            units = _units(ladder, v)
            xs = [o["compute"] for p, o in units.values()]
            ys = [final_loss(o) - final_loss(p) for p, o in units.values()]
            gap.scatter(xs, ys, s=16, color=color, label=v)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C = 6 N tokens (FLOPs)")
    ax.set_ylabel("final validation loss (nats / byte)")
    title = "Loss vs compute"
    comp = result["comparisons"].get("block")
    if comp is not None:
        title += (f"; Block = PreNorm x {_fmt_m(comp['largest']['multiplier'])} compute "
                  f"{_fmt_interval(comp['largest']['interval'])} at {comp['largest']['size']}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    gap.axhline(0, color="k", lw=0.8)
    gap.set_xscale("log")
    gap.set_xlabel("training compute C (FLOPs)")
    gap.set_ylabel("loss − PreNorm, paired by seed")
    gap.set_title("Paired difference to PreNorm per run", fontsize=10)
    if gap.get_legend_handles_labels()[0]:  # no pair finished yet: nothing to label
        gap.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lr_sweep(runs: List[dict], path: Path) -> None:
    plt = require_matplotlib()
    sweep = [r for r in sweep_runs(runs) if _ok(r)]
    variants = _variants(sweep)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for v in variants:
        rs = sorted((r for r in sweep if r["variant"] == v), key=lambda r: r["lr"])
        ax.plot([r["lr"] for r in rs], [final_loss(r) for r in rs], marker="o", label=v,
                color=_color(variants, v))
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats / byte)")
    if sweep:
        ax.set_title(f"lr sweep at {sweep[0]['blocks']}x{sweep[0]['dim']}, seed 0", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf" / "nan": JSON has no infinities
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write(out: Path, runs: List[dict], args, *, plots: bool = True) -> List[Path]:
    """Write summary.md, summary.json (and the PNGs when `plots` and there is something to draw)
    for `runs` into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    result = analyse(runs, draws=getattr(args, "bootstrap", 1000))
    (out / "summary.md").write_text(summary_markdown(runs, result))
    (out / "summary.json").write_text(json.dumps(_jsonable(result), indent=1))
    written = [out / "summary.md", out / "summary.json"]
    if plots and ladder_runs(runs):
        plot_scaling(runs, result, out / PLOTS[0])
        written.append(out / PLOTS[0])
    if plots and sweep_runs(runs):
        plot_lr_sweep(runs, out / PLOTS[1])
        written.append(out / PLOTS[1])
    return written
