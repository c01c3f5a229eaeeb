"""`--kv-cache-dtype fp8`: the KV pool in float8 e4m3, with the checkpoint's scales.

The pool holds twice the tokens of a 16-bit one in the same memory; attention reads the
stored values times their scale (kernels.cache, kernels.attention). Scales come from the
checkpoint, per layer or per KV head, under compressed-tensors' and vLLM's name
(`self_attn.k_scale`), older compressed-tensors' (`k_proj.output_scale`) or AutoFP8's
(`self_attn.kv_scale`); without them the scale is 1.0, with a warning. SmolLM2 over an FP8 pool
is compared with the float32 pool it replaces, and swap and prefix caching are shown to move
its bytes unchanged.

The checkpoints with KV scales are written by transformers (`save_pretrained`) with the scales
added under the names the formats use and, for compressed-tensors, the `kv_cache_scheme` its own
`QuantizationArgs` serialise: compressed-tensors' calibration of KV scales hooks the attention
signature of older transformers releases and finds no attention module in this one.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import (LONG_STORY, PROMPTS, generate, generate_with_a_swap, greedy, save_tiny_llama,
                     tiny_hf_model)
from safetensors.torch import load_file, save_file

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.models.loader import ModelLoadError

NUM_KV_HEADS, NUM_LAYERS = 2, 3       # tiny_hf_model's


@pytest.fixture(scope="module")
def ids(smollm_tokenizer) -> list[list[int]]:
    return [smollm_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def engine_on(path, kv_cache_dtype: str = "fp8", **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=64,
                                  kv_cache_dtype=kv_cache_dtype, **settings))


def add_tensors(path, tensors: dict[str, torch.Tensor], kv_cache_scheme: dict | None = None) -> None:
    """Adds tensors to a saved checkpoint, and a compressed-tensors kv_cache_scheme to its config."""
    file = path / "model.safetensors"
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})
    if kv_cache_scheme is not None:
        from compressed_tensors.quantization import QuantizationArgs
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                         "kv_cache_scheme": QuantizationArgs(**kv_cache_scheme).model_dump()}
        (path / "config.json").write_text(json.dumps(config))


def kv_scales(name: str, per_head: bool) -> dict[str, torch.Tensor]:
    """Distinct scales for every layer (and head): layer i's K scale is 0.01 (i + 1) (+ head / 1000)."""
    tensors = {}
    for i in range(NUM_LAYERS):
        for kind, base in (("k", 0.01), ("v", 0.002)):
            value = base * (i + 1) + (torch.arange(NUM_KV_HEADS) / 1000 if per_head else torch.zeros(1))
            tensors[name.format(layer=i, kind=kind)] = value.reshape(-1, 1, 1) if per_head else value.reshape(())
    return tensors


def loaded_scales(engine: LLMEngine) -> list[tuple[list[float], list[float]]]:
    return [(a.k_scale.tolist(), a.v_scale.tolist()) for a in (layer.self_attn for layer in engine.runner.model.layers)]


def test_an_fp8_pool_holds_twice_the_tokens_of_a_16_bit_one_in_the_same_memory(make_engine):
    settings = dict(dtype="bfloat16", num_blocks=None, kv_cache_memory_gb=0.05)
    bf16, fp8 = make_engine(**settings), make_engine(**settings, kv_cache_dtype="fp8")
    assert (bf16.runner.kv_cache.dtype, fp8.runner.kv_cache.dtype) == (torch.bfloat16, torch.float8_e4m3fn)
    assert 2 * fp8.runner.block_bytes == bf16.runner.block_bytes
    assert fp8.runner.num_blocks in (2 * bf16.runner.num_blocks, 2 * bf16.runner.num_blocks + 1)
    assert fp8.runner.swap_cache.dtype == torch.float8_e4m3fn


def test_smollm2_over_an_fp8_pool_stays_close_to_its_float32_pool(make_engine, smollm_tokenizer):
    full, fp8 = make_engine(), make_engine(kv_cache_dtype="fp8")
    ids = smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)
    base, quantized = (e.prompt_logits(ids).float().log_softmax(-1) for e in (full, fp8))
    kl = (base.exp() * (base - quantized)).sum(-1).mean().item()
    agree = (base.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    assert kl < 0.02 and agree > 0.85, (kl, agree)     # measured: 0.006, 0.92
    prompts = [smollm_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:4]]
    assert generate(fp8, prompts, greedy(8)) == generate(full, prompts, greedy(8))


