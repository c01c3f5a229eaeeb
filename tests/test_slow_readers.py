"""router.generate: a client that stops reading its stream does not hold the GPU.

A real worker process and an in-process router whose slow-reader timeout is half a second. The
slow client is a gRPC channel with a receive window of 1 KiB and no window growth, so the
router's writes back up after a few dozen responses, as over a slow network; it reads a little,
sleeps, then reads the rest. Greedy outputs are compared token for token with the engine run
offline in this process.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.generate import RunConfig
from router_harness import greedy_request, running_router
from worker_process import WorkerProcess

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time,"
MAX_TOKENS = 120
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess(["--model", "default", "--device", "cpu"]) as process:
        yield process


@pytest.fixture(scope="module")
def expected(make_engine, smollm_tokenizer) -> list[int]:
    from helpers import generate
    outputs = generate(make_engine(), [smollm_tokenizer.encode(PROMPT)],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return outputs["r0"][0]


async def read(router, pause_after: int | None, pause_s: float = 0.0) -> tuple[list[int], list[int]]:
    """Reads one greedy stream through a small receive window, pausing `pause_s` after
    `pause_after` responses: its tokens, and the worker's swapped count seen during the pause."""
    async with grpc.aio.insecure_channel(router.address, options=SMALL_WINDOW) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(
            greedy_request(PROMPT, MAX_TOKENS, ignore_eos=True))
        tokens, swapped, responses = [], [], 0
        async for response in call:
            tokens += [t for c in response.choices for t in c.token_ids]
            responses += 1
            if responses == pause_after:
                for _ in range(int(pause_s / 0.1)):
                    await asyncio.sleep(0.1)
                    swapped += [w.load.num_swapped for w in router.fleet.workers.values() if w.load]
        return tokens, swapped


def test_a_client_that_stops_reading_is_swapped_out_and_resumes_with_the_undisturbed_output(worker, expected):
    async def scenario():
        async with running_router(worker, run=RunConfig(slow_reader_s=0.5)) as router:
            tokens, swapped = await asyncio.wait_for(read(router, pause_after=3, pause_s=4.0), 120)
            return tokens, swapped, router.counters
    tokens, swapped, counters = asyncio.run(scenario())
    assert tokens == expected
    assert max(swapped) == 1                      # its KV sat in the worker's swap space meanwhile
    assert counters.swap_outs_slow_reader == 1 and counters.swap_ins_slow_reader == 1


def test_a_client_that_keeps_reading_is_never_swapped_out(worker, expected):
    async def scenario():
        async with running_router(worker, run=RunConfig(slow_reader_s=0.5)) as router:
            tokens, _ = await asyncio.wait_for(read(router, pause_after=None), 120)
            return tokens, router.counters
    tokens, counters = asyncio.run(scenario())
    assert tokens == expected and counters.swap_outs_slow_reader == 0
