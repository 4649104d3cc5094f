//! The Rust side of the Python benchmark (`bench/bench_w1.py`): the same W1 operations on
//! `kvtrie::PrefixTree` directly, so the Python figures can be divided by these (the
//! Python-call overhead). Prints one JSON line per figure.
//!
//! `cargo run --release -p kvtrie-python --example w1_rust -- [QUERIES] [HOT_LOOKUPS]`
//! (defaults 200000 and 200000).

use std::time::Instant;

use kvtrie::workload::ChatWorkload;
use kvtrie::{PrefixMatch, PrefixTree, TenantId};

fn figure(name: &str, threads: usize, value: f64) {
    println!(
        "{{\"figure\": \"{name}\", \"impl\": \"kvtrie-rust\", \"threads\": {threads}, \"value\": {value:.1}}}"
    );
}

/// Lookups/s of `threads` threads splitting `total` lookups over `queries` (cyclically).
fn lookups(tree: &PrefixTree, queries: &[String], total: usize, threads: usize) -> f64 {
    let per = total / threads;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut m = PrefixMatch::default();
                let mut sum = 0usize;
                for i in 0..per {
                    let q = &queries[(t * per + i) % queries.len()];
                    tree.prefix_match_into(q, None, &mut m);
                    sum += m.matched_chars;
                }
                std::hint::black_box(sum);
            });
        }
    });
    (per * threads) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().expect("a count"));
    let queries = args.next().unwrap_or(200_000);
    let hot = args.next().unwrap_or(200_000);
    let w = ChatWorkload::w1(queries);
    let tree = PrefixTree::new();
    let ids: Vec<TenantId> = w.tenants.iter().map(|t| tree.add_tenant(t)).collect();
    let start = Instant::now();
    for (i, p) in w.prompts.iter().enumerate() {
        tree.insert_at(p, ids[i % ids.len()], i as u64 + 1)
            .expect("insert");
    }
    figure(
        "w1_inserts_per_s",
        1,
        w.prompts.len() as f64 / start.elapsed().as_secs_f64(),
    );
    let first = &w.queries[..w.queries.len().min(1000)];
    for (name, queries, total) in [
        ("w1_hot_lookups_per_s", first, hot),
        ("w1_cold_lookups_per_s", &w.queries[..], w.queries.len()),
    ] {
        // Best of 5 rounds, 1 and 2 threads alternating (as the Python side).
        let mut best = [0.0f64; 2];
        for _ in 0..5 {
            for (i, threads) in [1, 2].into_iter().enumerate() {
                best[i] = best[i].max(lookups(&tree, queries, total, threads));
            }
        }
        figure(name, 1, best[0]);
        figure(name, 2, best[1]);
    }
}
