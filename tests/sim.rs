//! Tests of the simulator's engine (`kvtrie::sim`, feature `sim`): the LRU prefix-cache model
//! and the KV events it emits, the event-driven clock and replica queueing, the Mooncake
//! trace parser (every malformed input is an error, never a panic), trace-derived traffic,
//! configuration errors, pinned synthetic runs, and the properties of a replay of the first
//! 2,000 requests of the Mooncake conversation trace (`tests/data/`).
#![cfg(not(loom))]

use std::sync::OnceLock;

use kvtrie::blocks::{BlockHasher, BlockIndex, KvEvent, StoredBlock, WorkerId};
use kvtrie::router::PrefixAffinityConfig;
use kvtrie::sim::{
    check_clock, fitting_block_tokens, infinite_cache_ceiling, kv_config, parse_trace,
    parse_trace_str, parse_trace_str_with, parse_trace_with, render, simulate, standard_policies,
    ClusterView, EventQueue, KvAware, LruCache, Policy, PolicyError, PrefixAffinity, Replica,
    Report, RoundRobin, RouteRequest, RouterSetup, SimConfig, SimError, TraceError, TraceRecord,
    Traffic, BLOCK_SIZE, CHARS_PER_TOKEN, MAX_LINE_BYTES, MAX_ROUTER_INSTANCES, TRACE_BLOCK_TOKENS,
};
use std::io::Read as _;

#[path = "support/thread_alloc.rs"]
mod thread_alloc;

#[global_allocator]
static ALLOCATOR: thread_alloc::Counting = thread_alloc::Counting;

/// Bytes this thread allocated while running `f`.
fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let (out, _, bytes) = thread_alloc::allocated_by(f);
    (out, bytes)
}

// ---------------------------------------------------------------------------------------------
// LRU cache model
// ---------------------------------------------------------------------------------------------

