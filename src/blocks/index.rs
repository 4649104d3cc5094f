//! [`BlockIndex`]: which worker holds which KV blocks, fed by engine events, with lock-free
//! per-worker overlap scoring.
//!
//! # Concurrency protocol
//!
//! - **Readers** ([`BlockIndex::find_matches`] and friends) pin the epoch once, Acquire-load the
//!   slot-name directory and then the table pointer, probe the table with Acquire key and
//!   holder-word loads. They take no lock, write no shared memory and allocate only the result
//!   (its storage is reused by the `_into` forms).
//! - **Writers** ([`BlockIndex::apply`], [`BlockIndex::remove_worker`]) serialize on one mutex
//!   that owns all bookkeeping (per-worker engine hash → sequence hash maps, worker → dense
//!   slot). They replace holder words in the shared table with whole-word Release stores,
//!   insert keys with the write-once protocol of `table.rs`, and grow or purge the table by
//!   building a new one and swapping the pointer (RCU), retiring the old table through
//!   `crate::reclaim::retire`. Out-of-line holder sets replaced by an operation are retired
//!   as one batch at its end.
//! - **Worker slots.** The reader-visible slot → [`WorkerId`] mapping is an immutable
//!   directory behind an atomic pointer (`names.rs`), replaced (RCU) when a worker is added or
//!   removed. Removing a worker clears all its holders, publishes a directory without it, and
//!   only then retires a release token for its slot; the slot returns to the free list when the
//!   token's destructor runs, i.e. after every reader pinned at the time has unpinned. A reader
//!   loads the directory *before* the table, so a holder it sees for slot `s` belongs either to
//!   the worker its directory names for `s` (the slot cannot be reused while the reader stays
//!   pinned) or, if its directory names nobody, is ignored. No reader attributes one worker's
//!   block to another.
//!
//! # Memory per block
//!
//! A table entry is 16 bytes whatever the number of workers (see `table.rs` for the holder
//! forms: a 62-slot GPU bitset, one or two inline `(slot, tiers)` holders, or a pointer to an
//! out-of-line set — a bitset over the slots it spans, or a sorted holder list, whichever is
//! smaller). Each worker's engine hash → sequence hash map costs 16 bytes a slot at a load
//! between 5/9 and 4/5 for blocks held as one GPU copy; blocks with more copies or in other
//! tiers live in a hash map of 24-byte entries instead, and sequence hashes with more than one
//! reference per tier in another (see `WorkerBlocks`).
//!
//! # Storage tiers and copies
//!
//! A holder carries a 4-bit tier mask ([`Tier`]): the tiers in which the worker holds the
//! block. Lookups report, per worker, the leading run in any tier ([`OverlapScores::get`]), in
//! each tier ([`OverlapScores::get_tier`]) and tier-weighted ([`OverlapScores::weighted`]).
//! Copies are reference-counted per (worker, engine hash, tier) and per (worker, sequence
//! hash, tier), so a tier bit is cleared only with the last reference.

use std::collections::HashMap;

use super::event::{KvEvent, StoredBlock, Tier, TierWeights, WorkerId};
use super::hash::{chain, hash_u32s, BlockHasher};
use super::map::EngineMap;
use super::names::{Names, SlotNames};
use super::table::{
    bits_of, decode, holder_slot, holder_tiers, AddOutcome, Holders, RemoveOutcome, Scratch,
    SetLedger, Table, BITSET_SLOTS, GPU, MAX_SLOTS,
};
use crate::reclaim::{self, Guard};
use crate::sync::{lock, Arc, AtomicPtr, Mutex, Ordering};

/// How many blocks ahead `store_blocks` prefetches the worker's map slots.
const PREFETCH_AHEAD: usize = 8;
/// Blocks per batch of table updates in `store_blocks`.
const STORE_CHUNK: usize = 16;
/// Number of storage tiers a holder can name.
pub(crate) const TIERS: usize = 4;
/// Every tier bit.
const ALL_TIERS: u8 = (1 << TIERS) - 1;

/// Why an event was rejected by [`BlockIndex::apply`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventError {
    /// A [`KvEvent::Stored`] named a parent block the worker does not hold (never stored, or
    /// already removed). Nothing was stored.
    UnknownParent {
        /// The worker the event was for.
        worker: WorkerId,
        /// The unknown parent engine hash.
        parent: u64,
    },
    /// The index already names [`BlockIndex::MAX_WORKERS`] workers, so a new one cannot be
    /// added (remove some first). Nothing was stored.
    TooManyWorkers {
        /// The worker the event was for.
        worker: WorkerId,
    },
}

impl core::fmt::Display for EventError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            EventError::UnknownParent { worker, parent } => write!(
                f,
                "worker {} stored blocks under unknown parent block {parent:#x}",
                worker.0
            ),
            EventError::TooManyWorkers { worker } => write!(
                f,
                "cannot add worker {}: the index already holds {} workers",
                worker.0,
                BlockIndex::MAX_WORKERS
            ),
        }
    }
}

impl std::error::Error for EventError {}

/// Event counters of a [`BlockIndex`] (see [`BlockIndex::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IndexStats {
    /// Events applied successfully (including `remove_worker` calls).
    pub events_applied: u64,
    /// Block mappings newly stored (duplicate stores are not counted).
    pub blocks_stored: u64,
    /// Block mappings removed by `Removed` events (not by `Cleared`/`remove_worker`).
    pub blocks_removed: u64,
    /// `Stored` events rejected because of an unknown parent.
    pub unknown_parents: u64,
    /// Engine hashes in `Removed` events that the worker did not hold.
    pub unknown_removes: u64,
    /// `Stored` events rejected because the index was full of workers
    /// ([`EventError::TooManyWorkers`]).
    pub rejected_workers: u64,
    /// Stores of a block the worker already held in that tier: counted as one more copy.
    pub duplicate_copies: u64,
    /// Stores ignored because the block already had [`MAX_COPIES`] copies in that tier.
    pub copies_saturated: u64,
}

/// One worker's overlap with a request.
#[derive(Clone, Copy, Debug)]
struct Entry {
    worker: WorkerId,
    /// Leading blocks held in any tier.
    blocks: usize,
    /// Per tier, leading blocks held in that tier.
    tiers: [usize; TIERS],
    /// Σ over the leading blocks of the best weight among the tiers holding each.
    weighted: f64,
}

impl Entry {
    fn overlap(&self) -> Overlap {
        Overlap {
            blocks: self.blocks,
            per_tier: self.tiers,
            weighted: self.weighted,
        }
    }
}

/// One worker's overlap with a request, per tier (see [`OverlapScores::overlap`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overlap {
    /// Leading blocks held in any tier ([`OverlapScores::get`]).
    pub blocks: usize,
    /// Per tier (indexed by [`Tier::index`]), leading blocks held in that tier.
    pub per_tier: [usize; TIERS],
    /// Tier-weighted leading blocks ([`OverlapScores::weighted`]).
    pub weighted: f64,
}

/// A worker still matching during a scan in list mode.
#[derive(Clone, Copy, Debug)]
struct Active {
    slot: u32,
    /// Tiers that held every block so far.
    run: u8,
    /// Per tier, the depth at which the tier's run ended (valid once it left `run`).
    lead: [usize; TIERS],
    weighted: f64,
}

