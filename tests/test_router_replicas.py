"""Several router replicas over one worker: they share its KV budget through its load reports
(router.admission), without talking to each other.

The worker is a real `pagedserve serve --role worker` process with a pool of three KV blocks;
the replicas are in-process routers with default flags, each a real grpc.aio server on
loopback, so what the worker reports to them can be watched. Greedy outputs are compared token
for token with the engine run offline in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.fleet import FleetConfig
from router.server import Router, RouterConfig
from worker_process import WorkerProcess

pytestmark = pytest.mark.slow

POOL_TOKENS = 3 * 16  # --num-blocks 3 of 16 tokens
MAX_TOKENS = 10       # with a prompt of at most 6 tokens, a request fits one block
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time,", "Count to ten:",
    "The quick brown fox", "La vie est belle", "Last summer we", "import numpy as np",
    "My favourite colour is", "The recipe calls for", "Water boils at", "Dear diary, today",
    "The stock market", "To be or not to be", "The largest planet is", "Roses are red,",
    "A haiku about rain:", "The best way to learn", "Paris is known for", "Python lists are",
    "The moon is", "My cat likes", "Tomorrow I will", "Cold winters are",
]


@pytest.fixture(scope="module")
def small_worker() -> Iterator[WorkerProcess]:
    with WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32",
                        "--async-scheduling", "--metrics-port", "0", "--num-blocks", "3"],
                       env={"OMP_NUM_THREADS": "1"}) as worker:
        yield worker


@pytest.fixture(scope="module")
def expected(make_engine, smollm_tokenizer) -> dict[str, list[int]]:
    """Greedy outputs of PROMPTS from the engine run offline in this process, undisturbed."""
    from helpers import generate

    outputs = generate(make_engine(num_blocks=1024), [smollm_tokenizer.encode(p) for p in PROMPTS],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {prompt: outputs[f"r{i}"][0] for i, prompt in enumerate(PROMPTS)}


@contextlib.asynccontextmanager
async def replicas(worker: WorkerProcess, count: int) -> AsyncIterator[list[Router]]:
    """`count` routers with default flags over `worker`, once every one has connected."""
    routers = [Router(RouterConfig(workers=[worker.address], host="127.0.0.1", port=0,
                                   fleet=FleetConfig(backoff_initial_s=0.2), shutdown_grace_s=1.0))
               for _ in range(count)]
    for router in routers:
        await router.start()
    try:
        for router in routers:
            await router.fleet.wait_for(lambda fleet: len(fleet.accepting()) == 1, 60)
        # Every replica has heard from the worker that the others are there.
        await asyncio.wait_for(_until(lambda: all(
            next(iter(r.fleet.workers.values())).load.num_sessions == count for r in routers)), 10)
        yield routers
    finally:
        for router in routers:
            await router.stop()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.05)


async def generate(router: Router, prompt: str) -> list[int]:
    async with grpc.aio.insecure_channel(router.address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            text=prompt, params=pb.SamplingParameters(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True)))
        return [token for response in [r async for r in call] for c in response.choices
                for token in c.token_ids]


def test_two_replicas_never_reserve_more_of_a_worker_than_its_pool(small_worker, expected):
    async def scenario():
        async with replicas(small_worker, 2) as routers:
            reported: list[int] = []

            async def watch() -> None:  # every load report either replica receives
                seen: set[int] = set()
                while True:
                    for router in routers:
                        load = next(iter(router.fleet.workers.values())).load
                        if id(load) not in seen:
                            seen.add(id(load))
                            reported.append(load.tokens_in_flight)
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            halves = [PROMPTS[:12], PROMPTS[12:]]
            outputs = await asyncio.wait_for(asyncio.gather(*(
                generate(router, prompt) for router, half in zip(routers, halves)
                for prompt in half)), 240)
            watcher.cancel()
            return outputs, reported
    outputs, reported = asyncio.run(scenario())
    assert outputs == [expected[p] for p in PROMPTS]
    assert max(reported) <= POOL_TOKENS, sorted(reported)[-5:]
    assert max(reported) > POOL_TOKENS // 2  # the replicas did share it, not take turns
