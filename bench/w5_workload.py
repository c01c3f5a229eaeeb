"""W5's requests: a realistic online mix, generated from a seed (definition: docs/BENCHMARKS.md).

Two kinds of request. `chat` (about five in six): one of a few shared system prompts of
400-900 tokens, picked with a skewed (Zipf) popularity, then a unique user turn of lognormal
length. `document` (about one in six): a unique document of 3k-12k tokens, then a question of
the user turn's length. Each asks for a lognormal number of output tokens around 200, to be
generated in full (`ignore_eos`). Arrivals are a Poisson process at the given rate.

Prompts are token ids, so no tokenizer is needed and a model with dummy weights serves them.
Everything is a function of the seed: the shared system prompts of the seed alone (they are the
same in every phase of a run, as a popular prompt stays the same all day), the lengths, kinds
and arrival times of (seed, rate), and the unique tokens of (seed, rate, salt), so that two
phases at one rate (the gRPC and the HTTP one) send requests of the same shape whose unique
parts the prefix cache cannot have seen.

    from w5_workload import W5Spec, generate
    requests = generate(W5Spec(), rate=8, seed=0, vocab_size=128256, duration_s=60, salt="grpc")
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

CHAT, DOCUMENT = "chat", "document"
KINDS = (CHAT, DOCUMENT)
# Ids below 100 are left out (special tokens in the Llama and SmolLM2 vocabularies); above
# 128000 are Llama 3's specials.
LOWEST_ID, HIGHEST_ID = 100, 128000


@dataclass(frozen=True)
class W5Spec:
    """The mix's shape; lengths in tokens. `scaled` shrinks it for a small model."""

    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (400, 900)     # uniform, inclusive
    popularity_exponent: float = 1.0     # Zipf: prompt i is picked with weight 1 / (i + 1) ** this
    document_share: float = 1 / 6
    document_tokens: tuple[int, int] = (3000, 12000)       # uniform, inclusive
    user_turn_mean: float = 128.0        # lognormal; the question of a document request too
    user_turn_sigma: float = 0.8
    user_turn_tokens: tuple[int, int] = (8, 1024)          # clip
    output_mean: float = 200.0           # lognormal max_tokens
    output_sigma: float = 0.6
    output_tokens: tuple[int, int] = (16, 1024)            # clip

    def scaled(self, factor: float) -> W5Spec:
        """Every length times `factor` (at least 1 token, and 2 output tokens so that TPOT is
        defined): the same mix for a model with a short context or a slow CPU."""
        def span(pair: tuple[int, int], low: int = 1) -> tuple[int, int]:
            return max(low, round(pair[0] * factor)), max(low, round(pair[1] * factor))
        return replace(self, system_prompt_tokens=span(self.system_prompt_tokens),
                       document_tokens=span(self.document_tokens),
                       user_turn_mean=max(1.0, self.user_turn_mean * factor),
                       user_turn_tokens=span(self.user_turn_tokens),
                       output_mean=max(2.0, self.output_mean * factor),
                       output_tokens=span(self.output_tokens, low=2))

    def longest_request(self) -> int:
        """Prompt + output tokens of the longest request the spec can make."""
        prompt = max(self.system_prompt_tokens[1], self.document_tokens[1]) + self.user_turn_tokens[1]
        return prompt + self.output_tokens[1]


@dataclass
class W5Request:
    """One request of the mix. `shared_prefix_tokens`: how many leading prompt tokens are a
    shared system prompt (0 for a document)."""

    index: int
    kind: str
    arrival_s: float                 # from the start of the phase
    prompt: list[int]
    max_tokens: int
    system_prompt: int | None        # which shared prompt, for a chat request
    shared_prefix_tokens: int


def lognormal(rng: random.Random, mean: float, sigma: float, clip: tuple[int, int]) -> int:
    """A lognormal draw with the given mean, rounded and clipped to `clip`."""
    mu = math.log(mean) - sigma**2 / 2
    return min(clip[1], max(clip[0], round(rng.lognormvariate(mu, sigma))))


def _ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    high = min(HIGHEST_ID, vocab_size)
    return [rng.randrange(LOWEST_ID, high) for _ in range(count)]


