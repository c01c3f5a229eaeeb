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
- A Hugging Face `fp8` checkpoint with block scales (128 x 128 in the published ones): the
  model is built with `Fp8GroupedLinear` and reads the stored float8 weights as they are,
  each block's scale given to each of its rows (a scale per output channel per 128 inputs);
  `--load-format dummy` with such a config quantizes random weights into that layout.
- `--quantization int8` (CPU only so far): the same on load, each linear becoming an
  `Int8Linear` (int8 W8A8: weights per output channel, activations per token, `kernels.int8`).
- A 4-bit weight-only checkpoint (W4A16): GPTQ (v1 and v2), AWQ (GEMM) or compressed-tensors
  `pack-quantized`. The model is built with `W4Linear`; each linear's tensors are read whole,
  repacked into the one canonical layout of `kernels.w4_weight` (`worker.models.w4_formats`), and
  the model slices and fuses those like any other weight: q/k/v and gate/up concatenate along
  out_features, row-parallel layers take their whole groups of in_features.
  (`--load-format dummy` with a 4-bit method draws high-precision weights and rounds them to
  4 bits on load, for benchmarks of the shape.)
- A GGUF file's decoder linears of the types Q4_0, Q4_1, Q4_K, Q6_K, Q8_0 stay in their
  blocks on a GPU (and on the CPU under `--quantization gguf`; `none` dequantizes them there,
  which is faster): Q4_0 is the canonical layout at group 32 (`W4Linear`), Q4_1 and Q4_K the
  same with a float offset per group, Q8_0 and Q6_K the sum of two such weights
  (`W4PairLinear`, groups of 32 and 16). Each linear is kept or not on its own, a fused one
  (q/k/v, gate/up) when its parts share a type, so a file of mixed types (llama.cpp's Q4_K_M)
  keeps most; other GGUF types are dequantized on load.
"""

import abc
import importlib.util
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from kernels.fp8 import (FP8_DTYPE, Fp8Activation, dequantize_blocks, fp8_grouped_linear, fp8_linear, group_quant,
                         per_channel_quant, w8a8_applies)
from kernels.int8 import int8_linear, per_channel_quant_int8
from kernels.w4_weight import PACK, W4Weight
from kernels.w4a16 import w4a16_matmul
from worker.config import CheckpointQuantization, ModelConfig
from worker.models import w4_formats
from worker.models.llama import CheckpointSlice, DenseLinear
from worker.parallel import Shard, check_splittable, split_heads

Tensorish = torch.Tensor | CheckpointSlice      # a checkpoint tensor, read or not yet

log = logging.getLogger("pagedserve.worker")

# The quantized linears by their Hugging Face names (the model packs q/k/v and gate/up).
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SUPPORTED_CHECKPOINTS = (("compressed-tensors (format float-quantized: FP8 weights per channel or per tensor; "
                          "format pack-quantized: 4-bit integer weights, W4A16)"),
                         "fp8 (Hugging Face, with weight_block_size)",
                         "gptq (4 bits, checkpoint_format gptq or gptq_v2)",
                         "awq (4 bits, version gemm)")
FP8_MIN_CAPABILITY = (8, 9)     # FP8 tensor cores: Ada, Hopper and later
W4_METHODS = ("gptq", "awq", "compressed-tensors")      # the --quantization names of 4-bit formats
# The Triton W4A16 GEMM's K-tiles hold at least 16 rows and never straddle a group
# (kernels/triton_w4a16.py `_block_k`): a group size must be a multiple of 16, or -1.
W4_GROUP_MULTIPLE = 16
W4_ON_LOAD_GROUP_SIZE = 128     # random weights rounded to 4 bits on load (dummy): the common size


class Fp8Linear(nn.Module):
    """`x @ (weight * weight_scale[:, None]).T + bias` with `weight` float8_e4m3fn `[out, in]`
    and one fp32 scale per output channel. On a GPU, steps of up to 32 tokens run W8A16 (`x` as
    it is, the weight read once: decode is bound by weight bytes) and larger ones W8A8 (`x`
    quantized per token); see `kernels.fp8.fp8_linear`."""

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

    def forward(self, x: "torch.Tensor | Fp8Activation") -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether an input of `x`'s rows, dtype and device is quantized per token (W8A8), so
        the kernel that computes it may hand it over quantized (`Fp8Activation`)."""
        return w8a8_applies(x.numel() // x.shape[-1], x.dtype, x.device, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Fp8GroupedLinear(nn.Module):
    """`x @ W.T + bias` with `W` float8_e4m3fn `[out, in]` scaled per output channel per
    `group_size` inputs (`weight_scale [out, ceil(in / group_size)]`): a Hugging Face fp8
    checkpoint's blocks of `[block_n, group_size]` with each block's scale given to each of
    its rows, which costs 4 bytes per `group_size` weights (3 % at 128) and lets q/k/v and
    gate/up concatenate, and tensor parallelism slice, along the outputs as for any weight.
    On a GPU up to 32 tokens run W8A16 and more W8A8 with the activations quantized per token
    per group (`kernels.fp8.fp8_grouped_linear`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, -(-in_features // group_size),
                                                     dtype=torch.float32, device=device), requires_grad=False)
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
                                if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "Fp8GroupedLinear":
        """`linear` quantized per output channel per `group_size` inputs (its bias shared)."""
        fp8 = cls(linear.in_features, linear.out_features, bias=False, group_size=group_size, device="meta")
        weight, scale = group_quant(linear.weight, group_size)
        fp8.weight = nn.Parameter(weight, requires_grad=False)
        fp8.weight_scale = nn.Parameter(scale, requires_grad=False)
        fp8.bias = linear.bias
        return fp8

    def checkpoint_axes(self, name: str) -> tuple[int | None, int | None, int]:
        """For the model's loader (as `W4Linear.checkpoint_axes`): a column of `weight_scale`
        stands for `group_size` input features."""
        if name == "weight":
            return 0, 1, 1
        if name == "weight_scale":
            return 0, 1, self.group_size
        return 0, None, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_grouped_linear(x, self.weight, self.weight_scale, self.group_size, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class Int8Linear(nn.Module):
    """`x @ (weight * weight_scale[:, None]).T + bias` with `weight` int8 `[out, in]`, one fp32
    scale per output channel, and `x` quantized to int8 per token (`kernels.int8`)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = bias

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """The int8 copy of `linear` (its bias is shared, not copied)."""
        return cls(*per_channel_quant_int8(linear.weight), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class W4Linear(nn.Module):
    """`x @ W.T + bias` with `W` held as 4-bit integers in the canonical layout of
    `kernels.w4_weight` (`qweight`, `scales`, `zeros`, and `perm` under act-order), dequantized
    inside the GEMM (`w4a16_matmul`: Triton on a GPU, the reference on the CPU). The tensors
    are parameters, so the model's loader, `to_empty` and `.to(device)` treat them like
    `nn.Linear`'s; `scales` takes the model's dtype, as the model's other weights do, unless
    `scales_dtype` says otherwise (GGUF's scales, exact in float16 or float32). With
    `offsets`, the layer also holds the float `offsets` of formats that add one per group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 act_order: bool = False, device: torch.device | str | None = None, *,
                 scales_dtype: torch.dtype | None = None, offsets: bool = False):
        """`group_size` -1: one group over all in_features (and, split by rows under tensor
        parallelism, over each rank's)."""
        super().__init__()
        group = in_features if group_size == -1 else group_size
        if group <= 0 or in_features % PACK or in_features % group:
            raise ValueError(f"a 4-bit linear of {in_features} input features cannot have groups of "
                             f"{group_size}: in_features must be a multiple of {PACK} and of the group size")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group
        self.one_group = group_size == -1
        groups = in_features // group
        self.qweight = nn.Parameter(torch.empty(in_features // PACK, out_features, dtype=torch.int32,
                                                device=device), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(groups, out_features, dtype=scales_dtype, device=device),
                                   requires_grad=False)
        self.zeros = nn.Parameter(torch.empty(groups, out_features, dtype=torch.uint8, device=device),
                                  requires_grad=False)
        self.register_parameter("offsets", nn.Parameter(torch.empty_like(self.scales), requires_grad=False)
                                if offsets else None)
        self.register_parameter("perm", nn.Parameter(torch.empty(in_features, dtype=torch.int32, device=device),
                                                     requires_grad=False) if act_order else None)
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
                                if bias else None)
        self._weights: dict[str, W4Weight] = {}     # by the suffix of their parameters' names

    @classmethod
    def from_weight(cls, weight: W4Weight, bias: torch.Tensor | None = None) -> "W4Linear":
        """A layer holding `weight`'s tensors (and `bias`) themselves."""
        linear = cls(weight.in_features, weight.out_features, False, weight.group_size, device="meta")
        linear.qweight, linear.scales, linear.zeros = (nn.Parameter(t, requires_grad=False) for t in
                                                       (weight.qweight, weight.scales, weight.zeros))
        linear.offsets = None if weight.offsets is None else nn.Parameter(weight.offsets, requires_grad=False)
        linear.perm = None if weight.perm is None else nn.Parameter(weight.perm, requires_grad=False)
        linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return linear

    @property
    def w4(self) -> W4Weight:
        """The layer's tensors as a `W4Weight`."""
        return self._weight("")

    def _weight(self, suffix: str) -> W4Weight:
        """The parameters named `qweight{suffix}`, ... as a `W4Weight`, built again only when
        one was replaced (`to_empty`, a dropped perm): its checks cost more than a decode
        step's GEMM on small layers."""
        tensors = [getattr(self, name + suffix) for name in ("qweight", "scales", "zeros")] + [
            self.perm, getattr(self, "offsets" + suffix)]
        w = self._weights.get(suffix)
        if w is None or any(a is not b for a, b in zip((w.qweight, w.scales, w.zeros, w.perm, w.offsets), tensors)):
            w = self._weights[suffix] = W4Weight(*tensors[:3], self.group_size, self.in_features,
                                                 self.out_features, *tensors[3:])
        return w

    def checkpoint_axes(self, name: str) -> tuple[int | None, int | None, int]:
        """For the model's loader: parameter `name`'s dimension along out_features, along
        in_features (None: it has none), and the in_features each entry along the latter
        stands for (a row of `qweight` packs 8; one of `scales` or `zeros`, a group)."""
        if name == "qweight":
            return 1, 0, PACK
        if name in ("scales", "zeros", "offsets"):
            # One group over all inputs: a rank holding some of the rows needs all of it.
            return (1, None, 1) if self.one_group else (1, 0, self.group_size)
        if name == "perm":
            return None, None, 1      # one input order for the whole layer (and for all its fused parts)
        return 0, None, 1             # bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = w4a16_matmul(x, self.w4)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size="
                f"{-1 if self.one_group else self.group_size}, act_order={self.perm is not None}, "
                f"offsets={self.offsets is not None}, bias={self.bias is not None}")


class W4PairLinear(W4Linear):
    """`x @ W.T + bias` with `W` in integers of more than 4 bits per group (GGUF Q8_0 in
    groups of 32, Q6_K in groups of 16), held as the sum of two 4-bit weights in the
    canonical layout (`w4_formats.from_gguf_q8_0`, `from_gguf_q6_k`): a high one (`qweight`,
    `scales`, `zeros`) and a low one (`qweight_low`, ...). Two W4A16 GEMMs read the bytes an
    8-bit GEMM would, with no kernel of their own."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 device: torch.device | str | None = None, *, scales_dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias, group_size, device=device, scales_dtype=scales_dtype)
        self.register_parameter("offsets_low", None)
        for name in ("qweight", "scales", "zeros"):
            high = getattr(self, name)
            self.register_parameter(f"{name}_low", nn.Parameter(torch.empty_like(high), requires_grad=False))

    def checkpoint_axes(self, name: str) -> tuple[int | None, int | None, int]:
        return super().checkpoint_axes(name.removesuffix("_low"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = w4a16_matmul(x, self.w4) + w4a16_matmul(x, self._weight("_low"))
        return out if self.bias is None else out + self.bias


@torch.no_grad()
def round_to_w4(weight: torch.Tensor, group_size: int, offsets: bool = False) -> W4Weight:
    """`weight [N, K]` rounded to 4 bits per group of `group_size` inputs (-1: one group),
    each group's range [min, max] mapped onto 0..15 (asymmetric, round to nearest): what a
    real checkpoint's calibration does better, for weights that have no checkpoint. With
    `offsets`, in GGUF's Q4_1 / Q4_K form: no zero point, each group's minimum its float
    offset (`W = q * scale + min`), scales and offsets in float32 as a kept Q4_K file's are."""
    n, k = weight.shape
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"{k} input features do not split into groups of {group}")
    w = weight.float().reshape(n, k // group, group)
    if offsets:
        low, high = w.amin(-1), w.amax(-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        values = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15)
        return W4Weight.from_values(values.reshape(n, k).t(), scales.t(), torch.zeros_like(scales.t()), group,
                                    offsets=low.t())
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)     # zero stays representable
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    zeros = (-low / scales).round().clamp(0, 15)
    values = (w / scales[..., None] + zeros[..., None]).round().clamp(0, 15)
    return W4Weight.from_values(values.reshape(n, k).t(), scales.t().to(weight.dtype), zeros.t(), group)


# ---------------------------------------------------------------- how a load treats the linears

class LinearMethod:
    """High-precision linears, loaded as the checkpoint has them."""

    asked = "--quantization none"       # what chose this method, for error messages
    description = "high precision"      # what the linears compute, for the load log
    keep: frozenset[str] = frozenset()  # decoder linears whose GGUF tensors the loader hands on in blocks

    def create(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return DenseLinear(in_features, out_features, bias=bias)

    def prepare(self, model: nn.Module) -> None:
        """Called on the model built (on the meta device) before any weight is read: may
        replace decoder linears that differ from the rest (GGUF's, per module)."""

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
    description = "FP8 W8A8, quantized on load per output channel"

    def after_loading(self, model: nn.Module) -> None:
        quantize_decoder_linears(model)


class Fp8GroupedOnLoad(Fp8OnLoad):
    """Random weights (`--load-format dummy`) of a Hugging Face fp8 checkpoint's shape: drawn
    in high precision, then each decoder linear quantized into the checkpoint's layout
    (`Fp8GroupedLinear`), so that a benchmark measures the GEMMs the checkpoint would run."""

    asked = "--load-format dummy with a Hugging Face fp8 config"

    def __init__(self, block: tuple[int, int]):
        self.block, self.group_size = block, block[1]
        self.description = f"FP8 W8A8, quantized on load per output channel per {block[1]} inputs"

    def check_device(self, device: torch.device) -> None:
        _check_block_inputs(self.asked, self.block, device)
        super().check_device(device)

    def after_loading(self, model: nn.Module) -> None:
        quantize_decoder_linears(model, lambda linear: Fp8GroupedLinear.from_linear(linear, self.group_size))


def _check_block_inputs(asked: str, block: tuple[int, int], device: torch.device) -> None:
    """ValueError when the GPU kernels cannot take blocks of `block[1]` inputs."""
    if device.type == "cuda" and block[1] % 16:
        raise ValueError(f"{asked}: weight_block_size {list(block)} has blocks of {block[1]} inputs, but the GPU "
                         f"kernels take K-tiles of at least 16 inside a block: allowed are blocks of a multiple of "
                         f"16 inputs (the published checkpoints use 128)")


class Fp8Checkpoint(Fp8Method):
    """A compressed-tensors float-quantized checkpoint: float8 weights `[N, K]` as stored, with
    per-channel (`[N, 1]`) or per-tensor (`[1]`) weight scales, made per channel `[N]`."""

    asked = "the checkpoint's FP8 quantization_config (compressed-tensors)"
    description = "FP8 W8A8 as stored (compressed-tensors float-quantized)"

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


class Fp8BlockCheckpoint(Fp8Method):
    """A Hugging Face `fp8` checkpoint with block scales (`weight_scale_inv [ceil(N / bn),
    ceil(K / bk)]`, by which the float8 weight is multiplied): each decoder linear becomes an
    `Fp8GroupedLinear` with the stored float8 weight as it is and each block's scale given to
    each of the block's `bn` rows (groups of `bk` inputs). A decoder linear the checkpoint left
    in high precision is quantized into the same layout as it is read; any other quantized
    tensor (an LM head) is dequantized and keeps the model's dtype."""

    asked = "the checkpoint's FP8 quantization_config (Hugging Face fp8 with block scales)"

    def __init__(self, block: tuple[int, int]):
        self.block = block
        self.description = f"FP8 W8A8 as stored (Hugging Face fp8 checkpoint, {block[0]}x{block[1]} block scales)"

    def check_device(self, device: torch.device) -> None:
        _check_block_inputs(self.asked, self.block, device)
        super().check_device(device)

    def create(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return Fp8GroupedLinear(in_features, out_features, bias, self.block[1])

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Tensorish]]) -> Iterator[tuple[str, Tensorish]]:
        rows: dict[str, int] = {}                   # decoder linear -> output rows of its weight
        waiting: dict[str, torch.Tensor] = {}       # decoder linear -> block scales read before its weight
        pending: dict[str, dict[str, Tensorish]] = {}    # another module -> its weight / scales, until both are read
        for name, source in weights:
            module, _, kind = name.rpartition(".")
            if kind == "input_scale":
                continue    # static activation scales: dynamic per-token ones instead (as above)
            if kind not in ("weight", "weight_scale_inv") or (kind == "weight" and not _is_fp8(source)):
                if kind == "weight" and _is_decoder_linear(module):
                    # Left in high precision by the checkpoint: quantized into the layer's layout.
                    weight, scale = group_quant(_whole(source), self.block[1])
                    yield name, weight
                    yield f"{module}.weight_scale", scale
                else:
                    yield name, source
            elif not _is_decoder_linear(module):
                parts = pending.setdefault(module, {})
                parts[kind] = source
                if len(parts) == 2:
                    del pending[module]
                    yield f"{module}.weight", dequantize_blocks(_whole(parts["weight"]),
                                                                _whole(parts["weight_scale_inv"]), self.block)
            elif kind == "weight":
                rows[module] = _shape(source)[0]
                yield name, source          # as stored; read lazily, this rank's slice only
                if module in waiting:
                    yield f"{module}.weight_scale", self._per_row(module, waiting.pop(module), rows[module])
            elif module in rows:
                yield f"{module}.weight_scale", self._per_row(module, _whole(source), rows[module])
            else:
                waiting[module] = _whole(source)
        if pending or waiting:
            raise ValueError(f"checkpoint has float8 weights without block scales or scales without "
                             f"weights: {sorted([*pending, *waiting])[:3]}")

    def _per_row(self, module: str, scale: torch.Tensor, rows: int) -> torch.Tensor:
        """Block scales `[ceil(rows / bn), groups]` given to each row: `[rows, groups]`."""
        if scale.dim() != 2 or scale.shape[0] != -(-rows // self.block[0]):
            raise ValueError(f"checkpoint tensor {module}.weight_scale_inv has shape {tuple(scale.shape)}, but "
                             f"{rows} rows in blocks of {self.block[0]} need {-(-rows // self.block[0])} rows of scales")
        return scale.float().repeat_interleave(self.block[0], dim=0)[:rows]


class Int8OnLoad(LinearMethod):
    """`--quantization int8` on high-precision weights (or GGUF, dequantized first): each
    decoder linear is loaded as `nn.Linear`, then replaced by its `Int8Linear`."""

    asked = "--quantization int8"
    description = "int8 W8A8, quantized on load per output channel (activations per token)"

    def check_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"{self.asked} runs on the CPU only (its GEMM has not been measured on a GPU "
                             f"yet); allowed on {device.type}: --quantization fp8 (W8A8 in float8) or none")

    def after_loading(self, model: nn.Module) -> None:
        quantize_decoder_linears(model, Int8Linear.from_linear)


