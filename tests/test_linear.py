"""kernels.linear: the unquantized linear, and the one-row GEMV it takes on a GPU.

On the CPU `linear` is `F.linear`; the GEMV kernel itself runs through Triton's interpreter
in tests/test_fp8.py (`test_interp_weight_only_kernel_takes_a_16_bit_weight_without_a_scale`).
"""

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_hf_model

from kernels.linear import linear
from worker.models.llama import DenseLinear
from worker.models.loader import load_model, resolve_source


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_linear_on_the_cpu_is_f_linear_to_the_bit():
    x, w, b = randn(1, 96), randn(40, 96, seed=1), randn(40, seed=2)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x.expand(3, 96), w), F.linear(x.expand(3, 96), w))


def test_a_loaded_model_has_dense_decoder_linears_and_a_plain_lm_head(tmp_path):
    tiny_hf_model(tmp_path, "llama3")
    _, model = load_model(resolve_source(str(tmp_path)), torch.device("cpu"), torch.float32)
    layer = model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert type(module) is DenseLinear
    assert type(model.lm_head) is torch.nn.Linear


# Llama-3.1-8B's decoder linears (n, k), and a ragged one.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 200)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_one_row_matches_cublas_within_the_output_rounding(dtype):
    """Both sum in fp32 and round once: they differ by the summation order, well under one
    unit of the output's last place relative to the largest output."""
    for n, k in SHAPES:
        w = (randn(n, k, seed=n) * k ** -0.5).to(dtype).cuda()
        x, bias = randn(1, k, seed=k).to(dtype).cuda(), randn(n, seed=1).to(dtype).cuda()
        for b in (None, bias):
            out, want = linear(x, w, b), F.linear(x, w, b)
            assert out.dtype == dtype and out.shape == (1, n)
            torch.testing.assert_close(out.float(), want.float(), rtol=1e-2,
                                       atol=1e-2 * want.float().abs().max().item(),
                                       msg=lambda s, where=(n, k, b is None): f"{where}: {s}")


@pytest.mark.gpu
def test_gpu_one_row_replays_in_a_cuda_graph():
    w = (randn(4096, 4096) * 4096 ** -0.5).bfloat16().cuda()
    x = randn(1, 4096, seed=1).bfloat16().cuda()
    linear(x, w)                                    # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w)
    x.copy_(randn(1, 4096, seed=2).bfloat16())
    graph.replay()
    assert torch.equal(out, linear(x, w))
