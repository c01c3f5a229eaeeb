"""The `pagedserve` command: serve a model, or talk to a running server.

    pagedserve serve                                   # one worker + the router on :50051
    pagedserve serve --role router --workers w0:50061 w1:50061
    pagedserve serve --role worker --worker-port 50061
    pagedserve complete "The capital of France is"
    pagedserve chat "Write a haiku about paging"

Every flag can also be set by an environment variable named after it: --max-num-seqs is
PAGEDSERVE_MAX_NUM_SEQS (for switches: true/false). A flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.env_flags import ENV_PREFIX, apply_env
from common.ports import Listener, check_ports
from worker.flags import WORKER_REFUSED, add_engine_args, engine_config_from_args

if TYPE_CHECKING:   # imported where used: the client commands start without grpc's TLS
    from common.tls import ClientTls, ServerTls

DEFAULT_ADDRESS = "localhost:50051"
WORKER_HOST = "127.0.0.1"   # where `serve --role all` runs its worker
# `serve --role all` restarts a worker that fails, but a worker that fails more often than
# this is broken, not unlucky: then it gives up.
MAX_WORKER_RESTARTS = 3
RESTART_WINDOW_S = 300.0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the descriptions' line breaks. A default of None is left to the
    flag's help, which says what not giving it means (the device's choice, the model's limit)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


# ------------------------------------------------------------------------------ serve

def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve serve", formatter_class=_HelpFormatter,
        description="Serve a model over gRPC (pagedserve.v1.Generation).\n\n"
                    "--role all runs one worker (as a subprocess) and the router in this "
                    "process;\n--role router and --role worker run one part, for clusters.")
    parser.add_argument("--role", choices=("all", "router", "worker"), default="all",
                        help="what this process runs")
    engine = parser.add_argument_group("worker: model and engine")
    add_engine_args(engine)
    network = parser.add_argument_group("network")
    network.add_argument("--host", default="0.0.0.0", help="address to listen on")
    network.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    network.add_argument("--worker-port", type=int, default=50061,
                         help="the worker's gRPC port (router<->worker protocol)")
    network.add_argument("--worker-id", help="--role worker: the id it reports to routers, in "
                                             "their logs and metrics (default: host:port)")
    network.add_argument("--metrics-port", type=int, default=9091,
                         help="Prometheus /metrics port (0: off): the worker's with --role worker "
                              "or all, the router's with --role router; the router also serves "
                              "its metrics at /metrics of the HTTP API. Tracing is configured by "
                              "the standard OTEL_* variables (docs/observability.md)")
    network.add_argument("--http-port", type=int, default=8000,
                         help="the router's OpenAI-compatible HTTP API port (-1: off)")
    network.add_argument("--api-key", default=None,
                         help="require 'Authorization: Bearer <key>': the header on the HTTP "
                              "API's /v1 paths, the metadata 'authorization' on gRPC "
                              "pagedserve.v1 calls (gRPC health and reflection stay open)")
    network.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", default=[],
                         help="CORS: browser origins allowed to call the HTTP API ('*': any)")
    network.add_argument("--workers", nargs="+", metavar="TARGET",
                         help="--role router: the workers, each host:port, dns:host:port "
                              "(every address the name resolves to) or k8s:SERVICE[.NAMESPACE]:PORT "
                              "(the ready endpoints of a Kubernetes Service); dns: and k8s: targets "
                              "are listed again every --discovery-interval seconds")
    network.add_argument("--discovery-interval", type=float, default=5.0,
                         help="--role router: seconds between listings of dns: and k8s: worker targets "
                              "(a new worker is used, a vanished one dropped, this soon)")
    network.add_argument("--served-model-name", nargs="+", metavar="NAME",
                         help="names clients may use for the model (default: the model's own); "
                              "the first is reported to clients first")
    tls = parser.add_argument_group(
        "TLS between routers and workers", "PEM files, read and checked at start-up; "
        "docs/serving.md explains which certificate goes where")
    tls.add_argument("--tls-cert-file", help="--role worker: serve the worker API over TLS with "
                                             "this certificate chain (and --tls-key-file)")
    tls.add_argument("--tls-key-file", help="--role worker: the certificate's private key, "
                                            "unencrypted")
    tls.add_argument("--tls-client-ca-file",
                     help="--role worker: mutual TLS: refuse routers without a certificate "
                          "signed by one of these CAs")
    tls.add_argument("--health-port", type=int, default=0,
                     help="--role worker: also serve gRPC health, and nothing else, in "
                          "plaintext on this port (0: off), for probes that cannot speak TLS "
                          "(Kubernetes' gRPC probes)")
    tls.add_argument("--worker-tls-ca-file",
                     help="--role router: dial the workers over TLS, checking their "
                          "certificates against these CAs")
    tls.add_argument("--worker-tls-cert-file",
                     help="--role router: mutual TLS: the certificate chain to present to the "
                          "workers (with --worker-tls-key-file)")
    tls.add_argument("--worker-tls-key-file", help="--role router: that certificate's key")
    tls.add_argument("--worker-tls-server-name",
                     help="--role router: the name the workers' certificates must carry "
                          "(default: the host of the worker address; dns: targets resolve to "
                          "IP addresses, so give them the Service's name)")
    router = parser.add_argument_group("router: admission and scheduling")
    router.add_argument("--max-concurrent-requests", type=int, default=1024,
                        help="requests running at once over all workers; more wait in the queue")
    router.add_argument("--max-queue-len", type=int, default=256,
                        help="requests waiting for admission; more are refused "
                             "(RESOURCE_EXHAUSTED with a retry-after hint)")
    router.add_argument("--max-queue-wait", type=float, default=30.0,
                        help="seconds a request may wait for admission before it is refused")
    router.add_argument("--overcommit", type=float, default=1.0,
                        help="a worker's token budget is its KV capacity times this; above 1 "
                             "bets that requests stop before max_tokens (the worker preempts "
                             "when the bet is lost)")
    router.add_argument("--migrate-on-preemption", action=argparse.BooleanOptionalAction,
                        default=True, help="move a request preempted for recompute to a worker "
                                           "with clearly more free KV blocks")
    router.add_argument("--slow-reader-timeout", type=float, default=10.0,
                        help="seconds a client may leave the next response untaken (its stream "
                             "backed up) while its request holds a GPU before the request is "
                             "swapped out, to run again once the client has read what waited "
                             "(0: never)")
    router.add_argument("--slow-reader-backlog", type=int, default=1024,
                        help="swap such a request out sooner, once this many token messages wait "
                             "behind its client")
    router.add_argument("--preempt-for-priority", action=argparse.BooleanOptionalAction,
                        default=True, help="when a request fits no worker but is more urgent (a "
                                           "lower priority value) than running ones, take the "
                                           "least urgent of those off the worker where that frees "
                                           "the fewest tokens (swap out), and let them run again "
                                           "once there is room")
    router.add_argument("--preemption-min-run", type=float, default=1.0,
                        help="seconds a request runs after its admission, or its return, before "
                             "it may be taken off a GPU for priority again (against thrash)")
    router.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=True,
                        help="move running requests off a worker whose requests wait to one with "
                             "room (recompute there), the cheapest to recompute first")
    router.add_argument("--rebalance-after", type=float, default=2.0,
                        help="seconds both the waiting and the room must last before a move")
    router.add_argument("--rebalance-interval", type=float, default=30.0,
                        help="a request moves at most once per this many seconds")
    router.add_argument("--worker-timeout", type=float, default=5.0,
                        help="seconds without a message from a worker (it reports its load 5 "
                             "times a second) after which it counts as lost: a frozen worker's "
                             "requests then move to another worker")
    router.add_argument("--shutdown-grace", type=float, default=10.0,
                        help="seconds running requests may finish when the router stops")
    logs = parser.add_argument_group("logs")
    logs.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    logs.add_argument("--log-format", default="text", choices=("text", "json"),
                      help="json: one JSON object per line")
    apply_env(parser)
    return parser


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from common.log import setup_logging

    if args.role == "router" and not args.workers:
        parser.error("--role router needs --workers (for example --workers 10.0.0.7:50061)")
    _check_ranges(args, parser)
    _check_tls_flags(args, parser)
    setup_logging(args.log_level, args.log_format)
    try:
        # Before the model loads, which can take minutes: a taken port is refused at once.
        check_ports(_listeners(args))
        return _serve_role(args, parser)
    except (OSError, ValueError) as error:
        # A taken port, a bad model path or setting (the loader's ModelLoadError and the
        # engine's and the router's checks are ValueErrors whose message names it): one line.
        # Any other exception is a bug and keeps its traceback.
        print(f"pagedserve: {error}", file=sys.stderr)
        return WORKER_REFUSED if args.role == "worker" else 1


# Port flags and the value each takes besides a port (0: any free port the system gives).
_PORT_FLAGS = {"port": None, "worker_port": None, "metrics_port": "0: off", "health_port": "0: off",
               "http_port": "-1: off"}
# The router's numeric flags: (smallest, whether the smallest itself is allowed, its meaning).
_ROUTER_LIMITS = {"max_concurrent_requests": (1, True, ""), "max_queue_len": (0, True, ""),
                  "max_queue_wait": (0, True, " seconds"), "overcommit": (0, False, ""),
                  "worker_timeout": (0, False, " seconds"), "discovery_interval": (0, False, " seconds"),
                  "preemption_min_run": (0, True, " seconds"), "slow_reader_timeout": (0, True, " seconds"),
                  "slow_reader_backlog": (1, True, ""), "rebalance_after": (0, True, " seconds"),
                  "rebalance_interval": (0, True, " seconds"), "shutdown_grace": (0, True, " seconds")}


def _check_ranges(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Out-of-range ports and router settings are usage errors, not a server that listens
    elsewhere (a port past 65535 wraps) or refuses every request (an overcommit of 0 or NaN)."""
    for name, off in _PORT_FLAGS.items():
        value = getattr(args, name)
        if not (0 <= value <= 65535 or (off and value == int(off.split(":")[0]))):
            parser.error(f"--{name.replace('_', '-')} {value} is not a port: it takes 0 to 65535 "
                         f"(0: any free port{'; ' + off if off else ''})")
    for name, (low, inclusive, unit) in _ROUTER_LIMITS.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
            parser.error(f"--{name.replace('_', '-')} {value:g} must be {'at least' if inclusive else 'above'} "
                         f"{low}{unit}")


