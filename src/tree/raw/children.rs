//! Child tables: a node's children by the first char of their edges.

use super::node::Node;
use crate::reclaim::Retire;
use crate::sync::{AtomicPtr, AtomicU32, Ordering};
#[cfg(not(loom))]
use std::alloc::dealloc;
use std::alloc::{alloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// Tables with at most this many slots may hold their keys in any order (found by a linear
/// scan) and take new children in place; larger tables are sorted (binary search) and
/// replaced by a copy on every change.
pub(crate) const SMALL: usize = 64;

/// A node's children by edge key (first char of the edge): header, `cap` key slots, then `cap`
/// child-pointer slots (keys packed densely so a lookup scans one cache line), of which the
/// first `len` are in use.
///
/// Invariant: all `cap` child slots are initialized atomics, null from `len` on; entries
/// `0..len` are initialized, each child pointer a live, published node
/// whose edge starts with the char of its key; keys are distinct, and ascending when `cap >
/// SMALL`. `len` only grows, by [`ChildTable::push`] under the lock of the node the table
/// belongs to, which writes the entry before it publishes the new `len` (Release); an entry
/// never changes afterwards, except a slot swapped in place by a split (under the same lock),
/// for a node with the same first char. A child is retired only after it is unlinked from the
/// current table. A `&ChildTable` exists only while an epoch guard pinned before the table was
/// loaded lives (see [`Node::child_table`]) or while the tree is exclusively owned, so the
/// children it names are allocated for as long as the reference: that makes
/// [`ChildTable::iter`] and [`ChildTable::get`] safe.
#[repr(C)]
pub(crate) struct ChildTable {
    /// Entries in use. An atomic also makes the header `!Freeze`: the slots after it are
    /// written through pointers derived from `&ChildTable` (Tree Borrows would otherwise freeze
    /// them).
    len: AtomicU32,
    /// Slots allocated; immutable.
    cap: u32,
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

impl ChildTable {
    fn layout(cap: usize) -> (Layout, usize, usize) {
        let (l, keys) = Layout::new::<ChildTable>()
            .extend(Layout::array::<u32>(cap).expect("child table layout"))
            .expect("child table layout");
        let (l, ptrs) = l
            .extend(Layout::array::<AtomicPtr<Node>>(cap).expect("child table layout"))
            .expect("child table layout");
        debug_assert_eq!((keys, ptrs), (Self::KEYS_OFF, Self::ptrs_off(cap)));
        (l.pad_to_align(), keys, ptrs)
    }

    /// Offset of the keys (what [`Self::layout`] computes, without its overflow checks: the
    /// accessors run on every lookup).
    const KEYS_OFF: usize = size_of::<ChildTable>().next_multiple_of(align_of::<u32>());

    /// Offset of the child pointers of a table of `cap` slots (see [`Self::KEYS_OFF`]).
    #[inline]
    fn ptrs_off(cap: usize) -> usize {
        (Self::KEYS_OFF + cap * size_of::<u32>()).next_multiple_of(align_of::<AtomicPtr<Node>>())
    }

    /// The slots to allocate for a table that is growing to `n` entries: room to grow by half
    /// for a small table, exactly `n` for a large one (sorted, never grown in place).
    fn grown_cap(n: usize) -> usize {
        if n > SMALL {
            n
        } else {
            (n + (n / 2).max(1)).min(SMALL)
        }
    }

    /// Allocates a table of `cap` slots from `(key, child)` pairs (at least one, at most
    /// `cap`, distinct keys; ascending if `cap > SMALL`).
    fn alloc(
        entries: impl ExactSizeIterator<Item = (u32, *mut Node)>,
        cap: usize,
    ) -> NonNull<ChildTable> {
        let n = entries.len();
        debug_assert!(n > 0 && n <= cap);
        let (layout, koff, poff) = Self::layout(cap);
        // Safety: non-zero size.
        let p = unsafe { alloc(layout) }.cast::<ChildTable>();
        let Some(p) = NonNull::new(p) else {
            handle_alloc_error(layout)
        };
        let header = ChildTable {
            len: AtomicU32::new(n as u32),
            cap: cap as u32,
            #[cfg(loom)]
            poison: Default::default(),
        };
        // Safety: fresh allocation of `layout`, aligned for the header.
        unsafe { p.as_ptr().write(header) };
        // `cap` keys at `koff` and `cap` pointers at `poff` fit the allocation, each aligned as
        // `Layout::extend` computed.
        let k = p.as_ptr().cast::<u8>().wrapping_add(koff).cast::<u32>();
        let c = p
            .as_ptr()
            .cast::<u8>()
            .wrapping_add(poff)
            .cast::<AtomicPtr<Node>>();
        let mut prev = None;
        for (i, (key, child)) in entries.enumerate() {
            debug_assert!(
                cap <= SMALL || prev.is_none_or(|p| p < key),
                "keys ascending"
            );
            prev = Some(key);
            // Safety: key `i < n <= cap` of the fresh allocation (see above), not shared yet.
            unsafe { k.wrapping_add(i).write(key) };
            // Safety: slot `i < n <= cap` of the fresh allocation, not shared yet.
            unsafe { c.wrapping_add(i).write(AtomicPtr::new(child)) };
        }
        for i in n..cap {
            // Free slots hold null until `push` stores a child (an atomic store, so that loom
            // checks the `len` publication through it).
            // Safety: slot `i < cap` of the fresh allocation, not shared yet.
            unsafe {
                c.wrapping_add(i)
                    .write(AtomicPtr::new(std::ptr::null_mut()))
            };
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
            let cap = unsafe { (*p).cap } as usize;
            let (layout, _, poff) = Self::layout(cap);
            let c = p.cast::<u8>().wrapping_add(poff).cast::<AtomicPtr<Node>>();
            for i in 0..cap {
                // Safety: slot `i < cap` is an initialized atomic of the table, dropped once.
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
        // Acquire: pairs with the Release in `push`, so the entries below `len` are written.
        self.len.load(Ordering::Acquire) as usize
    }

    /// The start of the key array and of the child-slot array (`cap` each).
    #[inline]
    fn arrays(&self) -> (*mut u32, *mut AtomicPtr<Node>) {
        let base = (self as *const ChildTable).cast::<u8>().cast_mut();
        let keys = base.wrapping_add(Self::KEYS_OFF).cast::<u32>();
        let ptrs = base
            .wrapping_add(Self::ptrs_off(self.cap as usize))
            .cast::<AtomicPtr<Node>>();
        (keys, ptrs)
    }

    /// The keys and child slots in use, from one read of `len`.
    #[inline]
    fn entries(&self) -> (&[u32], &[AtomicPtr<Node>]) {
        let n = self.len();
        let (keys, ptrs) = self.arrays();
        // Safety: the first `n` keys after the header (at `KEYS_OFF`) are initialized and never
        // written again (type invariant; the Acquire load of `len` orders their writes before
        // us).
        let keys = unsafe { std::slice::from_raw_parts(keys, n) };
        // Safety: likewise the first `n` child slots (at `ptrs_off(cap)`), which change only
        // atomically.
        let ptrs = unsafe { std::slice::from_raw_parts(ptrs, n) };
        (keys, ptrs)
    }

    /// The keys in use (in slot order; ascending for a large table).
    #[inline]
    pub(crate) fn keys(&self) -> &[u32] {
        self.entries().0
    }

    /// Slots allocated (the most entries it can take in place).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn capacity(&self) -> usize {
        self.cap as usize
    }

    /// Sorted? (Large tables always are.)
    pub(crate) fn is_large(&self) -> bool {
        self.cap as usize > SMALL
    }

    /// `(key, child)` pairs, in slot order (ascending keys only for a large table).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Node)> + '_ {
        self.raw_iter().map(|(k, c)| (k, self.child(c)))
    }

    /// `(key, child)` pairs as raw pointers, with the allocations' provenance (Acquire loads,
    /// pairing with the Release that published the table or swapped the slot).
    pub(super) fn raw_iter(&self) -> impl Iterator<Item = (u32, *mut Node)> + '_ {
        let (keys, slots) = self.entries();
        keys.iter()
            .zip(slots)
            .map(|(&k, c)| (k, c.load(Ordering::Acquire)))
    }

    /// Index of the entry with `key` among `keys` (a table's keys in use).
    #[inline]
    fn position(keys: &[u32], key: u32, large: bool) -> Option<usize> {
        if large {
            keys.binary_search(&key).ok()
        } else {
            Self::scan(keys, key)
        }
    }

    /// Linear search of a small table's keys: eight at a time, with one vector compare and
    /// mask per group where the target has them, then the last few one by one. Keys are
    /// distinct, so the first match is the only one. A plain scan's exit branch is
    /// mispredicted at every wide node; W1 lookup paths cross two of about 26 children, and
    /// hot lookups ran 11–16 % faster for this in `insert_cost` (2–6 % in `report`; see
    /// `doc/performance-log.md`).
    #[inline]
    fn scan(keys: &[u32], key: u32) -> Option<usize> {
        let (groups, rest) = keys.as_chunks::<GROUP>();
        for (i, g) in groups.iter().enumerate() {
            let hits = group_hits(g, key);
            if hits != 0 {
                return Some(i * GROUP + hits.trailing_zeros() as usize);
            }
        }
        let j = rest.iter().position(|&x| x == key)?;
        Some(groups.len() * GROUP + j)
    }

    /// Index of the entry with `key`.
    #[inline]
    pub(crate) fn find(&self, key: u32) -> Option<usize> {
        Self::position(self.keys(), key, self.is_large())
    }

    /// The child with `key`.
    #[inline]
    pub(crate) fn get(&self, key: u32) -> Option<&Node> {
        let (keys, slots) = self.entries();
        let i = Self::position(keys, key, self.is_large())?;
        // Acquire: pairs with the Release that published the table or swapped the slot.
        Some(self.child(slots[i].load(Ordering::Acquire)))
    }

    /// The child a slot of this table holds (loaded with Acquire), as a reference.
    #[inline]
    fn child(&self, c: *mut Node) -> &Node {
        // Under loom, an entry read without its publication shows up here as a null slot.
        #[cfg(loom)]
        assert!(!c.is_null(), "child slot read before `len` published it");
        // Safety: see the type's invariant: the child is live as long as `self` is borrowed.
        let c = unsafe { &*c };
        c.check();
        c
    }

    /// Adds `(key, child)` in place if the table has a free slot and is small; false (nothing
    /// changed) otherwise.
    ///
    /// # Safety
    ///
    /// The caller holds the lock of the node this table belongs to (the only writer of its
    /// entries), the table has no entry for `key`, and `child` is a fully built node whose
    /// edge starts with the char keyed `key`.
    pub(super) unsafe fn push(&self, key: u32, child: *mut Node) -> bool {
        // Relaxed: only the lock holder changes `len`, and the lock's Acquire ordered the
        // previous holder's store before us.
        let n = self.len.load(Ordering::Relaxed) as usize;
        let cap = self.cap as usize;
        if n == cap || cap > SMALL {
            return false;
        }
        let (k, c) = self.arrays();
        // Safety: key slot `n < cap` of the allocation is not in use: no reader reads it
        // before the Release store of `len` below, and no other writer runs (caller's lock).
        unsafe { k.wrapping_add(n).write(key) };
        // Safety: child slot `n < cap` is an initialized (null) atomic of the live table.
        let slot = unsafe { &*c.wrapping_add(n) };
        // Relaxed: published by the Release store of `len` below.
        slot.store(child, Ordering::Relaxed);
        // Release: a reader that Acquire-loads the new `len` sees the entry (and the child's
        // contents, written before the caller handed it over).
        self.len.store(n as u32 + 1, Ordering::Release);
        true
    }

    /// Replaces the child keyed `key` in place (a split), returning the old child with its
    /// allocation's provenance; `None` if there is no such child.
    ///
    /// # Safety
    ///
    /// The caller holds the lock of the node this table belongs to, and `new` is a live node
    /// whose edge starts with the char keyed `key`; the caller retires the returned node.
    pub(super) unsafe fn swap_child(&self, key: u32, new: *mut Node) -> Option<*mut Node> {
        let (keys, slots) = self.entries();
        let i = Self::position(keys, key, self.is_large())?;
        // Only the lock holder writes a slot: a load and a store, not a locked swap.
        let old = slots[i].load(Ordering::Relaxed);
        // Release: publishes `new` to readers that Acquire-load the slot.
        slots[i].store(new, Ordering::Release);
        Some(old)
    }

    /// Heap bytes of this table (all its slots).
    pub(crate) fn bytes(&self) -> usize {
        Self::layout(self.cap as usize).0.size()
    }
}

/// Keys compared at once by [`ChildTable::scan`].
const GROUP: usize = 8;

/// Bit `j` set iff `g[j] == key`: two SSE2 compares and masks (SSE2 is in the x86-64
/// baseline).
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline]
fn group_hits(g: &[u32; GROUP], key: u32) -> u32 {
    #[target_feature(enable = "sse2")]
    #[inline]
    fn sse2(g: &[u32; GROUP], key: u32) -> u32 {
        use std::arch::x86_64::{
            _mm_castsi128_ps, _mm_cmpeq_epi32, _mm_movemask_ps, _mm_set1_epi32, _mm_set_epi32,
        };
        // Bit casts: the compare is of bit patterns.
        let k = _mm_set1_epi32(key as i32);
        let lo = _mm_set_epi32(g[3] as i32, g[2] as i32, g[1] as i32, g[0] as i32);
        let hi = _mm_set_epi32(g[7] as i32, g[6] as i32, g[5] as i32, g[4] as i32);
        let lo = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(lo, k)));
        let hi = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(hi, k)));
        (lo | (hi << 4)) as u32
    }
    // Safety: the build enables SSE2 (the `cfg` above), so the CPU running this code has it.
    unsafe { sse2(g, key) }
}

