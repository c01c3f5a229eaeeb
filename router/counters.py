"""What the router has seen happen to requests, counted in-process and in Prometheus.

One `RouterCounters` per router; `count` bumps a counter, logs the event with its context and
records it in the router's Prometheus series, so the numbers, the log lines and the metrics
never disagree. The series are labelled with the served model's name, which a router without
--served-model-name learns only from its first worker: they are attached then (`attach`), and
the refusals counted before that are added to them at once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.metrics import PREEMPTION_MODES, ROUTER_REJECT_REASONS, ROUTER_SWAP_REASONS, RouterMetrics

log = logging.getLogger("pagedserve.router")

# The counters that are also Prometheus series, and how each is recorded there.
_SERIES: dict[str, Callable[[RouterMetrics], None]] = {
    **{f"rejected_{reason}": (lambda m, r=reason: m.rejected(r)) for reason in ROUTER_REJECT_REASONS},
    **{f"preemptions_{mode}": (lambda m, p=mode: m.preempted(p)) for mode in PREEMPTION_MODES},
    **{f"swap_outs_{reason}": (lambda m, r=reason: m.swapped_out(r)) for reason in ROUTER_SWAP_REASONS},
    **{f"swap_ins_{reason}": (lambda m, r=reason: m.swapped_in(r)) for reason in ROUTER_SWAP_REASONS},
    "migrations": RouterMetrics.migrated,
    "rebalances": RouterMetrics.rebalanced,
    "redispatches": RouterMetrics.redispatched,
    "workers_lost": RouterMetrics.worker_lost,
}


@dataclass
class RouterCounters:
    """Event counts since the router started."""

    requests: int = 0               # Generate calls admitted
    rejected_invalid: int = 0       # refused with INVALID_ARGUMENT before admission
    rejected_overloaded: int = 0    # answered RESOURCE_EXHAUSTED by admission
    rejected_unavailable: int = 0   # answered UNAVAILABLE: no worker could take them
    rejected_not_found: int = 0     # asked for a model not served here
    preemptions_swap: int = 0       # PREEMPTED events with mode SWAP
    preemptions_recompute: int = 0  # PREEMPTED events with mode RECOMPUTE (including drains)
    redispatches: int = 0           # choices resubmitted after their worker was lost or drained
    migrations: int = 0             # choices moved by the router's own choice after a preemption
    rebalances: int = 0             # running choices moved off a worker with a queue (router.rebalance)
    swap_outs_priority: int = 0     # choices the router took off a GPU for a more urgent request
    swap_ins_priority: int = 0      # of those, choices that run again
    swap_outs_slow_reader: int = 0  # choices swapped out while their client did not read
    swap_ins_slow_reader: int = 0   # of those, choices that run again
    workers_lost: int = 0           # worker sessions that ended after the worker joined
    # The Prometheus series, once the model's name is known; None before.
    metrics: RouterMetrics | None = field(default=None, repr=False, compare=False)

    def count(self, name: str, event: str, **context: object) -> None:
        """Adds one to counter `name`, logs `event` with its context and the new total, and
        records it in the metrics when the counter is a series."""
        total = getattr(self, name) + 1
        setattr(self, name, total)
        log.info(event, extra={**context, name: total})
        if self.metrics is not None and name in _SERIES:
            _SERIES[name](self.metrics)

    def attach(self, metrics: RouterMetrics) -> None:
        """Records events in `metrics` from now on; the refusals counted so far (requests can
        be refused before the model's name is known, nothing else can happen) are added now."""
        for reason in ROUTER_REJECT_REASONS:
            metrics.rejected(reason, getattr(self, f"rejected_{reason}"))
        self.metrics = metrics

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "metrics"}
