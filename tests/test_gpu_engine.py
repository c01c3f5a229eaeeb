"""The engine on an NVIDIA GPU: logits against transformers, CUDA graphs against eager."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import generate, save_byte_level_tokenizer, save_tiny_llama

from common.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine

pytestmark = pytest.mark.gpu


def engine_for(path, dtype: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype=dtype, num_blocks=256,
                                  max_num_seqs=32, max_num_batched_tokens=1024, **kw))


def test_teacher_forced_logits_match_transformers_fp32(tmp_path):
    hf = save_tiny_llama(tmp_path).cuda()
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = engine_for(tmp_path, "float32", enforce_eager=True).prompt_logits(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids], device="cuda")).logits[0]
    torch.testing.assert_close(ours, theirs.float(), atol=2e-3, rtol=2e-3)


def test_teacher_forced_logits_bf16_as_close_as_transformers_own_bf16(tmp_path):
    hf = save_tiny_llama(tmp_path).cuda()
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        exact = hf(x).logits[0].float()
        theirs = hf.to(torch.bfloat16)(x).logits[0].float()
    ours = engine_for(tmp_path, "bfloat16", enforce_eager=True).prompt_logits(ids).float()
    their_error = (theirs - exact).abs().max().item()
    our_error = (ours - exact).abs().max().item()
    assert our_error <= 2 * their_error + 1e-3, (our_error, their_error)


@pytest.mark.parametrize("num_requests", [16, 13])   # 13 replays the 16-graph with padding
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_identical_with_and_without_cuda_graphs(tmp_path, num_requests, dtype):
    save_tiny_llama(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (40,), generator=gen).tolist() for _ in range(num_requests)]
    outputs = []
    for eager in (True, False):
        engine = engine_for(tmp_path, dtype, enforce_eager=eager)
        assert (engine.runner.graphs is None) == eager
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        tokens = {str(i): [] for i in range(num_requests)}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_mixing_prompts_and_decodes_identical_with_and_without_cuda_graphs(tmp_path, dtype):
    """Requests arriving while others decode make steps of decodes plus a prompt chunk: with
    graphs on, those replay the mixed graphs (padded to their token count) and change no token."""
    save_tiny_llama(tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 300, (12,), generator=gen)]
    outputs = []
    for eager in (True, False):
        engine = engine_for(tmp_path, dtype, enforce_eager=eager)
        replayed = []       # per step through the graphs: whether a mixed graph replayed it
        if not eager:
            run = engine.runner.graphs.run

            def spy(ids, pos, md, run=run):
                hidden = run(ids, pos, md)
                replayed.append(md.max_query_len > 1 and hidden is not None)
                return hidden
            engine.runner.graphs.run = spy
        tokens = {str(i): [] for i in range(len(prompts))}
        step = 0
        while step < 3 * len(prompts) or engine.has_unfinished():
            if step % 3 == 0 and step // 3 < len(prompts):
                i = step // 3
                engine.add_request(str(i), prompts[i], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
            step += 1
        outputs.append(tokens)
        assert eager or sum(replayed) >= len(prompts) - 1      # the prompts beside decodes
    assert outputs[0] == outputs[1]


def test_seeded_sampling_on_gpu_is_reproducible(tmp_path):
    save_tiny_llama(tmp_path)
    runs = []
    for extra in (0, 5):
        engine = engine_for(tmp_path, "bfloat16")
        engine.add_request("s", list(range(1, 30)), SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24))
        for i in range(extra):
            engine.add_request(f"o{i}", list(range(5, 50)), SamplingParams(temperature=1.0, max_tokens=24))
        got = []
        while engine.has_unfinished():
            got += [t for o in engine.step() if o.request_id == "s" for t in o.new_token_ids]
        runs.append(got)
    assert runs[0] == runs[1]


def test_async_scheduling_matches_synchronous_on_gpu(tmp_path):
    """Pending tokens read on the device, double-buffered staging and deferred host copies,
    with CUDA graphs, change no token. (float32: a sequence that stopped computes one more
    step under async scheduling, so later batches differ, and bf16 rounding depends on the
    batch. Preemption under async scheduling is covered on the CPU.)"""
    save_tiny_llama(tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 200, (24,), generator=gen)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=30, n=2),
              SamplingParams(temperature=1.0, seed=4, max_tokens=30, repetition_penalty=1.2, logprobs=3),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[7, 11, 13])]
    runs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", num_blocks=512,
                                        max_num_seqs=32, max_num_batched_tokens=256,
                                        async_scheduling=async_scheduling))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params[i % len(params)])
        tokens: dict[tuple[str, int], list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        assert engine.blocks.num_free == engine.blocks.num_blocks
        runs.append(tokens)
    assert runs[0] == runs[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpu_ranks_match_one(tmp_path, dtype):
    """Tensor parallelism over NCCL: the same greedy tokens, logits within the dtype's noise."""
    save_tiny_llama(tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in (9, 60, 150, 300)]
    runs = []
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype=dtype, num_blocks=256,
                                        max_num_seqs=32, max_num_batched_tokens=256, tensor_parallel_size=size))
        try:
            logits = engine.prompt_logits(prompts[2])
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            tokens = {}
            while engine.has_unfinished():
                for o in engine.step():
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        finally:
            engine.close()
        runs.append((logits.cpu(), tokens))
    tolerance = 1e-3 if dtype == "float32" else 5e-2
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=tolerance, rtol=tolerance)
    if dtype == "float32":
        assert runs[1][1] == runs[0][1]


