"""The OpenAI HTTP protocol, apart from the HTTP server: request bodies parsed and checked into
the gRPC API's `GenerateRequest`s, responses rendered as OpenAI JSON, and the service's errors
turned into OpenAI error objects naming the field as the client sent it.

Nothing here knows aiohttp: `router.openai_api` reads bodies and writes responses with these.
Checks here are of shape and type (what JSON can get wrong); ranges are the gRPC API's rules,
checked once for both APIs by `router.requests`.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import struct_pb2

from common.convert import MAX_EXTRA_ARGS_DEPTH, json_depth
from common.pb import generation_pb2 as pb
from router.errors import ApiError, bounded
from router.requests import MAX_REQUEST_ID_LENGTH
from router.tool_calls import StreamedCalls, ToolCallError, ToolCalling, tool_calling

# A logit_bias key: a token id written as a decimal integer (ASCII digits: str.isdigit takes "²").
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's error types; 5xx are all "server_error". `code` is a string or null, as in OpenAI's
# schema (typed clients reject a number there).
ERROR_TYPE = {401: "authentication_error", 429: "rate_limit_error"}
ERROR_CODE = {401: "invalid_api_key"}
INT32 = (-2**31, 2**31 - 1)
FLOAT32_MAX = 3.4028234663852886e38      # the largest finite float32: the gRPC API's number fields
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}

# gRPC field paths (ApiError.field) as an HTTP client names them, by leading piece: the
# longest piece that leads a path wins ("chat.messages[0].role" -> "messages[0].role").
HTTP_NAMES = {"params.": "", "text": "prompt", "token_ids.ids": "prompt", "token_ids": "tokens",
              "chat.messages": "messages", "chat.continue_final_message": "continue_final_message",
              "chat.template_kwargs": "chat_template_kwargs", "chat": "messages"}
# ... and as a chat client names them: top_logprobs is what it asks for logprobs with.
CHAT_NAMES = HTTP_NAMES | {"params.logprobs": "top_logprobs"}


class HttpError(Exception):
    """An OpenAI error response: status, message and the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after_s: float | None = None, code: str | None = None):
        message = bounded(message)
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s
        self.code = code or ERROR_CODE.get(status)

    @classmethod
    def from_api(cls, error: ApiError, names: dict[str, str] = HTTP_NAMES) -> HttpError:
        """The service's error as the HTTP client sees it: its field (`error.field`, a gRPC
        path) named as in the client's request, in `param` and where the message starts with it."""
        message, param, code = error.message, None, None
        if error.field is not None:
            param = http_field(error.field, names)
            if message.startswith(error.field):
                message = param + message[len(error.field):]
        elif error.code == grpc.StatusCode.NOT_FOUND:     # else an unknown model
            param, code = "model", "model_not_found"
        return cls(HTTP_STATUS.get(error.code, 500), message, param, error.retry_after_s, code)

    def json(self) -> dict:
        kind = "server_error" if self.status >= 500 else ERROR_TYPE.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def http_field(path: str, names: dict[str, str]) -> str:
    """A gRPC field path renamed by the longest of `names` that leads it as a whole piece."""
    for piece in sorted(names, key=len, reverse=True):
        rest = path[len(piece):]
        if path.startswith(piece) and (piece.endswith(".") or rest[:1] in ("", ".", "[")):
            return names[piece] + rest
    return path


