"""Checkpoints saved by `attnres_torch.hf` loaded into mlx-lm, and back (issue 43 item 3).

data/hf_attnres/{block,full,window}: tiny random Llama models (GQA, RoPE at base 500000, SwiGLU,
3 decoder layers) converted and saved by the real `attnres_torch.hf`, with torch's logits and
greedy tokens (written and drift-checked by backend_torch/tests/test_mlx_fixture.py; this venv
has no torch).  `load_hf` must give torch's logits within float32 rounding (twice torch's own
distance from float64, which the fixture records) and exactly torch's greedy tokens through
`generate_step`; the loads that would drop the rows are refused.

data/hf_attnres/mlx_saved: the way back, written by this file (`python
backend_mlx/tests/test_hf_checkpoint.py`, after the torch fixture) with `save_hf` from the
block model with new MLX-side rows; backend_torch/tests/test_mlx_fixture.py loads it with
`attnres_torch.hf.from_pretrained` and checks MLX's logits and tokens recorded here.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from attnres_mlx.hf_checkpoint import FORM, MODEL_FILE, mlx_lm_config  # noqa: E402
from attnres_mlx.mlx_lm import convert_prenorm, load_hf, save_hf  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "hf_attnres"
CASES = ("block", "full", "window")


def _expected(path: Path) -> dict:
    return json.loads((path / "expected.json").read_text())


def _logits(model, prompt) -> np.ndarray:
    return np.array(model(mx.array([prompt]))[0])


def _greedy(model, prompt, n) -> list:
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n),
                                        range(n))]


def _tolerance(expected: dict) -> float:
    """Equal within float32 rounding: twice torch's own float32 distance from float64."""
    return 2 * expected["float32_error"] + 1e-6


@pytest.mark.parametrize("case", CASES)
def test_load_hf_gives_torchs_logits_and_greedy_tokens(case):
    want = _expected(DATA / case)
    model, tokenizer = load_hf(DATA / case)
    assert tokenizer is None  # the fixture has no tokenizer files
    logits = _logits(model, want["prompt"])
    err = float(np.abs(logits - np.asarray(want["logits"], np.float32)).max())
    assert err <= _tolerance(want), (case, err, want["float32_error"])
    assert _greedy(model, want["prompt"], len(want["greedy"])) == want["greedy"]


def test_load_hf_of_the_checkpoint_jax_saved_gives_jaxs_logits_and_greedy_tokens():
    """data/hf_attnres/jax_saved: rows set in JAX, saved by attnres_jax.checkpoint_hf.save_hf
    (backend_jax/tests/test_checkpoint_hf.py writes and drift-checks it): MLX places row r
    where JAX did."""
    want = _expected(DATA / "jax_saved")
    model, _ = load_hf(DATA / "jax_saved")
    assert np.abs(_logits(model, want["prompt"]) - np.asarray(want["logits"])).max() < 1e-4
    assert _greedy(model, want["prompt"], len(want["greedy"])) == want["greedy"]


def test_plain_mlx_lm_loads_refuse_or_are_wrong_which_is_why_load_hf_exists(tmp_path):
    """What the docs warn about.  The checkpoint as attnres_torch.hf saves it (model_type
    "attnres"): mlx-lm alone refuses it, strict or not (no such model type).  The earlier record
    form (the base model_type in config.json): strict loading refuses the rows, strict=False
    returns the PreNorm model (at mlx-lm's default RoPE base, too) without a word."""
    want = _expected(DATA / "block")
    for strict in (True, False):
        with pytest.raises(ValueError, match="Model type attnres not supported"):
            load_model(DATA / "block", strict=strict)
    d = _copy("block", tmp_path)
    _edit_config(d, _legacy_record)
    with pytest.raises(ValueError, match="attnres"):
        load_model(d)
    plain, _ = load_model(d, strict=False)
    assert np.abs(_logits(plain, want["prompt"]) - np.asarray(want["logits"])).max() > 0.1


