//! Arbitrary bytes → `PrefixTree::read_snapshot` and `BlockIndex::read_snapshot`.
//!
//! Properties checked on every input, for both structures:
//! - nothing panics, hangs or allocates beyond the input (libFuzzer reports OOMs and timeouts);
//! - a restored structure passes `check_invariants`;
//! - a restored structure snapshots again to bytes that restore to an equal structure (for
//!   the block index: to the very same bytes, since a restore numbers workers densely in the
//!   order written).
//!
//! Seeds in `corpus/snapshot_restore/` are real snapshots: `seed-*` of small trees (multi-byte
//! text, splits, several tenants, an empty tree), `block-seed-*` of small block indexes (an
//! empty one; data-parallel ranks, tiers, duplicate copies and two engine hashes for one
//! sequence hash; 70 workers with a removed one and one without blocks).
#![no_main]

use kvtrie::blocks::BlockIndex;
use kvtrie::PrefixTree;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(tree) = PrefixTree::read_snapshot(data) {
        tree.check_invariants()
            .unwrap_or_else(|e| panic!("a restored tree breaks an invariant: {e}"));
        let mut again = Vec::new();
        tree.write_snapshot(&mut again).expect("writing to a Vec");
        let back = PrefixTree::read_snapshot(&again[..]).expect("a fresh snapshot restores");
        assert_eq!(back.snapshot(), tree.snapshot());
    }
    if let Ok(index) = BlockIndex::read_snapshot(data) {
        index
            .check_invariants()
            .unwrap_or_else(|e| panic!("a restored index breaks an invariant: {e}"));
        let mut again = Vec::new();
        index.write_snapshot(&mut again).expect("writing to a Vec");
        let back = BlockIndex::read_snapshot(&again[..]).expect("a fresh snapshot restores");
        back.check_invariants().expect("re-restored index is valid");
        let mut third = Vec::new();
        back.write_snapshot(&mut third).expect("writing to a Vec");
        assert_eq!(third, again);
        assert_eq!(back.stats(), index.stats());
        assert_eq!(back.total_blocks(), index.total_blocks());
    }
});