/// Per-worker overlap with a request: how many leading blocks of it each worker holds.
///
/// Returned by [`BlockIndex::find_matches`]; holds only workers with a positive score,
/// sorted by [`WorkerId`].
///
/// ```
/// use kvtrie::{BlockIndex, KvEvent, StoredBlock, WorkerId};
///
/// let index = BlockIndex::new();
/// let blocks = vec![
///     StoredBlock { engine_hash: 1, local_hash: 10 },
///     StoredBlock { engine_hash: 2, local_hash: 20 },
/// ];
/// index.apply(WorkerId(7), KvEvent::Stored { parent: None, blocks }).unwrap();
/// let scores = index.find_matches(&[10, 20, 30]);
/// assert_eq!(scores.get(WorkerId(7)), 2);
/// assert_eq!(scores.get(WorkerId(8)), 0);
/// assert_eq!(scores.iter().collect::<Vec<_>>(), vec![(WorkerId(7), 2)]);
/// assert_eq!(scores.max(), 2);
/// ```
#[derive(Clone, Default)]
pub struct OverlapScores {
    /// Score > 0, sorted by worker.
    entries: Vec<Entry>,
    /// Scratch of a scan in list mode.
    active: Vec<Active>,
    /// Scratch of a scan in wide-bitset mode: the active words, and the next block's.
    wide: Vec<u64>,
    next: Vec<u64>,
}

impl OverlapScores {
    /// An empty result, to pass to [`BlockIndex::find_matches_into`].
    pub fn new() -> Self {
        Self::default()
    }

    fn entry(&self, worker: WorkerId) -> Option<&Entry> {
        self.entries
            .binary_search_by_key(&worker, |e| e.worker)
            .ok()
            .map(|i| &self.entries[i])
    }

    /// The number of leading request blocks `worker` holds (0 if none or unknown).
    pub fn get(&self, worker: WorkerId) -> usize {
        self.entry(worker).map_or(0, |e| e.blocks)
    }

    /// The number of leading request blocks `worker` holds in `tier` (0 if none): the run
    /// of blocks from the first that all have a copy there.
    pub fn get_tier(&self, worker: WorkerId, tier: Tier) -> usize {
        self.entry(worker).map_or(0, |e| e.tiers[tier.index()])
    }

    /// The tier-weighted overlap of `worker`: the sum, over the leading blocks it holds (in
    /// any tier), of the best weight among the tiers that hold each block (0.0 if none).
    /// The weights are those of the lookup ([`BlockIndex::find_matches_weighted`]; the other
    /// lookups use [`TierWeights::default`]), so for GPU-only copies this is [`Self::get`].
    pub fn weighted(&self, worker: WorkerId) -> f64 {
        self.entry(worker).map_or(0.0, |e| e.weighted)
    }

    /// Everything known about `worker`'s overlap, if it holds the first block.
    pub fn overlap(&self, worker: WorkerId) -> Option<Overlap> {
        self.entry(worker).map(Entry::overlap)
    }

    /// `(worker, overlap)` for every worker with a positive score, sorted by worker.
    pub fn overlaps(&self) -> impl Iterator<Item = (WorkerId, Overlap)> + '_ {
        self.entries.iter().map(|e| (e.worker, e.overlap()))
    }

    /// `(worker, score)` for every worker with a positive score, sorted by worker.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, usize)> + '_ {
        self.entries.iter().map(|e| (e.worker, e.blocks))
    }

    /// Number of workers with a positive score.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no worker holds the request's first block.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The best score (0 when empty).
    pub fn max(&self) -> usize {
        self.entries.iter().map(|e| e.blocks).max().unwrap_or(0)
    }

    /// The worker with the best score (the smallest [`WorkerId`] among ties), if any.
    pub fn best(&self) -> Option<(WorkerId, usize)> {
        self.iter()
            .fold(None, |b: Option<(WorkerId, usize)>, (w, s)| match b {
                Some((_, bs)) if bs >= s => b,
                _ => Some((w, s)),
            })
    }

    /// Removes all scores, keeping the storage.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Records the workers of bitset word `word` (slots `64 * word ..`) set in `mask` as
    /// matching `depth` blocks, with the per-tier runs and weight all active workers share.
    #[inline]
    fn push_bits(
        &mut self,
        names: &SlotNames,
        word: usize,
        mut mask: u64,
        depth: usize,
        shared: &Shared,
    ) {
        while mask != 0 {
            let s = (word * 64) as u32 + mask.trailing_zeros();
            mask &= mask - 1;
            if let Some(worker) = names.get(s) {
                self.entries.push(Entry {
                    worker,
                    blocks: depth,
                    tiers: shared.tiers(depth),
                    weighted: shared.weighted(depth),
                });
            }
        }
    }

    fn push_active(&mut self, names: &SlotNames, a: &Active, depth: usize) {
        if let Some(worker) = names.get(a.slot) {
            let mut tiers = a.lead;
            for (t, v) in tiers.iter_mut().enumerate() {
                if a.run & (1 << t) != 0 {
                    *v = depth;
                }
            }
            self.entries.push(Entry {
                worker,
                blocks: depth,
                tiers,
                weighted: a.weighted,
            });
        }
    }
}

impl PartialEq for OverlapScores {
    /// Compares the per-worker, per-tier block counts (not the weighted sums, which depend on
    /// the weights a lookup was made with).
    fn eq(&self, other: &Self) -> bool {
        self.entries.len() == other.entries.len()
            && self
                .entries
                .iter()
                .zip(&other.entries)
                .all(|(a, b)| a.worker == b.worker && a.blocks == b.blocks && a.tiers == b.tiers)
    }
}

impl Eq for OverlapScores {}

impl core::fmt::Debug for OverlapScores {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|e| (e.worker.0, e.blocks)))
            .finish()
    }
}

/// Best tier weight for every tier mask.
type BestWeights = [f64; 1 << TIERS];

fn best_weights(w: &[f64; TIERS]) -> BestWeights {
    let mut best = [0.0; 1 << TIERS];
    for (m, b) in best.iter_mut().enumerate() {
        *b = best_of(w, m as u8);
    }
    best
}

/// The best weight among the tiers of mask `m` (0.0 for no tier).
#[inline]
fn best_of(w: &[f64; TIERS], m: u8) -> f64 {
    let mut best = f64::NEG_INFINITY;
    for (t, &x) in w.iter().enumerate() {
        if m & (1 << t) != 0 && x > best {
            best = x;
        }
    }
    if m == 0 {
        0.0
    } else {
        best
    }
}

/// What every active worker shares in the bitset scan modes, where each block so far was held
/// by all of its (active) holders in the same tiers. The weighted sum is kept lazily: blocks
/// `from..` all had mask `mask`, so a request whose blocks all have one mask (the common case)
/// costs one compare per block.
#[derive(Clone, Copy, Debug)]
struct Shared {
    /// Tiers that held every block so far.
    run: u8,
    /// Per tier, the depth at which its run ended (valid once it left `run`).
    lead: [usize; TIERS],
    /// The mask of blocks `from..` (`u8::MAX` before the first block), and its best weight.
    mask: u8,
    best: f64,
    from: usize,
    /// The weighted sum of blocks `..from`.
    before: f64,
}

impl Shared {
    fn new() -> Self {
        Shared {
            run: ALL_TIERS,
            lead: [0; TIERS],
            mask: u8::MAX,
            best: 0.0,
            from: 0,
            before: 0.0,
        }
    }

    /// The active workers all hold the block at `depth` in tiers `m`.
    #[inline]
    fn step(&mut self, m: u8, depth: usize, w: &[f64; TIERS]) {
        if m != self.mask {
            self.change(m, depth, w);
        }
    }

