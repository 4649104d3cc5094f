//! Snapshots of a `BlockIndex`: round trips (proptest over random event sequences in every
//! tier, many workers, W4), a snapshot taken while 2 threads apply events, and every class of
//! hostile input.
#![cfg(not(loom))]

use kvtrie::blocks::{
    BlockHasher, BlockIndex, KvEvent, StoredBlock, Tier, TierWeights, WorkerId, MAX_COPIES,
};
use kvtrie::snapshot::{SnapshotError, SnapshotKind, FORMAT_VERSION, MAGIC};
use kvtrie::workload::{KvWorkload, SplitMix64};
use kvtrie::PrefixTree;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// A snapshot of an index no other thread is changing (its summary counts every block).
fn snap(index: &BlockIndex) -> Vec<u8> {
    let mut out = Vec::new();
    let s = index.write_snapshot(&mut out).unwrap();
    assert_eq!(s.bytes, out.len() as u64);
    assert_eq!(s.blocks, index.total_blocks() as u64);
    out
}

/// A snapshot taken while other threads apply events.
fn live_snap(index: &BlockIndex) -> Vec<u8> {
    let mut out = Vec::new();
    let s = index.write_snapshot(&mut out).unwrap();
    assert_eq!(s.bytes, out.len() as u64);
    out
}

fn restore(b: &[u8]) -> Result<BlockIndex, SnapshotError> {
    let r = BlockIndex::read_snapshot(b);
    if let Ok(i) = &r {
        i.check_invariants().unwrap();
    }
    r
}

/// The restored index equals the original: same hasher, workers, per-worker blocks (the
/// snapshot of each is the same bytes), counters, and the same answers to `queries` (per
/// worker, per tier, weighted).
fn assert_same(a: &BlockIndex, b: &BlockIndex, queries: &[Vec<u64>]) {
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();
    assert_eq!(a.hasher(), b.hasher());
    assert_eq!(a.workers(), b.workers());
    for w in a.workers() {
        assert_eq!(a.block_count(w), b.block_count(w), "{w:?}");
    }
    assert_eq!(a.total_blocks(), b.total_blocks());
    assert_eq!(a.distinct_blocks(), b.distinct_blocks());
    assert_eq!(a.stats(), b.stats());
    let weights = TierWeights {
        gpu: 1.0,
        cpu: 0.5,
        disk: 0.25,
        other: 0.125,
    };
    for q in queries {
        let (x, y) = (
            a.find_matches_weighted(q, &weights),
            b.find_matches_weighted(q, &weights),
        );
        assert_eq!(x, y, "{q:?}");
        let wx: Vec<_> = x.overlaps().map(|(w, o)| (w, o.weighted)).collect();
        let wy: Vec<_> = y.overlaps().map(|(w, o)| (w, o.weighted)).collect();
        assert_eq!(wx, wy, "{q:?}");
    }
    // Per-worker contents: the snapshot lists every (engine hash, sequence hash, copies) of
    // every worker in a canonical order, so equal contents mean equal records (workers come
    // in slot order, which depends on slot reuse: compare them by id).
    assert_eq!(per_worker(&snap(a)), per_worker(&snap(b)));
}

/// A snapshot's meta payload, and per worker id the payloads of its records.
type PerWorker = (Vec<u8>, BTreeMap<u64, Vec<(u8, Vec<u8>)>>);

fn per_worker(b: &[u8]) -> PerWorker {
    let mut i = 12 + b[11] as usize;
    let mut meta = Vec::new();
    let mut out: BTreeMap<u64, Vec<(u8, Vec<u8>)>> = BTreeMap::new();
    let mut cur = None;
    loop {
        let tag = b[i];
        let len = u32::from_le_bytes(b[i + 1..i + 5].try_into().unwrap()) as usize;
        let p = b[i + 5..i + 5 + len].to_vec();
        i += 5 + len;
        match tag {
            0 => break,
            1 => meta = p,
            2 => {
                let w = u64::from_le_bytes(p[..8].try_into().unwrap());
                assert!(out.insert(w, Vec::new()).is_none(), "worker {w} twice");
                cur = Some(w);
            }
            _ => out.get_mut(&cur.unwrap()).unwrap().push((tag, p)),
        }
    }
    (meta, out)
}

