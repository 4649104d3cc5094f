//! The write path: applying engine events (`Stored`, `Removed`).
//!
//! An event holds the registry (shared) and its worker's lock throughout. It updates the
//! worker's maps directly and records the table changes they imply as [`Op`]s, in order; each
//! chunk's ops are applied under the table-side lock (see the module docs of `index`,
//! "Writers on several threads").

use super::workers::{Alias, Held, TableSide, Tally, WorkerBlocks, MAX_COPIES, ONE_GPU};
use super::{BlockIndex, DuplicateStores, EventError, TIERS};
use crate::blocks::event::{KvEvent, StoredBlock, Tier, WorkerId};
use crate::blocks::hash::chain;
use crate::blocks::table::{AddOutcome, RemoveOutcome, Table, GPU};
use crate::reclaim::{self, Guard};
use crate::sync::{lock, read};

/// How many blocks ahead `store_blocks` prefetches the worker's map slots.
pub(super) const PREFETCH_AHEAD: usize = 8;
/// Blocks per batch of table updates in `store_blocks`.
pub(super) const STORE_CHUNK: usize = 16;

/// What a store does with a block the worker already holds in the same tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Duplicates {
    /// Counts another copy (engine events).
    Count,
    /// Ignores it (the approximate index's repeated predictions).
    Ignore,
}

/// A table change an event's bookkeeping implies, applied later under the table-side lock
/// (in the order recorded) by [`Ctx::apply`].
#[derive(Clone, Copy, Debug)]
pub(super) enum Op {
    /// [`Ctx::first_copy`].
    First { seq: u64, t: u8, new_mapping: bool },
    /// [`Ctx::last_copy`].
    Last { seq: u64, t: u8 },
    /// [`Ctx::unmapped`].
    Unmapped { seq: u64 },
}

/// Most ops one block records (a reused engine hash: its old contents' last copies in every
/// tier, their unmapping, the new first copy).
const OPS_PER_BLOCK: usize = TIERS + 2;

/// The ops recorded for one chunk of blocks.
pub(super) struct Ops {
    ops: [Op; OPS_PER_BLOCK * STORE_CHUNK],
    n: usize,
}

impl Ops {
    pub(super) fn new() -> Self {
        Ops {
            ops: [Op::Unmapped { seq: 0 }; OPS_PER_BLOCK * STORE_CHUNK],
            n: 0,
        }
    }

    #[inline]
    pub(super) fn push(&mut self, op: Op) {
        self.ops[self.n] = op;
        self.n += 1;
    }

    /// Whether one more block's ops might not fit.
    fn full(&self) -> bool {
        self.n + OPS_PER_BLOCK > self.ops.len()
    }

    /// Records the ops of dropping every copy of a block held as `h` (its engine hash now maps
    /// elsewhere or nowhere; the caller updates the maps).
    fn drop_held(&mut self, h: Held) {
        for (k, &c) in h.copies.iter().enumerate() {
            if c > 0 {
                self.push(Op::Last {
                    seq: h.seq,
                    t: 1 << k,
                });
            }
        }
        self.push(Op::Unmapped { seq: h.seq });
    }

    /// Applies the recorded ops for `wb`'s worker under the table-side lock, retires the
    /// holder sets they replaced, and empties the list. Each op only reads and writes `wb`'s
    /// aliases and its holders in the table.
    pub(super) fn apply(&mut self, index: &BlockIndex, wb: &mut WorkerBlocks, guard: &Guard) {
        if self.n == 0 {
            return;
        }
        let mut side = lock(&index.tables);
        let mut cx = Ctx {
            index,
            side: &mut side,
            guard,
        };
        for &op in &self.ops[..self.n] {
            cx.apply(wb, op);
        }
        // Replaced sets are rare: this is one emptiness check per chunk, not a second lock.
        side.ledger.retire(guard);
        self.n = 0;
    }
}

/// One writer's access to the table side (table, its counters, the reclaimer ledger and
/// scratch), under the table-side lock (`side` borrows its guard).
pub(super) struct Ctx<'a> {
    pub(super) index: &'a BlockIndex,
    pub(super) side: &'a mut TableSide,
    pub(super) guard: &'a Guard,
}

