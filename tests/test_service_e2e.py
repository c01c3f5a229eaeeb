"""End to end: the router's public gRPC API in front of real worker processes on loopback.

Workers are `pagedserve serve --role worker` subprocesses with small KV pools, started together once
for the module (each loads SmolLM2 in a few seconds and holds about 2 GB); a test that kills or
drains a worker gets one of its own. The router runs in the test's event loop as a real grpc.aio
server on a free port, so its counters and its view of the workers can be inspected. Greedy
outputs are compared token for token with the engine run offline in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.admission import AdmissionConfig
from router.server import Router, RouterConfig
from router_harness import Stream, client, eventually, greedy_request, read_stream, running_router
from worker_process import REPO, WorkerProcess, free_port, module_command

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
    "The quick brown fox", "La vie est belle parce que", "In 1969, astronauts",
    "import numpy as np\n", "My favourite colour is", "The recipe calls for",
    "Water boils at", "Dear diary, today", "The stock market", "To be or not to be",
    "The largest planet is", "Roses are red,",
]
# Fast reconnects for health polling: gRPC's default backoff after "connection refused" grows
# to many seconds.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100),
                  ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]


def wait_serving(address: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Polls gRPC health at address until SERVING; fails if the process exits first."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, f"process for {address} exited with {process.returncode}"
            with contextlib.suppress(grpc.RpcError):
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not serve within {timeout_s} s")


WORKER_FLAGS = {
    "a": ["--num-blocks", "256"],
    "b": ["--num-blocks", "256"],
    "killed": ["--num-blocks", "256"],
    "drained": ["--num-blocks", "256"],
    "stopped": ["--num-blocks", "256"],
    # 12 blocks of 16 tokens: six requests of 60 tokens cannot all fit.
    "tiny-recompute": ["--num-blocks", "12", "--preemption-mode", "recompute"],
    "tiny-swap": ["--num-blocks", "12", "--preemption-mode", "swap", "--num-swap-blocks", "64"],
    # 3 blocks: max_model_len 48, one request at a time.
    "three-blocks": ["--num-blocks", "3", "--preemption-mode", "recompute"],
}


@pytest.fixture(scope="module")
def workers() -> dict[str, WorkerProcess]:
    """Every worker of the module, started at once so they load in parallel."""
    started = {name: WorkerProcess(
        ["--worker-id", name, "--model", "default", "--device", "cpu", "--dtype", "float32",
         # As on a GPU, where it is the default: kills, drains and preemptions meet tokens
         # still in flight.
         "--async-scheduling", "--metrics-port", "0", *flags],
        env={"OMP_NUM_THREADS": "1"})       # one thread each: several share a small machine
        for name, flags in WORKER_FLAGS.items()}
    for worker in started.values():
        worker.start()
    yield started
    for worker in started.values():
        worker.__exit__()


@pytest.fixture
def worker(workers) -> Callable[[str], WorkerProcess]:
    """workers by name, each once it serves."""
    def get(name: str) -> WorkerProcess:
        workers[name].wait_ready()
        return workers[name]
    return get


@pytest.fixture(scope="module")
def reference(make_engine, smollm_tokenizer):
    """Greedy outputs of the engine run offline in this process: prompt text -> token ids."""
    from helpers import generate

    engine = make_engine(num_blocks=1024)

    def run(prompts: list[str], params: SamplingParams) -> dict[str, list[int]]:
        unique = sorted(set(prompts))
        outputs = generate(engine, [smollm_tokenizer.encode(p) for p in unique], params)
        return {prompt: outputs[f"r{i}"][0] for i, prompt in enumerate(unique)}
    return run


def blocks_all_free(router: Router, worker_name: str) -> bool:
    load = router.fleet.workers[worker_name].load
    return load.free_blocks == load.total_blocks and load.num_running + load.num_waiting == 0


async def released(router: Router, worker_name: str) -> None:
    """Waits until an ended request holds nothing: its worker's blocks and its reservation."""
    await eventually(lambda: blocks_all_free(router, worker_name), 10, "the blocks to be freed")
    await eventually(lambda: router.admission.num_admitted == 0, 5, "the reservation to be released")


