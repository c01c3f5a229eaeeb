"""bench/w5.py and bench/w5_workload.py: W5's generator makes the mix it promises from a seed,
the report's maths (percentiles, goodput, prefix-cache deltas) is right on hand-made records,
and the whole driver runs against a real `pagedserve serve` on the CPU over gRPC and HTTP."""

import itertools
import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import w5  # noqa: E402
from w5 import Outcome, Slo, by_kind, cache_report, parse_counters, percentile, summarize  # noqa: E402
from w5_workload import (CHAT, DOCUMENT, W5Request, W5Spec, cacheable_share, generate,  # noqa: E402
                         system_prompts, warmup_requests)

VOCAB = 128256
SPEC = W5Spec()


@pytest.fixture(scope="module")
def many() -> list[W5Request]:
    """Enough requests of the full-size mix for its shares and means to show."""
    return generate(SPEC, 8.0, seed=0, vocab_size=VOCAB, num_requests=4000)


# ---------------------------------------------------------------- the generator


def test_the_same_seed_makes_the_same_requests_and_another_seed_others():
    def make(seed: int) -> list[W5Request]:
        return generate(SPEC, 8, seed=seed, vocab_size=VOCAB, duration_s=20)
    assert make(1) == make(1)
    assert make(1) != make(2)
    assert generate(SPEC, 8, seed=1, vocab_size=VOCAB, num_requests=30) == make(1)[:30]


def test_a_salt_changes_the_unique_tokens_only():
    grpc = generate(SPEC, 8, seed=0, vocab_size=VOCAB, num_requests=200, salt="grpc")
    http = generate(SPEC, 8, seed=0, vocab_size=VOCAB, num_requests=200, salt="http")
    shape = lambda r: (r.kind, r.arrival_s, len(r.prompt), r.max_tokens, r.system_prompt)  # noqa: E731
    assert [shape(r) for r in grpc] == [shape(r) for r in http]
    for a, b in zip(grpc, http):
        # Same system prompt, then tokens the other phase never sent.
        assert a.prompt[:a.shared_prefix_tokens] == b.prompt[:b.shared_prefix_tokens]
        assert a.prompt[a.shared_prefix_tokens:] != b.prompt[b.shared_prefix_tokens:]


def test_about_a_sixth_are_documents_of_3k_to_12k_tokens_and_the_rest_chats(many):
    documents = [r for r in many if r.kind == DOCUMENT]
    assert abs(len(documents) / len(many) - 1 / 6) < 0.02
    turn_low, turn_high = SPEC.user_turn_tokens
    for r in documents:
        assert r.system_prompt is None and r.shared_prefix_tokens == 0
        assert 3000 + turn_low <= len(r.prompt) <= 12000 + turn_high
    lengths = [len(r.prompt) for r in documents]
    assert min(lengths) < 3600 and max(lengths) > 11400       # the whole range is drawn
    for r in many:
        if r.kind == CHAT:
            assert 400 <= r.shared_prefix_tokens <= 900
            assert turn_low <= len(r.prompt) - r.shared_prefix_tokens <= turn_high
        assert all(100 <= t < 128000 for t in r.prompt[:50])


def test_user_turns_and_outputs_are_lognormal_around_their_means(many):
    turns = [len(r.prompt) - r.shared_prefix_tokens for r in many if r.kind == CHAT]
    outputs = [r.max_tokens for r in many]
    assert 115 < statistics.fmean(turns) < 140            # mean 128, a little lost to the clip
    assert 185 < statistics.fmean(outputs) < 215          # around 200
    # Right-skewed, as a lognormal is: the median below the mean.
    assert statistics.median(outputs) < statistics.fmean(outputs)
    assert all(16 <= n <= 1024 for n in outputs)


