"""router.openai_protocol: OpenAI bodies parsed into gRPC requests, errors named as the client
sent them. Each body goes where the HTTP API sends it (parse, then the service's validation of
the gRPC request); the HTTP server itself is specified in test_http_api.py."""

from __future__ import annotations

import asyncio
import copy
import json

import grpc
import pytest

from common.pb import generation_pb2 as pb
from router.errors import ApiError
from router.openai_protocol import (
    HttpError, chunk_choices, echoed, generate_requests, http_field, names_for, naming_prompt, parse_body,
    tokenize_request)
from router.requests import ServedModel, prepare_generate
from router.tokenizer import RouterTokenizer

PROMPT = "The capital of France is"
MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(smollm_tokenizer) -> ServedModel:
    return ServedModel((MODEL,), 2048, vocab_size=49152, tokenizer=RouterTokenizer(smollm_tokenizer))


def refusal(body: dict, served: ServedModel, *, chat: bool = False) -> dict:
    """The OpenAI error object the HTTP API answers `body` with (the test fails if it is
    accepted), plus its HTTP status."""
    try:
        requests = generate_requests(body, chat=chat, request_id="r")
        for i, request in enumerate(requests):
            try:
                prepare_generate(request, served)
            except ApiError as error:
                raise naming_prompt(error, i) if len(requests) > 1 else error
    except HttpError as error:
        return error.json()["error"] | {"status": error.status}
    except ApiError as error:
        http = HttpError.from_api(error, names_for(body, chat=chat))
        return http.json()["error"] | {"status": http.status}
    pytest.fail(f"{body} was accepted")


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4} | fields


# ------------------------------------------------------------------ bodies

def test_malformed_json_is_400():
    with pytest.raises(HttpError, match="not valid JSON") as refused:
        parse_body("{not json")
    assert refused.value.status == 400


def test_an_integer_too_long_to_read_is_400_naming_it():
    with pytest.raises(HttpError, match="an integer of 5000 digits") as refused:
        parse_body('{"prompt": "Hi", "max_tokens": ' + "7" * 5000 + "}")
    assert refused.value.status == 400


def test_deeply_nested_json_is_400():
    with pytest.raises(HttpError, match="nested") as refused:
        parse_body("[" * 100_000 + "]" * 100_000)
    assert refused.value.status == 400


def test_a_body_that_is_not_an_object_is_400():
    with pytest.raises(HttpError, match="must be a JSON object"):
        parse_body("[1, 2]")


# ------------------------------------------------------------------ fields

@pytest.mark.parametrize("field,value,status,param", [
    ("temperature", -1, 400, "temperature"), ("top_p", 1.5, 400, "top_p"), ("max_tokens", 0, 400, "max_tokens"),
    ("n", 0, 400, "n"), ("top_k", 0, 400, "top_k"), ("presence_penalty", 5, 400, "presence_penalty"),
    ("logprobs", 50, 400, "logprobs"), ("temperature", "hot", 400, "temperature"), ("prompt", "", 400, "prompt"),
    ("model", "gpt-17", 404, "model"), ("stop", [1, 2], 400, "stop"),
])
def test_bad_field_gets_status_and_json_error_naming_it(served, field, value, status, param):
    error = refusal(completion(**{field: value}), served)
    assert error["status"] == status
    assert (field if status == 400 else value) in error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("field,literal", [
    ("temperature", "1e999"), ("top_p", "-1e999"), ("presence_penalty", "NaN"),
    ("repetition_penalty", "Infinity"), ("min_p", "1" + "0" * 400), ("frequency_penalty", "1" + "0" * 30),
])
def test_a_number_out_of_a_float_field_range_is_400_naming_the_field(served, field, literal):
    body = parse_body('{"prompt": "Hi", "max_tokens": 1, "' + field + '": ' + literal + "}")
    error = refusal(body, served)
    assert error["status"] == 400 and error["param"] == field and "integer" not in error["message"], error


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 2**31), ("n", 2**40), ("priority", -2**40), ("seed", 2**64),
    ("stop_token_ids", [2**40]), ("prompt", [2**70]), ("prompt", ["Hi", [5, 2**40]]),
])
def test_integer_too_large_for_its_field_is_400_naming_it(served, field, value):
    error = refusal(completion(max_tokens=2) | {field: value}, served)
    assert error["status"] == 400
    assert error["param"].startswith(field) and "out of range" in error["message"]


