"""GGUF files whose decoder linears stay in their blocks (`worker/models/w4_formats.py`'s GGUF
readers, `quantization.GgufCheckpoint`, `loader.gguf_weights`): Q4_0, Q4_1 and Q8_0 written by
gguf's own writer and quantizer; Q4_K and Q6_K, which gguf-py cannot quantize, as random
blocks in the file (the format's bytes, every scale and value drawn at random), read back by
gguf's own dequantizer as the reference. When they stay quantized (on a GPU, or under
`--quantization gguf`), and when they are dequantized on load (the CPU's default); files of
mixed types (llama.cpp's Q4_K_M), kept linear by linear.

Tolerances (float32 on the CPU): a file kept in its blocks vs the same file dequantized on
load, logits within 1e-5 absolute on logits of about 1. The weights are the same numbers
(each format's repacking reproduces gguf's dequantization bit for bit, tested), so only the
order of the sums differs (measured: 0 for Q4_0, Q4_1 and Q4_K; 5.4e-7 for Q8_0 and 7.7e-7 for
Q6_K, each summed from two 4-bit GEMMs). On the GPU in
float32 (the W4A16 kernel's products in tf32x3), within 1e-4.
"""

import logging
import zlib

import numpy as np
import pytest
import torch
from helpers import tiny_llama

from kernels.w4_weight import dequantize_ref
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.models.llama import DenseLinear
from worker.models.loader import ModelLoadError, gguf_weights, load_config, load_model, resolve_source
from worker.models.quantization import W4Linear, W4PairLinear
from worker.models.w4_formats import GGUF_KEPT

CPU = torch.device("cpu")
ATOL = 1e-5
KEPT = list(GGUF_KEPT)          # Q4_0, Q4_1, Q4_K, Q6_K, Q8_0
K_QUANTS = {"Q4_K": 144, "Q6_K": 210}   # bytes per super-block of 256 weights
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def random_k_blocks(linear_type: str, rows: int, k: int, seed: int) -> np.ndarray:
    """`uint8 [rows, K / 256 * block bytes]`: super-blocks of random bytes whose float16
    scales are set to small normal numbers (weights of about 0.01-0.1)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, k // 256, K_QUANTS[linear_type]), dtype=np.uint8)
    if linear_type == "Q4_K":       # d and dmin: weights d * sc * q - dmin * mn, sc, mn < 64, q < 16
        blocks[..., 0:4] = (rng.uniform(2e-5, 1e-4, (rows, k // 256, 2))).astype(np.float16).view(np.uint8)
    else:                           # d, last: weights d * sc * (q - 32), |sc| <= 128, |q - 32| <= 32
        blocks[..., 208:210] = (rng.uniform(2e-6, 2e-5, (rows, k // 256, 1))).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def quantized(array: np.ndarray, linear_type: str, seed: int) -> np.ndarray:
    import gguf
    if linear_type in K_QUANTS:
        return random_k_blocks(linear_type, *array.shape, seed)
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[linear_type])


def gguf_model(linear_types: set[str]):
    """The tiny Llama; hidden 256 and intermediate 512 where the K-quants' super-blocks of 256
    inputs must divide every linear's in_features."""
    hidden = 256 if linear_types & K_QUANTS.keys() else 128
    return tiny_llama(vocab_size=256, hidden_size=hidden, layers=2, max_position_embeddings=256, num_heads=4)


def save_tiny_gguf(path, linear_type: str, others: dict[str, str] | None = None) -> None:
    """The tiny Llama as a GGUF file (gguf's writer), its decoder linears in `linear_type`
    except those `others` gives another type (GGUF name -> type), and the rest in float32;
    q and k rows interleaved per head, as llama.cpp's converter stores them."""
    import gguf
    others = others or {}
    model = gguf_model({linear_type, *others.values()})
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    for name, p in model.state_dict().items():
        array = p.numpy()
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module, _, param = rest.rpartition(".")
            gguf_name = f"blk.{index}.{GGUF_NAMES[module]}.{param}"
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
                array = array.reshape(heads, 2, -1, array.shape[1]).swapaxes(1, 2).reshape(array.shape)
            if module.endswith("_proj"):
                kind = others.get(gguf_name, linear_type)
                writer.add_tensor(gguf_name, quantized(array, kind, zlib.crc32(name.encode())),
                                  raw_dtype=gguf.GGMLQuantizationType[kind])
                continue
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=KEPT)
def gguf_file(request, tmp_path_factory):
    """(linear type, path of a tiny GGUF file whose decoder linears all have it)."""
    path = tmp_path_factory.mktemp(f"gguf-{request.param}") / "tiny.gguf"
    save_tiny_gguf(path, request.param)
    return request.param, path


