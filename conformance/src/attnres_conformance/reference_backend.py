"""The float64 NumPy reference as a `Backend`: kept under its old name for the meta-tests and
existing imports; the adapter lives in `adapters/numpy.py` (registry name "numpy")."""

from .adapters.numpy import NUMPY_DTYPES, VJP_ATTRS, backend, native
from .adapters.numpy import NumpyAdapter as ReferenceBackend

__all__ = ["NUMPY_DTYPES", "VJP_ATTRS", "ReferenceBackend", "backend", "native"]