@pytest.mark.parametrize("text,param", [
    ('{"prompt": "Hi \\ud800", "max_tokens": 2}', "prompt"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ('{"tools": [{"type": "function", "function": {"name": "f\\ud800"}}]}', "tools[0].function.name"),
    ('{"messages": [{"role": "tool", "content": "x", "tool_call_id": "\\udc00"}]}', "messages[0].tool_call_id"),
    ('{"vllm_xargs": {"k": ["a", "\\uDBFF"]}}', "vllm_xargs.k[1]"),
    ('{"vllm_xargs": {"\\ud800": 1}}', "vllm_xargs.<key>"),
])
def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_where(text, param):
    with pytest.raises(HttpError, match="lone UTF-16 surrogate") as refused:
        parse_body(text)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_surrogate_pair_is_the_character_it_escapes():
    assert parse_body('{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("literal,problem", [("NaN", "finite"), ("-Infinity", "finite"), ("1" + "0" * 400, "too large")])
def test_a_number_json_cannot_hold_in_vllm_xargs_is_400(served, literal, problem):
    error = refusal(parse_body('{"prompt": "Hi", "max_tokens": 1, "vllm_xargs": {"a": [' + literal + "]}}"), served)
    assert error["status"] == 400 and error["param"] in ("vllm_xargs", "extra_args") and problem in error["message"]


@pytest.mark.parametrize("depth", [17, 33, 900])
def test_vllm_xargs_nested_too_deep_is_400(served, depth):
    xargs = "{\"a\": " * depth + "1" + "}" * depth
    error = refusal(parse_body('{"prompt": "Hi", "max_tokens": 1, "vllm_xargs": ' + xargs + "}"), served)
    assert error["status"] == 400 and error["param"] == "vllm_xargs" and "more than 16 deep" in error["message"]


def test_prompt_over_max_model_len_is_400(served):
    error = refusal(completion(prompt=[1] * 5000, max_tokens=2), served)
    assert error["status"] == 400 and "prompt" in error["message"]


@pytest.mark.parametrize("chat,prompt,field", [
    (False, {"prompt": PROMPT}, "max_tokens"),
    (True, {"messages": MESSAGES}, "max_tokens"),
    (True, {"messages": MESSAGES}, "max_completion_tokens"),
])
def test_max_tokens_past_the_context_is_400_naming_the_limit(served, chat, prompt, field):
    error = refusal({"model": MODEL, field: 10**9} | prompt, served, chat=chat)
    assert error["status"] == 400
    assert error["param"] == field and error["message"].startswith(f"{field}=1000000000 is too large")
    assert "maximum context length is 2048 tokens" in error["message"]
    assert " in the completion" in error["message"]


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content"),
    ({"role": "wizard", "content": "hi"}, "messages[0].role"),
    ({"role": "user"}, "messages[0].content"),
])
def test_malformed_chat_message_is_400_naming_it(served, message, param):
    error = refusal({"model": MODEL, "messages": [message], "max_tokens": 2}, served, chat=True)
    assert error["status"] == 400 and error["param"] == param


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
])
def test_unsupported_openai_feature_is_refused_not_ignored(served, extra, param):
    error = refusal({"model": MODEL, "messages": MESSAGES, "max_tokens": 2} | extra, served, chat=True)
    assert error["status"] == 400 and error["param"] == param


def test_error_object_has_openai_types_and_string_or_null_code(served):
    error = refusal({"model": "gpt-17", "prompt": PROMPT}, served)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    error = refusal(completion(n=0), served)
    assert error["type"] == "invalid_request_error" and error["code"] is None


def test_chat_errors_name_the_fields_the_client_sent(served):
    body = {"model": MODEL, "messages": MESSAGES}
    assert refusal(body | {"logprobs": True, "top_logprobs": 21}, served, chat=True)["param"] == "top_logprobs"
    assert refusal(body | {"max_completion_tokens": 0}, served, chat=True)["param"] == "max_completion_tokens"


