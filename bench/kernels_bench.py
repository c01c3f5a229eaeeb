"""Micro-benchmarks of the Triton kernels on one GPU.

Memory-bound kernels report achieved bandwidth (bytes that must cross HBM: K/V read plus
q/out for attention, inputs read plus outputs written elsewhere) against the copy ceiling
measured on an H200 (4.25 TB/s, counting bytes read and written), and against a copy
measured in this run. Prefill attention reports TFLOP/s of the causal work actually
needed (4 * head_dim * heads per visible query-key pair). Shapes are Llama-3.1-8B's
(32 query heads, 8 KV heads, head dim 128, hidden 4096, intermediate 14336), bf16, block 16.

Each Triton timing is the median over replays of a CUDA graph holding several calls, so
it is GPU time without launch overhead (decode runs that way in the worker); the torch
reference column is eager time, for scale.

    python bench/kernels_bench.py --out kernels.json [--sweep]
"""

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from kernels.attention import paged_attention_ref  # noqa: E402
from kernels.cache import write_kv_ref  # noqa: E402
from kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from kernels.rotary import apply_rotary_and_write_kv, apply_rotary_ref, build_cos_sin_cache  # noqa: E402
from kernels.triton_attention import AttentionConfig, paged_attention_triton  # noqa: E402

COPY_CEILING = 4.25e12  # bytes/s, device-to-device copy on an H200 (read + written)
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
BLOCK_SIZE = 16
DTYPE = torch.bfloat16

DECODE_SWEEP = [
    AttentionConfig(num_splits=2), AttentionConfig(num_splits=4), AttentionConfig(num_splits=8),
    AttentionConfig(decode_block_n=32), AttentionConfig(decode_block_n=128),
    AttentionConfig(decode_num_warps=8), AttentionConfig(decode_num_stages=2),
]
PREFILL_SWEEP = [
    AttentionConfig(prefill_num_stages=2), AttentionConfig(prefill_num_warps=8),
    AttentionConfig(prefill_block_m=64), AttentionConfig(prefill_block_n=32),
    AttentionConfig(prefill_block_n=128, prefill_num_warps=8, prefill_num_stages=2),
]


def graph_time(fn: Callable[[], object], calls: int = 10, reps: int = 15) -> float:
    """Median seconds per call over replays of a graph of `calls` back-to-back calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def eager_time(fn: Callable[[], object], calls: int = 5, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def attention_batch(q_lens: list[int], seq_lens: list[int], seed: int = 0) -> dict:
    """Inputs of one step over a pool whose blocks are handed out in random order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [triton.cdiv(n, BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, device="cuda", generator=g).int()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for s, n in enumerate(blocks):
        table[s, :n] = order[start:start + n]
        start += n
    pool = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        q=torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", generator=g, dtype=DTYPE),
        k_cache=torch.randn(pool, device="cuda", generator=g, dtype=DTYPE),
        v_cache=torch.randn(pool, device="cuda", generator=g, dtype=DTYPE),
        block_tables=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=qsl.cuda(), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        scale=HEAD_DIM ** -0.5)


def describe(cfg: AttentionConfig) -> str:
    """The fields that differ from the default configuration."""
    default = AttentionConfig()
    return " ".join(f"{k}={v}" for k, v in vars(cfg).items() if getattr(default, k) != v)


def attention_cost(q_lens: list[int], seq_lens: list[int]) -> tuple[int, int]:
    """(bytes that must move, FLOPs of the visible query-key pairs) of one step."""
    elem = torch.finfo(DTYPE).bits // 8
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * elem
    q_out_bytes = sum(q_lens) * HEADS * HEAD_DIM * 2 * elem
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(q_lens, seq_lens))
    return kv_bytes + q_out_bytes, 4 * HEAD_DIM * HEADS * pairs


def row(name: str, seconds: float, nbytes: int = 0, flops: int = 0,
        ref_seconds: float | None = None, copy_bw: float | None = None) -> dict:
    r = {"name": name, "us": seconds * 1e6, "bytes": nbytes, "flops": flops}
    if nbytes:
        r["tb_per_s"] = nbytes / seconds / 1e12
        r["pct_of_4.25TBps"] = 100 * nbytes / seconds / COPY_CEILING
        if copy_bw:
            r["pct_of_copy_this_run"] = 100 * nbytes / seconds / copy_bw
    if flops:
        r["tflop_per_s"] = flops / seconds / 1e12
    if ref_seconds is not None:
        r["torch_ref_us"] = ref_seconds * 1e6
    return r


