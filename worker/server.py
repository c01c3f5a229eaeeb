"""The worker process: its gRPC service (`Info`, and one `Session` stream per router replica),
health and the engine watchdog, start-up and shutdown. It runs as `pagedserve serve --role
worker` (launcher.cli), which `--role all`, the tests and the Helm chart all start.

The engine itself runs on the thread of worker.engine_loop; this side reads the routers'
messages, queues them to it as commands, and writes what it hands back.
"""

import asyncio
import itertools
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from common import tracing
from common.convert import PREEMPTION_MODE_NAMES, submit_tokens
from common.grpc_server import create_server, listen
from common.metrics import ModelSetup, WorkerMetrics, serve_metrics
from common.pb import worker_pb2 as pb
from common.pb import worker_pb2_grpc
from common.reflection import enable_reflection, pool_of
from common.sampling_params import InvalidRequest
from common.tls import ServerTls
from worker import faults
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.engine_loop import EngineLoop, Session
from worker.model_runner import kv_cache_dtype_name
from worker.models.lora_checkpoint import LoRAAdapterError, read_lora_adapter
from worker.scheduler import SWAP

log = logging.getLogger("pagedserve.worker")

LOAD_REPORT_INTERVAL_S = 0.2
DRAIN_WAIT_S = 10.0         # for the engine thread to take the drain (it does so between steps)
SHUTDOWN_LINGER_S = 0.5     # of a session's silence before it is closed: see _close_sessions
SHUTDOWN_WAIT_S = 5.0       # for the sessions to settle and close


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: LLMEngine, worker_id: str, model_name: str):
        self.engine = engine
        self.registry = CollectorRegistry()     # this worker's own: nothing global leaks in
        runner = engine.runner
        self.metrics = WorkerMetrics(model_name, self.registry, lambda: self.loop.stats, engine.config.block_size,
                                     engine.config.max_loras if engine.lora else 0, ModelSetup(
                                         str(runner.dtype).removeprefix("torch."), runner.quantization,
                                         kv_cache_dtype_name(runner.kv_dtype)))
        self.loop = EngineLoop(engine, self.metrics, model_name)
        self.loop.sessions_alive = lambda: set(self.sessions)
        self.worker_id = worker_id
        self.sessions: set[Session] = set()
        self.stopping = False       # shutting down: new sessions are refused
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
            prefix_caching=e.config.enable_prefix_caching,
            max_loras=e.config.max_loras if e.lora else 0, max_lora_rank=e.config.max_lora_rank if e.lora else 0,
            kv_cache_dtype=self.metrics.setup.kv_cache_dtype, quantization=self.metrics.setup.quantization,
            logits_processors=sorted(e.logits_processors))
        log.info("reading the tokenizer of %s, for the routers", e.source.name)
        tokenizer = e.tokenizer
        if tokenizer is not None:
            e.grammars.use_tokenizer(tokenizer)     # now, not on the first structured output
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

    async def LoadLoRAAdapter(self, request, context) -> pb.LoRAAdapter:
        engine = self.engine
        if engine.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker serves no LoRA adapters (start it with --enable-lora)")
        if not request.lora_name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are both required")
        try:    # read beside the step loop; only registering it runs on the engine thread
            weights = await asyncio.to_thread(read_lora_adapter, request.lora_name, request.lora_path,
                                              engine.model_config, engine.config.max_lora_rank, engine.runner.dtype)
            dropped = await self.loop.ask(lambda: engine.add_lora(weights))
        except LoRAAdapterError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except InvalidRequest as e:       # the name is busy, or host memory is all in use
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)%s", weights.name, weights.path, weights.rank,
                 ", ".join(weights.target_modules), f"; dropped {', '.join(dropped)}" if dropped else "")
        return pb.LoRAAdapter(name=weights.name, path=weights.path, rank=weights.rank,
                              target_modules=weights.target_modules)

    async def UnloadLoRAAdapter(self, request, context) -> pb.UnloadLoRAAdapterResponse:
        engine, name = self.engine, request.lora_name
        adapter = engine.lora.get(name) if engine.lora is not None else None
        if adapter is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded")
        await self.loop.ask(lambda: setattr(adapter, "unloading", True))   # new Submits naming it fail
        try:
            while await self.loop.ask(lambda: engine.lora_in_use(name)):
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:      # the caller gave up (its deadline): the adapter serves on
            self.loop.call(lambda: setattr(adapter, "unloading", False))
            raise
        # Unless a load replaced it meanwhile (its own entry then, not this one).
        await self.loop.ask(lambda: engine.lora.get(name) is adapter and engine.remove_lora(name))
        log.info("LoRA adapter %r unloaded", name)
        return pb.UnloadLoRAAdapterResponse()

    async def Session(self, request_iterator, context):
        if self.stopping:   # a router reconnecting to a worker on its way out
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is shutting down")
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
                session.last_read_at = time.monotonic()
                kind = msg.WhichOneof("kind")
                if kind == "hello":
                    session.router_id = msg.hello.router_id
                    log.info("session %s opened by router %s", session.session_id, session.router_id)
                elif kind == "submit":
                    estimate = submit_tokens(msg.submit, self.engine.max_model_len)
                    session.submitted_tokens += estimate
                    session.submits_read += 1
                    loop.call(lambda m=msg.submit, t=time.monotonic(), e=estimate:
                              loop.submit(session, m, t, e))
                elif kind == "abort":
                    loop.call(lambda ids=list(msg.abort.request_ids), stop=msg.abort.stop_string:
                              loop.abort(session, ids, stop))
                elif kind == "preempt":
                    mode = PREEMPTION_MODE_NAMES.get(msg.preempt.mode)
                    loop.call(lambda r=msg.preempt.request_id, m=mode: loop.preempt(session, r, m))
                elif kind == "swap_out":
                    for r in msg.swap_out.request_ids:
                        loop.call(lambda r=r: loop.preempt(session, r, SWAP, hold=True))
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
            own = session.reported_tokens()
            session.outbox.put_nowait(pb.WorkerMessage(load=pb.LoadReport(
                free_blocks=s.free_blocks, used_blocks=s.total_blocks - s.free_blocks,
                total_blocks=s.total_blocks, num_running=s.num_running, num_waiting=s.num_waiting,
                num_swapped=s.num_swapped, free_swap_blocks=s.free_swap_blocks,
                # From the sessions' live counts, not the step's snapshot: the total and this
                # session's part must be of one moment for a router to tell the others' apart.
                tokens_in_flight=own + sum(other.reported_tokens() for other in self.sessions
                                           if other is not session),
                session_tokens_in_flight=own, session_submits_read=session.submits_read,
                num_sessions=len(self.sessions),
                draining=self.loop.draining, prefix_cache_hit_rate=hit_rate, stalled=self.loop.stalled,
                lora_adapters=[pb.LoRAAdapter(name=name, path=path, rank=rank, target_modules=targets,
                                              on_device=on_device, num_requests=users)
                               for name, path, rank, targets, on_device, users in s.lora_adapters])))
            await asyncio.sleep(LOAD_REPORT_INTERVAL_S)


