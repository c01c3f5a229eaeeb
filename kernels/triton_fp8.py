"""Triton kernels of the FP8 linears (`kernels.fp8`).

* `per_token_quant_triton` (meaning: `kernels.fp8.per_token_quant_ref`): one program per
  row: the row's amax, then the row scaled, clamped and cast, in one launch (`quantize_row`,
  which the kernels that make a W8A8 linear's input call to write it quantized). The unfused
  PyTorch form is seven kernels (upcast, abs, amax, divide, clamp, divide, clamp, cast) per
  linear layer: at batch 1 an 8B model runs 128 of them per token, and in a CUDA graph their
  launches alone cost more than the FP8 GEMM saves.
* `fp8_weight_only_triton` (meaning: `kernels.fp8.fp8_weight_only_ref`): the small-M
  (decode) linear, W8A16. The float8 weight `[N, K]` (row-major) is streamed once, each tile
  converted in registers (e4m3 values are exact in bfloat16, float16 and float32) and
  multiplied with the unquantized activations, products summed in fp32; the
  per-output-channel scale (and bias) is applied to the sum. The same kernel, without a
  scale, is the one-row GEMV of the unquantized linears (`kernels.linear`). One row (batch-1 decode,
  MODE "fma", `BLOCK_M` 1) runs on the FMA units, 16 weight rows per program, a
  [BLOCK_N, BLOCK_K] fp32 accumulator summed over K once at the end (the tensor cores'
  16-row minimum would waste the conversion on padding), the K loop's weight tiles staged
  through shared memory (cp.async, `num_stages` deep) to keep enough bytes in flight; 2..32
  rows take the tensor cores (MODE "dot", x @ W^T; "dot_t", W @ x^T, for larger tiles). A
  skinny product is bound by the weight's bytes, so narrow column tiles and, where the columns
  give too few programs, K split into ranges keep enough loads in flight; the split partial
  sums are added by the last program of each output tile
  (`kernels.triton_split_k.split_k_reduce`: fixed order, no second launch). The constexprs are
  the mode and tile shapes (`pick_fp8_config`: classes of M 1, 2..16, 17..32, larger),
  `HAS_BIAS`, `SPLIT` and the dot precision; M and the K range per split are run-time values,
  so a new batch size compiles nothing new within its class, and nothing is read back to the
  host (CUDA-graph capturable once each class has been warmed up outside the capture). With
  `group`, the weight's scales are per output channel per `group` inputs and multiply each
  K-tile's products (K-tiles never straddle a group: `group_block_k`).
* `per_token_group_quant_triton` and `fp8_grouped_gemm_triton` (meaning:
  `kernels.fp8.fp8_grouped_linear_ref`): the large-M grouped linear, W8A8. Activations
  quantized per token per group in one launch; then one tile of the output per program,
  each K-tile's float8 product on the tensor cores scaled by the activation rows' and the
  weight rows' scales of that group.
"""

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_enabled, wait_for_predecessor
from kernels.triton_split_k import TileConfig, pick_split, split_k_counters, split_k_reduce


@triton.jit
def _quantized(v, s, FP8_MAX: tl.constexpr):
    # div_rn: the correctly rounded division the reference does (Triton's `/` on fp32 is an
    # approximation), so both give the same float8 values.
    return tl.minimum(tl.maximum(tl.math.div_rn(v, s), -FP8_MAX), FP8_MAX)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton type of a torch dtype (same name): a kernel that quantizes its result rounds
    it to the activations' type first, as the tensor it stands for would be stored."""
    return getattr(tl, str(dtype).removeprefix("torch."))


