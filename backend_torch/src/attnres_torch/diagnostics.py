"""Training diagnostics for `DepthRouter` models: what the depth attention does while a model trains.

`DepthMonitor` observes a router (`DepthRouter.observer`, the shared schedule's observer hook) and
records, inside
`with monitor.record(step):` (one training step: forward and backward):

* per depth-attention row r (sublayer l = r + 1; row L is the output aggregation): the depth
  weights averaged over tokens (and heads) `[N_r]`, their mean entropy and mean maximum, and a
  label per source ("v3" = layer output v_3, "b2" = completed block b_2, "partial");
* per sublayer l = 1..L: the RMS of its input h_l and of its output v_l (the paper's Fig. 5
  "output magnitude"), and the L2 norm of its parameters' gradients ("gradient magnitude");
* a `DepthCollapseWarning` when a row's weights collapse onto one source: the token-averaged
  maximum weight exceeds `collapse_threshold` (0.99), once per row and monitor.

Weights are normalized per token before the statistics (softmax weights already sum to 1; sigmoid
weights are divided by their sum).  Entropy is in nats (a uniform row over N sources has log N).
Outside `record` the observer does nothing; `close()` detaches it.  `history` is a list of plain,
JSON-serializable dicts, one per record, from which `experiments.report` draws plots.

A collapse can also be answered (`on_collapse=`, a `CollapsePolicy` or its name: "log",
"lr_scale", "reset", "raise"); each record's responses are in its history entry ("collapse").
`entry_scalars` / `write_entry` / `DepthMonitor(..., writer=)` export the records to a
TensorBoard-style writer.  The policies, their exactness and the exported tags:
docs/training.md, "Depth-weight collapse".

While recording, a Block router runs its direct schedule (equal to two-phase, spec 3) so that every
row's weights are observable; each read asks its op for the weights with the output
(`depth_attention(..., return_weights=True)`: the same implementation, the weights from its own
lse, detached), so the model's computation and gradients are exactly those of an unmonitored
step and no depth attention runs twice.  The sublayer magnitudes are the inputs and outputs the
schedule hands out and receives; gradient norms come from the given sublayer modules.

The statistics, the records, the collapse rule and message and the policy decisions are the
framework-neutral `attnres_core.training` (shared with the JAX and MLX monitors); this module adds
the torch actions (optimizer hooks, in-place resets) and the TensorBoard export.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, List, Optional, Sequence, Union

import torch
from attnres_core import training as core
from attnres_core.schedule import ScheduleObserver
from attnres_core.training import (
    POLICIES,
    CollapseEvent,
    CollapsePolicy,
    DepthCollapseError,
    DepthCollapseWarning,
    LogPolicy,
    RaisePolicy,
    entry_scalars,
)
from torch import nn

from .modules import DepthRouter

__all__ = ["POLICIES", "CollapseEvent", "CollapsePolicy", "DepthCollapseError", "DepthCollapseWarning",
           "DepthMonitor", "LogPolicy", "LrScalePolicy", "RaisePolicy", "ResetPolicy", "collapse_policy",
           "entry_scalars", "tensorboard_writer", "weight_stats", "write_entry"]


def _query_slot(router, query_row: int):
    """(parameter, index) holding query row `query_row` (`DepthMonitorBase.query_row`): index is
    the row of a stacked `[R, ...]` parameter (`DepthRouter`), None where the row is its own
    parameter (per-layer ownership: any router with `row_parameter(name, row)`)."""
    name = core.query_parameter(router.config)
    if hasattr(router, "row_parameter"):
        return router.row_parameter(name, query_row), None
    return getattr(router, name), query_row


def _row(t: torch.Tensor, index):
    return t if index is None else t[index]


class LrScalePolicy(core.LrScaleRule):
    """Scale the learning rate of each collapsed row's query by `factor`, once per row.

    Implemented as optimizer step hooks: before `optimizer.step()` the affected rows are saved,
    after it each row becomes `old + factor * (new - old)`.  For optimizers whose update is
    proportional to the learning rate and whose state does not depend on it (SGD with momentum,
    Adam, AdamW, RMSprop, Adagrad) that is exactly a step with `lr * factor` for those rows,
    whatever scheduler sets the group's lr, and it works for a row of a stacked `[L+1, D]`
    parameter, which a param group cannot hold on its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float = 0.1):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        super().__init__(factor)
        self.optimizer = optimizer
        self.rows: List[tuple] = []  # (parameter, index or None, factor)
        self._saved: List[torch.Tensor] = []
        self._handles: list = []

    def apply_row(self, monitor, event, query_row):
        param, index = _query_slot(monitor.router, query_row)
        if not any(p is param for g in self.optimizer.param_groups for p in g["params"]):
            raise ValueError("optimizer: does not hold the router's query parameter of row "
                             f"{event.row} (shape {tuple(param.shape)}); pass the optimizer that trains it")
        self.rows.append((param, index, self.factor))
        if not self._handles:
            self._handles = [self.optimizer.register_step_pre_hook(self._pre),
                             self.optimizer.register_step_post_hook(self._post)]

    def _pre(self, optimizer, args, kwargs):
        self._saved = [_row(p.detach(), i).clone() for p, i, _ in self.rows]

    @torch.no_grad()
    def _post(self, optimizer, args, kwargs):
        for (p, i, f), old in zip(self.rows, self._saved):
            new = _row(p, i)
            new.copy_(old + f * (new - old))
        self._saved = []

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []


class ResetPolicy(core.ResetRule):
    """Move each collapsed row's query `shrink` of the way to zero (1.0: zero, the uniform
    average of M8), drop its pending gradient, and, given the optimizer, zero the row of every
    per-parameter state tensor (Adam's moments, SGD's momentum) so the update does not push it
    straight back.  Acts on every record in which the row is collapsed."""

    def __init__(self, shrink: float = 1.0, optimizer: Optional[torch.optim.Optimizer] = None):
        super().__init__(shrink)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        self.optimizer = optimizer

    @torch.no_grad()
    def reset_row(self, monitor, query_row):
        param, index = _query_slot(monitor.router, query_row)
        _row(param, index).mul_(self.keep)
        if param.grad is not None:
            _row(param.grad, index).zero_()
        if self.optimizer is not None:
            for value in self.optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    _row(value, index).zero_()


def collapse_policy(name: Union[str, CollapsePolicy], optimizer: Optional[torch.optim.Optimizer] = None,
                    **options) -> CollapsePolicy:
    """The policy called `name` ("log", "lr_scale", "reset", "raise"); "lr_scale" needs the
    optimizer, "reset" uses it when given.  options: `factor` (lr_scale), `shrink` (reset).
    A `CollapsePolicy` is returned as it is."""
    if name == "lr_scale" and optimizer is None:
        raise ValueError("on_collapse: 'lr_scale' needs the optimizer that trains the queries "
                         "(collapse_policy('lr_scale', optimizer) or LrScalePolicy(optimizer))")
    return core.make_policy(name, {"lr_scale": lambda **o: LrScalePolicy(optimizer, **o),
                                   "reset": lambda **o: ResetPolicy(optimizer=optimizer, **o)}, **options)


def write_entry(writer, entry: dict, prefix: str = "attnres") -> None:
    """Send a history entry to a `SummaryWriter`-style writer at global step `entry["step"]`:
    every `entry_scalars` value as `add_scalar`, and as `add_histogram` the mean weights of each
    row (`{prefix}/row{r}/weights`) and the entropies of all rows (`{prefix}/entropy`)."""
    for name in ("add_scalar", "add_histogram"):
        if not callable(getattr(writer, name, None)):
            raise TypeError(f"writer: expected an object with add_scalar and add_histogram (a "
                            f"torch.utils.tensorboard.SummaryWriter), got {type(writer).__name__}")
    step = entry["step"]
    for tag, value in entry_scalars(entry, prefix).items():
        writer.add_scalar(tag, value, step)
    for r in entry["rows"]:
        writer.add_histogram(f"{prefix}/row{r['row']}/weights",
                             torch.tensor(r["mean_weights"], dtype=torch.float64), step)
    if entry["rows"]:
        writer.add_histogram(f"{prefix}/entropy",
                             torch.tensor([r["entropy"] for r in entry["rows"]], dtype=torch.float64), step)