#[derive(Clone, Debug)]
enum Op {
    Stored {
        worker: u8,
        tier: u8,
        parent: Option<u8>,
        blocks: Vec<(u8, u8)>,
    },
    Removed {
        worker: u8,
        tier: u8,
        engine: Vec<u8>,
    },
    Cleared {
        worker: u8,
        tier: Option<u8>,
    },
    RemoveWorker {
        worker: u8,
    },
}

fn worker(w: u8) -> WorkerId {
    // Engines 0..3, two data-parallel ranks each.
    WorkerId::new(u64::from(w % 3), u16::from(w / 3 % 2))
}

fn local(l: u8) -> u64 {
    0x9E37_79B9_7F4A_7C15u64.wrapping_mul(u64::from(l % 6) + 1)
}

fn engine(e: u8) -> u64 {
    u64::from(e % 10) + 100
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), 0u8..4, proptest::option::of(any::<u8>()),
              proptest::collection::vec((any::<u8>(), any::<u8>()), 0..6))
            .prop_map(|(worker, tier, parent, blocks)| Op::Stored { worker, tier, parent, blocks }),
        2 => (any::<u8>(), 0u8..4, proptest::collection::vec(any::<u8>(), 0..4))
            .prop_map(|(worker, tier, engine)| Op::Removed { worker, tier, engine }),
        1 => (any::<u8>(), proptest::option::of(0u8..4))
            .prop_map(|(worker, tier)| Op::Cleared { worker, tier }),
        1 => any::<u8>().prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

/// Applies `ops`; returns the local-hash sequences of the stores (as queries).
fn apply(index: &BlockIndex, ops: &[Op]) -> Vec<Vec<u64>> {
    let mut queries = Vec::new();
    for op in ops {
        match op {
            Op::Stored {
                worker: w,
                tier,
                parent,
                blocks,
            } => {
                let blocks: Vec<StoredBlock> = blocks
                    .iter()
                    .map(|&(e, l)| StoredBlock {
                        engine_hash: engine(e),
                        local_hash: local(l),
                    })
                    .collect();
                queries.push(blocks.iter().map(|b| b.local_hash).collect());
                let _ = index.apply_in(
                    worker(*w),
                    Tier::ALL[*tier as usize],
                    KvEvent::Stored {
                        parent: parent.map(engine),
                        blocks,
                    },
                );
            }
            Op::Removed {
                worker: w,
                tier,
                engine: e,
            } => {
                let engine_hashes = e.iter().map(|&e| engine(e)).collect();
                index
                    .apply_in(
                        worker(*w),
                        Tier::ALL[*tier as usize],
                        KvEvent::Removed { engine_hashes },
                    )
                    .unwrap();
            }
            Op::Cleared { worker: w, tier } => match tier {
                None => index.apply(worker(*w), KvEvent::Cleared).unwrap(),
                Some(t) => index
                    .apply_in(worker(*w), Tier::ALL[*t as usize], KvEvent::Cleared)
                    .unwrap(),
            },
            Op::RemoveWorker { worker: w } => {
                index.remove_worker(worker(*w));
            }
        }
    }
    queries
}

/// Every sequence of up to 4 local hashes over the 6 used in the ops (plus some prefixes).
fn small_queries() -> Vec<Vec<u64>> {
    let mut out = vec![vec![]];
    let mut last = vec![vec![]];
    for _ in 0..3 {
        let mut next = Vec::new();
        for q in &last {
            for l in 0..6u8 {
                let mut q2: Vec<u64> = q.clone();
                q2.push(local(l));
                next.push(q2);
            }
        }
        out.extend(next.iter().cloned());
        last = next;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { 128 },
        ..ProptestConfig::default()
    })]

    #[test]
    #[cfg_attr(miri, ignore)]
    fn round_trip_equals_the_original(ops in proptest::collection::vec(op(), 0..80),
                                      seed in any::<u64>()) {
        let index = BlockIndex::with_hasher(&BlockHasher::with_seed(4, seed));
        let mut queries = apply(&index, &ops);
        queries.extend(small_queries());
        let bytes = snap(&index);
        let back = restore(&bytes).unwrap();
        // Workers are numbered densely in the order written: a snapshot of the restored
        // index is the same bytes.
        prop_assert_eq!(snap(&back), bytes);
        assert_same(&index, &back, &queries);
        // The restored index keeps working like the original under the same events.
        let more = apply(&index, &ops);
        apply(&back, &ops);
        assert_same(&index, &back, &more);
    }
}

