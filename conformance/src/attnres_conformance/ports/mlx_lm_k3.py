"""mlx-lm's Kimi K3 AttnRes mix (`mlx_lm.models.kimi_k3`, MLX) on `adapters.mlx.MLXAdapter`.

    pip install "mlx[cpu]" mlx-lm==0.32.2
    attnres-conformance --backend attnres_conformance.ports.mlx_lm_k3:backend

The port is a model's internals, called here as the model calls them: the finished blocks in a
`ResidualBlocks` (raw sources stacked `[K, ..., D]` and their float32 inverse RMS, computed when a
block is appended), the running partial sum as the last source, and `w_eff [D]` in float32, the
model's own fold of the key-norm gain into the query (`norm.weight.astype(float32) * proj.weight`),
to which the adapter adds the logit scale (u = q * g * scale, spec 2.1); then `_attn_res_mix`
(on the CPU: the compiled `_attn_res_combine`, differentiable; the Metal kernel serves inference on
Apple GPUs and has no VJP).  Declared: float32, float16, bfloat16 (every step in float32, so
float64 is not declared), one static query, no lse / weights, no argument checks.
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict

import mlx.core as mx

from ..adapters.mlx import MLXAdapter
from ..backend import Capabilities

PACKAGE = "mlx-lm"
SKIPS = ""


class KimiK3(MLXAdapter):
    name = "mlx-lm-kimi-k3"

    def is_available(self) -> bool:
        try:
            import mlx_lm.models.kimi_k3  # noqa: F401
        except ImportError:
            return False
        return True

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "float16", "bfloat16"), ops=frozenset({"depth_attention"}),
                            options=frozenset(), variants=frozenset(), validates_inputs=False)

    def versions(self) -> Dict[str, str]:
        return {"mlx": metadata.version("mlx"), PACKAGE: metadata.version(PACKAGE)}

    def depth_attention(self, sources, query, norm_weight, *, eps=1e-6, scale=1.0):
        from mlx_lm.models.kimi_k3 import ResidualBlocks, _attn_res_mix

        w_eff = query.astype(mx.float32) * scale
        if norm_weight is not None:
            w_eff = norm_weight.astype(mx.float32) * w_eff
        blocks = ResidualBlocks(eps)
        for x in list(sources)[:-1]:
            blocks.append(x)
        return _attn_res_mix(blocks, list(sources)[-1], w_eff, eps)


backend = KimiK3()