impl<'a> Ctx<'a> {
    #[inline]
    pub(super) fn table(&self) -> &'a Table {
        self.index.load_table(self.guard)
    }

    /// Sets tier bit `t` of `slot` for `seq`; returns the slot's tiers before (0: it did not
    /// hold `seq`).
    pub(super) fn add(&mut self, slot: u32, seq: u64, t: u8) -> u8 {
        loop {
            let table = self.table();
            let side = &mut *self.side;
            match table.add(seq, slot, t, side.used, &mut side.ledger, &mut side.scratch) {
                AddOutcome::AlreadySet(prev) => return prev,
                AddOutcome::Set {
                    revived,
                    new_slot,
                    prev,
                } => {
                    side.used += usize::from(new_slot);
                    side.live += usize::from(revived);
                    return prev;
                }
                AddOutcome::Full => {
                    let cap = Table::cap_for(side.live);
                    self.index.rebuild(side, cap, self.guard);
                }
            }
        }
    }

    /// Clears tier bits `tiers` of `slot` for `seq`.
    pub(super) fn remove(&mut self, slot: u32, seq: u64, tiers: u8) {
        let table = self.table();
        let side = &mut *self.side;
        if let RemoveOutcome::Removed { dead: true } =
            table.remove(seq, slot, tiers, &mut side.ledger, &mut side.scratch)
        {
            side.live -= 1;
        }
    }

    /// Applies one recorded op for `wb`'s worker.
    #[inline]
    pub(super) fn apply(&mut self, wb: &mut WorkerBlocks, op: Op) {
        match op {
            Op::First {
                seq,
                t,
                new_mapping,
            } => self.first_copy(wb, seq, t, new_mapping),
            Op::Last { seq, t } => self.last_copy(wb, seq, t),
            Op::Unmapped { seq } => Self::unmapped(wb, seq),
        }
    }

    /// An engine hash of `wb`'s worker that maps to `seq` got its first copy in tier bit `t`
    /// (`new_mapping`: it did not map to `seq` before).
    pub(super) fn first_copy(&mut self, wb: &mut WorkerBlocks, seq: u64, t: u8, new_mapping: bool) {
        let prev = self.add(wb.slot, seq, t);
        let ti = t.trailing_zeros() as usize;
        if let Some(a) = wb.aliases.get_mut(&seq) {
            a.engines += u32::from(new_mapping);
            a.tiers[ti] += 1;
        } else if new_mapping && prev != 0 {
            // Another engine hash (holding `seq` in tiers `prev`) already maps to it.
            let mut tiers = [0; TIERS];
            for (k, x) in tiers.iter_mut().enumerate() {
                *x = u32::from(prev & (1 << k) != 0);
            }
            tiers[ti] += 1;
            wb.aliases.insert(seq, Alias { engines: 2, tiers });
        }
    }

    /// An engine hash mapping to `seq` lost its last copy in tier bit `t`.
    pub(super) fn last_copy(&mut self, wb: &mut WorkerBlocks, seq: u64, t: u8) {
        if let Some(a) = wb.aliases.get_mut(&seq) {
            let x = &mut a.tiers[t.trailing_zeros() as usize];
            *x -= 1;
            if *x > 0 {
                return;
            }
        }
        self.remove(wb.slot, seq, t);
    }

    /// An engine hash no longer maps to `seq` (its copies are all gone).
    pub(super) fn unmapped(wb: &mut WorkerBlocks, seq: u64) {
        if let Some(a) = wb.aliases.get_mut(&seq) {
            a.engines -= 1;
            if a.engines <= 1 {
                wb.aliases.remove(&seq);
            }
        }
    }
}

impl BlockIndex {
    // ----------------------------------------------------------------------------------------
    // Writers
    // ----------------------------------------------------------------------------------------

