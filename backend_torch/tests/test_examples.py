"""The example LM and the training command: zero-query AttnRes == PreNorm at the logits (the paper's
initialization argument), a tiny end-to-end `train` run writing the whole report folder, the CLI,
the deterministic corpus and the plain progress fallback."""

from __future__ import annotations

import json
import re
import sys
import warnings

import pytest
import torch

from experiments import data, report, train
from experiments.model import VARIANTS, ExampleLM, variant_config

TINY = dict(dim=16, num_blocks=3, num_heads=2, context=8)

# Zero pseudo-queries give uniform depth weights, so h_l = (sum of the sources) / N_l is the PreNorm
# stream divided by a positive number; each sublayer's own RMSNorm and the final RMSNorm undo the
# factor up to their eps: relative logit error ~ eps / (2 * mean(h^2)) ~ 2e-10 at eps = 1e-12 in
# float64 for this model.  Tolerance: max |diff| <= 1e-8 * (1 + max |logits|).
ZERO_QUERY_TOL = 1e-8


def _paired(name: str, block_size: int = 2, window: int = 4):
    """(standard model, `name` model) with the same non-router weights, float64, eps = 1e-12."""
    models = []
    for variant in ("standard", name):
        torch.manual_seed(0)
        cfg = variant_config(variant, 2 * TINY["num_blocks"], block_size=block_size, window=window)
        models.append(ExampleLM(cfg, eps=1e-12, **TINY).double())
    base, model = models
    shared = {k: v for k, v in base.state_dict().items() if not k.startswith("router.")}
    missing = model.load_state_dict(shared, strict=False).missing_keys
    assert missing and all(k.startswith("router.") for k in missing)
    return base, model


@pytest.mark.parametrize("name,block_size", [("full", 2), ("block", 2), ("block", 4), ("input_query", 2),
                                             ("multihead", 2), ("sigmoid", 2), ("no_key_norm", 2),
                                             ("low_rank_keys", 2), ("compressed_history", 2)])
