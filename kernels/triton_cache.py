"""Triton block copies inside the KV pool (meaning: `copy_blocks_ref`). The pool's writes are
fused with rotary (`kernels.triton_rotary`)."""

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE


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
