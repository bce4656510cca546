"""Residual schemes around the user's sublayers, as pure JAX functions (spec sections 4-6, M1-M9).

`stack_apply(config, params, embedding, sublayers)` drives user-supplied sublayers (callables
`h [..., D] -> v [..., D]`, from any JAX library: Flax, Equinox, Haiku or plain functions over
pytrees) with the residual scheme `config` (`attnres_core.config.ResidualConfig`).  params is a
dict name -> array shaped exactly as `config.param_shapes(L, D)`; row r = l - 1 belongs to
sublayer l and row L to the output aggregation (M4).  The schedule itself is the shared
`attnres_core.schedule.ResidualStream`, run on `JaxOps`.  Everything here is differentiable and
works under `jit`, `grad`, `vmap` and `checkpoint`.

`probe_forward` is the spec's probe network (`f_l(h) = tanh(rmsnorm(h) @ W[l-1])`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from attnres_core import probe, validation
from attnres_core.config import ResidualConfig
from attnres_core.schedule import (
    FIXED_KINDS,
    FixedResidualStream,
    ScheduleObserver,
    call_scale,
    check_mix,
    run_schedule,
)
from jax.ad_checkpoint import checkpoint_name

from . import _mesh, _scan_full
from .ops import compute_dtype, dtype_name
from .residual_ops import JaxOps

Sublayer = Callable[[jax.Array], jax.Array]

#: The kinds `scan_apply` runs (the fixed-shape stream's): the models built on it
#: (`modules.Transformer`, `checkpoint_hf.LlamaAttnRes`) scan their layers for these by default.
SCAN_KINDS = FIXED_KINDS


def resolve_scan_layers(kind: str, scan_layers: Optional[bool]) -> bool:
    """A model's `scan_layers` argument resolved for the scheme `kind`: None (the default) scans
    where `scan_apply` runs the kind (`SCAN_KINDS`: compile time flat in depth) and unrolls
    elsewhere; False unrolls; True on a kind outside `SCAN_KINDS` is refused, naming the fix."""
    if scan_layers is None:
        return kind in SCAN_KINDS
    if scan_layers and kind not in SCAN_KINDS:
        raise ValueError(f"scan_layers: the layer-scanned form runs {SCAN_KINDS}; scheme {kind!r} "
                         "runs unrolled (scan_layers=False or None)")
    return bool(scan_layers)


def _check(config, params, embedding, num_layers: int, schedule: str) -> None:
    """Config, schedule (M9), embedding `[..., D]` and params names/shapes (M6), at trace time."""
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    config.check_schedule(schedule)
    validation.check_floating("embedding", dtype_name(embedding))
    if embedding.ndim < 1 or embedding.shape[-1] < 1:
        raise ValueError(f"embedding: expected shape [..., D] with D >= 1, got shape {embedding.shape}")
    config.check_params(params, num_layers, embedding.shape[-1], dtype_name)


#: The checkpoint name of every layer output v_l (the depth-attention sources) under `remat`.
SOURCE_NAME = "attnres_source"

REMAT_MODES = (None, "recompute", "offload")


def remat_policy(remat: Optional[str]):
    """The `jax.checkpoint` policy of a memory mode (None: no checkpoint).  "recompute": save
    only the arrays named `SOURCE_NAME` (the layer outputs v_l), recompute every sublayer and
    depth-attention read in the backward (torch's `Recompute`); "offload": the same, with the
    sources moved to pinned host memory between forward and backward (torch's `Offload`; on the
    CPU platform device and host memory are the same memory)."""
    if remat not in REMAT_MODES:
        raise ValueError(f"remat: expected one of {REMAT_MODES}, got {remat!r}")
    if remat is None:
        return None
    if remat == "recompute":
        return jax.checkpoint_policies.save_only_these_names(SOURCE_NAME)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(SOURCE_NAME,),
        offload_src="device", offload_dst="pinned_host")


def _named(f):
    """f with its output v_l named `SOURCE_NAME` for the remat policies."""
    return lambda *args: checkpoint_name(f(*args), SOURCE_NAME)


def _as_scale(scale, embedding):
    """M10: an array scale in the compute dtype (traced under jit: a temperature schedule
    without recompiles); a Python value as it is (checked by the schedule)."""
    if hasattr(scale, "shape"):
        return jnp.asarray(scale, dtype=compute_dtype(embedding.dtype))
    return scale


def stack_apply(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Sublayer], *,
                schedule: str = "direct", observer: Optional[ScheduleObserver] = None,
                mix=None, scale=None, remat: Optional[str] = None):
    """Run the residual scheme `config` over L user-supplied sublayers (spec section 4), on the
    shared schedule (`attnres_core.schedule.run_schedule`).

    Args:
      config: the residual scheme.  params: name -> array of `config.param_shapes(L, D)`.
      embedding: v_0 `[..., D]`.  sublayers: L callables `h [..., D] -> v [..., D]`.
      schedule: "direct" or "two_phase" (M9, see `ResidualConfig.supports_two_phase`); both give the same out.
      observer: an optional `ScheduleObserver` (sees every depth-attention row and sublayer;
        traced values under `jit`).
      mix: M10 progressive introduction, alpha in [0, 1] (None = 1): a Python float (0 runs no
        depth attention) or a 0-d array, e.g. traced under `jit`, so one compiled step serves
        every alpha of a warm-up.
      scale: M10 logit scale for this call: a Python float (static under `jit`) or a 0-d array
        (traced: one compiled step serves every temperature; folded into the queries,
        `attnres_core.schedule.call_scale`).
      remat: None, "recompute" or "offload" (`remat_policy`): the whole stack under one
        `jax.checkpoint` that keeps only the layer outputs v_l.

    Returns: out `[..., D]` (h_{L+1}, before any final norm) in the embedding's dtype.
    """
    if not isinstance(sublayers, (list, tuple)) or not all(callable(f) for f in sublayers):
        raise TypeError("sublayers: expected a list or tuple of callables h -> v")
    if len(sublayers) < 1:
        raise ValueError("sublayers: expected L >= 1 sublayers, got an empty sequence")
    embedding = jnp.asarray(embedding)
    params = {k: jnp.asarray(v) for k, v in params.items()} if isinstance(params, Mapping) else params
    _check(config, params, embedding, len(sublayers), schedule)
    if hasattr(mix, "shape"):  # an array alpha (numpy or JAX, traced under jit), in the compute dtype
        mix = jnp.asarray(mix, dtype=compute_dtype(embedding.dtype))
    scale, policy = _as_scale(scale, embedding), remat_policy(remat)
    if policy is None:
        return run_schedule(config, JaxOps(params), embedding, list(sublayers), schedule=schedule,
                            observer=observer, mix=mix, scale=scale)
    named = [_named(f) for f in sublayers]

    def run(params, embedding, mix, scale):
        return run_schedule(config, JaxOps(params), embedding, named, schedule=schedule,
                            observer=observer, mix=mix, scale=scale)

    return jax.checkpoint(run, policy=policy, static_argnums=_static(mix, scale))(
        params, embedding, mix, scale)


def _static(*values) -> tuple:
    """The argument numbers (after params, embedding) of the Python values among mix, scale."""
    return tuple(2 + i for i, v in enumerate(values) if not hasattr(v, "shape"))


def scan_apply(config: ResidualConfig, params: Mapping, embedding, sublayers: Sequence[Callable],
               layer_params, *, mix=None, scale=None, remat: Optional[str] = None, unroll: int = 1,
               stages: Optional[int] = None, backward: Optional[str] = None, record=None):
    """`stack_apply` as one `jax.lax.scan` over groups of sublayers: the program holds one group
    whatever L is (compile time flat in L), the schedule's state has a fixed shape
    (`attnres_core.schedule.FixedResidualStream`: Full a history buffer `[L + 1, ..., D]`,
    Block `[ceil(L / S) + 1, ..., D]`; every read masks the rows not yet written, which
    contribute exact zeros) and the result is `stack_apply`'s.

    Args:
      config: kinds standard, scalar, gated, full or block (direct schedule).  params: as
        `stack_apply`, of `config.param_shapes(L, D)`.
      embedding: v_0 `[..., D]`.
      sublayers: P callables `f_j(p, h [..., D]) -> v [..., D]`, one period of the stack (a
        transformer block: attention, MLP).
      layer_params: a pytree whose leaves are stacked `[n, ...]`; scan step i hands its slice p
        to every f_j and runs sublayers l = i * P + j + 1, so L = n * P.
      mix, scale: M10 as in `stack_apply`.
      remat: None, "recompute" or "offload" (`remat_policy`) on the scan body: the backward
        keeps each step's carry (the schedule's state) and the layer outputs, and recomputes the
        rest.
      unroll: `lax.scan`'s unroll.
      stages: the scan is split into this many consecutive scans (None: 4 for kind="full", else
        1), each holding only the buffer rows its sublayers touch: the rows read per sublayer
        are ~(stages + 1) / (2 stages) of L instead of L, each stage one more body in the program.
      backward: how the gradient of a Full or Block stack is formed.  "fused" (kind full with
        static queries, no M13 keys, remat None or "recompute"; `attnres_jax._scan_full`): the
        forward keeps the final buffer, each row's inverse RMS (computed once, when the row is
        written), each read's weights and logits and each sublayer's own VJP residuals (with
        remat="recompute" only its input), and a hand-written reverse scan adds every read's
        gradient to the buffer's cotangent in place: O(L) buffer rows, two passes over the
        history per read in each direction.  "replay": the forward keeps only the final
        buffer (and, per step, the small carries: the open block's partial row, the M10 PreNorm
        sum), and the backward is a reverse scan that rebuilds each step's entry buffer from it
        and takes that step's VJP: O(L) saved rows instead of a buffer per step (O(L^2)), at the
        cost of one more forward of each step (remat "recompute" is then implied).  "scan":
        `lax.scan`'s own autodiff of the shared schedule, which saves every step's carry.  None
        (default): "fused" for full where it runs (else "scan"), "replay" for block
        (docs/benchmarks.md).  remat="offload" always uses "scan".
      record: None, or statistics carried out of the scan (a monitor on the scanned stack, e.g.
        `training.DepthMonitor`'s observer): an object with `read_stats(weights [R, ...])` and
        `sublayer_stats(h, v)`, each returning a pytree of fixed-shape arrays (outside the
        gradient).  Every read's weights (the masked read's over the whole buffer, R rows, the
        rows not read exactly 0) and every sublayer's input h_l (before its pre-norm) and output
        v_l go through them inside the scan body; the results come out as the scan's outputs,
        stacked over the steps, so the program still holds one group whatever L is.  Runs with
        backward "scan" (None or "scan"; the others are refused).

    Returns: out `[..., D]` (h_{L+1}, before any final norm) in the embedding's dtype; with
    `record`, `(out, recorded)`: recorded = {"reads": P pytrees of `read_stats` stacked `[n, ...]`
    (row i * P + j of sublayer j of step i; empty where the stack reads nothing: additive kinds,
    mix 0), "sublayers": P pytrees of `sublayer_stats` stacked `[n, ...]`, "output": the output
    read's `read_stats` or None}.

    Under Explicit mesh axes (`jax.make_mesh`'s default) the scan runs with them made Auto
    (`_mesh`: XLA places the buffers and the sublayers' intermediates; the sublayers see Auto
    axes) and out is typed as the embedding is.
    """
    if not isinstance(sublayers, (list, tuple)) or not sublayers or not all(callable(f) for f in sublayers):
        raise TypeError("sublayers: expected a non-empty list or tuple of callables (p, h) -> v")
    values = {"params": params, "embedding": embedding, "layer_params": layer_params, "mix": mix, "scale": scale}
    if hasattr(embedding, "shape") and _mesh.explicit_mesh(*jax.tree_util.tree_leaves(values)) is not None:
        tok, channels = _mesh.token_specs(embedding)
        if record is not None:
            raise ValueError("record: not under Explicit mesh axes; call scan_apply inside "
                             "jax.sharding.auto_axes (as Transformer does)")
        return _mesh.auto_arrays(
            lambda **v: scan_apply(config, v["params"], v["embedding"], sublayers, v["layer_params"], mix=v["mix"],
                                   scale=v["scale"], remat=remat, unroll=unroll, stages=stages, backward=backward),
            values, _mesh.P(*tok, channels))
    leaves = jax.tree_util.tree_leaves(layer_params)
    if not leaves or any(jnp.ndim(x) < 1 for x in leaves) or len({jnp.shape(x)[0] for x in leaves}) != 1:
        raise ValueError("layer_params: expected a pytree of arrays stacked over one leading axis [n, ...], "
                         f"got leaf shapes {[jnp.shape(x) for x in leaves]}")
    n, period = jnp.shape(leaves[0])[0], len(sublayers)
    embedding = jnp.asarray(embedding)
    params = {k: jnp.asarray(v) for k, v in params.items()} if isinstance(params, Mapping) else params
    _check(config, params, embedding, n * period, "direct")
    if hasattr(mix, "shape"):
        mix = jnp.asarray(mix, dtype=compute_dtype(embedding.dtype))
    scale = _as_scale(scale, embedding)
    stream = FixedResidualStream(config, _ops(params, record), embedding, num_layers=n * period,
                                 mix=mix, scale=scale)
    if backward is not None and (not isinstance(backward, str) or backward not in SCAN_BACKWARDS):
        raise ValueError(f"backward: expected one of {SCAN_BACKWARDS} or None, got {backward!r}")
    if record is not None:
        if backward not in (None, "scan"):
            raise ValueError(f"backward: a recorded scan (record=) runs backward 'scan'; got {backward!r}")
        backward = "scan"
    rows_all = None if stream.buffer is None else stream.buffer.shape[0]
    called, query_scale = call_scale(config, scale)
    alpha = check_mix(mix, called)
    why_not = _scan_full.unsupported(config, alpha, remat)
    if backward is None:
        backward = "replay" if config.kind == "block" else ("fused" if why_not is None else "scan")
    stages = min(n, 4 if config.kind == "full" else 1) if stages is None else stages
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n:
        raise ValueError(f"stages: expected an int in [1, {n}] (the scan steps) or None, got {stages!r}")
    if backward == "fused":
        if why_not is not None:
            raise ValueError(f"backward='fused' runs kind='full' with static queries, remat None or "
                             f"'recompute' and no M13 keys; got {why_not}")
        remat_policy(remat)
        return _scan_full.full_scan(
            called, embedding, _fused_queries(called, params, n * period, embedding.dtype, query_scale),
            list(sublayers), layer_params, mix=alpha, stages=stages, unroll=unroll, remat=remat,
            out_norm_weights=params.get("out_norm_weights") if config.fuse_out_norm else None)
    replay = backward == "replay" and remat != "offload" and stream.buffer is not None
    policy = remat_policy(remat)  # checks remat in every case
    if replay:  # the replay recomputes each step itself: no checkpoint policy on top
        policy = None
    fs = list(sublayers) if policy is None else [_named(f) for f in sublayers]
    # The traced call inputs travel as explicit arguments of each step (the replayed scan's
    # custom VJP differentiates only its arguments); Python values stay static.
    traced = (params, embedding, mix if hasattr(mix, "shape") else None,
              scale if hasattr(scale, "shape") else None)

    def step(inputs, state, i, p):
        """One scan step: sublayers i * P + 1 .. i * P + P from `state`; returns the next state
        (with `record`: and the step's statistics)."""
        p_router, emb, mix_t, scale_t = inputs
        ops = _ops(p_router, record)
        s = FixedResidualStream(config, ops, emb, num_layers=n * period,
                                mix=mix if mix_t is None else mix_t, scale=scale if scale_t is None else scale_t)
        s.load(state, i * period + 1)
        if record is None:
            for f in fs:
                s.push(f(p, s.input()))
            return s.state
        reads, subs = [], []
        for f in fs:
            x = s.input()
            h, v = s._last_input, ops.cast_like(f(p, x), emb)  # as the unrolled stream's observer sees them
            reads += [record.read_stats(_padded(w, rows_all)) for w in ops.take_weights()]
            subs.append(record.sublayer_stats(h, v))
            s.push(v)
        return s.state, (reads, subs)

    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    state, start, recorded = stream.state, 0, []
    for stage in range(stages):
        stop = n * (stage + 1) // stages
        h, buffer, standard = state
        rows = buffer if buffer is None else buffer[:stream.count(stop * period + 1)]  # rows touched
        stage_params = jax.tree_util.tree_map(lambda x: x[start:stop], layer_params)
        if replay:
            h, rows, standard = _replayed_scan(step, traced, (h, rows, standard), start, stage_params,
                                               _entry_row(config, period), unroll)
        elif record is not None:
            (h, rows, standard), ys = jax.lax.scan(
                lambda c, x: step(traced, c, *x), (h, rows, standard),
                (jnp.arange(start, stop), stage_params), unroll=unroll)
            recorded.append(ys)
        else:
            (h, rows, standard), _ = jax.lax.scan(
                lambda c, x: (step(traced, c, *x), None), (h, rows, standard),
                (jnp.arange(start, stop), stage_params), unroll=unroll)
        if buffer is not None:  # the rows back into the buffer (no copy when the stage held all)
            buffer = rows if rows.shape[0] == buffer.shape[0] else buffer.at[:rows.shape[0]].set(rows)
        state = (h, buffer, standard)
        start = stop
    stream.load(state, n * period + 1)
    out = stream.output()
    if record is None:
        return out
    reads, subs = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *recorded)
    final = stream.ops.take_weights()
    return out, {"reads": reads, "sublayers": subs,
                 "output": record.read_stats(_padded(final[0], rows_all)) if final else None}


SCAN_BACKWARDS = ("fused", "replay", "scan")


class _RecordingOps(JaxOps):
    """`JaxOps` whose masked reads also form their weights and keep them (`take_weights`) for a
    recorded scan; the stream gets what it asked for."""

    def __init__(self, params=None):
        super().__init__(params)
        self._weights = []

    def depth_attention_prefix(self, buffer, count, query, norm_weight, config, *, return_weights,
                               out_norm_weight=None):
        result = super().depth_attention_prefix(buffer, count, query, norm_weight, config, return_weights=True,
                                                out_norm_weight=out_norm_weight)
        self._weights.append(result[-1])
        return tuple(result[:-1]) + ((result[-1] if return_weights else None),)

    def take_weights(self) -> list:
        """The weights of the reads since the last call."""
        out, self._weights = self._weights, []
        return out


def _ops(params, record):
    return JaxOps(params) if record is None else _RecordingOps(params)


def _padded(weights, rows: int):
    """Masked-read weights `[R', ...]` of a stage's rows, zero-padded to the buffer's R rows."""
    return jnp.pad(weights, [(0, rows - weights.shape[0])] + [(0, 0)] * (weights.ndim - 1))


def _fused_queries(config: ResidualConfig, params: Mapping, num_layers: int, dtype, query_scale):
    """`[L + 1, D]` in the compute dtype: row l - 1 = q * g of sublayer l's read (row L: the
    output's), q the M11 query row times an array call scale, g its key-norm gain (C10: as
    `_query_and_gain` and the op's query side form them)."""
    ct = compute_dtype(dtype)
    rows = jnp.asarray([config.query_row(l, num_layers) for l in range(1, num_layers + 2)])
    q = jnp.take(jnp.asarray(params["queries"]), rows, axis=0).astype(ct)
    if query_scale is not None:
        q = q * query_scale
    gain = params.get("norm_weights")
    return q if gain is None else q * jnp.take(jnp.asarray(gain), rows, axis=0).astype(ct)


def _entry_row(config: ResidualConfig, period: int) -> Callable:
    """i -> (r, open): at the entry of scan step i (sublayer l = i * P + 1) the buffer rows < r
    are final (written once, so equal to the final buffer's) and the rows > r not yet written
    (zero, and masked by every read of the step); row r is written by this step (full: row l)
    or, for block (`open`), holds the running partial of the block this step continues (M3),
    which the replay saves."""
    if config.kind == "full":
        return lambda i: (i * period + 1, False)
    S = config.block_size
    return lambda i: ((i * period) // S + 1, True)


def _replayed_scan(step: Callable, inputs, state: tuple, start: int, layer_params, entry_row: Callable,
                   unroll: int) -> tuple:
    """`lax.scan` of `state = step(inputs, state, i, p_i)` over i = start, start + 1, ... and the
    slices p_i of `layer_params` (leaves `[n, ...]`), whose backward replays each step from the
    final buffer instead of keeping every step's carry (`scan_apply(backward="replay")`).

    state: (h, buffer `[R, ..., D]`, standard), h / standard None or `[..., D]`.  Values and
    gradients are those of the plain scan: the replayed step sees the rows it read in the forward
    (the final buffer's rows < r, the saved partial at r, `entry_row`) and masks the later rows
    as the forward did (weight and gradient exactly 0 for finite rows; a non-finite buffer means
    a non-finite loss either way).
    Closed-over traced values of the user's sublayers are hoisted into explicit arguments
    (`jax.closure_convert`), so their gradients flow as well.
    """
    n = jax.tree_util.tree_leaves(layer_params)[0].shape[0]
    p0 = jax.tree_util.tree_map(lambda x: x[0], layer_params)
    converted, consts = jax.closure_convert(
        lambda inputs, state, i, p: step(inputs, state, i, p), inputs, state, jnp.int32(start), p0)

    def forward(args, state, layer_params):
        inputs, consts = args

        def body(carry, x):
            i, p = x
            h, buffer, standard = carry
            r, is_open = entry_row(i)
            kept = (h, jax.lax.dynamic_index_in_dim(buffer, r, 0, keepdims=False) if is_open else None, standard)
            return converted(inputs, carry, i, p, *consts), kept

        steps = (jnp.arange(start, start + n, dtype=jnp.int32), layer_params)
        return jax.lax.scan(body, state, steps, unroll=unroll)

    @jax.custom_vjp
    def run(args, state, layer_params):
        return forward(args, state, layer_params)[0]

    def run_fwd(args, state, layer_params):
        final, kept = forward(args, state, layer_params)
        return final, (args, layer_params, final[1], kept)

    def run_bwd(res, d_final):
        (inputs, consts), layer_params, buffer, kept = res

        def body(carry, x):
            d_state, d_args = carry
            i, p, (h, partial, standard) = x
            r, is_open = entry_row(i)
            # The step's entry buffer: the rows < r are the final buffer's; the rows > r hold
            # later outputs where the forward had zeros, but every read of this step masks them
            # (num_valid: weight exactly 0, gradient exactly 0 for finite rows), so the step
            # computes the same values; masking them here instead cost a buffer copy per step.
            # Row r is written by the step (full) or holds the saved partial (block).
            entry = jax.lax.dynamic_update_index_in_dim(buffer, partial.astype(buffer.dtype), r, 0) \
                if is_open else buffer
            _, vjp = jax.vjp(lambda a, s, p: converted(a[0], s, i, p, *a[1]), (inputs, consts),
                             (h, entry, standard), p)
            d_a, d_s, d_p = vjp(d_state)
            return (d_s, jax.tree_util.tree_map(jnp.add, d_args, d_a)), d_p

        zeros = jax.tree_util.tree_map(jnp.zeros_like, (inputs, consts))
        steps = (jnp.arange(start, start + n, dtype=jnp.int32), layer_params, kept)
        (d_state, d_args), d_layer_params = jax.lax.scan(body, (d_final, zeros), steps, reverse=True,
                                                         unroll=unroll)
        return d_args, d_state, d_layer_params

    run.defvjp(run_fwd, run_bwd)
    return run((inputs, consts), state, layer_params)


def probe_sublayers(sublayer_weights, eps: float, *, prenorm: bool = True) -> list:
    """The probe's L sublayers `f_l(h) = tanh(rmsnorm(h, eps) @ W[l-1])` on `JaxOps`
    (`attnres_core.probe.probe_sublayers`, with eps and fuse_out_norm = not prenorm); W `[L, D, D]`."""
    config = ResidualConfig(eps=eps, fuse_out_norm=not prenorm)
    return probe.probe_sublayers(config, JaxOps(), jnp.asarray(sublayer_weights))


def probe_forward(config: ResidualConfig, params: Mapping, embedding, sublayer_weights, *,
                  schedule: str = "direct", mix=None, scale: Optional[float] = None):
    """The spec's probe network (spec section 6; the shared `attnres_core.probe` on `JaxOps`):
    embedding `[..., D]`, sublayer_weights `[L, D, D]`; returns out `[..., D]`."""
    w, embedding = jnp.asarray(sublayer_weights), jnp.asarray(embedding)
    probe.check_sublayer_weights(w, embedding.shape[-1] if embedding.ndim else 0, dtype_name)
    return stack_apply(config, params, embedding, probe.probe_sublayers(config, JaxOps(), w),
                       schedule=schedule, mix=mix, scale=scale)
