"""Public requests checked and turned into what the router dispatches.

Every check raises ApiError with a message that names the field and says what is allowed, so a
client can fix its request without reading the server's logs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import grpc

from common import structured_output
from common.convert import sampling_params_from_proto, struct_to_dict
from common.pb import generation_pb2 as pb
from common.sampling_params import InvalidRequest, SamplingParams, choice_seed
from router.admission import reservation_tokens
from router.errors import ApiError, invalid_argument
from router.tokenizer import ChatTemplateError, RouterTokenizer

MAX_REQUEST_ID_LENGTH = 256
# Output tokens a request that set no max_tokens reserves (see PreparedRequest.reserved_tokens).
UNSET_MAX_TOKENS_RESERVATION = 1024


@dataclass(frozen=True)
class ServedModel:
    """The model as the router serves it: its names and the limits requests are checked against."""

    names: tuple[str, ...]  # the first is the default
    max_model_len: int
    vocab_size: int
    tokenizer: RouterTokenizer | None   # None: token ids only (see router.fleet.ModelSpec)
    lora_adapters: frozenset[str] = frozenset()   # LoRA adapters, each a model name of its own
    logits_processors: frozenset[str] = frozenset()   # selectable by name on every worker
    lora_unloading: frozenset[str] = frozenset()  # adapters being unloaded (no longer served)

    def check_name(self, model: str) -> None:
        """Empty means the default; any other name must be served (NOT_FOUND otherwise)."""
        if model in self.lora_unloading:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {model!r} is being unloaded")
        if model and model not in self.names and model not in self.lora_adapters:
            raise ApiError(grpc.StatusCode.NOT_FOUND,
                           f"model {model!r} is not served here; served: "
                           f"{', '.join([*self.names, *sorted(self.lora_adapters)])}")

    def lora_name(self, model: str, lora_name: str = "") -> str:
        """The LoRA adapter a request selects, by its dedicated field or by `model` (as OpenAI
        clients name a fine-tune); "" for the base model. NOT_FOUND for an unknown adapter."""
        if lora_name in self.lora_unloading:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {lora_name!r} is being unloaded",
                           field="lora_name")
        if lora_name and lora_name not in self.lora_adapters:
            raise ApiError(grpc.StatusCode.NOT_FOUND,
                           f"LoRA adapter {lora_name!r} is not loaded; loaded: "
                           f"{', '.join(sorted(self.lora_adapters)) or 'none'}", field="lora_name")
        if lora_name and model and model not in self.names and model != lora_name:
            raise invalid_argument(f"model {model!r} and lora_name {lora_name!r} disagree: name the "
                                   f"adapter in one of them, or the base model in `model`", "lora_name")
        return lora_name or (model if model in self.lora_adapters and model not in self.names else "")


@dataclass(frozen=True)
class PreparedRequest:
    """A validated Generate request, ready to be admitted and dispatched."""

    request_id: str
    prompt_token_ids: list[int]
    # Validated, `seed` always set and `max_tokens` resolved: prompt + max_tokens <= max_model_len.
    params: SamplingParams
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int
    # The client's, minus n and stop, with max_tokens resolved (see submit_params).
    worker_params: pb.SamplingParameters
    max_tokens_set: bool = True     # by the client; else the default (see reserved_tokens)
    lora_name: str = ""             # the LoRA adapter it runs under ("": the base model)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def reserved_tokens(self) -> int:
        """prompt + max_tokens per choice. A chat that set no max_tokens may run to the end of
        the context, but reserving all of it would let a pool hold only a handful of such
        chats: it reserves UNSET_MAX_TOKENS_RESERVATION output tokens, and the worker preempts
        if it outgrows them, as under --overcommit."""
        output = (self.params.max_tokens if self.max_tokens_set
                  else min(self.params.max_tokens, UNSET_MAX_TOKENS_RESERVATION))
        return reservation_tokens(len(self.prompt_token_ids), output, self.n)

    def submit_params(self, choice: int, prompt_logprobs: bool = True) -> pb.SamplingParameters:
        """What a worker gets for one choice: n left unset (one sequence per Submit), stop strings
        left out (the router applies them) and the choice's own seed. Prompt logprobs are the
        request's, asked of choice 0 only, and not again once `prompt_logprobs` is False (all
        received)."""
        params = pb.SamplingParameters()
        params.CopyFrom(self.worker_params)
        params.seed = choice_seed(self.params.seed, choice)
        if choice or not prompt_logprobs:
            params.ClearField("prompt_logprobs")
        return params


def request_id_problem(request_id: str) -> str | None:
    """Why a client's request id is refused, or None when it is fine."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        return (f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_LENGTH} "
                "are allowed")
    if not request_id.isprintable():
        return "request_id must be printable text: it holds a control character (such as a newline)"
    return None


