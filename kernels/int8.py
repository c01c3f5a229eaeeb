"""W8A8 int8 linear layers: int8 weights with one scale per output channel, activations
quantized to int8 per token at run time, products summed exactly in int32.

    y = (x_q @ w_q.T) * x_scale[:, None] * w_scale[None, :] + bias

Both quantizations are symmetric over [-127, 127] (no zero points), as in vLLM's and
SmoothQuant's W8A8. The product runs through `torch._int_mm` (oneDNN / fbgemm on the CPU:
on a 2-core AVX-512 machine about 6x an fp32 GEMM of SmolLM2's shapes at 32 tokens, and 1.7x
bf16; docs/BENCHMARKS.md). `int8_linear_ref` computes the same from the dequantized operands
and is the tests' oracle.
"""

import torch

INT8_MAX = 127


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x [R, C]` over its own absolute maximum: (int8 `[R, C]`, fp32 scale
    `[R, 1]`); a row of zeros gets a tiny scale and stays zeros."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX
    return (x / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def per_token_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[M, K]` to (int8 `[M, K]`, fp32 scale `[M, 1]`)."""
    return _quantize_rows(x)


def per_channel_quant_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[N, K]` to (int8 `[N, K]`, fp32 scale `[N]`): one scale per output channel."""
    w_q, scale = _quantize_rows(weight)
    return w_q, scale.view(-1)


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized product in float64, in x's dtype: what `int8_linear` computes."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = per_token_quant_int8(rows)
    y = (x_q.double() * x_scale.double()) @ (weight.double() * weight_scale.double()[:, None]).t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [..., K]` (any float dtype) through int8 `weight [N, K]` with `weight_scale [N]`."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = per_token_quant_int8(rows)
    y = torch._int_mm(x_q, weight.t()).float() * x_scale * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
