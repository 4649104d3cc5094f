"""Process-wide prefix trees of deployments, shared by the routers of :mod:`kvtrie.ray`.

A module of its own: Ray pickles a configured router class *by value* together with the
globals of its module, so the registry (and its lock) must live outside :mod:`kvtrie.ray`.
"""

from __future__ import annotations

import threading
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


_routers: Dict[Tuple[Any, ...], PrefixAffinityRouter] = {}


def shared_router(
    app_name: Optional[str],
    deployment_name: Optional[str],
    nats_url: str,
    options: Dict[str, Any],
    config: PrefixAffinityConfig,
) -> PrefixAffinityRouter:
    """The process-wide :meth:`PrefixAffinityRouter.shared` router of a deployment on a NATS
    server (created on first use with ``config`` and ``options``; later routers of the
    deployment share it, as they share its tree without NATS).
    """
    key = (app_name, deployment_name, nats_url, tuple(sorted(options.items())))
    with _lock:
        router = _routers.get(key)
        if router is None:
            router = _routers[key] = PrefixAffinityRouter.shared(nats_url, config, **options)
        return router


# The tree standing in for each ``tree_actor`` a router was given: by a Ray actor's id
# (holding the handle would keep the actor alive), else by the object's id with the object
# kept (so its id is not reused while the entry lives).
_actor_trees: Dict[Any, Tuple[Any, PrefixTree]] = {}


def tree_for_actor(actor: Any) -> PrefixTree:
    """The in-process tree standing in for ``tree_actor``: routers given the same actor
    share it, as they share Ray's actor; a router given another actor (as tests give a fresh
    one) does not see the deployment's shared tree.
    """
    actor_id = getattr(actor, "_actor_id", None)
    key, keep = (("ray", actor_id), None) if actor_id is not None else (("object", id(actor)), actor)
    with _lock:
        entry = _actor_trees.get(key)
        if entry is None or (keep is not None and entry[0] is not keep):
            entry = _actor_trees[key] = (keep, PrefixTree())
        return entry[1]
