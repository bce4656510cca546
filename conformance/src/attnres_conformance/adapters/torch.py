"""The primitives of attnres_torch for `base.Adapter` (registry name "torch").

Ops are dispatched exactly as users get them; gradients come from `torch.autograd.grad`; the
probe network is `DepthRouter` run with `torch.func.functional_call` on the given parameters.
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict

import numpy as np
import torch
from attnres_core.config import VARIANT_KINDS
from attnres_core.probe import probe_sublayers
from attnres_torch import dispatch, ops
from attnres_torch.modules import DepthRouter
from attnres_torch.residual_ops import TorchOps

from ..backend import OPS, OPTIONS, SCHEDULES, Capabilities
from .base import Adapter, implementation_counts


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
    name = "torch"
    ops = ops

    def __init__(self):
        self._since = dict(dispatch.impl_counts())

    def devices(self) -> tuple:
        return dispatch.capabilities()["devices"]

    def capabilities(self) -> Capabilities:
        # The backend contract's own answer (attnres_torch.dispatch.capabilities): a fused kernel
        # serves the default op on the default device (the C kernel on the CPU unless
        # ATTNRES_TORCH_CPU_C=0 or it cannot be built, the Triton kernels on CUDA).
        caps = dispatch.capabilities()
        return Capabilities(
            dtypes=caps["dtypes"], devices=caps["devices"], ops=frozenset(OPS),
            options=frozenset(OPTIONS), variants=frozenset(VARIANT_KINDS),
            schedules=frozenset(SCHEDULES), fused_kernel=caps["fused_kernel"],
            deterministic=caps["deterministic"])

    def versions(self) -> Dict[str, str]:
        out = {"torch": torch.__version__}
        for dist in ("attnres-torch", "triton"):
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
        return out

    def implementations_used(self) -> Dict[str, int]:
        """Calls per implementation (`attnres_torch.dispatch.impl_counts`) since creation."""
        return implementation_counts(dict(dispatch.impl_counts()), self._since)

    def array(self, values, dtype, device, strided):
        dt = torch_dtype(dtype)
        base = torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dt)
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
            wanted = [t for t in grad_leaves if t.requires_grad]
            got = iter(torch.autograd.grad([y for y, _ in pairs], wanted, [c for _, c in pairs],
                                           allow_unused=True))
            return [next(got) if t.requires_grad else None for t in grad_leaves]

        return outs, pullback

    def probe(self, config, params, embedding, sublayer_weights, *, schedule, mix, scale):
        num_layers, dim = sublayer_weights.shape[0], embedding.shape[-1]
        router = DepthRouter(config, num_layers, dim, schedule=schedule).to(
            device=embedding.device, dtype=embedding.dtype)
        sublayers = probe_sublayers(config, TorchOps(), sublayer_weights)  # attnres_core.probe
        return torch.func.functional_call(router, params, (embedding, sublayers),
                                          dict(mix=mix, scale=scale))


backend = TorchAdapter()
