//! Snapshots of a `PrefixTree`: round trips (proptest over random operation sequences, W1),
//! a snapshot taken while other threads insert, and every class of hostile input.
#![cfg(not(loom))]

use kvtrie::snapshot::{SnapshotError, SnapshotKind, FORMAT_VERSION, MAGIC, OLDEST_FORMAT_VERSION};
use kvtrie::workload::{ChatWorkload, SplitMix64, CHURN_ALPHABET};
use kvtrie::{Error, PrefixMatch, PrefixTree, TenantId};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn snap(tree: &PrefixTree) -> Vec<u8> {
    let mut out = Vec::new();
    let s = tree.write_snapshot(&mut out).unwrap();
    assert_eq!(s.bytes, out.len() as u64);
    out
}

/// The restored tree equals the original: same shape, owners, times, ids, counts, matches.
fn assert_same(a: &PrefixTree, b: &PrefixTree, queries: &[String]) {
    b.check_invariants().unwrap();
    assert_eq!(a.snapshot(), b.snapshot());
    assert_eq!(a.tenants(), b.tenants());
    for t in a.tenants() {
        assert_eq!(a.char_count(t), b.char_count(t));
        assert_eq!(a.tenant_name(t), b.tenant_name(t));
    }
    assert_eq!(
        (a.node_count(), a.distinct_chars(), a.distinct_bytes()),
        (b.node_count(), b.distinct_chars(), b.distinct_bytes())
    );
    for q in queries {
        assert_eq!(a.prefix_match(q, None), b.prefix_match(q, None), "{q:?}");
    }
}

/// `(path, owners by name with times)` of every node, owners sorted by name.
type Named = Vec<(String, Vec<(String, u64)>)>;

/// A snapshot with tenant ids replaced by names.
fn by_name(tree: &PrefixTree, s: &kvtrie::NodeSnapshot) -> Named {
    fn flat(tree: &PrefixTree, s: &kvtrie::NodeSnapshot, path: &str, out: &mut Named) {
        let mut owners: Vec<(String, u64)> = s
            .tenants
            .iter()
            .map(|&(t, ts)| {
                (
                    tree.tenant_name(t)
                        .map(|n| n.to_string())
                        .unwrap_or_default(),
                    ts,
                )
            })
            .collect();
        owners.sort();
        let p = format!("{path}|{}", s.text);
        out.push((p.clone(), owners));
        for c in &s.children {
            flat(tree, c, &p, out);
        }
    }
    let mut out = Vec::new();
    flat(tree, s, "", &mut out);
    out
}

#[derive(Clone, Debug)]
enum Op {
    Add(u8),
    Insert(String, u8, u64),
    Remove(u8),
    Evict(u8, usize),
}

fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(0..CHURN_ALPHABET.len(), 1..10)
        .prop_map(|v| v.into_iter().map(|i| CHURN_ALPHABET[i]).collect())
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4).prop_map(Op::Add),
        (text(), 0u8..4, 0u64..50).prop_map(|(s, t, ts)| Op::Insert(s, t, ts)),
        (text(), 0u8..4, 0u64..50).prop_map(|(s, t, ts)| Op::Insert(s, t, ts)),
        (text(), 0u8..4, 0u64..50).prop_map(|(s, t, ts)| Op::Insert(s, t, ts)),
        (0u8..4).prop_map(Op::Remove),
        (0u8..4, 1usize..20).prop_map(|(t, n)| Op::Evict(t, n)),
    ]
}

