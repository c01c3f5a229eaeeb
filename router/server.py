"""A router: discovery, the fleet of workers, admission and the public gRPC server, wired up.

    router = Router(RouterConfig(workers=["127.0.0.1:50061"], port=50051))
    await router.start()   # listening at once; workers connect in the background
    ...
    await router.stop()    # graceful: refuse new calls, give running ones a grace period

`run_router(config)` runs one on uvloop until SIGINT or SIGTERM (`pagedserve serve --role
router`). Besides pagedserve.v1.Generation the server offers standard gRPC health (SERVING
while at least one worker accepts requests) and reflection (for grpcurl). With an API key, calls
to pagedserve.v1 need it as `authorization: Bearer <key>` metadata (router.auth); health and
reflection stay open.

Prometheus metrics (common.metrics.RouterMetrics, in the router's own registry) are served at
/metrics of the HTTP API and, with `metrics_port`, on a port of their own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from common.grpc_server import create_server, listen
from common.metrics import RouterMetrics, serve_metrics
from common.pb import generation_pb2
from common.reflection import enable_reflection, pool_of
from router.admission import Admission, AdmissionConfig
from router.auth import ApiKeyInterceptor
from router.counters import RouterCounters
from router.discovery import Discovery
from router.fleet import Fleet, FleetConfig
from router.generate import RunConfig
from router.grpc_api import SERVICE_NAME, GrpcApi
from router.openai_api import OpenAIApi
from router.preemption import PreemptionConfig, PriorityPreemption
from router.rebalance import RebalanceConfig, Rebalancer
from router.service import GenerationService

log = logging.getLogger("pagedserve.router")

# Largest request message accepted; gRPC answers bigger ones with RESOURCE_EXHAUSTED. A prompt
# of a million tokens is 4-6 MB of text or at most 5 MB of token ids, so 8 MiB admits every
# prompt a model can take and refuses the mistakes before they cost memory.
MAX_REQUEST_BYTES = 8 * 2**20


@dataclass(frozen=True)
class RouterConfig:
    workers: Sequence[str]          # "host:port" or "dns:host:port" (see router.discovery)
    host: str = "0.0.0.0"
    port: int = 50051               # 0 picks a free port (see Router.port)
    served_model_names: Sequence[str] = ()  # default: the workers' model name
    admission: AdmissionConfig = AdmissionConfig()
    fleet: FleetConfig = FleetConfig()
    run: RunConfig = RunConfig()
    preemption: PreemptionConfig = PreemptionConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    max_request_bytes: int = MAX_REQUEST_BYTES
    discovery_refresh_s: float = 10.0
    shutdown_grace_s: float = 10.0  # how long running requests may finish on shutdown
    http_port: int | None = None    # the OpenAI-compatible HTTP API; None: off, 0: a free port
    # Required as "Authorization: Bearer <key>": the HTTP header on /v1 paths, gRPC metadata
    # ("authorization") on pagedserve.v1 calls. None: both are open.
    api_key: str | None = None
    allowed_origins: Sequence[str] = ()  # CORS: origins allowed to call the HTTP API ("*": any)
    # Prometheus /metrics on a port of its own (0: off), running until the process exits; for
    # scrapers that cannot reach the HTTP API (also at /metrics) or where it is off.
    metrics_port: int = 0
    router_id: str = field(default_factory=lambda: (
        f"router-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"))


class Router:
    """One router replica; see the module docstring."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.counters = RouterCounters()
        self.admission = Admission(config.admission)
        self.preemption = (PriorityPreemption(self.admission, config.preemption)
                           if config.preemption.enabled else None)
        self.registry = CollectorRegistry()  # this router's series only, no process collectors
        # The series are labelled with the served model's name: the configured one, or else
        # the one the first worker reports.
        self.fleet = Fleet(config.router_id, self.admission, self.counters, config.fleet,
                           on_model=None if config.served_model_names
                           else lambda model: self._start_metrics(model.name))
        if config.served_model_names:
            self._start_metrics(config.served_model_names[0])
        self.rebalancer = (Rebalancer(self.admission, self.fleet.worker_loads, config.rebalance)
                           if config.rebalance.enabled else None)
        self.service = GenerationService(self.fleet, self.admission, self.counters,
                                         served_model_names=config.served_model_names,
                                         run_config=config.run, preemption=self.preemption,
                                         rebalancer=self.rebalancer)
        self._discovery = Discovery(config.workers, self.fleet.update,
                                    refresh_s=config.discovery_refresh_s)
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._stopped = False
        self._tasks: list[asyncio.Task] = []
        self.port = 0
        self.http_port = 0
        self.metrics_port: int | None = None  # the standalone metrics port, once listening

    @property
    def address(self) -> str:
        """Where clients reach this router from the same machine."""
        host = "localhost" if self.config.host in ("0.0.0.0", "::", "[::]") else self.config.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        interceptors = ([ApiKeyInterceptor(self.config.api_key, generation_pb2.DESCRIPTOR.package)]
                        if self.config.api_key else [])
        server = create_server([("grpc.max_receive_message_length", self.config.max_request_bytes)],
                               interceptors)
        server.add_generic_rpc_handlers((GrpcApi(self.service).rpc_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        # What reflection describes: the public API and health. Not the router<->worker protocol
        # the router speaks as a client: that one is internal, and describing it on the public
        # port would invite clients to it.
        enable_reflection(server, (SERVICE_NAME, health.SERVICE_NAME),
                          pool_of((generation_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR)))
        self.port = listen(server, self.config.host, self.config.port)
        await self._publish_health(serving=False)
        await server.start()
        self._server = server
        if self.config.http_port is not None:
            await self._start_http()
        self.metrics_port = serve_metrics(self.registry, self.config.metrics_port, self.config.host)
        if self.metrics_port is not None:
            log.info("router metrics listening",
                     extra={"address": f"{self.config.host}:{self.metrics_port}"})
        self._tasks = [asyncio.create_task(self._discovery.run(), name="discovery"),
                       asyncio.create_task(self._track_health(), name="health")]
        if self.rebalancer is not None:
            self._tasks.append(asyncio.create_task(self.rebalancer.run(), name="rebalance"))
        log.info("router listening", extra={"router": self.config.router_id,
                                            "address": f"{self.config.host}:{self.port}",
                                            "workers": ",".join(self.config.workers)})

    async def stop(self) -> None:
        """Stops taking calls, lets running ones finish within the grace period (then ends them
        with UNAVAILABLE, which aborts them on the workers), and disconnects from the workers.
        Stopping again does nothing."""
        if self._stopped:
            return
        self._stopped = True
        await self._publish_health(serving=False)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Both servers stop taking calls at once; running streams get the grace period, then
        # end with UNAVAILABLE saying why (end_running). The servers' own deadlines come later,
        # for whatever is left after that.
        grace = self.config.shutdown_grace_s
        stopping = []
        if self._server is not None:
            stopping.append(asyncio.create_task(self._server.stop(grace + 5)))
        if self._http is not None:
            stopping.append(asyncio.create_task(self._http.cleanup()))
        await self.service.end_running(grace)
        await asyncio.gather(*stopping)
        await self.fleet.close()
        log.info("router stopped", extra=self.counters.snapshot())

    async def _start_http(self) -> None:
        api = OpenAIApi(self.service, api_key=self.config.api_key,
                        cors_origins=list(self.config.allowed_origins),
                        ready=lambda: bool(self.fleet.accepting()),
                        metrics=lambda: generate_latest(self.registry))
        # A client that goes away cancels its handler, so its request is aborted on the worker
        # (or leaves the admission queue) at once; aiohttp would otherwise let it run to the end.
        # A body refused unread (413) is read on for lingering_time before the connection
        # closes, so the client sees the reply; aiohttp's 10 s would hold a waiting client.
        self._http = web.AppRunner(api.app(), access_log=None, handler_cancellation=True,
                                   shutdown_timeout=self.config.shutdown_grace_s + 5, lingering_time=2.0)
        await self._http.setup()
        site = web.TCPSite(self._http, self.config.host, self.config.http_port)
        await site.start()
        self.http_port = self._http.addresses[0][1]
        log.info("router HTTP API listening", extra={"address": f"{self.config.host}:{self.http_port}"})

    def _start_metrics(self, model_name: str) -> None:
        """Creates the router's Prometheus series, labelled with `model_name`."""
        self.counters.attach(RouterMetrics(
            model_name, self.registry, running=lambda: self.admission.num_admitted,
            waiting=lambda: self.admission.num_waiting, ready_workers=self.fleet.num_accepting))

    @property
    def http_address(self) -> str:
        host = "localhost" if self.config.host in ("0.0.0.0", "::", "[::]") else self.config.host
        return f"http://{host}:{self.http_port}"

    async def _track_health(self) -> None:
        while True:
            serving = bool(self.fleet.accepting())
            await self._publish_health(serving)
            await self.fleet.wait_for(lambda fleet: bool(fleet.accepting()) != serving)

    async def _publish_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)


async def serve(config: RouterConfig,
                on_ready: Callable[[Router], Awaitable[None]] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Runs a router until SIGINT, SIGTERM or `stop` is set, then stops it gracefully.
    `on_ready(router)` runs alongside once the router listens (and is cancelled at the end)."""
    router = Router(config)
    stop = stop or asyncio.Event()
    ready = None
    try:
        # In the try: a port that cannot be listened on stops the servers already started
        # (an HTTP port taken must not leave the gRPC server running).
        await router.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        ready = asyncio.create_task(on_ready(router)) if on_ready is not None else None
        await stop.wait()
    finally:
        if ready is not None:
            ready.cancel()
        log.info("router shutting down", extra={"grace_s": config.shutdown_grace_s})
        await router.stop()


def run_router(config: RouterConfig) -> None:
    """Blocking: serve(config) on uvloop."""
    import uvloop
    uvloop.run(serve(config))
