//! Tear-down paths, for the sanitizer and miri stages of `ci/verify.sh` (and plain runs):
//! dropping a tree whose background eviction thread ran (stopped first, or outliving the
//! tree), and dropping trees and block indexes while retired nodes and tables are still
//! waiting in the epoch reclaimer, whose destructors then run after the owner is gone.
//!
//! Under AddressSanitizer a destructor that touches freed memory, a double free, or a node
//! freed twice (once by `Drop`, once by the reclaimer) is reported; LeakSanitizer (at exit)
//! reports anything neither `Drop` nor the reclaimer frees.
#![cfg(not(loom))]

use kvtrie::{BlockIndex, EvictionConfig, PrefixTree, StoredBlock, WorkerId};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn small() -> bool {
    cfg!(miri)
}

/// Prompts sharing prefixes, with multi-byte chars, so inserts split nodes and evictions prune.
fn prompt(i: usize) -> String {
    const HEADS: [&str; 3] = ["system: you are", "système: vous êtes", "🙂🙃 emoji"];
    let mut s = HEADS[i % 3].to_string();
    let mut x = i.wrapping_mul(2654435761);
    for _ in 0..(i % 7) {
        s.push(['a', 'é', 'è', '中'][x % 4]);
        x /= 4;
    }
    s
}

fn fill(tree: &PrefixTree, n: usize) {
    let tenants: Vec<_> = (0..3).map(|i| tree.add_tenant(&format!("r{i}"))).collect();
    for i in 0..n {
        tree.insert_at(&prompt(i), tenants[i % 3], i as u64)
            .unwrap();
    }
}

/// Waits (up to a minute) until the eviction thread brought every tenant to `threshold` chars
/// or fewer, and fails the test if it did not.
fn wait_for_eviction(tree: &PrefixTree, threshold: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let over = || {
        tree.tenants()
            .iter()
            .any(|&t| tree.char_count(t).unwrap() > threshold)
    };
    while over() {
        assert!(
            Instant::now() < deadline,
            "the eviction thread did not bring every tenant to {threshold} chars"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn drop_tree_after_eviction_thread_stopped() {
    let tree = Arc::new(PrefixTree::new());
    let handle = tree
        .start_eviction(EvictionConfig::new(40, 20, Duration::from_millis(1)))
        .unwrap();
    fill(&tree, if small() { 12 } else { 300 });
    wait_for_eviction(&tree, 40);
    assert_eq!(handle.panic_message(), None);
    handle.stop();
    tree.check_invariants().unwrap();
    drop(tree);
}

#[test]
fn drop_tree_while_eviction_thread_running() {
    // The handle outlives the tree: the thread holds only a weak reference and the last
    // `Arc` is dropped here, while it may be mid-pass.
    let tree = Arc::new(PrefixTree::new());
    let handle = tree
        .start_eviction(
            EvictionConfig::new(40, 20, Duration::from_millis(1)).with_global_budget(100, 60),
        )
        .unwrap();
    fill(&tree, if small() { 12 } else { 300 });
    wait_for_eviction(&tree, 40);
    assert_eq!(handle.panic_message(), None);
    drop(tree);
    drop(handle);
}

#[test]
fn drop_tree_with_pending_garbage() {
    // A worker thread splits and prunes (retiring nodes, owner tables, child tables and, by
    // removing and re-adding tenants, grows and recycles the slot table), never collecting.
    // It exits (its retired objects move to the global queue), the tree is dropped, and only
    // then another thread's collection runs the destructors.
    let n = if small() { 10 } else { 400 };
    for round in 0..if small() { 1 } else { 5 } {
        let tree = Arc::new(PrefixTree::new());
        let t2 = tree.clone();
        std::thread::spawn(move || {
            fill(&t2, n);
            for name in ["r0", "r1"] {
                let t = t2.tenant_id(name).unwrap();
                t2.remove_tenant(t);
            }
            for i in 0..70 {
                t2.add_tenant(&format!("extra{i}"));
            }
            let r2 = t2.tenant_id("r2").unwrap();
            t2.evict_tenant_by_lru(r2, 10 + round);
        })
        .join()
        .unwrap();
        tree.check_invariants().unwrap();
        drop(tree);
        let other = PrefixTree::new();
        other.collect_garbage();
        other.collect_garbage();
    }
}

#[test]
fn drop_block_index_with_pending_garbage() {
    let n = if small() { 20 } else { 2000 };
    let index = Arc::new(BlockIndex::new());
    let i2 = index.clone();
    std::thread::spawn(move || {
        for w in 0..3u64 {
            let blocks: Vec<StoredBlock> = (0..n as u64)
                .map(|i| StoredBlock {
                    engine_hash: i + 1,
                    local_hash: i * 7 + w,
                })
                .collect();
            i2.store_blocks(WorkerId(w), None, &blocks).unwrap();
        }
        i2.remove_worker(WorkerId(0));
        i2.remove_blocks(WorkerId(1), &(1..=n as u64).collect::<Vec<_>>());
    })
    .join()
    .unwrap();
    assert_eq!(index.total_blocks(), n);
    drop(index);
    let other = BlockIndex::new();
    other.collect_garbage();
    other.collect_garbage();
}