#[test]
fn a_cache_allocates_for_what_it_holds_not_for_its_capacity() {
    // 512 replicas of 16 M-block caches used to reserve ~0.9 GB each up front (hundreds of
    // GB in all: an abort, or the OOM killer, before the first request).
    let (mut c, bytes) = allocated_by(|| LruCache::new(1 << 24));
    assert!(bytes < 1 << 20, "an empty cache allocated {bytes} bytes");
    let (_, bytes) = allocated_by(|| Replica::new(usize::MAX, 8));
    assert!(bytes < 1 << 20, "an empty replica allocated {bytes} bytes");
    // It still holds what it is given, and grows as it fills.
    let seq: Vec<u64> = (1..=100_000).collect();
    insert(&mut c, &seq);
    assert_eq!((c.len(), c.lookup(&seq)), (100_000, 100_000));
}

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
    // A sequence repeating a hash is stored once; a zero-capacity cache stores nothing.
    let mut c = LruCache::new(8);
    insert(&mut c, &[7, 7, 8]);
    assert_eq!((c.len(), c.mru_order()), (2, vec![7, 8]));
    let mut c = LruCache::new(0);
    assert!(insert(&mut c, &[1, 2]).is_empty());
    assert!(c.is_empty());
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
    let traffic = Traffic::generate(&cfg).unwrap();
    let index = BlockIndex::with_hasher(&BlockHasher::new(BLOCK_SIZE));
    let w = WorkerId(3);
    let mut c = LruCache::new(40);
    let mut ev = Vec::new();
    let mut evictions = 0;
    for q in traffic.requests() {
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
        for p in &traffic.requests()[..20] {
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
    assert_eq!(
        r.finish(),
        None,
        "finishing on an idle replica does nothing"
    );
    assert_eq!((r.running(), r.waiting(), r.assigned), (0, 0, 5));
}

#[test]
fn replica_prefill_lanes_serialize_prefills() {
    // One lane: prefills queue behind each other, first come first served.
    let mut r = Replica::with_prefill_lanes(8, 4, 1);
    assert_eq!(
        (r.queue_prefill(1), r.queue_prefill(2), r.queue_prefill(3)),
        (Some(1), None, None)
    );
    assert_eq!(
        (r.prefill_finished(), r.prefill_finished()),
        (Some(2), Some(3))
    );
    assert_eq!((r.prefill_finished(), r.prefill_finished()), (None, None));
    assert_eq!(r.queue_prefill(4), Some(4), "an idle lane starts at once");
    // Two lanes: two prefills at once.
    let mut r = Replica::with_prefill_lanes(8, 4, 2);
    assert_eq!(
        (r.queue_prefill(1), r.queue_prefill(2), r.queue_prefill(3)),
        (Some(1), Some(2), None)
    );
    // As many lanes as running slots (the default of `Replica::new`): never a wait.
    let mut r = Replica::new(8, 2);
    assert_eq!((r.queue_prefill(1), r.queue_prefill(2)), (Some(1), Some(2)));
    assert_eq!(r.prefill_waiting(), 0);
}

/// Hand-made traffic: stream `c` is `tokens[c]`; requests `(stream, arrival µs, prompt
/// tokens, output tokens)`.
fn handmade(convs: &[Vec<u32>], reqs: &[(usize, u64, usize, usize)]) -> Traffic {
    Traffic::from_streams(convs.to_vec(), reqs).unwrap()
}

fn tiny_cfg(replicas: usize, max_running: usize) -> SimConfig {
    SimConfig {
        replicas,
        max_running,
        prefill_lanes: max_running,
        cache_blocks: 64,
        prefill_overhead_us: 1000.0,
        prefill_us_per_token: 10.0,
        decode_us_per_token: 100.0,
        ..SimConfig::default()
    }
}

#[test]
fn simulate_refuses_settings_that_would_saturate_the_clock() {
    let base = SimConfig {
        requests: 20,
        ..SimConfig::default()
    };
    let traffic = Traffic::generate(&base).unwrap();
    assert!(simulate(&base, &traffic, &mut RoundRobin::default(), &mut || {}).is_ok());
    // A cost model that `validate` accepts (finite, non-negative) but no clock can hold.
    for (cfg, field) in [
        (
            SimConfig {
                prefill_overhead_us: 1e300,
                ..base.clone()
            },
            "prefill_overhead_us",
        ),
        (
            SimConfig {
                prefill_us_per_token: 1e300,
                ..base.clone()
            },
            "prefill_us_per_token",
        ),
        (
            SimConfig {
                decode_us_per_token: 1e300,
                ..base.clone()
            },
            "decode_us_per_token",
        ),
    ] {
        assert!(cfg.validate_synthetic().is_ok());
        match simulate(&cfg, &traffic, &mut RoundRobin::default(), &mut || {}) {
            Err(SimError::Config(e)) => assert_eq!(e.field, field, "{e}"),
            other => panic!("{field}: expected a configuration error, got {other:?}"),
        }
    }
    // The bound is the arrivals plus every request's whole cost: 100 years of prefill for one
    // replayed request still fits, 1e16 µs (317 years) does not.
    let recs = parse_trace_str(
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 9, \"hash_ids\": [0, 5]}",
    )
    .unwrap();
    let one = Traffic::from_trace(&recs, &SimConfig::default()).unwrap();
    for (overhead, fits) in [(100.0 * 365.25 * 86_400e6, true), (1e16, false)] {
        let cfg = SimConfig {
            prefill_overhead_us: overhead,
            ..SimConfig::default()
        };
        assert_eq!(check_clock(&cfg, &one).is_ok(), fits, "{overhead:e}");
    }
    // Arrivals so sparse that they alone pass the limit (they saturate at u64::MAX).
    let sparse = SimConfig {
        rate: 1e-12,
        ..base.clone()
    };
    let traffic = Traffic::generate(&sparse).unwrap();
    match simulate(&sparse, &traffic, &mut RoundRobin::default(), &mut || {}) {
        Err(SimError::Config(e)) => assert_eq!(e.field, "rate", "{e}"),
        other => panic!("expected a configuration error, got {other:?}"),
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
    let r = simulate(&cfg, &traffic, &mut RoundRobin::default(), &mut || {}).unwrap();
    // 0 and 1 start at once; 2 takes 0's slot at 2320 µs, 3 takes 1's (FIFO).
    assert_eq!(r.ttft_ms, vec![1.32, 1.32, 3.64, 3.64]);
    assert_eq!(r.makespan_s, 4.64e-3);
    assert_eq!(
        (r.requests, r.cached_tokens, r.per_replica.clone()),
        (4, 0, vec![4])
    );
    assert_eq!((r.ttft_p50_ms, r.ttft_p99_ms), (1.32, 3.64));

    // The same with one prefill lane: the second prefill waits for the first.
    let cfg1 = SimConfig {
        prefill_lanes: 1,
        ..cfg.clone()
    };
    let r = simulate(&cfg1, &traffic, &mut RoundRobin::default(), &mut || {}).unwrap();
    // 0: prefill 0..1320; 1: 1320..2640; 2 starts at 2320 (0 done), its prefill 2640..3960;
    // 3 starts at 3640 (1 done), prefill 3960..5280.
    assert_eq!(r.ttft_ms, vec![1.32, 2.64, 3.96, 5.28]);

    // Arrivals at different times with one slot: strictly FIFO, and a later turn of the same
    // conversation (prompt = first prompt + response + more) hits the cached prefix.
    let traffic = handmade(&convs[..2], &[(0, 0, 32, 10), (1, 1, 16, 1), (0, 2, 60, 1)]);
    let cfg = tiny_cfg(1, 1);
    let r = simulate(&cfg, &traffic, &mut RoundRobin::default(), &mut || {}).unwrap();
    // req0: 0 → first token 1320, done 2320. req1 (16 tokens): starts 2320, prefill 1160,
    // done 3580. req2: starts 3580, blocks 0..2 of conversation 0 cached (32 prompt + 10
    // output tokens = 2 full blocks after req0 completes) → 60 − 32 = 28 uncached tokens.
    assert_eq!(r.cached_tokens, 32);
    assert_eq!(r.ttft_ms, vec![1.32, 3.479, 4.858]);
    assert_eq!(r.prompt_tokens, 108);
}

#[test]
fn hand_made_traffic_rejects_requests_that_do_not_fit() {
    let s = vec![(0..40).collect::<Vec<u32>>()];
    for reqs in [
        vec![(1, 0, 8, 0)],  // no stream 1
        vec![(0, 0, 0, 4)],  // empty prompt
        vec![(0, 0, 32, 9)], // 41 tokens > 40
    ] {
        let e = Traffic::from_streams(s.clone(), &reqs).unwrap_err();
        assert_eq!(e.field, "requests", "{e}");
    }
    // Sorted by arrival, numbered in that order.
    let t = Traffic::from_streams(s, &[(0, 9, 8, 0), (0, 3, 16, 0)]).unwrap();
    let ids: Vec<(u64, u64)> = t.requests().iter().map(|q| (q.id, q.arrival_us)).collect();
    assert_eq!(ids, vec![(0, 3), (1, 9)]);
}

#[test]
fn a_request_may_use_its_whole_stream() {
    // Prompt + output exactly the stream's length fits.
    let t = Traffic::from_streams(vec![(0..40).collect()], &[(0, 0, 32, 8)]).unwrap();
    let q = &t.requests()[0];
    assert_eq!((q.prompt_tokens, q.output_tokens), (32, 8));
    assert_eq!(t.blocks(q, 40).0.len(), 2);
}

#[test]
fn the_ceiling_finds_blocks_an_earlier_response_held() {
    // Request 0's prompt is block 0 and its response blocks 1 and 2; request 1's prompt is
    // blocks 0..3 of the same conversation: its 3 leading blocks were held by request 0's
    // prompt and response, so the ceiling counts all 48 tokens.
    let t = handmade(&[(0..64).collect()], &[(0, 0, 16, 32), (0, 1, 48, 0)]);
    let c = infinite_cache_ceiling(&t);
    assert_eq!((c.prompt_tokens, c.cached_tokens), (64, 48));
    // A request finds nothing of its own response, nor of later requests.
    let t = handmade(&[(0..64).collect()], &[(0, 0, 48, 0), (0, 1, 16, 32)]);
    assert_eq!(infinite_cache_ceiling(&t).cached_tokens, 16);
}

#[test]
fn fixed_user_and_output_lengths_are_accepted() {
    // `min..=max` with min == max is one length, not an empty range.
    let cfg = SimConfig {
        requests: 20,
        max_turns: 1,
        system_tokens: 32,
        user_tokens: (64, 64),
        output_tokens: (16, 16),
        ..SimConfig::default()
    };
    assert_eq!(cfg.validate_synthetic(), Ok(()));
    let t = Traffic::generate(&cfg).unwrap();
    assert_eq!(t.requests().len(), 20);
    for q in t.requests() {
        assert_eq!((q.prompt_tokens, q.output_tokens), (96, 16), "{q:?}");
    }
    let bad = SimConfig {
        user_tokens: (65, 64),
        ..cfg
    };
    assert_eq!(bad.validate_synthetic().unwrap_err().field, "user_tokens");
}

// ---------------------------------------------------------------------------------------------
// Configuration and policy errors
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_configurations_are_errors_naming_the_field() {
    let d = SimConfig::default;
    let cases: Vec<(SimConfig, &str)> = vec![
        (SimConfig { replicas: 0, ..d() }, "replicas"),
        (
            SimConfig {
                replicas: 100_000,
                ..d()
            },
            "replicas",
        ),
        (
            SimConfig {
                max_running: 0,
                ..d()
            },
            "max_running",
        ),
        (
            SimConfig {
                max_running: usize::MAX,
                ..d()
            },
            "max_running",
        ),
        (
            SimConfig {
                prefill_lanes: 1 << 20,
                ..d()
            },
            "prefill_lanes",
        ),
        (
            SimConfig {
                cache_blocks: 0,
                ..d()
            },
            "cache_blocks",
        ),
        (
            SimConfig {
                prefill_lanes: 0,
                ..d()
            },
            "prefill_lanes",
        ),
        (
            SimConfig {
                prefill_us_per_token: f64::NAN,
                ..d()
            },
            "prefill_us_per_token",
        ),
        (
            SimConfig {
                decode_us_per_token: -1.0,
                ..d()
            },
            "decode_us_per_token",
        ),
        (
            SimConfig {
                time_scale: 0.0,
                ..d()
            },
            "time_scale",
        ),
        (
            SimConfig {
                kv_overlap_weight: f64::INFINITY,
                ..d()
            },
            "kv_overlap_weight",
        ),
        (SimConfig { rate: 0.0, ..d() }, "rate"),
        (SimConfig { requests: 0, ..d() }, "requests"),
        (
            SimConfig {
                max_turns: 0,
                ..d()
            },
            "max_turns",
        ),
        (
            SimConfig {
                user_tokens: (9, 3),
                ..d()
            },
            "user_tokens",
        ),
        (
            SimConfig {
                system_tokens: 0,
                user_tokens: (0, 4),
                ..d()
            },
            "system_tokens",
        ),
        (
            SimConfig {
                system_tokens: usize::MAX,
                ..d()
            },
            "system_tokens",
        ),
        (
            SimConfig {
                think_mean_s: f64::NAN,
                ..d()
            },
            "think_mean_s",
        ),
        // More requests than memory holds: an error, not a failed allocation.
        (
            SimConfig {
                requests: usize::MAX,
                ..d()
            },
            "requests",
        ),
        (
            SimConfig {
                requests: 1_000_000_000,
                ..d()
            },
            "requests",
        ),
        // Costs that would overflow to infinity and all tie.
        (
            SimConfig {
                kv_overlap_weight: 1e307,
                ..d()
            },
            "kv_overlap_weight",
        ),
    ];
    for (cfg, field) in cases {
        let e = Traffic::generate(&cfg).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.to_string().starts_with(field));
    }
    // `simulate` checks the cluster part too.
    let traffic = Traffic::generate(&SimConfig { requests: 4, ..d() }).unwrap();
    let bad = SimConfig { replicas: 0, ..d() };
    let e = simulate(&bad, &traffic, &mut RoundRobin::default(), &mut || {}).unwrap_err();
    assert!(
        matches!(e, SimError::Config(ref c) if c.field == "replicas"),
        "{e}"
    );
    // Costs that would run the clock past 2^53 µs are refused, not saturated into nonsense
    // (see `simulate_refuses_settings_that_would_saturate_the_clock`).
    let huge = SimConfig {
        decode_us_per_token: 1e300,
        requests: 4,
        ..d()
    };
    let e = simulate(&huge, &traffic, &mut RoundRobin::default(), &mut || {}).unwrap_err();
    assert!(
        matches!(e, SimError::Config(ref c) if c.field == "decode_us_per_token"),
        "{e}"
    );
}

/// A policy that always answers replica `self.0`.
struct Fixed(usize);

impl Policy for Fixed {
    fn name(&self) -> &str {
        "fixed"
    }
    fn route(&mut self, _: &RouteRequest<'_>, _: &ClusterView<'_>) -> Result<usize, PolicyError> {
        Ok(self.0)
    }
}

#[test]
fn a_policy_choosing_a_missing_replica_is_an_error() {
    let cfg = SimConfig {
        requests: 3,
        replicas: 2,
        ..SimConfig::default()
    };
    let traffic = Traffic::generate(&cfg).unwrap();
    let e = simulate(&cfg, &traffic, &mut Fixed(2), &mut || {}).unwrap_err();
    assert_eq!(
        e,
        SimError::BadReplica {
            request: 0,
            replica: 2
        }
    );
    assert!(simulate(&cfg, &traffic, &mut Fixed(1), &mut || {}).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Synthetic traffic: determinism, pinned runs, prefix-aware routing wins
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

fn run_all(cfg: &SimConfig, traffic: &Traffic, setup: RouterSetup) -> Vec<Report> {
    standard_policies(cfg, setup)
        .iter_mut()
        .map(|p| simulate(cfg, traffic, p.as_mut(), &mut || {}).unwrap())
        .collect()
}

#[test]
fn traffic_is_deterministic_and_text_matches_tokens() {
    let cfg = small_cfg(11);
    let a = Traffic::generate(&cfg).unwrap();
    let b = Traffic::generate(&cfg).unwrap();
    assert_eq!(a.requests(), b.requests());
    assert_eq!(a.requests().len(), 240);
    assert!(a
        .requests()
        .windows(2)
        .all(|w| w[0].arrival_us <= w[1].arrival_us));
    let (mut tb, mut sb) = (Vec::new(), String::new());
    for q in a.requests() {
        let tokens = a.tokens(q, &mut tb).to_vec();
        let text = a.text(q, &mut sb);
        assert_eq!(tokens.len(), q.prompt_tokens);
        assert_eq!(text.len(), q.prompt_tokens * CHARS_PER_TOKEN);
        assert_eq!(text, render(&tokens));
        let h = BlockHasher::new(BLOCK_SIZE);
        assert_eq!(
            a.blocks(q, q.prompt_tokens).0,
            &h.sequence_hashes(&tokens)[..]
        );
    }
    // Two turns of one conversation: the later prompt extends the earlier one + its response.
    let c = a.requests().iter().find(|q| q.turn == 1).unwrap().stream;
    let turns: Vec<_> = a.requests().iter().filter(|q| q.stream == c).collect();
    assert!(turns[1].prompt_tokens > turns[0].prompt_tokens + turns[0].output_tokens);
    assert!(turns[1].arrival_us > turns[0].arrival_us);
    let other = Traffic::generate(&small_cfg(12)).unwrap();
    assert_ne!(a.requests(), other.requests());
}

/// Policy, cached prompt tokens, requests per replica, p99 TTFT (ms).
type Pinned<'a> = (&'a str, u64, Vec<u64>, f64);

#[test]
fn pinned_results_per_policy() {
    let cfg = small_cfg(11);
    let traffic = Traffic::generate(&cfg).unwrap();
    let reports = run_all(&cfg, &traffic, RouterSetup::single());
    let got: Vec<Pinned> = reports
        .iter()
        .map(|r| {
            (
                r.policy.as_str(),
                r.cached_tokens,
                r.per_replica.clone(),
                r.ttft_p99_ms,
            )
        })
        .collect();
    // Computed once from this configuration; any change to the traffic generator, the cache
    // model, the clock or a policy's decisions changes these numbers.
    let expect: Vec<Pinned> = vec![
        ("round-robin", 53184, vec![60, 60, 60, 60], 76.0),
        ("power-of-two", 55168, vec![56, 70, 55, 59], 76.4),
        ("prefix-affinity (ray)", 85120, vec![79, 74, 37, 50], 48.8),
        (
            "prefix-affinity (sglang)",
            84368,
            vec![79, 37, 35, 89],
            47.5,
        ),
        ("kv-aware", 84368, vec![79, 37, 35, 89], 47.5),
        // Greedy on cached prefixes within its queue bound, the oracle never needs the
        // fourth replica at this load.
        ("oracle", 83408, vec![89, 79, 72, 0], 47.5),
    ];
    assert_eq!(got, expect);
    assert!(reports
        .iter()
        .all(|r| (r.requests, r.prompt_tokens) == (240, 108727)));
    // The hit rate is cached / prompt tokens.
    assert_eq!(reports[2].hit_rate(), expect[2].1 as f64 / 108727.0);
    // Same seed, same numbers (routing time aside).
    let again = run_all(&cfg, &traffic, RouterSetup::single());
    for (a, b) in reports.iter().zip(&again) {
        assert_eq!(
            (a.cached_tokens, &a.ttft_ms, &a.per_replica, a.kv_events),
            (b.cached_tokens, &b.ttft_ms, &b.per_replica, b.kv_events)
        );
    }
}

#[test]
fn prefix_aware_policies_beat_round_robin_on_hit_rate() {
    for seed in [1, 2, 3] {
        let cfg = small_cfg(seed);
        let traffic = Traffic::generate(&cfg).unwrap();
        let reports = run_all(&cfg, &traffic, RouterSetup::single());
        let rr = &reports[0];
        assert_eq!(rr.policy, "round-robin");
        let aware: Vec<&Report> = reports
            .iter()
            .filter(|r| {
                r.policy.starts_with("prefix-affinity")
                    || r.policy.starts_with("kv-aware")
                    || r.policy == "oracle"
            })
            .collect();
        assert_eq!(
            aware.len(),
            4,
            "both PrefixAffinity presets, KvAware, the oracle"
        );
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

// ---------------------------------------------------------------------------------------------
// Trace parser: every malformed input is a clear error naming the line
// ---------------------------------------------------------------------------------------------

const GOOD: &str =
    r#"{"timestamp": 27, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#;

fn line_error(s: &str) -> (usize, String) {
    match parse_trace_str(s) {
        Err(e @ TraceError::Line { .. }) => (e.line().unwrap(), e.to_string()),
        other => panic!("{s:?}: expected a line error, got {other:?}"),
    }
}

#[test]
fn trace_parser_reads_good_lines() {
    let text = format!("{GOOD}\n\n  \r\n{{\"hash_ids\":[1],\"output_length\":0,\"extra\":{{\"a\":[1,2.5e3,\"x\\\"y\",null,true]}},\"timestamp\":1,\"input_length\":1}}\r\n");
    let t = parse_trace_str(&text).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(
        (t[0].timestamp_ms, t[0].input_length, t[0].output_length),
        (27, 600, 9)
    );
    assert_eq!(t[0].hash_ids, vec![0, 5]);
    assert_eq!((t[1].input_length, t[1].hash_ids.clone()), (1, vec![1]));
    // The reader form reads the same.
    assert_eq!(parse_trace(text.as_bytes()).unwrap(), t);
}

#[test]
fn trace_parser_reads_timestamps_as_dynamo_and_aiperf_write_them() {
    // Dynamo's data generator writes `timestamp` as an f64 (`27482.0`, `12.5`), aiperf reads
    // int or float, pandas turns an integer column with a gap into floats: one such line
    // must not refuse a whole trace. Fractions round to the nearest millisecond.
    let cases: &[(&str, u64)] = &[
        ("27482.0", 27_482),
        ("0.0", 0),
        ("12.5", 13),
        ("12.49", 12),
        ("2.7482e4", 27_482),
        ("27482E0", 27_482),
        ("1178625", 1_178_625),
        ("\"27482\"", 27_482),
        ("\" 27482.4 \"", 27_482),
        ("18446744073709551615", u64::MAX),
    ];
    for (ts, want) in cases {
        let text = format!(
            "{GOOD}\n{{\"timestamp\": {ts}, \"input_length\": 600, \"output_length\": 9, \"hash_ids\": [0, 5]}}\n"
        );
        let t = parse_trace_str(&text).unwrap_or_else(|e| panic!("{ts}: {e}"));
        assert_eq!(t[1].timestamp_ms, *want, "{ts}");
    }
    // A float trace replays as its integer twin.
    let ints = "{\"timestamp\": 0, \"input_length\": 655, \"output_length\": 52, \"hash_ids\": [46, 47]}\n\
                {\"timestamp\": 10535, \"input_length\": 672, \"output_length\": 26, \"hash_ids\": [46, 47]}";
    let floats = ints.replace(": 0,", ": 0.0,").replace("10535", "10535.0");
    assert_ne!(ints, floats);
    assert_eq!(
        parse_trace_str(&floats).unwrap(),
        parse_trace_str(ints).unwrap()
    );
}

#[test]
fn trace_parser_skips_a_byte_order_mark() {
    // Windows tools (PowerShell's Out-File, Notepad) open a UTF-8 file with EF BB BF.
    let t = parse_trace_str(&format!("\u{FEFF}{GOOD}\r\n{GOOD}")).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0], t[1]);
    // Only at the start of the file: elsewhere it is a stray byte, an error naming the line.
    let (n, msg) = line_error(&format!("{GOOD}\n\u{FEFF}{GOOD}\n"));
    assert_eq!(n, 2);
    assert!(msg.contains("column 1"), "{msg}");
}

#[test]
fn trace_parser_rejects_each_malformed_field() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"timestamp": -1, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`timestamp` must be a non-negative number of milliseconds, found -1",
        ),
        (
            r#"{"timestamp": -1.5, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`timestamp` must be a non-negative number of milliseconds, found -1.5",
        ),
        (
            r#"{"timestamp": "2025-06-01T10:00:00Z", "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`timestamp` must be a non-negative number of milliseconds, found the string \"2025-06-01T10:00:00Z\"",
        ),
        (
            r#"{"timestamp": "", "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`timestamp` must be a non-negative number of milliseconds, found the string \"\"",
        ),
        (
            r#"{"timestamp": null, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`timestamp` must be a non-negative number of milliseconds, found null",
        ),
        (
            r#"{"timestamp": 1e30, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`timestamp` 1e30 is out of range",
        ),
        (
            r#"{"timestamp": 99999999999999999999, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`timestamp` 99999999999999999999 is out of range",
        ),
        (
            r#"{"input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "missing field `timestamp`",
        ),
        (
            r#"{"timestamp": 1, "timestamp": 2, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]}"#,
            "duplicate field `timestamp`",
        ),
        (
            r#"{"timestamp": 1, "input_length": 0, "output_length": 9, "hash_ids": []}"#,
            "`input_length` must be at least 1",
        ),
        (
            r#"{"timestamp": 1, "input_length": 1e3, "output_length": 9, "hash_ids": [0, 5]}"#,
            "`input_length` must be a non-negative integer, found 1e3",
        ),
        (
            r#"{"timestamp": 1, "input_length": 99999999999, "output_length": 9, "hash_ids": [0]}"#,
            "`input_length` 99999999999 exceeds 16777216 tokens",
        ),
        (
            r#"{"timestamp": 1, "output_length": 9, "hash_ids": [0, 5]}"#,
            "missing field `input_length`",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": null, "hash_ids": [0, 5]}"#,
            "`output_length` must be a non-negative integer, found null",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 99999999999, "hash_ids": [0, 5]}"#,
            "`output_length` 99999999999 exceeds",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "hash_ids": [0, 5]}"#,
            "missing field `output_length`",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 9, "hash_ids": "0,5"}"#,
            "`hash_ids` must be an array of non-negative integers, found a string",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 9, "hash_ids": [0, -5]}"#,
            "`hash_ids[1]` must be a non-negative integer, found -5",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 9, "hash_ids": [0, [5]]}"#,
            "`hash_ids[1]` must be a non-negative integer, found an array",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 9, "hash_ids": [0]}"#,
            "`hash_ids` has 1 ids but `input_length` 600 needs 2",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 9, "hash_ids": [0, 5, 6]}"#,
            "`hash_ids` has 3 ids but `input_length` 600 needs 2",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 9}"#,
            "missing field `hash_ids`",
        ),
        (
            r#"[1, 2, 3]"#,
            "column 1: expected '{' (a JSON object per line), found '['",
        ),
        (
            r#"{"timestamp": 1 "input_length": 600}"#,
            "column 17: expected ',' or '}', found '\"'",
        ),
        (
            r#"{"timestamp": 1, "input_length": 600, "output_length": 9, "hash_ids": [0, 5]} x"#,
            "expected the end of the line after the object, found 'x'",
        ),
        (
            r#"{"timestamp": 1, "x": tru, "input_length": 600}"#,
            "expected a JSON value",
        ),
        (
            "{\"timestamp\": 1, \"x\": \"a\u{1}b\"}",
            "no control character in a string",
        ),
        (
            r#"{"timestamp": 1, "x": "\q"}"#,
            "expected an escape character",
        ),
        (r#"{timestamp: 1}"#, "column 2: expected '\"', found 't'"),
    ];
    for (line, want) in cases {
        // On line 3, after a good line and a blank one.
        let text = format!("{GOOD}\n\n{line}\n{GOOD}\n");
        let (n, msg) = line_error(&text);
        assert_eq!(n, 3, "{line}: {msg}");
        assert!(msg.starts_with("line 3"), "{msg}");
        assert!(msg.contains(want), "{line}:\n  got  {msg}\n  want {want}");
    }
    // Nesting inside a skipped field is bounded (no stack overflow).
    let deep = format!("{{\"x\": {}1{}}}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(line_error(&deep).1.contains("nested deeper than 64 levels"));
    // Invalid UTF-8 inside a skipped string is not an error; outside one it is.
    let mut bytes = br#"{"x": "caf"#.to_vec();
    bytes.extend([0xC3, 0x28]);
    bytes.extend(br#"", "timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [4]}"#);
    assert_eq!(parse_trace(&bytes[..]).unwrap()[0].hash_ids, vec![4]);
    assert!(parse_trace(&[0xFF, b'\n'][..]).is_err());
}

#[test]
fn trace_parser_reports_truncated_lines_and_empty_traces() {
    assert_eq!(parse_trace_str(""), Err(TraceError::Empty));
    assert_eq!(parse_trace_str("\n \n\t\n"), Err(TraceError::Empty));
    assert_eq!(TraceError::Empty.to_string(), "the trace has no requests");
    // Every proper prefix of a good line is an error on that line, never a panic.
    for cut in 1..GOOD.len() {
        let text = format!("{GOOD}\n{}", &GOOD[..cut]);
        let (n, msg) = line_error(&text);
        assert_eq!(n, 2, "cut at {cut}: {msg}");
        let mid_value = msg.contains("truncated line") || msg.contains("missing field");
        assert!(mid_value, "cut at {cut}: {msg}");
    }
    assert!(line_error(&GOOD[..40]).1.contains("truncated line"));
}

#[test]
fn trace_parser_never_panics_on_mutated_input() {
    // Deterministic mutations of a small trace: flipped, deleted and inserted bytes.
    let base = format!("{GOOD}\n{GOOD}\n");
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let (mut ok, mut err) = (0, 0);
    for _ in 0..3000 {
        let mut b = base.as_bytes().to_vec();
        for _ in 0..1 + next() % 3 {
            let i = (next() % b.len() as u64) as usize;
            match next() % 3 {
                0 => b[i] = (next() % 256) as u8,
                1 => {
                    b.remove(i);
                }
                _ => b.insert(i, b"{}[],:\"0-9e"[(next() % 11) as usize]),
            }
        }
        match parse_trace(&b[..]) {
            Ok(recs) => {
                ok += 1;
                assert!(recs.iter().all(|r| r.check().is_ok()));
            }
            Err(e) => {
                err += 1;
                assert!(!e.to_string().is_empty());
            }
        }
    }
    assert!(
        ok > 0 && err > 0,
        "the mutations must hit both ({ok} ok, {err} errors)"
    );
}

#[test]
fn trace_records_are_checked_again_when_building_traffic() {
    let mut recs = parse_trace_str(GOOD).unwrap();
    recs[0].hash_ids.pop();
    let e = Traffic::from_trace(&recs, &SimConfig::default()).unwrap_err();
    assert_eq!(e.field, "trace");
    assert!(
        e.reason.starts_with("record 0: `hash_ids` has 1 ids"),
        "{e}"
    );
    let bad = SimConfig {
        time_scale: f64::NAN,
        ..SimConfig::default()
    };
    recs = parse_trace_str(GOOD).unwrap();
    assert_eq!(
        Traffic::from_trace(&recs, &bad).unwrap_err().field,
        "time_scale"
    );
}

#[test]
fn small_traces_that_ask_for_too_much_memory_are_errors() {
    // Four 16 M-token prompts (a 400 kB file) used 1 GB; 200 one-block requests with
    // 16 M-token trace blocks asked for 3.4 G tokens. Both are refused before anything is built.
    let rec = |timestamp_ms: u64, input_length: usize, hash_ids: Vec<u64>| TraceRecord {
        timestamp_ms,
        input_length,
        output_length: 1,
        hash_ids,
    };
    let long = |i: u64| rec(i, 1 << 24, vec![i; 32_768]);
    let recs: Vec<TraceRecord> = (0..40).map(long).collect();
    let e = Traffic::from_trace(&recs, &SimConfig::default()).unwrap_err();
    assert_eq!(e.field, "trace");
    assert!(e.reason.contains("more than the simulator's 2^29"), "{e}");
    // Shorter prompts fit.
    let short: Vec<TraceRecord> = (0..40).map(|i| rec(i, 1 << 16, vec![i; 128])).collect();
    assert!(Traffic::from_trace(&short, &SimConfig::default()).is_ok());
    let wide = SimConfig {
        trace_block_tokens: 1 << 24,
        ..SimConfig::default()
    };
    let recs: Vec<TraceRecord> = (0..200).map(|i| rec(i, 16, vec![i])).collect();
    let e = Traffic::from_trace(&recs, &wide).unwrap_err();
    assert!(e.reason.contains("200 distinct trace blocks"), "{e}");
    // A timestamp past 2^53 µs is the trace's fault at a time scale of 1.
    let far = vec![rec(u64::MAX, 16, vec![1])];
    let e = Traffic::from_trace(&far, &SimConfig::default()).unwrap_err();
    assert_eq!(e.field, "trace", "{e}");
}

#[test]
fn a_trace_line_longer_than_the_cap_is_an_error_before_it_fills_memory() {
    // A file without newlines (`/dev/zero`, a JSON array on one line) stops at the cap.
    let endless = std::io::repeat(b' ').take(MAX_LINE_BYTES as u64 + 10);
    let e = parse_trace(std::io::BufReader::new(endless)).unwrap_err();
    assert_eq!(e.line(), Some(1));
    assert!(
        e.to_string().starts_with("line 1: longer than 64 MiB"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// Trace traffic: tokens from (hash id, position)
// ---------------------------------------------------------------------------------------------

#[test]
fn trace_tokens_derive_from_block_ids_and_positions() {
    let text = [
        r#"{"timestamp": 10, "input_length": 1100, "output_length": 40, "hash_ids": [7, 8, 9]}"#,
        r#"{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [7, 8]}"#,
        r#"{"timestamp": 20, "input_length": 1030, "output_length": 0, "hash_ids": [7, 3, 9]}"#,
        r#"{"timestamp": 20, "input_length": 1030, "output_length": 0, "hash_ids": [7, 8, 9]}"#,
    ]
    .join("\n");
    let recs = parse_trace_str(&text).unwrap();
    let cfg = SimConfig {
        time_scale: 0.5,
        ..SimConfig::default()
    };
    let t = Traffic::from_trace(&recs, &cfg).unwrap();
    // Sorted by arrival (ties in file order), scaled by 0.5: ms → µs.
    let q = t.requests();
    let order: Vec<(usize, u64)> = q.iter().map(|q| (q.stream, q.arrival_us)).collect();
    assert_eq!(order, vec![(1, 0), (0, 5_000), (2, 10_000), (3, 10_000)]);
    let toks = |i: usize| t.tokens(&q[i], &mut Vec::new()).to_vec();
    let (a, b, c, d) = (toks(1), toks(0), toks(2), toks(3));
    assert_eq!((a.len(), b.len(), c.len()), (1100, 700, 1030));
    // Same ids, same tokens: b's partial second block is a prefix of a's full one.
    assert_eq!(b[..], a[..700]);
    // A different second id: the same first block, then different tokens.
    assert_eq!(c[..512], a[..512]);
    assert_ne!(c[512..520], a[512..520]);
    // Same ids, same tokens, wherever the id sits in the file.
    assert_eq!(d[..], a[..1030]);
    assert!(a.iter().all(|&x| (x as u64) < kvtrie::sim::VOCAB));
    // Blocks are the tokens' block hashes (the last partial block ignored), text their
    // rendering.
    let h = BlockHasher::new(BLOCK_SIZE);
    for (i, tok) in [(1, &a), (0, &b), (2, &c)] {
        assert_eq!(
            t.blocks(&q[i], q[i].prompt_tokens).0,
            &h.sequence_hashes(tok)[..]
        );
        assert_eq!(t.text(&q[i], &mut String::new()), render(tok));
    }
    assert_eq!(
        TRACE_BLOCK_TOKENS / BLOCK_SIZE,
        32,
        "a trace block is 32 engine blocks"
    );
    // The stream continues with the response: (1100 + 40) / 16 = 71 full blocks, whose first
    // 68 are the prompt's.
    let (all, _) = t.blocks(&q[1], 1140);
    assert_eq!(all.len(), 71);
    assert_eq!(all[..68], h.sequence_hashes(&a)[..]);
}

#[test]
fn arrivals_beyond_exact_microseconds_are_an_error() {
    let recs = parse_trace_str(
        r#"{"timestamp": 1000, "input_length": 16, "output_length": 1, "hash_ids": [1]}
{"timestamp": 2000, "input_length": 16, "output_length": 1, "hash_ids": [2]}"#,
    )
    .unwrap();
    let cfg = SimConfig {
        time_scale: 1e17,
        ..trace_cfg()
    };
    let e = Traffic::from_trace(&recs, &cfg).unwrap_err();
    assert_eq!(e.field, "time_scale", "{e}");
    // The largest scale that still fits replays.
    let cfg = SimConfig {
        time_scale: 1e9,
        ..trace_cfg()
    };
    let t = Traffic::from_trace(&recs, &cfg).unwrap();
    assert_eq!(t.requests()[1].arrival_us, 2_000_000_000_000_000);
}

#[test]
fn a_response_never_matches_a_trace_block() {
    // Line i's response and the blocks of any id are separate token streams: with salted
    // seeds `i ^ salt`, block id `i ^ 3` had the tokens of line i's response, so a prompt
    // continuing [0] with id 3 hit the 64 tokens of line 0's response too.
    for (first, second) in [
        (0u64, 3u64),
        (0, 1),
        (0, 2),
        (1, 2),
        (5, 6),
        (42, 6),
        (7, 4),
    ] {
        let text = [
            format!(
                r#"{{"timestamp": 0, "input_length": 512, "output_length": 512, "hash_ids": [{first}]}}"#
            ),
            format!(
                r#"{{"timestamp": 10000, "input_length": 1024, "output_length": 8, "hash_ids": [{first}, {second}]}}"#
            ),
        ]
        .join("\n");
        let recs = parse_trace_str(&text).unwrap();
        let t = Traffic::from_trace(&recs, &trace_cfg()).unwrap();
        let c = infinite_cache_ceiling(&t);
        assert_eq!(c.cached_tokens, 512, "ids {first}, {second}: {c:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Replay of a 2,000-request slice of the Mooncake conversation trace
// ---------------------------------------------------------------------------------------------

/// The first 2,000 requests of `../shared/traces/mooncake_conversation.jsonl`, copied into
/// `tests/data/` (see its README) so the test runs on any checkout.
fn slice() -> &'static Traffic {
    static T: OnceLock<Traffic> = OnceLock::new();
    T.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/mooncake_conversation_2000.jsonl"
        );
        let file = std::fs::File::open(path).expect("tests/data trace slice");
        let recs = parse_trace(std::io::BufReader::new(file)).unwrap();
        assert_eq!(recs.len(), 2000);
        Traffic::from_trace(&recs, &trace_cfg()).unwrap()
    })
}

/// The trace replay's configuration: 8 replicas with the README's trace cache size.
fn trace_cfg() -> SimConfig {
    SimConfig {
        cache_blocks: 65_536,
        ..SimConfig::default()
    }
}

/// Every standard policy on the slice, twice (to check determinism). The two replays run on
/// two threads: they share nothing but the read-only traffic, and this is the longest step of
/// the debug-build test suite.
fn slice_reports() -> &'static (Vec<Report>, Vec<Report>) {
    static R: OnceLock<(Vec<Report>, Vec<Report>)> = OnceLock::new();
    R.get_or_init(|| {
        let cfg = trace_cfg();
        let traffic = slice();
        std::thread::scope(|s| {
            let second = s.spawn(|| run_all(&cfg, traffic, RouterSetup::single()));
            let a = run_all(&cfg, traffic, RouterSetup::single());
            (a, second.join().expect("second replay"))
        })
    })
}

fn by_name<'a>(reports: &'a [Report], name: &str) -> &'a Report {
    reports.iter().find(|r| r.policy == name).unwrap()
}

