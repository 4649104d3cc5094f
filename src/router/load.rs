//! [`LoadBook`]: the load booked on each worker by the requests routed to it, with the
//! request table that makes every release exact.
//!
//! A routing policy computes a cost per worker from the loads it reads here, chooses, and
//! books the request on the chosen worker in the same step ([`LoadBook::book`]); the engine's
//! lifecycle calls ([`LoadBook::prefill_complete`], [`LoadBook::request_complete`]) and the
//! reservation TTL ([`LoadBook::expire_stale`]) release the booking.
//! [`KvAwareRouter`](super::KvAwareRouter) is one such policy; the book is public so that
//! another policy (over another index, with another cost) can reuse it.
//!
//! The book takes the time as an input (`now` on every call that books or expires), so a
//! caller, a test or a loom model decides what time it is. Its atomics and locks come from
//! `crate::sync` (the loom model is `tests/loom.rs`, `i_load_book_*`).

use super::{mix64, IdBuildHasher};
use crate::blocks::WorkerId;
use crate::sync::{AtomicU64, Mutex, Ordering, RwLock, RwLockReadGuard};
use crossbeam_utils::CachePadded;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

/// The load booked on one worker, in blocks.
///
/// ```
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter, WorkerLoad};
/// use kvtrie::WorkerId;
/// let router = KvAwareRouter::new(KvAwareConfig::new(4));
/// assert_eq!(router.load(WorkerId(3)), WorkerLoad::default());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WorkerLoad {
    /// Prompt blocks still to be computed (booked requests whose prefill has not completed).
    pub prefill_blocks: u64,
    /// Blocks the booked requests keep active on the worker until they complete: what
    /// [`LoadBook::book`] booked, and for [`LoadBook::book_sequence`] the prompts' blocks,
    /// each once however many bookings share it, plus what each booked beyond them.
    pub decode_blocks: u64,
}

/// Counters of a [`LoadBook`] (see [`LoadBook::stats`]); a
/// [`KvAwareRouter`](super::KvAwareRouter) reports its book's as
/// [`KvAwareStats`](super::KvAwareStats).
///
/// ```
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
/// let router = KvAwareRouter::new(KvAwareConfig::default());
/// assert!(!router.request_complete(42));
/// assert_eq!(router.stats().unknown_ids, 1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LoadStats {
    /// Successful selections (bookings made).
    pub selections: u64,
    /// Bookings currently held.
    pub active_requests: u64,
    /// Prefill parts released by `prefill_complete`.
    pub prefills_completed: u64,
    /// Bookings released by `request_complete`.
    pub requests_completed: u64,
    /// Bookings released because they outlived the reservation TTL.
    pub expired: u64,
    /// Bookings replaced by a new selection with the same request id.
    pub replaced: u64,
    /// Lifecycle calls for ids with no booking (or repeated `prefill_complete`).
    pub unknown_ids: u64,
    /// Bookings dropped with their worker by `remove_worker`.
    pub removed: u64,
    /// Choices redone because the chosen worker's load changed between the read and the
    /// booking (another booking or release, a removal of the worker, or the choice
    /// function's own calls into the book).
    pub retries: u64,
}

/// What a policy's choice function (see [`LoadBook::book`]) chose: the index of a worker in
/// the slice it was given, and the load to book there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Choice {
    /// Index of the chosen worker in the `workers` slice (and in the loads the choice was
    /// made from).
    pub index: usize,
    /// Prefill blocks to book (clamped to the room left in the worker's load word).
    pub prefill_blocks: u64,
    /// Decode blocks to book (clamped likewise); for [`LoadBook::book_sequence`], those
    /// beyond the prompt's blocks (which the book adds itself).
    pub decode_blocks: u64,
}

/// A booking [`LoadBook::book`] made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Booked {
    /// Index of the chosen worker in the `workers` slice.
    pub index: usize,
    /// The chosen worker.
    pub worker: WorkerId,
    /// Prefill blocks booked (the choice's, clamped).
    pub prefill_blocks: u64,
    /// Decode blocks booked (the choice's, clamped; for [`LoadBook::book_sequence`], with the
    /// prompt blocks that were new to the worker).
    pub decode_blocks: u64,
}

// ---------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------

/// A worker's load word: prefill blocks in the low half, decode blocks in the high half, so
/// that one load reads both (each saturates at 2³² − 1).
const HALF: u64 = 32;
const LOW: u64 = (1 << HALF) - 1;

