"""Checkpoint converters between `DepthRouter` parameters and the AttnRes layouts of other models.

Our layout (`ResidualConfig.param_shapes`): "queries" `[L+1, D]` and "norm_weights" `[L+1, D]`,
row r = sublayer r + 1 (attention and MLP of decoder layer i are rows 2i and 2i + 1), row L the
output aggregation.  A `PerLayerRouter` reads and writes it with `stacked()` / `load_stacked()`.

flash-linear-attention models (`fla/models/*/modeling_*.py`, config `attnres_block_size`):
  `{prefix}layers.{i}.attn_res_proj.weight` `[1, D]`, `...attn_res_norm.weight` `[D]`,
  `...mlp_res_proj.weight`, `...mlp_res_norm.weight`, `{prefix}res_proj.weight`,
  `{prefix}res_norm.weight`; eps = `config.norm_eps` (1e-6 by default).  Their block size already
  counts sublayers (an even number; 1 is their "full" mode), so `block_size` is the same number.
  Their kernel fuses the next pre-norm (`output_rms_weight`): in our wiring that norm stays inside
  the sublayer and the model's final norm after the router.

Kimi K3 model code (mlx-lm `mlx_lm/models/kimi_k3.py`, tpu-inference
`tpu_inference/models/jax/kimi_k3.py`, after the HF checkpoint's names):
  `{prefix}layers.{i}.self_attention_res_proj.weight` `[1, D]` (tpu-inference's einsum kernel
  `[D, 1]`), `...self_attention_res_norm.weight`, `...mlp_res_proj.weight`,
  `...mlp_res_norm.weight`, `{prefix}output_attn_res_proj.weight`,
  `{prefix}output_attn_res_norm.weight`; eps = `rms_norm_eps` (1e-5).  Their block unit is the
  decoder layer, so our `block_size = 2 * attn_res_block_size`.  They fold the gain into the query
  (`w_eff = norm.weight * proj.weight`); the logit `<rmsnorm(v) * g, q>` depends only on that
  product, so the rows map one to one (query = proj, gain = norm).  The raw HF names
  `self_attention_res.proj_weight` / `.norm_weight` are read too.

`from_fla` / `from_k3` return our layout; `to_fla` / `to_k3` write theirs; `fla_config` /
`k3_config` give the matching `ResidualConfig`.  Keys of other parameters are ignored on the way
in and not produced on the way out: the rest of the model maps name to name.
"""

from __future__ import annotations

import re
from typing import Dict, Mapping, Optional, Tuple

import torch
from attnres_numpy.config import ResidualConfig
from torch import nn

FLA_SITES = ("attn_res", "mlp_res")
FLA_OUTPUT = "res"
K3_SITES = ("self_attention_res", "mlp_res")
K3_OUTPUT = "output_attn_res"


def fla_config(attnres_block_size: int, norm_eps: float = 1e-6) -> ResidualConfig:
    """Our scheme for a flash-linear-attention model: 1 (their full mode) -> kind="full"; an even
    block size (in sublayers, as ours) -> kind="block" with the same block_size."""
    if isinstance(attnres_block_size, bool) or not isinstance(attnres_block_size, int) or \
            attnres_block_size < 1 or (attnres_block_size != 1 and attnres_block_size % 2):
        raise ValueError(f"attnres_block_size: expected 1 or an even int >= 2 (FLA's rule), got "
                         f"{attnres_block_size!r}")
    if attnres_block_size == 1:
        return ResidualConfig(kind="full", eps=norm_eps)
    return ResidualConfig(kind="block", block_size=attnres_block_size, eps=norm_eps)


def k3_config(attn_res_block_size: int, rms_norm_eps: float = 1e-5) -> ResidualConfig:
    """Our scheme for a Kimi K3 model: block_size = 2 x their decoder-layer block size."""
    if isinstance(attn_res_block_size, bool) or not isinstance(attn_res_block_size, int) or attn_res_block_size < 1:
        raise ValueError(f"attn_res_block_size: expected an int >= 1 (decoder layers), got {attn_res_block_size!r}")
    return ResidualConfig(kind="block", block_size=2 * attn_res_block_size, eps=rms_norm_eps)


def _params_of(params) -> Dict[str, torch.Tensor]:
    if isinstance(params, nn.Module):
        if hasattr(params, "stacked"):
            params = params.stacked()
        else:
            params = {n: getattr(params, n) for n in ("queries", "norm_weights")
                      if isinstance(getattr(params, n, None), torch.Tensor)}
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a mapping or a router, got {type(params).__name__}")
    missing = [n for n in ("queries", "norm_weights") if n not in params]
    if missing:
        raise ValueError(f"params: the AttnRes checkpoint layouts hold a static query and a key-norm "
                         f"gain per row; missing {missing} (got {sorted(params)})")
    q, g = params["queries"], params["norm_weights"]
    if q.dim() != 2 or q.shape != g.shape or q.shape[0] % 2 != 1:
        raise ValueError(f"params: expected queries and norm_weights of one shape [2n+1, D] (n decoder "
                         f"layers); got {tuple(q.shape)} and {tuple(g.shape)}")
    return {"queries": q, "norm_weights": g}