/// Bit `j` set iff `g[j] == key` (elsewhere; tested on every target).
#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
#[inline]
fn group_hits(g: &[u32; GROUP], key: u32) -> u32 {
    group_hits_portable(g, key)
}

/// Bit `j` set iff `g[j] == key`, without vector intrinsics.
#[cfg_attr(
    all(target_arch = "x86_64", target_feature = "sse2", any(not(test), loom)),
    allow(dead_code)
)]
#[inline]
fn group_hits_portable(g: &[u32; GROUP], key: u32) -> u32 {
    g.iter()
        .enumerate()
        .fold(0, |m, (j, &x)| m | (u32::from(x == key) << j))
}

impl Retire for ChildTable {
    fn heap_bytes(&self) -> usize {
        self.bytes()
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
    /// A table of exactly `entries` (distinct keys, ascending if there are more than
    /// [`SMALL`]).
    pub(super) fn from_sorted(entries: &[(u32, *mut Node)]) -> Self {
        Self {
            ptr: ChildTable::alloc(entries.iter().copied(), entries.len()),
        }
    }

    /// A table of `entries` (at most [`SMALL`], any order) with room to grow, as
    /// [`Self::with_inserted`] leaves it: for a split's prefix node, whose children (the
    /// suffix and usually a new leaf) are the start of a branch point that tends to gain more.
    pub(super) fn with_room(entries: &[(u32, *mut Node)]) -> Self {
        debug_assert!(entries.len() <= SMALL);
        Self {
            ptr: ChildTable::alloc(
                entries.iter().copied(),
                ChildTable::grown_cap(entries.len()),
            ),
        }
    }

    /// `old`'s entries plus `(key, child)`, with room to grow if the table is small.
    pub(super) fn with_inserted(old: Option<&ChildTable>, key: u32, child: *mut Node) -> Self {
        let n = old.map_or(0, ChildTable::len) + 1;
        let cap = ChildTable::grown_cap(n);
        let ptr = match old {
            None => ChildTable::alloc(std::iter::once((key, child)), cap),
            Some(t) if cap > SMALL => {
                // Large tables are sorted (a small one becoming large is sorted here, once).
                let mut v: Vec<(u32, *mut Node)> = Vec::with_capacity(n);
                v.extend(t.raw_iter());
                v.push((key, child));
                v.sort_unstable_by_key(|e| e.0);
                ChildTable::alloc(v.into_iter(), cap)
            }
            // Small: the new entry goes last (no order to keep).
            Some(t) => ChildTable::alloc(
                ExactLen(t.raw_iter().chain(std::iter::once((key, child))), n),
                cap,
            ),
        };
        Self { ptr }
    }

    /// `old` without `key` (`None` when nothing is left), and the removed child's pointer.
    pub(super) fn without(old: &ChildTable, key: u32) -> (Option<Self>, *mut Node) {
        let removed = old
            .raw_iter()
            .find(|x| x.0 == key)
            .map(|x| x.1)
            .expect("the key is listed");
        let n = old.len() - 1;
        // Exactly `n` slots; order kept (a table that stays large stays sorted).
        let t = (n > 0).then(|| Self {
            ptr: ChildTable::alloc(ExactLen(old.raw_iter().filter(|x| x.0 != key), n), n),
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::NewNode;
    use super::*;

    /// Keys as edge keys look (ASCII shifted to the top byte, multi-byte UTF-8 sequences with
    /// the top bit set), distinct.
    fn keys(n: usize) -> Vec<u32> {
        (0..n as u32)
            .map(|i| match i % 3 {
                0 => (b'a' as u32 + i) << 24,
                1 => 0xF09F_9880 + i,
                _ => 0xC3A0_0000 + (i << 8),
            })
            .collect()
    }

    /// Leaves for tables to point at (a table never frees its children; these free themselves
    /// on drop, after the tables that name them).
    fn leaves(n: usize) -> Vec<NewNode> {
        (0..n)
            .map(|i| NewNode::leaf(b"x", i as u32 + 1, 0, 1))
            .collect()
    }

    /// A leaf as a table entry's child pointer.
    fn raw(n: &NewNode) -> *mut Node {
        std::ptr::from_ref(n.node()).cast_mut()
    }

    /// An unpublished table, read as a published one.
    fn table(t: &NewChildTable) -> &ChildTable {
        // Safety: live until `t` drops, exclusively ours and only read here.
        unsafe { t.ptr.as_ref() }
    }

    /// `(key, child)` pairs of a table, in slot order.
    fn pairs(t: &ChildTable) -> Vec<(u32, *mut Node)> {
        t.raw_iter().collect()
    }

    /// Bytes of a table: the header (8), `cap` keys (4 each) padded to 8, `cap` child pointers
    /// (8 each), whatever the entries in use; the same through `Retire`.
    #[cfg(target_pointer_width = "64")]
    #[test]
    fn bytes_count_the_header_and_every_slot() {
        let ls = leaves(SMALL + 1);
        let e: Vec<(u32, *mut Node)> = (0..=SMALL as u32)
            .map(|i| ((b'!' as u32 + i) << 24, raw(&ls[i as usize])))
            .collect();
        for (t, cap, bytes) in [
            (NewChildTable::from_sorted(&e[..1]), 1, 24),
            (NewChildTable::from_sorted(&e[..2]), 2, 32),
            (NewChildTable::from_sorted(&e[..3]), 3, 48),
            (NewChildTable::with_room(&e[..2]), 3, 48),
            (NewChildTable::from_sorted(&e), SMALL + 1, 792),
        ] {
            let c = table(&t);
            assert_eq!((c.capacity(), c.bytes()), (cap, bytes));
            assert_eq!(Retire::heap_bytes(c), bytes);
        }
    }

    /// `find` gives the slot of each key, in a small table in any order and in a large one,
    /// and nothing for an absent key.
    #[test]
    fn find_gives_each_keys_slot() {
        let ls = leaves(SMALL + 1);
        // Descending: slot order is the reverse of key order in the small table.
        let desc: Vec<(u32, *mut Node)> = (0..3u32)
            .rev()
            .map(|i| ((b'a' as u32 + i) << 24, raw(&ls[i as usize])))
            .collect();
        let asc: Vec<(u32, *mut Node)> = (0..=SMALL as u32)
            .map(|i| ((b'!' as u32 + i) << 24, raw(&ls[i as usize])))
            .collect();
        let small = NewChildTable::from_sorted(&desc);
        let large = NewChildTable::from_sorted(&asc);
        for (t, e) in [(table(&small), &desc), (table(&large), &asc)] {
            for (i, &(k, _)) in e.iter().enumerate() {
                assert_eq!(t.find(k), Some(i), "{k:#x}");
            }
            assert_eq!(t.find(u32::MAX), None);
        }
    }

    /// A small table takes each new entry last (no order to keep), up to `SMALL` slots
    /// included; past `SMALL` the copy is sorted (and exact), so binary search finds every
    /// child.
    #[test]
    fn inserts_go_last_in_a_small_table_and_in_key_order_in_a_large_one() {
        let ls = leaves(SMALL + 1);
        // Descending keys: each new key belongs first in key order.
        let e: Vec<(u32, *mut Node)> = (0..=SMALL as u32)
            .map(|i| ((b'!' as u32 + SMALL as u32 - i) << 24, raw(&ls[i as usize])))
            .collect();
        let mut t = NewChildTable::with_inserted(None, e[0].0, e[0].1);
        for n in 2..=SMALL + 1 {
            t = NewChildTable::with_inserted(Some(table(&t)), e[n - 1].0, e[n - 1].1);
            let c = table(&t);
            let (want, large) = if n <= SMALL {
                (e[..n].to_vec(), false)
            } else {
                (e[..n].iter().rev().copied().collect(), true)
            };
            assert_eq!(pairs(c), want, "{n} entries");
            assert_eq!((c.len(), c.is_large()), (n, large), "{n} entries");
            for &(k, child) in &e[..n] {
                assert_eq!(c.get(k).map(std::ptr::from_ref), Some(child.cast_const()));
            }
        }
        assert_eq!(table(&t).capacity(), SMALL + 1);
    }

    #[test]
    fn scan_finds_each_key_and_only_keys_present() {
        for n in 0..=SMALL {
            let ks = keys(n);
            for (i, &k) in ks.iter().enumerate() {
                assert_eq!(ChildTable::scan(&ks, k), Some(i), "key {i} of {n}");
            }
            for absent in [0, 1, u32::MAX, 0x6000_0000, 0xF09F_9880 + 1000] {
                if !ks.contains(&absent) {
                    assert_eq!(ChildTable::scan(&ks, absent), None, "{absent:#x} in {n}");
                }
            }
        }
    }

    #[test]
    fn group_hits_agree_with_the_portable_compare() {
        let ks = keys(GROUP * 2);
        for start in 0..GROUP {
            let g: &[u32; GROUP] = ks[start..start + GROUP].try_into().unwrap();
            for &k in &ks {
                let want = group_hits_portable(g, k);
                assert_eq!(group_hits(g, k), want, "key {k:#x}");
                assert_eq!(want.count_ones(), u32::from(g.contains(&k)));
            }
        }
    }
}
