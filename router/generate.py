"""One admitted Generate request, carried across workers until every choice has finished.

Each choice is its own dispatch: one Submit (n=1, the choice's seed) under a fresh internal id,
so a choice sent again never collides with what an earlier dispatch left behind, and news about
an abandoned dispatch id is ignored. All of a request's dispatches report into one inbox, and
what arrives together goes out together: the choices of one engine step share one response.

A choice moves to another worker, carrying its prompt and the tokens generated so far, when its
worker is lost or, draining, hands it back (re-dispatch); or when its worker preempted it by
recompute and another worker has clearly more free blocks (migration: recompute costs the same
anywhere, and the other worker can start now). A swapped-out choice stays: its KV is kept and
resuming it is cheap. Greedy and seeded sampling make the continuation exactly what the first
worker would have produced, so the client's stream has no gap and no duplicate.

The request's choices live on the worker its reservation is on; re-dispatched choices follow the
reservation when it moves, and only a request with a single live choice migrates.

The router may also take a request off its worker's GPU itself, for a more urgent one
(router.preemption): its choices are swapped out, or aborted where the worker reports too little
swap space, and its reservation is suspended. Once admission has room for it again they run
again: swapped in where their KV waits or, where it does not (aborted, or the room is on another
worker), submitted with their output so far. While it is out, a choice whose worker is lost or hands it back simply waits for that.

Prompt logprobs, which choice 0's dispatches compute, go out once each: a dispatch moved before
they were all in computes them again from the start, and those already sent are skipped.

Traced, every dispatch is a CLIENT span under the request's span, from Submit to the choice's
end or move; its context travels in the Submit, so the worker's span is its child. Preemptions,
migrations and re-dispatches are events of the request's span.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from common import tracing
from common.convert import PREEMPTION_MODE_NAMES
from common.pb import generation_pb2 as pb
from common.pb import worker_pb2
from router.admission import Reservation, WorkerBudget, WorkerChooser
from router.counters import RouterCounters
from router.detokenizer import TextStream
from router.errors import ApiError, invalid_argument, refusal_code, unavailable
from router.fleet import Fleet
from router.preemption import PRIORITY, PriorityPreemption, Running
from router.rebalance import Movable, Rebalancer
from router.requests import PreparedRequest
from router.worker_client import Incoming, WorkerClient, WorkerLost

log = logging.getLogger("pagedserve.router")

_FINISH_REASONS = {worker_pb2.FINISH_REASON_STOP: pb.FINISH_REASON_STOP,
                   worker_pb2.FINISH_REASON_LENGTH: pb.FINISH_REASON_LENGTH}
# The span events of the request's span for a choice's moves, by counter.
_MOVE_EVENTS = {"redispatches": "redispatched", "migrations": "migrated", "rebalances": "rebalanced"}


# Why the router took a request off its GPU: for a more urgent one, or because its client
# stopped reading its stream.
SLOW_READER = "slow_reader"


@dataclass(frozen=True)
class RunConfig:
    max_moves_per_choice: int = 3       # re-dispatches and migrations; then UNAVAILABLE
    migrate_on_preemption: bool = True
    # A migration target needs free blocks >= what the choice needs + this × the source's free.
    migration_free_ratio: float = 2.0
    # A client that has not taken the next response for this long (its stream is backed up:
    # gRPC flow control, or the HTTP response buffer) while its request holds the GPU has the
    # request swapped out until it has read what was waiting; 0: never.
    slow_reader_s: float = 10.0
    # ... or sooner, once this many worker messages (about one token each) wait behind it.
    slow_reader_backlog: int = 1024


@dataclass(frozen=True)
class _Returned:
    """Admission has room again for a request router.preemption took off its GPU: the wait's
    outcome, delivered to the request's inbox so that its one loop handles it in turn."""

    wait: asyncio.Future[None]


@dataclass(frozen=True)
class _Out:
    """A request router.preemption took off its worker's GPU, until it runs again."""

    returning: asyncio.Future[None]  # admission's wait for room
    reason: str = PRIORITY               # or SLOW_READER: why it is out
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Choice:
    index: int
    text: TextStream
    output: list[int] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    worker: WorkerClient | None = None
    dispatch_id: str = ""
    moves: int = 0
    span: Span | None = None  # the current dispatch's, when traced
    on_gpu: bool = False  # its worker admitted or resumed the dispatch, and has not preempted it
    parked: bool = False  # off every worker while the request is out: submitted on its return
    prompt_logprobs_received: int = 0   # from the current dispatch (they start over with each)

    @property
    def finished(self) -> bool:
        return self.finish_reason != pb.FINISH_REASON_UNSPECIFIED


