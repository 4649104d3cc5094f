//! The worker registry: per-worker bookkeeping (engine hash → sequence hash and copies),
//! slots handed out and released after a grace period, clearing and removing workers.

use super::write::Ctx;
use super::{BlockIndex, EventError, IndexStats, ALL_TIERS, TIERS};
use crate::blocks::event::{Tier, WorkerId};
use crate::blocks::map::EngineMap;
use crate::blocks::table::{RemoveOutcome, Scratch, SetLedger, GPU, MAX_SLOTS};
use crate::reclaim::{self, Guard};
use crate::sync::{lock, read, write, Arc, Mutex, RwLockReadGuard};
use std::collections::HashMap;

/// The release of a removed worker's slot, deferred through the reclaimer (see the module
/// docs, "Worker slots").
pub(super) struct SlotRelease {
    pub(super) slot: u32,
    pub(super) free: Arc<Mutex<Vec<u32>>>,
}

/// Destructor of a retired [`SlotRelease`]: returns the slot to the free list.
///
/// # Safety
///
/// `p` must come from `Box::into_raw` and be passed exactly once.
pub(super) unsafe fn release_slot(p: *mut SlotRelease) {
    // Safety: forwarded to the caller.
    let token = unsafe { Box::from_raw(p) };
    lock(&token.free).push(token.slot);
}

/// Copies of one engine hash per tier; each saturates at [`MAX_COPIES`].
pub(super) type Copies = [u8; TIERS];

/// Most copies of one block counted per (worker, engine hash, tier): a store beyond it is
/// counted in [`IndexStats::copies_saturated`] and otherwise ignored, so a stream that
/// re-announces a block without ever removing it cannot make it unremovable.
pub const MAX_COPIES: u8 = u8::MAX;

/// A block held other than as exactly one GPU copy.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Held {
    pub(super) seq: u64,
    pub(super) copies: Copies,
}

/// The copies of a block held once, on the GPU.
pub(super) const ONE_GPU: Copies = [1, 0, 0, 0];

/// A sequence hash that several engine hashes of one worker map to.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Alias {
    /// Engine hashes mapping to it (at least 2).
    pub(super) engines: u32,
    /// Per tier, how many of them have a copy there.
    pub(super) tiers: [u32; TIERS],
}

/// One worker's writer-side bookkeeping.
///
/// Copies are counted per engine hash and tier (a block stored twice in one tier, e.g. by two
/// requests computing it at once, needs two removals). The table's tier bit for `(worker,
/// seq)` is set while some engine hash mapping to `seq` has a copy in that tier: with one
/// such engine hash (the usual case) that is its own count; for the rare sequence hash that
/// several engine hashes map to, `aliases` counts, per tier, those with a copy.
pub(super) struct WorkerBlocks {
    pub(super) slot: u32,
    /// Engine hash → sequence hash, for blocks held as exactly one GPU copy (the common case;
    /// 16 bytes a slot).
    pub(super) simple: EngineMap,
    /// Engine hash → every other block: several copies, or tiers other than the GPU (24
    /// bytes a slot).
    pub(super) multi: EngineMap<Held>,
    /// Sequence hashes several engine hashes of this worker map to.
    pub(super) aliases: HashMap<u64, Alias>,
}

impl WorkerBlocks {
    pub(super) fn new(slot: u32) -> Self {
        WorkerBlocks {
            slot,
            simple: EngineMap::default(),
            multi: EngineMap::default(),
            aliases: HashMap::new(),
        }
    }

    /// Engine hashes held (in any tier).
    pub(super) fn len(&self) -> usize {
        self.simple.len() + self.multi.len()
    }

    /// The sequence hash engine hash `e` maps to, if the worker holds it in any tier.
    pub(super) fn seq_of(&self, e: u64) -> Option<u64> {
        match self.simple.get(e) {
            Some(s) => Some(s),
            None if self.multi.is_empty() => None,
            None => self.multi.get(e).map(|h| h.seq),
        }
    }

    /// The copies of `e`, if held.
    pub(super) fn held(&self, e: u64) -> Option<Held> {
        match self.simple.get(e) {
            Some(seq) => Some(Held {
                seq,
                copies: ONE_GPU,
            }),
            None if self.multi.is_empty() => None,
            None => self.multi.get(e),
        }
    }

    /// Records `e` as held `h` (in the compact map when it is one GPU copy; forgotten when no
    /// copy is left).
    pub(super) fn put(&mut self, e: u64, h: Held) {
        if h.copies == ONE_GPU {
            if !self.multi.is_empty() {
                self.multi.remove(e);
            }
            self.simple.insert(e, h.seq);
        } else {
            self.simple.remove(e);
            if h.copies == [0; TIERS] {
                self.multi.remove(e);
            } else {
                self.multi.insert(e, h);
            }
        }
    }
}

