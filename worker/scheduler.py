"""Iteration-level scheduling under a per-step token budget.

Every step gives the running sequences' decodes their token first (in priority order), then
prompt chunks (at most `long_prefill_token_threshold` tokens each when that is set) to running
and waiting sequences alike, shortest remaining prompt first (see `_prompt_order`), admitting
waiting ones as they fit, while the token budget lasts. Prompt and generated tokens are the same
thing here: a sequence just has tokens not yet computed. When the pool runs out of blocks the
lowest-priority running sequence (the latest, under FCFS) is preempted: its blocks are copied
to host swap space when there is room (and brought back when the pool has room again), else
they are freed and it waits to be recomputed. A sequence under a LoRA adapter runs only while
its adapter holds a device slot (`worker.lora`): one waiting for a slot lets the sequences
behind it go first.
"""

import bisect
import time
from dataclasses import dataclass, field

from worker.config import EngineConfig
from worker.kv_pool import BlockManager, SwapPool
from worker.lora import LoRASlots
from worker.sequence import Sequence, SeqStatus

SWAP, RECOMPUTE = "swap", "recompute"
# A prompt waiting longer than this goes before shorter ones (see Scheduler._prompt_order).
PROMPT_AGING_S = 2.0


@dataclass
class SchedulerEvent:
    """A lifecycle change the router hears about: admitted, preempted (swap or recompute),
    resumed."""
    seq: Sequence
    kind: str
    mode: str | None = None


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # tokens computed for it this step
    # This step computes its last known token, so it draws a new one (unless max_tokens is 0:
    # a prompt scored for its prompt logprobs draws nothing).
    samples: bool = False

    def __post_init__(self):
        self.samples = (self.seq.num_computed + self.num_tokens == self.seq.num_tokens
                        and self.seq.params.max_tokens > 0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Block moves, to run in this order before the step: ("out", device block, host block)
    # or ("in", host block, device block). Order matters: a block emptied by one move may be
    # the destination of a later one.
    swaps: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, swap_pool: SwapPool,
                 lora: LoRASlots | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.max_num_batched_tokens
        self.chunk_limit = config.long_prefill_token_threshold or config.max_num_batched_tokens
        self.priority_policy = config.scheduling_policy == "priority"
        self.preemption_mode = config.preemption_mode
        self.blocks = block_manager
        self.swap_pool = swap_pool
        self.lora = lora
        self.waiting: list[Sequence] = []      # sorted by `_order`
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = {SWAP: 0, RECOMPUTE: 0}
        self.events: list[SchedulerEvent] = []
        # Block moves decided since the last step (by `schedule` or router-driven swaps).
        self.pending_swaps: list[tuple[str, int, int]] = []

    def _order(self, seq: Sequence) -> tuple:
        return seq.key if self.priority_policy else (seq.arrival, seq.index)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._order)

    def _take_lora_slot(self, seq: Sequence) -> bool:
        """Pins the device slot of the sequence's adapter (if any); False: none is free."""
        if seq.lora_name is None or seq.lora_slot >= 0:
            return True
        slot = self.lora.acquire(seq.lora_name)
        seq.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _leave_lora_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora.release(seq.lora_slot)
            seq.lora_slot = -1

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and frees its blocks (finish or abort)."""
        self._leave_lora_slot(seq)
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_pool.give_back(seq.swap_blocks)
            seq.swap_blocks = []
        self.blocks.free_seq(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or any(not s.held for s in self.swapped))

    def preempt(self, seq: Sequence, mode: str | None = None) -> str:
        """Takes a running sequence off the device: its blocks go to host swap space when the
        mode allows and there is room, else they are freed and it waits to be recomputed.
        Returns the mode used."""
        mode = mode or self.preemption_mode
        self.running.remove(seq)
        self._leave_lora_slot(seq)
        if mode != RECOMPUTE and self.swap_pool.num_free >= len(seq.block_table):
            seq.swap_blocks = self.swap_pool.take(len(seq.block_table))
            self.pending_swaps += [("out", d, h) for d, h in zip(seq.block_table, seq.swap_blocks)]
            self.blocks.free_seq(seq)
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            mode = SWAP
        else:
            self.blocks.free_seq(seq)
            seq.num_computed = 0
            self.add(seq)
            mode = RECOMPUTE
        seq.was_preempted = True
        self.num_preemptions[mode] += 1
        self.events.append(SchedulerEvent(seq, "preempted", mode))
        return mode

    def _swap_in(self) -> None:
        """Brings swapped sequences back while the pool has room for them and a new token."""
        self.swapped.sort(key=self._order)
        for seq in [s for s in self.swapped if not s.held]:
            if len(self.running) >= self.max_num_seqs or \
                    self.blocks.num_free < len(seq.swap_blocks) + 1:
                break
            if not self._take_lora_slot(seq):
                continue
            self.blocks.reserve(seq, seq.num_computed)
            self.pending_swaps += [("in", h, d) for h, d in zip(seq.swap_blocks, seq.block_table)]
            self.swap_pool.give_back(seq.swap_blocks)
            seq.swap_blocks = []
            self.swapped.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.events.append(SchedulerEvent(seq, "resumed", SWAP))

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.events.append(SchedulerEvent(seq, "resumed" if seq.was_preempted else "admitted",
                                          RECOMPUTE if seq.was_preempted else None))

    def _prompt_order(self, seq: Sequence, now: float) -> tuple:
        """Prompt work goes shortest first: a chat turn does not wait behind a long document's
        chunks, and the document, finished a few tokens later, barely notices. A sequence
        preempted mid-generation, and a prompt older than PROMPT_AGING_S, go first and in
        arrival order, so no prompt waits forever behind a stream of shorter ones."""
        urgent = seq.was_preempted or now - seq.arrival > PROMPT_AGING_S
        return (seq.priority if self.priority_policy else 0, not urgent,
                0 if urgent else seq.num_uncomputed, seq.arrival, seq.index)

    def schedule(self) -> SchedulerOutput:
        """Decodes first, in priority order, then prompt chunks (of running sequences and of
        waiting ones, admitted as they fit), in `_prompt_order`, while the budget lasts."""
        out = SchedulerOutput()
        budget = self.token_budget
        if self.swapped:
            self._swap_in()
        self.running.sort(key=self._order)
        scheduled: set[int] = set()

        def grow(seq: Sequence, n: int) -> bool:
            """Reserves blocks for `n` more tokens of running `seq`, preempting the lowest-
            priority unscheduled running sequences while the pool is short; False: `seq`
            itself was the one preempted."""
            while not self.blocks.reserve(seq, seq.num_computed + n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return False
            return True

        def take(seq: Sequence, n: int) -> None:
            nonlocal budget
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled.add(id(seq))
            budget -= n

        prompts: list[Sequence] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue                # preempted for an earlier one's blocks
            if seq.at_max_len and seq.num_uncomputed <= seq.num_pending:
                # Its pending token finishes it when read; or, a prompt scored with
                # max_tokens 0, it is done once the step that computed it is read.
                continue
            if seq.num_uncomputed > 1:
                prompts.append(seq)
            elif grow(seq, 1):
                take(seq, 1)

        now = time.monotonic()
        # New work only joins when nothing had to be preempted: admitting it would just
        # take the blocks the preempted sequences need to come back.
        admitting = not out.preempted
        # Only as many waiting ones as could join, the earliest: a long queue is not sorted
        # every step.
        candidates = self.waiting[:max(0, self.max_num_seqs - len(self.running))] if admitting else []
        for seq in sorted(prompts + candidates, key=lambda seq: self._prompt_order(seq, now)):
            if budget <= 0:
                break
            if seq.status == SeqStatus.RUNNING:
                n = min(seq.num_uncomputed, budget, self.chunk_limit)
                if grow(seq, n):
                    take(seq, n)
                if out.preempted:
                    admitting = False
                continue
            if not admitting or seq.status != SeqStatus.WAITING or len(self.running) >= self.max_num_seqs:
                continue
            if seq.num_pending:
                continue            # preempted with its token in flight: back once it is read
            if not self._take_lora_slot(seq):
                continue            # every slot is pinned by other adapters' running sequences
            self.blocks.match_prefix(seq)
            n = min(seq.num_uncomputed, budget, self.chunk_limit)
            if not self.blocks.reserve(seq, seq.num_computed + n):
                self._leave_lora_slot(seq)
                # A waiting sequence holds no blocks: kept, its matched prefix could be all
                # that stops the running ones from growing (and, preempted in turn, their
                # own matches would stop it), a stall with no one left to preempt. The
                # blocks stay cached, so the next try matches them again.
                self.blocks.unmatch_prefix(seq)
                admitting = False
                continue
            self.blocks.count_prefix_match(seq)
            self._admit(seq)
            take(seq, n)
        if self.lora is not None:
            # Each adapter's tokens side by side: a tile of the LoRA kernels then meets one
            # adapter or two instead of every one in the batch (kernels.triton_lora).
            out.scheduled.sort(key=lambda s: s.seq.lora_slot)
        out.swaps, self.pending_swaps = self.pending_swaps, []
        return out
