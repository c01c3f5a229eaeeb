"""The router's traces and metrics, with a real worker process on loopback.

One traced worker (`pagedserve serve --role worker`, exporting to a real OTLP receiver) serves the module.
The trace tests run the router as `pagedserve serve --role router`, a process of its own that
exports to the same receiver, so the trace context crosses two process boundaries: client ->
router (gRPC metadata or HTTP headers) and router -> worker (the Submit). The metrics test runs a
router in this process and reads its /metrics over the HTTP API.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_receiver import OtlpReceiver, ReceivedSpan
from prometheus_client.parser import text_string_to_metric_families
from worker_process import REPO, WorkerProcess, free_port

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from router.fleet import FleetConfig
from router.server import Router, RouterConfig

pytestmark = pytest.mark.slow

TIMEOUT_S = 60            # bounds a router's start (it imports torch) and a stream
SPAN_TIMEOUT_S = 10       # spans are exported every 100 ms
# Only these OTEL_* variables configure the processes under test, whatever the runner has set.
OTEL_CLEARED = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME",
                "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_EXPORTER_OTLP_PROTOCOL")
# Reconnect fast while the router process starts: gRPC's default backoff grows to seconds.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 500)]


def otel_env(receiver: OtlpReceiver) -> dict[str, str | None]:
    """Exports spans to `receiver` every 100 ms; None removes a variable."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_BSP_SCHEDULE_DELAY": "100", **dict.fromkeys(OTEL_CLEARED)}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def worker(receiver) -> Iterator[WorkerProcess]:
    with WorkerProcess(["--metrics-port", "0"], env=otel_env(receiver)) as worker:
        yield worker


class RouterProcess:
    """`pagedserve serve --role router` in front of `worker_address`, tracing to `receiver`;
    entered once it serves (gRPC health SERVING: it listens and the worker joined)."""

    def __init__(self, worker_address: str, receiver: OtlpReceiver, args: tuple[str, ...] = ()):
        port, self.http_port = free_port(), free_port()
        self.address = f"127.0.0.1:{port}"
        self._command = [sys.executable, "-m", "launcher.cli", "serve", "--role", "router",
                         "--host", "127.0.0.1", "--port", str(port), "--http-port", str(self.http_port),
                         "--metrics-port", "0", "--workers", worker_address, *args]
        env = {**os.environ, **otel_env(receiver)}
        self._env = {name: value for name, value in env.items() if value is not None}
        self._log = tempfile.TemporaryFile(mode="w+")

    def __enter__(self) -> RouterProcess:
        self.process = subprocess.Popen(self._command, cwd=REPO, env=self._env, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        try:
            self._wait_serving()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)     # stops gracefully and flushes its spans
        try:
            self.process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()

    def log_text(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def _wait_serving(self) -> None:
        """Follows the router's health with Watch (no polling) until SERVING."""
        with grpc.insecure_channel(self.address, options=FAST_RECONNECT) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S, wait_for_ready=True)
            try:
                for reply in watch:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as error:
                self._log.seek(0)
                raise RuntimeError(f"router not serving ({error.code().name}):\n"
                                   f"{self._log.read()[-3000:]}") from None
            finally:
                watch.cancel()


@pytest.fixture(scope="module")
def traced_router(worker, receiver) -> Iterator[RouterProcess]:
    with RouterProcess(worker.address, receiver) as router:
        yield router


