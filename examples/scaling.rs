//! Thread sweep on W1: lookups, inserts and route cycles per thread count, for kvtrie and for
//! the same workload on a plain radix tree behind an `RwLock` (today's lock-based design), plus
//! the unsynchronized single-threaded tree as the yardstick. Then the `BlockIndex` writers on
//! W4: engine events applied per second by N threads into one shared index (each thread
//! publishing for its own workers, as engines do) against N threads each with its own index
//! (no shared state: the contention-free ceiling).
//!
//! ```text
//! cargo run --release --example scaling -- [--threads 1,2,4,8,16] [--queries 200000] [--best 3]
//! ```
//!
//! Every figure is the best of `--best` runs (fresh trees for inserts, eight W1 builds per run, and
//! for route cycles). Ratios (N threads ÷ 1 thread, kvtrie ÷ the others) are only meaningful
//! within one run.
//!
//! On a shared virtual machine the hypervisor can take a large share of the CPU (steal time),
//! which makes wall-clock rates swing by 2× between runs and hides whether threads contend.
//! So the example also reads each thread's own CPU time (`CLOCK_THREAD_CPUTIME_ID`, which excludes
//! steal) and prints a CPU-time view: operations per thread-CPU-second times the thread count,
//! the rate the threads would reach if each had its core to itself. Its N ÷ 1 ratio is N × the
//! per-operation CPU efficiency; contention (cache-line transfers, spinning) lowers it, stolen
//! time does not. Next to kvtrie's shared tree it measures the contention-free ceiling on the
//! same machine: every thread inserting into (or routing on) a tree of its own. The steal
//! share of the whole run is printed at the end. CPU time does not count time a thread sleeps
//! on a lock, so the CPU view flatters the `BlockIndex` writers, whose table-side mutex can
//! park them: read the wall-clock figures there. Other VMs on the same host can still slow a core without
//! it counting as steal (a busy sibling hyperthread, a shared cache), so every figure is the
//! best of `--best` rounds, and the rounds interleave the thread counts.

#[path = "../benches/common/mod.rs"]
mod common;

use common::{w1_choice, RwLockTree, SeqTree};
use kvtrie::blocks::{BlockHasher, BlockIndex, KvEvent, StoredBlock, WorkerId};
use kvtrie::workload::{ChatWorkload, KvWorkload};
use kvtrie::{PrefixMatch, PrefixTree, TenantId};
use std::cell::RefCell;
use std::sync::{Arc, Barrier};
use std::time::Instant;

thread_local! {
    /// Per-thread result storage: lookups allocate nothing (the `_into` form).
    static SCRATCH: RefCell<PrefixMatch> = RefCell::new(PrefixMatch::default());
}

/// Seconds of the host stolen from this VM, and all CPU seconds, so far (Linux `/proc/stat`).
fn steal_and_total() -> Option<(f64, f64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<f64> = s
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    Some((*fields.get(7)?, fields.iter().take(8).sum()))
}

/// A measured rate: by the wall clock, and by the threads' own CPU time (× threads).
#[derive(Clone, Copy, Default)]
struct Rate {
    wall: f64,
    cpu: f64,
}

impl Rate {
    fn max(self, o: Rate) -> Rate {
        Rate {
            wall: self.wall.max(o.wall),
            cpu: self.cpu.max(o.cpu),
        }
    }

    fn scale(self, k: f64) -> Rate {
        Rate {
            wall: self.wall * k,
            cpu: self.cpu * k,
        }
    }
}

/// Runs `body(thread)` on `threads` threads started together; returns `ops` per second of wall
/// time and per thread-CPU-second × `threads` (the wall rate where CPU time is unknown).
///
/// The wall time runs from the first thread's start to the last thread's end, both read by
/// the threads themselves: a clock read by the spawning thread would start late whenever the
/// workers took every core first (with as many workers as cores, a 2-thread round once read
/// 735 × one thread's rate).
fn timed<F: Fn(usize) + Sync>(threads: usize, ops: usize, body: F) -> Rate {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant, Option<f64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|th| {
                let (body, barrier) = (&body, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    let (t0, c0) = (Instant::now(), common::thread_cpu());
                    body(th);
                    let cpu = c0.zip(common::thread_cpu()).map(|(a, b)| b - a);
                    (t0, Instant::now(), cpu)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("benchmark thread"))
            .collect()
    });
    let start = spans
        .iter()
        .map(|s| s.0)
        .min()
        .expect("at least one thread");
    let end = spans
        .iter()
        .map(|s| s.1)
        .max()
        .expect("at least one thread");
    let wall = (end - start).as_secs_f64();
    let cpu: Option<f64> = spans.iter().map(|s| s.2).sum();
    let n = ops as f64;
    Rate {
        wall: n / wall,
        cpu: cpu
            .filter(|&c| c > 0.0)
            .map_or(n / wall, |c| n * threads as f64 / c),
    }
}

