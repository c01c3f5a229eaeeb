"""FP8 W8A8: the kernels (reference against fp32 matmuls; cuBLAS' against the reference on a
GPU), `--quantization fp8` on load, and compressed-tensors checkpoints written by the real
library against transformers. (Hugging Face's block-scaled fp8: tests/test_fp8_grouped.py.)

Tolerances, measured on this CPU where a figure is given:
- one W8A8 linear vs the fp32 matmul: relative error (Frobenius) < 6 % (measured 3.6 %):
  e4m3 keeps 3 mantissa bits, so each operand is off by up to 1/16 of itself.
- a checkpoint loaded here vs transformers' decompressed load with its linears' inputs
  quantized per token as here: 1e-5 (measured 5e-7 on logits up to 1.0: float32 rounding
  only); without that input quantization (W8A16, what transformers computes): < 5 % relative
  (measured 1.6-2.1 %, and 1.6 % on two ranks).
- SmolLM2-shaped random weights quantized on load vs unquantized: logits within 20 % relative
  (measured 13 %: random layers do not damp each other's rounding).
- SmolLM2-135M quantized on load vs unquantized, teacher-forced over 150 tokens of text: mean
  KL < 0.06 nats (measured 0.032), top-1 agreement > 80 % (measured 87 %).
"""

import argparse
import importlib.util
import json
import logging
import os
import weakref

import pytest
import torch
from helpers import (
    LONG_STORY,
    PROMPTS,
    engine_prompt_logits,
    generate,
    greedy,
    run_interpreter_tests,
    tiny_hf_model,
    tiny_llama,
)
from safetensors.torch import load_file

from kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    W8A16_MAX_M,
    Fp8Activation,
    dequantize_blocks,
    fp8_linear,
    fp8_linear_ref,
    fp8_linear_w8a8,
    fp8_weight_only_ref,
    per_channel_quant,
    per_token_quant,
    per_token_quant_ref,
    w8a8_applies,
)
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.flags import add_engine_args, engine_config_from_args
from worker.models import quantization
from worker.models.loader import (
    ModelLoadError,
    config_from_hf,
    load_model,
    resolve_source,
)
from worker.models.quantization import Fp8Linear

CPU = torch.device("cpu")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreter_only = pytest.mark.skipif(
    not INTERPRETING, reason="run by test_triton_interpreter in a TRITON_INTERPRET=1 subprocess")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ kernels

def test_per_token_quant_gives_each_row_its_own_scale():
    x = randn(7, 200) * torch.logspace(-3, 2, 7)[:, None]       # rows five decades apart
    x_q, scale = per_token_quant(x)
    assert x_q.dtype == FP8_DTYPE and scale.shape == (7, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, x.abs().amax(dim=1, keepdim=True) / FP8_MAX)
    # Every value within half a step of e4m3: 1/16 of itself, or half the smallest subnormal.
    error = (x_q.float() * scale - x).abs()
    assert (error <= x.abs() / 16 + scale * 2.0 ** -10).all()


def test_per_token_quant_of_no_rows_and_of_zero_rows():
    x_q, scale = per_token_quant(torch.empty(0, 64))
    assert x_q.shape == (0, 64) and scale.shape == (0, 1)
    x_q, scale = per_token_quant(torch.zeros(3, 64))
    assert (x_q.float() == 0).all() and torch.isfinite(scale).all() and (scale > 0).all()


def test_per_channel_quant_scales_each_output_channel_over_k():
    w = randn(72, 200) * torch.linspace(0.1, 3.0, 72)[:, None]
    w_q, scale = per_channel_quant(w)
    assert w_q.shape == (72, 200) and scale.shape == (72,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / FP8_MAX)
    assert (w_q.float().abs().amax(dim=1) == FP8_MAX).all()      # each row's largest hits 448


@pytest.mark.parametrize("m", [1, 7, 130])
def test_fp8_linear_ref_is_close_to_the_fp32_matmul_on_ragged_shapes(m):
    x, w, bias = randn(m, 200, seed=1), randn(72, 200, seed=2), randn(72, seed=3)
    w_q, w_scale = per_channel_quant(w)
    out = fp8_linear_ref(x, w_q, w_scale, bias)
    assert out.shape == (m, 72) and out.dtype == torch.float32
    assert rel_error(out - bias, x @ w.T) < 0.06


