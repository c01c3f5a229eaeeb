"""Per-request sampling parameters and their validation."""

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
# Temperatures below this are greedy, as in vLLM: dividing logits by a tiny one overflows float32
# (1e-37 makes them inf, and their softmax NaN), and one this small is as good as greedy anyway.
GREEDY_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01
MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS = 4096, 65536


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field and what is allowed."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field      # the field's name, which the message starts with


# What a structured output can be constrained to (pagedserve.v1.StructuredOutput's kinds).
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: `kind` one of STRUCTURED_OUTPUT_KINDS; `spec` the schema
    (JSON text), the pattern, the choices (a tuple of strings) or the grammar text; None for
    json_object. `common.structured_output` compiles it."""
    kind: str
    spec: str | tuple[str, ...] | None = None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # below GREEDY_TEMPERATURE (0 too) means greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n logprobs per generated token; None: none
    # Top-n logprobs of each prompt token (computed in its prefill); None: none. With it,
    # max_tokens may be 0: the prompt is scored and nothing generated.
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    allowed_token_ids: list[int] = field(default_factory=list)   # empty: every token
    # Words the output may not contain (vLLM's bad_words), tokenized by the worker: a word's
    # last token is banned whenever the output ends with the tokens before it.
    bad_words: list[str] = field(default_factory=list)
    # Custom logits processors to run (by name; the worker loads them, worker.logits_processors)
    # and their arguments (vLLM's extra_args: JSON values by name).
    logits_processors: list[str] = field(default_factory=list)
    extra_args: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def counts_output_tokens(self) -> bool:
        """Whether sampling reads the tokens generated so far (the penalties do)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raises InvalidRequest naming the first bad field; returns self when all are valid."""
        def bad(name: str, allowed: str):
            raise InvalidRequest(f"{name}={getattr(self, name)!r} is invalid: {allowed}", name)

        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            bad("n", "must be an integer in [1, 128]")
        if not self.temperature >= 0.0 or self.temperature > 100.0:
            bad("temperature", "must be in [0, 100] (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        # Not below 0.01: it divides the positive logits, and a tiny one made them infinite
        # (1e-38: NaN probabilities, tokens drawn at random).
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, 10]")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad("seed", "must be an integer in [0, 2^63)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0 or (
                self.max_tokens == 0 and (self.prompt_logprobs is None or self.n != 1)):
            bad("max_tokens", "must be an integer >= 1, or 0 to score a prompt (with "
                "prompt_logprobs set and n=1)")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and not (isinstance(self.logprobs, int)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"every id must be in [0, {vocab_size})")
        for token, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise InvalidRequest(f"logit_bias[{token}] is invalid: token ids must be in "
                                     f"[0, {vocab_size})", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequest(f"logit_bias[{token}]={bias!r} is invalid: must be in [-100, 100]",
                                     "logit_bias")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.allowed_token_ids):
            bad("allowed_token_ids", f"every id must be in [0, {vocab_size})")
        # More ids than the vocabulary holds repeat some; each step reads them all (1M ids made
        # every step of the batch about 1 s slower on the CPU).
        if vocab_size is not None and len(self.allowed_token_ids) > vocab_size:
            raise InvalidRequest(f"allowed_token_ids holds {len(self.allowed_token_ids)} ids; at most {vocab_size} "
                                 "(the vocabulary's size)", "allowed_token_ids")
        if any(not isinstance(word, str) or not word.strip() for word in self.bad_words):
            bad("bad_words", "every entry must be a string holding more than spaces")
        # The worker tokenizes them before the request's first step, in the loop every request
        # shares: 470,000 words held every other request for 21 s.
        chars = sum(map(len, self.bad_words))
        if len(self.bad_words) > MAX_BAD_WORDS or chars > MAX_BAD_WORDS_CHARS:
            raise InvalidRequest(f"bad_words holds {len(self.bad_words)} words of {chars} "
                                 f"characters; at most {MAX_BAD_WORDS} words of {MAX_BAD_WORDS_CHARS} characters "
                                 "in all", "bad_words")
        if any(not isinstance(name, str) or not name for name in self.logits_processors):
            bad("logits_processors", "every entry must be a processor's name")
        if not isinstance(self.extra_args, dict) or any(not isinstance(key, str) for key in self.extra_args):
            bad("extra_args", "must map names (strings) to values")
        if (so := self.structured_output) is not None:
            if so.kind not in STRUCTURED_OUTPUT_KINDS:
                raise InvalidRequest(f"structured_output kind {so.kind!r} is unknown: use one of "
                                     f"{', '.join(STRUCTURED_OUTPUT_KINDS)}", "structured_output")
            if so.kind != "json_object" and not so.spec:
                raise InvalidRequest(f"structured_output.{so.kind} is empty", f"structured_output.{so.kind}")
        return self


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request: choice 0 keeps the request's seed. Shared by
    the engine (n > 1 in one request) and the router (n > 1 fanned out over Submits)."""
    return seed if index == 0 else (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % 2**63
