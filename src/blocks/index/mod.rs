//! [`BlockIndex`]: which worker holds which KV blocks, fed by engine events, with lock-free
//! per-worker overlap scoring.
//!
//! # Concurrency protocol
//!
//! - **Readers** ([`BlockIndex::find_matches`] and friends) pin the epoch once, Acquire-load the
//!   slot-name directory and then the table pointer, probe the table with Acquire key and
//!   holder-word loads. They take no lock, write no shared memory and allocate only the result
//!   (its storage is reused by the `_into` forms).
//! - **Writers** ([`BlockIndex::apply`], [`BlockIndex::remove_worker`]) take three kinds of
//!   lock, always in this order (see *Writers on several threads* below):
//!   1. the **registry** (`RwLock`): shared for the whole of one event, exclusive to add or
//!      remove a worker (and for the views that must see no event half-applied);
//!   2. the event's **worker** (a `Mutex` per worker): its engine hash → sequence hash maps
//!      and alias counts, held for the whole event, so one worker's events apply one at a
//!      time and in the order they were applied;
//!   3. the **table side** (one `Mutex`): the only thread that changes the shared table. It
//!      replaces holder words with whole-word Release stores, inserts keys with the
//!      write-once protocol of `table.rs`, and grows or purges the table by building a new
//!      one and swapping the pointer (RCU), retiring the old table through
//!      `crate::reclaim::retire`. Out-of-line holder sets replaced while it is held are
//!      retired as one batch before it is released.
//!
//!   Event counters (`IndexStats`, the block total) are added up per event and merged under a
//!   fourth, innermost mutex before the event releases the registry.
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
//! # Writers on several threads
//!
//! Engines publish concurrently (the ZMQ subscriber runs a thread per engine), so events for
//! different workers arrive on different threads. Most of an event's work is the worker's own
//! bookkeeping: chaining sequence hashes and updating its engine hash maps. That part runs
//! under the worker's own lock, so writers of different workers do it in parallel. The table
//! changes it implies (set or clear this worker's holder of a sequence hash, count aliases)
//! are recorded in order as *table ops* and applied per chunk of 16 blocks under the
//! table-side lock. Deferring them changes nothing a reader or the worker's bookkeeping can
//! tell apart: the map updates never read the table or the aliases, the table ops never read
//! the maps, a worker's holder bits are changed only by that worker's writer (which holds the
//! worker's lock throughout), and a reader sees each holder change as the single Release store
//! it always was.
//!
//! Measured on W4 `Stored` events (`cargo run --release --example scaling`): the table ops
//! are about a quarter of an event's instructions (callgrind), and two threads applying
//! their own workers' events into one index run 1.74 × one thread, as fast as two threads
//! with an index each (1.72 ×); with one writer mutex they ran 0.5–1.0 ×. What stays
//! serialized is the table itself; from its quarter share of the work, the shared index should
//! stop scaling near four writers (an estimate: this machine has two cores). A table for
//! several writers (compare-and-swap key claims and holder words, a rebuild that excludes
//! them) is the step after this one. Adding or removing a worker takes the registry
//! exclusively, so it waits for the events in flight and holds new ones back meanwhile (both
//! are rare: once per engine start and stop).
//!
//! # Memory per block
//!
//! A table entry is 16 bytes whatever the number of workers (see `table.rs` for the holder
//! forms: a 58-slot bitset with one shared tier mask, one or two inline `(slot, tiers)` holders, or a pointer to an
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
//!
//! # Files
//!
//! | file | concern |
//! |---|---|
//! | `mod.rs` | the facade: [`BlockIndex`], its errors and counters, construction, the table pointer |
//! | `scores.rs` | lookup results ([`OverlapScores`]) and the scan state lookups share |
//! | `read.rs` | the read path: `find_matches` and its forms (lock-free) |
//! | `write.rs` | the write path: applying `Stored` and `Removed` events |
//! | `workers.rs` | the worker registry: per-worker bookkeeping, slots, clearing and removing workers |
//! | `inspect.rs` | sizes, counters, heap bytes, the invariant checker, snapshot support |

mod inspect;
mod read;
mod scores;
mod workers;
mod write;

#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(all(test, not(loom)))]
mod tests;

pub(in crate::blocks) use inspect::TierCopies;
pub use scores::{Overlap, OverlapScores};
pub use workers::MAX_COPIES;

