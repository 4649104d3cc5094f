//! The tree's memory on the standard chat workloads: WORKLOADS.md budgets a W1 tree at 1.5
//! heap bytes per distinct text byte, and `stats().heap_bytes` is the figure the budget is
//! read from, so this also checks that figure against what the tree really allocates.
//!
//! Builds are single-threaded and deterministic (the same inserts, the same node ids, the
//! same table and LRU growth), so the figures are exact for a given version of the crate. One
//! test builds both workloads in turn: a counting global allocator sees the whole process, so
//! nothing else may allocate while a build is measured.
#![cfg(not(loom))]

use kvtrie::workload::{ChatWorkload, CountingAlloc};
use kvtrie::{PrefixTree, TenantId};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

/// Frees everything the tree retired: nothing else runs, so the epoch advances on every
/// collection.
fn drain(tree: &PrefixTree) {
    for _ in 0..100 {
        if tree.retired_backlog().objects == 0 {
            return;
        }
        tree.collect_garbage();
    }
    panic!("retired objects left: {:?}", tree.retired_backlog());
}

/// Builds the workload's tree the standard way (prompt `i` for tenant `i % tenants` at time
/// `i`); returns it with the bytes allocated before the build and the bytes the build left
/// allocated (negative if it freed more than it allocated).
fn build(w: &ChatWorkload) -> (PrefixTree, isize, isize) {
    // This thread's first pin registers it with the reclaimer: not part of the tree.
    let warm = PrefixTree::new();
    warm.insert("warm-up", warm.add_tenant("w")).unwrap();
    drain(&warm);
    drop(warm);
    let before = ALLOC.live() as isize;
    let tree = PrefixTree::new();
    let ids: Vec<TenantId> = w.tenants.iter().map(|n| tree.add_tenant(n)).collect();
    for (i, p) in w.prompts.iter().enumerate() {
        tree.insert_at(p, ids[i % ids.len()], i as u64).unwrap();
    }
    drop(ids);
    drain(&tree);
    let live = ALLOC.live() as isize - before;
    (tree, before, live)
}

fn check(label: &str, w: &ChatWorkload, budget: f64) -> f64 {
    let (tree, before, live) = build(w);
    tree.check_invariants().unwrap();
    let st = tree.stats();
    assert_eq!(st.bytes, tree.distinct_bytes(), "{label}");
    let ratio = st.heap_bytes as f64 / st.bytes as f64;
    assert!(
        ratio <= budget,
        "{label}: heap {} B for {} B of text: {ratio:.4} > {budget}",
        st.heap_bytes,
        st.bytes
    );
    // The accounting is honest: what the build left allocated (requested sizes, no allocator
    // overhead) is the tree's own figure, give or take the reclaimer's bookkeeping (5 kB on
    // W1 and 3 kB on W3 when this test was written).
    let diff = live - st.heap_bytes as isize;
    assert!(
        diff.abs() <= 24 << 10,
        "{label}: allocated {live} B, accounted {} B",
        st.heap_bytes
    );
    // Dropping the tree frees all it allocated, give or take the same bookkeeping: among it
    // the slab's chunks, which its `Drop` frees with the sizes they were allocated with.
    drop(tree);
    let left = ALLOC.live() as isize - before;
    assert!(
        left.abs() <= 24 << 10,
        "{label}: {left} B still allocated once the tree is dropped"
    );
    ratio
}

/// W1 (10,000 chat prompts, 16 tenants): at most 1.5 heap bytes per text byte. W3 (W1 over a
/// multi-byte alphabet, twice the bytes for about the same nodes) is well under it (1.23); it
/// is here for the accounting check. Both give back what they allocated when dropped.
#[test]
#[cfg_attr(miri, ignore = "full W1 and W3 builds are too slow under miri")]
fn chat_tree_heap_is_within_budget_and_accounted() {
    let w1 = check("W1", &ChatWorkload::w1(0), 1.5);
    let w3 = check("W3", &ChatWorkload::w3(0), 1.5);
    assert!(w3 < w1, "W3 has longer text per node: {w3} < {w1}");
}
