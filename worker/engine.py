"""The step-level engine: requests in, one scheduling iteration per `step()`, token deltas out.

Asynchronous scheduling (on by default on GPUs): `step()` schedules and launches step N+1 while step
N still runs on the device, then reads step N's draws. Sequences that step N draws for are
scheduled with that token *pending* (read on the device by step N+1), so the GPU never waits
for the host. The price: stop tokens are seen one step late, so a sequence that stopped
computes one more token, which is thrown away. A step whose sampling needs the pending
tokens on the host (repetition penalties count them) reads them first. A step with rows
under a grammar (structured outputs) launches its forward first, then reads the step before
it and computes the grammar masks on the host while the forward runs: only the sampling
waits for them, and rows without a grammar are drawn in the same batch.

Prompt logprobs come out of the prefill the request runs anyway: each prompt chunk's forward
also computes the logprobs of the prompt tokens its positions predict, read with the step.
A prompt asking for them takes from the prefix cache only the part already scored (none,
unless preempted mid-prefill); one with max_tokens 0 ends once the step of its last chunk is
read, without drawing.

Not thread-safe: one thread drives it (the worker server queues RPC commands to that thread).
"""

import functools
import logging
import random
import time
from dataclasses import dataclass, field

import numpy as np

from common.sampling_params import InvalidRequest, SamplingParams, choice_seed
from worker.config import EngineConfig
from worker.kv_pool import BlockManager, SwapPool
from worker.logits_processors import load_processors
from worker import ranks
from worker.model_runner import ModelRunner, resolve_device
from worker.models.loader import ModelSource, load_tokenizer, resolve_source
from worker.models.lora_checkpoint import read_lora_adapter
from worker.parallel import Shard
from worker import structured
from worker.sampler import (NAN_LOGITS, NO_TOKEN_ALLOWED, BadWords, PromptLogprobs, PromptScoring, SampledTokens,
                            SampleResult, SamplingBatch, SamplingRow)
from worker.scheduler import Scheduler, ScheduledSeq, SchedulerOutput
from worker.sequence import FinishReason, Sequence, SeqStatus

log = logging.getLogger("pagedserve.engine")


class LoRANotFound(InvalidRequest):
    """A request names an adapter the engine does not hold (gRPC NOT_FOUND, HTTP 404)."""


@dataclass
class RequestOutput:
    """What one step produced for one sequence (one choice of a request)."""
    request_id: str
    index: int
    new_token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Prompt logprobs the step computed (params.prompt_logprobs), continuing the earlier ones:
    # the first output's first entry is for prompt token 1; all come before the first token.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # With finish reason ERROR: what went wrong, and whether the worker is at fault (NaN logits)
    # rather than the request (constraints that rule out every token, a grammar too complex).
    error: str | None = None
    fault: bool = False


@dataclass
class EngineEvent:
    """A lifecycle change of one choice: admitted, preempted (mode swap or recompute), resumed."""
    request_id: str
    index: int
    kind: str
    mode: str | None = None


@dataclass
class InFlightStep:
    """A launched step whose results the host has not read: draw i is for `drawn[i]`; the
    prompt logprobs are for `scored`, each sequence with how many of them are its, in order."""
    sampled: SampledTokens | None
    drawn: list[Sequence]
    prompt_logprobs: PromptLogprobs | None = None
    scored: list[tuple[Sequence, int]] = field(default_factory=list)