@pytest.mark.parametrize("max_tokens", [-1, 0, "many", 2**31])
def test_an_invalid_max_tokens_beside_max_completion_tokens_is_400_naming_it(served, max_tokens):
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 8, "max_tokens": max_tokens}
    error = refusal(body, served, chat=True)
    assert error["status"] == 400 and error["param"] == "max_tokens"
    assert error["message"].startswith("max_tokens")


def test_max_completion_tokens_wins_over_a_valid_max_tokens_beside_it():
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 8, "max_tokens": 100}
    [request] = generate_requests(body, chat=True, request_id="r")
    assert request.params.max_tokens == 8


def test_an_error_about_one_prompt_of_a_batch_names_it(served):
    error = refusal(completion(prompt=["Hi", "x " * 9000], max_tokens=2), served)
    assert error["status"] == 400 and error["param"] == "prompt[1]"
    assert error["message"].startswith("prompt[1]: the prompt has")


def test_an_error_without_a_field_names_no_param():
    error = HttpError.from_api(ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full", 2.5))
    assert (error.status, error.param, error.retry_after_s) == (429, None, 2.5)


# ------------------------------------------------------------------ names

@pytest.mark.parametrize("path,named", [
    ("params.temperature", "temperature"), ("text", "prompt"), ("token_ids.ids[3]", "prompt[3]"),
    ("chat.messages[0].role", "messages[0].role"), ("chat", "messages"), ("token_ids[2]", "tokens[2]"),
    ("request_id", "request_id"),
])
def test_grpc_field_paths_are_renamed_by_their_leading_piece(path, named):
    assert http_field(path, names_for({}, chat=False)) == named


def test_a_piece_renames_only_a_whole_leading_name():
    assert http_field("textual", {"text": "prompt"}) == "textual"


# ------------------------------------------------------------------ a batch

def test_a_batch_of_prompts_becomes_one_request_per_prompt_with_numbered_ids():
    requests = generate_requests(completion(prompt=["a", [1, 2]]), chat=False, request_id="r")
    assert [r.request_id for r in requests] == ["r-0", "r-1"]
    assert (requests[0].text, list(requests[1].token_ids.ids)) == ("a", [1, 2])


# ------------------------------------------------------------------ responses

def test_a_stream_chunk_leaves_out_choices_with_nothing_new():
    response = pb.GenerateResponse(choices=[pb.ChoiceDelta(index=0, text="Paris"), pb.ChoiceDelta(index=1)])
    offsets = [0, 0]
    choices = chunk_choices(response, chat=True, want_logprobs=False, offsets=offsets)
    assert choices == [{"index": 0, "logprobs": None, "finish_reason": None, "delta": {"content": "Paris"}}]
    assert offsets == [5, 0]


# ------------------------------------------------------------------ structured outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def constraint_of(body: dict, chat: bool = True) -> pb.StructuredOutput:
    [request] = generate_requests({"messages": MESSAGES} | body if chat else completion(**body),
                                  chat=chat, request_id="r")
    return request.params.structured_output


@pytest.mark.parametrize("body,expected", [
    ({"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]+"}}, pb.StructuredOutput(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, pb.StructuredOutput(choice=pb.Choices(values=["yes", "no"]))),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, pb.StructuredOutput(grammar='start: "a"')),
    ({"structured_outputs": {"json_object": True}}, pb.StructuredOutput(json_object=True)),
], ids=["json_object", "json_schema", "json", "json text", "regex", "choice", "grammar", "vllm json_object"])
def test_response_format_and_structured_outputs_become_the_grpc_constraint(body, expected):
    assert constraint_of(body) == expected


