"""A worker process's /metrics after a known workload: every counter moved by exactly what ran.

The workload is three greedy requests of 5 tokens that ignore EOS, on a worker with 16-token
blocks: A (40 prompt tokens) and B (7) together, then C, which repeats A's first two full blocks
and so finds them in the prefix cache.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.pb import worker_pb2
from worker_process import WorkerProcess, free_port, run_requests, submit

pytestmark = pytest.mark.slow

PROMPT_A = list(range(1000, 1040))
PROMPT_B = list(range(2000, 2007))
PROMPT_C = PROMPT_A[:32] + list(range(3000, 3008))   # 2 cached blocks + 8 new tokens
MAX_TOKENS = 5


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels without model_name) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def poll(port: int, done, timeout_s: float = 10) -> dict[tuple[str, tuple], float]:
    """Scrapes until `done(samples)`; the state gauges follow the engine loop by one iteration."""
    deadline = time.monotonic() + timeout_s
    while not done(samples := scrape(port)):
        assert time.monotonic() < deadline, f"metrics never settled: {samples}"
        time.sleep(0.05)
    return samples


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess(["--metrics-port", str(port := free_port())]) as process:
        process.metrics_port = port
        yield process


def test_counters_match_the_workload(worker):
    first = asyncio.run(run_requests(worker.address, [submit("a", PROMPT_A, MAX_TOKENS),
                                                      submit("b", PROMPT_B, MAX_TOKENS)]))
    second = asyncio.run(run_requests(worker.address, [submit("c", PROMPT_C, MAX_TOKENS)]))
    results = first | second
    assert all(len(r.tokens) == MAX_TOKENS and r.finish_reason == worker_pb2.FINISH_REASON_LENGTH
               for r in results.values()), results

    m = poll(worker.metrics_port, lambda m: m[("pagedserve_worker_kv_cache_usage_ratio", ())] == 0)
    assert m[("pagedserve_worker_generation_tokens_total", ())] == 3 * MAX_TOKENS
    assert m[("pagedserve_worker_prompt_tokens_total", ())] == len(PROMPT_A) + len(PROMPT_B) + len(PROMPT_C)
    assert m[("pagedserve_worker_requests_finished_total", (("reason", "length"),))] == 3
    for reason in ("stop", "abort", "drained", "failed"):
        assert m[("pagedserve_worker_requests_finished_total", (("reason", reason),))] == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "time_per_output_token_seconds"):
        assert m[(f"pagedserve_worker_{histogram}_count", ())] == 3, histogram
    # TTFT is part of the end-to-end latency, request by request.
    assert 0 < m[("pagedserve_worker_time_to_first_token_seconds_sum", ())] < \
        m[("pagedserve_worker_e2e_request_latency_seconds_sum", ())]

    # Tokens computed: the prompts less C's 32 cached tokens, then 4 decodes each (the 5th
    # token is sampled, never computed).
    assert m[("pagedserve_worker_step_batch_tokens_sum", ())] == \
        len(PROMPT_A) + len(PROMPT_B) + (len(PROMPT_C) - 32) + 3 * (MAX_TOKENS - 1)
    steps = m[("pagedserve_worker_step_duration_seconds_count", ())]
    assert steps >= MAX_TOKENS and m[("pagedserve_worker_step_batch_sequences_count", ())] == steps
    assert m[("pagedserve_worker_prefix_cache_hits_total", ())] == 2
    assert m[("pagedserve_worker_prefix_cache_queries_total", ())] >= 2

    for gauge in ("requests_running", "requests_waiting", "requests_swapped"):
        assert m[(f"pagedserve_worker_{gauge}", ())] == 0, gauge
    assert m[("pagedserve_worker_kv_cache_blocks", (("pool", "gpu"),))] == 128
    for mode in ("swap", "recompute"):
        assert m[("pagedserve_worker_preemptions_total", (("mode", mode),))] == 0
    # The vLLM names the Gateway API Inference Extension reads.
    assert m[("vllm:num_requests_waiting", ())] == 0
    assert m[("vllm:gpu_cache_usage_perc", ())] == 0
    assert m[("vllm:cache_config_info", (("block_size", "16"), ("cache_dtype", "float32"),
                                         ("num_gpu_blocks", "128")))] == 1
    # The embedded SmolLM2's Q4_1 linears are dequantized on load: float32, unquantized.
    assert m[("pagedserve_worker_model_config_info", (("dtype", "float32"), ("kv_cache_dtype", "float32"),
                                                      ("quantization", "none")))] == 1


@pytest.mark.parametrize("stop_string,reason", [(False, "abort"), (True, "stop")])
def test_running_requests_are_seen_and_an_abort_counts_by_its_cause(worker, stop_string, reason):
    """While a long request runs the gauges show it; aborting it counts as an abort, unless
    the router ended it for a stop string, which counts as a stop."""
    before = scrape(worker.metrics_port)
    seen: dict[str, float] = {}

    def abort_once_running(message: worker_pb2.WorkerMessage) -> list[worker_pb2.RouterMessage]:
        if seen or message.WhichOneof("kind") != "step":
            return []
        m = poll(worker.metrics_port, lambda m: m[("pagedserve_worker_requests_running", ())] == 1)
        seen.update(running=m[("pagedserve_worker_requests_running", ())],
                    kv=m[("vllm:kv_cache_usage_perc", ())])
        return [worker_pb2.RouterMessage(abort=worker_pb2.Abort(request_ids=["long"], stop_string=stop_string))]

    results = asyncio.run(run_requests(worker.address, [submit("long", PROMPT_A, 200)],
                                       on_message=abort_once_running))
    assert results["long"].finish_reason == worker_pb2.FINISH_REASON_ABORT
    assert seen["running"] == 1 and seen["kv"] > 0
    after = poll(worker.metrics_port, lambda m: m[("pagedserve_worker_kv_cache_usage_ratio", ())] == 0)
    finished = ("pagedserve_worker_requests_finished_total", (("reason", reason),))
    assert after[finished] - before[finished] == 1
    e2e = ("pagedserve_worker_e2e_request_latency_seconds_count", ())
    # Only completed requests (a stop string's among them) have an end-to-end latency.
    assert after[e2e] - before[e2e] == (reason == "stop")
