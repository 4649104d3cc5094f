//! Arbitrary bytes → `PrefixTree::read_snapshot`.
//!
//! Properties checked on every input:
//! - nothing panics, hangs or allocates beyond the input (libFuzzer reports OOMs and timeouts);
//! - a restored tree passes `check_invariants`;
//! - a restored tree snapshots again to bytes that restore to an equal tree.
//!
//! Seeds in `corpus/snapshot_restore/` are real snapshots of small trees (multi-byte text,
//! splits, several tenants, an empty tree).
#![no_main]

use kvtrie::PrefixTree;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(tree) = PrefixTree::read_snapshot(data) else {
        return;
    };
    tree.check_invariants()
        .unwrap_or_else(|e| panic!("a restored tree breaks an invariant: {e}"));
    let mut again = Vec::new();
    tree.write_snapshot(&mut again).expect("writing to a Vec");
    let back = PrefixTree::read_snapshot(&again[..]).expect("a fresh snapshot restores");
    assert_eq!(back.snapshot(), tree.snapshot());
});
