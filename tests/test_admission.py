"""router.admission: token budgets, the priority queue, overload and reservations."""

import asyncio
import re

import grpc
import pytest

from router.admission import (Admission, AdmissionConfig, Batch, NoWorkers, Overloaded, RequestTooLarge,
                              reservation_tokens)
from router.errors import ApiError


# Admission

def first(workers):
    return workers[0]


def admission_with(*capacities, **config):
    admission = Admission(AdmissionConfig(**config))
    for i, capacity in enumerate(capacities):
        admission.set_worker(f"w{i}", capacity)
    return admission


async def start_waiting(admission, tokens, priority=0):
    """Starts a reserve() that must queue; returns its task once it is in the queue."""
    waiting = admission.num_waiting
    task = asyncio.create_task(admission.reserve(tokens, first, priority))
    while admission.num_waiting == waiting and not task.done():
        await asyncio.sleep(0)  # one scheduler turn: reserve() queues on its first run
    assert not task.done(), "the request should have had to wait"
    return task


def assert_nothing_reserved(admission):
    assert admission.num_admitted == 0 and admission.num_waiting == 0
    assert all(w.reserved_tokens == 0 and w.num_requests == 0 for w in admission.workers)


def test_reservation_covers_prompt_and_max_tokens_of_every_choice():
    assert reservation_tokens(prompt_tokens=100, max_tokens=28, n=3) == 384


def test_admission_places_request_only_where_it_fits():
    async def scenario():
        admission = admission_with(100, 100)
        offered = []
        held = await admission.reserve(80, first)
        second = await admission.reserve(80, lambda fits: offered.append(fits) or fits[0])
        assert (held.worker_id, second.worker_id) == ("w0", "w1")
        assert [w.worker_id for w in offered[0]] == ["w1"]
    asyncio.run(scenario())


def test_admission_budget_is_capacity_times_overcommit():
    admission = admission_with(100, overcommit=1.5)
    assert admission.workers[0].capacity_tokens == 150


def test_admission_rejects_when_queue_full_with_retry_hint():
    async def scenario():
        admission = admission_with(100, max_queue_len=1)
        held = await admission.reserve(100, first)
        waiter = await start_waiting(admission, 50)
        with pytest.raises(Overloaded) as rejected:
            await admission.reserve(10, first)
        assert rejected.value.retry_after_s >= 1.0
        assert "retry in about" in str(rejected.value)
        waiter.cancel()
        held.release()
    asyncio.run(scenario())


def test_admission_waiter_admitted_after_release():
    async def scenario():
        admission = admission_with(100)
        held = await admission.reserve(100, first)
        waiter = await start_waiting(admission, 50)
        held.release()
        reservation = await waiter
        assert (reservation.worker_id, reservation.tokens) == ("w0", 50)
        assert admission.workers[0].reserved_tokens == 50
    asyncio.run(scenario())


def test_admission_rejects_after_max_wait():
    async def scenario():
        admission = admission_with(100, max_wait_s=0.05)
        held = await admission.reserve(100, first)
        with pytest.raises(Overloaded) as rejected:
            await admission.reserve(50, first)
        assert "queue wait limit of 0.05 s (--max-queue-wait)" in str(rejected.value)
        assert rejected.value.retry_after_s >= 1.0
        assert admission.num_waiting == 0
        held.release()
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


def test_a_batch_prompt_waits_for_its_own_batch_past_the_wait_limit():
    """A completions batch larger than the pool: its last prompt waits for the room its first
    one holds, however long that runs, instead of failing the batch (and every retry of it)."""
    async def scenario():
        admission = admission_with(100, max_wait_s=0.05)
        batch = Batch()
        held = await admission.reserve(100, first, batch=batch)
        waiter = asyncio.create_task(admission.reserve(60, first, batch=batch))
        await asyncio.sleep(0.2)        # four wait limits
        assert not waiter.done() and admission.num_waiting == 1
        held.release()
        assert (await waiter).tokens == 60
    asyncio.run(scenario())


