//! [`BlockIndex`]: which worker holds which KV blocks, fed by engine events, with lock-free
//! per-worker overlap scoring.
//!
//! # Concurrency protocol
//!
//! - **Readers** ([`BlockIndex::find_matches`] and friends) pin the epoch once, Acquire-load the
//!   slot-name snapshot and then the table pointer, probe the table with Acquire key loads and
//!   Relaxed bitset loads. They take no lock, write no shared memory and allocate only the
//!   result.
//! - **Writers** ([`BlockIndex::apply`], [`BlockIndex::remove_worker`]) serialize on one mutex
//!   that owns all bookkeeping (per-worker engine hash → sequence hash maps, worker → dense
//!   slot). They flip bits in the shared table with `fetch_or`/`fetch_and`, insert keys with the
//!   write-once protocol of `table.rs`, and grow or purge the table by building a new one and
//!   swapping the pointer (RCU), retiring the old table through `crate::reclaim::retire`.
//! - **Worker slots.** The reader-visible slot → [`WorkerId`] mapping is an immutable snapshot
//!   behind an atomic pointer, replaced (RCU) when a worker is added or removed. Removing a
//!   worker clears all its bits, publishes a snapshot without it, and only then retires a
//!   release token for its slot; the slot returns to the free list when the token's destructor
//!   runs, i.e. after every reader pinned at the time has unpinned. A reader loads the snapshot
//!   *before* the table, so a bit it sees for slot `s` belongs either to the worker its
//!   snapshot names for `s` (the slot cannot be reused while the reader stays pinned) or, if its
//!   snapshot names nobody, is ignored. No reader attributes one worker's block to another.

use std::collections::HashMap;

use super::event::{KvEvent, StoredBlock, WorkerId};
use super::hash::{chain, hash_u32s, BlockHasher};
use super::map::EngineMap;
use super::table::{ClearOutcome, SetOutcome, Table};
use crate::reclaim::{self, Guard};
use crate::sync::{lock, Arc, AtomicPtr, Mutex, Ordering};

/// How many blocks ahead `store_blocks` prefetches the worker's map slots.
const PREFETCH_AHEAD: usize = 8;
/// Blocks per batch of table updates in `store_blocks`.
const STORE_CHUNK: usize = 16;

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
}

impl core::fmt::Display for EventError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            EventError::UnknownParent { worker, parent } => write!(
                f,
                "worker {} stored blocks under unknown parent block {parent:#x}",
                worker.0
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
    /// `(worker, leading blocks held)`, score > 0, sorted by worker.
    scores: Vec<(WorkerId, usize)>,
    /// Scratch bitset for indexes with more than 64 worker slots.
    scratch: Vec<u64>,
}

impl OverlapScores {
    /// An empty result, to pass to [`BlockIndex::find_matches_into`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of leading request blocks `worker` holds (0 if none or unknown).
    pub fn get(&self, worker: WorkerId) -> usize {
        match self.scores.binary_search_by_key(&worker, |&(w, _)| w) {
            Ok(i) => self.scores[i].1,
            Err(_) => 0,
        }
    }

    /// `(worker, score)` for every worker with a positive score, sorted by worker.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, usize)> + '_ {
        self.scores.iter().copied()
    }

    /// Number of workers with a positive score.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// Whether no worker holds the request's first block.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// The best score (0 when empty).
    pub fn max(&self) -> usize {
        self.scores.iter().map(|&(_, s)| s).max().unwrap_or(0)
    }

    /// The worker with the best score (the smallest [`WorkerId`] among ties), if any.
    pub fn best(&self) -> Option<(WorkerId, usize)> {
        self.scores
            .iter()
            .copied()
            .fold(None, |b: Option<(WorkerId, usize)>, (w, s)| match b {
                Some((_, bs)) if bs >= s => b,
                _ => Some((w, s)),
            })
    }

    /// Removes all scores, keeping the storage.
    pub fn clear(&mut self) {
        self.scores.clear();
    }

    #[inline]
    fn push_mask(&mut self, names: &SlotNames, word: usize, mut mask: u64, score: usize) {
        while mask != 0 {
            let s = word * 64 + mask.trailing_zeros() as usize;
            mask &= mask - 1;
            if let Some(Some(id)) = names.ids.get(s) {
                self.scores.push((*id, score));
            }
        }
    }
}

