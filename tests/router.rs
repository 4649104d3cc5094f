//! Router policies: `PrefixAffinityRouter` (Ray / SGLang policies over `PrefixTree`) and
//! `KvAwareRouter` (Dynamo's cost policy over `BlockIndex`). Deterministic: fixed seeds, and
//! the concurrent tests assert invariants that hold under every interleaving.
#![cfg(not(loom))]

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kvtrie::router::{
    prompt_text, Candidate, ChatMessage, ContentPart, KvAwareConfig, KvAwareRouter, LoadChoice,
    PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId, RouteError, RouteReason, SelectError,
    Selection, WorkerLoad,
};
use kvtrie::workload::SplitMix64;
use kvtrie::{BlockIndex, KvEvent, StoredBlock, WorkerId};

// ---------------------------------------------------------------------------------------------
// PrefixAffinityRouter
// ---------------------------------------------------------------------------------------------

fn router_with(config: PrefixAffinityConfig, n: usize) -> (PrefixAffinityRouter, Vec<ReplicaId>) {
    let router = PrefixAffinityRouter::new(config);
    let names: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
    let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let ids = router.update_replicas(&refs);
    (router, ids)
}

fn idle(ids: &[ReplicaId]) -> Vec<Candidate> {
    ids.iter().map(|&r| Candidate::new(r, 0)).collect()
}

fn loaded(ids: &[ReplicaId], queues: &[usize]) -> Vec<Candidate> {
    ids.iter()
        .zip(queues)
        .map(|(&r, &q)| Candidate::new(r, q))
        .collect()
}

fn put(router: &PrefixAffinityRouter, text: &str, r: ReplicaId) {
    router.tree().insert_at(text, r.tenant(), 0).unwrap();
}

#[test]
fn high_match_rate_goes_to_the_replica_holding_the_prefix() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 4);
    let mut rng = SplitMix64::new(1);
    let system = rng.text(1000);
    put(&router, &format!("{system}first question"), ids[2]);
    // r2 is busier than everyone, but Ray's default never counts as imbalanced.
    let cands = loaded(&ids, &[0, 0, 50, 0]);
    for i in 0..20 {
        let r = router
            .route(&format!("{system}question {i}"), &cands)
            .unwrap();
        assert_eq!(r.replica, ids[2]);
        assert_eq!(r.reason, RouteReason::PrefixMatch);
        assert!(r.matched_chars >= 1000);
    }
    // Among several holders, the least loaded wins.
    put(&router, &format!("{system}other"), ids[3]);
    let r = router.route(&format!("{system}x"), &cands).unwrap();
    assert_eq!((r.replica, r.reason), (ids[3], RouteReason::PrefixMatch));
    // The prompt was inserted for the chosen replica.
    let m = router
        .tree()
        .prefix_match(&format!("{system}x"), Some(&[ids[3].tenant()]));
    assert_eq!(m.matched_chars, 1001);
    router.tree().check_invariants().unwrap();
}

#[test]
fn a_holder_outside_the_candidates_is_not_chosen() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 3);
    put(&router, "shared system prompt, then a question", ids[0]);
    let r = router
        .route("shared system prompt, then another", &idle(&ids[1..]))
        .unwrap();
    assert_ne!(r.replica, ids[0]);
    assert_eq!(r.matched_chars, 0);
    assert_eq!(r.reason, RouteReason::SmallestTenants);
}

/// `choose` matches among the candidates only, as `route` does: a longer prefix held by a
/// replica outside them neither counts as the match nor hides a candidate's shorter one.
#[test]
fn choose_matches_only_among_the_candidates() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 3);
    put(&router, "shared system prompt, then a question", ids[0]);
    put(&router, "shared system", ids[1]);
    let prompt = "shared system prompt, then another";
    let r = router.choose(prompt, &idle(&ids[1..])).unwrap();
    assert_eq!(
        (r.replica, r.reason, r.matched_chars),
        (ids[1], RouteReason::PrefixMatch, 13)
    );
    let r = router.choose(prompt, &idle(&ids[2..])).unwrap();
    assert_eq!(
        (r.replica, r.reason, r.matched_chars),
        (ids[2], RouteReason::SmallestTenants, 0)
    );
    // `route` decides the same.
    let r = router.route(prompt, &idle(&ids[1..])).unwrap();
    assert_eq!(
        (r.replica, r.reason, r.matched_chars),
        (ids[1], RouteReason::PrefixMatch, 13)
    );
}

#[test]
fn low_match_rate_goes_to_the_smallest_candidate_only() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 3);
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    let mut rng = SplitMix64::new(2);
    put(&router, &format!("x{}", rng.text(10_000)), a);
    put(&router, &rng.text(100), b);
    // c is the smallest replica (0 chars) but not a candidate.
    let cands = idle(&[a, b]);
    for _ in 0..20 {
        // Shares one char ("x") with a's text: match rate ~1% < 10%.
        let prompt = format!("x{}", rng.text(99));
        let r = router.route(&prompt, &cands).unwrap();
        assert_eq!(r.replica, b, "the smaller candidate");
        assert_ne!(r.replica, c);
        assert_eq!(r.reason, RouteReason::SmallestTenants);
    }
    assert_eq!(router.tree().char_count(c.tenant()), Some(0));
}

#[test]
fn a_zero_match_rate_threshold_takes_every_candidate_on_a_miss_as_ray_does() {
    // Ray: rate 0 ≥ threshold 0, so the matched tenants (at the root: every candidate) are
    // the group, and the least loaded of them wins, not the smallest tree.
    let (router, ids) = router_with(
        PrefixAffinityConfig {
            match_rate_threshold: 0.0,
            ..PrefixAffinityConfig::default()
        },
        2,
    );
    put(&router, "abcdef", ids[0]);
    let r = router.route("zzz", &loaded(&ids, &[0, 5])).unwrap();
    assert_eq!((r.replica, r.reason), (ids[0], RouteReason::PrefixMatch));
    assert_eq!(r.matched_chars, 0);
    // Above 0, a miss still goes to the smallest tree.
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 2);
    put(&router, "abcdef", ids[0]);
    let r = router.route("zzz", &loaded(&ids, &[0, 5])).unwrap();
    assert_eq!(
        (r.replica, r.reason),
        (ids[1], RouteReason::SmallestTenants)
    );
}

#[test]
fn match_rate_threshold_boundary_counts_chars_not_bytes() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 2);
    // a holds 10 chars (20 bytes) of a 100-char prompt: rate exactly 0.1 → hit.
    let held = "é".repeat(10);
    put(&router, &held, ids[0]);
    put(&router, "zz", ids[1]); // b is smaller by chars? no: 2 < 10, so a miss would go to b
    let prompt = format!("{held}{}", "q".repeat(90));
    let r = router.route(&prompt, &idle(&ids)).unwrap();
    assert_eq!((r.replica, r.reason), (ids[0], RouteReason::PrefixMatch));
    assert_eq!(r.matched_chars, 10);
    // 10 of 101 chars: below the threshold → the smallest replica.
    let prompt = format!("{held}{}", "w".repeat(91));
    let r = router.route(&prompt, &idle(&ids)).unwrap();
    assert_eq!(
        (r.replica, r.reason),
        (ids[1], RouteReason::SmallestTenants)
    );
}

#[test]
fn imbalance_uses_power_of_two_choices() {
    let config = PrefixAffinityConfig {
        imbalanced_threshold: 10.0,
        seed: 3,
        ..PrefixAffinityConfig::default()
    };
    let (router, ids) = router_with(config, 4);
    put(&router, "the cached system prompt and more", ids[0]);
    // Two candidates: both are drawn, so the idle one always wins over the holder.
    let two = loaded(&ids[..2], &[100, 0]);
    for _ in 0..20 {
        let r = router
            .route("the cached system prompt and more", &two)
            .unwrap();
        assert_eq!((r.replica, r.reason), (ids[1], RouteReason::Imbalanced));
    }
    // A spread equal to the threshold is not imbalanced: the holder wins.
    put(&router, "another cached prompt", ids[0]);
    let r = router
        .route("another cached prompt", &loaded(&ids[..2], &[10, 0]))
        .unwrap();
    assert_eq!((r.replica, r.reason), (ids[0], RouteReason::PrefixMatch));
    // Four candidates: the busiest replica is never chosen (it loses every pair it is
    // drawn in) and the idle one wins about half the time (whenever drawn).
    let four = loaded(&ids, &[100, 50, 0, 60]);
    let mut counts = [0usize; 4];
    for _ in 0..600 {
        let r = router.route("the cached system prompt", &four).unwrap();
        assert_eq!(r.reason, RouteReason::Imbalanced);
        counts[ids.iter().position(|&x| x == r.replica).unwrap()] += 1;
    }
    assert_eq!(counts[0], 0, "{counts:?}");
    assert!(counts[2] > 200 && counts[2] < 400, "{counts:?}");
    assert!(counts[1] > 0 && counts[3] > 0, "{counts:?}");
}

