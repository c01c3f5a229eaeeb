"""The public API, pagedserve.v1.Generation, served on grpc.aio.

Requests are parsed by the service's own deserializers: protobuf refuses a string field that
holds invalid UTF-8, and gRPC reports a failed parse as INTERNAL; this service answers
INVALID_ARGUMENT naming the field instead. Messages over the server's receive limit never get
here: gRPC itself answers RESOURCE_EXHAUSTED.

Status codes: INVALID_ARGUMENT names the bad field, NOT_FOUND is an unknown model,
RESOURCE_EXHAUSTED (with "retry-after" trailing metadata, in seconds) is overload, UNAVAILABLE
means no worker can serve, INTERNAL is a bug (logged with the request id).

Every Generate request, from gRPC or the HTTP API, is measured here (docs/observability.md):
refused ones in `requests_rejected_total`, every other one in `requests_finished_total` once its
stream ends, with its queue time, time to first token and the tokens the client received. When
tracing is on, each is a SERVER span (a child of the client's trace context) with child spans
for validation and tokenization, the admission queue, and each dispatch to a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common import tracing
from common.pb import generation_pb2 as pb
from router.admission import Admission, NoWorkers, Overloaded, RequestTooLarge, Reservation
from router.counters import RouterCounters
from router.errors import ApiError, invalid_argument, unavailable
from router.fleet import Fleet
from router.generate import GenerateRun, RunConfig
from router.requests import (PreparedRequest, ServedModel, encode_prompt, loggable_request_id,
                             prepare_generate, request_id_problem)
from router.wire import find_invalid_utf8

log = logging.getLogger("pagedserve.router")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# How the requests refused before admission are counted, by the status they get.
_REJECTIONS = {grpc.StatusCode.INVALID_ARGUMENT: "invalid",
               grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
               grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.NOT_FOUND: "not_found"}


@dataclass(frozen=True)
class _Unparsable:
    """What the deserializer hands the handler instead of a request it could not parse."""

    problem: str


def _parser(message_type: type[Message]) -> Callable[[bytes], Message | _Unparsable]:
    def parse(data: bytes) -> Message | _Unparsable:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            field = find_invalid_utf8(message_type.DESCRIPTOR, data)
            if field is not None:
                return _Unparsable(f"{field} is not valid UTF-8: string fields must hold "
                                   "UTF-8 text")
            return _Unparsable(f"the request is not a valid {message_type.DESCRIPTOR.full_name}:"
                               f" {error}")
    return parse


def _request_id(request: pb.GenerateRequest | _Unparsable) -> str:
    return "" if isinstance(request, _Unparsable) else request.request_id


async def _abort(context: grpc.aio.ServicerContext, error: ApiError, request_id: str = "") -> None:
    """Ends the call with `error`; its "request-id" trailer names the request as the logs do
    (when the id is ASCII, as gRPC metadata must be)."""
    trailers = error.trailing_metadata
    # A refused id is not sent back: echoing a 66 KB one hung a grpc-js connection.
    if request_id and request_id.isascii() and request_id_problem(request_id) is None:
        trailers += (("request-id", request_id),)
    await context.abort(error.code, error.message, trailing_metadata=trailers)


class GenerationService:
    """The Generation service over a fleet of workers."""

    def __init__(self, fleet: Fleet, admission: Admission, counters: RouterCounters, *,
                 served_model_names: Sequence[str] = (), run_config: RunConfig = RunConfig()
                 ) -> None:
        self._fleet = fleet
        self._admission = admission
        self._counters = counters
        self._served_names = tuple(served_model_names)
        self._run_config = run_config
        self._dispatch_ids = itertools.count()
        self._running: set[asyncio.Task] = set()   # the tasks streaming a Generate (gRPC or HTTP)
        self._closing = False

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """The service's methods with their lenient deserializers, for add_generic_rpc_handlers."""
        def method(kind, behaviour, request_type: type[Message], response_type: type[Message]):
            return kind(behaviour, request_deserializer=_parser(request_type),
                        response_serializer=response_type.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": method(grpc.unary_stream_rpc_method_handler, self.generate,
                               pb.GenerateRequest, pb.GenerateResponse),
            "Tokenize": method(grpc.unary_unary_rpc_method_handler, _unary(self.tokenize),
                               pb.TokenizeRequest, pb.TokenizeResponse),
            "Detokenize": method(grpc.unary_unary_rpc_method_handler, _unary(self.detokenize),
                                 pb.DetokenizeRequest, pb.DetokenizeResponse),
            "ModelInfo": method(grpc.unary_unary_rpc_method_handler, _unary(self.model_info),
                                pb.ModelInfoRequest, pb.ModelInfoResponse),
        })

    def served_model(self) -> ServedModel:
        model = self._fleet.model
        if model is None:
            raise unavailable("no worker has connected yet, so the served model is unknown")
        return ServedModel(self._served_names or (model.name,), model.max_model_len,
                           model.vocab_size, model.tokenizer)

    # ---------------------------------------------------------------- Generate

    async def generate(self, request: pb.GenerateRequest | _Unparsable,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """The gRPC method: `stream` with its errors turned into statuses."""
        try:
            if isinstance(request, _Unparsable):
                self.reject("invalid", "", request.problem)
                raise invalid_argument(request.problem)
            parent = tracing.extract(context.invocation_metadata()) if tracing.enabled() else None
            # aclosing: if the call ends at a yield, the inner stream is closed now, not whenever
            # it is garbage-collected, so its worker-side abort and release happen at once.
            async with contextlib.aclosing(self.stream(request, parent)) as responses:
                async for response in responses:
                    yield response
        except ApiError as error:
            await _abort(context, error, _request_id(request))
        except asyncio.CancelledError:
            if (error := self._shutting_down()) is None:
                raise
            await _abort(context, error, _request_id(request))

    async def end_running(self, grace_s: float) -> None:
        """On shutdown: lets running Generate streams finish within `grace_s`, then ends the
        rest with UNAVAILABLE ("the router is shutting down"), which also aborts them on their
        workers; the client hears why instead of a bare CANCELLED, and the request is counted
        as aborted, not as cancelled by its client."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=grace_s)
        self._closing = True
        for task in self._running:
            task.cancel()
        if self._running:
            await asyncio.wait(set(self._running), timeout=5)

    def _shutting_down(self) -> ApiError | None:
        """The error a stream ends with when end_running cancelled it (None: it was not)."""
        if not self._closing:
            return None
        asyncio.current_task().uncancel()
        return unavailable("the router is shutting down; send the request again (another router "
                           "replica, or this one once restarted, will serve it)")

    def reject(self, reason: str, request_id: str, message: str) -> None:
        """Counts and logs a request refused before admission; `reason` is one of
        common.metrics.ROUTER_REJECT_REASONS."""
        self._counters.count(f"rejected_{reason}", "request rejected", request_id=request_id,
                             error=message)

    async def stream(self, request: pb.GenerateRequest, parent: Context | None = None
                     ) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate request, whatever the transport: validation, admission, dispatch. Yields
        its responses and raises ApiError. Closing the stream early (the client went away or its
        deadline passed) aborts the request on the workers; the reservation is always released.
        `parent`: the client's trace context (from its gRPC metadata or HTTP headers). An empty
        `request.request_id` is filled in first, so that even a refusal names the request."""
        request.request_id = request.request_id or uuid.uuid4().hex
        task = asyncio.current_task()
        self._running.add(task)
        try:
            async with contextlib.aclosing(self._stream(request, parent)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._running.discard(task)

    async def _stream(self, request: pb.GenerateRequest, parent: Context | None
                      ) -> AsyncIterator[pb.GenerateResponse]:
        observed = _Observed(request, self._counters)
        if tracing.enabled():
            observed.start_span(parent, self._model_label(request))
        try:
            with observed.step("validate_and_tokenize"):
                prepared = await asyncio.to_thread(prepare_generate, request, self.served_model())
            observed.prepared(prepared)
            queued = time.monotonic()
            with observed.step("admission") as span:
                reservation = await self._admit(prepared)
                if span is not None:
                    span.set_attribute("pagedserve.worker", reservation.worker_id)
        except ApiError as error:
            self.reject(_REJECTIONS[error.code], observed.request_id, error.message)
            observed.end("rejected", f"{error.code.name}: {error.message}")
            raise
        except BaseException as error:  # the client went away while it was queued, or a bug
            if isinstance(error, asyncio.CancelledError) and (shutdown := self._shutting_down()):
                observed.end("abort", f"{shutdown.code.name}: {shutdown.message}")
                raise shutdown from None
            observed.end("cancelled" if isinstance(error, asyncio.CancelledError) else "error")
            raise
        queue_s = time.monotonic() - queued
        self._counters.count(
            "requests", "request admitted", request_id=prepared.request_id,
            worker=reservation.worker_id, prompt_tokens=len(prepared.prompt_token_ids),
            n=prepared.n, max_tokens=prepared.params.max_tokens, queued_s=round(queue_s, 3))
        observed.admitted(queue_s, len(prepared.prompt_token_ids))

        run = GenerateRun(prepared, reservation, self._fleet, self._counters, self._run_config,
                          self._next_dispatch_id, observed.span)
        outcome, level, reason, error_text = "finished", logging.INFO, "error", None
        try:
            async with contextlib.aclosing(run.responses()) as responses:
                async for response in responses:
                    yield response
                    observed.delivered(response)  # after the yield: the client has it
            reason = "length" if "FINISH_REASON_LENGTH" in run.finish_reasons else "stop"
        except ApiError as error:
            outcome = error_text = f"failed: {error.code.name}: {error.message}"
            if error.code == grpc.StatusCode.INTERNAL:
                level = logging.ERROR
            raise
        except (asyncio.CancelledError, GeneratorExit) as stopped:
            if isinstance(stopped, asyncio.CancelledError) and (error := self._shutting_down()):
                reason = "abort"
                outcome = error_text = f"failed: {error.code.name}: {error.message}"
                raise error from None
            reason = "cancelled"
            outcome = "cancelled (the client went away or its deadline passed)"
            raise
        except Exception:
            outcome = error_text = "failed: internal error"
            level = logging.ERROR
            log.exception("request failed", extra={"request_id": prepared.request_id})
            raise ApiError(grpc.StatusCode.INTERNAL,
                           f"internal error (logged with request id {prepared.request_id})"
                           ) from None
        finally:
            reservation.release()
            observed.end(reason, error_text)
            log.log(level, "request ended", extra={
                "request_id": prepared.request_id, "outcome": outcome,
                "finish_reasons": ",".join(run.finish_reasons),
                "completion_tokens": run.completion_tokens,
                "duration_s": round(time.monotonic() - observed.started, 3)})

    def _model_label(self, request: pb.GenerateRequest) -> str:
        """The model a request asks for, as its span names it (the default if it names none)."""
        if request.model:
            return request.model
        if self._served_names:
            return self._served_names[0]
        return self._fleet.model.name if self._fleet.model is not None else ""

    async def _admit(self, prepared: PreparedRequest) -> Reservation:
        try:
            return await self._admission.reserve(
                prepared.reserved_tokens, self._fleet.chooser(prepared.prompt_token_ids),
                priority=prepared.priority)
        except Overloaded as error:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error),
                           retry_after_s=error.retry_after_s) from None
        except NoWorkers as error:
            raise unavailable(str(error)) from None
        except RequestTooLarge as error:
            raise invalid_argument(str(error)) from None

    def _next_dispatch_id(self) -> str:
        return f"{self._fleet.router_id}-{next(self._dispatch_ids)}"

    # ---------------------------------------------------------------- unary methods

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        model = self.served_model()
        model.check_name(request.model)
        ids = await asyncio.to_thread(encode_prompt, request, model)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        model = self.served_model()
        model.check_name(request.model)
        for position, token_id in enumerate(request.token_ids):
            if not 0 <= token_id < model.vocab_size:
                raise invalid_argument(f"token_ids[{position}]={token_id} is out of range: "
                                       f"token ids must be in [0, {model.vocab_size})")
        if model.tokenizer is None:
            raise invalid_argument(f"the model {model.names[0]} is served without a tokenizer, "
                                   "so token ids cannot be turned into text")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(model.tokenizer.decode, request.token_ids, skip)
        return pb.DetokenizeResponse(text=text)

    async def model_info(self, request: pb.ModelInfoRequest) -> pb.ModelInfoResponse:
        ready = len(self._fleet.accepting())
        model = self._fleet.model
        if model is None:
            return pb.ModelInfoResponse(model_names=self._served_names, ready_workers=ready)
        return pb.ModelInfoResponse(model_names=self._served_names or (model.name,),
                                    max_model_len=model.max_model_len,
                                    vocab_size=model.vocab_size, ready_workers=ready)