async def serve_worker(config: EngineConfig, host: str, port: int, worker_id: str | None = None,
                       model_name: str | None = None, ready: Callable[[int], None] | None = None,
                       metrics_port: int = 0, tls: ServerTls | None = None,
                       health_port: int = 0) -> None:
    """Loads the model, serves until SIGTERM/SIGINT, then drains and stops. `metrics_port`:
    where to serve Prometheus /metrics (0: nowhere); tracing follows the OTEL_* variables.
    `tls`: serve over TLS (common.tls); `health_port`: also serve gRPC health, and nothing
    else, in plaintext there (0: nowhere), for probes that cannot speak TLS (Kubernetes').
    After an engine fault it hands the requests back, stops, and raises
    SystemExit(faults.EXIT_CODE) for its supervisor to restart it."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    started = time.monotonic()
    tracing.setup_tracing("pagedserve-worker")
    server = create_server([("grpc.max_receive_message_length", 64 * 2**20),
                            ("grpc.max_send_message_length", 64 * 2**20)])
    # The port is taken before the model loads, so a port in use fails in a second, not after
    # minutes of loading; clients are answered once the server starts.
    bound = listen(server, host, port, tls.credentials() if tls else None)
    health_server = create_server([]) if health_port else None
    if health_server is not None:
        listen(health_server, host, health_port)
    log.info("loading the model %s", "(the embedded default)" if config.model == "default" else config.model)
    engine = LLMEngine(config)
    service = WorkerService(engine, worker_id or f"{socket.gethostname()}:{port}",
                            model_name or engine.source.name)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if health_server is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
    service_name = pb.DESCRIPTOR.services_by_name["Worker"].full_name
    enable_reflection(server, (service_name, health.SERVICE_NAME),
                      pool_of((pb.DESCRIPTOR, health_pb2.DESCRIPTOR)))

    async def set_health(status) -> None:
        for name in ("", service_name):
            await health_servicer.set(name, status)

    stop = asyncio.Event()
    running_loop = asyncio.get_running_loop()
    service.loop.on_fault = lambda: running_loop.call_soon_threadsafe(stop.set)
    service.loop.start()
    await server.start()
    if health_server is not None:
        await health_server.start()
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
    service.stopping = True
    fault = service.loop.fault
    if fault is None:
        log.info("shutting down: draining %d requests", len(service.loop.owner))
        # Waited for: until the engine thread has run the drain, the outboxes do not hold the
        # hand-backs yet, and the sessions would close empty (routers then see the worker lost
        # rather than drained: nothing is lost, but the drain path goes unused).
        drained = threading.Event()
        service.loop.call(lambda: (service.loop.drain(), drained.set()))
        if not await asyncio.to_thread(drained.wait, DRAIN_WAIT_S):
            log.warning("the engine thread did not run the drain within %g s: closing the sessions "
                        "anyway (their routers see the worker lost and re-dispatch)", DRAIN_WAIT_S)
    await _close_sessions(service)
    await server.stop(grace=1)
    if health_server is not None:
        await health_server.stop(grace=1)
    service.loop.stop()
    engine.close(abandon=fault is not None)
    tracing.shutdown_tracing()
    if fault is not None:
        log.error("worker %s exits after a %s", service.worker_id, fault.split(" in step")[0])
        raise SystemExit(faults.EXIT_CODE)


async def _close_sessions(service: WorkerService) -> None:
    """Ends every session once its outbox is sent and its router has been quiet for
    SHUTDOWN_LINGER_S since the hand-backs (or since its last message). What a router sent
    before it read the hand-backs (a Submit, an Abort) still arrives then and is answered, a
    late Submit handed back at once, where closing at once would leave it lost with the worker."""
    started = time.monotonic()
    deadline = started + SHUTDOWN_WAIT_S

    def settled() -> bool:
        now = time.monotonic()
        return all(s.outbox.empty() and now - max(s.last_read_at, started) >= SHUTDOWN_LINGER_S
                   for s in service.sessions)
    while time.monotonic() < deadline and not settled():
        await asyncio.sleep(0.05)
    for session in service.sessions:
        session.outbox.put_nowait(None)     # ends each stream, rather than cancel it mid-wait
    while time.monotonic() < deadline and service.sessions:
        await asyncio.sleep(0.05)


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
               model_name: str | None = None, metrics_port: int = 0, tls: ServerTls | None = None,
               health_port: int = 0) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve_worker(config, host, port, worker_id, model_name, metrics_port=metrics_port,
                             tls=tls, health_port=health_port))