#[test]
fn slice_replays_are_deterministic_per_policy() {
    let (a, b) = slice_reports();
    assert_eq!(a.len(), 6);
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.policy, y.policy);
        assert_eq!(x.requests, 2000, "{}", x.policy);
        assert_eq!(
            (x.cached_tokens, &x.per_replica, x.kv_events),
            (y.cached_tokens, &y.per_replica, y.kv_events),
            "{}",
            x.policy
        );
        assert_eq!(x.ttft_ms, y.ttft_ms, "{}", x.policy);
        assert!(x.ttft_ms.iter().all(|t| t.is_finite() && *t > 0.0));
    }
}

#[test]
fn slice_oracle_bounds_every_policy_and_the_ceiling_bounds_the_oracle() {
    let (reports, _) = slice_reports();
    let oracle = by_name(reports, "oracle").hit_rate();
    // The oracle is greedy (longest cached prefix within a queue bound), a strong reference
    // but not an optimum: the KV-aware policy at the simulator's weight ties it on this slice
    // (25.41 % vs 25.51 % of prompt tokens; 25.58 % vs 25.57 % when the cache was looked up
    // as a request entered service rather than when its prefill started), so it may exceed
    // it by at most half a point.
    for r in reports {
        let margin = if r.policy == "kv-aware" { 0.005 } else { 0.0 };
        assert!(
            r.hit_rate() <= oracle + margin,
            "{} {:.4} > oracle {oracle:.4}",
            r.policy,
            r.hit_rate()
        );
    }
    let ceiling = infinite_cache_ceiling(slice());
    assert_eq!(ceiling.prompt_tokens, reports[0].prompt_tokens);
    assert!(ceiling.hit_rate() >= oracle, "{ceiling:?} < {oracle}");
    // Round-robin spreads each conversation over the cluster: far below both.
    assert!(by_name(reports, "round-robin").hit_rate() < 0.5 * oracle);
}

