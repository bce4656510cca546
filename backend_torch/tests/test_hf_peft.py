"""PEFT on a converted model (issue 45 item 2), with the pinned peft: the documented route
`LoraConfig(..., modules_to_save=hf.peft_modules_to_save(model))` trains the AttnRes rows
(non-zero gradients, values moved by an optimizer step, the moved copies are what the forward
reads), saves them in the adapter file, and `PeftModel.from_pretrained` on a fresh converted base
restores the trained model bitwise.  Plain LoRA (no modules_to_save) freezes the rows: the first
training forward warns (FrozenRowsWarning) with the cause and the fix.  `modules_to_save`
naming the rows by their short names works the same; naming the `attnres` ModuleDict is refused
by PEFT itself."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from attnres_core.config import ResidualConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
t = pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")
peft = pytest.importorskip("peft", reason="peft is installed by tests-torch")

from attnres_torch import hf  # noqa: E402

C = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
IDS = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(3))
SCHEMES = {"block": ResidualConfig(kind="block", block_size=2),
           "low_rank_keys": ResidualConfig.variant("low_rank_keys")}  # one stacked router


def _base(scheme="block"):
    """The same converted tiny Llama every call (seeded weights, random AttnRes rows, so every
    row but row 0 has a gradient: with zero queries the key norms' gains have none)."""
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(t.LlamaConfig(**C))
    hf.convert(model, SCHEMES[scheme])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "attnres" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model


def _lora(model, **kwargs):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, **kwargs))


def _attnres(model):
    return {n: p for n, p in model.named_parameters() if "attnres" in n and p.requires_grad}


def _step(model):
    """One SGD step on the LM loss over every trainable parameter; the gradients taken."""
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    grads = {n: p.grad.clone() for n, p in _attnres(model).items()}
    opt.step()
    opt.zero_grad()
    return grads


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_lora_with_modules_to_save_trains_saves_and_restores_the_rows(scheme, tmp_path):
    model = _base(scheme)
    names = hf.peft_modules_to_save(model)
    assert names == (["model.attnres_router"] if scheme == "low_rank_keys" else
                     [f"model.layers.{0 if r < 3 else 1}.attnres.row{r}" for r in range(5)])
    lora = _lora(model, modules_to_save=names)
    rows = _attnres(lora)
    assert rows and all(".modules_to_save.default." in n for n in rows)  # PEFT's trainable copies
    with torch.no_grad():
        before_logits = lora.eval()(input_ids=IDS).logits
    before = {n: p.detach().clone() for n, p in rows.items()}
    grads = _step(lora)
    # row 0 reads v_0 alone, so its softmax is constant and its gradient exactly zero (spec C6)
    live = {n for n in rows if scheme == "low_rank_keys" or ".row0." not in n}
    assert all(grads[n].abs().sum() > 0 for n in live), [n for n in live if not grads[n].any()]
    assert {n for n, p in rows.items() if not torch.equal(p, before[n])} == live
    lora.eval()
    with torch.no_grad():
        trained = lora(input_ids=IDS).logits
        assert not torch.equal(trained, before_logits)  # the forward reads the moved copies
        with lora.disable_adapter():  # the originals, untouched
            assert torch.equal(lora(input_ids=IDS).logits, before_logits)

    lora.save_pretrained(tmp_path)
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    want = {n.replace(".modules_to_save.default", "") for n in rows}
    assert want <= set(saved), sorted(want - set(saved))
    loaded = peft.PeftModel.from_pretrained(_base(scheme), str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, trained)


def test_plain_lora_freezes_the_rows_and_the_first_training_forward_warns():
    lora = _lora(_base())
    assert not _attnres(lora)  # get_peft_model froze them
    lora.train()
    with pytest.warns(hf.FrozenRowsWarning, match="modules_to_save=hf.peft_modules_to_save"):
        lora(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    with warnings.catch_warnings():  # once per model
        warnings.simplefilter("error", hf.FrozenRowsWarning)
        lora(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    # no warning where nothing trains or the rows do: eval, no_grad, a plain converted model
    for model, ctx in ((_lora(_base()).eval(), torch.enable_grad()),
                       (_lora(_base()).train(), torch.no_grad()),
                       (_base().train(), torch.enable_grad())):
        with warnings.catch_warnings(), ctx:
            warnings.simplefilter("error", hf.FrozenRowsWarning)
            model(input_ids=IDS, labels=IDS, use_cache=False)


def test_modules_to_save_by_short_row_names_works_and_the_attnres_dict_is_refused_by_peft():
    model = _base()
    short = sorted({n.rsplit(".", 1)[1] for n in hf.peft_modules_to_save(model)})
    lora = _lora(model, modules_to_save=short)
    grads = _step(lora)
    assert len(grads) == 10 and all(g.any() for n, g in grads.items() if ".row0." not in n)
    with pytest.raises(TypeError, match="ModuleDict"):
        _lora(_base(), modules_to_save=["attnres"])
