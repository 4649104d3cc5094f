//! Multi-threaded stress: several threads mix inserts, matches, removals and evictions; at
//! quiescence the invariants hold exactly, and removing every tenant empties the tree.
#![cfg(not(loom))]

use kvtrie::workload::SplitMix64;
use kvtrie::{EvictionConfig, PrefixTree, TenantId};
use std::sync::atomic::{AtomicUsize, Ordering};
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
                        _ => {
                            tree.remove_tenant(t);
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
