//! The one place that talks to the epoch-based reclaimer.
//!
//! kvtrie uses [`crossbeam_epoch`]: readers [`pin`] the current epoch for the duration of one
//! operation; writers unlink an object and then [`retire`] it, which defers its destructor until
//! every thread that was pinned at the time has unpinned. Under `--cfg loom --cfg crossbeam_loom`
//! crossbeam-epoch itself is model-checked by loom, and the destructors of retired objects poison
//! them instead of freeing them, so a reader that reaches a prematurely retired object fails an
//! assertion instead of reading freed memory.

pub(crate) use crossbeam_epoch::Guard;

/// Pins the current thread to the current epoch.
#[inline]
pub(crate) fn pin() -> Guard {
    crossbeam_epoch::pin()
}

/// Defers `destroy(ptr)` until no thread that is pinned now can still hold `ptr`.
///
/// # Safety
///
/// `ptr` must already be unlinked from every shared location, so that threads pinning after this
/// call cannot reach it; it must be retired exactly once; and `destroy(ptr)` must be sound to call
/// from any thread once no other thread holds `ptr` (the pointee is `Send`).
#[inline]
pub(crate) unsafe fn retire<T>(guard: &Guard, ptr: *mut T, destroy: unsafe fn(*mut T)) {
    struct SendPtr<T>(*mut T);
    // Safety: the pointee is only touched by `destroy`, which the caller vouches may run on
    // any thread once the pointer is no longer shared.
    unsafe impl<T> Send for SendPtr<T> {}
    let p = SendPtr(ptr);
    // Safety: by the caller's contract the object is unlinked and retired once; crossbeam runs
    // the closure only after every guard that was active at this point has been dropped.
    unsafe {
        guard.defer_unchecked(move || {
            let p = p;
            destroy(p.0)
        })
    };
}

/// Pushes this thread's deferred destructors to the global queue and tries to collect.
///
/// Used by tests (and by `PrefixTree::collect_garbage`) so reclamation really happens while
/// small workloads run.
pub(crate) fn flush(guard: &Guard) {
    guard.flush();
}

/// A guard for code that has exclusive access to a structure (its `Drop`), where no other
/// thread can hold references into it.
///
/// # Safety
///
/// The caller must have exclusive access to every object it reads through this guard, and
/// must not retire anything through it that another thread could still hold.
#[inline]
#[allow(dead_code)]
pub(crate) unsafe fn unprotected() -> &'static Guard {
    // Safety: forwarded to the caller.
    unsafe { crossbeam_epoch::unprotected() }
}

/// Runs `f` once no thread that is pinned now can still observe the state before this call
/// (a grace period), e.g. to recycle a tenant slot only after every reader that could have seen
/// its old bits has finished.
pub(crate) fn defer<F: FnOnce() + Send + 'static>(guard: &Guard, f: F) {
    guard.defer(f);
}
