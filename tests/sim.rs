//! Tests of the `simulate` example's core: the LRU prefix-cache model and the KV events it
//! emits, the event-driven clock and replica queueing, pinned per-policy results, and the
//! property that prefix-aware routing beats round-robin on shared-prefix traffic.

#[path = "../examples/simulate/sim.rs"]
mod sim;

use kvtrie::{BlockHasher, BlockIndex, KvEvent, StoredBlock, WorkerId};
use sim::{
    Conversation, EventQueue, LruCache, Policy, Replica, Report, Request, RoundRobin, SimConfig,
    Traffic, BLOCK_SIZE, CHARS_PER_TOKEN,
};

// ---------------------------------------------------------------------------------------------
// LRU cache model
// ---------------------------------------------------------------------------------------------

/// Local hashes for tests that use plain ids as sequence hashes.
fn locals(seq: &[u64]) -> Vec<u64> {
    seq.iter().map(|h| h + 1000).collect()
}

fn insert(c: &mut LruCache, seq: &[u64]) -> Vec<KvEvent> {
    let mut ev = Vec::new();
    c.insert(seq, &locals(seq), &mut ev);
    ev
}

fn stored(parent: Option<u64>, seq: &[u64]) -> KvEvent {
    KvEvent::Stored {
        parent,
        blocks: seq
            .iter()
            .map(|&h| StoredBlock {
                engine_hash: h,
                local_hash: h + 1000,
            })
            .collect(),
    }
}

#[test]
fn lru_hits_and_misses_count_leading_blocks() {
    let mut c = LruCache::new(16);
    assert!(c.is_empty());
    assert_eq!(c.lookup(&[1, 2, 3]), 0);
    assert_eq!(insert(&mut c, &[1, 2, 3]), vec![stored(None, &[1, 2, 3])]);
    assert_eq!(c.len(), 3);
    assert_eq!(c.lookup(&[1, 2, 3, 4]), 3);
    assert_eq!(c.lookup(&[1, 2]), 2);
    assert_eq!(
        c.lookup(&[9, 1, 2]),
        0,
        "a miss on the first block is a miss"
    );
    // Block 3 is cached, but block 2 of this sequence (7) is not: only one leading block hits.
    assert_eq!(c.lookup(&[1, 7, 3]), 1);
    assert_eq!(c.cached_prefix(&[]), 0);
}

#[test]
fn lru_capacity_and_eviction_order() {
    let mut c = LruCache::new(4);
    insert(&mut c, &[1, 2, 3]);
    // A sequence is touched in reverse: its head is the most recent, its tail goes first.
    assert_eq!(c.mru_order(), vec![1, 2, 3]);
    let ev = insert(&mut c, &[10, 11, 12]);
    assert_eq!(
        ev,
        vec![
            KvEvent::Removed {
                engine_hashes: vec![3, 2]
            },
            stored(None, &[10, 11, 12]),
        ]
    );
    assert_eq!(c.len(), 4);
    assert_eq!(c.mru_order(), vec![10, 11, 12, 1]);
    // A lookup refreshes recency: 1 becomes MRU, so 12 is evicted next.
    assert_eq!(c.lookup(&[1]), 1);
    assert_eq!(c.mru_order(), vec![1, 10, 11, 12]);
    let ev = insert(&mut c, &[20]);
    assert_eq!(
        ev,
        vec![
            KvEvent::Removed {
                engine_hashes: vec![12]
            },
            stored(None, &[20]),
        ]
    );
    assert!(!c.contains(12) && c.contains(11));
}

#[test]
fn lru_insert_never_evicts_its_own_sequence_and_truncates_to_capacity() {
    let mut c = LruCache::new(3);
    insert(&mut c, &[1, 2]);
    insert(&mut c, &[5]);
    // [1, 2] is older than [5], but re-inserting it (extended) must keep 1 and 2.
    let ev = insert(&mut c, &[1, 2, 3]);
    assert_eq!(
        ev,
        vec![
            KvEvent::Removed {
                engine_hashes: vec![5]
            },
            stored(Some(2), &[3]),
        ]
    );
    assert_eq!(c.mru_order(), vec![1, 2, 3]);
    // A sequence longer than the cache: only its first `capacity` blocks are cached.
    let mut c = LruCache::new(3);
    assert_eq!(
        insert(&mut c, &[1, 2, 3, 4, 5]),
        vec![stored(None, &[1, 2, 3])]
    );
    assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), 3);
}

