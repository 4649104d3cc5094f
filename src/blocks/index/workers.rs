//! The worker registry: per-worker bookkeeping (engine hash → sequence hash and copies),
//! slots handed out and released after a grace period, clearing and removing workers.

use super::write::Ctx;
use super::{BlockIndex, EventError, IndexStats, ALL_TIERS, TIERS};
use crate::blocks::event::{Tier, WorkerId};
use crate::blocks::map::EngineMap;
use crate::blocks::table::{RemoveOutcome, Scratch, SetLedger, GPU, MAX_SLOTS};
use crate::reclaim::{self, Guard};
use crate::sync::{lock, Arc, Mutex};
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

/// Everything writers own, behind the writer mutex.
pub(super) struct Writer {
    pub(super) workers: HashMap<WorkerId, WorkerBlocks>,
    /// Slots handed out so far (free ones are on `free_slots` after their grace period).
    pub(super) slots: u32,
    pub(super) counts: Counts,
    pub(super) ledger: SetLedger,
    pub(super) scratch: Scratch,
}

/// Writer-side counters.
#[derive(Default)]
pub(super) struct Counts {
    /// Non-empty slots of the current table (live + dead).
    pub(super) used: usize,
    /// Keys of the current table with at least one holder.
    pub(super) live: usize,
    /// Σ over workers of blocks held.
    pub(super) total_blocks: usize,
    pub(super) stats: IndexStats,
}

impl BlockIndex {
    /// Drops every block of `worker`, in every tier; the worker stays registered. No-op for
    /// unknown workers.
    pub fn clear_worker(&self, worker: WorkerId) {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let Writer {
            workers,
            counts,
            ledger,
            scratch,
            ..
        } = &mut *w;
        counts.stats.events_applied += 1;
        if let Some(wb) = workers.get_mut(&worker) {
            self.drop_all(counts, ledger, scratch, wb, &guard);
        }
        self.maybe_shrink(counts, &guard);
        ledger.retire(&guard);
    }

    /// Drops every copy `worker` holds in `tier` (its other tiers stay). No-op for unknown
    /// workers.
    pub fn clear_tier(&self, worker: WorkerId, tier: Tier) {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let Writer {
            workers,
            counts,
            ledger,
            scratch,
            ..
        } = &mut *w;
        counts.stats.events_applied += 1;
        if let Some(wb) = workers.get_mut(&worker) {
            let mut cx = Ctx {
                index: self,
                counts,
                ledger,
                scratch,
                guard: &guard,
            };
            let (t, ti) = (tier.bit(), tier.index());
            if t == GPU {
                let simple = core::mem::take(&mut wb.simple);
                cx.counts.total_blocks -= simple.len();
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
                    cx.counts.total_blocks -= 1;
                }
                wb.put(e, h);
            }
        }
        self.maybe_shrink(counts, &guard);
        ledger.retire(&guard);
    }

    /// Removes `worker` and all its blocks; returns the number of blocks it held. Its slot is
    /// reused only after an epoch grace period, so concurrent lookups never attribute its blocks
    /// to a worker added later.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let w = &mut *w;
        let Some(mut wb) = w.workers.remove(&worker) else {
            return 0;
        };
        w.counts.stats.events_applied += 1;
        let n = wb.len();
        // 1. Clear the worker's holders (every table from now on is built from these words).
        self.drop_all(
            &mut w.counts,
            &mut w.ledger,
            &mut w.scratch,
            &mut wb,
            &guard,
        );
        // 2. Publish slot names without it.
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
        self.maybe_shrink(&mut w.counts, &guard);
        w.ledger.retire(&guard);
        // Removals are rare: push the release to the global queue now, so the slot is reusable
        // after the grace period rather than when this thread's bag fills.
        reclaim::flush(&guard);
        n
    }

    pub(super) fn register(
        &self,
        w: &mut Writer,
        worker: WorkerId,
        guard: &Guard,
    ) -> Result<(), EventError> {
        let recycled = lock(&self.free_slots).pop();
        let slot = match recycled {
            Some(s) => s,
            None if w.slots < MAX_SLOTS => {
                w.slots += 1;
                w.slots - 1
            }
            None => return Err(EventError::TooManyWorkers { worker }),
        };
        // Publish the name before any holder of the slot is set.
        self.names.set(slot, Some(worker), guard);
        w.workers.insert(worker, WorkerBlocks::new(slot));
        Ok(())
    }

    /// Removes every holder of `wb`'s worker (all tiers) and forgets its blocks.
    pub(super) fn drop_all(
        &self,
        counts: &mut Counts,
        ledger: &mut SetLedger,
        scratch: &mut Scratch,
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
                table.remove(seq, wb.slot, ALL_TIERS, ledger, scratch)
            {
                counts.live -= 1;
            }
        }
        counts.total_blocks -= wb.len();
        wb.simple = EngineMap::default();
        wb.multi = EngineMap::default();
        wb.aliases = HashMap::new();
    }
}
