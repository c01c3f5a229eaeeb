"""Triton W4A16 GEMM (meaning: `w4a16.w4a16_matmul_ref`; layout: `w4_weight.W4Weight`).

One kernel, `y[m, n] = sum_k x[m, perm[k]] * W'[k, n]` with `W'` the packed rows, tiled
over (M, N) and optionally split along K. Each program walks its K-tiles; per tile it loads
the `BLOCK_K // 8` int32 words of each column once (one load of `[BLOCK_K // 8, BLOCK_N]`,
coalesced along N) and expands the nibbles in registers, with no integer-to-float
conversion (a quarter-rate instruction; at small M the unpacking, not the tensor cores or
the memory, is what limits): a nibble q OR-ed into a float's mantissa is an exact float of
q. A K-tile holds whole groups or lies within one: `BLOCK_K` divides the group size, or the
weight is one group, and the tile's zero points, scales and offsets (`W4Weight.offsets`,
where the format has them) are one row each; or the group size is a power of two below
`BLOCK_K` (GGUF's 32 and 16), and the tile loads one row per group it spans (small groups
would otherwise make short tiles: a group-32 weight ran at 0.4-0.6 of group 128's speed).
Two modes (`MODE`):

* "dot" (M > 1): word row r becomes the packed rows 8r..8r+7 (`0x4B000000 | q` is the float
  2**23 + q; minus 2**23 + z gives the exact integer q - z, exact in every activation dtype),
  the activation tile (gathered through `perm` under act-order) takes its dot product with
  these integers on the tensor cores, and the tile's scales multiply the result.
* "fma" (M == 1, batch-1 decode: `BLOCK_M` 1): no tensor cores, whose 16-row minimum would
  waste the unpacking on padding. Nibble j is moved under the exponent of 1.0 (the float
  1 + q / 16: one shift and one and-or), multiplied into x on the FMA units (three
  instructions per weight), and the zero point applied per tile through the sum of x:
  `sum (q - z) x = 16 sum (1 + q / 16) x - (16 + z) sum x`. The next tile's words, zero
  points and scales are loaded before this tile's arithmetic (register prefetch).

K is split into `split_k` ranges when the columns alone give too few programs to keep
enough loads and arithmetic in flight (decodes: about 6 programs per SM). Split programs
write float32 partial sums; the last program of each output tile to finish (counted with an
atomic) adds them up in split order 0, 1, ... and writes the result, so the result does not
depend on timing and no second kernel is launched. The per-tile counters live in one buffer
per device, reset to zero by that last program (see `split_k_counters` for what may share
it).

Past 64 rows (prefill chunks, large batches) the weight is instead dequantized once into
the activations' dtype (`w4_dequantize_triton`, one pass at memory speed) and multiplied by
cuBLAS: the tensor-core tiles expand each weight once per 64-row tile of M, and ran 3x slower
than bf16 at 256 rows (docs/BENCHMARKS.md). The dequantized weight is a temporary of K x N
elements (235 MB for the 8B gate_up in bf16), which the worker's memory profile, a forward
at the full step token budget, counts.

K need not be a multiple of `BLOCK_K` (the last tile is masked) nor N of `BLOCK_N`. M is a
run-time argument Triton does not specialise on (nor `tiles_per_split`), so a new batch size
compiles nothing new within its class of M: the constexprs are the mode and tile shapes
(`pick_config` chooses them from three classes of M: 1, 2..16, 17..64), `HAS_PERM`,
`SPLIT` and the dot precision. Nothing reads back to the host: the kernel is CUDA-graph
capturable (warm each class up once outside the capture, as Triton compiles on first use).

Tuned on one H200 (132 SMs) for the Llama-3.1-8B decoder shapes, group 128, bf16 (`python
bench/quant_linears.py --sweep`; docs/BENCHMARKS.md).
"""

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enabled, wait_for_predecessor
from .triton_split_k import TileConfig, pick_split, split_k_counters, split_k_reduce
from .w4_weight import W4Weight

_DECODE_MAX_M = 16
_MID_MAX_M = 64