#[test]
fn lru_events_one_stored_per_run_chained_to_the_parent() {
    let mut c = LruCache::new(16);
    // 3 is cached on its own (as the first block of another sequence).
    insert(&mut c, &[3]);
    let ev = insert(&mut c, &[1, 2, 3, 4, 5]);
    assert_eq!(ev, vec![stored(None, &[1, 2]), stored(Some(3), &[4, 5])]);
    // Fully cached: no events at all.
    assert!(insert(&mut c, &[1, 2, 3]).is_empty());
}

/// The cache's events, applied to a `BlockIndex` as an engine's would be, keep the index
/// equal to the cache: same block count, same per-sequence overlap, no rejected event.
#[test]
fn lru_events_keep_a_block_index_in_sync() {
    let cfg = SimConfig {
        requests: 120,
        system_prompts: 3,
        system_tokens: 64,
        ..SimConfig::default()
    };
    let traffic = Traffic::generate(&cfg);
    let index = BlockIndex::with_hasher(&BlockHasher::new(BLOCK_SIZE));
    let w = WorkerId(3);
    let mut c = LruCache::new(40);
    let mut ev = Vec::new();
    let mut evictions = 0;
    for q in &traffic.requests {
        let (seq, local) = traffic.blocks(q, q.prompt_tokens + q.output_tokens);
        ev.clear();
        c.insert(seq, local, &mut ev);
        for e in ev.drain(..) {
            if matches!(e, KvEvent::Removed { .. }) {
                evictions += 1;
            }
            index
                .apply(w, e)
                .expect("every stored block chains to a known parent");
        }
        assert_eq!(index.block_count(w), c.len());
        for p in &traffic.requests[..20] {
            let (seq, local) = traffic.blocks(p, p.prompt_tokens);
            let expect = c.cached_prefix(seq);
            assert_eq!(index.find_matches(local).get(w), expect);
            assert_eq!(index.find_matches_seq(seq).get(w), expect);
        }
    }
    assert!(
        evictions > 10,
        "the test must exercise evictions ({evictions})"
    );
}

// ---------------------------------------------------------------------------------------------
// Event-driven clock and replicas
// ---------------------------------------------------------------------------------------------

#[test]
fn event_queue_pops_in_time_order_ties_in_insertion_order() {
    let mut q = EventQueue::new();
    for (t, e) in [(5, 'a'), (1, 'b'), (5, 'c'), (3, 'd'), (1, 'e'), (5, 'f')] {
        q.push(t, e);
    }
    assert_eq!(q.len(), 6);
    let mut out = Vec::new();
    while let Some((t, e)) = q.pop() {
        assert_eq!(q.now(), t);
        out.push((t, e));
        if e == 'd' {
            q.push(5, 'g'); // scheduled later, at a time already queued: after a, c, f
            q.push(4, 'h');
        }
    }
    assert_eq!(
        out,
        vec![
            (1, 'b'),
            (1, 'e'),
            (3, 'd'),
            (4, 'h'),
            (5, 'a'),
            (5, 'c'),
            (5, 'f'),
            (5, 'g')
        ]
    );
    assert!(q.is_empty());
}

#[test]
fn replica_concurrency_limit_and_fifo_queue() {
    let mut r = Replica::new(8, 2);
    assert_eq!(r.submit(10), Some(10));
    assert_eq!(r.submit(11), Some(11));
    assert_eq!(r.submit(12), None);
    assert_eq!(r.submit(13), None);
    assert_eq!((r.running(), r.waiting(), r.load()), (2, 2, 4));
    assert_eq!(r.finish(), Some(12));
    assert_eq!((r.running(), r.waiting()), (2, 1));
    assert_eq!(r.submit(14), None);
    assert_eq!(r.finish(), Some(13));
    assert_eq!(r.finish(), Some(14));
    assert_eq!(r.finish(), None);
    assert_eq!(r.finish(), None);
    assert_eq!((r.running(), r.waiting(), r.assigned), (0, 0, 5));
}