def test_fp8_linear_ref_computes_the_dequantized_product():
    x, w = randn(7, 200, seed=1), randn(72, 200, seed=2)
    w_q, w_scale = per_channel_quant(w)
    x_q, x_scale = per_token_quant(x)
    expected = (x_q.float() * x_scale) @ (w_q.float() * w_scale[:, None]).T
    torch.testing.assert_close(fp8_linear_ref(x, w_q, w_scale), expected, rtol=1e-5, atol=1e-5)


def test_fp8_linear_keeps_leading_dimensions_zero_tokens_and_the_output_dtype():
    w_q, w_scale = per_channel_quant(randn(48, 32))
    assert fp8_linear(randn(2, 5, 32), w_q, w_scale).shape == (2, 5, 48)
    assert fp8_linear(torch.empty(0, 32), w_q, w_scale).shape == (0, 48)
    assert fp8_linear(randn(3, 32).bfloat16(), w_q, w_scale).dtype == torch.bfloat16


def test_w8a8_applies_on_cuda_past_the_w8a16_rows_to_shapes_cublas_takes():
    """Shapes only (no GPU needed): the rows `fp8_linear` gives W8A16 and the CPU's emulation
    never take a quantized input; nor does a shape cuBLAS' FP8 GEMM refuses."""
    cuda, weight = torch.device("cuda"), torch.zeros(64, 128, dtype=FP8_DTYPE)
    assert w8a8_applies(W8A16_MAX_M + 1, torch.bfloat16, cuda, weight)
    assert not w8a8_applies(W8A16_MAX_M, torch.bfloat16, cuda, weight)
    assert not w8a8_applies(0, torch.bfloat16, cuda, weight)
    assert not w8a8_applies(W8A16_MAX_M + 1, torch.bfloat16, CPU, weight)
    assert not w8a8_applies(W8A16_MAX_M + 1, torch.bfloat16, cuda, torch.zeros(64, 120, dtype=FP8_DTYPE))


def test_fp8_linear_takes_activations_quantized_already_as_it_would_quantize_them():
    x, w, bias = randn(3, 5, 64, seed=1), randn(48, 64, seed=2), randn(48, seed=3)
    w_q, w_scale = per_channel_quant(w)
    quantized = Fp8Activation.of(x)
    assert quantized.values.shape == x.shape and quantized.scale.shape == (15, 1)
    for fn in (fp8_linear, fp8_linear_ref, fp8_linear_w8a8):
        out = fn(quantized, w_q, w_scale, bias)
        assert out.shape == (3, 5, 48) and out.dtype == x.dtype
        assert torch.equal(out, fp8_linear_ref(x, w_q, w_scale, bias))


