"""How rank 0 of a tensor-parallel worker sends every device operation to the other ranks.

Each operation (a step, a block copy, a swap, stop) goes out as two broadcasts of int64
tensors: a fixed header, then the operation's arrays. So no Python object is pickled per
step; the step's arrays are rank 0's device tensors, pending tokens already in place, so the
broadcast queues behind rank 0's work without a host sync.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker.context import AttentionMetadata
from worker.parallel import Shard
from worker.transfer import to_device

STEP, COPY, SWAP, STOP = 1, 2, 3, 4
HEADER = 8


@dataclass
class StepArrays:
    """One step's inputs as every rank needs them: `rows` are the hidden rows whose logits
    are computed (None: no logits this step), `score_rows` those whose logits are reduced to
    prompt logprobs (None: none; see ModelRunner.forward_logits)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    rows: torch.Tensor | None
    score_rows: torch.Tensor | None = None


class StepChannel:
    """Rank 0's side sends, the others' side receives; the same class on both."""

    def __init__(self, device: torch.device, shard: Shard):
        self.device, self.shard = device, shard

    # ---------------------------------------------------------------- rank 0

    def send_step(self, step: StepArrays) -> None:
        md = step.metadata
        rows = step.rows if step.rows is not None else step.input_ids[:0]
        score_rows = step.score_rows if step.score_rows is not None else step.input_ids[:0]
        block_tables = md.block_tables.flatten()
        self._send([STEP, step.input_ids.numel(), md.seq_lens.numel(), md.block_tables.shape[1],
                    -1 if step.rows is None else rows.numel(), md.max_query_len, md.max_seq_len,
                    -1 if step.score_rows is None else score_rows.numel()],
                   [step.input_ids, step.positions, md.slot_mapping, md.seq_lens, md.query_start_loc,
                    block_tables, rows, score_rows])

    def send_copies(self, pairs: torch.Tensor) -> None:
        self._send([COPY, pairs.shape[0]], [pairs.flatten()])

    def send_swaps(self, moves: list[tuple[str, int, int]]) -> None:
        flat = [x for direction, a, b in moves for x in (direction == "in", a, b)]
        self._send([SWAP, len(moves)], [to_device(flat, torch.long, self.device)])

    def send_stop(self) -> None:
        self._send([STOP], [])

    def _send(self, header: list[int], arrays: list[torch.Tensor]) -> None:
        head = to_device(header + [0] * (HEADER - len(header)), torch.long, self.device)
        dist.broadcast(head, src=0)
        if arrays:
            payload = torch.cat([a.to(self.device, torch.long).flatten() for a in arrays])
            dist.broadcast(payload, src=0)

    # ---------------------------------------------------------------- ranks 1..N-1

    def receive(self) -> tuple[int, list[int], torch.Tensor | None]:
        head = torch.empty(HEADER, dtype=torch.long, device=self.device)
        dist.broadcast(head, src=0)
        header = head.tolist()
        size = self._payload_size(header)
        if size is None:
            return header[0], header, None
        payload = torch.empty(size, dtype=torch.long, device=self.device)
        dist.broadcast(payload, src=0)
        return header[0], header, payload

    @staticmethod
    def _payload_size(header: list[int]) -> int | None:
        op = header[0]
        if op == STEP:
            n_tokens, n_seqs, max_blocks, n_rows = header[1:5]
            return 3 * n_tokens + 2 * n_seqs + 1 + n_seqs * max_blocks + max(n_rows, 0) + max(header[7], 0)
        if op == COPY:
            return 2 * header[1]
        if op == SWAP:
            return 3 * header[1]
        return None

    @staticmethod
    def unpack_step(header: list[int], payload: torch.Tensor) -> StepArrays:
        n_tokens, n_seqs, max_blocks, n_rows, max_query_len, max_seq_len, n_score_rows = header[1:8]
        sizes = [n_tokens, n_tokens, n_tokens, n_seqs, n_seqs + 1, n_seqs * max_blocks, max(n_rows, 0),
                 max(n_score_rows, 0)]
        ids, positions, slots, seq_lens, starts, tables, rows, score_rows = payload.split(sizes)
        metadata = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.view(n_seqs, max_blocks).int(), seq_lens=seq_lens.int(),
            query_start_loc=starts.int(), max_query_len=max_query_len, max_seq_len=max_seq_len)
        return StepArrays(ids, positions, metadata, rows if n_rows >= 0 else None,
                          score_rows if n_score_rows >= 0 else None)

    @staticmethod
    def unpack_swaps(payload: torch.Tensor) -> list[tuple[str, int, int]]:
        return [("in" if d else "out", a, b) for d, a, b in payload.view(-1, 3).tolist()]
