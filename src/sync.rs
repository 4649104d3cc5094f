//! The one place that chooses between `std` and `loom` synchronization primitives.
//!
//! Every atomic, mutex, thread and `UnsafeCell` used by the crate comes from here, so that
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom"` swaps all of them for loom's model-checked
//! versions at once (see `tests/loom.rs`).

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::{
    sync::{
        atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    thread,
};

#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::{
    sync::{
        atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    thread,
};

/// `std`'s `UnsafeCell`, used only as a marker that makes a raw-table header `!Freeze` (so the
/// atomics that follow it in the same allocation may be written through pointers derived from
/// a shared reference to the header, under Tree Borrows). Never accessed, so loom has nothing
/// to model.
pub(crate) type FreezeMarker = std::cell::UnsafeCell<u32>;

/// Locks a mutex, ignoring poisoning: every critical section in this crate leaves its data
/// consistent before any operation that can panic, so a poisoned lock holds valid data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A "this object was reclaimed" flag for loom runs.
///
/// Under loom the destructors of retired objects set this flag instead of freeing memory, and
/// every read through a node or table asserts it is clear, so a premature retire fails the model
/// instead of silently reading freed memory. It is a plain `std` atomic on purpose: it is a test
/// oracle, not part of the algorithm, and must not add interleavings to the model. loom runs all
/// modeled threads on one OS thread, so the flag is coherent.
#[cfg(loom)]
#[derive(Default)]
pub(crate) struct PoisonFlag(std::sync::atomic::AtomicBool);

#[cfg(loom)]
impl PoisonFlag {
    pub(crate) fn poison(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    #[track_caller]
    pub(crate) fn assert_alive(&self, what: &str) {
        assert!(
            !self.0.load(std::sync::atomic::Ordering::SeqCst),
            "read of a reclaimed {what}: it was retired while still reachable"
        );
    }
}

/// Operating-system primitives for the background eviction thread, which sleeps with timeouts
/// and is never part of a loom model (loom cannot model timed waits). Everything the thread
/// does to the tree goes through the modeled primitives above.
pub(crate) mod os {
    pub(crate) use std::sync::{Condvar, Mutex};
    pub(crate) use std::thread;
}

/// The tree's writer lock: a test-and-test-and-set spin lock that yields after a short spin.
///
/// Writer critical sections are short (a few hundred nanoseconds), so on a contended handoff a
/// futex sleep/wake costs far more than the wait itself; spinning briefly keeps two writers
/// from serializing on syscalls. Under loom it is loom's `Mutex`.
#[cfg(not(loom))]
pub(crate) struct WriterLock<T> {
    locked: AtomicBool,
    data: std::cell::UnsafeCell<T>,
}

// Safety: the lock hands out `&mut T` to one thread at a time (acquire/release on `locked`).
#[cfg(not(loom))]
unsafe impl<T: Send> Sync for WriterLock<T> {}
// Safety: owning the lock owns the data.
#[cfg(not(loom))]
unsafe impl<T: Send> Send for WriterLock<T> {}

#[cfg(not(loom))]
impl<T> WriterLock<T> {
    pub(crate) fn new(data: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            data: std::cell::UnsafeCell::new(data),
        }
    }

    #[inline]
    pub(crate) fn lock(&self) -> WriterGuard<'_, T> {
        let mut spins = 0u32;
        loop {
            if !self.locked.swap(true, Ordering::Acquire) {
                return WriterGuard { lock: self };
            }
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins < 256 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

/// Exclusive access to a [`WriterLock`]'s data.
#[cfg(not(loom))]
pub(crate) struct WriterGuard<'a, T> {
    lock: &'a WriterLock<T>,
}

#[cfg(not(loom))]
impl<T> std::ops::Deref for WriterGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // Safety: this guard holds the lock (acquired with Acquire), so no other reference to
        // the data exists until it is released.
        unsafe { &*self.lock.data.get() }
    }
}

#[cfg(not(loom))]
impl<T> std::ops::DerefMut for WriterGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // Safety: as for `deref`; `&mut self` makes this the only access through the guard.
        unsafe { &mut *self.lock.data.get() }
    }
}

#[cfg(not(loom))]
impl<T> Drop for WriterGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

/// Under loom the writer lock is loom's `Mutex`, so the model explores its interleavings.
#[cfg(loom)]
pub(crate) struct WriterLock<T>(Mutex<T>);

#[cfg(loom)]
impl<T> WriterLock<T> {
    pub(crate) fn new(data: T) -> Self {
        Self(Mutex::new(data))
    }
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        lock(&self.0)
    }
}