/// Runs `f(thread, i)` for `i` in `thread, thread + threads, …` below `n` on `threads`
/// threads (all starting together).
fn run<F: Fn(usize, usize) + Sync>(threads: usize, n: usize, f: F) -> Rate {
    timed(threads, n, |th| {
        (th..n).step_by(threads).for_each(|i| f(th, i))
    })
}

/// The hot query for operation `i` of thread `t` of `threads` (which runs `i = t, t + threads,
/// ...`): every thread cycles through all `hot` queries, from its own starting point. (Taking
/// `i % hot` would split them between the threads, so that each thread's working set shrinks as
/// threads are added and fits its core's cache better: 2 threads then ran 3 × one thread.)
fn hot_query(t: usize, threads: usize, i: usize, hot: usize) -> usize {
    (i / threads + t * hot / threads) % hot
}

/// Fresh trees filled by one insert measurement: one W1 build takes a few milliseconds, too
/// short a window on a shared VM, so every measurement builds this many trees in turn.
const BUILDS: usize = 8;

/// [`run`] over `builds` fresh trees in turn: `f(build, thread, i)` for every build and every
/// `i` in `thread, thread + threads, …` below `n`. Threads move to the next tree without
/// waiting for each other (inserts into a shared tree stay concurrent throughout).
fn run_builds<F: Fn(usize, usize, usize) + Sync>(
    threads: usize,
    builds: usize,
    n: usize,
    f: F,
) -> Rate {
    timed(threads, builds * n, |th| {
        for b in 0..builds {
            (th..n).step_by(threads).for_each(|i| f(b, th, i))
        }
    })
}

/// Every thread runs `f(thread, i)` for all `i` below `n` (on state of its own).
fn run_each<F: Fn(usize, usize) + Sync>(threads: usize, n: usize, f: F) -> Rate {
    timed(threads, n * threads, |th| (0..n).for_each(|i| f(th, i)))
}

/// One measurement (the sweep interleaves rounds of them and keeps the best).
fn once(f: impl FnOnce() -> Rate) -> Rate {
    f()
}

fn best(k: usize, mut f: impl FnMut() -> Rate) -> Rate {
    (0..k).map(|_| f()).fold(Rate::default(), Rate::max)
}

fn kv_tree(w: &ChatWorkload, fill: bool) -> (Arc<PrefixTree>, Vec<TenantId>) {
    let tree = Arc::new(PrefixTree::new());
    let ids: Vec<TenantId> = w.tenants.iter().map(|n| tree.add_tenant(n)).collect();
    if fill {
        for (i, p) in w.prompts.iter().enumerate() {
            tree.insert_at(p, ids[i % ids.len()], i as u64).unwrap();
        }
    }
    (tree, ids)
}

fn rw_tree(w: &ChatWorkload, fill: bool) -> RwLockTree {
    let t = RwLockTree::new();
    if fill {
        for (i, p) in w.prompts.iter().enumerate() {
            t.insert(p, (i % 16) as u8, i as u64);
        }
    }
    t
}

