"""Static sm_90 report of the Triton kernels (`bench/kernel_report.py`, issue 13), no GPU needed.

Every kernel launch of `triton_depth` at a shape is captured on "meta" tensors, bound with
Triton's own launcher specialization, compiled for `GPUTarget("cuda", 90, 32)` and assembled with
the ptxas shipped in the Triton wheel (`-v`).  Asserted: no register spills (benchmark shapes and
the report's edge shapes, separately), 16-byte global loads and stores and no narrower than 4
bytes at the benchmark shapes (bf16, D a multiple of 8; `TINY_KERNELS`, the 128-byte table fill,
exempt), every `*_kernel` of `triton_depth` compiled.  The occupancy and PTX-width helpers are checked on known inputs first.

Skipped with the reason when Triton, its CUDA backend or its ptxas is absent, or under
TRITON_INTERPRET=1 (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted, nothing to compile for sm_90",
                allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend is absent")

import kernel_report as report  # noqa: E402  (bench/ is on sys.path: bench/tests/conftest.py)

if report.ptxas_path() is None:
    pytest.skip("no ptxas binary in the Triton wheel (triton/backends/nvidia/bin)", allow_module_level=True)

BENCH = [c for c in report.TRITON_CASES if c.bench]
EDGE = [c for c in report.TRITON_CASES if not c.bench]


@pytest.fixture(scope="module")
def bench_rows():
    return report.triton_rows(BENCH)


@pytest.fixture(scope="module")
def edge_rows():
    return report.triton_rows(EDGE)


def _where(r):
    return f"{r['case']}: {r['kernel']} (tile {r['tile']}, {r['num_warps']} warps, {r['registers']} regs)"


def test_occupancy_model():
    # sm_90: 64 regs x 16 warps = 32K registers -> 2 CTAs (threads allow 4); 68 regs round up to 72 per thread
    # (2304 per warp) -> 28 warps -> 1 CTA of 16; 177 regs x 8 warps -> 1; shared memory limits too.
    assert report.occupancy(64, 64, 16) == (2, "registers")
    assert report.occupancy(68, 64, 16)[0] == 1
    assert report.occupancy(177, 8192, 8) == (1, "registers")
    assert report.occupancy(32, 100 * 1024, 4) == (2, "smem")


def test_ptx_access_widths():
    ptx = """
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.b64 %rd5, [ %rd4 + 0 ];
        ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd2 + 0 ];
        @%p2 st.global.b16 [ %rd3 + 0 ], { %rs1 };
        st.global.v4.b32 [ %rd3 + 0 ], { %r1, %r2, %r3, %r4 };
        ld.shared.v4.b32 { %r1, %r2, %r3, %r4 }, [ %r9 + 0 ];
        cp.async.cg.shared.global [ %r10 + 0 ], [ %rd8 + 0 ], 0x10, %r11;
        cp.async.ca.shared.global [ %r12 + 0 ], [ %rd9 + 0 ], 4;
        cp.async.commit_group;
    """
    acc = report.global_accesses(ptx)
    assert acc["ld"] == collections.Counter({16: 2, 8: 2, 4: 1})
    assert acc["st"] == collections.Counter({16: 1, 2: 1})


def test_every_kernel_is_compiled(bench_rows, edge_rows):
    """Every launched `@triton.jit` kernel of the Triton implementation (its helpers, also
    JIT functions, are inlined into them) has a compiled row."""
    from attnres_torch.kernels import triton_depth
    from triton.runtime.jit import JITFunction

    kernels = {name for name, obj in vars(triton_depth).items()
               if name.endswith("_kernel") and isinstance(obj, JITFunction)}
    assert kernels and kernels == {r["kernel"] for r in bench_rows + edge_rows}


def test_no_spills_at_benchmark_shapes(bench_rows):
    spilled = [f"{_where(r)}: spill stores/loads {r['spill_stores']}/{r['spill_loads']} B"
               for r in bench_rows if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled


def test_no_spills_at_edge_shapes(edge_rows):
    """No spills, except the known ones of `report.SPILL_BOUNDS`, held to their bound."""
    spilled = [f"{_where(r)}: spill stores/loads {r['spill_stores']}/{r['spill_loads']} B"
               for r in edge_rows
               if max(r["spill_stores"], r["spill_loads"])
               > report.SPILL_BOUNDS.get((r["case"], r["kernel"]), 0)]
    assert not spilled, spilled


def test_vectorized_global_loads_and_stores_at_benchmark_shapes(bench_rows):
    scalar = []
    for r in bench_rows:
        if r["kernel"] in report.TINY_KERNELS:  # a 128-byte table fill: nothing to vectorize
            continue
        if r["narrow_loads"] or r["narrow_stores"] or r["widest_load"] < 16 or r["widest_store"] < 16:
            scalar.append(f"{_where(r)}: loads {r['loads']}, stores {r['stores']} (bytes: count)")
    assert not scalar, scalar


def test_record_launches_runs_nothing_and_restores_the_module():
    """`triton_depth.record_launches`: the forward's launches are recorded on meta tensors (no
    kernel runs, nothing is allocated on a device) and the module's own allocation, launch and
    table cache come back after the block, also when it raises."""
    import torch
    from attnres_torch.kernels import triton_depth as td

    saved = (td._alloc, td._launch, td._TABLES)
    xs = [torch.empty(64, 256, dtype=torch.bfloat16, device="meta") for _ in range(5)]
    q = torch.empty(256, dtype=torch.float32, device="meta")
    with td.record_launches() as launches:
        out, lse = td.forward(xs, q, q, 1e-6, 1.0)
    assert launches and all(hasattr(k, "fn") and k.fn.__name__.endswith("_kernel") for k, _, _, _ in launches)
    assert out.device.type == "meta" and lse.device.type == "meta" and tuple(out.shape) == (64, 256)
    assert all(a is b for a, b in zip((td._alloc, td._launch, td._TABLES), saved))
    with pytest.raises(RuntimeError, match="inside"):
        with td.record_launches():
            raise RuntimeError("inside")
    assert all(a is b for a, b in zip((td._alloc, td._launch, td._TABLES), saved))


def test_poisoned_outputs_fills_every_buffer_with_nan_and_restores():
    """`triton_depth.poisoned_outputs` (bench/gpu_check.py's proof that a kernel wrote every
    element): inside, every buffer the host code allocates is NaN; after, allocation is plain."""
    import torch
    from attnres_torch.kernels import triton_depth as td

    saved = td._alloc
    with td.poisoned_outputs():
        buf = td._alloc((3, 4), torch.float32, "cpu")
        assert torch.isnan(buf).all() and buf.shape == (3, 4)
    assert td._alloc is saved
