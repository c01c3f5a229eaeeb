"""The paged KV pool: block allocation with reference counts and prefix caching.

Blocks hold `block_size` tokens of K/V for every layer. A sequence owns an ordered block
table; blocks shared by several sequences (a cached prefix, the prompt of an n > 1 request)
are reference-counted. A full block is identified by a chained hash, `hash((previous block's
hash, its token ids))`, so equal hashes mean equal prefixes; the first block's chain starts
from the sequence's `cache_salt` (its LoRA adapter: the same tokens under another adapter
have other K/V). When its last user lets go, a
hashed block keeps its contents in the free list (least recently freed first out) and a later
request with the same prefix takes it back instead of recomputing it.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from worker.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()      # of a hashed block, to rule out hash collisions


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}     # chain hash -> block id
        self.prefix_queries = 0              # prompt blocks looked up
        self.prefix_hits = 0                 # of those, found in the cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ allocation

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:           # evict its cached contents
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def match_prefix(self, seq: Sequence) -> None:
        """Gives a sequence that has no blocks yet the cached blocks of its longest cached
        prefix of full blocks, always leaving at least one token to compute (its logits
        start the generation). The lookup counts in the hit rate only once the sequence is
        admitted with it (`count_prefix_match`): a request that waits looks up every step."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return
        prev = seq.cache_salt
        for i in range(self._matchable_blocks(seq)):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(prev, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def unmatch_prefix(self, seq: Sequence) -> None:
        """Gives back what `match_prefix` gave a sequence that could not be admitted; the
        blocks stay cached."""
        self.free_seq(seq)
        seq.num_computed = seq.num_cached_tokens = 0

    def count_prefix_match(self, seq: Sequence) -> None:
        """Counts an admitted sequence's prefix lookup: the blocks it looked up (the hits,
        and the miss that ended the match) and the hits."""
        if not self.enable_prefix_caching:
            return
        hits = seq.num_cached_tokens // self.block_size
        self.prefix_hits += hits
        self.prefix_queries += min(hits + 1, self._matchable_blocks(seq))

    def _matchable_blocks(self, seq: Sequence) -> int:
        """Full blocks of a sequence that may come from the cache: all but its last token's,
        and none past the prompt logprobs it still owes, which need their positions' logits
        (cached blocks hold K/V only: a step must compute those positions anyway)."""
        tokens = seq.num_tokens - 1
        if seq.owes_prompt_logprobs:
            tokens = min(tokens, seq.prompt_logprobs_next - 1)
        return tokens // self.block_size

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes the sequence's table cover `num_tokens` tokens; False if the pool is short."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > len(self.free):
            return False
        seq.block_table.extend(self._take_free() for _ in range(missing))
        return True

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks go into the free list first, so they are evicted before the shared
        # prefix blocks that later requests are likelier to ask for.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Shares the parent's blocks with a child. The last block, if partly filled, will be
        written by both, so the child gets its own copy: returns `(src, dst)` for the runner to
        copy, or None. The caller checks `num_free` first."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        for block_id in child.block_table:
            self._ref(block_id)
        if parent.num_computed % self.block_size == 0:
            return None
        src = child.block_table[-1]
        self.blocks[src].ref_count -= 1
        dst = self._take_free()
        child.block_table[-1] = dst
        return src, dst

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hashes the blocks that this step filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed, len(seq.token_ids)) // self.block_size   # known tokens only
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id


class SwapPool:
    """Host-memory blocks that hold the K/V of swapped-out sequences."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, count: int) -> list[int]:
        taken, self.free = self.free[-count:] if count else [], self.free[:len(self.free) - count]
        return taken

    def give_back(self, block_ids: list[int]) -> None:
        self.free.extend(block_ids)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`,
    zeroed: attention reads whole blocks and masks the unused slots, and a masked NaN would
    still poison the sum."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                       dtype=dtype, device=device)
