"""kvtrie.ray.PrefixCacheAffinityRouter inside a real Ray 2.60.0 installation: configured by
import path as Ray Serve configures routers, constructed with the arguments Ray's handle
router passes, and routing requests through Ray's own routing loop (``RequestRouter``
machinery, queue-length probes, pending requests) with fake replicas, as Ray's unit tests
do for its PrefixCacheAffinityRouter."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import time

import pytest

import kvtrie
from conftest import require

serve_common = require("ray.serve._private.common", "pip install 'ray[serve]==2.60.0'")
from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402
from ray.serve._private.request_router.replica_wrapper import RunningReplica  # noqa: E402
from ray.serve._private.utils import generate_request_id  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

import kvtrie.ray  # noqa: E402

DEPLOYMENT = DeploymentID(name="LLM", app_name="app")


class FakeReplica(RunningReplica):
    """A replica answering queue-length probes from memory (no actor)."""

    def __init__(self, uid: str, queue_len: int = 0):
        self._rid = ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT)
        self.queue_len = queue_len

    @property
    def replica_id(self):
        return self._rid

    @property
    def node_id(self):
        return ""

    @property
    def availability_zone(self):
        return None

    @property
    def multiplexed_model_ids(self):
        return set()

    @property
    def max_ongoing_requests(self):
        return 10

    @property
    def is_cross_language(self):
        return False

    @property
    def routing_stats(self):
        return {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


class Prompt:
    def __init__(self, prompt):
        self.prompt = prompt


class Chat:
    def __init__(self, messages):
        self.messages = messages


def pending(arg=None) -> PendingRequest:
    return pending_args([] if arg is None else [arg])


def pending_args(args) -> PendingRequest:
    """A request with these positional arguments."""
    return PendingRequest(
        args=list(args),
        kwargs={},
        metadata=RequestMetadata(
            request_id=generate_request_id(),
            internal_request_id=generate_request_id(),
            multiplexed_model_id="",
        ),
        created_at=time.time(),
    )


def make_router(tree=None, tree_actor=None, **kwargs):
    """As Ray Serve does: the class from a RequestRouterConfig (import path, pickled by
    value), constructed with the handle router's arguments, then initialize_state with the
    configured (JSON) kwargs. ``tree`` / ``tree_actor`` are passed directly, as tests pass
    Ray's ``tree_actor``."""
    config = RequestRouterConfig(
        request_router_class="kvtrie.ray.PrefixCacheAffinityRouter",
        request_router_kwargs=kwargs,
    )
    cls = config.get_request_router_class()
    router = cls(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.REPLICA,
        self_node_id="node",
        self_actor_id="actor",
        self_actor_handle=None,
        use_replica_queue_len_cache=False,
        create_replica_wrapper_func=lambda r: RunningReplica(r),
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
    )
    extra = {}
    if tree is not None:
        extra["tree"] = tree
    if tree_actor is not None:
        extra["tree_actor"] = tree_actor
    router.initialize_state(**config.request_router_kwargs, **extra)
    return router


async def route(router, req):
    """Routes one request through Ray's routing loop and runs the routed callback."""
    replica = await asyncio.wait_for(router._choose_replica_for_request(req), 30)
    router.on_request_routed(req, replica.replica_id, None)
    return replica


def rid(replica):
    return replica.replica_id.to_full_id_str()


def run(coro):
    return asyncio.run(coro)


def test_configured_class_is_a_ray_prefix_cache_affinity_router():
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter as RayRouter,
    )

    router = make_router(imbalanced_threshold=20)
    assert isinstance(router, RayRouter)
    assert isinstance(router.tree, kvtrie.PrefixTree)
    assert router._imbalanced_threshold == 20 and router._match_rate_threshold == 0.1
    # Ray's actor handle, stood in for over the router's tree (its calls need Ray running:
    # test_ray_serve.py).
    assert isinstance(router._tree_actor, kvtrie.ray.TreeActorStandIn)
    assert router._tree_actor.tree is router.tree


