"""SiLU-and-mul: the gated activation of the Llama MLP; it may write its result quantized for a
W8A8 linear (`quantize`: a `kernels.fp8.Fp8Activation`, in the same kernel on CUDA)."""

import torch
import torch.nn.functional as F

from .fp8 import Fp8Activation


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`x[..., 2d]` holds gate then up projections; returns `silu(gate) * up`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, quantize: bool = False) -> "torch.Tensor | Fp8Activation":
    """`silu_and_mul_ref(x)`, or with `quantize` that result quantized per token."""
    if x.is_cuda:
        from .triton_activation import silu_and_mul_triton
        return silu_and_mul_triton(x, quantize)
    out = silu_and_mul_ref(x)
    return Fp8Activation.of(out) if quantize else out