def test_dequantize_blocks_scales_each_block_including_partial_ones():
    w_q = randn(40, 24).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = randn(3, 2).abs()                               # blocks of 16 x 16: 16 + 16 + 8 rows, 16 + 8 columns
    expected = torch.empty(40, 24)
    for i in range(40):
        for j in range(24):
            expected[i, j] = w_q[i, j].float() * scale[i // 16, j // 16]
    torch.testing.assert_close(dequantize_blocks(w_q, scale, (16, 16)), expected)


def test_fp8_weight_only_ref_multiplies_unquantized_activations():
    x, w, bias = randn(7, 200, seed=1), randn(72, 200, seed=2), randn(72, seed=3)
    w_q, w_scale = per_channel_quant(w)
    expected = x @ (w_q.float() * w_scale[:, None]).T + bias
    torch.testing.assert_close(fp8_weight_only_ref(x, w_q, w_scale, bias), expected, rtol=1e-5, atol=1e-5)
    # Only the weight is rounded: closer to the fp32 matmul than W8A8 (measured 2.5 % vs 3.6 %).
    assert rel_error(fp8_weight_only_ref(x, w_q, w_scale), x @ w.T) < rel_error(fp8_linear_ref(x, w_q, w_scale), x @ w.T)
    out = fp8_weight_only_ref(randn(2, 3, 200).bfloat16(), w_q, w_scale, out_dtype=torch.float16)
    assert out.shape == (2, 3, 72) and out.dtype == torch.float16


# ------------------------------------------ the W8A16 Triton kernel through its interpreter (CPU)

@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter run")
def test_triton_interpreter():
    """Runs this file's interpreter_only tests on the CPU, through Triton's interpreter."""
    run_interpreter_tests(__file__)


def interp_w8a16(m, n, k, dtype, bias=True, seed=0, config=None):
    from kernels.triton_fp8 import fp8_weight_only_triton

    x, w, b = randn(m, k, seed=seed).to(dtype), randn(n, k, seed=seed + 1), randn(n, seed=seed + 2).to(dtype)
    w_q, w_scale = per_channel_quant(w)
    out = fp8_weight_only_triton(x, w_q, w_scale, b if bias else None, dtype, config)
    return out, fp8_weight_only_ref(x, w_q, w_scale, b if bias else None)


# fp32: tf32x3 products, fp32 sums. fp16: the output's rounding (outputs of order 10-100).
INTERP_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=0.06, rtol=4e-3)}


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
def test_interp_w8a16_matches_the_weight_only_ref_on_ragged_shapes(m, dtype):
    """N = 136: ragged column tiles; K = 2100: a ragged last K-tile; the default configs
    (8 SMs assumed on CPU) split K for more than one row."""
    out, ref = interp_w8a16(m, 136, 2100, dtype, seed=m)
    assert out.dtype == dtype and out.shape == (m, 136)
    torch.testing.assert_close(out, ref, **INTERP_TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("mode", ["dot", "dot_t", "fma"])
@pytest.mark.parametrize("split_k", [1, 2, 3, 7])
def test_interp_w8a16_split_k_sums_partials_and_leaves_the_counters_at_zero(split_k, mode):
    from kernels.triton_split_k import TileConfig
    from kernels.triton_split_k import split_k_counters

    block_m = 1 if mode == "fma" else 16
    config = TileConfig(block_m=block_m, block_n=32, block_k=32, split_k=split_k, mode=mode)   # 7 K-tiles
    for _ in range(2):                       # the second call reuses the counters
        out, ref = interp_w8a16(min(3, block_m), 72, 224, torch.float32, seed=split_k, config=config)
        torch.testing.assert_close(out, ref, **INTERP_TOL[torch.float32])
    assert not split_k_counters(CPU, 1).any()


@interpreter_only
def test_interp_w8a16_without_bias_and_with_no_rows():
    out, ref = interp_w8a16(2, 48, 64, torch.float32, bias=False)
    torch.testing.assert_close(out, ref, **INTERP_TOL[torch.float32])
    out, _ = interp_w8a16(0, 48, 64, torch.float32)
    assert out.shape == (0, 48)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_interp_weight_only_kernel_takes_a_16_bit_weight_without_a_scale(dtype):
    """The one-row GEMV of the unquantized linears (`kernels.linear`): the weight in the
    activations' dtype, no scale, with and without a bias; ragged N and K; one split and
    several (the default config on a narrow layer, and a forced split)."""
    from kernels.triton_fp8 import fp8_weight_only_triton
    from kernels.triton_split_k import TileConfig

    for n, k, config in [(136, 2100, None), (40, 300, TileConfig(1, 16, 64, 3, mode="fma"))]:
        x, w, b = randn(1, k, seed=n).to(dtype), (randn(n, k, seed=k) * k ** -0.5).to(dtype), randn(n).to(dtype)
        for bias in (None, b):
            out = fp8_weight_only_triton(x, w, None, bias, dtype, config)
            ref = x.float() @ w.float().t() + (0 if bias is None else bias.float())
            assert out.dtype == dtype and out.shape == (1, n)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [W8A16_MAX_M + 1, 130])
