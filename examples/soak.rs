//! W6 `churn` soak: sustained write churn on a shared `PrefixTree`; memory must stay flat.
//!
//! ```text
//! cargo run --release --example soak -- [--seconds 180] [--threads 2] [--evict-thread]
//!                                        [--every 5]
//! ```
//!
//! Each thread routes random 1–40-char texts over W6's multi-byte alphabet with
//! `match_and_insert` to one of 6 tenants at random timestamps; one op in 11 evicts 1–200 chars
//! of that tenant by LRU (or, with `--evict-thread`, a background eviction thread keeps every
//! tenant under 20,000 chars instead); thread 0 replaces a tenant 5 times per 100,000 ops
//! (`remove_tenant` + `add_tenant`). Every `--every` seconds it prints the live heap (a counting
//! global allocator), the tree's own heap (`stats().heap_bytes`), the retired backlog
//! (`retired_backlog()`), live ÷ tree heap and the process's resident set (`VmRSS`, what an
//! operator sees; it includes the allocator's free lists and fragmentation), as a table row and
//! one JSON line. The summary compares the largest resident set of the second half of the run
//! with that of the first half: a long run whose memory is flat keeps that ratio near 1.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtrie::workload::{resident_set_bytes, ChurnDriver, ChurnWorkload, CountingAlloc};
use kvtrie::{EvictionConfig, PrefixMatch, PrefixTree};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

struct Args {
    seconds: u64,
    threads: usize,
    evict_thread: bool,
    every: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seconds: 180,
        threads: 2,
        evict_thread: false,
        every: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str, max: u64| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .filter(|n| (1..=max).contains(n))
                .ok_or(format!("{name} needs an integer from 1 to {max}"))
        };
        match flag.as_str() {
            "--seconds" => a.seconds = num("--seconds", 365 * 86_400)?,
            "--threads" => a.threads = num("--threads", 256)? as usize,
            "--every" => a.every = num("--every", 86_400)?,
            "--evict-thread" => a.evict_thread = true,
            "-h" | "--help" => {
                return Err(
                    "usage: soak [--seconds N] [--threads N] [--evict-thread] [--every N]".into(),
                )
            }
            other => return Err(format!("unknown flag {other} (try --help)")),
        }
    }
    Ok(a)
}