    /// Applies one engine event for `worker`: `Stored` and `Removed` in the GPU tier
    /// ([`Self::apply_in`] for others), `Cleared` to every tier.
    ///
    /// - `Stored`: maps each block's engine hash to its sequence hash, chained from `parent`'s
    ///   sequence hash (or starting a sequence when `parent` is `None`). An unknown parent
    ///   rejects the whole event: [`EventError::UnknownParent`], nothing stored. Storing a
    ///   block the worker already holds in that tier adds a **copy**
    ///   ([`IndexStats::duplicate_copies`]): one removal then leaves the block visible until
    ///   the last copy goes; in the GPU tier under [`DuplicateStores::Reports`] it changes
    ///   nothing instead ([`Self::set_duplicate_stores`]). An engine hash stored again with
    ///   *other* contents moves to them (all copies of the old contents go).
    /// - `Removed`: removes one copy of each named block; engine hashes the worker does not
    ///   hold (in that tier) are counted in [`IndexStats::unknown_removes`], not an error.
    /// - `Cleared`: drops every block of the worker (the worker stays known).
    ///
    /// A worker holds a sequence hash in a tier while at least one copy of one of its engine
    /// hashes that map to it is in that tier.
    ///
    /// [`IndexStats::duplicate_copies`]: crate::blocks::IndexStats::duplicate_copies
    /// [`IndexStats::unknown_removes`]: crate::blocks::IndexStats::unknown_removes
    pub fn apply(&self, worker: WorkerId, event: KvEvent) -> Result<(), EventError> {
        match event {
            KvEvent::Cleared => {
                self.clear_worker(worker);
                Ok(())
            }
            other => self.apply_in(worker, Tier::Gpu, other),
        }
    }

    /// Applies one engine event for `worker`'s copies in storage tier `tier` (vLLM's
    /// `medium`; see [`Tier::from_medium`]). As [`Self::apply`], except that `Cleared` drops
    /// only that tier's copies. A `Stored` event's parent may be held in any tier.
    ///
    /// ```
    /// use kvtrie::blocks::{BlockIndex, KvEvent, StoredBlock, Tier, WorkerId};
    /// let index = BlockIndex::new();
    /// let blocks = vec![StoredBlock { engine_hash: 1, local_hash: 10 }];
    /// let w = WorkerId(4);
    /// index.apply(w, KvEvent::Stored { parent: None, blocks: blocks.clone() }).unwrap();
    /// index.apply_in(w, Tier::Cpu, KvEvent::Stored { parent: None, blocks }).unwrap();
    /// // Evicted from the GPU, still in host memory:
    /// index.apply(w, KvEvent::Removed { engine_hashes: vec![1] }).unwrap();
    /// let s = index.find_matches(&[10]);
    /// assert_eq!((s.get(w), s.get_tier(w, Tier::Gpu), s.get_tier(w, Tier::Cpu)), (1, 0, 1));
    /// ```
    pub fn apply_in(&self, worker: WorkerId, tier: Tier, event: KvEvent) -> Result<(), EventError> {
        match event {
            KvEvent::Stored { parent, blocks } => {
                self.store_blocks_in(worker, tier, parent, &blocks)
            }
            KvEvent::Removed { engine_hashes } => {
                self.remove_blocks_in(worker, tier, &engine_hashes);
                Ok(())
            }
            KvEvent::Cleared => {
                self.clear_tier(worker, tier);
                Ok(())
            }
        }
    }

    /// Applies a GPU-tier `Stored` event given by reference (see [`Self::apply`]).
    pub fn store_blocks(
        &self,
        worker: WorkerId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        self.store(worker, GPU, parent, blocks, self.gpu_duplicates())
    }

    /// Applies a `Stored` event in `tier` given by reference (see [`Self::apply_in`]).
    pub fn store_blocks_in(
        &self,
        worker: WorkerId,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        let dup = if tier.bit() == GPU {
            self.gpu_duplicates()
        } else {
            Duplicates::Count
        };
        self.store(worker, tier.bit(), parent, blocks, dup)
    }

    /// A GPU-tier store that counts a block the worker already holds as another copy whatever
    /// [`BlockIndex::set_duplicate_stores`] says (the ZMQ subscriber's per-engine ledger
    /// decides which stores are reports).
    #[cfg(feature = "zmq")]
    pub(crate) fn store_copies(
        &self,
        worker: WorkerId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        self.store(worker, GPU, parent, blocks, Duplicates::Count)
    }

    /// How a GPU-tier store treats a block the worker already holds on the GPU
    /// ([`BlockIndex::set_duplicate_stores`]).
    fn gpu_duplicates(&self) -> Duplicates {
        match self.duplicate_stores() {
            DuplicateStores::Copies => Duplicates::Count,
            DuplicateStores::Reports => Duplicates::Ignore,
        }
    }

