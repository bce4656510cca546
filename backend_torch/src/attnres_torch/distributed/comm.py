"""Counted wrappers of the torch.distributed calls the distributed modes make.

`CommCounter` records, per category, how many tensor elements this rank put on the wire
(a send's payload; an all-reduce / reduce-scatter / all-gather input).  The counts are what
the tests compare with the paper's formulas (Eqs. 7-8) and docs/distributed.md.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional

import torch
import torch.distributed as dist


class CommCounter:
    """Elements and calls per category, for this rank."""

    def __init__(self) -> None:
        self.elements: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, category: str, tensor: torch.Tensor) -> None:
        self.elements[category] += tensor.numel()
        self.calls[category] += 1

    def as_dict(self) -> dict:
        return {"elements": dict(self.elements), "calls": dict(self.calls)}


def _count(counter: Optional[CommCounter], category: str, tensor: torch.Tensor) -> None:
    if counter is not None:
        counter.add(category, tensor)


def all_reduce_sum(tensor: torch.Tensor, group, counter: Optional[CommCounter], category: str):
    """In-place SUM all-reduce of a contiguous tensor; returns it."""
    _count(counter, category, tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_dim0(tensor: torch.Tensor, group, counter: Optional[CommCounter], category: str):
    """`[n, ...]` on each of P ranks -> `[P * n, ...]` in rank order."""
    tensor = tensor.contiguous()
    world = dist.get_world_size(group)
    out = tensor.new_empty((world * tensor.shape[0],) + tuple(tensor.shape[1:]))
    _count(counter, category, tensor)
    dist.all_gather_into_tensor(out, tensor, group=group)
    return out


def reduce_scatter_dim0(tensor: torch.Tensor, group, counter: Optional[CommCounter], category: str):
    """`[P * n, ...]` on each rank -> the SUM over ranks of rows `[rank * n, (rank + 1) * n)`."""
    tensor = tensor.contiguous()
    world = dist.get_world_size(group)
    out = tensor.new_empty((tensor.shape[0] // world,) + tuple(tensor.shape[1:]))
    _count(counter, category, tensor)
    dist.reduce_scatter_tensor(out, tensor, op=dist.ReduceOp.SUM, group=group)
    return out


def send(tensor: torch.Tensor, dst: int, group, counter: Optional[CommCounter], category: str):
    """Blocking point-to-point send to group rank `dst`."""
    _count(counter, category, tensor)
    dist.send(tensor.contiguous(), group_dst=dst, group=group)


def recv(like_shape, dtype, src: int, group) -> torch.Tensor:
    """Blocking receive of a `like_shape` tensor from group rank `src`."""
    out = torch.empty(like_shape, dtype=dtype)
    dist.recv(out, group_src=src, group=group)
    return out
