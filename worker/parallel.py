"""Tensor parallelism: which slice of each weight a rank holds, and the collectives between ranks.

A worker with `tensor_parallel_size` N is N processes, one per GPU (NCCL) or N on the CPU
(gloo). Attention is split by KV heads, each rank taking its KV heads' query heads; with fewer
KV heads than ranks, each KV head is replicated on N / num_kv_heads ranks, which split its
query heads. The MLP is split by intermediate rows, the embedding and the LM head by
vocabulary. Splits are contiguous and as even as possible. Each layer's partial output is
summed with one all-reduce (after o_proj and after down_proj); the LM head's slices are
gathered on rank 0, which samples.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker.config import EngineConfig


@dataclass(frozen=True)
class Shard:
    """This process's place among the ranks of one worker."""

    rank: int = 0
    size: int = 1

    def split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's contiguous part of `total` items, as even as possible."""
        base, extra = divmod(total, self.size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)

    def padded_split(self, total: int) -> tuple[int, int, int]:
        """(start, length, padded length) for slices that must be the same size on every rank
        (they are gathered): ceil(total / size) each, the last one padded."""
        per_rank = -(-total // self.size)
        start = min(self.rank * per_rank, total)
        return start, min(per_rank, total - start), per_rank


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank computes: query heads [q_start, q_start + num_heads) and
    KV heads [kv_start, kv_start + num_kv_heads)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def split_heads(num_heads: int, num_kv_heads: int, shard: Shard) -> HeadSplit:
    """Raises ValueError when the heads cannot be split over `shard.size` ranks."""
    group = num_heads // num_kv_heads          # query heads per KV head
    if num_kv_heads >= shard.size:
        kv_start, kv_count = shard.split(num_kv_heads)
        return HeadSplit(kv_start * group, kv_count * group, kv_start, kv_count)
    replicas = shard.size // num_kv_heads
    if shard.size % num_kv_heads or group % replicas:
        raise ValueError(f"tensor_parallel_size={shard.size} cannot split {num_heads} query heads "
                         f"over {num_kv_heads} KV heads: with fewer KV heads than ranks, the ranks "
                         f"must be a multiple of the KV heads and divide each KV head's {group} "
                         f"query heads evenly")
    kv = shard.rank // replicas
    per_rank = group // replicas
    return HeadSplit(kv * group + (shard.rank % replicas) * per_rank, per_rank, kv, 1)


def check_splittable(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raises ValueError naming the problem when no rank of `size` could take its heads."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size} must be >= 1")
    if num_heads < size:
        raise ValueError(f"tensor_parallel_size={size} is more than the model's {num_heads} "
                         "attention heads")
    for rank in range(size):
        split_heads(num_heads, num_kv_heads, Shard(rank, size))


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Sums `x` over the ranks, in place."""
    if shard.size > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """Rank 0 gets every rank's `x` concatenated along the last dimension; the others None."""
    if shard.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(shard.size)] if shard.rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def min_over_ranks(value: int, shard: Shard, device: torch.device) -> int:
    """The smallest of every rank's `value`."""
    if shard.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def device_for(config: EngineConfig, rank: int) -> torch.device:
    """Rank r of a GPU worker uses GPU r (CUDA_VISIBLE_DEVICES picks which ones those are)."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", rank)
