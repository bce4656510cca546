"""The residual schedule of every scheme, written once (spec section 4-5, M1-M9).

A stack has sublayers l = 1..L (every attention and every MLP sublayer is one layer, M1).  The
embedding is v_0 `[..., D]`; sublayer l maps its input h_l to its output v_l = f_l(h_l), and the
residual scheme (`ResidualConfig`) decides how each h_l and the stack's output h_{L+1} are formed
from v_0..v_{l-1}.  Row r = l - 1 of every parameter belongs to sublayer l, row L to the output
aggregation (M4).

`ResidualStream` is that schedule as a small state machine, driven step by step::

    stream = ResidualStream(config, ops, embedding, num_layers=L)
    for f in sublayers:
        stream.push(f(stream.input()))     # h_l = input(), v_l = f_l(h_l)
    out = stream.output()                  # h_{L+1}, before any final norm

and `run_schedule` is exactly that loop.  The stream never touches an array itself: every step
goes through `ops`, a `ResidualOps` object a framework supplies (a few dozen lines: NumPy's
float64 tape, torch, JAX, MLX).  The reference model, the conformance probe, the routers of every
backend and the torch/JAX sequence- and pipeline-parallel wiring all run this one class; a new
residual scheme is added here (and in the spec and the ops it needs), nowhere else.

An optional `ScheduleObserver` sees every depth-attention read (its row, source labels, sources
and depth weights) and every sublayer (its input and output): diagnostics hook in there.

This module is framework-neutral: it imports no array library.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, List, Mapping, Optional, Sequence

from .config import ResidualConfig

Array = Any  # an array of the framework the ops belong to

ADDITIVE_KINDS = ("standard", "scalar", "gated")


class ResidualOps:
    """The primitives the schedule needs; a backend subclasses this and fills them in.

    Shapes: h, v, sources `[..., D]`; queries `[D]` (static) or `[..., D]` (input-dependent).
    Dtypes are the backend's business; the rule all shipped backends follow (C10): the stream
    stays in the embedding's dtype (M1a: `push` casts every v_l to it with `cast_like`), the
    scheme's own parameters are cast to it (`param(..., like=h)`), the depth-attention ops
    compute in float32 (float64 for float64) and round once.
    """

    def __init__(self, params: Optional[Mapping[str, Any]] = None):
        self.params = {} if params is None else params  # name -> array of param_shapes(L, D)

    def param(self, name: str, index, *, like: Optional[Array] = None) -> Array:
        """Row(s) `index` (an int, a tuple of ints or a slice) of parameter `name` (M6); with
        `like`, cast to `like`'s dtype.  None when `params` has no such entry or holds None (a
        gainless "norm_weights")."""
        p = self.params.get(name)
        if p is None:
            return None
        p = p[index]
        return p if like is None else self.cast_like(p, like)

    def cast_like(self, x: Array, like: Array) -> Array:
        """x in like's dtype (the NumPy / JAX / MLX spelling); x itself, or a cast that costs
        nothing, when it already has it (`push` calls it on every v_l)."""
        return x.astype(like.dtype)

    def add(self, a: Array, b: Array) -> Array:
        return a + b

    def mul(self, a: Array, b: Array) -> Array:
        """Elementwise product (a scalar weight or a gate `[..., D]` times a value `[..., D]`)."""
        return a * b

    def to_compute(self, x: Array) -> Array:
        """x in the compute dtype (C10: float32; float64 stays float64).  Default: x as it is."""
        return x

    def blend(self, standard: Array, attended: Array, alpha) -> Array:
        """M10: `(1 - alpha) * standard + alpha * attended`, alpha a Python float in (0, 1) (or
        a 0-d array of the framework), computed in the compute dtype with one cast back (C10):
        in bfloat16 a weakly typed `x * 0.2` would round the coefficients first (0.2 -> 0.2002,
        0.8 -> 0.8008) and the bias compounds over the layers."""
        c = self.to_compute
        return self.cast_like(c(standard) * (1.0 - alpha) + c(attended) * alpha, standard)

    def take(self, x: Array, i: int) -> Array:
        """`x[i]`: one query's row of phase-1 results `[S, ...]`."""
        return x[i]

    def rmsnorm(self, x: Array, eps: float) -> Array:
        """Gainless RMSNorm over the last axis."""
        raise NotImplementedError

    def matmul(self, x: Array, w: Array) -> Array:
        """Right-multiplication `x [..., D_in] @ w [D_in, D_out]`."""
        raise NotImplementedError

    def transpose(self, w: Array) -> Array:
        """`w.T` of a matrix `[a, b]` -> `[b, a]` (M13: the key projection's transpose maps an
        r-dim query to D dims).  Default: `w.T` (NumPy, torch, JAX and MLX all spell it so)."""
        return w.T

    def sigmoid(self, x: Array) -> Array:
        raise NotImplementedError

    def tanh(self, x: Array) -> Array:
        """Elementwise tanh: the probe network's activation (`attnres_core.probe`)."""
        raise NotImplementedError

    def rmsnorm_gain(self, x: Array, weight: Array, eps: float) -> Array:
        """M15 where no depth-attention read forms the input: `rmsnorm(x) * weight` over the
        last axis, weight `[D]` of any floating dtype, in x's dtype.  Default: the gainless
        `rmsnorm` times the weight cast to x's dtype (a backend with a fused RMSNorm overrides)."""
        return self.mul(self.rmsnorm(x, eps), self.cast_like(weight, x))

    def where(self, cond, a: Array, b: Array) -> Array:
        """a where the (possibly traced) boolean scalar cond holds, else b (`FixedResidualStream`)."""
        raise NotImplementedError

    def rows_init(self, first: Array, rows: int) -> Array:
        """A buffer `[rows, ..., D]` in first's dtype: row 0 = first `[..., D]`, the others zero
        (`FixedResidualStream`)."""
        raise NotImplementedError

    def write_row(self, buffer: Array, index, value: Array) -> Array:
        """buffer `[R, ..., D]` with row `index` (an int or a traced integer) replaced by value
        `[..., D]`; a new array, buffer itself unchanged."""
        raise NotImplementedError

    def depth_attention_prefix(self, buffer: Array, count, query: Array,
                               norm_weight: Optional[Array], config: ResidualConfig, *,
                               return_weights: bool, out_norm_weight: Optional[Array] = None) -> tuple:
        """`depth_attention` over the first `count` rows of buffer `[R, ..., D]` (count an int or
        a traced integer, 1 <= count <= R): the other rows are masked and contribute exact zeros
        (weight 0, gradient 0).  Default: the read of the rows as a list (count must be an int;
        source stats None)."""
        rows = [self.take(buffer, i) for i in range(count)]
        return self.depth_attention(rows, [None] * count, query, norm_weight, config,
                                    return_weights=return_weights, out_norm_weight=out_norm_weight)

    def source_stats(self, value: Array, config: ResidualConfig) -> Any:
        """Per-source statistics kept beside a sealed source and handed back to every later
        depth-attention read of it (MLX: its inverse RMS, computed once).  Default: None."""
        return None

    def depth_attention(self, sources: List[Array], stats: List[Any], query: Array,
                        norm_weight: Optional[Array], config: ResidualConfig, *,
                        return_weights: bool, out_norm_weight: Optional[Array] = None) -> tuple:
        """Spec section 2 with config's options: (out `[..., D]`, weights `[N, ...]` (`[N, ...,
        H]` with heads) when return_weights, else None).  stats[i] is `source_stats` of
        sources[i] or None (the running partial sum).  With `out_norm_weight` `[D]` (M15, C17
        with out_norm_eps = config.eps): (out, out_normed `[..., D]`, weights or None)."""
        raise NotImplementedError

    def depth_attention_multi(self, sources: List[Array], stats: List[Any], queries: Array,
                              norm_weights: Optional[Array], config: ResidualConfig) -> tuple:
        """Phase 1 (spec 3.1): (out `[S, ..., D]`, lse `[S, ...]`)."""
        raise NotImplementedError

    def merge_partial(self, out1: Array, lse1: Array, partial: Array, query: Array,
                      norm_weight: Optional[Array], config: ResidualConfig) -> Array:
        """Phase 2 (spec 3.2): merge one query's phase-1 result with the partial sum."""
        raise NotImplementedError


