"""Hugging Face checkpoints of `attnres_torch.hf` in mlx-lm, and back (issue 43 item 3).

A directory that `model.save_pretrained(path)` wrote from a model converted by
`attnres_torch.hf.convert` holds the base model's weights under their HF names, config.json with
the scheme under "attnres", and the AttnRes rows.  Neither `mlx_lm.load` nor a key rename loads
it right: strict loading refuses the row tensors, and `strict=False` drops them and returns the
PreNorm model without a word.  The two frameworks also give the rows to different layers:

* torch (`attnres_torch.hf`, per layer): decoder layer i owns rows 2i + 1 and 2i + 2 as
  `model.layers.<i>.attnres.row<r>.query` / `.norm_weight` (layer 0 also row 0; the last
  layer's row 2i + 2 is the output row L); with `per_layer=False` one stacked router holds
  them all: `model.attnres_router.queries` / `.norm_weights` `[L + 1, D]`;
* mlx-lm (`attnres_mlx.mlx_lm.convert_prenorm`): decoder layer i owns rows 2i and 2i + 1 as
  `model.layers.<i>.attnres_queries` / `attnres_norm_weights` `[2, D]` (the last layer also row
  L: `[3, D]`).

Row r is the same number in both (M4: row l - 1 is read before sublayer l, row L is the output
read), so the loader re-slices rows, it does not rename keys.

* `load_hf(path)`: (model, tokenizer or None): the mlx-lm model of config.json's `model_type`,
  converted with the recorded scheme, every weight and every row loaded strictly; ready for
  `generate_step`, `make_prompt_cache`, `mlx_lm.generate`.
* `save_hf(model, path)`: the way back, a directory `attnres_torch.hf.from_pretrained` loads
  (torch's names, torch's row ownership, the "attnres" entry).  Its config.json also names a
  `model_file` (`attnres_mlx_model.py`, written beside it): a plain `mlx_lm.load(path)` then
  refuses it (mlx-lm asks for `trust_remote_code=True`, with or without `strict`), and with
  `trust_remote_code=True` mlx-lm builds the AttnRes model through this module.

Both record forms of `attnres_torch.hf` are read and written back as loaded: the base
`model_type` with a `"layout"` in the record, and `"model_type": "attnres"` with the base type
and the traced `"form"` in the record (which mlx-lm alone refuses: no such model type).

Also read from config.json: transformers 5 writes the RoPE base as `rope_parameters`
(`{"rope_theta": ..., "rope_type": ...}`), which mlx-lm 0.32's Llama does not read (it would run
at its default base 10000); the loader passes it on as `rope_theta` / `rope_scaling`.
"""

from __future__ import annotations

import copy
import glob
import json
import re
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
from attnres_core.checkpoint import AUTO_MODEL_TYPE, CONFIG_KEY, guard, guarded_field, unguard
from attnres_core.config import ResidualConfig
from mlx.utils import tree_flatten

# CONFIG_KEY, AUTO_MODEL_TYPE and the guard: `attnres_core.checkpoint` (the contract all three
# backends share).

#: The model file that checkpoints written by `save_hf` name in config.json (mlx-lm's
#: `model_file`): a plain `mlx_lm.load` refuses them, `trust_remote_code=True` loads them right.
MODEL_FILE = "attnres_mlx_model.py"
MODEL_FILE_TEXT = '''"""mlx-lm's model file for an Attention Residuals checkpoint (config.json's "attnres" entry).

mlx_lm.load(path) refuses this checkpoint without trust_remote_code=True: a model built without
this file would drop the AttnRes rows and run as the PreNorm model.  Needs attnres-mlx installed;
attnres_mlx.mlx_lm.load_hf(path) loads it without running this file.
"""

from attnres_mlx.hf_checkpoint import Model, ModelArgs  # noqa: F401
'''

#: The decoder layer layout that `convert_prenorm` converts (torch's record: `layout`) ...
LAYOUT = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
#: ... and the same as the traced `form` that newer `attnres_torch.hf` records write: two
#: sublayers, each a (chain of child calls, sublayer module, residual multiplier) triple.
FORM = [[["input_layernorm", "self_attn"], "self_attn", None],
        [["post_attention_layernorm", "mlp"], "mlp", None]]