#[inline]
fn unpack(w: u64) -> WorkerLoad {
    WorkerLoad {
        prefill_blocks: w & LOW,
        decode_blocks: w >> HALF,
    }
}

/// The load word of `prefill` and `decode` blocks (each saturated to its half: the inverse of
/// [`unpack`] below that).
#[inline]
fn pack(prefill: u64, decode: u64) -> u64 {
    (decode.min(LOW) << HALF) | prefill.min(LOW)
}

/// Request-table shards (a power of two).
const SHARDS: usize = 16;

#[derive(Clone, Copy, Debug)]
struct Booking {
    worker: WorkerId,
    /// Prefill blocks still booked (0 once released).
    prefill: u64,
    prefill_done: bool,
    /// Decode blocks booked beyond the prompt's blocks (a partial last block, the expected
    /// output).
    extra: u64,
    /// The last of the prompt's blocks (sequence hashes), if it has any: the booking holds
    /// the path of blocks that ends there (see [`Active`]).
    last: Option<u64>,
    at: Instant,
}

#[derive(Default)]
struct Shard {
    bookings: HashMap<u64, Booking, IdBuildHasher>,
    stats: LoadStats,
}

/// One active block of a worker: a node of the tree of the prompts booked there.
#[derive(Clone, Copy, Debug)]
struct ActiveBlock {
    /// The block before it in the prompts that hold it (`None` for a first block).
    parent: Option<u64>,
    /// Bookings whose prompt ends here.
    ends: u32,
    /// Active blocks whose parent this is.
    children: u32,
}

/// What the bookings on one worker hold, exactly (the word shows it saturated).
///
/// The prompts' blocks are sequence hashes, each naming its whole prefix, so the blocks
/// bookings hold form a tree: a booking holds the path from a first block to its prompt's
/// last block. A block is active while a booking's path passes through it, that is while
/// some booking ends there or below it; a block shared by several prompts is active once, as
/// in NVIDIA Dynamo's active sequences. Booking a prompt finds where its path leaves the tree
/// (a binary search: the blocks it shares with the tree are a leading run) and adds the rest;
/// releasing one takes away the blocks at the end of its path that no other booking ends at
/// or passes through. Both cost the blocks added or taken away, not the prompt's length.
#[derive(Default)]
struct Active {
    blocks: HashMap<u64, ActiveBlock, IdBuildHasher>,
    /// The bookings' outstanding prefill blocks.
    prefill: u64,
    /// The bookings' decode blocks beyond their prompts' blocks.
    extra: u64,
}

impl Active {
    fn word(&self) -> u64 {
        pack(
            self.prefill,
            (self.blocks.len() as u64).saturating_add(self.extra),
        )
    }