def bench_copy() -> float:
    """Bytes read + written per second by a 1 GiB device copy, timed eagerly: captured in a
    graph, the copy becomes a memcpy node that ran at only ~2.8 TB/s on an H200."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / eager_time(lambda: dst.copy_(src))


def bench_attention(sweep: bool, copy_bw: float) -> list[dict]:
    rows = []
    for num_seqs, ctx in [(64, 4096), (16, 4096), (256, 1024), (8, 32768)]:
        q_lens, seq_lens = [1] * num_seqs, [ctx] * num_seqs
        batch = attention_batch(q_lens, seq_lens)
        nbytes, flops = attention_cost(q_lens, seq_lens)
        ref = eager_time(lambda: paged_attention_ref(**batch)) if ctx <= 4096 else None
        configs = [AttentionConfig()] + (DECODE_SWEEP if sweep and num_seqs in (16, 64) else [])
        for cfg in configs:
            t = graph_time(lambda: paged_attention_triton(**batch, config=cfg))
            label = describe(cfg)
            rows.append(row(f"decode attn {num_seqs}x{ctx} {label}".strip(), t, nbytes, flops,
                            None if label else ref, copy_bw))

    # Prefill: 8 fresh prompts of 2048; mixed: 4 chunks of 2048 over earlier context, next
    # to 64 decodes of 4096 (no torch reference: its masked SDPA would need ~150 GB).
    cases = {"prefill 8x2048": ([2048] * 8, [2048] * 8, True),
             "mixed 4x2048 chunks (ctx 0-6144) + 64 decodes@4096":
                 ([2048] * 4 + [1] * 64, [2048, 4096, 6144, 8192] + [4096] * 64, False)}
    for name, (q_lens, seq_lens, with_ref) in cases.items():
        batch = attention_batch(q_lens, seq_lens)
        _, flops = attention_cost(q_lens, seq_lens)
        ref = eager_time(lambda: paged_attention_ref(**batch), 2, 3) if with_ref else None
        configs = [AttentionConfig()] + (PREFILL_SWEEP if sweep else [])
        for cfg in configs:
            t = graph_time(lambda: paged_attention_triton(**batch, config=cfg), calls=3, reps=5)
            label = describe(cfg)
            rows.append(row(f"{name} {label}".strip(), t, 0, flops, None if label else ref))
    return rows


def rotary_then_write_ref(positions, q, k, v, cos_sin, k_cache, v_cache, slots) -> torch.Tensor:
    q, k = apply_rotary_ref(positions, q, k, cos_sin)
    write_kv_ref(k, v, k_cache, v_cache, slots)
    return q


def bench_elementwise(copy_bw: float) -> list[dict]:
    tokens, elem = 8192, 2
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos_sin = build_cos_sin_cache(HEAD_DIM, 8192, 500000.0).cuda()
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE)
    k_cache = torch.empty(tokens // BLOCK_SIZE, BLOCK_SIZE, KV_HEADS, HEAD_DIM,
                          device="cuda", dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(tokens, device="cuda")

    act = tokens * HIDDEN * elem
    qk = tokens * (HEADS + KV_HEADS) * HEAD_DIM * elem
    kv = tokens * KV_HEADS * HEAD_DIM * elem
    cases = [
        (f"rms_norm {tokens}x{HIDDEN}", lambda: rms_norm(x, weight, 1e-5),
         lambda: rms_norm_ref(x, weight, 1e-5), 2 * act),
        (f"fused_add_rms_norm {tokens}x{HIDDEN}",
         lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
         lambda: fused_add_rms_norm_ref(x, residual, weight, 1e-5), 4 * act),
        (f"rotary + write_kv {tokens} tok 32+8 heads",
         lambda: apply_rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots),
         lambda: rotary_then_write_ref(positions, q, k, v, cos_sin, k_cache, v_cache, slots),
         2 * qk + 2 * kv + tokens * HEAD_DIM * 4),
        (f"silu_and_mul {tokens}x{INTERMEDIATE}", lambda: silu_and_mul(gate_up),
         lambda: silu_and_mul_ref(gate_up), 3 * tokens * INTERMEDIATE * elem),
    ]
    return [row(name, graph_time(fn), nbytes, 0, eager_time(ref), copy_bw)
            for name, fn, ref, nbytes in cases]


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':<72} {'us':>9} {'TB/s':>6} {'%4.25':>6} {'%copy':>6} {'TFLOP/s':>8}"
          f" {'torch us':>9}")
    for r in rows:
        def fmt(key: str, spec: str) -> str:
            return format(r[key], spec) if key in r else "-"
        print(f"{r['name']:<72} {r['us']:>9.1f} {fmt('tb_per_s', '.2f'):>6}"
              f" {fmt('pct_of_4.25TBps', '.1f'):>6} {fmt('pct_of_copy_this_run', '.1f'):>6}"
              f" {fmt('tflop_per_s', '.1f'):>8} {fmt('torch_ref_us', '.1f'):>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true",
                        help="also time alternative attention tile configurations")
    args = parser.parse_args()

    copy_bw = bench_copy()
    rows = [row("copy 1 GiB (device to device)", 2 ** 31 / copy_bw, 2 ** 31)]
    rows += bench_attention(args.sweep, copy_bw)
    rows += bench_elementwise(copy_bw)
    print_table(rows)
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "copy_tb_per_s": copy_bw / 1e12,
                "copy_ceiling_tb_per_s": COPY_CEILING / 1e12}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