def test_arrivals_are_poisson_at_the_rate(many):
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(many)]
    assert all(g > 0 for g in gaps)
    assert abs(statistics.fmean(gaps) - 1 / 8) < 0.125 * 0.05
    # Exponential gaps: standard deviation equal to the mean.
    assert abs(statistics.stdev(gaps) / statistics.fmean(gaps) - 1) < 0.08
    timed = generate(SPEC, 16, seed=3, vocab_size=VOCAB, duration_s=100)
    assert all(r.arrival_s <= 100 for r in timed)
    assert abs(len(timed) - 1600) < 4 * 40                 # Poisson: sd = sqrt(1600)


def test_chat_requests_start_with_a_shared_system_prompt_of_skewed_popularity(many):
    prompts = system_prompts(SPEC, seed=0, vocab_size=VOCAB)
    assert len(prompts) == 4 and len({tuple(p) for p in prompts}) == 4
    assert all(400 <= len(p) <= 900 for p in prompts)
    chats = [r for r in many if r.kind == CHAT]
    for r in chats:
        assert r.prompt[:r.shared_prefix_tokens] == prompts[r.system_prompt]
    counts = [sum(r.system_prompt == i for r in chats) for i in range(4)]
    assert counts[0] > counts[1] > counts[2] > counts[3] > 0
    assert abs(counts[0] / len(chats) - 12 / 25) < 0.03    # Zipf weights 1, 1/2, 1/3, 1/4
    # Documents are unique: no two share even their first block.
    starts = [tuple(r.prompt[:16]) for r in many if r.kind == DOCUMENT]
    assert len(set(starts)) == len(starts)


def test_scaled_spec_keeps_the_mix_and_fits_a_short_context():
    small = SPEC.scaled(0.05)
    assert small.system_prompt_tokens == (20, 45) and small.document_tokens == (150, 600)
    assert small.output_tokens[0] >= 2 and small.user_turn_tokens[0] >= 1
    assert small.longest_request() <= 1024
    assert SPEC.scaled(1.0) == SPEC
    for r in generate(small, 4, seed=0, vocab_size=49152, num_requests=300):
        assert len(r.prompt) + r.max_tokens <= small.longest_request()
        assert r.max_tokens >= 2


def test_generate_refuses_both_or_neither_length_and_a_rate_of_zero():
    with pytest.raises(ValueError, match="exactly one"):
        generate(SPEC, 1, seed=0, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="exactly one"):
        generate(SPEC, 1, seed=0, vocab_size=VOCAB, duration_s=1, num_requests=1)
    with pytest.raises(ValueError, match="rate"):
        generate(SPEC, 0, seed=0, vocab_size=VOCAB, duration_s=1)


def test_warmup_sends_each_system_prompt_and_the_shortest_and_longest_document():
    prompts = system_prompts(SPEC, seed=0, vocab_size=VOCAB)
    warm = warmup_requests(SPEC, seed=0, vocab_size=VOCAB)
    assert [r.prompt[:len(p)] for r, p in zip(warm, prompts)] == prompts
    assert [len(r.prompt) for r in warm if r.kind == DOCUMENT] == [3000, 12000]
    phase = generate(SPEC, 8, seed=0, vocab_size=VOCAB, num_requests=100)
    assert not {tuple(r.prompt[-4:]) for r in warm} & {tuple(r.prompt[-4:]) for r in phase}


def test_cacheable_share_counts_the_full_blocks_of_system_prompts():
    requests = [W5Request(0, CHAT, 0.0, [1] * 40 + [2] * 10, 8, 0, 40),    # 2 full blocks of 16
                W5Request(1, CHAT, 0.0, [1] * 16, 8, 0, 16),                # the last token is computed
                W5Request(2, DOCUMENT, 0.0, [3] * 94, 8, None, 0)]
    assert cacheable_share(requests, 16) == pytest.approx(32 / 160)


# ---------------------------------------------------------------- the report's maths