    /// How many leading blocks of `blocks` are active here.
    fn depth(&self, blocks: &[u64]) -> usize {
        let (mut lo, mut hi) = (0, blocks.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.blocks.contains_key(&blocks[mid]) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// How many of `blocks` are not active here.
    fn new_blocks(&self, blocks: &[u64]) -> u64 {
        (blocks.len() - self.depth(blocks)) as u64
    }

    /// Adds a booking's path; returns how many blocks were new here and the block the booking
    /// ends at (its last block; `None` for no blocks). A list that is not a chain of sequence
    /// hashes (a block met again past where the path left the tree) is held up to the block
    /// before that one, and ends there: every block the booking added lies on the path to its
    /// end, so its release takes them away again. One probe of the map per block added.
    fn hold(&mut self, blocks: &[u64]) -> (u64, Option<u64>) {
        let from = self.depth(blocks);
        let mut end = from;
        while let Some(&h) = blocks.get(end) {
            match self.blocks.entry(h) {
                Entry::Occupied(_) => break,
                // Each block added gets a child, the next one, but the last (set below).
                Entry::Vacant(v) => v.insert(ActiveBlock {
                    parent: end.checked_sub(1).map(|p| blocks[p]),
                    ends: 0,
                    children: 1,
                }),
            };
            end += 1;
        }
        let Some(i) = end.checked_sub(1) else {
            return (0, None);
        };
        if end > from {
            if let Some(p) = from
                .checked_sub(1)
                .and_then(|p| self.blocks.get_mut(&blocks[p]))
            {
                p.children += 1;
            }
        }
        let last = blocks[i];
        if let Some(b) = self.blocks.get_mut(&last) {
            if end > from {
                b.children = 0;
            }
            b.ends += 1;
        }
        ((end - from) as u64, Some(last))
    }

    /// Releases `b`'s remaining load: the end of its path that no other booking ends at or
    /// passes through goes (one removal and one parent update per block).
    fn release(&mut self, b: &Booking) {
        let free = |n: &ActiveBlock| n.ends == 0 && n.children == 0;
        let mut at = b.last.and_then(|last| {
            let n = self.blocks.get_mut(&last)?;
            n.ends = n.ends.saturating_sub(1);
            free(n).then_some(last)
        });
        while let Some(n) = at.and_then(|h| self.blocks.remove(&h)) {
            at = n.parent.and_then(|p| {
                let pn = self.blocks.get_mut(&p)?;
                pn.children = pn.children.saturating_sub(1);
                free(pn).then_some(p)
            });
        }
        self.prefill -= b.prefill;
        self.extra -= b.extra;
    }
}

/// One worker's load: the word, for lock-free reads, and what makes it up. The word is
/// written only under `active`'s lock, so a booking checks it there against the word its
/// choice was made from (a booking and a release that cancel out leave it unchanged: the
/// load the choice saw is then still the load).
#[derive(Default)]
struct Cell {
    word: AtomicU64,
    active: Mutex<Active>,
}

impl Cell {
    fn load(&self) -> WorkerLoad {
        unpack(self.word.load(Ordering::Acquire))
    }
}

type Loads = HashMap<WorkerId, CachePadded<Cell>, IdBuildHasher>;

/// Releases `b`'s remaining load from its worker (if the worker is still known).
fn release(loads: &Loads, b: &Booking) {
    if let Some(cell) = loads.get(&b.worker) {
        let mut a = crate::sync::lock(&cell.active);
        a.release(b);
        cell.word.store(a.word(), Ordering::Release);
    }
}

/// Per-worker booked load and the table of the bookings that make it up.
///
/// Each worker has a 64-bit load word (prefill blocks in the low half, decode blocks in the
/// high half), read without a lock. [`book`](Self::book) reads the words of the allowed
/// workers, lets the caller's choice function pick one from those loads, and books it under
/// the worker's lock if its word is still the one the choice was made from; if another booking
/// or release changed that word meanwhile, the choice is redone on fresh loads (counted in
/// [`LoadStats::retries`]). So concurrent bookings see each other and do not herd onto one
/// worker. The booking enters the request table (16 mutex-protected shards by request id) in
/// the same critical section, so a lifecycle call that follows the booking always finds it,
/// and every release takes away exactly what was added. Amounts are clamped to the room left
/// in the 32-bit halves (a caller's huge number saturates instead of overflowing into the
/// other half).
///
/// [`book_sequence`](Self::book_sequence) books a request together with its prompt's blocks
/// (sequence hashes): a block that several bookings on one worker hold counts once in its
/// decode load, as NVIDIA Dynamo's active sequences count it, and the choice function sees
/// how many of the request's blocks each worker does not hold yet.
///
/// Workers are registered on first sight (under the write lock of the load map);
/// [`remove_worker`](Self::remove_worker) forgets one. Every release, and a booking with its
/// entry in the request table, holds the read lock, so a worker cannot vanish in the middle of
/// one. The choice function runs without any lock.
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvtrie::router::{Choice, LoadBook, WorkerLoad};
/// use kvtrie::WorkerId;
///
/// let book = LoadBook::new(Duration::from_secs(60));
/// let workers = [WorkerId(0), WorkerId(1)];
/// // A least-decode-load policy booking 2 prefill and 5 decode blocks.
/// let least = |loads: &[WorkerLoad]| Choice {
///     index: (0..loads.len()).min_by_key(|&i| loads[i].decode_blocks).unwrap(),
///     prefill_blocks: 2,
///     decode_blocks: 5,
/// };
/// let now = Instant::now();
/// let a = book.book(1, &workers, now, least).unwrap();
/// let b = book.book(2, &workers, now, least).unwrap();
/// assert_ne!(a.worker, b.worker);
/// assert_eq!(book.load(a.worker), WorkerLoad { prefill_blocks: 2, decode_blocks: 5 });
/// assert!(book.prefill_complete(1));
/// assert!(book.request_complete(1));
/// assert_eq!(book.load(a.worker), WorkerLoad::default());
/// // Request 2 is never completed: the TTL releases it.
/// assert_eq!(book.expire_stale(now + Duration::from_secs(60)), 1);
/// assert_eq!(book.load(b.worker), WorkerLoad::default());
/// assert_eq!(book.stats().expired, 1);
/// ```
pub struct LoadBook {
    /// Per-worker load words. Read-locked by every booking and release (workers are
    /// registered on first sight, under the write lock).
    loads: RwLock<Loads>,
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    ttl: Duration,
    origin: Instant,
    /// Nanoseconds since `origin` after which [`LoadBook::maybe_expire`] sweeps.
    next_sweep: AtomicU64,
}

impl fmt::Debug for LoadBook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadBook")
            .field("reservation_ttl", &self.ttl)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl LoadBook {
    /// An empty book whose bookings expire `reservation_ttl` after they are made (a zero TTL
    /// makes every booking stale at the next sweep).
    pub fn new(reservation_ttl: Duration) -> Self {
        Self {
            loads: RwLock::new(Loads::default()),
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(Mutex::new(Shard::default())))
                .collect(),
            ttl: reservation_ttl,
            origin: Instant::now(),
            next_sweep: AtomicU64::new(0),
        }
    }

    /// The reservation TTL.
    pub fn reservation_ttl(&self) -> Duration {
        self.ttl
    }

    #[inline]
    fn shard(&self, request_id: u64) -> &Mutex<Shard> {
        &self.shards[mix64(request_id) as usize & (SHARDS - 1)]
    }

    fn read_loads(&self) -> RwLockReadGuard<'_, Loads> {
        crate::sync::read(&self.loads)
    }

