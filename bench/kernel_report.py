"""Static kernel report for sm_90 (H200) and TPU that needs no GPU (issue 13, item 1).

    python bench/kernel_report.py [--part all|triton|pallas] [--quick] [--json PATH]
                                  [--torch-python PY] [--jax-python PY]

Two parts, each in its own environment (torch+Triton and JAX are separate nox environments):

* `--part triton` (run it with the torch env, e.g. `.nox/tests-torch/bin/python`): captures every
  kernel launch of `attnres_torch.kernels.triton_depth` at the benchmark shapes (on "meta"
  tensors, `triton_depth.record_launches`: nothing is allocated or run), binds the arguments
  with Triton's own launcher specialization (divisibility-16 and ==1 attributes, constexprs,
  num_warps exactly as a launch on a GPU would), compiles each specialization with
  `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` and runs the `ptxas`
  shipped in the Triton wheel (`-v`) on the PTX.  Per kernel: registers, spill stores/loads,
  shared memory, CTAs/SM and what limits them, the width of every global load/store in the PTX,
  whether the source loop is software-pipelined (`cp.async` in the PTX), and the bytes in flight
  per SM against what Little's law needs (`NEEDED_PER_SM`).
* `--part pallas` (run it with the JAX env, e.g. `.nox/tests-jax/bin/python`): every Pallas kernel
  of `attnres_jax.kernels.pallas` at the benchmark shapes, for the platforms `tpu` and `cuda`
  (the GPU lowering JAX picks by default, and the Triton lowering with
  `jax_pallas_use_mosaic_gpu=False`), lowered on the CPU with
  `jax.jit(f).trace(*abstract args).lower(lowering_platforms=(platform,))` (for `cuda` under an
  abstract mesh of one H200, `target_device`: JAX >= 0.11 reads the GPU from it and needs no
  device, e.g. the H200 image's JAX 0.11.2 without a GPU plugin): lowered, or refused
  (first line of the error); and what the dispatch plan (`Pallas().supports`) says for the
  platform (pallas, or routed to XLA and why).  The kernels the Triton lowering produced are
  then compiled for sm_90 too: their Triton IR is taken from the lowered custom call (printed by
  JAX's own Triton dialect) and compiled by `triton.compile` and the wheel's ptxas in the torch
  env (`--torch-python`; `compile_ttir_child`): warps, registers and spills per kernel.
* `--part all` (default): runs both parts as child processes, each with its env's python
  (`--torch-python` / `--jax-python`, default the nox envs under `.nox/` when present, else this
  interpreter), and prints both tables.

Output: markdown tables on stdout, progress on stderr (a compile takes ~0.1-2 s), `--json PATH`
the rows as JSON ({"triton": {...}, "pallas": {...}}).  `--quick` keeps the benchmark shapes
only (no edge shapes).  The CI tests (`bench/tests/torch/test_kernel_report.py`,
`bench/tests/jax/test_pallas_lowering.py`) import this file and run a few of its cases.

Model behind "bytes in flight" (a static estimate, not a measurement): a CTA keeps one loop step
of loads in flight (one source tile per step of the source loop; the merge kernel: its two input
tiles; the reduction: one `[BLOCK_D]` fp32 row), `num_stages - 1` steps when the loop is
pipelined (cp.async); times the CTAs resident on an SM (occupancy from registers, shared memory,
threads), spread over the busy SMs of the grid and averaged over all 132.  This is an upper bound
for an unpipelined loop: between loads the CTA reduces and waits at barriers, so the average is
lower.  Needed: latency x bandwidth / SMs = 700 ns x 4.3 TB/s / 132 = 22.3 KiB (19.1-25.5 KiB for
600-800 ns).  "reads/src": how often the kernel reads each source row from memory or L2 (the
forward reads it once per group of BLOCK_S queries; the backward twice unless delta comes from an
fp32 `out`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
EPS, SCALE = 1e-6, 1.0

# H200 (sm_90): 132 SMs, 64K 32-bit registers, 228 KB shared memory, 2048 threads, 32 CTAs per
# SM; 1 KB of shared memory reserved per CTA; registers allocated per warp in units of 256.
SMS, REGS_PER_SM, SMEM_PER_SM, THREADS_PER_SM, CTAS_PER_SM = 132, 65536, 233472, 2048, 32
SMEM_RESERVED_PER_CTA, REG_UNIT = 1024, 256
HBM_BYTES_PER_S, LATENCY_S = 4.3e12, 700e-9
NEEDED_PER_SM = HBM_BYTES_PER_S * LATENCY_S / SMS          # Little's law: ~22.3 KiB per SM


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- cases

@dataclasses.dataclass(frozen=True)
class Case:
    """One host call of `triton_depth` (op: forward, fwd+bwd, phase1, merge) at N sources
    `[T, D]` bf16 (S queries for phase1); `bench` marks the benchmark shapes."""

    name: str
    op: str
    n: int
    t: int
    d: int
    s: int = 1
    bench: bool = True


TRITON_CASES = (
    Case("forward 9x8192x7168", "forward", 9, 8192, 7168),
    Case("fwd+bwd 10x32768x4096", "fwd+bwd", 10, 32768, 4096),
    Case("phase1 8 blocks S=12 8192x7168", "phase1", 8, 8192, 7168, s=12),
    Case("merge 8192x7168", "merge", 1, 8192, 7168),
    Case("fwd+bwd out-norm 10x32768x4096", "fwd+bwd out-norm", 10, 32768, 4096),
    Case("fwd+bwd D=1", "fwd+bwd", 9, 8192, 1, bench=False),
    Case("fwd+bwd D=7", "fwd+bwd", 9, 8192, 7, bench=False),
    Case("fwd+bwd D=16384", "fwd+bwd", 9, 8192, 16384, bench=False),
    Case("fwd+bwd N=1", "fwd+bwd", 1, 8192, 4096, bench=False),
    Case("fwd+bwd N=300", "fwd+bwd", 300, 8192, 4096, bench=False),
    Case("fwd+bwd out-norm D=8192", "fwd+bwd out-norm", 9, 8192, 8192, bench=False),
)
#: Kernels that move a few bytes, exempt from the vector-width checks (reported once, at the first
#: case that launches them), and why.
TINY_KERNELS = {"_fill_table_kernel": "writes one <= 128-byte pointer/stride table from its "
                                      "arguments (no loads), once per table the cache misses"}

#: Known, bounded spills (bytes of spill stores or loads, at most): the output norm's backward at
#: the widest one-tile row (D = 8192, 8 warps) needs ~10 registers more than a thread's 255.
SPILL_BOUNDS = {("fwd+bwd out-norm D=8192", "_depth_bwd_kernel"): 64,
                # Triton 3.6 / ptxas 12.8 (the H200 image's) only: the persistent forward's row
                # loop at D = 7 (256-row tiles, 16 warps) fits 64 registers with 16 B of spills
                ("fwd+bwd D=7", "_depth_fwd_kernel"): 16}


# ------------------------------------------------------------------------------- Triton part

def capture_launches(case: Case) -> list:
    """[(kernel, grid, args, meta)] of the host call `case`, on meta tensors (nothing runs;
    `triton_depth.record_launches`)."""
    import torch
    from attnres_torch.kernels import triton_depth as td

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    n, t, d, s = case.n, case.t, case.d, case.s
    f32 = torch.float32
    with td.record_launches() as launches:  # cold tables: every case fills its own
        xs = [meta(t, d) for _ in range(n)]
        if case.op == "forward":
            td.forward(xs, meta(d, dtype=f32), meta(d, dtype=f32), EPS, SCALE)
        elif case.op == "fwd+bwd":
            q, g = meta(d, dtype=f32), meta(d, dtype=f32)
            out, lse = td.forward(xs, q, g, EPS, SCALE)
            td.backward(xs, q, g, out, lse, meta(t, d), None, EPS, SCALE)
        elif case.op == "fwd+bwd out-norm":  # the fused output norm (C17), widest D: 8192
            q, g, w = meta(d, dtype=f32), meta(d, dtype=f32), meta(d, dtype=f32)
            out, lse, _, _ = td.forward(xs, q, g, EPS, SCALE, out_norm=(w, EPS))
            td.backward(xs, q, g, out, lse, meta(t, d), None, EPS, SCALE,
                        out_norm=(w, EPS, meta(t, d)))
        elif case.op == "phase1":
            td.multi_forward(xs, meta(s, d, dtype=f32), meta(s, d, dtype=f32), EPS, SCALE)
        elif case.op == "merge":       # out1[i] of a phase-1 result [S, T, D], lse1[i] [T]
            out1, lse1 = meta(12, t, d)[1], meta(12, t, dtype=f32)[1]
            td.merge_forward(out1, lse1, meta(t, d), meta(d, dtype=f32), meta(d, dtype=f32), EPS, SCALE)
        else:
            raise ValueError(f"case.op: unknown op {case.op!r}")
    return launches


def _target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)


def ptxas_path() -> Optional[str]:
    """The ptxas Triton itself uses for sm_90 (shipped in the wheel), or None."""
    try:
        from triton.backends.nvidia import compiler as nv
    except ImportError:
        return None
    try:
        path = nv.get_ptxas(90).path
    except TypeError:                  # older Triton: get_ptxas() takes no arch
        path = nv.get_ptxas().path
    except Exception:                  # noqa: BLE001 - no binary
        return None
    return path if path and os.path.exists(path) else None


def compile_launch(kernel, args, meta):
    """The CompiledKernel of one launch for sm_90, specialized as Triton's launcher would."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = _target()
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **meta)
    # Triton's own (third-party) private packer: what its launcher runs before a compile.
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, spec, opts)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def run_ptxas(ptx: str, ptxas: str) -> Dict[str, int]:
    """`ptxas -v --gpu-name=sm_90a` on one PTX module -> registers, stack, spills, static smem."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        base = [ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")]
        res = subprocess.run(base[:2] + ["--regAllocOptLevel=2"] + base[2:], capture_output=True, text=True)
        if res.returncode != 0:        # a ptxas without --regAllocOptLevel
            res = subprocess.run(base, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"ptxas failed: {res.stderr.strip()[:500]}")
    return {k: int(m.group(1)) if (m := rx.search(res.stderr)) else 0 for k, rx in _PTXAS_RE.items()}


_ACCESS_RE = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_ASYNC_RE = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\S*\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-fA-F]+|\d+)")


def global_accesses(ptx: str) -> Dict[str, collections.Counter]:
    """{"ld": Counter(bytes per instruction), "st": ...} over the global loads/stores of the PTX
    (ld.global.v4.b32 -> 16, st.global.b16 -> 2); a pipelined loop's asynchronous global-to-shared
    copies count as loads of their size (cp.async.cg.shared.global [..], [..], 0x10 -> 16)."""
    out = {"ld": collections.Counter(), "st": collections.Counter()}
    for op, mods in _ACCESS_RE.findall(ptx):
        parts = mods.split(".")
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 0)
        out[op][vec * bits // 8] += 1
    for size in _ASYNC_RE.findall(ptx):
        out["ld"][int(size, 0)] += 1
    return out


def occupancy(regs: int, smem: int, num_warps: int):
    """(CTAs per SM, what limits them) on sm_90."""
    threads = 32 * num_warps
    per_warp = -(-max(regs, 1) * 32 // REG_UNIT) * REG_UNIT
    limits = {
        "threads": THREADS_PER_SM // threads,
        "registers": (REGS_PER_SM // per_warp) // num_warps,
        "smem": SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA),
        "CTA cap": CTAS_PER_SM,
    }
    ctas = min(limits.values())
    return ctas, "/".join(k for k, v in limits.items() if v == ctas)


def step_bytes(name: str, meta: dict, d: int) -> Optional[int]:
    """Bytes one CTA loads per loop step (the model in the module docstring); None if unknown."""
    bt, bd = meta.get("BLOCK_T", 1), min(meta.get("BLOCK_D", 1), d)
    if name == "_depth_fwd_kernel":
        return bt * bd * 2                                 # one bf16 source tile
    if name == "_depth_bwd_kernel":
        return bt * bd * 2 * (1 if meta.get("ONE_TILE") else 2)   # x (and d_out when walking D)
    if name == "_merge_kernel":
        return bt * bd * 2 * 2                             # out1 and partial tiles
    if name == "_reduce_rows_kernel":
        return meta["BLOCK_D"] * 4
    if name == "_phase1_logits_kernel":                   # a bf16 source tile and an fp32 qg tile
        return bt * bd * 2 + bd * meta["BLOCK_S"] * 4
    if name == "_weighted_sum_kernel":                    # a bf16 source tile and its fp32 weights
        return bt * bd * 2 + bt * meta["BLOCK_S"] * 4
    return None


def source_reads(name: str, meta: dict, case: Case) -> int:
    """How often each source row is read per call (see the module docstring)."""
    if name == "_depth_fwd_kernel":
        return -(-case.s // meta["BLOCK_S"])
    if name == "_depth_bwd_kernel":  # the output norm's y walk replaces delta's read of out
        return 1 if meta.get("DELTA_FROM_OUT") and not meta.get("OUT_NORM") else 2
    return 1


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _widths(counter: dict) -> str:
    """{bytes: count} (keys int, or str after a JSON round trip) -> "16Bx10 8Bx2", widest first."""
    items = sorted(((int(b), n) for b, n in counter.items()), reverse=True)
    return " ".join(f"{b}Bx{n}" for b, n in items) or "-"


def analyze_launch(case: Case, kernel, grid, args, meta, ptxas: str) -> dict:
    """One row of the Triton table (see `TRITON_COLUMNS`)."""
    t0 = time.time()
    ck = compile_launch(kernel, args, meta)
    ptx = ck.asm["ptx"]
    info = run_ptxas(ptx, ptxas)
    num_warps = ck.metadata.num_warps
    num_stages = ck.metadata.num_stages
    smem = int(ck.metadata.shared) + info["static_smem"]
    ctas, limiter = occupancy(info["registers"], smem, num_warps)
    acc = global_accesses(ptx)
    pipelined = "cp.async" in ptx
    name = kernel.fn.__name__
    step = step_bytes(name, meta, case.d)
    grid0 = _prod(grid) if isinstance(grid, tuple) else grid        # programs in all
    in_flight = None
    if step is not None:
        resident = min(grid0, SMS * ctas)                 # CTAs running at once
        in_flight = resident * step * ((num_stages - 1) if pipelined else 1) / SMS
    tile = "x".join(str(meta[k]) for k in ("BLOCK_T", "BLOCK_S", "BLOCK_D") if k in meta)
    return {
        "case": case.name, "bench": case.bench, "kernel": name, "grid": grid0, "tile": tile,
        "num_warps": num_warps, "num_stages": num_stages, "registers": info["registers"],
        "stack": info["stack"], "spill_stores": info["spill_stores"],
        "spill_loads": info["spill_loads"], "smem": smem, "ctas_per_sm": ctas, "limiter": limiter,
        "loads": dict(acc["ld"]), "stores": dict(acc["st"]),
        "narrow_loads": sum(n for b, n in acc["ld"].items() if b < 4),
        "narrow_stores": sum(n for b, n in acc["st"].items() if b < 4),
        "widest_load": max(acc["ld"], default=0), "widest_store": max(acc["st"], default=0),
        "source_reads": source_reads(name, meta, case), "pipelined": pipelined, "in_flight_per_sm": in_flight,
        "needed_per_sm": NEEDED_PER_SM, "compile_s": round(time.time() - t0, 2),
    }


def triton_rows(cases=TRITON_CASES) -> List[dict]:
    """Rows for every distinct kernel specialization each case launches (in launch order)."""
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: the kernels are interpreted, there is nothing to compile")
    ptxas = ptxas_path()
    if ptxas is None:
        raise RuntimeError("no ptxas in the Triton wheel (triton/backends/nvidia/bin)")
    rows = []
    log(f"triton {triton.__version__}, ptxas {ptxas}")
    for case in cases:
        seen = set()
        for kernel, grid, args, meta in capture_launches(case):
            key = (kernel.fn.__name__, tuple(sorted((k, str(v)) for k, v in meta.items())))
            if key in seen or (kernel.fn.__name__ in TINY_KERNELS
                               and any(r["kernel"] == kernel.fn.__name__ for r in rows)):
                continue  # a tiny kernel has one specialization: reported once
            seen.add(key)
            log(f"  compiling {kernel.fn.__name__} for {case.name} ...")
            row = analyze_launch(case, kernel, grid, args, meta, ptxas)
            log(f"    {row['compile_s']} s: {row['registers']} regs, spills "
                f"{row['spill_stores']}/{row['spill_loads']} B, {row['ctas_per_sm']} CTAs/SM")
            rows.append(row)
    return rows


def triton_part(quick: bool) -> dict:
    import triton
    cases = [c for c in TRITON_CASES if c.bench or not quick]
    return {"triton_version": triton.__version__, "ptxas": ptxas_version(), "target": "cuda sm_90 (GPUTarget('cuda', 90, 32))",
            "needed_per_sm": NEEDED_PER_SM, "rows": triton_rows(cases)}


def ptxas_version() -> str:
    path = ptxas_path()
    if path is None:
        return "absent"
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def _kb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1024:.1f} KiB"


def triton_markdown(part: dict) -> str:
    lines = [f"Triton {part['triton_version']}, ptxas {part['ptxas']}, {part['target']}; needed in "
             f"flight per SM (Little's law, 700 ns x 4.3 TB/s / 132 SMs): {_kb(part['needed_per_sm'])}.",
             "",
             "| case | kernel | grid | tile (T x S x D) | warps | regs | spill st/ld B | smem B | CTAs/SM "
             "(limit) | global ld widths | global st widths | reads/src | pipelined | in flight/SM | / needed |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|---|---:|---|---:|---:|"]
    for r in part["rows"]:
        ratio = "-" if r["in_flight_per_sm"] is None else f"{r['in_flight_per_sm'] / r['needed_per_sm']:.2f}"
        lines.append(
            f"| {r['case']} | {r['kernel']} | {r['grid']} | {r['tile']} | {r['num_warps']} | "
            f"{r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['smem']} | "
            f"{r['ctas_per_sm']} ({r['limiter']}) | {_widths(r['loads'])} | "
            f"{_widths(r['stores'])} | {r['source_reads']} | {'yes' if r['pipelined'] else 'no'} | "
            f"{_kb(r['in_flight_per_sm'])} | {ratio} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- Pallas part

@dataclasses.dataclass(frozen=True)
class PallasCase:
    """One Pallas kernel (forward, backward, phase1, merge) at N sources `[T, D]` bf16
    (S queries for phase1)."""

    kernel: str
    n: int
    t: int
    d: int
    s: int = 1

    @property
    def name(self) -> str:
        sets = f" S={self.s}" if self.kernel == "phase1" else ""
        return f"{self.kernel} N={self.n}{sets} T={self.t} D={self.d}"


PALLAS_CASES = (
    PallasCase("forward", 9, 8192, 7168),
    PallasCase("forward", 10, 32768, 4096),
    PallasCase("backward", 10, 32768, 4096),
    PallasCase("backward", 9, 8192, 7168),
    PallasCase("phase1", 8, 8192, 7168, s=12),
    PallasCase("phase1", 8, 8192, 4096, s=12),
    PallasCase("phase1", 8, 8192, 4096, s=16),
    PallasCase("merge", 2, 8192, 7168),
    PallasCase("merge", 2, 32768, 4096),
)

#: Lowerings: (label, lowering platform, plan platform, jax_pallas_use_mosaic_gpu or None = as set).
PALLAS_TARGETS = (
    ("tpu", "tpu", "tpu", None),
    ("cuda (default lowering)", "cuda", "gpu", None),
    ("cuda (Triton lowering)", "cuda", "gpu", False),
)


def pallas_request(case: PallasCase, platform: str):
    """The registry's `Request` a public call of this kernel makes on `platform` ("gpu"/"tpu")."""
    from attnres_jax.dispatch import Request
    op = {"forward": "depth_attention", "backward": "depth_attention", "phase1": "depth_attention_multi",
          "merge": "merge_partial"}[case.kernel]
    return Request(op, platform, "bfloat16", case.d, 1, case.n, case.s, False)


