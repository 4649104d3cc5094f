"""Ray Serve LLM integration: :class:`PrefixCacheAffinityRouter` with an in-process kvtrie tree.

Ray Serve LLM's ``PrefixCacheAffinityRouter`` keeps its prefix tree in a detached Ray actor
(``PrefixTreeActor``): every routed request costs two or three actor round trips
(``prefix_match``, ``get_smallest_tenants``, ``insert``), served one at a time by a tree
under one lock. This subclass keeps Ray's policy and configuration unchanged and replaces the
actor with a :class:`kvtrie.PrefixTree` in the router's own process: no round trips, lookups
without locks, and the GIL released while the tree is walked.

Use it wherever Ray's router is configured today (add ``"nats_url":
"nats://HOST:4222"`` to ``request_router_kwargs`` to share the routers' state across
processes through a NATS server run with JetStream, ``nats-server -js``)::

    from ray.serve.llm import LLMConfig
    from ray.serve.config import RequestRouterConfig

    llm_config = LLMConfig(
        ...,
        deployment_config=dict(
            request_router_config=RequestRouterConfig(
                request_router_class="kvtrie.ray:PrefixCacheAffinityRouter",
                request_router_kwargs={"imbalanced_threshold": 20},
            ),
        ),
    )

Differences from Ray's router (all deliberate):

* The tree lives in the router's process. Routers of the same deployment in one process
  share one tree (as they share Ray's named actor); routers in different processes (e.g.
  several proxies, or the replicas of an ingress deployment) each learn from the requests
  they route, instead of sharing one actor, unless given ``nats_url``: then they share
  their decisions over NATS JetStream and route as one router that saw every request (see
  below).
  Code that constructs the router itself (tests) may pass ``tree=`` (a
  :class:`kvtrie.PrefixTree`) to ``initialize_state``; ``request_router_kwargs`` must stay
  JSON, so deployments use the shared tree.
* ``tree_actor`` is accepted for signature compatibility but not used (with a warning):
  there is no actor. Routers given the same ``tree_actor`` object share an in-process tree
  of their own instead of the deployment's, so a test that gives each router a fresh actor
  still gets a fresh tree. ``router.tree`` is the :class:`kvtrie.PrefixTree`.
* ``router._tree_actor`` is a :class:`TreeActorStandIn`: the calls Ray's own tests make on
  the actor (``ray.get(router._tree_actor.insert.remote(text, replica, t))``,
  ``.prefix_match.remote(text)``, ``.getattr.remote("tenant_to_char_count")``,
  ``.stop_eviction_loop.remote()``, ...) run at once on the router's tree and return an
  ``ObjectRef`` of the result (``ray.put``, which starts Ray if it is not running, as Ray's
  own calls do). As with an actor, ``ray.get`` raises a call's error (a ``RayTaskError``
  that is also an instance of the error's type), and ``.remote()`` raises ``TypeError`` for
  arguments that do not fit the method. With
  ``nats_url`` it is ``None``: a write through it would bypass the sharing.
* An empty prompt has match rate 0 (Ray divides by zero and fails the routing attempt).
* A request whose arguments carry no ``prompt`` or ``messages`` (an HTTP request reaching
  the deployment through Serve's proxy, another method called through the handle, an
  embedding request), or only ones that are ``None``, is routed by power of two choices
  and recorded nowhere. Ray's router
  raises ``ValueError`` in its routing loop for it, and the request waits for a replica
  forever.
* Tenants the tree returns that are no longer replicas of this router are skipped (Ray
  raises ``KeyError``). The process's tree outlives ``serve.shutdown()`` (Ray's actor
  goes with it): on a cache miss, when only replicas gone since hold the fewest chars, the
  smallest of this router's replicas are taken instead.
* The tree follows kvtrie's semantics where they differ from Ray's (see
  :class:`kvtrie.PrefixTree`): monotone timestamps, for example.
* A prompt with a lone surrogate (``"\\ud83d"``, valid JSON but not Unicode text) is
  routed with each lone surrogate read as U+FFFD: the same length in chars, as Ray counts
  it (kvtrie's tree holds Unicode text only, and an error here would leave the request
  waiting for a replica forever).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import time
import traceback
from typing import Any, Dict, List, Optional

try:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter as _RayPrefixCacheAffinityRouter,
    )
    from ray.serve._private.common import ReplicaID
except ImportError as e:  # pragma: no cover - exercised only without Ray
    raise ImportError(
        "kvtrie.ray needs Ray Serve: pip install 'ray[serve]>=2.60'"
    ) from e

import ray
from ray.exceptions import RayTaskError

import kvtrie
from kvtrie._shared import shared_router, shared_tree, tree_for_actor

__all__ = ["PrefixCacheAffinityRouter", "TreeActorStandIn", "shared_router", "shared_tree"]

logger = logging.getLogger("ray.serve")


def _subject_prefix(app: Optional[str], deployment: Optional[str]) -> str:
    """A NATS subject token for a deployment: its application and deployment names
    (characters other than ASCII letters, digits, ``_`` and ``-`` made ``_``) and a hash of
    the exact pair, so that two deployments never share one."""
    raw = f"{app or ''}-{deployment or ''}"
    readable = "".join(c if (c.isascii() and c.isalnum()) or c in "_-" else "_" for c in raw)
    # The streams and bucket named after the prefix must fit the server's limits (the hash
    # keeps long names apart).
    readable = readable[:200]
    exact = hashlib.sha256(repr((app, deployment)).encode()).hexdigest()[:12]
    return f"kvtrie-{readable}-{exact}"


def _unicode(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (same length in chars)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


def _connect_ray() -> None:
    """Starts Ray as its own API calls do when it is not running (``ray.put`` starts a local
    instance unless ``RAY_ENABLE_AUTO_CONNECT=0``); raises ``RuntimeError`` if it still is not."""
    if ray.is_initialized():
        return
    try:
        from ray._private.auto_init_hook import auto_init_ray
    except ImportError:  # pragma: no cover - another Ray layout
        auto_init_ray = None
    if auto_init_ray is not None:
        auto_init_ray()
    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not running (call ray.init() first): the stand-in for Ray's tree actor "
            "returns ObjectRefs"
        )


class _StandInMethod:
    """One method of a :class:`TreeActorStandIn`, called like an actor method."""

    __slots__ = ("_name", "_call")

    def __init__(self, name: str, call):
        self._name = name
        self._call = call

    def remote(self, *args, **kwargs) -> "ray.ObjectRef":
        """Runs the method on the tree now; returns an ``ObjectRef`` of its result, or of
        its error, which ``ray.get`` raises as a ``RayTaskError`` that is also an instance
        of the error's own type (as for an actor). Arguments that do not fit the method's
        signature raise ``TypeError`` here, as an actor handle's ``.remote()`` does."""
        # Ray first (started as `ray.put` would start it): a call that changed the tree must
        # not then fail to hand its result back.
        _connect_ray()
        self._check_signature(args, kwargs)
        try:
            result = self._call(*args, **kwargs)
        except Exception as error:
            failed = RayTaskError(
                f"PrefixTreeActor.{self._name}", traceback.format_exc(), error
            )
            try:
                return ray.put(failed)
            except Exception:
                # An error Ray cannot serialize is raised here rather than lost.
                raise error from None
        return ray.put(result)

    def _check_signature(self, args, kwargs) -> None:
        try:
            signature = inspect.signature(self._call)
        except (TypeError, ValueError):
            # No signature to check against (the call itself will say what is wrong).
            return
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self._name}.remote(): {error}") from None

    def __call__(self, *args, **kwargs):
        # As Ray answers a direct call of an actor method.
        raise TypeError(
            f"Actor methods cannot be called directly. Instead of running "
            f"'object.{self._name}()', try 'object.{self._name}.remote()'."
        )