@pytest.mark.parametrize("body,expected", [
    ({"guided_json": SCHEMA}, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_regex": "[a-z]+"}, pb.StructuredOutput(regex="[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, pb.StructuredOutput(choice=pb.Choices(values=["yes", "no"]))),
    ({"guided_grammar": 'start: "a"'}, pb.StructuredOutput(grammar='start: "a"')),
], ids=["json", "regex", "choice", "grammar"])
def test_vllms_older_guided_fields_become_the_grpc_constraint(body, expected):
    assert constraint_of(body) == expected


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
])
def test_a_malformed_guided_field_is_400_naming_it(served, body, param):
    error = refusal({"model": MODEL, "messages": MESSAGES} | body, served, chat=True)
    assert error["status"] == 400 and error["param"] == param, error


def test_text_response_format_is_no_constraint():
    [request] = generate_requests({"messages": MESSAGES, "response_format": {"type": "text"}}, chat=True,
                                  request_id="r")
    assert not request.params.HasField("structured_output")


def test_completions_take_structured_outputs_too():
    assert constraint_of({"structured_outputs": {"regex": "[0-9]+"}}, chat=False).regex == "[0-9]+"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_a_malformed_constraint_is_400_naming_it(served, body, param):
    error = refusal({"model": MODEL, "messages": MESSAGES} | body, served, chat=True)
    assert error["status"] == 400 and error["param"] == param, error


@pytest.mark.parametrize("constraints", [{}, {"json_object": False}, {"regex": None}])
def test_structured_outputs_that_set_no_constraint_are_400(served, constraints):
    """`{}` was taken as no constraint while `{"json_object": false}` was a 400; vLLM's
    StructuredOutputsParams refuses none set, and the gRPC API an empty StructuredOutput and
    json_object false alike."""
    error = refusal({"model": MODEL, "messages": MESSAGES, "structured_outputs": constraints}, served, chat=True)
    assert error["status"] == 400 and error["param"] == "structured_outputs"
    assert error["message"].endswith("; it sets none")


@pytest.mark.parametrize("value", ["yes", 1, {}])
def test_a_json_object_constraint_that_is_not_a_boolean_is_400(served, value):
    error = refusal({"model": MODEL, "messages": MESSAGES, "structured_outputs": {"json_object": value}},
                    served, chat=True)
    assert error["status"] == 400 and error["param"] == "structured_outputs.json_object"
    assert error["message"].startswith("structured_outputs.json_object must be true")


@pytest.mark.parametrize("body,param,problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "unknown name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools", "Invalid type"),
])
def test_a_constraint_that_does_not_compile_is_400_naming_the_field_and_the_problem(served, body, param, problem):
    error = refusal({"model": MODEL, "messages": MESSAGES} | body, served, chat=True)
    assert error["status"] == 400 and error["param"] == param, error
    assert error["message"].startswith(f"{param} does not compile: ") and problem in error["message"]


# ------------------------------------------------------------------ chat rendering (vLLM's fields)

def chat_prompt(body: dict, served: ServedModel) -> str:
    """The prompt a chat body renders to, decoded with its special tokens."""
    [request] = generate_requests({"model": MODEL, "max_tokens": 2} | body, chat=True, request_id="r")
    return served.tokenizer.decode(prepare_generate(request, served).prompt_token_ids, skip_special_tokens=False)


PARTIAL = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite is"}]


def test_continue_final_message_leaves_the_assistant_turn_open(served):
    continued = chat_prompt({"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": False},
                            served)
    closed = chat_prompt({"messages": PARTIAL, "add_generation_prompt": False}, served)
    assert continued.endswith("My favourite is") and closed.startswith(continued) and closed != continued


def test_add_generation_prompt_false_opens_no_new_turn(served):
    with_turn = chat_prompt({"messages": MESSAGES}, served)
    without = chat_prompt({"messages": MESSAGES, "add_generation_prompt": False}, served)
    assert with_turn.startswith(without) and with_turn[len(without):].strip() == "<|im_start|>assistant"


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": PARTIAL, "continue_final_message": True}, "needs add_generation_prompt false"),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
     "the last message's role is 'user'"),
], ids=["with-a-new-turn", "after-a-user-turn"])
def test_continue_final_message_that_cannot_continue_is_400_naming_it(served, body, message):
    error = refusal({"model": MODEL} | body, served, chat=True)
    assert (error["status"], error["param"]) == (400, "continue_final_message") and message in error["message"]


