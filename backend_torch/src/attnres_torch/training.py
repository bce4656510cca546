"""Training tools for PyTorch: the stability schedules (spec M10), the depth-weight collapse
monitor with its policies, and the FLA / Kimi K3 checkpoint converters, in one place as in
`attnres_jax.training` and `attnres_mlx.training`.

What is arithmetic or parameter mapping is the framework-neutral `attnres_core.training` (the
same code JAX and MLX call).  The schedules are defined here; the monitor and the converters are
re-exported from `attnres_torch.diagnostics` and `attnres_torch.checkpoints` (the same objects).

* Schedules: plain callables `step -> float`, the core's curves, holding no state.
  `LinearWarmup(steps)` / `CosineWarmup(steps)`: the progressive-introduction mix alpha (pass as
  `mix=`), exactly 0.0 at step 0 and 1.0 at every step >= `steps`.
  `TemperatureSchedule(start, end, steps, kind)`: the depth-attention logit scale (pass as
  `scale=`), "linear", "cosine" or "geometric".  Their meaning and use in a training loop:
  docs/training.md ("Stability schedules")::

      alpha, temp = LinearWarmup(200), TemperatureSchedule(0.25, 1.0, 200, "cosine")
      for step, batch in enumerate(loader):
          loss = loss_fn(model(batch, mix=alpha(step), scale=temp(step)))

* `DepthMonitor(router, sublayers, on_collapse=...)`, `with monitor.record(step)`, and the
  policies `LogPolicy`, `RaisePolicy`, `LrScalePolicy`, `ResetPolicy` (`collapse_policy`,
  `POLICIES`), `entry_scalars`, `write_entry`, `tensorboard_writer`: `attnres_torch.diagnostics`.
* Converters: `fla_config`, `k3_config`, `from_fla` / `from_k3`, `to_fla` / `to_k3`,
  `load_into(router, params)`: `attnres_torch.checkpoints`.
"""

from __future__ import annotations

from attnres_core.training import KINDS, MIX_SCHEDULES, CosineWarmup, LinearWarmup, TemperatureSchedule

from .checkpoints import fla_config, from_fla, from_k3, k3_config, load_into, to_fla, to_k3
from .diagnostics import (
    POLICIES,
    CollapseEvent,
    CollapsePolicy,
    DepthCollapseError,
    DepthCollapseWarning,
    DepthMonitor,
    LogPolicy,
    LrScalePolicy,
    RaisePolicy,
    ResetPolicy,
    collapse_policy,
    entry_scalars,
    tensorboard_writer,
    weight_stats,
    write_entry,
)

__all__ = ["KINDS", "MIX_SCHEDULES", "POLICIES", "CollapseEvent", "CollapsePolicy", "CosineWarmup",
           "DepthCollapseError", "DepthCollapseWarning", "DepthMonitor", "LinearWarmup", "LogPolicy",
           "LrScalePolicy", "RaisePolicy", "ResetPolicy", "TemperatureSchedule", "collapse_policy",
           "entry_scalars", "fla_config", "from_fla", "from_k3", "k3_config", "load_into",
           "tensorboard_writer", "to_fla", "to_k3", "weight_stats", "write_entry"]