def client_context() -> tuple[str, str, str]:
    """A client's trace id, span id, and the `traceparent` that carries them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def span_of(receiver: OtlpReceiver, trace_id: str, service: str, name: str) -> ReceivedSpan:
    """The span of `service` in trace `trace_id` whose name starts with `name`."""
    return receiver.wait_for(lambda s: s.span.trace_id.hex() == trace_id and s.name.startswith(name)
                             and s.resource["service.name"] == service, SPAN_TIMEOUT_S)


def test_a_request_is_one_trace_across_client_router_and_worker(traced_router, receiver):
    prompt = list(range(1000, 1020))
    client_trace, client_span, traceparent = client_context()
    params = pb.SamplingParameters(max_tokens=6, ignore_eos=True, temperature=0.5, top_p=0.9, seed=3)
    request = pb.GenerateRequest(request_id="traced-1", token_ids=pb.TokenIds(ids=prompt), params=params)
    with grpc.insecure_channel(traced_router.address) as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(
            request, metadata=[("traceparent", traceparent)], timeout=TIMEOUT_S))
    assert sum(len(c.token_ids) for r in responses for c in r.choices) == 6

    served = span_of(receiver, client_trace, "pagedserve-router", "text_completion")
    steps = [span_of(receiver, client_trace, "pagedserve-router", name)
             for name in ("validate_and_tokenize", "admission", "dispatch")]
    on_worker = span_of(receiver, client_trace, "pagedserve-worker", "text_completion")

    # client -> router -> (its steps, the dispatch) -> the worker's span for the dispatch
    assert served.span.kind == Span.SPAN_KIND_SERVER
    assert served.span.parent_span_id.hex() == client_span
    assert [s.span.parent_span_id for s in steps] == [served.span.span_id] * 3
    dispatch = steps[2]
    assert on_worker.span.parent_span_id == dispatch.span.span_id
    assert on_worker.attributes["pagedserve.request_id"] == \
        dispatch.attributes["pagedserve.dispatch_id"]

    a = served.attributes
    duration_s = (served.span.end_time_unix_nano - served.span.start_time_unix_nano) / 1e9
    assert served.name == f"text_completion {on_worker.attributes['gen_ai.request.model']}"
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"]) == (
        "text_completion", on_worker.attributes["gen_ai.request.model"])
    assert a["gen_ai.response.id"] == a["pagedserve.request_id"] == "traced-1"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.seed"]) == (6, 3)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (len(prompt), 6)
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 < a["gen_ai.response.time_to_first_chunk"] < duration_s
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"]) == ("grpc", "pagedserve.v1.Generation", "Generate")


def test_a_request_whose_client_leaves_while_it_is_queued_is_logged_and_its_admission_span_not_failed(
        worker, receiver):
    with RouterProcess(worker.address, receiver, ("--max-concurrent-requests", "1")) as router, \
            grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        running = stub.Generate(pb.GenerateRequest(
            request_id="long-1", token_ids=pb.TokenIds(ids=[5, 6, 7]),
            params=pb.SamplingParameters(max_tokens=2000, ignore_eos=True)), timeout=TIMEOUT_S)
        next(running)       # admitted and streaming: the next request waits in the queue
        client_trace, _, traceparent = client_context()
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(pb.GenerateRequest(request_id="queued-1", token_ids=pb.TokenIds(ids=[1, 2]),
                                                  params=pb.SamplingParameters(max_tokens=2)),
                               metadata=[("traceparent", traceparent)], timeout=1.0))
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        running.cancel()
        served = span_of(receiver, client_trace, "pagedserve-router", "text_completion")
        admission = span_of(receiver, client_trace, "pagedserve-router", "admission")
        assert served.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
        assert admission.span.status.code != admission.span.status.STATUS_CODE_ERROR
        lines = [line for line in router.log_text().splitlines() if "queued-1" in line]
        assert any("cancelled before admission" in line for line in lines), lines


def test_a_refused_requests_span_names_the_request_the_provider_and_the_error(traced_router, receiver):
    client_trace, _, traceparent = client_context()
    request = pb.GenerateRequest(request_id="refused-1", token_ids=pb.TokenIds(ids=[1, 2]),
                                 params=pb.SamplingParameters(temperature=-1.0))
    with grpc.insecure_channel(traced_router.address) as channel, pytest.raises(grpc.RpcError) as error:
        list(generation_pb2_grpc.GenerationStub(channel).Generate(
            request, metadata=[("traceparent", traceparent)], timeout=TIMEOUT_S))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    a = span_of(receiver, client_trace, "pagedserve-router", "text_completion").attributes
    assert (a["pagedserve.request_id"], a["gen_ai.provider.name"], a["error.type"]) == \
        ("refused-1", "pagedserve", "INVALID_ARGUMENT")


def test_an_http_chat_request_continues_the_callers_trace(traced_router, receiver):
    client_trace, client_span, traceparent = client_context()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}

    async def chat() -> dict:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{traced_router.http_port}") as http, \
                http.post("/v1/chat/completions", json=body, headers={"traceparent": traceparent}) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.json()
    usage = asyncio.run(asyncio.wait_for(chat(), TIMEOUT_S))["usage"]

    served = span_of(receiver, client_trace, "pagedserve-router", "chat")
    dispatch = span_of(receiver, client_trace, "pagedserve-router", "dispatch")
    on_worker = span_of(receiver, client_trace, "pagedserve-worker", "text_completion")
    assert served.span.parent_span_id.hex() == client_span
    assert on_worker.span.parent_span_id == dispatch.span.span_id
    a = served.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert (a["http.request.method"], a["http.route"], a["url.scheme"]) == ("POST", "/v1/chat/completions", "http")
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])


async def grpc_tokens(stub: generation_pb2_grpc.GenerationStub, prompt: list[int]) -> int:
    """Tokens received for `prompt`, 5 of them unless something is wrong."""
    params = pb.SamplingParameters(max_tokens=5, ignore_eos=True, temperature=0.0)
    call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=params), timeout=TIMEOUT_S)
    return sum([len(choice.token_ids) async for response in call for choice in response.choices])


async def http_tokens(http: aiohttp.ClientSession, prompt: list[int]) -> int:
    """The same over the HTTP API: the completion tokens its usage reports."""
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    async with http.post("/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return (await reply.json())["usage"]["completion_tokens"]


def test_metrics_count_exactly_what_clients_received(worker):
    """3 requests of 5 tokens (two over gRPC, one over HTTP) and one refused: /metrics of the
    router's HTTP API says so, to the token, labelled with the model the worker reported."""
    prompts = [list(range(100, 107)), list(range(200, 211)), list(range(300, 313))]

    async def scenario() -> tuple[str, str]:
        router = Router(RouterConfig(workers=[worker.address], host="127.0.0.1", port=0, http_port=0,
                                     fleet=FleetConfig(backoff_initial_s=0.2), shutdown_grace_s=1.0))
        await router.start()
        try:
            await router.fleet.wait_for(lambda fleet: bool(fleet.accepting()), TIMEOUT_S)
            async with grpc.aio.insecure_channel(router.address) as channel, \
                    aiohttp.ClientSession(router.http_address) as http:
                stub = generation_pb2_grpc.GenerationStub(channel)
                received = await asyncio.wait_for(asyncio.gather(
                    grpc_tokens(stub, prompts[0]), grpc_tokens(stub, prompts[1]), http_tokens(http, prompts[2])),
                    TIMEOUT_S)
                assert received == [5, 5, 5]
                async with http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": "five"}) as reply:
                    assert reply.status == 400
                async with http.get("/metrics") as reply:
                    assert reply.status == 200
                    return await reply.text(), router.fleet.model.name
        finally:
            await router.stop()

    text, model_name = asyncio.run(scenario())
    samples = router_samples(text, model_name)

    def value(name: str, **labels: str) -> float:
        return samples[name, tuple(sorted(labels.items()))]

    assert value("generation_tokens_total") == 15
    assert value("prompt_tokens_total") == sum(map(len, prompts))
    finished = {labels: v for (name, labels), v in samples.items() if name == "requests_finished_total"}
    assert finished == {**dict.fromkeys(finished, 0), (("reason", "length"),): 3}
    assert value("time_to_first_token_seconds_count") == 3
    assert value("e2e_request_latency_seconds_count") == 3
    assert value("request_queue_time_seconds_count") == 3
    assert value("requests_rejected_total", reason="invalid") == 1
    assert (value("requests_running"), value("requests_waiting"), value("workers_ready")) == (0, 0, 1)