ON_LOAD = {"fp8": Fp8OnLoad, "int8": Int8OnLoad}   # --quantization values that quantize as they load


@torch.no_grad()
def quantize_decoder_linears(model: nn.Module,
                             convert: Callable[[nn.Linear], nn.Module] = Fp8Linear.from_linear) -> None:
    """Replaces every `nn.Linear` of the decoder layers by `convert(linear)` (its `Fp8Linear`
    unless told otherwise), one at a time: each high-precision weight is freed as soon as its
    quantized copy replaces it (nothing else holds it), so an 8B model never holds both."""
    for layer in model.layers:
        for parent in [m for m in layer.modules() if any(isinstance(c, nn.Linear) for c in m.children())]:
            for name in [n for n, c in parent.named_children() if isinstance(c, nn.Linear)]:
                setattr(parent, name, convert(getattr(parent, name)))


class W4Method(LinearMethod):
    """What every 4-bit method shares: the device check."""

    def check_device(self, device: torch.device) -> None:
        if device.type == "cpu":
            log.info("W4A16 (%s) on the CPU: each linear dequantizes its weight at every call "
                     "(kernels.w4a16.w4a16_matmul_ref), which is slower than the unquantized model", self.asked)
        elif device.type == "cuda" and importlib.util.find_spec("triton") is None:
            raise ValueError(f"{self.asked} on a GPU needs the Triton W4A16 GEMM, and triton is not "
                             f"installed (pip install triton); allowed without it: --device cpu")


