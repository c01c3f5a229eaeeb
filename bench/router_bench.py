"""Benchmarks through the router's gRPC API: W1 (offline throughput) and W3 (online serving,
Poisson arrivals), against `pagedserve serve --role all` started as a real process.

W1: every request sent at once, token-id prompts of 32..1024 tokens, 256 greedy tokens each
(the engine-level W1 of gpu_bench.py, so the two figures compare). W3: for each rate, requests
arrive as a Poisson process for `--duration` seconds; input and output lengths are lognormal
with means 202 and 179 tokens (sigma 0.8, clipped to [4, 2048] and [8, 1024]). TTFT is send
to first token; TPOT is (last token - first token) / (tokens - 1) per request. Each phase also
reports `kernels_compiled`: the Triton kernel variants the server compiled during it (it runs
on a fresh Triton cache), which should be 0 once the warm-up has run, since a compile inside
the step loop stalls every running request for hundreds of milliseconds.

    python bench/router_bench.py --out router.json                 # the 8B shape, dummy bf16
    python bench/router_bench.py --model default --dtype float32 --rates 1 --duration 10 \\
        --w1-requests 16 --w1-max-tokens 16 --out cpu.json        # a quick run on a CPU
"""

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import grpc  # noqa: E402

from common.pb import generation_pb2 as pb  # noqa: E402
from common.pb import generation_pb2_grpc  # noqa: E402
from report import current_commit  # noqa: E402
from workloads import w1_requests  # noqa: E402

INPUT_MEAN, OUTPUT_MEAN, SIGMA = 202, 179, 0.8


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


@dataclass
class Timing:
    """One request as the client saw it."""

    sent: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def percentiles(values: list[float]) -> dict:
    values = sorted(values)
    return {"p50": statistics.median(values), "p99": values[min(len(values) - 1, int(0.99 * len(values)))],
            "mean": statistics.fmean(values)}


def lognormal(rng: random.Random, mean: float, low: int, high: int) -> int:
    """A lognormal draw with the given mean (sigma SIGMA), rounded and clipped."""
    mu = math.log(mean) - SIGMA**2 / 2
    return min(high, max(low, round(rng.lognormvariate(mu, SIGMA))))


async def generate(stub, prompt: list[int], max_tokens: int, timing: Timing) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=pb.SamplingParameters(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    async for response in stub.Generate(request):
        now = time.perf_counter()
        timing.token_times += [now] * sum(len(c.token_ids) for c in response.choices)


async def w1(stub, count: int, max_tokens: int, vocab: int) -> dict:
    prompts = w1_requests(count, vocab_size=vocab)    # gpu_bench's W1 prompts
    start = time.perf_counter()
    timings = [Timing(start) for _ in prompts]
    await asyncio.gather(*(generate(stub, p, max_tokens, t) for p, t in zip(prompts, timings)))
    elapsed = time.perf_counter() - start
    tokens = sum(len(t.token_times) for t in timings)
    return {"requests": count, "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed, "requests_per_s": count / elapsed}


async def w3(stub, rate: float, duration_s: float, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    tasks, timings, inputs, outputs = [], [], [], []
    start = time.perf_counter()
    arrival = 0.0
    while True:
        arrival += rng.expovariate(rate)
        if arrival > duration_s:
            break
        n_in, n_out = lognormal(rng, INPUT_MEAN, 4, 2048), lognormal(rng, OUTPUT_MEAN, 8, 1024)
        prompt = [rng.randrange(100, min(128000, vocab)) for _ in range(n_in)]
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        timing = Timing(time.perf_counter())
        timings.append(timing)
        inputs.append(n_in)
        outputs.append(n_out)
        tasks.append(asyncio.create_task(generate(stub, prompt, n_out, timing)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    tokens = sum(len(t.token_times) for t in timings)
    return {"rate": rate, "requests": len(timings), "seconds": elapsed,
            "mean_input_tokens": statistics.fmean(inputs), "mean_output_tokens": statistics.fmean(outputs),
            "output_tokens_per_s": tokens / elapsed,
            "ttft_s": percentiles([t.ttft for t in timings]),
            "tpot_s": percentiles([t.tpot for t in timings if t.tpot is not None])}


def cache_entries(cache: Path) -> set[Path]:
    """The server's Triton cache: one directory per compiled kernel variant."""
    return set(cache.iterdir())


def kernel_name(entry: Path) -> str:
    names = [f.stem for f in entry.glob("*.json") if not f.name.startswith("__grp__")]
    return names[0] if names else entry.name


def start_server(args) -> subprocess.Popen:
    command = [sys.executable, "-m", "launcher.cli", "serve", "--role", "all", "--host", "127.0.0.1",
               "--port", str(args.port), "--worker-port", str(args.port + 1), "--metrics-port", "0",
               "--model", args.model, "--dtype", args.dtype, "--no-enable-prefix-caching",
               "--max-concurrent-requests", "4096", "--max-queue-len", "4096", "--max-queue-wait", "600",
               *(["--load-format", args.load_format] if args.load_format else []), *args.engine_args]
    log("starting", " ".join(command))
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TRITON_CACHE_DIR": str(args.triton_cache)}
    server = subprocess.Popen(command, cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    serving = threading.Event()

    def drain() -> None:            # keep reading, or the server blocks on its logs
        for line in server.stdout:
            if args.verbose or "WARNING" in line or "ERROR" in line or "serving" in line:
                print("  server:", line.rstrip(), flush=True)
            if line.startswith("pagedserve is serving"):
                serving.set()
    threading.Thread(target=drain, daemon=True).start()
    if not serving.wait(timeout=args.startup_timeout):
        server.kill()
        raise SystemExit(f"pagedserve serve did not come up within {args.startup_timeout} s")
    return server


async def run(args) -> dict:
    result = {}
    options = [("grpc.max_receive_message_length", 64 * 2**20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{args.port}", options=options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        vocab = (await stub.ModelInfo(pb.ModelInfoRequest())).vocab_size
        await w1(stub, 32, 8, vocab)        # warm up every kernel variant

        async def phase(workload):
            before = cache_entries(args.triton_cache)
            outcome = await workload
            new = cache_entries(args.triton_cache) - before
            outcome["kernels_compiled"] = sorted(kernel_name(entry) for entry in new)
            return outcome

        if args.w1_requests:
            result["w1"] = await phase(w1(stub, args.w1_requests, args.w1_max_tokens, vocab))
            log("W1 router", json.dumps(result["w1"]))
        result["w3"] = []
        for rate in args.rates:
            result["w3"].append(await phase(w3(stub, rate, args.duration, vocab, seed=round(rate * 1000))))
            log("W3", json.dumps(result["w3"][-1]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy", help="'' for the model's own format")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rates", type=float, nargs="*", default=[8, 16, 32])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--w1-requests", type=int, default=512)
    parser.add_argument("--w1-max-tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=50251)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--verbose", action="store_true", help="print every server log line")
    parser.add_argument("engine_args", nargs="*", help="after --: more `pagedserve serve` flags")
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "dtype": args.dtype,
              "commit": current_commit()}
    with tempfile.TemporaryDirectory(prefix="pagedserve-triton-") as cache:
        args.triton_cache = Path(cache)
        server = start_server(args)
        try:
            result.update(asyncio.run(run(args)))
        finally:
            server.terminate()
            server.wait(timeout=60)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
