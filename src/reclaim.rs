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
//!   as they go).
//!
//! The backlog of each structure is visible ([`Retirer::backlog`]).
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

/// One retired object, type-erased.
struct Retired {
    ptr: *mut (),
    destroy: unsafe fn(*mut ()),
}

/// Objects retired into one shard and not yet handed to crossbeam.
#[derive(Default)]
struct Batch {
    items: Vec<Retired>,
    bytes: usize,
}

/// A shard's batch being filled, and how many batches it deferred since its last flush.
#[derive(Default)]
struct Filling {
    batch: Batch,
    deferred: usize,
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
            unsafe { (r.destroy)(r.ptr) };
        }
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

/// Every this many deferred batches a shard flushes: crossbeam then gets bags of this many
/// batches (`FLUSH_EVERY × BATCH` objects; a collection frees 8 bags), and a thread that goes
/// idle strands at most `FLUSH_EVERY - 1` batches in its thread-local bag.
const FLUSH_EVERY: usize = 8;

struct Shard {
    filling: Mutex<Filling>,
    /// Enough batches were deferred on this shard to hand the bag over (see `flush_if_due`).
    flush_due: AtomicBool,
    /// Objects of batches this shard deferred and crossbeam has not freed yet (the filling
    /// batch counts its own, under the lock: a retire touches no shared counter).
    deferred_objects: AtomicUsize,
    /// Their heap bytes.
    deferred_bytes: AtomicUsize,
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
}

impl Default for Retirer {
    fn default() -> Self {
        Self::new()
    }
}

impl Shard {
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
                        deferred_objects: AtomicUsize::new(0),
                        deferred_bytes: AtomicUsize::new(0),
                    })
                })
                .collect(),
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
                    bytes: 0,
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
    /// expired bags) if enough batches were deferred since the last time. Writers call it after
    /// releasing their locks, so no freeing happens inside a critical section.
    pub(crate) fn flush_if_due(&self, guard: &Guard) {
        let shard = &self.shards[crate::sync::shard_index()];
        // Relaxed: a hint about this thread's own bag; nothing is published with it.
        if shard.flush_due.load(Ordering::Relaxed) {
            shard.flush_due.store(false, Ordering::Relaxed);
            guard.flush();
        }
    }

    /// Defers a batch as one function.
    fn defer_batch(&self, guard: &Guard, shard: usize, batch: Batch) {
        let (n, bytes) = (batch.items.len(), batch.bytes);
        let shards = Arc::clone(&self.shards);
        let free = move || {
            // Safety: crossbeam runs this only after every guard that was active when the
            // batch was deferred has been dropped, and each object was unlinked before it
            // entered the batch, earlier still.
            unsafe { batch.free() };
            shards[shard]
                .deferred_objects
                .fetch_sub(n, Ordering::Relaxed);
            shards[shard]
                .deferred_bytes
                .fetch_sub(bytes, Ordering::Relaxed);
        };
        guard.defer(free);
    }

    /// Defers every partial batch and flushes: after this, the structure's retired objects are
    /// all in the global queue, freed as soon as their grace period ends.
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
    }
}