def pallas_plan(case: PallasCase, platform: str):
    """(None or the reason the plan routes the call to XLA, the `Pallas` implementation resolved
    for the call: its tile TB and kernel settings)."""
    from attnres_jax.kernels.pallas import Pallas
    request = pallas_request(case, platform)
    return Pallas().supports(request), Pallas().resolve(request)


def pallas_lower(case: PallasCase, platform: str, impl, mosaic_gpu: Optional[bool] = None) -> Optional[str]:
    """Lower the kernel for `platform` ("tpu", "cuda") on abstract bf16 inputs, with the keyword
    arguments `impl` (a resolved `Pallas`) passes to the kernels (tile, compute dtype, ...):
    None, or the first line of the error.  `mosaic_gpu`: force `jax_pallas_use_mosaic_gpu`."""
    return pallas_lowering(case, platform, impl, mosaic_gpu)[1]


def pallas_lowering(case: PallasCase, platform: str, impl, mosaic_gpu: Optional[bool] = None):
    """`pallas_lower`, returning (the `jax.stages.Lowered` or None, None or the error's first line)."""
    import jax
    import jax.numpy as jnp
    from attnres_jax.kernels import pallas as kernels

    n, t, d, s = case.n, case.t, case.d, case.s
    f32, bf16 = jnp.float32, jnp.bfloat16
    a = jax.ShapeDtypeStruct
    common = impl.kernel_options(f32)      # exactly what the Pallas entry points pass
    if case.kernel == "forward":
        fn = lambda xs, qg: kernels.forward(xs, qg, per_token=False, eps=EPS, scale=SCALE, softmax=True,
                                            key_norm=True, **common)
        args = ([a((t, d), bf16)] * n, a((1, d), f32))
    elif case.kernel == "backward":
        stats = a((t, kernels.backward_columns(n, True).width), f32)  # d_lse, p_i, r_i, s_i packed
        fn = lambda xs, qg, go, st: kernels.backward(xs, qg, go, st, per_token=False, scale=SCALE, softmax=True,
                                                     key_norm=True, **common)
        args = ([a((t, d), bf16)] * n, a((1, d), f32), a((t, d), bf16), stats)
    elif case.kernel == "phase1":
        fn = lambda xs, qg: kernels.phase1(xs, qg, eps=EPS, scale=SCALE, **common)
        args = ([a((t, d), bf16)] * n, a((s, d), f32))
    elif case.kernel == "merge":
        fn = lambda o1, l1, b, qg: kernels.merge(o1, l1, b, qg, per_token=False, eps=EPS, scale=SCALE, **common)
        args = (a((t, d), bf16), a((t, 1), f32), a((t, d), bf16), a((1, d), f32))
    else:
        raise ValueError(f"case.kernel: unknown kernel {case.kernel!r}")
    old = _mosaic_gpu_default()
    try:
        if mosaic_gpu is not None and mosaic_gpu != old:
            jax.config.update("jax_pallas_use_mosaic_gpu", mosaic_gpu)
        with target_device(platform):
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    except Exception as e:  # noqa: BLE001 - a refusal is the result
        text = str(e).strip().splitlines()
        return None, f"{type(e).__name__}: {text[0] if text else ''}"[:300]
    finally:
        if mosaic_gpu is not None and mosaic_gpu != old:
            jax.config.update("jax_pallas_use_mosaic_gpu", old)
    return lowered, None


