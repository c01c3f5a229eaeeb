"""W4A16: the canonical layout, the checkpoint formats read into it, the reference matmul,
and the Triton kernel against the reference (on CPU through Triton's interpreter, in a
subprocess, and on CUDA).

The checkpoint packers here are written from the layouts the formats document (see
`worker/models/w4_formats.py`), word by word with Python integers, so they share no code
with the readers under test; compressed-tensors' own library, where installed, packs and
dequantizes independently of both.
"""

import dataclasses
import importlib.util
import os

import pytest
import torch
from helpers import run_interpreter_tests

from kernels.w4_weight import W4Weight, dequantize_ref, pack_int4, unpack_int4
from kernels.w4a16 import w4a16_matmul, w4a16_matmul_ref
from worker.models.w4_formats import from_awq, from_compressed_tensors, from_gptq

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreter_only = pytest.mark.skipif(
    not INTERPRETING, reason="run by test_triton_interpreter in a TRITON_INTERPRET=1 subprocess")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# ------------------------------------------------------------------------ test data

def word(nibbles: list[int]) -> int:
    """Eight 4-bit values, the first in the least significant bits, as a signed int32."""
    value = sum(v << (4 * j) for j, v in enumerate(nibbles))
    return value - (1 << 32) if value >= 1 << 31 else value


def int32(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def random_layer(k: int, n: int, group_size: int, seed: int = 0, max_zero: int = 15) -> dict:
    """Integer values `q [K, N]` (checkpoint input order), zeros `[G, N]`, scales `[G, N]`.

    Scales are about 1 / (8 sqrt K), so that `x @ W.T` is of order 1 for unit activations.
    """
    g = torch.Generator().manual_seed(seed)
    groups = k // group_size
    return dict(q=torch.randint(0, 16, (k, n), generator=g),
                zeros=torch.randint(0, max_zero + 1, (groups, n), generator=g),
                scales=((torch.rand(groups, n, generator=g) + 0.5) / (8 * k ** 0.5)).half())


def weight_from(layer: dict, group_idx: torch.Tensor) -> torch.Tensor:
    """`W [N, K]` in float64 from the integers: W[n, k] = (q - z[g(k)]) * s[g(k)]."""
    z = layer["zeros"][group_idx].double()
    s = layer["scales"][group_idx].double()
    return ((layer["q"].double() - z) * s).t()


def act_order_g_idx(k: int, group_size: int, seed: int) -> torch.Tensor:
    """g_idx as GPTQ's desc_act makes it: groups of `group_size` in a random feature order."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


def gptq_checkpoint(layer: dict, v1: bool) -> dict:
    q, zeros = layer["q"].tolist(), layer["zeros"].tolist()
    k, n = len(q), len(q[0])
    stored_zeros = [[(z - 1) & 0xF if v1 else z for z in row] for row in zeros]
    return dict(
        qweight=int32([[word([q[8 * r + j][c] for j in range(8)]) for c in range(n)]
                       for r in range(k // 8)]),
        qzeros=int32([[word(row[8 * c:8 * c + 8]) for c in range(n // 8)]
                      for row in stored_zeros]),
        scales=layer["scales"])


def awq_checkpoint(layer: dict) -> dict:
    def pack(rows: list[list[int]]) -> torch.Tensor:
        return int32([[word([row[8 * c + AWQ_ORDER[i]] for i in range(8)])
                       for c in range(len(row) // 8)] for row in rows])
    return dict(qweight=pack(layer["q"].tolist()), qzeros=pack(layer["zeros"].tolist()),
                scales=layer["scales"])


def compressed_tensors_checkpoint(layer: dict, symmetric: bool) -> dict:
    """Unsigned q is the stored signed value plus 8: the nibbles are q itself."""
    qt = layer["q"].t().tolist()                                     # [N, K]
    n, k = len(qt), len(qt[0])
    tensors = dict(weight_packed=int32([[word(row[8 * c:8 * c + 8]) for c in range(k // 8)]
                                        for row in qt]),
                   weight_scale=layer["scales"].t().contiguous(),
                   weight_shape=torch.tensor([n, k]))
    if not symmetric:
        zt = layer["zeros"].t().tolist()                             # [N, G], packed along N
        tensors["weight_zero_point"] = int32(
            [[word([zt[8 * r + j][g] for j in range(8)]) for g in range(len(zt[0]))]
             for r in range(n // 8)])
    return tensors


# ------------------------------------------------------------- the canonical layout

def test_pack_int4_puts_row_8r_plus_j_in_nibble_j():
    values = torch.tensor([[1, 15], [2, 0], [3, 0], [4, 0], [5, 0], [6, 0], [7, 0], [8, 15]])
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed.tolist() == [[0x87654321 - (1 << 32), 0xF000000F - (1 << 32)]]


def test_unpack_int4_inverts_pack_int4():
    values = torch.randint(0, 16, (64, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int4(pack_int4(values)), values.to(torch.uint8))


def test_dequantize_ref_follows_the_documented_formula():
    """W[n, perm[i]] = (q[i, n] - z[i // g, n]) * s[i // g, n], checked element by element."""
    layer = random_layer(32, 8, 16, seed=2)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(3))
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], 16, perm)
    got = dequantize_ref(w, torch.float32)
    for i in range(32):
        for n in range(8):
            q, z, s = layer["q"][i, n], layer["zeros"][i // 16, n], layer["scales"][i // 16, n]
            want = (int(q) - int(z)) * float(s)
            assert got[n, int(perm[i])].item() == pytest.approx(want, rel=1e-6)


def offsets_for(layer: dict, seed: int) -> torch.Tensor:
    """Float offsets `[G, N]` of the size a GGUF Q4_1 minimum has (-16 s .. 0)."""
    g = torch.Generator().manual_seed(seed)
    return -16 * torch.rand(layer["scales"].shape, generator=g) * layer["scales"].float()


def test_dequantize_ref_adds_the_offset_of_each_weight_s_group():
    """W[n, i] = (q - z) * s + o[i // g, n]: the offsets are added after the scaling."""
    layer = random_layer(32, 8, 16, seed=2)
    offsets = offsets_for(layer, seed=4)
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], 16, offsets=offsets)
    plain = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], 16)
    want = dequantize_ref(plain, torch.float32) + offsets.repeat_interleave(16, 0).t()
    assert torch.equal(dequantize_ref(w, torch.float32), want)