/// The worker registry, behind `BlockIndex::registry`: shared by every event, exclusive to
/// add or remove a worker.
pub(super) struct Registry {
    /// Each known worker's bookkeeping behind its own lock (taken after the registry, before
    /// the table side).
    pub(super) workers: HashMap<WorkerId, Mutex<WorkerBlocks>>,
    /// Slots handed out so far (free ones are on `free_slots` after their grace period).
    pub(super) slots: u32,
}

/// The table-side writer state, behind `BlockIndex::tables`: whoever holds it is the only
/// thread changing the shared table.
pub(super) struct TableSide {
    /// Non-empty slots of the current table (live + dead).
    pub(super) used: usize,
    /// Keys of the current table with at least one holder.
    pub(super) live: usize,
    pub(super) ledger: SetLedger,
    pub(super) scratch: Scratch,
}

/// Event counters: the index's totals behind `BlockIndex::tally`, and one event's changes,
/// merged into them once per event.
#[derive(Clone, Copy, Default)]
pub(super) struct Tally {
    /// Σ over workers of blocks held (a change, for one event's tally).
    pub(super) blocks: isize,
    pub(super) stats: IndexStats,
}

impl Tally {
    /// Adds one event's changes.
    pub(super) fn merge(&mut self, d: &Tally) {
        self.blocks += d.blocks;
        let (s, x) = (&mut self.stats, &d.stats);
        s.events_applied += x.events_applied;
        s.blocks_stored += x.blocks_stored;
        s.blocks_removed += x.blocks_removed;
        s.unknown_parents += x.unknown_parents;
        s.unknown_removes = s.unknown_removes.saturating_add(x.unknown_removes);
        s.rejected_workers += x.rejected_workers;
        s.duplicate_copies += x.duplicate_copies;
        s.copies_saturated += x.copies_saturated;
    }
}

impl BlockIndex {
    /// Merges one event's counter changes (`d`) into the index's.
    pub(super) fn merge_tally(&self, d: &Tally) {
        lock(&self.tally).merge(d);
    }

    /// Drops every block of `worker`, in every tier; the worker stays registered. No-op for
    /// unknown workers.
    pub fn clear_worker(&self, worker: WorkerId) {
        let guard = reclaim::pin();
        let reg = read(&self.registry);
        let mut d = Tally::default();
        d.stats.events_applied += 1;
        if let Some(wm) = reg.workers.get(&worker) {
            let mut wb = lock(wm);
            let mut side = lock(&self.tables);
            self.drop_all(&mut side, &mut d, &mut wb, &guard);
            self.maybe_shrink(&mut side, &guard);
            side.ledger.retire(&guard);
        }
        self.merge_tally(&d);
    }

    /// Drops every copy `worker` holds in `tier` (its other tiers stay). No-op for unknown
    /// workers.
    pub fn clear_tier(&self, worker: WorkerId, tier: Tier) {
        let guard = reclaim::pin();
        let reg = read(&self.registry);
        let mut d = Tally::default();
        d.stats.events_applied += 1;
        if let Some(wm) = reg.workers.get(&worker) {
            let wb = &mut *lock(wm);
            let mut side = lock(&self.tables);
            let mut cx = Ctx {
                index: self,
                side: &mut side,
                guard: &guard,
            };
            let (t, ti) = (tier.bit(), tier.index());
            if t == GPU {
                let simple = core::mem::take(&mut wb.simple);
                d.blocks -= simple.len() as isize;
                for (_, seq) in simple.iter() {
                    cx.last_copy(wb, seq, GPU);
                    Ctx::unmapped(wb, seq);
                }
            }
            let held: Vec<(u64, Held)> =
                wb.multi.iter().filter(|(_, h)| h.copies[ti] > 0).collect();
            for (e, mut h) in held {
                h.copies[ti] = 0;
                cx.last_copy(wb, h.seq, t);
                if h.copies == [0; TIERS] {
                    Ctx::unmapped(wb, h.seq);
                    d.blocks -= 1;
                }
                wb.put(e, h);
            }
            self.maybe_shrink(&mut side, &guard);
            side.ledger.retire(&guard);
        }
        self.merge_tally(&d);
    }

