"""FP8 KV cache against the model's dtype, on the Llama-3.1-8B shape (dummy bf16 weights), one GPU:
the pool's capacity in tokens at the same memory setting, and decode time per output token
(TPOT) over long contexts, where attention reads the most K/V. Same run, same settings; only
--kv-cache-dtype differs. Definitions: docs/BENCHMARKS.md.

    python bench/kv_cache_bench.py --out kv.json [--contexts 8192 32768] [--batch 1 8]
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common.sampling_params import SamplingParams  # noqa: E402
from report import current_commit  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402

DECODE_TOKENS = 64


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def tpot(engine: LLMEngine, context: int, batch: int) -> dict:
    """`batch` requests of `context` prompt tokens, then DECODE_TOKENS each: seconds per decode
    step once every prompt is in (the step loop's own timing, host included)."""
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"c{context}-{i}", [(1000 + 7 * i + t) % 120000 for t in range(context)], params)
    seqs = [s for group in engine.requests.values() for s in group]
    while any(s.num_computed < s.prompt_len for s in seqs):
        engine.step()
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), engine.num_steps
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    steps = engine.num_steps - steps
    return {"context": context, "batch": batch, "decode_steps": steps, "tpot_ms": 1e3 * seconds / max(steps, 1)}


def run(kv_cache_dtype: str, args) -> dict:
    engine = LLMEngine(EngineConfig(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16",
                                    kv_cache_dtype=kv_cache_dtype, max_model_len=max(args.contexts) + 2 * DECODE_TOKENS,
                                    max_num_seqs=64, max_num_batched_tokens=8192,
                                    gpu_memory_utilization=0.85, enable_prefix_caching=False))
    out = {"kv_cache_dtype": kv_cache_dtype, "kv_blocks": engine.blocks.num_blocks,
           "kv_tokens": engine.blocks.num_blocks * engine.config.block_size,
           "kv_bytes": engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()}
    log(kv_cache_dtype, json.dumps(out))
    tpot(engine, 1024, 1)      # warm-up: compile every kernel variant a step here takes
    out["tpot"] = []
    for context in args.contexts:
        for batch in args.batch:
            if batch * (context + DECODE_TOKENS) > out["kv_tokens"]:
                continue
            row = tpot(engine, context, batch)
            log(kv_cache_dtype, json.dumps(row))
            out["tpot"].append(row)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": current_commit(), "model": "llama-3.1-8b", "decode_tokens": DECODE_TOKENS,
              "runs": [run(kv, args) for kv in ("auto", "fp8")]}
    auto, fp8 = result["runs"]
    result["capacity_ratio"] = fp8["kv_tokens"] / auto["kv_tokens"]
    result["tpot_ratio"] = {f"{a['context']}x{a['batch']}": f["tpot_ms"] / a["tpot_ms"]
                            for a, f in zip(auto["tpot"], fp8["tpot"])}
    log("capacity ratio", round(result["capacity_ratio"], 3), "TPOT fp8/auto", json.dumps(result["tpot_ratio"]))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
