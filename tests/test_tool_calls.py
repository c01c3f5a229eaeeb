"""router.tool_calls: tools and tool_choice become a constraint; the output becomes tool_calls."""

import json

import pytest

from router.tool_calls import StreamedCalls, ToolCallError, tool_calling

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time"}}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


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


@pytest.mark.parametrize("body", [{}, {"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "none"}])
def test_no_tools_or_tool_choice_none_calls_nothing(body):
    assert tool_calling(body) is None


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS}, "tool_choice", "auto"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "required"),
    ({"tools": TOOLS, "tool_choice": named("stocks")}, "tool_choice", "not among the tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]", "name"),
    ({"tools": [], "tool_choice": "required"}, "tools", "non-empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
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
