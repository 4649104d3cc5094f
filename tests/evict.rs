//! The background eviction thread and the global budget. Written so they cannot pass by
//! accident of timing: they wait on conditions with generous deadlines and assert on elapsed
//! time only for the prompt-stop bound.
#![cfg(not(loom))]

use kvtrie::{EvictionConfig, PrefixTree, TenantId};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

/// How long stopping a thread whose next pass is an hour away may take.
const STOP_BOUND: Duration = Duration::from_secs(30);

/// Waits until `cond` holds (or the deadline passes); returns whether it held.
fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + DEADLINE;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cond()
}

/// Prompt `k` of tenant `i`: 10 chars whose first char is unique, so prompts share no node.
fn prompt(i: usize, k: usize) -> String {
    let c = char::from_u32(0x4E00 + (i * 1000 + k) as u32).unwrap();
    format!("{c}{k:09}")
}

/// A tree where tenant `i` owns `sizes[i]` chars in 10-char prompts at times 0, 1, 2, ...
fn tree_with(sizes: &[usize]) -> (Arc<PrefixTree>, Vec<TenantId>) {
    let tree = Arc::new(PrefixTree::new());
    let mut ids = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let t = tree.add_tenant(&format!("t{i}"));
        for k in 0..size / 10 {
            tree.insert_at(&prompt(i, k), t, k as u64).unwrap();
        }
        ids.push(t);
    }
    (tree, ids)
}

#[test]
fn one_pass_evicts_each_tenant_over_threshold_down_to_target() {
    // t0 exactly at the threshold (untouched: the rule is strictly greater), t1 and t2 over,
    // t3 under.
    let (tree, ids) = tree_with(&[500, 800, 1000, 100]);
    let cfg = EvictionConfig::new(500, 300, Duration::from_secs(3600));
    let stats = tree.run_eviction_pass(&cfg);
    assert_eq!(stats.tenants_evicted, 2);
    assert_eq!(tree.char_count(ids[0]), Some(500));
    assert_eq!(tree.char_count(ids[1]), Some(300));
    assert_eq!(tree.char_count(ids[2]), Some(300));
    assert_eq!(tree.char_count(ids[3]), Some(100));
    assert_eq!(stats.chars_evicted, 500 + 700);
    // The oldest prompts went first: t1 keeps its newest 30 prompts.
    assert_eq!(tree.prefix_match(&prompt(1, 49), None).matched_chars, 0);
    assert_eq!(tree.prefix_match(&prompt(1, 50), None).matched_chars, 10);
    tree.check_invariants().unwrap();
}

#[test]
fn background_thread_evicts_and_second_start_is_refused() {
    let (tree, ids) = tree_with(&[1000, 200]);
    let h = tree
        .start_eviction(EvictionConfig::new(500, 400, Duration::from_millis(1)))
        .unwrap();
    assert!(h.is_running());
    // A second thread is refused and the first keeps its parameters.
    assert!(tree
        .start_eviction(EvictionConfig::new(1, 0, Duration::from_millis(1)))
        .is_none());
    assert!(wait_for(|| tree.char_count(ids[0]) == Some(400)));
    // More inserts push t0 over again; the thread brings it back.
    for k in 0..50 {
        tree.insert_at(&format!("00-new{k:04}"), ids[0], 1_000_000 + k)
            .unwrap();
    }
    assert!(wait_for(|| tree.char_count(ids[0]).unwrap() <= 500));
    // Under-threshold t1 never loses anything (with the first parameters).
    assert_eq!(tree.char_count(ids[1]), Some(200));
    h.stop();
    tree.check_invariants().unwrap();
}

