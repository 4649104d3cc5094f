//! The one place that chooses between `std` and `loom` synchronization primitives.
//!
//! Every atomic, mutex, reader-writer lock, thread and `UnsafeCell` used by the crate comes
//! from here (two process-wide counters that only spread threads over shards and trees over
//! first generations, part of no protocol, use `std` directly, here: `shard_index` and
//! `next_tree_number` below), so that `RUSTFLAGS="--cfg loom --cfg crossbeam_loom"` swaps all
//! of them for loom's model-checked versions at once (see `tests/loom.rs`).

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::{
    sync::{
        atomic::{
            fence, AtomicBool, AtomicIsize, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
        },
        Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    },
    thread,
};

#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::{
    sync::{
        atomic::{
            fence, AtomicBool, AtomicIsize, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
        },
        Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    },
    thread,
};

/// Number of shards of the crate's per-thread-sharded state (retired-object batches, node-id
/// caches, counters): threads are spread over them round-robin, so concurrent writers on
/// different threads rarely share a lock or a cache line.
#[cfg(not(loom))]
pub(crate) const SHARDS: usize = 8;
/// Under loom every modeled thread uses shard 0 (loom runs them on one OS thread).
#[cfg(loom)]
pub(crate) const SHARDS: usize = 1;

/// This thread's shard in `0..SHARDS`, assigned round-robin at its first use.
#[inline]
pub(crate) fn shard_index() -> usize {
    #[cfg(loom)]
    {
        0
    }
    #[cfg(not(loom))]
    {
        // A plain std atomic: it only spreads threads over shards and is not part of any
        // protocol (nothing depends on which shard a thread gets).
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        thread_local! {
            static SHARD: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SHARDS;
        }
        SHARD.with(|s| *s)
    }
}

/// One step of a spin-wait loop: a CPU hint, or yielding to the scheduler after `spins`
/// steps; under loom, a yield (so the model lets the lock holder run).
#[inline]
pub(crate) fn spin_wait(spins: &mut u32) {
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        *spins = spins.saturating_add(1);
        if *spins < 128 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Locks a mutex, ignoring poisoning. The crate's critical sections do not panic (their
/// `expect`s state invariants); if one did, the data behind the lock stays memory-safe (at
/// worst an LRU heap misses entries or a tenant registry is half-updated), which is why the
/// lock is taken over rather than turned into a second panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Locks a mutex if it is free (poisoning ignored, as in [`lock`]).
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Read-locks a reader-writer lock, ignoring poisoning (see [`lock`]).
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

/// Write-locks a reader-writer lock, ignoring poisoning (see [`lock`]).
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// A number no earlier call in this process returned (0, 1, 2, ...): `tenant::first_generation`
/// spreads trees over first generations with it (not under loom, where every tree takes the
/// same first generation so that models stay deterministic).
#[cfg(not(loom))]
pub(crate) fn next_tree_number() -> u64 {
    // A plain std atomic: it only spreads trees over generations and is not part of any
    // protocol.
    static TREES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    TREES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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
    pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};
    pub(crate) use std::thread;
    #[cfg(feature = "zmq")]
    pub(crate) use std::thread::JoinHandle;

    /// Locks an operating-system mutex, ignoring poisoning (see [`super::lock`]).
    pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks an operating-system mutex if it is free, ignoring poisoning.
    pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
        match m.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Plain `std` atomics for flags and counters outside every protocol that must never be
    /// loom's: a global allocator's byte count (loom's atomics cannot run in an allocator),
    /// the ZMQ subscriber thread's stop flag and subscriber ids (an OS thread that blocks in
    /// libzmq, like the eviction thread never part of a model), and the eviction thread's
    /// test hook.
    #[cfg(any(test, feature = "testing", feature = "zmq"))]
    pub(crate) mod atomic {
        #[cfg(feature = "zmq")]
        pub(crate) use std::sync::atomic::AtomicBool;
        #[cfg(feature = "zmq")]
        pub(crate) use std::sync::atomic::AtomicU64;
        #[cfg(feature = "testing")]
        pub(crate) use std::sync::atomic::AtomicUsize;
        pub(crate) use std::sync::atomic::Ordering;
    }
}
