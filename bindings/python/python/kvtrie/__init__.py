"""kvtrie: lock-free concurrent data structures for cache-aware LLM request routing.

* :class:`PrefixTree` -- a drop-in for Ray Serve LLM's ``PrefixTree`` (same methods,
  arguments, defaults and return values), backed by kvtrie's lock-free radix tree.
* :class:`PrefixAffinityRouter` / :class:`PrefixAffinityConfig` -- Ray's (or SGLang's)
  prefix-cache affinity policy; :class:`KvAwareRouter` / :class:`KvAwareConfig` -- Dynamo's
  KV-overlap cost policy over a :class:`BlockIndex`.
* :class:`BlockHasher`, :class:`BlockIndex`, :class:`KvEvent`, :class:`StoredBlock` --
  Dynamo-compatible block hashing and a lock-free block index fed by engine KV events.
* :mod:`kvtrie.vllm` -- decoding of vLLM's KV-event batches; :mod:`kvtrie.zmq` -- a live
  subscriber to vLLM engines (background threads feeding a :class:`BlockIndex`);
  :mod:`kvtrie.ray` -- ``PrefixCacheAffinityRouter`` for Ray Serve LLM with an in-process
  kvtrie tree.

Every call that walks or changes a structure releases the GIL, and every object can be
shared between threads.

>>> import kvtrie
>>> tree = kvtrie.PrefixTree()
>>> tree.add_tenants(["replica-a", "replica-b"], 0.0)
>>> tree.insert("You are a helpful assistant. Hi!", "replica-a", 1.0)
>>> tree.prefix_match("You are a helpful assistant. Bye!")
('You are a helpful assistant. ', ['replica-a'])
"""

import collections.abc as _abc

from kvtrie import vllm, zmq  # noqa: F401
from kvtrie._kvtrie import (  # noqa: F401
    HAS_NATS,
    HAS_ZMQ,
    MAX_TENANTS,
    MAX_TEXT_BYTES,
    BlockHasher,
    BlockIndex,
    EvictionConfig,
    KvAwareConfig,
    KvAwareRouter,
    KvEvent,
    KvEventDecodeError,
    PrefixAffinityConfig,
    PrefixAffinityRouter,
    PrefixTree,
    Route,
    RouteError,
    Selection,
    StoredBlock,
    TenantCharCounts,
    UnknownParentError,
)
from kvtrie._kvtrie import __version__ as __version__

from kvtrie import _pickle  # noqa: F401,E402  (registers the configurations' picklers)

_abc.Mapping.register(TenantCharCounts)

__all__ = [
    "BlockHasher",
    "BlockIndex",
    "EvictionConfig",
    "HAS_NATS",
    "HAS_ZMQ",
    "KvAwareConfig",
    "KvAwareRouter",
    "KvEvent",
    "KvEventDecodeError",
    "MAX_TENANTS",
    "MAX_TEXT_BYTES",
    "PrefixAffinityConfig",
    "PrefixAffinityRouter",
    "PrefixTree",
    "Route",
    "RouteError",
    "Selection",
    "StoredBlock",
    "TenantCharCounts",
    "UnknownParentError",
    "vllm",
    "zmq",
]
