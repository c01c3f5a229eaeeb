"""Reads a PEFT LoRA adapter directory into the packed layout the decoder's LoRA slots take.

A PEFT adapter is `adapter_config.json` plus `adapter_model.safetensors` (or the older
`adapter_model.bin`), with tensors named like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). The decoder packs q/k/v into one projection and gate/up into another
(`worker.models.llama`), so the pieces of a packed projection are stacked here in its order,
absent pieces as zeros, and each B is pre-multiplied by its scaling (`lora_alpha / r`, or
`lora_alpha / sqrt(r)` under rsLoRA; PEFT's `rank_pattern` / `alpha_pattern` per module).

Everything a server cannot serve is refused with a `LoRAAdapterError` naming the file and the
problem: a missing or corrupt file, a non-LoRA PEFT type, DoRA, trained biases or
`modules_to_save`, a module other than the seven linear projections, a rank above the limit, or
shapes that do not match the served model (an adapter of another base model).

Pure function of the files: it runs on any thread, so a worker reads an adapter beside the
step loop and only hands the finished tensors to it.
"""

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from worker.config import ModelConfig

# Our packed projection -> the Hugging Face pieces packed into it, in output order.
PACKED_PIECES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PIECE_OWNER = {piece: packed for packed, pieces in PACKED_PIECES.items() for piece in pieces}
_NAME = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                   r"(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message names the file and the reason."""


@dataclass
class LoRAWeights:
    """An adapter read from disk, in host memory, ready to copy into a slot.

    `layers[(layer, packed)] = (a, b)`: a `[P, r, in]` (one A per piece of the packed
    projection, zeros for a piece the adapter leaves alone), b `[out, r]` with the scaling
    folded in; `r` is the adapter's largest rank, smaller pieces zero-padded."""
    name: str
    path: str
    rank: int
    target_modules: list[str]
    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each Hugging Face projection of the served model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the first pattern that matches the module's name as a
    suffix (PEFT's own rule, `(.*\\.)?pattern$`)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: no such directory")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(f"{config_file}: missing (a PEFT adapter directory has "
                               f"adapter_config.json and adapter_model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{config_file}: unreadable: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_file}: not a JSON object")
    problems = {
        "peft_type": config.get("peft_type", "LORA") != "LORA" and
        f"peft_type {config.get('peft_type')!r} is not LORA",
        "use_dora": bool(config.get("use_dora")) and "DoRA (use_dora) adapters are not supported",
        "bias": config.get("bias", "none") != "none" and
        f"bias={config.get('bias')!r}: adapters with trained biases are not supported",
        "modules_to_save": bool(config.get("modules_to_save")) and
        f"modules_to_save={config['modules_to_save']!r}: adapters that replace whole modules are not supported",
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")) and
        "fan_in_fan_out=true (Conv1D layers) does not apply to Llama-family models",
    }
    for problem in problems.values():
        if problem:
            raise LoRAAdapterError(f"{config_file}: {problem}")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key, 8), (int, float)) or config.get(key, 8) <= 0:
            raise LoRAAdapterError(f"{config_file}: {key}={config.get(key)!r} must be a positive number")
    return config


def _read_tensors(path: str) -> tuple[str, dict[str, torch.Tensor]]:
    st, binary = (os.path.join(path, f"adapter_model.{ext}") for ext in ("safetensors", "bin"))
    try:
        if os.path.exists(st):
            from safetensors.torch import load_file
            return st, load_file(st)
        if os.path.exists(binary):
            return binary, torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:     # a truncated or foreign file: name it, whatever the library raised
        raise LoRAAdapterError(f"{st if os.path.exists(st) else binary}: unreadable: {e}") from None
    raise LoRAAdapterError(f"LoRA adapter {path!r}: no adapter_model.safetensors or adapter_model.bin")


def read_lora_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int,
                      dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """Reads and checks the adapter at `path` against the served model `cfg`; the packed
    tensors are in `dtype` (the model's), the scaling applied in float32 first."""
    config = _read_config(path)
    weights_file, tensors = _read_tensors(path)
    shapes = projection_shapes(cfg)
    alpha = float(config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _NAME.match(key)
        if match is None:
            raise LoRAAdapterError(f"{weights_file}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                                   f"projection (only {', '.join(shapes)} of the decoder layers can be adapted)")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes:
            raise LoRAAdapterError(f"{weights_file}: tensor {key!r} adapts {module!r}, which the model "
                                   f"does not have; LoRA applies to {', '.join(shapes)}")
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(f"{weights_file}: tensor {key!r} is for layer {layer}, but the served model "
                                   f"has {cfg.num_layers} layers: the adapter is for another base model")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise LoRAAdapterError(f"{weights_file}: tensor {key!r} must be a 2-D float tensor, "
                                   f"not {tuple(tensor.shape)} {tensor.dtype}")
        if not torch.isfinite(tensor).all():
            # It would make every logit of its requests NaN; better refused than served.
            raise LoRAAdapterError(f"{weights_file}: tensor {key!r} holds NaN or infinite values")
        pieces.setdefault((layer, module), {})[which] = tensor
    if not pieces:
        raise LoRAAdapterError(f"{weights_file}: holds no LoRA weights")

    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    by_packed: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pieces.items()):
        where = f"{weights_file}: layers.{layer}.{module}"
        if missing := {"A", "B"} - set(ab):
            raise LoRAAdapterError(f"{where} has no lora_{missing.pop()} weight")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.shape != (r, fan_in) or b.shape != (fan_out, r):
            raise LoRAAdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                   f"the served model's {module} ({fan_in} -> {fan_out}): expected "
                                   f"({r}, {fan_in}) and ({fan_out}, {r}); the adapter is for another base model")
        if r > max_rank:
            raise LoRAAdapterError(f"{where} has rank {r}, above --max-lora-rank {max_rank}")
        module_name = f"model.layers.{layer}.{'self_attn' if module in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{module}"
        module_rank = _pattern_value(rank_pattern, module_name, config.get("r", r))
        module_alpha = float(_pattern_value(alpha_pattern, module_name, alpha))
        scaling = module_alpha / (math.sqrt(module_rank) if config.get("use_rslora") else module_rank)
        by_packed.setdefault((layer, PIECE_OWNER[module]), {})[module] = (a.float(), b.float() * scaling)
        rank = max(rank, r)

    for (layer, packed), present in by_packed.items():
        names = PACKED_PIECES[packed]
        fan_in = shapes[names[0]][0]
        a_packed = torch.zeros(len(names), rank, fan_in)
        b_packed = torch.zeros(sum(shapes[n][1] for n in names), rank)
        start = 0
        for p, piece in enumerate(names):
            size = shapes[piece][1]
            if piece in present:
                a, b = present[piece]
                a_packed[p, :a.shape[0]] = a
                b_packed[start:start + size, :b.shape[1]] = b
            start += size
        layers[(layer, packed)] = (a_packed.to(dtype), b_packed.to(dtype))
    targets = sorted({module for _, module in pieces})
    return LoRAWeights(name=name, path=path, rank=rank, target_modules=targets, layers=layers)
