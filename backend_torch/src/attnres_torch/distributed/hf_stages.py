"""A Hugging Face model converted by `attnres_torch.hf.convert` cut into stock
`torch.distributed.pipelining` stages (`split_hf`; `pipeline_stages` builds them).

    hf.convert(model, ResidualConfig(kind="block", block_size=4))   # Llama, Mistral, Qwen2, Qwen3
    chunks = split_hf(model, [2, 2])             # decoder layers per chunk; checked on a probe
    stages = pipeline_stages(chunks, device)     # this rank's PipelineStage(s)

Supported classes (`_FAMILIES`, an explicit table): `LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`.  A chunk runs its decoder layers through their own
`__call__` (the conversion's hooks compute what they compute unsplit) and supplies only what the
family's decoder loop would: chunk 0 embeds `input_ids [B, T]`, every chunk rebuilds positions,
rotary embeddings and each layer's mask as the family's `*Model.forward` does without a cache or
padding, the last chunk applies the final norm and `lm_head`.  A cut hands on what
`split_stack`'s does plus the hidden state the next layer takes (row 2i + 2, layer i's, forms
layer i + 1's input).  `verify=True` (the default) compares the chunks with the unsplit model's
logits on a probe batch, as `hf.convert` does.  The masks per family, the verification's
tolerance and what is refused (other classes, tied embeddings, a stacked router, padding, M10
inputs, an observer): docs/distributed.md, "A converted Hugging Face model".
"""

from __future__ import annotations

import inspect
from typing import List, Sequence

import torch
from torch import nn

from ..convert import PerLayerRouter
from ..residual_ops import TorchOps
from .stages import carried_count, carried_tensors, check_router, resume_stream

# The supported classes (an explicit table, not a guess from the modules' shapes): the name in
# `transformers` -> how that family's `*Model.forward` (transformers 5.24) gives decoder layer i
# its mask, which a chunk reproduces:
#   "causal"          LlamaModel: `create_causal_mask` for every layer;
#   "sliding_window"  MistralModel: `create_sliding_window_causal_mask` for every layer when
#                     `config.sliding_window` is set, else `create_causal_mask`;
#   "layer_types"     Qwen2Model / Qwen3Model: `{"full_attention": create_causal_mask,
#                     "sliding_attention": create_sliding_window_causal_mask}[config.layer_types[i]]`.
# Each calls its layers with the same keywords (hidden state, attention_mask, position_embeddings,
# position_ids; no cache) and rotary embeddings of the positions 0..T-1.
_FAMILIES = {
    "LlamaForCausalLM": "causal",
    "MistralForCausalLM": "sliding_window",
    "Qwen2ForCausalLM": "layer_types",
    "Qwen3ForCausalLM": "layer_types",
}
_MASK_BUILDERS = {"full_attention": "create_causal_mask",
                  "sliding_attention": "create_sliding_window_causal_mask"}
_VERIFY_TOLERANCE = 4 * torch.finfo(torch.float32).eps  # times max(1, max |logit|)


