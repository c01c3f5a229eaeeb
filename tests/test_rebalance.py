"""router.rebalance: running requests move from a worker with a queue to one with room.

The policy on its own (Rebalancer.check over made-up load reports and real admission
reservations), then end to end: a router whose only worker holds a queue (two sequence slots,
six requests), a second worker that joins, and the requests' greedy outputs, token for token
as the engine run offline in this process.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.admission import Admission, AdmissionConfig
from router.fleet import FleetConfig
from router.rebalance import Movable, RebalanceConfig, Rebalancer, WorkerLoad
from router.server import Router, RouterConfig
from router_harness import greedy_request, read_stream
from worker_process import WorkerProcess, free_port

CONFIG = RebalanceConfig(hold_s=1.0, interval_s=30.0)


class Fleet:
    """Two workers' load reports, as a test sets them, and admission budgets for them."""

    def __init__(self, hot_waiting: int = 3, cold_free: int = 100) -> None:
        self.loads = {"hot": WorkerLoad("hot", hot_waiting, 0, True), "cold": WorkerLoad("cold", 0, cold_free, True)}
        self.admission = Admission(AdmissionConfig())
        for worker_id in self.loads:
            self.admission.set_worker(worker_id, 1000)
        self.rebalancer = Rebalancer(self.admission, lambda: self.loads.values(), CONFIG)
        self.moved: list[tuple[str, str]] = []
        self.gone: set[str] = set()         # workers a move finds closed (move_to says False)

    async def running(self, request_id: str, tokens: int, worker_id: str = "hot") -> Movable:
        reservation = await self.admission.reserve(tokens, lambda fits: next(b for b in fits if b.worker_id == worker_id))

        def move_to(target: str) -> bool:
            if target in self.gone:
                return False
            self.moved.append((request_id, target))
            return True
        movable = Movable(request_id, reservation, movable=lambda: True, recompute_tokens=lambda: tokens,
                          move_to=move_to)
        self.rebalancer.add(movable)
        return movable


def test_the_cheapest_request_moves_once_the_queue_and_the_room_have_lasted():
    async def scenario():
        fleet = Fleet()
        await fleet.running("long", 300)
        await fleet.running("short", 40)
        assert fleet.rebalancer.check(0.0) is None          # seen now: not yet lasted
        assert fleet.rebalancer.check(0.5) is None
        moved = fleet.rebalancer.check(1.0)
        return moved.request_id, fleet.moved
    assert asyncio.run(scenario()) == ("short", [("short", "cold")])


def test_nothing_moves_while_the_busy_worker_has_no_queue():
    async def scenario():
        fleet = Fleet(hot_waiting=0)
        await fleet.running("r", 40)
        return [fleet.rebalancer.check(t) for t in (0.0, 1.0, 2.0)]
    assert asyncio.run(scenario()) == [None, None, None]


def test_a_moved_request_does_not_move_again_within_the_interval():
    async def scenario():
        fleet = Fleet()
        await fleet.running("only", 40)
        fleet.rebalancer.check(0.0)
        first = fleet.rebalancer.check(1.0)
        # Both workers still look the same (the reports lag): the target must show room again.
        again = [fleet.rebalancer.check(t) for t in (1.5, 2.5, 3.5)]
        return first.request_id, again
    assert asyncio.run(scenario()) == ("only", [None, None, None])


def test_a_request_that_does_not_fit_the_targets_budget_stays():
    async def scenario():
        fleet = Fleet()
        await fleet.running("big", 800)
        await fleet.running("cold-resident", 400, worker_id="cold")   # 600 of 1000 left there
        fleet.rebalancer.check(0.0)
        return fleet.rebalancer.check(1.0)
    assert asyncio.run(scenario()) is None


def test_a_worker_whose_reports_stop_is_no_target():
    async def scenario():
        fleet = Fleet()
        await fleet.running("r", 40)
        fleet.rebalancer.check(0.0)
        del fleet.loads["cold"]                              # left the fleet before its room lasted
        return fleet.rebalancer.check(1.0), fleet.moved
    assert asyncio.run(scenario()) == (None, [])


