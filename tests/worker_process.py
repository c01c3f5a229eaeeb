"""A real worker process for tests (`pagedserve serve --role worker`, as deployed), and a
minimal router side of its Session.

    with WorkerProcess(["--metrics-port", "9200"]) as worker:
        results = asyncio.run(run_requests(worker.address, [submit("r1", [1, 2, 3], max_tokens=5)]))
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.pb import generation_pb2, worker_pb2, worker_pb2_grpc
from common.tls import ClientTls

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 120    # loading SmolLM2 takes ~15 s, more with several loading at once


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, never the same one twice in a test run: the
    kernel may hand a just-closed port out again, and two servers told one port would fight."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def python_path() -> str:
    """PYTHONPATH for a subprocess: the repository, then what this process was given (the GPU
    machine's carried wheels live there)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module args`; on Linux the process also asks the kernel to kill it when the
    test process dies, even by SIGKILL (an out-of-memory kill), so no server outlives a run."""
    if sys.platform != "linux":
        return [sys.executable, "-m", module, *args]
    launcher = ("import ctypes, runpy, signal; "
                "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "  # 1: PR_SET_PDEATHSIG
                f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", launcher, *args]


def wait_for_http(url: str, server: subprocess.Popen, timeout_s: float = 120) -> None:
    """Returns once `url` answers 200; fails at once, with its output, if `server` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            output = server.stdout.read() if server.stdout else ""
            raise AssertionError(f"{server.args[0]} exited with {server.returncode} before {url} answered: {output}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s} s")


class WorkerProcess:
    """A worker subprocess on loopback with a 128-block KV pool (later flags override), ready
    once entered; its log is shown when it fails to start. Several can be `start`ed first and
    waited for afterwards, so that they load their models in parallel."""

    def __init__(self, args: Sequence[str] = (), env: dict[str, str | None] | None = None,
                 host: str = "127.0.0.1", port: int | None = None, tls: ClientTls | None = None):
        """`env`: variables to set for the worker, or (None) to remove from what it inherits.
        `host`: a loopback address to listen on; `port`: default, a free one. `tls`: how to
        reach a worker started with --tls-* flags."""
        self.port = port or free_port()
        self.address = f"{host}:{self.port}"
        self._args = ["serve", "--role", "worker", "--host", host, "--worker-port", str(self.port),
                      "--num-blocks", "128", *args]
        self._env = {name: value for name, value in {**os.environ, "PYTHONPATH": python_path(), **(env or {})}.items()
                     if value is not None}
        self._log = tempfile.TemporaryFile(mode="w+")
        self._tls = tls
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(module_command("launcher.cli", *self._args), cwd=REPO,
                                        env=self._env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        """Returns once the worker answers Info; fails with its log if it exits or is slow."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        channel = (grpc.secure_channel(self.address, self._tls.credentials(), self._tls.channel_options())
                   if self._tls else grpc.insecure_channel(self.address))
        with channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log()}")
                try:
                    stub.Info(worker_pb2.InfoRequest(), timeout=1)
                    return
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"worker not serving after {STARTUP_TIMEOUT_S} s:\n{self.log()}")
                    time.sleep(0.2)

    def __enter__(self) -> WorkerProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)    # drains, flushes its spans, exits
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()


def submit(request_id: str, prompt: list[int], max_tokens: int, trace_context: dict[str, str] | None = None,
           **params) -> worker_pb2.RouterMessage:
    """A Submit of `prompt` for `max_tokens` tokens that ignore EOS (so the count is exact)."""
    sampling = generation_pb2.SamplingParameters(max_tokens=max_tokens, ignore_eos=True,
                                                 temperature=params.pop("temperature", 0.0), **params)
    return worker_pb2.RouterMessage(submit=worker_pb2.Submit(
        request_id=request_id, prompt_token_ids=prompt, params=sampling, trace_context=trace_context or {}))


@dataclass
class Result:
    """What the worker sent about one request."""
    tokens: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)    # EventKind values, in order
    finish_reason: int = 0


async def run_requests(address: str, messages: Sequence[worker_pb2.RouterMessage], timeout_s: float = 30,
                       on_message: Callable[[worker_pb2.WorkerMessage], list[worker_pb2.RouterMessage]] | None = None,
                       ) -> dict[str, Result]:
    """Opens a Session, sends `messages` after the Hello, and reads until every submitted request
    got FINISHED or FAILED, or its aborted delta. `on_message` may answer what the worker sent
    with more messages (an Abort, a Preempt). Closes the session at the end."""
    pending = {m.submit.request_id for m in messages if m.WhichOneof("kind") == "submit"}
    results = {request_id: Result() for request_id in pending}
    outbox: asyncio.Queue[worker_pb2.RouterMessage | None] = asyncio.Queue()
    for message in [worker_pb2.RouterMessage(hello=worker_pb2.Hello(router_id="test")), *messages]:
        outbox.put_nowait(message)

    async def requests():
        while (message := await outbox.get()) is not None:
            yield message

    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Session(requests())

        async def read() -> None:
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "step":
                    for delta in message.step.deltas:
                        result = results[delta.request_id]
                        result.tokens += delta.new_token_ids
                        result.finish_reason = delta.finish_reason or result.finish_reason
                        if delta.finish_reason == worker_pb2.FINISH_REASON_ABORT:
                            pending.discard(delta.request_id)     # aborted: no event follows
                elif kind == "event" and message.event.request_id in results:
                    results[message.event.request_id].events.append(message.event.kind)
                    if message.event.kind in (worker_pb2.EVENT_KIND_FINISHED, worker_pb2.EVENT_KIND_FAILED):
                        pending.discard(message.event.request_id)
                for answer in on_message(message) if on_message else ():
                    outbox.put_nowait(answer)
                if not pending:
                    return

        try:
            await asyncio.wait_for(read(), timeout_s)
        finally:
            outbox.put_nowait(None)
            call.cancel()
    return results
