"""4-bit checkpoint formats -> `kernels.w4_weight.W4Weight` (the canonical layout).

One function per format reads the tensors of one linear layer as a checkpoint stores them
and returns the canonical weight; nothing here knows file names or configs. All of them
store `W [N, K]` (N out_features, K in_features) as unsigned 4-bit values q with an
integer zero point z and a scale s per group of `group_size` input features (the configs'
-1: one group) and output feature, `W = (q - z) * s`; they differ in how they pack:

* GPTQ (`quant_method: "gptq"`; AutoGPTQ `nn_modules/qlinear/qlinear_cuda_old.py`,
  `QuantLinear.pack`): `qweight int32 [K/8, N]` packed along K, nibble j of word r holding
  input row 8r + j (the canonical packing); `qzeros int32 [G, N/8]` packed along N, nibble
  j of word c holding column 8c + j; `scales [G, N]`; `g_idx int32 [K]`, the group of each
  input feature. `checkpoint_format: "gptq"` (v1) stores z - 1 in qzeros (AutoGPTQ's
  `zeros -= 1` before packing; its readers add the 1 back), `"gptq_v2"` (GPTQModel) stores
  z. With `desc_act` the groups are formed in activation order: `g_idx` is not sorted,
  and the rows of qweight stay in the checkpoint's input order.
* AWQ GEMM (`quant_method: "awq"`, `version: "gemm"`; AutoAWQ `awq/modules/linear/gemm.py`,
  `WQLinear_GEMM.from_linear`): `qweight int32 [K, N/8]` packed along N in the order
  [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of word c holds column 8c + order[i]); `qzeros int32
  [G, N/8]` packed the same way, storing z; `scales [G, N]`.
* compressed-tensors `pack-quantized` (`quant_method: "compressed-tensors"`; the library's
  `compressors/pack_quantized/`: `pack_to_int32`, `PackedQuantizationCompressor`):
  `weight_packed int32 [N, K/8]`, nibble j of word c holding input feature 8c + j, the
  signed value q - 8 stored as q; `weight_scale [N, G]`; `weight_shape` [N, K];
  `weight_zero_point` only when asymmetric, `int32 [ceil(N/8), G]` packed along N (the
  same sequential nibbles; the signed zero point stored + 8), else z = 8;
  `weight_g_idx [K]` with `actorder: "group"`, as GPTQ's g_idx.

* GGUF (ggml's `block_q4_0`, `block_q4_1`, `block_q8_0`, `block_q4_K`, `block_q6_K`;
  llama.cpp `ggml/src/ggml-common.h`, all little-endian): each row of `W` (N rows of K) is a
  run of blocks along K.
  - Q4_0: blocks of 32 features, a float16 scale d then 16 bytes, the low nibble of byte j
    holding feature j and the high nibble feature j + 16; `w = (q - 8) * d`: the canonical
    layout with group 32 and zero point 8.
  - Q4_1: blocks of 32, float16 d, float16 m, then Q4_0's 16 bytes; `w = d * q + m`: group
    32, zero point 0, the offset m.
  - Q8_0: blocks of 32, float16 d then 32 signed bytes; `w = q * d`, held as two 4-bit
    weights (`from_gguf_q8_0`).
  - Q4_K: super-blocks of 256 (144 bytes): float16 d, float16 dmin, 12 bytes of eight 6-bit
    scales sc and minimums mn, then 128 bytes of nibbles. Sub-block b (32 features) has
    `w = d * sc_b * q - dmin * mn_b`: group 32, the scale d * sc_b and the offset
    -dmin * mn_b (float32, each the exact product ggml's dequantizer forms). Features
    64c .. 64c + 31 are the low nibbles of bytes 32c .. 32c + 31, the next 32 their high
    nibbles. Scale bytes: for b < 4, sc_b = byte b & 63 and mn_b = byte b + 4 & 63; for
    b >= 4, sc_b = (byte b + 4 & 15) | (byte b - 4 >> 6) << 4 and mn_b = (byte b + 4 >> 4) |
    (byte b >> 6) << 4.
  - Q6_K: super-blocks of 256 (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2
    bits), 16 signed bytes of scales sc, float16 d. Sub-block b (16 features) has `w = d *
    sc_b * (q - 32)`, q 0..63: held as two 4-bit weights of group 16 (`from_gguf_q6_k`).
    In each half h of 128 features and for l < 32, with L = ql[64h:], H = qh[32h:]: feature
    l has the low nibble of L[l] and bits 0-1 of H[l], l + 32 the low nibble of L[l + 32] and
    bits 2-3, l + 64 the high nibble of L[l] and bits 4-5, l + 96 the high nibble of
    L[l + 32] and bits 6-7.

Activation order (an unsorted g_idx) becomes the canonical `perm`: the rows are sorted by
group, which needs every group to hold exactly `group_size` features (GPTQ and
llm-compressor form them so).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.w4_weight import PACK, W4Weight, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]
GGUF_BLOCK = 32  # input features per GGUF Q4_0 / Q4_1 / Q8_0 block, and per Q4_K sub-block
GGUF_SUPER_BLOCK = 256  # input features per GGUF K-quant super-block
Q6_K_GROUP = 16  # input features per Q6_K sub-block (one scale)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """`int32 [R, C]` packed along columns, nibble j of word c = column 8c + j -> `[R, 8C]`."""
    return unpack_int4(packed.t()).t()


def _packed(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor of packed 4-bit words: int32 (eight values a word), else a ValueError naming it."""
    if tensor.dtype != torch.int32:
        raise ValueError(f"{name} is {str(tensor.dtype).removeprefix('torch.')}, want int32 words of eight 4-bit values")
    return tensor


