"""Training tools for JAX: stability schedules as optax schedules, a depth-weight collapse monitor
on the schedule's observer, and the FLA / Kimi K3 checkpoint converters (needs the `flax` extra
for the monitor's NNX actions; optax for `query_lr_scale`).

What is arithmetic or parameter mapping is the framework-neutral `attnres_core.training` (the
same code torch and MLX call); this module evaluates it on `jax.numpy` and adds the JAX actions.

* Schedules (M10): `linear_warmup(steps)`, `cosine_warmup(steps)`, `temperature_schedule(start,
  end, steps, kind)`: callables `count -> 0-d float32 array`, traceable (an optax step count
  under `jit`), composable with `optax.join_schedules`; exactly 0.0 / 1.0 (start / end) at the
  end points.  Pass them as `mix=` / `scale=` of the NNX `DepthRouter` / `Transformer` or
  `stack_apply`: 0-d arrays trace, so one compiled step serves the whole warm-up.
* `DepthMonitor(router, on_collapse=...)`: `monitor.observer()` is a `ScheduleObserver` for
  `observer=`; inside the (jitted) step it computes each row's weight statistics and each
  sublayer's input / output RMS as arrays (no host transfer, `stop_gradient`), which the step
  returns (`observer.stats()`, e.g. as the aux of `nnx.value_and_grad`); `monitor.update(step,
  stats)` records them on the host, checks for collapse and answers with the policy: "log",
  "raise", "lr_scale" (`LrScalePolicy`: `lr_factors()` fed to the optax transform
  `query_lr_scale()`), "reset" (`ResetPolicy`: the query row re-zeroed in the router's NNX
  state, its optimizer moments zeroed in an `nnx.Optimizer`).
* Converters: `fla_config`, `k3_config`, `from_fla` / `from_k3` (jnp arrays), `to_fla` /
  `to_k3` (a mapping or an NNX `DepthRouter`), `load_into(router, params)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from attnres_core import training as core
from attnres_core.schedule import ScheduleObserver
from attnres_core.training import (
    POLICIES,
    CollapsePolicy,
    DepthCollapseError,
    DepthCollapseWarning,
    LogPolicy,
    RaisePolicy,
    entry_scalars,
    fla_config,
    k3_config,
)

__all__ = ["POLICIES", "CollapsePolicy", "DepthCollapseError", "DepthCollapseWarning", "DepthMonitor",
           "LogPolicy", "LrScalePolicy", "RaisePolicy", "ResetPolicy", "collapse_policy", "cosine_warmup",
           "entry_scalars", "fla_config", "from_fla", "from_k3", "k3_config", "linear_warmup", "load_into",
           "query_lr_scale", "temperature_schedule", "to_fla", "to_k3"]

Schedule = Callable[[jax.Array], jax.Array]


# -- schedules ---------------------------------------------------------------------------------

def _schedule(curve) -> Schedule:
    def schedule(count):
        return jnp.asarray(curve.curve(jnp.asarray(count), jnp), jnp.float32)

    schedule.curve = curve  # the core object: exact float64 values by `schedule.curve(step)`
    return schedule


def linear_warmup(steps: int) -> Schedule:
    """alpha(count) = min(1, count / steps) (`attnres_core.training.LinearWarmup`), float32."""
    return _schedule(core.LinearWarmup(steps))


def cosine_warmup(steps: int) -> Schedule:
    """alpha(count) = (1 - cos(pi min(1, count / steps))) / 2 (`CosineWarmup`), float32."""
    return _schedule(core.CosineWarmup(steps))


def temperature_schedule(start: float, end: float, steps: int, kind: str = "linear") -> Schedule:
    """The logit scale from `start` to `end` over `steps` ("linear", "cosine", "geometric";
    `TemperatureSchedule`), float32."""
    return _schedule(core.TemperatureSchedule(start, end, steps, kind))


# -- parameter paths ---------------------------------------------------------------------------

def _names(path) -> Tuple:
    """A pytree key path as plain names (dict keys, attributes, indices), without the trailing
    `value` of an NNX Variable."""
    out = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                out.append(getattr(key, attr))
                break
    return tuple(out[:-1]) if out and out[-1] == "value" else tuple(out)


def _matches(names: Tuple, suffix: Tuple) -> bool:
    return len(names) >= len(suffix) and names[len(names) - len(suffix):] == suffix


# -- lr_scale: an optax transform ----------------------------------------------------------------

def query_lr_scale(param: str = "queries", path: Sequence = ()):
    """An optax transform (chain it after the optimizer) that multiplies the update of every
    query row r by `query_lr_factors[r]`, an `[R]` array passed to `update` as an extra argument
    (`nnx.Optimizer.update(model, grads, query_lr_factors=monitor.lr_factors())`; traced, so a
    new factor needs no recompile; omitted: updates unchanged).  It acts on the leaves named
    `param` (under `path`, the router's names in the tree, e.g. ("router",)) whose leading axis
    is R.  After `optax.adamw(lr)` that is exactly lr * factor for those rows (the update is
    proportional to lr and the moments do not depend on it), as torch's `LrScalePolicy`."""
    import optax

    suffix = tuple(path) + (param,)

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, query_lr_factors=None, **extra):
        if query_lr_factors is None:
            return updates, state
        factors = jnp.asarray(query_lr_factors)

        def scale(path, u):
            if not _matches(_names(path), suffix) or jnp.ndim(u) < 1 or u.shape[0] != factors.shape[0]:
                return u
            f = factors.reshape((-1,) + (1,) * (u.ndim - 1)).astype(u.dtype)
            return u * f

        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformationExtraArgs(init, update)