@triton.jit
def _expand(words, shifts, z):
    """int32 words [.., W, ..] with `shifts` broadcast along a new axis of 8 to the exact
    floats q - z: nibble q OR-ed into the mantissa of 2**23 (`0x4B000000 | q` is the float
    2**23 + q), minus 2**23 + z. The arithmetic shift copies the sign into the top bits,
    which the mask drops."""
    bits = ((words >> shifts) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - (z + 8388608.0)


@triton.jit
def _per_word_row(t, TILE_GROUPS: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[TILE_GROUPS, BLOCK_N] -> each word row's [WORDS, BLOCK_N] (a word's 8 rows lie in one
    group: groups are multiples of 16 rows); for one group, [BLOCK_N] as loaded."""
    if TILE_GROUPS == 1:
        rows = t
    else:
        rows = tl.reshape(tl.broadcast_to(t[:, None, :], (TILE_GROUPS, WORDS // TILE_GROUPS, BLOCK_N)),
                          (WORDS, BLOCK_N))
    return rows


@triton.jit
def _w4_tile(qweight, zeros, scales, offsets, tile, offs_w, offs_n, n_ok, w_limit, max_group,
             group_size, stride_qk, stride_sg, stride_zg, stride_og, WORDS: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr,
             HAS_OFFSET: tl.constexpr):
    """K-tile `tile`'s words [WORDS, BLOCK_N] (word rows from `w_limit` on read as 0) and
    its groups' zero points, scales and offsets (0 without) as float32 for each word row
    (`_per_word_row`). Group indices are clamped, so the tile after a split's last one can be
    asked for (its words are all masked), and rows past K read the last group's (they
    multiply activations loaded as 0)."""
    word_rows = tile * WORDS + offs_w
    words = tl.load(qweight + word_rows[:, None] * stride_qk + offs_n[None, :],
                    mask=(word_rows < w_limit)[:, None] & n_ok[None, :], other=0)
    if TILE_GROUPS == 1:
        # One row each, kept one-dimensional ([BLOCK_N]): loaded as [1, BLOCK_N], the group-128
        # decode measured 1.8x slower at batch 1.
        rows = tl.minimum((tile * BLOCK_K) // group_size, max_group)
        cols, ok = offs_n, n_ok
    else:
        groups = tl.minimum((tile * BLOCK_K) // group_size + tl.arange(0, TILE_GROUPS), max_group)
        rows, cols, ok = groups[:, None], offs_n[None, :], n_ok[None, :]
    z = tl.load(zeros + rows * stride_zg + cols, mask=ok, other=0).to(tl.float32)
    s = tl.load(scales + rows * stride_sg + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        o = tl.load(offsets + rows * stride_og + cols, mask=ok, other=0.0).to(tl.float32)
    else:
        o = tl.zeros_like(s)
    return (words, _per_word_row(z, TILE_GROUPS, WORDS, BLOCK_N), _per_word_row(s, TILE_GROUPS, WORDS, BLOCK_N),
            _per_word_row(o, TILE_GROUPS, WORDS, BLOCK_N))


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _w4a16_kernel(out, partial, counters, x, qweight, scales, zeros, offsets, perm, M, N, K,
                  group_size, tiles_per_split, stride_xm, stride_xk, stride_om, stride_qk,
                  stride_sg, stride_zg, stride_og, HAS_PERM: tl.constexpr,
                  HAS_OFFSET: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  TILE_GROUPS: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """MODE "dot": acc [M, N] += x [M, K] @ (q - z) [K, N] on the tensor cores, scaled after
    the dot when the tile is one group; a tile of several groups (TILE_GROUPS > 1) has its
    weights dequantized in registers, `(q - z) * s + o`, before one dot. "fma": BLOCK_M == 1,
    no tensor cores: each weight multiplied into the one row of x on the FMA units, three
    instructions per weight (batch-1 decode: 1.4-2x the dot's speed there), each word row
    scaled by its group's scale. Offsets add `offset * sum(x)` over each group's inputs.
    PDL: launched early, waiting for the kernel before (`kernels.pdl`)."""
    wait_for_predecessor(PDL)
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    m_ok, n_ok = offs_m < M, offs_n < N
    # Row offsets in int64: M * stride_xm can pass 2**31 for long prefills of wide layers.
    x_rows = x + offs_m.to(tl.int64) * stride_xm
    shifts = tl.arange(0, 8) * 4
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))

    w_limit = tl.minimum(K // 8, last * WORDS)
    max_group = (K - 1) // group_size
    if MODE == "fma":
        acc2 = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        # Register prefetch: the next K-tile's words, zero points and scales are loaded
        # before this tile's arithmetic, so their latency overlaps it. Measured 5-15 % faster;
        # staging the loads through shared memory instead (`tl.range(num_stages=2..4)`, as
        # the FP8 GEMV does) was 11 % or more slower in every tile (H100, docs/BENCHMARKS.md).
        words, z, s, o = _w4_tile(qweight, zeros, scales, offsets, first, offs_w, offs_n, n_ok,
                                  w_limit, max_group, group_size, stride_qk, stride_sg,
                                  stride_zg, stride_og, WORDS, BLOCK_K, BLOCK_N, TILE_GROUPS, HAS_OFFSET)
        for tile in range(first, last):
            word_rows = tile * WORDS + offs_w
            # K is a multiple of 8: a word row is in range exactly when its 8 rows are.
            w_ok = word_rows < K // 8
            nxt = _w4_tile(qweight, zeros, scales, offsets, tile + 1, offs_w, offs_n, n_ok,
                           w_limit, max_group, group_size, stride_qk, stride_sg, stride_zg,
                           stride_og, WORDS, BLOCK_K, BLOCK_N, TILE_GROUPS, HAS_OFFSET)
            part = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
            x_sum = tl.zeros((WORDS,), dtype=tl.float32)
            for j in tl.static_range(8):
                k_j = word_rows * 8 + j
                if HAS_PERM:
                    k_j = tl.load(perm + k_j, mask=w_ok, other=0)
                a = tl.load(x_rows + k_j * stride_xk, mask=w_ok & m_ok, other=0.0).to(tl.float32)
                # Nibble j moved to mantissa bits 19..22 under the exponent of 1.0: the
                # float 1 + q / 16, exact; one shift and one and-or per weight.
                if 4 * j <= 19:
                    moved = words << (19 - 4 * j)
                else:
                    moved = words >> (4 * j - 19)
                unit = ((moved & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
                part += unit * a[:, None]
                x_sum += a
            # sum_j (q_j - z) a_j = 16 sum_j (1 + q_j / 16) a_j - (16 + z) sum_j a_j: the
            # terms are of the size of the result, so little cancels (error ~1e-7 relative).
            if TILE_GROUPS == 1:        # one row of zero points and scales: [BLOCK_N]
                acc2 += (16.0 * part - (z + 16.0)[None, :] * x_sum[:, None]) * s[None, :]
                if HAS_OFFSET:
                    acc2 += x_sum[:, None] * o[None, :]
            else:                       # one for each word row: [WORDS, BLOCK_N]
                acc2 += (16.0 * part - (z + 16.0) * x_sum[:, None]) * s
                if HAS_OFFSET:
                    acc2 += x_sum[:, None] * o
            words, z, s, o = nxt
        acc = tl.sum(acc2, axis=0)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for tile in range(first, last):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            if HAS_PERM:
                src_k = tl.load(perm + offs_k, mask=k_ok, other=0)
            else:
                src_k = offs_k
            a = tl.load(x_rows[:, None] + src_k[None, :] * stride_xk,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            words, z, s, o = _w4_tile(qweight, zeros, scales, offsets, tile, offs_w, offs_n, n_ok,
                                      w_limit, max_group, group_size, stride_qk, stride_sg,
                                      stride_zg, stride_og, WORDS, BLOCK_K, BLOCK_N, TILE_GROUPS, HAS_OFFSET)
            # [WORDS, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]: row 8r + j is nibble j of word r.
            # q - z in -16..15 is exact in every activation dtype; rows past K multiply
            # activations loaded as 0.
            if TILE_GROUPS == 1:
                b = _expand(words[:, None, :], shifts[None, :, None], z[None, None, :])
                b = tl.reshape(b.to(a.dtype), (BLOCK_K, BLOCK_N))
                acc += tl.dot(a, b, input_precision=DOT_PRECISION) * s[None, :]
                if HAS_OFFSET:
                    acc += tl.sum(a.to(tl.float32), axis=1)[:, None] * o[None, :]
            else:
                b = _expand(words[:, None, :], shifts[None, :, None], z[:, None, :])
                # Each weight rounded to the activations' dtype once, as the reference's
                # dequantized weight is.
                b = b * s[:, None, :]
                if HAS_OFFSET:
                    b += o[:, None, :]
                b = tl.reshape(b.to(a.dtype), (BLOCK_K, BLOCK_N))
                acc += tl.dot(a, b, input_precision=DOT_PRECISION)

    mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SPLIT:
        total, is_last = split_k_reduce(acc, partial, counters,
                                        pid_n * tl.num_programs(0) + pid_m, pid_k,
                                        tl.num_programs(2), offs_m, offs_n, mask, M, N)
        if is_last:
            tl.store(out_ptrs, total.to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _w4_dequantize_kernel(out, qweight, scales, zeros, offsets, N, K, group_size, stride_ok,
                          stride_qk, stride_sg, stride_zg, stride_og, HAS_OFFSET: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr):
    """out [K, N] (packed row order) = (q - z) * s + o, in float32 rounded to out's dtype once,
    as `w4_weight.dequantize_ref` computes it; one [BLOCK_K, BLOCK_N] tile a program."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    words, z, s, o = _w4_tile(qweight, zeros, scales, offsets, pid_k, tl.arange(0, WORDS), offs_n, n_ok,
                              K // 8, (K - 1) // group_size, group_size, stride_qk, stride_sg,
                              stride_zg, stride_og, WORDS, BLOCK_K, BLOCK_N, TILE_GROUPS, HAS_OFFSET)
    shifts = tl.arange(0, 8) * 4
    if TILE_GROUPS == 1:
        w = _expand(words[:, None, :], shifts[None, :, None], z[None, None, :]) * s[None, None, :]
        if HAS_OFFSET:
            w += o[None, None, :]
    else:
        w = _expand(words[:, None, :], shifts[None, :, None], z[:, None, :]) * s[:, None, :]
        if HAS_OFFSET:
            w += o[:, None, :]
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out + offs_k.to(tl.int64)[:, None] * stride_ok + offs_n[None, :],
             tl.reshape(w, (BLOCK_K, BLOCK_N)).to(out.dtype.element_ty),
             mask=(offs_k < K)[:, None] & n_ok[None, :])


