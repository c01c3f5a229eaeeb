"""A disk cache of what a GGUF file costs seconds to read: its tokenizer and, for small models,
its dequantized weights.

A GGUF file is read through gguf's reader, which parses every metadata field in Python (about
2 s for the embedded SmolLM2's 49k-token vocabulary), and dequantized with numpy (about 1 s);
transformers converts its tokenizer, parsing the file again (about 3 s). Every worker process
paid that on every start (a `make run` restart, each worker of a test run). Here the tokenizer
is saved once with `save_pretrained` (it then loads in about 0.2 s), and the model's config
and float32 tensors, Hugging Face names and layout, once as JSON and safetensors (read back
lazily, so tensor-parallel ranks read only their slices), when a load dequantizes every tensor
(no linears kept in their blocks) and the float32 weights take at most MAX_CACHED_WEIGHT_BYTES.
The config keeps the file's `quantization` (the type its linears could stay in), so a later
load that keeps them reads the file instead.

An entry is keyed by the file's resolved path, size and modification time, by the versions of
what made it (transformers, gguf, CACHE_FORMAT), so a changed file or library makes a new one.
Entries live under $PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else
~/.cache/pagedserve, each written beside its place and renamed into it (a reader sees a whole
entry or none). Where the cache cannot be written the file is read each time, as without it;
an entry that does not load is removed and made again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import torch

from worker.config import CheckpointQuantization, ModelConfig

log = logging.getLogger("pagedserve.worker")

CACHE_FORMAT = 2    # 2: the config's quantization is stored
MAX_CACHED_WEIGHT_BYTES = 4 * 2**30


def cache_dir() -> Path:
    if os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(os.environ["PAGEDSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def _entry(kind: str, gguf_path: str, *versions: str) -> Path:
    path = os.path.realpath(gguf_path)
    stat = os.stat(path)
    key = "\0".join([path, str(stat.st_size), str(stat.st_mtime_ns), str(CACHE_FORMAT), *versions])
    return cache_dir() / kind / hashlib.sha256(key.encode()).hexdigest()[:32]


def _store(entry: Path, write: Callable[[Path], None], what: str) -> None:
    """Writes an entry through `write(staging directory)`, then renames it into place."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        try:
            write(staging)
            os.rename(staging, entry)
        except OSError:         # another process cached it first, or the disk is full
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except OSError as e:
        log.debug("not caching %s: %s", what, e)


def _drop(entry: Path, what: str, error: Exception) -> None:
    log.warning("the cached %s at %s does not load (%s); reading the file again", what, entry, error)
    shutil.rmtree(entry, ignore_errors=True)


# ---------------------------------------------------------------- tokenizer

def gguf_tokenizer(gguf_path: str):
    """The Hugging Face tokenizer of a GGUF file: from the cache, else converted and cached."""
    from transformers import AutoTokenizer
    entry = _entry("gguf-tokenizers", gguf_path, version("transformers"))
    if (entry / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(entry)
        except Exception as e:
            _drop(entry, f"tokenizer of {gguf_path}", e)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    _store(entry, tokenizer.save_pretrained, f"the tokenizer of {gguf_path}")
    return tokenizer


# ---------------------------------------------------------------- dequantized weights

@dataclasses.dataclass(frozen=True)
class DequantizedModel:
    """A cached entry: the file's model config, and its tensors as gguf_weights yields them."""
    path: Path
    config: ModelConfig
    dequantized: dict[str, int]     # quantized type -> tensors dequantized, for the load log

    def weights(self) -> Iterator[tuple[str, object]]:
        """(Hugging Face name, lazy safetensors slice) of every tensor."""
        from safetensors import safe_open
        with safe_open(self.path / "model.safetensors", framework="pt") as file:
            for name in file.keys():
                yield name, file.get_slice(name)


def _weights_entry(gguf_path: str) -> Path:
    return _entry("gguf-dequantized", gguf_path, version("gguf"))


def cached_dequantized(gguf_path: str) -> DequantizedModel | None:
    entry = _weights_entry(gguf_path)
    if not (entry / "model.safetensors").exists():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        config = ModelConfig(**meta["config"])
        if config.quantization is not None:
            config.quantization = CheckpointQuantization(**config.quantization)
        return DequantizedModel(entry, config, meta["dequantized"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        _drop(entry, f"weights of {gguf_path}", e)
        return None


def caching_dequantized(gguf_path: str, config: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]],
                        dequantized: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes `weights` (gguf_weights' float32 tensors, nothing kept quantized) through and,
    once the last has gone by, caches them with `config` and gguf_weights' `dequantized`
    summary, unless they exceed MAX_CACHED_WEIGHT_BYTES (then it stops holding them)."""
    from safetensors.torch import save_file
    held: dict[str, torch.Tensor] | None = {}
    size = 0
    for name, tensor in weights:
        if held is not None:
            size += tensor.numel() * tensor.element_size()
            if size > MAX_CACHED_WEIGHT_BYTES:
                held = None
            else:
                held[name] = tensor
        yield name, tensor
    if held is None:
        return

    def write(staging: Path) -> None:
        save_file({name: t.contiguous() for name, t in held.items()}, staging / "model.safetensors")
        meta = {"config": dataclasses.asdict(config), "dequantized": dequantized}
        (staging / "meta.json").write_text(json.dumps(meta))
    _store(_weights_entry(gguf_path), write, f"the dequantized weights of {gguf_path}")