def names_for(body: dict, *, chat: bool) -> dict[str, str]:
    """How the client of this body names the gRPC fields."""
    names = CHAT_NAMES if chat else HTTP_NAMES
    if chat and body.get("max_completion_tokens") is not None:
        names = names | {"params.max_tokens": "max_completion_tokens"}
    if not chat and body.get("echo"):      # an echoed prompt's logprobs are what logprobs asked
        names = names | {"params.prompt_logprobs": "logprobs"}
    # The constraint, as the body gave it: a compile error names the field the client wrote.
    if isinstance(body.get("response_format"), dict):
        names = names | {"params.structured_output.json_schema": "response_format.json_schema.schema",
                         "params.structured_output": "response_format"}
    elif isinstance(constraints := body.get("structured_outputs"), dict):
        names = names | {f"params.structured_output.{kind}": f"structured_outputs.{name}"
                         for name, kind in STRUCTURED_KINDS.items() if name in constraints}
        names["params.structured_output"] = "structured_outputs"
    elif guided := [name for name in GUIDED_FIELDS if body.get(name) is not None]:
        names = names | {f"params.structured_output.{STRUCTURED_KINDS[GUIDED_FIELDS[guided[0]]]}": guided[0],
                         "params.structured_output": guided[0]}
    elif chat and body.get("tools") and body.get("tool_choice") not in (None, "auto", "none"):
        # A forced or required call's constraint is made of the tools' parameters.
        names = names | {"params.structured_output.json_schema": "tools", "params.structured_output": "tools"}
    return names


# ------------------------------------------------------------------ request parsing

def body_field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None,
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
            value = _as_float(value, name)
        else:
            _check_int(value, name, limits)
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        # The gRPC field is a float32, where it would become inf and be refused as "inf".
        raise HttpError(400, f"{name}={value:g} is out of range: the field holds a 32-bit float", name)
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


def int_list(values: list, name: str) -> list[int]:
    """An array of integers that fit the gRPC API's int32 fields (token ids)."""
    for i, value in enumerate(values):
        if not isinstance(value, int) or isinstance(value, bool):
            raise HttpError(400, f"{name} must be an array of integers", name)
        _check_int(value, f"{name}[{i}]")
    return values


def string_list(values: list, name: str) -> list[str]:
    """An array of strings."""
    if not all(isinstance(value, str) for value in values):
        raise HttpError(400, f"{name} must be an array of strings", name)
    return values


# Only an escape in the JSON text ("\\ud800") can put a UTF-16 surrogate in a string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_unicode(body: dict) -> None:
    """Refuses a lone UTF-16 surrogate in any string of the body, a key too, naming where it is:
    such a string is no Unicode text, and nothing past the parser could encode it. Walked with a
    stack, not recursion: the body may be nested as deeply as the parser allowed."""
    pending: list[tuple[str, object]] = [("<key>", key) for key in body] + list(body.items())
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise HttpError(400, f"{path} is not valid Unicode text: it holds a lone UTF-16 surrogate",
                                path) from None
        elif isinstance(value, dict):
            pending += [(f"{path}.<key>", key) for key in value]
            pending += [(f"{path}.{key}", item) for key, item in value.items()]
        elif isinstance(value, list):
            pending += [(f"{path}[{i}]", item) for i, item in enumerate(value)]