def system_prompts(spec: W5Spec, *, seed: int, vocab_size: int) -> list[list[int]]:
    """The shared system prompts of a run: a function of the seed only."""
    rng = random.Random(f"w5:{seed}:system")
    return [_ids(rng, rng.randint(*spec.system_prompt_tokens), vocab_size)
            for _ in range(spec.num_system_prompts)]


def poisson_arrivals(rng: random.Random, rate: float, duration_s: float | None,
                     num_requests: int | None) -> Iterator[float]:
    """Arrival times of a Poisson process at `rate` per second, drawn from `rng` one at a time
    (a caller may draw a request's other features from it in between): those within
    `duration_s`, or the first `num_requests`; exactly one of the two is given."""
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    if rate <= 0:
        raise ValueError(f"rate {rate} must be above 0 requests/s")
    arrival, count = 0.0, 0
    while num_requests is None or count < num_requests:
        arrival += rng.expovariate(rate)
        if duration_s is not None and arrival > duration_s:
            return
        yield arrival
        count += 1


def generate(spec: W5Spec, rate: float, *, seed: int, vocab_size: int, duration_s: float | None = None,
             num_requests: int | None = None, salt: str = "") -> list[W5Request]:
    """The requests arriving at `rate` per second (Poisson) within `duration_s`, or the first
    `num_requests` of them; `salt` changes the unique tokens only (see the module's docstring)."""
    rate = float(rate)          # 8 and 8.0 draw the same requests
    shape = random.Random(f"w5:{seed}:{rate!r}:shape")
    content = random.Random(f"w5:{seed}:{rate!r}:{salt}:content")
    prompts = system_prompts(spec, seed=seed, vocab_size=vocab_size)
    weights = [1 / (i + 1) ** spec.popularity_exponent for i in range(len(prompts))]
    requests: list[W5Request] = []
    for arrival in poisson_arrivals(shape, rate, duration_s, num_requests):
        # Every draw below is made for every request, whatever its kind, so that one request's
        # kind does not shift the next one's lengths between specs of different shares.
        is_document = shape.random() < spec.document_share
        choice = shape.choices(range(len(prompts)), weights)[0]
        document_len = shape.randint(*spec.document_tokens)
        turn_len = lognormal(shape, spec.user_turn_mean, spec.user_turn_sigma, spec.user_turn_tokens)
        max_tokens = lognormal(shape, spec.output_mean, spec.output_sigma, spec.output_tokens)
        if is_document:
            prompt = _ids(content, document_len + turn_len, vocab_size)
            kind, system, shared = DOCUMENT, None, 0
        else:
            prompt = prompts[choice] + _ids(content, turn_len, vocab_size)
            kind, system, shared = CHAT, choice, len(prompts[choice])
        requests.append(W5Request(len(requests), kind, arrival, prompt, max_tokens, system, shared))
    return requests


def warmup_requests(spec: W5Spec, *, seed: int, vocab_size: int) -> list[W5Request]:
    """What a run sends before it times anything, all at t=0 with 8 output tokens: each shared
    system prompt once, so the phases start with them cached (as on a server that has run a
    while: popular prompts stay hot), and a shortest and a longest document, so that kernel
    variants for those shapes are compiled by then. Its unique tokens are none of a phase's."""
    rng = random.Random(f"w5:{seed}:warm-up")
    requests = [W5Request(i, CHAT, 0.0, p + _ids(rng, 4, vocab_size), 8, i, len(p))
                for i, p in enumerate(system_prompts(spec, seed=seed, vocab_size=vocab_size))]
    for length in spec.document_tokens:
        requests.append(W5Request(len(requests), DOCUMENT, 0.0, _ids(rng, length, vocab_size), 8, None, 0))
    return requests


def cacheable_share(requests: list[W5Request], block_size: int) -> float:
    """The share of the requests' prompt tokens a prefix cache holding every shared system
    prompt can serve: the full blocks of each chat request's system prompt (the block the user
    turn starts in differs between requests). What a perfect cache would reach."""
    total = sum(len(r.prompt) for r in requests)
    # The last prompt token is always computed (its logits start the generation).
    cached = sum(min(r.shared_prefix_tokens, len(r.prompt) - 1) // block_size * block_size for r in requests)
    return cached / total if total else 0.0
