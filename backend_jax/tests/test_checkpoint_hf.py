"""Checkpoints saved by `attnres_torch.hf` loaded into JAX, and back (issue 43 item 3).

The checkpoints are the MLX loader's fixtures (backend_mlx/tests/data/hf_attnres/{block,full,
window}: tiny random Llama models with GQA, RoPE at base 500000, SwiGLU and tied embeddings,
converted and saved by the real `attnres_torch.hf`, with torch's logits and greedy tokens;
written and drift-checked by backend_torch/tests/test_mlx_fixture.py).  `load_hf` must give
torch's logits within float32 rounding (twice torch's own distance from float64, which the
fixture records) and exactly torch's greedy tokens, unrolled and layer-scanned; the rows moved
or missing are refused; `save_hf` writes the checkpoint back bit for bit; mlx_saved (rows set in
MLX) gives MLX's logits, so all three frameworks place row r alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from attnres_jax.checkpoint_hf import (  # noqa: E402
    FORM,
    LlamaAttnRes,
    load_hf,
    load_rows,
    read_safetensors,
    save_hf,
    write_safetensors,
)
from flax import nnx  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "backend_mlx" / "tests" / "data" / "hf_attnres"
CASES = ("block", "full", "window")


def _expected(path: Path) -> dict:
    return json.loads((path / "expected.json").read_text())


def _tolerance(expected: dict) -> float:
    return 2 * expected["float32_error"] + 1e-6


def _run(model, prompt, n):
    """(the logits of `prompt` `[T, V]`, the n greedy tokens that continue it), without a KV
    cache: the sequence padded to its final length (causal: position i reads tokens <= i
    only), so one compiled forward serves the logits and every step."""
    run = jax.jit(lambda t: model(t)[0])
    ids = np.zeros(len(prompt) + n, np.int32)
    ids[:len(prompt)] = prompt
    logits = None
    for i in range(len(prompt), len(prompt) + n):
        out = np.asarray(run(jnp.asarray(ids[None])))
        logits = out[:len(prompt)] if logits is None else logits
        ids[i] = int(np.argmax(out[i - 1]))
    return logits, ids[len(prompt):].tolist()


@pytest.mark.parametrize("scan", [None, False], ids=["default", "unrolled"])
@pytest.mark.parametrize("case", CASES)
def test_load_hf_gives_torchs_logits_and_greedy_tokens(case, scan):
    want = _expected(DATA / case)
    model = load_hf(DATA / case, scan_layers=scan)
    assert isinstance(model, LlamaAttnRes)
    assert model.scan_layers == (case != "window" and scan is None)
    logits, tokens = _run(model, want["prompt"], len(want["greedy"]))
    err = float(np.abs(logits - np.asarray(want["logits"], np.float32)).max())
    assert err <= _tolerance(want), (case, err, want["float32_error"])
    assert tokens == want["greedy"]


def test_the_rows_matter_and_load_rows_gives_them_for_a_model_of_ones_own():
    want = _expected(DATA / "block")
    model = load_hf(DATA / "block")
    rc, rows, rest = load_rows(DATA / "block")
    assert rc == model.router.config and "model.embed_tokens.weight" in rest
    for name, value in rows.items():
        assert np.array_equal(np.asarray(model.router.params()[name]), value)
    prompt = jnp.asarray([want["prompt"]])
    uniform = np.asarray(jax.jit(lambda t: model(t, mix=0.0))(prompt)[0])  # PreNorm, same weights
    assert np.abs(uniform - np.asarray(want["logits"])).max() > 0.1


def test_mlx_saved_gives_mlxs_logits():
    """The checkpoint MLX's save_hf wrote with rows set in MLX: JAX reads row r where MLX put it."""
    want = _expected(DATA / "mlx_saved")
    model = load_hf(DATA / "mlx_saved")
    logits, tokens = _run(model, want["prompt"], len(want["greedy"]))
    assert np.abs(logits - np.asarray(want["logits"])).max() < 1e-4
    assert tokens == want["greedy"]


