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
JSON-serializable dicts, one per record, from which `attnres_torch.examples.report` draws plots.

While recording, a Block router runs its direct schedule (equal to two-phase, spec 3) so that every
row's weights are observable; each read asks its op for the weights with the output
(`depth_attention(..., return_weights=True)`: the same implementation, the weights from its own
lse, detached), so the model's computation and gradients are exactly those of an unmonitored
step and no depth attention runs twice.  The sublayer magnitudes are the inputs and outputs the
schedule hands out and receives; gradient norms come from the given sublayer modules.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from attnres_numpy.schedule import ScheduleObserver
from torch import nn

from .modules import DepthRouter


class DepthCollapseWarning(UserWarning):
    """A depth-attention row puts (almost) all its weight on a single source."""


def weight_stats(weights: torch.Tensor) -> Dict[str, object]:
    """Statistics of depth weights `[N, ...]` (any trailing token / head dims).

    Returns {"mean_weights": [N] (per-token normalized weights averaged over tokens),
    "entropy": mean over tokens of -sum_i p_i log p_i (nats), "max_weight": mean over tokens of
    max_i p_i, "argmax": index of the largest mean weight}.
    """
    w = weights.detach().to(torch.float64).reshape(weights.shape[0], -1)  # [N, M]
    p = w / w.sum(0, keepdim=True)
    entropy = -torch.special.xlogy(p, p).sum(0)
    mean = p.mean(1)
    return {"mean_weights": mean.tolist(), "entropy": float(entropy.mean()),
            "max_weight": float(p.max(0).values.mean()), "argmax": int(mean.argmax())}


def _mean(xs: List[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


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
        return self.monitor._current is not None

    def depth_attention(self, row, labels, sources, weights) -> None:
        if self.monitor._current is not None and weights is not None:
            self.monitor._observe_row(row, labels, weights)

    def sublayer(self, layer, h, v) -> None:
        cur = self.monitor._current
        if cur is not None and self.monitor.sublayers:
            cur["input_rms"][layer - 1].append(_rms(h))
            cur["output_rms"][layer - 1].append(_rms(v))


class DepthMonitor:
    """Records depth weights, their entropy, per-sublayer magnitudes and gradient norms.

    Args:
      router: the model's `DepthRouter` (any variant; non-attention variants record no weights).
      sublayers: the L sublayer modules in order (e.g. `model.sublayers`) for the input / output
        RMS and gradient norms; empty to record depth weights only.
      collapse_threshold: warn when a row's token-averaged maximum weight exceeds it.

    While attached, the monitor is the router's `observer` (`DepthRouter.observer`, a
    `ScheduleObserver` of the shared schedule): `close()` before pickling or deep-copying the
    whole module (`state_dict` is unaffected).
    """

    def __init__(self, router: DepthRouter, sublayers: Sequence[nn.Module] = (), *,
                 collapse_threshold: float = 0.99):
        if sublayers and len(sublayers) != router.num_layers:
            raise ValueError(f"sublayers: expected {router.num_layers} modules (one per sublayer), "
                             f"got {len(sublayers)}")
        if not 0.0 < collapse_threshold < 1.0:
            raise ValueError(f"collapse_threshold: expected a value in (0, 1), got {collapse_threshold!r}")
        if router.observer is not None:
            raise ValueError("router: already watched by another DepthMonitor (close() it first)")
        self.router, self.sublayers = router, list(sublayers)
        self.collapse_threshold = collapse_threshold
        self.history: List[dict] = []
        self._current: Optional[dict] = None
        self._warned: set = set()
        self._observer = _MonitorObserver(self)
        router.observer = self._observer

    def close(self) -> None:
        """Detach from the router; it behaves as if never monitored."""
        if self.router.observer is self._observer:
            self.router.observer = None

    # -- recording ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self, step: int) -> Iterator[None]:
        """Record the forward pass(es) and the backward inside the block as `history` entry
        `step` (values averaged over several forward passes).  Gradient norms are the sublayers'
        `.grad` on exit (None when a sublayer has none): zero them with `set_to_none=True` before
        the step, as `torch.optim` does by default."""
        if self._current is not None:
            raise RuntimeError("record: already recording (records do not nest)")
        L = self.router.num_layers
        self._current = {"step": int(step), "rows": {}, "input_rms": [[] for _ in range(L)],
                         "output_rms": [[] for _ in range(L)]}
        try:
            yield
            entry = self._finish()
        finally:
            self._current = None
        self.history.append(entry)
        self._check_collapse(entry)

    def _observe_row(self, row: int, labels: List[str], weights: torch.Tensor) -> None:
        stats = weight_stats(weights)
        stats["labels"] = labels
        self._current["rows"].setdefault(row, []).append(stats)

    def _finish(self) -> dict:
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
                "input_rms": [_mean(x) for x in cur["input_rms"]] if self.sublayers else None,
                "output_rms": [_mean(x) for x in cur["output_rms"]] if self.sublayers else None,
                "grad_norm": self._grad_norms()}

    def _grad_norms(self) -> Optional[List[float]]:
        norms = []
        for m in self.sublayers:
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            if not grads:
                return None
            norms.append(math.sqrt(sum(float(g.detach().to(torch.float64).square().sum())
                                       for g in grads)))
        return norms or None

    def _check_collapse(self, entry: dict) -> None:
        for r in entry["rows"]:
            n = len(r["labels"])
            if n > 1 and r["max_weight"] > self.collapse_threshold and r["row"] not in self._warned:
                self._warned.add(r["row"])
                where = ("the output aggregation" if r["row"] == self.router.num_layers
                         else f"sublayer {r['row'] + 1}")
                warnings.warn(
                    f"AttnRes depth weights collapsed at step {entry['step']}: {where} (row "
                    f"{r['row']}) puts on average {r['max_weight']:.4f} > {self.collapse_threshold} "
                    f"of its weight on a single one of its {n} sources (mostly "
                    f"{r['labels'][r['argmax']]}), so it no longer mixes depth (a learned choice "
                    "or a sign of too large pseudo-query logits: check the learning rate)",
                    DepthCollapseWarning, stacklevel=4)  # 4: the caller's `with monitor.record`
