"""Triton paged attention for mixed prefill/decode batches (meaning: `paged_attention_ref`).

The sequences of a step are told apart at run time, on the device, by their query length:

* single-query sequences (decodes) go to `_decode_kernel`, one program per (sequence, KV
  head, split of the context). Long contexts are split so that even a modest batch of
  decodes fills every SM, and so that no long context is left to one program while the rest
  of the batch waits on it (`decode_splits`); the last split of each (sequence, KV head) to
  finish merges the splits by their log-sum-exp.
* longer ones (prefill chunks, with or without earlier context in the pool) go to
  `_prefill_kernel`, FlashAttention-style: one program per tile of query tokens and KV
  head, key tiles above the causal diagonal never visited.

Both pack the query heads that share a KV head as rows of one tile, so each K/V tile is
read from memory once per group. Grids depend on shapes and on the python ints
`max_query_len` / `max_seq_len` only, never on tensor values, so a step can be captured in
a CUDA graph (the caller then passes upper bounds for the two ints). Integers that change
with the batch (split count, sequence count, block-table width) are run-time arguments that
Triton is told not to specialise: each new value of a constexpr, or a value that happens to be 1 or a multiple
of 16, would compile another kernel variant, a stall of a second or more inside the step loop.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enabled, wait_for_predecessor
from .triton_split_k import num_sms, split_k_counters


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shapes and launch parameters; `None` fields are picked from the batch."""

    decode_block_n: int | None = None   # 64 keys a tile over a 16-bit pool, 128 over a float8 one
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    num_splits: int | None = None       # exactly this many even pieces per decode context
    max_split_tokens: int | None = None  # longest piece (default: _MAX_TOKENS_PER_SPLIT)
    prefill_block_m: int | None = None  # query rows (tokens x group heads) per program
    prefill_block_n: int | None = None
    prefill_num_warps: int = 4
    prefill_num_stages: int | None = None


# Splitting pays until about three programs per SM are in the launch: on an H200, 512
# unsplit programs (64 sequences x 8 KV heads x 4096 tokens) read K/V at 4.3 TB/s, and
# each further split only adds partial results to write and merge.
_DECODE_PROGRAMS_PER_SM = 3
# Below this, a split is too short to amortise its pipeline prologue and partial result.
_MIN_TOKENS_PER_SPLIT = 256
# Above this, a split is cut again even when the batch fills the SMs unsplit: one program
# per (sequence, KV head) left a single 12k-token document the last program of every layer
# while seventy 2k-token chats had long finished (W5 on an H200: decode steps of 17 ms where
# their bytes take 9).
_MAX_TOKENS_PER_SPLIT = 1024
# The grid is cut for the longest context the step may hold, and every program of a split
# past a shorter context's end still takes an SM's slot to find that out: programs beyond
# this many per SM cost more than the balance they buy (W1's 512 sequences: 5 % slower with
# four splits each where one did), so a larger batch gets longer splits. Whatever the batch,
# a context goes in at most _MAX_SPLITS pieces, which bounds the partial results.
_DECODE_GRID_PROGRAMS_PER_SM = 16
_MAX_SPLITS = 32
# A float8 tile of 128 keys holds the bytes a 16-bit tile of 64 does: with 64, half the bytes
# are in flight and the decode kernel read a float8 pool 1.3-1.4x slower than a bf16 one (H200).
_DECODE_BLOCK_N = {1: 128, 2: 64, 4: 64}


