//! Simulator core: traffic generator, per-replica LRU prefix cache, event-driven cluster model,
//! routing policies and per-policy metrics.
//!
//! This module has no dependency beyond `kvtrie` and `std`, so `tests/sim.rs` includes it with
//! `#[path]`; the progress bar, tables, JSON and plots live in `main.rs`. See `main.rs` for the
//! model in prose.

#![allow(dead_code)] // shared by the example and the tests; each uses a different subset

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvtrie::router::{
    Candidate, KvAwareConfig, KvAwareRouter, PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId,
};
use kvtrie::workload::SplitMix64;
use kvtrie::{BlockHasher, KvEvent, StoredBlock, WorkerId};

/// Tokens per KV block (vLLM's and Dynamo's default).
pub const BLOCK_SIZE: usize = 16;
/// Token ids are drawn from `0..VOCAB` (the W4 vocabulary).
pub const VOCAB: u64 = 32_000;
/// Every token is rendered as this many lowercase letters (base 26, fixed width), so two
/// prompts share a token prefix exactly when their texts share the rendered prefix.
pub const CHARS_PER_TOKEN: usize = 4;

/// Simulated time, in microseconds.
pub type Micros = u64;

// ============================================================================================
// Configuration
// ============================================================================================

/// Everything that defines one simulation (traffic, cluster and cost model).
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Number of replicas.
    pub replicas: usize,
    /// Number of requests (turns) to simulate.
    pub requests: usize,
    /// Mean request arrival rate, requests per simulated second.
    pub rate: f64,
    /// Prefix-cache capacity of each replica, in blocks of [`BLOCK_SIZE`] tokens.
    pub cache_blocks: usize,
    /// Seed of the traffic generator (and of the power-of-two policy).
    pub seed: u64,
    /// Requests a replica serves at once; the rest wait in its FIFO queue.
    pub max_running: usize,
    /// Number of distinct system prompts.
    pub system_prompts: usize,
    /// Tokens per system prompt.
    pub system_tokens: usize,
    /// A conversation has `1..=max_turns` turns (uniform).
    pub max_turns: usize,
    /// User text appended per turn: `min..=max` tokens (uniform).
    pub user_tokens: (usize, usize),
    /// Response tokens per turn: `min..=max` (uniform); they are part of the next turn's prompt.
    pub output_tokens: (usize, usize),
    /// Gap between two turns' arrivals: `think_min_s` + exponential with mean `think_mean_s`.
    pub think_min_s: f64,
    /// Mean of the exponential part of the think time.
    pub think_mean_s: f64,
    /// Fixed cost of a prefill, µs.
    pub prefill_overhead_us: f64,
    /// Prefill cost per uncached prompt token, µs.
    pub prefill_us_per_token: f64,
    /// Decode cost per output token, µs.
    pub decode_us_per_token: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            replicas: 8,
            requests: 4000,
            rate: 60.0,
            cache_blocks: 2048,
            seed: 7,
            max_running: 8,
            system_prompts: 32,
            system_tokens: 1024,
            max_turns: 8,
            user_tokens: (32, 288),
            output_tokens: (16, 128),
            think_min_s: 2.0,
            think_mean_s: 6.0,
            prefill_overhead_us: 5_000.0,
            prefill_us_per_token: 250.0,
            decode_us_per_token: 10_000.0,
        }
    }
}

impl SimConfig {
    /// Prefill time for a prompt with `uncached` tokens to compute.
    pub fn prefill_us(&self, uncached: usize) -> Micros {
        (self.prefill_overhead_us + self.prefill_us_per_token * uncached as f64).round() as Micros
    }

    /// Decode time for `output` tokens.
    pub fn decode_us(&self, output: usize) -> Micros {
        (self.decode_us_per_token * output as f64).round() as Micros
    }
}

// ============================================================================================
// Traffic
// ============================================================================================

/// One conversation: its whole token stream (system prompt, then user text and response per
/// turn), the same stream rendered as text, and its block hashes. Turn `k`'s prompt is a prefix
/// of the stream, so these are stored once per conversation.
#[derive(Clone, Debug)]
pub struct Conversation {
    /// Index of the system prompt it starts with.
    pub system: usize,
    /// The token stream.
    pub tokens: Vec<u32>,
    /// `tokens` rendered with [`render_token`] (`CHARS_PER_TOKEN` chars per token).
    pub text: String,
    /// Local (per-block) hashes of the stream's full blocks.
    pub local_hashes: Vec<u64>,
    /// Sequence (chained) hashes of the stream's full blocks.
    pub seq_hashes: Vec<u64>,
}

