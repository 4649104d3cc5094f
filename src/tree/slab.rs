//! Node ids: a concurrent slab mapping a node's id to the node, for references that must
//! outlive one epoch guard (LRU entries name nodes by id; a node names its parent by id).
//!
//! The slab is a directory of chunks that only grow (chunk `k` holds `BASE << k` entries and is
//! allocated zeroed on first use, a large one page by page by the OS; it is never moved or freed
//! before the tree), so a lookup is two Acquire loads and no lock. Ids are handed out from
//! per-thread-shard caches (free ids first, then a reserved block of fresh ids), so concurrent
//! writers on different threads share no lock and no counter cache line per node. The same
//! shards keep the tree's node, char and byte counts: an insert adds its nodes when it gives
//! back its unused ids, under one lock ([`Slab::settle`]); a prune subtracts its node.
//!
//! # Protocol
//!
//! - An entry is set to a node once the node is linked into the tree (or, for the nodes of a
//!   split, right before the node they replace is retired), and cleared before a node is
//!   retired, or overwritten: a split's suffix keeps the split node's id (and its child table),
//!   so its entry replaces the split node's before that is retired. So a node loaded from the
//!   slab under a guard is live for that guard, and each id names one node at a time (a scan
//!   by id, as `PrefixTree::stats`, counts a child table once).
//! - An id is released (for reuse) only after its entry is cleared; a stale reference by id
//!   then finds nothing or a different node, which the user (the LRU) validates.

use super::raw::{Node, MAX_NODE_ID};
use crate::reclaim::{Guard, Retirer};
use crate::sync::{AtomicPtr, AtomicU32, Mutex, Ordering};
use crossbeam_utils::CachePadded;

/// Entries of chunk 0.
#[cfg(not(loom))]
const BASE: usize = 256;
#[cfg(loom)]
const BASE: usize = 2;
/// Chunks: enough for every id up to [`MAX_NODE_ID`].
#[cfg(not(loom))]
const CHUNKS: usize = 23;
#[cfg(loom)]
const CHUNKS: usize = 30;
const _: () = assert!(BASE * ((1 << CHUNKS) - 1) > MAX_NODE_ID as usize);

/// Fresh ids a shard reserves at once.
const BLOCK: u32 = 64;

/// One shard's ids: released ids first, then what is left of its reserved block; and the
/// node, char and byte counts its writers added (negative: removed).
#[derive(Default)]
struct IdCache {
    free: Vec<u32>,
    next: u32,
    end: u32,
    counts: Counts,
}

/// Node, char and byte counts of a tree, or changes to them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) nodes: isize,
    pub(crate) chars: isize,
    pub(crate) bytes: isize,
}

impl Counts {
    /// One node of `chars` chars in `bytes` bytes.
    pub(crate) fn node(chars: usize, bytes: usize) -> Self {
        Counts {
            nodes: 1,
            chars: chars as isize,
            bytes: bytes as isize,
        }
    }

    /// The same counts, taken away.
    pub(crate) fn removed(self) -> Self {
        Counts {
            nodes: -self.nodes,
            chars: -self.chars,
            bytes: -self.bytes,
        }
    }

    pub(crate) fn add(&mut self, d: Counts) {
        self.nodes += d.nodes;
        self.chars += d.chars;
        self.bytes += d.bytes;
    }

    fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

/// Where the tree's nodes live and go: their ids (with the node, char and byte counts, kept by
/// the same per-thread shards), and the batched retirement of what writers unlink.
pub(crate) struct Store {
    pub(crate) slab: Slab,
    pub(crate) retirer: Retirer,
}

pub(crate) struct Slab {
    // Invariant: chunk `k` is null or a `Box<[AtomicPtr<Node>]>` of `BASE << k` entries from
    // `Box::into_raw`, published with Release, freed only by `Drop`.
    chunks: [AtomicPtr<AtomicPtr<Node>>; CHUNKS],
    caches: Box<[CachePadded<Mutex<IdCache>>]>,
    /// The first id not yet reserved by any shard.
    fresh: AtomicU32,
}

/// `(chunk, offset)` of `id`.
#[inline]
fn locate(id: u32) -> (usize, usize) {
    let x = id as usize / BASE + 1;
    let k = (usize::BITS - 1 - x.leading_zeros()) as usize;
    (k, id as usize - BASE * ((1 << k) - 1))
}

/// A chunk of `n` null entries. Outside loom, a zeroed allocation: the all-zero `AtomicPtr` is
/// null, and a large chunk (the last one holds a billion entries) then costs address space,
/// whose pages the OS zeroes on first touch, instead of a write of every entry on the insert
/// that first needs the chunk.
fn new_chunk(n: usize) -> Box<[AtomicPtr<Node>]> {
    #[cfg(loom)]
    {
        (0..n)
            .map(|_| AtomicPtr::new(std::ptr::null_mut()))
            .collect()
    }
    #[cfg(not(loom))]
    {
        let layout = std::alloc::Layout::array::<AtomicPtr<Node>>(n).expect("slab chunk layout");
        // Safety: non-zero size (`n >= BASE`).
        let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<AtomicPtr<Node>>();
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // Safety: `p` is a zeroed allocation of `n` `AtomicPtr<Node>`s with the layout a boxed
        // slice of that length uses; `AtomicPtr<T>` has the in-memory representation of
        // `*mut T`, whose all-zero value is null, so every entry is an initialized null.
        unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)) }
    }
}