def test_chat_template_kwargs_reach_the_template(smollm_tokenizer):
    hf = copy.deepcopy(smollm_tokenizer)
    hf.chat_template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"
    served = ServedModel((MODEL,), 2048, vocab_size=49152, tokenizer=RouterTokenizer(hf))
    assert chat_prompt({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}, served) == "<think>hi"
    assert chat_prompt({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, served) == "hi"


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}, {"tools": []}])
def test_chat_template_kwargs_may_not_set_what_the_renderer_sets(served, kwargs):
    error = refusal({"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": kwargs}, served, chat=True)
    assert (error["status"], error["param"]) == (400, "chat_template_kwargs")
    assert error["message"].startswith(f"chat_template_kwargs sets {next(iter(kwargs))}, which the renderer sets")


# ------------------------------------------------------------------ logit bias and allowed ids

def test_logit_bias_and_allowed_token_ids_become_the_grpc_fields():
    [request] = generate_requests(completion(logit_bias={"42": -100, "7": 2.5}, allowed_token_ids=[7, 42]),
                                  chat=False, request_id="r")
    assert dict(request.params.logit_bias) == {42: -100.0, 7: 2.5}
    assert list(request.params.allowed_token_ids) == [7, 42]


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_a_number_past_float32_is_400_naming_it_as_sent_not_as_inf(served, field):
    error = refusal(completion(**{field: 1e308}), served)
    assert (error["status"], error["param"]) == (400, field)
    assert error["message"] == f"{field}=1e+308 is out of range: the field holds a 32-bit float"


def test_an_empty_allowed_token_ids_is_400_not_every_token(served):
    error = refusal(completion(allowed_token_ids=[]), served)
    assert error["status"] == 400 and error["param"] == "allowed_token_ids" and "empty" in error["message"]


@pytest.mark.parametrize("bias,param", [
    ({"x": 1}, "logit_bias"), ({"5": "high"}, "logit_bias"), ({"5": 101}, "logit_bias"),
    ({"99999999": 1}, "logit_bias"), ({"5": True}, "logit_bias"), ({"--5": 1}, "logit_bias"),
    ({"\u00b2": 1}, "logit_bias"),
], ids=["not an id", "not a number", "over 100", "outside the vocabulary", "a boolean", "two signs",
        "a superscript digit"])
def test_a_bad_logit_bias_is_400_naming_it(served, bias, param):
    error = refusal(completion(logit_bias=bias), served)
    assert error["status"] == 400 and error["param"] == param, error


# ------------------------------------------------------------------ logprobs

def logprob(token_id: int, text: str, value: float, token_bytes: bytes = b"") -> pb.Logprob:
    return pb.Logprob(token_id=token_id, text=text, logprob=value, token_bytes=token_bytes or text.encode())


def test_completion_top_logprobs_keep_every_token_when_two_decode_to_the_same_text():
    sampled = logprob(7, "\ufffd", -0.5, b"\xf0\x9f")
    entry = pb.TokenLogprobs(sampled=sampled, top=[sampled, logprob(8, "\ufffd", -1.5, b"\xf0\x9f\xa6"),
                                                   logprob(9, " a", -2.0)])
    response = pb.GenerateResponse(choices=[pb.ChoiceDelta(index=0, text="", logprobs=[entry])])
    [choice] = chunk_choices(response, chat=False, want_logprobs=True, offsets=[0])
    assert choice["logprobs"]["top_logprobs"] == [{"\ufffd": -0.5, "\\xf0\\x9f\\xa6": -1.5, " a": -2.0}]


def test_chat_logprobs_carry_the_tokens_real_bytes():
    entry = pb.TokenLogprobs(sampled=logprob(7, "\ufffd", -0.5, b"\xf0\x9f"), top=[])
    response = pb.GenerateResponse(choices=[pb.ChoiceDelta(index=0, text="", logprobs=[entry])])
    [choice] = chunk_choices(response, chat=True, want_logprobs=True, offsets=[0])
    assert choice["logprobs"]["content"][0]["bytes"] == [0xF0, 0x9F]


