"""Offline, in-process generation: `LLM(model=...).generate(prompts, params)`."""

import itertools
from dataclasses import dataclass, field

from common.progress import progress
from common.sampling_params import InvalidRequest, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.models.loader import load_tokenizer


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    num_cached_tokens: int = 0


class LLM:
    """Runs the engine to completion over a batch of prompts (strings or token id lists).

    With `tensor_parallel_size` > 1 the other ranks are processes: call `close()` (or use
    `with LLM(...) as llm:`) to end them, and start the program under
    `if __name__ == "__main__":`, which spawned processes need.
    """

    def __init__(self, model: str = "default", **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = load_tokenizer(self.engine.source)
        self._ids = itertools.count()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.engine.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 show_progress: bool = False) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        completions: dict[str, Completion] = {}
        for prompt, p in zip(prompts, params_list):
            if isinstance(prompt, str) and self.tokenizer is None:
                raise InvalidRequest(f"{self.engine.source.name} has no tokenizer: give prompts as token ids")
            # The tokenizer's own special-token rule (a Llama 3 BOS), as the router encodes text.
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, p)
            completions[rid] = Completion(rid, ids, [Choice(i) for i in range(p.n)])
        finished = self._run(completions)
        for _ in progress(finished, len(completions), "generating") if show_progress else finished:
            pass
        if self.tokenizer is not None:
            for choice in (ch for c in completions.values() for ch in c.choices):
                choice.text = self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        return list(completions.values())

    def _run(self, completions: dict[str, Completion]):
        """Steps until every request is done; yields each completion as it finishes."""
        while self.engine.has_unfinished():
            for out in self.engine.step():
                completion = completions[out.request_id]
                choice = completion.choices[out.index]
                choice.token_ids += out.new_token_ids
                if out.logprobs:
                    choice.logprobs += out.logprobs
                completion.num_cached_tokens = out.num_cached_tokens
                if out.finish_reason is not None:
                    choice.finish_reason = out.finish_reason.value
                    if all(c.finish_reason for c in completion.choices):
                        yield completion
