"""bench/bench_out_norm.py (the fused output norm's benchmark, C17) at tiny shapes."""

import subprocess
import sys
from pathlib import Path


def test_bench_out_norm_quick_runs():
    """bench/bench_out_norm.py --quick (tiny shapes) runs to the end and reports every row."""
    script = Path(__file__).resolve().parents[3] / "bench" / "bench_out_norm.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| float32 |")
            or line.startswith("| bfloat16 |")]
    assert len(rows) == 2 * 2 * 3 + 2 * 2, proc.stdout  # (dtype, case, variant) rows + summaries
    assert "load average before" in proc.stdout and "load average after" in proc.stdout
