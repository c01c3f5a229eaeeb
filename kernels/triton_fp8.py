"""Triton per-token FP8 quantization (meaning: `kernels.fp8.per_token_quant_ref`).

One program per row: the row's amax, then the row scaled, clamped and cast, in one launch.
The unfused PyTorch form is seven kernels (upcast, abs, amax, divide, clamp, divide, clamp,
cast) per linear layer: at batch 1 an 8B model runs 128 of them per token, and in a CUDA
graph their launches alone cost more than the FP8 GEMM saves.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _per_token_quant_kernel(out, scale, x, stride_x, stride_o, k, FP8_MAX: tl.constexpr,
                            MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x + row * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    s = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale + row, s)
    for start in range(0, k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x + row * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
        # div_rn: the correctly rounded division the reference does (Triton's `/` on fp32
        # is an approximation), so both give the same float8 values.
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -FP8_MAX), FP8_MAX)
        tl.store(out + row * stride_o + cols, q.to(out.dtype.element_ty), mask=cols < k)


def per_token_quant_triton(x: torch.Tensor, dtype: torch.dtype, fp8_max: float, min_scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (row stride free, columns contiguous) to (`dtype` [M, K], fp32 scale [M, 1])
    with the reference's constants."""
    m, k = x.shape
    assert x.stride(-1) == 1
    out = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _per_token_quant_kernel[(m,)](out, scale, x, x.stride(0), out.stride(0), k, FP8_MAX=fp8_max,
                                      MIN_SCALE=min_scale, BLOCK=min(1024, triton.next_power_of_2(k)))
    return out, scale
