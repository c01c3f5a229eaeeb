"""Structured outputs compiled by llguidance: the grammar of each kind, and why one is refused.

Both sides use it: the router checks a request's constraint before admitting it (a compile
error is INVALID_ARGUMENT naming the problem, and no worker time is spent on it), the worker
compiles it again into a matcher for its tokenizer (`worker.structured`). llguidance is the
grammar engine (Lark and GBNF grammars, JSON Schema, regular expressions, in Rust; no torch):
chosen over xgrammar because it has no dependencies (xgrammar pins torch, transformers and
an FFI runtime, which a torch-free router could not install), compiles lazily in
milliseconds, and computes token masks with the GIL released, in parallel over a batch.
"""

from __future__ import annotations

import functools
import json

import llguidance

from common.sampling_params import StructuredOutput


def grammar_of(constraint: StructuredOutput) -> str:
    """The llguidance grammar of a constraint; raises ValueError when its text cannot be read
    (a schema that is not JSON, or nested past Python's recursion limit)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return llguidance.grammar_from("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        try:
            return llguidance.grammar_from("json_schema", json.dumps(closed_objects(json.loads(spec))))
        except json.JSONDecodeError as error:
            raise ValueError(f"the schema is not valid JSON: {error}") from None
        except RecursionError:
            # Python's parser is recursive; llguidance's own limit is lower, so such a schema
            # would not compile anyway.
            raise ValueError("the schema is nested too deeply to read") from None
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec)))
    if kind == "regex":
        return llguidance.grammar_from("regex", spec)
    return llguidance.grammar_from("grammar", spec)       # Lark, or GBNF (converted)


# Keywords whose value is one subschema, a list of them, or a map of names to them.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """`schema` with `"additionalProperties": false` on each object schema that lists its
    properties and says nothing of others, as vLLM's default grammar engine (xgrammar's strict
    mode) and OpenAI's strict schemas treat them. JSON Schema's own default admits any other
    key, and a small model given a tool's parameters then invents keys until `max_tokens`
    (a LangChain `with_structured_output(method="function_calling")` got none back). A schema
    that sets `additionalProperties` (or `unevaluatedProperties`) keeps what it says. The parts
    of an `allOf` of several are left open, and the root definitions they `$ref`: each lists
    only its own properties, and closing them would refuse every object holding another part's.
    Changes `schema`."""
    nodes = list(_subschemas(schema))
    refs = {node["$ref"] for node, in_all_of in nodes if in_all_of and isinstance(node.get("$ref"), str)}
    left_open = {id(node) for node, in_all_of in nodes if in_all_of}
    for root in ("$defs", "definitions"):
        definitions = schema.get(root) if isinstance(schema, dict) else None
        if isinstance(definitions, dict):
            left_open |= {id(d) for name, d in definitions.items() if f"#/{root}/{name}" in refs}
    for node, _ in nodes:
        if (id(node) not in left_open and ("properties" in node or "patternProperties" in node)
                and "additionalProperties" not in node and "unevaluatedProperties" not in node):
            node["additionalProperties"] = False
    return schema


def _subschemas(schema):
    """Each subschema of `schema` (itself included), with whether it is a part of an `allOf`
    of several. Follows the schema's keywords, not every dict, so that a property named
    "properties" is read as a name."""
    stack = [(schema, False)]
    while stack:
        node, in_all_of = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, in_all_of
        for key in _SUBSCHEMA:
            value = node.get(key)
            stack.extend((item, False) for item in (value if isinstance(value, list) else [value]))
        for key in _SUBSCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                several = key == "allOf" and len(value) > 1
                stack.extend((item, several) for item in value)
        for key in _SUBSCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                stack.extend((item, False) for item in value.values())


@functools.lru_cache(maxsize=256)
def problem(constraint: StructuredOutput) -> str | None:
    """Why the constraint cannot be compiled (an unsupported schema feature, a regex or grammar
    syntax error), or None when it compiles. Cached: clients send the same few schemas again
    and again, and the router checks every request."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_of(constraint))
    except ValueError as failed:
        return str(failed)
    return error or None