def test_async_scheduling_is_on_by_default_on_a_gpu(tmp_path):
    save_tiny_llama(tmp_path)
    assert engine_for(tmp_path, "float32").config.async_scheduling is True


def test_a_gpu_engine_takes_4096_token_steps_unless_given_a_budget(tmp_path):
    save_tiny_llama(tmp_path, max_position_embeddings=4096)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", num_blocks=256,
                                    max_num_seqs=32))
    assert engine.config.max_num_batched_tokens == 4096
    engine.add_request("long", [i % 512 for i in range(3000)], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert engine.last_plan.num_tokens == 3000      # the whole prompt in one step, not 2048 + 952


COUNT_COMPILES_IN_STEPS = """
import sys, torch, triton
from common.sampling_params import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine

engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cuda", dtype=sys.argv[2], num_blocks=256,
                                max_num_seqs=32, max_num_batched_tokens=256))
compiled = []
triton.knobs.runtime.jit_cache_hook = lambda *, repr, **_: compiled.append(repr)
gen = torch.Generator().manual_seed(9)
lengths = iter([2, 3, 5, 17, 40, 200, 700, 900, 4, 1, 64, 300])
tokens = 0
while engine.has_unfinished() or tokens == 0:
    n = next(lengths, None)      # one new request per step while they last: every mix of steps
    if n is not None:
        engine.add_request(str(n), torch.randint(0, 512, (n,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=min(60, 1000 - n), ignore_eos=True))
    tokens += sum(len(o.new_token_ids) for o in engine.step())
print(tokens, len(compiled))
print(*compiled, sep="\\n")
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serving_steps_compile_no_kernels_after_startup(tmp_path, dtype):
    """A kernel compiled inside the step loop stalls every running request for a second or
    more: startup compiles every variant the steps use. A fresh process, so no other test's
    compiles count."""
    save_tiny_llama(tmp_path)
    result = subprocess.run([sys.executable, "-c", COUNT_COMPILES_IN_STEPS, str(tmp_path), dtype],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts, *names = result.stdout.splitlines()
    tokens, compiles = map(int, counts.split())
    assert tokens > 0
    assert compiles == 0, names


@pytest.mark.gpu
def test_structured_outputs_on_the_gpu_follow_their_schema_beside_free_rows(tmp_path):
    """Asynchronous scheduling with grammars: each constrained step launches its forward, reads
    the step before it, masks and samples; free rows in the same batches are drawn as if alone."""
    import json

    import jsonschema

    from common.sampling_params import StructuredOutput
    save_tiny_llama(tmp_path, vocab_size=512)
    save_byte_level_tokenizer(tmp_path, vocab_size=512)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "n", "tags"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}}    # compact: a random model must end it
    # ignore_eos: the random model's config names an end token the trained tokenizer does not
    # have; the grammar ends each output.
    constrained = SamplingParams(temperature=1.0, max_tokens=120, seed=1, ignore_eos=True,
                                 structured_output=StructuredOutput("json_schema", json.dumps(schema)))
    free = SamplingParams(temperature=1.0, max_tokens=40, seed=2, ignore_eos=True)
    prompt = list(range(10, 30))
    engine = engine_for(tmp_path, "bfloat16")
    assert engine.config.async_scheduling
    alone = generate(engine, [prompt], free)["r0"]
    mixed = generate(engine, [prompt] * 9, [free] + [constrained] * 8)
    assert mixed["r0"] == alone
    tokenizer = engine.grammars._load_tokenizer()
    for rid in list(mixed)[1:]:
        jsonschema.validate(json.loads(tokenizer.decode(mixed[rid][0], skip_special_tokens=True)), schema)


def test_requests_whose_constraints_allow_no_token_fail_on_the_gpu_and_free_rows_run_on(tmp_path):
    """Asynchronous scheduling with graphs: the step after an impossible draw is already launched
    with the row's (valid) device token; the request fails when the draw is read."""
    from worker.sequence import FinishReason
    save_tiny_llama(tmp_path)
    engine = engine_for(tmp_path, "bfloat16")
    assert engine.config.async_scheduling and engine.runner.graphs is not None
    free = SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)
    # The stop token is banned until min_tokens, and it is the only token allowed.
    stuck = SamplingParams(temperature=1.0, max_tokens=24, min_tokens=4, stop_token_ids=[7], allowed_token_ids=[7])
    prompt = list(range(40, 60))
    alone = generate(engine, [prompt], free)["r0"]
    outputs = {}
    for i, params in enumerate([free, stuck, free, stuck]):
        engine.add_request(f"r{i}", prompt, params)
        outputs[f"r{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    for rid in ("r1", "r3"):
        [failed] = outputs[rid]
        assert failed.finish_reason == FinishReason.ERROR and "allowed_token_ids, min_tokens" in failed.error
    for rid in ("r0", "r2"):
        assert [t for out in outputs[rid] for t in out.new_token_ids] == alone[0]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_allowed_token_ids_on_the_gpu_bound_each_rows_draws_and_leave_free_rows_alone(tmp_path):
    """Each row's allowed ids are a device tensor made once (`Sequence.allowed_ids`) and joined
    per step: rows with different sets, and rows without, share asynchronous graph steps."""
    save_tiny_llama(tmp_path)
    engine = engine_for(tmp_path, "bfloat16")
    assert engine.config.async_scheduling and engine.runner.graphs is not None
    free = SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)
    sets = [[3, 9, 27], list(range(100, 400, 7)), [11]]
    bounded = [SamplingParams(temperature=1.0, max_tokens=24, seed=6 + i, ignore_eos=True, allowed_token_ids=ids)
               for i, ids in enumerate(sets)]
    prompt = list(range(40, 60))
    alone = generate(engine, [prompt], free)["r0"]
    mixed = generate(engine, [prompt] * 4, [bounded[0], free, bounded[1], bounded[2]])
    assert mixed["r1"] == alone
    for rid, ids in zip(("r0", "r2", "r3"), sets):
        [tokens] = mixed[rid]
        assert len(tokens) == 24 and set(tokens) <= set(ids), (rid, tokens)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_decoding_with_pdl_changes_no_token(tmp_path, monkeypatch):
    """The decode kernels launched with programmatic dependent launch (`kernels.pdl`, on by
    default on Hopper) give the tokens they give without it, in CUDA graphs and eagerly."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0+")
    save_tiny_llama(tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 200, (8,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("PAGEDSERVE_PDL", pdl)
        for eager in (True, False):
            engine = engine_for(tmp_path, "bfloat16", enforce_eager=eager)
            # One request alone (the one-row GEMVs), then eight at once (the tensor-core tiles).
            outputs[pdl, eager] = (generate(engine, prompts[:1], params), generate(engine, prompts, params))
    assert outputs["1", False] == outputs["0", False]
    assert outputs["1", True] == outputs["0", True]
