"""The router's service, whatever the transport: Generate, Tokenize, Detokenize, ModelInfo and
the LoRA adapter RPCs (router.lora_adapters) over pagedserve.v1 messages, raising ApiError (a gRPC status code, a message naming the
problem and the field it is about). Two entrances call it alike: `router.grpc_api` (the
Generation service on grpc.aio) and `router.openai_api` (the OpenAI HTTP API).

Codes: INVALID_ARGUMENT names the bad field, NOT_FOUND is an unknown model,
RESOURCE_EXHAUSTED (with a retry hint) is overload, UNAVAILABLE means no worker can serve,
INTERNAL is a bug (logged with the request id).

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
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common import tracing
from common.pb import generation_pb2 as pb
from router.admission import (
    Admission,
    Batch,
    NoWorkers,
    Overloaded,
    RequestTooLarge,
    Reservation,
)
from router.counters import RouterCounters
from router.errors import ApiError, invalid_argument, unavailable
from router.fleet import Fleet
from router.generate import GenerateRun, RunConfig
from router.preemption import PriorityPreemption
from router.rebalance import Rebalancer
from router.lora_adapters import LoRAAdapters
from router.requests import (
    UNSET_MAX_TOKENS_RESERVATION,
    PreparedRequest,
    ServedModel,
    encode_prompt,
    loggable_request_id,
    prepare_generate,
)

log = logging.getLogger("pagedserve.router")

# How the requests refused before admission are counted, by the status they get.
_REJECTIONS = {grpc.StatusCode.INVALID_ARGUMENT: "invalid",
               grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
               grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.NOT_FOUND: "not_found"}


class GenerationService:
    """The Generation service over a fleet of workers."""

    def __init__(self, fleet: Fleet, admission: Admission, counters: RouterCounters, *,
                 served_model_names: Sequence[str] = (), run_config: RunConfig = RunConfig(),
                 preemption: PriorityPreemption | None = None, rebalancer: Rebalancer | None = None) -> None:
        """`preemption`: the policy that may take requests off a GPU for more urgent ones;
        `rebalancer`: the one that moves running requests off a worker with a queue."""
        self._fleet = fleet
        self._admission = admission
        self._counters = counters
        self._served_names = tuple(served_model_names)
        self._run_config = run_config
        self._preemption = preemption
        self._rebalancer = rebalancer
        self._dispatch_ids = itertools.count()
        self._running: set[asyncio.Task] = set()   # the tasks streaming a Generate (gRPC or HTTP)
        self._closing = False
        self._lora = LoRAAdapters(fleet)

    def served_model(self) -> ServedModel:
        model = self._fleet.model
        if model is None:
            raise unavailable("no worker has connected yet, so the served model is unknown")
        return ServedModel(self._served_names or (model.name,), model.max_model_len,
                           model.vocab_size, model.tokenizer, frozenset(self._fleet.lora_adapters()),
                           model.logits_processors, frozenset(self._fleet.lora_unloading))

    # ---------------------------------------------------------------- Generate

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

    def shutting_down(self) -> ApiError | None:
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

    async def stream(self, request: pb.GenerateRequest, parent: Context | None = None,
                     transport: Mapping[str, str] | None = None,
                     batch: Batch | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate request, whatever the transport: validation, admission, dispatch. Yields
        its responses and raises ApiError. Closing the stream early (the client went away or its
        deadline passed) aborts the request on the workers; the reservation is always released.
        `parent`: the client's trace context (from its gRPC metadata or HTTP headers);
        `transport`: the span attributes of the call that carried it (OpenTelemetry's RPC or
        HTTP server conventions), so one SERVER span says both what was asked and how; `batch`:
        the other prompts of the client's request, if it has several (router.admission). An empty
        `request.request_id` is filled in first, so that even a refusal names the request."""
        request.request_id = request.request_id or uuid.uuid4().hex
        task = asyncio.current_task()
        self._running.add(task)
        try:
            async with contextlib.aclosing(self._stream(request, parent, transport or {}, batch)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._running.discard(task)

    async def _stream(self, request: pb.GenerateRequest, parent: Context | None,
                      transport: Mapping[str, str], batch: Batch | None) -> AsyncIterator[pb.GenerateResponse]:
        observed = _Observed(request, self._counters)
        if tracing.enabled():
            observed.start_span(parent, self._model_label(request), transport)
        try:
            with observed.step("validate_and_tokenize"):
                prepared = await asyncio.to_thread(prepare_generate, request, self.served_model())
            observed.prepared(prepared)
            queued = time.monotonic()
            with observed.step("admission") as span:
                reservation = await self._admit(prepared, batch)
                if span is not None:
                    span.set_attribute("pagedserve.worker", reservation.worker_id)
        except ApiError as error:
            self.reject(_REJECTIONS[error.code], observed.request_id, error.message)
            observed.end("rejected", f"{error.code.name}: {error.message}")
            raise
        except BaseException as error:  # the client went away while it was queued, or a bug
            if isinstance(error, asyncio.CancelledError) and (shutdown := self.shutting_down()):
                observed.end("abort", f"{shutdown.code.name}: {shutdown.message}")
                raise shutdown from None
            cancelled = isinstance(error, asyncio.CancelledError)
            observed.end("cancelled" if cancelled else "error")
            if cancelled:
                log.info("request ended", extra={
                    "request_id": observed.request_id, "outcome": "cancelled before admission (the client went away "
                    "or its deadline passed)", "duration_s": round(time.monotonic() - observed.started, 3)})
            raise
        queue_s = time.monotonic() - queued
        self._counters.count(
            "requests", "request admitted", request_id=prepared.request_id,
            worker=reservation.worker_id, prompt_tokens=len(prepared.prompt_token_ids),
            n=prepared.n, max_tokens=prepared.params.max_tokens, queued_s=round(queue_s, 3))
        observed.admitted(queue_s, len(prepared.prompt_token_ids))

        run = GenerateRun(prepared, reservation, self._fleet, self._counters, self._run_config,
                          self._next_dispatch_id, observed.span, self._preemption, self._rebalancer)
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
            if isinstance(stopped, asyncio.CancelledError) and (error := self.shutting_down()):
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

    async def _admit(self, prepared: PreparedRequest, batch: Batch | None) -> Reservation:
        try:
            return await self._admission.reserve(
                prepared.reserved_tokens, self._fleet.chooser(prepared.prompt_token_ids, prepared.lora_name),
                priority=prepared.priority, request_id=prepared.request_id, batch=batch)
        except Overloaded as error:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error),
                           retry_after_s=error.retry_after_s) from None
        except NoWorkers as error:
            raise unavailable(str(error)) from None
        except RequestTooLarge as error:
            if prepared.max_tokens_set:
                raise invalid_argument(str(error)) from None
            # The client set no max_tokens: say what was reserved in its place, and name n.
            raise invalid_argument(
                f"{error}; with max_tokens unset, {UNSET_MAX_TOKENS_RESERVATION} output tokens are reserved "
                f"for each of the n={prepared.n} choices: set max_tokens, or ask for fewer choices",
                "params.n" if prepared.n > 1 else "params.max_tokens") from None

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
                                       f"token ids must be in [0, {model.vocab_size})",
                                       f"token_ids[{position}]")
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
        names = self._served_names or (model.name,)
        return pb.ModelInfoResponse(model_names=names, max_model_len=model.max_model_len,
                                    vocab_size=model.vocab_size, ready_workers=ready,
                                    lora_adapters=self._lora.infos(names[0]))

    async def load_lora_adapter(self, request: pb.LoadLoRAAdapterRequest) -> pb.LoadLoRAAdapterResponse:
        return await self._lora.load(request, self.served_model().names)

    async def unload_lora_adapter(self, request: pb.UnloadLoRAAdapterRequest) -> pb.UnloadLoRAAdapterResponse:
        return await self._lora.unload(request)


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

    def start_span(self, parent: Context | None, model: str, transport: Mapping[str, str]) -> None:
        """Starts the request's span, at its arrival, as a child of the client's `parent`."""
        self._model = model
        self.span = tracing.start_span(
            f"{self._operation} {model}".strip(), parent=parent, kind=SpanKind.SERVER,
            # What a refused request's span can say too: who served it and which request it was.
            attributes={"gen_ai.operation.name": self._operation, "gen_ai.request.model": model,
                        "gen_ai.provider.name": "pagedserve", "pagedserve.request_id": self.request_id,
                        **transport},
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
        except (asyncio.CancelledError, GeneratorExit):
            raise       # the client went away: the request's span says so, not as an error
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
                | tracing.sampling_attributes(prepared.params)
                | ({"pagedserve.lora.name": prepared.lora_name} if prepared.lora_name else {}))

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
            if error is not None:   # its status code ("failed: " leads errors of admitted requests)
                kind = error.removeprefix("failed: ").split(":", 1)[0]
                self.span.set_attribute("error.type", kind if kind.isupper() else "INTERNAL")
            tracing.end_request_span(self.span, output_tokens=self.output_tokens,
                                     finish_reason=reason, ttft_s=ttft_s, error=error,
                                     end_time_ns=tracing.span_time_ns(now))