def parse_body(text: str) -> dict:
    """A request body: a JSON object."""
    try:
        body = json.loads(text, parse_int=_json_int)
    except json.JSONDecodeError as error:
        raise HttpError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise HttpError(400, "the body is not valid JSON here: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        _check_unicode(body)
    return body


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
    max_tokens = body_field(body, "max_tokens", (int,))
    completion_tokens = body_field(body, "max_completion_tokens", (int,)) if chat else None
    if completion_tokens is not None:
        # It wins, as in vLLM; a max_tokens beside it is still checked (the gRPC API's rule for a
        # chat), or a bad one would pass unseen.
        if max_tokens is not None and max_tokens < 1:
            raise HttpError(400, f"max_tokens must be an integer >= 1, got {max_tokens}", "max_tokens")
        max_tokens = completion_tokens
    if max_tokens == 0 and chat:
        field = "max_tokens" if completion_tokens is None else "max_completion_tokens"
        raise HttpError(400, f"{field} must be an integer >= 1, got 0", field)
    if max_tokens == 0 and (not body.get("echo") or body.get("n", 1) != 1):
        # The gRPC API's rule in this API's words: 0 scores a prompt, which here is echo.
        raise HttpError(400, "max_tokens must be an integer >= 1, or 0 to score a prompt (with echo=true "
                        "and n=1)", "max_tokens")
    if max_tokens is not None:
        p.max_tokens = max_tokens
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = body_field(body, name, (int, float))
        if value is not None:
            setattr(p, name, value)
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        setattr(p, name, body_field(body, name, (int, float), 0.0))
    for name in ("n", "top_k"):
        value = body_field(body, name, (int,))
        if value is not None:
            setattr(p, name, value)
    seed = body_field(body, "seed", (int,), limits=(0, 2**63 - 1))
    if seed is not None:
        p.seed = seed
    p.min_tokens = body_field(body, "min_tokens", (int,), 0)
    p.ignore_eos = body_field(body, "ignore_eos", (bool,), False)
    stop = body_field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HttpError(400, "stop must be a string or an array of strings", "stop")
    p.stop.extend(stop)
    p.stop_token_ids.extend(int_list(body_field(body, "stop_token_ids", (list,), []), "stop_token_ids"))
    if chat:
        if body_field(body, "logprobs", (bool,), False):
            p.logprobs = body_field(body, "top_logprobs", (int,), 0)
        elif body.get("top_logprobs") is not None:
            raise HttpError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    else:
        logprobs = body_field(body, "logprobs", (int,))
        if logprobs is not None:
            p.logprobs = logprobs
    best_of = body_field(body, "best_of", (int,))
    if best_of is not None and best_of != (p.n if p.HasField("n") else 1):
        raise HttpError(400, "best_of is not supported (it must equal n)", "best_of")
    if not chat and body_field(body, "echo", (bool,), False):
        # The echoed prompt carries its tokens' logprobs when logprobs are asked for. A prompt
        # echoed with max_tokens 0 is scored, not continued: that is what prompt_logprobs is
        # for on gRPC, so it gets them (top 0) even when only its text is shown.
        if p.HasField("logprobs") or (p.HasField("max_tokens") and p.max_tokens == 0):
            p.prompt_logprobs = p.logprobs
    for key, bias in body_field(body, "logit_bias", (dict,), {}).items():
        # JSON object keys are strings: OpenAI's are token ids written as integers.
        if not (_TOKEN_ID_KEY.fullmatch(key) and isinstance(bias, (int, float)) and not isinstance(bias, bool)):
            raise HttpError(400, "logit_bias must map token ids (as strings of digits) to numbers "
                            f"in [-100, 100]; got {json.dumps({key: bias})[:80]}", "logit_bias")
        token = int(key)
        _check_int(token, f"logit_bias[{key}]")
        p.logit_bias[token] = _as_float(bias, "logit_bias") if isinstance(bias, int) else bias
    allowed = body_field(body, "allowed_token_ids", (list,))
    if allowed == []:       # on gRPC an empty repeated field is unset: here it would allow nothing
        raise HttpError(400, "allowed_token_ids is empty: list at least one token id, or leave it out",
                        "allowed_token_ids")
    p.allowed_token_ids.extend(int_list(allowed or [], "allowed_token_ids"))
    p.bad_words.extend(string_list(body_field(body, "bad_words", (list,), []), "bad_words"))
    p.logits_processors.extend(string_list(body_field(body, "logits_processors", (list,), []),
                                           "logits_processors"))
    _fill_struct(p.extra_args, body, "vllm_xargs")       # vLLM's name for extra_args
    _refuse_unsupported(body, chat=chat)
    constraint = structured_output(body)
    if chat and (calling := tool_calls_of(body)) is not None and not calling.auto:
        if constraint is not None:
            raise HttpError(400, "a tool call and response_format / structured_outputs cannot both "
                            "constrain the output", "tool_choice")
        constraint = calling.constraint()
    if constraint is not None:
        p.structured_output.CopyFrom(constraint)
    return p


def tool_calls_of(body: dict) -> ToolCalling | None:
    """The tool calling of a chat body (router.tool_calls), as a 400 when malformed."""
    try:
        return tool_calling(body)
    except ToolCallError as error:
        raise HttpError(400, str(error), error.param) from None


# vLLM's `structured_outputs` kinds and the StructuredOutput field each becomes.
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


# vLLM's older fields for the same constraints (its releases before structured_outputs), which
# clients written for them still send: read as the structured_outputs kind each names, rather
# than ignored (a client would get free text where it asked for JSON).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_output(body: dict) -> pb.StructuredOutput | None:
    """The output constraint of a body: OpenAI's `response_format` (`json_object`, or
    `json_schema` with its `schema`), or vLLM's `structured_outputs` (one of `json`, a schema
    as an object or JSON text; `regex`; `choice`, a list of strings; `grammar`, Lark or GBNF;
    `json_object`: true), or its older `guided_*` fields. Whether it compiles is checked with
    the gRPC API's rules."""
    guided = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if guided:
        given = guided + (["structured_outputs"] if body.get("structured_outputs") is not None else [])
        if len(given) > 1:
            raise HttpError(400, f"give one of structured_outputs and the older {', '.join(GUIDED_FIELDS)}; "
                            f"this gives {' and '.join(given)}", guided[0])
        try:
            return structured_output({key: value for key, value in body.items() if key != guided[0]}
                                     | {"structured_outputs": {GUIDED_FIELDS[guided[0]]: body[guided[0]]}})
        except HttpError as error:     # named as the client named it
            if (error.param or "").startswith("structured_outputs"):
                error.param = guided[0]
            raise
    response_format = body_field(body, "response_format", (dict,), {})
    kind = response_format.get("type", "text")
    # Absent or null is no constraint; an object sent must set one (`{}` too, as in vLLM).
    constraints = body_field(body, "structured_outputs", (dict,))
    if kind != "text" and constraints is not None:
        raise HttpError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise HttpError(400, "response_format.json_schema.schema must be an object: the JSON "
                            "Schema the output follows", "response_format.json_schema.schema")
        return pb.StructuredOutput(json_schema=json.dumps(schema))
    if kind != "text":
        raise HttpError(400, f"response_format type {json.dumps(kind)[:40]} is not supported: use "
                        "text, json_object or json_schema", "response_format.type")
    if constraints is None:
        return None
    given = [name for name in constraints if constraints[name] not in (None, False)]
    unknown = [name for name in given if name not in STRUCTURED_KINDS]
    if unknown or len(given) != 1:
        raise HttpError(400, f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}"
                        f"; it sets {', '.join(given) or 'none'}", "structured_outputs")
    name = given[0]
    value, param = constraints[name], f"structured_outputs.{name}"
    if name == "json_object":
        if value is not True:
            raise HttpError(400, f"{param} must be true (or false, or left out, for no constraint)", param)
        return pb.StructuredOutput(json_object=True)
    if name == "json" and isinstance(value, dict):
        value = json.dumps(value)
    if name == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise HttpError(400, f"{param} must be a non-empty array of strings", param)
        return pb.StructuredOutput(choice=pb.Choices(values=value))
    if not isinstance(value, str):
        raise HttpError(400, f"{param} must be a string" + (" or an object" if name == "json" else ""), param)
    return pb.StructuredOutput(**{STRUCTURED_KINDS[name]: value})


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    """OpenAI features this server does not have are refused, not silently ignored: a client
    asking for JSON output or tool calls would otherwise get plain text it cannot use."""
    if not chat:
        if body_field(body, "suffix", (str,)):
            raise HttpError(400, "suffix is not supported", "suffix")
        return
    # vLLM's chat extensions that would change what the model is shown.
    if body_field(body, "chat_template", (str,)):
        raise HttpError(400, "chat_template is not supported: every chat is rendered with the served model's "
                        "own template", "chat_template")


