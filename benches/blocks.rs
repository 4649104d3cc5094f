//! W4 (`kv`, WORKLOADS.md): the block index under KV-event load and overlap lookups.
//!
//! `cargo bench --bench blocks` first prints a table and one JSON object per figure, measured
//! with simple timed loops over the standard W4 data (10,000 stored requests on 16 workers,
//! 200,000 queries; `KVTRIE_W4_QUERIES` overrides the query count), then runs a small
//! criterion group (`w4`) comparing `BlockIndex` with an `RwLock<HashMap<u64, u64>>` index.
//! Without `--bench` (e.g. `cargo test --benches`) it runs the same code on tiny sizes.
//! `cargo bench --bench blocks -- FILTER` runs the criterion benchmarks whose names match
//! `FILTER` and no figures; `-- figures` runs the figures only.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

#[path = "common/mod.rs"]
pub(crate) mod common;

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use kvtrie::blocks::{Tier, TierWeights};
use kvtrie::workload::KvWorkload;
use kvtrie::{BlockHasher, BlockIndex, OverlapScores, StoredBlock, WorkerId};

// ---------------------------------------------------------------------------------------------
// Heap accounting: a counting allocator, to check `BlockIndex::heap_bytes` against reality.
// ---------------------------------------------------------------------------------------------

struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

// Safety: forwards every call to the system allocator unchanged; the counter is a side effect.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // Safety: forwarded from the caller.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // Safety: forwarded from the caller.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // Safety: forwarded from the caller.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live_bytes() -> isize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Competitor: one RwLock around a HashMap of sequence hash → worker bitset.
// ---------------------------------------------------------------------------------------------

/// FxHash-style multiplicative hasher (keys are already hashes), so the competitor is not
/// slowed down by SipHash.
#[derive(Default)]
struct MulHasher(u64);

impl Hasher for MulHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

struct RwIndex {
    hasher: BlockHasher,
    map: RwLock<HashMap<u64, u64, BuildHasherDefault<MulHasher>>>,
}

impl RwIndex {
    fn new(hasher: BlockHasher) -> Self {
        Self {
            hasher,
            map: RwLock::new(HashMap::default()),
        }
    }

    fn store(&self, worker: usize, seqs: &[u64]) {
        let mut m = self.map.write().unwrap();
        for &s in seqs {
            *m.entry(s).or_insert(0) |= 1 << worker;
        }
    }

    /// Same semantics as `BlockIndex::find_matches` for ≤ 64 workers; returns the best score.
    fn find_matches(&self, local: &[u64], out: &mut Vec<(usize, usize)>) -> usize {
        let mut prev = None;
        self.scan(
            local.iter().map(|&l| {
                let s = prev.map_or(l, |p| self.hasher.chain(p, l));
                prev = Some(s);
                s
            }),
            out,
        )
    }

    fn find_matches_seq(&self, seq: &[u64], out: &mut Vec<(usize, usize)>) -> usize {
        self.scan(seq.iter().copied(), out)
    }

    fn scan(&self, seqs: impl Iterator<Item = u64>, out: &mut Vec<(usize, usize)>) -> usize {
        out.clear();
        let m = self.map.read().unwrap();
        let mut active = u64::MAX;
        let mut depth = 0;
        for s in seqs {
            let bits = m.get(&s).copied().unwrap_or(0) & active;
            let mut ended = active & !bits;
            if depth > 0 {
                while ended != 0 {
                    out.push((ended.trailing_zeros() as usize, depth));
                    ended &= ended - 1;
                }
            }
            active = bits;
            if active == 0 {
                break;
            }
            depth += 1;
        }
        if depth > 0 {
            while active != 0 {
                out.push((active.trailing_zeros() as usize, depth));
                active &= active - 1;
            }
        }
        depth
    }

    fn heap_bytes(&self) -> usize {
        let m = self.map.read().unwrap();
        m.capacity() * 8 / 7 * (16 + 1)
    }
}

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

