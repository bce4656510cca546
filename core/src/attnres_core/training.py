"""The framework-neutral part of the training tools (spec M8, M10, M11): what is only arithmetic
or parameter mapping, written once; each backend wraps it with its framework's actions.

* Stability curves (M10): `LinearWarmup`, `CosineWarmup` (the progressive-introduction mix
  alpha) and `TemperatureSchedule` (the logit scale).  Calling one with an int step gives the
  exact float64 value (exactly 0.0 / 1.0, or `start` / `end`, at the end points); `curve(step,
  xp)` evaluates the same formula on an array step with an array namespace `xp` (numpy,
  `jax.numpy`, `mlx.core`), the end points exact through `xp.where`.
* Collapse statistics and rule: `weight_statistics(weights, xp)` (per-token normalized depth
  weights `[N, ...]` -> mean weights `[N]`, mean entropy, mean maximum), `weight_stats` (the same
  in float64, as plain Python values), `collapse_events` (a row collapses when it has >= 2
  sources and its token-averaged maximum weight exceeds the threshold), `entry_scalars`.
* `DepthMonitorBase`: the records (history entries averaged over several forward passes), the
  collapse check, its message and the once-per-row warning; a backend's monitor subclasses it
  and feeds it what its observer sees.
* Policy decisions (`CollapsePolicy`: "log", "lr_scale", "reset", "raise"): what to do about a
  collapsed row (which query row, which factor, the action recorded), not the framework action;
  `LrScaleRule.apply_row` / `ResetRule.reset_row` are the backends' hooks.
* Checkpoint mappings: `fla_config` / `k3_config` and `from_fla` / `to_fla` / `from_k3` /
  `to_k3` between our `{"queries", "norm_weights"}` `[2n+1, D]` and flash-linear-attention /
  Kimi K3 keys (names, shapes, the `[1, D]` / `[D, 1]` projections), over any mapping of arrays:
  the caller passes its framework's `as_array`, `stack` and `copy`.

Layouts (row r = sublayer r + 1; decoder layer i's attention and MLP reads are rows 2i, 2i + 1;
row L the output aggregation, M4):
  flash-linear-attention (`attnres_block_size`, in sublayers; 1 = their full mode):
  `{prefix}layers.{i}.attn_res_proj.weight` `[1, D]`, `...attn_res_norm.weight` `[D]`,
  `...mlp_res_proj.weight`, `...mlp_res_norm.weight`, `{prefix}res_proj.weight`,
  `{prefix}res_norm.weight`; eps = `norm_eps` (1e-6).
  Kimi K3 (`attn_res_block_size` decoder layers, so block_size = 2 x it):
  `{prefix}layers.{i}.self_attention_res_proj.weight` `[1, D]` (tpu-inference's einsum kernel
  `[D, 1]`), `...self_attention_res_norm.weight`, `...mlp_res_*`, `{prefix}output_attn_res_*`;
  the raw HF names `...self_attention_res.proj_weight` / `.norm_weight` are read too; eps =
  `rms_norm_eps` (1e-5).  K3 folds the gain into the query (`w_eff = norm * proj`); the logit
  depends only on that product, so the rows map one to one (query = proj, gain = norm).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .config import ResidualConfig

# -- stability curves (M10) --------------------------------------------------------------------

KINDS = ("linear", "cosine", "geometric")


class _Python:
    """The array namespace of plain Python floats (`curve`'s formulas on a scalar)."""

    cos = staticmethod(math.cos)

    @staticmethod
    def where(cond, a, b):
        return a if cond else b


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


def _progress_array(step, steps: int, xp):
    """t of an array step (e.g. optax's int32 count): step / steps clipped to [0, 1]."""
    if steps == 0:
        return step * 0.0 + 1.0
    return xp.clip(step / steps, 0.0, 1.0)


def _ease(t, xp):
    """(1 - cos(pi t)) / 2, exactly 1.0 at t = 1 (and exactly 0.0 at t = 0: cos 0 = 1)."""
    return xp.where(t >= 1.0, 1.0, 0.5 * (1.0 - xp.cos(math.pi * t)))


class LinearWarmup:
    """alpha(step) = min(1, step / steps): exactly 0.0 at step 0 and 1.0 from `steps` on
    (steps = 0: 1.0 always, i.e. no introduction)."""

    def __init__(self, steps: int):
        self.steps = _check_steps(steps)

    def __call__(self, step: int) -> float:
        return _progress(step, self.steps)

    def curve(self, step, xp):
        """The same value for an array step, in the namespace `xp` (numpy, jax.numpy, mlx.core)."""
        return _progress_array(step, self.steps, xp)

    def __repr__(self) -> str:
        return f"LinearWarmup({self.steps})"


class CosineWarmup:
    """alpha(step) = (1 - cos(pi * min(1, step / steps))) / 2: exactly 0.0 at step 0 and 1.0
    from `steps` on, with zero slope at both ends."""

    def __init__(self, steps: int):
        self.steps = _check_steps(steps)

    def __call__(self, step: int) -> float:
        return _ease(_progress(step, self.steps), _Python)

    def curve(self, step, xp):
        """The same value for an array step, in the namespace `xp`."""
        return _ease(_progress_array(step, self.steps, xp), xp)

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

    def _value(self, t, xp):
        start, end = self.start, self.end
        if self.kind == "linear":
            inner = start + t * (end - start)
        elif self.kind == "cosine":
            inner = start + 0.5 * (1.0 - xp.cos(math.pi * t)) * (end - start)
        else:
            inner = start * (end / start) ** t
        return xp.where(t <= 0.0, start, xp.where(t >= 1.0, end, inner))

    def __call__(self, step: int) -> float:
        return self._value(_progress(step, self.steps), _Python)

    def curve(self, step, xp):
        """The same value for an array step, in the namespace `xp`."""
        return self._value(_progress_array(step, self.steps, xp), xp)

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


# -- collapse statistics and rule --------------------------------------------------------------

class DepthCollapseWarning(UserWarning):
    """A depth-attention row puts (almost) all its weight on a single source."""


class DepthCollapseError(RuntimeError):
    """Raised by `RaisePolicy` when a depth-attention row collapses."""


@dataclasses.dataclass(frozen=True)
class CollapseEvent:
    """One collapsed row of one record: row r (sublayer r + 1; row L is the output aggregation),
    its token-averaged maximum weight over `num_sources` sources, the label of the source it
    collapsed onto, and the monitor's threshold."""

    step: int
    row: int
    max_weight: float
    num_sources: int
    label: str
    threshold: float


def weight_statistics(weights, xp=np):
    """Statistics of depth weights `[N, ...]` (any trailing token / head dims) in the array
    namespace `xp` (numpy, jax.numpy, mlx.core; traceable).  Each token's weights are normalized
    to sum 1 first (sigmoid weights do not).  Returns (mean_weights `[N]`, entropy: mean over
    tokens of -sum_i p_i log p_i in nats (0 log 0 = 0), max_weight: mean over tokens of max_i p_i),
    in the weights' dtype."""
    w = xp.reshape(weights, (weights.shape[0], -1))  # [N, M]
    p = w / xp.sum(w, axis=0, keepdims=True)
    positive = p > 0
    plogp = xp.where(positive, p * xp.log(xp.where(positive, p, 1.0)), 0.0)
    return xp.mean(p, axis=1), xp.mean(-xp.sum(plogp, axis=0)), xp.mean(xp.max(p, axis=0))


def weight_stats(weights) -> Dict[str, object]:
    """`weight_statistics` in float64 as plain values: {"mean_weights": [N] list, "entropy",
    "max_weight": floats, "argmax": index of the largest mean weight}; weights `[N, ...]`."""
    mean, entropy, max_weight = weight_statistics(np.asarray(weights, dtype=np.float64))
    return {"mean_weights": mean.tolist(), "entropy": float(entropy),
            "max_weight": float(max_weight), "argmax": int(mean.argmax())}


def collapse_events(entry: dict, threshold: float) -> List[CollapseEvent]:
    """The collapsed rows of a history entry: rows with >= 2 sources whose token-averaged maximum
    weight exceeds `threshold` (a one-source row cannot mix)."""
    events = []
    for r in entry["rows"]:
        n = len(r["labels"])
        if n >= 2 and r["max_weight"] > threshold:
            events.append(CollapseEvent(entry["step"], r["row"], r["max_weight"], n,
                                        r["labels"][r["argmax"]], threshold))
    return events


def entry_scalars(entry: dict, prefix: str = "attnres") -> Dict[str, float]:
    """A history entry as plain scalars `{tag: float}`: per row `{prefix}/row{r}/entropy`,
    `.../max_weight` and `.../weight/{label}`; per sublayer l `{prefix}/sublayer{l}/input_rms`,
    `output_rms`, `grad_norm` (where recorded); `{prefix}/collapsed_rows` (this record)."""
    out: Dict[str, float] = {}
    for r in entry["rows"]:
        base = f"{prefix}/row{r['row']}"
        out[f"{base}/entropy"] = float(r["entropy"])
        out[f"{base}/max_weight"] = float(r["max_weight"])
        for label, w in zip(r["labels"], r["mean_weights"]):
            out[f"{base}/weight/{label}"] = float(w)
    for key in ("input_rms", "output_rms", "grad_norm"):
        for l, value in enumerate(entry.get(key) or [], start=1):
            if value is not None:
                out[f"{prefix}/sublayer{l}/{key}"] = float(value)
    out[f"{prefix}/collapsed_rows"] = float(len(entry.get("collapse", [])))
    return out


# -- policy decisions --------------------------------------------------------------------------

class CollapsePolicy:
    """What a monitor does when a row collapses.  `respond(monitor, event)` acts and returns a
    short description of the action (recorded in the history entry); `warn` says whether the
    monitor also issues its `DepthCollapseWarning` (once per row); `close()` undoes any hooks."""

    name = "log"
    warn = True

    def respond(self, monitor: "DepthMonitorBase", event: CollapseEvent) -> str:
        return "logged"

    def close(self) -> None:
        pass


class LogPolicy(CollapsePolicy):
    """Warn once per row (`DepthCollapseWarning`); change nothing."""


class RaisePolicy(CollapsePolicy):
    """Raise `DepthCollapseError` when a row collapses (after the record is in `history`)."""

    name = "raise"

    def respond(self, monitor, event):
        raise DepthCollapseError(monitor.collapse_message(event))


def _check_factor(factor) -> float:
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0.0 < factor < math.inf:
        raise ValueError(f"factor: expected a finite real number > 0, got {factor!r}")
    return float(factor)


class LrScaleRule(CollapsePolicy):
    """lr_scale: from its first collapse on, the query row of a collapsed depth-attention row
    (`monitor.query_row`, M11) moves `factor` times as far per optimizer step, once per row.
    `factors` maps query row -> factor; `row_factors(R)` is the `[R]` vector (1 elsewhere).
    A backend applies it in `apply_row(monitor, event, query_row)` (which may refuse with an
    error: the row is then not scaled) or reads `factors` in its update."""

    name = "lr_scale"

    def __init__(self, factor: float = 0.1):
        self.factor = _check_factor(factor)
        self.factors: Dict[int, float] = {}

    def respond(self, monitor, event):
        qrow = monitor.query_row(event.row)
        if qrow in self.factors:
            return f"lr x{self.factor:g} (already)"
        self.apply_row(monitor, event, qrow)
        self.factors[qrow] = self.factor
        return f"lr x{self.factor:g}"

    def apply_row(self, monitor, event: CollapseEvent, query_row: int) -> None:
        """The backend's action when query row `query_row` is first scaled (default: none)."""

    def row_factors(self, num_rows: int) -> np.ndarray:
        """`[num_rows]` float64: each query row's factor (1.0 where none collapsed)."""
        out = np.ones(num_rows)
        for row, factor in self.factors.items():
            out[row] = factor
        return out


def _check_shrink(shrink) -> float:
    if isinstance(shrink, bool) or not isinstance(shrink, numbers.Real) or not 0.0 < shrink <= 1.0:
        raise ValueError(f"shrink: expected a real number in (0, 1], got {shrink!r}")
    return float(shrink)


class ResetRule(CollapsePolicy):
    """reset: move the collapsed row's query `shrink` of the way to zero (1.0: zero, the uniform
    average of M8: the query row is multiplied by `keep = 1 - shrink`) and drop its optimizer
    state; acts on every record in which the row is collapsed.  The backend does it in
    `reset_row(monitor, query_row)`."""

    name = "reset"

    def __init__(self, shrink: float = 1.0):
        self.shrink = _check_shrink(shrink)

    @property
    def keep(self) -> float:
        return 1.0 - self.shrink

    def respond(self, monitor, event):
        self.reset_row(monitor, monitor.query_row(event.row))
        return "reset to uniform" if self.shrink == 1.0 else f"query x{self.keep:g}"

    def reset_row(self, monitor, query_row: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}: reset_row is the backend's action")


POLICIES = ("log", "lr_scale", "reset", "raise")


def make_policy(name: Union[str, CollapsePolicy], backends: Mapping[str, Callable[..., CollapsePolicy]],
                **options) -> CollapsePolicy:
    """The policy called `name`: "log" and "raise" from here, "lr_scale" / "reset" from the
    backend's constructors `backends[name](**options)`; a `CollapsePolicy` as it is."""
    if isinstance(name, CollapsePolicy):
        return name
    if name == "log":
        return LogPolicy()
    if name == "raise":
        return RaisePolicy()
    if name in ("lr_scale", "reset") and name in backends:
        return backends[name](**options)
    raise ValueError(f"on_collapse: expected one of {POLICIES} or a CollapsePolicy, got {name!r}")


# -- the monitor's records ---------------------------------------------------------------------

def _mean(xs: List[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


class DepthMonitorBase:
    """The framework-neutral part of a depth monitor over a router of scheme `config` with L =
    num_layers sublayers: one record per training step (`start_record(step)`, `add_row` /
    `add_sublayer` per observation, `build_entry`, `commit`), `history` (plain JSON-serializable
    dicts), the collapse check with `policy` and the once-per-row `DepthCollapseWarning`."""

    def __init__(self, config: ResidualConfig, num_layers: int, *, collapse_threshold: float = 0.99,
                 policy: CollapsePolicy):
        if not 0.0 < collapse_threshold < 1.0:
            raise ValueError(f"collapse_threshold: expected a value in (0, 1), got {collapse_threshold!r}")
        if not isinstance(policy, CollapsePolicy):
            raise TypeError(f"on_collapse: expected a CollapsePolicy, got {type(policy).__name__}")
        self.config, self.num_layers = config, num_layers
        self.collapse_threshold, self.policy = collapse_threshold, policy
        self.history: List[dict] = []
        self._current: Optional[dict] = None
        self._warned: set = set()

    @property
    def recording(self) -> bool:
        return self._current is not None

    def query_row(self, row: int) -> int:
        """The query/gain row (M11: shared rows serve several sublayers) of depth-attention row r."""
        return self.config.query_row(row + 1, self.num_layers)

    def start_record(self, step: int) -> None:
        if self._current is not None:
            raise RuntimeError("record: already recording (records do not nest)")
        L = self.num_layers
        self._current = {"step": int(step), "rows": {}, "input_rms": [[] for _ in range(L)],
                         "output_rms": [[] for _ in range(L)]}

    def stop_record(self) -> None:
        self._current = None

    def add_row(self, row: int, labels: Sequence[str], stats: Mapping[str, Any]) -> None:
        """Row r's weights seen once: stats "mean_weights" `[N]`, "entropy", "max_weight"."""
        self._current["rows"].setdefault(row, []).append(
            {"labels": list(labels), "mean_weights": [float(x) for x in stats["mean_weights"]],
             "entropy": float(stats["entropy"]), "max_weight": float(stats["max_weight"])})

    def add_sublayer(self, layer: int, input_rms: float, output_rms: float) -> None:
        """Sublayer l = layer seen once: the RMS of its input h_l and its output v_l."""
        self._current["input_rms"][layer - 1].append(float(input_rms))
        self._current["output_rms"][layer - 1].append(float(output_rms))

    def build_entry(self, *, magnitudes: bool, grad_norm: Optional[List[float]] = None) -> dict:
        """The record in progress as a history entry (values averaged over its observations)."""
        cur = self._current
        rows = []
        for row in sorted(cur["rows"]):
            seen = cur["rows"][row]
            n = len(seen)
            rows.append({
                "row": row, "labels": seen[0]["labels"],
                "mean_weights": [sum(s["mean_weights"][i] for s in seen) / n
                                 for i in range(len(seen[0]["labels"]))],
                "entropy": sum(s["entropy"] for s in seen) / n,
                "max_weight": sum(s["max_weight"] for s in seen) / n,
            })
        for r in rows:
            r["argmax"] = max(range(len(r["labels"])), key=lambda i: r["mean_weights"][i])
        return {"step": cur["step"], "rows": rows,
                "input_rms": [_mean(x) for x in cur["input_rms"]] if magnitudes else None,
                "output_rms": [_mean(x) for x in cur["output_rms"]] if magnitudes else None,
                "grad_norm": grad_norm}

    def commit(self, entry: dict, *, stacklevel: int = 1) -> dict:
        """Append `entry` to `history` and answer its collapsed rows (`policy.respond`, whose
        actions go to `entry["collapse"]`; `RaisePolicy` raises here), warning once per row;
        stacklevel 1 attributes the warning to the caller of `commit`."""
        self.history.append(entry)
        entry["collapse"] = []
        for event in collapse_events(entry, self.collapse_threshold):
            action = self.policy.respond(self, event)
            entry["collapse"].append({"row": event.row, "max_weight": event.max_weight, "action": action})
            if self.policy.warn and event.row not in self._warned:
                self._warned.add(event.row)
                message = self.collapse_message(event)
                if self.policy.name != "log":
                    message += f"; response ({self.policy.name}): {action}"
                warnings.warn(message, DepthCollapseWarning, stacklevel=stacklevel + 1)
        return entry

    def collapse_message(self, event: CollapseEvent) -> str:
        where = ("the output aggregation" if event.row == self.num_layers
                 else f"sublayer {event.row + 1}")
        return (f"AttnRes depth weights collapsed at step {event.step}: {where} (row {event.row}) "
                f"puts on average {event.max_weight:.4f} > {event.threshold} of its weight on a "
                f"single one of its {event.num_sources} sources (mostly {event.label}), so it no "
                "longer mixes depth (a learned choice or a sign of too large pseudo-query logits: "
                "check the learning rate)")

    def metrics(self, entry: Optional[dict] = None) -> Dict[str, float]:
        """`entry_scalars` of `entry` (default: the latest record)."""
        if entry is None:
            if not self.history:
                raise ValueError("metrics: nothing recorded yet")
            entry = self.history[-1]
        return entry_scalars(entry)


def query_parameter(config: ResidualConfig) -> str:
    """The name of the parameter holding the rows a collapse policy acts on: "queries" (static
    queries) or "query_weights" (input-dependent, M6)."""
    return "queries" if config.query == "static" else "query_weights"


# -- checkpoint mappings -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """A peer's AttnRes key names: the two per-layer read sites (attention, MLP), the output
    read's name, and whether the raw `{site}.proj_weight` / `.norm_weight` names are read too."""

    sites: Tuple[str, str]
    output: str
    raw_names: bool = False


FLA = CheckpointLayout(("attn_res", "mlp_res"), "res")
K3 = CheckpointLayout(("self_attention_res", "mlp_res"), "output_attn_res", raw_names=True)

#: proj_layout -> the projection's shape for width D: "linear" `[1, D]` (HF, mlx-lm `nn.Linear`,
#: FLA), "einsum" `[D, 1]` (tpu-inference's `JaxEinsum` kernel).
PROJ_LAYOUTS = {"linear": lambda d: (1, d), "einsum": lambda d: (d, 1)}


def fla_config(attnres_block_size: int, norm_eps: float = 1e-6) -> ResidualConfig:
    """Our scheme for a flash-linear-attention model: 1 (their full mode) -> kind="full"; an even
    block size (in sublayers, as ours) -> kind="block" with the same block_size."""
    if isinstance(attnres_block_size, bool) or not isinstance(attnres_block_size, int) or \
            attnres_block_size < 1 or (attnres_block_size != 1 and attnres_block_size % 2):
        raise ValueError(f"attnres_block_size: expected 1 or an even int >= 2 (FLA's rule), got "
                         f"{attnres_block_size!r}")
    if attnres_block_size == 1:
        return ResidualConfig(kind="full", eps=norm_eps)
    return ResidualConfig(kind="block", block_size=attnres_block_size, eps=norm_eps)


def k3_config(attn_res_block_size: int, rms_norm_eps: float = 1e-5) -> ResidualConfig:
    """Our scheme for a Kimi K3 model: block_size = 2 x their decoder-layer block size."""
    if isinstance(attn_res_block_size, bool) or not isinstance(attn_res_block_size, int) or attn_res_block_size < 1:
        raise ValueError(f"attn_res_block_size: expected an int >= 1 (decoder layers), got {attn_res_block_size!r}")
    return ResidualConfig(kind="block", block_size=2 * attn_res_block_size, eps=float(rms_norm_eps))


def checkpoint_bases(layout: CheckpointLayout, num_decoder_layers: int, prefix: str) -> List[str]:
    """The key stem of every row in row order: `{prefix}layers.{i}.{site}` for decoder layer i's
    two reads, then `{prefix}{output}` (2n + 1 stems)."""
    return [f"{prefix}layers.{i}.{s}" for i in range(num_decoder_layers) for s in layout.sites] + \
        [f"{prefix}{layout.output}"]


def _names(layout: CheckpointLayout, sd: Mapping, base: str) -> Tuple[str, str]:
    if layout.raw_names and (f"{base}.proj_weight" in sd or f"{base}.norm_weight" in sd):
        return f"{base}.proj_weight", f"{base}.norm_weight"
    return f"{base}_proj.weight", f"{base}_norm.weight"


def _vector(sd, key: str, dim: Optional[int], *, proj: bool, as_array):
    if key not in sd:
        raise ValueError(f"state_dict: missing {key!r}")
    t = as_array(sd[key])
    shape = tuple(t.shape)
    ok = (len(shape) == 1 or (proj and len(shape) == 2 and 1 in shape)) and \
        (dim is None or math.prod(shape) == dim)
    if not ok:
        want = "[1, D], [D, 1] or [D]" if proj else "[D]"
        raise ValueError(f"state_dict[{key!r}]: expected shape {want}"
                         f"{'' if dim is None else f' with D = {dim}'}, got {shape}")
    return t.reshape(-1)


def checkpoint_layers(state_dict: Mapping, layout: CheckpointLayout, prefix: str) -> int:
    """The number of decoder layers n with keys `{prefix}layers.<i>.{first site}...` (0..n-1)."""
    site = layout.sites[0]
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\." + re.escape(site) + r"[._]")
    found = sorted({int(m.group(1)) for k in state_dict for m in [pattern.match(k)] if m})
    if not found:
        raise ValueError(f"state_dict: no '{prefix}layers.<i>.{site}...' keys (is the prefix "
                         f"{prefix!r} right? the model may have no AttnRes)")
    if found != list(range(len(found))):
        raise ValueError(f"state_dict: layer indices {found} are not 0..{len(found) - 1}")
    return len(found)


def rows_from_checkpoint(state_dict: Mapping, layout: CheckpointLayout, *, prefix: str = "model.",
                         as_array: Callable = np.asarray, stack: Callable = np.stack) -> Dict[str, Any]:
    """Our `{"queries", "norm_weights"}` `[2n+1, D]` from a peer's keys (n decoder layers, found
    from the keys; other keys ignored).  as_array: each value to the framework's array (with
    `.shape`, `.reshape`); stack: a list of `[D]` arrays to `[R, D]`."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
    n = checkpoint_layers(state_dict, layout, prefix)
    queries, gains, dim = [], [], None
    for base in checkpoint_bases(layout, n, prefix):
        q_key, g_key = _names(layout, state_dict, base)
        q = _vector(state_dict, q_key, dim, proj=True, as_array=as_array)
        dim = math.prod(tuple(q.shape))
        queries.append(q)
        gains.append(_vector(state_dict, g_key, dim, proj=False, as_array=as_array))
    return {"queries": stack(queries), "norm_weights": stack(gains)}


def check_rows(params) -> Tuple[Any, Any]:
    """(queries, norm_weights) of our layout, checked: both `[2n+1, D]` (n decoder layers)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params: expected a mapping or a router, got {type(params).__name__}")
    missing = [n for n in ("queries", "norm_weights") if n not in params]
    if missing:
        raise ValueError(f"params: the AttnRes checkpoint layouts hold a static query and a key-norm "
                         f"gain per row; missing {missing} (got {sorted(params)})")
    q, g = params["queries"], params["norm_weights"]
    if len(q.shape) != 2 or tuple(q.shape) != tuple(g.shape) or q.shape[0] % 2 != 1:
        raise ValueError(f"params: expected queries and norm_weights of one shape [2n+1, D] (n decoder "
                         f"layers); got {tuple(q.shape)} and {tuple(g.shape)}")
    return q, g


def rows_to_checkpoint(params: Mapping, layout: CheckpointLayout, *, prefix: str = "model.",
                       proj_layout: str = "linear", copy: Callable = np.array) -> Dict[str, Any]:
    """A peer's keys from our `{"queries", "norm_weights"}` `[2n+1, D]`: `{stem}_proj.weight` in
    `PROJ_LAYOUTS[proj_layout]`, `{stem}_norm.weight` `[D]`; copy: each written row to an array
    that does not share the parameter's memory (identity for immutable arrays)."""
    if proj_layout not in PROJ_LAYOUTS:
        raise ValueError(f"proj_layout: expected 'linear' or 'einsum', got {proj_layout!r}")
    q, g = check_rows(params)
    shape = PROJ_LAYOUTS[proj_layout](q.shape[1])
    out = {}
    for r, base in enumerate(checkpoint_bases(layout, (q.shape[0] - 1) // 2, prefix)):
        out[f"{base}_proj.weight"] = copy(q[r].reshape(shape))
        out[f"{base}_norm.weight"] = copy(g[r])
    return out


def from_fla(state_dict: Mapping, *, prefix: str = "model.", **arrays) -> Dict[str, Any]:
    """Our rows from a flash-linear-attention state dict (`rows_from_checkpoint` with `FLA`)."""
    return rows_from_checkpoint(state_dict, FLA, prefix=prefix, **arrays)


def to_fla(params: Mapping, *, prefix: str = "model.", **arrays) -> Dict[str, Any]:
    """flash-linear-attention keys (`[1, D]` projections) from our rows."""
    return rows_to_checkpoint(params, FLA, prefix=prefix, **arrays)


def from_k3(state_dict: Mapping, *, prefix: str = "model.", **arrays) -> Dict[str, Any]:
    """Our rows from a Kimi K3 state dict (HF names, the sanitized mlx-lm names, or
    tpu-inference's `[D, 1]` projection kernels)."""
    return rows_from_checkpoint(state_dict, K3, prefix=prefix, **arrays)


def to_k3(params: Mapping, *, prefix: str = "model.", proj_layout: str = "linear",
          **arrays) -> Dict[str, Any]:
    """Kimi K3 keys from our rows; proj_layout "linear" (`[1, D]`) or "einsum" (`[D, 1]`)."""
    return rows_to_checkpoint(params, K3, prefix=prefix, proj_layout=proj_layout, **arrays)
