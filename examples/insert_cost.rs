//! Single-threaded cost of W1 inserts and hot lookups, for kvtrie and for the unsynchronized
//! single-threaded radix tree (the yardstick of the "inserts ÷ unsynchronized tree" figure).
//!
//! ```text
//! cargo run --release --example insert_cost
//! cargo run --release --example insert_cost -- inserts kvtrie|seqtree [SECONDS]
//! cargo run --release --example insert_cost -- lookups w1|w3 COUNT
//! ```
//!
//! Without arguments it alternates the two trees' inserts for three rounds of two seconds each
//! and prints the best rates and their ratio (compare ratios from one run only).
//!
//! `inserts` builds fresh W1 trees (prompt `i` for tenant `i % 16` at time `i`) for `SECONDS`
//! (default 6; at least one build) and prints inserts per wall-clock second and per
//! thread-CPU second (`CLOCK_THREAD_CPUTIME_ID`, which excludes time stolen by the
//! hypervisor). `lookups` builds one tree and runs `COUNT` hot `prefix_match_into` calls (the
//! first 1,000 queries, cycled).
//!
//! Wall-clock rates on a shared VM swing by 30 % between identical runs; instruction counts do
//! not. For those, run the binary under callgrind with `SECONDS = 0` (one build, no timing
//! loop) or with two `COUNT`s and take the difference:
//!
//! ```text
//! valgrind --tool=callgrind target/release/examples/insert_cost inserts kvtrie 0
//! callgrind_annotate --inclusive=yes callgrind.out.* | grep -E 'insert_at \[|SeqTree::insert \['
//! ```
//!
//! The inclusive count of `PrefixTree::insert_at` (or `SeqTree::insert`) divided by the number
//! of prompts (printed) is the cost of one insert.

#[path = "../benches/common/mod.rs"]
mod common;

use kvtrie::workload::ChatWorkload;
use kvtrie::PrefixMatch;
use std::time::Instant;

/// This thread's CPU time in seconds (0 where the OS does not report it).
fn cpu_seconds() -> f64 {
    common::thread_cpu().unwrap_or(0.0)
}

fn usage() -> ! {
    eprintln!(
        "usage: insert_cost [inserts kvtrie|seqtree [SECONDS, 0 to 86400] | lookups w1|w3 COUNT]"
    );
    std::process::exit(2)
}

/// Builds one W1 tree of the given kind (returned, so that dropping it is not timed).
fn build(kind: &str, w: &ChatWorkload) -> Box<dyn std::any::Any> {
    match kind {
        "kvtrie" => Box::new(common::figures::build(w).0),
        "seqtree" => Box::new(common::figures::seq_build(w)),
        _ => usage(),
    }
}

/// Inserts per wall-clock and per CPU second over `seconds` of fresh W1 builds.
fn rates(kind: &str, w: &ChatWorkload, seconds: f64) -> (f64, f64) {
    let start = Instant::now();
    let (mut n, mut wall, mut cpu) = (0usize, 0.0, 0.0);
    // At least one build, however short `seconds` is.
    while n == 0 || start.elapsed().as_secs_f64() < seconds {
        let (t, c) = (Instant::now(), cpu_seconds());
        let tree = build(kind, w);
        // kvtrie's inserts include freeing what they retired (epoch reclamation).
        wall += t.elapsed().as_secs_f64();
        cpu += cpu_seconds() - c;
        n += w.prompts.len();
        drop(tree);
    }
    let per_cpu = if cpu > 0.0 { n as f64 / cpu } else { 0.0 };
    (n as f64 / wall, per_cpu)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => {
            let w = ChatWorkload::w1(1000);
            let (mut kv, mut seq) = ((0.0f64, 0.0f64), (0.0f64, 0.0f64));
            for _ in 0..3 {
                let k = rates("kvtrie", &w, 2.0);
                let s = rates("seqtree", &w, 2.0);
                kv = (kv.0.max(k.0), kv.1.max(k.1));
                seq = (seq.0.max(s.0), seq.1.max(s.1));
            }
            common::figure("w1_kvtrie_inserts_per_s_1t", kv.0, "ops/s");
            common::figure("w1_seqtree_inserts_per_s_1t", seq.0, "ops/s");
            common::figure("w1_inserts_vs_seqtree", kv.0 / seq.0, "ratio");
            if kv.1 > 0.0 && seq.1 > 0.0 {
                common::figure("w1_inserts_vs_seqtree_cpu", kv.1 / seq.1, "ratio");
            }
        }
        Some("inserts") => {
            let kind = args.get(1).map_or_else(|| usage(), String::as_str);
            let seconds: f64 = args
                .get(2)
                .map_or(Ok(6.0), |s| s.parse())
                .ok()
                .filter(|s: &f64| (0.0..=86_400.0).contains(s))
                .unwrap_or_else(|| usage());
            let w = ChatWorkload::w1(1000);
            println!("{} W1 prompts per build", w.prompts.len());
            if seconds <= 0.0 {
                drop(build(kind, &w));
                return;
            }
            let (wall, cpu) = rates(kind, &w, seconds);
            common::figure(&format!("w1_{kind}_inserts_per_s_1t"), wall, "ops/s");
            if cpu > 0.0 {
                common::figure(&format!("w1_{kind}_inserts_per_cpu_s_1t"), cpu, "ops/s");
            }
        }
        Some("lookups") => {
            let w = match args.get(1).map(String::as_str) {
                Some("w1") => ChatWorkload::w1(20_000),
                Some("w3") => ChatWorkload::w3(5_000),
                _ => usage(),
            };
            let count: usize = args
                .get(2)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| usage());
            let (tree, _) = common::figures::build(&w);
            let (q, mut m) = (&w.queries, PrefixMatch::default());
            let hot = 1000.min(q.len());
            let (t, mut sum) = (Instant::now(), 0usize);
            for i in 0..count {
                tree.prefix_match_into(&q[i % hot], None, &mut m);
                sum += m.matched_chars;
            }
            let secs = t.elapsed().as_secs_f64();
            println!("{count} lookups matched {sum} chars");
            if count > 0 && secs > 0.0 {
                common::figure(
                    &format!("{}_match_hot_per_s_1t", args[1]),
                    count as f64 / secs,
                    "ops/s",
                );
            }
        }
        _ => usage(),
    }
}
