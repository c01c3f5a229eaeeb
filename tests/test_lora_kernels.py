"""Batched multi-LoRA: the reference shrink and expand against a naive per-token product
(CPU), the Triton kernels against the reference (on CPU through Triton's interpreter, in a
subprocess, and on CUDA)."""

import importlib.util
import os

import pytest
import torch
from helpers import run_interpreter_tests

from kernels.lora import (lora_expand, lora_expand_folded, lora_expand_folded_ref, lora_expand_ref,
                          lora_shrink, lora_shrink_ref)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
interpreter_only = pytest.mark.skipif(
    not INTERPRETING, reason="run by test_triton_interpreter in a TRITON_INTERPRET=1 subprocess")

# Output pieces (start, size): a plain linear, and q/k/v with GQA (k and v narrower than q).
ONE = [(0, 40)]
QKV = [(0, 32), (32, 8), (40, 8)]
# Mixed slots: every slot of three, and tokens without an adapter.
SLOTS = [0, -1, 2, 1, 1, -1, 0, 2, 2, 0]


# ------------------------------------------------------------------------- test data

def out_features(pieces: list[tuple[int, int]]) -> int:
    return max(start + size for start, size in pieces)


def random_adapters(num_slots: int, pieces: list[tuple[int, int]], in_features: int, rank: int,
                    dtype: torch.dtype = torch.float32, device: str = "cpu",
                    ranks: list[int] | None = None,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`a [S, P*R, in]`, `b [S, out, R]` in the layout of `kernels.lora`: slot s has rank
    `ranks[s]` (R by default), its A rows and B columns past that rank zero. Scaled so that
    shrunk values and deltas are of order 1 for unit inputs."""
    g = torch.Generator().manual_seed(seed)
    num_pieces = len(pieces)
    a = torch.randn(num_slots, num_pieces * rank, in_features, generator=g) / in_features ** 0.5
    b = torch.randn(num_slots, out_features(pieces), rank, generator=g) / rank ** 0.5
    for s, r in enumerate(ranks or []):
        b[s, :, r:] = 0
        for p in range(num_pieces):
            a[s, p * rank + r:(p + 1) * rank] = 0
    return a.to(dtype).to(device), b.to(dtype).to(device)


def pad_rank(a: torch.Tensor, b: torch.Tensor, num_pieces: int,
             rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same adapters zero-padded from their rank to `rank`."""
    num_slots, _, in_features = a.shape
    r = b.shape[2]
    a_pad = torch.zeros(num_slots, num_pieces * rank, in_features, dtype=a.dtype)
    for p in range(num_pieces):
        a_pad[:, p * rank:p * rank + r] = a[:, p * r:(p + 1) * r]
    b_pad = torch.zeros(num_slots, b.shape[1], rank, dtype=b.dtype)
    b_pad[..., :r] = b
    return a_pad, b_pad


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
          seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def naive_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int],
                pieces: list[tuple[int, int]], ranks: list[int]) -> torch.Tensor:
    """Token by token, in float64: its slot's dense weight update `B_p @ A_p` for each piece
    (the unpadded factors: the first `ranks[slot]` rows of A_p, columns of B_p) times x."""
    rank = b.shape[2]
    delta = torch.zeros(x.shape[0], out_features(pieces), dtype=torch.float64)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        r = ranks[s]
        for p, (start, size) in enumerate(pieces):
            a_p = a[s, p * rank:p * rank + r].double()         # [r, in]
            b_p = b[s, start:start + size, :r].double()        # [size, r]
            delta[t, start:start + size] = (b_p @ a_p) @ x[t].double()
    return delta