@pytest.mark.parametrize("case", ["block", "full"])
def test_save_hf_writes_back_torchs_checkpoint(case, tmp_path):
    model = load_hf(DATA / case)
    save_hf(model, tmp_path)
    got, ref = read_safetensors(tmp_path / "model.safetensors"), read_safetensors(DATA / case / "model.safetensors")
    assert sorted(got) == sorted(ref)
    for key in ref:
        assert got[key].dtype == ref[key].dtype and np.array_equal(got[key], ref[key]), key
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((DATA / case / "config.json").read_text())
    # new rows go back where torch reads them: load again, same logits
    rows = {k: np.asarray(v) * 0.5 for k, v in model.router.params().items()}
    model.router.load_params(rows)
    save_hf(model, tmp_path / "new")
    again = load_hf(tmp_path / "new", scan_layers=False)
    prompt = [1, 2, 3, 4, 5]
    np.testing.assert_allclose(_run(again, prompt, 1)[0], _run(model, prompt, 1)[0], rtol=0, atol=1e-5)


def test_safetensors_reader_and_writer_round_trip(tmp_path):
    import ml_dtypes

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, ml_dtypes.bfloat16),
               "c": np.array([1, -2], np.int64)}
    write_safetensors(tmp_path / "t.safetensors", tensors, {"format": "pt"})
    back = read_safetensors(tmp_path / "t.safetensors")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(DATA / case, dst)
    return dst


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path: Path, edit) -> None:
    weights = read_safetensors(path / "model.safetensors")
    edit(weights)
    write_safetensors(path / "model.safetensors", weights, {"format": "pt"})


def test_loads_that_would_drop_or_misplace_the_rows_are_refused(tmp_path):
    d = _copy("block", tmp_path)
    _edit_config(d, lambda c: c.pop("attnres"))
    with pytest.raises(ValueError, match="no 'attnres' entry but the weights hold 14 AttnRes"):
        load_hf(d)
    _edit_weights(d, lambda w: [w.pop(k) for k in list(w) if "attnres" in k])
    with pytest.raises(ValueError, match="no 'attnres' entry"):
        load_hf(d)
    d = _copy("window", tmp_path)
    _edit_weights(d, lambda w: w.pop("model.layers.2.attnres.row6.norm_weight"))
    with pytest.raises(ValueError, match=r"missing \['norm_weights row 6'\]"):
        load_hf(d)
    d = _copy("block", tmp_path / "m")  # MLX's ownership written with torch's names
    _edit_weights(d, lambda w: w.update({"model.layers.1.attnres.row2.query":
                                         w.pop("model.layers.0.attnres.row2.query")}))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1.attnres.row2.query'\]"):
        load_hf(d)
    d = _copy("full", tmp_path / "f")
    _edit_config(d, lambda c: c["attnres"].update(per_layer=True))
    with pytest.raises(ValueError, match="per_layer=True.*missing"):
        load_hf(d)
    d = _copy("block", tmp_path / "w")
    _edit_weights(d, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf(d)
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf(tmp_path)


def test_what_the_model_does_not_run_is_refused(tmp_path):
    d = _copy("block", tmp_path)
    olmo2 = [[["self_attn", "post_attention_layernorm"], "self_attn", None],
             [["mlp", "post_feedforward_layernorm"], "mlp", None]]
    cases = [
        (lambda c: c["attnres"].update(form=olmo2), "PreNorm layers only"),
        (lambda c: c["attnres"].update(base_model_type="gpt2"), "LlamaAttnRes runs"),
        (lambda c: c["attnres"]["config"].update(query="input"), "static queries"),
        (lambda c: c["rope_parameters"].update(rope_type="llama3", factor=8.0), "default RoPE only"),
        (lambda c: c.update(attention_bias=True), "no biases"),
        (lambda c: c["attnres"].pop("base_model_type"), "without the base model_type"),
    ]
    for edit, message in cases:
        shutil.rmtree(d)
        d = _copy("block", tmp_path)
        _edit_config(d, edit)
        with pytest.raises(ValueError, match=message):
            load_hf(d)
    with pytest.raises(ValueError, match="runs unrolled"):
        load_hf(DATA / "window", scan_layers=True)


def test_the_earlier_record_form_loads(tmp_path):
    d = _copy("block", tmp_path)

    def legacy(c):
        record = c["attnres"]
        assert record.pop("form") == FORM
        c["model_type"] = record.pop("base_model_type")
        record["layout"] = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]

    _edit_config(d, legacy)
    want = _expected(DATA / "block")
    logits, _ = _run(load_hf(d), want["prompt"], 1)
    assert np.abs(logits - np.asarray(want["logits"])).max() <= _tolerance(want)


