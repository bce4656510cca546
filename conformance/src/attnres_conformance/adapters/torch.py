"""`TorchAdapter`: PyTorch's primitives for `base.Adapter`, with no import of any AttnRes port.

Subclass it for any torch port (ours is `attnres_conformance.ports.attnres_torch`): declare
`capabilities()`, and either set `ops` (a module with `depth_attention`, `depth_attention_multi`,
`merge_partial`) or define those methods on the subclass, each taking the spec's arguments::

    class MyPort(TorchAdapter):
        name = "my_port"
        def capabilities(self):
            return Capabilities(dtypes=("float32",), ops=frozenset({"depth_attention"}),
                                options=frozenset())
        def depth_attention(self, sources, query, norm_weight, *, eps=1e-6, scale=1.0):
            return my_port.attn_res(torch.stack(sources), query * norm_weight * scale, eps)

Gradients come from `torch.autograd.grad`; strided inputs are every other element of a buffer
twice as wide; aliasing (C7a) is judged by overlapping storage.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from .base import Adapter


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: unknown torch dtype name {name!r}")
    return dtype


def _span(t: torch.Tensor):
    """(device, first byte, end byte) of the storage behind `t`."""
    storage = t.untyped_storage()
    return t.device, storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class TorchAdapter(Adapter):
    name = "torch-port"

    def versions(self) -> Dict[str, str]:
        return {"torch": torch.__version__}

    def array(self, values, dtype, device, strided):
        dt = torch_dtype(dtype)
        # np.array, not np.ascontiguousarray: the latter makes a 0-d array (a merge's lse1 with no
        # token axes) shape (1,).
        base = torch.from_numpy(np.array(values, order="C")).to(device=device, dtype=dt)
        if strided and base.dim() >= 1:
            wide = torch.zeros(base.shape[:-1] + (2 * base.shape[-1],), dtype=dt, device=device)
            wide[..., ::2] = base
            base = wide[..., ::2]
        return base

    def to_numpy(self, x) -> np.ndarray:
        x = x.detach().cpu()
        return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).numpy()

    def dtype_name(self, x) -> str:
        return str(x.dtype).replace("torch.", "")

    def cast(self, x, dtype: str):
        return x.to(torch_dtype(dtype))

    def context(self, call):
        """C3a: a call inside `torch.autocast` of `call.autocast`'s dtype (on the call's device type)."""
        region = getattr(call, "autocast", None)
        if region is None:
            return super().context(call)
        return torch.autocast(torch.device(call.device).type, dtype=torch_dtype(region))

    def shares_memory(self, result, argument) -> bool:
        # Tensors are mutable and views share storage: overlapping storage byte ranges count.
        (d1, lo1, hi1), (d2, lo2, hi2) = _span(result), _span(argument)
        return d1 == d2 and lo1 < hi2 and lo2 < hi1

    def vjp(self, fn, leaves, key=None):
        grad_leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in leaves]
        with torch.enable_grad():
            outs = fn(*grad_leaves)

        def pullback(cts):
            pairs = [(y, c) for y, c in zip(outs, cts) if c is not None]
            for i, (y, c) in enumerate(pairs):
                # torch.autograd.grad's own check, whose message building crashes past the first
                # output ("Boolean value of Tensor with more than one value is ambiguous": it looks
                # the cotangent up with list.index, i.e. tensor ==): raised here with its message.
                if c.shape != y.shape:
                    raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of {c.shape} and "
                                       f"output[{i}] has a shape of {y.shape}.")
            wanted = [t for t in grad_leaves if t.requires_grad]
            got = iter(torch.autograd.grad([y for y, _ in pairs], wanted, [c for _, c in pairs],
                                           allow_unused=True))
            return [next(got) if t.requires_grad else None for t in grad_leaves]

        return outs, pullback
