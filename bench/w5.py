"""W5, realistic online serving: the mix of bench/w5_workload.py (shared system prompts, some
long documents, lognormal turns and outputs) sent at Poisson arrival times to a running router,
over its gRPC API (`Generate`, streaming) and/or its HTTP API (`/v1/completions`, SSE), at each
of several rates. Judged by goodput, not by mean throughput. Definition: docs/BENCHMARKS.md.

For each (API, rate) phase and each request kind (all, chat, document) it reports TTFT and
TPOT p50/p90/p99, goodput (the share of the phase's requests that completed with TTFT <=
--slo-ttft and TPOT <= --slo-tpot; failed ones count as missing it), completed and failed
counts and output tokens/s; and, per phase, the prefix cache: the worker's hit rate (blocks
found / blocks looked up) and the share of prompt tokens served from the cache, from its
Prometheus counters before and after, next to what a cache holding every system prompt would
serve. TTFT is from sending a request to its first token at the client; TPOT is (last token -
first token) / (tokens - 1). A table goes to stdout, everything (per request too) to --out.

    # against a running `pagedserve serve` (gRPC :50051, HTTP :8000, worker metrics :9091)
    python bench/w5.py --api grpc,http --rates 4,8,12,16 --duration 60 --out w5.json
    # or start one: the H200 run (bench/gpu_w5.sh), and a quick one on a CPU
    python bench/w5.py --serve --model-args "--model llama-3.1-8b --load-format dummy \\
        --max-model-len 16384 --gpu-memory-utilization 0.85" --rates 8,12,16 --out w5.json
    python bench/w5.py --serve --scale 0.05 --rates 2 --num-requests 8 --out w5-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
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
from w5_workload import KINDS, W5Request, W5Spec, cacheable_share, generate, warmup_requests  # noqa: E402

QUANTILES = (0.50, 0.90, 0.99)
APIS = ("grpc", "http")


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


# ---------------------------------------------------------------------------- report maths


@dataclass(frozen=True)
class Slo:
    """The service level a request must meet to count in the goodput, in seconds."""

    ttft_s: float = 0.5
    tpot_s: float = 0.05


@dataclass
class Outcome:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    kind: str
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    send_lag_s: float = 0.0          # how late the client sent it against its arrival time
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    error: str | None = None         # "CODE: message" of a failed request

    @property
    def completed(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def ttft_s(self) -> float | None:
        return self.first_token - self.sent if self.first_token is not None else None

    @property
    def tpot_s(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)

    def meets(self, slo: Slo) -> bool:
        """Completed within both objectives (a one-token answer has no TPOT to miss)."""
        tpot = self.tpot_s
        return self.completed and self.ttft_s <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)

    def record(self) -> dict:
        return {"kind": self.kind, "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
                "output_tokens": self.tokens, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "send_lag_s": self.send_lag_s, "error": self.error}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between the closest ranks (numpy's
    default), so p99 of 100 values is not simply the largest."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Sequence[float]) -> dict | None:
    if not values:
        return None
    return {f"p{round(q * 100)}": percentile(values, q) for q in QUANTILES} | {"mean": statistics.fmean(values)}


def summarize(outcomes: Sequence[Outcome], seconds: float, slo: Slo) -> dict:
    """The figures of a set of requests that ran within `seconds` of wall time."""
    done = [o for o in outcomes if o.completed]
    good = sum(o.meets(slo) for o in outcomes)
    tokens = sum(o.tokens for o in done)
    return {
        "requests": len(outcomes), "completed": len(done), "failed": len(outcomes) - len(done),
        # Completed, but with fewer tokens than asked: with ignore_eos that is a bug to look at.
        "short": sum(o.tokens < o.max_tokens for o in done),
        "failures": dict(Counter(o.error.split(":")[0] for o in outcomes if o.error)),
        "mean_prompt_tokens": statistics.fmean(o.prompt_tokens for o in outcomes) if outcomes else None,
        "mean_output_tokens": statistics.fmean(o.tokens for o in done) if done else None,
        "ttft_s": distribution([o.ttft_s for o in done]),
        "tpot_s": distribution([o.tpot_s for o in done if o.tpot_s is not None]),
        "goodput": good / len(outcomes) if outcomes else None,
        "goodput_requests_per_s": good / seconds if seconds else None,
        "output_tokens_per_s": tokens / seconds if seconds else None,
    }


def by_kind(outcomes: Sequence[Outcome], seconds: float, slo: Slo) -> dict:
    """summarize() over all requests and over each kind (output tokens/s of a kind: its share
    of the phase's throughput)."""
    out = {"all": summarize(outcomes, seconds, slo)}
    for kind in KINDS:
        out[kind] = summarize([o for o in outcomes if o.kind == kind], seconds, slo)
    return out


# ---------------------------------------------------------------------------- prefix cache


@dataclass
class CacheCounters:
    """The worker's prefix-cache counters at one scrape (sums over its series)."""

    queries: float           # prompt KV blocks looked up
    hits: float              # of those, found
    prompt_tokens: float     # prompt tokens of requests that produced a first token
    block_size: int


def parse_counters(text: str) -> CacheCounters | None:
    """The counters from a worker's /metrics text; None if it has none (a router's /metrics)."""
    values = {"pagedserve_worker_prefix_cache_queries_total": 0.0,
              "pagedserve_worker_prefix_cache_hits_total": 0.0, "pagedserve_worker_prompt_tokens_total": 0.0}
    found, block_size = False, 16
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
                found = True
            elif sample.name == "vllm:cache_config_info":
                block_size = int(sample.labels["block_size"])
    if not found:
        return None
    return CacheCounters(values["pagedserve_worker_prefix_cache_queries_total"],
                         values["pagedserve_worker_prefix_cache_hits_total"],
                         values["pagedserve_worker_prompt_tokens_total"], block_size)


def cache_report(before: CacheCounters | None, after: CacheCounters | None,
                 requests: Sequence[W5Request]) -> dict | None:
    """The prefix cache over a phase, from the counters' deltas."""
    if before is None or after is None:
        return None
    queries, hits = after.queries - before.queries, after.hits - before.hits
    prompt_tokens = after.prompt_tokens - before.prompt_tokens
    return {"block_lookups": queries, "block_hits": hits,
            "hit_rate": hits / queries if queries else None,
            "prompt_tokens_from_cache": hits * after.block_size / prompt_tokens if prompt_tokens else None,
            "prompt_tokens_cacheable": cacheable_share(list(requests), after.block_size),
            "block_size": after.block_size}


async def scrape(session: aiohttp.ClientSession, url: str | None) -> CacheCounters | None:
    """The counters at `url` now; None, said in the log, when it fails: the latencies of a
    run are worth keeping without its prefix-cache figures."""
    if not url:
        return None
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status == 200:
                return parse_counters(await response.text())
            problem = f"answered HTTP {response.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        problem = f"failed: {type(error).__name__}: {error}"
    log(f"metrics at {url} {problem}: no prefix-cache figures for this phase")
    return None


# ---------------------------------------------------------------------------- clients


class GrpcClient:
    """Generate over the router's public gRPC API, token-id prompts."""

    name = "grpc"

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float):
        self.stub = generation_pb2_grpc.GenerationStub(channel)
        self.timeout_s = timeout_s

    def payload(self, request: W5Request) -> pb.GenerateRequest:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=request.prompt), params=pb.SamplingParameters(
            temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True))

    async def send(self, payload: pb.GenerateRequest, outcome: Outcome) -> None:
        try:
            async for response in self.stub.Generate(payload, timeout=self.timeout_s):
                # The first message may carry only usage (admitted): not a token.
                if got := sum(len(c.token_ids) for c in response.choices):
                    now = time.perf_counter()
                    if outcome.first_token is None:
                        outcome.first_token = now
                    outcome.last_token = now
                    outcome.tokens += got
        except grpc.aio.AioRpcError as error:
            outcome.error = f"{error.code().name}: {error.details()}"


