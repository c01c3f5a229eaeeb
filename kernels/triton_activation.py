"""Triton SiLU-and-mul (meaning: `silu_and_mul_ref`).

Rows are cut into blocks of up to 1,024 columns, a program each. Quantized for a W8A8 linear
(`kernels.fp8.Fp8Activation`), a program takes a whole row instead, since the row's scale
needs its amax: the product rounded to the input dtype, as it would be stored, then
`kernels.triton_fp8.quantize_row` (the float8 values and scale `per_token_quant` makes of the
stored row, bit for bit), so the 16-bit row is neither written nor read back.
"""

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Activation
from kernels.pdl import launch_options, pdl_enabled, wait_for_predecessor
from kernels.triton_fp8 import quantize_row, tl_dtype


@triton.jit
def _silu_and_mul_kernel(out, scale, x, stride_x, stride_o, d, BLOCK: tl.constexpr,
                         DTYPE: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                         MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the reference's two ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    y = (act * up).to(DTYPE)
    if QUANT:       # BLOCK covers the row: one program per row
        quantize_row(out + row * stride_o, scale + row, y.to(tl.float32), cols, mask, FP8_MAX, MIN_SCALE)
    else:
        tl.store(out + row * stride_o + cols, y, mask=mask)


def silu_and_mul_triton(x: torch.Tensor, quantize: bool = False) -> "torch.Tensor | Fp8Activation":
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(-1) == 1
    out = torch.empty((x2.shape[0], d), dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device) if quantize else out
    block = triton.next_power_of_2(d) if quantize else min(1024, triton.next_power_of_2(d))
    if x2.shape[0]:
        pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            out, scale, x2, x2.stride(0), out.stride(0), d, BLOCK=block, DTYPE=tl_dtype(x.dtype),
            QUANT=quantize, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, PDL=pdl,
            num_warps=min(max(block // 512, 4), 16), **launch_options(pdl))
    out = out.view(*x.shape[:-1], d)
    return Fp8Activation(out, scale, x.dtype) if quantize else out
