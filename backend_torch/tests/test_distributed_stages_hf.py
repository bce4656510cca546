"""A Hugging Face Llama converted by `attnres_torch.hf.convert`, cut by `split_hf` into stock
`torch.distributed.pipelining` stages (`attnres_torch.distributed.hf_stages`): on a local gloo
world of 2 CPU processes, `ScheduleGPipe`, `Schedule1F1B` (one stage per rank) and
`ScheduleInterleaved1F1B` (two per rank), Block (S = 3: cuts inside and on block boundaries) and
Full AttnRes, all in one world.  The losses equal the unsplit converted model's and every parameter
gradient (embedding, layers, AttnRes rows, final norm, lm_head) its mean over the microbatches,
bitwise (computed in one CPU thread, as the ranks compute: with two, a matmul rounds otherwise).  In one process the chunks give the model's logits and
gradients bitwise (also under HF gradient checkpointing) for each supported family: Llama,
Mistral (a sliding window shorter than the sequence), Qwen2 and Qwen3 (sliding layers from
max_window_layers on: per-layer masks).  split_hf's probe check refuses chunks that do not
reproduce the model (a wrong mask).  Tied embeddings, unconverted or other models, stacked
routers, padding masks and M10 per-call inputs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from _helpers import stock_schedule_step  # noqa: E402
from attnres_torch import ResidualConfig, hf  # noqa: E402
from attnres_torch.distributed import hf_stages, run_local, split_hf  # noqa: E402
from transformers import (  # noqa: E402
    ArceeConfig,
    ArceeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB, M = 64, 4  # vocabulary, microbatches (2 sequences each)
CONFIGS = {"block": ResidualConfig(kind="block", block_size=3), "full": ResidualConfig(kind="full")}
# decoder layers per chunk (4 layers, L = 8 sublayers): one chunk per rank, and two per rank
LAYOUTS = {"gpipe": [2, 2], "1f1b": [2, 2], "interleaved": [1, 1, 1, 1]}


# the supported families (tiny, random weights); windows of 3 tokens, shorter than the 5-token
# sequences (and split_hf's 8-token probe), so the sliding masks differ from the causal one
SLIDING = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2}  # layers 2, 3 slide
FAMILIES = {"llama": (LlamaForCausalLM, LlamaConfig, {}),
            "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 3}),
            "qwen2": (Qwen2ForCausalLM, Qwen2Config, SLIDING),
            "qwen3": (Qwen3ForCausalLM, Qwen3Config, {**SLIDING, "head_dim": 8})}
MASKS = {"llama": ["full_attention"] * 4, "mistral": ["sliding_attention"] * 4,
         "qwen2": ["full_attention"] * 2 + ["sliding_attention"] * 2}
MASKS["qwen3"] = MASKS["qwen2"]


def _llama(tied=False, cls=None, family="llama"):
    torch.manual_seed(0)
    model_cls, config_cls, extra = FAMILIES[family]
    return (cls or model_cls)(config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, **extra))


def _model(kind, **kw):
    model = hf.convert(_llama(**kw), CONFIGS[kind])
    with torch.no_grad():  # trained-looking rows: the depth weights are not uniform
        for name, p in model.named_parameters():
            if ".attnres." in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.train()


def _data():
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (2 * M, 5), generator=gen),
            torch.randint(0, VOCAB, (2 * M, 5), generator=gen))


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _rank(rank, world):
    tokens, target = _data()
    return {(kind, name): stock_schedule_step(rank, split_hf(_model(kind), sizes), name, M, tokens,
                                              target, _loss)
            for kind in CONFIGS for name, sizes in LAYOUTS.items()}


def test_stock_schedules_equal_the_unsplit_model():
    results = run_local(_rank, 2, timeout=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_local's ranks: a CPU matmul's rounding may follow the threads
    try:
        _compare(results)
    finally:
        torch.set_num_threads(threads)


def _compare(results):
    tokens, target = _data()
    for kind in CONFIGS:
        model = _model(kind)
        losses = []
        for m in range(M):  # the unsplit converted model: the mean loss over the microbatches
            loss = _loss(model(tokens[2 * m: 2 * m + 2]).logits, target[2 * m: 2 * m + 2])
            loss.backward()
            losses.append(loss.item())
        assert all(p.grad is not None for p in model.parameters())
        for p in model.parameters():  # divided once at the end, as the schedules' scale_grads
            p.grad /= M
        for name, sizes in LAYOUTS.items():
            chunks = split_hf(model, sizes)
            want = {(k, n): p.grad.numpy() for k, c in enumerate(chunks) for n, p in c.named_parameters()}
            got = {**results[0][kind, name][1], **results[1][kind, name][1]}
            assert got.keys() == want.keys(), (kind, name)
            assert sum(p.numel() for c in chunks for p in c.parameters()) == \
                sum(p.numel() for p in model.parameters())  # every parameter in one chunk
            for key, g in want.items():  # bitwise (the same CPU thread count)
                assert np.array_equal(got[key], g), (kind, name, key, float(np.max(np.abs(got[key] - g))))
            last = (len(sizes) - 1) % 2  # the rank holding the last stage reports the losses
            assert results[last][kind, name][0] == losses, (kind, name)  # bitwise
            assert results[1 - last][kind, name][0] == []



# Llama with both kinds; the other families' masks with Block (cuts inside and on block
# boundaries), and Qwen2's per-layer masks with Full too (the added test time kept small)
@pytest.mark.parametrize("kind,family", [("block", "llama"), ("full", "llama"), ("block", "mistral"),
                                         ("block", "qwen2"), ("full", "qwen2"), ("block", "qwen3")])
def test_chunks_in_one_process_equal_the_model(kind, family):
    """The chunks in sequence: the logits and every gradient equal the model's bitwise, for
    cuts inside and on block boundaries; under HF gradient checkpointing too; each family's
    layers get the masks its own model forward gives them."""
    model = _model(kind, family=family)
    # split_hf's probe check passes (the default verify=True); the splits below skip it (time)
    assert [t for c in split_hf(model, [1, 2, 1]) for t in c.mask_types] == MASKS[family]
    tokens = _data()[0][:3]
    cot = torch.randn(3, 5, VOCAB)
    want = model(tokens).logits
    (want * cot).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for sizes, checkpointing in [([1, 2, 1], False), ([1, 1, 1, 1], True), ([4], False)]:
        model.zero_grad()
        if checkpointing:
            model.activation_checkpointing_enable()  # transformers 5.24's gradient_checkpointing_enable
            assert model.model.layers[0].gradient_checkpointing
        x = (tokens,)
        for c in split_hf(model, sizes, verify=False):
            x = c(*x)
            x = x if isinstance(x, tuple) else (x,)
        assert torch.equal(x[0], want), sizes
        (x[0] * cot).sum().backward()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, grads[n]), (sizes, n)
    chunks = split_hf(model, [2, 2], verify=False)
    assert len(chunks[0](tokens)) == (3 if kind == "block" else 5) + 1  # carried + hidden state
    assert [n for n, _ in chunks[1].named_parameters()][-2:] == ["norm.weight", "lm_head.weight"]


def test_tied_embeddings_are_refused():
    model = _model("block", tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True.*untie it before splitting"):
        split_hf(model, [2, 2])
    assert len(split_hf(model, [4])) == 1  # one chunk holds both: nothing is shared between stages
    # untied as the message says: the chunks then run and split
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    tokens = _data()[0][:2]
    x = split_hf(model, [2, 2])[0](tokens)
    assert torch.equal(split_hf(model, [2, 2])[1](*x), model(tokens).logits)


def test_unsupported_models_and_calls_are_refused():
    with pytest.raises(ValueError, match="not converted"):
        split_hf(_llama(), [2, 2])
    supported = r"supported classes \(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM\)"
    with pytest.raises(ValueError, match=supported + ", got a LlamaModel"):
        split_hf(hf.convert(_llama(cls=LlamaModel), CONFIGS["full"]), [2, 2])
    arcee = ArceeForCausalLM(ArceeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         bos_token_id=0, eos_token_id=1))  # a Llama-like family: not in the table
    with pytest.raises(ValueError, match=supported + ", got a ArceeForCausalLM"):
        split_hf(hf.convert(arcee, CONFIGS["full"]), [1, 1])
    with pytest.raises(TypeError, match="verify: expected True or False"):
        split_hf(_model("full"), [2, 2], verify="yes")
    with pytest.raises(ValueError, match="Block or Full"):
        split_hf(hf.convert(_llama(), ResidualConfig(kind="window", window=2)), [2, 2])
    with pytest.raises(ValueError, match="per_layer=False"):
        split_hf(hf.convert(_llama(), CONFIGS["block"], per_layer=False), [2, 2])
    model = _model("full")
    with pytest.raises(ValueError, match=r"summing to the 4 decoder layers"):
        split_hf(model, [2, 1])
    chunks = split_hf(model, [2, 2])
    tokens = _data()[0][:2]
    with pytest.raises(ValueError, match="padding is not supported"):
        chunks[0](tokens, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]))
    x = chunks[0](tokens, attention_mask=torch.ones(2, 5, dtype=torch.long))  # no padding: fine
    with pytest.raises(ValueError, match="resumes from 6 tensors"):
        chunks[1](*x[1:])
    with hf.residual_inputs(model, mix=0.5), pytest.raises(ValueError, match="not carried across"):
        chunks[1](*x)
    assert torch.equal(chunks[1](*x), model(tokens).logits)  # the state was left clean


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_the_probe_check_refuses_a_wrong_mask(family, monkeypatch):
    """split_hf runs the chunks on a probe batch against the model: chunks that give every layer
    the full causal mask (not the family's sliding ones) are refused; the model's mode, schedule
    and stream are restored; verify=False skips the check (and the chunks then differ)."""
    model = _model("block", family=family)
    router = hf.router(model)
    real = hf_stages._causal_mask
    monkeypatch.setattr(hf_stages, "_causal_mask",
                        lambda config, h, position_ids, kind="full_attention": real(config, h, position_ids))
    name = type(model).__name__
    with pytest.raises(ValueError, match=rf"chunks of the converted {name} do not reproduce the unsplit "
                                         r"model: their logits differ by \S+ \(max abs.* 1 x 8 tokens"):
        split_hf(model, [2, 2])
    state = hf._state(model)
    assert model.training and router.schedule is None and state.stream is None and state.mix is None
    tokens = _data()[0][:2]
    chunks = split_hf(model, [2, 2], verify=False)
    assert not torch.equal(chunks[1](*chunks[0](tokens)), model(tokens).logits)
    monkeypatch.undo()
    chunks = split_hf(model, [2, 2])  # the family's masks: accepted, and equal
    with hf.residual_inputs(model, mix=0.5):  # the probe runs without the M10 inputs (restored)
        split_hf(model, [2, 2])
        assert hf._state(model).mix == 0.5
    assert torch.equal(chunks[1](*chunks[0](tokens)), model(tokens).logits)
