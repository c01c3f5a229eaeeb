"""Structured outputs in the engine (worker.structured and its use by worker.engine), on the real
SmolLM2: every output follows its constraint, whatever else the batch, the pool or a move does.
"""

import json
import re

import jsonschema
import pytest
from helpers import generate

from common.sampling_params import InvalidRequest, SamplingParams, StructuredOutput
from common.structured_output import grammar_of
from worker.sequence import FinishReason
from worker.structured import spells

# Bounded sizes, so that even a rambling 135M model completes the object within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
QUESTIONS = ["Describe a user of a web shop as JSON.", "Who is the admin here? Answer in JSON.",
             "Invent a guest for a party, as a JSON object.", "A person from Paris, please, in JSON."]


@pytest.fixture(scope="module")
def chat_ids(smollm_tokenizer):
    def ids(question: str) -> list[int]:
        text = smollm_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                    add_generation_prompt=True, tokenize=False)
        return smollm_tokenizer.encode(text, add_special_tokens=False)
    return ids


@pytest.fixture
def engine(make_engine):
    return make_engine(num_blocks=256)


def constrained(kind: str, spec=None, **kw) -> SamplingParams:
    kw = {"temperature": 0.0, "max_tokens": 120} | kw
    return SamplingParams(structured_output=StructuredOutput(kind, spec), **kw)


def texts(tokenizer, results: dict) -> list[str]:
    return [tokenizer.decode(choice, skip_special_tokens=True) for r in results.values() for choice in r]


def test_json_schema_outputs_validate_against_the_schema(engine, chat_ids, smollm_tokenizer):
    params = constrained("json_schema", json.dumps(PERSON))
    outputs = texts(smollm_tokenizer, generate(engine, [chat_ids(q) for q in QUESTIONS], params))
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("text,follows", [('{"a": [1, {"b": null}], "c": "d"}', True), ("[1, 2]", False)])
def test_a_json_object_is_any_object_and_nothing_else(engine, smollm_tokenizer, text, follows):
    matcher = engine.grammars.matcher(StructuredOutput("json_object"))
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) == follows


def follows(engine, tokenizer, constraint: StructuredOutput, text: str) -> bool:
    """Whether the whole of `text` is an output `constraint` accepts."""
    matcher = engine.grammars.matcher(constraint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


OPEN_ENDED = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_an_object_schema_silent_on_other_properties_admits_none(engine, smollm_tokenizer):
    """As vLLM's default engine and OpenAI's strict schemas read it: a tool's parameters
    without `additionalProperties` are exactly its parameters."""
    schema = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"outer": OPEN_ENDED}}))
    assert follows(engine, smollm_tokenizer, schema, '{"outer": {"a": 1}}')
    assert not follows(engine, smollm_tokenizer, schema, '{"outer": {"a": 1, "b": 2}}')
    assert not follows(engine, smollm_tokenizer, schema, '{"outer": {"a": 1}, "b": 2}')


def test_an_object_schema_that_allows_other_properties_keeps_them(engine, smollm_tokenizer):
    schema = StructuredOutput("json_schema", json.dumps(OPEN_ENDED | {"additionalProperties": True}))
    assert follows(engine, smollm_tokenizer, schema, '{"a": 1, "b": 2}')


def test_the_parts_of_an_all_of_stay_open_so_that_their_intersection_is_satisfiable(engine, smollm_tokenizer):
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    schema = StructuredOutput("json_schema", json.dumps({"allOf": [OPEN_ENDED, {"$ref": "#/$defs/B"}], "$defs": {"B": b}}))
    assert follows(engine, smollm_tokenizer, schema, '{"a": 1, "b": 2}')


def test_the_branches_beside_a_schema_s_own_properties_stay_open_and_so_does_it(engine, smollm_tokenizer):
    schema = StructuredOutput("json_schema", json.dumps(OPEN_ENDED | {"anyOf": [
        {"properties": {"b": {"type": "integer"}}, "required": ["b"]}, {"required": ["a"]}]}))
    assert follows(engine, smollm_tokenizer, schema, '{"a": 1, "b": 2}')


