"""The workers a router drives: one connection loop per discovered address.

Each loop connects (Info, then a Session), makes the worker known to admission with a budget of
its KV capacity (shared with other router replicas as its load reports say: router.admission),
waits for the session to end, and connects again with exponential backoff, so a
worker that restarts at the same address comes back by itself. Discovery adds and removes
addresses; a removed address's worker is disconnected.

All workers must serve one model: the first to connect defines it, and a worker with another
model or vocabulary is refused (and retried, in case the fleet is being replaced). A worker seen
at two addresses is used once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.admission import Admission, WorkerBudget, WorkerChooser
from router.balancer import BalancerConfig, LoRAPlacement, choose_worker
from router.rebalance import WorkerLoad
from router.counters import RouterCounters
from router.tokenizer import RouterTokenizer, tokenizer_for
from common.tls import ClientTls
from router.worker_client import WorkerClient, WorkerUnavailable

log = logging.getLogger("pagedserve.router")


@dataclass(frozen=True)
class FleetConfig:
    connect_timeout_s: float = 10.0   # for Info and the session's first message
    backoff_initial_s: float = 0.5    # first wait before reconnecting; doubles up to the max
    backoff_max_s: float = 10.0
    # A session silent this long counts as lost: its worker reports load 5 times a second.
    silence_timeout_s: float = 5.0
    affinity_blocks: int = 4          # prompt blocks hashed for prefix affinity
    max_load_gap: float = 0.25        # load difference past which the least-loaded worker wins
    worker_tls: ClientTls | None = None  # dial the workers over TLS; None: in plaintext


@dataclass(frozen=True)
class ModelSpec:
    """What the workers serve, as requests are checked against it."""

    name: str
    max_model_len: int  # the smallest over connected workers: any of them can take any request
    vocab_size: int
    block_size: int
    # None: the model came without tokenizer files (dummy weights of a bare config), so it is
    # served on token ids only, as vLLM's --skip-tokenizer-init does.
    tokenizer: RouterTokenizer | None
    # Custom logits processors every connected worker has loaded: any of them can take a
    # request that selects these.
    logits_processors: frozenset[str] = frozenset()


class _Refused(Exception):
    """A reachable worker the fleet will not use."""


class Fleet:
    """Connected workers, kept in step with discovery and with admission's budgets."""

    def __init__(self, router_id: str, admission: Admission, counters: RouterCounters,
                 config: FleetConfig = FleetConfig(),
                 on_model: Callable[[ModelSpec], None] | None = None) -> None:
        """`on_model` is called once, when the first worker to join defines the model."""
        self.router_id = router_id
        self.config = config
        self.workers: dict[str, WorkerClient] = {}  # by worker id, connected ones only
        self._admission = admission
        self._counters = counters
        self._on_model = on_model
        self._links: dict[str, asyncio.Task] = {}  # by address
        self._model: ModelSpec | None = None
        self._accepting: dict[str, bool] = {}  # as last told to admission
        self._changed = asyncio.Event()
        # LoRA adapters loaded through this router, name -> path: loadable on any worker even
        # before (or after) a worker reports holding them.
        self.lora_paths: dict[str, str] = {}
        # Adapters this router is unloading: no longer served, though workers still report them.
        self.lora_unloading: set[str] = set()

    @property
    def model(self) -> ModelSpec | None:
        """The served model; None until a first worker connected (then kept even if all leave)."""
        return self._model

    def accepting(self) -> list[WorkerClient]:
        return [w for w in self.workers.values() if w.accepting]

    def num_accepting(self) -> int:
        """How many workers accept requests, as admission knows it. Safe to call from another
        thread (a metrics scrape): list() copies the values in one step under the GIL."""
        return sum(list(self._accepting.values()))

    def update(self, added: set[str], removed: set[str]) -> None:
        """Discovery's callback: starts and stops connection loops."""
        for address in removed:
            link = self._links.pop(address, None)
            if link is not None:
                link.cancel()
        for address in added - self._links.keys():
            self._links[address] = asyncio.create_task(self._link(address),
                                                       name=f"link-{address}")

    async def close(self) -> None:
        """Disconnects every worker; they abort this router's requests."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.cancel()
        await asyncio.gather(*links, return_exceptions=True)

    async def wait_for(self, predicate: Callable[[Fleet], bool],
                       timeout_s: float | None = None) -> None:
        """Waits until predicate(fleet) holds, re-checking whenever a worker joins, leaves, or
        starts or stops accepting requests. Raises TimeoutError after timeout_s."""
        async def until() -> None:
            while not predicate(self):
                await self._changed.wait()
        await asyncio.wait_for(until(), timeout_s)

    def worker_loads(self) -> list[WorkerLoad]:
        """Each connected worker's latest load report, as router.rebalance weighs it."""
        return [WorkerLoad(c.worker_id, c.load.num_waiting, c.load.free_blocks, c.accepting)
                for c in self.workers.values() if c.load is not None]

    def lora_adapters(self) -> dict[str, tuple[str, list[str]]]:
        """Every LoRA adapter a worker holds or this router loaded: name -> (path, the ids of
        the workers holding it)."""
        adapters: dict[str, tuple[str, list[str]]] = {name: (path, []) for name, path in self.lora_paths.items()}
        for worker_id, client in self.workers.items():
            for name, adapter in client.lora_adapters().items():
                adapters.setdefault(name, (adapter.path, []))[1].append(worker_id)
        return {name: entry for name, entry in adapters.items() if name not in self.lora_unloading}

    def lora_path(self, name: str) -> str | None:
        """Where the adapter is read from, as the workers see it (None: unknown)."""
        entry = self.lora_adapters().get(name)
        return entry[0] if entry is not None else None

    def _lora_placement(self, name: str) -> LoRAPlacement:
        clients = self.workers.values()
        return LoRAPlacement(name, frozenset(c.worker_id for c in clients if c.serves_lora),
                             frozenset(c.worker_id for c in clients if c.holds_lora(name)))

    def chooser(self, prompt_token_ids: Sequence[int], lora_name: str = "") -> WorkerChooser:
        """The admission chooser for a prompt: prefix affinity balanced against load, and the
        request's LoRA adapter's placement (router.balancer)."""
        balancer = BalancerConfig(block_size=self._model.block_size if self._model else 16,
                                  affinity_blocks=self.config.affinity_blocks,
                                  max_load_gap=self.config.max_load_gap)

        def choose(fits: list[WorkerBudget]) -> WorkerBudget | None:
            # Read when called: a queued request is placed long after it asked.
            kv_usage = {worker_id: w.kv_usage for worker_id, w in self.workers.items()}
            lora = self._lora_placement(lora_name) if lora_name else None
            return choose_worker(fits, prompt_token_ids, balancer, kv_usage, lora)
        return choose

    def choose(self, prompt_token_ids: Sequence[int],
               exclude: WorkerClient | None = None, lora_name: str = "") -> WorkerClient | None:
        """An accepting worker for a request already admitted (re-dispatch), other than
        `exclude`, whether or not its budget has room: a running request must not wait."""
        def usable(budget: WorkerBudget) -> bool:
            client = self.workers.get(budget.worker_id)
            return budget.accepting and client is not None and client.accepting and (
                client is not exclude)
        budgets = [b for b in self._admission.workers if usable(b)]
        chosen = self.chooser(prompt_token_ids, lora_name)(budgets) if budgets else None
        return self.workers[chosen.worker_id] if chosen is not None else None

    async def _link(self, address: str) -> None:
        """Connects to the worker at address, again and again, until cancelled."""
        backoff = self.config.backoff_initial_s
        while True:
            client = WorkerClient(address, self.router_id, on_load=self._on_load,
                                  silence_timeout_s=self.config.silence_timeout_s,
                                  tls=self.config.worker_tls)
            try:
                info = await client.connect(self.config.connect_timeout_s)
                tokenizer = (await asyncio.to_thread(tokenizer_for, info)
                             if info.tokenizer_json else None)
                self._join(client, tokenizer)
            except asyncio.CancelledError:
                await client.close()
                raise
            except Exception as error:
                await client.close()
                expected = isinstance(error, (WorkerUnavailable, _Refused))
                log.warning("worker not usable, retrying", exc_info=not expected, extra={
                    "address": address, "error": str(error), "retry_in_s": backoff})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)
                continue
            backoff = self.config.backoff_initial_s
            try:
                await client.wait_closed()
                self._counters.count("workers_lost", "worker lost", worker=client.worker_id,
                                     address=address, reason=client.lost_reason)
            finally:
                self._leave(client)
                await client.close()
            await asyncio.sleep(backoff)

    def _join(self, client: WorkerClient, tokenizer: RouterTokenizer | None) -> None:
        info = client.info
        if self._model is not None and (info.model_name, info.vocab_size) != (
                self._model.name, self._model.vocab_size):
            raise _Refused(f"worker {info.worker_id} serves {info.model_name!r} (vocabulary "
                           f"{info.vocab_size}) but this router serves {self._model.name!r} "
                           f"(vocabulary {self._model.vocab_size})")
        if info.worker_id in self.workers:
            raise _Refused(f"worker {info.worker_id} is already connected at "
                           f"{self.workers[info.worker_id].address}")
        if self._model is None:
            self._model = ModelSpec(info.model_name, info.max_model_len, info.vocab_size,
                                    info.block_size, tokenizer, frozenset(info.logits_processors))
            if tokenizer is None:
                log.warning("model has no tokenizer: serving token ids only (no text, chat or "
                            "stop strings)", extra={"model": info.model_name})
            if self._on_model is not None:
                self._on_model(self._model)
        self.workers[info.worker_id] = client
        self._refresh_model()
        self._sync_admission(client)
        self._on_load(client)  # the report that opened the session came before the worker joined
        log.info("worker joined", extra={
            "worker": info.worker_id, "address": client.address, "model": info.model_name,
            "kv_blocks": info.num_gpu_blocks, "block_size": info.block_size,
            "max_model_len": info.max_model_len})
        self._notify()

    def _leave(self, client: WorkerClient) -> None:
        if self.workers.get(client.worker_id) is not client:
            return
        del self.workers[client.worker_id]
        self._accepting.pop(client.worker_id, None)
        self._admission.remove_worker(client.worker_id)
        self._refresh_model()
        log.info("worker left", extra={"worker": client.worker_id, "address": client.address})
        self._notify()

    def _on_load(self, client: WorkerClient) -> None:
        if self.workers.get(client.worker_id) is not client:
            return
        if self._accepting.get(client.worker_id) != client.accepting:
            self._sync_admission(client)
            self._notify()
        load = client.load
        self._admission.observe_load(client.worker_id, load.tokens_in_flight,
                                     load.session_tokens_in_flight, load.num_sessions,
                                     unread_tokens=client.unread_tokens)

    def _sync_admission(self, client: WorkerClient) -> None:
        self._accepting[client.worker_id] = client.accepting
        self._admission.set_worker(client.worker_id,
                                   client.info.num_gpu_blocks * client.info.block_size,
                                   accepting=client.accepting)

    def _refresh_model(self) -> None:
        if self._model is None or not self.workers:
            return
        max_model_len = min(w.info.max_model_len for w in self.workers.values())
        processors = frozenset.intersection(*(frozenset(w.info.logits_processors) for w in self.workers.values()))
        if (max_model_len, processors) != (self._model.max_model_len, self._model.logits_processors):
            self._model = dataclasses.replace(self._model, max_model_len=max_model_len,
                                              logits_processors=processors)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