#[test]
fn many_workers_and_high_slots_round_trip() {
    // 150 workers (slots past the inline bitset), one removed (a free slot), shared chains
    // held in mixed tiers and with several copies.
    let index = BlockIndex::new();
    let chain: Vec<StoredBlock> = (0..20)
        .map(|i| StoredBlock {
            engine_hash: 1000 + i,
            local_hash: 7 * i + 1,
        })
        .collect();
    for w in 0..150u64 {
        let n = 1 + (w as usize % 20);
        let tier = Tier::ALL[(w % 7 % 4) as usize];
        let id = WorkerId::new(w, (w % 3) as u16);
        index
            .apply_in(
                id,
                tier,
                KvEvent::Stored {
                    parent: None,
                    blocks: chain[..n].to_vec(),
                },
            )
            .unwrap();
        if w % 5 == 0 {
            index
                .store_blocks(id, None, &chain[..n.min(3)])
                .expect("a second copy");
        }
    }
    index.remove_worker(WorkerId::new(10, 1));
    let queries: Vec<Vec<u64>> = (0..=20)
        .map(|n| chain[..n].iter().map(|b| b.local_hash).collect())
        .collect();
    let back = restore(&snap(&index)).unwrap();
    assert_same(&index, &back, &queries);
    assert_eq!(back.workers().len(), 149);
}

#[test]
fn saturated_copies_round_trip() {
    let index = BlockIndex::new();
    let b = [StoredBlock {
        engine_hash: 5,
        local_hash: 50,
    }];
    for _ in 0..300 {
        index.store_blocks(WorkerId(1), None, &b).unwrap();
    }
    assert!(index.stats().copies_saturated > 0);
    let back = restore(&snap(&index)).unwrap();
    assert_same(&index, &back, &[vec![50]]);
    // As many removals as copies empty both.
    for _ in 0..MAX_COPIES {
        for i in [&index, &back] {
            i.remove_blocks(WorkerId(1), &[5]);
        }
    }
    assert_eq!((index.total_blocks(), back.total_blocks()), (0, 0));
}

#[test]
fn w4_round_trip() {
    let (requests, queries) = if cfg!(miri) {
        (8, 4)
    } else if cfg!(debug_assertions) {
        (300, 200)
    } else {
        (2_000, 1_000)
    };
    let w = KvWorkload::generate(requests, queries);
    let hasher = BlockHasher::new(w.block_size);
    let index = BlockIndex::with_hasher(&hasher);
    for (i, r) in w.requests.iter().enumerate() {
        let local = hasher.local_hashes(r);
        let seq = hasher.chain_local(&local);
        let blocks: Vec<StoredBlock> = local
            .iter()
            .zip(&seq)
            .map(|(&l, &s)| StoredBlock {
                engine_hash: s,
                local_hash: l,
            })
            .collect();
        index
            .store_blocks(WorkerId((i % 16) as u64), None, &blocks)
            .unwrap();
    }
    let q: Vec<Vec<u64>> = w.queries.iter().map(|t| hasher.local_hashes(t)).collect();
    let back = restore(&snap(&index)).unwrap();
    assert_same(&index, &back, &q);
    for t in &w.queries {
        assert_eq!(index.find_matches_tokens(t), back.find_matches_tokens(t));
    }
}

#[test]
fn empty_index_round_trip() {
    let index = BlockIndex::with_hasher(&BlockHasher::with_seed(32, 99));
    let back = restore(&snap(&index)).unwrap();
    assert_same(&index, &back, &[vec![1, 2]]);
    assert_eq!(back.hasher().block_size(), 32);
    assert_eq!(back.hasher().seed(), 99);
    // A known worker without blocks stays known.
    index.apply(WorkerId(3), KvEvent::Cleared).unwrap();
    index
        .store_blocks(
            WorkerId(3),
            None,
            &[StoredBlock {
                engine_hash: 1,
                local_hash: 1,
            }],
        )
        .unwrap();
    index.remove_blocks(WorkerId(3), &[1]);
    let back = restore(&snap(&index)).unwrap();
    assert_eq!(back.workers(), vec![WorkerId(3)]);
    assert_same(&index, &back, &[vec![1]]);
}