    /// Books request `request_id` on the worker `choose` picks from `workers`' current loads
    /// (`loads[i]` is `workers[i]`'s), at time `now` (the booking expires at `now` + TTL).
    ///
    /// `choose` may be called more than once: when the chosen worker's load changed between
    /// the read and the booking, the choice is redone on the fresh loads. The amounts are
    /// clamped to the room left in the worker's load word. Booking an id that is still booked
    /// replaces its booking (the old one is released, [`LoadStats::replaced`]).
    ///
    /// Returns `None`, booking nothing, if `workers` is empty, if `choose` returns an index
    /// out of range, or if its picks keep landing on workers that a
    /// [`remove_worker`](Self::remove_worker) removed while this call ran: once every one of
    /// `workers` is gone, or after more such picks than there are workers (a removed worker is
    /// shown to the choice with a full load, and is not registered again: a later booking
    /// that lists it registers it afresh).
    /// Allocates a buffer of `workers.len()` loads; [`Self::book_into`] reuses the caller's.
    ///
    /// `choose` runs with no lock of the book held, so it may call the book's methods (a
    /// [`load`](Self::load), even a nested [`book`](Self::book)); whatever changed the chosen
    /// worker's load meanwhile, a booking, a release or a [`remove_worker`](Self::remove_worker),
    /// makes the book redo the choice on fresh loads. So a choice function that itself changes
    /// the load of the worker it then picks (a nested booking there) on every call never lets
    /// the outer booking through: it may call in, but must not do that each time.
    pub fn book<F>(
        &self,
        request_id: u64,
        workers: &[WorkerId],
        now: Instant,
        choose: F,
    ) -> Option<Booked>
    where
        F: FnMut(&[WorkerLoad]) -> Choice,
    {
        self.book_into(request_id, workers, now, &mut Vec::new(), choose)
    }

    /// [`Self::book`] with the loads read into `loads` (cleared first), so a warm caller
    /// allocates nothing.
    pub fn book_into<F>(
        &self,
        request_id: u64,
        workers: &[WorkerId],
        now: Instant,
        loads: &mut Vec<WorkerLoad>,
        mut choose: F,
    ) -> Option<Booked>
    where
        F: FnMut(&[WorkerLoad]) -> Choice,
    {
        self.book_sequence_with(
            request_id,
            workers,
            now,
            &[],
            loads,
            &mut Vec::new(),
            false,
            |l, _| choose(l),
        )
    }

