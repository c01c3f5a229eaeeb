"""Priority under saturation (issue 15): what the router's policies for urgent requests buy
urgent requests, and what they cost in throughput.

For each policy setting in --policies, a fresh `pagedserve serve --role all` (bench/w5.py's
`serving`, with --model-args and the setting's flags) gets the same seeded online workload over
its gRPC API: Poisson arrivals at --rate for --duration seconds (or --num-requests), each one
urgent (priority 0) with probability --urgent-share and otherwise low (priority 1); lognormal
prompt and output lengths, the same for both classes, every output generated in full
(`ignore_eos`); token-id prompts, so dummy weights without a tokenizer serve them.

    on   --preempt-for-priority --rebalance (the defaults): an urgent request that fits no
         worker takes less urgent ones off the GPU and runs at once (docs/serving.md,
         "Priority across the fleet", "Rebalancing", "Slow readers")
    off  --no-preempt-for-priority --no-rebalance --slow-reader-timeout 0: urgent requests
         only overtake the others in the router's priority-ordered queue, and wait there for
         a running request to end

The policies act only when requests wait, so the workload must saturate the KV pool: the
router reserves prompt + max_tokens of a worker's pool for each request, and a pool shrunk
with the worker's --num-blocks makes those reservations, not the GPU's speed, the limit. The
queue limits are raised in the commands below so that the backlog of an overloaded phase
waits rather than fails (a failed request would take its tokens out of the throughput).

Per setting it reports urgent TTFT p50/p90/p99, low TTFT p50/p99, TPOT p50/p99 of each class
(a request taken off the GPU pauses: that shows in its TPOT), output tokens/s over the phase
(from its start to its last request's end, so a lower capacity shows as a longer drain),
completed and failed counts; the router's counters over the phase, from its /metrics: swap-outs
(by reason) and swap-ins, rebalances, its worker's PREEMPTED events by mode (swap: the
router's swap-outs; recompute: where swap space was short, or the worker's own), rejections,
the mean wait in its admission queue, and the queue's length sampled each second (the evidence
of saturation); and the worker's mean engine step time and sequences per step, which tell a
throughput difference due to the pool being less used (fewer sequences) from one due to slower
steps (copies, or a busy machine: on a shared CPU that noise is ±10 %). Then the comparison:
urgent TTFT p50/p99 on against off, and throughput on/off, which issue 15 wants at 0.95 or
more (--max-throughput-drop). TTFT is from sending a request to its first token at the client.
A table goes to stdout and --markdown, everything (per request too) to --out.

    # one H200 (from the repository root, after `source bench/device_env.sh`): the 8B shape
    # in dummy bf16 weights (bench/gpu_w5.sh's model) over a pool of 16,384 tokens, about 21
    # mean reservations; 600 requests bound each setting's time whatever the capacity
    timeout 470 python3 bench/priority_bench.py --rate 16 --num-requests 600 \\
        --out "$OUT/priority.json" --markdown "$OUT/priority.md" \\
        --model-args "--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096 \\
        --num-blocks 1024 --swap-space 8 --max-queue-len 4096 --max-queue-wait 300"
    # a CPU check: the embedded SmolLM2-135M over a pool of 512 tokens, about a minute a setting
    python bench/priority_bench.py --scale 0.1 --rate 3 --num-requests 60 \\
        --model-args "--device cpu --dtype bfloat16 --num-blocks 32 --max-queue-wait 300"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from common.pb import generation_pb2 as pb  # noqa: E402
from common.pb import generation_pb2_grpc  # noqa: E402
from report import current_commit  # noqa: E402
from w5 import GrpcClient, Outcome, Slo, distribution, log, ms, run_phase, serving, summarize  # noqa: E402
from w5_workload import HIGHEST_ID, LOWEST_ID, W5Request, lognormal, poisson_arrivals  # noqa: E402

URGENT, LOW = "urgent", "low"
CLASSES = (URGENT, LOW)
PRIORITY = {URGENT: 0, LOW: 1}       # lower is more urgent (GenerateRequest.priority)

# Each setting's router flags, after --model-args so that they win over them. "on" names the
# defaults too, so that PAGEDSERVE_* variables in the environment cannot turn them off.
POLICY_FLAGS = {
    "on": ["--preempt-for-priority", "--rebalance"],
    "off": ["--no-preempt-for-priority", "--no-rebalance", "--slow-reader-timeout", "0"],
}


# ---------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class PriorityMix:
    """The workload's shape; lengths in tokens, each a lognormal draw of the mean clipped to
    the range. `scaled` shrinks it for a small model or a CPU."""

    urgent_share: float = 0.2
    prompt_mean: float = 512.0
    prompt_sigma: float = 0.6
    prompt_tokens: tuple[int, int] = (32, 2048)
    output_mean: float = 256.0
    output_sigma: float = 0.6
    output_tokens: tuple[int, int] = (16, 1024)

    def scaled(self, factor: float) -> PriorityMix:
        """Every length times `factor`, with at least 1 prompt token and 2 output tokens (so
        that TPOT is defined)."""
        def span(pair: tuple[int, int], low: int) -> tuple[int, int]:
            return max(low, round(pair[0] * factor)), max(low, round(pair[1] * factor))
        return replace(self, prompt_mean=max(1.0, self.prompt_mean * factor),
                       prompt_tokens=span(self.prompt_tokens, 1),
                       output_mean=max(2.0, self.output_mean * factor),
                       output_tokens=span(self.output_tokens, 2))


@dataclass
class PriorityRequest(W5Request):
    """A request of the workload: a W5Request (so that w5.run_phase sends it; no shared
    prefix) with its priority. Its `kind` is its class, URGENT or LOW."""

    priority: int


def generate(mix: PriorityMix, rate: float, *, seed: int, vocab_size: int, duration_s: float | None = None,
             num_requests: int | None = None) -> list[PriorityRequest]:
    """The requests arriving at `rate` per second (Poisson) within `duration_s`, or the first
    `num_requests` of them: a function of (mix, rate, seed), so every setting gets the same."""
    rate = float(rate)          # 8 and 8.0 draw the same requests
    shape = random.Random(f"priority:{seed}:{rate!r}:shape")
    content = random.Random(f"priority:{seed}:{rate!r}:content")
    high = min(HIGHEST_ID, vocab_size)
    requests: list[PriorityRequest] = []
    for arrival in poisson_arrivals(shape, rate, duration_s, num_requests):
        # Every draw is made for every request, so another urgent share keeps the lengths.
        kind = URGENT if shape.random() < mix.urgent_share else LOW
        prompt_len = lognormal(shape, mix.prompt_mean, mix.prompt_sigma, mix.prompt_tokens)
        max_tokens = lognormal(shape, mix.output_mean, mix.output_sigma, mix.output_tokens)
        # Random tokens: no two requests share a prefix, so the prefix cache makes none cheaper.
        prompt = [content.randrange(LOWEST_ID, high) for _ in range(prompt_len)]
        requests.append(PriorityRequest(len(requests), kind, arrival, prompt, max_tokens, system_prompt=None,
                                        shared_prefix_tokens=0, priority=PRIORITY[kind]))
    return requests


def warmup_requests(mix: PriorityMix, *, seed: int, vocab_size: int) -> list[PriorityRequest]:
    """What each server gets before it is timed, all at t=0, low, 8 output tokens each: the
    shortest and the longest prompt, so that kernel variants for those shapes are compiled."""
    rng = random.Random(f"priority:{seed}:warm-up")
    high = min(HIGHEST_ID, vocab_size)
    return [PriorityRequest(i, LOW, 0.0, [rng.randrange(LOWEST_ID, high) for _ in range(length)], 8,
                            system_prompt=None, shared_prefix_tokens=0, priority=PRIORITY[LOW])
            for i, length in enumerate(mix.prompt_tokens)]


class PriorityClient(GrpcClient):
    """w5's gRPC client (token-id prompts, ignore_eos, greedy), with each request's priority."""

    def payload(self, request: PriorityRequest) -> pb.GenerateRequest:
        message = super().payload(request)
        message.priority = request.priority
        return message


# ---------------------------------------------------------------------------- the router's metrics


@dataclass(frozen=True)
class RouterCounters:
    """The router's counters at one scrape (sums over their series), or their change over a
    phase (`minus`)."""

    swap_outs_priority: float = 0.0      # choices taken off a GPU for a more urgent request
    swap_outs_slow_reader: float = 0.0   # ... while their client did not read
    swap_ins: float = 0.0                # choices that ran again after one of those
    rebalances: float = 0.0
    # PREEMPTED events from the worker, by mode: one per swap-out the router asked for, and
    # the worker's own preemptions when its pool ran short (none while the router's budget holds).
    preempted_swap: float = 0.0
    preempted_recompute: float = 0.0
    rejected: float = 0.0
    queue_wait_s: float = 0.0            # sum of the waits in the admission queue
    admitted: float = 0.0                # requests that left the admission queue

    def minus(self, before: RouterCounters) -> RouterCounters:
        return RouterCounters(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})


@dataclass(frozen=True)
class WorkerSteps:
    """The worker's engine steps so far (its step histograms' counts and sums), or over a
    phase (`minus`): what a throughput difference comes from, fewer sequences per step (the
    pool less used) or longer steps (copies, a busier machine)."""

    steps: float = 0.0
    seconds: float = 0.0      # their wall time
    sequences: float = 0.0    # the sequences each ran, summed

    def minus(self, before: WorkerSteps) -> WorkerSteps:
        return WorkerSteps(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def report(self) -> dict:
        return {"steps": self.steps, "mean_step_s": self.seconds / self.steps if self.steps else None,
                "mean_sequences": self.sequences / self.steps if self.steps else None}


@dataclass(frozen=True)
class WorkerScrape:
    """What one scrape of the worker's /metrics gives."""

    pool_tokens: int    # its KV pool: the router's budget for it
    steps: WorkerSteps


