"""Batched LoRA for a step that mixes adapters: shrink and expand indexed by a per-token slot.

Every adapter loaded on the device sits in a slot of stacked buffers, one pair per decoder
linear. A linear with `P` pieces packed along its outputs (q/k/v: 3, gate/up: 2, the others
1) keeps, for slot `s`:

    a[s]: [P * R, in]    rows p*R .. p*R + R - 1 are piece p's A, zero-padded to rank R
    b[s]: [out, R]       output row o of piece p holds piece p's B row, scaling folded in

so token `t` with adapter slot `slots[t]` (-1: no adapter) adds

    delta[t, o] = sum_j shrunk[t, p(o) * R + j] * b[slots[t], o, j],  shrunk[t] = a[slots[t]] @ x[t]

to the base layer's output. Each output row belongs to one piece, which is why `b` needs only
R columns even for a packed layer. `pieces` lists each piece's output rows as
`(start, size)`, in order.

A base weight may also carry every slot's A below its own rows (`worker.lora` folds them
in where the extra rows are few), so that the base GEMM returns `y_aug [T, out + S*P*R]`:
the outputs, then each slot's shrink. `lora_expand_folded` picks each token's slot's shrink
from there and returns the outputs with the deltas added, as a new `[T, out]` tensor.

`lora_shrink` / `lora_expand` / `lora_expand_folded` dispatch to the Triton kernels on a GPU (`kernels.triton_lora`)
and to the plain PyTorch reference here otherwise; the reference is also the tests' oracle.
"""

import torch


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[T, P*R]` float32: each token's input through its slot's A (zeros for slot -1)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in torch.unique(slots).tolist():
        if slot >= 0:
            rows = slots == slot
            out[rows] = x[rows].float() @ a[slot].float().t()
    return out


def lora_expand_ref(y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    pieces: list[tuple[int, int]]) -> torch.Tensor:
    """Adds each token's LoRA delta to `y [T, out]` in place and returns it."""
    rank = b.shape[2]
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = slots == slot
        for p, (start, size) in enumerate(pieces):
            delta = shrunk[rows, p * rank:(p + 1) * rank] @ b[slot, start:start + size].float().t()
            y[rows, start:start + size] += delta.to(y.dtype)
    return y


def lora_expand_folded_ref(y_aug: torch.Tensor, out_features: int, b: torch.Tensor,
                           slots: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """`[T, out_features]`: the outputs of `y_aug` plus each token's delta, its shrink taken
    from its slot's columns of `y_aug` (a new tensor)."""
    num_slots, _, rank = b.shape
    shrunk_all = y_aug[:, out_features:].view(y_aug.shape[0], num_slots, len(pieces) * rank)
    valid = slots >= 0
    shrunk = shrunk_all[torch.arange(y_aug.shape[0], device=y_aug.device), slots.clamp(min=0).long()]
    shrunk = torch.where(valid[:, None], shrunk.float(), 0.0)
    return lora_expand_ref(y_aug[:, :out_features].clone(), shrunk, b, slots, pieces)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from kernels.triton_lora import lora_shrink_triton
        return lora_shrink_triton(x, a, slots)
    return lora_shrink_ref(x, a, slots)


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                pieces: list[tuple[int, int]]) -> torch.Tensor:
    if y.is_cuda:
        from kernels.triton_lora import lora_expand_triton
        return lora_expand_triton(y, shrunk, b, slots, pieces)
    return lora_expand_ref(y, shrunk, b, slots, pieces)


def lora_expand_folded(y_aug: torch.Tensor, out_features: int, b: torch.Tensor,
                       slots: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    if y_aug.is_cuda:
        from kernels.triton_lora import lora_expand_folded_triton
        return lora_expand_folded_triton(y_aug, out_features, b, slots, pieces)
    return lora_expand_folded_ref(y_aug, out_features, b, slots, pieces)