#: mlx-lm model types whose parameter names are the HF checkpoint's (the model's `sanitize` only
#: drops keys), so `save_hf` can write them back under the same names.
SAVE_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_ROW_NAMES = {"queries": "query", "norm_weights": "norm_weight"}
_PER_LAYER = re.compile(r"^model\.layers\.(\d+)\.attnres\.row(\d+)\.(\w+)$")
_STACKED = re.compile(r"^model\.attnres_router\.(\w+)$")


def _refuse(msg: str):
    raise ValueError(msg)


def scheme(config: dict, where: str = "config") -> ResidualConfig:
    """The `ResidualConfig` of an HF config dict's "attnres" entry, checked against what the
    mlx-lm conversion supports (a Llama-layout PreNorm decoder at `model.layers`; full, block or
    window with static queries).  Both record forms of `attnres_torch.hf` are read: the base
    `model_type` with `"layout"`, and `"model_type": "attnres"` with the base type and the
    traced `"form"` in the record."""
    record = config.get(CONFIG_KEY)
    if not isinstance(record, dict) or "config" not in record:
        _refuse(f"{where}: no {CONFIG_KEY!r} entry (not saved from a model converted by "
                "attnres_torch.hf or attnres_mlx.mlx_lm.save_hf); a PreNorm checkpoint loads with "
                "mlx_lm.load, then attnres_mlx.mlx_lm.convert_prenorm converts it")
    rc = ResidualConfig.from_dict(record["config"])
    if config.get("model_type") == AUTO_MODEL_TYPE and not _base_type(record):
        _refuse(f"{where}: model_type {AUTO_MODEL_TYPE!r} without the base model_type in the "
                f"{CONFIG_KEY!r} record")
    form = record.get("form")
    if form is not None and _form(form) != _form(FORM):
        _refuse(f"{where}: the decoder layers' form is {form} (attnres_torch.hf's trace); the "
                f"mlx-lm loader converts PreNorm layers only: {FORM}")
    if record.get("layers", "model.layers") != "model.layers" or \
            list(record.get("layout", LAYOUT)) != LAYOUT:
        _refuse(f"{where}: the AttnRes rows belong to decoder layers at {record.get('layers')!r} "
                f"with layout {record.get('layout')}; the mlx-lm loader handles Llama-layout "
                f"decoders at 'model.layers' ({LAYOUT})")
    if rc.kind not in ("full", "block", "window") or \
            set(rc.param_shapes(2, 1)) != {"queries", "norm_weights"}:
        _refuse(f"{where}: scheme {rc} is not one convert_prenorm runs (full/block/window with "
                "static queries: parameters queries and norm_weights only)")
    return rc


def _form(form) -> list:
    return [[list(chain), fn, mult] for chain, fn, mult in form]


def base_config(config: dict) -> dict:
    """The config of the base model: `model_type` "attnres" replaced by the record's base type
    (mlx-lm picks its model class by it); mlx-lm's `model_file` dropped; the guarded field's own
    value restored (`attnres_core.checkpoint`)."""
    out = {k: v for k, v in unguard(config).items() if k != "model_file"}
    if out.get("model_type") == AUTO_MODEL_TYPE:
        out["model_type"] = _base_type(out[CONFIG_KEY])
    return out


def _base_type(record: dict):
    """The base model's type in an "attnres" record: "base_model_type" as attnres_torch.hf
    writes it (an earlier form wrote "model_type")."""
    return record.get("base_model_type") or record.get("model_type")