def test_a_swapped_out_request_over_an_fp8_pool_resumes_with_its_undisturbed_tokens(make_engine, ids):
    reference = generate(make_engine(kv_cache_dtype="fp8"), [ids[0], ids[1]], greedy(12))
    engine = make_engine(kv_cache_dtype="fp8", num_swap_blocks=32)
    got, _ = generate_with_a_swap(engine, [ids[0], ids[1]], greedy(12), before=3, held=2)
    assert got == {k: v[0] for k, v in reference.items()}


def test_a_prompt_served_from_cached_fp8_blocks_gives_the_tokens_it_gave_computed(make_engine, smollm_tokenizer):
    engine = make_engine(kv_cache_dtype="fp8")
    prompt = smollm_tokenizer.encode(LONG_STORY, add_special_tokens=False)[:100]
    first = generate(engine, [prompt], greedy(10))
    hits = engine.blocks.prefix_hits
    assert generate(engine, [prompt], greedy(10)) == first
    assert engine.blocks.prefix_hits - hits == 100 // engine.config.block_size


@pytest.mark.parametrize("per_head", [False, True], ids=["per-layer", "per-head"])
def test_compressed_tensors_kv_scales_are_read_per_layer_or_per_head(tmp_path, per_head):
    tiny_hf_model(tmp_path, "llama3")
    add_tensors(tmp_path, kv_scales("model.layers.{layer}.self_attn.{kind}_scale", per_head),
                dict(num_bits=8, type="float", symmetric=True, dynamic=False,
                     strategy="attn_head" if per_head else "tensor"))
    scales = loaded_scales(engine_on(tmp_path))
    for i, (k, v) in enumerate(scales):
        heads = torch.arange(NUM_KV_HEADS) / 1000 if per_head else torch.zeros(NUM_KV_HEADS)
        torch.testing.assert_close(torch.tensor(k), 0.01 * (i + 1) + heads)
        torch.testing.assert_close(torch.tensor(v), 0.002 * (i + 1) + heads)


@pytest.mark.parametrize("name", ["model.layers.{layer}.self_attn.{kind}_proj.output_scale"], ids=["output_scale"])
def test_older_compressed_tensors_kv_scale_names_are_read(tmp_path, name):
    tiny_hf_model(tmp_path, "llama3")
    add_tensors(tmp_path, kv_scales(name, per_head=False))
    assert [k[0] for k, _ in loaded_scales(engine_on(tmp_path))] == pytest.approx([0.01, 0.02, 0.03])


def test_one_kv_scale_for_both_k_and_v_is_read(tmp_path):
    tiny_hf_model(tmp_path, "llama3")
    add_tensors(tmp_path, {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.5 + i) for i in range(NUM_LAYERS)})
    assert loaded_scales(engine_on(tmp_path)) == [([0.5 + i] * 2, [0.5 + i] * 2) for i in range(NUM_LAYERS)]


def test_calibrated_scales_keep_an_fp8_pool_closer_to_float32_than_scale_one(tmp_path):
    """A model whose K/V are small (tiny_hf_model's, scaled down): with scale 1.0 they fall among
    float8's subnormals and lose digits; scales of amax / 448, as a calibration gives, keep them."""
    tiny_hf_model(tmp_path, "llama3")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * 1e-3
    save_file(tensors, file, metadata={"format": "pt"})
    ids = torch.randint(0, 320, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = engine_on(tmp_path, "auto").prompt_logits(ids)
    unscaled = engine_on(tmp_path).prompt_logits(ids)
    add_tensors(tmp_path, {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(1e-3 / 448 * 4)
                           for i in range(NUM_LAYERS) for kind in "kv"})
    scaled = engine_on(tmp_path).prompt_logits(ids)
    assert (scaled - reference).abs().max() < (unscaled - reference).abs().max() / 4


def test_an_fp8_pool_without_checkpoint_scales_warns_that_it_uses_one(tmp_path, caplog):
    tiny_hf_model(tmp_path, "llama3")
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker"):
        engine_on(tmp_path)
    assert "no k_scale/v_scale for 3 of 3 layers" in caplog.text


@pytest.mark.parametrize(("tensor", "message"), [
    (torch.tensor([0.1, 0.2, 0.3]), "has 3 values: a KV-cache scale is one per layer or one per KV head"),
    (torch.tensor(0.0), "not a positive finite number"),
    (torch.tensor(float("nan")), "not a positive finite number"),
], ids=["three-values", "zero", "nan"])
def test_a_kv_scale_that_cannot_be_one_is_refused_naming_the_tensor(tmp_path, tensor, message):
    tiny_hf_model(tmp_path, "llama3")
    add_tensors(tmp_path, {"model.layers.1.self_attn.k_scale": tensor})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.k_scale.*" + message):
        engine_on(tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    (dict(num_bits=4, type="int"), "has num_bits 4: only FP8 e4m3 KV caches are supported"),
    (dict(dynamic=True), "asks for dynamic scales"),
    (dict(strategy="group", group_size=16), "has strategy 'group': allowed are tensor, attn_head"),
], ids=["int4", "dynamic", "group"])
def test_a_kv_cache_scheme_it_cannot_serve_is_refused_saying_why(tmp_path, change, message):
    tiny_hf_model(tmp_path, "llama3")
    add_tensors(tmp_path, {}, dict(dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), **change))
    with pytest.raises(ModelLoadError, match=message):
        engine_on(tmp_path)


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported: use one of auto, fp8, fp8_e4m3"):
        EngineConfig(model="default", kv_cache_dtype="int8").validate()


