"""Prometheus metrics of the router and the worker: stable names, one registry per process.

Every series starts with `pagedserve_router_` or `pagedserve_worker_` and carries the served
model's name as label `model_name`; docs/observability.md lists them all. Instrumentation code
calls the event methods of `RouterMetrics` / `WorkerMetrics` (`admitted`, `first_token`,
`finished`, `step`, ...), which hold pre-labelled children: a call costs a few lock-and-adds and
no label lookup.

The worker's state gauges and its engine counters (KV usage, running/waiting/swapped,
preemptions, prefix-cache lookups) are not pushed at all: a collector reads the engine's latest
stats snapshot when Prometheus scrapes, so the engine loop pays nothing for them. The same
collector exports the few vLLM-named series that the Kubernetes Gateway API Inference
Extension's endpoint picker reads by default (`vllm:num_requests_waiting`, ...), so a worker is
a drop-in endpoint for it without metric-name flags. `serve_metrics` answers in the text format
only, which keeps those names as they are (TEXT_FORMAT says why).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               make_wsgi_app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

log = logging.getLogger("pagedserve.metrics")

# The `_created` series would double the count of series, and nothing reads them (as in vLLM).
disable_created_metrics()

ROUTER = "pagedserve_router"
WORKER = "pagedserve_worker"

# Seconds. Latencies span a cached 1-token prompt on a GPU to a long queue on a CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06,
                0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
BATCH_TOKEN_BUCKETS = tuple(float(2**i) for i in range(16))     # 1 .. 32768
BATCH_SEQ_BUCKETS = tuple(float(2**i) for i in range(11))       # 1 .. 1024

PREEMPTION_MODES = ("swap", "recompute")
# How a request left the worker: its finish reason, or what ended it early.
WORKER_FINISH_REASONS = ("stop", "length", "abort", "drained", "failed")
# How a request ended at the router, as its client saw it.
ROUTER_FINISH_REASONS = ("stop", "length", "abort", "cancelled", "error")
ROUTER_REJECT_REASONS = ("invalid", "overloaded", "unavailable", "not_found")
# Why the router itself takes a request off a worker's GPU (router.preemption): for a more
# urgent one.
ROUTER_SWAP_REASONS = ("priority", "slow_reader")


class _RequestMetrics:
    """The per-request series router and worker share, under one prefix."""

    def __init__(self, prefix: str, where: str, model_name: str, registry: CollectorRegistry,
                 finish_reasons: tuple[str, ...]):
        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"{prefix}_{name}", doc, ["model_name"], registry=registry,
                             buckets=buckets).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(f"{prefix}_{name}", doc, ["model_name"], registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds",
                              f"Time from a request's arrival at the {where} to its first generated token.",
                              LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time between a request's output tokens after the first, per request "
                              "that ended with stop or length and produced two tokens or more.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             f"Time from a request's arrival at the {where} to its last token, per request "
                             "that ended with stop or length.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               f"Time a request waited at the {where} before it was admitted.", LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests admitted (router) or that "
                                     "produced their first token (worker).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        family = Counter(f"{prefix}_requests_finished", f"Requests that left the {where}, by reason.",
                         ["model_name", "reason"], registry=registry)
        self.finished = {reason: family.labels(model_name, reason) for reason in finish_reasons}

    def observe_end(self, reason: str, e2e_s: float, ttft_s: float | None, output_tokens: int) -> None:
        self.finished[reason].inc()
        if reason in ("stop", "length"):
            self.e2e.observe(e2e_s)
            if ttft_s is not None and output_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (output_tokens - 1))


# ---------------------------------------------------------------------------- worker


class EngineState(Protocol):
    """What the worker's collector reads from the engine's stats snapshot (`EngineStats`)."""
    total_blocks: int
    free_blocks: int
    total_swap_blocks: int
    free_swap_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions: Mapping[str, int]     # mode -> preemptions since start
    prefix_queries: int                # KV blocks looked up in the prefix cache
    prefix_hits: int                   # of those, found
    # LoRA: (name, path, rank, target modules, in a device slot, sequences held) per adapter.
    lora_adapters: list[tuple[str, str, int, list[str], bool, int]]
    lora_slots_in_use: int
    lora_loads: int                    # adapters copied into a device slot
    lora_evictions: int                # adapters dropped from host memory


class WorkerMetrics:
    """A worker's metrics. Event methods are called on the engine thread; `state` is called on
    the scrape thread and must return the latest snapshot without touching the engine."""

    def __init__(self, model_name: str, registry: CollectorRegistry, state: Callable[[], EngineState],
                 block_size: int, max_loras: int = 0, config: ModelSetup | None = None):
        self.requests = _RequestMetrics(WORKER, "worker", model_name, registry, WORKER_FINISH_REASONS)
        self.model_name = model_name
        self.lora_requests = Counter(f"{WORKER}_lora_requests", "Requests that left the worker, by LoRA "
                                     "adapter.", ["model_name", "lora_name"], registry=registry)
        self.lora_tokens = Counter(f"{WORKER}_lora_generation_tokens", "Tokens generated, by LoRA adapter.",
                                   ["model_name", "lora_name"], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"{WORKER}_{name}", doc, ["model_name"], registry=registry,
                             buckets=buckets).labels(model_name)

        self.step_duration = histogram("step_duration_seconds", "Wall time of one engine step that "
                                       "computed tokens (schedule, forward, sample).", STEP_BUCKETS)
        self.step_tokens = histogram("step_batch_tokens", "Tokens computed in one engine step "
                                     "(prompt chunks + decodes).", BATCH_TOKEN_BUCKETS)
        self.step_seqs = histogram("step_batch_sequences", "Sequences in one engine step.", BATCH_SEQ_BUCKETS)
        self.setup = config or ModelSetup()
        registry.register(_EngineCollector(model_name, state, block_size, max_loras, self.setup))

    def step(self, duration_s: float, num_tokens: int, num_seqs: int, num_generated: int) -> None:
        """One engine step that computed `num_tokens` tokens of `num_seqs` sequences (none:
        it only read the previous step's tokens) and reported `num_generated` tokens."""
        if num_seqs:
            self.step_duration.observe(duration_s)
            self.step_tokens.observe(num_tokens)
            self.step_seqs.observe(num_seqs)
        if num_generated:
            self.requests.generation_tokens.inc(num_generated)

    def admitted(self, queue_time_s: float) -> None:
        """A request joined the running batch for the first time."""
        self.requests.queue.observe(queue_time_s)

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self.requests.ttft.observe(ttft_s)
        self.requests.prompt_tokens.inc(prompt_tokens)

    def finished(self, reason: str, e2e_s: float, ttft_s: float | None, output_tokens: int) -> None:
        """A request left the worker; `reason` is one of WORKER_FINISH_REASONS. Latency
        histograms take only requests that completed (stop, length)."""
        self.requests.observe_end(reason, e2e_s, ttft_s, output_tokens)

    def lora_finished(self, lora_name: str, output_tokens: int) -> None:
        """A request under a LoRA adapter left the worker (besides `finished`)."""
        self.lora_requests.labels(self.model_name, lora_name).inc()
        self.lora_tokens.labels(self.model_name, lora_name).inc(output_tokens)


@dataclass(frozen=True)
class ModelSetup:
    """How a worker holds its model, as the config info series label it (InfoResponse's names)."""
    dtype: str = ""
    quantization: str = "none"
    kv_cache_dtype: str = ""


class _EngineCollector(Collector):
    """Builds the worker's state series from the engine's latest stats at scrape time."""

    def __init__(self, model_name: str, state: Callable[[], EngineState], block_size: int, max_loras: int,
                 setup: ModelSetup):
        self.model_name = model_name
        self.state = state
        self.block_size = block_size
        self.max_loras = max_loras
        self.setup = setup
        self.started = time.time()

    def collect(self) -> Iterator[Metric]:
        s, m = self.state(), self.model_name
        kv_usage = 1 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0
        swap_usage = 1 - s.free_swap_blocks / s.total_swap_blocks if s.total_swap_blocks else 0.0

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([m], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([m], value)
            return family

        yield gauge(f"{WORKER}_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge(f"{WORKER}_requests_waiting", "Requests queued and not admitted yet, or preempted "
                    "for recompute.", s.num_waiting)
        yield gauge(f"{WORKER}_requests_swapped", "Requests swapped out to host memory.", s.num_swapped)
        yield gauge(f"{WORKER}_kv_cache_usage_ratio", "Fraction of GPU KV-cache blocks holding tokens of "
                    "requests (cached prefix blocks no request uses count as free), 0 to 1.", kv_usage)
        yield gauge(f"{WORKER}_swap_space_usage_ratio", "Fraction of host swap blocks in use, 0 to 1.",
                    swap_usage)
        blocks = GaugeMetricFamily(f"{WORKER}_kv_cache_blocks", "KV-cache blocks of the pool "
                                   "(gpu: device pool, cpu: host swap space).", labels=["model_name", "pool"])
        blocks.add_metric([m, "gpu"], s.total_blocks)
        blocks.add_metric([m, "cpu"], s.total_swap_blocks)
        yield blocks
        yield counter(f"{WORKER}_prefix_cache_queries", "KV blocks of prompts looked up in the prefix "
                      "cache.", s.prefix_queries)
        yield counter(f"{WORKER}_prefix_cache_hits", "KV blocks of prompts found in the prefix cache.",
                      s.prefix_hits)
        preemptions = CounterMetricFamily(f"{WORKER}_preemptions", "Requests taken off the GPU, by how "
                                          "their blocks were given up.", labels=["model_name", "mode"])
        for mode in PREEMPTION_MODES:
            preemptions.add_metric([m, mode], s.preemptions.get(mode, 0))
        yield preemptions

        # vLLM's names, as the Gateway API Inference Extension's endpoint picker reads them by default.
        yield gauge("vllm:num_requests_running", "Alias of pagedserve_worker_requests_running.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Alias of pagedserve_worker_requests_waiting.", s.num_waiting)
        yield gauge("vllm:gpu_cache_usage_perc", "Alias of pagedserve_worker_kv_cache_usage_ratio (0 to 1).",
                    kv_usage)
        yield gauge("vllm:kv_cache_usage_perc", "Alias of pagedserve_worker_kv_cache_usage_ratio (0 to 1).",
                    kv_usage)
        cache = GaugeMetricFamily("vllm:cache_config_info", "KV-cache layout (the value is always 1).",
                                  labels=["model_name", "block_size", "num_gpu_blocks", "cache_dtype"])
        cache.add_metric([m, str(self.block_size), str(s.total_blocks), self.setup.kv_cache_dtype], 1)
        yield cache
        setup = GaugeMetricFamily(f"{WORKER}_model_config_info", "How the model is held: its dtype, the "
                                  "decoder linears' quantization, the KV cache's dtype (the value is always 1).",
                                  labels=["model_name", "dtype", "quantization", "kv_cache_dtype"])
        setup.add_metric([m, self.setup.dtype, self.setup.quantization, self.setup.kv_cache_dtype], 1)
        yield setup
        yield from self._lora(s)

    def _lora(self, s: EngineState) -> Iterator[Metric]:
        m = self.model_name
        adapters = GaugeMetricFamily(f"{WORKER}_lora_adapters", "LoRA adapters held, by where they are "
                                     "(device: in a slot, host: in host memory only).", labels=["model_name", "where"])
        on_device = sum(1 for a in s.lora_adapters if a[4])
        adapters.add_metric([m, "device"], on_device)
        adapters.add_metric([m, "host"], len(s.lora_adapters) - on_device)
        yield adapters
        slots = GaugeMetricFamily(f"{WORKER}_lora_slots_in_use", "Device LoRA slots holding an adapter.",
                                  labels=["model_name"])
        slots.add_metric([m], s.lora_slots_in_use)
        yield slots
        for name, doc, value in (("lora_slot_loads", "LoRA adapters copied into a device slot.", s.lora_loads),
                                 ("lora_evictions", "LoRA adapters dropped from host memory "
                                  "(--max-cpu-loras).", s.lora_evictions)):
            family = CounterMetricFamily(f"{WORKER}_{name}", doc, labels=["model_name"])
            family.add_metric([m], value)
            yield family
        # vLLM's series, as the Gateway API Inference Extension's endpoint picker reads it for
        # adapter affinity (present with no adapters too: a missing one is a scrape error there).
        lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters with requests (running: in a "
                                 "device slot; waiting: not yet); the value is when this was last updated, "
                                 "in Unix seconds.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        running = ",".join(a[0] for a in s.lora_adapters if a[5] and a[4])
        waiting = ",".join(a[0] for a in s.lora_adapters if a[5] and not a[4])
        lora.add_metric([str(self.max_loras), running, waiting], time.time() if s.lora_adapters else self.started)
        yield lora


# ---------------------------------------------------------------------------- router


class RouterMetrics:
    """A router's metrics. `running`, `waiting` and `ready_workers` are read at scrape time, on
    the scrape thread: they must be cheap, non-blocking reads (for example a len())."""

    def __init__(self, model_name: str, registry: CollectorRegistry, *, running: Callable[[], float],
                 waiting: Callable[[], float], ready_workers: Callable[[], float]):
        self.requests = _RequestMetrics(ROUTER, "router", model_name, registry, ROUTER_FINISH_REASONS)

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(f"{ROUTER}_{name}", doc, ["model_name"], registry=registry).labels(model_name).set_function(read)

        def counter(name: str, doc: str):
            return Counter(f"{ROUTER}_{name}", doc, ["model_name"], registry=registry).labels(model_name)

        gauge("requests_running", "Requests admitted and not finished.", running)
        gauge("requests_waiting", "Requests in the admission queue.", waiting)
        gauge("workers_ready", "Workers with an open session that accept requests.", ready_workers)
        rejected = Counter(f"{ROUTER}_requests_rejected", "Requests refused before generation, by reason.",
                           ["model_name", "reason"], registry=registry)
        self._rejected = {reason: rejected.labels(model_name, reason) for reason in ROUTER_REJECT_REASONS}
        preempted = Counter(f"{ROUTER}_preemptions", "PREEMPTED events from workers, by mode.",
                            ["model_name", "mode"], registry=registry)
        self._preempted = {mode: preempted.labels(model_name, mode) for mode in PREEMPTION_MODES}
        self._migrations = counter("migrations", "Preempted requests the router moved to another worker.")
        self._rebalances = counter("rebalances", "Running requests the router moved off a worker with "
                                   "requests waiting to one with room.")
        swap_outs = Counter(f"{ROUTER}_swap_outs", "Requests (choices) the router took off a worker's GPU "
                            "(swapped out, or aborted to be recomputed where swap space was short), by why.",
                            ["model_name", "reason"], registry=registry)
        self._swap_outs = {reason: swap_outs.labels(model_name, reason) for reason in ROUTER_SWAP_REASONS}
        swap_ins = Counter(f"{ROUTER}_swap_ins", "Requests (choices) the router had taken off a GPU that run "
                           "again (swapped in, or resubmitted where room was), by why they were out.",
                           ["model_name", "reason"], registry=registry)
        self._swap_ins = {reason: swap_ins.labels(model_name, reason) for reason in ROUTER_SWAP_REASONS}
        self._redispatches = counter("redispatches", "Requests resubmitted after their worker was lost "
                                     "or drained.")
        self._workers_lost = counter("workers_lost", "Worker sessions that ended after the worker joined.")

    def rejected(self, reason: str, count: int = 1) -> None:
        """`count` requests were refused; `reason` is one of ROUTER_REJECT_REASONS."""
        self._rejected[reason].inc(count)

    def admitted(self, queue_time_s: float, prompt_tokens: int) -> None:
        """A request left the admission queue for a worker."""
        self.requests.queue.observe(queue_time_s)
        self.requests.prompt_tokens.inc(prompt_tokens)

    def first_token(self, ttft_s: float) -> None:
        self.requests.ttft.observe(ttft_s)

    def finished(self, reason: str, e2e_s: float, ttft_s: float | None, output_tokens: int) -> None:
        """A request's stream ended; `reason` is one of ROUTER_FINISH_REASONS. Counts its
        output tokens; latency histograms take only requests that completed (stop, length)."""
        self.requests.generation_tokens.inc(output_tokens)
        self.requests.observe_end(reason, e2e_s, ttft_s, output_tokens)

    def lora_finished(self, lora_name: str, output_tokens: int) -> None:
        """A request under a LoRA adapter left the worker (besides `finished`)."""
        self.lora_requests.labels(self.model_name, lora_name).inc()
        self.lora_tokens.labels(self.model_name, lora_name).inc(output_tokens)

    def preempted(self, mode: str) -> None:
        self._preempted[mode].inc()

    def migrated(self) -> None:
        self._migrations.inc()

    def rebalanced(self) -> None:
        self._rebalances.inc()

    def swapped_out(self, reason: str) -> None:
        """`reason` is one of ROUTER_SWAP_REASONS."""
        self._swap_outs[reason].inc()

    def swapped_in(self, reason: str) -> None:
        self._swap_ins[reason].inc()

    def redispatched(self) -> None:
        self._redispatches.inc()

    def worker_lost(self) -> None:
        self._workers_lost.inc()


# ---------------------------------------------------------------------------- serving


# The exposition format /metrics always answers in. prometheus_client (0.22 and later) would
# answer a scraper that asks for OpenMetrics 1.0.0 without naming an escaping, as Prometheus 2
# does, with every `:` of a sample name written as `_` (under `# TYPE vllm:...` lines), so
# Prometheus stored the vLLM-named series as `vllm_num_requests_running` and queries for
# vLLM's names found nothing. The text format writes names as they are, and every scraper reads it.
TEXT_FORMAT = "text/plain; version=0.0.4"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:
        """Scrapes are not logged (they come every few seconds)."""


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> int | None:
    """Serves `registry` at http://host:port/metrics on a daemon thread, in the text format
    whatever the scraper asks for (TEXT_FORMAT); port 0 turns it off.

    Returns the port, or None when off or when the port is taken: metrics are not worth failing
    a serving process for, so that is logged, not raised."""
    if not port:
        return None
    app = make_wsgi_app(registry)

    def text_format_app(environ, start_response):
        return app({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        server = make_server(host, port, text_format_app, server_class, handler_class=_QuietHandler)
    except OSError as e:
        log.error("cannot serve metrics on %s:%d (%s); /metrics is off: choose another --metrics-port",
                  host, port, e)
        return None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server.server_port
