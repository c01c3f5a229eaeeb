"""GPU benchmarks W1 (offline throughput), W2 (batch-1 decode) and W4 (KV memory) on the
Llama-3.1-8B shape with dummy bf16 weights, and the Hugging Face transformers peer in the
same run (`generate` for W2, `generate_batch` for W1). Definitions: docs/BENCHMARKS.md.

    python bench/gpu_bench.py --out result.json [--peer-w1-requests 64] [--skip-peer]
    python bench/gpu_bench.py --out tp2.json --tensor-parallel-size 2 --skip-peer   # two GPUs
    python bench/gpu_bench.py --out 70b.json --model llama-3-70b --tensor-parallel-size 4 --skip-peer
"""

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common.sampling_params import SamplingParams  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402
from worker.models.loader import PRESETS  # noqa: E402
from decode_profile import kernel_summary, profile_steps  # noqa: E402
from report import current_commit  # noqa: E402
from workloads import w1_requests  # noqa: E402

MODEL = "llama-3.1-8b"


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def copy_bandwidth() -> float:
    """Device-to-device copy, read + write bytes per second (the roofline's denominator)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * reps / (time.perf_counter() - start)


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    first_token = None
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    generated = 0
    steps0 = engine.num_steps
    while engine.has_unfinished():
        outs = engine.step()
        if outs and first_token is None:
            first_token = time.perf_counter() - start
        generated += sum(len(o.new_token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    return {"requests": len(prompts), "output_tokens": generated, "seconds": elapsed,
            "output_tokens_per_s": generated / elapsed, "requests_per_s": len(prompts) / elapsed,
            "steps": engine.num_steps - steps0, "first_token_s": first_token}


def profile_w1(engine: LLMEngine) -> dict:
    """W1 once more under the profiler: each kernel's time per engine step over the whole run
    (prefill and decode steps together), printed as ms over the run, longest first."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run = run_engine(engine, w1_requests(), 256)
        torch.cuda.synchronize()
    summary = kernel_summary(prof, run["steps"], run["seconds"])
    log(f"W1 profiled: {run['output_tokens_per_s']:.0f} out tok/s under the profiler, {run['steps']} steps, "
        f"GPU busy {summary['gpu_busy_ms_per_step'] * run['steps']:.0f} of {run['seconds'] * 1e3:.0f} ms")
    for row in summary["kernels"][:30]:
        print(f"{row['us_per_step'] * run['steps'] / 1e3:9.1f} ms {row['launches_per_step'] * run['steps']:8.0f}x  "
              f"{row['name']}", flush=True)
    return {"run": run, **summary}


