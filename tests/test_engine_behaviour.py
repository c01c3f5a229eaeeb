"""Engine behaviour on the real SmolLM2: block accounting, aborts, sampling, limits."""

import time

import pytest
from helpers import LONG_STORY, PROMPTS, generate, generate_with_a_swap, greedy, overflowing_adapter

from common.sampling_params import InvalidRequest, SamplingParams, choice_seed
from worker.sequence import FinishReason


@pytest.fixture(scope="module")
def ids(smollm_tokenizer):
    return [smollm_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture
def engine(make_engine):
    return make_engine(max_num_batched_tokens=64, num_blocks=128)


def sampled(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=seed, **kw)


def test_every_block_is_free_after_all_requests_finish(engine, ids):
    generate(engine, ids, greedy(8))
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert not engine.requests


def test_abort_mid_prefill_frees_blocks(engine, ids):
    long = max(ids, key=len)
    engine.add_request("long", long, greedy(8))
    engine.step()                                     # first 64-token chunk only
    seq = engine.requests["long"][0]
    assert 0 < seq.num_computed < len(long)
    assert engine.abort("long")
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_unfinished()


def test_abort_mid_decode_frees_blocks_and_spares_others(engine, ids):
    engine.add_request("a", ids[0], greedy(30))
    engine.add_request("b", ids[1], greedy(6))
    tokens_b = []
    for _ in range(3):
        tokens_b += [t for o in engine.step() if o.request_id == "b" for t in o.new_token_ids]
    assert engine.requests["a"][0].num_output > 0
    engine.abort("a")
    while engine.has_unfinished():
        tokens_b += [t for o in engine.step() for t in o.new_token_ids]
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert len(tokens_b) == 6


def test_abort_of_unknown_request_returns_false(engine):
    assert engine.abort("nope") is False


def test_a_temperature_below_1e_5_gives_the_greedy_tokens(engine, ids):
    tiny = generate(engine, [ids[0]], SamplingParams(temperature=1e-38, max_tokens=24, seed=1))
    assert tiny == generate(engine, [ids[0]], greedy(24))


def test_seeded_sampling_reproducible_across_runs_and_batch_company(make_engine, ids):
    alone = generate(make_engine(), [ids[3]], sampled(1234))["r0"]
    again = generate(make_engine(), [ids[3]], sampled(1234))["r0"]
    crowd = generate(make_engine(max_num_batched_tokens=32), [ids[0], ids[3], ids[5]],
                     [sampled(None), sampled(1234), sampled(7)])["r1"]
    assert alone == again == crowd


def test_different_seeds_give_different_samples(engine, ids):
    out = generate(engine, [ids[3]] * 2, [sampled(1), sampled(2)])
    assert out["r0"] != out["r1"]


def test_seeded_output_unchanged_by_preemption(make_engine, ids):
    reference = generate(make_engine(), ids, sampled(99))
    tight = make_engine(max_num_batched_tokens=128, num_blocks=-(-max(map(len, ids)) // 16) + 3)
    assert generate(tight, ids, sampled(99)) == reference
    assert sum(tight.scheduler.num_preemptions.values()) > 0


def test_n_choices_share_prompt_and_equal_single_requests_with_choice_seeds(make_engine, ids):
    engine = make_engine()
    free_before = engine.blocks.num_free
    engine.add_request("n", ids[6], sampled(5, n=3))
    choices = [[] for _ in range(3)]
    while len(engine.requests["n"]) < 3:
        for o in engine.step():
            choices[o.index] += o.new_token_ids
    used = free_before - engine.blocks.num_free
    assert used <= len(ids[6]) // 16 + 3               # full prompt blocks held once, not 3 times
    while engine.has_unfinished():
        for o in engine.step():
            choices[o.index] += o.new_token_ids
    singles = generate(make_engine(), [ids[6]] * 3, [sampled(choice_seed(5, i)) for i in range(3)])
    assert choices == [singles[f"r{i}"][0] for i in range(3)]
    assert len({tuple(c) for c in choices}) > 1


def test_stop_token_id_ends_with_stop_reason(engine, ids):
    free_run = generate(engine, [ids[0]], greedy(10))["r0"][0]
    stop_at = free_run[4]
    engine.add_request("s", ids[0], greedy(10, stop_token_ids=[stop_at]))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == free_run[:free_run.index(stop_at) + 1]
    assert outs[-1].finish_reason == FinishReason.STOP


def test_max_tokens_ends_with_length_reason(engine, ids):
    engine.add_request("m", ids[1], greedy(3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 3 and outs[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_holds_back_eos(engine, smollm_tokenizer):
    chat = smollm_tokenizer.encode("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    short = generate(engine, [chat], greedy(200))["r0"][0]
    assert short[-1] == 2 and len(short) < 40         # the model ends its answer with EOS
    longer = generate(engine, [chat], greedy(200, min_tokens=len(short) + 5))["r0"][0]
    assert len(longer) >= len(short) + 5 and 2 not in longer[:len(short) + 5]


def test_ignore_eos_generates_all_max_tokens(engine, smollm_tokenizer):
    chat = smollm_tokenizer.encode("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    out = generate(engine, [chat], greedy(60, ignore_eos=True))["r0"][0]
    assert len(out) == 60


def greedy_text(engine, tokenizer, prompt: str, **params) -> str:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return tokenizer.decode(generate(engine, [ids], greedy(16, **params))["r0"][0])


def test_a_bad_word_of_one_token_is_kept_out_at_a_texts_start_and_after_a_space(engine, smollm_tokenizer):
    assert greedy_text(engine, smollm_tokenizer, "The capital of France is").startswith(" Paris")
    for prompt in ("The capital of France is", "The capital of France is:\n"):
        assert "Paris" not in greedy_text(engine, smollm_tokenizer, prompt, bad_words=["Paris"])


WIZARD = "Once upon a time, in a small village by the sea,"     # greedy: "... a wise old wizard named"


def test_a_bad_word_of_several_tokens_is_kept_out(engine, smollm_tokenizer):
    assert len(smollm_tokenizer.encode(" wizard", add_special_tokens=False)) == 2
    assert "wizard" in greedy_text(engine, smollm_tokenizer, WIZARD)
    assert "wizard" not in greedy_text(engine, smollm_tokenizer, WIZARD, bad_words=["wizard"])


def test_bad_words_give_the_same_output_under_asynchronous_scheduling(engine, make_engine, smollm_tokenizer):
    banned = greedy_text(engine, smollm_tokenizer, WIZARD, bad_words=["wizard", "old"])
    assert greedy_text(make_engine(async_scheduling=True), smollm_tokenizer, WIZARD,
                       bad_words=["wizard", "old"]) == banned


def test_n_choices_get_the_prompt_logprobs_once_with_choice_0(engine, ids):
    engine.add_request("p", ids[0], SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=3, prompt_logprobs=1))
    counts, tokens = [0, 0], [0, 0]
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.index] += len(out.prompt_logprobs or ())
            tokens[out.index] += len(out.new_token_ids)
    assert counts == [len(ids[0]) - 1, 0] and tokens == [3, 3]


def test_logprobs_top_n_sorted_and_contain_greedy_choice(engine, ids):
    engine.add_request("l", ids[0], greedy(4, logprobs=5))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    for o in outs:
        (chosen, top), = o.logprobs
        assert len(top) == 5
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0] == (o.new_token_ids[0], pytest.approx(chosen))


def first_outputs(engine):
    """The first step outputs there are (with asynchronous scheduling, a step reports the
    tokens of the step before it)."""
    while not (outputs := engine.step()):
        pass
    return outputs


def test_priority_policy_serves_urgent_request_first(make_engine, ids):
    engine = make_engine(scheduling_policy="priority", max_num_seqs=1)
    engine.add_request("late", ids[0], greedy(3), priority=5)
    engine.add_request("urgent", ids[1], greedy(3), priority=-1)
    assert [o.request_id for o in first_outputs(engine)] == ["urgent"]


def test_fcfs_serves_prompts_of_equal_length_in_arrival_order(make_engine, ids):
    engine = make_engine(max_num_seqs=1)
    engine.add_request("first", ids[0], greedy(3), priority=5)
    engine.add_request("second", ids[0], greedy(3), priority=-1)
    assert [o.request_id for o in first_outputs(engine)] == ["first"]


def _plans(engine, steps: int) -> list[dict[str, int]]:
    plans = []
    for _ in range(steps):
        engine.step()
        plans.append({s.seq.request_id: s.num_tokens for s in engine.last_plan.scheduled})
    return plans


def test_a_short_prompt_goes_before_the_rest_of_an_earlier_long_one(make_engine, smollm_tokenizer):
    engine = make_engine(max_num_batched_tokens=64)
    story = 3 * smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    engine.add_request("document", story[:150], greedy(2))
    engine.add_request("short", story[150:170], greedy(2))
    assert _plans(engine, 1) == [{"short": 20, "document": 44}]


def test_a_decode_is_not_held_back_by_an_earlier_prompts_chunks(make_engine, smollm_tokenizer):
    engine = make_engine(max_num_batched_tokens=64)
    story = 3 * smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    engine.add_request("document", story[:200], greedy(2))
    engine.add_request("short", story[200:210], greedy(4))
    assert _plans(engine, 3) == [{"short": 10, "document": 54}, {"short": 1, "document": 63},
                                 {"short": 1, "document": 63}]


def test_a_prompt_waiting_past_the_aging_bound_goes_before_shorter_ones(make_engine, smollm_tokenizer):
    from worker.scheduler import PROMPT_AGING_S

    engine = make_engine(max_num_batched_tokens=64)
    story = 3 * smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    engine.add_request("document", story[:150], greedy(2), arrival=time.monotonic() - PROMPT_AGING_S - 1)
    engine.add_request("short", story[150:170], greedy(2))
    assert _plans(engine, 1) == [{"document": 64}]


def test_a_long_prompt_takes_at_most_the_long_prefill_threshold_a_step(make_engine, smollm_tokenizer):
    """A document arriving first leaves room beside it: the short prompt behind it gets all
    its tokens in the first step, the document 24 of them a step until it is done."""
    engine = make_engine(max_num_batched_tokens=64, long_prefill_token_threshold=24)
    story = smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    engine.add_request("document", story[:100], greedy(2))
    engine.add_request("short", story[100:120], greedy(2))
    steps = []
    while engine.has_unfinished():
        engine.step()
        steps.append({s.seq.request_id: s.num_tokens for s in engine.last_plan.scheduled})
    assert steps[0] == {"document": 24, "short": 20}
    assert [step["document"] for step in steps[:5]] == [24, 24, 24, 24, 4]


def test_the_long_prefill_threshold_changes_no_output(make_engine, ids):
    assert generate(make_engine(long_prefill_token_threshold=8), ids, greedy(6)) == \
        generate(make_engine(), ids, greedy(6))


def test_a_negative_long_prefill_threshold_is_refused(make_engine):
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1 must be >= 0"):
        make_engine(long_prefill_token_threshold=-1)


def test_prompt_longer_than_max_model_len_rejected(make_engine, ids):
    engine = make_engine(max_model_len=32)
    with pytest.raises(InvalidRequest, match="prompt has .* tokens; the maximum is 31"):
        engine.add_request("x", ids[7], greedy())


def test_prompt_larger_than_the_whole_pool_rejected(make_engine, smollm_tokenizer):
    engine = make_engine(num_blocks=4)                  # 64 tokens in all
    prompt = smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    with pytest.raises(InvalidRequest, match="maximum is 63"):
        engine.add_request("x", prompt, greedy())
    assert not engine.has_unfinished()


def test_empty_prompt_and_bad_token_ids_rejected(engine):
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.add_request("e", [], greedy())
    with pytest.raises(InvalidRequest, match="prompt token ids must be in"):
        engine.add_request("e", [1, 10**6], greedy())


def test_duplicate_request_id_rejected(engine, ids):
    engine.add_request("d", ids[0], greedy())
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("d", ids[0], greedy())
    engine.abort("d")


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("n", 0),
    ("presence_penalty", 3.0), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-38), ("seed", -1), ("stop_token_ids", [10**7]), ("prompt_logprobs", 21), ("bad_words", [" "]),

])
def test_invalid_sampling_parameter_rejected_naming_it(engine, ids, field, value):
    with pytest.raises(InvalidRequest, match=f"^{field}="):
        engine.add_request("bad", ids[0], SamplingParams(**{field: value}))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field,value,count", [
    ("bad_words", ["word"] * 4097, "4097 words of 16388 characters"),
    ("bad_words", ["w" * 65537], "1 words of 65537 characters"),
    ("allowed_token_ids", [7] * 49153, "49153 ids")])