def _serve_role(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.role == "worker":
        tls = _worker_server_tls(args)     # before torch and the model: a bad file fails at once
        # Start-up shows progress through its silent stretches: importing torch takes seconds.
        logging.getLogger("pagedserve.worker").info("worker starting: importing torch")
        from worker.server import run_worker     # imports torch: only a worker pays for it
        run_worker(engine_config_from_args(args), args.host, args.worker_port, args.worker_id,
                   model_name=(args.served_model_name or [None])[0],
                   metrics_port=args.metrics_port, tls=tls, health_port=args.health_port)
        return 0
    from common import tracing
    try:
        tracing.setup_tracing("pagedserve-router")  # a worker process sets up its own
    except ValueError as error:
        parser.error(str(error))
    try:
        if args.role == "router":
            from router.server import run_router
            run_router(_router_config(args, args.workers))
            return 0
        import uvloop
        return uvloop.run(_serve_all(args))
    finally:
        tracing.shutdown_tracing()  # exports the spans still buffered


def _listeners(args: argparse.Namespace) -> list[Listener]:
    """Every port `serve` cannot serve without, its worker's included with --role all. Not
    --metrics-port: without it a process still serves (common.metrics.serve_metrics logs that
    it is taken), and several processes on one host are run on its default."""
    if args.role == "worker":
        health = [("--health-port", args.host, args.health_port)] if args.health_port else []
        return [("--worker-port", args.host, args.worker_port), *health]
    router = [("--port", args.host, args.port), ("--http-port", args.host, args.http_port)]
    if args.role == "router":
        return router
    return [*router, ("--worker-port", WORKER_HOST, args.worker_port)]


def _router_config(args: argparse.Namespace, workers: Sequence[str]):
    from router.admission import AdmissionConfig
    from router.fleet import FleetConfig
    from router.generate import RunConfig
    from router.preemption import PreemptionConfig
    from router.rebalance import RebalanceConfig
    from router.server import RouterConfig

    return RouterConfig(
        workers=list(workers), host=args.host, port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        admission=AdmissionConfig(overcommit=args.overcommit,
                                  max_concurrent_requests=args.max_concurrent_requests,
                                  max_queue_len=args.max_queue_len,
                                  max_wait_s=args.max_queue_wait),
        run=RunConfig(migrate_on_preemption=args.migrate_on_preemption, slow_reader_s=args.slow_reader_timeout,
                      slow_reader_backlog=args.slow_reader_backlog),
        preemption=PreemptionConfig(enabled=args.preempt_for_priority,
                                    min_run_s=args.preemption_min_run),
        rebalance=RebalanceConfig(enabled=args.rebalance, hold_s=args.rebalance_after,
                                  interval_s=args.rebalance_interval),
        fleet=FleetConfig(silence_timeout_s=args.worker_timeout, worker_tls=_worker_client_tls(args)),
        discovery_refresh_s=args.discovery_interval,
        shutdown_grace_s=args.shutdown_grace,
        http_port=None if args.http_port < 0 else args.http_port,
        # With --role all the worker has --metrics-port; the router's are then on the HTTP API.
        metrics_port=args.metrics_port if args.role == "router" else 0,
        api_key=args.api_key, allowed_origins=tuple(args.allowed_origins))


_WORKER_TLS_FLAGS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "health_port")
_ROUTER_TLS_FLAGS = ("worker_tls_ca_file", "worker_tls_cert_file", "worker_tls_key_file",
                     "worker_tls_server_name")