def test_the_branches_of_a_union_of_objects_are_closed(engine, smollm_tokenizer):
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    schema = StructuredOutput("json_schema", json.dumps({"anyOf": [OPEN_ENDED, b]}))
    assert follows(engine, smollm_tokenizer, schema, '{"b": 2}')
    assert not follows(engine, smollm_tokenizer, schema, '{"b": 2, "c": 3}')


def test_a_property_named_properties_is_a_name_not_a_keyword(engine, smollm_tokenizer):
    inner = {"type": "object", "properties": {"properties": {"type": "integer"}}, "required": ["properties"]}
    schema = StructuredOutput("json_schema", json.dumps(inner))
    assert follows(engine, smollm_tokenizer, schema, '{"properties": 3}')
    assert not follows(engine, smollm_tokenizer, schema, '{"properties": 3, "additionalProperties": 4}')


def test_regex_output_matches_the_whole_pattern(engine, chat_ids, smollm_tokenizer):
    pattern = r"[0-9]{3}-[0-9]{4} \((home|work)\)"
    params = constrained("regex", pattern, temperature=1.0, seed=7)
    for text in texts(smollm_tokenizer, generate(engine, [chat_ids("My phone number?")] * 3, params)):
        assert re.fullmatch(pattern, text), text


def test_choice_output_is_one_of_the_choices(engine, chat_ids, smollm_tokenizer):
    choices = ("positive", "negative", "neutral")
    params = constrained("choice", choices, temperature=1.0, seed=3)
    outputs = texts(smollm_tokenizer, generate(engine, [chat_ids("I loved this film!")] * 4, params))
    assert set(outputs) <= set(choices)


@pytest.mark.parametrize("grammar", [
    'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,8}/',
    'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z] [a-z]? [a-z]?',
], ids=["lark", "gbnf"])
def test_a_grammar_constrains_the_output(engine, chat_ids, smollm_tokenizer, grammar):
    params = constrained("grammar", grammar, temperature=1.0, seed=5)
    for text in texts(smollm_tokenizer, generate(engine, [chat_ids("Greet someone.")] * 2, params)):
        assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}!", text), text


def test_a_complete_output_ends_with_finish_reason_stop(engine, chat_ids):
    engine.add_request("r", chat_ids("Yes or no?"), constrained("choice", ("yes", "no")))
    finish = [o.finish_reason for _ in range(40) for o in engine.step() if o.finish_reason]
    assert finish == [FinishReason.STOP] and not engine.has_unfinished()


def test_n_choices_each_follow_the_schema(engine, chat_ids, smollm_tokenizer):
    params = constrained("json_schema", json.dumps(PERSON), n=2, temperature=0.9, seed=11)
    outputs = texts(smollm_tokenizer, generate(engine, [chat_ids(QUESTIONS[2])], params))
    assert len(outputs) == 2
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)


def test_constrained_and_unconstrained_rows_share_a_batch_without_changing_the_free_ones(
        engine, make_engine, chat_ids):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = generate(make_engine(num_blocks=256), [chat_ids(QUESTIONS[1])], free)["r0"]
    mixed = generate(engine, [chat_ids(QUESTIONS[1]), chat_ids(QUESTIONS[0])],
                     [free, constrained("json_schema", json.dumps(PERSON), max_tokens=40)])
    assert mixed["r0"] == alone


def test_asynchronous_scheduling_gives_the_same_constrained_outputs(make_engine, chat_ids):
    """Asynchronous (the GPU default): each constrained step reads the step before it between
    its forward and its sampling, and a choice that read ends keeps its row in the batch."""
    prompts = [chat_ids("My phone number?"), chat_ids("Say something nice.")]
    params = [constrained("regex", r"[0-9]{3}-[0-9]{4}"), constrained("regex", r"[a-z ]{10,30}\.", max_tokens=40)]
    runs = [generate(make_engine(num_blocks=256, async_scheduling=mode), prompts, params) for mode in (False, True)]
    assert runs[0] == runs[1]


