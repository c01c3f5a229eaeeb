"""Priority across the fleet: the router takes less urgent requests off a worker's GPU so that a
more urgent one, which fits nowhere, runs at once.

Each worker preempts on its own when its pool runs short, but it sees only its own queue; the
router sees the whole fleet. When the head of admission's queue (router.admission) fits no
worker and is more urgent (a lower priority value) than requests this router runs, the policy
looks on each worker for the least urgent of those requests (the highest priority value first,
the latest admitted first among equals, as a worker's scheduler picks its own victims), taking
them until the head would fit, and chooses the worker where that frees the fewest tokens: the
least work disturbed. It takes those requests off the GPU (router.generate: SwapOut, which
keeps their KV in the worker's host swap space, or, when the worker reports too little swap
space, Abort, to be computed again from the output so far) and suspends their reservations, so
that admission places the head there at once. Each one then queues again with its own priority
and its original arrival, and runs again as soon as admission has room for it: swapped in where
its KV waits, or, when another worker has room first, resubmitted there with its output so far.

Guards against thrash: a request is never preempted for one equally or less urgent, and it runs
at least `min_run_s` after its admission, or its return, before it may be preempted again; a
request is preempted only while every choice of it runs on the GPU. A router replica sees only
its own requests, so it preempts only those.

The policy decides when admission reports its head blocked (on every arrival and release, and
on every load report: several times a second while anything waits), on the next turn of the
event loop, never in the middle of admission's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from router.admission import Admission, QueuedRequest, Reservation, WorkerBudget

log = logging.getLogger("pagedserve.router")

# Why the router takes a request off a GPU, as metrics, logs and traces name it.
PRIORITY = "priority"


@dataclass(frozen=True)
class PreemptionConfig:
    """The router's priority policy (--preempt-for-priority, --preemption-min-run)."""

    enabled: bool = True
    # A request runs at least this long after its admission or return before it may be
    # preempted again: each preemption costs a swap (or a recompute) both ways.
    min_run_s: float = 1.0


@dataclass(eq=False)
class Running:
    """A request this router runs, as the policy weighs it (router.generate keeps it current)."""

    request_id: str
    priority: int
    reservation: Reservation
    # Whether every live choice of it runs on the GPU now (admitted or resumed, not preempted).
    on_gpu: Callable[[], bool]
    # Takes it off its worker's GPU and suspends its reservation, for the request named.
    swap_out: Callable[[str], None]
    running_since: float = field(default_factory=time.monotonic)  # its admission or last return


@dataclass(frozen=True)
class Plan:
    """What to preempt where so that the head of the queue fits."""

    worker_id: str
    victims: tuple[Running, ...]
    freed_tokens: int


def plan_room(head: QueuedRequest, workers: Sequence[WorkerBudget], running: Iterable[Running],
              now: float, min_run_s: float) -> Plan | None:
    """The worker where preempting the least urgent of the running requests frees the fewest
    tokens and lets `head` in, and those requests; None when the head fits somewhere already,
    or when no worker has enough it may preempt."""
    if any(w.accepting and w.fits(head.tokens) for w in workers):
        return None
    candidates = [r for r in running
                  if r.priority > head.priority and not r.reservation.suspended
                  and now - r.running_since >= min_run_s and r.on_gpu()]
    # Least urgent first: the highest priority value, then the latest arrival.
    candidates.sort(key=lambda r: r.reservation.order, reverse=True)
    plans = []
    for worker in workers:
        if not worker.accepting:
            continue
        missing = head.tokens - worker.free_tokens
        victims, freed = [], 0
        for victim in (r for r in candidates if r.reservation.worker is worker):
            if freed >= missing:
                break
            victims.append(victim)
            freed += victim.reservation.tokens
        if freed >= missing:
            plans.append(Plan(worker.worker_id, tuple(victims), freed))
    return min(plans, key=lambda p: (p.freed_tokens, len(p.victims), p.worker_id), default=None)


class PriorityPreemption:
    """The policy over one router's admission; see the module docstring."""

    def __init__(self, admission: Admission, config: PreemptionConfig = PreemptionConfig()) -> None:
        self.config = config
        self._admission = admission
        self._running: set[Running] = set()
        self._check_due = False
        admission.on_blocked = self._schedule_check

    def add(self, running: Running) -> None:
        """A request this router runs from now on (router.generate, once it is dispatched)."""
        self._running.add(running)

    def discard(self, running: Running) -> None:
        self._running.discard(running)

    def _schedule_check(self) -> None:
        if not self._check_due:
            self._check_due = True
            asyncio.get_running_loop().call_soon(self._check)

    def _check(self) -> None:
        self._check_due = False
        head = self._admission.head
        if head is None:
            return
        plan = plan_room(head, self._admission.workers, self._running, time.monotonic(),
                         self.config.min_run_s)
        if plan is None:
            return
        log.info("preempting for a more urgent request", extra={
            "request_id": head.request_id, "priority": head.priority, "worker": plan.worker_id,
            "preempted": ",".join(v.request_id for v in plan.victims),
            "freed_tokens": plan.freed_tokens})
        for victim in plan.victims:
            victim.swap_out(head.request_id)