def mlx_lm_config(config: dict) -> dict:
    """The config as mlx-lm's model classes read it: transformers 5's `rope_parameters` passed
    on as `rope_theta` (and, for a scaled RoPE, `rope_scaling`) where those keys are absent."""
    out = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        if "rope_theta" not in out:
            out["rope_theta"] = rope["rope_theta"]
        elif float(out["rope_theta"]) != float(rope["rope_theta"]):
            _refuse(f"config: rope_theta {out['rope_theta']} and rope_parameters.rope_theta "
                    f"{rope['rope_theta']} disagree")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" and out.get("rope_scaling") is None:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def torch_rows(weights: Dict[str, mx.array], config: dict, num_layers: int
               ) -> Tuple[Dict[str, mx.array], Dict[str, mx.array]]:
    """(the stacked rows {"queries", "norm_weights"} `[L + 1, D]`, the other weights) from a
    checkpoint's tensors in torch's names, per layer or stacked as config's record says.  Every
    row must be there, once, where torch puts it, and nothing else of AttnRes."""
    record = config[CONFIG_KEY]
    L = 2 * num_layers
    rows: Dict[str, Dict[int, mx.array]] = {name: {} for name in _ROW_NAMES}
    rest, unknown = {}, []
    per_layer = bool(record.get("per_layer", True))
    by_row = {v: k for k, v in _ROW_NAMES.items()}
    for key, value in weights.items():
        m, s = _PER_LAYER.match(key), _STACKED.match(key)
        if per_layer and m and m.group(3) in by_row:
            layer, r = int(m.group(1)), int(m.group(2))
            owner = 0 if r == 0 else (r - 1) // 2
            if r > L or layer != owner or r in rows[by_row[m.group(3)]]:
                unknown.append(key)
            else:
                rows[by_row[m.group(3)]][r] = value
        elif not per_layer and s and s.group(1) in _ROW_NAMES and value.ndim == 2 \
                and value.shape[0] == L + 1:
            rows[s.group(1)].update({r: value[r] for r in range(L + 1)})
        elif "attnres" in key:
            unknown.append(key)
        else:
            rest[key] = value
    missing = [f"{name} row {r}" for name, got in rows.items() for r in range(L + 1) if r not in got]
    if unknown or missing:
        layout = ("per layer: model.layers.<i>.attnres.row<r>.query/.norm_weight, layer i owning "
                  "rows 2i + 1, 2i + 2 and layer 0 row 0" if per_layer else
                  "stacked: model.attnres_router.queries/.norm_weights [L + 1, D]")
        _refuse(f"checkpoint: its AttnRes rows are not those of {num_layers} decoder layers "
                f"saved {layout} (config.json's per_layer={per_layer}): "
                + (f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}; " if missing else "")
                + (f"unexpected {sorted(unknown)[:4]}" if unknown else ""))
    return {name: mx.stack([got[r] for r in range(L + 1)]) for name, got in rows.items()}, rest


def mlx_rows(stacked: Dict[str, mx.array], num_layers: int) -> Dict[str, mx.array]:
    """The stacked rows as `convert_prenorm`'s per-layer parameters (layer i: rows 2i, 2i + 1;
    the last layer also row L)."""
    out = {}
    for i in range(num_layers):
        sl = slice(2 * i, 2 * num_layers + 1 if i == num_layers - 1 else 2 * i + 2)
        out[f"model.layers.{i}.attnres_queries"] = stacked["queries"][sl]
        out[f"model.layers.{i}.attnres_norm_weights"] = stacked["norm_weights"][sl]
    return out


# -- the model, as mlx-lm builds it -----------------------------------------------------------------

class _HFModelMixin:
    """Mixin of the model class `build` returns: its `sanitize` (which mlx-lm's `load_model`
    calls on the checkpoint's tensors) moves torch's rows to the converted layers."""

    def sanitize(self, weights):
        config = self._attnres_hf_config
        rows, rest = torch_rows(dict(weights), config, len(self.model.layers))
        parent = super()
        rest = parent.sanitize(rest) if hasattr(parent, "sanitize") else rest
        rest.update(mlx_rows(rows, len(self.model.layers)))
        return rest


_CLASSES: Dict[type, type] = {}