class ScheduleObserver:
    """Receives what a stream computes; every method is optional (default: ignore).

    `wants_weights`: ask the depth-attention ops for the weights (direct schedule only; the
    two-phase schedule never forms them).
    """

    wants_weights = False

    def depth_attention(self, row: int, labels: List[str], sources: List[Array],
                        weights: Optional[Array]) -> None:
        """Row r's read: labels per source ("v3" layer output v_3, "b2" completed block b_2,
        "partial" the running intra-block sum); weights `[N, ...]` or None."""

    def sublayer(self, layer: int, h: Array, v: Array) -> None:
        """Sublayer l = layer took h_l and returned v_l."""


class ResidualStream:
    """One forward pass of the residual scheme `config` over `num_layers` sublayers.

    Args:
      config: the scheme.
      ops: the framework's `ResidualOps`.
      embedding: v_0 `[..., D]`.
      num_layers: L.
      schedule: "direct", or "two_phase" (M9: block, softmax, key norm, one head, static query).
      observer: an optional `ScheduleObserver`.
      mix: M10 progressive introduction, alpha in [0, 1] (attention kinds; None = 1): every
        input is `(1 - alpha) * standard + alpha * attnres`; 0 runs no depth attention at all.
      scale: M10 per-call logit scale replacing `config.scale` (None: keep it).

    State (read-only for callers): `layer` (the next sublayer l), `values` (v_0..v_{l-1}; full,
    window, static; the states h_0..h_{l-1} for hybrid; window with history="summaries": the
    kept history v_0, b_1..b_m, v_{mS+1}..v_{l-1}, labelled by `value_labels`), `blocks`
    (b_0..; block), `partial` (the running block sum or None), `h` (the running state of the
    additive kinds).
    """

    def __init__(self, config: ResidualConfig, ops: ResidualOps, embedding: Array, *,
                 num_layers: int, schedule: str = "direct",
                 observer: Optional[ScheduleObserver] = None, mix: Optional[float] = None,
                 scale: Optional[float] = None):
        if not isinstance(config, ResidualConfig):
            raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
        config.check_schedule(schedule)
        config, self._query_scale = call_scale(config, scale)
        alpha = check_mix(mix, config)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers: expected an int >= 1, got {num_layers!r}")
        if observer is not None and observer.wants_weights and schedule != "direct":
            raise ValueError("observer: depth weights exist only under schedule='direct'")
        self.config, self.ops, self.num_layers = config, ops, num_layers
        self.two_phase = schedule == "two_phase"
        self.observer = observer
        self.layer = 1
        self._embedding = embedding  # M1a: its dtype is the stream's
        self.h = embedding  # additive kinds: h_l
        stats = self._stats(embedding)
        self.values: List[Array] = [embedding]  # static / full / window: v_0..v_{l-1}
        self.value_stats: List[Any] = [stats]
        self.value_labels: List[str] = ["v0"]  # M14: what each kept entry of `values` is
        self.summaries = 0  # M14: m, the complete blocks of outputs kept as sums
        self.blocks: List[Array] = [embedding]  # block: b_0..b_{n-1}
        self.block_stats: List[Any] = [stats]
        self.partial: Optional[Array] = None
        # M10: alpha is None (plain scheme), 0.0 (plain standard) or strictly inside (0, 1);
        # `standard` is the PreNorm state v_0 + ... + v_{l-1} the mix needs.
        self.mix = alpha
        self._standard_only = isinstance(alpha, float) and alpha == 0.0
        self.standard = embedding if alpha is not None else None
        self._phase1 = None  # (out1 [S, ..., D], lse1 [S, ...], first row) of the current block
        self._last_input: Optional[Array] = None

    @classmethod
    def resume(cls, config: ResidualConfig, ops: ResidualOps, *, num_layers: int, layer: int,
               blocks: Sequence[Array], partial: Optional[Array]) -> "ResidualStream":
        """A block stream that starts at sublayer `layer` (direct schedule) holding the completed
        blocks b_0..b_{n-1} and the running partial sum (None at a block boundary): how a
        pipeline stage picks up what its predecessor sent."""
        if config.kind != "block":
            raise ValueError(f"config: resume is for kind='block', got kind={config.kind!r}")
        S = config.block_size
        if not 1 <= layer <= num_layers:
            raise ValueError(f"layer: expected 1 <= layer <= {num_layers}, got {layer}")
        if len(blocks) != (layer - 1) // S + 1 or (partial is None) != ((layer - 1) % S == 0):
            raise ValueError(f"blocks/partial: sublayer {layer} with block size {S} needs "
                             f"{(layer - 1) // S + 1} completed blocks and "
                             f"{'no' if (layer - 1) % S == 0 else 'a'} partial sum; got "
                             f"{len(blocks)} blocks and partial={'None' if partial is None else 'a tensor'}")
        stream = cls(config, ops, blocks[0], num_layers=num_layers)
        stream.layer = layer
        stream.blocks = list(blocks)
        stream.block_stats = [stream._stats(b) for b in blocks]
        stream.partial = partial
        return stream

    # -- helpers -------------------------------------------------------------------------------
    def _stats(self, value: Array) -> Any:
        return self.ops.source_stats(value, self.config) if self.config.is_attention else None

    def _sources(self, layer: int):
        """(sources, stats, labels) of sublayer `layer` (L + 1: the output aggregation)."""
        cfg = self.config
        if cfg.kind == "block":  # M3: [b_0..b_{n-1}] (+ the partial sum inside a block)
            n = len(self.blocks)
            labels = [f"b{j}" for j in range(n)]
            if self.partial is None:
                return list(self.blocks), list(self.block_stats), labels
            return self.blocks + [self.partial], self.block_stats + [None], labels + ["partial"]
        if cfg.history == "summaries":  # M14: v_0, the summaries b_1..b_m, then each later output
            return list(self.values), list(self.value_stats), list(self.value_labels)
        idx = list(range(layer))  # M2 full: [v_0..v_{l-1}]; M12 hybrid: the states [h_0..h_{l-1}]
        if cfg.kind == "window":  # M5: [v_0] + [v_j : max(1, l - W) <= j <= l - 1]
            idx = [0] + list(range(max(1, layer - cfg.window), layer))
        prefix = "h" if cfg.kind == "hybrid" else "v"
        return ([self.values[j] for j in idx], [self.value_stats[j] for j in idx],
                [f"{prefix}{j}" for j in idx])

    def _attend(self, row: int, layer: int, fuse: bool = False) -> tuple:
        """Depth attention of row r (sublayer r + 1; r = L: the output) over the sources of
        `layer` (direct schedule): (out, out_normed with `fuse` (M15) else None)."""
        cfg, ops = self.config, self.ops
        sources, stats, labels = self._sources(layer)
        qrow = cfg.query_row(layer, self.num_layers)  # M11: r, unless queries are shared
        if cfg.query == "static":  # M6: the pseudo-query w_l
            q = ops.param("queries", qrow)
        else:  # M6: q_l = rmsnorm(most recent source) @ W_l, per token
            q = ops.matmul(ops.rmsnorm(sources[-1], cfg.eps),
                           ops.param("query_weights", qrow, like=sources[-1]))
        q, gain = self._query_and_gain(q, qrow)
        want = self.observer is not None and self.observer.wants_weights
        if fuse:  # M15: the row's output norm from the same pass (C17)
            out, normed, weights = ops.depth_attention(sources, stats, q, gain, cfg, return_weights=want,
                                                       out_norm_weight=self._out_norm_weight(row))
        else:
            (out, weights), normed = ops.depth_attention(sources, stats, q, gain, cfg,
                                                         return_weights=want), None
        if self.observer is not None:
            self.observer.depth_attention(row, labels, sources, weights)
        return out, normed

    def _out_norm_weight(self, row: int) -> Array:
        """M15: the pre-norm gain `[D]` of row r (sublayer r + 1; r = L: the output)."""
        return self.ops.param("out_norm_weights", row)

    def _handed(self, h: Array, normed: Optional[Array], row: int) -> Array:
        """What the stream hands on for row r: h itself, or with fuse_out_norm (M15) its
        normed form (the fused op's when a single read formed h, else composed)."""
        if not self.config.fuse_out_norm:
            return h
        if normed is not None:
            return normed
        return self.ops.rmsnorm_gain(h, self._out_norm_weight(row), self.config.eps)

    def _query_and_gain(self, q: Array, rows) -> tuple:
        """(query, gain) of the depth-attention op for row(s) `rows` (an int, or a slice of
        phase-1 rows) and the query q: `q [D]` / `[..., D]` / `[S, D]` and `norm_weights[rows]`.

        M13 (key_rank = r): q is the r-dim q_r and the gain g_r `[r]` is applied after the
        projection, `k_i = (rmsnorm(v_i) @ P) * g_r`; since
        `<q_r, (x @ P) * g_r> = <x, (q_r * g_r) @ P^T>`, the op gets the D-dim query
        `(q_r * g_r) @ P^T` and no gain.  It is formed and kept in the compute dtype (C10: float32,
        float64 for float64; the ops take a query of any floating dtype), so low precision rounds
        q_r at most, not the D-dim query again.  An array call scale (`call_scale`) multiplies
        the query, in the compute dtype."""
        ops = self.ops
        gain = ops.param("norm_weights", rows)
        if self.config.key_rank is not None:
            q = ops.to_compute(q)
            if gain is not None:
                q = ops.mul(ops.to_compute(gain), q)
            P = ops.to_compute(ops.param("key_projection", slice(None)))
            q, gain = ops.matmul(q, ops.transpose(P)), None
        if self._query_scale is not None:  # M10, an array scale: z_i is linear in the query
            q = ops.mul(ops.to_compute(q), self._query_scale)
        return q, gain

    def _weighted_sum(self, row: int) -> Array:
        """M7 static: h = sum_{i <= r} depth_weights[r, i] v_i (DenseFormer-style)."""
        ops = self.ops
        h = None
        for i, v in enumerate(self.values[:row + 1]):
            term = ops.mul(ops.param("depth_weights", (row, i), like=v), v)
            h = term if h is None else ops.add(h, term)
        return h

    def _two_phase_input(self, row: int) -> Array:
        """M9: phase 1 once per block for all its sublayers, phase 2 merged per sublayer."""
        cfg, ops, L = self.config, self.ops, self.num_layers
        qrow = cfg.query_row(row + 1, L)
        if self.partial is None:  # the block's first sublayer: run phase 1 for its queries
            last = min(row + cfg.block_size, L)  # sublayers row+1 .. last
            # M11: one phase-1 query when the block's sublayers share theirs, else one each.
            rows = slice(qrow, cfg.query_row(last, L) + 1)
            queries, gains = self._query_and_gain(ops.param("queries", rows), rows)
            out1, lse1 = ops.depth_attention_multi(list(self.blocks), list(self.block_stats),
                                                   queries, gains, cfg)
            self._phase1 = (out1, lse1, qrow)
            return ops.take(out1, 0)
        out1, lse1, first = self._phase1
        i = qrow - first
        query, gain = self._query_and_gain(ops.param("queries", qrow), qrow)
        return ops.merge_partial(ops.take(out1, i), ops.take(lse1, i), self.partial, query, gain, cfg)

    # -- the protocol --------------------------------------------------------------------------
    def input(self) -> Array:
        """h_l `[..., D]` for the next sublayer l; with fuse_out_norm (M15) the sublayer's
        normed input `rmsnorm(h_l) * out_norm_weights[l - 1]` (h_l stays the stream's)."""
        if self.layer > self.num_layers:
            raise ValueError(f"input: all {self.num_layers} sublayers were already pushed")
        kind, row = self.config.kind, self.layer - 1
        normed = None
        if kind in ADDITIVE_KINDS:
            h = self.h
        elif kind == "static":
            h = self._weighted_sum(row)
        elif self._standard_only:  # M10 at alpha = 0: the standard scheme, no depth attention
            h = self.standard
        elif kind == "block" and self.two_phase:
            h = self._blend(self._two_phase_input(row))
        else:
            h, normed = self._read(row, self.layer)
        self._last_input = h
        return self._handed(h, normed, row)

    def _read(self, row: int, layer: int) -> tuple:
        """(h, normed or None) of a direct read: the blended read under a mix (M10, normed
        later), else the read itself, with its output norm fused when M15 asks for it."""
        if self.mix is not None:
            return self._blend(self._attend(row, layer)[0]), None
        return self._attend(row, layer, fuse=self.config.fuse_out_norm)

    def _blend(self, attended: Array) -> Array:
        """M10: `(1 - alpha) * standard + alpha * attended` (the attended input itself without a
        mix)."""
        if self.mix is None:
            return attended
        return self.ops.blend(self.standard, attended, self.mix)

    def push(self, v: Array) -> None:
        """Record v_l `[..., D]`, the output of sublayer l, in the stream's dtype (M1a: a v_l of
        another dtype, e.g. bfloat16 under torch.autocast, is cast to the embedding's first)."""
        cfg, ops, l = self.config, self.ops, self.layer
        if l > self.num_layers:
            raise ValueError(f"push: all {self.num_layers} sublayers were already pushed")
        row = l - 1
        v = ops.cast_like(v, self._embedding)  # M1a
        if self.observer is not None:
            self.observer.sublayer(l, self._last_input, v)
        if self.standard is not None:  # M10: the PreNorm state beside the scheme's own
            self.standard = ops.add(self.standard, v)
        if cfg.kind in ADDITIVE_KINDS:
            self.h = self._additive_step(self.h, v, row)
        elif cfg.kind == "block":  # M3: the partial sum; sealed at the block's last sublayer
            self.partial = v if self.partial is None else ops.add(self.partial, v)
            if l % cfg.block_size == 0 or l == self.num_layers:
                self.blocks = self.blocks + [self.partial]
                self.block_stats = self.block_stats + [self._stats(self.partial)]
                self.partial = None
        else:
            if cfg.kind == "hybrid":  # M12: the state h_l = (retrieved) input + output
                if self._last_input is None:
                    raise ValueError("push: kind='hybrid' adds v_l to its input h_l: call input() "
                                     "before each push()")
                v = ops.add(self._last_input, v)
            self.values = self.values + [v]
            self.value_stats = self.value_stats + [self._stats(v)]
            self.value_labels = self.value_labels + [f"{'h' if cfg.kind == 'hybrid' else 'v'}{l}"]
            if cfg.history == "summaries":
                self._summarize(l)
        self._last_input = None
        self.layer += 1

    def _additive_step(self, h: Array, v: Array, row) -> Array:
        """M7: h_{l+1} of the additive kinds from h_l, v_l and row r = l - 1 (an int, or a traced
        integer in `FixedResidualStream`)."""
        cfg, ops = self.config, self.ops
        if cfg.kind == "standard":  # M7: h_{l+1} = h_l + v_l
            return ops.add(h, v)
        if cfg.kind == "scalar":  # M7: h_{l+1} = h_l + alpha_l v_l
            return ops.add(h, ops.mul(ops.param("alphas", row, like=v), v))
        # gated, M7: h_{l+1} = h_l + sigmoid(rmsnorm(h_l) @ W_l + b_l) * v_l
        logits = ops.matmul(ops.rmsnorm(h, cfg.eps), ops.param("gate_weights", row, like=h))
        gate = ops.sigmoid(ops.add(logits, ops.param("gate_biases", row, like=h)))
        return ops.add(h, ops.mul(gate, v))

    def _summarize(self, pushed: int) -> None:
        """M14 after v_l (l = pushed): the next reader (sublayer l + 1, or the output) sees block
        n = m + 1 (outputs (n-1)S+1 .. nS) as one sum once nS <= l - W.  The S outputs, kept
        individually right after v_0 and b_1..b_m, are replaced by
        b_n = (..((v_{(n-1)S+1} + v_{(n-1)S+2}) + ..) + v_{nS}) (left to right, as M3's partial)."""
        cfg, ops = self.config, self.ops
        S = cfg.block_size
        while (self.summaries + 1) * S <= pushed - cfg.window:
            first = 1 + self.summaries  # index of v_{mS+1} in `values`
            block = self.values[first:first + S]
            total = block[0]
            for v in block[1:]:
                total = ops.add(total, v)
            self.summaries += 1
            self.values = self.values[:first] + [total] + self.values[first + S:]
            self.value_stats = (self.value_stats[:first] + [self._stats(total)]
                                + self.value_stats[first + S:])
            self.value_labels = (self.value_labels[:first] + [f"b{self.summaries}"]
                                 + self.value_labels[first + S:])

    def output(self) -> Array:
        """h_{L+1} `[..., D]` after all L sublayers (before any final norm); M4: row L.  With
        fuse_out_norm (M15): the final norm's output `rmsnorm(h_{L+1}) * out_norm_weights[L]`."""
        if self.layer != self.num_layers + 1:
            raise ValueError(f"output: {self.layer - 1} of {self.num_layers} sublayers pushed")
        kind, L = self.config.kind, self.num_layers
        if kind in ADDITIVE_KINDS:
            return self.h
        if kind == "static":
            return self._weighted_sum(L)
        if self._standard_only:
            return self._handed(self.standard, None, L)
        return self._handed(*self._read(L, L + 1), L)


