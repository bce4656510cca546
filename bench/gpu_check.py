"""GPU check of the Triton depth-attention kernels against the peers, for one H200 session.

The one prepared script for a lent device: every row reaches `--out-dir` as soon as it is
measured, whatever fails later.

The command a session runs (the device tool; the peers' wheels, put in `bench/.peers` by
`bench/fetch_peers.sh` here first, are git-ignored, so they are carried; `$OUT` is the folder
that comes back, at most 8 files: this script writes 4):

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out-dir $OUT",
        carry=["bench/.peers"], timeout_s=600)

    python bench/gpu_check.py --dry-run --out-dir /tmp/dry       # the whole script on the CPU

Nothing of ours needs installing (the packages are imported from the tree); the peers come from
`bench/.peers/site` (put on sys.path) or the environment; the adapters are `bench/peers`.

Output (`--out-dir`, default `$OUT` when set): `report.md` (the table), `report.json` (meta,
correctness, phases, rows, notes), `rows.jsonl` (one JSON object a row, in the order measured),
`log.txt` (all output, the children's included).  The first three are rewritten after every row
and every phase, each as a temporary file renamed over the old one (`os.replace`), so a kill at
any moment leaves every row measured before it.

One deadline, `--budget` seconds from the start (default 540: one 600 s command with a minute to
spare), that every phase draws from; a watchdog thread fires at it: it records the phase it cut,
kills that phase's process and writes the partial report (exit 3); the phases after it get rows
"not run".  Each phase runs in its own child process (a hang, a raise, a sticky CUDA error or an
`os._exit` ends that child, never the run), under min(its cap, what is left of the budget),
counted from the child's start-up (imports, CUDA context; at most 120 s), in this order:

1. Correctness (`--correctness-cap`) on the device against the float64 reference
   (`attnres_numpy.ops`) on the upcast inputs, at small shapes: forward, backward (random d_out
   and d_lse), phase 1 (multi), phase 2 (merge); fp32/bf16/fp16; N in {1, 2, 9, 33}; D in {1, 7,
   123, 1000, 4096, 20000}; shared and per-token queries; unaligned row-strided sources;
   NaN-poisoned output buffers; bitwise repeatability.  Then every op captured in one CUDA graph
   (sources made inside the capture), replayed on new input values against the reference, and run
   eagerly with a cold table cache under `torch.cuda.set_sync_debug_mode("error")`.  A case that
   raises is a failure and the next case runs; a broken device ends the phase (the cases left are
   counted as not run).
2. Ours (`--ours-cap`): the kernels and the autograd op at the two target shapes first (forward
   N=9 x T=8192 x D=7168 bf16; backward-only and forward+backward N=10 x T=32768 x D=4096 bf16),
   then forward at the second shape, one two-phase block (8 blocks, 12 sublayers) against 12
   independent reads, phase 1 (8 blocks, 12 queries) and merge at T=8192, D=7168 and D=4096.
   The copy bandwidth (`dst.copy_(src)`) is measured first.
3. Distributed smoke (`python -m experiments.distributed_smoke`; NCCL, gloo on the CPU),
   `--smoke-cap` (at most 120 s).
4. Each peer in its own child, cheapest first (`Adapter.cost` in `bench/peers`): the eager
   composite, Liger, `torch.compile` of the composite, FLA (default and Gluon), fast-attnres,
   flash-attn-res; the sections of 2 each can express.  Each first call (its compiles and
   autotuning) under `--warmup-cap`, the peer under `--peer-cap` in all; a cap that fires ends the
   peer's timing (its later rows "skipped" with the reason); a child that stops answering is
   killed 3 s past its cap.  Every Triton autotuner a peer runs keeps `--autotune-configs` of its
   configs (evenly spaced over its list; 0 keeps the full lists); the report lists each kernel's
   configs before and after.  Every peer output is compared with ours (max |peer - ours|).
5. JAX (`--jax-cap`; `--jax-python`): attnres_jax impl="xla" and impl="pallas", jitted, forward
   and forward+backward at the two target shapes (back-to-back async dispatch).

Two numbers per timing row: "kernel ms" = CUDA-graph replay of the call (the mean over many
replays between two events), or, where capture fails (autograd calls), many back-to-back calls
between two events; "call ms" = median wall time of one call + synchronize, the latency a user
sees; GB/s on the minimal bytes of the operation and the fraction of the copy bandwidth measured
in the same run.  Caps raise `Timeout`, a BaseException: no `except Exception` on the way (a
graph-capture fallback, a peer's) can swallow one and time the call uncapped.

Exit status: 0 all correct and every phase ran; 1 a correctness failure (kernels or distributed
smoke); 2 no usable device; 3 no failure, but the report is partial (the budget ran out, the
process was terminated, or the correctness phase did not finish).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
EPS, SCALE = 1e-6, 1.0
SMOKE_CAP_MAX = 120.0      # the distributed smoke's cap, at most (an NCCL hang waits this long)
STARTUP_CAP = 120.0        # seconds a child may take to import and say it is ready
KILL_GRACE = 3.0           # past a child's cap (its own SIGALRM fires first), the parent kills it
WATCHDOG_GRACE = 15.0      # after the deadline, the main thread's time to finish the report
MIN_PHASE = 5.0            # a phase with less of the budget left is not started
OURS, OP = "attnres triton kernels", "attnres_torch.depth_attention (autograd)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (needs TRITON_INTERPRET=1)")
    p.add_argument("--dry-run", action="store_true",
                   help="the whole script on the CPU at tiny shapes: --device cpu --quick with "
                        "TRITON_INTERPRET=1 (set before Triton is imported)")
    p.add_argument("--quick", action="store_true", help="tiny shapes everywhere")
    out = os.environ.get("OUT")
    p.add_argument("--out-dir", type=Path, default=Path(out) if out else None,
                   help="write report.md, report.json, rows.jsonl and log.txt here, after every "
                        "row (default: $OUT when set)")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for the whole run, every phase included (default 540: one 600 s "
                        "device command with a minute to spare)")
    p.add_argument("--correctness-cap", type=float, default=150.0, help="seconds (default 150)")
    p.add_argument("--ours-cap", type=float, default=120.0,
                   help="seconds for our timing rows (default 120)")
    p.add_argument("--smoke-cap", type=float, default=90.0,
                   help=f"seconds for the distributed smoke (default 90, at most {SMOKE_CAP_MAX:.0f})")
    p.add_argument("--peer-cap", type=float, default=75.0,
                   help="seconds per peer, its compiles and autotuning included (default 75)")
    p.add_argument("--warmup-cap", type=float, default=45.0,
                   help="seconds for any one first call (compile, autotune; default 45)")
    p.add_argument("--jax-cap", type=float, default=120.0, help="seconds for JAX (default 120)")
    p.add_argument("--autotune-configs", type=int, default=3,
                   help="configs each Triton autotuner of a peer keeps (default 3; 0: all)")
    p.add_argument("--peers-module", type=Path,
                   help="a Python file whose all_adapters() replaces bench/peers' (fake peers)")
    p.add_argument("--target-ms", type=float, default=200.0,
                   help="device time per measurement; sets the replay count (default 200)")
    p.add_argument("--max-iters", type=int, default=200, help="most replays per measurement")
    p.add_argument("--latency-calls", type=int, default=10, help="calls timed one by one")
    p.add_argument("--jax-python", default=sys.executable,
                   help="interpreter for the JAX phase (default: this one)")
    p.add_argument("--skip-correctness", action="store_true", help="no correctness phase")
    p.add_argument("--skip-ours", action="store_true", help="no timing rows of ours")
    p.add_argument("--skip-jax", action="store_true", help="no JAX (XLA, Pallas) rows")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile rows")
    p.add_argument("--skip-peers", action="store_true", help="no peer-library rows")
    p.add_argument("--skip-timing", action="store_true", help="correctness (and the smoke) only")
    p.add_argument("--skip-distributed", action="store_true", help="no distributed smoke test")
    # a child's arguments (set by the parent)
    p.add_argument("--child", choices=("correctness", "ours", "peer", "jax"), help=argparse.SUPPRESS)
    p.add_argument("--child-impl", help=argparse.SUPPRESS)
    p.add_argument("--child-cap", type=float, help=argparse.SUPPRESS)
    p.add_argument("--msg-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--copy-gbs", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 < args.smoke_cap <= SMOKE_CAP_MAX:
        p.error(f"--smoke-cap: must be in (0, {SMOKE_CAP_MAX:.0f}] seconds (got {args.smoke_cap})")
    for name in ("budget", "correctness_cap", "ours_cap", "peer_cap", "warmup_cap", "jax_cap"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: must be > 0 seconds (got {getattr(args, name)})")
    if args.autotune_configs < 0:
        p.error(f"--autotune-configs: must be >= 0 (got {args.autotune_configs})")
    if args.dry_run:
        args.device, args.quick = "cpu", True
        args.target_ms, args.max_iters, args.latency_calls = 1.0, 1, 1
    return args


# ---------------------------------------------------------------- what is measured (parent and child)

def shapes(quick):
    """The timing shapes: reads (N, T, D), the block (blocks, sublayers, T, D), phase 1 / merge
    (blocks, queries, T, D) at two D (flash-attn-res needs a power-of-two D)."""
    if quick:
        return dict(fwd=(3, 8, 64), train=(4, 8, 64), block=(3, 4, 8, 64),
                    two_phase=((3, 4, 8, 48), (3, 4, 8, 64)))
    return dict(fwd=(9, 8192, 7168), train=(10, 32768, 4096), block=(8, 12, 8192, 7168),
                two_phase=((8, 12, 8192, 7168), (8, 12, 8192, 4096)))


def read_case(n, t, d):
    return f"N={n} T={t} D={d} bf16"


def block_case(nb, s_l, t, d):
    return f"{nb} cached blocks x {s_l} sublayers, T={t} D={d} bf16"


def two_phase_case(nb, s, t, d):
    return f"{nb} blocks x {s} queries, T={t} D={d} bf16"


def has_phase1(peers, ad):
    return type(ad).phase1 is not peers.Adapter.phase1


def has_merge(peers, ad):
    return type(ad).merge is not peers.Adapter.merge


def plan(quick, peers=None, ad=None):
    """[(section, case, impl)] one timing child measures, in its order: ours (`ad` None: the
    kernels and the autograd op) or one adapter's."""
    s = shapes(quick)
    fwd, train = read_case(*s["fwd"]), read_case(*s["train"])
    impls = [OURS, OP] if ad is None else [ad.name]
    rows = [("forward", fwd, i) for i in impls]
    rows += [(sec, train, i) for sec in ("backward only", "forward+backward") for i in impls]
    rows += [("forward", train, i) for i in impls]
    if ad is None:
        b = s["block"]
        rows += [("block", block_case(*b), "attnres two-phase (multi + merges)"),
                 ("block", block_case(*b), f"attnres {b[1]} independent reads")]
    for tp in s["two_phase"]:
        case = two_phase_case(*tp)
        if ad is None or has_phase1(peers, ad):
            rows.append(("phase 1", case, impls[0]))
        if ad is None or has_merge(peers, ad):
            rows.append(("merge", case, impls[0]))
    return rows