def test_an_assistant_turns_tool_calls_and_a_tool_turns_call_id_are_kept():
    body = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]}
    [request] = generate_requests(body, chat=True, request_id="r")
    assistant, tool = request.chat.messages[1], request.chat.messages[2]
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_1", "get_weather", '{"city": "Oslo"}')]
    assert tool.tool_call_id == "call_1" and tool.content == "12 C"


def test_a_malformed_tool_call_in_the_history_is_400_naming_it(served):
    body = {"model": MODEL, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": 5}]}]}
    error = refusal(body, served, chat=True)
    assert error["status"] == 400 and error["param"] == "messages[0].tool_calls[0]"


# ------------------------------------------------------------------ echo (prompt logprobs)

def test_echo_with_logprobs_asks_for_the_prompts_logprobs_as_many_as_logprobs():
    [request] = generate_requests(completion(echo=True, logprobs=3), chat=False, request_id="r")
    assert request.params.prompt_logprobs == 3 and request.params.logprobs == 3


def test_echo_without_logprobs_asks_for_no_prompt_logprobs():
    [request] = generate_requests(completion(echo=True), chat=False, request_id="r")
    assert not request.params.HasField("prompt_logprobs")


def test_an_echoed_prompt_with_max_tokens_0_is_accepted_for_scoring(served):
    for body in (completion(echo=True, logprobs=1, max_tokens=0), completion(echo=True, max_tokens=0)):
        [request] = generate_requests(body, chat=False, request_id="r")
        assert prepare_generate(request, served).params.max_tokens == 0


@pytest.mark.parametrize("body", [completion(max_tokens=0), completion(echo=True, logprobs=1, max_tokens=0, n=2)],
                         ids=["not echoed", "n=2"])
def test_max_tokens_0_is_400_naming_it_unless_an_echoed_prompt_is_scored_once(served, body):
    error = refusal(body, served)
    assert error["status"] == 400 and error["param"] == "max_tokens" and "score a prompt" in error["message"]
    assert "echo=true" in error["message"] and "prompt_logprobs" not in error["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_with_max_tokens_0_is_400_naming_the_field_sent(served, field):
    error = refusal({"model": MODEL, "messages": MESSAGES, field: 0}, served, chat=True)
    assert (error["status"], error["param"], error["message"]) == (400, field, f"{field} must be an integer >= 1, got 0")


def test_prompt_logprobs_out_of_range_is_400_naming_logprobs_as_the_client_sent_it(served):
    error = refusal(completion(echo=True, logprobs=21), served)
    assert error["status"] == 400 and error["param"] == "logprobs"


async def _stream(*responses: pb.GenerateResponse):
    for response in responses:
        yield response


def echo_of(*responses: pb.GenerateResponse, n: int = 1, with_logprobs: bool = True) -> list[pb.GenerateResponse]:
    async def prompt_text() -> str:
        return "Hi there"

    async def collect() -> list[pb.GenerateResponse]:
        return [r async for r in echoed(_stream(*responses), prompt_text, n, with_logprobs)]
    return asyncio.run(collect())


ADMITTED = pb.GenerateResponse(usage=pb.Usage(prompt_tokens=2))
FIRST, SECOND = (pb.TokenLogprobs(sampled=pb.Logprob(token_id=1, text="Hi", token_bytes=b"Hi")),   # no logprob
                 pb.TokenLogprobs(sampled=logprob(2, " there", -3.0), top=[logprob(5, " you", -1.0)]))


def test_an_echo_starts_every_choice_with_the_prompt_and_its_logprobs_before_any_output():
    early = pb.GenerateResponse(choices=[pb.ChoiceDelta(index=1, text=" b")], prompt_logprobs=[FIRST])
    later = pb.GenerateResponse(choices=[pb.ChoiceDelta(index=0, text=" a")], prompt_logprobs=[SECOND])
    admitted, echo, *rest = echo_of(ADMITTED, early, later, n=2)
    assert admitted == ADMITTED
    assert [(c.index, c.text, list(c.logprobs)) for c in echo.choices] == [(0, "Hi there", [FIRST, SECOND]),
                                                                           (1, "Hi there", [FIRST, SECOND])]
    assert [c.text for r in rest for c in r.choices] == [" b", " a"]
    assert not any(r.prompt_logprobs for r in rest)


def test_an_echo_without_logprobs_is_the_prompts_text_alone():
    _, echo, rest = echo_of(ADMITTED, pb.GenerateResponse(choices=[pb.ChoiceDelta(index=0, text=" a")]),
                            with_logprobs=False)
    assert [(c.text, list(c.logprobs)) for c in echo.choices] == [("Hi there", [])]
    assert rest.choices[0].text == " a"


def test_an_echoed_prompts_first_token_has_null_logprobs_and_the_rest_their_own():
    response = pb.GenerateResponse(choices=[pb.ChoiceDelta(index=0, text="Hi there", logprobs=[FIRST, SECOND])])
    [choice] = chunk_choices(response, chat=False, want_logprobs=True, offsets=[0])
    assert choice["logprobs"] == {"tokens": ["Hi", " there"], "token_logprobs": [None, -3.0],
                                  "top_logprobs": [None, {" you": -1.0, " there": -3.0}], "text_offset": [0, 2]}


# ------------------------------------------------------------------ bad words

def test_bad_words_become_the_grpc_field():
    [request] = generate_requests(completion(bad_words=["Paris", "wizard"]), chat=False, request_id="r")
    assert list(request.params.bad_words) == ["Paris", "wizard"]


@pytest.mark.parametrize("bad_words,param", [("Paris", "bad_words"), ([5], "bad_words"), ([" "], "bad_words")],
                         ids=["not an array", "not strings", "only a space"])
def test_malformed_bad_words_are_400_naming_them(served, bad_words, param):
    error = refusal(completion(bad_words=bad_words), served)
    assert error["status"] == 400 and error["param"] == param


def test_bad_words_on_a_model_without_a_tokenizer_are_400_saying_so():
    tokenless = ServedModel((MODEL,), 2048, vocab_size=49152, tokenizer=None)
    error = refusal(completion(prompt=[1, 2], bad_words=["Paris"]), tokenless)
    assert error["param"] == "bad_words" and "without a tokenizer" in error["message"]


# ------------------------------------------------------------------ custom logits processors

def test_logits_processors_and_vllm_xargs_become_the_grpc_fields():
    body = completion(logits_processors=["length_temperature"], vllm_xargs={"length_scale": 500, "tag": "a"})
    [request] = generate_requests(body, chat=False, request_id="r")
    assert list(request.params.logits_processors) == ["length_temperature"]
    assert dict(request.params.extra_args) == {"length_scale": 500.0, "tag": "a"}


@pytest.mark.parametrize("body,param", [({"logits_processors": "length_temperature"}, "logits_processors"),
                                        ({"logits_processors": [""]}, "logits_processors"),
                                        ({"vllm_xargs": [1]}, "vllm_xargs")],
                         ids=["not an array", "empty name", "xargs not an object"])
def test_malformed_logits_processor_fields_are_400_naming_them(served, body, param):
    error = refusal(completion(**body), served)
    assert error["status"] == 400 and error["param"] == param


# ------------------------------------------------------------------ /tokenize

def test_tokenize_asks_for_the_assistant_turns_opening_unless_told_not_to():
    assert tokenize_request({"messages": MESSAGES}).chat.add_generation_prompt is True
    assert tokenize_request({"messages": MESSAGES, "add_generation_prompt": False}).chat.add_generation_prompt is False


def test_tokenize_shows_the_chat_template_its_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    [tool] = tokenize_request({"messages": MESSAGES, "tools": tools}).chat.tools
    assert tool.name == "f" and json.loads(tool.parameters_json) == {"type": "object"}


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": PROMPT, "tools": []}, "tools"),
    ({"messages": MESSAGES, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"messages": MESSAGES, "tools": {}}, "tools"),
])
def test_malformed_tokenize_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(HttpError) as refused:
        tokenize_request(body)
    assert refused.value.status == 400 and refused.value.param == param
