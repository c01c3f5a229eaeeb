"""The worker's gRPC service: `Info`, and one `Session` stream per router replica.

The engine runs on its own thread (`EngineLoop`); RPC handlers never touch it directly but
queue commands that the engine thread runs between steps, so a slow client or a burst of
RPCs never stalls a step. After each step the engine thread hands every session one
`StepOutput` with the deltas of all its requests; the asyncio side turns records into
protobuf and writes them. Request ids are namespaced per session, so two routers can use
the same ids.

Metrics and traces are recorded on the engine thread from what it already has in hand: the
step's plan and outputs, the engine's lifecycle events and one `RequestRecord` per request
(arrival, first token, tokens, span). Gauges are read from the latest `EngineStats` at scrape
time. See docs/observability.md.
"""

import argparse
import asyncio
import itertools
import json
import logging
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span, SpanKind
from prometheus_client import CollectorRegistry

from common import tracing
from common.convert import sampling_params_from_proto
from common.grpc_server import create_server, listen
from common.metrics import WorkerMetrics, serve_metrics
from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from worker.config import EngineConfig
from worker import faults
from worker.engine import EngineEvent, EngineStats, LLMEngine, RequestOutput
from worker.models.loader import load_tokenizer
from worker.sampling_params import InvalidRequest
from worker.sequence import FinishReason

log = logging.getLogger("pagedserve.worker")

FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
          FinishReason.ABORT: pb.FINISH_REASON_ABORT, None: pb.FINISH_REASON_NONE}
MODES = {"swap": pb.PREEMPTION_MODE_SWAP, "recompute": pb.PREEMPTION_MODE_RECOMPUTE, None: 0}
EVENT_KINDS = {"admitted": pb.EVENT_KIND_ADMITTED, "preempted": pb.EVENT_KIND_PREEMPTED,
               "resumed": pb.EVENT_KIND_RESUMED}
MODE_NAMES = {pb.PREEMPTION_MODE_SWAP: "swap", pb.PREEMPTION_MODE_RECOMPUTE: "recompute"}
LOAD_REPORT_INTERVAL_S = 0.2


@dataclass(eq=False)
class Session:
    """One router's stream: its requests (engine keys) and its outbox."""
    session_id: str
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    keys: set[str] = field(default_factory=set)
    router_id: str = ""

    def key(self, request_id: str) -> str:
        return f"{self.session_id}/{request_id}"

    def send(self, message: pb.WorkerMessage | None) -> None:
        """Thread-safe: queues a message (None closes the stream) for the session's writer."""
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, message)


@dataclass(eq=False, slots=True)
class RequestRecord:
    """What the metrics and the trace need about one request, kept on the engine thread."""
    received: float                     # time.monotonic() when its Submit was read
    prompt_tokens: int
    span: Span | None                   # None when tracing is off
    first_token: float | None = None
    num_output: int = 0                 # tokens generated here (not those it arrived with)

    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.received


def _delta(request_id: str, out: RequestOutput) -> pb.RequestDelta:
    delta = pb.RequestDelta(request_id=request_id, new_token_ids=out.new_token_ids,
                            finish_reason=FINISH[out.finish_reason], num_prompt_tokens=out.num_prompt_tokens)
    for chosen, top in out.logprobs or ():
        delta.logprobs.add(logprob=chosen, top_token_ids=[t for t, _ in top], top_logprobs=[lp for _, lp in top])
    return delta


