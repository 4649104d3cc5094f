//! KV-side soak: a `KvAwareRouter` and its `BlockIndex` under weeks-style write churn; memory
//! must stay flat.
//!
//! ```text
//! cargo run --release --example kv_soak -- [--seconds 120] [--threads 2] [--workers 16]
//!                                           [--capacity 4096] [--every 5]
//! ```
//!
//! Each thread routes W4-style requests (one of 100 system prompts of 2,048 tokens, then
//! 64–1,024 fresh tokens) with `select_and_reserve` over the live workers. The chosen worker's
//! engine (a `sim::LruCache` of `--capacity` GPU blocks, and one of twice that many CPU
//! blocks that a quarter of the requests are offloaded to) caches the request and publishes
//! its `Stored` / `Removed` events, which the index applies in order; then the request's
//! prefill and completion are reported, except for one request in 50, which is lost and left
//! for the reservation TTL (2 s here) to release. Thread 0 also restarts a worker's engine
//! (`Cleared`, both tiers) every 20,000 requests and replaces a worker by a new one
//! (`remove_worker` on the router and the index, a fresh `WorkerId`) every 50,000.
//!
//! So the index keeps `workers × 3 × capacity` engine blocks at most, whatever the run's
//! length. Every `--every` seconds it prints the live heap (a counting global allocator), the
//! index's own heap (`heap_bytes`), its blocks, the router's active bookings and the
//! process's resident set, as a table row and one JSON line. The summary compares the largest
//! live heap, index heap and resident set of the second half of the run with the first
//! half's (after the first report, while the caches fill): flat memory keeps them near 1.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvtrie::blocks::{BlockIndex, KvEvent, Tier, WorkerId};
use kvtrie::router::{KvAwareConfig, KvAwareRouter};
use kvtrie::sim::LruCache;
use kvtrie::workload::{resident_set_bytes, CountingAlloc, SplitMix64};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

/// One request in this many is lost (never completed).
const LOST_EVERY: u64 = 50;
/// Thread 0 clears one worker's cache every this many of its requests.
const CLEAR_EVERY: u64 = 20_000;
/// Thread 0 replaces one worker every this many of its requests.
const REPLACE_EVERY: u64 = 50_000;

struct Args {
    seconds: u64,
    threads: usize,
    workers: usize,
    capacity: usize,
    every: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seconds: 120,
        threads: 2,
        workers: 16,
        capacity: 4096,
        every: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str, max: u64| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .filter(|v| (1..=max).contains(v))
                .ok_or(format!("{name} needs an integer from 1 to {max}"))
        };
        match flag.as_str() {
            "--seconds" => a.seconds = num("--seconds", 365 * 86_400)?,
            "--threads" => a.threads = num("--threads", 256)? as usize,
            "--workers" => a.workers = num("--workers", 4096)? as usize,
            "--capacity" => a.capacity = num("--capacity", 1 << 24)? as usize,
            "--every" => a.every = num("--every", 86_400)?,
            "-h" | "--help" => {
                return Err("usage: kv_soak [--seconds N] [--threads N] [--workers N] \
                            [--capacity BLOCKS] [--every N]"
                    .into())
            }
            other => return Err(format!("unknown flag {other} (try --help)")),
        }
    }
    Ok(a)
}

/// One worker's engine: its id (replaced workers get a new one) and its two cache tiers.
struct Engine {
    id: WorkerId,
    gpu: LruCache,
    cpu: LruCache,
}

impl Engine {
    fn new(id: WorkerId, capacity: usize) -> Self {
        Self {
            id,
            gpu: LruCache::new(capacity),
            cpu: LruCache::new(2 * capacity),
        }
    }
}

struct Cluster {
    router: KvAwareRouter,
    index: Arc<BlockIndex>,
    engines: Vec<Mutex<Engine>>,
    /// The live workers' ids (what a router's worker pool would hold).
    ids: RwLock<Vec<WorkerId>>,
    next_id: AtomicU64,
    capacity: usize,
    system: Vec<Vec<u32>>,
    requests: AtomicU64,
    lost: AtomicU64,
    event_errors: AtomicU64,
}

