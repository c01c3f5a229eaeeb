"""router.tool_calls: tools and tool_choice become a constraint; the output becomes tool_calls."""

import json

import jsonschema
import pytest

from common.sampling_params import StructuredOutput
from common.structured_output import problem
from router.tool_calls import StreamedCalls, ToolCallError, tool_calling
from router.tool_syntax import HermesSyntax, Llama3JsonSyntax

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time"}}]


def named(name) -> dict:
    return {"type": "function", "function": {"name": name}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_named_function_constrains_the_output_to_its_parameters():
    calling = tool_calling({"tools": TOOLS, "tool_choice": named("weather")})
    assert json.loads(calling.constraint().json_schema) == WEATHER


def test_required_constrains_the_output_to_a_name_and_arguments_of_one_tool():
    schema = json.loads(tool_calling({"tools": TOOLS, "tool_choice": "required"}).constraint().json_schema)
    assert [option["properties"]["name"]["const"] for option in schema["anyOf"]] == ["weather", "time"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}


def test_a_forced_output_is_the_calls_arguments():
    call = tool_calling({"tools": TOOLS, "tool_choice": named("weather")}).call('{"city": "Oslo"}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}


def test_a_required_output_names_its_function():
    call = tool_calling({"tools": TOOLS, "tool_choice": "required"}).call('{"name": "time", "arguments": {}}')
    assert call["function"] == {"name": "time", "arguments": "{}"}


def test_an_output_cut_short_is_no_call():
    assert tool_calling({"tools": TOOLS, "tool_choice": "required"}).call('{"name": "ti') is None


def test_a_named_call_cut_short_is_still_that_call_as_its_stream_sent_it():
    """max_tokens ends the arguments early: the call keeps them as they are, incomplete, so an
    unstreamed response has the shape of the streamed one (tool_calls, not content)."""
    calling = tool_calling({"tools": TOOLS, "tool_choice": named("weather")})
    content, [call] = calling.split('{"city": "Par')
    assert content is None and call["function"] == {"name": "weather", "arguments": '{"city": "Par'}
    streamed = StreamedCalls(calling, 1)
    pieces = [streamed.delta(0, '{"city": ', False), streamed.delta(0, '"Par', True)]
    assert "".join(p["tool_calls"][0]["function"]["arguments"] for p in pieces) == call["function"]["arguments"]


def test_a_required_output_cut_short_is_content_streamed_or_not():
    calling = tool_calling({"tools": TOOLS, "tool_choice": "required"})
    assert calling.split('{"name": "ti') == ('{"name": "ti', [])
    assert StreamedCalls(calling, 1).delta(0, '{"name": "ti', True) == {"content": '{"name": "ti'}


@pytest.mark.parametrize("body", [{}, {"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "none"}])
def test_no_tools_or_tool_choice_none_calls_nothing(body):
    assert tool_calling(body) is None


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS, "tool_choice": named("stocks")}, "tool_choice", "not among the tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]", "name"),
    ({"tools": [], "tool_choice": "required"}, "tools", "non-empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"tools": TOOLS, "tool_choice": named(["weather"])}, "tool_choice", "not among the tools"),
    ({"tools": TOOLS, "tool_choice": named({"a": 1})}, "tool_choice", "not among the tools"),
    ({"tools": [tool("f", {"type": "object", "$defs": 5})], "tool_choice": "required"},
     "tools[0].function.parameters", r"\$defs must map names to schemas"),
    ({"tools": [tool("f", {"definitions": ["x"]})], "tool_choice": "required"},
     "tools[0].function.parameters", "definitions must map names to schemas"),
    ({"tools": [tool("f", json.loads('{"items": ' * 600 + "{}" + "}" * 600))], "tool_choice": "required"},
     "tools[0].function.parameters", "more than 100 deep"),
])
def test_malformed_or_unsupported_tool_calling_is_refused_naming_the_field(body, param, words):
    with pytest.raises(ToolCallError, match=words) as refused:
        tool_calling(body)
    assert refused.value.param == param


def test_a_streamed_forced_call_sends_its_id_and_name_first_then_argument_pieces():
    calls = StreamedCalls(tool_calling({"tools": TOOLS, "tool_choice": named("weather")}), n=1)
    first, second = calls.delta(0, '{"city": ', False), calls.delta(0, '"Oslo"}', True)
    assert first["tool_calls"][0]["function"] == {"arguments": '{"city": ', "name": "weather"}
    assert first["tool_calls"][0]["id"].startswith("call_")
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}


def test_a_streamed_required_call_is_sent_whole_when_its_choice_ends():
    calls = StreamedCalls(tool_calling({"tools": TOOLS, "tool_choice": "required"}), n=1)
    assert calls.delta(0, '{"name": "time", ', False) is None
    [call] = calls.delta(0, '"arguments": {}}', True)["tool_calls"]
    assert call["function"] == {"name": "time", "arguments": "{}"} and call["index"] == 0


def test_the_tools_are_shown_to_the_template_in_openais_form_unless_tool_choice_is_none():
    shown = tool_calling({"tools": TOOLS, "tool_choice": "required"}).tools
    assert [(t.name, json.loads(t.parameters_json) if t.parameters_json else None) for t in shown] == [
        ("weather", WEATHER), ("time", None)]
    assert tool_calling({"tools": TOOLS, "tool_choice": "none"}) is None


# ------------------------------------------------------------------ tool_choice "auto"

HERMES_TEMPLATE = "{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %} answer in <tool_call> tags"
LLAMA3_TEMPLATE = "{{- 'Environment: ipython' }}{% for m in messages %}{{ m.content }}{% endfor %}"


def auto(template: str, **body):
    return tool_calling({"tools": TOOLS, **body}).with_syntax(template, "m")


@pytest.mark.parametrize("body", [{}, {"tool_choice": "auto"}], ids=["default", "auto"])
def test_auto_takes_the_syntax_the_chat_template_names_and_constrains_nothing(body):
    calling = auto(HERMES_TEMPLATE, **body)
    assert calling.auto and isinstance(calling.syntax, HermesSyntax) and calling.constraint() is None
    assert isinstance(auto(LLAMA3_TEMPLATE).syntax, Llama3JsonSyntax)


def test_auto_on_a_template_of_no_known_syntax_is_refused_naming_the_known_ones():
    with pytest.raises(ToolCallError, match=r"chat template of m is of no family .*hermes: .*llama3_json: "
                                            r".*send tool_choice \"required\"") as refused:
        auto("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert refused.value.param == "tool_choice"


def test_hermes_blocks_become_calls_and_the_text_around_them_content():
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    content, calls = auto(HERMES_TEMPLATE).split(text)
    assert content == "Let me look.\n\n"
    assert [c["function"] for c in calls] == [{"name": "weather", "arguments": '{"city": "Oslo"}'},
                                              {"name": "time", "arguments": "{}"}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "stocks", "arguments": {}}</tool_call>',          # not among the tools
    '<tool_call>{"name": "weather", "arguments": {"city": "Os</tool_call>',  # not JSON
    '<tool_call>{"name": "weather", "arguments": [1]}</tool_call>',         # arguments not an object
    "It is sunny in Oslo.",
], ids=["unknown-tool", "broken-json", "array-arguments", "plain-text"])
def test_hermes_output_that_is_not_clearly_a_call_is_all_content(text):
    assert auto(HERMES_TEMPLATE).split(text) == (text, [])


