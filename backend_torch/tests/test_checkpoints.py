"""Checkpoint converters, tested numerically against faithful re-implementations of each peer's
forward on random weights (written here from reading their code, never imported):

* flash-linear-attention: fla-org/flash-linear-attention `fla/models/gla/modeling_gla.py`
  (`GLABlock.forward`: prefix_sum / attnres_states, the boundaries `(2 * layer_idx) % block_size`
  and `(2 * layer_idx + 1) % block_size`, the first layer's plain `attn_norm`; `GLAModel.forward`:
  the output aggregation with the final norm folded in), `fla/ops/attnres/naive.py`
  (`naive_attnres`: rms_norm(v, rms_weight, eps) . query, softmax over sources, fp32) and
  `fla/ops/attnres/fused.py` (`output_rms_weight`: an RMSNorm of the mix with the same eps).
* Kimi K3: ml-explore/mlx-lm `mlx_lm/models/kimi_k3.py` (PR 1626: `_attn_res_combine` with
  `w_eff = norm.weight * proj.weight`, `KimiK3DecoderLayer.__call__` with `is_block_start =
  layer_idx % attn_res_block_size == 0`, `KimiK3TextModel.__call__`) and vllm-project/tpu-inference
  `tpu_inference/models/jax/kimi_k3.py` (`apply_attn_res`, `KimiDecoderLayer.__call__`, the
  `[D, 1]` projection kernel).

Our side is the user's blocks wrapped by `wrap_prenorm` (per-layer sites) or a `DepthRouter`,
loaded with the converted parameters; both directions and exact round trips are checked, in
float32 against the peer's float32 computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attnres_torch import DepthRouter
from attnres_torch.checkpoints import fla_config, from_fla, from_k3, k3_config, load_into, to_fla, to_k3
from attnres_torch.convert import wrap_prenorm
from torch import nn

D, T, B = 16, 6, 2


class CausalAttention(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False), heads

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))


class SwiGLU(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False),
                                         nn.Linear(2 * dim, dim, bias=False))

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """A PreNorm decoder layer under a peer's attribute names (norm1, fn1, norm2, fn2)."""

    def __init__(self, names, eps):
        super().__init__()
        self.names = names
        for i, name in enumerate(names):
            setattr(self, name, (nn.RMSNorm(D, eps=eps), CausalAttention(D), nn.RMSNorm(D, eps=eps), SwiGLU(D))[i])
        with torch.no_grad():
            for n in (names[0], names[2]):
                getattr(self, n).weight.add_(0.3 * torch.randn(D))


def _blocks(names, n, eps, seed):
    torch.manual_seed(seed)
    return nn.ModuleList(Block(names, eps) for _ in range(n)), 1 + 0.3 * torch.randn(D)


