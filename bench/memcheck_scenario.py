"""A short serving scenario for `compute-sanitizer --tool memcheck`: every device path of a step.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/memcheck_scenario.py
    python3 bench/memcheck_scenario.py cpu      # the same scenario on the CPU, as a check of it
    ... memcheck_scenario.py cuda fp8           # the mixed batch alone, FP8 weights over a float8 KV pool

A small random Llama (bf16, CUDA graphs and asynchronous scheduling on, a 256-token step
budget so long prompts run as many chunk steps that draw nothing): lone prompts from 1k to 8k
tokens on a fresh engine, then a mixed batch with aborts mid-prefill and mid-decode, n > 1,
prefix-cache hits and swap preemption in a small pool. `fp8`: only the mixed batch, with
weights quantized to FP8 on load (the weight-only GEMVs and the W8A8 GEMMs) over a float8 KV
pool (its scaled KV write and attention). Exits non-zero if any request goes wrong; memcheck's
own exit code reports memory errors.
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.sampling_params import SamplingParams  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402


DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
FP8 = len(sys.argv) > 2 and sys.argv[2] == "fp8"


def tiny_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2,
                                 max_position_embeddings=8192)).save_pretrained(path)


def run(engine: LLMEngine, abort_after: dict[str, int] | None = None) -> dict[str, int]:
    """Steps to the end; aborts request r after `abort_after[r]` steps. Tokens per choice."""
    counts: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            key = f"{out.request_id}/{out.index}"
            counts[key] = counts.get(key, 0) + len(out.new_token_ids)
        steps += 1
        for request_id, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(request_id)
    assert engine.blocks.num_free == engine.blocks.num_blocks, "blocks left held"
    return counts


def main() -> None:
    path = tempfile.mkdtemp()
    tiny_llama(path)
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 512, (n,), generator=gen).tolist()  # noqa: E731
    greedy = lambda n, **kw: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)  # noqa: E731

    for length in () if FP8 else (1024, 2048, 4096, 8184):
        engine = LLMEngine(EngineConfig(model=path, device=DEVICE, dtype="bfloat16", num_blocks=600,
                                        max_num_batched_tokens=256, max_num_seqs=64))
        engine.add_request("lone", ids(length), greedy(8))
        assert run(engine) == {"lone/0": 8}, length
        print(f"lone prompt of {length} tokens: ok", flush=True)
        del engine

    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"} if FP8 else {}
    engine = LLMEngine(EngineConfig(model=path, device=DEVICE, dtype="bfloat16", num_blocks=100,
                                    num_swap_blocks=256, max_num_batched_tokens=256, max_num_seqs=64, **fp8))
    shared = ids(200)
    for i in range(24):
        engine.add_request(f"r{i}", shared + ids(20 + 10 * i), greedy(40))
    engine.add_request("forked", ids(50), SamplingParams(temperature=0.8, seed=1, max_tokens=30, n=3))
    engine.add_request("long", ids(1400), greedy(4))
    counts = run(engine, abort_after={"long": 3, "r5": 12, "r9": 30})
    assert all(counts.get(f"r{i}/0") == 40 for i in range(24) if i not in (5, 9)), counts
    assert engine.stats().preemptions["swap"] + engine.stats().preemptions["recompute"] > 0, engine.stats()
    assert engine.blocks.prefix_hits > 0
    print(f"mixed batch with aborts, n=3, prefix hits and preemption{' (FP8 weights, float8 KV)' if FP8 else ''}: "
          f"ok ({engine.stats().preemptions})")


if __name__ == "__main__":
    main()