def test_an_unclosed_last_hermes_block_still_counts_as_a_call():
    _, [call] = auto(HERMES_TEMPLATE).split('<tool_call>{"name": "time", "arguments": {}}')
    assert call["function"]["name"] == "time"


def test_llama3_json_calls_with_parameters_and_a_python_tag_become_calls():
    calling = auto(LLAMA3_TEMPLATE)
    content, calls = calling.split('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; '
                                   '{"name": "time", "parameters": {}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert calling.split("The weather is fine.") == ("The weather is fine.", [])


def stream(calling, pieces: list[str]) -> tuple[list[dict], bool]:
    calls = StreamedCalls(calling, n=1)
    deltas = [calls.delta(0, piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return [d for d in deltas if d is not None], calls.call_made(0)


def test_streamed_hermes_text_flows_as_content_and_a_call_goes_whole_at_the_end():
    deltas, made = stream(auto(HERMES_TEMPLATE), ["Checking", " now. <tool", '_call>{"name": "time", ',
                                                   '"arguments": {}}</tool_call>'])
    assert deltas[0] == {"content": "Checking"} and deltas[1] == {"content": " now. "}
    [call] = deltas[2]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "time", "arguments": "{}"} and made
    assert "".join(d.get("content", "") for d in deltas) == "Checking now. "


def test_streamed_text_held_back_as_a_possible_tag_is_sent_when_it_turns_out_text():
    deltas, made = stream(auto(HERMES_TEMPLATE), ["a <", "b", " c"])
    assert "".join(d["content"] for d in deltas) == "a <b c" and not made


def test_a_streamed_llama3_json_call_is_held_until_the_end():
    deltas, made = stream(auto(LLAMA3_TEMPLATE), ['{"name": "time", ', '"parameters": {}}'])
    assert len(deltas) == 1 and deltas[0]["tool_calls"][0]["function"]["name"] == "time" and made
    deltas, made = stream(auto(LLAMA3_TEMPLATE), ["Hello", " there"])
    assert deltas == [{"content": "Hello"}, {"content": " there"}] and not made


PAINT = {  # what pydantic writes for a model with an enum field and a nested model
    "type": "object", "title": "Paint",
    "properties": {"color": {"$ref": "#/$defs/Color"}, "at": {"$ref": "#/definitions/Point"},
                   "again": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["color", "at"],
    "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"}},
    "definitions": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
}


def test_required_keeps_a_tools_own_definitions_and_references_resolving():
    tools = TOOLS + [{"type": "function", "function": {"name": "paint", "parameters": PAINT}}]
    constraint = tool_calling({"tools": tools, "tool_choice": "required"}).constraint()
    assert problem(StructuredOutput("json_schema", constraint.json_schema)) is None   # llguidance compiles it
    schema = json.loads(constraint.json_schema)
    assert set(schema["$defs"]) == {"tool2_Color", "tool2_Point"}
    for arguments, ok in [({"color": "red", "at": {"x": 1}}, True),
                          ({"color": "red", "at": {"x": 1}, "again": {"color": "blue", "at": {"x": 2}}}, True),
                          ({"color": "green", "at": {"x": 1}}, False),
                          ({"color": "blue", "at": {"x": "1"}}, False),
                          ({"color": "red", "at": {"x": 1}, "again": {"color": "green", "at": {"x": 2}}}, False)]:
        valid = jsonschema.Draft202012Validator(schema).is_valid({"name": "paint", "arguments": arguments})
        assert valid == ok, arguments
