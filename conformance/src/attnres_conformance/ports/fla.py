"""flash-linear-attention's `fla.ops.attnres.naive_attnres` (torch) on `adapters.torch.TorchAdapter`.

    pip install flash-linear-attention==0.6.0 fla-core==0.6.0 triton  # triton: fla imports it
    attnres-conformance --backend attnres_conformance.ports.fla:backend --skips fla-skips.txt

(`fla-skips.txt`: the text of `SKIPS` below; `python -m attnres_conformance.ports.fla` prints it.)
The port's call is `naive_attnres(query [D], residuals: list of [..., D], rms_weight [D],
output_rms_weight=None, rms_eps, scale, return_weights)`.  Its design, declared: every step in
float32 whatever the input dtype (so float64 is not declared: a float64 result carries float32
rounding), a required key-norm gain (a gainless case passes ones, the same function), one
static query `[D]`, sources given as a list of contiguous tensors (it `view`s them), a fused
output norm that returns only the normed output and uses `rms_eps` for both norms.  It checks
no argument beyond "at least one source" (`validates_inputs=False`: a spec error it does not
raise is listed as a validation gap, not a failure).
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict

import torch

from ..adapters.torch import TorchAdapter
from ..backend import Capabilities

PACKAGE = "flash-linear-attention"
#: The port's skips: design choices `Capabilities` has no field for, one rule a line with its reason.
SKIPS = """\
depth_attention/out_norm/*out_norm_eps*  # the fused output norm has no eps of its own: rms_eps serves both norms
*outnorm_eps*  # (the same, in the covering arrays and the forward-only rows)
*outnormeps*  # (the same, in the golden vectors)
"""


class FlaNaive(TorchAdapter):
    name = "fla-naive"

    def is_available(self) -> bool:
        try:
            import fla.ops.attnres  # noqa: F401
        except Exception:  # ImportError, or a Triton that fails to load
            return False
        return True

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "float16", "bfloat16"), ops=frozenset({"depth_attention"}),
                            options=frozenset({"weights", "out_norm"}), variants=frozenset(),
                            out_norm_outputs=("out_normed",), validates_inputs=False)

    def versions(self) -> Dict[str, str]:
        return {"torch": torch.__version__, PACKAGE: metadata.version(PACKAGE)}

    def depth_attention(self, sources, query, norm_weight, *, eps=1e-6, scale=1.0, return_weights=False,
                        out_norm_weight=None):
        from fla.ops.attnres import naive_attnres

        gain = torch.ones_like(query) if norm_weight is None else norm_weight  # no gain = a gain of ones
        return naive_attnres(query, list(sources), gain, output_rms_weight=out_norm_weight, rms_eps=eps,
                             scale=scale, return_weights=return_weights)


backend = FlaNaive()

if __name__ == "__main__":
    print(SKIPS, end="")