def test_a_target_gone_when_the_move_is_made_leaves_the_request_and_the_next_target_takes_it():
    async def scenario():
        fleet = Fleet(cold_free=100)
        fleet.loads["colder"] = WorkerLoad("colder", 0, 50, True)      # less room: tried second
        fleet.admission.set_worker("colder", 1000)
        movable = await fleet.running("r", 40)
        fleet.gone.add("cold")
        fleet.rebalancer.check(0.0)
        moved = fleet.rebalancer.check(1.0)
        return moved is movable, fleet.moved
    assert asyncio.run(scenario()) == (True, [("r", "colder")])


def test_a_move_no_target_takes_leaves_the_request_free_to_move_at_the_next_check():
    async def scenario():
        fleet = Fleet()
        movable = await fleet.running("r", 40)
        fleet.gone.add("cold")
        fleet.rebalancer.check(0.0)
        failed = fleet.rebalancer.check(1.0)
        fleet.gone.clear()                                   # the worker is back
        return failed, movable.moved_at, fleet.rebalancer.check(1.5), fleet.moved
    failed, moved_at, moved, log = asyncio.run(scenario())
    assert (failed, moved_at) == (None, float("-inf"))
    assert moved.request_id == "r" and log == [("r", "cold")]


# ------------------------------------------------------------------------------ end to end

PROMPTS = ["Once upon a time,", "The capital of France is", "def fibonacci(n):", "Count to ten:",
           "The quick brown fox", "Water boils at"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def expected(make_engine, smollm_tokenizer) -> list[list[int]]:
    from helpers import generate
    outputs = generate(make_engine(), [smollm_tokenizer.encode(p) for p in PROMPTS],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [outputs[f"r{i}"][0] for i in range(len(PROMPTS))]


WORKER_FLAGS = ["--model", "default", "--device", "cpu", "--max-num-seqs", "2", "--metrics-port", "0"]


@pytest.mark.slow
def test_requests_queued_on_one_worker_move_to_a_worker_that_joins_and_finish_unchanged(expected):
    # Both workers load up front; the router learns of the second only once requests wait on the
    # first (as discovery would tell it). Starting the process then raced its model load against
    # the queue draining, which a fast machine lost.
    busy, joining = (WorkerProcess(WORKER_FLAGS + ["--worker-id", name], port=free_port()) for name in ("busy", "new"))

    async def scenario():
        router = Router(RouterConfig(workers=[busy.address], host="127.0.0.1", port=0,
                                     fleet=FleetConfig(backoff_initial_s=0.2), shutdown_grace_s=1.0,
                                     rebalance=RebalanceConfig(hold_s=0.5, check_s=0.2)))
        await router.start()
        try:
            await router.fleet.wait_for(lambda fleet: len(fleet.accepting()) == 1, 60)
            async with grpc.aio.insecure_channel(router.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                streams = [asyncio.create_task(read_stream(stub.Generate(
                    greedy_request(p, MAX_TOKENS, ignore_eos=True)))) for p in PROMPTS]
                while not any(w.load is not None and w.load.num_waiting for w in router.fleet.workers.values()):
                    await asyncio.sleep(0.05)
                router.fleet.update({joining.address}, set())   # all six are on the busy worker: two run, four wait
                done = await asyncio.wait_for(asyncio.gather(*streams), 240)
            return [s.token_ids for s in done], router.counters
        finally:
            await router.stop()

    # Both start before either is waited on, so their model loads overlap; each is stopped even
    # if the other fails to start.
    with contextlib.ExitStack() as running:
        for worker in (busy, joining):
            worker.start()
            running.callback(worker.__exit__)
        for worker in (busy, joining):
            worker.wait_ready()
        outputs, counters = asyncio.run(scenario())
    assert outputs == expected
    assert counters.rebalances >= 1 and counters.redispatches == 0