fn apply(tree: &PrefixTree, ops: &[Op]) -> Vec<String> {
    let id = |n: u8| tree.tenant_id(&format!("t{n}"));
    let mut texts = Vec::new();
    for o in ops {
        match o {
            Op::Add(n) => {
                tree.add_tenant(&format!("t{n}"));
            }
            Op::Insert(s, n, ts) => {
                if let Some(t) = id(*n) {
                    tree.insert_at(s, t, *ts).unwrap();
                }
                texts.push(s.clone());
            }
            Op::Remove(n) => {
                if let Some(t) = id(*n) {
                    tree.remove_tenant(t);
                }
            }
            Op::Evict(n, k) => {
                if let Some(t) = id(*n) {
                    tree.evict_tenant_by_lru(t, *k);
                }
            }
        }
    }
    texts
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { 256 },
        // Failing cases are saved next to this file (`*.proptest-regressions`) and replayed
        // first; the default location is found from a `lib.rs`, which a test file lacks.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    /// Random operation sequences: the restored tree equals the original, and the two stay
    /// equal under the same further operations (times, LRU order and slots restored too).
    #[test]
    fn round_trip_equals_the_original(ops in proptest::collection::vec(op(), 0..60),
                                       more in proptest::collection::vec(op(), 0..20)) {
        let tree = PrefixTree::new();
        let texts = apply(&tree, &ops);
        let restored = PrefixTree::read_snapshot(&snap(&tree)[..]).unwrap();
        assert_same(&tree, &restored, &texts);
        // Further operations give the same tree, up to the slots new tenants get (the
        // original reuses a removed tenant's slot only after a grace period).
        let t1 = apply(&tree, &more);
        let t2 = apply(&restored, &more);
        assert_eq!(t1, t2);
        restored.check_invariants().unwrap();
        assert_eq!(by_name(&tree, &tree.snapshot()), by_name(&restored, &restored.snapshot()));
        for q in &t1 {
            let (a, b) = (tree.prefix_match(q, None), restored.prefix_match(q, None));
            assert_eq!(a.matched_chars, b.matched_chars);
        }
    }
}

#[test]
fn w1_round_trip() {
    let w = ChatWorkload::generate(false, if cfg!(miri) { 20 } else { 10_000 }, 2_000);
    let tree = PrefixTree::new();
    let ids: Vec<TenantId> = w.tenants.iter().map(|n| tree.add_tenant(n)).collect();
    for (i, p) in w.prompts.iter().enumerate() {
        tree.insert_at(p, ids[i % 16], i as u64).unwrap();
    }
    let bytes = snap(&tree);
    let restored = PrefixTree::read_snapshot(&bytes[..]).unwrap();
    assert_same(&tree, &restored, &w.queries);
    // The restored tree evicts in the same LRU order.
    for &t in &ids {
        assert_eq!(
            tree.evict_tenant_by_lru(t, 3_000),
            restored.evict_tenant_by_lru(t, 3_000)
        );
    }
    assert_same(&tree, &restored, &w.queries[..200]);
}

/// The clock resumes where the snapshot's stopped, however long ago that is: a tree that ran
/// longer than the restoring machine has been up restarted at 0 (an `Instant` that far back
/// did not exist), so what it then inserted at the tree clock counted as older than
/// everything restored.
#[test]
fn the_clock_resumes_after_a_snapshot_older_than_the_machine() {
    let mut tree = PrefixTree::new();
    let month = 30 * 24 * 3_600_000;
    tree.advance_clock(1_000 * month);
    let a = tree.add_tenant("a");
    tree.insert("old", a).unwrap();
    let at = tree.now();
    let mut restored = PrefixTree::read_snapshot(&snap(&tree)[..]).unwrap();
    assert!(restored.now() >= at, "{} < {at}", restored.now());
    // The snapshot waited a minute: the caller adds it.
    restored.advance_clock(60_000);
    assert!(restored.now() >= at + 60_000);
    let a = restored.tenant_id("a").unwrap();
    restored.insert("new", a).unwrap();
    // The newer prompt survives the eviction of the oldest group.
    assert_eq!(restored.evict_tenant_by_lru(a, 1), 3);
    assert_eq!(restored.prefix_match("new", None).matched_chars, 3);
    assert_eq!(restored.prefix_match("old", None).matched_chars, 0);
}

