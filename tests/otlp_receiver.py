"""A real OTLP/gRPC trace receiver for tests: what a collector would get, kept in memory.

It serves `opentelemetry.proto.collector.trace.v1.TraceService/Export` on a loopback port with
the `opentelemetry-proto` package's generated classes, so a process under test exports with its
unmodified OTLP exporter (`OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint`).

    with OtlpReceiver() as receiver:
        ...  # start the process with OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint
        span = receiver.wait_for(lambda s: s.name.startswith("text_completion"), timeout_s=10)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def attribute_value(value: AnyValue) -> object:
    """An OTLP attribute value as the Python value it was recorded from."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(attribute_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


def attributes(pairs: list[KeyValue]) -> dict[str, object]:
    return {kv.key: attribute_value(kv.value) for kv in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, with the attributes of the resource (the process) that sent it."""
    span: Span
    resource: dict[str, object]

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attributes(self) -> dict[str, object]:
        return attributes(self.span.attributes)

    @property
    def events(self) -> list[tuple[str, dict[str, object]]]:
        return [(event.name, attributes(event.attributes)) for event in self.span.events]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context) -> \
            trace_service_pb2.ExportTraceServiceResponse:
        received = [ReceivedSpan(span, attributes(rs.resource.attributes))
                    for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
        with self.receiver.arrived:
            self.receiver.spans.extend(received)
            self.receiver.arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Collects exported spans in `spans`; a context manager that starts and stops the server."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.arrived = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    def wait_for(self, match: Callable[[ReceivedSpan], bool], timeout_s: float) -> ReceivedSpan:
        """The first span received that matches, waiting up to `timeout_s` for it to arrive."""
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while True:
                found = next((s for s in self.spans if match(s)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching span within {timeout_s} s; received: "
                                       f"{[s.name for s in self.spans]}")
                self.arrived.wait(left)
