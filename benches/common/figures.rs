//! Timed measurements of the WORKLOADS.md figures for the tree (W1, W2, W3, W5), shared by
//! `benches/tree.rs` and `examples/report.rs`. Each returns `(figure, value, unit)` rows.
#![allow(dead_code)]

use super::SeqTree;
use kvtrie::workload::{ChatWorkload, MultiturnWorkload};
use kvtrie::{EvictionConfig, PrefixMatch, PrefixTree, TenantId};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub type Fig = (String, f64, String);

thread_local! {
    /// Per-thread result storage reused across lookups (the non-allocating form).
    static SCRATCH: std::cell::RefCell<PrefixMatch> = std::cell::RefCell::new(PrefixMatch::default());
}

fn fig(v: &mut Vec<Fig>, name: String, value: f64, unit: &str) {
    super::figure(&name, value, unit);
    v.push((name, value, unit.to_string()));
}

/// Builds the W1/W3 tree: prompt `i` for tenant `i % 16` at timestamp `i`.
pub fn build(w: &ChatWorkload) -> (Arc<PrefixTree>, Vec<TenantId>) {
    let tree = Arc::new(PrefixTree::new());
    let tids: Vec<TenantId> = w.tenants.iter().map(|n| tree.add_tenant(n)).collect();
    for (i, p) in w.prompts.iter().enumerate() {
        tree.insert_at(p, tids[i % tids.len()], i as u64).unwrap();
    }
    (tree, tids)
}

/// Builds the unsynchronized single-threaded yardstick on the W1/W3 data (as [`build`]).
pub fn seq_build(w: &ChatWorkload) -> SeqTree {
    let mut seq = SeqTree::new();
    for (i, p) in w.prompts.iter().enumerate() {
        seq.insert(p, (i % 16) as u8, i as u64);
    }
    seq
}

/// Runs `f(thread, i)` for `per_thread` iterations on `threads` threads; returns ops/s.
pub fn parallel<F>(threads: usize, per_thread: usize, f: F) -> f64
where
    F: Fn(usize, usize) + Sync,
{
    let barrier = std::sync::Barrier::new(threads);
    let start = std::sync::Mutex::new(None::<Instant>);
    let elapsed = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|th| {
                let (f, barrier, start) = (&f, &barrier, &start);
                s.spawn(move || {
                    barrier.wait();
                    start.lock().unwrap().get_or_insert_with(Instant::now);
                    for i in 0..per_thread {
                        f(th, i);
                    }
                    Instant::now()
                })
            })
            .collect();
        let end = hs.into_iter().map(|h| h.join().unwrap()).max().unwrap();
        end - start.lock().unwrap().unwrap()
    });
    (threads * per_thread) as f64 / elapsed.as_secs_f64()
}