async def stream_all_then(stub, requests: list[pb.GenerateRequest], min_tokens: int,
                          action: Callable[[], None]) -> list[Stream]:
    """Starts every request, runs `action` once each stream has min_tokens tokens, and reads
    all streams to their end."""
    streams = [Stream() for _ in requests]
    tasks = [asyncio.create_task(read_stream(stub.Generate(r), s))
             for r, s in zip(requests, streams)]
    await eventually(lambda: all(len(s.token_ids) >= min_tokens for s in streams), 60,
                     f"every stream to have {min_tokens} tokens")
    action()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return streams


# ------------------------------------------------------------------------------ serving

def test_32_concurrent_streams_match_the_offline_engine(worker, reference, smollm_tokenizer):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    expected = reference(prompts, SamplingParams(temperature=0.0, max_tokens=10))

    async def scenario():
        async with running_router(worker("a"), worker("b")) as router, client(router) as stub:
            streams = await asyncio.wait_for(asyncio.gather(
                *(read_stream(stub.Generate(greedy_request(p, 10))) for p in prompts)), 300)
            for prompt, stream in zip(prompts, streams):
                assert stream.token_ids == expected[prompt], prompt
                assert stream.text == smollm_tokenizer.decode(stream.token_ids,
                                                              skip_special_tokens=True)
                first, last = stream.responses[0], stream.responses[-1]
                prompt_tokens = len(smollm_tokenizer.encode(prompt))
                assert not first.choices and first.usage.prompt_tokens == prompt_tokens
                assert last.usage.completion_tokens == len(stream.token_ids)
                assert last.usage.total_tokens == prompt_tokens + len(stream.token_ids)
            assert router.counters.requests == 32
            assert router.admission.num_admitted == 0
            # An evenly loaded fleet: no policy took a request off its GPU or moved one.
            c = router.counters
            assert (c.rebalances, c.swap_outs_priority, c.swap_outs_slow_reader, c.migrations) == (0, 0, 0, 0)
    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_complete_unchanged(mode, worker, reference):
    prompts = PROMPTS[:6]
    params = dict(max_tokens=44, ignore_eos=True)
    expected = reference(prompts, SamplingParams(temperature=0.0, **params))

    async def scenario():
        # Overcommit lets the router admit more than the 192-token pool holds.
        async with running_router(worker(f"tiny-{mode}"),
                                  admission=AdmissionConfig(overcommit=8.0)) as router, \
                client(router) as stub:
            streams = await asyncio.wait_for(asyncio.gather(
                *(read_stream(stub.Generate(greedy_request(p, **params))) for p in prompts)), 300)
            assert [s.token_ids for s in streams] == [expected[p] for p in prompts]
            counters = router.counters
            assert getattr(counters, f"preemptions_{mode}") > 0, counters
            assert counters.redispatches == 0 and counters.migrations == 0
    asyncio.run(scenario())


def test_recompute_preemption_in_a_three_block_pool_finishes_every_request_unchanged(worker, reference):
    """24 concurrent requests sharing a one-block prefix on a worker that holds one at a time:
    this used to stop the worker for good after a few preemptions (waiting requests held the
    blocks of their prefix matches, with nothing running left to preempt)."""
    shared = "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each step aloud"
    prompts = [f"{shared}, {i}:" for i in range(24)]
    params = dict(max_tokens=16, ignore_eos=True)
    expected = reference(prompts, SamplingParams(temperature=0.0, **params))

    async def scenario():
        async with running_router(worker("three-blocks"),
                                  admission=AdmissionConfig(overcommit=24.0)) as router, \
                client(router) as stub:
            streams = await asyncio.wait_for(asyncio.gather(
                *(read_stream(stub.Generate(greedy_request(p, **params))) for p in prompts)), 240)
            assert [s.token_ids for s in streams] == [expected[p] for p in prompts]
            assert router.counters.preemptions_recompute > 0, router.counters
    asyncio.run(scenario())


