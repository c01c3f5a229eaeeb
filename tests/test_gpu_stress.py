"""The engine stress scenarios (tests/stress.py) at GPU sizes, on one NVIDIA GPU.

Two models. A tiny random Llama in float32 for every scenario that compares tokens with a
reference run (fp32, so greedy tokens do not depend on the batch and equality means
something), at batch sizes up to 256. The Llama-3.1-8B shape with dummy bf16 weights for
prompts up to its full max_model_len (131072 tokens) in a pool sized from GPU memory, where
only completion, lengths and the pool are checked (bf16 rounding depends on the batch).

Every scenario runs with CUDA graphs on and off and asynchronous scheduling on and off. The
8B weights are loaded once for the module and shared by every 8B engine; each engine's pool
is freed before the next is built. Budget: well under 8 minutes on an H200; a 131k-token
prefill takes tens of seconds, so the full doubling ladder runs in one configuration and
only its top length in the others. Run them all with `python bench/gpu_stress.py`.
"""

import functools
import gc

import pytest
import stress
import torch

from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.models.loader import PRESETS

pytestmark = pytest.mark.gpu

# (async_scheduling, enforce_eager)
CONFIGS = [(a, e) for a in (True, False) for e in (False, True)]
DEFAULT = (True, False)          # what a GPU worker runs: async scheduling, CUDA graphs


def config_id(config) -> str:
    a, e = config
    return f"{'async' if a else 'sync'}-{'eager' if e else 'graphs'}"


def free_gpu_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- the tiny fp32 model

