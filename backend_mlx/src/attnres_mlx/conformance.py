"""Deprecated: the conformance adapter moved into the suite, `attnres_conformance.adapters.mlx`
(registry name "mlx"); this alias keeps `import attnres_mlx.conformance` and its names
`backend` and `MLXBackend` working for one release.  It needs attnres-conformance installed."""

import warnings

warnings.warn("attnres_mlx.conformance is deprecated and will be removed in the next release: the "
              "adapter is attnres_conformance.adapters.mlx (attnres-conformance --backend mlx)",
              DeprecationWarning, stacklevel=2)

try:
    from attnres_conformance.adapters.mlx import MLXAdapter as MLXBackend
    from attnres_conformance.adapters.mlx import backend
except ImportError as exc:  # the backend no longer depends on the suite
    raise ImportError("attnres_mlx.conformance (deprecated) needs the conformance suite: "
                      "pip install attnres-conformance") from exc

__all__ = ["MLXBackend", "backend"]
