"""The compute-scaling sweep: the power-law fit and the compute multiplier recover known values,
the corpus splits by path and de-duplicates, and a tiny sweep end to end (lr sweep, ladder,
resume after an interruption, settings and corpus guards, --plan, --report-only)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments import corpus, scaling, scaling_report

# --- the fit ---------------------------------------------------------------------------------


def test_fit_recovers_a_known_power_law_with_asymptote():
    C = np.geomspace(1e10, 1e14, 7)
    a, b, c = 2.0, 0.3, 1.5
    fit = scaling_report.fit_power_law(C, a * (C / 1e12) ** -b + c)
    assert fit["a"] == pytest.approx(a, rel=1e-3)
    assert fit["b"] == pytest.approx(b, rel=1e-3)
    assert fit["c"] == pytest.approx(c, abs=1e-3)
    assert fit["rms"] < 1e-5
    # with noise (2 mnats, fixed draw) the fit is still close, and it beats the c = 0 form
    noisy = a * (C / 1e12) ** -b + c + np.random.default_rng(0).normal(0, 2e-3, C.shape)
    fit = scaling_report.fit_power_law(C, noisy)
    assert fit["b"] == pytest.approx(b, rel=0.15) and fit["c"] == pytest.approx(c, abs=0.05)
    assert scaling_report.fit_power_law(C, noisy, asymptote=False)["rms"] > 10 * fit["rms"]
    # c = 0: exact on a pure power law
    pure = scaling_report.fit_power_law(C, 3.0 * (C / 1e12) ** -0.05, asymptote=False)
    assert (pure["a"], pure["b"], pure["c"]) == (pytest.approx(3.0), pytest.approx(0.05), 0.0)


def test_fit_input_errors():
    with pytest.raises(ValueError, match="3 distinct"):
        scaling_report.fit_power_law([1e10, 1e10, 1e11], [3.0, 3.1, 2.9])
    with pytest.raises(ValueError, match="shapes"):
        scaling_report.fit_power_law([1e10, 1e11, 1e12], [3.0, 2.9])
    with pytest.raises(ValueError, match="positive"):
        scaling_report.fit_power_law([1e10, 1e11, 1e12], [3.0, float("nan"), 2.0])


def test_multiplier_of_a_curve_shifted_in_compute():
    base = {"a": 2.0, "b": 0.3, "c": 1.5}
    ahead = dict(base, a=2.0 * 1.25 ** -0.3)  # L_ahead(C) = L_base(1.25 C)
    for C in (1e10, 1e12, 3e13):
        assert scaling_report.multiplier(base, ahead, C) == pytest.approx(1.25, rel=1e-9)
        assert scaling_report.multiplier(base, base, C) == pytest.approx(1.0, rel=1e-9)
    assert scaling_report.compute_for_loss(base, 1.4) == math.inf  # below the asymptote
    assert math.isnan(scaling_report.compute_for_loss(dict(base, b=-0.1), 2.0))


def _fake_runs(shift: float, noise: float = 1e-3):
    """Ladder records: 5 sizes x 2 seeds, Block = PreNorm at `shift` x the compute."""
    rng = np.random.default_rng(1)
    runs = []
    for i, C in enumerate(np.geomspace(1e11, 1e14, 5)):
        for seed in (0, 1):
            e = rng.normal(0, noise)  # shared by the pair, as a seed's data and init are
            for variant, m in (("standard", 1.0), ("block", shift)):
                loss = 2.0 * (m * C / 1e12) ** -0.3 + 1.5 + e + rng.normal(0, noise / 4)
                runs.append({"variant": variant, "seed": seed, "blocks": i + 1, "dim": 16 * (i + 1),
                             "nonembedding_params": 1000 * (i + 1), "compute": float(C),
                             "val": [{"step": 1, "loss": float(loss)}], "settings": {"kind": "ladder"}})
    return runs


def test_compare_recovers_the_multiplier_with_a_bootstrap_interval():
    result = scaling_report.compare(_fake_runs(1.25), "block", draws=200)
    big = result["largest"]
    assert big["multiplier"] == pytest.approx(1.25, rel=0.05)
    lo, hi = big["interval"]
    assert lo < 1.25 < hi and hi - lo < 0.5
    assert result["pairs"] == 10 and result["draws"] == 200
    # no shift: the interval holds 1
    lo, hi = scaling_report.compare(_fake_runs(1.0), "block", draws=200)["largest"]["interval"]
    assert lo < 1.0 < hi
    # fewer than 3 sizes: no fit with an asymptote
    two = [r for r in _fake_runs(1.25) if r["blocks"] <= 2]
    assert scaling_report.compare(two, "block", draws=10) is None
    assert scaling_report.compare(two, "block", draws=10, asymptote=False) is not None


# --- the corpus ------------------------------------------------------------------------------


def _tree(root, files: int = 40, size: int = 3000):
    """A folder of deterministic text files (plus files the corpus must skip)."""
    words = ["def", "return", "self", "import", "class", "lambda", "value", "(x)", "\n", "    "]
    for i in range(files):
        rng = np.random.default_rng(i)
        text = " ".join(words[j] for j in rng.integers(0, len(words), size // 5))
        (root / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 3}" / f"m{i}.py").write_text(text)
    (root / "pkg0" / "copy.md").write_text((root / "pkg0" / "m0.py").read_text())  # a duplicate
    (root / "pkg0" / "blob.bin").write_bytes(b"\0" * 100)  # not a text extension
    (root / "pkg0" / "__pycache__").mkdir(exist_ok=True)
    (root / "pkg0" / "__pycache__" / "c.py").write_text("skipped")
    return root


def test_corpus_splits_by_path_deduplicates_and_is_deterministic(tmp_path):
    root = _tree(tmp_path / "t")
    src = [("t", root, "1")]
    c = corpus.load_corpus(src, val_fraction=0.2)
    again = corpus.load_corpus(src, val_fraction=0.2)
    assert c.sha256() == again.sha256() and c.files == again.files
    train, val = set(c.files["train"]), set(c.files["val"])
    assert not train & val and train and val
    assert len(train | val) == 40 and c.duplicates == 1  # copy.md dropped, .bin and __pycache__ skipped
    assert all(corpus.is_validation(p, 0.2) for p in val) and not any(corpus.is_validation(p, 0.2) for p in train)
    d = c.describe()
    assert d["train"]["bytes"] == c.train.numel() and d["val"]["files"] == len(val)
    assert d["sources"] == [{"name": "t", "version": "1", "root": str(root), "files": 40,
                             "bytes": c.train.numel() + c.val.numel()}]
    # a new file changes no other file's split
    (root / "pkg1" / "new.py").write_text("new file")
    grown = corpus.load_corpus(src, val_fraction=0.2)
    assert set(grown.files["val"]) - {"t/pkg1/new.py"} == val
    with pytest.raises(ValueError, match="val_fraction"):
        corpus.load_corpus(src, val_fraction=1.0)
    with pytest.raises(ValueError, match="not installed"):
        corpus.default_sources(["no_such_package_attnres"])
    with pytest.raises(ValueError, match="distinct"):
        corpus.load_corpus(src + src)


# --- the sweep, end to end -------------------------------------------------------------------


def _argv(root, out):
    return ["--out", str(out), "--corpus-root", str(root), "--sizes", "1x16,2x32", "--residual",
            "standard,block", "--seeds", "2", "--multi-seed-sizes", "1", "--tokens-per-param", "0.15",
            "--batch", "2", "--context", "16", "--eval-batches", "1", "--evals", "1", "--lr-sweep",
            "1e-3,3e-3", "--lr-extend", "0", "--lr-size", "1x16", "--bootstrap", "20", "--val-fraction", "0.2"]


def test_tiny_sweep_resumes_refuses_and_reports(tmp_path, monkeypatch):
    root, out = _tree(tmp_path / "corpus"), tmp_path / "sweep"
    argv = _argv(root, out)
    real, calls = scaling.one_run, []

    def interrupted(*a, **k):
        if len(calls) == 5:
            raise KeyboardInterrupt  # as ^C during the sixth trained run
        calls.append(a[1:6])
        return real(*a, **k)

    monkeypatch.setattr(scaling, "one_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scaling.main(argv + ["--no-plots"])
    runs_dir = out / "runs"
    before = {p.name: p.read_bytes() for p in runs_dir.glob("*.json")}
    # 4 sweep runs, then 1x16 seed 0 (copied from the sweep's best lr, not trained), 1x16 standard s1
    assert len(calls) == 5 and sorted(before) == sorted(
        [f"lr{lr}-1x16-{v}-s0.json" for lr in ("0.001", "0.003") for v in ("standard", "block")]
        + ["1x16-standard-s0.json", "1x16-block-s0.json", "1x16-standard-s1.json"])

    calls.clear()
    monkeypatch.setattr(scaling, "one_run", lambda *a, **k: calls.append(a[1:6]) or real(*a, **k))
    assert scaling.main(argv + ["--no-plots"]) == 0
    assert all((runs_dir / n).read_bytes() == data for n, data in before.items())  # not recomputed
    best = scaling.best_lr([json.loads((runs_dir / f"lr{lr}-1x16-standard-s0.json").read_text())
                            for lr in ("0.001", "0.003")])
    assert calls == [(1, 16, "block", 1, best), (2, 32, "standard", 0, best / 2), (2, 32, "block", 0, best / 2)]

    runs = {r["file"]: r for r in scaling.load_runs(out)}
    assert len(runs) == 10
    copied = runs["1x16-standard-s0.json"]
    assert copied["from_sweep"] == f"lr{best:g}-1x16-standard-s0.json" and copied["settings"]["kind"] == "ladder"
    args = scaling.build_parser().parse_args(argv)
    for r in runs.values():
        model = scaling.build_model(args, r["blocks"], r["dim"], r["variant"])
        n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("embed.", "pos.", "head.")))
        assert r["nonembedding_params"] == n and r["tokens"] == r["steps"] * 2 * 16
        assert r["compute"] == 6 * n * r["tokens"]
        assert r["steps"] == max(1, round(0.15 * scaling.size_params(args, r["blocks"], r["dim"]) / 32))
        assert r["settings"]["corpus_sha256"] == r["corpus"]["sha256"] and r["wall_s"] > 0
        assert len(r["load_before"]) == 3 and r["val"][-1]["step"] == r["steps"]
    for seed in (0, 1):  # paired: zero-query Block computes the PreNorm function at step 0
        s, b = runs[f"1x16-standard-s{seed}.json"], runs[f"1x16-block-s{seed}.json"]
        assert b["val"][0]["loss"] == pytest.approx(s["val"][0]["loss"], abs=1e-4)
    assert runs["2x32-standard-s0.json"]["steps"] > runs["1x16-standard-s0.json"]["steps"]

    summary = (out / "summary.md").read_text()
    assert "## Learning-rate sweep at 1x16" in summary and f"peak lr {best:g}" in summary
    assert "| 2x32 | 4 | 2 |" in summary
    gap = runs["2x32-block-s0.json"]["val"][-1]["loss"] - runs["2x32-standard-s0.json"]["val"][-1]["loss"]
    assert f"({gap:+.4f})" in summary
    result = json.loads((out / "summary.json").read_text())
    assert result["comparisons"]["block"] is None  # 2 sizes: too few for a, b and c
    assert result["comparisons_no_asymptote"]["block"]["pairs"] == 3

    # other settings, or another corpus, are refused; --report-only and --plan train nothing
    other = list(argv)
    other[other.index("--context") + 1] = "8"
    with pytest.raises(SystemExit, match="other settings.*context: saved 16, now 8"):
        scaling.main(other)
    monkeypatch.setattr(scaling, "one_run", None)
    assert not (out / scaling_report.PLOTS[0]).exists()
    assert scaling.main(argv + ["--report-only"]) == 0
    for name in scaling_report.PLOTS:
        assert (out / name).stat().st_size > 0, name
    assert scaling.main(argv + ["--plan", "--plan-steps", "1"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert [(r["blocks"], r["dim"]) for r in plan["sizes"]] == [(1, 16), (2, 32)]
    assert plan["sizes"][0]["sweep_runs"] == 2 and plan["total_s"] > 0
    (root / "pkg2" / "m2.py").write_text("changed text")
    with pytest.raises(SystemExit, match="another corpus"):
        scaling.main(argv)


def test_lr_sweep_extends_past_an_edge_optimum():
    added = {}
    assert scaling.next_lr([2e-3, 4e-3, 8e-3], 8e-3, added, 2) == 1.6e-2  # the grid's step, x2
    assert scaling.next_lr([2e-3, 4e-3, 8e-3, 1.6e-2], 1.6e-2, added, 2) == 3.2e-2
    assert scaling.next_lr([2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2], 3.2e-2, added, 2) is None  # 2 per side
    assert scaling.next_lr([1e-3, 3e-3], 1e-3, added, 2) == pytest.approx(1e-3 / 3)  # the low side
    assert added == {"high": 2, "low": 1}
    assert scaling.next_lr([2e-3, 4e-3, 8e-3], 4e-3, {}, 2) is None  # inside: nothing to add
    assert scaling.next_lr([2e-3], 2e-3, {}, 2) is None and scaling.next_lr([2e-3, 4e-3], None, {}, 2) is None


def test_scaling_cli_errors():
    with pytest.raises(SystemExit, match="standard"):
        scaling.main(["--residual", "block,full"])
    with pytest.raises(SystemExit, match="does not divide"):
        scaling.main(["--sizes", "2x24", "--head-dim", "16"])
    with pytest.raises(SystemExit):
        scaling.build_parser().parse_args(["--lr-sweep", "0,1e-3"])