/// The KV-aware policy against the oracle on the slice (the issue's target): at least 0.9 ×
/// the oracle's hit rate, with a p99 TTFT no worse than round-robin's.
#[test]
fn slice_kv_aware_reaches_nine_tenths_of_the_oracle() {
    let (reports, _) = slice_reports();
    let kv = by_name(reports, "kv-aware");
    let oracle = by_name(reports, "oracle");
    let rr = by_name(reports, "round-robin");
    let pa = by_name(reports, "prefix-affinity (ray)");
    assert!(
        kv.hit_rate() >= 0.9 * oracle.hit_rate(),
        "kv-aware {:.4} < 0.9 × oracle {:.4}",
        kv.hit_rate(),
        oracle.hit_rate()
    );
    // The other half of T1's target: at least prefix affinity's hit rate (on this slice
    // 0.4 points above it; on the whole trace 0.2).
    assert!(
        kv.hit_rate() >= pa.hit_rate(),
        "kv-aware {:.4} < prefix affinity {:.4}",
        kv.hit_rate(),
        pa.hit_rate()
    );
    assert!(
        kv.ttft_p99_ms <= rr.ttft_p99_ms,
        "{} > {}",
        kv.ttft_p99_ms,
        rr.ttft_p99_ms
    );
}

#[test]
fn slice_shared_prefix_affinity_routers_beat_isolated_ones() {
    let cfg = trace_cfg();
    let run = |setup| {
        let mut p = PrefixAffinity::new(
            "prefix-affinity (ray)",
            PrefixAffinityConfig::default(),
            cfg.replicas,
            setup,
        );
        simulate(&cfg, slice(), &mut p, &mut || {}).unwrap()
    };
    let isolated = run(RouterSetup::isolated(8));
    let shared = run(RouterSetup::shared(8));
    assert!(
        isolated.hit_rate() <= shared.hit_rate(),
        "isolated {:.4} > shared {:.4}",
        isolated.hit_rate(),
        shared.hit_rate()
    );
    // Sharing one tree, eight routers do about as well as one.
    let single = by_name(&slice_reports().0, "prefix-affinity (ray)");
    assert!(shared.hit_rate() >= 0.9 * single.hit_rate());
}

