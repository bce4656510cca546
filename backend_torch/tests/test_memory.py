"""Memory modes (`attnres_torch.memory`): Recompute and Offload give the plain path's outputs and
every gradient (bitwise on the CPU: the same kernels run on the same inputs; under torch.compile
within 1e-5 relative), and save what their docstrings say."""

from __future__ import annotations

import pytest
import torch
from attnres_core.config import ResidualConfig
from attnres_torch.memory import Offload, Recompute, SavedBytes, checkpointed, memory_mode
from attnres_torch.modules import AttnResTransformer

B, T, D, BLOCKS, VOCAB = 2, 8, 16, 3, 64
L = 2 * BLOCKS


def _model(kind, seed=0):
    torch.manual_seed(seed)
    cfg = ResidualConfig.variant(kind, **({"block_size": 2} if kind == "block" else {}))
    model = AttnResTransformer(VOCAB, D, BLOCKS, 2, cfg)
    with torch.no_grad():  # nonzero queries: non-uniform depth weights, so every path matters
        for p in model.router.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g), torch.randn(B, T, VOCAB, generator=g)


def _step(model, tokens, cot, ctx=None, **kw):
    """(logits, {name: grad}) of <logits, cot> (a random cotangent)."""
    model.zero_grad(set_to_none=True)
    if ctx is None:
        out = model(tokens, **kw)
    else:
        with ctx:
            out = model(tokens, **kw)
    (out * cot).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return out.detach(), grads


def _taken(out, model):
    """(logits, {name: grad}) of a step run by hand, in `_step`'s form."""
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same(a, b, exact=True, rtol=1e-5):
    (out_a, g_a), (out_b, g_b) = a, b
    check = torch.equal if exact else (lambda x, y: torch.allclose(x, y, rtol=rtol, atol=rtol * float(y.abs().max())))
    assert check(out_a, out_b), float((out_a - out_b).abs().max())
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        assert check(g_a[n], g_b[n]), (n, float((g_a[n] - g_b[n]).abs().max()))


@pytest.mark.parametrize("kind", ["standard", "full", "block"])
@pytest.mark.parametrize("mode", ["recompute", "offload", "recompute+offload"])
def test_mode_gives_plain_outputs_and_every_gradient(kind, mode):
    model = _model(kind)
    tokens, cot = _inputs()
    plain = _step(model, tokens, cot)
    _assert_same(_step(model, tokens, cot, memory_mode(mode, model, window=1)), plain)


@pytest.mark.parametrize("kind", ["full", "block"])
def test_recompute_with_mix_and_scale(kind):
    model = _model(kind)
    tokens, cot = _inputs(2)
    plain = _step(model, tokens, cot, mix=0.3, scale=0.5)
    _assert_same(_step(model, tokens, cot, Recompute(model), mix=0.3, scale=0.5), plain)
    with Offload(model, window=0) as off:
        got = model(tokens, mix=0.3, scale=0.5)
    model.zero_grad(set_to_none=True)
    (got * cot).sum().backward()  # the backward after the block: brought back from the host
    assert off.offloaded_bytes > 0
    _assert_same(_taken(got, model), plain)


def test_checkpointed_stream_loop():
    model = _model("full")
    tokens, cot = _inputs(3)
    plain = _step(model, tokens, cot)
    model.zero_grad(set_to_none=True)
    stream = model.router.stream(model.embed(tokens))
    for f in model.sublayers:
        stream.push(checkpointed(f)(stream.input()))
    out = model.head(model.norm(stream.output()))
    (out * cot).sum().backward()
    _assert_same(_taken(out, model), plain)


def test_recompute_under_torch_compile():
    model = _model("block")
    tokens, cot = _inputs(4)
    plain = _step(model, tokens, cot)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    with Recompute(model):
        got = _step(compiled, tokens, cot)
    _assert_same(got, plain, exact=False, rtol=1e-5)
    assert "forward" not in model.sublayers[0].__dict__  # unpatched after the block


def test_recompute_saves_only_sources_outputs_and_inputs():
    """Full, L = 6, fp32 (the C kernel): under Recompute the distinct [B, T, D] storages saved are
    the sources v_0..v_6, the depth-attention outputs h_1..h_7 (h_l is also the checkpoint's
    input; h_7 also the final norm's) and the final norm's output (the head's input): 15."""
    model = _model("full")
    tokens, _ = _inputs()
    with SavedBytes() as plain:
        model(tokens)
    with SavedBytes() as rec, Recompute(model):
        model(tokens)
        big = [t for t in rec._seen.values() if t.shape == (B, T, D)]
        assert len(big) == 2 * (L + 1) + 1
    assert rec.bytes < plain.bytes / 3, (rec.bytes, plain.bytes)


def test_offload_window_and_counters():
    model = _model("block")
    tokens, cot = _inputs(5)
    plain = _step(model, tokens, cot)
    with Offload(model, window=L + 2) as keep_all:
        model(tokens)
    assert keep_all.offloaded_bytes == 0 and keep_all.kept_bytes == keep_all.saved_bytes > 0
    for window in (0, 2):
        with Offload(model, window=window) as off:
            got = _step(model, tokens, cot)
        _assert_same(got, plain)
        assert 0 < off.offloaded_bytes and off.kept_bytes < off.saved_bytes
        assert off.peak_device_bytes <= off.saved_bytes
    with SavedBytes() as acct:
        model(tokens)
    assert acct.bytes == keep_all.saved_bytes  # both count distinct storages


def test_bad_arguments():
    model = _model("full")
    with pytest.raises(ValueError, match="window: expected an int >= 0"):
        Offload(model, window=-1)
    with pytest.raises(ValueError, match="min_bytes"):
        Offload(model, min_bytes=1.5)
    with pytest.raises(ValueError, match="model: expected a model with .sublayers"):
        Recompute(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode: expected one of none, recompute"):
        with memory_mode("compressed", model):
            pass
    with Recompute(model):
        with pytest.raises(ValueError, match="already patched"):
            Recompute(model).__enter__()
