"""Engine faults and stalls (worker.faults, the worker's watchdog, the router's silence timer).

A worker whose step fails hands its requests back and exits with faults.EXIT_CODE; the router
finishes them elsewhere with no lost or repeated token. A worker whose engine stops advancing
reports NOT_SERVING and is routed around; a frozen worker is given up after the router's
silence timeout. Faults are injected with PAGEDSERVE_INJECT_FAULT into real worker processes.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc
from common.sampling_params import SamplingParams
from router.fleet import FleetConfig
from router.server import Router
from worker import faults
from router_harness import running_router
from worker_process import WorkerProcess, run_requests, submit

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
           "The quick brown fox", "La vie est belle parce que", "In 1969, astronauts",
           "Water boils at"]
MAX_TOKENS = 40


def worker_process(*flags: str, fault: str | None = None) -> WorkerProcess:
    return WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32",
                          "--async-scheduling", "--metrics-port", "0", "--num-blocks", "256", *flags],
                         env={"OMP_NUM_THREADS": "1", faults.INJECT_ENV: fault})


@pytest.fixture(scope="module")
def expected(make_engine, smollm_tokenizer) -> dict[str, list[int]]:
    """Greedy outputs of PROMPTS from the engine run offline in this process."""
    from helpers import generate

    outputs = generate(make_engine(num_blocks=1024), [smollm_tokenizer.encode(p) for p in PROMPTS],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return {prompt: outputs[f"r{i}"][0] for i, prompt in enumerate(PROMPTS)}


async def generate_all(router: Router, on_started=None) -> list[list[int]]:
    """Streams every prompt greedily; `on_started()` runs once each stream has 2 tokens."""
    outputs: list[list[int]] = [[] for _ in PROMPTS]

    async def one(stub, i: int) -> None:
        request = pb.GenerateRequest(text=PROMPTS[i], params=pb.SamplingParameters(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        async for response in stub.Generate(request):
            for choice in response.choices:
                outputs[i] += choice.token_ids

    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(one(stub, i)) for i in range(len(PROMPTS))]
        if on_started is not None:
            while not all(len(o) >= 2 for o in outputs):
                assert not any(t.done() and t.exception() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.02)
            on_started()
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
    return outputs


def health_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status


# ------------------------------------------------------------------------------ classification

@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, ...)`",
    "Triton Error [CUDA]: an illegal memory access was encountered",
    "CUDA error: device-side assert triggered",
])
def test_cuda_errors_are_device_faults(message):
    assert faults.is_device_fault(RuntimeError(message))


@pytest.mark.parametrize("error", [RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"),
                                   ValueError("CUDA error"), KeyError("r1")])
def test_other_errors_are_not_device_faults(error):
    assert not faults.is_device_fault(error)


def test_injected_device_fault_is_classified_as_one():
    with pytest.raises(faults.InjectedDeviceFault) as raised:
        faults.FaultInjection.parse("device@7").before_step(7)
    assert faults.is_device_fault(raised.value)


def test_fault_injection_fires_at_its_step_only():
    injection = faults.FaultInjection.parse("device@7")
    injection.before_step(6)
    injection.before_step(8)


@pytest.mark.parametrize("spec", ["device", "device@x", "stall@3", "melt@3", "device@3:1"])
def test_a_malformed_fault_injection_is_refused_naming_the_variable(spec):
    with pytest.raises(ValueError, match=faults.INJECT_ENV):
        faults.FaultInjection.parse(spec)


# ------------------------------------------------------------------------------ a worker faults

@pytest.mark.slow
def test_faulted_worker_hands_its_requests_back_and_exits_and_they_finish_elsewhere(expected):
    with worker_process("--worker-id", "healthy") as healthy, \
            worker_process("--worker-id", "faulty", fault="device@6") as faulty:
        async def scenario():
            async with running_router(healthy, faulty) as router:
                outputs = await generate_all(router)
                assert outputs == [expected[p] for p in PROMPTS]
                assert router.counters.redispatches > 0, router.counters
        asyncio.run(scenario())
        assert faulty.process.wait(timeout=30) == faults.EXIT_CODE
        log = faulty.log()
        assert "device fault in step 6: CUDA error: an illegal memory access" in log, log
        assert "Traceback" not in log, log


@pytest.mark.slow
def test_a_faulted_worker_hands_a_request_back_as_preempted_for_recompute_naming_the_fault():
    from common.pb import worker_pb2

    with worker_process(fault="device@1") as worker:
        events = []

        def on_message(message):
            if message.WhichOneof("kind") == "event" and message.event.request_id == "r1":
                events.append(message.event)
            return []

        # The session ends when the worker exits, which ends the call.
        asyncio.run(run_requests(worker.address, [submit("r1", [1, 2, 3], max_tokens=5)], timeout_s=60,
                                 on_message=on_message))
        assert worker.process.wait(timeout=30) == faults.EXIT_CODE
    handed_back = events[-1]
    assert handed_back.kind == worker_pb2.EVENT_KIND_PREEMPTED
    assert handed_back.mode == worker_pb2.PREEMPTION_MODE_RECOMPUTE
    assert handed_back.hand_back == worker_pb2.HAND_BACK_WORKER_FAULT
    assert handed_back.message.startswith("device fault in step 1: CUDA error")


# ------------------------------------------------------------------------------ the watchdog

@pytest.mark.slow
def test_stalled_engine_reports_not_serving_naming_its_state_and_is_routed_around():
    with worker_process("--worker-id", "healthy") as healthy, \
            worker_process("--worker-id", "stalling", "--engine-stall-timeout", "1",
                           fault="stall@2:8") as stalling:
        async def scenario():
            async with running_router(healthy, stalling) as router:
                # A request straight to the stalling worker makes it step into the stall.
                direct = asyncio.create_task(run_requests(stalling.address, [submit("r1", [1, 2, 3], max_tokens=4)],
                                                          timeout_s=60))
                deadline = time.monotonic() + 6
                while [w.worker_id for w in router.fleet.accepting()] != ["healthy"]:
                    assert time.monotonic() < deadline, "the router still sends work to the stalled worker"
                    await asyncio.sleep(0.05)
                assert health_of(stalling.address) == health_pb2.HealthCheckResponse.NOT_SERVING
                result = await direct        # the stall ends; the request completes
                assert len(result["r1"].tokens) == 4
                await router.fleet.wait_for(lambda f: len(f.accepting()) == 2, 10)
                assert health_of(stalling.address) == health_pb2.HealthCheckResponse.SERVING
        asyncio.run(scenario())
        log = stalling.log()
        assert "engine stalled: its work has not advanced for" in log, log
        assert "(running 1, waiting 0, swapped 0;" in log, log
        assert "engine advancing again" in log, log


# ------------------------------------------------------------------------------ a frozen worker

@pytest.mark.slow
def test_frozen_worker_is_given_up_within_the_silence_timeout_and_its_requests_finish_elsewhere(expected):
    with worker_process("--worker-id", "healthy") as healthy, \
            worker_process("--worker-id", "frozen") as frozen:
        async def scenario():
            fleet = FleetConfig(backoff_initial_s=0.2, silence_timeout_s=2.0)
            async with running_router(healthy, frozen, fleet=fleet) as router:
                frozen_at = []
                lost_at = []

                def freeze():
                    frozen.process.send_signal(signal.SIGSTOP)
                    frozen_at.append(time.monotonic())

                async def watch():
                    while "frozen" in router.fleet.workers:
                        await asyncio.sleep(0.05)
                    lost_at.append(time.monotonic())

                watcher = asyncio.create_task(watch())
                outputs = await generate_all(router, on_started=freeze)
                await asyncio.wait_for(watcher, 10)
                assert outputs == [expected[p] for p in PROMPTS]
                assert lost_at[0] - frozen_at[0] < 2.0 + 1.5, lost_at[0] - frozen_at[0]
                assert router.counters.workers_lost == 1
        try:
            asyncio.run(scenario())
        finally:
            frozen.process.send_signal(signal.SIGCONT)


# ------------------------------------------------------------------------------ after a fault

def test_a_submit_after_a_fault_is_handed_back_at_once_and_never_reaches_the_engine(make_engine):
    """Between the fault and the worker's exit, routers may still send work: it goes straight
    back (and the load reports say draining), not into an engine that no longer steps."""
    from prometheus_client import CollectorRegistry

    from common.metrics import WorkerMetrics
    from common.pb import worker_pb2
    from common.convert import submit_tokens
    from worker.engine_loop import EngineLoop, Session

    engine = make_engine(num_blocks=64)
    loop = EngineLoop(engine, WorkerMetrics("m", CollectorRegistry(), lambda: None, 16), "m")
    loop._engine_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert loop.draining

    async def scenario() -> worker_pb2.Event:
        session = Session("s1", asyncio.get_running_loop())
        msg = submit("late", [1, 2, 3], max_tokens=4).submit
        loop.submit(session, msg, time.monotonic(), submit_tokens(msg, engine.max_model_len))
        await asyncio.sleep(0)      # Session.send queues through call_soon_threadsafe
        return session.outbox.get_nowait().event

    event = asyncio.run(scenario())
    assert (event.request_id, event.kind, event.hand_back) == (
        "late", worker_pb2.EVENT_KIND_PREEMPTED, worker_pb2.HAND_BACK_WORKER_FAULT)
    assert event.message.startswith("device fault in step 1: CUDA error")
    assert not engine.has_unfinished()