def tensorboard_writer(log_dir=None, **kwargs):
    """A `torch.utils.tensorboard.SummaryWriter`; TensorBoard is an optional dependency, and
    without it this raises ImportError saying how to get it (or to pass any writer object)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError("tensorboard_writer: TensorBoard is not installed (pip install tensorboard); "
                          "entry_scalars() gives the same metrics as a plain dict, and write_entry() "
                          f"accepts any object with add_scalar/add_histogram ({exc})") from exc
    return SummaryWriter(log_dir=log_dir, **kwargs)


def weight_stats(weights: torch.Tensor):
    """Statistics of depth weights `[N, ...]` (any trailing token / head dims), in float64 on
    the host (`attnres_core.training.weight_stats`).

    Returns {"mean_weights": [N] (per-token normalized weights averaged over tokens),
    "entropy": mean over tokens of -sum_i p_i log p_i (nats), "max_weight": mean over tokens of
    max_i p_i, "argmax": index of the largest mean weight}.
    """
    return core.weight_stats(weights.detach().to(device="cpu", dtype=torch.float64).numpy())


def _rms(x: torch.Tensor) -> float:
    return float(x.detach().to(torch.float64).square().mean().sqrt())


class _MonitorObserver(ScheduleObserver):
    """The monitor's `ScheduleObserver`: the router's stream reports each depth-attention row
    (labels and the weights the op computed with the output) and each sublayer (input, output);
    it asks for weights only while its monitor records."""

    def __init__(self, monitor: "DepthMonitor"):
        self.monitor = monitor

    @property
    def wants_weights(self) -> bool:
        return self.monitor.recording

    def depth_attention(self, row, labels, sources, weights) -> None:
        if self.monitor.recording and weights is not None:
            self.monitor.add_row(row, labels, weight_stats(weights))

    def sublayer(self, layer, h, v) -> None:
        if self.monitor.recording and self.monitor.sublayers:
            self.monitor.add_sublayer(layer, _rms(h), _rms(v))


class DepthMonitor(core.DepthMonitorBase):
    """Records depth weights, their entropy, per-sublayer magnitudes and gradient norms.

    Args:
      router: the model's `DepthRouter` (any variant; non-attention variants record no weights).
      sublayers: the L sublayer modules in order (e.g. `model.sublayers`) for the input / output
        RMS and gradient norms; empty to record depth weights only.
      collapse_threshold: warn when a row's token-averaged maximum weight exceeds it.
      on_collapse: the response, a `CollapsePolicy` or "log" / "raise" (the other names need
        arguments: `collapse_policy(name, optimizer)`).
      writer: an optional `SummaryWriter`-style writer that receives every record (`write_entry`).

    While attached, the monitor is the router's `observer` (`DepthRouter.observer`, a
    `ScheduleObserver` of the shared schedule): `close()` before pickling or deep-copying the
    whole module (`state_dict` is unaffected).  The records, `history`, `metrics()` and the
    collapse check are `attnres_core.training.DepthMonitorBase`'s.
    """

    def __init__(self, router: DepthRouter, sublayers: Sequence[nn.Module] = (), *,
                 collapse_threshold: float = 0.99,
                 on_collapse: Union[str, CollapsePolicy] = "log", writer=None):
        if sublayers and len(sublayers) != router.num_layers:
            raise ValueError(f"sublayers: expected {router.num_layers} modules (one per sublayer), "
                             f"got {len(sublayers)}")
        super().__init__(router.config, router.num_layers, collapse_threshold=collapse_threshold,
                         policy=collapse_policy(on_collapse))
        if router.observer is not None:
            raise ValueError("router: already watched by another DepthMonitor (close() it first)")
        if writer is not None:
            for name in ("add_scalar", "add_histogram"):
                if not callable(getattr(writer, name, None)):
                    raise TypeError(f"writer: expected a SummaryWriter-style object with add_scalar and "
                                    f"add_histogram, got {type(writer).__name__}")
        self.writer = writer
        self.router, self.sublayers = router, list(sublayers)
        self._observer = _MonitorObserver(self)
        router.observer = self._observer

    def close(self) -> None:
        """Detach from the router (it behaves as if never monitored) and remove the policy's
        hooks."""
        if self.router.observer is self._observer:
            self.router.observer = None
        self.policy.close()

    # -- recording ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self, step: int) -> Iterator[None]:
        """Record the forward pass(es) and the backward inside the block as `history` entry
        `step` (values averaged over several forward passes).  Gradient norms are the sublayers'
        `.grad` on exit (None when a sublayer has none): zero them with `set_to_none=True` before
        the step, as `torch.optim` does by default."""
        self.start_record(step)
        try:
            yield
            entry = self.build_entry(magnitudes=bool(self.sublayers), grad_norm=self._grad_norms())
        finally:
            self.stop_record()
        self.commit(entry, stacklevel=3)  # 3: the caller's `with monitor.record`
        if self.writer is not None:
            write_entry(self.writer, entry)

    def _grad_norms(self) -> Optional[List[float]]:
        norms = []
        for m in self.sublayers:
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            if not grads:
                return None
            norms.append(math.sqrt(sum(float(g.detach().to(torch.float64).square().sum())
                                       for g in grads)))
        return norms or None
