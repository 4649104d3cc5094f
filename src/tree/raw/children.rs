//! Child tables: a node's children by the first char of their edges.

use super::node::Node;
use crate::reclaim::Retire;
use crate::sync::{AtomicPtr, Ordering};
#[cfg(not(loom))]
use std::alloc::dealloc;
use std::alloc::{alloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// A node's children, sorted by edge key (first char of the edge): header, `len` keys, then
/// `len` child pointers (keys packed densely so a lookup scans one cache line).
///
/// Invariant: each child pointer is a live, published node whose edge starts with the char of
/// its key; a slot is swapped in place only by a split (under the parent's lock), for a node
/// with the same first char. A child is retired only after it is unlinked from the current
/// table. A `&ChildTable` exists only while an epoch guard pinned before the table was loaded
/// lives (see [`Node::child_table`]) or while the tree is exclusively owned, so the children
/// it names are allocated for as long as the reference: that makes [`ChildTable::iter`] and
/// [`ChildTable::get`] safe.
#[repr(C)]
pub(crate) struct ChildTable {
    len: u32,
    /// Makes the header `!Freeze`: the child slots after it are atomics written through
    /// pointers derived from `&ChildTable` (Tree Borrows would otherwise freeze them).
    _tail: crate::sync::FreezeMarker,
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

impl ChildTable {
    fn layout(n: usize) -> (Layout, usize, usize) {
        let (l, keys) = Layout::new::<ChildTable>()
            .extend(Layout::array::<u32>(n).expect("child table layout"))
            .expect("child table layout");
        let (l, ptrs) = l
            .extend(Layout::array::<AtomicPtr<Node>>(n).expect("child table layout"))
            .expect("child table layout");
        debug_assert_eq!((keys, ptrs), (Self::KEYS_OFF, Self::ptrs_off(n)));
        (l.pad_to_align(), keys, ptrs)
    }

    /// Offset of the keys (what [`Self::layout`] computes, without its overflow checks: the
    /// accessors run on every lookup).
    const KEYS_OFF: usize = size_of::<ChildTable>().next_multiple_of(align_of::<u32>());

    /// Offset of the child pointers of a table of `n` children (see [`Self::KEYS_OFF`]).
    #[inline]
    fn ptrs_off(n: usize) -> usize {
        (Self::KEYS_OFF + n * size_of::<u32>()).next_multiple_of(align_of::<AtomicPtr<Node>>())
    }

    /// Allocates a table from `(key, child)` pairs in strictly ascending key order (at least
    /// one).
    fn alloc(entries: impl ExactSizeIterator<Item = (u32, *mut Node)>) -> NonNull<ChildTable> {
        let n = entries.len();
        debug_assert!(n > 0);
        let (layout, koff, poff) = Self::layout(n);
        // Safety: non-zero size.
        let p = unsafe { alloc(layout) }.cast::<ChildTable>();
        let Some(p) = NonNull::new(p) else {
            handle_alloc_error(layout)
        };
        let header = ChildTable {
            len: n as u32,
            _tail: crate::sync::FreezeMarker::new(0),
            #[cfg(loom)]
            poison: Default::default(),
        };
        // Safety: fresh allocation of `layout`, aligned for the header.
        unsafe { p.as_ptr().write(header) };
        // `n` keys at `koff` and `n` pointers at `poff` fit the allocation, each aligned as
        // `Layout::extend` computed.
        let k = p.as_ptr().cast::<u8>().wrapping_add(koff).cast::<u32>();
        let c = p
            .as_ptr()
            .cast::<u8>()
            .wrapping_add(poff)
            .cast::<AtomicPtr<Node>>();
        let mut prev = None;
        for (i, (key, child)) in entries.enumerate() {
            debug_assert!(prev.is_none_or(|p| p < key), "keys strictly ascending");
            prev = Some(key);
            // Safety: key `i < n` of the fresh allocation (see above), not shared yet.
            unsafe { k.wrapping_add(i).write(key) };
            // Safety: slot `i < n` of the fresh allocation, not shared yet.
            unsafe { c.wrapping_add(i).write(AtomicPtr::new(child)) };
        }
        p
    }

    /// Frees a table (not the children).
    ///
    /// # Safety
    ///
    /// `p` came from [`ChildTable::alloc`], no other thread holds it, freed once.
    pub(super) unsafe fn destroy(p: *mut ChildTable) {
        #[cfg(loom)]
        {
            // Safety: still allocated (never freed under loom).
            unsafe { (*p).poison.poison() };
        }
        #[cfg(not(loom))]
        {
            // Safety: `p` is live (caller's contract).
            let n = unsafe { (*p).len } as usize;
            let (layout, _, poff) = Self::layout(n);
            let c = p.cast::<u8>().wrapping_add(poff).cast::<AtomicPtr<Node>>();
            for i in 0..n {
                // Safety: slot `i < n` is an initialized atomic of the table, dropped once.
                unsafe { std::ptr::drop_in_place(c.wrapping_add(i)) };
            }
            // Safety: the header is initialized and dropped once.
            unsafe { std::ptr::drop_in_place(p) };
            // Safety: the block was allocated with `layout` and is freed once.
            unsafe { dealloc(p.cast::<u8>(), layout) };
        }
    }

    #[inline]
    pub(crate) fn check(&self) {
        #[cfg(loom)]
        self.poison.assert_alive("child table");
    }

    /// Number of children.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    /// The keys, ascending.
    #[inline]
    pub(crate) fn keys(&self) -> &[u32] {
        let start = (self as *const ChildTable)
            .cast::<u8>()
            .wrapping_add(Self::KEYS_OFF)
            .cast::<u32>();
        // Safety: `len` initialized keys follow the header at `koff` (independent of `len`).
        unsafe { std::slice::from_raw_parts(start, self.len as usize) }
    }

    /// The child slots, in key order.
    #[inline]
    fn slots(&self) -> &[AtomicPtr<Node>] {
        let n = self.len as usize;
        let start = (self as *const ChildTable)
            .cast::<u8>()
            .wrapping_add(Self::ptrs_off(n))
            .cast::<AtomicPtr<Node>>();
        // Safety: `n` initialized pointers follow the keys at `poff`.
        unsafe { std::slice::from_raw_parts(start, n) }
    }

    /// `(key, child)` pairs, in key order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Node)> + '_ {
        self.raw_iter().map(|(k, c)| {
            // Safety: see the type's invariant: the child is live as long as `self` is borrowed.
            let c = unsafe { &*c };
            c.check();
            (k, c)
        })
    }

    /// `(key, child)` pairs as raw pointers, with the allocations' provenance (Acquire loads,
    /// pairing with the Release that published the table or swapped the slot).
    pub(super) fn raw_iter(&self) -> impl Iterator<Item = (u32, *mut Node)> + '_ {
        self.keys()
            .iter()
            .zip(self.slots())
            .map(|(&k, c)| (k, c.load(Ordering::Acquire)))
    }

    /// Index of the entry with `key`.
    #[inline]
    pub(crate) fn find(&self, key: u32) -> Option<usize> {
        let k = self.keys();
        if k.len() <= 64 {
            // Branch-free: count the smaller keys (vectorizes), then check the candidate.
            let i = k.iter().map(|&x| (x < key) as usize).sum::<usize>();
            (k.get(i) == Some(&key)).then_some(i)
        } else {
            k.binary_search(&key).ok()
        }
    }

    /// The child with `key`.
    #[inline]
    pub(crate) fn get(&self, key: u32) -> Option<&Node> {
        let i = self.find(key)?;
        // Acquire: pairs with the Release that published the table or swapped the slot.
        let c = self.slots()[i].load(Ordering::Acquire);
        // Safety: see the type's invariant: the child is live as long as `self` is borrowed.
        let c = unsafe { &*c };
        c.check();
        Some(c)
    }

    /// Replaces the child keyed `key` in place (a split), returning the old child with its
    /// allocation's provenance; `None` if there is no such child.
    ///
    /// # Safety
    ///
    /// The caller holds the lock of the node this table belongs to, and `new` is a live node
    /// whose edge starts with the char keyed `key`; the caller retires the returned node.
    pub(super) unsafe fn swap_child(&self, key: u32, new: *mut Node) -> Option<*mut Node> {
        let i = self.find(key)?;
        // AcqRel: Release publishes `new` to readers that Acquire-load the slot.
        Some(self.slots()[i].swap(new, Ordering::AcqRel))
    }

    /// Heap bytes of a table with `n` entries.
    pub(crate) fn bytes(n: usize) -> usize {
        if n == 0 {
            0
        } else {
            Self::layout(n).0.size()
        }
    }
}

