"""The linear layers of one Llama-3.1-8B decoder token, per weight format, on one GPU.

For M tokens per step (1 = batch-1 decode), times the four decoder linears of all 32 layers
(qkv 4096→6144, o 4096→4096, gate_up 4096→28672, down 14336→4096) in bf16 (cuBLAS), FP8 W8A8
(`kernels.fp8.fp8_linear`, per-token activation scales) and W4A16 group 128
(`kernels.w4a16.w4a16_matmul`, Triton), replayed from CUDA graphs as decode steps run, and
prints the bandwidth each reaches over its weight bytes (FP8 also split into its quantization
and its GEMM, rowwise- and tensorwise-scaled). Each format is checked against its reference first.

    python bench/quant_linears.py --out quant_linears.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels.fp8 import fp8_linear, fp8_linear_ref, per_channel_quant, per_token_quant  # noqa: E402
from kernels.w4a16 import W4Weight, w4a16_matmul, w4a16_matmul_ref  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
LAYERS = 32
GROUP = 128


def w4_of(k: int, n: int, g: torch.Generator) -> W4Weight:
    values = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // GROUP, n, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = torch.full((k // GROUP, n), 8, dtype=torch.uint8)
    return W4Weight.from_values(values, scales, zeros, GROUP).to("cuda")


def timed(fn, repeats: int = 20) -> float:
    """Device milliseconds per call of `fn`, replayed from a CUDA graph (as the engine's decode
    steps run), so Python and launch overhead do not count."""
    for _ in range(2):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, (k, n) in SHAPES.items():
        bf16 = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).cuda()
        weights[name] = {"bf16": bf16, "fp8": per_channel_quant(bf16), "w4a16": w4_of(k, n, g)}

    # Correctness first: each fast path against its reference, on one shape, M = 5.
    checks = {}
    x = torch.randn(5, 4096, generator=g).to(torch.bfloat16).cuda()
    w_q, w_scale = weights["qkv"]["fp8"]
    fast, ref = fp8_linear(x, w_q, w_scale).float(), fp8_linear_ref(x, w_q, w_scale).float()
    checks["fp8_max_rel_error"] = ((fast - ref).abs().max() / ref.abs().max()).item()
    w4 = weights["qkv"]["w4a16"]
    fast, ref = w4a16_matmul(x, w4).float(), w4a16_matmul_ref(x, w4).float()
    checks["w4a16_max_rel_error"] = ((fast - ref).abs().max() / ref.abs().max()).item()
    print(json.dumps(checks), flush=True)

    one = torch.ones(1, 1, dtype=torch.float32, device="cuda")
    formats = {
        "bf16": (lambda x, w: x @ w.T, lambda w: w.numel() * 2),
        "fp8": (lambda x, w: fp8_linear(x, *w), lambda w: w[0].numel() + w[1].numel() * 4),
        # The parts of fp8: the activations' quantization alone, and the GEMM alone with
        # rowwise scales and with one scale per tensor (cuBLAS' own FP8 path).
        "fp8_quant_only": (lambda x, w: per_token_quant(x), lambda w: w[0].numel() + w[1].numel() * 4),
        "fp8_gemm_rowwise": (lambda x, w: torch._scaled_mm(
            x.to(w[0].dtype), w[0].t(), scale_a=one.repeat(x.shape[0], 1), scale_b=w[1].view(1, -1),
            out_dtype=torch.bfloat16), lambda w: w[0].numel() + w[1].numel() * 4),
        "fp8_gemm_tensorwise": (lambda x, w: torch._scaled_mm(
            x.to(w[0].dtype), w[0].t(), scale_a=one.view(()), scale_b=one.view(()),
            out_dtype=torch.bfloat16), lambda w: w[0].numel() + w[1].numel() * 4),
        "w4a16": (w4a16_matmul, lambda w: w.qweight.numel() * 4 + w.scales.numel() * 2 + w.zeros.numel()),
    }
    results = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "checks": checks, "tokens": {}}
    for m in args.tokens:
        row = {}
        for fmt, (run, size) in formats.items():
            ms = bytes_ = 0.0
            for name, (k, n) in SHAPES.items():
                x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
                w = weights[name][fmt.split("_")[0]]
                ms += timed(lambda: run(x, w)) * LAYERS
                bytes_ += size(w) * LAYERS
            row[fmt] = {"ms_per_token_step": ms, "weight_gb": bytes_ / 1e9,
                        "bandwidth_tb_per_s": bytes_ / (ms / 1e3) / 1e12}
        row["fp8_speedup"] = row["bf16"]["ms_per_token_step"] / row["fp8"]["ms_per_token_step"]
        row["w4a16_speedup"] = row["bf16"]["ms_per_token_step"] / row["w4a16"]["ms_per_token_step"]
        results["tokens"][m] = row
        print(f"M={m}: " + ", ".join(f"{f} {row[f]['ms_per_token_step']:.2f} ms "
                                     f"({row[f]['bandwidth_tb_per_s']:.2f} TB/s)" for f in formats), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
