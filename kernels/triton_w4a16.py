"""Triton W4A16 GEMM (meaning: `w4a16.w4a16_matmul_ref`; layout: `w4a16.W4Weight`).

One kernel, `y[m, n] = sum_k x[m, perm[k]] * W'[k, n]` with `W'` the packed rows, tiled
over (M, N) and optionally split along K:

* Each program walks its K-tiles: it loads an activation tile (gathered through `perm`
  under act-order), the int32 words holding the weight tile (each word read by the 8 rows
  it packs; the repeats hit the cache), shifts out each row's nibble, subtracts the zero
  point and takes the tile's dot product with these exact small integers. A K-tile never
  straddles a group (`BLOCK_K` divides the group size, or the weight is one group), so the
  tile's scales are one row, applied to the dot product's result.
* Small M (decodes): a 16-row tile, and K split into `split_k` ranges so that a matrix
  with few column tiles still fills the SMs; the programs write float32 partial sums that
  are added up afterwards (in a fixed order: the result does not depend on timing).
* Large M (prefill): bigger tiles, no split.

K need not be a multiple of `BLOCK_K` (the last tile is masked) nor N of `BLOCK_N`. M is a
run-time argument Triton does not specialise on, so a new batch size compiles nothing.
The tile shapes are untuned first choices (see `pick_config`).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .w4a16 import W4Weight

# Splitting K pays until about two programs per SM are in flight; below a few K-tiles per
# split, the partial sums cost more than the parallelism brings.
_PROGRAMS_PER_SM = 2
_MIN_TILES_PER_SPLIT = 4
_DECODE_MAX_M = 16


@dataclass(frozen=True)
class W4A16Config:
    """Tile shapes and launch parameters of one call (see `pick_config`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _w4a16_kernel(out, partial, x, qweight, scales, zeros, perm, M, N, K, group_size,
                  tiles_per_split, stride_xm, stride_xk, stride_om, stride_qk, stride_sg,
                  stride_zg, HAS_PERM: tl.constexpr, SPLIT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    # Row offsets in int64: M * stride_xm can pass 2**31 for long prefills of wide layers.
    x_rows = x + offs_m.to(tl.int64)[:, None] * stride_xm

    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first, last):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_PERM:
            src_k = tl.load(perm + offs_k, mask=k_ok, other=0)
        else:
            src_k = offs_k
        a = tl.load(x_rows + src_k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        words = tl.load(qweight + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :],
                        mask=k_ok[:, None] & n_ok[None, :], other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        group = (tile * BLOCK_K) // group_size
        z = tl.load(zeros + group * stride_zg + offs_n, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(scales + group * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        # q - z lies in -16..15: exact in every activation dtype. Rows past K multiply
        # activations loaded as 0.
        b = (q - z[None, :]).to(a.dtype)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION) * s[None, :]

    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        rows = pid_k * M + offs_m.to(tl.int64)
        tl.store(partial + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(out.dtype.element_ty), mask=mask)


_num_sms_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the CPU interpreter: few enough that the tests' small matrices split K
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms_cache:
        _num_sms_cache[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms_cache[index]


def _block_k(w: W4Weight, cap: int) -> int:
    """The largest power of two up to `cap` that keeps K-tiles within one group."""
    if w.num_groups == 1:
        return min(cap, max(16, triton.next_power_of_2(w.in_features)))
    lowest_bit = w.group_size & -w.group_size
    if lowest_bit < 16:
        raise ValueError(f"group size {w.group_size} must be a multiple of 16")
    return min(cap, lowest_bit)


def pick_config(m: int, w: W4Weight, dtype: torch.dtype, device: torch.device) -> W4A16Config:
    """Tiles for an `[m, K] @ [K, N]` product; a function of python ints only."""
    wide = dtype == torch.float32  # twice the bytes per tile element: smaller tiles
    if m <= _DECODE_MAX_M:
        block_n, block_k = 64, _block_k(w, 128)
        tiles = triton.cdiv(w.in_features, block_k)
        programs = triton.cdiv(w.out_features, block_n)
        wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), programs)
        split_k = max(1, min(wanted, tiles // _MIN_TILES_PER_SPLIT))
        return W4A16Config(16, block_n, block_k, split_k)
    block_m = 64 if m <= 64 or wide else 128
    block_n = 64 if wide else 128
    return W4A16Config(block_m, block_n, _block_k(w, 64), num_warps=8 if block_m == 128 else 4,
                       num_stages=2 if wide else 3)


def w4a16_matmul_triton(x: torch.Tensor, w: W4Weight,
                        config: W4A16Config | None = None) -> torch.Tensor:
    """Same arguments and result as `w4a16_matmul_ref`; `config` overrides `pick_config`."""
    k, n = w.in_features, w.out_features
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    assert w.qweight.stride(1) == w.scales.stride(1) == w.zeros.stride(1) == 1
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or pick_config(m, w, x.dtype, x.device)
    assert w.num_groups == 1 or w.group_size % cfg.block_k == 0, "a K-tile straddles groups"
    tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(tiles, cfg.split_k)
    split_k = triton.cdiv(tiles, tiles_per_split)  # no split left without a tile
    partial = out  # a placeholder: unused without a split
    if split_k > 1:
        partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    # fp32 as three TF32 products (about fp32 accuracy on tensor cores); the 16-bit types
    # are exact inputs to the tensor cores anyway.
    dot_precision = "tf32x3" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    _w4a16_kernel[grid](
        out, partial, x2, w.qweight, w.scales, w.zeros, w.perm if w.perm is not None else x2,
        m, n, k, w.group_size, tiles_per_split, x2.stride(0), x2.stride(1), out.stride(0),
        w.qweight.stride(0), w.scales.stride(0), w.zeros.stride(0),
        HAS_PERM=w.perm is not None, SPLIT=split_k > 1, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=dot_precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split_k > 1:
        out.copy_(partial.sum(0))
    return out.view(*x.shape[:-1], n)