def jax_plan(quick):
    s = shapes(quick)
    return [(f"jax {sec}", read_case(*shape), f"attnres_jax impl={impl}")
            for sec, shape in (("forward", s["fwd"]), ("forward+backward", s["train"]))
            for impl in ("xla", "pallas")]


# ---------------------------------------------------------------- a child's side

class Channel:
    """A child's messages to the parent: one JSON object a line on the pipe `--msg-fd` (none:
    the messages are dropped, for in-process use).  Call as `emit(kind, **fields)`."""

    def __init__(self, fd=None):
        self.f = os.fdopen(fd, "w", buffering=1) if fd is not None else None
        self.lock = threading.Lock()

    def __call__(self, kind, **fields):
        if self.f is None:
            return
        line = json.dumps(dict(fields, t=kind), default=str)
        with self.lock:
            self.f.write(line + "\n")
            self.f.flush()


class Timeout(BaseException):
    """A cap ran out.  A BaseException, so that no `except Exception` on the way (a graph-capture
    fallback, a peer's own) swallows it and lets the call run on uncapped."""


class DeviceLost(BaseException):
    """The device state is broken (a sticky CUDA error): nothing more can run in this process."""


class Caps:
    """A child's wall-clock caps, on SIGALRM (Python code, a compile or autotune loop, is
    interrupted; one long C call finishes first, and the parent kills a child that does not come
    back).  `total` seconds from now in all; `guard(seconds, reason)` raises Timeout(reason) after
    min(seconds, what is left of the total), or the total's reason when that is less.  A cap that
    fired stays fired: it raises again every `REARM_S` seconds, and once more when the block
    ends, however the block's own code handled the first (an `except BaseException`, an error
    raised while unwinding that replaced it)."""

    REARM_S = 1.0

    def __init__(self, total, name):
        self.total, self.name, self.end = total, name, time.monotonic() + total

    def left(self):
        return self.end - time.monotonic()

    @contextlib.contextmanager
    def guard(self, seconds=None, reason=None):
        limit, why = self.left(), f"{self.name}: over its {self.total:.0f} s cap"
        if seconds is not None and seconds < limit:
            limit, why = seconds, reason
        if limit <= 0:
            raise Timeout(why)
        fired = []

        def alarm(signum, frame):
            fired.append(True)
            signal.setitimer(signal.ITIMER_REAL, self.REARM_S)
            raise Timeout(why)
        old = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            yield
        except Timeout:
            raise
        except BaseException as e:
            if fired:
                raise Timeout(why) from e
            raise
        else:
            if fired:
                raise Timeout(why)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def spread(items, k):
    """`k` of `items`, evenly spaced, the first and the last included (all of them if k >= len)."""
    items = list(items)
    n = len(items)
    if k <= 0 or k >= n:
        return items
    if k == 1:
        return [items[(n - 1) // 2]]
    return [items[i] for i in sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})]


class AutotuneTrim:
    """While active, every Triton autotuner keeps `k` of its configs (`spread`) the first time it
    runs, so a peer's first call compiles k variants instead of its whole list (FLA: 24 + 24 + 10,
    fast-attnres 48 + 48); each trim is sent to the parent (`emit("autotune", ...)`) for the
    report.  k = 0: nothing is trimmed.  Patches `cls.run` (default
    `triton.runtime.autotuner.Autotuner`: the entry of every autotuned launch, subclasses'
    included) in this process only."""

    def __init__(self, k, emit, impl, cls=None):
        self.k, self.emit, self.impl, self.cls, self.orig = k, emit, impl, cls, None

    def __enter__(self):
        if self.k <= 0:
            self.cls = None
            return self
        if self.cls is None:
            try:
                from triton.runtime.autotuner import Autotuner as cls
            except ImportError:
                return self
            self.cls = cls
        Autotuner = self.cls
        self.orig = Autotuner.run
        seen, trim = set(), self

        def run(tuner, *args, **kwargs):
            if id(tuner) not in seen:
                seen.add(id(tuner))
                trim.apply(tuner)
            return trim.orig(tuner, *args, **kwargs)
        Autotuner.run = run
        return self

    def apply(self, tuner):
        before = list(tuner.configs)
        if len(before) <= self.k:
            return
        tuner.configs = spread(before, self.k)
        getattr(tuner, "cache", {}).clear()
        fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", repr(fn))
        self.emit("autotune", impl=self.impl, kernel=name, before=len(before),
                  kept=[str(c) for c in tuner.configs])

    def __exit__(self, *exc):
        if self.cls is not None:
            self.cls.run = self.orig
        return False


# ---------------------------------------------------------------- correctness

def _cpu(t):
    """Tensors (or lists of them, or None) on the host, for the NumPy comparisons."""
    if isinstance(t, (list, tuple)):
        return [_cpu(x) for x in t]
    return None if t is None else t.detach().cpu()