fn mb(b: usize) -> f64 {
    b as f64 / 1e6
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let base = ALLOC.live();
    let tree = Arc::new(PrefixTree::new());
    let driver = Arc::new(ChurnDriver::new(Arc::clone(&tree)));
    let _evictor = args.evict_thread.then(|| {
        tree.start_eviction(EvictionConfig::new(
            20_000,
            16_000,
            Duration::from_millis(10),
        ))
        .expect("first eviction thread")
    });
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..args.threads)
        .map(|i| {
            let (driver, stop, ops) = (Arc::clone(&driver), Arc::clone(&stop), Arc::clone(&ops));
            let inline = !args.evict_thread;
            std::thread::spawn(move || {
                let mut w = ChurnWorkload::new(6 + i as u64, i == 0);
                let mut out = PrefixMatch::default();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..256 {
                        driver.apply(&w.next_op(), &mut out, inline);
                    }
                    n += 256;
                }
                ops.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    println!(
        "W6 churn soak: {} threads, {} s, eviction {}",
        args.threads,
        args.seconds,
        if args.evict_thread {
            "by the background thread (20,000 → 16,000 chars per tenant, every 10 ms)"
        } else {
            "inline (1 op in 11)"
        }
    );
    println!(
        "{:>6} {:>12} {:>12} {:>14} {:>12} {:>10} {:>10}",
        "t (s)", "live MB", "tree MB", "backlog MB", "objects", "live/tree", "RSS MB"
    );
    let start = Instant::now();
    let mut worst_ratio = 0f64;
    let mut worst_backlog = 0f64;
    // The largest resident set in the first and in the second half of the run.
    let mut rss_max = [0usize; 2];
    // Bursts: the backlog is sampled every 10 ms against the documented bound
    // (0.5 × the last measured tree heap + 4 MB); the longest stretch above it is reported.
    let mut heap = tree.stats().heap_bytes;
    let (mut over_since, mut longest_over) = (None::<Instant>, Duration::ZERO);
    let mut next_report = Duration::from_secs(args.every);
    let end = Duration::from_secs(args.seconds);
    while start.elapsed() < end {
        std::thread::sleep(Duration::from_millis(10));
        let b = tree.retired_backlog();
        if b.bytes > heap / 2 + (4 << 20) {
            over_since.get_or_insert_with(Instant::now);
        } else if let Some(since) = over_since.take() {
            longest_over = longest_over.max(since.elapsed());
        }
        if start.elapsed() < next_report {
            continue;
        }
        let t = next_report.as_secs();
        next_report += Duration::from_secs(args.every);
        let stats = tree.stats();
        heap = stats.heap_bytes;
        let backlog = tree.retired_backlog();
        let live = ALLOC.live().saturating_sub(base);
        let ratio = live as f64 / stats.heap_bytes.max(1) as f64;
        let backlog_ratio = backlog.bytes as f64 / stats.heap_bytes.max(1) as f64;
        // Steady state: after the first report.
        if t > args.every {
            worst_ratio = worst_ratio.max(ratio);
            worst_backlog = worst_backlog.max(backlog_ratio);
        }
        let rss = resident_set_bytes().unwrap_or(0);
        let half = usize::from(2 * t > args.seconds);
        rss_max[half] = rss_max[half].max(rss);
        println!(
            "{:>6} {:>12.1} {:>12.1} {:>14.2} {:>12} {:>10.2} {:>10.1}",
            t,
            mb(live),
            mb(stats.heap_bytes),
            mb(backlog.bytes),
            backlog.objects,
            ratio,
            mb(rss)
        );
        println!(
            "{{\"figure\":\"w6_soak\",\"threads\":{},\"evict_thread\":{},\"t_s\":{},\"live_bytes\":{},\"tree_heap_bytes\":{},\"backlog_bytes\":{},\"backlog_objects\":{},\"live_over_tree\":{:.3},\"rss_bytes\":{}}}",
            args.threads, args.evict_thread, t, live, stats.heap_bytes, backlog.bytes, backlog.objects, ratio, rss
        );
    }
    if let Some(since) = over_since {
        longest_over = longest_over.max(since.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("worker thread");
    }
    let total = ops.load(Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    // None ("n/a", JSON null) when either half had no report (a run shorter than two reports)
    // or RSS is unreadable: never a made-up ratio.
    let rss_growth =
        (rss_max[0] > 0 && rss_max[1] > 0).then(|| rss_max[1] as f64 / rss_max[0] as f64);
    let fmt = |null: &str| rss_growth.map_or(null.to_string(), |g| format!("{g:.3}"));
    println!(
        "ops {total} ({:.2} M/s); max live/tree heap {worst_ratio:.2}, max backlog/tree heap \
         {worst_backlog:.2}; longest stretch over the backlog bound {} ms; max RSS {:.1} MB in \
         the first half, {:.1} MB in the second ({} ×)",
        total as f64 / secs / 1e6,
        longest_over.as_millis(),
        mb(rss_max[0]),
        mb(rss_max[1]),
        fmt("n/a")
    );
    println!(
        "{{\"figure\":\"w6_steady_state\",\"threads\":{},\"evict_thread\":{},\"max_live_over_tree\":{:.3},\"max_backlog_over_tree\":{:.3},\"longest_over_bound_ms\":{},\"ops_per_s\":{:.0},\"rss_max_first_half_bytes\":{},\"rss_max_second_half_bytes\":{},\"rss_second_over_first_half\":{}}}",
        args.threads,
        args.evict_thread,
        worst_ratio,
        worst_backlog,
        longest_over.as_millis(),
        total as f64 / secs,
        rss_max[0],
        rss_max[1],
        fmt("null")
    );
}
