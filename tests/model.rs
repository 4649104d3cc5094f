//! Differential test: random operation sequences (multi-byte text, tenant churn, ties in
//! timestamps, `match_and_insert`) applied to the real tree and to the sequential reference
//! model by `kvtrie::model::run_differential`, which compares every result and checks the
//! invariants after every operation.
#![cfg(not(loom))]

use kvtrie::model::{run_differential, DiffOp};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// Chars that share lead bytes pairwise, plus ASCII.
const ALPHABET: &[char] = &['a', 'b', 'c', 'é', 'è', '🙂', '🙃', '中'];

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(ALPHABET), 0..10)
        .prop_map(|v| v.into_iter().collect())
}

fn op() -> impl Strategy<Value = DiffOp> {
    let tenant = 0u8..5;
    let avail = prop::option::of(prop::collection::vec(0u8..6, 0..4));
    prop_oneof![
        1 => tenant.clone().prop_map(DiffOp::Add),
        6 => (text(), tenant.clone(), 0u64..6).prop_map(|(t, n, ts)| DiffOp::Insert(t, n, ts)),
        4 => (text(), avail.clone()).prop_map(|(t, a)| DiffOp::Match(t, a)),
        1 => tenant.clone().prop_map(DiffOp::Remove),
        1 => prop::collection::vec(tenant.clone(), 0..5).prop_map(DiffOp::RemoveMany),
        2 => (tenant.clone(), 0usize..12).prop_map(|(n, c)| DiffOp::Evict(n, c)),
        1 => avail.clone().prop_map(DiffOp::Smallest),
        3 => (text(), avail, 0u64..6, 0usize..4, prop::option::of(tenant))
            .prop_map(|(t, a, ts, p, f)| DiffOp::MatchAndInsert(t, a, ts, p, f)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { 512 },
        // Failing cases are saved next to this file (`*.proptest-regressions`) and replayed
        // first; the default location is found from a `lib.rs`, which a test file lacks.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    #[cfg_attr(miri, ignore)]
    fn tree_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        run_differential(&ops);
    }
}

#[test]
fn scripted_sequence_matches_model() {
    // A fixed sequence exercising splits, groups and churn, also run under miri.
    run_differential(&[
        DiffOp::Add(0),
        DiffOp::Add(1),
        DiffOp::Insert("aé🙂".into(), 0, 1),
        DiffOp::Insert("aè🙂".into(), 1, 2),
        DiffOp::Insert("a".into(), 0, 3),
        DiffOp::Match("aé🙃".into(), None),
        DiffOp::Evict(0, 1),
        DiffOp::Remove(1),
        DiffOp::Add(1),
        DiffOp::Insert("aèb".into(), 1, 0),
        DiffOp::Match("aèb".into(), Some(vec![0, 1])),
        DiffOp::MatchAndInsert("aèbc".into(), Some(vec![1]), 4, 0, Some(0)),
        DiffOp::Smallest(None),
        DiffOp::Evict(1, 100),
        DiffOp::Add(2),
        DiffOp::Insert("aébc".into(), 2, 5),
        DiffOp::RemoveMany(vec![2, 1, 2, 3]),
        DiffOp::Match("aé".into(), None),
    ]);
}
