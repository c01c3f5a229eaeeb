"""Which worker gets a request: prefix affinity, overruled by load.

A worker caches the KV of full prompt blocks by prefix, so requests that start alike are cheaper
on the worker that saw that start before. The affinity key hashes the prompt's first few full
blocks (a fixed number, so prompts that share fewer blocks than that may still part ways), and
rendezvous (highest-random-weight) hashing maps a key to a worker: adding or removing a worker
moves only the keys it gains or loses, and every router replica agrees without talking. When
the affinity worker is much busier than the least-loaded one, load wins.

A request under a LoRA adapter goes only to workers that serve adapters, and to one that holds
its adapter already unless every holder is much busier (by the same load gap) than the least
loaded: then that one loads it. Among holders prefix affinity picks as above, with the
adapter's name in the key (each adapter's KV is cached apart).

Pure functions over worker states; nothing here keeps state between calls.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class WorkerState(Protocol):
    """What the balancer reads of a worker (router.admission.WorkerBudget is one)."""

    @property
    def worker_id(self) -> str: ...

    @property
    def free_tokens(self) -> int: ...

    @property
    def capacity_tokens(self) -> int: ...


W = TypeVar("W", bound=WorkerState)


@dataclass(frozen=True)
class BalancerConfig:
    """How strongly prefix affinity binds."""

    block_size: int = 16     # the workers' KV block size, in tokens
    affinity_blocks: int = 4  # full prompt blocks hashed into the affinity key
    # Largest load difference (in [0, 1]) between the affinity worker and the least-loaded one
    # for which affinity still wins.
    max_load_gap: float = 0.25


@dataclass(frozen=True)
class LoRAPlacement:
    """Where a request's LoRA adapter can run: workers that serve adapters, and those of them
    that hold this one."""

    name: str
    capable: frozenset[str]
    holders: frozenset[str]


def affinity_key(prompt_token_ids: Sequence[int], block_size: int,
                 affinity_blocks: int, salt: str = "") -> bytes | None:
    """Digest of the prompt's first full blocks (up to affinity_blocks) and `salt` (the LoRA
    adapter); None when the prompt has no full block, since only full blocks are cached."""
    num_blocks = min(len(prompt_token_ids) // block_size, affinity_blocks)
    if num_blocks == 0:
        return None
    prefix = prompt_token_ids[:num_blocks * block_size]
    return hashlib.blake2b(struct.pack(f"<{len(prefix)}q", *prefix) + salt.encode(),
                           digest_size=16).digest()


def affinity_worker(key: bytes, workers: Sequence[W]) -> W:
    """The worker a key maps to by rendezvous hashing: the highest hash of (key, worker id)."""
    return max(workers, key=lambda w: hashlib.blake2b(
        key + w.worker_id.encode(), digest_size=8).digest())


def load(worker: WorkerState, kv_usage: float = 0.0) -> float:
    """How busy a worker is, in [0, 1] (more when overcommitted): the larger of the share of its
    token budget this router reserved and the share of KV blocks it reports in use (which also
    counts other router replicas' requests)."""
    if worker.capacity_tokens <= 0:
        return 1.0
    return max(1.0 - worker.free_tokens / worker.capacity_tokens, kv_usage)


def choose_worker(candidates: Sequence[W], prompt_token_ids: Sequence[int],
                  config: BalancerConfig = BalancerConfig(),
                  kv_usage: Mapping[str, float] | None = None,
                  lora: LoRAPlacement | None = None) -> W | None:
    """Picks the worker for a prompt among candidates (those it fits on); None if there are none.

    kv_usage maps worker id to used / total KV blocks from its latest load report; `lora`: the
    request's adapter, and where it can run.
    """
    if lora is not None:
        candidates = [w for w in candidates if w.worker_id in lora.capable]
    if not candidates:
        return None
    kv_usage = kv_usage or {}
    loads = {w.worker_id: load(w, kv_usage.get(w.worker_id, 0.0)) for w in candidates}
    least_loaded = min(candidates, key=lambda w: (loads[w.worker_id], w.worker_id))
    if lora is not None:
        holders = [w for w in candidates if w.worker_id in lora.holders]
        if not holders:
            return least_loaded
        best = min(holders, key=lambda w: (loads[w.worker_id], w.worker_id))
        if loads[best.worker_id] - loads[least_loaded.worker_id] > config.max_load_gap:
            return least_loaded
        candidates, least_loaded = holders, best
    key = affinity_key(prompt_token_ids, config.block_size, config.affinity_blocks,
                       lora.name if lora is not None else "")
    if key is None:
        return least_loaded
    preferred = affinity_worker(key, candidates)
    if loads[preferred.worker_id] - loads[least_loaded.worker_id] > config.max_load_gap:
        return least_loaded
    return preferred
