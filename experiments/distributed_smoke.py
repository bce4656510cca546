"""Smoke test of every distributed path on one device, and the device-mixing detector.

    python -m experiments.distributed_smoke [--device cuda] [--backend nccl]

On a machine with one GPU this runs a `torch.distributed` world of size 1 on NCCL (the collectives
and the pipeline's one-stage hand-off really run on the GPU; a size-1 world cannot exercise
point-to-point send/recv, which torch refuses to self) and checks, on the device:

- `depth_attention_tp` (all-reduce), two heads, with lse: out, lse and every gradient against
  the float64 NumPy reference (`attnres_numpy.ops`);
- `sequence_sharded_prefill` (all-gather + reduce-scatter): out and every gradient (embedding,
  sublayer weights, queries, gains) against the reference probe network
  (`attnres_numpy.model.probe_forward` / `probe_vjp`);
- `run_pipeline` with schedules "gpipe", "1f1b" and "interleaved_1f1b" on one stage (chunks
  handed over in process): losses and every gradient against the same reference;
- a declared dtype that differs from the stack's raises TypeError;
- under `DeviceMixingDetector(device)`: no op mixes devices and no tensor leaves the device.

Exit status: 0 every check passed, 1 a check failed, 2 skipped (the reason is printed: no
CUDA, no NCCL, no torch.distributed).  `bench/gpu_check.py` runs this as its distributed section;
the CPU tests run `run_smoke(device="cpu")` on gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Ops whose job is to move a tensor between devices (`x.to(device)`, `dst.copy_(src)`).
_MOVES = {"aten._to_copy.default", "aten.copy_.default", "aten._copy_from.default",
          "aten._copy_from_and_resize.default", "aten.lift_fresh.default"}


class DeviceMixingDetector(TorchDispatchMode):
    """Records every op (aten, c10d, custom) that mixes devices, while active.

    An op is flagged when its tensor operands sit on more than one device, or, with `device`
    set, when any tensor it reads or returns is elsewhere than `device` (a buffer created on the
    default device and then sent is caught there).  0-dim CPU tensors are exempt, as CUDA ops
    accept them; device moves (`.to(device)`, `copy_`) are exempt from the mixing rule only.
    Autograd's backward ops run under the mode too.  `violations`: one line per flagged op.
    """

    def __init__(self, device=None):
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.violations: List[str] = []
        self.ops = 0

    @staticmethod
    def _devices(tree) -> List[torch.device]:
        return [t.device for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
                and not (t.device.type == "cpu" and t.dim() == 0)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = str(func)
        operands = self._devices((args, kwargs))
        if len(set(operands)) > 1 and name not in _MOVES:  # recorded before the op can raise
            self.violations.append(f"{name}: operands on {sorted({str(d) for d in operands})}")
        self._stray(name, operands)
        out = func(*args, **kwargs)
        self._stray(name, self._devices(out))
        return out

    def _stray(self, name, devices) -> None:
        if self.device is None:
            return
        stray = {str(d) for d in devices if not self._same(d)}
        if stray:
            self.violations.append(f"{name}: tensors on {sorted(stray)}, expected {self.device}")

    def _same(self, d: torch.device) -> bool:
        want = self.device
        return d.type == want.type and (want.index is None or d.index == want.index)


def unavailable_reason(device: str = "cuda", backend: str = "nccl") -> Optional[str]:
    """Why the smoke test cannot run here, or None."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if backend == "nccl" and not dist.is_nccl_available():
        return "NCCL is not available in this torch build"
    if backend == "gloo" and not dist.is_gloo_available():
        return "gloo is not available in this torch build"
    return None


class _Report:
    def __init__(self, log):
        self.passed, self.failures, self.log = 0, [], log

    def close(self, what, got, want, tol):
        """max |got - want| <= tol * (1 + max |want|) (want: float64 NumPy)."""
        got = [got] if isinstance(got, torch.Tensor) else list(got)
        want = [want] if isinstance(want, np.ndarray) else list(want)
        for i, (g, w) in enumerate(zip(got, want)):
            g = g.detach().to("cpu", torch.float64).numpy()
            w = np.asarray(w, dtype=np.float64)
            err = float(np.max(np.abs(g - w))) if g.shape == w.shape else float("inf")
            bound = tol * (1 + float(np.max(np.abs(w))))
            if not err <= bound:
                self.failures.append(f"{what}[{i}]: max error {err:.3g} > {bound:.3g} "
                                     f"(shapes {g.shape} vs {w.shape})")
                return
        self.passed += 1

    def check(self, what, ok, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failures.append(f"{what}: {detail}")


def _f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def _probe(w, eps):
    """The spec's probe sublayers f_l(h) = tanh(rmsnorm(h) @ W_l), `[..., D] -> [..., D]`."""
    def layer(i):
        return lambda h: torch.tanh(h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) @ w[i])
    return [layer(i) for i in range(w.shape[0])]


