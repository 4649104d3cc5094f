//! Unit tests of the block index.

use super::BlockIndex;
use crate::blocks::event::{StoredBlock, WorkerId};
use crate::blocks::table::{Table, GPU};
use crate::reclaim;
use crate::sync::{lock, read};

fn stored(pairs: &[(u64, u64)]) -> Vec<StoredBlock> {
    pairs
        .iter()
        .map(|&(engine_hash, local_hash)| StoredBlock {
            engine_hash,
            local_hash,
        })
        .collect()
}

#[test]
fn more_than_64_workers() {
    let index = BlockIndex::new();
    let n = if cfg!(miri) { 70 } else { 130 };
    for w in 0..n {
        index
            .store_blocks(WorkerId(w), None, &stored(&[(1, 5), (2, 6)]))
            .unwrap();
        if w % 2 == 0 {
            index
                .store_blocks(WorkerId(w), Some(2), &stored(&[(3, 7)]))
                .unwrap();
        }
    }
    let s = index.find_matches(&[5, 6, 7]);
    assert_eq!(s.len(), n as usize);
    for w in 0..n {
        assert_eq!(s.get(WorkerId(w)), if w % 2 == 0 { 3 } else { 2 });
    }
    assert_eq!(index.total_blocks(), (2 * n + n / 2) as usize);
    // Three distinct blocks, each with one out-of-line set.
    assert_eq!(lock(&index.tables).ledger.live_sets, 3);
}

#[test]
fn bitset_then_list_mode() {
    // Slots 0..62 hold the first block (bitset form); slot 70 holds the first two blocks
    // (the second block's holders spill), slot 3 holds all three.
    let index = BlockIndex::new();
    for w in 0..71u64 {
        let blocks: &[(u64, u64)] = match w {
            3 | 70 => &[(1, 5), (2, 6), (3, 7)],
            _ => &[(1, 5)],
        };
        index
            .store_blocks(WorkerId(w), None, &stored(blocks))
            .unwrap();
    }
    index.remove_blocks(WorkerId(70), &[3]);
    let s = index.find_matches(&[5, 6, 7]);
    assert_eq!(s.len(), 71);
    assert_eq!(s.get(WorkerId(3)), 3);
    assert_eq!(s.get(WorkerId(70)), 2);
    assert_eq!(s.get(WorkerId(0)), 1);
    // Only low slots: bitset all the way.
    let index = BlockIndex::new();
    for w in 0..5u64 {
        index
            .store_blocks(
                WorkerId(w),
                None,
                &stored(&[(1, 5), (2, 6)][..1 + (w as usize % 2)]),
            )
            .unwrap();
    }
    let s = index.find_matches(&[5, 6]);
    assert_eq!(
        s.iter().collect::<Vec<_>>(),
        vec![
            (WorkerId(0), 1),
            (WorkerId(1), 2),
            (WorkerId(2), 1),
            (WorkerId(3), 2),
            (WorkerId(4), 1)
        ]
    );
}

#[test]
fn memory_per_block_does_not_grow_with_workers() {
    // Each of many workers stores one block of its own: the table stays 16 bytes a slot
    // and no out-of-line set is needed (one holder is a pair or a bitset).
    let index = BlockIndex::new();
    let n = if cfg!(miri) { 200 } else { 5_000 };
    for w in 0..n {
        index
            .store_blocks(WorkerId(w), None, &stored(&[(w + 1, w * 7919 + 1)]))
            .unwrap();
    }
    let st = lock(&index.tables);
    assert_eq!(st.ledger.live_sets, 0);
    assert_eq!(st.live, n as usize);
    drop(st);
    for w in (0..n).step_by(97) {
        assert_eq!(index.find_matches(&[w * 7919 + 1]).get(WorkerId(w)), 1);
    }
    let guard = reclaim::pin();
    let table_bytes = index.load_table(&guard).heap_bytes();
    assert!(
        table_bytes <= 16 * Table::cap_for(n as usize) * 2,
        "{table_bytes}"
    );
}

#[test]
fn slot_reuse_waits_for_grace_period() {
    let index = BlockIndex::new();
    index
        .store_blocks(WorkerId(1), None, &stored(&[(1, 5)]))
        .unwrap();
    // A reader pinned across the removal keeps the slot from being recycled.
    let reader = reclaim::pin();
    let names_before = index.names.load(&reader);
    assert_eq!(names_before.get(0), Some(WorkerId(1)));
    assert_eq!(index.remove_worker(WorkerId(1)), 1);
    index
        .store_blocks(WorkerId(2), None, &stored(&[(1, 5)]))
        .unwrap();
    {
        let reg = read(&index.registry);
        assert_eq!(
            lock(&reg.workers[&WorkerId(2)]).slot,
            1,
            "slot 0 not yet reusable"
        );
    }
    // The pinned reader's snapshot still names worker 1 at slot 0, and slot 0 holds nothing.
    assert_eq!(names_before.get(0), Some(WorkerId(1)));
    assert_eq!(index.load_table(&reader).tiers_of(5, 0), 0);
    assert_eq!(index.load_table(&reader).tiers_of(5, 1), GPU);
    drop(reader);
    // Let the reclaimer run the deferred release.
    let mut released = false;
    for _ in 0..if cfg!(miri) { 200 } else { 10_000 } {
        let g = reclaim::pin();
        reclaim::flush(&g);
        drop(g);
        if !lock(&index.free_slots).is_empty() {
            released = true;
            break;
        }
    }
    if released {
        index
            .store_blocks(WorkerId(3), None, &stored(&[(9, 9)]))
            .unwrap();
        let reg = read(&index.registry);
        assert_eq!(lock(&reg.workers[&WorkerId(3)]).slot, 0, "slot 0 recycled");
    }
    assert_eq!(index.find_matches(&[5]).get(WorkerId(1)), 0);
    assert_eq!(index.find_matches(&[5]).get(WorkerId(2)), 1);
}

#[test]
fn grows_purges_and_shrinks() {
    let index = BlockIndex::new();
    let n = if cfg!(miri) { 200 } else { 5_000 };
    let blocks: Vec<StoredBlock> = (0..n)
        .map(|i| StoredBlock {
            engine_hash: i + 1,
            local_hash: i * 7919,
        })
        .collect();
    index.store_blocks(WorkerId(0), None, &blocks).unwrap();
    let cap = index.table_cap();
    assert!(cap * 3 / 4 >= n as usize);
    let w = lock(&index.tables);
    // Local hash 0 (block 0) lives out of line and uses no slot.
    assert_eq!((w.live, w.used), (n as usize, n as usize - 1));
    drop(w);
    index.clear_worker(WorkerId(0));
    assert_eq!(index.table_cap(), crate::blocks::table::MIN_CAP);
    assert_eq!(index.total_blocks(), 0);
    assert!(index.find_matches(&[0]).is_empty());
    // Store and remove repeatedly: dead keys never overfill the table.
    for round in 0..20u64 {
        let b: Vec<StoredBlock> = (0..50u64)
            .map(|i| StoredBlock {
                engine_hash: i + 1,
                local_hash: round * 1000 + i,
            })
            .collect();
        index.store_blocks(WorkerId(0), None, &b).unwrap();
        index.remove_blocks(WorkerId(0), &(1..=50).collect::<Vec<u64>>());
    }
    assert_eq!(lock(&index.tables).live, 0);
}