#[test]
fn live_snapshot_holds_every_event_applied_before_it() {
    // Two threads each grow one chain per worker (every event chains from the previous one,
    // so each worker's state is a prefix of its chain) and churn a side block, until told to
    // stop after the snapshots; `done[t]` counts the chain events thread `t` completed.
    const THREADS: usize = 2;
    const SNAPSHOTS: usize = if cfg!(miri) { 2 } else { 5 };
    let index = Arc::new(BlockIndex::new());
    let done: Arc<Vec<AtomicUsize>> = Arc::new((0..THREADS).map(|_| AtomicUsize::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let block = |t: usize, i: usize| StoredBlock {
        engine_hash: ((t as u64) << 32) | i as u64,
        local_hash: (i as u64) * 31 + 7,
    };
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (index, done, stop) = (index.clone(), done.clone(), stop.clone());
            std::thread::spawn(move || {
                let w = WorkerId::new(t as u64, 1);
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let parent = (i > 0).then(|| block(t, i - 1).engine_hash);
                    index.store_blocks(w, parent, &[block(t, i)]).unwrap();
                    done[t].store(i + 1, Ordering::Release);
                    // A side block in host memory, stored and removed.
                    let side = [StoredBlock {
                        engine_hash: u64::MAX - i as u64,
                        local_hash: 1,
                    }];
                    index.store_blocks_in(w, Tier::Cpu, None, &side).unwrap();
                    index.remove_blocks_in(w, Tier::Cpu, &[side[0].engine_hash]);
                    i += 1;
                }
                i
            })
        })
        .collect();
    let chain =
        |t: usize, n: usize| -> Vec<u64> { (0..n).map(|i| block(t, i).local_hash).collect() };
    for _ in 0..SNAPSHOTS {
        let before: Vec<usize> = done.iter().map(|d| d.load(Ordering::Acquire)).collect();
        let bytes = live_snap(&index);
        let back = restore(&bytes).unwrap();
        for (t, &n) in before.iter().enumerate() {
            let w = WorkerId::new(t as u64, 1);
            // The chain blocks, and at most the side block.
            let held = back.block_count(w);
            assert!(held >= n, "thread {t}: {held} blocks, {n} applied before");
            let m = back.find_matches(&chain(t, held)).get(w);
            assert!(m >= n, "thread {t}: matches {m}, {n} applied before");
            assert!(m == held || m + 1 == held, "thread {t}: {m} of {held}");
        }
        std::thread::yield_now();
    }
    stop.store(true, Ordering::Relaxed);
    let applied: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // At quiescence, a snapshot is exact.
    let back = restore(&snap(&index)).unwrap();
    let queries: Vec<Vec<u64>> = (0..THREADS).map(|t| chain(t, applied[t])).collect();
    assert_same(&index, &back, &queries);
    for (t, &n) in applied.iter().enumerate() {
        assert_eq!(
            back.find_matches(&queries[t])
                .get(WorkerId::new(t as u64, 1)),
            n
        );
    }
}

// ------------------------------------------------------------------------------------------
// Hostile input
// ------------------------------------------------------------------------------------------

fn small() -> Vec<u8> {
    let index = BlockIndex::with_hasher(&BlockHasher::new(4));
    let b = |e: u64| StoredBlock {
        engine_hash: e,
        local_hash: e * 10,
    };
    index
        .store_blocks(WorkerId::new(1, 2), None, &[b(1), b(2)])
        .unwrap();
    index
        .store_blocks_in(WorkerId(2), Tier::Disk, None, &[b(1)])
        .unwrap();
    index.store_blocks(WorkerId(2), None, &[b(1)]).unwrap();
    snap(&index)
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = small();
    for n in 0..bytes.len() {
        let e = restore(&bytes[..n])
            .err()
            .unwrap_or_else(|| panic!("{n} bytes restored"));
        assert!(
            matches!(
                e,
                SnapshotError::Truncated { .. } | SnapshotError::NotASnapshot
            ),
            "{n}: {e}"
        );
    }
    assert!(restore(&bytes).is_ok());
}

#[test]
fn every_flipped_bit_is_an_error() {
    let bytes = small();
    for i in 0..bytes.len() {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            let e = restore(&b)
                .err()
                .unwrap_or_else(|| panic!("flip {i}/{bit}: restored"));
            assert!(!e.to_string().is_empty());
        }
    }
}