    #[cold]
    fn change(&mut self, m: u8, depth: usize, w: &[f64; TIERS]) {
        self.before += (depth - self.from) as f64 * self.best;
        self.from = depth;
        self.mask = m;
        self.best = best_of(w, m);
        let dropped = self.run & !m;
        for (t, lead) in self.lead.iter_mut().enumerate() {
            if dropped & (1 << t) != 0 {
                *lead = depth;
            }
        }
        self.run &= m;
    }

    /// The weighted sum of the first `depth` blocks.
    #[inline]
    fn weighted(&self, depth: usize) -> f64 {
        self.before + (depth - self.from) as f64 * self.best
    }

    /// Per-tier runs of a worker that ends with `depth` blocks.
    #[inline]
    fn tiers(&self, depth: usize) -> [usize; TIERS] {
        let mut tiers = self.lead;
        for (t, v) in tiers.iter_mut().enumerate() {
            if self.run & (1 << t) != 0 {
                *v = depth;
            }
        }
        tiers
    }

    /// The list-mode state of an active worker in `slot` after `depth` blocks.
    fn active(&self, slot: u32, depth: usize) -> Active {
        Active {
            slot,
            run: self.run,
            lead: self.lead,
            weighted: self.weighted(depth),
        }
    }
}

/// The tier mask `slot` holds in `h` (0 if none).
#[inline]
fn tiers_in(h: Holders<'_>, slot: u32, from: &mut usize) -> u8 {
    match h {
        Holders::Empty => 0,
        Holders::Bits(m, b) => {
            if slot < BITSET_SLOTS && (b >> slot) & 1 != 0 {
                m
            } else {
                0
            }
        }
        Holders::Pair(h0, h1) => {
            if holder_slot(h0) == slot {
                holder_tiers(h0)
            } else if h1 != 0 && holder_slot(h1) == slot {
                holder_tiers(h1)
            } else {
                0
            }
        }
        Holders::Sparse(set) => {
            // `from` only moves forward: the active workers are visited in slot order, and
            // they are a subset of the previous block's holders, so a linear merge is cheap.
            let mut i = (*from).min(set.len());
            while i < set.len() && holder_slot(set[i]) < slot {
                i += 1;
            }
            *from = i;
            match set.get(i) {
                Some(&h) if holder_slot(h) == slot => holder_tiers(h),
                _ => 0,
            }
        }
        Holders::Dense(m, base, words) => {
            let k = (slot / 64).wrapping_sub(base) as usize;
            match words.get(k) {
                Some(&w) if (w >> (slot % 64)) & 1 != 0 => m,
                _ => 0,
            }
        }
    }
}

/// Calls `f(slot, tiers)` for every holder of `h`, in slot order.
fn for_each_holder(h: Holders<'_>, mut f: impl FnMut(u32, u8)) {
    match h {
        Holders::Empty => {}
        Holders::Bits(m, mut b) => {
            while b != 0 {
                f(b.trailing_zeros(), m);
                b &= b - 1;
            }
        }
        Holders::Pair(h0, h1) => {
            f(holder_slot(h0), holder_tiers(h0));
            if h1 != 0 {
                f(holder_slot(h1), holder_tiers(h1));
            }
        }
        Holders::Sparse(set) => set.iter().for_each(|&h| f(holder_slot(h), holder_tiers(h))),
        Holders::Dense(m, base, words) => {
            for (k, &w) in words.iter().enumerate() {
                let mut b = w;
                while b != 0 {
                    f((base as usize + k) as u32 * 64 + b.trailing_zeros(), m);
                    b &= b - 1;
                }
            }
        }
    }
}

/// The tier mask every holder of `h` shares, if they share one (`None`: they differ).
fn uniform_mask(h: Holders<'_>) -> Option<u8> {
    match h {
        Holders::Empty => Some(0),
        Holders::Bits(m, _) | Holders::Dense(m, ..) => Some(m),
        Holders::Pair(h0, h1) => {
            let m = holder_tiers(h0);
            (h1 == 0 || holder_tiers(h1) == m).then_some(m)
        }
        Holders::Sparse(set) => {
            let m = set.first().map_or(0, |&h| holder_tiers(h));
            set.iter().all(|&h| holder_tiers(h) == m).then_some(m)
        }
    }
}

/// The active workers of a wide-bitset scan: bit `b` of `words[i]` = slot
/// `64 * (off + i) + b`; words outside `lo..hi` (absolute word indexes) are zero.
struct Wide {
    words: Vec<u64>,
    next: Vec<u64>,
    off: usize,
    lo: usize,
    hi: usize,
}

impl Wide {
    /// Narrows `lo..hi` to the non-zero words; false if none is left.
    fn trim(&mut self) -> bool {
        while self.lo < self.hi && self.words[self.lo - self.off] == 0 {
            self.lo += 1;
        }
        while self.hi > self.lo && self.words[self.hi - 1 - self.off] == 0 {
            self.hi -= 1;
        }
        self.lo < self.hi
    }

    /// Keeps the active workers of word `k` that `held(k)` has; the others end with `depth`
    /// blocks and the `shared` state.
    #[inline]
    fn intersect(
        &mut self,
        names: &SlotNames,
        depth: usize,
        shared: &Shared,
        out: &mut OverlapScores,
        held: impl Fn(usize) -> u64,
    ) {
        for k in self.lo..self.hi {
            let a = &mut self.words[k - self.off];
            let kept = *a & held(k);
            if kept != *a {
                out.push_bits(names, k, *a & !kept, depth, shared);
                *a = kept;
            }
        }
    }

    /// Intersects the active workers with the holders `h` of the block at `depth` (0-based):
    /// those that do not hold it end with `depth` blocks and the `shared` state. Returns the
    /// tier mask the remaining ones all hold it in (`Some((false, _))`: none remains), or
    /// `None` (changing nothing) when the active holders' tiers differ: the scan must
    /// continue in list mode.
    fn step(
        &mut self,
        names: &SlotNames,
        h: Holders<'_>,
        depth: usize,
        shared: &Shared,
        out: &mut OverlapScores,
    ) -> Option<(bool, u8)> {
        let (off, lo, hi) = (self.off, self.lo, self.hi);
        let mask = match h {
            Holders::Empty => {
                self.intersect(names, depth, shared, out, |_| 0);
                0
            }
            Holders::Bits(m, b) => {
                self.intersect(names, depth, shared, out, |k| if k == 0 { b } else { 0 });
                m
            }
            Holders::Dense(m, base, words) => {
                let base = base as usize;
                self.intersect(names, depth, shared, out, |k| {
                    words.get(k.wrapping_sub(base)).copied().unwrap_or(0)
                });
                m
            }
            Holders::Pair(..) | Holders::Sparse(_) => {
                self.next.clear();
                self.next.resize(hi - lo, 0);
                let mut mask = None;
                let mut mixed = false;
                let words = &self.words;
                let next = &mut self.next;
                for_each_holder(h, |slot, tiers| {
                    let k = slot as usize / 64;
                    if (lo..hi).contains(&k) && (words[k - off] >> (slot % 64)) & 1 != 0 {
                        match mask {
                            None => mask = Some(tiers),
                            Some(m) if m != tiers => mixed = true,
                            Some(_) => {}
                        }
                        next[k - lo] |= 1 << (slot % 64);
                    }
                });
                if mixed {
                    return None;
                }
                for k in lo..hi {
                    let a = &mut self.words[k - off];
                    let kept = self.next[k - lo];
                    out.push_bits(names, k, *a & !kept, depth, shared);
                    *a = kept;
                }
                mask.unwrap_or(0)
            }
        };
        Some((self.trim(), mask))
    }
}

