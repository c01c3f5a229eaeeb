"""Programmatic dependent launch of the decode kernels (`kernels.pdl`): when it is on, and
that a chain of kernels launched with it computes what the same chain computes without."""

import pytest
import torch

from kernels.linear import linear
from kernels.norm import fused_add_rms_norm
from kernels.pdl import launch_options, pdl_enabled

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="PDL needs compute capability 9.0+")


def test_pdl_is_off_on_the_cpu():
    assert not pdl_enabled(torch.device("cpu"))


def test_launch_options_ask_triton_for_pdl_only_when_it_is_on():
    assert launch_options(True) == {"launch_pdl": True}
    assert launch_options(False) == {}


@pytest.mark.gpu
@needs_hopper
def test_pdl_is_on_on_hopper_unless_turned_off(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv("PAGEDSERVE_PDL", raising=False)
    assert pdl_enabled(cuda)
    monkeypatch.setenv("PAGEDSERVE_PDL", "0")
    assert not pdl_enabled(cuda)


def _norm_and_gemvs(x, residual, norm_weight, weights):
    """A decode layer's shape of launches: add-and-norm, then one-row GEMVs, each reading the
    one before, four times over (every launch depends on its predecessor)."""
    for _ in range(4):
        h, residual = fused_add_rms_norm(x, residual, norm_weight, 1e-5)
        y = linear(h, weights[0])
        x = linear(linear(y[:, :weights[1].shape[1]], weights[1]), weights[1])
    return x, residual


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("graph", [False, True])
def test_a_chain_launched_with_pdl_equals_it_without(monkeypatch, graph):
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / 64
               for n, k in ((6144, 4096), (4096, 4096))]
    norm_weight = torch.randn(4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn_like(x)

    def run(pdl: str) -> torch.Tensor:
        monkeypatch.setenv("PAGEDSERVE_PDL", pdl)
        if not graph:
            return _norm_and_gemvs(x, residual, norm_weight, weights)[0]
        _norm_and_gemvs(x, residual, norm_weight, weights)      # compiles outside the capture
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            out = _norm_and_gemvs(x, residual, norm_weight, weights)[0]
        for _ in range(3):
            cuda_graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    without, with_pdl = run("0"), run("1")
    assert torch.isfinite(without).all()
    assert torch.equal(with_pdl, without)
