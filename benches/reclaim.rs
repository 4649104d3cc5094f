#![allow(missing_docs)]
//! crossbeam-epoch vs seize for the block index's access pattern (issue: "compare crossbeam-epoch
//! and seize for this table and keep the one that wins").
//!
//! A `BlockIndex` lookup pins once, loads the table pointer, and probes the table about 129
//! times (W4's average leading run); a writer swaps the table and retires the old one. This
//! bench measures exactly those three costs with each reclaimer, on the same table, in the same
//! criterion groups, and prints a table plus JSON lines.
//!
//! `cargo bench --bench reclaim`

use criterion::{criterion_group, Criterion, Throughput};
use kvtrie::workload::SplitMix64;
use std::hint::black_box;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::{Duration, Instant};

/// An open-addressing table of `u64` keys (2^21 slots, half full), like the block table.
struct Table {
    keys: Vec<u64>,
}

const SLOTS: usize = 1 << 21;
const PROBES: usize = 129;

fn table() -> Box<Table> {
    let mut r = SplitMix64::new(1);
    let mut keys = vec![0u64; SLOTS];
    for _ in 0..SLOTS / 2 {
        let k = r.next() | 1;
        let mut i = (k as usize) & (SLOTS - 1);
        while keys[i] != 0 {
            i = (i + 1) & (SLOTS - 1);
        }
        keys[i] = k;
    }
    Box::new(Table { keys })
}

#[inline]
fn probe(t: &Table, seed: u64) -> u64 {
    let mut acc = 0;
    let mut x = seed;
    for _ in 0..PROBES {
        x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
        acc ^= t.keys[(x as usize) & (SLOTS - 1)];
    }
    acc
}

fn time(mut f: impl FnMut(u64), n: u64) -> f64 {
    let t0 = Instant::now();
    for i in 0..n {
        f(i);
    }
    n as f64 / t0.elapsed().as_secs_f64()
}

fn figure(name: &str, value: f64, unit: &str) {
    println!("{name:<44} {value:>16.1} {unit}");
    println!("{{\"figure\":\"{name}\",\"value\":{value},\"unit\":\"{unit}\"}}");
}

fn bench(c: &mut Criterion) {
    let ptr = AtomicPtr::new(Box::into_raw(table()));
    let collector = seize::Collector::new();
    use seize::Guard as _;

    let mut g = c.benchmark_group("reclaim_pin_load");
    g.throughput(Throughput::Elements(1));
    g.bench_function("crossbeam_epoch", |b| {
        b.iter(|| {
            let guard = crossbeam_epoch::pin();
            let p = ptr.load(Ordering::Acquire);
            black_box(p);
            drop(guard);
        })
    });
    g.bench_function("seize", |b| {
        b.iter(|| {
            let guard = collector.enter();
            black_box(guard.protect(&ptr, Ordering::Acquire));
        })
    });
    g.finish();

    let mut g = c.benchmark_group("reclaim_lookup_129_probes");
    g.throughput(Throughput::Elements(1));
    let mut i = 0u64;
    g.bench_function("crossbeam_epoch", |b| {
        b.iter(|| {
            i += 1;
            let _guard = crossbeam_epoch::pin();
            // Safety: the table is never retired while this group runs.
            let t = unsafe { &*ptr.load(Ordering::Acquire) };
            black_box(probe(t, i))
        })
    });
    g.bench_function("seize", |b| {
        b.iter(|| {
            i += 1;
            let guard = collector.enter();
            // Safety: as above.
            let t = unsafe { &*guard.protect(&ptr, Ordering::Acquire) };
            black_box(probe(t, i))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("reclaim_swap_retire");
    g.throughput(Throughput::Elements(1));
    let small = AtomicPtr::new(Box::into_raw(Box::new(0u64)));
    g.bench_function("crossbeam_epoch", |b| {
        b.iter(|| {
            let guard = crossbeam_epoch::pin();
            let old = small.swap(Box::into_raw(Box::new(1u64)), Ordering::AcqRel);
            let free = move || {
                // Safety: `old` was just unlinked and is retired once. Runs after every guard active at the defer is gone.
                drop(unsafe { Box::from_raw(old) })
            };
            // Safety: the closure only frees `old`, which no thread can reach by the time it runs.
            unsafe { guard.defer_unchecked(free) };
        })
    });
    g.bench_function("seize", |b| {
        b.iter(|| {
            let old = small.swap(Box::into_raw(Box::new(1u64)), Ordering::AcqRel);
            // Safety: `old` was just unlinked and is retired once.
            unsafe { collector.retire(old, seize::reclaim::boxed) };
        })
    });
    g.finish();

    // Plain timed loops for the table / JSON figures (same code paths).
    println!("\n{:<44} {:>16} unit", "figure", "value");
    let n = 3_000_000;
    let cb = time(
        |_| {
            let g = crossbeam_epoch::pin();
            black_box(ptr.load(Ordering::Acquire));
            drop(g);
        },
        n,
    );
    let sz = time(
        |_| {
            let g = collector.enter();
            black_box(g.protect(&ptr, Ordering::Acquire));
        },
        n,
    );
    figure("reclaim_pin_load_crossbeam_ns", 1e9 / cb, "ns/op");
    figure("reclaim_pin_load_seize_ns", 1e9 / sz, "ns/op");
    let n = 300_000;
    let cb = time(
        |i| {
            let _g = crossbeam_epoch::pin();
            // Safety: not retired during this loop.
            black_box(probe(unsafe { &*ptr.load(Ordering::Acquire) }, i));
        },
        n,
    );
    let sz = time(
        |i| {
            let g = collector.enter();
            // Safety: not retired during this loop.
            black_box(probe(unsafe { &*g.protect(&ptr, Ordering::Acquire) }, i));
        },
        n,
    );
    figure("reclaim_lookup129_crossbeam_per_s", cb, "lookups/s");
    figure("reclaim_lookup129_seize_per_s", sz, "lookups/s");
    figure("reclaim_lookup129_crossbeam_over_seize", cb / sz, "ratio");
    let n = 1_000_000;
    let cb = time(
        |_| {
            let guard = crossbeam_epoch::pin();
            let old = small.swap(Box::into_raw(Box::new(1u64)), Ordering::AcqRel);
            let free = move || {
                // Safety: unlinked, retired once. Runs after every guard active at the defer is gone.
                drop(unsafe { Box::from_raw(old) })
            };
            // Safety: the closure only frees `old`, which no thread can reach by the time it runs.
            unsafe { guard.defer_unchecked(free) };
        },
        n,
    );
    let sz = time(
        |_| {
            let old = small.swap(Box::into_raw(Box::new(1u64)), Ordering::AcqRel);
            // Safety: unlinked, retired once.
            unsafe { collector.retire(old, seize::reclaim::boxed) };
        },
        n,
    );
    figure("reclaim_swap_retire_crossbeam_ns", 1e9 / cb, "ns/op");
    figure("reclaim_swap_retire_seize_ns", 1e9 / sz, "ns/op");
    // Safety: benchmarks are over; no guard is active.
    drop(unsafe { Box::from_raw(ptr.load(Ordering::Relaxed)) });
    // Safety: as above.
    drop(unsafe { Box::from_raw(small.load(Ordering::Relaxed)) });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    targets = bench
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
