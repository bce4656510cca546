"""Hugging Face checkpoints of `attnres_torch.hf` in JAX, and back (issue 43 item 3; needs the
`flax` extra).

A directory that `model.save_pretrained(path)` wrote from a Llama model converted by
`attnres_torch.hf.convert` holds the base weights under their HF names, config.json with the
scheme under "attnres", and the AttnRes rows:

* per layer (the default): decoder layer i owns rows 2i + 1 and 2i + 2 as
  `model.layers.<i>.attnres.row<r>.query` / `.norm_weight`, layer 0 also row 0 (row r is read
  before sublayer r + 1, row L = 2 x layers is the output read: M4);
* `per_layer=False`: one stacked router, `model.attnres_router.queries` / `.norm_weights`
  `[L + 1, D]`.

In JAX the rows are the `DepthRouter`'s `queries` / `norm_weights` `[L + 1, D]` (row r is row r:
the loader stacks them, it assigns nothing to layers).

* `load_hf(path)`: a `LlamaAttnRes` NNX model (embedding, RMSNorm, RoPE, grouped-query
  attention, SwiGLU, the router; layer-scanned where the scheme allows it) with every tensor of
  the checkpoint loaded and checked: a missing or extra tensor, a row not where torch puts it,
  a scheme, form or architecture this model does not run is refused, naming the cause.
* `save_hf(model, path)`: the way back, a directory `attnres_torch.hf.from_pretrained` loads
  (torch's names and row ownership, the "attnres" record as loaded); a `load_hf` + `save_hf`
  round trip is the checkpoint again, bit for bit.
* `load_rows(path)`: (the `ResidualConfig`, the rows `{"queries", "norm_weights"}` `[L + 1, D]`,
  every other tensor by its HF name) for a model of the user's own: `DepthRouter.load_params`
  takes the rows.

Both record forms of `attnres_torch.hf` are read: `"model_type": "attnres"` with the base type
(`"base_model_type"`) and the traced `"form"` in the record, and the earlier base `model_type`
with a `"layout"`.  Model types: Llama (`"llama"`: no attention or MLP biases, RoPE of type
"default", the RoPE base from `rope_theta` or transformers 5's `rope_parameters`).  The
safetensors files are read and written with NumPy (no `safetensors` package needed).
"""

from __future__ import annotations

import glob
import json
import re
import struct
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from attnres_core.checkpoint import AUTO_MODEL_TYPE, CONFIG_KEY, guard, unguard
from attnres_core.config import ResidualConfig
from flax import nnx

from ._math import HIGHEST
from .modules import DepthRouter, _stacked
from .stack import SCAN_KINDS, resolve_scan_layers  # noqa: F401 (SCAN_KINDS: here full, block scan)

# CONFIG_KEY, AUTO_MODEL_TYPE and the guard (`guard` / `unguard`): the checkpoint contract all
# three backends share (`attnres_core.checkpoint`).
#: The decoder layer's traced form (attnres_torch.hf's "form") and earlier "layout" of a
#: PreNorm Llama layer: the two sublayers this model runs.
FORM = [[["input_layernorm", "self_attn"], "self_attn", None],
        [["post_attention_layernorm", "mlp"], "mlp", None]]
LAYOUT = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
#: The base model types `LlamaAttnRes` runs.
MODEL_TYPES = ("llama",)

_ROW_NAMES = {"queries": "query", "norm_weights": "norm_weight"}
_PER_LAYER = re.compile(r"^model\.layers\.(\d+)\.attnres\.row(\d+)\.(\w+)$")
_STACKED = re.compile(r"^model\.attnres_router\.(\w+)$")


def _refuse(msg: str):
    raise ValueError(msg)


# -- safetensors, with NumPy ----------------------------------------------------------------------

def _st_dtypes() -> dict:
    import ml_dtypes  # a dependency of jax

    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
            "BOOL": np.bool_}


def read_safetensors(path) -> Dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, by name (NumPy arrays, the file's dtypes)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    dtypes, base, out = _st_dtypes(), 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            _refuse(f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader does not know")
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(data[base + begin:base + end], dtypes[info["dtype"]]).reshape(info["shape"]).copy()
    return out


def write_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: Optional[dict] = None) -> None:
    """Write `tensors` (name -> array) as a .safetensors file (names sorted, as safetensors does)."""
    names = {np.dtype(v): k for k, v in _st_dtypes().items()}
    header, chunks, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in names:
            _refuse(f"{name}: dtype {a.dtype} has no safetensors name")
        raw = a.tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in chunks:
            f.write(raw)