def test_a_batch_prompt_waiting_for_another_clients_room_gets_a_fresh_limit_once_its_batch_holds_none():
    async def scenario():
        admission = admission_with(100, max_wait_s=0.05)
        other = await admission.reserve(50, first)
        batch = Batch()
        sibling = await admission.reserve(50, first, batch=batch)
        waiter = asyncio.create_task(admission.reserve(60, first, batch=batch))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        sibling.release()               # 50 free: the waiter needs the other client's room too
        await asyncio.sleep(0.01)
        assert not waiter.done(), "its limit starts afresh when its batch stops holding room"
        with pytest.raises(Overloaded, match="queue wait limit of 0.05 s"):
            await waiter
        other.release()
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


def test_only_a_batchs_first_prompt_is_held_to_the_queue_length_bound():
    async def scenario():
        admission = admission_with(100, max_queue_len=1)
        held = await admission.reserve(100, first)
        batch = Batch()
        prompts = [asyncio.create_task(admission.reserve(10, first, batch=batch)) for _ in range(3)]
        await asyncio.sleep(0)
        assert admission.num_waiting == 3 and not any(p.done() for p in prompts)
        with pytest.raises(Overloaded, match="already waiting"):
            await admission.reserve(10, first, batch=Batch())      # another client's batch
        held.release()
        assert [(await p).tokens for p in prompts] == [10, 10, 10]
    asyncio.run(scenario())


def test_admission_is_fifo_so_a_large_waiter_is_not_overtaken():
    async def scenario():
        admission = admission_with(100)
        held = await admission.reserve(60, first)
        large = await start_waiting(admission, 80)
        small = await start_waiting(admission, 30)  # would fit now, but queues behind `large`
        held.release()
        assert (await large).tokens == 80
        assert not small.done()
        (await large).release()
        assert (await small).tokens == 30
    asyncio.run(scenario())


def serving_order(*priorities, cancelled=()):
    """Queues requests with these priorities, in this order, behind a full worker that holds one
    at a time; cancels those at the `cancelled` indices, then frees the worker request by request.
    Returns the indices of the others in the order they were placed."""
    async def scenario():
        admission = admission_with(100)
        running = await admission.reserve(100, first)
        waiters = [await start_waiting(admission, 100, priority) for priority in priorities]
        for index in cancelled:
            waiters[index].cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiters[index]
        pending = {task: index for index, task in enumerate(waiters) if index not in cancelled}
        order = []
        while pending:
            running.release()
            placed, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            assert len(placed) == 1, "only one request fits at a time"
            task = placed.pop()
            order.append(pending.pop(task))
            running = task.result()
        running.release()
        assert_nothing_reserved(admission)
        return order
    return asyncio.run(scenario())


def test_admission_serves_lower_priority_value_first_though_queued_later():
    assert serving_order(5, 0) == [1, 0]


def test_admission_keeps_fifo_among_equal_priorities():
    assert serving_order(3, 3, 3) == [0, 1, 2]


def test_admission_places_newcomer_better_than_every_waiter_at_once_when_it_fits():
    async def scenario():
        admission = admission_with(100, max_wait_s=0.05)  # had it queued, it would fail fast
        held = await admission.reserve(60, first)
        large = await start_waiting(admission, 80, priority=1)
        urgent = await admission.reserve(30, first, priority=0)
        assert (urgent.worker_id, urgent.tokens) == ("w0", 30)
        assert admission.num_waiting == 1 and not large.done()
        large.cancel()
        urgent.release()
        held.release()
    asyncio.run(scenario())


def test_admission_full_queue_refuses_even_a_better_priority_newcomer():
    async def scenario():
        admission = admission_with(100, max_queue_len=1)
        held = await admission.reserve(100, first)
        waiter = await start_waiting(admission, 50, priority=5)
        with pytest.raises(Overloaded):
            await admission.reserve(10, first, priority=0)
        assert admission.num_waiting == 1 and not waiter.done()
        waiter.cancel()
        held.release()
    asyncio.run(scenario())


def test_admission_cancelling_a_middle_waiter_keeps_the_others_in_order():
    assert serving_order(2, 0, 1, cancelled=[2]) == [1, 0]


def test_overloaded_message_states_the_retry_after_trailer():
    overloaded = Overloaded("3 requests are already waiting", retry_after_s=1.2)
    error = ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(overloaded),
                     retry_after_s=overloaded.retry_after_s)  # as GenerationService._admit does
    stated = re.search(r"retry in about (\d+) s", str(overloaded)).group(1)
    assert stated == dict(error.trailing_metadata)["retry-after"] == "2"  # 1.2 s, rounded up