# -- the monitor -----------------------------------------------------------------------------------

def _stats_dtype(x):
    """x outside the gradient, in float32 at least (float64 stays float64)."""
    x = jax.lax.stop_gradient(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _rms(x) -> jax.Array:
    x = _stats_dtype(x)
    return jnp.sqrt(jnp.mean(x * x))


class _StatsObserver(ScheduleObserver):
    """One step's observer: each row's `weight_statistics` and each sublayer's input / output
    RMS as arrays of the trace it runs in (float32 at least, outside the gradient); `stats()` is the
    pytree the step returns to `DepthMonitor.update`."""

    wants_weights = True

    def __init__(self, monitor: "DepthMonitor"):
        self.monitor = monitor
        self.rows: Dict[int, List[dict]] = {}
        self.sublayers: Dict[int, List[tuple]] = {}

    def depth_attention(self, row, labels, sources, weights) -> None:
        if weights is None:
            return
        self.monitor._labels[row] = list(labels)  # static: a function of the scheme and the row
        mean, entropy, max_weight = core.weight_statistics(_stats_dtype(weights), jnp)
        self.rows.setdefault(row, []).append({"mean_weights": mean, "entropy": entropy,
                                              "max_weight": max_weight})

    def sublayer(self, layer, h, v) -> None:
        self.sublayers.setdefault(layer, []).append((_rms(h), _rms(v)))

    def stats(self) -> dict:
        """{"rows": {r: [stats per forward pass]}, "sublayers": {l: [(input_rms, output_rms)]}}."""
        return {"rows": self.rows, "sublayers": self.sublayers}

    # the layer-scanned stack (`scan_apply(record=)`): the statistics come out of the scan
    def read_stats(self, weights) -> dict:
        """One read's statistics from its masked weights `[R, ...]` (rows not read: exactly 0,
        which add nothing to any statistic); `scanned` keeps the rows read."""
        mean, entropy, max_weight = core.weight_statistics(_stats_dtype(weights), jnp)
        return {"mean_weights": mean, "entropy": entropy, "max_weight": max_weight}

    def sublayer_stats(self, h, v) -> tuple:
        return _rms(h), _rms(v)

    def scanned(self, config, num_layers: int, period: int, recorded: Mapping) -> None:
        """Record a scanned pass: `recorded` from `scan_apply(record=self)` (leaves stacked over
        the n = L / period steps) as the unrolled pass would have (the same rows, labels and
        sublayers; each row's mean weights cut to the sources it reads)."""
        n = num_layers // period
        for j, read in enumerate(recorded["reads"]):
            for i in range(n):
                self._scanned_row(config, num_layers, i * period + j + 1, read, i)
        if recorded["output"] is not None:
            self._scanned_row(config, num_layers, num_layers + 1, recorded["output"], None)
        for j, (h_rms, v_rms) in enumerate(recorded["sublayers"]):
            for i in range(n):
                self.sublayers.setdefault(i * period + j + 1, []).append((h_rms[i], v_rms[i]))

    def _scanned_row(self, config, num_layers: int, layer: int, read: Mapping, i) -> None:
        labels = _prefix_labels(config, num_layers, layer)
        self.monitor._labels[layer - 1] = labels
        at = (lambda x: x) if i is None else (lambda x: x[i])
        self.rows.setdefault(layer - 1, []).append({
            "mean_weights": at(read["mean_weights"])[..., :len(labels)], "entropy": at(read["entropy"]),
            "max_weight": at(read["max_weight"])})


def _prefix_labels(config, num_layers: int, layer: int) -> list:
    """The source labels of sublayer `layer`'s read (L + 1: the output) in the layer-scanned
    stack's buffer, as the unrolled stream names them: full v_0..v_{l-1}; block b_0..b_n, the
    last one "partial" inside a block (M3)."""
    if config.kind == "full":
        return [f"v{j}" for j in range(layer)]
    S = config.block_size
    sealed = (layer - 1) // S + 1 if layer <= num_layers else -(-num_layers // S) + 1
    inside = layer <= num_layers and (layer - 1) % S != 0
    return [f"b{j}" for j in range(sealed)] + (["partial"] if inside else [])


def _state_variables(tree, suffix: Tuple, shape) -> list:
    """The NNX Variables of `tree` (e.g. an optimizer's state) at names ending in `suffix`
    whose value has `shape`."""
    from flax import nnx

    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return [v for p, v in flat if isinstance(v, nnx.Variable) and _matches(_names(p), suffix)
            and tuple(np.shape(v[...])) == tuple(shape)]


class LrScalePolicy(core.LrScaleRule):
    """lr_scale: from a row's first collapse on, `monitor.lr_factors()` holds `factor` for its
    query row; pass it to the `query_lr_scale` transform each step (the decision is
    `attnres_core.training.LrScaleRule`'s)."""


class ResetPolicy(core.ResetRule):
    """reset: multiply the collapsed row's query by 1 - shrink in the router's NNX state (shrink
    1.0: zero, the uniform average of M8) and, given the `nnx.Optimizer`, zero that row of every
    optimizer state leaf of the query parameter (Adam's moments) found at names ending in
    `path + (param name,)` (path: the router's names in the model, e.g. ("router",); () matches
    any)."""

    def __init__(self, shrink: float = 1.0, optimizer=None, path: Sequence = ()):
        super().__init__(shrink)
        if optimizer is not None and not hasattr(optimizer, "opt_state"):
            raise TypeError(f"optimizer: expected an nnx.Optimizer or None, got {type(optimizer).__name__}")
        self.optimizer, self.path = optimizer, tuple(path)

    def reset_row(self, monitor, query_row):
        name = core.query_parameter(monitor.config)
        var = getattr(monitor.router, name)
        var[...] = var[...].at[query_row].multiply(self.keep)
        if self.optimizer is not None:
            found = _state_variables(self.optimizer.opt_state, self.path + (name,), var[...].shape)
            if not found:
                raise ValueError(f"optimizer: holds no state for the router's {name!r} (shape "
                                 f"{tuple(var[...].shape)}) at names ending in {self.path + (name,)}; "
                                 "pass the optimizer that trains it (and path=)")
            for state in found:
                state[...] = state[...].at[query_row].set(0)


def collapse_policy(name: Union[str, CollapsePolicy], optimizer=None, **options) -> CollapsePolicy:
    """The policy called `name` ("log", "lr_scale", "reset", "raise"); "reset" zeroes the
    optimizer state of `optimizer` (an `nnx.Optimizer`) when given.  options: `factor`
    (lr_scale), `shrink` and `path` (reset)."""
    return core.make_policy(name, {"lr_scale": LrScalePolicy,
                                   "reset": lambda **o: ResetPolicy(optimizer=optimizer, **o)}, **options)


class DepthMonitor(core.DepthMonitorBase):
    """Depth weights, their entropy and per-sublayer magnitudes of an NNX `DepthRouter`'s passes,
    and the collapse responses.

    Args:
      router: the NNX `DepthRouter` (`Transformer.router`).  On a layer-scanned `Transformer`
        (the default for its kinds) the statistics are carried out of the scan (`scan_apply(record=)`:
        the same statistics as the unrolled model's within float32 rounding, the program still one
        group whatever L is; that call runs the scan's backward "scan").
      collapse_threshold: a row whose token-averaged maximum weight exceeds it collapsed.
      on_collapse: a `CollapsePolicy` or its name ("reset" with `optimizer=`: `collapse_policy`).

    Per step: `obs = monitor.observer()`, `model(tokens, observer=obs)` (any number of passes),
    return `obs.stats()` from the step, then `monitor.update(step, stats)` on the host.
    `history`, `metrics()` and the collapse rule are `attnres_core.training.DepthMonitorBase`'s.
    """

    def __init__(self, router, *, collapse_threshold: float = 0.99,
                 on_collapse: Union[str, CollapsePolicy] = "log", optimizer=None):
        super().__init__(router.config, router.num_layers, collapse_threshold=collapse_threshold,
                         policy=collapse_policy(on_collapse, optimizer))
        self.router = router
        self._labels: Dict[int, List[str]] = {}

    def observer(self) -> _StatsObserver:
        """A fresh observer for one step's forward pass(es)."""
        return _StatsObserver(self)

    def lr_factors(self) -> jax.Array:
        """`[R]` float32: each query row's learning-rate factor (1 unless lr_scale answered a
        collapse), for `query_lr_scale`'s `query_lr_factors=`."""
        rows = self.config.query_rows(self.num_layers)
        if isinstance(self.policy, core.LrScaleRule):
            return jnp.asarray(self.policy.row_factors(rows), jnp.float32)
        return jnp.ones((rows,), jnp.float32)

    def update(self, step: int, stats: Mapping, grad_norm: Optional[Sequence] = None) -> dict:
        """Record one step from its `observer().stats()` (arrays, fetched here), check it for
        collapse and answer (the policy; "raise" raises after recording).  grad_norm: optional
        L per-sublayer gradient norms.  Returns the history entry."""
        stats = jax.device_get(stats)
        self.start_record(step)
        try:
            for row in sorted(stats["rows"]):
                for seen in stats["rows"][row]:
                    self.add_row(row, self._labels[row], seen)
            for layer in sorted(stats["sublayers"]):
                for h_rms, v_rms in stats["sublayers"][layer]:
                    self.add_sublayer(layer, h_rms, v_rms)
            norms = None if grad_norm is None else [float(g) for g in grad_norm]
            entry = self.build_entry(magnitudes=bool(stats["sublayers"]), grad_norm=norms)
        finally:
            self.stop_record()
        return self.commit(entry, stacklevel=2)


# -- checkpoint converters -------------------------------------------------------------------------

_READ = {"as_array": jnp.asarray, "stack": jnp.stack}


def _params_of(params):
    return params.params() if hasattr(params, "params") and callable(params.params) else params


def from_fla(state_dict: Mapping, *, prefix: str = "model.") -> Dict[str, jax.Array]:
    """Our `{"queries", "norm_weights"}` `[2n+1, D]` from a flash-linear-attention state dict."""
    return core.from_fla(state_dict, prefix=prefix, **_READ)


def to_fla(params, *, prefix: str = "model.") -> Dict[str, jax.Array]:
    """flash-linear-attention keys (`[1, D]` projections) from our layout (a mapping or an NNX
    `DepthRouter`)."""
    return core.to_fla(_params_of(params), prefix=prefix, copy=jnp.asarray)


def from_k3(state_dict: Mapping, *, prefix: str = "model.") -> Dict[str, jax.Array]:
    """Our rows from a Kimi K3 state dict (HF names, mlx-lm names, tpu-inference `[D, 1]`)."""
    return core.from_k3(state_dict, prefix=prefix, **_READ)


def to_k3(params, *, prefix: str = "model.", proj_layout: str = "linear") -> Dict[str, jax.Array]:
    """Kimi K3 keys from our layout; proj_layout "linear" (`[1, D]`) or "einsum" (`[D, 1]`,
    tpu-inference's kernel)."""
    return core.to_k3(_params_of(params), prefix=prefix, proj_layout=proj_layout, copy=jnp.asarray)


def load_into(router, params: Mapping) -> None:
    """Set an NNX `DepthRouter`'s parameters from our layout (names and shapes checked, each
    cast to the parameter's dtype)."""
    router.load_params(params)