#[test]
fn power_of_two_is_deterministic_per_seed() {
    let run = || {
        let config = PrefixAffinityConfig {
            imbalanced_threshold: 0.0,
            seed: 99,
            ..PrefixAffinityConfig::default()
        };
        let (router, ids) = router_with(config, 8);
        let cands = loaded(&ids, &[5, 1, 7, 3, 2, 8, 4, 6]);
        (0..100)
            .map(|i| {
                router
                    .route(&format!("p{i}"), &cands)
                    .unwrap()
                    .replica
                    .tenant()
                    .slot()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}

/// Power of two choices keeps the first drawn of two tied candidates (Ray's rule: the second
/// wins only with a strictly shorter queue). The router's stream is SplitMix64 from the seed
/// (the stream of `workload::SplitMix64`), and a draw in `0..n` takes the top bits of the next
/// value times `n`: with two tied replicas the first drawn is `next() >> 63`, the second draw
/// is spent on the other one.
#[test]
fn power_of_two_keeps_the_first_drawn_of_a_tie() {
    let config = PrefixAffinityConfig {
        imbalanced_threshold: -1.0, // always imbalanced: every request draws two
        seed: 17,
        ..PrefixAffinityConfig::default()
    };
    let (router, ids) = router_with(config, 2);
    let cands = idle(&ids);
    let mut rng = SplitMix64::new(17);
    let mut firsts = [0usize; 2];
    for k in 0..64 {
        let first = (rng.next() >> 63) as usize;
        rng.next();
        firsts[first] += 1;
        let r = router.route(&format!("p{k}"), &cands).unwrap();
        assert_eq!(
            (r.replica, r.reason),
            (ids[first], RouteReason::Imbalanced),
            "request {k}"
        );
    }
    // Both replicas were drawn first, so each side of the rule was exercised.
    assert!(firsts[0] > 0 && firsts[1] > 0, "{firsts:?}");
}

/// `choose` takes a prompt of exactly `MAX_TEXT_BYTES` bytes and rejects one byte more with
/// the tree's error. The prompts are NUL bytes in a zeroed allocation (untouched pages:
/// reading them costs no memory) over an empty tree.
#[test]
fn choose_accepts_a_prompt_of_the_maximum_length_and_rejects_one_byte_more() {
    use kvtrie::MAX_TEXT_BYTES;
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 1);
    let bytes = vec![0u8; MAX_TEXT_BYTES + 1];
    let longest = std::str::from_utf8(&bytes[..MAX_TEXT_BYTES]).unwrap();
    let r = router.choose(longest, &idle(&ids)).unwrap();
    assert_eq!((r.replica, r.matched_chars), (ids[0], 0));
    let over = std::str::from_utf8(&bytes).unwrap();
    assert_eq!(
        router.choose(over, &idle(&ids)),
        Err(RouteError::Tree(kvtrie::Error::TextTooLong {
            len: MAX_TEXT_BYTES + 1
        }))
    );
}

#[test]
fn empty_prompt_is_no_text_and_rotates_over_the_least_loaded() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 3);
    let cands = loaded(&ids, &[2, 0, 0]);
    let mut seen = Vec::new();
    for _ in 0..4 {
        let r = router.route("", &cands).unwrap();
        assert_eq!(r.reason, RouteReason::NoText);
        assert_eq!(r.matched_chars, 0);
        seen.push(r.replica);
    }
    assert!(seen.iter().all(|&r| r != ids[0]));
    assert!(seen.contains(&ids[1]) && seen.contains(&ids[2]), "{seen:?}");
    // Nothing was stored.
    assert_eq!(router.tree().node_count(), 0);
    router.route_chat(&[], &cands).unwrap();
}

#[test]
fn chat_messages_are_normalized_like_ray() {
    let parts = [
        ContentPart::Text("Describe "),
        ContentPart::Image,
        ContentPart::Text("this picture"),
        ContentPart::Image,
    ];
    let msgs = [
        ChatMessage::text("system", "You are a vision model."),
        ChatMessage::parts("user", &parts),
        ChatMessage::text("assistant", ""),
    ];
    let text = prompt_text(&msgs);
    assert_eq!(text, "You are a vision model.Describe this picture");
    assert!(!text.contains("system") && !text.contains("user"));
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 2);
    let r = router.route_chat(&msgs, &idle(&ids)).unwrap();
    let m = router
        .tree()
        .prefix_match(&text, Some(&[r.replica.tenant()]));
    assert_eq!(m.matched_chars, text.chars().count());
    // The same conversation with a different role layout routes to the same replica.
    let again = [ChatMessage::text(
        "user",
        "You are a vision model.Describe this picture!",
    )];
    let r2 = router.route_chat(&again, &idle(&ids)).unwrap();
    assert_eq!(
        (r2.replica, r2.reason),
        (r.replica, RouteReason::PrefixMatch)
    );
}

#[test]
fn cache_misses_spread_over_idle_replicas() {
    for config in [
        PrefixAffinityConfig::default(),
        PrefixAffinityConfig::sglang(),
    ] {
        let (router, ids) = router_with(config, 4);
        let cands = idle(&ids);
        let mut rng = SplitMix64::new(5);
        let mut counts: HashMap<ReplicaId, usize> = HashMap::new();
        for _ in 0..100 {
            let r = router.route(&rng.text(200), &cands).unwrap();
            *counts.entry(r.replica).or_default() += 1;
        }
        assert_eq!(counts.len(), 4, "{counts:?}");
        assert!(counts.values().all(|&c| c <= 50), "{counts:?}");
    }
}

/// The replica registry's lookups and removal report exact values: `replica` finds a live
/// replica by name, `remove_replica` returns the chars its tree held (0 for an id already
/// removed), and the router keeps the configuration it was given.
#[test]
fn replica_lookup_and_removal_report_exact_values() {
    let config = PrefixAffinityConfig {
        match_rate_threshold: 0.25,
        seed: 9,
        ..PrefixAffinityConfig::default()
    };
    let (router, ids) = router_with(config, 2);
    assert_eq!(router.config(), &config);
    assert_eq!(router.replica("r0"), Some(ids[0]));
    assert_eq!(router.replica("r1"), Some(ids[1]));
    assert_eq!(router.replica("r2"), None);
    put(&router, "hello world", ids[0]);
    put(&router, "hello there", ids[0]);
    // "hello " is shared: 6 + 5 + 5 chars.
    assert_eq!(router.remove_replica(ids[0]), 16);
    assert_eq!(router.remove_replica(ids[0]), 0);
    assert_eq!(router.replica("r0"), None);
    assert_eq!(router.remove_replica(ids[1]), 0);
}

/// A tree error carries its cause: `RouteError::Tree` reports it as its `source`, the other
/// errors have none.
#[test]
fn a_route_error_from_the_tree_has_it_as_source() {
    use std::error::Error as _;
    let cause = kvtrie::Error::TextTooLong { len: 7 };
    let e = RouteError::Tree(cause.clone());
    assert_eq!(e.source().map(|s| s.to_string()), Some(cause.to_string()));
    assert!(RouteError::NoCandidates.source().is_none());
    assert!(RouteError::NoLiveCandidates.source().is_none());
}

#[test]
fn removed_replica_is_never_chosen_again() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 4);
    let mut rng = SplitMix64::new(6);
    let system = rng.text(500);
    put(&router, &system, ids[1]);
    // Keep r0, r2, r3: r1 (which holds the prefix) goes away.
    let kept = router.update_replicas(&["r0", "r2", "r3"]);
    assert_eq!(kept, vec![ids[0], ids[2], ids[3]]);
    assert_eq!(router.replica("r1"), None);
    assert_eq!(router.replicas(), kept);
    // Stale candidate lists still name r1.
    let cands = idle(&ids);
    for i in 0..200 {
        let prompt = if i % 2 == 0 {
            format!("{system}{i}")
        } else {
            rng.text(50)
        };
        let r = router.route(&prompt, &cands).unwrap();
        assert_ne!(r.replica, ids[1]);
    }
    // Only the removed replica left → a clear error.
    assert_eq!(
        router.route("hello", &idle(&ids[1..2])),
        Err(RouteError::NoLiveCandidates)
    );
    assert_eq!(router.route("hello", &[]), Err(RouteError::NoCandidates));
    // Re-adding the name gives a new id; the old one stays dead.
    let again = router.add_replica("r1");
    assert_ne!(again, ids[1]);
    assert_eq!(
        router.route("hello", &idle(&ids[1..2])),
        Err(RouteError::NoLiveCandidates)
    );
    router.tree().check_invariants().unwrap();
}

#[test]
fn route_racing_with_replica_removal() {
    for round in 0..5u64 {
        let (router, ids) = router_with(PrefixAffinityConfig::default(), 4);
        let mut rng = SplitMix64::new(100 + round);
        let system = rng.text(300);
        for &r in &ids {
            put(&router, &format!("{system}{r:?}"), r);
        }
        let victim = ids[round as usize % 4];
        let removed = AtomicBool::new(false);
        let barrier = Barrier::new(3);
        let cands = idle(&ids);
        std::thread::scope(|s| {
            for th in 0..2u64 {
                let (router, removed, barrier, cands, system) =
                    (&router, &removed, &barrier, &cands, &system);
                s.spawn(move || {
                    let mut rng = SplitMix64::new(th);
                    barrier.wait();
                    for i in 0..3000 {
                        let was_removed = removed.load(Ordering::Acquire);
                        let prompt = if i % 3 == 0 {
                            rng.text(40)
                        } else {
                            format!("{system}{}", rng.text(10))
                        };
                        let r = router.route(&prompt, cands).unwrap();
                        if was_removed {
                            assert_ne!(r.replica, victim, "route after removal chose it");
                        }
                    }
                });
            }
            barrier.wait();
            std::thread::sleep(Duration::from_millis(2));
            let keep: Vec<String> = ids
                .iter()
                .filter(|&&r| r != victim)
                .map(|&r| router.replica_name(r).unwrap().to_string())
                .collect();
            let keep: Vec<&str> = keep.iter().map(|s| s.as_str()).collect();
            router.update_replicas(&keep);
            removed.store(true, Ordering::Release);
        });
        assert!(!router.tree().is_live(victim.tenant()));
        router.tree().check_invariants().unwrap();
    }
}

