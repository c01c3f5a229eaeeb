"""The OpenAI-compatible HTTP API of the router: the aiohttp app.

`POST /v1/completions` and `/v1/chat/completions` (with SSE streaming and usage),
`GET /v1/models`, `POST /tokenize` and `/detokenize`, `GET /health` and `GET /metrics`. A body
is parsed into the gRPC API's `GenerateRequest` by `router.openai_protocol` and goes through the
same validation, admission and dispatch (`GenerationService.stream`), so both APIs behave alike;
errors come back as OpenAI-style JSON with the status the gRPC code maps to. With tracing on, a
request's span continues the trace of its W3C `traceparent` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import socket
import uuid
import zlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from common import tracing
from common.pb import generation_pb2 as pb
from router.admission import Batch
from router.auth import bearer_key_matches
from router.errors import ApiError
from router.openai_protocol import (
    MAX_HEADER_REQUEST_ID_LENGTH,
    Accumulator,
    HttpError,
    body_field,
    chunk_choices,
    completion_json,
    echoed,
    generate_requests,
    int_list,
    model_json,
    names_for,
    naming_prompt,
    parse_body,
    response_meta,
    role_chunk,
    tokenize_request,
    tool_calls_of,
    usage_json,
)
from router.tool_calls import StreamedCalls, ToolCallError, ToolCalling

log = logging.getLogger("pagedserve.http")

MAX_BODY_BYTES = 8 * 2**20
# What an event stream may hold unsent: in the kernel's send buffer of its connection (fixed, so
# that autotuning, megabytes on a fast link, does not hide a client that stopped reading) and in
# the transport's own buffer, before the stream stops taking responses and its request counts
# as blocked (router.generate's slow-reader policy swaps it out).
SSE_SOCKET_BUFFER_BYTES = 16 * 2**10
SSE_PENDING_BYTES = 16 * 2**10
REQUEST_ID = web.RequestKey("request_id", str)


def error_response(error: HttpError) -> web.Response:
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if error.retry_after_s else {}
    if error.status == 401:     # RFC 9110: a 401 names the scheme it wants
        headers["WWW-Authenticate"] = "Bearer"
    response = web.json_response(error.json(), status=error.status, headers=headers)
    if error.status in (413, 415):
        # Refused before its body was read: the connection closes, or a client that waits to
        # send the body, or sends the next request after it, would find the server reading on.
        response.force_close()
    return response


# Content-Encoding -> zlib's wbits for it. The app decodes bodies itself (aiohttp's own decoding
# is off: it answered an encoding it lacks, such as br, with a plain-text 400 before any
# middleware, and took unknown ones as no encoding at all).
BODY_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _content_codings(request: web.Request) -> list[str]:
    """The body's Content-Encoding codings, in the order they were applied; 415 for one this
    server cannot decode."""
    codings = [c.strip().lower() for c in request.headers.get("Content-Encoding", "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for coding in codings:
        if coding not in BODY_ENCODINGS:
            raise HttpError(415, f"Content-Encoding {coding!r} is not supported: send the body as it is, or "
                            f"compressed with {', '.join(sorted(BODY_ENCODINGS))}", "Content-Encoding")
    return codings


def _decoded(body: bytes, coding: str) -> bytes:
    """`body` decompressed, at most MAX_BODY_BYTES of it (a bomb is 413, not a full memory)."""
    inflate = zlib.decompressobj(BODY_ENCODINGS[coding])
    try:
        out = inflate.decompress(body, MAX_BODY_BYTES + 1)
        if len(out) > MAX_BODY_BYTES or inflate.unconsumed_tail:
            raise HttpError(413, f"request body too large: over {MAX_BODY_BYTES} bytes once decompressed ({coding})")
        if not inflate.eof:
            raise zlib.error("the compressed stream ends early")
    except zlib.error as error:
        raise HttpError(400, f"the body cannot be read: it is not valid {coding} data ({error})",
                        "Content-Encoding") from None
    return out


async def _body_text(request: web.Request) -> str:
    """The body as text, decompressed as its Content-Encoding says. JSON is UTF-8 (RFC 8259): a
    body declared in another charset, or in one unknown, is refused rather than read as what it
    says it is not."""
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise HttpError(415, f"charset={charset} is not supported: send the JSON body as UTF-8 "
                        "(Content-Type: application/json, or with charset=utf-8)")
    codings = _content_codings(request)
    if (length := request.content_length) is not None and length > MAX_BODY_BYTES:
        # Said at once, rather than after waiting for a body that may never come.
        raise HttpError(413, f"request body too large: Content-Length {length}, at most {MAX_BODY_BYTES} bytes")
    try:
        body = await request.read()
    except web.RequestPayloadError as error:     # a broken chunked transfer, say
        cause = error.__cause__
        problem = cause.message if isinstance(cause, HttpProcessingError) else str(error)
        raise HttpError(400, f"the body cannot be read: {problem}") from None
    for coding in reversed(codings):
        body = _decoded(body, coding)
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise HttpError(400, f"the body is not valid UTF-8, as JSON must be: {error.reason} at "
                        f"byte {error.start}") from None



class _MalformedHttpIsInfo(logging.Filter):
    """aiohttp logs a client's malformed HTTP (a control byte in a header, say) as an ERROR
    with a traceback, though it already answered 400 and the fault is the client's: one INFO
    line instead, so ERROR stays a sign of a server problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "malformed HTTP request refused: %s", (error.message,)
            record.exc_info = record.exc_text = None
        return True