def test_a_list_past_its_cap_is_rejected_saying_how_long_it_is(engine, ids, field, value, count):
    with pytest.raises(InvalidRequest, match=f"^{field} holds {count}; at most ") as refused:
        engine.add_request("long", ids[0], SamplingParams(**{field: value}))
    assert refused.value.field == field and not engine.has_unfinished()


def test_allowed_token_ids_limit_every_token_and_become_a_tensor_once(engine, ids):
    """The list (up to the vocabulary's size) is not walked again at every step."""
    allowed = [11, 29, 3000, 42]
    engine.add_request("only", ids[0], SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                       allowed_token_ids=allowed))
    outputs = [engine.step() for _ in range(2)]
    [seq] = engine.requests["only"]
    made = seq.allowed_ids
    while engine.has_unfinished():
        outputs.append(engine.step())
    drawn = [t for step in outputs for out in step if out.request_id == "only" for t in out.new_token_ids]
    assert len(drawn) == 6 and set(drawn) <= set(allowed)
    assert made is not None and made.tolist() == allowed and seq.allowed_ids is made


def test_swap_out_on_request_holds_until_swap_in_and_output_unchanged(make_engine, ids):
    reference = generate(make_engine(), [ids[0], ids[1]], greedy(12))
    engine = make_engine(num_swap_blocks=32)
    got, tokens_while_held = generate_with_a_swap(engine, [ids[0], ids[1]], greedy(12), before=3, held=4)
    assert tokens_while_held == 3                   # held out meanwhile
    assert got == {k: v[0] for k, v in reference.items()}
    kinds = [(e.request_id, e.kind, e.mode) for e in engine.drain_events()]
    assert ("r0", "preempted", "swap") in kinds and ("r0", "resumed", "swap") in kinds
    assert engine.swap_pool.num_free == 32 and engine.blocks.num_free == engine.blocks.num_blocks