def test_routes_by_prefix_then_by_smallest_tree():
    async def body():
        router = make_router(imbalanced_threshold=10, tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        router.update_replicas([r1, r2])
        assert router.tree.tenant_to_char_count == {rid(r1): 0, rid(r2): 0}
        router.tree.insert("Hello", rid(r2), time.time())
        assert router.tree.prefix_match("Hello world") == ("Hello", [rid(r2)])
        # High match rate: the matching replica, for prompts and chats alike.
        for _ in range(5):
            assert await route(router, pending(Prompt("Hello world"))) is r2
        chat = Chat([{"content": "Hello"}, {"content": " world"}])
        assert await route(router, pending(chat)) is r2
        # The routed prompts were recorded for r2.
        assert router.tree.prefix_match("Hello world!") == ("Hello world", [rid(r2)])
        # Low match rate: the smaller tree (r1), which then learns the prompt.
        assert await route(router, pending(Prompt("zebra"))) is r1
        assert router.tree.tenant_to_char_count[rid(r1)] == 5
        assert await route(router, pending(Chat([{"content": [{"type": "text", "text": "zebras"}]}]))) is r1
        assert router.curr_num_routing_tasks == 0 and router.num_pending_requests == 0

    run(body())


def test_a_match_rate_equal_to_the_threshold_follows_the_prefix():
    # Ray falls back to the smallest trees only below match_rate_threshold.
    async def body():
        router = make_router(match_rate_threshold=0.5, tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        router.update_replicas([r1, r2])
        router.tree.insert("abcd", rid(r2), time.time())
        assert await route(router, pending(Prompt("abcdwxyz"))) is r2  # 4 of 8: 0.5
        assert await route(router, pending(Prompt("abcQRSTU"))) is r1  # 3 of 8: below

    run(body())


def test_imbalanced_load_falls_back_to_power_of_two():
    async def body():
        router = make_router(imbalanced_threshold=2, tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1", 0), FakeReplica("r2", 10)
        router.update_replicas([r1, r2])
        router.tree.insert("hello world", rid(r2), time.time())
        for _ in range(5):
            assert await route(router, pending(Prompt("hello world"))) is r1

    run(body())


def test_a_spread_equal_to_the_imbalanced_threshold_is_balanced():
    # Ray routes by load alone only when the spread of queue lengths exceeds the threshold.
    async def body():
        router = make_router(imbalanced_threshold=2, tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1", 0), FakeReplica("r2", 2)
        router.update_replicas([r1, r2])
        router.tree.insert("hello world", rid(r2), time.time())
        for _ in range(5):
            assert await route(router, pending(Prompt("hello world"))) is r2
        r2.queue_len = 3
        for _ in range(5):
            assert await route(router, pending(Prompt("hello world"))) is r1

    run(body())


def test_no_prompt_and_empty_prompt():
    async def body():
        router = make_router(tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1", 0), FakeReplica("r2", 5)
        router.update_replicas([r1, r2])
        # No args: Ray's power of two picks the least busy.
        for _ in range(5):
            assert await asyncio.wait_for(router._choose_replica_for_request(pending()), 30) is r1
        # An empty prompt: match rate 0 instead of Ray's division by zero.
        assert await route(router, pending(Prompt(""))) in (r1, r2)

    run(body())


class Embedding:
    """An argument with neither ``prompt`` nor ``messages`` (as Ray Serve LLM's embedding
    requests, an HTTP request from Serve's proxy, or any other method's arguments)."""

    def __init__(self, input):
        self.input = input


def test_requests_without_a_prompt_are_routed_by_power_of_two():
    # Ray's router raises ValueError in its routing loop for these, and the request waits for
    # a replica forever (tests/test_ray_serve.py shows it through a real Serve application).
    async def body():
        router = make_router(tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1", 0), FakeReplica("r2", 5)
        router.update_replicas([r1, r2])
        router.tree.insert("hello world", rid(r2), time.time())
        for arg in (Embedding("hello world"), 21, "hello world", {"prompt": "hello world"}):
            req = pending(arg)
            # Power of two picks the less busy replica; the tree is not asked.
            assert await route(router, req) is r1
        # Nothing was recorded for them.
        assert router.tree.tenant_to_char_count == {rid(r1): 0, rid(r2): 11}
        # A request with a prompt among other arguments still goes by the tree.
        assert await route(router, pending_args([21, Prompt("hello world")])) is r2

    run(body())


def test_a_prompt_with_a_lone_surrogate_is_routed():
    # Valid JSON ("\ud83d" alone) that is not Unicode text: Ray's tree takes it, and an error
    # in the routing loop would leave the request waiting for a replica forever.
    async def body():
        router = make_router(tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        router.update_replicas([r1, r2])
        prompt = json.loads('"hi \\ud83d there"')
        first = await route(router, pending(Prompt(prompt)))
        # Recorded with the surrogate read as U+FFFD: the same length in chars.
        assert router.tree.tenant_to_char_count[rid(first)] == len(prompt) == 10
        assert await route(router, pending(Prompt(prompt))) is first

    run(body())


def test_every_lone_surrogate_is_read_as_the_replacement_character():
    # High and low surrogates alike, up to the last one (U+DFFF), are recorded as U+FFFD.
    async def body():
        router = make_router(tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        router.update_replicas([r1, r2])
        for i, s in enumerate(["\ud800", "\udbff", "\udc00", "\udfff"]):
            router.on_request_routed(pending(Prompt(f"{i}a{s}b")), r1.replica_id, None)
            assert router.tree.prefix_match(f"{i}a\ufffdb") == (f"{i}a\ufffdb", [rid(r1)])
        assert router.tree.tenant_to_char_count == {rid(r1): 4 * 4, rid(r2): 0}
        assert await route(router, pending(Prompt("0a\udfffb"))) is r1

    run(body())


def test_replica_changes_update_the_tree():
    async def body():
        router = make_router(tree=kvtrie.PrefixTree())
        r1, r2, r3 = FakeReplica("r1"), FakeReplica("r2"), FakeReplica("r3")
        router.update_replicas([r1, r2])
        await route(router, pending(Prompt("some prompt")))
        router.update_replicas([r2, r3])
        assert set(router.tree.tenant_to_char_count) == {rid(r2), rid(r3)}
        router.on_replica_actor_died(r3.replica_id)
        assert set(router.tree.tenant_to_char_count) == {rid(r2)}
        assert r3.replica_id not in router.curr_replicas
        assert await route(router, pending(Prompt("some prompt"))) is r2

    run(body())


def test_routers_in_two_processes_share_their_decisions_over_nats(nats_url):
    # Two routers of one deployment as two processes would have them: each its own shared
    # router (distinct router ids), on one NATS server.
    systems = [f"You are assistant number {i}. " * 20 for i in range(6)]

    async def body():
        a = make_router(nats_url=nats_url, nats_options={"router_id": 1})
        b = make_router(nats_url=nats_url, nats_options={"router_id": 2})
        assert a.tree is None and a.shared_router is not b.shared_router
        assert a._tree_actor is None
        assert a.shared_router.is_shared
        replicas = [FakeReplica("r1"), FakeReplica("r2"), FakeReplica("r3")]
        a.update_replicas(replicas)
        b.update_replicas(replicas)
        first = [rid(await route(a, pending(Prompt(s + "?")))) for s in systems]
        assert set(first) == {rid(r) for r in replicas}, first
        assert a.shared_router.sync() and b.shared_router.sync()
        # b routes every system prompt where a sent it, from a's decisions alone.
        assert [rid(await route(b, pending(Prompt(s + "!")))) for s in systems] == first
        # Each routed request was recorded once, when it was routed: choosing alone (as
        # Ray's loop does again when the replica it chose is full) records nothing.
        assert a.shared_router.shared_stats()["recorded"] == 6
        assert b.shared_router.shared_stats()["recorded"] == 6
        await b.choose_replicas(replicas, pending(Prompt(systems[0] + "?")))
        assert b.shared_router.shared_stats()["recorded"] == 6
        # A prompt attribute that is None: routed by power of two, as with no attribute.
        await route(b, pending(Prompt(None)))
        assert b.shared_router.shared_stats()["recorded"] == 6
        # A request without a prompt is still routed (power of two), and nothing recorded.
        await route(b, pending(Embedding("x")))
        assert b.shared_router.shared_stats()["recorded"] == 6
        # A replica that leaves is dropped from the shared router too.
        a.update_replicas(replicas[:2])
        assert set(a.shared_router.replicas()) == {rid(r) for r in replicas[:2]}
        # Routers of the deployment in one process share one shared router.
        again = make_router(nats_url=nats_url, nats_options={"router_id": 1})
        assert again.shared_router is a.shared_router

    run(body())


class SlowProbe(FakeReplica):
    """A replica whose next queue-length probes time out."""

    def __init__(self, uid: str, timeouts: int):
        super().__init__(uid)
        self.timeouts = timeouts
        self.probes = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        if self.timeouts > 0:
            self.timeouts -= 1
            await asyncio.sleep(deadline_s * 5)
        return self.queue_len


async def route_with_a_failed_probe(router, slow, prompt: str):
    """Routes ``prompt`` while ``slow``'s queue-length probe times out once. Ray probes new
    replicas in the background: that probe lands first, so that the routing's own probe of
    ``slow`` is the one that times out."""
    end = time.monotonic() + 30
    while slow.probes == 0:
        assert time.monotonic() < end, "Ray never probed the new replica"
        await asyncio.sleep(0.01)
    slow.timeouts = 1
    chosen = await route(router, pending(Prompt(prompt)))
    assert slow.timeouts == 0  # the routing's probe did time out
    return chosen


def test_a_replica_whose_probe_fails_stays_a_candidate_with_nats(nats_url):
    # Ray keeps a replica whose queue length is unknown among the prefix-match candidates;
    # the shared router dropped it, and sent its cached prompt elsewhere.
    async def body():
        router = make_router(
            nats_url=nats_url,
            nats_options={"router_id": 3, "subject_prefix": f"probe{time.time_ns()}"},
        )
        r1, r2 = FakeReplica("r1"), SlowProbe("r2", timeouts=0)
        router.update_replicas([r1, r2])
        router.shared_router.record("P" * 50, rid(r2))
        router.shared_router.record("Q" * 60, rid(r1))
        assert rid(await route_with_a_failed_probe(router, r2, "P" * 50)) == rid(r2)

    run(body())


def test_a_replica_whose_probe_fails_counts_as_the_least_loaded_known_with_nats(nats_url):
    # Its queue length is taken as the lowest known one (0 here): of two replicas holding
    # the prompt, it wins over the one with queue length 1.
    async def body():
        router = make_router(
            nats_url=nats_url,
            nats_options={"router_id": 4, "subject_prefix": f"fill{time.time_ns()}"},
        )
        r1, r2 = FakeReplica("r1", 1), SlowProbe("r2", timeouts=0)
        r3, r4 = FakeReplica("r3", 0), FakeReplica("r4", 2)
        router.update_replicas([r1, r2, r3, r4])
        router.shared_router.record("P" * 50, rid(r1))
        router.shared_router.record("P" * 50, rid(r2))
        assert rid(await route_with_a_failed_probe(router, r2, "P" * 50)) == rid(r2)

    run(body())


def test_a_cache_miss_goes_to_the_smallest_live_replica_past_stale_tenants():
    # The process's tree outlives serve.shutdown(): replicas of an earlier deployment stay in
    # it with 0 chars, and every miss went to power of two instead of the smallest replica.
    async def body():
        tree = kvtrie.PrefixTree()
        old = make_router(tree=tree)
        old.update_replicas([FakeReplica("old0"), FakeReplica("old1")])
        new = make_router(tree=tree)
        n1, n2 = FakeReplica("n1", queue_len=0), FakeReplica("n2", queue_len=1)
        new.update_replicas([n1, n2])
        tree.insert("X" * 100, rid(n1), time.time())
        tree.insert("Y" * 10, rid(n2), time.time())
        for i in range(5):
            assert rid(await route(new, pending(Prompt(f"miss {i} " + "z" * 20)))) == rid(n2)

    run(body())


def test_the_smallest_replica_fallback_reads_one_snapshot_of_the_counts():
    # The live view can lose a tenant (another thread removing it) between a membership test
    # and a lookup: the fallback raised KeyError from inside routing. It now reads a copy.
    async def body():
        tree = kvtrie.PrefixTree()
        router = make_router(tree=tree)
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        tree.insert("X" * 10, rid(a), time.time())
        tree.insert("Y" * 3, rid(b), time.time())
        return tree, router, b

    tree, router, b = run(body())

    class Vanishing:
        """A view whose tenants all vanish after the membership test."""

        def __contains__(self, key):
            return True

        def __getitem__(self, key):
            raise KeyError(key)

        def copy(self):
            return tree.tenant_to_char_count.copy()

    class Racing:
        tenant_to_char_count = Vanishing()

        def get_smallest_tenants(self):
            return []

    router._tree = Racing()
    assert router._smallest_live_tenants() == [rid(b)]


def test_a_shared_router_evicts_as_configured(nats_url):
    async def body():
        router = make_router(
            nats_url=nats_url,
            do_eviction=True,
            eviction_threshold_chars=10,
            eviction_target_chars=5,
            eviction_interval_secs=0.05,
        )
        shared = router.shared_router
        assert shared.is_evicting
        assert (shared.config.eviction.threshold_chars, shared.config.eviction.target_chars) == (10, 5)
        r1 = FakeReplica("r1")
        router.update_replicas([r1])
        await route(router, pending(Prompt("a prompt well over ten chars")))
        end = time.monotonic() + 30
        while shared.char_counts()[rid(r1)] > 5:
            assert time.monotonic() < end, shared.char_counts()
            await asyncio.sleep(0.02)

    run(body())


def test_a_shared_router_with_a_target_above_its_threshold_evicts_as_ray(nats_url):
    """Ray evicts a tenant only above both its threshold and its target, down to the target
    (``start_eviction_loop`` raises the threshold to the target, on the path without NATS);
    the shared router's ``EvictionConfig`` lowered the target to the threshold instead."""

    async def body():
        router = make_router(
            nats_url=nats_url,
            do_eviction=True,
            eviction_threshold_chars=10,
            eviction_target_chars=40,
            eviction_interval_secs=3600.0,
        )
        e = router.shared_router.config.eviction
        assert (e.threshold_chars, e.target_chars) == (40, 40)

    run(body())


def test_nats_options_need_nats_url_and_exclude_a_tree():
    with pytest.raises(ValueError, match="nats_url"):
        make_router(nats_options={"router_id": 1})
    with pytest.raises(ValueError, match="nats_url"):
        make_router(tree=kvtrie.PrefixTree(), nats_url="nats://127.0.0.1:1")


def test_default_subject_prefix_is_the_names_made_a_nats_token():
    # ASCII letters, digits, "_" and "-" are kept, anything else is made "_", and a hash of
    # the exact (app, deployment) pair keeps pairs of the same readable part apart.
    prefix = kvtrie.ray._subject_prefix
    p = prefix("my-app_1", "Llama 3.1/ä")
    readable, _, digest = p.rpartition("-")
    assert readable == "kvtrie-my-app_1-Llama_3_1__"
    assert digest and all(c in "0123456789abcdef" for c in digest)
    assert prefix("my-app_1", "Llama 3.1/ä") == p
    assert prefix(None, None).rpartition("-")[0] == "kvtrie--"
    a, b = prefix("a-b", "c"), prefix("a", "b-c")
    assert a.rpartition("-")[0] == b.rpartition("-")[0] == "kvtrie-a-b-c"
    assert a != b
    # Long names are cut to fit the server's name limits; the hash still tells them apart.
    long_a, long_b = prefix("a" * 300, "x"), prefix("a" * 300, "y")
    assert len(long_a) <= 241 and len(long_b) <= 241 and long_a != long_b
    kvtrie.PrefixAffinityRouter.shared("nats://127.0.0.1:1", subject_prefix=long_a)


def test_routers_of_a_deployment_share_one_tree_per_process():
    a, b = make_router(), make_router()
    assert a.tree is b.tree is kvtrie.ray.shared_tree("app", "LLM")
    assert make_router(tree=kvtrie.PrefixTree()).tree is not a.tree


def test_each_deployment_has_a_shared_tree_of_its_own():
    shared_tree = kvtrie.ray.shared_tree
    llm = shared_tree("app", "LLM")
    assert shared_tree("app", "LLM") is llm
    others = [shared_tree("app", "Embedder"), shared_tree("other", "LLM"), shared_tree()]
    assert len({id(t) for t in [llm, *others]}) == 4
    assert shared_tree(None, None) is others[2]


def test_tree_actor_is_not_used_but_keeps_routers_apart(caplog):
    with caplog.at_level(logging.WARNING):
        router = make_router(tree_actor="an actor handle")
    assert router._tree_actor.tree is router.tree
    assert "does not use tree_actor" in caplog.text
    # A router given an actor does not share the deployment's tree; routers given the same
    # actor share one, as they share Ray's actor.
    first, second = object(), object()
    a, b, c = make_router(tree_actor=first), make_router(tree_actor=first), make_router(tree_actor=second)
    assert a.tree is b.tree
    assert c.tree is not a.tree
    assert a.tree is not make_router().tree
    with pytest.raises(TypeError):
        make_router(tree="not a tree")


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_the_tree_of_a_tree_actor_goes_with_its_last_router():
    # Ray's router tests give every router a fresh actor: the stand-in trees (and the
    # eviction threads started on them) must not outlive the routers.
    import gc
    import weakref

    from kvtrie import _shared

    def evict_threads():
        names = []
        for task in pathlib.Path("/proc/self/task").iterdir():
            try:
                names.append((task / "comm").read_text().strip())
            except OSError:
                pass  # ended meanwhile
        return names.count("kvtrie-evict")

    before = evict_threads()
    actor = object()

    async def body():
        a = make_router(tree_actor=actor, do_eviction=True, eviction_interval_secs=0.05)
        b = make_router(tree_actor=actor)
        assert a.tree is b.tree
        a.update_replicas([FakeReplica("r1")])
        assert a.tree.eviction_running
        return a, b

    # (Ray's update_replicas leaves work referring to the router on its event loop: the
    # routers are collectable once the loop is done.)
    a, b = run(body())
    entry = weakref.ref(_shared._actor_trees[("object", id(actor))])
    del a
    gc.collect()
    assert entry() is not None  # b still routes with it
    del b
    gc.collect()
    assert entry() is None
    assert ("object", id(actor)) not in _shared._actor_trees
    # The tree went too, and its eviction thread ended.
    end = time.monotonic() + 30
    while evict_threads() > before:
        assert time.monotonic() < end
        time.sleep(0.02)


def test_the_tree_actor_stand_in_shares_its_tree_and_stays_in_process(monkeypatch):
    import copy
    import pickle

    import ray
    import ray._private.auto_init_hook as auto_init

    a = make_router(tree=kvtrie.PrefixTree())
    # Another router given this router's actor handle shares its tree, as with Ray's actor.
    assert make_router(tree_actor=a._tree_actor).tree is a.tree
    for clone in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be pickled"):
            clone(a._tree_actor)
    if ray.is_initialized():
        pytest.skip("Ray is running in this process")
    # Without Ray and with auto-connect off, a call fails before it touches the tree.
    monkeypatch.setattr(auto_init, "enable_auto_connect", False)
    a.tree.add_tenants(["r"], 0.0)
    with pytest.raises(RuntimeError, match="Ray is not running"):
        a._tree_actor.insert.remote("hello", "r", 1.0)
    with pytest.raises(RuntimeError, match="Ray is not running"):
        a._tree_actor.remove_tenants.remote(["r"])
    assert a.tree.tenant_to_char_count == {"r": 0}


def test_eviction_loop_is_started_on_replica_update():
    async def body():
        router = make_router(
            do_eviction=True,
            eviction_threshold_chars=10,
            eviction_target_chars=5,
            eviction_interval_secs=0.05,
            tree=kvtrie.PrefixTree(),
        )
        assert not router._eviction_loop_running
        r1 = FakeReplica("r1")
        router.update_replicas([r1])
        assert router._eviction_loop_running and router.tree.eviction_running
        router.tree.insert("verylongtext", rid(r1), time.time())
        router.tree.insert("anotherlongtext", rid(r1), time.time() + 1)
        # (The running loop may evict as soon as the inserts land: no count is read before.)
        end = time.monotonic() + 30
        while router.tree.tenant_to_char_count[rid(r1)] > 5:
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
        router.tree.stop_eviction_loop()

    run(body())


def test_prompt_normalization_is_rays():
    async def body():
        router = make_router(tree=kvtrie.PrefixTree())
        norm = router._extract_text_from_request
        assert norm(pending(Prompt("Hello world"))) == "Hello world"
        assert norm(pending(Chat(["Hello", " ", "world"]))) == "Hello world"
        parts = [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {"url": "x"}}]
        assert norm(pending(Chat([{"content": parts}]))) == "Hello"
        with pytest.raises(ValueError):
            norm(pending())

    run(body())
