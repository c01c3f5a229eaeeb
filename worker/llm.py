"""Offline, in-process generation: `LLM(model=...).generate(prompts, params)`."""

import itertools
from dataclasses import dataclass, field

from common.progress import progress
from common.sampling_params import InvalidRequest, SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.models.loader import load_tokenizer
from worker.models.lora_checkpoint import read_lora_adapter


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
    # With params.prompt_logprobs: per prompt token, (its logprob, [(token id, logprob) of the
    # top n]); None for the first token, which nothing predicts (as in vLLM).
    prompt_logprobs: list | None = None
    # Why the request failed (its choices' finish_reason is "error"), else None: its
    # constraints ruled out every token, or its grammar was too complex for the grammar engine.
    error: str | None = None


class LLM:
    """Runs the engine to completion over a batch of prompts (strings or token id lists).

    With `enable_lora=True`, `add_lora(name, path)` loads a PEFT adapter and
    `generate(..., lora_name=name)` runs prompts under it.

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

    def add_lora(self, name: str, path: str) -> None:
        """Loads the PEFT adapter directory `path` under `name` (replacing an adapter of
        that name); raises LoRAAdapterError naming the file and the problem."""
        engine = self.engine
        engine.add_lora(read_lora_adapter(name, path, engine.model_config, engine.config.max_lora_rank,
                                          engine.runner.dtype))

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 show_progress: bool = False, lora_name: str | None = None) -> list[Completion]:
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
            self.engine.add_request(rid, ids, p, lora_name=lora_name)
            completions[rid] = Completion(rid, ids, [Choice(i) for i in range(p.n)],
                                          prompt_logprobs=None if p.prompt_logprobs is None else [None])
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
                if out.prompt_logprobs:
                    completion.prompt_logprobs += out.prompt_logprobs
                completion.num_cached_tokens = out.num_cached_tokens
                completion.error = completion.error or out.error
                if out.finish_reason is not None:
                    choice.finish_reason = out.finish_reason.value
                    if all(c.finish_reason for c in completion.choices):
                        yield completion
