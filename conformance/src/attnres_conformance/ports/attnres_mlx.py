"""attnres_mlx on `adapters.mlx.MLXAdapter` (registry name "mlx").

Capabilities and the implementations that ran come from the backend's public contract
(`attnres_mlx.dispatch`); the probe network is `attnres_mlx.probe.probe_forward`.
"""

from __future__ import annotations

from typing import Dict

from attnres_mlx import DepthRouter, dispatch, ops, probe

from ..adapters.base import implementation_counts
from ..adapters.mlx import MLXAdapter
from ..backend import Capabilities
from . import contract_capabilities


class AttnresMLX(MLXAdapter):
    name = "mlx"
    ops = ops

    def __init__(self):
        self._since = dict(dispatch.impl_counts())

    def capabilities(self) -> Capabilities:
        return contract_capabilities(dispatch.capabilities(), sublayer_dtype=True)  # M1a probes

    def versions(self) -> Dict[str, str]:
        from attnres_mlx import __version__
        return dict(super().versions(), attnres_mlx=__version__)

    def implementations_used(self) -> Dict[str, int]:
        """Op calls per implementation (`attnres_mlx.dispatch.impl_counts`) since creation."""
        return implementation_counts(dict(dispatch.impl_counts()), self._since)

    def probe(self, config, params, embedding, sublayer_weights, *, schedule, mix, scale,
              sublayer_dtype=None):
        if sublayer_dtype is None:
            return probe.probe_forward(config, params, embedding, sublayer_weights, schedule=schedule,
                                       mix=mix, scale=scale)
        # M1a: `probe_forward`'s router and sublayers, each sublayer returning sublayer_dtype.
        router = DepthRouter(config, sublayer_weights.shape[0], embedding.shape[-1])
        router.update(dict(params))
        sublayers = self.sublayers_in(probe.probe_sublayers(sublayer_weights, config.eps,
                                                            prenorm=not config.fuse_out_norm), sublayer_dtype)
        return router(embedding, sublayers, schedule=schedule, mix=mix, scale=scale)


backend = AttnresMLX()
