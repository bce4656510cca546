"""A Hugging Face model converted by `attnres_torch.hf.convert` cut into stock
`torch.distributed.pipelining` stages (`split_hf`; `pipeline_stages` builds them).

    hf.convert(model, ResidualConfig(kind="block", block_size=4))     # a LlamaForCausalLM
    chunks = split_hf(model, [2, 2])             # decoder layers per chunk
    stages = pipeline_stages(chunks, device)     # this rank's PipelineStage(s)

A chunk runs its decoder layers through their own `__call__`, so the conversion's hooks compute
exactly what they compute in the unsplit model; it only supplies what the model's decoder loop
would: chunk 0 embeds `input_ids [B, T]`, every chunk recomputes the positions `0..T-1`, the
rotary embeddings and the causal mask from the hidden state's shape (as `LlamaModel.forward`
does without a cache or padding), and the last chunk applies the final norm and `lm_head` and
returns the logits.  A cut hands on what `split_stack`'s does (the completed blocks and the open
partial sum; Full AttnRes every output) plus the hidden state the next layer takes: decoder layer
i owns the router rows its call reads (`layers[i].attnres`, `per_layer=True`), and the depth
read that forms layer i + 1's input is row 2i + 2, layer i's, so the chunk holding layer i makes
that read and sends its result.

Refused (ValueError naming the cause): a model that is not a converted `LlamaForCausalLM`
(other families' decoder loops differ: sliding-window masks, per-layer mask types); tied
embeddings across chunks (`tie_word_embeddings=True`: the embedding and `lm_head` would be one
parameter in two stages); a stacked router (`per_layer=False`, shared queries, low-rank keys)
or a kind other than Block and Full (`stages.check_router`); and, at the forward, an attention
mask with padding, an M10 `residual_inputs` block (mix / scale) and a depth observer.  HF
gradient checkpointing works in the chunks (the conversion's replay; bitwise).  The chunks run the direct schedule (as `split_stack`'s; the unsplit model in
eval mode runs Block's two-phase schedule, equal within rounding), and no KV cache.
"""

from __future__ import annotations

import inspect
from typing import List, Sequence

import torch
from torch import nn

from ..convert import PerLayerRouter
from ..residual_ops import TorchOps
from .stages import carried_count, carried_tensors, check_router, resume_stream


def _llama_causal_lm():
    try:
        from transformers import LlamaForCausalLM
    except ImportError:  # pragma: no cover - transformers is installed with the hf extra
        return None
    return LlamaForCausalLM


def _causal_mask(config, h: torch.Tensor, position_ids: torch.Tensor):
    """`LlamaModel.forward`'s mask for a full causal sequence (no padding, no cache)."""
    from transformers.masking_utils import create_causal_mask

    names = inspect.signature(create_causal_mask).parameters
    kw = {"config": config, "attention_mask": None, "position_ids": position_ids}
    kw["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    for name in ("cache", "past_key_values"):
        if name in names:
            kw[name] = None
    if "cache_position" in names:
        kw["cache_position"] = position_ids[0]
    return create_causal_mask(**kw)


class HFChunk(nn.Module):
    """Decoder layers `first`..`last` (0-based) of a converted HF causal LM, as the module of one
    pipeline stage (`split_hf`).

    forward: chunk 0 takes `input_ids [B, T]` (and optionally an all-ones `attention_mask`);
    a later chunk the tensors its predecessor returned.  A chunk returns the carried tensors and
    the hidden state `[B, T, D]` (a tuple), the last chunk the logits `[B, T, vocab]`."""

    def __init__(self, model: nn.Module, first: int, last: int):
        super().__init__()
        from .. import hf  # imported here: importing attnres_torch.hf registers with transformers

        state = hf._state(model)
        owner, layers = state.base, state.layers
        self.__dict__["_attnres_state"] = state  # the model's hooks' state (not a submodule)
        self.first, self.last, self.num_decoder_layers = first, last, len(layers)
        self.is_first, self.is_last = first == 0, last == len(layers) - 1
        self.hf_config = model.config
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
        mask = _causal_mask(self.hf_config, h, position_ids)
        position_embeddings = self.rotary_emb(h, position_ids)
        saved = router.schedule
        try:
            router.schedule = "direct"  # as the resumed streams (layer 0's hook starts chunk 0's)
            if stream is not None:
                state.stream, state.cursor = stream, (self.first - 1, 4)
            for layer in self.layers:
                out = layer(h, attention_mask=mask, position_embeddings=position_embeddings,
                            position_ids=position_ids)
                h = out[0] if isinstance(out, tuple) else out
            if self.is_last:
                return self.lm_head(self.norm(h))
            return carried_tensors(state.stream) + (h,)
        finally:
            router.schedule = saved
            state.stream, state.cursor = None, None


def split_hf(model: nn.Module, sizes: Sequence[int]) -> List[HFChunk]:
    """A converted HF causal LM (`hf.convert`; Llama family), Block or Full AttnRes, cut into
    len(sizes) chunks of sizes[k] consecutive decoder layers (summing to the model's layers) for
    `torch.distributed.pipelining`: chunk 0 embeds `input_ids [B, T]`, the last returns the
    logits.  Returns one `HFChunk` per chunk, chunk k for `PipelineStage(chunks[k], k,
    len(sizes), ...)` (`pipeline_stages` builds this rank's).  The chunks own the model's modules
    (not copies), each decoder layer with its AttnRes rows."""
    from .. import hf

    if not hf.is_converted(model):
        raise ValueError("model: not converted (call attnres_torch.hf.convert first)")
    llama = _llama_causal_lm()
    if llama is None or not isinstance(model, llama):
        raise ValueError(f"model: split_hf cuts a converted LlamaForCausalLM, got a "
                         f"{type(model).__name__}; other families' decoder loops (sliding-window "
                         f"or per-layer masks, other position schemes) are not reproduced")
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
    embed = model.get_input_embeddings().weight
    if len(sizes) > 1 and model.lm_head.weight is embed:
        raise ValueError("model: tie_word_embeddings=True makes lm_head.weight the embedding's "
                         "weight, which the first and the last chunk would both hold (its gradient "
                         "scaled once per stage and never summed across ranks); untie it before "
                         "splitting: model.lm_head.weight = nn.Parameter(model.lm_head.weight"
                         ".detach().clone()); model.config.tie_word_embeddings = False")
    chunks, first = [], 0
    for s in sizes:
        chunks.append(HFChunk(model, first, first + s - 1))
        first += s
    return chunks
