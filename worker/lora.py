"""Multi-LoRA on the device: adapter slots in the decoder's linears, and who holds which slot.

With `--enable-lora` each of the four packed projections of every decoder layer (q/k/v, o,
gate/up, down) is wrapped in a `LoRALinear` that owns `max_loras` slots of stacked A and B
(layout in `kernels.lora`). A step's tokens carry their sequence's slot (`-1`: the base model)
in `worker.context`, so one forward serves base and adapter tokens of any mix; the slot
buffers have fixed shapes, so CUDA graphs capture them like any other weight.

`LoRASlots` keeps the adapters the engine knows (read from disk by
`worker.models.lora_checkpoint`, at most `max_cpu_loras` in host memory, least recently used
dropped first) and maps them onto the device slots: a running sequence pins its adapter's
slot; a slot no running sequence pins is reused, least recently used first, for the next
adapter that needs one. Copying an adapter into a slot is queued on the device stream before
the step that needs it, after any step still reading the slot's previous adapter.
"""

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from kernels.linear import linear
from kernels.lora import lora_expand, lora_expand_folded, lora_shrink
from worker.context import get_context
from worker.models.lora_checkpoint import PACKED_PIECES, LoRAWeights

log = logging.getLogger("pagedserve.worker")


# A plain (unquantized) linear takes its slots' A as extra rows of its own weight when they
# add at most this share of its rows: its GEMM then computes every slot's shrink for a few
# per cent more bytes, one launch fewer per projection (launches, not bytes, are what LoRA
# costs at small batches: docs/BENCHMARKS.md).
FOLD_MAX_EXTRA_ROWS = 1 / 8