def test_zero_query_model_equals_prenorm_logits(name, block_size):
    # M13 starts as Full (zero r-dim queries); M14 with W = 1, S = 2 over L = 6 reads summaries,
    # whose sources still add up to the PreNorm state.
    base, model = _paired(name, block_size, window=1 if name == "compressed_history" else 4)
    tokens = torch.randint(0, 256, (2, TINY["context"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = base(tokens)
        got = model(tokens)
        err = float((got - ref).abs().max())
        assert err <= ZERO_QUERY_TOL * (1 + float(ref.abs().max())), f"{name}: max |diff| {err:.3g}"
        # negative control: nonzero queries make the models differ, so the check above can fail
        for p in model.router.parameters():
            p.add_(0.5)
        assert float((model(tokens) - ref).abs().max()) > 1e-3


def test_window_is_not_prenorm_at_init():
    """Window keeps only recent sources, so zero queries do not reproduce PreNorm (L = 6, W = 4)."""
    base, model = _paired("window")
    assert model.router.config.window == 4
    tokens = torch.randint(0, 256, (1, TINY["context"]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert float((model(tokens) - base(tokens)).abs().max()) > 1e-3


def test_every_variant_builds_and_runs():
    tokens = torch.randint(0, 256, (1, 4))
    for name in VARIANTS:
        model = ExampleLM(variant_config(name, 6, block_size=4, window=2), **TINY)
        assert model(tokens).shape == (1, 4, 256), name
    with pytest.raises(ValueError, match="context = 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def _tiny_args(out, *extra):
    return ["--residual", "standard,block", "--seeds", "1", "--steps", "3", "--blocks", "2",
            "--dim", "16", "--heads", "2", "--context", "8", "--batch", "2", "--eval-every", "2",
            "--eval-batches", "2", "--corpus-bytes", "300000", "--out", str(out), *extra]


def _check_metrics(out):
    meta = json.loads((out / "metrics.json").read_text())
    runs = {r["variant"]: r for r in meta["runs"]}
    assert set(runs) == {"standard", "block"}
    for r in runs.values():
        assert len(r["train_loss"]) == 3 and all(0 < x < 10 for x in r["train_loss"])
        assert [v["step"] for v in r["val"]] == [0, 2, 3]
        assert [d["step"] for d in r["diagnostics"]] == [0, 2]
        assert len(r["diagnostics"][-1]["grad_norm"]) == 4
    # paired runs: zero-query Block equals PreNorm at step 0 (float32, eps 1e-6)
    assert runs["block"]["val"][0]["loss"] == pytest.approx(runs["standard"]["val"][0]["loss"], abs=1e-4)
    assert runs["standard"]["diagnostics"][0]["rows"] == []
    assert len(runs["block"]["diagnostics"][0]["rows"]) == 5
    summary = (out / "summary.md").read_text()
    assert "| block |" in summary and "| standard |" in summary
    # one seed: no "± 0.0000" (a standard deviation of one value), the last step counted from 1
    assert "±" not in summary and "step 3 of 3" in summary


def test_train_writes_report_with_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="plot files need matplotlib (the 'plots' extra)")
    assert train.main(_tiny_args(tmp_path)) == 0
    _check_metrics(tmp_path)
    expected = {"metrics.json", "summary.md", *report.PLOT_FILES, "depth_weights_block.png"}
    assert {p.name for p in tmp_path.iterdir()} == expected
    assert all((tmp_path / name).stat().st_size > 1000 for name in report.PLOT_FILES)


def test_train_without_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    # without matplotlib the run still writes the numbers, and says how to get the figures
    assert train.main(_tiny_args(tmp_path)) == 0
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "pip install matplotlib" in err
    assert "attnres-torch[plots]" not in err  # not on PyPI: a command that cannot work
    # something is printed before the corpus and the first step (no silent start)
    assert err.index("reading the corpus") < err.index("corpus:") < err.index("[1/6")
    assert "at step 2" in err  # the validation loss says when it was measured
    assert {p.name for p in tmp_path.iterdir()} == {"metrics.json", "summary.md"}
    _check_metrics(tmp_path)
    assert train.main(_tiny_args(tmp_path, "--no-plots")) == 0
    assert "matplotlib" not in capsys.readouterr().err
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.require_matplotlib()


def test_collapse_warning_is_one_readable_line(capsys):
    from attnres_torch.diagnostics import DepthCollapseWarning

    seen = []
    show = train._readable_collapse_warnings(lambda *a: seen.append(a))
    with warnings.catch_warnings():
        warnings.showwarning = show
        warnings.simplefilter("always")
        warnings.warn("depth weights collapsed at step 7", DepthCollapseWarning)
        warnings.warn("something else", UserWarning)
    err = capsys.readouterr().err
    assert err.strip() == "note: depth weights collapsed at step 7"
    assert len(seen) == 1 and seen[0][1] is UserWarning  # other warnings keep their usual form


def test_cli_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert all(opt in text for opt in ("--residual", "--seeds", "--steps", "--out"))
    assert all(name in text for name in VARIANTS)
    with pytest.raises(SystemExit) as exc:
        train.main(["--residual", "standard,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err
    assert train._seeds("3") == [0, 1, 2] and train._seeds("4,7") == [4, 7]


def test_corpus_selection_and_split_are_deterministic(tmp_path):
    for i in range(12):
        (tmp_path / f"m{i:02d}.py").write_bytes(bytes([65 + i]) * (i + 1))
    (tmp_path / "notes.txt").write_bytes(b"not python")
    corpus = data.load_stdlib_corpus(root=str(tmp_path), val_every=5)
    assert corpus.files == [f"m{i:02d}.py" for i in range(12)]
    assert bytes(corpus.val.tolist()) == bytes([65 + 4]) * 5 + bytes([65 + 9]) * 10
    assert corpus.train.numel() + corpus.val.numel() == sum(range(1, 13))
    again = data.load_stdlib_corpus(root=str(tmp_path), val_every=5)
    assert torch.equal(corpus.train, again.train) and corpus.describe() == again.describe()
    capped = data.load_stdlib_corpus(max_bytes=20, root=str(tmp_path), val_every=5)
    assert capped.train.numel() + capped.val.numel() == 20
    stdlib = data.load_stdlib_corpus(100_000)
    assert stdlib.train.numel() > 0 and stdlib.val.numel() > 0


def test_batches():
    seq = torch.arange(100, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    b = data.random_batch(seq, 3, 8, gen)
    assert b.shape == (3, 9) and b.dtype == torch.int64 and torch.all(b[:, 1:] - b[:, :-1] == 1)
    fixed = data.fixed_batches(seq, 2, 3, 8)
    assert len(fixed) == 2 and fixed[0].shape == (3, 9)
    assert torch.equal(torch.cat(fixed), torch.cat(data.fixed_batches(seq, 2, 3, 8)))


def test_plain_progress_fallback(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = train._progress(40)
    assert isinstance(bar, train._PlainProgress)
    bar.set_description("block seed 0")
    bar.set_postfix_str("loss 1.0")
    for _ in range(40):
        bar.update()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 21 and lines[0].startswith("[1/40")  # a line after the first step
    assert lines[-1].startswith("[40/40 100%") and "block seed 0 loss 1.0" in lines[-1]
    # every line has an ETA (mean rate so far x remaining work); none left at the end
    assert all(re.search(r"s, ETA \d+s\]", line) for line in lines) and "ETA 0s]" in lines[-1]


def test_example_model_uses_the_learned_position_option():
    cfg = variant_config("block", 2 * TINY["num_blocks"], block_size=2)
    model = ExampleLM(cfg, **TINY)
    assert model.positional == "learned" and model.pos.weight.shape == (TINY["context"], TINY["dim"])
    rope = ExampleLM(cfg, positional="rope", **TINY)
    assert not hasattr(rope, "pos") and rope(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)
    with pytest.raises(ValueError, match=r"T <= context = 8"):
        rope(torch.zeros(1, 9, dtype=torch.long))


def test_train_model_returns_the_trained_model(tmp_path):
    args = train.build_parser().parse_args(["--blocks", "1", "--dim", "16", "--heads", "2", "--steps", "2",
                                            "--context", "8", "--batch", "2", "--eval-batches", "1"])
    corpus = data.load_stdlib_corpus(300_000)
    val = data.fixed_batches(corpus.val, 1, 2, 8)
    model, run = train.train_model("block", 0, args, corpus, val, train._PlainProgress(2))
    assert isinstance(model, ExampleLM) and run["val"][-1]["step"] == 2
    assert run["val"][-1]["loss"] == pytest.approx(train.evaluate(model, val))


def test_log_ticks_are_round_and_enough():
    assert report.log_ticks(0.15, 3.0) == [0.2, 0.5, 1.0, 2.0]
    assert report.log_ticks(0.04, 0.45) == [0.05, 0.1, 0.2]
    assert report.log_ticks(0.06, 0.3) == [0.07, 0.1, 0.15, 0.2, 0.3]
    assert report.log_ticks(1e-3, 1e2) == [0.001, 0.01, 0.1, 1.0, 10.0, 100.0]


def test_decoder_example_converts_and_trains(capsys):
    from examples import torch_decoder as decoder

    assert decoder.main([]) == 0
    out = capsys.readouterr().out
    diff = float(re.search(r"at init ([0-9.e+-]+)", out).group(1))
    first, last = (float(x) for x in re.findall(r"loss ([0-9.]+)", out))
    assert "logits (2, 32, 256); router parameters 1152" in out and diff < 1e-3
    assert last < first - 1.0


def test_decoder_conversion_is_prenorm_at_init_in_float64():
    from attnres_core.config import ResidualConfig

    from examples.torch_decoder import Decoder, convert

    torch.manual_seed(0)
    prenorm = Decoder(64, 16, 3, 2).double()
    tokens = torch.randint(0, 64, (2, 8))
    # the sublayers' RMSNorm eps (1e-6) is what keeps this from exact: relative ~ eps / mean(h^2)
    for config in (ResidualConfig(kind="full"), ResidualConfig(kind="block", block_size=2)):
        model = convert(prenorm, config).double()
        with torch.no_grad():
            ref = prenorm(tokens)
            assert (model(tokens) - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())
            model.router.queries.add_(0.5)  # negative control: trained queries change the function
            assert (model(tokens) - ref).abs().max() > 1e-3


def test_train_stability_schedule_flags(tmp_path):
    """--introduce-steps / --temperature-schedule drive mix and scale per step for the attention
    variants only; at mix 0 Block is the PreNorm model exactly (same step-0 validation loss)."""
    assert train.main(_tiny_args(tmp_path, "--no-plots", "--introduce-steps", "2",
                                 "--temperature-schedule", "0.5:1:2")) == 0
    runs = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["runs"]}
    assert runs["block"]["mix"] == [0.0, 0.5, 1.0] and runs["block"]["scale"] == [0.5, 0.75, 1.0]
    assert runs["standard"]["mix"] is None and runs["standard"]["scale"] is None
    assert runs["block"]["val"][0]["loss"] == runs["standard"]["val"][0]["loss"]


def test_logits_with_mix_and_scale():
    base, model = _paired("block")
    with torch.no_grad():
        for p in model.router.parameters():
            p.add_(0.5)
    tokens = torch.randint(0, 256, (2, TINY["context"]), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(train._logits(model, tokens, 1.0, None), model(tokens))
        assert torch.equal(train._logits(model, tokens, 0.0, None), base(tokens))
        half = train._logits(model, tokens, 0.5, 2.0)
        assert float((half - model(tokens)).abs().max()) > 1e-3
        assert float((half - base(tokens)).abs().max()) > 1e-3


def test_schedule_flags_bad_values(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--temperature-schedule", "1:2"])
    assert exc.value.code == 2 and "START:END:STEPS" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--introduce-steps: expected an int >= 0"):
        train.main(["--introduce-steps", "-1"])
