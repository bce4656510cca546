"""Residual-scheme configuration and parameter layout (spec section 5, constraints M1-M9).

`ResidualConfig` is the small serializable description of every residual variant of the spec.
It is shared by every backend (backends depend on `attnres-numpy` for it) so that a config written
by one framework reads back in another: `ResidualConfig.from_dict(cfg.to_dict())`.

Layers are 1-based sublayers l = 1..L (every attention and every MLP sublayer is one layer,
M1).  Parameter arrays are indexed by row r = l - 1 for sublayer l, and row L for the final
output aggregation (M6).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from .validation import check_floating

KINDS = ("standard", "scalar", "gated", "static", "full", "block", "window", "hybrid")
ATTENTION_KINDS = ("full", "block", "window", "hybrid")
QUERY_MODES = ("static", "input")
QUERY_SHARING = ("none", "block", "stack")
HISTORY = ("drop", "summaries")
SCHEDULES = ("direct", "two_phase")

#: The named variants of the spec's conformance matrix and the config each one means
#: (block_size / window are filled in by the caller where needed).
VARIANT_KINDS: Dict[str, dict] = {
    "standard": dict(kind="standard"),
    "scalar": dict(kind="scalar"),
    "gated": dict(kind="gated"),
    "static": dict(kind="static"),
    "full": dict(kind="full"),
    "block": dict(kind="block"),
    "window": dict(kind="window"),
    "input_query": dict(kind="full", query="input"),
    "sigmoid": dict(kind="full", activation="sigmoid"),
    "no_key_norm": dict(kind="full", key_norm=False),
    "multihead": dict(kind="block", num_heads=2),
    "shared_queries": dict(kind="block", query_sharing="block"),
    "hybrid": dict(kind="hybrid"),
    "low_rank_keys": dict(kind="full", key_rank=4),
    "compressed_history": dict(kind="window", window=1, block_size=2, history="summaries"),
    "fused_out_norm": dict(kind="full", fuse_out_norm=True),
}


@dataclass(frozen=True)
class ResidualConfig:
    """How sublayer inputs are formed from earlier outputs.

    kind: "standard" (PreNorm h + f(h)), "scalar" (h + a_l f(h)), "gated"
      (h + sigmoid(rmsnorm(h) @ W_l + b_l) * f(h)), "static" (DenseFormer-style learned scalars
      over all sources), "full", "block" or "window" (depth attention; spec section 4), or
      "hybrid" (depth attention over the hidden states, whose residual path is kept, M12).
    block_size: sublayers per block (kind="block"), S >= 1; the last block may be shorter.  With
      kind="window", history="summaries": the size of the summary blocks (M14).
    window: the W most recent layer outputs attended besides the embedding (kind="window").
    query: "static" (pseudo-query w_l) or "input" (q_l = rmsnorm(most recent source) @ W_l).
    activation: "softmax" or "sigmoid" (unnormalized weights).
    key_norm: RMS-normalize keys (False: keys are the raw sources, times the gain).
    num_heads: H >= 1; D splits into H heads that attend independently.
    query_sharing: "none" (a query and gain per sublayer), "block" (one per block, kind="block")
      or "stack" (one for every sublayer); the output aggregation keeps its own (M11).
    eps: epsilon of every RMSNorm in the scheme (key norm, query input norm, gate input norm).
    scale: logit scale (1.0 = the paper).
    key_rank: None, or r >= 1 (attention kinds, one head): low-rank keys
      `(rmsnorm(v_i) @ key_projection) * g_l` of r dims, one `key_projection [D, r]` for the
      stack, queries and gains of r dims (M13); r <= D is checked where D is known
      (`param_shapes`).
    history: kind="window" only: "drop" (outputs older than the window are not attended, M5) or
      "summaries" (they are kept as sums of complete blocks of `block_size` outputs, M14).
    fuse_out_norm: attention kinds: the scheme owns the pre-norm gains of every sublayer's input
      and of the output, `out_norm_weights [L + 1, D]`; the stream hands sublayer l
      `rmsnorm(h_l) * out_norm_weights[l - 1]` (from the depth-attention pass itself where h_l is
      one read, C17) and returns `rmsnorm(h_{L+1}) * out_norm_weights[L]` (M15).
    """

    kind: str = "full"
    block_size: Optional[int] = None
    window: Optional[int] = None
    query: str = "static"
    activation: str = "softmax"
    key_norm: bool = True
    num_heads: int = 1
    eps: float = 1e-6
    scale: float = 1.0
    query_sharing: str = "none"
    key_rank: Optional[int] = None
    history: str = "drop"
    fuse_out_norm: bool = False

    def __post_init__(self):
        self.validate()

    # -- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ResidualConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    @classmethod
    def variant(cls, name: str, **overrides) -> "ResidualConfig":
        """The config of a named conformance variant (see VARIANT_KINDS), with overrides."""
        if name not in VARIANT_KINDS:
            raise ValueError(f"variant: unknown name {name!r}; known: {sorted(VARIANT_KINDS)}")
        fields = dict(VARIANT_KINDS[name])
        fields.update(overrides)
        if fields["kind"] == "block" and fields.get("block_size") is None:
            fields["block_size"] = 2
        if fields["kind"] == "window" and fields.get("window") is None:
            fields["window"] = 2
        if fields.get("history") == "summaries" and fields.get("block_size") is None:
            fields["block_size"] = 2
        return cls(**fields)

    # -- checks ------------------------------------------------------------------------------
    @property
    def is_attention(self) -> bool:
        return self.kind in ATTENTION_KINDS

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        for name in ("block_size", "window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise TypeError(f"{name}: expected an int or None, got {type(value).__name__} {value!r}")
        if self.history not in HISTORY:
            raise ValueError(f"history: expected one of {HISTORY}, got {self.history!r}")
        if self.history == "summaries" and self.kind != "window":
            raise ValueError(f"history: 'summaries' keeps the outputs older than the window as block "
                             f"sums, so it needs kind='window'; got kind={self.kind!r}")
        summaries = self.history == "summaries"  # M14: block_size sizes the summary blocks
        if self.kind == "block" or summaries:
            if self.block_size is None or self.block_size < 1:
                need = "kind='block'" if self.kind == "block" else "history='summaries'"
                raise ValueError(f"block_size: {need} needs block_size >= 1, got {self.block_size!r}")
        elif self.block_size is not None:
            raise ValueError(f"block_size: only meaningful for kind='block' (or kind='window' with "
                             f"history='summaries'), got kind={self.kind!r}")
        if self.kind == "window":
            if self.window is None or self.window < 1:
                raise ValueError(f"window: kind='window' needs window >= 1, got {self.window!r}")
        elif self.window is not None:
            raise ValueError(f"window: only meaningful for kind='window', got kind={self.kind!r}")
        if self.query not in QUERY_MODES:
            raise ValueError(f"query: expected one of {QUERY_MODES}, got {self.query!r}")
        if self.activation not in ("softmax", "sigmoid"):
            raise ValueError(f"activation: expected 'softmax' or 'sigmoid', got {self.activation!r}")
        if not isinstance(self.key_norm, bool):
            raise TypeError(f"key_norm: expected a bool, got {self.key_norm!r}")
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, numbers.Integral) or self.num_heads < 1:
            raise ValueError(f"num_heads: expected an int >= 1, got {self.num_heads!r}")
        if self.key_rank is not None:  # M13
            if (isinstance(self.key_rank, bool) or not isinstance(self.key_rank, numbers.Integral)):
                raise TypeError(f"key_rank: expected an int or None, got "
                                f"{type(self.key_rank).__name__} {self.key_rank!r}")
            if self.key_rank < 1:
                raise ValueError(f"key_rank: expected an int >= 1 or None, got {self.key_rank!r}")
        if not self.is_attention and (self.query != "static" or self.activation != "softmax"
                                      or not self.key_norm or self.num_heads != 1
                                      or self.query_sharing != "none" or self.key_rank is not None):
            raise ValueError(
                f"kind={self.kind!r} has no depth attention: query, activation, key_norm, "
                "num_heads, key_rank and query_sharing must keep their defaults"
            )
        if self.key_rank is not None and self.num_heads != 1:
            raise ValueError(f"key_rank: low-rank keys project the whole key (M13), so they need "
                             f"num_heads=1; got num_heads={self.num_heads}")
        if not isinstance(self.fuse_out_norm, bool):
            raise TypeError(f"fuse_out_norm: expected a bool, got {self.fuse_out_norm!r}")
        if self.fuse_out_norm and not self.is_attention:
            raise ValueError(f"fuse_out_norm: the output norm is fused into depth attention (M15), "
                             f"so it needs an attention kind {ATTENTION_KINDS}; got kind={self.kind!r}")
        if self.query_sharing not in QUERY_SHARING:
            raise ValueError(f"query_sharing: expected one of {QUERY_SHARING}, got {self.query_sharing!r}")
        if self.query_sharing == "block" and self.kind != "block":
            raise ValueError(f"query_sharing: 'block' shares a query per block, so it needs "
                             f"kind='block'; got kind={self.kind!r}")
        for name in ("eps", "scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite real number, got {value!r}")
        if self.eps <= 0:
            raise ValueError(f"eps: expected eps > 0, got {self.eps!r}")

    @property
    def supports_two_phase(self) -> bool:
        """M9: the two-phase schedule exists for block, softmax, key-normed, one-head, static-query
        configs."""
        return (self.kind == "block" and self.activation == "softmax" and self.key_norm
                and self.num_heads == 1 and self.query == "static")

    def check_schedule(self, schedule: str) -> None:
        """M9: schedule is one of SCHEDULES, and "two_phase" only where `supports_two_phase`."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
        if schedule == "two_phase" and not self.supports_two_phase:
            raise ValueError(
                "schedule: 'two_phase' needs kind='block', activation='softmax', key_norm=True, "
                f"num_heads=1 and query='static'; got {self}"
            )

    # -- parameters --------------------------------------------------------------------------
    def query_rows(self, num_layers: int) -> int:
        """M11: rows of `queries`/`query_weights`/`norm_weights`: L + 1 (one per sublayer and the
        output), ceil(L / S) + 1 (query_sharing="block") or 2 (query_sharing="stack")."""
        if self.query_sharing == "block":
            return -(-num_layers // self.block_size) + 1
        return 2 if self.query_sharing == "stack" else num_layers + 1

    def query_row(self, layer: int, num_layers: int) -> int:
        """M11: the query/gain row of sublayer `layer` (1-based; L + 1 = the output aggregation)."""
        if layer == num_layers + 1:
            return self.query_rows(num_layers) - 1
        if self.query_sharing == "block":
            return (layer - 1) // self.block_size
        return 0 if self.query_sharing == "stack" else layer - 1

    def param_shapes(self, num_layers: int, dim: int) -> Dict[str, Tuple[int, ...]]:
        """Names and shapes of the scheme's parameters for L = num_layers sublayers of width D.

        full/block/window/hybrid: "queries" [R, D] (query="static") or "query_weights" [R, D, D]
          (query="input"), and "norm_weights" [R, D], R = `query_rows(L)` (L + 1 unless queries
          are shared, M11); the last row is the output aggregation.  With key_rank = r (M13) the
          queries are [R, r] / [R, D, r], the gains [R, r], plus one "key_projection" [D, r] for
          the stack.
        scalar: "alphas" [L].  gated: "gate_weights" [L, D, D], "gate_biases" [L, D].
        static: "depth_weights" [L+1, L+1], row r uses columns 0..r (the rest is unused).
        standard: none.
        fuse_out_norm (M15): also "out_norm_weights" [L + 1, D], one pre-norm gain per sublayer
          input and one for the output (never shared, whatever query_sharing says).
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or num_layers < 1:
            raise ValueError(f"num_layers: expected an int >= 1, got {num_layers!r}")
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
            raise ValueError(f"dim: expected an int >= 1, got {dim!r}")
        L, D = int(num_layers), int(dim)
        if self.is_attention and D % self.num_heads:
            raise ValueError(f"num_heads: D = {D} is not divisible by num_heads = {self.num_heads}")
        if self.key_rank is not None and self.key_rank > D:
            raise ValueError(f"key_rank: expected 1 <= key_rank <= D = {D}, got {self.key_rank}")
        if self.kind == "standard":
            return {}
        if self.kind == "scalar":
            return {"alphas": (L,)}
        if self.kind == "gated":
            return {"gate_weights": (L, D, D), "gate_biases": (L, D)}
        if self.kind == "static":
            return {"depth_weights": (L + 1, L + 1)}
        R = self.query_rows(L)
        Q = D if self.key_rank is None else self.key_rank  # M13: queries and gains live in r dims
        shapes = {"queries": (R, Q)} if self.query == "static" else {"query_weights": (R, D, Q)}
        shapes["norm_weights"] = (R, Q)
        if self.key_rank is not None:
            shapes["key_projection"] = (D, self.key_rank)
        if self.fuse_out_norm:  # M15: the pre-norm gains of sublayers 1..L and of the output
            shapes["out_norm_weights"] = (L + 1, D)
        return shapes

    def check_params(self, params, num_layers: int, dim: int,
                     dtype_name: Callable[[object], str]) -> None:
        """M6: params maps exactly the names of `param_shapes(L, D)` to floating arrays of those
        shapes.  dtype_name: the caller's array -> canonical dtype name ("float32", ...), so every
        framework raises the same errors."""
        shapes = self.param_shapes(num_layers, dim)
        if not isinstance(params, Mapping):
            raise TypeError(f"params: expected a mapping name -> array, got {type(params).__name__}")
        if set(params) != set(shapes):
            raise ValueError(
                f"params: expected names {sorted(shapes)} for kind={self.kind!r}, query={self.query!r}; "
                f"got {sorted(params)}"
            )
        for name, shape in shapes.items():
            value = params[name]
            check_floating(f"params[{name!r}]", dtype_name(value))
            got = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
            if got != shape:
                raise ValueError(
                    f"params[{name!r}]: expected shape {shape} for L = {num_layers} sublayers and "
                    f"D = {dim}, got shape {got}"
                )

    def init_params(self, num_layers: int, dim: int) -> Dict[str, np.ndarray]:
        """The spec's initialization (M8): queries and projections zero, gains one, alphas one,
        gate weights and biases zero, static depth weights one on and below the diagonal, the
        key projection (M13) the first r columns of the identity, I[:, :r]."""
        params = {}
        for name, shape in self.param_shapes(num_layers, dim).items():
            if name in ("norm_weights", "alphas", "out_norm_weights"):
                params[name] = np.ones(shape)
            elif name == "depth_weights":
                params[name] = np.tril(np.ones(shape))
            elif name == "key_projection":
                params[name] = np.eye(*shape)
            else:
                params[name] = np.zeros(shape)
        return params
