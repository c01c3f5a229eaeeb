"""Engine-level stress scenarios, shared by the CPU suite (tests/test_engine_stress.py, small
sizes) and the GPU suite (tests/test_gpu_stress.py, serving sizes). Not tests themselves.

Every scenario takes `make(**engine_settings) -> LLMEngine` (a factory whose own defaults
fix the model, device, dtype and the configuration under test: async scheduling, CUDA
graphs) plus its sizes, drives `LLMEngine` directly, asserts, and leaves every engine it built
clean: no sequence anywhere, every device block and every host swap block free
(`assert_clean`). Output equality is only asserted where the caller says the numbers are
exact enough for greedy decoding to be batch-invariant (fp32); otherwise a scenario checks
lengths, finish reasons and the pool.

`check_block_ownership` states the pool's design rule and can run between any two steps:
every device block is owned by running sequences (its ref_count is how many), or is free
(possibly still holding cached prefix contents); a swapped sequence holds host swap blocks
only; a waiting sequence holds no blocks at all.
"""

import gc
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from common.sampling_params import SamplingParams, choice_seed
from worker.engine import LLMEngine
from worker.sequence import FinishReason, SeqStatus

Make = Callable[..., LLMEngine]
Key = tuple[str, int]           # (request id, choice index)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    """Greedy and blind to EOS: a random model's EOS must not end a request early."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def doubling_lengths(start: int, top: int) -> list[int]:
    """start, 2 start, 4 start, ... below `top`, then `top` itself."""
    lengths, n = [], start
    while n < top:
        lengths.append(n)
        n *= 2
    return lengths + [top]


def release(engine: LLMEngine) -> None:
    """Frees the engine's KV pool now. Engines built over shared weights leave views of their
    pool in the model's attention layers, which would keep it alive (and make the next
    engine's GPU memory profile find no room for its own pool). Those layers are shared:
    release an engine before building the next, never after."""
    engine.close()
    runner = engine.runner
    for layer in runner.model.layers:
        layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
    runner.kv_cache = runner.swap_cache = runner.graphs = None
    if runner.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- invariants

def _describe(engine: LLMEngine) -> str:
    return f"engine.stats() = {engine.stats()}"