def test_rope_parameters_of_transformers_5_reach_mlx_lm():
    cfg = json.loads((DATA / "block" / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 500000.0
    assert mlx_lm_config(cfg)["rope_theta"] == 500000.0
    model, _ = load_hf(DATA / "block")
    assert model.model.layers[0].self_attn.rope.base == 500000.0
    scaled = mlx_lm_config({"rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3",
                                                "factor": 8.0}})
    assert scaled["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(DATA / case, dst)
    return dst


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path: Path, edit) -> None:
    weights = dict(mx.load(str(path / "model.safetensors")))
    edit(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})


def test_loads_that_would_drop_or_misplace_the_rows_are_refused(tmp_path):
    # the scheme record removed, the rows still there
    d = _copy("block", tmp_path)
    _edit_config(d, lambda c: c.pop("attnres"))
    with pytest.raises(ValueError, match="no 'attnres' entry but the weights hold 14 AttnRes"):
        load_hf(d)
    # a PreNorm checkpoint: not ours to load
    _edit_weights(d, lambda w: [w.pop(k) for k in list(w) if "attnres" in k])
    with pytest.raises(ValueError, match="mlx_lm.load, then attnres_mlx.mlx_lm.convert_prenorm"):
        load_hf(d)
    # a row missing
    d = _copy("window", tmp_path)
    _edit_weights(d, lambda w: w.pop("model.layers.2.attnres.row6.norm_weight"))
    with pytest.raises(ValueError, match=r"missing \['norm_weights row 6'\]"):
        load_hf(d)
    # per-layer rows where the record says one stacked router, and the reverse
    d = _copy("block", tmp_path / "b")
    _edit_config(d, lambda c: c["attnres"].update(per_layer=False))
    with pytest.raises(ValueError, match="per_layer=False.*unexpected"):
        load_hf(d)
    d = _copy("full", tmp_path / "f")
    _edit_config(d, lambda c: c["attnres"].update(per_layer=True))
    with pytest.raises(ValueError, match="per_layer=True.*missing"):
        load_hf(d)
    # a row on a layer that does not read it (MLX's ownership written with torch's names)
    d = _copy("block", tmp_path / "m")
    _edit_weights(d, lambda w: w.update({"model.layers.1.attnres.row2.query":
                                         w.pop("model.layers.0.attnres.row2.query")}))
    with pytest.raises(ValueError, match="unexpected \\['model.layers.1.attnres.row2.query'\\]"):
        load_hf(d)
    # schemes and layouts the mlx-lm conversion does not run
    d = _copy("full", tmp_path / "g")
    _edit_config(d, lambda c: c["attnres"]["config"].update(query="input"))
    with pytest.raises(ValueError, match="not one convert_prenorm runs"):
        load_hf(d)
    _edit_config(d, lambda c: c["attnres"].update(layers="transformer.h"))
    with pytest.raises(ValueError, match="Llama-layout decoders at 'model.layers'"):
        load_hf(d)
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf(tmp_path)