#[test]
fn concurrent_routing_keeps_tree_invariants() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 8);
    let mut rng = SplitMix64::new(7);
    let systems: Vec<String> = (0..10).map(|_| rng.text(400)).collect();
    let threads = 4;
    let per = 1500;
    let reasons = std::sync::Mutex::new(BTreeMap::<String, usize>::new());
    std::thread::scope(|s| {
        for th in 0..threads {
            let (router, ids, systems, reasons) = (&router, &ids, &systems, &reasons);
            s.spawn(move || {
                let mut rng = SplitMix64::new(1000 + th as u64);
                let mut local = BTreeMap::<String, usize>::new();
                for i in 0..per {
                    let sys = &systems[rng.below(10) as usize];
                    let len = 20 + rng.below(200) as usize;
                    let prompt = format!("{sys}{}", rng.text(len));
                    let cands: Vec<Candidate> = ids
                        .iter()
                        .map(|&r| Candidate::new(r, rng.below(4) as usize))
                        .collect();
                    let r = router.route(&prompt, &cands).unwrap();
                    assert!(ids.contains(&r.replica));
                    // Routed prompts are stored for their replica.
                    let m = router
                        .tree()
                        .prefix_match(&prompt, Some(&[r.replica.tenant()]));
                    assert_eq!(m.matched_bytes, prompt.len(), "thread {th} request {i}");
                    *local.entry(format!("{:?}", r.reason)).or_default() += 1;
                }
                let mut g = reasons.lock().unwrap();
                for (k, v) in local {
                    *g.entry(k).or_default() += v;
                }
            });
        }
    });
    router.tree().check_invariants().unwrap();
    let reasons = reasons.into_inner().unwrap();
    assert_eq!(reasons.values().sum::<usize>(), threads * per);
    assert!(
        reasons.get("PrefixMatch").copied().unwrap_or(0) > threads * per / 2,
        "{reasons:?}"
    );
}

/// SGLang always runs its eviction (`--eviction-interval`, `--max-tree-size`): a router built
/// from the preset runs its tree's eviction thread, so the tree does not keep every distinct
/// prompt ever routed; Ray's default does not evict, as Ray's does not.
#[test]
fn sglang_preset_evicts_and_rays_does_not() {
    let (sglang, _) = router_with(PrefixAffinityConfig::sglang(), 2);
    assert!(sglang.is_evicting());
    let (ray, _) = router_with(PrefixAffinityConfig::ray(), 2);
    assert!(!ray.is_evicting());
}

#[test]
fn sglang_imbalance_rule() {
    let (router, ids) = router_with(PrefixAffinityConfig::sglang(), 2);
    let mut rng = SplitMix64::new(8);
    let holder = ids[0];
    let q = |a: usize, b: usize| loaded(&ids, &[a, b]);
    // (holder queue, other queue) → imbalanced?
    let cases = [
        ((100, 40), false),   // spread 60 ≤ 64
        ((105, 40), true),    // spread 65 > 64 and 105 > 60
        ((1000, 900), false), // spread 100, but 1000 ≤ 1.5 × 900
        ((200, 100), true),   // spread 100 and 200 > 150
        ((150, 100), false),  // spread 50
    ];
    for ((a, b), imbalanced) in cases {
        // A fresh prefix per case, held by the holder only.
        let system = rng.text(300);
        put(&router, &system, holder);
        let r = router
            .route(&format!("{system}{}", rng.text(20)), &q(a, b))
            .unwrap();
        if imbalanced {
            // The least-loaded replica, not power of two.
            assert_eq!(
                (r.replica, r.reason),
                (ids[1], RouteReason::Imbalanced),
                "{a} {b}"
            );
        } else {
            assert_eq!(
                (r.replica, r.reason),
                (holder, RouteReason::PrefixMatch),
                "{a} {b}"
            );
        }
    }
    assert_eq!(
        PrefixAffinityConfig::sglang().imbalanced_choice,
        LoadChoice::LeastLoaded
    );
}

#[test]
fn sglang_cache_miss_goes_to_least_loaded_not_smallest() {
    let mut rng = SplitMix64::new(9);
    let big = rng.text(5000);
    for (config, expect_big, reason) in [
        (
            PrefixAffinityConfig::sglang(),
            true,
            RouteReason::LeastLoaded,
        ),
        (
            PrefixAffinityConfig::default(),
            false,
            RouteReason::SmallestTenants,
        ),
    ] {
        let (router, ids) = router_with(config, 2);
        put(&router, &big, ids[0]); // ids[1] is empty (smallest) but busier
        let cands = loaded(&ids, &[0, 5]);
        let r = router.route("an unrelated prompt", &cands).unwrap();
        let want = if expect_big { ids[0] } else { ids[1] };
        assert_eq!((r.replica, r.reason), (want, reason));
    }
    // Threshold 0.3: a 20% match is a miss for SGLang, a hit for Ray.
    for (config, hit) in [
        (PrefixAffinityConfig::sglang(), false),
        (PrefixAffinityConfig::default(), true),
    ] {
        let (router, ids) = router_with(config, 2);
        put(&router, &"a".repeat(20), ids[0]);
        put(&router, &"b".repeat(100), ids[0]);
        let r = router
            .route(
                &format!("{}{}", "a".repeat(20), "c".repeat(80)),
                &loaded(&ids, &[0, 1]),
            )
            .unwrap();
        assert_eq!(r.reason == RouteReason::PrefixMatch, hit, "{r:?}");
    }
}

#[test]
fn dead_and_unknown_candidates_are_ignored() {
    let (router, ids) = router_with(PrefixAffinityConfig::default(), 2);
    let other = PrefixAffinityRouter::new(PrefixAffinityConfig::default());
    let foreign = other.update_replicas(&["x", "y", "z"]);
    // Foreign ids with higher slots are not live here.
    let mut cands = idle(&foreign[2..]);
    cands.push(Candidate::new(ids[1], 3));
    let r = router.route("hello", &cands).unwrap();
    assert_eq!(r.replica, ids[1]);
    assert_eq!(
        router.route("hello", &idle(&foreign[2..])),
        Err(RouteError::NoLiveCandidates)
    );
}

#[test]
fn eviction_preset_runs_the_background_thread() {
    let router = PrefixAffinityRouter::new(PrefixAffinityConfig::default().with_eviction());
    assert!(router.is_evicting());
    let plain = PrefixAffinityRouter::new(PrefixAffinityConfig::default());
    assert!(!plain.is_evicting());
}

// ---------------------------------------------------------------------------------------------
// KvAwareRouter
// ---------------------------------------------------------------------------------------------

const BS: usize = 4;

fn kv_router(config: KvAwareConfig) -> KvAwareRouter {
    KvAwareRouter::new(config)
}

/// Stores the first `blocks` full blocks of `tokens` on `worker` (engine hash = sequence hash).
fn store(router: &KvAwareRouter, worker: WorkerId, tokens: &[u32], blocks: usize) {
    let h = router.hasher();
    let local = h.local_hashes(tokens);
    let seq = h.sequence_hashes(tokens);
    let blocks = (0..blocks)
        .map(|i| StoredBlock {
            engine_hash: seq[i],
            local_hash: local[i],
        })
        .collect();
    router
        .index()
        .apply(
            worker,
            KvEvent::Stored {
                parent: None,
                blocks,
            },
        )
        .unwrap();
}

fn toks(seed: u64, n: usize) -> Vec<u32> {
    SplitMix64::new(seed).tokens(n)
}

const W: [WorkerId; 4] = [WorkerId(0), WorkerId(1), WorkerId(2), WorkerId(3)];

#[test]
fn overlap_decides_when_loads_are_equal() {
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(1, 40); // 10 blocks
    store(&router, W[2], &prompt, 6);
    store(&router, W[1], &prompt, 3);
    let s = router.select_and_reserve(1, &prompt, &W, 0).unwrap();
    assert_eq!((s.worker, s.overlap_blocks), (W[2], 6));
    assert_eq!(s.cost, 4.0);
    // Prefill books the 4 new prompt blocks; decode the whole prompt, active until done.
    assert_eq!((s.prefill_blocks, s.decode_blocks), (4, 10));
    // Without W2, the next best overlap wins (W1's load is still 0).
    let s = router
        .select_and_reserve(2, &prompt, &[W[0], W[1], W[3]], 0)
        .unwrap();
    assert_eq!((s.worker, s.overlap_blocks), (W[1], 3));
}

#[test]
fn load_decides_when_overlaps_are_equal() {
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(2, 32); // 8 blocks
    store(&router, W[0], &prompt, 4);
    store(&router, W[1], &prompt, 4);
    let pair = [W[0], W[1]];
    let a = router.select_and_reserve(1, &prompt, &pair, 16).unwrap();
    let b = router.select_and_reserve(2, &prompt, &pair, 16).unwrap();
    assert_ne!(
        a.worker, b.worker,
        "the second request sees the first one's booking"
    );
    assert_eq!(a.cost, b.cost);
    // A third goes to whichever is lighter after releasing b.
    router.request_complete(2);
    let c = router.select_and_reserve(3, &prompt, &pair, 16).unwrap();
    assert_eq!(c.worker, b.worker);
}

#[test]
fn booking_is_visible_to_the_next_selection() {
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(3, 20); // 5 blocks
    let one = [W[0]];
    let s1 = router.select_and_reserve(1, &prompt, &one, 8).unwrap();
    assert_eq!((s1.prefill_blocks, s1.decode_blocks), (5, 7));
    assert_eq!(s1.cost, 5.0);
    assert_eq!(
        router.load(W[0]),
        WorkerLoad {
            prefill_blocks: 5,
            decode_blocks: 7
        }
    );
    let s2 = router.select_and_reserve(2, &prompt, &one, 8).unwrap();
    // cost = 1.0 × 5 new prefill + 7 active blocks (the booked prefill is not counted twice).
    assert_eq!(s2.cost, 12.0);
    // Overlap weight scales only the prefill term.
    let heavy = kv_router(KvAwareConfig {
        overlap_weight: 2.0,
        ..KvAwareConfig::new(BS)
    });
    heavy.select_and_reserve(1, &prompt, &one, 8).unwrap();
    let s = heavy.select_and_reserve(2, &prompt, &one, 8).unwrap();
    assert_eq!(s.cost, 2.0 * 5.0 + 7.0);
}

