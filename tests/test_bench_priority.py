"""bench/priority_bench.py without a server: its workload is the seeded two-priority mix it
promises, and its report's arithmetic (router counter deltas, per-class summaries, the on/off
comparison) is right on hand-made records."""

import sys
from dataclasses import asdict, replace
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from priority_bench import (LOW, PRIORITY, URGENT, PriorityClient, PriorityMix, RouterCounters,  # noqa: E402
                            WorkerSteps, compare, generate, make_phase, markdown, parse_router_metrics,
                            parse_worker_metrics, warmup_requests)
from w5 import Outcome  # noqa: E402

VOCAB = 49152
MIX = PriorityMix()
SMALL = MIX.scaled(0.05)      # short prompts: thousands of requests draw in milliseconds


def test_the_same_seed_makes_the_same_requests_and_another_seed_others():
    def make(seed: int):
        return generate(SMALL, 8, seed=seed, vocab_size=VOCAB, duration_s=10)
    assert make(1) == make(1)
    assert make(1) != make(2)
    assert generate(SMALL, 8.0, seed=1, vocab_size=VOCAB, num_requests=20) == make(1)[:20]


def test_about_the_urgent_share_of_requests_are_priority_0_and_the_rest_priority_1():
    requests = generate(SMALL, 8, seed=0, vocab_size=VOCAB, num_requests=3000)
    urgent = [r for r in requests if r.kind == URGENT]
    assert abs(len(urgent) / len(requests) - 0.2) < 0.02
    assert all(r.priority == PRIORITY[r.kind] for r in requests)
    assert {r.priority for r in requests} == {0, 1} and PRIORITY[URGENT] < PRIORITY[LOW]


def test_another_urgent_share_changes_the_classes_but_not_the_arrivals_or_lengths():
    def shapes(share: float):
        requests = generate(replace(SMALL, urgent_share=share), 8, seed=0, vocab_size=VOCAB, num_requests=200)
        return [(r.arrival_s, len(r.prompt), r.max_tokens) for r in requests], [r.kind for r in requests]
    (shape_20, kinds_20), (shape_0, kinds_0) = shapes(0.2), shapes(0.0)
    assert shape_20 == shape_0
    assert URGENT in kinds_20 and set(kinds_0) == {LOW}


def test_lengths_stay_within_the_mix_and_token_ids_within_the_vocabulary():
    mix = MIX.scaled(0.1)
    requests = generate(mix, 8, seed=0, vocab_size=VOCAB, num_requests=2000)
    assert all(mix.prompt_tokens[0] <= len(r.prompt) <= mix.prompt_tokens[1] for r in requests)
    assert all(mix.output_tokens[0] <= r.max_tokens <= mix.output_tokens[1] for r in requests)
    assert all(100 <= t < VOCAB for r in requests for t in r.prompt)


def test_scaling_keeps_two_output_tokens_at_least():
    tiny = MIX.scaled(0.001)
    assert tiny.output_tokens[0] >= 2 and tiny.output_mean >= 2 and tiny.prompt_tokens[0] >= 1


def test_arrivals_increase_and_a_duration_bounds_them():
    requests = generate(SMALL, 8, seed=0, vocab_size=VOCAB, duration_s=30)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] <= 30
    assert 160 < len(requests) < 320                  # about 8 x 30


def test_generate_refuses_both_or_neither_length_and_a_rate_of_zero():
    with pytest.raises(ValueError):
        generate(MIX, 8, seed=0, vocab_size=VOCAB)
    with pytest.raises(ValueError):
        generate(MIX, 8, seed=0, vocab_size=VOCAB, duration_s=1, num_requests=1)
    with pytest.raises(ValueError):
        generate(MIX, 0, seed=0, vocab_size=VOCAB, num_requests=1)


def test_warmup_sends_the_shortest_and_longest_prompt_at_low_priority():
    warm = warmup_requests(MIX, seed=0, vocab_size=VOCAB)
    assert sorted(len(r.prompt) for r in warm) == list(MIX.prompt_tokens)
    assert all(r.priority == PRIORITY[LOW] and r.arrival_s == 0 for r in warm)


def test_the_client_sends_each_requests_priority():
    request = next(r for r in generate(SMALL, 8, seed=0, vocab_size=VOCAB, num_requests=20) if r.kind == URGENT)
    with grpc.insecure_channel("127.0.0.1:1") as channel:    # never connects: payload() sends nothing
        message = PriorityClient(channel, timeout_s=1).payload(request)
    assert message.priority == 0 and message.params.ignore_eos
    assert list(message.token_ids.ids) == request.prompt and message.params.max_tokens == request.max_tokens


