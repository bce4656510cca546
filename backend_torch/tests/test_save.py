"""The `save` option of the ops and routers (what the kernels' backward keeps): every save mode
gives bitwise the same values and gradients on every kernel path ("cpu_c", "chunked" here;
"triton" under TRITON_INTERPRET=1, run by `test_triton_paths_in_interpreter_subprocess` in a
fresh interpreter), the stats mode agrees with the float64 reference, the Triton fp32 backward
reruns its forward only under "stats", `SavedBytes` sees `out` dropped exactly where nothing else
holds it, and torch.compile traces the option with no graph break."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import attnres_torch as at
import pytest
import torch
import torch.nn.functional as F
from _helpers import assert_close, compute_dtype, f64, rand
from attnres_numpy import ops as ref_ops
from attnres_torch import dispatch
from attnres_torch.memory import SavedBytes

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
#: Kernel paths of this process: Triton runs on CPU tensors only under TRITON_INTERPRET=1.
IMPLS = ["cpu_c", "chunked"] + (["triton"] if INTERPRET and HAS_TRITON else [])
EPS, SCALE = 1e-6, 0.7
SHAPE = (4, 16)  # small: the interpreted Triton tests stay fast
#: (op, per-token query, gain): the plain op, its weights form, phase 1, the fused output norm.
CASES = [("depth_attention", False, True), ("depth_attention", True, False),
         ("weights", False, True), ("multi", False, True), ("out_norm", True, True),
         ("lse_only", False, True)]


def _inputs(op, per_token, gain, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [rand(gen, SHAPE, dtype) for _ in range(3)]
    if op == "multi":
        q = rand(gen, (2, SHAPE[-1]), torch.float32)
        g = rand(gen, (2, SHAPE[-1]), torch.float32) + 1.0 if gain else None
    else:
        q = rand(gen, SHAPE if per_token else SHAPE[-1:], torch.float32)
        g = rand(gen, SHAPE[-1:], torch.float32) + 1.0 if gain else None
    w = rand(gen, SHAPE[-1:], torch.float32) + 1.0 if op == "out_norm" else None
    lead = (2,) if op == "multi" else ()
    cot = [rand(gen, lead + SHAPE, dtype), rand(gen, lead + SHAPE[:-1], torch.float32),
           rand(gen, SHAPE, dtype)]
    return xs, q, g, w, cot


def _run(impl, save, op, xs, q, g, w, cot):
    """Forward + backward with random cotangents: (outputs, gradients), as plain tensors."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in xs + [q, g, w]]
    sxs, sq, sg, sw = leaves[:3], leaves[3], leaves[4], leaves[5]
    with at.use_impl(impl):
        if op == "multi":
            outs = at.depth_attention_multi(sxs, sq, sg, eps=EPS, scale=SCALE, save=save)
        elif op == "weights":
            outs = at.depth_attention(sxs, sq, sg, eps=EPS, scale=SCALE, return_lse=True,
                                      return_weights=True, save=save)
        elif op == "out_norm":
            out, normed, lse = at.depth_attention(sxs, sq, sg, eps=EPS, scale=SCALE,
                                                  return_lse=True, out_norm_weight=sw, save=save)
            outs = (out, lse, normed)
        else:
            outs = at.depth_attention(sxs, sq, sg, eps=EPS, scale=SCALE, return_lse=True,
                                      save=save)
        assert at.last_impl() == impl
    if op == "lse_only":  # out unused: its cotangent is materialized in the backward
        loss = (outs[1] * cot[1]).sum()
    else:
        loss = sum((o * c).sum() for o, c in zip(outs[:2], cot[:2]))
        if op == "out_norm":
            loss = loss + (outs[2] * cot[2]).sum()
    params = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, params)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl,op,per_token,gain", [
    (impl, *case) for impl in IMPLS for case in CASES
    if not (impl == "chunked" and case[0] == "out_norm")])  # chunked: no fused norm kernel