#[test]
fn lifecycle_releases_exactly_the_booked_amounts() {
    let router = kv_router(KvAwareConfig::new(BS));
    let p1 = toks(4, 30); // 8 blocks (ceil), 7 full
    let p2 = toks(5, 16); // 4 blocks
    store(&router, W[0], &p1, 3);
    let s1 = router.select_and_reserve(10, &p1, &[W[0]], 10).unwrap();
    let s2 = router.select_and_reserve(20, &p2, &[W[0]], 0).unwrap();
    assert_eq!(
        (s1.overlap_blocks, s1.prefill_blocks, s1.decode_blocks),
        (3, 5, 8 + 3)
    );
    assert_eq!((s2.prefill_blocks, s2.decode_blocks), (4, 4));
    let total = |s: &[&Selection]| WorkerLoad {
        prefill_blocks: s.iter().map(|x| x.prefill_blocks as u64).sum(),
        decode_blocks: s.iter().map(|x| x.decode_blocks as u64).sum(),
    };
    assert_eq!(router.load(W[0]), total(&[&s1, &s2]));
    assert!(router.prefill_complete(10));
    assert!(
        !router.prefill_complete(10),
        "repeated prefill_complete is a no-op"
    );
    assert_eq!(
        router.load(W[0]),
        WorkerLoad {
            prefill_blocks: 4,
            decode_blocks: 11 + 4
        }
    );
    assert!(router.request_complete(10));
    assert_eq!(
        router.load(W[0]),
        WorkerLoad {
            prefill_blocks: 4,
            decode_blocks: 4
        }
    );
    // request_complete without prefill_complete releases both parts.
    assert!(router.request_complete(20));
    assert_eq!(router.load(W[0]), WorkerLoad::default());
    assert!(!router.request_complete(20));
    let st = router.stats();
    assert_eq!(
        (
            st.selections,
            st.prefills_completed,
            st.requests_completed,
            st.active_requests
        ),
        (2, 1, 2, 0)
    );
}

#[test]
fn unknown_ids_are_harmless() {
    let router = kv_router(KvAwareConfig::new(BS));
    let s = router
        .select_and_reserve(1, &toks(6, 8), &[W[1]], 4)
        .unwrap();
    let before = router.load(W[1]);
    assert!(!router.prefill_complete(999));
    assert!(!router.request_complete(999));
    assert!(!router.request_complete(u64::MAX));
    assert_eq!(router.load(W[1]), before);
    assert_eq!(before.decode_blocks, s.decode_blocks as u64);
    assert_eq!(router.stats().unknown_ids, 3);
    assert_eq!(router.stats().active_requests, 1);
}

#[test]
fn reselecting_a_booked_id_replaces_its_booking() {
    let router = kv_router(KvAwareConfig::new(BS));
    let p = toks(7, 16);
    router.select_and_reserve(1, &p, &[W[0]], 0).unwrap();
    router.select_and_reserve(1, &p, &[W[1]], 0).unwrap();
    assert_eq!(router.load(W[0]), WorkerLoad::default());
    assert_eq!(router.load(W[1]).decode_blocks, 4);
    assert_eq!(router.stats().replaced, 1);
    router.request_complete(1);
    assert!(router
        .loads()
        .iter()
        .all(|(_, l)| *l == WorkerLoad::default()));
}

#[test]
fn stale_reservations_expire() {
    // Explicit sweep with a chosen clock.
    let router = kv_router(KvAwareConfig {
        reservation_ttl: Duration::from_secs(60),
        ..KvAwareConfig::new(BS)
    });
    router
        .select_and_reserve(1, &toks(8, 16), &[W[0]], 0)
        .unwrap();
    router
        .select_and_reserve(2, &toks(9, 16), &[W[1]], 0)
        .unwrap();
    router.prefill_complete(2);
    let now = Instant::now();
    assert_eq!(router.expire_stale(now), 0);
    assert_eq!(router.expire_stale(now + Duration::from_secs(61)), 2);
    assert!(router
        .loads()
        .iter()
        .all(|(_, l)| *l == WorkerLoad::default()));
    assert_eq!(router.stats().expired, 2);
    assert!(!router.request_complete(1), "an expired booking is gone");

    // Lazy sweep by a later selection.
    let router = kv_router(KvAwareConfig {
        reservation_ttl: Duration::from_millis(5),
        ..KvAwareConfig::new(BS)
    });
    router
        .select_and_reserve(1, &toks(8, 16), &[W[0]], 0)
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    router
        .select_and_reserve(2, &toks(9, 16), &[W[1]], 0)
        .unwrap();
    let st = router.stats();
    assert_eq!((st.expired, st.active_requests), (1, 1));
    assert_eq!(router.load(W[0]), WorkerLoad::default());
    assert_eq!(router.load(W[1]).decode_blocks, 4);
}