def build(config: dict):
    """The converted mlx-lm model (unloaded weights) of an HF config dict with an "attnres"
    entry: mlx-lm's class for `model_type`, `convert_prenorm` with the recorded scheme, and a
    `sanitize` that takes torch's row names.  mlx-lm's `load_model` then loads it strictly."""
    from mlx_lm.utils import _get_classes

    from .mlx_lm import convert_prenorm

    config = {k: v for k, v in config.items() if k != "model_file"}
    rc = scheme(config)
    mcfg = mlx_lm_config(base_config(config))
    model_class, args_class = _get_classes(mcfg)
    model = model_class(args_class.from_dict(mcfg))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        _refuse(f"config: model_type {config.get('model_type')!r} builds an mlx-lm "
                f"{model_class.__name__} without model.layers")
    convert_prenorm(model, rc)
    cls = type(model)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"AttnResHF{cls.__name__}", (_HFModelMixin, cls), {})
    model.__class__ = _CLASSES[cls]
    object.__setattr__(model, "_attnres_hf_config", copy.deepcopy(config))
    return model


class ModelArgs:
    """mlx-lm's `ModelArgs` for the `model_file` route: the config dict itself."""

    @classmethod
    def from_dict(cls, config: dict) -> dict:
        return dict(config)


def Model(config: dict):  # noqa: N802 - mlx-lm calls `arch.Model(arch.ModelArgs.from_dict(config))`
    """mlx-lm's `Model` for the `model_file` route (`mlx_lm.load(path, trust_remote_code=True)`
    on a checkpoint `save_hf` wrote): `build(config)`."""
    return build(config)


# -- load / save ------------------------------------------------------------------------------------

def _weight_keys(path: Path):
    keys = []
    for wf in sorted(glob.glob(str(path / "model*.safetensors"))):
        keys += list(mx.load(wf).keys())
    return keys


def load_hf(path, *, tokenizer: bool = True, lazy: bool = False):
    """Load a checkpoint directory saved by `attnres_torch.hf` (`model.save_pretrained(path)` of a
    converted model) or by `save_hf` into mlx-lm: returns (model, tokenizer), the tokenizer
    `mlx_lm.load` would give, or None where the directory has no tokenizer files (or
    tokenizer=False).

    The model is mlx-lm's class for config.json's `model_type`, converted in place by
    `convert_prenorm` with the scheme of config.json's "attnres" entry, and every weight loaded
    strictly: each AttnRes row of the checkpoint lands on the layer that reads it in MLX (torch
    and MLX assign rows to layers differently, see this module's docstring), a missing or extra
    tensor is an error.  It runs the direct schedule (torch's eval-mode two-phase schedule gives
    the same values up to float32 rounding); `set_mix` applies as after `convert_prenorm`.

    Refused, with the cause: a config without the "attnres" entry (a PreNorm checkpoint: use
    `mlx_lm.load`), a scheme or layout the mlx-lm conversion does not run, rows missing or not
    where the record says.  Never use `mlx_lm.load(path, strict=False)` on such a checkpoint: it
    drops the rows and returns the PreNorm model without a word."""
    from mlx_lm.utils import load_model, load_tokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        _refuse(f"path: {str(path)!r} has no config.json (expected a local directory written by "
                "save_pretrained of an attnres_torch.hf model, or by save_hf)")
    config = json.loads((path / "config.json").read_text())
    if CONFIG_KEY not in config:
        rows = [k for k in _weight_keys(path) if "attnres" in k]
        if rows:
            _refuse(f"path: {path}/config.json has no {CONFIG_KEY!r} entry but the weights hold "
                    f"{len(rows)} AttnRes tensors (e.g. {rows[0]!r}): the scheme record was "
                    "removed, and without it the rows cannot be placed; restore config.json as "
                    "attnres_torch.hf saved it")
    scheme(config, f"{path}/config.json")
    model, _ = load_model(path, lazy=lazy, strict=True, model_config={"model_file": None},
                          get_model_classes=lambda config: (Model, ModelArgs))
    object.__setattr__(model, "_attnres_hf_config", config)
    tok = None
    if tokenizer and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                         "tokenizer.model")):
        tok = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tok