def _check_tls_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuses TLS flags given to a role that would ignore them, or given without their pair.
    With --role all the router reaches its own worker on loopback, in plaintext."""
    def given(names: Sequence[str]) -> list[str]:
        return ["--" + name.replace("_", "-") for name in names if getattr(args, name)]

    if args.role != "worker" and given(_WORKER_TLS_FLAGS):
        parser.error(f"{', '.join(given(_WORKER_TLS_FLAGS))}: for --role worker only")
    if args.role != "router" and given(_ROUTER_TLS_FLAGS):
        parser.error(f"{', '.join(given(_ROUTER_TLS_FLAGS))}: for --role router only")
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        parser.error("--tls-cert-file and --tls-key-file go together")
    if args.tls_client_ca_file and not args.tls_cert_file:
        parser.error("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    if bool(args.worker_tls_cert_file) != bool(args.worker_tls_key_file):
        parser.error("--worker-tls-cert-file and --worker-tls-key-file go together")
    if given(_ROUTER_TLS_FLAGS) and not args.worker_tls_ca_file:
        parser.error(f"{', '.join(given(_ROUTER_TLS_FLAGS))}: need --worker-tls-ca-file, the CAs "
                     "the workers' certificates are checked against")


def _worker_server_tls(args: argparse.Namespace) -> ServerTls | None:
    """The worker's common.tls.ServerTls, or None (plaintext); raises TlsError for a bad file."""
    from common.tls import load_server_tls
    if not args.tls_cert_file:
        return None
    return load_server_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)


