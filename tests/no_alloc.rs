//! DESIGN.md: reads allocate nothing ("the `_into`/borrowing forms return without
//! allocating"). A per-thread counting allocator checks `prefix_match_into` once warm, also
//! with tenant lists beyond the 1024 slots a match keeps on the stack.
#![cfg(not(loom))]

use kvtrie::{PrefixMatch, PrefixTree};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting the allocations each thread makes (tests run on threads of
/// their own, so a test reads its own count).
struct Counting;

thread_local! {
    static CALLS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // After the thread's locals are gone, nothing is counted.
    let _ = CALLS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is passed on to `System` unchanged; counting touches a thread-local
// `Cell` only (no allocation, no reentrance).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations this thread made while running `f`.
fn allocations<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = CALLS.with(Cell::get);
    let out = f();
    (out, CALLS.with(Cell::get) - before)
}

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
        let ((), n) = allocations(|| tree.prefix_match_into("hello world", available, &mut m));
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