#[test]
fn router_setups_clamp_the_instance_count() {
    assert_eq!(RouterSetup::isolated(0).count(), 1);
    assert_eq!(RouterSetup::shared(10_000).count(), MAX_ROUTER_INSTANCES);
    assert_eq!(RouterSetup::shared(10_000).label(), "256 shared");
    assert_eq!(RouterSetup::isolated(1).label(), "1");
    let p = PrefixAffinity::new(
        "pa",
        PrefixAffinityConfig::default(),
        4,
        RouterSetup::shared(1 << 40),
    );
    assert_eq!(p.routers().len(), MAX_ROUTER_INSTANCES);
}

#[test]
fn kv_aware_instances_learn_only_what_their_setup_allows() {
    // Isolated KV-aware instances index only the blocks their own requests cached (and every
    // eviction of those); shared ones index everything. Run a short synthetic slice and check
    // each instance's index against the caches' union.
    let cfg = SimConfig {
        requests: 300,
        ..small_cfg(5)
    };
    let traffic = Traffic::generate(&cfg).unwrap();
    for setup in [RouterSetup::isolated(3), RouterSetup::shared(3)] {
        let mut p = KvAware::new(kv_config(&cfg), cfg.replicas, setup);
        let r = simulate(&cfg, &traffic, &mut p, &mut || {}).unwrap();
        assert_eq!(r.requests, 300);
        let blocks: Vec<usize> = p
            .routers()
            .iter()
            .map(|k| {
                (0..cfg.replicas as u64)
                    .map(|w| k.index().block_count(WorkerId(w)))
                    .sum()
            })
            .collect();
        let first = p.routers()[0].index();
        let same = p
            .routers()
            .iter()
            .all(|k| std::sync::Arc::ptr_eq(k.index(), first));
        assert_eq!(same, setup.shared);
        if !setup.shared {
            let total: usize = blocks.iter().sum();
            assert!(blocks.iter().all(|&b| b > 0 && b < total), "{blocks:?}");
        }
        // Every booking was released.
        for k in p.routers() {
            assert_eq!(k.stats().active_requests, 0);
        }
    }
}