struct Data {
    hasher: BlockHasher,
    /// Per stored request: (worker, blocks with engine hash = sequence hash).
    events: Vec<(WorkerId, Vec<StoredBlock>)>,
    /// Query tokens.
    queries: Vec<Vec<u32>>,
    /// Query local hashes.
    query_local: Vec<Vec<u64>>,
}

fn data(requests: usize, queries: usize) -> Data {
    let w = KvWorkload::generate(requests, queries);
    let hasher = BlockHasher::new(w.block_size);
    let events = w
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let local = hasher.local_hashes(r);
            let seq = hasher.chain_local(&local);
            let blocks = local
                .iter()
                .zip(&seq)
                .map(|(&l, &s)| StoredBlock {
                    engine_hash: s,
                    local_hash: l,
                })
                .collect();
            (WorkerId((i % 16) as u64), blocks)
        })
        .collect();
    let query_local = w.queries.iter().map(|q| hasher.local_hashes(q)).collect();
    Data {
        hasher,
        events,
        queries: w.queries,
        query_local,
    }
}

fn build(d: &Data) -> BlockIndex {
    let index = BlockIndex::with_hasher(&d.hasher);
    for (w, blocks) in &d.events {
        index.store_blocks(*w, None, blocks).unwrap();
    }
    index
}

fn build_rw(d: &Data) -> RwIndex {
    let rw = RwIndex::new(d.hasher);
    for (w, blocks) in &d.events {
        let seqs: Vec<u64> = blocks.iter().map(|b| b.engine_hash).collect();
        rw.store(w.0 as usize, &seqs);
    }
    rw
}

/// Blocks a lookup probes: up to and including the first block no worker still matches.
fn probes(max: usize, n: usize) -> usize {
    (max + 1).min(n)
}