impl PartialEq for OverlapScores {
    fn eq(&self, other: &Self) -> bool {
        self.scores == other.scores
    }
}

impl Eq for OverlapScores {}

impl core::fmt::Debug for OverlapScores {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_map()
            .entries(self.scores.iter().map(|(w, s)| (w.0, s)))
            .finish()
    }
}

/// Reader-visible slot → worker mapping; immutable once published.
struct SlotNames {
    ids: Box<[Option<WorkerId>]>,
    /// Under loom, set by the retire destructor instead of freeing (see `crate::sync`).
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
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
    // Safety: forwarded to the caller.
    drop(unsafe { Box::from_raw(p) });
}

/// Frees a retired slot-name snapshot.
///
/// # Safety
///
/// As for [`drop_table`].
unsafe fn drop_names(p: *mut SlotNames) {
    #[cfg(loom)]
    // Safety: forwarded to the caller; leaked, never freed, under loom.
    unsafe {
        (*p).poison.poison()
    };
    #[cfg(not(loom))]
    // Safety: forwarded to the caller.
    drop(unsafe { Box::from_raw(p) });
}

/// One worker's writer-side bookkeeping.
struct WorkerBlocks {
    slot: u32,
    /// Engine hash → sequence hash.
    blocks: EngineMap,
    /// Sequence hashes that more than one engine hash of this worker maps to: the number of
    /// extra engine hashes. The worker's table bit is cleared when the last one goes.
    extra: HashMap<u64, u32>,
}

/// Everything writers own, behind the writer mutex.
struct Writer {
    workers: HashMap<WorkerId, WorkerBlocks>,
    /// Writer copy of the published slot names.
    names: Vec<Option<WorkerId>>,
    counts: Counts,
}

/// Writer-side counters.
#[derive(Default)]
struct Counts {
    /// Non-empty slots of the current table (live + dead).
    used: usize,
    /// Keys of the current table with at least one bit set.
    live: usize,
    /// Σ over workers of blocks held.
    total_blocks: usize,
    stats: IndexStats,
}

