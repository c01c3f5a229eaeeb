"""Multi-LoRA through the router (router.lora_adapters, the balancer's adapter placement, the
worker's adapter RPCs), with real worker processes and adapters made here with peft.

Greedy outputs are compared with transformers + peft on SmolLM2.
"""

from __future__ import annotations

import asyncio
import copy

import grpc
import openai
import pytest
import torch

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from helpers import overflowing_adapter
from router_harness import running_router
from worker_process import WorkerProcess

pytestmark = pytest.mark.slow

PROMPTS = ["The lighthouse keeper wrote that", "Once upon a time,", "def fibonacci(n):"]
ADAPTERS = {"sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
            "poet": dict(r=16, lora_alpha=16, use_rslora=True,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"])}
MAX_TOKENS = 10
LONG = 40       # the request a killed worker leaves half done


@pytest.fixture(scope="module")
def adapters(hf_smollm, tmp_path_factory):
    """name -> (PEFT directory, the peft model on transformers' SmolLM2)."""
    from peft import LoraConfig, get_peft_model
    made = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(hf_smollm), LoraConfig(init_lora_weights=False, **config))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.mul_(0.3)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        made[name] = (str(path), model.eval())
    return made


@pytest.fixture(scope="module")
def expected(adapters, hf_smollm, smollm_tokenizer):
    """(adapter or None, prompt) -> peft's first LONG greedy tokens (fewer when it drew EOS:
    the requests here ignore it, and go on)."""
    out = {}
    for name, model in [(None, hf_smollm)] + [(n, m) for n, (_, m) in adapters.items()]:
        for prompt in PROMPTS:
            ids = smollm_tokenizer.encode(prompt)
            with torch.no_grad():
                tokens = model.generate(torch.tensor([ids]), max_new_tokens=LONG, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            out[name, prompt] = tokens[0, len(ids):].tolist()
    return out


@pytest.fixture(scope="module")
def workers(adapters):
    """Two LoRA workers; only "holder" loads the "sql" adapter at start."""
    common = ["--model", "default", "--device", "cpu", "--dtype", "float32", "--enable-lora",
              "--max-loras", "2", "--metrics-port", "0"]
    started = {"holder": WorkerProcess(["--worker-id", "holder", *common, "--lora-modules",
                                        f"sql={adapters['sql'][0]}"], env={"OMP_NUM_THREADS": "1"}),
               "spare": WorkerProcess(["--worker-id", "spare", *common], env={"OMP_NUM_THREADS": "1"})}
    for w in started.values():
        w.start()
    for w in started.values():
        w.wait_ready()
    yield started
    for w in started.values():
        w.__exit__()


def greedy(prompt: str, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, params=pb.SamplingParameters(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), **fields)


async def tokens(stub, request: pb.GenerateRequest) -> list[int]:
    return [t for r in [r async for r in stub.Generate(request)] for c in r.choices for t in c.token_ids]


def test_adapter_requests_go_to_the_worker_holding_it_and_match_peft(workers, expected):
    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            got = await asyncio.gather(*(tokens(stub, greedy(p, lora_name="sql")) for p in PROMPTS),
                                       *(tokens(stub, greedy(p, model="sql")) for p in PROMPTS),
                                       *(tokens(stub, greedy(p)) for p in PROMPTS))
            assert got == [expected["sql", p][:MAX_TOKENS] for p in PROMPTS] * 2 + \
                [expected[None, p][:MAX_TOKENS] for p in PROMPTS]
            assert not router.fleet.workers["spare"].holds_lora("sql")     # never needed elsewhere
    asyncio.run(scenario())


def test_model_info_lists_adapters_with_their_base(workers, adapters):
    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            info = await generation_pb2_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest())
            assert [(a.name, a.parent, a.path, a.workers) for a in info.lora_adapters] == \
                [("sql", info.model_names[0], adapters["sql"][0], 1)]
    asyncio.run(scenario())


def test_run_time_load_serves_over_http_then_unload_makes_it_unknown(workers, adapters, expected):
    async def scenario():
        async with running_router(workers["holder"], workers["spare"], http_port=0) as router:
            client = openai.AsyncOpenAI(base_url=f"{router.http_address}/v1", api_key="none", max_retries=0)
            load = await client.post("/load_lora_adapter", cast_to=str, body={
                "lora_name": "poet", "lora_path": adapters["poet"][0]})
            assert "poet" in load
            models = {m.id: m for m in (await client.models.list()).data}
            base = router.fleet.model.name
            assert (models["poet"].model_extra["parent"], models["poet"].model_extra["root"]) == \
                (base, adapters["poet"][0])
            completions = await asyncio.gather(*(client.completions.create(
                model="poet", prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
                for p in PROMPTS))
            texts = [c.choices[0].text for c in completions]
            tokenizer = router.fleet.model.tokenizer.hf
            assert texts == [tokenizer.decode(expected["poet", p][:MAX_TOKENS], skip_special_tokens=True)
                             for p in PROMPTS]
            await client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "poet"})
            await asyncio.sleep(0.5)     # a load report from each worker
            with pytest.raises(openai.NotFoundError, match="poet"):
                await client.completions.create(model="poet", prompt=PROMPTS[0], max_tokens=2)
            assert all(not w.holds_lora("poet") for w in router.fleet.workers.values())
    asyncio.run(scenario())


