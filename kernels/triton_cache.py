"""Triton KV-pool writes and block copies (meaning: `write_kv_ref`, `copy_blocks_ref`)."""

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:  # padding token: its K/V go nowhere
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value + token * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:     # x / scale, saturated: e4m3 has no infinity, and a cast past 448 gives NaN
        heads = tl.arange(0, BLOCK_H)
        ks = tl.load(k_scale + heads, mask=heads < NUM_KV_HEADS, other=1.0)[:, None]
        vs = tl.load(v_scale + heads, mask=heads < NUM_KV_HEADS, other=1.0)[:, None]
        k = tl.clamp(k.to(tl.float32) / ks, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / vs, -FP8_MAX, FP8_MAX)
    tl.store(k_cache + block * stride_kcb + offset * stride_kct + h * stride_kch + d,
             k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + block * stride_vcb + offset * stride_vct + h * stride_vch + d,
             v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    num_tokens = slot_mapping.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert key.stride(-1) == value.stride(-1) == 1
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == FP8_DTYPE
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,   # unread unless FP8
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8, FP8_MAX=FP8_MAX)


@triton.jit
def _copy_blocks_kernel(cache_addrs, src_to_dst, like, block_numel, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    # One launch serves every layer's pool: each program finds its tensor by address.
    base = tl.load(cache_addrs + tl.program_id(1)).to(tl.pointer_type(like.dtype.element_ty))
    src = tl.load(src_to_dst + 2 * pair).to(tl.int64)
    dst = tl.load(src_to_dst + 2 * pair + 1).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    data = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, data, mask=mask)


def copy_blocks_triton(caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Like `copy_blocks_ref`, for pairs whose destinations are never sources (copy-on-write).

    Caches are grouped by dtype and block shape, one launch per group.
    """
    if not caches or src_to_dst.shape[0] == 0:
        return
    device = caches[0].device
    pairs = src_to_dst.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    groups: dict[tuple, list[torch.Tensor]] = {}
    for cache in caches:
        assert cache.is_contiguous()
        if cache.dtype == FP8_DTYPE:
            cache = cache.view(torch.uint8)     # moved as bytes: nothing converts them
        groups.setdefault((cache.dtype, cache[0].numel()), []).append(cache)
    for (_, block_numel), group in groups.items():
        addrs = torch.tensor([c.data_ptr() for c in group], dtype=torch.int64, device=device)
        chunk = min(4096, triton.next_power_of_2(block_numel))
        grid = (pairs.shape[0], len(group), triton.cdiv(block_numel, chunk))
        _copy_blocks_kernel[grid](addrs, pairs, group[0], block_numel, CHUNK=chunk)