class _Observed:
    """One Generate request as its metrics and trace see it: when it arrived, when its first
    token reached the client, how many tokens did, and its SERVER span (None when not traced).
    The metrics go to the counters' series, which exist once the model's name is known: always
    so for an admitted request."""

    def __init__(self, request: pb.GenerateRequest, counters: RouterCounters) -> None:
        self.started = time.monotonic()
        self.request_id = loggable_request_id(request.request_id)
        self.first_token: float | None = None
        self.output_tokens = 0
        self.span: Span | None = None
        self._operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
        self._model = ""
        self._counters = counters

    def start_span(self, parent: Context | None, model: str) -> None:
        """Starts the request's span, at its arrival, as a child of the client's `parent`."""
        self._model = model
        self.span = tracing.start_span(
            f"{self._operation} {model}".strip(), parent=parent, kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": self._operation, "gen_ai.request.model": model},
            start_time_ns=tracing.span_time_ns(self.started))

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[Span | None]:
        """A child span of the request's around one step of handling it, failed if the step
        raises; None, at no cost, when not traced."""
        if self.span is None:
            yield None
            return
        span = tracing.start_span(name, parent=trace.set_span_in_context(self.span))
        try:
            yield span
        except BaseException as error:
            span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
            raise
        finally:
            span.end()

    def prepared(self, prepared: PreparedRequest) -> None:
        self.request_id = prepared.request_id
        if self.span is not None:
            self.span.set_attributes(
                tracing.request_attributes(self._operation, self._model, prepared.request_id,
                                           len(prepared.prompt_token_ids))
                | tracing.sampling_attributes(prepared.params))

    def admitted(self, queue_s: float, prompt_tokens: int) -> None:
        if self._counters.metrics is not None:
            self._counters.metrics.admitted(queue_s, prompt_tokens)

    def delivered(self, response: pb.GenerateResponse) -> None:
        """The client has taken `response`."""
        tokens = sum(len(choice.token_ids) for choice in response.choices)
        if not tokens:
            return
        if self.first_token is None:
            self.first_token = time.monotonic()
            if self._counters.metrics is not None:
                self._counters.metrics.first_token(self.first_token - self.started)
        self.output_tokens += tokens

    def end(self, reason: str, error: str | None = None) -> None:
        """The request is over: `reason` is one of common.metrics.ROUTER_FINISH_REASONS, or
        "rejected" for a request refused before admission (counted as such by `reject`).
        `error`, when given, marks the span failed."""
        now = time.monotonic()
        ttft_s = None if self.first_token is None else self.first_token - self.started
        if reason != "rejected" and self._counters.metrics is not None:
            self._counters.metrics.finished(reason, now - self.started, ttft_s, self.output_tokens)
        if self.span is not None:
            tracing.end_request_span(self.span, output_tokens=self.output_tokens,
                                     finish_reason=reason, ttft_s=ttft_s, error=error,
                                     end_time_ns=tracing.span_time_ns(now))


def _unary(method: Callable[[Message], Awaitable[Message]]):
    """Wraps a unary method: unparsable requests and ApiErrors become their status codes."""
    async def handle(request: Message | _Unparsable, context: grpc.aio.ServicerContext):
        try:
            if isinstance(request, _Unparsable):
                raise invalid_argument(request.problem)
            return await method(request)
        except ApiError as error:
            await _abort(context, error)
    return handle
