//! The one place that talks to the epoch-based reclaimer.
//!
//! kvtrie uses [`crossbeam_epoch`]: readers [`pin`] the current epoch for the duration of one
//! operation; writers unlink an object and then retire it, which defers its destructor until
//! every thread that was pinned at the time has unpinned. Under `--cfg loom --cfg crossbeam_loom`
//! crossbeam-epoch itself is model-checked by loom, and the destructors of retired objects poison
//! them instead of freeing them, so a reader that reaches a prematurely retired object fails an
//! assertion instead of reading freed memory.
//!
//! # Bounded backlog
//!
//! crossbeam-epoch frees a bounded number of deferred functions per collection (8 bags of 64,
//! one collection every 128 pins or per flush). A writer that retires one small object per
//! deferred function about as fast as that never drains a burst (a tenant removal, an eviction
//! pass): the retired-but-unfreed backlog then grows without bound under sustained load, the
//! "garbage death spiral". A [`Retirer`] avoids it by **batching**: retired objects collect in
//! a per-thread-shard batch, each full batch becomes *one* deferred function, and every few
//! batches the bag is pushed to the global queue ([`Guard::flush`], which also collects up to 8
//! expired bags) once the writer released its locks (`Retirer::flush_if_due`). Every flush
//! adds one bag and can free eight, so the queue drains as long as the epoch advances, and the
//! number of objects freed per collection is `BATCH` times larger. What is
//! pending is bounded by
//!
//! * `SHARDS × BATCH` objects in partial batches (a constant), plus
//! * what the structure retires while the global epoch advances twice (every thread pinned at a
//!   retirement must unpin first; kvtrie's operations hold a pin for one operation only, and
//!   the long ones, a tenant's removal and an eviction of many chars, even of one timestamp
//!   group of any size, [`repin`] between bounded chunks of work and hand their batches over
//!   as they go), plus
//! * the expired objects parked for the writers to free (a constant, below).
//!
//! The backlog of each structure is visible ([`Retirer::backlog`]).
//!
//! # Freeing a few at a time
//!
//! A batch whose grace period has passed is not freed by the collection that finds it: it is
//! *parked*, and writers free parked objects eight at a time after their writes
//! ([`Retirer::flush_if_due`]; each writer shard takes one parked batch at a time to drain),
//! between their own allocations. A collection frees up to eight bags of batches, thousands of
//! objects, on one thread; with glibc's malloc such a burst takes the arena locks of the
//! threads that allocated the objects while they allocate, and two writers sleep on each other.
//!
//! Parking adds to the backlog, which counts parked objects until they are freed, at most
//! [`PARKED_MAX`] objects and 1 MiB in the queue plus one batch per writer shard being
//! drained (`SHARDS × BATCH` objects). A batch that does not fit is freed at once by the
//! collection that found it expired. Bulk operations (an eviction, a tenant's removal) free
//! the parked batches they retired themselves between their chunks of work
//! ([`Retirer::flush_bulk`], as does [`Retirer::flush`]), so what they retire is freed on their
//! thread while they run (what their last chunk retires waits for later writes or passes),
//! and other threads' batches stay parked for the writers. The retirer's drop frees
//! everything parked, and so does an eviction pass once the writers are idle
//! ([`Retirer::free_parked_if_idle`]); without an eviction thread, what is parked when the
//! writes stop stays until the next writes.
//!
//! A batched object is deferred later than it was retired, which is only more conservative: a
//! thread pinned at retirement is still pinned (or has unpinned) when the batch is deferred.

use crate::sync::{AtomicBool, AtomicUsize, Mutex, Ordering};
use crossbeam_utils::CachePadded;
use std::sync::Arc;

pub(crate) use crossbeam_epoch::Guard;

/// Pins the current thread to the current epoch.
#[inline]
pub(crate) fn pin() -> Guard {
    crossbeam_epoch::pin()
}

/// Unpins and pins the current thread again (if `guard` is its only guard), so the epoch can
/// advance during a long operation. Every reference obtained under `guard` must be dropped
/// first, which the `&mut` borrow enforces.
#[inline]
pub(crate) fn repin(guard: &mut Guard) {
    guard.repin();
}

/// Is the current thread pinned (test support: checks that long operations unpin)?
#[cfg(all(test, not(loom)))]
pub(crate) fn is_pinned() -> bool {
    crossbeam_epoch::is_pinned()
}

/// Pushes this thread's deferred destructors to the global queue and tries to collect.
pub(crate) fn flush(guard: &Guard) {
    guard.flush();
}

