"""Deprecated: the conformance adapter moved into the suite, `attnres_conformance.adapters.jax`
(registry name "jax"); this alias keeps `import attnres_jax.conformance` and its names
`backend` and `JaxBackend` working for one release.  It needs attnres-conformance installed."""

import warnings

warnings.warn("attnres_jax.conformance is deprecated and will be removed in the next release: the "
              "adapter is attnres_conformance.adapters.jax (attnres-conformance --backend jax)",
              DeprecationWarning, stacklevel=2)

try:
    from attnres_conformance.adapters.jax import JaxAdapter as JaxBackend
    from attnres_conformance.adapters.jax import backend
except ImportError as exc:  # the backend no longer depends on the suite
    raise ImportError("attnres_jax.conformance (deprecated) needs the conformance suite: "
                      "pip install attnres-conformance") from exc

__all__ = ["JaxBackend", "backend"]