use super::event::WorkerId;
use super::hash::BlockHasher;
use super::names::Names;
use super::table::{Scratch, SetLedger, Table, MAX_SLOTS};
use crate::reclaim::{self, Guard};
use crate::sync::{Arc, AtomicBool, AtomicPtr, Mutex, Ordering, RwLock};
use std::collections::HashMap;
use workers::{Registry, TableSide, Tally};

/// Number of storage tiers a holder can name.
pub(crate) const TIERS: usize = 4;
/// Every tier bit.
const ALL_TIERS: u8 = (1 << TIERS) - 1;

/// Why an event was rejected by [`BlockIndex::apply`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventError {
    /// A [`KvEvent::Stored`] named a parent block the worker
    /// does not hold (never stored, or already removed). Nothing was stored.
    ///
    /// [`KvEvent::Stored`]: crate::blocks::KvEvent::Stored
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
    /// Events applied successfully (including `remove_worker` calls that removed a known
    /// worker).
    pub events_applied: u64,
    /// Block mappings newly stored (duplicate stores are not counted).
    pub blocks_stored: u64,
    /// Block mappings removed by `Removed` events, each when its last copy goes (not by
    /// `Cleared`/`remove_worker`): a removal that leaves another copy, in the same tier or
    /// another, removes no mapping.
    pub blocks_removed: u64,
    /// `Stored` events rejected because of an unknown parent.
    pub unknown_parents: u64,
    /// Engine hashes in `Removed` events that the worker did not hold.
    pub unknown_removes: u64,
    /// `Stored` events rejected because the index was full of workers
    /// ([`EventError::TooManyWorkers`]).
    pub rejected_workers: u64,
    /// Stores of a block the worker already held in that tier: counted as one more copy
    /// (GPU stores that [`DuplicateStores::Reports`] ignores are not counted anywhere).
    pub duplicate_copies: u64,
    /// Stores ignored because the block already had [`MAX_COPIES`] copies in that tier.
    pub copies_saturated: u64,
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

/// A lock-free index of KV-cache blocks: sequence hash → the workers that hold the block.
///
/// Engines report [`KvEvent`]s per worker ([`BlockIndex::apply`]); routers ask which workers
/// hold the longest leading run of a request's blocks ([`BlockIndex::find_matches`]). Lookups
/// take no lock and write no shared memory; writers of different workers apply their own
/// bookkeeping in parallel and take turns only to change the shared table. Memory
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
///
/// [`KvEvent`]: crate::blocks::KvEvent
pub struct BlockIndex {
    hasher: BlockHasher,
    // Invariant: never null; points to a `Table` from `Box::into_raw`. Changed (holder words,
    // keys) and replaced only by a writer holding `tables`, which retires the previous pointer through `reclaim::retire`
    // right after the Release swap; the current one is freed by `Drop`.
    table: AtomicPtr<Table>,
    /// The reader-visible slot names; every slot any holder names in any reachable table has
    /// been named in a directory published before that holder.
    names: Names,
    /// Every known worker's bookkeeping, each behind its own mutex; lock order: `registry`,
    /// one worker, `tables`, `tally` (module docs).
    registry: RwLock<Registry>,
    /// The table-side writer state; its holder is the only thread that changes the table.
    tables: Mutex<TableSide>,
    /// Event counters, merged once per event.
    tally: Mutex<Tally>,
    /// Slots released after a grace period, ready for reuse.
    free_slots: Arc<Mutex<Vec<u32>>>,
    /// GPU-tier stores of blocks already held are reports ([`DuplicateStores::Reports`]).
    reports: AtomicBool,
}