def _read_dir(path: Path) -> Dict[str, np.ndarray]:
    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        _refuse(f"path: {path} holds no model*.safetensors (save_pretrained's safetensors format)")
    out: Dict[str, np.ndarray] = {}
    for f in files:
        out.update(read_safetensors(f))
    return out


# -- the record ------------------------------------------------------------------------------------

def _base_type(config: dict):
    record = config.get(CONFIG_KEY) or {}
    if config.get("model_type") == AUTO_MODEL_TYPE:
        return record.get("base_model_type") or record.get("model_type")
    return config.get("model_type")


def scheme(config: dict, where: str = "config") -> ResidualConfig:
    """The `ResidualConfig` of an HF config dict's "attnres" record, checked against what
    `LlamaAttnRes` runs (a PreNorm Llama decoder at `model.layers`; full, block or window with
    static queries)."""
    record = config.get(CONFIG_KEY)
    if not isinstance(record, dict) or "config" not in record:
        _refuse(f"{where}: no {CONFIG_KEY!r} entry (not saved from a model converted by "
                "attnres_torch.hf or by attnres_jax.checkpoint_hf.save_hf)")
    if config.get("model_type") == AUTO_MODEL_TYPE and not _base_type(config):
        _refuse(f"{where}: model_type {AUTO_MODEL_TYPE!r} without the base model_type in the "
                f"{CONFIG_KEY!r} record")
    if _base_type(config) not in MODEL_TYPES:
        _refuse(f"{where}: base model_type {_base_type(config)!r}; LlamaAttnRes runs {MODEL_TYPES} "
                "(for another family, load_rows gives the rows for a model of your own)")
    form = record.get("form")
    if form is not None and [[list(c), f, m] for c, f, m in form] != FORM:
        _refuse(f"{where}: the decoder layers' form is {form} (attnres_torch.hf's trace); "
                f"LlamaAttnRes runs PreNorm layers only: {FORM}")
    if record.get("layers", "model.layers") != "model.layers" or list(record.get("layout", LAYOUT)) != LAYOUT:
        _refuse(f"{where}: the AttnRes rows belong to decoder layers at {record.get('layers')!r} "
                f"with layout {record.get('layout')}; LlamaAttnRes runs Llama-layout decoders at "
                f"'model.layers' ({LAYOUT})")
    rc = ResidualConfig.from_dict(record["config"])
    if rc.kind not in ("full", "block", "window") or set(rc.param_shapes(2, 1)) != set(_ROW_NAMES):
        _refuse(f"{where}: scheme {rc} is not one LlamaAttnRes runs (full, block or window with "
                "static queries: parameters queries and norm_weights only)")
    return rc


def _rows(weights: Dict[str, np.ndarray], record: dict, num_layers: int):
    """(the stacked rows {"queries", "norm_weights"} `[L + 1, D]`, the other tensors): every row
    there once, where torch puts it (per layer or stacked as the record says), nothing else of
    AttnRes."""
    L = 2 * num_layers
    per_layer = bool(record.get("per_layer", True))
    rows: Dict[str, Dict[int, np.ndarray]] = {name: {} for name in _ROW_NAMES}
    by_row = {v: k for k, v in _ROW_NAMES.items()}
    rest, unknown = {}, []
    for key, value in weights.items():
        m, s = _PER_LAYER.match(key), _STACKED.match(key)
        if per_layer and m and m.group(3) in by_row:
            layer, r = int(m.group(1)), int(m.group(2))
            owner = 0 if r == 0 else (r - 1) // 2
            if r > L or layer != owner or r in rows[by_row[m.group(3)]]:
                unknown.append(key)
            else:
                rows[by_row[m.group(3)]][r] = value
        elif not per_layer and s and s.group(1) in _ROW_NAMES and value.ndim == 2 and value.shape[0] == L + 1:
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
        _refuse(f"checkpoint: its AttnRes rows are not those of {num_layers} decoder layers saved "
                f"{layout} (config.json's per_layer={per_layer}): "
                + (f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}; " if missing else "")
                + (f"unexpected {sorted(unknown)[:4]}" if unknown else ""))
    return {name: np.stack([got[r] for r in range(L + 1)]) for name, got in rows.items()}, rest


def _config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        _refuse(f"path: {str(path)!r} has no config.json (expected a directory written by "
                "save_pretrained of an attnres_torch.hf model, or by save_hf)")
    return json.loads((path / "config.json").read_text())


