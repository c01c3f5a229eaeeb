"""common.metrics in-process: the router's event methods land in the series they document, a
taken port leaves a process without /metrics rather than without service, /metrics keeps the
vLLM-named series' names whatever format a scraper asks for, and the Grafana dashboard asks
only for series that exist."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.metrics import RouterMetrics, WorkerMetrics, serve_metrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """name, labels other than model_name (always "m" here) -> value."""
    text = generate_latest(registry).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == "m", s
            found[s.name, tuple(sorted(s.labels.items()))] = s.value
    return found


def test_router_metrics_record_what_they_are_told():
    registry = CollectorRegistry()
    queue = [1, 2]
    metrics = RouterMetrics("m", registry, running=lambda: 3, waiting=lambda: len(queue), ready_workers=lambda: 2)
    metrics.rejected("overloaded")
    metrics.admitted(0.5, prompt_tokens=10)
    metrics.first_token(0.25)
    metrics.finished("length", e2e_s=1.25, ttft_s=0.25, output_tokens=5)
    metrics.finished("cancelled", e2e_s=0.1, ttft_s=None, output_tokens=0)
    metrics.preempted("swap")
    metrics.migrated()
    metrics.swapped_out("priority")
    metrics.swapped_out("priority")
    metrics.swapped_in("priority")
    metrics.redispatched()
    metrics.worker_lost()
    queue.pop()

    m = samples(registry)
    assert m[("pagedserve_router_requests_running", ())] == 3
    assert m[("pagedserve_router_requests_waiting", ())] == 1     # read when scraped
    assert m[("pagedserve_router_workers_ready", ())] == 2
    assert m[("pagedserve_router_requests_rejected_total", (("reason", "overloaded"),))] == 1
    assert m[("pagedserve_router_requests_rejected_total", (("reason", "invalid"),))] == 0
    assert m[("pagedserve_router_request_queue_time_seconds_sum", ())] == 0.5
    assert m[("pagedserve_router_prompt_tokens_total", ())] == 10
    assert m[("pagedserve_router_generation_tokens_total", ())] == 5
    assert m[("pagedserve_router_time_to_first_token_seconds_count", ())] == 1
    assert m[("pagedserve_router_requests_finished_total", (("reason", "length"),))] == 1
    assert m[("pagedserve_router_requests_finished_total", (("reason", "cancelled"),))] == 1
    # Latency of completed requests only; TPOT = (1.25 - 0.25) / (5 - 1).
    assert m[("pagedserve_router_e2e_request_latency_seconds_count", ())] == 1
    assert m[("pagedserve_router_time_per_output_token_seconds_sum", ())] == pytest.approx(0.25)
    assert m[("pagedserve_router_preemptions_total", (("mode", "swap"),))] == 1
    assert m[("pagedserve_router_migrations_total", ())] == 1
    assert m[("pagedserve_router_swap_outs_total", (("reason", "priority"),))] == 2
    assert m[("pagedserve_router_swap_ins_total", (("reason", "priority"),))] == 1
    assert m[("pagedserve_router_redispatches_total", ())] == 1
    assert m[("pagedserve_router_workers_lost_total", ())] == 1


def test_a_taken_metrics_port_is_logged_not_raised(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert serve_metrics(CollectorRegistry(), taken.getsockname()[1], "127.0.0.1") is None
    assert "cannot serve metrics" in caplog.text
    assert serve_metrics(CollectorRegistry(), 0) is None


# What Prometheus asks for when it scrapes: 2.x, 3.x, 3.x with legacy names, and a plain client.
SCRAPE_ACCEPT_HEADERS = [
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,application/openmetrics-text;"
    "version=0.0.1;q=0.9,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.8,text/plain;version=0.0.4;q=0.7",
    "application/openmetrics-text;version=1.0.0;escaping=underscores,text/plain;version=0.0.4;q=0.5",
    "",
]


@pytest.mark.parametrize("accept", SCRAPE_ACCEPT_HEADERS, ids=["prometheus-2", "prometheus-3",
                                                                "prometheus-3-legacy-names", "no-accept"])
def test_vllm_names_survive_every_scrape_format(accept):
    """The vLLM-named series keep their `vllm:` names in the samples (prometheus_client's
    OpenMetrics encoder would write `vllm_num_requests_running`, which is what Prometheus stored)."""
    registry = CollectorRegistry()
    state = SimpleNamespace(total_blocks=8, free_blocks=6, total_swap_blocks=0, free_swap_blocks=0, num_running=2,
                            num_waiting=1, num_swapped=0, preemptions={}, prefix_queries=0, prefix_hits=0,
                            lora_adapters=[("sql", "/adapters/sql", 8, ["q_proj"], True, 1)],
                            lora_slots_in_use=1, lora_loads=1, lora_evictions=0)
    WorkerMetrics("m", registry, lambda: state, block_size=16)
    port = serve_metrics(registry, _free_port(), "127.0.0.1")
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=5) as reply:
        content_type, text = reply.headers["Content-Type"], reply.read().decode()
    assert content_type.startswith("text/plain; version=0.0.4")
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert values["vllm:num_requests_running"] == 2 and values["vllm:num_requests_waiting"] == 1
    assert values["vllm:kv_cache_usage_perc"] == values["pagedserve_worker_kv_cache_usage_ratio"] == 0.25
    assert not [name for name in values if name.startswith("vllm_")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_dashboard_queries_only_metrics_that_exist():
    """Every series helm/pagedserve/dashboards/pagedserve.json asks for is one RouterMetrics or WorkerMetrics exports."""
    registry = CollectorRegistry()
    RouterMetrics("m", registry, running=lambda: 0, waiting=lambda: 0, ready_workers=lambda: 0)
    state = SimpleNamespace(total_blocks=8, free_blocks=8, total_swap_blocks=0, free_swap_blocks=0, num_running=0,
                            num_waiting=0, num_swapped=0, preemptions={}, prefix_queries=0, prefix_hits=0,
                            lora_adapters=[], lora_slots_in_use=0, lora_loads=0, lora_evictions=0)
    WorkerMetrics("m", registry, lambda: state, block_size=16)
    exported = {s.name for family in text_string_to_metric_families(generate_latest(registry).decode())
                for s in family.samples}

    dashboard = json.loads((Path(__file__).parent.parent / "helm/pagedserve/dashboards/pagedserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    queried = {name for expr in exprs for name in re.findall(r"\b(pagedserve_[a-z0-9_]+)", expr)}
    assert queried and queried <= exported, queried - exported


def test_lora_series_name_the_adapters_with_requests():
    registry = CollectorRegistry()
    state = SimpleNamespace(total_blocks=8, free_blocks=8, total_swap_blocks=0, free_swap_blocks=0, num_running=2,
                            num_waiting=0, num_swapped=0, preemptions={}, prefix_queries=0, prefix_hits=0,
                            lora_adapters=[("sql", "/a/sql", 8, ["q_proj"], True, 2),
                                           ("poet", "/a/poet", 16, ["o_proj"], False, 1),
                                           ("idle", "/a/idle", 8, ["q_proj"], False, 0)],
                            lora_slots_in_use=1, lora_loads=3, lora_evictions=1)
    metrics = WorkerMetrics("m", registry, lambda: state, block_size=16, max_loras=4)
    metrics.lora_finished("sql", 7)
    samples = [s for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples]
    info = next(s for s in samples if s.name == "vllm:lora_requests_info")
    assert (info.labels["max_lora"], info.labels["running_lora_adapters"], info.labels["waiting_lora_adapters"]) == \
        ("4", "sql", "poet")
    where = {s.labels["where"]: s.value for s in samples if s.name == "pagedserve_worker_lora_adapters"}
    assert where == {"device": 1, "host": 2}
    tokens = next(s for s in samples if s.name == "pagedserve_worker_lora_generation_tokens_total")
    assert (tokens.labels["lora_name"], tokens.value) == ("sql", 7)
