"""CUDA graphs for decode-only steps.

A decode step of batch `n` replays the graph captured for the smallest ladder size `>= n`,
with the inputs copied into the graph's static buffers and the padding rows made inert: slot
-1 (their K/V are written nowhere), sequence length 0 and no queries (attention skips them).
Attention is told the largest context the pool allows, so the kernels' launch shapes do not
depend on the step. With LoRA the graphs read each row's adapter slot from a static buffer
too (-1 for base-model rows and padding). Sampling runs outside the graph.
"""

import logging

import torch

from worker.context import AttentionMetadata, set_context

log = logging.getLogger("pagedserve.worker")


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int,
                 max_seq_len: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 lora: bool = False):
        self.model = model
        self.max_seq_len = max_seq_len
        self.sizes = batch_ladder(max_batch)
        new = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.input_ids, self.positions = new(max_batch), new(max_batch)
        self.slot_mapping = new(max_batch)
        self.seq_lens = new(max_batch, dt=torch.int32)
        self.query_start_loc = new(max_batch + 1, dt=torch.int32)
        self.block_tables = new(max_batch, max_blocks_per_seq, dt=torch.int32)
        self.lora_slots = torch.full((max_batch,), -1, dtype=torch.int32, device=device) if lora else None
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                 self.query_start_loc[:size + 1], 1, self.max_seq_len,
                                 lora_slots=None if self.lora_slots is None else self.lora_slots[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the ladder, largest first so smaller graphs reuse its memory pool."""
        self.slot_mapping.fill_(-1)
        for size in reversed(self.sizes):
            metadata = self._metadata(size)
            set_context(metadata)
            try:
                for _ in range(2):   # warm up: Triton compiles, cuBLAS picks kernels
                    self.model(self.input_ids[:size], self.positions[:size])
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size])
            finally:
                set_context(None)
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batches %s", self.sizes)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states `[n, hidden]` of a decode step of `n` sequences."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.query_start_loc[:n + 1].copy_(metadata.query_start_loc)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
            self.query_start_loc[n + 1:size + 1].fill_(n)
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        if self.lora_slots is not None:
            if metadata.lora_slots is None:
                self.lora_slots[:size].fill_(-1)
            else:
                self.lora_slots[:n].copy_(metadata.lora_slots)
                self.lora_slots[n:size].fill_(-1)
        self.graphs[size].replay()
        return self.hidden[:n]
