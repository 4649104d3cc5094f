//! Inspection: sizes, counters, heap bytes, the invariant checker (feature `testing`), and
//! the snapshot support `persist.rs` builds on.

use super::workers::{Alias, Held, WorkerBlocks, ONE_GPU};
use super::write::{Ctx, PREFETCH_AHEAD, STORE_CHUNK};
use super::{BlockIndex, IndexStats, TIERS};
use crate::blocks::event::WorkerId;
use crate::blocks::table::Table;
use crate::reclaim;
use crate::sync::{lock, read, write, Mutex};

impl BlockIndex {
    // ----------------------------------------------------------------------------------------
    // Introspection
    // ----------------------------------------------------------------------------------------

    /// Blocks (engine hashes) `worker` holds.
    pub fn block_count(&self, worker: WorkerId) -> usize {
        read(&self.registry)
            .workers
            .get(&worker)
            .map_or(0, |wb| lock(wb).len())
    }

    /// Σ over workers of the blocks each holds.
    pub fn total_blocks(&self) -> usize {
        lock(&self.tally).blocks.max(0) as usize
    }

    /// Distinct sequence hashes held by at least one worker.
    pub fn distinct_blocks(&self) -> usize {
        lock(&self.tables).live
    }

    /// Known workers (those with a successful `Stored` event and not removed), sorted.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut v: Vec<WorkerId> = read(&self.registry).workers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Event counters.
    pub fn stats(&self) -> IndexStats {
        lock(&self.tally).stats
    }

    /// Heap bytes owned by the index: the current table, its out-of-line holder sets and slot
    /// names, and the writer's bookkeeping (hash maps estimated from their capacities).
    /// Retired tables and sets that the reclaimer has not freed yet are not counted.
    pub fn heap_bytes(&self) -> usize {
        let reg = read(&self.registry);
        let side = lock(&self.tables);
        let guard = reclaim::pin();
        let table = self.load_table(&guard);
        let mut bytes = core::mem::size_of::<Table>() + table.heap_bytes();
        bytes += side.ledger.live_bytes;
        bytes += self.names.load(&guard).heap_bytes();
        bytes += side.scratch.heap_bytes();
        drop(side);
        // hashbrown: one control byte per bucket plus the entry; capacity ≈ 7/8 of buckets.
        let hm = |cap: usize, entry: usize| cap * 8 / 7 * (entry + 1);
        bytes += hm(
            reg.workers.capacity(),
            core::mem::size_of::<(WorkerId, Mutex<WorkerBlocks>)>(),
        );
        for wb in reg.workers.values() {
            let wb = lock(wb);
            bytes += wb.simple.heap_bytes()
                + wb.multi.heap_bytes()
                + hm(wb.aliases.capacity(), core::mem::size_of::<(u64, Alias)>());
        }
        bytes += lock(&self.free_slots).capacity() * 4;
        bytes
    }

    /// Pushes this thread's retired tables and snapshots to the reclaimer and lets it free
    /// whatever no pinned reader can still hold (useful before measuring memory, and in tests).
    pub fn collect_garbage(&self) {
        let guard = reclaim::pin();
        reclaim::flush(&guard);
    }

    /// Current table capacity, for tests (unit tests and the loom models).
    #[cfg(any(test, loom))]
    #[doc(hidden)]
    pub fn table_cap(&self) -> usize {
        let guard = reclaim::pin();
        self.load_table(&guard).cap()
    }
}

// --------------------------------------------------------------------------------------------
// Snapshot support (the format lives in `persist.rs`)
// --------------------------------------------------------------------------------------------

/// Copies per tier of one block in a snapshot.
pub(in crate::blocks) type TierCopies = [u8; TIERS];

impl BlockIndex {
    /// The known workers in slot order, and the event counters, read together.
    pub(in crate::blocks) fn snapshot_workers(&self) -> (Vec<WorkerId>, IndexStats) {
        // Exclusive: no event is half-applied, so the counters match the workers.
        let reg = write(&self.registry);
        let mut v: Vec<(u32, WorkerId)> = reg
            .workers
            .iter()
            .map(|(&k, wb)| (lock(wb).slot, k))
            .collect();
        v.sort_unstable();
        (
            v.into_iter().map(|(_, k)| k).collect(),
            lock(&self.tally).stats,
        )
    }

