"""The checkpoints that backend_mlx/tests/test_hf_checkpoint.py loads into mlx-lm (issue 43 item 3):
tiny random Llama models converted by `attnres_torch.hf`, saved with `save_pretrained`, and what
torch computes from them (the logits of one prompt and the greedy tokens `generate` continues it
with).  The MLX test venv has no torch, so the checkpoints and torch's results are committed
under backend_mlx/tests/data/hf_attnres/; this file is their generator and their drift check:

* regenerating them here (in a tmp dir) gives the committed tensors and config bitwise, and
* torch, loading the committed checkpoints with `hf.from_pretrained`, still computes the
  committed logits (float32 rounding) and exactly the committed greedy tokens.

Regenerate (after a deliberate change of `attnres_torch.hf`'s format or of the cases below):

    python backend_torch/tests/test_mlx_fixture.py

Weights come from numpy's seeded generator, not torch's initializers, so the same bytes come out
under every torch version.  Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from attnres_core.config import ResidualConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # the only reason to skip: the checkpoint format needs safetensors
    import safetensors  # noqa: F401
    from safetensors.numpy import load_file
except ImportError:  # pragma: no cover - tests-torch installs it
    safetensors = None

FIXTURE = Path(__file__).resolve().parents[2] / "backend_mlx" / "tests" / "data" / "hf_attnres"

#: The cases: name -> (scheme, per_layer).  3 decoder layers, L = 6 sublayers: Block with S = 4
#: crosses a decoder-layer boundary (blocks {0..3}, {4, 5}); Full is saved with one stacked
#: router (per_layer=False: `model.attnres_router.queries [L+1, D]`), Block and Window with the
#: per-layer rows (`model.layers.<i>.attnres.row<r>.query`).
CASES = {
    "block": ({"kind": "block", "block_size": 4}, True),
    "full": ({"kind": "full"}, False),
    "window": ({"kind": "window", "window": 2}, True),
}

#: The tiny Llama: GQA (2 query heads, 1 KV head), RoPE with a base other than mlx-lm's default
#: (transformers 5 writes it as `rope_parameters`, which mlx-lm 0.32 does not read), SwiGLU, tied
#: embeddings.
LLAMA = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
             bos_token_id=0, eos_token_id=31, pad_token_id=30)

PROMPT = [0, 5, 17, 3, 9, 22, 11, 4]
NEW_TOKENS = 8
#: The greedy tokens are a meaningful check only if no step's top-2 logits are closer than this.
MIN_MARGIN = 1e-3


def _need_safetensors():
    if safetensors is None:
        pytest.skip("safetensors is not installed (the checkpoint format of attnres_torch.hf)")


def build(name: str, seed: int):
    """The converted torch model of case `name`: every weight and AttnRes row from
    `np.random.default_rng(seed)`, float32, eval mode."""
    import transformers
    from attnres_torch import hf

    scheme, per_layer = CASES[name]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    hf.convert(model, ResidualConfig(**scheme), per_layer=per_layer)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for key, p in sorted(model.named_parameters()):
            if key.endswith("norm.weight") or key.endswith("layernorm.weight") \
                    or key.endswith("norm_weight") or key.endswith("norm_weights"):
                value = 1.0 + 0.2 * rng.standard_normal(p.shape)   # RMSNorm and key-norm gains
            elif "attnres" in key:
                value = 0.7 * rng.standard_normal(p.shape)         # pseudo-queries, non-zero
            elif "embed_tokens" in key:
                value = rng.standard_normal(p.shape)               # also the (tied) head
            else:
                value = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
            p.copy_(torch.from_numpy(value.astype(np.float32)))
    return model


def torch_results(model):
    """(logits [T, V] of PROMPT, the NEW_TOKENS greedy tokens, the smallest top-2 margin)."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=LLAMA["pad_token_id"])
    tokens = out.sequences[0, len(PROMPT):].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    top2 = logits.topk(2, dim=-1).values
    margins.append(float((top2[:, 0] - top2[:, 1]).min()))
    return logits.numpy(), tokens, min(margins)


