"""The engine's thread and what it keeps per router session and per request.

The engine runs on its own thread (`EngineLoop`); RPC handlers never touch it directly but
queue commands that the engine thread runs between steps, so a slow client or a burst of
RPCs never stalls a step. After each step the engine thread hands every session one
`StepOutput` with the deltas of all its requests; the asyncio side writes them. Request ids
are namespaced per session, so two routers can use the same ids.

Metrics and traces are recorded on the engine thread from what it already has in hand: the
step's plan and outputs, the engine's lifecycle events and one `RequestRecord` per request
(arrival, first token, tokens, span). Gauges are read from the latest `EngineStats` at scrape
time. See docs/observability.md.
"""

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span, SpanKind

from common import tracing
from common.convert import PREEMPTION_MODES, sampling_params_from_proto
from common.metrics import WorkerMetrics
from common.pb import worker_pb2 as pb
from common.sampling_params import InvalidRequest
from worker import faults
from worker.engine import EngineEvent, EngineStats, LLMEngine, LoRANotFound, RequestOutput
from worker.scheduler import RECOMPUTE
from worker.sequence import FinishReason
from worker.step_log import StepLog

log = logging.getLogger("pagedserve.worker")

FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
          FinishReason.ABORT: pb.FINISH_REASON_ABORT, None: pb.FINISH_REASON_NONE}
EVENT_KINDS = {"admitted": pb.EVENT_KIND_ADMITTED, "preempted": pb.EVENT_KIND_PREEMPTED,
               "resumed": pb.EVENT_KIND_RESUMED}


@dataclass(eq=False)
class Session:
    """One router's stream: its requests (engine keys) and its outbox."""
    session_id: str
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    keys: set[str] = field(default_factory=set)
    router_id: str = ""
    # prompt + max_tokens over the Submits the reader has taken off the stream, written by the
    # reader. The engine thread reads commands only between steps: without these a report taken
    # meanwhile would show the other replicas room this session has already claimed.
    submitted_tokens: int = 0
    # (prompt + max_tokens over its requests in the engine, how much of submitted_tokens the
    # engine thread has taken in so far): written by the engine thread as one tuple, so that
    # the load reporter on the event loop reads both of one moment (see reported_tokens).
    engine_tokens: tuple[int, int] = (0, 0)
    submits_read: int = 0               # Submits the reader has taken off the stream
    last_read_at: float = 0.0           # time.monotonic() of the router's last message

    def reported_tokens(self) -> int:
        """Its part of LoadReport.tokens_in_flight: its requests in the engine and its Submits
        read but not yet taken in, each once. Exact when called on the reader's event loop."""
        in_engine, taken = self.engine_tokens
        return in_engine + self.submitted_tokens - taken

    def count(self, in_engine: int, taken: int = 0) -> None:
        """Engine thread: adds to the two counts of engine_tokens in one assignment."""
        held, taken_so_far = self.engine_tokens
        self.engine_tokens = (held + in_engine, taken_so_far + taken)

    def key(self, request_id: str) -> str:
        return f"{self.session_id}/{request_id}"

    def send(self, message: pb.WorkerMessage | None) -> None:
        """Thread-safe: queues a message (None closes the stream) for the session's writer."""
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, message)


@dataclass(eq=False, slots=True)
class RequestRecord:
    """What the metrics, the trace and the load reports need about one request, kept on the
    engine thread."""
    received: float                     # time.monotonic() when its Submit was read
    prompt_tokens: int
    span: Span | None                   # None when tracing is off
    first_token: float | None = None
    num_output: int = 0                 # tokens generated here (not those it arrived with)
    lora_name: str = ""                 # its LoRA adapter ("": the base model)
    tokens_in_flight: int = 0           # prompt + max_tokens (at most max_model_len), as reported

    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.received


def _delta(request_id: str, out: RequestOutput) -> pb.RequestDelta:
    delta = pb.RequestDelta(request_id=request_id, new_token_ids=out.new_token_ids,
                            finish_reason=FINISH[out.finish_reason], num_prompt_tokens=out.num_prompt_tokens)
    for chosen, top in out.logprobs or ():
        delta.logprobs.add(logprob=chosen, top_token_ids=[t for t, _ in top], top_logprobs=[lp for _, lp in top])
    for chosen, top in out.prompt_logprobs or ():
        delta.prompt_logprobs.add(logprob=chosen, top_token_ids=[t for t, _ in top],
                                  top_logprobs=[lp for _, lp in top])
    return delta