    /// Removes `worker` and all its blocks; returns the number of blocks it held. Its slot is
    /// reused only after an epoch grace period, so concurrent lookups never attribute its blocks
    /// to a worker added later.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        let guard = reclaim::pin();
        // Exclusive: no event of this worker is half-applied, and none starts until it is gone.
        let mut reg = write(&self.registry);
        let Some(wm) = reg.workers.remove(&worker) else {
            return 0;
        };
        let mut wb = lock(&wm);
        let mut d = Tally::default();
        d.stats.events_applied += 1;
        let n = wb.len();
        let mut side = lock(&self.tables);
        // 1. Clear the worker's holders (every table from now on is built from these words).
        self.drop_all(&mut side, &mut d, &mut wb, &guard);
        // 2. Publish slot names without it (slot names change only under the registry's
        // exclusive lock).
        let slot = wb.slot;
        self.names.set(slot, None, &guard);
        // 3. Defer the slot's release past every reader that may still name it.
        let token = Box::into_raw(Box::new(SlotRelease {
            slot,
            free: Arc::clone(&self.free_slots),
        }));
        // Safety: the token is a fresh heap object no other thread can reach, retired once;
        // `release_slot` only frees it and pushes the slot onto a mutex-protected list, which
        // is sound on any thread.
        unsafe { reclaim::retire(&guard, token, release_slot) };
        self.maybe_shrink(&mut side, &guard);
        side.ledger.retire(&guard);
        drop(side);
        self.merge_tally(&d);
        drop(reg);
        // Removals are rare: push the release to the global queue now, so the slot is reusable
        // after the grace period rather than when this thread's bag fills.
        reclaim::flush(&guard);
        n
    }

    /// Removes every data-parallel rank of `engine` (each worker whose
    /// [`WorkerId::engine`] it is) and their blocks, as when the engine leaves the pool (a
    /// Dynamo worker id names all its ranks); returns the blocks they held. A rank whose first
    /// store races with the call may stay. Like [`WorkerId::new`], it keeps the low 48 bits
    /// of `engine`.
    ///
    /// ```
    /// use kvtrie::blocks::{BlockIndex, KvEvent, StoredBlock, WorkerId};
    /// let index = BlockIndex::new();
    /// for w in [WorkerId::new(7, 0), WorkerId::new(7, 1), WorkerId::new(8, 0)] {
    ///     let blocks = vec![StoredBlock { engine_hash: 1, local_hash: 10 }];
    ///     index.apply(w, KvEvent::Stored { parent: None, blocks }).unwrap();
    /// }
    /// assert_eq!(index.remove_engine(7), 2);
    /// assert_eq!(index.workers(), vec![WorkerId::new(8, 0)]);
    /// ```
    pub fn remove_engine(&self, engine: u64) -> usize {
        let engine = engine & WorkerId::MAX_ENGINE;
        let ranks: Vec<WorkerId> = read(&self.registry)
            .workers
            .keys()
            .copied()
            .filter(|w| w.engine() == engine)
            .collect();
        ranks.into_iter().map(|w| self.remove_worker(w)).sum()
    }

    /// Adds `worker` with a fresh (or recycled) slot, under the registry's exclusive lock.
    pub(super) fn register(
        &self,
        reg: &mut Registry,
        worker: WorkerId,
        guard: &Guard,
    ) -> Result<(), EventError> {
        let recycled = lock(&self.free_slots).pop();
        let slot = match recycled {
            Some(s) => s,
            None if reg.slots < MAX_SLOTS => {
                reg.slots += 1;
                reg.slots - 1
            }
            None => return Err(EventError::TooManyWorkers { worker }),
        };
        // Publish the name before any holder of the slot is set.
        self.names.set(slot, Some(worker), guard);
        reg.workers
            .insert(worker, Mutex::new(WorkerBlocks::new(slot)));
        Ok(())
    }

    /// The registry, shared, after registering `worker` if `add` and it was not there.
    /// `Err` only if it had to be added and the index is full of workers. Registration is one
    /// pass: a `remove_worker` between it and the shared lock leaves the worker out of the
    /// registry returned, which the caller reads as the event applied before that removal
    /// (going round again could last as long as another thread kept removing it).
    pub(super) fn registry_with(
        &self,
        worker: WorkerId,
        add: bool,
        guard: &Guard,
    ) -> Result<RwLockReadGuard<'_, Registry>, EventError> {
        let reg = read(&self.registry);
        if !add || reg.workers.contains_key(&worker) {
            return Ok(reg);
        }
        // Never wait for the exclusive lock while holding the shared one.
        drop(reg);
        {
            let mut reg = write(&self.registry);
            if !reg.workers.contains_key(&worker) {
                self.register(&mut reg, worker, guard)?;
            }
        }
        Ok(read(&self.registry))
    }

    /// Removes every holder of `wb`'s worker (all tiers) and forgets its blocks.
    pub(super) fn drop_all(
        &self,
        side: &mut TableSide,
        d: &mut Tally,
        wb: &mut WorkerBlocks,
        guard: &Guard,
    ) {
        let table = self.load_table(guard);
        let seqs = wb
            .simple
            .iter()
            .map(|(_, s)| s)
            .chain(wb.multi.iter().map(|(_, h)| h.seq));
        for seq in seqs {
            // A sequence hash several engine hashes map to is removed by the first.
            if let RemoveOutcome::Removed { dead: true } =
                table.remove(seq, wb.slot, ALL_TIERS, &mut side.ledger, &mut side.scratch)
            {
                side.live -= 1;
            }
        }
        d.blocks -= wb.len() as isize;
        wb.simple = EngineMap::default();
        wb.multi = EngineMap::default();
        wb.aliases = HashMap::new();
    }
}
