"""Traces: a worker process exports its request spans over OTLP/gRPC to a real receiver,
parented by the trace context a router put in the Submit, with the GenAI attributes."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_receiver import OtlpReceiver, ReceivedSpan
from worker_process import WorkerProcess, run_requests, submit

from common import tracing
from common.pb import worker_pb2

PROMPT = list(range(1000, 1040))       # 3 blocks: more than one prefill chunk at a 16-token budget
SPAN_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def traced_worker():
    """A worker exporting to a receiver every 100 ms, with a small step budget so that a prompt
    is prefilled in several chunks."""
    with OtlpReceiver() as receiver:
        # Whatever OTEL_* the test runner has must not configure the worker.
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": None, "OTEL_TRACES_EXPORTER": None,
               "OTEL_SDK_DISABLED": None, "OTEL_SERVICE_NAME": None, "OTEL_RESOURCE_ATTRIBUTES": None,
               "OTEL_TRACES_SAMPLER": None, "OTEL_EXPORTER_OTLP_PROTOCOL": None}
        with WorkerProcess(["--metrics-port", "0", "--max-num-batched-tokens", "16"], env=env) as worker:
            yield worker, receiver


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _span_of(receiver: OtlpReceiver, trace_id: str) -> ReceivedSpan:
    return receiver.wait_for(lambda s: s.span.trace_id.hex() == trace_id, SPAN_TIMEOUT_S)


def test_request_span_joins_the_routers_trace(traced_worker):
    worker, receiver = traced_worker
    traceparent, trace_id, parent_id = _traceparent()
    results = asyncio.run(run_requests(worker.address, [
        submit("r1", PROMPT, 4, {"traceparent": traceparent}, temperature=0.5, top_p=0.9, seed=7)]))
    assert len(results["r1"].tokens) == 4

    span = _span_of(receiver, trace_id)
    assert span.span.parent_span_id.hex() == parent_id
    assert span.span.kind == Span.SPAN_KIND_SERVER
    assert span.resource["service.name"] == "pagedserve-worker"
    a = span.attributes
    assert span.name == f"text_completion {a['gen_ai.request.model']}"
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.response.id"] == a["pagedserve.request_id"] == "r1"
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.seed"] == 7
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    duration_s = (span.span.end_time_unix_nano - span.span.start_time_unix_nano) / 1e9
    assert 0 < a["gen_ai.response.time_to_first_chunk"] < duration_s

    events = span.events
    names = [name for name, _ in events]
    assert names[0] == "admitted" and "first_token" in names
    chunks = [attrs for name, attrs in events if name == "prefill_chunk"]
    assert [c["pagedserve.chunk.start"] for c in chunks] == [0, 16, 32]
    assert sum(c["pagedserve.chunk.tokens"] for c in chunks) == len(PROMPT)
    times = [e.time_unix_nano for e in span.span.events]
    assert times == sorted(times)


def test_preemption_and_abort_show_in_the_span(traced_worker):
    """A request preempted by the router and later aborted: its span says both, and ends."""
    worker, receiver = traced_worker
    traceparent, trace_id, _ = _traceparent()
    preempted = False

    def preempt_then_abort(message: worker_pb2.WorkerMessage) -> list[worker_pb2.RouterMessage]:
        """Preempts at the first token; aborts once the request is back in the batch."""
        nonlocal preempted
        if message.WhichOneof("kind") == "step" and not preempted:
            preempted = True
            return [worker_pb2.RouterMessage(preempt=worker_pb2.Preempt(
                request_id="r2", mode=worker_pb2.PREEMPTION_MODE_SWAP))]
        if message.WhichOneof("kind") == "event" and message.event.kind == worker_pb2.EVENT_KIND_RESUMED:
            return [worker_pb2.RouterMessage(abort=worker_pb2.Abort(request_ids=["r2"]))]
        return []

    results = asyncio.run(run_requests(worker.address, [submit("r2", PROMPT, 200, {"traceparent": traceparent})],
                                       on_message=preempt_then_abort))
    assert worker_pb2.EVENT_KIND_PREEMPTED in results["r2"].events

    span = _span_of(receiver, trace_id)
    names = [name for name, _ in span.events]
    modes = [attrs["pagedserve.preemption.mode"] for name, attrs in span.events if name == "preempted"]
    assert modes and modes[0] in ("swap", "recompute")
    assert names.index("preempted") < names.index("resumed")
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert 0 < span.attributes["gen_ai.usage.output_tokens"] < 200


def test_tracing_is_off_unless_configured(monkeypatch):
    """Without an exporter or endpoint, or with the SDK disabled, nothing is set up and the
    helpers cost nothing: no span, no context."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.setup_tracing("test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.setup_tracing("test")
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.setup_tracing("test")
    assert not tracing.enabled()
    assert tracing.start_span("x") is None
    assert tracing.inject() == {}
    assert tracing.extract({"traceparent": _traceparent()[0]}) is None


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"])
def test_an_otlp_protocol_other_than_grpc_is_refused_naming_the_variable_set(monkeypatch, variable):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "http/protobuf")
    with pytest.raises(ValueError, match=f"^{variable}='http/protobuf' is not supported"):
        tracing._exporter("otlp")
