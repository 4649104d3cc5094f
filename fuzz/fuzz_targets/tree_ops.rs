//! Differential fuzzing of `PrefixTree` against the sequential reference model
//! (`kvtrie::model::ModelTree`), in the style of `tests/model.rs`.
//!
//! The fuzz input is decoded with `arbitrary` into a sequence of operations over five tenant
//! names and an alphabet of chars that share UTF-8 lead bytes pairwise (`é`/`è`, `🙂`/`🙃`,
//! `中`/`丰`) plus ASCII. Every operation is applied to the real tree and to the model and
//! every result is compared; after each operation the tree's invariants are checked
//! (`check_invariants()`), every tenant's char count, the live tenants and the node count are
//! compared, and at the end the whole snapshot (texts, owners, timestamps) is compared.
//!
//! Run: `cd fuzz && cargo +nightly fuzz run tree_ops -- -max_total_time=60` (one hour:
//! `-max_total_time=3600`). Seeds live in `fuzz/corpus/tree_ops/`.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use kvtrie::model::{ModelSnapshot, ModelTenant, ModelTree};
use kvtrie::{NodeSnapshot, PrefixMatch, PrefixTree, TenantId};
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

/// Chars that share lead bytes pairwise, plus ASCII.
const ALPHABET: &[char] = &['a', 'b', 'c', 'é', 'è', '🙂', '🙃', '中', '丰'];
const NAMES: u8 = 5;
const MAX_OPS: usize = 64;

/// A short text over [`ALPHABET`].
#[derive(Debug)]
struct Text(String);

impl<'a> Arbitrary<'a> for Text {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let n = u.int_in_range(0..=10)?;
        let mut s = String::new();
        for _ in 0..n {
            s.push(ALPHABET[u.choose_index(ALPHABET.len())?]);
        }
        Ok(Text(s))
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add(u8),
    Insert(Text, u8, u8),
    Match(Text, Option<Vec<u8>>),
    Remove(u8),
    Evict(u8, u8),
    Smallest(Option<Vec<u8>>),
    /// `match_and_insert(text, available, ts, choose)`: `choose` picks the `pick`-th tenant of
    /// the match (modulo its size), or declines when the match has no tenant and `fallback`
    /// names nobody; with `fallback` it picks that name's id (possibly removed).
    MatchAndInsert(Text, Option<Vec<u8>>, u8, u8, Option<u8>),
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
                let pairs: Vec<_> = names
                    .iter()
                    .take(4)
                    .filter_map(|n| self.by_name.get(&(n % NAMES)))
                    .collect();
                (
                    Some(pairs.iter().map(|p| p.0).collect()),
                    Some(pairs.iter().map(|p| p.1).collect()),
                )
            }
        }
    }

    /// Maps real ids to model ids, sorted (slot order and registration order differ once
    /// slots are reused).
    fn map(&self, v: impl IntoIterator<Item = TenantId>) -> Vec<ModelTenant> {
        let mut m: Vec<ModelTenant> = v.into_iter().map(|t| self.to_model[&t]).collect();
        m.sort_unstable();
        m
    }
}

fn convert(s: &NodeSnapshot, ids: &Ids) -> ModelSnapshot {
    let mut tenants: Vec<_> = s
        .tenants
        .iter()
        .map(|&(t, ts)| (ids.to_model[&t], ts))
        .collect();
    tenants.sort_unstable();
    ModelSnapshot {
        text: s.text.clone(),
        tenants,
        children: s.children.iter().map(|c| convert(c, ids)).collect(),
    }
}

fn check_match(text: &str, got: &PrefixMatch, want: &(usize, Vec<ModelTenant>), ids: &Ids) {
    assert_eq!(
        (got.matched_chars, ids.map(got.tenants.iter())),
        *want,
        "match {text:?}"
    );
    let bytes: usize = text
        .chars()
        .take(got.matched_chars)
        .map(char::len_utf8)
        .sum();
    assert_eq!(got.matched_bytes, bytes, "matched bytes of {text:?}");
}

