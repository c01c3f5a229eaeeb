"""SiLU-and-mul: the gated activation of the Llama MLP."""

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`x[..., 2d]` holds gate then up projections; returns `silu(gate) * up`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from .triton_activation import silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
