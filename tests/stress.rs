//! Multi-threaded stress: several threads mix inserts, matches, removals and evictions; at
//! quiescence the invariants hold exactly, and removing every tenant empties the tree.
#![cfg(not(loom))]

use kvtrie::workload::SplitMix64;
use kvtrie::{EvictionConfig, PrefixTree, TenantId};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const THREADS: usize = 4;

fn ops() -> usize {
    if cfg!(miri) {
        60
    } else {
        20_000
    }
}

/// Prompts over a few shared prefixes with multi-byte chars, so threads split the same nodes.
fn prompt(r: &mut SplitMix64) -> String {
    const PREFIXES: [&str; 4] = [
        "system: you are",
        "système: vous êtes",
        "系统：你是",
        "🙂🙃 emoji",
    ];
    let mut s = PREFIXES[r.below(4) as usize].to_string();
    for _ in 0..r.below(12) {
        s.push(['a', 'b', 'é', 'è', '中', '🙂'][r.below(6) as usize]);
    }
    s
}

#[test]
fn mixed_operations_keep_invariants() {
    let tree = Arc::new(PrefixTree::new());
    let names: Vec<String> = (0..6).map(|i| format!("r{i}")).collect();
    for n in &names {
        tree.add_tenant(n);
    }
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|th| {
            let tree = tree.clone();
            let names = names.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut r = SplitMix64::new(th as u64 + 1);
                barrier.wait();
                let mut matched = 0usize;
                for i in 0..ops() {
                    let name = &names[r.below(names.len() as u64) as usize];
                    let t = tree.add_tenant(name);
                    match r.below(100) {
                        0..=39 => {
                            // Stale ids are fine: the tenant may have been removed meanwhile.
                            let _ = tree.insert_at(&prompt(&mut r), t, i as u64);
                        }
                        40..=86 => {
                            let m = tree.prefix_match(&prompt(&mut r), None);
                            matched += m.matched_chars;
                        }
                        87..=89 => {
                            // A chunked scan of the node ids beside the writers (ASan and miri
                            // check it never reads a freed node or table).
                            // Each node counted gives its chars, bytes and allocation
                            // together, so the sums keep their order whatever moved.
                            let s = tree.stats();
                            assert!(s.tenants <= names.len(), "{s:?}");
                            assert!(s.chars <= s.bytes && s.bytes < s.heap_bytes, "{s:?}");
                        }
                        90..=95 => {
                            tree.evict_tenant_by_lru(t, 1 + r.below(20) as usize);
                        }
                        96..=97 => {
                            tree.remove_tenant(t);
                        }
                        _ => {
                            // A batch with another tenant, and `t` again (removed once).
                            let u = tree.add_tenant(&names[r.below(names.len() as u64) as usize]);
                            let removed = tree.remove_tenants(&[t, u, t]);
                            assert_eq!(removed[2], 0, "{removed:?}");
                        }
                    }
                }
                matched
            })
        })
        .collect();
    let matched: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(matched > 0, "the matches found something");
    tree.check_invariants().unwrap();
    tree.collect_garbage();
    for t in tree.tenants() {
        tree.remove_tenant(t);
    }
    assert_eq!(tree.node_count(), 0);
    assert_eq!(tree.distinct_chars(), 0);
    tree.check_invariants().unwrap();
}

/// Evicting "everything" of a tenant ends while another thread keeps inserting for it (the
/// eviction runs in batches with the tenant's LRU lock free in between, so it is capped at what
/// the tenant owned when it began); each call evicts at least that much unless the tenant ran
/// out, and the accounting stays exact.
#[test]
fn evicting_everything_ends_while_inserts_continue() {
    let tree = Arc::new(PrefixTree::new());
    let t = tree.add_tenant("r0");
    let other = tree.add_tenant("r1");
    let mut r = SplitMix64::new(5);
    for i in 0..ops() as u64 {
        tree.insert_at(&prompt(&mut r), if i % 3 == 0 { other } else { t }, i)
            .unwrap();
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let inserter = s.spawn(|| {
            let mut r = SplitMix64::new(6);
            let mut i = ops() as u64;
            while !stop.load(Ordering::Relaxed) {
                tree.insert_at(&prompt(&mut r), t, i).unwrap();
                i += 1;
            }
        });
        let mut evicted = 0;
        for _ in 0..if cfg!(miri) { 2 } else { 50 } {
            evicted += tree.evict_tenant_by_lru(t, usize::MAX);
        }
        stop.store(true, Ordering::Relaxed);
        inserter.join().unwrap();
        assert!(evicted > 0);
    });
    tree.check_invariants().unwrap();
    // The other tenant was never evicted.
    assert!(tree.char_count(other).unwrap() > 0);
    let rest = tree.char_count(t).unwrap();
    assert_eq!(tree.evict_tenant_by_lru(t, usize::MAX), rest);
    assert_eq!(tree.char_count(t), Some(0));
    tree.check_invariants().unwrap();
}