    /// Books request `request_id` with its prompt's blocks `blocks` (the sequence hashes of
    /// its full blocks, in order: each names its whole prefix) on the worker `choose` picks.
    ///
    /// `choose` gets each worker's load and how many of `blocks` it does not hold yet
    /// (`new_blocks[i]`: the blocks its other bookings do not already keep active). The
    /// booking adds those new blocks to the worker's decode load, plus the choice's
    /// `decode_blocks` (what the request keeps active beyond these blocks: a partial last
    /// block, the expected output); its release takes away the blocks no other booking on
    /// the worker still holds. Otherwise as [`Self::book`].
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use kvtrie::router::{Choice, LoadBook, WorkerLoad};
    /// use kvtrie::WorkerId;
    ///
    /// let book = LoadBook::new(Duration::from_secs(60));
    /// let w = [WorkerId(0)];
    /// let now = Instant::now();
    /// // Two requests sharing a 3-block prefix, each with 2 output blocks.
    /// let pick = |_: &[WorkerLoad], _: &[u64]| Choice { index: 0, prefill_blocks: 0, decode_blocks: 2 };
    /// let a = book.book_sequence(1, &w, now, &[10, 11, 12], pick).unwrap();
    /// let b = book.book_sequence(2, &w, now, &[10, 11, 12, 13], pick).unwrap();
    /// assert_eq!((a.decode_blocks, b.decode_blocks), (3 + 2, 1 + 2));
    /// assert_eq!(book.load(w[0]).decode_blocks, 4 + 2 + 2);
    /// assert!(book.request_complete(1));
    /// assert_eq!(book.load(w[0]).decode_blocks, 4 + 2); // request 2 still holds the prefix
    /// ```
    pub fn book_sequence<F>(
        &self,
        request_id: u64,
        workers: &[WorkerId],
        now: Instant,
        blocks: &[u64],
        choose: F,
    ) -> Option<Booked>
    where
        F: FnMut(&[WorkerLoad], &[u64]) -> Choice,
    {
        let (mut loads, mut news) = (Vec::new(), Vec::new());
        self.book_sequence_into(
            request_id, workers, now, blocks, &mut loads, &mut news, choose,
        )
    }