def test_admission_cancelled_waiter_leaves_nothing_reserved():
    async def scenario():
        admission = admission_with(100)
        held = await admission.reserve(100, first)
        waiter = await start_waiting(admission, 50)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        held.release()
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


def test_admission_waiter_cancelled_right_after_grant_releases_it():
    async def scenario():
        admission = admission_with(100)
        held = await admission.reserve(100, first)
        waiter = await start_waiting(admission, 50)
        held.release()  # grants the waiter, which has not resumed yet...
        assert admission.num_admitted == 1
        waiter.cancel()  # ...and is cancelled before it could take its reservation
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


def test_admission_caps_concurrent_requests():
    async def scenario():
        admission = admission_with(1000, max_concurrent_requests=1)
        held = await admission.reserve(10, first)
        waiter = await start_waiting(admission, 10)
        held.release()
        (await waiter).release()
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


def test_admission_rejects_request_larger_than_any_worker():
    async def scenario():
        with pytest.raises(RequestTooLarge, match="needs 101 tokens"):
            await admission_with(100, 40).reserve(101, first)
    asyncio.run(scenario())


def test_admission_without_accepting_workers_is_unavailable():
    async def scenario():
        admission = Admission()
        admission.set_worker("draining", 100, accepting=False)
        with pytest.raises(NoWorkers):
            await admission.reserve(10, first)
    asyncio.run(scenario())


def test_reservation_moved_to_another_worker_is_released_there():
    async def scenario():
        admission = admission_with(100, 100)
        reservation = await admission.reserve(90, first)
        reservation.move_to("w1")
        assert [w.reserved_tokens for w in admission.workers] == [0, 90]
        reservation.release()
        reservation.release()  # idempotent
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


# Sharing a worker with other router replicas

def test_a_replica_alone_on_a_worker_may_reserve_all_the_room_the_report_leaves():
    async def scenario():
        admission = admission_with(100)
        admission.observe_load("w0", tokens_in_flight=0, own_tokens_in_flight=0, num_sessions=1)
        assert (await admission.reserve(100, first)).tokens == 100
    asyncio.run(scenario())


def test_a_replica_claims_only_its_share_of_the_room_others_leave_until_the_next_report():
    async def scenario():
        admission = admission_with(100)
        # Another replica holds 20: 80 are left, and this replica's half of them is 40.
        admission.observe_load("w0", tokens_in_flight=20, own_tokens_in_flight=0, num_sessions=2)
        await admission.reserve(30, first)
        waiter = await start_waiting(admission, 20)
        # The next report counts this replica's 30: its share is half of the 50 left.
        admission.observe_load("w0", tokens_in_flight=50, own_tokens_in_flight=30, num_sessions=2)
        assert (await waiter).tokens == 20
        assert admission.workers[0].free_tokens == 5
    asyncio.run(scenario())


def test_a_replica_alone_on_a_worker_reserves_all_it_releases_again_at_once():
    async def scenario():
        admission = admission_with(100)
        admission.observe_load("w0", tokens_in_flight=0, own_tokens_in_flight=0, num_sessions=1)
        (await admission.reserve(100, first)).release()
        assert admission.workers[0].free_tokens == 100
    asyncio.run(scenario())


def test_a_shared_replica_reserves_a_share_of_what_it_releases_at_once_and_the_rest_after_a_report():
    async def scenario():
        admission = admission_with(100)
        admission.observe_load("w0", tokens_in_flight=0, own_tokens_in_flight=0, num_sessions=2)
        (await admission.reserve(50, first)).release()
        at_once = admission.workers[0].free_tokens
        admission.observe_load("w0", tokens_in_flight=0, own_tokens_in_flight=0, num_sessions=2)
        assert [at_once, admission.workers[0].free_tokens] == [25, 50]
    asyncio.run(scenario())


