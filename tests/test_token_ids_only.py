"""A model without tokenizer files (dummy weights of a bare config) served through the router:
token-id prompts stream token ids; whatever needs text is refused with a message saying why."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from router.fleet import FleetConfig
from router.server import Router, RouterConfig
from worker_process import WorkerProcess

pytestmark = pytest.mark.slow

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("bare-config")
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    with WorkerProcess(["--model", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                        "--dtype", "float32", "--metrics-port", "0"]) as process:
        yield process


@contextlib.asynccontextmanager
async def router_over(worker: WorkerProcess) -> AsyncIterator[Router]:
    """A fresh in-process router (gRPC and HTTP) over the worker, once connected to it."""
    router = Router(RouterConfig(workers=[worker.address], host="127.0.0.1", port=0, http_port=0,
                                 fleet=FleetConfig(backoff_initial_s=0.2), shutdown_grace_s=1.0))
    await router.start()
    try:
        await router.fleet.wait_for(lambda fleet: bool(fleet.accepting()), 60)
        yield router
    finally:
        await router.stop()


def call(worker: WorkerProcess, request: pb.GenerateRequest) -> tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None]:
    """Runs one Generate through a fresh router over the worker: its responses, or its error."""
    async def scenario():
        async with router_over(worker) as router, grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            try:
                return [r async for r in stub.Generate(request)], None
            except grpc.aio.AioRpcError as error:
                return [], error
    return asyncio.run(scenario())


def params(**fields) -> pb.SamplingParameters:
    return pb.SamplingParameters(temperature=0.0, max_tokens=8, ignore_eos=True, **fields)


def test_token_id_prompt_streams_token_ids_without_text(worker):
    responses, error = call(worker, pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 17, 42, 99]), params=params()))
    assert error is None
    choices = [c for r in responses for c in r.choices]
    assert sum(len(c.token_ids) for c in choices) == 8
    assert all(0 <= t < TINY_LLAMA["vocab_size"] for c in choices for t in c.token_ids)
    assert "".join(c.text for c in choices) == ""
    assert choices[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 8


def test_text_prompt_is_refused_asking_for_token_ids(worker):
    _, error = call(worker, pb.GenerateRequest(text="hello", params=params()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without a tokenizer" in error.details() and "token_ids" in error.details()


def test_stop_strings_are_refused_pointing_at_stop_token_ids(worker):
    _, error = call(worker, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]),
                                               params=params(stop=["\n"])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.stop" in error.details() and "stop_token_ids" in error.details()


def test_http_api_takes_token_ids_and_refuses_chat_with_a_400(worker):
    import aiohttp

    async def scenario():
        async with router_over(worker) as router, aiohttp.ClientSession(router.http_address) as http:
            async with http.post("/v1/completions", json={
                    "prompt": [1, 17, 42], "max_tokens": 4, "temperature": 0, "ignore_eos": True}) as r:
                completion = (r.status, await r.json())
            async with http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) as r:
                chat = (r.status, await r.json())
            return completion, chat

    (status, completion), (chat_status, chat) = asyncio.run(scenario())
    assert status == 200 and completion["usage"]["completion_tokens"] == 4
    assert completion["choices"][0]["text"] == ""
    assert chat_status == 400 and "without a tokenizer" in chat["error"]["message"]


def test_http_stream_carries_the_token_ids_it_has_no_text_for(worker):
    """Without a tokenizer the text is empty: each chunk carries its tokens' ids instead, as the
    whole response does, so a stream shows its tokens as they come rather than nothing."""
    import aiohttp

    body = {"prompt": [1, 17, 42], "max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def scenario():
        async with router_over(worker) as router, aiohttp.ClientSession(router.http_address) as http:
            async with http.post("/v1/completions", json=body) as r:
                whole = await r.json()
            async with http.post("/v1/completions", json=body | {"stream": True}) as r:
                events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                          if line.startswith("data: {")]
            return whole, events

    whole, events = asyncio.run(scenario())
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == 6
    chunks = [choice["token_ids"] for event in events for choice in event["choices"]]
    assert [t for chunk in chunks for t in chunk] == ids
    assert len([chunk for chunk in chunks if chunk]) > 1      # streamed, not all at the end