FIXED_KINDS = ADDITIVE_KINDS + ("full", "block")


class FixedResidualStream(ResidualStream):
    """The direct schedule over a state of one shape at every sublayer, so a loop over layers
    can be one traced body whatever L is (`jax.lax.scan`): `layer` may be a traced integer.

    Kinds (`FIXED_KINDS`): the additive kinds (state h_l), "full" (M2: a history buffer
    `[L + 1, ..., D]`, row j = v_j, rows >= l not yet written and zero) and "block" (M3: a block
    buffer `[ceil(L / S) + 1, ..., D]`, row 0 = v_0 = b_0, row n = b_n; the running partial sum
    of the current block lives in its own row until it is complete).  A read at sublayer l
    attends the first `count(l)` rows of the buffer (`ResidualOps.depth_attention_prefix`): the
    rows not yet written are masked and contribute exact zeros, so it is exactly the read of
    `ResidualStream` over the same sources in the same order (full: v_0..v_{l-1}; block:
    b_0..b_{n-1} and the partial).  With a mix (M10) the state also holds the PreNorm sum.

    Protocol: as `ResidualStream` (`input`, `push`, `output`); `state` is the tuple of arrays
    that changes from sublayer to sublayer (a scan's carry) and `load(state, layer)` resumes a
    stream at sublayer `layer` (1-based) holding that state.  Not here: the two-phase
    schedule, observers, kinds window / static / hybrid (their sources are not a prefix).
    """

    def __init__(self, config: ResidualConfig, ops: ResidualOps, embedding: Array, *,
                 num_layers: int, mix=None, scale=None):
        if isinstance(config, ResidualConfig) and config.kind not in FIXED_KINDS:
            raise ValueError(f"config: the fixed-shape stream runs kinds {FIXED_KINDS}, got "
                             f"kind={config.kind!r}")
        super().__init__(config, ops, embedding, num_layers=num_layers, mix=mix, scale=scale)
        self.buffer = None
        if self.config.kind in ("full", "block"):
            self.buffer = ops.rows_init(embedding, self.count(num_layers + 1))

    @property
    def state(self) -> tuple:
        """(h, buffer, standard): the arrays that change per sublayer (None where unused)."""
        additive = self.config.kind in ADDITIVE_KINDS
        return (self.h if additive else None, self.buffer, self.standard)

    def load(self, state: tuple, layer) -> None:
        """Resume at sublayer `layer` (an int or a traced integer, 1-based) holding `state`."""
        self.h, self.buffer, self.standard = state
        self.layer = layer
        self._last_input = None

    def count(self, layer):
        """Rows of the buffer that sublayer `layer` (L + 1: the output) reads: full l (v_0..v_{l-1},
        M2); block ceil((l - 1) / S) + 1 (b_0..b_n and the partial sum when inside a block, M3)."""
        if self.config.kind == "full":
            return layer
        S = self.config.block_size
        return (layer - 1 + S - 1) // S + 1

    def _query_row(self, layer):
        """M11 `config.query_row` for a sublayer 1 <= l <= L given as an int or a traced integer."""
        cfg = self.config
        if cfg.query_sharing == "block":
            return (layer - 1) // cfg.block_size
        return 0 if cfg.query_sharing == "stack" else layer - 1

    def _prefix_read(self, row, layer, qrow) -> tuple:
        """(h, normed or None) of sublayer `layer` (row r; its query row qrow): the masked read of
        the buffer's first count(layer) rows, blended under a mix (M10) as `_read` does."""
        cfg, ops = self.config, self.ops
        count = self.count(layer)
        if cfg.query == "static":  # M6
            q = ops.param("queries", qrow)
        else:  # M6: the most recent source is the last row read
            last = ops.take(self.buffer, count - 1)
            q = ops.matmul(ops.rmsnorm(last, cfg.eps), ops.param("query_weights", qrow, like=last))
        q, gain = self._query_and_gain(q, qrow)
        fuse = cfg.fuse_out_norm and self.mix is None
        result = ops.depth_attention_prefix(self.buffer, count, q, gain, cfg, return_weights=False,
                                            out_norm_weight=self._out_norm_weight(row) if fuse else None)
        if fuse:
            return result[0], result[1]
        return self._blend(result[0]), None

    def input(self) -> Array:
        """h_l (or its normed form, M15) for sublayer l = `layer`."""
        kind, layer = self.config.kind, self.layer
        row = layer - 1
        normed = None
        if kind in ADDITIVE_KINDS:
            h = self.h
        elif self._standard_only:  # M10 at alpha = 0
            h = self.standard
        else:
            h, normed = self._prefix_read(row, layer, self._query_row(layer))
        self._last_input = h
        return self._handed(h, normed, row)

    def push(self, v: Array) -> None:
        """Record v_l (M1a: in the stream's dtype): full writes row l, block adds v_l to the
        current block's row (v_l itself at the block's first sublayer)."""
        cfg, ops, layer = self.config, self.ops, self.layer
        v = ops.cast_like(v, self._embedding)  # M1a
        if self.standard is not None:  # M10
            self.standard = ops.add(self.standard, v)
        if cfg.kind in ADDITIVE_KINDS:
            self.h = self._additive_step(self.h, v, layer - 1)
        elif cfg.kind == "full":  # M2
            self.buffer = ops.write_row(self.buffer, layer, v)
        else:  # M3: the partial sum, left to right; complete when the next block starts
            S = cfg.block_size
            slot = (layer - 1) // S + 1
            partial = ops.where((layer - 1) % S == 0, v, ops.add(ops.take(self.buffer, slot), v))
            self.buffer = ops.write_row(self.buffer, slot, partial)
        self._last_input = None
        self.layer = layer + 1

    def output(self) -> Array:
        """h_{L+1} after all L sublayers (M4: row L; M15: normed)."""
        kind, L = self.config.kind, self.num_layers
        if kind in ADDITIVE_KINDS:
            return self.h
        if self._standard_only:
            return self._handed(self.standard, None, L)
        return self._handed(*self._prefix_read(L, L + 1, self.config.query_row(L + 1, L)), L)


