//! Block hashing and `BlockIndex` semantics: hash vectors, overlap scoring, events, a proptest
//! against a sequential `HashMap` model, and a multi-threaded stress test.
#![cfg(not(loom))]

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvtrie::blocks::{CacheKeys, HasherError, IndexStats, MmInput};
use kvtrie::blocks::{Tier, TierWeights};
use kvtrie::workload::SplitMix64;
use kvtrie::{BlockHasher, BlockIndex, EventError, KvEvent, OverlapScores, StoredBlock, WorkerId};
use proptest::prelude::*;
use xxhash_rust::xxh3::xxh3_64_with_seed;

// ---------------------------------------------------------------------------------------------
// Hashing
// ---------------------------------------------------------------------------------------------

#[test]
fn xxh3_test_vector() {
    assert_eq!(
        xxh3_64_with_seed(b"test data", 1337),
        13_226_331_709_069_118_873
    );
    assert_eq!(BlockHasher::new(16).seed(), 1337);
}

#[test]
fn local_hash_is_xxh3_of_le_u32_bytes() {
    let h = BlockHasher::new(4);
    let tokens = [1u32, 2, 3, 0xDEAD_BEEF, 5, 6, 7, 8];
    let mut bytes = Vec::new();
    for t in &tokens[..4] {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let local = h.local_hashes(&tokens);
    assert_eq!(local.len(), 2);
    assert_eq!(local[0], xxh3_64_with_seed(&bytes, 1337));
    assert_eq!(local[0], h.hash_block(&tokens[..4]));
    assert_ne!(local[0], local[1]);
}

#[test]
fn trailing_partial_block_is_ignored() {
    let h = BlockHasher::new(16);
    let tokens: Vec<u32> = (0..47).collect();
    assert_eq!(h.local_hashes(&tokens).len(), 2);
    assert_eq!(h.local_hashes(&tokens), h.local_hashes(&tokens[..32]));
    assert_eq!(h.sequence_hashes(&tokens), h.sequence_hashes(&tokens[..32]));
    assert!(h.local_hashes(&tokens[..15]).is_empty());
    assert_eq!(h.full_blocks(&tokens), 2);
}

#[test]
fn sequence_hashes_chain_manually() {
    let h = BlockHasher::new(2);
    let tokens: Vec<u32> = (100..108).collect();
    let local = h.local_hashes(&tokens);
    let seq = h.sequence_hashes(&tokens);
    assert_eq!(seq.len(), 4);
    assert_eq!(seq[0], local[0]);
    for i in 1..4 {
        let mut buf = Vec::new();
        buf.extend_from_slice(&seq[i - 1].to_le_bytes());
        buf.extend_from_slice(&local[i].to_le_bytes());
        assert_eq!(seq[i], xxh3_64_with_seed(&buf, 1337), "block {i}");
        assert_eq!(seq[i], h.chain(seq[i - 1], local[i]));
    }
    assert_eq!(h.chain_local(&local), seq);
    // The `_into` forms clear and refill.
    let mut out = vec![1, 2, 3, 4, 5, 6];
    h.sequence_hashes_into(&tokens, &mut out);
    assert_eq!(out, seq);
    h.local_hashes_into(&tokens[..2], &mut out);
    assert_eq!(out, vec![local[0]]);
}

#[test]
fn salt_changes_the_seed() {
    let h = BlockHasher::new(16);
    assert_eq!(h.with_salt("", "").seed(), 1337);
    assert_eq!(
        h.with_salt("lora-a", "").seed(),
        1337u64.wrapping_add(xxh3_64_with_seed(b"lora-a", 0))
    );
    assert_eq!(
        h.with_salt("", "ns").seed(),
        1337u64.wrapping_add(xxh3_64_with_seed(b"ns", 1))
    );
    assert_eq!(
        h.with_salt("lora-a", "ns").seed(),
        1337u64
            .wrapping_add(xxh3_64_with_seed(b"lora-a", 0))
            .wrapping_add(xxh3_64_with_seed(b"ns", 1))
    );
    let tokens: Vec<u32> = (0..32).collect();
    let salted = h.with_salt("lora-a", "ns");
    assert_eq!(salted.block_size(), 16);
    assert_ne!(salted.local_hashes(&tokens), h.local_hashes(&tokens));
    assert_eq!(
        salted.local_hashes(&tokens)[0],
        xxh3_64_with_seed(
            &tokens[..16]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
            salted.seed()
        )
    );
}

#[test]
fn try_new_rejects_zero_and_keeps_the_block_size() {
    assert_eq!(BlockHasher::try_new(0), Err(HasherError::ZeroBlockSize));
    let h = BlockHasher::try_new(4).unwrap();
    assert_eq!((h.block_size(), h.seed()), (4, 1337));
    assert_eq!(h.local_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]).len(), 2);
}

/// A multimodal item keys exactly the blocks it overlaps: `[offset, offset + length)` meets
/// `[start, end)`; an item ending on a block's start or starting on its end leaves it alone.
#[test]
fn multimodal_items_key_exactly_the_blocks_they_overlap() {
    let h = BlockHasher::new(4);
    let tokens: Vec<u32> = (0..16).collect();
    let plain = h.local_hashes(&tokens);
    let keyed = |offset: usize, length: usize| -> Vec<bool> {
        let mm = [MmInput {
            identifier: "img",
            offset,
            length,
        }];
        let keys = CacheKeys {
            mm_inputs: &mm,
            ..CacheKeys::default()
        };
        let got = h.local_hashes_with(&tokens, &keys);
        assert_eq!(got.len(), 4);
        got.iter().zip(&plain).map(|(a, b)| a != b).collect()
    };
    assert_eq!(keyed(0, 2), [true, false, false, false]);
    assert_eq!(keyed(0, 4), [true, false, false, false]);
    assert_eq!(keyed(4, 4), [false, true, false, false]);
    assert_eq!(keyed(8, 1), [false, false, true, false]);
    assert_eq!(keyed(3, 6), [true, true, true, false]);
    assert_eq!(keyed(9, 100), [false, false, true, true]);
    // A zero-length item keys the block it sits inside.
    assert_eq!(keyed(6, 0), [false, true, false, false]);
}