#[test]
fn concurrent_selections_never_lose_a_booking() {
    let router = kv_router(KvAwareConfig::new(BS));
    let workers: Vec<WorkerId> = (0..8).map(WorkerId).collect();
    let mut rng = SplitMix64::new(10);
    let shared = rng.tokens(64);
    for (i, &w) in workers.iter().enumerate() {
        store(&router, w, &shared, 1 + i % 8);
    }
    let threads = 4u64;
    let per = 2000u64;
    type Outstanding = (u64, Selection, Vec<u32>, usize);
    let all: Vec<Vec<Outstanding>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|th| {
                let (router, workers, shared) = (&router, &workers, &shared);
                s.spawn(move || {
                    let mut rng = SplitMix64::new(th);
                    let mut out = Vec::new();
                    for i in 0..per {
                        let id = th * per + i;
                        let mut t = shared[..rng.below(64) as usize + 1].to_vec();
                        let extra = rng.below(40) as usize;
                        t.extend(rng.tokens(extra));
                        let output = rng.below(64) as usize;
                        let s = router.select_and_reserve(id, &t, workers, output).unwrap();
                        if i % 3 == 0 {
                            router.prefill_complete(id);
                            router.request_complete(id);
                        } else {
                            out.push((id, s, t, output));
                        }
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // What the outstanding requests hold: their prefill adds up; on decode, a full prompt
    // block that several of them share on a worker counts once there (so a selection's
    // `decode_blocks`, which counts only the blocks new on the worker, can leave a shared
    // block to a request that completed before the others), plus each one's partial last
    // block and expected output.
    let mut expect: BTreeMap<WorkerId, WorkerLoad> = BTreeMap::new();
    let mut held: BTreeMap<WorkerId, std::collections::BTreeSet<u64>> = BTreeMap::new();
    for (_, s, t, output) in all.iter().flatten() {
        let e = expect.entry(s.worker).or_default();
        e.prefill_blocks += s.prefill_blocks as u64;
        let full = router.hasher().sequence_hashes(t);
        assert_eq!(full.len(), t.len() / BS);
        held.entry(s.worker).or_default().extend(full);
        e.decode_blocks += (t.len().div_ceil(BS) - t.len() / BS + output.div_ceil(BS)) as u64;
    }
    for (w, blocks) in &held {
        expect.get_mut(w).unwrap().decode_blocks += blocks.len() as u64;
    }
    // Each selection counted at least its own share.
    for (w, e) in &expect {
        let reported: u64 = all
            .iter()
            .flatten()
            .filter(|o| o.1.worker == *w)
            .map(|o| o.1.decode_blocks as u64)
            .sum();
        assert!(reported <= e.decode_blocks, "worker {w:?}");
    }
    for (w, l) in router.loads() {
        assert_eq!(
            l,
            expect.get(&w).copied().unwrap_or_default(),
            "worker {w:?}"
        );
    }
    let st = router.stats();
    assert_eq!(st.selections, threads * per);
    assert_eq!(
        st.active_requests,
        all.iter().map(|v| v.len() as u64).sum::<u64>()
    );
    // Complete everything from several threads (prefill first for half of them).
    std::thread::scope(|s| {
        for part in &all {
            let router = &router;
            s.spawn(move || {
                for (k, (id, ..)) in part.iter().enumerate() {
                    if k % 2 == 0 {
                        assert!(router.prefill_complete(*id));
                    }
                    assert!(router.request_complete(*id));
                }
            });
        }
    });
    assert!(router
        .loads()
        .iter()
        .all(|(_, l)| *l == WorkerLoad::default()));
    assert_eq!(router.stats().active_requests, 0);
}

/// Active blocks count once per worker, as Dynamo's active sequences count them: requests
/// sharing a prefix on one worker hold its blocks once, so a worker running several
/// conversations on one cached prompt does not look loaded in proportion and keeps the next
/// one (three identical cached requests, weight 1.75: cost 0 + 4 on the holder against
/// 1.75 × 4 = 7 on a cold worker). Each request's own blocks beyond the shared ones, its
/// partial last block and its output count for it alone; releases take away exactly the
/// blocks no other booking still holds.
#[test]
fn shared_prompt_blocks_are_active_once_per_worker() {
    let cfg = KvAwareConfig {
        overlap_weight: 1.75,
        ..KvAwareConfig::new(BS)
    };
    let router = kv_router(cfg);
    let prompt = toks(21, 16); // 4 blocks
    store(&router, W[0], &prompt, 4);
    let ws = [W[0], W[1]];
    for id in 1..=3 {
        let s = router.select_and_reserve(id, &prompt, &ws, 0).unwrap();
        assert_eq!(s.worker, W[0], "request {id}");
        assert_eq!(s.cost, 4.0 * f64::from(id > 1), "request {id}");
        assert_eq!(s.decode_blocks, if id == 1 { 4 } else { 0 });
    }
    assert_eq!(router.load(W[0]).decode_blocks, 4);
    // A longer request on the same prefix: 2 more full blocks, a partial one, 2 output blocks.
    let mut longer = prompt.clone();
    longer.extend(toks(22, 9));
    let s = router.select_and_reserve(4, &longer, &[W[0]], 8).unwrap();
    assert_eq!(s.decode_blocks, 2 + 1 + 2);
    assert_eq!(router.load(W[0]).decode_blocks, 4 + 5);
    // The shared blocks stay active while any booking holds them.
    for (id, left) in [(1, 9), (4, 4), (2, 4), (3, 0)] {
        assert!(router.request_complete(id));
        assert_eq!(router.load(W[0]).decode_blocks, left, "after request {id}");
    }
    assert_eq!(router.load(W[0]), WorkerLoad::default());
    // Expiry and replacement release the same way.
    router.select_and_reserve(5, &prompt, &[W[1]], 0).unwrap();
    router.select_and_reserve(6, &prompt, &[W[1]], 0).unwrap();
    router.select_and_reserve(5, &longer, &[W[1]], 0).unwrap(); // replaces request 5
    assert_eq!(router.load(W[1]).decode_blocks, 4 + 3);
    assert_eq!(
        router.expire_stale(Instant::now() + Duration::from_secs(3600)),
        2
    );
    assert_eq!(router.load(W[1]), WorkerLoad::default());
}

#[test]
fn concurrent_selections_do_not_herd() {
    // Equal requests, no overlap, nothing completes: every booking goes to a worker whose load
    // is minimal at the moment of booking, so loads never differ by more than one request.
    // The prompt's 10 blocks count once per worker (active there while any booking holds
    // them), each booking's 6 output blocks once each.
    let router = kv_router(KvAwareConfig::new(BS));
    let workers: Vec<WorkerId> = (0..8).map(WorkerId).collect();
    let prompt = toks(11, 40);
    std::thread::scope(|s| {
        for th in 0..4u64 {
            let (router, workers, prompt) = (&router, &workers, &prompt);
            s.spawn(move || {
                for i in 0..500 {
                    router
                        .select_and_reserve(th * 1000 + i, prompt, workers, 24)
                        .unwrap();
                }
            });
        }
    });
    let loads: Vec<u64> = router
        .loads()
        .iter()
        .map(|(_, l)| l.decode_blocks)
        .collect();
    let per_request = 10 + 6;
    let (min, max) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
    assert!(max - min <= per_request, "{loads:?}");
    assert!(
        loads.iter().all(|&l| l >= 10 + 6),
        "every worker got bookings: {loads:?}"
    );
    assert_eq!(loads.iter().sum::<u64>(), 8 * 10 + 2000 * 6);
    for l in &loads {
        assert_eq!((l - 10) % 6, 0, "{loads:?}");
    }
}

#[test]
fn temperature_sampling_is_seeded_and_favors_low_cost() {
    let run = |seed: u64| {
        let router = kv_router(KvAwareConfig {
            temperature: 2.0,
            seed,
            ..KvAwareConfig::new(BS)
        });
        let prompt = toks(12, 40); // 10 blocks
        store(&router, W[0], &prompt, 8); // cost 2
        store(&router, W[1], &prompt, 6); // cost 4
                                          // W2, W3: cost 10
        let mut picks = Vec::new();
        for id in 0..2000 {
            let s = router.select_and_reserve(id, &prompt, &W, 0).unwrap();
            router.request_complete(id);
            picks.push(s.worker.0 as usize);
        }
        picks
    };
    let a = run(42);
    assert_eq!(a, run(42), "same seed, same choices");
    assert_ne!(a, run(43));
    let mut counts = [0usize; 4];
    for &p in &a {
        counts[p] += 1;
    }
    // Dynamo's weights: exp(−(cost − 2) / ((10 − 2) × 2)) = 1, e^-1/8, e^-1/2, e^-1/2
    // → 32.3 %, 28.5 %, 19.6 %, 19.6 % (bounds: about 5 standard deviations of 2,000 draws).
    assert!(
        counts[0] > counts[1] && counts[1] > counts[2].max(counts[3]),
        "{counts:?}"
    );
    assert!(counts[0] > 540 && counts[0] < 760, "{counts:?}");
    assert!(counts[1] > 460 && counts[1] < 680, "{counts:?}");
    assert!(
        counts[2] + counts[3] > 650 && counts[2] + counts[3] < 920,
        "{counts:?}"
    );
}

/// Draws `n` selections of `prompt` over `workers` (each completed at once, so loads stay 0)
/// and counts the picks per worker index.
fn picks(router: &KvAwareRouter, prompt: &[u32], workers: &[WorkerId], n: u64) -> Vec<usize> {
    let mut counts = vec![0usize; workers.len()];
    for id in 0..n {
        let s = router.select_and_reserve(id, prompt, workers, 0).unwrap();
        assert!(router.request_complete(id));
        counts[workers.iter().position(|&w| w == s.worker).unwrap()] += 1;
    }
    counts
}

#[test]
fn temperature_is_on_dynamos_scale() {
    // Dynamo divides the costs by their spread before the temperature: at T = 1 the uncached
    // worker weighs 1/e of the cached one, however many blocks the prompt has.
    for blocks in [4usize, 100] {
        let router = kv_router(KvAwareConfig {
            temperature: 1.0,
            seed: 7,
            ..KvAwareConfig::new(BS)
        });
        let prompt = toks(3, blocks * BS);
        store(&router, W[1], &prompt, blocks);
        let counts = picks(&router, &prompt, &W[..2], 2000);
        // p(W0) = 1 / (1 + e) = 26.9 %: 538 of 2,000, about 20 either way.
        assert!(
            counts[0] > 440 && counts[0] < 640,
            "{blocks} blocks: {counts:?}"
        );
    }
    // Equal costs are drawn uniformly.
    let router = kv_router(KvAwareConfig {
        temperature: 0.5,
        seed: 11,
        ..KvAwareConfig::new(BS)
    });
    let counts = picks(&router, &toks(4, 40), &W, 2000);
    assert!(counts.iter().all(|&c| c > 400 && c < 600), "{counts:?}");
    // A small temperature all but decides: at 0.05 the dearest weighs e^-20 of the cheapest.
    let router = kv_router(KvAwareConfig {
        temperature: 0.05,
        seed: 5,
        ..KvAwareConfig::new(BS)
    });
    let prompt = toks(6, 40);
    store(&router, W[3], &prompt, 10);
    assert_eq!(picks(&router, &prompt, &W, 500), vec![0, 0, 0, 500]);
    // And the smallest positive temperatures decide outright. With a spread of costs under 1
    // (0.1 here), the spread times the temperature underflowed to 0, which made the cheapest
    // weight 0 / 0 and picked the first worker.
    for temperature in [5e-324, 1e-320, 1e-300] {
        let router = kv_router(KvAwareConfig {
            temperature,
            overlap_weight: 0.01,
            seed: 5,
            ..KvAwareConfig::new(BS)
        });
        store(&router, W[3], &prompt, 10);
        assert_eq!(
            picks(&router, &prompt, &W, 100),
            vec![0, 0, 0, 100],
            "T = {temperature:e}"
        );
    }
}

/// The softmax weighs each cost's distance above the minimum, scaled by the spread `max − min`,
/// not the costs' size: the same load on every worker shifts all costs alike and changes
/// nothing. Both workers carry 1,001 active blocks (costs 1,011 and 1,001, spread 10): at
/// T = 0.05 the dearest weighs e^-20 of the cheapest, so the cached worker takes every draw.
/// (Scaled by `max + min` = 2,012 instead, the uncached worker would weigh e^-0.1 and take
/// about half; weighing `c + min` instead of `c − min`, every weight would underflow to 0 and
/// the first worker would take them all.)
#[test]
fn temperature_scales_by_the_spread_of_costs_not_their_size() {
    let router = kv_router(KvAwareConfig {
        temperature: 0.05,
        seed: 3,
        ..KvAwareConfig::new(BS)
    });
    let prompt = toks(32, 40); // 10 blocks
    store(&router, W[1], &prompt, 10);
    for (id, w) in [(1000, W[0]), (1001, W[1])] {
        // One partial prompt block and 1,000 output blocks, held until the end of the test.
        let s = router.select_and_reserve(id, &[7], &[w], 4000).unwrap();
        assert_eq!(s.decode_blocks, 1001);
    }
    let s = router.select_and_reserve(999, &prompt, &W[..2], 0).unwrap();
    assert_eq!((s.worker, s.cost), (W[1], 1001.0));
    assert!(router.request_complete(999));
    assert_eq!(picks(&router, &prompt, &W[..2], 200), vec![0, 200]);
}

#[test]
fn ties_rotate_at_temperature_zero() {
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(13, 8);
    let mut seen = std::collections::BTreeSet::new();
    for id in 0..8 {
        let s = router.select_and_reserve(id, &prompt, &W, 0).unwrap();
        router.request_complete(id);
        seen.insert(s.worker);
    }
    assert_eq!(seen.len(), 4);
}

#[test]
fn errors_and_short_requests() {
    let router = kv_router(KvAwareConfig::new(BS));
    assert_eq!(
        router.select_and_reserve(1, &[], &W, 10),
        Err(SelectError::EmptyTokens)
    );
    assert_eq!(
        router.select_and_reserve(1, &[1, 2], &[], 10),
        Err(SelectError::NoWorkers)
    );
    assert_eq!(router.stats().selections, 0);
    // Shorter than one block: no overlap anywhere, one block of work, routed by load.
    let short = [1u32, 2, 3];
    store(&router, W[0], &toks(14, 8), 2);
    let s = router.select_and_reserve(1, &short, &W, 1).unwrap();
    assert_eq!(
        (s.overlap_blocks, s.prefill_blocks, s.decode_blocks),
        (0, 1, 2)
    );
    let s2 = router.select_and_reserve(2, &short, &W, 1).unwrap();
    assert_ne!(s2.worker, s.worker);
}

#[test]
fn salted_router_matches_a_salted_index() {
    let config = KvAwareConfig {
        salt: Some(("lora-a".into(), "ns".into())),
        ..KvAwareConfig::new(BS)
    };
    let index = Arc::new(BlockIndex::with_hasher(&config.hasher()));
    let router = KvAwareRouter::with_index(index, config);
    let prompt = toks(15, 16);
    store(&router, W[3], &prompt, 4);
    let s = router.select_and_reserve(1, &prompt, &W, 0).unwrap();
    assert_eq!((s.worker, s.overlap_blocks), (W[3], 4));
    // Unsalted hashes do not match the salted blocks.
    let plain = kvtrie::BlockHasher::new(BS).local_hashes(&prompt);
    assert_eq!(router.index().find_matches(&plain).max(), 0);
}

#[test]
#[should_panic(expected = "router's hasher")]
fn index_with_another_seed_is_rejected() {
    let config = KvAwareConfig {
        salt: Some(("lora-a".into(), String::new())),
        ..KvAwareConfig::new(BS)
    };
    let _ = KvAwareRouter::with_index(Arc::new(BlockIndex::new()), config);
}

#[test]
fn remove_worker_drops_its_bookings() {
    let router = kv_router(KvAwareConfig::new(BS));
    router
        .select_and_reserve(1, &toks(16, 16), &[W[0]], 0)
        .unwrap();
    router
        .select_and_reserve(2, &toks(17, 16), &[W[1]], 0)
        .unwrap();
    assert_eq!(router.remove_worker(W[0]), 1);
    assert!(!router.request_complete(1));
    assert_eq!(router.load(W[0]), WorkerLoad::default());
    assert!(router.request_complete(2));
    // Every booking is accounted for: made = completed + expired + replaced + removed + held.
    let s = router.stats();
    assert_eq!((s.selections, s.requests_completed, s.removed), (2, 1, 1));
    assert_eq!(s.active_requests, 0);
}

/// An engine's data-parallel ranks leave together: `remove_engine` drops every rank's
/// bookings in the router and every rank's blocks in the index, and nothing of another
/// engine.
#[test]
fn remove_engine_drops_every_rank() {
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(31, 16);
    let (a0, a1, b0) = (
        WorkerId::new(5, 0),
        WorkerId::new(5, 1),
        WorkerId::new(6, 0),
    );
    for (i, w) in [a0, a1, b0].into_iter().enumerate() {
        store(&router, w, &prompt, 4);
        router
            .select_and_reserve(i as u64, &prompt, &[w], 4)
            .unwrap();
    }
    assert_eq!(router.remove_engine(5), 2);
    assert_eq!(router.index().remove_engine(5), 8);
    assert_eq!(router.index().workers(), vec![b0]);
    assert_eq!(router.loads().len(), 1);
    assert!(!router.request_complete(0) && !router.request_complete(1));
    assert!(router.request_complete(2));
    assert_eq!(
        (router.remove_engine(5), router.index().remove_engine(5)),
        (0, 0)
    );
}

/// A `LoadBook` choice function may call into its book: it runs without the book's locks. It
/// reads a load, makes a nested booking (which moves worker 0's load, so the outer choice is
/// redone) and waits for a `remove_worker` of another thread, which on a book holding its
/// worker map's read lock through the choice would wait for ever (the choice would then panic
/// on its timeout). The redone choice sees the removed worker full, and the booking does not
/// bring it back.
/// `LoadBook::maybe_expire` on a clock the test sets: the first call only starts the clock
/// (even with a stale booking), a call before a quarter TTL has passed since the last sweep
/// does nothing, and the call exactly a quarter TTL later sweeps; its clock then restarts.
#[test]
fn load_book_lazy_sweeps_run_every_quarter_ttl() {
    use kvtrie::router::{Choice, LoadBook};
    let book = LoadBook::new(Duration::from_secs(40));
    assert_eq!(book.reservation_ttl(), Duration::from_secs(40));
    let t0 = Instant::now();
    let one = |_: &[WorkerLoad]| Choice {
        index: 0,
        prefill_blocks: 1,
        decode_blocks: 2,
    };
    let (s, ns) = (Duration::from_secs(1), Duration::from_nanos(1));
    book.book(1, &[W[0]], t0, one).unwrap();
    // Request 1 is stale from t0 + 40 s on; the first call only starts the clock.
    assert_eq!(book.maybe_expire(t0 + 100 * s), 0);
    assert_eq!(book.stats().active_requests, 1);
    // The next sweep is due a quarter TTL (10 s) later, not a nanosecond before.
    assert_eq!(book.maybe_expire(t0 + 110 * s - ns), 0);
    assert_eq!(book.stats().active_requests, 1);
    assert_eq!(book.maybe_expire(t0 + 110 * s), 1);
    assert_eq!((book.stats().expired, book.stats().active_requests), (1, 0));
    assert_eq!(book.load(W[0]), WorkerLoad::default());
    // Request 2 is stale from t0 + 150 s on (a booking exactly one TTL old expires): the
    // sweep due at 120 s finds nothing, the one due at 130 s is late, at 150 s less a
    // nanosecond, and still finds nothing; the explicit sweep at 150 s releases it.
    book.book(2, &[W[0]], t0 + 110 * s, one).unwrap();
    assert_eq!(book.maybe_expire(t0 + 120 * s - ns), 0);
    assert_eq!(book.maybe_expire(t0 + 120 * s), 0);
    assert_eq!(book.maybe_expire(t0 + 130 * s - ns), 0);
    assert_eq!(book.maybe_expire(t0 + 150 * s - ns), 0);
    assert_eq!(book.stats().active_requests, 1);
    assert_eq!(book.expire_stale(t0 + 150 * s), 1);
    assert_eq!(book.stats().expired, 2);
    assert_eq!(book.load(W[0]), WorkerLoad::default());
}

#[test]
fn a_load_book_choice_may_call_into_the_book() {
    use kvtrie::router::{Choice, LoadBook};
    use std::sync::mpsc;
    let book = Arc::new(LoadBook::new(Duration::from_secs(60)));
    let now = Instant::now();
    let ws = [W[0], W[1]];
    let only = |i: usize, d: u64| {
        move |_: &[WorkerLoad]| Choice {
            index: i,
            prefill_blocks: 1,
            decode_blocks: d,
        }
    };
    book.book(10, &ws[1..], now, only(0, 7)).unwrap();
    let mut calls = 0;
    let b = book
        .book(1, &ws, now, |loads: &[WorkerLoad]| {
            calls += 1;
            if calls == 1 {
                assert_eq!(book.load(W[1]), loads[1], "the load the choice was given");
                // Moves worker 0's word after the outer read: the outer choice is redone.
                book.book(2, &ws[..1], now, only(0, 3)).unwrap();
                let (tx, rx) = mpsc::channel();
                let remover = {
                    let book = book.clone();
                    std::thread::spawn(move || tx.send(book.remove_worker(W[1])).unwrap())
                };
                let dropped = rx
                    .recv_timeout(Duration::from_secs(30))
                    .expect("remove_worker finished while the choice ran");
                assert_eq!(dropped, 1, "request 10's booking on worker 1");
                remover.join().unwrap();
            } else {
                // Removed during this call: shown full, not registered again.
                let full = (1 << 32) - 1;
                assert_eq!(
                    (loads[1].prefill_blocks, loads[1].decode_blocks),
                    (full, full)
                );
            }
            Choice {
                index: 0,
                prefill_blocks: 1,
                decode_blocks: 5,
            }
        })
        .unwrap();
    assert_eq!(calls, 2, "the first choice was made from a stale word");
    assert_eq!((b.worker, b.decode_blocks), (W[0], 5));
    let load = |p, d| WorkerLoad {
        prefill_blocks: p,
        decode_blocks: d,
    };
    assert_eq!(book.loads(), vec![(W[0], load(2, 8))]);
    let s = book.stats();
    assert_eq!(
        (s.selections, s.retries, s.active_requests),
        (3, 1, 2),
        "{s:?}"
    );
    assert!(!book.request_complete(10), "dropped with worker 1");
    assert!(book.request_complete(1) && book.request_complete(2));
    assert_eq!(book.load(W[0]), WorkerLoad::default());
}

/// `LoadBook::book_sequence` shows the choice how many of the request's blocks each worker
/// does not hold yet, and books exactly those (the leading run it shares counts once).
#[test]
fn book_sequence_shows_each_workers_new_blocks() {
    use kvtrie::router::{Choice, LoadBook};
    let book = LoadBook::new(Duration::from_secs(60));
    let now = Instant::now();
    let ws = [W[0], W[1]];
    let on = |i: usize| {
        move |_: &[WorkerLoad], _: &[u64]| Choice {
            index: i,
            prefill_blocks: 0,
            decode_blocks: 0,
        }
    };
    book.book_sequence(1, &ws, now, &[1, 2, 3], on(0)).unwrap();
    book.book_sequence(2, &ws, now, &[1, 2], on(1)).unwrap();
    let mut seen = Vec::new();
    let b = book
        .book_sequence(3, &ws, now, &[1, 2, 3, 4], |l: &[WorkerLoad], n: &[u64]| {
            seen = n.to_vec();
            assert_eq!((l[0].decode_blocks, l[1].decode_blocks), (3, 2));
            Choice {
                index: 1,
                prefill_blocks: 0,
                decode_blocks: 0,
            }
        })
        .unwrap();
    assert_eq!(seen, vec![1, 2]);
    assert_eq!((b.worker, b.decode_blocks), (W[1], 2));
    assert_eq!(book.load(W[1]).decode_blocks, 4);
    for id in 1..=3 {
        assert!(book.request_complete(id));
    }
    assert_eq!(
        book.loads(),
        vec![(W[0], WorkerLoad::default()), (W[1], WorkerLoad::default())]
    );
}

/// A booking whose every allowed worker is removed while it chooses books nothing (and does
/// not register the worker again); a later booking listing the worker registers it afresh.
#[test]
fn a_booking_on_a_worker_removed_while_choosing_books_nothing() {
    use kvtrie::router::{Choice, LoadBook};
    let book = Arc::new(LoadBook::new(Duration::from_secs(60)));
    let now = Instant::now();
    let pick = |_: &[WorkerLoad]| Choice {
        index: 0,
        prefill_blocks: 1,
        decode_blocks: 1,
    };
    book.book(1, &[W[0]], now, pick).unwrap();
    let mut calls = 0;
    let b = book.book(2, &[W[0]], now, |l: &[WorkerLoad]| {
        calls += 1;
        if calls == 1 {
            assert_eq!(book.remove_worker(W[0]), 1);
        }
        pick(l)
    });
    assert_eq!((b, calls), (None, 1));
    assert_eq!(book.loads(), vec![]);
    assert!(!book.request_complete(2));
    assert!(book.book(3, &[W[0]], now, pick).is_some());
    assert_eq!(book.loads().len(), 1);
}

/// A choice that keeps picking a worker removed while it chose, with another allowed worker
/// still present, is given up after one more such pick than there are workers (here 3 picks
/// of 2 workers), not retried for ever and not cut short. The removed worker is shown full.
#[test]
fn repeated_picks_of_a_removed_worker_give_up_after_one_per_worker_and_one_more() {
    use kvtrie::router::{Choice, LoadBook};
    let book = LoadBook::new(Duration::from_secs(60));
    let now = Instant::now();
    let ws = [W[0], W[1]];
    let mut seen = Vec::new();
    let b = book.book(1, &ws, now, |loads: &[WorkerLoad]| {
        seen.push(loads.to_vec());
        assert!(
            seen.len() <= 10,
            "still choosing after {} picks",
            seen.len()
        );
        if seen.len() == 1 {
            assert_eq!(book.remove_worker(W[0]), 0);
        }
        Choice {
            index: 0,
            prefill_blocks: 1,
            decode_blocks: 1,
        }
    });
    assert_eq!(b, None);
    assert_eq!(seen.len(), 3);
    let full = WorkerLoad {
        prefill_blocks: u64::from(u32::MAX),
        decode_blocks: u64::from(u32::MAX),
    };
    assert_eq!(seen[0], vec![WorkerLoad::default(); 2]);
    assert_eq!(seen[1], vec![full, WorkerLoad::default()]);
    assert_eq!(seen[2], seen[1]);
    assert_eq!(book.stats().selections, 0);
    assert_eq!(book.loads(), vec![(W[1], WorkerLoad::default())]);
}

// ---------------------------------------------------------------------------------------------
// Caller numbers never overflow; bad configurations are errors
// ---------------------------------------------------------------------------------------------

#[test]
fn huge_expected_output_saturates_instead_of_overflowing() {
    let router = KvAwareRouter::new(KvAwareConfig::new(1));
    let s = router
        .select_and_reserve(1, &[1, 2, 3], &[WorkerId(1)], usize::MAX)
        .unwrap();
    let cap = (1u64 << 32) - 1;
    assert_eq!(s.worker, WorkerId(1));
    assert_eq!((s.prefill_blocks, s.decode_blocks), (3, cap as usize));
    assert_eq!(router.load(WorkerId(1)).decode_blocks, cap);
    // The worker's decode half is full: a second booking adds its two prompt blocks (active
    // blocks count exactly) but no output, and the word saturates instead of wrapping.
    let s2 = router
        .select_and_reserve(2, &[4, 5], &[WorkerId(1)], usize::MAX)
        .unwrap();
    assert_eq!(s2.decode_blocks, 2);
    assert_eq!(router.load(WorkerId(1)).prefill_blocks, 5);
    assert_eq!(router.load(WorkerId(1)).decode_blocks, cap);
    // Releases are exact.
    assert!(router.request_complete(1));
    assert!(router.request_complete(2));
    assert_eq!(router.load(WorkerId(1)), Default::default());
    // A huge prompt: prefill and decode clamp, the cost stays finite.
    let big = vec![7u32; 1 << 20];
    let s3 = router
        .select_and_reserve(3, &big, &[WorkerId(1), WorkerId(2)], usize::MAX)
        .unwrap();
    assert!(s3.cost.is_finite());
}

#[test]
fn huge_reservation_ttl_does_not_overflow() {
    let config = KvAwareConfig {
        reservation_ttl: Duration::MAX,
        ..KvAwareConfig::new(4)
    };
    let router = KvAwareRouter::new(config);
    for id in 0..3 {
        router
            .select_and_reserve(id, &[1, 2, 3, 4, 5], &[WorkerId(0)], 4)
            .unwrap();
    }
    let far = Instant::now() + Duration::from_secs(1 << 40);
    assert_eq!(
        router.expire_stale(far),
        0,
        "a reservation of Duration::MAX never expires"
    );
    assert_eq!(router.stats().active_requests, 3);
}

#[test]
fn invalid_kv_aware_configs_are_errors() {
    use kvtrie::blocks::{BlockHasher, HasherError};
    use kvtrie::router::ConfigError;
    assert_eq!(BlockHasher::try_new(0), Err(HasherError::ZeroBlockSize));
    assert!(BlockHasher::try_with_seed(0, 7).is_err());
    assert!(matches!(
        KvAwareConfig::try_new(0),
        Err(ConfigError::Hasher(HasherError::ZeroBlockSize))
    ));
    let base = KvAwareConfig::new(BS);
    let bad = [
        (
            KvAwareConfig {
                block_size: 0,
                ..base.clone()
            },
            "block size",
        ),
        (
            KvAwareConfig {
                overlap_weight: f64::NAN,
                ..base.clone()
            },
            "overlap_weight",
        ),
        (
            KvAwareConfig {
                overlap_weight: -1.0,
                ..base.clone()
            },
            "overlap_weight",
        ),
        (
            KvAwareConfig {
                temperature: f64::INFINITY,
                ..base.clone()
            },
            "temperature",
        ),
        (
            KvAwareConfig {
                temperature: -0.5,
                ..base.clone()
            },
            "temperature",
        ),
        (
            KvAwareConfig {
                reservation_ttl: Duration::ZERO,
                ..base.clone()
            },
            "reservation_ttl",
        ),
    ];
    for (config, field) in bad {
        let err = KvAwareRouter::try_new(config.clone()).expect_err(field);
        assert!(err.to_string().contains(field), "{err}");
        assert!(config.validate().is_err());
        let index = Arc::new(BlockIndex::new());
        assert!(KvAwareRouter::try_with_index(index, config.clone()).is_err());
        // The panicking constructor panics with the same message.
        let p = std::panic::catch_unwind(|| KvAwareRouter::new(config)).expect_err(field);
        let msg = p.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains(field), "{msg}");
    }
    // An index built with another seed.
    let salted = KvAwareConfig {
        salt: Some(("lora-a".into(), String::new())),
        ..base.clone()
    };
    let index = Arc::new(BlockIndex::with_hasher(&base.hasher()));
    assert!(matches!(
        KvAwareRouter::try_with_index(index, salted),
        Err(ConfigError::SeedMismatch { .. })
    ));
    // An index that hashes blocks of another size: its blocks never match the router's.
    let index = Arc::new(BlockIndex::with_hasher(&BlockHasher::new(
        base.block_size * 4,
    )));
    assert!(matches!(
        KvAwareRouter::try_with_index(index, base.clone()),
        Err(ConfigError::BlockSizeMismatch {
            index: 16,
            config: 4
        })
    ));
    assert!(KvAwareRouter::try_new(base).is_ok());
}

/// The overlap weight's bound is inclusive: `MAX_OVERLAP_WEIGHT` itself is valid and prices
/// an uncached block at exactly that much (a finite cost), anything above it is an error.
#[test]
fn the_largest_overlap_weight_is_valid_and_the_next_is_not() {
    use kvtrie::router::{ConfigError, MAX_OVERLAP_WEIGHT};
    let max = KvAwareConfig {
        overlap_weight: MAX_OVERLAP_WEIGHT,
        ..KvAwareConfig::new(BS)
    };
    assert_eq!(max.validate(), Ok(()));
    let router = KvAwareRouter::try_new(max.clone()).unwrap();
    // The router keeps the configuration it was given.
    assert_eq!(router.config(), &max);
    let s = router
        .select_and_reserve(1, &toks(31, 8), &[W[0]], 0)
        .unwrap();
    assert_eq!(s.cost, 2.0 * MAX_OVERLAP_WEIGHT);
    for over in [
        MAX_OVERLAP_WEIGHT.next_up(),
        2.0 * MAX_OVERLAP_WEIGHT,
        1e300,
    ] {
        let config = KvAwareConfig {
            overlap_weight: over,
            ..KvAwareConfig::new(BS)
        };
        assert!(
            matches!(
                config.validate(),
                Err(ConfigError::InvalidValue {
                    field: "overlap_weight",
                    ..
                })
            ),
            "{over:e}"
        );
        assert!(KvAwareRouter::try_new(config).is_err(), "{over:e}");
    }
}

#[test]
#[should_panic(expected = "block size must be positive")]
fn zero_block_size_config_panics_as_documented() {
    let _ = KvAwareConfig::new(0);
}

#[test]
#[should_panic(expected = "block size must be positive")]
fn zero_block_size_hasher_panics_as_documented() {
    let _ = kvtrie::BlockHasher::new(0);
}

// ---------------------------------------------------------------------------------------------
// issue 13: tiers, data-parallel ranks, cache partitions
// ---------------------------------------------------------------------------------------------

/// [`store`] in a storage tier.
fn store_in(
    router: &KvAwareRouter,
    worker: WorkerId,
    tier: kvtrie::blocks::Tier,
    tokens: &[u32],
    n: usize,
) {
    let h = router.hasher();
    let local = h.local_hashes(tokens);
    let seq = h.sequence_hashes(tokens);
    let blocks = (0..n)
        .map(|i| StoredBlock {
            engine_hash: seq[i],
            local_hash: local[i],
        })
        .collect();
    router
        .index()
        .apply_in(
            worker,
            tier,
            KvEvent::Stored {
                parent: None,
                blocks,
            },
        )
        .unwrap();
}

#[test]
fn tier_weighted_selection_prefers_the_gpu_holder() {
    use kvtrie::blocks::{Tier, TierWeights};
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(30, 40); // 10 blocks
                               // Equal load, equal overlap (8 blocks), but W1 holds them in host memory only.
    store_in(&router, W[1], Tier::Cpu, &prompt, 8);
    store_in(&router, W[2], Tier::Gpu, &prompt, 8);
    let s = router
        .select_and_reserve(1, &prompt, &[W[1], W[2]], 0)
        .unwrap();
    assert_eq!(
        (s.worker, s.overlap_blocks, s.weighted_overlap),
        (W[2], 8, 8.0)
    );
    assert_eq!((s.cost, s.prefill_blocks), (2.0, 2));
    router.request_complete(1);
    // Against the CPU holder alone: 8 × 0.8 = 6.4 blocks cached, 3.6 to prefill (4 booked).
    let s = router.select_and_reserve(2, &prompt, &[W[1]], 0).unwrap();
    assert_eq!(s.overlap_blocks, 8);
    assert!((s.weighted_overlap - 6.4).abs() < 1e-9, "{s:?}");
    assert!((s.cost - 3.6).abs() < 1e-9, "{s:?}");
    assert_eq!(s.prefill_blocks, 4);
    router.request_complete(2);
    // A longer CPU run can beat a short GPU one: W1 holds 10 on the CPU (8.0), W3 6 on the GPU.
    store_in(&router, W[1], Tier::Cpu, &prompt, 10);
    store_in(&router, W[3], Tier::Gpu, &prompt, 6);
    let s = router
        .select_and_reserve(3, &prompt, &[W[1], W[3]], 0)
        .unwrap();
    assert_eq!(s.worker, W[1]);
    router.request_complete(3);
    // With uniform weights the tiers do not matter: a tie, broken by rotation.
    let uniform = KvAwareConfig {
        tier_weights: TierWeights::UNIFORM,
        ..KvAwareConfig::new(BS)
    };
    let r2 = KvAwareRouter::with_index(router.index().clone(), uniform);
    let s = r2.select_and_reserve(4, &prompt, &[W[1], W[2]], 0).unwrap();
    assert_eq!(s.weighted_overlap, s.overlap_blocks as f64);
    // Invalid weights are a config error: negative, or above a GPU copy's worth.
    for disk in [-1.0, 1.5, f64::INFINITY] {
        let bad = KvAwareConfig {
            tier_weights: TierWeights {
                disk,
                ..TierWeights::default()
            },
            ..KvAwareConfig::new(BS)
        };
        assert!(KvAwareRouter::try_new(bad).is_err(), "{disk}");
    }
}

#[test]
fn data_parallel_ranks_are_selected_individually() {
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(31, 32); // 8 blocks
                               // Engine 5 has 4 DP ranks; rank 2 holds the prompt, rank 1 half of it.
    let ranks: Vec<WorkerId> = WorkerId::ranks(5, 4).collect();
    store(&router, WorkerId::new(5, 2), &prompt, 8);
    store(&router, WorkerId::new(5, 1), &prompt, 4);
    // Booked on the chosen rank alone.
    let s = router.select_and_reserve(1, &prompt, &ranks, 0).unwrap();
    assert_eq!((s.engine(), s.dp_rank(), s.overlap_blocks), (5, 2, 8));
    assert_eq!(router.load(WorkerId::new(5, 2)).decode_blocks, 8);
    assert_eq!(router.load(WorkerId::new(5, 0)).decode_blocks, 0);
    // Ranks of different engines never alias: engine 6 rank 0 is not engine 5 rank 0.
    assert_ne!(WorkerId::new(6, 0), WorkerId::new(5, 0));
    // The one-worker-per-engine mapping still works: engine-level ids are plain ids.
    store(&router, WorkerId(9), &prompt, 8);
    let s = router
        .select_and_reserve(2, &prompt, &[WorkerId(9), WorkerId::new(5, 3)], 0)
        .unwrap();
    assert_eq!((s.worker, s.dp_rank()), (WorkerId(9), 0));
}

#[test]
fn a_salted_request_matches_only_its_partition() {
    use kvtrie::blocks::CacheKeys;
    let router = kv_router(KvAwareConfig::new(BS));
    let prompt = toks(32, 40);
    let a = CacheKeys {
        cache_salt: Some("tenant-a"),
        ..CacheKeys::default()
    };
    let b = CacheKeys {
        cache_salt: Some("tenant-b"),
        ..CacheKeys::default()
    };
    let h = router.hasher();
    let local = h.local_hashes_with(&prompt, &a);
    let blocks = local
        .iter()
        .enumerate()
        .map(|(i, &l)| StoredBlock {
            engine_hash: i as u64 + 1,
            local_hash: l,
        })
        .collect();
    router
        .index()
        .apply(
            W[1],
            KvEvent::Stored {
                parent: None,
                blocks,
            },
        )
        .unwrap();
    let s = router
        .select_and_reserve_with(1, &prompt, &a, &W, 0)
        .unwrap();
    assert_eq!((s.worker, s.overlap_blocks), (W[1], 10));
    for (id, keys) in [(2, b), (3, CacheKeys::default())] {
        let s = router
            .select_and_reserve_with(id, &prompt, &keys, &W, 0)
            .unwrap();
        assert_eq!(s.overlap_blocks, 0, "{keys:?}");
    }
}

#[test]
fn nan_prefix_affinity_configs_are_errors() {
    use kvtrie::router::ConfigError;
    let base = PrefixAffinityConfig::default();
    for (cfg, field) in [
        (
            PrefixAffinityConfig {
                match_rate_threshold: f64::NAN,
                ..base
            },
            "match_rate_threshold",
        ),
        (
            PrefixAffinityConfig {
                imbalanced_threshold: f64::NAN,
                ..base
            },
            "imbalanced_threshold",
        ),
        (
            PrefixAffinityConfig {
                imbalanced_ratio: Some(f64::NAN),
                ..base
            },
            "imbalanced_ratio",
        ),
        // `ratio × min` is NaN with an empty queue: -∞ held for queues [5, 1], not [5, 0].
        (
            PrefixAffinityConfig {
                imbalanced_ratio: Some(f64::NEG_INFINITY),
                ..base
            },
            "imbalanced_ratio",
        ),
    ] {
        assert!(
            matches!(cfg.validate(), Err(ConfigError::InvalidValue { field: f, .. }) if f == field),
            "{field}"
        );
        let e = PrefixAffinityRouter::try_new(cfg).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
        let tree = Arc::new(kvtrie::PrefixTree::new());
        assert!(PrefixAffinityRouter::try_with_tree(tree, cfg).is_err());
        let caught = std::panic::catch_unwind(|| PrefixAffinityRouter::new(cfg));
        assert!(caught.is_err(), "new panics as documented");
    }
    // Ray's meanings of infinite and negative values stay valid.
    for cfg in [
        PrefixAffinityConfig::sglang(),
        PrefixAffinityConfig {
            imbalanced_threshold: -1.0,
            match_rate_threshold: f64::NEG_INFINITY,
            ..base
        },
        PrefixAffinityConfig {
            imbalanced_ratio: Some(-2.0),
            ..base
        },
        PrefixAffinityConfig {
            imbalanced_ratio: Some(f64::INFINITY),
            ..base
        },
    ] {
        assert_eq!(cfg.validate(), Ok(()));
        assert!(PrefixAffinityRouter::try_new(cfg).is_ok());
    }
    // Eviction settings written as a struct literal are checked as `EvictionConfig::validate`
    // checks them (the router started an eviction thread with them clamped, silently).
    let ok = kvtrie::EvictionConfig::new(100, 50, Duration::from_secs(1));
    for (eviction, what) in [
        (
            kvtrie::EvictionConfig {
                target_chars: 500,
                ..ok
            },
            "target",
        ),
        (
            kvtrie::EvictionConfig {
                interval: Duration::ZERO,
                ..ok
            },
            "interval",
        ),
        (
            kvtrie::EvictionConfig {
                global: Some((1, 9)),
                ..ok
            },
            "global",
        ),
    ] {
        let cfg = PrefixAffinityConfig {
            eviction: Some(eviction),
            ..base
        };
        let want = eviction.validate().unwrap_err();
        assert_eq!(cfg.validate(), Err(ConfigError::Eviction(want)), "{what}");
        let e = PrefixAffinityRouter::try_new(cfg).unwrap_err();
        assert!(e.to_string().contains("eviction"), "{e}");
    }
    let cfg = PrefixAffinityConfig {
        eviction: Some(ok),
        ..base
    };
    assert!(PrefixAffinityRouter::try_new(cfg).unwrap().is_evicting());
}

#[test]
fn sglang_imbalance_ratio_is_strict() {
    // Imbalanced needs max − min > 64 AND max > 1.5 × min: at max == 1.5 × min it is not.
    let (router, ids) = router_with(PrefixAffinityConfig::sglang(), 2);
    let holder = ids[0];
    let mut rng = SplitMix64::new(9);
    for ((a, b), expected) in [
        ((195, 130), (holder, RouteReason::PrefixMatch)), // spread 65, 195 == 1.5 × 130
        ((196, 130), (ids[1], RouteReason::Imbalanced)),  // spread 66, 196 > 195
    ] {
        let system = rng.text(300);
        put(&router, &system, holder);
        let r = router
            .route(&format!("{system}{}", rng.text(20)), &loaded(&ids, &[a, b]))
            .unwrap();
        assert_eq!((r.replica, r.reason), expected, "{a} {b}");
    }
}