def _event(request_id: str, kind: int, mode: str | None = None, message: str = "",
           worker_fault: bool = False, hand_back: int = pb.HAND_BACK_UNSPECIFIED,
           status_code: grpc.StatusCode | None = None) -> pb.WorkerMessage:
    return pb.WorkerMessage(event=pb.Event(request_id=request_id, kind=kind, mode=PREEMPTION_MODES.get(mode, 0), message=message,
                                           worker_fault=worker_fault, hand_back=hand_back,
                                           status_code=status_code.value[0] if status_code is not None else 0))


def _handed_back(request_id: str, message: str, fault: bool) -> pb.WorkerMessage:
    """The PREEMPTED that gives a request back to its router for good (a drain or a fault)."""
    return _event(request_id, pb.EVENT_KIND_PREEMPTED, RECOMPUTE, message,
                  hand_back=pb.HAND_BACK_WORKER_FAULT if fault else pb.HAND_BACK_DRAINING)


class EngineLoop:
    """Owns the engine on a dedicated thread; everything else talks to it with `call`.

    A step that raises is an engine fault (see worker.faults): the loop steps no more, hands
    every request back to its router as a drain does, and calls `on_fault`, after which the
    worker exits. `last_progress` (when the engine last advanced, or had nothing it could
    advance) is what the watchdog reads."""

    def __init__(self, engine: LLMEngine, metrics: WorkerMetrics, model_name: str):
        self.engine = engine
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.owner: dict[str, Session] = {}        # engine key -> session
        self.records: dict[str, RequestRecord] = {}  # engine key -> record, for every owned key
        self.draining = False
        self.fault: str | None = None              # what broke the engine, once it has
        self.on_fault: Callable[[], None] = lambda: None
        self.last_progress = time.monotonic()
        self.stalled = False                       # set by the watchdog
        self.stats: EngineStats = engine.stats()
        self.metrics = metrics
        self.model_name = model_name
        self.tracing = tracing.enabled()
        self.injection = faults.FaultInjection.from_env()
        self.step_log = StepLog.from_env()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self.wake.set()
        self._thread.join(timeout=10)
        if self.step_log is not None and not self._thread.is_alive():
            self.step_log.close()       # an engine thread still in a step may yet write to it

    def call(self, command: Callable[[], None]) -> None:
        self.commands.put(command)
        self.wake.set()

    async def ask(self, query: Callable[[], object]):
        """Runs `query` on the engine thread between steps and returns (or raises) what it did."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(query())
            except Exception as error:     # the caller's to report, not a failed command
                future.set_exception(error)
        self.call(command)
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stopped:
            self.wake.clear()
            self._run_commands()
            progressed = self.fault is None and self.engine.has_unfinished() and self._step()
            if self.fault is None:
                self.stats = self.engine.stats()
                if progressed or not self.engine.has_runnable():
                    self.last_progress = time.monotonic()
            if not progressed and not self.commands.qsize():
                # Nothing ran (idle, only held/unfittable work, or faulted): sleep until a command.
                self.wake.wait(timeout=0.05 if self.engine.has_unfinished() else 1.0)

    def _step(self) -> bool:
        """Runs one engine step and publishes what it produced; whether it advanced anything."""
        started = time.monotonic()
        try:
            if self.injection is not None:
                self.injection.before_step(self.engine.num_steps + 1)
            outputs = self.engine.step()
        except Exception as error:
            self._engine_fault(error)
            return False
        self._observe_step(started, len(outputs))
        self._publish(outputs, started)
        # A prompt chunk reports no tokens, nor does the first step launched after an idle
        # spell: both are progress, to be followed at once.
        return bool(outputs or self.engine.last_plan.scheduled)

    def _engine_fault(self, error: Exception) -> None:
        """Gives up the engine after a failed step: hands every request back, then `on_fault`."""
        kind = "device fault" if faults.is_device_fault(error) else "engine fault"
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        self.fault = f"{kind} in step {self.engine.num_steps + 1}: {first_line}"
        self.draining = True        # admits nothing more: Submits are handed back at once
        # A device fault's Python traceback says nothing; an engine fault is a bug to find.
        log.error("%s; handing %d requests back to their routers and exiting", self.fault,
                  len(self.owner), exc_info=None if kind == "device fault" else error)
        self._hand_back(self.fault, fault=True)
        self.on_fault()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                log.exception("worker command failed")

    def _observe_step(self, started: float, num_outputs: int) -> None:
        plan = self.engine.last_plan
        duration = time.monotonic() - started
        # One token per output. A step that scheduled nothing (only swaps ran, nothing fitted,
        # or it only read the step before) still reports that step's tokens.
        self.metrics.step(duration, plan.num_tokens, len(plan.scheduled), num_outputs)
        if self.step_log is not None:
            sched = self.engine.scheduler
            self.step_log.record(started, duration, plan, len(sched.running), len(sched.waiting),
                                 len(sched.swapped))

    def _trace_step(self, started: float, now: float) -> None:
        """Adds the step's prompt chunks and first tokens to the requests' spans."""
        chunk_at = tracing.span_time_ns(started)
        for s in self.engine.last_plan.scheduled:
            record = self.records.get(s.seq.request_id)
            if record is None or record.span is None:
                continue
            start = s.seq.num_computed - s.num_tokens      # num_computed already counts this chunk
            if start < s.seq.prompt_len:
                record.span.add_event("prefill_chunk", {"pagedserve.chunk.start": start,
                                                        "pagedserve.chunk.tokens": s.num_tokens}, chunk_at)
            if record.first_token == now:
                record.span.add_event("first_token", timestamp=tracing.span_time_ns(now))

    def _publish(self, outputs: list[RequestOutput], step_started: float | None = None) -> None:
        """Sends a step's deltas and the engine's events; `step_started` is when the scheduler
        decided those events (None: just now, outside a step)."""
        now = time.monotonic()
        by_session: dict[Session, list] = {}
        finished, failed = [], []
        for out in outputs:
            session = self.owner.get(out.request_id)
            if session is None:
                continue
            request_id = out.request_id.split("/", 1)[1]
            if out.finish_reason == FinishReason.ERROR:
                failed.append((session, request_id, out))
                continue
            by_session.setdefault(session, []).append(_delta(request_id, out))
            record = self.records[out.request_id]
            if record.first_token is None and out.new_token_ids:   # not a prompt chunk's logprobs
                record.first_token = now
                self.metrics.first_token(now - record.received, out.num_prompt_tokens)
            record.num_output += len(out.new_token_ids)
            if out.finish_reason is not None:
                finished.append((session, out.request_id, request_id, out.finish_reason.value))
        for session, deltas in by_session.items():
            session.send(pb.WorkerMessage(step=pb.StepOutput(step_index=self.engine.num_steps, deltas=deltas)))
        events_at = now if step_started is None else step_started
        for event in self.engine.drain_events():
            session = self.owner.get(event.request_id)
            if session is not None:
                session.send(_event(event.request_id.split("/", 1)[1], EVENT_KINDS[event.kind], event.mode))
                self._observe_event(self.records[event.request_id], event, events_at)
        if self.tracing and step_started is not None:
            self._trace_step(step_started, now)     # after "admitted", before the span may end
        for session, key, request_id, reason in finished:
            self._forget(key, reason)
            session.send(_event(request_id, pb.EVENT_KIND_FINISHED))
        for session, request_id, out in failed:
            self._forget(out.request_id, "failed", out.error)
            session.send(_event(request_id, pb.EVENT_KIND_FAILED, message=out.error, worker_fault=out.fault))

    def _observe_event(self, record: RequestRecord, event: EngineEvent, at: float) -> None:
        if event.kind == "admitted":
            self.metrics.admitted(at - record.received)
        if record.span is not None:
            attributes = {"pagedserve.preemption.mode": event.mode} if event.mode else None
            record.span.add_event(event.kind, attributes, tracing.span_time_ns(at))

    def _forget(self, key: str, reason: str, error: str | None = None) -> None:
        """Drops a request the worker no longer holds; `reason` is how it left (a
        WORKER_FINISH_REASONS value), `error` what went wrong when it failed."""
        session = self.owner.pop(key, None)
        if session is not None:
            session.keys.discard(key)
            record = self.records.pop(key)
            session.count(-record.tokens_in_flight)
            self._close_record(record, reason, error)

    def _close_record(self, record: RequestRecord, reason: str, error: str | None = None) -> None:
        now = time.monotonic()
        self.metrics.finished(reason, now - record.received, record.ttft_s(), record.num_output)
        if record.lora_name:
            self.metrics.lora_finished(record.lora_name, record.num_output)
        if record.span is not None:
            if reason == "drained":
                record.span.add_event("drained", timestamp=tracing.span_time_ns(now))
            tracing.end_request_span(record.span, output_tokens=record.num_output, finish_reason=reason,
                                     ttft_s=record.ttft_s(), error=error, end_time_ns=tracing.span_time_ns(now))

    def _hand_back(self, message: str, fault: bool = False) -> None:
        """Gives every request back to its router for re-dispatch (PREEMPTED, recompute: the
        router resubmits prompt + the tokens it has received), then tells every session it
        holds nothing more (DRAINED). After a fault the engine is not touched: its state may
        be half-updated."""
        held = list(self.owner.items())
        # Every hand-back is queued before the engine is touched: should freeing one request
        # raise, the routers still have them all back.
        for key, session in held:
            session.send(_handed_back(key.split("/", 1)[1], message, fault))
        for session in {session for _, session in held} | self.sessions_alive():
            session.send(_event("", pb.EVENT_KIND_DRAINED))
        for key, _ in held:
            if not fault:
                self.engine.abort(key)
            self._forget(key, "failed" if fault else "drained", message if fault else None)

    # ------------------------------------------------------------ commands (engine thread)

    def submit(self, session: Session, msg: pb.Submit, received: float, estimate: int) -> None:
        """`received`: time.monotonic() when the Submit was read, where its latencies start;
        `estimate`: what the reader added to session.submitted_tokens for it."""
        added = 0
        try:
            added = self._submit(session, msg, received)
        finally:
            session.count(added, taken=estimate)

    def _submit(self, session: Session, msg: pb.Submit, received: float) -> int:
        """Adds the request to the engine; returns its tokens in flight (0 if refused)."""
        key = session.key(msg.request_id)
        record = RequestRecord(received, len(msg.prompt_token_ids), self._start_span(msg, received),
                               lora_name=msg.lora_name)
        if self.draining:
            session.send(_handed_back(msg.request_id, self.fault or "draining", self.fault is not None))
            self._close_record(record, "drained")
            return 0
        try:
            params = sampling_params_from_proto(msg.params)
            if record.span is not None:
                record.span.set_attributes(tracing.sampling_attributes(params))
            if params.n != 1:
                raise InvalidRequest(f"n={params.n} is invalid: a Submit carries one choice (n=1); "
                                     "the router fans out n > 1")
            self.engine.add_request(key, list(msg.prompt_token_ids), params, priority=msg.priority,
                                    output_token_ids=list(msg.output_token_ids),
                                    lora_name=msg.lora_name or None)
        except InvalidRequest as e:
            # An adapter it does not hold (or is unloading) is the client's NOT_FOUND, as for one
            # the router never knew: the request itself is not at fault.
            code = grpc.StatusCode.NOT_FOUND if isinstance(e, LoRANotFound) else grpc.StatusCode.INVALID_ARGUMENT
            session.send(_event(msg.request_id, pb.EVENT_KIND_FAILED, message=str(e), status_code=code))
            self._close_record(record, "failed", str(e))
            return 0
        self.owner[key] = session
        self.records[key] = record
        session.keys.add(key)
        record.tokens_in_flight = self.engine.requests[key][0].max_len
        return record.tokens_in_flight

    def _start_span(self, msg: pb.Submit, received: float) -> Span | None:
        """The request's span on this worker, a child of the router's span in `trace_context`."""
        if not self.tracing:
            return None
        attributes = tracing.request_attributes("text_completion", self.model_name, msg.request_id,
                                                len(msg.prompt_token_ids))
        if msg.output_token_ids:       # migrated or re-dispatched: continues after these
            attributes["pagedserve.prior_output_tokens"] = len(msg.output_token_ids)
        if msg.lora_name:
            attributes["pagedserve.lora.name"] = msg.lora_name
        return tracing.start_span(f"text_completion {self.model_name}", parent=tracing.extract(msg.trace_context),
                                  kind=SpanKind.SERVER, attributes=attributes,
                                  start_time_ns=tracing.span_time_ns(received))

    def abort(self, session: Session, request_ids, stop_string: bool = False) -> None:
        if self.fault is not None:
            return      # nothing is held any more
        for request_id in request_ids:
            key = session.key(request_id)
            if self.engine.abort(key):
                self._forget(key, "stop" if stop_string else "abort")
                session.send(pb.WorkerMessage(step=pb.StepOutput(
                    step_index=self.engine.num_steps,
                    deltas=[pb.RequestDelta(request_id=request_id, finish_reason=pb.FINISH_REASON_ABORT)])))

    def preempt(self, session: Session, request_id: str, mode: str | None, hold: bool = False) -> None:
        if self.fault is None:
            self.engine.preempt(session.key(request_id), mode, hold)
            self._publish([])

    def swap_in(self, session: Session, request_id: str) -> None:
        if self.fault is None:
            self.engine.swap_in(session.key(request_id))

    def stalled_for(self) -> float:
        """Seconds the engine has held runnable work without advancing it (thread-safe)."""
        return time.monotonic() - self.last_progress

    def drain(self) -> None:
        """Stops admitting and hands every request back to its router for re-dispatch."""
        if self.fault is not None:
            return      # already handed back
        if not self.draining:
            log.info("draining: %d requests handed back", len(self.owner))
        self.draining = True
        self._hand_back("draining")

    def close_session(self, session: Session) -> None:
        for key in list(session.keys):
            if self.fault is None:
                self.engine.abort(key)
            self._forget(key, "abort")
        if session.keys:
            log.info("session %s closed", session.session_id)

    # Sessions are registered by the service so drain can tell idle ones too.
    sessions_alive: Callable[[], set[Session]] = staticmethod(lambda: set())