def test_unload_waits_for_the_adapters_running_requests(workers, adapters, expected):
    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="verse", lora_path=adapters["poet"][0]))
            request = pb.GenerateRequest(text=PROMPTS[0], lora_name="verse", params=pb.SamplingParameters(
                temperature=0.0, max_tokens=LONG, ignore_eos=True))
            finished_at = {}

            async def stream() -> list[int]:
                got = await tokens(stub, request)
                finished_at["stream"] = asyncio.get_running_loop().time()
                return got
            running = asyncio.create_task(stream())
            while not any(a.num_requests for w in router.fleet.workers.values()
                          for a in w.lora_adapters().values() if a.name == "verse"):
                await asyncio.sleep(0.05)
            await stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="verse"))
            unloaded_at = asyncio.get_running_loop().time()
            got = await running
            assert len(got) == LONG and got[:len(expected["poet", PROMPTS[0]])] == expected["poet", PROMPTS[0]]
            # Had it not waited, it would have returned while most of the 40 tokens were to come;
            # the slack is the two answers' travel through the router, in either order.
            assert unloaded_at >= finished_at["stream"] - 0.2
    asyncio.run(scenario())


def test_an_unload_its_caller_gives_up_on_leaves_the_adapter_serving(workers, adapters, expected):
    """The worker's unload waits for the adapter's running request; a caller whose deadline
    passes meanwhile cancels it, and the adapter takes new requests again."""
    from common.pb import worker_pb2, worker_pb2_grpc

    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="kept", lora_path=adapters["poet"][0]))
            long = pb.GenerateRequest(text=PROMPTS[0], lora_name="kept", params=pb.SamplingParameters(
                temperature=0.0, max_tokens=LONG, ignore_eos=True))
            running = asyncio.create_task(tokens(stub, long))
            while not (busy := [w for w in router.fleet.workers.values()
                                if any(a.num_requests for a in w.lora_adapters().values() if a.name == "kept")]):
                await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(busy[0].address) as worker_channel:
                with pytest.raises(grpc.aio.AioRpcError) as gave_up:
                    await worker_pb2_grpc.WorkerStub(worker_channel).UnloadLoRAAdapter(
                        worker_pb2.UnloadLoRAAdapterRequest(lora_name="kept"), timeout=0.3)
            assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert len(await running) == LONG
            again = await tokens(stub, greedy(PROMPTS[0], lora_name="kept"))      # the adapter's, as peft's
            assert len(again) == MAX_TOKENS and again == expected["poet", PROMPTS[0]][:MAX_TOKENS]
    asyncio.run(scenario())


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_a_request_for_an_adapter_being_unloaded_is_not_found_naming_it(workers, adapters, api):
    """While an unload waits for the adapter's running request, new requests under it are
    refused (by the router, or by the worker for one already on its way): the client gets what
    an unknown adapter gets, NOT_FOUND (HTTP 404) naming it, not a complaint about its own
    request."""
    name = f"going-{api}"

    async def refusal(stub, client) -> tuple[int | grpc.StatusCode, str]:
        """Sends one-token requests under the adapter until one is refused (those the worker
        takes before the unload reaches it run)."""
        while True:
            try:
                if api == "grpc":
                    await tokens(stub, pb.GenerateRequest(text=PROMPTS[1], lora_name=name,
                                                          params=pb.SamplingParameters(max_tokens=1)))
                else:
                    await client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=1)
            except grpc.aio.AioRpcError as error:
                return error.code(), error.details()
            except openai.APIStatusError as error:
                return error.status_code, error.message

    async def scenario():
        async with running_router(workers["holder"], workers["spare"], http_port=0) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            client = openai.AsyncOpenAI(base_url=f"{router.http_address}/v1", api_key="none", max_retries=0)
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=adapters["poet"][0]))
            running = asyncio.create_task(tokens(stub, pb.GenerateRequest(
                text=PROMPTS[0], lora_name=name, params=pb.SamplingParameters(max_tokens=3 * LONG, ignore_eos=True))))
            while not any(a.num_requests for w in router.fleet.workers.values()
                          for a in w.lora_adapters().values() if a.name == name):
                await asyncio.sleep(0.05)
            unload = asyncio.ensure_future(stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=name)))
            refused = await refusal(stub, client)
            # Refused mid-unload, not once the adapter was gone.
            assert not running.done() and not unload.done()
            await unload
            assert len(await running) == 3 * LONG
            return refused
    code, message = asyncio.run(scenario())
    assert code == (grpc.StatusCode.NOT_FOUND if api == "grpc" else 404)
    assert f"LoRA adapter {name!r} is being unloaded" in message


