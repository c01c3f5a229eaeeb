"""Triton batched multi-LoRA shrink and expand (meaning: `lora.lora_shrink_ref`,
`lora.lora_expand_ref`; layout: the `kernels.lora` docstring).

Both kernels tile tokens x outputs and take their products on the tensor cores, so a
prefill chunk on one adapter is a GEMM, not a GEMV per token. Tokens of a tile may carry
different adapter slots: a program loads its tile's slots, bounds a loop over slots by
their smallest and largest valid value, skips the slots no token of the tile carries, and
for each slot present takes the dot product of the tile's rows with that slot's weights,
the rows of other slots loaded as zeros. Every row belongs to one slot, so the products of
all passes add up in one accumulator, and the work grows with the number of distinct
adapters in a tile, not with the number of slots. Slot -1 (no adapter), and any slot past
the last one, is a row no pass loads.

* shrink, `[T, in] -> [T, P*R]` float32: K = `in` is long and N = P*R short, so when the
  token and output tiles alone make too few programs (decodes) K is split into ranges
  added by `triton_split_k.split_k_reduce`, in fixed order. Rows of slot -1 are stored
  as zeros.
* expand, `y [T, out] += shrunk @ b[slot]^T` per piece: output column o of piece p reads
  shrunk columns p*R .. p*R + R - 1, which one dot cannot gather per column; so each
  program takes one dot per piece that overlaps its columns (a tile straddling a piece
  boundary takes two), the columns of other pieces loaded as zeros. The pieces' bounds
  are scalar arguments (P <= 3), so nothing is copied to the device per call. Rows of
  slot -1 and columns outside every piece are neither loaded nor stored.
* folded expand: when the base GEMM computed every slot's shrink beside its own outputs
  (`worker.lora`), the same kernel reads each token's shrink at its slot's offset in that
  wider output and writes base + delta to a new tensor, every element of it.

Accumulation is in float32. The launch grid and the arguments depend on shapes and on
`pieces` only, nothing reads back to the host: both are CUDA-graph capturable (warm each
class of T up once outside the capture, as Triton compiles on first use) and a replay
honours new slot values. T is a run-time argument Triton does not specialise on, so a new
batch size compiles nothing new within its tile class.

Tile shapes are first choices for the tensor cores, not tuned on a GPU yet. At batch 1 the
cost is the launches' fixed latency, not bytes (about 30 us a Llama-3.1-8B layer for its
eight launches on an H200): that is why the shrink folds into the base GEMM where it can; a
fused shrink + expand kernel for small batches was tried and measured slower (37 us a layer),
so it is not kept (docs/BENCHMARKS.md).
"""

import torch
import triton
import triton.language as tl

from .triton_split_k import TileConfig, pick_split, split_k_counters, split_k_reduce

_MAX_PIECES = 3
# The expand's rank tile: the dot's least K. Wider ones spill registers at 64 x 128 output
# tiles (ptxas for sm_90), and the expand is bound by its reads and writes of y, not by
# the dots.
_BLOCK_R = 16


@triton.jit
def _tile_slots(slots, offs_t, T, S, stride_slot):
    """The tile's slots as int32 (-1 for rows past T and slots outside 0..S-1) and the
    range `lo .. hi` of the valid ones (empty when there are none)."""
    slot = tl.load(slots + offs_t * stride_slot, mask=offs_t < T, other=-1).to(tl.int32)
    slot = tl.where((slot >= 0) & (slot < S), slot, -1)
    lo = tl.min(tl.where(slot >= 0, slot, S), axis=0)
    hi = tl.max(slot, axis=0)
    return slot, lo, hi