def split_result(result, out_norm_weight, return_weights: bool) -> tuple:
    """An op's `out` / `(out, out_normed?, weights?)` as the stream's `(out, weights)` or, with
    out_norm_weight (M15), `(out, out_normed, weights)`; weights None unless asked for."""
    if out_norm_weight is None and not return_weights:
        return result, None
    result = tuple(result)
    weights = result[-1] if return_weights else None
    return (result[0], weights) if out_norm_weight is None else (result[0], result[1], weights)


def check_mix(mix, config: ResidualConfig) -> Optional[float]:
    """M10: None (no mix) or a real alpha in [0, 1] for an attention kind; returns None for
    None or 1 (the plain scheme), else the float alpha (0.0: the plain standard scheme).  A 0-d
    array alpha (a JAX tracer, so one compiled step serves every alpha) is returned as it is:
    it is always blended, and its ends are exact for finite values (1 * s + 0 * a = s)."""
    if mix is None:
        return None
    if not config.is_attention:
        raise ValueError(f"mix: blends standard and depth attention, so it needs an attention "
                         f"kind (full, block, window); got kind={config.kind!r}")
    if not isinstance(mix, (bool, numbers.Real)) and getattr(mix, "shape", None) == ():
        return mix  # a 0-d array (e.g. traced under jax.jit): always blended, range unchecked
    if isinstance(mix, bool) or not isinstance(mix, numbers.Real) or not 0.0 <= float(mix) <= 1.0:
        raise ValueError(f"mix: expected a real number in [0, 1] or None, got {mix!r}")
    return None if float(mix) == 1.0 else float(mix)


