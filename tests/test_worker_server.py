"""worker.server: what a worker's Info says about how it holds the model.

Built in process on an engine (the servicer a `pagedserve serve --role worker` process serves);
the rest of the servicer is specified end to end with worker processes (test_worker_faults,
test_worker_metrics, test_router_replicas).
"""

from __future__ import annotations

from worker.server import WorkerService


def test_info_names_the_kv_cache_dtype_and_the_linears_quantization(make_engine):
    info = WorkerService(make_engine(kv_cache_dtype="fp8", num_blocks=32), "w1", "smol").info
    assert (info.dtype, info.kv_cache_dtype, info.quantization) == ("float32", "fp8_e4m3", "none")
    assert info.num_gpu_blocks == 32


def test_info_of_fp8_linears_quantized_on_load_says_fp8(make_engine):
    info = WorkerService(make_engine(quantization="fp8", num_blocks=32), "w1", "smol").info
    assert (info.kv_cache_dtype, info.quantization) == ("float32", "fp8")