def test_output_under_recompute_preemption_still_follows_the_schema(make_engine, chat_ids,
                                                                   smollm_tokenizer):
    # A pool too small for all four: sequences are preempted (recompute) and come back.
    engine = make_engine(num_blocks=12, preemption_mode="recompute", max_num_batched_tokens=64)
    params = constrained("json_schema", json.dumps(PERSON), temperature=0.8, seed=2)
    outputs = texts(smollm_tokenizer, generate(engine, [chat_ids(q) for q in QUESTIONS], params))
    assert engine.stats().preemptions.get("recompute", 0) > 0
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)


def test_a_resumed_request_continues_its_grammar_from_the_tokens_it_carries(engine, make_engine, chat_ids):
    """A request moved to another worker arrives with its output so far: the matcher is rebuilt
    from those tokens, and the rest is what the uninterrupted run gives."""
    prompt, params = chat_ids(QUESTIONS[3]), constrained("json_schema", json.dumps(PERSON))
    [whole] = generate(engine, [prompt], params)["r0"]
    other = make_engine(num_blocks=256)
    other.add_request("moved", prompt, params, output_token_ids=whole[:9])
    rest = []
    while other.has_unfinished():
        rest += [t for o in other.step() for t in o.new_token_ids]
    assert whole[:9] + rest == whole


