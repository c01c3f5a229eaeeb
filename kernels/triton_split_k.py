"""What the weight-streaming Triton GEMMs (`kernels.triton_w4a16`, `kernels.triton_fp8`'s
W8A16) share: the tile configuration of a call, and K split into ranges whose partial sums
the last program of each output tile adds (fixed order, no second launch). `num_sms` also
sizes the split decodes of `kernels.triton_attention`.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Splitting K: keep at least this many K-tiles per split (below that the partial sums cost
# more than the parallelism brings), and at most this many splits.
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLIT = 16
_COUNTERS = 1 << 16          # output tiles per launch a counter buffer serves


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes and launch parameters of one call (`kernels.triton_w4a16.pick_config`,
    `kernels.triton_fp8.pick_fp8_config`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    mode: str = "dot"        # the kernel's MODE: "dot", "dot_t" (FP8 only) or "fma" (block_m 1)


@triton.jit
def split_k_reduce(acc, partial, counters, tile_id, pid_k, splits, offs_m, offs_n, mask, M, N):
    """Stores this program's `acc` [BLOCK_M, BLOCK_N] as partial sum `pid_k` of `splits`;
    returns (the sum over all splits, True) in the last program of the output tile to get
    here and (zeros, False) in the others. The sum is taken in split order 0, 1, ..., so it
    does not depend on which program came last.

    `partial` is `[splits, M, N]` float32; `counters[tile_id]` must be 0 on entry, and is 0
    again once every program of the tile is done."""
    plane = M.to(tl.int64) * N
    rows = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(partial + pid_k * plane + rows, acc, mask=mask)
    # Every thread's partial is written before the counter moves (the barrier orders the
    # other threads' stores before the releasing atomic; release is cumulative).
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + tile_id, 1, sem="acq_rel", scope="gpu")
    last = arrived == splits - 1
    total = tl.zeros_like(acc)
    if last:
        ptrs = partial + rows
        for _ in range(0, splits):
            # .cg: from L2, where the other programs' stores are, never a stale L1 line.
            total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            ptrs += plane
        tl.atomic_xchg(counters + tile_id, 0)
    return total, last


_num_sms_cache: dict[int, int] = {}
_counter_cache: dict[torch.device, torch.Tensor] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the CPU interpreter: few enough that the tests' small inputs split
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms_cache:
        _num_sms_cache[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms_cache[index]


def split_k_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The zeroed int32 counters `split_k_reduce` needs for `tiles` output tiles.

    One buffer per device, zeroed once when first asked for outside a CUDA-graph capture and
    left at zero by every launch that uses it: launches that share it must not run at the
    same time on different streams (the engine runs its steps on one stream at a time, eagerly
    or replayed). Asked for first inside a capture, a buffer of this launch's own is made
    instead and its zeroing is captured with it, so the graph stays right whatever runs
    before its replays (a buffer cached there would be zeroed only when that graph replays)."""
    if tiles > _COUNTERS:
        raise ValueError(f"{tiles} output tiles in one split-K launch; at most {_COUNTERS}")
    buf = _counter_cache.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(tiles, dtype=torch.int32, device=device)
        buf = _counter_cache[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return buf


def pick_split(tiles_k: int, programs: int, device: torch.device, per_sm: float,
               min_tiles: int = _MIN_TILES_PER_SPLIT, max_split: int = _MAX_SPLIT) -> int:
    """How many K ranges: enough for `per_sm` programs per SM (several co-reside on an SM, each
    one's loads adding to the bytes in flight), each range at least `min_tiles` K-tiles long,
    and at most `max_split` (the partial sums cost more beyond)."""
    wanted = math.ceil(per_sm * num_sms(device) / programs)
    return max(1, min(wanted, tiles_k // min_tiles, max_split))
