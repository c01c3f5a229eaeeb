"""The engine stress scenarios (tests/stress.py) at CPU sizes, on a tiny random Llama in float32
(exact enough for greedy outputs to be batch-invariant, so equality with reference runs is
meaningful). Each runs with asynchronous scheduling on and off. The GPU suite
(tests/test_gpu_stress.py, at GPU sizes) also runs each with CUDA graphs on and off; on the CPU
there are none (`enforce_eager` changes nothing), so that axis is left out here."""

import functools

import pytest
import stress
import torch

from worker.config import EngineConfig
from worker.engine import LLMEngine

CONFIGS = [pytest.param(a, id="async" if a else "sync") for a in (False, True)]   # async_scheduling

MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls gain nothing from threads, and on a small shared machine
    OpenMP's waiting threads make each one tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random Llama saved as a Hugging Face directory, loaded once in float32."""
    from helpers import save_tiny_llama

    from worker.models.loader import load_model, resolve_source
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(path, vocab_size=256, hidden_size=64, layers=2, max_position_embeddings=MAX_MODEL_LEN)
    source = resolve_source(str(path))
    return path, source, load_model(source, torch.device("cpu"), torch.float32)


@pytest.fixture(params=CONFIGS)
def make(request, tiny):
    """Engines over the shared tiny weights in one configuration of the matrix."""
    path, source, loaded = tiny

    def make(**settings):
        settings = {"device": "cpu", "dtype": "float32", "num_blocks": 640, "max_num_seqs": 64,
                    "max_num_batched_tokens": 256, "async_scheduling": request.param, **settings}
        return LLMEngine(EngineConfig(model=str(path), **settings), source, loaded)
    return make


def test_lone_long_prompts_up_to_max_model_len(make):
    stress.lone_long_prompts(make, stress.doubling_lengths(1024, MAX_MODEL_LEN - 8))   # 1024, 2048, 4088


@pytest.mark.parametrize("num_decoders", [8, 16])
def test_long_prompts_while_others_decode(make, num_decoders):
    stress.long_prompts_while_decoding(make, [1024, MAX_MODEL_LEN - 8], num_decoders)


def test_long_prompts_while_others_decode_under_a_long_prefill_threshold(make):
    capped = functools.partial(make, long_prefill_token_threshold=64)
    stress.long_prompts_while_decoding(capped, [1024], 16)


@pytest.mark.parametrize("batch_size", [1, 2, 16, 63])
def test_aborts_mid_prefill_and_mid_decode(make, batch_size):
    stress.aborts(make, batch_size)


def test_n_choices(make):
    stress.n_choices(make)


def test_prefix_cache_hits(make):
    stress.prefix_cache(make)


def test_stop_tokens(make):
    stress.stop_tokens(make)


@pytest.mark.parametrize("num_swap_blocks", ["small", "ample"])
def test_preemption_storm_swap(make, num_swap_blocks):
    stress.preemption_storm(make, mode="swap", num_swap_blocks=num_swap_blocks)


def test_preemption_storm_recompute(make):
    """THE RECOMPUTE STORM: every preempted request loses its blocks and is prefilled again,
    taking back its own blocks from the prefix cache when they survive. Kept apart from the
    swap storms so that a failure here names recompute preemption."""
    stress.preemption_storm(make, mode="recompute")


@pytest.mark.parametrize("mode,num_swap_blocks", [("swap", "small"), ("recompute", "ample")],
                         ids=["swap", "recompute"])
def test_preemption_storm_over_a_float8_kv_pool(make, mode, num_swap_blocks):
    """Swap-out and swap-in copy float8 blocks (and their scales stay per layer); recompute
    writes them again: the storm ends, every block accounted for after each step."""
    fp8 = functools.partial(make, kv_cache_dtype="fp8")
    stress.preemption_storm(fp8, mode=mode, num_swap_blocks=num_swap_blocks, same_tokens=False)
