"""int8 W8A8 linears (kernels.int8, worker.models.quantization's Int8Linear and
`--quantization int8`): the quantizers, the GEMM against its dequantized reference, the load,
and SmolLM2 end to end against float32.

Measured when written, teacher-forced over LONG_STORY (150 tokens): perplexity 66.19 in
float32 (the embedded GGUF, dequantized), 68.82 in int8 (+4.0 %); the test allows +10 %.
"""


import pytest
import torch
from helpers import LONG_STORY, PROMPTS, generate, greedy, perplexity

from kernels.int8 import INT8_MAX, int8_linear, int8_linear_ref, per_channel_quant_int8, per_token_quant_int8
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.models.loader import load_model, resolve_source
from worker.models.quantization import Int8Linear, Int8OnLoad

CPU = torch.device("cpu")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ the quantizers

def test_per_channel_quant_maps_each_output_channels_largest_weight_to_127():
    w = randn(5, 40) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 1e3])[:, None]
    q, scale = per_channel_quant_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (5,)
    assert torch.equal(q.abs().amax(dim=1), torch.full((5,), INT8_MAX, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6 * w.abs()).all()


def test_per_token_quant_gives_each_row_its_own_scale_and_keeps_zero_rows_zero():
    x = torch.cat([randn(3, 16), torch.zeros(1, 16)]) * torch.tensor([1.0, 100.0, 0.01, 1.0])[:, None]
    q, scale = per_token_quant_int8(x)
    assert scale.shape == (4, 1)
    assert torch.equal(q[:3].abs().amax(dim=1), torch.full((3,), INT8_MAX, dtype=torch.int8))
    assert not q[3].any()


# ------------------------------------------------------------------------------------ the GEMM

@pytest.mark.parametrize("m", [0, 1, 7, 130])
def test_int8_linear_equals_its_dequantized_reference_on_ragged_shapes(m):
    """K = 577 and N = 13 fit no tile; int32 sums are exact, so only the float scaling differs."""
    w, scale = per_channel_quant_int8(randn(13, 577, seed=1))
    x, bias = randn(m, 577, seed=2), randn(13, seed=3)
    torch.testing.assert_close(int8_linear(x, w, scale, bias), int8_linear_ref(x, w, scale, bias),
                               atol=1e-5, rtol=1e-5)


def test_int8_linear_is_close_to_the_float32_product():
    weight, x = randn(96, 256, seed=1), randn(9, 256, seed=2)
    got = int8_linear(x, *per_channel_quant_int8(weight))
    want = x @ weight.t()
    assert (got - want).norm() / want.norm() < 0.02


def test_int8_linear_keeps_leading_dimensions_and_the_input_dtype():
    w, scale = per_channel_quant_int8(randn(8, 32))
    x = randn(2, 3, 32).bfloat16()
    y = int8_linear(x, w, scale)
    assert y.shape == (2, 3, 8) and y.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ the load

def test_quantize_on_load_makes_every_decoder_linear_int8_and_nothing_else():
    _, model = load_model(resolve_source("default", "dummy"), CPU, torch.float32, quantization="int8")
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear, Int8Linear) and linear.weight.dtype == torch.int8
    assert model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32


def test_int8_on_a_gpu_is_refused_naming_what_runs_there():
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU only.*--quantization fp8"):
        Int8OnLoad().check_device(torch.device("cuda"))


# ------------------------------------------------------------------------------ SmolLM2 end to end

@pytest.fixture(scope="module")
def int8_engine():
    engine = LLMEngine(EngineConfig(model="default", device="cpu", dtype="float32", quantization="int8",
                                    num_blocks=512))
    yield engine
    engine.close()


def test_smollm2_in_int8_reports_its_quantization(int8_engine):
    assert int8_engine.runner.quantization == "int8"


def test_smollm2_in_int8_perplexity_stays_within_10_percent_of_fp32(int8_engine, make_engine, smollm_tokenizer):
    ids = smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    base, int8 = perplexity(make_engine().prompt_logits(ids), ids), perplexity(int8_engine.prompt_logits(ids), ids)
    print(f"perplexity fp32 {base:.2f} int8 {int8:.2f}")
    assert int8 < 1.1 * base, (base, int8)


def test_smollm2_in_int8_keeps_the_greedy_answers_of_clear_prompts(int8_engine, smollm_tokenizer):
    prompts = [smollm_tokenizer.encode(PROMPTS[i], add_special_tokens=False) for i in (0, 4)]
    results = generate(int8_engine, prompts, greedy(12))
    capital, counting = (smollm_tokenizer.decode(results[f"r{i}"][0]) for i in range(2))
    assert capital.startswith(" Paris") and counting.startswith(" 6, 7, 8, 9"), (capital, counting)