/// The release of a removed worker's slot, deferred through the reclaimer (see the module
/// docs, "Worker slots").
struct SlotRelease {
    slot: u32,
    free: Arc<Mutex<Vec<u32>>>,
}

/// Destructor of a retired [`SlotRelease`]: returns the slot to the free list.
///
/// # Safety
///
/// `p` must come from `Box::into_raw` and be passed exactly once.
unsafe fn release_slot(p: *mut SlotRelease) {
    // Safety: forwarded to the caller.
    let token = unsafe { Box::from_raw(p) };
    lock(&token.free).push(token.slot);
}

/// Frees a retired table.
///
/// # Safety
///
/// `p` must come from `Box::into_raw`, be unreachable by new readers, and be passed once.
unsafe fn drop_table(p: *mut Table) {
    // Under loom, poison instead of freeing so that a premature retire fails the model.
    #[cfg(loom)]
    // Safety: forwarded to the caller; the table is leaked, never freed, under loom.
    unsafe {
        (*p).poison.poison()
    };
    #[cfg(not(loom))]
    // Safety: forwarded to the caller. A table owns no holder set (they belong to the current
    // table), so dropping it frees only its slot array.
    drop(unsafe { Box::from_raw(p) });
}

/// Copies of one engine hash per tier; each saturates at [`MAX_COPIES`].
type Copies = [u8; TIERS];

/// Most copies of one block counted per (worker, engine hash, tier): a store beyond it is
/// counted in [`IndexStats::copies_saturated`] and otherwise ignored, so a stream that
/// re-announces a block without ever removing it cannot make it unremovable.
pub const MAX_COPIES: u8 = u8::MAX;

/// A block held other than as exactly one GPU copy.
#[derive(Clone, Copy, Debug, Default)]
struct Held {
    seq: u64,
    copies: Copies,
}

/// The copies of a block held once, on the GPU.
const ONE_GPU: Copies = [1, 0, 0, 0];

/// A sequence hash that several engine hashes of one worker map to.
#[derive(Clone, Copy, Debug, Default)]
struct Alias {
    /// Engine hashes mapping to it (at least 2).
    engines: u32,
    /// Per tier, how many of them have a copy there.
    tiers: [u32; TIERS],
}

/// One worker's writer-side bookkeeping.
///
/// Copies are counted per engine hash and tier (a block stored twice in one tier, e.g. by two
/// requests computing it at once, needs two removals). The table's tier bit for `(worker,
/// seq)` is set while some engine hash mapping to `seq` has a copy in that tier: with one
/// such engine hash (the usual case) that is its own count; for the rare sequence hash that
/// several engine hashes map to, `aliases` counts, per tier, those with a copy.
struct WorkerBlocks {
    slot: u32,
    /// Engine hash → sequence hash, for blocks held as exactly one GPU copy (the common case;
    /// 16 bytes a slot).
    simple: EngineMap,
    /// Engine hash → every other block: several copies, or tiers other than the GPU (24
    /// bytes a slot).
    multi: EngineMap<Held>,
    /// Sequence hashes several engine hashes of this worker map to.
    aliases: HashMap<u64, Alias>,
}

impl WorkerBlocks {
    fn new(slot: u32) -> Self {
        WorkerBlocks {
            slot,
            simple: EngineMap::default(),
            multi: EngineMap::default(),
            aliases: HashMap::new(),
        }
    }

    /// Engine hashes held (in any tier).
    fn len(&self) -> usize {
        self.simple.len() + self.multi.len()
    }

    /// The sequence hash engine hash `e` maps to, if the worker holds it in any tier.
    fn seq_of(&self, e: u64) -> Option<u64> {
        match self.simple.get(e) {
            Some(s) => Some(s),
            None if self.multi.is_empty() => None,
            None => self.multi.get(e).map(|h| h.seq),
        }
    }

    /// The copies of `e`, if held.
    fn held(&self, e: u64) -> Option<Held> {
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
    fn put(&mut self, e: u64, h: Held) {
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
struct Writer {
    workers: HashMap<WorkerId, WorkerBlocks>,
    /// Slots handed out so far (free ones are on `free_slots` after their grace period).
    slots: u32,
    counts: Counts,
    ledger: SetLedger,
    scratch: Scratch,
}

/// Writer-side counters.
#[derive(Default)]
struct Counts {
    /// Non-empty slots of the current table (live + dead).
    used: usize,
    /// Keys of the current table with at least one holder.
    live: usize,
    /// Σ over workers of blocks held.
    total_blocks: usize,
    stats: IndexStats,
}

/// What a store does with a block the worker already holds in the same tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Duplicates {
    /// Counts another copy (engine events).
    Count,
    /// Ignores it (the approximate index's repeated predictions).
    Ignore,
}

/// One writer operation's access to the table, counters and reclaimer ledger.
struct Ctx<'a> {
    index: &'a BlockIndex,
    counts: &'a mut Counts,
    ledger: &'a mut SetLedger,
    scratch: &'a mut Scratch,
    guard: &'a Guard,
}

impl<'a> Ctx<'a> {
    #[inline]
    fn table(&self) -> &'a Table {
        self.index.load_table(self.guard)
    }