@dataclass(frozen=True)
class RouterScrape:
    """What one scrape of the router's /metrics gives."""

    counters: RouterCounters
    running: float     # requests admitted and not finished (gauge)
    waiting: float     # requests in the admission queue (gauge)


# Sample name (and its reason or mode label, where that splits a family) -> RouterCounters field.
_COUNTER_SAMPLES = {
    ("pagedserve_router_swap_outs_total", "priority"): "swap_outs_priority",
    ("pagedserve_router_swap_outs_total", "slow_reader"): "swap_outs_slow_reader",
    ("pagedserve_router_swap_ins_total", None): "swap_ins",
    ("pagedserve_router_rebalances_total", None): "rebalances",
    ("pagedserve_router_preemptions_total", "swap"): "preempted_swap",
    ("pagedserve_router_preemptions_total", "recompute"): "preempted_recompute",
    ("pagedserve_router_requests_rejected_total", None): "rejected",
    ("pagedserve_router_request_queue_time_seconds_sum", None): "queue_wait_s",
    ("pagedserve_router_request_queue_time_seconds_count", None): "admitted",
}


def parse_router_metrics(text: str) -> RouterScrape | None:
    """The router's counters and queue gauges from its /metrics text; None if it has none (a
    worker's /metrics)."""
    values = dict.fromkeys(_COUNTER_SAMPLES.values(), 0.0)
    gauges = {"pagedserve_router_requests_running": None, "pagedserve_router_requests_waiting": None}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in gauges:
                gauges[sample.name] = sample.value
                continue
            label = sample.labels.get("reason", sample.labels.get("mode"))
            name = (_COUNTER_SAMPLES.get((sample.name, label))
                    or _COUNTER_SAMPLES.get((sample.name, None)))
            if name is not None:
                values[name] += sample.value
    if None in gauges.values():
        return None
    return RouterScrape(RouterCounters(**values), gauges["pagedserve_router_requests_running"],
                        gauges["pagedserve_router_requests_waiting"])