def load_rows(path) -> Tuple[ResidualConfig, Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """(the scheme, the rows {"queries", "norm_weights"} `[L + 1, D]` as `DepthRouter` holds
    them, every other tensor by its HF name) of a checkpoint directory saved by
    `attnres_torch.hf`, for a model of the user's own (any decoder family: only the record and
    the rows are checked here)."""
    path = Path(path)
    config = _config(path)
    record = config.get(CONFIG_KEY)
    if not isinstance(record, dict) or "config" not in record:
        _refuse(f"{path}/config.json: no {CONFIG_KEY!r} entry (not saved from a converted model)")
    rc = ResidualConfig.from_dict(record["config"])
    if record.get("layers", "model.layers") != "model.layers":
        _refuse(f"{path}/config.json: rows of decoder layers at {record['layers']!r}; load_rows "
                "reads those at 'model.layers'")
    rows, rest = _rows(_read_dir(path), record, int(config["num_hidden_layers"]))
    return rc, rows, rest


# -- the model -------------------------------------------------------------------------------------

class _Config:
    """The Llama hyperparameters of an HF config dict (refusing what LlamaAttnRes does not run)."""

    def __init__(self, config: dict, where: str = "config"):
        config = unguard(config)  # the guarded field's own value (attnres_core.checkpoint)
        get = config.get
        self.vocab_size, self.dim = int(config["vocab_size"]), int(config["hidden_size"])
        self.hidden, self.num_layers = int(config["intermediate_size"]), int(config["num_hidden_layers"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(get("head_dim") or self.dim // self.num_heads)
        self.eps = float(get("rms_norm_eps", 1e-6))
        self.tied = bool(get("tie_word_embeddings", False))
        rope = get("rope_parameters") or {}
        scaling = get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type")) or scaling.get("rope_type", scaling.get("type")) or "default"
        if kind != "default":
            _refuse(f"{where}: RoPE of type {kind!r}; LlamaAttnRes runs the default RoPE only")
        theta = get("rope_theta", rope.get("rope_theta", 10000.0))
        if "rope_theta" in rope and float(rope["rope_theta"]) != float(theta):
            _refuse(f"{where}: rope_theta {theta} and rope_parameters.rope_theta {rope['rope_theta']} disagree")
        self.rope_theta = float(theta)
        for key in ("attention_bias", "mlp_bias"):
            if get(key):
                _refuse(f"{where}: {key}=True; LlamaAttnRes has no biases")
        if get("hidden_act", "silu") != "silu":
            _refuse(f"{where}: hidden_act {get('hidden_act')!r}; LlamaAttnRes runs SwiGLU (silu)")
        if self.num_heads % self.num_kv_heads:
            _refuse(f"{where}: {self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")


def _p(shape, dtype):
    return nnx.Param(jnp.zeros(shape, dtype))


def _mm(x, w):
    """x @ w.T for a weight in torch's [out, in] layout."""
    return jnp.einsum("...i,oi->...o", x, w, precision=HIGHEST)


class _RMSNorm(nnx.Module):
    def __init__(self, dim, eps, dtype):
        self.weight, self.eps = nnx.Param(jnp.ones((dim,), dtype)), eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def _rotate_half(x):
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-b, a], axis=-1)


class _Proj(nnx.Module):
    def __init__(self, d_in, d_out, dtype):
        self.weight = _p((d_out, d_in), dtype)

    def __call__(self, x):
        return _mm(x, self.weight[...])


class _SelfAttention(nnx.Module):
    def __init__(self, c: _Config, dtype):
        self.q_proj = _Proj(c.dim, c.num_heads * c.head_dim, dtype)
        self.k_proj = _Proj(c.dim, c.num_kv_heads * c.head_dim, dtype)
        self.v_proj = _Proj(c.dim, c.num_kv_heads * c.head_dim, dtype)
        self.o_proj = _Proj(c.num_heads * c.head_dim, c.dim, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim

    def __call__(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) * self.head_dim ** -0.5
        mask = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores.astype(jnp.float32), -jnp.inf), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=HIGHEST).reshape(b, t, -1)
        return self.o_proj(out)


class _MLP(nnx.Module):
    def __init__(self, c: _Config, dtype):
        self.gate_proj = _Proj(c.dim, c.hidden, dtype)
        self.up_proj = _Proj(c.dim, c.hidden, dtype)
        self.down_proj = _Proj(c.hidden, c.dim, dtype)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nnx.Module):
    """A Llama decoder layer as its two AttnRes sublayers (the residual adds are the router's)."""

    def __init__(self, c: _Config, dtype):
        self.input_layernorm = _RMSNorm(c.dim, c.eps, dtype)
        self.self_attn = _SelfAttention(c, dtype)
        self.post_attention_layernorm = _RMSNorm(c.dim, c.eps, dtype)
        self.mlp = _MLP(c, dtype)

    def attention(self, h, cos, sin):
        return self.self_attn(self.input_layernorm(h), cos, sin)

    def feed_forward(self, h):
        return self.mlp(self.post_attention_layernorm(h))


