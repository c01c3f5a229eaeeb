"""The ranks of a tensor-parallel worker: their processes, and the channel rank 0 drives them by.

Rank 0 is the worker: it schedules, serves RPC and samples. Ranks 1..N-1 are processes it
spawns, each holding its slices of the weights and of the KV pool; they run what rank 0
sends and take part in the layers' collectives. Each device operation goes out as two
broadcasts of int64 tensors (a fixed header, then the operation's arrays), so no Python
object is pickled per step; the step's arrays are rank 0's device tensors, pending tokens
already in place, so the broadcast queues behind rank 0's work without a host sync.
"""

import ctypes
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker.config import EngineConfig
from worker.context import AttentionMetadata
from worker.models.loader import ModelSource, load_config
from worker.parallel import Shard, check_splittable
from worker.transfer import to_device

log = logging.getLogger("pagedserve.worker")

STEP, COPY, SWAP, STOP = 1, 2, 3, 4
HEADER = 8


@dataclass
class StepArrays:
    """One step's inputs as every rank needs them: `rows` are the hidden rows whose logits
    are computed (None: no logits this step)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    rows: torch.Tensor | None


class StepChannel:
    """Rank 0's side sends, the others' side receives; the same class on both."""

    def __init__(self, device: torch.device, shard: Shard):
        self.device, self.shard = device, shard

    # ---------------------------------------------------------------- rank 0

    def send_step(self, step: StepArrays) -> None:
        md = step.metadata
        rows = step.rows if step.rows is not None else step.input_ids[:0]
        block_tables = md.block_tables.flatten()
        self._send([STEP, step.input_ids.numel(), md.seq_lens.numel(), md.block_tables.shape[1],
                    -1 if step.rows is None else rows.numel(), md.max_query_len, md.max_seq_len],
                   [step.input_ids, step.positions, md.slot_mapping, md.seq_lens, md.query_start_loc,
                    block_tables, rows])

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
            return 3 * n_tokens + 2 * n_seqs + 1 + n_seqs * max_blocks + max(n_rows, 0)
        if op == COPY:
            return 2 * header[1]
        if op == SWAP:
            return 3 * header[1]
        return None

    @staticmethod
    def unpack_step(header: list[int], payload: torch.Tensor) -> StepArrays:
        n_tokens, n_seqs, max_blocks, n_rows, max_query_len, max_seq_len = header[1:7]
        sizes = [n_tokens, n_tokens, n_tokens, n_seqs, n_seqs + 1, n_seqs * max_blocks, max(n_rows, 0)]
        ids, positions, slots, seq_lens, starts, tables, rows = payload.split(sizes)
        metadata = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.view(n_seqs, max_blocks).int(), seq_lens=seq_lens.int(),
            query_start_loc=starts.int(), max_query_len=max_query_len, max_seq_len=max_seq_len)
        return StepArrays(ids, positions, metadata, rows if n_rows >= 0 else None)

    @staticmethod
    def unpack_swaps(payload: torch.Tensor) -> list[tuple[str, int, int]]:
        return [("in" if d else "out", a, b) for d, a, b in payload.view(-1, 3).tolist()]


@dataclass
class Ranks:
    """The processes of ranks 1..N-1, as rank 0 holds them."""

    shard: Shard
    processes: list[BaseProcess] = field(default_factory=list)
    _closing: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        """Ends this process, saying why, as soon as a rank dies: the collectives rank 0 takes
        part in would otherwise wait for the dead rank forever. (A worker that exits is one
        the router knows how to replace: it re-dispatches its requests.)"""
        threading.Thread(target=self._watch, name="pagedserve-ranks", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        # The sentinels, not is_alive(): an event loop's child watcher may have reaped the
        # process already, and then is_alive() cannot tell that it is gone.
        ended = multiprocessing.connection.wait(list(sentinels))
        if self._closing.is_set():
            return
        rank = sentinels[ended[0]]
        code = self.processes[rank - 1].exitcode
        log.critical("tensor-parallel rank %d exited%s; the worker cannot run without it and "
                     "exits", rank, "" if code is None else f" with code {code}")
        os._exit(1)

    def abandon(self) -> None:
        """Kills the ranks, which may wait in a collective forever: rank 0 failed to start, or
        its engine faulted."""
        self._closing.set()
        for process in self.processes:
            process.kill()
            process.join()

    def close(self, channel: StepChannel) -> None:
        """Tells the ranks to exit, waits for them and leaves the process group."""
        self._closing.set()
        channel.send_stop()
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        dist.destroy_process_group()


def device_for(config: EngineConfig, rank: int) -> torch.device:
    """Rank r of a GPU worker uses GPU r (CUDA_VISIBLE_DEVICES picks which ones those are)."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", rank)


def launch(config: EngineConfig, source: ModelSource) -> Ranks:
    """Checks that the model splits over `tensor_parallel_size` ranks, starts ranks 1..N-1 and
    joins the process group as rank 0."""
    size = config.tensor_parallel_size
    model = load_config(source)
    check_splittable(model.num_heads, model.num_kv_heads, size)
    device = device_for(config, 0)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; "
                         f"{torch.cuda.device_count()} are visible")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    context = mp.get_context("spawn")
    ranks = Ranks(Shard(0, size))
    for rank in range(1, size):
        process = context.Process(target=_rank_main, args=(rank, config, source, address),
                                  name=f"pagedserve-rank-{rank}", daemon=True)
        process.start()
        ranks.processes.append(process)
    ranks.watch()
    _join_group(device, 0, size, address)
    log.info("tensor parallel: %d ranks on %s", size, device.type)
    return ranks


def _join_group(device: torch.device, rank: int, size: int, address: str) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # NVLink multicast off: see docs
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address,
                            rank=rank, world_size=size)


def _rank_main(rank: int, config: EngineConfig, source: ModelSource, address: str) -> None:
    """Rank 1..N-1: load the slices, then run what rank 0 sends until it says stop."""
    from worker.model_runner import ModelRunner
    if sys.platform == "linux":   # die with rank 0, even when it is killed outright
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # 1: PR_SET_PDEATHSIG
    device = device_for(config, rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    _join_group(device, rank, config.tensor_parallel_size, address)
    shard = Shard(rank, config.tensor_parallel_size)
    runner = ModelRunner(config, source, shard=shard)
    channel = StepChannel(runner.device, shard)
    with torch.inference_mode():
        while True:
            op, header, payload = channel.receive()
            if op == STOP:
                break
            if op == STEP:
                runner.forward_logits(channel.unpack_step(header, payload))
            elif op == COPY:
                runner.copy_blocks(payload.view(-1, 2))
            elif op == SWAP:
                runner.swap(channel.unpack_swaps(payload))
    dist.destroy_process_group()
