"""The multi-hop recall probe: the task generator's answers follow from its inputs alone (checked by
a plain pointer-chasing solver written here, independently of the generator), bad task shapes are
refused, the stopping rule, and a 5-step probe end to end (JSON per run, resume, report)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from experiments import recall

TASK = {"nodes": 5, "symbols": 9, "hops": 3, "queries": 4}


def solve(tokens: list, nodes: int, symbols: int, hops: int, queries: int) -> tuple:
    """Read one sequence as a person would: the pairs define f, each query block starts with its
    node; returns (answers f^j(q) for each query and hop, the positions they are asked at)."""
    f = {tokens[2 * i]: tokens[2 * i + 1] for i in range(nodes)}
    answers, positions = [], []
    for qi in range(queries):
        at = 2 * nodes + qi * hops
        node = tokens[at]
        assert node < symbols and all(t == symbols + j - 2 for j, t in
                                      zip(range(2, hops + 1), tokens[at + 1: at + hops]))
        for j in range(hops):
            node = f[node]
            answers.append(node)
            positions.append(at + j)
    return answers, positions


def test_the_answers_are_determined_by_the_inputs():
    batch = recall.hop_batch(torch.Generator().manual_seed(3), 64, **TASK)
    vocab, T = recall.task_shape(**TASK)
    tokens = batch["tokens"]
    assert tokens.shape == (64, T) and tokens.dtype == torch.int64 and int(tokens.max()) < vocab
    assert batch["answers"].shape == (64, TASK["queries"] * TASK["hops"])
    assert batch["hop"].tolist() == [1, 2, 3] * TASK["queries"]
    for row, answers in zip(tokens.tolist(), batch["answers"].tolist()):
        pairs = row[: 2 * TASK["nodes"]]
        xs, ys = pairs[0::2], pairs[1::2]
        # one cycle through all the nodes: f is a permutation of the shown nodes without fixed points
        assert sorted(xs) == sorted(ys) and len(set(xs)) == TASK["nodes"] and all(x != y for x, y in zip(xs, ys))
        node, seen = xs[0], set()
        for _ in range(TASK["nodes"]):
            seen.add(node)
            node = ys[xs.index(node)]
        assert seen == set(xs)
        want, positions = solve(row, **TASK)
        assert answers == want and batch["positions"].tolist() == positions
        queries = row[2 * TASK["nodes"]::TASK["hops"]]
        assert len(set(queries)) == TASK["queries"]  # distinct query nodes
        assert all(q not in want[i * 3:(i + 1) * 3] for i, q in enumerate(queries))  # hops < nodes
        # hop 2 is never q, f(q) or f^-1(q): the shortcut_ceiling guess is among nodes - 3 others
        inverse = {y: x for x, y in zip(xs, ys)}
        for i, q in enumerate(queries):
            assert want[3 * i + 1] not in {q, want[3 * i], inverse[q]}
    assert recall.shortcut_ceiling(TASK["nodes"]) == 1 / (TASK["nodes"] - 3)
    # the generator is deterministic in its generator and does not always draw the same sequence
    again = recall.hop_batch(torch.Generator().manual_seed(3), 64, **TASK)
    assert torch.equal(again["tokens"], tokens)
    assert len({tuple(r) for r in tokens.tolist()}) == 64


@pytest.mark.parametrize("bad, name", [({"nodes": 10}, "nodes, symbols"), ({"hops": 5}, "hops"),
                                       ({"queries": 6}, "queries"), ({"nodes": 1}, "nodes")])
def test_bad_task_shapes_are_refused(bad, name):
    with pytest.raises(ValueError, match=name):
        recall.hop_batch(torch.Generator(), 2, **{**TASK, **bad})
    with pytest.raises(ValueError, match="batch"):
        recall.hop_batch(torch.Generator(), 0, **TASK)
    with pytest.raises(ValueError, match="nodes"):
        recall.shortcut_ceiling(3)


def test_stopping_rule():
    args = argparse.Namespace(solved=0.99, min_delta=0.01, patience=300, max_steps=1000)
    curve = lambda accs: [{"step": 100 * i, "acc": a} for i, a in enumerate(accs)]  # noqa: E731
    assert recall.stop_reason(curve([0.2, 0.5, 0.995]), args) == "solved"
    assert recall.stop_reason(curve([0.2, 0.5, 0.6]), args) is None
    # gains of <= 1 point for 300 steps after the best: a plateau
    assert recall.stop_reason(curve([0.2, 0.6, 0.605, 0.608, 0.6]), args) == "plateau"
    assert recall.stop_reason(curve([0.2, 0.6, 0.605, 0.62, 0.6]), args) is None
    assert recall.stop_reason(curve([0.1 * i for i in range(11)][:9] + [0.85, 0.9]), args) == "cap"


def test_a_five_step_probe_writes_its_runs_resumes_and_reports(tmp_path, monkeypatch):
    out = tmp_path / "recall"
    argv = ["--depths", "1", "--residual", "standard,block", "--seeds", "1", "--dim", "16",
            "--heads", "2", "--batch", "4", "--max-steps", "5", "--eval-every", "2",
            "--eval-sequences", "8", "--nodes", "4", "--symbols", "6", "--hops", "2",
            "--queries", "2", "--out", str(out), "--no-plots"]
    assert recall.main(argv) == 0
    runs = {r["variant"]: r for r in recall.load_runs(out)}
    assert sorted(p.name for p in (out / "runs").glob("*.json")) == ["L2-block-s0.json", "L2-standard-s0.json"]
    for r in runs.values():
        assert r["stop"] == {"step": 5, "reason": "cap"} and [p["step"] for p in r["curve"]] == [0, 2, 4, 5]
        assert len(r["final"]["by_hop"]) == 2 and 0 <= r["final"]["acc"] <= 1 and r["step_s"] > 0
    # paired: zero-query Block computes the PreNorm function at step 0 (same held-out loss)
    assert runs["block"]["curve"][0]["loss"] == pytest.approx(runs["standard"]["curve"][0]["loss"], abs=1e-5)
    assert runs["block"]["curve"][-1]["loss"] != runs["standard"]["curve"][-1]["loss"]
    summary = (out / "summary.md").read_text()
    assert "| 2 | block |" in summary and "5 (cap)" in summary

    # the same command again trains nothing; other settings are refused
    before = {p.name: p.read_bytes() for p in (out / "runs").glob("*.json")}
    monkeypatch.setattr(recall, "train_run", lambda *a, **k: pytest.fail("a finished run was retrained"))
    assert recall.main(argv) == 0
    assert {p.name: p.read_bytes() for p in (out / "runs").glob("*.json")} == before
    assert len(json.loads((out / "recall.json").read_text())["sessions"]) == 2
    with pytest.raises(SystemExit, match="other settings"):
        recall.main(_with(argv, "--batch", "3"))
    with pytest.raises(SystemExit, match="past where these settings stop it"):
        recall.main(_with(argv, "--max-steps", "4"))
    assert recall.main(argv + ["--report-only"]) == 0


def _with(argv: list, flag: str, value: str) -> list:
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


def test_a_run_continues_from_its_state_as_if_never_stopped(tmp_path):
    argv = ["--depths", "1", "--residual", "block", "--seeds", "1", "--dim", "16", "--heads", "2",
            "--batch", "4", "--eval-every", "2", "--eval-sequences", "8", "--nodes", "4",
            "--symbols", "6", "--hops", "2", "--queries", "2", "--no-plots"]
    key = "runs/L2-block-s0.json"
    assert recall.main(argv + ["--max-steps", "4", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "state" / "L2-block-s0.pt").exists()
    assert recall.main(argv + ["--max-steps", "6", "--out", str(tmp_path / "a")]) == 0  # extended
    assert recall.main(argv + ["--max-steps", "6", "--out", str(tmp_path / "b")]) == 0  # in one go
    extended, whole = (json.loads((tmp_path / d / key).read_text()) for d in "ab")
    assert [p["step"] for p in extended["curve"]] == [0, 2, 4, 6] and extended["stop"]["step"] == 6
    assert extended["curve"] == whole["curve"]  # the same losses and accuracies, bit for bit

    # another stopping rule that stops the saved run where it ended: reused, its record says so
    out = tmp_path / "a"
    assert recall.main(argv + ["--max-steps", "6", "--patience", "50", "--out", str(out)]) == 0
    again = json.loads((out / key).read_text())
    assert again["curve"] == extended["curve"] and again["settings"]["patience"] == 50
    # one that would have stopped it earlier (no gain of 100 points in 2 steps) is refused
    with pytest.raises(SystemExit, match="past where these settings stop it"):
        recall.main(argv + ["--max-steps", "6", "--patience", "2", "--min-delta", "1", "--out", str(out)])
    # first_stop: the first evaluation at which a rule stops the run (here the cap of 4)
    assert recall.first_stop(extended["curve"], argparse.Namespace(
        solved=2.0, min_delta=0.0, patience=100, max_steps=4)) == (2, "cap")
