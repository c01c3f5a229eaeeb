"""A router in the test's event loop over real worker processes, and the gRPC client side of
the end-to-end tests: one place for what test_service_e2e, test_preemption, test_lora_serving,
test_slow_readers and test_rebalance all drive."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from router.admission import AdmissionConfig
from router.fleet import FleetConfig
from router.server import Router, RouterConfig
from worker_process import WorkerProcess


@contextlib.asynccontextmanager
async def running_router(*workers: WorkerProcess, admission: AdmissionConfig = AdmissionConfig(),
                         fleet: FleetConfig = FleetConfig(backoff_initial_s=0.2), **settings) -> AsyncIterator[Router]:
    """An in-process router over the given workers, once it is connected to all of them."""
    router = Router(RouterConfig(
        workers=[w.address for w in workers], host="127.0.0.1", port=0, admission=admission,
        fleet=fleet, shutdown_grace_s=1.0, **settings))
    await router.start()
    try:
        await router.fleet.wait_for(lambda fleet: len(fleet.accepting()) == len(workers), 60)
        yield router
    finally:
        await router.stop()


@contextlib.asynccontextmanager
async def client(router: Router) -> AsyncIterator[generation_pb2_grpc.GenerationStub]:
    async with grpc.aio.insecure_channel(router.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def greedy_request(prompt: str, max_tokens: int, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, params=pb.SamplingParameters(
        temperature=0.0, max_tokens=max_tokens, **params))


@dataclass
class Stream:
    """What one Generate call returned, gathered as it arrives."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    responses: list[pb.GenerateResponse] = field(default_factory=list)


async def read_stream(call, stream: Stream | None = None) -> Stream:
    """Reads a single-choice Generate call to its end into `stream`."""
    stream = stream or Stream()
    async for response in call:
        stream.responses.append(response)
        for choice in response.choices:
            assert choice.index == 0
            stream.token_ids += choice.token_ids
            stream.text += choice.text
            if choice.finish_reason:
                stream.finish_reason = choice.finish_reason
    return stream


async def eventually(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Polls predicate until it holds; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.05)
