"""Runs one scheduled step on the device: flat inputs, forward, logits, sampling.

Owns the model and the KV pool tensor. Inputs are built with numpy from the scheduled
sequences (no per-token Python loop), copied to the device in one go, and the attention
metadata is published through `worker.context` for the duration of the forward. Nothing here
waits for the GPU: a sequence's pending token (drawn by the step still in flight) is read
from that step's device tensor, and the draws come back as `SampledTokens`.
"""

import itertools
import logging

import numpy as np
import torch

from kernels.attention import gather_plan
from kernels.cache import FP8_KV_DTYPE, copy_blocks, swap_blocks
from worker.config import EngineConfig, ModelConfig
from worker.context import AttentionMetadata, set_context
from worker.cuda_graphs import MAX_MIXED_TOKENS, StepGraphs
from worker.kv_pool import allocate_kv_cache
from worker.lora import LoRASlots, attach_lora
from worker.models.loader import ModelSource, load_model
from worker.models.quantization import FP8_MIN_CAPABILITY, quantization_label
from worker.parallel import Shard, device_for, min_over_ranks
from worker.sampler import PromptLogprobs, PromptScoring, SampledTokens, SamplingBatch, sample, token_logprobs
from worker.scheduler import ScheduledSeq
from worker.step_channel import StepArrays, StepChannel
from worker.transfer import to_device

log = logging.getLogger("pagedserve.worker")

