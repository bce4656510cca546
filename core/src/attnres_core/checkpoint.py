"""The Hugging Face checkpoint contract of a converted model, shared by the three backends.

A directory saved from a model converted by `attnres_torch.hf` (or written by
`attnres_jax.checkpoint_hf.save_hf` / `attnres_mlx.hf_checkpoint.save_hf`) holds the base
model's weights under their HF names, the AttnRes rows, and a config.json with

- `"model_type": "attnres"` (`AUTO_MODEL_TYPE`) and the scheme under `"attnres"` (`CONFIG_KEY`),
  whose `"base_model_type"` names the family: tools that do not know the type refuse it;
- the guard (`guard`): one strict field of the family's config (`use_cache`, or
  `tie_word_embeddings` where the class declares no `use_cache`) moves into the record as
  `"guard": {"field", "value"}` and its top-level value becomes a sentence saying what the
  directory is and how to load it.  The family's own class (`LlamaForCausalLM.from_pretrained(
  path)`), which reads config.json with its own config class whatever `model_type` says, then
  fails at once (transformers' strict config fields: a str is not a bool), naming the fix,
  instead of building the PreNorm model and dropping the rows with a warning.  The loaders that
  know the format (`unguard`) restore the field.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

#: The key under which config.json records the scheme.
CONFIG_KEY = "attnres"
#: The `model_type` a converted model's config.json carries (the base type is in the record).
AUTO_MODEL_TYPE = "attnres"
#: The family fields that can carry the guard, in order of preference (strict bools in
#: transformers' configs; the saver picks the first its config class declares).
GUARD_FIELDS = ("use_cache", "tie_word_embeddings")
#: The guard's text: what the directory is and how to load it.
GUARD_TEXT = ("attnres: this is an Attention Residuals checkpoint (config.json's 'attnres' record); "
              "the family's own class would load it as the PreNorm model without the AttnRes rows. "
              "Load it with transformers' Auto classes after `import attnres_torch.hf`, or "
              "attnres_torch.hf.from_pretrained(cls, path)")


def guard(config: Dict[str, Any], field: Optional[str] = None, value: Any = None) -> Dict[str, Any]:
    """A copy of config.json's dict with the guard on `field` (idempotent; default: the field
    the dict's guard already uses, else `use_cache`).  `value`: the family's value of `field`
    when the dict lacks it (a diff-only dict omits a default)."""
    if not isinstance(config.get(CONFIG_KEY), dict):
        raise ValueError(f"config: no {CONFIG_KEY!r} record to guard (not a converted model's config)")
    field = field or guarded_field(config) or GUARD_FIELDS[0]
    if field not in GUARD_FIELDS:
        raise ValueError(f"field: expected one of {GUARD_FIELDS}, got {field!r}")
    out = unguard(config)
    record = dict(out[CONFIG_KEY])
    record["guard"] = {"field": field, "value": out.get(field, value)}
    out[CONFIG_KEY], out[field] = record, GUARD_TEXT
    return out


def unguard(config: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of config.json's dict with the guarded field's own value back in place (the same
    dict's copy when it carries no guard: a checkpoint saved before the guard).  A field whose
    value is `None` in the record (the family's default) is dropped."""
    field = guarded_field(config)
    if field is None:
        return dict(config)
    record = {k: v for k, v in config[CONFIG_KEY].items() if k != "guard"}
    value = config[CONFIG_KEY]["guard"].get("value")
    out = dict(config, **{CONFIG_KEY: record})
    if value is None:
        del out[field]
    else:
        out[field] = value
    return out


def guarded_field(config: Dict[str, Any]) -> Optional[str]:
    """The field config.json's dict carries its guard on (None without a guard)."""
    record = config.get(CONFIG_KEY)
    entry = record.get("guard") if isinstance(record, dict) else None
    return entry.get("field") if isinstance(entry, dict) and config.get(entry.get("field")) == GUARD_TEXT else None
