//! DESIGN.md: reads allocate nothing ("the `_into`/borrowing forms return without
//! allocating"). A per-thread counting allocator checks `prefix_match_into` once warm, also
//! with tenant lists beyond the 1024 slots a match keeps on the stack.
#![cfg(not(loom))]

use kvtrie::{PrefixMatch, PrefixTree};
#[path = "support/thread_alloc.rs"]
mod thread_alloc;

#[global_allocator]
static ALLOCATOR: thread_alloc::Counting = thread_alloc::Counting;

#[test]
fn warm_prefix_matches_allocate_nothing_whatever_the_tenant_slots() {
    let tree = PrefixTree::new();
    let ids: Vec<_> = (0..1100)
        .map(|i| tree.add_tenant(&format!("r{i}")))
        .collect();
    tree.insert_at("hello world", ids[5], 1).unwrap();
    tree.insert_at("hello there", ids[1099], 2).unwrap();
    let mut m = PrefixMatch::default();
    for available in [
        None,
        Some(&[ids[5]][..]),
        Some(&[ids[5], ids[1099]][..]),
        Some(&[ids[1099]][..]),
    ] {
        // Warm: the result's storage, and this thread's buffer for slots past 1024.
        tree.prefix_match_into("hello world", available, &mut m);
        let ((), n, _) =
            thread_alloc::allocated_by(|| tree.prefix_match_into("hello world", available, &mut m));
        assert_eq!(n, 0, "{available:?}");
    }
    // The answers are right: the deepest node reached is owned by the available tenants.
    tree.prefix_match_into("hello there", Some(&[ids[5], ids[1099]]), &mut m);
    assert_eq!(m.matched_chars, 11);
    assert_eq!(m.tenants.iter().collect::<Vec<_>>(), vec![ids[1099]]);
    tree.prefix_match_into("hello world", Some(&[ids[1099]]), &mut m);
    assert_eq!(m.matched_chars, 6);
    assert_eq!(m.tenants.iter().collect::<Vec<_>>(), vec![ids[1099]]);
}