/// The handle's totals sum what the thread's completed passes did, exactly.
#[test]
fn the_handle_totals_what_the_passes_evicted() {
    // t0 and t1 over the threshold, t2 under it; a global budget the tenants' own eviction
    // already meets.
    let (tree, ids) = tree_with(&[1000, 800, 200]);
    let cfg = EvictionConfig::new(500, 300, Duration::from_millis(1)).with_global_budget(900, 800);
    let h = tree.start_eviction(cfg).unwrap();
    // The first pass evicts; the second (and any later one) finds nothing over a budget.
    assert!(wait_for(|| h.totals().passes >= 2), "{:?}", h.totals());
    let t = h.totals();
    assert_eq!(
        (t.tenants_evicted, t.chars_evicted, t.global_chars_evicted),
        (2, 700 + 500, 0),
        "{t:?}"
    );
    assert_eq!(
        ids.iter().map(|&i| tree.char_count(i)).collect::<Vec<_>>(),
        vec![Some(300), Some(300), Some(200)]
    );
    // One prompt of 250 chars for t2 (450 chars then, not over its threshold) takes the tree
    // over the global budget at once (1,050 > 900): a later pass evicts the globally oldest
    // groups down to the global target of 800 (t2's times 0..19 and t1's 50..54).
    let long = format!(
        "{}{}",
        char::from_u32(0x4E00 + 2_100).unwrap(),
        "x".repeat(249)
    );
    tree.insert_at(&long, ids[2], 1_000).unwrap();
    assert_eq!(tree.distinct_chars(), 1_050);
    let before = h.totals().passes;
    assert!(
        wait_for(|| h.totals().global_chars_evicted > 0),
        "{:?}",
        h.totals()
    );
    let t = h.totals();
    assert!(t.passes > before, "{t:?}");
    assert_eq!(t.global_chars_evicted, 250, "{t:?}");
    assert_eq!(t.chars_evicted, 1_200, "{t:?}");
    assert_eq!(tree.distinct_chars(), 800);
    // The final totals: later passes found nothing over either bound.
    let last = h.stop();
    assert_eq!(
        (last.chars_evicted, last.global_chars_evicted),
        (1_200, 250),
        "{last:?}"
    );
    tree.check_invariants().unwrap();
}

/// A router reports its eviction thread's totals, and none without one.
#[test]
fn a_router_reports_its_eviction_totals() {
    use kvtrie::router::{PrefixAffinityConfig, PrefixAffinityRouter};
    let router = PrefixAffinityRouter::new(PrefixAffinityConfig::default());
    assert_eq!(router.eviction_totals(), None);
    let router = PrefixAffinityRouter::new(PrefixAffinityConfig {
        eviction: Some(EvictionConfig::new(50, 30, Duration::from_millis(1))),
        ..PrefixAffinityConfig::default()
    });
    let ids: Vec<TenantId> = router
        .update_replicas(&["a", "b"])
        .into_iter()
        .map(|r| r.tenant())
        .collect();
    let tree = router.tree();
    for k in 0..10 {
        tree.insert_at(&prompt(0, k), ids[0], k as u64).unwrap();
    }
    // Passes may run between the inserts (the thread started with the router), so how many
    // passes evicted and where the count ends (30 to 50) depends on timing; that the totals
    // account for every char inserted and not left does not.
    let settled = || {
        let left = router.tree().char_count(ids[0]).unwrap();
        let t = router.eviction_totals().unwrap();
        left <= 50 && t.chars_evicted as usize + left == 100
    };
    assert!(wait_for(settled), "{:?}", router.eviction_totals());
    let t = router.eviction_totals().unwrap();
    assert!(t.tenants_evicted >= 1, "{t:?}");
    assert_eq!(t.global_chars_evicted, 0, "{t:?}");
    assert_eq!(router.tree().char_count(ids[1]), Some(0));
    // Stopping returns the final totals, and the router keeps them for its metrics. Nothing
    // was over the threshold any more, so later passes evicted nothing.
    let last = router.stop_eviction().unwrap();
    assert!(!router.is_evicting());
    assert_eq!(
        (last.chars_evicted, last.tenants_evicted),
        (t.chars_evicted, t.tenants_evicted)
    );
    assert!(last.passes >= t.passes, "{last:?} {t:?}");
    assert_eq!(router.eviction_totals(), Some(last));
    assert_eq!(router.stop_eviction(), Some(last));
    let never = PrefixAffinityRouter::new(PrefixAffinityConfig::default());
    assert_eq!(never.stop_eviction(), None);
}

