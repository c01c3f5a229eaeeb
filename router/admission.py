"""Admission control: per-worker token budgets, a cap on concurrency, a bounded priority queue.

Each worker offers a budget of kv_capacity_tokens × overcommit tokens. A request reserves
(prompt + max_tokens) × n of them on the worker it is placed on, for as long as it runs: the
most KV it could ever need (router.requests resolves max_tokens so that prompt + max_tokens never
exceeds max_model_len). An overcommit above 1 bets that requests seldom reach max_tokens;
when the bet is lost the worker preempts, it does not fail.

A request that fits nowhere waits in a queue bounded in length (max_queue_len) and in time
(max_wait_s); past either bound it fails with Overloaded, which carries a retry-after hint in
whole seconds.

The queue is ordered by (priority, arrival): a lower priority value comes first (as the API
promises, "lower values are served sooner"), and requests of equal priority keep their arrival
order (FIFO). Only the head of that order is ever placed: a request is placed once every waiter
before it in the order has been placed or has given up. A newcomer is placed at once only when
no waiter comes before it (the queue is empty, or every waiter has a worse, i.e. higher,
priority value) and it fits right now; otherwise it queues, even when it would fit. A newcomer
that would have to wait while the queue is full fails with Overloaded whatever its priority: it
never displaces a waiter.

Within one priority, a large request at the head is therefore never starved by a stream of small
ones that each fit; the price is that requests behind it wait (head-of-line blocking) until room
frees up for it. Requests of a better priority do overtake it, and a steady stream of them can
keep it waiting; the max_wait_s bound keeps either wait finite.

Several router replicas share each worker without talking to each other, through the worker's
load reports (`observe_load`): a report says how many tokens the other replicas' requests
hold there and how many replicas (sessions) share it. Until its next report, a replica may
reserve what it holds plus a 1/num_sessions share of the room the others leave (less, for
each other replica, what its own Submits not yet counted by the report will hold, which the
others' reports miss as well), so replicas that decide at the same moment, from pictures
taken while Submits were on their way, cannot overfill the worker together.
What a replica releases it may reuse at once only in part, a 1/num_sessions share: a request
that finished left the worker's count before its finish reached this replica, so the others
may have seen its tokens free and taken their shares of them; the rest comes back with the
next report (alone on a worker, a replica reuses all of it at once). A request
larger than one share, which could never fit one, may instead take the whole room, at most
once per report (WorkerBudget.fits). docs/serving.md states the guarantee this gives.

The prompts of one client request (a completions batch) share a `Batch`: such a prompt waits
for its own batch without limit, since the room it waits for is what its siblings hold and will
give back, so it does not expire while a sibling holds a reservation (its wait limit starts
afresh once none does); and only the batch's first prompt is held to the queue's length bound.
Otherwise a batch larger than the pool failed as a whole when its last prompts had waited
max_wait_s behind its first ones, and so did every retry.

A reservation can be suspended (`Reservation.suspend`: router.preemption took its request off
the GPU for a more urgent one), which gives its tokens back while the request lives on, and
resumed (`Reservation.resume`): it queues again at its original place in the order, past the
queue's bounds (the request already runs for its client), until a worker has room for it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class AdmissionError(Exception):
    """A request could not be admitted."""


class Overloaded(AdmissionError):
    """The queue is full, or the request waited too long (RESOURCE_EXHAUSTED / HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        # Whole seconds, rounded up, once: the message and the retry-after trailer say the same.
        self.retry_after_s: int = math.ceil(retry_after_s)
        super().__init__(f"{message}; retry in about {self.retry_after_s} s")


class NoWorkers(AdmissionError):
    """No worker accepts requests (UNAVAILABLE / HTTP 503)."""


class RequestTooLarge(AdmissionError):
    """The request needs more tokens than any worker's whole budget (INVALID_ARGUMENT)."""


def reservation_tokens(prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
    """Tokens a request reserves: the most KV its n choices could fill."""
    return (prompt_tokens + max_tokens) * n


@dataclass(frozen=True)
class AdmissionConfig:
    """Limits of admission control."""

    overcommit: float = 1.0             # budget = KV capacity in tokens × overcommit
    max_concurrent_requests: int = 1024  # admitted and not yet released, over all workers
    max_queue_len: int = 256            # requests waiting to be admitted
    max_wait_s: float = 30.0            # longest a request waits before Overloaded


@dataclass(eq=False)
class WorkerBudget:
    """One worker's token budget, as this router replica sees it (see the module docstring)."""

    worker_id: str
    capacity_tokens: int
    accepting: bool = True  # False while the worker drains or is not ready
    reserved_tokens: int = 0  # by this replica
    num_requests: int = 0
    # From the latest load report: the replicas sharing the worker, what the others' requests
    # hold there, and how much this replica may hold until the next report (what it held then
    # plus its share of the room left). Before a first report, a replica counts itself alone.
    num_sessions: int = 1
    others_tokens: int = 0
    limit_tokens: int | None = None
    claimed_since_report: bool = False

    @property
    def room_tokens(self) -> int:
        """What the other replicas leave of the capacity, less what this one holds."""
        return self.capacity_tokens - self.others_tokens - self.reserved_tokens

    @property
    def free_tokens(self) -> int:
        """What this replica may reserve there now: the room, within its share."""
        if self.limit_tokens is None:
            return self.room_tokens
        return min(self.room_tokens, self.limit_tokens - self.reserved_tokens)

    def fits(self, tokens: int) -> bool:
        """Whether a request of `tokens` may be placed here now. One larger than a share of the
        whole capacity could never fit a share: it may take the whole room instead, if this
        replica has claimed nothing since the report (so that each replica overfills the worker
        by one such request at most)."""
        if tokens <= self.free_tokens:
            return True
        return (tokens > self.capacity_tokens // self.num_sessions
                and not self.claimed_since_report and tokens <= self.room_tokens)


# Picks the worker for a request among those it fits on (never empty); None declines them all.
WorkerChooser = Callable[[list[WorkerBudget]], WorkerBudget | None]


@dataclass(eq=False)
class Batch:
    """The prompts of one client request, admitted one by one (see the module docstring)."""

    members: int = 0      # prompts that asked for a reservation so far
    holding: int = 0      # reservations of the batch on a worker now (not released or suspended)
    overdue: list[_Waiter] = field(default_factory=list)   # past their wait limit while holding


@dataclass(frozen=True)
class QueuedRequest:
    """The head of the admission queue, as router.preemption weighs it."""

    tokens: int
    priority: int
    request_id: str  # for logs and traces ("" when the caller named none)


@dataclass(eq=False)
class Reservation:
    """Tokens held on one worker for one admitted request, until release()."""

    tokens: int
    worker: WorkerBudget
    _admission: Admission = field(repr=False)
    order: tuple[int, int] = (0, 0)  # its place in the queue's order: (priority, arrival)
    request_id: str = ""
    batch: Batch | None = None
    _admitted_at: float = field(default_factory=time.monotonic, repr=False)
    released: bool = False
    suspended: bool = False  # its tokens are given back until resume()
    _resuming: _Waiter | None = field(default=None, repr=False)

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    def release(self) -> None:
        """Gives the tokens back. Idempotent."""
        self._admission._release(self)

    def move_to(self, worker_id: str) -> None:
        """Moves the reservation to another worker (migration), even past its budget: a request
        already running must not queue behind new ones."""
        self._admission._move(self, worker_id)

    def suspend(self) -> None:
        """Gives the tokens (and the concurrency slot) back while the request lives on, off the
        GPU; resume() takes them again. Idempotent."""
        self._admission._suspend(self)

    async def resume(self, choose: WorkerChooser) -> None:
        """Waits in the queue, at the reservation's original place in the order and past the
        queue's bounds, until a worker `choose` picks has room; the reservation is then on it."""
        await self._admission._resume(self, choose)


@dataclass(eq=False)
class _Waiter:
    tokens: int
    choose: WorkerChooser
    granted: asyncio.Future[Reservation]
    order: tuple[int, int]  # (priority, arrival sequence number): the queue's sort key
    request_id: str = ""
    resuming: Reservation | None = None  # a suspended reservation to place again, else a new one
    batch: Batch | None = None
    deadline: asyncio.TimerHandle | None = None     # when it stops waiting (max_wait_s)


class Admission:
    """Admits requests onto workers within their token budgets; see the module docstring.

    Not thread-safe: use it from one event loop.
    """

    # Weight of the newest sample in the running mean of how long requests hold reservations.
    _HOLD_TIME_SMOOTHING = 0.1

    def __init__(self, config: AdmissionConfig = AdmissionConfig()) -> None:
        self.config = config
        self._workers: dict[str, WorkerBudget] = {}
        self._queue: list[_Waiter] = []  # sorted by _Waiter.order; the head is [0]
        self._arrivals = itertools.count()
        self._num_admitted = 0
        self._mean_hold_s = 1.0  # until the first release says otherwise
        # Called whenever the queue's head cannot be placed (router.preemption listens). It must
        # not call back into admission before returning: it runs in the middle of placing.
        self.on_blocked: Callable[[], None] = lambda: None

    @property
    def workers(self) -> list[WorkerBudget]:
        return list(self._workers.values())

    @property
    def num_admitted(self) -> int:
        return self._num_admitted

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def head(self) -> QueuedRequest | None:
        """The request placed next, once a worker has room for it."""
        for waiter in self._queue:
            if not waiter.granted.done():
                priority = waiter.order[0]
                return QueuedRequest(waiter.tokens, priority, waiter.request_id)
        return None

    def set_worker(self, worker_id: str, kv_capacity_tokens: int, accepting: bool = True) -> None:
        """Adds a worker, or updates its capacity and whether it accepts requests."""
        capacity = int(kv_capacity_tokens * self.config.overcommit)
        worker = self._workers.get(worker_id)
        if worker is None:
            self._workers[worker_id] = WorkerBudget(worker_id, capacity, accepting)
        else:
            worker.capacity_tokens, worker.accepting = capacity, accepting
        self._admit_waiters()

    def remove_worker(self, worker_id: str) -> None:
        """Forgets a worker. Reservations still on it hold nothing until moved or released."""
        self._workers.pop(worker_id, None)

    def observe_load(self, worker_id: str, tokens_in_flight: int, own_tokens_in_flight: int,
                     num_sessions: int, unread_tokens: int = 0) -> None:
        """A worker's load report: every replica's requests hold `tokens_in_flight` tokens there,
        this one's `own_tokens_in_flight` of them, and `num_sessions` replicas share it;
        `unread_tokens` of this replica's reservations there were not counted yet (their Submits
        were on their way). Sets this replica's share of the room until the next report (see the
        module docstring)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.num_sessions = max(num_sessions, 1)
        # Measured by the worker at one moment: exact, if already a little old.
        worker.others_tokens = max(tokens_in_flight - own_tokens_in_flight, 0)
        # Another replica's report missed this one's unread Submits too, so its room holds them
        # as free: each of the N - 1 others may take a 1/N share of them. Leaving (N - 1) times
        # them out of this replica's room makes the shares sum to the true room whatever is in
        # flight (room_i = true room + the others' unread; sum over i of (room_i - (N-1) unread_i) / N).
        room = worker.room_tokens - (worker.num_sessions - 1) * unread_tokens
        share = max(room, 0) // worker.num_sessions
        worker.limit_tokens = worker.reserved_tokens + share
        worker.claimed_since_report = False
        self._admit_waiters()

    async def reserve(self, tokens: int, choose: WorkerChooser, priority: int = 0,
                      request_id: str = "", batch: Batch | None = None) -> Reservation:
        """Reserves tokens on a worker picked by `choose`, waiting in the queue if need be.

        A lower `priority` value is served sooner; see the module docstring. Raises NoWorkers,
        RequestTooLarge or Overloaded. Cancelling the caller while it waits leaves nothing
        reserved. `request_id` names the request in what router.preemption logs and traces;
        `batch`, the other prompts of its client request, if any.
        """
        if tokens < 1:
            raise ValueError(f"tokens={tokens} must be >= 1")
        accepting = [w for w in self._workers.values() if w.accepting]
        if not accepting:
            raise NoWorkers("no worker is ready to accept requests")
        largest = max(w.capacity_tokens for w in accepting)
        if tokens > largest:
            raise RequestTooLarge(f"the request needs {tokens} tokens (prompt + max_tokens, at "
                                  f"most max_model_len, times n) but a worker holds at most {largest}")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(tokens, choose, loop.create_future(), (priority, next(self._arrivals)),
                         request_id, batch=batch)
        first_of_batch = batch is None or batch.members == 0
        if batch is not None:
            batch.members += 1
        if not self._queue or self._queue[0].order > waiter.order:  # no waiter comes before it
            reservation = self._place(waiter)
            if reservation is not None:
                return reservation
        if len(self._queue) >= self.config.max_queue_len and first_of_batch:
            raise Overloaded(f"{len(self._queue)} requests are already waiting",
                             self._retry_after_s())

        bisect.insort(self._queue, waiter, key=lambda w: w.order)
        self.on_blocked()
        waiter.deadline = loop.call_later(self.config.max_wait_s, self._expire, waiter)
        try:
            return await waiter.granted
        except BaseException:
            # Cancelled after being granted but before resuming: the reservation is ours to free.
            granted = waiter.granted
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                granted.result().release()
            self._leave_queue(waiter)
            raise
        finally:
            waiter.deadline.cancel()

    def _place(self, waiter: _Waiter) -> Reservation | None:
        """Books the waiter's tokens on a worker its chooser picks among those it fits; None
        when it fits nowhere now."""
        if self._num_admitted >= self.config.max_concurrent_requests:
            return None
        fits = [w for w in self._workers.values() if w.accepting and w.fits(waiter.tokens)]
        worker = waiter.choose(fits) if fits else None
        if worker is None:
            return None
        worker.reserved_tokens += waiter.tokens
        worker.num_requests += 1
        worker.claimed_since_report = True
        self._num_admitted += 1
        if waiter.batch is not None:
            waiter.batch.holding += 1
        reservation = waiter.resuming
        if reservation is None:
            return Reservation(waiter.tokens, worker, self, waiter.order, waiter.request_id, waiter.batch)
        reservation.worker, reservation.suspended, reservation._resuming = worker, False, None
        return reservation

    def _admit_waiters(self) -> None:
        """Places waiters from the head of the queue for as long as the head fits."""
        while self._queue:
            waiter = self._queue[0]
            if waiter.granted.done():  # cancelled; its task has yet to clean up
                self._queue.pop(0)
                continue
            try:
                reservation = self._place(waiter)
            except Exception as error:  # a broken chooser fails its own request, not a release
                self._queue.pop(0)
                waiter.granted.set_exception(error)
                continue
            if reservation is None:
                self.on_blocked()
                return
            self._queue.pop(0)
            waiter.granted.set_result(reservation)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.granted.done():
            return
        if waiter.batch is not None and waiter.batch.holding:
            waiter.batch.overdue.append(waiter)     # it waits for its own batch: see _give_back
            return
        self._leave_queue(waiter)
        waiter.granted.set_exception(Overloaded(
            f"no worker had room within the queue wait limit of {self.config.max_wait_s:g} s "
            "(--max-queue-wait)",
            self._retry_after_s()))

    def _leave_queue(self, waiter: _Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            return  # granted or expired already
        self._admit_waiters()  # the head may have changed, and the new one may fit

    def _release(self, reservation: Reservation) -> None:
        if reservation.released:
            return
        reservation.released = True
        if reservation._resuming is not None:  # it will never take a place again
            reservation._resuming.granted.cancel()
            self._leave_queue(reservation._resuming)
            reservation._resuming = None
        if reservation.suspended:
            return  # it holds nothing
        held_s = time.monotonic() - reservation._admitted_at
        self._mean_hold_s += self._HOLD_TIME_SMOOTHING * (held_s - self._mean_hold_s)
        worker = reservation.worker
        if worker.limit_tokens is not None and worker.num_sessions > 1:
            # A request that finished was dropped from the worker's count before its finish
            # reached this replica, so another replica's report may have shown its tokens free
            # already, and that replica may take its 1/N share of them: this one keeps the same
            # share for reuse at once, the rest waits for the next report.
            worker.limit_tokens -= reservation.tokens - reservation.tokens // worker.num_sessions
        self._give_back(reservation)

    def _suspend(self, reservation: Reservation) -> None:
        if reservation.released or reservation.suspended:
            return
        reservation.suspended = True
        self._give_back(reservation)

    def _give_back(self, reservation: Reservation) -> None:
        reservation.worker.reserved_tokens -= reservation.tokens
        reservation.worker.num_requests -= 1
        self._num_admitted -= 1
        batch = reservation.batch
        if batch is not None:
            batch.holding -= 1
            if not batch.holding:   # its overdue prompts wait for others now: a fresh limit
                loop = asyncio.get_running_loop()
                for waiter in batch.overdue:
                    if not waiter.granted.done():
                        waiter.deadline = loop.call_later(self.config.max_wait_s, self._expire, waiter)
                batch.overdue.clear()
        self._admit_waiters()

    async def _resume(self, reservation: Reservation, choose: WorkerChooser) -> None:
        if reservation.released or not reservation.suspended or reservation._resuming is not None:
            raise ValueError("only a suspended reservation, not already resuming, can resume")
        waiter = _Waiter(reservation.tokens, choose, asyncio.get_running_loop().create_future(),
                         reservation.order, reservation.request_id, resuming=reservation,
                         batch=reservation.batch)
        reservation._resuming = waiter
        bisect.insort(self._queue, waiter, key=lambda w: w.order)
        self._admit_waiters()
        try:
            await waiter.granted
        except BaseException:  # cancelled while it waited, or its chooser broke: still suspended
            if reservation._resuming is waiter:
                reservation._resuming = None
                self._leave_queue(waiter)
            raise

    def _move(self, reservation: Reservation, worker_id: str) -> None:
        if reservation.released or reservation.suspended:
            raise ValueError("cannot move a released or suspended reservation")
        target = self._workers.get(worker_id)
        if target is None:
            raise ValueError(f"unknown worker {worker_id!r}")
        source = reservation.worker
        source.reserved_tokens -= reservation.tokens
        source.num_requests -= 1
        target.reserved_tokens += reservation.tokens
        target.num_requests += 1
        reservation.worker = target
        self._admit_waiters()

    def _retry_after_s(self) -> float:
        """Roughly when a request arriving now would get in: the queue ahead of it drains at
        about (requests admitted / mean hold time) requests per second."""
        drain_rate = max(self._num_admitted, 1) / max(self._mean_hold_s, 1e-3)
        return min(max((len(self._queue) + 1) / drain_rate, 1.0), 60.0)
