//! Timed measurements of the routers against the bare structures they wrap, on W1 (prefix
//! affinity over `PrefixTree`) and W4 (KV-aware over `BlockIndex`). Each function returns
//! `(figure, value, unit)` rows; the `*_over_bare` ratios compare rates measured in the same
//! run (target: the prefix-affinity router at ≥ 0.77 × the bare match + insert rate, i.e. it
//! costs at most 1.3 × the structure's own work).
#![allow(dead_code)]

use super::figures::{build, parallel, Fig};
use kvtrie::router::{
    Candidate, KvAwareConfig, KvAwareRouter, PrefixAffinityConfig, PrefixAffinityRouter,
};
use kvtrie::workload::{ChatWorkload, KvWorkload};
use kvtrie::{BlockIndex, OverlapScores, PrefixMatch, StoredBlock, WorkerId};
use std::cell::RefCell;
use std::sync::Arc;

fn fig(v: &mut Vec<Fig>, name: String, value: f64, unit: &str) {
    super::figure(&name, value, unit);
    v.push((name, value, unit.to_string()));
}

/// Runs every variant over the items `0..n` in chunks of `chunk`, interleaved chunk by chunk
/// (variant 0 on chunk 0, variant 1 on chunk 0, ..., variant 0 on chunk 1, ...), each chunk
/// split over `threads` threads. Interleaving exposes all variants to the same machine noise
/// (these 2-core machines are shared). Returns per variant `(items/s over all chunks, items/s
/// of its fastest chunk)`.
fn interleaved(
    threads: usize,
    n: usize,
    chunk: usize,
    variants: &[&(dyn Fn(usize) + Sync)],
) -> Vec<(f64, f64)> {
    let per = chunk / threads;
    let chunk = per * threads;
    let mut secs = vec![0.0f64; variants.len()];
    let mut best = vec![0.0f64; variants.len()];
    for c in 0..n / chunk {
        for (v, f) in variants.iter().enumerate() {
            let rate = parallel(threads, per, |th, j| f(c * chunk + th * per + j));
            secs[v] += chunk as f64 / rate;
            best[v] = best[v].max(rate);
        }
    }
    let done = (n / chunk * chunk) as f64;
    secs.iter()
        .zip(&best)
        .map(|(&t, &b)| (done / t, b))
        .collect()
}

/// All router figures: W1 with `n` queries, W4 with `n` queries.
pub fn routers(n: usize, out: &mut Vec<Fig>) {
    prefix_affinity(&ChatWorkload::w1(n), out);
    kv_aware(&KvWorkload::w4(n), out);
}

