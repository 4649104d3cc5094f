//! CPU hints shared by the tree and the block index.

/// Hints the CPU to fetch the cache line holding `p` into all cache levels, so that a later
/// load of it overlaps other work instead of waiting. A hint only: any address will do (it
/// never faults) and it changes no program state; off x86-64 it does nothing.
#[inline]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // Safety: the build enables SSE (the `cfg` above; it is in the x86-64 baseline), the
        // intrinsic's one requirement; a prefetch never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) };
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = p;
}