@dataclass
class EngineStats:
    total_blocks: int
    free_blocks: int
    total_swap_blocks: int
    free_swap_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions: dict[str, int]
    prefix_queries: int
    prefix_hits: int
    steps: int
    # The LoRA adapters held: (name, path, rank, target modules, in a device slot, sequences).
    lora_adapters: list[tuple[str, str, int, list[str], bool, int]] = field(default_factory=list)
    lora_slots_in_use: int = 0
    lora_loads: int = 0                  # adapters copied into a device slot, since start
    lora_evictions: int = 0              # adapters dropped from host memory (--max-cpu-loras)


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None, loaded=None):
        """`loaded`: (ModelConfig, model) already in memory, to share weights between engines."""
        self.config = config = config.validate().for_device(resolve_device(config.device).type)
        self.source = source or resolve_source(config.model, config.load_format)
        # Ranks 1..N-1 of a tensor-parallel worker run in processes of their own.
        self.ranks = ranks.launch(config, self.source) if config.tensor_parallel_size > 1 else None
        try:
            self.runner = ModelRunner(config, self.source, loaded, self.ranks.shard if self.ranks else Shard())
        except BaseException:
            if self.ranks is not None:
                self.ranks.abandon()    # they would wait for this rank in a collective forever
            raise
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap_pool = SwapPool(self.runner.num_swap_blocks)
        self.lora = self.runner.lora
        self.scheduler = Scheduler(config, self.blocks, self.swap_pool, self.lora)
        self.requests: dict[str, list[Sequence]] = {}
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.num_steps = 0
        self.last_plan = SchedulerOutput()   # of the latest step: for metrics and traces
        self.in_flight: InFlightStep | None = None
        self.grammars = structured.Grammars(lambda: self.tokenizer, self.vocab_size)
        self.logits_processors = load_processors(config.logits_processors, self.vocab_size, self.runner.device)
        for name, path in config.lora_modules.items():
            log.info("loading LoRA adapter %r from %s", name, path)
            self.add_lora(read_lora_adapter(name, path, self.model_config, config.max_lora_rank, self.runner.dtype))

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @functools.cached_property
    def tokenizer(self):
        """The model's Hugging Face tokenizer, read on first use; None for a model without one.
        The engine reads text only to compile grammars and to tokenize bad words."""
        return load_tokenizer(self.source)

    def close(self, abandon: bool = False) -> None:
        """Stops the other ranks of a tensor-parallel worker (nothing to do otherwise);
        `abandon`: kills them instead, after a fault (they may be stuck in a collective)."""
        if self.ranks is not None:
            if abandon:
                self.ranks.abandon()
            else:
                self.ranks.close(self.runner.channel)
            self.runner.channel = self.ranks = None

    # ------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, arrival: float | None = None,
                    output_token_ids: list[int] = (), lora_name: str | None = None) -> None:
        """Queues a request; raises InvalidRequest (naming the problem) if it can never run.

        `output_token_ids`: tokens this request already generated elsewhere (a migrated
        request); generation continues after them as if it had never moved. `lora_name`: the
        LoRA adapter to run it under (one `add_lora` loaded)."""
        params.validate(self.vocab_size)
        self._check_logits_processors(params)
        adapter = self._adapter(lora_name) if lora_name else None
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty: give at least one token")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})")
        if output_token_ids and params.n != 1:
            raise InvalidRequest("a request resumed with output_token_ids must have n=1")
        if len(prompt_token_ids) + len(output_token_ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the maximum is "
                                 f"{self.max_model_len - 1} (max_model_len {self.max_model_len} "
                                 f"leaves room for at least one generated token)")
        matcher = None
        if params.structured_output is not None:
            matcher = self.grammars.matcher(params.structured_output)
            structured.consume(matcher, list(output_token_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq = Sequence(request_id=request_id, index=0, prompt_len=len(prompt_token_ids),
                       token_ids=list(prompt_token_ids) + list(output_token_ids), params=params, seed=seed,
                       priority=priority, arrival=time.monotonic() if arrival is None else arrival,
                       pending_fork=params.n > 1,
                       max_len=min(len(prompt_token_ids) + params.max_tokens, self.max_model_len),
                       bad_words=self._bad_words(params.bad_words) if params.bad_words else None,
                       matcher=matcher, lora_name=lora_name or None,
                       cache_salt=None if adapter is None else hash(("lora", adapter.load_id)))
        if adapter is not None:
            adapter.in_use += 1
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)

    def _check_logits_processors(self, params: SamplingParams) -> None:
        """Refuses a request naming a logits processor this worker did not load, or passing
        arguments one of its processors refuses."""
        for name in params.logits_processors:
            processor = self.logits_processors.get(name)
            if processor is None:
                raise InvalidRequest(f"logits_processors: {name!r} is not loaded on this worker (loaded: "
                                     f"{', '.join(self.logits_processors) or 'none'}; see --logits-processors)",
                                     "logits_processors")
            try:
                processor.validate(params.extra_args)
            except ValueError as error:
                raise InvalidRequest(f"extra_args: {error} (for logits processor {name})", "extra_args") from None

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is and frees its blocks; False if it is unknown."""
        return self._end(request_id, FinishReason.ABORT) is not None

    def _end(self, request_id: str, reason: FinishReason) -> list[Sequence] | None:
        """Finishes each unfinished choice of a request with `reason`, freeing its blocks, and
        forgets the request; returns those choices (None for a request it does not know)."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return None
        ended = [seq for seq in seqs if seq.status != SeqStatus.FINISHED]
        for seq in ended:
            self.scheduler.remove(seq)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
            self._let_go_of_adapter(seq)
        return ended

    def preempt(self, request_id: str, mode: str | None = None, hold: bool = False) -> list[str]:
        """Takes a request's running choices off the device (swap or recompute, as the pool
        allows); `hold` keeps swapped ones out until `swap_in`. Returns the modes used."""
        modes = []
        for seq in self.requests.get(request_id, ()):
            if seq.status == SeqStatus.RUNNING:
                modes.append(self.scheduler.preempt(seq, mode))
            seq.held = hold and seq.status == SeqStatus.SWAPPED
        return modes

    def swap_in(self, request_id: str) -> None:
        """Lets a request held in swap space come back as soon as the pool has room."""
        for seq in self.requests.get(request_id, ()):
            seq.held = False

    def drain_events(self) -> list[EngineEvent]:
        events, self.scheduler.events = self.scheduler.events, []
        return [EngineEvent(e.seq.request_id, e.seq.index, e.kind, e.mode) for e in events]

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.in_flight is not None

    def has_runnable(self) -> bool:
        """Whether some work could advance now: all but requests held in swap space."""
        return self.in_flight is not None or self.scheduler.has_work()

    def stats(self) -> EngineStats:
        sched = self.scheduler
        return EngineStats(
            total_blocks=self.blocks.num_blocks, free_blocks=self.blocks.num_free,
            total_swap_blocks=self.swap_pool.num_blocks, free_swap_blocks=self.swap_pool.num_free,
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
            preemptions=dict(sched.num_preemptions), prefix_queries=self.blocks.prefix_queries,
            prefix_hits=self.blocks.prefix_hits, steps=self.num_steps, **self._lora_stats())

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        return dict(lora_adapters=[(name, a.weights.path, a.weights.rank, a.weights.target_modules,
                                    a.slot is not None, a.in_use) for name, a in self.lora.adapters.items()],
                    lora_slots_in_use=self.lora.slots_in_use, lora_loads=self.lora.loads,
                    lora_evictions=self.lora.evictions)

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, and returns what the step before it generated
        (with asynchronous scheduling off: what this one generated)."""
        plan = self.last_plan = self.scheduler.schedule()
        if plan.swaps:
            self.runner.swap(plan.swaps)
        outputs = []
        if self.in_flight is not None and any(
                s.samples and s.seq.num_pending and s.seq.params.counts_output_tokens
                for s in plan.scheduled):
            outputs += self._read_in_flight()
            # Reading may have finished sequences of the plan; their blocks are gone.
            plan.scheduled = [s for s in plan.scheduled if s.seq.status == SeqStatus.RUNNING]
        launched = self._launch(plan, outputs) if plan.scheduled else None
        if self.in_flight is not None:
            outputs += self._read_in_flight()
        self.in_flight = launched
        if not self.config.async_scheduling and launched is not None:
            outputs += self._read_in_flight()
        return outputs

    def _launch(self, plan: SchedulerOutput, outputs: list[RequestOutput]) -> InFlightStep | None:
        """Starts the plan's forward and sampling on the device; each sequence that draws
        (and each choice forked from it) gets its token as pending. With rows under a grammar,
        the step in flight is read between the two (its outputs go to `outputs`)."""
        self.num_steps += 1
        rows, logits_rows, constrained = [], [], []
        for i, s in enumerate(plan.scheduled):
            if s.samples:
                draws = s.seq.params.n if s.seq.pending_fork else 1
                for index in range(draws):
                    if s.seq.matcher is not None:
                        constrained.append((len(rows), s.seq))
                    rows.append(self._sampling_row(s.seq, choice_seed(s.seq.seed, index)))
                    logits_rows.append(i)
        previous = self.in_flight.sampled if self.in_flight is not None else None
        batch = (SamplingBatch.build(rows, self.vocab_size, self.runner.device,
                                     previous.token_ids if previous is not None else None, self.logits_processors)
                 if rows else None)
        scoring, scored = self._prompt_scoring(plan.scheduled)
        logits, prompt_logprobs = self.runner.forward(plan.scheduled, logits_rows, previous, scoring)
        for seq, count in scored:
            seq.prompt_logprobs_next += count
        if constrained:
            if self.in_flight is not None:      # the tokens the grammars follow; the forward runs
                outputs += self._read_in_flight()
            batch.allowed = self.grammars.allowed([row for row, _ in constrained],
                                                  [seq.matcher for _, seq in constrained],
                                                  self.runner.device)
        sampled = self.runner.sample(logits, batch) if rows else None

        drawn = []
        for s in plan.scheduled:
            seq = s.seq
            seq.num_computed += s.num_tokens
            # One the read above finished has no blocks left; its draw keeps its row (rows and
            # draws pair by position) and is dropped when read.
            if seq.status == SeqStatus.RUNNING:
                self.blocks.register_full_blocks(seq)
            if s.samples:
                drawn += [seq] + (self._fork(seq) if seq.pending_fork else [])
        for row, seq in enumerate(drawn):
            seq.num_pending += 1
            seq.pending_row = row
        return InFlightStep(sampled, drawn, prompt_logprobs, scored) if drawn or scored else None

    @staticmethod
    def _prompt_scoring(scheduled: list[ScheduledSeq]
                        ) -> tuple[PromptScoring | None, list[tuple[Sequence, int]]]:
        """The prompt tokens a step scores: in each chunk of a prompt that owes prompt logprobs,
        the rows whose logits predict the owed tokens, and each such sequence with how many are
        its. A prompt scored with max_tokens 0 is listed with its last chunk even with none:
        reading that step finishes it."""
        rows, token_ids, scored, top_n = [], [], [], 0
        offset = 0       # of the chunk's first token among the step's
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed
            count = 0
            if seq.owes_prompt_logprobs:
                # Position p predicts prompt token p + 1. The first owed token's position is at
                # or after the chunk's first, as the prefix cache gives no blocks past the part
                # scored; a chunk recomputed after preemption may end before it, scoring none.
                first, last = seq.prompt_logprobs_next, min(start + s.num_tokens, seq.prompt_len - 1)
                count = max(0, last - first + 1)
            if count:
                rows.append(np.arange(count) + (offset + first - 1 - start))
                token_ids += seq.token_ids[first:last + 1]
                top_n = max(top_n, seq.params.prompt_logprobs)
            if count or (seq.params.max_tokens == 0 and start + s.num_tokens == seq.num_tokens):
                scored.append((seq, count))
            offset += s.num_tokens
        scoring = PromptScoring(np.concatenate(rows), token_ids, top_n) if rows else None
        return scoring, scored

    def _read_in_flight(self) -> list[RequestOutput]:
        """Waits for the step in flight's results: appends its draws to their sequences, and
        hands out the prompt logprobs it computed (a prompt's last ones with its first token)."""
        step, self.in_flight = self.in_flight, None
        prompt_logprobs = self._split_prompt_logprobs(step)
        outputs = []
        result = step.sampled.read() if step.sampled is not None else SampleResult([], [])
        for seq, token, logprobs in zip(step.drawn, result.token_ids, result.logprobs):
            seq.num_pending -= 1
            if seq.status == SeqStatus.FINISHED:     # aborted, or stopped a step earlier
                continue
            failure = self._undrawable(seq, token)
            if failure is not None:
                outputs += self._fail(seq, *failure)
                continue
            outputs.append(self._append_token(seq, token, logprobs, prompt_logprobs.pop(seq, None)))
            if seq.status == SeqStatus.RUNNING:      # not finished now, nor preempted meanwhile
                self.blocks.register_full_blocks(seq)
        for seq, entries in prompt_logprobs.items():
            if seq.status != SeqStatus.FINISHED:
                outputs.append(self._prompt_output(seq, entries))
        return outputs

    @staticmethod
    def _split_prompt_logprobs(step: InFlightStep) -> dict[Sequence, list]:
        """The step's prompt logprobs by sequence, each cut to the top-n it asked for."""
        entries = step.prompt_logprobs.read() if step.prompt_logprobs is not None else []
        out, start = {}, 0
        for seq, count in step.scored:
            top_n = seq.params.prompt_logprobs
            out[seq] = [(lp, top[:top_n]) for lp, top in entries[start:start + count]]
            start += count
        return out

    def _prompt_output(self, seq: Sequence, prompt_logprobs: list) -> RequestOutput:
        """A prompt chunk's logprobs, which draws nothing; a prompt scored with max_tokens 0
        ends (length) with its last."""
        reason = None
        if seq.params.max_tokens == 0 and seq.num_computed >= seq.num_tokens:
            reason = FinishReason.LENGTH
        out = RequestOutput(seq.request_id, seq.index, [], None, reason, seq.prompt_len,
                            seq.num_cached_tokens, prompt_logprobs)
        if reason is not None:
            self._finish(seq, reason)
        return out

    def _sampling_row(self, seq: Sequence, seed: int) -> SamplingRow:
        p = seq.params
        banned = []
        if seq.num_tokens - seq.prompt_len < p.min_tokens:    # the drawn token's output index
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
        row = SamplingRow(p, seed, seq.num_tokens, seq.token_ids, seq.prompt_len, banned, seq.bad_words,
                          seq.allowed_ids, seq.pending_row if seq.num_pending else -1)
        seq.allowed_ids = row.allowed_ids       # made by the first row, kept for the others
        return row

    def _bad_words(self, words: list[str]) -> BadWords:
        """A request's bad words as token sequences, tokenized as vLLM does: each word as
        written (leading spaces dropped), and after a space where that gives another first token
        and as many tokens (the word in the middle of a text rather than at its start)."""
        if self.tokenizer is None:
            raise InvalidRequest("bad_words: this model is served without a tokenizer, so there are "
                                 "no words to ban", "bad_words")
        words = [word.lstrip() for word in words]
        # One batch call: the tokenizer's Rust side takes them all at once, not a word a call.
        encoded = self.tokenizer(words + [" " + word for word in words], add_special_tokens=False)["input_ids"]
        sequences = []
        for alone, spaced in zip(encoded[:len(words)], encoded[len(words):]):
            sequences += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        if any(not 0 <= t < self.vocab_size for tokens in sequences for t in tokens):
            raise InvalidRequest("bad_words: a word tokenizes to ids outside the model's vocabulary", "bad_words")
        return BadWords(tokens=tuple(tokens[0] for tokens in sequences if len(tokens) == 1),
                        sequences=tuple(tuple(tokens) for tokens in sequences if len(tokens) > 1))

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Creates choices 1..n-1 of a request whose prompt is now computed. They share the
        prompt's blocks; without a free block for the partial last block they recompute."""
        parent.pending_fork = False
        children = []
        for index in range(1, parent.params.n):
            child = Sequence(request_id=parent.request_id, index=index, prompt_len=parent.prompt_len,
                             token_ids=list(parent.token_ids), params=parent.params,
                             seed=choice_seed(parent.seed, index), priority=parent.priority,
                             arrival=parent.arrival, max_len=parent.max_len, bad_words=parent.bad_words,
                             prompt_logprobs_next=parent.prompt_logprobs_next,    # the parent's to send
                             matcher=None if parent.matcher is None else parent.matcher.deep_copy(),
                             lora_name=parent.lora_name, cache_salt=parent.cache_salt)
            if parent.lora_name is not None:
                self.lora.get(parent.lora_name).in_use += 1
            if self.blocks.num_free >= 1:
                copy = self.blocks.fork(parent, child)
                if copy:
                    self.runner.pending_copies.append(copy)
                child.num_computed = parent.num_computed
                if parent.lora_slot >= 0:        # runs at once, in its parent's slot
                    child.lora_slot = self.lora.acquire(parent.lora_name)
                child.status = SeqStatus.RUNNING
                self.scheduler.running.append(child)
            else:
                self.scheduler.add(child)
            children.append(child)
        self.requests[parent.request_id].extend(children)
        return children

    def _append_token(self, seq: Sequence, token: int, logprobs, prompt_logprobs=None) -> RequestOutput:
        seq.token_ids.append(token)
        p = seq.params
        if logprobs is not None:
            chosen, top = logprobs
            logprobs = [(chosen, top[:p.logprobs])]
        reason = None
        if seq.num_output >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            reason = FinishReason.STOP
        elif seq.matcher is not None and seq.matcher.is_stopped():   # the output is complete
            reason = FinishReason.STOP
        elif len(seq.token_ids) >= seq.max_len:
            reason = FinishReason.LENGTH
        out = RequestOutput(seq.request_id, seq.index, [token], logprobs, reason,
                            seq.prompt_len, seq.num_cached_tokens, prompt_logprobs)
        if reason is not None:
            self._finish(seq, reason)
        return out

    def _undrawable(self, seq: Sequence, token: int) -> tuple[str, bool] | None:
        """Why the sequence cannot take the token drawn for it, as (error, worker at fault), or
        None; advances its grammar over the token. The request fails rather than end as if it
        had stopped: the output would break its constraints."""
        position = f"output token {seq.num_output}"
        if token == NO_TOKEN_ALLOWED:
            p = seq.params
            limits = [name for name, given in (
                ("structured_output", p.structured_output is not None), ("allowed_token_ids", p.allowed_token_ids),
                ("bad_words", p.bad_words), ("min_tokens", seq.num_output < p.min_tokens),
                ("logits_processors", p.logits_processors)) if given]
            return f"no token may come at {position}: {', '.join(limits)} together rule out every token", False
        if token == NAN_LOGITS:
            under = f" under LoRA adapter '{seq.lora_name}'" if seq.lora_name else ""
            return f"the model computed NaN logits{under} at {position}", True
        if seq.matcher is not None and (seq.matcher.is_error() or not seq.matcher.consume_token(token)):
            # The grammar engine itself gave up (a grammar too complex for its limits): while
            # computing the mask, which then allows only the end (and would take it), or on the
            # token the mask allowed. Its message's first line says which limit. The compiled
            # grammar is dropped: its copies share the state that reached the limit, so the next
            # request under it would start from there.
            self.grammars.forget(seq.params.structured_output)
            reason = seq.matcher.get_error().splitlines()[0][:500]
            return f"structured_output: the grammar engine stopped at {position}: {reason}", False
        return None

    def _fail(self, seq: Sequence, error: str, fault: bool) -> list[RequestOutput]:
        """Ends the sequence's whole request with `error`: an ERROR output for each of its
        choices still unfinished."""
        log.warning("request %s failed: %s", seq.request_id, error)
        return [RequestOutput(s.request_id, s.index, [], None, FinishReason.ERROR, s.prompt_len, s.num_cached_tokens,
                              error=error, fault=fault)
                for s in self._end(seq.request_id, FinishReason.ERROR)]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._let_go_of_adapter(seq)
        family = self.requests.get(seq.request_id, [])
        if all(s.status == SeqStatus.FINISHED for s in family) and not family[0].pending_fork:
            del self.requests[seq.request_id]

    # ------------------------------------------------------------ LoRA adapters

    def _adapter(self, name: str):
        if self.lora is None:
            raise InvalidRequest(f"LoRA adapter {name!r} asked for, but this worker serves no adapters "
                                 f"(start it with --enable-lora)", "lora_name")
        adapter = self.lora.get(name)
        if adapter is not None and adapter.unloading:
            raise LoRANotFound(f"LoRA adapter {name!r} is being unloaded", "lora_name")
        if adapter is None:
            loaded = [n for n, a in self.lora.adapters.items() if not a.unloading]
            raise LoRANotFound(f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(loaded) or 'none'})",
                               "lora_name")
        return adapter

    def add_lora(self, weights) -> list[str]:
        """Makes an adapter read by `worker.models.lora_checkpoint.read_lora_adapter` servable;
        returns adapters dropped from host memory to make room (`--max-cpu-loras`)."""
        if self.lora is None:
            raise InvalidRequest("this worker serves no LoRA adapters (start it with --enable-lora)")
        try:
            return self.lora.add(weights)
        except ValueError as e:
            raise InvalidRequest(str(e), "lora_name") from None

    def remove_lora(self, name: str) -> None:
        """Forgets an adapter with no requests left (`lora_in_use` says how many it has)."""
        if self.lora is None or self.lora.get(name) is None:
            raise LoRANotFound(f"LoRA adapter {name!r} is not loaded", "lora_name")
        self.lora.remove(name)

    def lora_in_use(self, name: str) -> int:
        """Sequences the engine holds under the adapter (0 for an unknown one)."""
        adapter = self.lora.get(name) if self.lora is not None else None
        return adapter.in_use if adapter is not None else 0

    def _let_go_of_adapter(self, seq: Sequence) -> None:
        if seq.lora_name is not None and (adapter := self.lora.get(seq.lora_name)) is not None:
            adapter.in_use -= 1

    # ------------------------------------------------------------ scoring

    def prompt_logits(self, token_ids: list[int], lora_name: str | None = None):
        """Logits `[len, vocab]` at every position of `token_ids` (teacher forcing), under the
        LoRA adapter `lora_name` if given."""
        seq = Sequence("__score__", 0, len(token_ids), list(token_ids), SamplingParams(), 0,
                       lora_name=lora_name)
        if lora_name is not None:
            self._adapter(lora_name)
            if self.lora.acquire(lora_name) is None:
                raise InvalidRequest(f"no LoRA slot is free for {lora_name!r}: every slot is in use")
            seq.lora_slot = self.lora.get(lora_name).slot
        if not self.blocks.reserve(seq, len(token_ids)):
            raise InvalidRequest(f"{len(token_ids)} tokens do not fit in the free KV pool")
        try:
            return self.runner.all_logits(ScheduledSeq(seq, len(token_ids)))
        finally:
            self.blocks.free_seq(seq)
            if seq.lora_slot >= 0:
                self.lora.release(seq.lora_slot)
