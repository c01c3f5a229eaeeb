"""The 4-bit weight of weight-only quantized matmuls (W4A16): its in-memory layout, packing and
exact dequantization (the matmuls: `kernels.w4a16`).

A `W4Weight` stands for the weight `W [N, K]` of a linear layer (`N` out_features, `K`
in_features; `y = x @ W.T`) as 4-bit integers with one scale and one zero point per group
of `group_size` consecutive input rows and per output column. Every checkpoint format is
repacked into this one layout on load (`worker/models/w4_formats.py`):

    qweight  int32 [K // 8, N]   bits 4j..4j+3 of qweight[r, n] (j = 0..7, least significant
                                 first) hold q[8r + j, n], the unsigned 4-bit value 0..15 of
                                 packed row 8r + j (the words are two's complement: a 15 in
                                 the top nibble makes them negative)
    scales   [G, N]              float16, bfloat16 or float32; G = K // group_size
    zeros    uint8 [G, N]        the integer zero point z of each group, unpacked: 0..15,
                                 or 16, which GPTQ v1 checkpoints can encode
    perm     int32 [K] or None   packed row i multiplies input feature perm[i]; None is the
                                 identity
    offsets  [G, N] or None      float (any float dtype, like scales): a float added to each
                                 weight of the group, for formats whose groups are
                                 `scale * q + min` (GGUF Q4_1 and Q4_K); None is 0

    W[n, perm[i]] = (q[i, n] - z[g, n]) * scales[g, n] + offsets[g, n],   g = i // group_size

`group_size` is K for a single group (the checkpoints' -1).

Why this layout:

* Packed along K, as GPTQ's `qweight`: a K-tile of the GEMM reads whole 32-bit words,
  coalesced along N; GPTQ checkpoints (the most common) need no repacking and
  compressed-tensors' `pack-quantized` is one transpose.
* Zero points unpacked: N bytes per group against `group_size * N / 2` bytes of weights
  (1.6 % at group 128), one load per tile, and room for GPTQ v1's 16. Not pre-scaled, so
  `q - z` stays an exact small integer: the kernel multiplies by the scale after the tile's
  dot product, and the reference has one rounding per weight.
* Offsets apart from zero points: a float minimum (GGUF's `d * q + m`) is no integer zero
  point, and folding it into one (`z = -m / d`) would make `q - z` inexact in 16-bit
  activations. The kernel adds `offset * sum(x)` over the group's inputs instead: one row
  sum per K-tile.
* Activation order (GPTQ `desc_act`, compressed-tensors `actorder`) is resolved on load: the
  rows are sorted by group, so every group is a contiguous run of `group_size` rows and a
  K-tile needs one row of scales and zeros; the kernel gathers the activation through
  `perm` as it loads it, so no extra pass over `x` is made.
"""

from dataclasses import dataclass, replace

import torch

PACK = 8  # 4-bit values per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class W4Weight:
    """A 4-bit grouped weight in the canonical layout of this module's docstring."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None
    offsets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k, n, g = self.in_features, self.out_features, self.group_size
        if k % PACK or g <= 0 or k % g:
            raise ValueError(f"in_features {k} must be a multiple of {PACK} and of the group "
                             f"size {g}")
        groups = k // g
        checks = [
            (self.qweight.dtype == torch.int32 and self.qweight.shape == (k // PACK, n),
             f"qweight int32 [{k // PACK}, {n}]", self.qweight),
            (self.scales.dtype.is_floating_point and self.scales.shape == (groups, n),
             f"scales float [{groups}, {n}]", self.scales),
            (self.zeros.dtype == torch.uint8 and self.zeros.shape == (groups, n),
             f"zeros uint8 [{groups}, {n}]", self.zeros),
        ]
        if self.perm is not None:
            checks.append((self.perm.dtype == torch.int32 and self.perm.shape == (k,),
                           f"perm int32 [{k}]", self.perm))
        if self.offsets is not None:
            checks.append((self.offsets.dtype.is_floating_point and self.offsets.shape == (groups, n),
                           f"offsets float [{groups}, {n}]", self.offsets))
        for ok, want, tensor in checks:
            if not ok or not tensor.is_contiguous():
                raise ValueError(f"W4Weight: want {want} contiguous, got {tensor.dtype} "
                                 f"{list(tensor.shape)} with strides {tensor.stride()}")

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    @classmethod
    def from_values(cls, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, perm: torch.Tensor | None = None,
                    offsets: torch.Tensor | None = None) -> "W4Weight":
        """From the unpacked values `q [K, N]` (0..15) of the packed rows."""
        k, n = values.shape
        return cls(pack_int4(values), scales.contiguous(), zeros.to(torch.uint8).contiguous(),
                   group_size, k, n, None if perm is None else perm.to(torch.int32).contiguous(),
                   None if offsets is None else offsets.contiguous())

    def to(self, device: torch.device | str) -> "W4Weight":
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                       zeros=self.zeros.to(device),
                       perm=None if self.perm is None else self.perm.to(device),
                       offsets=None if self.offsets is None else self.offsets.to(device))


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """`[K, N]` integers 0..15 -> `int32 [K // 8, N]`, row 8r + j in nibble j of row r."""
    k, n = values.shape
    if k % PACK:
        raise ValueError(f"cannot pack {k} rows into words of {PACK}")
    nibbles = values.to(torch.int64).contiguous().view(k // PACK, PACK, n)
    if nibbles.numel() and (nibbles.min() < 0 or nibbles.max() > 15):
        raise ValueError("4-bit values must lie in 0..15")
    words = (nibbles << _SHIFTS.to(values.device, torch.int64).view(1, PACK, 1)).sum(1)
    # Unsigned 32-bit words as int32: the ones at 2**31 and above wrap to negative.
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: `int32 [K // 8, N]` -> `uint8 [K, N]`."""
    rows, n = qweight.shape
    shifts = _SHIFTS.to(qweight.device).view(1, PACK, 1)
    # `>>` is arithmetic on int32; the mask drops the copied sign bits.
    nibbles = (qweight.unsqueeze(1) >> shifts) & 0xF
    return nibbles.reshape(rows * PACK, n).to(torch.uint8)


def dequantize_ref(w: W4Weight, dtype: torch.dtype) -> torch.Tensor:
    """`W [N, K]` in `dtype`, input features in their original order (`perm` undone).

    `(q - z) * scale + offset` is computed in float32 and rounded to `dtype` once.
    """
    q = unpack_int4(w.qweight).to(torch.float32)                        # [K, N]
    zeros = w.zeros.to(torch.float32).repeat_interleave(w.group_size, 0)
    scales = w.scales.to(torch.float32).repeat_interleave(w.group_size, 0)
    values = (q - zeros) * scales
    if w.offsets is not None:
        values += w.offsets.to(torch.float32).repeat_interleave(w.group_size, 0)
    packed_rows = values.to(dtype).t()                                    # [N, K], packed order
    if w.perm is None:
        return packed_rows.contiguous()
    weight = torch.empty_like(packed_rows)
    weight[:, w.perm.long()] = packed_rows
    return weight