    /// `worker`'s blocks, read under its lock (one consistent state of the worker):
    /// those held as exactly one GPU copy into `simple` as `(engine hash, sequence hash)`, the
    /// others into `multi` with their copies per tier; both cleared first, in no particular
    /// order. False (and both empty) if the worker is not known.
    pub(in crate::blocks) fn worker_blocks_into(
        &self,
        worker: WorkerId,
        simple: &mut Vec<(u64, u64)>,
        multi: &mut Vec<(u64, u64, TierCopies)>,
    ) -> bool {
        simple.clear();
        multi.clear();
        let reg = read(&self.registry);
        let Some(wb) = reg.workers.get(&worker) else {
            return false;
        };
        let wb = lock(wb);
        simple.reserve(wb.simple.len());
        simple.extend(wb.simple.iter());
        multi.reserve(wb.multi.len());
        multi.extend(wb.multi.iter().map(|(e, h)| (e, h.seq, h.copies)));
        true
    }

    /// Restore: adds `worker` (no blocks yet) in the next free slot. The index must not be
    /// shared yet.
    pub(in crate::blocks) fn restore_worker(&self, worker: WorkerId) -> Result<(), String> {
        let mut reg = write(&self.registry);
        let guard = reclaim::pin();
        if reg.workers.contains_key(&worker) {
            return Err(format!(
                "worker {} (engine {}, rank {}) appears twice",
                worker.0,
                worker.engine(),
                worker.dp_rank()
            ));
        }
        self.register(&mut reg, worker, &guard)
            .map_err(|e| e.to_string())
    }

