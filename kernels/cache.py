"""KV-pool data movement: write by slot mapping, block copy, swap between pools.

A slot is `block_id * block_size + offset`; a negative slot is padding and writes nowhere.

A pool in float8 e4m3 (`--kv-cache-dtype fp8`) stores `x / scale`, saturated at ±448, with a
float32 scale per KV head (`k_scale`, `v_scale`: `[num_kv_heads]`, one value repeated when the
checkpoint gives one per layer); attention multiplies it back. A 16- or 32-bit pool stores K/V
as they are and takes no scales.
"""

import torch

from .fp8 import FP8_DTYPE, FP8_MAX

# The float8 pool's element (e4m3, as the FP8 weights') and its largest value.
FP8_KV_DTYPE, FP8_KV_MAX = FP8_DTYPE, FP8_MAX


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def stored_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """`x[tokens, num_kv_heads, head_dim]` as a pool of `dtype` holds it."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() / scale[:, None]).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Stores `key/value[num_tokens, num_kv_heads, head_dim]` at their slots in the pool."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        rows = _as_bytes(stored_kv(x[valid], cache.dtype, scale))
        _as_bytes(cache).view(-1, num_kv_heads, head_dim)[slots] = rows


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Each sequence's first `length` positions, its blocks `blocks[S, nb]` (int64) of
    `cache[num_blocks, block_size, num_kv_heads, head_dim]` in order: `[S, length,
    num_kv_heads, head_dim]`, in the pool's dtype. Whole blocks move with `index_select`,
    several times faster on the CPU than indexing row by row (docs/BENCHMARKS.md)."""
    num_seqs, num_ctx_blocks = blocks.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    picked = _as_bytes(cache).index_select(0, blocks.reshape(-1))
    picked = picked.view(num_seqs, num_ctx_blocks * block_size, num_kv_heads, head_dim)[:, :length]
    return picked.view(cache.dtype)


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A float8 pool as bytes, for moves: indexing float8 tensors is not supported everywhere."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache


def copy_blocks_ref(caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copies whole blocks inside each pool tensor: `src_to_dst[n] = (src, dst)`."""
    src, dst = src_to_dst[:, 0].long(), src_to_dst[:, 1].long()
    for cache in caches:
        cache = _as_bytes(cache)
        cache[dst] = cache[src]


def copy_blocks(caches, src_to_dst) -> None:
    if caches and caches[0].is_cuda:
        from .triton_cache import copy_blocks_triton
        copy_blocks_triton(caches, src_to_dst)
        return
    copy_blocks_ref(caches, src_to_dst)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Moves whole blocks `src_to_dst[n] = (src, dst)` between a device pool and a host swap
    pool (either direction), each given block-first (`[blocks, ...]`; the device pool may be a
    strided view). The host pool must be contiguous, so that each run of consecutive host
    blocks is one contiguous span.

    On a GPU nothing here waits for the device: the blocks are gathered into (or scattered from)
    a contiguous device buffer by one indexing kernel, and each run of host blocks crosses in one
    asynchronous copy to or from pinned memory, all on the current stream. That stream orders
    them after the steps that wrote the blocks and before any step or later swap that reuses a
    block, and the host never reads the swap pool itself. (Copying through pageable memory and
    indexing on the host instead blocked the step loop for tens of milliseconds a swap.)"""
    src, dst = _as_bytes(src), _as_bytes(dst)
    if src.device == dst.device:        # a CPU worker: both pools in host memory
        dst[src_to_dst[:, 1].long()] = src[src_to_dst[:, 0].long()]
        return
    outward = dst.device.type == "cpu"
    device = src.device if outward else dst.device
    pairs = src_to_dst.long()
    # Pinned, so the index copy does not wait for the device either; the caching host allocator
    # keeps the memory until the copy has run.
    device_ids = pairs[:, 0 if outward else 1].pin_memory().to(device, non_blocking=True)
    host_ids = pairs[:, 1 if outward else 0].tolist()
    host = dst if outward else src
    staged = src[device_ids] if outward else torch.empty((len(host_ids), *src.shape[1:]), dtype=src.dtype,
                                                          device=device)
    for first, start, count in _runs(host_ids):
        if outward:
            host[first:first + count].copy_(staged[start:start + count], non_blocking=True)
        else:
            staged[start:start + count].copy_(host[first:first + count], non_blocking=True)
    if not outward:
        dst[device_ids] = staged


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first id, index of its entry, length) of each run of consecutive ids in `ids`."""
    runs: list[tuple[int, int, int]] = []
    for index, block in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((block, index, 1))
    return runs