class W4OnLoad(W4Method):
    """Random (dummy) weights, drawn in high precision, rounded to 4 bits once loaded: the
    memory and speed of a 4-bit checkpoint of the shape, without its accuracy. `offsets`: in
    the form a GGUF Q4_K file's linears are kept in (`round_to_w4`)."""

    def __init__(self, asked: str, group_size: int, offsets: bool = False):
        self.asked, self.group_size, self.offsets = asked, group_size, offsets
        form = (f"in GGUF Q4_K's form: groups of {group_size}, float32 scales and minimums" if offsets
                else f"(group size {group_size})")
        self.description = f"W4A16, random weights rounded to 4 bits on load {form}"

    def after_loading(self, model: nn.Module) -> None:
        def rounded(linear: nn.Linear) -> W4Linear:
            try:
                return W4Linear.from_weight(round_to_w4(linear.weight, self.group_size, self.offsets), linear.bias)
            except ValueError as e:
                raise ValueError(f"{self.asked} on random weights rounds them in groups of {self.group_size}: "
                                 f"{e}") from e
        quantize_decoder_linears(model, rounded)


# A decoder linear's Hugging Face name -> the packed projection it is part of.
FUSED_PROJECTIONS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                     "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


class W4Checkpoint(W4Method, abc.ABC):
    """A pre-quantized 4-bit checkpoint, in the format a subclass reads. Each decoder
    linear's tensors are gathered (a linear's come together in the name-sorted files, so few
    wait at once), read whole, repacked into the canonical layout (`W4Linear`'s parameters:
    qweight, scales, zeros and, under act-order, perm) and handed on; the model takes its
    slice of those. So a rank of a tensor-parallel worker reads every layer whole (4-bit
    weights are a quarter of bf16's bytes, each held only until repacked) rather than the
    format's own slices, and the slicing is written once, for the canonical layout."""

    parts: tuple[str, ...]              # the tensors every layer of the format has
    zero_point_part: str | None = None  # the one stored only with zero points (asymmetric)
    g_idx_part: str | None = None       # the one giving each input feature's group

    def __init__(self, checkpoint: CheckpointQuantization):
        self.checkpoint = checkpoint
        self.asked = f"the checkpoint's 4-bit quantization_config ({checkpoint.quant_method})"
        details = [checkpoint.quant_method,
                   "one group per row" if checkpoint.group_size == -1 else f"group size {checkpoint.group_size}",
                   "symmetric" if checkpoint.symmetric else "zero points"]
        if checkpoint.checkpoint_format:
            details.insert(1, f"checkpoint_format {checkpoint.checkpoint_format}")
        if checkpoint.act_order:
            details.append("act-order")
        self.description = f"W4A16 as stored ({', '.join(details)})"
        self.required = set(self.parts)
        if self.zero_point_part and not checkpoint.symmetric:
            self.required.add(self.zero_point_part)
        if self.g_idx_part and checkpoint.act_order:
            self.required.add(self.g_idx_part)

    def create(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return W4Linear(in_features, out_features, bias, self.checkpoint.group_size, self.checkpoint.act_order)

    @abc.abstractmethod
    def repack(self, parts: dict[str, torch.Tensor]) -> W4Weight:
        """One layer's tensors (the keys of `self.required`) in the canonical layout."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Tensorish]]) -> Iterator[tuple[str, Tensorish]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}         # linear -> its tensors read so far
        orders: dict[str, tuple[str, torch.Tensor]] = {}         # fused projection -> (first part, its perm)
        in_features: dict[str, dict[str, int]] = {}              # linear -> {tensor: input features it spans}
        for name, source in weights:
            linear, _, kind = name.rpartition(".")
            if not _is_decoder_linear(linear) or kind == "bias":
                yield name, source
                continue
            if kind == self.g_idx_part and not self.checkpoint.act_order:
                g_idx = _whole(source)
                _check_groups_in_order(name, g_idx, self.checkpoint.group_size)
                _same_in_features(linear, in_features, kind, g_idx.shape[0])
                continue        # the plain grouping, which the canonical layout has anyway
            if kind == self.zero_point_part and self.checkpoint.symmetric:
                raise ValueError(f"checkpoint tensor {name!r} holds zero points, but the quantization_config says "
                                 f"the weights are symmetric (symmetric: true); allowed: symmetric: false with "
                                 f"zero points, or symmetric weights without them")
            if kind not in self.required:
                raise ValueError(f"checkpoint tensor {name!r} is not one of a {self.checkpoint.quant_method} 4-bit "
                                 f"layer's ({', '.join(sorted(self.required))}): a model of 4-bit and other "
                                 f"decoder linears is not supported")
            parts = pending.setdefault(linear, {})
            parts[kind] = _whole(source)
            if len(parts) < len(self.required):
                continue
            del pending[linear]
            try:
                w = self.repack(parts)
            except ValueError as e:
                raise ValueError(f"checkpoint layer {linear!r}: {e}") from e
            _same_in_features(linear, in_features, "weight", w.in_features)
            yield f"{linear}.qweight", w.qweight
            yield f"{linear}.scales", w.scales
            yield f"{linear}.zeros", w.zeros
            if self.checkpoint.act_order:
                perm = w.perm if w.perm is not None else torch.arange(w.in_features, dtype=torch.int32)
                self._check_fused_order(linear, perm, orders)
                yield f"{linear}.perm", perm
        if pending:
            linear, parts = next(iter(pending.items()))
            raise ValueError(f"checkpoint lacks {', '.join(sorted(self.required - parts.keys()))} of the 4-bit "
                             f"layer {linear!r} ({len(pending)} layers incomplete)")

    def _check_fused_order(self, linear: str, perm: torch.Tensor,
                           orders: dict[str, tuple[str, torch.Tensor]]) -> None:
        """Refuses parts of one fused projection quantized in different activation orders:
        the packed projection gathers its input once, in one order. (Not unfused instead:
        GPTQ and llm-compressor derive the order from the layer's inputs, which q/k/v and
        gate/up share, so such checkpoints are not expected.)"""
        prefix, _, projection = linear.rpartition(".")
        if projection not in FUSED_PROJECTIONS:
            return
        fused = f"{prefix}.{FUSED_PROJECTIONS[projection]}"
        first, first_perm = orders.setdefault(fused, (linear, perm))
        if not torch.equal(first_perm, perm):
            raise ValueError(f"checkpoint layers {first!r} and {linear!r} have different act-order groups "
                             f"({self.g_idx_part}), but pagedserve packs them into one {FUSED_PROJECTIONS[projection]} "
                             f"that takes its input in one order; allowed: act-order checkpoints whose fused "
                             f"projections share their g_idx")

    def after_loading(self, model: nn.Module) -> None:
        if not self.checkpoint.act_order:
            return
        for module in model.modules():
            if isinstance(module, W4Linear) and module.perm is not None and torch.equal(
                    module.perm, torch.arange(module.in_features, dtype=torch.int32, device=module.perm.device)):
                module.perm = None      # groups in input order after all: no gather in the GEMM


class GptqCheckpoint(W4Checkpoint):
    """GPTQ (`worker.models.w4_formats.from_gptq`: v1 or v2 zero points, act-order g_idx)."""

    parts = ("qweight", "qzeros", "scales")
    g_idx_part = "g_idx"

    def repack(self, parts: dict[str, torch.Tensor]) -> W4Weight:
        return w4_formats.from_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                                    group_size=self.checkpoint.group_size,
                                    checkpoint_format=self.checkpoint.checkpoint_format)


class AwqCheckpoint(W4Checkpoint):
    """AWQ GEMM (`worker.models.w4_formats.from_awq`)."""

    parts = ("qweight", "qzeros", "scales")

    def repack(self, parts: dict[str, torch.Tensor]) -> W4Weight:
        return w4_formats.from_awq(parts["qweight"], parts["qzeros"], parts["scales"],
                                   group_size=self.checkpoint.group_size)


class CompressedTensorsW4Checkpoint(W4Checkpoint):
    """compressed-tensors `pack-quantized` (`worker.models.w4_formats.from_compressed_tensors`)."""

    parts = ("weight_packed", "weight_scale", "weight_shape")
    zero_point_part = "weight_zero_point"
    g_idx_part = "weight_g_idx"

    def repack(self, parts: dict[str, torch.Tensor]) -> W4Weight:
        return w4_formats.from_compressed_tensors(
            parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], parts.get("weight_zero_point"),
            parts.get("weight_g_idx"), group_size=self.checkpoint.group_size)


class GgufCheckpoint(W4Method):
    """A GGUF file's decoder linears of a type of `w4_formats.GGUF_KEPT` (all the parts of a
    fused one of one type: `loader.gguf_kept_modules`), kept as stored: Q4_0, Q4_1 and Q4_K
    as `W4Linear`s of group 32 (with offsets for Q4_1 and Q4_K), Q8_0 and Q6_K as
    `W4PairLinear`s (groups of 32 and 16). The model is built with `nn.Linear`s and `prepare`
    puts those in place of the kept ones; the loader reads them repacked
    (`loader.gguf_weights`, `keep`) and dequantizes only the other tensors."""

    def __init__(self, checkpoint: CheckpointQuantization):
        self.kept = checkpoint.kept_modules
        self.keep = frozenset(self.kept)
        self.asked = f"a GGUF file of {checkpoint.checkpoint_format} decoder linears"
        counts = sorted(Counter(self.kept.values()).items())
        self.description = "as stored: " + ", ".join(
            f"{n} in GGUF {kind} (W{w4_formats.GGUF_KEPT[kind].bits}A16, groups of "
            f"{w4_formats.GGUF_KEPT[kind].group_size})" for kind, n in counts)

    def prepare(self, model: nn.Module) -> None:
        for name, kind in self.kept.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear, kept = getattr(parent, child), w4_formats.GGUF_KEPT[kind]
            shape = linear.in_features, linear.out_features, linear.bias is not None, kept.group_size
            setattr(parent, child, W4PairLinear(*shape, device="meta", scales_dtype=kept.scales_dtype) if kept.pair
                    else W4Linear(*shape, device="meta", scales_dtype=kept.scales_dtype, offsets=kept.offsets))


def gguf_stays_quantized(quantization: str, device_type: str) -> bool:
    """Whether a GGUF file's decoder linears of a kept type stay in their blocks: when
    `--quantization gguf` asks, and under `none` on a GPU. On the CPU, `none` dequantizes
    them on load, as it does every other GGUF type: there the W4A16 matmul is the reference,
    which dequantizes the whole weight at every call (several times slower than a float32
    matmul), so keeping them saves memory only."""
    return quantization == "gguf" or quantization == "none" and device_type != "cpu"


W4_CHECKPOINTS: dict[str, type[W4Checkpoint]] = {
    "gptq": GptqCheckpoint, "awq": AwqCheckpoint, "compressed-tensors": CompressedTensorsW4Checkpoint}


def _check_groups_in_order(name: str, g_idx: torch.Tensor, group_size: int) -> None:
    """A g_idx the config says is not in activation order must be the plain grouping."""
    k, g_idx = g_idx.shape[0], g_idx.to(torch.int64)
    plain = torch.arange(k) // (k if group_size == -1 else group_size)
    if torch.equal(g_idx, plain):
        return
    groups = int(g_idx.max()) + 1 if k else 0
    if groups and k % groups == 0 and torch.equal(g_idx, torch.arange(k) // (k // groups)):
        raise ValueError(f"checkpoint tensor {name!r} groups the input features in groups of {k // groups}, but the "
                         f"quantization_config says group_size {group_size}")
    raise ValueError(f"checkpoint tensor {name!r} groups the input features in activation order, but the "
                     f"quantization_config says they are not (desc_act / actorder off)")


def _same_in_features(linear: str, seen: dict[str, dict[str, int]], tensor: str, count: int) -> None:
    """Refuses a layer whose g_idx and weight disagree on its input features (whichever came first)."""
    spans = seen.setdefault(linear, {})
    spans[tensor] = count
    if len(set(spans.values())) > 1:
        raise ValueError(f"checkpoint layer {linear!r}: its tensors span different input features "
                         f"({', '.join(f'{t} {n}' for t, n in sorted(spans.items()))})")


def allowed_quantizations(checkpoint: CheckpointQuantization | None) -> tuple[str, ...]:
    """The --quantization values that run a checkpoint quantized as `checkpoint`."""
    if checkpoint is None:
        return ("none", *ON_LOAD)
    if checkpoint.quant_method == "gguf":
        return ("none", "gguf", *ON_LOAD)   # fp8 or int8 on GGUF: dequantized, then quantized on load
    fp8 = ("fp8",) if checkpoint.method == "fp8" and checkpoint.quant_method != "fp8" else ()
    return ("none", checkpoint.quant_method) + fp8


def quantization_label(quantization: str, checkpoint: CheckpointQuantization | None, device_type: str) -> str:
    """What the decoder linears are, for Info and the metrics: `none`, `fp8` (quantized on
    load), or the checkpoint's quant_method and scheme (`gptq w4a16`, `gguf Q4_0`, ...), on a
    device of type `device_type`."""
    if checkpoint is None or quantization in ON_LOAD and checkpoint.quant_method == "gguf":
        return quantization if quantization in ON_LOAD or quantization == "none" else f"{quantization} w4a16"
    if checkpoint.quant_method == "gguf":
        return f"gguf {checkpoint.checkpoint_format}" if gguf_stays_quantized(quantization, device_type) else "none"
    if checkpoint.quant_method == "fp8":       # Hugging Face's block FP8: its scheme is the block
        return "fp8 block {}x{}".format(*checkpoint.weight_block_size)
    return f"{checkpoint.quant_method} {checkpoint.method}"


def linear_method(quantization: str, checkpoint: CheckpointQuantization | None, device_type: str,
                  dummy: bool = False) -> LinearMethod:
    """The method for `--quantization` on a checkpoint quantized as `checkpoint` (None: high
    precision), on a device of type `device_type`; `dummy`: the weights are drawn at random
    instead of read. ValueError names the --quantization values that fit when this one does
    not."""
    if checkpoint is None and quantization == "gguf":
        if dummy:       # the shape of a GGUF Q4_K file's kept linears, for benchmarks
            return W4OnLoad("--load-format dummy --quantization gguf", w4_formats.GGUF_BLOCK, offsets=True)
        raise ValueError(f"--quantization gguf keeps a GGUF file's decoder linears in their blocks, which needs a "
                         f"GGUF file with decoder linears of the types "
                         f"{', '.join(w4_formats.GGUF_KEPT)}; this model has none (another format, or a "
                         f"GGUF file whose linears are all of other types, dequantized on load); allowed: "
                         f"{', '.join(allowed_quantizations(None))}")
    if checkpoint is None and quantization in W4_METHODS:
        if dummy:
            return W4OnLoad(f"--quantization {quantization}", W4_ON_LOAD_GROUP_SIZE)
        raise ValueError(f"--quantization {quantization} runs checkpoints quantized by {quantization}, but this one "
                         f"has high-precision weights (no quantization_config; or a GGUF file, dequantized on load), "
                         f"and nothing here rounds weights to 4 bits on load; allowed: "
                         f"{', '.join(allowed_quantizations(None))} (fp8: quantized on load)")
    if checkpoint is None:
        return ON_LOAD[quantization]() if quantization in ON_LOAD else LinearMethod()
    if quantization not in allowed_quantizations(checkpoint):
        raise ValueError(f"--quantization {quantization} does not fit this checkpoint, quantized by "
                         f"{checkpoint.quant_method} ({checkpoint.method}) as its quantization_config says; "
                         f"allowed: {', '.join(allowed_quantizations(checkpoint))}")
    if checkpoint.quant_method == "gguf":       # (random weights of a GGUF's shape: high precision, as ever)
        if quantization in ON_LOAD:
            return ON_LOAD[quantization]()
        if dummy or not gguf_stays_quantized(quantization, device_type):
            return LinearMethod()
        return GgufCheckpoint(checkpoint)
    if dummy:       # random weights are drawn in high precision: rounded on load as the checkpoint's are
        if checkpoint.method == "fp8":
            return Fp8GroupedOnLoad(checkpoint.weight_block_size) if checkpoint.weight_block_size else Fp8OnLoad()
        return W4OnLoad(f"--load-format dummy with a {checkpoint.quant_method} config", checkpoint.group_size)
    if checkpoint.method == "w4a16":
        return W4_CHECKPOINTS[checkpoint.quant_method](checkpoint)
    if checkpoint.quant_method == "compressed-tensors":
        return Fp8Checkpoint()
    return Fp8BlockCheckpoint(checkpoint.weight_block_size)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError, before any rank starts, when `size` ranks cannot split the
    checkpoint's grouped layers (4-bit ones, and block-scaled fp8 in groups of a block's
    inputs). Column-parallel layers split out_features, which both layouts keep unpacked; a
    row-parallel layer (o_proj, down_proj) gives each rank a range of its in_features, which
    must be whole groups (whole words of 8 with one group per row), and act-order groups are
    scattered over all of them."""
    quant = cfg.quantization
    if size == 1 or quant is None or (quant.group_size is None and quant.weight_block_size is None):
        return
    if quant.act_order:
        raise ValueError(f"tensor_parallel_size={size} cannot split this act-order 4-bit checkpoint "
                         f"({quant.quant_method}, desc_act / actorder group): each rank takes a contiguous range of "
                         f"o_proj's and down_proj's input features, but each act-order group is scattered over "
                         f"all of them; allowed: tensor_parallel_size=1, or a checkpoint without act-order")
    if (problem := _row_split_problem(cfg, size)) is not None:
        fitting = [n for n in range(1, cfg.num_heads + 1)
                   if _splits_heads(cfg, n) and _row_split_problem(cfg, n) is None]
        raise ValueError(f"tensor_parallel_size={size} {problem}; allowed for this checkpoint: "
                         f"tensor_parallel_size {', '.join(map(str, fitting))}")


