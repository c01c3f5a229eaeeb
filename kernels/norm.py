"""RMSNorm, plain and fused with the residual add."""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rms_norm(x + residual), x + residual)`."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from .triton_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float):
    if x.is_cuda:
        from .triton_norm import fused_add_rms_norm_triton
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)