# Rows of logits computed at once for prompt logprobs. The pool is sized after a profile whose
# forward computed this many rows' logits, so a step scoring a whole prefill chunk computes
# them this many at a time, keeping only their logprobs, rather than a chunk's worth (budget x
# vocabulary floats: 1 GiB for 2048 tokens of a 128k vocabulary) the profile never measured.
MAX_LOGITS_ROWS = 256


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and float32 on the CPU (CPU half matmuls are slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """As Info and the metrics name a pool's dtype: vLLM's fp8_e4m3, else PyTorch's name."""
    return "fp8_e4m3" if dtype == FP8_KV_DTYPE else str(dtype).removeprefix("torch.")


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype for --kv-cache-dtype `name`: the model's (`dtype`) for auto."""
    if name == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        found = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"kv_cache_dtype={name!r} needs a GPU of compute capability "
                         f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or later (float8 conversions), and "
                         f"{torch.cuda.get_device_name(device)} has {found}: use kv_cache_dtype='auto'")
    return FP8_KV_DTYPE


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} asked for, but no CUDA GPU is available")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource,
                 loaded: tuple[ModelConfig, torch.nn.Module] | None = None, shard: Shard = Shard()):
        """`loaded` reuses weights already in memory (an engine with another pool or limits);
        `shard`: this rank's place in a tensor-parallel worker (whose ranks build runners in
        step: the pool is sized together)."""
        self.config, self.shard = config, shard
        self.device = resolve_device(config.device) if shard.size == 1 else device_for(config, shard.rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)  # before loading
        self.model_config, self.model = loaded or load_model(source, self.device, self.dtype, config.seed, shard,
                                                            config.quantization)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads     # this rank's
        self.quantization = quantization_label(config.quantization, self.model_config.quantization,
                                               self.device.type)
        if self.kv_dtype == FP8_KV_DTYPE and shard.rank == 0:
            self._log_kv_scales()
        # Before the pool is sized: the adapter slots take device memory too.
        self.lora = None if not config.enable_lora else LoRASlots(
            attach_lora(self.model, config.max_loras, config.max_lora_rank), config.max_loras,
            config.max_cpu_loras)
        self.num_blocks = self._size_pool()
        # Rank 0 of a tensor-parallel worker sends every device operation to the other ranks.
        self.channel = StepChannel(self.device, shard) if shard.size > 1 and shard.rank == 0 else None
        cfg = self.model_config
        self.kv_cache = allocate_kv_cache(cfg.num_layers, self.num_blocks, self.block_size,
                                          self.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        for layer, cache in zip(self.model.layers, self.kv_cache):
            layer.self_attn.k_cache, layer.self_attn.v_cache = cache[0], cache[1]
        self.num_swap_blocks = (config.num_swap_blocks if config.num_swap_blocks is not None else
                                min_over_ranks(int(config.swap_space_gb * 2**30) // self.block_bytes,
                                               shard, self.device))
        # Block-first, unlike the device pool, so that a block is one contiguous span for its
        # copy (kernels.cache.swap_blocks). Uninitialised: a host block is only ever read after
        # a swap-out wrote all of it.
        self.swap_cache = torch.empty(self.num_swap_blocks, 2, cfg.num_layers, self.block_size,
                                      self.num_kv_heads, cfg.head_dim, dtype=self.kv_dtype,
                                      pin_memory=self.device.type == "cuda")
        self.pending_copies: list[tuple[int, int]] = []
        self.graphs = None
        if self.device.type == "cuda":
            self._alloc_staging()
            log.info("compiling the attention kernels of mixed steps")
            self._compile_eager_kernels()
            # Tensor-parallel ranks run eagerly: their collectives are not captured (yet).
            if not config.enforce_eager and shard.size == 1:
                self.graphs = StepGraphs(
                    self.model, min(config.max_num_seqs, config.max_num_batched_tokens),
                    min(MAX_MIXED_TOKENS, config.max_num_batched_tokens), self.max_blocks_per_seq,
                    self.max_model_len, cfg.hidden_size, self.dtype, self.device,
                    lora=self.lora is not None)
                log.info("capturing CUDA graphs of %d decode batch sizes and %d mixed step sizes",
                         len(self.graphs.decode_sizes), len(self.graphs.mixed_sizes))
                self.graphs.capture()
        log.info("model %s on %s (%s): %d KV blocks of %d tokens = %d tokens, %.2f GiB of %s",
                 cfg.architecture, self.device, str(self.dtype).removeprefix("torch."), self.num_blocks,
                 self.block_size, self.num_blocks * self.block_size, self.kv_cache.numel()
                 * self.kv_cache.element_size() / 2**30, str(self.kv_dtype).removeprefix("torch."))

    def _log_kv_scales(self) -> None:
        layers = [layer.self_attn for layer in self.model.layers]
        loaded = sum(a.kv_scales_loaded for a in layers)
        if loaded == len(layers):
            log.info("FP8 KV cache with the checkpoint's k_scale/v_scale")
            return
        missing = [i for i, a in enumerate(layers) if not a.kv_scales_loaded]
        log.warning("FP8 KV cache: the checkpoint has no k_scale/v_scale for %d of %d layers (first: "
                    "layer %d): their K/V are stored unscaled (scale 1.0), which clips values "
                    "beyond ±448 and rounds small ones coarsely; a checkpoint calibrated with a "
                    "kv_cache_scheme (llm-compressor) avoids both", len(missing), len(layers), missing[0])

    @torch.inference_mode()
    def _compile_eager_kernels(self) -> None:
        """Runs two throwaway mixed steps so that every attention kernel variant an eager step
        can use is compiled now rather than inside the step loop, where a compile stalls all
        running requests for a second or more: a decode next to a short prompt (one split,
        short query tiles) and a decode over a long context next to a long prompt (split
        decode, long query tiles). Nothing is written to the pool (slots -1). Every rank of a
        tensor-parallel worker runs the same steps, so their collectives pair up."""
        long_context = min(self.max_model_len, 4096)
        for context, prompt in ((1, 2), (long_context, 128)):
            blocks = -(-max(context, prompt) // self.block_size)
            n = 1 + prompt
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            set_context(AttentionMetadata(
                slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
                block_tables=torch.zeros(2, blocks, dtype=torch.int32, device=self.device),
                seq_lens=torch.tensor([context, prompt], dtype=torch.int32, device=self.device),
                query_start_loc=torch.tensor([0, 1, n], dtype=torch.int32, device=self.device),
                max_query_len=prompt, max_seq_len=max(context, prompt)))
            try:
                self.model(ids, ids)
            finally:
                set_context(None)

    @property
    def max_model_len(self) -> int:
        cfg = self.model_config
        return min(self.config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings,
                   self.num_blocks * self.block_size)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def _alloc_staging(self) -> None:
        """Pinned host buffers the step inputs are written into, then copied asynchronously:
        two sets, used by turns, each with an event recorded after its copies were queued.
        While step N runs, step N+1 fills the other set once step N-1's copies from it have
        run. That wait is free when the host has read step N-1's draws since, but nothing
        else orders it: a run of prompt chunks draws no token, the host races ahead of the
        device, and without the event it rewrote a set (slot mapping, block tables) that a
        queued copy had still to read."""
        tokens, seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        pinned = lambda *shape, dt: torch.zeros(*shape, dtype=dt).pin_memory()  # noqa: E731
        self.staging_sets = [{
            "input_ids": pinned(tokens, dt=torch.int64), "positions": pinned(tokens, dt=torch.int64),
            "slot_mapping": pinned(tokens, dt=torch.int64), "seq_lens": pinned(seqs, dt=torch.int32),
            "query_start_loc": pinned(seqs + 1, dt=torch.int32),
            "block_tables": pinned(seqs * self.max_blocks_per_seq, dt=torch.int32),
            "lora_slots": pinned(tokens, dt=torch.int32)} for _ in range(2)]
        self.staging_copied: list[torch.cuda.Event | None] = [None, None]
        self.staging_turn = 0
        self.staging = self.staging_sets[0]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this rank's KV heads."""
        per_head = self.model_config.kv_bytes_per_token // self.model_config.num_kv_heads
        return self.block_size * per_head * self.num_kv_heads * self.kv_dtype.itemsize

    def _size_pool(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if self.device.type == "cuda":
            blocks = self._profile_gpu_blocks()
        else:
            blocks = max(1, int(self.config.kv_cache_memory_gb * 2**30) // self.block_bytes)
        return min_over_ranks(blocks, self.shard, self.device)   # one block table for all ranks

    @torch.inference_mode()
    def _profile_gpu_blocks(self) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the GPU after the weights and the
        activations of a forward at the full step token budget."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = self.config.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        set_context(AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros(1, -(-n // self.block_size), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            max_query_len=n, max_seq_len=n,
            # Adapters' activations count too (a folded linear's output is wider).
            lora_slots=None if self.lora is None else torch.zeros(n, dtype=torch.int32, device=self.device)))
        empty_pool = torch.zeros(1, self.block_size, self.model_config.num_kv_heads,
                                 self.model_config.head_dim, dtype=self.kv_dtype, device=self.device)
        for layer in self.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = empty_pool
        try:
            self.model.compute_logits(self.model(ids, ids)[-MAX_LOGITS_ROWS:])
        finally:
            set_context(None)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        total = torch.cuda.get_device_properties(self.device).total_memory
        available = total * self.config.gpu_memory_utilization - peak
        if available < self.block_bytes:
            raise RuntimeError(f"no GPU memory left for the KV cache: weights and activations take "
                               f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise "
                               f"--gpu-memory-utilization or lower --max-num-batched-tokens")
        return int(available // self.block_bytes)

    def _to_device(self, array: np.ndarray, name: str) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type != "cuda":
            return tensor
        if array.size > self.staging[name].numel():
            return to_device(array, tensor.dtype, self.device)
        staged = self.staging[name][:array.size].view(array.shape)
        staged.numpy()[...] = array
        return staged.to(self.device, non_blocking=True)

    def prepare(self, scheduled: list[ScheduledSeq], previous: SampledTokens | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Step inputs on the device; pending tokens are read from `previous`' draws."""
        if self.device.type == "cuda":
            self._next_staging_set()
        bs = self.block_size
        query_lens = np.array([s.num_tokens for s in scheduled], dtype=np.int64)
        starts = np.array([s.seq.num_computed for s in scheduled], dtype=np.int64)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        # Position of each token: its sequence's start plus its offset within the chunk.
        seq_of_token = np.repeat(np.arange(len(scheduled)), query_lens)
        positions = starts[seq_of_token] + np.arange(query_start_loc[-1]) - query_start_loc[seq_of_token]
        # A pending token is the last of its (one-token) chunk: a placeholder here, its id
        # copied on the device below.
        input_ids = np.concatenate([np.asarray(s.seq.token_ids[s.seq.num_computed:s.seq.num_computed + s.num_tokens]
                                               + [0] * s.seq.num_pending, dtype=np.int64)
                                    for s in scheduled])
        pending_rows = np.array([s.seq.pending_row if s.seq.num_pending else -1 for s in scheduled])
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            block_tables[i, :len(s.seq.block_table)] = s.seq.block_table
        slot_mapping = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping, "slot_mapping"),
            block_tables=self._to_device(block_tables, "block_tables"),
            seq_lens=self._to_device(seq_lens.astype(np.int32), "seq_lens"),
            query_start_loc=self._to_device(query_start_loc.astype(np.int32), "query_start_loc"),
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()))
        if self.lora is not None:
            seq_slots = np.array([s.seq.lora_slot for s in scheduled], dtype=np.int32)
            if (seq_slots >= 0).any():      # a step of base-model tokens skips the adapters
                metadata.lora_slots = self._to_device(np.repeat(seq_slots, query_lens), "lora_slots")
        if self.device.type == "cuda":
            # Decode kernels split the context by this bound; CUDA graphs must use the largest
            # one, and eager steps use it too so both paths compute the same numbers.
            metadata.max_seq_len = self.max_model_len
        input_ids_device = self._to_device(input_ids, "input_ids")
        if (pending := np.flatnonzero(pending_rows >= 0)).size:
            input_ids_device[to_device(query_start_loc[pending + 1] - 1, torch.long, self.device)] = \
                previous.token_ids[to_device(pending_rows[pending], torch.long, self.device)]
        positions_device = self._to_device(positions, "positions")
        if self.device.type == "cuda":
            self.staging_copied[self.staging_turn] = event = torch.cuda.Event()
            event.record()
        return input_ids_device, positions_device, metadata

    def _next_staging_set(self) -> None:
        """Turns to the other staging set, once the device has run the copies that last read
        it (a host wait only when the device is more than a step behind)."""
        self.staging_turn ^= 1
        self.staging = self.staging_sets[self.staging_turn]
        if (copied := self.staging_copied[self.staging_turn]) is not None:
            copied.synchronize()

    def swap(self, moves: list[tuple[str, int, int]]) -> None:
        """Runs block moves between the device pool and host swap space, in order, one
        transfer per run of moves in the same direction."""
        # The device pool is [layers, K/V, blocks, ...]: a view with the block axis first.
        device_pool = self.kv_cache.transpose(0, 2)
        pools = {"out": (device_pool, self.swap_cache), "in": (self.swap_cache, device_pool)}
        if self.channel is not None:
            self.channel.send_swaps(moves)
        for direction, run in itertools.groupby(moves, key=lambda m: m[0]):
            src, dst = pools[direction]
            swap_blocks(src, dst, torch.tensor([(a, b) for _, a, b in run]))

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copies whole blocks `pairs[i] = (src, dst)` within the pool (a forked choice's
        partly filled last block)."""
        if self.channel is not None:
            self.channel.send_copies(pairs)
        copy_blocks(list(self.kv_cache.flatten(0, 1)), pairs)

    def forward_logits(self, step: StepArrays, targets: tuple[torch.Tensor, int] | None = None
                       ) -> tuple[torch.Tensor | None, PromptLogprobs | None]:
        """The forward of a step, then the logits of `step.rows` and the prompt logprobs of
        `step.score_rows` (on rank 0, where `targets` holds the scored tokens and the top-n to
        keep; None elsewhere, and when there are no such rows)."""
        if self.channel is not None:
            self.channel.send_step(step)
        md = step.metadata
        if self.device.type == "cpu":
            md.gather_plan = gather_plan(md.block_tables, md.seq_lens, md.query_start_loc,
                                         md.max_query_len, md.max_seq_len, self.block_size,
                                         step.input_ids.numel())
        hidden = self.graphs.run(step.input_ids, step.positions, md) if self.graphs else None
        if hidden is None:
            set_context(md)
            try:
                hidden = self.model(step.input_ids, step.positions)
            finally:
                set_context(None)
        logits = None if step.rows is None else self.model.compute_logits(hidden[step.rows])
        return logits, self._score(hidden, step.score_rows, targets)

    def _score(self, hidden: torch.Tensor, rows: torch.Tensor | None,
               targets: tuple[torch.Tensor, int] | None) -> PromptLogprobs | None:
        """The prompt logprobs of hidden `rows`: their logits MAX_LOGITS_ROWS at a time, each
        slice reduced to logprobs before the next is computed. Every rank computes the logits
        (gathering them is a collective); rank 0, which has `targets`, reduces them."""
        if rows is None:
            return None
        parts = []
        for start in range(0, rows.numel(), MAX_LOGITS_ROWS):
            logits = self.model.compute_logits(hidden[rows[start:start + MAX_LOGITS_ROWS]])
            if logits is not None:
                token_ids, top_n = targets
                parts.append(token_logprobs(logits, token_ids[start:start + MAX_LOGITS_ROWS], top_n))
        return PromptLogprobs(tuple(torch.cat(part) for part in zip(*parts))) if parts else None

    @torch.inference_mode()
    def forward(self, scheduled: list[ScheduledSeq], logits_rows: list[int],
                previous: SampledTokens | None = None, scoring: PromptScoring | None = None
                ) -> tuple[torch.Tensor | None, PromptLogprobs | None]:
        """Launches the forward of the step: the logits at the last position of each sequence
        in `logits_rows` (indices into `scheduled`, repeated for a request forking n > 1), or
        None without rows, and the logprobs of the prompt tokens `scoring` asks for (None
        without). `previous`: the draws of the step in flight, holding the pending tokens.
        Sampling is apart (`sample`), so the host can prepare what sampling needs (grammar
        masks) while the forward runs."""
        if self.pending_copies:
            self.copy_blocks(to_device(self.pending_copies, torch.long, self.device))
            self.pending_copies.clear()
        input_ids, positions, metadata = self.prepare(scheduled, previous)
        rows = None
        if logits_rows:
            rows = metadata.query_start_loc[1:].long() - 1
            if logits_rows != list(range(len(scheduled))):    # skip the index copy when all sample once
                rows = rows[to_device(logits_rows, torch.long, self.device)]
        score_rows = targets = None
        if scoring is not None:
            score_rows = to_device(scoring.rows, torch.long, self.device)
            targets = (to_device(scoring.token_ids, torch.long, self.device), scoring.top_n)
        return self.forward_logits(StepArrays(input_ids, positions, metadata, rows, score_rows), targets)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        """Draws a token for each row of a step's logits (see `worker.sampler.sample`)."""
        return sample(logits, batch)

    @torch.inference_mode()
    def all_logits(self, scheduled: ScheduledSeq) -> torch.Tensor:
        """Logits at every position of one sequence's chunk (teacher forcing, scoring)."""
        input_ids, positions, metadata = self.prepare([scheduled])
        rows = torch.arange(input_ids.numel(), device=self.device)
        return self.forward_logits(StepArrays(input_ids, positions, metadata, rows))[0]