#[test]
fn stop_is_prompt_even_with_a_long_interval_and_restart_works() {
    let (tree, ids) = tree_with(&[1000]);
    let h = tree
        .start_eviction(EvictionConfig::new(500, 400, Duration::from_secs(3600)))
        .unwrap();
    let t0 = Instant::now();
    h.stop();
    // A liveness bound far below the hour a stop that waits out the interval would take
    // (generous: a loaded machine may not run the woken thread at once).
    assert!(t0.elapsed() < STOP_BOUND, "stop took {:?}", t0.elapsed());
    // Nothing ran in the meantime (the first pass is an hour away).
    assert_eq!(tree.char_count(ids[0]), Some(1000));
    // Restart after a stop works, with new parameters.
    let h = tree
        .start_eviction(EvictionConfig::new(500, 100, Duration::from_millis(1)))
        .unwrap();
    assert!(wait_for(|| tree.char_count(ids[0]) == Some(100)));
    // Dropping the handle stops the thread too.
    let t0 = Instant::now();
    drop(h);
    assert!(t0.elapsed() < STOP_BOUND, "drop took {:?}", t0.elapsed());
    assert!(tree
        .start_eviction(EvictionConfig::new(500, 100, Duration::from_secs(3600)))
        .is_some());
}

#[test]
fn the_thread_does_not_keep_the_tree_alive() {
    let (tree, _) = tree_with(&[100]);
    let weak = Arc::downgrade(&tree);
    let h = tree
        .start_eviction(EvictionConfig::new(50, 10, Duration::from_millis(1)))
        .unwrap();
    drop(tree);
    assert!(wait_for(|| weak.upgrade().is_none()), "tree still alive");
    assert!(!h.is_running());
    drop(h);
}

#[test]
fn global_budget_evicts_the_globally_oldest_first() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    // Interleave times across tenants: a has the odd times, b the even ones.
    for k in 0..100usize {
        let t = if k % 2 == 0 { b } else { a };
        tree.insert_at(&prompt(0, k)[..8], t, k as u64).unwrap();
    }
    assert_eq!(tree.distinct_chars(), 100 * 6);
    let cfg = EvictionConfig::new(usize::MAX, usize::MAX, Duration::from_secs(1))
        .with_global_budget(400, 300);
    let stats = tree.run_eviction_pass(&cfg);
    // 600 -> at most 300: the 50 oldest 6-char prompts go (times 0..50), across both tenants.
    assert_eq!(tree.distinct_chars(), 300);
    assert_eq!(stats.global_chars_evicted, 300);
    let kept: Vec<usize> = (0..100usize)
        .filter(|&k| tree.prefix_match(&prompt(0, k)[..8], None).matched_chars == 6)
        .collect();
    assert_eq!(kept, (50..100).collect::<Vec<_>>());
    tree.check_invariants().unwrap();
    // Under the budget: a pass evicts nothing.
    let again = tree.run_eviction_pass(&cfg);
    assert_eq!(again.global_chars_evicted, 0);
}

#[test]
fn pass_that_evicts_nothing_changes_nothing() {
    let (tree, ids) = tree_with(&[300, 200]);
    let before = tree.snapshot();
    let s = tree.run_eviction_pass(&EvictionConfig::new(300, 0, Duration::from_secs(1)));
    assert_eq!(s, Default::default());
    assert_eq!(tree.snapshot(), before);
    assert_eq!(tree.char_count(ids[0]), Some(300));
}