/// Defers `destroy(ptr)` until no thread that is pinned now can still hold `ptr`, as its own
/// deferred function (no batching; for rare, large objects such as a rebuilt hash table).
///
/// # Safety
///
/// `ptr` must already be unlinked from every shared location, so that threads pinning after this
/// call cannot reach it; it must be retired exactly once; and `destroy(ptr)` must be sound to call
/// from any thread once no other thread holds `ptr` (the pointee is `Send`).
#[inline]
pub(crate) unsafe fn retire<T>(guard: &Guard, ptr: *mut T, destroy: unsafe fn(*mut T)) {
    let p = SendPtr(ptr);
    let free = move || {
        let p = p;
        // Safety: by the caller's contract the object is unlinked and retired once; this runs
        // only after every guard that was active at the `defer` below has been dropped.
        unsafe { destroy(p.0) }
    };
    // Safety: the closure only frees an object no thread can reach any more by then (see
    // above); it borrows nothing, so running it later on any thread is sound.
    unsafe { guard.defer_unchecked(free) };
}

/// Runs `f` once no thread that is pinned now can still observe the state before this call
/// (a grace period), e.g. to recycle a tenant slot only after every reader that could have seen
/// its old bits has finished.
pub(crate) fn defer<F: FnOnce() + Send + 'static>(guard: &Guard, f: F) {
    guard.defer(f);
}

/// A raw pointer that may cross threads: the pointee is only touched by its destructor, which
/// the retiring caller vouches may run on any thread once the pointer is no longer shared.
struct SendPtr<T>(*mut T);
// Safety: see the type's docs; the pointer is used by exactly one destructor call.
unsafe impl<T> Send for SendPtr<T> {}

/// An object kvtrie allocates by hand and reclaims through a [`Retirer`].
pub(crate) trait Retire {
    /// Heap bytes the object's destructor frees (for the backlog figures).
    fn heap_bytes(&self) -> usize;

    /// Frees the object.
    ///
    /// # Safety
    ///
    /// `p` was allocated as the implementation expects, no other thread holds it, and it is
    /// destroyed exactly once.
    unsafe fn destroy(p: *mut Self);
}

/// Type-erased [`Retire::destroy`].
///
/// # Safety
///
/// `p` is a `*mut T` satisfying [`Retire::destroy`]'s contract.
unsafe fn destroy_erased<T: Retire>(p: *mut ()) {
    // Safety: forwarded to the caller.
    unsafe { T::destroy(p.cast::<T>()) }
}

/// One retired object, type-erased, with the heap bytes its destructor frees.
struct Retired {
    ptr: *mut (),
    destroy: unsafe fn(*mut ()),
    bytes: usize,
}

/// Objects retired into one shard (`origin`, whose counters they are in): being filled, then
/// handed to crossbeam, then parked or freed.
#[derive(Default)]
struct Batch {
    items: Vec<Retired>,
    bytes: usize,
    origin: usize,
}

/// A shard's batch being filled, how many batches it deferred since its last flush, and the
/// expired batch its writers are freeing a few objects at a time (see [`Parked`]).
#[derive(Default)]
struct Filling {
    batch: Batch,
    deferred: usize,
    draining: Batch,
}

// Safety: a batch only holds retired (unlinked) objects, which its single destructor call may
// free on any thread (the `Retire` contract: destructors are sound on any thread).
unsafe impl Send for Batch {}

impl Batch {
    /// Frees every object.
    ///
    /// # Safety
    ///
    /// No thread can still hold any of the batch's objects (their grace period has passed, or
    /// the structure that retired them is being dropped).
    unsafe fn free(self) {
        for r in self.items {
            // Safety: each object was retired once (`Retirer::retire`'s contract) and, by this
            // function's contract, is no longer held by any thread.
            unsafe { r.free() };
        }
    }
}

impl Batch {
    /// Frees every object and counts them as freed in their shard's figures.
    ///
    /// # Safety
    ///
    /// As for [`Batch::free`].
    unsafe fn free_counted(self, shards: &[CachePadded<Shard>]) {
        let (origin, n, bytes) = (self.origin, self.items.len(), self.bytes);
        // Safety: forwarded to the caller.
        unsafe { self.free() };
        shards[origin].count_freed(n, bytes);
    }
}

impl Retired {
    /// Frees the object.
    ///
    /// # Safety
    ///
    /// As for [`Batch::free`]: its grace period has passed (or its structure is being dropped),
    /// and it is freed once.
    unsafe fn free(self) {
        // Safety: forwarded to the caller; `destroy` is the object's own (`destroy_erased`).
        unsafe { (self.destroy)(self.ptr) }
    }
}