class LoRALinear(nn.Module):
    """A decoder linear plus `num_slots` LoRA adapters, picked per token."""

    def __init__(self, base: nn.Module, pieces: list[tuple[int, int]], in_features: int,
                 num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.pieces, self.max_rank = base, pieces, max_rank
        self.out_features = out_features = sum(size for _, size in pieces)
        extra = num_slots * len(pieces) * max_rank
        self.folded = isinstance(base, nn.Linear) and extra <= FOLD_MAX_EXTRA_ROWS * out_features
        if self.folded:
            # weight = [W; A of slot 0; ...; A of slot S-1]; `lora_a` is a view of its tail,
            # so loading a slot writes straight into the base GEMM's weight.
            weight = torch.cat([base.weight.detach(), base.weight.new_zeros(extra, in_features)])
            base.weight = nn.Parameter(weight, requires_grad=False)
            if base.bias is not None:
                base.bias = nn.Parameter(torch.cat([base.bias.detach(), base.bias.new_zeros(extra)]),
                                         requires_grad=False)
            lora_a = weight[out_features:].view(num_slots, len(pieces) * max_rank, in_features)
        else:
            lora_a = torch.zeros(num_slots, len(pieces) * max_rank, in_features, dtype=dtype,
                                 device=device)
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, out_features, max_rank, dtype=dtype,
                                                   device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = get_context().lora_slots
        if not self.folded:
            y = self.base(x)
            if slots is None:
                return y
            return lora_expand(y, lora_shrink(x, self.lora_a, slots), self.lora_b, slots, self.pieces)
        weight, bias, n = self.base.weight, self.base.bias, self.out_features
        if slots is None:       # the leading rows alone: the base model's own GEMM
            return linear(x, weight[:n], None if bias is None else bias[:n])
        return lora_expand_folded(linear(x, weight, bias), n, self.lora_b, slots, self.pieces)

    def load_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Puts one adapter's (a [P, r, in], b [out, r]) in `slot`; None leaves the slot inert
        for this layer (the adapter does not touch it)."""
        a_slot = self.lora_a[slot].view(len(self.pieces), self.max_rank, -1)
        if weights is None:
            a_slot.zero_()
            self.lora_b[slot].zero_()
            return
        a, b = weights
        rank = a.shape[1]
        a_slot[:, :rank].copy_(a, non_blocking=True)
        a_slot[:, rank:].zero_()
        self.lora_b[slot, :, :rank].copy_(b, non_blocking=True)
        self.lora_b[slot, :, rank:].zero_()


def attach_lora(model: nn.Module, num_slots: int, max_rank: int) -> dict[tuple[int, str], LoRALinear]:
    """Wraps every decoder layer's packed projections; returns them by (layer, projection)."""
    cfg = model.config
    weight = model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    layout = {  # projection -> (its module's parent attribute, output pieces, input features)
        "qkv_proj": ("self_attn", [(0, q), (q, kv), (q + kv, kv)], h),
        "o_proj": ("self_attn", [(0, h)], q),
        "gate_up_proj": ("mlp", [(0, inter), (inter, inter)], h),
        "down_proj": ("mlp", [(0, h)], inter),
    }
    assert set(layout) == set(PACKED_PIECES)
    if isinstance(model.layers[0].self_attn.qkv_proj, LoRALinear):
        raise ValueError("the model already has LoRA slots: weights shared between engines "
                         "cannot each get their own (load the model for the LoRA engine alone)")
    wrapped = {}
    for i, layer in enumerate(model.layers):
        for name, (parent, pieces, fan_in) in layout.items():
            owner = getattr(layer, parent)
            module = LoRALinear(getattr(owner, name), pieces, fan_in, num_slots, max_rank, dtype, device)
            setattr(owner, name, module)
            wrapped[(i, name)] = module
    return wrapped


@dataclass
class LoadedAdapter:
    """An adapter the engine holds: its weights and where it is."""
    weights: LoRAWeights
    load_id: int                  # distinct per load: keys its prefix-cache entries
    slot: int | None = None       # device slot, if in one
    in_use: int = 0               # sequences of it the engine holds (not only running ones)
    unloading: bool = False       # takes no new requests: forgotten once `in_use` reaches 0


class LoRASlots:
    """The adapters the engine knows and the device slots they occupy."""

    def __init__(self, layers: dict[tuple[int, str], LoRALinear], num_slots: int, max_cpu_loras: int):
        self.layers, self.num_slots, self.max_cpu_loras = layers, num_slots, max_cpu_loras
        self.adapters: OrderedDict[str, LoadedAdapter] = OrderedDict()   # least recently used first
        self.slot_owner: list[str | None] = [None] * num_slots
        self.pins = [0] * num_slots          # running sequences using each slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self._load_ids = itertools.count(1)
        self.loads = self.evictions = 0       # slot loads, and adapters dropped from host memory

    def add(self, weights: LoRAWeights) -> list[str]:
        """Registers an adapter (replacing one of the same name that no sequence uses);
        returns the names of adapters dropped to stay within `max_cpu_loras`."""
        old = self.adapters.get(weights.name)
        if old is not None:
            if old.in_use:
                raise ValueError(f"LoRA adapter {weights.name!r} is in use by {old.in_use} sequences; "
                                 f"unload it first")
            self._drop(weights.name)
        dropped = []
        while len(self.adapters) >= self.max_cpu_loras:
            idle = next((n for n, a in self.adapters.items() if not a.in_use), None)
            if idle is None:
                raise ValueError(f"cannot load LoRA adapter {weights.name!r}: all {self.max_cpu_loras} "
                                 f"adapters held (--max-cpu-loras) have requests in flight")
            self._drop(idle)
            dropped.append(idle)
            self.evictions += 1
        self.adapters[weights.name] = LoadedAdapter(weights, next(self._load_ids))
        return dropped

    def remove(self, name: str) -> None:
        """Forgets an adapter; it must have no sequences left (the caller waits for them)."""
        adapter = self.adapters[name]
        if adapter.in_use:
            raise ValueError(f"LoRA adapter {name!r} still has {adapter.in_use} sequences")
        self._drop(name)

    def _drop(self, name: str) -> None:
        adapter = self.adapters.pop(name)
        if adapter.slot is not None:
            self.slot_owner[adapter.slot] = None

    def get(self, name: str) -> LoadedAdapter | None:
        return self.adapters.get(name)

    def acquire(self, name: str) -> int | None:
        """The slot of `name` for a sequence about to run, pinned until `release`; loads the
        adapter into a free or idle slot if needed. None: every slot is pinned by others."""
        adapter = self.adapters[name]
        self.adapters.move_to_end(name)
        if adapter.slot is None:
            slot = next((s for s in self.slot_lru if self.pins[s] == 0), None)
            if slot is None:
                return None
            if (previous := self.slot_owner[slot]) is not None:
                self.adapters[previous].slot = None
            for key, layer in self.layers.items():
                layer.load_slot(slot, adapter.weights.layers.get(key))
            self.slot_owner[slot], adapter.slot = name, slot
            self.loads += 1
            log.info("LoRA adapter %r in device slot %d", name, slot)
        self.pins[adapter.slot] += 1
        self.slot_lru.move_to_end(adapter.slot)
        return adapter.slot

    def release(self, slot: int) -> None:
        self.pins[slot] -= 1

    @property
    def slots_in_use(self) -> int:
        return sum(owner is not None for owner in self.slot_owner)
