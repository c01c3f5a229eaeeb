"""Model loading: sources, clear errors for bad inputs, GGUF layout."""

import json

import numpy as np
import pytest
import torch

from worker.models.loader import (ModelLoadError, _unpermute_qk, config_from_hf, load_model,
                                  resolve_source)


def test_default_resolves_to_the_embedded_gguf():
    source = resolve_source("default")
    assert source.format == "gguf" and source.path.endswith(".gguf")


def test_missing_path_error_names_it():
    with pytest.raises(ModelLoadError, match="/no/such/model"):
        resolve_source("/no/such/model")


def test_directory_without_config_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_unsupported_architecture_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        config_from_hf(str(tmp_path))


LLAMA_SHAPE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize(("config", "message"), [
    ([LLAMA_SHAPE], r"config.json must hold a JSON object \(a Hugging Face model config\), not list"),
    ({k: v for k, v in LLAMA_SHAPE.items() if k != "num_attention_heads"},
     r"config.json: num_attention_heads must be a positive integer, got None \(missing\)"),
    (LLAMA_SHAPE | {"hidden_size": "32"}, r"config.json: hidden_size must be a positive integer, got '32'"),
    (LLAMA_SHAPE | {"num_hidden_layers": 0}, r"config.json: num_hidden_layers must be a positive integer, got 0"),
], ids=["a-list", "no-heads", "a-string-size", "no-layers"])
def test_a_config_of_the_wrong_shape_is_refused_naming_the_field(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(str(tmp_path))


def test_architectures_given_as_one_string_are_read_as_a_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SHAPE | {"architectures": "LlamaForCausalLM"}))
    assert config_from_hf(str(tmp_path)).architecture == "LlamaForCausalLM"


def test_corrupt_gguf_rejected_naming_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    with pytest.raises(ModelLoadError, match="broken.gguf is not a valid GGUF"):
        load_model(resolve_source(str(bad)), torch.device("cpu"), torch.float32)


def test_corrupt_safetensors_rejected_naming_the_file(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors is not a readable safetensors file"):
        load_model(resolve_source(str(tmp_path)), torch.device("cpu"), torch.float32)


def test_dummy_preset_builds_without_files():
    source = resolve_source("llama-3.1-8b", "dummy")
    assert source.format == "dummy" and source.path is None


def test_unknown_load_format_rejected():
    with pytest.raises(ModelLoadError, match="load_format='pt'"):
        resolve_source("default", "pt")


def test_unpermute_inverts_llama_cpp_qk_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's conversion: per head, interleave the two rotary halves.
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(_unpermute_qk(permuted, heads), w)


def test_model_directory_without_tokenizer_files_has_no_tokenizer(tmp_path):
    from worker.models.loader import load_tokenizer
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert load_tokenizer(resolve_source(str(tmp_path), "dummy")) is None
