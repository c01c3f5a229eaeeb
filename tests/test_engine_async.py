"""Asynchronous scheduling (the default on GPUs): step N+1 is launched before step N's tokens are read.
It must change when tokens are reported, never which tokens, nor what the pool holds after."""

import pytest
from helpers import generate, greedy

from common.sampling_params import SamplingParams
from worker.sequence import FinishReason


@pytest.fixture(scope="module")
def ids(smollm_tokenizer):
    from helpers import PROMPTS
    return [smollm_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def mixed_params(stop_token: int) -> list[SamplingParams]:
    """Every sampling feature that reads or ends on tokens, one request each."""
    return [greedy(20),
            SamplingParams(temperature=0.8, top_k=40, max_tokens=16, seed=5, n=3),
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=6, repetition_penalty=1.3),
            SamplingParams(temperature=0.7, max_tokens=16, seed=7, frequency_penalty=0.5, presence_penalty=0.4),
            greedy(20, stop_token_ids=[stop_token]),
            greedy(12, min_tokens=10, stop_token_ids=[stop_token]),
            SamplingParams(temperature=0.9, min_p=0.1, max_tokens=16, seed=8, logprobs=2),
            greedy(3)]


def run(make_engine, ids, async_scheduling: bool, stop_token: int, **settings):
    engine = make_engine(async_scheduling=async_scheduling, **settings)
    outputs = generate(engine, ids, mixed_params(stop_token))
    return engine, outputs


@pytest.mark.parametrize("settings", [
    {"max_num_batched_tokens": 64},
    # 24 blocks of 16 tokens for 10 sequences: preempted again and again, both ways
    {"max_num_batched_tokens": 64, "num_blocks": 24, "preemption_mode": "recompute"},
    {"max_num_batched_tokens": 64, "num_blocks": 24, "preemption_mode": "swap", "num_swap_blocks": 64},
], ids=["roomy", "recompute", "swap"])
def test_async_scheduling_generates_what_synchronous_scheduling_does(make_engine, ids, settings):
    reference_engine, reference = run(make_engine, ids, False, stop_token=0, **settings)
    # A stop token the greedy run really produces, so stopping one step late is exercised.
    stop_token = reference["r4"][0][4]
    reference_engine, reference = run(make_engine, ids, False, stop_token, **settings)
    engine, outputs = run(make_engine, ids, True, stop_token, **settings)
    assert outputs == reference
    assert outputs["r4"][0][-1] == stop_token and len(outputs["r4"][0]) < 20
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.swap_pool.num_free == engine.swap_pool.num_blocks
    if "num_blocks" in settings:
        assert sum(engine.scheduler.num_preemptions.values()) > 0


def test_a_stopped_sequence_reports_nothing_after_its_stop_token(make_engine, ids):
    engine = make_engine(async_scheduling=True)
    stop = generate(make_engine(), ids[:1], greedy(8))["r0"][0][2]
    engine.add_request("r", ids[0], greedy(8, stop_token_ids=[stop]))
    reported = []
    while engine.has_unfinished():
        reported += engine.step()
    assert [t for o in reported for t in o.new_token_ids][-1] == stop
    assert [o.finish_reason for o in reported][-1] == FinishReason.STOP
    assert sum(o.finish_reason is not None for o in reported) == 1
    assert engine.num_steps > len(reported)     # the step after the stop ran, and was dropped


def test_it_is_off_by_default_on_the_cpu_where_nothing_would_overlap(make_engine):
    assert make_engine().config.async_scheduling is False
    assert make_engine(async_scheduling=True).config.async_scheduling is True


def test_the_engine_takes_the_cpu_step_budget_unless_given_one(make_engine):
    assert make_engine().config.max_num_batched_tokens == 2048
    assert make_engine(max_num_batched_tokens=96).config.max_num_batched_tokens == 96