def _random_rows(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return {"queries": 0.7 * torch.randn(2 * n + 1, D, generator=gen),
            "norm_weights": 1 + 0.3 * torch.randn(2 * n + 1, D, generator=gen)}


# -- flash-linear-attention, re-implemented -------------------------------------------------------

def fla_attnres(query, residuals, rms_weight, output_rms_weight, eps):
    """naive_attnres (+ the fused kernel's output RMSNorm): fp32, softmax over sources."""
    v = torch.stack(residuals).float()
    k = F.rms_norm(v, (v.shape[-1],), rms_weight.flatten().float(), eps)
    p = (k * query.flatten().float()).sum(-1).softmax(dim=0)
    o = (p[..., None] * v).sum(0)
    o = F.rms_norm(o, (o.shape[-1],), output_rms_weight.float(), eps)
    return o.to(residuals[0].dtype)


def fla_forward(blocks, final_norm, sd, block_size, eps, emb):
    """GLAModel.forward / GLABlock.forward's AttnRes path, state dict keys as the model names them."""
    states, hidden = None, emb
    for i, b in enumerate(blocks):
        pre = f"model.layers.{i}."
        prefix_sum = hidden
        if states is None:
            x = F.rms_norm(prefix_sum, (D,), b.attn_norm.weight, eps)
            states, prefix_sum = [prefix_sum], None
        else:
            residuals = [*states, prefix_sum]
            if (2 * i) % block_size == 0:
                states, prefix_sum = residuals, None
            x = fla_attnres(sd[pre + "attn_res_proj.weight"], residuals, sd[pre + "attn_res_norm.weight"],
                            b.attn_norm.weight, eps)
        y = b.attn(x)
        prefix_sum = y if prefix_sum is None else prefix_sum + y
        residuals = [*states, prefix_sum]
        if (2 * i + 1) % block_size == 0:
            states, prefix_sum = residuals, None
        x = fla_attnres(sd[pre + "mlp_res_proj.weight"], residuals, sd[pre + "mlp_res_norm.weight"],
                        b.mlp_norm.weight, eps)
        y = b.mlp(x)
        hidden = y if prefix_sum is None else prefix_sum + y
    return fla_attnres(sd["model.res_proj.weight"], [*states, hidden], sd["model.res_norm.weight"],
                       final_norm, eps)


FLA_NAMES = ("attn_norm", "attn", "mlp_norm", "mlp")


@pytest.mark.parametrize("block_size,n", [(1, 3), (2, 3), (4, 3), (6, 4)])
def test_fla_checkpoint_reproduces_the_fla_forward_both_ways(block_size, n):
    eps = 1e-6
    blocks, final_norm = _blocks(FLA_NAMES, n, eps, seed=block_size)
    emb = torch.randn(B, T, D)
    rows = _random_rows(n, seed=10 + block_size)
    fla_sd = {k: v for k, v in to_fla(rows).items()}
    assert fla_sd["model.layers.0.attn_res_proj.weight"].shape == (1, D)
    assert len(fla_sd) == 4 * n + 2
    with torch.no_grad():
        theirs = fla_forward(blocks, final_norm, fla_sd, block_size, eps, emb)
        # FLA checkpoint -> our per-layer sites around the same blocks
        stack = wrap_prenorm(blocks, fla_config(block_size, eps), sublayers="fla")
        load_into(stack.depth_router, from_fla({**fla_sd, "model.embeddings.weight": torch.zeros(3, D)}))
        ours = F.rms_norm(stack(emb), (D,), final_norm, eps)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    assert (ours - F.rms_norm(emb, (D,), final_norm, eps)).abs().max() > 0.1  # a real computation
    # round trips are exact, and our router's own parameters written out give the same forward
    for k, v in to_fla(stack.depth_router).items():
        assert torch.equal(v, fla_sd[k])
    router = DepthRouter(fla_config(block_size, eps), 2 * n, D)
    load_into(router, rows)
    assert all(torch.equal(a, b) for a, b in zip(from_fla(to_fla(router)).values(), rows.values()))


def test_fla_config_and_key_errors():
    assert fla_config(1).kind == "full" and fla_config(4).block_size == 4 and fla_config(4).eps == 1e-6
    with pytest.raises(ValueError, match="attnres_block_size: expected 1 or an even int"):
        fla_config(3)
    sd = to_fla(_random_rows(2, 0))
    broken = dict(sd)
    del broken["model.layers.1.mlp_res_norm.weight"]
    with pytest.raises(ValueError, match=r"missing 'model.layers.1.mlp_res_norm.weight'"):
        from_fla(broken)
    broken = {**sd, "model.layers.1.attn_res_proj.weight": torch.zeros(2, D)}
    with pytest.raises(ValueError, match=r"attn_res_proj.weight'\]: expected shape \[1, D\].*got \(2, 16\)"):
        from_fla(broken)
    with pytest.raises(ValueError, match="no 'model.layers.<i>.attn_res"):
        from_fla({"model.embeddings.weight": torch.zeros(2, D)})
    assert torch.equal(from_fla({"backbone." + k[len("model."):]: v for k, v in sd.items()},
                                prefix="backbone.")["queries"], from_fla(sd)["queries"])
    with pytest.raises(ValueError, match=r"shape \[2n\+1, D\]"):
        to_fla({"queries": torch.zeros(4, D), "norm_weights": torch.zeros(4, D)})


# -- Kimi K3 (mlx-lm / tpu-inference), re-implemented ---------------------------------------------

def k3_mix(blocks, partial_sum, proj_weight, norm_weight, eps):
    """_attn_res_combine / apply_attn_res: fp32, the gain folded into the query (w_eff)."""
    if not blocks:
        return partial_sum
    w_eff = norm_weight.float() * proj_weight.reshape(-1).float()
    raw = torch.stack(blocks)
    rf = raw.float()
    inv_rms = torch.rsqrt((rf * rf).mean(-1) + eps)
    pf = partial_sum.float()
    p_logit = (pf @ w_eff) * torch.rsqrt((pf * pf).mean(-1) + eps)
    logits = torch.cat([(rf @ w_eff) * inv_rms, p_logit[None]])
    p = torch.softmax(logits, dim=0)
    out = (p[:-1, ..., None] * rf).sum(0) + p[-1, ..., None] * pf
    return out.to(partial_sum.dtype)


def k3_forward(layers, final_norm, sd, block_size, eps, emb):
    """KimiK3TextModel.__call__ / KimiK3DecoderLayer.__call__ (no pipeline), HF key names."""
    blocks, h = [], emb
    for i, layer in enumerate(layers):
        pre = f"model.layers.{i}."
        partial_sum = h
        x = k3_mix(blocks, partial_sum, sd[pre + "self_attention_res_proj.weight"],
                   sd[pre + "self_attention_res_norm.weight"], eps)
        if i % block_size == 0:  # is_block_start
            blocks.append(partial_sum)
            partial_sum = None
        y = layer.self_attn(F.rms_norm(x, (D,), layer.input_layernorm.weight, eps))
        partial_sum = y if partial_sum is None else partial_sum + y
        x = k3_mix(blocks, partial_sum, sd[pre + "mlp_res_proj.weight"], sd[pre + "mlp_res_norm.weight"], eps)
        h = partial_sum + layer.mlp(F.rms_norm(x, (D,), layer.post_attention_layernorm.weight, eps))
    h = k3_mix(blocks, h, sd["model.output_attn_res_proj.weight"], sd["model.output_attn_res_norm.weight"], eps)
    return F.rms_norm(h, (D,), final_norm, eps)


K3_NAMES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@pytest.mark.parametrize("block_size,n,per_layer", [(1, 3, True), (2, 5, True), (2, 4, False), (3, 5, True)])
def test_k3_checkpoint_reproduces_the_k3_forward_both_ways(block_size, n, per_layer):
    eps = 1e-5
    layers, final_norm = _blocks(K3_NAMES, n, eps, seed=20 + block_size)
    emb = torch.randn(B, T, D)
    rows = _random_rows(n, seed=30 + block_size)
    k3_sd = to_k3(rows)
    cfg = k3_config(block_size)
    assert cfg.block_size == 2 * block_size and cfg.eps == 1e-5
    with torch.no_grad():
        theirs = k3_forward(layers, final_norm, k3_sd, block_size, eps, emb)
        stack = wrap_prenorm(layers, cfg, sublayers="llama", per_layer=per_layer)
        load_into(stack.depth_router, from_k3(k3_sd))
        ours = F.rms_norm(stack(emb), (D,), final_norm, eps)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    assert (ours - F.rms_norm(emb, (D,), final_norm, eps)).abs().max() > 0.1
    for k, v in to_k3(stack.depth_router).items():
        assert torch.equal(v, k3_sd[k])


def test_k3_reads_tpu_inference_kernels_and_raw_hf_names():
    rows = _random_rows(3, seed=5)
    hf = to_k3(rows)
    tpu = to_k3(rows, proj_layout="einsum")
    assert tpu["model.layers.0.mlp_res_proj.weight"].shape == (D, 1)
    raw = {k.replace("_proj.weight", ".proj_weight").replace("_norm.weight", ".norm_weight"): v
           for k, v in hf.items()}
    assert "model.layers.2.self_attention_res.proj_weight" in raw
    for sd in (hf, tpu, raw):
        got = from_k3(sd)
        assert all(torch.equal(got[k], rows[k]) for k in rows)
    with pytest.raises(ValueError, match="proj_layout"):
        to_k3(rows, proj_layout="jax")
    with pytest.raises(ValueError, match=r"attn_res_block_size: expected an int >= 1"):
        k3_config(0)
    with pytest.raises(ValueError, match=r"layer indices \[0, 2\] are not 0..1"):
        from_k3({k: v for k, v in hf.items() if ".layers.1." not in k})
