"""How close the one-row FP8 GEMV (batch-1 decode) comes to what its tiling can stream, on
the Llama-3.1-8B decoder shapes, one GPU. Asks whether the float8 -> float conversion, not the
memory system, bounds the W8A16 FMA kernel (`kernels.triton_fp8`).

Variants, each timed as `bench/quant_linears.py` times (CUDA-graph replays over copies of the
weight past the L2 cache):

* `shipped`: `kernels.fp8.fp8_linear` at one row (the FMA kernel with `pick_fp8_config`'s tiles).
* `bytes`: 16 weight rows a program as the shipped kernel, the float8 weight loaded as bytes and
  summed as integers: no float conversion, no multiply. The memory ceiling of that tiling.
* `fma_h`: the FMA product with the weight converted through float16 explicitly.
* `dot16`: the weight tile converted to float16 (one instruction per pair on Hopper) and
  multiplied on the tensor cores with x^T, float16, padded to 16 columns; tiles swept.
* `bf16`: the 16-bit one-row GEMV (`kernels.linear`) on the bfloat16 weight, twice the bytes.

    python bench/gemv_ceiling.py        # prints each variant's best per shape; $OUT/gemv_ceiling.json
"""

import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from quant_linears import SHAPES, copies_of, rel_error, timed  # noqa: E402

from kernels.fp8 import fp8_linear, fp8_weight_only_ref, per_channel_quant  # noqa: E402
from kernels.linear import linear  # noqa: E402
from kernels.triton_split_k import split_k_counters, split_k_reduce  # noqa: E402


@triton.jit(do_not_specialize=["M"])
def _variant_kernel(out, partial, counters, x, w, w_scale, M, N, K, tiles_per_split, stride_wn,
                    VARIANT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w + offs_n.to(tl.int64) * stride_wn
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    if VARIANT == "dot16":
        cols = tl.arange(0, 16)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        for tile in range(first, last):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x_t = tl.load(x + offs_k[:, None] + cols[None, :] * 0, mask=k_ok[:, None] & (cols[None, :] == 0),
                          other=0.0).to(tl.float16)
            b = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(b.to(tl.float16), x_t, acc)
        y = tl.sum(acc, axis=1)
    elif VARIANT == "bytes":
        sums = tl.zeros((BLOCK_N, BLOCK_K), tl.int32)
        for tile in range(first, last):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            b = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0)
            sums += b.to(tl.int32)
        y = tl.sum(sums, axis=1).to(tl.float32)
    else:  # fma_h
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for tile in range(first, last):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            b = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 += b.to(tl.float16).to(tl.float32) * a[None, :]
        y = tl.sum(acc2, axis=1)
    scale = tl.load(w_scale + offs_n, mask=n_ok, other=0.0)
    offs_m = tl.arange(0, 1)
    mask = (offs_m < M)[:, None] & n_ok[None, :]
    out_ptrs = out + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT:
        total, is_last = split_k_reduce(y[None, :], partial, counters, pid_n, pid_k, tl.num_programs(1),
                                        offs_m, offs_n, mask, M, N)
        if is_last:
            tl.store(out_ptrs, (total * scale[None, :]).to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, (y[None, :] * scale[None, :]).to(out.dtype.element_ty), mask=mask)


def variant(x: torch.Tensor, w: tuple, name: str, block_n: int, block_k: int, split: int, warps: int,
            stages: int) -> torch.Tensor:
    w_q, w_scale = w
    n, k = w_q.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    per = triton.cdiv(triton.cdiv(k, block_k), split)
    split = triton.cdiv(triton.cdiv(k, block_k), per)
    partial = counters = out
    if split > 1:
        partial = torch.empty((split, 1, n), dtype=torch.float32, device=x.device)
        counters = split_k_counters(x.device, triton.cdiv(n, block_n))
    _variant_kernel[(triton.cdiv(n, block_n), split)](
        out, partial, counters, x, w_q.view(torch.uint8) if name == "bytes" else w_q, w_scale, 1, n, k, per,
        w_q.stride(0), VARIANT=name, SPLIT=split > 1, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    g = torch.Generator().manual_seed(0)
    results = []
    for shape, (k, n) in SHAPES.items():
        bf16 = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).cuda()
        fp8s = copies_of(per_channel_quant(bf16), False)
        x = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda()
        ref = fp8_weight_only_ref(x, *fp8s[0])

        def record(name, config, fn, weights, nbytes=n * k, checked=True):
            err = rel_error(fn(x, weights[0]), ref) if checked else None
            us = timed(fn, x, weights, repeats=5) * 1e3
            results.append(dict(shape=shape, variant=name, config=config, us=us, tb_per_s=nbytes / us / 1e6, err=err))

        record("shipped", None, lambda x, w: fp8_linear(x, *w), fp8s)
        record("bf16", None, linear, copies_of(bf16, False), nbytes=2 * n * k, checked=False)
        for block_k, warps, split in itertools.product((256, 512), (4, 8), (1, 2)):
            cfg = (16, block_k, split, warps, 3)
            record("bytes", cfg, lambda x, w, c=cfg: variant(x, w, "bytes", *c), fp8s, checked=False)
            record("fma_h", cfg, lambda x, w, c=cfg: variant(x, w, "fma_h", *c), fp8s)
        for block_n, block_k, warps, stages, split in itertools.product((64, 128), (128, 256), (4, 8), (3, 4), (1, 2, 4)):
            cfg = (block_n, block_k, split, warps, stages)
            record("dot16", cfg, lambda x, w, c=cfg: variant(x, w, "dot16", *c), fp8s)
        del fp8s, bf16
        torch.cuda.empty_cache()
    best = {}
    for r in results:
        key = (r["shape"], r["variant"])
        if (r["err"] is None or r["err"] < 2e-2) and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for (shape, name), r in sorted(best.items()):
        print(f"{shape:8s} {name:8s} {r['us']:7.2f} us {r['tb_per_s']:5.2f} TB/s  config (block_n, block_k, "
              f"split, warps, stages) {r['config']}", flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_ceiling.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results,
                                                       "best": list(best.values())}, indent=1))


if __name__ == "__main__":
    main()
