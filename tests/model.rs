//! Differential test: random operation sequences (multi-byte text, tenant churn, ties in
//! timestamps) applied to the real tree and to the sequential reference model; every result is
//! compared, and the invariants are checked after every operation.

use kvtrie::model::{ModelSnapshot, ModelTenant, ModelTree};
use kvtrie::{NodeSnapshot, PrefixTree, TenantId};
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Clone, Debug)]
enum Op {
    Add(u8),
    Insert(String, u8, u64),
    Match(String, Option<Vec<u8>>),
    Remove(u8),
    Evict(u8, usize),
    Smallest(Option<Vec<u8>>),
    /// `match_and_insert`: match restricted to `avail`, then insert for tenant `n`.
    Route(String, Option<Vec<u8>>, u8, u64),
}

/// Chars that share lead bytes pairwise, plus ASCII.
const ALPHABET: &[char] = &['a', 'b', 'c', 'é', 'è', '🙂', '🙃', '中'];

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(ALPHABET), 0..10)
        .prop_map(|v| v.into_iter().collect())
}

fn op() -> impl Strategy<Value = Op> {
    let tenant = 0u8..5;
    let avail = prop::option::of(prop::collection::vec(0u8..6, 0..4));
    prop_oneof![
        1 => tenant.clone().prop_map(Op::Add),
        6 => (text(), tenant.clone(), 0u64..6).prop_map(|(t, n, ts)| Op::Insert(t, n, ts)),
        4 => (text(), avail.clone()).prop_map(|(t, a)| Op::Match(t, a)),
        1 => tenant.clone().prop_map(Op::Remove),
        2 => (tenant, 0usize..12).prop_map(|(n, c)| Op::Evict(n, c)),
        1 => avail.clone().prop_map(Op::Smallest),
        3 => (text(), avail, 0u8..5, 0u64..6).prop_map(|(t, a, n, ts)| Op::Route(t, a, n, ts)),
    ]
}

/// Real and model ids of each tenant name (the latest incarnation, possibly removed).
#[derive(Default)]
struct Ids {
    by_name: HashMap<u8, (TenantId, ModelTenant)>,
    to_model: HashMap<TenantId, ModelTenant>,
}

impl Ids {
    fn list(&self, v: &Option<Vec<u8>>) -> (Option<Vec<TenantId>>, Option<Vec<ModelTenant>>) {
        match v {
            None => (None, None),
            Some(names) => {
                let pairs: Vec<_> = names.iter().filter_map(|n| self.by_name.get(n)).collect();
                (
                    Some(pairs.iter().map(|p| p.0).collect()),
                    Some(pairs.iter().map(|p| p.1).collect()),
                )
            }
        }
    }

    /// Maps real ids to model ids, sorted (slot order and registration order can differ once
    /// slots are reused).
    fn map(&self, v: impl IntoIterator<Item = TenantId>) -> Vec<ModelTenant> {
        let mut m: Vec<ModelTenant> = v.into_iter().map(|t| self.to_model[&t]).collect();
        m.sort_unstable();
        m
    }
}

fn convert(s: &NodeSnapshot, ids: &Ids) -> ModelSnapshot {
    ModelSnapshot {
        text: s.text.clone(),
        tenants: {
            let mut v: Vec<_> = s
                .tenants
                .iter()
                .map(|&(t, ts)| (ids.to_model[&t], ts))
                .collect();
            v.sort_unstable();
            v
        },
        children: s.children.iter().map(|c| convert(c, ids)).collect(),
    }
}