def test_requests_preempted_for_recompute_migrate_to_a_roomier_worker(worker, reference):
    # Prompts of two full blocks get prefix affinity, which sends some to the tiny worker.
    prompts = [f"{p} {'and then, ' * 12}" for p in PROMPTS[:8]]
    params = dict(max_tokens=40, ignore_eos=True)
    expected = reference(prompts, SamplingParams(temperature=0.0, **params))

    async def scenario():
        async with running_router(worker("tiny-recompute"), worker("a"),
                                  admission=AdmissionConfig(overcommit=8.0)) as router, \
                client(router) as stub:
            streams = await asyncio.wait_for(asyncio.gather(
                *(read_stream(stub.Generate(greedy_request(p, **params))) for p in prompts)), 300)
            assert [s.token_ids for s in streams] == [expected[p] for p in prompts]
            assert router.counters.migrations > 0, router.counters
    asyncio.run(scenario())


def test_killed_worker_requests_finish_on_the_other(worker, reference):
    prompts = PROMPTS[:8]
    expected = reference(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                 ignore_eos=True))
    victim = worker("killed")

    async def scenario():
        async with running_router(worker("a"), victim) as router, client(router) as stub:
            requests = [greedy_request(p, 40, ignore_eos=True) for p in prompts]
            streams = await stream_all_then(stub, requests, 2, victim.process.kill)
            assert [s.token_ids for s in streams] == [expected[p] for p in prompts]
            assert router.counters.workers_lost == 1
            assert router.counters.redispatches > 0
            assert list(router.fleet.workers) == ["a"]
    asyncio.run(scenario())


def test_drained_worker_hands_its_requests_to_the_other(worker, reference):
    prompts = PROMPTS[8:16]
    expected = reference(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                 ignore_eos=True))

    async def scenario():
        async with running_router(worker("a"), worker("drained")) as router, \
                client(router) as stub:
            requests = [greedy_request(p, 40, ignore_eos=True) for p in prompts]
            streams = await stream_all_then(stub, requests, 2,
                                            router.fleet.workers["drained"].drain)
            assert [s.token_ids for s in streams] == [expected[p] for p in prompts]
            assert router.counters.redispatches > 0
            assert router.counters.workers_lost == 0
            assert [w.worker_id for w in router.fleet.accepting()] == ["a"]
            await eventually(lambda: blocks_all_free(router, "drained"), 10,
                             "the drained worker to hold nothing")
    asyncio.run(scenario())


