"""kvtrie.PrefixTree against Ray 2.60.0's PrefixTree on random operation sequences: every
result (inserts, matches, removals, evictions, smallest tenants, char counts) must be equal.

Times never decrease within a sequence (kvtrie keeps the newest time of a node where Ray
overwrites it with an older one: a documented deviation), names are not repeated within one
``remove_tenants`` call (the other documented deviation), and texts mix ASCII with
multi-code-point characters that share UTF-8 lead bytes.
"""

from __future__ import annotations

import random

import pytest

import kvtrie
from conftest import ray_prefix_tree_class

ALPHABET = "aab é è🙂🙃中"
NAMES = ["r0", "r1", "r2", "r3", "r4"]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))


def random_names(rng: random.Random, unique: bool) -> list:
    pool = NAMES + ["ghost"]
    k = rng.randint(0, 4)
    return rng.sample(pool, k) if unique else [rng.choice(pool) for _ in range(k)]


@pytest.mark.parametrize("seed", range(100))
def test_random_sequences_match_ray(seed):
    rng = random.Random(seed)
    ours = kvtrie.PrefixTree()
    ray = ray_prefix_tree_class()()
    now = 0.0
    texts = []
    for step in range(300):
        op = rng.random()
        if rng.random() < 0.7:
            now += rng.choice([0.0, 0.5, 1.0])  # equal times form LRU groups
        where = f"seed {seed} step {step}"
        if op < 0.08:
            names = random_names(rng, unique=False)
            assert ours.add_tenants(names, now) == ray.add_tenants(names, now), where
        elif op < 0.45:
            text = rng.choice(texts) + random_text(rng) if texts and rng.random() < 0.5 else random_text(rng)
            texts.append(text)
            tenant = rng.choice(NAMES + ["ghost"])
            assert ours.insert(text, tenant, now) == ray.insert(text, tenant, now), where
        elif op < 0.75:
            text = rng.choice(texts) if texts and rng.random() < 0.7 else random_text(rng)
            if rng.random() < 0.5:
                text = text[: rng.randint(0, len(text))] + random_text(rng)[:2]
            avail = None if rng.random() < 0.4 else random_names(rng, unique=False)
            assert ours.prefix_match(text, avail) == ray.prefix_match(text, avail), where
        elif op < 0.82:
            names = random_names(rng, unique=True)
            assert ours.remove_tenants(names) == ray.remove_tenants(names), where
        elif op < 0.94:
            tenant = rng.choice(NAMES + ["ghost"])
            n = rng.choice([0, 1, 2, 5, 20, 1000])
            assert ours.evict_tenant_by_lru(tenant, n) == ray.evict_tenant_by_lru(tenant, n), where
        else:
            assert ours.get_smallest_tenants() == ray.get_smallest_tenants(), where
        assert ours.tenant_to_char_count == ray.tenant_to_char_count, where
        assert list(ours.tenant_to_char_count) == list(ray.tenant_to_char_count), where
    ours.check_invariants()