def _row_split_problem(cfg: ModelConfig, size: int) -> str | None:
    """What keeps `size` ranks from taking whole groups of the row-parallel layers' inputs
    (one rank takes them whole, a short last group too)."""
    if size == 1:
        return None
    quant = cfg.quantization
    group_size = quant.weight_block_size[1] if quant.weight_block_size else quant.group_size
    unit = PACK if group_size == -1 else group_size
    for rank in range(size):
        shard = Shard(rank, size)
        heads = split_heads(cfg.num_heads, cfg.num_kv_heads, shard)
        for name, (start, length) in (("o_proj", (heads.q_start * cfg.head_dim, heads.num_heads * cfg.head_dim)),
                                      ("down_proj", shard.split(cfg.intermediate_size))):
            if start % unit or length % unit:
                what = ("words of 8 packed features" if group_size == -1
                        else f"blocks of {unit} inputs (weight_block_size)" if quant.weight_block_size
                        else f"groups of {unit} (the group size)")
                return (f"gives rank {rank} the input features {start}..{start + length - 1} of {name}, "
                        f"which do not start and end on boundaries of {what}")
    return None


def _splits_heads(cfg: ModelConfig, size: int) -> bool:
    try:
        check_splittable(cfg.num_heads, cfg.num_kv_heads, size)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- config.json's quantization_config

