"""The `Backend` protocol: what a port implements to be checked by the conformance suite.

A backend adapter speaks NumPy at its boundary, so the suite never imports a framework:

* it receives every floating input as a float64 NumPy array whose values are exactly
  representable in the requested dtype (the suite rounds them first), builds native arrays of
  `OpCall.dtype` (or the per-input override in `OpCall.input_dtypes`) on `OpCall.device`,
  non-contiguous views when `OpCall.strided`, runs the op (and its VJP when cotangents are
  given) and returns float32/float64 NumPy arrays;
* it lets the framework's own `ValueError` / `TypeError` propagate for bad input;
* it returns its native inputs read back after the call (`OpResult.inputs_after`) so the suite
  can prove inputs are never modified.

Adapters live in the suite (`attnres_conformance.adapters.<framework>:backend`, built on `adapters.base.Adapter`) and are
selected by name (see `registry.py`) or as `module:object`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

OPS = ("depth_attention", "depth_attention_multi", "merge_partial")

#: Options of `depth_attention` a backend may declare (all are required for full conformance).
OPTIONS = (
    "per_token_query",  # query [..., D]
    "num_heads",  # num_heads > 1
    "sigmoid",  # activation="sigmoid"
    "no_key_norm",  # key_norm=False
    "lse",  # return_lse=True (and a d_lse cotangent)
    "weights",  # return_weights=True
    "stacked",  # sources as one [N, ..., D] array
    "strided",  # non-contiguous inputs
    "out_norm",  # out_norm_weight (C17): also out_normed, its cotangent and d_out_norm_weight
)

SCHEDULES = ("direct", "two_phase")

#: Per-call inputs of the probe / router (spec M10) a backend may declare.
CALL_INPUTS = ("mix", "scale")



@dataclass(frozen=True)
class Capabilities:
    """What a backend declares.  Calls outside these are skipped *and reported as skipped*;
    calls inside them must pass.  `max_sources` / `max_dim` are hard limits the backend must
    enforce with a ValueError (never truncate): the suite checks exactly those edges."""

    dtypes: Sequence[str]
    devices: Sequence[str] = ("cpu",)
    ops: frozenset = frozenset(OPS)
    options: frozenset = frozenset(OPTIONS)
    variants: frozenset = frozenset()  # names of attnres_core.config.VARIANT_KINDS
    schedules: frozenset = frozenset(SCHEDULES)
    call_inputs: frozenset = frozenset(CALL_INPUTS)
    fused_kernel: bool = False
    deterministic: bool = True
    max_sources: Optional[int] = None
    max_dim: Optional[int] = None
    # -- design choices a port may declare (each skips or adapts exactly the cases it affects) --
    #: False: the port takes no key-norm gain (`norm_weight`); cases run with `norm_weight=None`
    #: (serve a gain through the query instead: the exact fold u = q * g * scale, spec 2.1).
    gain: bool = True
    #: A fixed logit scale (e.g. 1.0 for a port without `scale`): cases run at this scale, the
    #: rows whose point is another scale are skipped.  None: any scale.
    scale: Optional[float] = None
    #: A fixed key-norm eps, as `scale`.  None: any eps.
    eps: Optional[float] = None
    #: False: forward only (no VJP); every gradient column is skipped with that reason.
    backward: bool = True
    #: D rules besides `max_dim`: D a power of two, D a multiple of this.
    dim_power_of_two: bool = False
    dim_multiple: Optional[int] = None
    #: False: `merge_partial` returns no lse (the merge cases run without `return_lse`).
    merge_lse: bool = True
    #: What `depth_attention` with `out_norm_weight` returns: ("out", "out_normed") as the spec,
    #: or ("out_normed",) for a fused norm that returns only the normed output.
    out_norm_outputs: Tuple[str, ...] = ("out", "out_normed")
    #: The autocast regions the port honours (C3a: torch.autocast's dtypes, e.g. ("bfloat16",
    #: "float16")): calls inside such a region with sources of mixed dtypes (`OpCall.autocast`).
    #: Empty: the framework has no autocast, or the port does not declare it (the rows skip).
    autocast: Tuple[str, ...] = ()
    #: True: the port's probe honours `ProbeCall.sublayer_dtype` (M1a: sublayers returning another
    #: dtype than the stream's; the rows need that dtype declared too).  False: the rows skip.
    sublayer_dtype: bool = False
    #: False: the port does not validate its arguments; a spec error it does not raise is
    #: reported as a validation gap (status "gap", not a failure) instead of a failure.
    validates_inputs: bool = True

    def dim_reason(self, dim: int) -> Optional[str]:
        """Why D = `dim` is outside the declared D rules, or None."""
        if self.max_dim is not None and dim > self.max_dim:
            return f"D = {dim} beyond declared max_dim = {self.max_dim}"
        if self.dim_power_of_two and (dim < 1 or dim & (dim - 1)):
            return f"D = {dim} is not a power of two (declared dim_power_of_two)"
        if self.dim_multiple and dim % self.dim_multiple:
            return f"D = {dim} is not a multiple of {self.dim_multiple} (declared dim_multiple)"
        return None

    def accepts_dim(self, dim: int) -> bool:
        return self.dim_reason(dim) is None


@dataclass
class OpCall:
    """One call of a spec op.

    op: one of OPS.
    inputs: by spec argument name.  depth_attention: "sources" (a list of `[..., D]` arrays, or
      one stacked `[N, ..., D]` array: the adapter must pass the same form to its op), "query",
      "norm_weight" (or None), and only where given "out_norm_weight" (C17; a keyword argument
      of the op).  depth_attention_multi: "sources", "queries", "norm_weights".
      merge_partial: "out1", "lse1", "partial", "query", "norm_weight".
    attrs: keyword arguments of the op (eps, scale, and for depth_attention num_heads,
      activation, key_norm, return_lse, return_weights, and out_norm_eps where given).
    dtype: the floating dtype of every input ("float64", "float32", "float16", "bfloat16").
    input_dtypes: per-input overrides (e.g. {"query": "int32"}); for "sources" either one dtype
      or a list with one per source.  Used by the error tests.
    cotangents: None for forward only; else {"out": ..., "lse": ... (optional), "out_normed":
      ... (with out_norm_weight)} and the adapter also returns every input's gradient.
    """

    op: str
    inputs: Dict[str, Any]
    attrs: Dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    input_dtypes: Dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    strided: bool = False
    cotangents: Optional[Dict[str, np.ndarray]] = None
    #: Per-input memory layouts beyond `strided` (issue 44's layout transforms): input name ->
    #: (layout, axis), layout one of `LAYOUTS`; for list / tuple sources it applies to each source
    #: (axis counted in the source's own axes).  Values are unchanged; an adapter built on
    #: `adapters.base.Adapter` builds these views (`Adapter.layout_array`), others may ignore it.
    layouts: Dict[str, Tuple[str, int]] = field(default_factory=dict)
    #: Cotangents given in another dtype than their output's (issue 44's bad-cotangent rows):
    #: output name -> dtype name.
    cotangent_dtypes: Dict[str, str] = field(default_factory=dict)
    #: The call runs inside the framework's autocast region of this dtype (C3a; None: outside).
    autocast: Optional[str] = None


#: Memory layouts of an input (`OpCall.layouts`): every other element of a buffer twice as wide
#: along the channel / a token / the source axis, a stacked array stored with its first two axes
#: swapped (a KV-cache-like [T, N, D] buffer read as [N, T, D]), a contiguous view at a storage
#: offset (a slice of a larger buffer), and a stride-0 broadcast along the token axes (values
#: equal on every token).
LAYOUTS = ("channel_strided", "token_strided", "source_strided", "transposed", "offset", "expanded")


@dataclass
class OpResult:
    """outputs: "out" (and "out_normed" with out_norm_weight, "lse", "weights" when asked;
      depth_attention_multi always has "lse").
    grads: one entry per differentiable input of the call, keyed like `OpCall.inputs`
      ("sources" in the form it was given: list or stacked); None for a None input.
    inputs_after: every input read back from the backend's native arrays after the call.
    native_dtypes: the dtype name ("float32", "bfloat16", ...) of every native output and gradient
      before read-back, keyed "out", "lse", "weights", "grad.<input>" (a list for list sources),
      so the suite can check C10.3's result dtypes although the arrays come back upcast.
    aliases: names of the outputs whose native memory overlaps any native input (C7a: every
      output is a fresh array; frameworks with immutable arrays return an empty tuple)."""

    outputs: Dict[str, np.ndarray]
    grads: Dict[str, Any] = field(default_factory=dict)
    inputs_after: Dict[str, Any] = field(default_factory=dict)
    native_dtypes: Dict[str, Any] = field(default_factory=dict)
    aliases: tuple = ()


@dataclass
class ProbeCall:
    """A model-level run of the spec's probe network (spec section 6).

    config: `ResidualConfig.to_dict()`; params: the scheme's parameters by name
      (`ResidualConfig.param_shapes`); embedding `[..., D]` (v_0); sublayer_weights `[L, D, D]`
      (f_l(h) = tanh(rmsnorm(h) @ W_l), rmsnorm without gain, eps = config eps).
    schedule: "direct", or "two_phase" (kind="block" only, forward only).
    cotangent: None for forward only; else `[..., D]` and the adapter returns gradients for
      "embedding", "sublayer_weights" and every parameter name.
    mix, scale: the M10 call inputs (None: not given): alpha in [0, 1] blending the standard
      state and the scheme, and a logit scale replacing the config's for this call.
    sublayer_dtype: None (the sublayers return the call's dtype), or the dtype every sublayer
      returns (M1a): v_l = f_l(h_l) computed as usual, then cast to this dtype, as a bfloat16
      sublayer under autocast returns into a float32 stream; the stream, and so `out`, stays in
      the embedding's dtype (`dtype`).  Every array is still given in `dtype`.
    """

    config: Dict[str, Any]
    params: Dict[str, np.ndarray]
    embedding: np.ndarray
    sublayer_weights: np.ndarray
    dtype: str = "float32"
    device: str = "cpu"
    schedule: str = "direct"
    cotangent: Optional[np.ndarray] = None
    mix: Optional[float] = None
    scale: Optional[float] = None
    sublayer_dtype: Optional[str] = None


@dataclass
class ProbeResult:
    """out: the probe's output read back; grads: by name (see `ProbeCall.cotangent`);
    out_dtype: the dtype name of the native `out` before read-back (M1a: the embedding's dtype,
      whatever its sublayers return; None: not reported, which the sublayer_dtype rows fail)."""

    out: np.ndarray
    grads: Dict[str, np.ndarray] = field(default_factory=dict)
    out_dtype: Optional[str] = None


@runtime_checkable
class Backend(Protocol):
    """What the conformance suite needs from a port."""

    name: str

    def is_available(self) -> bool:
        """True when the framework imports and `capabilities()` can be honoured here."""

    def capabilities(self) -> Capabilities:
        ...

    def versions(self) -> Dict[str, str]:
        """Package versions for the report, e.g. {"torch": "2.13.0", "attnres_torch": "0.1.0"}."""

    def call_op(self, call: OpCall) -> OpResult:
        ...

    def call_probe(self, call: ProbeCall) -> ProbeResult:
        ...
