"""The W4A16 matmul `x @ W.T` over a 4-bit `W4Weight` (layout: `kernels.w4_weight`): the
reference, which dequantizes and multiplies, and the dispatch to the Triton kernel on a GPU."""

import torch

from .w4_weight import W4Weight, dequantize_ref


def w4a16_matmul_ref(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """`x [..., K] @ W.T -> [..., N]`: the weight dequantized to `x.dtype`, then a matmul."""
    return x @ dequantize_ref(w, x.dtype).t()


def w4a16_matmul(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    if x.is_cuda:
        from .triton_w4a16 import w4a16_matmul_triton
        return w4a16_matmul_triton(x, w)
    return w4a16_matmul_ref(x, w)