def test_scaled_mm_path_matches_the_reference_on_cuda(m):
    x, w, bias = randn(m, 256, seed=1), randn(128, 256, seed=2), randn(128, seed=3)
    w_q, w_scale = per_channel_quant(w)
    cuda = [t.cuda() for t in (x.bfloat16(), w_q, w_scale, bias.bfloat16())]
    out = fp8_linear(*cuda)
    ref = fp8_linear_ref(*cuda)
    assert out.dtype == torch.bfloat16
    # The same quantized operands: only the summation order and bfloat16 rounding differ.
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.float().abs().max().item())
    # The W8A8 path at a small M too, as the bench times it.
    small = [cuda[0][:3]] + cuda[1:]
    torch.testing.assert_close(fp8_linear_w8a8(*small).float(), fp8_linear_ref(*small).float(),
                               rtol=1e-2, atol=1e-2 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_w8a16_path_matches_the_weight_only_ref_on_cuda(dtype):
    """Every M up to the threshold class edges, on Llama-like widths (split K and not) and a
    ragged shape; bias and no bias. Same operands as the reference: only the summation order
    and the output's rounding differ."""
    for n, k in [(6144, 4096), (4096, 14336), (28672, 4096), (1000, 200)]:
        w_q, w_scale = (t.cuda() for t in per_channel_quant(randn(n, k, seed=n) * k ** -0.5))
        bias = randn(n, seed=k).to(dtype).cuda()
        for m in sorted({1, 2, 7, 16, 17, 32, W8A16_MAX_M}):
            x = randn(m, k, seed=m).to(dtype).cuda()
            for b in (None, bias):
                out, ref = fp8_linear(x, w_q, w_scale, b), fp8_weight_only_ref(x, w_q, w_scale, b)
                assert out.dtype == dtype and out.shape == (m, n)
                tol = 1e-4 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item(),
                                           msg=lambda s, where=(n, k, m, b is None): f"{where}: {s}")


