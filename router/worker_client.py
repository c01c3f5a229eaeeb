"""One worker as the router sees it: its Info, its Session stream and its latest load report.

The router keeps one Session per worker. Everything it sends goes into an outbox queue that a
single request iterator drains, so writes never interleave. One reader task demultiplexes what
comes back: every request delta and event goes to the inbox registered for its dispatch id, load
reports replace `load`. When the stream ends, for whatever reason, every dispatch still
registered gets a WorkerLost, and the client is finished for good: reconnecting makes a new one.

LoRA adapters load with a unary RPC beside the session. A dispatch under an adapter the worker
does not hold yet is registered at once and submitted once the load has succeeded (a failed
load fails the dispatch like a worker refusal); concurrent dispatches share one load.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from common.convert import submit_tokens
from common.pb import generation_pb2, worker_pb2, worker_pb2_grpc
from common.tls import ClientTls

log = logging.getLogger("pagedserve.router")

CHANNEL_OPTIONS = [
    # Info carries tokenizer.json, 9 MB for a Llama 3 vocabulary: over gRPC's 4 MiB default.
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
]


class WorkerUnavailable(Exception):
    """The worker could not be reached, or did not open a session in time."""


@dataclass(frozen=True)
class WorkerLost:
    """The worker's session ended: nothing more will come for the dispatch."""

    reason: str


@dataclass(frozen=True)
class Incoming:
    """Something a worker sent about one dispatch, as delivered to the dispatch's inbox."""

    tag: int  # what the dispatch was registered with (the router uses the choice index)
    dispatch_id: str
    worker: WorkerClient
    payload: worker_pb2.RequestDelta | worker_pb2.Event | WorkerLost


Inbox = asyncio.Queue[Incoming]


@dataclass
class _Registration:
    inbox: Inbox
    tag: int
    # A Submit under an adapter the worker was believed to hold: (the message, adapter name,
    # path), so a refusal because the worker no longer holds it loads it and sends it again.
    resend: tuple[worker_pb2.RouterMessage, str, str] | None = None