def test_a_training_step_with_nnx_jit_and_the_optimizer():
    """The loaded model trains as any NNX model: one nnx.jit + nnx.Optimizer step, scanned."""
    optax = pytest.importorskip("optax")
    from flax import nnx

    model = load_hf(DATA / "block")
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    tokens = jnp.asarray([_expected(DATA / "block")["prompt"]])

    @nnx.jit
    def step(model, opt, t):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(t[:, :-1]), t[:, 1:]).mean()
        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    first = float(step(model, opt, tokens))
    assert np.isfinite(first) and float(step(model, opt, tokens)) < first


# -- the way back, checked by torch ------------------------------------------------------------------

def write_jax_saved(path: Path) -> None:
    """data/hf_attnres/jax_saved: the block model with new rows set in JAX (so torch can only
    match by placing them as JAX does), saved by save_hf, with JAX's logits and greedy tokens;
    backend_torch/tests/test_mlx_fixture.py loads it with attnres_torch.hf.from_pretrained.  The
    rows' seed is the first from 8 on whose greedy continuation has 3 distinct tokens or more
    and no top-2 logits (prompt and steps) within 1e-3."""
    src = _expected(DATA / "block")
    prompt, n = src["prompt"], len(src["greedy"])
    model = load_hf(DATA / "block")
    shapes = {k: v.shape for k, v in model.router.params().items()}
    fwd = nnx.jit(lambda m, t: m(t)[0])  # one compile: the rows are state, not constants
    for seed in range(8, 208):
        rng = np.random.default_rng(seed)
        model.router.load_params({
            "queries": (0.7 * rng.standard_normal(shapes["queries"])).astype(np.float32),
            "norm_weights": (1 + 0.2 * rng.standard_normal(shapes["norm_weights"])).astype(np.float32)})
        ids = np.zeros(len(prompt) + n, np.int32)
        ids[:len(prompt)] = prompt
        for i in range(len(prompt), len(prompt) + n):
            ids[i] = int(np.argmax(np.asarray(fwd(model, jnp.asarray(ids[None])))[i - 1]))
        full = np.asarray(fwd(model, jnp.asarray(ids[None])))
        logits, tokens = full[:len(prompt)], ids[len(prompt):].tolist()
        top2 = np.sort(full[:-1], axis=-1)[:, -2:]
        if len(set(tokens)) >= 3 and float((top2[:, 1] - top2[:, 0]).min()) > 1e-3:
            break
    else:
        raise AssertionError("no seed in 8..207 gives a non-degenerate greedy continuation")
    save_hf(model, path)
    expected = {"from": "block", "seed": seed, "prompt": prompt, "logits": logits.tolist(), "greedy": tokens,
                "generator": "backend_jax/tests/test_checkpoint_hf.py"}
    (path / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def test_the_committed_jax_saved_checkpoint_is_what_save_hf_writes(tmp_path):
    write_jax_saved(tmp_path)
    committed = DATA / "jax_saved"
    hint = "data/hf_attnres/jax_saved drifted: run python backend_jax/tests/test_checkpoint_hf.py"
    assert (tmp_path / "config.json").read_text() == (committed / "config.json").read_text(), hint
    got, ref = read_safetensors(tmp_path / "model.safetensors"), read_safetensors(committed / "model.safetensors")
    assert sorted(got) == sorted(ref), hint
    for key in ref:
        assert np.array_equal(got[key], ref[key]), (key, hint)
    new, old = _expected(tmp_path), _expected(committed)
    assert (new["prompt"], new["greedy"]) == (old["prompt"], old["greedy"]), hint
    np.testing.assert_allclose(new["logits"], old["logits"], rtol=0, atol=1e-4, err_msg=hint)


if __name__ == "__main__":
    import sys

    write_jax_saved(DATA / "jax_saved")
    print(f"wrote {DATA / 'jax_saved'}", file=sys.stderr)