fn run(ops: &[Op]) {
    let tree = PrefixTree::new();
    let mut model = ModelTree::default();
    let mut ids = Ids::default();
    for op in ops {
        match op {
            Op::Add(n) => {
                let t = tree.add_tenant(&format!("t{n}"));
                let m = model.add_tenant(&format!("t{n}"));
                ids.by_name.insert(*n, (t, m));
                ids.to_model.insert(t, m);
            }
            Op::Insert(text, n, ts) => {
                let Some(&(t, m)) = ids.by_name.get(n) else {
                    continue;
                };
                let r = tree.insert_at(text, t, *ts);
                let mr = model.insert(text, m, *ts);
                assert_eq!(r.is_ok(), mr.is_ok(), "{op:?}");
            }
            Op::Match(text, avail) => {
                let (ra, ma) = ids.list(avail);
                let got = tree.prefix_match(text, ra.as_deref());
                let want = model.prefix_match(text, ma.as_deref());
                assert_eq!(
                    (got.matched_chars, ids.map(got.tenants.iter())),
                    want,
                    "{op:?}"
                );
                let bytes: usize = text
                    .chars()
                    .take(got.matched_chars)
                    .map(char::len_utf8)
                    .sum();
                assert_eq!(got.matched_bytes, bytes);
            }
            Op::Remove(n) => {
                let Some(&(t, m)) = ids.by_name.get(n) else {
                    continue;
                };
                assert_eq!(tree.remove_tenant(t), model.remove_tenant(m), "{op:?}");
            }
            Op::Evict(n, c) => {
                let Some(&(t, m)) = ids.by_name.get(n) else {
                    continue;
                };
                assert_eq!(
                    tree.evict_tenant_by_lru(t, *c),
                    model.evict_tenant_by_lru(m, *c),
                    "{op:?}"
                );
            }
            Op::Smallest(avail) => {
                let (ra, ma) = ids.list(avail);
                let mut want = model.smallest_tenants(ma.as_deref());
                want.sort();
                let mut got = ids.map(tree.smallest_tenants(ra.as_deref()));
                got.sort();
                assert_eq!(got, want, "{op:?}");
            }
            Op::Route(text, avail, n, ts) => {
                let Some(&(t, m)) = ids.by_name.get(n) else {
                    continue;
                };
                let (ra, ma) = ids.list(avail);
                let mut got = kvtrie::PrefixMatch::default();
                let r = tree.match_and_insert(text, ra.as_deref(), *ts, &mut got, |_| Some(t));
                let want = model.prefix_match(text, ma.as_deref());
                assert_eq!(
                    (got.matched_chars, ids.map(got.tenants.iter())),
                    want,
                    "{op:?}"
                );
                let mr = model.insert(text, m, *ts);
                assert_eq!(r.is_ok(), mr.is_ok(), "{op:?}");
            }
        }
        tree.check_invariants()
            .unwrap_or_else(|e| panic!("after {op:?}: {e}"));
        for &(t, m) in ids.by_name.values() {
            assert_eq!(
                tree.char_count(t),
                model.char_count(m),
                "count after {op:?}"
            );
        }
        assert_eq!(ids.map(tree.tenants()), model.tenants());
        assert_eq!(tree.node_count(), model.node_count(), "nodes after {op:?}");
    }
    assert_eq!(convert(&tree.snapshot(), &ids), model.snapshot());
    // Removing every tenant leaves an empty tree.
    for t in tree.tenants() {
        tree.remove_tenant(t);
    }
    assert_eq!((tree.node_count(), tree.distinct_chars()), (0, 0));
    tree.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 512 }, ..ProptestConfig::default() })]

    #[test]
    #[cfg_attr(miri, ignore)]
    fn tree_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        run(&ops);
    }
}

#[test]
fn scripted_sequence_matches_model() {
    // A fixed sequence exercising splits, groups and churn, also run under miri.
    let ops = vec![
        Op::Add(0),
        Op::Add(1),
        Op::Insert("aé🙂".into(), 0, 1),
        Op::Insert("aè🙂".into(), 1, 2),
        Op::Insert("a".into(), 0, 3),
        Op::Match("aé🙃".into(), None),
        Op::Evict(0, 1),
        Op::Remove(1),
        Op::Add(1),
        Op::Insert("aèb".into(), 1, 0),
        Op::Match("aèb".into(), Some(vec![0, 1])),
        Op::Smallest(None),
        Op::Evict(1, 100),
    ];
    run(&ops);
}
