"""Decode attention over a float8 KV pool against a bfloat16 one, on the 8B shape (32 query
heads, 8 KV heads, head dim 128), one GPU: the default (128-key tiles, float16 queries) and a
sweep of tile shapes, split counts, pipeline stages and warps, each timed in CUDA-graph replays (kernels_bench's
timer). The 2026-12-01 runs in docs/BENCHMARKS.md had also query-dtype and tile variants that are
the default since.
`tbps` is the bytes of K/V the kernel must read over its time; `vs_bf16`, its time over the
bfloat16 pool's default; `max_err`, the largest difference from the bfloat16 pool's output.

    python bench/fp8_attention_sweep.py     # writes $OUT/probe.json (default ./out)
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from kernels_bench import HEAD_DIM, KV_HEADS, attention_batch, graph_time  # noqa: E402

from kernels.triton_attention import AttentionConfig, decode_splits, paged_attention_triton  # noqa: E402


def main() -> None:
    out = []
    for num_seqs, ctx in [(1, 32768), (8, 32768), (64, 4096)]:
        b = attention_batch([1] * num_seqs, [ctx] * num_seqs)
        kv16 = num_seqs * ctx * KV_HEADS * HEAD_DIM * 2 * 2
        base = graph_time(lambda: paged_attention_triton(**b))
        out.append(dict(case=f"{num_seqs}x{ctx}", variant="bf16 pool", us=base * 1e6, tbps=kv16 / base / 1e12))
        ks = torch.rand(KV_HEADS, device="cuda") * 0.01 + 0.01
        vs = torch.rand(KV_HEADS, device="cuda") * 0.01 + 0.01
        f8 = dict(b)
        f8["k_cache"] = (b["k_cache"].float() / ks[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        f8["v_cache"] = (b["v_cache"].float() / vs[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        ref = paged_attention_triton(**b).float()
        for name, q, cfg in [("fp8 default", b["q"], AttentionConfig()),
                             ("fp8 2x splits", b["q"], AttentionConfig(num_splits=2 * decode_splits(num_seqs, KV_HEADS, ctx, 128, torch.device("cuda"))[0])),
                             ("fp8 4x splits", b["q"], AttentionConfig(num_splits=4 * decode_splits(num_seqs, KV_HEADS, ctx, 128, torch.device("cuda"))[0])),
                             ("fp8 s2", b["q"], AttentionConfig(decode_num_stages=2)),
                             ("fp8 n256", b["q"], AttentionConfig(decode_block_n=256)),
                             ("fp8 n64", b["q"], AttentionConfig(decode_block_n=64)),
                             ("fp8 s4", b["q"], AttentionConfig(decode_num_stages=4)),
                             ("fp8 w8", b["q"], AttentionConfig(decode_num_warps=8)),
                             ("fp8 n256 w8", b["q"], AttentionConfig(decode_block_n=256, decode_num_warps=8)),
                             ("bf16 n128", None, AttentionConfig(decode_block_n=128))]:
            try:
                if q is None:
                    t = graph_time(lambda: paged_attention_triton(**b, config=cfg))
                    err = 0.0
                else:
                    args = dict(f8, q=q)
                    t = graph_time(lambda: paged_attention_triton(**args, config=cfg, k_scale=ks, v_scale=vs))
                    err = (paged_attention_triton(**args, config=cfg, k_scale=ks, v_scale=vs).float() - ref).abs().max().item()
                out.append(dict(case=f"{num_seqs}x{ctx}", variant=name, us=t * 1e6, vs_bf16=t / base, max_err=err,
                                tbps=(kv16 // (2 if q is not None else 1)) / t / 1e12))
            except Exception as e:
                out.append(dict(case=f"{num_seqs}x{ctx}", variant=name, error=repr(e)[:300]))
            print(json.dumps(out[-1]), flush=True)
    Path(os.environ.get("OUT", "out"), "probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