@triton.jit
def quantize_row(out_row, scale_ptr, v, cols, mask, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A whole row `v` (fp32 in registers, 0 where masked) quantized as `per_token_quant_ref`
    does: its scale, amax / 448 floored at MIN_SCALE, stored at `scale_ptr`; the float8 values
    at `out_row + cols`. For kernels that compute a W8A8 linear's input (`kernels.triton_norm`,
    `kernels.triton_activation`) and this file's quantization."""
    s = tl.maximum(tl.max(tl.abs(v), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr, s)
    tl.store(out_row + cols, _quantized(v, s, FP8_MAX).to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _per_token_quant_kernel(out, scale, x, stride_x, stride_o, k, FP8_MAX: tl.constexpr,
                            MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:    # the row fits one block: read once, kept in registers
        cols = tl.arange(0, BLOCK)
        v = tl.load(x + row * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
        quantize_row(out + row * stride_o, scale + row, v, cols, cols < k, FP8_MAX, MIN_SCALE)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x + row * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        s = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
        tl.store(scale + row, s)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x + row * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
            tl.store(out + row * stride_o + cols, _quantized(v, s, FP8_MAX).to(out.dtype.element_ty),
                     mask=cols < k)


# Rows up to this long are quantized from registers, read once; longer ones in two passes.
_ONE_PASS_MAX = 16384


def per_token_quant_triton(x: torch.Tensor, dtype: torch.dtype, fp8_max: float, min_scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (row stride free, columns contiguous) to (`dtype` [M, K], fp32 scale [M, 1])
    with the reference's constants."""
    m, k = x.shape
    assert x.stride(-1) == 1
    out = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        one_pass = triton.next_power_of_2(k) <= _ONE_PASS_MAX
        block = triton.next_power_of_2(k) if one_pass else 1024
        _per_token_quant_kernel[(m,)](out, scale, x, x.stride(0), out.stride(0), k, FP8_MAX=fp8_max,
                                      MIN_SCALE=min_scale, BLOCK=block, ONE_PASS=one_pass,
                                      num_warps=min(max(block // 512, 1), 16) if one_pass else 4)
    return out, scale


# ---------------------------------------------------------------- W8A16: small-M linear

@triton.jit
def _group_scales(w_scale, offs_n, n_ok, stride_sn, tile, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The scales of weight rows `offs_n` for K-tile `tile` (which lies in one group)."""
    return tl.load(w_scale + offs_n.to(tl.int64) * stride_sn + (tile * BLOCK_K) // GROUP, mask=n_ok, other=0.0)


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _fp8_weight_only_kernel(out, partial, counters, x, w, w_scale, bias, M, N, K,
                            tiles_per_split, stride_xm, stride_om, stride_wn, stride_sn,
                            HAS_SCALE: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                            SPLIT: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """MODE "dot": acc [M, N] += x [M, K] @ W^T [K, N] on the tensor cores; "dot_t": the same
    product transposed, W [N, K] @ x^T [K, M] (the wide weight tile the left operand);
    "fma": BLOCK_M == 1, no tensor cores: each weight multiplied into the one row of x on the
    FMA units, a [BLOCK_N, BLOCK_K] fp32 accumulator summed over K once at the end.
    GROUP 0: one scale per output channel (`w_scale [N]`), applied to the sum; GROUP > 0: one
    per channel per GROUP inputs (`w_scale [N, ceil(K / GROUP)]`, row stride `stride_sn`),
    applied to each K-tile's products (BLOCK_K divides GROUP, so a tile has one scale a row).
    PDL: launched early, waiting for the kernel before (`kernels.pdl`)."""
    wait_for_predecessor(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x + offs_m.to(tl.int64) * stride_xm
    w_rows = w + offs_n.to(tl.int64) * stride_wn    # row n of W, contiguous along K
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))

    if MODE == "fma":
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # tl.range's num_stages: these loads feed FMAs, not a dot, and Triton's pipeliner
        # stages (cp.async through shared memory) only dot operands unless the loop asks.
        for tile in tl.range(first, last, num_stages=STAGES):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(x_rows + offs_k, mask=k_ok & m_ok, other=0.0)
            b = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            if GROUP > 0:
                b = b * _group_scales(w_scale, offs_n, n_ok, stride_sn, tile, BLOCK_K, GROUP)[:, None]
            acc2 += b * a.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]
    elif MODE == "dot_t":
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for tile in range(first, last):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a_t = tl.load(x_rows[None, :] + offs_k[:, None], mask=k_ok[:, None] & m_ok[None, :],
                          other=0.0)
            b = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if GROUP > 0:
                scales = _group_scales(w_scale, offs_n, n_ok, stride_sn, tile, BLOCK_K, GROUP)
                acc_t += tl.dot(b.to(a_t.dtype), a_t, input_precision=DOT_PRECISION) * scales[:, None]
            else:
                acc_t = tl.dot(b.to(a_t.dtype), a_t, acc_t, input_precision=DOT_PRECISION)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for tile in range(first, last):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(x_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_rows[None, :] + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
            if GROUP > 0:
                scales = _group_scales(w_scale, offs_n, n_ok, stride_sn, tile, BLOCK_K, GROUP)
                acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * scales[None, :]
            else:
                acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)

    mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if HAS_SCALE and GROUP == 0:
        s = tl.load(w_scale + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    else:       # a 16-bit weight, or scales already applied per K-tile
        s = tl.full((BLOCK_N,), 1.0, tl.float32)
    if HAS_BIAS:
        add = tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    else:
        add = tl.zeros_like(s)
    if SPLIT:
        total, is_last = split_k_reduce(acc, partial, counters,
                                        pid_n * tl.num_programs(0) + pid_m, pid_k,
                                        tl.num_programs(2), offs_m, offs_n, mask, M, N)
        if is_last:
            y = total * s[None, :] + add[None, :]
            tl.store(out_ptrs, y.to(out.dtype.element_ty), mask=mask)
    else:
        y = acc * s[None, :] + add[None, :]
        tl.store(out_ptrs, y.to(out.dtype.element_ty), mask=mask)


def group_block_k(group: int) -> int:
    """The K-tile of a grouped weight: the largest power of two dividing `group`, at most 128,
    so that no tile straddles two groups."""
    return min(128, group & -group)


def pick_fp8_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                    weight_bytes: int = 1, group: int = 0) -> TileConfig:
    """Tiles for an `[m, K] @ [N, K].T` weight-only product of a weight of `weight_bytes` per
    entry (scaled per `group` inputs, or 0: per channel); a function of python ints only.

    Measured for the Llama-3.1-8B decoder shapes, bf16 (`python bench/quant_linears.py
    --sweep`): one row takes the FMA units, 16 weight rows a program, K-tiles of 512 staged
    4 deep through shared memory (`num_stages`, the K loop's cp.async pipeline), no split
    (on an H100 the staging made split K slower at every shape, and the float8 kernel 9 %
    faster over a layer than without it); 4 warps for a float8 weight, 8 for a 16-bit one
    (`kernels.linear`). A grouped float8 weight's K-tiles are its group's (`group_block_k`),
    and K is split to 2 programs per SM. Up to 16 rows a 16 x 32 tile on the tensor cores,
    K split to 4 programs per SM (H200); up to 32 rows 32 x 64, 3 per SM; more rows 64 x 64
    (fp8_linear uses this kernel up to `kernels.fp8.W8A16_MAX_M` rows)."""
    wide = dtype == torch.float32
    if m == 1:
        warps = 8 if weight_bytes == 2 else 4
        mode, block_m, block_n, block_k, stages, per_sm = "fma", 1, 16, 512, 4, 2 if group else 0
    elif m <= 16:
        mode, block_m, block_n, block_k, warps, stages, per_sm = "dot", 16, 32, 256, 4, 3, 4
    elif m <= 32:
        mode, block_m, block_n, block_k, warps, stages, per_sm = "dot", 32, 64, 256, 4, 3, 3
    else:
        mode, block_m, block_n, block_k, warps, stages, per_sm = "dot_t", 64, 64, 128, 4, 3, 2
    if wide:
        block_k = min(block_k, 128)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if group:
        block_k = min(block_k, group_block_k(group))
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = pick_split(triton.cdiv(k, block_k), programs, device, per_sm)
    return TileConfig(block_m, block_n, block_k, split_k, warps, stages, mode)


def fp8_weight_only_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                           bias: torch.Tensor | None, out_dtype: torch.dtype,
                           config: TileConfig | None = None, group: int = 0) -> torch.Tensor:
    """`x [M, K] @ (weight [N, K] * weight_scale [N, 1]).T + bias` in `out_dtype`, `x`
    unquantized (bfloat16, float16 or float32; columns contiguous), `weight` row-major: float8
    with its scale, or 16-bit with `weight_scale` None (the one-row GEMV of an unquantized
    linear, `kernels.linear`). With `group` (a multiple of 16), `weight_scale [N, ceil(K /
    group)]` holds a scale per output channel per `group` inputs. `config` overrides
    `pick_fp8_config`."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.stride(1) == 1 and x.stride(1) == 1
    if group:
        assert group % 16 == 0 and weight_scale.shape == (n, triton.cdiv(k, group)) and weight_scale.stride(1) == 1
    else:
        assert weight_scale is None or (weight_scale.numel() == n and weight_scale.is_contiguous())
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or pick_fp8_config(m, n, k, x.dtype, x.device, weight.element_size(), group)
    assert not group or group % cfg.block_k == 0, "a K-tile must lie in one group"
    assert (cfg.mode == "fma") == (cfg.block_m == 1), "the fma mode is the one-row tile"
    tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(tiles, cfg.split_k)
    split_k = triton.cdiv(tiles, tiles_per_split)  # no split left without a tile
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    partial = counters = out  # placeholders: unused without a split
    if split_k > 1:
        partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        counters = split_k_counters(x.device, grid[0] * grid[1])
    if bias is not None:
        assert bias.numel() == n and bias.is_contiguous()
    placeholder = out       # for the pointers the kernel does not read
    pdl = pdl_enabled(x.device)
    _fp8_weight_only_kernel[grid](
        out, partial, counters, x, weight, placeholder if weight_scale is None else weight_scale,
        placeholder if bias is None else bias,
        m, n, k, tiles_per_split, x.stride(0), out.stride(0), weight.stride(0),
        weight_scale.stride(0) if group else 0,
        HAS_SCALE=weight_scale is not None, GROUP=group, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        MODE=cfg.mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32", STAGES=cfg.num_stages, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    return out


# ---------------------------------------------------------------- W8A8 with group scales: large M

@triton.jit
def _per_token_group_quant_kernel(out, scale, x, stride_x, stride_o, stride_s, k, GROUP: tl.constexpr,
                                  BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    ok = (tl.arange(0, BLOCK) < GROUP) & (cols < k)
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(v), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale + row * stride_s + group, s)
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -FP8_MAX), FP8_MAX)     # div_rn: as above
    tl.store(out + row * stride_o + cols, q.to(out.dtype.element_ty), mask=ok)


def per_token_group_quant_triton(x: torch.Tensor, group: int, dtype: torch.dtype, fp8_max: float,
                                 min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (columns contiguous) to (`dtype` [M, K], fp32 scale [M, ceil(K / group)]):
    `kernels.fp8.group_quant` in one launch, a program per row per group."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    out = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _per_token_group_quant_kernel[(m, groups)](out, scale, x, x.stride(0), out.stride(0), scale.stride(0), k,
                                                   GROUP=group, BLOCK=triton.next_power_of_2(group),
                                                   FP8_MAX=fp8_max, MIN_SCALE=min_scale)
    return out, scale


@triton.jit(do_not_specialize=["M"])
def _fp8_grouped_gemm_kernel(out, a, a_scale, b, b_scale, bias, M, N, K,
                             stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
                             GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             UPCAST: tl.constexpr):
    """out [M, N] = sum over K-tiles of (a_q @ b_q^T) * a_scale[:, g] * b_scale[:, g] + bias,
    g the tile's group. Programs walk GROUP_M row tiles down a column of tiles before moving
    on, so a weight tile is read once from memory for several row tiles (from L2 after).
    UPCAST: float8 tiles to float16 for the dot (exact: e4m3 fits in it), where BLOCK_K is
    below the float8 tensor-core instruction's K of 32."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_rows = a + offs_m.to(tl.int64) * stride_am
    b_rows = b + offs_n.to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(a_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(b_rows[None, :] + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        g = (tile * BLOCK_K) // GROUP
        sa = tl.load(a_scale + offs_m.to(tl.int64) * stride_asm + g, mask=m_ok, other=0.0)
        sb = tl.load(b_scale + offs_n.to(tl.int64) * stride_bsn + g, mask=n_ok, other=0.0)
        if UPCAST:
            part = tl.dot(x.to(tl.float16), w.to(tl.float16))
        else:
            part = tl.dot(x, w)
        acc += part * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_grouped_gemm_triton(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                            weight_scale: torch.Tensor, group: int, bias: torch.Tensor | None,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """`x_q [M, K]` float8 with `x_scale [M, ceil(K / group)]` (`per_token_group_quant_triton`)
    times `weight [N, K]` float8 with `weight_scale [N, ceil(K / group)]`, transposed, plus
    `bias`, in `out_dtype` (meaning: `kernels.fp8.fp8_grouped_linear_ref`). Tiles of 64 x 128
    and the group's K-tile (`group_block_k`), 4 warps, 3 stages: the fastest of 16 tile
    shapes swept on the H200 for the 8B q/k/v at 512 and 4096 rows (docs/BENCHMARKS.md),
    which is still slower than cuBLAS' bfloat16 GEMM there."""
    m, k = x_q.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.stride(1) == 1 and x_q.stride(1) == 1
    assert x_scale.stride(1) == 1 and weight_scale.stride(1) == 1
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    block_m, block_n, block_k = 64, 128, group_block_k(group)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_grouped_gemm_kernel[grid](
        out, x_q, x_scale, weight, weight_scale, out if bias is None else bias, m, n, k,
        x_q.stride(0), x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=8, UPCAST=block_k < 32, num_warps=4, num_stages=3)
    return out