_STEP_SAMPLES = {"pagedserve_worker_step_duration_seconds_count": "steps",
                 "pagedserve_worker_step_duration_seconds_sum": "seconds",
                 "pagedserve_worker_step_batch_sequences_sum": "sequences"}


def parse_worker_metrics(text: str) -> WorkerScrape | None:
    """The pool and the step figures from a worker's /metrics text; None if it has no pool (a
    router's /metrics)."""
    pool, steps = None, dict.fromkeys(_STEP_SAMPLES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                pool = int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
            elif sample.name in _STEP_SAMPLES:
                steps[_STEP_SAMPLES[sample.name]] += sample.value
    return WorkerScrape(pool, WorkerSteps(**steps)) if pool is not None else None


async def fetch_text(session: aiohttp.ClientSession, url: str) -> str | None:
    """The body at `url`, or None, said in the log: a run's latencies are worth keeping
    without the figures a failed scrape would have given."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status == 200:
                return await response.text()
            problem = f"answered HTTP {response.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        problem = f"failed: {type(error).__name__}: {error}"
    log(f"metrics at {url} {problem}")
    return None


async def scrape_router(session: aiohttp.ClientSession, url: str) -> RouterScrape | None:
    text = await fetch_text(session, url)
    return parse_router_metrics(text) if text is not None else None


async def scrape_worker(session: aiohttp.ClientSession, url: str) -> WorkerScrape | None:
    text = await fetch_text(session, url)
    return parse_worker_metrics(text) if text is not None else None


async def watch_router(session: aiohttp.ClientSession, url: str, requests: Sequence[PriorityRequest],
                       interval_s: float, waiting: list[float]) -> None:
    """Until cancelled: samples the router's queue length into `waiting` every second (the
    evidence that the phase saturates the pool), and logs progress every `interval_s`; stops
    at a failed scrape (logged once)."""
    start = last_log = time.perf_counter()
    while True:
        await asyncio.sleep(1.0)
        scrape = await scrape_router(session, url)
        if scrape is None:
            return
        waiting.append(scrape.waiting)
        now = time.perf_counter()
        if now - last_log >= interval_s:
            last_log = now
            sent = sum(r.arrival_s <= now - start for r in requests)
            log(f"  {now - start:5.0f} s: {sent}/{len(requests)} sent; router: {scrape.running:.0f} running, "
                f"{scrape.waiting:.0f} waiting, {scrape.counters.swap_outs_priority:.0f} swapped out for "
                f"priority since start")


# ---------------------------------------------------------------------------- the report


@dataclass
class Phase:
    """One policy setting's run of the workload."""

    policies: str                       # "on" or "off"
    server_flags: list[str]
    seconds: float                      # from the phase's start to its last request's end
    classes: dict[str, dict]            # "all", URGENT, LOW: w5.summarize()
    router: dict | None                 # RouterCounters over the phase (None: no /metrics)
    router_mean_wait_s: float | None    # mean wait in the admission queue of those admitted
    router_waiting: dict | None         # the queue's length, sampled each second: mean and max
    worker_steps: dict | None           # WorkerSteps.report() over the phase (None: no /metrics)
    send_lag_s: dict | None             # how late the client sent requests: p99 and max
    per_request: list[dict] = field(repr=False)


