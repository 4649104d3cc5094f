"""Pickling (and ``copy``) of kvtrie's values: configurations, block hashers, KV events, routing
decisions (``Route``, ``Selection``) and decoded vLLM batches.

Ray passes a deployment's arguments and a task's values between processes by pickle, so a
configuration built in the driver must survive the trip. Each value is rebuilt from its public
fields by its own constructor, which accepts every value it produced. (Trees, indexes and
routers hold live state of their process and refuse to be pickled.)
"""

from __future__ import annotations

import copyreg
from typing import Any

from kvtrie._kvtrie import (
    BlockHasher,
    DecodedBatch,
    DecodedEvent,
    EvictionConfig,
    KvAwareConfig,
    KvEvent,
    PrefixAffinityConfig,
    Route,
    Selection,
    StoredBlock,
)


def _eviction_config(
    threshold_chars: int,
    target_chars: int,
    interval: float,
    global_budget: tuple[int, int] | None,
    batch_groups: int,
) -> EvictionConfig:
    return EvictionConfig(
        threshold_chars,
        target_chars,
        interval,
        global_budget=global_budget,
        batch_groups=batch_groups,
    )


def _reduce_eviction_config(c: EvictionConfig) -> tuple[Any, tuple[Any, ...]]:
    return _eviction_config, (
        c.threshold_chars,
        c.target_chars,
        c.interval,
        c.global_budget,
        c.batch_groups,
    )


def _prefix_affinity_config(fields: dict[str, Any]) -> PrefixAffinityConfig:
    return PrefixAffinityConfig(**fields)


def _reduce_prefix_affinity_config(c: PrefixAffinityConfig) -> tuple[Any, tuple[Any, ...]]:
    names = (
        "imbalanced_threshold",
        "imbalanced_ratio",
        "imbalanced_choice",
        "match_rate_threshold",
        "miss_policy",
        "eviction",
        "seed",
    )
    return _prefix_affinity_config, ({n: getattr(c, n) for n in names},)


def _kv_aware_config(fields: dict[str, Any]) -> KvAwareConfig:
    return KvAwareConfig(**fields)


def _reduce_kv_aware_config(c: KvAwareConfig) -> tuple[Any, tuple[Any, ...]]:
    names = (
        "block_size",
        "overlap_weight",
        "temperature",
        "salt",
        "seed",
        "reservation_ttl",
    )
    return _kv_aware_config, ({n: getattr(c, n) for n in names},)


def _block_hasher(block_size: int, seed: int) -> BlockHasher:
    # A salted hasher's seed already includes its salt.
    return BlockHasher(block_size, seed)


def _stored_block(engine_hash: int, local_hash: int) -> StoredBlock:
    return StoredBlock(engine_hash, local_hash)


def _stored(parent: int | None, blocks: list[StoredBlock]) -> KvEvent:
    return KvEvent.Stored(parent, blocks)


def _removed(engine_hashes: list[int]) -> KvEvent:
    return KvEvent.Removed(engine_hashes)


def _cleared() -> KvEvent:
    return KvEvent.Cleared()


def _route(replica: str, reason: str, matched_chars: int) -> Route:
    return Route(replica, reason, matched_chars)


def _reduce_route(r: Route) -> tuple[Any, tuple[Any, ...]]:
    return _route, (r.replica, r.reason, r.matched_chars)


def _selection(
    worker: int,
    overlap_blocks: int,
    weighted_overlap: float,
    cost: float,
    prefill_blocks: int,
    decode_blocks: int,
) -> Selection:
    return Selection(
        worker, overlap_blocks, weighted_overlap, cost, prefill_blocks, decode_blocks
    )


def _reduce_selection(s: Selection) -> tuple[Any, tuple[Any, ...]]:
    return _selection, (
        s.worker,
        s.overlap_blocks,
        s.weighted_overlap,
        s.cost,
        s.prefill_blocks,
        s.decode_blocks,
    )


def _decoded_event(
    event: KvEvent, block_size: int, medium: str | None, group_idx: int | None
) -> DecodedEvent:
    return DecodedEvent(event, block_size, medium, group_idx)


def _reduce_decoded_event(e: DecodedEvent) -> tuple[Any, tuple[Any, ...]]:
    return _decoded_event, (e.event, e.block_size, e.medium, e.group_idx)


def _decoded_batch(
    ts: float,
    events: list[DecodedEvent],
    data_parallel_rank: int | None,
    skipped: tuple[int, ...],
    malformed: str | None = None,
) -> DecodedBatch:
    # Pickles of earlier versions carry four counts (no malformed events).
    groups, unknown, block_sizes, remote, *rest = skipped
    return DecodedBatch(
        ts,
        events,
        data_parallel_rank,
        skipped_groups=groups,
        skipped_unknown=unknown,
        skipped_block_sizes=block_sizes,
        skipped_remote=remote,
        skipped_malformed=rest[0] if rest else 0,
        malformed=malformed,
    )


def _reduce_decoded_batch(b: DecodedBatch) -> tuple[Any, tuple[Any, ...]]:
    skipped = (
        b.skipped_groups,
        b.skipped_unknown,
        b.skipped_block_sizes,
        b.skipped_remote,
        b.skipped_malformed,
    )
    return _decoded_batch, (b.ts, b.events, b.data_parallel_rank, skipped, b.malformed)


copyreg.pickle(BlockHasher, lambda h: (_block_hasher, (h.block_size, h.seed)))
copyreg.pickle(StoredBlock, lambda b: (_stored_block, (b.engine_hash, b.local_hash)))
copyreg.pickle(KvEvent.Stored, lambda e: (_stored, (e.parent, e.blocks)))
copyreg.pickle(KvEvent.Removed, lambda e: (_removed, (e.engine_hashes,)))
copyreg.pickle(KvEvent.Cleared, lambda e: (_cleared, ()))
copyreg.pickle(Route, _reduce_route)
copyreg.pickle(Selection, _reduce_selection)
copyreg.pickle(DecodedEvent, _reduce_decoded_event)
copyreg.pickle(DecodedBatch, _reduce_decoded_batch)
copyreg.pickle(EvictionConfig, _reduce_eviction_config)
copyreg.pickle(PrefixAffinityConfig, _reduce_prefix_affinity_config)
copyreg.pickle(KvAwareConfig, _reduce_kv_aware_config)


# The ZMQ subscriber's engine configuration (in wheels built with the `zmq` feature).
import kvtrie._kvtrie as _native  # noqa: E402

_EngineConfig: Any = getattr(_native, "EngineConfig", None)


def _engine_config(args: dict[str, Any]) -> Any:
    assert _EngineConfig is not None
    return _EngineConfig(**args)


def _reduce_engine_config(c: Any) -> tuple[Any, tuple[Any, ...]]:
    return _engine_config, (c._init_args(),)


if _EngineConfig is not None:
    copyreg.pickle(_EngineConfig, _reduce_engine_config)