class Checker:
    def __init__(self, torch, td, ops, helpers, device):
        self.torch, self.td, self.ops, self.h, self.device = torch, td, ops, helpers, device
        self.failures, self.passed = [], 0
        self.graph_note = "CUDA-graph check: not run"

    def f64(self, t):
        return self.h.f64(_cpu(t))

    def close(self, got, ref, dtype_name, what, grad=False):
        """The suite's comparison (`_helpers.assert_close`): `dtype_name` is the result's dtype
        (the sources' for out and d_sources, "float32" for lse and fp32 parameters' gradients),
        `grad` picks the gradient column."""
        try:
            self.h.assert_close(_cpu(got), ref, dtype_name, what, grad=grad)
            self.passed += 1
        except AssertionError as e:
            self.failures.append(str(e))

    def rand(self, gen, shape, dtype):
        return self.h.rand(gen, shape, dtype).to(self.device)

    def sources(self, gen, n, shape, dtype, unaligned):
        if not unaligned:
            return [self.rand(gen, shape, dtype) for _ in range(n)]
        wide = shape[:-1] + (shape[-1] + 3,)  # row stride D + 3, base offset 1 element
        return [self.rand(gen, wide, dtype)[..., 1:shape[-1] + 1] for _ in range(n)]

    @staticmethod
    def depth_tag(n, shape, dtype, per_token, gain, unaligned):
        name = str(dtype).replace("torch.", "")
        return f"depth N={n} {tuple(shape)} {name} per_token={per_token} gain={gain} unaligned={unaligned}"

    @staticmethod
    def two_phase_tag(n, num_q, shape, dtype):
        return f"two-phase N={n} S={num_q} {tuple(shape)} {str(dtype).replace('torch.', '')}"

    def depth(self, n, shape, dtype, per_token, gain, unaligned):
        torch, td, ops, f64 = self.torch, self.td, self.ops, self.f64
        name = str(dtype).replace("torch.", "")
        tag = self.depth_tag(n, shape, dtype, per_token, gain, unaligned)
        gen = torch.Generator().manual_seed(n * 1000 + shape[-1])
        xs = self.sources(gen, n, shape, dtype, unaligned)
        q = self.rand(gen, shape if per_token else shape[-1:], torch.float32)
        g = self.rand(gen, shape[-1:], torch.float32) + 1.0 if gain else None
        d_out = self.rand(gen, shape, dtype)
        d_lse = self.rand(gen, shape[:-1], torch.float32)
        results = []
        for _ in range(2):
            out, lse = td.forward(xs, q, g, EPS, SCALE)
            d_src, d_q, d_g = td.backward(xs, q, g, out, lse, d_out, d_lse, EPS, SCALE)
            results.append([out, lse, d_q] + list(d_src) + ([] if d_g is None else [d_g]))
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            self.failures.append(f"{tag}: repeated forward+backward not bitwise identical")
        ref_out, ref_lse = ops.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=SCALE,
                                               return_lse=True)
        ref = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), f64(d_lse), eps=EPS,
                                      scale=SCALE)
        self.close(out, ref_out, name, f"{tag}: out")
        self.close(lse, ref_lse, "float32", f"{tag}: lse")
        self.close(d_src, ref["sources"], name, f"{tag}: d_sources", grad=True)
        self.close(d_q, ref["query"], "float32", f"{tag}: d_query", grad=True)
        if gain:
            self.close(d_g, ref["norm_weight"], "float32", f"{tag}: d_norm_weight", grad=True)

    def two_phase(self, n, num_q, shape, dtype):
        torch, td, ops, f64 = self.torch, self.td, self.ops, self.f64
        name = str(dtype).replace("torch.", "")
        tag = self.two_phase_tag(n, num_q, shape, dtype)
        gen = torch.Generator().manual_seed(num_q * 100 + n)
        xs = self.sources(gen, n, shape, dtype, True)
        qs = self.rand(gen, (num_q, shape[-1]), torch.float32)
        gs = self.rand(gen, (num_q, shape[-1]), torch.float32) + 1.0
        out1, lse1 = td.multi_forward(xs, qs, gs, EPS, SCALE)
        r_out, r_lse = ops.depth_attention_multi(f64(xs), f64(qs), f64(gs), eps=EPS, scale=SCALE)
        self.close(out1, r_out, name, f"{tag}: multi out")
        self.close(lse1, r_lse, "float32", f"{tag}: multi lse")
        partial = self.rand(gen, shape, dtype)
        for s in range(num_q):
            out, lse = td.merge_forward(out1[s], lse1[s], partial, qs[s], gs[s], EPS, SCALE)
            d_out, d_lse = ops.depth_attention(f64(xs + [partial]), f64(qs[s]), f64(gs[s]),
                                               eps=EPS, scale=SCALE, return_lse=True)
            self.close(out, d_out, name, f"{tag}: merge(multi) vs direct out, query {s}")
            self.close(lse, d_lse, "float32", f"{tag}: merge(multi) vs direct lse, query {s}")
            m_out, m_lse = ops.merge_partial(f64(out1[s]), f64(lse1[s]), f64(partial), f64(qs[s]),
                                             f64(gs[s]), eps=EPS, scale=SCALE, return_lse=True)
            self.close(out, m_out, name, f"{tag}: merge out, query {s}")
            self.close(lse, m_lse, "float32", f"{tag}: merge lse, query {s}")

    def _graph_step(self, base, q, g, qs, gs, d_out, partial):
        """Every op once, its sources made here (`base[i] * 1`: inside a capture they are new
        allocations of the graph's pool, so every pointer table is filled by a node of it)."""
        td = self.td
        xs = [base[i] * 1 for i in range(base.shape[0])]
        out, lse = td.forward(xs, q, g, EPS, SCALE)
        d_src, d_q, d_g = td.backward(xs, q, g, out, lse, d_out, None, EPS, SCALE)
        out1, lse1 = td.multi_forward(xs, qs, gs, EPS, SCALE)
        m_out, m_lse = td.merge_forward(out1[0], lse1[0], partial, qs[0], gs[0], EPS, SCALE)
        return out, lse, d_src, d_q, d_g, out1, lse1, m_out, m_lse

    def graphs(self, quick):
        """CUDA-graph capture and no host sync (issue 13): forward, backward, phase 1 (S = 12,
        the two-pass path) and merge captured in one graph, replayed after the static inputs got
        new values, against the float64 reference; then the same calls eagerly with a cold table
        cache under `torch.cuda.set_sync_debug_mode("error")`, where any host sync raises.  On
        the CPU (dry run) the capture is simulated (`triton_depth._capturing` patched), which runs
        the tables' capture branch but no graph.  Returns a line for the report."""
        from unittest import mock
        torch, td, ops, f64 = self.torch, self.td, self.ops, self.f64
        gen = torch.Generator().manual_seed(77)
        n, shape, dtype, num_q = 3, (4, 64 if quick else 4096), torch.bfloat16, 12
        dim = shape[-1]
        base = self.rand(gen, (n,) + shape, dtype)                  # static inputs of the graph
        q, g = self.rand(gen, (dim,), torch.float32), self.rand(gen, (dim,), torch.float32) + 1.0
        qs = self.rand(gen, (num_q, dim), torch.float32)
        gs = self.rand(gen, (num_q, dim), torch.float32) + 1.0
        d_out, partial = self.rand(gen, shape, dtype), self.rand(gen, shape, dtype)
        args = (base, q, g, qs, gs, d_out, partial)
        failed = len(self.failures)
        if self.device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                           # compiles, outside the capture
                self._graph_step(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    res = self._graph_step(*args)
            except Exception as e:  # noqa: BLE001 - the finding itself
                self.failures.append(f"CUDA-graph capture of the ops: {type(e).__name__}: {e}")
                return "CUDA-graph capture: FAILED (see the failures)"
            base.copy_(self.rand(gen, (n,) + shape, dtype))         # new values, same storage
            graph.replay()
            torch.cuda.synchronize()
            how = "captured in one CUDA graph, replayed on new input values"
        else:
            with mock.patch.object(td, "_capturing", lambda device: True):
                res = self._graph_step(*args)
            how = "capture simulated on the CPU (the tables' capture branch; no graph)"
        out, lse, d_src, d_q, d_g, out1, lse1, m_out, m_lse = res
        xs = [base[i] for i in range(n)]
        tag = f"graph N={n} {shape} bf16"
        r_out, r_lse = ops.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=SCALE,
                                           return_lse=True)
        ref = ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(d_out), None, eps=EPS,
                                      scale=SCALE)
        r_out1, r_lse1 = ops.depth_attention_multi(f64(xs), f64(qs), f64(gs), eps=EPS, scale=SCALE)
        r_m, r_ml = ops.merge_partial(f64(out1[0]), f64(lse1[0]), f64(partial), f64(qs[0]),
                                      f64(gs[0]), eps=EPS, scale=SCALE, return_lse=True)
        self.close(out, r_out, "bfloat16", f"{tag}: out")
        self.close(lse, r_lse, "float32", f"{tag}: lse")
        self.close(d_src, ref["sources"], "bfloat16", f"{tag}: d_sources", grad=True)
        # fp32 gradients of bf16 sources at the sources' tolerance, as test_triton_depth.py has
        # it: d_query sums terms that cancel (the weights sum to 1), so its relative error is
        # that of the terms (1.7e-4 at the dry run's shape, as before the table and grid changes)
        self.close(d_q, ref["query"], "bfloat16", f"{tag}: d_query", grad=True)
        self.close(d_g, ref["norm_weight"], "bfloat16", f"{tag}: d_norm_weight", grad=True)
        self.close(out1, r_out1, "bfloat16", f"{tag}: phase-1 out, S={num_q}")
        self.close(lse1, r_lse1, "float32", f"{tag}: phase-1 lse, S={num_q}")
        self.close(m_out, r_m, "bfloat16", f"{tag}: merge out")
        self.close(m_lse, r_ml, "float32", f"{tag}: merge lse")
        sync = "not checked (no CUDA)"
        if self.device == "cuda":
            td._TABLES.clear()                                      # every table a miss
            torch.cuda.set_sync_debug_mode("error")
            try:
                self._graph_step(*args)
                sync = "none (set_sync_debug_mode('error'), cold table cache)"
            except RuntimeError as e:
                self.failures.append(f"host sync on the eager path: {e}")
                sync = "FOUND (see the failures)"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        verdict = "ok" if len(self.failures) == failed else "FAILED"
        return f"ops {how}: {verdict}; host syncs on the eager path: {sync}"


    def cases(self, quick):
        """[(label, call)] of every correctness case, in order; the CUDA-graph check last (its line
        for the report lands in `graph_note`)."""
        torch = self.torch
        f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
        out = []

        def depth(*a):
            out.append((self.depth_tag(*a), lambda: self.depth(*a)))

        def two_phase(*a):
            out.append((self.two_phase_tag(*a), lambda: self.two_phase(*a)))

        for dim in (1, 7, 33) if quick else (1, 7, 123, 1000, 4096, 20000):
            for dtype in (f32, bf16, f16):
                depth(9 if dim < 4096 else 3, (3, dim), dtype, False, True, dim % 2 == 1)
            depth(2, (2, 3, dim), f32, True, True, False)
            depth(1, (3, dim), bf16, True, False, True)
        depth(2 if quick else 33, (2, 5, 64), bf16, False, False, True)
        for dtype in (f32, bf16):
            two_phase(3, 5, (4, 33 if quick else 1000), dtype)
            two_phase(2 if quick else 8, 3 if quick else 12, (3, 64 if quick else 7168), dtype)

        def graphs():
            self.graph_note = self.graphs(quick)
        out.append(("CUDA-graph capture and host syncs", graphs))
        return out

    def poisoned_outputs(self):
        """Every output buffer the kernels allocate starts as NaN (a kernel that leaves an element
        unwritten fails its comparison): `triton_depth.poisoned_outputs`."""
        return self.td.poisoned_outputs()


# ---------------------------------------------------------------- timing (in a child)