def tokenize_request(body: dict) -> pb.TokenizeRequest:
    """`POST /tokenize` (vLLM's): a text (`prompt`) or a chat (`messages`), the chat rendered as
    a chat completion would render it: with `tools` shown to the template, and the assistant
    turn's opening unless `add_generation_prompt` is false."""
    tokenize = pb.TokenizeRequest(model=body_field(body, "model", (str,), ""))
    given = [name for name in ("prompt", "messages") if body.get(name) is not None]
    if len(given) != 1:
        raise HttpError(400, "give one of prompt (a text) and messages (a chat) to tokenize, "
                             f"not {' and '.join(given) or 'neither'}", "prompt")
    if given == ["prompt"]:
        for name in ("add_generation_prompt", "tools", "continue_final_message", "chat_template_kwargs"):
            if body.get(name) is not None:
                raise HttpError(400, f"{name} applies to messages, not to a prompt", name)
        tokenize.text = body_field(body, "prompt", (str,))
        return tokenize
    tokenize.chat.CopyFrom(chat_messages(body))
    if (calling := tool_calls_of(body)) is not None:
        tokenize.chat.tools.extend(calling.tools)
    return tokenize


MAX_PROMPTS = 256     # prompts in one completions request (each is admitted as one request)
# An X-Request-Id's length: each prompt of a batch is a request named "<id>-<index>", and the
# gRPC API allows MAX_REQUEST_ID_LENGTH.
MAX_HEADER_REQUEST_ID_LENGTH = MAX_REQUEST_ID_LENGTH - len(f"-{MAX_PROMPTS - 1}")