/// The key of an item is its identifier and its offset from the block's start: blocks of
/// equal tokens with an item at the same place in each hash alike, wherever they are.
#[test]
fn multimodal_offsets_are_relative_to_the_block() {
    let h = BlockHasher::new(4);
    let tokens = [7u32; 12];
    let with = |offset: usize, identifier: &str| {
        let mm = [MmInput {
            identifier,
            offset,
            length: 1,
        }];
        h.local_hashes_with(
            &tokens,
            &CacheKeys {
                mm_inputs: &mm,
                ..CacheKeys::default()
            },
        )
    };
    let plain = h.hash_block(&tokens[..4]);
    let (at1, at5, at10) = (with(1, "img"), with(5, "img"), with(10, "img"));
    assert_eq!(at1[1..], [plain, plain]);
    assert_eq!(at5[0], plain);
    assert_eq!(at5[1], at1[0]);
    assert_ne!(at10[2], at1[0]);
    assert_ne!(at1[0], plain);
    assert_ne!(with(1, "other")[0], at1[0]);
}

// ---------------------------------------------------------------------------------------------
// Overlap semantics
// ---------------------------------------------------------------------------------------------

const A: WorkerId = WorkerId(1);
const B: WorkerId = WorkerId(2);

/// Blocks whose engine hash is `100 + local hash`.
fn blocks(locals: &[u64]) -> Vec<StoredBlock> {
    locals
        .iter()
        .map(|&l| StoredBlock {
            engine_hash: 100 + l,
            local_hash: l,
        })
        .collect()
}

fn stored(parent: Option<u64>, locals: &[u64]) -> KvEvent {
    KvEvent::Stored {
        parent,
        blocks: blocks(locals),
    }
}

fn scores(s: &OverlapScores) -> Vec<(u64, usize)> {
    s.iter().map(|(w, n)| (w.0, n)).collect()
}

#[test]
fn leading_run_only() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2, 3, 4])).unwrap();
    // B holds blocks 2..4 of the same chain but not block 1: score 0.
    index.apply(B, stored(None, &[1, 2, 3, 4])).unwrap();
    index
        .apply(
            B,
            KvEvent::Removed {
                engine_hashes: vec![101],
            },
        )
        .unwrap();
    let s = index.find_matches(&[1, 2, 3, 4]);
    assert_eq!(scores(&s), vec![(1, 4)]);
    assert_eq!(s.get(B), 0);
    assert_eq!(index.block_count(B), 3);
    // A longer request scores the stored run; a diverging one scores up to the divergence.
    assert_eq!(index.find_matches(&[1, 2, 3, 4, 5, 6]).get(A), 4);
    assert_eq!(index.find_matches(&[1, 2, 9, 4]).get(A), 2);
    assert_eq!(
        index.find_matches(&[2, 3]).get(A),
        0,
        "not chained from the start"
    );
    assert!(index.find_matches(&[]).is_empty());
    assert_eq!(s.max(), 4);
    assert_eq!(s.best(), Some((A, 4)));
}

#[test]
fn scores_are_empty_only_without_holders_and_clear_empties_them() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2])).unwrap();
    let mut s = index.find_matches(&[1, 2]);
    assert!(!s.is_empty());
    assert_eq!((s.len(), s.get(A), s.max()), (1, 2, 2));
    s.clear();
    assert!(s.is_empty());
    assert_eq!((s.len(), s.get(A), s.max(), s.best()), (0, 0, 0, None));
    assert_eq!(scores(&s), vec![]);
    assert!(index.find_matches(&[3]).is_empty());
}

/// Scores are equal when every worker has the same blocks and the same per-tier runs: the
/// same tiers with another block count, or another worker, differ.
#[test]
fn scores_equal_only_with_equal_workers_blocks_and_tiers() {
    let gpu_only = BlockIndex::new();
    gpu_only.apply_in(A, Tier::Gpu, stored(None, &[1])).unwrap();
    // Block 2 in the CPU tier only: two blocks, but still a GPU run of 1 and a CPU run of 0.
    let gpu_then_cpu = BlockIndex::new();
    gpu_then_cpu
        .apply_in(A, Tier::Gpu, stored(None, &[1]))
        .unwrap();
    gpu_then_cpu
        .apply_in(A, Tier::Cpu, stored(Some(101), &[2]))
        .unwrap();
    let on_b = BlockIndex::new();
    on_b.apply_in(B, Tier::Gpu, stored(None, &[1])).unwrap();
    let (one, two, b) = (
        gpu_only.find_matches(&[1, 2]),
        gpu_then_cpu.find_matches(&[1, 2]),
        on_b.find_matches(&[1, 2]),
    );
    assert_eq!((one.get(A), two.get(A)), (1, 2));
    for t in [Tier::Gpu, Tier::Cpu] {
        assert_eq!(one.get_tier(A, t), two.get_tier(A, t), "{t:?}");
    }
    assert_ne!(one, two);
    assert_ne!(one, b);
    assert_eq!(one, gpu_only.find_matches(&[1, 2]));
}