def test_an_adapter_unloaded_while_it_serves_can_be_loaded_again_from_another_path_at_once(
        workers, adapters, expected):
    """Unload, then load under the same name: how a client updates an adapter. The unload
    returns once the running request has finished; the workers' load reports taken before then
    still listed the adapter, and must not make the new load a clash with the old path."""
    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="updated", lora_path=adapters["poet"][0]))
            running = asyncio.create_task(tokens(stub, pb.GenerateRequest(
                text=PROMPTS[0], lora_name="updated", params=pb.SamplingParameters(max_tokens=LONG, ignore_eos=True))))
            while not any(a.num_requests for w in router.fleet.workers.values()
                          for a in w.lora_adapters().values() if a.name == "updated"):
                await asyncio.sleep(0.05)
            await stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="updated"))
            assert len(await running) == LONG
            try:
                loaded = await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
                    lora_name="updated", lora_path=adapters["sql"][0]))
                assert loaded.adapter.path == adapters["sql"][0]
                info = await stub.ModelInfo(pb.ModelInfoRequest())
                assert [a.path for a in info.lora_adapters if a.name == "updated"] == [adapters["sql"][0]]
                return await tokens(stub, greedy(PROMPTS[1], lora_name="updated"))
            finally:
                await stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="updated"))
    assert asyncio.run(scenario()) == expected["sql", PROMPTS[1]][:MAX_TOKENS]


def test_a_request_for_an_adapter_its_worker_dropped_from_host_memory_loads_it_again(adapters, expected):
    """A worker holding one adapter in host memory (--max-cpu-loras 1) drops the first when the
    second loads; the router, which still knows the first one's path, has it loaded again for
    the next request under it, even when it still believed the worker held it."""
    worker = WorkerProcess(["--worker-id", "small", "--model", "default", "--device", "cpu", "--dtype", "float32",
                            "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1"], env={"OMP_NUM_THREADS": "1"})
    worker.start()
    worker.wait_ready()

    async def scenario():
        async with running_router(worker) as router, grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for name in ("first", "second"):
                path = adapters["poet" if name == "first" else "sql"][0]
                await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
            first = await tokens(stub, greedy(PROMPTS[0], lora_name="first"))
            second = await tokens(stub, greedy(PROMPTS[0], lora_name="second"))
            return first, second
    try:
        first, second = asyncio.run(scenario())
    finally:
        worker.__exit__()
    assert first == expected["poet", PROMPTS[0]][:MAX_TOKENS]
    assert second == expected["sql", PROMPTS[0]][:MAX_TOKENS]