class TreeActorStandIn:
    """What ``router._tree_actor`` is: the interface of Ray's ``PrefixTreeActor`` handle
    over the router's in-process :class:`kvtrie.PrefixTree`, so that code written against
    Ray's router (its unit tests, for one) runs unchanged::

        ray.get(router._tree_actor.insert.remote("Hello", replica_id, time.time()))
        counts = ray.get(router._tree_actor.getattr.remote("tenant_to_char_count"))

    Each ``.remote(...)`` call runs on the tree at once and returns ``ray.put(result)``
    (starting a local Ray instance first if Ray is not running, as ``ray.put`` does, unless
    ``RAY_ENABLE_AUTO_CONNECT=0``: then ``RuntimeError`` and the tree is left as it was). As
    with an actor, an unknown method is an ``AttributeError`` at once, arguments that do not
    fit its signature a ``TypeError`` from ``.remote()``, and an error of the call itself
    (an unknown attribute for ``getattr``, a bad value) is raised by ``ray.get``, as a
    ``RayTaskError`` that is also an instance of the error's type. The stand-in cannot be pickled (it holds an in-process tree): pass the
    router's tree, or the stand-in itself as another router's ``tree_actor`` in this process
    (the routers then share the tree, as routers given one actor handle do).
    ``getattr`` / ``setattr`` act on the tree's attributes, as the actor's do on its tree
    (kvtrie's tree has no settable attributes). Only the tree's public methods are there:
    Ray's private helpers (``_get_lru_chain``, ...) have no kvtrie counterpart.
    """

    __slots__ = ("_tree",)

    def __init__(self, tree: kvtrie.PrefixTree):
        self._tree = tree

    @property
    def tree(self) -> kvtrie.PrefixTree:
        """The tree the calls run on."""
        return self._tree

    def __getattr__(self, name: str) -> _StandInMethod:
        if name.startswith("_"):
            # Private names (and `_tree` itself before `__init__`, as `copy` probes) are not
            # actor methods.
            raise AttributeError(name)
        tree = self._tree
        if name == "getattr":
            return _StandInMethod(name, lambda attribute: getattr(tree, attribute))
        if name == "setattr":
            return _StandInMethod(
                name, lambda attribute, value: setattr(tree, attribute, value)
            )
        method = getattr(tree, name, None)
        if not callable(method):
            raise AttributeError(
                f"{type(tree).__name__} has no actor method {name!r} (the stand-in for "
                f"Ray's PrefixTreeActor offers the tree's public methods, getattr and "
                f"setattr)"
            )
        return _StandInMethod(name, method)

    def __reduce__(self):
        raise TypeError(
            "TreeActorStandIn stands in for Ray's tree actor over an in-process tree and "
            "cannot be pickled or sent to another process"
        )

    def __repr__(self) -> str:
        return f"TreeActorStandIn({self._tree!r})"


