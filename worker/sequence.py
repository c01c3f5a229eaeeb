"""One generated sequence: its tokens, progress, blocks and limits.

A request with `n > 1` starts as one sequence; when its prompt has been computed the engine
forks the other `n - 1`, which share the prompt's blocks.

Under asynchronous scheduling a sequence may have a *pending* token: drawn on the device by
the step in flight, not yet known to the host. It counts in `num_tokens` (the next step
computes it, reading it on the device) but is not in `token_ids` until the engine reads it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from worker.sampler import BadWords


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"       # EOS or a stop token
    LENGTH = "length"   # max_tokens or max_model_len reached
    ABORT = "abort"
    ERROR = "error"     # the request failed (RequestOutput.error says why)


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int                          # choice index within the request (n > 1)
    prompt_len: int
    token_ids: list[int]                # prompt followed by every generated token
    params: SamplingParams
    seed: int                           # sampling randomness = f(seed, position)
    priority: int = 0
    arrival: float = 0.0
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0               # tokens whose K/V are in the pool
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks, chained
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache
    finish_reason: FinishReason | None = None
    pending_fork: bool = False          # sequence 0 of an n > 1 request, not yet forked
    swap_blocks: list[int] = field(default_factory=list)  # host blocks while SWAPPED
    held: bool = False                  # swapped out on request: stays out until swapped in
    was_preempted: bool = False         # its next admission is a resumption
    max_len: int = 0                    # prompt + tokens allowed by max_tokens and the model
    # Tokens drawn on the device that the host has not read: one between steps; two for a
    # moment while the next step is launched before the previous one's draws are read.
    num_pending: int = 0
    pending_row: int = -1               # the latest draw's row among its step's draws
    # With params.prompt_logprobs: the next prompt position whose logprob a step has still to
    # compute (position 0 has none). Kept through preemption: what was sent is not sent again.
    prompt_logprobs_next: int = 1
    bad_words: BadWords | None = None   # params.bad_words as token sequences
    allowed_ids: torch.Tensor | None = None     # params.allowed_token_ids as a tensor, once sampled
    # Its structured-output grammar state (llguidance LLMatcher) over the output tokens the
    # host has read; None when unconstrained (see worker.structured).
    matcher: object | None = None
    lora_name: str | None = None        # its LoRA adapter; None: the base model
    lora_slot: int = -1                 # the adapter's device slot while it runs (worker.lora)
    cache_salt: int | None = None       # starts its prefix-cache hash chain (worker.kv_pool)

    @property
    def num_tokens(self) -> int:
        """Tokens including pending ones."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output(self) -> int:
        """Generated tokens known to the host."""
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def owes_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs, and some are still to compute."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs_next < self.prompt_len

    @property
    def at_max_len(self) -> bool:
        """Its pending or last token is its last: nothing more to compute for it."""
        return self.num_tokens >= self.max_len

    @property
    def key(self) -> tuple:
        """Scheduling order: smaller runs first, and is preempted last."""
        return (self.priority, self.arrival, self.index)
