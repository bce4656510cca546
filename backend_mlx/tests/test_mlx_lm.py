"""mlx-lm integration: Kimi K3's Block AttnRes weights both ways, PreNorm Llama converted in place
(small models built from their ModelArgs, random weights)."""

import attnres_numpy.model as ref_model
import mlx.core as mx
import numpy as np
import pytest
from attnres_core.config import ResidualConfig
from attnres_mlx import mlx_lm as C
from helpers import assert_close, to_mx, to_np

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import kimi_k3, llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

D, V = 32, 64


def _kimi(block_size):
    args = kimi_k3.ModelArgs.from_dict(dict(
        model_type="kimi_k3", vocab_size=V, hidden_size=D, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-5,
        linear_attn_config={"kda_layers": [1, 3], "num_heads": 2, "head_dim": 16,
                            "short_conv_kernel_size": 4},
        attn_res_block_size=block_size, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16))
    mx.random.seed(0)
    model = kimi_k3.Model(args)
    model.eval()
    rng = np.random.default_rng(block_size)
    text = model.language_model.model
    reads = [(ly, r) for ly in text.layers for r in ("self_attention_res", "mlp_res")]
    reads.append((text, "output_attn_res"))
    for owner, r in reads:  # non-zero queries: depth attention far from uniform
        getattr(owner, r + "_proj").weight = mx.array(rng.standard_normal((1, D)), mx.float32)
        getattr(owner, r + "_norm").weight = mx.array(1 + 0.3 * rng.standard_normal(D),
                                                     mx.float32)
    return model


@pytest.mark.parametrize("block_size", [1, 2])
def test_kimi_k3_router_reproduces_its_logits_bit_exactly(block_size):
    """K3's own sublayers driven by the converted DepthRouter give K3's logits bit for bit on
    the CPU (float32): prefill, then single-token decode through K3's caches."""
    model = _kimi(block_size)
    router = C.kimi_k3_router(model)
    assert router.config == ResidualConfig(kind="block", block_size=2 * block_size, eps=1e-5)
    tokens = mx.array(np.random.default_rng(1).integers(0, V, size=(2, 7)))
    ours_cache, k3_cache = model.make_cache(), model.make_cache()
    for t0, t1 in [(0, 5), (5, 6), (6, 7)]:
        expect = model(tokens[:, t0:t1], k3_cache)
        got = C.kimi_k3_logits(model, router, tokens[:, t0:t1], ours_cache)
        assert mx.array_equal(got, expect).item(), float(mx.abs(got - expect).max())


def test_kimi_k3_weights_round_trip():
    """Router -> K3 -> router is the identity, and a K3 model given other router rows computes
    what the router does with them (so the reverse mapping is the one K3 reads)."""
    model = _kimi(1)
    router = C.kimi_k3_router(model)
    rng = np.random.default_rng(3)
    router.update({k: mx.array(rng.standard_normal(v.shape), mx.float32)
                   for k, v in router.parameters().items()})
    C.load_kimi_k3(model, router)
    back = C.kimi_k3_router(model)
    for name, value in router.parameters().items():
        assert mx.array_equal(back[name], value).item(), name
    tokens = mx.array(rng.integers(0, V, size=(1, 6)))
    assert mx.array_equal(model(tokens), C.kimi_k3_logits(model, router, tokens)).item()
    with pytest.raises(ValueError, match="router: expected"):
        C.load_kimi_k3(model, C.DepthRouter(ResidualConfig.variant("full"), 8, D))


def _llama(seed=0):
    args = llama.ModelArgs(model_type="llama", hidden_size=D, num_hidden_layers=3,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=V, num_key_value_heads=2)
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_llama_converted_at_mix_zero_is_the_prenorm_model_and_generates():
    """mix=0: the converted Llama's logits equal the unconverted one's bit for bit, and
    generate_step with its KVCache yields the same tokens and logprobs; weight names are kept
    and each layer owns its rows."""
    plain, conv = _llama(), _llama()
    names = set(dict(_flat(plain.parameters())))
    C.convert_prenorm(conv, ResidualConfig.variant("block"), mix=0.0)
    conv_names = dict(_flat(conv.parameters()))
    assert names <= set(conv_names)
    assert conv_names["model.layers.0.attnres_queries"].shape == (2, D)
    assert conv_names["model.layers.2.attnres_norm_weights"].shape == (3, D)
    tokens = mx.array(np.random.default_rng(0).integers(0, V, size=(2, 5)))
    assert mx.array_equal(conv(tokens), plain(tokens)).item()
    prompt = tokens[0]
    runs, offsets = [], []
    for model in (plain, conv):
        cache = make_prompt_cache(model)
        runs.append([(int(t), lp) for (t, lp), _ in zip(
            generate_step(prompt, model, max_tokens=4, prompt_cache=cache), range(4))])
        offsets.append([c.offset for c in cache])
    assert offsets[0] == offsets[1] and offsets[1][0] >= prompt.size + 3
    for (ta, la), (tb, lb) in zip(*runs):
        assert ta == tb and mx.array_equal(la, lb).item()


def _flat(tree, prefix=""):
    from mlx.utils import tree_flatten
    return tree_flatten(tree, prefix)


@pytest.mark.parametrize("kind", ["block", "full"])
def test_llama_converted_matches_reference_with_cache(kind):
    """With non-zero rows the converted Llama is the scheme over its own sublayers: its logits
    (prefill, then single-token decode through KVCache) equal the float64 reference schedule
    driving the same sublayers."""
    model = _llama(1)
    cfg = ResidualConfig.variant(kind)
    C.convert_prenorm(model, cfg)
    rng = np.random.default_rng(2)
    for layer in model.model.layers:
        layer.attnres_queries = mx.array(rng.standard_normal(layer.attnres_queries.shape) * 0.5,
                                         mx.float32)
    tokens = mx.array(rng.integers(0, V, size=(1, 6)))
    inner = model.model
    emb = to_np(inner.embed_tokens(tokens))
    from mlx_lm.models.base import create_attention_mask
    mask = create_attention_mask(inner.embed_tokens(tokens), None)
    subs = []
    for ly in inner.layers:
        subs += [lambda h, ly=ly: to_np(ly.self_attn(ly.input_layernorm(to_mx(h, "float32")),
                                                     mask, None)),
                 lambda h, ly=ly: to_np(ly.mlp(ly.post_attention_layernorm(to_mx(h, "float32"))))]
    params = {"queries": np.concatenate([to_np(ly.attnres_queries) for ly in inner.layers]),
              "norm_weights": np.concatenate([to_np(ly.attnres_norm_weights)
                                              for ly in inner.layers])}
    out = ref_model.stack_forward(cfg, params, emb, subs)
    expect = to_np(model.model.embed_tokens.as_linear(inner.norm(to_mx(out, "float32"))))
    cache = make_prompt_cache(model)
    steps = [model(tokens[:, :4], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache)
                                                  for t in (4, 5)]
    assert_close("logits", mx.concatenate(steps, axis=1), expect, grad=False, override="probe")


def test_convert_prenorm_errors():
    model = _llama()
    with pytest.raises(ValueError, match="config: convert_prenorm supports"):
        C.convert_prenorm(model, ResidualConfig.variant("input_query"))
    with pytest.raises(TypeError, match="config: expected a ResidualConfig"):
        C.convert_prenorm(model, "block")
    C.convert_prenorm(model)
    with pytest.raises(TypeError, match="expected an unconverted PreNorm decoder layer"):
        C.convert_prenorm(model)