def generate_requests(body: dict, *, chat: bool, request_id: str) -> list[pb.GenerateRequest]:
    """The gRPC requests of one HTTP request: one, or one per prompt of a completions batch
    (ids `<request_id>-<i>`)."""
    body_field(body, "user", (str,))       # accepted for OpenAI clients; type-checked, unused
    request = pb.GenerateRequest(model=body_field(body, "model", (str,), ""), request_id=request_id,
                                 params=sampling_parameters(body, chat=chat),
                                 priority=body_field(body, "priority", (int,), 0),
                                 include_stop_str_in_output=body_field(body, "include_stop_str_in_output", (bool,), False))
    skip = body_field(body, "skip_special_tokens", (bool,))
    if skip is not None:
        request.skip_special_tokens = skip
    if chat:
        request.chat.CopyFrom(chat_messages(body))
        if (calling := tool_calls_of(body)) is not None:
            request.chat.tools.extend(calling.tools)
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
        if not isinstance(one, str):
            int_list(one, name)
    return batch


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(body: dict) -> pb.ChatMessages:
    messages = body_field(body, "messages", (list,))
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
        calls = _history_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls")
        if isinstance(content, list):          # content parts: only text is understood
            if any(not isinstance(part, dict) or part.get("type") != "text"
                   or not isinstance(part.get("text"), str) for part in content):
                raise HttpError(400, f"{name}: only text parts ({{\"type\": \"text\", \"text\": "
                                "string}) are supported", name)
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise HttpError(400, f"{name} must be a string or an array of text parts", name)
        call_id = m.get("tool_call_id") or ""
        if not isinstance(call_id, str):
            raise HttpError(400, f"messages[{i}].tool_call_id must be a string", f"messages[{i}].tool_call_id")
        chat.messages.add(role=m["role"], content=content, tool_calls=calls, tool_call_id=call_id)
    # vLLM's rendering fields: checked against each other and the template's own names by the
    # gRPC API's rules (router.requests), which name them as sent.
    chat.add_generation_prompt = body_field(body, "add_generation_prompt", (bool,), True)
    chat.continue_final_message = body_field(body, "continue_final_message", (bool,), False)
    _fill_struct(chat.template_kwargs, body, "chat_template_kwargs")
    return chat


def _fill_struct(struct: struct_pb2.Struct, body: dict, name: str) -> None:
    """body[name], a JSON object, into a `google.protobuf.Struct` field; too deep a nesting or an
    integer past a Struct's float64 numbers is a 400 naming the field."""
    value = body_field(body, name, (dict,))
    if value is None:
        return
    if json_depth(value) > MAX_EXTRA_ARGS_DEPTH:
        raise HttpError(400, f"{name} nests objects and lists more than {MAX_EXTRA_ARGS_DEPTH} deep", name)
    try:
        struct.update(value)
    except OverflowError:
        raise HttpError(400, f"{name} holds an integer too large for a JSON number (a float64)", name) from None