def check_block_ownership(engine: LLMEngine) -> None:
    """Asserts the pool's ownership rule (between steps):

    * each sequence in a scheduler queue belongs to a live request and has that queue's status,
      and each unfinished sequence of a live request is in the queue of its status, once;
    * a RUNNING sequence's block table covers its computed tokens, without repeats;
    * a SWAPPED sequence holds no device blocks, and host swap blocks covering its computed
      tokens; the swapped sequences' host blocks and the swap pool's free list partition the
      swap pool;
    * a WAITING sequence holds no blocks (device or host);
    * a FINISHED sequence holds no blocks;
    * every device block's ref_count equals the number of block tables that hold it; a block is
      in the free list exactly when its ref_count is 0; a prefix-cache entry names a block that
      carries that hash.

    Every violation found is reported together, with the engine's stats."""
    sched, blocks = engine.scheduler, engine.blocks
    problems: list[str] = []
    queues = {SeqStatus.RUNNING: sched.running, SeqStatus.WAITING: sched.waiting,
              SeqStatus.SWAPPED: sched.swapped}
    live = {id(s): s for seqs in engine.requests.values() for s in seqs}
    queued: dict[int, object] = {}
    for status, queue in queues.items():
        for seq in queue:
            name = f"{seq.request_id}/{seq.index}"
            if id(seq) in queued:
                problems.append(f"{name} is in more than one queue slot")
            queued[id(seq)] = seq
            if seq.status != status:
                problems.append(f"{name} is in the {status.value} queue with status {seq.status.value}")
            if id(seq) not in live:
                problems.append(f"{name} is in the {status.value} queue but its request is gone")
    for seq in live.values():
        if seq.status != SeqStatus.FINISHED and id(seq) not in queued:
            problems.append(f"{seq.request_id}/{seq.index} is {seq.status.value} but in no queue")

    refs: Counter[int] = Counter()
    for seq in {**live, **queued}.values():
        name = f"{seq.request_id}/{seq.index} ({seq.status.value})"
        refs.update(seq.block_table)
        if seq.status == SeqStatus.RUNNING:
            if len(set(seq.block_table)) != len(seq.block_table):
                problems.append(f"{name} holds a block twice: {seq.block_table}")
            if len(seq.block_table) < blocks.blocks_needed(seq.num_computed):
                problems.append(f"{name} has {seq.num_computed} computed tokens but only "
                                f"{len(seq.block_table)} blocks")
            if seq.swap_blocks:
                problems.append(f"{name} holds host swap blocks {seq.swap_blocks}")
        elif seq.status == SeqStatus.SWAPPED:
            if seq.block_table:
                problems.append(f"{name} holds device blocks {seq.block_table}")
            if len(seq.swap_blocks) < blocks.blocks_needed(seq.num_computed):
                problems.append(f"{name} has {seq.num_computed} computed tokens but only "
                                f"{len(seq.swap_blocks)} swap blocks")
        elif seq.block_table or seq.swap_blocks:    # WAITING or FINISHED
            problems.append(f"{name} holds device blocks {seq.block_table} and swap blocks "
                            f"{seq.swap_blocks} (rule: a {seq.status.value} sequence holds no blocks)")

    for block in blocks.blocks:
        in_free = block.block_id in blocks.free
        if block.ref_count != refs[block.block_id]:
            problems.append(f"block {block.block_id}: ref_count {block.ref_count}, but "
                            f"{refs[block.block_id]} block tables hold it")
        if in_free != (block.ref_count == 0):
            problems.append(f"block {block.block_id}: ref_count {block.ref_count}, "
                            f"{'in' if in_free else 'not in'} the free list")
    for h, block_id in blocks.cached.items():
        if blocks.blocks[block_id].hash != h:
            problems.append(f"prefix cache entry {h} names block {block_id}, which carries "
                            f"hash {blocks.blocks[block_id].hash}")

    held = [b for s in sched.swapped for b in s.swap_blocks]
    counts = Counter(held + engine.swap_pool.free)
    every = set(range(engine.swap_pool.num_blocks))
    twice = sorted(b for b, c in counts.items() if c > 1)
    lost, unknown = sorted(every - counts.keys()), sorted(counts.keys() - every)
    if twice or lost or unknown:
        problems.append(f"swap pool of {len(every)} blocks: {len(held)} held by swapped sequences, "
                        f"{engine.swap_pool.num_free} free; held or free twice: {twice[:10]}, "
                        f"neither: {lost[:10]}, unknown: {unknown[:10]}")
    assert not problems, "block ownership broken:\n  " + "\n  ".join(problems[:20]) + \
        (f"\n  ... {len(problems) - 20} more" if len(problems) > 20 else "") + f"\n{_describe(engine)}"


def assert_clean(engine: LLMEngine, what: str = "") -> None:
    """After a scenario: nothing left anywhere, every device and host block free."""
    where = f"{what}: " if what else ""
    sched = engine.scheduler
    assert not engine.has_unfinished(), f"{where}requests left {list(engine.requests)}; {_describe(engine)}"
    assert not (sched.running or sched.waiting or sched.swapped), \
        f"{where}sequences left in the scheduler; {_describe(engine)}"
    assert engine.blocks.num_free == engine.blocks.num_blocks, f"{where}device blocks leaked; {_describe(engine)}"
    assert all(b.ref_count == 0 for b in engine.blocks.blocks), f"{where}a block kept a reference"
    assert engine.swap_pool.num_free == engine.swap_pool.num_blocks, \
        f"{where}host swap blocks leaked; {_describe(engine)}"


# ---------------------------------------------------------------- driving an engine

