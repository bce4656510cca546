"""Deprecated: the conformance adapter moved into the suite, `attnres_conformance.adapters.torch`
(registry name "torch"); this alias keeps `import attnres_torch.conformance` and its names
`backend` and `TorchBackend` working for one release.  It needs attnres-conformance installed."""

import warnings

warnings.warn("attnres_torch.conformance is deprecated and will be removed in the next release: the "
              "adapter is attnres_conformance.adapters.torch (attnres-conformance --backend torch)",
              DeprecationWarning, stacklevel=2)

try:
    from attnres_conformance.adapters.torch import TorchAdapter as TorchBackend
    from attnres_conformance.adapters.torch import backend
except ImportError as exc:  # the backend no longer depends on the suite
    raise ImportError("attnres_torch.conformance (deprecated) needs the conformance suite: "
                      "pip install attnres-conformance") from exc

__all__ = ["TorchBackend", "backend"]
