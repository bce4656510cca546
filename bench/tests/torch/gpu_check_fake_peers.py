"""Fake peers for the dry-run failure tests of bench/gpu_check.py (`--peers-module` this file).

`GPU_CHECK_FAKE_PEERS` names them, comma-separated, in run order.  Each computes the eager
composite (so its first row is a correct "ok" row) and then misbehaves from its second timed
row on (the first row of the "backward only" section):

- "corrupt": writes a CUDA-like sticky error to stderr and ends its process with `os._exit(134)`,
  as a process whose CUDA context a peer broke (illegal memory access) ends;
- "hang": blocks SIGALRM (so the child's own caps cannot fire, as in a long C call) and sleeps;
  only the parent's kill ends it;
- "raises": every call raises RuntimeError (each row "failed"; the child goes on).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import peers


class _Fake(peers.Eager):
    cost = 0
    mode = "?"

    def __init__(self):
        super().__init__()
        self.prepared = 0

    def prepare(self, inp, requires_grad=False):
        self.prepared += 1
        return super().prepare(inp, requires_grad)

    def forward(self, prep):
        if self.mode == "raises":
            raise RuntimeError("fake peer: kernel launch failed")
        if self.prepared >= 2 and self.mode == "corrupt":
            sys.stderr.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
            sys.stderr.flush()
            os._exit(134)
        if self.prepared >= 2 and self.mode == "hang":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            while True:
                time.sleep(3600)
        return super().forward(prep)


def make(mode):
    return type(f"Fake_{mode}", (_Fake,), dict(name=f"fake {mode}", mode=mode))()


def all_adapters():
    modes = [m for m in os.environ.get("GPU_CHECK_FAKE_PEERS", "").split(",") if m]
    return [make(m) for m in modes]
