"""The engine's greedy outputs and logits equal Hugging Face transformers' on the same weights."""

import json

import pytest
import torch
from helpers import LONG_STORY, PROMPTS, generate, greedy, tiny_hf_model

from common.sampling_params import SamplingParams
from worker.sequence import FinishReason

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids(smollm_tokenizer):
    return [smollm_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_smollm, prompt_ids):
    """transformers' greedy continuation of each prompt, run one prompt at a time (no padding)."""
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            seq = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out.append(seq[0, len(ids):].tolist())
    return out


def outputs(results):
    return [results[f"r{i}"][0] for i in range(len(results))]


def test_prompts_cover_multiple_blocks_and_exceed_the_step_budget(prompt_ids):
    lengths = sorted(len(ids) for ids in prompt_ids)
    assert lengths[-2] > 3 * 16 and lengths[-1] > 128


def test_concurrent_greedy_matches_transformers_with_chunked_prefill(make_engine, prompt_ids, reference):
    engine = make_engine(max_num_batched_tokens=128)
    assert outputs(generate(engine, prompt_ids, greedy(NEW_TOKENS))) == reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_unchanged_under_repeated_preemption(make_engine, prompt_ids, reference, mode):
    longest = max(len(ids) for ids in prompt_ids) + NEW_TOKENS
    # A pool that holds just the longest request: the others keep preempting each other.
    engine = make_engine(max_num_batched_tokens=128, num_blocks=-(-longest // 16),
                         preemption_mode=mode, num_swap_blocks=64)
    assert outputs(generate(engine, prompt_ids, greedy(NEW_TOKENS))) == reference
    assert engine.scheduler.num_preemptions[mode] >= 3


@pytest.mark.parametrize("block_size", [8, 32])
def test_greedy_independent_of_block_size(make_engine, prompt_ids, reference, block_size):
    engine = make_engine(block_size=block_size, max_num_batched_tokens=96)
    assert outputs(generate(engine, prompt_ids, greedy(NEW_TOKENS))) == reference


def test_prefix_cache_hits_for_shared_prefix_and_output_unchanged(make_engine, smollm_tokenizer, hf_smollm):
    from helpers import LONG_STORY
    prompts = [smollm_tokenizer.encode(LONG_STORY + q, add_special_tokens=False)
               for q in ("Who rowed the boat?", "What did the keeper write?")]
    cached, uncached = make_engine(), make_engine(enable_prefix_caching=False)
    first = generate(cached, prompts[:1], greedy(12))["r0"][0]
    second = generate(cached, prompts[1:], greedy(12))["r0"][0]
    assert cached.blocks.prefix_hits >= len(prompts[1]) // 16 - 2
    assert uncached.blocks.prefix_hits == 0
    assert outputs(generate(uncached, prompts, greedy(12))) == [first, second]


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral"])
def test_teacher_forced_logits_match_transformers(tmp_path, kind):
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    hf = tiny_hf_model(tmp_path, kind)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"]
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_blocks=64))
    ids = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = engine.prompt_logits(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


# ------------------------------------------------------------------ prompt logprobs

@pytest.fixture(scope="module")
def story_ids(smollm_tokenizer):
    """A prompt of five blocks (80 tokens): several chunks under a step budget of 16."""
    return smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)[:80]


@pytest.fixture(scope="module")
def teacher_forced(hf_smollm, story_ids):
    """transformers' log-softmax at every position of the prompt, fed in whole."""
    with torch.no_grad():
        return hf_smollm(torch.tensor([story_ids])).logits[0].log_softmax(-1)


