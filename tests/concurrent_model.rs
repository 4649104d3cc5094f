//! Multi-threaded differential test: several threads insert (and read) concurrently; the tree
//! they leave must equal the sequential reference model fed the same inserts.
//!
//! Inserts commute — a node's owners are the union of the tenants that inserted through it,
//! each with the maximum of its timestamps, and the shape is the radix tree of the set of
//! texts — so whatever the interleaving, the final tree is the model's, node for node and time
//! for time, with exact char counts. Threads also read while others write; every read must be
//! one the final tree (or a prefix of its history) could give: never longer than the text, never
//! ending inside a char, never naming an unknown tenant.
#![cfg(not(loom))]

use kvtrie::model::{ModelSnapshot, ModelTree};
use kvtrie::workload::{SplitMix64, CHURN_ALPHABET};
use kvtrie::{NodeSnapshot, PrefixMatch, PrefixTree, TenantId};
use std::collections::HashMap;
use std::sync::Arc;

const TENANTS: usize = 6;

fn text(r: &mut SplitMix64) -> String {
    let n = 1 + r.below(12) as usize;
    (0..n)
        .map(|_| CHURN_ALPHABET[r.below(CHURN_ALPHABET.len() as u64) as usize])
        .collect()
}

/// `NodeSnapshot` with real ids mapped to model tenants (children already sorted by text).
fn convert(s: &NodeSnapshot, to_model: &HashMap<TenantId, usize>) -> ModelSnapshot {
    let mut tenants: Vec<(usize, u64)> = s
        .tenants
        .iter()
        .map(|&(t, ts)| (to_model[&t], ts))
        .collect();
    tenants.sort_unstable();
    ModelSnapshot {
        text: s.text.clone(),
        tenants,
        children: s.children.iter().map(|c| convert(c, to_model)).collect(),
    }
}

fn run(threads: usize, per_thread: usize, seed: u64) {
    let tree = Arc::new(PrefixTree::new());
    let ids: Vec<TenantId> = (0..TENANTS)
        .map(|i| tree.add_tenant(&format!("t{i}")))
        .collect();
    // Each thread's operations, generated up front so the model sees the same inserts.
    let plans: Vec<Vec<(String, usize, u64, bool)>> = (0..threads)
        .map(|th| {
            let mut r = SplitMix64::new(seed * 1000 + th as u64);
            (0..per_thread)
                .map(|_| {
                    let read = r.below(4) == 0;
                    (
                        text(&mut r),
                        r.below(TENANTS as u64) as usize,
                        r.below(1000),
                        read,
                    )
                })
                .collect()
        })
        .collect();
    std::thread::scope(|s| {
        for plan in &plans {
            let (tree, ids) = (&tree, &ids);
            s.spawn(move || {
                let mut m = PrefixMatch::default();
                for (text, t, ts, read) in plan {
                    if *read {
                        tree.prefix_match_into(text, None, &mut m);
                        assert!(m.matched_bytes <= text.len());
                        assert!(text.is_char_boundary(m.matched_bytes), "{m:?} in {text:?}");
                        assert_eq!(m.matched_chars, text[..m.matched_bytes].chars().count());
                        assert!(m.tenants.iter().all(|x| ids.contains(&x)), "{m:?}");
                    } else {
                        tree.insert_at(text, ids[*t], *ts).unwrap();
                    }
                }
            });
        }
    });
    tree.check_invariants()
        .unwrap_or_else(|e| panic!("invariant violated: {e}"));
    let mut model = ModelTree::default();
    let mids: Vec<usize> = (0..TENANTS)
        .map(|i| model.add_tenant(&format!("t{i}")))
        .collect();
    for plan in &plans {
        for (text, t, ts, read) in plan {
            if !read {
                model.insert(text, mids[*t], *ts).unwrap();
            }
        }
    }
    let to_model: HashMap<TenantId, usize> =
        ids.iter().copied().zip(mids.iter().copied()).collect();
    let mut got = convert(&tree.snapshot(), &to_model);
    let mut want = model.snapshot();
    // The root's times are the tenants' last insert times in both.
    got.tenants.sort_unstable();
    want.tenants.sort_unstable();
    assert_eq!(
        got, want,
        "seed {seed}: concurrent inserts differ from the sequential model"
    );
    for (i, &t) in ids.iter().enumerate() {
        assert_eq!(tree.char_count(t), model.char_count(mids[i]), "tenant {i}");
    }
    assert_eq!(tree.node_count(), model.node_count());
}

#[test]
fn concurrent_inserts_equal_the_sequential_model() {
    let (threads, per_thread, seeds) = if cfg!(miri) {
        (2, 40, 1)
    } else {
        (4, 3_000, 8)
    };
    for seed in 0..seeds {
        run(threads, per_thread, seed);
    }
}