ROUTER_METRICS = """\
# TYPE pagedserve_router_requests_running gauge
pagedserve_router_requests_running{{model_name="m"}} 7.0
# TYPE pagedserve_router_requests_waiting gauge
pagedserve_router_requests_waiting{{model_name="m"}} 3.0
# TYPE pagedserve_router_swap_outs counter
pagedserve_router_swap_outs_total{{model_name="m",reason="priority"}} {priority}
pagedserve_router_swap_outs_total{{model_name="m",reason="slow_reader"}} {slow}
# TYPE pagedserve_router_swap_ins counter
pagedserve_router_swap_ins_total{{model_name="m",reason="priority"}} {priority}
pagedserve_router_swap_ins_total{{model_name="m",reason="slow_reader"}} {slow}
# TYPE pagedserve_router_rebalances counter
pagedserve_router_rebalances_total{{model_name="m"}} 2.0
# TYPE pagedserve_router_request_queue_time_seconds histogram
pagedserve_router_request_queue_time_seconds_sum{{model_name="m"}} {wait}
pagedserve_router_request_queue_time_seconds_count{{model_name="m"}} {admitted}
"""


def router_page(priority: float, wait: float, admitted: float, slow: float = 1.0) -> str:
    return ROUTER_METRICS.format(priority=priority, wait=wait, admitted=admitted, slow=slow)


def test_router_counters_over_a_phase_are_the_deltas_of_two_scrapes():
    before = parse_router_metrics(router_page(2.0, 1.0, 10.0))
    after = parse_router_metrics(router_page(7.0, 5.0, 30.0))
    assert (after.running, after.waiting) == (7.0, 3.0)
    assert after.counters.swap_ins == 8.0            # both reasons
    delta = after.counters.minus(before.counters)
    assert delta == RouterCounters(swap_outs_priority=5.0, swap_ins=5.0, queue_wait_s=4.0, admitted=20.0)


WORKER_METRICS = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",model_name="m",num_gpu_blocks="48"}} 1.0
# TYPE pagedserve_worker_step_duration_seconds histogram
pagedserve_worker_step_duration_seconds_count{{model_name="m"}} {steps}
pagedserve_worker_step_duration_seconds_sum{{model_name="m"}} {seconds}
# TYPE pagedserve_worker_step_batch_sequences histogram
pagedserve_worker_step_batch_sequences_count{{model_name="m"}} {steps}
pagedserve_worker_step_batch_sequences_sum{{model_name="m"}} {sequences}
"""


def test_the_workers_steps_over_a_phase_give_the_mean_step_time_and_batch():
    before = parse_worker_metrics(WORKER_METRICS.format(steps=10, seconds=1.0, sequences=20))
    after = parse_worker_metrics(WORKER_METRICS.format(steps=110, seconds=6.0, sequences=620))
    assert after.pool_tokens == 768
    report = after.steps.minus(before.steps).report()
    assert report == {"steps": 100, "mean_step_s": pytest.approx(0.05), "mean_sequences": pytest.approx(6.0)}
    assert WorkerSteps().report() == {"steps": 0, "mean_step_s": None, "mean_sequences": None}


def test_each_kind_of_metrics_page_is_told_from_the_other():
    worker = WORKER_METRICS.format(steps=1, seconds=1, sequences=1)
    router = router_page(0, 0, 0)
    assert parse_router_metrics(worker) is None and parse_worker_metrics(router) is None


def outcome(kind: str, ttft_s: float, tokens: int = 11, tpot_s: float = 0.01) -> Outcome:
    o = Outcome(kind, prompt_tokens=50, max_tokens=tokens, sent=100.0)
    o.first_token, o.last_token, o.tokens = 100.0 + ttft_s, 100.0 + ttft_s + tpot_s * (tokens - 1), tokens
    return o


def test_a_phase_summarizes_each_class_and_the_routers_mean_wait():
    outcomes = [outcome(URGENT, 0.1), outcome(URGENT, 0.3), outcome(LOW, 1.0), outcome(LOW, 2.0)]
    failed = Outcome(LOW, 50, 11, sent=100.0, error="RESOURCE_EXHAUSTED: overloaded")
    before = parse_router_metrics(router_page(0.0, 0.0, 0.0))
    after = parse_router_metrics(router_page(3.0, 2.0, 4.0))
    phase = make_phase("on", [*outcomes, failed], 2.0, before, after, waiting=[0.0, 2.0, 4.0],
                       steps=WorkerSteps(steps=10, seconds=0.5, sequences=40))
    assert phase.classes[URGENT]["ttft_s"]["p50"] == pytest.approx(0.2)
    assert phase.classes[LOW]["ttft_s"]["p50"] == pytest.approx(1.5)
    assert (phase.classes["all"]["completed"], phase.classes["all"]["failed"]) == (4, 1)
    assert phase.classes["all"]["output_tokens_per_s"] == pytest.approx(44 / 2.0)
    assert phase.classes[URGENT]["output_tokens_per_s"] == pytest.approx(22 / 2.0)
    assert phase.router["swap_outs_priority"] == 3.0 and phase.router_mean_wait_s == pytest.approx(0.5)
    assert phase.router_waiting == {"mean": 2.0, "max": 4.0}
    assert phase.worker_steps["mean_sequences"] == 4.0
    assert phase.server_flags == ["--preempt-for-priority", "--rebalance"]


def test_a_phase_without_router_metrics_has_no_router_figures():
    phase = make_phase("off", [outcome(URGENT, 0.1)], 1.0, None, None, waiting=[], steps=None)
    assert phase.router is None and phase.router_mean_wait_s is None and phase.router_waiting is None
    assert phase.worker_steps is None


def classes(urgent_ttfts: list[float], tokens_per_s_scale: float) -> dict:
    """A phase's classes with these urgent TTFTs and 4 low requests, over 1 / scale seconds."""
    outcomes = [outcome(URGENT, t) for t in urgent_ttfts] + [outcome(LOW, 1.0) for _ in range(4)]
    return make_phase("on", outcomes, 1.0 / tokens_per_s_scale, None, None, [], None).classes


