"""router.preemption: an urgent request that fits no worker runs at once, the less urgent ones it
displaces wait swapped out and then finish unchanged, and nothing is preempted where room or
urgency does not call for it.

The choice of victims (`plan_room`) and the policy's hold on admission run in-process over a real
router.admission. End to end, workers are `pagedserve serve --role worker` processes with small
KV pools, started together once for the module, behind an in-process router with default flags;
greedy outputs are compared token for token with the engine run offline in this process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common import tracing
from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.admission import Admission, QueuedRequest
from router.counters import RouterCounters
from router.preemption import PriorityPreemption, Running, plan_room
from router.server import Router
from helpers import LONG_STORY
from otlp_receiver import OtlpReceiver
from router_harness import running_router
from worker_process import WorkerProcess


def first(workers):
    return workers[0]


async def running(admission: Admission, tokens: int, priority: int, *, on_gpu: bool = True,
                  ran_s: float = 10.0, worker: str | None = None) -> Running:
    """A request admitted with `tokens` on `worker` (default: the first with room) that has run
    for `ran_s`; swapping it out suspends its reservation, as router.generate does."""
    def choose(fits):
        return next(w for w in fits if w.worker_id == worker) if worker else fits[0]
    reservation = await admission.reserve(tokens, choose, priority)
    return Running(f"p{priority}-{tokens}", priority, reservation, on_gpu=lambda: on_gpu,
                   swap_out=lambda _: reservation.suspend(), running_since=time.monotonic() - ran_s)


def admission_with(*capacities: int) -> Admission:
    admission = Admission()
    for i, capacity in enumerate(capacities):
        admission.set_worker(f"w{i}", capacity)
    return admission


def plan(admission: Admission, head_tokens: int, head_priority: int, runs: list[Running],
         min_run_s: float = 1.0):
    return plan_room(QueuedRequest(head_tokens, head_priority, "urgent"), admission.workers, runs,
                     time.monotonic(), min_run_s)


# ------------------------------------------------------------------------------ the choice

def test_the_least_urgent_running_requests_are_preempted_first():
    async def scenario():
        admission = admission_with(90)
        runs = [await running(admission, 30, priority) for priority in (1, 5, 3)]
        chosen = plan(admission, 30, 0, runs)
        assert [v.priority for v in chosen.victims] == [5]
    asyncio.run(scenario())


def test_among_equally_urgent_requests_the_latest_admitted_is_preempted_first():
    async def scenario():
        admission = admission_with(90)
        runs = [await running(admission, 30, 5) for _ in range(3)]
        assert plan(admission, 30, 0, runs).victims == (runs[2],)
    asyncio.run(scenario())


def test_the_worker_where_preemption_frees_the_fewest_tokens_is_chosen():
    async def scenario():
        admission = admission_with(100, 100)
        runs = [await running(admission, 90, 5, worker="w0"),
                await running(admission, 60, 5, worker="w1"),
                await running(admission, 30, 5, worker="w1")]
        chosen = plan(admission, 40, 0, runs)  # w1 has 10 free: its 30 make room
        assert (chosen.worker_id, chosen.victims, chosen.freed_tokens) == ("w1", (runs[2],), 30)
    asyncio.run(scenario())


def test_a_request_is_never_preempted_for_an_equally_urgent_one():
    async def scenario():
        admission = admission_with(60)
        runs = [await running(admission, 30, 2) for _ in range(2)]
        assert plan(admission, 30, 2, runs) is None
    asyncio.run(scenario())


def test_a_request_is_not_preempted_before_it_has_run_the_minimum_time():
    async def scenario():
        admission = admission_with(60)
        runs = [await running(admission, 60, 5, ran_s=0.5)]
        assert plan(admission, 30, 0, runs, min_run_s=1.0) is None
        assert plan(admission, 30, 0, runs, min_run_s=0.25).victims == (runs[0],)
    asyncio.run(scenario())


def test_a_request_not_running_on_the_gpu_is_not_preempted():
    async def scenario():
        admission = admission_with(60)
        runs = [await running(admission, 60, 5, on_gpu=False)]
        assert plan(admission, 30, 0, runs) is None
    asyncio.run(scenario())


def test_nothing_is_preempted_when_the_urgent_request_fits_somewhere():
    async def scenario():
        admission = admission_with(60, 60)
        runs = [await running(admission, 60, 5, worker="w0")]
        assert plan(admission, 30, 0, runs) is None
    asyncio.run(scenario())


def test_nothing_is_preempted_when_all_the_less_urgent_ones_would_not_make_room():
    async def scenario():
        admission = admission_with(100)
        runs = [await running(admission, 40, 0), await running(admission, 40, 5)]
        assert plan(admission, 70, 1, runs) is None
    asyncio.run(scenario())


def test_the_policy_swaps_out_for_a_blocked_urgent_request_which_admission_then_places():
    async def scenario():
        admission = admission_with(60)
        policy = PriorityPreemption(admission)
        victim = await running(admission, 60, 5)
        policy.add(victim)
        urgent = await asyncio.wait_for(admission.reserve(30, first, priority=0), 1)
        assert victim.reservation.suspended and urgent.worker_id == "w0"
    asyncio.run(scenario())


# ------------------------------------------------------------------------------ end to end

POOL_BLOCKS = 16          # of 16 tokens: four requests of 64 tokens fill it
LOW_MAX_TOKENS = 58       # with a prompt of at most 6 tokens, a request reserves 64 or fewer
URGENT_MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The quick brown fox", "Water boils at", "My cat likes", "Paris is known for",
           "The moon is", "Roses are red,", "Cold winters are"]
# At most 48 tokens: with URGENT_MAX_TOKENS, four fill a worker's pool but take few steps.
LONG_PROMPTS = [f"{LONG_STORY[:210]} {p}" for p in PROMPTS]


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    """Two small workers with room in their swap space, loading in parallel."""
    started = [WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32",
                              "--async-scheduling", "--metrics-port", "0",
                              "--num-blocks", str(POOL_BLOCKS), "--num-swap-blocks", "64"],
                             env={"OMP_NUM_THREADS": "1"}) for _ in range(2)]
    for worker in started:
        worker.start()
    try:
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        for worker in started:
            worker.__exit__()


@pytest.fixture(scope="module")
def expected(make_engine, smollm_tokenizer):
    """Greedy outputs, undisturbed, of the engine run offline: (prompt, max_tokens) -> ids."""
    from helpers import generate

    engine = make_engine(num_blocks=1024)
    outputs = {}
    for prompts, max_tokens in ((PROMPTS[:4], LOW_MAX_TOKENS), (PROMPTS, URGENT_MAX_TOKENS),
                                (LONG_PROMPTS, URGENT_MAX_TOKENS)):
        got = generate(engine, [smollm_tokenizer.encode(p) for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        outputs |= {(p, max_tokens): got[f"r{i}"][0] for i, p in enumerate(prompts)}
    return outputs


@dataclass
class Timed:
    """One Generate stream's tokens and when each arrived (time.monotonic())."""

    sent: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.sent

    def tokens_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.arrivals)


