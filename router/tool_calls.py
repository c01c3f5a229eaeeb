"""OpenAI tool calls: a request's `tools` are shown to the model through its chat template, and
`tool_choice` decides how its output becomes the message's `tool_calls`.

`tool_choice` a named function constrains the output to that function's `parameters` schema:
the output is the call's arguments. `"required"` constrains it to `{"name": ..., "arguments":
...}` for one of the tools. `"none"` calls nothing (the tools are not shown). `"auto"`, OpenAI's
default whenever `tools` are given, lets the model choose: its output is parsed in its own
family's tool-call syntax (router.tool_syntax, told from its chat template), and a model whose
syntax is not known gets a 400 naming the known ones and the choices that work anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field

from common.convert import json_depth
from common.pb import generation_pb2 as pb
from router.tool_syntax import KNOWN_SYNTAXES, ToolSyntax

# How deep a tool's parameters schema may nest: far past any real one, and short of Python's
# recursion limit, which placing it in the tool-call grammar walks into.
MAX_SCHEMA_DEPTH = 100


class ToolCallError(ValueError):
    """A malformed `tools` / `tool_choice`: the message names the field, `param` is it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCalling:
    """How a request's choices call tools: `forced`, the one function called, or None for
    any of `schemas` (`"required"`); `auto`: the model chooses, and `syntax` parses what it
    wrote (set by `with_syntax` once the model is known)."""
    schemas: dict[str, dict]            # tool name -> its parameters' JSON schema
    forced: str | None
    tools: tuple[pb.ChatTool, ...] = ()     # as the chat template is given them
    auto: bool = False
    syntax: ToolSyntax | None = None

    def with_syntax(self, chat_template: str, model: str) -> ToolCalling:
        """For `auto`: this calling with the tool-call syntax of the model's chat template;
        raises ToolCallError where none is known."""
        if not self.auto:
            return self
        syntax = next((s for s in KNOWN_SYNTAXES if s.matches(chat_template)), None)
        if syntax is None:
            raise ToolCallError(
                f"tool_choice \"auto\" (the default when tools are given) needs the model's own tool-call "
                f"syntax, and the chat template of {model} is of no family whose syntax is known ("
                f"{'; '.join(s.description for s in KNOWN_SYNTAXES)}): send tool_choice \"required\" or "
                "{\"type\": \"function\", \"function\": {\"name\": ...}}, which work with any model",
                "tool_choice")
        return dataclasses.replace(self, syntax=syntax)

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """A complete output as (content, tool calls): for `auto`, as its syntax parses it
        (calls of tools not given are left as text); for a named function, its call, even cut
        short (its arguments then incomplete JSON, as vLLM returns them: a stream has sent them
        as the call's arguments already); for `"required"`, one call, or the text as content
        where it was cut short (no name can be read from it)."""
        if self.auto:
            content, calls = self.syntax.split(text, set(self.schemas))
            return content, [_call(name, arguments) for name, arguments in calls]
        if self.forced is not None:
            return None, [_call(self.forced, text)]
        call = self.call(text)
        return (None, [call]) if call is not None else (text, [])

    def constraint(self) -> pb.StructuredOutput | None:
        if self.auto:
            return None
        if self.forced is not None:
            return pb.StructuredOutput(json_schema=json.dumps(self.schemas[self.forced]))
        calls, definitions = [], {}
        for i, (name, schema) in enumerate(self.schemas.items()):
            arguments, defined = _nested(schema, f"#/anyOf/{i}/properties/arguments", f"tool{i}_")
            calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                          "required": ["name", "arguments"], "additionalProperties": False})
            definitions |= defined
        return pb.StructuredOutput(json_schema=json.dumps(
            {"anyOf": calls} | ({"$defs": definitions} if definitions else {})))

    def call(self, text: str) -> dict | None:
        """The tool call of a complete output, or None for one cut short (not valid JSON)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.forced is not None:
            return _call(self.forced, text)
        return _call(value["name"], json.dumps(value["arguments"]))


def _nested(schema: dict, at: str, prefix: str) -> tuple[dict, dict]:
    """A tool's parameters schema moved from the root of a document to the JSON pointer `at`:
    (the schema without its `$defs` / `definitions`, those definitions renamed with `prefix`).
    Its local references follow: `#/$defs/X` (or `#/definitions/X`) becomes `#/$defs/<prefix>X`,
    which the caller keeps at the new root, and any other `#...` is taken to lie under `at`.
    (Pydantic's tools keep their enums and nested models in `$defs`, which nesting left dangling.)"""
    definitions = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def moved(node):
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: moved(value) for key, value in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            for root in ("#/$defs/", "#/definitions/"):
                if ref.startswith(root):
                    out["$ref"] = "#/$defs/" + prefix + ref.removeprefix(root)
                    break
            else:
                out["$ref"] = at + ref[1:]
        return out

    body = {key: value for key, value in schema.items() if key not in ("$defs", "definitions")}
    return moved(body), {prefix + name: moved(value) for name, value in definitions.items()}


def _call(name: str, arguments: str) -> dict:
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
    schemas, shown = {}, []
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
        for key in ("$defs", "definitions"):
            if not isinstance(parameters.get(key, {}), dict):
                raise ToolCallError(f"tools[{i}].function.parameters.{key} must map names to schemas",
                                    f"tools[{i}].function.parameters")
        if json_depth(parameters) > MAX_SCHEMA_DEPTH:
            raise ToolCallError(f"tools[{i}].function.parameters nests objects and lists more than "
                                f"{MAX_SCHEMA_DEPTH} deep", f"tools[{i}].function.parameters")
        if name in schemas:
            raise ToolCallError(f"tools[{i}]: a second function named {name!r}", f"tools[{i}]")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ToolCallError(f"tools[{i}].function.description must be a string", f"tools[{i}].function.description")
        schemas[name] = parameters
        shown.append(pb.ChatTool(name=name, description=description,
                                 parameters_json=json.dumps(parameters) if "parameters" in function else ""))
    if choice == "none":
        return None
    tools = tuple(shown)
    if choice == "required":
        return ToolCalling(schemas, None, tools)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in schemas:
            raise ToolCallError(f"tool_choice names {name!r}, which is not among the tools: "
                                f"{', '.join(schemas)}", "tool_choice")
        return ToolCalling(schemas, name, tools)
    if choice in (None, "auto"):
        return ToolCalling(schemas, None, tools, auto=True)
    raise ToolCallError(f"tool_choice must be \"none\", \"required\", \"auto\" or a named function; got "
                        f"{json.dumps(choice)[:60]}", "tool_choice")


@dataclass
class StreamedCalls:
    """The tool-call deltas of a streamed chat, per choice: a forced call streams its arguments
    as they come (its id and name first); a `"required"` one is sent whole when its choice ends,
    since the name is known only then. Under `"auto"` the text streams as content while its
    syntax says it is text for sure; the calls, and any text held back, go when the choice ends."""
    calling: ToolCalling
    n: int
    text: list[str] = field(init=False)
    ids: list[str] = field(init=False)
    sent: list[int] = field(init=False)         # auto: characters of text already sent as content
    made: list[bool] = field(init=False)        # auto: whether the ended choice called a tool

    def __post_init__(self) -> None:
        self.text, self.ids = [""] * self.n, [new_call_id() for _ in range(self.n)]
        self.sent, self.made = [0] * self.n, [False] * self.n

    def call_made(self, index: int) -> bool:
        """Whether choice `index`'s output so far is a whole tool call (auto: called tools)."""
        if self.calling.auto:
            return self.made[index]
        return self.calling.call(self.text[index]) is not None

    def delta(self, index: int, text: str, finished: bool) -> dict | None:
        """The `delta` of a chunk for `text` arriving on choice `index` (None: nothing to send)."""
        if self.calling.auto:
            return self._auto_delta(index, text, finished)
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

    def _auto_delta(self, index: int, text: str, finished: bool) -> dict | None:
        self.text[index] += text
        whole, sent = self.text[index], self.sent[index]
        if not finished:
            ready = self.calling.syntax.streamable(whole)
            if ready <= sent:
                return None
            self.sent[index] = ready
            return {"content": whole[sent:ready]}
        content, calls = self.calling.split(whole)
        self.made[index] = bool(calls)
        delta: dict = {}
        if (rest := (content or "")[sent:]):
            delta["content"] = rest
        if calls:
            delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(calls)]
        return delta or None