@triton.jit(do_not_specialize=["T", "tiles_per_split"])
def _shrink_kernel(out, partial, counters, x, a, slots, T, N, K, S, tiles_per_split,
                   stride_slot, stride_xt, stride_xk, stride_as, stride_an, stride_ak,
                   stride_ot, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[t, n] = sum_k x[t, k] * a[slot[t], n, k] over this program's K range."""
    pid_t, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok, n_ok = offs_t < T, offs_n < N
    slot, lo, hi = _tile_slots(slots, offs_t, T, S, stride_slot)
    # Row offsets in int64: T * stride_xt and S * stride_as can pass 2**31 at the largest
    # shapes.
    x_rows = x + offs_t.to(tl.int64)[:, None] * stride_xt
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))

    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for i in range(hi - lo + 1):
        s = lo + i  # a tensor in the interpreter too, whose range counts in python ints
        rows = slot == s
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            a_cols = a + s.to(tl.int64) * stride_as + offs_n.to(tl.int64)[None, :] * stride_an
            for tile in range(first, last):
                offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                # Rows of other slots load as zeros: their products add nothing to acc.
                xt = tl.load(x_rows + offs_k[None, :] * stride_xk,
                             mask=rows[:, None] & k_ok[None, :], other=0.0)
                at = tl.load(a_cols + offs_k[:, None] * stride_ak,
                             mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc += tl.dot(xt, at, input_precision=DOT_PRECISION)

    mask = t_ok[:, None] & n_ok[None, :]
    out_ptrs = out + offs_t.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    if SPLIT:
        total, is_last = split_k_reduce(acc, partial, counters,
                                        pid_n * tl.num_programs(0) + pid_t, pid_k,
                                        tl.num_programs(2), offs_t, offs_n, mask, T, N)
        if is_last:
            tl.store(out_ptrs, total, mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


@triton.jit
def _expand_piece(acc, shrunk_rows, b_slot, rows, offs_n, n_start, start, end, piece, R,
                  stride_sr, stride_bo, stride_br, BLOCK_N: tl.constexpr,
                  BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += shrunk[rows, piece*R : piece*R + R] @ b[slot, cols of the piece, :]^T, where
    this tile's columns `n_start ..` overlap the piece's `start .. end - 1`."""
    if (start < n_start + BLOCK_N) & (end > n_start):
        cols = (offs_n >= start) & (offs_n < end)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            st = tl.load(shrunk_rows + (piece * R + offs_r)[None, :] * stride_sr,
                         mask=rows[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
            # Columns of other pieces load as zeros: they take their piece's own pass.
            bt = tl.load(b_slot + offs_n.to(tl.int64)[None, :] * stride_bo
                         + offs_r[:, None] * stride_br,
                         mask=r_ok[:, None] & cols[None, :], other=0.0)
            acc += tl.dot(st, bt.to(tl.float32), input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["T", "start0", "end0", "start1", "end1", "start2", "end2"])
def _expand_kernel(out, y, shrunk, b, slots, T, N, R, S, start0, end0, start1, end1, start2, end2,
                   stride_slot, stride_ot, stride_oo, stride_yt, stride_yo, stride_st, stride_ss,
                   stride_sr, stride_bs, stride_bo, stride_br, NUM_PIECES: tl.constexpr,
                   STORE_ALL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[t, o] = y[t, o] + sum_j shrunk[t, slot[t], p(o)*R + j] * b[slot[t], o, j] for o
    in a piece (`stride_ss` 0: one shrunk row a token). STORE_ALL: every element of `out`
    is written (a new tensor); else only those an adapter changes (`out` is `y`)."""
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    n_start = pid_n * BLOCK_N
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    slot, lo, hi = _tile_slots(slots, offs_t, T, S, stride_slot)
    shrunk_rows = shrunk + offs_t.to(tl.int64)[:, None] * stride_st

    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for i in range(hi - lo + 1):
        s = lo + i  # a tensor in the interpreter too, whose range counts in python ints
        rows = slot == s
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            b_slot = b + s.to(tl.int64) * stride_bs
            shrunk_slot = shrunk_rows + s.to(tl.int64) * stride_ss
            acc = _expand_piece(acc, shrunk_slot, b_slot, rows, offs_n, n_start, start0, end0,
                                0, R, stride_sr, stride_bo, stride_br, BLOCK_N, BLOCK_R,
                                DOT_PRECISION)
            if NUM_PIECES > 1:
                acc = _expand_piece(acc, shrunk_slot, b_slot, rows, offs_n, n_start, start1,
                                    end1, 1, R, stride_sr, stride_bo, stride_br, BLOCK_N,
                                    BLOCK_R, DOT_PRECISION)
            if NUM_PIECES > 2:
                acc = _expand_piece(acc, shrunk_slot, b_slot, rows, offs_n, n_start, start2,
                                    end2, 2, R, stride_sr, stride_bo, stride_br, BLOCK_N,
                                    BLOCK_R, DOT_PRECISION)

    # Unused pieces have empty bounds (0, 0), so they add no column.
    in_piece = (((offs_n >= start0) & (offs_n < end0)) | ((offs_n >= start1) & (offs_n < end1))
                | ((offs_n >= start2) & (offs_n < end2)))
    if STORE_ALL:
        mask = (offs_t < T)[:, None] & (offs_n < N)[None, :]
    else:
        mask = (slot >= 0)[:, None] & (in_piece & (offs_n < N))[None, :]
    rows64 = offs_t.to(tl.int64)[:, None]
    base = tl.load(y + rows64 * stride_yt + offs_n[None, :] * stride_yo, mask=mask, other=0.0)
    # The reference rounds the delta to y's dtype before it adds it: so does this (rows and
    # columns no adapter touches add an exact zero).
    delta = acc.to(y.dtype.element_ty)
    tl.store(out + rows64 * stride_ot + offs_n[None, :] * stride_oo,
             (base.to(tl.float32) + delta.to(tl.float32)).to(y.dtype.element_ty), mask=mask)


def _block_t(num_tokens: int) -> int:
    """Token tile: 16 rows (the tensor cores' least) for decodes, 64 for prefill chunks."""
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64


def _num_warps(block_t: int) -> int:
    # 64-row tiles need 8 warps to stay within 255 registers a thread, unspilled.
    return 8 if block_t == 64 else 4


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 as three TF32 products (about fp32 accuracy on tensor cores); the 16-bit inputs of
    # the shrink are exact on the tensor cores anyway, and the expand's float32 `shrunk` as
    # TF32 errs well below the 16-bit rounding of its result.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def pick_shrink_config(num_tokens: int, n: int, k: int, dtype: torch.dtype,
                       device: torch.device) -> TileConfig:
    """Tiles of the shrink (`block_m`: tokens); a function of python ints only. K is split
    until there are about two programs per SM, as decodes give a few token tiles only."""
    wide = dtype == torch.float32  # twice the bytes per tile element: a shorter K tile
    block_t = _block_t(num_tokens)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(32 if wide else 64, max(16, triton.next_power_of_2(k)))
    programs = triton.cdiv(num_tokens, block_t) * triton.cdiv(n, block_n)
    split_k = pick_split(triton.cdiv(k, block_k), programs, device, per_sm=2)
    return TileConfig(block_t, block_n, block_k, split_k, num_warps=_num_warps(block_t))


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same arguments and result as `lora_shrink_ref`: `[T, P*R]` float32."""
    num_tokens, k = x.shape
    num_slots, n, _ = a.shape
    assert a.shape[2] == k, f"x has {k} features, the A weights {a.shape[2]}"
    assert a.dtype == x.dtype, f"x is {x.dtype}, the A weights {a.dtype}"
    assert slots.shape == (num_tokens,)
    out = torch.empty((num_tokens, n), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or n == 0:
        return out
    cfg = pick_shrink_config(num_tokens, n, k, x.dtype, x.device)
    tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(tiles, cfg.split_k)
    split_k = triton.cdiv(tiles, tiles_per_split)  # no split left without a tile
    grid = (triton.cdiv(num_tokens, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    partial = counters = out  # placeholders: unused without a split
    if split_k > 1:
        partial = torch.empty((split_k, num_tokens, n), dtype=torch.float32, device=x.device)
        counters = split_k_counters(x.device, grid[0] * grid[1])
    _shrink_kernel[grid](
        out, partial, counters, x, a, slots, num_tokens, n, k, num_slots, tiles_per_split,
        slots.stride(0), x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        out.stride(0), SPLIT=split_k > 1, BLOCK_T=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION=_dot_precision(x.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def lora_expand_triton(y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor,
                       slots: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """Same arguments and result as `lora_expand_ref`: adds into `y` in place, returns it."""
    assert shrunk.shape == (y.shape[0], len(pieces) * b.shape[2]), "shrunk is not [T, P*R]"
    assert shrunk.dtype == torch.float32
    return _expand(y, y, shrunk, 0, b, slots, pieces)


def lora_expand_folded_triton(y_aug: torch.Tensor, out_features: int, b: torch.Tensor,
                              slots: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """Same arguments and result as `lora.lora_expand_folded_ref`: a new `[T, out_features]`."""
    num_slots, _, rank = b.shape
    width = len(pieces) * rank
    assert y_aug.shape[1] == out_features + num_slots * width, "y_aug is not [T, out + S*P*R]"
    out = torch.empty((y_aug.shape[0], out_features), dtype=y_aug.dtype, device=y_aug.device)
    return _expand(out, y_aug[:, :out_features], y_aug[:, out_features:], width, b, slots, pieces)


def _expand(out: torch.Tensor, y: torch.Tensor, shrunk: torch.Tensor, slot_stride: int,
            b: torch.Tensor, slots: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """out = y + each token's delta; `shrunk` holds a row a token, its slot's columns
    starting at slot * `slot_stride`. Writes only what adapters change when `out` is `y`."""
    num_tokens, n = y.shape
    num_slots, _, rank = b.shape
    num_pieces = len(pieces)
    assert 1 <= num_pieces <= _MAX_PIECES, f"{num_pieces} pieces; at most {_MAX_PIECES}"
    assert b.dtype == y.dtype and out.shape == y.shape and out.dtype == y.dtype
    assert slots.shape == (num_tokens,)
    assert all(0 <= start and start + size <= min(n, b.shape[1]) for start, size in pieces)
    store_all = out is not y
    if num_tokens == 0 or (rank == 0 and not store_all):
        return out
    bounds = [(start, start + size) for start, size in pieces]
    bounds += [(0, 0)] * (_MAX_PIECES - num_pieces)
    block_t = _block_t(num_tokens)
    # Decodes: narrower column tiles make more programs of the few token tiles.
    block_n = 64 if num_tokens <= 16 or y.dtype == torch.float32 else 128
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))
    _expand_kernel[grid](
        out, y, shrunk, b, slots, num_tokens, n, rank, num_slots,
        *(v for be in bounds for v in be), slots.stride(0), out.stride(0), out.stride(1),
        y.stride(0), y.stride(1), shrunk.stride(0), slot_stride, shrunk.stride(1),
        b.stride(0), b.stride(1), b.stride(2), NUM_PIECES=num_pieces, STORE_ALL=store_all,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=_BLOCK_R,
        DOT_PRECISION=_dot_precision(y.dtype), num_warps=_num_warps(block_t))
    return out