def token_ids(n: int = 90) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def engine_logits(path, ids: list[int], **settings) -> torch.Tensor:
    settings = {"device": "cpu", "dtype": "float32", "num_blocks": 64, **settings}
    engine = LLMEngine(EngineConfig(model=str(path), **settings))
    try:
        return engine.prompt_logits(ids).cpu()
    finally:
        engine.close()


def dequantized_logits(path, ids: list[int]) -> torch.Tensor:
    """The file's model with every tensor dequantized on load by gguf (the reader of every
    other GGUF type, which tests/test_engine_vs_transformers.py checks against transformers)."""
    from worker.models.llama import LlamaForCausalLM
    source = resolve_source(str(path))
    cfg = load_config(source)
    cfg.quantization = None
    model = LlamaForCausalLM(cfg)
    model.load_weights(gguf_weights(str(path), cfg))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=64), source,
                       (cfg, model.eval()))
    try:
        return engine.prompt_logits(ids)
    finally:
        engine.close()


def decoder_linears(model) -> list[torch.nn.Module]:
    return [m for layer in model.layers for m in layer.modules()
            if isinstance(m, (W4Linear, torch.nn.Linear)) and m is not layer]


# ------------------------------------------------------------------ the readers

@pytest.mark.parametrize("linear_type", KEPT)
def test_gguf_blocks_repack_into_what_gguf_dequantizes_them_to(linear_type):
    import gguf
    weights = torch.randn(40, 512, generator=torch.Generator().manual_seed(4)).numpy()
    blocks = quantized(weights, linear_type, seed=5)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[linear_type]))
    parts = GGUF_KEPT[linear_type].read(torch.from_numpy(blocks))
    assert len(parts) == (2 if GGUF_KEPT[linear_type].pair else 1)
    got = sum(dequantize_ref(w, torch.float32) for w in parts)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("linear_type", ["Q4_1", "Q4_K"])
def test_gguf_types_with_minimums_keep_them_as_float_offsets(linear_type):
    (w,) = GGUF_KEPT[linear_type].read(torch.from_numpy(quantized(np.ones((8, 256), np.float32), linear_type, 1)))
    assert w.offsets is not None and not w.zeros.any()


@pytest.mark.parametrize("linear_type", KEPT)
def test_gguf_rows_of_partial_blocks_are_refused(linear_type):
    blocks = quantized(np.ones((4, 256), np.float32), linear_type, seed=2)
    with pytest.raises(ValueError, match="are not whole blocks"):
        GGUF_KEPT[linear_type].read(torch.from_numpy(blocks[:, :-1]))


# ------------------------------------------------------------------ files on the CPU

def test_a_file_of_one_kept_type_keeps_its_linears_in_blocks_under_quantization_gguf(gguf_file):
    linear_type, path = gguf_file
    _, model = load_model(resolve_source(str(path)), CPU, torch.float32, quantization="gguf")
    kept = GGUF_KEPT[linear_type]
    linears = [m for m in decoder_linears(model) if isinstance(m, W4Linear)]
    assert len(linears) == 4 * 2 == len(decoder_linears(model))
    assert all((type(m) is W4PairLinear) == kept.pair and m.group_size == kept.group_size
               and (m.offsets is not None) == kept.offsets and m.scales.dtype == kept.scales_dtype for m in linears)


def test_a_file_kept_in_blocks_computes_the_logits_of_the_file_dequantized(gguf_file):
    _, path = gguf_file
    ids = token_ids()
    torch.testing.assert_close(engine_logits(path, ids, quantization="gguf"), dequantized_logits(path, ids),
                               atol=ATOL, rtol=0)


# llama.cpp's Q4_K_M: Q4_K, with attn_v and ffn_down in Q6_K in some layers (here layer 0); and a
# file whose layer-1 ffn_down is of a type not kept.
Q4_K_M = {"blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K"}
WITH_Q5_0 = {**Q4_K_M, "blk.1.ffn_down.weight": "Q5_0"}


def test_a_file_of_mixed_types_keeps_each_linear_whose_parts_share_a_kept_type(tmp_path):
    path = tmp_path / "mixed.gguf"
    save_tiny_gguf(path, "Q4_K", WITH_Q5_0)
    _, model = load_model(resolve_source(str(path)), CPU, torch.float32, quantization="gguf")
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if m in decoder_linears(model)}
    assert kinds == {"layers.0.self_attn.qkv_proj": "DenseLinear",        # Q4_K q and k beside a Q6_K v
                     "layers.0.self_attn.o_proj": "W4Linear", "layers.0.mlp.gate_up_proj": "W4Linear",
                     "layers.0.mlp.down_proj": "W4PairLinear",       # Q6_K
                     "layers.1.self_attn.qkv_proj": "W4Linear", "layers.1.self_attn.o_proj": "W4Linear",
                     "layers.1.mlp.gate_up_proj": "W4Linear", "layers.1.mlp.down_proj": "DenseLinear"}   # Q5_0