def test_percentiles_interpolate_between_ranks():
    values = list(range(100, 0, -1))           # 1..100, unsorted
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile(values, 0.9) == pytest.approx(90.1)
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([1.0, 3.0], 0.0) == 1.0 and percentile([1.0, 3.0], 1.0) == 3.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def outcome(kind: str, ttft: float, tpot: float, tokens: int = 11, error: str | None = None) -> Outcome:
    """A request sent at t=10 with its first token after `ttft` and the others `tpot` apart."""
    o = Outcome(kind, prompt_tokens=100, max_tokens=tokens, sent=10.0, tokens=tokens, error=error)
    if error is None:
        o.first_token = 10.0 + ttft
        o.last_token = o.first_token + tpot * (tokens - 1)
    return o


def test_ttft_tpot_and_the_slo_of_one_request():
    o = outcome(CHAT, 0.2, 0.03)
    assert o.ttft_s == pytest.approx(0.2) and o.tpot_s == pytest.approx(0.03)
    assert o.meets(Slo()) and not o.meets(Slo(ttft_s=0.1)) and not o.meets(Slo(tpot_s=0.02))
    single = outcome(CHAT, 0.2, 0.0, tokens=1)
    assert single.tpot_s is None and single.meets(Slo())   # no TPOT to miss
    failed = outcome(CHAT, 0, 0, error="UNAVAILABLE: no worker")
    assert not failed.completed and not failed.meets(Slo()) and failed.ttft_s is None