def write(name: str, path: Path) -> None:
    """Case `name` saved under `path`: `save_pretrained`'s config.json and model.safetensors, and
    expected.json (prompt, torch's logits, greedy tokens, the scheme for the reader, and
    `float32_error`: how far torch's float32 logits are from the same model's in float64, the
    scale of "equal within float32 rounding" for another framework's float32 logits).  The seed is
    the first from 43 on whose greedy continuation has 3 distinct tokens or more and no step's
    top-2 logits within MIN_MARGIN (a tiny random model otherwise repeats one token), and no EOS
    before NEW_TOKENS tokens."""
    for seed in range(43, 243):
        model = build(name, seed)
        logits, tokens, margin = torch_results(model)
        if len(tokens) == NEW_TOKENS and len(set(tokens)) >= 3 and margin > MIN_MARGIN:
            break
    else:
        raise AssertionError(f"{name}: no seed in 43..242 gives a non-degenerate greedy continuation")
    with torch.no_grad():  # float32 rounding, measured: the same model in float64
        exact = build(name, seed).double()(torch.tensor([PROMPT])).logits[0].numpy()
    rounding = float(np.abs(logits.astype(np.float64) - exact).max())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    gen = path / "generation_config.json"
    if gen.exists():
        gen.unlink()  # not needed by either loader; keeps the fixture small
    expected = {"scheme": CASES[name][0], "per_layer": CASES[name][1], "seed": seed, "prompt": PROMPT,
                "logits": [[float(x) for x in row] for row in logits], "greedy": tokens,
                "min_margin": margin, "float32_error": rounding, "generator": "backend_torch/tests/test_mlx_fixture.py"}
    (path / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def _config_without_version(path: Path) -> dict:
    """config.json less transformers' version (which may differ without changing the
    checkpoint).  Everything else, the "attnres" record's form included (model_type "attnres",
    "base_model_type", the traced "form"), must be what attnres_torch.hf writes now; the MLX
    loader also reads the earlier form (test_hf_checkpoint.py edits the fixture into it)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("transformers_version", None)
    return cfg


@pytest.mark.parametrize("name", sorted(CASES))
def test_regenerated_fixture_equals_the_committed_one(name, tmp_path):
    _need_safetensors()
    pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")
    committed = FIXTURE / name
    assert committed.is_dir(), f"{committed} is missing: run python {__file__}"
    write(name, tmp_path)
    hint = f"the committed fixture drifted from attnres_torch.hf: run python {Path(__file__).name}"
    assert _config_without_version(tmp_path) == _config_without_version(committed), hint
    got, want = load_file(tmp_path / "model.safetensors"), load_file(committed / "model.safetensors")
    assert sorted(got) == sorted(want), hint
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), (key, hint)
    new, old = (json.loads((p / "expected.json").read_text()) for p in (tmp_path, committed))
    assert (new["seed"], new["prompt"], new["greedy"]) == (old["seed"], old["prompt"], old["greedy"]), hint
    tol = 2 * old["float32_error"] + 1e-6  # another CPU's float32 matmuls round differently
    np.testing.assert_allclose(new["logits"], old["logits"], rtol=0, atol=tol, err_msg=hint)


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_computes_the_committed_results_from_the_committed_checkpoint(name):
    _need_safetensors()
    transformers = pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")
    from attnres_torch import hf

    committed = FIXTURE / name
    model = hf.from_pretrained(transformers.LlamaForCausalLM, str(committed)).eval()
    assert hf.is_converted(model)
    logits, tokens, margin = torch_results(model)
    expected = json.loads((committed / "expected.json").read_text())
    assert tokens == expected["greedy"]
    assert margin > MIN_MARGIN
    tol = 2 * expected["float32_error"] + 1e-6
    np.testing.assert_allclose(logits, np.asarray(expected["logits"], np.float32), rtol=0, atol=tol)
    # the rows are really there and not a plain mean: the same weights as PreNorm (mix = 0) differ
    with torch.no_grad(), hf.residual_inputs(model, mix=0.0):
        prenorm = model(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(prenorm - logits).max() > 0.1
    # and the family's own class, which would build that PreNorm model, refuses the directory
    with pytest.raises(Exception, match="Attention Residuals checkpoint"):
        transformers.LlamaForCausalLM.from_pretrained(str(committed))


@pytest.mark.parametrize("saved", ["mlx_saved", "jax_saved"])
def test_torch_loads_the_checkpoint_mlx_or_jax_saved_and_computes_their_results(saved):
    """The way back: data/hf_attnres/mlx_saved was written by `attnres_mlx.mlx_lm.save_hf` (rows
    set in MLX; backend_mlx/tests/test_hf_checkpoint.py writes and drift-checks it), jax_saved by
    `attnres_jax.checkpoint_hf.save_hf` (rows set in JAX; backend_jax/tests/test_checkpoint_hf.py).
    torch's `hf.from_pretrained` loads each (mlx_saved's config also names mlx-lm's model_file)
    and computes that framework's logits within float32 rounding and its greedy tokens."""
    _need_safetensors()
    transformers = pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")
    from attnres_torch import hf

    path = FIXTURE / saved
    expected = json.loads((path / "expected.json").read_text())
    # the family's own class refuses what the other frameworks saved (the guard they write)
    with pytest.raises(Exception, match="Attention Residuals checkpoint"):
        transformers.LlamaForCausalLM.from_pretrained(str(path))
    model = hf.from_pretrained(transformers.LlamaForCausalLM, str(path)).eval()
    logits, tokens, _ = torch_results(model)
    assert tokens == expected["greedy"]
    with torch.no_grad():
        exact = model.double()(torch.tensor([PROMPT])).logits[0].numpy()
    tol = 3 * float(np.abs(logits.astype(np.float64) - exact).max()) + 1e-6
    np.testing.assert_allclose(logits, np.asarray(expected["logits"], np.float32), rtol=0, atol=tol)
    committed = json.loads((FIXTURE / "block" / "expected.json").read_text())
    assert np.abs(logits - np.asarray(committed["logits"])).max() > 0.1  # their rows, not torch's


if __name__ == "__main__":
    for case in sorted(CASES):
        write(case, FIXTURE / case)
        print(f"wrote {FIXTURE / case}", file=sys.stderr)