def test_save_modes_bitwise_equal(impl, dtype, op, per_token, gain):
    inputs = _inputs(op, per_token, gain, dtype)
    before = [t.clone() for t in inputs[0]]
    base_outs, base_grads = _run(impl, "out", op, *inputs)
    for save in ("auto", "stats"):
        outs, grads = _run(impl, save, op, *inputs)
        for i, (a, b) in enumerate(zip(outs + grads, base_outs + base_grads)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{save}: result {i} differs from 'out'"
    assert all(torch.equal(a, b) for a, b in zip(inputs[0], before)), "an input was modified"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stats_mode_matches_reference(impl, dtype):
    """save="stats" (on Triton fp32: the forward rerun in the backward) against the float64
    reference with random cotangents, d_lse included."""
    xs, q, g, _, cot = _inputs("depth_attention", False, True, dtype, seed=1)
    (out, lse), grads = _run(impl, "stats", "depth_attention", xs, q, g, None, cot)
    name = str(dtype).replace("torch.", "")
    ref_out, ref_lse = ref_ops.depth_attention(f64(xs), f64(q), f64(g), eps=EPS, scale=SCALE,
                                               return_lse=True)
    ref = ref_ops.depth_attention_vjp(f64(xs), f64(q), f64(g), f64(cot[0]), f64(cot[1]), eps=EPS,
                                      scale=SCALE)
    assert_close(out, ref_out, name, "out", grad=False)
    assert_close(lse, ref_lse, compute_dtype(name), "lse", grad=False)
    assert_close(grads[:3], ref["sources"], name, "d_sources", grad=True)
    assert_close(grads[3], ref["query"], "float32", "d_query", grad=True)
    assert_close(grads[4], ref["norm_weight"], "float32", "d_norm_weight", grad=True)


@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="Triton kernels on the CPU need "
                    "TRITON_INTERPRET=1 (test_triton_paths_in_interpreter_subprocess runs this)")
@pytest.mark.parametrize("dtype,save,forwards", [
    (torch.float32, "auto", 1), (torch.float32, "out", 1), (torch.float32, "stats", 2),
    (torch.bfloat16, "auto", 1), (torch.bfloat16, "stats", 1)])
def test_triton_recomputes_only_where_its_backward_reads_out(monkeypatch, dtype, save, forwards):
    """Only the fp32 Triton backward reads out: "stats" reruns the forward kernel there, and
    nowhere else; "auto" never recomputes."""
    from attnres_torch.kernels import triton_depth as td

    launches = []
    real = td._launch
    monkeypatch.setattr(td, "_launch", lambda k, grid, *a, **m: (launches.append(k.fn.__name__),
                                                                 real(k, grid, *a, **m)))
    _run("triton", save, "depth_attention", *_inputs("depth_attention", False, True, dtype))
    assert launches.count("_depth_fwd_kernel") == forwards
    assert launches.count("_depth_bwd_kernel") == 1


@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="Triton kernels on the CPU need "
                    "TRITON_INTERPRET=1 (test_triton_paths_in_interpreter_subprocess runs this)")
def test_triton_stats_rerun_compiles_fullgraph():
    """The fp32 Triton backward's forward rerun (a custom op called in the backward) traces
    with torch.compile: one graph, no break, bitwise the eager gradients."""
    dispatch.implementation("triton")  # imported before the trace: its first import takes a lock
    torch._dynamo.reset()
    xs, q, g, _, cot = _inputs("depth_attention", False, True, torch.float32, seed=2)
    xs = [x.requires_grad_() for x in xs]

    def f(xs):
        return (at.depth_attention(xs, q, g, eps=EPS, scale=SCALE, save="stats") * cot[0]).sum()

    with at.use_impl("triton"):  # forcing is read as a constant by the trace
        assert torch._dynamo.explain(f)(xs).graph_break_count == 0
        torch._dynamo.reset()
        got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(xs), xs)
        want = torch.autograd.grad(f(xs), xs)
        assert at.last_impl() == "triton"
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _saved_bytes(save, then_norm, impl="cpu_c", dtype=torch.float32):
    xs = [torch.randn(8, 32, dtype=dtype, requires_grad=True) for _ in range(3)]
    q = torch.randn(32, requires_grad=True)
    with SavedBytes() as acct, at.use_impl(impl):
        out = at.depth_attention(xs, q, save=save)
        # the next sublayer's pre-norm saves its input: the same storage as out
        y = F.rms_norm(out, (32,), eps=1e-6) if then_norm else out
        y.sum().backward()
    return acct.bytes, out.untyped_storage().nbytes()