def loggable_request_id(request_id: str) -> str:
    """The id as logs may show it: one that validation will refuse (too long, or with control
    characters that would forge log lines) is shown escaped and cut short."""
    if request_id_problem(request_id) is None:
        return request_id
    return repr(request_id[:64]) + ("..." if len(request_id) > 64 else "")


def prepare_generate(request: pb.GenerateRequest, model: ServedModel) -> PreparedRequest:
    """Checks a Generate request and tokenizes its prompt; raises ApiError."""
    model.check_name(request.model)
    lora_name = model.lora_name(request.model, request.lora_name)
    if problem := request_id_problem(request.request_id):
        raise invalid_argument(problem, "request_id")
    for i, stop in enumerate(request.params.stop):
        if not stop:
            raise invalid_argument(f"params.stop[{i}] is empty: a stop string needs at least one "
                                   "character", f"params.stop[{i}]")
    for i, name in enumerate(request.params.logits_processors):
        if name not in model.logits_processors:
            raise invalid_argument(f"logits_processors[{i}]: {name!r} is not loaded on the workers (loaded: "
                                   f"{', '.join(sorted(model.logits_processors)) or 'none'}; a worker loads "
                                   "them with --logits-processors)", "logits_processors")
    if request.params.stop and model.tokenizer is None:
        raise invalid_argument(f"params.stop: the model {model.names[0]} is served without a "
                               "tokenizer, so there is no text to match stop strings in; use "
                               "stop_token_ids", "params.stop")
    prompt = encode_prompt(request, model)
    _check_prompt_length(request, prompt, model)
    params = _sampling_params(request, len(prompt), model)
    if params.seed is None:
        # Drawn here, not on the worker, so a choice re-dispatched elsewhere continues the same.
        params.seed = random.getrandbits(63)
    submit = pb.SamplingParameters()
    submit.CopyFrom(request.params)
    submit.ClearField("n")
    submit.ClearField("stop")
    submit.max_tokens = params.max_tokens   # resolved here: a worker's own default is 16
    return PreparedRequest(
        max_tokens_set=request.params.HasField("max_tokens"),
        request_id=request.request_id,     # GenerationService.stream drew one if it was empty
        prompt_token_ids=prompt, params=params,
        stop=tuple(request.params.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=(request.skip_special_tokens
                             if request.HasField("skip_special_tokens") else True),
        priority=request.priority, worker_params=submit, lora_name=lora_name)


def encode_prompt(request: pb.GenerateRequest | pb.TokenizeRequest,
                  model: ServedModel) -> list[int]:
    """The prompt of a Generate or Tokenize request as token ids: text tokenized, a chat
    rendered and tokenized, token ids checked against the vocabulary."""
    which = request.WhichOneof("input")
    if which is None:
        options = "text, token_ids or chat" if hasattr(request, "token_ids") else "text or chat"
        raise invalid_argument(f"input is missing: set one of {options}")
    if which != "token_ids" and model.tokenizer is None:
        raise invalid_argument(f"{which}: the model {model.names[0]} is served without a "
                               "tokenizer, so prompts must be token_ids", which)
    if which == "text":
        return model.tokenizer.encode_text(request.text)
    if which == "chat":
        return _chat_token_ids(request.chat, model.tokenizer)
    ids = list(request.token_ids.ids)
    for position, token_id in enumerate(ids):
        if not 0 <= token_id < model.vocab_size:
            raise invalid_argument(f"token_ids.ids[{position}]={token_id} is out of range: "
                                   f"token ids must be in [0, {model.vocab_size})",
                                   f"token_ids.ids[{position}]")
    return ids


def _check_prompt_length(request: pb.GenerateRequest, ids: list[int], model: ServedModel) -> None:
    """A prompt needs a token, and room in max_model_len for at least one generated token."""
    field = {"text": "text", "token_ids": "token_ids.ids", "chat": "chat"}[
        request.WhichOneof("input")]
    if not ids:
        raise invalid_argument(f"{field} is empty: the prompt needs at least one token", field)
    if len(ids) >= model.max_model_len:
        raise invalid_argument(
            f"{field}: the prompt has {len(ids)} tokens; at most {model.max_model_len - 1} are "
            f"allowed (max_model_len={model.max_model_len}, minus one token to generate)", field)


def _sampling_params(request: pb.GenerateRequest, prompt_tokens: int,
                     model: ServedModel) -> SamplingParams:
    """The request's sampling parameters, validated, with max_tokens resolved. A max_tokens the
    client set must fit in max_model_len together with the prompt; an unset one is, for a chat,
    the rest of the context (as in vLLM's chat API), and for text or token ids OpenAI's
    completions default of 16, cut to what the context leaves."""
    room = model.max_model_len - prompt_tokens
    try:
        params = sampling_params_from_proto(request.params)
        if not request.params.HasField("max_tokens"):
            chat = request.WhichOneof("input") == "chat"
            params.max_tokens = room if chat else min(params.max_tokens, room)
        params.validate(model.vocab_size)
    except InvalidRequest as error:
        raise invalid_argument(f"params.{error}", f"params.{error.field}") from None
    if params.max_tokens > room:
        raise invalid_argument(_context_exceeded(request, prompt_tokens, params.max_tokens, model),
                               "params.max_tokens")
    if params.bad_words and model.tokenizer is None:
        raise invalid_argument(f"params.bad_words: the model {model.names[0]} is served without a "
                               "tokenizer, so there are no words to ban", "params.bad_words")
    if params.structured_output is not None:
        if model.tokenizer is None:
            raise invalid_argument(f"params.structured_output: the model {model.names[0]} is served "
                                   "without a tokenizer, so there is no text to constrain",
                                   "params.structured_output")
        if (why := structured_output.problem(params.structured_output)) is not None:
            field = f"params.structured_output.{params.structured_output.kind}"
            raise invalid_argument(f"{field} does not compile: {why}", field)
    return params


def _context_exceeded(request: pb.GenerateRequest, prompt_tokens: int, max_tokens: int,
                      model: ServedModel) -> str:
    """Why max_tokens does not fit, in vLLM's words: clients such as LiteLLM recognise a context
    overflow by "This model's maximum context length is"."""
    prompt = "messages" if request.WhichOneof("input") == "chat" else "prompt"
    return (f"params.max_tokens={max_tokens} is too large. This model's maximum context length is "
            f"{model.max_model_len} tokens. However, you requested {prompt_tokens + max_tokens} "
            f"tokens ({prompt_tokens} in the {prompt}, {max_tokens} in the completion). Please "
            f"reduce the length of the {prompt} or completion.")


def _template_message(message: pb.ChatMessage) -> dict:
    """A message as chat templates read it (transformers' convention): tool calls with their
    arguments as a mapping where they are JSON (templates iterate or `tojson` them)."""
    out = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _json_or_text(c.arguments)}} for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_tool(tool: pb.ChatTool, position: int) -> dict:
    """A tool as chat templates take it (OpenAI's form, parameters as a mapping)."""
    if not tool.name:
        raise invalid_argument(f"chat.tools[{position}].name is empty", f"chat.tools[{position}].name")
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        try:
            function["parameters"] = json.loads(tool.parameters_json)
        except ValueError:
            raise invalid_argument(f"chat.tools[{position}].parameters_json is not JSON",
                                   f"chat.tools[{position}].parameters_json") from None
        except RecursionError:
            raise invalid_argument(f"chat.tools[{position}].parameters_json is nested too deeply to read",
                                   f"chat.tools[{position}].parameters_json") from None
    return {"type": "function", "function": function}


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):       # not JSON, or nested past what Python reads
        return text