def summarize_classes(outcomes: Sequence[Outcome], seconds: float) -> dict[str, dict]:
    """w5.summarize() over all requests and over each class (a class's output tokens/s is its
    share of the phase's throughput). Its goodput is at W5's default objectives."""
    out = {"all": summarize(outcomes, seconds, Slo())}
    for kind in CLASSES:
        out[kind] = summarize([o for o in outcomes if o.kind == kind], seconds, Slo())
    return out


def make_phase(policies: str, outcomes: Sequence[Outcome], seconds: float, before: RouterScrape | None,
               after: RouterScrape | None, waiting: Sequence[float], steps: WorkerSteps | None) -> Phase:
    """A setting's figures: its requests' outcomes, the router's scrapes before and after the
    phase and its queue lengths sampled in between, and the worker's steps over the phase."""
    counters = after.counters.minus(before.counters) if before is not None and after is not None else None
    lags = [o.send_lag_s for o in outcomes]
    return Phase(
        policies=policies, server_flags=POLICY_FLAGS[policies], seconds=seconds,
        classes=summarize_classes(outcomes, seconds),
        router=asdict(counters) if counters is not None else None,
        router_mean_wait_s=counters.queue_wait_s / counters.admitted if counters is not None and counters.admitted
        else None,
        router_waiting={"mean": statistics.fmean(waiting), "max": max(waiting)} if waiting else None,
        worker_steps=steps.report() if steps is not None else None,
        send_lag_s={"p99": distribution(lags)["p99"], "max": max(lags)} if lags else None,
        per_request=[o.record() for o in outcomes])


