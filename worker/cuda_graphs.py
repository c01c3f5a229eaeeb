"""CUDA graphs for decode steps and for small mixed steps.

Two ladders of captured forwards:

* decode graphs, one per batch size: a decode-only step of `n` sequences replays the graph
  of the smallest ladder size `>= n`;
* mixed graphs, one per token count up to `MAX_MIXED_TOKENS`: a step with prompt chunks of
  `t` tokens in all (decodes included) replays the smallest one `>= t`. Such steps are
  frequent under online traffic (a chat turn arriving beside running decodes), and run
  eagerly their launches took the host 11-18 ms more than the device needed (W5 on an H200),
  time every running sequence waited. Larger chunks keep the device busy longer than their
  eager launches take, so they gain nothing from a graph.

Inputs are copied into the graphs' static buffers and the padding made inert: slot -1 (its
K/V are written nowhere), padding sequences of length 0 with no queries (attention skips
them), padding tokens past the last sequence's queries (their rows are computed and never
read). Attention is told the largest context the pool allows and, in a mixed graph, a
query length above one, so the kernels' launch shapes do not depend on the step. With LoRA
the graphs read each token's adapter slot from a static buffer too (-1 for base-model
tokens and padding). Sampling runs outside the graph.
"""

import logging

import torch

from worker.context import AttentionMetadata, set_context

log = logging.getLogger("pagedserve.worker")

MAX_MIXED_TOKENS = 1024


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


def mixed_ladder(max_tokens: int) -> list[int]:
    """Token counts of the mixed graphs: a step of more than 96 tokens is padded by under a
    third of its tokens (smaller ones cost their weights' bytes whatever their padding)."""
    sizes = [16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class StepGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_mixed_tokens: int,
                 max_blocks_per_seq: int, max_seq_len: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, lora: bool = False):
        """`max_batch`: the most sequences a step holds; `max_mixed_tokens`: the largest mixed
        step to capture (0: none)."""
        self.model = model
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.decode_sizes = batch_ladder(max_batch)
        self.mixed_sizes = mixed_ladder(max_mixed_tokens) if max_mixed_tokens > 1 else []
        max_tokens = max([max_batch] + self.mixed_sizes)
        new = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.input_ids, self.positions = new(max_tokens), new(max_tokens)
        self.slot_mapping = new(max_tokens)
        self.seq_lens = new(max_batch, dt=torch.int32)
        self.query_start_loc = new(max_batch + 1, dt=torch.int32)
        self.block_tables = new(max_batch, max_blocks_per_seq, dt=torch.int32)
        self.lora_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device) if lora else None
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        # (False, batch size) for a decode graph, (True, token count) for a mixed one
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _seqs(self, mixed: bool, size: int) -> int:
        """Sequences a graph holds: one per token, at most the step's limit."""
        return min(size, self.max_batch) if mixed else size

    def _metadata(self, mixed: bool, size: int) -> AttentionMetadata:
        seqs = self._seqs(mixed, size)
        return AttentionMetadata(self.slot_mapping[:size], self.block_tables[:seqs], self.seq_lens[:seqs],
                                 self.query_start_loc[:seqs + 1], size if mixed else 1, self.max_seq_len,
                                 lora_slots=None if self.lora_slots is None else self.lora_slots[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures both ladders, largest first so smaller graphs reuse its memory pool."""
        self.slot_mapping.fill_(-1)
        # Warm-up and capture see no queries: every kernel skips every sequence.
        self.query_start_loc.fill_(0)
        ladders = [(True, s) for s in self.mixed_sizes] + [(False, s) for s in self.decode_sizes]
        for mixed, size in sorted(ladders, key=lambda key: -key[1]):
            set_context(self._metadata(mixed, size))
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
            self.graphs[mixed, size] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batches %s and mixed steps of %s tokens",
                 self.decode_sizes, self.mixed_sizes)

    def _pick(self, num_tokens: int, num_seqs: int, mixed: bool) -> int | None:
        """The size of the graph that holds the step, None if none does."""
        sizes = self.mixed_sizes if mixed else self.decode_sizes
        if num_seqs > self.max_batch:
            return None
        return next((s for s in sizes if s >= num_tokens), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states `[num_tokens, hidden]` of the step, or None when no graph fits it."""
        n, seqs = input_ids.shape[0], metadata.seq_lens.shape[0]
        mixed = metadata.max_query_len > 1
        size = self._pick(n, seqs, mixed)
        if size is None:
            return None
        graph_seqs = self._seqs(mixed, size)
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:seqs].copy_(metadata.seq_lens)
        self.query_start_loc[:seqs + 1].copy_(metadata.query_start_loc)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
        if graph_seqs > seqs:
            self.seq_lens[seqs:graph_seqs].fill_(0)
            self.query_start_loc[seqs + 1:graph_seqs + 1].fill_(n)
        self.block_tables[:seqs, :width].copy_(metadata.block_tables)
        if self.lora_slots is not None:
            if metadata.lora_slots is None:
                self.lora_slots[:size].fill_(-1)
            else:
                self.lora_slots[:n].copy_(metadata.lora_slots)
                self.lora_slots[n:size].fill_(-1)
        self.graphs[mixed, size].replay()
        return self.hidden[:n]