@dataclass
class Driver:
    """Feeds requests to an engine and steps it, recording every choice's tokens and finish
    reason and checking, at every step, that the step kept to the token budget, that nothing
    is reported for a finished or aborted choice, and (with `check`) block ownership.
    More than `limit` calls of `step()` is a stall: it fails, naming the engine's stats."""
    engine: LLMEngine
    limit: int
    check: bool = True
    what: str = ""
    tokens: dict[Key, list[int]] = field(default_factory=dict)
    finish: dict[Key, FinishReason] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)     # request id -> num_cached_tokens
    aborted: set[str] = field(default_factory=set)
    params: dict[str, SamplingParams] = field(default_factory=dict)
    iterations: int = 0

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params)
        self.params[request_id] = params
        for index in range(params.n):
            self.tokens[(request_id, index)] = []

    def abort(self, request_id: str) -> None:
        assert self.engine.abort(request_id), f"{self.what}: {request_id} had already finished"
        self.aborted.add(request_id)

    def step(self) -> list:
        engine = self.engine
        outputs = engine.step()
        self.iterations += 1
        assert engine.last_plan.num_tokens <= engine.config.max_num_batched_tokens, \
            f"{self.what}: a step scheduled {engine.last_plan.num_tokens} tokens"
        for out in outputs:
            key = (out.request_id, out.index)
            assert out.request_id not in self.aborted, f"{self.what}: {key} reported a token after its abort"
            assert key in self.tokens, f"{self.what}: unknown choice {key}"
            assert key not in self.finish, f"{self.what}: {key} reported a token after finishing"
            self.tokens[key] += out.new_token_ids
            self.cached[out.request_id] = out.num_cached_tokens
            if out.finish_reason is not None:
                self.finish[key] = out.finish_reason
        if self.check:
            check_block_ownership(engine)
        assert self.iterations <= self.limit, (
            f"{self.what}: stalled: {self.iterations} steps, more than the limit of {self.limit}, "
            f"{sum(map(len, self.tokens.values()))} tokens out; {_describe(engine)}")
        return outputs

    def run(self) -> "Driver":
        """Steps until the engine is idle, then checks that every choice not aborted finished
        and that the engine is clean."""
        while self.engine.has_unfinished():
            self.step()
        unfinished = [k for k in self.tokens if k[0] not in self.aborted and k not in self.finish]
        assert not unfinished, f"{self.what}: engine idle but {unfinished[:8]} never finished"
        assert_clean(self.engine, self.what)
        return self

    def survivors(self) -> dict[Key, list[int]]:
        return {k: v for k, v in self.tokens.items() if k[0] not in self.aborted}


