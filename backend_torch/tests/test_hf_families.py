"""Every decoder family of the pinned transformers converts exactly or is refused at convert
(issue 45 items 1, 3, 4), and docs/hf-families.md is this walk's output.

The walk: for every `model_type` of transformers' causal-LM Auto mapping, a tiny config (32
wide, 2 layers, 64 tokens; a few config attempts for the families whose validators reject the
first) and random weights (seed 0).  A family whose tiny config does not build, is too large
(a composite config the overrides do not reach) or whose unconverted model cannot run a forward
is listed as not walked, with the reason.  Otherwise `hf.convert(model, Full)` either

* converts: then at `mix=0` the converted model's logits on a fresh batch (2 x 7 tokens, not
  convert's probe) equal the unconverted model's bitwise; with random AttnRes rows at the
  default mix the logits move (the rows act) and stay finite; a cached step (6 tokens, then
  the 7th with the KV cache) equals the full forward to 1e-5 wherever the unconverted model's
  own cached step does; and the form `convert(verify=False)` reads from the children is
  compared with the traced one;
* or refuses with a ValueError from `convert` (nothing left on the model), whose reason the
  table shows.

Any other outcome (an exception other than the refusal, a converted family that is not
bitwise at mix=0) fails the family's test.  Numbers in the table are classes ("exact"), not
raw values, so the page is the same on every machine.

Regenerate the page: `python backend_torch/tests/test_hf_families.py` (tests-torch venv);
`test_docs_family_table_is_the_walks_output` fails when the committed page differs.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from attnres_core.config import ResidualConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
t = pytest.importorskip("transformers", reason="the HF stack is installed by tests-torch")

from attnres_torch import hf  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "hf-families.md"

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


# -- the walk over every causal-LM family ------------------------------------------------------------

#: Tiny config attempts, first that builds and runs a forward wins.  The keys a config does not
#: know are set as plain attributes and ignored; MoE / MLA keys shrink those families.
_CORE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
            n_group=1, topk_group=1, first_k_dense_replace=1)
_MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
ATTEMPTS = (
    {**_CORE, **_IDS, "head_dim": 8, "rotary_dim": 4, **_MOE, **_MLA},
    {**_CORE, **_IDS, "rotary_dim": 4, **_MOE, **_MLA},
    {**_CORE, **_IDS, "head_dim": 8},
    {**_CORE, **_IDS},
    {**_CORE, "head_dim": 8},
)
#: A tiny config above this many parameters did not reach a sub-config (vision / audio towers,
#: encoder-decoder halves): listed as too large, not built.
MAX_PARAMS = 20_000_000
#: Families the walk must convert / refuse (the table pins the rest).
MUST_CONVERT = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "granite", "olmo2", "gemma2",
                "gemma3_text", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
                "minicpm3", "llama4_text")
MUST_REFUSE = ("cohere", "phi", "gpt_neox", "gptj", "codegen")

WALK_FAMILIES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
_BATCH = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(3))


def _first_line(e: BaseException, limit: int = 110) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if type(e).__name__ == "StrictDataclassClassValidationError" and len(lines) > 1:
        text = lines[1]  # the validator's own message
    text = re.sub(r"0x[0-9a-fA-F]+", "0x..", text)
    if len(text) > limit:
        text = text[:limit].rstrip() + " ..."
    return f"{type(e).__name__}: {text}"


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _build(family: str):
    """(model, None) for the first tiny config attempt that builds and runs a forward, or
    (None, reason)."""
    cls = getattr(t, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    reason = None
    for kwargs in ATTEMPTS:
        try:
            config = CONFIG_MAPPING[family](**kwargs)
            with torch.device("meta"):
                size = sum(p.numel() for p in cls(config).parameters())
            if size > MAX_PARAMS:
                reason = (f"tiny config too large ({size / 1e6:.0f}M parameters: the overrides "
                          "do not reach a sub-config)")
                continue
            torch.manual_seed(0)
            model = cls(config).eval()
        except Exception as e:  # noqa: BLE001 - the reason is the table's
            reason = f"tiny config does not build ({_first_line(e)})"
            continue
        try:
            with torch.no_grad():
                _logits(model(_BATCH, use_cache=False))
        except Exception as e:  # noqa: BLE001
            reason = f"the unconverted model's forward fails ({_first_line(e)})"
            continue
        return model, None
    return None, reason


def _refusal_reason(message: str) -> str:
    text = re.sub(r"^model: cannot convert this \w+'s decoder layers: ", "", message)
    text = re.sub(r"^model: the conversion is not exact and was undone: ", "not exact: ", text)
    text = re.sub(r"\. (Supported forms|Report the family).*$", "", text, flags=re.S)
    if text.startswith("model: no decoder layer stack found"):
        return ("no decoder layer stack (a list of one layer class, each with a norm and two "
                "sublayer modules as children; post-norm layers keep their norms inside)")

    def cls(m):
        return f"by {'0' if float(m.group(1)) == 0 else 'a nonzero amount'}"
    return re.sub(r"by (\d[\d.e+-]*)", cls, text)


def _cached_step(model, ids) -> float:
    """max |last logits of a full forward - those of prefix + one cached step|."""
    full = _logits(model(ids, use_cache=False))[:, -1]
    out = model(ids[:, :-1], use_cache=True)
    step = _logits(model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True))[:, -1]
    return float((full.double() - step.double()).abs().max())


def _plain_class_check(model, family: str) -> str:
    """Whether the family's own config class refuses the config.json a converted model saves
    (the guard of attnres_core.checkpoint): `XForCausalLM.from_pretrained(path)` reads it with
    that class whatever model_type says, and would otherwise build the PreNorm model."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        model.config.to_json_file(path)
        with open(path) as f:
            data = json.load(f)
    try:
        CONFIG_MAPPING[family].from_dict(data)
    except Exception as e:  # noqa: BLE001 - any loud failure will do; the text is checked
        return "plain class refused" if "Attention Residuals checkpoint" in str(e) else "PLAIN CLASS REFUSAL UNCLEAR"
    return "PLAIN CLASS LOADS IT"