def _worker_client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The router's common.tls.ClientTls for dialing workers, or None (plaintext); raises
    TlsError for a bad file."""
    from common.tls import load_client_tls
    if not args.worker_tls_ca_file:
        return None
    return load_client_tls(args.worker_tls_ca_file, args.worker_tls_cert_file,
                           args.worker_tls_key_file, args.worker_tls_server_name)


async def _serve_all(args: argparse.Namespace) -> int:
    """A worker subprocess on loopback, restarted when it fails, and the router in this process.
    Ctrl-C stops the router first (running requests get the grace period), then the worker."""
    from router.server import serve

    worker = _SupervisedWorker(args)
    stop = asyncio.Event()
    # From the start, not only once the router serves: Ctrl-C or SIGTERM while the worker
    # loads must stop it too, as nothing else would (it runs in a session of its own).
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        started = await _until_stopped(stop, worker.start())
        if started is None:     # stopped while the worker loaded
            return 0
        if not started:
            return worker.start_failed()
        supervision = asyncio.create_task(worker.supervise())
        supervision.add_done_callback(lambda _: stop.set())
        await serve(_router_config(args, [worker.address]), on_ready=_announce, stop=stop)
        if supervision.done():
            return supervision.result()     # or raises what ended it: a taken port
        supervision.cancel()                # stopped by Ctrl-C or SIGTERM
        await asyncio.wait([supervision])
        return 0
    finally:
        await worker.stop()


async def _until_stopped(stop: asyncio.Event, work: Awaitable[bool]) -> bool | None:
    """What work returns, or None (work cancelled) if stop is set first."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait([task])
    return None