def checkpoint_quantization(config: dict, model: ModelConfig) -> CheckpointQuantization | None:
    """Checks a config.json `quantization_config` against the model it quantizes; ValueError
    names what is not supported and what is. None: the decoder linears are not quantized (a
    compressed-tensors config with a KV-cache scheme only)."""
    method = _object(config, "quantization_config").get("quant_method")
    if method == "compressed-tensors":
        if config.get("kv_cache_scheme"):
            _check_kv_cache_scheme(_object(config["kv_cache_scheme"], "quantization_config.kv_cache_scheme"))
            if not config.get("config_groups"):
                return None
        return _compressed_tensors(config, model)
    if method == "fp8":
        block = config.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config (quant_method fp8) has weight_block_size {block!r}: "
                             f"two block sides are needed, such as [128, 128]")
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config (quant_method fp8) has fmt {config['fmt']!r}: only e4m3 is supported")
        return CheckpointQuantization(method="fp8", quant_method=method, weight_block_size=tuple(block))
    if method == "gptq":
        return _check_w4_groups(_gptq(config), model)
    if method == "awq":
        return _check_w4_groups(_awq(config, model), model)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: "
                     f"{'; '.join(SUPPORTED_CHECKPOINTS)})")


# KV-cache scale layouts a compressed-tensors kv_cache_scheme may give (its `strategy`): one
# scale per layer for K and one for V, or one per KV head.
KV_SCALE_STRATEGIES = ("tensor", "attn_head")