def walk_family(family: str) -> dict:
    """One row of the table: status ('converts', 'refused', 'not walked', 'ERROR'), form or
    reason, the verify=False reading, what was verified, the mix=0 difference class."""
    row = dict(family=family, cls=MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], status="not walked",
               why="", static="", verified="", diff="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, reason = _build(family)
        if model is None:
            row["why"] = reason
            return row
        plain = copy.deepcopy(model)
        try:
            hf.convert(model, ResidualConfig(kind="full"))
        except ValueError as e:
            left = [n for n, _ in model.named_parameters() if "attnres" in n]
            if hf.is_converted(model) or left:
                row.update(status="ERROR", why=f"refused but left converted: {left[:2]}")
            else:
                row.update(status="refused", why=_refusal_reason(str(e)))
            return row
        except Exception as e:  # noqa: BLE001 - any other failure at convert is a defect
            row.update(status="ERROR", why=f"convert raised {_first_line(e)}")
            return row
        state = hf._state(model)
        row.update(status="converts", why=hf.layer_form(model))
        try:
            static = hf._static_form(state.layers[0])
            row["static"] = "same" if static == state.form else "differs (keep verify=True)"
        except ValueError:
            row["static"] = "refused (keep verify=True)"
        checks = []
        with torch.no_grad():
            want = _logits(plain(_BATCH, use_cache=False))
            with hf.residual_inputs(model, mix=0.0):
                got = _logits(model(_BATCH, use_cache=False))
            diff = float((got.double() - want.double()).abs().max())
            row["diff"] = "exact" if torch.equal(got, want) else "<=1e-6" if diff <= 1e-6 else "DIFFERS"
            checks.append("mix=0 bitwise" if row["diff"] == "exact" else "mix=0")
            for n, p in model.named_parameters():
                if "attnres" in n:
                    p.normal_(generator=torch.Generator().manual_seed(len(n)))
            moved = _logits(model(_BATCH, use_cache=False))
            acts = bool(torch.isfinite(moved).all()) and not torch.equal(moved, want)
            checks.append("rows act" if acts else "ROWS DO NOT ACT")
            try:
                plain_gap = _cached_step(plain, _BATCH)
            except Exception:  # noqa: BLE001 - the family's own cache path; not ours to check
                plain_gap = None
            if plain_gap is not None and plain_gap <= 1e-5:
                gap = _cached_step(model, _BATCH)
                checks.append("cached step = full" if gap <= 1e-5 else "CACHED STEP DIFFERS")
            else:
                checks.append("no cache check (the unconverted model's cached step "
                              f"{'fails' if plain_gap is None else 'differs'})")
        checks.append(_plain_class_check(model, family))
        row["verified"] = "; ".join(checks)
        if row["diff"] == "DIFFERS" or any(c.isupper() for c in checks):
            row["status"] = "ERROR"
        return row


