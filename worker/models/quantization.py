"""Quantized linear layers: which class each decoder linear gets, and how weights become it.

Only the linears of the decoder layers (qkv_proj, o_proj, gate_up_proj, down_proj) are
quantized; the embedding and the LM head keep the model's dtype, as in vLLM. A
`LinearMethod` decides three things for a load: the class the model builds for each decoder
linear (`create`), how a checkpoint's tensors are adapted to that class before the model
packs them (`checkpoint_tensors`), and what happens once every weight is in (`after_loading`).

- `--quantization fp8` on a high-precision checkpoint (or GGUF, or dummy weights): the model
  is built and loaded with `nn.Linear`, then each linear is replaced by an `Fp8Linear`, one
  at a time, so peak memory stays near the unquantized model's.
- A compressed-tensors `float-quantized` checkpoint: the model is built with `Fp8Linear` and
  reads the stored float8 weights and their scales as they are.
- A Hugging Face `fp8` checkpoint with block scales (128 x 128 in the published ones): each
  weight's blocks are dequantized as it is read, and the layers are requantized per output
  channel after loading (no block-scaled GEMM yet).

A weight-only 4-bit linear would be one more class and `LinearMethod` next to these.
"""

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kernels.fp8 import FP8_DTYPE, dequantize_blocks, fp8_linear, per_channel_quant
from worker.config import CheckpointQuantization
from worker.models.llama import CheckpointSlice

Tensorish = torch.Tensor | CheckpointSlice      # a checkpoint tensor, read or not yet

log = logging.getLogger("pagedserve.worker")

# The quantized linears by their Hugging Face names (the model packs q/k/v and gate/up).
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SUPPORTED_CHECKPOINTS = ("compressed-tensors (format float-quantized: FP8 weights per channel or per tensor)",
                         "fp8 (Hugging Face, with weight_block_size)")
FP8_MIN_CAPABILITY = (8, 9)     # FP8 tensor cores: Ada, Hopper and later


class Fp8Linear(nn.Module):
    """`x @ (weight * weight_scale[:, None]).T + bias` with `weight` float8_e4m3fn `[out, in]`
    and one fp32 scale per output channel; `x` is quantized per token at run time (W8A8)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
                                if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """The FP8 copy of `linear` (its bias is shared, not copied)."""
        fp8 = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        weight, scale = per_channel_quant(linear.weight)
        fp8.weight = nn.Parameter(weight, requires_grad=False)
        fp8.weight_scale = nn.Parameter(scale, requires_grad=False)
        fp8.bias = linear.bias
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# ---------------------------------------------------------------- how a load treats the linears

class LinearMethod:
    """High-precision linears, loaded as the checkpoint has them."""

    asked = "--quantization none"       # what chose this method, for error messages

    def create(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def check_device(self, device: torch.device) -> None:
        """Raises ValueError, before anything is loaded, when `device` cannot run the layers."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Tensorish]]) -> Iterable[tuple[str, Tensorish]]:
        """The checkpoint's (name, tensor or lazy slice) pairs as the model's parameters take them."""
        return weights

    def after_loading(self, model: nn.Module) -> None:
        """Runs once every weight is loaded."""


class Fp8Method(LinearMethod):
    """What every FP8 method shares: the GPU check."""

    def check_device(self, device: torch.device) -> None:
        if device.type == "cpu":
            log.info("FP8 (%s) on the CPU: the W8A8 linears are emulated in fp32 "
                     "(kernels.fp8.fp8_linear_ref), which is slower than the unquantized model", self.asked)
        elif device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < FP8_MIN_CAPABILITY:
                raise ValueError(
                    f"{self.asked} needs FP8 tensor cores (compute capability "
                    f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer: Ada, Hopper, Blackwell), "
                    f"but {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; "
                    f"allowed on this GPU: --quantization none with a high-precision checkpoint")


class Fp8OnLoad(Fp8Method):
    """`--quantization fp8` on high-precision weights: each decoder linear is loaded as
    `nn.Linear`, then replaced by its `Fp8Linear`."""

    asked = "--quantization fp8"

    def after_loading(self, model: nn.Module) -> None:
        quantize_decoder_linears(model)