/// Objects per batch: one deferred function frees this many objects.
#[cfg(not(any(loom, miri)))]
const BATCH: usize = 64;
/// Under miri, small batches so the batching path runs in small tests.
#[cfg(all(miri, not(loom)))]
const BATCH: usize = 4;
/// Under loom every object is deferred on its own, exactly when it is retired, so a premature
/// retirement is caught at the earliest point (a batched object would only be freed later).
#[cfg(loom)]
const BATCH: usize = 1;

/// A batch holding this many bytes is deferred even if it is not full (large objects should
/// not wait for 63 more).
const BATCH_BYTES: usize = 256 << 10;

/// Expired objects a writer frees after each write ([`Retirer::flush_if_due`]): more than an
/// insert or a route retires (about one), so the parked batches drain between bursts.
const FREE_PER_WRITE: usize = 8;

/// At most this many expired objects wait in [`Parked`]; a batch that would exceed it is freed
/// at once by the thread whose collection found it expired, as if there were no parking.
#[cfg(not(any(loom, miri)))]
const PARKED_MAX: usize = 16 * BATCH;
/// Under miri, a few small batches.
#[cfg(all(miri, not(loom)))]
const PARKED_MAX: usize = 4 * BATCH;
/// Under loom, one object: the models see both a parked object and one freed at once.
#[cfg(loom)]
const PARKED_MAX: usize = 1;

/// At most this many bytes of expired objects wait in [`Parked`].
const PARKED_MAX_BYTES: usize = 1 << 20;

/// Every this many deferred batches a shard flushes: crossbeam then gets bags of this many
/// batches (`FLUSH_EVERY × BATCH` objects; a collection frees 8 bags), and a thread that goes
/// idle strands at most `FLUSH_EVERY - 1` batches in its thread-local bag.
const FLUSH_EVERY: usize = 8;

struct Shard {
    filling: Mutex<Filling>,
    /// Enough batches were deferred on this shard to hand the bag over (see `flush_if_due`).
    flush_due: AtomicBool,
    /// The shard's `draining` batch is not empty (Relaxed: a hint, checked under the lock).
    draining: AtomicBool,
    /// Objects of batches this shard deferred and not freed yet, in crossbeam or parked (the
    /// filling batch counts its own, under the lock: a retire touches no shared counter).
    deferred_objects: AtomicUsize,
    /// Their heap bytes.
    deferred_bytes: AtomicUsize,
}

/// Batches whose grace period has passed, waiting for writers to free them a few objects per
/// write (see the module docs, *Freeing a few at a time*). Measured on W1 route cycles on two
/// threads: 2,781 of the 3,308 times a writer thread went to sleep, it waited for a glibc arena
/// lock inside a collection's burst of frees; with parking, 141 of 369.
#[derive(Default)]
struct Parked {
    batches: Vec<Batch>,
    objects: usize,
    bytes: usize,
    /// The retirer was dropped: batches that expire later are freed at once.
    closed: bool,
    /// Batches taken by writers to drain, ever (wrapping): tells idle writers from busy ones.
    takes: usize,
}

/// Retired-but-unfreed objects of one structure (see [`Retirer::backlog`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Backlog {
    pub(crate) objects: usize,
    pub(crate) bytes: usize,
}

/// Batched retirement for one structure (a tree, an index): see the module docs.
pub(crate) struct Retirer {
    shards: Arc<[CachePadded<Shard>]>,
    parked: Arc<ParkedQueue>,
    /// [`Parked::takes`] at the last [`Retirer::free_parked_if_idle`].
    idle_mark: AtomicUsize,
}

/// [`Parked`] behind its lock, with a lock-free hint of whether it holds anything.
#[derive(Default)]
struct ParkedQueue {
    queue: Mutex<Parked>,
    /// Objects parked (Relaxed: a hint for writers to skip the lock when nothing is parked).
    objects: AtomicUsize,
}

impl ParkedQueue {
    /// Parks an expired batch, or gives it back to be freed at once (the queue is full or
    /// closed).
    fn park(&self, batch: Batch) -> Option<Batch> {
        let mut q = crate::sync::lock(&self.queue);
        if q.closed
            || q.objects + batch.items.len() > PARKED_MAX
            || q.bytes + batch.bytes > PARKED_MAX_BYTES
        {
            return Some(batch);
        }
        q.objects += batch.items.len();
        q.bytes += batch.bytes;
        q.batches.push(batch);
        self.objects.store(q.objects, Ordering::Relaxed);
        None
    }

    /// Takes the most recently parked batch, unless another thread holds the queue (a writer
    /// then frees nothing this time rather than sleep on the lock).
    fn try_take_one(&self) -> Option<Batch> {
        let mut q = crate::sync::try_lock(&self.queue)?;
        let b = q.batches.pop()?;
        q.takes = q.takes.wrapping_add(1);
        q.objects -= b.items.len();
        q.bytes -= b.bytes;
        self.objects.store(q.objects, Ordering::Relaxed);
        Some(b)
    }

