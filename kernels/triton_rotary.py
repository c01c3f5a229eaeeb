"""Triton rotary embedding, rotate-half layout (meaning: `apply_rotary_ref`).

One program per token rotates all of its query and key heads with one read of the
token's cos/sin row.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(dst, src, stride_dst, stride_src, cos, sin, num_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (i < HALF)
    x1 = tl.load(src + h * stride_src + i, mask=mask).to(tl.float32)
    x2 = tl.load(src + h * stride_src + HALF + i, mask=mask).to(tl.float32)
    tl.store(dst + h * stride_dst + i, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + h * stride_dst + HALF + i, (x2 * cos + x1 * sin).to(dst.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotary_kernel(q_out, k_out, q, k, positions, cos_sin_cache,
                   stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_cache + pos * stride_cs + i, mask=i < HALF).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_cache + pos * stride_cs + HALF + i,
                  mask=i < HALF).to(tl.float32)[None, :]
    _rotate_heads(q_out + token * stride_qot, q + token * stride_qt, stride_qoh, stride_qh,
                  cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_out + token * stride_kot, k + token * stride_kt, stride_koh, stride_kh,
                  cos, sin, NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def apply_rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates `q[T, H, D]` and `k[T, KVH, D]` into new tensors (the inputs are left as is)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim, "rotary_dim must equal head_dim"
    assert q.stride(-1) == k.stride(-1) == cos_sin_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q_out, k_out, q, k, positions, cos_sin_cache,
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half))
    return q_out, k_out