class _SupervisedWorker:
    """The worker subprocess of `serve --role all`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.address = f"{WORKER_HOST}:{args.worker_port}"
        self.process: asyncio.subprocess.Process | None = None
        self._failures: list[float] = []    # loop times of its failures in the last window

    async def start(self) -> bool:
        """Starts a worker and waits until it serves: True, or False if it exited first."""
        # Again at every start: another server may have taken the port since the last one.
        check_ports([("--worker-port", WORKER_HOST, self.args.worker_port)])
        # A new id each time, which the worker must report: the proof that the one answering
        # on the port is this one, not a stranger that took the port while it was loading.
        worker_id = f"worker-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        name = (["--served-model-name", self.args.served_model_name[0]]
                if self.args.served_model_name else [])
        # The engine settings travel as the worker's own PAGEDSERVE_* variables; its own
        # session keeps a terminal's Ctrl-C from reaching it before the router has finished.
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "launcher.cli", "serve", "--role", "worker", "--host", WORKER_HOST,
            "--worker-port", str(self.args.worker_port), "--worker-id", worker_id,
            "--metrics-port", str(self.args.metrics_port), "--log-level", self.args.log_level,
            "--log-format", self.args.log_format, *name,
            env={**os.environ, **_engine_env(self.args)}, start_new_session=True)
        return await _wait_until_serving(self.address, self.process, worker_id)

    def start_failed(self) -> int:
        """serve's exit code when the first worker exited before serving; says so unless the
        worker said why itself."""
        if self.process.returncode == WORKER_REFUSED:
            return WORKER_REFUSED
        print(f"pagedserve: the worker exited with code {self.process.returncode} before "
              "serving (its log is above)", file=sys.stderr)
        return 1

    async def supervise(self) -> int:
        """Restarts the worker whenever it fails, until it stops by itself (SIGTERM drains a
        worker, then it exits with 0) or fails more than MAX_WORKER_RESTARTS times within
        RESTART_WINDOW_S; returns serve's exit code then."""
        loop = asyncio.get_running_loop()
        while True:
            code = await self.process.wait()
            if code == 0:
                print("pagedserve: the worker exited with code 0", file=sys.stderr)
                return 1
            now = loop.time()
            self._failures = [t for t in self._failures if now - t < RESTART_WINDOW_S] + [now]
            if len(self._failures) > MAX_WORKER_RESTARTS:
                print(f"pagedserve: the worker exited with code {code}: {len(self._failures)} "
                      f"failures within {RESTART_WINDOW_S:g} s; giving up", file=sys.stderr)
                return 1
            print(f"pagedserve: the worker exited with code {code}; restarting it",
                  file=sys.stderr, flush=True)
            await self.start()

    async def stop(self) -> None:
        """Stops the worker if it runs: it drains and exits (or is killed after 30 s)."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), 30)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()


def _engine_env(args: argparse.Namespace) -> dict[str, str]:
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    names = vars(engine.parse_args([])).keys()
    # A flag of several values (--logits-processors a b) as apply_env reads it back: spaced;
    # a --lora-modules entry (name, path) as it was written, name=path.
    item = lambda v: "=".join(v) if isinstance(v, tuple) else str(v)  # noqa: E731
    as_env = lambda value: " ".join(map(item, value)) if isinstance(value, list) else str(value)  # noqa: E731
    return {ENV_PREFIX + name.upper(): as_env(getattr(args, name))
            for name in names if getattr(args, name) is not None}


async def _wait_until_serving(address: str, worker: asyncio.subprocess.Process, worker_id: str,
                              timeout_s: float = 1800.0) -> bool:
    """Polls the worker's gRPC health until SERVING (loading a model can take minutes): True
    then, False if the worker exits first. Raises OSError if what serves at `address` is not
    the worker `worker_id`, TimeoutError (an OSError too) if nothing serves in time."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.pb import worker_pb2, worker_pb2_grpc

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # Reconnect fast: gRPC's default backoff after "connection refused" grows past 10 s.
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while loop.time() < deadline:
            if worker.returncode is not None:
                return False
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    info = await worker_pb2_grpc.WorkerStub(channel).Info(
                        worker_pb2.InfoRequest(), timeout=5.0)
                    if info.worker_id != worker_id:
                        raise OSError(f"a worker this process did not start ({info.worker_id}) "
                                      f"answers at {address}; choose another --worker-port")
                    return True
            except grpc.aio.AioRpcError:
                pass  # not listening yet
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the worker at {address} did not serve within {timeout_s:g} s")


