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
