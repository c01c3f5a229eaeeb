"""Where a batch-1 decode step goes (W2's shape, Llama-3.1-8B, dummy weights), from a torch
profiler trace: the GPU's busy time per step against the wall time (the rest is the GPU idle:
between the launches of one CUDA graph, and waiting on the host), and each kernel's (and
copy's) launches and time per step. Also W2's decode rate
and the weight bandwidth it achieves (weight bytes x tokens/s, as gpt-fast prints it).

    python bench/decode_profile.py --out profile.json [--quantization fp8] [--kv-cache-dtype fp8] [--power]
        [--pdl off]

`--pdl off` launches the decode kernels without programmatic dependent launch (`kernels/pdl.py`;
the same as `PAGEDSERVE_PDL=0`), for a same-run comparison against the default.

`--power` also decodes 1,500 tokens while `nvidia-smi` samples the GPU's power, clocks and
clock-limiting reasons (`gpu_power.py`).
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common.sampling_params import SamplingParams  # noqa: E402
from kernels.pdl import pdl_enabled  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402
from gpu_power import PowerSampler  # noqa: E402
from report import current_commit  # noqa: E402

def decode_rate(engine: LLMEngine, prompt_len: int = 128, new_tokens: int = 256) -> float:
    """Decode tokens per second of one request (its first token, the prefill, excluded)."""
    engine.add_request("w2", list(range(1000, 1000 + prompt_len)),
                       SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        if engine.step() and first is None:
            first = time.perf_counter()
    return (new_tokens - 1) / (time.perf_counter() - first)


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def profile_steps(engine: LLMEngine, steps: int, trace_path: Path | None) -> dict:
    """Profiles `steps` decode steps of one request at context ~128-200."""
    from torch.profiler import ProfilerActivity, profile
    engine.add_request("p", list(range(2000, 2128)),
                       SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True))
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    return kernel_summary(prof, steps, wall)


def kernel_summary(prof, steps: int, wall: float) -> dict:
    """A profile's GPU busy and idle time per step (of `steps` over `wall` seconds), and each
    kernel's (and copy's) launches and time per step, longest first."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        per_name[e.name].append(e.time_range.end - e.time_range.start)
    table = sorted(({"name": name[:120], "launches_per_step": len(times) / steps,
                     "us_per_step": sum(times) / steps, "us_each": sum(times) / len(times)}
                    for name, times in per_name.items()), key=lambda r: -r["us_per_step"])
    busy = busy_union(intervals) / steps / 1e3
    return {"steps": steps, "wall_ms_per_step": wall / steps * 1e3, "gpu_busy_ms_per_step": busy,
            "gpu_idle_ms_per_step": wall / steps * 1e3 - busy,
            "launches_per_step": len(kernels) / steps, "kernels": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--trace", help="also write the chrome trace here")
    parser.add_argument("--power", action="store_true", help="sample power and clocks over a 1,500-token decode")
    parser.add_argument("--pdl", choices=("on", "off"), default="on",
                        help="programmatic dependent launch of the decode kernels (on: where the GPU has it)")
    args = parser.parse_args()
    if args.pdl == "off":
        os.environ["PAGEDSERVE_PDL"] = "0"
    # A small max_num_seqs: only batch 1 runs, and fewer CUDA graphs to capture.
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16",
                                    max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.85,
                                    enable_prefix_caching=False, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    decode_rate(engine, new_tokens=32)      # warm-up: compiles the prefill and decode variants
    rates = [decode_rate(engine) for _ in range(3)]
    rate = max(rates)
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "commit": current_commit(),
              "model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "pdl": pdl_enabled(torch.device("cuda")),     # whether it was on, not just asked for
              "weight_bytes": weight_bytes, "w2_decode_tokens_per_s": rates,
              "achieved_weight_tb_per_s": weight_bytes * rate / 1e12,
              "profile": profile_steps(engine, args.steps, Path(args.trace) if args.trace else None)}
    if args.power:
        with PowerSampler() as sampler:
            start = datetime.datetime.now()
            long_rate = decode_rate(engine, new_tokens=1500)
            end = datetime.datetime.now()
        # From half a second in: the prefill and the first steps are not the steady state.
        power = sampler.summary(start + datetime.timedelta(seconds=0.5), end)
        result["power"] = {"w2_decode_tokens_per_s": long_rate, **(dataclasses.asdict(power) if power else {})}
        print(f"W2 over 1,500 tokens {long_rate:.1f} tok/s; {power.line() if power else 'no nvidia-smi samples'}",
              flush=True)
    p = result["profile"]
    print(f"W2 decode {rate:.1f} tok/s ({', '.join(f'{r:.1f}' for r in rates)}); weights "
          f"{weight_bytes / 1e9:.2f} GB -> {result['achieved_weight_tb_per_s']:.2f} TB/s achieved", flush=True)
    print(f"per step: wall {p['wall_ms_per_step']:.3f} ms, GPU busy {p['gpu_busy_ms_per_step']:.3f} ms, "
          f"idle {p['gpu_idle_ms_per_step']:.3f} ms, {p['launches_per_step']:.0f} launches", flush=True)
    for row in p["kernels"][:25]:
        print(f"{row['us_per_step']:9.1f} us/step {row['launches_per_step']:6.1f}x {row['us_each']:7.2f} us  {row['name']}")
    Path(args.out).write_text(json.dumps(result, indent=2))
    engine.close()


if __name__ == "__main__":
    main()