def test_an_adapter_that_makes_nan_logits_fails_its_request_as_internal_and_the_worker_serves_on(
        workers, smollm_weights, expected, tmp_path):
    """An adapter whose finite weights overflow makes its requests' logits NaN on the worker:
    the worker is at fault, not the request, so the client gets INTERNAL (HTTP 500) saying
    why, and the worker goes on serving (the engine-level test checks its batch is spared)."""
    path = overflowing_adapter(tmp_path, smollm_weights[0])

    async def scenario():
        async with running_router(workers["holder"], workers["spare"], http_port=0) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            client = openai.AsyncOpenAI(base_url=f"{router.http_address}/v1", api_key="none", max_retries=0)
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="overflow", lora_path=path))
            try:
                with pytest.raises(grpc.aio.AioRpcError) as over_grpc:
                    await tokens(stub, greedy(PROMPTS[0], lora_name="overflow"))
                with pytest.raises(openai.InternalServerError) as over_http:
                    await client.completions.create(model="overflow", prompt=PROMPTS[0], max_tokens=2)
                after = await asyncio.gather(*(tokens(stub, greedy(PROMPTS[0], lora_name=name))
                                               for name in ("sql", "")))
            finally:
                await stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="overflow"))
            return over_grpc.value, over_http.value, after
    over_grpc, over_http, after = asyncio.run(scenario())
    why = "the model computed NaN logits under LoRA adapter 'overflow' at output token 0"
    assert over_grpc.code() == grpc.StatusCode.INTERNAL and why in over_grpc.details()
    assert over_http.status_code == 500 and why in over_http.message
    assert after == [expected["sql", PROMPTS[0]][:MAX_TOKENS], expected[None, PROMPTS[0]][:MAX_TOKENS]]


def test_loading_a_broken_adapter_is_invalid_argument_naming_the_file(workers, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")

    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="bad", lora_path=str(tmp_path)))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "adapter_config.json: unreadable" in error.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await tokens(stub, greedy(PROMPTS[0], lora_name="bad"))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            assert await tokens(stub, greedy(PROMPTS[0])) != []      # and it serves on
    asyncio.run(scenario())


def test_loading_under_the_base_models_name_or_a_loaded_adapters_name_is_refused(workers, adapters):
    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            info = await stub.ModelInfo(pb.ModelInfoRequest())
            base, (loaded, *_) = info.model_names[0], info.lora_adapters
            other = next(path for path, _ in adapters.values() if path != loaded.path)
            refusals = []
            for name, path in ((base, other), (loaded.name, other)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
                refusals.append((refused.value.code(), refused.value.details()))
            return base, loaded, refusals
    base, loaded, refusals = asyncio.run(scenario())
    assert refusals[0] == (grpc.StatusCode.INVALID_ARGUMENT,
                           f"lora_name {base!r} is the base model's name: an adapter needs a name of its own")
    assert refusals[1][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert refusals[1][1].startswith(f"LoRA adapter {loaded.name!r} is already loaded from {loaded.path!r}")


def test_loading_a_loaded_adapter_again_by_another_spelling_of_its_path_is_accepted(workers, adapters):
    async def scenario():
        async with running_router(workers["holder"], workers["spare"]) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            path = adapters["poet"][0]
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="respelled", lora_path=path))
            try:
                head, tail = path.rsplit("/", 1)
                again = await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
                    lora_name="respelled", lora_path=f"{head}/./{tail}/"))
            finally:
                await stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="respelled"))
            return again.adapter.name
    assert asyncio.run(scenario()) == "respelled"


def test_an_adapter_request_whose_worker_dies_finishes_on_a_worker_that_loads_it(adapters, expected):
    common = ["--model", "default", "--device", "cpu", "--dtype", "float32", "--enable-lora", "--async-scheduling"]
    victim = WorkerProcess(["--worker-id", "victim", *common, "--lora-modules", f"sql={adapters['sql'][0]}"],
                           env={"OMP_NUM_THREADS": "1"})
    other = WorkerProcess(["--worker-id", "other", *common], env={"OMP_NUM_THREADS": "1"})
    victim.start(), other.start()
    victim.wait_ready(), other.wait_ready()

    async def scenario():
        async with running_router(victim, other) as router, grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(text=PROMPTS[1], lora_name="sql", params=pb.SamplingParameters(
                temperature=0.0, max_tokens=LONG, ignore_eos=True))
            got: list[int] = []
            async for response in stub.Generate(request):
                for choice in response.choices:
                    got += choice.token_ids
                if len(got) >= 3 and victim.process.poll() is None:
                    victim.process.kill()
            assert router.counters.redispatches == 1
            assert router.fleet.workers["other"].holds_lora("sql")
            return got
    try:
        got = asyncio.run(scenario())
    finally:
        victim.__exit__(), other.__exit__()
    assert len(got) == LONG and got[:len(expected["sql", PROMPTS[1]])] == expected["sql", PROMPTS[1]]
