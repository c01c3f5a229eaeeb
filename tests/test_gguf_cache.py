"""worker.models.gguf_cache: a GGUF file's tokenizer and dequantized weights, read once and
cached.

On a copy of the embedded SmolLM2 GGUF, in a cache directory of the test's own
(PAGEDSERVE_CACHE_DIR).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from worker.models.gguf_cache import gguf_tokenizer

TEXTS = ["Hello world", "  leading spaces and émojis 🙂", "def f(x):\n\treturn x ** 2"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def gguf(tmp_path, smollm_source):
    """A copy of the GGUF file, so that the test may touch it."""
    return shutil.copy(smollm_source.path, tmp_path / "model.gguf")


def entries(cache, kind: str = "gguf-tokenizers") -> list[str]:
    root = cache / kind
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_the_cached_tokenizer_encodes_decodes_and_templates_as_the_converted_one(cache, gguf):
    converted = gguf_tokenizer(str(gguf))
    assert len(entries(cache)) == 1
    cached = gguf_tokenizer(str(gguf))
    assert type(cached) is type(converted) and cached is not converted
    for text in TEXTS:
        ids = converted.encode(text)
        assert cached.encode(text) == ids and cached.decode(ids) == converted.decode(ids)
    assert (cached.bos_token, cached.eos_token) == (converted.bos_token, converted.eos_token)
    assert cached.apply_chat_template(CHAT, tokenize=False) == converted.apply_chat_template(CHAT, tokenize=False)


def test_a_changed_file_is_converted_afresh(cache, gguf):
    gguf_tokenizer(str(gguf))
    os.utime(gguf, ns=(1, 1))
    gguf_tokenizer(str(gguf))
    assert len(entries(cache)) == 2


def test_a_damaged_entry_is_converted_again_and_replaced(cache, gguf):
    gguf_tokenizer(str(gguf))
    (entry,) = entries(cache)
    (cache / "gguf-tokenizers" / entry / "tokenizer.json").write_text("{not json")
    assert gguf_tokenizer(str(gguf)).encode(TEXTS[0]) == gguf_tokenizer(str(gguf)).encode(TEXTS[0])
    assert (cache / "gguf-tokenizers" / entry / "tokenizer.json").read_text().startswith("{")
    assert entries(cache) == [entry]


def test_an_unwritable_cache_converts_each_time(tmp_path, monkeypatch, gguf):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(blocker / "cache"))     # under a file: cannot be made
    assert gguf_tokenizer(str(gguf)).encode(TEXTS[0])


# ---------------------------------------------------------------- dequantized weights

def load(path: str, caplog, **settings):
    import torch

    from worker.models.loader import load_model, resolve_source
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        cfg, model = load_model(resolve_source(path), torch.device("cpu"), torch.float32, **settings)
    return cfg, model, " ".join(caplog.messages)


def test_a_second_load_reads_the_cached_weights_and_they_equal_the_files(cache, gguf, caplog):
    import torch
    cfg, first, log = load(str(gguf), caplog)
    assert "read from the cache" not in log and len(entries(cache, "gguf-dequantized")) == 1
    cfg_again, second, log = load(str(gguf), caplog)
    assert "Q4_1 210, Q8_0 1 (read from the cache at" in log
    assert cfg_again == cfg
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_weights_beyond_the_size_limit_are_not_cached(cache, gguf, caplog, monkeypatch):
    from worker.models import gguf_cache
    monkeypatch.setattr(gguf_cache, "MAX_CACHED_WEIGHT_BYTES", 2**20)
    load(str(gguf), caplog)
    assert entries(cache, "gguf-dequantized") == []


def test_a_damaged_weights_entry_is_read_from_the_file_again_and_replaced(cache, gguf, caplog):
    load(str(gguf), caplog)
    (entry,) = entries(cache, "gguf-dequantized")
    (cache / "gguf-dequantized" / entry / "meta.json").write_text("{")
    _, _, log = load(str(gguf), caplog)
    assert "does not load" in log and "read from the cache" not in log
    assert "read from the cache" in load(str(gguf), caplog)[2]
