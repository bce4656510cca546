"""The single-device distributed smoke test (`experiments.distributed_smoke`, run by
`bench/gpu_check.py`): every path over a world of size 1 against the float64 reference, under the
device-mixing detector.  On this CPU machine it runs on gloo; with a GPU the NCCL run is here too;
without one the NCCL run must skip and say why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attnres_torch.distributed import run_local

from experiments.distributed_smoke import main, run_smoke, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_passes_on_cpu_gloo():
    def worker(rank, world):
        lines = []
        res = run_smoke("cpu", log=lines.append)
        return {"res": res, "lines": lines}
    (out,) = run_local(worker, 1)
    res = out["res"]
    assert res["skipped"] is None and res["failures"] == [], out["lines"]
    # 5 paths' values and gradients, 5 detector verdicts, the dtype error.
    assert res["passed"] == 31, out["lines"]
    assert res["ops_checked"] > 1000
    assert out["lines"][-1].startswith("distributed smoke (gloo, cpu): PASS")


def test_nccl_smoke_on_one_gpu():
    reason = unavailable_reason("cuda", "nccl")
    if reason is not None:
        pytest.skip(f"the NCCL smoke test needs a CUDA GPU and NCCL: {reason}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "backend_torch" / "src"), str(ROOT / "reference_numpy" / "src"),
         str(ROOT / "core" / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "experiments.distributed_smoke", "--device", "cuda"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout


def test_smoke_skips_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-GPU skip path does not apply")
    lines = []
    res = run_smoke("cuda", log=lines.append)
    assert res["skipped"] == unavailable_reason("cuda", "nccl") and "CUDA" in res["skipped"]
    assert lines == [f"distributed smoke: SKIPPED ({res['skipped']})"]
    assert main(["--device", "cuda"]) == 2

