"""Does a persistent one-row GEMV stream the weight faster than the shipped one? The batch-1
FP8 and 16-bit GEMVs (`kernels.triton_fp8`'s FMA mode) give each program 16 weight rows, so
each program's cp.async pipeline fills and drains once per 16 rows: for q/k/v (K = 4096, 8
K-tiles of 512) the fill is a large part of its life. Here each program of a grid sized to
the SMs walks a contiguous range of row tiles in one flattened loop over (row tile, K-tile),
so its pipeline fills once per kernel, and the loads come either from pointers (cp.async) or
from a TMA descriptor (`TensorDescriptor`, Hopper's bulk copies).

Timed as `bench/quant_linears.py` times (CUDA-graph replays over copies of the weight past the
L2 cache), every kernel launched with PDL as the shipped one is, on the Llama-3.1-8B decoder
shapes:

    python bench/gemv_persistent.py     # best per shape and variant; $OUT/gemv_persistent.json
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
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kernels.fp8 import fp8_linear, fp8_weight_only_ref, per_channel_quant  # noqa: E402
from kernels.linear import linear  # noqa: E402
from kernels.pdl import launch_options, pdl_enabled, wait_for_predecessor  # noqa: E402
from kernels.triton_split_k import num_sms  # noqa: E402


@triton.jit
def _persistent_kernel(out, x, w, w_desc, w_scale, N, K, stride_wn, tiles_per_program,
                       TMA: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    k_tiles = tl.cdiv(K, BLOCK_K)
    first = tl.program_id(0) * tiles_per_program
    last = tl.minimum(first + tiles_per_program, tl.cdiv(N, BLOCK_N))
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for step in tl.range(0, (last - first) * k_tiles, num_stages=STAGES):
        n_tile = first + step // k_tiles
        k_tile = step % k_tiles
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if TMA:
            b = w_desc.load([n_tile * BLOCK_N, k_tile * BLOCK_K])
        else:
            b = tl.load(w + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                        mask=(offs_n < N)[:, None] & k_ok[None, :], other=0.0)
        acc += b.to(tl.float32) * a[None, :]
        if k_tile == k_tiles - 1:
            y = tl.sum(acc, axis=1)
            if HAS_SCALE:
                y *= tl.load(w_scale + offs_n, mask=offs_n < N, other=0.0)
            tl.store(out + offs_n, y.to(out.dtype.element_ty), mask=offs_n < N)
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)


def persistent(x: torch.Tensor, w, tma: bool, block_n: int, block_k: int, warps: int, stages: int,
               per_sm: int) -> torch.Tensor:
    w_q, w_scale = w if isinstance(w, tuple) else (w, None)
    n, k = w_q.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(n, block_n)
    per = triton.cdiv(n_tiles, num_sms(x.device) * per_sm)
    desc = TensorDescriptor.from_tensor(w_q, [block_n, block_k]) if tma else w_q
    pdl = pdl_enabled(x.device)
    _persistent_kernel[(triton.cdiv(n_tiles, per),)](
        out, x, w_q, desc, w_scale if w_scale is not None else out, n, k, w_q.stride(0), per,
        TMA=tma, HAS_SCALE=w_scale is not None, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        PDL=pdl, num_warps=warps, **launch_options(pdl))
    return out


def main() -> None:
    g = torch.Generator().manual_seed(0)
    results = []
    for shape, (k, n) in SHAPES.items():
        bf16 = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).cuda()
        kinds = {"fp8": copies_of(per_channel_quant(bf16), False), "bf16": copies_of(bf16, False)}
        x = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda()
        refs = {"fp8": fp8_weight_only_ref(x, *kinds["fp8"][0]), "bf16": x.float() @ bf16.float().T}

        def record(kind, name, config, fn):
            weights = kinds[kind]
            try:
                err = rel_error(fn(x, weights[0]), refs[kind])
                us = timed(fn, x, weights, repeats=5) * 1e3
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                print(f"{shape} {kind} {name} {config}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                return
            nbytes = n * k * (1 if kind == "fp8" else 2)
            results.append(dict(shape=shape, kind=kind, variant=name, config=config, us=us,
                                tb_per_s=nbytes / us / 1e6, err=err))

        record("fp8", "shipped", None, lambda x, w: fp8_linear(x, *w))
        record("bf16", "shipped", None, linear)
        for kind, tma, block_n, block_k, stages, per_sm in itertools.product(
                ("fp8", "bf16"), (False, True), (8, 16, 32), (128, 256, 512), (4, 8), (1, 2, 4)):
            elem = 1 if kind == "fp8" else 2
            warps = 4 if kind == "fp8" else 8      # the shipped kernel's
            if block_k == (512 if tma else 128):    # a TMA box is at most 256 elements a side
                continue
            if block_n * block_k * elem * stages > 160 * 1024 // per_sm:   # shared memory
                continue
            cfg = (block_n, block_k, warps, stages, per_sm)
            record(kind, "tma" if tma else "persistent", cfg,
                   lambda x, w, t=tma, c=cfg: persistent(x, w, t, *c))
        del kinds, bf16
        torch.cuda.empty_cache()
    best = {}
    for r in results:
        key = (r["kind"], r["shape"], r["variant"])
        if r["err"] < 2e-2 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for (kind, shape, name), r in sorted(best.items()):
        print(f"{kind:4s} {shape:8s} {name:10s} {r['us']:7.2f} us {r['tb_per_s']:5.2f} TB/s  config "
              f"(block_n, block_k, warps, stages, per_sm) {r['config']}", flush=True)
    # One config per kind and variant for all four shapes: the layer's sum.
    sums = {}
    for r in results:
        if r["err"] < 2e-2:
            sums.setdefault((r["kind"], r["variant"], str(r["config"])), {})[r["shape"]] = r["us"]
    for kind, name in sorted({(k, v) for k, v, _ in sums}):
        ranked = sorted((sum(v.values()), c) for (k2, v2, c), v in sums.items()
                        if (k2, v2) == (kind, name) and len(v) == len(SHAPES))
        print(f"{kind} {name} layer sum: " + "; ".join(f"{c} {t:.1f} us" for t, c in ranked[:3]), flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_persistent.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "results": results, "best": list(best.values())}, indent=1))


if __name__ == "__main__":
    main()