/// What a GPU-tier `Stored` event means for a block the worker already holds on the GPU (see
/// [`BlockIndex::set_duplicate_stores`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DuplicateStores {
    /// Another copy, which takes a removal of its own (the default). vLLM by default
    /// ("incremental" reports) stores a block it already caches only when another request
    /// computed it anew, in a block of its own, and publishes a removal for each copy it
    /// evicts.
    #[default]
    Copies,
    /// A report that the block is still held: nothing changes, and one removal removes it.
    /// For engines whose requests ask vLLM for full reports (`kv_cache_report_mode = "full"`,
    /// which gateways set to learn of prefix-cache hits): vLLM then publishes a store for every
    /// block a request reuses, and no removal for it. Counted as copies, each report would keep
    /// its block in the index after the engine evicted it. Copies in other tiers are still
    /// counted (vLLM's offloading connector asks its consumers to count them).
    Reports,
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
            registry: RwLock::new(Registry {
                workers: HashMap::new(),
                slots: 0,
            }),
            tables: Mutex::new(TableSide {
                used: 0,
                live: 0,
                ledger: SetLedger::default(),
                scratch: Scratch::default(),
            }),
            tally: Mutex::new(Tally::default()),
            free_slots: Arc::new(Mutex::new(Vec::new())),
            reports: AtomicBool::new(false),
        }
    }

    /// Sets what a GPU-tier store of a block the worker already holds on the GPU means, from
    /// the next event on: another copy (the default), or a report that it is still held, for
    /// engines that publish full reports (see [`DuplicateStores`]). Not part of a snapshot.
    ///
    /// ```
    /// use kvtrie::blocks::{BlockIndex, DuplicateStores, KvEvent, StoredBlock, WorkerId};
    /// let index = BlockIndex::new();
    /// index.set_duplicate_stores(DuplicateStores::Reports);
    /// let w = WorkerId(1);
    /// let store = || KvEvent::Stored {
    ///     parent: None,
    ///     blocks: vec![StoredBlock { engine_hash: 7, local_hash: 70 }],
    /// };
    /// index.apply(w, store()).unwrap();
    /// index.apply(w, store()).unwrap(); // a reused block reported again
    /// index.apply(w, KvEvent::Removed { engine_hashes: vec![7] }).unwrap();
    /// assert_eq!(index.block_count(w), 0);
    /// ```
    pub fn set_duplicate_stores(&self, d: DuplicateStores) {
        self.reports
            .store(d == DuplicateStores::Reports, Ordering::Relaxed);
    }

    /// What a GPU-tier store of a block already held means ([`Self::set_duplicate_stores`]).
    pub fn duplicate_stores(&self) -> DuplicateStores {
        if self.reports.load(Ordering::Relaxed) {
            DuplicateStores::Reports
        } else {
            DuplicateStores::Copies
        }
    }

    /// An empty index whose first worker gets slot `first_slot` (loom models use it to reach
    /// the holder forms of high slots with few workers).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn with_first_slot(first_slot: u32) -> Self {
        let index = Self::new();
        crate::sync::write(&index.registry).slots = first_slot.min(MAX_SLOTS);
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
    // The table pointer (every writer that grows or purges the table goes through here)
    // ----------------------------------------------------------------------------------------

    /// Replaces the table by a rebuilt one of `cap` slots, dropping dead keys.
    fn rebuild(&self, side: &mut TableSide, cap: usize, guard: &Guard) {
        let old_ref = self.load_table(guard);
        let (new, used) = old_ref.rebuild(cap);
        let new = Box::into_raw(Box::new(new));
        // Release publishes the new table's contents to readers that Acquire-load it.
        let old = self.table.swap(new, Ordering::AcqRel);
        side.used = used;
        // Safety: `old` came from `Box::into_raw` and is now unlinked (the swap replaced it),
        // so only readers pinned before this point can hold it; it is retired exactly once
        // (only the writer that swaps it out retires it). Table writers are serialized by
        // `tables` (held by the caller, whose `&mut TableSide` proves it), so none still
        // modifies it; readers holding it see a frozen, consistent older state.
        unsafe { reclaim::retire(guard, old, drop_table) };
        // A table is large and rebuilds are rare: push it to the global queue now, so it is
        // freed after the grace period rather than when this thread's bag fills (64 deferred
        // functions, which a writer that only churns blocks gathers in as many rebuilds: up
        // to 64 dead tables per writer thread). The deferred functions a collection runs here
        // free memory or push to leaf locks (`free_slots`, a tree's released slots, its
        // parked queue), none of them the table side held by the caller or a lock whose holder
        // waits for it. One collection runs at most 8 expired bags of 64 functions, from any
        // structure in the process: a rare stall of this index's writers, next to the O(cap)
        // rebuild itself (crossbeam's `pin` runs the same collection every 128 pins anyway).
        reclaim::flush(guard);
    }

    /// Rebuilds a mostly dead or empty table smaller.
    fn maybe_shrink(&self, side: &mut TableSide, guard: &Guard) {
        let table = self.load_table(guard);
        if table.cap() > 64 && side.live * 8 < table.cap() {
            self.rebuild(side, Table::cap_for(side.live), guard);
        }
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