class Timer:
    """kernel ms: CUDA-graph replay (or back-to-back calls) between two events, mean per call;
    call ms: median of single calls each followed by a synchronize (host overhead included)."""

    def __init__(self, torch, device, target_ms, max_iters, latency_calls):
        self.torch, self.dev = torch, device
        self.target_ms, self.max_iters, self.latency_calls = target_ms, max_iters, latency_calls

    def sync(self):
        if self.dev == "cuda":
            self.torch.cuda.synchronize()

    def _graph(self, fn):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    def latency(self, fn):
        times = []
        for _ in range(self.latency_calls):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def measure(self, fn, graph=True):
        """-> dict(kernel_ms, call_ms, method, iters); fn is warmed up (compiled) first."""
        torch = self.torch
        fn()
        self.sync()
        if self.dev != "cuda":
            iters = self.max_iters
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            kernel = (time.perf_counter() - t0) * 1e3 / iters
            return dict(kernel_ms=kernel, call_ms=self.latency(fn), iters=iters,
                        method="back-to-back (host clock)")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        one = max(start.elapsed_time(end), 1e-3)
        iters = int(min(max(self.target_ms / one, 3), self.max_iters))
        run, method, g = fn, "back-to-back", None
        if graph:
            try:
                g = self._graph(fn)
                run, method = g.replay, "CUDA graph replay"
            except Exception as e:  # noqa: BLE001 - not capturable: say so, time back-to-back
                method = f"back-to-back (graph capture failed: {type(e).__name__}: {str(e)[:60]})"
                g = None
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
        run()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        kernel = start.elapsed_time(end) / iters
        del g
        return dict(kernel_ms=kernel, call_ms=self.latency(fn), iters=iters, method=method)


def device_error(torch, device):
    """None, or the error a synchronize raises on `device` (a sticky CUDA error: the context is
    lost, and every later call in this process fails)."""
    if device != "cuda":
        return None
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the finding itself
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


class Bench:
    """The timed sections in one child: `run_ours()` (our kernels and autograd op) or
    `run_peer(ad)` (one adapter), in the order of `plan`; each row is sent (`emit("row", ...)`)
    as soon as it is measured.  Each section's inputs are seeded by its case, so every child
    times the same values; its large tensors are freed when it returns."""

    def __init__(self, args, torch, td, peers, emit, caps, copy_gbs=None):
        self.args, self.torch, self.td, self.peers = args, torch, td, peers
        self.emit, self.caps, self.copy_gbs = emit, caps, copy_gbs
        self.dev = args.device
        self.timer = Timer(torch, self.dev, args.target_ms, args.max_iters, args.latency_calls)
        self.dead = None                   # why this child times nothing more (a cap fired)

    # ---- bookkeeping

    def copy_bandwidth(self):
        """GB/s of dst.copy_(src) (read + write) on a large buffer, by the same timer."""
        numel = (1 << 16) if self.args.quick else (1 << 30)
        src = self.torch.empty(numel, dtype=self.torch.uint8, device=self.dev)
        dst = self.torch.empty_like(src)
        m = self.timer.measure(lambda: dst.copy_(src))
        self.copy_gbs = 2 * numel / (m["kernel_ms"] * 1e-3) / 1e9
        self.emit("copy", gbs=self.copy_gbs,
                  note=f"measured copy bandwidth (dst.copy_(src), {numel / 2**30:.3g} GiB, "
                       f"{m['method']}): {self.copy_gbs:.0f} GB/s")

    def row(self, section, case, impl, status, m=None, nbytes=None, note=""):
        r = dict(section=section, case=case, impl=impl, status=status, note=note, kernel_ms=None,
                 call_ms=None, method=None, iters=None, bytes=nbytes)
        if m is not None:
            r.update(m)
        self.emit("row", **r)
        shown = status
        if m is not None:
            gbs = nbytes / (m["kernel_ms"] * 1e-3) / 1e9
            shown = (f"{m['kernel_ms']:.4g} ms kernel, {m['call_ms']:.4g} ms call, {gbs:.0f} GB/s, "
                     f"{m['method']}")
        print(f"  [{section}] {case} | {impl}: {shown}{' | ' + note if note else ''}", flush=True)

    def device_error(self):
        return device_error(self.torch, self.dev)

    def release(self):
        if self.dev == "cuda":
            try:
                self.torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - a sticky error re-raised here
                raise DeviceLost(f"torch.cuda.empty_cache: {type(e).__name__}: {str(e)[:200]}") from None

    def time(self, section, case, impl, make, nbytes, graph=True, note=""):
        """make() builds the call (untimed; may raise peers.Unsupported) -> (fn, note); its first
        call runs under the warm-up cap, the measurement under what is left of the child's cap.
        A cap that fires ends this child's timing (later rows: "skipped" with the reason); an
        error is the row's ("failed"), unless the device state is lost, which ends the child."""
        if self.dead is not None:
            return self.row(section, case, impl, "skipped", note=self.dead)
        self.emit("start", section=section, case=case, impl=impl)
        warm = self.args.warmup_cap
        try:
            with self.caps.guard(warm, f"{impl}: first call (compile, autotune) over the "
                                       f"{warm:.0f} s warm-up cap"):
                fn, extra = make()
                fn()
                self.timer.sync()
            with self.caps.guard():
                m = self.timer.measure(fn, graph)
            self.row(section, case, impl, "ok", m, nbytes, "; ".join(x for x in (note, extra) if x))
        except self.peers.Unsupported as e:
            self.row(section, case, impl, "skipped", note=str(e))
        except Timeout as e:
            self.dead = f"not timed: {e} (in {section}, {case})"
            self.row(section, case, impl, "timeout", note=str(e))
        except Exception as e:  # noqa: BLE001 - a peer's or a compile's failure is its row's
            lost = self.device_error()
            self.row(section, case, impl, "failed", note=f"{type(e).__name__}: {str(e)[:300]}"
                     + (f"; device state lost: {lost}" if lost else ""))
            if lost:
                raise DeviceLost(f"{impl} in {section}, {case}: {lost}") from None
        finally:
            self.release()

    def sources(self, n, t, d, requires_grad=False):
        torch = self.torch
        return [torch.randn(t, d, device=self.dev, dtype=torch.bfloat16).requires_grad_(requires_grad)
                for _ in range(n)]

    def inputs(self, case, n, t, d):
        """Sources N x `[T, D]` bf16, query `[D]`, gain `[D]`, the same in every child (seeded by
        the case)."""
        torch = self.torch
        torch.manual_seed(zlib.crc32(case.encode()))
        xs = self.sources(n, t, d)
        q = torch.randn(d, device=self.dev)
        g = torch.rand(d, device=self.dev) + 0.5
        return self.peers.Inputs(xs, q, g, EPS, SCALE)

    def _diff(self, out, ours):
        """max |out - ours|; a peer's extra unit axes (flash-attn-res's B = 1) are dropped, any
        other shape difference is a failure (never a broadcast)."""
        out = out[0] if isinstance(out, (tuple, list)) else out
        if out.numel() != ours.numel():
            raise ValueError(f"output shape {tuple(out.shape)} != ours {tuple(ours.shape)}")
        diff = (out.reshape(ours.shape).float() - ours.float()).abs().max().item()
        return f"max |out - ours| = {diff:.3g}"

    def op(self, xs, q, g):
        import attnres_torch
        return attnres_torch.depth_attention(xs, q, g, eps=EPS, scale=SCALE)

    # ---- sections (ad None: ours)

    def forward(self, n, t, d, ad=None):
        td, sec = self.td, "forward"
        case = read_case(n, t, d)
        inp = self.inputs(case, n, t, d)
        xs, q, g = inp.sources, inp.query, inp.gain
        nbytes = (n + 1) * t * d * 2 + t * 4            # read N sources, write out and lse
        if ad is None:
            self.time(sec, case, OURS, lambda: ((lambda: td.forward(xs, q, g, EPS, SCALE)), ""), nbytes)
            self.time(sec, case, OP, lambda: ((lambda: self.op(xs, q, g)), ""), nbytes)
            return

        def make():
            ad.load()
            ad.check(inp)
            prep = ad.prepare(inp)
            note = self._diff(ad.forward(prep), td.forward(xs, q, g, EPS, SCALE)[0])
            return (lambda: ad.forward(prep)), note + (f"; {ad.notes}" if ad.notes else "")
        with ad.environment():
            self.time(sec, case, ad.name, make, nbytes)

    def training(self, n, t, d, ad=None):
        """backward-only and forward+backward (random d_out; gradients of every leaf)."""
        torch, td = self.torch, self.td
        case = read_case(n, t, d)
        inp = self.inputs(case, n, t, d)
        xs, q, g = inp.sources, inp.query, inp.gain
        d_out = torch.randn(t, d, device=self.dev, dtype=torch.bfloat16)
        fwd_bytes = (n + 1) * t * d * 2
        bwd_bytes = (2 * n + 1) * t * d * 2            # read N sources and d_out, write N grads

        def ours_bwd():
            out, lse = td.forward(xs, q, g, EPS, SCALE)
            return (lambda: td.backward(xs, q, g, out, lse, d_out, None, EPS, SCALE)), ""

        def ours_fb():
            o, s = td.forward(xs, q, g, EPS, SCALE)
            return td.backward(xs, q, g, o, s, d_out, None, EPS, SCALE)

        def autograd_make(a, fwd_too):
            def make():
                a.load()
                a.check(inp)
                prep = a.prepare(inp, requires_grad=True)
                if fwd_too:
                    return (lambda: torch.autograd.grad(a.forward(prep), prep.leaves, d_out)), a.notes
                o = a.forward(prep)
                return (lambda: torch.autograd.grad(o, prep.leaves, d_out, retain_graph=True)), a.notes
            return make

        for sec, nbytes, fwd_too in (("backward only", bwd_bytes, False),
                                     ("forward+backward", fwd_bytes + bwd_bytes, True)):
            # autograd calls: back-to-back for backward only (a backward recorded outside a
            # capture runs on the legacy stream); forward+backward tries a graph
            if ad is None:
                self.time(sec, case, OURS, (lambda: (ours_fb, "")) if fwd_too else ours_bwd, nbytes)
                self.time(sec, case, OP, autograd_make(_OpAdapter(self), fwd_too), nbytes,
                          graph=fwd_too)
            else:
                with ad.environment():
                    self.time(sec, case, ad.name, autograd_make(ad, fwd_too), nbytes, graph=fwd_too)

    def two_phase(self, nb, s_l, t, d, ad=None):
        """phase 1 (S queries over nb blocks) and one merge; a peer where it has those entry
        points (flash-attn-res, the composites)."""
        torch, td = self.torch, self.td
        case = two_phase_case(nb, s_l, t, d)
        inp = self.inputs(case, nb, t, d)
        qs, gs = torch.randn(s_l, d, device=self.dev), torch.rand(s_l, d, device=self.dev) + 0.5
        partial = self.sources(1, t, d)[0]
        tdb = t * d * 2
        memo = {}

        def ours_p1():                                  # (out1 [S, T, D], lse1 [S, T]), once
            if "p1" not in memo:
                memo["p1"] = td.multi_forward(inp.sources, qs, gs, EPS, SCALE)
            return memo["p1"]

        def ours_merge():
            out1, lse1 = ours_p1()
            return td.merge_forward(out1[1], lse1[1], partial, qs[1], gs[1], EPS, SCALE)

        for kind, nbytes, has in (("phase 1", (nb + s_l) * tdb, has_phase1),
                                  ("merge", 3 * tdb, has_merge)):
            if ad is None:
                fn = (lambda: td.multi_forward(inp.sources, qs, gs, EPS, SCALE)) if kind == "phase 1" \
                    else ours_merge
                self.time(kind, case, OURS, lambda fn=fn: (fn, ""), nbytes)
                continue
            if not has(self.peers, ad):
                continue

            def build(kind=kind):
                ad.load()
                if kind == "phase 1":
                    fn = ad.phase1(inp, qs, gs)
                    return fn, self._diff(fn(), ours_p1()[0])
                out1, lse1 = ours_p1()
                fn = ad.merge(out1[1], lse1[1], partial, qs[1], gs[1], EPS, SCALE)
                return fn, self._diff(fn(), ours_merge()[0])
            with ad.environment():
                self.time(kind, case, ad.name, build, nbytes)

    def block(self, nb, s_l, t, d):
        """One block of the two-phase schedule against independent reads (both update partial)."""
        td = self.td
        sec, case = "block", block_case(nb, s_l, t, d)
        self.torch.manual_seed(zlib.crc32(case.encode()))
        blocks = self.sources(nb, t, d)
        qs = self.torch.randn(s_l, d, device=self.dev)
        gs = self.torch.rand(s_l, d, device=self.dev) + 0.5
        updates = self.sources(s_l, t, d)                              # stand-ins for f_l(h_l)
        tdb = t * d * 2

        def two_phase():
            out1, lse1 = td.multi_forward(blocks, qs, gs, EPS, SCALE)
            partial = updates[0]
            td.merge_forward(out1[1], lse1[1], partial, qs[1], gs[1], EPS, SCALE)
            for i in range(2, s_l):
                partial = partial + updates[i - 1]
                td.merge_forward(out1[i], lse1[i], partial, qs[i], gs[i], EPS, SCALE)

        def independent():
            td.forward(blocks, qs[0], gs[0], EPS, SCALE)
            partial = updates[0]
            for i in range(1, s_l):
                if i > 1:
                    partial = partial + updates[i - 1]
                td.forward(blocks + [partial], qs[i], gs[i], EPS, SCALE)

        # minimal bytes: phase 1 reads nb blocks and writes s_l outputs; the first merge reads
        # out1 and partial and writes out; each later one adds the update to partial (read 2,
        # write 1) and merges (read 2, write 1).  Independent: read nb (+1) sources, write out;
        # an add: 3.
        two_bytes = (nb + s_l) * tdb + 3 * tdb + (s_l - 2) * 6 * tdb
        ind_bytes = sum((nb + (i > 0) + 1) * tdb for i in range(s_l)) + (s_l - 2) * 3 * tdb
        self.time(sec, case, "attnres two-phase (multi + merges)", lambda: (two_phase, ""), two_bytes)
        self.time(sec, case, f"attnres {s_l} independent reads", lambda: (independent, ""), ind_bytes)

    def run_ours(self):
        """Ours at the two target shapes first, then the other sections (`plan`)."""
        s = shapes(self.args.quick)
        self.forward(*s["fwd"])
        self.training(*s["train"])
        self.forward(*s["train"])
        self.block(*s["block"])
        for tp in s["two_phase"]:
            self.two_phase(*tp)

    def run_peer(self, ad):
        s = shapes(self.args.quick)
        self.forward(*s["fwd"], ad=ad)
        self.training(*s["train"], ad=ad)
        self.forward(*s["train"], ad=ad)
        for tp in s["two_phase"]:
            self.two_phase(*tp, ad=ad)