def _vector(sd, key: str, dim: Optional[int], *, proj: bool) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"state_dict: missing {key!r}")
    t = torch.as_tensor(sd[key])
    ok = (t.dim() == 1 or (proj and t.dim() == 2 and 1 in t.shape)) and (dim is None or t.numel() == dim)
    if not ok:
        want = "[1, D], [D, 1] or [D]" if proj else "[D]"
        raise ValueError(f"state_dict[{key!r}]: expected shape {want}"
                         f"{'' if dim is None else f' with D = {dim}'}, got {tuple(t.shape)}")
    return t.reshape(-1)


def _num_layers(sd, prefix: str, site: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\." + re.escape(site) + r"[._]")
    found = sorted({int(m.group(1)) for k in sd for m in [pattern.match(k)] if m})
    if not found:
        raise ValueError(f"state_dict: no '{prefix}layers.<i>.{site}...' keys (is the prefix "
                         f"{prefix!r} right? the model may have no AttnRes)")
    if found != list(range(len(found))):
        raise ValueError(f"state_dict: layer indices {found} are not 0..{len(found) - 1}")
    return len(found)


def _read(sd, prefix: str, sites: Tuple[str, str], output: str, names) -> Dict[str, torch.Tensor]:
    if not isinstance(sd, Mapping):
        raise TypeError(f"state_dict: expected a mapping, got {type(sd).__name__}")
    n = _num_layers(sd, prefix, sites[0])
    keys = [f"{prefix}layers.{i}.{s}" for i in range(n) for s in sites] + [f"{prefix}{output}"]
    queries, gains, dim = [], [], None
    for base in keys:
        q_key, g_key = names(sd, base)
        q = _vector(sd, q_key, dim, proj=True)
        dim = q.numel()
        queries.append(q)
        gains.append(_vector(sd, g_key, dim, proj=False))
    return {"queries": torch.stack(queries).clone(), "norm_weights": torch.stack(gains).clone()}


def _write(params, prefix: str, sites, output: str, proj_shape) -> Dict[str, torch.Tensor]:
    p = _params_of(params)
    q, g = p["queries"].detach(), p["norm_weights"].detach()
    n = (q.shape[0] - 1) // 2
    bases = [f"{prefix}layers.{i}.{s}" for i in range(n) for s in sites] + [f"{prefix}{output}"]
    out = {}
    for r, base in enumerate(bases):
        out[f"{base}_proj.weight"] = q[r].reshape(proj_shape(q.shape[1])).clone()
        out[f"{base}_norm.weight"] = g[r].clone()
    return out


def _plain_names(sd, base):
    return f"{base}_proj.weight", f"{base}_norm.weight"


def _k3_names(sd, base):
    if f"{base}.proj_weight" in sd or f"{base}.norm_weight" in sd:  # the raw HF names
        return f"{base}.proj_weight", f"{base}.norm_weight"
    return _plain_names(sd, base)


def from_fla(state_dict: Mapping[str, torch.Tensor], *, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """Our `{"queries", "norm_weights"}` `[2n+1, D]` from a flash-linear-attention model's state
    dict (n decoder layers, found from the keys)."""
    return _read(state_dict, prefix, FLA_SITES, FLA_OUTPUT, _plain_names)


def to_fla(params, *, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """flash-linear-attention keys (`attn_res_proj.weight` `[1, D]`, ...) from our layout (a
    mapping, a `DepthRouter` or a `PerLayerRouter`)."""
    return _write(params, prefix, FLA_SITES, FLA_OUTPUT, lambda d: (1, d))


def from_k3(state_dict: Mapping[str, torch.Tensor], *, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """Our `{"queries", "norm_weights"}` `[2n+1, D]` from a Kimi K3 state dict (HF names, the
    sanitized mlx-lm names, or tpu-inference's `[D, 1]` projection kernels)."""
    return _read(state_dict, prefix, K3_SITES, K3_OUTPUT, _k3_names)


def to_k3(params, *, prefix: str = "model.", proj_layout: str = "linear") -> Dict[str, torch.Tensor]:
    """Kimi K3 keys from our layout; proj_layout "linear" writes `[1, D]` projections (HF,
    mlx-lm `nn.Linear`), "einsum" `[D, 1]` (tpu-inference's `JaxEinsum` kernel)."""
    shapes = {"linear": lambda d: (1, d), "einsum": lambda d: (d, 1)}
    if proj_layout not in shapes:
        raise ValueError(f"proj_layout: expected 'linear' or 'einsum', got {proj_layout!r}")
    return _write(params, prefix, K3_SITES, K3_OUTPUT, shapes[proj_layout])


def load_into(router: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy our-layout params into a `DepthRouter` or `PerLayerRouter` (shapes checked)."""
    if hasattr(router, "load_stacked"):
        router.load_stacked(params)
        return
    shapes = router.config.param_shapes(router.num_layers, router.dim)
    if set(params) != set(shapes):
        raise ValueError(f"params: expected names {sorted(shapes)}, got {sorted(params)}")
    with torch.no_grad():
        for name, shape in shapes.items():
            value = torch.as_tensor(params[name])
            if tuple(value.shape) != shape:
                raise ValueError(f"params[{name!r}]: expected shape {shape}, got {tuple(value.shape)}")
            getattr(router, name).copy_(value)


__all__ = ["fla_config", "from_fla", "from_k3", "k3_config", "load_into", "to_fla", "to_k3"]
