"""Kernels: each reference against a naive loop (CPU), each Triton kernel against its
reference (on CPU through Triton's interpreter, in a subprocess, and on CUDA)."""

import importlib.util
import math
import os

import pytest
import torch
from helpers import run_interpreter_tests

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.attention import paged_attention, paged_attention_ref
from kernels.cache import (
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    copy_blocks,
    copy_blocks_ref,
    swap_blocks,
    write_kv_ref,
)
from kernels.fp8 import FP8_DTYPE, Fp8Activation, per_token_quant, per_token_quant_ref
from kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary_and_write_kv, apply_rotary_ref, build_cos_sin_cache

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreter_only = pytest.mark.skipif(
    not INTERPRETING, reason="run by test_triton_interpreter in a TRITON_INTERPRET=1 subprocess")


# ----------------------------------------------------------------------------- batches

def paged_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype, device: str = "cpu",
                pad_tokens: int = 0, seed: int = 0) -> dict:
    """A step's attention inputs over a pool whose blocks are handed out in random order.

    Table entries past a sequence's own blocks hold other valid block ids (the reference
    gathers up to max_seq_len for every sequence); `pad_tokens` query rows belong to no
    sequence, as in a CUDA-graph batch padded to its captured size.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    width = max(blocks_needed) + 1
    num_blocks = sum(blocks_needed) + 4
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g, dtype=torch.int32)
    for s, n in enumerate(blocks_needed):
        table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    num_tokens = sum(q_lens) + pad_tokens
    return dict(
        q=torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype).to(device),
        k_cache=torch.randn(shape, generator=g).to(dtype).to(device),
        v_cache=torch.randn(shape, generator=g).to(dtype).to(device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                     dtype=torch.int32, device=device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), scale=head_dim ** -0.5)


def poison_unused_slots(batch: dict) -> None:
    """Fills every pool slot outside the sequences' contexts with NaN (never-written memory)."""
    block_size = batch["k_cache"].shape[1]
    live = torch.zeros(batch["k_cache"].shape[:2], dtype=torch.bool)
    for s, n in enumerate(batch["seq_lens"].tolist()):
        for t in range(n):
            live[int(batch["block_tables"][s, t // block_size]), t % block_size] = True
    live = live.to(batch["k_cache"].device)
    batch["k_cache"][~live] = float("nan")
    batch["v_cache"][~live] = float("nan")


# (block_size, head_dim, num_heads, num_kv_heads): GQA ratios 1, 3 (SmolLM2), 4, 8.
SHAPES = [(16, 64, 4, 4), (32, 64, 9, 3), (16, 128, 8, 2), (32, 128, 16, 2)]
# (q_lens, seq_lens): contexts end on, just past and well past block boundaries.
SMALL_BATCHES = {
    "decode": ([1, 1, 1, 1], [1, 16, 17, 70]),
    "prefill": ([5, 33], [5, 33]),
    "mixed": ([1, 20, 1, 7, 0], [40, 20, 33, 50, 0]),  # a chunk of 7 over 43 earlier tokens
    "padding": ([3, 0, 1], [3, 0, 9]),
}


# ------------------------------------------------------------------ naive definitions

def naive_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                          scale, **_) -> torch.Tensor:
    """Token by token, head by head: gather the context through the table, softmax, sum."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = []
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if start == end:
            continue
        slots = [(int(block_tables[s, t // block_size]), t % block_size) for t in range(seq_len)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [seq_len, KVH, D]
        values = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for i in range(end - start):
            pos = seq_len - (end - start) + i  # this query's own position: sees keys 0..pos
            row = torch.empty(num_heads, q.shape[2], dtype=torch.float64)
            for h in range(num_heads):
                scores = keys[:pos + 1, h // group] @ q[start + i, h].double() * scale
                row[h] = torch.softmax(scores, 0) @ values[:pos + 1, h // group]
            rows.append(row)
    return torch.stack(rows)


def naive_inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> list[float]:
    """Per frequency, as the Llama 3 paper's pseudo-code states it."""
    freqs = []
    for j in range(0, rotary_dim, 2):
        f = base ** (-j / rotary_dim)
        kind = (scaling or {}).get("rope_type", "default")
        if kind == "linear":
            f /= scaling["factor"]
        elif kind == "llama3":
            wavelen = 2 * math.pi / f
            low = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
            high = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
            if wavelen > low:
                f /= scaling["factor"]
            elif wavelen >= high:
                smooth = ((scaling["original_max_position_embeddings"] / wavelen
                           - scaling["low_freq_factor"])
                          / (scaling["high_freq_factor"] - scaling["low_freq_factor"]))
                f = (1 - smooth) * f / scaling["factor"] + smooth * f
        freqs.append(f)
    return freqs


# ------------------------------------------------------- references vs naive (CPU)

@pytest.mark.parametrize("batch_name", SMALL_BATCHES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs%d-d%d-h%d-kv%d" % s)
def test_attention_ref_matches_naive(shape, batch_name):
    block_size, head_dim, num_heads, num_kv_heads = shape
    batch = paged_batch(*SMALL_BATCHES[batch_name], num_heads, num_kv_heads, head_dim,
                        block_size, torch.float32)
    out = paged_attention_ref(**batch)
    torch.testing.assert_close(out.double(), naive_paged_attention(**batch),
                               atol=1e-5, rtol=1e-5)


def test_attention_ref_half_precision_close_to_naive():
    batch = paged_batch([1, 6, 1], [30, 6, 65], 8, 2, 64, 16, torch.bfloat16)
    out = paged_attention_ref(**batch)
    torch.testing.assert_close(out.double(), naive_paged_attention(**batch),
                               atol=2e-2, rtol=2e-2)


def test_public_functions_run_references_on_cpu():
    batch = paged_batch([1, 4], [9, 4], 4, 2, 64, 16, torch.float32)
    assert torch.equal(paged_attention(**batch), paged_attention_ref(**batch))
    x = torch.randn(3, 64)
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
    assert torch.equal(rms_norm(x, torch.ones(64), 1e-6), rms_norm_ref(x, torch.ones(64), 1e-6))


def test_write_kv_ref_matches_naive():
    k_cache = torch.zeros(6, 16, 2, 64)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(7, 2, 64), torch.randn(7, 2, 64)
    slots = torch.tensor([0, -1, 17, 95, 31, -1, 48])
    write_kv_ref(key, value, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // 16, slot % 16] = key[t]
            want_v[slot // 16, slot % 16] = value[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_copy_and_swap_blocks_ref_match_naive():
    caches = [torch.randn(8, 16, 2, 64) for _ in range(3)]
    before = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 5], [2, 6], [1, 7]])
    copy_blocks_ref(caches, pairs)
    for cache, old in zip(caches, before):
        for src, dst in pairs.tolist():
            old[dst] = old[src]
        assert torch.equal(cache, old)

    host = torch.zeros(4, 16, 2, 64)
    swap_blocks(caches[0], host, torch.tensor([[3, 0], [5, 2]]))
    assert torch.equal(host[0], caches[0][3]) and torch.equal(host[2], caches[0][5])
    assert not host[1].any() and not host[3].any()


# --------------------------------------------------------------- float8 KV pools (CPU)

def rotary_and_write_ref(positions, q, k, v, cos_sin, k_cache, v_cache, slots, k_scale=None, v_scale=None):
    """What `apply_rotary_and_write_kv` means, from the two references."""
    q, k = apply_rotary_ref(positions, q, k, cos_sin)
    write_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    return q


def write_kv_unrotated(key, value, k_cache, v_cache, slots, k_scale=None, v_scale=None) -> None:
    """The pool write of `apply_rotary_and_write_kv` alone: at position 0 the rotation is the
    identity, exactly (cos 1, sin 0), so its stores must equal `write_kv_ref`'s bit for bit."""
    num_tokens, _, head_dim = key.shape
    positions = torch.zeros(num_tokens, dtype=torch.long, device=key.device)
    cos_sin = build_cos_sin_cache(head_dim, 1, 10000.0).to(key.device)
    apply_rotary_and_write_kv(positions, key, key, value, cos_sin, k_cache, v_cache, slots, k_scale, v_scale)


def fp8_pool_batch(seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A mixed batch over a float8 pool, with a scale per KV head (values of several
    magnitudes, so that the scales matter), and the scales."""
    batch = paged_batch([1, 20, 1, 7, 0], [40, 20, 33, 50, 0], 9, 3, 64, 32, torch.float32,
                        pad_tokens=2, seed=seed)
    k_scale, v_scale = torch.tensor([0.1, 0.02, 0.5]), torch.tensor([1.0, 0.05, 0.3])
    batch["k_cache"] = (batch["k_cache"] * 8).to(FP8_KV_DTYPE)
    batch["v_cache"] = (batch["v_cache"] * 8).to(FP8_KV_DTYPE)
    return batch, k_scale, v_scale


def dequantized(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cache.float() * scale[:, None]


def test_write_kv_ref_to_a_float8_pool_stores_each_head_divided_by_its_scale():
    k_cache = torch.zeros(6, 16, 2, 64, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(7, 2, 64), torch.randn(7, 2, 64)
    k_scale, v_scale = torch.tensor([0.01, 0.1]), torch.tensor([0.002, 1.0])
    slots = torch.tensor([0, -1, 17, 95, 31, -1, 48])
    write_kv_ref(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
                want = (x[t] / scale[:, None]).to(FP8_KV_DTYPE)
                assert torch.equal(cache[slot // 16, slot % 16].view(torch.uint8), want.view(torch.uint8))
    assert not k_cache[0, 1:].float().any()      # nothing else written


def test_write_kv_ref_saturates_values_beyond_the_float8_range():
    k_cache = torch.zeros(1, 16, 1, 16, dtype=FP8_KV_DTYPE)
    key = torch.tensor([1e6, -1e6, 500.0, 3.0]).repeat(4).view(1, 1, 16)
    write_kv_ref(key, key, k_cache, k_cache.clone(), torch.tensor([0]), torch.ones(1), torch.ones(1))
    assert k_cache[0, 0, 0, :4].float().tolist() == [FP8_KV_MAX, -FP8_KV_MAX, FP8_KV_MAX, 3.0]


def test_attention_ref_over_a_float8_pool_reads_stored_values_times_their_scales():
    batch, k_scale, v_scale = fp8_pool_batch()
    out = paged_attention_ref(**batch, k_scale=k_scale, v_scale=v_scale)
    wide = dict(batch, k_cache=dequantized(batch["k_cache"], k_scale),
                v_cache=dequantized(batch["v_cache"], v_scale))
    torch.testing.assert_close(out.double(), naive_paged_attention(**wide), atol=1e-5, rtol=1e-5)


def test_a_float8_pool_without_scales_is_refused():
    batch, _, _ = fp8_pool_batch()
    with pytest.raises(ValueError, match="float8 KV pool needs k_scale and v_scale"):
        paged_attention(**batch)


def test_block_copies_and_swaps_move_float8_pools_bit_for_bit():
    pool = (torch.randn(8, 16, 2, 64) * 50).to(FP8_KV_DTYPE)
    want = pool.view(torch.uint8).clone()
    copy_blocks([pool], torch.tensor([[1, 5]]))
    want[5] = want[1]
    assert torch.equal(pool.view(torch.uint8), want)
    host = torch.zeros(4, 16, 2, 64, dtype=FP8_KV_DTYPE)
    swap_blocks(pool, host, torch.tensor([[3, 0]]))
    assert torch.equal(host[0].view(torch.uint8), want[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_refs_match_naive(dtype):
    x, residual = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)

    def naive(h):
        h = h.double()
        return h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5) * weight.double()

    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-5).double(), naive(x), **tol)
    normed, summed = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed.double(), x.double() + residual.double(), **tol)
    torch.testing.assert_close(normed.double(), naive(summed), **tol)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
], ids=["default", "linear", "llama3"])
def test_rotary_ref_matches_naive(scaling):
    head_dim, base = 64, 500000.0
    cache = build_cos_sin_cache(head_dim, 2048, base, scaling)
    positions = torch.tensor([0, 1, 7, 2047, 300])
    q, k = torch.randn(5, 6, head_dim), torch.randn(5, 2, head_dim)
    q_rot, k_rot = apply_rotary_ref(positions, q, k, cache)

    half = head_dim // 2
    freqs = naive_inv_freq(head_dim, base, scaling)
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        want = torch.empty(x.shape, dtype=torch.float64)
        for t, pos in enumerate(positions.tolist()):
            for j, f in enumerate(freqs):
                c, s = math.cos(pos * f), math.sin(pos * f)
                a, b = x[t, :, j].double(), x[t, :, j + half].double()
                want[t, :, j], want[t, :, j + half] = a * c - b * s, b * c + a * s
        # fp32 angles of positions up to 2047 carry ~1e-4 absolute error
        torch.testing.assert_close(x_rot.double(), want, atol=1e-3, rtol=1e-4)


def test_silu_and_mul_ref_matches_naive():
    x = torch.randn(3, 4, 2 * 96)
    gate, up = x[..., :96].double(), x[..., 96:].double()
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(x).double(), want, atol=1e-6, rtol=1e-6)


# ------------------------------------------ Triton through its interpreter (CPU)

@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter run")
def test_triton_interpreter():
    """Runs this file's interpreter_only tests on the CPU, through Triton's interpreter."""
    run_interpreter_tests(__file__)


# The interpreter truncates when it converts to bfloat16 and gets bfloat16 matmuls wrong,
# so bfloat16 is left to the GPU tests.
INTERP_DTYPES = [torch.float32, torch.float16]
INTERP_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


@interpreter_only
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
@pytest.mark.parametrize("batch_name", ["mixed", "padding", "long"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs%d-d%d-h%d-kv%d" % s)
def test_interp_attention(shape, batch_name, dtype):
    from kernels.triton_attention import paged_attention_triton

    block_size, head_dim, num_heads, num_kv_heads = shape
    # "long": decodes long enough to be split (and one to leave some splits empty), next to
    # a prefill chunk tiled several times over.
    q_lens, seq_lens = SMALL_BATCHES.get(batch_name, ([1, 1, 150, 1], [700, 1030, 400, 3]))
    batch = paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                        dtype, pad_tokens=2)
    want = paged_attention_ref(**batch)
    out = paged_attention_triton(**batch)
    torch.testing.assert_close(out[:want.shape[0]], want, **INTERP_TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("num_splits", [1, 3, 37])   # 37: more splits than the context has key tiles
def test_interp_attention_ignores_unwritten_slots(num_splits):
    from kernels.triton_attention import AttentionConfig, paged_attention_triton

    batch = paged_batch([1, 9, 1], [300, 40, 21], 8, 2, 64, 16, torch.float32)
    want = paged_attention_ref(**batch)
    poison_unused_slots(batch)
    out = paged_attention_triton(**batch, config=AttentionConfig(num_splits=num_splits))
    torch.testing.assert_close(out, want, **INTERP_TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("max_split_tokens", [64, 128])
def test_interp_attention_cuts_long_decodes_into_pieces_of_at_most_max_split_tokens(max_split_tokens):
    from kernels.triton_attention import AttentionConfig, paged_attention_triton

    # 300 tokens: five pieces of 64 or three of 128, beside contexts of one piece and a chunk.
    batch = paged_batch([1, 1, 9, 1], [300, 60, 40, 129], 8, 2, 64, 16, torch.float32)
    want = paged_attention_ref(**batch)
    poison_unused_slots(batch)
    out = paged_attention_triton(**batch, config=AttentionConfig(max_split_tokens=max_split_tokens))
    torch.testing.assert_close(out, want, **INTERP_TOL[torch.float32])


def test_decode_splits_cut_long_contexts_of_a_batch_that_fills_the_sms():
    from kernels.triton_attention import decode_splits

    # 8 sequences x 2 KV heads fill the interpreter's 8 "SMs" (3 programs each) unsplit, yet a
    # 4k context goes in 1,024-token pieces: 16 programs per SM afford 8 pieces a context.
    assert decode_splits(8, 2, 4096, 64, torch.device("cpu")) == (4, 1024)
    # A bound of 64k tokens makes 8 longer pieces rather than 64.
    assert decode_splits(8, 2, 65536, 64, torch.device("cpu")) == (8, 8192)


def test_decode_splits_leave_a_batch_of_many_programs_unsplit():
    from kernels.triton_attention import decode_splits

    # 64 sequences x 8 KV heads: 512 programs, four times the 128 the 8 "SMs" afford.
    assert decode_splits(64, 8, 4096, 64, torch.device("cpu")) == (1, 4096)


def test_decode_splits_spread_a_small_batch_over_the_sms():
    from kernels.triton_attention import decode_splits

    # One sequence, 8 KV heads, the interpreter's 8 "SMs": 3 programs per SM want 3 splits,
    # more than 2,048 tokens' pieces of at most 1,024.
    assert decode_splits(1, 8, 2048, 64, torch.device("cpu")) == (3, 1024)


@interpreter_only
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
def test_interp_rotary_and_kv_write(dtype):
    k_cache = torch.randn(10, 16, 3, 64).to(dtype)
    v_cache = torch.randn(10, 16, 3, 64).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    cos_sin = build_cos_sin_cache(64, 200, 10000.0)
    positions = torch.tensor([0, 5, 199, 3, 3, 17, 60])
    # q/k/v as views of a fused projection, as the model hands them over
    qkv = torch.randn(7, 9 + 2 * 3, 64).to(dtype)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([5, -1, 17, 159, 0, -1, 33])
    want_q = rotary_and_write_ref(positions, q, k, v, cos_sin, want_k, want_v, slots)
    got_q = apply_rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    tol = INTERP_TOL[dtype]
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(k_cache, want_k, **tol)
    assert torch.equal(v_cache, want_v)


@interpreter_only
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
def test_interp_kv_write_stores_what_the_reference_stores(dtype):
    k_cache = torch.randn(10, 16, 3, 64).to(dtype)
    v_cache = torch.randn(10, 16, 3, 64).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(7, 2, 3, 64).to(dtype)
    slots = torch.tensor([5, -1, 17, 159, 0, -1, 33])
    write_kv_ref(kv[:, 0], kv[:, 1], want_k, want_v, slots)
    write_kv_unrotated(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@interpreter_only
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
def test_interp_copy_blocks(dtype):
    from kernels.triton_cache import copy_blocks_triton

    caches = [torch.randn(10, 16, 3, 64).to(dtype), torch.randn(10, 16, 3, 64).to(dtype),
              torch.randn(10, 32, 64).to(dtype)]
    want = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 4], [2, 7], [1, 9]], dtype=torch.int32)
    copy_blocks_ref(want, pairs)
    copy_blocks_triton(caches, pairs)
    assert all(torch.equal(c, w) for c, w in zip(caches, want))


@interpreter_only
def test_interp_attention_over_a_float8_pool():
    from kernels.triton_attention import paged_attention_triton

    batch, k_scale, v_scale = fp8_pool_batch()
    want = paged_attention_ref(**batch, k_scale=k_scale, v_scale=v_scale)
    out = paged_attention_triton(**batch, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out[:want.shape[0]], want, **INTERP_TOL[torch.float32])


@interpreter_only
def test_interp_write_kv_to_a_float8_pool():
    """On values a float8 holds exactly, over power-of-two scales: the interpreter rounds
    float8 conversions its own way (the GPU test covers rounding, asking for equal bits)."""
    k_cache = torch.zeros(10, 16, 3, 64, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    k_scale, v_scale = torch.tensor([2.0 ** -6, 0.5, 4.0]), torch.tensor([2.0 ** -3, 1.0, 0.25])
    stored = (torch.randn(7, 2, 3, 64) * 20).to(FP8_KV_DTYPE).float()
    kv = stored * torch.stack([k_scale, v_scale])[None, :, :, None]
    kv[0, 0, 0, 0] = 1e6                                   # saturates
    slots = torch.tensor([5, -1, 17, 159, 0, -1, 33])
    write_kv_ref(kv[:, 0], kv[:, 1], want_k, want_v, slots, k_scale, v_scale)
    write_kv_unrotated(kv[:, 0], kv[:, 1], k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert want_k[0, 5, 0, 0].float() == FP8_KV_MAX


@interpreter_only
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
def test_interp_elementwise(dtype):
    from kernels.triton_activation import silu_and_mul_triton
    from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

    tol = INTERP_TOL[dtype]
    x, residual = torch.randn(2, 3, 576).to(dtype), torch.randn(2, 3, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5),
                               **tol)
    for got, want in zip(fused_add_rms_norm_triton(x, residual, weight, 1e-5),
                         fused_add_rms_norm_ref(x, residual, weight, 1e-5)):
        torch.testing.assert_close(got, want, **tol)

    x = torch.randn(4, 3, 2 * 1536).to(dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **tol)


# ------------------------------------------------------------ Triton on CUDA

GPU_TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
           torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Exact up to rounding order: one or two units in the last place.
GPU_ELEMENTWISE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
                       torch.float16: dict(atol=1e-3, rtol=2e-3),
                       torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}


def gpu_batches(rng: torch.Generator) -> dict[str, tuple[list[int], list[int]]]:
    def lens(n: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=rng).tolist()

    decode_ctx = lens(48, 1, 3000)
    chunk_q, chunk_ctx = lens(4, 2, 300), lens(4, 0, 1500)
    return {
        "decode": ([1] * 48, decode_ctx),
        "prefill": (lens(3, 2, 700) + [1], None),
        "mixed": ([1] * 16 + chunk_q + [0, 0],
                  lens(16, 1, 2000) + [q + c for q, c in zip(chunk_q, chunk_ctx)] + [0, 0]),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [
    *[(s, torch.bfloat16) for s in SHAPES],
    *[(s, torch.float16) for s in SHAPES],
    (SHAPES[2], torch.float32),
    (SHAPES[3], torch.float32),
], ids=lambda p: "bs%d-d%d-h%d-kv%d" % p if isinstance(p, tuple) else str(p))
def test_gpu_attention(shape, dtype):
    block_size, head_dim, num_heads, num_kv_heads = shape
    rng = torch.Generator().manual_seed(sum(shape))
    for name, (q_lens, seq_lens) in gpu_batches(rng).items():
        seq_lens = seq_lens or q_lens
        batch = paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                            dtype, "cuda", pad_tokens=3)
        want = paged_attention_ref(**batch)
        out = paged_attention(**batch)
        torch.testing.assert_close(out[:want.shape[0]], want, **GPU_TOL[dtype], msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16, 37])
def test_gpu_attention_splits_and_unwritten_slots(num_splits):
    from kernels.triton_attention import AttentionConfig, paged_attention_triton

    batch = paged_batch([1] * 6 + [37], [4096, 1, 17, 1000, 2500, 33, 300], 32, 8, 128, 16,
                        torch.bfloat16, "cuda")
    want = paged_attention_ref(**batch)
    poison_unused_slots(batch)
    out = paged_attention_triton(**batch, config=AttentionConfig(num_splits=num_splits))
    torch.testing.assert_close(out, want, **GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_attention_cuts_a_long_decode_among_many_short_ones():
    from kernels.triton_attention import paged_attention_triton

    # 80 decodes fill the SMs unsplit; the 12k context still goes in pieces.
    seq_lens = [12000] + [700 + 13 * i for i in range(79)]
    batch = paged_batch([1] * 80, seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    want = paged_attention_ref(**batch)
    poison_unused_slots(batch)
    out = paged_attention_triton(**batch)
    torch.testing.assert_close(out, want, **GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_decode_step_replays_in_cuda_graph():
    """Rotary + KV write + attention captured once with fixed bounds, replayed over new lengths."""
    num_seqs, bound = 8, 2048
    batch = paged_batch([1] * num_seqs, [bound] * num_seqs, 8, 2, 128, 16, torch.bfloat16, "cuda")
    static = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    new_k = torch.zeros(num_seqs, 2, 128, dtype=torch.bfloat16, device="cuda")
    new_v = torch.zeros_like(new_k)
    slots = torch.zeros(num_seqs, dtype=torch.int64, device="cuda")
    # Position 0 everywhere: the rotation is the identity, so the pool must hold new_k as is.
    positions = torch.zeros(num_seqs, dtype=torch.int64, device="cuda")
    cos_sin = build_cos_sin_cache(128, 1, 10000.0).cuda()

    def step() -> torch.Tensor:
        apply_rotary_and_write_kv(positions, new_k, new_k, new_v, cos_sin, static["k_cache"],
                                  static["v_cache"], slots)
        return paged_attention(**static, max_query_len=1, max_seq_len=bound,
                               scale=batch["scale"])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, bound + 1, (num_seqs,), generator=g)
        lens[-1] = 0  # a padding sequence: no query, no slot
        static["seq_lens"].copy_(lens)
        static["query_start_loc"].copy_(torch.tensor([0, *range(1, num_seqs), num_seqs - 1]))
        # Named apart from `positions`: rebinding the name step() reads would free the tensor
        # the graph captured, and its replays would read whatever took that memory.
        last = (lens - 1).clamp(min=0)
        block_ids = static["block_tables"].cpu().gather(1, (last // 16)[:, None])[:, 0]
        slot_ids = block_ids * 16 + last % 16
        slot_ids[-1] = -1
        slots.copy_(slot_ids)
        new_k.copy_(torch.randn(new_k.shape, generator=g))
        new_v.copy_(torch.randn(new_v.shape, generator=g))
        want_k, want_v = static["k_cache"].clone(), static["v_cache"].clone()
        graph.replay()

        write_kv_ref(new_k, new_v, want_k, want_v, slots)
        assert torch.equal(static["k_cache"], want_k) and torch.equal(static["v_cache"], want_v)
        want = paged_attention_ref(static["q"], want_k, want_v, static["block_tables"],
                                   static["seq_lens"], static["query_start_loc"], 1,
                                   int(lens.max()), batch["scale"])
        torch.testing.assert_close(out[:num_seqs - 1], want, **GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_kv_write_and_copy_blocks(dtype):
    rng = torch.Generator().manual_seed(1)
    for block_size, num_kv_heads, head_dim in [(16, 8, 128), (32, 3, 64)]:
        shape = (64, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=rng).to(dtype).cuda()
        v_cache = torch.randn(shape, generator=rng).to(dtype).cuda()
        want_k, want_v = k_cache.clone(), v_cache.clone()
        kv = torch.randn(300, 2, num_kv_heads, head_dim, generator=rng).to(dtype).cuda()
        slots = torch.randperm(64 * block_size, generator=rng)[:300]
        slots[::7] = -1
        write_kv_ref(kv[:, 0], kv[:, 1], want_k, want_v, slots.cuda())
        write_kv_unrotated(kv[:, 0], kv[:, 1], k_cache, v_cache, slots.cuda())
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

        caches = [k_cache, v_cache, torch.randn(64, 7, 33, generator=rng).to(dtype).cuda()]
        want = [c.clone() for c in caches]
        pairs = torch.stack([torch.arange(0, 20), torch.arange(30, 50)], 1)
        copy_blocks_ref(want, pairs)
        copy_blocks(caches, pairs)
        assert all(torch.equal(c, w) for c, w in zip(caches, want))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_KV_DTYPE], ids=str)
def test_gpu_swaps_are_ordered_by_the_stream_alone(dtype):
    """A swap-out after device work that is still queued copies what that work wrote; blocks
    rewritten right after it, and a swap-in back to other blocks, all without a host wait,
    leave the swapped data intact (the runner's layouts: a [layers, K/V, blocks, ...] pool
    seen block-first, a pinned block-first host pool; host runs 10-12 and 20)."""
    as_bytes = (lambda t: t.view(torch.uint8)) if dtype == FP8_KV_DTYPE else (lambda t: t)
    pool = torch.randn(3, 2, 64, 16, 2, 32, device="cuda").to(dtype)
    device = pool.transpose(0, 2)
    host = torch.empty(32, *device.shape[1:], dtype=dtype, pin_memory=True)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):     # keeps the stream busy, so that the writes below are still queued
        busy = busy @ busy / 64
    written = as_bytes(torch.randn(4, *device.shape[1:], device="cuda").to(dtype))
    out_blocks, host_blocks, in_blocks = [5, 9, 2, 40], [10, 11, 12, 20], [1, 3, 4, 60]
    as_bytes(device)[out_blocks] = written
    swap_blocks(device, host, torch.tensor(list(zip(out_blocks, host_blocks))))
    as_bytes(device)[out_blocks] = torch.zeros_like(written)    # the freed blocks reused at once
    swap_blocks(host, device, torch.tensor(list(zip(host_blocks, in_blocks))))
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(host)[host_blocks].cuda(), written)
    assert torch.equal(as_bytes(device)[in_blocks], written)
    assert not as_bytes(device)[out_blocks].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [576, 4096, 5120])
def test_gpu_norms(dtype, hidden):
    rng = torch.Generator().manual_seed(hidden)
    x = torch.randn(37, hidden, generator=rng).to(dtype).cuda()
    residual = torch.randn(37, hidden, generator=rng).to(dtype).cuda()
    weight = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype).cuda()
    tol = GPU_ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **tol)
    for got, want in zip(fused_add_rms_norm(x, residual, weight, 1e-6),
                         fused_add_rms_norm_ref(x, residual, weight, 1e-6)):
        torch.testing.assert_close(got, want, **tol)
    # fp32 residual stream under a 16-bit hidden state
    for got, want in zip(fused_add_rms_norm(x, residual.float(), weight, 1e-6),
                         fused_add_rms_norm_ref(x, residual.float(), weight, 1e-6)):
        torch.testing.assert_close(got, want, **GPU_ELEMENTWISE_TOL[torch.float32])


def assert_quantized_as(got: Fp8Activation, stored: torch.Tensor, quantize=per_token_quant) -> None:
    """`got` is `stored` quantized per token by `quantize`, bit for bit: scales and float8
    values; the scales are the reference's on the same device too (they involve no float8
    cast; torch's division by a scalar differs between the CPU and CUDA in the last bit).
    float32 on CUDA is held to less: the fused kernel's row differs from the plain kernel's
    stored one in the last bits of some rows (measured on an H100), so the scales agree to a
    few float32 ulps and the values to one float8 step."""
    rows = stored.reshape(-1, stored.shape[-1])
    want_values, want_scale = quantize(rows)
    assert got.values.dtype == FP8_DTYPE and got.values.shape == stored.shape and got.dtype == stored.dtype
    values = got.values.reshape(want_values.shape)
    if stored.dtype == torch.float32 and stored.is_cuda:
        torch.testing.assert_close(got.scale, want_scale, rtol=1e-6, atol=0)
        step = torch.maximum(want_values.float().abs() / 8, torch.tensor(2.0 ** -9, device=stored.device))
        assert ((values.float() - want_values.float()).abs() <= step).all()
        return
    assert torch.equal(got.scale, want_scale) and torch.equal(got.scale, per_token_quant_ref(rows)[1])
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))


def test_norms_and_silu_quantize_their_result_on_the_cpu_as_per_token_quant():
    x, residual, weight = torch.randn(2, 3, 64), torch.randn(2, 3, 64), torch.randn(64)
    assert_quantized_as(rms_norm(x, weight, 1e-5, quantize=True), rms_norm(x, weight, 1e-5))
    got, summed = fused_add_rms_norm(x, residual, weight, 1e-5, quantize=True)
    want, want_summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_quantized_as(got, want)
    assert torch.equal(summed, want_summed)
    gate_up = torch.randn(5, 128)
    assert_quantized_as(silu_and_mul(gate_up, quantize=True), silu_and_mul(gate_up))


@interpreter_only
def test_interp_elementwise_take_any_float_dtype_unquantized():
    """float64 too: the rounding type the kernels are given is named after the torch dtype, not
    looked up in a list of the serving dtypes. Both kernels compute in float32, so the results
    are float32-accurate (the norm's sum of squares differs from the float64 reference's)."""
    from kernels.triton_activation import silu_and_mul_triton
    from kernels.triton_norm import rms_norm_triton

    rng = torch.Generator().manual_seed(64)
    x = torch.randn(3, 200, generator=rng, dtype=torch.float64)
    weight = torch.rand(200, generator=rng, dtype=torch.float64)
    tol = INTERP_TOL[torch.float32]
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **tol)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **tol)


@interpreter_only
@pytest.mark.parametrize("dtype", INTERP_DTYPES, ids=str)
def test_interp_elementwise_quantized_as_per_token_quant_of_their_result(dtype):
    """The norm and SiLU-and-mul kernels that write a W8A8 linear's input quantized: each
    row's scale and values as the quantization kernel makes of what they write unquantized
    (ragged widths: masked lanes must not count in a row's amax)."""
    from kernels.fp8 import FP8_MAX, MIN_SCALE
    from kernels.triton_activation import silu_and_mul_triton
    from kernels.triton_fp8 import per_token_quant_triton
    from kernels.triton_norm import fused_add_rms_norm_triton, rms_norm_triton

    def quantize(t):    # the interpreter's float8 cast on both sides (it is not torch's)
        return per_token_quant_triton(t, FP8_DTYPE, FP8_MAX, MIN_SCALE)

    x, residual = torch.randn(2, 3, 576).to(dtype) * 4, torch.randn(2, 3, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    assert_quantized_as(rms_norm_triton(x, weight, 1e-5, quantize=True), rms_norm_triton(x, weight, 1e-5), quantize)
    got, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-5, quantize=True)
    want, want_summed = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    assert_quantized_as(got, want, quantize)
    assert torch.equal(summed, want_summed)
    gate_up = -torch.rand(4, 3, 2 * 1500).to(dtype)     # negative gates: the amax is not at a masked lane's 0
    assert_quantized_as(silu_and_mul_triton(gate_up, quantize=True), silu_and_mul_triton(gate_up), quantize)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden,width", [(576, 1536), (4096, 14336), (5120, 100)])
def test_gpu_norms_and_silu_write_what_per_token_quant_makes_of_their_result(dtype, hidden, width):
    """Bit for bit in 16-bit dtypes (float32: `assert_quantized_as`): quantizing in the norm or
    activation kernel changes no value and no scale, the residual sum included; an all-zero
    row takes the floor scale."""
    rng = torch.Generator().manual_seed(hidden)
    x = torch.randn(37, hidden, generator=rng).to(dtype).cuda()
    x[3] = 0
    residual = torch.randn(37, hidden, generator=rng).to(dtype).cuda()
    weight = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype).cuda()
    assert_quantized_as(rms_norm(x, weight, 1e-6, quantize=True), rms_norm(x, weight, 1e-6))
    got, summed = fused_add_rms_norm(x, residual, weight, 1e-6, quantize=True)
    want, want_summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_quantized_as(got, want)
    assert torch.equal(summed, want_summed)
    gate_up = torch.randn(65, 2 * width, generator=rng).to(dtype).cuda()
    gate_up[7] = 0
    assert_quantized_as(silu_and_mul(gate_up, quantize=True), silu_and_mul(gate_up))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
# (8, 1): one KV head, as a multi-query model has, or a rank of Llama-3-8B's 8 under 8-way TP.
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((9, 3), 64), ((16, 16), 64), ((8, 1), 128)])
def test_gpu_rotary_and_kv_write(dtype, heads, head_dim):
    num_heads, num_kv_heads = heads
    rng = torch.Generator().manual_seed(head_dim)
    cache = build_cos_sin_cache(head_dim, 8192, 500000.0).cuda()
    positions = torch.randint(0, 8192, (333,), generator=rng).cuda()
    qkv = torch.randn(333, num_heads + 2 * num_kv_heads, head_dim, generator=rng).to(dtype).cuda()
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    k_cache = torch.randn(40, 16, num_kv_heads, head_dim, generator=rng).to(dtype).cuda()
    v_cache = torch.randn_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(40 * 16, generator=rng)[:333].cuda()
    slots[::5] = -1
    want_q = rotary_and_write_ref(positions, q, k, v, cache, want_k, want_v, slots)
    got_q = apply_rotary_and_write_kv(positions, q, k, v, cache, k_cache, v_cache, slots)
    torch.testing.assert_close(got_q, want_q, **GPU_ELEMENTWISE_TOL[dtype])
    torch.testing.assert_close(k_cache, want_k, **GPU_ELEMENTWISE_TOL[dtype])
    assert torch.equal(v_cache, want_v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [1536, 14336, 100])
def test_gpu_silu_and_mul(dtype, width):
    x = torch.randn(65, 2 * width, generator=torch.Generator().manual_seed(width))
    x = x.to(dtype).cuda()
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **GPU_ELEMENTWISE_TOL[dtype])
    assert torch.equal(silu_and_mul(x[:, None]), silu_and_mul(x)[:, None])


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_attention_over_a_float8_pool(q_dtype):
    """Each batch kind over a float8 pool with per-head scales, against the reference."""
    block_size, head_dim, num_heads, num_kv_heads = SHAPES[3]
    rng = torch.Generator().manual_seed(3)
    k_scale = torch.rand(num_kv_heads, generator=rng).cuda() * 0.2 + 0.01
    v_scale = torch.rand(num_kv_heads, generator=rng).cuda() * 0.2 + 0.01
    for name, (q_lens, seq_lens) in gpu_batches(rng).items():
        batch = paged_batch(q_lens, seq_lens or q_lens, num_heads, num_kv_heads, head_dim,
                            block_size, q_dtype, "cuda", pad_tokens=3)
        for cache in ("k_cache", "v_cache"):
            batch[cache] = (batch[cache].float() * 30).to(FP8_KV_DTYPE)
        want = paged_attention_ref(**batch, k_scale=k_scale, v_scale=v_scale)
        out = paged_attention(**batch, k_scale=k_scale, v_scale=v_scale)
        torch.testing.assert_close(out[:want.shape[0]], want, **GPU_TOL[q_dtype], msg=name)


@pytest.mark.gpu
def test_gpu_kv_write_to_a_float8_pool_rounds_as_the_reference():
    rng = torch.Generator().manual_seed(2)
    shape = (64, 16, 8, 128)
    k_cache = torch.zeros(shape, dtype=FP8_KV_DTYPE, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv = (torch.randn(300, 2, 8, 128, generator=rng) * 4).to(torch.bfloat16).cuda()
    kv[0, 0, 0, 0] = 1e9        # saturates, never NaN
    k_scale, v_scale = (torch.rand(8, generator=rng).cuda() * 0.05 + 1e-3 for _ in range(2))
    slots = torch.randperm(64 * 16, generator=rng)[:300].cuda()
    slots[::7] = -1
    write_kv_ref(kv[:, 0], kv[:, 1], want_k, want_v, slots, k_scale, v_scale)
    write_kv_unrotated(kv[:, 0], kv[:, 1], k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert not k_cache.float().isnan().any()

    pairs = torch.stack([torch.arange(0, 20), torch.arange(30, 50)], 1)
    copy_blocks([k_cache, v_cache], pairs)
    assert torch.equal(k_cache[30:50].view(torch.uint8), k_cache[0:20].view(torch.uint8))
