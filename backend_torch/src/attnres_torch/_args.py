"""Argument plumbing shared by the public ops: torch dtype names, source forms, device checks.

The checks themselves live in `attnres_core.validation` (one piece of code per idea); this
module only turns torch objects into the shapes and canonical dtype names those checks take.
"""

from __future__ import annotations

import contextlib
import functools
from typing import List, Sequence, Tuple, Union

import torch

Sources = Union[torch.Tensor, Sequence[torch.Tensor]]

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}


def dtype_name(t: torch.Tensor) -> str:
    """Canonical dtype name for `attnres_core.validation` ("int32", "bool", ... = non-floating)."""
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))


def compute_dtype(source_dtype: torch.dtype) -> torch.dtype:
    """C10: float64 sources compute in float64, everything else in float32."""
    return torch.float64 if source_dtype == torch.float64 else torch.float32


def autocast_on(device: torch.device) -> bool:
    """Whether a `torch.autocast` region is enabled for `device`'s type (any device type)."""
    kind = device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def autocast_off(device: torch.device):
    """A context that disables autocast for `device`'s type while the ops compute (C10: every
    intermediate in the compute dtype, which autocast's reduced-precision matmuls would break);
    a no-op outside autocast."""
    return torch.autocast(device.type, enabled=False) if autocast_on(device) else contextlib.nullcontext()


def autocast_promote(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """C3a: under `torch.autocast` on the first tensor's device, tensors of different float16 /
    bfloat16 / float32 / float64 dtypes are cast to the widest (`torch.promote_types`: float16
    with bfloat16 gives float32), as autocast does for `torch.cat`; else (autocast off, one dtype,
    or a non-floating tensor) they are returned as given and the dtype checks (C3, C14) apply."""
    dtypes = {t.dtype for t in tensors}
    if (len(dtypes) < 2 or not all(d in _DTYPE_NAMES for d in dtypes)
            or not autocast_on(tensors[0].device)):
        return tensors
    wide = functools.reduce(torch.promote_types, dtypes)
    return [t.to(wide) for t in tensors]


def require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def optional_tensor(name: str, value):
    return None if value is None else require_tensor(name, value)


def split_sources(sources: Sources) -> Tuple[List[torch.Tensor], bool, list, list]:
    """Sources as a list of `[..., D]` views (a stacked `[N, ..., D]` tensor is unbound, never
    copied; a list under autocast is promoted to one dtype, `autocast_promote`).  Returns (views,
    stacked, shapes, dtype names) for `validation.check_sources`."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2:
            n = sources.shape[0] if sources.dim() else 0
            return [], True, [()] * n, [dtype_name(sources)] * n
        views = list(sources.unbind(0))
        return views, True, [tuple(sources.shape[1:])] * len(views), [dtype_name(sources)] * len(views)
    if not isinstance(sources, (list, tuple)):
        raise TypeError(
            "sources: expected a sequence of tensors [..., D] or one stacked tensor [N, ..., D], "
            f"got {type(sources).__name__}"
        )
    views = autocast_promote([require_tensor(f"sources[{i}]", s) for i, s in enumerate(sources)])
    return views, False, [tuple(s.shape) for s in views], [dtype_name(s) for s in views]


def check_same_device(named: Sequence[Tuple[str, torch.Tensor]]) -> torch.device:
    """Every tensor argument must live on one device; returns it."""
    device = None
    first = None
    for name, t in named:
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name}: on device {t.device}, but {first} is on {device}; "
                             "every tensor must be on one device")
    return device