def test_a_worker_stopped_by_sigterm_drains_its_requests_to_the_other(worker, reference):
    """SIGTERM (what Kubernetes sends) drains: the requests come back handed back by a draining
    worker, not lost with it, and finish on the other worker token for token."""
    prompts = PROMPTS[8:16]
    expected = reference(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stopped = worker("stopped")

    async def scenario():
        async with running_router(worker("a"), stopped) as router, client(router) as stub:
            requests = [greedy_request(p, 40, ignore_eos=True) for p in prompts]
            streams = await stream_all_then(stub, requests, 2,
                                            lambda: stopped.process.send_signal(signal.SIGTERM))
            assert [s.token_ids for s in streams] == [expected[p] for p in prompts]
            # Each moved request came back as a PREEMPTED hand-back (counted with the recompute
            # preemptions) before the worker left, rather than being found lost with it.
            assert router.counters.redispatches > 0
            assert router.counters.preemptions_recompute == router.counters.redispatches, stopped.log()
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ cancellation

def test_client_cancel_frees_the_workers_blocks(worker):
    async def scenario():
        async with running_router(worker("a")) as router, client(router) as stub:
            call = stub.Generate(greedy_request(PROMPTS[0], 1000, ignore_eos=True))
            stream = Stream()
            reading = asyncio.create_task(read_stream(call, stream))
            await eventually(lambda: len(stream.token_ids) >= 2, 30, "tokens to flow")
            await eventually(lambda: not blocks_all_free(router, "a"), 5,
                             "a load report showing the request")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            await released(router, "a")
    asyncio.run(scenario())


def test_deadline_frees_the_workers_blocks(worker):
    async def scenario():
        async with running_router(worker("a")) as router, client(router) as stub:
            call = stub.Generate(greedy_request(PROMPTS[1], 1000, ignore_eos=True), timeout=2.0)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await read_stream(call)
            assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await released(router, "a")
    asyncio.run(scenario())


def test_router_shutdown_ends_running_and_queued_streams_with_unavailable_saying_why(worker):
    async def scenario():
        limits = AdmissionConfig(max_concurrent_requests=1)
        async with running_router(worker("a"), admission=limits) as router, client(router) as stub:
            streams, readings = [Stream(), Stream()], []
            for request_id, stream in zip(("running", "queued"), streams):
                request = greedy_request(PROMPTS[0], 2000, ignore_eos=True)
                request.request_id = request_id
                readings.append(asyncio.create_task(read_stream(stub.Generate(request), stream)))
                if request_id == "running":     # admitted first: the second then has to queue
                    await eventually(lambda: len(streams[0].token_ids) >= 2, 30, "tokens to flow")
            await eventually(lambda: router.admission.num_waiting == 1, 10, "the second to queue")
            await router.stop()
            errors = [await rejected(reading) for reading in readings]
        for request_id, error in zip(("running", "queued"), errors):
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.details()
            assert dict(error.trailing_metadata())["request-id"] == request_id
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ overload

def test_overload_is_refused_promptly_with_a_retry_hint(worker):
    async def scenario():
        limits = AdmissionConfig(max_concurrent_requests=2, max_queue_len=2)
        async with running_router(worker("a"), admission=limits) as router, \
                client(router) as stub:
            calls = [stub.Generate(greedy_request(p, 24, ignore_eos=True)) for p in PROMPTS[:10]]
            started = time.monotonic()

            async def outcome(call):
                try:
                    return await read_stream(call)
                except grpc.aio.AioRpcError as error:
                    return error, time.monotonic() - started
            outcomes = await asyncio.wait_for(asyncio.gather(*map(outcome, calls)), 120)
            refused = [o for o in outcomes if isinstance(o, tuple)]
            served = [o for o in outcomes if isinstance(o, Stream)]
            assert len(served) == 4 and len(refused) == 6
            assert all(len(s.token_ids) == 24 for s in served)
            for error, after_s in refused:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert after_s < 2.0
                assert "retry in about" in error.details()
                retry_after = dict(error.trailing_metadata())["retry-after"]
                assert int(retry_after) >= 1
            assert router.counters.rejected_overloaded == 6
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ bad input

async def assert_still_serving(stub) -> None:
    stream = await read_stream(stub.Generate(greedy_request("Hello", 1)))
    assert len(stream.token_ids) == 1


async def rejected(call_coroutine) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call_coroutine
    return failed.value


def expect_rejections(cases: list[tuple[pb.GenerateRequest, grpc.StatusCode, str]], worker):
    """Each request fails with its code and a message containing its text; a valid request
    still succeeds after each."""
    async def scenario():
        async with running_router(worker("a")) as router, client(router) as stub:
            for request, code, needle in cases:
                error = await rejected(read_stream(stub.Generate(request)))
                assert (error.code(), needle in error.details()) == (code, True), (
                    request, error.code(), error.details())
                await assert_still_serving(stub)
    asyncio.run(scenario())


def test_empty_prompt_is_invalid(worker):
    expect_rejections([
        (pb.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT,
         "token_ids.ids is empty"),
        (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "input is missing"),
    ], worker)


def test_prompt_over_max_model_len_is_invalid(worker):
    max_model_len = 256 * 16  # worker "a": its whole pool
    expect_rejections([
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * max_model_len)),
         grpc.StatusCode.INVALID_ARGUMENT, f"token_ids.ids: the prompt has {max_model_len}"),
        (pb.GenerateRequest(text="hello " * max_model_len), grpc.StatusCode.INVALID_ARGUMENT,
         "text: the prompt has"),
    ], worker)