/// Hand-made traffic: conversation `c` is `tokens[c]`; requests `(conv, arrival µs, prompt
/// tokens, output tokens)`.
fn handmade(convs: &[Vec<u32>], reqs: &[(usize, u64, usize, usize)]) -> Traffic {
    let h = BlockHasher::new(BLOCK_SIZE);
    Traffic {
        conversations: convs
            .iter()
            .map(|t| {
                let local_hashes = h.local_hashes(t);
                Conversation {
                    system: 0,
                    text: sim::render(t),
                    seq_hashes: h.chain_local(&local_hashes),
                    local_hashes,
                    tokens: t.clone(),
                }
            })
            .collect(),
        requests: reqs
            .iter()
            .enumerate()
            .map(
                |(i, &(conv, arrival_us, prompt_tokens, output_tokens))| Request {
                    id: i as u64,
                    conv,
                    turn: 0,
                    arrival_us,
                    prompt_tokens,
                    output_tokens,
                },
            )
            .collect(),
    }
}

fn tiny_cfg(replicas: usize, max_running: usize) -> SimConfig {
    SimConfig {
        replicas,
        max_running,
        cache_blocks: 64,
        prefill_overhead_us: 1000.0,
        prefill_us_per_token: 10.0,
        decode_us_per_token: 100.0,
        ..SimConfig::default()
    }
}

#[test]
fn simulation_honours_the_concurrency_limit_fifo_and_the_cache() {
    let convs: Vec<Vec<u32>> = (0..4u32)
        .map(|c| (0..64).map(|i| c * 1000 + i).collect())
        .collect();
    // Four requests at t = 0 on one replica serving two at once; prompts of 32 tokens
    // (prefill 1000 + 320 µs), 10 output tokens (decode 1000 µs).
    let traffic = handmade(
        &convs,
        &[
            (0, 0, 32, 10),
            (1, 0, 32, 10),
            (2, 0, 32, 10),
            (3, 0, 32, 10),
        ],
    );
    let cfg = tiny_cfg(1, 2);
    let r = sim::simulate(&cfg, &traffic, &mut RoundRobin::default(), &mut || {});
    // 0 and 1 start at once; 2 takes 0's slot at 2320 µs, 3 takes 1's (FIFO).
    assert_eq!(r.ttft_ms, vec![1.32, 1.32, 3.64, 3.64]);
    assert_eq!(r.makespan_s, 4.64e-3);
    assert_eq!(
        (r.requests, r.cached_tokens, r.per_replica.clone()),
        (4, 0, vec![4])
    );

    // Arrivals at different times with one slot: strictly FIFO, and a later turn of the same
    // conversation (prompt = first prompt + response + more) hits the cached prefix.
    let traffic = handmade(&convs[..2], &[(0, 0, 32, 10), (1, 1, 16, 1), (0, 2, 60, 1)]);
    let cfg = tiny_cfg(1, 1);
    let r = sim::simulate(&cfg, &traffic, &mut RoundRobin::default(), &mut || {});
    // req0: 0 → first token 1320, done 2320. req1 (16 tokens): starts 2320, prefill 1160,
    // done 3580. req2: starts 3580, blocks 0..2 of conversation 0 cached (32 prompt + 10
    // output tokens = 2 full blocks after req0 completes) → 60 − 32 = 28 uncached tokens.
    assert_eq!(r.cached_tokens, 32);
    assert_eq!(r.ttft_ms, vec![1.32, 3.479, 4.858]);
    assert_eq!(r.prompt_tokens, 108);
}

// ---------------------------------------------------------------------------------------------
// Pinned runs
// ---------------------------------------------------------------------------------------------

/// A small configuration: 4 replicas, 240 requests over 6 shared system prompts.
fn small_cfg(seed: u64) -> SimConfig {
    SimConfig {
        replicas: 4,
        requests: 240,
        rate: 12.0,
        cache_blocks: 192,
        seed,
        system_prompts: 6,
        system_tokens: 256,
        max_turns: 6,
        user_tokens: (16, 96),
        output_tokens: (8, 48),
        ..SimConfig::default()
    }
}

fn run_all(cfg: &SimConfig) -> Vec<Report> {
    let traffic = Traffic::generate(cfg);
    sim::standard_policies(cfg)
        .iter_mut()
        .map(|p| sim::simulate(cfg, &traffic, p.as_mut(), &mut || {}))
        .collect()
}

