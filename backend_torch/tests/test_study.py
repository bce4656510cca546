"""The depth study: a tiny sweep end to end (runs, probes, costs, report), resume after an
interruption (finished runs are not recomputed), settings guard, and the probes themselves."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import probes, study, study_report
from experiments.model import ExampleLM, variant_config

TINY = ["--depths", "1,2", "--dim", "16", "--heads", "2", "--matched", "1x32", "--residual",
        "standard,block", "--seeds", "1", "--steps", "3", "--batch", "2", "--context", "16",
        "--eval-every", "3", "--eval-batches", "1", "--diag-every", "3", "--corpus-bytes", "300000",
        "--probe-sequences", "4", "--probe-length", "8", "--latency-reps", "1"]


def test_tiny_sweep_resumes_and_writes_the_report(tmp_path, monkeypatch):
    out = tmp_path / "study"
    argv = TINY + ["--out", str(out)]
    real, calls = study.one_run, []

    def interrupted(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt  # as ^C during the third run
        calls.append(a[1:5])
        return real(*a, **k)

    monkeypatch.setattr(study, "one_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        study.main(argv + ["--no-plots"])
    done = sorted((out / "runs").glob("*.json"))
    assert [p.name for p in done] == ["1x16-block-s0.json", "1x16-standard-s0.json"]
    before = {p.name: p.read_bytes() for p in done}

    calls.clear()
    monkeypatch.setattr(study, "one_run", lambda *a, **k: calls.append(a[1:5]) or real(*a, **k))
    assert study.main(argv) == 0
    # the two finished runs were not recomputed (same bytes), the other four were
    assert calls == [(2, 16, "standard", 0), (2, 16, "block", 0), (1, 32, "standard", 0), (1, 32, "block", 0)]
    assert all((out / "runs" / name).read_bytes() == data for name, data in before.items())
    runs = study.load_runs(out)
    assert len(runs) == 6 and len(json.loads((out / "study.json").read_text())["sessions"]) == 2
    for name in ("summary.md",) + study_report.PLOTS:
        assert (out / name).stat().st_size > 0, name

    by = {(r["blocks"], r["dim"], r["variant"]): r for r in runs}
    for r in runs:
        assert len(r["train_loss"]) == 3 and r["val"][-1]["step"] == 3
        assert 0 <= r["probe"]["copy"] <= 1 and 0 <= r["probe"]["first"] <= 1
        assert r["memory"]["total"] == r["memory"]["state"] + r["memory"]["activations"]
        assert r["memory"]["state"] == 16 * r["params"] and r["memory"]["activations"] > 0
        assert len(r["diagnostics"][-1]["input_rms"]) == 2 * r["blocks"]
        # Block is timed with both schedules, standard has only the direct one
        assert set(r["decode_s"]) == ({"direct", "two_phase"} if r["variant"] == "block" else {"direct"})
    # paired: zero-query Block computes the PreNorm function at step 0 (same loss, same seed)
    for b, d in [(1, 16), (2, 16), (1, 32)]:
        assert by[(b, d, "block")]["val"][0]["loss"] == pytest.approx(by[(b, d, "standard")]["val"][0]["loss"], abs=1e-4)
    assert by[(1, 32, "standard")]["params"] > by[(1, 16, "standard")]["params"]
    summary = (out / "summary.md").read_text()
    assert "| block | " in summary and "2 blocks (L=4)" in summary and "| 1x32 | block |" in summary
    gap = by[(2, 16, "block")]["val"][-1]["loss"] - by[(2, 16, "standard")]["val"][-1]["loss"]
    assert f"{gap:+.4f}" in summary

    # the same folder with other settings is refused; --report-only trains nothing
    with pytest.raises(SystemExit, match="other settings"):
        study.main(TINY + ["--steps", "4", "--out", str(out), "--no-plots"])
    monkeypatch.setattr(study, "one_run", None)
    assert study.main(argv + ["--report-only", "--no-plots"]) == 0


def test_study_cli_errors(capsys):
    with pytest.raises(SystemExit):
        study.build_parser().parse_args(["--matched", "8by128"])
    with pytest.raises(SystemExit):
        study.build_parser().parse_args(["--depths", "0,4"])
    with pytest.raises(SystemExit, match="probe-length"):
        study.main(["--probe-length", "40", "--context", "64"])
    with pytest.raises(SystemExit, match="does not divide"):
        study.main(["--dim", "30", "--heads", "4"])


class _Copier(torch.nn.Module):
    """Predicts the byte one copy-length back: perfect on the second copy, 0 elsewhere."""

    def forward(self, seq):
        n, T = seq.shape
        P = T // 2
        guess = torch.zeros_like(seq)
        guess[:, P:T - 1] = seq[:, 1:P]
        return torch.nn.functional.one_hot(guess, 256).float()


def test_copy_probe_counts_the_second_copy():
    val = torch.arange(1, 201, dtype=torch.uint8)  # no zero byte: the copier's "first" is 0
    seqs = probes.copy_windows(val, 5, 6)
    assert seqs.shape == (5, 12) and torch.equal(seqs[:, :6], seqs[:, 6:])
    copier = _Copier().train()
    assert probes.copy_accuracy(copier, seqs) == {"copy": 1.0, "first": 0.0, "gain": 1.0}
    assert copier.training  # the mode is restored
    seqs[:, -1] = 0  # one wrong byte out of 5 per sequence on the copy
    assert probes.copy_accuracy(copier, seqs)["copy"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="sequences"):
        probes.copy_accuracy(copier, seqs[:, :5])


def test_memory_and_latency_measures():
    torch.manual_seed(0)
    model = ExampleLM(variant_config("block", 4, block_size=2), dim=16, num_blocks=2, num_heads=2, context=8)
    small = probes.training_memory(model, torch.randint(0, 256, (2, 9)))
    large = probes.training_memory(model, torch.randint(0, 256, (4, 9)))
    assert small["state"] == large["state"] == 16 * sum(p.numel() for p in model.parameters())
    assert 1.5 < large["activations"] / small["activations"] < 2.5  # activations scale with the batch
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert probes.decode_latency(model, 8, "two_phase", reps=2) > 0
    assert model.router.schedule is None and model.training