#[test]
fn partial_chains_on_several_workers() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2])).unwrap();
    index.apply(B, stored(None, &[1, 2, 3, 4, 5])).unwrap();
    index.apply(WorkerId(3), stored(None, &[1])).unwrap();
    index.apply(WorkerId(4), stored(None, &[7, 8])).unwrap();
    let s = index.find_matches(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(scores(&s), vec![(1, 2), (2, 5), (3, 1)]);
    assert_eq!(s.len(), 3);
    assert_eq!(s.best(), Some((B, 5)));
    // Ties: the smallest worker id.
    index
        .apply(WorkerId(0), stored(None, &[1, 2, 3, 4, 5]))
        .unwrap();
    assert_eq!(
        index.find_matches(&[1, 2, 3, 4, 5]).best(),
        Some((WorkerId(0), 5))
    );
    // All forms agree.
    let s = index.find_matches(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(scores(&s), vec![(0, 5), (1, 2), (2, 5), (3, 1)]);
    let h = index.hasher();
    let seq = h.chain_local(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(index.find_matches_seq(&seq), s);
    let mut out = OverlapScores::new();
    index.find_matches_into(&[1, 2, 3, 4, 5, 6], &mut out);
    assert_eq!(out, s);
    index.find_matches_into(&[7, 8], &mut out);
    assert_eq!(scores(&out), vec![(4, 2)]);
}

#[test]
fn find_matches_tokens_hashes_with_the_index_hasher() {
    let hasher = BlockHasher::new(4).with_salt("lora", "");
    let index = BlockIndex::with_hasher(&hasher);
    let tokens: Vec<u32> = (0..18).collect();
    let local = hasher.local_hashes(&tokens);
    let seq = hasher.sequence_hashes(&tokens);
    let ev = KvEvent::Stored {
        parent: None,
        blocks: local
            .iter()
            .zip(&seq)
            .take(3)
            .map(|(&l, &s)| StoredBlock {
                engine_hash: s,
                local_hash: l,
            })
            .collect(),
    };
    index.apply(A, ev).unwrap();
    assert_eq!(index.find_matches_tokens(&tokens).get(A), 3);
    assert_eq!(index.find_matches(&local).get(A), 3);
    assert_eq!(index.find_matches_seq(&seq).get(A), 3);
    // An index with the unsalted seed chains differently after block 0.
    let plain = BlockIndex::with_seed(1337);
    plain
        .apply(
            A,
            KvEvent::Stored {
                parent: None,
                blocks: local
                    .iter()
                    .map(|&l| StoredBlock {
                        engine_hash: l,
                        local_hash: l,
                    })
                    .collect(),
            },
        )
        .unwrap();
    assert_eq!(plain.find_matches_seq(&seq).get(A), 1);
}

#[test]
fn removal_in_the_middle_cuts_the_run() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2, 3, 4, 5])).unwrap();
    index
        .apply(
            A,
            KvEvent::Removed {
                engine_hashes: vec![103],
            },
        )
        .unwrap();
    assert_eq!(index.find_matches(&[1, 2, 3, 4, 5]).get(A), 2);
    assert_eq!(index.block_count(A), 4);
    assert_eq!(index.stats().blocks_removed, 1);
    // Re-storing block 3 under its parent restores the run.
    index.apply(A, stored(Some(102), &[3])).unwrap();
    assert_eq!(index.find_matches(&[1, 2, 3, 4, 5]).get(A), 5);
}

#[test]
fn cleared_and_remove_worker() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2, 3])).unwrap();
    index.apply(B, stored(None, &[1, 2])).unwrap();
    assert_eq!(index.total_blocks(), 5);
    index.apply(A, KvEvent::Cleared).unwrap();
    assert_eq!(index.block_count(A), 0);
    assert_eq!(index.workers(), vec![A, B], "Cleared keeps the worker");
    assert_eq!(scores(&index.find_matches(&[1, 2, 3])), vec![(2, 2)]);
    // A's old blocks are gone, so a child of them is an unknown parent.
    assert!(index.apply(A, stored(Some(101), &[2])).is_err());

    assert_eq!(index.remove_worker(B), 2);
    assert_eq!(index.remove_worker(B), 0);
    assert_eq!(index.workers(), vec![A]);
    assert!(index.find_matches(&[1, 2, 3]).is_empty());
    assert_eq!(index.total_blocks(), 0);
    // A removed worker can come back with fresh state.
    index.apply(B, stored(None, &[1])).unwrap();
    assert_eq!(scores(&index.find_matches(&[1, 2, 3])), vec![(2, 1)]);
    assert_eq!(index.distinct_blocks(), 1);
}

#[test]
fn parent_chaining_across_events() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2])).unwrap();
    index.apply(A, stored(Some(102), &[3, 4])).unwrap();
    index.apply(A, stored(Some(104), &[5])).unwrap();
    assert_eq!(index.find_matches(&[1, 2, 3, 4, 5]).get(A), 5);
    // A branch from block 1.
    index
        .apply(
            A,
            KvEvent::Stored {
                parent: Some(101),
                blocks: vec![StoredBlock {
                    engine_hash: 900,
                    local_hash: 9,
                }],
            },
        )
        .unwrap();
    assert_eq!(index.find_matches(&[1, 9]).get(A), 2);
    assert_eq!(index.find_matches(&[1, 2, 3, 4, 5]).get(A), 5);
    // The same local hashes stored without a parent are a different sequence.
    index.apply(B, stored(None, &[3, 4])).unwrap();
    assert_eq!(index.find_matches(&[1, 2, 3, 4]).get(B), 0);
    assert_eq!(index.find_matches(&[3, 4]).get(B), 2);
}

#[test]
fn unknown_parent_is_an_error_and_stores_nothing() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1])).unwrap();
    let err = index.apply(A, stored(Some(555), &[2, 3])).unwrap_err();
    assert_eq!(
        err,
        EventError::UnknownParent {
            worker: A,
            parent: 555
        }
    );
    assert!(err.to_string().contains("unknown parent"));
    assert_eq!(index.block_count(A), 1);
    // Another worker's block is not a parent for B.
    assert!(index.apply(B, stored(Some(101), &[2])).is_err());
    assert_eq!(index.block_count(B), 0);
    assert!(index.workers() == vec![A]);
    let st = index.stats();
    assert_eq!(st.unknown_parents, 2);
    assert_eq!(st.events_applied, 1);
    assert_eq!(st.blocks_stored, 1);
}

#[test]
fn duplicate_store_is_reference_counted() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2, 3])).unwrap();
    // The same blocks stored again (two requests computed them at once): a second copy.
    index.apply(A, stored(None, &[1, 2, 3])).unwrap();
    index.apply(A, stored(Some(101), &[2])).unwrap();
    assert_eq!(index.block_count(A), 3);
    assert_eq!(index.total_blocks(), 3);
    let st = index.stats();
    assert_eq!((st.blocks_stored, st.duplicate_copies), (3, 4));
    assert_eq!(index.find_matches(&[1, 2, 3]).get(A), 3);
    let remove = |e: u64| {
        index
            .apply(
                A,
                KvEvent::Removed {
                    engine_hashes: vec![e],
                },
            )
            .unwrap()
    };
    // One removal of block 2 (three copies) leaves it visible; the third removal drops it.
    remove(102);
    assert_eq!(index.find_matches(&[1, 2, 3]).get(A), 3);
    remove(102);
    assert_eq!(index.find_matches(&[1, 2, 3]).get(A), 3);
    remove(102);
    assert_eq!(index.find_matches(&[1, 2, 3]).get(A), 1);
    assert_eq!(index.block_count(A), 2);
    remove(102);
    assert_eq!(index.stats().unknown_removes, 1);
    // Block 3: two copies.
    remove(103);
    assert_eq!(index.block_count(A), 2);
    remove(103);
    assert_eq!(index.block_count(A), 1);
    assert_eq!(index.distinct_blocks(), 1);
}

