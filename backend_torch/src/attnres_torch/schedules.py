"""Stability schedules for training with AttnRes (spec M10): plain callables `step -> float`,
the framework-neutral `attnres_core.training` curves (one definition for torch, JAX and MLX).

* `LinearWarmup(steps)` / `CosineWarmup(steps)`: the progressive-introduction mix alpha, from
  exactly 0.0 at step 0 to exactly 1.0 at every step >= `steps` (linear, or the half-cosine
  ease-in-out `(1 - cos(pi t)) / 2`).  Pass the value as `mix=` to `DepthRouter.forward` /
  `.stream` / `AttnResTransformer.forward`: at 0 the model is the plain PreNorm sum of the same
  outputs, at 1 plain AttnRes (the schedule's `check_mix` maps 1.0 to the plain scheme).
* `TemperatureSchedule(start, end, steps, kind)`: the depth-attention logit scale, from `start`
  at step 0 to `end` at every step >= `steps`, "linear", "cosine" or "geometric" (log-linear;
  start and end > 0).  Pass the value as `scale=`.  A scale below 1 flattens the depth weights
  (a high temperature), above 1 sharpens them; with zero-initialized queries every scale gives
  the same uniform weights at step 0.

They hold no state, so any training loop can call them::

    alpha, temp = LinearWarmup(200), TemperatureSchedule(0.25, 1.0, 200, "cosine")
    for step, batch in enumerate(loader):
        loss = loss_fn(model(batch, mix=alpha(step), scale=temp(step)))
"""

from __future__ import annotations

from attnres_core.training import KINDS, MIX_SCHEDULES, CosineWarmup, LinearWarmup, TemperatureSchedule

__all__ = ["KINDS", "MIX_SCHEDULES", "CosineWarmup", "LinearWarmup", "TemperatureSchedule"]
