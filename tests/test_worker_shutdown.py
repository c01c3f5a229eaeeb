"""worker.server: how a worker leaves on SIGTERM (what Kubernetes sends).

A real worker process and a raw router<->worker Session: the worker hands every request back,
answers what the router sends before it has read the hand-backs (a late Submit is handed back,
not lost with the worker), refuses new sessions meanwhile, and exits cleanly.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from common.pb import worker_pb2, worker_pb2_grpc
from worker_process import WorkerProcess, submit

pytestmark = pytest.mark.slow

PROMPT = [504, 3458, 282, 4649, 314]     # token ids: the worker needs no tokenizer for them


def handed_back(message: worker_pb2.WorkerMessage, request_id: str) -> bool:
    event = message.event
    return (message.WhichOneof("kind") == "event" and event.request_id == request_id
            and event.kind == worker_pb2.EVENT_KIND_PREEMPTED
            and event.hand_back == worker_pb2.HAND_BACK_DRAINING)


def test_a_stopping_worker_hands_back_a_submit_sent_after_its_drain_and_refuses_new_sessions():
    async def scenario(worker: WorkerProcess) -> tuple[grpc.StatusCode, str]:
        outbox: asyncio.Queue = asyncio.Queue()
        outbox.put_nowait(worker_pb2.RouterMessage(hello=worker_pb2.Hello(router_id="test")))
        outbox.put_nowait(submit("running", PROMPT, 2000))

        async def requests():
            while (message := await outbox.get()) is not None:
                yield message

        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            messages = aiter(stub.Session(requests()))
            while not (m := await anext(messages)).WhichOneof("kind") == "step":
                pass                                   # the first token: it runs
            worker.process.send_signal(signal.SIGTERM)
            while not handed_back(await anext(messages), "running"):
                pass
            outbox.put_nowait(submit("late", PROMPT, 10))   # sent before reading the DRAINED
            while not handed_back(await anext(messages), "late"):
                pass
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                second = stub.Session(requests())
                await second.read()
            outbox.put_nowait(None)
            return refused.value.code(), refused.value.details()

    with WorkerProcess(["--model", "default", "--device", "cpu"]) as worker:
        code, details = asyncio.run(asyncio.wait_for(scenario(worker), 60))
        assert worker.process.wait(30) == 0, worker.log()
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