/// One request: turn `turn` of conversation `conv`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Dense id, in arrival order.
    pub id: u64,
    /// Conversation index.
    pub conv: usize,
    /// Turn number within the conversation (0-based).
    pub turn: usize,
    /// Arrival time.
    pub arrival_us: Micros,
    /// Prompt length in tokens (a prefix of the conversation's stream).
    pub prompt_tokens: usize,
    /// Response length in tokens (they follow the prompt in the stream).
    pub output_tokens: usize,
}

/// The whole traffic of a run; every policy is simulated on the same `Traffic`.
#[derive(Clone, Debug)]
pub struct Traffic {
    /// The conversations.
    pub conversations: Vec<Conversation>,
    /// The requests, sorted by arrival time (ids are their indices).
    pub requests: Vec<Request>,
}

/// Renders one token as `CHARS_PER_TOKEN` lowercase letters (fixed width, injective on `0..VOCAB`).
pub fn render_token(t: u32, out: &mut String) {
    let mut x = t;
    for _ in 0..CHARS_PER_TOKEN {
        out.push((b'a' + (x % 26) as u8) as char);
        x /= 26;
    }
}

/// Renders a token sequence (see [`render_token`]).
pub fn render(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * CHARS_PER_TOKEN);
    for &t in tokens {
        render_token(t, &mut s);
    }
    s
}

/// A uniform `f64` in `[0, 1)`.
fn unit(r: &mut SplitMix64) -> f64 {
    (r.next() >> 11) as f64 / (1u64 << 53) as f64
}

/// An exponential variate with the given mean.
fn exponential(r: &mut SplitMix64, mean: f64) -> f64 {
    -mean * (1.0 - unit(r)).ln()
}

fn uniform(r: &mut SplitMix64, (lo, hi): (usize, usize)) -> usize {
    lo + r.below((hi - lo + 1) as u64) as usize
}

impl Traffic {
    /// Generates the traffic of `cfg` (deterministic in `cfg.seed`).
    ///
    /// Conversations start as a Poisson process of rate `rate / mean turns`, so requests arrive
    /// at about `rate` per second; each picks a system prompt uniformly and has `1..=max_turns`
    /// turns; a turn appends user text, and its response (generated here too, so every policy
    /// sees identical prompts) is appended after it; the next turn arrives a think time later.
    pub fn generate(cfg: &SimConfig) -> Self {
        assert!(cfg.rate > 0.0, "rate must be positive");
        assert!(cfg.max_turns > 0 && cfg.system_prompts > 0);
        let mut r = SplitMix64::new(cfg.seed);
        let hasher = BlockHasher::new(BLOCK_SIZE);
        let tokens = |r: &mut SplitMix64, n: usize| -> Vec<u32> {
            (0..n).map(|_| r.below(VOCAB) as u32).collect()
        };
        let system: Vec<Vec<u32>> = (0..cfg.system_prompts)
            .map(|_| tokens(&mut r, cfg.system_tokens))
            .collect();
        let mean_turns = (cfg.max_turns as f64 + 1.0) / 2.0;
        let mut start_s = 0.0f64;
        let mut conversations = Vec::new();
        let mut requests = Vec::with_capacity(cfg.requests);
        while requests.len() < cfg.requests {
            start_s += exponential(&mut r, mean_turns / cfg.rate);
            let sys = r.below(cfg.system_prompts as u64) as usize;
            let turns = 1 + r.below(cfg.max_turns as u64) as usize;
            let conv = conversations.len();
            let mut stream = system[sys].clone();
            let mut at = start_s;
            for turn in 0..turns {
                if requests.len() == cfg.requests {
                    break;
                }
                let n = uniform(&mut r, cfg.user_tokens);
                stream.extend(tokens(&mut r, n));
                let prompt_tokens = stream.len();
                let out = uniform(&mut r, cfg.output_tokens);
                stream.extend(tokens(&mut r, out));
                requests.push(Request {
                    id: 0,
                    conv,
                    turn,
                    arrival_us: (at * 1e6).round() as Micros,
                    prompt_tokens,
                    output_tokens: out,
                });
                at += cfg.think_min_s + exponential(&mut r, cfg.think_mean_s);
            }
            let local_hashes = hasher.local_hashes(&stream);
            let seq_hashes = hasher.chain_local(&local_hashes);
            conversations.push(Conversation {
                system: sys,
                text: render(&stream),
                tokens: stream,
                local_hashes,
                seq_hashes,
            });
        }
        requests.sort_by_key(|q| (q.arrival_us, q.conv, q.turn));
        for (i, q) in requests.iter_mut().enumerate() {
            q.id = i as u64;
        }
        Self {
            conversations,
            requests,
        }
    }

