"""Memory modes for training AttnRes models: what autograd keeps of the stored history.

An AttnRes stack must keep its sources for the depth attention anyway (Full: v_0..v_{l-1}; Block:
the completed blocks b_0..b_{n-1} and the running partial sum); a plain training step also keeps
every sublayer's internals (its pre-norm, the attention's q/k/v, the MLP's hidden layer) for the
backward.  Two modes change that, each a context manager around the forward (the backward may run
inside or after it) that leaves outputs and gradients unchanged:

* `Recompute(model)`: every sublayer runs under non-reentrant `torch.utils.checkpoint`; per
  sublayer only its input and the depth attention's saved tensors are kept (`checkpointed(f)`:
  the same for one callable).
* `Offload(model, window=W)`: saved tensors older than W sublayers go to host memory during the
  forward and come back on first use in the backward.

Both compose (`with Recompute(model), Offload(model): ...`).  What each keeps, how, and the
measured savings: docs/training.md (the memory modes) and the classes' docstrings.  Compressed
storage of old sources (low rank, lower precision) is not here yet.

`SavedBytes()` measures: the bytes of every distinct storage autograd saves inside it
(parameters excluded), plus the inputs `Recompute` keeps for its recomputation, which the
checkpoint holds outside autograd's saved tensors.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Recompute", "Offload", "SavedBytes", "checkpointed", "sublayer_modules"]

ModelLike = Union[nn.Module, Iterable[nn.Module]]

_ACCOUNTING: List["SavedBytes"] = []  # the active SavedBytes contexts (innermost last)


def sublayer_modules(model: ModelLike) -> List[nn.Module]:
    """The sublayer modules of `model`: a Hugging Face model converted by `attnres_torch.hf`
    (its attention and MLP modules), its `.sublayers` (an `AttnResTransformer` or anything with
    that attribute) or the modules of an iterable (e.g. an `nn.ModuleList`)."""
    from . import hf  # no transformers import: hf reads only the model's own structure

    if isinstance(model, nn.Module) and hf.is_converted(model):
        return hf.sublayer_modules(model)
    subs = getattr(model, "sublayers", model)
    if isinstance(subs, nn.Module) and not isinstance(subs, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"model: expected a model with .sublayers or an iterable of sublayer "
                         f"modules, got {type(model).__name__}")
    try:
        mods = list(subs)
    except TypeError:
        raise ValueError(f"model: expected a model with .sublayers or an iterable of sublayer "
                         f"modules, got {type(model).__name__}") from None
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise ValueError("model: expected a non-empty list of nn.Module sublayers")
    return mods


def _is_param(t: torch.Tensor) -> bool:
    """A parameter or a view of one (F.linear saves the weight's transpose): never counted as
    activation memory, never offloaded."""
    base = t if t._base is None else t._base
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


class SavedBytes:
    """Counts what a forward leaves for its backward, as bytes of distinct storages.

    Inside `with SavedBytes() as acct:` every tensor autograd saves is recorded (parameters and
    views of them excluded; a storage saved many times, such as a source read by every later depth attention,
    counts once), as is every input `Recompute` keeps for recomputation.  `acct.bytes` is the
    total, `acct.tensors` the number of distinct storages.  Tensors pass through unchanged.  An
    inner `Offload` takes over autograd's hooks, so use its own counters there."""

    def __init__(self):
        self.bytes = 0
        self.tensors = 0
        self._seen: Dict[tuple, torch.Tensor] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or _is_param(t):
            return
        key = _storage_key(t)
        if key not in self._seen:
            self._seen[key] = t  # keeps the storage alive, so its address is not reused
            self.bytes += t.untyped_storage().nbytes()
            self.tensors += 1

    def _pack(self, t):
        self.add(t)
        return t

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        _ACCOUNTING.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACCOUNTING.remove(self)
        self._hooks.__exit__(*exc)
        self._seen = {}


#: Keyword arguments of Hugging Face attention modules that hold a KV cache: a checkpointed
#: sublayer would append its keys twice (forward and recomputation), so they are dropped while a
#: gradient is recorded, as HF's own gradient checkpointing does.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def checkpointed(f: Callable, *, preserve_rng_state: bool = True) -> Callable:
    """f wrapped in non-reentrant `torch.utils.checkpoint`: its internals are recomputed in the
    backward instead of saved; what is kept is its input h, the first positional argument or,
    for a keyword-only call (HF's `self_attn(hidden_states=...)`), the first tensor keyword
    (see `Recompute`)."""

    def run(*args, **kwargs):
        h = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        for acct in _ACCOUNTING:
            acct.add(h)
        if torch.is_grad_enabled():
            kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
        return checkpoint(f, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                          **kwargs)

    return run


class Recompute:
    """`with Recompute(model): loss = ...; loss.backward()` (the backward may also follow the
    block): every sublayer's forward runs under non-reentrant `torch.utils.checkpoint`.

    Saved per sublayer l: the input h_l and the depth attention's own saved tensors (its sources
    v_0..v_{l-1} / blocks and partial sum, query, gain, lse, and the output where `save` keeps
    it), nothing else; the sublayer
    (pre-norm, attention, MLP) is recomputed in the backward, once.  Outputs and gradients equal
    the plain path's (the same kernels run on the same inputs; dropout keeps its RNG state with
    preserve_rng_state).  The module's parameters and state_dict are untouched; the sublayers'
    `forward` is patched on the instances while the block is active.

    A Hugging Face model converted by `attnres_torch.hf` whose decoder layers are HF
    `GradientCheckpointingLayer`s is recomputed per decoder layer instead, through HF's own
    checkpointing switched on for the block (norms included; the conversion replays the
    layer's residual stream), which keeps fewer bytes than per-sublayer checkpoints around the
    layers' own norms.

    Args:
      model: an `AttnResTransformer` (anything with `.sublayers`), a converted HF model, or an
        iterable of the sublayer modules that are passed to `DepthRouter.forward`.
      enabled: False makes the block a no-op (for a flag).
    """

    def __init__(self, model: ModelLike, *, enabled: bool = True, preserve_rng_state: bool = True):
        from . import hf

        self.modules = sublayer_modules(model)
        self.enabled, self.preserve_rng_state = bool(enabled), preserve_rng_state
        self._patched: List[nn.Module] = []
        self._layers: List[nn.Module] = []
        if isinstance(model, nn.Module) and hf.is_converted(model):
            layers = hf.decoder_layers(model)
            if all(hasattr(layer, "_gradient_checkpointing_func") or hasattr(type(layer), "gradient_checkpointing")
                   for layer in layers):
                self._layers = layers
        self._saved_layers: List[tuple] = []

    def __enter__(self) -> "Recompute":
        if self.enabled and self._layers:
            func = functools.partial(checkpoint, use_reentrant=False,
                                     preserve_rng_state=self.preserve_rng_state)
            for layer in self._layers:
                self._saved_layers.append((layer, {k: layer.__dict__[k] for k in
                                                   ("gradient_checkpointing", "_gradient_checkpointing_func")
                                                   if k in layer.__dict__}))
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = func
            return self
        if self.enabled:
            for m in self.modules:
                if "forward" in m.__dict__:
                    raise ValueError("model: a sublayer's forward is already patched (nested "
                                     "Recompute on the same model?)")
                m.forward = checkpointed(type(m).forward.__get__(m),
                                         preserve_rng_state=self.preserve_rng_state)
                self._patched.append(m)
        return self

    def __exit__(self, *exc) -> None:
        for m in self._patched:
            del m.forward
        self._patched = []
        for layer, saved in self._saved_layers:
            for k in ("gradient_checkpointing", "_gradient_checkpointing_func"):
                if k in saved:
                    setattr(layer, k, saved[k])
                else:
                    layer.__dict__.pop(k, None)
        self._saved_layers = []


class _Slot:
    """One saved storage under `Offload`: on the device until it ages out, then on the host."""

    __slots__ = ("device_tensor", "device", "host", "ref", "layer", "event", "reloaded")

    def __init__(self, t: torch.Tensor, layer: int):
        self.device_tensor: Optional[torch.Tensor] = t
        self.device = t.device
        self.host: Optional[torch.Tensor] = None
        self.ref = weakref.ref(t)
        self.layer = layer
        self.event = None
        self.reloaded = None  # weakref to the device copy the backward brought back


class Offload:
    """`with Offload(model, window=2): loss = ...` then `loss.backward()` (inside or after).

    While active, autograd's saved tensors go through saved-tensor hooks.  Each one is tagged with
    the sublayer being computed when it was saved (0: before the first; L + 1: the output
    aggregation and the head).  When sublayer l starts, every saved tensor tagged <= l - 1 -
    window is copied to `host` memory and its device reference dropped: on CUDA into pinned
    memory, non-blocking, on a side stream (the device copy is kept alive for that stream with
    `record_stream`); elsewhere a plain copy.  A storage saved by several ops (a source read by
    every later depth attention) is copied once.  The backward brings an offloaded tensor back
    on its first use (waiting for the side stream, a non-blocking copy from pinned memory) and
    shares that copy while it is alive; there is no prefetch yet.

    Kept on the device regardless: parameters, tensors under `min_bytes`, tensors of other
    devices than the model's, and the saved tensors of the last `window` sublayers.

    Counters (bytes; a storage counts once): `saved_bytes`, every storage saved; `offloaded_bytes`,
    copied to the host; `kept_bytes`, saved storages still held on the device (by autograd or by
    anyone else: a Full source the stream still reads); `peak_device_bytes`, the largest
    `kept_bytes` seen at a sublayer boundary or the end of the forward, the number to compare
    with `SavedBytes` of a plain forward.

    Args:
      model: an `AttnResTransformer` (anything with `.sublayers`) or its sublayer modules.
      window: W >= 0 sublayers whose saved tensors stay on the device.
      min_bytes: smaller tensors are never offloaded (default 0).
      pin_memory: None = pinned host buffers when the tensor is on CUDA.
    """

    def __init__(self, model: ModelLike, *, window: int = 2, min_bytes: int = 0,
                 pin_memory: Optional[bool] = None):
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window: expected an int >= 0, got {window!r}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes: expected an int >= 0, got {min_bytes!r}")
        self.modules = sublayer_modules(model)
        self.window, self.min_bytes, self.pin_memory = window, min_bytes, pin_memory
        self.saved_bytes = self.offloaded_bytes = self.peak_device_bytes = 0
        self._all: List[_Slot] = []
        self._kept_final: Optional[int] = None
        self._layer = 0
        self._slots: Dict[int, _Slot] = {}  # id(tensor) -> slot (checked with the slot's weakref)
        self._live: List[_Slot] = []  # slots still on the device, oldest first
        self._handles = []
        self._stream = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def kept_bytes(self) -> int:
        if self._kept_final is not None:
            return self._kept_final
        held = {}
        for slot in self._all:
            t = slot.device_tensor if slot.device_tensor is not None else slot.ref()
            if t is not None:
                held[_storage_key(t)] = t.untyped_storage().nbytes()
        return sum(held.values())

    # -- forward -------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if _is_param(t) or t.untyped_storage().nbytes() < self.min_bytes:
            return t
        slot = self._slots.get(id(t))
        if slot is not None and slot.ref() is t:
            return slot
        slot = _Slot(t, self._layer)
        self._slots[id(t)] = slot
        self._live.append(slot)
        key = _storage_key(t)
        if key not in self._storages:
            self._storages[key] = t  # alive while counted: the address is not reused meanwhile
            self.saved_bytes += t.untyped_storage().nbytes()
        self._all.append(slot)
        return slot

    def _enter_layer(self, layer: int) -> None:
        self._layer = layer
        keep = []
        for slot in self._live:
            if slot.layer <= layer - 1 - self.window:
                self._offload(slot)
            else:
                keep.append(slot)
        self._live = keep
        live_keys = {_storage_key(s.device_tensor) for s in keep}
        self._storages = {k: t for k, t in self._storages.items() if k in live_keys}
        self.peak_device_bytes = max(self.peak_device_bytes, self.kept_bytes)

    def _offload(self, slot: _Slot) -> None:
        t = slot.device_tensor
        if t.device.type == "cuda":
            pin = True if self.pin_memory is None else self.pin_memory
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=t.device)
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=pin)
                t.record_stream(self._stream)
                slot.event = torch.cuda.Event()
                slot.event.record(self._stream)
        else:
            host = t.detach().to("cpu", copy=True)
        slot.host = host
        slot.device_tensor = None
        self.offloaded_bytes += host.nbytes

    # -- backward ------------------------------------------------------------------------------
    def _unpack(self, packed):
        if not isinstance(packed, _Slot):
            return packed
        if packed.device_tensor is not None:
            return packed.device_tensor
        t = packed.reloaded() if packed.reloaded is not None else None
        if t is None:
            ref = packed.ref()  # the forward's tensor, if something else still holds it
            if ref is not None:
                return ref
            host = packed.host
            if packed.event is not None:
                packed.event.synchronize()
                t = host.to(packed.device, non_blocking=host.is_pinned())
            else:
                t = host.clone()
            packed.reloaded = weakref.ref(t)
        return t

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> "Offload":
        L = len(self.modules)
        for i, m in enumerate(self.modules):
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, layer=i + 1: self._enter_layer(layer)))
        self._handles.append(self.modules[-1].register_forward_hook(
            lambda mod, args, out: self._enter_layer(L + 1)))
        self._layer = 0
        self._storages: Dict[tuple, torch.Tensor] = {}
        self._kept_final = None
        self.saved_bytes = self.offloaded_bytes = self.peak_device_bytes = 0
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self.peak_device_bytes = max(self.peak_device_bytes, self.kept_bytes)
        self._kept_final = self.kept_bytes
        self._handles, self._slots, self._live, self._all, self._storages = [], {}, [], [], {}


@contextlib.contextmanager
def memory_mode(mode: str, model: ModelLike, *, window: int = 2):
    """One of "none", "recompute", "offload", "recompute+offload" as a single context (for flags
    and benchmarks); yields the `Offload` object (or None) for its counters."""
    modes = ("none", "recompute", "offload", "recompute+offload")
    if mode not in modes:
        raise ValueError(f"mode: expected one of {', '.join(modes)}, got {mode!r}")
    with contextlib.ExitStack() as stack:
        if "recompute" in mode:
            stack.enter_context(Recompute(model))
        off = stack.enter_context(Offload(model, window=window)) if "offload" in mode else None
        yield off