OUT_OF_RANGE = [
    ("n", 0), ("n", 129), ("temperature", -0.5), ("temperature", 101.0), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", 0), ("top_k", -2), ("min_p", -0.1), ("min_p", 1.5),
    ("presence_penalty", -2.5), ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("frequency_penalty", 2.5), ("repetition_penalty", 0.0), ("repetition_penalty", 10.5),
    ("seed", 2**63), ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 17),
    ("logprobs", -1), ("logprobs", 21), ("stop_token_ids", [49152]),
]


def test_every_out_of_range_sampling_parameter_is_invalid(worker):
    cases = []
    for name, value in OUT_OF_RANGE:
        params = pb.SamplingParameters()
        if isinstance(value, list):
            getattr(params, name).extend(value)
        else:
            setattr(params, name, value)
        cases.append((pb.GenerateRequest(text="Hi", params=params),
                      grpc.StatusCode.INVALID_ARGUMENT, f"params.{name}="))
    expect_rejections(cases, worker)


def test_request_id_with_a_control_character_or_too_long_is_invalid(worker):
    expect_rejections([(pb.GenerateRequest(text="Hi", request_id="a\nFAKE LOG LINE"),
                        grpc.StatusCode.INVALID_ARGUMENT, "request_id must be printable"),
                       (pb.GenerateRequest(text="Hi", request_id="x" * 20000),
                        grpc.StatusCode.INVALID_ARGUMENT, "request_id has 20000 characters")], worker)


def test_empty_stop_string_is_invalid(worker):
    expect_rejections([(pb.GenerateRequest(text="Hi", params=pb.SamplingParameters(stop=["ok", ""])),
                        grpc.StatusCode.INVALID_ARGUMENT, "params.stop[1] is empty")], worker)


def test_refusal_names_the_request_in_its_trailers(worker):
    async def scenario():
        async with running_router(worker("a")) as router, client(router) as stub:
            for request_id in ("mine-42", ""):
                call = stub.Generate(pb.GenerateRequest(text="", request_id=request_id))
                error = await rejected(read_stream(call))
                trailers = dict(error.trailing_metadata())
                assert trailers["request-id"] == request_id or (not request_id and len(trailers["request-id"]) == 32)
    asyncio.run(scenario())


def test_reflection_describes_the_public_api_only(worker):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def scenario():
        async with running_router(worker("a")) as router, client(router):
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)

                async def ask(symbol: str) -> reflection_pb2.ServerReflectionResponse:
                    call = stub.ServerReflectionInfo()
                    await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
                    await call.done_writing()
                    return [response async for response in call][0]
                return await ask("pagedserve.v1.Generation"), await ask("pagedserve.worker.v1.Worker")
    public, internal = asyncio.run(scenario())
    assert public.HasField("file_descriptor_response")
    assert internal.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_a_structured_output_constrains_the_streamed_text(worker):
    params = pb.SamplingParameters(max_tokens=24, temperature=1.0, seed=3,
                                   structured_output=pb.StructuredOutput(regex=r" [0-9]{2}:[0-9]{2} (am|pm)"))

    async def scenario():
        async with running_router(worker("a")) as router, client(router) as stub:
            return await read_stream(stub.Generate(pb.GenerateRequest(text="The train leaves at", params=params)))
    stream = asyncio.run(scenario())
    assert re.fullmatch(r" [0-9]{2}:[0-9]{2} (am|pm)", stream.text), stream.text
    assert stream.finish_reason == pb.FINISH_REASON_STOP


def test_a_structured_output_that_does_not_compile_is_invalid_naming_it(worker):
    params = pb.SamplingParameters(structured_output=pb.StructuredOutput(regex="a(b"))
    expect_rejections([(pb.GenerateRequest(text="Hi", params=params), grpc.StatusCode.INVALID_ARGUMENT,
                        "params.structured_output.regex does not compile")], worker)


