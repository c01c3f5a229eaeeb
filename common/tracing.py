"""OpenTelemetry tracing for router and worker, configured only by the standard OTEL_* variables.

Tracing is on when an exporter is asked for: `OTEL_TRACES_EXPORTER` (otlp, console; none turns it
off) or, with that unset, an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`). `OTEL_SDK_DISABLED=true` always turns it off. Everything else
(service name and resource, sampler, batch processor schedule, exporter headers, TLS, timeouts)
is read by the SDK from its own variables.

Off, every helper returns at once (`start_span` returns None, `inject` an empty dict) without
creating a span or a context, so call sites test `enabled()` or the returned span once and the
hot path pays nothing. Span attributes follow the OpenTelemetry GenAI semantic conventions
(`gen_ai.*`); what they do not cover is under `pagedserve.*`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from common.sampling_params import SamplingParams

log = logging.getLogger("pagedserve.tracing")

_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None
# Spans take wall-clock nanoseconds; latencies are measured on the monotonic clock.
_WALL_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()


def setup_tracing(service_name: str) -> bool:
    """Turns tracing on if the environment asks for it (see the module docstring); returns
    whether it is on. `service_name` is used unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES
    name the service. Raises ValueError naming the variable when the configuration is unusable."""
    global _provider, _tracer
    if _tracer is not None:
        return True
    names = _exporter_names()
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {SERVICE_NAME: service_name})
    provider = TracerProvider(resource=resource)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer("pagedserve")
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    log.info("tracing on: service %s exports spans to %s", resource.attributes[SERVICE_NAME],
             ", ".join(f"otlp at {endpoint or 'the default endpoint'}" if n == "otlp" else n for n in names))
    return True


def _exporter_names() -> list[str]:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    configured = os.environ.get("OTEL_TRACES_EXPORTER")
    if configured is None:
        # The SDK's default exporter is otlp; pagedserve traces only when asked, so an endpoint
        # is what turns the default on.
        asked = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if asked else []
    names = [n.strip().lower() for n in configured.split(",") if n.strip()]
    return [] if "none" in names else names


def _exporter(name: str) -> SpanExporter:
    if name == "otlp":
        # The traces-only variable wins, as in the OpenTelemetry SDK; the error names the one set.
        variable = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
                         if os.environ.get(v)), None)
        protocol = os.environ[variable] if variable else "grpc"
        if protocol != "grpc":
            raise ValueError(f"{variable}={protocol!r} is not supported: pagedserve exports OTLP over grpc "
                             "(unset it or set grpc)")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported: use otlp, console or none")


def shutdown_tracing() -> None:
    """Exports the spans still buffered and turns tracing off; call once when the process stops."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


def enabled() -> bool:
    return _tracer is not None


def span_time_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as the wall-clock nanoseconds spans and events take."""
    return _WALL_MINUS_MONOTONIC_NS + int(monotonic_s * 1e9)


# ---------------------------------------------------------------------------- context propagation


def inject(span: Span | None = None) -> dict[str, str]:
    """W3C trace context ("traceparent", "tracestate") of `span`, or of the current context, as
    a dict: update a Submit's `trace_context` with it, or pass `list(inject(span).items())` as gRPC
    metadata. Empty when tracing is off."""
    if _tracer is None:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return carrier


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Context | None:
    """The remote parent carried by HTTP headers, a Submit's `trace_context`, or gRPC metadata
    (`context.invocation_metadata()`, a sequence of key/value pairs). None when tracing is off
    or the carrier is empty; pass the result as `parent` to `start_span`."""
    if _tracer is None or not carrier:
        return None
    if not isinstance(carrier, Mapping):
        carrier = dict(carrier)
    return propagate.extract(carrier)


# ---------------------------------------------------------------------------- spans


def start_span(name: str, *, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
               attributes: Mapping[str, object] | None = None, start_time_ns: int | None = None) -> Span | None:
    """A started span (end it yourself), child of `parent` or else of the current span; None
    when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_time_ns)


def request_attributes(operation: str, model: str, request_id: str, prompt_tokens: int) -> dict[str, object]:
    """GenAI attributes of a generation request known on arrival. `operation` is the GenAI
    operation name: "text_completion" or "chat"."""
    return {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "pagedserve",
        "gen_ai.request.model": model,
        "gen_ai.response.id": request_id,
        "pagedserve.request_id": request_id,
        "gen_ai.usage.input_tokens": prompt_tokens,
    }


def sampling_attributes(params: SamplingParams) -> dict[str, object]:
    """GenAI attributes of the sampling parameters in effect (defaults filled in)."""
    attributes: dict[str, object] = {
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }
    if params.top_k > 0:
        attributes["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    if params.presence_penalty:
        attributes["gen_ai.request.presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        attributes["gen_ai.request.frequency_penalty"] = params.frequency_penalty
    if params.n != 1:
        attributes["gen_ai.request.choice.count"] = params.n
    return attributes


def end_request_span(span: Span, *, output_tokens: int, finish_reason: str, ttft_s: float | None,
                     error: str | None = None, end_time_ns: int | None = None) -> None:
    """Records a generation's outcome on its span and ends it. `finish_reason` is the reason
    it ended (stop, length, abort, ...); `error`, when given, marks the span failed."""
    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    span.set_attribute("gen_ai.response.finish_reasons", (finish_reason,))
    if ttft_s is not None:
        span.set_attribute("gen_ai.response.time_to_first_chunk", ttft_s)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_time_ns)
