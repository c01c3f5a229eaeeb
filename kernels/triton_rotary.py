"""Triton rotary embedding fused with the KV-pool write (meaning: `apply_rotary_ref`, then
`write_kv_ref` of the rotated keys and the values).

One program per token rotates all of its query heads with one read of the token's cos/sin
row, and its key heads, which go straight to the token's slot in the pool with its values:
the rotated keys never make a round trip through memory, and one launch does what a rotary
kernel and a pool write did.
"""

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE, FP8_MAX
from .pdl import launch_options, pdl_enabled, wait_for_predecessor


@triton.jit
def _rotated_halves(src, stride_src, cos, sin, num_heads,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Both halves of heads `src[h, :]` rotated, rounded to the source's dtype, and the mask."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (i < HALF)
    x1 = tl.load(src + h * stride_src + i, mask=mask).to(tl.float32)
    x2 = tl.load(src + h * stride_src + HALF + i, mask=mask).to(tl.float32)
    dtype = src.dtype.element_ty
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype), mask


@triton.jit
def _store_kv_heads(dst, stride_dst, first, second, scale, mask, num_heads,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Stores both halves of a token's heads at `dst` in the pool's dtype (as `stored_kv`)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if FP8:     # x / scale, saturated: e4m3 has no infinity, and a cast past 448 gives NaN
        heads = tl.arange(0, BLOCK_H)
        s = tl.load(scale + heads, mask=heads < num_heads, other=1.0)[:, None]
        first = tl.clamp(first.to(tl.float32) / s, -FP8_MAX, FP8_MAX)
        second = tl.clamp(second.to(tl.float32) / s, -FP8_MAX, FP8_MAX)
    tl.store(dst + h * stride_dst + i, first.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + h * stride_dst + HALF + i, second.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_write_kv_kernel(q_out, q, k, v, positions, cos_sin_cache, slot_mapping,
                            k_cache, v_cache, k_scale, v_scale,
                            stride_qot, stride_qoh, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_cs,
                            stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr,
                            BLOCK_HALF: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                            PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_cache + pos * stride_cs + i, mask=i < HALF).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_cache + pos * stride_cs + HALF + i, mask=i < HALF).to(tl.float32)[None, :]

    q1, q2, q_mask = _rotated_halves(q + token * stride_qt, stride_qh, cos, sin, NUM_HEADS,
                                     HALF, BLOCK_H, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)[:, None]
    dst = q_out + token * stride_qot + h * stride_qoh + i[None, :]
    tl.store(dst, q1, mask=q_mask)
    tl.store(dst + HALF, q2, mask=q_mask)

    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:   # a padding token's K/V go nowhere
        k1, k2, kv_mask = _rotated_halves(k + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS,
                                          HALF, BLOCK_KH, BLOCK_HALF)
        kh = tl.arange(0, BLOCK_KH)[:, None]
        v_src = v + token * stride_vt + kh * stride_vh + i[None, :]
        v1 = tl.load(v_src, mask=kv_mask)
        v2 = tl.load(v_src + HALF, mask=kv_mask)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        _store_kv_heads(k_cache + block * stride_kcb + offset * stride_kct, stride_kch, k1, k2,
                        k_scale, kv_mask, NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF, FP8, FP8_MAX)
        _store_kv_heads(v_cache + block * stride_vcb + offset * stride_vct, stride_vch, v1, v2,
                        v_scale, kv_mask, NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF, FP8, FP8_MAX)


def rotary_write_kv_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotates `q[T, H, D]` into a new tensor, which it returns, and `k[T, KVH, D]` into the
    pool with `v` (the inputs are left as they are)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert cos_sin_cache.shape[-1] == head_dim, "rotary_dim must equal head_dim"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == cos_sin_cache.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens:
        half = head_dim // 2
        fp8 = k_cache.dtype == FP8_DTYPE
        pdl = pdl_enabled(q.device)
        _rotary_write_kv_kernel[(num_tokens,)](
            q_out, q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
            k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,   # unread unless FP8
            q_out.stride(0), q_out.stride(1), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), cos_sin_cache.stride(0),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_SIZE=block_size,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), FP8=fp8, FP8_MAX=FP8_MAX, PDL=pdl,
            **launch_options(pdl))
    return q_out
