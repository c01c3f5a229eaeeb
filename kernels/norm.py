"""RMSNorm, plain and fused with the residual add; either may write its result quantized for
a W8A8 linear (`quantize`: a `kernels.fp8.Fp8Activation`, in the same kernel on CUDA)."""

import torch

from .fp8 import Fp8Activation


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rms_norm(x + residual), x + residual)`."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rms_norm(x, weight, eps: float, quantize: bool = False) -> "torch.Tensor | Fp8Activation":
    """`rms_norm_ref`'s result, or with `quantize` that result quantized per token."""
    if x.is_cuda:
        from .triton_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, quantize)
    out = rms_norm_ref(x, weight, eps)
    return Fp8Activation.of(out) if quantize else out


def fused_add_rms_norm(x, residual, weight, eps: float, quantize: bool = False):
    """`fused_add_rms_norm_ref`'s pair, the first quantized per token with `quantize`."""
    if x.is_cuda:
        from .triton_norm import fused_add_rms_norm_triton
        return fused_add_rms_norm_triton(x, residual, weight, eps, quantize)
    out, residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    return (Fp8Activation.of(out) if quantize else out), residual