@triton.jit
def _attend(acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head, lo, hi,
            qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
            MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (acc, m_i, l_i) with keys `lo <= key < hi` of one sequence.

    Scores are kept in the log2 domain (`qk_scale` includes log2(e)). With MASKED, keys
    past `hi` or after a row's query position are hidden; without it the caller promises
    that every key in range is visible to every row and `hi - lo` is a multiple of BLOCK_N.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n
        in_range = keys < hi
        if MASKED:
            blocks = tl.load(block_table + keys // BLOCK_SIZE, mask=in_range, other=0)
        else:
            blocks = tl.load(block_table + keys // BLOCK_SIZE)
        blocks = blocks.to(tl.int64)
        k_rows = blocks * stride_kb + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        v_rows = blocks * stride_vb + (keys % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        if MASKED:
            # Masked V rows must read as zeros: the pool may hold NaNs where nothing was
            # written, and 0 * NaN would poison the accumulator.
            k = tl.load(k_cache + k_rows[:, None] + offs_d[None, :], mask=in_range[:, None],
                        other=0.0)
            v = tl.load(v_cache + v_rows[:, None] + offs_d[None, :], mask=in_range[:, None],
                        other=0.0)
        else:
            k = tl.load(k_cache + k_rows[:, None] + offs_d[None, :])
            v = tl.load(v_cache + v_rows[:, None] + offs_d[None, :])

        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            visible = (keys[None, :] <= q_pos[:, None]) & in_range[None, :]
            s = tl.where(visible, s, float("-inf"))
        # Every row sees at least one key in the first tile it visits (callers start at or
        # below the lowest query position), so m_new is finite and no NaN arises here.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_splits", "max_split", "stride_bt"])
def _decode_kernel(out, part_out, part_lse, counters, q, k_cache, v_cache, k_scale, v_scale,
                   block_tables, seq_lens, query_start_loc, qk_scale, num_splits, max_split,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, SCALED: tl.constexpr, Q_F16: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SCALED:      # a float8 pool's K scale folds into the score scale (its V scale: below)
        qk_scale = qk_scale * tl.load(k_scale + kv_head)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens + seq)

    # Splits are cut from the actual length, in whole key tiles, so a bound passed as
    # max_seq_len costs nothing: the programs of splits a short context does not reach return
    # here, and a context of one split is written out by its one program.
    per_split = tl.minimum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, max_split)
    active = tl.cdiv(seq_len, per_split)
    if split >= active:
        return
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q_tile = tl.load(q + q_start * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0)
    if Q_F16:       # see paged_attention_triton: float8 K/V then convert to float16
        q_tile = q_tile.to(tl.float16)
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + seq_len - 1

    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q_tile, q_pos, k_cache, v_cache,
                            block_tables + seq.to(tl.int64) * stride_bt, kv_head, lo, hi,
                            qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                            stride_vh, BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, DOT_PRECISION)

    if SCALED:
        acc = acc * (tl.load(v_scale + kv_head) / l_i)[:, None]
    else:
        acc = acc / l_i[:, None]
    out_ptrs = out + q_start * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT:
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None])
    elif active == 1:
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Every split stores its part; the last of the sequence's KV head to arrive merges
        # them by their log-sum-exp, in split order (whoever came last), and re-zeroes the
        # counter. One launch, where a second kernel for the merge cost a launch per layer.
        first = (seq * NUM_HEADS + heads) * num_splits
        tl.store(part_out + (first + split)[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_lse + first + split, m_i + tl.log2(l_i), mask=row_ok)
        # All threads' stores precede the releasing atomic (see triton_split_k.split_k_reduce).
        tl.debug_barrier()
        tile = seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == active - 1:
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            weights = tl.zeros([BLOCK_G], tl.float32)
            total = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
            for s in range(0, active):
                # .cg: from L2, where the other programs' stores are, never a stale L1 line.
                lse = tl.load(part_lse + first + s, mask=row_ok, other=0.0, cache_modifier=".cg")
                part = tl.load(part_out + (first + s)[:, None] * HEAD_DIM + offs_d[None, :],
                               mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, lse)
                old, new = tl.exp2(m - m_new), tl.exp2(lse - m_new)
                total = total * old[:, None] + part * new[:, None]
                weights = weights * old + new
                m = m_new
            tl.store(out_ptrs, (total / weights[:, None]).to(out.dtype.element_ty),
                     mask=row_ok[:, None])
            tl.atomic_xchg(counters + tile, 0)


@triton.jit
def _find_sequence(query_start_loc, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile `tile`; sequence s owns tiles from
    `query_start_loc[s] // BLOCK_Q + s`, a numbering that gives every sequence at least
    as many tiles as it needs and totals at most `num_tokens // BLOCK_Q + num_seqs`."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                    query_start_loc, qk_scale, num_seqs,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    SCALED: tl.constexpr, Q_F16: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Tiles run last-first: late tiles of a sequence attend to the most keys, and starting
    # the longest work first shortens the tail of the launch.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if (q_len <= 1) | (q_tile * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seq_lens + seq)
    ctx_len = seq_len - q_len
    if SCALED:      # as in _decode_kernel
        qk_scale = qk_scale * tl.load(k_scale + kv_head)

    # Row r of the tile is query token r // GROUP_PAD with head r % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_tile * BLOCK_Q + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q_tile_v = tl.load(q + q_offs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if Q_F16:
        q_tile_v = q_tile_v.to(tl.float16)
    q_pos = ctx_len + tok

    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    block_table = block_tables + seq.to(tl.int64) * stride_bt
    # Keys up to the tile's first query position are visible to every row: whole key
    # tiles below it run unmasked, the few straddling the diagonal masked, none above it.
    first_pos = ctx_len + q_tile * BLOCK_Q
    diag_lo = (first_pos + 1) // BLOCK_N * BLOCK_N
    diag_hi = ctx_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q_tile_v, q_pos, k_cache, v_cache, block_table,
                            kv_head, 0, diag_lo, qk_scale, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                            False, DOT_PRECISION)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q_tile_v, q_pos, k_cache, v_cache, block_table,
                            kv_head, diag_lo, diag_hi, qk_scale, stride_kb, stride_kt,
                            stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE, BLOCK_N,
                            HEAD_DIM, True, DOT_PRECISION)

    if SCALED:
        acc = acc * (tl.load(v_scale + kv_head) / l_i)[:, None]
    else:
        acc = acc / l_i[:, None]
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(out + o_offs + offs_d[None, :], acc.to(out.dtype.element_ty), mask=row_ok[:, None])


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                  device: torch.device, max_split_tokens: int = _MAX_TOKENS_PER_SPLIT
                  ) -> tuple[int, int]:
    """How each decode's context is cut, from python ints only: `(num_splits, max_split)`.
    A context of `n` tokens goes in `min(cdiv(n, num_splits), max_split)`-token pieces (whole
    key tiles): evenly over `num_splits` programs when the batch is too small to fill the
    SMs, and in pieces of at most `max_split` tokens, so that no long context is left to one
    program."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(_DECODE_PROGRAMS_PER_SM * num_sms(device), programs)
    wanted = min(wanted, triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT))
    affordable = min(_MAX_SPLITS, triton.cdiv(_DECODE_GRID_PROGRAMS_PER_SM * num_sms(device), programs))
    max_split = max(max_split_tokens, triton.cdiv(max_seq_len, affordable))
    max_split = triton.cdiv(max_split, block_n) * block_n
    return max(1, wanted, triton.cdiv(max_seq_len, max_split)), max_split


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int,
                           max_seq_len: int, scale: float,
                           config: AttentionConfig | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same arguments and result as `paged_attention_ref`, returned as `[num_tokens, ...]`.

    Rows of tokens past `query_start_loc[-1]` (batch padding) are left unwritten.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}: not a power of two from 16"
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    cfg = config or AttentionConfig()
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    qk_scale = scale * 1.4426950408889634  # log2(e): the kernels use exp2
    # fp32 matmuls as three TF32 products: about fp32 accuracy on tensor cores, where plain
    # FMA tiles would spill registers. ("tf32" is the default, and a no-op, for 16-bit.)
    dot_precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    pool_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0))
    scaled = k_scale is not None
    # Over a float8 pool, 16-bit queries are taken as float16: e4m3 converts to float16 in one
    # instruction per pair, to bfloat16 only through float32, and that conversion of every K/V
    # tile cost more than the halved bytes saved (H200: 1.3x slower than a bf16 pool at 32k
    # context; 0.93-1.08x with float16). Queries of a bfloat16 model beyond float16's range
    # (65504) would overflow; real models' stay far below.
    q_f16 = scaled and q.element_size() == 2
    scales = (k_scale, v_scale) if scaled else (seq_lens, seq_lens)   # unread unless SCALED

    block_n = cfg.decode_block_n or _DECODE_BLOCK_N[k_cache.element_size()]
    if cfg.num_splits:      # even pieces, however long
        num_splits, max_split = cfg.num_splits, triton.cdiv(max_seq_len, block_n) * block_n
    else:
        num_splits, max_split = decode_splits(num_seqs, num_kv_heads, max_seq_len, block_n, q.device,
                                              cfg.max_split_tokens or _MAX_TOKENS_PER_SPLIT)
    part_out = part_lse = counters = out  # placeholders: unused when there is a single split
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim),
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                               device=q.device)
        counters = split_k_counters(q.device, num_seqs * num_kv_heads)
    pdl = pdl_enabled(q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_lse, counters, q, k_cache, v_cache, *scales, block_tables, seq_lens,
        query_start_loc, qk_scale, num_splits, max_split, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), *pool_strides,
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, group_pad), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=num_splits > 1, SCALED=scaled, Q_F16=q_f16,
        DOT_PRECISION=dot_precision, PDL=pdl, num_warps=cfg.decode_num_warps,
        num_stages=cfg.decode_num_stages, **launch_options(pdl))

    if max_query_len > 1:
        # Wide rows (fp32, head_dim over 128) need twice the shared memory per tile: halve
        # the tiles. Short chunks get fewer rows, so fewer of them are padding.
        wide = q.element_size() > 2 or head_dim > 128
        block_m = cfg.prefill_block_m or (64 if wide or max_query_len * group_pad <= 64 else 128)
        block_m = max(block_m, group_pad)
        block_q = block_m // group_pad
        _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
            out, q, k_cache, v_cache, *scales, block_tables, seq_lens, query_start_loc, qk_scale,
            num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *pool_strides,
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size, BLOCK_N=cfg.prefill_block_n or (32 if wide else 64),
            SCALED=scaled, Q_F16=q_f16, DOT_PRECISION=dot_precision, num_warps=cfg.prefill_num_warps,
            num_stages=cfg.prefill_num_stages or (2 if wide else 3))
    return out
