"""Pipeline schedules: the order in which each stage runs its forward (F) and backward (B) chunk
passes, and one global order of every transfer that all stages follow (deadlock-free).

Schedules (`SCHEDULES`), for M microbatches over `plan` (P stages, V chunks per stage):

  "gpipe"             every forward, then every backward, in reverse (with V > 1: all
                      microbatches through a stage's first chunk, then its second...).  Any V.
                      A stage holds the activations (and the cross-stage cache) of all M
                      microbatches at once.
  "1f1b"              Megatron's one-forward-one-backward (V = 1): stage r runs
                      min(P - r - 1, M) warm-up forwards, then alternates F and B, then drains.
                      At most P - r microbatches in flight on stage r.
  "interleaved_1f1b"  Megatron's interleaved 1F1B (V > 1, M a multiple of P): microbatches go in
                      groups of P through chunk 0, then chunk 1, ... of the stage; warm-up
                      (P - r - 1) * 2 + (V - 1) * P chunk passes (all of them when M = P).

`simulate` runs the per-stage orders on a clock with unit-time F and B chunk passes (a stage
idles while the next pass in its order is not ready) and returns the events in clock order:
("F" | "B", m, k) passes and ("send_F" | "send_B", m, k) transfers.  "send_F" m k carries
chunk k's outputs to chunk k + 1; "send_B" m k carries chunk k's input gradients to chunk
k - 1.  A transfer sits right after the pass that produces it.  Every stage performs its own
passes and transfers in this one global order, so with blocking (rendezvous) send/recv no
stage can wait on a transfer that waits on it: when the i-th transfer is reached, both its
stages have completed every earlier transfer, and passes never block.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from .pipeline_plan import PipelinePlan

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

Pass = Tuple[str, int, int]  # ("F" | "B", microbatch, chunk)


def check_schedule(schedule: str, plan: PipelinePlan, num_microbatches: int) -> None:
    """Raise ValueError for an unknown schedule or one that does not fit the layout."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    m, v, p = num_microbatches, plan.virtual_stages, plan.num_stages
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"embeddings: expected at least one microbatch, got {m!r}")
    if schedule == "1f1b" and v != 1:
        raise ValueError(f"schedule: '1f1b' runs one chunk per stage, but the plan has "
                         f"{v} virtual stages ({plan.num_chunks} chunks over {p} stages); use "
                         f"'interleaved_1f1b' or 'gpipe'")
    if schedule == "interleaved_1f1b":
        if v < 2:
            raise ValueError(f"schedule: 'interleaved_1f1b' needs virtual stages V >= 2, the plan "
                             f"has V = {v}; use '1f1b'")
        if m % p:
            raise ValueError(f"embeddings: 'interleaved_1f1b' needs the number of microbatches to "
                             f"be a multiple of the {p} stages (as in Megatron), got {m}")


def stage_order(plan: PipelinePlan, num_microbatches: int, schedule: str, stage: int) -> List[Pass]:
    """The passes of `stage` in the order it runs them."""
    check_schedule(schedule, plan, num_microbatches)
    p, v, m_total = plan.num_stages, plan.virtual_stages, num_microbatches
    mine = [k for k in range(plan.num_chunks) if plan.stage_of(k) == stage]
    if schedule == "gpipe":
        return ([("F", m, k) for k in mine for m in range(m_total)]
                + [("B", m, k) for k in reversed(mine) for m in reversed(range(m_total))])
    if schedule == "1f1b":
        k = mine[0]
        warmup = min(p - stage - 1, m_total)
        order = [("F", m, k) for m in range(warmup)]
        for i in range(m_total - warmup):
            order += [("F", warmup + i, k), ("B", i, k)]
        return order + [("B", m, k) for m in range(m_total - warmup, m_total)]
    # Megatron's interleaved schedule: virtual microbatch i -> (microbatch, local chunk).
    total = m_total * v

    def virtual(i: int, forward: bool) -> Tuple[int, int]:
        in_group = i % (p * v)
        local = in_group // p
        local = local if forward else v - 1 - local
        return (i // (p * v)) * p + in_group % p, local * p + stage

    warmup = total if m_total == p else min((p - stage - 1) * 2 + (v - 1) * p, total)
    order = [("F",) + virtual(i, True) for i in range(warmup)]
    for i in range(total - warmup):
        order += [("F",) + virtual(warmup + i, True), ("B",) + virtual(i, False)]
    return order + [("B",) + virtual(i, False) for i in range(total - warmup, total)]


def simulate(plan: PipelinePlan, num_microbatches: int, schedule: str):
    """(events, clock): every pass and transfer in one global order, and the number of unit
    time steps the schedule takes (its makespan with F = B = 1 per chunk pass; the bubble is
    clock - 2 M V).  Raises RuntimeError if the per-stage orders cannot make progress."""
    check_schedule(schedule, plan, num_microbatches)
    last = plan.num_chunks - 1
    orders = [stage_order(plan, num_microbatches, schedule, s) for s in range(plan.num_stages)]
    pos = [0] * plan.num_stages
    done: Dict[Pass, int] = {}  # pass -> the step it ran in
    events: List[tuple] = []
    clock = 0
    while any(pos[s] < len(orders[s]) for s in range(plan.num_stages)):
        ran = []
        for s, order in enumerate(orders):
            if pos[s] == len(order):
                continue
            kind, m, k = order[pos[s]]
            if kind == "F":
                deps = [("F", m, k - 1)] if k > 0 else []
            else:
                deps = [("F", m, k)] + ([("B", m, k + 1)] if k < last else [])
            if all(done.get(d, clock) < clock for d in deps):
                ran.append((kind, m, k))
                pos[s] += 1
        if not ran:
            raise RuntimeError(f"schedule {schedule!r} stalls at step {clock} (positions {pos})")
        for ev in ran:
            done[ev] = clock
        events += ran
        for kind, m, k in ran:
            if kind == "F" and k < last:
                events.append(("send_F", m, k))
            elif kind == "B" and k > 0:
                events.append(("send_B", m, k))
        clock += 1
    return events, clock