def test_goodput_is_the_share_of_all_requests_meeting_both_objectives():
    outcomes = [outcome(CHAT, 0.1, 0.01),                # good
                outcome(CHAT, 0.6, 0.01),                # TTFT over 500 ms
                outcome(DOCUMENT, 0.3, 0.08),            # TPOT over 50 ms
                outcome(DOCUMENT, 0.4, 0.04),            # good
                outcome(CHAT, 0, 0, error="RESOURCE_EXHAUSTED: overloaded")]
    s = summarize(outcomes, seconds=2.0, slo=Slo())
    assert (s["requests"], s["completed"], s["failed"], s["short"]) == (5, 4, 1, 0)
    assert s["failures"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["goodput"] == pytest.approx(2 / 5)
    assert s["goodput_requests_per_s"] == pytest.approx(1.0)
    assert s["output_tokens_per_s"] == pytest.approx(44 / 2.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.35)     # of the completed ones: .1 .3 .4 .6
    assert s["tpot_s"]["p90"] == pytest.approx(percentile([0.01, 0.01, 0.08, 0.04], 0.9))
    kinds = by_kind(outcomes, 2.0, Slo())
    assert kinds["chat"]["goodput"] == pytest.approx(1 / 3) and kinds["document"]["goodput"] == 0.5
    assert kinds["document"]["output_tokens_per_s"] == pytest.approx(22 / 2.0)
    assert summarize(outcomes, 2.0, Slo(ttft_s=1.0, tpot_s=0.1))["goodput"] == pytest.approx(4 / 5)


def test_a_request_with_fewer_tokens_than_asked_is_counted_short():
    o = outcome(CHAT, 0.1, 0.01, tokens=5)
    o.max_tokens = 8
    assert summarize([o], 1.0, Slo())["short"] == 1


WORKER_METRICS = """\
# TYPE pagedserve_worker_prefix_cache_queries counter
pagedserve_worker_prefix_cache_queries_total{{model_name="m"}} {queries}
# TYPE pagedserve_worker_prefix_cache_hits counter
pagedserve_worker_prefix_cache_hits_total{{model_name="m"}} {hits}
# TYPE pagedserve_worker_prompt_tokens counter
pagedserve_worker_prompt_tokens_total{{model_name="m"}} {prompt}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",model_name="m",num_gpu_blocks="512"}} 1.0
"""


def test_the_prefix_cache_over_a_phase_comes_from_the_counters_deltas():
    before = parse_counters(WORKER_METRICS.format(queries=10, hits=4, prompt=1000))
    after = parse_counters(WORKER_METRICS.format(queries=60, hits=44, prompt=3000))
    assert after.block_size == 16 and after.hits == 44
    requests = [W5Request(0, CHAT, 0.0, [1] * 50, 8, 0, 40)]
    report = cache_report(before, after, requests)
    assert report["hit_rate"] == pytest.approx(40 / 50)
    assert report["prompt_tokens_from_cache"] == pytest.approx(40 * 16 / 2000)
    assert report["prompt_tokens_cacheable"] == pytest.approx(32 / 50)
    # A router's /metrics has no worker series: nothing to report, rather than zeros.
    assert parse_counters('# TYPE pagedserve_router_requests_running gauge\n'
                          'pagedserve_router_requests_running{model_name="m"} 0.0\n') is None
    assert cache_report(None, after, requests) is None


def test_the_markdown_table_has_a_row_per_phase_and_kind():
    kinds = by_kind([outcome(CHAT, 0.1, 0.01), outcome(DOCUMENT, 0.3, 0.02)], 1.0, Slo())
    result = {"model": "m", "scale": 1.0, "seed": 0, "duration_s": 30.0, "num_requests": None,
              "slo": {"ttft_s": 0.5, "tpot_s": 0.05},
              "phases": [{"api": "grpc", "rate": 8.0, "kinds": kinds,
                          "prefix_cache": {"hit_rate": 0.9, "prompt_tokens_from_cache": 0.3,
                                           "prompt_tokens_cacheable": 0.35}}]}
    text = w5.markdown(result)
    assert ("| grpc | 8 | all | 2 (0) | 100 | 200 / 280 / 298 | 15.0 / 19.0 / 19.9 | 100.0% | 22 "
            "| 90% / 30% (35%) |") in text
    assert "| grpc | 8 | document | 1 (0) |" in text


# ---------------------------------------------------------------- end to end, on the CPU


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32"}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "token-ids-only"])
def test_w5_runs_against_a_real_server_over_grpc_and_http(model, tmp_path):
    """The embedded SmolLM2 (HTTP tokens timed by their text), and dummy weights of a bare
    config, as on the H200 (no tokenizer: HTTP tokens counted from their logprobs)."""
    # Blocks of 8: the scaled system prompts (12-27 tokens) fill one at least, so they hit.
    model_args = "--device cpu --num-blocks 256 --block-size 8"
    if model == "smollm2":
        model_args += " --dtype bfloat16"      # twice float32's speed here: the test stays short
    else:
        (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
        model_args += f" --model {tmp_path} --load-format dummy"
    out, table = tmp_path / "w5.json", tmp_path / "w5.md"
    result = w5.main(["--serve", "--model-args", model_args,
                      "--api", "grpc,http", "--rates", "4", "--num-requests", "5", "--scale", "0.03",
                      "--startup-timeout", "120", "--request-timeout", "60",
                      "--out", str(out), "--markdown", str(table)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["http_logprobs"] is (model == "token-ids-only")
    assert [(p["api"], p["rate"]) for p in result["phases"]] == [("grpc", 4.0), ("http", 4.0)]
    for phase in result["phases"]:
        records = phase["per_request"]
        assert len(records) == 5
        for r in records:
            assert r["error"] is None and r["output_tokens"] == r["max_tokens"], r
        everything = phase["kinds"]["all"]
        assert (everything["completed"], everything["failed"], everything["short"]) == (5, 0, 0)
        for kind in ("all", "chat"):
            s = phase["kinds"][kind]
            assert set(s["ttft_s"]) == {"p50", "p90", "p99", "mean"} and set(s["tpot_s"]) == set(s["ttft_s"])
            assert 0 <= s["goodput"] <= 1 and s["output_tokens_per_s"] > 0
        cache = phase["prefix_cache"]
        # The warm-up cached every system prompt (12+ tokens: a full block of 8 at least).
        assert cache["block_hits"] > 0 and 0 < cache["hit_rate"] <= 1
        assert 0 < cache["prompt_tokens_from_cache"] <= cache["prompt_tokens_cacheable"] + 1e-9
    assert "| http | 4 | all | 5 (0) |" in table.read_text()