    /// Takes the parked batches retired on shard `origin`.
    fn take_from(&self, origin: usize) -> Vec<Batch> {
        let mut q = crate::sync::lock(&self.queue);
        // In place: the others keep their storage (this runs at every chunk of an eviction).
        let mine: Vec<Batch> = q.batches.extract_if(.., |b| b.origin == origin).collect();
        for b in &mine {
            q.objects -= b.items.len();
            q.bytes -= b.bytes;
        }
        self.objects.store(q.objects, Ordering::Relaxed);
        mine
    }

    /// Takes every parked batch (`close`: and parks no more).
    fn take_all(&self, close: bool) -> Vec<Batch> {
        let mut q = crate::sync::lock(&self.queue);
        q.closed |= close;
        (q.objects, q.bytes) = (0, 0);
        self.objects.store(0, Ordering::Relaxed);
        std::mem::take(&mut q.batches)
    }
}

impl Default for Retirer {
    fn default() -> Self {
        Self::new()
    }
}

impl Shard {
    /// Counts `objects` objects of `bytes` heap bytes, deferred from this shard, as freed.
    fn count_freed(&self, objects: usize, bytes: usize) {
        // Relaxed: figures only (see `count_deferred`).
        self.deferred_objects.fetch_sub(objects, Ordering::Relaxed);
        self.deferred_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Counts `batch` as deferred (under the filling lock, just before it leaves the shard).
    fn count_deferred(&self, batch: &Batch) {
        // Relaxed: figures only; the filling lock orders them with the batch hand-over for
        // `Retirer::backlog`.
        self.deferred_objects
            .fetch_add(batch.items.len(), Ordering::Relaxed);
        self.deferred_bytes
            .fetch_add(batch.bytes, Ordering::Relaxed);
    }
}

impl Retirer {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..crate::sync::SHARDS)
                .map(|_| {
                    CachePadded::new(Shard {
                        filling: Mutex::new(Filling::default()),
                        flush_due: AtomicBool::new(false),
                        draining: AtomicBool::new(false),
                        deferred_objects: AtomicUsize::new(0),
                        deferred_bytes: AtomicUsize::new(0),
                    })
                })
                .collect(),
            parked: Arc::default(),
            idle_mark: AtomicUsize::new(0),
        }
    }

    /// Retires `ptr`: it is freed once no thread that is pinned now can still hold it.
    ///
    /// # Safety
    ///
    /// As for [`retire`]: `ptr` is unlinked from every shared location, retired exactly once,
    /// and [`Retire::destroy`] may run on any thread once no other thread holds it.
    pub(crate) unsafe fn retire<T: Retire>(&self, guard: &Guard, ptr: *mut T) {
        // Safety: the object is still allocated: it is freed only after this call defers it.
        let bytes = unsafe { &*ptr }.heap_bytes();
        let i = crate::sync::shard_index();
        let shard = &self.shards[i];
        let (full, flush) = {
            let mut f = crate::sync::lock(&shard.filling);
            f.batch.items.push(Retired {
                ptr: ptr.cast(),
                destroy: destroy_erased::<T>,
                bytes,
            });
            f.batch.bytes += bytes;
            if f.batch.items.len() >= BATCH || f.batch.bytes >= BATCH_BYTES {
                f.deferred += 1;
                let flush = f.deferred >= FLUSH_EVERY;
                if flush {
                    f.deferred = 0;
                }
                // The next batch gets its room at once (not five doublings of a Vec).
                let next = Batch {
                    items: Vec::with_capacity(BATCH),
                    ..Batch::default()
                };
                shard.count_deferred(&f.batch);
                (Some(std::mem::replace(&mut f.batch, next)), flush)
            } else {
                (None, false)
            }
        };
        if let Some(batch) = full {
            self.defer_batch(guard, i, batch);
        }
        if flush {
            // Due: the caller hands the bag over once it released its locks
            // (`flush_if_due`); crossbeam also pushes a full bag by itself.
            shard.flush_due.store(true, Ordering::Relaxed);
        }
    }

    /// Hands this thread's bag of deferred batches to the global queue (and collects up to 8
    /// expired bags) if enough batches were deferred since the last time, then frees up to
    /// [`FREE_PER_WRITE`] parked objects (see [`Parked`]). Inserts call it after releasing
    /// their node locks, so no freeing happens inside a node's critical section.
    pub(crate) fn flush_if_due(&self, guard: &Guard) {
        let shard = self.hand_over_if_due(guard);
        // Relaxed hints: a parked batch missed here is freed by a later write or a flush.
        if shard.draining.load(Ordering::Relaxed) || self.parked.objects.load(Ordering::Relaxed) > 0
        {
            self.free_parked_some(shard);
        }
    }

    /// For bulk operations (an eviction, a tenant's removal), between their chunks of work:
    /// hands the bag over if due, like [`Self::flush_if_due`], then frees, on the operation's
    /// thread, the parked batches retired on its shard (what it retired itself and found
    /// expired so far) and its shard's draining batch. Other threads' batches stay parked for
    /// their writers: freed here in bulk, they would take those writers' arena locks.
    pub(crate) fn flush_bulk(&self, guard: &Guard) {
        self.hand_over_if_due(guard);
        self.free_parked_own();
    }

    /// Frees the parked batches retired on this thread's shard, and its draining batch.
    fn free_parked_own(&self) {
        let i = crate::sync::shard_index();
        let batches = self.parked.take_from(i);
        self.free_expired(batches, std::slice::from_ref(&self.shards[i]));
    }

    /// Frees `batches` (taken from the parked queue) and the draining batches of `shards`.
    fn free_expired(&self, mut batches: Vec<Batch>, shards: &[CachePadded<Shard>]) {
        for shard in shards {
            let b = {
                let mut f = crate::sync::lock(&shard.filling);
                shard.draining.store(false, Ordering::Relaxed);
                std::mem::take(&mut f.draining)
            };
            if !b.items.is_empty() {
                batches.push(b);
            }
        }
        for b in batches {
            // Safety: parked and draining batches expired before they were parked.
            unsafe { b.free_counted(&self.shards) };
        }
    }

    /// Hands this thread's bag to the global queue if enough batches were deferred since the
    /// last time (see [`Self::flush_if_due`]); returns this thread's shard.
    fn hand_over_if_due(&self, guard: &Guard) -> &Shard {
        let shard = &self.shards[crate::sync::shard_index()];
        // Relaxed: a hint about this thread's own bag; nothing is published with it.
        if shard.flush_due.load(Ordering::Relaxed) {
            shard.flush_due.store(false, Ordering::Relaxed);
            guard.flush();
        }
        shard
    }

    /// Frees up to [`FREE_PER_WRITE`] parked objects: from the shard's draining batch, which
    /// takes a parked batch when it is empty.
    fn free_parked_some(&self, shard: &Shard) {
        let mut some: [Option<Retired>; FREE_PER_WRITE] = [const { None }; FREE_PER_WRITE];
        let origin = {
            let mut f = crate::sync::lock(&shard.filling);
            if f.draining.items.is_empty() {
                match self.parked.try_take_one() {
                    Some(b) => f.draining = b,
                    None => {
                        shard.draining.store(false, Ordering::Relaxed);
                        return;
                    }
                }
            }
            for r in &mut some {
                *r = f.draining.items.pop();
                // The batch's bytes stay those of the objects it still holds.
                f.draining.bytes -= r.as_ref().map_or(0, |r| r.bytes);
            }
            let left = !f.draining.items.is_empty();
            shard.draining.store(left, Ordering::Relaxed);
            f.draining.origin
        };
        let (mut n, mut bytes) = (0, 0);
        for r in some.into_iter().flatten() {
            (n, bytes) = (n + 1, bytes + r.bytes);
            // Safety: the object's batch expired (crossbeam ran its deferred function, see
            // `defer_batch`) before it was parked, and it left the batch once, above.
            unsafe { r.free() };
        }
        self.shards[origin].count_freed(n, bytes);
    }

    /// Frees every parked object and every shard's draining batch (`close`: and parks no more).
    fn free_parked_all(&self, close: bool) {
        self.free_expired(self.parked.take_all(close), &self.shards);
    }

    /// Defers a batch as one function, which parks it for writers to free (or frees it).
    fn defer_batch(&self, guard: &Guard, shard: usize, mut batch: Batch) {
        batch.origin = shard;
        let shards = Arc::clone(&self.shards);
        let parked = Arc::clone(&self.parked);
        let free = move || {
            // crossbeam runs this only after every guard that was active when the batch was
            // deferred has been dropped, and each object was unlinked before it entered the
            // batch, earlier still: the batch has expired.
            if let Some(batch) = parked.park(batch) {
                // Safety: expired (above).
                unsafe { batch.free_counted(&shards) };
            }
        };
        guard.defer(free);
    }

    /// Defers every partial batch, flushes, and frees the parked batches retired on this
    /// thread's shard (as [`Self::flush_bulk`]): after this, the structure's retired objects
    /// are in the global queue, parked, or freed; those in the queue are parked when their
    /// grace period ends (or freed, if the parking is full).
    pub(crate) fn flush(&self, guard: &Guard) {
        for (i, shard) in self.shards.iter().enumerate() {
            let batch = {
                let mut f = crate::sync::lock(&shard.filling);
                f.deferred = 0;
                shard.count_deferred(&f.batch);
                std::mem::take(&mut f.batch)
            };
            if !batch.items.is_empty() {
                self.defer_batch(guard, i, batch);
            }
        }
        guard.flush();
        self.free_parked_own();
    }

    /// [`Self::flush`]es if no writer took a parked batch to drain since the last call while
    /// something is pending (the writers are idle, so nothing else would free what is parked,
    /// nor defer their partial batches). Eviction passes that evict nothing call it, so the
    /// background thread frees what idle writers left behind over its next passes.
    pub(crate) fn free_parked_if_idle(&self) {
        let takes = crate::sync::lock(&self.parked.queue).takes;
        // Relaxed: only the eviction pass reads and writes the mark.
        if self.idle_mark.swap(takes, Ordering::Relaxed) == takes && self.backlog().objects > 0 {
            self.flush(&pin());
            self.free_parked_all(false);
        }
    }

    /// Frees every parked object now (test support: `collect_garbage` after its collections).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn free_parked(&self) {
        self.free_parked_all(false);
    }

    /// Retired objects not yet freed, and their heap bytes.
    pub(crate) fn backlog(&self) -> Backlog {
        self.shards.iter().fold(Backlog::default(), |b, s| {
            // Under the filling lock, which a batch leaves only after it was counted as
            // deferred: no batch is missed or counted twice.
            let f = crate::sync::lock(&s.filling);
            Backlog {
                objects: b.objects
                    + f.batch.items.len()
                    + s.deferred_objects.load(Ordering::Relaxed),
                bytes: b.bytes + f.batch.bytes + s.deferred_bytes.load(Ordering::Relaxed),
            }
        })
    }
}