    /// [`Self::book_sequence`] with the loads and new-block counts read into `loads` and
    /// `new_blocks` (cleared first), so a warm caller allocates nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn book_sequence_into<F>(
        &self,
        request_id: u64,
        workers: &[WorkerId],
        now: Instant,
        blocks: &[u64],
        loads: &mut Vec<WorkerLoad>,
        new_blocks: &mut Vec<u64>,
        choose: F,
    ) -> Option<Booked>
    where
        F: FnMut(&[WorkerLoad], &[u64]) -> Choice,
    {
        self.book_sequence_with(
            request_id, workers, now, blocks, loads, new_blocks, true, choose,
        )
    }

    /// [`Self::book_sequence_into`], counting each worker's new blocks for the choice only if
    /// `count_new` (else `choose` gets an empty slice, and a policy that does not price them
    /// saves a lock per worker and `news` stays unallocated).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn book_sequence_with<F>(
        &self,
        request_id: u64,
        workers: &[WorkerId],
        now: Instant,
        blocks: &[u64],
        loads: &mut Vec<WorkerLoad>,
        news: &mut Vec<u64>,
        count_new: bool,
        mut choose: F,
    ) -> Option<Booked>
    where
        F: FnMut(&[WorkerLoad], &[u64]) -> Choice,
    {
        if workers.is_empty() {
            return None;
        }
        // Unseen workers are registered once, here. One removed while this call runs is not
        // registered again: it shows a full load from then on. Picks of removed workers are
        // counted: past one per allowed worker, or once every one is gone, the call gives up
        // (remembering only the last one looped for ever when a tie-rotating choice picked
        // each removed worker in turn).
        let mut cells = self.registered(workers);
        let mut gone = 0usize;
        loop {
            loads.clear();
            news.clear();
            for w in workers {
                let cell = cells.get(w);
                loads.push(cell.map_or(unpack(u64::MAX), |c| c.load()));
                if count_new {
                    news.push(cell.map_or(blocks.len() as u64, |c| {
                        crate::sync::lock(&c.active).new_blocks(blocks)
                    }));
                }
            }
            // The choice runs without the lock, so it may call into this book; the check of
            // the word below validates it against whatever happened meanwhile.
            drop(cells);
            let c = choose(loads, news);
            let (Some(&worker), Some(&cur)) = (workers.get(c.index), loads.get(c.index)) else {
                return None;
            };
            cells = self.read_loads();
            let Some(cell) = cells.get(&worker) else {
                // Removed: choose again with it shown full.
                gone += 1;
                if gone > workers.len() || !workers.iter().any(|w| cells.contains_key(w)) {
                    return None;
                }
                continue;
            };
            let mut shard = crate::sync::lock(self.shard(request_id));
            let mut active = crate::sync::lock(&cell.active);
            // The word the choice was made from (pack inverts unpack exactly), and the count of
            // new blocks it saw: a booking and a release that cancel out in the word can still
            // change which of the prompt's blocks are active.
            if cell.word.load(Ordering::Relaxed) != pack(cur.prefill_blocks, cur.decode_blocks)
                || (count_new && active.new_blocks(blocks) != news[c.index])
            {
                drop(active);
                shard.stats.retries += 1;
                continue;
            }
            // The prompt's blocks count exactly; what the caller adds is clamped to the room
            // left in the halves, and recorded as added, so the releases are exact.
            let (new, last) = active.hold(blocks);
            let used = (active.blocks.len() as u64).saturating_add(active.extra);
            let prefill = c.prefill_blocks.min(LOW.saturating_sub(active.prefill));
            let extra = c.decode_blocks.min(LOW.saturating_sub(used));
            active.prefill += prefill;
            active.extra += extra;
            cell.word.store(active.word(), Ordering::Release);
            drop(active);
            let booking = Booking {
                worker,
                prefill,
                prefill_done: false,
                extra,
                last,
                at: now,
            };
            shard.stats.selections += 1;
            if let Some(old) = shard.bookings.insert(request_id, booking) {
                release(&cells, &old);
                shard.stats.replaced += 1;
            }
            return Some(Booked {
                index: c.index,
                worker,
                prefill_blocks: prefill,
                decode_blocks: new + extra,
            });
        }
    }

    /// The worker map, read-locked, after registering those of `workers` it did not have
    /// (under the write lock). Registration is one pass: a worker removed between it and the
    /// read lock is absent from the map returned, and the caller shows it full (registering
    /// again until all were present could go round for as long as another thread kept
    /// removing one of them).
    fn registered(&self, workers: &[WorkerId]) -> RwLockReadGuard<'_, Loads> {
        let cells = self.read_loads();
        if workers.iter().all(|w| cells.contains_key(w)) {
            return cells;
        }
        drop(cells);
        {
            let mut wl = crate::sync::write(&self.loads);
            for &w in workers {
                wl.entry(w).or_default();
            }
        }
        self.read_loads()
    }

    /// Releases the prefill part of `request_id`'s booking (its prompt has been computed).
    /// Returns whether the booking existed with its prefill outstanding (possibly 0 blocks,
    /// for a fully cached prompt); unknown ids and repeated calls are no-ops returning false.
    pub fn prefill_complete(&self, request_id: u64) -> bool {
        let loads = self.read_loads();
        let mut shard = crate::sync::lock(self.shard(request_id));
        let shard = &mut *shard;
        match shard.bookings.get_mut(&request_id) {
            Some(b) if !b.prefill_done => {
                if let Some(cell) = loads.get(&b.worker) {
                    let mut a = crate::sync::lock(&cell.active);
                    a.prefill -= b.prefill;
                    cell.word.store(a.word(), Ordering::Release);
                }
                b.prefill = 0;
                b.prefill_done = true;
                shard.stats.prefills_completed += 1;
                true
            }
            _ => {
                shard.stats.unknown_ids += 1;
                false
            }
        }
    }

    /// Releases everything still booked for `request_id` (the request finished or was
    /// cancelled). Returns whether it had a booking: unknown ids are no-ops.
    pub fn request_complete(&self, request_id: u64) -> bool {
        let loads = self.read_loads();
        let mut shard = crate::sync::lock(self.shard(request_id));
        match shard.bookings.remove(&request_id) {
            Some(b) => {
                release(&loads, &b);
                shard.stats.requests_completed += 1;
                true
            }
            None => {
                shard.stats.unknown_ids += 1;
                false
            }
        }
    }

    /// Releases every booking made at least the reservation TTL before `now`; returns how
    /// many.
    pub fn expire_stale(&self, now: Instant) -> usize {
        let ttl = self.ttl;
        let loads = self.read_loads();
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut shard = crate::sync::lock(shard);
            let shard = &mut *shard;
            let before = shard.bookings.len();
            shard.bookings.retain(|_, b| {
                let keep = now.saturating_duration_since(b.at) < ttl;
                if !keep {
                    release(&loads, b);
                }
                keep
            });
            let expired = before - shard.bookings.len();
            shard.stats.expired += expired as u64;
            n += expired;
        }
        n
    }

    /// Runs [`expire_stale`](Self::expire_stale) if a quarter TTL (at least 1 ms) has passed
    /// since the last sweep (the first call only starts the clock); of concurrent callers one
    /// wins the sweep, the others skip it. Returns the bookings expired.
    pub fn maybe_expire(&self, now: Instant) -> usize {
        let at = u64::try_from(now.saturating_duration_since(self.origin).as_nanos())
            .unwrap_or(u64::MAX);
        let next = self.next_sweep.load(Ordering::Relaxed);
        if at < next {
            return 0;
        }
        let step = (self.ttl / 4).max(Duration::from_millis(1));
        let to = at.saturating_add(u64::try_from(step.as_nanos()).unwrap_or(u64::MAX));
        if self
            .next_sweep
            .compare_exchange(next, to, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
            && next != 0
        {
            return self.expire_stale(now);
        }
        0
    }

    /// Forgets a worker: drops its bookings and its load word. Returns the bookings dropped.
    /// Booking on it again registers it afresh.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        let mut loads = crate::sync::write(&self.loads);
        loads.remove(&worker);
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut shard = crate::sync::lock(shard);
            let before = shard.bookings.len();
            shard.bookings.retain(|_, b| b.worker != worker);
            let removed = before - shard.bookings.len();
            shard.stats.removed += removed as u64;
            n += removed;
        }
        n
    }

    /// Forgets every data-parallel rank of `engine` (see [`Self::remove_worker`]; the low 48
    /// bits of `engine`, as [`WorkerId::new`] keeps); returns the bookings dropped. A rank
    /// first booked while the call runs may stay.
    pub fn remove_engine(&self, engine: u64) -> usize {
        let engine = engine & WorkerId::MAX_ENGINE;
        let ranks: Vec<WorkerId> = self
            .read_loads()
            .keys()
            .copied()
            .filter(|w| w.engine() == engine)
            .collect();
        ranks.into_iter().map(|w| self.remove_worker(w)).sum()
    }

    /// The load booked on `worker` (zero for a worker never booked).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.read_loads()
            .get(&worker)
            .map_or_else(WorkerLoad::default, |c| c.load())
    }

    /// Every known worker's booked load, by ascending worker id.
    pub fn loads(&self) -> Vec<(WorkerId, WorkerLoad)> {
        let mut v: Vec<_> = self
            .read_loads()
            .iter()
            .map(|(&w, c)| (w, c.load()))
            .collect();
        v.sort_unstable_by_key(|&(w, _)| w);
        v
    }

    /// The counters, summed over the request-table shards.
    pub fn stats(&self) -> LoadStats {
        let mut t = LoadStats::default();
        for shard in self.shards.iter() {
            let shard = crate::sync::lock(shard);
            let s = &shard.stats;
            t.selections += s.selections;
            t.active_requests += shard.bookings.len() as u64;
            t.prefills_completed += s.prefills_completed;
            t.requests_completed += s.requests_completed;
            t.expired += s.expired;
            t.replaced += s.replaced;
            t.unknown_ids += s.unknown_ids;
            t.removed += s.removed;
            t.retries += s.retries;
        }
        t
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::workload::SplitMix64;

    /// Every allowed worker removed while a booking chooses, by a choice that rotates over
    /// them (as tie-breaking does): the booking gives up instead of choosing for ever.
    #[test]
    fn a_booking_whose_workers_all_leave_while_it_chooses_gives_up() {
        let book = LoadBook::new(Duration::from_secs(60));
        let workers: Vec<WorkerId> = (0..4).map(WorkerId).collect();
        let mut calls = 0usize;
        let booked = book.book(1, &workers, Instant::now(), |loads| {
            calls += 1;
            assert!(calls <= 20, "still choosing after {calls} rounds");
            if calls == 1 {
                for &w in &workers {
                    book.remove_worker(w);
                }
            }
            Choice {
                index: calls % loads.len(),
                prefill_blocks: 1,
                decode_blocks: 1,
            }
        });
        assert!(booked.is_none());
        // One removed during the choice, the others still there: it books one of those.
        let booked = book.book(2, &workers, Instant::now(), |loads| {
            if loads.iter().all(|l| l.prefill_blocks == 0) {
                book.remove_worker(workers[0]);
                return Choice {
                    index: 0,
                    prefill_blocks: 1,
                    decode_blocks: 0,
                };
            }
            let index = loads.iter().position(|l| l.prefill_blocks == 0).unwrap();
            Choice {
                index,
                prefill_blocks: 1,
                decode_blocks: 0,
            }
        });
        assert_eq!(booked.map(|b| b.worker), Some(workers[1]));
    }

    fn booking(last: Option<u64>) -> Booking {
        Booking {
            worker: WorkerId(0),
            prefill: 0,
            prefill_done: true,
            extra: 0,
            last,
            at: Instant::now(),
        }
    }

    /// Lists that are not chains of sequence hashes (a caller's arbitrary ids, repeated
    /// blocks, collisions) never panic, and once every booking is released nothing is left:
    /// `[1, 2, 1]`, and `[9]` then `[1, 2, 9]`, used to leave blocks 1 and 2 for ever.
    #[test]
    fn lists_that_are_not_chains_leave_nothing_behind() {
        let mut rng = SplitMix64::new(9);
        let mut lists: Vec<Vec<u64>> = vec![vec![1, 2, 1], vec![9], vec![1, 2, 9], vec![]];
        let n = if cfg!(miri) { 50 } else { 2_000 };
        for _ in 0..n {
            let len = rng.below(8) as usize;
            lists.push((0..len).map(|_| rng.below(12)).collect());
        }
        for round in 0..4 {
            let mut active = Active::default();
            let mut held = Vec::new();
            for (i, l) in lists.iter().enumerate() {
                let (new, last) = active.hold(l);
                assert!(new as usize <= l.len());
                held.push(booking(last));
                // Release in an order that depends on the round.
                if (i + round) % 3 == 0 {
                    let b = held.swap_remove(rng.below(held.len() as u64) as usize);
                    active.release(&b);
                }
            }
            for b in held {
                active.release(&b);
            }
            assert!(
                active.blocks.is_empty(),
                "round {round}: {:?}",
                active.blocks
            );
        }
    }

    /// The tree of active blocks against a trivially correct model (a count per block of the
    /// bookings holding it): random prompts drawn from a few shared prefixes, booked and
    /// released in random order, sequence hashes chained as a router chains them. After every
    /// step the active blocks are exactly the model's, and so is each booking's count of new
    /// blocks.
    #[test]
    fn active_blocks_match_a_reference_count() {
        let mut rng = SplitMix64::new(5);
        let mut active = Active::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut live: Vec<(Booking, Vec<u64>)> = Vec::new();
        let steps = if cfg!(miri) { 300 } else { 20_000 };
        for step in 0..steps {
            if live.is_empty() || rng.below(100) < 55 {
                // A prompt: one of 4 roots, then a walk of up to 12 blocks over 3 choices
                // each, so that prompts share prefixes of every length.
                let len = 1 + rng.below(12) as usize;
                let mut blocks = Vec::with_capacity(len);
                let mut h = rng.below(4);
                for _ in 0..len {
                    h = crate::rng::mix64(h.wrapping_mul(31).wrapping_add(rng.below(3) + 1));
                    blocks.push(h);
                }
                let expected_new = blocks.iter().filter(|b| !model.contains_key(b)).count();
                assert_eq!(
                    active.new_blocks(&blocks),
                    expected_new as u64,
                    "step {step}"
                );
                let (new, last) = active.hold(&blocks);
                assert_eq!(new, expected_new as u64, "step {step}");
                assert_eq!(last, blocks.last().copied());
                for &b in &blocks {
                    *model.entry(b).or_insert(0) += 1;
                }
                live.push((booking(last), blocks));
            } else {
                let (b, blocks) = live.swap_remove(rng.below(live.len() as u64) as usize);
                active.release(&b);
                for h in blocks {
                    let c = model.get_mut(&h).unwrap();
                    *c -= 1;
                    if *c == 0 {
                        model.remove(&h);
                    }
                }
            }
            assert_eq!(active.blocks.len(), model.len(), "step {step}");
        }
        let mut keys: Vec<_> = active.blocks.keys().copied().collect();
        let mut want: Vec<_> = model.keys().copied().collect();
        keys.sort_unstable();
        want.sort_unstable();
        assert_eq!(keys, want);
    }
}
