"""Stability schedules for training with AttnRes (spec M10): plain callables `step -> float`.

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

import math
import numbers

KINDS = ("linear", "cosine", "geometric")


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"steps: expected an int >= 0, got {steps!r}")
    return int(steps)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    return int(step)


def _progress(step, steps: int) -> float:
    """t = step / steps clamped to [0, 1]; 1.0 for every step when steps = 0."""
    step = _check_step(step)
    return 1.0 if step >= steps else step / steps


class LinearWarmup:
    """alpha(step) = min(1, step / steps): exactly 0.0 at step 0 and 1.0 from `steps` on
    (steps = 0: 1.0 always, i.e. no introduction)."""

    def __init__(self, steps: int):
        self.steps = _check_steps(steps)

    def __call__(self, step: int) -> float:
        return _progress(step, self.steps)

    def __repr__(self) -> str:
        return f"LinearWarmup({self.steps})"


class CosineWarmup:
    """alpha(step) = (1 - cos(pi * min(1, step / steps))) / 2: exactly 0.0 at step 0 and 1.0
    from `steps` on, with zero slope at both ends."""

    def __init__(self, steps: int):
        self.steps = _check_steps(steps)

    def __call__(self, step: int) -> float:
        t = _progress(step, self.steps)
        return 1.0 if t == 1.0 else 0.5 * (1.0 - math.cos(math.pi * t))

    def __repr__(self) -> str:
        return f"CosineWarmup({self.steps})"


class TemperatureSchedule:
    """scale(step): `start` at step 0, `end` at every step >= `steps`.

    kind: "linear" (start + t (end - start)), "cosine" (start + (1 - cos(pi t)) / 2 (end -
    start)) or "geometric" (start (end / start)^t; start, end > 0), with t = min(1, step / steps).
    The end points are returned exactly.
    """

    def __init__(self, start: float, end: float, steps: int, kind: str = "linear"):
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite real number, got {value!r}")
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "geometric" and not (start > 0 and end > 0):
            raise ValueError(f"start/end: kind='geometric' needs start > 0 and end > 0, got "
                             f"start={start!r}, end={end!r}")
        self.start, self.end, self.kind = float(start), float(end), kind
        self.steps = _check_steps(steps)

    def __call__(self, step: int) -> float:
        t = _progress(step, self.steps)
        if t == 0.0:
            return self.start
        if t == 1.0:
            return self.end
        if self.kind == "linear":
            return self.start + t * (self.end - self.start)
        if self.kind == "cosine":
            return self.start + 0.5 * (1.0 - math.cos(math.pi * t)) * (self.end - self.start)
        return self.start * (self.end / self.start) ** t

    @classmethod
    def parse(cls, text: str) -> "TemperatureSchedule":
        """From "START:END:STEPS[:KIND]" (KIND defaults to linear), e.g. "0.25:1:200:cosine"."""
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) not in (3, 4):
            raise ValueError(f"temperature schedule: expected START:END:STEPS[:KIND], got {text!r}")
        try:
            start, end, steps = float(parts[0]), float(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"temperature schedule: expected START:END:STEPS[:KIND] with numbers "
                             f"START, END and an int STEPS, got {text!r}") from None
        return cls(start, end, steps, parts[3] if len(parts) == 4 else "linear")

    def __repr__(self) -> str:
        return f"TemperatureSchedule({self.start}, {self.end}, {self.steps}, {self.kind!r})"


#: name -> mix schedule class, as the example trainer's `--introduce-kind` spells them.
MIX_SCHEDULES = {"linear": LinearWarmup, "cosine": CosineWarmup}
