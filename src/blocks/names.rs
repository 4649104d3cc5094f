//! The reader-visible worker slot → [`WorkerId`] mapping of a [`BlockIndex`](super::BlockIndex).
//!
//! A published mapping is an immutable **directory** of pointers to immutable **chunks** of
//! [`CHUNK`] names. Naming one slot builds a copy of its chunk and a copy of the directory that
//! points to it (the other chunks are shared), publishes the new directory with one `Release`
//! swap, and retires the old directory together with the replaced chunk. A change therefore
//! costs `O(CHUNK + slots / CHUNK)`, not `O(slots)`, so registering `n` workers is `O(n²/64)`
//! pointer copies at worst instead of `O(n²)` names.
//!
//! # Ownership
//!
//! Every chunk is owned by exactly one current directory. A retired directory frees only its
//! own pointer array; the chunk it shared with its successor stays owned by the successor, and
//! the chunk that was replaced is retired in the same batch as the old directory. A reader that
//! loaded the old directory (pinned before the batch was retired) may still read through it:
//! both objects outlive its guard.

use super::event::WorkerId;
use crate::reclaim::{self, Guard};
use crate::sync::{AtomicPtr, Ordering};

/// Names per chunk.
pub(crate) const CHUNK: usize = 64;

/// Names of slots `k * CHUNK .. (k + 1) * CHUNK`; immutable once published.
struct NameChunk {
    ids: [Option<WorkerId>; CHUNK],
    /// Under loom, set by the retire destructor instead of freeing (see `crate::sync`).
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

/// A published directory; immutable once published.
pub(crate) struct SlotNames {
    chunks: Box<[*mut NameChunk]>,
    /// Under loom, set by the retire destructor instead of freeing (see `crate::sync`).
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

impl SlotNames {
    /// The worker named by `slot` in this snapshot (`None`: free or beyond the snapshot).
    #[inline]
    pub(crate) fn get(&self, slot: u32) -> Option<WorkerId> {
        #[cfg(loom)]
        self.poison.assert_alive("slot-name directory");
        let c = *self.chunks.get(slot as usize / CHUNK)?;
        // Safety: a chunk a published directory points to is freed only in the same retired
        // batch as the last directory that points to it, or by `Names::drop`; the caller
        // borrows this directory under a guard (or under exclusive access), so the chunk lives.
        let chunk = unsafe { &*c };
        #[cfg(loom)]
        chunk.poison.assert_alive("slot-name chunk");
        chunk.ids[slot as usize % CHUNK]
    }

    /// Heap bytes of this directory and its chunks.
    pub(crate) fn heap_bytes(&self) -> usize {
        core::mem::size_of::<SlotNames>()
            + self.chunks.len()
                * (core::mem::size_of::<*mut NameChunk>() + core::mem::size_of::<NameChunk>())
    }
}

/// An old directory and the chunk its successor replaced, retired together.
struct Retired {
    dir: *mut SlotNames,
    chunk: Option<*mut NameChunk>,
}

/// Destructor of a [`Retired`] batch: frees (under loom: poisons) the directory's pointer
/// array and the replaced chunk, never the chunks the successor still owns.
///
/// # Safety
///
/// `p` must come from `Box::into_raw`, its directory must be unlinked (replaced by a
/// successor), its chunk referenced by no current directory, and `p` passed exactly once.
unsafe fn free_retired(p: *mut Retired) {
    // Safety: forwarded to the caller.
    let r = unsafe { Box::from_raw(p) };
    #[cfg(loom)]
    // Safety: forwarded to the caller; under loom both are leaked, never freed.
    unsafe {
        (*r.dir).poison.poison();
        if let Some(c) = r.chunk {
            (*c).poison.poison();
        }
    }
    #[cfg(not(loom))]
    {
        // Safety: forwarded to the caller; the directory came from `Box::into_raw`.
        drop(unsafe { Box::from_raw(r.dir) });
        if let Some(c) = r.chunk {
            // Safety: forwarded to the caller; the chunk came from `Box::into_raw`.
            drop(unsafe { Box::from_raw(c) });
        }
    }
}

// Safety: the pointers are plain heap objects handed to the reclaimer; see `free_retired`.
unsafe impl Send for Retired {}

/// The atomic pointer to the current directory, and its writer-side operations.
pub(crate) struct Names {
    // Invariant: never null; points to a `SlotNames` from `Box::into_raw` whose chunk pointers
    // all come from `Box::into_raw` and are owned by it. Replaced only by the index writer.
    current: AtomicPtr<SlotNames>,
}

impl Names {
    /// An empty mapping.
    pub(crate) fn new() -> Self {
        let dir = Box::into_raw(Box::new(SlotNames {
            chunks: Box::new([]),
            #[cfg(loom)]
            poison: crate::sync::PoisonFlag::default(),
        }));
        Self {
            current: AtomicPtr::new(dir),
        }
    }