def _history_tool_calls(calls, name: str) -> list[pb.ToolCall]:
    """An assistant turn's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments"}}], arguments as JSON text (as OpenAI sends them)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise HttpError(400, f"{name} must be an array", name)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str) and isinstance(call.get("id", ""), str)):
            raise HttpError(400, f"{name}[{j}] must be {{\"id\": string, \"type\": \"function\", "
                            "\"function\": {\"name\": string, \"arguments\": JSON text}}", f"{name}[{j}]")
        out.append(pb.ToolCall(id=call.get("id", ""), name=function["name"],
                               arguments=function.get("arguments", "")))
    return out


# ------------------------------------------------------------------ responses

def _completion_logprobs(entries, text_offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry.sampled.text)
        known = entry.sampled.HasField("logprob")      # not the first token of an echoed prompt
        token_logprobs.append(entry.sampled.logprob if known else None)
        # OpenAI lists the sampled token among the top ones even when it ranks lower.
        top.append(_top_by_text([*entry.top, entry.sampled]) if known else None)
        offsets.append(text_offset)
        text_offset += len(entry.sampled.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _top_by_text(logprobs) -> dict[str, float]:
    """Top logprobs keyed by text, as the legacy completions API has them: two tokens can
    decode to the same text (two parts of multi-byte characters are both U+FFFD), so a later
    one keeps its entry under its bytes written out ("\\xe2\\x80"), then under its id."""
    out: dict[str, float] = {}
    for lp in logprobs:
        for key in (lp.text, "".join(f"\\x{b:02x}" for b in lp.token_bytes), f"<token {lp.token_id}>"):
            if key and out.get(key, lp.logprob) == lp.logprob:
                out[key] = lp.logprob
                break
    return out


def _chat_logprobs(entries) -> dict:
    def one(lp):
        return {"token": lp.text, "logprob": lp.logprob,
                "bytes": list(lp.token_bytes or lp.text.encode())}
    return {"content": [one(e.sampled) | {"top_logprobs": [one(t) for t in e.top]} for e in entries]}


class Accumulator:
    """Collects the stream of one request into whole choices (non-streaming responses)."""

    def __init__(self, n: int, chat: bool, want_logprobs: bool, calling: ToolCalling | None = None,
                 token_ids: bool = False):
        """`token_ids`: each choice carries its output's token ids too (vLLM's `return_token_ids`)."""
        self.chat, self.want_logprobs, self.calling, self.want_token_ids = chat, want_logprobs, calling, token_ids
        self.text = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.usage: pb.Usage | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        for c in response.choices:
            self.text[c.index] += c.text
            self.token_ids[c.index].extend(c.token_ids)
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
            content, calls = self.calling.split(text) if self.calling is not None else (text, [])
            if calls:
                choice |= {"message": {"role": "assistant", "content": content, "tool_calls": calls},
                           "finish_reason": "tool_calls" if self.finish[i] == "stop" else self.finish[i]}
            elif self.chat:
                choice |= {"message": {"role": "assistant", "content": text}}
            else:
                choice |= {"text": text}
            if self.want_token_ids:
                choice["token_ids"] = self.token_ids[i]
            out.append(choice)
        return out


def usage_json(usage: pb.Usage | None) -> dict:
    usage = usage or pb.Usage()
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}



def model_json(name: str, max_model_len: int, parent: str | None = None, root: str | None = None) -> dict:
    """A /v1/models entry; a LoRA adapter has its base model as `parent` and its path as `root`,
    as vLLM lists them."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "pagedserve",
            "root": root or name, "parent": parent, "max_model_len": max_model_len}


