"""The unquantized (16-bit) linear: `F.linear`, except for one row on a GPU.

A batch-1 decode step multiplies one activation row by every weight of the model, so it is
bound by how fast the weights stream from memory. For that one shape cuBLAS picks split-K
kernels on the narrower layers (q/k/v and o of an 8B Llama) whose partial sums cost a second
launch, and reaches less of the H200's bandwidth than the Triton weight-only kernel of the
FP8 linears does when fed the 16-bit weight (`kernels.triton_fp8`, its "fma" mode: no
tensor cores, products summed in fp32 like cuBLAS's, one rounding). Measured per layer of
Llama-3.1-8B on an H200 (docs/BENCHMARKS.md): q/k/v 14.9 us against 16.0, o 11.2 against
12.6, gate/up 58.3 against 60.6, down equal. Every other shape is cuBLAS's.
"""

import torch
import torch.nn.functional as F

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, `x [..., K]`. The choice depends on shapes and dtypes alone (no
    host sync), so a CUDA graph captures whichever path its batch size takes."""
    if (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in GEMV_DTYPES
            and weight.dtype == x.dtype and weight.stride(-1) == 1 and x.stride(-1) == 1):
        from kernels.triton_fp8 import fp8_weight_only_triton   # Triton only where it runs
        return fp8_weight_only_triton(x, weight, None, bias, x.dtype)
    return F.linear(x, weight, bias)