def test_requests_refused_before_the_first_worker_are_counted_once_it_names_the_model(worker):
    """With no --served-model-name the series need the worker's model name for their label."""
    async def scenario() -> tuple[str, str, str]:
        router = Router(RouterConfig(workers=[], host="127.0.0.1", port=0, http_port=0,
                                     fleet=FleetConfig(backoff_initial_s=0.2), shutdown_grace_s=1.0))
        await router.start()
        try:
            async with aiohttp.ClientSession(router.http_address) as http:
                async with http.post("/v1/completions", json={"prompt": [1, 2]}) as reply:
                    assert reply.status == 503
                async with http.get("/metrics") as reply:
                    before = await reply.text()
                router.fleet.update(added={worker.address}, removed=set())  # as discovery does
                await router.fleet.wait_for(lambda fleet: bool(fleet.accepting()), TIMEOUT_S)
                async with http.get("/metrics") as reply:
                    return before, await reply.text(), router.fleet.model.name
        finally:
            await router.stop()

    before, after, model_name = asyncio.run(scenario())
    assert "pagedserve_router" not in before
    assert router_samples(after, model_name)["requests_rejected_total", (("reason", "unavailable"),)] == 1


def router_samples(text: str, model_name: str) -> dict[tuple[str, tuple], float]:
    """The router's samples in a /metrics text, by name without the `pagedserve_router_` prefix
    and labels other than model_name, which must be `model_name` on every one."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == model_name, sample
            name = sample.name.removeprefix("pagedserve_router_")
            samples[name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples
