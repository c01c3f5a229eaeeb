"""Serving on an NVIDIA GPU through real processes, as users run it.

`pagedserve serve` with the Llama-3.1-8B shape (dummy bf16 weights) and its defaults takes
lone prompts up to its full max_model_len on a fresh worker, alone and beside running decodes
(a lone 16k prompt used to crash it: the staging buffers of a run of prompt chunks were
rewritten before their copies ran). A GPU worker whose device faults (injected) hands its
requests back and exits, and the router finishes them on the other worker, token for token.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import grpc
import pytest
import torch
from helpers import save_tiny_llama

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.fleet import FleetConfig
from router.server import Router, RouterConfig
from worker import faults
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker_process import REPO, WorkerProcess, free_port, module_command, python_path

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MAX_MODEL_LEN_8B = 131072


def token_request(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=pb.SamplingParameters(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def generate(stub, request: pb.GenerateRequest) -> tuple[list[int], int]:
    tokens, finish = [], 0
    async for response in stub.Generate(request, timeout=600):
        for choice in response.choices:
            tokens += choice.token_ids
            finish = choice.finish_reason or finish
    return tokens, finish


def random_ids(count: int, seed: int, vocab: int = 128000) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def serve_8b():
    """`pagedserve serve` (router + worker) with the 8B shape and default engine settings."""
    port = free_port()
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), "serve_8b.log"), "w")
    process = subprocess.Popen(
        module_command("launcher.cli", "serve", "--model", "llama-3.1-8b", "--load-format", "dummy",
                       "--port", str(port), "--worker-port", str(free_port()), "--http-port", "-1",
                       "--metrics-port", "0", "--host", "127.0.0.1"),
        cwd=REPO, env={**os.environ, "PYTHONPATH": python_path()}, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while True:
            assert process.poll() is None, f"serve exited with {process.returncode}"
            try:
                stub.ModelInfo(pb.ModelInfoRequest(), timeout=2)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "serve did not come up in 300 s"
                time.sleep(1)
    yield address
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def test_lone_prompts_up_to_max_model_len_complete_on_a_fresh_8b_server(serve_8b):
    """Doubling from 16k to the full context, each alone on an idle worker: the runs of prompt
    chunks that draw no token, where the host races ahead of the device."""
    async def scenario():
        async with grpc.aio.insecure_channel(serve_8b) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for length in (16384, 32768, 65536, MAX_MODEL_LEN_8B - 8):
                tokens, finish = await generate(stub, token_request(random_ids(length, length), 8))
                assert len(tokens) == 8 and finish == pb.FINISH_REASON_LENGTH, length
    asyncio.run(scenario())


def test_long_prompts_beside_running_decodes_complete(serve_8b):
    async def scenario():
        async with grpc.aio.insecure_channel(serve_8b) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            decodes = [asyncio.create_task(generate(stub, token_request(random_ids(300, i), 200)))
                       for i in range(16)]
            await asyncio.sleep(1.0)
            longs = [await generate(stub, token_request(random_ids(n, n + 1), 8)) for n in (24576, 49152)]
            for tokens, finish in [*longs, *(await asyncio.gather(*decodes))]:
                assert finish == pb.FINISH_REASON_LENGTH
            assert [len(t) for t, _ in longs] == [8, 8]
    asyncio.run(scenario())


def test_requests_longer_than_the_context_are_refused_and_the_server_keeps_serving(serve_8b):
    async def scenario():
        async with grpc.aio.insecure_channel(serve_8b) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, token_request(random_ids(MAX_MODEL_LEN_8B - 4, 3), 8))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            tokens, _ = await generate(stub, token_request(random_ids(100, 4), 8))
            assert len(tokens) == 8
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ a device fault

def test_gpu_worker_device_fault_hands_back_and_the_other_worker_finishes_token_for_token(tmp_path):
    save_tiny_llama(tmp_path)
    model = str(tmp_path)
    prompts = [random_ids(int(n), i, vocab=512) for i, n in enumerate(torch.randint(8, 200, (12,)).tolist())]
    reference = LLMEngine(EngineConfig(model=model, device="cuda", dtype="float32", num_blocks=512))
    for i, p in enumerate(prompts):
        reference.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    expected = {str(i): [] for i in range(len(prompts))}
    while reference.has_unfinished():
        for out in reference.step():
            expected[out.request_id] += out.new_token_ids
    del reference
    torch.cuda.empty_cache()

    flags = ["--model", model, "--device", "cuda", "--dtype", "float32", "--num-blocks", "512",
             "--metrics-port", "0"]
    with WorkerProcess([*flags, "--worker-id", "healthy"]) as healthy, \
            WorkerProcess([*flags, "--worker-id", "faulty"], env={faults.INJECT_ENV: "device@20"}) as faulty:
        async def scenario():
            router = Router(RouterConfig(workers=[healthy.address, faulty.address], host="127.0.0.1", port=0,
                                         fleet=FleetConfig(backoff_initial_s=0.2), shutdown_grace_s=1.0))
            await router.start()
            try:
                await router.fleet.wait_for(lambda f: len(f.accepting()) == 2, 60)
                async with grpc.aio.insecure_channel(router.address) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    results = await asyncio.gather(*(generate(stub, token_request(p, 60)) for p in prompts))
                assert {str(i): tokens for i, (tokens, _) in enumerate(results)} == expected
                assert router.counters.redispatches > 0, router.counters
            finally:
                await router.stop()
        asyncio.run(scenario())
        assert faulty.process.wait(timeout=60) == faults.EXIT_CODE
        assert "device fault in step 20" in faulty.log()