impl Drop for Retirer {
    fn drop(&mut self) {
        // Objects still in partial batches were retired by operations of the owning structure,
        // which is being dropped: no thread is inside one of its operations, so none can hold
        // them. Free them now rather than leave them to the reclaimer.
        for shard in self.shards.iter() {
            let batch = std::mem::take(&mut crate::sync::lock(&shard.filling).batch);
            // Safety: see above; the owner's `Drop` runs with exclusive access.
            unsafe { batch.free() };
        }
        // Parked batches expired already; batches that expire later are freed when they do.
        self.free_parked_all(true);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize as StdCounter, Ordering as StdOrdering};

    /// A retirable object that counts its own destruction.
    struct Counted(Arc<StdCounter>);

    impl Retire for Counted {
        fn heap_bytes(&self) -> usize {
            10
        }

        unsafe fn destroy(p: *mut Self) {
            // Safety: `p` came from `Box::into_raw` in `retire_n` and is destroyed once.
            let b = unsafe { Box::from_raw(p) };
            b.0.fetch_add(1, StdOrdering::Relaxed);
        }
    }

    /// A collector of the test's own: other tests' pinned threads cannot hold its epoch back,
    /// and only this test's thread runs its deferred functions.
    struct Epoch(Option<crossbeam_epoch::LocalHandle>);