def compiled_for_hopper_ptx(kernel, types: dict, constexprs: dict, num_warps: int) -> str:
    """PTX of a Triton kernel compiled here for sm_90 (ptxas ships with Triton; no GPU used),
    pointers, strides, N and K taken as multiples of 16 as the engine's tensors give them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        signature[name] = "constexpr" if name in constexprs else types.get(name, "i32")
        if signature[name].startswith("*") or name.startswith("stride") or name in ("N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": constexprs["STAGES"]}).asm["ptx"]


@pytest.mark.skipif(INTERPRETING, reason="compiles the kernel, which the interpreter does not")
def test_one_row_gemv_compiled_for_hopper_stages_its_weight_loads_through_shared_memory():
    """Triton's pipeliner stages loads that feed no dot only where the loop asks for it
    (`tl.range(num_stages=...)`); a plain `range` compiles to no `cp.async` at any depth.
    Compiled for sm_90: the one-row loop at 4 stages issues them, at 1 it does not."""
    from kernels.triton_fp8 import _fp8_weight_only_kernel

    types = dict(out="*bf16", partial="*fp32", counters="*i32", x="*bf16", w="*fp8e4nv",
                 w_scale="*fp32", bias="*bf16")

    def cp_async_count(stages):
        constexprs = dict(HAS_SCALE=True, GROUP=0, HAS_BIAS=False, SPLIT=False, MODE="fma", BLOCK_M=1,
                          BLOCK_N=16, BLOCK_K=512, DOT_PRECISION="tf32", STAGES=stages, PDL=False)
        return compiled_for_hopper_ptx(_fp8_weight_only_kernel, types, constexprs, num_warps=4).count("cp.async.")

    assert cp_async_count(4) > 0
    assert cp_async_count(1) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("split_k", [1, 3])
def test_one_row_gemv_with_its_k_loop_staged_matches_the_ref_on_cuda(split_k, stages, weight_dtype):
    """The one-row kernel stages its K loop's weight tiles through shared memory `num_stages`
    deep. K = 2100 with 512-wide tiles is 5 tiles, the last ragged; split in 3 ranges (2, 2, 1
    tiles) a range is shorter than the pipeline, which must still load every tile once."""
    from kernels.triton_fp8 import fp8_weight_only_triton
    from kernels.triton_split_k import TileConfig

    n, k = 136, 2100
    x = randn(1, k, seed=stages).bfloat16().cuda()
    w = randn(n, k, seed=split_k) * k ** -0.5
    config = TileConfig(1, 16, 512, split_k, num_warps=4, num_stages=stages, mode="fma")
    if weight_dtype == torch.bfloat16:
        w16 = w.bfloat16().cuda()
        out, ref = fp8_weight_only_triton(x, w16, None, None, x.dtype, config), x.float() @ w16.float().t()
    else:
        w_q, w_scale = (t.cuda() for t in per_channel_quant(w))
        out = fp8_weight_only_triton(x, w_q, w_scale, None, x.dtype, config)
        ref = fp8_weight_only_ref(x, w_q, w_scale).float()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 4096), (7, 200), (130, 14336), (0, 64), (5, 20000)])
def test_fused_per_token_quant_on_cuda_equals_the_reference(m, k):
    """The one-kernel Triton quantization: the same scales and float8 values, bit for bit, for
    rows read once (up to 16,384) and rows read twice (20,000). (Not checked in Triton's
    interpreter, which truncates where the GPU rounds to nearest.)"""
    x = (randn(m, k, seed=4) * 3).bfloat16().cuda()
    if m:
        x[0] = 0                      # an all-zero row (CUDA-graph padding) takes the floor scale
    q, scale = per_token_quant(x)
    q_ref, scale_ref = per_token_quant_ref(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.gpu
def test_fp8_linear_replays_in_a_cuda_graph():
    w_q, w_scale = (t.cuda() for t in per_channel_quant(randn(128, 256, seed=2)))
    x = randn(16, 256, seed=1).bfloat16().cuda()
    fp8_linear(x, w_q, w_scale)                            # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w_q, w_scale)
    x.copy_(randn(16, 256, seed=5).bfloat16())
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, w_q, w_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, W8A16_MAX_M + 8])
def test_fp8_linears_of_a_layer_replay_in_a_cuda_graph_captured_first(m, monkeypatch):
    """Split-K W8A16 launches inside a capture with no counters made yet (each launch then
    gets its own, zeroed in the graph), then with the shared counters; replayed twice on new
    inputs, each replay equal to the eager result."""
    from kernels import triton_split_k

    weights = [tuple(t.cuda() for t in per_channel_quant(randn(n, k, seed=n) * k ** -0.5))
               for n, k in [(6144, 4096), (4096, 4096), (4096, 14336)]]
    xs = [randn(m, 4096, seed=1).bfloat16().cuda(), randn(m, 14336, seed=2).bfloat16().cuda()]

    def step():
        return [fp8_linear(xs[0], *weights[0]), fp8_linear(xs[0], *weights[1]), fp8_linear(xs[1], *weights[2])]

    step()                                              # compiles
    monkeypatch.setattr(triton_split_k, "_counter_cache", {})
    for _ in range(2):                                  # no counters yet, then the shared ones
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for seed in (5, 6):
            xs[0].copy_(randn(m, 4096, seed=seed).bfloat16())
            xs[1].copy_(randn(m, 14336, seed=seed).bfloat16())
            graph.replay()
            for got, want in zip(outs, step()):
                torch.testing.assert_close(got, want, rtol=0, atol=0)   # fixed summation order
        step()                                          # outside a capture: the shared counters


# ------------------------------------------------------------------------------ settings and devices

@pytest.mark.gpu
def test_fp8_linear_inputs_quantized_by_the_kernels_before_them_change_no_logit(tmp_path, monkeypatch):
    """A 64-token prompt, so every decoder linear runs W8A8, through a small random Llama
    quantized on load, eager: the RMSNorms and the SiLU-and-mul write three of each layer's
    four linear inputs quantized (only o_proj's input is quantized apart), and with that turned
    off every input is quantized apart; the logits are the same bit for bit."""
    from helpers import save_tiny_llama

    from kernels import fp8
    from worker.models import llama

    save_tiny_llama(tmp_path, layers=3)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", num_blocks=64,
                                    quantization="fp8", enforce_eager=True))
    ids = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    apart = []
    quantize = fp8.per_token_quant
    monkeypatch.setattr(fp8, "per_token_quant", lambda x: apart.append(x.shape) or quantize(x))
    fused = engine.prompt_logits(ids)
    assert len(apart) == 3
    apart.clear()
    monkeypatch.setattr(llama, "writes_quantized", lambda consumer, x: False)
    unfused = engine.prompt_logits(ids)
    assert len(apart) == 4 * 3
    assert torch.equal(fused, unfused)
    engine.close()


def test_unknown_quantization_is_refused_naming_the_allowed_values():
    with pytest.raises(ValueError, match="quantization='int4' is not supported: use one of none, fp8, int8, gptq, awq, "
                                         "compressed-tensors"):
        EngineConfig(model="default", quantization="int4").validate()


def test_quantization_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).quantization == "none"
    assert engine_config_from_args(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"


def test_fp8_on_a_gpu_older_than_ada_is_refused_naming_what_was_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"--quantization fp8 needs FP8 tensor cores \(compute capability 8.9 "
                                         r"or newer.*NVIDIA A100 has 8.0; allowed on this GPU: --quantization none"):
        quantization.linear_method("fp8", None, "cuda").check_device(torch.device("cuda", 0))


def test_fp8_on_the_cpu_says_it_is_emulated(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        quantization.linear_method("fp8", None, "cpu").check_device(CPU)
    assert any("emulated in fp32" in r.message for r in caplog.records)


# ------------------------------------------------------------------------------ quantized on load

@pytest.fixture(scope="module")
def dummy_smollm():
    """SmolLM2-shaped random weights, unquantized and quantized on load (the same draws)."""
    source = resolve_source("default", "dummy")
    return source, load_model(source, CPU, torch.float32), load_model(source, CPU, torch.float32,
                                                                       quantization="fp8")


def test_quantize_on_load_makes_every_decoder_linear_fp8_and_nothing_else(dummy_smollm):
    _, _, (_, model) = dummy_smollm
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear, Fp8Linear) and linear.weight.dtype == FP8_DTYPE
    assert model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32


def test_quantize_on_load_of_a_dummy_smollm2_keeps_its_logits_close(dummy_smollm):
    source, base, fp8 = dummy_smollm
    ids = torch.randint(0, 49152, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = [LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", num_blocks=64), source,
                        loaded).prompt_logits(ids) for loaded in (base, fp8)]
    # Random weights through 30 layers: each adds its rounding to the residual stream.
    assert rel_error(logits[1], logits[0]) < 0.2


def test_quantize_on_load_frees_each_high_precision_weight_as_it_goes(tmp_path, monkeypatch):
    tiny_hf_model(tmp_path, "llama3")
    _, model = load_model(resolve_source(str(tmp_path)), CPU, torch.float32)
    originals = [weakref.ref(m.weight) for layer in model.layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear)]
    quantized_so_far, most_kept = [0], [0]
    real_quant = quantization.per_channel_quant

    def counting_quant(w):
        # Weights already quantized whose high-precision copy is still alive.
        kept = sum(ref() is not None for ref in originals[:quantized_so_far[0]])
        most_kept[0] = max(most_kept[0], kept)
        quantized_so_far[0] += 1
        return real_quant(w)
    monkeypatch.setattr(quantization, "per_channel_quant", counting_quant)
    quantization.quantize_decoder_linears(model)
    assert quantized_so_far[0] == len(originals) == 4 * model.config.num_layers
    assert most_kept[0] == 0
    assert all(ref() is None for ref in originals)


@pytest.fixture(scope="module")
def smollm_fp8(smollm_source):
    return load_model(smollm_source, CPU, torch.float32, quantization="fp8")


def test_quantize_on_load_of_smollm2_keeps_its_predictions(make_engine, smollm_source, smollm_fp8,
                                                           smollm_tokenizer):
    ids = smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    base = make_engine().prompt_logits(ids).log_softmax(-1)
    fp8 = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", num_blocks=128),
                    smollm_source, smollm_fp8).prompt_logits(ids).log_softmax(-1)
    kl = (base.exp() * (base - fp8)).sum(-1).mean().item()
    agree = (base.argmax(-1) == fp8.argmax(-1)).float().mean().item()
    assert kl < 0.06 and agree > 0.8, (kl, agree)


def test_quantize_on_load_of_smollm2_keeps_greedy_answers(make_engine, smollm_source, smollm_fp8,
                                                          smollm_tokenizer):
    # Prompts with one clear continuation: the capital, the boiling point, counting.
    prompts = [smollm_tokenizer.encode(PROMPTS[i], add_special_tokens=False) for i in (0, 2, 4)]
    fp8 = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", num_blocks=128),
                    smollm_source, smollm_fp8)
    assert generate(fp8, prompts, greedy(6)) == generate(make_engine(), prompts, greedy(6))


@pytest.mark.gpu
def test_smollm2_fp8_on_a_gpu_with_cuda_graphs_keeps_its_predictions(smollm_tokenizer):
    """cuBLAS' FP8 GEMM inside the engine's CUDA graphs: the same bounds as on the CPU,
    against the bfloat16 model."""
    def engine(quantization: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model="default", device="cuda", dtype="bfloat16", num_blocks=256,
                                      max_num_seqs=16, quantization=quantization))
    bf16, fp8 = engine("none"), engine("fp8")
    assert fp8.runner.graphs is not None
    ids = smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    base, quantized = (e.prompt_logits(ids).float().log_softmax(-1) for e in (bf16, fp8))
    kl = (base.exp() * (base - quantized)).sum(-1).mean().item()
    agree = (base.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    assert kl < 0.06 and agree > 0.8, (kl, agree)
    prompts = [smollm_tokenizer.encode(PROMPTS[i], add_special_tokens=False) for i in (0, 2, 4)]
    assert generate(fp8, prompts, greedy(6)) == generate(bf16, prompts, greedy(6))


def test_quantize_on_load_keeps_a_qwen2_bias(tmp_path):
    tiny_hf_model(tmp_path, "qwen2")
    _, model = load_model(resolve_source(str(tmp_path)), CPU, torch.float32, quantization="fp8")
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.bias is not None
    q_bias = load_file(tmp_path / "model.safetensors")["model.layers.0.self_attn.q_proj.bias"]
    torch.testing.assert_close(qkv.bias[:q_bias.shape[0]], q_bias.float())


# ------------------------------------------------------------------------------ pre-quantized checkpoints

def save_compressed_tensors_fp8(path, kind: str = "llama", preset: str = "FP8_DYNAMIC",
                                dtype: torch.dtype = torch.bfloat16):
    """A tiny random model quantized to FP8 with compressed-tensors and saved in its format;
    `preset` FP8_DYNAMIC: per-channel weights, dynamic activations; FP8: per-tensor weights and
    static input scales. The scales are stored in `dtype`, the model's. (llmcompressor's
    `oneshot` does the same through this library; it pins another transformers, so the tests
    use the library directly.)"""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    if kind == "llama":
        model = tiny_llama(vocab_size=256, hidden_size=64, layers=2, max_position_embeddings=256)
    else:
        model = tiny_hf_model(path, kind)
    model = model.to(dtype)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w, args = module.weight.detach().float(), module.quantization_scheme.weights
        rows = w if args.strategy == "channel" else w.reshape(1, -1)
        scale, _ = calculate_qparams(rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(0.05)     # calibrated in real use; ignored here
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


def transformers_logits(path, ids: list[int], quantize_inputs: bool) -> torch.Tensor:
    """transformers' own load of the checkpoint (decompressed to float32 weights); with
    `quantize_inputs`, each decoder linear's input is quantized per token as pagedserve does."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    config = CompressedTensorsConfig(run_compressed=False) if "compressed" in (path / "config.json").read_text() else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config).eval()
    def quantize_input(_, args):
        (x,) = args
        x_q, scale = per_token_quant(x.reshape(-1, x.shape[-1]))
        return (x_q.float() * scale).view(x.shape)
    if quantize_inputs:
        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_pre_hook(quantize_input)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def token_ids(vocab: int = 256, n: int = 100) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize(("kind", "preset"), [("llama", "FP8_DYNAMIC"), ("llama", "FP8"), ("qwen2", "FP8_DYNAMIC")],
                         ids=["per-channel", "per-tensor-static-inputs", "qwen2-bias-tied"])