TINY_MAX_LEN = 16384


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer random Llama (grouped KV heads) saved as a Hugging Face directory, loaded once
    on the GPU in float32."""
    from helpers import save_tiny_llama

    from worker.models.loader import load_model, resolve_source
    path = tmp_path_factory.mktemp("tiny_llama_gpu")
    save_tiny_llama(path, max_position_embeddings=TINY_MAX_LEN)
    source = resolve_source(str(path))
    # A dict, emptied at the end: pytest keeps a fixture's value until after its teardown.
    weights = {"path": path, "source": source, "loaded": load_model(source, torch.device("cuda"), torch.float32)}
    yield weights
    weights.clear()
    free_gpu_memory()


@pytest.fixture(params=CONFIGS, ids=config_id)
def make(request, tiny):
    return engine_maker(tiny, *request.param)


@pytest.fixture
def make_default(tiny):
    """Engines in the configuration a GPU worker runs, for scenarios too slow for all four."""
    return engine_maker(tiny, *DEFAULT)


def engine_maker(tiny, async_scheduling: bool, enforce_eager: bool):
    path, source, loaded = tiny["path"], tiny["source"], tiny["loaded"]

    def make(**settings):
        settings = {"device": "cuda", "dtype": "float32", "num_blocks": 8192, "max_num_seqs": 256,
                    "max_num_batched_tokens": 2048, "async_scheduling": async_scheduling,
                    "enforce_eager": enforce_eager, **settings}
        engine = LLMEngine(EngineConfig(model=str(path), **settings), source, loaded)
        assert (engine.runner.graphs is None) == enforce_eager
        return engine
    return make


@pytest.mark.parametrize("num_decoders", [8, 32])
def test_long_prompts_while_others_decode(make, num_decoders):
    stress.long_prompts_while_decoding(make, [1024, TINY_MAX_LEN - 8], num_decoders)


def test_long_prompts_while_others_decode_under_a_long_prefill_threshold(make):
    capped = functools.partial(make, long_prefill_token_threshold=512)
    stress.long_prompts_while_decoding(capped, [1024, TINY_MAX_LEN - 8], 32)


@pytest.mark.parametrize("batch_size", [1, 16, 100, 256])   # 100: a CUDA graph replayed with padding
def test_aborts_mid_prefill_and_mid_decode(make, batch_size):
    stress.aborts(make, batch_size, max_tokens=32)


def test_n_choices(make):
    stress.n_choices(make, num_requests=48, max_tokens=32)


def test_prefix_cache_hits(make):
    stress.prefix_cache(make, num_requests=64, prefix_len=1000, max_tokens=24)


def test_stop_tokens(make):
    stress.stop_tokens(make, num_requests=128, max_tokens=32)


# About 11x the roomy run's steps and some 30 preemptions (the limit is 20x): a pool of one
# 384-token request serves 24 requests that grow by 128 tokens each.
STORM = dict(num_requests=24, max_prompt_len=256, max_tokens=128, shared_prefix_len=64)


@pytest.mark.parametrize("num_swap_blocks", ["small", "ample"])
def test_preemption_storm_swap(make, num_swap_blocks):
    stress.preemption_storm(make, mode="swap", num_swap_blocks=num_swap_blocks, **STORM)


def test_preemption_storm_recompute(make):
    """THE RECOMPUTE STORM (see tests/test_engine_stress.py)."""
    stress.preemption_storm(make, mode="recompute", **STORM)


@pytest.mark.parametrize("mode,num_swap_blocks", [("swap", "small"), ("recompute", "ample")],
                         ids=["swap", "recompute"])
def test_preemption_storm_over_a_float8_kv_pool(make_default, mode, num_swap_blocks):
    """The float8 pool's swaps and rewrites under the Triton KV write and attention, with
    asynchronous scheduling and CUDA graphs."""
    fp8 = functools.partial(make_default, kv_cache_dtype="fp8")
    stress.preemption_storm(fp8, mode=mode, num_swap_blocks=num_swap_blocks, same_tokens=False, **STORM)


# ---------------------------------------------------------------- Llama-3.1-8B, dummy bf16

LLAMA_8B = "llama-3.1-8b"
MAX_LEN_8B = PRESETS[LLAMA_8B]["max_position_embeddings"]      # 131072
TOP_8B = MAX_LEN_8B - 8                                          # room for 8 generated tokens


@pytest.fixture(scope="module")
def llama8b():
    """The 8B weights, once for the module (16 GB): every 8B engine shares them."""
    from worker.models.loader import load_model, resolve_source
    source = resolve_source(LLAMA_8B, "dummy")
    weights = {"source": source, "loaded": load_model(source, torch.device("cuda"), torch.bfloat16),
               "engines": []}
    yield weights
    for engine in weights["engines"]:
        stress.release(engine)
    weights.clear()             # then the 16 GB go back to the driver, for later test files
    free_gpu_memory()


def make_8b(llama8b, config):
    """Engines with the defaults a GPU worker starts with (pool sized from
    gpu_memory_utilization, max_num_batched_tokens, max_num_seqs), in `config`."""
    source, loaded = llama8b["source"], llama8b["loaded"]
    async_scheduling, enforce_eager = config

    def make(**settings):
        # The scenario released the previous engine, unless it failed: then the traceback
        # keeps it alive, and its pool would leave the next engine no memory.
        while llama8b["engines"]:
            stress.release(llama8b["engines"].pop())
        free_gpu_memory()
        engine = LLMEngine(EngineConfig(model=LLAMA_8B, load_format="dummy", dtype="bfloat16", device="cuda",
                                        async_scheduling=async_scheduling, enforce_eager=enforce_eager,
                                        **settings), source, loaded)
        llama8b["engines"].append(engine)
        assert engine.max_model_len == MAX_LEN_8B, (
            f"the pool sized from memory ({engine.blocks.num_blocks} blocks of {engine.config.block_size}) "
            f"cuts max_model_len to {engine.max_model_len}, below the model's {MAX_LEN_8B}")
        return engine
    return make


def test_8b_lone_prompts_doubling_to_max_model_len(llama8b):
    """1k, 2k, ... 64k, then 131064 tokens, each alone, in the serving configuration."""
    stress.lone_long_prompts(make_8b(llama8b, DEFAULT), stress.doubling_lengths(1024, TOP_8B))


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != DEFAULT], ids=config_id)
def test_8b_lone_prompt_at_max_model_len(llama8b, config):
    stress.lone_long_prompts(make_8b(llama8b, config), [TOP_8B])


def test_8b_prompt_at_max_model_len_while_32_decode(llama8b):
    stress.long_prompts_while_decoding(make_8b(llama8b, DEFAULT), [TOP_8B], 32, exact=False)
