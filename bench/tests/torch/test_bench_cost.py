"""bench/bench_cost.py --quick for torch: every worker runs (train: PreNorm, Full, Block; decode:
the four variants with a KV cache), the C kernel serves the depth attention where it is built,
and the JSON carries every field the table is drawn from, with positive times and ratios."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TRAIN_FIELDS = {"framework", "form", "layers", "dim", "batch", "seq", "variant", "step_s", "steps_s", "step_ratio",
                "steps_cpu_s", "step_cpu_ratio", "peak_bytes", "memory_ratio", "memory", "info", "profile",
                "load_before", "load_after"}
DECODE_FIELDS = {"framework", "form", "layers", "dim", "prefill", "variant", "kv_cache", "prefill_s", "prefills_s",
                 "prefill_ratio", "token_s", "tokens_s", "token_ratio", "prefills_cpu_s", "prefill_cpu_ratio",
                 "tokens_cpu_s", "token_cpu_ratio", "peak_bytes", "memory_ratio", "memory", "info", "profile",
                 "load_before", "load_after"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    pytest.importorskip("transformers", reason="the torch decode rows run a transformers Llama")
    out = tmp_path_factory.mktemp("cost") / "cost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cost.py"), "--quick", "--frameworks", "torch",
                           "--torch-python", sys.executable, "--threads", "1", "--profile", "always",
                           "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_meta_and_paper(doc):
    assert set(doc["meta"]) >= {"date", "host", "cpu", "cpus", "load_before", "load_after", "command"}
    assert doc["paper"] == {"train": 0.04, "inference": 0.02}
    assert doc["block_size"] == 8
    assert "< 1.04x" in doc["markdown"] and "< 1.02x" in doc["markdown"]
    assert f"load average {doc['meta']['load_before']} before / {doc['meta']['load_after']} after" in doc["markdown"]


def test_train_rows(doc):
    rows = {r["variant"]: r for r in doc["train"]}
    assert sorted(rows) == ["block", "full", "prenorm"] and len(doc["train"]) == 3
    for v, r in rows.items():
        assert TRAIN_FIELDS <= set(r), TRAIN_FIELDS - set(r)
        assert r["framework"] == "torch" and r["info"]["model"] == "AttnResTransformer"
        assert len(r["steps_s"]) == 3 and min(r["steps_s"]) > 0 and r["step_s"] > 0
        assert r["step_ratio"] > 0 and r["step_cpu_ratio"] > 0 and r["memory_ratio"] > 0 and r["peak_bytes"] > 0
        assert r["memory"]["state_bytes"] == 16 * r["info"]["params"]
        assert r["memory"]["saved_activation_bytes"] > 0
        prof = r["profile"]["ms"]
        assert prof["wall"] > 0 and prof["matmul"] > 0 and prof["AdamW step (timed apart)"] > 0
        if v != "prenorm":
            assert prof["depth attention (attnres ops)"] > 0
    assert rows["prenorm"]["step_ratio"] == 1.0 and rows["prenorm"]["memory_ratio"] == 1.0
    assert rows["prenorm"]["memory"]["impl_counts_timed"] == {}  # PreNorm calls no depth attention


def test_the_c_kernel_served_the_timed_steps(doc):
    from attnres_torch.kernels import cpu_c

    if not cpu_c.available():
        pytest.skip("the C kernel is not built here (no compiler): the chunked kernel serves instead")
    for r in doc["train"] + doc["decode"]:
        if r["variant"] != "prenorm":
            counts = r["memory"]["impl_counts_timed"]
            assert set(counts) == {"cpu_c"} and counts["cpu_c"] > 0, (r["variant"], counts)
            assert r["info"]["last_choice"]["impl"] == "cpu_c"


def test_decode_rows(doc):
    rows = {r["variant"]: r for r in doc["decode"]}
    assert sorted(rows) == ["block-direct", "block-two_phase", "full", "prenorm"]
    for v, r in rows.items():
        assert DECODE_FIELDS <= set(r), DECODE_FIELDS - set(r)
        assert r["kv_cache"] is True and "LlamaForCausalLM" in r["info"]["model"]
        assert len(r["prefills_s"]) == 2 and len(r["tokens_s"]) == 3 and min(r["tokens_s"]) > 0
        assert min(r["prefill_ratio"], r["token_ratio"], r["prefill_cpu_ratio"], r["token_cpu_ratio"],
                   r["memory_ratio"]) > 0
        assert r["profile"]["ms"]["wall"] > 0
        if v != "prenorm":
            assert r["profile"]["ms"]["depth attention (attnres ops)"] > 0
    assert rows["prenorm"]["token_ratio"] == 1.0