def _event(request_id: str, kind: int, mode: str | None = None, message: str = "",
           worker_fault: bool = False) -> pb.WorkerMessage:
    return pb.WorkerMessage(event=pb.Event(request_id=request_id, kind=kind, mode=MODES[mode], message=message,
                                           worker_fault=worker_fault))


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
        self.on_fault: Callable[[str], None] = lambda message: None
        self.last_progress = time.monotonic()
        self.stalled = False                       # set by the watchdog
        self.stats: EngineStats = engine.stats()
        self.metrics = metrics
        self.model_name = model_name
        self.tracing = tracing.enabled()
        self.injection = faults.FaultInjection.from_env()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self.wake.set()
        self._thread.join(timeout=10)

    def call(self, command: Callable[[], None]) -> None:
        self.commands.put(command)
        self.wake.set()

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
        # A device fault's Python traceback says nothing; an engine fault is a bug to find.
        log.error("%s; handing %d requests back to their routers and exiting", self.fault,
                  len(self.owner), exc_info=None if kind == "device fault" else error)
        self._hand_back(self.fault, worker_fault=True)
        self.on_fault(self.fault)

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
        # One token per output. A step that scheduled nothing (only swaps ran, nothing fitted,
        # or it only read the step before) still reports that step's tokens.
        self.metrics.step(time.monotonic() - started, plan.num_tokens, len(plan.scheduled), num_outputs)

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
        finished = []
        for out in outputs:
            session = self.owner.get(out.request_id)
            if session is None:
                continue
            request_id = out.request_id.split("/", 1)[1]
            by_session.setdefault(session, []).append(_delta(request_id, out))
            record = self.records[out.request_id]
            if record.first_token is None:
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
            self._close_record(self.records.pop(key), reason, error)

    def _close_record(self, record: RequestRecord, reason: str, error: str | None = None) -> None:
        now = time.monotonic()
        self.metrics.finished(reason, now - record.received, record.ttft_s(), record.num_output)
        if record.span is not None:
            if reason == "drained":
                record.span.add_event("drained", timestamp=tracing.span_time_ns(now))
            tracing.end_request_span(record.span, output_tokens=record.num_output, finish_reason=reason,
                                     ttft_s=record.ttft_s(), error=error, end_time_ns=tracing.span_time_ns(now))

    def _hand_back(self, message: str, worker_fault: bool = False) -> None:
        """Gives every request back to its router for re-dispatch (PREEMPTED, recompute: the
        router resubmits prompt + the tokens it has received), then tells every session it
        holds nothing more (DRAINED). After a fault the engine is not touched: its state may
        be half-updated."""
        sessions = set(self.owner.values())
        for key, session in list(self.owner.items()):
            if not worker_fault:
                self.engine.abort(key)
            self._forget(key, "failed" if worker_fault else "drained", message if worker_fault else None)
            session.send(_event(key.split("/", 1)[1], pb.EVENT_KIND_PREEMPTED, "recompute", message,
                                worker_fault=worker_fault))
        for session in sessions | self.sessions_alive():
            session.send(_event("", pb.EVENT_KIND_DRAINED))

    # ------------------------------------------------------------ commands (engine thread)

    def submit(self, session: Session, msg: pb.Submit, received: float) -> None:
        """`received`: time.monotonic() when the Submit was read, where its latencies start."""
        key = session.key(msg.request_id)
        record = RequestRecord(received, len(msg.prompt_token_ids), self._start_span(msg, received))
        if self.draining:
            session.send(_event(msg.request_id, pb.EVENT_KIND_PREEMPTED, "recompute", self.fault or "draining",
                                worker_fault=self.fault is not None))
            self._close_record(record, "drained")
            return
        try:
            params = sampling_params_from_proto(msg.params)
            if record.span is not None:
                record.span.set_attributes(tracing.sampling_attributes(params))
            if params.n != 1:
                raise InvalidRequest(f"n={params.n} is invalid: a Submit carries one choice (n=1); "
                                     "the router fans out n > 1")
            self.engine.add_request(key, list(msg.prompt_token_ids), params, priority=msg.priority,
                                    output_token_ids=list(msg.output_token_ids))
        except InvalidRequest as e:
            session.send(_event(msg.request_id, pb.EVENT_KIND_FAILED, message=str(e)))
            self._close_record(record, "failed", str(e))
            return
        self.owner[key] = session
        self.records[key] = record
        session.keys.add(key)

    def _start_span(self, msg: pb.Submit, received: float) -> Span | None:
        """The request's span on this worker, a child of the router's span in `trace_context`."""
        if not self.tracing:
            return None
        attributes = tracing.request_attributes("text_completion", self.model_name, msg.request_id,
                                                len(msg.prompt_token_ids))
        if msg.output_token_ids:       # migrated or re-dispatched: continues after these
            attributes["pagedserve.prior_output_tokens"] = len(msg.output_token_ids)
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


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: LLMEngine, worker_id: str, model_name: str):
        self.engine = engine
        self.registry = CollectorRegistry()     # this worker's own: nothing global leaks in
        self.metrics = WorkerMetrics(model_name, self.registry, lambda: self.loop.stats, engine.config.block_size)
        self.loop = EngineLoop(engine, self.metrics, model_name)
        self.loop.sessions_alive = lambda: set(self.sessions)
        self.worker_id = worker_id
        self.sessions: set[Session] = set()
        self._session_ids = itertools.count(1)
        self.info = self._build_info(model_name)

    def _build_info(self, model_name: str) -> pb.InfoResponse:
        e, cfg = self.engine, self.engine.model_config
        info = pb.InfoResponse(
            worker_id=self.worker_id, model_name=model_name, architecture=cfg.architecture,
            dtype=str(e.runner.dtype).removeprefix("torch."), block_size=e.config.block_size,
            num_gpu_blocks=e.blocks.num_blocks, num_cpu_blocks=e.swap_pool.num_blocks,
            max_model_len=e.max_model_len, max_num_seqs=e.config.max_num_seqs,
            max_num_batched_tokens=e.config.max_num_batched_tokens, vocab_size=cfg.vocab_size,
            eos_token_ids=sorted(e.eos_token_ids), tensor_parallel_size=e.config.tensor_parallel_size,
            prefix_caching=e.config.enable_prefix_caching)
        tokenizer = load_tokenizer(e.source)
        if tokenizer is not None:
            info.tokenizer_json = tokenizer.backend_tokenizer.to_str().encode()
            info.tokenizer_config_json = json.dumps({
                name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                if getattr(tokenizer, name, None) is not None} | {"model_max_length": e.max_model_len})
            info.chat_template = tokenizer.chat_template or ""
            info.bos_token = tokenizer.bos_token or ""
            info.eos_token = tokenizer.eos_token or ""
        return info

    async def Info(self, request, context) -> pb.InfoResponse:
        return self.info

    async def Session(self, request_iterator, context):
        session = Session(f"s{next(self._session_ids)}", asyncio.get_running_loop())
        self.sessions.add(session)
        reader = asyncio.create_task(self._read(request_iterator, session))
        reporter = asyncio.create_task(self._report_load(session))
        try:
            while (message := await session.outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()
            reporter.cancel()
            self.sessions.discard(session)
            self.loop.call(lambda: self.loop.close_session(session))

    async def _read(self, request_iterator, session: Session) -> None:
        loop = self.loop
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "hello":
                    session.router_id = msg.hello.router_id
                    log.info("session %s opened by router %s", session.session_id, session.router_id)
                elif kind == "submit":
                    loop.call(lambda m=msg.submit, t=time.monotonic(): loop.submit(session, m, t))
                elif kind == "abort":
                    loop.call(lambda ids=list(msg.abort.request_ids), stop=msg.abort.stop_string:
                              loop.abort(session, ids, stop))
                elif kind == "preempt":
                    mode = MODE_NAMES.get(msg.preempt.mode)
                    loop.call(lambda r=msg.preempt.request_id: loop.preempt(session, r, mode))
                elif kind == "swap_out":
                    for r in msg.swap_out.request_ids:
                        loop.call(lambda r=r: loop.preempt(session, r, "swap", hold=True))
                elif kind == "swap_in":
                    for r in msg.swap_in.request_ids:
                        loop.call(lambda r=r: loop.swap_in(session, r))
                elif kind == "drain":
                    loop.call(loop.drain)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            session.outbox.put_nowait(None)     # the router closed its side: end the stream

    async def _report_load(self, session: Session) -> None:
        while True:
            s = self.loop.stats
            hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
            session.outbox.put_nowait(pb.WorkerMessage(load=pb.LoadReport(
                free_blocks=s.free_blocks, used_blocks=s.total_blocks - s.free_blocks,
                total_blocks=s.total_blocks, num_running=s.num_running, num_waiting=s.num_waiting,
                num_swapped=s.num_swapped, tokens_in_flight=s.tokens_in_flight,
                free_swap_blocks=s.free_swap_blocks, draining=self.loop.draining,
                prefix_cache_hit_rate=hit_rate, stalled=self.loop.stalled)))
            await asyncio.sleep(LOAD_REPORT_INTERVAL_S)


async def serve_worker(config: EngineConfig, host: str, port: int, worker_id: str | None = None,
                       model_name: str | None = None, ready: Callable[[int], None] | None = None,
                       metrics_port: int = 0) -> None:
    """Loads the model, serves until SIGTERM/SIGINT, then drains and stops. `metrics_port`:
    where to serve Prometheus /metrics (0: nowhere); tracing follows the OTEL_* variables.
    After an engine fault it hands the requests back, stops, and raises
    SystemExit(faults.EXIT_CODE) for its supervisor to restart it."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    started = time.monotonic()
    tracing.setup_tracing("pagedserve-worker")
    server = create_server([("grpc.max_receive_message_length", 64 * 2**20),
                            ("grpc.max_send_message_length", 64 * 2**20)])
    # The port is taken before the model loads, so a port in use fails in a second, not after
    # minutes of loading; clients are answered once the server starts.
    bound = listen(server, host, port)
    engine = LLMEngine(config)
    service = WorkerService(engine, worker_id or f"{socket.gethostname()}:{port}",
                            model_name or engine.source.name)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = pb.DESCRIPTOR.services_by_name["Worker"].full_name
    reflection.enable_server_reflection([service_name, reflection.SERVICE_NAME, health.SERVICE_NAME], server)

    async def set_health(status) -> None:
        for name in ("", service_name):
            await health_servicer.set(name, status)

    stop = asyncio.Event()
    running_loop = asyncio.get_running_loop()
    service.loop.on_fault = lambda message: running_loop.call_soon_threadsafe(stop.set)
    service.loop.start()
    await server.start()
    await set_health(health_pb2.HealthCheckResponse.SERVING)
    log.info("worker %s serving %s on %s:%d (%d KV blocks of %d tokens, max_model_len %d) after %.1fs",
             service.worker_id, service.info.model_name, host, bound, service.info.num_gpu_blocks,
             config.block_size, engine.max_model_len, time.monotonic() - started)
    if (metrics_bound := serve_metrics(service.registry, metrics_port, host)) is not None:
        log.info("metrics at http://%s:%d/metrics", host, metrics_bound)
    if ready:
        ready(bound)

    for sig in (signal.SIGTERM, signal.SIGINT):
        running_loop.add_signal_handler(sig, stop.set)
    watchdog = (asyncio.create_task(_watch_engine(service.loop, set_health, config.stall_timeout_s))
                if config.stall_timeout_s > 0 else None)
    await stop.wait()
    if watchdog is not None:
        watchdog.cancel()
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    fault = service.loop.fault
    if fault is None:
        log.info("shutting down: draining %d requests", len(service.loop.owner))
        service.loop.call(service.loop.drain)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(not s.outbox.empty() for s in service.sessions):
        await asyncio.sleep(0.05)
    for session in service.sessions:
        session.outbox.put_nowait(None)     # ends each stream, rather than cancel it mid-wait
    while time.monotonic() < deadline and service.sessions:
        await asyncio.sleep(0.05)
    await server.stop(grace=1)
    service.loop.stop()
    engine.close(abandon=fault is not None)
    tracing.shutdown_tracing()
    if fault is not None:
        log.error("worker %s exits after a %s", service.worker_id, fault.split(" in step")[0])
        raise SystemExit(faults.EXIT_CODE)


async def _watch_engine(loop: EngineLoop, set_health: Callable, timeout_s: float) -> None:
    """The watchdog: health is NOT_SERVING (and load reports say `stalled`) while the engine
    holds work it could run but has not advanced for `timeout_s`, so that a stall is seen
    and routed around instead of silent; SERVING again once it advances."""
    from grpc_health.v1 import health_pb2

    while True:
        await asyncio.sleep(min(1.0, timeout_s / 4))
        stalled = loop.fault is None and loop.stalled_for() > timeout_s
        if stalled == loop.stalled:
            continue
        loop.stalled = stalled
        if stalled:
            s = loop.stats
            log.error("engine stalled: its work has not advanced for %.1f s (running %d, waiting %d, "
                      "swapped %d; %d of %d KV blocks free; %d steps so far); reporting NOT_SERVING",
                      loop.stalled_for(), s.num_running, s.num_waiting, s.num_swapped, s.free_blocks,
                      s.total_blocks, s.steps)
        else:
            log.info("engine advancing again; reporting SERVING")
        await set_health(health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                         else health_pb2.HealthCheckResponse.SERVING)


def run_worker(config: EngineConfig, host: str = "0.0.0.0", port: int = 50061, worker_id: str | None = None,
               model_name: str | None = None, metrics_port: int = 0) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve_worker(config, host, port, worker_id, model_name, metrics_port=metrics_port))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_gb=args.kv_cache_memory_gb,
        num_blocks=args.num_blocks, swap_space_gb=args.swap_space, num_swap_blocks=args.num_swap_blocks,
        preemption_mode=args.preemption_mode, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
        stall_timeout_s=args.engine_stall_timeout)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (vLLM names where the meaning is the same). The commands that use them make
    each readable from PAGEDSERVE_<FLAG> too (common.cli.apply_env)."""
    d = EngineConfig(model="default")
    a = parser.add_argument
    a("--model", default="default", help="Hugging Face directory, .gguf file, preset "
      "name with --load-format dummy, or 'default' (the embedded SmolLM2-135M-Instruct)")
    a("--load-format", default=d.load_format, choices=["auto", "hf", "gguf", "dummy"],
      help="how to read the weights; dummy = random weights of the model's shape")
    a("--dtype", default=d.dtype, help="auto (bfloat16 on GPU, float32 on CPU), float32, float16, bfloat16")
    a("--device", default=d.device, help="auto, cpu or cuda")
    a("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    a("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
      help="token budget of one step (prefill chunks + decodes)")
    a("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    a("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
      help="share of GPU memory for weights, activations and the KV pool")
    a("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb, help="KV pool size on the CPU, in GiB")
    a("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the sizing)")
    a("--swap-space", type=float, default=d.swap_space_gb, help="host swap space for preempted requests, in GiB")
    a("--num-swap-blocks", type=int, default=None, help="swap space in blocks (overrides)")
    a("--preemption-mode", default=d.preemption_mode, choices=["swap", "recompute"],
      help="swap: to host memory when there is room, else recompute")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
      help="share KV blocks of equal prompt prefixes")
    a("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
    a("--enforce-eager", action="store_true", default=d.enforce_eager, help="no CUDA graphs")
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
      help="launch each step before reading the previous one's tokens, so the GPU never waits "
           "for the host (stop tokens are seen one step late); default: on with a GPU, off on "
           "the CPU, where it would only delay each token by a step")
    a("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
      help="GPUs (ranks: processes) to split the model over; on the CPU, processes over gloo")
    a("--engine-stall-timeout", type=float, default=d.stall_timeout_s,
      help="the worker's watchdog: seconds its engine may hold runnable work without advancing "
           "it before the worker logs the engine's state and reports NOT_SERVING (0: off)")


def main(argv: list[str] | None = None) -> None:
    import sys

    from common.cli import WORKER_REFUSED, apply_env
    from common.ports import check_ports

    parser = argparse.ArgumentParser(prog="python -m worker.server", description="pagedserve worker")
    add_engine_args(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--worker-port", "--port", dest="port", type=int, default=50061)
    parser.add_argument("--worker-id")
    parser.add_argument("--served-model-name")
    parser.add_argument("--metrics-port", type=int, default=9091,
                        help="port of the Prometheus /metrics endpoint (0: off); tracing is set with "
                             "the standard OTEL_* variables (docs/observability.md)")
    apply_env(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # Before the model loads, which can take minutes: a taken port is refused at once.
        # The metrics port is not: without it the worker still serves (see serve_metrics).
        check_ports([("--worker-port", args.host, args.port)])
        run_worker(engine_config_from_args(args), args.host, args.port, args.worker_id,
                   args.served_model_name, args.metrics_port)
    except (OSError, ValueError) as error:
        # A taken port, a bad model path or setting (the loader's ModelLoadError and the
        # engine's checks are ValueErrors whose message names it): one line, no traceback. Any
        # other exception is a bug and keeps its traceback.
        print(f"worker: {error}", file=sys.stderr)
        raise SystemExit(WORKER_REFUSED) from error


if __name__ == "__main__":
    main()