#[test]
fn copies_saturate_at_the_cap() {
    use kvtrie::blocks::MAX_COPIES;
    let index = BlockIndex::new();
    for _ in 0..u32::from(MAX_COPIES) + 10 {
        index.apply(A, stored(None, &[1])).unwrap();
    }
    let st = index.stats();
    assert_eq!(st.duplicate_copies, u64::from(MAX_COPIES) - 1);
    assert_eq!(st.copies_saturated, 10);
    for _ in 0..MAX_COPIES - 1 {
        index
            .apply(
                A,
                KvEvent::Removed {
                    engine_hashes: vec![101],
                },
            )
            .unwrap();
    }
    assert_eq!(index.find_matches(&[1]).get(A), 1);
    index
        .apply(
            A,
            KvEvent::Removed {
                engine_hashes: vec![101],
            },
        )
        .unwrap();
    assert!(index.find_matches(&[1]).is_empty());
    assert_eq!(index.total_blocks(), 0);
}

#[test]
fn tiers_are_held_and_removed_independently() {
    let index = BlockIndex::new();
    let gpu = |ev| index.apply_in(A, Tier::Gpu, ev).unwrap();
    let cpu = |ev| index.apply_in(A, Tier::Cpu, ev).unwrap();
    // GPU holds 1..=4, the CPU offload holds 1..=3; disk holds 1..=2 for worker B.
    gpu(stored(None, &[1, 2, 3, 4]));
    cpu(stored(None, &[1, 2, 3]));
    index
        .apply_in(B, Tier::Disk, stored(None, &[1, 2]))
        .unwrap();
    let q = [1, 2, 3, 4, 5];
    let s = index.find_matches(&q);
    assert_eq!(
        (s.get(A), s.get_tier(A, Tier::Gpu), s.get_tier(A, Tier::Cpu)),
        (4, 4, 3)
    );
    assert_eq!(
        (
            s.get(B),
            s.get_tier(B, Tier::Disk),
            s.get_tier(B, Tier::Gpu)
        ),
        (2, 2, 0)
    );
    assert_eq!(index.block_count(A), 4, "engine hashes, whatever the tiers");
    // The GPU evicts blocks 2 and 3: the CPU copies keep the run going.
    gpu(KvEvent::Removed {
        engine_hashes: vec![102, 103],
    });
    let s = index.find_matches(&q);
    assert_eq!(
        (s.get(A), s.get_tier(A, Tier::Gpu), s.get_tier(A, Tier::Cpu)),
        (4, 1, 3)
    );
    let o = s.overlap(A).unwrap();
    assert_eq!(o.per_tier, [1, 3, 0, 0]);
    // Weighted (defaults GPU 1.0, CPU 0.8): blocks 1 and 4 on the GPU, 2 and 3 on the CPU.
    assert!((o.weighted - (1.0 + 0.8 + 0.8 + 1.0)).abs() < 1e-9, "{o:?}");
    let w = TierWeights {
        cpu: 0.5,
        ..TierWeights::default()
    };
    let s = index.find_matches_weighted(&q, &w);
    assert!((s.weighted(A) - 3.0).abs() < 1e-9);
    assert!((s.weighted(B) - 1.0).abs() < 1e-9, "disk 0.5 x 2");
    // A removal in a tier that does not hold the block is unknown; GPU removal of a CPU-only
    // block too.
    cpu(KvEvent::Removed {
        engine_hashes: vec![104],
    });
    gpu(KvEvent::Removed {
        engine_hashes: vec![102],
    });
    assert_eq!(index.stats().unknown_removes, 2);
    // Clearing the CPU tier leaves the GPU copies; `apply(Cleared)` clears every tier.
    cpu(KvEvent::Cleared);
    let s = index.find_matches(&q);
    assert_eq!((s.get(A), s.get_tier(A, Tier::Cpu)), (1, 0));
    assert_eq!(index.block_count(A), 2, "blocks 1 and 4 on the GPU");
    index.apply(B, KvEvent::Cleared).unwrap();
    assert_eq!(index.find_matches(&q).get(B), 0);
    // A parent held only on the CPU chains a GPU store.
    cpu(stored(None, &[7]));
    gpu(stored(Some(107), &[8]));
    assert_eq!(index.find_matches(&[7, 8]).get(A), 2);
    assert_eq!(index.find_matches(&[7, 8]).get_tier(A, Tier::Gpu), 0);
}

#[test]
fn duplicate_copies_per_tier() {
    // Two copies on the GPU and one on the CPU: the block stays until all three are gone.
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1])).unwrap();
    index.apply(A, stored(None, &[1])).unwrap();
    index.apply_in(A, Tier::Cpu, stored(None, &[1])).unwrap();
    let rm = |t| {
        index
            .apply_in(
                A,
                t,
                KvEvent::Removed {
                    engine_hashes: vec![101],
                },
            )
            .unwrap()
    };
    rm(Tier::Gpu);
    assert_eq!(index.find_matches(&[1]).get_tier(A, Tier::Gpu), 1);
    rm(Tier::Gpu);
    let s = index.find_matches(&[1]);
    assert_eq!(
        (s.get(A), s.get_tier(A, Tier::Gpu), s.get_tier(A, Tier::Cpu)),
        (1, 0, 1)
    );
    rm(Tier::Cpu);
    assert!(index.find_matches(&[1]).is_empty());
    assert_eq!((index.total_blocks(), index.distinct_blocks()), (0, 0));
}

#[test]
fn two_engine_hashes_for_one_sequence_hash() {
    // The worker holds the sequence hash while any of its engine hashes maps to it.
    let index = BlockIndex::new();
    let ev = |e: u64| KvEvent::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            engine_hash: e,
            local_hash: 7,
        }],
    };
    index.apply(A, ev(1)).unwrap();
    index.apply(A, ev(2)).unwrap();
    assert_eq!(index.block_count(A), 2);
    index
        .apply(
            A,
            KvEvent::Removed {
                engine_hashes: vec![1],
            },
        )
        .unwrap();
    assert_eq!(index.find_matches(&[7]).get(A), 1);
    index
        .apply(
            A,
            KvEvent::Removed {
                engine_hashes: vec![2],
            },
        )
        .unwrap();
    assert_eq!(index.find_matches(&[7]).get(A), 0);
}