@pytest.mark.parametrize("case", ["block", "full"])
def test_save_hf_writes_back_torchs_checkpoint_and_plain_mlx_lm_refuses_it(case, tmp_path):
    """load_hf + save_hf is the torch checkpoint again (same tensor names, same bits, same
    record; per-layer or stacked as loaded), plus the model_file marker: a plain mlx-lm load
    fails loudly, strict or not, and trust_remote_code=True builds the AttnRes model."""
    want = _expected(DATA / case)
    model, _ = load_hf(DATA / case)
    save_hf(model, tmp_path)
    got, ref = mx.load(str(tmp_path / "model.safetensors")), mx.load(str(DATA / case / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for key in ref:
        assert got[key].dtype == ref[key].dtype and mx.array_equal(got[key], ref[key]).item(), key
    cfg = json.loads((tmp_path / "config.json").read_text())
    torch_cfg = json.loads((DATA / case / "config.json").read_text())
    assert cfg.pop("model_file") == MODEL_FILE and (tmp_path / MODEL_FILE).is_file()
    assert cfg == torch_cfg
    for strict in (True, False):
        with pytest.raises(ValueError, match="trust_remote_code"):
            load_model(tmp_path, strict=strict)
    remote, _ = load_model(tmp_path, trust_remote_code=True)
    again, _ = load_hf(tmp_path)
    for m in (remote, again):
        assert np.array_equal(_logits(m, want["prompt"]), _logits(model, want["prompt"]))


def test_a_torch_config_naming_the_model_file_makes_plain_mlx_lm_loud_and_load_hf_still_loads(tmp_path):
    """What attnres_torch.hf could write to close the strict=False hole on its side: the
    model_file key alone (no file beside it).  mlx-lm refuses without trust_remote_code, fails on
    the missing file with it; load_hf does not use the key and loads torch's model."""
    d = _copy("block", tmp_path)
    _edit_config(d, lambda c: c.update(model_file=MODEL_FILE))
    for strict in (True, False):
        with pytest.raises(ValueError, match="trust_remote_code"):
            load_model(d, strict=strict)
    with pytest.raises(FileNotFoundError):
        load_model(d, strict=False, trust_remote_code=True)
    want = _expected(DATA / "block")
    model, _ = load_hf(d)
    assert np.abs(_logits(model, want["prompt"]) - np.asarray(want["logits"])).max() <= _tolerance(want)


def _legacy_record(c: dict) -> None:
    """The record form of earlier attnres_torch.hf (the base model_type in config.json, the
    decoder "layout" in the record), from the committed fixture's form (model_type "attnres",
    the base type and the traced form in the record)."""
    record = c["attnres"]
    assert c["model_type"] == "attnres" and record.pop("form") == FORM
    c["model_type"] = record.pop("base_model_type")
    record["layout"] = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]


@pytest.mark.parametrize("case", ["block", "full"])
def test_the_earlier_record_form_loads_and_saves_back_in_its_own_form(case, tmp_path):
    want = _expected(DATA / case)
    d = _copy(case, tmp_path)
    _edit_config(d, _legacy_record)
    model, _ = load_hf(d)
    assert np.abs(_logits(model, want["prompt"]) - np.asarray(want["logits"])).max() <= _tolerance(want)
    assert _greedy(model, want["prompt"], len(want["greedy"])) == want["greedy"]
    save_hf(model, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg.pop("model_file") == MODEL_FILE
    assert cfg == json.loads((d / "config.json").read_text())
    remote, _ = load_model(tmp_path / "out", trust_remote_code=True)
    assert np.array_equal(_logits(remote, want["prompt"]), _logits(model, want["prompt"]))


@pytest.mark.parametrize("legacy", [False, True], ids=["attnres", "legacy"])
def test_a_changed_scheme_saves_a_new_record_in_the_loaded_form(legacy, tmp_path):
    """save_hf of a model whose scheme is not the loaded one writes a new record, in the form
    the checkpoint had (model_type "attnres" + base_model_type + form, or the base model_type +
    layout), and it loads back equal."""
    d = _copy("block", tmp_path)
    if legacy:
        _edit_config(d, _legacy_record)
    model, _ = load_hf(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attnres"]["config"]["block_size"] = 2  # the record now disagrees with the model's scheme
    save_hf(model, tmp_path / "out", config=cfg)
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    record = out["attnres"]
    assert record["config"]["block_size"] == 4  # the model's scheme, not the stale record's
    if legacy:
        assert out["model_type"] == "llama" and record["layout"] and "form" not in record
    else:
        assert out["model_type"] == "attnres" and record["base_model_type"] == "llama"
        assert record["form"] == FORM and "layout" not in record and "model_type" not in record
    back, _ = load_hf(tmp_path / "out")
    prompt = _expected(DATA / "block")["prompt"]
    assert np.array_equal(_logits(back, prompt), _logits(model, prompt))


def test_records_load_hf_refuses(tmp_path):
    """Forms the mlx-lm conversion does not run, and a model_type "attnres" record without the
    base type."""
    d = _copy("block", tmp_path)
    olmo2 = [[["self_attn", "post_attention_layernorm"], "self_attn", None],
             [["mlp", "post_feedforward_layernorm"], "mlp", None]]
    _edit_config(d, lambda c: c["attnres"].update(form=olmo2))
    with pytest.raises(ValueError, match="converts PreNorm layers only"):
        load_hf(d)
    _edit_config(d, lambda c: (c["attnres"].update(form=FORM), c["attnres"].pop("base_model_type")))
    with pytest.raises(ValueError, match="without the base model_type"):
        load_hf(d)


def test_save_hf_of_a_model_converted_in_mlx(tmp_path):
    """A model converted with convert_prenorm (no load_hf) saves with the HF config given and
    loads back equal; without a config it is refused."""
    from attnres_core.config import ResidualConfig
    from mlx_lm.models import llama

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8,
           "num_hidden_layers": 2, "intermediate_size": 16, "num_attention_heads": 2,
           "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": 32,
           "tie_word_embeddings": False}
    mx.random.seed(0)
    model = convert_prenorm(llama.Model(llama.ModelArgs.from_dict(cfg)),
                            ResidualConfig(kind="block", block_size=2))
    rng = np.random.default_rng(0)
    for layer in model.model.layers:
        layer.attnres_queries = mx.array(rng.standard_normal(layer.attnres_queries.shape), mx.float32)
    with pytest.raises(ValueError, match="pass config="):
        save_hf(model, tmp_path)
    save_hf(model, tmp_path, config=cfg)
    back, _ = load_hf(tmp_path)
    prompt = [1, 2, 3, 4]
    assert np.array_equal(_logits(back, prompt), _logits(model, prompt))
    assert "model.layers.0.attnres.row0.query" in mx.load(str(tmp_path / "model.safetensors"))


# -- the way back, checked by torch ------------------------------------------------------------------

def write_mlx_saved(path: Path) -> None:
    """data/hf_attnres/mlx_saved: the block model with new rows set in MLX (so torch can only
    match by placing them as MLX did), saved by save_hf, with MLX's logits and greedy tokens."""
    src = _expected(DATA / "block")
    model, _ = load_hf(DATA / "block")
    rng = np.random.default_rng(7)
    for layer in model.model.layers:
        layer.attnres_queries = mx.array(0.7 * rng.standard_normal(layer.attnres_queries.shape),
                                         mx.float32)
        layer.attnres_norm_weights = mx.array(
            1 + 0.2 * rng.standard_normal(layer.attnres_norm_weights.shape), mx.float32)
    save_hf(model, path)
    prompt, n = src["prompt"], len(src["greedy"])
    expected = {"from": "block", "prompt": prompt, "logits": _logits(model, prompt).tolist(),
                "greedy": _greedy(model, prompt, n),
                "generator": "backend_mlx/tests/test_hf_checkpoint.py"}
    (path / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def test_the_committed_mlx_saved_checkpoint_is_what_save_hf_writes(tmp_path):
    write_mlx_saved(tmp_path)
    committed = DATA / "mlx_saved"
    hint = "data/hf_attnres/mlx_saved drifted: run python backend_mlx/tests/test_hf_checkpoint.py"
    for name in ("config.json", MODEL_FILE):
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (name, hint)
    got, ref = mx.load(str(tmp_path / "model.safetensors")), mx.load(str(committed / "model.safetensors"))
    assert sorted(got) == sorted(ref), hint
    for key in ref:
        assert mx.array_equal(got[key], ref[key]).item(), (key, hint)
    new, old = _expected(tmp_path), _expected(committed)
    assert (new["prompt"], new["greedy"]) == (old["prompt"], old["greedy"]), hint
    np.testing.assert_allclose(new["logits"], old["logits"], rtol=0, atol=1e-4, err_msg=hint)


if __name__ == "__main__":
    write_mlx_saved(DATA / "mlx_saved")
    print(f"wrote {DATA / 'mlx_saved'}", file=sys.stderr)
