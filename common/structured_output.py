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
    (a schema that is not JSON)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return llguidance.grammar_from("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        try:
            json.loads(spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"the schema is not valid JSON: {error}") from None
        return llguidance.grammar_from("json_schema", spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec)))
    if kind == "regex":
        return llguidance.grammar_from("regex", spec)
    return llguidance.grammar_from("grammar", spec)       # Lark, or GBNF (converted)


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
