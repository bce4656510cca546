"""Training diagnostics for `DepthRouter` models: what the depth attention does while a model trains.

`DepthMonitor` hooks a router (and, optionally, its sublayer modules) and records, inside
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
Outside `record` the hooks do nothing; `close()` removes them.  `history` is a list of plain,
JSON-serializable dicts, one per record, from which `attnres_torch.examples.report` draws plots.

While recording, a Block router runs its direct schedule (equal to two-phase, spec 3) so that every
row's weights are observable; the weights are recomputed under `torch.no_grad()` with
`depth_attention(..., return_weights=True)`, so the model's computation and gradients are exactly
those of an unmonitored step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from .modules import DepthRouter, RouterStream
from .ops import depth_attention


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


class _RecordingStream(RouterStream):
    """A `RouterStream` that reports every depth-attention call to its monitor.

    `modules.py` has no public observer hook, so this relies on RouterStream internals: every
    depth attention goes through `_attend(row, sources)`, `_query(row, sources)` gives the row's
    query, `two_phase` selects the schedule, and `values` / `blocks` / `partial` hold the sources
    (matched by identity for the labels).  `test_diagnostics.py` checks the result against the
    float64 reference, so a change there fails loudly.
    """

    def __init__(self, router: DepthRouter, embedding: torch.Tensor, monitor: "DepthMonitor"):
        super().__init__(router, embedding)
        self.two_phase = False
        self.monitor = monitor

    def _labels(self, sources: Sequence[torch.Tensor]) -> List[str]:
        pool, prefix = (self.blocks, "b") if self.cfg.kind == "block" else (self.values, "v")
        labels = []
        for s in sources:
            if s is self.partial:
                labels.append("partial")
            else:
                labels.append(next(f"{prefix}{j}" for j, t in enumerate(pool) if t is s))
        return labels

    def _attend(self, row: int, sources: List[torch.Tensor]) -> torch.Tensor:
        out = super()._attend(row, sources)
        c = self.cfg
        with torch.no_grad():
            _, weights = depth_attention(sources, self._query(row, sources),
                                         self.router.norm_weights[row], eps=c.eps, scale=c.scale,
                                         num_heads=c.num_heads, activation=c.activation,
                                         key_norm=c.key_norm, return_weights=True)
        self.monitor._observe_row(row, self._labels(sources), weights)
        return out


class DepthMonitor:
    """Records depth weights, their entropy, per-sublayer magnitudes and gradient norms.

    Args:
      router: the model's `DepthRouter` (any variant; non-attention variants record no weights).
      sublayers: the L sublayer modules in order (e.g. `model.sublayers`) for the input / output
        RMS and gradient norms; empty to record depth weights only.
      collapse_threshold: warn when a row's token-averaged maximum weight exceeds it.

    While attached, the router carries an instance attribute `stream` (the recording switch):
    `close()` before pickling or deep-copying the whole module (`state_dict` is unaffected).
    """

    def __init__(self, router: DepthRouter, sublayers: Sequence[nn.Module] = (), *,
                 collapse_threshold: float = 0.99):
        if sublayers and len(sublayers) != router.num_layers:
            raise ValueError(f"sublayers: expected {router.num_layers} modules (one per sublayer), "
                             f"got {len(sublayers)}")
        if not 0.0 < collapse_threshold < 1.0:
            raise ValueError(f"collapse_threshold: expected a value in (0, 1), got {collapse_threshold!r}")
        if "stream" in vars(router):
            raise ValueError("router: already watched by another DepthMonitor (close() it first)")
        self.router, self.sublayers = router, list(sublayers)
        self.collapse_threshold = collapse_threshold
        self.history: List[dict] = []
        self._current: Optional[dict] = None
        self._warned: set = set()
        self._handles = [m.register_forward_hook(self._sublayer_hook(l))
                         for l, m in enumerate(self.sublayers)]
        self._plain_stream = router.stream
        router.stream = lambda embedding: (_RecordingStream(router, embedding, self)
                                           if self._current is not None
                                           else self._plain_stream(embedding))

    def close(self) -> None:
        """Remove every hook; the router and sublayers behave as if never monitored."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if "stream" in vars(self.router):
            del self.router.stream

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

    def _sublayer_hook(self, index: int):
        def hook(module, args, output):
            if self._current is not None:
                self._current["input_rms"][index].append(_rms(args[0]))
                self._current["output_rms"][index].append(_rms(output))
        return hook

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