/// A restored clock is at least the newest time in the tree: a live snapshot reads the clock
/// before the nodes, whose later inserts would otherwise count as newer than the first
/// inserts after the restore.
#[test]
fn the_clock_resumes_at_least_at_the_newest_time() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let ahead = tree.now() + 3_600_000;
    tree.insert_at("written during the snapshot", a, ahead)
        .unwrap();
    let restored = PrefixTree::read_snapshot(&snap(&tree)[..]).unwrap();
    assert!(restored.now() >= ahead);
}

#[test]
fn empty_tree_round_trip() {
    let tree = PrefixTree::new();
    let restored = PrefixTree::read_snapshot(&snap(&tree)[..]).unwrap();
    assert_same(&tree, &restored, &["abc".to_string()]);
    // A tree with tenants but no text, and a removed tenant's slot left free.
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.remove_tenant(a);
    let restored = PrefixTree::read_snapshot(&snap(&tree)[..]).unwrap();
    assert_same(&tree, &restored, &[]);
    assert_eq!(restored.tenants(), vec![b]);
    let c = restored.add_tenant("c");
    assert_ne!(c, b);
    restored.check_invariants().unwrap();
}

/// A snapshot taken while two threads insert: it restores to a valid tree holding every insert
/// completed before the snapshot began.
#[test]
fn live_snapshot_holds_every_completed_insert() {
    let per_thread = if cfg!(miri) { 60 } else { 4_000 };
    let tree = Arc::new(PrefixTree::new());
    let ids: Vec<TenantId> = (0..4).map(|i| tree.add_tenant(&format!("t{i}"))).collect();
    let texts: Vec<Vec<(String, usize)>> = (0..2)
        .map(|th| {
            let mut r = SplitMix64::new(99 + th);
            (0..per_thread)
                .map(|_| {
                    let n = 1 + r.below(30) as usize;
                    let s: String = (0..n)
                        .map(|_| CHURN_ALPHABET[r.below(CHURN_ALPHABET.len() as u64) as usize])
                        .collect();
                    (s, r.below(4) as usize)
                })
                .collect()
        })
        .collect();
    let done: Vec<AtomicUsize> = (0..2).map(|_| AtomicUsize::new(0)).collect();
    let (bytes, completed) = std::thread::scope(|s| {
        for (th, plan) in texts.iter().enumerate() {
            let (tree, ids, done) = (&tree, &ids, &done);
            s.spawn(move || {
                for (i, (text, t)) in plan.iter().enumerate() {
                    tree.insert_at(text, ids[*t], i as u64).unwrap();
                    done[th].store(i + 1, Ordering::Release);
                }
            });
        }
        // Let the writers get going, then snapshot while they run.
        while done[0].load(Ordering::Acquire) < per_thread / 4 {
            std::thread::yield_now();
        }
        let completed: Vec<usize> = done.iter().map(|d| d.load(Ordering::Acquire)).collect();
        (snap(&tree), completed)
    });
    let restored = PrefixTree::read_snapshot(&bytes[..]).unwrap();
    restored.check_invariants().unwrap();
    let rids: Vec<TenantId> = (0..4)
        .map(|i| restored.tenant_id(&format!("t{i}")).unwrap())
        .collect();
    assert_eq!(rids, ids);
    for (th, plan) in texts.iter().enumerate() {
        for (text, t) in &plan[..completed[th]] {
            let m = restored.prefix_match(text, Some(&[rids[*t]]));
            assert_eq!(m.matched_chars, text.chars().count(), "{text:?} of t{t}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Hostile input
// ---------------------------------------------------------------------------------------------

fn small() -> (PrefixTree, Vec<u8>) {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("hello world", a, 1).unwrap();
    tree.insert_at("hello there", b, 2).unwrap();
    tree.insert_at("héllo 🙂", a, 3).unwrap();
    let bytes = snap(&tree);
    (tree, bytes)
}

fn restore(b: &[u8]) -> Result<PrefixTree, SnapshotError> {
    let r = PrefixTree::read_snapshot(b);
    if let Ok(t) = &r {
        t.check_invariants().unwrap();
    }
    r
}

#[test]
fn every_truncation_is_an_error() {
    let (_, bytes) = small();
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
fn every_flipped_byte_is_an_error() {
    let (_, bytes) = small();
    for i in 0..bytes.len() {
        for bit in [0x01u8, 0x80] {
            let mut b = bytes.clone();
            b[i] ^= bit;
            // Whatever the flip breaks (header, a length, a payload, the checksum), restoring
            // reports it; if a flip of a length still frames, the checksum catches it.
            let e = restore(&b)
                .err()
                .unwrap_or_else(|| panic!("flip {i}/{bit}: restored"));
            let _ = e.to_string();
        }
    }
}

#[test]
fn header_errors_name_what_is_wrong() {
    let (_, bytes) = small();
    assert!(matches!(
        restore(b"not a snapshot at all"),
        Err(SnapshotError::NotASnapshot)
    ));
    assert!(matches!(restore(b""), Err(SnapshotError::NotASnapshot)));
    let mut v = bytes.clone();
    v[8..10].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    match restore(&v) {
        Err(SnapshotError::UnsupportedVersion { found }) => assert_eq!(found, FORMAT_VERSION + 1),
        other => panic!("{other:?}"),
    }
    let mut k = bytes.clone();
    k[10] = 2;
    match restore(&k) {
        Err(SnapshotError::WrongKind { expected, found }) => {
            assert_eq!(expected, SnapshotKind::PrefixTree);
            assert_eq!(found, Some(SnapshotKind::BlockIndex));
        }
        other => panic!("{other:?}"),
    }
    k[10] = 77;
    assert!(matches!(
        restore(&k),
        Err(SnapshotError::WrongKind { found: None, .. })
    ));
    let mut c = bytes.clone();
    let last = c.len() - 1;
    c[last] ^= 1;
    assert!(matches!(
        restore(&c),
        Err(SnapshotError::ChecksumMismatch { .. })
    ));
}

/// Builds snapshots by hand, with a correct checksum, to reach the structural checks.
struct Hand {
    out: Vec<u8>,
    records: u64,
}

impl Hand {
    fn new() -> Self {
        Self::with_version(FORMAT_VERSION)
    }
    fn with_version(version: u16) -> Self {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&version.to_le_bytes());
        out.push(1);
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
    fn meta(self, tenants: u32, slots: u32) -> Self {
        let mut p = 5u64.to_le_bytes().to_vec();
        p.extend_from_slice(&tenants.to_le_bytes());
        p.extend_from_slice(&slots.to_le_bytes());
        self.record(1, &p)
    }
    fn tenant(self, slot: u32, gen: u32, name: &str) -> Self {
        let mut p = slot.to_le_bytes().to_vec();
        p.extend_from_slice(&gen.to_le_bytes());
        p.extend_from_slice(&0u64.to_le_bytes());
        p.extend_from_slice(&(name.len() as u32).to_le_bytes());
        p.extend_from_slice(name.as_bytes());
        self.record(2, &p)
    }
    /// The slots record (format version 2 on): every slot's generation.
    fn slots(self, gens: &[u32]) -> Self {
        let p: Vec<u8> = gens.iter().flat_map(|g| g.to_le_bytes()).collect();
        self.record(4, &p)
    }
    fn node(self, edge: &[u8], owners: &[(u32, u64)], children: u32) -> Self {
        let mut p = (edge.len() as u32).to_le_bytes().to_vec();
        p.extend_from_slice(edge);
        p.extend_from_slice(&(owners.len() as u32).to_le_bytes());
        for &(s, t) in owners {
            p.extend_from_slice(&s.to_le_bytes());
            p.extend_from_slice(&t.to_le_bytes());
        }
        p.extend_from_slice(&children.to_le_bytes());
        self.record(3, &p)
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

fn base() -> Hand {
    Hand::new().meta(1, 1).tenant(0, 1, "a").slots(&[1])
}

#[test]
fn a_hand_built_snapshot_restores() {
    let b = base()
        .node(b"", &[(0, 0)], 2)
        .node(b"ab", &[(0, 3)], 1)
        .node(b"c", &[(0, 3)], 0)
        .node("é".as_bytes(), &[(0, 1)], 0)
        .finish();
    let t = restore(&b).unwrap();
    let a = t.tenant_id("a").unwrap();
    assert_eq!(t.char_count(a), Some(4));
    assert_eq!(t.prefix_match("abc", None).matched_chars, 3);
}

#[test]
fn a_version_1_snapshot_restores() {
    // Version 1 has no slots record: a free slot starts again at generation 0.
    let b = Hand::with_version(1)
        .meta(1, 2)
        .tenant(1, 3, "b")
        .node(b"", &[(1, 0)], 1)
        .node(b"hello", &[(1, 4)], 0)
        .finish();
    let t = restore(&b).unwrap();
    let b_id = t.tenant_id("b").unwrap();
    assert_eq!((b_id.slot(), b_id.generation()), (1, 3));
    assert_eq!(t.char_count(b_id), Some(5));
    let c = t.add_tenant("c");
    // The free slot is reused with the restored tree's first generation (odd, and not b's).
    assert_eq!((c.slot(), c.generation() & 1), (0, 1));
    assert_ne!(c, b_id);
}

#[test]
fn a_removed_tenants_id_stays_stale_after_a_restore() {
    let t = PrefixTree::new();
    let a = t.add_tenant("a");
    let b = t.add_tenant("b");
    let _c = t.add_tenant("c");
    t.insert_at("hello", a, 1).unwrap();
    t.insert_at("help", b, 2).unwrap();
    assert_eq!(t.remove_tenant(b), 4); // "hel" and "p"
    let mut bytes = Vec::new();
    t.write_snapshot(&mut bytes).unwrap();
    let r = restore(&bytes).unwrap();
    assert_eq!(r.char_count(b), None);
    // The new tenant takes b's free slot, with a generation b never had.
    let d = r.add_tenant("d");
    assert_eq!(d.slot(), b.slot());
    assert_ne!(d, b);
    assert_eq!(r.char_count(b), None);
    assert_eq!(r.tenant_name(b), None);
    assert!(r.insert_at("hey", b, 3).is_err());
    assert_eq!(r.char_count(d), Some(0));
    // And again through a second snapshot of the restored tree, b's slot now live.
    let e = r.tenant_id("c").unwrap();
    assert_eq!(r.remove_tenant(e), 0);
    let mut again = Vec::new();
    r.write_snapshot(&mut again).unwrap();
    let r2 = restore(&again).unwrap();
    let f = r2.add_tenant("f");
    assert_eq!(f.slot(), e.slot());
    assert_ne!(f, e);
    assert_eq!(r2.tenant_id("d"), Some(d));
    assert_eq!(r2.char_count(e), None);
}

#[test]
fn trees_restored_from_one_snapshot_issue_different_ids() {
    let t = PrefixTree::new();
    let _a = t.add_tenant("a");
    let b = t.add_tenant("b");
    t.insert_at("hello", b, 1).unwrap();
    t.remove_tenant(b);
    let bytes = snap(&t);
    // Two routers warm-started from one snapshot each add a tenant on b's free slot.
    let (r1, r2) = (restore(&bytes).unwrap(), restore(&bytes).unwrap());
    let (p, q) = (r1.add_tenant("p"), r2.add_tenant("q"));
    assert_eq!((p.slot(), q.slot()), (b.slot(), b.slot()));
    assert_ne!(p, q);
    assert!(p != b && q != b);
    // An id of one is unknown to the other, which changes nothing.
    assert_eq!(r2.insert_at("secret", p, 5), Err(Error::UnknownTenant(p)));
    assert_eq!(r1.insert_at("secret", q, 5), Err(Error::UnknownTenant(q)));
    assert_eq!((r1.char_count(p), r2.char_count(q)), (Some(0), Some(0)));
    assert_eq!(r2.prefix_match("secret", None).matched_chars, 0);
}

#[test]
fn free_slots_restore_as_generations_only() {
    let free = 4_096u32;
    let mut gens = vec![2u32; free as usize + 1];
    gens[0] = 1;
    let many = Hand::new()
        .meta(1, free + 1)
        .tenant(0, 1, "a")
        .slots(&gens)
        .node(b"", &[(0, 0)], 0)
        .finish();
    let one = base().node(b"", &[(0, 0)], 0).finish();
    let (many, one) = (restore(&many).unwrap(), restore(&one).unwrap());
    many.check_invariants().unwrap();
    // A free slot costs its entry in the slot table, not a tenant's state (128 bytes and an
    // LRU each: a small file asked for 35 times its size).
    let extra = many.stats().heap_bytes - one.stats().heap_bytes;
    assert!(
        extra < free as usize * 32,
        "{extra} heap bytes for {free} free slots"
    );
    // A tenant added later gets a state on its slot as usual.
    let z = many.add_tenant("z");
    assert!(z.slot() >= 1 && z.slot() <= free as usize);
    many.insert_at("zebra", z, 1).unwrap();
    assert_eq!(many.char_count(z), Some(5));
    many.check_invariants().unwrap();
}

#[test]
fn structural_errors_are_invalid_not_panics() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("no meta", Hand::new().finish()),
        ("node first", Hand::new().node(b"", &[], 0).finish()),
        (
            "too many tenants",
            Hand::new().meta(u32::MAX, u32::MAX).finish(),
        ),
        (
            "tenant beyond slots",
            Hand::new().meta(1, 1).tenant(5, 1, "a").finish(),
        ),
        (
            "even generation",
            Hand::new().meta(1, 1).tenant(0, 2, "a").finish(),
        ),
        (
            "duplicate name",
            Hand::new()
                .meta(2, 2)
                .tenant(0, 1, "a")
                .tenant(1, 1, "a")
                .finish(),
        ),
        (
            "fewer tenants",
            Hand::new().meta(2, 2).tenant(0, 1, "a").finish(),
        ),
        (
            "root with an edge",
            base().node(b"x", &[(0, 0)], 0).finish(),
        ),
        (
            "root not owned by the tenants",
            base().node(b"", &[], 0).finish(),
        ),
        (
            "unknown owner",
            base()
                .node(b"", &[(0, 0)], 1)
                .node(b"ab", &[(0, 1), (3, 1)], 0)
                .finish(),
        ),
        (
            "owner-less node",
            base().node(b"", &[(0, 0)], 1).node(b"ab", &[], 0).finish(),
        ),
        (
            "empty edge",
            base()
                .node(b"", &[(0, 0)], 1)
                .node(b"", &[(0, 1)], 0)
                .finish(),
        ),
        (
            "bad UTF-8",
            base()
                .node(b"", &[(0, 0)], 1)
                .node(&[0xC3], &[(0, 1)], 0)
                .finish(),
        ),
        (
            "duplicate child key",
            base()
                .node(b"", &[(0, 0)], 2)
                .node(b"ab", &[(0, 1)], 0)
                .node(b"ac", &[(0, 1)], 0)
                .finish(),
        ),
        (
            "prefix closure",
            Hand::new()
                .meta(2, 2)
                .tenant(0, 1, "a")
                .tenant(1, 1, "b")
                .slots(&[1, 1])
                .node(b"", &[(0, 0), (1, 0)], 1)
                .node(b"ab", &[(0, 1)], 1)
                .node(b"c", &[(1, 1)], 0)
                .finish(),
        ),
        (
            "unsorted owners",
            Hand::new()
                .meta(2, 2)
                .tenant(0, 1, "a")
                .tenant(1, 1, "b")
                .slots(&[1, 1])
                .node(b"", &[(1, 0), (0, 0)], 0)
                .finish(),
        ),
        (
            "ends inside the tree",
            base()
                .node(b"", &[(0, 0)], 3)
                .node(b"ab", &[(0, 1)], 0)
                .finish(),
        ),
        (
            "node after the tree",
            base()
                .node(b"", &[(0, 0)], 0)
                .node(b"ab", &[(0, 1)], 0)
                .finish(),
        ),
        (
            "unknown tag",
            base().node(b"", &[(0, 0)], 1).record(9, b"").finish(),
        ),
        (
            "no slots record",
            Hand::new()
                .meta(1, 1)
                .tenant(0, 1, "a")
                .node(b"", &[(0, 0)], 0)
                .finish(),
        ),
        (
            "a tenant's generation differs in the slots record",
            Hand::new()
                .meta(1, 1)
                .tenant(0, 1, "a")
                .slots(&[3])
                .node(b"", &[(0, 0)], 0)
                .finish(),
        ),
        (
            "a free slot with a live generation",
            Hand::new()
                .meta(1, 2)
                .tenant(0, 1, "a")
                .slots(&[1, 5])
                .node(b"", &[(0, 0)], 0)
                .finish(),
        ),
        (
            "a slots record one slot short",
            Hand::new()
                .meta(1, 2)
                .tenant(0, 1, "a")
                .slots(&[1])
                .node(b"", &[(0, 0)], 0)
                .finish(),
        ),
        (
            "a slots record one slot long",
            Hand::new()
                .meta(1, 1)
                .tenant(0, 1, "a")
                .slots(&[1, 2])
                .node(b"", &[(0, 0)], 0)
                .finish(),
        ),
        (
            "trailing bytes",
            base()
                .record(
                    3,
                    &[
                        0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9,
                    ],
                )
                .finish(),
        ),
    ];
    for (what, b) in cases {
        match restore(&b) {
            Err(SnapshotError::Invalid { reason, .. }) => assert!(!reason.is_empty(), "{what}"),
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// A format version below the oldest this crate reads is unsupported, as one above the
/// newest: not read as the oldest layout.
#[test]
fn a_version_below_the_oldest_is_unsupported() {
    let old = OLDEST_FORMAT_VERSION - 1;
    // The layout of version 1 (no slots record), which would restore as such.
    let b = Hand::with_version(old)
        .meta(1, 1)
        .tenant(0, 1, "a")
        .node(b"", &[(0, 0)], 0)
        .finish();
    match restore(&b) {
        Err(SnapshotError::UnsupportedVersion { found }) => assert_eq!(found, old),
        other => panic!("{other:?}"),
    }
}

/// The end record counts the records before it: a count one short or one long of what was
/// read is invalid, even with a checksum that matches.
#[test]
fn an_end_record_that_miscounts_the_records_is_invalid() {
    for delta in [-1i64, 1] {
        let mut h = base().node(b"", &[(0, 0)], 1).node(b"ab", &[(0, 1)], 0);
        h.records = h.records.wrapping_add_signed(delta);
        match restore(&h.finish()) {
            Err(SnapshotError::Invalid { reason, .. }) => {
                assert!(reason.contains("end record"), "{delta}: {reason}")
            }
            other => panic!("{delta}: {other:?}"),
        }
    }
}

/// A tenant's slot must be below the slots in use (the meta record's count): a tenant on
/// the slot just past them is invalid, not a panic.
#[test]
fn a_tenant_on_the_slot_past_those_in_use_is_invalid() {
    let b = Hand::new()
        .meta(1, 1)
        .tenant(1, 1, "a")
        .slots(&[0])
        .node(b"", &[(1, 0)], 0)
        .finish();
    match restore(&b) {
        Err(SnapshotError::Invalid { reason, .. }) => {
            assert!(reason.contains("slot 1"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// A node lists each owner once (slots strictly ascending): an owner listed twice is
/// invalid.
#[test]
fn an_owner_listed_twice_is_invalid() {
    let b = base()
        .node(b"", &[(0, 0)], 1)
        .node(b"ab", &[(0, 1), (0, 1)], 0)
        .finish();
    match restore(&b) {
        Err(SnapshotError::Invalid { reason, .. }) => {
            assert!(reason.contains("ascending"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn absurd_lengths_cost_nothing() {
    // A record that claims 2 GiB with only a few bytes behind it: truncated, after reading
    // only what is there.
    let b = base().raw_record(3, 1 << 31, b"abc").finish();
    assert!(matches!(restore(&b), Err(SnapshotError::Truncated { .. })));
    // The largest length a record can state (4 GiB − 1), with nothing behind it: the same.
    let b = base().raw_record(3, u32::MAX, b"").finish();
    assert!(matches!(restore(&b), Err(SnapshotError::Truncated { .. })));
    // Counts far beyond the payload.
    let b = base()
        .node(b"", &[(0, 0)], u32::MAX)
        .record(3, &[255, 255, 255, 255])
        .finish();
    assert!(restore(&b).is_err());
    // A wrong record count in the end record.
    let mut h = base().node(b"", &[(0, 0)], 0);
    h.records += 1;
    assert!(matches!(
        restore(&h.finish()),
        Err(SnapshotError::Invalid { .. })
    ));
}

#[test]
fn deep_trees_restore_without_recursion() {
    // A chain of 20,000 nested single-char edges (each a node): the restore's stack is data.
    let depth = if cfg!(miri) {
        50
    } else if cfg!(debug_assertions) {
        4_000
    } else {
        20_000
    };
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let mut s = String::new();
    for i in 0..depth {
        s.push(if i % 2 == 0 { 'a' } else { 'b' });
        tree.insert_at(&s, a, i as u64).unwrap();
    }
    let restored = PrefixTree::read_snapshot(&snap(&tree)[..]).unwrap();
    restored.check_invariants().unwrap();
    assert_eq!(restored.char_count(a), Some(depth));
    let mut m = PrefixMatch::default();
    restored.prefix_match_into(&s, None, &mut m);
    assert_eq!(m.matched_chars, depth);
    // The plain data of such a tree is as safe to handle: cloned, compared, formatted and
    // taken apart on a thread whose stack a recursion over 20,000 levels would overflow.
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            let plain = tree.snapshot();
            let copy = plain.clone();
            assert!(copy == plain);
            let again = restored.snapshot();
            assert!(again == plain);
            again.drop_flat();
            let text = format!("{plain:?}");
            assert_eq!(text.matches("NodeSnapshot {").count(), depth + 1);
            assert!(text.starts_with("NodeSnapshot { text: \"\", tenants: [(TenantId("));
            let mut deepest = &copy;
            while let Some(c) = deepest.children.first() {
                deepest = c;
            }
            assert_eq!(deepest.text, if depth % 2 == 1 { "a" } else { "b" });
            // Dropped as the type's docs say (the compiler's drop recurses per level).
            copy.drop_flat();
            plain.drop_flat();
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn a_snapshots_plain_data_formats_clones_and_compares_like_its_fields() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("hello", a, 1).unwrap();
    tree.insert_at("help", b, 2).unwrap();
    tree.insert_at("hi", b, 3).unwrap();
    let plain = tree.snapshot();
    let copy = plain.clone();
    assert!(copy == plain);
    let mut other = plain.clone();
    other.children[0].children[1].tenants[0].1 += 1;
    assert!(other != plain);
    let mut shorter = plain.clone();
    shorter.children[0].children.pop();
    assert!(shorter != plain);
    // The derived format, on one line.
    let (ta, tb) = (format!("{a:?}"), format!("{b:?}"));
    let leaf = |text: &str, owners: String| {
        format!("NodeSnapshot {{ text: {text:?}, tenants: [{owners}], children: [] }}")
    };
    let expected = format!(
        "NodeSnapshot {{ text: \"\", tenants: [({ta}, 1), ({tb}, 3)], children: [\
         NodeSnapshot {{ text: \"h\", tenants: [({ta}, 1), ({tb}, 3)], children: [\
         NodeSnapshot {{ text: \"el\", tenants: [({ta}, 1), ({tb}, 2)], children: [{}, {}] }}, \
         {}] }}] }}",
        leaf("lo", format!("({ta}, 1)")),
        leaf("p", format!("({tb}, 2)")),
        leaf("i", format!("({tb}, 3)")),
    );
    assert_eq!(format!("{plain:?}"), expected);
    assert_eq!(format!("{plain:#?}"), expected);
}