class HttpClient:
    """`/v1/completions` with `stream: true` (SSE) on the router's OpenAI-compatible HTTP API,
    token-id prompts (OpenAI's list-of-ints `prompt`).

    A model served on token ids only (dummy weights of a preset) streams no text, and a chunk
    is only sent for a choice with text, an end or logprobs: for such a model the requests ask
    for `logprobs: 0` (the sampled token's logprob, no alternatives), which puts every token in
    a chunk, and the tokens are counted from them. With a tokenizer, no logprobs are asked for:
    token times are those of the chunks with text, the count is the final usage's."""

    name = "http"

    def __init__(self, session: aiohttp.ClientSession, url: str, *, logprobs: bool, timeout_s: float):
        self.session, self.url, self.logprobs = session, url, logprobs
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    @staticmethod
    async def needs_logprobs(session: aiohttp.ClientSession, url: str) -> bool:
        """Whether the served model has no tokenizer (its /tokenize refuses text)."""
        async with session.post(f"{url}/tokenize", json={"prompt": "a"}) as response:
            return response.status != 200

    def payload(self, request: W5Request) -> bytes:
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.logprobs:
            body["logprobs"] = 0
        return json.dumps(body).encode()

    async def send(self, payload: bytes, outcome: Outcome) -> None:
        counted = 0
        try:
            async with self.session.post(f"{self.url}/v1/completions", data=payload, timeout=self.timeout,
                                         headers={"Content-Type": "application/json"}) as response:
                if response.status != 200:
                    outcome.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome.error = f"STREAM: {chunk['error'].get('message')}"
                        return
                    if chunk.get("usage"):
                        outcome.tokens = chunk["usage"]["completion_tokens"]
                    got = [c for c in chunk.get("choices", []) if c.get("text") or c.get("logprobs")]
                    if got:
                        now = time.perf_counter()
                        if outcome.first_token is None:
                            outcome.first_token = now
                        outcome.last_token = now
                        counted += sum(len((c.get("logprobs") or {}).get("token_logprobs", [])) for c in got)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            outcome.error = f"{type(error).__name__}: {error}"
            return
        if self.logprobs and counted != outcome.tokens:
            outcome.error = f"COUNT: {counted} tokens streamed, usage says {outcome.tokens}"