#[test]
fn unknown_remove_is_counted() {
    let index = BlockIndex::new();
    index.apply(A, stored(None, &[1, 2])).unwrap();
    index
        .apply(
            A,
            KvEvent::Removed {
                engine_hashes: vec![101, 999, 101],
            },
        )
        .unwrap();
    index
        .apply(
            B,
            KvEvent::Removed {
                engine_hashes: vec![101],
            },
        )
        .unwrap();
    let st = index.stats();
    assert_eq!(st.blocks_removed, 1);
    assert_eq!(st.unknown_removes, 3);
    assert_eq!(index.block_count(A), 1);
}

/// `blocks_removed` counts mappings, like `blocks_stored`: a removal that leaves another copy
/// of the block (a duplicate in the same tier, or a copy in another) removes none, and the
/// removal of the last copy counts once. (Each removed copy was counted, so that stored minus
/// removed could reach 0 while the block was still held.)
#[test]
fn removed_blocks_are_counted_as_mappings_like_stored_ones() {
    let index = BlockIndex::new();
    let removed = |e: u64, t: Tier| {
        index
            .apply_in(
                A,
                t,
                KvEvent::Removed {
                    engine_hashes: vec![e],
                },
            )
            .unwrap()
    };
    // A duplicate GPU copy of 101, and 102 on the GPU and the CPU.
    index.apply(A, stored(None, &[1])).unwrap();
    index.apply(A, stored(None, &[1])).unwrap();
    index.apply(A, stored(Some(101), &[2])).unwrap();
    index
        .apply_in(A, Tier::Cpu, stored(Some(101), &[2]))
        .unwrap();
    let counts = || {
        let st = index.stats();
        (st.blocks_stored, st.blocks_removed, index.block_count(A))
    };
    assert_eq!(counts(), (2, 0, 2));
    removed(101, Tier::Gpu);
    removed(102, Tier::Gpu);
    assert_eq!(counts(), (2, 0, 2), "copies remain of both");
    removed(101, Tier::Gpu);
    assert_eq!(counts(), (2, 1, 1));
    removed(102, Tier::Cpu);
    assert_eq!(counts(), (2, 2, 0));
    assert_eq!(index.stats().unknown_removes, 0);
}

/// With full reports (vLLM's `kv_cache_report_mode = "full"` publishes a store for every block a
/// request reuses, and no removal for it), a GPU store of a block already held changes
/// nothing, so the engine's one removal removes it; counted as copies (the default, right for
/// vLLM's incremental reports), the block stayed in the index after the engine evicted it.
/// Copies in other tiers are still counted.
#[test]
fn full_reports_of_reused_blocks_are_not_copies() {
    use kvtrie::blocks::DuplicateStores;
    let run = |d: DuplicateStores| {
        let index = BlockIndex::new();
        assert_eq!(index.duplicate_stores(), DuplicateStores::Copies);
        index.set_duplicate_stores(d);
        assert_eq!(index.duplicate_stores(), d);
        // A request stores 101, 102; two later ones reuse them (reported from block 0).
        for _ in 0..3 {
            index.apply(A, stored(None, &[1, 2])).unwrap();
        }
        index.apply_in(A, Tier::Cpu, stored(None, &[1])).unwrap();
        index.apply_in(A, Tier::Cpu, stored(None, &[1])).unwrap();
        // The engine evicts both from the GPU, and one CPU copy of 101.
        index
            .apply(
                A,
                KvEvent::Removed {
                    engine_hashes: vec![102, 101],
                },
            )
            .unwrap();
        index
            .apply_in(
                A,
                Tier::Cpu,
                KvEvent::Removed {
                    engine_hashes: vec![101],
                },
            )
            .unwrap();
        let s = index.find_matches(&[1, 2]);
        (s.get_tier(A, Tier::Gpu), s.get_tier(A, Tier::Cpu))
    };
    // Reports: gone from the GPU; one CPU copy of 101 left.
    assert_eq!(run(DuplicateStores::Reports), (0, 1));
    // Copies: two reports each still counted on the GPU.
    assert_eq!(run(DuplicateStores::Copies), (2, 1));
}

#[test]
fn hash_zero_and_engine_hash_zero_work() {
    let index = BlockIndex::new();
    index
        .apply(
            A,
            KvEvent::Stored {
                parent: None,
                blocks: vec![
                    StoredBlock {
                        engine_hash: 0,
                        local_hash: 0,
                    },
                    StoredBlock {
                        engine_hash: 5,
                        local_hash: 0,
                    },
                ],
            },
        )
        .unwrap();
    assert_eq!(index.find_matches(&[0, 0]).get(A), 2);
    index.apply(A, stored(Some(0), &[3])).unwrap();
    let h = BlockHasher::new(16);
    assert_eq!(index.find_matches_seq(&h.chain_local(&[0, 3])).get(A), 2);
    index
        .apply(
            A,
            KvEvent::Removed {
                engine_hashes: vec![0],
            },
        )
        .unwrap();
    assert_eq!(index.find_matches(&[0, 0]).get(A), 0);
    assert_eq!(index.block_count(A), 2);
}

#[test]
fn heap_bytes_and_stats_track_contents() {
    let index = BlockIndex::new();
    let empty = index.heap_bytes();
    let locals: Vec<u64> = (1..=1000).collect();
    index.apply(A, stored(None, &locals)).unwrap();
    let full = index.heap_bytes();
    assert!(full > empty + 1000 * 16, "{empty} -> {full}");
    assert!(full < empty + 1000 * 80, "{empty} -> {full}");
    index.apply(A, KvEvent::Cleared).unwrap();
    assert!(index.heap_bytes() < full / 4);
    assert_eq!(
        index.stats(),
        IndexStats {
            events_applied: 2,
            blocks_stored: 1000,
            ..IndexStats::default()
        }
    );
}

#[test]
fn index_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<BlockIndex>();
    check::<OverlapScores>();
}

// ---------------------------------------------------------------------------------------------
// Model-based property test
// ---------------------------------------------------------------------------------------------

/// The obviously correct sequential model: per worker, engine hash → (sequence hash, copies
/// per tier).
#[derive(Default)]
struct Model {
    workers: BTreeMap<WorkerId, HashMap<u64, (u64, [u32; 4])>>,
    unknown_parents: u64,
    unknown_removes: u64,
}