    /// Sets tier bit `t` of `slot` for `seq`; returns the slot's tiers before (0: it did not
    /// hold `seq`).
    fn add(&mut self, slot: u32, seq: u64, t: u8) -> u8 {
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
    fn remove(&mut self, slot: u32, seq: u64, tiers: u8) {
        if let RemoveOutcome::Removed { dead: true } =
            self.table()
                .remove(seq, slot, tiers, self.ledger, self.scratch)
        {
            self.counts.live -= 1;
        }
    }

    /// An engine hash of `wb`'s worker that maps to `seq` got its first copy in tier bit `t`
    /// (`new_mapping`: it did not map to `seq` before).
    fn first_copy(&mut self, wb: &mut WorkerBlocks, seq: u64, t: u8, new_mapping: bool) {
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
    fn last_copy(&mut self, wb: &mut WorkerBlocks, seq: u64, t: u8) {
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
    fn unmapped(wb: &mut WorkerBlocks, seq: u64) {
        if let Some(a) = wb.aliases.get_mut(&seq) {
            a.engines -= 1;
            if a.engines <= 1 {
                wb.aliases.remove(&seq);
            }
        }
    }

    /// Drops every copy of `e` (held as `h`): the engine hash no longer maps to anything.
    fn drop_engine(&mut self, wb: &mut WorkerBlocks, e: u64, h: Held) {
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

/// A lock-free index of KV-cache blocks: sequence hash → the workers that hold the block.
///
/// Engines report [`KvEvent`]s per worker ([`BlockIndex::apply`]); routers ask which workers
/// hold the longest leading run of a request's blocks ([`BlockIndex::find_matches`]). Lookups
/// take no lock and write no shared memory; writers serialize among themselves only. Memory
/// per stored block does not depend on how many workers the index has seen.
///
/// ```
/// use kvtrie::{BlockHasher, BlockIndex, KvEvent, StoredBlock, WorkerId};
///
/// let hasher = BlockHasher::new(4);
/// let index = BlockIndex::with_hasher(&hasher);
/// let prompt: Vec<u32> = (0..12).collect(); // three blocks
/// let local = hasher.local_hashes(&prompt);
/// let seq = hasher.sequence_hashes(&prompt);
/// // Worker 0 stores the first two blocks, then the third under its parent.
/// let stored = |e: &[usize]| e.iter().map(|&i| StoredBlock { engine_hash: seq[i], local_hash: local[i] }).collect();
/// index.apply(WorkerId(0), KvEvent::Stored { parent: None, blocks: stored(&[0, 1]) }).unwrap();
/// index.apply(WorkerId(0), KvEvent::Stored { parent: Some(seq[1]), blocks: stored(&[2]) }).unwrap();
/// // Worker 1 holds only the first block.
/// index.apply(WorkerId(1), KvEvent::Stored { parent: None, blocks: stored(&[0]) }).unwrap();
///
/// let scores = index.find_matches(&local);
/// assert_eq!((scores.get(WorkerId(0)), scores.get(WorkerId(1))), (3, 1));
/// assert_eq!(index.find_matches_tokens(&prompt), scores);
///
/// index.apply(WorkerId(0), KvEvent::Removed { engine_hashes: vec![seq[1]] }).unwrap();
/// assert_eq!(index.find_matches(&local).get(WorkerId(0)), 1);
/// assert_eq!(index.total_blocks(), 3);
/// ```
pub struct BlockIndex {
    hasher: BlockHasher,
    // Invariant: never null; points to a `Table` from `Box::into_raw`. Replaced only by a
    // writer holding `writer`, which retires the previous pointer through `reclaim::retire`
    // right after the Release swap; the current one is freed by `Drop`.
    table: AtomicPtr<Table>,
    /// The reader-visible slot names; every slot any holder names in any reachable table has
    /// been named in a directory published before that holder.
    names: Names,
    writer: Mutex<Writer>,
    /// Slots released after a grace period, ready for reuse.
    free_slots: Arc<Mutex<Vec<u32>>>,
}

impl Default for BlockIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl core::fmt::Debug for BlockIndex {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("BlockIndex")
            .field("hasher", &self.hasher)
            .field("total_blocks", &self.total_blocks())
            .finish_non_exhaustive()
    }
}

impl BlockIndex {
    /// The most workers an index names at once (2²⁷); a `Stored` event for one more worker is
    /// rejected with [`EventError::TooManyWorkers`].
    pub const MAX_WORKERS: usize = MAX_SLOTS as usize;

    /// An empty index with the default hasher (seed 1337, block size 16).
    pub fn new() -> Self {
        Self::with_hasher(&BlockHasher::new(16))
    }

    /// An empty index that chains sequence hashes with `hasher`'s seed (use the salted hasher
    /// the local hashes come from) and hashes tokens with its block size in
    /// [`Self::find_matches_tokens`].
    pub fn with_hasher(hasher: &BlockHasher) -> Self {
        let table = Box::into_raw(Box::new(Table::new(0)));
        Self {
            hasher: *hasher,
            table: AtomicPtr::new(table),
            names: Names::new(),
            writer: Mutex::new(Writer {
                workers: HashMap::new(),
                slots: 0,
                counts: Counts::default(),
                ledger: SetLedger::default(),
                scratch: Scratch::default(),
            }),
            free_slots: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// An empty index whose first worker gets slot `first_slot` (loom models use it to reach
    /// the holder forms of high slots with few workers).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn with_first_slot(first_slot: u32) -> Self {
        let index = Self::new();
        lock(&index.writer).slots = first_slot.min(MAX_SLOTS);
        index
    }

    /// An empty index with seed `seed` and block size 16.
    pub fn with_seed(seed: u64) -> Self {
        Self::with_hasher(&BlockHasher::with_seed(16, seed))
    }

    /// The hasher whose seed chains sequence hashes.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The current table, valid while both `self` and `guard` live.
    #[inline]
    fn load_table<'a>(&'a self, _guard: &'a Guard) -> &'a Table {
        // Safety: `table` is never null and points to a live `Table` (Invariant). A table is
        // freed only by its retire destructor, which runs after every guard that was active
        // when it was retired (including `_guard`, whose lifetime bounds the reference) has
        // been dropped, or by `Drop`, which cannot run while `&self` (also bounding the
        // reference) is borrowed. Acquire pairs with the writer's Release swap, so the
        // table's initial contents are visible.
        unsafe { &*self.table.load(Ordering::Acquire) }
    }

    // ----------------------------------------------------------------------------------------
    // Readers
    // ----------------------------------------------------------------------------------------

    /// For every worker, the number of leading blocks of a request it holds, given the
    /// request's **local** block hashes in order (sequence hashes are chained on the fly with
    /// this index's seed). Stops as soon as no worker can extend its run.
    pub fn find_matches(&self, local_hashes: &[u64]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_into(local_hashes, &mut out);
        out
    }

    /// [`Self::find_matches`] into the caller's storage (no allocation once `out` has grown).
    pub fn find_matches_into(&self, local_hashes: &[u64], out: &mut OverlapScores) {
        let seed = self.hasher.seed();
        let mut prev = None;
        self.scan(
            local_hashes.iter().map(|&l| {
                let s = match prev {
                    None => l,
                    Some(p) => chain(p, l, seed),
                };
                prev = Some(s);
                s
            }),
            &TierWeights::default().as_array(),
            out,
        );
    }

    /// [`Self::find_matches`] with tier weights for [`OverlapScores::weighted`] (the block
    /// counts do not depend on them).
    ///
    /// ```
    /// use kvtrie::blocks::{BlockIndex, KvEvent, StoredBlock, Tier, TierWeights, WorkerId};
    /// let index = BlockIndex::new();
    /// let blocks: Vec<StoredBlock> = (1..=4)
    ///     .map(|i| StoredBlock { engine_hash: i, local_hash: 10 * i })
    ///     .collect();
    /// // Worker 1 holds the chain on the GPU, worker 2 only in host memory.
    /// index.apply(WorkerId(1), KvEvent::Stored { parent: None, blocks: blocks.clone() }).unwrap();
    /// index.apply_in(WorkerId(2), Tier::Cpu, KvEvent::Stored { parent: None, blocks }).unwrap();
    /// let s = index.find_matches_weighted(&[10, 20, 30, 40], &TierWeights::default());
    /// assert_eq!((s.get(WorkerId(1)), s.get(WorkerId(2))), (4, 4));
    /// assert_eq!((s.weighted(WorkerId(1)), s.weighted(WorkerId(2))), (4.0, 3.2));
    /// ```
    pub fn find_matches_weighted(
        &self,
        local_hashes: &[u64],
        weights: &TierWeights,
    ) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_weighted_into(local_hashes, weights, &mut out);
        out
    }

    /// [`Self::find_matches_weighted`] into the caller's storage.
    pub fn find_matches_weighted_into(
        &self,
        local_hashes: &[u64],
        weights: &TierWeights,
        out: &mut OverlapScores,
    ) {
        let seed = self.hasher.seed();
        let mut prev = None;
        self.scan(
            local_hashes.iter().map(|&l| {
                let s = match prev {
                    None => l,
                    Some(p) => chain(p, l, seed),
                };
                prev = Some(s);
                s
            }),
            &weights.as_array(),
            out,
        );
    }

    /// [`Self::find_matches`] for already chained **sequence** hashes.
    pub fn find_matches_seq(&self, seq_hashes: &[u64]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_seq_into(seq_hashes, &mut out);
        out
    }

    /// [`Self::find_matches_seq`] into the caller's storage.
    pub fn find_matches_seq_into(&self, seq_hashes: &[u64], out: &mut OverlapScores) {
        self.scan(
            seq_hashes.iter().copied(),
            &TierWeights::default().as_array(),
            out,
        );
    }

    /// [`Self::find_matches`] straight from tokens, hashed with this index's hasher. Blocks
    /// past the point where no worker matches are not hashed at all.
    pub fn find_matches_tokens(&self, tokens: &[u32]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_tokens_into(tokens, &mut out);
        out
    }

    /// [`Self::find_matches_tokens`] into the caller's storage.
    pub fn find_matches_tokens_into(&self, tokens: &[u32], out: &mut OverlapScores) {
        let seed = self.hasher.seed();
        let mut prev = None;
        self.scan(
            tokens.chunks_exact(self.hasher.block_size()).map(|b| {
                let l = hash_u32s(b, seed);
                let s = match prev {
                    None => l,
                    Some(p) => chain(p, l, seed),
                };
                prev = Some(s);
                s
            }),
            &TierWeights::default().as_array(),
            out,
        );
    }

    /// The lookup proper: lock-free, no shared writes, no allocation beyond `out`'s storage.
    ///
    /// Three modes, each entered at most once and in this order, because each handles a
    /// superset of the holder forms of the previous one:
    ///
    /// 1. **small bitset**: while every block's holders are in the inline bitset form (holders
    ///    in slots 0..58 sharing one tier mask, the common case) the active workers are one
    ///    `u64`, and their per-tier runs and weight one shared state;
    /// 2. **wide bitset**: while the active workers hold each block in one shared tier mask,
    ///    they are a bitset over the slot range they span, intersected word by word with dense
    ///    sets (or bit by bit with pairs and sparse sets), still with one shared state;
    /// 3. **list**: otherwise, a sorted list of active workers with their own per-tier runs,
    ///    merged with each block's sorted holders.
    fn scan(
        &self,
        seqs: impl Iterator<Item = u64>,
        weights: &[f64; TIERS],
        out: &mut OverlapScores,
    ) {
        out.entries.clear();
        let guard = reclaim::pin();
        // Order matters: slot names first, then the table (module docs, "Worker slots").
        let names = self.names.load(&guard);
        let table = self.load_table(&guard);
        let mut seqs = seqs;
        let mut depth = 0usize;
        let mut active = u64::MAX;
        let mut shared = Shared::new();
        let mut pending = None;
        for seq in seqs.by_ref() {
            let word = table.word(seq);
            let Some((m, held)) = bits_of(word) else {
                pending = Some(word);
                break;
            };
            let bits = held & active;
            if bits != active {
                if depth > 0 {
                    out.push_bits(names, 0, active & !bits, depth, &shared);
                }
                active = bits;
                if bits == 0 {
                    break;
                }
            }
            shared.step(m, depth, weights);
            depth += 1;
        }
        match pending {
            Some(word) => Self::scan_wide(
                names,
                table,
                &guard,
                decode(word, &guard),
                active,
                depth,
                shared,
                seqs,
                weights,
                out,
            ),
            None if depth > 0 => out.push_bits(names, 0, active, depth, &shared),
            None => {}
        }
        drop(guard);
        out.entries.sort_unstable_by_key(|e| e.worker);
    }

    /// Modes 2 and 3 of [`Self::scan`], from the block whose holders are `first`, at `depth`
    /// leading blocks matched by the slots of `active` with state `shared` (`depth == 0`: none
    /// yet, `first` is the request's first block).
    #[allow(clippy::too_many_arguments)]
    fn scan_wide(
        names: &SlotNames,
        table: &Table,
        guard: &Guard,
        first: Holders<'_>,
        active: u64,
        mut depth: usize,
        mut shared: Shared,
        mut seqs: impl Iterator<Item = u64>,
        weights: &[f64; TIERS],
        out: &mut OverlapScores,
    ) {
        let mut wide = Wide {
            words: core::mem::take(&mut out.wide),
            next: core::mem::take(&mut out.next),
            off: 0,
            lo: 0,
            hi: 0,
        };
        wide.words.clear();
        // The holders at which the scan must switch to list mode, if it must.
        let mut to_list = None;
        if depth == 0 {
            match uniform_mask(first) {
                Some(m) => {
                    // `first` is a pair or an out-of-line set, so it has a holder.
                    let mut min = u32::MAX;
                    let mut max = 0;
                    for_each_holder(first, |slot, _| {
                        min = min.min(slot);
                        max = max.max(slot);
                    });
                    wide.off = min as usize / 64;
                    wide.lo = wide.off;
                    wide.hi = max as usize / 64 + 1;
                    wide.words.resize(wide.hi - wide.off, 0);
                    let (off, words) = (wide.off, &mut wide.words);
                    for_each_holder(first, |slot, _| {
                        words[slot as usize / 64 - off] |= 1 << (slot % 64);
                    });
                    shared.step(m, 0, weights);
                    depth = 1;
                }
                None => {
                    Self::scan_list(
                        names,
                        table,
                        guard,
                        Vec::new(),
                        first,
                        0,
                        seqs,
                        weights,
                        out,
                    );
                    wide.words.clear();
                    out.wide = wide.words;
                    out.next = wide.next;
                    return;
                }
            }
        } else {
            wide.words.push(active);
            wide.hi = 1;
            match wide.step(names, first, depth, &shared, out) {
                Some((true, m)) => {
                    shared.step(m, depth, weights);
                    depth += 1;
                }
                Some((false, _)) => {}
                None => to_list = Some(first),
            }
        }
        if to_list.is_none() && wide.lo < wide.hi {
            for seq in seqs.by_ref() {
                let h = decode(table.word(seq), guard);
                match wide.step(names, h, depth, &shared, out) {
                    Some((true, m)) => {
                        shared.step(m, depth, weights);
                        depth += 1;
                    }
                    Some((false, _)) => break,
                    None => {
                        to_list = Some(h);
                        break;
                    }
                }
            }
        }
        match to_list {
            Some(h) => {
                let mut list = core::mem::take(&mut out.active);
                list.clear();
                for k in wide.lo..wide.hi {
                    let mut bits = wide.words[k - wide.off];
                    while bits != 0 {
                        list.push(shared.active((k * 64) as u32 + bits.trailing_zeros(), depth));
                        bits &= bits - 1;
                    }
                }
                Self::scan_list(names, table, guard, list, h, depth, seqs, weights, out);
            }
            None => {
                for k in wide.lo..wide.hi {
                    out.push_bits(names, k, wide.words[k - wide.off], depth, &shared);
                }
            }
        }
        wide.words.clear();
        out.wide = wide.words;
        out.next = wide.next;
    }

    /// Mode 3 of [`Self::scan`]: `list` holds the workers matching `depth` leading blocks
    /// (`depth == 0`: none yet, `first` is the request's first block), `first` the holders of
    /// the block at `depth`.
    #[allow(clippy::too_many_arguments)]
    fn scan_list(
        names: &SlotNames,
        table: &Table,
        guard: &Guard,
        mut list: Vec<Active>,
        first: Holders<'_>,
        mut depth: usize,
        seqs: impl Iterator<Item = u64>,
        weights: &[f64; TIERS],
        out: &mut OverlapScores,
    ) {
        let best = best_weights(weights);
        if depth == 0 {
            list.clear();
            for_each_holder(first, |slot, run| {
                list.push(Active {
                    slot,
                    run,
                    lead: [0; TIERS],
                    weighted: best[run as usize],
                })
            });
            depth = 1;
        } else {
            Self::step(names, &mut list, first, depth, &best, out);
            if !list.is_empty() {
                depth += 1;
            }
        }
        if !list.is_empty() {
            for seq in seqs {
                let h = decode(table.word(seq), guard);
                Self::step(names, &mut list, h, depth, &best, out);
                if list.is_empty() {
                    break;
                }
                depth += 1;
            }
        }
        for a in &list {
            out.push_active(names, a, depth);
        }
        list.clear();
        out.active = list;
    }

    /// Intersects the active workers with the holders `h` of the block at `depth` (0-based):
    /// workers that do not hold it end with `depth` blocks.
    #[inline]
    fn step(
        names: &SlotNames,
        list: &mut Vec<Active>,
        h: Holders<'_>,
        depth: usize,
        best: &BestWeights,
        out: &mut OverlapScores,
    ) {
        let mut from = 0usize;
        let mut keep = 0usize;
        for i in 0..list.len() {
            let mut a = list[i];
            let tiers = tiers_in(h, a.slot, &mut from);
            if tiers == 0 {
                out.push_active(names, &a, depth);
                continue;
            }
            let dropped = a.run & !tiers;
            if dropped != 0 {
                for (t, lead) in a.lead.iter_mut().enumerate() {
                    if dropped & (1 << t) != 0 {
                        *lead = depth;
                    }
                }
                a.run &= tiers;
            }
            a.weighted += best[tiers as usize];
            list[keep] = a;
            keep += 1;
        }
        list.truncate(keep);
    }

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

    fn store(
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
    fn flush(cx: &mut Ctx<'_>, wb: &mut WorkerBlocks, pending: &[(u64, bool)], t: u8) {
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

    fn register(&self, w: &mut Writer, worker: WorkerId, guard: &Guard) -> Result<(), EventError> {
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

    /// Replaces the table by a rebuilt one of `cap` slots, dropping dead keys.
    fn rebuild(&self, counts: &mut Counts, cap: usize, guard: &Guard) {
        let old_ref = self.load_table(guard);
        let (new, used) = old_ref.rebuild(cap);
        let new = Box::into_raw(Box::new(new));
        // Release publishes the new table's contents to readers that Acquire-load it.
        let old = self.table.swap(new, Ordering::AcqRel);
        counts.used = used;
        // Safety: `old` came from `Box::into_raw` and is now unlinked (the swap replaced it),
        // so only readers pinned before this point can hold it; it is retired exactly once
        // (only the writer that swaps it out retires it). Writers are serialized, so no writer
        // still modifies it; readers holding it see a frozen, consistent older state.
        unsafe { reclaim::retire(guard, old, drop_table) };
    }

    /// Removes every holder of `wb`'s worker (all tiers) and forgets its blocks.
    fn drop_all(
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

    /// Rebuilds a mostly dead or empty table smaller.
    fn maybe_shrink(&self, counts: &mut Counts, guard: &Guard) {
        let table = self.load_table(guard);
        if table.cap() > 64 && counts.live * 8 < table.cap() {
            self.rebuild(counts, Table::cap_for(counts.live), guard);
        }
    }

    // ----------------------------------------------------------------------------------------
    // Introspection
    // ----------------------------------------------------------------------------------------

    /// Blocks (engine hashes) `worker` holds.
    pub fn block_count(&self, worker: WorkerId) -> usize {
        lock(&self.writer)
            .workers
            .get(&worker)
            .map_or(0, |wb| wb.len())
    }

    /// Σ over workers of the blocks each holds.
    pub fn total_blocks(&self) -> usize {
        lock(&self.writer).counts.total_blocks
    }

    /// Distinct sequence hashes held by at least one worker.
    pub fn distinct_blocks(&self) -> usize {
        lock(&self.writer).counts.live
    }

    /// Known workers (those with a successful `Stored` event and not removed), sorted.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut v: Vec<WorkerId> = lock(&self.writer).workers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Event counters.
    pub fn stats(&self) -> IndexStats {
        lock(&self.writer).counts.stats
    }

    /// Heap bytes owned by the index: the current table, its out-of-line holder sets and slot
    /// names, and the writer's bookkeeping (hash maps estimated from their capacities).
    /// Retired tables and sets that the reclaimer has not freed yet are not counted.
    pub fn heap_bytes(&self) -> usize {
        let w = lock(&self.writer);
        let guard = reclaim::pin();
        let table = self.load_table(&guard);
        let mut bytes = core::mem::size_of::<Table>() + table.heap_bytes();
        bytes += w.ledger.live_bytes;
        bytes += self.names.load(&guard).heap_bytes();
        bytes += w.scratch.heap_bytes();
        // hashbrown: one control byte per bucket plus the entry; capacity ≈ 7/8 of buckets.
        let hm = |cap: usize, entry: usize| cap * 8 / 7 * (entry + 1);
        bytes += hm(
            w.workers.capacity(),
            core::mem::size_of::<(WorkerId, WorkerBlocks)>(),
        );
        for wb in w.workers.values() {
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

    /// Current table capacity, for tests.
    #[cfg(test)]
    fn table_cap(&self) -> usize {
        let guard = reclaim::pin();
        self.load_table(&guard).cap()
    }
}

// --------------------------------------------------------------------------------------------
// Snapshot support (the format lives in `persist.rs`)
// --------------------------------------------------------------------------------------------

/// Copies per tier of one block in a snapshot.
pub(super) type TierCopies = [u8; TIERS];

impl BlockIndex {
    /// The known workers in slot order, and the event counters, read together.
    pub(super) fn snapshot_workers(&self) -> (Vec<WorkerId>, IndexStats) {
        let w = lock(&self.writer);
        let mut v: Vec<(u32, WorkerId)> = w.workers.iter().map(|(&k, wb)| (wb.slot, k)).collect();
        v.sort_unstable();
        (v.into_iter().map(|(_, k)| k).collect(), w.counts.stats)
    }

    /// `worker`'s blocks, read under the writer lock (one consistent state of the worker):
    /// those held as exactly one GPU copy into `simple` as `(engine hash, sequence hash)`, the
    /// others into `multi` with their copies per tier; both cleared first, in no particular
    /// order. False (and both empty) if the worker is not known.
    pub(super) fn worker_blocks_into(
        &self,
        worker: WorkerId,
        simple: &mut Vec<(u64, u64)>,
        multi: &mut Vec<(u64, u64, TierCopies)>,
    ) -> bool {
        simple.clear();
        multi.clear();
        let w = lock(&self.writer);
        let Some(wb) = w.workers.get(&worker) else {
            return false;
        };
        simple.reserve(wb.simple.len());
        simple.extend(wb.simple.iter());
        multi.reserve(wb.multi.len());
        multi.extend(wb.multi.iter().map(|(e, h)| (e, h.seq, h.copies)));
        true
    }

    /// Restore: adds `worker` (no blocks yet) in the next free slot. The index must not be
    /// shared yet.
    pub(super) fn restore_worker(&self, worker: WorkerId) -> Result<(), String> {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        if w.workers.contains_key(&worker) {
            return Err(format!(
                "worker {} (engine {}, rank {}) appears twice",
                worker.0,
                worker.engine(),
                worker.dp_rank()
            ));
        }
        self.register(&mut w, worker, &guard)
            .map_err(|e| e.to_string())
    }

    /// Restore: gives `worker` (added by [`Self::restore_worker`]) the blocks `blocks`, each
    /// `(engine hash, sequence hash, copies per tier)`, exactly as the events that left it
    /// holding them would have. An engine hash the worker already holds, or one without any
    /// copy, is an error (the index then holds part of the blocks, and is to be dropped).
    pub(super) fn restore_blocks(
        &self,
        worker: WorkerId,
        blocks: &[(u64, u64, TierCopies)],
    ) -> Result<(), String> {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let Writer {
            workers,
            counts,
            ledger,
            scratch,
            ..
        } = &mut *w;
        let wb = workers
            .get_mut(&worker)
            .ok_or_else(|| format!("blocks for worker {} before its record", worker.0))?;
        // Room for the batch up front, growing by doubling (restores are bulk loads). Both are
        // bounded by the batch, whose bytes were read.
        let n = blocks.len();
        let gpu = blocks.iter().filter(|b| b.2 == ONE_GPU).count();
        wb.simple.reserve(gpu);
        wb.multi.reserve(n - gpu);
        if !self.load_table(&guard).has_room(counts.used + n) {
            let cap = Table::cap_for((counts.live + n).max(counts.live * 2));
            self.rebuild(counts, cap, &guard);
        }
        let mut cx = Ctx {
            index: self,
            counts,
            ledger,
            scratch,
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
                cx.counts.total_blocks += 1;
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
        cx.ledger.retire(&guard);
        result
    }

    /// Restore: sets the event counters.
    pub(super) fn restore_stats(&self, stats: IndexStats) {
        lock(&self.writer).counts.stats = stats;
    }

    /// Checks that the writer's bookkeeping and the shared table agree (test support,
    /// feature `testing`; O(blocks), takes the writer lock): every worker has its own slot,
    /// named in the slot directory; no engine hash is in both per-worker maps, none without a
    /// copy, none held as one GPU copy outside the compact map; the sequence hashes several
    /// engine hashes map to are exactly the aliases, with the right counts; the table holds
    /// exactly, per `(sequence hash, worker)`, the tiers some engine hash of the worker
    /// mapping to it has a copy in; and the block and live-key counters match.
    #[cfg(all(any(test, feature = "testing"), not(loom)))]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn check_invariants(&self) -> Result<(), String> {
        use std::collections::HashSet;
        let w = lock(&self.writer);
        let guard = reclaim::pin();
        let names = self.names.load(&guard);
        let table = self.load_table(&guard);
        let mut expected: HashMap<(u64, u32), u8> = HashMap::new();
        let mut slots = HashSet::new();
        let mut total = 0usize;
        for (&worker, wb) in &w.workers {
            let id = worker.0;
            if wb.slot >= w.slots {
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
        if total != w.counts.total_blocks {
            return Err(format!(
                "total_blocks is {}, the workers hold {total}",
                w.counts.total_blocks
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
        if live.len() != w.counts.live {
            return Err(format!(
                "the live-key counter is {}, the table has {}",
                w.counts.live,
                live.len()
            ));
        }
        Ok(())
    }
}

impl Drop for BlockIndex {
    fn drop(&mut self) {
        let table = self.table.load(Ordering::Relaxed);
        let mut sets = SetLedger::default();
        // Safety: `&mut self` means no reader or writer of this index is running; the current
        // table was never retired (only swapped-out ones are), so freeing it here is its only
        // release. Its holder sets go to a ledger that frees them when it drops (no reader can
        // reach them any more).
        unsafe { (*table).unlink_all(&mut sets) };
        // Safety: as above; the table came from `Box::into_raw` and is freed once, here.
        drop(unsafe { Box::from_raw(table) });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
        assert_eq!(lock(&index.writer).ledger.live_sets, 3);
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
        let st = lock(&index.writer);
        assert_eq!(st.ledger.live_sets, 0);
        assert_eq!(st.counts.live, n as usize);
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
            let w = lock(&index.writer);
            assert_eq!(w.workers[&WorkerId(2)].slot, 1, "slot 0 not yet reusable");
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
            let w = lock(&index.writer);
            assert_eq!(w.workers[&WorkerId(3)].slot, 0, "slot 0 recycled");
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
        let w = lock(&index.writer);
        // Local hash 0 (block 0) lives out of line and uses no slot.
        assert_eq!((w.counts.live, w.counts.used), (n as usize, n as usize - 1));
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
        let w = lock(&index.writer);
        assert_eq!(w.counts.live, 0);
    }
}

/// Model checks of the reader/writer protocol: `RUSTFLAGS="--cfg loom --cfg crossbeam_loom"
/// LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib blocks::index::loom_tests`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::sync::thread;

    fn one(engine_hash: u64, local_hash: u64) -> [StoredBlock; 1] {
        [StoredBlock {
            engine_hash,
            local_hash,
        }]
    }

    /// A reader racing `remove_worker` + a new worker (which may get the recycled slot once the
    /// writer's flushes end the grace period) never attributes one worker's block to the other.
    #[test]
    fn remove_worker_vs_reader() {
        loom::model(|| {
            let index = Arc::new(BlockIndex::new());
            index.store_blocks(WorkerId(1), None, &one(1, 10)).unwrap();
            let writer = {
                let index = Arc::clone(&index);
                thread::spawn(move || {
                    index.remove_worker(WorkerId(1));
                    for _ in 0..2 {
                        index.collect_garbage();
                    }
                    index.store_blocks(WorkerId(2), None, &one(2, 20)).unwrap();
                })
            };
            let a = index.find_matches(&[10]);
            let b = index.find_matches(&[20]);
            assert_eq!(a.get(WorkerId(2)), 0, "{a:?}");
            assert_eq!(b.get(WorkerId(1)), 0, "{b:?}");
            writer.join().unwrap();
            assert!(index.find_matches(&[10]).is_empty());
            assert_eq!(index.find_matches(&[20]).get(WorkerId(2)), 1);
        });
    }

    /// A chain stored before the reader starts stays fully visible while the writer's inserts
    /// fill the table and it is rebuilt (RCU swap + retire).
    #[test]
    fn reader_vs_rebuild() {
        loom::model(|| {
            let index = Arc::new(BlockIndex::new());
            let base: Vec<StoredBlock> = (1..=11)
                .map(|i| StoredBlock {
                    engine_hash: i,
                    local_hash: i * 1000,
                })
                .collect();
            index.store_blocks(WorkerId(1), None, &base).unwrap();
            let cap = index.table_cap();
            let writer = {
                let index = Arc::clone(&index);
                thread::spawn(move || {
                    // Two more keys: the second finds 12 of 16 slots used and rebuilds.
                    let more: Vec<StoredBlock> = (1..=2)
                        .map(|i| StoredBlock {
                            engine_hash: i,
                            local_hash: 77 + i,
                        })
                        .collect();
                    index.store_blocks(WorkerId(2), None, &more).unwrap();
                })
            };
            let locals: Vec<u64> = (1..=11).map(|i| i * 1000).collect();
            assert_eq!(index.find_matches(&locals).get(WorkerId(1)), 11);
            writer.join().unwrap();
            assert_ne!(index.table_cap(), cap, "the table was rebuilt");
            assert_eq!(index.find_matches(&locals).get(WorkerId(1)), 11);
            assert_eq!(index.find_matches(&[78, 79]).get(WorkerId(2)), 2);
        });
    }
}