/// A lock-free index of KV-cache blocks: sequence hash → the workers that hold the block.
///
/// Engines report [`KvEvent`]s per worker ([`BlockIndex::apply`]); routers ask which workers
/// hold the longest leading run of a request's blocks ([`BlockIndex::find_matches`]). Lookups
/// take no lock and write no shared memory; writers serialize among themselves only.
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
    // Invariant: as for `table`, for the slot-name snapshot. Always at least as long as the
    // largest slot any worker bit is set for in any table.
    names: AtomicPtr<SlotNames>,
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
    /// An empty index with the default hasher (seed 1337, block size 16).
    pub fn new() -> Self {
        Self::with_hasher(&BlockHasher::new(16))
    }

    /// An empty index that chains sequence hashes with `hasher`'s seed (use the salted hasher
    /// the local hashes come from) and hashes tokens with its block size in
    /// [`Self::find_matches_tokens`].
    pub fn with_hasher(hasher: &BlockHasher) -> Self {
        let table = Box::into_raw(Box::new(Table::new(0, 1)));
        let names = Box::into_raw(Box::new(SlotNames {
            ids: Box::new([]),
            #[cfg(loom)]
            poison: crate::sync::PoisonFlag::default(),
        }));
        Self {
            hasher: *hasher,
            table: AtomicPtr::new(table),
            names: AtomicPtr::new(names),
            writer: Mutex::new(Writer {
                workers: HashMap::new(),
                names: Vec::new(),
                counts: Counts::default(),
            }),
            free_slots: Arc::new(Mutex::new(Vec::new())),
        }
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
        // reference) is borrowed. Acquire pairs with the
        // writer's Release swap, so the table's initial contents are visible.
        unsafe { &*self.table.load(Ordering::Acquire) }
    }

    /// The current slot-name snapshot, valid while both `self` and `guard` live.
    #[inline]
    fn load_names<'a>(&'a self, _guard: &'a Guard) -> &'a SlotNames {
        // Safety: as in `load_table`, for the `names` pointer.
        let names = unsafe { &*self.names.load(Ordering::Acquire) };
        #[cfg(loom)]
        names.poison.assert_alive("slot-name snapshot");
        names
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
        self.scan(seq_hashes.iter().copied(), out);
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
            out,
        );
    }

    /// The lookup proper: lock-free, no shared writes, no allocation beyond `out`'s storage.
    fn scan(&self, seqs: impl Iterator<Item = u64>, out: &mut OverlapScores) {
        out.scores.clear();
        let guard = reclaim::pin();
        // Order matters: slot names first, then the table (module docs, "Worker slots").
        let names = self.load_names(&guard);
        let table = self.load_table(&guard);
        let mut depth = 0usize;
        if table.words() == 1 {
            let mut active = u64::MAX;
            for seq in seqs {
                let bits = table.word0(seq) & active;
                if depth > 0 {
                    out.push_mask(names, 0, active & !bits, depth);
                }
                active = bits;
                if active == 0 {
                    break;
                }
                depth += 1;
            }
            if depth > 0 {
                out.push_mask(names, 0, active, depth);
            }
        } else {
            let words = table.words();
            let mut active = core::mem::take(&mut out.scratch);
            active.clear();
            active.resize(words, u64::MAX);
            for seq in seqs {
                let found = table.find(seq);
                let mut any = 0;
                for (w, a) in active.iter_mut().enumerate() {
                    let bits = match found {
                        // Relaxed: see `Table::word0`.
                        Some(ws) => ws[w].load(Ordering::Relaxed) & *a,
                        None => 0,
                    };
                    if depth > 0 {
                        out.push_mask(names, w, *a & !bits, depth);
                    }
                    *a = bits;
                    any |= bits;
                }
                if any == 0 {
                    break;
                }
                depth += 1;
            }
            if depth > 0 {
                for (w, &a) in active.iter().enumerate() {
                    out.push_mask(names, w, a, depth);
                }
            }
            out.scratch = active;
        }
        drop(guard);
        out.scores.sort_unstable_by_key(|&(w, _)| w);
    }

    // ----------------------------------------------------------------------------------------
    // Writers
    // ----------------------------------------------------------------------------------------

    /// Applies one engine event for `worker`.
    ///
    /// - `Stored`: maps each block's engine hash to its sequence hash, chained from `parent`'s
    ///   sequence hash (or starting a sequence when `parent` is `None`). Storing a mapping that
    ///   exists is a no-op. An unknown parent rejects the whole event:
    ///   [`EventError::UnknownParent`], nothing stored.
    /// - `Removed`: drops the named blocks; unknown engine hashes are counted in
    ///   [`IndexStats::unknown_removes`], not an error.
    /// - `Cleared`: drops every block of the worker (the worker stays known).
    ///
    /// A worker holds a sequence hash while at least one of its engine hashes maps to it.
    pub fn apply(&self, worker: WorkerId, event: KvEvent) -> Result<(), EventError> {
        match event {
            KvEvent::Stored { parent, blocks } => self.store_blocks(worker, parent, &blocks),
            KvEvent::Removed { engine_hashes } => {
                self.remove_blocks(worker, &engine_hashes);
                Ok(())
            }
            KvEvent::Cleared => {
                self.clear_worker(worker);
                Ok(())
            }
        }
    }

    /// Applies a `Stored` event given by reference (see [`Self::apply`]).
    pub fn store_blocks(
        &self,
        worker: WorkerId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let w = &mut *w;
        let mut prev = match parent {
            None => None,
            Some(p) => match w.workers.get(&worker).and_then(|wb| wb.blocks.get(p)) {
                Some(seq) => Some(seq),
                None => {
                    w.counts.stats.unknown_parents += 1;
                    return Err(EventError::UnknownParent { worker, parent: p });
                }
            },
        };
        w.counts.stats.events_applied += 1;
        if blocks.is_empty() {
            return Ok(());
        }
        if !w.workers.contains_key(&worker) {
            self.register(w, worker, &guard);
        }
        let Writer {
            workers, counts, ..
        } = w;
        let wb = workers.get_mut(&worker).expect("registered above");
        let seed = self.hasher.seed();
        // Blocks go in chunks: first every block's mapping (prefetching map slots a few
        // blocks ahead), then the table bits of the new mappings (prefetched in the first
        // pass), so the cache misses of consecutive blocks overlap.
        let mut pending = [0u64; STORE_CHUNK];
        for (c, chunk) in blocks.chunks(STORE_CHUNK).enumerate() {
            let mut n = 0;
            for (i, b) in chunk.iter().enumerate() {
                if let Some(ahead) = blocks.get(c * STORE_CHUNK + i + PREFETCH_AHEAD) {
                    wb.blocks.prefetch(ahead.engine_hash);
                }
                let seq = match prev {
                    None => b.local_hash,
                    Some(p) => chain(p, b.local_hash, seed),
                };
                prev = Some(seq);
                match wb.blocks.insert(b.engine_hash, seq) {
                    Some(old) if old == seq => continue,
                    Some(old) => {
                        // The engine reused an id for different content: move the mapping.
                        // Set the pending bits first, in case `old` is among them.
                        for &s in &pending[..n] {
                            self.set_ref(counts, wb, s, &guard);
                        }
                        n = 0;
                        Self::release_ref(self.load_table(&guard), counts, wb, old);
                        counts.stats.blocks_stored += 1;
                    }
                    None => {
                        counts.stats.blocks_stored += 1;
                        counts.total_blocks += 1;
                    }
                }
                self.load_table(&guard).prefetch(seq);
                pending[n] = seq;
                n += 1;
            }
            for &s in &pending[..n] {
                self.set_ref(counts, wb, s, &guard);
            }
        }
        Ok(())
    }

    /// Applies a `Removed` event given by reference (see [`Self::apply`]).
    pub fn remove_blocks(&self, worker: WorkerId, engine_hashes: &[u64]) {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let Writer {
            workers, counts, ..
        } = &mut *w;
        counts.stats.events_applied += 1;
        let Some(wb) = workers.get_mut(&worker) else {
            counts.stats.unknown_removes += engine_hashes.len() as u64;
            return;
        };
        let table = self.load_table(&guard);
        for &e in engine_hashes {
            match wb.blocks.remove(e) {
                Some(seq) => {
                    counts.stats.blocks_removed += 1;
                    counts.total_blocks -= 1;
                    Self::release_ref(table, counts, wb, seq);
                }
                None => counts.stats.unknown_removes += 1,
            }
        }
        self.maybe_shrink(counts, &guard);
    }

    /// Drops every block of `worker`; the worker stays registered. No-op for unknown workers.
    pub fn clear_worker(&self, worker: WorkerId) {
        let mut w = lock(&self.writer);
        let guard = reclaim::pin();
        let Writer {
            workers, counts, ..
        } = &mut *w;
        counts.stats.events_applied += 1;
        if let Some(wb) = workers.get_mut(&worker) {
            self.drop_all(counts, wb, &guard);
        }
        self.maybe_shrink(counts, &guard);
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
        let n = wb.blocks.len();
        // 1. Clear the worker's bits (every table from now on is built from these words).
        self.drop_all(&mut w.counts, &mut wb, &guard);
        // 2. Publish slot names without it.
        let slot = wb.slot;
        w.names[slot as usize] = None;
        self.publish_names(&w.names, &guard);
        // 3. Defer the slot's release past every reader that may still name it.
        let token = Box::into_raw(Box::new(SlotRelease {
            slot,
            free: Arc::clone(&self.free_slots),
        }));
        // Safety: the token is a fresh heap object no other thread can reach, retired once;
        // `release_slot` only frees it and pushes the slot onto a mutex-protected list, which
        // is sound on any thread.
        unsafe { reclaim::retire(&guard, token, release_slot) };
        // Removals are rare: push the release to the global queue now, so the slot is reusable
        // after the grace period rather than when this thread's bag fills.
        reclaim::flush(&guard);
        self.maybe_shrink(&mut w.counts, &guard);
        n
    }

    fn register(&self, w: &mut Writer, worker: WorkerId, guard: &Guard) {
        let recycled = lock(&self.free_slots).pop();
        let slot = match recycled {
            Some(s) => s,
            None => w.names.len() as u32,
        };
        if slot as usize == w.names.len() {
            w.names.push(None);
        }
        w.names[slot as usize] = Some(worker);
        // Publish the name before any bit of the slot is set.
        self.publish_names(&w.names, guard);
        let table = self.load_table(guard);
        let needed = slot as usize / 64 + 1;
        if needed > table.words() {
            self.rebuild(&mut w.counts, table.cap(), needed, guard);
        }
        w.workers.insert(
            worker,
            WorkerBlocks {
                slot,
                blocks: EngineMap::default(),
                extra: HashMap::new(),
            },
        );
    }

    fn publish_names(&self, names: &[Option<WorkerId>], guard: &Guard) {
        let new = Box::into_raw(Box::new(SlotNames {
            ids: names.to_vec().into_boxed_slice(),
            #[cfg(loom)]
            poison: crate::sync::PoisonFlag::default(),
        }));
        // Release: readers that Acquire the new snapshot see every bit cleared before it.
        let old = self.names.swap(new, Ordering::AcqRel);
        // Safety: `old` came from `Box::into_raw` and is now unlinked (the swap replaced it),
        // so only readers pinned before this point can hold it; it is retired exactly once
        // (only the writer that swaps it out retires it).
        unsafe { reclaim::retire(guard, old, drop_names) };
    }

    /// Replaces the table by a rebuilt one of `cap` slots and `words` words, dropping dead keys.
    fn rebuild(&self, counts: &mut Counts, cap: usize, words: usize, guard: &Guard) {
        let old_ref = self.load_table(guard);
        let (new, used) = old_ref.rebuild(cap, words);
        let new = Box::into_raw(Box::new(new));
        // Release publishes the new table's contents to readers that Acquire-load it.
        let old = self.table.swap(new, Ordering::AcqRel);
        counts.used = used;
        // Safety: as in `publish_names`: `old` is unlinked by the swap and retired once.
        // Writers are serialized, so no writer still modifies it; readers holding it see a
        // frozen, consistent older state.
        unsafe { reclaim::retire(guard, old, drop_table) };
    }

    /// Records that `wb`'s worker gained a reference to `seq` (its mapping is already in
    /// `wb.blocks`): sets the table bit, or counts an extra reference if it is set.
    fn set_ref(&self, counts: &mut Counts, wb: &mut WorkerBlocks, seq: u64, guard: &Guard) {
        loop {
            let table = self.load_table(guard);
            match table.set_bit(seq, wb.slot as usize, counts.used) {
                SetOutcome::AlreadySet => {
                    // Another engine hash of this worker already maps to `seq`.
                    *wb.extra.entry(seq).or_insert(0) += 1;
                    return;
                }
                SetOutcome::Set { revived, new_slot } => {
                    counts.used += usize::from(new_slot);
                    counts.live += usize::from(revived);
                    return;
                }
                SetOutcome::Full => {
                    let (cap, words) = (Table::cap_for(counts.live), table.words());
                    self.rebuild(counts, cap, words, guard);
                }
            }
        }
    }

    fn release_ref(table: &Table, counts: &mut Counts, wb: &mut WorkerBlocks, seq: u64) {
        if let Some(n) = wb.extra.get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                wb.extra.remove(&seq);
            }
            return;
        }
        if let ClearOutcome::Cleared { dead: true } = table.clear_bit(seq, wb.slot as usize) {
            counts.live -= 1;
        }
    }

    fn drop_all(&self, counts: &mut Counts, wb: &mut WorkerBlocks, guard: &Guard) {
        let table = self.load_table(guard);
        let slot = wb.slot as usize;
        for (_, seq) in wb.blocks.iter() {
            if let ClearOutcome::Cleared { dead: true } = table.clear_bit(seq, slot) {
                counts.live -= 1;
            }
        }
        counts.total_blocks -= wb.blocks.len();
        wb.blocks = EngineMap::default();
        wb.extra = HashMap::new();
    }

    /// Rebuilds a mostly dead or empty table smaller.
    fn maybe_shrink(&self, counts: &mut Counts, guard: &Guard) {
        let table = self.load_table(guard);
        if table.cap() > 64 && counts.live * 8 < table.cap() {
            self.rebuild(counts, Table::cap_for(counts.live), table.words(), guard);
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
            .map_or(0, |wb| wb.blocks.len())
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

    /// Heap bytes owned by the index: the current table and slot names, and the writer's
    /// bookkeeping (hash maps estimated from their capacities). Retired tables that the
    /// reclaimer has not freed yet are not counted.
    pub fn heap_bytes(&self) -> usize {
        let w = lock(&self.writer);
        let guard = reclaim::pin();
        let table = self.load_table(&guard);
        let names = self.load_names(&guard);
        let mut bytes = core::mem::size_of::<Table>() + table.heap_bytes();
        bytes += core::mem::size_of::<SlotNames>()
            + core::mem::size_of_val::<[Option<WorkerId>]>(&names.ids);
        bytes += w.names.capacity() * core::mem::size_of::<Option<WorkerId>>();
        // hashbrown: one control byte per bucket plus the entry; capacity ≈ 7/8 of buckets.
        let hm = |cap: usize, entry: usize| cap * 8 / 7 * (entry + 1);
        bytes += hm(
            w.workers.capacity(),
            core::mem::size_of::<(WorkerId, WorkerBlocks)>(),
        );
        for wb in w.workers.values() {
            bytes += wb.blocks.heap_bytes() + hm(wb.extra.capacity(), 12);
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

    /// Current table capacity and bitset words, for tests.
    #[cfg(test)]
    fn table_shape(&self) -> (usize, usize) {
        let guard = reclaim::pin();
        let t = self.load_table(&guard);
        (t.cap(), t.words())
    }
}

impl Drop for BlockIndex {
    fn drop(&mut self) {
        // Safety: `&mut self` means no reader or writer of this index is running; the current
        // pointers were never retired (only swapped-out ones are), so freeing them here is
        // their only release.
        drop(unsafe { Box::from_raw(self.table.load(Ordering::Relaxed)) });
        // Safety: as above, for the slot-name snapshot.
        drop(unsafe { Box::from_raw(self.names.load(Ordering::Relaxed)) });
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
        assert!(index.table_shape().1 >= 2);
        let s = index.find_matches(&[5, 6, 7]);
        assert_eq!(s.len(), n as usize);
        for w in 0..n {
            assert_eq!(s.get(WorkerId(w)), if w % 2 == 0 { 3 } else { 2 });
        }
        assert_eq!(index.total_blocks(), (2 * n + n / 2) as usize);
    }

    #[test]
    fn slot_reuse_waits_for_grace_period() {
        let index = BlockIndex::new();
        index
            .store_blocks(WorkerId(1), None, &stored(&[(1, 5)]))
            .unwrap();
        // A reader pinned across the removal keeps the slot from being recycled.
        let reader = reclaim::pin();
        let names_before = index.load_names(&reader);
        assert_eq!(names_before.ids[0], Some(WorkerId(1)));
        assert_eq!(index.remove_worker(WorkerId(1)), 1);
        index
            .store_blocks(WorkerId(2), None, &stored(&[(1, 5)]))
            .unwrap();
        {
            let w = lock(&index.writer);
            assert_eq!(w.workers[&WorkerId(2)].slot, 1, "slot 0 not yet reusable");
        }
        // The pinned reader's snapshot still names worker 1 at slot 0, and slot 0's bit is clear.
        assert_eq!(names_before.ids[0], Some(WorkerId(1)));
        assert_eq!(index.load_table(&reader).word0(5), 0b10);
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
        let (cap, _) = index.table_shape();
        assert!(cap * 3 / 4 >= n as usize);
        let w = lock(&index.writer);
        // Local hash 0 (block 0) lives out of line and uses no slot.
        assert_eq!((w.counts.live, w.counts.used), (n as usize, n as usize - 1));
        drop(w);
        index.clear_worker(WorkerId(0));
        assert_eq!(index.table_shape().0, crate::blocks::table::MIN_CAP);
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
            let (cap, _) = index.table_shape();
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
            assert_ne!(index.table_shape().0, cap, "the table was rebuilt");
            assert_eq!(index.find_matches(&locals).get(WorkerId(1)), 11);
            assert_eq!(index.find_matches(&[78, 79]).get(WorkerId(2)), 2);
        });
    }
}
