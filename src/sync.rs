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
