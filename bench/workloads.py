"""The benchmark workloads' requests, shared by the engine-level and the router-level benches
so that both measure the same prompts (definitions: docs/BENCHMARKS.md, ../shared/DESIGN.md)."""

import random


def w1_requests(count: int = 512, seed: int = 0, vocab_size: int = 128256) -> list[list[int]]:
    """W1: `count` prompts of 32..1024 random token ids (ids below 100 left out: specials)."""
    rng = random.Random(seed)
    high = min(128000, vocab_size)
    return [[rng.randrange(100, high) for _ in range(rng.randint(32, 1024))] for _ in range(count)]
