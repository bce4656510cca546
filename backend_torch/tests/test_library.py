"""The `torch.library` custom ops of each kernel implementation (`attnres::<impl>_<kind>`,
registered by `dispatch`): opcheck (schema, fake/meta, autograd registration), a
`torch.compile(fullgraph=True)` trace of a model using them."""

from __future__ import annotations

from types import SimpleNamespace

import attnres_torch as at
import pytest
import torch
from attnres_torch import dispatch
from attnres_torch.kernels import chunked, cpu_c

IMPLS = {"cpu_c": cpu_c, "chunked": chunked}


def _sources(n=3, shape=(4, 6), dtype=torch.float32, grad=True):
    return [torch.randn(shape, dtype=dtype, requires_grad=grad) for _ in range(n)]


@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("gain", [False, True])
@pytest.mark.parametrize("save", dispatch.SAVE_MODES)
def test_opcheck_depth_attention(impl, per_token, gain, save):
    xs = _sources()
    q = torch.randn((4, 6) if per_token else (6,), requires_grad=True)
    g = torch.rand(6, requires_grad=True) + 0.5 if gain else None
    torch.library.opcheck(dispatch.OPS[impl].depth_attention, (xs, q, g, 1e-6, 1.0, save))


@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
def test_opcheck_backward_and_multi(impl):
    xs = _sources(grad=False)
    q, g = torch.randn(6), torch.rand(6) + 0.5
    ops = dispatch.OPS[impl]
    out, lse = ops.depth_attention(xs, q, g, 1e-6, 1.0, "auto")
    for saved_out in (out, None):  # None: save="stats" (these kernels never read out)
        torch.library.opcheck(ops.depth_attention_backward,
                              (xs, q, g, saved_out, lse, torch.randn(4, 6), torch.randn(4), 1e-6,
                               1.0))
    qs = torch.randn(2, 6, requires_grad=True)
    gs = torch.rand(2, 6) + 0.5
    for save in dispatch.SAVE_MODES:
        torch.library.opcheck(ops.depth_attention_multi, (_sources(), qs, gs, 1e-6, 1.0, save))
        torch.library.opcheck(ops.depth_attention_weights, (_sources(), qs[0], gs[0], 1e-6, 1.0,
                                                            save))


def test_ops_are_named_per_implementation():
    """Each kernel implementation registers its own ops in the `attnres` namespace; the chunked
    kernel has no fused output norm op."""
    for name, module in IMPLS.items():
        for kind in dispatch.KINDS[:4]:
            assert getattr(dispatch.OPS[name], kind) is not None
            assert getattr(torch.ops.attnres, f"{name}_{kind}").default is not None
    assert hasattr(dispatch.OPS["cpu_c"], "depth_attention_out_norm")
    assert not hasattr(dispatch.OPS["chunked"], "depth_attention_out_norm")
    bogus = SimpleNamespace(NAME="bogus", depth_attention=chunked.depth_attention)
    with pytest.raises(ValueError, match="bogus: expected op bodies"):
        dispatch._define(bogus)


def test_compile_fullgraph_router_model():
    torch._dynamo.reset()
    router = at.DepthRouter(at.ResidualConfig.variant("block", block_size=2), 4, 16)
    with torch.no_grad():
        router.queries.normal_()
    lin = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def model(x):
        return router(x, [lambda h, f=f: torch.tanh(f(h)) for f in lin])

    x = torch.randn(2, 5, 16)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    before = at.impl_counts()
    y = compiled(x)
    assert at.impl_counts() == before  # traced, not run through Python dispatch
    torch.testing.assert_close(y, model(x), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert router.queries.grad is not None and torch.isfinite(router.queries.grad).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture():
    xs = [torch.randn(64, 128, device="cuda") for _ in range(4)]
    q, g = torch.randn(128, device="cuda"), torch.ones(128, device="cuda")
    at.depth_attention(xs, q, g)  # warm-up (compiles kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = at.depth_attention(xs, q, g)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, at.depth_attention(xs, q, g))
