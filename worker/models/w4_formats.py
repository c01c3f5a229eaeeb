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

* GGUF (ggml's `block_q4_0` and `block_q8_0`; llama.cpp `ggml/src/ggml-common.h`): each row
  of `W` (N rows of K) is K/32 blocks of 32 input features, a block being its float16 scale
  d (2 bytes, little-endian) then its values. Q4_0: 16 bytes, the low nibble of byte j
  holding feature j and the high nibble feature j + 16, `w = (q - 8) * d`: the canonical
  layout with group 32 and zero point 8. Q8_0: 32 signed bytes, `w = q * d`, which the
  canonical layout holds as two 4-bit weights (`from_gguf_q8_0`).

Activation order (an unsorted g_idx) becomes the canonical `perm`: the rows are sorted by
group, which needs every group to hold exactly `group_size` features (GPTQ and
llm-compressor form them so).
"""

import torch

from kernels.w4_weight import PACK, W4Weight, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]
GGUF_BLOCK = 32  # input features per GGUF Q4_0 / Q8_0 block


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """`int32 [R, C]` packed along columns, nibble j of word c = column 8c + j -> `[R, 8C]`."""
    return unpack_int4(packed.t()).t()


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
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
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
    k = qweight.shape[0]
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
    n, k = weight_packed.shape[0], weight_packed.shape[1] * PACK
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


def _gguf_blocks(blocks: torch.Tensor, value_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`uint8 [N, K / 32 * (2 + value_bytes)]` -> (scales float16 `[G, N]`, value bytes
    `uint8 [N, G, value_bytes]`)."""
    n, row_bytes = blocks.shape
    if row_bytes % (2 + value_bytes):
        raise ValueError(f"rows of {row_bytes} bytes are not whole blocks of {2 + value_bytes}")
    blocks = blocks.contiguous().view(n, row_bytes // (2 + value_bytes), 2 + value_bytes)
    scales = blocks[:, :, :2].contiguous().view(torch.float16).squeeze(-1)     # little-endian float16
    return scales.t(), blocks[:, :, 2:]


def from_gguf_q4_0(blocks: torch.Tensor) -> W4Weight:
    """A GGUF Q4_0 tensor's rows (`uint8 [N, K / 32 * 18]`; layout in the module docstring)."""
    scales, qs = _gguf_blocks(blocks, GGUF_BLOCK // 2)
    n, groups, _ = qs.shape
    values = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, groups * GGUF_BLOCK)    # [N, K]
    zeros = torch.full((groups, n), 8, dtype=torch.uint8, device=blocks.device)
    return W4Weight.from_values(values.t(), scales, zeros, GGUF_BLOCK)


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
