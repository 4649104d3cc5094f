//! loom models (placeholder; see ci/verify.sh).
#![cfg(loom)]
use kvtrie::PrefixTree;
#[test]
fn smoke() {
    loom::model(|| {
        let t = PrefixTree::new();
        let a = t.add_tenant("a");
        t.insert_at("ab", a, 1).unwrap();
        t.check_invariants().unwrap();
    });
}
