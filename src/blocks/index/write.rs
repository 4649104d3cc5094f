//! The write path: applying engine events (`Stored`, `Removed`) under the writer lock.

use super::workers::{Alias, Counts, Held, WorkerBlocks, Writer, MAX_COPIES};
use super::{BlockIndex, EventError, TIERS};
use crate::blocks::event::{KvEvent, StoredBlock, Tier, WorkerId};
use crate::blocks::hash::chain;
use crate::blocks::table::{AddOutcome, RemoveOutcome, Scratch, SetLedger, Table, GPU};
use crate::reclaim::{self, Guard};
use crate::sync::lock;

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

/// One writer operation's access to the table, counters and reclaimer ledger.
pub(super) struct Ctx<'a> {
    pub(super) index: &'a BlockIndex,
    pub(super) counts: &'a mut Counts,
    pub(super) ledger: &'a mut SetLedger,
    pub(super) scratch: &'a mut Scratch,
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
            match table.add(seq, slot, t, self.counts.used, self.ledger, self.scratch) {
                AddOutcome::AlreadySet(prev) => return prev,
                AddOutcome::Set {
                    revived,
                    new_slot,
                    prev,
                } => {
                    self.counts.used += usize::from(new_slot);
                    self.counts.live += usize::from(revived);
                    return prev;
                }
                AddOutcome::Full => {
                    let cap = Table::cap_for(self.counts.live);
                    self.index.rebuild(self.counts, cap, self.guard);
                }
            }
        }
    }

    /// Clears tier bits `tiers` of `slot` for `seq`.
    pub(super) fn remove(&mut self, slot: u32, seq: u64, tiers: u8) {
        if let RemoveOutcome::Removed { dead: true } =
            self.table()
                .remove(seq, slot, tiers, self.ledger, self.scratch)
        {
            self.counts.live -= 1;
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

    /// Drops every copy of `e` (held as `h`): the engine hash no longer maps to anything.
    pub(super) fn drop_engine(&mut self, wb: &mut WorkerBlocks, e: u64, h: Held) {
        for (k, &c) in h.copies.iter().enumerate() {
            if c > 0 {
                self.last_copy(wb, h.seq, 1 << k);
            }
        }
        Self::unmapped(wb, h.seq);
        wb.put(
            e,
            Held {
                seq: h.seq,
                copies: [0; TIERS],
            },
        );
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
    ///   the last copy goes. An engine hash stored again with *other* contents moves to them
    ///   (all copies of the old contents go).
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
        self.store(worker, GPU, parent, blocks, Duplicates::Count)
    }

    /// Applies a `Stored` event in `tier` given by reference (see [`Self::apply_in`]).
    pub fn store_blocks_in(
        &self,
        worker: WorkerId,
        tier: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        self.store(worker, tier.bit(), parent, blocks, Duplicates::Count)
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
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let w = &mut *w;
        let mut prev = match parent {
            None => None,
            Some(p) => match w.workers.get(&worker).and_then(|wb| wb.seq_of(p)) {
                Some(seq) => Some(seq),
                None => {
                    w.counts.stats.unknown_parents += 1;
                    return Err(EventError::UnknownParent { worker, parent: p });
                }
            },
        };
        if !blocks.is_empty() && !w.workers.contains_key(&worker) {
            if let Err(e) = self.register(w, worker, &guard) {
                w.counts.stats.rejected_workers += 1;
                return Err(e);
            }
        }
        w.counts.stats.events_applied += 1;
        if blocks.is_empty() {
            return Ok(());
        }
        let Writer {
            workers,
            counts,
            ledger,
            scratch,
            ..
        } = w;
        let wb = workers.get_mut(&worker).expect("registered above");
        let mut cx = Ctx {
            index: self,
            counts,
            ledger,
            scratch,
            guard: &guard,
        };
        let ti = t.trailing_zeros() as usize;
        let seed = self.hasher.seed();
        // Blocks go in chunks: first every block's mapping (prefetching map slots a few
        // blocks ahead), then the table holders of the first copies (prefetched in the first
        // pass), so the cache misses of consecutive blocks overlap. A copy that must be
        // *released* flushes the pending ones first, in case they meet.
        let mut pending = [(0u64, false); STORE_CHUNK];
        for (c, chunk) in blocks.chunks(STORE_CHUNK).enumerate() {
            let mut n = 0;
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
                            cx.counts.stats.copies_saturated += 1;
                            continue;
                        }
                        h.copies[ti] += 1;
                        if c > 0 {
                            cx.counts.stats.duplicate_copies += 1;
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
                        Self::flush(&mut cx, wb, &pending[..n], t);
                        n = 0;
                        cx.drop_engine(wb, e, old);
                        let mut copies = [0; TIERS];
                        copies[ti] = 1;
                        wb.put(e, Held { seq, copies });
                        cx.counts.stats.blocks_stored += 1;
                        new_mapping = true;
                    }
                    // 2. Otherwise the compact map: one probe in the common case.
                    None if t == GPU => match wb.simple.insert(e, seq) {
                        None => {
                            cx.counts.stats.blocks_stored += 1;
                            cx.counts.total_blocks += 1;
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
                            cx.counts.stats.duplicate_copies += 1;
                            continue;
                        }
                        Some(old) => {
                            // The engine reused an id for other contents: move the mapping.
                            Self::flush(&mut cx, wb, &pending[..n], t);
                            n = 0;
                            cx.last_copy(wb, old, GPU);
                            Ctx::unmapped(wb, old);
                            cx.counts.stats.blocks_stored += 1;
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
                                Self::flush(&mut cx, wb, &pending[..n], t);
                                n = 0;
                                wb.simple.remove(e);
                                cx.last_copy(wb, s0, GPU);
                                Ctx::unmapped(wb, s0);
                                cx.counts.stats.blocks_stored += 1;
                                new_mapping = true;
                            }
                            None => {
                                cx.counts.stats.blocks_stored += 1;
                                cx.counts.total_blocks += 1;
                                new_mapping = true;
                            }
                        }
                        wb.put(e, Held { seq, copies });
                    }
                }
                cx.table().prefetch(seq);
                pending[n] = (seq, new_mapping);
                n += 1;
            }
            Self::flush(&mut cx, wb, &pending[..n], t);
        }
        cx.ledger.retire(&guard);
        Ok(())
    }

    /// The table holders of first copies collected by `store`.
    pub(super) fn flush(cx: &mut Ctx<'_>, wb: &mut WorkerBlocks, pending: &[(u64, bool)], t: u8) {
        for &(seq, new_mapping) in pending {
            cx.first_copy(wb, seq, t, new_mapping);
        }
    }

    /// Applies a GPU-tier `Removed` event given by reference (see [`Self::apply`]).
    pub fn remove_blocks(&self, worker: WorkerId, engine_hashes: &[u64]) {
        self.remove_blocks_in(worker, Tier::Gpu, engine_hashes);
    }

    /// Applies a `Removed` event in `tier` given by reference (see [`Self::apply_in`]).
    pub fn remove_blocks_in(&self, worker: WorkerId, tier: Tier, engine_hashes: &[u64]) {
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
        let Some(wb) = workers.get_mut(&worker) else {
            counts.stats.unknown_removes = counts
                .stats
                .unknown_removes
                .saturating_add(engine_hashes.len() as u64);
            return;
        };
        let mut cx = Ctx {
            index: self,
            counts,
            ledger,
            scratch,
            guard: &guard,
        };
        let t = tier.bit();
        let ti = tier.index();
        for &e in engine_hashes {
            if t == GPU && (wb.multi.is_empty() || wb.multi.get(e).is_none()) {
                match wb.simple.remove(e) {
                    Some(seq) => {
                        cx.counts.stats.blocks_removed += 1;
                        cx.counts.total_blocks -= 1;
                        cx.last_copy(wb, seq, GPU);
                        Ctx::unmapped(wb, seq);
                    }
                    None => cx.counts.stats.unknown_removes += 1,
                }
                continue;
            }
            match wb.held(e) {
                Some(mut h) if h.copies[ti] > 0 => {
                    h.copies[ti] -= 1;
                    cx.counts.stats.blocks_removed += 1;
                    if h.copies[ti] == 0 {
                        cx.last_copy(wb, h.seq, t);
                    }
                    if h.copies == [0; TIERS] {
                        Ctx::unmapped(wb, h.seq);
                        cx.counts.total_blocks -= 1;
                    }
                    wb.put(e, h);
                }
                _ => cx.counts.stats.unknown_removes += 1,
            }
        }
        self.maybe_shrink(cx.counts, &guard);
        cx.ledger.retire(&guard);
    }
}
