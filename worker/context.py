"""The metadata of the step being run, read by every attention layer (and LoRA linear).

The model's forward takes only `(input_ids, positions)`; the batch layout that attention
needs (where each sequence's queries start, its block table, where new K/V go) is set here
by the model runner before the forward and cleared after.
"""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [num_tokens] pool slot of each new token, -1 = padding
    block_tables: torch.Tensor        # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor            # [num_seqs] context length after this step
    query_start_loc: torch.Tensor     # [num_seqs + 1] where each sequence's queries start
    max_query_len: int
    max_seq_len: int
    gather_plan: object | None = None  # CPU attention's index plan, shared by all layers
    lora_slots: torch.Tensor | None = None  # [num_tokens] int32 LoRA slot of each token, -1 = base;
                                            # None: no adapter in the step (worker.lora)


_current: AttentionMetadata | None = None


def set_context(metadata: AttentionMetadata | None) -> None:
    global _current
    _current = metadata


def get_context() -> AttentionMetadata:
    assert _current is not None, "attention called outside a model runner step"
    return _current