def _check_kv_cache_scheme(scheme: dict) -> None:
    """A compressed-tensors kv_cache_scheme is served with --kv-cache-dtype fp8, its
    k_scale/v_scale read with the weights: FP8 (8-bit float), symmetric, static scales."""
    where = "quantization_config (compressed-tensors) kv_cache_scheme"
    wanted = {"num_bits": 8, "type": "float", "symmetric": True}
    for key, value in wanted.items():
        if scheme.get(key, value) != value:
            raise ValueError(f"{where} has {key} {scheme.get(key)!r}: only FP8 e4m3 KV caches are supported "
                             f"(num_bits 8, type float, symmetric)")
    if scheme.get("dynamic"):
        raise ValueError(f"{where} asks for dynamic scales: only static ones (k_scale, v_scale) are supported")
    if scheme.get("strategy", "tensor") not in KV_SCALE_STRATEGIES:
        raise ValueError(f"{where} has strategy {scheme.get('strategy')!r}: allowed are "
                         f"{', '.join(KV_SCALE_STRATEGIES)}")


def _gptq(config: dict) -> CheckpointQuantization:
    where = "quantization_config (quant_method gptq)"
    _check_bits(where, config.get("bits"))
    # transformers' GPTQConfig writes checkpoint_format; GPTQModel's own config says format.
    checkpoint_format = config.get("checkpoint_format", config.get("format", "gptq"))
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where} has checkpoint_format {checkpoint_format!r}: allowed are gptq (v1, zero points "
                         f"stored minus one) and gptq_v2")
    if (pack_dtype := config.get("pack_dtype", "int32")) != "int32":
        raise ValueError(f"{where} has pack_dtype {pack_dtype!r}: only int32 words (eight 4-bit values each) "
                         f"are supported")
    if config.get("lm_head"):
        raise ValueError(f"{where} quantizes lm_head (lm_head: true): only the decoder linears can be 4-bit")
    if config.get("dynamic"):
        raise ValueError(f"{where} sets some modules apart (dynamic): one setting for every decoder linear "
                         f"is supported")
    blocks = config.get("modules_in_block_to_quantize") or [DECODER_LINEARS]      # None: all of them
    if unquantized := sorted(set(DECODER_LINEARS) - {name for block in blocks for name in block}):
        raise ValueError(f"{where} leaves decoder linears unquantized ({unquantized[:3]}, by "
                         f"modules_in_block_to_quantize): a model of 4-bit and high-precision decoder "
                         f"linears is not supported")
    return CheckpointQuantization(method="w4a16", quant_method="gptq", group_size=config.get("group_size", 128),
                                  act_order=bool(config.get("desc_act", False)),
                                  symmetric=bool(config.get("sym", True)), checkpoint_format=checkpoint_format)


