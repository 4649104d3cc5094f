"""Long-running use from Python: what a Ray router does for weeks, in rounds over a fixed
working set, must leave memory and threads where they were.

Each round drives every kind of call the bindings offer over the same prompts, token
sequences and tenant names: inserts, matches, match-and-insert with a Python callback,
evictions, tenants removed and added again, the eviction loop started and stopped, routes and
their bookings, KV events in and selections out, hashing, vLLM payload decoding and errors
raised from Rust. The working set is the same in every round, so after a few rounds of
warm-up nothing the bindings hold should grow. Two meters:

* Python objects: ``tracemalloc``'s traced memory (every object the bindings create or leak
  is a Python allocation);
* Rust and native memory: glibc's ``mallinfo2`` bytes in use (the crate allocates through
  ``malloc``; freed memory left cached in the allocator is not in use).

Over the measured rounds (3,200 prompts, about 38,000 calls) both meters vary by at most
about 16 KB and 50 KB between runs (the tree's reclamation backlog, allocator bookkeeping); a
leak of one small Python object per prompt adds about 300 KB (a kept match result per prompt:
780 KB, and 1.2 MB of native memory). The bounds are 64 KB and 512 KB.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import tracemalloc

import pytest

import kvtrie
from kvtrie import (
    BlockHasher,
    BlockIndex,
    EvictionConfig,
    KvAwareConfig,
    KvAwareRouter,
    KvEvent,
    PrefixAffinityConfig,
    PrefixAffinityRouter,
    PrefixTree,
    RouteError,
    StoredBlock,
    vllm,
)

WARMUP_ROUNDS = 3
MEASURED_ROUNDS = 8
PROMPTS = 400


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_meter():
    """A function returning the bytes glibc's malloc has handed out and not got back, or
    ``None`` where there is no ``mallinfo2`` (not glibc, or glibc < 2.33)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    mallinfo2.argtypes = []

    def in_use() -> int:
        m = mallinfo2()
        return m.uordblks + m.hblkhd

    return in_use


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Workload:
    """The fixed working set and the objects a long-running router keeps."""

    def __init__(self) -> None:
        rng = random.Random(7)
        systems = ["".join(rng.choice("abcdefgh ") for _ in range(300)) for _ in range(8)]
        self.prompts = [
            rng.choice(systems) + "".join(rng.choice("abcdefghij é中🙂") for _ in range(80))
            for _ in range(PROMPTS)
        ]
        self.tenants = [f"replica-{i}" for i in range(8)]
        self.tree = PrefixTree()
        self.tree.add_tenants(self.tenants, 0.0)
        self.router = PrefixAffinityRouter(PrefixAffinityConfig(match_rate_threshold=0.2))
        self.router.update_replicas(self.tenants)
        self.hasher = BlockHasher(16)
        self.kv = KvAwareRouter(KvAwareConfig(block_size=16))
        self.workers = list(range(1, 9))
        self.tokens = [
            [rng.randrange(32_000) for _ in range(16 * (4 + i % 12))] for i in range(PROMPTS)
        ]
        self.clock = 0.0
        self.payload = self._vllm_payload()

    def _vllm_payload(self) -> bytes:
        """One vLLM ``KVEventBatch`` as vLLM encodes it, if msgspec is here."""
        try:
            import msgspec
        except ImportError:
            return b""
        stored = {
            "type": "BlockStored",
            "block_hashes": [11, 12],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
        }
        return msgspec.msgpack.encode([1.0, [stored, {"type": "AllBlocksCleared"}], None])

    def round(self) -> None:
        tree, router, kv, hasher = self.tree, self.router, self.kv, self.hasher
        names = self.tenants
        for i, prompt in enumerate(self.prompts):
            self.clock += 1.0
            tenant = names[i % len(names)]
            tree.insert(prompt, tenant, self.clock)
            tree.prefix_match(prompt)
            tree.prefix_match(prompt, names[:3])
            tree.match_and_insert(
                prompt[: 200 + i % 100],
                lambda text, owners: owners[0] if owners else tenant,
                self.clock,
            )
            if i % 10 == 0:
                tree.evict_tenant_by_lru(tenant, 150)
                tree.get_smallest_tenants()
                dict(tree.tenant_to_char_count)
                tree.prefix_match_many(self.prompts[i : i + 5], names[4:])
            route = router.route(prompt, {n: (i + k) % 5 for k, n in enumerate(names)})
            _ = (route.replica, route.reason, route.matched_chars)
            tokens = self.tokens[i]
            local = hasher.local_hashes(tokens)
            worker = self.workers[i % len(self.workers)]
            engine = [hash((worker, i, b)) & 0xFFFF_FFFF_FFFF for b in range(len(local))]
            kv.index.apply(
                worker, KvEvent.Stored(None, [StoredBlock(e, h) for e, h in zip(engine, local)])
            )
            sel = kv.select_and_reserve(i, tokens, self.workers)
            _ = (sel.worker, sel.overlap_blocks, sel.cost)
            kv.prefill_complete(i)
            kv.request_complete(i)
            kv.index.find_matches(local)
            if i % 4 == 0:
                kv.index.apply(worker, KvEvent.Removed(engine[len(engine) // 2 :]))
            if i % 50 == 0:
                with pytest.raises(TypeError):
                    tree.insert(None, tenant, self.clock)
                with pytest.raises(RouteError):
                    router.route(prompt, {})
                if self.payload:
                    batch = vllm.decode_batch(self.payload, block_size=16)
                    for e in batch.events:
                        kv.index.apply(worker, e.event)
                with pytest.raises(ValueError):
                    vllm.decode_batch(b"\xc1garbage", block_size=16)
        # Tenants and replicas leave and come back under the same names (as Ray's replicas
        # restart); workers are replaced.
        tree.remove_tenants(names[-2:])
        tree.add_tenants(names[-2:], self.clock)
        router.remove_replica(names[-1])
        router.add_replica(names[-1])
        kv.remove_worker(self.workers[-1])
        # The eviction loop, started and stopped.
        tree.start_eviction_loop(40_000, 30_000, 0.001)
        tree.stop_eviction_loop()
        router.char_counts()
        tree.stats()
        kv.stats()


def test_a_long_run_from_python_keeps_memory_and_threads_flat():
    # (only bindings calls are measured: the workload's own data is built first)
    w = Workload()
    malloc_in_use = _malloc_meter()
    tracemalloc.start()
    try:
        for _ in range(WARMUP_ROUNDS):
            w.round()
        gc.collect()
        py_before = tracemalloc.get_traced_memory()[0]
        native_before = malloc_in_use() if malloc_in_use else None
        threads_before = _os_threads()
        for _ in range(MEASURED_ROUNDS):
            w.round()
        gc.collect()
        py_after = tracemalloc.get_traced_memory()[0]
        native_after = malloc_in_use() if malloc_in_use else None
        threads_after = _os_threads()
    finally:
        tracemalloc.stop()
    calls = MEASURED_ROUNDS * PROMPTS * 12
    py_growth = py_after - py_before
    assert py_growth < 64 * 1024, (
        f"Python memory grew {py_growth} bytes over {calls} calls "
        f"({py_before} -> {py_after})"
    )
    if native_before is not None:
        native_growth = native_after - native_before
        assert native_growth < 512 * 1024, (
            f"malloc'd memory in use grew {native_growth} bytes over {calls} calls "
            f"({native_before} -> {native_after})"
        )
    assert threads_after == threads_before
    # The structures themselves stayed consistent under the churn.
    w.tree.check_invariants()
    w.router.check_invariants()
    assert len(w.tree) > 0
