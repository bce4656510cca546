"""torch's `ResidualOps`: the primitives the shared residual schedule (`attnres_core.schedule`)
runs on.  `DepthRouter`, `stream()`, `DepthMonitor` and the sequence- and pipeline-parallel
wiring all drive `ResidualStream` with this object; nothing in torch re-derives the schedule.

Dtypes (C10): the stream keeps the embedding's dtype (M1a: `push` casts every v_l to it with
`cast_like`, so under `torch.autocast` the sublayers' bfloat16 / float16 outputs join a float32
stream, as PreNorm's `h + v` does; a bfloat16 model keeps a bfloat16 stream); the scheme's own
parameters (alphas, gate, static depth weights, query projections) are cast to it, and its own
products run in it with autocast off (`matmul`); the depth-attention query and gain go to the
ops as they are (the ops compute in float32, float64 for float64, with autocast disabled, and
round once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attnres_core.schedule import ResidualOps, split_result

from . import dispatch, ops
from ._args import autocast_off, compute_dtype


class TorchOps(ResidualOps):
    """params: name -> tensor of `ResidualConfig.param_shapes(L, D)` (a missing or None
    "norm_weights" means a gainless key norm); save: the depth-attention ops' `save` ("auto",
    "out", "stats": what their backward keeps, `ops.depth_attention`)."""

    def __init__(self, params=None, *, save: str = "auto"):
        super().__init__(params)
        dispatch.check_save(save)
        self.save = save

    def cast_like(self, x, like):
        """x in like's dtype (x itself when it has it; the backward rounds the cotangent to x's)."""
        return x.to(like.dtype)

    def to_compute(self, x):
        return x.to(compute_dtype(x.dtype))

    def rmsnorm(self, x, eps):
        return F.rms_norm(x, (x.shape[-1],), eps=eps)

    def matmul(self, x, w):
        """`x @ w` in the operands' dtype, outside autocast (M1a: the scheme's own products, the
        gate, the input-dependent query and M13's effective query, stay in the stream's dtype)."""
        with autocast_off(x.device):
            return x @ w

    def sigmoid(self, x):
        return torch.sigmoid(x)

    def tanh(self, x):
        return torch.tanh(x)

    def rmsnorm_gain(self, x, weight, eps):
        """M15 composed: `rmsnorm(x) * weight` in the compute dtype, rounded once (C10)."""
        c = compute_dtype(x.dtype)
        return F.rms_norm(x.to(c), (x.shape[-1],), weight.to(c), eps=eps).to(x.dtype)

    def depth_attention(self, sources, stats, query, norm_weight, config, *, return_weights,
                        out_norm_weight=None):
        result = ops.depth_attention(sources, query, norm_weight, eps=config.eps,
                                     scale=config.scale, num_heads=config.num_heads,
                                     activation=config.activation, key_norm=config.key_norm,
                                     return_weights=return_weights, out_norm_weight=out_norm_weight,
                                     save=self.save)
        return split_result(result, out_norm_weight, return_weights)

    def depth_attention_multi(self, sources, stats, queries, norm_weights, config):
        return ops.depth_attention_multi(sources, queries, norm_weights, eps=config.eps,
                                         scale=config.scale, save=self.save)

    def merge_partial(self, out1, lse1, partial, query, norm_weight, config):
        return ops.merge_partial(out1, lse1, partial, query, norm_weight, eps=config.eps,
                                 scale=config.scale)
