"""worker.engine_loop: what a session reports of the tokens its requests hold.

The engine thread takes Submits only between steps, so a load report may be taken while a Submit
waits for it; the session counts it from the moment it is read (worker.server's reader adds its
estimate), and counts it once when the engine thread takes it. Run here on an EngineLoop whose
thread is not started, so the moment in between can be held still.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from common.metrics import WorkerMetrics
from common.convert import submit_tokens
from common.pb import worker_pb2 as pb
from worker.engine_loop import EngineLoop, Session
from worker_process import submit


def _loop(make_engine) -> EngineLoop:
    engine = make_engine(num_blocks=64)
    return EngineLoop(engine, WorkerMetrics("m", CollectorRegistry(), lambda: None, 16), "m")


def test_a_submit_read_but_not_taken_counts_in_the_report_and_once_when_taken(make_engine):
    loop = _loop(make_engine)

    async def scenario() -> list[int]:
        session = Session("s1", asyncio.get_running_loop())
        msg = submit("r1", [1, 2, 3, 4, 5], max_tokens=7).submit
        estimate = submit_tokens(msg, loop.engine.max_model_len)
        session.submitted_tokens += estimate            # as worker.server's reader does
        read = session.reported_tokens()
        loop.submit(session, msg, time.monotonic(), estimate)
        return [read, session.reported_tokens(), session.engine_tokens]

    assert asyncio.run(scenario()) == [12, 12, (12, 12)]


def test_a_refused_submit_counts_until_taken_and_then_nothing(make_engine):
    loop = _loop(make_engine)

    async def scenario() -> list[int]:
        session = Session("s1", asyncio.get_running_loop())
        msg = submit("r1", [1, 2, 3], max_tokens=4, top_p=7.0).submit     # out of range
        estimate = submit_tokens(msg, loop.engine.max_model_len)
        session.submitted_tokens += estimate
        read = session.reported_tokens()
        loop.submit(session, msg, time.monotonic(), estimate)
        return [read, session.reported_tokens()]

    assert asyncio.run(scenario()) == [7, 0]


def test_the_estimate_is_capped_at_max_model_len(make_engine):
    loop = _loop(make_engine)
    max_len = loop.engine.max_model_len
    msg = submit("r1", [1, 2, 3], max_tokens=max_len).submit
    assert submit_tokens(msg, max_len) == max_len


def test_a_request_that_fails_in_a_step_gets_failed_naming_why_and_its_tokens_return(make_engine):
    loop = _loop(make_engine)

    async def scenario() -> tuple[list[pb.WorkerMessage], int]:
        session = Session("s1", asyncio.get_running_loop())
        # A stop token is banned until min_tokens; it is the only token allowed.
        msg = submit("r1", [1, 2, 3], max_tokens=4, min_tokens=2, stop_token_ids=[5], allowed_token_ids=[5]).submit
        loop.submit(session, msg, time.monotonic(), 0)
        while loop.engine.has_unfinished():
            loop._step()
        await asyncio.sleep(0)         # the sends are queued through the event loop
        sent = []
        while not session.outbox.empty():
            sent.append(session.outbox.get_nowait())
        return sent, session.reported_tokens()

    sent, tokens = asyncio.run(scenario())
    [failed] = [m.event for m in sent if m.WhichOneof("kind") == "event" and m.event.kind == pb.EVENT_KIND_FAILED]
    assert failed.request_id == "r1" and not failed.worker_fault
    assert failed.message == "no token may come at output token 0: allowed_token_ids, min_tokens together rule out every token"
    assert tokens == 0