def _record(model, layers, config: dict) -> dict:
    """The "attnres" entry for a converted model: the loaded one where the scheme is unchanged
    (its form, per_layer and schedule kept, so a load + save round trip is the same directory),
    else a new one in the form `config` has (base model_type + layout, or model_type "attnres"
    + base type + form)."""
    shared = layers[0]._attnres_pass
    loaded = config.get(CONFIG_KEY) or {}
    dtype = str(layers[0].attnres_queries.dtype).replace("mlx.core.", "")
    if loaded and ResidualConfig.from_dict(loaded["config"]) == shared.config:
        return dict(copy.deepcopy(loaded), dtype=dtype)
    record = {"config": shared.config.to_dict(), "per_layer": True, "schedule": None,
              "dtype": dtype, "layers": "model.layers", "layout": list(LAYOUT)}
    if config.get("model_type") == AUTO_MODEL_TYPE:
        record.pop("layout")
        record.update(form=copy.deepcopy(FORM), base_model_type=_base_type(loaded))
    return record


def save_hf(model, path, *, config: Optional[dict] = None) -> None:
    """Save an mlx-lm model converted by `convert_prenorm` (or loaded by `load_hf`) as a
    directory `attnres_torch.hf.from_pretrained(LlamaForCausalLM, path)` loads: config.json (the
    HF config with the "attnres" entry), model.safetensors (HF names; the rows in torch's
    ownership: `model.layers.<i>.attnres.row<r>.*`, or the stacked router where the loaded
    checkpoint had one) and `attnres_mlx_model.py`, which config.json names as mlx-lm's
    `model_file` so that a plain `mlx_lm.load(path)` refuses the directory.

    config: the model's HF config dict (what `mlx_lm.load(..., return_config=True)` returns, or
    config.json); default: the one `load_hf` read.  Model types: those whose mlx-lm parameter
    names are HF's (`SAVE_TYPES`); not quantized.  The tokenizer is not written
    (`tokenizer.save_pretrained(path)` does that)."""
    from .mlx_lm import AttnResDecoderLayer

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not isinstance(layers[0], AttnResDecoderLayer):
        _refuse("model: expected an mlx-lm model converted by convert_prenorm or loaded by load_hf")
    config = getattr(model, "_attnres_hf_config", None) if config is None else config
    if config is None:
        _refuse("config: this model was not loaded by load_hf; pass config= (the model's HF "
                "config dict: mlx_lm.load(path, return_config=True)[2])")
    model_type = getattr(model, "model_type", base_config(config).get("model_type"))
    if model_type not in SAVE_TYPES:
        _refuse(f"model: mlx-lm's {model_type!r} parameter names are not known to be Hugging "
                f"Face's; save_hf writes {SAVE_TYPES}")
    flat = dict(tree_flatten(model.parameters()))
    if any(k.endswith(".scales") for k in flat):
        _refuse("model: quantized (its weights are packed); save the float model")
    L = 2 * len(layers)
    record = _record(model, layers, config)
    queries = mx.concatenate([ly.attnres_queries for ly in layers])
    gains = mx.concatenate([ly.attnres_norm_weights for ly in layers])
    weights = {k: v for k, v in flat.items() if ".attnres_" not in k}
    if record["per_layer"]:
        for r in range(L + 1):
            owner = 0 if r == 0 else (r - 1) // 2
            weights[f"model.layers.{owner}.attnres.row{r}.query"] = queries[r]
            weights[f"model.layers.{owner}.attnres.row{r}.norm_weight"] = gains[r]
    else:
        weights["model.attnres_router.queries"] = queries
        weights["model.attnres_router.norm_weights"] = gains
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    field = guarded_field(config)
    out = unguard(config)
    out[CONFIG_KEY] = {k: v for k, v in record.items() if k != "guard"}
    out["model_file"] = MODEL_FILE
    out = guard(out, field)  # LlamaForCausalLM.from_pretrained(path) refuses it (attnres_core.checkpoint)
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / MODEL_FILE).write_text(MODEL_FILE_TEXT)
    (path / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