impl IdCache {
    /// A released id, else the next of the reserved block.
    fn take_local(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop() {
            return Some(id);
        }
        (self.next < self.end).then(|| {
            self.next += 1;
            self.next - 1
        })
    }
}

impl Slab {
    /// An empty slab whose first id is `first` (ids below it are the caller's, e.g. the root).
    pub(crate) fn new(first: u32) -> Self {
        Self {
            chunks: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
            caches: (0..crate::sync::SHARDS)
                .map(|_| CachePadded::new(Mutex::new(IdCache::default())))
                .collect(),
            fresh: AtomicU32::new(first),
        }
    }

    /// The entry of `id`, allocating its chunk if needed.
    fn entry(&self, id: u32) -> &AtomicPtr<Node> {
        let (k, off) = locate(id);
        // Acquire: pairs with the Release that published the chunk.
        let mut c = self.chunks[k].load(Ordering::Acquire);
        if c.is_null() {
            let fresh = Box::into_raw(new_chunk(BASE << k)).cast::<AtomicPtr<Node>>();
            // AcqRel: Release publishes the zeroed chunk; Acquire on failure sees the winner's.
            match self.chunks[k].compare_exchange(
                std::ptr::null_mut(),
                fresh,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => c = fresh,
                Err(winner) => {
                    // Safety: our chunk was never published; free it as the box it was.
                    drop(unsafe {
                        Box::from_raw(std::ptr::slice_from_raw_parts_mut(fresh, BASE << k))
                    });
                    c = winner;
                }
            }
        }
        // Safety: `c` is a published chunk of `BASE << k` entries (invariant) and
        // `off < BASE << k` by construction of `locate`; chunks live as long as the slab.
        unsafe { &*c.wrapping_add(off) }
    }

    /// The node with `id`, if any, valid while `_guard` lives.
    pub(crate) fn get<'g>(&'g self, id: u32, _guard: &'g Guard) -> Option<&'g Node> {
        let (k, off) = locate(id);
        let c = self.chunks.get(k)?.load(Ordering::Acquire);
        if c.is_null() {
            return None;
        }
        // Safety: a published chunk of `BASE << k` entries, `off` in bounds (see `entry`).
        let e = unsafe { &*c.wrapping_add(off) };
        // Acquire: pairs with the Release in `set`, so the node is initialized.
        let n = e.load(Ordering::Acquire);
        // Safety: a non-null entry is a linked node (or one about to replace a linked node),
        // cleared before the node is retired (module docs), so it is not freed while `_guard`,
        // pinned before this load, lives.
        let n = unsafe { n.as_ref() }?;
        n.check();
        Some(n)
    }

    /// One more than the highest id handed out so far: ids at or above it have no entry.
    /// Relaxed: a caller that must see every node of a finished insert synchronizes with it
    /// by other means (a join, a lock); otherwise a bound a moment stale is all it can use.
    pub(crate) fn id_bound(&self) -> u32 {
        self.fresh
            .load(Ordering::Relaxed)
            .min(MAX_NODE_ID.saturating_add(1))
    }

