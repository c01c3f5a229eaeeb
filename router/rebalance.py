"""Rebalancing: running requests move from a worker with a queue to one with room.

Admission places each request on the worker that suits it best when it arrives; later, one
worker may hold a queue of requests it cannot start (its sequence slots or its KV pool full)
while another, joined since or emptied, has room. Workers never move work themselves. When a
worker's load reports have shown requests waiting for `hold_s`, and another's have shown none
waiting and free blocks for as long, the router moves one of its own running requests from the
first to the second per check: Preempt for recompute there (an abort), Submit with its output
so far here (router.generate), which frees a slot and its blocks on the busy worker for what
waits. Of the candidates it moves the one cheapest to compute again (prompt + output tokens,
the recompute's cost), among those whose reservation fits the target's budget; a request moves
at most once per `interval_s`, and only one with a single live choice on the GPU (its
choices' outputs differ, and all of a request's choices live on its reservation's worker).
Greedy and seeded sampling make the continuation what the first worker would have written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router.admission import Admission, Reservation

log = logging.getLogger("pagedserve.router")


@dataclass(frozen=True)
class RebalanceConfig:
    """--rebalance (on), --rebalance-after, --rebalance-interval."""

    enabled: bool = True
    hold_s: float = 2.0             # how long both the queue and the room must have lasted
    interval_s: float = 30.0        # a request moves at most once per this
    check_s: float = 0.5


@dataclass(eq=False)
class Movable:
    """A request this router runs, as rebalancing weighs it (router.generate keeps it current)."""

    request_id: str
    reservation: Reservation
    # Whether it can move now: one live choice, on the GPU, not taken off by the router.
    movable: Callable[[], bool]
    recompute_tokens: Callable[[], int]     # prompt + output so far
    # Moves it to the worker named (recompute there); False when that worker is gone.
    move_to: Callable[[str], bool]
    moved_at: float = float("-inf")


@dataclass
class _Since:
    """Since when a worker's reports have shown a queue (waiting) or room (no queue, free blocks)."""
    waiting: float | None = None
    room: float | None = None


@dataclass
class WorkerLoad:
    """What a check needs of one worker's latest load report."""
    worker_id: str
    waiting: int
    free_blocks: int
    accepting: bool


class Rebalancer:
    """Moves running requests between workers; see the module docstring."""

    def __init__(self, admission: Admission, loads: Callable[[], Iterable[WorkerLoad]],
                 config: RebalanceConfig = RebalanceConfig()) -> None:
        self.config = config
        self._admission = admission
        self._loads = loads
        self._running: set[Movable] = set()
        self._since: dict[str, _Since] = {}

    def add(self, movable: Movable) -> None:
        self._running.add(movable)

    def discard(self, movable: Movable) -> None:
        self._running.discard(movable)

    async def run(self) -> None:
        """Checks every `check_s` until cancelled."""
        while True:
            await asyncio.sleep(self.config.check_s)
            self.check(time.monotonic())

    def check(self, now: float) -> Movable | None:
        """One check at time `now`: the request moved, if any."""
        loads = {load.worker_id: load for load in self._loads()}
        for worker_id in set(self._since) - set(loads):
            del self._since[worker_id]
        for load in loads.values():
            since = self._since.setdefault(load.worker_id, _Since())
            since.waiting = (since.waiting if since.waiting is not None else now) if load.waiting else None
            has_room = load.accepting and not load.waiting and load.free_blocks > 0
            since.room = (since.room if since.room is not None else now) if has_room else None
        held = lambda t: t is not None and now - t >= self.config.hold_s  # noqa: E731
        hot = [w for w, s in self._since.items() if held(s.waiting)]
        cold = sorted((w for w, s in self._since.items() if held(s.room)),
                      key=lambda w: -loads[w].free_blocks)
        if not hot or not cold:
            return None
        budgets = {b.worker_id: b for b in self._admission.workers}
        candidates = sorted((m for m in self._running
                             if m.reservation.worker_id in hot and not m.reservation.suspended
                             and now - m.moved_at >= self.config.interval_s and m.movable()),
                            key=lambda m: m.recompute_tokens())
        for movable in candidates:
            for target in cold:
                budget = budgets.get(target)
                if budget is None or not budget.fits(movable.reservation.tokens):
                    continue
                source = movable.reservation.worker_id
                if movable.move_to(target):
                    movable.moved_at = now
                    self._since[target].room = None    # its next reports say whether room is left
                    log.info("rebalancing", extra={"request_id": movable.request_id, "source": source,
                                                   "target": target, "waiting": loads[source].waiting,
                                                   "recompute_tokens": movable.recompute_tokens()})
                    return movable
        return None
