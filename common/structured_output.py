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


# Keywords whose subschemas describe other values than the object itself: its properties'
# values, its items, the keys' names; one subschema, or a map of names to them. ($defs are
# reached through $ref, mostly as such values.)
_CHILD = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedItems",
          "unevaluatedProperties", "additionalItems")
_CHILD_LISTS = ("prefixItems",)
_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# Keywords whose subschemas describe the same value as their parent, as a condition or a part.
_IN_PLACE = ("not", "if", "then", "else")
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAPS = ("dependentSchemas",)
# An object schema with any of these keeps JSON Schema's default: it says what other keys may
# come, or has parts that may list them (`additionalProperties: false` sees only its own).
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties") + _IN_PLACE + _IN_PLACE_LISTS + _IN_PLACE_MAPS


def closed_objects(schema):
    """`schema` with `"additionalProperties": false` on each object schema that lists its
    properties and says nothing of others, as vLLM's default grammar engine (xgrammar's strict
    mode) and OpenAI's strict schemas treat them. JSON Schema's own default admits any other
    key, and a small model given a tool's parameters then invents keys until `max_tokens`
    (a LangChain `with_structured_output(method="function_calling")` got none back). A schema
    that sets `additionalProperties` (or `unevaluatedProperties`) keeps what it says.

    Only a schema that describes a whole object, alone, is closed. One that describes part of
    it, or a condition on it, stays open (and so do the root definitions it `$ref`s): the parts
    of an `allOf` of several, the `anyOf` / `oneOf` branches beside properties of their parent,
    `if` / `then` / `else` / `not` / `dependentSchemas`; so does a schema that has such parts.
    Closing those would refuse every object holding a key that another part lists. Changes
    `schema`."""
    nodes = list(_subschemas(schema))
    refs = {node["$ref"] for node, part in nodes if part and isinstance(node.get("$ref"), str)}
    left_open = {id(node) for node, part in nodes if part}
    for root in ("$defs", "definitions"):
        definitions = schema.get(root) if isinstance(schema, dict) else None
        if isinstance(definitions, dict):
            left_open |= {id(d) for name, d in definitions.items() if f"#/{root}/{name}" in refs}
    for node, _ in nodes:
        if (id(node) not in left_open and ("properties" in node or "patternProperties" in node)
                and not any(key in node for key in _OPEN_KEYS)):
            node["additionalProperties"] = False
    return schema


def _subschemas(schema):
    """Each subschema of `schema` (itself included), with whether it describes only part of an
    object (`closed_objects`). Follows the schema's keywords, not every dict, so that a
    property named "properties" is read as a name."""
    stack = [(schema, False)]
    while stack:
        node, part = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, part
        lists_properties = "properties" in node or "patternProperties" in node
        for keys, is_part in ((_CHILD, False), (_IN_PLACE, True)):
            for key in keys:
                value = node.get(key)     # (`items` may be a list: the old tuple form)
                stack.extend((item, is_part) for item in (value if isinstance(value, list) else [value]))
        for keys, is_part in ((_CHILD_MAPS, False), (_IN_PLACE_MAPS, True)):
            for key in keys:
                value = node.get(key)
                if isinstance(value, dict):
                    stack.extend((item, is_part) for item in value.values())
        for key in _CHILD_LISTS + _IN_PLACE_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                # A branch of a union describes the whole object unless its parent lists
                # properties of its own; the parts of an allOf of several never do.
                is_part = key in _IN_PLACE_LISTS and (lists_properties or (key == "allOf" and len(value) > 1))
                stack.extend((item, is_part) for item in value)


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
