//! W1 (and W2, W3, W5) for `PrefixTree`, with a single-threaded radix tree and an
//! `RwLock`-wrapped tree as competitors in the same criterion groups; prints the WORKLOADS.md
//! figures as a table and JSON lines at the end.
//!
//! `cargo bench --bench tree` (set `KVTRIE_QUERIES` to change the number of queries).
//! `cargo bench --bench tree -- FILTER` runs the criterion benchmarks whose names match
//! `FILTER` and no figures; `cargo bench --bench tree -- figures` runs the figures only.

#[path = "common/mod.rs"]
mod common;

use common::{RwLockTree, SeqTree};
use criterion::{criterion_group, Criterion, Throughput};
use kvtrie::workload::ChatWorkload;
use kvtrie::{PrefixMatch, PrefixTree};
use std::hint::black_box;
use std::time::Duration;

fn queries() -> usize {
    // At least the 1,000 hot queries every lookup figure cycles through.
    common::env_count("KVTRIE_QUERIES", 50_000, 1000)
}

fn w1(c: &mut Criterion) {
    let w = ChatWorkload::w1(1000);
    let (tree, tids) = common::figures::build(&w);
    let seq = common::figures::seq_build(&w);
    let rw = RwLockTree(std::sync::RwLock::new(SeqTree::new()));
    for (i, p) in w.prompts.iter().enumerate() {
        rw.insert(p, (i % 16) as u8, i as u64);
    }
    let mut g = c.benchmark_group("w1_prefix_match_hot");
    g.throughput(Throughput::Elements(w.queries.len() as u64));
    g.bench_function("kvtrie", |b| {
        let mut m = PrefixMatch::default();
        b.iter(|| {
            for q in &w.queries {
                tree.prefix_match_into(q, None, &mut m);
                black_box(&m);
            }
        })
    });
    g.bench_function("seqtree_unsynchronized", |b| {
        b.iter(|| {
            for q in &w.queries {
                black_box(seq.prefix_match(q));
            }
        })
    });
    g.bench_function("rwlock_tree", |b| {
        b.iter(|| {
            for q in &w.queries {
                black_box(rw.prefix_match(q));
            }
        })
    });
    g.finish();

    let mut g = c.benchmark_group("w1_insert");
    g.throughput(Throughput::Elements(w.prompts.len() as u64));
    g.sample_size(10);
    g.bench_function("kvtrie", |b| {
        b.iter(|| {
            let t = PrefixTree::new();
            let ids: Vec<_> = w.tenants.iter().map(|n| t.add_tenant(n)).collect();
            for (i, p) in w.prompts.iter().enumerate() {
                t.insert_at(p, ids[i % 16], i as u64).unwrap();
            }
            t
        })
    });
    g.bench_function("rwlock_tree", |b| {
        b.iter(|| {
            let t = RwLockTree::new();
            for (i, p) in w.prompts.iter().enumerate() {
                t.insert(p, (i % 16) as u8, i as u64);
            }
            t
        })
    });
    g.finish();
    let _ = tids;
}

/// W2 (route cycles over growing conversations) and W3 (W1 over a mixed alphabet), each with
/// the lock-based tree as competitor in the same group.
fn w2_w3(c: &mut Criterion) {
    let w2 = kvtrie::workload::MultiturnWorkload::generate(200, 8);
    let mut g = c.benchmark_group("w2_route_cycles");
    g.throughput(Throughput::Elements(w2.requests.len() as u64));
    g.sample_size(10);
    g.bench_function("kvtrie_match_and_insert", |b| {
        b.iter(|| {
            let t = PrefixTree::new();
            let ids: Vec<_> = w2.tenants.iter().map(|n| t.add_tenant(n)).collect();
            let mut m = PrefixMatch::default();
            for (i, (conv, p)) in w2.requests.iter().enumerate() {
                t.match_and_insert(p, None, i as u64, &mut m, |_| Some(ids[conv % 16]))
                    .unwrap();
            }
            t
        })
    });
    g.bench_function("rwlock_tree", |b| {
        b.iter(|| {
            let t = RwLockTree::new();
            for (i, (conv, p)) in w2.requests.iter().enumerate() {
                black_box(t.prefix_match(p));
                t.insert(p, (conv % 16) as u8, i as u64);
            }
            t
        })
    });
    g.finish();

    let w3 = ChatWorkload::w3(1000);
    let (tree, _) = common::figures::build(&w3);
    let seq = common::figures::seq_build(&w3);
    let mut g = c.benchmark_group("w3_prefix_match_hot");
    g.throughput(Throughput::Elements(w3.queries.len() as u64));
    g.bench_function("kvtrie", |b| {
        let mut m = PrefixMatch::default();
        b.iter(|| {
            for q in &w3.queries {
                tree.prefix_match_into(q, None, &mut m);
                black_box(&m);
            }
        })
    });
    g.bench_function("seqtree_unsynchronized", |b| {
        b.iter(|| {
            for q in &w3.queries {
                black_box(seq.prefix_match(q));
            }
        })
    });
    g.finish();
}

/// W5: lookups while the background eviction thread runs every 10 ms, against lookups
/// without it, in one group.
fn w5(c: &mut Criterion) {
    let w = ChatWorkload::w1(1000);
    let mut g = c.benchmark_group("w5_prefix_match_hot");
    g.throughput(Throughput::Elements(w.queries.len() as u64));
    for evicting in [false, true] {
        let (tree, tids) = common::figures::build(&w);
        let cnt = tree.char_count(tids[0]).unwrap();
        let handle = evicting.then(|| {
            tree.start_eviction(kvtrie::EvictionConfig::new(
                cnt * 9 / 10,
                cnt * 8 / 10,
                Duration::from_millis(10),
            ))
            .unwrap()
        });
        let name = if evicting {
            "during_eviction"
        } else {
            "no_eviction"
        };
        g.bench_function(name, |b| {
            let mut m = PrefixMatch::default();
            let mut k = 0u64;
            b.iter(|| {
                // Keep the eviction thread busy: re-insert a few prompts per iteration.
                for p in w.prompts.iter().skip((k as usize * 7) % 9000).take(4) {
                    tree.insert_at(p, tids[(k % 16) as usize], 1_000_000 + k)
                        .unwrap();
                    k += 1;
                }
                for q in &w.queries {
                    tree.prefix_match_into(q, None, &mut m);
                    black_box(&m);
                }
            })
        });
        drop(handle);
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = config();
    targets = w1, w2_w3, w5
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // `-- --list` is criterion's: it lists the benchmarks, and nothing is measured. A filter
    // other than `figures` selects criterion benchmarks only.
    if std::env::args().any(|a| a == "--list") || !common::figures_wanted() {
        return;
    }
    let n = queries();
    let mut out = Vec::new();
    println!("\n{:<48} {:>16} unit", "figure", "value");
    common::figures::chat("w1", &ChatWorkload::w1(n), &mut out);
    common::figures::multiturn(&kvtrie::workload::MultiturnWorkload::w2(), &mut out);
    common::figures::chat("w3", &ChatWorkload::w3(n / 4), &mut out);
    common::figures::evict(&ChatWorkload::w1(n), &mut out);
}