/// W1 (or W3 with `label = "w3"`) figures.
pub fn chat(label: &str, w: &ChatWorkload, out: &mut Vec<Fig>) {
    // Inserts/s, 1 thread, into a fresh tree, and the unsynchronized tree's on the same data:
    // the best of three builds of each, interleaved, after a warm-up build of each (so that the
    // allocator's first-touch page faults are not what is measured; the first build after one
    // runs 10-15 % slower for both trees, as the allocator settles). The previous build is
    // dropped before the next one starts, so each reuses freed memory, as a router's tree does.
    drop(build(w));
    drop(seq_build(w));
    let (mut ins, mut seq_ins) = (0f64, 0f64);
    let (mut kept, mut seq) = (None, None);
    for _ in 0..3 {
        drop(kept.take());
        let t0 = Instant::now();
        kept = Some(build(w));
        ins = ins.max(w.prompts.len() as f64 / t0.elapsed().as_secs_f64());
        drop(seq.take());
        let t0 = Instant::now();
        seq = Some(seq_build(w));
        seq_ins = seq_ins.max(w.prompts.len() as f64 / t0.elapsed().as_secs_f64());
    }
    let ((tree, tids), seq) = (kept.expect("three builds"), seq.expect("three builds"));
    fig(out, format!("{label}_inserts_per_s_1t"), ins, "ops/s");
    fig(
        out,
        format!("{label}_seqtree_inserts_per_s_1t"),
        seq_ins,
        "ops/s",
    );
    fig(
        out,
        format!("{label}_inserts_vs_seqtree"),
        ins / seq_ins,
        "ratio",
    );
    let st = tree.stats();
    fig(out, format!("{label}_nodes"), st.nodes as f64, "nodes");
    fig(
        out,
        format!("{label}_heap_bytes_per_text_byte"),
        st.heap_bytes as f64 / st.bytes as f64,
        "ratio",
    );
    let q = &w.queries;
    let hot = 1000.min(q.len());
    let n = q.len();
    // Hot lookups on 1 and 2 threads and the yardstick's: the best of three interleaved
    // rounds of each (one measurement on a shared VM swings by 30 %, which a ratio of two
    // single measurements doubles).
    let (mut hot_1t, mut hot_2t, mut seq_hot) = (0f64, 0f64, 0f64);
    for _ in 0..3 {
        hot_1t = hot_1t.max(parallel(1, n, |_, i| {
            SCRATCH.with_borrow_mut(|m| {
                tree.prefix_match_into(&q[i % hot], None, m);
                std::hint::black_box(&*m);
            });
        }));
        seq_hot = seq_hot.max(parallel(1, n, |_, i| {
            std::hint::black_box(seq.prefix_match(&q[i % hot]));
        }));
        hot_2t = hot_2t.max(parallel(2, n / 2, |th, i| {
            SCRATCH.with_borrow_mut(|m| {
                tree.prefix_match_into(&q[(th * 500 + i) % hot], None, m);
                std::hint::black_box(&*m);
            });
        }));
    }
    fig(out, format!("{label}_match_hot_per_s_1t"), hot_1t, "ops/s");
    fig(out, format!("{label}_match_hot_per_s_2t"), hot_2t, "ops/s");
    fig(
        out,
        format!("{label}_match_hot_2t_over_1t"),
        hot_2t / hot_1t,
        "ratio",
    );
    let cold_1t = parallel(1, n, |_, i| {
        SCRATCH.with_borrow_mut(|m| {
            tree.prefix_match_into(&q[i], None, m);
            std::hint::black_box(&*m);
        });
    });
    fig(
        out,
        format!("{label}_match_cold_per_s_1t"),
        cold_1t,
        "ops/s",
    );
    let cold_2t = parallel(2, n / 2, |th, i| {
        SCRATCH.with_borrow_mut(|m| {
            tree.prefix_match_into(&q[th * (n / 2) + i], None, m);
            std::hint::black_box(&*m);
        });
    });
    fig(
        out,
        format!("{label}_match_cold_per_s_2t"),
        cold_2t,
        "ops/s",
    );
    // The memory limit: a bare comparison of each cold query against its system prompt.
    let bare = parallel(1, n, |_, i| {
        let s = w.system[w.query_system[i]].as_bytes();
        std::hint::black_box(&q[i].as_bytes()[..s.len()] == s);
    });
    fig(
        out,
        format!("{label}_bare_compare_cold_per_s"),
        bare,
        "ops/s",
    );
    fig(
        out,
        format!("{label}_seqtree_match_hot_per_s_1t"),
        seq_hot,
        "ops/s",
    );
    fig(
        out,
        format!("{label}_match_hot_vs_seqtree"),
        hot_1t / seq_hot,
        "ratio",
    );
    let rw = super::RwLockTree(std::sync::RwLock::new(seq));
    let rw_hot = parallel(2, n / 2, |th, i| {
        std::hint::black_box(rw.prefix_match(&q[(th * 500 + i) % hot]));
    });
    fig(
        out,
        format!("{label}_rwlock_tree_match_hot_per_s_2t"),
        rw_hot,
        "ops/s",
    );
    // 2-thread 90/10 mix on a fresh copy of the tree.
    let (tree2, tids2) = build(w);
    let mix = parallel(2, n / 2, |th, i| {
        let qi = th * (n / 2) + i;
        if i % 10 == 0 {
            tree2
                .insert_at(&q[qi], tids2[qi % 16], (w.prompts.len() + qi) as u64)
                .unwrap();
        } else {
            SCRATCH.with_borrow_mut(|m| {
                tree2.prefix_match_into(&q[qi % hot], None, m);
                std::hint::black_box(&*m);
            });
        }
    });
    fig(out, format!("{label}_mix_90_10_per_s_2t"), mix, "ops/s");
    drop(tree2);
    // Route cycles (match, choose, insert) on 2 threads, over the cold queries.
    let (tree3, _) = build(w);
    // One descent per request: match, choose (an owner of the match, or a tenant by rotation
    // on a miss), insert.
    let route = parallel(2, n / 2, |th, i| {
        let qi = th * (n / 2) + i;
        SCRATCH.with_borrow_mut(|m| {
            tree3
                .match_and_insert(&q[qi], None, (w.prompts.len() + qi) as u64, m, |m| {
                    Some(super::w1_choice(m, qi, &tids))
                })
                .unwrap();
        });
    });
    fig(
        out,
        format!("{label}_route_cycles_per_s_2t"),
        route,
        "ops/s",
    );
    tree3.check_invariants().unwrap();
    if label == "w3" {
        tree.check_invariants().unwrap();
        fig(out, "w3_counts_equal_recount".into(), 1.0, "bool");
    }
}

