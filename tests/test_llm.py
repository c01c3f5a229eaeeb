"""The offline API: `LLM(model).generate(prompts, params)` in-process, as README shows it."""

import pytest
from helpers import PROMPTS, generate, greedy

from common.sampling_params import InvalidRequest, SamplingParams
from worker.llm import LLM


@pytest.fixture(scope="module")
def llm():
    with LLM("default", device="cpu", dtype="float32", num_blocks=256) as model:
        yield model


def test_text_prompts_give_the_engines_greedy_tokens_and_their_text(llm, make_engine, smollm_tokenizer):
    prompts = PROMPTS[:3]
    completions = llm.generate(prompts, greedy(10))
    expected = generate(make_engine(), [smollm_tokenizer.encode(p) for p in prompts], greedy(10))
    for i, completion in enumerate(completions):
        (choice,) = completion.choices
        assert choice.token_ids == expected[f"r{i}"][0]
        assert choice.text == smollm_tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert choice.finish_reason in ("stop", "length")


def test_token_id_prompt_and_n_choices(llm, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPTS[0])
    (completion,) = llm.generate(ids, SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=6, ignore_eos=True))
    assert completion.prompt_token_ids == ids
    assert [len(c.token_ids) for c in completion.choices] == [6, 6, 6]
    assert [c.finish_reason for c in completion.choices] == ["length"] * 3


def test_a_scored_prompt_has_a_logprob_per_token_the_first_none_and_no_output(llm, smollm_tokenizer):
    (completion,) = llm.generate(PROMPTS[0], SamplingParams(prompt_logprobs=2, max_tokens=0))
    first, *rest = completion.prompt_logprobs
    assert first is None and len(rest) == len(completion.prompt_token_ids) - 1
    assert all(logprob <= 0 and len(top) == 2 for logprob, top in rest)
    assert completion.choices[0].token_ids == [] and completion.choices[0].finish_reason == "length"


def test_text_needs_a_tokenizer(tmp_path):
    from helpers import tiny_hf_model
    tiny_hf_model(tmp_path, "llama3")     # weights and config, no tokenizer files
    with LLM(str(tmp_path), device="cpu", num_blocks=32) as model:
        assert model.generate([1, 2, 3], greedy(2, ignore_eos=True))[0].choices[0].token_ids
        with pytest.raises(InvalidRequest, match="has no tokenizer: give prompts as token ids"):
            model.generate("hello", greedy(2))


def test_two_ranks_generate_what_one_does(llm):
    params = greedy(12, ignore_eos=True)
    with LLM("default", device="cpu", dtype="float32", num_blocks=256, tensor_parallel_size=2) as two:
        assert [c.choices[0].text for c in two.generate(PROMPTS[:2], params)] == \
            [c.choices[0].text for c in llm.generate(PROMPTS[:2], params)]