#: The GPU a `cuda` lowering targets when this machine has none (`target_device`).
GPU_KIND, GPU_CORES = "NVIDIA H200", SMS


def target_device(platform: str):
    """Context for lowering for `platform` with no such device here: for "cuda", an abstract
    mesh of one `GPU_KIND` device (`jax.sharding.use_abstract_mesh`), which JAX >= 0.11's Pallas
    Triton lowering reads for the compute capability instead of asking for a local GPU (there it
    raises "No supported GPU devices found"); older JAX reads no abstract device and lowers
    as before.  Any other platform: no change."""
    import contextlib

    import jax
    sharding = jax.sharding
    if platform != "cuda" or not all(hasattr(sharding, n) for n in
                                     ("use_abstract_mesh", "AbstractMesh", "AbstractDevice")):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind=GPU_KIND, num_cores=GPU_CORES, platform="gpu")
    return sharding.use_abstract_mesh(sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))


#: The kernel's custom call in lowered StableHLO: its operand and result types after the last " : (".
_PALLAS_CALL = re.compile(r"stablehlo\.custom_call @\S+\(.*:\s*\((.*)\)\s*->\s*\((.*)\)\s*$")
_PALLAS_TENSOR = re.compile(r"tensor<([0-9x]+)x[a-z]+[0-9]*>")