def test_preempt_falls_back_to_recompute_without_swap_room(make_engine, ids):
    engine = make_engine(num_swap_blocks=0)
    engine.add_request("r", ids[6], greedy(4))
    engine.step()
    engine.step()
    assert engine.preempt("r", "swap") == ["recompute"]


def test_abort_of_swapped_request_returns_its_host_blocks(make_engine, ids):
    engine = make_engine(num_swap_blocks=16)
    engine.add_request("r", ids[0], greedy(8))
    engine.step()
    engine.preempt("r", "swap", hold=True)
    engine.abort("r")
    assert engine.swap_pool.num_free == 16 and engine.blocks.num_free == engine.blocks.num_blocks


def test_migrated_request_continues_exactly(make_engine, ids):
    """A request resubmitted elsewhere with the tokens generated so far (recompute) goes on
    as if it had never moved: same seeded tokens, same stop at max_tokens."""
    full = generate(make_engine(), [ids[3]], sampled(42))["r0"][0]
    engine = make_engine()
    engine.add_request("moved", ids[3], sampled(42), output_token_ids=full[:5])
    rest = []
    while engine.has_unfinished():
        rest += [t for o in engine.step() for t in o.new_token_ids]
    assert full[:5] + rest == full


def test_admitted_event_reported_once(make_engine, ids):
    engine = make_engine()
    engine.add_request("a", ids[0], greedy(3))
    while engine.has_unfinished():
        engine.step()
    assert [(e.request_id, e.kind) for e in engine.drain_events()] == [("a", "admitted")]