    impl Drop for Epoch {
        fn drop(&mut self) {
            // Under miri (Tree Borrows, as CI runs it), dropping the last handle of a collector
            // other than the global one is reported as undefined behavior inside crossbeam-epoch
            // itself (its deallocation of the collector's list; crossbeam-rs/crossbeam#545 is
            // the same report under Stacked Borrows): leak it there (miri ignores leaks in CI).
            if cfg!(miri) {
                std::mem::forget(self.0.take());
            }
        }
    }

    impl Epoch {
        fn new() -> Self {
            Self(Some(crossbeam_epoch::Collector::new().register()))
        }

        fn pin(&self) -> Guard {
            self.0.as_ref().expect("dropped only at the end").pin()
        }

        /// Collects (without `Retirer::flush`, which frees what is parked) until `done`.
        fn collect_until(&self, done: impl Fn() -> bool) {
            for _ in 0..1_000 {
                if done() {
                    return;
                }
                self.pin().flush();
            }
            panic!("the epoch did not advance");
        }
    }

    fn retire_n(e: &Epoch, r: &Retirer, freed: &Arc<StdCounter>, n: usize) {
        let guard = e.pin();
        for _ in 0..n {
            let p = Box::into_raw(Box::new(Counted(Arc::clone(freed))));
            // Safety: `p` was never shared, and is retired once.
            unsafe { r.retire(&guard, p) };
        }
    }

    fn parked(r: &Retirer) -> usize {
        r.parked.objects.load(Ordering::Relaxed)
    }

    fn count(c: &StdCounter) -> usize {
        c.load(StdOrdering::Relaxed)
    }

