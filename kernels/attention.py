"""Paged attention for mixed prefill/decode batches (reference + dispatch).

Layout of one step's batch: queries of all sequences are flattened into `q[num_tokens,
num_heads, head_dim]`, sequence `s` owning rows `query_start_loc[s]:query_start_loc[s+1]`.
Its keys and values live in the paged pool `k_cache/v_cache[num_blocks, block_size,
num_kv_heads, head_dim]`, addressed through `block_tables[s]`; `seq_lens[s]` counts every
token of the sequence including this step's queries (already written to the pool), so the
queries sit at positions `seq_lens[s] - q_len(s) ... seq_lens[s] - 1` and attend causally.
A float8 pool (kernels.cache) comes with `k_scale`/`v_scale[num_kv_heads]`: its K and V are the
stored values times their head's scale.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cache import FP8_KV_DTYPE, gather_blocks


@dataclass
class GatherPlan:
    """Where each sequence's queries and context sit, as padded index tensors. It depends
    only on the batch layout, so one plan serves every layer of a step."""
    q_index: torch.Tensor      # [S, Q] row of q for each padded query
    q_valid: torch.Tensor      # [S, Q] which padded queries are real
    blocks: torch.Tensor       # [S, ceil(L / block_size)] int64: each sequence's context blocks
    mask: torch.Tensor         # [S, 1, Q, L] causal and length mask


def gather_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                max_query_len: int, max_seq_len: int, block_size: int, num_tokens: int) -> GatherPlan:
    device = seq_lens.device
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    q_offsets = torch.arange(max_query_len, device=device)
    q_valid = q_offsets[None, :] < q_lens[:, None]
    q_index = (query_start_loc[:-1, None] + q_offsets[None, :]).clamp(max=num_tokens - 1).long()

    num_ctx_blocks = (max_seq_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_ctx_blocks].long()

    key_pos = torch.arange(max_seq_len, device=device)
    query_pos = (seq_lens - q_lens)[:, None] + q_offsets[None, :]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    return GatherPlan(q_index, q_valid, blocks, mask[:, None])


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    plan: GatherPlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gathers each sequence's context into a padded batch and runs masked SDPA."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if plan is None:
        plan = gather_plan(block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                           block_size, num_tokens)
    # Half-precision SDPA on the CPU takes its slow path: compute in float32 there.
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    q_pad = q[plan.q_index].transpose(1, 2).to(dtype)                             # [S, H, Q, D]
    length = plan.mask.shape[-1]                  # L, the context the plan covers
    k = gather_blocks(k_cache, plan.blocks, length).transpose(1, 2).to(dtype)    # [S, KVH, L, D]
    v = gather_blocks(v_cache, plan.blocks, length).transpose(1, 2).to(dtype)
    if k_scale is not None:
        k = k * k_scale.to(dtype)[None, :, None, None]
    if v_scale is not None:
        v = v * v_scale.to(dtype)[None, :, None, None]
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=plan.mask, scale=scale,
                                         enable_gqa=num_heads != num_kv_heads)   # [S, H, Q, D]
    return out.transpose(1, 2)[plan.q_valid].to(q.dtype)                         # [T, H, D]


def gpu_head_dim_supported(head_dim: int) -> bool:
    """The Triton kernels load a head whole, in one power-of-two tile of at least 16 lanes."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                    max_query_len: int, max_seq_len: int, scale: float,
                    plan: GatherPlan | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`plan` (CPU only) skips rebuilding the gather indices in every layer; `k_scale`/`v_scale`
    are read only with a float8 pool, which needs them."""
    if k_cache.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = None
    elif k_scale is None or v_scale is None:
        raise ValueError("a float8 KV pool needs k_scale and v_scale")
    if q.is_cuda:
        from .triton_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, max_query_len, max_seq_len, scale,
                                      k_scale=k_scale, v_scale=v_scale)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               max_query_len, max_seq_len, scale, plan, k_scale, v_scale)
