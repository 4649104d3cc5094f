//! A removed tenant's slot comes back at the tenant limit even when nothing else in the process
//! pins the epoch: the slot's release is a deferred function of the reclaimer, and a caller
//! that retries `try_add_tenant` after `TooManyTenants` used to be told `TooManyTenants` for
//! ever (nothing ran the deferred release). One test in its own process: another test's
//! operations would pin and collect for it.
#![cfg(not(loom))]

use kvtrie::{Error, PrefixTree, MAX_TENANTS};

#[test]
fn a_removed_tenants_slot_is_reused_at_the_limit_without_other_activity() {
    // Two slots left (test support: the first `MAX_TENANTS - 2` are skipped).
    let tree = PrefixTree::with_tenant_slots_from(MAX_TENANTS as u32 - 2);
    let ids: Vec<_> = tree
        .try_add_tenants(&["t0", "t1"])
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(tree.try_add_tenant("one more"), Err(Error::TooManyTenants));
    tree.insert_at("hello", ids[0], 1).unwrap();
    assert_eq!(tree.remove_tenant(ids[0]), 5);
    // No other thread exists, so no pin holds the grace period back.
    let new = tree
        .try_add_tenant("new")
        .expect("the removed tenant's slot");
    assert_eq!(new.slot(), ids[0].slot());
    assert!(!tree.is_live(ids[0]));
    assert!(tree.insert_at("x", ids[0], 2).is_err());
    tree.insert_at("hex", new, 2).unwrap();
    assert_eq!(tree.char_count(new), Some(3));
    tree.check_invariants().unwrap();
}