@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
def test_saved_bytes_stats_drops_out_only_where_nothing_else_holds_it(impl):
    keep, out_bytes = _saved_bytes("out", False, impl)
    stats, _ = _saved_bytes("stats", False, impl)
    auto, _ = _saved_bytes("auto", False, impl)
    assert keep - stats == out_bytes > 0  # out alone (sources and query are leaves: not counted)
    assert auto == stats  # no CPU kernel's backward reads out
    # behind a norm that saves its input, out is held anyway: no mode saves a byte
    assert _saved_bytes("out", True, impl)[0] == _saved_bytes("stats", True, impl)[0]


def test_saved_bytes_router_fused_norm_and_prenorm():
    """A router whose sublayers start with their own RMSNorm, then a final norm: those norms
    hold every depth attention's out, so "stats" saves nothing; with the fused output norm (M15) out feeds no
    norm, and "stats" drops one `[B, T, D]` per sublayer and for the output."""
    def measure(config, save, prenorm):
        torch.manual_seed(0)
        L, dim = 4, 16
        router = at.DepthRouter(config, L, dim, save=save)
        lins = [torch.nn.Linear(dim, dim) for _ in range(L)]
        subs = [(lambda h, f=f: f(F.rms_norm(h, (dim,), eps=1e-6))) if prenorm else
                (lambda h, f=f: f(h)) for f in lins]
        x = torch.randn(2, 5, dim)
        with SavedBytes() as acct:
            h = router(x, subs)
            (F.rms_norm(h, (dim,), eps=1e-6) if prenorm else h).sum().backward()  # final norm
        return acct.bytes

    full = at.ResidualConfig.variant("full")
    assert measure(full, "stats", True) == measure(full, "out", True)
    fused = at.ResidualConfig.variant("fused_out_norm")
    one = 2 * 5 * 16 * 4  # one [B, T, D] fp32 out
    assert measure(fused, "out", False) - measure(fused, "stats", False) == 5 * one  # L + 1 calls


def test_router_and_module_pass_save():
    x = [torch.randn(3, 8) for _ in range(2)]
    layer = at.DepthAttention(8, save="stats")
    assert "save='stats'" in repr(layer)
    layer(x)
    router = at.DepthRouter(at.ResidualConfig.variant("full"), 2, 8, save="stats")
    assert router.stream(x[0]).ops.save == "stats"


@pytest.mark.parametrize("make", [
    lambda: at.depth_attention([torch.randn(2, 4)], torch.zeros(4), save="all"),
    lambda: at.depth_attention_multi([torch.randn(2, 4)], torch.zeros(1, 4), save=None),
    lambda: at.DepthAttention(4, save="stat"),
    lambda: at.DepthRouter(at.ResidualConfig.variant("full"), 2, 4, save="checkpoint")])
def test_bad_save_raises_value_error_naming_it(make):
    with pytest.raises(ValueError, match=r"save: expected one of \('auto', 'out', 'stats'\)"):
        make()


@pytest.mark.parametrize("save", dispatch.SAVE_MODES)
def test_compile_fullgraph_no_graph_break(save):
    torch._dynamo.reset()
    xs = [torch.randn(4, 16, requires_grad=True) for _ in range(3)]
    q = torch.randn(16, requires_grad=True)

    def f(xs, q):
        out, lse = at.depth_attention(xs, q, return_lse=True, save=save)
        mid = at.depth_attention_multi(xs, torch.stack([q, -q]), save=save)[0]
        return (out * out).sum() + lse.sum() + mid.sum()

    explain = torch._dynamo.explain(f)(xs, q)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(xs, q), xs + [q])
    want = torch.autograd.grad(f(xs, q), xs + [q])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1 already: the triton cases run here")
def test_triton_paths_in_interpreter_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1")
    module = Path(__file__)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(module), "-q", "-p",
                           "no:cacheprovider", "-k", "triton and not subprocess"],
                          cwd=module.parents[1], env=env, capture_output=True, text=True,
                          timeout=600)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert proc.returncode == 0 and summary, f"interpreted Triton save tests failed:\n{tail}"
    assert not re.search(r"\d+ (failed|skipped|error)", proc.stdout), tail
    print(summary.group(0), "in the TRITON_INTERPRET=1 subprocess")
