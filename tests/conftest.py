"""Shared pytest hooks."""

import os
import shutil
import tempfile

import pytest

_made_cache_dir: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """One GGUF cache (worker.models.gguf_cache) for the run, its worker processes included,
    away from the user's own; removed at the end unless the caller named one."""
    global _made_cache_dir
    if "PAGEDSERVE_CACHE_DIR" not in os.environ:
        _made_cache_dir = os.environ["PAGEDSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedserve-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _made_cache_dir is not None:
        shutil.rmtree(_made_cache_dir, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips `@pytest.mark.gpu` tests where CUDA is unavailable."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch  # only once there is a gpu test to judge

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)


# ---------------------------------------------------------------- the embedded model

@pytest.fixture(scope="session")
def smollm_source():
    from worker.models.loader import resolve_source
    return resolve_source("default")


@pytest.fixture(scope="session")
def smollm_weights(smollm_source):
    """SmolLM2 loaded once in fp32 on the CPU; engines under test share these weights."""
    import torch
    from worker.models.loader import load_model
    return load_model(smollm_source, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_source):
    from worker.models.loader import load_tokenizer
    return load_tokenizer(smollm_source)


@pytest.fixture(scope="session")
def make_engine(smollm_source, smollm_weights):
    """Builds an engine over the shared SmolLM2 weights with the given engine settings."""
    from worker.config import EngineConfig
    from worker.engine import LLMEngine

    def make(**settings):
        settings.setdefault("num_blocks", 512)
        settings.setdefault("device", "cpu")
        settings.setdefault("dtype", "float32")
        return LLMEngine(EngineConfig(model="default", **settings), smollm_source, smollm_weights)
    return make


@pytest.fixture(scope="session")
def hf_smollm(smollm_source):
    """Hugging Face transformers' own load of the same GGUF: the reference."""
    import os

    import torch
    from transformers import AutoModelForCausalLM
    path = smollm_source.path
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()