    /// Calls `f` with the node of each id in `ids` that has one, in id order; the nodes are
    /// valid while `_guard` lives. Unallocated chunks are skipped whole.
    pub(crate) fn for_each_in<'g>(
        &'g self,
        ids: std::ops::Range<u32>,
        _guard: &'g Guard,
        mut f: impl FnMut(&'g Node),
    ) {
        let mut id = ids.start;
        while id < ids.end {
            let (k, off) = locate(id);
            let Some(chunk) = self.chunks.get(k) else {
                return;
            };
            // The entries of chunk `k` from `off` on that lie in the range.
            let n = ((BASE << k) - off).min((ids.end - id) as usize);
            // Acquire: pairs with the Release that published the chunk.
            let c = chunk.load(Ordering::Acquire);
            if !c.is_null() {
                for i in off..off + n {
                    // Safety: a published chunk of `BASE << k` entries (invariant), and
                    // `i < off + n <= BASE << k`.
                    let e = unsafe { &*c.wrapping_add(i) };
                    // Acquire: pairs with the Release in `set`, so the node is initialized.
                    let p = e.load(Ordering::Acquire);
                    // Safety: as in `get`: a non-null entry is a node cleared from the slab
                    // before it is retired, so not freed while `_guard`, pinned before this
                    // load, lives.
                    if let Some(node) = unsafe { p.as_ref() } {
                        node.check();
                        f(node);
                    }
                }
            }
            id += n as u32;
        }
    }

    /// Points `id`'s entry at `node` (a linked node, or one replacing a linked node).
    pub(crate) fn set(&self, id: u32, node: *mut Node) {
        // Release: readers that Acquire-load the entry see the node's contents.
        self.entry(id).store(node, Ordering::Release);
    }

    /// Clears `id`'s entry (before its node is retired) and releases the id for reuse.
    pub(crate) fn release(&self, id: u32) {
        self.entry(id)
            .store(std::ptr::null_mut(), Ordering::Release);
        self.unreserve(id);
    }

    /// Two free ids (see [`Self::reserve`]) under one lock, or `None` (nothing reserved) when
    /// fewer than two are left.
    pub(crate) fn reserve_two(&self) -> Option<(u32, u32)> {
        let me = crate::sync::shard_index();
        {
            let mut c = crate::sync::lock(&self.caches[me]);
            // This shard's released ids first, then its block (an insert that used one of the
            // two gives the other back, so one released id is the common case).
            if c.free.len() + (c.end - c.next) as usize >= 2 {
                return Some((c.take_local()?, c.take_local()?));
            }
        }
        let a = self.reserve()?;
        match self.reserve() {
            Some(b) => Some((a, b)),
            None => {
                self.unreserve(a);
                None
            }
        }
    }

    /// Gives back a reserved id whose entry is clear (never set: an insert that did not need
    /// it; or cleared by [`Self::release`]).
    pub(crate) fn unreserve(&self, id: u32) {
        self.settle([Some(id), None], Counts::default());
    }

    /// What a writer does when it is done, under one lock of its shard: gives back the
    /// reserved ids it did not use (as [`Self::unreserve`]) and adds what it changed to the
    /// counts. An insert that added a leaf without a split takes this lock anyway, for the
    /// prefix id it did not use, so its counts cost no locked instruction of their own; one
    /// that used both ids takes it for the counts alone (one lock, not three atomic adds).
    pub(crate) fn settle(&self, unused: [Option<u32>; 2], changed: Counts) {
        if unused == [None, None] && changed.is_zero() {
            return;
        }
        let mut c = crate::sync::lock(&self.caches[crate::sync::shard_index()]);
        c.free.extend(unused.into_iter().flatten());
        c.counts.add(changed);
    }

    /// The tree's counts: the sum over the shards (each may be negative: nodes are added and
    /// removed on any thread). Exact once the writers are done; while they run, the sum lags
    /// each one's changes until it settles.
    pub(crate) fn counts(&self) -> Counts {
        let mut sum = Counts::default();
        for c in self.caches.iter() {
            sum.add(crate::sync::lock(c).counts);
        }
        sum
    }

    /// A free id, or `None` when every id up to [`MAX_NODE_ID`] is in use: this thread's
    /// released ids first, then its reserved block, then ids released on other threads (a
    /// thread that only inserts must reuse what an evicting thread frees), then a fresh block.
    pub(crate) fn reserve(&self) -> Option<u32> {
        let me = crate::sync::shard_index();
        let mut c = crate::sync::lock(&self.caches[me]);
        if let Some(id) = c.take_local() {
            return Some(id);
        }
        // Take up to a block of ids another shard released (never waiting for its lock).
        for k in 1..self.caches.len() {
            let other = (me + k) % self.caches.len();
            if let Some(mut o) = crate::sync::try_lock(&self.caches[other]) {
                if !o.free.is_empty() {
                    let n = o.free.len().min(BLOCK as usize);
                    let at = o.free.len() - n;
                    c.free.extend(o.free.drain(at..));
                    return c.free.pop();
                }
            }
        }
        // Relaxed: a counter handing out disjoint blocks; nothing is published with it.
        let start = self.fresh.fetch_add(BLOCK, Ordering::Relaxed);
        if start > MAX_NODE_ID {
            self.fresh.fetch_sub(BLOCK, Ordering::Relaxed);
            return None;
        }
        c.next = start + 1;
        c.end = start.saturating_add(BLOCK).min(MAX_NODE_ID + 1);
        Some(start)
    }

