"""Process-wide prefix trees of deployments, shared by the routers of :mod:`kvtrie.ray`.

A module of its own: Ray pickles a configured router class *by value* together with the
globals of its module, so the registry (and its lock) must live outside :mod:`kvtrie.ray`.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

from kvtrie._kvtrie import PrefixAffinityConfig, PrefixAffinityRouter, PrefixTree

_trees: Dict[Tuple[Optional[str], Optional[str]], PrefixTree] = {}
_lock = threading.Lock()


def shared_tree(
    app_name: Optional[str] = None, deployment_name: Optional[str] = None
) -> PrefixTree:
    """The process-wide :class:`kvtrie.PrefixTree` of a deployment (created on first use).

    Routers of the same deployment in one process share it, as Ray's routers share the
    deployment's named tree actor.
    """
    key = (app_name, deployment_name)
    with _lock:
        tree = _trees.get(key)
        if tree is None:
            tree = _trees[key] = PrefixTree()
        return tree


# The shared routers in use, by deployment, server, options and policy: kept only while a
# router of the deployment holds one (a deleted deployment's router, its connection and its
# thread go with its last router).
_routers: "weakref.WeakValueDictionary[Tuple[Any, ...], PrefixAffinityRouter]" = (
    weakref.WeakValueDictionary()
)
# One lock per key being created: a start blocks (up to the warm start's timeout) without
# holding up the other deployments.
_starting: Dict[Tuple[Any, ...], threading.Lock] = {}


def shared_router(
    app_name: Optional[str],
    deployment_name: Optional[str],
    nats_url: str,
    options: Dict[str, Any],
    config: PrefixAffinityConfig,
) -> PrefixAffinityRouter:
    """The process-wide :meth:`PrefixAffinityRouter.shared` router of a deployment on a NATS
    server with these options and this policy (created on first use; later routers of the
    deployment share it, as they share its tree without NATS).
    """
    key = (app_name, deployment_name, nats_url, tuple(sorted(options.items())), repr(config))
    with _lock:
        router = _routers.get(key)
        if router is not None:
            return router
        starting = _starting.setdefault(key, threading.Lock())
    with starting:
        router = _routers.get(key)
        if router is None:
            router = PrefixAffinityRouter.shared(nats_url, config, **options)
            with _lock:
                _routers[key] = router
                _starting.pop(key, None)
        return router


def _after_fork_in_child() -> None:
    # A lock held by another thread at the fork stays held in the child: start afresh. The
    # parent's shared routers have no NATS thread in the child (they route locally there):
    # routers the child makes get shared routers of their own.
    global _lock, _starting, _routers
    _lock = threading.Lock()
    _starting = {}
    _routers = weakref.WeakValueDictionary()


os.register_at_fork(after_in_child=_after_fork_in_child)


# The tree standing in for each ``tree_actor`` a router was given: by a Ray actor's id
# (holding the handle would keep the actor alive), else by the object's id with the object
# kept (so its id is not reused while the entry lives). Held weakly: the routers given the
# actor hold the entry, and the tree (with its eviction thread) goes with the last of them.
class ActorTree:
    """The in-process tree standing in for one ``tree_actor`` (see :func:`tree_for_actor`);
    a router keeps it for as long as it uses ``tree``."""

    __slots__ = ("actor", "tree", "__weakref__")

    def __init__(self, actor: Any, tree: PrefixTree) -> None:
        self.actor = actor
        self.tree = tree


_actor_trees: "weakref.WeakValueDictionary[Any, ActorTree]" = weakref.WeakValueDictionary()


def tree_for_actor(actor: Any) -> ActorTree:
    """The in-process tree standing in for ``tree_actor``: routers given the same actor
    share it, as they share Ray's actor; a router given another actor (as tests give a fresh
    one) does not see the deployment's shared tree. The caller keeps the returned entry for
    as long as it uses the tree: the entry is dropped with the last router holding it.
    """
    actor_id = getattr(actor, "_actor_id", None)
    key, keep = (("ray", actor_id), None) if actor_id is not None else (("object", id(actor)), actor)
    with _lock:
        entry = _actor_trees.get(key)
        if entry is None or (keep is not None and entry.actor is not keep):
            entry = _actor_trees[key] = ActorTree(keep, PrefixTree())
        return entry
