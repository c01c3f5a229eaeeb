"""The ranks of a tensor-parallel worker: their processes, started and watched by rank 0.

Rank 0 is the worker: it schedules, serves RPC and samples. Ranks 1..N-1 are processes it
spawns, each holding its slices of the weights and of the KV pool; they run what rank 0
sends over the step channel (worker.step_channel) and take part in the layers' collectives.
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
from worker.model_runner import ModelRunner
from worker.models.loader import ModelSource, load_config
from worker.models.quantization import check_tensor_parallel
from worker.parallel import Shard, check_splittable, device_for
from worker.step_channel import COPY, STEP, STOP, SWAP, StepChannel

log = logging.getLogger("pagedserve.worker")

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


def launch(config: EngineConfig, source: ModelSource) -> Ranks:
    """Checks that the model splits over `tensor_parallel_size` ranks, starts ranks 1..N-1 and
    joins the process group as rank 0."""
    size = config.tensor_parallel_size
    model = load_config(source)
    check_splittable(model.num_heads, model.num_kv_heads, size)
    check_tensor_parallel(model, size)
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