def step_limit(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> int:
    """Twice the steps of serving the requests one after another, whole chunks at a time: any
    run without preemption is faster, so a run slower than this has stalled."""
    budget = engine.config.max_num_batched_tokens
    serial = sum(p.n * (math.ceil(len(prompt) / budget) + p.max_tokens) for prompt, p in requests)
    return 2 * serial + 16


# ---------------------------------------------------------------- scenarios

def lone_long_prompts(make: Make, lengths: list[int], *, max_tokens: int = 8, seed: int = 0,
                      check: bool = True) -> dict[int, list[int]]:
    """Each prompt alone on a fresh engine, prefilled in budget-sized chunks, then decoded:
    proves a prompt of every length up to the top (the model's limit, for the GPU) is
    prefilled without error and without overrunning the pool or the step budget, generates
    exactly `max_tokens` tokens, and leaves the pool clean. Returns the tokens per length."""
    results = {}
    for length in lengths:
        engine = make()
        what = f"lone prompt of {length} tokens"
        assert length + max_tokens <= engine.max_model_len, (
            f"{what}: {length} + {max_tokens} tokens do not fit max_model_len {engine.max_model_len} "
            f"({engine.blocks.num_blocks} blocks of {engine.config.block_size})")
        prompt = random_prompt(random.Random(seed + length), length, engine.vocab_size)
        params = greedy(max_tokens)
        drv = Driver(engine, step_limit(engine, [(prompt, params)]), check, what)
        drv.add("long", prompt, params)
        drv.run()
        tokens = drv.tokens[("long", 0)]
        assert len(tokens) == max_tokens and drv.finish[("long", 0)] == FinishReason.LENGTH, \
            (what, len(tokens), drv.finish)
        results[length] = tokens
        release(engine)
    return results


def long_prompts_while_decoding(make: Make, lengths: list[int], num_decoders: int, *,
                                max_tokens: int = 8, decoder_prompt_len: int = 32, seed: int = 0,
                                exact: bool = True, check: bool = True) -> None:
    """A long prompt arrives while `num_decoders` requests decode: its chunks share every step
    with the decodes. Proves the decodes keep going during the whole prefill (a token per
    step: chunked prefill does not starve them), everything completes at full length, and the
    pool is clean; with `exact` (fp32), that the long prompt's tokens equal its tokens alone
    and the decoders' tokens equal theirs without it."""
    alone = lone_long_prompts(make, lengths, max_tokens=max_tokens, seed=seed, check=False) if exact else {}
    for length in lengths:
        engine = make()
        budget = engine.config.max_num_batched_tokens
        assert budget > num_decoders, f"a step budget of {budget} leaves no room for a prefill chunk"
        # The decoders must outlast the prefill, whose chunks the long-prefill threshold caps.
        chunk = budget - num_decoders
        if engine.config.long_prefill_token_threshold:
            chunk = min(chunk, engine.config.long_prefill_token_threshold)
        prefill_steps = math.ceil(length / chunk)
        decode_params = greedy(prefill_steps + 16)
        rng = random.Random(seed + 7 * length)
        decoders = [random_prompt(rng, decoder_prompt_len, engine.vocab_size) for _ in range(num_decoders)]
        long = random_prompt(random.Random(seed + length), length, engine.vocab_size)
        room = engine.blocks.num_blocks * engine.config.block_size
        need = length + max_tokens + num_decoders * (decoder_prompt_len + decode_params.max_tokens + 16)
        assert need <= room, f"the pool holds {room} tokens, the scenario needs {need}"
        what = f"prompt of {length} tokens among {num_decoders} decoders"
        limit = step_limit(engine, [(p, decode_params) for p in decoders] + [(long, greedy(max_tokens))])
        drv = Driver(engine, limit, check, what)
        for i, p in enumerate(decoders):
            drv.add(f"d{i}", p, decode_params)
        while not all(drv.tokens[(f"d{i}", 0)] for i in range(num_decoders)):
            drv.step()                      # every decoder past its prompt
        drv.add("long", long, greedy(max_tokens))
        seq = engine.requests["long"][0]
        before = [len(drv.tokens[(f"d{i}", 0)]) for i in range(num_decoders)]
        prefill_iterations = 0
        while seq.num_computed < length:
            drv.step()
            prefill_iterations += 1
        gained = [len(drv.tokens[(f"d{i}", 0)]) - b for i, b in enumerate(before)]
        if prefill_iterations >= 3:         # a shorter prefill proves nothing about starving
            # A decode per step; one step of slack for async scheduling's late report.
            assert min(gained) >= prefill_iterations - 2, \
                f"{what}: decoders got {gained} tokens during a {prefill_iterations}-step prefill"
        drv.run()
        release(engine)
        assert len(drv.tokens[("long", 0)]) == max_tokens, (what, drv.tokens[("long", 0)])
        assert all(len(drv.tokens[(f"d{i}", 0)]) == decode_params.max_tokens for i in range(num_decoders)), what
        if exact:
            assert drv.tokens[("long", 0)] == alone[length], f"{what}: its tokens differ from the run alone"
            reference = make()
            ref = Driver(reference, limit, False, f"{what}, reference")
            for i, p in enumerate(decoders):
                ref.add(f"d{i}", p, decode_params)
            ref.run()
            release(reference)
            assert drv.survivors() == {**ref.tokens, ("long", 0): alone[length]}, \
                f"{what}: the decoders' tokens differ from their run without the long prompt"


def aborts(make: Make, batch_size: int, *, long_len: int | None = None, max_tokens: int = 24,
           seed: int = 0, exact: bool = True, check: bool = True) -> None:
    """`batch_size` requests decode; a long prompt joins and is aborted after its first
    chunk (mid-prefill), and every third decoder is aborted at a staggered point of its
    decode. Proves an abort frees everything the request held wherever it was (pool clean,
    ownership intact at every step), nothing is reported for an aborted request afterwards,
    and (with `exact`) that the survivors generate exactly what they generate without the
    aborted requests."""
    engine = make()
    budget = engine.config.max_num_batched_tokens
    long_len = long_len or 3 * budget
    assert budget < long_len < engine.max_model_len, "the long prompt must span several chunks"
    rng = random.Random(seed + batch_size)
    prompts = [random_prompt(rng, rng.randint(8, 64), engine.vocab_size) for _ in range(batch_size)]
    long = random_prompt(rng, long_len, engine.vocab_size)
    params = greedy(max_tokens)
    # Decoder i (i % 3 == 0) is aborted once it has reported this many tokens.
    abort_after = {f"d{i}": 1 + (i // 3) % (max_tokens - 2) for i in range(0, batch_size, 3)}
    what = f"aborts in a batch of {batch_size}"
    limit = step_limit(engine, [(p, params) for p in prompts] + [(long, params)])
    drv = Driver(engine, limit, check, what)
    for i, p in enumerate(prompts):
        drv.add(f"d{i}", p, params)
    drv.step()
    drv.add("long", long, params)
    long_seq = engine.requests["long"][0]
    while engine.has_unfinished():
        drv.step()
        if "long" not in drv.aborted and long_seq.num_computed > 0:
            assert long_seq.num_computed < long_len, f"{what}: the long prompt was not chunked"
            drv.abort("long")
        for rid, after in abort_after.items():
            if rid not in drv.aborted and len(drv.tokens[(rid, 0)]) >= after:
                drv.abort(rid)
    drv.run()
    assert drv.aborted == {"long", *abort_after}, f"{what}: aborted only {sorted(drv.aborted)}"
    survivors = [i for i in range(batch_size) if f"d{i}" not in abort_after]
    assert all(len(drv.tokens[(f"d{i}", 0)]) == max_tokens for i in survivors), what
    release(engine)
    if exact and survivors:
        reference = make()
        ref = Driver(reference, limit, False, f"{what}, reference without the aborted")
        for i in survivors:
            ref.add(f"d{i}", prompts[i], params)
        ref.run()
        release(reference)
        assert drv.survivors() == ref.tokens, f"{what}: survivors' tokens differ from a run without the aborted"


def n_choices(make: Make, *, num_requests: int = 12, max_tokens: int = 16, seed: int = 0,
              check: bool = True) -> None:
    """Requests with n = 2..5 seeded sampled choices, and greedy ones with n = 3, in one batch.
    Proves forking shares the prompt correctly: each choice equals a single request with the
    choice's seed (`choice_seed`), greedy choices are identical to each other and to a single
    greedy request, every choice runs to max_tokens, and the pool ends clean."""
    engine = make()
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(5, 90), engine.vocab_size) for _ in range(num_requests)]
    params = [greedy(max_tokens, n=3) if i % 4 == 3 else
              SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
                             ignore_eos=True, n=2 + i % 4)
              for i in range(num_requests)]
    what = f"{num_requests} requests with n > 1"
    drv = Driver(engine, step_limit(engine, list(zip(prompts, params))), check, what)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        drv.add(f"r{i}", p, sp)
    drv.run()
    assert all(len(t) == max_tokens for t in drv.tokens.values()), what
    release(engine)

    reference = make()
    singles = [(f"r{i}", index, prompts[i], SamplingParams(
        **{**vars(sp), "n": 1, "seed": None if sp.seed is None else choice_seed(sp.seed, index)}))
        for i, sp in enumerate(params) for index in range(sp.n)]
    ref = Driver(reference, step_limit(reference, [(p, sp) for *_, p, sp in singles]), False, f"{what}, singles")
    for rid, index, p, sp in singles:
        ref.add(f"{rid}.{index}", p, sp)
    ref.run()
    release(reference)
    assert drv.tokens == {(rid, index): ref.tokens[(f"{rid}.{index}", 0)] for rid, index, *_ in singles}, \
        f"{what}: choices differ from single requests with the choices' seeds"
    for i, sp in enumerate(params):
        if sp.greedy:
            assert len({tuple(drv.tokens[(f"r{i}", j)]) for j in range(sp.n)}) == 1, f"{what}: r{i}"
    assert drv.tokens[("r0", 0)] != drv.tokens[("r0", 1)], f"{what}: r0's sampled choices are alike"