@functools.lru_cache(maxsize=None)
def family_row(family: str) -> tuple:
    t.logging.set_verbosity_error()
    return tuple(sorted(walk_family(family).items()))


def _cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code else text.replace("<", "&lt;")


HEADER = """\
# Hugging Face families: what `hf.convert` converts and refuses

<!-- Generated by backend_torch/tests/test_hf_families.py; do not edit. Regenerate with
     `python backend_torch/tests/test_hf_families.py` (tests-torch virtualenv); the test
     test_docs_family_table_is_the_walks_output fails when this page differs from the walk. -->

Every `model_type` of transformers {version}'s causal-LM Auto mapping, walked with a tiny config
(hidden size 32, 2 layers, vocabulary 64) and random weights. `hf.convert(model,
ResidualConfig(kind="full"))` either **converts** (then, on a fresh batch of 2 x 7 tokens, the
converted model at `mix=0` equals the unconverted one bitwise; random AttnRes rows change the
logits; a cached step equals the full forward to 1e-5 wherever the unconverted model's own does;
the config.json it saves is refused by the family's own config class, *plain class refused*, so
`XForCausalLM.from_pretrained(path)` cannot load it as the PreNorm model)
or is **refused** at `convert` with a `ValueError` and the model left as it was. No family
converts to another function: `convert` itself checks `mix=0` on its probe batch before
returning (see [What converts](hf-fsdp-autocast.md#what-converts)).

*Not walked* families are those whose tiny config does not build, is too large (a vision or
audio tower the overrides do not reach; their text-only family is listed on its own row), or
whose unconverted model cannot run a forward at this size; they are not claimed either way.
With their real configs, `convert` still verifies before returning.

The *form* is what the probe forward traced in each layer (pre norm, sublayer, post norm,
residual multiplier). *verify=False* says whether the form read from the children's
registration order (what `convert(..., verify=False)` uses, with no forward) matches the traced
one: use `verify=False` only for a family marked *same*. *mix=0* is the class of the largest
difference from the unconverted logits (*exact*: bitwise).

Summary: {converts} families convert, {refused} are refused, {skipped} not walked.

| family | status | form, or why | verify=False | verified | mix=0 |
|---|---|---|---|---|---|
"""


def render(rows) -> str:
    rows = [dict(r) for r in rows]
    count = {s: sum(r["status"] == s for r in rows) for s in ("converts", "refused", "not walked")}
    text = HEADER.format(version=t.__version__, converts=count["converts"],
                         refused=count["refused"], skipped=count["not walked"])
    for r in rows:
        why = _cell(r["why"], code=r["status"] == "converts")
        text += (f"| `{r['family']}` | {r['status']} | {why} | {r['static'] or '-'} | "
                 f"{r['verified'] or '-'} | {r['diff'] or '-'} |\n")
    return text


def walk() -> str:
    return render([family_row(f) for f in WALK_FAMILIES])


@pytest.mark.parametrize("family", WALK_FAMILIES)
def test_family_walk_converts_exactly_or_refuses_at_convert(family):
    row = dict(family_row(family))
    assert row["status"] != "ERROR", row
    if row["status"] == "converts":
        assert row["diff"] == "exact", row
    if family in MUST_CONVERT:
        assert row["status"] == "converts", row
    if family in MUST_REFUSE:
        assert row["status"] == "refused", row


def test_docs_family_table_is_the_walks_output():
    want = walk()
    have = PAGE.read_text() if PAGE.is_file() else ""
    assert have == want, (f"{PAGE} is not the walk's output; regenerate it with "
                          f"`python backend_torch/tests/test_hf_families.py`")


if __name__ == "__main__":
    PAGE.write_text(walk())
    print(f"wrote {PAGE}", file=sys.stderr)
