"""Shared test helpers: random inputs exact in a dtype, float64 upcasts, and the comparison with
the float64 reference under the conformance suite's one tolerance table."""

from __future__ import annotations

import numpy as np
import torch
from attnres_conformance.tolerances import TOLERANCES, rel_err, tolerance

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}

#: Gradients in these dtypes are held to the table's value column, stricter than the suite's
#: gradient column: float64 runs the reference's math in the reference's precision; these tests
#: held its gradients to 1e-10 before they took the suite's table, and use < 1e-4 of that bound.
GRADS_AT_VALUE_COLUMN = ("float64",)


def compute_dtype(dtype_name: str) -> str:
    """The dtype of lse and weights for inputs of `dtype_name` (C10.3: the compute dtype)."""
    return "float64" if dtype_name == "float64" else "float32"


def rtol_for(dtype_name: str, *, grad: bool) -> float:
    """The rtol these tests hold an array of `dtype_name` to: the suite's table
    (`attnres_conformance.tolerances.TOLERANCES`), value or gradient column."""
    return tolerance(dtype_name, grad=grad and dtype_name not in GRADS_AT_VALUE_COLUMN)


def rand(gen: torch.Generator, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def f64(t) -> np.ndarray:
    """The exact values of a tensor (or list of tensors) as float64 NumPy."""
    if isinstance(t, (list, tuple)):
        return [f64(x) for x in t]
    return None if t is None else t.detach().to(torch.float64).numpy()


def assert_close(got, ref, dtype_name: str, what: str = "", *, grad: bool) -> None:
    """`got` (a tensor, array or list of them) against the float64 reference `ref` (computed on
    the same, upcast inputs), exactly as the conformance suite compares them
    (`attnres_conformance.tolerances`): `rel_err = max_i |g_i - r_i| / (|r_i| + max(rms(r), atol))
    <= rtol` of the `dtype_name` row, its value column or, with `grad=True`, its gradient column.
    `dtype_name` is the dtype the result is in: the sources' for `out` and their gradients, the
    compute dtype for lse, weights and float32 parameters' gradients (`rtol_for`)."""
    if isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), what
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_close(g, r, dtype_name, f"{what}[{i}]", grad=grad)
        return
    got = f64(got) if isinstance(got, torch.Tensor) else np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    err, message = rel_err(got, ref, TOLERANCES[dtype_name].atol)
    rtol = rtol_for(dtype_name, grad=grad)
    assert err <= rtol, f"{what}: rel_err {err:.3g} > rtol {rtol:.3g} ({dtype_name}); {message}"


def leaves(xs):
    """Fresh leaf copies requiring grad (a list, or one tensor)."""
    if isinstance(xs, (list, tuple)):
        return [leaves(x) for x in xs]
    return None if xs is None else xs.detach().clone().requires_grad_(True)


def stock_schedule_step(rank: int, chunks, layout: str, microbatches: int, tokens, target, loss_fn):
    """One step of torch's stock pipeline schedule `layout` ("gpipe", "1f1b": one stage per
    rank; "interleaved": two) over this rank's stages of `chunks` (`pipeline_stages`): (the losses
    the last stage reports, {(stage index, parameter name): gradient as numpy})."""
    from attnres_torch.distributed import pipeline_stages
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
    stages = pipeline_stages(chunks, "cpu")
    schedule = kinds[layout](stages if layout == "interleaved" else stages[0], microbatches,
                             loss_fn=loss_fn)
    last = any(s.is_last for s in stages)
    losses = []
    schedule.step(*((tokens,) if rank == 0 else ()), target=target if last else None, losses=losses)
    grads = {(s.stage_index, n): p.grad.numpy().copy()
             for s in stages for n, p in chunks[s.stage_index].named_parameters()}
    return [loss.item() for loss in losses], grads
