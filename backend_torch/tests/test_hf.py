"""`attnres_torch.hf` against the real `transformers` (pinned in noxfile.py): tiny configs, random
weights, nothing downloaded.  Every family converts by structure; the converted model equals a
float64 hand-written stream loop over the same sublayers (value and every gradient); and what a
training script does with an HF model keeps working: generate with the KV cache, HF gradient
checkpointing, save_pretrained / from_pretrained, torch.save, deepcopy, output_hidden_states,
Recompute / Offload, the Trainer, PEFT LoRA, torch.compile, autocast, FSDP2 per decoder layer."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os

import numpy as np
import pytest
import torch
from attnres_core import checkpoint
from attnres_core.config import ResidualConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")

from attnres_torch import DepthRouter, hf  # noqa: E402
from attnres_torch.memory import Offload, Recompute, SavedBytes  # noqa: E402
from huggingface_hub.errors import StrictDataclassFieldValidationError  # noqa: E402

VOCAB, T = 64, 6


def _config(family: str):
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "llama":
        return t.LlamaForCausalLM, t.LlamaConfig(**common)
    if family == "mistral":
        return t.MistralForCausalLM, t.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return t.Qwen2ForCausalLM, t.Qwen2Config(**common)
    if family == "qwen3":
        return t.Qwen3ForCausalLM, t.Qwen3Config(**common, head_dim=8)
    if family == "gpt2":
        return t.GPT2LMHeadModel, t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4,
                                               n_positions=64, bos_token_id=0, eos_token_id=1,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    raise AssertionError(family)


def _model(family: str, seed: int = 0):
    cls, cfg = _config(family)
    torch.manual_seed(seed)
    return cls(cfg).eval()


def _randomize_attnres(model, seed: int = 1) -> None:
    """Non-zero AttnRes rows (zero queries make every read a plain mean)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "attnres" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.7)


