"""The linear layers of one Llama-3.1-8B decoder token, per weight format, on one GPU.

For M tokens per step (1 = batch-1 decode), times the four decoder linears of all 32 layers
(qkv 4096→6144, o 4096→4096, gate_up 4096→28672, down 14336→4096) replayed from CUDA graphs
as decode steps run, and prints the bandwidth each reaches over its weight bytes. Rows:

* `bf16`: cuBLAS (`x @ W.T`); `bf16_linear`: what the engine's unquantized linears run
  (`kernels.linear`: a Triton GEMV at one row, cuBLAS above).
* `fp8`: what `kernels.fp8.fp8_linear` does at this M (W8A16 Triton up to `W8A16_MAX_M`
  rows, W8A8 above); `fp8_w8a16` and `fp8_w8a8` force either path at every M, and the
  W8A8 path is also split into its parts: the activations' quantization alone, and the
  GEMM alone with rowwise scales and with one scale per tensor (cuBLAS' own FP8 path).
* `fp8_grouped`: `kernels.fp8.fp8_grouped_linear`, a scale per channel per 128 inputs (what
  a Hugging Face block-FP8 checkpoint loads as): W8A16 up to `W8A16_MAX_M` rows, above it the
  activations quantized per token per 128 and the Triton block-scaled GEMM.
* `w4a16`: `kernels.w4a16.w4a16_matmul` (Triton), group 128.
* `gguf_q4_1`, `gguf_q4_k`: the same kernel on the layouts GGUF Q4_1 and Q4_K files keep
  (group 32 with a float offset per group; float16 and float32 scales and offsets).
* `w4a16_tinygemm`: the peer for `w4a16`, torch's own 4-bit kernel
  (`aten::_weight_int4pack_mm`, tinygemm) on the same weights repacked for it.

Each layer's weight is read once per token step in the engine, and the 8B model is far larger
than the L2 cache, so each measurement rotates through copies of the weight (together over
`ROTATE_BYTES`) inside the graph; `--l2-hot` replays one copy instead (the method of the
earlier runs in docs/BENCHMARKS.md, which lets the smaller weights sit in L2). Each format is
checked against its reference first.

    python bench/quant_linears.py --out quant_linears.json
    python bench/quant_linears.py --out sweep.json --sweep     # the tile sweeps behind the configs
"""

import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels.fp8 import (W8A16_MAX_M, fp8_grouped_linear, fp8_grouped_linear_ref,  # noqa: E402
                         fp8_grouped_weight_only_ref, fp8_linear, fp8_linear_ref, fp8_linear_w8a8,
                         fp8_weight_only_ref, group_quant, per_channel_quant, per_token_quant)
from kernels.linear import linear  # noqa: E402
from kernels.w4_weight import W4Weight, unpack_int4  # noqa: E402
from kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
LAYERS = 32
GROUP = 128
ROTATE_BYTES = 256e6     # several times the H200's 50 MB L2


