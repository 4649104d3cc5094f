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
//! Every figure is the best of `--best` runs (fresh trees for inserts and route cycles). Ratios
//! (N threads ÷ 1 thread, kvtrie ÷ the others) are only meaningful within one run.

#[path = "../benches/common/mod.rs"]
mod common;

use common::{RwLockTree, SeqTree};
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

/// Runs `body(thread)` on `threads` threads started together; returns the seconds they took.
fn timed<F: Fn(usize) + Sync>(threads: usize, body: F) -> f64 {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for th in 0..threads {
            let (body, barrier) = (&body, &barrier);
            s.spawn(move || {
                barrier.wait();
                body(th);
                barrier.wait();
            });
        }
        barrier.wait();
        let t0 = Instant::now();
        barrier.wait();
        t0.elapsed().as_secs_f64()
    })
}

/// Runs `f(thread, i)` for `i` in `thread, thread + threads, …` below `n` on `threads`
/// threads; returns operations per second (all threads start together).
fn run<F: Fn(usize, usize) + Sync>(threads: usize, n: usize, f: F) -> f64 {
    n as f64
        / timed(threads, |th| {
            (th..n).step_by(threads).for_each(|i| f(th, i))
        })
}

fn best(k: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..k).map(|_| f()).fold(0.0, f64::max)
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
            "--queries" => a.queries = val.parse().map_err(|_| "--queries takes a number")?,
            "--best" => {
                a.best = val
                    .parse::<usize>()
                    .map_err(|_| "--best takes a number")?
                    .max(1)
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

    // The unsynchronized single-threaded yardstick.
    let seq_insert = best(k, || {
        let t0 = Instant::now();
        let mut s = SeqTree::new();
        for (i, p) in w.prompts.iter().enumerate() {
            s.insert(p, (i % 16) as u8, i as u64);
        }
        w.prompts.len() as f64 / t0.elapsed().as_secs_f64()
    });
    let mut seq = SeqTree::new();
    for (i, p) in w.prompts.iter().enumerate() {
        seq.insert(p, (i % 16) as u8, i as u64);
    }
    let seq_lookup = best(k, || {
        run(1, q.len(), |_, i| {
            std::hint::black_box(seq.prefix_match(&q[i % hot]));
        })
    });
    println!(
        "unsynchronized tree, 1 thread: {seq_insert:.0} inserts/s, {seq_lookup:.0} hot lookups/s"
    );
    println!("{{\"figure\":\"w1_seqtree_inserts_per_s_1t\",\"value\":{seq_insert:.0}}}");
    println!("{{\"figure\":\"w1_seqtree_match_hot_per_s_1t\",\"value\":{seq_lookup:.0}}}");

    let (full, ids) = kv_tree(&w, true);
    let rw_full = rw_tree(&w, true);
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
    let mut base: Option<[f64; 3]> = None;
    for &th in &args.threads {
        let kv_lookup = best(k, || {
            run(th, q.len(), |_, i| {
                SCRATCH.with_borrow_mut(|m| {
                    full.prefix_match_into(&q[i % hot], None, m);
                    std::hint::black_box(&*m);
                });
            })
        });
        let rw_lookup = best(k, || {
            run(th, q.len(), |_, i| {
                std::hint::black_box(rw_full.prefix_match(&q[i % hot]));
            })
        });
        let kv_insert = best(k, || {
            let (t, ids) = kv_tree(&w, false);
            run(th, w.prompts.len(), |_, i| {
                t.insert_at(&w.prompts[i], ids[i % 16], i as u64).unwrap();
            })
        });
        let rw_insert = best(k, || {
            let t = rw_tree(&w, false);
            run(th, w.prompts.len(), |_, i| {
                t.insert(&w.prompts[i], (i % 16) as u8, i as u64);
            })
        });
        // 90 % lookups (hot) / 10 % inserts of new queries, on a full tree.
        let kv_mix = best(k, || {
            let (t, ids) = kv_tree(&w, true);
            run(th, q.len(), |_, i| {
                if i % 10 == 0 {
                    t.insert_at(&q[i], ids[i % 16], (w.prompts.len() + i) as u64)
                        .unwrap();
                } else {
                    SCRATCH.with_borrow_mut(|m| {
                        t.prefix_match_into(&q[i % hot], None, m);
                        std::hint::black_box(&*m);
                    });
                }
            })
        });
        let rw_mix = best(k, || {
            let t = rw_tree(&w, true);
            run(th, q.len(), |_, i| {
                if i % 10 == 0 {
                    t.insert(&q[i], (i % 16) as u8, (w.prompts.len() + i) as u64);
                } else {
                    std::hint::black_box(t.prefix_match(&q[i % hot]));
                }
            })
        });
        let routes = q.len().min(50_000);
        let kv_route = best(k, || {
            let (t, _) = kv_tree(&w, true);
            run(th, routes, |_, i| {
                SCRATCH.with_borrow_mut(|m| {
                    t.match_and_insert(&q[i], None, (w.prompts.len() + i) as u64, m, |m| {
                        let n = m.tenants.len();
                        Some(if n > 0 && m.matched_chars > 0 {
                            m.tenants.as_slice()[i % n]
                        } else {
                            ids[i % ids.len()]
                        })
                    })
                    .unwrap();
                });
            })
        });
        let rw_route = best(k, || {
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
        println!(
            "{th:>8} {kv_lookup:>13.0} {rw_lookup:>13.0} {kv_insert:>13.0} {rw_insert:>13.0} {kv_mix:>13.0} {rw_mix:>13.0} {kv_route:>13.0} {rw_route:>13.0}"
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
        ] {
            println!("{{\"figure\":\"w1_{name}_per_s\",\"threads\":{th},\"value\":{v:.0}}}");
        }
        let b = *base.get_or_insert([kv_lookup, kv_insert, kv_route]);
        if th > 1 {
            println!(
                "         kvtrie {th} threads ÷ 1: lookups {:.2}, inserts {:.2}, route cycles {:.2}; \
                 mix ÷ RwLock tree {:.2}",
                kv_lookup / b[0],
                kv_insert / b[1],
                kv_route / b[2],
                kv_mix / rw_mix
            );
            println!(
                "{{\"figure\":\"w1_mix_90_10_vs_rwlock\",\"threads\":{th},\"value\":{:.3}}}",
                kv_mix / rw_mix
            );
            for (name, v) in [
                ("match_hot", kv_lookup / b[0]),
                ("inserts", kv_insert / b[1]),
                ("route_cycles", kv_route / b[2]),
            ] {
                println!(
                    "{{\"figure\":\"w1_{name}_{th}t_over_1t\",\"threads\":{th},\"value\":{v:.3}}}"
                );
            }
        } else {
            println!(
                "         kvtrie ÷ unsynchronized tree, 1 thread: inserts {:.2}, lookups {:.2}",
                kv_insert / seq_insert,
                kv_lookup / seq_lookup
            );
            println!(
                "{{\"figure\":\"w1_inserts_vs_seqtree\",\"value\":{:.3}}}",
                kv_insert / seq_insert
            );
            println!(
                "{{\"figure\":\"w1_match_hot_vs_seqtree\",\"value\":{:.3}}}",
                kv_lookup / seq_lookup
            );
        }
    }
    block_writers(&args);
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
        "{:>8} {:>16} {:>16} {:>10}",
        "threads", "shared blocks/s", "own idx blocks/s", "shared÷own"
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
    let mut base = None;
    for &th in &args.threads {
        // Thread t applies the events of workers w with w % th == t (an engine is one writer).
        let by_thread = |t: usize, i: usize| (events[i].0 .0 as usize) % th == t;
        let shared = best(k, || {
            let index = BlockIndex::new();
            run_all(th, events.len(), |t, i| {
                if by_thread(t, i) {
                    store(&index, &events[i]);
                }
            }) * blocks as f64
                / events.len() as f64
        });
        let own = best(k, || {
            let indexes: Vec<BlockIndex> = (0..th).map(|_| BlockIndex::new()).collect();
            run_all(th, events.len(), |t, i| {
                if by_thread(t, i) {
                    store(&indexes[t], &events[i]);
                }
            }) * blocks as f64
                / events.len() as f64
        });
        println!("{th:>8} {shared:>16.0} {own:>16.0} {:>10.2}", shared / own);
        println!("{{\"figure\":\"w4_block_writers_shared_blocks_per_s\",\"threads\":{th},\"value\":{shared:.0}}}");
        println!("{{\"figure\":\"w4_block_writers_own_index_blocks_per_s\",\"threads\":{th},\"value\":{own:.0}}}");
        let b = *base.get_or_insert(shared);
        if th > 1 {
            println!("         shared index, {th} threads ÷ 1: {:.2}", shared / b);
            println!(
                "{{\"figure\":\"w4_block_writers_{th}t_over_1t\",\"threads\":{th},\"value\":{:.3}}}",
                shared / b
            );
        }
    }
}

/// Like [`run`], but every thread sees every index `0..n` (it filters its own share).
fn run_all<F: Fn(usize, usize) + Sync>(threads: usize, n: usize, f: F) -> f64 {
    n as f64 / timed(threads, |th| (0..n).for_each(|i| f(th, i)))
}