    /// The prompt of `req` as tokens and as text.
    pub fn prompt(&self, req: &Request) -> (&[u32], &str) {
        let c = &self.conversations[req.conv];
        (
            &c.tokens[..req.prompt_tokens],
            &c.text[..req.prompt_tokens * CHARS_PER_TOKEN],
        )
    }

    /// Sequence and local hashes of the full blocks of the first `tokens` tokens of `req`'s
    /// conversation.
    pub fn blocks(&self, req: &Request, tokens: usize) -> (&[u64], &[u64]) {
        let c = &self.conversations[req.conv];
        let n = tokens / BLOCK_SIZE;
        (&c.seq_hashes[..n], &c.local_hashes[..n])
    }

    /// Total prompt tokens over all requests.
    pub fn prompt_tokens(&self) -> u64 {
        self.requests.iter().map(|q| q.prompt_tokens as u64).sum()
    }
}

// ============================================================================================
// LRU prefix cache
// ============================================================================================

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Slot {
    hash: u64,
    prev: u32, // towards MRU
    next: u32, // towards LRU
}

/// A replica's KV prefix cache: at most `capacity` blocks keyed by **sequence** hash, evicted
/// least-recently-used first.
///
/// Because keys are chained hashes, a block is reusable only when every block before it is
/// cached too: [`Self::lookup`] counts leading cached blocks. Touching a sequence marks its
/// blocks used in reverse order, so its first block is the most recent: a sequence's tail is
/// evicted before its head (vLLM frees a request's blocks in reverse order for the same reason).
///
/// [`Self::insert`] reports the changes as the [`KvEvent`]s an engine would publish: one
/// `Removed` for the blocks evicted to make room, then one `Stored` per run of newly cached
/// blocks, chained to the block before the run (engine hash = sequence hash).
#[derive(Clone, Debug)]
pub struct LruCache {
    capacity: usize,
    map: HashMap<u64, u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    head: u32, // MRU
    tail: u32, // LRU
}