def test_the_comparison_gives_urgent_ttft_on_and_off_and_the_throughput_ratio():
    on, off = classes([0.1, 0.2, 0.3], 1.0), classes([0.5, 1.0, 1.5], 1.0 / 1.02)
    result = compare(on, off, max_drop=0.05)
    assert result["urgent_ttft_p50_s"] == {"on": pytest.approx(0.2), "off": pytest.approx(1.0)}
    assert result["urgent_ttft_p99_s"]["on"] == pytest.approx(0.298)
    assert result["throughput_ratio"] == pytest.approx(1.02)
    assert result["throughput_bound"] == pytest.approx(0.95) and result["throughput_holds"]


def test_a_throughput_drop_past_the_bound_fails_the_comparison():
    on, off = classes([0.1], 0.94), classes([0.5], 1.0)
    result = compare(on, off, max_drop=0.05)
    assert result["throughput_ratio"] == pytest.approx(0.94) and not result["throughput_holds"]
    assert compare(on, off, max_drop=0.1)["throughput_holds"]


def test_no_completed_urgent_request_leaves_its_ttft_out_of_the_comparison():
    on = classes([], 1.0)
    assert compare(on, classes([0.5], 1.0), 0.05)["urgent_ttft_p50_s"] == {"on": None, "off": 0.5}


def test_the_markdown_table_has_a_row_per_setting_and_the_comparison():
    on, off = classes([0.1, 0.2, 0.3], 1.0), classes([0.5, 1.0, 1.5], 1.0)
    before = parse_router_metrics(router_page(0.0, 0.0, 0.0))
    after = parse_router_metrics(router_page(3.0, 2.0, 4.0))
    phase_on = make_phase("on", [outcome(URGENT, 0.1), outcome(LOW, 1.0)], 1.0, before, after, [1.0, 3.0],
                          WorkerSteps(steps=4, seconds=0.2, sequences=8))
    phase_off = make_phase("off", [outcome(URGENT, 0.5), outcome(LOW, 1.0)], 1.0, None, None, [], None)
    result = {"model": "m", "mix": asdict(MIX), "rate": 3.0, "duration_s": None, "num_requests": 2,
              "pool_tokens": 768, "seed": 0, "model_args": "--num-blocks 48",
              "settings": {"on": asdict(phase_on), "off": asdict(phase_off)},
              "comparison": compare(on, off, 0.05)}
    text = markdown(result)
    assert ("| on | 2 (0) | 100 / 100 / 100 | 1000 / 1000 | 10 / 10 · 10 / 10 | 22 | 3 / 3 · 0 "
            "| 500 · 2.0 / 3 | 50.0 · 2.0 |") in text
    assert ("| off | 2 (0) | 500 / 500 / 500 | 1000 / 1000 | 10 / 10 · 10 / 10 | 22 | – | – · – "
            "| – |") in text
    assert "Urgent TTFT, policies off → on: p50 1000 → 200 ms, p99 1490 → 298 ms." in text
    assert "Throughput on/off: 1.000, within the bound of 0.95." in text


def test_the_markdown_table_names_swap_outs_for_slow_readers_apart():
    before, after = parse_router_metrics(router_page(0, 0, 0)), parse_router_metrics(router_page(3, 2, 4, slow=3))
    phase = make_phase("on", [outcome(URGENT, 0.1), outcome(LOW, 1.0)], 1.0, before, after, [], None)
    result = {"model": "m", "mix": asdict(MIX), "rate": 3.0, "duration_s": 10.0, "num_requests": None,
              "pool_tokens": 768, "seed": 0, "model_args": "", "settings": {"on": asdict(phase)}}
    assert "| 3 + 2 slow reader / 5 · 0 |" in markdown(result)
