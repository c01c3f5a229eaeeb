"""KV-pool data movement: write by slot mapping, block copy, swap between pools.

A slot is `block_id * block_size + offset`; a negative slot is padding and writes nowhere.
"""

import torch


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores `key/value[num_tokens, num_kv_heads, head_dim]` at their slots in the pool."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(v_cache.dtype)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if k_cache.is_cuda:
        from .triton_cache import write_kv_triton
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def copy_blocks_ref(caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copies whole blocks inside each pool tensor: `src_to_dst[n] = (src, dst)`."""
    src, dst = src_to_dst[:, 0].long(), src_to_dst[:, 1].long()
    for cache in caches:
        cache[dst] = cache[src]


def copy_blocks(caches, src_to_dst) -> None:
    if caches and caches[0].is_cuda:
        from .triton_cache import copy_blocks_triton
        copy_blocks_triton(caches, src_to_dst)
        return
    copy_blocks_ref(caches, src_to_dst)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Moves blocks between a device pool and a host swap pool (either direction).

    Index on the source's device, copy the gathered blocks across in one transfer.
    """
    src_ids = src_to_dst[:, 0].long().to(src.device)
    dst_ids = src_to_dst[:, 1].long().to(dst.device)
    # Asynchronous only towards the device: a host destination is read right after the copy.
    dst[dst_ids] = src[src_ids].to(dst.device, non_blocking=dst.device.type != "cpu")