def _ids(batch: int = 2, seed: int = 3):
    return torch.randint(3, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def _decoder(model):
    """(owner, layers, (norm1, fn1, norm2, fn2)) of the PreNorm families tested here."""
    owner, name, layers = hf.find_decoder(model)
    form = hf._static_form(layers[0])
    (c1, f1, m1), (c2, f2, m2) = form
    assert len(c1) == len(c2) == 2 and c1[1] == f1 and c2[1] == f2 and m1 is None, form
    return owner, layers, (c1[0], f1, c2[0], f2)


def _final_norm(owner):
    """The decoder's final norm (`norm` in Llama-style models, `ln_f` in GPT-2)."""
    return getattr(owner, "norm", None) or getattr(owner, "ln_f")


def _train_step(model, ids, ctx=None):
    """One forward + backward of the LM loss: (bytes autograd saved, gradients by name)."""
    model.zero_grad()
    with SavedBytes() as acct, (ctx if ctx is not None else contextlib.nullcontext()):
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return acct.bytes, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FAMILIES = list(hf.TESTED_FAMILIES)
SCHEMES = {"full": ResidualConfig(kind="full"), "block": ResidualConfig(kind="block", block_size=2),
           "window": ResidualConfig.variant("window")}


class _Recorder:
    """The arguments the unconverted model passes to every sublayer module (masks, rotary
    embeddings) and the input of its first layer (the embedding v_0)."""

    def __init__(self, model):
        self.calls, self.embedding, self.handles = {}, None, []
        _, layers, (n1, f1, n2, f2) = _decoder(model)
        for i, layer in enumerate(layers):
            for j, fn in enumerate((f1, f2)):
                self.handles.append(getattr(layer, fn).register_forward_pre_hook(
                    lambda mod, args, kwargs, key=(i, j): self.calls.__setitem__(key, (args, kwargs)),
                    with_kwargs=True))
        self.handles.append(layers[0].register_forward_pre_hook(
            lambda mod, args, kwargs: setattr(self, "embedding",
                                              args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))

    def remove(self):
        for h in self.handles:
            h.remove()


def _oracle_logits(plain64, router64, ids):
    """The hand-written loop a user would otherwise copy: DepthRouter over the model's own
    `fn(norm(h))` sublayers, with the sublayer arguments the model itself passes, in float64."""
    rec = _Recorder(plain64)
    plain64(ids, use_cache=False)  # records masks / rotary embeddings and v_0 (with its graph)
    rec.remove()
    owner, layers, (n1, f1, n2, f2) = _decoder(plain64)

    def sublayer(i, j, norm, fn):
        args, kwargs = rec.calls[(i, j)]
        module, norm = getattr(layers[i], fn), getattr(layers[i], norm)

        def f(h):
            x = norm(h)
            out = module(x, *args[1:], **kwargs) if args else module(**dict(kwargs, hidden_states=x))
            return out[0] if isinstance(out, tuple) else out
        return f

    subs = [sublayer(i, j, n, f) for i in range(len(layers))
            for j, (n, f) in enumerate(((n1, f1), (n2, f2)))]
    h = router64(rec.embedding, subs)
    final = _final_norm(owner)
    return plain64.get_output_embeddings()(final(h))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_equals_the_float64_hand_written_loop_value_and_every_gradient(family, scheme):
    model = _model(family)
    plain64 = copy.deepcopy(model).double()
    hf.convert(model, SCHEMES[scheme])
    _randomize_attnres(model)
    model.train()  # direct schedule; dropout is 0 in these configs
    plain64.train()
    ids = _ids()
    logits = model(ids, use_cache=False).logits
    router64 = DepthRouter(SCHEMES[scheme], 2 * len(_decoder(model)[1]), 32).double()
    with torch.no_grad():
        for name, value in hf.router(model).stacked().items():
            getattr(router64, name).copy_(value.double())
    ref = _oracle_logits(plain64, router64, ids)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    np.testing.assert_allclose(logits.detach().double().numpy(), ref.detach().numpy(), rtol=2e-4, atol=2e-5)
    params = [(n, p) for n, p in model.named_parameters() if "attnres" not in n]
    grads = torch.autograd.grad(logits, [p for _, p in params], cot.float(), allow_unused=True)
    ref_params = dict(plain64.named_parameters())
    ref_grads = torch.autograd.grad(ref, [ref_params[n] for n, _ in params], cot, allow_unused=True)
    checked = 0
    for (name, _), g, r in zip(params, grads, ref_grads):
        if r is None:
            assert g is None or not g.any(), name
            continue
        scale = float(r.abs().max()) + 1e-6
        assert float((g.double() - r).abs().max()) <= 2e-4 * scale + 1e-6, name
        checked += 1
    assert checked >= 10
    # and the AttnRes rows' gradients against the stacked router's
    rt = hf.router(model)
    shapes = SCHEMES[scheme].param_shapes(rt.num_layers, rt.dim)
    rows = [(name, r, rt.row_parameter(name, r)) for name, shape in shapes.items() for r in range(shape[0])]
    logits = model(ids, use_cache=False).logits
    got = torch.autograd.grad(logits, [p for _, _, p in rows], cot.float())
    ref = _oracle_logits(plain64, router64, ids)
    want = dict(zip(shapes, torch.autograd.grad(ref, [getattr(router64, n) for n in shapes], cot)))
    for (name, r, _), g in zip(rows, got):
        w = want[name][r]
        scale = float(w.abs().max()) + 1e-6
        assert float((g.double() - w).abs().max()) <= 2e-4 * scale + 1e-6, (name, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_mix_zero_is_the_unconverted_model_bitwise_and_init_differs_only_by_eps(family):
    model = _model(family)
    plain = copy.deepcopy(model)
    hf.convert(model, ResidualConfig(kind="full"))
    ids = _ids()
    with torch.no_grad():
        want = plain(ids).logits
        with hf.residual_inputs(model, mix=0.0):
            assert torch.equal(model(ids).logits, want)
        at_init = model(ids).logits
    assert not torch.equal(at_init, want)  # the mean of N sources is not their sum (docs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", ["full", "block"])
def test_generate_with_the_kv_cache_equals_the_no_cache_loop(family, scheme):
    model = _model(family)
    hf.convert(model, SCHEMES[scheme])
    _randomize_attnres(model)
    ids = _ids(batch=1)
    model.generation_config.eos_token_id = None  # six tokens each way, no early stop
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        tokens = ids
        for _ in range(6):  # the no-cache loop: the whole sequence every step
            nxt = model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    assert torch.equal(cached, tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_gradient_checkpointing_recomputes_the_sublayers_and_keeps_the_gradients(family):
    model = _model(family)
    plain = copy.deepcopy(model).train()
    hf.convert(model, SCHEMES["block"])
    _randomize_attnres(model)
    model.train()
    ids = _ids()
    bytes_plain, grads_plain = _train_step(model, ids)
    prenorm_plain, _ = _train_step(plain, ids)
    model.activation_checkpointing_enable()  # transformers 5.24's name of gradient_checkpointing_enable
    plain.activation_checkpointing_enable()
    bytes_ckpt, grads_ckpt = _train_step(model, ids)
    prenorm_ckpt, _ = _train_step(plain, ids)
    assert grads_plain.keys() == grads_ckpt.keys()
    assert all(torch.equal(grads_plain[k], grads_ckpt[k]) for k in grads_plain)
    assert bytes_ckpt < 0.5 * bytes_plain, (bytes_ckpt, bytes_plain)
    # what stays beyond PreNorm's checkpointing: the sources and the boundary reads' outputs
    assert bytes_ckpt < prenorm_ckpt + (bytes_plain - prenorm_plain) + bytes_plain // 4
    model.activation_checkpointing_disable()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant"):
        model(ids, labels=ids, use_cache=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trip_is_bitwise_and_the_plain_class_refuses_it(family, tmp_path):
    model = _model(family)
    cls, _ = _config(family)
    hf.convert(model, SCHEMES["block"])
    _randomize_attnres(model)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(cls, str(tmp_path)).eval()
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(loaded(ids).logits, want)
    # The family's own class reads config.json whatever its model_type: the guard stops it before
    # any weight is read (it would build the PreNorm model and drop the rows with a warning).
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["use_cache"] == checkpoint.GUARD_TEXT
    assert saved["attnres"]["guard"] == {"field": "use_cache", "value": True}
    with pytest.raises(StrictDataclassFieldValidationError, match="use_cache.*Attention Residuals checkpoint"):
        cls.from_pretrained(str(tmp_path))
    assert loaded.config.use_cache is True and "guard" not in loaded.config.attnres
    assert loaded.generation_config.use_cache is True
    assert model.config.attnres["config"]["kind"] == "block"
    # a config that names the scheme with the rows gone
    model.save_pretrained(tmp_path / "plain", state_dict={k: v for k, v in model.state_dict().items()
                                                          if "attnres" not in k})
    with pytest.raises(ValueError, match="lacks 14 AttnRes tensors"):
        hf.from_pretrained(cls, str(tmp_path / "plain"))
    _model(family).save_pretrained(tmp_path / "prenorm")
    with pytest.raises(ValueError, match="no 'attnres' entry"):
        hf.from_pretrained(cls, str(tmp_path / "prenorm"))


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_save_and_deepcopy_of_a_converted_model(family):
    model = _model(family)
    hf.convert(model, SCHEMES["full"])
    _randomize_attnres(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(model)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(restored(ids).logits, want)
        assert torch.equal(twin(ids).logits, want)
        with torch.no_grad():  # the copy owns its rows: changing them leaves the original alone
            for n, p in twin.named_parameters():
                if "attnres" in n:
                    p.add_(1.0)
        assert not torch.equal(twin(ids).logits, want)
        assert torch.equal(model(ids).logits, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_hidden_states_and_layer_hooks_see_the_attnres_states(family):
    model = _model(family)
    hf.convert(model, SCHEMES["full"])
    _randomize_attnres(model)
    _, layers, _ = _decoder(model)
    seen = []
    for layer in layers:
        layer.register_forward_hook(lambda mod, args, out: seen.append(out))
    out = model(_ids(), output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == len(layers) + 1 and len(seen) == len(layers)
    for i in range(len(layers) - 1):  # layer i's output: the next layer's depth-attended input
        assert torch.equal(hs[i + 1], seen[i])
    owner = _decoder(model)[0]
    final = _final_norm(owner)
    assert torch.equal(hs[-1], final(seen[-1]))  # HF reports the last one after the final norm


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_recompute_and_offload_accept_a_converted_model(mode):
    model = _model("llama")
    hf.convert(model, SCHEMES["block"])
    _randomize_attnres(model)
    model.train()
    ids = _ids()
    base_bytes, base = _train_step(model, ids)
    ctx = Recompute(model) if mode == "recompute" else Offload(model, window=1)
    got_bytes, got = _train_step(model, ids, ctx)
    assert base.keys() == got.keys() and all(torch.equal(base[k], got[k]) for k in base)
    if mode == "recompute":
        assert got_bytes < 0.75 * base_bytes, (got_bytes, base_bytes)
    else:
        assert ctx.offloaded_bytes > 0


def test_trainer_trains_the_router_rows(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = _model("llama")
    hf.convert(model, SCHEMES["block"])
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "attnres" in n}
    data = [{"input_ids": ids, "labels": ids} for ids in _ids(batch=8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True)
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert np.isfinite(result.training_loss)
    moved = {n for n, p in model.named_parameters() if "attnres" in n and not torch.equal(p, before[n])}
    # row 0 reads v_0 alone: its softmax is constant, so its gradient is exactly zero (spec C6)
    assert moved == {n for n in before if ".row0." not in n}


def test_peft_lora_on_the_sublayers_leaves_the_conversion_intact():
    peft = pytest.importorskip("peft", reason="peft is installed by tests-torch")
    model = _model("llama")
    hf.convert(model, SCHEMES["block"])
    _randomize_attnres(model)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    with torch.no_grad():
        assert torch.equal(lora(input_ids=ids).logits, want)  # LoRA's B starts at zero
    lora.train()
    loss = lora(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    lora_grads = [p.grad for n, p in lora.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None for g in lora_grads) and any(g.any() for g in lora_grads)


@pytest.mark.parametrize("scheme", ["full", "block"])
def test_torch_compile_has_no_graph_break(scheme):
    import torch._dynamo as dynamo

    model = _model("llama")
    hf.convert(model, SCHEMES[scheme])
    _randomize_attnres(model)
    model.train()
    ids = _ids()
    dynamo.reset()
    explained = dynamo.explain(model)(ids, use_cache=False)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        np.testing.assert_allclose(compiled(ids, use_cache=False).logits.numpy(),
                                   model(ids, use_cache=False).logits.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_autocast_bf16_forward_and_backward(family):
    model = _model(family)
    hf.convert(model, SCHEMES["block"])
    _randomize_attnres(model)
    model.train()
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss.detach())
    rows = [p.grad for n, p in model.named_parameters() if "attnres" in n]
    assert all(g is not None and torch.isfinite(g).all() for g in rows) and any(g.any() for g in rows)
    with torch.no_grad():  # close to the fp32 model
        ref = model(ids, labels=ids, use_cache=False).loss
    assert abs(loss.item() - ref.item()) < 0.05 * abs(ref.item())


def test_unknown_structures_and_bad_arguments_get_clear_errors():
    t = transformers
    phi = t.PhiForCausalLM(t.PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4))
    with pytest.raises(ValueError, match="PhiDecoderLayer: child modules called more than once"):
        hf.convert(phi, SCHEMES["full"])  # the refusal names the calls found
    assert not hf.is_converted(phi) and not any("attnres" in n for n, _ in phi.named_parameters())
    model = _model("llama")
    with pytest.raises(TypeError, match="config"):
        hf.convert(model, {"kind": "full"})
    with pytest.raises(ValueError, match="fuse_out_norm"):
        hf.convert(model, ResidualConfig(kind="full", fuse_out_norm=True))
    with pytest.raises(ValueError, match="per_layer"):
        hf.convert(model, ResidualConfig.variant("shared_queries"), per_layer=True)
    hf.convert(model, SCHEMES["full"])
    with pytest.raises(ValueError, match="already converted"):
        hf.convert(model, SCHEMES["full"])
    with pytest.raises(ValueError, match="not converted"):
        hf.router(_model("gpt2"))


def test_shared_parameter_schemes_use_one_stacked_router_on_the_base_model():
    model = _model("llama")
    hf.convert(model, ResidualConfig.variant("low_rank_keys"))
    assert isinstance(model.model.attnres_router, DepthRouter)
    assert not any("layers" in n and "attnres" in n for n, _ in model.named_parameters())
    loss = model(_ids(), labels=_ids(), use_cache=False).loss
    loss.backward()
    assert all(p.grad is not None for p in model.model.attnres_router.parameters())


# -- FSDP2 per decoder layer on gloo, 2 ranks -------------------------------------------------------

def _fsdp_model():
    model = _model("llama")
    hf.convert(model, SCHEMES["block"])
    _randomize_attnres(model)
    return model.train()


def _fsdp_rank(rank, world):
    from torch.distributed.fsdp import fully_shard

    model = _fsdp_model()
    for layer in model.model.layers:  # the standard recipe: each decoder layer, then the root
        fully_shard(layer)
    fully_shard(model)
    ids = _ids(batch=4)[2 * rank: 2 * rank + 2]
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    # HF checkpointing under FSDP2: the layer's hooks (FSDP2's and ours) stay outside the
    # recomputation; the gradients are the plain step's, bitwise
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(ids, labels=ids, use_cache=False).loss.backward()
    same = all(np.array_equal(grads[n], p.grad.full_tensor().numpy()) for n, p in model.named_parameters())
    return float(loss), grads, same


def test_fsdp2_fully_shard_per_decoder_layer_equals_one_process():
    from attnres_torch.distributed.launch import run_local

    results = run_local(_fsdp_rank, 2, timeout=300)
    model = _fsdp_model()
    ids = _ids(batch=4)
    losses = []
    for r in range(2):  # one process, the same two micro-batches, the mean of their gradients
        loss = model(ids[2 * r: 2 * r + 2], labels=ids[2 * r: 2 * r + 2], use_cache=False).loss
        (loss / 2).backward()
        losses.append(float(loss))
    assert [r[0] for r in results] == pytest.approx(losses, rel=1e-6)
    assert all(r[2] for r in results)  # checkpointed == plain on every rank
    grads = results[0][1]
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    assert any("attnres" in n for n in grads)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)


# -- the user page: its code blocks run unchanged and print what they say ---------------------------

from pathlib import Path  # noqa: E402

from attnres_conformance.doc_blocks import make_tests  # noqa: E402

_PAGE = Path(__file__).resolve().parents[2] / "docs" / "hf-fsdp-autocast.md"
test_hf_page_block_runs_and_prints_what_it_says, test_hf_page_has_blocks = make_tests(
    _PAGE, "attnres_torch", min_blocks=5)
