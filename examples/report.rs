//! Runs the WORKLOADS.md figures of W1–W5 and the routers once and prints a table plus one
//! JSON line per figure.
//!
//! `cargo run --release --example report` (`KVTRIE_QUERIES`, at least 1,000, sets the number
//! of queries; the default, 200,000, is the standard size and takes about a minute on two
//! cores).
//!
//! The other figures have their own programs: W6 (memory over a long run) `soak`; T1 (the
//! trace replay) `simulate -- --trace`; the thread sweep (2 ÷ 1 thread for inserts and route
//! cycles) `scaling`; W4 at 1,024 workers and the tiers `cargo bench --bench blocks`.

// W4 (BlockIndex) figures live with the block bench; its `main` is unused here. The shared
// bench code is the one the block bench loads (`blocks_bench::common`).
#[allow(dead_code)]
#[path = "../benches/blocks.rs"]
mod blocks_bench;

use blocks_bench::common;

use kvtrie::workload::{ChatWorkload, MultiturnWorkload};

fn main() {
    // At least the 1,000 hot queries every lookup figure cycles through.
    let n = common::env_count("KVTRIE_QUERIES", 200_000, 1000);
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
