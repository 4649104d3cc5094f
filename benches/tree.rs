//! W1 (and W2, W3, W5) for `PrefixTree`, with a single-threaded radix tree and an
//! `RwLock`-wrapped tree as competitors in the same criterion groups; prints the WORKLOADS.md
//! figures as a table and JSON lines at the end.
//!
//! `cargo bench --bench tree` (set `KVTRIE_QUERIES` to change the number of queries).

#[path = "common/mod.rs"]
mod common;

use common::{RwLockTree, SeqTree};
use criterion::{criterion_group, Criterion, Throughput};
use kvtrie::workload::ChatWorkload;
use kvtrie::{PrefixMatch, PrefixTree};
use std::hint::black_box;
use std::time::Duration;

fn queries() -> usize {
    std::env::var("KVTRIE_QUERIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

fn w1(c: &mut Criterion) {
    let w = ChatWorkload::w1(1000);
    let (tree, tids) = common::figures::build(&w);
    let mut seq = SeqTree::new();
    for (i, p) in w.prompts.iter().enumerate() {
        seq.insert(p, (i % 16) as u8, i as u64);
    }
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

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = config();
    targets = w1
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let n = queries();
    let mut out = Vec::new();
    println!("\n{:<48} {:>16} unit", "figure", "value");
    common::figures::chat("w1", &ChatWorkload::w1(n), &mut out);
    common::figures::multiturn(&kvtrie::workload::MultiturnWorkload::w2(), &mut out);
    common::figures::chat("w3", &ChatWorkload::w3(n / 4), &mut out);
    common::figures::evict(&ChatWorkload::w1(n), &mut out);
}