def call_scale(config: ResidualConfig, scale) -> tuple:
    """M10: (config, query factor) of a per-call scale.  None or a finite real: (`with_call_scale`,
    None).  A 0-d array (e.g. traced under jax.jit, so one compiled step serves every temperature
    of a schedule): (config with scale 1, the array), and the stream multiplies every query by
    it; the logit `scale * r_i * <q * g, v_i>` is linear in q, so this is the same function
    (rounded differently at the last bit, and differentiable in the scale).  Its value is not
    checked."""
    if not isinstance(scale, (bool, numbers.Real)) and getattr(scale, "shape", None) == ():
        if not config.is_attention:  # no depth-attention logit to scale (as for a float)
            return config, None
        return dataclasses.replace(config, scale=1.0), scale
    return with_call_scale(config, scale), None


def with_call_scale(config: ResidualConfig, scale) -> ResidualConfig:
    """M10: config with `scale` (a finite real) replacing config.scale; None keeps config."""
    if scale is None:
        return config
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number or None, got {scale!r}")
    return dataclasses.replace(config, scale=float(scale))


def run_schedule(config: ResidualConfig, ops: ResidualOps, embedding: Array,
                 sublayers: Sequence[Callable[[Array], Array]], *, schedule: str = "direct",
                 observer: Optional[ScheduleObserver] = None, mix: Optional[float] = None,
                 scale: Optional[float] = None) -> Array:
    """Run the scheme over sublayers f_1..f_L (callables h -> v); returns h_{L+1} `[..., D]`."""
    stream = ResidualStream(config, ops, embedding, num_layers=len(sublayers), schedule=schedule,
                            observer=observer, mix=mix, scale=scale)
    for f in sublayers:
        stream.push(f(stream.input()))
    return stream.output()