def shared_prefix_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """16 requests for a 3-block pool, most sharing a prefix of 1-2 blocks: prefix-cache hits
    for requests that must wait."""
    import random
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 40000) for _ in range(32)]
    prompts = [prefix[:rng.choice([0, 16, 20, 32])] + [rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 12))]
               for _ in range(16)]
    return prompts, [greedy(rng.randrange(1, 48 - len(p)), ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_recompute_preemption_in_a_tiny_pool_always_progresses(make_engine, async_scheduling):
    """Requests that wait hold no blocks (a prefix match is given back when they cannot be
    admitted), so the running ones can always grow or preempt each other: all finish, and
    greedy outputs equal a roomy run's. Before, waiting requests kept their matched prefix
    blocks and the engine stopped stepping with 0 running and all 3 blocks held."""
    prompts, params = shared_prefix_workload(seed=0)
    roomy = generate(make_engine(num_blocks=256), prompts, params)
    engine = make_engine(num_blocks=3, preemption_mode="recompute", max_num_batched_tokens=64,
                         async_scheduling=async_scheduling)
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", ids, p)
    got = {f"r{i}": [[]] for i in range(len(prompts))}
    for _ in range(3000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got[out.request_id][out.index] += out.new_token_ids
        assert not any(seq.block_table for seq in engine.scheduler.waiting)
    assert not engine.has_unfinished(), f"stalled: {engine.stats()}"
    assert got == roomy
    assert engine.stats().preemptions["recompute"] > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_whose_logits_are_nan_fails_as_the_workers_fault_and_spares_its_batch(
        smollm_source, smollm_weights, ids, tmp_path, async_scheduling):
    """A real adapter whose delta overflows makes only its request's logits NaN (no mock of
    the sampler): that request fails, every choice, with the worker at fault (clients: INTERNAL),
    while a base-model request in the same steps draws what it draws alone."""
    import copy
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.models.lora_checkpoint import read_lora_adapter
    cfg, model = smollm_weights
    # A copy: serving adapters folds their A rows into the base weights.
    engine = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", num_blocks=128,
                                    enable_lora=True, async_scheduling=async_scheduling),
                       smollm_source, (cfg, copy.deepcopy(model)))
    engine.add_lora(read_lora_adapter("overflow", overflowing_adapter(tmp_path, cfg), cfg, 16))
    alone = generate(engine, [ids[0]], greedy(6, ignore_eos=True))["r0"]
    engine.add_request("base", ids[0], greedy(6, ignore_eos=True))
    engine.add_request("broken", ids[1], sampled(seed=1, n=2), lora_name="overflow")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    broken = [o for o in outputs if o.request_id == "broken"]
    # Every choice of the request ends, each with the error, none with a token.
    assert [(o.index, o.new_token_ids, o.finish_reason, o.fault) for o in broken] == \
        [(0, [], FinishReason.ERROR, True), (1, [], FinishReason.ERROR, True)]
    assert {o.error for o in broken} == {"the model computed NaN logits under LoRA adapter 'overflow' at output token 0"}
    assert [[t for o in outputs if o.request_id == "base" for t in o.new_token_ids]] == alone
    assert engine.blocks.num_free == engine.blocks.num_blocks and engine.lora_in_use("overflow") == 0