def folded_output(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`y_aug [T, out + S*P*R]`: what a base GEMM whose weight carries every slot's A below
    its own rows returns, `y` then each slot's shrink (in y's dtype, as the GEMM's)."""
    every_slot = x.float() @ a.reshape(-1, a.shape[2]).float().t()
    return torch.cat([y, every_slot.to(y.dtype)], dim=1)


# ------------------------------------------------------------------- the reference (CPU)

def test_reference_shrink_is_each_tokens_input_through_its_slots_a():
    a, _ = random_adapters(3, QKV, 48, 8)
    x = randn(len(SLOTS), 48)
    shrunk = lora_shrink_ref(x, a, torch.tensor(SLOTS))
    for t, s in enumerate(SLOTS):
        want = a[s].double() @ x[t].double() if s >= 0 else torch.zeros(3 * 8, dtype=torch.float64)
        torch.testing.assert_close(shrunk[t].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pieces", [ONE, QKV], ids=["P1", "P3-qkv"])
def test_reference_adds_each_tokens_dense_delta(pieces):
    a, b = random_adapters(3, pieces, 48, 8)
    x, y = randn(len(SLOTS), 48), randn(len(SLOTS), out_features(pieces), seed=2)
    slots = torch.tensor(SLOTS)
    got = lora_expand_ref(y.clone(), lora_shrink_ref(x, a, slots), b, slots, pieces)
    want = y.double() + naive_delta(x, a, b, SLOTS, pieces, ranks=[8, 8, 8])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pieces", [ONE, QKV], ids=["one", "qkv"])
def test_reference_folded_expand_takes_each_tokens_shrink_from_its_slots_columns(pieces):
    a, b = random_adapters(3, pieces, 48, 8)
    x, y = randn(len(SLOTS), 48), randn(len(SLOTS), out_features(pieces), seed=2)
    slots = torch.tensor(SLOTS)
    y_aug = folded_output(x, a, y)
    got = lora_expand_folded_ref(y_aug, y.shape[1], b, slots, pieces)
    want = lora_expand_ref(y.clone(), lora_shrink_ref(x, a, slots), b, slots, pieces)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(y_aug[:, :y.shape[1]], y), "the folded expand writes a new tensor"


def test_reference_leaves_tokens_without_adapter_untouched():
    a, b = random_adapters(3, QKV, 48, 8)
    x, y = randn(len(SLOTS), 48), randn(len(SLOTS), out_features(QKV), seed=2)
    slots = torch.tensor(SLOTS)
    shrunk = lora_shrink_ref(x, a, slots)
    got = lora_expand_ref(y.clone(), shrunk, b, slots, QKV)
    none = slots < 0
    assert not shrunk[none].any()
    assert torch.equal(got[none], y[none])


def test_reference_zero_padded_ranks_give_the_unpadded_product():
    """Adapters of rank 5 in slots of rank 16: the padding adds nothing."""
    a, b = random_adapters(3, QKV, 48, 5)
    a_pad, b_pad = pad_rank(a, b, len(QKV), 16)
    x, y = randn(len(SLOTS), 48), randn(len(SLOTS), out_features(QKV), seed=2)
    slots = torch.tensor(SLOTS)
    unpadded = lora_expand_ref(y.clone(), lora_shrink_ref(x, a, slots), b, slots, QKV)
    padded = lora_expand_ref(y.clone(), lora_shrink_ref(x, a_pad, slots), b_pad, slots, QKV)
    torch.testing.assert_close(padded, unpadded, atol=1e-6, rtol=1e-6)


def test_reference_mixed_ranks_match_the_naive_product():
    """Slots of ranks 3, 8 and 5 in one bank of rank 8, mixed in one batch."""
    ranks = [3, 8, 5]
    a, b = random_adapters(3, QKV, 48, 8, ranks=ranks)
    x, y = randn(len(SLOTS), 48), randn(len(SLOTS), out_features(QKV), seed=2)
    slots = torch.tensor(SLOTS)
    got = lora_expand_ref(y.clone(), lora_shrink_ref(x, a, slots), b, slots, QKV)
    want = y.double() + naive_delta(x, a, b, SLOTS, QKV, ranks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------- the kernels against the reference, any device

def assert_kernels_match_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                   y: torch.Tensor, slots: torch.Tensor,
                                   pieces: list[tuple[int, int]], shrink_tol: dict,
                                   expand_tol: dict, where: str = "") -> None:
    """Both kernels (through the public functions on CUDA) against the references; the
    expand on the reference's `shrunk`, so that each is judged on its own. Rows without an
    adapter come out bit for bit as they went in."""
    from kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    want_shrunk = lora_shrink_ref(x, a, slots)
    shrunk = lora_shrink(x, a, slots) if x.is_cuda else lora_shrink_triton(x, a, slots)
    torch.testing.assert_close(shrunk, want_shrunk, **shrink_tol, msg=lambda s: f"{where}: {s}")
    want = lora_expand_ref(y.clone(), want_shrunk, b, slots, pieces)
    got = y.clone()
    out = (lora_expand(got, want_shrunk, b, slots, pieces) if y.is_cuda
           else lora_expand_triton(got, want_shrunk, b, slots, pieces))
    assert out is got, "the expand adds into y in place"
    torch.testing.assert_close(got, want, **expand_tol, msg=lambda s: f"{where}: {s}")
    none = slots < 0
    assert torch.equal(got[none], y[none]), f"{where}: a token without adapter was changed"


def prefill_slots(num_tokens: int, num_slots: int, mixed: slice, seed: int = 0) -> torch.Tensor:
    """A long chunk on slot 1, a stretch `mixed` of random slots (a tile holding several
    requests, and tokens without an adapter) and three padding tokens at the end."""
    slots = torch.ones(num_tokens, dtype=torch.int64)
    n = len(range(num_tokens)[mixed])
    slots[mixed] = torch.randint(-1, num_slots, (n,), generator=torch.Generator().manual_seed(seed))
    slots[-3:] = -1
    return slots


MARGIN = 2


def poisoned(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `values` as a strided view into a NaN-filled buffer `MARGIN` elements
    wider on every side; a kernel that reads outside the view picks a NaN up, one that
    writes outside it overwrites one."""
    buffer = torch.full([n + 2 * MARGIN for n in values.shape], float("nan"),
                        dtype=values.dtype, device=values.device)
    view = buffer[tuple(slice(MARGIN, MARGIN + n) for n in values.shape)]
    view.copy_(values)
    return buffer, view


def assert_ragged_shapes_stay_in_bounds(dtype: torch.dtype, device: str, shrink_tol: dict,
                                        expand_tol: dict) -> None:
    """SmolLM2's q/k/v (in 576, out 960 = 576 + 192 + 192) at rank 24 over 13 tokens: no
    dimension a multiple of the tiles, every operand a view inside NaNs."""
    from kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    pieces = [(0, 576), (576, 192), (768, 192)]
    a, b = random_adapters(4, pieces, 576, 24, dtype, device)
    x, y = randn(13, 576, dtype=dtype, device=device), randn(13, 960, dtype=dtype, device=device)
    slots = torch.tensor([0, 3, -1, 3, 1, 1, 2, -1, 0, 0, 2, 3, 1], device=device)
    want_shrunk = lora_shrink_ref(x, a, slots)
    want = lora_expand_ref(y.clone(), want_shrunk, b, slots, pieces)
    (_, xv), (_, av), (_, bv), (_, shrunk) = map(poisoned, (x, a, b, want_shrunk))
    y_buffer, yv = poisoned(y)

    # assert_close fails on a NaN picked up from outside an operand.
    torch.testing.assert_close(lora_shrink_triton(xv, av, slots), want_shrunk, **shrink_tol)
    torch.testing.assert_close(lora_expand_triton(yv, shrunk, bv, slots, pieces), want,
                               **expand_tol)
    outside = torch.ones_like(y_buffer, dtype=torch.bool)
    outside[MARGIN:-MARGIN, MARGIN:-MARGIN] = False
    assert y_buffer[outside].isnan().all(), "the expand wrote outside y"


# ------------------------------------------ Triton through its interpreter (CPU)

@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter run")
def test_triton_interpreter():
    """Runs this file's interpreter_only tests on the CPU, through Triton's interpreter."""
    run_interpreter_tests(__file__)


# The interpreter gets bfloat16 wrong (see test_kernels.py): bfloat16 is left to the GPU.
INTERP_SHRINK_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
                     torch.float16: {"atol": 1e-4, "rtol": 1e-4}}
INTERP_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 4e-3, "rtol": 4e-3}}
# Pieces against the 64- and 128-wide column tiles: a ragged tile, a boundary inside a
# tile, and (at 128) all three pieces in one tile.
INTERP_PIECES = {"P1": [(0, 72)], "P2": [(0, 40), (40, 40)], "P3": [(0, 48), (48, 16), (64, 16)]}


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rank", [16, 24])         # 24: no power of two, a ragged rank tile
@pytest.mark.parametrize("pieces", INTERP_PIECES.values(), ids=INTERP_PIECES.keys())
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_interp_decode_batches_match_reference(num_tokens, pieces, rank, dtype):
    """Random slots of four, -1 among them, given as int32; in = 520 splits the shrink's K
    (8 SMs assumed on the CPU) and leaves its last K tile ragged."""
    from kernels.triton_lora import pick_shrink_config

    a, b = random_adapters(4, pieces, 520, rank, dtype)
    x, y = randn(num_tokens, 520, dtype=dtype), randn(num_tokens, out_features(pieces), dtype=dtype)
    slots = torch.randint(-1, 4, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens),
                          dtype=torch.int32)
    assert pick_shrink_config(num_tokens, a.shape[1], 520, dtype, x.device).split_k > 1
    assert_kernels_match_reference(x, a, b, y, slots, pieces, INTERP_SHRINK_TOL[dtype],
                                   INTERP_TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_interp_prefill_chunk_matches_reference(dtype):
    """150 tokens, three token tiles: one on one slot, one mixed, one ending in padding; K
    not split. Slots as int64."""
    from kernels.triton_lora import pick_shrink_config

    pieces = INTERP_PIECES["P3"]
    a, b = random_adapters(4, pieces, 100, 16, dtype)
    x, y = randn(150, 100, dtype=dtype), randn(150, out_features(pieces), dtype=dtype)
    assert pick_shrink_config(150, a.shape[1], 100, dtype, x.device).split_k == 1
    assert_kernels_match_reference(x, a, b, y, prefill_slots(150, 4, slice(70, 100)), pieces,
                                   INTERP_SHRINK_TOL[dtype], INTERP_TOL[dtype])


@interpreter_only
def test_interp_tokens_without_adapter_get_zero_shrunk_rows():
    from kernels.triton_lora import lora_shrink_triton

    a, _ = random_adapters(4, QKV, 64, 16)
    slots = torch.tensor([-1, 2, -1, -1, 0])
    shrunk = lora_shrink_triton(randn(5, 64), a, slots)
    assert not shrunk[slots < 0].any()


def assert_folded_expand_matches_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                           y: torch.Tensor, slots: torch.Tensor,
                                           pieces: list[tuple[int, int]], tol: dict) -> None:
    """The folded expand (through the public function on CUDA) against the reference on the
    same wider output; rows without an adapter come out bit for bit as the base's."""
    from kernels.triton_lora import lora_expand_folded_triton

    y_aug = folded_output(x, a, y)
    want = lora_expand_folded_ref(y_aug, y.shape[1], b, slots, pieces)
    expand = lora_expand_folded if y.is_cuda else lora_expand_folded_triton
    got = expand(y_aug, y.shape[1], b, slots, pieces)
    assert got.is_contiguous() and got.shape == y.shape
    torch.testing.assert_close(got, want, **tol)
    none = slots < 0
    assert torch.equal(got[none], y[none]), "a token without adapter was changed"
    assert torch.equal(y_aug[:, :y.shape[1]], y), "the folded expand wrote into its input"


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("pieces", INTERP_PIECES.values(), ids=INTERP_PIECES.keys())
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_interp_folded_expand_matches_reference(num_tokens, pieces, dtype):
    """Four slots of rank 24 (a ragged rank tile), -1 among the tokens' slots."""
    a, b = random_adapters(4, pieces, 72, 24, dtype)
    x, y = randn(num_tokens, 72, dtype=dtype), randn(num_tokens, out_features(pieces), dtype=dtype)
    slots = torch.randint(-1, 4, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens),
                          dtype=torch.int32)
    assert_folded_expand_matches_reference(x, a, b, y, slots, pieces, INTERP_TOL[dtype])


@interpreter_only
def test_interp_ragged_shapes_read_and_write_nothing_out_of_bounds():
    assert_ragged_shapes_stay_in_bounds(torch.float32, "cpu", INTERP_SHRINK_TOL[torch.float32],
                                        INTERP_TOL[torch.float32])


# ------------------------------------------------------------ Triton on CUDA

SHRINK_TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 1e-3, "rtol": 1e-3}}
# bfloat16 outputs of order 1-4: a unit in the last place or two.
GPU_TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}
# Llama-3.1-8B's linears: (in, pieces).
LAYERS = {"qkv": (4096, [(0, 4096), (4096, 1024), (5120, 1024)]),
          "gate_up": (4096, [(0, 14336), (14336, 14336)]),
          "down": (14336, [(0, 4096)])}