#[test]
fn traffic_is_deterministic_and_text_matches_tokens() {
    let cfg = small_cfg(11);
    let a = Traffic::generate(&cfg);
    let b = Traffic::generate(&cfg);
    assert_eq!(a.requests, b.requests);
    assert_eq!(a.requests.len(), 240);
    assert!(a
        .requests
        .windows(2)
        .all(|w| w[0].arrival_us <= w[1].arrival_us));
    for q in &a.requests {
        let (tokens, text) = a.prompt(q);
        assert_eq!(tokens.len(), q.prompt_tokens);
        assert_eq!(text.len(), q.prompt_tokens * CHARS_PER_TOKEN);
        assert_eq!(text, sim::render(tokens));
    }
    // Two turns of one conversation: the later prompt extends the earlier one + its response.
    let c = a.requests.iter().find(|q| q.turn == 1).unwrap().conv;
    let turns: Vec<&Request> = a.requests.iter().filter(|q| q.conv == c).collect();
    assert!(turns[1].prompt_tokens > turns[0].prompt_tokens + turns[0].output_tokens);
    assert!(turns[1].arrival_us > turns[0].arrival_us);
    let other = Traffic::generate(&small_cfg(12));
    assert_ne!(a.requests, other.requests);
}

/// Policy, requests, prompt tokens, cached prompt tokens, requests per replica, p99 TTFT (ms).
type Pinned<'a> = (&'a str, u64, u64, u64, Vec<u64>, f64);

#[test]
fn pinned_results_per_policy() {
    let cfg = small_cfg(11);
    let reports = run_all(&cfg);
    let got: Vec<Pinned> = reports
        .iter()
        .map(|r| {
            (
                r.policy.as_str(),
                r.requests,
                r.prompt_tokens,
                r.cached_tokens,
                r.per_replica.clone(),
                r.ttft_p99_ms,
            )
        })
        .collect();
    // Computed once from this configuration; any change to the traffic generator, the cache
    // model, the clock or a policy's decisions changes these numbers.
    let expect: Vec<Pinned> = vec![
        (
            "round-robin",
            240,
            108727,
            53184,
            vec![60, 60, 60, 60],
            182.5,
        ),
        (
            "power-of-two",
            240,
            108727,
            54768,
            vec![58, 68, 56, 58],
            186.25,
        ),
        (
            "prefix-affinity (ray)",
            240,
            108727,
            85120,
            vec![79, 74, 37, 50],
            114.5,
        ),
        (
            "prefix-affinity (sglang)",
            240,
            108727,
            84368,
            vec![79, 37, 35, 89],
            111.25,
        ),
        ("kv-aware", 240, 108727, 69728, vec![64, 63, 55, 58], 159.5),
    ];
    assert_eq!(got, expect);
    // The hit rate is cached / prompt tokens: Ray's pinned run, 85120 / 108727.
    assert_eq!(reports[2].hit_rate(), 85120.0 / 108727.0);
    // Same seed, same numbers (routing time aside).
    let again = run_all(&cfg);
    for (a, b) in reports.iter().zip(&again) {
        assert_eq!(
            (a.cached_tokens, &a.ttft_ms, &a.per_replica, a.kv_events),
            (b.cached_tokens, &b.ttft_ms, &b.per_replica, b.kv_events)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Property: prefix-aware routing wins on shared prefixes
// ---------------------------------------------------------------------------------------------

#[test]
fn prefix_aware_policies_beat_round_robin_on_hit_rate() {
    for seed in [1, 2, 3] {
        let cfg = small_cfg(seed);
        let reports = run_all(&cfg);
        let rr = reports
            .iter()
            .find(|r| r.policy == RoundRobin::default().name())
            .unwrap();
        let aware: Vec<&Report> = reports
            .iter()
            .filter(|r| r.policy.starts_with("prefix-affinity") || r.policy.starts_with("kv-aware"))
            .collect();
        assert_eq!(aware.len(), 3, "both PrefixAffinity presets and KvAware");
        for r in aware {
            assert!(
                r.hit_rate() > rr.hit_rate(),
                "seed {seed}: {} hit rate {:.3} <= round-robin {:.3}",
                r.policy,
                r.hit_rate(),
                rr.hit_rate()
            );
        }
    }
}
