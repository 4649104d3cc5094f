//! Long-lived collections stay bounded under steady-state churn: a router runs for weeks, so
//! nothing may grow with the operations, names, workers or requests it has ever seen.
//!
//! Each test drives one structure through a steady workload whose *live* state stays constant
//! and asserts that memory stays flat.
//!
//! The live heap is read from a counting global allocator (`kvtrie::workload::CountingAlloc`),
//! so the tests of this file run one at a time (`SERIAL`), and every assertion compares sizes
//! (no timing).
#![cfg(not(loom))]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvtrie::blocks::{ApproxConfig, ApproxIndex, BlockIndex, KvEvent, StoredBlock, Tier, WorkerId};
use kvtrie::router::{Candidate, Choice, KvAwareConfig, KvAwareRouter, LoadBook};
use kvtrie::router::{PrefixAffinityConfig, PrefixAffinityRouter};
use kvtrie::workload::CountingAlloc;
use kvtrie::PrefixTree;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

/// The tests measure the process's live heap: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Live heap bytes now, relative to `base`.
fn grown_since(base: usize) -> isize {
    ALLOC.live() as isize - base as isize
}

fn blocks(base: u64, n: u64) -> Vec<StoredBlock> {
    (0..n)
        .map(|i| StoredBlock {
            engine_hash: base + i + 1,
            local_hash: (base + i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        })
        .collect()
}

/// src/blocks/approx.rs while the caller's clock stands still: a hot prefix re-recorded at the
/// time it already has keeps one queue entry per block (each record used to push another, all
/// current, so compaction kept them: one 16-byte entry per block per request).
#[test]
fn approx_queue_is_flat_when_the_clock_stands_still() {
    let _s = serial();
    // Pure LRU by count: no TTL, at most 1024 blocks per worker.
    let approx = ApproxIndex::new(ApproxConfig {
        ttl: u64::MAX,
        max_blocks_per_worker: 1024,
    });
    let w = WorkerId(1);
    let prefix: Vec<u64> = (1..=16).collect(); // one hot 16-block system prompt
    let now = 7; // the caller's clock does not advance between these requests
    for _ in 0..200 {
        approx.record(w, &prefix, now);
    }
    approx.expire(now);
    let base = ALLOC.live();
    let (blocks_before, heap_before) = (approx.block_count(w), approx.index().heap_bytes());
    // (Kept small: each `record` also runs `compact`, a full pass over the queue that
    // removes nothing, so the cost of a record grows with the queue too.)
    for _ in 0..5_000 {
        approx.record(w, &prefix, now);
    }
    approx.expire(now);
    // The live state did not change...
    assert_eq!(approx.block_count(w), blocks_before);
    assert_eq!(approx.block_count(w), 16);
    assert_eq!(approx.index().heap_bytes(), heap_before);
    // ...but the per-worker queue grew by one entry per block per request.
    let grown = grown_since(base);
    assert!(
        grown < 64 << 10,
        "5,000 re-records of the same 16 blocks at one timestamp grew the live heap by \
         {grown} bytes (16 blocks remembered)"
    );
}

/// src/tree/mod.rs `Registry` (names, slot_names, free/released slots) and src/tenant.rs
/// `Slots`: 20,000 add/insert/remove cycles of fresh tenant names reuse a handful of slots and
/// leave the tree's heap and the process's live heap where they were.
#[test]
fn tree_tenant_registry_is_flat_under_fresh_name_churn() {
    let _s = serial();
    let tree = PrefixTree::new();
    let keep = tree.add_tenant("keep");
    tree.insert_at("base", keep, 0).unwrap();
    let cycle = |i: u64| {
        let t = tree.add_tenant(&format!("replica-{i}"));
        tree.insert_at(&format!("prompt {i}"), t, i).unwrap();
        tree.remove_tenant(t);
        t.slot()
    };
    for i in 0..1_000 {
        cycle(i);
    }
    tree.collect_garbage();
    let (base, heap) = (ALLOC.live(), tree.stats().heap_bytes);
    let mut max_slot = 0;
    for i in 1_000..20_000 {
        max_slot = max_slot.max(cycle(i));
    }
    tree.collect_garbage();
    assert!(max_slot < 64, "slot {max_slot}");
    assert_eq!(tree.stats().heap_bytes, heap);
    assert!(grown_since(base) < 64 << 10, "{}", grown_since(base));
}

/// src/blocks/index/workers.rs `Registry`, src/blocks/names.rs directory, free slots: 20,000
/// store/remove_worker cycles of fresh worker ids.
#[test]
fn block_index_worker_registry_is_flat_under_fresh_worker_churn() {
    let _s = serial();
    let index = BlockIndex::new();
    let cycle = |i: u64| {
        let w = WorkerId(1_000 + i);
        let ev = KvEvent::Stored {
            parent: None,
            blocks: blocks(i * 10, 4),
        };
        index.apply(w, ev).unwrap();
        index.remove_worker(w);
    };
    for i in 0..1_000 {
        cycle(i);
    }
    index.collect_garbage();
    let (base, heap) = (ALLOC.live(), index.heap_bytes());
    for i in 1_000..20_000 {
        cycle(i);
    }
    index.collect_garbage();
    assert_eq!(index.heap_bytes(), heap);
    assert!(index.workers().is_empty());
    assert!(grown_since(base) < 64 << 10, "{}", grown_since(base));
}

/// src/blocks/map.rs `EngineMap` (simple, multi), `WorkerBlocks::aliases`, the table and its
/// holder sets: store/remove cycles of fresh hashes with copies, a second tier and an alias
/// (two engine hashes for one sequence hash).
#[test]
fn block_index_engine_maps_are_flat_under_store_remove_cycles() {
    let _s = serial();
    let index = BlockIndex::new();
    let w = WorkerId(1);
    let other = WorkerId(2);
    let cycle = |i: u64| {
        let b = blocks(i * 100, 8);
        let stored = |bs: &[StoredBlock]| KvEvent::Stored {
            parent: None,
            blocks: bs.to_vec(),
        };
        index.apply(w, stored(&b)).unwrap();
        index.apply(other, stored(&b[..3])).unwrap();
        index.apply_in(w, Tier::Cpu, stored(&b[..4])).unwrap();
        index.apply(w, stored(&b[..2])).unwrap(); // second GPU copies
        let alias = StoredBlock {
            engine_hash: b[0].engine_hash ^ (1 << 62),
            local_hash: b[0].local_hash,
        };
        index.apply(w, stored(&[alias])).unwrap();
        let all: Vec<u64> = b.iter().map(|s| s.engine_hash).collect();
        let removed = |hs: &[u64]| KvEvent::Removed {
            engine_hashes: hs.to_vec(),
        };
        index.apply(w, removed(&all)).unwrap();
        index.apply(w, removed(&all[..2])).unwrap();
        index.apply_in(w, Tier::Cpu, removed(&all[..4])).unwrap();
        index.apply(w, removed(&[alias.engine_hash])).unwrap();
        index.apply(other, KvEvent::Cleared).unwrap();
    };
    for i in 0..1_000 {
        cycle(i);
    }
    index.collect_garbage();
    let (base, heap) = (ALLOC.live(), index.heap_bytes());
    for i in 1_000..40_000 {
        cycle(i);
    }
    index.collect_garbage();
    assert_eq!((index.total_blocks(), index.distinct_blocks()), (0, 0));
    assert_eq!(index.heap_bytes(), heap);
    index.check_invariants().unwrap();
    assert!(grown_since(base) < 64 << 10, "{}", grown_since(base));
}

/// src/router/load.rs `LoadBook` shards (bookings by request id): completed requests, and
/// requests never completed but expired by the TTL.
#[test]
fn load_book_bookings_are_flat_when_released_or_expired() {
    let _s = serial();
    let book = LoadBook::new(Duration::from_secs(60));
    let workers = [WorkerId(0), WorkerId(1)];
    let t0 = Instant::now();
    let pick = |i: u64| {
        move |_: &[kvtrie::router::WorkerLoad]| Choice {
            index: (i % 2) as usize,
            prefill_blocks: 1,
            decode_blocks: 2,
        }
    };
    let cycle = |i: u64| {
        book.book(i, &workers, t0, pick(i)).unwrap();
        book.prefill_complete(i);
        book.request_complete(i);
        // A request that is never completed: released by the TTL sweep.
        let at = t0 + Duration::from_millis(i);
        book.book(u64::MAX - i, &workers, at, pick(i)).unwrap();
        book.expire_stale(at + Duration::from_secs(60));
    };
    for i in 0..1_000 {
        cycle(i);
    }
    let base = ALLOC.live();
    for i in 1_000..40_000 {
        cycle(i);
    }
    assert_eq!(book.stats().active_requests, 0);
    assert_eq!(book.loads().len(), 2);
    assert!(grown_since(base) < 64 << 10, "{}", grown_since(base));
}

/// src/blocks/approx.rs with an advancing clock: the TTL and the per-worker bound keep the
/// queue, the last-time map and the index at the blocks remembered.
#[test]
fn approx_index_is_flat_with_an_advancing_clock() {
    let _s = serial();
    let ttl = ApproxIndex::new(ApproxConfig {
        ttl: 100,
        max_blocks_per_worker: 0,
    });
    let bound = ApproxIndex::new(ApproxConfig {
        ttl: u64::MAX,
        max_blocks_per_worker: 64,
    });
    let cycle = |i: u64| {
        let hs: Vec<u64> = (0..8).map(|k| i * 100 + k + 1).collect();
        ttl.record(WorkerId(i % 4), &hs, i);
        ttl.record(WorkerId(i % 4), &[1, 2, 3], i); // a hot prefix, re-recorded
        ttl.expire(i);
        bound.record(WorkerId(i % 4), &hs, i);
    };
    for i in 0..1_000 {
        cycle(i);
    }
    ttl.index().collect_garbage();
    bound.index().collect_garbage();
    let base = ALLOC.live();
    for i in 1_000..40_000 {
        cycle(i);
    }
    ttl.index().collect_garbage();
    bound.index().collect_garbage();
    assert!(ttl.index().total_blocks() <= 4 * 3 + 100 * 8);
    assert_eq!(bound.index().total_blocks(), 4 * 64);
    assert!(grown_since(base) < 64 << 10, "{}", grown_since(base));
}

/// src/router/prefix_affinity.rs replica churn (`update_replicas` with fresh names) and
/// src/router/kv_aware.rs selections with fresh request ids that complete.
#[test]
fn routers_are_flat_under_replica_and_request_churn() {
    let _s = serial();
    let pa = PrefixAffinityRouter::new(PrefixAffinityConfig::default());
    let kv = KvAwareRouter::new(KvAwareConfig::new(4));
    let tokens: Vec<u32> = (0..64).collect();
    let cycle = |i: u64| {
        let ids = pa.update_replicas(&[&format!("a{i}"), &format!("b{i}")]);
        let c: Vec<Candidate> = ids.iter().map(|&x| Candidate::new(x, 0)).collect();
        pa.route(&format!("prompt {i}"), &c).unwrap();
        kv.select_and_reserve(i, &tokens, &[WorkerId(i % 3), WorkerId(7)], 8)
            .unwrap();
        kv.request_complete(i);
    };
    for i in 0..1_000 {
        cycle(i);
    }
    pa.tree().collect_garbage();
    let (base, heap) = (ALLOC.live(), pa.tree().stats().heap_bytes);
    for i in 1_000..20_000 {
        cycle(i);
    }
    pa.tree().collect_garbage();
    assert_eq!(pa.tree().stats().heap_bytes, heap);
    assert_eq!(kv.stats().active_requests, 0);
    assert!(grown_since(base) < 64 << 10, "{}", grown_since(base));
}

/// src/blocks/index/mod.rs `rebuild`: a writer that churns blocks (stores fresh ones, removes
/// old ones) fills the table with dead keys and rebuilds it every few thousand events; the old
/// table is retired. Without `collect_garbage` (a ZMQ subscriber's engine thread never calls
/// it), each retired table used to wait in the writer thread's crossbeam bag until 64 deferred
/// functions had gathered there: the live heap grew by a whole table per rebuild, up to 64
/// tables per writer thread.
#[test]
fn block_index_rebuilt_tables_are_freed_without_collect_garbage() {
    let _s = serial();
    let index = BlockIndex::new();
    let w = WorkerId(1);
    let live = 2_000u64;
    let store = |i: u64| {
        index
            .apply(
                w,
                KvEvent::Stored {
                    parent: None,
                    blocks: blocks(i * 10, 1),
                },
            )
            .unwrap()
    };
    let remove = |i: u64| {
        index
            .apply(
                w,
                KvEvent::Removed {
                    engine_hashes: vec![i * 10 + 1],
                },
            )
            .unwrap()
    };
    for i in 0..live {
        store(i);
    }
    // Warm up: a few rebuilds, then measure from a clean state.
    for i in live..live * 4 {
        store(i);
        remove(i - live);
    }
    index.collect_garbage();
    let (base, table) = (ALLOC.live(), index.heap_bytes());
    let mut peak = 0isize;
    for i in live * 4..live * 40 {
        store(i);
        remove(i - live);
        peak = peak.max(grown_since(base));
    }
    assert_eq!(index.total_blocks(), live as usize);
    assert!(
        peak < 4 * table as isize,
        "grew by {peak} bytes (the index holds {table})"
    );
}