/// W2: route cycles over growing conversations.
pub fn multiturn(w: &MultiturnWorkload, out: &mut Vec<Fig>) {
    let tree = PrefixTree::new();
    let tids: Vec<TenantId> = w.tenants.iter().map(|n| tree.add_tenant(n)).collect();
    let t0 = Instant::now();
    for (i, (c, p)) in w.requests.iter().enumerate() {
        let m = tree.prefix_match(p, None);
        std::hint::black_box(&m);
        tree.insert_at(p, tids[c % 16], i as u64).unwrap();
    }
    let rate = w.requests.len() as f64 / t0.elapsed().as_secs_f64();
    fig(out, "w2_route_cycles_per_s_1t".into(), rate, "ops/s");
    fig(
        out,
        "w2_final_nodes".into(),
        tree.node_count() as f64,
        "nodes",
    );
}

/// Lookups per W5 throughput measurement, as multiples of the query count: long enough to
/// span many 10 ms eviction intervals (one pass of the query set on two threads lasts about as
/// long as two intervals, mostly the first, large pass).
const W5_ROUNDS: usize = 10;

/// W5: eviction under load.
///
/// Throughput: two threads look up W1's hot queries on W1's tree while a third re-inserts W1's
/// prompts (one every 50 µs, at new timestamps, so evicted prompts come back and every pass has
/// work); with the background eviction thread running every 10 ms (thresholds so that a pass
/// removes about 10 % of each tenant's chars) against without it, same inserter
/// (`w5_during_over_without`: what eviction costs the lookups). `w5_during_over_idle` compares
/// the same "during" figure with the lookups alone on an idle tree: on two cores it also
/// carries the inserter's wake-ups, which take a core from a lookup thread 20,000 times a
/// second.
pub fn evict(w: &ChatWorkload, out: &mut Vec<Fig>) {
    let q = &w.queries;
    let n = q.len();
    let hot = 1000.min(n);
    let lookups = |tree: &PrefixTree| {
        parallel(2, W5_ROUNDS * n / 2, |th, i| {
            SCRATCH.with_borrow_mut(|m| {
                tree.prefix_match_into(&q[(th * hot / 2 + i) % hot], None, m);
                std::hint::black_box(&*m);
            });
        })
    };
    // Lookups while a third thread re-inserts the prompts (see above).
    let with_inserter = |tree: &PrefixTree, tids: &[TenantId]| {
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let inserter = s.spawn(|| {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let p = &w.prompts[i % w.prompts.len()];
                    tree.insert_at(p, tids[i % 16], (w.prompts.len() + i) as u64)
                        .unwrap();
                    i += 1;
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
            let r = lookups(tree);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            inserter.join().unwrap();
            r
        })
    };
    let (tree, _) = build(w);
    let idle = lookups(&tree);
    fig(out, "w5_match_per_s_2t_idle".into(), idle, "ops/s");
    drop(tree);
    let (tree, tids) = build(w);
    let base = with_inserter(&tree, &tids);
    fig(out, "w5_match_per_s_2t_no_eviction".into(), base, "ops/s");
    let per_tenant = tree.char_count(tids[0]).unwrap();
    let threshold = per_tenant * 9 / 10;
    let cfg = EvictionConfig::new(threshold, threshold * 9 / 10, Duration::from_millis(10));
    drop(tree);
    let (tree, tids) = build(w);
    let h = tree.start_eviction(cfg).unwrap();
    let during = with_inserter(&tree, &tids);
    h.stop();
    fig(
        out,
        "w5_match_per_s_2t_during_eviction".into(),
        during,
        "ops/s",
    );
    fig(out, "w5_during_over_without".into(), during / base, "ratio");
    fig(out, "w5_during_over_idle".into(), during / idle, "ratio");
    // One pass against chars evicted, on W1 and on a 10x larger tree.
    for (label, copies) in [("w1", 1usize), ("w1x10", 10)] {
        let tree = PrefixTree::new();
        let tids: Vec<TenantId> = w.tenants.iter().map(|n| tree.add_tenant(n)).collect();
        let mut i = 0u64;
        for c in 0..copies {
            for (k, p) in w.prompts.iter().enumerate() {
                let text = if c == 0 { p.clone() } else { format!("{c}{p}") };
                tree.insert_at(&text, tids[k % 16], i).unwrap();
                i += 1;
            }
        }
        for frac in [100usize, 20] {
            let cnt = tids
                .iter()
                .map(|&t| tree.char_count(t).unwrap())
                .min()
                .unwrap();
            let target = cnt - cnt / frac;
            let cfg = EvictionConfig::new(target, target, Duration::from_secs(1));
            let t0 = Instant::now();
            let s = tree.run_eviction_pass(&cfg);
            let dt = t0.elapsed().as_secs_f64();
            fig(
                out,
                format!("w5_pass_{label}_evicted_chars_1_in_{frac}"),
                s.chars_evicted as f64,
                "chars",
            );
            fig(
                out,
                format!("w5_pass_{label}_time_1_in_{frac}"),
                dt * 1e6,
                "us",
            );
            fig(
                out,
                format!("w5_pass_{label}_ns_per_evicted_char_1_in_{frac}"),
                dt * 1e9 / s.chars_evicted.max(1) as f64,
                "ns",
            );
        }
        let t0 = Instant::now();
        let reps = 1000;
        for _ in 0..reps {
            std::hint::black_box(tree.run_eviction_pass(&EvictionConfig::new(
                usize::MAX,
                usize::MAX,
                Duration::from_secs(1),
            )));
        }
        fig(
            out,
            format!("w5_pass_{label}_evicting_nothing"),
            t0.elapsed().as_secs_f64() * 1e6 / reps as f64,
            "us",
        );
        fig(
            out,
            format!("w5_{label}_nodes"),
            tree.node_count() as f64,
            "nodes",
        );
    }
    bulk_group(w, out);
}