def response_meta(request_id: str, model: str, *, chat: bool) -> dict:
    """The fields every response and chunk of one request shares."""
    return {"id": ("chatcmpl-" if chat else "cmpl-") + request_id, "created": int(time.time()),
            "model": model}


def completion_json(meta: dict, acc: Accumulator) -> dict:
    return meta | {"object": "chat.completion" if acc.chat else "text_completion",
                   "choices": acc.choices(), "usage": usage_json(acc.usage)}


def role_chunk(n: int) -> dict:
    """A chat stream's first chunk: each choice's assistant role, before any content."""
    return {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None} for i in range(n)]}


def chunk_choices(response: pb.GenerateResponse, *, chat: bool, want_logprobs: bool,
                  offsets: list[int], calls: StreamedCalls | None = None, token_ids: bool = False) -> list[dict]:
    """A stream chunk's choices from one response: those with text, an end or logprobs.
    `offsets` (text streamed so far, per choice) advances: completions' logprobs count from it.
    `calls`: the text is tool calls (router.tool_calls), sent as tool-call deltas. `token_ids`:
    each choice carries its new tokens' ids too, and one with tokens but no text is sent."""
    choices = []
    for c in response.choices:
        ids = {"token_ids": list(c.token_ids)} if token_ids else {}
        logprobs = None
        if want_logprobs and c.logprobs:
            logprobs = _chat_logprobs(c.logprobs) if chat else _completion_logprobs(c.logprobs, offsets[c.index])
        offsets[c.index] += len(c.text)
        finish = FINISH.get(c.finish_reason)
        choice = {"index": c.index, "logprobs": logprobs, "finish_reason": finish} | ids
        if calls is not None:
            delta = calls.delta(c.index, c.text, finished=bool(c.finish_reason))
            if finish == "stop" and calls.call_made(c.index):
                choice["finish_reason"] = "tool_calls"
            choice["delta"] = delta or {}
            if delta or c.finish_reason or logprobs or ids.get("token_ids"):
                choices.append(choice)
            continue
        choice |= {"delta": {"content": c.text}} if chat else {"text": c.text}
        if c.text or c.finish_reason or logprobs or ids.get("token_ids"):
            choices.append(choice)
    return choices


async def echoed(responses: AsyncIterator[pb.GenerateResponse], prompt_text: Callable[[], Awaitable[str]],
                 n: int, with_logprobs: bool) -> AsyncIterator[pb.GenerateResponse]:
    """One prompt's completion stream with the prompt echoed (OpenAI's `echo`): each of its `n`
    choices starts with the prompt's text and, `with_logprobs`, its tokens' logprobs (the
    stream's prompt_logprobs; the first token's are null). Those all arrive before choice 0's
    first token, but another choice may come sooner: what comes is held until the echo is out.
    Closing it closes `responses` (which aborts the request)."""
    async with contextlib.aclosing(responses):
        first = await anext(responses)      # admitted, or the request's error before any output
        yield first
        text = await prompt_text()
        entries, held = [], []
        if with_logprobs:
            async for response in responses:
                entries.extend(response.prompt_logprobs)
                response.ClearField("prompt_logprobs")
                if response.choices or response.HasField("usage"):
                    held.append(response)
                if len(entries) == first.usage.prompt_tokens:
                    break
        yield pb.GenerateResponse(request_id=first.request_id, choices=[
            pb.ChoiceDelta(index=i, text=text, logprobs=entries) for i in range(n)])
        for response in held:
            yield response
        async for response in responses:
            yield response


def naming_prompt(error: ApiError, prompt: int) -> ApiError:
    """An error about one prompt of a completions batch, naming it as `prompt[i]`."""
    field = error.field or ""
    for piece in ("token_ids.ids", "text"):
        if field == piece or field.startswith(piece + "["):
            path = f"prompt[{prompt}]{field[len(piece):]}"
            message = error.message
            if message.startswith(field):
                message = path + message[len(field):]
            return ApiError(error.code, message, error.retry_after_s, field=path)
    return error