def prefix_cache(make: Make, *, num_requests: int = 16, prefix_len: int = 300, max_tokens: int = 12,
                 seed: int = 0, check: bool = True) -> None:
    """Many requests share a long prefix. One is prefilled first; the rest arrive together
    (its blocks are running), then a last few arrive once all have finished (its blocks are
    free but still cached). Proves every later request is served the prefix's full blocks
    from the cache (prefix_hits, num_cached_tokens), shared blocks are reference-counted
    right at every step, and the tokens equal a run with enable_prefix_caching=False."""
    runs = {}
    for caching in (True, False):
        engine = make(enable_prefix_caching=caching)
        bs = engine.config.block_size
        rng = random.Random(seed)
        prefix = random_prompt(rng, prefix_len, engine.vocab_size)
        prompts = [prefix + random_prompt(rng, rng.randint(1, 40), engine.vocab_size) for _ in range(num_requests)]
        params = greedy(max_tokens)
        # Room for all requests without sharing: then no free block that still holds the
        # prefix is taken (evicted) before the last request arrives.
        need = sum(engine.blocks.blocks_needed(len(p) + max_tokens) for p in prompts)
        assert engine.blocks.num_blocks >= need, f"prefix_cache needs a pool of {need} blocks"
        what = f"shared prefix of {prefix_len} tokens, caching {'on' if caching else 'off'}"
        drv = Driver(engine, step_limit(engine, [(p, params) for p in prompts]), check, what)
        last_wave = max(2, num_requests // 4)
        drv.add("r0", prompts[0], params)
        while not drv.tokens[("r0", 0)]:
            drv.step()                       # r0's prompt is computed and its blocks hashed
        for i in range(1, num_requests - last_wave):
            drv.add(f"r{i}", prompts[i], params)
        while engine.has_unfinished():
            drv.step()
        for i in range(num_requests - last_wave, num_requests):
            drv.add(f"r{i}", prompts[i], params)
        drv.run()
        later = [f"r{i}" for i in range(1, num_requests)]
        shared_blocks = prefix_len // bs
        if caching:
            assert engine.blocks.prefix_hits >= len(later) * shared_blocks, \
                f"{what}: {engine.blocks.prefix_hits} prefix hits, expected {len(later)} x {shared_blocks}"
            short = {r: drv.cached[r] for r in later if drv.cached[r] < shared_blocks * bs}
            assert not short, f"{what}: requests served fewer cached tokens than the prefix: {short}"
        else:
            assert engine.blocks.prefix_hits == 0 and not any(drv.cached.values()), what
        assert all(len(t) == max_tokens for t in drv.tokens.values()), what
        runs[caching] = drv.tokens
        release(engine)
    assert runs[True] == runs[False], "tokens with the prefix cache differ from tokens without it"


def stop_tokens(make: Make, *, num_requests: int = 24, max_tokens: int = 24, seed: int = 0,
                check: bool = True) -> None:
    """Greedy requests whose stop_token_ids are tokens their free run generates (at every
    position from the first to the last), or that it never generates. Proves each stops right
    after the first stop token with reason STOP, or runs to max_tokens with LENGTH, that the
    early finishers free their blocks at once without disturbing the others (their tokens
    equal the free run's), and the pool ends clean."""
    engine = make()
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(4, 120), engine.vocab_size) for _ in range(num_requests)]
    free_params = greedy(max_tokens)
    free = Driver(engine, step_limit(engine, [(p, free_params) for p in prompts]), check, "free run")
    for i, p in enumerate(prompts):
        free.add(f"r{i}", p, free_params)
    free.run()
    release(engine)

    expected, params = {}, []
    for i in range(num_requests):
        ref = free.tokens[(f"r{i}", 0)]
        if i % 5 == 4:      # a stop token it never generates
            stops = [next(t for t in range(engine.vocab_size) if t not in ref)]
            expected[f"r{i}"] = (ref, FinishReason.LENGTH)
        else:               # the token at position i % max_tokens, and one more after it
            stops = [ref[i % max_tokens]] + ref[i % max_tokens + 1:][:1]
            end = min(ref.index(t) for t in stops) + 1
            expected[f"r{i}"] = (ref[:end], FinishReason.STOP)
        params.append(greedy(max_tokens, stop_token_ids=stops))
    engine = make()
    drv = Driver(engine, step_limit(engine, list(zip(prompts, params))), check, "stop tokens")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        drv.add(f"r{i}", p, sp)
    drv.run()
    release(engine)
    got = {rid: (drv.tokens[(rid, 0)], drv.finish[(rid, 0)]) for rid, _ in drv.params.items()}
    wrong = {rid: (got[rid], expected[rid]) for rid in expected if got[rid] != expected[rid]}
    assert not wrong, f"stop tokens: (got, expected) {wrong}"