#[test]
fn wrong_kind_both_ways_and_wrong_version() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    tree.insert_at("hello", a, 1).unwrap();
    let mut tree_bytes = Vec::new();
    tree.write_snapshot(&mut tree_bytes).unwrap();
    match restore(&tree_bytes) {
        Err(SnapshotError::WrongKind { expected, found }) => {
            assert_eq!(expected, SnapshotKind::BlockIndex);
            assert_eq!(found, Some(SnapshotKind::PrefixTree));
        }
        other => panic!("{other:?}"),
    }
    let bytes = small();
    match PrefixTree::read_snapshot(&bytes[..]) {
        Err(SnapshotError::WrongKind { expected, found }) => {
            assert_eq!(expected, SnapshotKind::PrefixTree);
            assert_eq!(found, Some(SnapshotKind::BlockIndex));
        }
        other => panic!("{other:?}"),
    }
    let mut k = bytes.clone();
    k[10] = 200;
    assert!(matches!(
        restore(&k),
        Err(SnapshotError::WrongKind { found: None, .. })
    ));
    let mut v = bytes.clone();
    v[8..10].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    match restore(&v) {
        Err(SnapshotError::UnsupportedVersion { found }) => assert_eq!(found, FORMAT_VERSION + 1),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        restore(b"KVTRIE"),
        Err(SnapshotError::NotASnapshot)
    ));
    let mut c = bytes.clone();
    let last = c.len() - 1;
    c[last] ^= 1;
    assert!(matches!(
        restore(&c),
        Err(SnapshotError::ChecksumMismatch { .. })
    ));
}

/// Builds block-index snapshots by hand, with a correct checksum, to reach the structural
/// checks.
struct Hand {
    out: Vec<u8>,
    records: u64,
}

impl Hand {
    fn new() -> Self {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.push(2);
        out.push(0);
        Hand { out, records: 0 }
    }
    fn record(mut self, tag: u8, payload: &[u8]) -> Self {
        self.out.push(tag);
        self.out
            .extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.out.extend_from_slice(payload);
        self.records += 1;
        self
    }
    fn raw_record(mut self, tag: u8, len: u32, payload: &[u8]) -> Self {
        self.out.push(tag);
        self.out.extend_from_slice(&len.to_le_bytes());
        self.out.extend_from_slice(payload);
        self
    }
    fn meta_with(self, block_size: u64) -> Self {
        let mut p = block_size.to_le_bytes().to_vec();
        p.extend_from_slice(&1337u64.to_le_bytes());
        for i in 0..8u64 {
            p.extend_from_slice(&i.to_le_bytes());
        }
        self.record(1, &p)
    }
    fn meta(self) -> Self {
        self.meta_with(16)
    }
    fn worker(self, w: u64) -> Self {
        self.record(2, &w.to_le_bytes())
    }
    fn gpu(self, blocks: &[(u64, u64)]) -> Self {
        let mut p = Vec::new();
        for &(e, s) in blocks {
            p.extend_from_slice(&e.to_le_bytes());
            p.extend_from_slice(&s.to_le_bytes());
        }
        self.record(3, &p)
    }
    fn copies(self, blocks: &[(u64, u64, [u8; 4])]) -> Self {
        let mut p = Vec::new();
        for &(e, s, c) in blocks {
            p.extend_from_slice(&e.to_le_bytes());
            p.extend_from_slice(&s.to_le_bytes());
            p.extend_from_slice(&c);
        }
        self.record(4, &p)
    }
    fn finish(mut self) -> Vec<u8> {
        self.out.push(0);
        self.out.extend_from_slice(&8u32.to_le_bytes());
        self.out.extend_from_slice(&self.records.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&self.out);
        self.out.extend_from_slice(&sum.to_le_bytes());
        self.out
    }
}

#[test]
fn a_hand_built_snapshot_restores() {
    // Worker 1 holds seq 10 (engine 1) then 20 (engine 2); worker 2 holds seq 10 under two
    // engine hashes (an alias), one of them also in host memory, and seq 20 twice on disk.
    let b = Hand::new()
        .meta()
        .worker(1)
        .gpu(&[(1, 10), (2, 20)])
        .worker(2)
        .gpu(&[(5, 10)])
        .copies(&[(6, 10, [1, 1, 0, 0]), (7, 20, [0, 0, 2, 0])])
        .finish();
    let i = restore(&b).unwrap();
    assert_eq!(i.stats().events_applied, 0);
    assert_eq!(i.stats().copies_saturated, 7);
    assert_eq!(i.total_blocks(), 5);
    assert_eq!(i.distinct_blocks(), 2);
    let s = i.find_matches_seq(&[10, 20]);
    assert_eq!((s.get(WorkerId(1)), s.get(WorkerId(2))), (2, 2));
    assert_eq!(s.get_tier(WorkerId(2), Tier::Cpu), 1);
    assert_eq!(s.get_tier(WorkerId(2), Tier::Gpu), 1);
    // Removing one of the two engine hashes of seq 10 keeps it on the GPU.
    i.remove_blocks(WorkerId(2), &[5]);
    assert_eq!(
        i.find_matches_seq(&[10]).get_tier(WorkerId(2), Tier::Gpu),
        1
    );
    i.remove_blocks(WorkerId(2), &[6]);
    assert_eq!(
        i.find_matches_seq(&[10]).get_tier(WorkerId(2), Tier::Gpu),
        0
    );
    i.check_invariants().unwrap();
}