def w4_of(k: int, n: int, g: torch.Generator, group: int = GROUP, scales_dtype: torch.dtype = torch.bfloat16,
          offsets: bool = False) -> W4Weight:
    values = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(scales_dtype)
    zeros = torch.full((k // group, n), 0 if offsets else 8, dtype=torch.uint8)
    return W4Weight.from_values(values, scales, zeros, group,
                                offsets=-8 * scales if offsets else None).to("cuda")


def tinygemm_of(w: W4Weight, inner_k_tiles: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` (no act-order, groups of GROUP rows) as torch's tinygemm takes it: the packed weight,
    and bf16 scales and zeros `[G, N, 2]` for its `(q - 8) * scale + zero`, so
    `zero = (8 - z) * s + offset` (rounded to bf16 once)."""
    assert w.perm is None and w.group_size == GROUP
    q = unpack_int4(w.qweight).T.to(torch.int32)                     # [N, K]
    packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous(),
                                               inner_k_tiles)
    zero = (8 - w.zeros.float()) * w.scales.float()
    if w.offsets is not None:
        zero += w.offsets.float()
    return packed, torch.stack([w.scales.float(), zero], dim=2).to(torch.bfloat16).contiguous()


def tinygemm(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch._weight_int4pack_mm(x, w[0], GROUP, w[1])


def nbytes(w) -> int:
    if isinstance(w, W4Weight):
        offsets = 0 if w.offsets is None else w.offsets.numel() * w.offsets.element_size()
        return w.qweight.numel() * 4 + w.scales.numel() * w.scales.element_size() + w.zeros.numel() + offsets
    if isinstance(w, tuple):
        return sum(t.numel() * t.element_size() for t in w)
    return w.numel() * w.element_size()


def copies_of(w, hot: bool) -> list:
    """`w` and enough clones of it to pass ROTATE_BYTES (just `w` when `hot`)."""
    count = 1 if hot else max(1, math.ceil(ROTATE_BYTES / nbytes(w)))

    def clone(w):
        if isinstance(w, W4Weight):
            return W4Weight(w.qweight.clone(), w.scales.clone(), w.zeros.clone(), w.group_size,
                            w.in_features, w.out_features, w.perm,
                            None if w.offsets is None else w.offsets.clone())
        if isinstance(w, tuple):
            return tuple(t.clone() for t in w)
        return w.clone()
    return [w] + [clone(w) for _ in range(count - 1)]


def timed(fn, x, ws: list, repeats: int = 10) -> float:
    """Device milliseconds per call of `fn(x, w)`, the calls over `ws` in turn replayed from a
    CUDA graph (as the engine's decode steps run), so Python and launch overhead do not count."""
    for w in ws[:2]:
        fn(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (repeats * len(ws))


def rel_error(fast: torch.Tensor, ref: torch.Tensor) -> float:
    return ((fast.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# ------------------------------------------------------------------------------ the table

def main_table(args) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, (k, n) in SHAPES.items():
        bf16 = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).cuda()
        base = {"bf16": bf16, "fp8": per_channel_quant(bf16), "fp8_grouped": group_quant(bf16, GROUP),
                "w4a16": w4_of(k, n, g),
                "gguf_q4_1": w4_of(k, n, g, 32, torch.float16, offsets=True),
                "gguf_q4_k": w4_of(k, n, g, 32, torch.float32, offsets=True)}
        base["w4a16_tinygemm"] = tinygemm_of(base["w4a16"])
        weights[name] = {fmt: copies_of(w, args.l2_hot) for fmt, w in base.items()}

    # Correctness first: each fast path against its reference, on every shape, M = 5 and 64.
    checks = {}
    for name, (k, n) in SHAPES.items():
        for m in (5, 64):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            w_q, w_scale = weights[name]["fp8"][0]
            ref = (fp8_weight_only_ref if m <= W8A16_MAX_M else fp8_linear_ref)(x, w_q, w_scale)
            checks[f"fp8_{name}_m{m}"] = rel_error(fp8_linear(x, w_q, w_scale), ref)
            checks[f"fp8_w8a8_{name}_m{m}"] = rel_error(fp8_linear_w8a8(x, w_q, w_scale),
                                                         fp8_linear_ref(x, w_q, w_scale))
            g_q, g_scale = weights[name]["fp8_grouped"][0]
            grouped_ref = fp8_grouped_weight_only_ref if m <= W8A16_MAX_M else fp8_grouped_linear_ref
            checks[f"fp8_grouped_{name}_m{m}"] = rel_error(fp8_grouped_linear(x, g_q, g_scale, GROUP),
                                                            grouped_ref(x, g_q, g_scale, GROUP))
            one_row, bf16 = x[:1], weights[name]["bf16"][0]
            checks[f"bf16_linear_{name}_m1"] = rel_error(linear(one_row, bf16), one_row @ bf16.T)
            for kind in ("w4a16", "gguf_q4_1", "gguf_q4_k"):
                w4 = weights[name][kind][0]
                checks[f"{kind}_{name}_m{m}"] = rel_error(w4a16_matmul(x, w4), w4a16_matmul_ref(x, w4))
            checks[f"w4a16_tinygemm_{name}_m{m}"] = rel_error(
                tinygemm(x, weights[name]["w4a16_tinygemm"][0]), w4a16_matmul_ref(x, weights[name]["w4a16"][0]))
    print("max relative errors: " + json.dumps({k: f"{v:.1e}" for k, v in checks.items()}), flush=True)
    assert max(checks.values()) < 2e-2, checks

    from kernels.triton_fp8 import fp8_weight_only_triton

    one = torch.ones(1, 1, dtype=torch.float32, device="cuda")
    formats = {
        "bf16": (lambda x, w: x @ w.T, "bf16"),
        "bf16_linear": (linear, "bf16"),
        "fp8": (lambda x, w: fp8_linear(x, *w), "fp8"),
        "fp8_w8a16": (lambda x, w: fp8_weight_only_triton(x, w[0], w[1], None, x.dtype), "fp8"),
        "fp8_w8a8": (lambda x, w: fp8_linear_w8a8(x, *w), "fp8"),
        "fp8_grouped": (lambda x, w: fp8_grouped_linear(x, w[0], w[1], GROUP), "fp8_grouped"),
        "fp8_quant_only": (lambda x, w: per_token_quant(x), "fp8"),
        "fp8_gemm_rowwise": (lambda x, w: torch._scaled_mm(
            x.to(w[0].dtype), w[0].t(), scale_a=one.repeat(x.shape[0], 1), scale_b=w[1].view(1, -1),
            out_dtype=torch.bfloat16), "fp8"),
        "fp8_gemm_tensorwise": (lambda x, w: torch._scaled_mm(
            x.to(w[0].dtype), w[0].t(), scale_a=one.view(()), scale_b=one.view(()),
            out_dtype=torch.bfloat16), "fp8"),
        "w4a16": (w4a16_matmul, "w4a16"),
        "gguf_q4_1": (w4a16_matmul, "gguf_q4_1"),
        "gguf_q4_k": (w4a16_matmul, "gguf_q4_k"),
        "w4a16_tinygemm": (tinygemm, "w4a16_tinygemm"),
    }
    results = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "l2_hot": args.l2_hot, "w8a16_max_m": W8A16_MAX_M,
               "checks": checks, "tokens": {}}
    for m in args.tokens:
        row = {}
        for fmt, (run, kind) in formats.items():
            ms = bytes_ = 0.0
            for name, (k, n) in SHAPES.items():
                x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
                ws = weights[name][kind]
                ms += timed(run, x, ws) * LAYERS
                bytes_ += nbytes(ws[0]) * LAYERS
            row[fmt] = {"ms_per_token_step": ms, "weight_gb": bytes_ / 1e9,
                        "bandwidth_tb_per_s": bytes_ / (ms / 1e3) / 1e12}
        row["fp8_speedup"] = row["bf16"]["ms_per_token_step"] / row["fp8"]["ms_per_token_step"]
        row["w4a16_speedup"] = row["bf16"]["ms_per_token_step"] / row["w4a16"]["ms_per_token_step"]
        results["tokens"][m] = row
        print(f"M={m}: " + ", ".join(f"{f} {row[f]['ms_per_token_step']:.2f} ms "
                                     f"({row[f]['bandwidth_tb_per_s']:.2f} TB/s)" for f in formats), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print("\n| M | " + " | ".join(formats) + " |")
    for m, row in results["tokens"].items():
        print(f"| {m} | " + " | ".join(f"{row[f]['ms_per_token_step']:.2f} ({row[f]['bandwidth_tb_per_s']:.2f})"
                                      for f in formats) + " |")


# ------------------------------------------------------------------------------ the sweeps

def fp8_space():
    """(mode, block_m, block_n, block_k, num_warps, num_stages) per class of M (the kernels'
    modes: kernels/triton_fp8.py); the candidates left from the wider sweeps of
    docs/BENCHMARKS.md. In the one-row "fma" mode num_stages is the depth of the K loop's
    cp.async pipeline (1: none)."""
    fma = [("fma", 1, bn, bk, w, s) for bn, bk, w, s in itertools.product(
        (16, 32), (256, 512, 1024), (4, 8), (1, 2, 3, 4, 6))]
    small = [("dot", 16, 32, 256, 4, 3), ("dot", 16, 64, 128, 4, 3), ("dot", 16, 64, 128, 8, 4),
             ("dot_t", 16, 64, 128, 4, 3)]
    mid = [("dot", 32, 64, 256, 4, 3), ("dot", 32, 64, 128, 4, 3), ("dot_t", 32, 64, 128, 4, 3)]
    mid += [("dot", 64, 128, 128, 4, 3), ("dot_t", 64, 64, 128, 4, 3), ("dot_t", 64, 128, 128, 8, 3)]
    return fma + small + mid


def bf16_space():
    """The one-row GEMV of a 16-bit weight (`kernels.linear`: the FP8 kernel's "fma" mode)."""
    return [("fma", 1, 16, bk, w, s) for bk, w, s in itertools.product((256, 512), (4, 8), (1, 2, 3, 4))]


def w4_space():
    """As `fp8_space`; in "fma" mode num_stages 1 is the kernel's register prefetch."""
    fma = [("fma", 1, bn, bk, w, s) for bn, bk, w, s in itertools.product(
        (64, 128, 256), (64, 128), (4, 8), (1, 2, 3, 4))]
    small = [("dot", 16, bn, bk, w, s) for bn, bk, (w, s) in itertools.product(
        (64, 128), (64, 128), ((4, 3), (4, 4), (8, 3)))]
    mid = [("dot", 64, 128, 128, 4, 3), ("dot", 64, 64, 128, 4, 3), ("dot", 64, 128, 128, 8, 3)]
    large = [("dot", 64, 128, 128, 4, 3), ("dot", 128, 128, 128, 8, 3), ("dot", 128, 128, 64, 8, 3)]
    return fma + small + mid + large


def _compile(job) -> str:
    """Runs one config once on small inputs: fills Triton's cache for the timing process
    (the specialisation matches: every size and stride a multiple of 16, M unspecialised)."""
    kind, (mode, bm, bn, bk, warps, stages) = job
    m = 1 if bm == 1 else 3
    try:
        if kind in ("fp8", "bf16"):
            from kernels.triton_fp8 import fp8_weight_only_triton
            from kernels.triton_split_k import TileConfig
            w = torch.randn(256, 2048, device="cuda").to(torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16)
            s = torch.ones(256, device="cuda") if kind == "fp8" else None
            x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            for split in (1, 2):
                fp8_weight_only_triton(x, w, s, None, x.dtype,
                                       TileConfig(bm, bn, bk, split, warps, stages, mode))
        else:
            from kernels.triton_split_k import TileConfig
            from kernels.triton_w4a16 import w4a16_matmul_triton
            g = torch.Generator().manual_seed(0)
            w = W4Weight.from_values(torch.randint(0, 16, (1024, 512), generator=g),
                                     torch.rand(8, 512).bfloat16(), torch.full((8, 512), 8), 128).to("cuda")
            x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
            for split in (1, 2):
                w4a16_matmul_triton(x, w, TileConfig(bm, bn, bk, split, warps, stages, mode))
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported, and the config is skipped
        return f"{job}: {type(e).__name__}: {str(e)[:200]}"


def _fp8_with(cfg, x, w):
    from kernels.triton_fp8 import fp8_weight_only_triton
    return fp8_weight_only_triton(x, w[0], w[1], None, x.dtype, cfg)


def _bf16_with(cfg, x, w):
    from kernels.triton_fp8 import fp8_weight_only_triton
    return fp8_weight_only_triton(x, w, None, None, x.dtype, cfg)


def _w4_with(cfg, x, w):
    from kernels.triton_w4a16 import w4a16_matmul_triton
    return w4a16_matmul_triton(x, w, cfg)


def sweep(args) -> None:
    from kernels.triton_split_k import TileConfig

    def wanted(kind, c):
        return kind in args.sweep_kinds and (not args.sweep_modes or c[0] in args.sweep_modes)
    spaces = {"fp8": [c for c in fp8_space() if wanted("fp8", c)],
              "bf16": [c for c in bf16_space() if wanted("bf16", c)],
              "w4a16": [c for c in w4_space() if wanted("w4a16", c)]}
    jobs = [(kind, c) for kind, space in spaces.items() for c in space]
    start = time.time()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(14, os.cpu_count() or 1), mp_context=ctx) as pool:
        failed = [e for e in pool.map(_compile, jobs) if e]
    print(f"compiled {len(jobs)} configs x 2 in {time.time() - start:.0f} s; failed: {failed}", flush=True)
    bad = {f.split(":")[0] for f in failed}

    g = torch.Generator().manual_seed(0)
    results, best = [], {}
    for name, (k, n) in SHAPES.items():
        bf16 = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).cuda()
        fp8s = copies_of(per_channel_quant(bf16), False)
        bf16s = copies_of(bf16, False)
        w4s = copies_of(w4_of(k, n, g), False)
        for kind, space, ms_list in (("fp8", spaces["fp8"], (1, 16, 32, 64)), ("bf16", spaces["bf16"], (1,)),
                                     ("w4a16", spaces["w4a16"], (1, 16, 64, 256))):
            for m in ms_list:
                if m not in args.sweep_ms or not space:
                    continue
                x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
                if kind == "fp8":
                    ref = fp8_weight_only_ref(x, *fp8s[0])
                elif kind == "bf16":
                    ref = x @ bf16.T
                else:
                    ref = w4a16_matmul_ref(x, w4s[0])
                block_ms = {1: (1, 16), 16: (16,), 32: (32,), 64: (32, 64), 256: (64, 128)}[m]
                for c in space:
                    if str((kind, c)) in bad or c[1] not in block_ms:
                        continue
                    mode, bm = c[0], c[1]
                    tiles = math.ceil(k / c[3])
                    for split in (1, 2, 3, 4, 6, 8, 16):
                        if split > 1 and tiles // split < 2:
                            continue
                        cfg = TileConfig(bm, c[2], c[3], split, c[4], c[5], mode)
                        if kind == "fp8":
                            run = partial(_fp8_with, cfg)
                            ws = fp8s
                        elif kind == "bf16":
                            run = partial(_bf16_with, cfg)
                            ws = bf16s
                        else:
                            run = partial(_w4_with, cfg)
                            ws = w4s
                        err = rel_error(run(x, ws[0]), ref)
                        ms = timed(run, x, ws, repeats=5)
                        tbs = nbytes(ws[0]) / (ms / 1e3) / 1e12
                        rec = {"kind": kind, "shape": name, "m": m, "config": list(c),
                               "split": split, "us": ms * 1e3, "tb_per_s": tbs, "err": err}
                        results.append(rec)
                        key = (kind, name, m)
                        if err < 2e-2 and (key not in best or ms < best[key]["us"] / 1e3):
                            best[key] = rec
                if (kind, name, m) not in best:
                    continue
                base = timed(lambda x, w: x @ w.T, x, copies_of(bf16, False), repeats=5)
                print(f"{kind} {name} M={m}: best {best[(kind, name, m)]['config']} split "
                      f"{best[(kind, name, m)]['split']}: {best[(kind, name, m)]['us']:.1f} us "
                      f"({best[(kind, name, m)]['tb_per_s']:.2f} TB/s); bf16 {base * 1e3:.1f} us", flush=True)
        del fp8s, bf16s, w4s, bf16
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"results": results,
                                          "best": [v for v in best.values()]}, indent=1))
    # One config per (kind, M) for every shape, each shape at its best split: the ones to ship.
    per = {}
    for r in results:
        if r["err"] < 2e-2:
            key = (r["kind"], r["m"], tuple(r["config"]), r["shape"])
            per[key] = min(per.get(key, 1e9), r["us"])
    totals = {}
    for (kind, m, c, shape), us in per.items():
        totals.setdefault((kind, m, c), {})[shape] = us
    for kind, m in sorted({(k, m) for k, m, _ in totals}):
        ranked = sorted((sum(v.values()), c) for (k2, m2, c), v in totals.items()
                        if (k2, m2) == (kind, m) and len(v) == len(SHAPES))
        print(f"{kind} M={m}: " + "; ".join(f"{list(c)} {t:.0f} us" for t, c in ranked[:4]), flush=True)
    print(f"sweep done in {time.time() - start:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--l2-hot", action="store_true",
                        help="replay one copy of each weight (it may sit in L2) instead of rotating")
    parser.add_argument("--sweep", action="store_true", help="time the tile configs instead")
    parser.add_argument("--sweep-kinds", nargs="+", default=["fp8", "bf16", "w4a16"])
    parser.add_argument("--sweep-modes", nargs="*", default=[], help="only these kernel modes")
    parser.add_argument("--sweep-ms", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    args = parser.parse_args()
    sweep(args) if args.sweep else main_table(args)


if __name__ == "__main__":
    main()
