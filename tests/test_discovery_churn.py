"""Discovery under churn, end to end: workers on loopback addresses behind one DNS name (a test
resolver answers for it, as a Kubernetes headless Service would) come and go while clients
stream; the router follows without a restart, uses a new worker once it serves, drops one that
leaves within seconds, and every request completes, with the same tokens as before the churn."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.request

import grpc
import pytest

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from router.fleet import FleetConfig
from router.server import Router, RouterConfig
from worker_process import WorkerProcess, free_port

pytestmark = pytest.mark.slow

NAME = "workers.churn.test"
REFRESH_S = 0.5         # the router's --discovery-interval here
FOLLOW_WITHIN_S = 5.0   # "within seconds": a worker that comes or goes is seen this soon
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]


def finished_requests(host: str, metrics_port: int) -> float:
    """Requests the worker at host completed, from its /metrics."""
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("pagedserve_worker_requests_finished_total{") and 'reason="length"' in line)


async def eventually(condition, timeout_s: float, what: str) -> float:
    """Seconds until condition() holds; fails after timeout_s."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def test_router_follows_workers_coming_and_going_behind_one_name(monkeypatch):
    port = free_port()
    metrics = {"a": free_port(), "b": free_port()}
    workers = {name: WorkerProcess(["--worker-id", name, "--model", "default", "--device", "cpu",
                                    "--dtype", "float32", "--metrics-port", str(metrics[name])],
                                   host=host, port=port)
               for name, host in (("a", "127.0.0.2"), ("b", "127.0.0.3"))}
    # The name's records: what a headless Service's DNS would answer, ready pods only.
    records: set[str] = set()
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, service, *args, **kwargs):
        if host != NAME:
            return real_getaddrinfo(host, service, *args, **kwargs)
        if not records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, service)) for ip in records]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for worker in workers.values():
        worker.start()
    try:
        for worker in workers.values():
            worker.wait_ready()
        records.add("127.0.0.2")
        asyncio.run(asyncio.wait_for(_churn(workers, records, port, metrics), 180))
    finally:
        for worker in workers.values():
            worker.__exit__()


async def _churn(workers: dict[str, WorkerProcess], records: set[str], port: int,
                 metrics: dict[str, int]) -> None:
    router = Router(RouterConfig(workers=[f"dns:{NAME}:{port}"], host="127.0.0.1", port=0,
                                 discovery_refresh_s=REFRESH_S, fleet=FleetConfig(backoff_initial_s=0.2),
                                 shutdown_grace_s=1.0))
    await router.start()

    def ids() -> set[str]:
        """The workers the router uses now."""
        return set(router.fleet.workers)

    outputs: dict[str, set[str]] = {p: set() for p in PROMPTS}
    errors: list[str] = []
    stop = asyncio.Event()
    completed = 0

    async def client(prompt: str, stub) -> None:
        nonlocal completed
        while not stop.is_set():
            request = pb.GenerateRequest(text=prompt, params=pb.SamplingParameters(
                max_tokens=24, temperature=0, ignore_eos=True))
            try:
                text = "".join([c.text async for r in stub.Generate(request, timeout=60) for c in r.choices])
            except grpc.aio.AioRpcError as error:
                errors.append(f"{error.code().name}: {error.details()}")
                await asyncio.sleep(0.1)
                continue
            outputs[prompt].add(text)
            completed += 1

    try:
        await eventually(lambda: ids() == {"a"}, 10, "the router using worker a")
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            clients = [asyncio.create_task(client(p, stub)) for p in PROMPTS]
            await eventually(lambda: completed >= 8, 60, "requests through worker a")

            # A new worker behind the name is used, without a restart.
            records.add("127.0.0.3")
            joined = await eventually(lambda: ids() == {"a", "b"}, 10, "worker b joining")
            await eventually(lambda: finished_requests("127.0.0.3", metrics["b"]) > 0, 30,
                             "requests on worker b")

            # A worker whose record goes (a pod unready, or being deleted) is dropped by discovery
            # alone, while it still runs; its requests continue on the other. Then it stops.
            before = completed
            records.discard("127.0.0.2")
            left = await eventually(lambda: ids() == {"b"}, 10, "worker a leaving")
            assert workers["a"].process.poll() is None
            workers["a"].process.send_signal(signal.SIGTERM)
            await eventually(lambda: completed >= before + 8, 60, "requests after worker a left")
            stop.set()
            await asyncio.gather(*clients)
    finally:
        await router.stop()
    assert not errors, errors
    # Greedy decoding: each prompt's every completion, moved mid-stream or not, is the same text.
    assert all(len(texts) == 1 for texts in outputs.values()), outputs
    assert joined < FOLLOW_WITHIN_S and left < FOLLOW_WITHIN_S, (joined, left)
