"""torch.compile of converted models gives the eager result in any order of compilation in one
process (issue 45 item 8).  Dynamo does not guard on module hooks (`skip_nnmodule_hook_guards`),
so a graph compiled for an unconverted model of the same class was reused for a converted one
and computed PreNorm (for a torchtitan-style model: 2.3 off, compiled in 0.8 s); `convert` now
gives each converted layer an instance `forward` (its class's own), which dynamo does guard on.

The `aot_eager` backend keeps the compile cheap; the guards and the graph reuse are dynamo's,
the same under inductor."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from attnres_core.config import ResidualConfig
from attnres_torch import hf
from test_hf_containers import Transformer, _ids

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _randomize(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "attnres" in n:
                p.copy_(3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model


def _titan(convert):
    torch.manual_seed(0)
    model = Transformer().eval()
    return _randomize(hf.convert(model, ResidualConfig(kind="full"))) if convert else model


@pytest.mark.parametrize("order", ["plain_first", "converted_first"])
def test_compiled_forward_equals_eager_in_any_compile_order(order):
    torch._dynamo.reset()
    ids = _ids()
    for convert in ((False, True) if order == "plain_first" else (True, False)):
        model = _titan(convert)
        with torch.no_grad():
            eager = model(ids)
            model.forward = torch.compile(model.forward, backend="aot_eager")
            assert torch.equal(model(ids), eager), ("converted" if convert else "plain", order)


def test_a_model_compiled_before_its_conversion_recompiles():
    torch._dynamo.reset()
    ids = _ids()
    model = _titan(False)
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        compiled(ids)
        _randomize(hf.convert(model, ResidualConfig(kind="full")))
        assert torch.equal(compiled(ids), model(ids))
    assert all("forward" in layer.__dict__ for layer in hf.decoder_layers(model))
    clone = copy.deepcopy(model)  # the instance forward follows the copy
    assert all(layer.forward.__self__ is layer for layer in hf.decoder_layers(clone))


def test_a_refused_conversion_leaves_no_instance_forward():
    torch.manual_seed(0)
    model = Transformer(order=[1, 0, 2])
    with pytest.raises(ValueError):
        hf.convert(model, ResidualConfig(kind="full"))
    assert not any("forward" in layer.__dict__ for layer in model.layers.values())


def test_compiled_static_cache_generation_of_a_converted_llama_after_an_unconverted_one():
    t = pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")
    torch._dynamo.reset()
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    tokens = {}
    for convert in (False, True):  # the order: the unconverted model compiled first
        torch.manual_seed(0)
        model = t.LlamaForCausalLM(t.LlamaConfig(**config)).eval()
        if convert:
            _randomize(hf.convert(model, ResidualConfig(kind="full")))

        def generate():
            return model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                  cache_implementation="static")

        eager = generate()
        model.forward = torch.compile(model.forward, backend="aot_eager")
        assert torch.equal(generate(), eager), "converted" if convert else "plain"
        tokens[convert] = eager
    assert not torch.equal(tokens[False], tokens[True])  # the two models differ: the test can tell
