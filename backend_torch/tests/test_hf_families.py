"""Families beyond PreNorm convert exactly or are refused at convert (issue 45 items 1, 3, 4):
tiny configs of the pinned transformers, random weights, mix=0 against the unconverted model
bitwise; a converted checkpoint loads with the plain AutoModelForCausalLM, bitwise."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from attnres_core.config import ResidualConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
t = pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")

from attnres_torch import hf  # noqa: E402

C = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
FAMILIES = {
    "granite": (lambda: t.GraniteForCausalLM(t.GraniteConfig(**C, residual_multiplier=0.5)),
                "PreNorm with residual multiplier"),
    "olmo2": (lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**C)), "branch-output norm"),
    "gemma2": (lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**C)), "sandwich norms"),
    "cohere": (lambda: t.CohereForCausalLM(t.CohereConfig(**C)), None),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_converts_bitwise_at_mix_zero_or_is_refused_at_convert(family):
    build, form = FAMILIES[family]
    torch.manual_seed(0)
    model = build().eval()
    plain = copy.deepcopy(model)
    if form is None:
        with pytest.raises(ValueError, match="attention and MLP in parallel"):
            hf.convert(model, ResidualConfig(kind="full"))
        assert not hf.is_converted(model)
        return
    hf.convert(model, ResidualConfig(kind="full"))
    assert hf.layer_form(model).startswith(form)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(ids).logits
        with hf.residual_inputs(model, mix=0.0):
            assert torch.equal(model(ids).logits, want)


def test_plain_auto_from_pretrained_loads_the_converted_model_bitwise(tmp_path):
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(t.LlamaConfig(**C)).eval()
    hf.convert(model, ResidualConfig(kind="block", block_size=2))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "attnres" in n:
                p.normal_()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    auto = t.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ours = hf.from_pretrained(t.LlamaForCausalLM, str(tmp_path))
    assert hf.is_converted(auto) and isinstance(auto, t.LlamaForCausalLM)
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(auto(ids).logits, want)
        assert torch.equal(ours(ids).logits, want)