#[test]
fn zero_interval_is_clamped_or_rejected() {
    use kvtrie::evict::{
        EvictionConfigError as ConfigError, EvictionStartError as StartError,
        MIN_EVICTION_INTERVAL as MIN_INTERVAL,
    };
    assert_eq!(
        EvictionConfig::new(50, 10, Duration::ZERO).interval,
        MIN_INTERVAL
    );
    assert_eq!(
        EvictionConfig::try_new(50, 10, Duration::ZERO),
        Err(ConfigError::IntervalTooShort(Duration::ZERO))
    );
    // A struct literal with a zero interval: `start_eviction` runs it at the minimum interval
    // (and evicts), `try_start_eviction` says what is wrong.
    let (tree, ids) = tree_with(&[200]);
    let literal = EvictionConfig {
        threshold_chars: 50,
        target_chars: 10,
        interval: Duration::ZERO,
        global: None,
        batch_groups: 0,
    };
    match tree.try_start_eviction(literal) {
        Err(StartError::Config(ConfigError::IntervalTooShort(d))) => assert_eq!(d, Duration::ZERO),
        other => panic!("expected a config error, got {other:?}"),
    }
    let h = tree.start_eviction(literal).unwrap();
    assert!(wait_for(|| tree.char_count(ids[0]).unwrap() <= 10));
    assert!(h.is_running());
    match tree.try_start_eviction(EvictionConfig::new(1, 1, Duration::from_secs(1))) {
        Err(StartError::AlreadyRunning) => {}
        other => panic!("expected AlreadyRunning, got {other:?}"),
    }
    h.stop();
}

#[test]
fn target_above_threshold_still_evicts() {
    use kvtrie::evict::EvictionConfigError as ConfigError;
    assert_eq!(
        EvictionConfig::try_new(100, 500, Duration::from_secs(1)),
        Err(ConfigError::TargetAboveThreshold {
            threshold: 100,
            target: 500
        })
    );
    assert_eq!(
        EvictionConfig::new(100, 500, Duration::from_secs(1)).target_chars,
        100
    );
    // A struct literal that says target > threshold evicts down to the threshold.
    let (tree, ids) = tree_with(&[1000]);
    let literal = EvictionConfig {
        threshold_chars: 300,
        target_chars: 900,
        interval: Duration::from_secs(1),
        global: Some((100, 5_000)),
        batch_groups: 16,
    };
    assert!(matches!(
        literal.validate(),
        Err(ConfigError::TargetAboveThreshold { .. })
    ));
    let stats = tree.run_eviction_pass(&literal);
    assert_eq!(tree.char_count(ids[0]), Some(100), "{stats:?}");
    tree.check_invariants().unwrap();
}

/// The global budget's target may equal its maximum (only a target above it is an error), and
/// `with_global_budget` clamps a target above the maximum to it, so what it builds validates.
#[test]
fn a_global_target_at_its_maximum_is_valid_and_one_above_is_clamped() {
    use kvtrie::evict::EvictionConfigError as ConfigError;
    let at_max = EvictionConfig::new(50, 10, Duration::from_secs(1)).with_global_budget(300, 300);
    assert_eq!(at_max.global, Some((300, 300)));
    assert_eq!(at_max.validate(), Ok(()));
    let above = EvictionConfig::new(50, 10, Duration::from_secs(1)).with_global_budget(300, 301);
    assert_eq!(above.global, Some((300, 300)));
    assert_eq!(above.validate(), Ok(()));
    let literal = EvictionConfig {
        global: Some((300, 301)),
        ..at_max
    };
    assert_eq!(
        literal.validate(),
        Err(ConfigError::GlobalTargetAboveMax {
            max: 300,
            target: 301
        })
    );
    // Such a configuration starts a thread, and a pass evicts down to the maximum.
    let (tree, _) = tree_with(&[310]);
    let cfg = EvictionConfig::new(usize::MAX, usize::MAX, Duration::from_secs(3600))
        .with_global_budget(300, 300);
    tree.try_start_eviction(cfg).unwrap().stop();
    assert_eq!(tree.run_eviction_pass(&cfg).global_chars_evicted, 10);
    assert_eq!(tree.distinct_chars(), 300);
    assert_eq!(tree.prefix_match(&prompt(0, 0), None).matched_chars, 0);
    tree.check_invariants().unwrap();
}