logging.getLogger("aiohttp.server").addFilter(_MalformedHttpIsInfo())


class OpenAIApi:
    def __init__(self, service, *, api_key: str | None = None, cors_origins: list[str] | None = None,
                 metrics: Callable[[], bytes] | None = None, ready: Callable[[], bool] = lambda: True):
        """`service`: the router's GenerationService (`stream`, `reject`, `served_model`,
        `tokenize`, `detokenize`); `metrics` renders the Prometheus text of the router."""
        self.service, self.api_key, self.cors_origins = service, api_key, cors_origins or []
        self.metrics, self.ready = metrics, ready

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, handler_args={"auto_decompress": False},
                              middlewares=[self._request_id, self._errors, self._preflight, self._auth])
        app.on_response_prepare.append(self._cors)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)     # ids may hold a "/"
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # ---------------------------------------------------------------- middlewares

    @web.middleware
    async def _request_id(self, request: web.Request, handler):
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        problem = None
        if not (request_id.isascii() and request_id.isprintable()):
            problem = "X-Request-Id must be printable ASCII text"
        elif len(request_id) > MAX_HEADER_REQUEST_ID_LENGTH:
            problem = (f"X-Request-Id has {len(request_id)} characters; at most {MAX_HEADER_REQUEST_ID_LENGTH} "
                       "(each prompt of a batch is a request named after it, with -<index> appended)")
        if problem is not None:
            request[REQUEST_ID] = uuid.uuid4().hex
            response = error_response(HttpError(400, problem, "X-Request-Id"))
        else:
            request[REQUEST_ID] = request_id
            response = await handler(request)
        response.headers["X-Request-Id"] = request[REQUEST_ID]
        return response

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except HttpError as error:
            log.info("http request rejected", extra={"request_id": request[REQUEST_ID],
                                                     "status": error.status, "error": error.message})
            return error_response(error)
        except web.HTTPRequestEntityTooLarge:
            return error_response(HttpError(413, f"request body too large: at most {MAX_BODY_BYTES} bytes"))
        except web.HTTPException as error:
            if error.status < 400:
                raise
            response = error_response(HttpError(error.status, error.reason or "error"))
            if "Allow" in error.headers:                # 405 says which methods there are
                response.headers["Allow"] = error.headers["Allow"]
            return response
        except ConnectionError:
            # The client went away while its body was read: nobody is left to answer.
            log.info("http client went away", extra={"request_id": request[REQUEST_ID]})
            return web.Response(status=400)
        except Exception:
            log.exception("http request failed", extra={"request_id": request[REQUEST_ID]})
            return error_response(HttpError(500, f"internal error (logged with request id {request[REQUEST_ID]})"))

    @web.middleware
    async def _preflight(self, request: web.Request, handler):
        """Answers a CORS preflight from an allowed origin (its headers come from _cors)."""
        if request.method == "OPTIONS" and self._cors_allowed(request):
            return web.Response(status=204)
        return await handler(request)

    def _cors_allowed(self, request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        return bool(origin) and ("*" in self.cors_origins or origin in self.cors_origins)

    async def _cors(self, request: web.Request, response: web.StreamResponse) -> None:
        """CORS headers on every response as it is prepared: errors and event streams too,
        whose headers are sent before a middleware could see them."""
        if self._cors_allowed(request):
            response.headers["Access-Control-Allow-Origin"] = request.headers["Origin"]
            # Whatever headers the browser asks for (OpenAI's JS client sends x-stainless-*).
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "Authorization, Content-Type, X-Request-Id")
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
        if self.cors_origins and "*" not in self.cors_origins:
            response.headers["Vary"] = "Origin"     # the answer depends on the Origin header

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path.startswith("/v1/") and not bearer_key_matches(
                request.headers.get("Authorization", ""), self.api_key):
            raise HttpError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
        return await handler(request)

    # ---------------------------------------------------------------- helpers

    async def _body(self, request: web.Request) -> dict:
        return parse_body(await _body_text(request))

    def _model_name(self, body: dict) -> str:
        return body.get("model") or self._served().names[0]

    def _served(self):
        try:
            return self.service.served_model()
        except ApiError as error:
            raise HttpError.from_api(error) from None

    def _without_tokenizer(self) -> bool:
        """Whether the served model has no tokenizer; False while no worker has named a model
        (the service then refuses the request, and counts it)."""
        try:
            return self.service.served_model().tokenizer is None
        except ApiError:
            return False

    # ---------------------------------------------------------------- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            grpc_requests = generate_requests(body, chat=chat, request_id=request[REQUEST_ID])
            stream = body_field(body, "stream", (bool,), False)
            stream_options = body_field(body, "stream_options", (dict,), {})
            if stream_options and not stream:
                # As OpenAI and vLLM answer: the options of a stream the request did not ask for.
                raise HttpError(400, "stream_options is only allowed with stream=true", "stream_options")
            include_usage = body_field({"stream_options.include_usage": stream_options.get("include_usage")},
                                       "stream_options.include_usage", (bool,), False)
        except HttpError as error:      # refused before the service saw it: count it there
            self.service.reject("invalid", request[REQUEST_ID], error.message)
            raise
        names = names_for(body, chat=chat)
        calling = self._tool_calling(body, request[REQUEST_ID]) if chat else None
        # vLLM's extension; always on for a model without a tokenizer, whose text is empty.
        token_ids = body_field(body, "return_token_ids", (bool,), False) or self._without_tokenizer()
        parent = tracing.extract(request.headers) if tracing.enabled() else None
        params = grpc_requests[0].params
        n = params.n if params.HasField("n") else 1
        # The request span's attributes of the call (OpenTelemetry's HTTP server conventions).
        call = {"http.request.method": request.method,
                "http.route": request.match_info.route.resource.canonical,
                "url.path": request.path, "url.scheme": request.scheme}
        # A batch's prompts are admitted one by one, and wait for each other without limit.
        batch = Batch() if len(grpc_requests) > 1 else None
        streams = [self.service.stream(r, parent, call, batch) for r in grpc_requests]
        if not chat and body_field(body, "echo", (bool,), False):
            streams = [echoed(s, functools.partial(self._prompt_text, r), n, params.HasField("logprobs"))
                       for s, r in zip(streams, grpc_requests)]
        # aclosing: when the client goes away (its handler is cancelled) the stream is closed at
        # once, which aborts the request on its worker or takes it out of the admission queue.
        async with contextlib.aclosing(streams[0] if len(streams) == 1 else _merged(streams, n)) as responses:
            try:
                first = await anext(responses)          # errors before any output become statuses
            except ApiError as error:
                raise HttpError.from_api(error, names) from None
            except StopAsyncIteration:
                first = None
            meta = response_meta(request[REQUEST_ID], self._model_name(body), chat=chat)
            want_logprobs = params.HasField("logprobs")
            n *= len(streams)
            if stream:
                return await self._sse(request, meta, _prepend(first, responses), chat=chat, n=n,
                                       want_logprobs=want_logprobs, include_usage=include_usage,
                                       names=names, calling=calling, token_ids=token_ids)
            acc = Accumulator(n, chat, want_logprobs, calling, token_ids)
            try:
                async for response in _prepend(first, responses):
                    acc.add(response)
            except ApiError as error:
                raise HttpError.from_api(error, names) from None
        return web.json_response(completion_json(meta, acc))

    def _tool_calling(self, body: dict, request_id: str) -> ToolCalling | None:
        """The chat's tool calling; under "auto", with the served model's tool-call syntax."""
        calling = tool_calls_of(body)
        if calling is None or not calling.auto:
            return calling
        served = self._served()
        template = served.tokenizer.hf.chat_template or "" if served.tokenizer is not None else ""
        try:
            return calling.with_syntax(template, served.names[0])
        except ToolCallError as error:
            self.service.reject("invalid", request_id, str(error))
            raise HttpError(400, str(error), error.param) from None

    async def _prompt_text(self, request: pb.GenerateRequest) -> str:
        """A completion prompt as text, to echo: a token-id prompt decoded, special tokens kept."""
        if request.WhichOneof("input") == "text":
            return request.text
        decoded = await self.service.detokenize(pb.DetokenizeRequest(
            model=request.model, token_ids=request.token_ids.ids, skip_special_tokens=False))
        return decoded.text

    async def _sse(self, request: web.Request, meta: dict, responses: AsyncIterator[pb.GenerateResponse], *,
                   chat: bool, n: int, want_logprobs: bool, include_usage: bool,
                   names: dict[str, str], calling: ToolCalling | None, token_ids: bool) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          "X-Request-Id": request[REQUEST_ID]})
        await out.prepare(request)
        transport = request.transport   # None once the client has gone: the writes then raise
        if transport is not None and (sock := transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SSE_SOCKET_BUFFER_BYTES)
        obj = "chat.completion.chunk" if chat else "text_completion"
        # With include_usage every chunk has a usage field, null but in the last (as OpenAI's).
        head = meta | {"object": obj} | ({"usage": None} if include_usage else {})

        async def send(payload: dict) -> None:
            await out.write(b"data: " + json.dumps(head | payload).encode() + b"\n\n")
            # aiohttp waits for its transport only every 64 KiB written: a stalled reader is
            # noticed here instead, at SSE_PENDING_BYTES.
            while (transport is not None and not transport.is_closing()
                   and transport.get_write_buffer_size() > SSE_PENDING_BYTES):
                await asyncio.sleep(0.05)

        if chat:
            await send(role_chunk(n))
        usage = None
        offsets = [0] * n
        calls = StreamedCalls(calling, n) if calling is not None else None
        try:
            async for response in responses:
                if choices := chunk_choices(response, chat=chat, want_logprobs=want_logprobs,
                                            offsets=offsets, calls=calls, token_ids=token_ids):
                    await send({"choices": choices})
                if response.HasField("usage"):
                    usage = response.usage
        except ApiError as error:
            # Headers are gone: report the error in the stream, as OpenAI servers do.
            await out.write(b"data: " + json.dumps(HttpError.from_api(error, names).json()).encode() + b"\n\n")
        except ConnectionResetError:
            return out      # the client went away: the caller closes the stream, which aborts it
        if include_usage:
            await send({"choices": [], "usage": usage_json(usage)})
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    # ---------------------------------------------------------------- the rest

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": await self._model_list()})

    async def _model_list(self) -> list[dict]:
        served = self._served()
        info = await self.service.model_info(pb.ModelInfoRequest())
        return [model_json(name, served.max_model_len) for name in served.names] + [
            model_json(a.name, served.max_model_len, parent=a.parent, root=a.path) for a in info.lora_adapters]

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        models = {m["id"]: m for m in await self._model_list()}
        if name not in models:
            raise HttpError(404, f"model {name!r} is not served here; served: {', '.join(models)}",
                            "model", code="model_not_found")
        return web.json_response(models[name])

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: plain text on success."""
        body = await self._body(request)
        load = pb.LoadLoRAAdapterRequest(lora_name=body_field(body, "lora_name", (str,), ""),
                                         lora_path=body_field(body, "lora_path", (str,), ""))
        try:
            await self.service.load_lora_adapter(load)
        except ApiError as error:
            raise HttpError.from_api(error) from None
        return web.Response(text=f"Success: LoRA adapter '{load.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's `POST /v1/unload_lora_adapter {"lora_name"}`; waits for its requests to end."""
        body = await self._body(request)
        unload = pb.UnloadLoRAAdapterRequest(lora_name=body_field(body, "lora_name", (str,), ""))
        try:
            await self.service.unload_lora_adapter(unload)
        except ApiError as error:
            raise HttpError.from_api(error) from None
        return web.Response(text=f"Success: LoRA adapter '{unload.lora_name}' removed successfully.")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            result = await self.service.tokenize(tokenize_request(body))
        except ApiError as error:
            raise HttpError.from_api(error) from None
        served = self._served()
        return web.json_response({"tokens": list(result.token_ids), "count": result.count,
                                  "max_model_len": served.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("tokens") is None:
            raise HttpError(400, "tokens is required: the token ids to turn into text", "tokens")
        tokens = int_list(body_field(body, "tokens", (list,)), "tokens")
        try:
            result = await self.service.detokenize(pb.DetokenizeRequest(
                model=body_field(body, "model", (str,), ""), token_ids=tokens))
        except ApiError as error:
            raise HttpError.from_api(error) from None
        return web.json_response({"prompt": result.text})

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready():
            raise HttpError(503, "no worker is serving yet")
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            raise HttpError(404, "metrics are not enabled")
        return web.Response(body=self.metrics(), content_type="text/plain", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})


async def _merged(streams: list[AsyncIterator[pb.GenerateResponse]], n: int
                  ) -> AsyncIterator[pb.GenerateResponse]:
    """The streams of a batch's prompts as one, in arrival order: choice i of prompt p becomes
    choice p * n + i, and one last message carries the usage summed over the prompts. The
    first error of any prompt ends it (closing the others, which aborts them)."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(prompt: int, responses: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async for response in responses:
                arrivals.put_nowait((prompt, response))
        except ApiError as error:
            arrivals.put_nowait((prompt, naming_prompt(error, prompt)))
        except Exception as error:
            arrivals.put_nowait((prompt, error))
        else:
            arrivals.put_nowait((prompt, None))

    pumps = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    usage = [pb.Usage() for _ in streams]
    try:
        running = len(streams)
        while running:
            prompt, response = await arrivals.get()
            if response is None:            # that prompt's stream has ended
                running -= 1
                continue
            if isinstance(response, Exception):
                raise response
            for choice in response.choices:
                choice.index += prompt * n
            if response.HasField("usage"):
                usage[prompt] = response.usage
                response.ClearField("usage")
            if response.choices:
                yield response
        yield pb.GenerateResponse(usage=pb.Usage(
            prompt_tokens=sum(u.prompt_tokens for u in usage),
            completion_tokens=sum(u.completion_tokens for u in usage),
            total_tokens=sum(u.total_tokens for u in usage)))
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)



async def _prepend(first, rest: AsyncIterator):
    if first is not None:
        yield first
    async for item in rest:
        yield item