#[test]
fn a_cache_insert_pairs_the_shorter_of_its_two_slices() {
    // It was a debug assertion (a panic in debug builds, truncation in release builds).
    let mut cache = LruCache::new(4);
    let mut events = Vec::new();
    cache.insert(&[1, 2, 3], &[10], &mut events);
    assert_eq!(cache.lookup(&[1, 2, 3]), 1);
    cache.insert(&[5], &[50, 60], &mut events);
    assert_eq!(cache.lookup(&[5]), 1);
}

// ---------------------------------------------------------------------------------------------
// Trace block sizes other than Mooncake's 512 tokens (Dynamo's generator: `--block-size`)
// ---------------------------------------------------------------------------------------------

#[test]
fn traces_of_other_block_sizes_replay_with_the_trace_block_size_set() {
    // A trace of 16-token blocks, as Dynamo's generator writes with `--block-size 16`: 40
    // tokens are 3 blocks.
    let text = "{\"timestamp\": 0, \"input_length\": 40, \"output_length\": 4, \"hash_ids\": [1, 2, 3]}\n\
                {\"timestamp\": 5, \"input_length\": 48, \"output_length\": 4, \"hash_ids\": [1, 2, 4]}";
    // At the default 512 the counts do not fit, and the error says which size they fit.
    let (line, msg) = line_error(text);
    assert_eq!(line, 1);
    assert!(
        msg.contains(
            "`hash_ids` has 3 ids but `input_length` 40 needs 1 (one per 512-token block)"
        ) && msg.contains("fit a trace block size of 16 tokens")
            && msg.contains("--trace-block-tokens 16"),
        "{msg}"
    );
    let recs = parse_trace_str_with(text, 16).unwrap();
    assert_eq!(parse_trace_with(text.as_bytes(), 16).unwrap(), recs);
    assert_eq!(recs[1].hash_ids, vec![1, 2, 4]);
    // Several fitting sizes are all named; none, said so.
    let one = r#"{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1]}"#;
    let e = parse_trace_str_with(one, 16).unwrap_err().to_string();
    assert!(
        e.contains("needs 7 (one per 16-token block); these counts fit a trace block size of 128, 256, 512 or 1024 tokens"),
        "{e}"
    );
    assert_eq!(fitting_block_tokens(100, 2), vec![64]);
    let none = r#"{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}"#;
    let (_, msg) = line_error(none);
    assert!(msg.contains("no common trace block size"), "{msg}");
    // A size that is not a whole number of engine blocks is refused, by the parser and by
    // the configuration.
    for bad in [0, 8, 100, (1 << 24) + 16] {
        match parse_trace_str_with(text, bad) {
            Err(TraceError::BlockTokens { block_tokens, .. }) => assert_eq!(block_tokens, bad),
            other => panic!("{bad}: {other:?}"),
        }
        let cfg = SimConfig {
            trace_block_tokens: bad,
            ..SimConfig::default()
        };
        let e = cfg.validate().unwrap_err();
        assert_eq!(e.field, "trace_block_tokens", "{e}");
        assert!(
            e.reason.contains("multiple of the engine block size 16"),
            "{e}"
        );
    }
    // Replayed at 16 tokens per trace block: each id is one engine block of the id's first
    // 16 tokens, so the two prompts share exactly 2 engine blocks (ids 1, 2).
    let cfg = SimConfig {
        trace_block_tokens: 16,
        ..trace_cfg()
    };
    let t = Traffic::from_trace(&recs, &cfg).unwrap();
    let q = t.requests();
    let (a, b) = (
        t.tokens(&q[0], &mut Vec::new()).to_vec(),
        t.tokens(&q[1], &mut Vec::new()).to_vec(),
    );
    assert_eq!((a.len(), b.len()), (40, 48));
    assert_eq!(a[..32], b[..32]);
    assert_ne!(a[32..40], b[32..40]);
    let h = BlockHasher::new(BLOCK_SIZE);
    assert_eq!(t.blocks(&q[1], 48).0, &h.sequence_hashes(&b)[..]);
    assert_eq!(t.text(&q[0], &mut String::new()), render(&a));
    // The first 16 tokens of an id are the same at any trace block size.
    let at512 = Traffic::from_trace(&parse_trace_str(GOOD).unwrap(), &trace_cfg()).unwrap();
    let good = at512.tokens(&at512.requests()[0], &mut Vec::new()).to_vec();
    let recs0 = parse_trace_str_with(
        r#"{"timestamp": 0, "input_length": 16, "output_length": 0, "hash_ids": [0]}"#,
        16,
    )
    .unwrap();
    let t0 = Traffic::from_trace(&recs0, &cfg).unwrap();
    assert_eq!(t0.tokens(&t0.requests()[0], &mut Vec::new()), &good[..16]);
    assert_eq!(infinite_cache_ceiling(&t).cached_tokens, 32);
    // Records of 16-token blocks replayed at the default size: an error naming the record.
    let e = Traffic::from_trace(&recs, &trace_cfg()).unwrap_err();
    assert_eq!(e.field, "trace");
    assert!(
        e.reason.starts_with("record 0: `hash_ids` has 3 ids"),
        "{e}"
    );
    let bad = SimConfig {
        trace_block_tokens: 24,
        ..trace_cfg()
    };
    assert_eq!(
        Traffic::from_trace(&recs, &bad).unwrap_err().field,
        "trace_block_tokens"
    );
}

