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
    /// Blocks the booked requests keep active on the worker (prompt + expected output), until
    /// they complete.
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
    /// Decode blocks to book (clamped likewise).
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
    /// Decode blocks booked (the choice's, clamped).
    pub decode_blocks: u64,
}

// ---------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------

/// A worker's load word: prefill blocks in the low half, decode blocks in the high half, so
/// one compare-and-swap books both.
const HALF: u64 = 32;
const LOW: u64 = (1 << HALF) - 1;

#[inline]
fn unpack(w: u64) -> WorkerLoad {
    WorkerLoad {
        prefill_blocks: w & LOW,
        decode_blocks: w >> HALF,
    }
}

/// The load word of `prefill` and `decode` blocks (each below 2³²: the inverse of [`unpack`]).
#[inline]
fn pack(prefill: u64, decode: u64) -> u64 {
    (decode << HALF) | prefill
}

/// Request-table shards (a power of two).
const SHARDS: usize = 16;

#[derive(Clone, Copy, Debug)]
struct Booking {
    worker: WorkerId,
    /// Prefill blocks still booked (0 once released).
    prefill: u64,
    prefill_done: bool,
    decode: u64,
    at: Instant,
}

#[derive(Default)]
struct Shard {
    bookings: HashMap<u64, Booking, IdBuildHasher>,
    stats: LoadStats,
}

type Loads = HashMap<WorkerId, CachePadded<AtomicU64>, IdBuildHasher>;

/// Releases `b`'s remaining load from its worker's counter (if the worker is still known).
fn release(loads: &Loads, b: &Booking) {
    if let Some(cell) = loads.get(&b.worker) {
        cell.fetch_sub(pack(b.prefill, b.decode), Ordering::AcqRel);
    }
}

/// Per-worker booked load and the table of the bookings that make it up.
///
/// Each worker has one 64-bit load word (prefill blocks in the low half, decode blocks in the
/// high half). [`book`](Self::book) reads the words of the allowed workers, lets the caller's
/// choice function pick one from those loads, and books it by a compare-and-swap against the
/// word the choice was made from; if another booking or release changed that word meanwhile,
/// the choice is redone on fresh loads (counted in [`LoadStats::retries`]). So concurrent
/// bookings see each other and do not herd onto one worker. The booking enters the request
/// table (16 mutex-protected shards by request id) in the same critical section as the
/// compare-and-swap, so a lifecycle call that follows the booking always finds it, and every
/// release subtracts exactly what was added. Amounts are clamped to the 32-bit halves (a
/// caller's huge number saturates instead of overflowing into the other half).
///
/// Workers are registered on first sight (under the write lock of the load map);
/// [`remove_worker`](Self::remove_worker) forgets one. Every release, and a booking's
/// compare-and-swap with its entry in the request table, holds the read lock, so a worker
/// cannot vanish in the middle of one. The choice function runs without any lock.
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
    /// Returns `None`, booking nothing, if `workers` is empty or `choose` returns an index
    /// out of range. Allocates a buffer of `workers.len()` loads; [`Self::book_into`] reuses
    /// the caller's.
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
        if workers.is_empty() {
            return None;
        }
        let mut cells = self.registered(workers);
        loop {
            loads.clear();
            loads.extend(
                workers
                    .iter()
                    .map(|w| unpack(cells.get(w).map_or(0, |c| c.load(Ordering::Acquire)))),
            );
            // The choice runs without the lock, so it may call into this book; the
            // compare-and-swap below validates it against whatever happened meanwhile.
            drop(cells);
            let c = choose(loads);
            let (Some(&worker), Some(&cur)) = (workers.get(c.index), loads.get(c.index)) else {
                return None;
            };
            // A worker removed since the read is registered afresh (a booking after the
            // removal); its new word is 0, so a choice made from another word is redone.
            cells = self.registered(workers);
            let cell = cells.get(&worker)?;
            // The word the choice was made from (pack inverts unpack exactly).
            let word = pack(cur.prefill_blocks, cur.decode_blocks);
            // Book within the 32-bit halves, recording exactly what was added so the
            // releases are exact.
            let prefill = c.prefill_blocks.min(LOW - cur.prefill_blocks);
            let decode = c.decode_blocks.min(LOW - cur.decode_blocks);
            let mut shard = crate::sync::lock(self.shard(request_id));
            if cell
                .compare_exchange(
                    word,
                    word + pack(prefill, decode),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
            {
                shard.stats.retries += 1;
                continue;
            }
            let booking = Booking {
                worker,
                prefill,
                prefill_done: false,
                decode,
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
                decode_blocks: decode,
            });
        }
    }

    /// The worker map, read-locked, with every one of `workers` registered (unseen ones are
    /// added under the write lock first). Holding the read lock, no worker can be removed.
    fn registered(&self, workers: &[WorkerId]) -> RwLockReadGuard<'_, Loads> {
        loop {
            let cells = self.read_loads();
            if workers.iter().all(|w| cells.contains_key(w)) {
                return cells;
            }
            drop(cells);
            let mut wl = crate::sync::write(&self.loads);
            for &w in workers {
                wl.entry(w).or_default();
            }
        }
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
                    cell.fetch_sub(b.prefill, Ordering::AcqRel);
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

    /// The load booked on `worker` (zero for a worker never booked).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.read_loads()
            .get(&worker)
            .map_or_else(WorkerLoad::default, |c| unpack(c.load(Ordering::Acquire)))
    }

    /// Every known worker's booked load, by ascending worker id.
    pub fn loads(&self) -> Vec<(WorkerId, WorkerLoad)> {
        let mut v: Vec<_> = self
            .read_loads()
            .iter()
            .map(|(&w, c)| (w, unpack(c.load(Ordering::Acquire))))
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
