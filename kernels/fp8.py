"""FP8 (e4m3fn) linears: per-output-channel weight scales; W8A8 for large M, W8A16 for small M.

`fp8_linear` picks by the number of rows M of the activations (tokens in the step):

* M <= `W8A16_MAX_M` (decodes): weight-only, W8A16. The activations stay in their own dtype
  (unquantized), the float8 weight is converted to it tile by tile inside one Triton kernel
  (`kernels.triton_fp8.fp8_weight_only_triton`), products summed in fp32, the channel scale
  applied to the sum. Why: at small M the product is bound by the weight's bytes, so FP8
  tensor cores' doubled rate buys nothing; quantizing the activations costs a kernel launch
  per linear (128 per token for an 8B model); and torch's rowwise-scaled FP8 GEMM (the
  per-channel scales need it) streams the weight at 1.6 TB/s on an H200 at batch 1 against
  about 3 TB/s for this kernel (docs/BENCHMARKS.md). It is also more accurate: only the
  weight is rounded, not the activations. Reference: `fp8_weight_only_ref`.
* Larger M (prefill): W8A8. Each row of the activations is quantized with its own scale
  (amax / 448, one fused Triton kernel) and multiplied with cuBLAS' FP8 GEMM
  (`torch._scaled_mm`, rowwise scaling), where FP8 tensor cores' doubled rate pays.
  Reference: `fp8_linear_ref`. The kernel that makes the activations can quantize them as it
  writes them instead (`Fp8Activation`: the RMSNorm and SiLU-and-mul kernels do, when
  `w8a8_applies` says the linear after them will run W8A8): on W1 with FP8 weights the separate
  quantization was 6 % of the GPU's time, and the bf16 tensor it reads back is written for it
  alone.

On the CPU `fp8_linear` is `fp8_linear_ref` (W8A8, emulated in fp32) at every M. None of
these read anything back to the host, so all can be captured in a CUDA graph.

`fp8_grouped_linear` is the same for a weight with a scale per output channel per group of
inputs (a Hugging Face fp8 checkpoint's 128 x 128 blocks, each block's scale given to its
rows): W8A16 up to `W8A16_MAX_M` rows, the scale applied to each K-tile's products; above,
the activations quantized per token per group (DeepSeek-V3's 1 x 128) and a Triton GEMM
that scales each K-tile's float8 product by both operands' scales. Why not cuBLAS' block-
scaled GEMM (`F.scaled_mm`, `BlockWise1x128` x `BlockWise128x128`): probed on the H200 (torch
2.11), it took 45 us for a 4096 x 4096 weight at 512 rows where bfloat16 took 27, and it
needs the 128 x 128 scale layout, which q/k/v packing breaks where a part's rows are not a
multiple of 128.
"""

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max          # 448
# Smallest scale: an all-zero row (CUDA-graph padding, a zero weight row) quantizes to zeros
# instead of dividing by zero. vLLM uses the same floor for its dynamic scales.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# cuBLAS' FP8 GEMM needs K and N to be multiples of 16; other shapes take the emulation.
SCALED_MM_ALIGNMENT = 16
# Up to this many rows `fp8_linear` runs W8A16 on CUDA: measured on an H200 for the
# Llama-3.1-8B decoder linears (bench/quant_linears.py, all 128 of a token step), W8A16 takes
# 3.8 ms at 32 rows against W8A8's 4.4, 4.7 ms at 48 against 4.2.
W8A16_MAX_M = 32
W8A16_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x [R, C]` scaled by its own amax / 448: (float8 [R, C], fp32 scale [R, 1])."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    # Clamped before the cast: float8_e4m3fn has no infinity, an out-of-range value becomes NaN.
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@dataclass(frozen=True)
class Fp8Activation:
    """Activations quantized per token for a W8A8 linear, by the kernel that computed them:
    what `per_token_quant` would make of the `dtype` tensor it stands for (`values` float8
    `[M, K]`, `scale` fp32 `[M, 1]`). `fp8_linear` multiplies it as it is."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor) -> "Fp8Activation":
        """`x` quantized per token (`x [..., K]`: values keep its shape)."""
        q, scale = per_token_quant(x.reshape(-1, x.shape[-1]))
        return cls(q.view(x.shape), scale, x.dtype)


def w8a8_applies(rows: int, dtype: torch.dtype, device: torch.device, weight: torch.Tensor) -> bool:
    """Whether `fp8_linear` of `rows` activations of `dtype` on `device` with this float8
    `weight [N, K]` quantizes them per token for cuBLAS' FP8 GEMM (so it would take them
    quantized already: `Fp8Activation`). Shapes only: no host sync."""
    n, k = weight.shape
    if device.type != "cuda" or rows == 0 or n % SCALED_MM_ALIGNMENT or k % SCALED_MM_ALIGNMENT:
        return False
    return not _w8a16_applies(rows, dtype, weight)


def _w8a16_applies(rows: int, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    return rows <= W8A16_MAX_M and dtype in W8A16_DTYPES and weight.stride(-1) == 1


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


def group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [R, C]` to (float8 `[R, C]`, fp32 scale `[R, ceil(C / group)]`): each row's runs of
    `group` columns scaled by their own amax / 448 (the last run may be shorter). The
    activations of a grouped linear (DeepSeek-V3's 1 x 128 blocks), and a high-precision
    weight given that linear's layout."""
    r, c = x.shape
    groups = -(-c // group)
    runs = torch.nn.functional.pad(x.float(), (0, groups * group - c)).view(r, groups, group)
    scale = (runs.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (runs / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(r, groups * group)[:, :c], scale


def fp8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W8A8 with a scale per output channel per `group` inputs (`weight_scale [N, ceil(K /
    group)]`) and `x` quantized per token per `group` inputs: `sum over groups g of
    (x_q[:, g] @ w_q[:, g].T) * sx[:, g] * sw[:, g]`, emulated in fp32."""
    out_dtype = out_dtype or x.dtype
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    x_q, x_scale = group_quant(x2, group)
    out = dequantize_blocks(x_q, x_scale, (1, group)) @ dequantize_blocks(weight, weight_scale, (1, group)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_grouped_weight_only_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                                ) -> torch.Tensor:
    """W8A16 of a grouped weight: `x` as it is, the weight dequantized to fp32, one rounding."""
    full = dequantize_blocks(weight, weight_scale, (1, group))
    return fp8_weight_only_ref(x, full, torch.ones(full.shape[0], device=full.device), bias, out_dtype or x.dtype)


def fp8_linear_ref(x: "torch.Tensor | Fp8Activation", weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x [..., K] @ (weight [N, K] * weight_scale [N]).T + bias` with `x` quantized per token
    (here, or as it comes: `Fp8Activation`).

    The products of the quantized values are summed in fp32 and scaled afterwards, as the FP8
    GEMM does: `(x_q * sa) @ (w_q * sb).T == (x_q @ w_q.T) * sa * sb.T`.
    """
    if isinstance(x, Fp8Activation):
        lead, x_q, x_scale = x.values.shape[:-1], x.values.reshape(-1, weight.shape[1]), x.scale
    else:
        lead, (x_q, x_scale) = x.shape[:-1], per_token_quant_ref(x.reshape(-1, x.shape[-1]))
    out_dtype = out_dtype or x.dtype
    out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.float().view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).view(*lead, weight.shape[0])


def fp8_weight_only_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
    """W8A16: `x [..., K] @ (weight [N, K] * weight_scale [N]).T + bias` with `x` as it is:
    the weight dequantized to fp32, an fp32 matmul, one rounding to `out_dtype`."""
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, x.shape[-1]).float()
    out = x2 @ (weight.float() * weight_scale.float().view(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: "torch.Tensor | Fp8Activation", weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8-weight linear: `weight` float8 `[N, K]` row-major (so `weight.t()` is the
    column-major operand `_scaled_mm` needs), `weight_scale` fp32 `[N]`; output in
    `out_dtype` (default: `x`'s). On CUDA, W8A16 for up to `W8A16_MAX_M` rows (meaning:
    `fp8_weight_only_ref`), W8A8 above (meaning: `fp8_linear_ref`); see the module
    docstring. The choice depends on the shape alone (no host sync). `x` may come quantized
    (`Fp8Activation`, where `w8a8_applies`): the W8A8 product without quantizing it again."""
    if isinstance(x, Fp8Activation):
        return fp8_linear_w8a8(x, weight, weight_scale, bias, out_dtype)
    n, k = weight.shape
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, weight_scale, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:    # older torch's rowwise kernel refuses M=0 (a shape: no host sync)
        return x.new_empty(*x.shape[:-1], n, dtype=out_dtype)
    if _w8a16_applies(m, x.dtype, weight):
        from kernels.triton_fp8 import fp8_weight_only_triton   # Triton only where it runs
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = fp8_weight_only_triton(x2, weight, weight_scale.reshape(-1),
                                     None if bias is None else bias.reshape(-1), out_dtype)
        return out.view(*x.shape[:-1], n)
    return fp8_linear_w8a8(x, weight, weight_scale, bias, out_dtype)


def fp8_linear_w8a8(x: "torch.Tensor | Fp8Activation", weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                    ) -> torch.Tensor:
    """`fp8_linear`'s large-M path at any M: per-token quantization (unless `x` comes
    quantized) and `_scaled_mm` on CUDA (the reference where cuBLAS cannot take the shape or
    the device is not CUDA)."""
    n, k = weight.shape
    values = x.values if isinstance(x, Fp8Activation) else x
    if not values.is_cuda or n % SCALED_MM_ALIGNMENT or k % SCALED_MM_ALIGNMENT:
        return fp8_linear_ref(x, weight, weight_scale, bias, out_dtype)
    out_dtype = out_dtype or x.dtype
    lead = values.shape[:-1]
    if values.numel() == 0:    # older torch's rowwise kernel refuses M=0 (a shape: no host sync)
        return values.new_empty(*lead, n, dtype=out_dtype)
    if isinstance(x, Fp8Activation):
        x_q, x_scale = values.reshape(-1, k), x.scale
    else:
        x_q, x_scale = per_token_quant(values.reshape(-1, k))
    # bfloat16 is the one output every torch version and GPU gives rowwise scaling (fp16 and
    # fp32 only some: fp32 needs cuBLAS >= 12.9 on sm90); another dtype is cast from it.
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.view(*lead, n)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8-weight linear with a scale per output channel per `group` inputs (a Hugging Face
    fp8 checkpoint's 128 x 128 blocks, each block's scale given to its rows): `weight` float8
    `[N, K]` row-major, `weight_scale` fp32 `[N, ceil(K / group)]`. On CUDA (`group` a
    multiple of 16), up to `W8A16_MAX_M` rows W8A16 (meaning: `fp8_grouped_weight_only_ref`),
    above it the activations quantized per token per group and a Triton block-scaled GEMM
    (meaning: `fp8_grouped_linear_ref`); on the CPU the reference W8A8 at every M. The choice
    depends on the shape alone (no host sync)."""
    n, k = weight.shape
    if not x.is_cuda:
        return fp8_grouped_linear_ref(x, weight, weight_scale, group, bias, out_dtype)
    from kernels.triton_fp8 import fp8_grouped_gemm_triton, fp8_weight_only_triton, per_token_group_quant_triton
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.reshape(-1)
    if x2.shape[0] <= W8A16_MAX_M and x.dtype in W8A16_DTYPES:
        out = fp8_weight_only_triton(x2, weight, weight_scale, b, out_dtype, group=group)
    else:
        x_q, x_scale = per_token_group_quant_triton(x2, group, FP8_DTYPE, FP8_MAX, MIN_SCALE)
        out = fp8_grouped_gemm_triton(x_q, x_scale, weight, weight_scale, group, b, out_dtype)
    return out.view(*x.shape[:-1], n)
