"""Serving overhead on the CPU default: the same concurrent workload through the engine alone,
through the router's gRPC API, and through its OpenAI-compatible HTTP API (SSE streaming).

Reports requests/s, output tokens/s and time to first token (p50/p99) for each path. The
router and one worker run as real processes on loopback, as `pagedserve serve` runs them.

    python bench/serving_bench.py [--requests 32] [--max-tokens 64] [--out result.json]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from cpu_bench import make_prompts  # noqa: E402
from report import current_commit  # noqa: E402


def summary(ttfts: list[float], tokens: int, seconds: float, requests: int) -> dict:
    ttfts = sorted(ttfts)
    return {"requests_per_s": requests / seconds, "output_tokens_per_s": tokens / seconds, "seconds": seconds,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def engine_alone(prompts: list[str], max_tokens: int) -> dict:
    from common.sampling_params import SamplingParams
    from worker.config import EngineConfig
    from worker.engine import LLMEngine
    from worker.models.loader import load_tokenizer
    # Prefix caching off on every path: each path runs the same prompts, and a cache warmed by
    # the previous path would make the next look faster.
    engine = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", enable_prefix_caching=False))
    tokenizer = load_tokenizer(engine.source)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), tokenizer.encode(p), params)
    first, tokens = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            tokens += len(out.new_token_ids)
    return summary(list(first.values()), tokens, time.perf_counter() - start, len(prompts))


async def through_grpc(address: str, prompts: list[str], max_tokens: int) -> dict:
    import grpc

    from common.pb import generation_pb2 as pb
    from common.pb import generation_pb2_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def one(prompt: str) -> tuple[float, int]:
            request = pb.GenerateRequest(text=prompt, params=pb.SamplingParameters(
                temperature=0, max_tokens=max_tokens, ignore_eos=True))
            ttft, tokens = None, 0
            async for response in stub.Generate(request):
                got = sum(len(c.token_ids) for c in response.choices)
                if got and ttft is None:
                    ttft = time.perf_counter() - start
                tokens += got
            return ttft, tokens
        results = await asyncio.gather(*(one(p) for p in prompts))
    return summary([r[0] for r in results], sum(r[1] for r in results), time.perf_counter() - start, len(prompts))


async def through_http(url: str, prompts: list[str], max_tokens: int) -> dict:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()

        async def one(prompt: str) -> tuple[float, int]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            ttft, tokens = None, 0
            async with session.post(f"{url}/v1/completions", json=body) as response:
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                        ttft = time.perf_counter() - start
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return ttft, tokens
        results = await asyncio.gather(*(one(p) for p in prompts))
    return summary([r[0] for r in results], sum(r[1] for r in results), time.perf_counter() - start, len(prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    prompts = make_prompts(args.requests, seed=1)
    result = {"date": time.strftime("%Y-%m-%d"), "requests": args.requests, "max_tokens": args.max_tokens,
              "commit": current_commit()}
    result["engine"] = engine_alone(prompts, args.max_tokens)
    print("engine alone", json.dumps(result["engine"]), flush=True)

    grpc_port, http_port = 50151, 8151
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "--role", "all", "--host", "127.0.0.1",
                               "--port", str(grpc_port), "--http-port", str(http_port), "--worker-port", "50152",
                               "--metrics-port", "0", "--no-enable-prefix-caching"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    serving = threading.Event()

    def drain() -> None:                        # keep reading, or the server blocks on its logs
        for line in server.stdout:
            if line.startswith("pagedserve is serving"):
                serving.set()
    threading.Thread(target=drain, daemon=True).start()
    try:
        if not serving.wait(timeout=180):
            raise SystemExit("pagedserve serve did not come up within 180 s")
        address, url = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
        asyncio.run(through_grpc(address, prompts[:4], 4))        # warm up both paths
        asyncio.run(through_http(url, prompts[:4], 4))
        result["grpc"] = asyncio.run(through_grpc(address, prompts, args.max_tokens))
        print("router gRPC ", json.dumps(result["grpc"]), flush=True)
        result["http"] = asyncio.run(through_http(url, prompts, args.max_tokens))
        print("router HTTP ", json.dumps(result["http"]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