struct Args {
    threads: Vec<usize>,
    queries: usize,
    best: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        threads: vec![1, 2, 4, 8, 16],
        queries: 200_000,
        best: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--threads" => {
                a.threads = val
                    .split(',')
                    .map(|x| {
                        x.trim()
                            .parse::<usize>()
                            .ok()
                            .filter(|&n| (1..=1024).contains(&n))
                    })
                    .collect::<Option<_>>()
                    .ok_or("--threads takes a list like 1,2,4")?
            }
            // At least the 1,000 hot queries the lookups cycle through.
            "--queries" => {
                a.queries = val
                    .parse()
                    .ok()
                    .filter(|&n| n >= 1000)
                    .ok_or("--queries takes a number of at least 1000")?
            }
            "--best" => {
                a.best = val
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or("--best takes a number from 1 to 100")?
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn main() {
    let args = parse().unwrap_or_else(|e| {
        eprintln!("{e}\nusage: scaling [--threads 1,2,4] [--queries N] [--best K]");
        std::process::exit(2)
    });
    let steal0 = steal_and_total();
    let w = ChatWorkload::w1(args.queries);
    let q = &w.queries;
    let hot = 1000.min(q.len());
    let k = args.best;
    println!(
        "W1 thread sweep: {} prompts, {} queries, best of {k}, {} hardware threads",
        w.prompts.len(),
        q.len(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    // The unsynchronized single-threaded yardstick: one insert measurement (the trees are
    // freed after the clock stops). It runs in every round, between kvtrie's measurements, so
    // that both meet the allocator in the same state.
    let seq_insert_once = || {
        let trees: Vec<_> = (0..BUILDS)
            .map(|_| std::sync::Mutex::new(SeqTree::new()))
            .collect();
        timed(1, BUILDS * w.prompts.len(), |_| {
            for tree in &trees {
                let mut s = tree.lock().unwrap_or_else(|e| e.into_inner());
                for (i, p) in w.prompts.iter().enumerate() {
                    s.insert(p, (i % 16) as u8, i as u64);
                }
            }
        })
    };
    let seq = common::figures::seq_build(&w);
    let seq_lookup = best(k, || {
        run(1, q.len(), |_, i| {
            std::hint::black_box(seq.prefix_match(&q[i % hot]));
        })
    });
    let (full, ids) = kv_tree(&w, true);
    let rw_full = rw_tree(&w, true);
    let routes = q.len().min(50_000);
    let route = |t: &PrefixTree, i: usize| {
        SCRATCH.with_borrow_mut(|m| {
            t.match_and_insert(&q[i], None, (w.prompts.len() + i) as u64, m, |m| {
                Some(w1_choice(m, i, &ids))
            })
            .unwrap();
        });
    };
    let mut base: Option<[Rate; 5]> = None;
    let mut cpu_rows = Vec::new();
    // One measurement of every W1 figure at `th` threads.
    let measure = |th: usize| -> [Rate; 10] {
        let kv_lookup = once(|| {
            run(th, q.len(), |t, i| {
                SCRATCH.with_borrow_mut(|m| {
                    full.prefix_match_into(&q[hot_query(t, th, i, hot)], None, m);
                    std::hint::black_box(&*m);
                });
            })
        });
        let rw_lookup = once(|| {
            run(th, q.len(), |t, i| {
                std::hint::black_box(rw_full.prefix_match(&q[hot_query(t, th, i, hot)]));
            })
        });
        let kv_insert = once(|| {
            let trees: Vec<_> = (0..BUILDS).map(|_| kv_tree(&w, false)).collect();
            run_builds(th, BUILDS, w.prompts.len(), |b, _, i| {
                let (t, ids) = &trees[b];
                t.insert_at(&w.prompts[i], ids[i % 16], i as u64).unwrap();
            })
        });
        // The contention-free ceiling: every thread inserts all of W1 into trees of its own.
        let own_insert = once(|| {
            let trees: Vec<Vec<_>> = (0..th)
                .map(|_| (0..BUILDS).map(|_| kv_tree(&w, false)).collect())
                .collect();
            run_each(th, BUILDS * w.prompts.len(), |t, j| {
                let (tree, ids) = &trees[t][j / w.prompts.len()];
                let i = j % w.prompts.len();
                tree.insert_at(&w.prompts[i], ids[i % 16], i as u64)
                    .unwrap();
            })
        });
        let rw_insert = once(|| {
            let trees: Vec<_> = (0..BUILDS).map(|_| rw_tree(&w, false)).collect();
            run_builds(th, BUILDS, w.prompts.len(), |b, _, i| {
                trees[b].insert(&w.prompts[i], (i % 16) as u8, i as u64);
            })
        });
        // 90 % lookups (hot) / 10 % inserts of new queries, on a full tree. Every thread inserts
        // on one in ten of its own operations (thread `th` runs `i = th, th + threads, ...`, so
        // `i / threads` counts them); `i % 10` would give every insert to the even threads.
        let kv_mix = once(|| {
            let (t, ids) = kv_tree(&w, true);
            run(th, q.len(), |tt, i| {
                if (i / th).is_multiple_of(10) {
                    t.insert_at(&q[i], ids[i % 16], (w.prompts.len() + i) as u64)
                        .unwrap();
                } else {
                    SCRATCH.with_borrow_mut(|m| {
                        t.prefix_match_into(&q[hot_query(tt, th, i, hot)], None, m);
                        std::hint::black_box(&*m);
                    });
                }
            })
        });
        let rw_mix = once(|| {
            let t = rw_tree(&w, true);
            run(th, q.len(), |tt, i| {
                if (i / th).is_multiple_of(10) {
                    t.insert(&q[i], (i % 16) as u8, (w.prompts.len() + i) as u64);
                } else {
                    std::hint::black_box(t.prefix_match(&q[hot_query(tt, th, i, hot)]));
                }
            })
        });
        let kv_route = once(|| {
            let (t, _) = kv_tree(&w, true);
            run(th, routes, |_, i| route(&t, i))
        });
        let own_route = once(|| {
            let trees: Vec<_> = (0..th).map(|_| kv_tree(&w, true).0).collect();
            run_each(th, routes, |t, i| route(&trees[t], i))
        });
        let rw_route = once(|| {
            let t = rw_tree(&w, true);
            run(th, routes, |_, i| {
                let mut g = t.0.write().unwrap_or_else(|e| e.into_inner());
                let (_, owners) = g.prefix_match(&q[i]);
                let chosen = if owners != 0 {
                    owners.trailing_zeros() as u8
                } else {
                    (i % 16) as u8
                };
                g.insert(&q[i], chosen, (w.prompts.len() + i) as u64);
            })
        });
        [
            kv_lookup, rw_lookup, kv_insert, own_insert, rw_insert, kv_mix, rw_mix, kv_route,
            own_route, rw_route,
        ]
    };
    // Rounds interleave the thread counts, so a burst of interference from other VMs does not
    // land on one thread count only; each figure is the best of its rounds.
    let mut results = vec![[Rate::default(); 10]; args.threads.len()];
    let mut seq_insert = Rate::default();
    for _ in 0..k {
        seq_insert = seq_insert.max(seq_insert_once());
        for (ti, &th) in args.threads.iter().enumerate() {
            for (best, m) in results[ti].iter_mut().zip(measure(th)) {
                *best = best.max(m);
            }
        }
    }
    println!(
        "unsynchronized tree, 1 thread: {:.0} inserts/s, {:.0} hot lookups/s",
        seq_insert.wall, seq_lookup.wall
    );
    println!(
        "{{\"figure\":\"w1_seqtree_inserts_per_s_1t\",\"value\":{:.0}}}",
        seq_insert.wall
    );
    println!(
        "{{\"figure\":\"w1_seqtree_match_hot_per_s_1t\",\"value\":{:.0}}}",
        seq_lookup.wall
    );

    println!(
        "{:>8} {:>13} {:>13} {:>13} {:>13} {:>13} {:>13} {:>13} {:>13}",
        "threads",
        "kv lookups/s",
        "rw lookups/s",
        "kv inserts/s",
        "rw inserts/s",
        "kv mix/s",
        "rw mix/s",
        "kv routes/s",
        "rw routes/s"
    );
    for (&th, r) in args.threads.iter().zip(&results) {
        let [kv_lookup, rw_lookup, kv_insert, own_insert, rw_insert, kv_mix, rw_mix, kv_route, own_route, rw_route] =
            *r;
        println!(
            "{th:>8} {:>13.0} {:>13.0} {:>13.0} {:>13.0} {:>13.0} {:>13.0} {:>13.0} {:>13.0}",
            kv_lookup.wall,
            rw_lookup.wall,
            kv_insert.wall,
            rw_insert.wall,
            kv_mix.wall,
            rw_mix.wall,
            kv_route.wall,
            rw_route.wall
        );
        for (name, v) in [
            ("match_hot", kv_lookup),
            ("rwlock_match_hot", rw_lookup),
            ("inserts", kv_insert),
            ("rwlock_inserts", rw_insert),
            ("mix_90_10", kv_mix),
            ("rwlock_mix_90_10", rw_mix),
            ("route_cycles", kv_route),
            ("rwlock_route_cycles", rw_route),
            ("own_tree_inserts", own_insert),
            ("own_tree_route_cycles", own_route),
        ] {
            println!(
                "{{\"figure\":\"w1_{name}_per_s\",\"threads\":{th},\"value\":{:.0},\"per_cpu\":{:.0}}}",
                v.wall, v.cpu
            );
        }
        let b = *base.get_or_insert([kv_lookup, kv_insert, kv_route, own_insert, own_route]);
        if th > 1 {
            println!(
                "         kvtrie {th} threads ÷ 1: lookups {:.2}, inserts {:.2}, route cycles {:.2}; \
                 mix ÷ RwLock tree {:.2}",
                kv_lookup.wall / b[0].wall,
                kv_insert.wall / b[1].wall,
                kv_route.wall / b[2].wall,
                kv_mix.wall / rw_mix.wall
            );
            println!(
                "{{\"figure\":\"w1_mix_90_10_vs_rwlock\",\"threads\":{th},\"value\":{:.3}}}",
                kv_mix.wall / rw_mix.wall
            );
            for (name, v) in [
                ("match_hot", kv_lookup.wall / b[0].wall),
                ("inserts", kv_insert.wall / b[1].wall),
                ("route_cycles", kv_route.wall / b[2].wall),
            ] {
                println!(
                    "{{\"figure\":\"w1_{name}_{th}t_over_1t\",\"threads\":{th},\"value\":{v:.3}}}"
                );
            }
        } else {
            println!(
                "         kvtrie ÷ unsynchronized tree, 1 thread: inserts {:.2} (CPU time: {:.2}), lookups {:.2}",
                kv_insert.wall / seq_insert.wall,
                kv_insert.cpu / seq_insert.cpu,
                kv_lookup.wall / seq_lookup.wall
            );
            println!(
                "{{\"figure\":\"w1_inserts_vs_seqtree\",\"value\":{:.3},\"per_cpu\":{:.3}}}",
                kv_insert.wall / seq_insert.wall,
                kv_insert.cpu / seq_insert.cpu
            );
            println!(
                "{{\"figure\":\"w1_match_hot_vs_seqtree\",\"value\":{:.3}}}",
                kv_lookup.wall / seq_lookup.wall
            );
        }
        cpu_rows.push((th, [kv_insert, own_insert, kv_route, own_route, kv_mix]));
    }
    cpu_view(&cpu_rows);
    block_writers(&args);
    if let (Some((s0, t0)), Some((s1, t1))) = (steal0, steal_and_total()) {
        let share = (s1 - s0) / (t1 - t0).max(1.0);
        println!(
            "\nsteal: the hypervisor took {:.0} % of this VM's CPU time during the run",
            100.0 * share
        );
        println!("{{\"figure\":\"steal_share\",\"value\":{share:.3}}}");
    }
}

/// The CPU-time table: per thread count, ops per thread-CPU-second × threads for kvtrie's
/// shared tree and for one tree per thread, and their ratios to the first thread count's.
fn cpu_view(rows: &[(usize, [Rate; 5])]) {
    println!(
        "\nCPU-time view (ops per thread-CPU-second × threads; not lowered by time stolen from the VM):"
    );
    println!(
        "{:>8} {:>13} {:>13} {:>13} {:>13} {:>13}",
        "threads", "kv inserts", "own-tree ins", "kv routes", "own-tree rts", "kv mix"
    );
    let Some(&(first, base)) = rows.first() else {
        return;
    };
    for &(th, r) in rows {
        println!(
            "{th:>8} {:>13.0} {:>13.0} {:>13.0} {:>13.0} {:>13.0}",
            r[0].cpu, r[1].cpu, r[2].cpu, r[3].cpu, r[4].cpu
        );
        if th == first {
            continue;
        }
        let ratio = |j: usize| r[j].cpu / base[j].cpu;
        println!(
            "         {th} threads ÷ {first} (CPU time): inserts {:.2} (own trees {:.2}), route cycles {:.2} (own trees {:.2})",
            ratio(0),
            ratio(1),
            ratio(2),
            ratio(3)
        );
        for (name, j) in [
            ("inserts", 0),
            ("own_tree_inserts", 1),
            ("route_cycles", 2),
            ("own_tree_route_cycles", 3),
        ] {
            println!(
                "{{\"figure\":\"w1_{name}_{th}t_over_{first}t_cpu\",\"threads\":{th},\"value\":{:.3}}}",
                ratio(j)
            );
        }
    }
}

/// W4's stored requests as engine events (one `Stored` per request, engine hash = sequence
/// hash), worker `i % 16`.
fn w4_events() -> Vec<(WorkerId, Vec<StoredBlock>)> {
    let w = KvWorkload::w4(0);
    let h = BlockHasher::new(w.block_size);
    w.requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let local = h.local_hashes(r);
            let seq = h.sequence_hashes(r);
            let blocks = local
                .iter()
                .zip(&seq)
                .map(|(&local_hash, &engine_hash)| StoredBlock {
                    engine_hash,
                    local_hash,
                })
                .collect();
            (WorkerId((i % 16) as u64), blocks)
        })
        .collect()
}

fn block_writers(args: &Args) {
    let events = w4_events();
    let blocks: usize = events.iter().map(|(_, b)| b.len()).sum();
    let k = args.best;
    println!(
        "\nW4 BlockIndex writers: {} Stored events ({blocks} blocks) on 16 workers, best of {k}",
        events.len()
    );
    println!(
        "{:>8} {:>16} {:>16} {:>10} {:>16} {:>16}",
        "threads",
        "shared blocks/s",
        "own idx blocks/s",
        "shared÷own",
        "shared per cpu",
        "own per cpu"
    );
    let store = |index: &BlockIndex, (w, b): &(WorkerId, Vec<StoredBlock>)| {
        index
            .apply(
                *w,
                KvEvent::Stored {
                    parent: None,
                    blocks: b.clone(),
                },
            )
            .expect("W4 events are valid");
    };
    // One measurement of both figures at `th` threads (rounds interleave thread counts, as
    // for W1).
    let measure = |th: usize| -> (Rate, Rate) {
        // Thread t applies the events of workers w with w % th == t (an engine is one writer).
        let by_thread = |t: usize, i: usize| (events[i].0 .0 as usize) % th == t;
        let per_block = blocks as f64 / events.len() as f64;
        let index = BlockIndex::new();
        let shared = run_all(th, events.len(), |t, i| {
            if by_thread(t, i) {
                store(&index, &events[i]);
            }
        })
        .scale(per_block);
        let indexes: Vec<BlockIndex> = (0..th).map(|_| BlockIndex::new()).collect();
        let own = run_all(th, events.len(), |t, i| {
            if by_thread(t, i) {
                store(&indexes[t], &events[i]);
            }
        })
        .scale(per_block);
        (shared, own)
    };
    let mut results = vec![(Rate::default(), Rate::default()); args.threads.len()];
    for _ in 0..k {
        for (ti, &th) in args.threads.iter().enumerate() {
            let (shared, own) = measure(th);
            results[ti] = (results[ti].0.max(shared), results[ti].1.max(own));
        }
    }
    let mut base = None;
    for (&th, &(shared, own)) in args.threads.iter().zip(&results) {
        println!(
            "{th:>8} {:>16.0} {:>16.0} {:>10.2} {:>16.0} {:>16.0}",
            shared.wall,
            own.wall,
            shared.wall / own.wall,
            shared.cpu,
            own.cpu
        );
        println!(
            "{{\"figure\":\"w4_block_writers_shared_blocks_per_s\",\"threads\":{th},\"value\":{:.0},\"per_cpu\":{:.0}}}",
            shared.wall, shared.cpu
        );
        println!(
            "{{\"figure\":\"w4_block_writers_own_index_blocks_per_s\",\"threads\":{th},\"value\":{:.0},\"per_cpu\":{:.0}}}",
            own.wall, own.cpu
        );
        let b = *base.get_or_insert((shared, own));
        if th > 1 {
            println!(
                "         {th} threads ÷ 1: shared index {:.2} (CPU time {:.2}), own indexes {:.2} (CPU time {:.2})",
                shared.wall / b.0.wall,
                shared.cpu / b.0.cpu,
                own.wall / b.1.wall,
                own.cpu / b.1.cpu
            );
            println!(
                "{{\"figure\":\"w4_block_writers_{th}t_over_1t\",\"threads\":{th},\"value\":{:.3},\"per_cpu\":{:.3}}}",
                shared.wall / b.0.wall,
                shared.cpu / b.0.cpu
            );
        }
    }
}

/// Like [`run`], but every thread sees every index `0..n` (it filters its own share).
fn run_all<F: Fn(usize, usize) + Sync>(threads: usize, n: usize, f: F) -> Rate {
    timed(threads, n, |th| (0..n).for_each(|i| f(th, i)))
}