impl LruCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            map: HashMap::with_capacity(capacity),
            slots: Vec::with_capacity(capacity),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no block is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether the block with this sequence hash is cached.
    pub fn contains(&self, seq_hash: u64) -> bool {
        self.map.contains_key(&seq_hash)
    }

    /// The cached blocks from most to least recently used.
    pub fn mru_order(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len());
        let mut i = self.head;
        while i != NIL {
            out.push(self.slots[i as usize].hash);
            i = self.slots[i as usize].next;
        }
        out
    }

    /// The number of leading blocks of `seq` that are cached, without touching anything.
    pub fn cached_prefix(&self, seq: &[u64]) -> usize {
        seq.iter().take_while(|h| self.map.contains_key(h)).count()
    }

    /// The number of leading blocks of `seq` that are cached (a prefix-cache hit); those blocks
    /// become the most recently used, the first one most recent of all.
    pub fn lookup(&mut self, seq: &[u64]) -> usize {
        let n = self.cached_prefix(seq);
        for h in seq[..n].iter().rev() {
            let i = self.map[h];
            self.move_to_front(i);
        }
        n
    }

    /// Caches the blocks of a sequence (`seq[i]` chained, `local[i]` its local hash); only the
    /// first `capacity` blocks fit. Every block of `seq` ends up cached and most recently used,
    /// in reverse order. The engine events of the change are appended to `events`.
    pub fn insert(&mut self, seq: &[u64], local: &[u64], events: &mut Vec<KvEvent>) {
        debug_assert_eq!(seq.len(), local.len());
        let seq = &seq[..seq.len().min(self.capacity)];
        // 1. Cached blocks of the sequence become MRU. The evictions below remove
        //    `len + missing - capacity` blocks from the LRU end; since `seq.len() <= capacity`,
        //    that is at most `len - (seq.len() - missing)`: only blocks outside `seq`.
        let mut missing = 0;
        for h in seq.iter().rev() {
            match self.map.get(h) {
                Some(&i) => self.move_to_front(i),
                None => missing += 1,
            }
        }
        // 2. Evict to make room.
        let over = (self.len() + missing).saturating_sub(self.capacity);
        if over > 0 {
            let mut removed = Vec::with_capacity(over);
            for _ in 0..over {
                removed.push(self.pop_lru());
            }
            events.push(KvEvent::Removed {
                engine_hashes: removed,
            });
        }
        // 3. Store the missing blocks, one event per run.
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = None;
        for (i, (&h, &l)) in seq.iter().zip(local).enumerate() {
            if self.map.contains_key(&h) {
                if !run.is_empty() {
                    events.push(KvEvent::Stored {
                        parent: run_parent,
                        blocks: std::mem::take(&mut run),
                    });
                }
                continue;
            }
            if run.is_empty() {
                run_parent = if i == 0 { None } else { Some(seq[i - 1]) };
            }
            run.push(StoredBlock {
                engine_hash: h,
                local_hash: l,
            });
            self.push_front(h);
        }
        if !run.is_empty() {
            events.push(KvEvent::Stored {
                parent: run_parent,
                blocks: run,
            });
        }
        // 4. Final recency: the first block most recent.
        for h in seq.iter().rev() {
            let i = self.map[h];
            self.move_to_front(i);
        }
    }

    fn unlink(&mut self, i: u32) {
        let Slot { prev, next, .. } = self.slots[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
    }

    fn link_front(&mut self, i: u32) {
        self.slots[i as usize].prev = NIL;
        self.slots[i as usize].next = self.head;
        if self.head != NIL {
            self.slots[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    fn move_to_front(&mut self, i: u32) {
        if self.head != i {
            self.unlink(i);
            self.link_front(i);
        }
    }

    fn push_front(&mut self, hash: u64) {
        let slot = Slot {
            hash,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.map.insert(hash, i);
        self.link_front(i);
    }

    fn pop_lru(&mut self) -> u64 {
        let i = self.tail;
        assert!(i != NIL, "pop from an empty cache");
        self.unlink(i);
        let h = self.slots[i as usize].hash;
        self.map.remove(&h);
        self.free.push(i);
        h
    }
}

// ============================================================================================
// Event-driven clock
// ============================================================================================

struct Entry<E> {
    time: Micros,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.time, self.seq) == (other.time, other.seq)
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap, we pop the earliest (then first inserted).
        (other.time, other.seq).cmp(&(self.time, self.seq))
    }
}

/// A priority queue of timed events: pops in time order, ties in insertion order.
pub struct EventQueue<E> {
    heap: BinaryHeap<Entry<E>>,
    next_seq: u64,
    now: Micros,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> EventQueue<E> {
    /// An empty queue at time 0.
    pub fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            next_seq: 0,
            now: 0,
        }
    }

    /// Schedules `event` at `time` (not before the current time).
    pub fn push(&mut self, time: Micros, event: E) {
        debug_assert!(time >= self.now, "event scheduled in the past");
        self.heap.push(Entry {
            time,
            seq: self.next_seq,
            event,
        });
        self.next_seq += 1;
    }

    /// The earliest event (the first scheduled among equal times); advances the clock.
    pub fn pop(&mut self) -> Option<(Micros, E)> {
        let e = self.heap.pop()?;
        self.now = e.time;
        Some((e.time, e.event))
    }

    /// Time of the last popped event.
    pub fn now(&self) -> Micros {
        self.now
    }

    /// Pending events.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

// ============================================================================================
// Replica
// ============================================================================================

/// A replica: a prefix cache, at most `max_running` requests in service, a FIFO queue for the
/// rest.
#[derive(Clone, Debug)]
pub struct Replica {
    /// Its prefix cache.
    pub cache: LruCache,
    max_running: usize,
    running: usize,
    waiting: VecDeque<usize>,
    /// Requests routed to it.
    pub assigned: u64,
}

impl Replica {
    /// An idle replica.
    pub fn new(cache_blocks: usize, max_running: usize) -> Self {
        assert!(max_running > 0);
        Self {
            cache: LruCache::new(cache_blocks),
            max_running,
            running: 0,
            waiting: VecDeque::new(),
            assigned: 0,
        }
    }

    /// Accepts request `req`: returns it if it starts now, else queues it and returns `None`.
    pub fn submit(&mut self, req: usize) -> Option<usize> {
        self.assigned += 1;
        if self.running < self.max_running {
            self.running += 1;
            Some(req)
        } else {
            self.waiting.push_back(req);
            None
        }
    }

    /// A running request finished: frees its slot and returns the queued request that takes
    /// it, if any (first come, first served).
    pub fn finish(&mut self) -> Option<usize> {
        assert!(self.running > 0, "finish without a running request");
        self.running -= 1;
        let next = self.waiting.pop_front()?;
        self.running += 1;
        Some(next)
    }

    /// Requests in service.
    pub fn running(&self) -> usize {
        self.running
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in service or waiting (the "queue length" routers see).
    pub fn load(&self) -> usize {
        self.running + self.waiting.len()
    }
}

// ============================================================================================
// Policies
// ============================================================================================

/// What a policy sees of a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Request id.
    pub id: u64,
    /// Prompt tokens.
    pub tokens: &'a [u32],
    /// Prompt text (the tokens rendered).
    pub text: &'a str,
    /// Response length (known to the simulator; routers may use it as the expected length).
    pub output_tokens: usize,
}

/// A routing policy under simulation. Only [`Policy::route`] is timed.
pub trait Policy {
    /// Display name.
    fn name(&self) -> &str;
    /// Picks a replica index in `0..loads.len()`; `loads[i]` is replica `i`'s queue length
    /// (running + waiting).
    fn route(&mut self, req: &RouteRequest<'_>, loads: &[usize]) -> usize;
    /// KV events replica `replica`'s cache just published.
    fn kv_events(&mut self, _replica: usize, _events: &[KvEvent]) {}
    /// The request's prefill finished (its first token was produced).
    fn prefill_complete(&mut self, _id: u64) {}
    /// The request finished.
    fn request_complete(&mut self, _id: u64) {}
}

/// Round-robin over the replicas.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn route(&mut self, _req: &RouteRequest<'_>, loads: &[usize]) -> usize {
        let r = self.next % loads.len();
        self.next = self.next.wrapping_add(1);
        r
    }
}

/// Power of two choices on queue length: two distinct replicas drawn at random (seeded), the
/// shorter queue wins (the first drawn on ties).
#[derive(Debug)]
pub struct PowerOfTwo {
    rng: SplitMix64,
}

impl PowerOfTwo {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix64::new(seed),
        }
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &str {
        "power-of-two"
    }
    fn route(&mut self, _req: &RouteRequest<'_>, loads: &[usize]) -> usize {
        let n = loads.len() as u64;
        if n == 1 {
            return 0;
        }
        let a = self.rng.below(n) as usize;
        let b = (a + 1 + self.rng.below(n - 1) as usize) % n as usize;
        if loads[b] < loads[a] {
            b
        } else {
            a
        }
    }
}