    /// The current directory, valid while both `self` and `guard` live.
    #[inline]
    pub(crate) fn load<'a>(&'a self, _guard: &'a Guard) -> &'a SlotNames {
        // Safety: `current` is never null and points to a live directory (Invariant). A
        // directory is freed only by its retire destructor, which runs after every guard that
        // was active when it was retired (including `_guard`, whose lifetime bounds the
        // reference) has been dropped, or by `Drop`, which cannot run while `&self` is
        // borrowed. Acquire pairs with the writer's Release swap, so the directory and its
        // chunks are fully written.
        let dir = unsafe { &*self.current.load(Ordering::Acquire) };
        #[cfg(loom)]
        dir.poison.assert_alive("slot-name directory");
        dir
    }

    /// Publishes `name` for `slot` (writer side: the caller holds the index's registry exclusively).
    /// Readers that load the directory after this call see it.
    pub(crate) fn set(&self, slot: u32, name: Option<WorkerId>, guard: &Guard) {
        let old_ptr = self.current.load(Ordering::Relaxed);
        // Safety: only the writer replaces the directory, and the caller is the writer, so
        // `old_ptr` stays live (and unretired) during this call.
        let old = unsafe { &*old_ptr };
        let k = slot as usize / CHUNK;
        let mut chunks: Vec<*mut NameChunk> = old.chunks.to_vec();
        let replaced = chunks.get(k).copied();
        let mut fresh = Box::new(NameChunk {
            ids: [None; CHUNK],
            #[cfg(loom)]
            poison: crate::sync::PoisonFlag::default(),
        });
        if let Some(c) = replaced {
            // Safety: `c` is owned by the current directory (see above), so it is live.
            fresh.ids = unsafe { (*c).ids };
        }
        fresh.ids[slot as usize % CHUNK] = name;
        let fresh = Box::into_raw(fresh);
        if k < chunks.len() {
            chunks[k] = fresh;
        } else {
            // Slots are handed out densely, so a new slot starts at most one new chunk.
            chunks.resize(k, core::ptr::null_mut());
            chunks.push(fresh);
            for c in chunks.iter_mut() {
                if c.is_null() {
                    *c = Box::into_raw(Box::new(NameChunk {
                        ids: [None; CHUNK],
                        #[cfg(loom)]
                        poison: crate::sync::PoisonFlag::default(),
                    }));
                }
            }
        }
        let new = Box::into_raw(Box::new(SlotNames {
            chunks: chunks.into_boxed_slice(),
            #[cfg(loom)]
            poison: crate::sync::PoisonFlag::default(),
        }));
        // Release: readers that Acquire the new directory see its chunks and everything the
        // writer did before (e.g. the bits it cleared before naming a slot free).
        let old = self.current.swap(new, Ordering::AcqRel);
        debug_assert_eq!(old, old_ptr);
        let retired = Box::into_raw(Box::new(Retired {
            dir: old,
            chunk: replaced,
        }));
        // Safety: the old directory is unlinked by the swap; the replaced chunk is referenced
        // only by it (the new directory points to the copy); readers pinned before this point
        // may still hold both, and the reclaimer waits for them. Retired once.
        unsafe { reclaim::retire(guard, retired, free_retired) };
    }
}

impl Drop for Names {
    fn drop(&mut self) {
        let p = self.current.load(Ordering::Relaxed);
        // Safety: `&mut self`: no reader or writer is left; the current directory and its
        // chunks were never retired (only replaced ones are), so this is their only release.
        let dir = unsafe { Box::from_raw(p) };
        for &c in dir.chunks.iter() {
            // Safety: as above; each chunk of the current directory came from
            // `Box::into_raw` and is owned by it alone.
            drop(unsafe { Box::from_raw(c) });
        }
    }
}
