"""Iteration-level scheduling under a per-step token budget.

Every step takes the running sequences first (in priority order), giving each the tokens it
still has to compute (one for a decode, a chunk for a prompt) while the token budget lasts,
then admits waiting sequences with what is left. Prompt and generated tokens are the same
thing here: a sequence just has tokens not yet computed. When the pool runs out of blocks the
lowest-priority running sequence (the latest, under FCFS) is preempted: its blocks are freed
and it waits to be recomputed, or it is swapped to host memory by the engine.
"""

import bisect
from dataclasses import dataclass, field

from worker.config import EngineConfig
from worker.kv_pool import BlockManager
from worker.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # tokens computed for it this step
    samples: bool = False    # this step computes its last known token, so it draws a new one

    def __post_init__(self):
        self.samples = self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.max_num_batched_tokens
        self.priority_policy = config.scheduling_policy == "priority"
        self.blocks = block_manager
        self.waiting: list[Sequence] = []      # sorted by `_order`
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def _order(self, seq: Sequence) -> tuple:
        return seq.key if self.priority_policy else (seq.arrival, seq.index)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._order)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and frees its blocks (finish or abort)."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks and queues it to be recomputed."""
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.num_computed = 0
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        self.running.sort(key=self._order)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.reserve(seq, seq.num_computed + n):
                victim = self.running[-1]       # unscheduled: we schedule from the front
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1

        # New work only joins when nothing had to be preempted: admitting it would just
        # take the blocks the preempted sequences need to come back.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.reserve(seq, seq.num_computed + n):
                break
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out