def w4_dequantize_triton(w: W4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[K, N]` in `dtype`, rows in packed order (`perm` not undone): the transpose
    of `dequantize_ref` before its permutation."""
    k, n = w.in_features, w.out_features
    out = torch.empty((k, n), dtype=dtype, device=w.qweight.device)
    block_k, block_n = _block_k(w, 64), 128
    offsets = w.offsets
    _w4_dequantize_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        out, w.qweight, w.scales, w.zeros, offsets if offsets is not None else w.scales, n, k,
        w.group_size, out.stride(0), w.qweight.stride(0), w.scales.stride(0), w.zeros.stride(0),
        offsets.stride(0) if offsets is not None else 0, HAS_OFFSET=offsets is not None,
        BLOCK_K=block_k, BLOCK_N=block_n, TILE_GROUPS=tile_groups(w, block_k), num_warps=4)
    return out


def _block_k(w: W4Weight, cap: int, several_groups: bool = True) -> int:
    """`cap` (a power of two) for a one-group weight, or, with `several_groups`, for groups of
    a power of two below it (several groups a tile); else the largest power of two up to
    `cap` that keeps K-tiles within one group."""
    if w.num_groups == 1:
        return min(cap, max(16, triton.next_power_of_2(w.in_features)))
    lowest_bit = w.group_size & -w.group_size
    if lowest_bit < 16:
        raise ValueError(f"group size {w.group_size} must be a multiple of 16")
    return cap if several_groups and lowest_bit == w.group_size else min(cap, lowest_bit)


def tile_groups(w: W4Weight, block_k: int) -> int:
    """Groups one K-tile of `block_k` rows spans (1: within one group)."""
    return block_k // w.group_size if w.num_groups > 1 and block_k > w.group_size else 1


def pick_config(m: int, w: W4Weight, dtype: torch.dtype, device: torch.device) -> TileConfig:
    """Tiles for an `[m, K] @ [K, N]` product; a function of python ints only.

    Measured on one H200 for the Llama-3.1-8B decoder shapes, group 128, bf16
    (`python bench/quant_linears.py --sweep`): one row takes the FMA units ("fma", 128
    columns per program, K split to about 6 programs per SM); up to 16 rows a 16 x 128 tile
    on the tensor cores, split likewise; more rows 64 x 128, split to 1.5 programs per SM
    (past 64 rows `w4a16_matmul_triton` dequantizes instead, unless given a config). Groups
    of 32 (GGUF), same shapes, two runs: the tensor-core tiles take 128 rows, four groups
    (M = 16: 4.35 ms a token step against 7.33 with 32-row tiles); the FMA tile stays within
    its group (3.57 ms against 4.13 with 128 rows)."""
    wide = dtype == torch.float32  # twice the bytes per tile element: smaller tiles
    n, k = w.out_features, w.in_features
    block_k = _block_k(w, 128, several_groups=m > 1)
    if m == 1:
        mode, block_m, block_n, warps, stages, per_sm = "fma", 1, 128, 4, 3, 6
    elif m <= _DECODE_MAX_M:
        mode, block_m, block_n, warps, stages, per_sm = "dot", 16, 64 if wide else 128, 4, 3, 6
    else:
        mode, block_m, block_n, warps, stages, per_sm = "dot", 64, 64 if wide else 128, 4, 3, 1.5
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = pick_split(triton.cdiv(k, block_k), programs, device, per_sm)
    return TileConfig(block_m, block_n, block_k, split_k, warps, stages, mode)


def w4a16_matmul_triton(x: torch.Tensor, w: W4Weight,
                        config: TileConfig | None = None) -> torch.Tensor:
    """Same arguments and result as `w4a16_matmul_ref`; `config` overrides `pick_config`."""
    k, n = w.in_features, w.out_features
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert w.qweight.stride(1) == w.scales.stride(1) == w.zeros.stride(1) == 1
    offsets = w.offsets
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    if config is None and m > _MID_MAX_M:
        x_rows = x2 if w.perm is None else x2.index_select(1, w.perm)
        return torch.mm(x_rows, w4_dequantize_triton(w, x.dtype), out=out).view(*x.shape[:-1], n)
    cfg = config or pick_config(m, w, x.dtype, x.device)
    groups_a_tile = tile_groups(w, cfg.block_k)
    assert w.num_groups == 1 or w.group_size % cfg.block_k == 0 or cfg.block_k == groups_a_tile * w.group_size, \
        "a K-tile straddles groups"
    assert cfg.block_k % 8 == 0 and cfg.block_k >= 16
    assert (cfg.mode == "fma") == (cfg.block_m == 1), "the fma mode is the one-row tile"
    tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(tiles, cfg.split_k)
    split_k = triton.cdiv(tiles, tiles_per_split)  # no split left without a tile
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    partial = counters = out  # placeholders: unused without a split
    if split_k > 1:
        partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        counters = split_k_counters(x.device, grid[0] * grid[1])
    # fp32 as three TF32 products (about fp32 accuracy on tensor cores); the 16-bit types
    # are exact inputs to the tensor cores anyway.
    dot_precision = "tf32x3" if x.dtype == torch.float32 else "tf32"
    pdl = pdl_enabled(x.device)
    _w4a16_kernel[grid](
        out, partial, counters, x2, w.qweight, w.scales, w.zeros,
        offsets if offsets is not None else w.scales, w.perm if w.perm is not None else x2,
        m, n, k, w.group_size, tiles_per_split, x2.stride(0), x2.stride(1), out.stride(0),
        w.qweight.stride(0), w.scales.stride(0), w.zeros.stride(0),
        offsets.stride(0) if offsets is not None else 0,
        HAS_PERM=w.perm is not None, HAS_OFFSET=offsets is not None, SPLIT=split_k > 1, MODE=cfg.mode, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TILE_GROUPS=groups_a_tile, DOT_PRECISION=dot_precision,
        PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    return out.view(*x.shape[:-1], n)