async def stream(stub, prompt: str, max_tokens: int, priority: int, timed: Timed,
                 request_id: str = "") -> Timed:
    call = stub.Generate(pb.GenerateRequest(
        text=prompt, priority=priority, request_id=request_id,
        params=pb.SamplingParameters(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    async for response in call:
        for choice in response.choices:
            timed.token_ids += choice.token_ids
            timed.arrivals += [time.monotonic()] * len(choice.token_ids)
    return timed


def metrics(router: Router) -> dict[tuple[str, str], float]:
    """The router's swap counters as Prometheus reads them: (series, reason) -> value."""
    text = generate_latest(router.registry).decode()
    return {(s.name, s.labels["reason"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith(("pagedserve_router_swap_outs",
                                                          "pagedserve_router_swap_ins"))}


async def until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@dataclass
class Displaced:
    """What the urgent-request scenario saw: the router's counters and swap series, the four
    less urgent streams and the urgent one."""

    counters: RouterCounters
    series: dict[tuple[str, str], float]
    lows: list[Timed]
    urgent: Timed


LOW_PROMPTS, URGENT_PROMPT = PROMPTS[:4], PROMPTS[4]


def urgent_behind_less_urgent_ones(worker: WorkerProcess) -> Displaced:
    """Four priority-5 requests fill the worker's pool; once they have run for the policy's
    minimum time, a priority-0 request arrives. Request ids: low-0 .. low-3, urgent."""
    async def scenario():
        async with running_router(worker) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            lows = [Timed() for _ in LOW_PROMPTS]
            tasks = [asyncio.create_task(stream(stub, p, LOW_MAX_TOKENS, 5, t, f"low-{i}"))
                     for i, (p, t) in enumerate(zip(LOW_PROMPTS, lows))]
            await until(lambda: all(t.token_ids for t in lows), 30, "the low-priority streams")
            await asyncio.sleep(router.config.preemption.min_run_s)
            assert not any(t.done() for t in tasks), "they should still be running"
            urgent = await stream(stub, URGENT_PROMPT, URGENT_MAX_TOKENS, 0, Timed(), "urgent")
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return Displaced(router.counters, metrics(router), lows, urgent)
    return asyncio.run(scenario())


@pytest.mark.slow
def test_an_urgent_request_runs_at_once_while_the_less_urgent_ones_wait_swapped_out(workers, expected):
    seen = urgent_behind_less_urgent_ones(workers[0])
    assert seen.urgent.token_ids == expected[URGENT_PROMPT, URGENT_MAX_TOKENS]
    assert [t.token_ids for t in seen.lows] == [expected[p, LOW_MAX_TOKENS] for p in LOW_PROMPTS]
    swapped_out = seen.series["pagedserve_router_swap_outs_total", "priority"]
    assert swapped_out >= 1 and seen.series["pagedserve_router_swap_ins_total", "priority"] == swapped_out
    # Swapped, not recomputed: the worker had swap space, and no pool ran short by itself.
    assert seen.counters.preemptions_swap == swapped_out and seen.counters.preemptions_recompute == 0
    # Its first token came while one of them was out: that one got no token meanwhile.
    urgent = seen.urgent
    assert any(t.tokens_between(urgent.arrivals[0], urgent.arrivals[-1]) == 0 for t in seen.lows)
    # It did not wait for one of them to finish, as it would have without the policy.
    first_low_done = min(t.arrivals[-1] for t in seen.lows)
    assert urgent.ttft_s < (first_low_done - urgent.sent) / 2, (urgent.ttft_s, first_low_done - urgent.sent)


@pytest.mark.slow
def test_each_swap_out_and_return_is_an_event_of_the_displaced_requests_span(workers, monkeypatch):
    with OtlpReceiver() as receiver:
        for name, value in {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp",
                            "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SDK_DISABLED": "false"}.items():
            monkeypatch.setenv(name, value)
        tracing.setup_tracing("pagedserve-router")
        try:
            urgent_behind_less_urgent_ones(workers[0])
            span = receiver.wait_for(lambda s: any(name == "swapped_out" for name, _ in s.events), 10)
        finally:
            tracing.shutdown_tracing()
    assert span.attributes["pagedserve.request_id"].startswith("low-")
    events = dict(span.events)
    out, back = events["swapped_out"], events["swapped_in"]
    assert (out["pagedserve.reason"], out["pagedserve.for_request"], out["pagedserve.preemption.mode"]) == (
        "priority", "urgent", "swap")
    assert (back["pagedserve.reason"], back["pagedserve.resume"]) == ("priority", "swap_in")
    assert out["pagedserve.worker"] == back["pagedserve.worker"]  # back in where its KV waited


@pytest.mark.slow
def test_nothing_is_preempted_on_an_idle_or_evenly_loaded_fleet(workers, expected):
    async def scenario():
        async with running_router(*workers) as router, \
                grpc.aio.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            waiting = []

            async def watch_queue() -> None:
                while True:
                    waiting.append(router.admission.num_waiting)
                    await asyncio.sleep(0.01)
            watcher = asyncio.create_task(watch_queue())
            # Mixed priorities that all fit, then more requests of one priority than the fleet
            # holds at once: those queue rather than preempt each other.
            mixed = await asyncio.gather(*(
                stream(stub, p, URGENT_MAX_TOKENS, priority, Timed())
                for p, priority in zip(PROMPTS[:4], (0, 3, 5, 7))))
            equal = await asyncio.gather(*(
                stream(stub, p, URGENT_MAX_TOKENS, 2, Timed()) for p in LONG_PROMPTS))
            watcher.cancel()
            return router.counters, mixed, equal, max(waiting)

    counters, mixed, equal, most_waiting = asyncio.run(scenario())
    assert [t.token_ids for t in mixed] == [expected[p, URGENT_MAX_TOKENS] for p in PROMPTS[:4]]
    assert [t.token_ids for t in equal] == [expected[p, URGENT_MAX_TOKENS] for p in LONG_PROMPTS]
    assert most_waiting >= 1  # the fleet was full
    assert (counters.swap_outs_priority, counters.swap_ins_priority) == (0, 0)
    assert counters.preemptions_swap + counters.preemptions_recompute == 0