impl Cluster {
    /// Routes one request and lets its engine cache it.
    fn route(&self, r: &mut SplitMix64, request_id: u64, scratch: &mut Scratch) {
        let mut tokens = self.system[r.below(self.system.len() as u64) as usize].clone();
        let n = 64 + r.below(961) as usize;
        tokens.extend(r.tokens(n));
        let offload = r.below(4) == 0;
        let ids = self.ids.read().expect("ids").clone();
        let s = match self
            .router
            .select_and_reserve(request_id, &tokens, &ids, 128)
        {
            Ok(s) => s,
            Err(e) => panic!("selection failed: {e}"),
        };
        let slot = ids
            .iter()
            .position(|&w| w == s.worker)
            .expect("chosen worker");
        {
            let mut e = self.engines[slot].lock().expect("engine");
            // A worker replaced since the ids were read gets no events (its old id is gone).
            if e.id == s.worker {
                let h = self.router.hasher();
                h.local_hashes_into(&tokens, &mut scratch.local);
                h.chain_local_into(&scratch.local, &mut scratch.seq);
                scratch.events.clear();
                e.gpu
                    .insert(&scratch.seq, &scratch.local, &mut scratch.events);
                self.apply(e.id, Tier::Gpu, &mut scratch.events);
                if offload {
                    e.cpu
                        .insert(&scratch.seq, &scratch.local, &mut scratch.events);
                    self.apply(e.id, Tier::Cpu, &mut scratch.events);
                }
            }
        }
        if request_id.is_multiple_of(LOST_EVERY) {
            self.lost.fetch_add(1, Ordering::Relaxed);
        } else {
            self.router.prefill_complete(request_id);
            self.router.request_complete(request_id);
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    fn apply(&self, w: WorkerId, tier: Tier, events: &mut Vec<KvEvent>) {
        for ev in events.drain(..) {
            if self.index.apply_in(w, tier, ev).is_err() {
                self.event_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The engine in `slot` restarts with an empty cache (both tiers).
    fn clear(&self, slot: usize) {
        let mut e = self.engines[slot].lock().expect("engine");
        let id = e.id;
        *e = Engine::new(id, self.capacity);
        for tier in [Tier::Gpu, Tier::Cpu] {
            if self.index.apply_in(id, tier, KvEvent::Cleared).is_err() {
                self.event_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The worker in `slot` leaves the pool; a new worker (a new id) takes its place.
    fn replace(&self, slot: usize) {
        let mut ids = self.ids.write().expect("ids");
        let mut e = self.engines[slot].lock().expect("engine");
        let old = e.id;
        self.router.remove_worker(old);
        self.index.remove_worker(old);
        let new = WorkerId(self.next_id.fetch_add(1, Ordering::Relaxed));
        *e = Engine::new(new, self.capacity);
        ids[slot] = new;
    }
}

#[derive(Default)]
struct Scratch {
    local: Vec<u64>,
    seq: Vec<u64>,
    events: Vec<KvEvent>,
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
    let config = KvAwareConfig {
        reservation_ttl: Duration::from_secs(2),
        ..KvAwareConfig::new(16)
    };
    let index = Arc::new(BlockIndex::with_hasher(&config.hasher()));
    let router = KvAwareRouter::with_index(Arc::clone(&index), config);
    let mut r = SplitMix64::new(1337);
    let system = (0..100).map(|_| r.tokens(2048)).collect();
    let ids: Vec<WorkerId> = (0..args.workers as u64).map(WorkerId).collect();
    let cluster = Arc::new(Cluster {
        router,
        index,
        engines: ids
            .iter()
            .map(|&w| Mutex::new(Engine::new(w, args.capacity)))
            .collect(),
        ids: RwLock::new(ids),
        next_id: AtomicU64::new(args.workers as u64),
        capacity: args.capacity,
        system,
        requests: AtomicU64::new(0),
        lost: AtomicU64::new(0),
        event_errors: AtomicU64::new(0),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..args.threads)
        .map(|t| {
            let (cluster, stop) = (Arc::clone(&cluster), Arc::clone(&stop));
            let workers = args.workers;
            std::thread::spawn(move || {
                let mut r = SplitMix64::new(7 + t as u64);
                let mut scratch = Scratch::default();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Request ids: unique over the threads.
                    let id = n * 256 + t as u64;
                    cluster.route(&mut r, id, &mut scratch);
                    n += 1;
                    if t == 0 && n.is_multiple_of(CLEAR_EVERY) {
                        cluster.clear(r.below(workers as u64) as usize);
                    }
                    if t == 0 && n.is_multiple_of(REPLACE_EVERY) {
                        cluster.replace(r.below(workers as u64) as usize);
                    }
                }
            })
        })
        .collect();
    println!(
        "KV soak: {} threads, {} workers of {} GPU + {} CPU blocks, {} s",
        args.threads,
        args.workers,
        args.capacity,
        2 * args.capacity,
        args.seconds
    );
    println!(
        "{:>6} {:>10} {:>10} {:>10} {:>11} {:>8} {:>9} {:>8} {:>8}",
        "t (s)",
        "requests",
        "live MB",
        "index MB",
        "blocks",
        "B/block",
        "bookings",
        "workers",
        "RSS MB"
    );
    let start = Instant::now();
    // The largest live heap, index heap and resident set in each half of the run.
    let mut max = [[0usize; 3]; 2];
    let mut next_report = Duration::from_secs(args.every);
    let end = Duration::from_secs(args.seconds);
    while start.elapsed() < end {
        std::thread::sleep(Duration::from_millis(50));
        if start.elapsed() < next_report {
            continue;
        }
        let t = next_report.as_secs();
        next_report += Duration::from_secs(args.every);
        cluster.index.collect_garbage();
        let live = ALLOC.live().saturating_sub(base);
        let heap = cluster.index.heap_bytes();
        let blocks = cluster.index.total_blocks();
        let workers = cluster.index.workers().len();
        let bookings = cluster.router.stats().active_requests;
        let rss = resident_set_bytes().unwrap_or(0);
        let requests = cluster.requests.load(Ordering::Relaxed);
        // Steady state: after the first report.
        if t > args.every {
            let half = usize::from(2 * t > args.seconds);
            for (m, v) in max[half].iter_mut().zip([live, heap, rss]) {
                *m = (*m).max(v);
            }
        }
        println!(
            "{:>6} {:>10} {:>10.1} {:>10.1} {:>11} {:>8.1} {:>9} {:>8} {:>8.1}",
            t,
            requests,
            mb(live),
            mb(heap),
            blocks,
            heap as f64 / blocks.max(1) as f64,
            bookings,
            workers,
            mb(rss)
        );
        println!(
            "{{\"figure\":\"kv_soak\",\"threads\":{},\"t_s\":{},\"requests\":{},\"live_bytes\":{},\"index_heap_bytes\":{},\"index_blocks\":{},\"bookings\":{},\"index_workers\":{},\"rss_bytes\":{}}}",
            args.threads, t, requests, live, heap, blocks, bookings, workers, rss
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("router thread");
    }
    let secs = start.elapsed().as_secs_f64();
    let requests = cluster.requests.load(Ordering::Relaxed);
    // "n/a" (JSON null) when either half had no report (a run shorter than two reports) or the
    // figure is unreadable: never a made-up ratio.
    let growth = |i: usize, json: bool| {
        if max[0][i] > 0 && max[1][i] > 0 {
            format!("{:.3}", max[1][i] as f64 / max[0][i] as f64)
        } else if json {
            "null".to_string()
        } else {
            "n/a".to_string()
        }
    };
    println!(
        "requests {requests} ({:.0}/s), lost {}, event errors {}; second half ÷ first half, \
         largest: live heap {}, index heap {}, resident set {}",
        requests as f64 / secs,
        cluster.lost.load(Ordering::Relaxed),
        cluster.event_errors.load(Ordering::Relaxed),
        growth(0, false),
        growth(1, false),
        growth(2, false)
    );
    println!(
        "{{\"figure\":\"kv_soak_summary\",\"threads\":{},\"seconds\":{},\"requests\":{},\"event_errors\":{},\"live_growth\":{},\"index_heap_growth\":{},\"rss_growth\":{}}}",
        args.threads,
        args.seconds,
        requests,
        cluster.event_errors.load(Ordering::Relaxed),
        growth(0, true),
        growth(1, true),
        growth(2, true)
    );
}