/// Runs `f` over the queries split across `threads` threads, three times; returns the best
/// (seconds, Σ f results).
fn timed<F>(threads: usize, n: usize, f: F) -> (f64, usize)
where
    F: Fn(usize, &mut OverlapScores) -> usize + Sync,
{
    let mut best = (f64::MAX, 0);
    for _ in 0..3 {
        let start = Instant::now();
        let total = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let f = &f;
                    s.spawn(move || {
                        let mut out = OverlapScores::new();
                        let mut acc = 0;
                        let mut i = t;
                        while i < n {
                            acc += f(i, &mut out);
                            i += threads;
                        }
                        acc
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        let secs = start.elapsed().as_secs_f64();
        if secs < best.0 {
            best = (secs, total);
        }
    }
    best
}

struct Figures(Vec<(String, f64, &'static str)>);

impl Figures {
    fn add(&mut self, name: &str, value: f64, unit: &'static str) {
        self.0.push((name.to_string(), value, unit));
    }

    /// A table row and a JSON line per figure (`common::figure`: full precision, with the
    /// unit; a value that is not a number prints as `n/a` and JSON `null`).
    fn print(&self) {
        println!("{:<48} {:>16} unit", "figure", "value");
        for (name, v, unit) in &self.0 {
            common::figure(name, *v, unit);
        }
    }
}

pub(crate) fn report(requests: usize, queries: usize) {
    let t0 = Instant::now();
    let d = data(requests, queries);
    let gen_s = t0.elapsed().as_secs_f64();
    let mut fig = Figures(Vec::new());
    let event_blocks: usize = d.events.iter().map(|(_, b)| b.len()).sum();

    // Event blocks applied/s (best of 3 builds) and heap bytes (allocator-measured).
    let mut best = f64::MAX;
    let mut index = None;
    for _ in 0..3 {
        drop(index.take());
        collect_garbage();
        let before = live_bytes();
        let start = Instant::now();
        let built = build(&d);
        best = best.min(start.elapsed().as_secs_f64());
        collect_garbage();
        let measured = live_bytes() - before;
        index = Some((built, measured));
    }
    let (index, measured) = index.unwrap();
    let total = index.total_blocks();
    fig.add(
        "w4_event_blocks_applied_per_s",
        event_blocks as f64 / best,
        "blocks/s",
    );
    fig.add("w4_stored_blocks", total as f64, "blocks");
    fig.add(
        "w4_distinct_blocks",
        index.distinct_blocks() as f64,
        "blocks",
    );
    fig.add(
        "w4_heap_bytes_per_block",
        index.heap_bytes() as f64 / total as f64,
        "B/block",
    );
    fig.add(
        "w4_heap_bytes_per_block_allocator",
        measured as f64 / total as f64,
        "B/block",
    );
    fig.add(
        "w4_heap_bytes_per_event_block",
        index.heap_bytes() as f64 / event_blocks as f64,
        "B/block",
    );

    let n = d.queries.len();
    let n_seq = n.min(20_000);
    let query_seq: Vec<Vec<u64>> = d.query_local[..n_seq]
        .iter()
        .map(|q| d.hasher.chain_local(q))
        .collect();
    for threads in [1, 2] {
        // Hashing excluded: precomputed local hashes.
        let (secs, blocks) = timed(threads, n, |i, out| {
            let q = &d.query_local[i];
            index.find_matches_into(q, out);
            probes(out.max(), q.len())
        });
        fig.add(
            &format!("w4_find_matches_per_s_{threads}t"),
            n as f64 / secs,
            "lookups/s",
        );
        fig.add(
            &format!("w4_block_lookups_per_s_{threads}t"),
            blocks as f64 / secs,
            "blocks/s",
        );
        // Table only: precomputed sequence hashes.
        let (secs, blocks) = timed(threads, n_seq, |i, out| {
            let q = &query_seq[i];
            index.find_matches_seq_into(q, out);
            probes(out.max(), q.len())
        });
        fig.add(
            &format!("w4_block_lookups_per_s_{threads}t_seq"),
            blocks as f64 / secs,
            "blocks/s",
        );
        // Hashing included: from tokens, hashing only the blocks the lookup reaches.
        let (secs, blocks) = timed(threads, n, |i, out| {
            let q = &d.queries[i];
            index.find_matches_tokens_into(q, out);
            probes(out.max(), q.len() / 16)
        });
        fig.add(
            &format!("w4_find_matches_per_s_{threads}t_hashing"),
            n as f64 / secs,
            "lookups/s",
        );
        fig.add(
            &format!("w4_block_lookups_per_s_{threads}t_hashing"),
            blocks as f64 / secs,
            "blocks/s",
        );
        // Hashing included, every block of the request hashed up front (a router that needs
        // the hashes anyway).
        let (secs, _) = timed(threads, n, |i, out| {
            thread_local!(static BUF: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) });
            BUF.with(|b| {
                let mut b = b.borrow_mut();
                d.hasher.local_hashes_into(&d.queries[i], &mut b);
                index.find_matches_into(&b, out);
            });
            0
        });
        fig.add(
            &format!("w4_find_matches_per_s_{threads}t_full_hashing"),
            n as f64 / secs,
            "lookups/s",
        );
    }

    // Competitor.
    let rw = build_rw(&d);
    for threads in [1, 2] {
        let (secs, blocks) = timed(threads, n, |i, _| {
            thread_local!(static OUT: std::cell::RefCell<Vec<(usize, usize)>> = const { std::cell::RefCell::new(Vec::new()) });
            let q = &d.query_local[i];
            OUT.with(|o| probes(rw.find_matches(q, &mut o.borrow_mut()), q.len()))
        });
        fig.add(
            &format!("w4_rwlock_hashmap_block_lookups_per_s_{threads}t"),
            blocks as f64 / secs,
            "blocks/s",
        );
        let (secs, blocks) = timed(threads, n_seq, |i, _| {
            thread_local!(static OUT: std::cell::RefCell<Vec<(usize, usize)>> = const { std::cell::RefCell::new(Vec::new()) });
            let q = &query_seq[i];
            OUT.with(|o| probes(rw.find_matches_seq(q, &mut o.borrow_mut()), q.len()))
        });
        fig.add(
            &format!("w4_rwlock_hashmap_block_lookups_per_s_{threads}t_seq"),
            blocks as f64 / secs,
            "blocks/s",
        );
    }
    fig.add(
        "w4_rwlock_hashmap_heap_bytes_per_distinct_block",
        rw.heap_bytes() as f64 / index.distinct_blocks() as f64,
        "B/block",
    );
    let start = Instant::now();
    black_box(build_rw(&d));
    fig.add(
        "w4_rwlock_hashmap_event_blocks_applied_per_s",
        event_blocks as f64 / start.elapsed().as_secs_f64(),
        "blocks/s",
    );

    // Check: the two indexes agree on a sample.
    let mut out = OverlapScores::new();
    let mut rw_out = Vec::new();
    for q in d.query_local.iter().take(1000) {
        index.find_matches_into(q, &mut out);
        rw.find_matches(q, &mut rw_out);
        rw_out.sort_unstable();
        let mine: Vec<(usize, usize)> = out.iter().map(|(w, s)| (w.0 as usize, s)).collect();
        assert_eq!(mine, rw_out, "BlockIndex and RwLock<HashMap> disagree");
    }

    println!(
        "\nW4 kv: {requests} requests on 16 workers ({event_blocks} event blocks, {total} stored \
         blocks), {n} queries (generated in {gen_s:.1} s)"
    );
    fig.print();
}

/// W4 with the stored requests spread over `workers` workers (request `i` on worker
/// `i % workers`), the block-index memory and lookup figures per worker count. A system prompt
/// is used by about 100 requests, so at 1,024 workers its blocks are held by about 100
/// workers each and a request suffix by one: the "typical sharing" of the worker-scale target.
pub(crate) fn report_workers(requests: usize, queries: usize, worker_counts: &[usize]) {
    let w = KvWorkload::generate(requests, queries);
    let hasher = BlockHasher::new(w.block_size);
    let stored: Vec<Vec<StoredBlock>> = w
        .requests
        .iter()
        .map(|r| {
            let local = hasher.local_hashes(r);
            let seq = hasher.chain_local(&local);
            local
                .iter()
                .zip(&seq)
                .map(|(&l, &s)| StoredBlock {
                    engine_hash: s,
                    local_hash: l,
                })
                .collect()
        })
        .collect();
    let query_local: Vec<Vec<u64>> = w.queries.iter().map(|q| hasher.local_hashes(q)).collect();
    let event_blocks: usize = stored.iter().map(Vec::len).sum();
    let mut fig = Figures(Vec::new());
    for &n in worker_counts {
        collect_garbage();
        let before = live_bytes();
        let start = Instant::now();
        let index = BlockIndex::with_hasher(&hasher);
        for (i, b) in stored.iter().enumerate() {
            index
                .store_blocks(WorkerId((i % n) as u64), None, b)
                .unwrap();
        }
        let build_s = start.elapsed().as_secs_f64();
        collect_garbage();
        let measured = live_bytes() - before;
        let total = index.total_blocks();
        fig.add(
            &format!("w4_{n}w_event_blocks_applied_per_s"),
            event_blocks as f64 / build_s,
            "blocks/s",
        );
        fig.add(
            &format!("w4_{n}w_heap_bytes_per_block"),
            index.heap_bytes() as f64 / total as f64,
            "B/block",
        );
        fig.add(
            &format!("w4_{n}w_heap_bytes_per_block_allocator"),
            measured as f64 / total as f64,
            "B/block",
        );
        fig.add(
            &format!("w4_{n}w_heap_bytes_per_distinct_block"),
            index.heap_bytes() as f64 / index.distinct_blocks() as f64,
            "B/block",
        );
        let (secs, blocks) = timed(1, query_local.len(), |i, out| {
            let q = &query_local[i];
            index.find_matches_into(q, out);
            probes(out.max(), q.len())
        });
        fig.add(
            &format!("w4_{n}w_block_lookups_per_s_1t"),
            blocks as f64 / secs,
            "blocks/s",
        );
    }
    // Many workers with one block each: the per-block cost must not grow with the worker count.
    let many = 16_384usize;
    collect_garbage();
    let before = live_bytes();
    let start = Instant::now();
    let index = BlockIndex::with_hasher(&hasher);
    for i in 0..many {
        index
            .store_blocks(
                WorkerId(i as u64),
                None,
                &[StoredBlock {
                    engine_hash: i as u64 + 1,
                    local_hash: (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                }],
            )
            .unwrap();
    }
    fig.add(
        "w4_16384_workers_one_block_store_s",
        start.elapsed().as_secs_f64(),
        "s",
    );
    collect_garbage();
    fig.add(
        "w4_16384_workers_one_block_heap_bytes_per_block",
        (live_bytes() - before) as f64 / many as f64,
        "B/block",
    );
    println!(
        "\nW4 by worker count: {requests} requests ({event_blocks} event blocks), {} queries",
        query_local.len()
    );
    fig.print();
}

/// What storage tiers and duplicate copies cost: W4 on 16 workers stored (a) on the GPU only,
/// (b) on the GPU and again in the CPU tier (a CPU-offloading engine), (c) twice on the GPU
/// (every block with two copies), (d) on the GPU with every other request then evicted from
/// the GPU but kept on the CPU (mixed tiers along the chains).
pub(crate) fn report_tiers(requests: usize, queries: usize) {
    let d = data(requests, queries);
    let mut fig = Figures(Vec::new());
    type Store = fn(&BlockIndex, usize, WorkerId, &[StoredBlock]);
    let variants: [(&str, Store); 4] = [
        ("gpu", |ix, _, w, b| ix.store_blocks(w, None, b).unwrap()),
        ("gpu_cpu", |ix, _, w, b| {
            ix.store_blocks(w, None, b).unwrap();
            ix.store_blocks_in(w, Tier::Cpu, None, b).unwrap();
        }),
        ("gpu_x2", |ix, _, w, b| {
            ix.store_blocks(w, None, b).unwrap();
            ix.store_blocks(w, None, b).unwrap();
        }),
        ("mixed", |ix, i, w, b| {
            ix.store_blocks(w, None, b).unwrap();
            if i % 2 == 1 {
                ix.store_blocks_in(w, Tier::Cpu, None, b).unwrap();
                // the request's own tail leaves the GPU, its prefix stays
                let tail: Vec<u64> = b[b.len() / 2..].iter().map(|x| x.engine_hash).collect();
                ix.remove_blocks(w, &tail);
            }
        }),
    ];
    let n = d.query_local.len();
    for (name, store) in variants {
        collect_garbage();
        let before = live_bytes();
        let start = Instant::now();
        let index = BlockIndex::with_hasher(&d.hasher);
        for (i, (w, b)) in d.events.iter().enumerate() {
            store(&index, i, *w, b);
        }
        let build_s = start.elapsed().as_secs_f64();
        collect_garbage();
        let measured = live_bytes() - before;
        let total = index.total_blocks();
        fig.add(
            &format!("w4_tiers_{name}_heap_bytes_per_block"),
            measured as f64 / total as f64,
            "B/block",
        );
        fig.add(&format!("w4_tiers_{name}_build_s"), build_s, "s");
        let weights = TierWeights::default();
        let (secs, blocks) = timed(1, n, |i, out| {
            let q = &d.query_local[i];
            index.find_matches_weighted_into(q, &weights, out);
            probes(out.max(), q.len())
        });
        fig.add(
            &format!("w4_tiers_{name}_block_lookups_per_s_1t"),
            blocks as f64 / secs,
            "blocks/s",
        );
    }
    println!("\nW4 tiers and copies: {requests} requests on 16 workers, {n} queries");
    fig.print();
}

/// Lets the epoch reclaimer free retired tables, so heap measurements see only live memory.
fn collect_garbage() {
    let idx = BlockIndex::new();
    for _ in 0..64 {
        idx.collect_garbage();
    }
}

// ---------------------------------------------------------------------------------------------
// Criterion group
// ---------------------------------------------------------------------------------------------

fn w4(c: &mut Criterion) {
    let d = data(2_000, 2_000);
    let index = build(&d);
    let rw = build_rw(&d);
    let batch = 500;
    let blocks: usize = d.query_local[..batch].iter().map(Vec::len).sum();
    let mut g = c.benchmark_group("w4");
    g.throughput(Throughput::Elements(batch as u64));
    g.bench_function(BenchmarkId::new("find_matches", "blockindex"), |b| {
        let mut out = OverlapScores::new();
        b.iter(|| {
            for q in &d.query_local[..batch] {
                index.find_matches_into(black_box(q), &mut out);
            }
        })
    });
    g.bench_function(BenchmarkId::new("find_matches", "rwlock_hashmap"), |b| {
        let mut out = Vec::new();
        b.iter(|| {
            for q in &d.query_local[..batch] {
                black_box(rw.find_matches(black_box(q), &mut out));
            }
        })
    });
    g.bench_function(BenchmarkId::new("find_matches_tokens", "blockindex"), |b| {
        let mut out = OverlapScores::new();
        b.iter(|| {
            for q in &d.queries[..batch] {
                index.find_matches_tokens_into(black_box(q), &mut out);
            }
        })
    });
    let ev = &d.events[..200];
    let ev_blocks: usize = ev.iter().map(|(_, b)| b.len()).sum();
    g.throughput(Throughput::Elements(ev_blocks as u64));
    g.bench_function(BenchmarkId::new("apply_stored", "blockindex"), |b| {
        b.iter(|| {
            let idx = BlockIndex::with_hasher(&d.hasher);
            for (w, blocks) in ev {
                idx.store_blocks(*w, None, blocks).unwrap();
            }
            idx
        })
    });
    g.bench_function(BenchmarkId::new("apply_stored", "rwlock_hashmap"), |b| {
        b.iter(|| {
            let rw = RwIndex::new(d.hasher);
            for (w, blocks) in ev {
                let seqs: Vec<u64> = blocks.iter().map(|b| b.engine_hash).collect();
                rw.store(w.0 as usize, &seqs);
            }
            rw
        })
    });
    g.finish();
    black_box(blocks);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    targets = w4
}

/// `KVTRIE_W4_WORKERS`: the worker counts of the multi-worker figures, comma-separated, each at
/// least 1 (default 16, 256, 1024); anything else ends the program with a message.
fn worker_counts() -> Vec<usize> {
    let Some(v) = std::env::var_os("KVTRIE_W4_WORKERS") else {
        return vec![16, 256, 1024];
    };
    let counts: Option<Vec<usize>> = v.to_str().and_then(|s| {
        s.split(',')
            .map(|x| x.trim().parse().ok().filter(|&n| n >= 1))
            .collect()
    });
    counts.unwrap_or_else(|| {
        eprintln!("KVTRIE_W4_WORKERS={v:?}: expected worker counts of at least 1, comma-separated");
        std::process::exit(2)
    })
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    // `-- --help` and `-- --list` are criterion's: answer them without measuring first.
    let listing = std::env::args().any(|a| matches!(a.as_str(), "--help" | "-h" | "--list"));
    if listing {
        // Nothing measured: criterion answers below.
    } else if bench_mode && !common::figures_wanted() {
        // A criterion filter: its benchmarks only.
    } else if bench_mode {
        // Both settings are checked before anything is measured.
        let queries = common::env_count("KVTRIE_W4_QUERIES", 200_000, 1);
        let workers = worker_counts();
        report(10_000, queries);
        report_workers(10_000, queries.min(20_000), &workers);
        report_tiers(10_000, queries.min(50_000));
    } else {
        // `cargo test --benches`: a smoke run on tiny sizes.
        report(200, 100);
        report_workers(200, 100, &[4, 100]);
        report_tiers(200, 100);
    }
    // `KVTRIE_W4_NO_CRITERION=1`: the figures only.
    if std::env::var_os("KVTRIE_W4_NO_CRITERION").is_none() {
        benches();
        Criterion::default().configure_from_args().final_summary();
    }
}