    /// A retirer with `n` retired objects (whole batches) whose batches expired and were
    /// parked, and the count of objects freed.
    fn with_parked(n: usize) -> (Epoch, Retirer, Arc<StdCounter>) {
        let (e, r) = (Epoch::new(), Retirer::new());
        let freed = Arc::new(StdCounter::new(0));
        retire_n(&e, &r, &freed, n);
        e.collect_until(|| parked(&r) == n);
        (e, r, freed)
    }

    #[test]
    fn expired_batches_wait_parked_and_writes_free_a_few_each() {
        let (e, r, freed) = with_parked(2 * BATCH);
        assert_eq!(count(&freed), 0, "parked, not freed");
        let backlog = r.backlog();
        assert_eq!(
            backlog.objects,
            2 * BATCH,
            "parked objects count until freed"
        );
        assert_eq!(backlog.bytes, 2 * BATCH * 10);
        // A write frees a few of them, from one parked batch (a write drains one at a time).
        r.flush_if_due(&e.pin());
        let first = FREE_PER_WRITE.min(BATCH);
        assert_eq!(count(&freed), first);
        assert_eq!(r.backlog().objects, 2 * BATCH - first);
        assert_eq!(r.backlog().bytes, r.backlog().objects * 10);
        // Writes go on freeing them, a few at a time.
        for _ in 0..2 * BATCH {
            r.flush_if_due(&e.pin());
        }
        assert_eq!(count(&freed), 2 * BATCH);
        assert_eq!(r.backlog(), Backlog::default());
    }

    #[test]
    fn a_flush_frees_every_parked_and_draining_object() {
        let (e, r, freed) = with_parked(2 * BATCH);
        // One batch starts draining, the other stays parked.
        r.flush_if_due(&e.pin());
        assert!(count(&freed) < 2 * BATCH);
        r.flush(&e.pin());
        assert_eq!(count(&freed), 2 * BATCH);
        assert_eq!(r.backlog(), Backlog::default());
    }

    #[test]
    fn bulk_flushes_free_their_own_parked_batches_and_leave_the_others() {
        let (e, r, freed) = with_parked(BATCH);
        // A batch retired on another shard, expired and parked for the writers.
        let other = (crate::sync::shard_index() + 1) % crate::sync::SHARDS;
        let items = (0..BATCH)
            .map(|_| Retired {
                ptr: Box::into_raw(Box::new(Counted(Arc::clone(&freed)))).cast(),
                destroy: destroy_erased::<Counted>,
                bytes: 10,
            })
            .collect();
        let batch = Batch {
            items,
            bytes: BATCH * 10,
            origin: other,
        };
        r.shards[other].count_deferred(&batch);
        assert!(r.parked.park(batch).is_none());
        r.flush_bulk(&e.pin());
        assert_eq!(count(&freed), BATCH, "this thread's batch is freed");
        assert_eq!(parked(&r), BATCH, "the other shard's stays parked");
        assert_eq!(r.backlog().objects, BATCH);
        // Any writer drains it.
        for _ in 0..BATCH {
            r.flush_if_due(&e.pin());
        }
        assert_eq!(count(&freed), 2 * BATCH);
        assert_eq!(r.backlog(), Backlog::default());
    }

    #[test]
    fn batches_beyond_the_parking_bound_are_freed_at_once() {
        let (e, r) = (Epoch::new(), Retirer::new());
        let freed = Arc::new(StdCounter::new(0));
        let n = PARKED_MAX + 2 * BATCH;
        retire_n(&e, &r, &freed, n);
        e.collect_until(|| count(&freed) + parked(&r) == n);
        assert_eq!(parked(&r), PARKED_MAX);
        assert_eq!(count(&freed), 2 * BATCH);
        assert_eq!(r.backlog().objects, PARKED_MAX);
    }

    #[test]
    fn idle_checks_free_what_is_parked_once_no_writer_takes_any() {
        let (e, r, freed) = with_parked(2 * BATCH);
        r.flush_if_due(&e.pin());
        // The first check sees a writer's take since the start; the second sees none and
        // frees the parked and the draining objects.
        r.free_parked_if_idle();
        assert!(count(&freed) < 2 * BATCH);
        r.free_parked_if_idle();
        assert_eq!(count(&freed), 2 * BATCH);
        assert_eq!(r.backlog(), Backlog::default());
        // A writer that took a parked batch since the last check is left to free the rest.
        retire_n(&e, &r, &freed, 2 * BATCH);
        e.collect_until(|| parked(&r) == 2 * BATCH);
        r.flush_if_due(&e.pin());
        r.free_parked_if_idle();
        let by_the_writer = FREE_PER_WRITE.min(BATCH);
        assert_eq!(count(&freed), 2 * BATCH + by_the_writer);
        assert_eq!(r.backlog().objects, 2 * BATCH - by_the_writer);
    }