    /// A GPU-tier store that treats blocks the worker already holds as no-ops (the
    /// approximate index re-records the same prefixes over and over).
    pub(crate) fn store_blocks_idempotent(
        &self,
        worker: WorkerId,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        self.store(worker, GPU, None, blocks, Duplicates::Ignore)
    }

    pub(super) fn store(
        &self,
        worker: WorkerId,
        t: u8,
        parent: Option<u64>,
        blocks: &[StoredBlock],
        dup: Duplicates,
    ) -> Result<(), EventError> {
        let guard = reclaim::pin();
        let mut d = Tally::default();
        // A new worker is added only for a store that starts a sequence with blocks.
        let add = parent.is_none() && !blocks.is_empty();
        let reg = match self.registry_with(worker, add, &guard) {
            Ok(reg) => reg,
            Err(e) => {
                d.stats.rejected_workers += 1;
                self.merge_tally(&d);
                return Err(e);
            }
        };
        let Some(wm) = reg.workers.get(&worker) else {
            if let Some(p) = parent {
                d.stats.unknown_parents += 1;
                self.merge_tally(&d);
                return Err(EventError::UnknownParent { worker, parent: p });
            }
            // No blocks, nothing to add the worker for; or a `remove_worker` came right
            // after registering it, which then removed what this store would have added.
            d.stats.events_applied += 1;
            self.merge_tally(&d);
            return Ok(());
        };
        let wb = &mut *lock(wm);
        let mut prev = match parent {
            None => None,
            Some(p) => match wb.seq_of(p) {
                Some(seq) => Some(seq),
                None => {
                    d.stats.unknown_parents += 1;
                    self.merge_tally(&d);
                    return Err(EventError::UnknownParent { worker, parent: p });
                }
            },
        };
        d.stats.events_applied += 1;
        let ti = t.trailing_zeros() as usize;
        let seed = self.hasher.seed();
        // Blocks go in chunks: first every block's mapping (prefetching map slots a few
        // blocks ahead), recording the table ops it implies, then those ops under the table
        // lock (their holders prefetched in the first pass), so the cache misses of
        // consecutive blocks overlap and the table lock is held only for the table's part.
        let mut ops = Ops::new();
        for (c, chunk) in blocks.chunks(STORE_CHUNK).enumerate() {
            let table = self.load_table(&guard);
            for (i, b) in chunk.iter().enumerate() {
                if let Some(ahead) = blocks.get(c * STORE_CHUNK + i + PREFETCH_AHEAD) {
                    wb.simple.prefetch(ahead.engine_hash);
                    if !wb.multi.is_empty() {
                        wb.multi.prefetch(ahead.engine_hash);
                    }
                }
                let seq = match prev {
                    None => b.local_hash,
                    Some(p) => chain(p, b.local_hash, seed),
                };
                prev = Some(seq);
                let e = b.engine_hash;
                let new_mapping;
                // 1. A block with copies or tiers beyond one GPU copy: updated in place.
                let in_multi = match wb.multi.get_mut(e) {
                    Some(h) if h.seq == seq => {
                        let c = h.copies[ti];
                        if c > 0 && dup == Duplicates::Ignore {
                            continue;
                        }
                        if c == MAX_COPIES {
                            d.stats.copies_saturated += 1;
                            continue;
                        }
                        h.copies[ti] += 1;
                        if c > 0 {
                            d.stats.duplicate_copies += 1;
                            continue;
                        }
                        Some(None)
                    }
                    Some(h) => Some(Some(*h)),
                    None => None,
                };
                match in_multi {
                    // first copy in tier `t` of a block held in other tiers
                    Some(None) => new_mapping = false,
                    Some(Some(old)) => {
                        // Other contents under a reused id: drop every copy of the old.
                        ops.drop_held(old);
                        let mut copies = [0; TIERS];
                        copies[ti] = 1;
                        wb.put(e, Held { seq, copies });
                        d.stats.blocks_stored += 1;
                        new_mapping = true;
                    }
                    // 2. Otherwise the compact map: one probe in the common case.
                    None if t == GPU => match wb.simple.insert(e, seq) {
                        None => {
                            d.stats.blocks_stored += 1;
                            d.blocks += 1;
                            new_mapping = true;
                        }
                        Some(old) if old == seq => {
                            if dup == Duplicates::Ignore {
                                continue;
                            }
                            // A second GPU copy: no table change.
                            wb.simple.remove(e);
                            wb.multi.insert(
                                e,
                                Held {
                                    seq,
                                    copies: [2, 0, 0, 0],
                                },
                            );
                            d.stats.duplicate_copies += 1;
                            continue;
                        }
                        Some(old) => {
                            // The engine reused an id for other contents: move the mapping.
                            ops.drop_held(Held {
                                seq: old,
                                copies: ONE_GPU,
                            });
                            d.stats.blocks_stored += 1;
                            new_mapping = true;
                        }
                    },
                    None => {
                        let mut copies = [0; TIERS];
                        copies[ti] = 1;
                        match wb.simple.get(e) {
                            Some(s0) if s0 == seq => {
                                // Held once on the GPU; now also in tier `t`.
                                copies[0] = 1;
                                new_mapping = false;
                            }
                            Some(s0) => {
                                wb.simple.remove(e);
                                ops.drop_held(Held {
                                    seq: s0,
                                    copies: ONE_GPU,
                                });
                                d.stats.blocks_stored += 1;
                                new_mapping = true;
                            }
                            None => {
                                d.stats.blocks_stored += 1;
                                d.blocks += 1;
                                new_mapping = true;
                            }
                        }
                        wb.put(e, Held { seq, copies });
                    }
                }
                table.prefetch(seq);
                ops.push(Op::First {
                    seq,
                    t,
                    new_mapping,
                });
            }
            ops.apply(self, wb, &guard);
        }
        // Merged before the registry is released (at return), so a view that takes it
        // exclusively sees counters that match the workers.
        self.merge_tally(&d);
        Ok(())
    }