GPU_SLOTS = 32


def gpu_adapters(layer: str, rank: int, dtype: torch.dtype):
    """(in, pieces, a, b) of `layer` with 32 adapter slots, on the GPU."""
    in_features, pieces = LAYERS[layer]
    return (in_features, pieces, *random_adapters(GPU_SLOTS, pieces, in_features, rank, dtype,
                                                  "cuda"))


def gpu_inputs(num_tokens: int, in_features: int, pieces: list[tuple[int, int]],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): a layer's input and its base output, on the GPU."""
    return (randn(num_tokens, in_features, dtype=dtype, device="cuda", seed=num_tokens),
            randn(num_tokens, out_features(pieces), dtype=dtype, device="cuda",
                  seed=num_tokens + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("layer", LAYERS)
def test_gpu_decode_batches_match_reference(layer, rank, dtype):
    """1, 7 and 256 tokens, each on a random one of 32 slots or none."""
    in_features, pieces, a, b = gpu_adapters(layer, rank, dtype)
    for num_tokens in (1, 7, 256):
        x, y = gpu_inputs(num_tokens, in_features, pieces, dtype)
        slots = torch.randint(-1, GPU_SLOTS, (num_tokens,),
                              generator=torch.Generator().manual_seed(num_tokens)).cuda()
        assert_kernels_match_reference(x, a, b, y, slots, pieces, SHRINK_TOL[dtype],
                                       GPU_TOL[dtype], where=f"{num_tokens} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("layer", LAYERS)
def test_gpu_prefill_chunks_match_reference(layer, rank, dtype):
    """2048 tokens on one slot but for a mixed stretch across a tile boundary."""
    in_features, pieces, a, b = gpu_adapters(layer, rank, dtype)
    x, y = gpu_inputs(2048, in_features, pieces, dtype)
    slots = prefill_slots(2048, GPU_SLOTS, slice(1000, 1100)).cuda()
    assert_kernels_match_reference(x, a, b, y, slots, pieces, SHRINK_TOL[dtype], GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", LAYERS)
def test_gpu_folded_expand_matches_reference(layer, dtype):
    """1, 7 and 256 decode tokens on random slots of 8 (rank 16), and a 2048-token chunk on
    one slot but for a mixed stretch."""
    in_features, pieces = LAYERS[layer]
    a, b = random_adapters(8, pieces, in_features, 16, dtype, "cuda")
    for num_tokens in (1, 7, 256, 2048):
        x, y = gpu_inputs(num_tokens, in_features, pieces, dtype)
        slots = (prefill_slots(num_tokens, 8, slice(1000, 1100)) if num_tokens == 2048 else
                 torch.randint(-1, 8, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens)))
        assert_folded_expand_matches_reference(x, a, b, y, slots.cuda(), pieces, GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [7, 512])
def test_gpu_replay_in_a_cuda_graph_follows_new_slots(num_tokens):
    """Shrink and expand captured once on slot 0, replayed with other slots and inputs:
    each replay gives the reference's answer for the slots it found."""
    in_features, pieces, a, b = gpu_adapters("qkv", 16, torch.bfloat16)
    x, y0 = gpu_inputs(num_tokens, in_features, pieces, torch.bfloat16)
    slots = torch.zeros(num_tokens, dtype=torch.int32, device="cuda")

    def step() -> torch.Tensor:
        return lora_expand(y0.clone(), lora_shrink(x, a, slots), b, slots, pieces)

    stream = torch.cuda.Stream()   # warm up (compile) off the capturing stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator().manual_seed(0)
    # Random slots twice, then a batch without any adapter.
    for new_slots in (torch.randint(-1, GPU_SLOTS, (num_tokens,), generator=g),
                      torch.randint(-1, GPU_SLOTS, (num_tokens,), generator=g),
                      torch.full((num_tokens,), -1)):
        slots.copy_(new_slots)
        x.copy_(torch.randn(x.shape, generator=g))
        graph.replay()
        want = lora_expand_ref(y0.clone(), lora_shrink_ref(x, a, slots), b, slots, pieces)
        torch.testing.assert_close(out, want, **GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_ragged_shapes_read_and_write_nothing_out_of_bounds(dtype):
    assert_ragged_shapes_stay_in_bounds(dtype, "cuda", SHRINK_TOL[dtype], GPU_TOL[dtype])