    /// Restore: gives `worker` (added by [`Self::restore_worker`]) the blocks `blocks`, each
    /// `(engine hash, sequence hash, copies per tier)`, exactly as the events that left it
    /// holding them would have. An engine hash the worker already holds, or one without any
    /// copy, is an error (the index then holds part of the blocks, and is to be dropped).
    pub(in crate::blocks) fn restore_blocks(
        &self,
        worker: WorkerId,
        blocks: &[(u64, u64, TierCopies)],
    ) -> Result<(), String> {
        let reg = read(&self.registry);
        let guard = reclaim::pin();
        let wb = &mut *lock(
            reg.workers
                .get(&worker)
                .ok_or_else(|| format!("blocks for worker {} before its record", worker.0))?,
        );
        let mut side = lock(&self.tables);
        let mut d = super::workers::Tally::default();
        // Room for the batch up front, growing by doubling (restores are bulk loads). Both are
        // bounded by the batch, whose bytes were read.
        let n = blocks.len();
        let gpu = blocks.iter().filter(|b| b.2 == ONE_GPU).count();
        wb.simple.reserve(gpu);
        wb.multi.reserve(n - gpu);
        if !self.load_table(&guard).has_room(side.used + n) {
            let cap = Table::cap_for((side.live + n).max(side.live * 2));
            self.rebuild(&mut side, cap, &guard);
        }
        let mut cx = Ctx {
            index: self,
            side: &mut side,
            guard: &guard,
        };
        let mut result = Ok(());
        // In chunks: the mappings first (prefetching map slots a few blocks ahead), then the
        // table holders (prefetched in the first pass), as `store` does.
        'chunks: for chunk in blocks.chunks(STORE_CHUNK) {
            let mut done = 0;
            for (i, &(e, seq, copies)) in chunk.iter().enumerate() {
                if let Some(ahead) = chunk.get(i + PREFETCH_AHEAD) {
                    wb.simple.prefetch(ahead.0);
                }
                if copies == [0; TIERS] {
                    result = Err(format!("engine hash {e:#x} has no copy in any tier"));
                } else if wb.seq_of(e).is_some() {
                    result = Err(format!(
                        "engine hash {e:#x} appears twice for worker {}",
                        worker.0
                    ));
                }
                if result.is_err() {
                    break;
                }
                wb.put(e, Held { seq, copies });
                d.blocks += 1;
                cx.table().prefetch(seq);
                done += 1;
            }
            for &(_, seq, copies) in &chunk[..done] {
                let mut new_mapping = true;
                for (k, &c) in copies.iter().enumerate() {
                    if c > 0 {
                        cx.first_copy(wb, seq, 1 << k, new_mapping);
                        new_mapping = false;
                    }
                }
            }
            if result.is_err() {
                break 'chunks;
            }
        }
        cx.side.ledger.retire(&guard);
        drop(side);
        self.merge_tally(&d);
        result
    }

    /// Restore: gives back the room the batches reserved ahead (the table and the maps end
    /// at the load an index built by events settles at).
    pub(in crate::blocks) fn restore_finish(&self) {
        let reg = write(&self.registry);
        let guard = reclaim::pin();
        for wb in reg.workers.values() {
            let mut wb = lock(wb);
            wb.simple.shrink_to_target();
            wb.multi.shrink_to_target();
        }
        let mut side = lock(&self.tables);
        let cap = Table::cap_for(side.live);
        if self.load_table(&guard).cap() > cap {
            self.rebuild(&mut side, cap, &guard);
        }
        side.ledger.retire(&guard);
    }

    /// Restore: sets the event counters.
    pub(in crate::blocks) fn restore_stats(&self, stats: IndexStats) {
        lock(&self.tally).stats = stats;
    }

    /// Checks that the writer's bookkeeping and the shared table agree (test support,
    /// feature `testing`; O(blocks), takes every writer lock): every worker has its own slot,
    /// named in the slot directory; no engine hash is in both per-worker maps, none without a
    /// copy, none held as one GPU copy outside the compact map; the sequence hashes several
    /// engine hashes map to are exactly the aliases, with the right counts; the table holds
    /// exactly, per `(sequence hash, worker)`, the tiers some engine hash of the worker
    /// mapping to it has a copy in; and the block and live-key counters match.
    #[cfg(all(any(test, feature = "testing"), not(loom)))]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn check_invariants(&self) -> Result<(), String> {
        use std::collections::{HashMap, HashSet};
        // Exclusive: no event is half-applied (and no worker lock is held elsewhere).
        let reg = write(&self.registry);
        let guard = reclaim::pin();
        let names = self.names.load(&guard);
        let table = self.load_table(&guard);
        let mut expected: HashMap<(u64, u32), u8> = HashMap::new();
        let mut slots = HashSet::new();
        let mut total = 0usize;
        for (&worker, wb) in &reg.workers {
            let wb = lock(wb);
            let id = worker.0;
            if wb.slot >= reg.slots {
                return Err(format!(
                    "worker {id}: slot {} was never handed out",
                    wb.slot
                ));
            }
            if !slots.insert(wb.slot) {
                return Err(format!("slot {} belongs to two workers", wb.slot));
            }
            if names.get(wb.slot) != Some(worker) {
                return Err(format!(
                    "worker {id}: the directory misnames slot {}",
                    wb.slot
                ));
            }
            // Per sequence hash: engine hashes mapping to it, and those with a copy per tier.
            let mut per_seq: HashMap<u64, (u32, [u32; TIERS])> = HashMap::new();
            for (e, seq) in wb.simple.iter() {
                if wb.multi.get(e).is_some() {
                    return Err(format!("worker {id}: engine hash {e:#x} is in both maps"));
                }
                let x = per_seq.entry(seq).or_default();
                x.0 += 1;
                x.1[0] += 1;
            }
            for (e, h) in wb.multi.iter() {
                if h.copies == [0; TIERS] || h.copies == ONE_GPU {
                    return Err(format!(
                        "worker {id}: engine hash {e:#x} has copies {:?} in the wide map",
                        h.copies
                    ));
                }
                let x = per_seq.entry(h.seq).or_default();
                x.0 += 1;
                for (k, &c) in h.copies.iter().enumerate() {
                    x.1[k] += u32::from(c > 0);
                }
            }
            total += wb.len();
            let mut aliased = 0;
            for (&seq, &(n, tiers)) in &per_seq {
                let mut mask = 0u8;
                for (k, &c) in tiers.iter().enumerate() {
                    if c > 0 {
                        mask |= 1 << k;
                    }
                }
                expected.insert((seq, wb.slot), mask);
                match wb.aliases.get(&seq) {
                    Some(a) if n >= 2 && a.engines == n && a.tiers == tiers => aliased += 1,
                    None if n < 2 => {}
                    a => {
                        return Err(format!(
                            "worker {id}: sequence hash {seq:#x} has {n} engine hashes \
                             ({tiers:?} per tier) but alias {a:?}"
                        ))
                    }
                }
            }
            if aliased != wb.aliases.len() {
                return Err(format!("worker {id}: stray aliases"));
            }
        }
        // Lock order: workers (above, one at a time), then the table side, then the tally.
        let side = lock(&self.tables);
        let tally = *lock(&self.tally);
        if total as isize != tally.blocks {
            return Err(format!(
                "total_blocks is {}, the workers hold {total}",
                tally.blocks
            ));
        }
        let live = table.live_entries();
        let mut found = 0usize;
        for (key, holders) in &live {
            for &(slot, tiers) in holders {
                match expected.get(&(*key, slot)) {
                    Some(&m) if m == tiers => found += 1,
                    m => {
                        return Err(format!(
                            "the table has slot {slot} holding {key:#x} in tiers {tiers:#b}, \
                             the bookkeeping {m:?}"
                        ))
                    }
                }
            }
        }
        if found != expected.len() {
            return Err(format!(
                "the table names {found} (block, worker) holders, the bookkeeping {}",
                expected.len()
            ));
        }
        if live.len() != side.live {
            return Err(format!(
                "the live-key counter is {}, the table has {}",
                side.live,
                live.len()
            ));
        }
        Ok(())
    }
}