#[test]
fn global_budget_evicts_only_when_strictly_exceeded() {
    // Exactly at the global maximum: the pass evicts nothing (the rule is "exceed").
    let (tree, ids) = tree_with(&[300]);
    assert_eq!(tree.distinct_chars(), 300);
    let cfg = EvictionConfig::new(usize::MAX, usize::MAX, Duration::from_secs(3600))
        .with_global_budget(300, 100);
    let before = tree.snapshot();
    assert_eq!(tree.run_eviction_pass(&cfg), Default::default());
    assert_eq!(tree.snapshot(), before);
    // One char over: the oldest 10-char prompts go until at most 100 chars remain (21 of them).
    tree.insert_at("z", ids[0], 1_000).unwrap();
    let stats = tree.run_eviction_pass(&cfg);
    assert_eq!(stats.global_chars_evicted, 210);
    assert_eq!(tree.distinct_chars(), 91);
    assert_eq!(tree.prefix_match(&prompt(0, 20), None).matched_chars, 0);
    assert_eq!(tree.prefix_match(&prompt(0, 21), None).matched_chars, 10);
    tree.check_invariants().unwrap();
}

/// The configuration and start errors say what is wrong in words, and a start error names the
/// configuration error as its source (`AlreadyRunning` has none).
#[test]
fn eviction_errors_display_their_reason_and_source() {
    use kvtrie::evict::{EvictionConfigError as ConfigError, EvictionStartError as StartError};
    use std::error::Error as _;
    let target = ConfigError::TargetAboveThreshold {
        threshold: 100,
        target: 500,
    };
    assert_eq!(
        target.to_string(),
        "eviction target of 500 chars is above the threshold of 100 chars"
    );
    assert_eq!(
        ConfigError::GlobalTargetAboveMax {
            max: 300,
            target: 301
        }
        .to_string(),
        "global eviction target of 301 chars is above the maximum of 300 chars"
    );
    assert_eq!(
        ConfigError::IntervalTooShort(Duration::ZERO).to_string(),
        "eviction interval 0ns is shorter than the minimum of 1ms"
    );
    assert_eq!(
        StartError::AlreadyRunning.to_string(),
        "an eviction thread is already running for this tree"
    );
    assert!(StartError::AlreadyRunning.source().is_none());
    let config = StartError::Config(target);
    assert_eq!(
        config.to_string(),
        "invalid eviction configuration: eviction target of 500 chars is above the threshold of 100 chars"
    );
    assert_eq!(
        config.source().map(|e| e.to_string()).as_deref(),
        Some("eviction target of 500 chars is above the threshold of 100 chars")
    );
    let spawn = StartError::Spawn(std::io::Error::other("no threads left"));
    assert_eq!(
        spawn.to_string(),
        "could not start the eviction thread: no threads left"
    );
    assert_eq!(
        spawn.source().map(|e| e.to_string()).as_deref(),
        Some("no threads left")
    );
}

/// A handle's `Debug` says whether its thread is running.
#[test]
fn a_handle_debug_shows_whether_it_runs() {
    let (tree, _) = tree_with(&[100]);
    let h = tree
        .start_eviction(EvictionConfig::new(500, 400, Duration::from_secs(3600)))
        .unwrap();
    assert_eq!(format!("{h:?}"), "EvictionHandle { running: true, .. }");
    drop(tree);
    assert_eq!(format!("{h:?}"), "EvictionHandle { running: false, .. }");
}

/// The global budget breaks a tie between the tenants' oldest times in favour of the smallest
/// tenant id (documented on `with_global_budget`; here the first added): one group is enough,
/// and it is that tenant's.
#[test]
fn global_eviction_breaks_a_tie_of_oldest_times_by_the_lowest_slot() {
    let tree = PrefixTree::new();
    let a = tree.add_tenant("a");
    let b = tree.add_tenant("b");
    tree.insert_at("bbbb", b, 1).unwrap();
    tree.insert_at("aaaa", a, 1).unwrap();
    let cfg = EvictionConfig::new(usize::MAX, usize::MAX, Duration::from_secs(3600))
        .with_global_budget(7, 4);
    assert_eq!(tree.run_eviction_pass(&cfg).global_chars_evicted, 4);
    assert_eq!((tree.char_count(a), tree.char_count(b)), (Some(0), Some(4)));
    assert_eq!(tree.prefix_match("bbbb", None).matched_chars, 4);
    tree.check_invariants().unwrap();
}