# ---------------------------------------------------------------------------- phases


async def run_phase(client: GrpcClient | HttpClient, requests: Sequence[W5Request]) -> tuple[list[Outcome], float]:
    """Sends each request at its arrival time; the outcomes and the phase's wall time (from
    its start to the last request's end)."""
    payloads = [client.payload(r) for r in requests]     # built before the clock starts
    outcomes = [Outcome(r.kind, len(r.prompt), r.max_tokens) for r in requests]
    tasks = []
    start = time.perf_counter()
    for request, payload, outcome in zip(requests, payloads, outcomes):
        due = start + request.arrival_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        outcome.sent = time.perf_counter()
        outcome.send_lag_s = outcome.sent - due
        tasks.append(asyncio.create_task(client.send(payload, outcome)))
    await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


HEADER = (f"{'api':<5} {'rate':>5}  {'kind':<9}{'reqs':>5}{'done':>6}{'fail':>5}{'prompt':>8}  "
          f"{'TTFT p50/p90/p99 ms':>22}  {'TPOT p50/p90/p99 ms':>20}  {'goodput':>7}{'out tok/s':>10}")


def ms(dist: dict | None, digits: int) -> str:
    """A distribution's p50 / p90 / p99 in milliseconds."""
    return "–" if dist is None else " / ".join(f"{dist[k] * 1e3:.{digits}f}" for k in ("p50", "p90", "p99"))


def phase_line(api: str, rate: float, kinds: dict) -> list[str]:
    """A phase's rows of the table on stdout (HEADER's columns), one per kind that ran."""
    lines = []
    for kind, s in kinds.items():
        if not s["requests"]:
            continue
        head = f"{api:<5} {rate:>5g}" if kind == "all" else " " * 11
        lines.append(f"{head}  {kind:<9}{s['requests']:>5}{s['completed']:>6}{s['failed']:>5}"
                     f"{s['mean_prompt_tokens']:>8.0f}  {ms(s['ttft_s'], 0):>22}  {ms(s['tpot_s'], 1):>20}"
                     f"  {s['goodput']:>7.1%}{s['output_tokens_per_s']:>10,.0f}")
    return lines


def cache_line(cache: dict | None) -> str:
    if cache is None:
        return "            prefix cache: no worker metrics (see the log; without --serve, give --metrics-url)"
    hit = "–" if cache["hit_rate"] is None else f"{cache['hit_rate']:.1%}"
    share = "–" if cache["prompt_tokens_from_cache"] is None else f"{cache['prompt_tokens_from_cache']:.1%}"
    return (f"            prefix cache: {hit} of block lookups hit; {share} of prompt tokens from the "
            f"cache (every system prompt cached: {cache['prompt_tokens_cacheable']:.1%})")


