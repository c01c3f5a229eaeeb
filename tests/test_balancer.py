"""router.balancer: prefix affinity balanced against load."""

import random


from router.admission import WorkerBudget
from router.balancer import BalancerConfig, affinity_worker, affinity_key, choose_worker


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


# LoRA adapter placement

def test_an_adapter_request_goes_to_a_worker_holding_the_adapter():
    from router.balancer import LoRAPlacement
    workers = idle_workers(4)
    lora = LoRAPlacement("sql", frozenset(w.worker_id for w in workers), frozenset({"worker-2"}))
    assert {choose_worker(workers, prompt(seed), lora=lora).worker_id for seed in range(50)} == {"worker-2"}


def test_an_adapter_request_goes_only_to_workers_that_serve_adapters():
    from router.balancer import LoRAPlacement
    workers = idle_workers(3)
    lora = LoRAPlacement("sql", frozenset({"worker-1"}), frozenset())
    assert {choose_worker(workers, prompt(seed), lora=lora).worker_id for seed in range(20)} == {"worker-1"}
    assert choose_worker(workers[:1], prompt(0), lora=lora) is None


def test_a_much_busier_holder_loses_the_request_to_the_least_loaded_worker():
    from router.balancer import LoRAPlacement
    busy, idle = WorkerBudget("busy", 1000, reserved_tokens=600), WorkerBudget("idle", 1000)
    lora = LoRAPlacement("sql", frozenset({"busy", "idle"}), frozenset({"busy"}))
    assert choose_worker([busy, idle], prompt(0), lora=lora).worker_id == "idle"
    close = WorkerBudget("busy", 1000, reserved_tokens=100)
    assert choose_worker([close, idle], prompt(0), lora=lora).worker_id == "busy"


def test_the_adapter_is_part_of_the_prefix_affinity_key():
    shared = prompt(0, length=64)
    assert affinity_key(shared, 16, 4, "sql") != affinity_key(shared, 16, 4)
    assert affinity_key(shared, 16, 4, "sql") == affinity_key(shared, 16, 4, "sql")
