"""A line of JSON per engine step, for finding where an online workload's latency goes.

`PAGEDSERVE_STEP_LOG=PATH` makes the worker append, after every step, what the step scheduled
and how long the engine thread spent in it:

    {"t": 12.031, "ms": 31.2, "prefill_seqs": 1, "prefill_tokens": 2048, "decodes": 74,
     "decode_context": 151230, "max_context": 9120, "running": 75, "waiting": 3, "swapped": 0}

`t` is the step's start in seconds since the log was opened; `ms` the wall time of
`LLMEngine.step`. With asynchronous scheduling a step launches one forward and waits for the
one before it, so on a busy GPU `ms` is the previous step's device time (and the gaps between
`t`s the cadence every running sequence sees). A decode is a scheduled sequence computing one
token past its prompt; `decode_context` sums the tokens those decodes attend to. Off (the
default) it costs nothing; on, a few microseconds a step.
"""

import json
import os
import time
from typing import TextIO

from worker.scheduler import SchedulerOutput

STEP_LOG_ENV = "PAGEDSERVE_STEP_LOG"


class StepLog:
    def __init__(self, file: TextIO):
        self.file = file
        self.opened = time.monotonic()

    @classmethod
    def from_env(cls) -> "StepLog | None":
        path = os.environ.get(STEP_LOG_ENV)
        if not path:
            return None
        try:
            return cls(open(path, "a", buffering=1 << 16))
        except OSError as e:
            # Said at start-up, naming the setting: not a bare errno from deep in the worker.
            raise ValueError(f"{STEP_LOG_ENV}={path!r}: cannot open it for appending ({e.strerror})") from e

    def record(self, started: float, duration_s: float, plan: SchedulerOutput,
               running: int, waiting: int, swapped: int) -> None:
        prefill_seqs = prefill_tokens = decodes = decode_context = max_context = 0
        for s in plan.scheduled:
            # num_computed already counts this step's tokens (the engine advanced it at launch).
            context = s.seq.num_computed
            max_context = max(max_context, context)
            if s.num_tokens == 1 and context > s.seq.prompt_len:
                decodes += 1
                decode_context += context
            else:
                prefill_seqs += 1
                prefill_tokens += s.num_tokens
        self.file.write(json.dumps({
            "t": round(started - self.opened, 4), "ms": round(duration_s * 1e3, 3),
            "prefill_seqs": prefill_seqs, "prefill_tokens": prefill_tokens, "decodes": decodes,
            "decode_context": decode_context, "max_context": max_context, "running": running,
            "waiting": waiting, "swapped": swapped}) + "\n")

    def close(self) -> None:
        self.file.close()