def test_compressed_tensors_fp8_checkpoint_matches_transformers(tmp_path, kind, preset):
    # float32 scales: transformers decompresses in the scales' dtype, and bfloat16 would round
    # its weights (by 2^-9), which per-token activation rounding then amplifies to about 1 %.
    save_compressed_tensors_fp8(tmp_path, kind, preset, torch.float32)
    ids = token_ids(256 if kind == "llama" else 320)
    ours = engine_prompt_logits(tmp_path, ids)
    theirs = transformers_logits(tmp_path, ids, quantize_inputs=True)
    # Equal to float32 rounding, except that a tie in one per-token activation rounding may break
    # the other way on a difference of one ulp (transformers 5.24 flips one on the qwen2 model):
    # that moves one position's logits by ~1e-4, never more than one position's.
    differs = ((ours - theirs).abs() > 1e-5 + 1e-5 * theirs.abs()).any(dim=1)
    assert differs.sum() <= 1, f"positions {differs.nonzero().flatten().tolist()} differ"
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3)
    assert rel_error(ours, transformers_logits(tmp_path, ids, quantize_inputs=False)) < 0.05


def test_compressed_tensors_fp8_weights_load_as_stored(tmp_path):
    save_compressed_tensors_fp8(tmp_path, preset="FP8")           # per-tensor: q, k, v scales differ
    stored = load_file(tmp_path / "model.safetensors")
    _, model = load_model(resolve_source(str(tmp_path)), CPU, torch.float32)
    qkv = model.layers[1].self_attn.qkv_proj
    prefix = "model.layers.1.self_attn."
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(
        [stored[f"{prefix}{p}_proj.weight"] for p in "qkv"]).view(torch.uint8))
    rows = [stored[f"{prefix}{p}_proj.weight"].shape[0] for p in "qkv"]
    expected = torch.cat([stored[f"{prefix}{p}_proj.weight_scale"].float().expand(n) for p, n in zip("qkv", rows)])
    torch.testing.assert_close(qkv.weight_scale, expected)


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"], ids=["per-channel", "per-tensor"])
def test_compressed_tensors_fp8_checkpoint_under_tensor_parallelism(tmp_path, preset):
    """Two ranks read their rows of q/k/v and gate/up with their scales, and their columns of
    o_proj and down. (Each rank quantizes its own columns of the o_proj and down inputs per
    token, so the result is not one rank's to the bit.)"""
    save_compressed_tensors_fp8(tmp_path, preset=preset)
    ids = token_ids()
    assert rel_error(engine_prompt_logits(tmp_path, ids, 2), transformers_logits(tmp_path, ids, False)) < 0.05


def test_unknown_quant_method_is_refused_naming_it_and_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ModelLoadError, match=r"config.json: quantization_config.quant_method 'bitsandbytes' is not "
                                             r"supported \(supported: compressed-tensors .*; fp8 .*; gptq .*; awq"):
        config_from_hf(str(tmp_path))


@pytest.mark.parametrize(("change", "message"), [
    ({"format": "int-quantized", "config_groups": {}}, "format 'int-quantized': supported are float-quantized"),
    ({"ignore": ["lm_head", "re:.*down_proj$"]}, "leaves decoder linears unquantized"),
    ({"ignore": []}, "quantizes lm_head"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "int"}}, "kv_cache_scheme has type 'int': only FP8 e4m3"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "asks for sparsity"),
], ids=["format", "unquantized-decoder-linear", "quantized-lm-head", "int8-kv-cache", "sparsity"])
def test_compressed_tensors_configs_it_cannot_run_are_refused_saying_why(tmp_path, change, message):
    save_compressed_tensors_fp8(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(str(tmp_path))