def test_a_file_of_mixed_types_computes_the_logits_of_the_file_dequantized(tmp_path):
    path = tmp_path / "mixed.gguf"
    save_tiny_gguf(path, "Q4_K", WITH_Q5_0)
    ids = token_ids()
    torch.testing.assert_close(engine_logits(path, ids, quantization="gguf"), dequantized_logits(path, ids),
                               atol=ATOL, rtol=0)


def test_a_file_of_mixed_types_is_labelled_by_its_kept_types(tmp_path):
    path = tmp_path / "mixed.gguf"
    save_tiny_gguf(path, "Q4_K", Q4_K_M)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=64,
                                    quantization="gguf"))
    try:
        assert engine.runner.quantization == "gguf Q4_K+Q6_K"
    finally:
        engine.close()


def test_the_cpu_dequantizes_a_kept_type_on_load_by_default_saying_so(tmp_path, caplog):
    path = tmp_path / "tiny.gguf"
    save_tiny_gguf(path, "Q4_1")
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        _, model = load_model(resolve_source(str(path)), CPU, torch.float32)
    assert all(type(m) is DenseLinear for m in decoder_linears(model))
    assert "tiny.gguf: dequantized on load, not kept quantized (tensors by type): Q4_1 14" in caplog.messages


def test_the_info_label_says_whether_the_linears_stay_in_blocks(tmp_path):
    path = tmp_path / "tiny.gguf"
    save_tiny_gguf(path, "Q4_1")
    labels = {}
    for quantization in ("none", "gguf"):
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=64,
                                        quantization=quantization))
        labels[quantization] = engine.runner.quantization
        engine.close()
    assert labels == {"none": "none", "gguf": "gguf Q4_1"}


def test_a_dequantized_load_on_the_cpu_is_cached_and_a_kept_load_reads_the_file(tmp_path, caplog):
    """The cache of dequantized weights serves the CPU's default load; a load that keeps the
    linears in their blocks (a GPU's, or --quantization gguf) reads the file, not the cache."""
    path = tmp_path / "tiny.gguf"
    save_tiny_gguf(path, "Q4_0")
    load_model(resolve_source(str(path)), CPU, torch.float32)              # makes the cache entry
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        _, dequantized = load_model(resolve_source(str(path)), CPU, torch.float32)
        _, kept = load_model(resolve_source(str(path)), CPU, torch.float32, quantization="gguf")
    assert any("read from the cache at" in m for m in caplog.messages)
    assert type(dequantized.layers[0].mlp.down_proj) is DenseLinear
    assert type(kept.layers[0].mlp.down_proj) is W4Linear


def test_quantization_gguf_on_a_file_of_another_type_is_refused_naming_the_kept_types(tmp_path):
    path = tmp_path / "tiny.gguf"
    save_tiny_gguf(path, "Q5_0")
    with pytest.raises(ModelLoadError, match=r"--quantization gguf keeps .* of the types Q4_0, Q4_1, Q4_K, "
                                             r"Q6_K, Q8_0; this model has none .*allowed: none, fp8, int8"):
        load_model(resolve_source(str(path)), CPU, torch.float32, quantization="gguf")


def test_quantization_gguf_on_a_hugging_face_checkpoint_is_refused(tmp_path):
    tiny_llama(vocab_size=256, hidden_size=128, layers=1, max_position_embeddings=256).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="--quantization gguf keeps a GGUF file's decoder linears"):
        load_model(resolve_source(str(tmp_path)), CPU, torch.float32, quantization="gguf")


# ------------------------------------------------------------------ the GPU

@pytest.mark.gpu
def test_gpu_a_file_kept_in_blocks_computes_the_logits_of_the_file_dequantized(gguf_file):
    """On a GPU the default (none) keeps the blocks: float32 through the W4A16 kernel."""
    linear_type, path = gguf_file
    ids = token_ids()
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=64))
    try:
        assert engine.runner.quantization == f"gguf {linear_type}"
        got = engine.prompt_logits(ids).cpu()
    finally:
        engine.close()
    torch.testing.assert_close(got, dequantized_logits(path, ids), atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_gpu_a_file_kept_in_blocks_decodes_in_cuda_graphs_as_it_does_eagerly(gguf_file):
    from helpers import generate, greedy
    _, path = gguf_file
    prompts = [token_ids(n) for n in (5, 17, 40)]
    outputs = []
    for enforce_eager in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_blocks=64,
                                        enforce_eager=enforce_eager))
        try:
            outputs.append(generate(engine, prompts, greedy(12)))
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
def test_gpu_a_file_of_mixed_types_computes_the_logits_of_the_file_dequantized(tmp_path):
    path = tmp_path / "mixed.gguf"
    save_tiny_gguf(path, "Q4_K", WITH_Q5_0)
    ids = token_ids()
    got = engine_logits(path, ids, device="cuda")
    torch.testing.assert_close(got, dequantized_logits(path, ids), atol=1e-4, rtol=0)
