"""Sampler rules on small hand-made logits."""

import math

import pytest
import torch

from common.sampling_params import SamplingParams
from worker.sampler import (NAN_LOGITS, NO_TOKEN_ALLOWED, BadWords, SampleResult, SamplingBatch, SamplingRow, filter_logits, apply_penalties,
                            sample, seeded_uniform, uniform_from_bits)

V = 8


def batch(*params: SamplingParams, seeds=None, outputs=None, prompts=None, banned=None):
    rows = []
    for i, p in enumerate(params):
        prompt, output = (prompts or [[]] * len(params))[i], (outputs or [[]] * len(params))[i]
        rows.append(SamplingRow(p, (seeds or [0] * len(params))[i], 10, prompt + output, len(prompt),
                                (banned or [[]] * len(params))[i]))
    return SamplingBatch.build(rows, V, torch.device("cpu"))


def draw(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    return sample(logits, batch).read()


def logits(*rows):
    return torch.tensor(rows, dtype=torch.float32)


ROW = [0.0, 3.0, 1.0, 2.9, -1.0, 0.5, 2.0, 0.1]


def test_greedy_picks_argmax():
    assert draw(logits(ROW), batch(SamplingParams(temperature=0))).token_ids == [1]


def test_a_temperature_too_small_to_divide_by_is_greedy_beside_sampled_rows():
    # Logits of a real model's size: 30 / 1e-38 overflows float32, and softmax of inf is NaN.
    row = [10 * x for x in ROW]
    out = draw(logits(row, row), batch(SamplingParams(temperature=1e-38), SamplingParams(temperature=1.0)))
    assert out.token_ids[0] == 1


def test_top_k_one_equals_greedy_whatever_the_seed():
    draws = {draw(logits(ROW), batch(SamplingParams(temperature=2.0, top_k=1), seeds=[s])).token_ids[0]
             for s in range(20)}
    assert draws == {1}


def test_min_p_one_keeps_only_the_top_token():
    draws = {draw(logits(ROW), batch(SamplingParams(temperature=1.0, min_p=1.0), seeds=[s])).token_ids[0]
             for s in range(20)}
    assert draws == {1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # top two tokens (ids 1 and 3) hold ~0.62 of the mass: top_p 0.6 keeps exactly them.
    draws = {draw(logits(ROW), batch(SamplingParams(temperature=1.0, top_p=0.6), seeds=[s])).token_ids[0]
             for s in range(60)}
    assert draws == {1, 3}


def test_sampling_follows_the_distribution():
    probs = torch.softmax(logits(ROW)[0], -1)
    counts = torch.zeros(V)
    for s in range(3000):
        counts[draw(logits(ROW), batch(SamplingParams(temperature=1.0), seeds=[s])).token_ids[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_seeded_uniform_depends_only_on_seed_position_and_token():
    seeds, pos, vocab = torch.tensor([5, 5, 6]), torch.tensor([3, 3, 3]), torch.arange(1000)
    u = seeded_uniform(seeds, pos, vocab)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.03
    assert not torch.equal(u[0], seeded_uniform(seeds[:1], pos[:1] + 1, vocab)[0])


def test_uniform_numbers_stay_strictly_inside_zero_and_one_at_the_extreme_hashes():
    u = uniform_from_bits(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert u.dtype == torch.float32 and bool((u > 0).all() and (u < 1).all())
    assert -torch.log(u).min() > 0


def test_a_token_filtered_out_is_never_drawn_over_many_draws_of_a_large_vocabulary():
    """Top-k 1 over a 49k vocabulary, 96 rows by 64 positions: every draw is the top token
    (where a uniform number could reach 1, about one draw in 340 was not)."""
    vocab = 49152
    logits = torch.randn(96, vocab, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_k=1)
    for position in range(64):
        rows = [SamplingRow(params, seed, position, [], 0, []) for seed in range(96)]
        drawn = sample(logits, SamplingBatch.build(rows, vocab, torch.device("cpu"))).read().token_ids
        assert drawn == logits.argmax(-1).tolist(), position


def test_banned_tokens_are_never_drawn():
    out = draw(logits(ROW), batch(SamplingParams(temperature=0), banned=[[1, 3]]))
    assert out.token_ids == [6]


def test_penalties_follow_their_definitions():
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    b = batch(p, outputs=[[1, 1, 4]], prompts=[[6]])
    got = apply_penalties(logits(ROW), b)[0]
    expected = torch.tensor(ROW)
    expected[1] = 3.0 / 2 - 0.25 * 2 - 0.5     # positive: divided, then 2 occurrences
    expected[4] = -1.0 * 2 - 0.25 - 0.5        # negative: multiplied
    expected[6] = 2.0 / 2                      # prompt token: repetition penalty only
    torch.testing.assert_close(got, expected)


def test_logprobs_are_of_the_unmodified_distribution():
    out = draw(logits(ROW), batch(SamplingParams(temperature=0, logprobs=2, presence_penalty=1.0),
                                    outputs=[[1]]))
    lp = torch.log_softmax(logits(ROW)[0], -1)
    chosen, top = out.logprobs[0]
    assert chosen == lp[out.token_ids[0]].item()
    assert [t for t, _ in top] == [1, 3]


def kept_by_definition(row: list[float], p: SamplingParams) -> set[int]:
    """Top-k, then the smallest most-likely set reaching top_p, then min-p; written plainly."""
    ranked = sorted(range(len(row)), key=lambda t: -row[t])
    allowed = ranked[:p.top_k] if p.top_k > 0 else ranked
    total = sum(math.exp(row[t]) for t in allowed)
    kept, mass = set(), 0.0
    for t in allowed:
        if mass >= p.top_p:
            break
        kept.add(t)
        mass += math.exp(row[t]) / total
    best = max(row)
    return {t for t in kept if math.exp(row[t] - best) >= p.min_p}


@pytest.mark.parametrize("params", [
    # every sampling row has a top_k: only the widest k logits are looked at
    [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_k=20, top_p=0.5),
     SamplingParams(temperature=1.0, top_k=9, min_p=0.3), SamplingParams(temperature=0.0)],
    # a row with top-p alone: the whole vocabulary is ranked
    [SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0, top_k=3),
     SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0, top_k=12, top_p=0.9, min_p=0.05)],
], ids=["within-widest-top-k", "whole-vocabulary"])
def test_filters_keep_what_their_definitions_keep(params):
    vocab = 64
    values = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(3)) * 2
    rows = [SamplingRow(p, 0, 10, [], 0, []) for p in params]
    kept = filter_logits(values, SamplingBatch.build(rows, vocab, torch.device("cpu"))) > float("-inf")
    for row, p in enumerate(params):
        if not p.greedy:
            assert set(kept[row].nonzero()[:, 0].tolist()) == kept_by_definition(values[row].tolist(), p)


# ------------------------------------------------------------------ logit bias, allowed ids, grammar masks

def test_logit_bias_of_minus_100_bans_a_token_and_plus_100_forces_one():
    greedy = SamplingParams(temperature=0)
    banned = SamplingParams(temperature=0, logit_bias={1: -100.0})
    forced = SamplingParams(temperature=1.0, logit_bias={4: 100.0})
    assert draw(logits(ROW, ROW, ROW), batch(greedy, banned, forced)).token_ids == [1, 3, 4]


def test_logit_bias_leaves_the_reported_logprobs_the_models_own():
    biased = draw(logits(ROW), batch(SamplingParams(temperature=0, logprobs=1, logit_bias={1: -100.0})))
    plain = draw(logits(ROW), batch(SamplingParams(temperature=0, logprobs=1)))
    assert biased.logprobs[0][1] == plain.logprobs[0][1]     # the top token is still 1, as the model says


def test_allowed_token_ids_limit_their_row_only():
    only = SamplingParams(temperature=1.0, allowed_token_ids=[4, 7])
    free = SamplingParams(temperature=0)
    draws = [draw(logits(ROW, ROW), batch(only, free, seeds=[seed, 0])).token_ids for seed in range(20)]
    assert {d[0] for d in draws} <= {4, 7} and {d[1] for d in draws} == {1}


def test_a_grammar_bitmask_keeps_only_its_tokens_in_its_rows():
    b = batch(SamplingParams(temperature=0), SamplingParams(temperature=0))
    b.allowed = (torch.tensor([1]), torch.tensor([[1 << 5 | 1 << 7]], dtype=torch.int32))   # tokens 5 and 7
    assert draw(logits(ROW, ROW), b).token_ids == [1, 5]


def test_a_row_whose_constraints_allow_no_token_reads_no_token_allowed_but_keeps_a_token_on_the_device():
    b = batch(SamplingParams(temperature=0, allowed_token_ids=[4]), SamplingParams(temperature=1.0),
              banned=[[4], []])
    sampled = sample(logits(ROW, ROW), b)
    assert sampled.read().token_ids[0] == NO_TOKEN_ALLOWED
    assert 0 <= int(sampled.token_ids[0]) < V      # the next step may embed it before the host reads


def test_a_row_of_nan_logits_reads_nan_logits_and_leaves_its_neighbour_alone():
    b = batch(SamplingParams(temperature=1.0), SamplingParams(temperature=0))
    assert draw(logits([math.nan] * V, ROW), b).token_ids == [NAN_LOGITS, 1]


# ------------------------------------------------------------------ bad words

GREEDY = SamplingParams(temperature=0)


def bad_words_batch(*rows: tuple[list[int], BadWords], prompt: list[int] = (), pending: list[int] = ()):
    """Greedy rows with their output so far and bad words; `pending`: the last output token
    of each row, still on the device (as under asynchronous scheduling), if given."""
    sampling_rows = [SamplingRow(GREEDY, 0, 10, [*prompt, *output], len(prompt), [], words,
                                 pending_row=i if pending else -1)
                     for i, (output, words) in enumerate(rows)]
    return SamplingBatch.build(sampling_rows, V, torch.device("cpu"), torch.tensor(pending) if pending else None)


def test_a_one_token_bad_word_is_never_drawn():
    assert draw(logits(ROW), bad_words_batch(([], BadWords(tokens=(1,))))).token_ids == [3]


def test_a_bad_word_bans_its_last_token_right_after_the_rest_of_it_only():
    words = BadWords(sequences=((5, 6, 1),))
    b = bad_words_batch(([2, 5, 6], words), ([5, 6, 2], words), ([6, 5], words))
    assert draw(logits(ROW, ROW, ROW), b).token_ids == [3, 1, 1]


def test_a_bad_word_counts_generated_tokens_only():
    words = BadWords(sequences=((5, 6, 1),))
    assert draw(logits(ROW), bad_words_batch(([6], words), prompt=[5])).token_ids == [1]


def test_a_bad_word_ending_in_a_pending_token_is_matched_on_the_device():
    words = BadWords(sequences=((5, 6, 1), (4, 1)))
    b = bad_words_batch(([5], words), ([4], words), pending=[6, 6])     # outputs 5 6 and 4 6
    assert draw(logits(ROW, ROW), b).token_ids == [3, 1]


def test_bad_words_of_different_lengths_apply_in_one_batch():
    b = bad_words_batch(([7], BadWords(sequences=((7, 1),))),
                        ([2, 4, 7], BadWords(sequences=((2, 4, 7, 1), (7, 3)))),
                        ([], BadWords(tokens=(1, 3))))
    assert draw(logits(ROW, ROW, ROW), b).token_ids == [3, 6, 6]
