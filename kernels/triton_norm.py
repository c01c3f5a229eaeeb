"""Triton RMSNorm, plain and fused with the residual add (meaning: `norm.*_ref`).

One program per row. The rounding steps of the reference are kept (sum rounded to its
dtype before it is normalised, normalised value rounded before the weight multiplies it),
so 16-bit results match it to the last bit in most elements.

`QUANT`: the row, rounded to the output dtype as it would be stored, is quantized per token
instead (`kernels.triton_fp8.quantize_row`: the float8 values and scale `per_token_quant`
makes of the stored row, bit for bit), so a W8A8 linear's input is written once, in 8 bits,
rather than in 16 bits and read back by a quantization kernel.
"""

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Activation
from kernels.pdl import launch_options, pdl_enabled, wait_for_predecessor
from kernels.triton_fp8 import quantize_row, tl_dtype


@triton.jit
def _rms_norm_kernel(out, res_out, scale, x, residual, weight, stride_x, stride_r, stride_o,
                     stride_ro, n_cols, eps, ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     QUANT: tl.constexpr, OUT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        h += tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(res_out.dtype.element_ty)
        tl.store(res_out + row * stride_ro + cols, h, mask=mask)
        h = h.to(tl.float32)
    # `res_out` is the tensor being normalised (x itself without residual): its dtype is
    # the one the reference rounds to before applying the weight.
    inv_rms = tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    normed = (h * inv_rms).to(res_out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(OUT_DTYPE)
    if QUANT:
        quantize_row(out + row * stride_o, scale + row, y.to(tl.float32), cols, mask, FP8_MAX, MIN_SCALE)
    else:
        tl.store(out + row * stride_o + cols, y, mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, quantize: bool) -> tuple["torch.Tensor | Fp8Activation", torch.Tensor]:
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if residual is None:
        r2 = res_out = x2
        normed_dtype = x.dtype
    else:
        r2 = residual.reshape(-1, n_cols)
        normed_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x2.shape, dtype=normed_dtype, device=x.device)
    out_dtype = torch.promote_types(weight.dtype, normed_dtype)
    out = torch.empty(x2.shape, dtype=FP8_DTYPE if quantize else out_dtype, device=x.device)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device) if quantize else out
    assert x2.stride(-1) == r2.stride(-1) == weight.stride(-1) == 1
    block = triton.next_power_of_2(n_cols)
    if x2.shape[0]:
        pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            out, res_out, scale, x2, r2, weight, x2.stride(0), r2.stride(0), out.stride(0),
            res_out.stride(0), n_cols, eps, ADD_RESIDUAL=residual is not None, BLOCK=block,
            QUANT=quantize, OUT_DTYPE=tl_dtype(out_dtype), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            PDL=pdl, num_warps=min(max(block // 512, 1), 8), **launch_options(pdl))
    normed = Fp8Activation(out.view(x.shape), scale, out_dtype) if quantize else out.view(x.shape)
    return normed, res_out.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    quantize: bool = False) -> "torch.Tensor | Fp8Activation":
    return _launch(x, None, weight, eps, quantize)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, quantize: bool = False
                              ) -> tuple["torch.Tensor | Fp8Activation", torch.Tensor]:
    """Returns `(rms_norm(x + residual), x + residual)` from one read of each input."""
    return _launch(x, residual, weight, eps, quantize)
