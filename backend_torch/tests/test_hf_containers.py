"""Decoder layers in an `nn.ModuleDict` (torchtitan's Llama3 keeps `layers` as a ModuleDict
keyed "0".."n-1" and calls `for layer in self.layers.values()`) or an `nn.Sequential` convert
with `hf.convert` like a ModuleList (issue 45 item 4): mix=0 equals the unconverted model
bitwise, the rows act and train; a model that calls its layers in another order than the
container holds them is refused at convert, never converted to another function."""

from __future__ import annotations

import copy

import pytest
import torch
from attnres_core.config import ResidualConfig
from attnres_torch import hf
from torch import nn

D, V, T = 16, 32, 6


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv, self.wo = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x, freqs):
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        q = q * freqs
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)))


class TransformerBlock(nn.Module):
    """torchtitan's block: `h = x + attention(attention_norm(x), freqs_cis)`, then
    `h + feed_forward(ffn_norm(h))`."""

    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(D, eps=1e-5), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(D, eps=1e-5), FeedForward()

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers=3, container="dict", order=None):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        blocks = [TransformerBlock() for _ in range(n_layers)]
        if container == "dict":
            self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        else:
            self.layers = nn.Sequential(*blocks)
        self.norm, self.output = nn.RMSNorm(D, eps=1e-5), nn.Linear(D, V, bias=False)
        self.order = order  # None: the container's order
        self.register_buffer("freqs_cis", torch.linspace(0.5, 1.5, D), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        layers = list(self.layers.values()) if isinstance(self.layers, nn.ModuleDict) else list(self.layers)
        for i in (self.order or range(len(layers))):
            h = layers[i](h, self.freqs_cis)
        return self.output(self.norm(h))


def _ids(seed=3, batch=2):
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("container", ["dict", "sequential"])
@pytest.mark.parametrize("kind", ["full", "block"])
def test_layers_in_a_moduledict_or_sequential_convert_exactly(container, kind):
    torch.manual_seed(0)
    model = Transformer(container=container)
    plain = copy.deepcopy(model)
    config = ResidualConfig(kind="full") if kind == "full" else ResidualConfig(kind="block", block_size=2)
    hf.convert(model, config)
    assert hf.layer_form(model) == "PreNorm: attention_norm -> attention; ffn_norm -> feed_forward"
    layers = list(model.layers.values()) if container == "dict" else list(model.layers)
    assert hf.decoder_layers(model) == layers
    assert sorted(n for n, _ in model.named_parameters() if "attnres" in n and ".query" in n) == [
        f"layers.{i}.attnres.row{r}.query" for i, rows in ((0, (0, 1, 2)), (1, (3, 4)), (2, (5, 6)))
        for r in rows]
    ids = _ids()
    with torch.no_grad():
        want = plain(ids)
        with hf.residual_inputs(model, mix=0.0):
            assert torch.equal(model(ids), want)
        for n, p in model.named_parameters():
            if "attnres" in n:
                p.normal_(generator=torch.Generator().manual_seed(len(n)))
        assert not torch.equal(model(ids), want)  # the rows act
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "attnres" in n and ".query" in n}
    assert all(g is not None and g.any() for n, g in grads.items() if ".row0." not in n)


def test_a_model_calling_its_layers_out_of_the_containers_order_is_refused_at_convert():
    torch.manual_seed(0)
    model = Transformer(order=[1, 0, 2])
    with pytest.raises(ValueError, match="TransformerBlock .*layer 1 ran before layer 0"):
        hf.convert(model, ResidualConfig(kind="full"))
    assert not hf.is_converted(model)
    assert not any("attnres" in n for n, _ in model.named_parameters())
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in model.layers.values())