class LlamaAttnRes(nnx.Module):
    """A Llama-family causal decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) whose
    residual stream is the AttnRes scheme `rc` over its L = 2 x layers sublayers (attention,
    MLP), as `attnres_torch.hf.convert` makes it: tokens `[B, T]` -> logits `[B, T, vocab]`.
    Parameters zero-initialised (`load_hf` fills them), named as the HF checkpoint:
    `embed_tokens`, `layers` (an `nnx.List`, or one layer whose variables are stacked
    `[layers, ...]` when `scan_layers`), `norm`, `lm_head` (None when tied), `router` (a
    `DepthRouter`, rows `[L + 1, D]`).

    config: the HF config dict (config.json). scan_layers: None (scan for the kinds of
    `SCAN_KINDS`: compile time flat in depth), True or False.  dtype: of every parameter."""

    def __init__(self, config: dict, rc: ResidualConfig, *, scan_layers: Optional[bool] = None,
                 dtype=jnp.float32):
        c = _Config(config)
        scan_layers = resolve_scan_layers(rc.kind, scan_layers)
        self.embed_tokens = _p((c.vocab_size, c.dim), dtype)
        layers = [_DecoderLayer(c, dtype) for _ in range(c.num_layers)]
        self.layers = _stacked(layers) if scan_layers else nnx.List(layers)
        self.norm = _RMSNorm(c.dim, c.eps, dtype)
        self.lm_head = None if c.tied else _p((c.vocab_size, c.dim), dtype)
        self.router = DepthRouter(rc, 2 * c.num_layers, c.dim, dtype=dtype)
        self.scan_layers, self.num_layers = bool(scan_layers), c.num_layers
        self.head_dim, self.rope_theta = c.head_dim, c.rope_theta
        self.hf_config_json: Optional[str] = None  # the config.json load_hf read (save_hf's default)

    def _rope(self, positions):
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float32) / self.head_dim))
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)

    def __call__(self, tokens, *, positions=None, mix=None, scale=None):
        """tokens `[B, T]` -> logits `[B, T, vocab]`; positions `[B, T]` (default 0..T-1);
        mix, scale: the router's M10 per-call inputs."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        cos, sin = self._rope(positions)
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if self.scan_layers:
            graphdef, state = nnx.split(self.layers)
            sublayers = (lambda p, h: nnx.merge(graphdef, p).attention(h, cos, sin),
                         lambda p, h: nnx.merge(graphdef, p).feed_forward(h))
            h = self.router.scan(x, sublayers, state, mix=mix, scale=scale)
        else:
            sublayers = []
            for layer in self.layers:
                sublayers += [lambda h, ly=layer: ly.attention(h, cos, sin), layer.feed_forward]
            h = self.router(x, sublayers, mix=mix, scale=scale)
        head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        return _mm(self.norm(h), head)

    # the HF names of the base weights <-> the model's variables
    def _base_vars(self) -> Dict[str, Tuple[nnx.Variable, Optional[int]]]:
        """HF name -> (variable, the layer index into a stacked variable or None)."""
        out = {"model.embed_tokens.weight": (self.embed_tokens, None),
               "model.norm.weight": (self.norm.weight, None)}
        if self.lm_head is not None:
            out["lm_head.weight"] = (self.lm_head, None)
        layer_vars = {}
        for path, var in nnx.iter_graph(self.layers):
            if isinstance(var, nnx.Variable):
                layer_vars[path] = var
        for i in range(self.num_layers):
            for path, var in layer_vars.items():
                if self.scan_layers:
                    name, index = ".".join(map(str, path)), i
                else:
                    if path[0] != i:
                        continue
                    name, index = ".".join(map(str, path[1:])), None
                out[f"model.layers.{i}.{name}"] = (var, index)
        return out


def load_hf(path, *, scan_layers: Optional[bool] = None) -> LlamaAttnRes:
    """Load a checkpoint directory saved by `attnres_torch.hf` (`save_pretrained` of a converted
    Llama model) or by `save_hf`: a `LlamaAttnRes` with every tensor set (dtype: the
    checkpoint's), the rows stacked into its router.  Refused, naming the cause: no "attnres"
    record (a PreNorm checkpoint, or a stripped record with the rows still there), a base type,
    form, layout, scheme or Llama option the model does not run, a missing or extra tensor, a
    row not where the record says, a shape that is not the config's."""
    path = Path(path)
    config = _config(path)
    weights = _read_dir(path)
    if CONFIG_KEY not in config:
        rows = sorted(k for k in weights if "attnres" in k)
        if rows:
            _refuse(f"path: {path}/config.json has no {CONFIG_KEY!r} entry but the weights hold "
                    f"{len(rows)} AttnRes tensors (e.g. {rows[0]!r}): the scheme record was removed, "
                    "and without it the rows cannot be placed; restore config.json as attnres_torch.hf "
                    "saved it")
    rc = scheme(config, f"{path}/config.json")
    c = _Config(config, f"{path}/config.json")
    rows, rest = _rows(weights, config[CONFIG_KEY], c.num_layers)
    dtypes = {v.dtype for v in rest.values()}
    if len(dtypes) != 1:
        _refuse(f"checkpoint: tensors of several dtypes {sorted(map(str, dtypes))}; expected one")
    dtype = jnp.dtype(dtypes.pop())
    model = LlamaAttnRes(config, rc, scan_layers=scan_layers, dtype=dtype)
    targets = model._base_vars()
    missing = sorted(set(targets) - set(rest))
    unexpected = sorted(set(rest) - set(targets))
    if missing or unexpected:
        _refuse(f"checkpoint: not the weights of this Llama config: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}")
    stacked: Dict[int, list] = {}
    for name, (var, index) in targets.items():
        value = rest[name]
        want = var[...].shape[1:] if index is not None else var[...].shape
        if tuple(value.shape) != tuple(want):
            _refuse(f"checkpoint: {name} has shape {tuple(value.shape)}, the config gives {tuple(want)}")
        if index is None:
            var[...] = jnp.asarray(value, dtype)
        else:
            stacked.setdefault(id(var), [var, {}])[1][index] = value
    for var, parts in stacked.values():
        var[...] = jnp.asarray(np.stack([parts[i] for i in range(model.num_layers)]), dtype)
    model.router.load_params({k: jnp.asarray(v) for k, v in rows.items()})
    model.hf_config_json = json.dumps(config, sort_keys=True)  # a str: static under nnx.jit
    return model


def save_hf(model: LlamaAttnRes, path, *, config: Optional[dict] = None) -> None:
    """Save a `LlamaAttnRes` as a directory `attnres_torch.hf.from_pretrained(LlamaForCausalLM,
    path)` loads: config.json (the HF config with its "attnres" record; default: the one
    `load_hf` read) and model.safetensors (HF names; the rows in torch's ownership, per layer or
    stacked as the record says).  The record is kept as loaded where the router's scheme is the
    recorded one, else refused (a changed scheme is a new conversion: attnres_torch.hf.convert)."""
    if not isinstance(model, LlamaAttnRes):
        _refuse(f"model: expected a LlamaAttnRes (load_hf), got {type(model).__name__}")
    if config is None and getattr(model, "hf_config_json", None):
        config = json.loads(model.hf_config_json)
    if config is None:
        _refuse("config: this model was not loaded by load_hf; pass config= (the HF config dict "
                "with its 'attnres' record)")
    rc = scheme(config)
    if rc != model.router.config:
        _refuse(f"config: its 'attnres' record holds {rc}, the model runs {model.router.config}")
    record = config[CONFIG_KEY]
    weights = {}
    for name, (var, index) in model._base_vars().items():
        value = np.asarray(var[...])
        weights[name] = value if index is None else value[index]
    rows = {k: np.asarray(v) for k, v in model.router.params().items()}
    L = 2 * model.num_layers
    if record.get("per_layer", True):
        for r in range(L + 1):
            owner = 0 if r == 0 else (r - 1) // 2
            for name, short in _ROW_NAMES.items():
                weights[f"model.layers.{owner}.attnres.row{r}.{short}"] = rows[name][r]
    else:
        for name in _ROW_NAMES:
            weights[f"model.attnres_router.{name}"] = rows[name]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", weights, metadata={"format": "pt"})
    config = guard(config)  # LlamaForCausalLM.from_pretrained(path) refuses it (attnres_core.checkpoint)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