class _OpAdapter:
    """Our public autograd op, timed through the same autograd path as the peers."""
    name, notes, env = "attnres_torch.depth_attention (autograd)", "", {}

    def __init__(self, bench):
        self.bench = bench

    def load(self):
        pass

    def check(self, inp):
        pass

    def prepare(self, inp, requires_grad=False):
        from peers import Prepared  # noqa: PLC0415 - bench/ is on sys.path in main()
        xs = [s.detach().requires_grad_(requires_grad) for s in inp.sources]
        q, g = (t.detach().requires_grad_(requires_grad) for t in (inp.query, inp.gain))
        return Prepared((xs, q, g), leaves=xs + [q, g])

    def forward(self, prep):
        return self.bench.op(*prep.args)

    def environment(self):
        import contextlib
        return contextlib.nullcontext()

# ---------------------------------------------------------------- the children's entry points

def _tree_paths():
    """Nothing of ours is installed on the GPU machine: every package from the tree (_helpers
    compares with the suite's tolerance table, attnres_conformance)."""
    for sub in ("conformance/src", "core/src", "reference_numpy/src", "backend_torch/src",
                "backend_torch/tests", "bench"):
        if str(ROOT / sub) not in sys.path:
            sys.path.insert(0, str(ROOT / sub))


def load_adapters(args, peers):
    """The peers in run order: cheapest first (`cost`, stable), from bench/peers or
    `--peers-module`; the composites' torch.compile out with --skip-compile."""
    if args.peers_module is not None:
        spec = importlib.util.spec_from_file_location("gpu_check_peers_module", args.peers_module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        adapters = mod.all_adapters()
    else:
        adapters = peers.all_adapters()
    if args.skip_compile:
        adapters = [a for a in adapters if not isinstance(a, peers.Compiled)]
    return sorted(adapters, key=lambda a: a.cost)


def _torch_child_setup(args, emit):
    """Imports for a torch child; exits 2 (after saying why) when the device is unusable."""
    _tree_paths()
    import peers
    peers.add_peer_site()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        emit("nodevice", reason="no CUDA device (--dry-run runs the whole script on the CPU)")
        sys.exit(2)
    from attnres_torch.kernels import triton_depth as td
    probe = [torch.zeros(2, 4, device=args.device)]
    if not td.supports(probe, torch.zeros(4, device=args.device), None, num_heads=1,
                       activation="softmax", key_norm=True):
        emit("nodevice", reason="the Triton kernels do not support this device (Triton missing, "
                                "or a CPU run without TRITON_INTERPRET=1)")
        sys.exit(2)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    emit("meta", device=torch.cuda.get_device_name() if args.device == "cuda" else "CPU (interpreter)",
         torch=torch.__version__, triton=triton_version)
    return torch, td, peers


def correctness_child(args, emit):
    """Every `Checker` case in turn under the phase's cap; a case that raises is a failure and
    the next one runs, unless the device state is lost (then the phase ends)."""
    torch, td, peers = _torch_child_setup(args, emit)
    import _helpers
    from attnres_numpy import ops
    caps = Caps(args.child_cap, "correctness")
    checker = Checker(torch, td, ops, _helpers, args.device)
    cases = checker.cases(args.quick)
    emit("ready", cases=len(cases))
    run = 0
    try:
        with caps.guard(), checker.poisoned_outputs():
            for label, call in cases:
                passed, failed = checker.passed, len(checker.failures)
                lost = None
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - a case that raises is a failure
                    checker.failures.append(f"{label}: raised {type(e).__name__}: {str(e)[:300]}")
                    lost = device_error(torch, args.device)
                run += 1
                emit("check", case=label, passed=checker.passed - passed,
                     failures=checker.failures[failed:], run=run)
                if lost:
                    emit("incomplete", reason=f"device state lost after '{label}' ({lost}): "
                                              f"{len(cases) - run} of {len(cases)} cases not run")
                    return 4
    except Timeout as e:
        where = f"in '{cases[run][0]}'" if run < len(cases) else "after the last case"
        emit("incomplete", reason=f"{e}: {len(cases) - run} of {len(cases)} cases not run "
                                  f"(the cap fired {where})")
        return 3
    emit("note", text=checker.graph_note)
    emit("done")
    return 0


def timing_child(args, emit):
    """Ours (`--child ours`) or one peer (`--child peer --child-impl NAME`) through `Bench`."""
    torch, td, peers = _torch_child_setup(args, emit)
    ad = None
    if args.child == "peer":
        (ad,) = [a for a in load_adapters(args, peers) if a.name == args.child_impl]
    caps = Caps(args.child_cap, "ours" if ad is None else ad.name)
    emit("ready")
    bench = Bench(args, torch, td, peers, emit, caps, args.copy_gbs)
    try:
        if bench.copy_gbs is None:
            with caps.guard():
                bench.copy_bandwidth()
        if ad is None:
            bench.run_ours()
        else:
            with AutotuneTrim(args.autotune_configs, emit, ad.name):
                try:
                    with caps.guard(args.warmup_cap, f"{ad.name}: import over the "
                                                     f"{args.warmup_cap:.0f} s warm-up cap"):
                        version = peer_version(ad)
                except Timeout as e:
                    version = bench.dead = str(e)
                emit("meta", peer=ad.name, version=version)
                bench.run_peer(ad)
    except DeviceLost as e:
        emit("lost", reason=str(e))
        return 4
    except Timeout as e:                               # outside a row (the copy measurement)
        emit("note", text=f"{e} (outside a row)")
        return 3
    emit("done")
    return 0


def peer_version(ad):
    """The peer's distribution version, or why it has none."""
    if ad.dist is None:
        return "(part of this run)"
    try:
        ad.load()
        from importlib.metadata import version
        return version(ad.dist)
    except Exception as e:  # noqa: BLE001 - Unsupported (not importable) or no metadata
        return f"{type(e).__name__}: {str(e)[:120]}"


def jax_child(args, emit):
    """attnres_jax (impl "xla" and "pallas"), jitted, forward at the forward shape and
    forward+backward (VJP of every source, query and gain) at the training shape
    (`jax_plan`).  JAX and torch in one process would fight over the GPU's memory:
    XLA_PYTHON_CLIENT_PREALLOCATE=false here, and torch is not imported."""
    import jax
    import jax.numpy as jnp
    from attnres_jax import depth_attention

    dev = jax.devices("gpu")[0] if args.device == "cuda" else jax.devices("cpu")[0]
    emit("meta", jax=jax.__version__, jax_device=str(dev))
    emit("ready")

    def timed(fn, *xs):
        jax.block_until_ready(fn(*xs))                   # compile
        t0 = time.perf_counter()
        one = jax.block_until_ready(fn(*xs))
        one = (time.perf_counter() - t0) * 1e3
        iters = int(min(max(args.target_ms / max(one, 1e-3), 3), args.max_iters))
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn(*xs)
        jax.block_until_ready(r)
        kernel = (time.perf_counter() - t0) * 1e3 / iters
        lat = []
        for _ in range(args.latency_calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*xs))
            lat.append((time.perf_counter() - t0) * 1e3)
        return dict(kernel_ms=kernel, call_ms=statistics.median(lat), iters=iters,
                    method="back-to-back, async dispatch (host clock)")

    def row(section, case, impl, status, m=None, nbytes=None, note=""):
        emit("row", **dict(dict(section=section, case=case, impl=impl, status=status, note=note,
                                bytes=nbytes), **(m or {})))
        print(f"  [{section}] {case} | {impl}: {status} {m or ''} {note}", flush=True)

    key = jax.random.PRNGKey(0)
    s = shapes(args.quick)
    for section, (n, t, d) in (("forward", s["fwd"]), ("forward+backward", s["train"])):
        case = read_case(n, t, d)
        ks = jax.random.split(key, n + 3)
        xs = [jax.device_put(jax.random.normal(k, (t, d), jnp.bfloat16), dev) for k in ks[:n]]
        q = jax.device_put(jax.random.normal(ks[n], (d,), jnp.float32), dev)
        g = jax.device_put(jax.random.uniform(ks[n + 1], (d,), jnp.float32) + 0.5, dev)
        cot = jax.device_put(jax.random.normal(ks[n + 2], (t, d), jnp.bfloat16), dev)
        fwd_bytes = (n + 1) * t * d * 2
        for impl in ("xla", "pallas"):
            name = f"attnres_jax impl={impl}"

            def f(xs, q, g, impl=impl):
                return depth_attention(xs, q, g, eps=EPS, scale=SCALE, impl=impl)
            if section == "forward":
                fn, nbytes = jax.jit(f), fwd_bytes
            else:
                def fb(xs, q, g, f=f):
                    out, pull = jax.vjp(f, xs, q, g)
                    return pull(cot)
                fn, nbytes = jax.jit(fb), fwd_bytes + (2 * n + 1) * t * d * 2
            emit("start", section=f"jax {section}", case=case, impl=name)
            try:
                row(f"jax {section}", case, name, "ok", timed(fn, xs, q, g), nbytes)
            except ValueError as e:       # the implementation cannot run this call: a skip
                row(f"jax {section}", case, name, "skipped", note=str(e)[:200])
            except Exception as e:  # noqa: BLE001
                row(f"jax {section}", case, name, "failed", note=f"{type(e).__name__}: {str(e)[:200]}")
    emit("done")
    return 0


