//! Runs every WORKLOADS.md figure once and prints a table plus one JSON line per figure.
//!
//! `cargo run --release --example report` (`KVTRIE_QUERIES=200000` is the standard size; the
//! default, 200,000, takes about a minute on two cores).

#[path = "../benches/common/mod.rs"]
mod common;

// W4 (BlockIndex) figures live with the block bench; its `main` is unused here.
#[allow(dead_code)]
#[path = "../benches/blocks.rs"]
mod blocks_bench;

use kvtrie::workload::{ChatWorkload, MultiturnWorkload};

fn main() {
    let n: usize = std::env::var("KVTRIE_QUERIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("kvtrie report: {n} queries, {threads} hardware threads");
    println!("{:<48} {:>16} unit", "figure", "value");
    let mut out = Vec::new();
    let w1 = ChatWorkload::w1(n);
    common::figures::chat("w1", &w1, &mut out);
    common::figures::evict(&w1, &mut out);
    drop(w1);
    common::figures::multiturn(&MultiturnWorkload::w2(), &mut out);
    common::figures::chat("w3", &ChatWorkload::w3(n / 4), &mut out);
    blocks_bench::report(10_000, n);
    common::router_figures::routers(n, &mut out);
}
