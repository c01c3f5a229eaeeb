"""Triton RMSNorm, plain and fused with the residual add (meaning: `norm.*_ref`).

One program per row. The rounding steps of the reference are kept (sum rounded to its
dtype before it is normalised, normalised value rounded before the weight multiplies it),
so 16-bit results match it to the last bit in most elements.
"""

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled, wait_for_predecessor


@triton.jit
def _rms_norm_kernel(out, res_out, x, residual, weight, stride_x, stride_r, stride_o,
                     stride_ro, n_cols, eps, ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
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
    tl.store(out + row * stride_o + cols, (normed * w).to(out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if residual is None:
        r2 = res_out = x2
        normed_dtype = x.dtype
    else:
        r2 = residual.reshape(-1, n_cols)
        normed_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x2.shape, dtype=normed_dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, normed_dtype),
                      device=x.device)
    assert x2.stride(-1) == r2.stride(-1) == weight.stride(-1) == 1
    block = triton.next_power_of_2(n_cols)
    if x2.shape[0]:
        pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            out, res_out, x2, r2, weight, x2.stride(0), r2.stride(0), out.stride(0),
            res_out.stride(0), n_cols, eps, ADD_RESIDUAL=residual is not None, BLOCK=block,
            PDL=pdl, num_warps=min(max(block // 512, 1), 8), **launch_options(pdl))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rms_norm(x + residual), x + residual)` from one read of each input."""
    return _launch(x, residual, weight, eps)
