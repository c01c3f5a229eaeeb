"""How model families write tool calls when they choose for themselves (tool_choice "auto"):
each syntax is told from the model's chat template, splits a complete output into text and
calls, and says how much of an output still growing is text for sure (streaming).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among text, as
  Hermes 2/3, Qwen2 / Qwen2.5 and their fine-tunes write them (the template shows the tools
  in `<tools>` and names the tags).
- `llama3_json`: the whole output one JSON object `{"name": ..., "parameters": {...}}` (or
  several, joined by `;`), as Llama 3.1 / 3.2 / 3.3 write a custom tool's call (the template
  names the `ipython` environment; a `<|python_tag|>` before it is skipped).

A call counts only when it names one of the request's tools with an object of arguments; an
output with any other block or object is all text, so nothing is called that the model did
not clearly call.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass

Call = tuple[str, str]      # (function name, arguments as JSON text)


@dataclass(frozen=True)
class ToolSyntax(abc.ABC):
    name: str
    description: str

    @abc.abstractmethod
    def matches(self, chat_template: str) -> bool:
        """Whether a chat template is of this syntax's family."""

    @abc.abstractmethod
    def split(self, text: str, tools: set[str]) -> tuple[str | None, list[Call]]:
        """(the text outside calls, or None where there is none; the calls). Calls only where
        every one parses; else (text, [])."""

    @abc.abstractmethod
    def streamable(self, text: str) -> int:
        """How many leading characters of an output so far are text whatever follows; what
        split(text) gives as content starts with them."""


def _arguments(value: dict, tools: set[str], *keys: str) -> Call | None:
    name = value.get("name")
    arguments = next((value[k] for k in keys if k in value), None)
    if isinstance(arguments, str):          # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in tools or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments)


class HermesSyntax(ToolSyntax):
    OPEN = "<tool_call>"
    # A block, or a last one the model ended without closing.
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def matches(self, chat_template: str) -> bool:
        return self.OPEN in chat_template

    def split(self, text: str, tools: set[str]) -> tuple[str | None, list[Call]]:
        calls = []
        for block in self._BLOCK.finditer(text):
            try:
                value = json.loads(block.group(1))
            except ValueError:
                return text, []
            call = _arguments(value, tools, "arguments") if isinstance(value, dict) else None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = self._BLOCK.sub("", text)
        return (content if content.strip() else None), calls

    def streamable(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        # Hold back an end that may be the start of a tag.
        for length in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if text.endswith(self.OPEN[:length]):
                return len(text) - length
        return len(text)


class Llama3JsonSyntax(ToolSyntax):
    PYTHON_TAG = "<|python_tag|>"

    def matches(self, chat_template: str) -> bool:
        return self.PYTHON_TAG in chat_template or "Environment: ipython" in chat_template

    def _body(self, text: str) -> str:
        body = text.strip()
        return body[len(self.PYTHON_TAG):].lstrip() if body.startswith(self.PYTHON_TAG) else body

    def split(self, text: str, tools: set[str]) -> tuple[str | None, list[Call]]:
        body = self._body(text)
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _arguments(value, tools, "parameters", "arguments") if isinstance(value, dict) else None
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def streamable(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.PYTHON_TAG) or \
                self.PYTHON_TAG.startswith(body):
            return 0            # may be a call: held until the output is complete
        return len(text)


KNOWN_SYNTAXES: tuple[ToolSyntax, ...] = (
    HermesSyntax("hermes", "hermes: <tool_call> blocks, as Hermes and Qwen2.5 templates name them"),
    Llama3JsonSyntax("llama3_json", "llama3_json: a JSON call, as Llama 3.1+ templates (ipython) ask"),
)
