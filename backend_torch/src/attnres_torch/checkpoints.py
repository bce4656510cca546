"""Checkpoint converters between `DepthRouter` parameters and the AttnRes layouts of other models.

Our layout (`ResidualConfig.param_shapes`): "queries" `[L+1, D]` and "norm_weights" `[L+1, D]`,
row r = sublayer r + 1 (attention and MLP of decoder layer i are rows 2i and 2i + 1), row L the
output aggregation.  A `PerLayerRouter` reads and writes it with `stacked()` / `load_stacked()`.

Peers: flash-linear-attention models (`fla/models/*/modeling_*.py`; their block size counts
sublayers, the same number as ours) and Kimi K3 model code (mlx-lm, tpu-inference, the HF
checkpoint's names; their block unit is the decoder layer, so ours is twice theirs, and they fold
the gain into the query, `w_eff = norm.weight * proj.weight`, which maps row to row).  Their key
names, shapes, eps and block sizes: docs/models-and-checkpoints.md (the converters' table).

`from_fla` / `from_k3` return our layout; `to_fla` / `to_k3` write theirs; `fla_config` /
`k3_config` give the matching `ResidualConfig`.  Keys of other parameters are ignored on the way
in and not produced on the way out: the rest of the model maps name to name.

The names, shapes and transposes are the framework-neutral `attnres_core.training` mappings
(shared with the JAX and MLX converters); this module hands them torch tensors.
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch
from attnres_core import training as core
from attnres_core.training import fla_config, k3_config
from torch import nn

#: torch's arrays for the core mappings: tensors in, fresh tensors (not views of a parameter) out.
_READ = {"as_array": torch.as_tensor, "stack": lambda rows: torch.stack(rows).clone()}
_WRITE = {"copy": torch.clone}


def _params_of(params) -> Dict[str, torch.Tensor]:
    """Our layout of a mapping or a router (`stacked()` of a `PerLayerRouter`), detached."""
    if isinstance(params, nn.Module):
        if hasattr(params, "stacked"):
            params = params.stacked()
        else:
            params = {n: getattr(params, n) for n in ("queries", "norm_weights")
                      if isinstance(getattr(params, n, None), torch.Tensor)}
    if isinstance(params, Mapping):
        params = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    return params


def from_fla(state_dict: Mapping[str, torch.Tensor], *, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """Our `{"queries", "norm_weights"}` `[2n+1, D]` from a flash-linear-attention model's state
    dict (n decoder layers, found from the keys)."""
    return core.from_fla(state_dict, prefix=prefix, **_READ)


def to_fla(params, *, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """flash-linear-attention keys (`attn_res_proj.weight` `[1, D]`, ...) from our layout (a
    mapping, a `DepthRouter` or a `PerLayerRouter`)."""
    return core.to_fla(_params_of(params), prefix=prefix, **_WRITE)


def from_k3(state_dict: Mapping[str, torch.Tensor], *, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """Our `{"queries", "norm_weights"}` `[2n+1, D]` from a Kimi K3 state dict (HF names, the
    sanitized mlx-lm names, or tpu-inference's `[D, 1]` projection kernels)."""
    return core.from_k3(state_dict, prefix=prefix, **_READ)


def to_k3(params, *, prefix: str = "model.", proj_layout: str = "linear") -> Dict[str, torch.Tensor]:
    """Kimi K3 keys from our layout; proj_layout "linear" writes `[1, D]` projections (HF,
    mlx-lm `nn.Linear`), "einsum" `[D, 1]` (tpu-inference's `JaxEinsum` kernel)."""
    return core.to_k3(_params_of(params), prefix=prefix, proj_layout=proj_layout, **_WRITE)


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
