"""Triton SiLU-and-mul (meaning: `silu_and_mul_ref`)."""

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled, wait_for_predecessor


@triton.jit
def _silu_and_mul_kernel(out, x, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the reference's two ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + row * stride_o + cols, (act * up).to(out.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(-1) == 1
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0]:
        pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            out, x2, x2.stride(0), out.stride(0), d, BLOCK=block, PDL=pdl,
            **launch_options(pdl))
    return out.view(*x.shape[:-1], d)