impl Model {
    fn apply(&mut self, h: &BlockHasher, w: WorkerId, ev: &KvEvent) -> Result<(), ()> {
        match ev {
            KvEvent::Cleared => {
                if let Some(m) = self.workers.get_mut(&w) {
                    m.clear();
                }
                Ok(())
            }
            other => self.apply_in(h, w, Tier::Gpu, other),
        }
    }

    fn apply_in(&mut self, h: &BlockHasher, w: WorkerId, t: Tier, ev: &KvEvent) -> Result<(), ()> {
        let t = t.index();
        match ev {
            KvEvent::Stored { parent, blocks } => {
                let mut prev = match parent {
                    None => None,
                    Some(p) => match self.workers.get(&w).and_then(|m| m.get(p)) {
                        Some(&(s, _)) => Some(s),
                        None => {
                            self.unknown_parents += 1;
                            return Err(());
                        }
                    },
                };
                if blocks.is_empty() {
                    return Ok(());
                }
                let m = self.workers.entry(w).or_default();
                for b in blocks {
                    let s = match prev {
                        None => b.local_hash,
                        Some(p) => h.chain(p, b.local_hash),
                    };
                    let e = m.entry(b.engine_hash).or_insert((s, [0; 4]));
                    if e.0 != s {
                        *e = (s, [0; 4]);
                    }
                    e.1[t] = (e.1[t] + 1).min(u32::from(kvtrie::blocks::MAX_COPIES));
                    prev = Some(s);
                }
            }
            KvEvent::Removed { engine_hashes } => {
                for e in engine_hashes {
                    let m = self.workers.get_mut(&w);
                    match m.and_then(|m| m.get_mut(e).map(|x| (x, ()))) {
                        Some((x, ())) if x.1[t] > 0 => {
                            x.1[t] -= 1;
                            if x.1 == [0; 4] {
                                self.workers.get_mut(&w).unwrap().remove(e);
                            }
                        }
                        _ => self.unknown_removes += 1,
                    }
                }
            }
            KvEvent::Cleared => {
                if let Some(m) = self.workers.get_mut(&w) {
                    for x in m.values_mut() {
                        x.1[t] = 0;
                    }
                    m.retain(|_, x| x.1 != [0; 4]);
                }
            }
        }
        Ok(())
    }

    /// Per worker with a positive score: (any-tier run, per-tier runs).
    fn find(&self, h: &BlockHasher, local: &[u64]) -> Vec<(u64, usize, [usize; 4])> {
        let seq = h.chain_local(local);
        self.workers
            .iter()
            .filter_map(|(w, m)| {
                let tiers_of = |s: u64| {
                    m.values()
                        .filter(|x| x.0 == s)
                        .fold([false; 4], |mut acc, x| {
                            for (a, &c) in acc.iter_mut().zip(&x.1) {
                                *a |= c > 0;
                            }
                            acc
                        })
                };
                let n = seq
                    .iter()
                    .take_while(|&&s| tiers_of(s).contains(&true))
                    .count();
                let mut per = [0; 4];
                for (t, p) in per.iter_mut().enumerate() {
                    *p = seq.iter().take_while(|&&s| tiers_of(s)[t]).count();
                }
                (n > 0).then_some((w.0, n, per))
            })
            .collect()
    }

    /// Per worker with a positive score: Σ over its leading blocks of the best tier weight.
    fn weighted(&self, h: &BlockHasher, local: &[u64], w: &TierWeights) -> Vec<(u64, f64)> {
        let seq = h.chain_local(local);
        self.find(h, local)
            .into_iter()
            .map(|(wid, n, _)| {
                let m = &self.workers[&WorkerId(wid)];
                let sum = seq[..n]
                    .iter()
                    .map(|&s| {
                        Tier::ALL
                            .iter()
                            .filter(|t| m.values().any(|x| x.0 == s && x.1[t.index()] > 0))
                            .map(|&t| w.weight(t))
                            .fold(f64::NEG_INFINITY, f64::max)
                    })
                    .sum();
                (wid, sum)
            })
            .collect()
    }

    fn find_matches(&self, h: &BlockHasher, local: &[u64]) -> Vec<(u64, usize)> {
        self.find(h, local)
            .into_iter()
            .map(|(w, n, _)| (w, n))
            .collect()
    }
}

fn detailed(s: &OverlapScores) -> Vec<(u64, usize, [usize; 4])> {
    s.overlaps()
        .map(|(w, o)| (w.0, o.blocks, o.per_tier))
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    Event(u64, KvEvent),
    EventIn(u64, Tier, KvEvent),
    RemoveWorker(u64),
}