/// W1: route decisions/s of `PrefixAffinityRouter` (Ray defaults, 16 idle candidates) over
/// each distinct query once, on 1 and 2 threads, next to the bare tree doing the same work on
/// its own copy of the W1 tree (10,000 prompts for r0..r15; routing inserts, so every variant
/// needs its own): `prefix_match_into` then `insert_at` (two descents, choosing round robin
/// among the owners of the deepest node), and `match_and_insert` (one descent, same choice).
/// The variants run interleaved in chunks of 5,000 queries; each ratio is given over the whole
/// run and over the fastest chunk of each variant.
pub fn prefix_affinity(w: &ChatWorkload, out: &mut Vec<Fig>) {
    let q = &w.queries;
    let n = q.len();
    let base_ts = w.prompts.len() as u64;
    thread_local!(static M: RefCell<PrefixMatch> = RefCell::default());
    for threads in [1usize, 2] {
        let (t_two, tids) = build(w);
        let (t_one, _) = build(w);
        let (t_router, _) = build(w);
        let router = PrefixAffinityRouter::with_tree(t_router, PrefixAffinityConfig::default());
        // The router routes to the replicas it has: register the tree's tenants by name (the
        // same tenants, so the prompts inserted above are theirs).
        let names: Vec<&str> = w.tenants.iter().map(String::as_str).collect();
        let cands: Vec<Candidate> = router
            .update_replicas(&names)
            .into_iter()
            .map(|r| Candidate::new(r, 0))
            .collect();
        let two_step = |i: usize| {
            M.with(|m| {
                let m = &mut *m.borrow_mut();
                t_two.prefix_match_into(&q[i], None, m);
                let t = m
                    .tenants
                    .iter()
                    .nth(i % m.tenants.len().max(1))
                    .unwrap_or(tids[0]);
                t_two.insert_at(&q[i], t, base_ts + i as u64).unwrap();
            })
        };
        let one_descent = |i: usize| {
            M.with(|m| {
                let m = &mut *m.borrow_mut();
                t_one
                    .match_and_insert(&q[i], None, base_ts + i as u64, m, |m| {
                        Some(
                            m.tenants
                                .iter()
                                .nth(i % m.tenants.len().max(1))
                                .unwrap_or(tids[0]),
                        )
                    })
                    .unwrap();
            })
        };
        let routed = |i: usize| {
            std::hint::black_box(router.route(&q[i], &cands).unwrap());
        };
        let r = interleaved(threads, n, 5000, &[&two_step, &one_descent, &routed]);
        router.tree().check_invariants().unwrap();
        let t = threads;
        fig(
            out,
            format!("w1_bare_match_then_insert_per_s_{t}t"),
            r[0].0,
            "ops/s",
        );
        fig(
            out,
            format!("w1_bare_match_and_insert_per_s_{t}t"),
            r[1].0,
            "ops/s",
        );
        fig(out, format!("w1_router_route_per_s_{t}t"), r[2].0, "ops/s");
        fig(
            out,
            format!("w1_router_over_bare_match_then_insert_{t}t"),
            r[2].0 / r[0].0,
            "ratio",
        );
        fig(
            out,
            format!("w1_router_over_bare_match_then_insert_best_chunk_{t}t"),
            r[2].1 / r[0].1,
            "ratio",
        );
        fig(
            out,
            format!("w1_router_over_bare_match_and_insert_{t}t"),
            r[2].0 / r[1].0,
            "ratio",
        );
        fig(
            out,
            format!("w1_router_over_bare_match_and_insert_best_chunk_{t}t"),
            r[2].1 / r[1].1,
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

/// W4: decisions/s of `KvAwareRouter` (temperature 0, 16 allowed workers, 256 expected
/// output tokens; one decision = `select_and_reserve` + `request_complete`, so loads stay
/// bounded) against the bare index's `find_matches` with hashing included (`local_hashes_into`
/// + `find_matches_into`), on 1 and 2 threads, interleaved in chunks of 5,000 queries.
pub fn kv_aware(w: &KvWorkload, out: &mut Vec<Fig>) {
    let config = KvAwareConfig::new(w.block_size);
    let index = build_w4(w, &config);
    let hasher = config.hasher();
    let workers: Vec<WorkerId> = (0..16).map(WorkerId).collect();
    let q = &w.queries;
    let n = q.len();
    thread_local!(static S: RefCell<(Vec<u64>, OverlapScores)> = RefCell::default());
    for threads in [1usize, 2] {
        let router = KvAwareRouter::with_index(index.clone(), config.clone());
        let bare = |i: usize| {
            S.with(|s| {
                let (hashes, scores) = &mut *s.borrow_mut();
                hasher.local_hashes_into(&q[i], hashes);
                index.find_matches_into(hashes, scores);
                std::hint::black_box(&*scores);
            })
        };
        let routed = |i: usize| {
            let s = router
                .select_and_reserve(i as u64, &q[i], &workers, 256)
                .unwrap();
            std::hint::black_box(s);
            router.request_complete(i as u64);
        };
        let r = interleaved(threads, n, 5000, &[&bare, &routed]);
        let t = threads;
        fig(
            out,
            format!("w4_bare_find_matches_hashed_per_s_{t}t"),
            r[0].0,
            "ops/s",
        );
        fig(out, format!("w4_router_select_per_s_{t}t"), r[1].0, "ops/s");
        fig(
            out,
            format!("w4_router_over_bare_find_matches_{t}t"),
            r[1].0 / r[0].0,
            "ratio",
        );
        fig(
            out,
            format!("w4_router_over_bare_find_matches_best_chunk_{t}t"),
            r[1].1 / r[0].1,
            "ratio",
        );
    }
}
