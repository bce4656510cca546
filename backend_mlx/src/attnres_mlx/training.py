"""Training tools for MLX: stability schedules, a depth-weight collapse monitor with its policies,
and the FLA / Kimi K3 checkpoint converters for `DepthRouter`.

What is arithmetic or parameter mapping is the framework-neutral `attnres_core.training` (the
same code torch and JAX call); this module evaluates it on `mlx.core` and adds the MLX actions.

* Schedules (M10): `linear_warmup(steps)`, `cosine_warmup(steps)`, `temperature_schedule(start,
  end, steps, kind)`: callables `step -> value`; an int step gives the exact Python float, an
  `mx.array` step (an optimizer's `step`, or a 0-d input of an `mx.compile`d step) a float32
  array, so they compose with `mlx.optimizers.join_schedules` and trace.  Pass the value as the
  router's `mix=` / `scale=`.
* `DepthMonitor(router, on_collapse=...)`: pass `monitor.observer` as the router's `observer=`
  and run the step inside `with monitor.record(step):` (eagerly: a step under `mx.compile` is
  refused with that fix, never recorded empty).  While
  it records, the observer asks the router's ops for each row's depth weights with its output
  (`MlxOps.depth_attention(..., return_weights=True)`, fused reads included) and takes them
  outside the gradient: the pass's own query (static or input-dependent, M6), keys (low-rank
  included, M13) and logit scale, so any attention scheme is monitored and no depth attention
  runs twice.  In a record the router runs a two-phase pass as a direct one (two-phase never
  forms the weights; the result is the same, spec 3), as torch's router does.  Policies: "log", "raise",
  "lr_scale" and "reset" (`LrScalePolicy`, `ResetPolicy`); `monitor.apply_update(optimizer,
  model, grads)` in place of `optimizer.update(model, grads)` completes them (lr_scale: each
  scaled query row moves `factor` times as far; reset: the reset row's pending gradient and
  optimizer state are zeroed first).
* Converters: `fla_config`, `k3_config`, `from_fla` / `from_k3` (mx arrays), `to_fla` / `to_k3`
  (a mapping or a `DepthRouter`), `load_into(router, params)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Callable, Dict, Iterator, List, Optional, Union

import mlx.core as mx
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
from mlx.utils import tree_flatten

from . import ops
from .modules import DepthRouter

__all__ = ["POLICIES", "CollapsePolicy", "DepthCollapseError", "DepthCollapseWarning", "DepthMonitor",
           "LogPolicy", "LrScalePolicy", "RaisePolicy", "ResetPolicy", "collapse_policy", "cosine_warmup",
           "entry_scalars", "fla_config", "from_fla", "from_k3", "k3_config", "linear_warmup", "load_into",
           "temperature_schedule", "to_fla", "to_k3"]


# -- schedules ---------------------------------------------------------------------------------

def _schedule(curve) -> Callable:
    def schedule(step):
        if isinstance(step, mx.array):
            return curve.curve(step, mx).astype(mx.float32)
        return curve(step)

    schedule.curve = curve  # the core object
    return schedule


def linear_warmup(steps: int) -> Callable:
    """alpha(step) = min(1, step / steps) (`attnres_core.training.LinearWarmup`)."""
    return _schedule(core.LinearWarmup(steps))


def cosine_warmup(steps: int) -> Callable:
    """alpha(step) = (1 - cos(pi min(1, step / steps))) / 2 (`CosineWarmup`)."""
    return _schedule(core.CosineWarmup(steps))


def temperature_schedule(start: float, end: float, steps: int, kind: str = "linear") -> Callable:
    """The logit scale from `start` to `end` over `steps` ("linear", "cosine", "geometric";
    `TemperatureSchedule`)."""
    return _schedule(core.TemperatureSchedule(start, end, steps, kind))


# -- trees ---------------------------------------------------------------------------------------

def _path_of(model, array: mx.array) -> Optional[List]:
    """The keys of `array` in `model.parameters()` (by identity), None when it is not there."""
    for key, value in tree_flatten(model.parameters()):
        if value is array:
            return [int(k) if k.isdigit() else k for k in key.split(".")]
    return None


def _get(tree, keys):
    for k in keys:
        if tree is None:
            return None
        try:
            tree = tree[k]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


def _set(tree, keys, value) -> None:
    _get(tree, keys[:-1])[keys[-1]] = value


def _rows_mask(num_rows: int, rows) -> mx.array:
    """`[R, 1]` bool: True on the given rows."""
    hit = mx.zeros((num_rows,), mx.bool_)
    for r in rows:
        hit = mx.logical_or(hit, mx.arange(num_rows) == r)
    return hit[:, None]


def _zero_rows(x: mx.array, rows) -> mx.array:
    mask = _rows_mask(x.shape[0], rows).reshape((x.shape[0],) + (1,) * (x.ndim - 1))
    return mx.where(mask, mx.zeros_like(x), x)


# -- policies ----------------------------------------------------------------------------------

class LrScalePolicy(core.LrScaleRule):
    """lr_scale: from a row's first collapse on, `DepthMonitor.apply_update` moves its query row
    `factor` times as far per step (`old + factor * (new - old)`: exactly lr * factor for
    optimizers whose update is proportional to the learning rate with state that does not depend
    on it: SGD with momentum, Adam, AdamW)."""


class ResetPolicy(core.ResetRule):
    """reset: multiply the collapsed row's query by 1 - shrink (1.0: zero, the uniform average of
    M8) at once; the next `DepthMonitor.apply_update` zeroes that row's pending gradient and
    optimizer state (Adam's moments) before the update, so it does not push the row back."""

    def __init__(self, shrink: float = 1.0):
        super().__init__(shrink)
        self.pending: set = set()

    def reset_row(self, monitor, query_row):
        name = core.query_parameter(monitor.config)
        q = monitor.router[name]
        keep = _rows_mask(q.shape[0], [query_row]).reshape((q.shape[0],) + (1,) * (q.ndim - 1))
        setattr(monitor.router, name, mx.where(keep, q * self.keep, q))
        self.pending.add(query_row)


def collapse_policy(name: Union[str, CollapsePolicy], **options) -> CollapsePolicy:
    """The policy called `name` ("log", "lr_scale", "reset", "raise"); options: `factor`
    (lr_scale), `shrink` (reset)."""
    return core.make_policy(name, {"lr_scale": LrScalePolicy, "reset": ResetPolicy}, **options)


# -- the monitor -----------------------------------------------------------------------------------

def _rms(x: mx.array) -> mx.array:
    x = mx.stop_gradient(x).astype(ops.compute_dtype(x.dtype))
    return mx.sqrt(mx.mean(x * x))


#: What to do when a recorded step is compiled: the observer is a Python side effect, which
#: `mx.compile` traces once (its arrays are placeholders) and then replays without calling it.
_COMPILED_FIX = ("A step compiled with mx.compile cannot be monitored: run the steps you record "
                 "eagerly (e.g. every 100th: `with monitor.record(step): loss = step_fn(...)` with the "
                 "uncompiled function) and the others compiled.")


class _MonitorObserver(ScheduleObserver):
    """The monitor's `ScheduleObserver`: while its monitor records, each row's weight statistics
    from the weights the router's ops returned with the row's output, and each sublayer's input /
    output RMS, kept lazy until the record ends.

    `wants_weights` (read when a pass starts) is True only while the monitor records, as for
    torch's observer (a pass started before the record reports no weights).  Outside a record
    the observer costs nothing and any schedule runs (a two-phase decode included); inside one
    the stream asks the ops for the weights, and the router runs a two-phase pass as a direct
    one (which forms them; spec 3: the same result), as torch's does."""

    def __init__(self, monitor: "DepthMonitor"):
        self.monitor = monitor

    @property
    def wants_weights(self) -> bool:
        return self.monitor.recording

    def depth_attention(self, row, labels, sources, weights) -> None:
        if not self.monitor.recording or weights is None:
            return
        w = mx.stop_gradient(weights)  # C11: the weights are not differentiable
        w = w.astype(ops.compute_dtype(w.dtype))
        self.monitor._pending_rows.append((row, list(labels), core.weight_statistics(w, mx)))

    def sublayer(self, layer, h, v) -> None:
        if self.monitor.recording:
            self.monitor._pending_sublayers.append((layer, _rms(h), _rms(v)))


class DepthMonitor(core.DepthMonitorBase):
    """Depth weights, their entropy and per-sublayer magnitudes of an MLX `DepthRouter`'s passes,
    and the collapse responses (see the module docstring).

    Args:
      router: the `DepthRouter`, any scheme (static or input-dependent queries M6, low-rank
        keys M13, heads, sigmoid ...; non-attention kinds record magnitudes only).
      collapse_threshold: a row whose token-averaged maximum weight exceeds it collapsed.
      on_collapse: a `CollapsePolicy` or its name.

    `history`, `metrics()` and the collapse rule are `attnres_core.training.DepthMonitorBase`'s.
    """

    def __init__(self, router: DepthRouter, *, collapse_threshold: float = 0.99,
                 on_collapse: Union[str, CollapsePolicy] = "log"):
        super().__init__(router.config, router.num_layers, collapse_threshold=collapse_threshold,
                         policy=collapse_policy(on_collapse))
        self.router = router
        self.observer = _MonitorObserver(self)
        self._grad_norm = None
        self._pending_rows: list = []
        self._pending_sublayers: list = []

    def set_grad_norm(self, norms) -> None:
        """Inside `record`: the L per-sublayer gradient norms of this step (the loop computes
        them from the grads `nn.value_and_grad` returned), stored in the entry's "grad_norm"."""
        if not self.recording:
            raise RuntimeError("set_grad_norm: only inside `with monitor.record(step)`")
        norms = [float(n) for n in norms]
        if len(norms) != self.num_layers:
            raise ValueError(f"norms: expected {self.num_layers} values (one per sublayer), got {len(norms)}")
        self._grad_norm = norms

    @contextlib.contextmanager
    def record(self, step: int) -> Iterator[None]:
        """Record the forward pass(es) run inside the block with `observer=monitor.observer` as
        `history` entry `step` (values averaged over several passes), then check it for collapse
        and answer.  The passes must use schedule="direct" (see `_MonitorObserver`); the weights
        are each pass's own, formed with the scale it was called with."""
        self.start_record(step)
        try:
            yield
            rows, subs = self._pending_rows, self._pending_sublayers
            if not rows and not subs:
                raise RuntimeError(f"DepthMonitor.record({step}): no pass ran with observer=monitor.observer "
                                   f"inside the record. {_COMPILED_FIX}")
            try:
                mx.eval([s for _, _, s in rows], [(h, v) for _, h, v in subs])
            except RuntimeError as exc:
                if "without a primitive" not in str(exc):
                    raise
                raise RuntimeError(f"DepthMonitor.record({step}): the pass ran under mx.compile, whose "
                                   f"traced arrays the observer cannot keep. {_COMPILED_FIX}") from None
            for row, labels, (mean, entropy, max_weight) in rows:
                self.add_row(row, labels, {"mean_weights": mean.tolist(), "entropy": entropy.item(),
                                           "max_weight": max_weight.item()})
            for layer, h, v in subs:
                self.add_sublayer(layer, h.item(), v.item())
            entry = self.build_entry(magnitudes=bool(subs), grad_norm=self._grad_norm)
        finally:
            self.stop_record()
            self._grad_norm, self._pending_rows, self._pending_sublayers = None, [], []
        self.commit(entry, stacklevel=3)  # 3: the caller's `with monitor.record`

    def apply_update(self, optimizer, model, grads) -> None:
        """`optimizer.update(model, grads)` with the policy's actions: rows reset since the last
        update get zero gradient and optimizer state first; lr_scale rows then move `factor`
        times as far.  The router must be part of `model`."""
        name = core.query_parameter(self.config)
        path = _path_of(model, self.router[name])
        if path is None:
            raise ValueError(f"model: does not hold the monitored router's {name!r} parameter")
        pending = getattr(self.policy, "pending", None)
        if pending:
            g = _get(grads, path)
            if g is not None:
                _set(grads, path, _zero_rows(g, pending))
            for key, value in list((_get(optimizer.state, path) or {}).items()):
                if isinstance(value, mx.array) and value.shape == self.router[name].shape:
                    _get(optimizer.state, path)[key] = _zero_rows(value, pending)
            pending.clear()
        old = self.router[name]
        optimizer.update(model, grads)
        factors = getattr(self.policy, "factors", None)
        if factors:
            new = self.router[name]
            f = mx.array(self.policy.row_factors(old.shape[0]), mx.float32)
            f = f.reshape((-1,) + (1,) * (old.ndim - 1)).astype(old.dtype)
            mask = _rows_mask(old.shape[0], factors).reshape(f.shape)
            setattr(self.router, name, mx.where(mask, old + f * (new - old), new))


# -- checkpoint converters -------------------------------------------------------------------------

_READ = {"as_array": mx.array, "stack": mx.stack}


def _params_of(params) -> Mapping:
    if isinstance(params, DepthRouter):
        return {n: params[n] for n in ("queries", "norm_weights") if n in params}
    return params


def _identity(x):
    return x


def from_fla(state_dict: Mapping, *, prefix: str = "model.") -> Dict[str, mx.array]:
    """Our `{"queries", "norm_weights"}` `[2n+1, D]` from a flash-linear-attention state dict."""
    return core.from_fla(state_dict, prefix=prefix, **_READ)


def to_fla(params, *, prefix: str = "model.") -> Dict[str, mx.array]:
    """flash-linear-attention keys (`[1, D]` projections) from our layout (a mapping or a
    `DepthRouter`)."""
    return core.to_fla(_params_of(params), prefix=prefix, copy=_identity)


def from_k3(state_dict: Mapping, *, prefix: str = "model.") -> Dict[str, mx.array]:
    """Our rows from a Kimi K3 state dict (HF names, mlx-lm names, tpu-inference `[D, 1]`)."""
    return core.from_k3(state_dict, prefix=prefix, **_READ)


def to_k3(params, *, prefix: str = "model.", proj_layout: str = "linear") -> Dict[str, mx.array]:
    """Kimi K3 keys from our layout; proj_layout "linear" (`[1, D]`) or "einsum" (`[D, 1]`)."""
    return core.to_k3(_params_of(params), prefix=prefix, proj_layout=proj_layout, copy=_identity)


def load_into(router: DepthRouter, params: Mapping) -> None:
    """Set a `DepthRouter`'s parameters from our layout (names and shapes checked, each cast to
    the parameter's dtype)."""
    shapes = router.config.param_shapes(router.num_layers, router.dim)
    if set(params) != set(shapes):
        raise ValueError(f"params: expected names {sorted(shapes)}, got {sorted(params)}")
    new = {}
    for name, shape in shapes.items():
        value = mx.array(params[name])
        if tuple(value.shape) != shape:
            raise ValueError(f"params[{name!r}]: expected shape {shape}, got {tuple(value.shape)}")
        new[name] = value.astype(router[name].dtype)
    router.update(new)