fn tier_strategy() -> impl Strategy<Value = Tier> {
    prop_oneof![
        Just(Tier::Gpu),
        Just(Tier::Cpu),
        Just(Tier::Disk),
        Just(Tier::Other)
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let block = (0u64..10, 0u64..4).prop_map(|(engine_hash, local_hash)| StoredBlock {
        engine_hash,
        local_hash,
    });
    let event = prop_oneof![
        4 => (proptest::option::weighted(0.6, 0u64..10), proptest::collection::vec(block, 0..5))
            .prop_map(|(parent, blocks)| KvEvent::Stored { parent, blocks }),
        2 => proptest::collection::vec(0u64..10, 0..4)
            .prop_map(|engine_hashes| KvEvent::Removed { engine_hashes }),
        1 => Just(KvEvent::Cleared),
    ];
    prop_oneof![
        8 => (0u64..3, event.clone()).prop_map(|(w, e)| Op::Event(w, e)),
        4 => (0u64..3, tier_strategy(), event).prop_map(|(w, t, e)| Op::EventIn(w, t, e)),
        1 => (0u64..3).prop_map(Op::RemoveWorker),
    ]
}

proptest! {
    // 256 cases by default; `PROPTEST_CASES` overrides.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn matches_sequential_model(
        ops in proptest::collection::vec(op_strategy(), 1..60),
        queries in proptest::collection::vec(proptest::collection::vec(0u64..4, 0..6), 6),
    ) {
        let h = BlockHasher::new(16);
        let index = BlockIndex::new();
        let mut model = Model::default();
        for op in &ops {
            match op {
                Op::Event(w, ev) => {
                    let got = index.apply(WorkerId(*w), ev.clone()).map_err(|_| ());
                    let want = model.apply(&h, WorkerId(*w), ev);
                    prop_assert_eq!(got, want, "{:?}", op);
                }
                Op::EventIn(w, t, ev) => {
                    let got = index.apply_in(WorkerId(*w), *t, ev.clone()).map_err(|_| ());
                    let want = model.apply_in(&h, WorkerId(*w), *t, ev);
                    prop_assert_eq!(got, want, "{:?}", op);
                }
                Op::RemoveWorker(w) => {
                    let want = model.workers.remove(&WorkerId(*w)).map_or(0, |m| m.len());
                    prop_assert_eq!(index.remove_worker(WorkerId(*w)), want);
                }
            }
            for q in &queries {
                prop_assert_eq!(detailed(&index.find_matches(q)), model.find(&h, q), "{:?}", q);
                let w = TierWeights { gpu: 0.7, cpu: 0.9, disk: 0.2, other: 0.5 };
                let got = index.find_matches_weighted(q, &w);
                for (wid, want) in model.weighted(&h, q, &w) {
                    let g = got.weighted(WorkerId(wid));
                    prop_assert!((g - want).abs() < 1e-9, "{} vs {} for {}", g, want, wid);
                }
            }
            let mut total = 0;
            for w in 0..3 {
                let n = model.workers.get(&WorkerId(w)).map_or(0, |m| m.len());
                total += n;
                prop_assert_eq!(index.block_count(WorkerId(w)), n);
            }
            prop_assert_eq!(index.total_blocks(), total);
            prop_assert_eq!(index.workers(), model.workers.keys().copied().collect::<Vec<_>>());
        }
        let st = index.stats();
        prop_assert_eq!(st.unknown_parents, model.unknown_parents);
        prop_assert_eq!(st.unknown_removes, model.unknown_removes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// The same model check with worker slots past the inline bitset (`fillers` workers
    /// registered first, each holding one unrelated block), so the holder sets take every form
    /// (bitset, pair, dense and sparse out-of-line sets) and lookups every scan mode.
    #[test]
    #[cfg_attr(miri, ignore)]
    fn matches_sequential_model_with_many_workers(
        fillers in 0u64..140,
        filler_tier in tier_strategy(),
        shared_fillers in proptest::bool::ANY,
        ops in proptest::collection::vec(many_worker_op(), 1..80),
        queries in proptest::collection::vec(proptest::collection::vec(0u64..4, 0..6), 4),
    ) {
        let h = BlockHasher::new(16);
        let index = BlockIndex::new();
        let mut model = Model::default();
        // Fillers hold either unrelated blocks, or (`shared_fillers`) a prefix of the queries'
        // blocks, all in one tier: holder sets with many holders sharing a tier mask.
        for f in 0..fillers {
            let local = if shared_fillers { f % 3 } else { 1_000 + f };
            let ev = KvEvent::Stored {
                parent: None,
                blocks: vec![StoredBlock { engine_hash: 1, local_hash: local }],
            };
            index.apply_in(WorkerId(1_000 + f), filler_tier, ev.clone()).unwrap();
            model.apply_in(&h, WorkerId(1_000 + f), filler_tier, &ev).unwrap();
        }
        for op in &ops {
            match op {
                Op::Event(w, ev) => {
                    let got = index.apply(WorkerId(*w), ev.clone()).map_err(|_| ());
                    let want = model.apply(&h, WorkerId(*w), ev);
                    prop_assert_eq!(got, want, "{:?}", op);
                }
                Op::EventIn(w, t, ev) => {
                    let got = index.apply_in(WorkerId(*w), *t, ev.clone()).map_err(|_| ());
                    let want = model.apply_in(&h, WorkerId(*w), *t, ev);
                    prop_assert_eq!(got, want, "{:?}", op);
                }
                Op::RemoveWorker(w) => {
                    let want = model.workers.remove(&WorkerId(*w)).map_or(0, |m| m.len());
                    prop_assert_eq!(index.remove_worker(WorkerId(*w)), want);
                }
            }
            for q in &queries {
                prop_assert_eq!(detailed(&index.find_matches(q)), model.find(&h, q), "{:?}", q);
                let w = TierWeights { gpu: 0.7, cpu: 0.9, disk: 0.2, other: 0.5 };
                let got = index.find_matches_weighted(q, &w);
                for (wid, want) in model.weighted(&h, q, &w) {
                    let g = got.weighted(WorkerId(wid));
                    prop_assert!((g - want).abs() < 1e-9, "{} vs {} for {}", g, want, wid);
                }
                let seq = h.chain_local(q);
                prop_assert_eq!(scores(&index.find_matches_seq(&seq)), model.find_matches(&h, q));
            }
            let total: usize = model.workers.values().map(|m| m.len()).sum();
            prop_assert_eq!(index.total_blocks(), total);
            prop_assert_eq!(index.workers(), model.workers.keys().copied().collect::<Vec<_>>());
        }
    }
}

fn many_worker_op() -> impl Strategy<Value = Op> {
    let block = (0u64..10, 0u64..4).prop_map(|(engine_hash, local_hash)| StoredBlock {
        engine_hash,
        local_hash,
    });
    let event = prop_oneof![
        5 => (proptest::option::weighted(0.5, 0u64..10), proptest::collection::vec(block, 0..5))
            .prop_map(|(parent, blocks)| KvEvent::Stored { parent, blocks }),
        2 => proptest::collection::vec(0u64..10, 0..4)
            .prop_map(|engine_hashes| KvEvent::Removed { engine_hashes }),
        1 => Just(KvEvent::Cleared),
    ];
    prop_oneof![
        10 => (0u64..8, event.clone()).prop_map(|(w, e)| Op::Event(w, e)),
        6 => (0u64..8, tier_strategy(), event).prop_map(|(w, t, e)| Op::EventIn(w, t, e)),
        1 => (0u64..8).prop_map(Op::RemoveWorker),
    ]
}

// ---------------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------------

/// A deterministic event script for worker `w`, each event with the tier it applies to:
/// stores and removes blocks of shared chains (`1..=40`) and of chains only `w` ever stores
/// (`w * 1000 + ...`), long enough to span several of the writer's chunks. Each block's engine
/// hash is drawn from two per position (`+ 100`), so two engine hashes of one worker often map
/// to one sequence hash (aliases); engine hashes are re-stored with other contents (the local
/// hashes `+ 500`), sometimes in another tier; and tiers or everything are sometimes cleared.
fn script(w: u64, len: usize) -> Vec<(Tier, KvEvent)> {
    let mut r = SplitMix64::new(w + 1);
    let mut pick = SplitMix64::new(w + 100);
    let mut out = Vec::with_capacity(len);
    for _ in 0..len {
        let base = if r.below(2) == 0 { 0 } else { w * 1000 };
        let k = 1 + if r.below(4) == 0 {
            r.below(40)
        } else {
            r.below(6)
        };
        let tier = if r.below(5) == 0 {
            Tier::Cpu
        } else {
            Tier::Gpu
        };
        let other = if r.below(8) == 0 { 500 } else { 0 };
        let mut engine = |i: u64| base + i + 100 * pick.below(2);
        out.push(match r.below(10) {
            0..=5 => (
                tier,
                KvEvent::Stored {
                    parent: None,
                    blocks: (1..=k)
                        .map(|i| StoredBlock {
                            engine_hash: engine(i),
                            local_hash: base + i + other,
                        })
                        .collect(),
                },
            ),
            6..=8 => (
                tier,
                KvEvent::Removed {
                    engine_hashes: (k.saturating_sub(2).max(1)..=k).map(engine).collect(),
                },
            ),
            _ => (tier, KvEvent::Cleared),
        });
    }
    out
}

#[test]
fn concurrent_writers_and_readers_match_sequential_replay() {
    let workers = 4u64;
    let len = if cfg!(miri) { 16 } else { 10_000 };
    let scripts: Vec<Vec<(Tier, KvEvent)>> = (1..=workers).map(|w| script(w, len)).collect();
    let index = Arc::new(BlockIndex::new());
    let done = Arc::new(AtomicBool::new(false));

    let readers: Vec<_> = (0..2)
        .map(|_| {
            let index = Arc::clone(&index);
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let shared: Vec<u64> = (1..=40).collect();
                let mut out = OverlapScores::new();
                let mut lookups = 0u64;
                loop {
                    let finished = done.load(Ordering::Acquire);
                    index.find_matches_into(&shared, &mut out);
                    for (w, n) in out.iter() {
                        assert!((1..=workers).contains(&w.0), "unknown worker {w:?}");
                        assert!((1..=40).contains(&n));
                    }
                    for w in 1..=workers {
                        // A chain only worker `w` stores is attributed to `w` alone.
                        let own: Vec<u64> = (1..=40).map(|i| w * 1000 + i).collect();
                        index.find_matches_into(&own, &mut out);
                        assert!(out.iter().all(|(x, _)| x == WorkerId(w)), "{out:?}");
                    }
                    lookups += 1;
                    if finished {
                        return lookups;
                    }
                }
            })
        })
        .collect();

    let writers: Vec<_> = scripts
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let index = Arc::clone(&index);
            let s = s.clone();
            let w = WorkerId(i as u64 + 1);
            std::thread::spawn(move || {
                for (j, (tier, ev)) in s.into_iter().enumerate() {
                    index.apply_in(w, tier, ev).unwrap();
                    if j % (len / 4) == len / 8 {
                        // Exercise slot release and reuse under concurrent readers.
                        index.remove_worker(w);
                    }
                }
            })
        })
        .collect();
    for t in writers {
        t.join().unwrap();
    }
    done.store(true, Ordering::Release);
    for t in readers {
        assert!(t.join().unwrap() > 0);
    }

    let replay = BlockIndex::new();
    for (i, s) in scripts.iter().enumerate() {
        let w = WorkerId(i as u64 + 1);
        for (j, (tier, ev)) in s.iter().enumerate() {
            replay.apply_in(w, *tier, ev.clone()).unwrap();
            if j % (len / 4) == len / 8 {
                replay.remove_worker(w);
            }
        }
    }
    assert_eq!(index.workers(), replay.workers());
    assert_eq!(index.total_blocks(), replay.total_blocks());
    assert_eq!(index.distinct_blocks(), replay.distinct_blocks());
    assert_eq!(index.stats(), replay.stats());
    index.check_invariants().unwrap();
    for w in 0..=workers {
        assert_eq!(
            index.block_count(WorkerId(w)),
            replay.block_count(WorkerId(w))
        );
        for base in [0, w * 1000] {
            for n in 1..=40 {
                let q: Vec<u64> = (1..=n).map(|i| base + i).collect();
                assert_eq!(index.find_matches(&q), replay.find_matches(&q), "{q:?}");
            }
        }
    }
}