def score(engine, prompt_ids, top_n: int = 2, max_tokens: int = 0, steps_before=None):
    """Runs one request for the prompt's logprobs to its end: (the prompt logprobs, in the
    order they came, the outputs that carried them, the generated tokens, the finish reason)."""
    engine.add_request("s", prompt_ids, SamplingParams(temperature=0, prompt_logprobs=top_n,
                                                       max_tokens=max_tokens))
    entries, carriers, tokens, reason = [], [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            entries += out.prompt_logprobs or []
            carriers += [out] if out.prompt_logprobs else []
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
        if steps_before is not None:
            steps_before = steps_before(engine)
    return entries, carriers, tokens, reason


def assert_teacher_forced(entries, ids, reference, top_n: int = 2):
    """Entry i holds prompt token i + 1's logprob and the top `top_n` at its position, as the
    reference says (the top ones compared by value, and each listed id's own value, so that
    tokens tied in value may come in either order)."""
    assert len(entries) == len(ids) - 1 and all(len(top) == top_n for _, top in entries)
    positions = torch.arange(len(ids) - 1)
    chosen = torch.tensor([lp for lp, _ in entries])
    torch.testing.assert_close(chosen, reference[positions, torch.tensor(ids[1:])], atol=1e-4, rtol=0)
    top_ids = torch.tensor([[t for t, _ in top] for _, top in entries])
    top_values = torch.tensor([[v for _, v in top] for _, top in entries])
    torch.testing.assert_close(top_values, reference[:-1].topk(top_n).values, atol=1e-4, rtol=0)
    torch.testing.assert_close(top_values, reference[positions[:, None], top_ids], atol=1e-4, rtol=0)


def test_prompt_logprobs_equal_transformers_teacher_forcing_across_a_chunked_prefill(
        make_engine, story_ids, teacher_forced):
    entries, carriers, _, _ = score(make_engine(max_num_batched_tokens=16), story_ids)
    assert len(carriers) == len(story_ids) // 16                # one output per prompt chunk
    assert_teacher_forced(entries, story_ids, teacher_forced)


def test_a_prompt_scored_with_max_tokens_0_generates_nothing_and_ends_with_length(make_engine, story_ids):
    engine = make_engine()
    entries, _, tokens, reason = score(engine, story_ids[:20])
    assert (len(entries), tokens, reason) == (19, [], FinishReason.LENGTH)
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.requests


def test_prompt_logits_are_computed_max_logits_rows_at_a_time(make_engine, story_ids, teacher_forced, monkeypatch):
    import worker.model_runner
    monkeypatch.setattr(worker.model_runner, "MAX_LOGITS_ROWS", 8)
    engine = make_engine(max_num_batched_tokens=40)
    rows_at_once = []
    compute_logits = engine.runner.model.compute_logits

    def counting(hidden):
        rows_at_once.append(hidden.shape[0])
        return compute_logits(hidden)
    monkeypatch.setattr(engine.runner.model, "compute_logits", counting)
    entries, *_ = score(engine, story_ids)
    assert max(rows_at_once) == 8 and sum(rows_at_once) == len(story_ids) - 1
    assert_teacher_forced(entries, story_ids, teacher_forced)


def test_a_cached_prefix_does_not_cut_the_prompt_logprobs_short(make_engine, story_ids, teacher_forced):
    engine = make_engine()
    generate(engine, [story_ids], greedy(2))                   # caches the story's blocks
    hits = engine.blocks.prefix_hits
    entries, *_ = score(engine, story_ids)
    assert engine.blocks.prefix_hits == hits                  # the scored prompt computed them all
    assert_teacher_forced(entries, story_ids, teacher_forced)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
def test_prompt_logprobs_survive_recompute_preemption_mid_prefill_each_sent_once(
        make_engine, story_ids, teacher_forced, prefix_caching):
    def preempt_after_two_chunks(engine):
        seq = engine.requests["s"][0]
        if seq.num_computed == 32:
            engine.preempt("s", "recompute")
            return None
        return preempt_after_two_chunks
    engine = make_engine(max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    entries, *_ = score(engine, story_ids, steps_before=preempt_after_two_chunks)
    assert engine.scheduler.num_preemptions["recompute"] == 1
    # With the cache, the two blocks already scored come from it; without, they are recomputed.
    assert engine.blocks.prefix_hits == (2 if prefix_caching else 0)
    assert_teacher_forced(entries, story_ids, teacher_forced)


def test_prompt_logprobs_all_come_by_the_first_token_under_asynchronous_scheduling(
        make_engine, story_ids, teacher_forced):
    engine = make_engine(max_num_batched_tokens=16, async_scheduling=True)
    entries, carriers, tokens, _ = score(engine, story_ids, max_tokens=2)
    assert carriers[-1].new_token_ids == tokens[:1] == [teacher_forced[-1].argmax().item()]
    assert_teacher_forced(entries, story_ids, teacher_forced)