def pallas_narrow(lowered) -> tuple:
    """(operands, results) of the lowered kernel's custom call whose last dim is 1 (`[T, 1]`
    columns: each padded 128x on TPU, whose (8, 128) tiles put the last dim on the lanes), summed
    over the module's custom calls."""
    ins = outs = 0
    for line in lowered.as_text().splitlines():
        match = _PALLAS_CALL.search(line)
        if match:
            narrow = [sum(dims.split("x")[-1] == "1" for dims in _PALLAS_TENSOR.findall(types))
                      for types in match.groups()]
            ins, outs = ins + narrow[0], outs + narrow[1]
    return ins, outs


def _mosaic_gpu_default() -> bool:
    """Whether this JAX lowers a `pallas_call` without compiler_params with Mosaic GPU (else Triton)."""
    import jax
    return bool(getattr(jax.config, "jax_pallas_use_mosaic_gpu", False))


def pallas_triton_ir(lowered) -> List[tuple]:
    """[(Triton IR as text, num_warps)] of every Triton-lowered kernel call in `lowered` (the
    `__gpu$xla.gpu.triton` custom calls carry the kernel as MLIR bytecode in their backend
    config; JAX's own Triton dialect prints it, so Triton's compiler can take it from there)."""
    # JAX's own (third-party) internals: its Triton dialect and MLIR bindings have no public home.
    from jax._src.lib import triton as jax_triton
    from jax._src.lib.mlir import ir

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call" and \
                            "mhlo.backend_config" in child.attributes:
                        calls.append(child)
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    out = []
    for call in calls:
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        if "ir" not in config:
            continue
        ctx = ir.Context()
        jax_triton.dialect.register_dialect(ctx)
        with ctx:
            text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
        out.append((text, ir.IntegerAttr(config["num_warps"]).value))
    return out


