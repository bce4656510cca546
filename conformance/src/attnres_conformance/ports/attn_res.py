"""attn-res's `attn_res.AttnResOperator` (torch) on `adapters.torch.TorchAdapter`.

    pip install attn-res==0.1.0
    attnres-conformance --backend attnres_conformance.ports.attn_res:backend

The port is a module, `AttnResOperator(d_model, eps)` with one parameter `pseudo_query [D]`,
called on stacked sources `[N, B, T, D]` (4-D only).  It has no key-norm gain and no logit
scale: the adapter serves both through the query, the exact fold u = q * g * scale (spec 2.1),
run with `torch.func.functional_call(op, {"pseudo_query": u}, ...)` so autograd gives d_query and
d_norm_weight through the product.  Token axes are flattened into T (B = 1).  The port checks no
argument (`validates_inputs=False`: a spec error it does not raise is a validation gap).
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict

import torch

from ..adapters.torch import TorchAdapter
from ..backend import Capabilities

PACKAGE = "attn-res"
SKIPS = ""


class AttnRes(TorchAdapter):
    name = "attn-res"

    def is_available(self) -> bool:
        try:
            import attn_res  # noqa: F401
        except ImportError:
            return False
        return True

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float64", "float32", "float16", "bfloat16"),
                            ops=frozenset({"depth_attention"}), options=frozenset({"stacked", "strided"}),
                            variants=frozenset(), validates_inputs=False)

    def versions(self) -> Dict[str, str]:
        return {"torch": torch.__version__, PACKAGE: metadata.version(PACKAGE)}

    def depth_attention(self, sources, query, norm_weight, *, eps=1e-6, scale=1.0):
        from attn_res import AttnResOperator

        x = sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))
        n, dim = x.shape[0], x.shape[-1]
        u = query * scale if norm_weight is None else query * norm_weight * scale  # the fold
        op = AttnResOperator(dim, eps=eps)
        out = torch.func.functional_call(op, {"pseudo_query": u}, (x.reshape(n, 1, -1, dim),))
        return out.reshape(x.shape[1:])


backend = AttnRes()
