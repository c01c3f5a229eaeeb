"""Tensor parallelism on the CPU (gloo): a worker spread over N ranks computes what one rank
does. Ranks 1..N-1 are real processes; rank 0 is the engine in this process."""

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import LONG_STORY, PROMPTS, generate, greedy, tiny_hf_model

from common.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.parallel import HeadSplit, Shard, check_splittable, split_heads

# ------------------------------------------------------------------------------ how weights split


def test_kv_heads_split_contiguously_with_their_query_heads():
    assert [split_heads(32, 8, Shard(r, 4)) for r in range(4)] == [
        HeadSplit(8 * r, 8, 2 * r, 2) for r in range(4)]


def test_uneven_kv_heads_split_as_evenly_as_possible():
    # SmolLM2-135M: 9 query heads over 3 KV heads, on 2 ranks.
    assert [split_heads(9, 3, Shard(r, 2)) for r in range(2)] == [HeadSplit(0, 6, 0, 2), HeadSplit(6, 3, 2, 1)]


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head():
    assert [split_heads(8, 2, Shard(r, 4)) for r in range(4)] == [
        HeadSplit(0, 2, 0, 1), HeadSplit(2, 2, 0, 1), HeadSplit(4, 2, 1, 1), HeadSplit(6, 2, 1, 1)]


def test_heads_that_cannot_be_split_are_refused_naming_the_sizes():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot split 8 query heads over 2 KV heads"):
        check_splittable(8, 2, 3)
    with pytest.raises(ValueError, match="more than the model's 8 attention heads"):
        check_splittable(8, 8, 16)


def test_vocabulary_slices_are_padded_to_one_size():
    assert [Shard(r, 3).padded_split(320) for r in range(3)] == [(0, 107, 107), (107, 107, 107), (214, 106, 107)]

# ------------------------------------------------------------------------------ whole models


def engine(model: str, tensor_parallel_size: int, **settings) -> LLMEngine:
    settings.setdefault("num_blocks", 128)
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32",
                                  tensor_parallel_size=tensor_parallel_size, **settings))


def run(model: str, tensor_parallel_size: int, prompts, params, scored: list[int], **settings):
    """Greedy outputs of `prompts` and the teacher-forced logits of `scored`."""
    tp = engine(model, tensor_parallel_size, **settings)
    try:
        return generate(tp, prompts, params), tp.prompt_logits(scored), tp
    finally:
        tp.close()


@pytest.mark.parametrize(("kind", "tensor_parallel_size"), [("llama3", 2), ("qwen2", 4)],
                         ids=["llama3-tp2", "qwen2-tied-bias-tp4-replicated-kv"])
def test_small_models_match_one_rank(tmp_path, kind, tensor_parallel_size):
    tiny_hf_model(tmp_path, kind)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist() for n in (5, 40, 90)]
    scored = torch.randint(0, 320, (70,), generator=gen).tolist()
    params = greedy(16, ignore_eos=True)
    one_tokens, one_logits, _ = run(str(tmp_path), 1, prompts, params, scored)
    tp_tokens, tp_logits, _ = run(str(tmp_path), tensor_parallel_size, prompts, params, scored)
    torch.testing.assert_close(tp_logits, one_logits, atol=1e-4, rtol=1e-4)
    assert tp_tokens == one_tokens


def test_prompt_logprobs_over_two_ranks_take_each_slice_of_logits_from_both(tmp_path):
    """A prompt scored in one step with more rows than one slice of logits (MAX_LOGITS_ROWS):
    both ranks compute every slice's logits (a collective), rank 0 reduces them."""
    from worker.model_runner import MAX_LOGITS_ROWS
    tiny_hf_model(tmp_path, "llama3")
    ids = torch.randint(0, 320, (MAX_LOGITS_ROWS + 40,), generator=torch.Generator().manual_seed(3)).tolist()
    tp = engine(str(tmp_path), 2, max_num_batched_tokens=512)
    try:
        tp.add_request("s", ids, SamplingParams(prompt_logprobs=1, max_tokens=0))
        entries = []
        while tp.has_unfinished():
            entries += [entry for out in tp.step() for entry in out.prompt_logprobs or []]
        reference = tp.prompt_logits(ids).log_softmax(-1)
    finally:
        tp.close()
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor([lp for lp, _ in entries]), expected, atol=1e-5, rtol=0)


def test_smollm2_with_uneven_heads_preemption_and_forks_matches_one_rank(smollm_tokenizer):
    """Two ranks of SmolLM2 (6 + 3 query heads) through chunked prefill, swap preemption in
    a 12-block pool and n=2 forks (block copies) give the single rank's tokens."""
    prompts = [smollm_tokenizer.encode(p, add_special_tokens=False)
               for p in [*PROMPTS[:5], LONG_STORY[:300]]]
    params = [greedy(20, ignore_eos=True)] * 5 + [SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12)]
    settings = dict(num_blocks=12, preemption_mode="swap", num_swap_blocks=64, max_num_batched_tokens=48)
    one_tokens, one_logits, _ = run("default", 1, prompts, params, prompts[5], **settings)
    tp_tokens, tp_logits, tp = run("default", 2, prompts, params, prompts[5], **settings)
    assert tp.scheduler.num_preemptions["swap"] > 0
    torch.testing.assert_close(tp_logits, one_logits, atol=2e-4, rtol=1e-4)
    assert tp_tokens == one_tokens


def test_a_model_that_cannot_split_is_refused_before_any_rank_starts(tmp_path):
    tiny_hf_model(tmp_path, "llama3")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cannot split 8 query heads"):
        engine(str(tmp_path), 3)


# ------------------------------------------------------------------------------ the worker process


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads child processes from /proc")
def test_worker_process_serves_with_two_ranks_and_takes_them_down_on_exit(make_engine, smollm_tokenizer):
    import asyncio

    import grpc
    from worker_process import WorkerProcess, run_requests, submit

    from common.pb import worker_pb2, worker_pb2_grpc

    prompt = smollm_tokenizer.encode(PROMPTS[3], add_special_tokens=False)
    expected = generate(make_engine(), [prompt], greedy(12, ignore_eos=True))["r0"][0]
    with WorkerProcess(["--tensor-parallel-size", "2", "--metrics-port", "0"]) as worker:
        with grpc.insecure_channel(worker.address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
        results = asyncio.run(run_requests(worker.address, [submit("r", prompt, 12)]))
        children = _children(worker.process.pid)
    assert info.tensor_parallel_size == 2
    assert results["r"].tokens == expected
    assert len(children) >= 1
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, [Path(f"/proc/{p}/cmdline").read_text() for p in children if _alive(p)]
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads child processes from /proc")
def test_a_worker_whose_rank_dies_exits_saying_so_instead_of_hanging():
    import signal

    from worker_process import WorkerProcess

    with WorkerProcess(["--tensor-parallel-size", "2", "--metrics-port", "0"]) as worker:
        (rank,) = [pid for pid in _children(worker.process.pid)
                   if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        os.kill(rank, signal.SIGKILL)
        assert worker.process.wait(timeout=30) != 0
        assert "tensor-parallel rank 1 exited" in worker.log()


def _children(pid: int) -> list[int]:
    """Child processes of pid (Linux /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
