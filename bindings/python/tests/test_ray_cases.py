"""kvtrie.PrefixTree against Ray 2.60.0's PrefixTree on cases the other suites do not cover:
every form of ``available_tenants`` (Ray tests the object's truth, so an empty iterator
filters everything out while an empty list means every tenant), and random sequences over
combining marks, NUL and shared lead bytes with repeated timestamps and odd eviction sizes.
Every test runs the same calls on both trees and compares the results.
"""

from __future__ import annotations

import random

import pytest

import kvtrie
from conftest import ray_prefix_tree_class


def both():
    return kvtrie.PrefixTree(), ray_prefix_tree_class()()


def setup(tree):
    tree.add_tenants(["a", "b"], 0.0)
    tree.insert("hello world", "a", 1.0)
    tree.insert("hello there", "b", 2.0)


@pytest.mark.parametrize(
    "make_available",
    [
        pytest.param(lambda: iter([]), id="empty-iterator"),
        pytest.param(lambda: (x for x in []), id="empty-generator"),
    ],
)
def test_empty_iterable_available_tenants_as_ray(make_available):
    # Ray tests `if available_tenants:` on the object itself: an (empty) iterator or generator
    # is truthy, so Ray filters it to nothing and returns ("", None). Only a falsy value
    # (None, [], (), set()) means "every tenant".
    ours, ray = both()
    setup(ours)
    setup(ray)
    expected = ray.prefix_match("hello wor", make_available())
    assert expected == ("", None)
    assert ours.prefix_match("hello wor", make_available()) == expected
    assert ours.prefix_match_many(["hello wor"], make_available()) == [expected]


@pytest.mark.parametrize("available", [None, [], (), set(), ["b"], ("b", "a"), ["ghost"]])
def test_available_tenant_containers_as_ray(available):
    ours, ray = both()
    setup(ours)
    setup(ray)
    for text in ["hello wor", "hello", "", "xyz", "hello th"]:
        assert ours.prefix_match(text, available) == ray.prefix_match(text, available)


ALPHA = ["a", "b", "é", "è", "中", "🙂", "🙃", "\u0301", "\u0300", "\0", "e\u0301", " "]


def rtext(r, n):
    return "".join(r.choice(ALPHA) for _ in range(r.randint(0, n)))


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_match_ray(seed):
    """Multi-byte text (combining marks, NUL, shared lead bytes), repeated timestamps, float
    and negative eviction sizes."""
    r = random.Random(seed)
    ours, ray = both()
    names = ["r0", "r1", "r2", "r3", "ghost"]
    now = 0.0
    texts = []
    for step in range(300):
        where = f"seed {seed} step {step}"
        if r.random() < 0.6:
            now += r.choice([0.0, 0.25, 1.0])
        op = r.random()
        if op < 0.1:
            ns = [r.choice(names) for _ in range(r.randint(0, 3))]
            assert ours.add_tenants(ns, now) == ray.add_tenants(ns, now), where
        elif op < 0.45:
            if texts and r.random() < 0.6:
                b = r.choice(texts)
                text = b[: r.randint(0, len(b))] + rtext(r, 3)
            else:
                text = rtext(r, 10)
            texts.append(text)
            t = r.choice(names)
            assert ours.insert(text, t, now) == ray.insert(text, t, now), where
        elif op < 0.7:
            text = r.choice(texts) if texts and r.random() < 0.7 else rtext(r, 6)
            if r.random() < 0.5:
                text = text[: r.randint(0, len(text))] + rtext(r, 2)
            k = r.random()
            avail = None if k < 0.3 else ([] if k < 0.4 else [r.choice(names) for _ in range(r.randint(1, 4))])
            assert ours.prefix_match(text, avail) == ray.prefix_match(text, avail), where
        elif op < 0.77:
            ns = list(dict.fromkeys(r.choice(names) for _ in range(r.randint(0, 3))))
            assert ours.remove_tenants(ns) == ray.remove_tenants(ns), where
        elif op < 0.93:
            t = r.choice(names)
            n = r.choice([0, 1, 2, 3, 5, 10, 50, 10**6, 2.5, -3])
            assert ours.evict_tenant_by_lru(t, n) == ray.evict_tenant_by_lru(t, n), where
        else:
            assert ours.get_smallest_tenants() == ray.get_smallest_tenants(), where
        assert ours.tenant_to_char_count == ray.tenant_to_char_count, where
        assert list(ours.tenant_to_char_count) == list(ray.tenant_to_char_count), where
    ours.check_invariants()