/// [`PrefixAffinityRouter`] (Ray's policy, or SGLang's with [`PrefixAffinityConfig::sglang`]):
/// routes on the prompt text with the replicas' queue lengths; learns only from its own
/// decisions (it is not fed the caches' events, as in Ray and SGLang).
pub struct PrefixAffinity {
    name: String,
    router: PrefixAffinityRouter,
    ids: Vec<ReplicaId>,
    candidates: Vec<Candidate>,
}

impl PrefixAffinity {
    /// A router over `replicas` replicas named `replica-0`...
    pub fn new(name: &str, config: PrefixAffinityConfig, replicas: usize) -> Self {
        let router = PrefixAffinityRouter::new(config);
        let names: Vec<String> = (0..replicas).map(|i| format!("replica-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let ids = router.update_replicas(&refs);
        Self {
            name: name.to_string(),
            router,
            ids,
            candidates: Vec::with_capacity(replicas),
        }
    }

    /// The router.
    pub fn router(&self) -> &PrefixAffinityRouter {
        &self.router
    }
}

impl Policy for PrefixAffinity {
    fn name(&self) -> &str {
        &self.name
    }
    fn route(&mut self, req: &RouteRequest<'_>, loads: &[usize]) -> usize {
        self.candidates.clear();
        self.candidates.extend(
            self.ids
                .iter()
                .zip(loads)
                .map(|(&id, &l)| Candidate::new(id, l)),
        );
        let route = self
            .router
            .route(req.text, &self.candidates)
            .expect("every candidate is a live replica");
        self.ids
            .iter()
            .position(|&id| id == route.replica)
            .expect("the router returns a candidate")
    }
}

/// [`KvAwareRouter`] (Dynamo's cost policy): its `BlockIndex` is fed the caches' KV events as
/// they happen; the booking is released by `prefill_complete` / `request_complete` at the
/// simulated times. The expected output length passed to it is the true one (an oracle).
pub struct KvAware {
    router: KvAwareRouter,
    workers: Vec<WorkerId>,
}

impl KvAware {
    /// A router over workers `WorkerId(0)..WorkerId(replicas)`, Dynamo's defaults
    /// (overlap weight 1, temperature 0) with [`BLOCK_SIZE`]-token blocks.
    pub fn new(replicas: usize) -> Self {
        Self {
            router: KvAwareRouter::new(KvAwareConfig::new(BLOCK_SIZE)),
            workers: (0..replicas as u64).map(WorkerId).collect(),
        }
    }

    /// The router.
    pub fn router(&self) -> &KvAwareRouter {
        &self.router
    }
}

impl Policy for KvAware {
    fn name(&self) -> &str {
        "kv-aware"
    }
    fn route(&mut self, req: &RouteRequest<'_>, _loads: &[usize]) -> usize {
        let s = self
            .router
            .select_and_reserve(req.id, req.tokens, &self.workers, req.output_tokens)
            .expect("non-empty prompt and workers");
        s.worker.0 as usize
    }
    fn kv_events(&mut self, replica: usize, events: &[KvEvent]) {
        for e in events {
            self.router
                .index()
                .apply(self.workers[replica], e.clone())
                .expect("the cache only chains blocks to parents it has announced");
        }
    }
    fn prefill_complete(&mut self, id: u64) {
        self.router.prefill_complete(id);
    }
    fn request_complete(&mut self, id: u64) {
        self.router.request_complete(id);
    }
}

/// The policies compared by the simulator, in display order.
pub fn standard_policies(cfg: &SimConfig) -> Vec<Box<dyn Policy>> {
    vec![
        Box::new(RoundRobin::default()),
        Box::new(PowerOfTwo::new(cfg.seed ^ 0x5EED)),
        Box::new(PrefixAffinity::new(
            "prefix-affinity (ray)",
            PrefixAffinityConfig::default(),
            cfg.replicas,
        )),
        Box::new(PrefixAffinity::new(
            "prefix-affinity (sglang)",
            PrefixAffinityConfig::sglang(),
            cfg.replicas,
        )),
        Box::new(KvAware::new(cfg.replicas)),
    ]
}

// ============================================================================================
// Simulation
// ============================================================================================

/// Per-policy results.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Policy name.
    pub policy: String,
    /// Requests completed.
    pub requests: u64,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens served from a replica's prefix cache.
    pub cached_tokens: u64,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// 99th percentile time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Requests routed to each replica.
    pub per_replica: Vec<u64>,
    /// Simulated time until the last request finished, s.
    pub makespan_s: f64,
    /// KV events published by all caches.
    pub kv_events: u64,
    /// Wall-clock time spent inside the policy's routing call.
    pub route_time: Duration,
    /// Time to first token of every request (by request id), ms.
    pub ttft_ms: Vec<f64>,
}

impl Report {
    /// Cached prompt tokens / prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }

    /// Max / mean requests per replica (1.0 = perfectly balanced).
    pub fn load_balance(&self) -> f64 {
        let max = self.per_replica.iter().copied().max().unwrap_or(0) as f64;
        let mean = self.per_replica.iter().sum::<u64>() as f64 / self.per_replica.len() as f64;
        if mean == 0.0 {
            0.0
        } else {
            max / mean
        }
    }

    /// Routing decisions per wall-clock second spent routing.
    pub fn decisions_per_sec(&self) -> f64 {
        let s = self.route_time.as_secs_f64();
        if s == 0.0 {
            f64::INFINITY
        } else {
            self.requests as f64 / s
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Arrival(usize),
    PrefillDone(usize, usize),
    Complete(usize, usize),
}

/// Value at quantile `q` (nearest rank) of sorted `v`.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Runs `traffic` through a fresh cluster routed by `policy`; `progress` is called once per
/// completed request.
pub fn simulate(
    cfg: &SimConfig,
    traffic: &Traffic,
    policy: &mut dyn Policy,
    progress: &mut dyn FnMut(),
) -> Report {
    let mut replicas: Vec<Replica> = (0..cfg.replicas)
        .map(|_| Replica::new(cfg.cache_blocks, cfg.max_running))
        .collect();
    let mut q = EventQueue::new();
    for (i, r) in traffic.requests.iter().enumerate() {
        q.push(r.arrival_us, Ev::Arrival(i));
    }
    let mut loads = vec![0usize; cfg.replicas];
    let mut ttft = vec![f64::NAN; traffic.requests.len()];
    let mut events = Vec::new();
    let mut route_time = Duration::ZERO;
    let (mut cached_tokens, mut kv_events, mut done, mut end) = (0u64, 0u64, 0u64, 0);

    // Starts request `i` on replica `r` at `now`: prefix-cache lookup, prefill scheduled.
    let start = |i: usize,
                 r: usize,
                 now: Micros,
                 replicas: &mut [Replica],
                 q: &mut EventQueue<Ev>,
                 ttft: &mut [f64],
                 cached_tokens: &mut u64| {
        let req = &traffic.requests[i];
        let (seq, _) = traffic.blocks(req, req.prompt_tokens);
        let hit = replicas[r].cache.lookup(seq) * BLOCK_SIZE;
        *cached_tokens += hit as u64;
        let t = now + cfg.prefill_us(req.prompt_tokens - hit);
        ttft[i] = (t - req.arrival_us) as f64 / 1e3;
        q.push(t, Ev::PrefillDone(r, i));
    };

    while let Some((now, ev)) = q.pop() {
        match ev {
            Ev::Arrival(i) => {
                let req = &traffic.requests[i];
                let (tokens, text) = traffic.prompt(req);
                let view = RouteRequest {
                    id: req.id,
                    tokens,
                    text,
                    output_tokens: req.output_tokens,
                };
                for (l, r) in loads.iter_mut().zip(&replicas) {
                    *l = r.load();
                }
                let t0 = Instant::now();
                let r = policy.route(&view, &loads);
                route_time += t0.elapsed();
                assert!(
                    r < cfg.replicas,
                    "policy chose replica {r} of {}",
                    cfg.replicas
                );
                if let Some(i) = replicas[r].submit(i) {
                    start(
                        i,
                        r,
                        now,
                        &mut replicas,
                        &mut q,
                        &mut ttft,
                        &mut cached_tokens,
                    );
                }
            }
            Ev::PrefillDone(r, i) => {
                let req = &traffic.requests[i];
                let (seq, local) = traffic.blocks(req, req.prompt_tokens);
                events.clear();
                replicas[r].cache.insert(seq, local, &mut events);
                kv_events += events.len() as u64;
                policy.kv_events(r, &events);
                policy.prefill_complete(req.id);
                q.push(now + cfg.decode_us(req.output_tokens), Ev::Complete(r, i));
            }
            Ev::Complete(r, i) => {
                let req = &traffic.requests[i];
                let (seq, local) = traffic.blocks(req, req.prompt_tokens + req.output_tokens);
                events.clear();
                replicas[r].cache.insert(seq, local, &mut events);
                kv_events += events.len() as u64;
                policy.kv_events(r, &events);
                policy.request_complete(req.id);
                done += 1;
                end = now;
                progress();
                if let Some(next) = replicas[r].finish() {
                    start(
                        next,
                        r,
                        now,
                        &mut replicas,
                        &mut q,
                        &mut ttft,
                        &mut cached_tokens,
                    );
                }
            }
        }
    }
    let mut sorted = ttft.clone();
    sorted.sort_by(f64::total_cmp);
    Report {
        policy: policy.name().to_string(),
        requests: done,
        prompt_tokens: traffic.prompt_tokens(),
        cached_tokens,
        ttft_mean_ms: if sorted.is_empty() {
            0.0
        } else {
            sorted.iter().sum::<f64>() / sorted.len() as f64
        },
        ttft_p99_ms: quantile(&sorted, 0.99),
        per_replica: replicas.iter().map(|r| r.assigned).collect(),
        makespan_s: end as f64 / 1e6,
        kv_events,
        route_time,
        ttft_ms: ttft,
    }
}