class Fp8Checkpoint(Fp8Method):
    """A compressed-tensors float-quantized checkpoint: float8 weights `[N, K]` as stored, with
    per-channel (`[N, 1]`) or per-tensor (`[1]`) weight scales, made per channel `[N]`."""

    asked = "the checkpoint's FP8 quantization_config (compressed-tensors)"

    def create(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return Fp8Linear(in_features, out_features, bias)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Tensorish]]) -> Iterator[tuple[str, Tensorish]]:
        rows: dict[str, int] = {}                   # linear -> output rows of its weight
        waiting: dict[str, torch.Tensor] = {}       # linear -> per-tensor scale read before its weight
        for name, source in weights:
            linear, _, kind = name.rpartition(".")
            if not _is_decoder_linear(linear):
                yield name, source
            elif kind == "input_scale":
                # A static per-tensor activation scale: ignored. Per-token scales computed at run
                # time are at least as accurate (each row gets its own range, none is clipped)
                # and keep one GEMM path; their cost is an amax per row.
                continue
            elif kind == "weight":
                if not _is_fp8(source):
                    raise ValueError(f"checkpoint tensor {name!r} is {_dtype_name(source)}, but its "
                                     f"quantization_config says float8_e4m3fn")
                rows[linear] = _shape(source)[0]
                yield name, source
                if linear in waiting:
                    yield f"{linear}.weight_scale", waiting.pop(linear).expand(rows[linear])
            elif kind == "weight_scale":
                scale = _whole(source).float().reshape(-1)      # [N, 1] or per tensor [1] / []
                if scale.numel() > 1:
                    yield name, scale
                elif linear in rows:
                    yield name, scale.expand(rows[linear])
                else:
                    waiting[linear] = scale
            else:
                yield name, source
        if waiting:
            raise ValueError(f"checkpoint has weight scales without weights: {sorted(waiting)[:3]}")


class Fp8BlockCheckpoint(Fp8OnLoad):
    """A Hugging Face `fp8` checkpoint with block scales (`weight_scale_inv` `[N/bn, K/bk]`,
    by which the float8 weight is multiplied). Each weight is dequantized as it is read and
    the decoder linears are requantized per output channel after loading: one more rounding
    than the checkpoint's own, in exchange for the per-channel GEMM (no block-scaled GEMM yet).
    Any other quantized tensor (an LM head) is dequantized and stays in the model's dtype; a
    decoder linear the checkpoint left in high precision is quantized like the others."""

    asked = "the checkpoint's FP8 quantization_config (Hugging Face fp8 with block scales)"

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Tensorish]]) -> Iterator[tuple[str, Tensorish]]:
        pending: dict[str, dict[str, Tensorish]] = {}     # module -> its weight / scale, until both are read
        for name, source in weights:
            module, _, kind = name.rpartition(".")
            if kind == "input_scale":
                continue    # static activation scales: dynamic per-token ones instead (as above)
            if kind == "weight" and not _is_fp8(source):
                yield name, source      # a module the checkpoint left unquantized
                continue
            if kind not in ("weight", "weight_scale_inv"):
                yield name, source
                continue
            parts = pending.setdefault(module, {})
            parts[kind] = source
            if len(parts) == 2:
                del pending[module]
                yield f"{module}.weight", dequantize_blocks(_whole(parts["weight"]),
                                                            _whole(parts["weight_scale_inv"]), self.block)
        if pending:
            raise ValueError(f"checkpoint has float8 weights without block scales or scales without "
                             f"weights: {sorted(pending)[:3]}")


@torch.no_grad()
def quantize_decoder_linears(model: nn.Module) -> None:
    """Replaces every `nn.Linear` of the decoder layers by its `Fp8Linear`, one at a time: each
    high-precision weight is freed as soon as its FP8 copy replaces it (nothing else holds
    it), so an 8B model never holds both."""
    for layer in model.layers:
        for parent in [m for m in layer.modules() if any(type(c) is nn.Linear for c in m.children())]:
            for name in [n for n, c in parent.named_children() if type(c) is nn.Linear]:
                setattr(parent, name, Fp8Linear.from_linear(getattr(parent, name)))