def _same_outputs(n: int, tensor: torch.Tensor, name: str, dim: int) -> None:
    if tensor.shape[dim] != n:
        raise ValueError(f"{name} has {tensor.shape[dim]} output features, the packed weight {n}")


def _group_size(config_group_size: int | None, in_features: int, num_groups: int) -> int:
    group_size = in_features if config_group_size in (None, -1) else config_group_size
    if group_size <= 0 or in_features % group_size or in_features // group_size != num_groups:
        raise ValueError(f"group size {config_group_size} does not fit {in_features} input "
                         f"features in {num_groups} groups")
    return group_size


def _sort_groups(values: torch.Tensor, g_idx: torch.Tensor | None,
                 group_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`values [K, N]` in checkpoint order -> (rows sorted by group, perm or None)."""
    if g_idx is None:
        return values, None
    k = values.shape[0]
    if g_idx.shape != (k,):
        raise ValueError(f"g_idx has shape {list(g_idx.shape)}, want [{k}] (one group per input feature)")
    g_idx = g_idx.to(torch.int64)
    grouped = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, grouped):
        return values, None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], grouped):
        raise ValueError(f"g_idx does not put exactly {group_size} input features in each "
                         "group")
    return values[perm], perm.to(torch.int32)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None = None, *, group_size: int | None,
              checkpoint_format: str = "gptq") -> W4Weight:
    """A 4-bit GPTQ layer (v1 `"gptq"` or `"gptq_v2"`; layout in the module docstring)."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}")
    k, n = _packed(qweight, "qweight").shape[0] * PACK, qweight.shape[1]
    _same_outputs(n, scales, "scales", 1)
    _packed(qzeros, "qzeros")
    group_size = _group_size(group_size, k, scales.shape[0])
    zeros = _unpack_columns(qzeros)[:, :n]  # whole words: drop the padding past N, if any
    if checkpoint_format == "gptq":
        # v1 stores z - 1: a nibble of 15 reads as 16, as every v1 reader has it.
        zeros = zeros + 1
    values, perm = _sort_groups(unpack_int4(qweight), g_idx, group_size)
    return W4Weight.from_values(values, scales, zeros, group_size, perm)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
             group_size: int | None) -> W4Weight:
    """A 4-bit AWQ GEMM layer (layout in the module docstring)."""
    k = _packed(qweight, "qweight").shape[0]
    _same_outputs(qweight.shape[1] * PACK, scales, "scales", 1)
    _packed(qzeros, "qzeros")
    group_size = _group_size(group_size, k, scales.shape[0])
    # Column c of each word's eight is in nibble AWQ_ORDER.index(c).
    inverse = torch.tensor([AWQ_ORDER.index(c) for c in range(PACK)], device=qweight.device)

    def columns(packed: torch.Tensor) -> torch.Tensor:
        by_nibble = _unpack_columns(packed)                        # [R, 8C], nibble order
        rows, width = by_nibble.shape
        return by_nibble.view(rows, width // PACK, PACK)[:, :, inverse].reshape(rows, width)

    return W4Weight.from_values(columns(qweight), scales, columns(qzeros), group_size)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_shape: torch.Tensor | None = None,
                            weight_zero_point: torch.Tensor | None = None,
                            weight_g_idx: torch.Tensor | None = None, *,
                            group_size: int | None) -> W4Weight:
    """A 4-bit compressed-tensors `pack-quantized` layer (layout in the module docstring).

    `group_size` None or -1 is the `channel` strategy: one group.
    """
    n, k = _packed(weight_packed, "weight_packed").shape[0], weight_packed.shape[1] * PACK
    _same_outputs(n, weight_scale, "weight_scale", 0)
    if weight_shape is not None and tuple(weight_shape.tolist()) != (n, k):
        # pack_to_int32 pads K to whole words; the kernels need K to be a multiple of 8.
        raise ValueError(f"weight_shape {weight_shape.tolist()} is not [{n}, {k}]")
    group_size = _group_size(group_size, k, weight_scale.shape[1])
    values = unpack_int4(weight_packed.t())                      # [K, N], q = signed + 8
    if weight_zero_point is None:
        zeros = torch.full((k // group_size, n), 8, dtype=torch.uint8, device=values.device)
    elif weight_zero_point.dtype == torch.int32:
        zeros = unpack_int4(weight_zero_point)[:n].t()             # [G, N], z = signed + 8
    else:
        raise ValueError(f"weight_zero_point is {weight_zero_point.dtype}, want packed int32")
    values, perm = _sort_groups(values, weight_g_idx, group_size)
    return W4Weight.from_values(values, weight_scale.t(), zeros, group_size, perm)


def _blocks(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """`uint8 [N, row bytes]` -> `uint8 [N, blocks per row, block_bytes]`."""
    n, row_bytes = blocks.shape
    if row_bytes % block_bytes:
        raise ValueError(f"rows of {row_bytes} bytes are not whole blocks of {block_bytes}")
    return blocks.contiguous().view(n, row_bytes // block_bytes, block_bytes)


def _float16(pair: torch.Tensor) -> torch.Tensor:
    """`uint8 [..., 2]` little-endian float16s -> float32 `[...]`."""
    return pair.contiguous().view(torch.float16).squeeze(-1).float()


def _gguf_blocks(blocks: torch.Tensor, value_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`uint8 [N, K / 32 * (2 + value_bytes)]` -> (scales float16 `[G, N]`, value bytes
    `uint8 [N, G, value_bytes]`)."""
    blocks = _blocks(blocks, 2 + value_bytes)
    return _float16(blocks[:, :, :2]).half().t(), blocks[:, :, 2:]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`uint8 [..., B]` -> `[..., 2B]`: the B low nibbles, then the B high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def from_gguf_q4_0(blocks: torch.Tensor) -> W4Weight:
    """A GGUF Q4_0 tensor's rows (`uint8 [N, K / 32 * 18]`; layout in the module docstring)."""
    scales, qs = _gguf_blocks(blocks, GGUF_BLOCK // 2)
    n, groups, _ = qs.shape
    values = _nibbles(qs).reshape(n, groups * GGUF_BLOCK)                             # [N, K]
    zeros = torch.full((groups, n), 8, dtype=torch.uint8, device=blocks.device)
    return W4Weight.from_values(values.t(), scales, zeros, GGUF_BLOCK)


def from_gguf_q4_1(blocks: torch.Tensor) -> W4Weight:
    """A GGUF Q4_1 tensor's rows (`uint8 [N, K / 32 * 20]`)."""
    blocks = _blocks(blocks, 4 + GGUF_BLOCK // 2)
    n, groups, _ = blocks.shape
    values = _nibbles(blocks[:, :, 4:]).reshape(n, groups * GGUF_BLOCK)
    zeros = torch.zeros((groups, n), dtype=torch.uint8, device=blocks.device)
    return W4Weight.from_values(values.t(), _float16(blocks[:, :, :2]).half().t(), zeros, GGUF_BLOCK,
                                offsets=_float16(blocks[:, :, 2:4]).half().t())


def _q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`uint8 [..., 12]` -> (sc, mn), each `[..., 8]` of 6-bit integers (module docstring)."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low & 63, (high & 15) | (low >> 6) << 4], dim=-1)
    mn = torch.cat([mid & 63, (high >> 4) | (mid >> 6) << 4], dim=-1)
    return sc, mn


def from_gguf_q4_k(blocks: torch.Tensor) -> W4Weight:
    """A GGUF Q4_K tensor's rows (`uint8 [N, K / 256 * 144]`)."""
    blocks = _blocks(blocks, 16 + GGUF_SUPER_BLOCK // 2)
    n, supers, _ = blocks.shape
    d, dmin = _float16(blocks[:, :, 0:2]), _float16(blocks[:, :, 2:4])               # [N, S]
    sc, mn = _q4_k_scales(blocks[:, :, 4:16])                                        # [N, S, 8]
    qs = blocks[:, :, 16:].reshape(n, supers, 4, GGUF_BLOCK)                          # 4 chunks of 64
    values = _nibbles(qs).reshape(n, supers * GGUF_SUPER_BLOCK)
    scales = (d[..., None] * sc.float()).reshape(n, -1)                               # [N, G]
    offsets = -(dmin[..., None] * mn.float()).reshape(n, -1)
    zeros = torch.zeros(scales.t().shape, dtype=torch.uint8, device=blocks.device)
    return W4Weight.from_values(values.t(), scales.t(), zeros, GGUF_BLOCK, offsets=offsets.t())


def from_gguf_q6_k(blocks: torch.Tensor) -> tuple[W4Weight, W4Weight]:
    """A GGUF Q6_K tensor's rows (`uint8 [N, K / 256 * 210]`) as two canonical weights of
    group 16 whose sum is it: with q = 16 h + l (h 0..3, l 0..15), `(q - 32) * s =
    (h - 2) * 16 s + l * s`, a high weight of values h, zero point 2 and scales 16 s (exact:
    a power of two), and a low one of values l, zero point 0 and scales s, where s = d * sc
    (float32, the exact product)."""
    half = GGUF_SUPER_BLOCK // 2
    blocks = _blocks(blocks, half + half // 2 + GGUF_SUPER_BLOCK // Q6_K_GROUP + 2)
    n, supers, _ = blocks.shape
    ql = blocks[:, :, :half].reshape(n, supers, 2, 2, 32)              # [.., half, L[:32] / L[32:], l]
    qh = blocks[:, :, half:half + half // 2].reshape(n, supers, 2, 1, 32)
    sc = blocks[:, :, half + half // 2:-2].contiguous().view(torch.int8)              # [N, S, 16]
    d = _float16(blocks[:, :, -2:])                                                   # [N, S]
    # Feature 32 j + l of a half (j = 0..3) takes nibble j // 2 of L[32 (j % 2) + l] and
    # bits 2j, 2j + 1 of H[l].
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)                                       # [.., 4, 32]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(4, 1)) & 3
    low, high = (v.reshape(n, supers * GGUF_SUPER_BLOCK).t() for v in (low, high))   # [K, N]
    scales = (d[..., None] * sc.float()).reshape(n, -1).t().contiguous()              # [G, N]
    twos = torch.full(scales.shape, 2, dtype=torch.uint8, device=blocks.device)
    return (W4Weight.from_values(high, scales * 16, twos, Q6_K_GROUP),
            W4Weight.from_values(low, scales, torch.zeros_like(twos), Q6_K_GROUP))


def from_gguf_q8_0(blocks: torch.Tensor) -> tuple[W4Weight, W4Weight]:
    """A GGUF Q8_0 tensor's rows (`uint8 [N, K / 32 * 34]`) as two canonical weights whose
    sum is it: each signed byte q is 16 h + l with l = q & 15 (0..15) and h = q >> 4
    (-8..7), so `q * d = (h + 8 - 8) * 16 d + (l - 0) * d`: a high weight of values h + 8,
    zero point 8 and scales 16 d (exact: a power of two), and a low one of values l, zero
    point 0 and scales d."""
    scales, qs = _gguf_blocks(blocks, GGUF_BLOCK)
    n, groups, _ = qs.shape
    q = qs.view(torch.int8).reshape(n, groups * GGUF_BLOCK).to(torch.int32)           # [N, K]
    full = torch.full((groups, n), 8, dtype=torch.uint8, device=blocks.device)
    high = W4Weight.from_values((q >> 4).t() + 8, scales * 16, full, GGUF_BLOCK)
    low = W4Weight.from_values((q & 0xF).t(), scales, torch.zeros_like(full), GGUF_BLOCK)
    return high, low


@dataclass(frozen=True)
class GgufKept:
    """A GGUF type whose decoder linears stay quantized: the reader of a tensor's rows into
    one canonical weight or a (high, low) pair summing to it, and what the layer holding
    them needs (`quantization.W4Linear` / `W4PairLinear`)."""
    read: Callable[[torch.Tensor], tuple[W4Weight, ...]]
    bits: int                   # of each stored weight value
    group_size: int
    scales_dtype: torch.dtype   # in which the scales (and offsets) are exact
    offsets: bool = False

    @property
    def pair(self) -> bool:
        return self.bits > 4


GGUF_KEPT = {
    "Q4_0": GgufKept(lambda rows: (from_gguf_q4_0(rows),), 4, GGUF_BLOCK, torch.float16),
    "Q4_1": GgufKept(lambda rows: (from_gguf_q4_1(rows),), 4, GGUF_BLOCK, torch.float16, offsets=True),
    "Q4_K": GgufKept(lambda rows: (from_gguf_q4_k(rows),), 4, GGUF_BLOCK, torch.float32, offsets=True),
    "Q6_K": GgufKept(from_gguf_q6_k, 6, Q6_K_GROUP, torch.float32),
    "Q8_0": GgufKept(from_gguf_q8_0, 8, GGUF_BLOCK, torch.float16),
}