/// One tenant's whole W1 × 10 loaded at a single timestamp (a bulk load, as a restore or a warm
/// start makes: one LRU group of about 100 k leaves) is evicted on one thread while another
/// thread keeps inserting new prompts for the same tenant. Prints the eviction's time, the
/// longest any of those inserts took (an insert that finds the tenant's LRU locked by the
/// eviction parks its new leaf's entry instead of waiting), and how many finished meanwhile.
pub fn bulk_group(w: &ChatWorkload, out: &mut Vec<Fig>) {
    let tree = PrefixTree::new();
    let t = tree.add_tenant("bulk");
    for c in 0..10 {
        for p in &w.prompts {
            tree.insert_at(&format!("{c}{p}"), t, 1).unwrap();
        }
    }
    let owned = tree.char_count(t).unwrap();
    use std::sync::atomic::{AtomicBool, Ordering};
    let (started, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let (evicted, evict_s, (max_s, during)) = std::thread::scope(|s| {
        let inserter = s.spawn(|| {
            let (mut max, mut n, mut i) = (0f64, 0usize, 0usize);
            while !done.load(Ordering::Acquire) {
                let p = format!("new{}", w.prompts[i % w.prompts.len()]);
                let counts = started.load(Ordering::Acquire);
                let t0 = Instant::now();
                tree.insert_at(&p, t, 2 + i as u64).unwrap();
                max = max.max(t0.elapsed().as_secs_f64());
                n += usize::from(counts);
                i += 1;
            }
            (max, n)
        });
        // Let the inserter start before the eviction takes the lock.
        std::thread::sleep(Duration::from_millis(5));
        started.store(true, Ordering::Release);
        let t0 = Instant::now();
        let evicted = tree.evict_tenant_by_lru(t, owned);
        let dt = t0.elapsed().as_secs_f64();
        done.store(true, Ordering::Release);
        (evicted, dt, inserter.join().unwrap())
    });
    fig(
        out,
        "w5_bulk_group_evicted_chars".into(),
        evicted as f64,
        "chars",
    );
    fig(out, "w5_bulk_group_evict_ms".into(), evict_s * 1e3, "ms");
    fig(
        out,
        "w5_bulk_group_max_insert_ms_same_tenant".into(),
        max_s * 1e3,
        "ms",
    );
    fig(
        out,
        "w5_bulk_group_inserts_during_eviction".into(),
        during as f64,
        "inserts",
    );
}
