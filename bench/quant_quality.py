"""What each quantization costs in accuracy, on the embedded SmolLM2-135M (CPU): perplexity of
the text the tests ship (`tests/helpers.py`'s LONG_STORY, teacher-forced), its change against
float32, the mean KL divergence of the next-token distributions from float32's, and how often
both pick the same top token. The bytes of the decoder layers' parameters are printed too.

Every row runs the engine's own CPU path for the format: `--quantization fp8` (W8A8, quantized on
load), `int8`, `gguf` (the file's Q4_1 blocks kept), `--kv-cache-dtype fp8`, `--dtype bfloat16`;
W4A16 is the engine's 4-bit linear over the weights rounded as `--load-format dummy` rounds them
(`round_to_w4`: asymmetric min-max, no calibration) in groups of 64 (SmolLM2's 576 inputs take
no groups of 128), since no 4-bit checkpoint of this model ships. The embedded file is itself
Q4_1, so float32 here is its dequantized weights: every other format rounds weights that were
rounded once already.

    python bench/quant_quality.py --out quality.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from helpers import LONG_STORY, perplexity  # noqa: E402

from worker.config import EngineConfig  # noqa: E402
from worker.engine import LLMEngine  # noqa: E402
from worker.models.loader import load_model, load_tokenizer, resolve_source  # noqa: E402
from worker.models.quantization import W4OnLoad  # noqa: E402
from report import current_commit  # noqa: E402

CPU = torch.device("cpu")
# name -> (load_model settings, engine settings, the group size to round the linears to 4 bits
# in after loading, or 0)
FORMATS = {
    "float32": ({}, {}, 0),
    "bfloat16": ({"dtype": torch.bfloat16}, {"dtype": "bfloat16"}, 0),
    "fp8 (W8A8)": ({"quantization": "fp8"}, {}, 0),
    "int8 (W8A8)": ({"quantization": "int8"}, {}, 0),
    "W4A16 (group 64, RTN)": ({}, {}, 64),
    "GGUF Q4_1 kept in blocks": ({"quantization": "gguf"}, {"quantization": "gguf"}, 0),
    "float32, fp8 KV cache": ({}, {"kv_cache_dtype": "fp8"}, 0),
}


def decoder_layer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder layers' parameters (the linears and the norms)."""
    return sum(p.numel() * p.element_size() for p in model.layers.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    source = resolve_source("default")
    ids = load_tokenizer(source).encode(LONG_STORY, add_special_tokens=False)
    rows, base = {}, None
    for name, (load, engine_settings, w4_group) in FORMATS.items():
        load = {"dtype": torch.float32, **load}
        loaded = load_model(source, CPU, load.pop("dtype"), **load)
        if w4_group:
            W4OnLoad("the quality bench", w4_group).after_loading(loaded[1])
        engine = LLMEngine(EngineConfig(model="default", device="cpu", num_blocks=128,
                                        **{"dtype": "float32", **engine_settings}), source, loaded)
        logprobs = engine.prompt_logits(ids).float().log_softmax(-1)
        if base is None:
            base = logprobs
        row = {"perplexity": perplexity(logprobs, ids), "decoder_bytes": decoder_layer_bytes(loaded[1]),
               "mean_kl_nats": (base.exp() * (base - logprobs)).sum(-1).mean().item(),
               "top1_agreement": (base.argmax(-1) == logprobs.argmax(-1)).float().mean().item()}
        row["perplexity_change"] = row["perplexity"] / rows.get("float32", row)["perplexity"] - 1
        rows[name] = row
        print(f"{name:<28} perplexity {row['perplexity']:7.2f} ({row['perplexity_change']:+.1%})  "
              f"KL {row['mean_kl_nats']:.3f}  top-1 {row['top1_agreement']:.0%}  "
              f"decoder {row['decoder_bytes'] / 1e6:.0f} MB", flush=True)
        engine.close()
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": current_commit(),
                                          "tokens": len(ids), "formats": rows}, indent=2))


if __name__ == "__main__":
    main()
