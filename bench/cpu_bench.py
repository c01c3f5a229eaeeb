"""CPU benchmark of the embedded default: 32 concurrent requests x 128 new tokens, greedy,
the engine against Hugging Face transformers' batched `generate` on the same machine and run,
both in the same dtype.

    python bench/cpu_bench.py [--dtype float32|bfloat16] [--quantization none|int8] [--requests 32]
                              [--new-tokens 128] [--out r.json]

`--quantization int8` quantizes the engine's decoder linears on load (the peer stays in
`--dtype`): what the engine offers on a CPU, against what transformers does by default.
"""

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from report import current_commit  # noqa: E402

WORDS = ("river mountain quietly engine bright harvest lantern story number garden window "
         "travel ancient signal winter market letter orange science careful machine ocean "
         "history forest silver answer morning people simple thunder question village").split()


def make_prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 200))) for _ in range(count)]


def bench_engine(prompts, new_tokens: int, dtype: str, quantization: str = "none") -> dict:
    from common.sampling_params import SamplingParams
    from worker.engine import LLMEngine
    from worker.config import EngineConfig
    from worker.models.loader import load_tokenizer

    engine = LLMEngine(EngineConfig(model="default", device="cpu", dtype=dtype, quantization=quantization))
    tok = load_tokenizer(engine.source)
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("warmup", ids[0][:16], SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    start = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", p, params)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    return {"output_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed,
            "steps": engine.num_steps, "prompt_tokens": sum(map(len, ids))}


def bench_transformers(prompts, new_tokens: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from worker.models.loader import embedded_gguf_path
    path = embedded_gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch.input_ids.shape[1]) * len(prompts)
    return {"output_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="of both the engine and the peer")
    parser.add_argument("--quantization", default="none", choices=["none", "int8"],
                        help="of the engine's decoder linears (the peer's stay in --dtype)")
    args = parser.parse_args()
    prompts = make_prompts(args.requests)
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "commit": current_commit(),
              "dtype": args.dtype, "quantization": args.quantization,
              "engine": bench_engine(prompts, args.new_tokens, args.dtype, args.quantization)}
    print(f"pagedserve engine: {result['engine']['tokens_per_s']:.1f} output tokens/s "
          f"({result['engine']['output_tokens']} in {result['engine']['seconds']:.1f}s)", flush=True)
    if not args.skip_peer:
        import transformers
        result["transformers_version"] = transformers.__version__
        result["transformers"] = bench_transformers(prompts, args.new_tokens, args.dtype)
        result["ratio"] = result["engine"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
        print(f"transformers generate: {result['transformers']['tokens_per_s']:.1f} output tokens/s "
              f"({result['transformers']['output_tokens']} in {result['transformers']['seconds']:.1f}s); "
              f"ratio {result['ratio']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
