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


def _collective(current: str, older: str):
    """The torch.distributed function named `current`, or `older` on a torch that predates it
    (torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
    `all_gather_single` / `reduce_scatter_single`).  Looked up per call, so a test can patch it."""
    fn = getattr(dist, current, None)
    return fn if fn is not None else getattr(dist, older)


def all_reduce_sum(tensor: torch.Tensor, group, counter: Optional[CommCounter], category: str):
    """In-place SUM all-reduce of a contiguous tensor; returns it."""
    _count(counter, category, tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_dim0(tensor: torch.Tensor, group, counter: Optional[CommCounter], category: str):
    """`[n, ...]` on each of P ranks -> `[P * n, ...]` in rank order (on the input's device)."""
    tensor = tensor.contiguous()
    world = dist.get_world_size(group)
    out = tensor.new_empty((world * tensor.shape[0],) + tuple(tensor.shape[1:]))
    _count(counter, category, tensor)
    _collective("all_gather_single", "all_gather_into_tensor")(out, tensor, group=group)
    return out


def reduce_scatter_dim0(tensor: torch.Tensor, group, counter: Optional[CommCounter], category: str):
    """`[P * n, ...]` on each rank -> the SUM over ranks of rows `[rank * n, (rank + 1) * n)`
    (on the input's device)."""
    tensor = tensor.contiguous()
    world = dist.get_world_size(group)
    if tensor.shape[0] % world:
        raise ValueError(f"tensor: dim 0 of shape {tuple(tensor.shape)} must divide by the group "
                         f"size {world} to reduce-scatter")
    out = tensor.new_empty((tensor.shape[0] // world,) + tuple(tensor.shape[1:]))
    _count(counter, category, tensor)
    _collective("reduce_scatter_single", "reduce_scatter_tensor")(out, tensor, op=dist.ReduceOp.SUM,
                                                                  group=group)
    return out


def check_transfer(tensor: torch.Tensor, what: str, shape: tuple, dtype: torch.dtype,
                   device: torch.device) -> None:
    """Raise before a point-to-point transfer whose payload differs from what the receiver
    allocates (`shape`, `dtype` declared to the runner, `device` the stage's): ValueError for a
    shape or device, TypeError for a dtype, naming the argument, the expected and the actual.
    (A mismatched payload would otherwise abort gloo, or be received silently and fail later.)"""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"microbatch_shape: declared {tuple(shape)} for every transferred tensor, "
                         f"but {what} has shape {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise TypeError(f"dtype: declared {dtype} for every transferred tensor, but {what} has "
                        f"dtype {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"device: this stage runs on {device}, but {what} is on {tensor.device}")


def send(tensor: torch.Tensor, dst: int, group, counter: Optional[CommCounter], category: str):
    """Blocking point-to-point send to group rank `dst` (check the payload with
    `check_transfer` first)."""
    _count(counter, category, tensor)
    dist.send(tensor.contiguous(), group_dst=dst, group=group)


def recv(shape, dtype: torch.dtype, device, src: int, group) -> torch.Tensor:
    """Blocking receive of a `shape` tensor of `dtype` from group rank `src`, into a buffer
    allocated on `device` (NCCL accepts only tensors on the process's GPU)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, group_src=src, group=group)
    return out