fn run(ops: &[Op]) {
    let tree = PrefixTree::new();
    let mut model = ModelTree::default();
    let mut ids = Ids::default();
    for op in ops {
        match op {
            Op::Add(n) => {
                let name = format!("t{}", n % NAMES);
                let t = tree.add_tenant(&name);
                let m = model.add_tenant(&name);
                assert_eq!(tree.tenant_id(&name), Some(t));
                assert_eq!(tree.tenant_name(t).as_deref(), Some(name.as_str()));
                ids.by_name.insert(n % NAMES, (t, m));
                ids.to_model.insert(t, m);
            }
            Op::Insert(Text(text), n, ts) => {
                let Some(&(t, m)) = ids.by_name.get(&(n % NAMES)) else {
                    continue;
                };
                let ts = u64::from(ts % 8);
                let r = tree.insert_at(text, t, ts);
                let mr = model.insert(text, m, ts);
                assert_eq!(r.is_ok(), mr.is_ok(), "{op:?}: {r:?}");
            }
            Op::Match(Text(text), avail) => {
                let (ra, ma) = ids.list(avail);
                let got = tree.prefix_match(text, ra.as_deref());
                let want = model.prefix_match(text, ma.as_deref());
                check_match(text, &got, &want, &ids);
            }
            Op::Remove(n) => {
                let Some(&(t, m)) = ids.by_name.get(&(n % NAMES)) else {
                    continue;
                };
                assert_eq!(tree.remove_tenant(t), model.remove_tenant(m), "{op:?}");
                assert_eq!(tree.tenant_name(t), None);
            }
            Op::Evict(n, c) => {
                let Some(&(t, m)) = ids.by_name.get(&(n % NAMES)) else {
                    continue;
                };
                let c = usize::from(c % 16);
                assert_eq!(
                    tree.evict_tenant_by_lru(t, c),
                    model.evict_tenant_by_lru(m, c),
                    "{op:?}"
                );
            }
            Op::Smallest(avail) => {
                let (ra, ma) = ids.list(avail);
                let mut want = model.smallest_tenants(ma.as_deref());
                want.sort_unstable();
                assert_eq!(
                    ids.map(tree.smallest_tenants(ra.as_deref())),
                    want,
                    "{op:?}"
                );
            }
            Op::MatchAndInsert(Text(text), avail, ts, pick, fallback) => {
                let (ra, ma) = ids.list(avail);
                let ts = u64::from(ts % 8);
                let fb = fallback.and_then(|f| ids.by_name.get(&(f % NAMES)).copied());
                let want = model.prefix_match(text, ma.as_deref());
                let mut out = PrefixMatch::default();
                let mut chosen_in_cb = None;
                let r = tree.match_and_insert(text, ra.as_deref(), ts, &mut out, |m| {
                    let c = if m.tenants.is_empty() {
                        fb.map(|f| f.0)
                    } else {
                        Some(m.tenants.as_slice()[usize::from(*pick) % m.tenants.len()])
                    };
                    chosen_in_cb = c;
                    c
                });
                check_match(text, &out, &want, &ids);
                match chosen_in_cb {
                    None => assert_eq!(r, Ok(None), "{op:?}"),
                    Some(t) => {
                        let mr = model.insert(text, ids.to_model[&t], ts);
                        match mr {
                            Ok(()) => assert_eq!(r, Ok(Some(t)), "{op:?}"),
                            Err(()) => assert_eq!(r, Err(kvtrie::Error::UnknownTenant(t))),
                        }
                    }
                }
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
            assert_eq!(tree.is_live(t), model.is_live(m), "liveness after {op:?}");
        }
        assert_eq!(
            ids.map(tree.tenants()),
            model.tenants(),
            "tenants after {op:?}"
        );
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

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    run(&ops);
});