def test_output_tokens_that_break_the_grammar_are_refused(engine, chat_ids, smollm_tokenizer):
    wrong = smollm_tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(InvalidRequest, match=r"output_token_ids\[0\].* does not follow"):
        engine.add_request("bad", chat_ids("Yes?"), constrained("choice", ("yes", "no")),
                           output_token_ids=wrong)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kind,spec,problem", [
    ("json_schema", '{"type": "objec"}', "Invalid type"),
    ("json_schema", '{"items": ' * 5000 + "{}" + "}" * 5000, "nested too deeply"),
    ("regex", "a(b", "unclosed group"),
    ("grammar", "start: foo", "unknown name"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_it(engine, kind, spec, problem):
    with pytest.raises(InvalidRequest, match=f"(?s)structured_output.{kind} does not compile: .*{problem}"):
        engine.add_request("bad", [1, 2, 3], constrained(kind, spec))


def test_a_constraint_compiles_once_for_all_its_requests(engine, chat_ids):
    schema = json.dumps(PERSON)
    generate(engine, [chat_ids(q) for q in QUESTIONS[:2]], constrained("json_schema", schema, max_tokens=4))
    generate(engine, [chat_ids(QUESTIONS[2])], constrained("json_schema", schema, max_tokens=4))
    assert list(engine.grammars._compiled) == [StructuredOutput("json_schema", schema)]


def outputs_of(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Runs the requests together to the end: request id -> its outputs, in order."""
    got = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    return got


# Fine to compile, but past the grammar engine's 2,000 items a parser row once the object opens.
WIDE = json.dumps({"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(600)}})


def test_a_grammar_too_complex_for_the_grammar_engine_fails_its_request_naming_the_limit(engine, chat_ids):
    got = outputs_of(engine, {"wide": (chat_ids("An object, please."), constrained("json_schema", WIDE))})
    last = got["wide"][-1]
    assert last.finish_reason == FinishReason.ERROR and not last.fault
    assert re.match(r"structured_output: the grammar engine stopped at output token 0: .*max is 2000", last.error)
    assert [t for out in got["wide"] for t in out.new_token_ids] == []


@pytest.mark.parametrize("kind, spec", [("grammar", "start: a\na: a"), ("grammar", "root ::= root"),
                                        ("json_schema", '{"$ref": "#"}')])
def test_a_grammar_no_text_satisfies_is_refused(engine, chat_ids, kind, spec):
    """It used to be taken, allowed only the end, and reported complete with empty output."""
    with pytest.raises(InvalidRequest, match=f"^structured_output.{kind} admits no output: no text satisfies it"):
        engine.add_request("empty", chat_ids("Anything."), constrained(kind, spec))
    assert not engine.has_unfinished()


def test_a_grammar_the_grammar_engine_gave_up_on_fails_every_request_under_it(engine, chat_ids):
    """Copies of a compiled grammar share the lexer state that reached the engine's limit: the
    second request used to start from it, be allowed only the end, and end as if complete."""
    params = constrained("regex", "b{1000000}", max_tokens=6)
    for attempt in range(3):
        got = outputs_of(engine, {f"r{attempt}": (chat_ids("Answer:"), params)})[f"r{attempt}"]
        assert got[-1].finish_reason == FinishReason.ERROR, (attempt, got)
        assert "the grammar engine stopped at output token 0: lexer error" in got[-1].error


def test_constraints_that_rule_out_every_token_fail_the_request_naming_them(engine, chat_ids):
    params = constrained("choice", ("yes",), allowed_token_ids=[42])
    [out] = outputs_of(engine, {"r": (chat_ids("Yes?"), params)})["r"]
    assert out.finish_reason == FinishReason.ERROR and not out.fault
    assert out.error == ("no token may come at output token 0: structured_output, allowed_token_ids together "
                         "rule out every token")


def test_min_tokens_with_only_the_end_allowed_fails_the_request_once_no_token_is_left(engine, chat_ids):
    end = sorted(engine.eos_token_ids)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, allowed_token_ids=[end])
    [out] = outputs_of(engine, {"r": (chat_ids("Hi"), params)})["r"]
    assert out.error == "no token may come at output token 0: allowed_token_ids, min_tokens together rule out every token"


def test_a_failed_request_frees_its_blocks_and_leaves_its_batch_neighbours_unchanged(engine, chat_ids):
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = outputs_of(engine, {"free": (chat_ids("Name a colour."), free)})["free"]
    together = outputs_of(engine, {"free": (chat_ids("Name a colour."), free),
                                   "wide": (chat_ids("An object, please."), constrained("json_schema", WIDE))})
    assert [o.new_token_ids for o in together["free"]] == [o.new_token_ids for o in alone]
    assert together["wide"][-1].finish_reason == FinishReason.ERROR
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_literal_spelling_a_special_token_is_generated_as_text(engine, chat_ids, smollm_tokenizer):
    """The grammar's "<|im_end|>" is text: the special token (the end of a chat turn) must not
    stand in for it, nor end the output before the rest of the literal."""
    pattern = r"Done<\|im_end\|> (yes|no)"
    engine.add_request("r", chat_ids("Finished?"), constrained("regex", pattern))
    outputs = [o for _ in range(60) for o in engine.step()]
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert smollm_tokenizer.convert_tokens_to_ids("<|im_end|>") not in tokens[:-1]
    assert re.fullmatch(pattern, smollm_tokenizer.decode(tokens, skip_special_tokens=True))


@pytest.mark.parametrize("kind, spec", [
    ("regex", r"Done<\|im_end\|>"), ("regex", "Done<[|]im_end[|]>"), ("choice", ("a<|im_end|>", "b")),
    ("json_schema", r'{"const": "\u003c|im_end|>"}'), ("grammar", 'start: "<|im_end|>" "x"')])
def test_a_grammar_spelling_a_special_token_is_recognised_however_written(kind, spec):
    assert spells(grammar_of(StructuredOutput(kind, spec)), ["<|endoftext|>", "<|im_end|>"])


def test_a_grammar_spelling_no_special_token_is_not_taken_for_one():
    schema = {"type": "object", "properties": {"im_end": {"type": "string", "pattern": "<|>"}}}
    assert not spells(grammar_of(StructuredOutput("json_schema", json.dumps(schema))), ["<|im_end|>"])