def bench_engine(args) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16",
                                    max_model_len=4096, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    gpu_memory_utilization=0.85, enable_prefix_caching=False,
                                    tensor_parallel_size=args.tensor_parallel_size,
                                    quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    out = {"weight_bytes": weight_bytes, "kv_blocks": engine.blocks.num_blocks}
    # Warm up on the W1 shapes themselves (every prefill chunk and decode batch size), so
    # that whichever configuration runs first does not pay for compiling kernel variants.
    run_engine(engine, w1_requests(), 32)
    # Each workload with asynchronous scheduling (the default) and without, same engine.
    for suffix, async_scheduling in (("_sync", False), ("", True)) if args.compare_sync else (("", True),):
        engine.config.async_scheduling = async_scheduling
        w2 = run_engine(engine, [list(range(1000, 1128))], 256)
        w2["decode_tokens_per_s"] = 255 / (w2["seconds"] - w2["first_token_s"])
        out["w2" + suffix] = w2
        log(f"W2 engine{suffix}", json.dumps(w2))
        w1 = run_engine(engine, w1_requests(), 256)
        out["w1" + suffix] = w1
        log(f"W1 engine{suffix}", json.dumps(w1))
    if args.profile:
        out["w2_profile"] = profile_steps(engine, steps=24, trace_path=None)
    if args.profile_w1:
        out["w1_profile"] = profile_w1(engine)

    # W4: the paged pool's KV bytes for 256 requests of 32..2048 tokens, at the moment all are
    # resident, against a contiguous cache padded to the longest request.
    rng = random.Random(1)
    lengths = [rng.randint(32, 2048) for _ in range(256)]
    block_bytes = engine.runner.block_bytes
    # Long enough generations that no request finishes (and frees its blocks) before every
    # prompt is in the pool; then compare with a padded cache for the tokens held right then.
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    for i, n in enumerate(lengths):
        engine.add_request(f"w4-{i}", [rng.randrange(100, 128000) for _ in range(n - 1)], params)
    seqs = [s for group in engine.requests.values() for s in group]
    while any(s.num_computed < s.prompt_len for s in seqs):
        engine.step()
    held = engine.blocks.num_blocks - engine.blocks.num_free      # all 256 resident now
    lengths = [s.num_computed for s in seqs]
    for request_id in list(engine.requests):
        engine.abort(request_id)
    per_token = block_bytes // engine.config.block_size
    padded = len(lengths) * max(lengths) * per_token
    out["w4"] = {"requests": 256, "tokens": sum(lengths), "paged_bytes": held * block_bytes,
                 "padded_to_longest_bytes": padded, "ratio": padded / (held * block_bytes),
                 "padded_to_max_model_len_bytes": len(lengths) * engine.max_model_len * per_token,
                 "ratio_vs_max_model_len": len(lengths) * engine.max_model_len * per_token / (held * block_bytes)}
    log("W4", json.dumps(out["w4"]))
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def hf_model(model: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    p = PRESETS[model]
    config = LlamaConfig(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                         intermediate_size=p["intermediate_size"], num_hidden_layers=p["num_layers"],
                         num_attention_heads=p["num_heads"], num_key_value_heads=p["num_kv_heads"],
                         rope_theta=p["rope_theta"], max_position_embeddings=4096,
                         rope_scaling=p.get("rope_scaling"), attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    return model


def bench_peer(args) -> dict:
    from transformers import GenerationConfig
    model = hf_model(args.model)
    out = {}
    ids = torch.arange(1000, 1128, device="cuda")[None]
    model.generate(ids, max_new_tokens=8, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    out["w2"] = {"output_tokens_per_s": 256 / elapsed, "seconds": elapsed, "how": "generate, dynamic cache"}
    log("W2 transformers", json.dumps(out["w2"]))
    if args.peer_w1_requests:
        prompts = w1_requests()[:args.peer_w1_requests]
        config = GenerationConfig(max_new_tokens=256, min_new_tokens=256, do_sample=False, eos_token_id=-1)
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=config)
        elapsed = time.perf_counter() - start
        generated = sum(len(r.generated_tokens) for r in results.values())
        out["w1_subset"] = {"requests": len(prompts), "output_tokens": generated, "seconds": elapsed,
                            "output_tokens_per_s": generated / elapsed, "how": "generate_batch, defaults"}
        log("W1 transformers", json.dumps(out["w1_subset"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="profile W2 decode steps (bench/decode_profile.py's kernel table)")
    parser.add_argument("--profile-w1", action="store_true",
                        help="profile one more W1 run: each kernel's time over it")
    parser.add_argument("--compare-sync", action="store_true",
                        help="also run W1 and W2 with asynchronous scheduling off")
    parser.add_argument("--peer-w1-requests", type=int, default=64,
                        help="W1 requests given to the peer (all 512 take it over 4 minutes)")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--model", default=MODEL, choices=sorted(PRESETS),
                        help="the dummy model's shape (the peer needs one GPU to hold it)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs of one worker (weight_bytes and the W2 roofline are per GPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--quantization", default="none", choices=("none", "fp8", "gptq", "gguf"),
                        help="the engine's --quantization (the dummy bf16 weights quantized on load; "
                             "gptq: rounded to 4 bits in groups of 128; gguf: in GGUF Q4_K's form, groups of 32)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="the engine's --kv-cache-dtype")
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
              "model": args.model, "tensor_parallel_size": args.tensor_parallel_size,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "torch": torch.__version__, "commit": current_commit(),
              "copy_bytes_per_s": copy_bandwidth()}
    log(f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    result["engine"] = bench_engine(args)
    roofline = result["copy_bytes_per_s"] / result["engine"]["weight_bytes"]
    result["w2_roofline_tokens_per_s"] = roofline
    result["w2_fraction_of_roofline"] = result["engine"]["w2"]["decode_tokens_per_s"] / roofline
    log(f"W2 roofline {roofline:.0f} tok/s; engine decode at {100 * result['w2_fraction_of_roofline']:.0f}%")
    Path(args.out).write_text(json.dumps(result, indent=2))
    if not args.skip_peer:
        result["transformers"] = bench_peer(args)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
