"""Argument plumbing shared by the public ops: torch dtype names, source forms, device checks.

The checks themselves live in `attnres_numpy.validation` (one piece of code per idea); this
module only turns torch objects into the shapes and canonical dtype names those checks take.
"""

from __future__ import annotations

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
    """Canonical dtype name for `attnres_numpy.validation` ("int32", "bool", ... = non-floating)."""
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))


def compute_dtype(source_dtype: torch.dtype) -> torch.dtype:
    """C10: float64 sources compute in float64, everything else in float32."""
    return torch.float64 if source_dtype == torch.float64 else torch.float32


def require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def optional_tensor(name: str, value):
    return None if value is None else require_tensor(name, value)


def split_sources(sources: Sources) -> Tuple[List[torch.Tensor], bool, list, list]:
    """Sources as a list of `[..., D]` views (a stacked `[N, ..., D]` tensor is unbound, never
    copied).  Returns (views, stacked, shapes, dtype names) for `validation.check_sources`."""
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
    views = [require_tensor(f"sources[{i}]", s) for i, s in enumerate(sources)]
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
