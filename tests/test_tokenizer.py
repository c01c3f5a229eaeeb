"""router.tokenizer: the tokenizer rebuilt from a worker's Info, as logprobs use it."""

import pytest

from router.tokenizer import RouterTokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer) -> RouterTokenizer:
    return RouterTokenizer(smollm_tokenizer)


def test_the_bytes_of_the_tokens_of_a_split_character_join_into_it(tokenizer):
    ids = tokenizer.encode_text(" 🦀")
    assert len(ids) > 1 and any("\ufffd" in tokenizer.token_text(i) for i in ids)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == " 🦀".encode()


def test_a_whole_tokens_bytes_are_its_text(tokenizer):
    [love] = tokenizer.encode_text(" love")
    assert tokenizer.token_bytes(love) == b" love" and tokenizer.token_piece(love) == "Ġlove"


def test_a_special_tokens_bytes_are_its_text(tokenizer):
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.token_bytes(end) == b"<|im_end|>"


def test_a_byte_fallback_token_is_its_byte():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<0xE2>": 1, "▁hi": 2}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer = RouterTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend))
    assert tokenizer.token_bytes(1) == b"\xe2"