def test_a_finished_request_another_replica_saw_free_before_its_release_is_not_reserved_twice():
    """The worker drops a finished request from its count before the finish reaches its
    replica: the other replica's next report shows those tokens free already."""
    async def scenario():
        a, b = admission_with(100), admission_with(100)
        for admission in (a, b):
            admission.observe_load("w0", tokens_in_flight=0, own_tokens_in_flight=0, num_sessions=2)
        finished = await a.reserve(50, first)
        a.observe_load("w0", tokens_in_flight=50, own_tokens_in_flight=50, num_sessions=2)
        await a.reserve(25, first)      # its share of the 50 left
        b.observe_load("w0", tokens_in_flight=25, own_tokens_in_flight=0, num_sessions=2)
        finished.release()
        a_worker, b_worker = a.workers[0], b.workers[0]
        assert a_worker.reserved_tokens + a_worker.free_tokens + b_worker.free_tokens <= 100
    asyncio.run(scenario())


def test_a_request_larger_than_a_share_takes_the_whole_room_once_per_report():
    async def scenario():
        admission = admission_with(100, 100)
        for worker in ("w0", "w1"):
            admission.observe_load(worker, tokens_in_flight=0, own_tokens_in_flight=0, num_sessions=2)
        large = await admission.reserve(80, first)  # over the share of 50, within the room
        assert large.worker_id == "w0"
        second = await admission.reserve(20, first)  # w0 has claimed since its report: w1 takes it
        assert second.worker_id == "w1"
        third = await start_waiting(admission, 60)
        admission.observe_load("w1", tokens_in_flight=20, own_tokens_in_flight=20, num_sessions=2)
        assert (await third).worker_id == "w1"
    asyncio.run(scenario())


def test_shares_taken_from_reports_that_miss_submits_in_flight_never_sum_past_the_pool():
    """Two replicas each hold 20 of a 100-token worker, 10 of which the worker has not read yet
    when it reports, so each report shows the other holding only 10. Their new shares still sum
    to the 60 truly left (before, 35 each: 70)."""
    async def scenario():
        replicas = [admission_with(100), admission_with(100)]
        for admission in replicas:
            await admission.reserve(20, first)
            admission.observe_load("w0", tokens_in_flight=20, own_tokens_in_flight=10,
                                   num_sessions=2, unread_tokens=10)
        assert sum(a.workers[0].free_tokens for a in replicas) == 60
    asyncio.run(scenario())


def test_room_other_replicas_hold_past_the_capacity_admits_nothing():
    async def scenario():
        admission = admission_with(100, max_wait_s=0.05)
        admission.observe_load("w0", tokens_in_flight=130, own_tokens_in_flight=0, num_sessions=2)
        with pytest.raises(Overloaded):
            await admission.reserve(1, first)
    asyncio.run(scenario())


# Suspension (router.preemption)

def test_a_suspended_reservation_gives_its_tokens_back_until_it_resumes():
    async def scenario():
        admission = admission_with(100)
        victim = await admission.reserve(60, first, priority=5)
        urgent_waiting = await start_waiting(admission, 50, priority=0)
        victim.suspend()
        urgent = await urgent_waiting
        assert admission.workers[0].reserved_tokens == 50 and admission.num_admitted == 1
        resuming = asyncio.create_task(victim.resume(first))
        await asyncio.sleep(0)
        assert not resuming.done() and admission.head.priority == 5
        urgent.release()
        await resuming
        assert (victim.suspended, admission.workers[0].reserved_tokens) == (False, 60)
        victim.release()
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


def test_a_resuming_reservation_keeps_its_place_ahead_of_later_arrivals_of_its_priority():
    async def scenario():
        admission = admission_with(100)
        victim = await admission.reserve(60, first, priority=5)
        victim.suspend()
        blocker = await admission.reserve(100, first, priority=0)
        later = await start_waiting(admission, 60, priority=5)
        resuming = asyncio.create_task(victim.resume(first))
        await asyncio.sleep(0)
        blocker.release()
        await resuming
        assert not later.done()
        victim.release()
        (await later).release()
        assert_nothing_reserved(admission)
    asyncio.run(scenario())


def test_releasing_a_reservation_while_it_waits_to_resume_leaves_nothing_behind():
    async def scenario():
        admission = admission_with(100)
        victim = await admission.reserve(60, first, priority=5)
        victim.suspend()
        blocker = await admission.reserve(100, first)
        resuming = asyncio.create_task(victim.resume(first))
        await asyncio.sleep(0)
        victim.release()
        with pytest.raises(asyncio.CancelledError):
            await resuming
        blocker.release()
        assert_nothing_reserved(admission)
    asyncio.run(scenario())
