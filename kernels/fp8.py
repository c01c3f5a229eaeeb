"""FP8 (e4m3fn) W8A8 linear: per-output-channel weight scales, dynamic per-token activation
scales.

`fp8_linear` quantizes each row of the activations with its own scale (amax / 448) and
multiplies with cuBLAS' FP8 GEMM (`torch._scaled_mm`, rowwise scaling) on CUDA;
`fp8_linear_ref` computes the same products in fp32 on any device (the CPU path and the test
oracle). Neither reads anything back to the host, so both can be captured in a CUDA graph.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max          # 448
# Smallest scale: an all-zero row (CUDA-graph padding, a zero weight row) quantizes to zeros
# instead of dividing by zero. vLLM uses the same floor for its dynamic scales.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# cuBLAS' FP8 GEMM needs K and N to be multiples of 16; other shapes take the emulation.
SCALED_MM_ALIGNMENT = 16


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x [R, C]` scaled by its own amax / 448: (float8 [R, C], fp32 scale [R, 1])."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    # Clamped before the cast: float8_e4m3fn has no infinity, an out-of-range value becomes NaN.
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[M, K]` to (float8 `[M, K]`, fp32 scale `[M, 1]`); M may be 0. One fused
    Triton kernel on CUDA (`kernels.triton_fp8`), the same values as this reference."""
    if x.is_cuda and x.stride(-1) == 1:
        from kernels.triton_fp8 import per_token_quant_triton   # Triton only where it runs
        return per_token_quant_triton(x, FP8_DTYPE, FP8_MAX, MIN_SCALE)
    return per_token_quant_ref(x)


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows(x)


def per_channel_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[N, K]` to (float8 `[N, K]`, fp32 scale `[N]`): one scale per output channel."""
    w_q, scale = _quantize_rows(w)
    return w_q, scale.view(-1)


def dequantize_blocks(w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 `[N, K]` of a block-quantized weight: `scale[i, j]` applies to the block of rows
    `i*block[0]...` and columns `j*block[1]...` (the last blocks may be partial)."""
    n, k = w_q.shape
    full = scale.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return w_q.float() * full


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x [..., K] @ (weight [N, K] * weight_scale [N]).T + bias` with `x` quantized per token.

    The products of the quantized values are summed in fp32 and scaled afterwards, as the FP8
    GEMM does: `(x_q * sa) @ (w_q * sb).T == (x_q @ w_q.T) * sa * sb.T`.
    """
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_scale = per_token_quant_ref(x2)
    out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.float().view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W8A8 linear: `weight` float8 `[N, K]` row-major (so `weight.t()` is the column-major
    operand `_scaled_mm` needs), `weight_scale` fp32 `[N]`; output in `out_dtype` (default:
    `x`'s)."""
    n, k = weight.shape
    if not x.is_cuda or n % SCALED_MM_ALIGNMENT or k % SCALED_MM_ALIGNMENT:
        return fp8_linear_ref(x, weight, weight_scale, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:    # older torch's rowwise kernel refuses M=0 (a shape: no host sync)
        return x.new_empty(*x.shape[:-1], n, dtype=out_dtype)
    x_q, x_scale = per_token_quant(x2)
    # bfloat16 is the one output every torch version and GPU gives rowwise scaling (fp16 and
    # fp32 only some: fp32 needs cuBLAS >= 12.9 on sm90); another dtype is cast from it.
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.view(*x.shape[:-1], n)