class WorkerClient:
    """The router's connection to one worker; see the module docstring."""

    def __init__(self, address: str, router_id: str, *, silence_timeout_s: float = 15.0,
                 on_load: Callable[[WorkerClient], None] | None = None,
                 tls: ClientTls | None = None) -> None:
        """`tls`: dial the worker over TLS (common.tls); None: in plaintext."""
        self.address = address
        self.router_id = router_id
        self.info: worker_pb2.InfoResponse | None = None
        self.load: worker_pb2.LoadReport | None = None
        self.alive = False
        self.lost_reason: str | None = None
        # The worker reports a load several times a second; this much silence means it is gone
        # even when TCP has not noticed (a partition, a frozen host).
        self._silence_timeout_s = silence_timeout_s
        self._on_load = on_load
        self._tls = tls
        self._draining = False
        self._outbox: asyncio.Queue[worker_pb2.RouterMessage | None] = asyncio.Queue()
        self._dispatches: dict[str, _Registration] = {}
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._lora_loads: dict[str, asyncio.Task] = {}     # adapter name -> its load in progress
        # Adapter name -> the count of load reports received when its load succeeded: a report
        # taken before the load finished may still arrive after it, without the adapter.
        self._lora_loaded: dict[str, int] = {}
        # The converse: adapter name -> the count of load reports received when it was seen gone
        # (unloaded by this router, or a Submit refused for want of it), and the names being
        # unloaded now. A report taken earlier may still list them.
        self._lora_gone: dict[str, int] = {}
        self._lora_unloading: set[str] = set()
        self._reports = 0
        # Submits sent on the session, numbered, with what each holds once the worker reads it:
        # those a load report has not counted yet are `unread_tokens`.
        self._submits_sent = 0
        self._unread: collections.deque[tuple[int, int]] = collections.deque()
        self._unsent_tokens = 0     # of Submits waiting for their LoRA adapter to load
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._closed = asyncio.Event()

    def __repr__(self) -> str:
        return f"WorkerClient({self.address}, {self.worker_id or 'not connected'})"

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info else ""

    @property
    def unread_tokens(self) -> int:
        """What this router's Submits not yet counted by the latest load report will hold there
        (on their way, or waiting for an adapter): the part of its reservations that the other
        replicas' reports cannot show them either."""
        return sum(tokens for _, tokens in self._unread) + self._unsent_tokens

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def accepting(self) -> bool:
        """Whether new dispatches should come here: not while it drains, nor while its
        watchdog reports its engine stalled."""
        return self.alive and not self._draining and not (self.load is not None and self.load.stalled)

    @property
    def kv_usage(self) -> float:
        """Share of the worker's KV blocks in use, over every router's requests."""
        if self.load is None or self.load.total_blocks <= 0:
            return 0.0
        return self.load.used_blocks / self.load.total_blocks

    @property
    def serves_lora(self) -> bool:
        return self.info is not None and self.info.max_loras > 0

    def lora_adapters(self) -> dict[str, worker_pb2.LoRAAdapter]:
        """The adapters the worker holds, by name: its latest load report's, less those being
        unloaded and those seen gone since that report may have been taken (the second report
        after says for sure)."""
        if self.load is None:
            return {}
        return {a.name: a for a in self.load.lora_adapters
                if a.name not in self._lora_unloading and self._reports - self._lora_gone.get(a.name, -2) >= 2}

    def holds_lora(self, name: str) -> bool:
        """Whether the worker holds the adapter: in its latest report, or loaded by this router
        so recently that no report taken after the load has come (the one taken while it
        loaded may arrive after it, so the second report since says for sure)."""
        loaded = self._lora_loaded.get(name)
        return name in self.lora_adapters() or (loaded is not None and self._reports - loaded < 2)

    async def load_lora(self, name: str, path: str, timeout_s: float = 300.0) -> worker_pb2.LoRAAdapter:
        """Has the worker load the adapter (grpc.aio.AioRpcError on refusal)."""
        adapter = await self._stub.LoadLoRAAdapter(
            worker_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path), timeout=timeout_s)
        self._lora_loaded[name] = self._reports
        self._lora_gone.pop(name, None)
        return adapter

    async def unload_lora(self, name: str, timeout_s: float = 600.0) -> None:
        """Has the worker forget the adapter once its requests under it have finished; it is
        not listed as held from the start (no new request goes there for it)."""
        self._lora_loaded.pop(name, None)
        self._lora_unloading.add(name)
        try:
            await self._stub.UnloadLoRAAdapter(worker_pb2.UnloadLoRAAdapterRequest(lora_name=name),
                                               timeout=timeout_s)
        finally:
            self._lora_unloading.discard(name)
            self._lora_gone[name] = self._reports

    async def connect(self, timeout_s: float) -> worker_pb2.InfoResponse:
        """Fetches Info and opens the session (Hello, then the worker's first load report).
        Raises WorkerUnavailable."""
        self._channel = (grpc.aio.secure_channel(self.address, self._tls.credentials(),
                                                 options=CHANNEL_OPTIONS + self._tls.channel_options())
                         if self._tls else grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS))
        stub = self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        try:
            self.info = await stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s)
            self._outbox.put_nowait(worker_pb2.RouterMessage(
                hello=worker_pb2.Hello(router_id=self.router_id)))
            self._call = stub.Session(self._outgoing())
            first = await asyncio.wait_for(self._call.read(), timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as error:
            await self._channel.close()
            detail = (f"{error.code().name}: {error.details()}"
                      if isinstance(error, grpc.aio.AioRpcError) else f"no answer in {timeout_s} s")
            raise WorkerUnavailable(f"worker at {self.address} is unavailable: {detail}") from None
        if first is grpc.aio.EOF:
            await self._channel.close()
            raise WorkerUnavailable(f"worker at {self.address} closed the session at once")
        self.alive = True
        self._handle(first)
        self._reader = asyncio.create_task(self._read(), name=f"session-{self.address}")
        return self.info

    def submit(self, dispatch_id: str, inbox: Inbox, tag: int, prompt_token_ids: Sequence[int],
               params: generation_pb2.SamplingParameters, priority: int = 0,
               output_token_ids: Sequence[int] = (),
               trace_context: Mapping[str, str] | None = None,
               lora: tuple[str, str] | None = None) -> None:
        """Sends a request; what the worker says about it arrives in `inbox`. On a worker that is
        already lost the inbox gets a WorkerLost at once. `trace_context` (W3C) makes the
        worker's span for the request a child of the span it names. `lora`: the (name, path)
        of the adapter to run it under, loaded first if the worker does not hold it."""
        if not self.alive:
            inbox.put_nowait(Incoming(tag, dispatch_id, self,
                                      WorkerLost(self.lost_reason or "not connected")))
            return
        registration = self._dispatches[dispatch_id] = _Registration(inbox, tag)
        message = worker_pb2.RouterMessage(submit=worker_pb2.Submit(
            request_id=dispatch_id, prompt_token_ids=prompt_token_ids, params=params,
            priority=priority, output_token_ids=output_token_ids, trace_context=trace_context,
            lora_name=lora[0] if lora else ""))
        if lora is None or self.holds_lora(lora[0]):
            if lora is not None:
                registration.resend = (message, *lora)
            self._send_submit(message)
        else:
            asyncio.create_task(self._submit_after_load(dispatch_id, message, *lora))

    def _send_submit(self, message: worker_pb2.RouterMessage) -> None:
        self._submits_sent += 1
        self._unread.append((self._submits_sent, submit_tokens(message.submit, self.info.max_model_len)))
        self._outbox.put_nowait(message)

    async def _submit_after_load(self, dispatch_id: str, message: worker_pb2.RouterMessage,
                                 name: str, path: str) -> None:
        tokens = submit_tokens(message.submit, self.info.max_model_len)
        self._unsent_tokens += tokens
        try:
            await self._load_then_submit(dispatch_id, message, name, path)
        finally:
            self._unsent_tokens -= tokens

    async def _load_then_submit(self, dispatch_id: str, message: worker_pb2.RouterMessage,
                                name: str, path: str) -> None:
        load = self._lora_loads.get(name)
        if load is None:
            log.info("loading LoRA adapter on demand", extra={"worker": self.worker_id, "lora": name})
            load = self._lora_loads[name] = asyncio.create_task(self.load_lora(name, path))
            load.add_done_callback(lambda _: self._lora_loads.pop(name, None))
        try:
            await asyncio.shield(load)
        except grpc.aio.AioRpcError as error:
            self._deliver(dispatch_id, worker_pb2.Event(
                request_id=dispatch_id, kind=worker_pb2.EVENT_KIND_FAILED,
                message=f"LoRA adapter {name!r} could not be loaded on worker {self.worker_id}: "
                        f"{error.details()}", status_code=error.code().value[0]))
            self.forget(dispatch_id)
            return
        if dispatch_id in self._dispatches and self.alive:     # not aborted or lost meanwhile
            self._send_submit(message)

    def forget(self, dispatch_id: str) -> None:
        """Stops delivering messages about a dispatch (the worker may still hold it)."""
        self._dispatches.pop(dispatch_id, None)

    def abort(self, dispatch_ids: Sequence[str], stop_string: bool = False) -> None:
        """Forgets dispatches and asks the worker to end them (ids it no longer knows are
        ignored by the worker, so aborting one that just finished is harmless); `stop_string`:
        they end because their text hit a stop string."""
        for dispatch_id in dispatch_ids:
            self.forget(dispatch_id)
        if self.alive and dispatch_ids:
            self._outbox.put_nowait(worker_pb2.RouterMessage(
                abort=worker_pb2.Abort(request_ids=dispatch_ids, stop_string=stop_string)))

    def swap_out(self, dispatch_ids: Sequence[str]) -> None:
        """Asks the worker to swap dispatches out and keep them out until swap_in; each gets a
        PREEMPTED event saying how (RECOMPUTE where its swap space ran out)."""
        if self.alive and dispatch_ids:
            self._outbox.put_nowait(worker_pb2.RouterMessage(
                swap_out=worker_pb2.SwapOut(request_ids=dispatch_ids)))

    def swap_in(self, dispatch_ids: Sequence[str]) -> None:
        """Lets dispatches held by swap_out run again (RESUMED once they are back on the GPU)."""
        if self.alive and dispatch_ids:
            self._outbox.put_nowait(worker_pb2.RouterMessage(
                swap_in=worker_pb2.SwapIn(request_ids=dispatch_ids)))

    def drain(self) -> None:
        """Asks the worker to hand back every request and admit no more."""
        self._draining = True
        if self.alive:
            self._outbox.put_nowait(worker_pb2.RouterMessage(drain=worker_pb2.Drain()))

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        """Ends the session (the worker then aborts this router's requests) and the channel."""
        self._lose("closed by the router")
        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def _outgoing(self) -> AsyncIterator[worker_pb2.RouterMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        reason = "the worker ended the session"
        try:
            while True:
                message = await asyncio.wait_for(self._call.read(), self._silence_timeout_s)
                if message is grpc.aio.EOF:
                    break
                self._handle(message)
        except asyncio.TimeoutError:
            reason = f"no message from the worker for {self._silence_timeout_s:g} s"
            self._call.cancel()
        except grpc.aio.AioRpcError as error:
            reason = f"session failed: {error.code().name}: {error.details()}"
        finally:
            self._lose(reason)

    def _handle(self, message: worker_pb2.WorkerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "step":
            for delta in message.step.deltas:
                self._deliver(delta.request_id, delta)
        elif kind == "event":
            event = message.event
            if event.kind == worker_pb2.EVENT_KIND_DRAINED:
                self._draining = True
                log.info("worker drained", extra={"worker": self.worker_id})
            elif not self._reloads_lora_for(event):
                self._deliver(event.request_id, event)
        elif kind == "load":
            self.load = message.load
            self._reports += 1
            for name in [n for n, seen in self._lora_gone.items() if self._reports - seen >= 2]:
                del self._lora_gone[name]
            if message.load.HasField("session_submits_read"):   # else a worker that does not say
                while self._unread and self._unread[0][0] <= message.load.session_submits_read:
                    self._unread.popleft()
            else:
                self._unread.clear()
            self._draining |= message.load.draining
            if self._on_load is not None:
                self._on_load(self)

    def _reloads_lora_for(self, event: worker_pb2.Event) -> bool:
        """Whether a refusal is a Submit's whose adapter the worker no longer holds (dropped from
        its host memory past --max-cpu-loras, or its load report was stale), now loaded on demand
        and the Submit sent again, once. Not while this router unloads the adapter."""
        registration = self._dispatches.get(event.request_id)
        if (event.kind != worker_pb2.EVENT_KIND_FAILED or event.worker_fault or registration is None
                or registration.resend is None or event.status_code != grpc.StatusCode.NOT_FOUND.value[0]):
            return False
        message, name, path = registration.resend
        registration.resend = None
        if name in self._lora_unloading:
            return False
        log.info("worker no longer holds the LoRA adapter", extra={"worker": self.worker_id, "lora": name})
        self._lora_loaded.pop(name, None)
        self._lora_gone[name] = self._reports
        asyncio.create_task(self._submit_after_load(event.request_id, message, name, path))
        return True

    def _deliver(self, dispatch_id: str,
                 payload: worker_pb2.RequestDelta | worker_pb2.Event) -> None:
        registration = self._dispatches.get(dispatch_id)
        if registration is not None:  # else abandoned: late news about it is of no interest
            registration.inbox.put_nowait(Incoming(registration.tag, dispatch_id, self, payload))

    def _lose(self, reason: str) -> None:
        if self._closed.is_set():
            return
        self.alive = False
        self.lost_reason = reason
        self._outbox.put_nowait(None)  # ends the request iterator: the session is half-closed
        lost = WorkerLost(f"worker {self.worker_id or self.address} lost: {reason}")
        for dispatch_id, registration in self._dispatches.items():
            registration.inbox.put_nowait(Incoming(registration.tag, dispatch_id, self, lost))
        self._dispatches.clear()
        self._closed.set()