def child_main(args):
    """A child's whole life; it ends with `os._exit` (no interpreter teardown, which a broken
    CUDA context can hang) once its output is flushed."""
    emit = Channel(args.msg_fd)
    run = {"jax": jax_child, "correctness": correctness_child}.get(args.child, timing_child)
    try:
        rc = run(args, emit)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed for the parent's log, then the exit status
        import traceback
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---------------------------------------------------------------- the parent: report

def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def atomic_write(path: Path, text: str):
    """Write `text` to `path` through a temporary file renamed over it: a reader (or a kill) sees
    the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Report:
    """Everything the run measured, written to `out_dir` after every change (`write`):
    report.md, report.json and rows.jsonl, each atomically; log.txt is appended to.  Rows are
    kept in the order they arrive; the table sorts them by `order` (the sections and cases of
    ours, then the implementations in run order).  Thread-safe (the children's readers, the
    watchdog and the main thread all write)."""

    def __init__(self, out_dir, meta, order):
        self.out_dir, self.meta, self.lock = out_dir, meta, threading.RLock()
        self.case_order, self.impl_order = order
        self.rows, self.notes, self.phases, self.autotune = [], [], [], []
        self.correctness = dict(passed=0, failures=[], cases=None, run=0, complete=False,
                                skipped=False, reason="not run")
        self.distributed, self.copy_gbs, self.partial, self.current = None, None, None, "start-up"
        self.peers = {}
        self.t0 = time.monotonic()
        self.log_file = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.log_file = open(out_dir / "log.txt", "a", buffering=1)

    def log(self, line):
        with self.lock:
            print(line, flush=True)
            if self.log_file is not None:
                self.log_file.write(line + "\n")

    def note(self, text):
        with self.lock:
            self.notes.append(text)
            self.write()

    def add_row(self, phase, fields):
        with self.lock:
            r = dict(section=fields.get("section"), case=fields.get("case"), impl=fields.get("impl"),
                     status=fields.get("status"), note=fields.get("note") or "",
                     kernel_ms=fields.get("kernel_ms"), call_ms=fields.get("call_ms"),
                     method=fields.get("method"), iters=fields.get("iters"),
                     bytes=fields.get("bytes"), gbs=None, frac_copy=None, phase=phase,
                     at_s=round(time.monotonic() - self.t0, 1))
            if r["kernel_ms"] and r["bytes"]:
                r["gbs"] = r["bytes"] / (r["kernel_ms"] * 1e-3) / 1e9
            self.rows.append(r)
            self.write()
            return r

    def keys(self):
        with self.lock:
            return {(r["section"], r["case"], r["impl"]) for r in self.rows}

    def _final_rows(self):
        for r in self.rows:
            r["frac_copy"] = r["gbs"] / self.copy_gbs if r["gbs"] and self.copy_gbs else None
        n = len(self.case_order)
        return sorted(self.rows, key=lambda r: (self.case_order.get((r["section"], r["case"]), n),
                                                self.impl_order.get(r["impl"], len(self.impl_order))))

    def render(self):
        meta = self.meta
        c = self.correctness
        lines = [f"### Depth attention on {meta.get('device', '?')} ({meta['date']})", "",
                 f"torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}"
                 + (f", jax {meta['jax']}" if meta.get("jax") else "") + "; peers: "
                 + (", ".join(f"{k} {v}" for k, v in self.peers.items()) or "none"), ""]
        if self.partial:
            lines += [f"**PARTIAL REPORT: {self.partial}.**", ""]
        if c["skipped"]:
            lines += ["Correctness: skipped (--skip-correctness).", ""]
        else:
            state = "complete" if c["complete"] else f"INCOMPLETE: {c['reason']}"
            lines += [f"Correctness vs float64 reference: {c['passed']} comparisons passed, "
                      f"{len(c['failures'])} failures; {c['run']} of {c['cases'] or '?'} cases run "
                      f"({state}).", ""]
        lines += ["| phase | status | seconds | note |", "|---|---|---:|---|"]
        lines += [f"| {p['name']} | {p['status']} | {_fmt(p.get('seconds'), '.1f')} | "
                  f"{str(p.get('note', '')).replace('|', '/')} |" for p in self.phases]
        lines += ["", "| section | case | implementation | kernel ms | call ms | GB/s (minimal bytes) "
                  "| fraction of copy BW | timing | note |",
                  "|---|---|---|---:|---:|---:|---:|---|---|"]
        for r in self._final_rows():
            status = "" if r["status"] == "ok" else f"**{r['status']}**: "
            lines.append(f"| {r['section']} | {r['case']} | {r['impl']} | {_fmt(r['kernel_ms'], '.4g')} "
                         f"| {_fmt(r['call_ms'], '.4g')} | {_fmt(r['gbs'], '.4g')} "
                         f"| {_fmt(r['frac_copy'], '.2f')} | {r['method'] or ''} "
                         f"| {status}{str(r['note']).replace('|', '/')} |")
        lines += [""] + [f"- {n}" for n in self.notes]
        if self.autotune:
            lines += ["", "Autotune lists of the peers, as trimmed (`--autotune-configs`):"]
            lines += [f"- {a}" for a in self.autotune]
        if c["failures"]:
            lines += ["", "Correctness failures:"] + [f"- {f}" for f in c["failures"]]
        lines += ["", f"{time.monotonic() - self.t0:.1f} s since the start"]
        return "\n".join(lines) + "\n"

    def as_json(self):
        return dict(meta=self.meta, partial=self.partial, correctness=self.correctness,
                    distributed=self.distributed, copy_gbs=self.copy_gbs, phases=self.phases,
                    rows=self._final_rows(), notes=self.notes, autotune=self.autotune,
                    peers=self.peers, total_s=time.monotonic() - self.t0)

    def write(self):
        if self.out_dir is None:
            return
        with self.lock:
            md = self.render()
            atomic_write(self.out_dir / "report.md", md)
            atomic_write(self.out_dir / "report.json",
                         json.dumps(self.as_json(), indent=1, default=str) + "\n")
            atomic_write(self.out_dir / "rows.jsonl",
                         "".join(json.dumps(r, default=str) + "\n" for r in self.rows))


# ---------------------------------------------------------------- the parent: children, deadline

class Children:
    """The live child processes, each the leader of its own process group (its compiler and
    autotuning subprocesses die with it)."""

    def __init__(self):
        self.lock, self.live = threading.Lock(), set()

    def start(self, cmd, env, pass_fds=()):
        with self.lock:
            proc = subprocess.Popen(cmd, env=env, pass_fds=pass_fds, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, text=True, errors="replace")
            self.live.add(proc)
        return proc

    def kill(self, proc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def done(self, proc):
        with self.lock:
            self.live.discard(proc)

    def kill_all(self):
        with self.lock:
            for proc in list(self.live):
                self.kill(proc)


class Watchdog(threading.Thread):
    """At the deadline: records in the report what the budget cut, kills the running child and
    writes the partial report; the main thread then records the rows that did not run.  If the
    main thread has not finished `grace` seconds later, it writes the report once more and ends
    the process (`exit(3)`).  `fire(why)` does the same at once (SIGTERM)."""

    def __init__(self, report, children, deadline, budget, grace=WATCHDOG_GRACE, exit=os._exit):
        super().__init__(name="gpu_check watchdog", daemon=True)
        self.report, self.children, self.deadline, self.budget = report, children, deadline, budget
        self.grace, self.exit = grace, exit
        self.finished, self.fired = threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def run(self):
        if self.finished.wait(max(0.0, self.deadline - time.monotonic())):
            return
        self.fire(f"the run's {self.budget:.0f} s budget ran out")
        if self.finished.wait(self.grace):
            return
        self.report.note(f"the main thread did not finish within {self.grace:.0f} s of the "
                         f"deadline; the process ended here")
        self.exit(3)

    def fire(self, why):
        with self.lock:
            if self.fired.is_set():
                return
            with self.report.lock:
                self.report.partial = f"{why} during {self.report.current}"
                self.fired.set()
            self.report.log(f"gpu_check: {self.report.partial}; the report so far is written")
            self.children.kill_all()
            self.report.write()

    def stop(self):
        self.finished.set()


class Run:
    """The parent: runs each phase's child under min(its cap, the budget left), feeding the
    report as the child's messages arrive."""

    def __init__(self, args, peers, adapters):
        self.args, self.peers, self.adapters = args, peers, adapters
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        ours = plan(args.quick)
        keys = [(s, c) for s, c, _ in ours]
        for ad in adapters:
            keys += [(s, c) for s, c, _ in plan(args.quick, peers, ad)]
        keys += [(s, c) for s, c, _ in jax_plan(args.quick)]
        impls = [OURS, OP] + [i for _, _, i in ours if i not in (OURS, OP)] + [a.name for a in adapters] \
            + [i for _, _, i in jax_plan(args.quick)]
        order = ({k: i for i, k in reversed(list(enumerate(keys)))},
                 {k: i for i, k in reversed(list(enumerate(impls)))})
        meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    peer_site=str(peers.PEER_SITE) if peers.PEER_SITE.is_dir() else None,
                    args={k: str(v) for k, v in vars(args).items()},
                    run_order=["correctness", "ours", "distributed smoke"]
                    + [a.name for a in adapters] + ["jax"])
        self.report = Report(args.out_dir, meta, order)
        self.children = Children()
        self.watchdog = Watchdog(self.report, self.children, self.deadline, args.budget)
        self.nodevice = None

    def left(self):
        return self.deadline - time.monotonic()

    def stopped(self):
        return self.watchdog.fired.is_set()

    def env(self, jax=False):
        env = dict(os.environ)
        if self.args.dry_run:
            env["TRITON_INTERPRET"] = "1"
        paths = [str(ROOT), str(ROOT / "core" / "src"), str(ROOT / "reference_numpy" / "src")]  # ROOT: experiments/
        paths += [str(ROOT / "backend_jax" / "src")] if jax else [str(ROOT / "backend_torch" / "src")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
        if jax:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            env.pop("TRITON_INTERPRET", None)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def child_cmd(self, kind, cap, impl=None, python=None):
        a = self.args
        cmd = [python or sys.executable, str(SCRIPT), "--child", kind, "--child-cap", f"{cap:.1f}",
               "--device", a.device, "--target-ms", str(a.target_ms), "--max-iters", str(a.max_iters),
               "--latency-calls", str(a.latency_calls), "--warmup-cap", str(a.warmup_cap),
               "--autotune-configs", str(a.autotune_configs)]
        cmd += ["--quick"] * a.quick + ["--dry-run"] * a.dry_run + ["--skip-compile"] * a.skip_compile
        if impl is not None:
            cmd += ["--child-impl", impl]
        if a.peers_module is not None:
            cmd += ["--peers-module", str(a.peers_module)]
        if self.report.copy_gbs is not None:
            cmd += ["--copy-gbs", repr(self.report.copy_gbs)]
        return cmd

    # ---- one child

    def run_child(self, phase, cmd, cap, env, on_msg=None):
        """Run one child to its end: its messages (`on_msg`, when it has the message pipe) and
        output lines (to the log) as they come; killed KILL_GRACE s past `cap` counted from its
        'ready' (before that: STARTUP_CAP; a child without messages: from its start).  ->
        dict(rc, killed (None, "cap", "start-up", "budget"), done, tail, last_start, seconds)."""
        state = dict(ready_at=None, done=False, start=None)
        r = w = None
        if on_msg is not None:
            r, w = os.pipe()
            cmd = cmd + ["--msg-fd", str(w)]
        t0 = time.monotonic()
        proc = self.children.start(cmd, env, pass_fds=(w,) if w is not None else ())
        if w is not None:
            os.close(w)
        tail, flagged = collections.deque(maxlen=40), collections.deque(maxlen=20)

        def read_msgs():
            with os.fdopen(r) as f:
                for line in f:
                    try:
                        m = json.loads(line)
                    except ValueError:
                        continue
                    kind = m.get("t")
                    if kind == "ready":
                        state["ready_at"] = time.monotonic()
                    elif kind == "done":
                        state["done"] = True
                    elif kind == "lost":
                        state["lost"] = m["reason"]
                    elif kind == "start":
                        state["start"] = (m["section"], m["case"], m["impl"])
                        with self.report.lock:
                            self.report.current = f"{phase}: {m['section']}, {m['case']}, {m['impl']}"
                    elif kind == "row" and state["start"] == (m["section"], m["case"], m["impl"]):
                        state["start"] = None
                    try:
                        on_msg(m)
                    except Exception as e:  # noqa: BLE001 - a bad message must not stop the reader
                        self.report.log(f"gpu_check: message {line.strip()[:200]} not understood: {e!r}")

        def read_out():
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if "FAIL" in line or "Error" in line or "error:" in line:
                    flagged.append(line.strip())
                self.report.log(f"[{phase}] {line}")

        threads = [threading.Thread(target=read_out, daemon=True)]
        if r is not None:
            threads.append(threading.Thread(target=read_msgs, daemon=True))
        for t in threads:
            t.start()
        killed = None
        while True:
            try:
                rc = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if on_msg is None:
                limit, why = t0 + cap + KILL_GRACE, "cap"
            elif state["ready_at"] is None:
                limit, why = t0 + STARTUP_CAP, "start-up"
            else:
                limit, why = state["ready_at"] + cap + KILL_GRACE, "cap"
            if now > limit:
                killed = why
                self.children.kill(proc)
                rc = proc.wait()
                break
        self.children.done(proc)
        for t in threads:
            t.join(timeout=10)
        if self.stopped() and not state["done"]:
            killed = "budget"
        return dict(rc=rc, killed=killed, done=state["done"], lost=state.get("lost"), tail=list(tail),
                    flagged=list(flagged), last_start=state["start"],
                    seconds=time.monotonic() - t0)

    @staticmethod
    def why_ended(end, cap):
        """What ended a child that did not finish, in words."""
        if end["killed"] == "budget":
            return "the run's budget ran out"
        if end["killed"] == "cap":
            return f"no answer {cap:.0f} s after its start-up, killed (a hang its own caps could not stop)"
        if end["killed"] == "start-up":
            return f"not ready {STARTUP_CAP:.0f} s after its start, killed"
        if end.get("lost"):
            return f"the device state was lost ({end['lost']})"
        last = (end["flagged"] or [ln for ln in end["tail"] if ln.strip()] or [""])[-1].strip()
        return f"the child exited with status {end['rc']}" + (f": {last[:300]}" if last else "")

    def phase(self, name, status, t0=None, note=""):
        with self.report.lock:
            self.report.phases.append(dict(name=name, status=status, note=note,
                                           seconds=None if t0 is None else time.monotonic() - t0))
            self.report.write()
        self.report.log(f"gpu_check: phase {name}: {status}{' (' + note + ')' if note else ''}")

    def cap_for(self, cap):
        """(the phase's cap within the budget, or None when too little is left: not started)."""
        if self.stopped():
            return None
        left = self.left()
        return None if left < MIN_PHASE else min(cap, left)

    def not_run(self, phase, planned, reason, status="not run"):
        """A row for each planned row that has none yet."""
        have = self.report.keys()
        for section, case, impl in planned:
            if (section, case, impl) not in have:
                self.report.add_row(phase, dict(section=section, case=case, impl=impl,
                                                status=status, note=reason))

    def on_msg(self, phase):
        rep = self.report

        def handle(m):
            kind = m.get("t")
            if kind == "row":
                rep.add_row(phase, m)
            elif kind == "meta":
                with rep.lock:
                    if "peer" in m:
                        rep.peers[m["peer"]] = m["version"]
                    for k in ("device", "torch", "triton", "jax", "jax_device"):
                        if k in m and k not in rep.meta:
                            rep.meta[k] = m[k]
                    rep.write()
            elif kind == "copy":
                with rep.lock:
                    if rep.copy_gbs is None:
                        rep.copy_gbs = m["gbs"]
                        rep.notes.append(m["note"])
                    rep.write()
            elif kind == "note":
                rep.note(m["text"])
            elif kind == "autotune":
                with rep.lock:
                    rep.autotune.append(f"{m['impl']}: {m['kernel']}: {m['before']} -> "
                                        f"{len(m['kept'])} configs ({'; '.join(m['kept'])})")
                    rep.write()
            elif kind == "lost":
                rep.note(f"{phase}: device state lost ({m['reason']}); the phase ended there")
            elif kind == "nodevice":
                self.nodevice = m["reason"]
            elif kind in ("ready", "check", "incomplete") and phase == "correctness":
                with rep.lock:
                    c = rep.correctness
                    if kind == "ready":
                        c.update(cases=m["cases"], reason="running")
                    elif kind == "check":
                        c["passed"] += m["passed"]
                        c["failures"] += m["failures"]
                        c["run"] = m["run"]
                    else:
                        c["reason"] = m["reason"]
                    rep.write()
        return handle

    # ---- phases

    def correctness(self):
        rep = self.report
        cap = self.cap_for(self.args.correctness_cap)
        if cap is None:
            rep.correctness["reason"] = "not started: the budget ran out"
            return self.phase("correctness", "not run", note="the budget ran out")
        with rep.lock:
            rep.current, rep.correctness["reason"] = "correctness", "starting"
        t0 = time.monotonic()
        end = self.run_child("correctness", self.child_cmd("correctness", cap), cap, self.env(),
                             self.on_msg("correctness"))
        with rep.lock:
            c = rep.correctness
            c["complete"] = end["done"]
            if end["done"]:
                c["reason"] = None
            elif c["reason"] in ("running", "starting"):
                c["reason"] = self.why_ended(end, cap)
        self.phase("correctness", "ok" if end["done"] else "incomplete", t0,
                   "" if end["done"] else rep.correctness["reason"])

    def timing(self, name, kind, planned, cap, impl=None):
        """One timing child (ours, or one peer): rows as they come; a child that ends early
        leaves its running row "killed"/"failed" and the rest "not run", with the reason."""
        rep = self.report
        cap = self.cap_for(cap)
        if cap is None:
            self.not_run(name, planned, "not started: the run's budget ran out")
            return self.phase(name, "not run", note="the budget ran out")
        with rep.lock:
            rep.current = name
        t0 = time.monotonic()
        end = self.run_child(name, self.child_cmd(kind, cap, impl), cap, self.env(), self.on_msg(name))
        if end["done"]:
            return self.phase(name, "ok", t0)
        why = self.why_ended(end, cap)
        if end["last_start"] is not None:
            section, case, impl_ = end["last_start"]
            rep.add_row(name, dict(section=section, case=case, impl=impl_,
                                   status="killed" if end["killed"] else "failed",
                                   note=f"{why} (while this row was measured)"))
        self.not_run(name, planned, f"not reached: {why}")
        self.phase(name, "killed" if end["killed"] else "failed", t0, why)

    def peer(self, ad):
        planned = plan(self.args.quick, self.peers, ad)
        if ad.module is not None:
            top = ad.module.split(".")[0]
            try:
                found = importlib.util.find_spec(top) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                why = f"not importable: no module named {top!r}"
                with self.report.lock:
                    self.report.peers[ad.name] = why
                self.not_run(ad.name, planned, why, status="skipped")
                return self.phase(ad.name, "skipped", note=why)
        self.timing(ad.name, "peer", planned, self.args.peer_cap, impl=ad.name)

    def smoke(self):
        rep = self.report
        cap = self.cap_for(self.args.smoke_cap)
        if cap is None:
            return self.phase("distributed smoke", "not run", note="the budget ran out")
        with rep.lock:
            rep.current = "distributed smoke"
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "experiments.distributed_smoke", "--device", self.args.device]
        end = self.run_child("distributed smoke", cmd, cap, self.env())
        if end["killed"]:
            verdict = "FAIL"
            note = (f"timed out after {cap:.0f} s" if end["killed"] == "cap"
                    else self.why_ended(end, cap))
        else:
            verdict = {0: "PASS", 2: "SKIPPED"}.get(end["rc"], "FAIL")
            fails = [ln for ln in end["flagged"] if "FAIL" in ln] or end["flagged"] or end["tail"][-1:]
            note = "" if verdict == "PASS" else " | ".join(ln[:150] for ln in fails[:3])
        with rep.lock:
            rep.distributed = verdict
            rep.notes.append(f"distributed smoke (torch.distributed world of 1, "
                             f"{'NCCL' if self.args.device == 'cuda' else 'gloo'}): {verdict}"
                             + (f" ({note})" if note else ""))
        self.phase("distributed smoke", verdict, t0, note)

    def jax(self):
        planned = jax_plan(self.args.quick)
        rep = self.report
        cap = self.cap_for(self.args.jax_cap)
        if cap is None:
            self.not_run("jax", planned, "not started: the run's budget ran out")
            return self.phase("jax", "not run", note="the budget ran out")
        with rep.lock:
            rep.current = "jax"
        t0 = time.monotonic()
        cmd = self.child_cmd("jax", cap, python=self.args.jax_python)
        end = self.run_child("jax", cmd, cap, self.env(jax=True), self.on_msg("jax"))
        if end["done"]:
            return self.phase("jax", "ok", t0)
        why = self.why_ended(end, cap)
        absent = any("No module named 'jax'" in ln for ln in end["tail"])
        if end["last_start"] is not None:
            section, case, impl = end["last_start"]
            rep.add_row("jax", dict(section=section, case=case, impl=impl,
                                    status="killed" if end["killed"] else "failed", note=why))
        if absent:
            self.not_run("jax", planned, "jax is not importable", status="skipped")
        else:
            self.not_run("jax", planned, f"not reached: {why}")
        self.phase("jax", "skipped" if absent else ("killed" if end["killed"] else "failed"), t0,
                   "jax is not importable" if absent else why)

    def main(self):
        a = self.args
        self.watchdog.start()
        prev = signal.signal(signal.SIGTERM, lambda s, f: self.watchdog.fire("terminated (SIGTERM)"))
        if a.skip_correctness:
            self.report.correctness.update(skipped=True, reason="skipped")
        self.report.write()
        try:
            if not a.skip_correctness:
                self.correctness()
                if self.nodevice:
                    return self.no_device()
            if not a.skip_timing and not a.skip_ours:
                self.timing("ours", "ours", plan(a.quick), a.ours_cap)
                if self.nodevice:
                    return self.no_device()
            if not a.skip_distributed:
                self.smoke()
            if not a.skip_timing:
                if not a.skip_peers:
                    for ad in self.adapters:
                        self.peer(ad)
                if not a.skip_jax:
                    self.jax()
        finally:
            self.watchdog.stop()
            signal.signal(signal.SIGTERM, prev)
        c = self.report.correctness
        self.report.note(f"total {time.monotonic() - self.t0:.1f} s of the {a.budget:.0f} s budget")
        self.report.log(self.report.render())
        if c["failures"] or self.report.distributed == "FAIL":
            return 1
        if self.report.partial or not (c["complete"] or a.skip_correctness):
            return 3
        return 0

    def no_device(self):
        self.report.partial = f"no usable device: {self.nodevice}"
        self.report.write()
        self.report.log(f"gpu_check: {self.nodevice}")
        return 2


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    sys.path.insert(0, str(ROOT / "bench"))
    import peers
    peers.add_peer_site()
    run = Run(args, peers, [] if args.skip_peers else load_adapters(args, peers))
    return run.main()


if __name__ == "__main__":
    sys.exit(main())