def _check_tp(rep, dev, gen):
    from attnres_numpy import ops as ref
    from attnres_torch.distributed.tensor_parallel import HiddenShard, depth_attention_tp
    n, tok, dim, heads = 3, (2, 3), 8, 2
    xs = [torch.randn(tok + (dim,), generator=gen, dtype=torch.float64) for _ in range(n)]
    q, g = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.5, torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5
    d_out, d_lse = torch.randn(tok + (dim,), generator=gen, dtype=torch.float64), torch.randn(tok + (heads,), generator=gen, dtype=torch.float64)
    shard = HiddenShard.even(dim)
    lx = [shard.local(x).to(dev, torch.float32).requires_grad_() for x in xs]
    lq, lg = (shard.local(t).to(dev, torch.float32).requires_grad_() for t in (q, g))
    cot, cot_lse = shard.local(d_out).to(dev, torch.float32), d_lse.to(dev, torch.float32)
    with DeviceMixingDetector(dev) as det:  # everything the distributed code does, on `dev`
        out, lse = depth_attention_tp(lx, lq, lg, shard=shard, num_heads=heads, return_lse=True)
        torch.autograd.backward([out, lse], [cot, cot_lse])
    x32 = [_f64(x.float()) for x in xs]  # the float32 inputs, exactly
    q32, g32, do32, dl32 = (_f64(t.float()) for t in (q, g, d_out, d_lse))
    want_out, want_lse = ref.depth_attention(x32, q32, g32, num_heads=heads, return_lse=True)
    vjp = ref.depth_attention_vjp(x32, q32, g32, do32, dl32, num_heads=heads)
    rep.close("tp out", out, want_out, 1e-4)
    rep.close("tp lse", lse, want_lse, 1e-4)
    rep.close("tp d_sources", [x.grad for x in lx], vjp["sources"], 1e-4)
    rep.close("tp d_query", lq.grad, vjp["query"], 1e-4)
    rep.close("tp d_norm_weight", lg.grad, vjp["norm_weight"], 1e-4)
    return det


def _network(gen, num_layers, tok, dim):
    emb = torch.randn(tok + (dim,), generator=gen, dtype=torch.float64)
    w = torch.randn(num_layers, dim, dim, generator=gen, dtype=torch.float64) * dim ** -0.5
    queries = torch.randn(num_layers + 1, dim, generator=gen, dtype=torch.float64) * 0.5
    gains = torch.rand(num_layers + 1, dim, generator=gen, dtype=torch.float64) + 0.5
    cot = torch.randn(tok + (dim,), generator=gen, dtype=torch.float64)
    return [t.float() for t in (emb, w, queries, gains, cot)]  # float32, exact in float64 below


def _reference(block_size, num_layers, emb, w, queries, gains, cot):
    from attnres_core.config import ResidualConfig
    from attnres_numpy import model as ref
    config = ResidualConfig(kind="block", block_size=block_size)
    params = {"queries": _f64(queries), "norm_weights": _f64(gains)}
    out = ref.probe_forward(config, params, _f64(emb), _f64(w))
    return out, ref.probe_vjp(config, params, _f64(emb), _f64(w), _f64(cot))


def _check_seq(rep, dev, gen):
    from attnres_torch.distributed.sequence_parallel import (
        all_reduce_grads,
        sequence_sharded_prefill,
        shard_sequence,
    )
    L, S, tok, dim = 5, 2, (2, 4), 8
    emb, w, queries, gains, cot = _network(gen, L, tok, dim)
    demb, dcot = emb.to(dev), cot.to(dev)
    lw, lq, lg = (t.to(dev).requires_grad_() for t in (w, queries, gains))
    with DeviceMixingDetector(dev) as det:
        le = shard_sequence(demb, seq_dim=1).requires_grad_()
        out, blocks = sequence_sharded_prefill(le, _probe(lw, 1e-6), lq, lg, block_size=S, seq_dim=1)
        (out * shard_sequence(dcot, seq_dim=1)).sum().backward()
        all_reduce_grads([lw, lq, lg])
    want, vjp = _reference(S, L, emb, w, queries, gains, cot)
    rep.close("seq out", out, want, 1e-4)
    for got, key in ((le, "embedding"), (lw, "sublayer_weights"), (lq, "queries"), (lg, "norm_weights")):
        rep.close(f"seq d_{key}", got.grad, vjp[key], 1e-4)
    return det