    #[test]
    fn a_dropped_retirer_frees_what_is_parked_and_what_expires_later() {
        let (e, r, freed) = with_parked(BATCH);
        // A second batch, deferred but not expired yet while this guard is held.
        let guard = e.pin();
        retire_n(&e, &r, &freed, BATCH);
        drop(r);
        assert_eq!(count(&freed), BATCH, "the parked batch went with it");
        drop(guard);
        e.collect_until(|| count(&freed) == 2 * BATCH);
    }

    /// A retirable object with the heap bytes it is given, counting its own destruction.
    struct Weighed(Arc<StdCounter>, usize);

    impl Retire for Weighed {
        fn heap_bytes(&self) -> usize {
            self.1
        }

        unsafe fn destroy(p: *mut Self) {
            // Safety: `p` came from `Box::into_raw` in `retire_weighed` and is destroyed once.
            let b = unsafe { Box::from_raw(p) };
            b.0.fetch_add(1, StdOrdering::Relaxed);
        }
    }

    fn retire_weighed(e: &Epoch, r: &Retirer, freed: &Arc<StdCounter>, n: usize, bytes: usize) {
        let guard = e.pin();
        for _ in 0..n {
            let p = Box::into_raw(Box::new(Weighed(Arc::clone(freed), bytes)));
            // Safety: `p` was never shared, and is retired once.
            unsafe { r.retire(&guard, p) };
        }
    }

    /// The parked queue's own counts: objects, bytes, batches, takes.
    fn queue(r: &Retirer) -> (usize, usize, usize, usize) {
        let q = crate::sync::lock(&r.parked.queue);
        (q.objects, q.bytes, q.batches.len(), q.takes)
    }

    #[test]
    fn is_pinned_tells_a_pinned_thread() {
        assert!(!is_pinned());
        let guard = pin();
        assert!(is_pinned());
        drop(guard);
        assert!(!is_pinned());
    }

    #[test]
    fn the_parking_bound_counts_bytes_too() {
        // Each object fills a batch of its own, and four fill the parking's bytes exactly.
        const BIG: usize = PARKED_MAX_BYTES / 4;
        const { assert!(BIG >= BATCH_BYTES && 4 <= PARKED_MAX) };
        let (e, r) = (Epoch::new(), Retirer::new());
        let freed = Arc::new(StdCounter::new(0));
        retire_weighed(&e, &r, &freed, 5, BIG);
        e.collect_until(|| count(&freed) + parked(&r) == 5);
        assert_eq!(parked(&r), 4, "batches up to the byte bound park");
        assert_eq!(queue(&r), (4, PARKED_MAX_BYTES, 4, 0));
        assert_eq!(count(&freed), 1, "the one beyond it is freed at once");
        let backlog = Backlog {
            objects: 4,
            bytes: PARKED_MAX_BYTES,
        };
        assert_eq!(r.backlog(), backlog);
    }

    #[test]
    fn a_writer_takes_a_parked_batch_with_its_counts() {
        let (e, r, _freed) = with_parked(2 * BATCH);
        assert_eq!(queue(&r), (2 * BATCH, 2 * BATCH * 10, 2, 0));
        r.flush_if_due(&e.pin());
        assert_eq!(parked(&r), BATCH);
        assert_eq!(queue(&r), (BATCH, BATCH * 10, 1, 1));
    }

    #[test]
    fn a_bulk_flush_takes_its_batches_with_their_counts() {
        let (e, r, freed) = with_parked(BATCH);
        let other = (crate::sync::shard_index() + 1) % crate::sync::SHARDS;
        let items = (0..BATCH)
            .map(|_| Retired {
                ptr: Box::into_raw(Box::new(Weighed(Arc::clone(&freed), 100))).cast(),
                destroy: destroy_erased::<Weighed>,
                bytes: 100,
            })
            .collect();
        let batch = Batch {
            items,
            bytes: BATCH * 100,
            origin: other,
        };
        r.shards[other].count_deferred(&batch);
        assert!(r.parked.park(batch).is_none());
        assert_eq!(queue(&r), (2 * BATCH, BATCH * 110, 2, 0));
        r.flush_bulk(&e.pin());
        assert_eq!(parked(&r), BATCH);
        assert_eq!(queue(&r), (BATCH, BATCH * 100, 1, 0));
        // `collect_garbage`'s last step frees the other shard's batch too.
        r.free_parked();
        assert_eq!(count(&freed), 2 * BATCH);
        assert_eq!(queue(&r), (0, 0, 0, 0));
        assert_eq!(r.backlog(), Backlog::default());
    }
}