def compare(on: dict, off: dict, max_drop: float) -> dict:
    """The issue's comparison of two settings' `classes`: urgent TTFT p50 and p99 on and off
    (seconds; None where no urgent request completed), and throughput on/off against the
    bound 1 - max_drop."""
    def urgent_ttft(classes: dict, key: str) -> float | None:
        dist = classes[URGENT]["ttft_s"]
        return dist[key] if dist else None

    out = {f"urgent_ttft_{key}_s": {"on": urgent_ttft(on, key), "off": urgent_ttft(off, key)}
           for key in ("p50", "p99")}
    on_rate, off_rate = on["all"]["output_tokens_per_s"], off["all"]["output_tokens_per_s"]
    ratio = on_rate / off_rate if on_rate is not None and off_rate else None
    return out | {"throughput_ratio": ratio, "throughput_bound": 1 - max_drop,
                  "throughput_holds": ratio is not None and ratio >= 1 - max_drop}


def two_ms(dist: dict | None) -> str:
    """A distribution's p50 / p99 in milliseconds."""
    return "–" if dist is None else f"{dist['p50'] * 1e3:.0f} / {dist['p99'] * 1e3:.0f}"


def markdown(result: dict) -> str:
    """The run as a Markdown table, one row per setting, and the comparison, for docs/BENCHMARKS.md."""
    mix = result["mix"]
    per_phase = (f"{result['duration_s']:g} s of arrivals" if result["duration_s"]
                 else f"{result['num_requests']} requests")
    lines = [(f"Priority under saturation on {result.get('model', '?')}: Poisson arrivals at {result['rate']:g} "
              f"requests/s, {per_phase} per setting, {mix['urgent_share']:.0%} urgent (priority 0, the rest 1); "
              f"lognormal prompts of {mix['prompt_mean']:.0f} and outputs of {mix['output_mean']:.0f} tokens "
              f"on average (ignore_eos); KV pool {result.get('pool_tokens') or '?'} tokens; "
              f"seed {result['seed']}. "
              f"Server: `{result['model_args']}`; \"off\" adds `{shlex.join(POLICY_FLAGS['off'])}`."),
             "",
             ("| policies | requests (failed) | urgent TTFT p50 / p90 / p99 ms | low TTFT p50 / p99 ms "
              "| TPOT p50 / p99 ms, urgent · low | out tok/s | swap-outs / swap-ins · rebalances "
              "| router queue: mean wait ms · mean / max length | engine step: mean ms · sequences |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, phase in result["settings"].items():
        classes, router = phase["classes"], phase["router"]
        moves = "–"
        if router is not None:
            slow = router["swap_outs_slow_reader"]
            moves = (f"{router['swap_outs_priority']:.0f}{f' + {slow:.0f} slow reader' if slow else ''} "
                     f"/ {router['swap_ins']:.0f} · {router['rebalances']:.0f}")
        wait = "–" if phase["router_mean_wait_s"] is None else f"{phase['router_mean_wait_s'] * 1e3:.0f}"
        length = "–" if phase["router_waiting"] is None else (f"{phase['router_waiting']['mean']:.1f} / "
                                                             f"{phase['router_waiting']['max']:.0f}")
        steps = phase["worker_steps"]
        step = ("–" if steps is None or steps["mean_step_s"] is None
                else f"{steps['mean_step_s'] * 1e3:.1f} · {steps['mean_sequences']:.1f}")
        everything = classes["all"]
        lines.append(f"| {setting} | {everything['requests']} ({everything['failed']}) "
                     f"| {ms(classes[URGENT]['ttft_s'], 0)} | {two_ms(classes[LOW]['ttft_s'])} "
                     f"| {two_ms(classes[URGENT]['tpot_s'])} · {two_ms(classes[LOW]['tpot_s'])} "
                     f"| {everything['output_tokens_per_s']:,.0f} | {moves} | {wait} · {length} | {step} |")
    if comparison := result.get("comparison"):
        def change(key: str) -> str:
            values = comparison[f"urgent_ttft_{key}_s"]
            if values["on"] is None or values["off"] is None:
                return f"{key} –"
            return f"{key} {values['off'] * 1e3:.0f} → {values['on'] * 1e3:.0f} ms"
        ratio = comparison["throughput_ratio"]
        verdict = ("–" if ratio is None else f"{ratio:.3f}, "
                   + ("within" if comparison["throughput_holds"] else "**outside**")
                   + f" the bound of {comparison['throughput_bound']:.2f}")
        lines += ["", f"Urgent TTFT, policies off → on: {change('p50')}, {change('p99')}. "
                      f"Throughput on/off: {verdict}."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- a run


async def run_setting(args: argparse.Namespace, mix: PriorityMix, policies: str, grpc_address: str,
                      http_url: str, worker_metrics_url: str, result: dict) -> Phase:
    """The warm-up, then the timed workload, on a server started for `policies`."""
    router_metrics_url = f"{http_url}/metrics"   # with --role all the router serves them on its HTTP API
    async with grpc.aio.insecure_channel(grpc_address) as channel, aiohttp.ClientSession() as session:
        info = await generation_pb2_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)
        worker = await scrape_worker(session, worker_metrics_url)
        pool = worker.pool_tokens if worker is not None else None
        requests = generate(mix, args.rate, seed=args.seed, vocab_size=info.vocab_size,
                            duration_s=args.duration, num_requests=args.num_requests)
        # The router would refuse a reservation larger than the pool, the worker a sequence
        # longer than max_model_len: say so before anything is timed.
        largest = max(len(r.prompt) + r.max_tokens for r in requests)
        if largest > info.max_model_len or (pool is not None and largest > pool):
            raise SystemExit(f"the largest request ({largest} tokens) exceeds the served max_model_len "
                             f"{info.max_model_len} or the KV pool ({pool} tokens): lower --scale or "
                             f"enlarge the server")
        result |= {"model": info.model_names[0], "vocab_size": info.vocab_size, "pool_tokens": pool}
        client = PriorityClient(channel, args.request_timeout)
        warmup = warmup_requests(mix, seed=args.seed, vocab_size=info.vocab_size)
        outcomes, seconds = await run_phase(client, warmup)
        if failed := [o.error for o in outcomes if not o.completed]:
            raise SystemExit(f"{len(failed)} warm-up requests failed, first: {failed[0]}")
        urgent = sum(r.kind == URGENT for r in requests)
        mean_reservation = statistics.fmean(len(r.prompt) + r.max_tokens for r in requests)
        log(f"policies {policies}: warm-up done in {seconds:.1f} s; sending {len(requests)} requests "
            f"({urgent} urgent) at {args.rate:g}/s, mean reservation {mean_reservation:.0f} tokens"
            + (f" (the pool holds {pool / mean_reservation:.1f} of them)" if pool else ""))
        before = await scrape_router(session, router_metrics_url)
        worker_before = await scrape_worker(session, worker_metrics_url)
        waiting: list[float] = []
        watcher = asyncio.create_task(watch_router(session, router_metrics_url, requests,
                                                   args.progress_interval, waiting))
        try:
            outcomes, seconds = await run_phase(client, requests)
        finally:
            watcher.cancel()
        await asyncio.sleep(0.3)    # the last requests' counters follow their ends
        after = await scrape_router(session, router_metrics_url)
        worker_after = await scrape_worker(session, worker_metrics_url)
    steps = (worker_after.steps.minus(worker_before.steps)
             if worker_before is not None and worker_after is not None else None)
    phase = make_phase(policies, outcomes, seconds, before, after, waiting, steps)
    classes = phase.classes
    log(f"policies {policies}: {classes['all']['completed']}/{classes['all']['requests']} done in {seconds:.1f} s, "
        f"{classes['all']['output_tokens_per_s']:,.0f} out tok/s; urgent TTFT p50/p90/p99 "
        f"{ms(classes[URGENT]['ttft_s'], 0)} ms, low {ms(classes[LOW]['ttft_s'], 0)} ms; router: "
        + ("no /metrics" if phase.router is None else
           f"{phase.router['swap_outs_priority']:.0f} swap-outs for priority "
           f"({phase.router['swap_outs_slow_reader']:.0f} for slow readers), {phase.router['swap_ins']:.0f} "
           f"swap-ins, {phase.router['preempted_recompute']:.0f} recompute preemptions, "
           f"{phase.router['rebalances']:.0f} rebalances, {phase.router['rejected']:.0f} rejected"))
    return phase


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def settings(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        if not names or len(set(names)) != len(names) or any(n not in POLICY_FLAGS for n in names):
            raise argparse.ArgumentTypeError(f"{text!r}: give on,off, off,on, on or off")
        return names

    parser.add_argument("--policies", type=settings, default=["on", "off"],
                        help="the settings to run, in this order (default on,off)")
    parser.add_argument("--rate", type=float, default=16.0, help="requests/s (Poisson)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--duration", type=float, help="seconds of arrivals per setting (default 60)")
    length.add_argument("--num-requests", type=int, help="requests per setting, instead of --duration")
    parser.add_argument("--urgent-share", type=float, default=PriorityMix.urgent_share,
                        help="share of requests with priority 0 (the rest: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="every length of the mix times this (0.1 for a CPU run)")
    parser.add_argument("--max-throughput-drop", type=float, default=0.05,
                        help="the throughput the policies may cost, as a share of the 'off' setting's")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--progress-interval", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--out", help="the JSON report (rewritten after every setting)")
    parser.add_argument("--markdown", help="also write the results as a Markdown table (docs/BENCHMARKS.md)")
    server = parser.add_argument_group("the server (`pagedserve serve --role all`, started for each setting)")
    server.add_argument("--model-args", default="", help="its model, engine and router flags, one string")
    server.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to come up")
    server.add_argument("--verbose", action="store_true", help="print every server log line")
    args = parser.parse_args(argv)
    if args.duration is None and args.num_requests is None:
        args.duration = 60.0
    if not 0 <= args.urgent_share <= 1:
        parser.error(f"--urgent-share {args.urgent_share:g} must be between 0 and 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    mix = PriorityMix(urgent_share=args.urgent_share).scaled(args.scale)
    result = {"date": time.strftime("%Y-%m-%d"), "commit": current_commit(), "mix": asdict(mix),
              "scale": args.scale, "seed": args.seed, "rate": args.rate, "duration_s": args.duration,
              "num_requests": args.num_requests, "model_args": args.model_args,
              "goodput_slo": asdict(Slo()), "settings": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        if args.markdown:
            Path(args.markdown).write_text(markdown(result))

    # A SIGTERM (`timeout`, the device machine ending a call) exits through the `finally` of
    # `serving`, which stops the server: it would otherwise outlive this process.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for policies in args.policies:
            model_args = [*shlex.split(args.model_args), *POLICY_FLAGS[policies]]
            with serving(model_args, startup_timeout_s=args.startup_timeout,
                         verbose=args.verbose) as (grpc_address, http_url, metrics_url):
                phase = asyncio.run(run_setting(args, mix, policies, grpc_address, http_url, metrics_url, result))
            result["settings"][policies] = asdict(phase)
            save()
    finally:
        signal.signal(signal.SIGTERM, previous)
    settings = result["settings"]
    if "on" in settings and "off" in settings:
        result["comparison"] = compare(settings["on"]["classes"], settings["off"]["classes"],
                                       args.max_throughput_drop)
    save()
    print("\n" + markdown(result), flush=True)
    if args.out:
        log("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