def _awq(config: dict, model: ModelConfig) -> CheckpointQuantization:
    where = "quantization_config (quant_method awq)"
    _check_bits(where, config.get("bits", config.get("w_bit")))     # transformers' name, AutoAWQ's
    version = config.get("version", "gemm")
    if str(version).lower() != "gemm":
        raise ValueError(f"{where} has version {version!r}: only gemm is supported (gemv, gemv_fast, exllama, "
                         f"ipex and marlin pack their words differently)")
    skipped = config.get("modules_to_not_convert") or []
    decoder = [f"model.layers.{i}.{linear}" for i in range(model.num_layers) for linear in DECODER_LINEARS]
    if unquantized := [name for name in decoder if any(skip in name for skip in skipped)]:
        raise ValueError(f"{where} leaves decoder linears unquantized ({unquantized[:3]}, by modules_to_not_convert): "
                         f"a model of 4-bit and high-precision decoder linears is not supported")
    return CheckpointQuantization(method="w4a16", quant_method="awq",
                                  group_size=config.get("group_size", config.get("q_group_size", 128)),
                                  symmetric=not config.get("zero_point", True))


def _check_bits(where: str, bits) -> None:
    if bits != 4:
        raise ValueError(f"{where} has bits {bits!r}: only 4-bit weights are supported (allowed: bits 4)")