    /// Applies a GPU-tier `Removed` event given by reference (see [`Self::apply`]).
    pub fn remove_blocks(&self, worker: WorkerId, engine_hashes: &[u64]) {
        self.remove_blocks_in(worker, Tier::Gpu, engine_hashes);
    }

    /// Applies a `Removed` event in `tier` given by reference (see [`Self::apply_in`]).
    pub fn remove_blocks_in(&self, worker: WorkerId, tier: Tier, engine_hashes: &[u64]) {
        let guard = reclaim::pin();
        let mut d = Tally::default();
        d.stats.events_applied += 1;
        let reg = read(&self.registry);
        let Some(wm) = reg.workers.get(&worker) else {
            d.stats.unknown_removes = engine_hashes.len() as u64;
            self.merge_tally(&d);
            return;
        };
        let wb = &mut *lock(wm);
        let t = tier.bit();
        let ti = tier.index();
        let mut ops = Ops::new();
        for &e in engine_hashes {
            if ops.full() {
                ops.apply(self, wb, &guard);
            }
            if t == GPU && (wb.multi.is_empty() || wb.multi.get(e).is_none()) {
                match wb.simple.remove(e) {
                    Some(seq) => {
                        d.stats.blocks_removed += 1;
                        d.blocks -= 1;
                        ops.push(Op::Last { seq, t: GPU });
                        ops.push(Op::Unmapped { seq });
                    }
                    None => d.stats.unknown_removes += 1,
                }
                continue;
            }
            match wb.held(e) {
                Some(mut h) if h.copies[ti] > 0 => {
                    h.copies[ti] -= 1;
                    if h.copies[ti] == 0 {
                        ops.push(Op::Last { seq: h.seq, t });
                    }
                    // A mapping is removed with its last copy (as `blocks_stored` counts it
                    // once, at its first).
                    if h.copies == [0; TIERS] {
                        ops.push(Op::Unmapped { seq: h.seq });
                        d.stats.blocks_removed += 1;
                        d.blocks -= 1;
                    }
                    wb.put(e, h);
                }
                _ => d.stats.unknown_removes += 1,
            }
        }
        ops.apply(self, wb, &guard);
        let mut side = lock(&self.tables);
        self.maybe_shrink(&mut side, &guard);
        side.ledger.retire(&guard);
        drop(side);
        self.merge_tally(&d);
    }
}