def compile_ttir(items: List[dict]) -> List[dict]:
    """Triton env: compile each {"path": Triton IR text file, "num_warps"} for sm_90 and assemble
    with the wheel's ptxas -> {"registers", "spill_stores", "spill_loads", "stack", "loads",
    "stores"} or {"error"}."""
    import triton
    from triton.backends.compiler import GPUTarget

    ptxas = ptxas_path()
    out = []
    for item in items:
        try:
            ck = triton.compile(item["path"], target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=item["num_warps"]))
            info = run_ptxas(ck.asm["ptx"], ptxas)
            acc = global_accesses(ck.asm["ptx"])
            out.append(dict(info, loads=dict(acc["ld"]), stores=dict(acc["st"])))
        except Exception as e:  # noqa: BLE001 - a refusal is the result
            out.append({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"})
    return out


def compile_ttir_child(items: List[dict], python: str) -> List[dict]:
    """`compile_ttir` in `python` (the torch env has Triton; the JAX env need not): raises
    RuntimeError with the reason when that interpreter cannot."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "items.json", Path(tmp) / "compiled.json"
        src.write_text(json.dumps(items))
        res = subprocess.run([python, str(Path(__file__).resolve()), "--compile-ttir", str(src), "--json",
                              str(dst)], capture_output=True, text=True)
        if res.returncode != 0 or not dst.exists():
            raise RuntimeError(f"{python} could not compile the Triton IR: {res.stderr.strip()[-300:]}")
        return json.loads(dst.read_text())


def pallas_rows(cases=PALLAS_CASES, targets=PALLAS_TARGETS, torch_python: Optional[str] = None,
                ir_dir: Optional[str] = None) -> List[dict]:
    """Rows of the Pallas table; with `torch_python`, the Triton-lowered GPU kernels are also
    compiled for sm_90 there ("sm90": registers and spills, or "sm90_error")."""
    rows, items = [], []
    for case in cases:
        for label, platform, plan_platform, mosaic in targets:
            reason, impl = pallas_plan(case, plan_platform)
            t0 = time.time()
            lowered, err = pallas_lowering(case, platform, impl, mosaic)
            log(f"  {case.name} on {label}: {'lowered' if err is None else 'refused'} ({time.time() - t0:.1f} s)")
            rows.append({"case": case.name, "kernel": case.kernel, "target": label, "tile": impl.tile,
                         "num_warps": impl.num_warps if plan_platform == "gpu" else None,
                         "plan": "pallas" if reason is None else f"xla: {reason}",
                         "lowered": err is None, "error": err,
                         "narrow": None if lowered is None else pallas_narrow(lowered)})
            if torch_python and lowered is not None and mosaic is False:
                for j, (text, warps) in enumerate(pallas_triton_ir(lowered)):
                    path = Path(ir_dir) / f"{len(rows)}_{j}.ttir"
                    path.write_text(text)
                    items.append({"row": len(rows) - 1, "path": str(path), "num_warps": warps})
    if items:
        log(f"  compiling {len(items)} Triton-lowered kernels for sm_90 with {torch_python} ...")
        try:
            for item, res in zip(items, compile_ttir_child(items, torch_python)):
                rows[item["row"]]["sm90"] = res
        except RuntimeError as e:
            for item in items:
                rows[item["row"]]["sm90"] = {"error": str(e)}
    return rows


def pallas_part(quick: bool, torch_python: Optional[str] = None) -> dict:
    import jax
    with tempfile.TemporaryDirectory() as tmp:
        rows = pallas_rows(torch_python=torch_python, ir_dir=tmp)
    return {"jax_version": jax.__version__,
            "default_gpu_lowering": "Mosaic GPU" if _mosaic_gpu_default() else "Triton",
            "rows": rows}


def pallas_markdown(part: dict) -> str:
    lines = [f"JAX {part['jax_version']} (default GPU lowering of pallas_call: {part['default_gpu_lowering']}), "
             "lowered on the CPU for abstract bf16 inputs; plan = `Pallas().supports` on that platform; "
             "[*, 1] in/out = the kernel's operands / results whose last dim is 1 (on TPU each is padded "
             "128x by the (8, 128) tiling).", "",
             "| case | target | TB | plan | lowering | [*, 1] in/out | sm_90 warps, regs, spill st/ld B |",
             "|---|---|---:|---|---|---:|---|"]
    for r in part["rows"]:
        low = "lowered" if r["lowered"] else f"refused: {r['error']}"
        narrow = "" if r.get("narrow") is None else "%d / %d" % tuple(r["narrow"])
        sm90 = r.get("sm90") or {}
        if "error" in sm90:
            compiled = f"not compiled: {sm90['error'][:80]}"
        elif sm90:
            compiled = f"{r['num_warps']}, {sm90['registers']}, {sm90['spill_stores']}/{sm90['spill_loads']}"
        else:
            compiled = ""
        lines.append(f"| {r['case']} | {r['target']} | {r['tile']} | {r['plan']} | {low.replace('|', '/')} | "
                     f"{narrow} | {compiled.replace('|', '/')} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main

def _env_python(name: str) -> str:
    py = ROOT / ".nox" / name / "bin" / "python"
    return str(py) if py.exists() else sys.executable


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--part", choices=("all", "triton", "pallas"), default="all")
    p.add_argument("--quick", action="store_true", help="benchmark shapes only (no edge shapes)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--torch-python", default=_env_python("tests-torch"), help="python of the torch env")
    p.add_argument("--jax-python", default=_env_python("tests-jax"), help="python of the JAX env")
    p.add_argument("--compile-ttir", type=Path, help=argparse.SUPPRESS)  # `compile_ttir_child`'s end
    return p.parse_args(argv)


def _child(python: str, part: str, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{part}.json"
        cmd = [python, str(Path(__file__).resolve()), "--part", part, "--json", str(out)]
        res = subprocess.run(cmd + (["--quick"] if quick else []), stdout=subprocess.DEVNULL)
        if res.returncode != 0 or not out.exists():
            return {"error": f"{' '.join(cmd)} exited with {res.returncode}"}
        return json.loads(out.read_text())[part]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_ttir:
        args.json.write_text(json.dumps(compile_ttir(json.loads(args.compile_ttir.read_text()))))
        return 0
    result = {}
    if args.part == "all":
        log(f"triton part with {args.torch_python}")
        result["triton"] = _child(args.torch_python, "triton", args.quick)
        log(f"pallas part with {args.jax_python}")
        result["pallas"] = _child(args.jax_python, "pallas", args.quick)
    elif args.part == "triton":
        result["triton"] = triton_part(args.quick)
    else:
        result["pallas"] = pallas_part(args.quick, args.torch_python)
    for part, render in (("triton", triton_markdown), ("pallas", pallas_markdown)):
        if part in result:
            print(f"## {part}\n")
            print(result[part]["error"] if "error" in result[part] else render(result[part]))
            print()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 1 if any("error" in v for v in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