def markdown(result: dict) -> str:
    """The run as a Markdown table, one row per phase and kind, for docs/BENCHMARKS.md."""
    slo = result["slo"]
    per_phase = (f"{result['duration_s']:g} s of arrivals" if result["duration_s"]
                 else f"{result['num_requests']} requests")
    lines = [(f"W5 on {result.get('model', '?')}, scale {result['scale']:g}, seed {result['seed']}, {per_phase} "
              f"per phase; goodput: TTFT ≤ {slo['ttft_s'] * 1e3:g} ms and TPOT ≤ {slo['tpot_s'] * 1e3:g} ms."),
             "",
             ("| API | rate (req/s) | kind | requests (failed) | mean prompt | TTFT p50 / p90 / p99 ms "
              "| TPOT p50 / p90 / p99 ms | goodput | out tok/s | prefix cache: hits / from cache (cacheable) |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for phase in result.get("phases", []):
        cache = phase["prefix_cache"]
        for kind, s in phase["kinds"].items():
            if not s["requests"]:
                continue
            cell = "–"
            if kind == "all" and cache and cache["hit_rate"] is not None:
                cell = (f"{cache['hit_rate']:.0%} / {cache['prompt_tokens_from_cache']:.0%} "
                        f"({cache['prompt_tokens_cacheable']:.0%})")
            lines.append(f"| {phase['api']} | {phase['rate']:g} | {kind} | {s['requests']} ({s['failed']}) "
                         f"| {s['mean_prompt_tokens']:,.0f} | {ms(s['ttft_s'], 0)} | {ms(s['tpot_s'], 1)} "
                         f"| {s['goodput']:.1%} | {s['output_tokens_per_s']:,.0f} | {cell} |")
    return "\n".join(lines) + "\n"


async def run(args, spec: W5Spec, grpc_address: str, http_url: str, metrics_url: str | None,
              result: dict, save: Callable[[], None]) -> None:
    """Runs the warm-up, then every (rate, API) phase, adding each to `result["phases"]` and
    calling `save` after it (a run cut short keeps the phases it finished)."""
    slo = Slo(args.slo_ttft, args.slo_tpot)
    options = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.max_send_message_length", 64 * 2**20)]
    # No connection limit: aiohttp's default of 100 would queue requests in the client.
    connector = aiohttp.TCPConnector(limit=0)
    async with grpc.aio.insecure_channel(grpc_address, options=options) as channel, \
            aiohttp.ClientSession(connector=connector) as session:
        info = await generation_pb2_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)
        if spec.longest_request() > info.max_model_len:
            raise SystemExit(f"the longest W5 request ({spec.longest_request()} tokens) exceeds the served "
                             f"max_model_len {info.max_model_len}: raise the server's --max-model-len or "
                             f"lower --scale")
        clients = {}
        if "grpc" in args.api:
            clients["grpc"] = GrpcClient(channel, args.request_timeout)
        if "http" in args.api:
            logprobs = await HttpClient.needs_logprobs(session, http_url)
            clients["http"] = HttpClient(session, http_url, logprobs=logprobs, timeout_s=args.request_timeout)
        result |= {"model": info.model_names[0], "vocab_size": info.vocab_size, "max_model_len": info.max_model_len,
                   "http_logprobs": clients["http"].logprobs if "http" in clients else None, "phases": []}
        for client in clients.values():
            outcomes, seconds = await run_phase(client, warmup_requests(spec, seed=args.seed,
                                                                         vocab_size=info.vocab_size))
            if failed := [o.error for o in outcomes if not o.completed]:
                raise SystemExit(f"{len(failed)} warm-up requests over {client.name} failed, first: {failed[0]}")
            log(f"warm-up over {client.name}: {len(outcomes)} requests in {seconds:.1f} s")
        print("\n" + HEADER, flush=True)
        for rate in args.rates:
            for client in clients.values():
                requests = generate(spec, rate, seed=args.seed, vocab_size=info.vocab_size,
                                    duration_s=args.duration, num_requests=args.num_requests, salt=client.name)
                before = await scrape(session, metrics_url)
                outcomes, seconds = await run_phase(client, requests)
                await asyncio.sleep(0.3)    # the worker's stats snapshot follows its last step
                after = await scrape(session, metrics_url)
                kinds = by_kind(outcomes, seconds, slo)
                lags = [o.send_lag_s for o in outcomes]
                phase = {"api": client.name, "rate": rate, "seconds": seconds, "kinds": kinds,
                         "prefix_cache": cache_report(before, after, requests),
                         "send_lag_s": {"p99": percentile(lags, 0.99), "max": max(lags)} if lags else None,
                         "per_request": [o.record() for o in outcomes]}
                result["phases"].append(phase)
                print("\n".join([*phase_line(client.name, rate, kinds), cache_line(phase["prefix_cache"])]),
                      flush=True)
                save()


# ---------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(model_args: list[str], *, startup_timeout_s: float, verbose: bool):
    """`pagedserve serve --role all` on loopback with `model_args`: yields (gRPC address, HTTP
    URL, worker metrics URL) once it serves; stops it after."""
    grpc_port, http_port, worker_port, metrics_port = (free_port() for _ in range(4))
    command = [sys.executable, "-m", "launcher.cli", "serve", "--role", "all", "--host", "127.0.0.1",
               "--port", str(grpc_port), "--http-port", str(http_port), "--worker-port", str(worker_port),
               "--metrics-port", str(metrics_port), *model_args]
    log("starting", shlex.join(command))
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    server = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": path},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()

    def drain() -> None:            # keep reading, or the server blocks on its logs
        for line in server.stdout:
            if verbose or "WARNING" in line or "ERROR" in line or "Traceback" in line:
                print("  server:", line.rstrip(), flush=True)
            if line.startswith("pagedserve is serving"):
                ready.set()
        ready.set()                 # it exited: stop waiting
    threading.Thread(target=drain, daemon=True).start()
    try:
        if not ready.wait(timeout=startup_timeout_s) or server.poll() is not None:
            raise SystemExit(f"pagedserve serve did not come up within {startup_timeout_s:g} s "
                             f"(exit code {server.poll()}); run with --verbose to see its log")
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# ---------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",") if x]

    def apis(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        if not names or any(n not in APIS for n in names):
            raise argparse.ArgumentTypeError(f"{text!r}: give grpc, http or grpc,http")
        return names

    parser.add_argument("--api", type=apis, default=["grpc"], help="grpc, http, or both: grpc,http")
    parser.add_argument("--rates", type=floats, default=[4.0, 8.0, 12.0, 16.0], help="requests/s, comma-separated")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--duration", type=float, help="seconds of arrivals per phase (default 60)")
    length.add_argument("--num-requests", type=int, help="requests per phase, instead of --duration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="every length of the mix times this (0.05 for a CPU smoke run)")
    parser.add_argument("--slo-ttft", type=float, default=0.5, help="goodput's TTFT objective, seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.05, help="goodput's TPOT objective, seconds")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--out", help="the JSON report (rewritten after every phase)")
    parser.add_argument("--markdown", help="also write the results as a Markdown table (docs/BENCHMARKS.md)")
    target = parser.add_argument_group("the server")
    target.add_argument("--serve", action="store_true", help="start `pagedserve serve --role all` with "
                        "--model-args on free loopback ports, and stop it at the end")
    target.add_argument("--model-args", default="", help="--serve: its model and engine flags, one string")
    target.add_argument("--startup-timeout", type=float, default=600.0, help="--serve: seconds to come up")
    target.add_argument("--verbose", action="store_true", help="--serve: print every server log line")
    target.add_argument("--grpc-address", default="127.0.0.1:50051", help="without --serve: the router's gRPC")
    target.add_argument("--http-url", default="http://127.0.0.1:8000", help="without --serve: its HTTP API")
    target.add_argument("--metrics-url", default="http://127.0.0.1:9091/metrics",
                        help="without --serve: a worker's /metrics (prefix-cache counters; '' for none)")
    args = parser.parse_args(argv)
    if args.duration is None and args.num_requests is None:
        args.duration = 60.0
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    spec = W5Spec().scaled(args.scale)
    result = {"date": time.strftime("%Y-%m-%d"), "commit": current_commit(), "workload": asdict(spec),
              "scale": args.scale, "seed": args.seed, "slo": asdict(Slo(args.slo_ttft, args.slo_tpot)),
              "duration_s": args.duration, "num_requests": args.num_requests,
              "server": args.model_args if args.serve else args.grpc_address}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        if args.markdown:
            Path(args.markdown).write_text(markdown(result))

    if args.serve:
        # A SIGTERM (`timeout`, the device machine ending a call) exits through the `finally`
        # that stops the server, which would otherwise outlive this process.
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            with serving(shlex.split(args.model_args), startup_timeout_s=args.startup_timeout,
                         verbose=args.verbose) as (grpc_address, http_url, metrics_url):
                asyncio.run(run(args, spec, grpc_address, http_url, metrics_url, result, save))
        finally:
            signal.signal(signal.SIGTERM, previous)
    else:
        asyncio.run(run(args, spec, args.grpc_address, args.http_url, args.metrics_url or None, result, save))
    save()
    if args.out:
        log("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
