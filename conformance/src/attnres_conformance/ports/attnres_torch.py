"""attnres_torch on `adapters.torch.TorchAdapter` (registry name "torch").

Ops are dispatched exactly as users get them; the probe network is `DepthRouter` run with
`torch.func.functional_call` on the given parameters.
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict

import torch
from attnres_core.probe import probe_sublayers
from attnres_torch import dispatch, ops
from attnres_torch.modules import DepthRouter
from attnres_torch.residual_ops import TorchOps

from ..adapters.base import implementation_counts
from ..adapters.torch import TorchAdapter
from ..backend import Capabilities
from . import contract_capabilities


class AttnresTorch(TorchAdapter):
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
        # C3a: torch.autocast regions (attnres_torch._args.autocast_promote widens the sources).
        # M1a: the probe's sublayers may return another dtype (`ProbeCall.sublayer_dtype`).
        return contract_capabilities(dispatch.capabilities(), autocast=("bfloat16", "float16"),
                                     sublayer_dtype=True)

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

    def probe(self, config, params, embedding, sublayer_weights, *, schedule, mix, scale,
              sublayer_dtype=None):
        num_layers, dim = sublayer_weights.shape[0], embedding.shape[-1]
        router = DepthRouter(config, num_layers, dim, schedule=schedule).to(
            device=embedding.device, dtype=embedding.dtype)
        sublayers = self.sublayers_in(probe_sublayers(config, TorchOps(), sublayer_weights),  # attnres_core.probe
                                      sublayer_dtype)
        return torch.func.functional_call(router, params, (embedding, sublayers),
                                          dict(mix=mix, scale=scale))


backend = AttnresTorch()