def _check_w4_groups(quant: CheckpointQuantization, model: ModelConfig) -> CheckpointQuantization:
    """Refuses a group size the W4A16 GEMM cannot take on this model's layers."""
    inputs = {"hidden_size (q/k/v, gate/up)": model.hidden_size,
              "attention width (o_proj)": model.num_heads * model.head_dim,
              "intermediate_size (down_proj)": model.intermediate_size}

    def fits(size: int) -> bool:
        return all(k % size == 0 for k in inputs.values())

    group_size = quant.group_size
    if (group_size == -1 and fits(PACK)) or (isinstance(group_size, int) and group_size > 0
                                             and group_size % W4_GROUP_MULTIPLE == 0 and fits(group_size)):
        return quant
    allowed = ([-1] if fits(PACK) else []) + [g for g in (32, 64, 128, 256) if fits(g)]
    raise ValueError(f"quantization_config ({quant.quant_method}) has group_size {group_size!r}, which the W4A16 GEMM "
                     f"cannot take on this model: a group size must be -1 (one group per row) or a multiple of "
                     f"{W4_GROUP_MULTIPLE} that divides the input features of every decoder linear ("
                     f"{', '.join(f'{k} in {name}' for name, k in inputs.items())}); allowed here: "
                     f"{', '.join(map(str, allowed)) or 'none'}")


def _compressed_tensors(config: dict, model: ModelConfig) -> CheckpointQuantization:
    """A compressed-tensors config this loader can read as it is: FP8 weights (per channel or
    per tensor, `float-quantized`) or 4-bit integer weights (`pack-quantized`), one scheme on
    every decoder linear and on nothing else."""
    where = "quantization_config (compressed-tensors)"
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms")):
        if config.get(key):
            raise ValueError(f"{where} asks for {what} ({key}), which is not supported")
    groups = _object(config.get("config_groups") or {}, f"{where} config_groups")
    for group_name, group in groups.items():
        _object(group, f"{where} group {group_name!r}")
        for key in ("weights", "input_activations", "output_activations"):
            if group.get(key) is not None:
                _object(group[key], f"{where} group {group_name!r} {key}")
        _strings(group.get("targets") or [], f"{where} group {group_name!r} targets")
    formats = {group.get("format") or config.get("format") for group in groups.values()} or {config.get("format")}
    if formats == {"float-quantized"}:
        quant = _compressed_tensors_fp8(where, groups)
    elif formats == {"pack-quantized"}:
        quant = _check_w4_groups(_compressed_tensors_w4(where, groups), model)
    else:
        raise ValueError(f"{where} has format {', '.join(sorted(map(repr, formats)))}: supported are float-quantized "
                         f"(FP8) and pack-quantized (4-bit integers), one of them for every decoder linear")
    ignore = _strings(config.get("ignore") or [], f"{where} ignore")

    def quantized(name: str) -> bool:
        return any(_matches(name, g.get("targets") or []) for g in groups.values()) and not _matches(name, ignore)

    decoder = [f"model.layers.{i}.{linear}" for i in range(model.num_layers) for linear in DECODER_LINEARS]
    if unquantized := [n for n in decoder if not quantized(n)]:
        raise ValueError(f"{where} leaves decoder linears unquantized ({unquantized[:3]}): a model of "
                         f"quantized and high-precision decoder layers is not supported")
    if quantized("lm_head"):
        raise ValueError(f"{where} quantizes lm_head: only the decoder linears can be quantized "
                         f"(put lm_head in ignore)")
    return quant


def _compressed_tensors_fp8(where: str, groups: dict) -> CheckpointQuantization:
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
    return CheckpointQuantization(method="fp8", quant_method="compressed-tensors")


# The settings of a pack-quantized group's weights that must agree over the groups: the model
# packs q/k/v and gate/up into one layer each.
_W4_SETTINGS = ("num_bits", "type", "strategy", "group_size", "symmetric", "actorder")


def _compressed_tensors_w4(where: str, groups: dict) -> CheckpointQuantization:
    first = None
    for group_name, group in groups.items():
        weights = group.get("weights") or {}
        if not (weights.get("num_bits") == 4 and weights.get("type") == "int"
                and weights.get("strategy") in ("group", "channel") and not weights.get("dynamic")):
            raise ValueError(f"{where} group {group_name!r} has weights {weights}: supported are 4-bit integer "
                             f"weights per group or per channel (the W4A16 and W4A16_ASYM schemes)")
        if group.get("input_activations") is not None or group.get("output_activations") is not None:
            raise ValueError(f"{where} group {group_name!r} quantizes activations too: only weight-only 4-bit "
                             f"(W4A16) is supported with pack-quantized weights")
        settings = {key: weights.get(key) for key in _W4_SETTINGS}
        first = first or settings
        if settings != first:
            raise ValueError(f"{where} groups differ ({first} and {settings} in {group_name!r}): one setting for "
                             f"every decoder linear is supported")
    if first is None:
        raise ValueError(f"{where} has no config_groups: nothing says how the decoder linears are quantized")
    return CheckpointQuantization(
        method="w4a16", quant_method="compressed-tensors",
        group_size=first["group_size"] if first["strategy"] == "group" else -1,
        # "group" (alias "dynamic") stores weight_g_idx; "weight" (alias "static") only
        # changes the calibration order and stores the plain grouping.
        act_order=first["actorder"] in ("group", "dynamic"), symmetric=first["symmetric"] is not False)


def _object(value, where: str) -> dict:
    """`value` if it is a JSON object; else a ValueError naming `where`, not an AttributeError later."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__} {str(value)[:60]!r}")
    return value


def _strings(value, where: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{where} must be a list of module names or re: patterns, got {str(value)[:60]!r}")
    return value


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
    return source if isinstance(source, torch.Tensor) else source[...]     # [...]: 0-dim ones too

