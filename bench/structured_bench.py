"""The cost of structured outputs: decode time per output token (TPOT) at batch `--batch`, every
request under a JSON-schema constraint against none, and the unconstrained half of a batch that
mixes both, all in one run on one engine (issue 14's benchmark: overhead <= 10 %; mixed-in
unconstrained rows unchanged).

    python bench/structured_bench.py --out structured.json                        # the 8B shape, dummy bf16
    python bench/structured_bench.py --out s.json --model default --batch 4 --tokens 8   # CPU smoke run
    python bench/structured_bench.py --save-tokenizer bench/smollm2-tokenizer   # here, before carrying it

A grammar needs a tokenizer, and a preset shape (dummy weights) has none: the 8B shape is built
as a config directory with SmolLM2's tokenizer (from `--tokenizer`, a directory `save_pretrained`
wrote: it travels to the GPU machine, the GGUF does not), its vocabulary size the tokenizer's.
The schema asks for one long string, so no request ends before `--tokens` (the constraint allows
EOS only once the string closes, past minLength), and a step's batch stays whole.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from report import current_commit  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402
from worker.models.loader import PRESETS  # noqa: E402

SCHEMA = json.dumps({"type": "object", "properties": {"story": {"type": "string", "minLength": 100000}},
                     "required": ["story"], "additionalProperties": False})


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def model_dir(shape: str, tokenizer_dir: str) -> str:
    """A config directory of preset `shape` with the tokenizer of `tokenizer_dir`."""
    from transformers import AutoTokenizer, LlamaConfig
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    p = PRESETS[shape]
    path = tempfile.mkdtemp(prefix="structured-bench-")
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
                num_hidden_layers=p["num_layers"], num_attention_heads=p["num_heads"],
                num_key_value_heads=p["num_kv_heads"], rope_theta=p["rope_theta"], max_position_embeddings=4096,
                eos_token_id=tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def decode_tpot(engine: LLMEngine, constrained: list[bool], tokens: int, tag: str) -> dict:
    """TPOT (ms) of the batch's decode steps, over the constrained rows and the free ones."""
    prompt = [engine.tokenizer.encode("Write a long story about the sea.")] * len(constrained)
    for i, (ids, limited) in enumerate(zip(prompt, constrained)):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, seed=i, ignore_eos=not limited,
                                structured_output=StructuredOutput("json_schema", SCHEMA) if limited else None)
        engine.add_request(f"{tag}-{i}", ids, params)
    arrivals: dict[str, list[float]] = {f"{tag}-{i}": [] for i in range(len(constrained))}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            arrivals[out.request_id] += [now] * len(out.new_token_ids)
    gaps = {True: [], False: []}
    for i, limited in enumerate(constrained):
        times = arrivals[f"{tag}-{i}"][1:]     # from the first token: decode steps only
        gaps[limited] += [b - a for a, b in zip(times, times[1:])]
    return {"batch": len(constrained), "constrained": sum(constrained),
            **{f"tpot_ms_{'constrained' if k else 'free'}": 1e3 * statistics.mean(v) for k, v in gaps.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--save-tokenizer", metavar="DIR", help="write SmolLM2's tokenizer to DIR and exit")
    parser.add_argument("--model", default=None, help="a model path or 'default' instead of the 8B shape")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(PRESETS))
    parser.add_argument("--tokenizer", default="bench/smollm2-tokenizer",
                        help="a tokenizer directory (save_pretrained) for the dummy shape")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    if args.save_tokenizer:
        from worker.models.loader import load_tokenizer, resolve_source
        load_tokenizer(resolve_source("default")).save_pretrained(args.save_tokenizer)
        return
    if not args.out:
        parser.error("--out is required")
    dummy = args.model is None
    engine = LLMEngine(EngineConfig(model=model_dir(args.shape, args.tokenizer) if dummy else args.model,
                                    load_format="dummy" if dummy else "auto", dtype="bfloat16" if dummy else "auto",
                                    max_num_seqs=max(args.batch, 1), gpu_memory_utilization=0.85))
    decode_tpot(engine, [True, False] * 2, 8, "warm")      # compiles the grammar engine's tokenizer view
    runs = {name: decode_tpot(engine, rows, args.tokens, name) for name, rows in {
        "free": [False] * args.batch, "constrained": [True] * args.batch,
        "mixed": [i % 2 == 0 for i in range(args.batch)]}.items()}
    result = {"date": time.strftime("%Y-%m-%d"), "commit": current_commit(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "model": args.model or args.shape, "tokens": args.tokens, "runs": runs,
              "constrained_overhead": runs["constrained"]["tpot_ms_constrained"] / runs["free"]["tpot_ms_free"] - 1,
              "mixed_free_rows_vs_free": runs["mixed"]["tpot_ms_free"] / runs["free"]["tpot_ms_free"] - 1}
    log(json.dumps(result))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