class GenerateRun:
    """Streams one admitted request's responses; see the module docstring."""

    def __init__(self, request: PreparedRequest, reservation: Reservation, fleet: Fleet,
                 counters: RouterCounters, config: RunConfig,
                 next_dispatch_id: Callable[[], str], span: Span | None = None,
                 preemption: PriorityPreemption | None = None, rebalancer: Rebalancer | None = None) -> None:
        """`span`: the request's span, parent of the dispatch spans (None: not traced);
        `preemption`: the policy that may take it off its GPU for a more urgent one;
        `rebalancer`: the one that may move it off a worker with a queue."""
        self.request = request
        self._reservation = reservation
        self._fleet = fleet
        self._counters = counters
        self._config = config
        self._next_dispatch_id = next_dispatch_id
        self._span = span
        self._trace_parent = trace.set_span_in_context(span) if span is not None else None
        self._inbox: asyncio.Queue[Incoming | _Returned] = asyncio.Queue()
        self._preemption = preemption
        self._running = Running(request.request_id, request.priority, reservation,
                                on_gpu=lambda: all(c.on_gpu for c in self._choices if not c.finished),
                                swap_out=self._swap_out)
        self._out: _Out | None = None
        self._rebalancer = rebalancer
        self._movable = Movable(request.request_id, reservation, movable=self._can_move,
                                recompute_tokens=lambda: len(request.prompt_token_ids) + self.completion_tokens,
                                move_to=self._rebalance_to)
        # While a response waits for its client to take it: since when (None: it was taken),
        # and the event set once the client has taken every response waiting.
        self._blocked_since: float | None = None
        self._caught_up = asyncio.Event()
        tokenizer = fleet.model.tokenizer
        self._tokenizer = tokenizer
        self._choices = [
            _Choice(i, TextStream(tokenizer and tokenizer.hf, prompt_token_ids=request.prompt_token_ids,
                                  stop=request.stop,
                                  include_stop_str_in_output=request.include_stop_str_in_output,
                                  skip_special_tokens=request.skip_special_tokens))
            for i in range(request.n)]
        # Prompt logprobs (choice 0's dispatches compute them): how many prompt tokens' entries
        # have gone out, and those for the next response.
        self._prompt_logprobs_sent = 0
        self._prompt_logprobs: list[pb.TokenLogprobs] = []

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output) for c in self._choices)

    @property
    def finish_reasons(self) -> list[str]:
        return [pb.FinishReason.Name(c.finish_reason) for c in self._choices]

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """The request's stream: a first message with the prompt's length, then the choices'
        progress. Closing it early (client gone) aborts whatever still runs on workers."""
        watcher: asyncio.Task | None = None
        try:
            yield pb.GenerateResponse(request_id=self.request.request_id, usage=pb.Usage(
                prompt_tokens=len(self.request.prompt_token_ids)))
            worker = self._fleet.workers.get(self._reservation.worker_id)
            if worker is None:
                worker = self._retarget(exclude=None, reason="its worker left before dispatch")
            for choice in self._choices:
                self._dispatch(choice, worker)
            if self._preemption is not None:
                self._preemption.add(self._running)
            if self._rebalancer is not None:
                self._rebalancer.add(self._movable)
            watcher = asyncio.create_task(self._watch_reader()) if self._config.slow_reader_s > 0 else None
            while not all(c.finished for c in self._choices):
                if self._inbox.empty():
                    self._caught_up.set()       # every response went out: a slow reader may return
                batch = [await self._inbox.get()]
                while not self._inbox.empty():
                    batch.append(self._inbox.get_nowait())
                deltas: dict[int, pb.ChoiceDelta] = {}
                for incoming in batch:
                    self._handle(incoming, deltas)
                response = self._response(deltas)
                if response.choices or response.HasField("usage") or response.prompt_logprobs:
                    self._blocked_since = time.monotonic()
                    yield response
                    self._blocked_since = None
        finally:
            if watcher is not None:
                watcher.cancel()
            if self._preemption is not None:
                self._preemption.discard(self._running)
            if self._rebalancer is not None:
                self._rebalancer.discard(self._movable)
            if self._out is not None:
                self._out.returning.cancel()
            for choice in self._choices:
                if not choice.finished and choice.worker is not None:
                    choice.worker.abort([choice.dispatch_id])
                _end_span(choice)

    def _handle(self, incoming: Incoming | _Returned, deltas: dict[int, pb.ChoiceDelta]) -> None:
        if isinstance(incoming, _Returned):
            self._on_return(incoming)
            return
        choice = self._choices[incoming.tag]
        if choice.finished or incoming.dispatch_id != choice.dispatch_id:
            return  # news about a dispatch already abandoned
        payload = incoming.payload
        if isinstance(payload, WorkerLost):
            self._redispatch(choice, payload.reason)
        elif isinstance(payload, worker_pb2.RequestDelta):
            self._on_delta(choice, payload, deltas)
        else:
            self._on_event(choice, payload, incoming.worker)

    def _on_delta(self, choice: _Choice, delta: worker_pb2.RequestDelta,
                  deltas: dict[int, pb.ChoiceDelta]) -> None:
        if delta.finish_reason == worker_pb2.FINISH_REASON_ABORT:
            # The router forgets a dispatch before aborting it, so this abort is the worker's own.
            self._redispatch(choice, "the worker aborted it")
            return
        if self.request.params.prompt_logprobs is not None and choice.index == 0:
            self._take_prompt_logprobs(choice, delta)
        out = deltas.setdefault(choice.index, pb.ChoiceDelta(index=choice.index))
        tokens = list(delta.new_token_ids)
        choice.output += tokens
        out.token_ids.extend(tokens)
        if self.request.params.logprobs is not None:
            out.logprobs.extend(self._logprobs(token, entry)
                                for token, entry in zip(tokens, delta.logprobs))
        piece = choice.text.push(tokens)
        out.text += piece.text
        if piece.stopped:  # a stop string: the worker would go on, so end it here
            choice.worker.abort([choice.dispatch_id], stop_string=True)
            self._finish(choice, out, pb.FINISH_REASON_STOP)
        elif delta.finish_reason != worker_pb2.FINISH_REASON_NONE:
            choice.worker.forget(choice.dispatch_id)
            last = choice.text.finish()
            out.text += last.text
            self._finish(choice, out, pb.FINISH_REASON_STOP if last.stopped
                         else _FINISH_REASONS[delta.finish_reason])

    def _take_prompt_logprobs(self, choice: _Choice, delta: worker_pb2.RequestDelta) -> None:
        """Queues a delta's prompt logprobs for the next response, each prompt token's once: a
        choice sent to another worker before it had them all gets them from the start again.
        The first prompt token's entry, which has no logprob, leads them."""
        prompt = self.request.prompt_token_ids
        if not self._prompt_logprobs_sent:
            self._prompt_logprobs.append(pb.TokenLogprobs(sampled=self._logprob(prompt[0])))
            self._prompt_logprobs_sent = 1
        for entry in delta.prompt_logprobs:
            choice.prompt_logprobs_received += 1
            position = choice.prompt_logprobs_received      # a dispatch's k-th is for prompt token k
            if position == self._prompt_logprobs_sent:
                self._prompt_logprobs.append(self._logprobs(prompt[position], entry))
                self._prompt_logprobs_sent += 1

    def _on_event(self, choice: _Choice, event: worker_pb2.Event, worker: WorkerClient) -> None:
        context = {"request_id": self.request.request_id, "choice": choice.index,
                   "dispatch": choice.dispatch_id, "worker": worker.worker_id}
        if event.kind == worker_pb2.EVENT_KIND_PREEMPTED:
            choice.on_gpu = False
            mode = PREEMPTION_MODE_NAMES[event.mode]
            self._counters.count(f"preemptions_{mode}", "choice preempted", mode=mode,
                                 detail=event.message, **context)
            if self._span is not None:
                self._span.add_event("preempted", {
                    "pagedserve.choice": choice.index, "pagedserve.worker": worker.worker_id,
                    "pagedserve.preemption.mode": mode})
            if event.mode != worker_pb2.PREEMPTION_MODE_RECOMPUTE:
                return
            if self._out is not None:  # the router's own swap-out fell back to recompute, or a
                self._park(choice)     # hand-back: either way it waits for its return
                return
            if event.hand_back == worker_pb2.HAND_BACK_WORKER_FAULT:
                self._redispatch(choice, f"its worker faulted ({event.message})")
            elif event.hand_back == worker_pb2.HAND_BACK_DRAINING or worker.draining:
                self._redispatch(choice, "its worker is draining")
            else:
                self._maybe_migrate(choice, worker)
        elif event.kind == worker_pb2.EVENT_KIND_FAILED:
            # The worker judged the request (a bad field, too long for it), found it names what
            # it does not hold (an adapter being unloaded: NOT_FOUND), or broke with it.
            if event.worker_fault:
                raise ApiError(grpc.StatusCode.INTERNAL,
                               f"worker {worker.worker_id} failed the request: {event.message}")
            code = refusal_code(event.status_code)
            if code != grpc.StatusCode.INVALID_ARGUMENT:
                raise ApiError(code, event.message)
            raise invalid_argument(f"the worker refused the request: {event.message}")
        else:  # ADMITTED, RESUMED, FINISHED
            choice.on_gpu = event.kind != worker_pb2.EVENT_KIND_FINISHED
            log.debug("choice %s", worker_pb2.EventKind.Name(event.kind).removeprefix(
                "EVENT_KIND_").lower(), extra=context)

    def _finish(self, choice: _Choice, out: pb.ChoiceDelta, reason: int) -> None:
        choice.finish_reason = out.finish_reason = reason
        _end_span(choice)

    def _dispatch(self, choice: _Choice, worker: WorkerClient) -> None:
        choice.worker, choice.dispatch_id = worker, self._next_dispatch_id()
        choice.on_gpu = False
        choice.prompt_logprobs_received = 0
        _end_span(choice)  # the previous dispatch's, when the choice moves
        if self._trace_parent is not None:
            choice.span = tracing.start_span("dispatch", parent=self._trace_parent,
                                             kind=SpanKind.CLIENT, attributes={
                                                 "pagedserve.choice": choice.index,
                                                 "pagedserve.worker": worker.worker_id,
                                                 "pagedserve.dispatch_id": choice.dispatch_id,
                                                 "pagedserve.prior_output_tokens": len(choice.output)})
        prompt_logprobs_owed = self._prompt_logprobs_sent < len(self.request.prompt_token_ids)
        worker.submit(choice.dispatch_id, self._inbox, choice.index, self.request.prompt_token_ids,
                      self.request.submit_params(choice.index, prompt_logprobs_owed), self.request.priority,
                      output_token_ids=choice.output,
                      trace_context=tracing.inject(choice.span) if choice.span is not None else None,
                      lora=self._lora())
        log.debug("choice dispatched", extra={
            "request_id": self.request.request_id, "choice": choice.index,
            "dispatch": choice.dispatch_id, "worker": worker.worker_id,
            "output_tokens": len(choice.output)})

    def _lora(self) -> tuple[str, str] | None:
        """The request's LoRA adapter as a worker loads it: (name, path)."""
        name = self.request.lora_name
        if not name:
            return None
        path = self._fleet.lora_path(name)
        if path is None:
            gone = "is being unloaded" if name in self._fleet.lora_unloading else "was unloaded"
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} {gone}", field="lora_name")
        return name, path

    # ---------------------------------------------------------------- router.preemption

    async def _watch_reader(self) -> None:
        """Swaps the request out while its client does not read (RunConfig.slow_reader_s and
        slow_reader_backlog), to run again once the client has taken what was waiting."""
        while True:
            # A wake-up a second per request at most: routers hold thousands of streams.
            await asyncio.sleep(min(1.0, self._config.slow_reader_s / 4))
            since = self._blocked_since
            if since is None or self._out is not None or not self._running.on_gpu():
                continue
            if (time.monotonic() - since >= self._config.slow_reader_s
                    or self._inbox.qsize() >= self._config.slow_reader_backlog):
                self._caught_up.clear()
                self._swap_out(reason=SLOW_READER)

    def _swap_out(self, for_request: str = "", reason: str = PRIORITY) -> None:
        """Takes the request off its worker's GPU and suspends its reservation: for the more
        urgent `for_request` (router.preemption), or while its client does not read
        (SLOW_READER: it returns once the client has taken what was waiting, and admission has
        room). SwapOut keeps its KV in the worker's swap space; where the worker reports too
        little of that, the choices are aborted instead, to be computed again from their output
        on their return: a recompute the worker would run by itself could take their blocks
        back before the request it made room for got them."""
        if self._out is not None:       # out already (its choices' PREEMPTED may not be read yet)
            return
        home = self._fleet.workers.get(self._reservation.worker_id)
        live = [c for c in self._choices if not c.finished]
        block_size = self._fleet.model.block_size
        blocks = sum(math.ceil((len(self.request.prompt_token_ids) + len(c.output) + 1) / block_size)
                     for c in live)
        swap = home is not None and home.load is not None and home.load.free_swap_blocks >= blocks
        if swap:
            home.swap_out([c.dispatch_id for c in live])
        mode = "swap" if swap else "recompute"
        for choice in live:
            if not swap:
                self._park(choice)
            self._counters.count(f"swap_outs_{reason}", "choice swapped out",
                                 request_id=self.request.request_id, choice=choice.index,
                                 worker=self._reservation.worker_id, mode=mode,
                                 for_request=for_request)
            if self._span is not None:
                self._span.add_event("swapped_out", {
                    "pagedserve.choice": choice.index, "pagedserve.worker": self._reservation.worker_id,
                    "pagedserve.reason": reason, "pagedserve.preemption.mode": mode}
                    | ({"pagedserve.for_request": for_request} if for_request else {}))
        self._reservation.suspend()
        returning = asyncio.ensure_future(self._return(home, reason))
        returning.add_done_callback(lambda wait: self._inbox.put_nowait(_Returned(wait)))
        self._out = _Out(returning, reason)

    async def _return(self, home: WorkerClient | None, reason: str) -> None:
        if reason == SLOW_READER:
            await self._caught_up.wait()
        await self._reservation.resume(self._return_chooser(home))

    def _return_chooser(self, home: WorkerClient | None) -> WorkerChooser:
        """Where the request runs again: the worker whose swap space holds its KV when that has
        room (a copy back), else wherever the balancer picks (a recompute there)."""
        balance = self._fleet.chooser(self.request.prompt_token_ids, self.request.lora_name)

        def choose(fits: list[WorkerBudget]) -> WorkerBudget | None:
            at_home = [b for b in fits if home is not None and b.worker_id == home.worker_id]
            return at_home[0] if at_home else balance(fits)
        return choose

    def _park(self, choice: _Choice) -> None:
        """Takes a choice off its worker until the request returns."""
        choice.worker.abort([choice.dispatch_id])
        choice.parked, choice.on_gpu = True, False
        _end_span(choice)

    def _on_return(self, returned: _Returned) -> None:
        """Admission has room again for the request: its choices run again, swapped in where
        their KV waits, or submitted with their output so far where the room is."""
        if returned.wait.cancelled():
            return  # the request ended while it waited
        returned.wait.result()  # raises what broke the wait (a chooser's bug)
        out, self._out = self._out, None
        target = self._retarget(exclude=None, reason="its worker left while it was out")
        for choice in (c for c in self._choices if not c.finished):
            if choice.parked or choice.worker is not target:
                if not choice.parked:
                    choice.worker.abort([choice.dispatch_id])  # frees its swap space there
                choice.parked = False
                self._dispatch(choice, target)
                how = "recompute"
            else:
                target.swap_in([choice.dispatch_id])
                how = "swap_in"
            self._counters.count(f"swap_ins_{out.reason}", "choice runs again",
                                 request_id=self.request.request_id, choice=choice.index,
                                 worker=target.worker_id, how=how,
                                 out_s=round(time.monotonic() - out.since, 3))
            if self._span is not None:
                self._span.add_event("swapped_in", {
                    "pagedserve.choice": choice.index, "pagedserve.worker": target.worker_id,
                    "pagedserve.reason": out.reason, "pagedserve.resume": how})
        self._running.running_since = time.monotonic()

    # ---------------------------------------------------------------- router.rebalance

    def _can_move(self) -> bool:
        live = [c for c in self._choices if not c.finished]
        return self._out is None and len(live) == 1 and live[0].on_gpu

    def _rebalance_to(self, worker_id: str) -> bool:
        """Moves the request's one live choice to `worker_id` (router.rebalance): recompute there."""
        target = self._fleet.workers.get(worker_id)
        if target is None or not target.accepting or (self.request.lora_name and not target.serves_lora):
            return False
        (choice,) = [c for c in self._choices if not c.finished]
        source = choice.worker
        self._reservation.move_to(worker_id)
        self._move(choice, target, "rebalances", f"{source.worker_id} had requests waiting, {worker_id} room")
        return True

    def _redispatch(self, choice: _Choice, reason: str) -> None:
        """Moves a choice its worker can no longer run; UNAVAILABLE when nowhere is left."""
        if self._out is not None:
            self._park(choice)  # it runs again wherever admission finds it room
            return
        if choice.moves >= self._config.max_moves_per_choice:
            raise unavailable(f"choice {choice.index} was moved {choice.moves} times, the "
                              f"limit; giving up because {reason}")
        self._move(choice, self._retarget(choice.worker, reason), "redispatches", reason)

    def _maybe_migrate(self, choice: _Choice, source: WorkerClient) -> None:
        """Moves a choice preempted for recompute to a worker with clearly more free blocks."""
        live = [c for c in self._choices if not c.finished]
        if (not self._config.migrate_on_preemption or live != [choice]
                or choice.moves >= self._config.max_moves_per_choice):
            return
        block_size = self._fleet.model.block_size
        needed = math.ceil((len(self.request.prompt_token_ids) + len(choice.output) + 1)
                           / block_size)
        source_free = source.load.free_blocks if source.load else 0
        targets = [w for w in self._fleet.accepting() if w is not source and w.load is not None
                   and (not self.request.lora_name or w.serves_lora)]
        target = max(targets, key=lambda w: w.load.free_blocks, default=None)
        if target is None or target.load.free_blocks < (
                needed + self._config.migration_free_ratio * source_free):
            return
        self._reservation.move_to(target.worker_id)
        self._move(choice, target, "migrations",
                   f"{target.load.free_blocks} free blocks there, {source_free} here")

    def _retarget(self, exclude: WorkerClient | None, reason: str) -> WorkerClient:
        """Where the request's choices go when `exclude` cannot keep them: its reservation's
        worker if that still accepts, else one the balancer picks (the reservation follows)."""
        current = self._fleet.workers.get(self._reservation.worker_id)
        if current is not None and current is not exclude and current.accepting:
            return current
        target = self._fleet.choose(self.request.prompt_token_ids, exclude=exclude,
                                    lora_name=self.request.lora_name)
        if target is None:
            raise unavailable(f"no worker is left to continue the request ({reason})")
        self._reservation.move_to(target.worker_id)
        return target

    def _move(self, choice: _Choice, target: WorkerClient, counter: str, reason: str) -> None:
        source = choice.worker
        source.abort([choice.dispatch_id])  # no-op on a lost worker; frees a live one's blocks
        choice.moves += 1
        if self._span is not None:
            self._span.add_event(_MOVE_EVENTS[counter], {
                "pagedserve.choice": choice.index, "pagedserve.source_worker": source.worker_id,
                "pagedserve.target_worker": target.worker_id, "pagedserve.reason": reason,
                "pagedserve.output_tokens": len(choice.output)})
        self._dispatch(choice, target)
        self._counters.count(counter, "choice moved", request_id=self.request.request_id,
                             choice=choice.index, source=source.worker_id,
                             target=target.worker_id, reason=reason,
                             output_tokens=len(choice.output))

    def _logprob(self, token: int, value: float | None = None) -> pb.Logprob:
        if self._tokenizer is None:
            return pb.Logprob(token_id=token, logprob=value)
        return pb.Logprob(token_id=token, logprob=value, text=self._tokenizer.token_text(token),
                          token_bytes=self._tokenizer.token_bytes(token))

    def _logprobs(self, token_id: int, entry: worker_pb2.TokenLogprobs) -> pb.TokenLogprobs:
        return pb.TokenLogprobs(sampled=self._logprob(token_id, entry.logprob), top=[
            self._logprob(t, lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)])

    def _response(self, deltas: dict[int, pb.ChoiceDelta]) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=self.request.request_id, choices=[
            d for _, d in sorted(deltas.items()) if d.token_ids or d.text or d.finish_reason],
            prompt_logprobs=self._prompt_logprobs)
        self._prompt_logprobs = []
        if all(c.finished for c in self._choices):
            prompt, completion = len(self.request.prompt_token_ids), self.completion_tokens
            response.usage.CopyFrom(pb.Usage(prompt_tokens=prompt, completion_tokens=completion,
                                             total_tokens=prompt + completion))
        return response


def _end_span(choice: _Choice) -> None:
    """Ends the span of the choice's current dispatch, if it has one still open."""
    if choice.span is not None:
        choice.span.end()
        choice.span = None
