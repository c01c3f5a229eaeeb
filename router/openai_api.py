"""The OpenAI-compatible HTTP API of the router.

`POST /v1/completions` and `/v1/chat/completions` (with SSE streaming and usage),
`GET /v1/models`, `POST /tokenize` and `/detokenize`, `GET /health` and `GET /metrics`. A
request is translated into the gRPC API's `GenerateRequest` and goes through the same
validation, admission and dispatch (`GenerationService.stream`), so both APIs behave alike;
errors come back as OpenAI-style JSON with the status the gRPC code maps to. With tracing on, a
request's span continues the trace of its W3C `traceparent` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from common import tracing
from common.pb import generation_pb2 as pb
from router.auth import bearer_key_matches
from router.errors import ApiError

log = logging.getLogger("pagedserve.http")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's error types; 5xx are all "server_error". `code` is a string or null, as in OpenAI's
# schema (typed clients reject a number there).
ERROR_TYPE = {401: "authentication_error", 429: "rate_limit_error"}
ERROR_CODE = {401: "invalid_api_key"}
INT32 = (-2**31, 2**31 - 1)
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
MAX_BODY_BYTES = 8 * 2**20
REQUEST_ID = web.RequestKey("request_id", str)


# The field an INVALID_ARGUMENT message starts with: "max_tokens=0 is invalid", "prompt: ...",
# "prompt is empty"; not the first word of a sentence ("the request needs ...").
_PARAM = re.compile(r"([A-Za-z_][\w.\[\]]*)(?:=|:| is | has | must )")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after_s: float | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s
        self.code = code or ERROR_CODE.get(status)

    @classmethod
    def from_api(cls, error: ApiError, renames: dict[str, str]) -> HttpError:
        """The gRPC error as the HTTP client sees it: fields named as in its request."""
        message = error.message
        for grpc_name, http_name in renames.items():
            if message.startswith(grpc_name):
                message = http_name + message[len(grpc_name):]
                break
        param = code = None
        if error.code == grpc.StatusCode.INVALID_ARGUMENT and (match := _PARAM.match(message)):
            param = match.group(1)
        elif error.code == grpc.StatusCode.NOT_FOUND:     # the only NOT_FOUND: an unknown model
            param, code = "model", "model_not_found"
        return cls(HTTP_STATUS.get(error.code, 500), message, param, error.retry_after_s, code)

    def json(self) -> dict:
        kind = "server_error" if self.status >= 500 else ERROR_TYPE.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(math.ceil(self.retry_after_s))} if self.retry_after_s else None
        return web.json_response(self.json(), status=self.status, headers=headers)


# ------------------------------------------------------------------ request parsing

def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None,
           limits: tuple[int, int] = INT32) -> Any:
    """body[name] checked against `kinds`; an integer also against `limits` (the range of the
    gRPC field it goes into), or made a float for a number field; a string for being encodable
    text."""
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python: only accept it where bool is asked for.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        allowed = " or ".join("boolean" if k is bool else "integer" if k is int else "number"
                              if k is float else "string" if k is str else "array" if k is list
                              else "object" for k in kinds)
        raise HttpError(400, f"{name} must be {allowed}, got {json.dumps(value)[:80]}", name)
    if isinstance(value, int) and not isinstance(value, bool):
        if float in kinds:  # a number field: its range is the gRPC API's, checked later
            return _as_float(value, name)
        _check_int(value, name, limits)
    if isinstance(value, str):
        _check_text(value, name)
    return value


def _check_int(value: int, name: str, limits: tuple[int, int] = INT32) -> None:
    if not limits[0] <= value <= limits[1]:
        what = "a 32-bit integer" if limits == INT32 else f"an integer in [{limits[0]}, {limits[1]}]"
        raise HttpError(400, f"{name}={value} is out of range: the field holds {what}", name)


def _as_float(value: int, name: str) -> float:
    """An integer sent for a number field, as the float the field holds."""
    try:
        return float(value)
    except OverflowError:
        raise HttpError(400, f"{name} is out of range: the number has {len(str(abs(value)))} digits",
                        name) from None


def _int_list(values: list, name: str) -> list[int]:
    """An array of integers that fit the gRPC API's int32 fields (token ids)."""
    for i, value in enumerate(values):
        if not isinstance(value, int) or isinstance(value, bool):
            raise HttpError(400, f"{name} must be an array of integers", name)
        _check_int(value, f"{name}[{i}]")
    return values