def test_a_refusal_quoting_a_large_input_is_invalid_argument_cut_to_a_readable_length(worker):
    # The message quotes the regex; whole, it would overflow the client's trailer limit and
    # reach the client as RESOURCE_EXHAUSTED, which reads as overload.
    params = pb.SamplingParameters(structured_output=pb.StructuredOutput(regex="(" + "a" * 20000))
    expect_rejections([(pb.GenerateRequest(text="Hi", params=params), grpc.StatusCode.INVALID_ARGUMENT,
                        "more characters)")], worker)


def test_unknown_model_is_not_found(worker):
    expect_rejections([(pb.GenerateRequest(model="gpt-17", text="Hi"),
                        grpc.StatusCode.NOT_FOUND, "'gpt-17' is not served")], worker)


def test_invalid_utf8_in_a_stop_string_is_invalid(worker):
    request = pb.GenerateRequest(text="Hi", params=pb.SamplingParameters(stop=["ok", "@@"]))
    raw = request.SerializeToString()
    assert raw.count(b"@@") == 1
    raw = raw.replace(b"@@", b"\xff\xfe")

    async def scenario():
        async with running_router(worker("a")) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            generate = channel.unary_stream("/pagedserve.v1.Generation/Generate",
                                            response_deserializer=pb.GenerateResponse.FromString)
            error = await rejected(read_stream(generate(raw)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "params.stop[1] is not valid UTF-8" in error.details()
            await assert_still_serving(generation_pb2_grpc.GenerationStub(channel))
    asyncio.run(scenario())


def test_oversized_message_is_resource_exhausted(worker):
    async def scenario():
        async with running_router(worker("a")) as router, client(router) as stub:
            huge = "x" * (router.config.max_request_bytes + 1)
            error = await rejected(read_stream(stub.Generate(pb.GenerateRequest(text=huge))))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await assert_still_serving(stub)
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ other methods

def test_tokenize_detokenize_model_info_and_health(worker, smollm_tokenizer):
    chat = [{"role": "user", "content": "What is paging?"}]

    async def scenario():
        async with running_router(worker("a")) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            text = await stub.Tokenize(pb.TokenizeRequest(text="Paged attention"))
            assert list(text.token_ids) == smollm_tokenizer.encode("Paged attention")
            assert text.count == len(text.token_ids)
            rendered = await stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(
                messages=[pb.ChatMessage(**m) for m in chat])))
            assert list(rendered.token_ids) == smollm_tokenizer.encode(
                smollm_tokenizer.apply_chat_template(chat, tokenize=False,
                                                     add_generation_prompt=True))
            detok = await stub.Detokenize(pb.DetokenizeRequest(token_ids=text.token_ids))
            assert detok.text == "Paged attention"
            info = await stub.ModelInfo(pb.ModelInfoRequest())
            assert (list(info.model_names), info.max_model_len, info.vocab_size,
                    info.ready_workers) == (["smollm2-135m-instruct"], 4096, 49152, 1)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ API key

API_KEY = "grpc-test-key"


@contextlib.asynccontextmanager
async def keyed_router() -> AsyncIterator[grpc.aio.Channel]:
    """A channel to an in-process router started with an API key and no workers: a call the key
    lets through gets UNAVAILABLE (ModelInfo answers), one it stops gets UNAUTHENTICATED."""
    router = Router(RouterConfig(workers=[], host="127.0.0.1", port=0, api_key=API_KEY,
                                 shutdown_grace_s=0.1))
    await router.start()
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            yield channel
    finally:
        await router.stop()


PUBLIC_CALLS = {
    "Generate": lambda stub, **kw: read_stream(stub.Generate(pb.GenerateRequest(text="Hi"), **kw)),
    "Tokenize": lambda stub, **kw: stub.Tokenize(pb.TokenizeRequest(text="Hi"), **kw),
    "Detokenize": lambda stub, **kw: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]), **kw),
    "ModelInfo": lambda stub, **kw: stub.ModelInfo(pb.ModelInfoRequest(), **kw),
}


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),),
                                      (("authorization", API_KEY),)], ids=["none", "wrong", "no-scheme"])
