"""router.generate: a client that stops reading its stream does not hold the GPU.

A real worker process and an in-process router whose slow-reader timeout is half a second. The
slow gRPC client is a channel with a receive window of 1 KiB and no window growth, so the
router's writes back up after a few dozen responses, as over a slow network; the slow HTTP
client is a TCP socket with a 1 KiB receive buffer reading the OpenAI event stream. Each reads
a little, sleeps, then reads the rest. Greedy outputs are compared with the engine run offline
in this process: token for token over gRPC, as text over HTTP.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket

import grpc
import pytest

from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.generate import RunConfig
from router_harness import eventually, greedy_request, running_router
from worker_process import WorkerProcess

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time,"
MAX_TOKENS = 120
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess(["--model", "default", "--device", "cpu"]) as process:
        yield process


class SmallWindowConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a socket whose receive buffer is 1 KiB (set before connecting, so that the
    window it advertises stays small)."""

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


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


async def read_http(router, pause_after: int) -> tuple[str, list[int]]:
    """Streams the same greedy request from /v1/completions (with top-20 logprobs, so each event
    is about 700 bytes), and after `pause_after` events stops reading until the router has
    swapped it out (however fast the tokens come, the connection's buffers fill) and a little
    longer: its text, and the worker's swapped count seen during the pause."""
    connection = SmallWindowConnection("127.0.0.1", router.http_port, timeout=60)
    body = json.dumps({"model": router.fleet.model.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "logprobs": 20, "stream": True})

    def start() -> http.client.HTTPResponse:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        return connection.getresponse()

    def next_event(response: http.client.HTTPResponse) -> dict | None:
        while line := response.readline():
            if line.startswith(b"data: "):
                return None if line.strip() == b"data: [DONE]" else json.loads(line[6:])
        raise AssertionError("the stream ended without [DONE]")

    def sample() -> bool:
        swapped.extend(w.load.num_swapped for w in router.fleet.workers.values() if w.load)
        return router.counters.swap_outs_slow_reader > 0

    response = await asyncio.to_thread(start)
    assert response.status == 200
    text, swapped, events = "", [], 0
    while (event := await asyncio.to_thread(next_event, response)) is not None:
        text += "".join(c["text"] for c in event["choices"])
        events += 1
        if events == pause_after:
            await eventually(sample, 60, "the router to swap the unread stream out")
            for _ in range(5):
                await asyncio.sleep(0.1)
                sample()
    connection.close()
    return text, swapped


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


def test_an_http_client_that_stops_reading_is_swapped_out_and_resumes_with_the_undisturbed_text(
        worker, expected, smollm_tokenizer):
    async def scenario():
        async with running_router(worker, http_port=0, run=RunConfig(slow_reader_s=0.5)) as router:
            text, swapped = await asyncio.wait_for(read_http(router, pause_after=3), 120)
            return text, swapped, router.counters
    text, swapped, counters = asyncio.run(scenario())
    assert text == smollm_tokenizer.decode(expected, skip_special_tokens=True)
    assert max(swapped) == 1                      # its KV sat in the worker's swap space meanwhile
    assert counters.swap_outs_slow_reader == 1 and counters.swap_ins_slow_reader == 1
