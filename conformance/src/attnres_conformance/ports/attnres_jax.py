"""attnres_jax on `adapters.jax.JaxAdapter` (registry name "jax").

Only public names of attnres_jax are used: the ops, `stack.probe_forward` (with
`probe_sublayers` and `stack_apply` for sublayers of another dtype, M1a) and the backend
contract of `attnres_jax.dispatch` (capabilities, and `impl_counts()` for which implementation
served each call).  Calls run on the contract's first device.
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict

from attnres_jax import dispatch, ops, probe_sublayers, stack_apply
from attnres_jax.stack import probe_forward

from ..adapters.jax import DTYPES, JaxAdapter
from ..backend import Capabilities
from . import contract_capabilities


class AttnresJax(JaxAdapter):
    name = "jax"
    ops = ops
    #: The forward cell of a gradient case reads the outputs of the case's gradient call
    #: (`checks.check_reference`): attnres_jax's custom VJPs compute their primal with their fwd
    #: rule (`attnres_jax.dispatch`), so the forward-only program and the forward of the gradient
    #: program trace the same code, and a case compiles once instead of twice.  Forward-only
    #: cases and the determinism and invariant checks still call the forward alone;
    #: backend_jax's own tests hold jitted forward-only calls to the reference.
    forward_in_gradient_call = True

    def capabilities(self) -> Capabilities:
        caps = dispatch.capabilities()
        return contract_capabilities(caps, dtypes=tuple(d for d in DTYPES if d in caps["dtypes"]),
                                     devices=caps["devices"][:1], sublayer_dtype=True)

    def versions(self) -> Dict[str, str]:
        from attnres_jax import __version__

        out = dict(super().versions(), attnres_jax=__version__)
        try:
            out["flax"] = metadata.version("flax")
        except metadata.PackageNotFoundError:
            out["flax"] = "not installed"
        return out

    def implementations_used(self) -> Dict[str, int]:
        """Adapter calls per implementation: "pallas" when an op call traced in it was served by
        the Pallas kernels (`dispatch.impl_counts()` grew there), else "xla"."""
        return dict(self._counts)

    def _count(self, full, run):
        """run(), counted under its implementation (decided when `full` first traced: a cached
        executable traces no op call)."""
        before = dispatch.impl_counts()
        out = run()
        impl = self._impl.get(full) or ("pallas" if dispatch.impl_counts()["pallas"] > before["pallas"] else "xla")
        if full is not None:
            self._impl[full] = impl
        self._counts[impl] = self._counts.get(impl, 0) + 1
        return out

    def probe(self, config, params, embedding, sublayer_weights, *, schedule, mix, scale,
              sublayer_dtype=None):
        if sublayer_dtype is None:
            return probe_forward(config, params, embedding, sublayer_weights, schedule=schedule, mix=mix,
                                 scale=scale)
        # M1a: `probe_forward`'s sublayers, each returning sublayer_dtype, on the same stack.
        sublayers = self.sublayers_in(probe_sublayers(sublayer_weights, config.eps, prenorm=not config.fuse_out_norm),
                                      sublayer_dtype)
        return stack_apply(config, params, embedding, sublayers, schedule=schedule, mix=mix, scale=scale)


backend = AttnresJax()