def _family(model: nn.Module):
    """The `_FAMILIES` entry of `model`'s class (its name, its mask rule), or None."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - transformers is installed with the hf extra
        return None
    for name, rule in _FAMILIES.items():
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            return name, rule
    return None


def _mask_types(rule: str, config, n: int) -> List[str]:
    """Each decoder layer's mask type ("full_attention" / "sliding_attention"), as the family's
    model forward picks it."""
    if rule == "layer_types":
        return [config.layer_types[i] for i in range(n)]
    if rule == "sliding_window" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _causal_mask(config, h: torch.Tensor, position_ids: torch.Tensor, kind: str = "full_attention"):
    """The family's mask of type `kind` for a full causal sequence (no padding, no cache), built
    by the `transformers.masking_utils` function its model forward calls."""
    from transformers import masking_utils

    build = getattr(masking_utils, _MASK_BUILDERS[kind])
    names = inspect.signature(build).parameters
    kw = {"config": config, "attention_mask": None, "position_ids": position_ids}
    kw["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    for name in ("cache", "past_key_values"):
        if name in names:
            kw[name] = None
    if "cache_position" in names:
        kw["cache_position"] = position_ids[0]
    return build(**kw)


class HFChunk(nn.Module):
    """Decoder layers `first`..`last` (0-based) of a converted HF causal LM, as the module of one
    pipeline stage (`split_hf`).

    forward: chunk 0 takes `input_ids [B, T]` (and optionally an all-ones `attention_mask`);
    a later chunk the tensors its predecessor returned.  A chunk returns the carried tensors and
    the hidden state `[B, T, D]` (a tuple), the last chunk the logits `[B, T, vocab]`."""

    def __init__(self, model: nn.Module, first: int, last: int, rule: str = "causal"):
        super().__init__()
        from .. import hf  # imported here: importing attnres_torch.hf registers with transformers

        state = hf._state(model)
        owner, layers = state.base, state.layers
        self.__dict__["_attnres_state"] = state  # the model's hooks' state (not a submodule)
        self.first, self.last, self.num_decoder_layers = first, last, len(layers)
        self.is_first, self.is_last = first == 0, last == len(layers) - 1
        self.hf_config = model.config
        self.mask_types = _mask_types(rule, model.config, len(layers))[first:last + 1]
        self.embed = owner.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(layers[first:last + 1])
        self.rotary_emb = owner.rotary_emb  # buffers only: every chunk recomputes the positions
        self.norm = owner.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def extra_repr(self) -> str:
        return (f"decoder layers {self.first}..{self.last} of {self.num_decoder_layers}, "
                f"kind={self._attnres_state.router.config.kind!r}")

    def _check_call(self, state, router) -> None:
        if state.mix is not None or state.scale is not None:
            raise ValueError("hf.residual_inputs(mix=..., scale=...): the M10 per-call inputs are "
                             "not carried across pipeline stages; run the chunks outside that block")
        if getattr(router, "observer", None) is not None:
            raise ValueError("router.observer: a depth observer (DepthMonitor) watches one stream "
                             "per pass, which pipeline chunks split; set hf.router(model).observer "
                             "= None while the model runs as chunks")

    def forward(self, *inputs, attention_mask=None):
        state = self._attnres_state
        router = state.router
        self._check_call(state, router)
        cfg, L = router.config, router.num_layers
        stream = None
        if self.is_first:
            if len(inputs) != 1:
                raise ValueError(f"inputs: the first chunk takes input_ids [B, T], got {len(inputs)} tensors")
            if attention_mask is not None and not bool(torch.all(attention_mask == 1)):
                raise ValueError("attention_mask: padding is not supported by pipeline chunks (every "
                                 "chunk rebuilds the causal mask from the shape); pass unpadded "
                                 "sequences of one length, or no mask")
            h = self.embed(inputs[0])
        else:
            layer = 2 * self.first + 1  # the sublayer this chunk starts at (1-based)
            want = carried_count(cfg, layer) + 1
            if len(inputs) != want:
                raise ValueError(f"inputs: the chunk of decoder layers {self.first}..{self.last} "
                                 f"resumes from {want} tensors (carried and the hidden state), "
                                 f"got {len(inputs)}")
            params = {n: getattr(router, n) for n in cfg.param_shapes(L, router.dim)}
            stream = resume_stream(cfg, TorchOps(params, save=router.save), L, layer, inputs[:-1])
            h = inputs[-1]
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks = {kind: _causal_mask(self.hf_config, h, position_ids, kind)
                 for kind in dict.fromkeys(self.mask_types)}
        position_embeddings = self.rotary_emb(h, position_ids)
        saved = router.schedule
        try:
            router.schedule = "direct"  # as the resumed streams (layer 0's hook starts chunk 0's)
            if stream is not None:
                state.stream, state.cursor = stream, (self.first - 1, 4)
            for layer, kind in zip(self.layers, self.mask_types):
                out = layer(h, attention_mask=masks[kind], position_embeddings=position_embeddings,
                            position_ids=position_ids)
                h = out[0] if isinstance(out, tuple) else out
            if self.is_last:
                return self.lm_head(self.norm(h))
            return carried_tensors(state.stream) + (h,)
        finally:
            router.schedule = saved
            state.stream, state.cursor = None, None


def split_hf(model: nn.Module, sizes: Sequence[int], *, verify: bool = True) -> List[HFChunk]:
    """A converted HF causal LM (`hf.convert`; `LlamaForCausalLM`, `MistralForCausalLM`,
    `Qwen2ForCausalLM` or `Qwen3ForCausalLM`), Block or Full AttnRes, cut into len(sizes) chunks
    of sizes[k] consecutive decoder layers (summing to the model's layers) for
    `torch.distributed.pipelining`: chunk 0 embeds `input_ids [B, T]`, the last returns the
    logits.  Returns one `HFChunk` per chunk, chunk k for `PipelineStage(chunks[k], k,
    len(sizes), ...)` (`pipeline_stages` builds this rank's).  The chunks own the model's modules
    (not copies), each decoder layer with its AttnRes rows.

    verify: True (default): before returning, run the chunks in sequence on a probe batch (1 x 8
      token ids; more where a sliding window is shorter, up to 64) and compare with the unsplit
      model's logits, both in eval mode, no grad, the direct schedule; a difference beyond float32
      rounding (4 eps x max(1, max |logit|); in practice they are equal bitwise) is refused with
      the class and the difference.  Costs two forwards of the probe: pass False for a model that
      cannot run one here (parameters on the meta device) or where even that is too costly."""
    from .. import hf

    if not isinstance(verify, bool):
        raise TypeError(f"verify: expected True or False, got {verify!r}")
    if not hf.is_converted(model):
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    family = _family(model)
    if family is None:
        raise ValueError(f"model: split_hf cuts a converted model of the supported classes "
                         f"({', '.join(_FAMILIES)}), got a {type(model).__name__}; other families' "
                         f"decoder loops (their masks, position schemes and layer calls) are not "
                         f"reproduced")
    name, rule = family
    router = hf.router(model)
    check_router(router)
    if not isinstance(router, PerLayerRouter):
        raise ValueError("model: converted with per_layer=False, so one stacked router on the base "
                         "model holds every row and no chunk can own its rows; convert with "
                         "per_layer=True (the default for Block and Full without shared rows)")
    n = len(hf.decoder_layers(model))
    if (not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
            or sum(sizes) != n):
        raise ValueError(f"sizes: expected ints >= 1 summing to the {n} decoder layers, got {list(sizes)!r}")
    if rule == "layer_types":
        types = list(getattr(model.config, "layer_types", None) or [])
        if len(types) < n or any(t not in _MASK_BUILDERS for t in types[:n]):
            raise ValueError(f"model: config.layer_types {types!r} does not give each of the {n} "
                             f"decoder layers one of {list(_MASK_BUILDERS)}")
    embed = model.get_input_embeddings().weight
    if len(sizes) > 1 and model.lm_head.weight is embed:
        raise ValueError("model: tie_word_embeddings=True makes lm_head.weight the embedding's "
                         "weight, which the first and the last chunk would both hold (its gradient "
                         "scaled once per stage and never summed across ranks); untie it before "
                         "splitting: model.lm_head.weight = nn.Parameter(model.lm_head.weight"
                         ".detach().clone()); model.config.tie_word_embeddings = False")
    chunks, first = [], 0
    for s in sizes:
        chunks.append(HFChunk(model, first, first + s - 1, rule))
        first += s
    if verify:
        _verify(model, chunks, name)
    return chunks


def _probe_tokens(config) -> int:
    """The probe's length: 8 tokens, or one past the shortest sliding window up to 64 (so the
    window cuts the probe), at most the model's positions."""
    T = 8
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        T = max(T, min(window + 1, 64))
    limit = getattr(config, "max_position_embeddings", None)
    return min(T, limit) if isinstance(limit, int) and limit > 0 else T


def _verify(model: nn.Module, chunks: Sequence[HFChunk], name: str) -> None:
    """`split_hf(verify=True)`: the chunks in sequence against the unsplit model on a probe batch,
    both in eval mode under no_grad with the direct schedule (the chunks' own; the unsplit model
    would run Block's two-phase schedule in eval, equal only within rounding), without M10
    per-call inputs or a depth observer (restored after)."""
    from .. import hf

    if any(p.is_meta for p in model.parameters()):
        raise ValueError("verify: the model's parameters are on the meta device, so split_hf cannot "
                         "run its probe forward; load the weights first, or pass verify=False")
    state = hf._state(model)
    router = state.router
    emb = model.get_input_embeddings()
    T = _probe_tokens(model.config)
    ids = ((torch.arange(T) * 7 + 3) % emb.num_embeddings).unsqueeze(0).to(emb.weight.device)
    has_observer = hasattr(router, "observer")
    saved = (router.schedule, state.mix, state.scale, getattr(router, "observer", None))
    try:
        router.schedule = "direct"
        state.mix = state.scale = None
        if has_observer:
            router.observer = None
        with hf._probe_mode(model):
            want = hf._probe_value(model(input_ids=ids, use_cache=False))
            x = (ids,)
            for chunk in chunks:
                x = chunk(*x)
                x = x if isinstance(x, tuple) else (x,)
            got = x[0]
    finally:
        router.schedule, state.mix, state.scale = saved[:3]
        if has_observer:
            router.observer = saved[3]
    diff = hf._maxdiff(got, want)  # inf for another shape
    scale = max(1.0, float(want.abs().max()))
    if not diff <= _VERIFY_TOLERANCE * scale:
        raise ValueError(f"model: the chunks of the converted {name} do not reproduce the unsplit "
                         f"model: their logits differ by {diff:.3g} (max abs; allowed "
                         f"{_VERIFY_TOLERANCE * scale:.3g}) on a probe batch of 1 x {T} tokens. "
                         f"Report the model; verify=False skips this check")