#[test]
fn lock_free_inserts_race_with_structural_writers() {
    // Half the threads re-insert existing paths (lock-free timestamp raises), half split and
    // prune the same nodes; timestamps must never be lost or attached to the wrong owner.
    let tree = Arc::new(PrefixTree::new());
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    let base = ["abcdefgh", "abcdxyz", "ab🙂cd"];
    for (i, s) in base.iter().enumerate() {
        tree.insert_at(s, a, i as u64).unwrap();
    }
    let n = ops();
    let handles: Vec<_> = (0..THREADS)
        .map(|th| {
            let tree = tree.clone();
            std::thread::spawn(move || {
                let mut r = SplitMix64::new(100 + th as u64);
                for i in 0..n {
                    let s = base[r.below(3) as usize];
                    if th % 2 == 0 {
                        tree.insert_at(s, a, 10 + i as u64).unwrap();
                    } else {
                        let cut = 1 + r.below(s.chars().count() as u64) as usize;
                        let p: String = s.chars().take(cut).collect();
                        tree.insert_at(&p, b, i as u64).unwrap();
                        if r.below(4) == 0 {
                            tree.evict_tenant_by_lru(b, 1 + r.below(5) as usize);
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    tree.check_invariants().unwrap();
    assert_eq!(tree.char_count(a), Some(14));
    // Every node of `a` was raised by the last round of inserts of a thread: the final
    // timestamps are the largest ones written for paths through them.
    fn max_ts(s: &kvtrie::NodeSnapshot, t: TenantId) -> u64 {
        s.tenants
            .iter()
            .filter(|x| x.0 == t)
            .map(|x| x.1)
            .max()
            .unwrap_or(0)
    }
    let snap = tree.snapshot();
    assert!(max_ts(&snap, a) >= 10 + n as u64 - 1 - 3 * THREADS as u64);
}

/// Many distinct first chars under one node: writers add children to the same node (in place
/// while its table has room, by a grown copy otherwise, sorted once it passes 64), while a
/// reader checks that a child, once seen, stays found and whole, and that a walk over the tree
/// (a snapshot) lists every child seen so far, once.
#[test]
fn wide_node_children_added_in_place_race_readers() {
    let width = if cfg!(miri) { 24 } else { 300 };
    // ASCII and multi-byte first chars (keys of 1 to 3 bytes).
    let chars: Vec<char> = ('!'..='~')
        .chain('À'..='ÿ')
        .chain('一'..='龥')
        .take(width)
        .collect();
    let tree = Arc::new(PrefixTree::new());
    let a = tree.add_tenant("a");
    tree.insert_at("p", a, 0).unwrap();
    let writers = THREADS - 1;
    let done = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..THREADS)
        .map(|th| {
            let tree = tree.clone();
            let chars = chars.clone();
            let done = done.clone();
            std::thread::spawn(move || {
                if th == writers {
                    // The reader, until every writer is done and a last pass saw everything.
                    let mut seen = vec![false; chars.len()];
                    loop {
                        let last = done.load(Ordering::Acquire) == writers;
                        for (i, c) in chars.iter().enumerate() {
                            let m = tree.prefix_match(&format!("p{c}x"), None);
                            match m.matched_chars {
                                3 => seen[i] = true,
                                1 => assert!(!seen[i], "child {c:?} lost after it was seen"),
                                n => panic!("{c:?}: matched {n} chars"),
                            }
                        }
                        let snap = tree.snapshot();
                        let p = &snap.children[0];
                        let mut listed: Vec<&str> =
                            p.children.iter().map(|c| c.text.as_str()).collect();
                        let n = listed.len();
                        listed.dedup();
                        assert_eq!(listed.len(), n, "a child listed twice");
                        for (i, c) in chars.iter().enumerate() {
                            if seen[i] {
                                assert!(listed.contains(&format!("{c}x").as_str()), "{c:?}");
                            }
                        }
                        if last {
                            return seen;
                        }
                    }
                }
                // Counts this writer done even if it panics (the reader then ends too, and
                // the join reports the panic).
                struct Done(Arc<AtomicUsize>);
                impl Drop for Done {
                    fn drop(&mut self) {
                        self.0.fetch_add(1, Ordering::Release);
                    }
                }
                let _done = Done(done);
                // Each writer adds its share of the chars, in a shuffled order.
                let mut mine: Vec<char> = chars.iter().copied().skip(th).step_by(writers).collect();
                let mut r = SplitMix64::new(7 + th as u64);
                for i in (1..mine.len()).rev() {
                    mine.swap(i, r.below(i as u64 + 1) as usize);
                }
                for (i, c) in mine.iter().enumerate() {
                    tree.insert_at(&format!("p{c}x"), a, 1 + i as u64).unwrap();
                }
                Vec::new()
            })
        })
        .collect();
    let mut results: Vec<Vec<bool>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let seen = results.pop().expect("the reader's");
    assert!(
        seen.iter().all(|&s| s),
        "the reader's last pass missed a child"
    );
    tree.check_invariants().unwrap();
    assert_eq!(tree.char_count(a), Some(1 + 2 * width));
    assert_eq!(tree.node_count(), 1 + width);
}

#[test]
fn background_eviction_under_load_respects_thresholds() {
    let tree = Arc::new(PrefixTree::new());
    let names: Vec<String> = (0..4).map(|i| format!("r{i}")).collect();
    let tids: Vec<TenantId> = names.iter().map(|n| tree.add_tenant(n)).collect();
    let (threshold, target) = (300, 200);
    let handle = tree
        .start_eviction(EvictionConfig::new(
            threshold,
            target,
            Duration::from_millis(1),
        ))
        .unwrap();
    let workers: Vec<_> = (0..3)
        .map(|th| {
            let tree = tree.clone();
            let tids = tids.clone();
            std::thread::spawn(move || {
                let mut r = SplitMix64::new(7 + th);
                for i in 0..ops() / 2 {
                    let t = tids[r.below(4) as usize];
                    if r.below(2) == 0 {
                        tree.insert(&prompt(&mut r), t).unwrap();
                    } else {
                        tree.prefix_match(&prompt(&mut r), None);
                    }
                    let _ = i;
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    // Wait (generous deadline, never asserting on time) for a pass after the last insert.
    let deadline = Instant::now() + Duration::from_secs(60);
    while tids
        .iter()
        .any(|&t| tree.char_count(t).unwrap() > threshold)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(2));
    }
    handle.stop();
    tree.check_invariants().unwrap();
    for &t in &tids {
        assert!(
            tree.char_count(t).unwrap() <= threshold,
            "{t:?} above threshold"
        );
    }
}

/// Routes (match, choose, insert in one descent) over a two-letter alphabet, so that threads
/// split and extend the same nodes, while the router's eviction thread evicts every 1 ms:
/// once routing ends and the eviction is stopped, the invariants hold exactly.
#[test]
fn routes_race_the_routers_background_eviction() {
    use kvtrie::router::{Candidate, PrefixAffinityConfig, PrefixAffinityRouter};
    let rounds = if cfg!(miri) { 1 } else { 8 };
    for round in 0..rounds {
        let router = PrefixAffinityRouter::new(PrefixAffinityConfig {
            eviction: Some(EvictionConfig::new(300, 150, Duration::from_millis(1))),
            ..PrefixAffinityConfig::default()
        });
        let ids = router.update_replicas(&["r0", "r1", "r2", "r3", "r4", "r5"]);
        std::thread::scope(|s| {
            for th in 0..THREADS as u64 {
                let (router, ids) = (&router, &ids);
                s.spawn(move || {
                    let mut r = SplitMix64::new(round * 100 + th);
                    for _ in 0..ops() / 20 {
                        let p: String = (0..r.below(41))
                            .map(|_| if r.below(2) == 0 { 'a' } else { 'b' })
                            .collect();
                        let c: Vec<Candidate> = (0..3)
                            .map(|_| Candidate::new(ids[r.below(6) as usize], r.below(4) as usize))
                            .collect();
                        router.route(&p, &c).unwrap();
                    }
                });
            }
        });
        assert!(router.is_evicting());
        router.stop_eviction();
        assert!(!router.is_evicting());
        router
            .tree()
            .check_invariants()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// Protocols that cross each other (from a race review): tenant removal and slot reuse against
// in-flight inserts with stale ids (their undo), splits by other tenants, and LRU eviction;
// at quiescence the invariants hold and evicting everything of each tenant removes exactly
// what it owns (its LRU still reaches every one of its leaves) and empties the tree.
// ---------------------------------------------------------------------------------------------

/// `n` rounds or operations in an optimized build, an eighth (at least 1) in a debug build
/// (CI's test run and the sanitizer).
fn scaled(n: usize) -> usize {
    if cfg!(debug_assertions) {
        (n / 8).max(1)
    } else {
        n
    }
}

/// `n` times: removes a random one of `names` and adds it again (often after a collection, so
/// slots are reused), then `pause`s.
fn churn_tenants(tree: &PrefixTree, names: &[&str], seed: u64, n: usize, pause: impl Fn()) {
    let mut r = SplitMix64::new(seed);
    for _ in 0..n {
        let name = names[r.below(names.len() as u64) as usize];
        if let Some(t) = tree.tenant_id(name) {
            if r.below(2) == 0 {
                tree.remove_tenant(t);
            } else {
                // A batch listing `t` twice: removed once.
                assert_eq!(tree.remove_tenants(&[t, t])[1], 0);
            }
        }
        if r.below(2) == 0 {
            tree.collect_garbage();
        }
        tree.add_tenant(name);
        pause();
    }
}

/// Texts over a few shared prefixes, so that inserts of different tenants split each other's
/// edges at many points (ASCII and multi-byte chars).
fn split_text(r: &mut SplitMix64, k: u64) -> String {
    const P: [&str; 3] = ["common/", "commun/é", "com"];
    let mut s = P[r.below(3) as usize].to_string();
    s.push_str(&format!("{}", k % 7));
    for _ in 0..r.below(10) {
        s.push(['a', 'b', 'c', 'é', '中'][r.below(5) as usize]);
    }
    s
}

/// At quiescence: invariants hold, and evicting "everything" of each live tenant removes
/// exactly what it owns (its LRU reaches every one of its leaves) and leaves it owning nothing.
fn quiescent_checks(tree: &PrefixTree, what: &str) {
    tree.check_invariants()
        .unwrap_or_else(|e| panic!("{what}: invariant violated: {e}"));
    for t in tree.tenants() {
        let before = tree.char_count(t).unwrap();
        let got = tree.evict_tenant_by_lru(t, usize::MAX);
        let after = tree.char_count(t).unwrap();
        assert_eq!(
            (got, after),
            (before, 0),
            "{what}: {t:?} owned {before} chars; evicting everything removed {got} and left {after} (a leaf without an LRU entry?)"
        );
        tree.check_invariants()
            .unwrap_or_else(|e| panic!("{what}: after evicting {t:?}: {e}"));
    }
    assert_eq!(
        tree.node_count(),
        0,
        "{what}: nodes left after evicting everything"
    );
}

/// Tenant churn with slot reuse (remove, collect, re-add under the same names), inserts with
/// possibly stale ids (the undo path), splits by a stable tenant, and LRU evictions of the
/// churned tenants, all at once.
#[test]
fn slot_reuse_races_stale_inserts_splits_and_evictions() {
    let rounds = scaled(40);
    for round in 0..rounds {
        let tree = Arc::new(PrefixTree::new());
        let names = ["a", "b", "c"];
        for n in names {
            tree.add_tenant(n);
        }
        let u = tree.add_tenant("u");
        let stop = Arc::new(AtomicBool::new(false));
        let clock = Arc::new(AtomicU64::new(1));
        std::thread::scope(|s| {
            // Inserters for the churned tenants (ids looked up once per batch: often stale).
            for th in 0..2u64 {
                let (tree, stop, clock) = (&tree, &stop, &clock);
                s.spawn(move || {
                    let mut r = SplitMix64::new(round as u64 * 100 + th);
                    let mut k = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let Some(t) = tree.tenant_id(names[r.below(3) as usize]) else {
                            continue;
                        };
                        for _ in 0..8 {
                            k += 1;
                            let ts = clock.fetch_add(1, Ordering::Relaxed);
                            let _ = tree.insert_at(&split_text(&mut r, k), t, ts);
                        }
                        if r.below(4) == 0 {
                            tree.evict_tenant_by_lru(t, 1 + r.below(30) as usize);
                        }
                    }
                });
            }
            // The stable tenant splits their edges.
            {
                let (tree, stop, clock) = (&tree, &stop, &clock);
                s.spawn(move || {
                    let mut r = SplitMix64::new(round as u64 * 100 + 50);
                    let mut k = 0;
                    while !stop.load(Ordering::Relaxed) {
                        k += 1;
                        let mut t = split_text(&mut r, k);
                        let cut = 1 + r.below(t.chars().count() as u64) as usize;
                        t = t.chars().take(cut).collect();
                        t.push('Z');
                        let ts = clock.fetch_add(1, Ordering::Relaxed);
                        tree.insert_at(&t, u, ts).unwrap();
                        if r.below(8) == 0 {
                            tree.evict_tenant_by_lru(u, 1 + r.below(20) as usize);
                        }
                    }
                });
            }
            // The churner: removes and re-adds the tenants (slots reused after a grace period).
            churn_tenants(&tree, &names, round as u64 * 100 + 77, scaled(300), || {
                std::thread::yield_now()
            });
            stop.store(true, Ordering::Relaxed);
        });
        tree.collect_garbage();
        quiescent_checks(&tree, &format!("round {round}"));
    }
}

/// The same tenant inserts (extending and re-raising its own leaves) while it is evicted in
/// small amounts and another tenant splits its edges: at quiescence every leaf of both is in
/// their LRU.
#[test]
fn lru_reaches_every_leaf_after_self_inserts_splits_and_evictions() {
    for round in 0..scaled(20) {
        let tree = Arc::new(PrefixTree::new());
        let a = tree.add_tenant("a");
        let b = tree.add_tenant("b");
        let stop = AtomicBool::new(false);
        let clock = AtomicU64::new(1);
        std::thread::scope(|s| {
            for (th, t) in [(0u64, a), (1, a), (2, b)] {
                let (tree, stop, clock) = (&tree, &stop, &clock);
                s.spawn(move || {
                    let mut r = SplitMix64::new(round as u64 * 10 + th);
                    let mut k = 0;
                    while !stop.load(Ordering::Relaxed) {
                        k += 1;
                        // A few timestamps shared by many nodes (big groups), some repeated.
                        let ts = clock.load(Ordering::Relaxed) / 16;
                        clock.fetch_add(1, Ordering::Relaxed);
                        let mut x = split_text(&mut r, k);
                        if th == 2 {
                            let cut = 1 + r.below(x.chars().count() as u64) as usize;
                            x = x.chars().take(cut).collect();
                            x.push('Y');
                        }
                        tree.insert_at(&x, t, ts).unwrap();
                    }
                });
            }
            let mut r = SplitMix64::new(round as u64 * 10 + 9);
            for _ in 0..scaled(3000) {
                let t: TenantId = if r.below(3) == 0 { b } else { a };
                tree.evict_tenant_by_lru(t, 1 + r.below(40) as usize);
            }
            stop.store(true, Ordering::Relaxed);
        });
        quiescent_checks(&tree, &format!("round {round}"));
    }
}

/// The background thread (per-tenant and global budgets, 1 ms passes) runs beside inserts,
/// tenant churn with slot reuse and manual evictions; at quiescence the invariants hold and
/// every tenant's LRU still reaches all of its leaves.
#[test]
fn background_and_global_eviction_race_tenant_churn() {
    for round in 0..scaled(10) {
        let tree = Arc::new(PrefixTree::new());
        let names = ["a", "b", "c", "d"];
        for n in names {
            tree.add_tenant(n);
        }
        let handle = tree
            .start_eviction(
                EvictionConfig::new(120, 80, Duration::from_millis(1)).with_global_budget(300, 200),
            )
            .unwrap();
        let stop = AtomicBool::new(false);
        let clock = AtomicU64::new(1);
        std::thread::scope(|s| {
            for th in 0..2u64 {
                let (tree, stop, clock) = (&tree, &stop, &clock);
                s.spawn(move || {
                    let mut r = SplitMix64::new(round as u64 * 100 + th);
                    let mut k = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let Some(t) = tree.tenant_id(names[r.below(4) as usize]) else {
                            continue;
                        };
                        k += 1;
                        let ts = clock.fetch_add(1, Ordering::Relaxed);
                        let _ = tree.insert_at(&split_text(&mut r, k), t, ts);
                        if r.below(16) == 0 {
                            tree.evict_tenant_by_lru(t, 1 + r.below(30) as usize);
                        }
                    }
                });
            }
            churn_tenants(&tree, &names, round as u64 * 100 + 77, scaled(200), || {
                std::thread::sleep(Duration::from_micros(200))
            });
            stop.store(true, Ordering::Relaxed);
        });
        handle.stop();
        tree.collect_garbage();
        quiescent_checks(&tree, &format!("round {round}"));
    }
}