#[test]
fn structural_errors_are_invalid_not_panics() {
    let over_batch: Vec<(u64, u64)> = (1..=4097).map(|e| (e, e)).collect();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("no meta", Hand::new().finish()),
        ("worker first", Hand::new().worker(1).finish()),
        ("short meta", Hand::new().record(1, &[0; 12]).finish()),
        ("block size 0", Hand::new().meta_with(0).finish()),
        (
            "blocks before a worker",
            Hand::new().meta().gpu(&[(1, 1)]).finish(),
        ),
        (
            "duplicate worker",
            Hand::new().meta().worker(1).worker(2).worker(1).finish(),
        ),
        (
            "duplicate engine hash in a record",
            Hand::new().meta().worker(1).gpu(&[(1, 1), (1, 2)]).finish(),
        ),
        (
            "duplicate engine hash across records",
            Hand::new()
                .meta()
                .worker(1)
                .gpu(&[(1, 1)])
                .copies(&[(1, 1, [0, 2, 0, 0])])
                .finish(),
        ),
        (
            "no copy in any tier",
            Hand::new()
                .meta()
                .worker(1)
                .copies(&[(1, 1, [0, 0, 0, 0])])
                .finish(),
        ),
        (
            "empty block record",
            Hand::new().meta().worker(1).gpu(&[]).finish(),
        ),
        (
            "ragged block record",
            Hand::new().meta().worker(1).record(3, &[0; 17]).finish(),
        ),
        (
            "ragged copies record",
            Hand::new().meta().worker(1).record(4, &[0; 16]).finish(),
        ),
        (
            "too many blocks in a record",
            Hand::new().meta().worker(1).gpu(&over_batch).finish(),
        ),
        (
            "worker record with trailing bytes",
            Hand::new().meta().record(2, &[0; 9]).finish(),
        ),
        (
            "short worker record",
            Hand::new().meta().record(2, &[0; 4]).finish(),
        ),
        ("unknown tag", Hand::new().meta().record(9, b"").finish()),
        ("second meta", Hand::new().meta().meta().finish()),
    ];
    for (what, b) in cases {
        match restore(&b) {
            Err(SnapshotError::Invalid { reason, .. }) => assert!(!reason.is_empty(), "{what}"),
            other => panic!("{what}: {other:?}"),
        }
    }
}

#[test]
fn absurd_lengths_cost_nothing() {
    // A record that claims 2 GiB with a few bytes behind it: truncated, after reading only
    // what is there.
    let b = Hand::new().meta().raw_record(3, 1 << 31, b"abc").finish();
    assert!(matches!(restore(&b), Err(SnapshotError::Truncated { .. })));
    // The largest length a record can state (4 GiB − 1), with nothing behind it: the same.
    let b = Hand::new().meta().raw_record(3, u32::MAX, b"").finish();
    assert!(matches!(restore(&b), Err(SnapshotError::Truncated { .. })));
    // An absurd block size is accepted as a number (it only sets how tokens are cut), but
    // not one that is 0 or beyond `usize`.
    if usize::BITS < 64 {
        let b = Hand::new().meta_with(u64::MAX).finish();
        assert!(matches!(restore(&b), Err(SnapshotError::Invalid { .. })));
    }
    // A wrong record count in the end record.
    let mut h = Hand::new().meta().worker(1).gpu(&[(1, 1)]);
    h.records += 1;
    assert!(matches!(
        restore(&h.finish()),
        Err(SnapshotError::Invalid { .. })
    ));
}

#[test]
fn random_bytes_after_a_valid_header_never_panic() {
    let mut r = SplitMix64::new(5);
    let head = Hand::new().meta().worker(1).out;
    for _ in 0..if cfg!(miri) { 20 } else { 2_000 } {
        let mut b = head.clone();
        let n = r.below(120) as usize;
        b.extend((0..n).map(|_| r.next() as u8));
        let _ = restore(&b);
    }
}