impl Retire for ChildTable {
    fn heap_bytes(&self) -> usize {
        Self::bytes(self.len())
    }

    unsafe fn destroy(p: *mut Self) {
        // Safety: forwarded to the caller.
        unsafe { ChildTable::destroy(p) }
    }
}

/// A child table not yet published, exclusively owned; freed (not its children) on drop.
pub(super) struct NewChildTable {
    ptr: NonNull<ChildTable>,
}

impl NewChildTable {
    pub(super) fn from_sorted(entries: &[(u32, *mut Node)]) -> Self {
        Self {
            ptr: ChildTable::alloc(entries.iter().copied()),
        }
    }

    /// `old`'s entries plus `(key, child)`.
    pub(super) fn with_inserted(old: Option<&ChildTable>, key: u32, child: *mut Node) -> Self {
        let old: Vec<(u32, *mut Node)> = old.map_or_else(Vec::new, |t| t.raw_iter().collect());
        let i = old.partition_point(|x| x.0 < key);
        let it = old[..i]
            .iter()
            .copied()
            .chain(std::iter::once((key, child)))
            .chain(old[i..].iter().copied());
        Self {
            ptr: ChildTable::alloc(ExactLen(it, old.len() + 1)),
        }
    }

    /// `old` without `key` (`None` when nothing is left), and the removed child's pointer.
    pub(super) fn without(old: &ChildTable, key: u32) -> (Option<Self>, *mut Node) {
        let removed = old
            .raw_iter()
            .find(|x| x.0 == key)
            .map(|x| x.1)
            .expect("the key is listed");
        let n = old.len() - 1;
        let t = (n > 0).then(|| Self {
            ptr: ChildTable::alloc(ExactLen(old.raw_iter().filter(|x| x.0 != key), n)),
        });
        (t, removed)
    }

    pub(super) fn into_raw(self) -> *mut ChildTable {
        let p = self.ptr.as_ptr();
        std::mem::forget(self);
        p
    }
}

impl Drop for NewChildTable {
    fn drop(&mut self) {
        // Safety: never published, so exclusively ours.
        unsafe { ChildTable::destroy(self.ptr.as_ptr()) };
    }
}

/// An iterator with a known exact length.
struct ExactLen<I>(I, usize);

impl<I: Iterator> Iterator for ExactLen<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        let x = self.0.next();
        if x.is_some() {
            self.1 -= 1;
        }
        x
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.1, Some(self.1))
    }
}

impl<I: Iterator> ExactSizeIterator for ExactLen<I> {}
