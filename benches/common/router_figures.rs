//! Timed measurements of the routers against the bare structures they wrap, on W1 (prefix
//! affinity over `PrefixTree`) and W4 (KV-aware over `BlockIndex`). Each function returns
//! `(figure, value, unit)` rows; the `*_over_bare` ratios compare rates measured in the same
//! run (target: the prefix-affinity router at ≥ 0.77 × the bare match + insert rate, i.e. it
//! costs at most 1.3 × the structure's own work).
#![allow(dead_code)]

use super::figures::{build, parallel, Fig};
use kvtrie::router::{
    Candidate, KvAwareConfig, KvAwareRouter, PrefixAffinityConfig, PrefixAffinityRouter,
    ReplicaId,
};
use kvtrie::workload::{ChatWorkload, KvWorkload};
use kvtrie::{BlockIndex, OverlapScores, PrefixMatch, StoredBlock, WorkerId};
use std::cell::RefCell;
use std::sync::Arc;

fn fig(v: &mut Vec<Fig>, name: String, value: f64, unit: &str) {
    super::figure(&name, value, unit);
    v.push((name, value, unit.to_string()));
}

/// Best of `reps` runs of `f` (each on fresh state built by `f` itself).
fn best(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..reps).map(|_| f()).fold(0.0, f64::max)
}

/// All router figures: W1 with `n` queries, W4 with `n` queries.
pub fn routers(n: usize, out: &mut Vec<Fig>) {
    prefix_affinity(&ChatWorkload::w1(n), out);
    kv_aware(&KvWorkload::w4(n), out);
}

/// W1: route decisions/s of `PrefixAffinityRouter` (Ray defaults, 16 idle candidates) over
/// each distinct query once, on 1 and 2 threads, next to the bare tree doing the same work:
/// `prefix_match_into` then `insert_at` (two descents), and `match_and_insert` (one). Every
/// measurement starts from a freshly built W1 tree (10,000 prompts for r0..r15), since routing
/// inserts. Best of 2 runs each.
pub fn prefix_affinity(w: &ChatWorkload, out: &mut Vec<Fig>) {
    let q = &w.queries;
    let n = q.len();
    let base_ts = w.prompts.len() as u64;
    for threads in [1usize, 2] {
        let per = n / threads;
        let idx = |th: usize, i: usize| th * per + i;
        // Bare: match, choose (round robin over the owners of the deepest node), insert.
        let two_step = best(2, || {
            let (tree, tids) = build(w);
            parallel(threads, per, |th, i| {
                let qi = idx(th, i);
                thread_local!(static M: RefCell<PrefixMatch> = RefCell::default());
                M.with(|m| {
                    let m = &mut *m.borrow_mut();
                    tree.prefix_match_into(&q[qi], None, m);
                    let t = m
                        .tenants
                        .iter()
                        .nth(qi % m.tenants.len().max(1))
                        .unwrap_or(tids[0]);
                    tree.insert_at(&q[qi], t, base_ts + qi as u64).unwrap();
                });
            })
        });
        fig(
            out,
            format!("w1_bare_match_then_insert_per_s_{threads}t"),
            two_step,
            "ops/s",
        );
        let one_descent = best(2, || {
            let (tree, tids) = build(w);
            parallel(threads, per, |th, i| {
                let qi = idx(th, i);
                thread_local!(static M: RefCell<PrefixMatch> = RefCell::default());
                M.with(|m| {
                    let m = &mut *m.borrow_mut();
                    tree.match_and_insert(&q[qi], None, base_ts + qi as u64, m, |m| {
                        Some(
                            m.tenants
                                .iter()
                                .nth(qi % m.tenants.len().max(1))
                                .unwrap_or(tids[0]),
                        )
                    })
                    .unwrap();
                });
            })
        });
        fig(
            out,
            format!("w1_bare_match_and_insert_per_s_{threads}t"),
            one_descent,
            "ops/s",
        );
        let routed = best(2, || {
            let (tree, tids) = build(w);
            let router = PrefixAffinityRouter::with_tree(tree, PrefixAffinityConfig::default());
            let cands: Vec<Candidate> = tids
                .iter()
                .map(|&t| Candidate::new(ReplicaId(t), 0))
                .collect();
            let rate = parallel(threads, per, |th, i| {
                std::hint::black_box(router.route(&q[idx(th, i)], &cands).unwrap());
            });
            debug_assert!(router.tree().check_invariants().is_ok());
            rate
        });
        fig(
            out,
            format!("w1_router_route_per_s_{threads}t"),
            routed,
            "ops/s",
        );
        fig(
            out,
            format!("w1_router_over_bare_match_then_insert_{threads}t"),
            routed / two_step,
            "ratio",
        );
        fig(
            out,
            format!("w1_router_over_bare_match_and_insert_{threads}t"),
            routed / one_descent,
            "ratio",
        );
    }
}

/// Builds the W4 index: request `i` stored on worker `i % 16` as one `Stored` event chaining
/// its full blocks, engine hash = sequence hash.
pub fn build_w4(w: &KvWorkload, config: &KvAwareConfig) -> Arc<BlockIndex> {
    let hasher = config.hasher();
    let index = Arc::new(BlockIndex::with_hasher(&hasher));
    for (i, r) in w.requests.iter().enumerate() {
        let local = hasher.local_hashes(r);
        let seq = hasher.chain_local(&local);
        let blocks: Vec<StoredBlock> = local
            .iter()
            .zip(&seq)
            .map(|(&l, &s)| StoredBlock {
                engine_hash: s,
                local_hash: l,
            })
            .collect();
        index
            .store_blocks(WorkerId((i % 16) as u64), None, &blocks)
            .unwrap();
    }
    index
}

/// W4: decisions/s of `KvAwareRouter` (temperature 0, 16 allowed workers; one decision =
/// `select_and_reserve` + `request_complete`, so loads stay bounded) against the bare index's
/// `find_matches` with hashing included, on 1 and 2 threads. Best of 2 runs each.
pub fn kv_aware(w: &KvWorkload, out: &mut Vec<Fig>) {
    let config = KvAwareConfig::new(w.block_size);
    let index = build_w4(w, &config);
    let hasher = config.hasher();
    let workers: Vec<WorkerId> = (0..16).map(WorkerId).collect();
    let q = &w.queries;
    let n = q.len();
    for threads in [1usize, 2] {
        let per = n / threads;
        let bare = best(2, || {
            parallel(threads, per, |th, i| {
                thread_local!(static S: RefCell<(Vec<u64>, OverlapScores)> = RefCell::default());
                S.with(|s| {
                    let (hashes, scores) = &mut *s.borrow_mut();
                    hasher.local_hashes_into(&q[th * per + i], hashes);
                    index.find_matches_into(hashes, scores);
                    std::hint::black_box(&*scores);
                });
            })
        });
        fig(
            out,
            format!("w4_bare_find_matches_hashed_per_s_{threads}t"),
            bare,
            "ops/s",
        );
        let routed = best(2, || {
            let router = KvAwareRouter::with_index(index.clone(), config.clone());
            parallel(threads, per, |th, i| {
                let id = (th * per + i) as u64;
                let s = router
                    .select_and_reserve(id, &q[th * per + i], &workers, 256)
                    .unwrap();
                std::hint::black_box(s);
                router.request_complete(id);
            })
        });
        fig(
            out,
            format!("w4_router_select_per_s_{threads}t"),
            routed,
            "ops/s",
        );
        fig(
            out,
            format!("w4_router_over_bare_find_matches_{threads}t"),
            routed / bare,
            "ratio",
        );
    }
}
