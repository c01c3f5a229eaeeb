"""OpenAI tool calls, made by constraining the output: a request's `tools` and `tool_choice` become
a JSON-schema constraint, and the constrained output becomes the message's `tool_calls`.

`tool_choice` a named function constrains the output to that function's `parameters` schema:
the output is the call's arguments. `"required"` constrains it to `{"name": ..., "arguments":
...}` for one of the tools. `"none"` calls nothing (the tools are ignored). `"auto"`, OpenAI's
default whenever `tools` are given, would need the model's own tool-call syntax told apart from
text, which differs by model family and is not parsed here: it is refused with a 400 saying to
send `"required"` or a named function.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from common.pb import generation_pb2 as pb


class ToolCallError(ValueError):
    """A malformed `tools` / `tool_choice`: the message names the field, `param` is it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCalling:
    """How a request's choices call tools: `forced`, the one function called, or None for
    any of `schemas` (`"required"`)."""
    schemas: dict[str, dict]            # tool name -> its parameters' JSON schema
    forced: str | None

    def constraint(self) -> pb.StructuredOutput:
        if self.forced is not None:
            return pb.StructuredOutput(json_schema=json.dumps(self.schemas[self.forced]))
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in self.schemas.items()]
        return pb.StructuredOutput(json_schema=json.dumps({"anyOf": calls}))

    def call(self, text: str) -> dict | None:
        """The tool call of a complete output, or None for one cut short (not valid JSON)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.forced is not None:
            name, arguments = self.forced, text
        else:
            name, arguments = value["name"], json.dumps(value["arguments"])
        return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_calling(body: dict) -> ToolCalling | None:
    """The tool calling a chat body asks for, or None (no tools, or tool_choice "none");
    raises ToolCallError."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise ToolCallError("functions / function_call (OpenAI's deprecated form) are not supported: "
                            "send tools and tool_choice", "functions")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolCallError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolCallError("tools must be a non-empty array of {\"type\": \"function\", \"function\": "
                            "{\"name\", \"parameters\"}}", "tools")
    schemas = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolCallError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                                "string, \"parameters\": JSON schema}}", f"tools[{i}]")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolCallError(f"tools[{i}].function.parameters must be a JSON schema object",
                                f"tools[{i}].function.parameters")
        if name in schemas:
            raise ToolCallError(f"tools[{i}]: a second function named {name!r}", f"tools[{i}]")
        schemas[name] = parameters
    if choice == "none":
        return None
    if choice == "required":
        return ToolCalling(schemas, None)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in schemas:
            raise ToolCallError(f"tool_choice names {name!r}, which is not among the tools: "
                                f"{', '.join(schemas)}", "tool_choice")
        return ToolCalling(schemas, name)
    if choice in (None, "auto"):
        raise ToolCallError("tool_choice \"auto\" (the default when tools are given) is not supported: "
                            "this server does not parse a model's own tool-call syntax; send tool_choice "
                            "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                            "tool_choice")
    raise ToolCallError(f"tool_choice must be \"none\", \"required\", \"auto\" or a named function; got "
                        f"{json.dumps(choice)[:60]}", "tool_choice")


@dataclass
class StreamedCalls:
    """The tool-call deltas of a streamed chat, per choice: a forced call streams its arguments
    as they come (its id and name first); a `"required"` one is sent whole when its choice ends,
    since the name is known only then."""
    calling: ToolCalling
    n: int
    text: list[str] = field(init=False)
    ids: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.text, self.ids = [""] * self.n, [new_call_id() for _ in range(self.n)]

    def call_made(self, index: int) -> bool:
        """Whether choice `index`'s output so far is a whole tool call."""
        return self.calling.call(self.text[index]) is not None

    def delta(self, index: int, text: str, finished: bool) -> dict | None:
        """The `delta` of a chunk for `text` arriving on choice `index` (None: nothing to send)."""
        first = not self.text[index]
        self.text[index] += text
        if self.calling.forced is not None:
            call = {"index": 0, "function": {"arguments": text}}
            if first:
                call |= {"id": self.ids[index], "type": "function"}
                call["function"]["name"] = self.calling.forced
            return {"tool_calls": [call]} if text or first else None
        if not finished:
            return None
        whole = self.calling.call(self.text[index])
        if whole is None:           # cut short: what there is, as text
            return {"content": self.text[index]}
        return {"tool_calls": [{"index": 0} | whole | {"id": self.ids[index]}]}
