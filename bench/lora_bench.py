"""Multi-LoRA cost on the GPU: W1 and W2 (docs/BENCHMARKS.md) with adapters against the base
model in the same run, on the Llama-3.1-8B shape with dummy bf16 weights.

    python bench/lora_bench.py --out lora.json [--adapters 8] [--rank 16]

W1 spreads its 512 requests evenly over `--adapters` adapters of rank `--rank` on all seven
projections (the issue's target: >= 85 % of the base model's output tokens/s); W2 decodes one
request under one adapter (target >= 90 %). The adapters are random, written in PEFT's format.
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from common.sampling_params import SamplingParams  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402
from worker.config import ModelConfig  # noqa: E402
from worker.models.loader import PRESETS  # noqa: E402
from worker.models.lora_checkpoint import projection_shapes  # noqa: E402
from report import current_commit  # noqa: E402
from workloads import w1_requests  # noqa: E402

MODEL = "llama-3.1-8b"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def write_adapter(path: Path, shapes: dict, layers: int, rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in MODULES:
            fan_in, fan_out = shapes[module]
            where = "self_attn" if module in MODULES[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 1e-3).bfloat16()
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          "target_modules": MODULES}))


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, loras: list[str | None]) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start, first_token, generated = time.perf_counter(), None, 0
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", p, params, lora_name=lora)
    while engine.has_unfinished():
        outs = engine.step()
        if outs and first_token is None:
            first_token = time.perf_counter() - start
        generated += sum(len(o.new_token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    return {"output_tokens": generated, "seconds": elapsed, "output_tokens_per_s": generated / elapsed,
            "decode_tokens_per_s": (max_tokens - 1) / (elapsed - first_token) if len(prompts) == 1 else None}


def bench(args, adapters: dict[str, str] | None) -> dict:
    engine = LLMEngine(EngineConfig(
        model=MODEL, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=512,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.85, enable_prefix_caching=False,
        enable_lora=adapters is not None, max_loras=max(args.adapters, 1), max_lora_rank=args.rank,
        lora_modules=adapters or {}))
    names = list(adapters or {}) or [None]
    w1 = w1_requests()
    w1_loras = [names[i % len(names)] for i in range(len(w1))]
    run(engine, w1, 32, w1_loras)          # warm-up: every chunk and batch size compiled
    out = {"w2": run(engine, [list(range(1000, 1128))], 256, [names[0]]),
           "w1": run(engine, w1, 256, w1_loras), "kv_blocks": engine.blocks.num_blocks}
    log("adapters" if adapters else "base", json.dumps(out))
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    shapes = projection_shapes(ModelConfig(**PRESETS[MODEL]))
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "model": MODEL,
              "commit": current_commit(), "adapters": args.adapters, "rank": args.rank}
    result["base"] = bench(args, None)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for i in range(args.adapters):
            paths[f"a{i}"] = str(Path(tmp) / f"a{i}")
            write_adapter(Path(paths[f"a{i}"]), shapes, PRESETS[MODEL]["num_layers"], args.rank, i)
        result["lora"] = bench(args, paths)
    for w in ("w1", "w2"):
        key = "decode_tokens_per_s" if w == "w2" else "output_tokens_per_s"
        result[f"{w}_ratio"] = result["lora"][w][key] / result["base"][w][key]
    log(f"W1 with {args.adapters} adapters at {100 * result['w1_ratio']:.1f}% of base; "
        f"W2 with one at {100 * result['w2_ratio']:.1f}%")
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