@pytest.mark.parametrize("method", PUBLIC_CALLS)
def test_with_an_api_key_every_public_method_needs_it(method, metadata):
    async def scenario():
        async with keyed_router() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            error = await rejected(PUBLIC_CALLS[method](stub, metadata=metadata))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "send the metadata 'authorization: Bearer <key>'" in error.details()
    asyncio.run(scenario())


@pytest.mark.parametrize("key, expected", [(API_KEY, "UNAVAILABLE"), (None, "UNAUTHENTICATED")])
def test_the_complete_command_sends_its_api_key(key, expected, capsys):
    """`pagedserve complete --api-key` gets past the key (then UNAVAILABLE: no worker here)."""
    from launcher.cli import main

    async def scenario():
        router = Router(RouterConfig(workers=[], host="127.0.0.1", port=0, api_key=API_KEY,
                                     shutdown_grace_s=0.1))
        await router.start()
        try:
            args = ["complete", "Hi", "--address", router.address] + (["--api-key", key] if key else [])
            assert await asyncio.to_thread(main, args) == 1
        finally:
            await router.stop()
    asyncio.run(scenario())
    assert f"pagedserve: {expected}:" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_api_key_is_accepted_with_the_bearer_scheme_in_any_case(scheme):
    async def scenario():
        async with keyed_router() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            info = await stub.ModelInfo(pb.ModelInfoRequest(),
                                        metadata=(("authorization", f"{scheme} {API_KEY}"),))
            assert info.ready_workers == 0
            error = await rejected(read_stream(stub.Generate(
                pb.GenerateRequest(text="Hi"), metadata=(("authorization", f"{scheme} {API_KEY}"),))))
            assert error.code() == grpc.StatusCode.UNAVAILABLE   # past the key: no worker yet
    asyncio.run(scenario())


def test_health_and_reflection_need_no_api_key():
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def scenario():
        async with keyed_router() as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            await call.done_writing()
            services = [s.name for r in [r async for r in call] for s in r.list_services_response.service]
            assert "pagedserve.v1.Generation" in services
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ router restart

def test_new_router_serves_and_a_dead_routers_requests_are_aborted(worker, tmp_path):
    shared = worker("a")
    port = free_port()
    log_path = tmp_path / "router.log"
    with open(log_path, "w") as log:
        old_router = subprocess.Popen(
            module_command("launcher.cli", "serve", "--role", "router", "--host", "127.0.0.1",
                           "--port", str(port), "--workers", shared.address),
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        try:
            wait_serving(f"127.0.0.1:{port}", old_router, 60)
        except (AssertionError, TimeoutError):
            print(log_path.read_text()[-3000:])
            raise

        async def scenario():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                old_stub = generation_pb2_grpc.GenerationStub(channel)
                streams = [Stream() for _ in range(3)]
                orphans = [asyncio.create_task(read_stream(old_stub.Generate(
                    greedy_request(p, 1000, ignore_eos=True)), s))
                    for p, s in zip(PROMPTS, streams)]
                await eventually(lambda: all(s.token_ids for s in streams), 30,
                                 "the old router's streams to flow")
                async with running_router(shared) as router, client(router) as stub:
                    await eventually(lambda: not blocks_all_free(router, "a"), 5,
                                     "the old router's requests on the worker")
                    old_router.send_signal(signal.SIGKILL)
                    await eventually(lambda: blocks_all_free(router, "a"), 10,
                                     "the worker to abort the dead router's requests")
                    await assert_still_serving(stub)
                for orphan in orphans:
                    with pytest.raises(grpc.aio.AioRpcError):
                        await orphan
        asyncio.run(scenario())
    finally:
        if old_router.poll() is None:
            old_router.kill()
        old_router.wait(timeout=10)