// ---------------------------------------------------------------------------------------------
// Unsorted traces: replayed in timestamp order; the N earliest arrivals
// ---------------------------------------------------------------------------------------------

fn trace_line(ts: u64, id: u64) -> String {
    format!(
        r#"{{"timestamp": {ts}, "input_length": 600, "output_length": 9, "hash_ids": [{id}, 5]}}"#
    )
}

#[test]
fn unsorted_traces_replay_by_timestamp_ties_in_file_order() {
    // Timestamps 11 and 10 ms at a time scale of 1e-4 both arrive at 1 µs: the earlier
    // timestamp (line 1) is still replayed first.
    let text = [trace_line(11, 0), trace_line(10, 1), trace_line(40, 2)].join("\n");
    let recs = parse_trace_str(&text).unwrap();
    let cfg = SimConfig {
        time_scale: 1e-4,
        ..trace_cfg()
    };
    let t = Traffic::from_trace(&recs, &cfg).unwrap();
    let order: Vec<(usize, u64)> = t
        .requests()
        .iter()
        .map(|q| (q.stream, q.arrival_us))
        .collect();
    assert_eq!(order, vec![(1, 1), (0, 1), (2, 4)]);
}

#[test]
fn the_n_earliest_arrivals_of_an_unsorted_trace_are_kept() {
    // File order: 30, 10, 20, 10, 5 ms.
    let text = [
        trace_line(30, 0),
        trace_line(10, 1),
        trace_line(20, 2),
        trace_line(10, 3),
        trace_line(5, 4),
    ]
    .join("\n");
    let recs = parse_trace_str(&text).unwrap();
    let cfg = trace_cfg();
    let full = Traffic::from_trace(&recs, &cfg).unwrap();
    let arrivals =
        |t: &Traffic| -> Vec<u64> { t.requests().iter().map(|q| q.arrival_us).collect() };
    assert_eq!(arrivals(&full), vec![5_000, 10_000, 10_000, 20_000, 30_000]);
    // The three earliest: 5, then the two at 10 ms (lines 1 and 3, in file order), not the
    // first three lines (30, 10, 20).
    let three = Traffic::from_trace_earliest(&recs, 3, &cfg).unwrap();
    assert_eq!(arrivals(&three), vec![5_000, 10_000, 10_000]);
    assert_eq!(three.streams(), 3);
    // Ties in file order: the first at 10 ms is line 1 (id 1), as in the whole replay.
    let toks = |t: &Traffic, i: usize| t.tokens(&t.requests()[i], &mut Vec::new()).to_vec();
    for i in 0..3 {
        assert_eq!(toks(&three, i), toks(&full, i), "request {i}");
        assert_eq!(
            three.requests()[i].output_tokens,
            full.requests()[i].output_tokens
        );
        // The response (cached at completion) is the same too.
        let q = &three.requests()[i];
        let f = &full.requests()[i];
        assert_eq!(three.blocks(q, 609).0, full.blocks(f, 609).0, "request {i}");
    }
    // The cut falls between the two requests at 10 ms: the first in file order is kept.
    let two = Traffic::from_trace_earliest(&recs, 2, &cfg).unwrap();
    assert_eq!(toks(&two, 1), toks(&full, 1));
    assert_ne!(toks(&two, 1), toks(&full, 2));
    // n beyond the trace: the whole replay.
    let all = Traffic::from_trace_earliest(&recs, 99, &cfg).unwrap();
    assert_eq!(all.requests(), full.requests());
}

