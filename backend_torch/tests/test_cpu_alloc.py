"""`attnres_torch.cpu_alloc.keep_large_blocks` (issue 19): opt-in, process-wide, glibc only.  Each
setting runs in a fresh subprocess (the setting would otherwise leak into this test process):
with it, a loop's fresh 64 MiB buffer reuses earlier steps' pages (no first-touch faults)
and the op's results are the same bits; without it (glibc's default), every step faults again."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from attnres_torch import cpu_alloc as cpu

GLIBC = cpu._glibc() is not None
PAGES = 64 * 2**20 // 4096  # 4 KiB pages of the 64 MiB buffer


def _thp_always() -> bool:
    """Transparent huge pages back every mapping: a fresh 64 MiB block faults ~32 times, not
    16384, and fault counts cannot tell the two settings apart."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False

LOOP = textwrap.dedent("""
    import json, resource, sys, torch
    import attnres_torch as at
    from attnres_torch import cpu_alloc as cpu
    mode = sys.argv[1]
    kept = cpu.keep_large_blocks(True) if mode in ("keep", "keep-off") else None
    if mode == "keep-off":
        # steps with the setting on, then back to glibc's defaults.  Their blocks are 16 MiB: the
        # heap keeps what it holds after the setting is off (the module's docstring), and a free
        # block of 64 MiB left there would serve the loop's buffers without faults.
        for _ in range(2):
            torch.empty(4 * 2**20).fill_(1.0)
        kept = cpu.keep_large_blocks(False)
    faults = []
    for _ in range(20):  # a loop: one fresh 64 MiB fp32 buffer per step, written in full
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 * 2**20).fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, 1024, generator=gen).requires_grad_() for _ in range(3)]
    q = torch.randn(1024, generator=gen).requires_grad_()
    out = at.depth_attention(xs, q)
    grads = torch.autograd.grad(out, xs + [q], torch.randn(4096, 1024, generator=gen))
    digest = [float(out.double().sum())] + [float(g.double().abs().sum()) for g in grads]
    print(json.dumps(dict(kept=kept, faults=faults, digest=digest, state=cpu.large_blocks_kept())))
""")


def _run(mode):
    res = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="keep_large_blocks needs glibc")
def test_kept_blocks_are_reused_without_faults_and_change_no_bits():
    default, kept = _run("default"), _run("keep")
    assert kept["kept"] is True and kept["state"] is True and default["state"] is False
    assert kept["digest"] == default["digest"]  # the allocator moves no bits
    if _thp_always():
        pytest.skip("THP 'always': fault counts do not separate the settings")
    # glibc's default maps every 64 MiB block afresh (every 4 KiB page faults at every step); the
    # kept heap settles (seen after 3-9 steps: it first grows by a few blocks, freed blocks that
    # the next padded posix_memalign request does not fit) and then reuses pages without faults
    assert min(default["faults"][1:]) > PAGES // 2, default["faults"]
    assert max(kept["faults"][-5:]) < PAGES // 100, kept["faults"]


@pytest.mark.skipif(not GLIBC, reason="keep_large_blocks needs glibc")
def test_off_restores_fresh_mappings():
    off = _run("keep-off")
    assert off["kept"] is True and off["state"] is False
    if _thp_always():
        pytest.skip("THP 'always': fault counts do not separate the settings")
    assert min(off["faults"][1:]) > PAGES // 2, off["faults"]  # mapped afresh: every step faults


def test_rejects_a_non_bool():
    with pytest.raises(TypeError, match="on: expected a bool, got int"):
        cpu.keep_large_blocks(1)


@pytest.mark.skipif(GLIBC, reason="the non-glibc answer")
def test_returns_false_without_glibc():
    assert cpu.keep_large_blocks(True) is False and not cpu.large_blocks_kept()