def test_an_fp8_pool_on_a_gpu_older_than_ada_is_refused_naming_what_is_allowed(monkeypatch):
    from worker.model_runner import resolve_kv_cache_dtype
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or later "
                                         r".*NVIDIA A100 has 8.0: use kv_cache_dtype='auto'"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda", 0))


def test_per_head_kv_scales_split_with_their_heads_over_two_ranks(tmp_path):
    """Each rank takes its own heads' scales: two ranks give one rank's logits. Head 1's scale
    is so small that its K/V saturate (to ±448 × 2^-12), head 0's keeps them whole, so a rank
    that took another head's scale would compute other logits."""
    tiny_hf_model(tmp_path, "llama3")
    head_scales = torch.tensor([1.0, 2.0 ** -12]).reshape(-1, 1, 1)
    add_tensors(tmp_path, {f"model.layers.{i}.self_attn.{kind}_scale": head_scales.clone()
                           for i in range(NUM_LAYERS) for kind in "kv"},
                dict(num_bits=8, type="float", symmetric=True, strategy="attn_head"))
    ids = torch.randint(0, 320, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    one = engine_on(tmp_path).prompt_logits(ids)
    two = engine_on(tmp_path, tensor_parallel_size=2)
    try:
        torch.testing.assert_close(two.prompt_logits(ids), one, atol=2e-3, rtol=2e-3)
    finally:
        two.close()


@pytest.mark.gpu
def test_gpu_an_fp8_pool_decodes_in_cuda_graphs_as_it_does_eagerly(tmp_path):
    """The float8 write and attention captured in decode graphs and run eagerly in mixed steps:
    the same tokens either way, and logits close to a bfloat16 pool's. (tiny_hf_model's heads of
    8 lanes are below what the GPU kernels take: this model's are 32.)"""
    save_tiny_llama(tmp_path, hidden_size=256, layers=NUM_LAYERS)
    add_tensors(tmp_path, kv_scales("model.layers.{layer}.self_attn.{kind}_scale", per_head=True))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (3, 40, 170, 9)]

    def engine(**settings) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", num_blocks=256,
                                      **settings))

    graphs, eager = engine(kv_cache_dtype="fp8"), engine(kv_cache_dtype="fp8", enforce_eager=True)
    assert graphs.runner.graphs is not None and graphs.runner.kv_cache.dtype == torch.float8_e4m3fn
    params = greedy(24, ignore_eos=True)
    assert generate(graphs, prompts, params) == generate(eager, prompts, params)
    base = engine().prompt_logits(prompts[2]).float().log_softmax(-1)
    quantized = graphs.prompt_logits(prompts[2]).float().log_softmax(-1)
    assert (base.exp() * (base - quantized)).sum(-1).mean().item() < 0.02


@pytest.mark.gpu
def test_gpu_a_head_dim_the_kernels_cannot_take_is_refused_at_load(tmp_path):
    tiny_hf_model(tmp_path, "llama3")            # 8 lanes a head
    with pytest.raises(ModelLoadError, match="head_dim 8 is not served on the GPU"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", num_blocks=64))


def test_an_fp8_checkpoint_with_a_kv_cache_scheme_serves_fp8_weights_over_its_scaled_pool(tmp_path):
    from test_fp8 import save_compressed_tensors_fp8

    from worker.models.quantization import Fp8Linear
    save_compressed_tensors_fp8(tmp_path)           # tiny_llama: 2 layers, 4 KV heads
    config = json.loads((tmp_path / "config.json").read_text())
    scheme = dict(num_bits=8, type="float", symmetric=True, strategy="tensor")
    config["quantization_config"]["kv_cache_scheme"] = scheme
    (tmp_path / "config.json").write_text(json.dumps(config))
    add_tensors(tmp_path, {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.01 * (i + 1))
                           for i in range(2) for kind in "kv"})
    engine = engine_on(tmp_path)
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert [k[0] for k, _ in loaded_scales(engine)] == pytest.approx([0.01, 0.02])
    assert engine.runner.quantization == "compressed-tensors fp8"