#[test]
fn readers_see_a_stable_prefix_while_the_table_grows() {
    // A chain stored before the readers start must stay fully visible while a writer grows
    // the table (RCU swaps) and churns other keys.
    let index = Arc::new(BlockIndex::new());
    let chain: Vec<u64> = (1..=20).collect();
    index.apply(A, stored(None, &chain)).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let index = Arc::clone(&index);
        let done = Arc::clone(&done);
        let chain = chain.clone();
        std::thread::spawn(move || {
            let mut out = OverlapScores::new();
            while !done.load(Ordering::Acquire) {
                index.find_matches_into(&chain, &mut out);
                assert_eq!(out.get(A), 20);
            }
        })
    };
    let n = if cfg!(miri) { 50 } else { 20_000 };
    for round in 0..4u64 {
        let locals: Vec<u64> = (0..n).map(|i| 1_000_000 * (round + 1) + i).collect();
        index
            .apply(
                B,
                KvEvent::Stored {
                    parent: None,
                    blocks: locals
                        .iter()
                        .map(|&l| StoredBlock {
                            engine_hash: l,
                            local_hash: l,
                        })
                        .collect(),
                },
            )
            .unwrap();
        index.apply(B, KvEvent::Cleared).unwrap();
    }
    done.store(true, Ordering::Release);
    reader.join().unwrap();
    assert_eq!(index.find_matches(&chain).get(A), 20);
}

#[test]
fn dynamo_medium_names_map_to_their_tiers() {
    // NVIDIA Dynamo's `StorageTier::from_kv_medium`: CPU_TIER1 is host memory, CPU_TIER2 disk.
    assert_eq!(Tier::from_medium(Some("CPU_TIER1")), Tier::Cpu);
    assert_eq!(Tier::from_medium(Some("CPU_TIER2")), Tier::Disk);
    assert_eq!(Tier::from_medium(Some("CPU_PINNED")), Tier::Cpu);
    assert_eq!(Tier::from_medium(Some("DEVICE")), Tier::Gpu);
    assert_eq!(Tier::from_medium(Some("NVME")), Tier::Disk);
    assert_eq!(Tier::from_medium(Some("EXTERNAL")), Tier::Other);
}