def _check_text(value: str, name: str) -> None:
    """JSON can escape a lone UTF-16 surrogate ("\\ud800"), which is no Unicode text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise HttpError(400, f"{name} is not valid Unicode text: it holds a lone UTF-16 "
                        "surrogate", name) from None


async def _body_text(request: web.Request) -> str:
    """The body as text. JSON is UTF-8 (RFC 8259): a body declared in another charset, or in one
    unknown, is refused rather than read as what it says it is not."""
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise HttpError(415, f"charset={charset} is not supported: send the JSON body as UTF-8 "
                        "(Content-Type: application/json, or with charset=utf-8)")
    try:
        return (await request.read()).decode("utf-8")
    except web.RequestPayloadError as error:     # a broken gzip stream, say
        cause = error.__cause__
        problem = cause.message if isinstance(cause, HttpProcessingError) else str(error)
        raise HttpError(400, f"the body cannot be read: {problem}") from None
    except UnicodeDecodeError as error:
        raise HttpError(400, f"the body is not valid UTF-8, as JSON must be: {error.reason} at "
                        f"byte {error.start}") from None


def _json_int(digits: str) -> int:
    """A JSON integer. One longer than Python converts (4300 digits by default) is a 400 naming
    the problem instead of a ValueError."""
    try:
        return int(digits)
    except ValueError:
        raise HttpError(400, f"the body holds an integer of {len(digits.lstrip('-'))} digits, "
                        "far more than any field takes") from None


def sampling_parameters(body: dict, *, chat: bool) -> pb.SamplingParameters:
    """OpenAI fields plus the gRPC API's extra sampling fields, type-checked; ranges are
    checked with the gRPC API's rules later."""
    p = pb.SamplingParameters()
    max_tokens = _field(body, "max_completion_tokens", (int,)) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _field(body, "max_tokens", (int,))
    if max_tokens is not None:
        p.max_tokens = max_tokens
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = _field(body, name, (int, float))
        if value is not None:
            setattr(p, name, value)
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        setattr(p, name, _field(body, name, (int, float), 0.0))
    for name in ("n", "top_k"):
        value = _field(body, name, (int,))
        if value is not None:
            setattr(p, name, value)
    seed = _field(body, "seed", (int,), limits=(0, 2**63 - 1))
    if seed is not None:
        p.seed = seed
    p.min_tokens = _field(body, "min_tokens", (int,), 0)
    p.ignore_eos = _field(body, "ignore_eos", (bool,), False)
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HttpError(400, "stop must be a string or an array of strings", "stop")
    for i, s in enumerate(stop):
        _check_text(s, f"stop[{i}]")
    p.stop.extend(stop)
    p.stop_token_ids.extend(_int_list(_field(body, "stop_token_ids", (list,), []), "stop_token_ids"))
    if chat:
        if _field(body, "logprobs", (bool,), False):
            p.logprobs = _field(body, "top_logprobs", (int,), 0)
        elif body.get("top_logprobs") is not None:
            raise HttpError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    else:
        logprobs = _field(body, "logprobs", (int,))
        if logprobs is not None:
            p.logprobs = logprobs
    best_of = _field(body, "best_of", (int,))
    if best_of is not None and best_of != (p.n if p.HasField("n") else 1):
        raise HttpError(400, "best_of is not supported (it must equal n)", "best_of")
    if not chat and _field(body, "echo", (bool,), False):
        raise HttpError(400, "echo=true is not supported", "echo")
    if _field(body, "logit_bias", (dict,), {}):
        raise HttpError(400, "logit_bias is not supported", "logit_bias")
    _refuse_unsupported(body, chat=chat)
    return p


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    """OpenAI features this server does not have are refused, not silently ignored: a client
    asking for JSON output or tool calls would otherwise get plain text it cannot use."""
    if not chat:
        if _field(body, "suffix", (str,)):
            raise HttpError(400, "suffix is not supported", "suffix")
        return
    for name in ("tools", "functions"):
        if _field(body, name, (list,)):
            raise HttpError(400, f"{name} are not supported: this server does not parse tool "
                            "calls; send the conversation as plain messages", name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise HttpError(400, f"{name} is not supported (tool calls are not parsed)", name)
    response_format = _field(body, "response_format", (dict,), {})
    if response_format.get("type", "text") != "text":
        raise HttpError(400, f"response_format type {json.dumps(response_format.get('type'))[:40]}"
                        " is not supported: only text", "response_format")


MAX_PROMPTS = 256     # prompts in one completions request (each is admitted as one request)


def generate_requests(body: dict, *, chat: bool, request_id: str) -> list[pb.GenerateRequest]:
    """The gRPC requests of one HTTP request: one, or one per prompt of a completions batch
    (ids `<request_id>-<i>`)."""
    _field(body, "user", (str,))       # accepted for OpenAI clients; type-checked, unused
    request = pb.GenerateRequest(model=_field(body, "model", (str,), ""), request_id=request_id,
                                 params=sampling_parameters(body, chat=chat),
                                 priority=_field(body, "priority", (int,), 0),
                                 include_stop_str_in_output=_field(body, "include_stop_str_in_output", (bool,), False))
    skip = _field(body, "skip_special_tokens", (bool,))
    if skip is not None:
        request.skip_special_tokens = skip
    if chat:
        request.chat.CopyFrom(chat_messages(body))
        return [request]
    prompts = completion_prompts(body.get("prompt"))
    requests = []
    for i, prompt in enumerate(prompts):
        one = pb.GenerateRequest()
        one.CopyFrom(request)
        if len(prompts) > 1:
            one.request_id = f"{request_id}-{i}"
        if isinstance(prompt, str):
            one.text = prompt
        else:
            one.token_ids.ids.extend(prompt)
        requests.append(one)
    return requests


def completion_prompts(prompt) -> list[str | list[int]]:
    """A completions `prompt`: a string, token ids, or an array of either (a batch)."""
    def is_ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if prompt is None:
        raise HttpError(400, "prompt is required", "prompt")
    if isinstance(prompt, str) or (is_ids(prompt) and prompt):
        batch, names = [prompt], ["prompt"]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        batch, names = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
    else:
        raise HttpError(400, "prompt must be a string, an array of token ids, or an array of "
                        "strings or of token-id arrays", "prompt")
    if len(batch) > MAX_PROMPTS:
        raise HttpError(400, f"prompt holds {len(batch)} prompts; at most {MAX_PROMPTS} are allowed "
                        "in one request", "prompt")
    for one, name in zip(batch, names):
        if isinstance(one, str):
            _check_text(one, name)
        else:
            _int_list(one, name)
    return batch


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(body: dict) -> pb.ChatMessages:
    messages = _field(body, "messages", (list,))
    if not messages:
        raise HttpError(400, "messages is required and must not be empty", "messages")
    chat = pb.ChatMessages()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise HttpError(400, f"messages[{i}] must be an object whose role is one of "
                            f"{', '.join(CHAT_ROLES)}", f"messages[{i}].role")
        name = f"messages[{i}].content"
        content = m.get("content")
        if content is None and m["role"] == "assistant":   # an assistant turn may be empty
            content = ""
        if isinstance(content, list):          # content parts: only text is understood
            if any(not isinstance(part, dict) or part.get("type") != "text"
                   or not isinstance(part.get("text"), str) for part in content):
                raise HttpError(400, f"{name}: only text parts ({{\"type\": \"text\", \"text\": "
                                "string}) are supported", name)
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise HttpError(400, f"{name} must be a string or an array of text parts", name)
        _check_text(content, name)
        chat.messages.add(role=m["role"], content=content)
    return chat


# ------------------------------------------------------------------ responses

def _completion_logprobs(entries, text_offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry.sampled.text)
        token_logprobs.append(entry.sampled.logprob)
        # OpenAI lists the sampled token among the top ones even when it ranks lower.
        top.append({t.text: t.logprob for t in entry.top} | {entry.sampled.text: entry.sampled.logprob})
        offsets.append(text_offset)
        text_offset += len(entry.sampled.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(entries) -> dict:
    def one(lp):
        return {"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode())}
    return {"content": [one(e.sampled) | {"top_logprobs": [one(t) for t in e.top]} for e in entries]}


class Accumulator:
    """Collects the stream of one request into whole choices (non-streaming responses)."""

    def __init__(self, n: int, chat: bool, want_logprobs: bool):
        self.chat, self.want_logprobs = chat, want_logprobs
        self.text = [""] * n
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.usage: pb.Usage | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        for c in response.choices:
            self.text[c.index] += c.text
            self.logprobs[c.index].extend(c.logprobs)
            if c.finish_reason:
                self.finish[c.index] = FINISH.get(c.finish_reason)
        if response.HasField("usage") and response.usage.completion_tokens + response.usage.total_tokens:
            self.usage = response.usage

    def choices(self) -> list[dict]:
        out = []
        for i, text in enumerate(self.text):
            logprobs = None
            if self.want_logprobs:
                logprobs = _chat_logprobs(self.logprobs[i]) if self.chat else _completion_logprobs(self.logprobs[i], 0)
            choice = {"index": i, "logprobs": logprobs, "finish_reason": self.finish[i]}
            choice |= {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            out.append(choice)
        return out


def usage_json(usage: pb.Usage | None) -> dict:
    usage = usage or pb.Usage()
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


# ------------------------------------------------------------------ the server

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
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[self._request_id, self._errors, self._preflight, self._auth])
        app.on_response_prepare.append(self._cors)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # ---------------------------------------------------------------- middlewares

    @web.middleware
    async def _request_id(self, request: web.Request, handler):
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if not (request_id.isascii() and request_id.isprintable()):
            request[REQUEST_ID] = uuid.uuid4().hex
            response = HttpError(400, "X-Request-Id must be printable ASCII text", "X-Request-Id").response()
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
            return error.response()
        except web.HTTPRequestEntityTooLarge:
            return HttpError(413, f"request body too large: at most {MAX_BODY_BYTES} bytes").response()
        except web.HTTPException as error:
            if error.status < 400:
                raise
            response = HttpError(error.status, error.reason or "error").response()
            if "Allow" in error.headers:                # 405 says which methods there are
                response.headers["Allow"] = error.headers["Allow"]
            return response
        except ConnectionError:
            # The client went away while its body was read: nobody is left to answer.
            log.info("http client went away", extra={"request_id": request[REQUEST_ID]})
            return web.Response(status=400)
        except Exception:
            log.exception("http request failed", extra={"request_id": request[REQUEST_ID]})
            return HttpError(500, f"internal error (logged with request id {request[REQUEST_ID]})").response()

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
        text = await _body_text(request)
        try:
            body = json.loads(text, parse_int=_json_int)
        except json.JSONDecodeError as error:
            raise HttpError(400, f"the body is not valid JSON: {error}") from None
        except RecursionError:
            raise HttpError(400, "the body is not valid JSON here: it is nested too deeply") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body

    def _model_name(self, body: dict) -> str:
        return body.get("model") or self._served().names[0]

    def _served(self):
        try:
            return self.service.served_model()
        except ApiError as error:
            raise HttpError.from_api(error, {}) from None

    # ---------------------------------------------------------------- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            grpc_requests = generate_requests(body, chat=chat, request_id=request[REQUEST_ID])
            stream = _field(body, "stream", (bool,), False)
            include_usage = _field(_field(body, "stream_options", (dict,), {}), "include_usage",
                                   (bool,), False)
        except HttpError as error:      # refused before the service saw it: count it there
            self.service.reject("invalid", request[REQUEST_ID], error.message)
            raise
        renames = {"params.": "", "text": "prompt", "token_ids.ids": "prompt", "chat.messages": "messages",
                   "chat": "messages"}
        if chat:    # the gRPC fields that chat clients know by other names
            extra = {"params.logprobs": "top_logprobs"}
            if body.get("max_completion_tokens") is not None:
                extra["params.max_tokens"] = "max_completion_tokens"
            renames = extra | renames
        parent = tracing.extract(request.headers) if tracing.enabled() else None
        params = grpc_requests[0].params
        n = params.n if params.HasField("n") else 1
        streams = [self.service.stream(r, parent) for r in grpc_requests]
        # aclosing: when the client goes away (its handler is cancelled) the stream is closed at
        # once, which aborts the request on its worker or takes it out of the admission queue.
        async with contextlib.aclosing(streams[0] if len(streams) == 1 else _merged(streams, n)) as responses:
            try:
                first = await anext(responses)          # errors before any output become statuses
            except ApiError as error:
                raise HttpError.from_api(error, renames) from None
            except StopAsyncIteration:
                first = None
            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + request[REQUEST_ID],
                    "created": int(time.time()), "model": self._model_name(body)}
            want_logprobs = params.HasField("logprobs")
            n *= len(streams)
            if stream:
                return await self._sse(request, meta, _prepend(first, responses), chat=chat, n=n,
                                       want_logprobs=want_logprobs, include_usage=include_usage)
            acc = Accumulator(n, chat, want_logprobs)
            try:
                async for response in _prepend(first, responses):
                    acc.add(response)
            except ApiError as error:
                raise HttpError.from_api(error, renames) from None
        return web.json_response(meta | {"object": "chat.completion" if chat else "text_completion",
                                         "choices": acc.choices(), "usage": usage_json(acc.usage)})

    async def _sse(self, request: web.Request, meta: dict, responses: AsyncIterator[pb.GenerateResponse], *,
                   chat: bool, n: int, want_logprobs: bool, include_usage: bool) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          "X-Request-Id": request[REQUEST_ID]})
        await out.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict) -> None:
            await out.write(b"data: " + json.dumps(meta | {"object": obj} | payload).encode() + b"\n\n")

        if chat:
            await send({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None} for i in range(n)]})
        usage = None
        offsets = [0] * n
        try:
            async for response in responses:
                choices = []
                for c in response.choices:
                    logprobs = None
                    if want_logprobs and c.logprobs:
                        logprobs = _chat_logprobs(c.logprobs) if chat else _completion_logprobs(c.logprobs, offsets[c.index])
                    offsets[c.index] += len(c.text)
                    choice = {"index": c.index, "logprobs": logprobs, "finish_reason": FINISH.get(c.finish_reason)}
                    choice |= {"delta": {"content": c.text}} if chat else {"text": c.text}
                    if c.text or c.finish_reason or logprobs:
                        choices.append(choice)
                if choices:
                    await send({"choices": choices})
                if response.HasField("usage"):
                    usage = response.usage
        except ApiError as error:
            # Headers are gone: report the error in the stream, as OpenAI servers do.
            await out.write(b"data: " + json.dumps(HttpError.from_api(error, {}).json()).encode() + b"\n\n")
        except ConnectionResetError:
            return out      # the client went away: the caller closes the stream, which aborts it
        if include_usage:
            await send({"choices": [], "usage": usage_json(usage)})
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    # ---------------------------------------------------------------- the rest

    async def models(self, request: web.Request) -> web.Response:
        served = self._served()
        return web.json_response({"object": "list", "data": [_model_json(name, served) for name in served.names]})

    async def model(self, request: web.Request) -> web.Response:
        served, name = self._served(), request.match_info["model"]
        if name not in served.names:
            raise HttpError(404, f"model {name!r} is not served here; served: {', '.join(served.names)}",
                            "model", code="model_not_found")
        return web.json_response(_model_json(name, served))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokenize = pb.TokenizeRequest(model=_field(body, "model", (str,), ""))
        if "messages" in body:
            tokenize.chat.CopyFrom(chat_messages(body))
        else:
            tokenize.text = _field(body, "prompt", (str,), "")
        try:
            result = await self.service.tokenize(tokenize)
        except ApiError as error:
            raise HttpError.from_api(error, {"text": "prompt", "chat": "messages"}) from None
        served = self._served()
        return web.json_response({"tokens": list(result.token_ids), "count": result.count,
                                  "max_model_len": served.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = _int_list(_field(body, "tokens", (list,), []), "tokens")
        try:
            result = await self.service.detokenize(pb.DetokenizeRequest(
                model=_field(body, "model", (str,), ""), token_ids=tokens))
        except ApiError as error:
            raise HttpError.from_api(error, {"token_ids": "tokens"}) from None
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


def _model_json(name: str, served) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pagedserve",
            "max_model_len": served.max_model_len}


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
            arrivals.put_nowait((prompt, _naming_prompt(error, prompt)))
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


def _naming_prompt(error: ApiError, prompt: int) -> ApiError:
    """An error about one prompt of a batch, naming it as `prompt[i]`."""
    for field in ("text", "token_ids.ids"):
        if error.message.startswith(field):
            return ApiError(error.code, f"prompt[{prompt}]{error.message[len(field):]}", error.retry_after_s)
    return error


async def _prepend(first, rest: AsyncIterator):
    if first is not None:
        yield first
    async for item in rest:
        yield item