// ---------------------------------------------------------------------------------------------
// The prefix cache is looked up when a request's prefill starts
// ---------------------------------------------------------------------------------------------

#[test]
fn replica_prefill_queue_is_first_come_first_served() {
    let mut r = Replica::with_prefill_lanes(8, 4, 2);
    assert_eq!(r.queue_prefill(1), Some(1));
    assert_eq!(r.queue_prefill(2), Some(2));
    assert_eq!(r.queue_prefill(3), None);
    assert_eq!(r.queue_prefill(4), None);
    assert_eq!((r.prefilling(), r.prefill_waiting()), (2, 2));
    assert_eq!(r.prefill_finished(), Some(3));
    assert_eq!(r.prefill_finished(), Some(4));
    assert_eq!(r.prefill_finished(), None);
    assert_eq!(r.prefill_finished(), None);
    assert_eq!(
        r.prefill_finished(),
        None,
        "finishing with no prefill running does nothing"
    );
    assert_eq!((r.prefilling(), r.prefill_waiting()), (0, 0));
}

#[test]
fn a_request_queued_behind_the_prefill_of_its_prefix_finds_it_cached() {
    // A hand-made trace: request 1 extends request 0's prompt by a block and arrives while
    // request 0's 1,024-token prefill is running on the only replica (one prefill lane).
    let text = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 10, \"hash_ids\": [1, 2]}\n\
                {\"timestamp\": 1, \"input_length\": 1536, \"output_length\": 10, \"hash_ids\": [1, 2, 3]}";
    let recs = parse_trace_str(text).unwrap();
    let cfg = SimConfig {
        replicas: 1,
        ..trace_cfg()
    };
    let traffic = Traffic::from_trace(&recs, &cfg).unwrap();
    let ceiling = infinite_cache_ceiling(&traffic);
    assert_eq!(ceiling.cached_tokens, 1024);
    for mut policy in standard_policies(&cfg, RouterSetup::single()) {
        let r = simulate(&cfg, &traffic, policy.as_mut(), &mut || {}).unwrap();
        // Request 0: prefill 5 ms + 1024 × 0.1 ms = 107.4 ms. Request 1 enters service at
        // 1 ms but its prefill waits for the lane until 107.4 ms; it looks the cache up then
        // and finds request 0's 1,024 tokens: 5 + 512 × 0.1 = 56.2 ms of prefill, first token
        // at 163.6 ms. (Looked up at 1 ms, it found nothing and its first token came at
        // 107.4 + 158.6 ms.)
        assert_eq!(r.cached_tokens, 1024, "{}", r.policy);
        assert_eq!(r.ttft_ms, vec![107.4, 162.6], "{}", r.policy);
        assert!(r.cached_tokens <= ceiling.cached_tokens);
        // Two Stored events: request 0's prompt (64 blocks) at its prefill, request 1's new
        // block (32 engine blocks) at its prefill; the responses fill no block, nothing is
        // evicted.
        assert_eq!(r.kv_events, 2, "{}", r.policy);
    }
    // With a lane per running request the two prefills run at once, and the second one
    // cannot use blocks the first has not finished computing.
    let lanes = SimConfig {
        prefill_lanes: 8,
        ..cfg.clone()
    };
    let r = simulate(&lanes, &traffic, &mut RoundRobin::default(), &mut || {}).unwrap();
    assert_eq!(r.cached_tokens, 0);
    assert_eq!(r.ttft_ms, vec![107.4, 158.6]);
}

#[test]
fn a_prefix_evicted_while_a_request_waits_for_its_prefill_is_a_miss() {
    // One replica with room for 64 engine blocks (1,024 tokens), one prefill lane. Request
    // 0 caches trace block 1 (32 engine blocks); request 1 (1,024 tokens) is being prefilled
    // when request 2 (block 1 again) enters service, and evicts block 1 before request 2's
    // prefill starts.
    let text = [
        r#"{"timestamp": 0, "input_length": 512, "output_length": 0, "hash_ids": [1]}"#,
        r#"{"timestamp": 100, "input_length": 1024, "output_length": 0, "hash_ids": [4, 5]}"#,
        r#"{"timestamp": 101, "input_length": 512, "output_length": 0, "hash_ids": [1]}"#,
    ]
    .join("\n");
    let recs = parse_trace_str(&text).unwrap();
    let cfg = SimConfig {
        replicas: 1,
        cache_blocks: 64,
        ..trace_cfg()
    };
    let traffic = Traffic::from_trace(&recs, &cfg).unwrap();
    let r = simulate(&cfg, &traffic, &mut RoundRobin::default(), &mut || {}).unwrap();
    // Request 0: 0..56.2 ms, caches id 1. Request 1 at 100 ms: 5 + 102.4 ms of prefill,
    // done at 207.4 ms; its 64 blocks evict id 1. Request 2 entered service at 101 ms, when
    // id 1 was cached, but its prefill starts at 207.4 ms: a miss.
    assert_eq!(r.cached_tokens, 0);
    assert_eq!(r.ttft_ms, vec![56.2, 107.4, 162.6]);
}
