"""`bench/kernel_report.py --part pallas` lowers for `cuda` on a machine with no GPU, also with
JAX >= 0.11 (the H200 image has 0.11.2), whose Pallas Triton lowering asks for the GPU's compute
capability and, finding no GPU, raised "No supported GPU devices found": `target_device("cuda")`
names an abstract H200 (`jax.sharding.use_abstract_mesh`) for the lowering to read instead.
The lowering itself is tested in `test_pallas_lowering.py`, through the same context."""

from __future__ import annotations

import importlib

import jax
import kernel_report as report  # bench/ is on sys.path (bench/tests/conftest.py)
import pytest


def _abstract_device():
    return jax.sharding.get_abstract_mesh().abstract_device


def test_target_device_names_an_h200_for_cuda_only():
    before = _abstract_device()
    with report.target_device("cuda"):
        dev = _abstract_device()
        assert (dev.device_kind, dev.num_cores, dev.platform) == ("NVIDIA H200", 132, "gpu")
    assert _abstract_device() == before
    with report.target_device("tpu"):
        assert _abstract_device() == before


def test_the_triton_lowering_reads_the_h200_without_a_gpu():
    """JAX >= 0.11: the lookup the Triton lowering makes; refused here without the context (no
    GPU on this machine), sm_90 with it."""
    try:
        gpu_info = importlib.import_module("jax._src.pallas.triton.gpu_info")
    except ImportError:
        pytest.skip(f"JAX {jax.__version__}: the Pallas Triton lowering makes no GPU-info lookup")
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present: the lookup would find it")
    with pytest.raises(ValueError):
        gpu_info.get_gpu_info()
    with report.target_device("cuda"):
        assert gpu_info.get_gpu_info().compute_capability == 90