# Template variables (and apply_chat_template's own arguments) a request's template_kwargs may
# not set: the renderer sets them from the request's own fields.
RENDERER_VARIABLES = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "tokenize", "chat_template", "return_dict",
                                "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                                "return_assistant_tokens_mask"})


def _chat_token_ids(chat: pb.ChatMessages, tokenizer: RouterTokenizer) -> list[int]:
    if not chat.messages:
        raise invalid_argument("chat.messages is empty: give at least one message", "chat.messages")
    for position, message in enumerate(chat.messages):
        if not message.role:
            raise invalid_argument(f"chat.messages[{position}].role is empty: use for example "
                                   "\"system\", \"user\" or \"assistant\"",
                                   f"chat.messages[{position}].role")
    add_generation_prompt = (chat.add_generation_prompt
                             if chat.HasField("add_generation_prompt") else True)
    if chat.continue_final_message and add_generation_prompt:
        raise invalid_argument("chat.continue_final_message continues the last message, so it needs "
                               "add_generation_prompt false (which opens a new turn)", "chat.continue_final_message")
    if chat.continue_final_message and chat.messages[-1].role != "assistant":
        raise invalid_argument(f"chat.continue_final_message continues an assistant turn, but the last message's "
                               f"role is {chat.messages[-1].role!r}", "chat.continue_final_message")
    try:
        template_kwargs = struct_to_dict(chat.template_kwargs, "chat.template_kwargs")
    except InvalidRequest as error:
        raise invalid_argument(str(error), error.field) from None
    if reserved := sorted(RENDERER_VARIABLES & template_kwargs.keys()):
        raise invalid_argument(f"chat.template_kwargs sets {', '.join(reserved)}, which the renderer sets itself "
                               f"(give them as their own fields)", "chat.template_kwargs")
    try:
        return tokenizer.encode_chat([_template_message(m) for m in chat.messages], add_generation_prompt,
                                     [_template_tool(t, i) for i, t in enumerate(chat.tools)] or None,
                                     chat.continue_final_message, template_kwargs)
    except ChatTemplateError as error:
        raise invalid_argument(f"chat: {error}", "chat") from None