@dataclass
class StormResult:
    roomy_steps: int
    tight_steps: int
    preemptions: dict[str, int]


def preemption_storm(make: Make, *, mode: str, num_swap_blocks: int | str = "ample",
                     num_requests: int = 24, max_prompt_len: int = 96, max_tokens: int = 48,
                     shared_prefix_len: int = 32, seed: int = 0, steps_factor: int = 20,
                     same_tokens: bool = True) -> StormResult:
    """Many concurrent requests in a pool just one block larger than the longest request, so
    running requests preempt each other again and again (preemption_mode `mode`; for swap a
    swap pool of `num_swap_blocks`, an int, "small" (half the longest request's blocks: the
    longer victims fall back to recompute) or "ample" (every request fits)). Every other request starts with the same
    `shared_prefix_len` tokens (a system prompt), so the prefix cache is under pressure too.
    Block ownership is checked after every step. Proves the storm finishes within
    `steps_factor` x the steps of a roomy run (no livelock or stall), generates exactly the
    roomy run's tokens (greedy, fp32: swap-out, swap-in, recomputation and cache hits restore
    the same K/V), and leaves both pools clean. `same_tokens` False drops the token check, for
    pools whose K/V are rounded (a float8 pool: a last-bit difference of a batch-dependent GEMM
    can round a value the other way, so greedy tokens may part)."""
    rng = random.Random(seed)
    # One prompt of the maximum length, the others mostly short: many are admitted at once,
    # then their generations outgrow the pool.
    lengths = [max_prompt_len if i == 0 else rng.randint(4, max_prompt_len // (1 if i % 4 == 0 else 3))
               for i in range(num_requests)]
    # Room for every request at once, whatever the block size (8 is the smallest).
    roomy = make(num_blocks=sum(-(-(n + max_tokens) // 8) for n in lengths))
    bs = roomy.config.block_size
    prefix = random_prompt(rng, shared_prefix_len, roomy.vocab_size)
    prompts = [random_prompt(rng, n, roomy.vocab_size) if i % 2 == 0 else
               (prefix + random_prompt(rng, n, roomy.vocab_size))[:max(n, shared_prefix_len + 1)]
               for i, n in enumerate(lengths)]
    assert max(map(len, prompts)) == max_prompt_len
    params = greedy(max_tokens)
    longest_blocks = -(-(max_prompt_len + max_tokens) // bs)
    swap = {"ample": roomy.blocks.num_blocks, "small": longest_blocks // 2}.get(num_swap_blocks, num_swap_blocks)

    ref = Driver(roomy, step_limit(roomy, [(p, params) for p in prompts]), False, "roomy run")
    for i, p in enumerate(prompts):
        ref.add(f"r{i}", p, params)
    ref.run()
    assert sum(roomy.scheduler.num_preemptions.values()) == 0, "the roomy run was preempted"
    release(roomy)

    engine = make(num_blocks=longest_blocks + 1, preemption_mode=mode, num_swap_blocks=swap)
    what = f"preemption storm ({mode}, {swap} swap blocks, {longest_blocks + 1} device blocks)"
    drv = Driver(engine, steps_factor * ref.iterations, True, what)
    for i, p in enumerate(prompts):
        drv.add(f"r{i}", p, params)
    drv.run()
    preemptions = dict(engine.scheduler.num_preemptions)
    release(engine)
    assert not same_tokens or drv.tokens == ref.tokens, (
        f"{what}: tokens differ from the roomy run's for "
        f"{sorted(k[0] for k in ref.tokens if drv.tokens[k] != ref.tokens[k])}")
    # The storm must have happened, in the modes asked for.
    if mode == "recompute":
        assert preemptions["recompute"] > 0 and preemptions["swap"] == 0, (what, preemptions)
    else:
        assert preemptions["swap"] > 0, (what, preemptions)
        if num_swap_blocks == "small":
            assert preemptions["recompute"] > 0, f"{what}: no preemption fell back to recompute"
    return StormResult(ref.iterations, drv.iterations, preemptions)
