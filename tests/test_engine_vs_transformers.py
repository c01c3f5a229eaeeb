"""The engine's greedy outputs and logits equal Hugging Face transformers' on the same weights."""

import json

import pytest
import torch
from helpers import PROMPTS, generate, greedy, tiny_hf_model

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
