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

Not thread-safe: one thread drives it (the worker server queues RPC commands to that thread).
"""

import dataclasses
import logging
import random
import time
from dataclasses import dataclass

from common.sampling_params import InvalidRequest, SamplingParams, choice_seed
from worker.config import EngineConfig
from worker.kv_pool import BlockManager, SwapPool
from worker import ranks
from worker.model_runner import ModelRunner
from worker.models.loader import ModelSource, load_tokenizer, resolve_source
from worker.parallel import Shard
from worker import structured
from worker.sampler import SampledTokens, SamplingBatch, SamplingRow
from worker.scheduler import Scheduler, ScheduledSeq, SchedulerOutput
from worker.sequence import FinishReason, Sequence, SeqStatus

log = logging.getLogger("pagedserve.engine")


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


@dataclass
class EngineEvent:
    """A lifecycle change of one choice: admitted, preempted (mode swap or recompute), resumed."""
    request_id: str
    index: int
    kind: str
    mode: str | None = None


@dataclass
class InFlightStep:
    """A launched step whose draws the host has not read: draw i is for `drawn[i]`."""
    sampled: SampledTokens
    drawn: list[Sequence]


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
    tokens_in_flight: int
    steps: int


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None, loaded=None):
        """`loaded`: (ModelConfig, model) already in memory, to share weights between engines."""
        self.config = config.validate()
        self.source = source or resolve_source(config.model, config.load_format)
        # Ranks 1..N-1 of a tensor-parallel worker run in processes of their own.
        self.ranks = ranks.launch(config, self.source) if config.tensor_parallel_size > 1 else None
        try:
            self.runner = ModelRunner(config, self.source, loaded, self.ranks.shard if self.ranks else Shard())
        except BaseException:
            if self.ranks is not None:
                self.ranks.abandon()    # they would wait for this rank in a collective forever
            raise
        if config.async_scheduling is None:
            self.config = dataclasses.replace(config, async_scheduling=self.runner.device.type == "cuda")
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap_pool = SwapPool(self.runner.num_swap_blocks)
        self.scheduler = Scheduler(config, self.blocks, self.swap_pool)
        self.requests: dict[str, list[Sequence]] = {}
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.num_steps = 0
        self.last_plan = SchedulerOutput()   # of the latest step: for metrics and traces
        self.in_flight: InFlightStep | None = None
        self.grammars = structured.Grammars(lambda: load_tokenizer(self.source), self.vocab_size)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

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
                    output_token_ids: list[int] = ()) -> None:
        """Queues a request; raises InvalidRequest (naming the problem) if it can never run.

        `output_token_ids`: tokens this request already generated elsewhere (a migrated
        request); generation continues after them as if it had never moved."""
        params.validate(self.vocab_size)
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
                       matcher=matcher)
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drops a request wherever it is and frees its blocks; False if it is unknown."""
        seqs = self.requests.pop(request_id, None)
        for seq in seqs or ():
            if seq.status != SeqStatus.FINISHED:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
        return seqs is not None

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
            prefix_hits=self.blocks.prefix_hits, steps=self.num_steps,
            tokens_in_flight=sum(s.max_len for seqs in self.requests.values() for s in seqs))

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
        batch = SamplingBatch.build(rows, self.vocab_size, self.runner.device) if rows else None
        previous = self.in_flight.sampled if self.in_flight is not None else None
        logits = self.runner.forward(plan.scheduled, logits_rows, previous)
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
        return InFlightStep(sampled, drawn) if drawn else None

    def _read_in_flight(self) -> list[RequestOutput]:
        """Waits for the step in flight's draws and appends them to their sequences."""
        step, self.in_flight = self.in_flight, None
        result = step.sampled.read()
        outputs = []
        for seq, token, logprobs in zip(step.drawn, result.token_ids, result.logprobs):
            seq.num_pending -= 1
            if seq.status == SeqStatus.FINISHED:     # aborted, or stopped a step earlier
                continue
            outputs.append(self._append_token(seq, token, logprobs))
            if seq.status == SeqStatus.RUNNING:      # not finished now, nor preempted meanwhile
                self.blocks.register_full_blocks(seq)
        return outputs

    def _sampling_row(self, seq: Sequence, seed: int) -> SamplingRow:
        p = seq.params
        banned = []
        if seq.num_tokens - seq.prompt_len < p.min_tokens:    # the drawn token's output index
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
        return SamplingRow(p, seed, seq.num_tokens, seq.token_ids, seq.prompt_len, banned)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Creates choices 1..n-1 of a request whose prompt is now computed. They share the
        prompt's blocks; without a free block for the partial last block they recompute."""
        parent.pending_fork = False
        children = []
        for index in range(1, parent.params.n):
            child = Sequence(request_id=parent.request_id, index=index, prompt_len=parent.prompt_len,
                             token_ids=list(parent.token_ids), params=parent.params,
                             seed=choice_seed(parent.seed, index), priority=parent.priority,
                             arrival=parent.arrival, max_len=parent.max_len,
                             matcher=None if parent.matcher is None else parent.matcher.deep_copy())
            if self.blocks.num_free >= 1:
                copy = self.blocks.fork(parent, child)
                if copy:
                    self.runner.pending_copies.append(copy)
                child.num_computed = parent.num_computed
                child.status = SeqStatus.RUNNING
                self.scheduler.running.append(child)
            else:
                self.scheduler.add(child)
            children.append(child)
        self.requests[parent.request_id].extend(children)
        return children

    def _append_token(self, seq: Sequence, token: int, logprobs) -> RequestOutput:
        seq.token_ids.append(token)
        p = seq.params
        if logprobs is not None:
            chosen, top = logprobs
            logprobs = [(chosen, top[:p.logprobs])]
        reason = None
        if seq.num_output >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            reason = FinishReason.STOP
        elif seq.matcher is not None and self._grammar_ends(seq, token):
            reason = FinishReason.STOP
        elif len(seq.token_ids) >= seq.max_len:
            reason = FinishReason.LENGTH
        out = RequestOutput(seq.request_id, seq.index, [token], logprobs, reason,
                            seq.prompt_len, seq.num_cached_tokens)
        if reason is not None:
            self._finish(seq, reason)
        return out

    @staticmethod
    def _grammar_ends(seq: Sequence, token: int) -> bool:
        """Advances the sequence's grammar over its new token: True once the output is
        complete (nothing but the end may follow). A token the grammar refuses cannot be drawn
        under its mask; should one come (a bug), the choice ends rather than run on unchecked."""
        if not seq.matcher.consume_token(token):
            log.error("request %s: token %d does not follow its grammar (%s); the choice ends",
                      seq.request_id, token, seq.matcher.get_error())
            return True
        return seq.matcher.is_stopped()

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        family = self.requests.get(seq.request_id, [])
        if all(s.status == SeqStatus.FINISHED for s in family) and not family[0].pending_fork:
            del self.requests[seq.request_id]

    # ------------------------------------------------------------ scoring

    def prompt_logits(self, token_ids: list[int]):
        """Logits `[len, vocab]` at every position of `token_ids` (teacher forcing)."""
        seq = Sequence("__score__", 0, len(token_ids), list(token_ids), SamplingParams(), 0)
        if not self.blocks.reserve(seq, len(token_ids)):
            raise InvalidRequest(f"{len(token_ids)} tokens do not fit in the free KV pool")
        try:
            return self.runner.all_logits(ScheduledSeq(seq, len(token_ids)))
        finally:
            self.blocks.free_seq(seq)
