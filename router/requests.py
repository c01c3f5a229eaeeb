"""Public requests checked and turned into what the router dispatches.

Every check raises ApiError with a message that names the field and says what is allowed, so a
client can fix its request without reading the server's logs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

from common.convert import sampling_params_from_proto
from common.pb import generation_pb2 as pb
from router.admission import reservation_tokens
from router.errors import ApiError, invalid_argument
from router.tokenizer import ChatTemplateError, RouterTokenizer
from worker.sampling_params import InvalidRequest, SamplingParams, choice_seed

MAX_REQUEST_ID_LENGTH = 256


@dataclass(frozen=True)
class ServedModel:
    """The model as the router serves it: its names and the limits requests are checked against."""

    names: tuple[str, ...]  # the first is the default
    max_model_len: int
    vocab_size: int
    tokenizer: RouterTokenizer | None   # None: token ids only (see router.fleet.ModelSpec)

    def check_name(self, model: str) -> None:
        """Empty means the default; any other name must be served (NOT_FOUND otherwise)."""
        if model and model not in self.names:
            raise ApiError(grpc.StatusCode.NOT_FOUND,
                           f"model {model!r} is not served here; served: {', '.join(self.names)}")


@dataclass(frozen=True)
class PreparedRequest:
    """A validated Generate request, ready to be admitted and dispatched."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams       # validated; `seed` is always set
    max_new_tokens: int          # max_tokens, capped by what max_model_len leaves
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int
    worker_params: pb.SamplingParameters  # the client's, minus n and stop (see submit_params)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def reserved_tokens(self) -> int:
        return reservation_tokens(len(self.prompt_token_ids), self.max_new_tokens, self.n)

    def submit_params(self, choice: int) -> pb.SamplingParameters:
        """What a worker gets for one choice: n left unset (one sequence per Submit), stop strings
        left out (the router applies them) and the choice's own seed."""
        params = pb.SamplingParameters()
        params.CopyFrom(self.worker_params)
        params.seed = choice_seed(self.params.seed, choice)
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
    if problem := request_id_problem(request.request_id):
        raise invalid_argument(problem)
    try:
        params = sampling_params_from_proto(request.params).validate(model.vocab_size)
    except InvalidRequest as error:
        raise invalid_argument(f"params.{error}") from None
    for i, stop in enumerate(request.params.stop):
        if not stop:
            raise invalid_argument(f"params.stop[{i}] is empty: a stop string needs at least one "
                                   "character")
    if request.params.stop and model.tokenizer is None:
        raise invalid_argument(f"params.stop: the model {model.names[0]} is served without a "
                               "tokenizer, so there is no text to match stop strings in; use "
                               "stop_token_ids")
    prompt = encode_prompt(request, model)
    _check_prompt_length(request, prompt, model)
    if params.seed is None:
        # Drawn here, not on the worker, so a choice re-dispatched elsewhere continues the same.
        params.seed = random.getrandbits(63)
    submit = pb.SamplingParameters()
    submit.CopyFrom(request.params)
    submit.ClearField("n")
    submit.ClearField("stop")
    return PreparedRequest(
        request_id=request.request_id,     # GenerationService.stream drew one if it was empty
        prompt_token_ids=prompt, params=params,
        max_new_tokens=min(params.max_tokens, model.max_model_len - len(prompt)),
        stop=tuple(request.params.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=(request.skip_special_tokens
                             if request.HasField("skip_special_tokens") else True),
        priority=request.priority, worker_params=submit)


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
                               "tokenizer, so prompts must be token_ids")
    if which == "text":
        return model.tokenizer.encode_text(request.text)
    if which == "chat":
        return _chat_token_ids(request.chat, model.tokenizer)
    ids = list(request.token_ids.ids)
    for position, token_id in enumerate(ids):
        if not 0 <= token_id < model.vocab_size:
            raise invalid_argument(f"token_ids.ids[{position}]={token_id} is out of range: "
                                   f"token ids must be in [0, {model.vocab_size})")
    return ids


def _check_prompt_length(request: pb.GenerateRequest, ids: list[int], model: ServedModel) -> None:
    """A prompt needs a token, and room in max_model_len for at least one generated token."""
    field = {"text": "text", "token_ids": "token_ids.ids", "chat": "chat"}[
        request.WhichOneof("input")]
    if not ids:
        raise invalid_argument(f"{field} is empty: the prompt needs at least one token")
    if len(ids) >= model.max_model_len:
        raise invalid_argument(
            f"{field}: the prompt has {len(ids)} tokens; at most {model.max_model_len - 1} are "
            f"allowed (max_model_len={model.max_model_len}, minus one token to generate)")


def _chat_token_ids(chat: pb.ChatMessages, tokenizer: RouterTokenizer) -> list[int]:
    if not chat.messages:
        raise invalid_argument("chat.messages is empty: give at least one message")
    for position, message in enumerate(chat.messages):
        if not message.role:
            raise invalid_argument(f"chat.messages[{position}].role is empty: use for example "
                                   "\"system\", \"user\" or \"assistant\"")
    add_generation_prompt = (chat.add_generation_prompt
                             if chat.HasField("add_generation_prompt") else True)
    try:
        return tokenizer.encode_chat([{"role": m.role, "content": m.content}
                                      for m in chat.messages], add_generation_prompt)
    except ChatTemplateError as error:
        raise invalid_argument(f"chat: {error}") from None