async def _announce(router) -> None:
    await router.fleet.wait_for(lambda fleet: bool(fleet.accepting()))
    address = router.address
    print(f"\npagedserve is serving {router.fleet.model.name}\n"
          f"  gRPC     {address}  (pagedserve.v1.Generation; health and reflection enabled)\n"
          + (f"  HTTP     {router.http_address}/v1  (OpenAI-compatible: completions, chat/completions,"
             f" models; /health, /metrics)\n" if router.http_port else "")
          + f"  try      pagedserve complete \"The capital of France is\" --address {address}\n"
          f"           grpcurl -plaintext -d '{{\"text\": \"The capital of France is\"}}' "
          f"{address} pagedserve.v1.Generation/Generate\n"
          f"Ctrl-C stops the router and the worker.\n", flush=True)


# ------------------------------------------------------------------------------ clients

def _client_parser(command: str, prompt_help: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"pagedserve {command}", formatter_class=_HelpFormatter,
                                     description=f"{prompt_help}, streaming the answer.")
    parser.add_argument("prompt", help=prompt_help.lower())
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the router's gRPC address")
    parser.add_argument("--model", default="", help="served model name (default: the served one)")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, help="0 = greedy (server default 1.0)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling (server default 1.0)")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens")
    parser.add_argument("--seed", type=int, help="same seed, same output")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, help="deadline in seconds")
    parser.add_argument("--api-key", help="the router's --api-key, if it has one")
    if command == "chat":
        parser.add_argument("--system", help="a system message before yours")
    apply_env(parser)
    return parser


def _complete(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from common.pb import generation_pb2 as pb
    return _stream(args, parser, pb.GenerateRequest(text=args.prompt))


def _chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from common.pb import generation_pb2 as pb
    messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
    messages.append(pb.ChatMessage(role="user", content=args.prompt))
    return _stream(args, parser, pb.GenerateRequest(chat=pb.ChatMessages(messages=messages)))


def _stream(args: argparse.Namespace, parser: argparse.ArgumentParser, request) -> int:
    """Sends the request and writes the text as it arrives; a summary goes to stderr."""
    import grpc

    from common.pb import generation_pb2 as pb
    from common.pb import generation_pb2_grpc

    request.model = args.model
    params = request.params
    params.stop.extend(args.stop)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            try:
                setattr(params, name, value)
            except ValueError:      # past the field's integer type: a usage error, not a traceback
                from google.protobuf.descriptor import FieldDescriptor as F
                low, high = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
                             F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1),
                             }[params.DESCRIPTOR.fields_by_name[name].type]
                parser.error(f"--{name.replace('_', '-')} {value}: out of range; it takes {low} to {high}")
    finish, usage = "", None
    with grpc.insecure_channel(args.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                for choice in response.choices:
                    sys.stdout.write(choice.text)
                    if choice.finish_reason:
                        finish = pb.FinishReason.Name(choice.finish_reason)
                sys.stdout.flush()
                if response.HasField("usage"):
                    usage = response.usage
        except grpc.RpcError as error:
            print(f"\npagedserve: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    print()
    if usage is not None:
        print(f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens, "
              f"{finish.removeprefix('FINISH_REASON_').lower()}]", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------ main

@dataclass(frozen=True)
class _Command:
    help: str
    parser: Callable[[], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


COMMANDS = {
    "serve": _Command("serve a model (worker and router, or one of them)", _serve_parser, _serve),
    "complete": _Command("complete a text prompt",
                         lambda: _client_parser("complete", "Complete a text prompt"), _complete),
    "chat": _Command("send one chat message",
                     lambda: _client_parser("chat", "Send one chat message"), _chat),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog="pagedserve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1],
        epilog="commands:\n" + "\n".join(f"  {name:<10}{c.help}" for name, c in COMMANDS.items())
               + "\n\n`pagedserve COMMAND --help` explains a command's flags.")
    top.add_argument("command", choices=COMMANDS, help="what to do")
    # Only the command word is parsed here: each command builds its own parser on demand, so
    # the client commands start without importing the engine.
    command = COMMANDS[top.parse_args(argv[:1]).command]
    parser = command.parser()
    try:
        return command.run(parser.parse_args(argv[1:]), parser)
    except OSError as error:    # a port taken, a file unreadable: say so, without a traceback
        raise SystemExit(f"pagedserve: {error}") from error


if __name__ == "__main__":
    sys.exit(main())
