"""kvtrie.ray.PrefixCacheAffinityRouter in a real Ray Serve application: a local Ray
instance, Serve's controller and HTTP proxy, replica actors, and the router configured by
import path in ``RequestRouterConfig`` as the module docs tell users to. The other Ray tests
drive Ray's routing loop with fake replicas; these check what only a running application
shows (the class pickled to the controller and the proxy, replicas coming and going through
Serve's long poll, requests that a router error would leave waiting for ever).

The calls Ray's own tests make on the router's tree actor (``ray.get(...remote())``) need
a running Ray instance too, so they are checked here.

Every request is sent with a timeout, so a routing loop that fails shows as a test failure,
not a hang.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import types
import urllib.request

import pytest

from conftest import free_port, require

ray = require("ray", "pip install 'ray[serve]==2.60.0'")
from ray import serve  # noqa: E402
from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

import kvtrie.ray  # noqa: E402

APP = "kvtrie_e2e"
DEPLOYMENT = "Echo"
# Seconds a request may take before the test fails (routing on a loaded 2-core CI machine
# takes milliseconds; a request that hangs never returns).
TIMEOUT = 60


@serve.deployment(name=DEPLOYMENT, ray_actor_options={"num_cpus": 0})
class Echo:
    """Answers every call with the id of the replica that served it."""

    def __call__(self, request=None):
        return serve.get_replica_context().replica_id.unique_id

    def double(self, x):
        return 2 * x


def deploy(replicas: int, app_name: str = APP, **kwargs):
    """(Re)deploys the application with ``replicas`` replicas and kvtrie's router (with
    ``kwargs`` added to its ``request_router_kwargs``)."""
    app = Echo.options(
        num_replicas=replicas,
        request_router_config=RequestRouterConfig(
            request_router_class="kvtrie.ray:PrefixCacheAffinityRouter",
            request_router_kwargs={"imbalanced_threshold": 20, **kwargs},
        ),
    ).bind()
    return serve.run(app, name=app_name, route_prefix="/" if app_name == APP else f"/{app_name}")


@pytest.fixture(scope="module")
def serve_app():
    port = free_port()
    # Serve's controller gives the HTTP proxy 5 s per readiness check and replaces it after
    # three misses; on a loaded 2-core machine the proxy's worker did not start within that
    # (serve.start then failed with "killed by ray.kill"). The processes ray.init starts
    # inherit this; serve.start itself waits at most 60 s for the proxy.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(TIMEOUT))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield deploy(3), port
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(handle, **fields) -> str:
    return handle.remote(types.SimpleNamespace(**fields)).result(timeout_s=TIMEOUT)


# Six long system prompts (they share 25 chars, a match rate under Ray's 10 %).
SYSTEMS = [f"You are assistant number {i}. " * 20 for i in range(6)]


def prompts(rounds: int):
    """Each system prompt asked ``rounds`` times, with a different question each time."""
    for r in range(rounds):
        for i, s in enumerate(SYSTEMS):
            yield i, s + f"Question {r}: what is {i} + {r}?"


def live_replicas() -> set:
    """The unique ids of the replicas in the deployment's tree (this process's handles)."""
    counts = kvtrie.ray.shared_tree(APP, DEPLOYMENT).tenant_to_char_count
    return {full.rsplit("#", 1)[-1] for full in counts}


def test_prompts_stick_to_the_replica_holding_their_prefix(serve_app):
    handle, _ = serve_app
    served = collections.defaultdict(set)
    for i, prompt in prompts(4):
        served[i].add(ask(handle, prompt=prompt))
    # Each system prompt went to one replica every time (the tree's longest match), and the
    # six prefixes were spread over the three replicas (a miss goes to the smallest tree).
    assert all(len(r) == 1 for r in served.values()), dict(served)
    assert len(set().union(*served.values())) == 3, dict(served)
    # Chat messages are routed by the same tree: the system prompt's replica again.
    chat = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "hi"}]
    assert {ask(handle, messages=chat)} == served[0]
    # The handle's router (in this process) recorded every prompt in the deployment's tree.
    tree = kvtrie.ray.shared_tree(APP, DEPLOYMENT)
    counts = tree.tenant_to_char_count
    assert len(counts) == 3 and all(c > 0 for c in counts.values()), counts


def test_requests_without_a_prompt_are_served(serve_app):
    # An HTTP request through Serve's proxy and a call to another method carry no prompt:
    # Ray's own PrefixCacheAffinityRouter raises in its routing loop for them, and they wait
    # for a replica forever.
    handle, port = serve_app
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=TIMEOUT).read()
    assert body.decode() in live_replicas(), body
    assert handle.double.remote(21).result(timeout_s=TIMEOUT) == 42
    assert handle.remote().result(timeout_s=TIMEOUT) in live_replicas()


def test_a_removed_replica_leaves_the_tree_and_its_prefixes_move(serve_app):
    handle, _ = serve_app
    before = {i: ask(handle, prompt=p) for i, p in prompts(1)}
    handle = deploy(2)
    # The handles' routers learn the new replica set through Serve's long poll.
    end = time.monotonic() + TIMEOUT
    while len(live_replicas()) != 2 and time.monotonic() < end:
        time.sleep(0.1)
    live = live_replicas()
    assert len(live) == 2, live
    served = collections.defaultdict(set)
    for i, prompt in prompts(3):
        served[i].add(ask(handle, prompt=prompt))
    # Only live replicas serve, and each prefix still sticks to one of them (those of the
    # removed replica moved once).
    assert set().union(*served.values()) <= live, (dict(served), live)
    assert all(len(r) == 1 for r in served.values()), dict(served)
    assert sum(before[i] not in live for i in before) >= 1, (before, live)


def test_decisions_of_a_serve_application_reach_other_processes_over_nats(serve_app, nats_url):
    # The handle's router, configured with nats_url through Serve, publishes its decisions:
    # another router on the same NATS subjects (as another process's would be) learns where
    # each prompt went without routing any of them. An application of its own: a process
    # keeps the request router it made for a deployment when the deployment's router
    # configuration changes.
    app = f"{APP}_nats"
    handle = deploy(2, app_name=app, nats_url=nats_url)
    served = {}
    for i, prompt in prompts(2):
        served.setdefault(i, set()).add(ask(handle, prompt=prompt))
    assert all(len(r) == 1 for r in served.values()), served
    deployment = DeploymentID(name=DEPLOYMENT, app_name=app)
    full = {
        u: ReplicaID(unique_id=u, deployment_id=deployment).to_full_id_str()
        for r in served.values()
        for u in r
    }
    peer = kvtrie.PrefixAffinityRouter.shared(
        nats_url, subject_prefix=kvtrie.ray._subject_prefix(app, DEPLOYMENT), router_id=99
    )
    peer.update_replicas(sorted(full.values()))
    assert peer.sync(TIMEOUT), str(peer.shared_stats())
    for i, system in enumerate(SYSTEMS):
        r = peer.route(system + "Another question?", {n: 0 for n in full.values()})
        assert (r.replica, r.reason) == (full[next(iter(served[i]))], "prefix_match"), (i, r)


def test_calls_made_on_rays_tree_actor_run_on_the_routers_tree(serve_app):
    # Ray's own router tests drive the tree through the router's actor handle
    # (`ray.get(router._tree_actor.insert.remote(...))`); the same calls work on kvtrie's
    # router, on its in-process tree, and the router routes by what they put there.
    from test_ray_router import FakeReplica, Prompt, make_router, pending, rid

    async def choose(router, prompt):
        req = pending(Prompt(prompt))
        return await asyncio.wait_for(router._choose_replica_for_request(req), TIMEOUT)

    async def body():
        router = make_router(tree=kvtrie.PrefixTree())
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        router.update_replicas([r1, r2])
        actor = router._tree_actor
        counts = ray.get(actor.getattr.remote("tenant_to_char_count"))
        assert counts == {rid(r1): 0, rid(r2): 0} and type(counts) is dict
        assert ray.get(actor.insert.remote("Hello", rid(r2), time.time())) is None
        assert ray.get(actor.prefix_match.remote("Hello world")) == ("Hello", [rid(r2)])
        assert router.tree.tenant_to_char_count[rid(r2)] == 5
        for _ in range(5):
            assert await choose(router, "Hello world") is r2
        ray.get(actor.insert.remote("longtext", rid(r2), time.time()))
        ray.get(actor.insert.remote("hi", rid(r1), time.time()))
        assert ray.get(actor.get_smallest_tenants.remote()) == [rid(r1)]
        # A miss goes to the smallest tree, as in Ray's test_low_match_rate_uses_smallest_tree.
        assert await choose(router, "z") is r1
        assert ray.get(actor.remove_tenants.remote([rid(r1)])) == {rid(r1): 2}
        assert router.tree.tenant_to_char_count == {rid(r2): 13}
        # What the actor handle refuses, refused here too, at once.
        with pytest.raises(TypeError, match="cannot be called directly"):
            actor.insert("x", rid(r2), 0.0)
        with pytest.raises(AttributeError, match="_get_lru_chain"):
            actor._get_lru_chain
        with pytest.raises(AttributeError, match="no actor method 'tenant_to_char_count'"):
            actor.tenant_to_char_count
        # As with an actor: arguments that do not fit the method fail at `.remote()`; an
        # error of the call itself comes out of `ray.get`, as a RayTaskError of its type.
        with pytest.raises(TypeError, match="insert.remote"):
            actor.insert.remote("x")
        refs = [
            actor.setattr.remote("tenant_to_char_count", {}),
            actor.getattr.remote("no_such_field"),
            actor.insert.remote(7, rid(r2), time.time()),
        ]
        for ref, error in zip(refs, (AttributeError, AttributeError, TypeError)):
            with pytest.raises(ray.exceptions.RayTaskError) as failed:
                ray.get(ref)
            assert isinstance(failed.value, error), failed.value
        assert router.tree.tenant_to_char_count == {rid(r2): 13}

        # The eviction loop the router started stops through the handle, as in Ray's
        # test_eviction_task_creation.
        evicting = make_router(
            tree=kvtrie.PrefixTree(),
            do_eviction=True,
            eviction_threshold_chars=10,
            eviction_target_chars=5,
            eviction_interval_secs=60,
        )
        evicting.update_replicas([FakeReplica("r1")])
        assert evicting._eviction_loop_running and evicting.tree.eviction_running
        assert ray.get(evicting._tree_actor.stop_eviction_loop.remote()) is None
        assert not evicting.tree.eviction_running

    asyncio.run(body())