class PrefixCacheAffinityRouter(_RayPrefixCacheAffinityRouter):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` backed by an in-process
    :class:`kvtrie.PrefixTree` instead of a tree actor.

    The policy is Ray's: when the candidates' queue lengths are balanced (spread at most
    ``imbalanced_threshold``), the replicas holding the longest cached prefix of the prompt
    are preferred if it covers at least ``match_rate_threshold`` of it, otherwise the
    replicas with the smallest caches; when imbalanced, power of two choices. The prompt is
    recorded for the chosen replica once the request is routed.

    Parameters (``request_router_kwargs``) are Ray's: ``imbalanced_threshold``,
    ``match_rate_threshold``, ``do_eviction``, ``eviction_threshold_chars``,
    ``eviction_target_chars``, ``eviction_interval_secs``, ``tree_actor`` (see above), plus
    ``tree``: the :class:`kvtrie.PrefixTree` to use (default: the deployment's shared tree,
    see :func:`shared_tree`), and ``nats_url`` / ``nats_options``.

    With ``nats_url``, the routers of the deployment share their decisions over NATS
    JetStream: each process keeps one :meth:`kvtrie.PrefixAffinityRouter.shared` router per
    deployment (:func:`shared_router`), which publishes every decision and applies the
    other processes' ones, so a prompt routed by one ingress replica is known to all. The
    policy is then run by that router (the same policy, in Rust, on the queue lengths Ray
    probed; a replica whose probe failed counts with the lowest known length) and the
    prompt is recorded, and shared, once the request is routed. Where the two paths differ:
    on a cache miss the shared router takes the smallest tenants among the candidates
    (Ray's takes them from the whole tree, which can name a replica the request was not
    offered to, e.g. one without its multiplexed model); an empty prompt goes to the least
    loaded candidate; and one replica is chosen (ties rotate), where Ray returns the whole
    group of matched or smallest replicas for its own pick.
    ``nats_options`` (JSON) are passed
    to :meth:`~kvtrie.PrefixAffinityRouter.shared`: ``subject_prefix`` (default: made of
    the application and deployment names), ``router_id``, ``warm_start``, ``warm_timeout``,
    ``snapshot_interval``, ``retention``. ``router.tree`` is then ``None`` and
    ``router.shared_router`` the :class:`kvtrie.PrefixAffinityRouter`. An unreachable server
    is not an error: routing goes on with what the process knows, and catches up when the
    server is back.
    """

    def initialize_state(
        self,
        imbalanced_threshold: Optional[float] = float("inf"),
        match_rate_threshold: Optional[float] = 0.1,
        do_eviction: Optional[bool] = False,
        eviction_threshold_chars: Optional[int] = 400_000,
        eviction_target_chars: Optional[int] = 360_000,
        eviction_interval_secs: Optional[float] = 10,
        tree_actor: Any = None,
        tree: Optional[kvtrie.PrefixTree] = None,
        nats_url: Optional[str] = None,
        nats_options: Optional[Dict[str, Any]] = None,
    ):
        self._imbalanced_threshold = imbalanced_threshold
        self._match_rate_threshold = match_rate_threshold
        self._do_eviction = do_eviction
        self._eviction_loop_running = False
        self._eviction_threshold_chars = eviction_threshold_chars
        self._eviction_target_chars = (
            eviction_target_chars
            if eviction_target_chars is not None
            else eviction_threshold_chars
        )
        self._eviction_interval_secs = eviction_interval_secs
        self._shared_router: Optional[kvtrie.PrefixAffinityRouter] = None
        if nats_url is not None:
            if tree is not None or tree_actor is not None:
                raise ValueError("nats_url cannot be combined with tree or tree_actor")
            self._tree = None
            self._tree_actor = None
            dep = getattr(self, "_deployment_id", None)
            app, name = (dep.app_name, dep.name) if dep else (None, None)
            options = dict(nats_options or {})
            options.setdefault("subject_prefix", _subject_prefix(app, name))
            self._shared_router = shared_router(
                app, name, nats_url, options, self._policy_config()
            )
            return
        if nats_options is not None:
            raise ValueError("nats_options needs nats_url")
        if tree_actor is not None:
            logger.warning(
                "kvtrie.ray.PrefixCacheAffinityRouter does not use tree_actor: its prefix "
                "tree is in-process (routers given the same tree_actor share one tree; "
                "pass tree= to choose it)"
            )
            if tree is None:
                # Another router's stand-in: share that router's tree, as routers given one
                # actor handle share its tree.
                if isinstance(tree_actor, TreeActorStandIn):
                    tree = tree_actor.tree
                else:
                    # Kept with the router: the actor's tree (and its eviction thread) goes
                    # with the last router given the actor.
                    self._actor_tree = tree_for_actor(tree_actor)
                    tree = self._actor_tree.tree
        if tree is None:
            dep = getattr(self, "_deployment_id", None)
            tree = shared_tree(
                dep.app_name if dep else None, dep.name if dep else None
            )
        if not isinstance(tree, kvtrie.PrefixTree):
            raise TypeError(f"tree must be a kvtrie.PrefixTree, not {type(tree).__name__}")
        self._tree = tree
        # No actor: calls made on Ray's actor run on the tree (see `TreeActorStandIn`).
        self._tree_actor = TreeActorStandIn(tree)

    @property
    def tree(self) -> Optional[kvtrie.PrefixTree]:
        """The :class:`kvtrie.PrefixTree` this router routes with (``None`` with
        ``nats_url``: see :attr:`shared_router`)."""
        return self._tree

    @property
    def shared_router(self) -> Optional[kvtrie.PrefixAffinityRouter]:
        """With ``nats_url``, the process's shared router of this deployment (``None``
        otherwise)."""
        return self._shared_router

    def _policy_config(self) -> kvtrie.PrefixAffinityConfig:
        """This router's parameters as a :class:`kvtrie.PrefixAffinityConfig` (Ray's policy)."""
        config = kvtrie.PrefixAffinityConfig.ray(
            imbalanced_threshold=float(
                self._imbalanced_threshold
                if self._imbalanced_threshold is not None
                else float("inf")
            ),
            match_rate_threshold=float(
                self._match_rate_threshold
                if self._match_rate_threshold is not None
                else 0.1
            ),
        )
        if self._do_eviction:
            config = config.replace(
                # As `PrefixTree.start_eviction_loop` (the path without NATS) and Ray: a
                # target above the threshold raises the threshold to it (an `EvictionConfig`
                # would lower the target instead).
                eviction=kvtrie.EvictionConfig(
                    max(self._eviction_threshold_chars, self._eviction_target_chars),
                    self._eviction_target_chars,
                    float(self._eviction_interval_secs),
                )
            )
        return config

    async def _queue_lens(self, candidate_replicas):
        """``{full replica id: queue length}`` of every candidate: from Ray's cache, else
        probed as Ray's router probes. Ray keeps a replica whose length is unknown (a probe
        that failed or timed out) among the prefix-match candidates and leaves it out of the
        load check; here it gets the lowest known length (0 if none is known), which leaves
        the spread of the known ones, hence the load check, as Ray has it."""
        lens = {}
        unknown = []
        for r in candidate_replicas:
            q = (
                self._replica_queue_len_cache.get(r.replica_id)
                if self._use_replica_queue_len_cache
                else None
            )
            if q is None or q >= r.max_ongoing_requests:
                unknown.append(r)
            else:
                lens[r.replica_id.to_full_id_str()] = q
        if unknown:
            for r, q in await self._probe_queue_lens(unknown, 0):
                if q is not None:
                    lens[r.replica_id.to_full_id_str()] = q
        fill = min(lens.values(), default=0)
        for r in candidate_replicas:
            lens.setdefault(r.replica_id.to_full_id_str(), fill)
        return lens

    def _request_text(self, pending_request) -> Optional[str]:
        """The prompt text of a request as Ray extracts and normalizes it (Unicode text,
        see :func:`_unicode`), or ``None`` when no argument has a ``prompt`` or
        ``messages`` attribute that is not ``None``: such a request is routed without the
        tree (Ray's ``_extract_text_from_request`` raises ``ValueError`` for it)."""
        if not any(
            hasattr(arg, "prompt") or hasattr(arg, "messages")
            for arg in pending_request.args
        ):
            return None
        try:
            text = self._extract_text_from_request(pending_request)
        except ValueError:
            # Such attributes, all None (Ray raises for these too).
            return None
        return _unicode(text)

    async def _prefix_match_best_replicas(self, pending_request, candidate_replicas):
        chosen: List[str] = []
        if (
            pending_request is not None
            and pending_request.args is not None
            and len(pending_request.args) > 0
        ):
            input_text = self._request_text(pending_request)
            if input_text is not None and self._shared_router is not None:
                # The shared router runs the policy; the prompt is recorded, and shared,
                # once Ray reports the request routed (`on_request_routed`).
                lens = await self._queue_lens(candidate_replicas)
                try:
                    if lens:
                        chosen = [self._shared_router.choose(input_text, lens).replica]
                except kvtrie.RouteError:
                    # Every candidate left meanwhile (another router of this process saw
                    # it go): Ray's power of two over what is left.
                    chosen = []
            elif input_text is not None:
                highest, lowest = 0, float("inf")
                unknown = []
                if self._use_replica_queue_len_cache:
                    for r in candidate_replicas:
                        q = self._replica_queue_len_cache.get(r.replica_id)
                        if q is None or q >= r.max_ongoing_requests:
                            unknown.append(r)
                        else:
                            highest, lowest = max(highest, q), min(lowest, q)
                else:
                    unknown = candidate_replicas
                if unknown:
                    for _, q in await self._probe_queue_lens(unknown, 0):
                        if q is not None:
                            highest, lowest = max(highest, q), min(lowest, q)
                if not highest - lowest > self._imbalanced_threshold:
                    ids = [r.replica_id.to_full_id_str() for r in candidate_replicas]
                    matched_text, matched = self._tree.prefix_match(input_text, ids)
                    rate = len(matched_text) / len(input_text) if input_text else 0.0
                    if rate < self._match_rate_threshold:
                        smallest = self._smallest_live_tenants()
                        if smallest:
                            chosen = smallest
                    elif matched:
                        chosen = matched
        replicas = []
        for s in chosen:
            r = self._replicas.get(ReplicaID.from_full_id_str(s))
            if r is not None:
                replicas.append(r)
        return [replicas]

    def _smallest_live_tenants(self) -> List[str]:
        """Ray's ``get_smallest_tenants``, over this router's replicas. The tree is shared by
        the routers of a process and outlives ``serve.shutdown()``: tenants of replicas gone
        since (a redeployment in the same driver) may hold the fewest chars, and are skipped
        for the smallest live replicas (Ray's actor starts empty with each deployment)."""
        live = {r.to_full_id_str() for r in self._replicas}
        smallest = [s for s in self._tree.get_smallest_tenants() or [] if s in live]
        if smallest:
            return smallest
        # One snapshot: the live view can lose a tenant between a membership test and a
        # lookup while another thread removes it.
        counts = self._tree.tenant_to_char_count.copy()
        held = [s for s in live if s in counts]
        if not held:
            return []
        least = min(counts[s] for s in held)
        return sorted(s for s in held if counts[s] == least)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        """Drops the replica from routing and its text from the tree."""
        super(_RayPrefixCacheAffinityRouter, self).on_replica_actor_died(replica_id)
        if self._shared_router is not None:
            self._shared_router.remove_replica(replica_id.to_full_id_str())
        else:
            self._tree.remove_tenants([replica_id.to_full_id_str()])

    def update_replicas(self, replicas):
        """Updates the replica set and the tree's tenants; starts eviction if configured."""
        old = set(self._replica_id_set)
        super(_RayPrefixCacheAffinityRouter, self).update_replicas(replicas)
        new = set(self._replica_id_set)
        added, removed = new - old, old - new
        if self._shared_router is not None:
            # (Its eviction thread, if configured, runs from its start.)
            for r in added:
                self._shared_router.add_replica(r.to_full_id_str())
            for r in removed:
                self._shared_router.remove_replica(r.to_full_id_str())
            return
        if added:
            self._tree.add_tenants([r.to_full_id_str() for r in added], time.time())
        if removed:
            self._tree.remove_tenants([r.to_full_id_str() for r in removed])
        if self._do_eviction and not self._eviction_loop_running:
            self._tree.start_eviction_loop(
                self._eviction_threshold_chars,
                self._eviction_target_chars,
                self._eviction_interval_secs,
            )
            self._eviction_loop_running = True

    def on_request_routed(self, pending_request, replica_id: ReplicaID, result):
        """Records the request's prompt for the replica it was routed to."""
        if (
            pending_request is not None
            and pending_request.args is not None
            and len(pending_request.args) > 0
        ):
            input_text = self._request_text(pending_request)
            if input_text is None:
                return
            if self._shared_router is not None:
                # In this process's tree, and for every other process.
                self._shared_router.record(input_text, replica_id.to_full_id_str())
            else:
                self._tree.insert(input_text, replica_id.to_full_id_str(), time.time())