    /// Heap bytes of the slab (allocated chunks and id caches).
    pub(crate) fn heap_bytes(&self) -> usize {
        let chunks: usize = (0..CHUNKS)
            .filter(|&k| !self.chunks[k].load(Ordering::Relaxed).is_null())
            .map(|k| (BASE << k) * std::mem::size_of::<AtomicPtr<Node>>())
            .sum();
        let caches: usize = self
            .caches
            .iter()
            .map(|c| crate::sync::lock(c).free.capacity() * 4)
            .sum();
        chunks + caches
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        for (k, c) in self.chunks.iter().enumerate() {
            let p = c.load(Ordering::Relaxed);
            if !p.is_null() {
                // Safety: `&mut self`: nobody reads the slab any more; the chunk came from
                // `Box::into_raw` of a slice of this length and is freed once, here.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, BASE << k)) });
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::ptr;

    #[test]
    fn locate_covers_ids_contiguously() {
        assert_eq!(locate(0), (0, 0));
        assert_eq!(locate(BASE as u32 - 1), (0, BASE - 1));
        assert_eq!(locate(BASE as u32), (1, 0));
        assert_eq!(locate(3 * BASE as u32 - 1), (1, 2 * BASE - 1));
        assert_eq!(locate(3 * BASE as u32), (2, 0));
        let (k, off) = locate(MAX_NODE_ID);
        assert!(k < CHUNKS && off < BASE << k);
    }

    /// A scan visits exactly the set entries in its range, in id order, across chunk
    /// boundaries and over chunks never allocated.
    #[test]
    fn a_scan_visits_the_set_entries_of_its_range() {
        use crate::tree::raw::NewNode;
        let s = Slab::new(0);
        let base = BASE as u32;
        // Chunk 0's last entry, chunk 1's first and last, one of chunk 3 (chunk 2 is never
        // allocated).
        let ids = [0, base - 1, base, 3 * base - 1, 7 * base + 5];
        let nodes: Vec<NewNode> = ids.iter().map(|&i| NewNode::leaf(b"x", i, 0, 1)).collect();
        for (&i, n) in ids.iter().zip(&nodes) {
            s.set(i, ptr::from_ref(n.node()).cast_mut());
        }
        let guard = crate::reclaim::pin();
        let scan = |r: std::ops::Range<u32>| {
            let mut seen = Vec::new();
            s.for_each_in(r, &guard, |n| seen.push(n.id()));
            seen
        };
        assert_eq!(scan(0..MAX_NODE_ID), ids);
        assert_eq!(scan(1..base + 1), [base - 1, base]);
        assert!(scan(base + 1..3 * base - 1).is_empty());
        assert_eq!(
            scan(3 * base - 1..7 * base + 6),
            [3 * base - 1, 7 * base + 5]
        );
        assert!(scan(7 * base + 6..MAX_NODE_ID).is_empty());
        drop(guard);
        for &i in &ids {
            s.set(i, ptr::null_mut());
        }
    }

    #[test]
    fn ids_released_on_one_thread_are_reused_on_another() {
        let s = Slab::new(1);
        let ids: Vec<u32> = (0..200).map(|_| s.reserve().unwrap()).collect();
        // Another thread releases them all (an eviction thread, say).
        std::thread::scope(|sc| {
            sc.spawn(|| ids.iter().for_each(|&i| s.release(i)));
        });
        // This thread reuses them before taking fresh ids.
        let fresh_before = s.fresh.load(Ordering::Relaxed);
        for _ in 0..200 {
            s.reserve().unwrap();
        }
        assert_eq!(s.fresh.load(Ordering::Relaxed), fresh_before);
    }

    #[test]
    fn settle_gives_back_unused_ids_and_counts_sum_over_threads() {
        let s = Slab::new(1);
        let (a, b) = s.reserve_two().unwrap();
        s.settle([Some(b), None], Counts::node(5, 7));
        assert_eq!(s.reserve(), Some(b), "the unused id comes back first");
        // Removed on another thread (its own shard, or the same one: the sum is the same).
        std::thread::scope(|t| {
            t.spawn(|| s.settle([None, None], Counts::node(5, 7).removed()));
        });
        assert_eq!(s.counts(), Counts::default());
        s.settle([None, None], Counts::node(3, 4));
        s.settle([Some(a), None], Counts::node(0, 0));
        let two = Counts {
            nodes: 2,
            chars: 3,
            bytes: 4,
        };
        assert_eq!(s.counts(), two);
        assert_eq!(s.reserve(), Some(a));
    }

    #[test]
    fn reserve_two_hands_out_two_ids_or_none() {
        let s = Slab::new(1);
        let (a, b) = s.reserve_two().unwrap();
        assert_ne!(a, b);
        s.unreserve(a);
        s.unreserve(b);
        let (c, d) = s.reserve_two().unwrap();
        assert_eq!([c.min(d), c.max(d)], [a.min(b), a.max(b)]);
        // One id left: nothing is reserved, and the last id stays available.
        let s = Slab::new(MAX_NODE_ID);
        assert_eq!(s.reserve_two(), None);
        assert_eq!(s.reserve(), Some(MAX_NODE_ID));
        assert_eq!(s.reserve(), None);
    }

    #[test]
    fn reserve_two_takes_one_released_id_and_one_from_the_block() {
        // What an insert leaves behind: it reserved two ids and gave one back.
        let s = Slab::new(1);
        let (a, b) = s.reserve_two().unwrap();
        s.unreserve(b);
        let fresh_before = s.fresh.load(Ordering::Relaxed);
        let (c, d) = s.reserve_two().unwrap();
        assert_eq!(c, b, "the released id first");
        assert!(d != a && d != b, "then the reserved block");
        assert_eq!(
            s.fresh.load(Ordering::Relaxed),
            fresh_before,
            "no new block"
        );
        // A block with one id left and one released id: both, still under one lock.
        let s = Slab::new(MAX_NODE_ID - 2);
        let (a, b) = s.reserve_two().unwrap();
        assert_eq!((a, b), (MAX_NODE_ID - 2, MAX_NODE_ID - 1));
        s.unreserve(a);
        assert_eq!(s.reserve_two(), Some((a, MAX_NODE_ID)));
        assert_eq!(s.reserve(), None);
    }

    #[test]
    fn reserve_reuses_released_ids() {
        let s = Slab::new(1);
        let a = s.reserve().unwrap();
        let b = s.reserve().unwrap();
        assert_eq!((a, b), (1, 2));
        s.release(a);
        assert_eq!(s.reserve(), Some(a));
    }

    /// A thread whose own shard has no id left takes one that any other shard released,
    /// whichever shard that is, before it reserves a fresh block.
    #[test]
    fn reserve_finds_ids_released_on_every_other_shard() {
        let me = crate::sync::shard_index();
        for other in (0..crate::sync::SHARDS).filter(|&o| o != me) {
            let s = Slab::new(1);
            let released = [10, 11, 12];
            crate::sync::lock(&s.caches[other]).free.extend(released);
            let fresh_before = s.fresh.load(Ordering::Relaxed);
            let id = s.reserve().unwrap();
            assert!(released.contains(&id), "shard {other}: got {id}");
            assert_eq!(
                s.fresh.load(Ordering::Relaxed),
                fresh_before,
                "shard {other}"
            );
        }
    }

    /// The heap figure is the allocated chunks (each of `BASE << k` entries) plus the id
    /// caches' capacity.
    #[test]
    fn heap_bytes_counts_allocated_chunks_and_id_caches() {
        let entry = std::mem::size_of::<AtomicPtr<Node>>();
        let s = Slab::new(1);
        assert_eq!(s.heap_bytes(), 0);
        // Chunk 0, then chunk 2 (chunk 1 is never allocated).
        s.set(5, ptr::null_mut());
        assert_eq!(s.heap_bytes(), BASE * entry);
        s.set(3 * BASE as u32, ptr::null_mut());
        assert_eq!(s.heap_bytes(), 5 * BASE * entry);
        let cap = {
            let mut c = crate::sync::lock(&s.caches[crate::sync::shard_index()]);
            c.free.reserve_exact(10);
            c.free.capacity()
        };
        assert!(cap >= 10);
        assert_eq!(s.heap_bytes(), 5 * BASE * entry + 4 * cap);
    }
}