def test_w4weight_refuses_offsets_of_another_shape_or_not_float():
    layer = random_layer(64, 8, 32)
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], 32)
    for offsets in (offsets_for(layer, 0)[:1], torch.zeros(2, 8, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"offsets float \[2, 8\]"):
            dataclasses.replace(w, offsets=offsets)


def test_w4weight_refuses_mismatched_shapes():
    layer = random_layer(64, 8, 32)
    with pytest.raises(ValueError, match="scales"):
        W4Weight.from_values(layer["q"], layer["scales"][:1], layer["zeros"], 32)


# ------------------------------------------------------------------------------- GPTQ

@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_reads_values_zeros_and_scales(checkpoint_format):
    layer = random_layer(128, 16, 32, seed=4, max_zero=15 if checkpoint_format == "gptq_v2" else 14)
    if checkpoint_format == "gptq":
        layer["zeros"] += 1  # v1 stores z - 1 in a nibble: it encodes z = 1..16
    ckpt = gptq_checkpoint(layer, v1=checkpoint_format == "gptq")
    w = from_gptq(**ckpt, group_size=32, checkpoint_format=checkpoint_format)
    assert (w.in_features, w.out_features, w.group_size, w.perm) == (128, 16, 32, None)
    assert torch.equal(unpack_int4(w.qweight), layer["q"].to(torch.uint8))
    assert torch.equal(w.zeros, layer["zeros"].to(torch.uint8))
    assert torch.equal(w.scales, layer["scales"])


def test_gptq_v1_stored_nibble_15_is_zero_point_16():
    layer = random_layer(64, 8, 32, seed=5)
    layer["zeros"][:] = 16
    w = from_gptq(**gptq_checkpoint(layer, v1=True), group_size=32)
    assert torch.equal(w.zeros, torch.full((2, 8), 16, dtype=torch.uint8))
    torch.testing.assert_close(dequantize_ref(w, torch.float64),
                               weight_from(layer, torch.arange(64) // 32), rtol=0, atol=0)


def test_gptq_desc_act_becomes_a_row_permutation():
    layer = random_layer(128, 16, 32, seed=6)
    g_idx = act_order_g_idx(128, 32, seed=7)
    w = from_gptq(**gptq_checkpoint(layer, v1=False), g_idx=g_idx, group_size=32,
                  checkpoint_format="gptq_v2")
    assert w.perm is not None and sorted(w.perm.tolist()) == list(range(128))
    torch.testing.assert_close(dequantize_ref(w, torch.float64),
                               weight_from(layer, g_idx.long()), rtol=0, atol=0)


def test_gptq_sorted_g_idx_needs_no_permutation():
    layer = random_layer(64, 8, 32)
    g_idx = (torch.arange(64) // 32).to(torch.int32)
    w = from_gptq(**gptq_checkpoint(layer, v1=False), g_idx=g_idx, group_size=32,
                  checkpoint_format="gptq_v2")
    assert w.perm is None


def test_gptq_g_idx_with_unequal_groups_is_refused():
    layer = random_layer(64, 8, 32)
    g_idx = torch.zeros(64, dtype=torch.int32)
    g_idx[40:] = 1  # 40 + 24 features
    with pytest.raises(ValueError, match="exactly 32"):
        from_gptq(**gptq_checkpoint(layer, v1=False), g_idx=g_idx, group_size=32,
                  checkpoint_format="gptq_v2")


def test_gptq_whole_row_group():
    layer = random_layer(64, 8, 64, seed=8, max_zero=14)
    layer["zeros"] += 1
    w = from_gptq(**gptq_checkpoint(layer, v1=True), group_size=-1)
    assert w.group_size == 64 and w.num_groups == 1
    torch.testing.assert_close(dequantize_ref(w, torch.float64),
                               weight_from(layer, torch.zeros(64, dtype=torch.long)),
                               rtol=0, atol=0)


# -------------------------------------------------------------------------------- AWQ

def test_awq_interleaved_columns_are_put_in_order():
    layer = random_layer(64, 24, 32, seed=9)
    w = from_awq(**awq_checkpoint(layer), group_size=32)
    assert torch.equal(unpack_int4(w.qweight), layer["q"].to(torch.uint8))
    assert torch.equal(w.zeros, layer["zeros"].to(torch.uint8))
    torch.testing.assert_close(dequantize_ref(w, torch.float64),
                               weight_from(layer, torch.arange(64) // 32), rtol=0, atol=0)


# -------------------------------------------------------------- compressed-tensors

@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-point"])
def test_compressed_tensors_reads_values_and_zero_points(symmetric):
    layer = random_layer(128, 24, 64, seed=10)
    if symmetric:
        layer["zeros"][:] = 8  # signed values -8..7 are q - 8
    w = from_compressed_tensors(**compressed_tensors_checkpoint(layer, symmetric), group_size=64)
    assert torch.equal(unpack_int4(w.qweight), layer["q"].to(torch.uint8))
    assert torch.equal(w.zeros, layer["zeros"].to(torch.uint8))
    torch.testing.assert_close(dequantize_ref(w, torch.float64),
                               weight_from(layer, torch.arange(128) // 64), rtol=0, atol=0)


def test_compressed_tensors_actorder_g_idx_becomes_a_row_permutation():
    layer = random_layer(128, 16, 32, seed=11)
    g_idx = act_order_g_idx(128, 32, seed=12)
    w = from_compressed_tensors(**compressed_tensors_checkpoint(layer, symmetric=False),
                                weight_g_idx=g_idx, group_size=32)
    assert w.perm is not None
    torch.testing.assert_close(dequantize_ref(w, torch.float64),
                               weight_from(layer, g_idx.long()), rtol=0, atol=0)


def test_compressed_tensors_channel_strategy_is_one_group():
    layer = random_layer(64, 8, 64, seed=13)
    w = from_compressed_tensors(**compressed_tensors_checkpoint(layer, symmetric=False),
                                group_size=None)
    assert w.num_groups == 1 and w.group_size == 64


def test_compressed_tensors_library_packing_reads_back():
    """The library's own packer (values -8..7, zero points packed along out_features)."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized")
    g = torch.Generator().manual_seed(14)
    signed = torch.randint(-8, 8, (24, 128), generator=g, dtype=torch.int8)        # [N, K]
    signed_zero = torch.randint(-8, 8, (24, 2), generator=g, dtype=torch.int8)     # [N, G]
    w = from_compressed_tensors(ct.pack_to_int32(signed, 4), torch.rand(24, 2).half(),
                                torch.tensor([24, 128]),
                                ct.pack_to_int32(signed_zero, 4, packed_dim=0), group_size=64)
    assert torch.equal(unpack_int4(w.qweight).t(), (signed + 8).to(torch.uint8))
    assert torch.equal(w.zeros.t(), (signed_zero + 8).to(torch.uint8))


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-point"])
def test_compressed_tensors_library_dequantizes_as_we_do(symmetric):
    """A dense weight compressed by the library, decompressed by it and read by us."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    n, k, group_size = 24, 128, 32
    g = torch.Generator().manual_seed(15)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size))
    dense = {"weight": torch.randn(n, k, generator=g).half(),
             "weight_scale": (torch.rand(n, k // group_size, generator=g) / 4 + 0.1).half()}
    if not symmetric:
        dense["weight_zero_point"] = torch.randint(-3, 4, (n, k // group_size), generator=g,
                                                   dtype=torch.int8)
    ckpt = PackedQuantizationCompressor.compress(dense, scheme)
    want = PackedQuantizationCompressor.decompress(ckpt, scheme)["weight"]
    w = from_compressed_tensors(ckpt["weight_packed"], ckpt["weight_scale"],
                                ckpt["weight_shape"], ckpt.get("weight_zero_point"),
                                group_size=group_size)
    assert torch.equal(dequantize_ref(w, want.dtype), want)


# ------------------------------------------------------------- the reference matmul

REF_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
           torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_ref_matmul_is_dequantize_then_matmul(dtype):
    """Against float64 from the integers; 16-bit types differ by their rounding of W and y."""
    layer = random_layer(256, 40, 64, seed=16)                   # q in input-feature order
    g_idx = act_order_g_idx(256, 64, seed=17)
    perm = torch.argsort(g_idx, stable=True)                        # packed row -> feature
    w = W4Weight.from_values(layer["q"][perm], layer["scales"], layer["zeros"], 64, perm)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(18)).to(dtype)
    want = x.double() @ weight_from(layer, g_idx.long()).t()
    torch.testing.assert_close(w4a16_matmul_ref(x, w).double(), want, **REF_TOL[dtype])


def test_matmul_on_cpu_is_the_reference_over_leading_dims():
    layer = random_layer(64, 16, 32, seed=19)
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], 32)
    x = torch.randn(2, 3, 64)
    out = w4a16_matmul(x, w)
    assert out.shape == (2, 3, 16)
    assert torch.equal(out, w4a16_matmul_ref(x.reshape(6, 64), w).reshape(2, 3, 16))


# ------------------------------------------ Triton through its interpreter (CPU)

@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter run")
def test_triton_interpreter():
    """Runs this file's interpreter_only tests on the CPU, through Triton's interpreter."""
    run_interpreter_tests(__file__)


# The interpreter gets bfloat16 wrong (see test_kernels.py): bfloat16 is left to the GPU.
# fp16: one or two units in the last place of outputs of order 1-4.
INTERP_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
# group size -> K: a multiple of the group; 200 leaves the last 128- or 64-wide tile ragged.
INTERP_K = {32: 224, 64: 320, 128: 384, -1: 200}
INTERP_N = 72  # one full 64-wide column tile and a ragged one


def interp_case(m: int, group: int, dtype: torch.dtype, act_order: bool = False,
                seed: int = 0) -> tuple[torch.Tensor, W4Weight]:
    k = INTERP_K[group]
    group_size = k if group == -1 else group
    layer = random_layer(k, INTERP_N, group_size, seed=seed)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else None
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], group_size, perm)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x, w


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("group", [32, 64, 128, -1], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("m", [1, 3, 64, 130])
def test_interp_matmul_matches_ref(m, group, dtype):
    from kernels.triton_w4a16 import w4a16_matmul_triton

    x, w = interp_case(m, group, dtype)
    torch.testing.assert_close(w4a16_matmul_triton(x, w), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("group", [32, -1], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("m", [1, 3, 130])
def test_interp_matmul_adds_offsets(m, group, dtype):
    """Both modes (one row: fma), with ragged K and N tiles."""
    from kernels.triton_w4a16 import w4a16_matmul_triton

    x, w = interp_case(m, group, dtype, seed=13)
    w = dataclasses.replace(w, offsets=offsets_for({"scales": w.scales}, seed=14))
    torch.testing.assert_close(w4a16_matmul_triton(x, w), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_interp_split_k_adds_each_split_s_offsets(mode):
    from kernels.triton_split_k import TileConfig
    from kernels.triton_w4a16 import w4a16_matmul_triton

    x, w = interp_case(3 if mode == "dot" else 1, 32, torch.float32, seed=15)
    w = dataclasses.replace(w, offsets=offsets_for({"scales": w.scales}, seed=16))
    config = TileConfig(block_m=16 if mode == "dot" else 1, block_n=32, block_k=32,
                        split_k=3, mode=mode)
    torch.testing.assert_close(w4a16_matmul_triton(x, w, config), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_interp_tiles_of_several_groups_split_along_k(mode):
    """Groups of 16 and 32 in 128-row tiles (one row of scales per group), K split, with
    offsets and act-order; K = 224 leaves the last tile ragged."""
    from kernels.triton_split_k import TileConfig
    from kernels.triton_w4a16 import pick_config, tile_groups, w4a16_matmul_triton

    for group in (16, 32):
        layer = random_layer(224, INTERP_N, group, seed=group)
        perm = torch.randperm(224, generator=torch.Generator().manual_seed(group))
        w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], group, perm,
                                 offsets=offsets_for(layer, seed=group + 1))
        m = 3 if mode == "dot" else 1       # by default only the dot takes tiles of several groups
        assert pick_config(m, w, torch.float16, torch.device("cpu")).block_k == (128 if mode == "dot" else group)
        config = TileConfig(block_m=16 if mode == "dot" else 1, block_n=32, block_k=128,
                            split_k=2, mode=mode)
        assert tile_groups(w, config.block_k) == 128 // group
        x = torch.randn(m, 224, generator=torch.Generator().manual_seed(3)).half()
        torch.testing.assert_close(w4a16_matmul_triton(x, w, config), w4a16_matmul_ref(x, w),
                                   **INTERP_TOL[torch.float16])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("group", [16, 32, 128, -1], ids=lambda g: f"g{g}")
def test_interp_dequantize_writes_the_reference_weight_in_packed_row_order(group, dtype):
    """Past 64 rows the matmul multiplies this dequantized weight: the reference's values,
    rounded to the activations' dtype once, rows left in packed order (act-order is undone by
    gathering x); groups below the 64-row tile, offsets, ragged K and N."""
    from kernels.triton_w4a16 import w4_dequantize_triton

    k = INTERP_K.get(group, 224)
    group_size = k if group == -1 else group
    layer = random_layer(k, INTERP_N, group_size, seed=group + 40)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(group + 41))
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], group_size, perm,
                             offsets=offsets_for(layer, seed=group + 42))
    want = dequantize_ref(dataclasses.replace(w, perm=None), dtype).t()
    got = w4_dequantize_triton(w, dtype)
    assert got.dtype == dtype and got.shape == (k, INTERP_N)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6 if dtype == torch.float32 else 1e-3)


@interpreter_only
@pytest.mark.parametrize("group", [32, -1], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("m", [1, 130])
def test_interp_act_order_gathers_activations(m, group):
    from kernels.triton_w4a16 import w4a16_matmul_triton

    x, w = interp_case(m, group, torch.float32, act_order=True, seed=3)
    torch.testing.assert_close(w4a16_matmul_triton(x, w), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("mode", ["dot", "fma"])
@pytest.mark.parametrize("split_k", [2, 3, 7])  # 7 tiles of 32: 4 + 3, 3 + 3 + 1, 1 each
def test_interp_split_k_sums_partials(split_k, mode):
    """Both modes (fma: one row), act-order, K split unevenly."""
    from kernels.triton_split_k import TileConfig
    from kernels.triton_w4a16 import w4a16_matmul_triton

    x, w = interp_case(3 if mode == "dot" else 1, 32, torch.float16, act_order=True, seed=5)
    config = TileConfig(block_m=16 if mode == "dot" else 1, block_n=32, block_k=32,
                         split_k=split_k, mode=mode)
    torch.testing.assert_close(w4a16_matmul_triton(x, w, config), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[torch.float16])


@interpreter_only
def test_interp_split_k_leaves_the_counters_at_zero_for_the_next_call():
    """The last program of each output tile adds the partials and resets its counter: a
    second call on the same counters gives the same result, bit for bit."""
    from kernels.triton_split_k import TileConfig, split_k_counters
    from kernels.triton_w4a16 import w4a16_matmul_triton

    x, w = interp_case(5, 32, torch.float32, seed=11)
    config = TileConfig(block_m=16, block_n=32, block_k=32, split_k=3)
    first = w4a16_matmul_triton(x, w, config)
    assert not split_k_counters(x.device, 1).any()
    assert torch.equal(w4a16_matmul_triton(x, w, config), first)
    torch.testing.assert_close(first, w4a16_matmul_ref(x, w), **INTERP_TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("m", [17, 40])
def test_interp_mid_batch_tiles_with_split_k(m):
    """The 17..64-row class: 64-row tiles, K split (8 SMs assumed on CPU)."""
    from kernels.triton_w4a16 import pick_config, w4a16_matmul_triton

    layer = random_layer(1024, INTERP_N, 128, seed=m)
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], 128)
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).half()
    assert pick_config(m, w, x.dtype, x.device).split_k > 1
    torch.testing.assert_close(w4a16_matmul_triton(x, w), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[torch.float16])


@interpreter_only
def test_interp_decode_splits_k_by_default():
    """A decode over few column tiles gets K split by `pick_config` (8 SMs assumed on CPU)."""
    from kernels.triton_w4a16 import pick_config, w4a16_matmul_triton

    layer = random_layer(1024, INTERP_N, 128, seed=9)
    w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], 128)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(10))
    assert pick_config(2, w, x.dtype, x.device).split_k > 1
    torch.testing.assert_close(w4a16_matmul_triton(x, w), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[torch.float32])


@interpreter_only
def test_interp_reads_strided_activations_and_empty_batches():
    """x as a column slice of a wider tensor, with leading dimensions; and M = 0."""
    from kernels.triton_w4a16 import w4a16_matmul_triton

    x, w = interp_case(6, 64, torch.float32, seed=7)
    wide = torch.cat([x, torch.randn(6, 16)], dim=1).view(2, 3, -1)[..., :x.shape[1]]
    got = w4a16_matmul_triton(wide, w)
    assert got.shape == (2, 3, INTERP_N)
    torch.testing.assert_close(got.reshape(6, -1), w4a16_matmul_ref(x, w),
                               **INTERP_TOL[torch.float32])
    assert w4a16_matmul_triton(x[:0], w).shape == (0, INTERP_N)


# ------------------------------------------------------------------ Triton on CUDA

GPU_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
           torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_w4a16_matmul(dtype):
    """Decode and prefill batch sizes on Llama-like widths: groups of 128 (sorted and in
    act-order), 32 and one group; K = 4032 leaves the last tile of one group ragged."""
    for k, n, group_size, act_order in [(4096, 1536, 128, False), (4096, 1536, 128, True),
                                        (2048, 1024, 32, False), (4032, 1000, 4032, False)]:
        layer = random_layer(k, n, group_size, seed=k + n)
        layer["scales"] = layer["scales"].to(torch.bfloat16 if dtype == torch.bfloat16
                                             else torch.float16)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(n)) if act_order else None
        w = W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"], group_size,
                                 perm).to("cuda")
        for m in [1, 5, 16, 17, 100, 512]:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
            where = f"{k=} {n=} {group_size=} {act_order=} {m=}"
            torch.testing.assert_close(w4a16_matmul(x, w), w4a16_matmul_ref(x, w),
                                       **GPU_TOL[dtype], msg=lambda s, where=where: f"{where}: {s}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_w4a16_matmul_adds_offsets(dtype):
    """The GGUF Q4_1 / Q4_K shape of weight (groups of 32, float offsets) at decode and
    prefill batch sizes; K = 2080 leaves the last 64-wide tile ragged."""
    for k, n in [(4096, 1536), (2080, 1000)]:
        layer = random_layer(k, n, 32, seed=k + n, max_zero=0)
        w = W4Weight.from_values(layer["q"], layer["scales"].float(), layer["zeros"], 32,
                                 offsets=offsets_for(layer, seed=n)).to("cuda")
        for m in [1, 5, 16, 17, 100, 512]:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
            where = f"{k=} {n=} {m=}"
            torch.testing.assert_close(w4a16_matmul(x, w), w4a16_matmul_ref(x, w),
                                       **GPU_TOL[dtype], msg=lambda s, where=where: f"{where}: {s}")


@pytest.mark.gpu
def test_gpu_w4a16_decode_replays_in_a_cuda_graph(monkeypatch):
    """Split-K decodes captured with no counters made yet, then with the shared ones; each
    replay on new inputs equal to the eager result (the partials are added in fixed order)."""
    from kernels import triton_split_k

    shapes = [(4096, 6144), (4096, 4096), (14336, 4096)]
    weights = []
    for k, n in shapes:
        layer = random_layer(k, n, 128, seed=k + n)
        layer["scales"] = layer["scales"].to(torch.bfloat16)
        weights.append(W4Weight.from_values(layer["q"], layer["scales"], layer["zeros"],
                                            128).to("cuda"))
    for m in (1, 16):
        xs = [torch.zeros(m, k, dtype=torch.bfloat16, device="cuda") for k, _ in shapes]

        def step():
            return [w4a16_matmul(x, w) for x, w in zip(xs, weights)]

        step()                                                  # compiles
        monkeypatch.setattr(triton_split_k, "_counter_cache", {})
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = step()
            for seed in (1, 2):
                for x in xs:
                    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
                graph.replay()
                for got, want, x, w in zip(outs, step(), xs, weights):
                    assert torch.equal(got, want)
                    torch.testing.assert_close(got, w4a16_matmul_ref(x, w), **GPU_TOL[torch.bfloat16])
            step()