def linear_method(quantization: str, checkpoint: CheckpointQuantization | None,
                  dummy: bool = False) -> LinearMethod:
    """The method for `--quantization` on a checkpoint quantized as `checkpoint` (None: high
    precision); `dummy`: the weights are drawn at random instead of read."""
    # Every checkpoint format is FP8 for now, so --quantization none and fp8 both run it; with
    # a second method, a --quantization other than the checkpoint's is to be refused here.
    if checkpoint is not None and not dummy:
        if checkpoint.quant_method == "compressed-tensors":
            return Fp8Checkpoint()
        return Fp8BlockCheckpoint(checkpoint.weight_block_size)
    if checkpoint is not None:      # random weights are drawn in high precision: quantized on load
        quantization = checkpoint.method
    return Fp8OnLoad() if quantization == "fp8" else LinearMethod()


# ---------------------------------------------------------------- config.json's quantization_config

def checkpoint_quantization(config: dict, num_layers: int) -> CheckpointQuantization:
    """Checks a config.json `quantization_config`; ValueError names what is not supported."""
    method = config.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(config, num_layers)
        return CheckpointQuantization(method="fp8", quant_method=method)
    if method == "fp8":
        block = config.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config (quant_method fp8) has weight_block_size {block!r}: "
                             f"two block sides are needed, such as [128, 128]")
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config (quant_method fp8) has fmt {config['fmt']!r}: only e4m3 is supported")
        return CheckpointQuantization(method="fp8", quant_method=method, weight_block_size=tuple(block))
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: "
                     f"{'; '.join(SUPPORTED_CHECKPOINTS)})")


def _check_compressed_tensors(config: dict, num_layers: int) -> None:
    """A compressed-tensors config this loader can read as it is: FP8 weights (per channel or
    per tensor) on every decoder linear and on nothing else."""
    where = "quantization_config (compressed-tensors)"
    if config.get("format") != "float-quantized":
        raise ValueError(f"{where} has format {config.get('format')!r}: only float-quantized (FP8) is supported")
    for key, what in (("sparsity_config", "sparsity"), ("kv_cache_scheme", "a quantized KV cache"),
                      ("transform_config", "transforms")):
        if config.get(key):
            raise ValueError(f"{where} asks for {what} ({key}), which is not supported")
    groups = config.get("config_groups") or {}
    for group_name, group in groups.items():
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if not (weights.get("num_bits") == 8 and weights.get("type") == "float"
                and weights.get("strategy") in ("channel", "tensor") and weights.get("symmetric", True)):
            raise ValueError(f"{where} group {group_name!r} has weights {weights}: supported are "
                             f"symmetric 8-bit float weights, per channel or per tensor")
        if inputs is not None and not (inputs.get("num_bits") == 8 and inputs.get("type") == "float"):
            raise ValueError(f"{where} group {group_name!r} has input_activations {inputs}: supported "
                             f"are 8-bit float activations (computed per token at run time) or none")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where} group {group_name!r} quantizes output activations, which is not supported")
    ignore = config.get("ignore") or []

    def quantized(name: str) -> bool:
        return any(_matches(name, g.get("targets") or []) for g in groups.values()) and not _matches(name, ignore)

    decoder = [f"model.layers.{i}.{linear}" for i in range(num_layers) for linear in DECODER_LINEARS]
    if unquantized := [n for n in decoder if not quantized(n)]:
        raise ValueError(f"{where} leaves decoder linears unquantized ({unquantized[:3]}): a model of "
                         f"FP8 and high-precision decoder layers is not supported")
    if quantized("lm_head"):
        raise ValueError(f"{where} quantizes lm_head: only the decoder linears can be FP8 (put lm_head in ignore)")


def _matches(name: str, patterns: list[str]) -> bool:
    """compressed-tensors' matching of a Linear module: by class name, by full name, or by
    `re:` regular expression."""
    return any(p in ("Linear", name) or (p.startswith("re:") and re.match(p[3:], name)) for p in patterns)


# ---------------------------------------------------------------- tensors and lazy slices

def _is_decoder_linear(module: str) -> bool:
    module = module.removeprefix("model.")
    return module.startswith("layers.") and module.split(".", 2)[-1] in DECODER_LINEARS


def _shape(source: Tensorish) -> tuple[int, ...]:
    return tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())


def _dtype_name(source: Tensorish) -> str:
    return str(source.dtype) if isinstance(source, torch.Tensor) else source.get_dtype()


def _is_fp8(source: Tensorish) -> bool:
    return _dtype_name(source) in (str(FP8_DTYPE), "F8_E4M3")      # a tensor's, safetensors' name


def _whole(source: Tensorish) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]