def _check_pipeline(rep, dev, gen, schedule, chunk_sizes):
    from attnres_torch.distributed.pipeline import run_pipeline
    from attnres_torch.distributed.pipeline_plan import PipelinePlan
    plan = PipelinePlan(chunk_sizes, 2, 1)
    M, tok, dim = 2, (3,), 8
    nets = [_network(gen, plan.num_layers, tok, dim) for _ in range(M)]
    _, w, queries, gains, _ = nets[0]
    embs, cots = [n[0] for n in nets], [n[4] for n in nets]
    lw, lq, lg = (t.to(dev).requires_grad_() for t in (w, queries, gains))
    dembs, dcots = [e.to(dev) for e in embs], [c.to(dev) for c in cots]
    with DeviceMixingDetector(dev) as det:
        res = run_pipeline(plan, dembs, _probe(lw, 1e-6), lq, lg,
                           lambda out, m: (out * dcots[m]).sum(), microbatch_shape=tok + (dim,),
                           dtype=torch.float32, schedule=schedule)
    tag = f"pipeline {schedule} chunks {chunk_sizes}"
    refs = [_reference(2, plan.num_layers, embs[m], w, queries, gains, cots[m]) for m in range(M)]
    rep.close(f"{tag} losses", torch.stack(res["losses"]),
              np.array([float(np.sum(o * _f64(c))) for (o, _), c in zip(refs, cots)]), 1e-4)
    rep.close(f"{tag} d_embedding", res["embedding_grads"], [v["embedding"] for _, v in refs], 1e-4)
    for got, key in ((lw, "sublayer_weights"), (lq, "queries"), (lg, "norm_weights")):
        rep.close(f"{tag} d_{key}", got.grad, sum(v[key] for _, v in refs), 1e-4)
    return det


def _check_dtype_error(rep, dev):
    from attnres_torch.distributed.pipeline import run_pipeline
    from attnres_torch.distributed.pipeline_plan import PipelinePlan
    plan = PipelinePlan((1, 2), 2, 1)
    w = torch.zeros(3, 4, 4, device=dev)
    try:
        run_pipeline(plan, [torch.zeros(2, 4, device=dev)], _probe(w, 1e-6),
                     torch.zeros(4, 4, device=dev), None, lambda out, m: out.sum(),
                     microbatch_shape=(2, 4), dtype=torch.bfloat16)
    except TypeError as e:
        rep.check("declared bfloat16 for a float32 stack", "bfloat16" in str(e) and "float32" in str(e),
                  f"the TypeError does not name both dtypes: {e}")
    else:
        rep.check("declared bfloat16 for a float32 stack", False, "no TypeError")


def run_smoke(device: str = "cuda", backend: Optional[str] = None, *, log=print) -> dict:
    """Run every check on `device` in a world of size 1 (the current process group if one is
    initialized, else a fresh one on `backend`, default "nccl" for CUDA and "gloo" otherwise,
    destroyed at the end).  Returns {"skipped": reason or None, "passed": int,
    "failures": [str], "ops_checked": int}."""
    backend = backend or ("nccl" if torch.device(device).type == "cuda" else "gloo")
    reason = unavailable_reason(device, backend)
    if reason is not None:
        log(f"distributed smoke: SKIPPED ({reason})")
        return {"skipped": reason, "passed": 0, "failures": [], "ops_checked": 0}
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    own = not dist.is_initialized()
    tmp = None
    if own:
        tmp = tempfile.mkdtemp()
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
                                rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"run_smoke: needs a world of size 1, the current one has {dist.get_world_size()}")
    rep = _Report(log)
    ops = 0
    try:
        gen = torch.Generator().manual_seed(20)
        steps = [("tensor parallel", lambda: _check_tp(rep, dev, gen)),
                 ("sequence-sharded prefill", lambda: _check_seq(rep, dev, gen))]
        for schedule, sizes in (("gpipe", (3, 2)), ("1f1b", (5,)), ("interleaved_1f1b", (1, 2, 2))):
            steps.append((f"pipeline {schedule}",
                          lambda s=schedule, c=sizes: _check_pipeline(rep, dev, gen, s, c)))
        for name, step in steps:
            before = len(rep.failures)
            try:
                det = step()
            except Exception as e:  # noqa: BLE001 - a failing path is reported, the rest still run
                rep.failures.append(f"{name}: {type(e).__name__}: {e}")
                continue
            ops += det.ops
            rep.check(f"{name}: device mixing ({det.ops} ops checked)", not det.violations,
                      "; ".join(det.violations[:5]))
            log(f"distributed smoke: {name}: {'ok' if len(rep.failures) == before else 'FAILED'}")
        _check_dtype_error(rep, dev)
    finally:
        if own:
            dist.destroy_process_group()
    verdict = "PASS" if not rep.failures else "FAIL"
    log(f"distributed smoke ({backend}, {dev}): {verdict}: {rep.passed} checks passed, "
        f"{len(rep.failures)} failed, {ops} ops checked for device mixing")
    for f in rep.failures:
        log(f"  FAIL {f}")
    return {"skipped": None, "passed": rep.passed, "failures": rep.failures, "ops_checked": ops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default=None, help="nccl (CUDA default) or gloo")
    args = p.parse_args(argv)
    res = run_smoke(args.device, args.backend)
    if res["skipped"]:
        return 2
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
