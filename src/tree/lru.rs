//! Per-tenant LRU eviction, detaching and pruning, and tenant removal.
//!
//! Each tenant keeps a lazy min-heap of its *leaves* (nodes it owns with no child it owns),
//! keyed by last-access time, behind the tenant's own lock. Timestamps never decrease along a
//! root-to-leaf path, so the oldest timestamp group is always found at such leaves. Evicting `k`
//! nodes costs `O(k · (log h + σ))` amortized, where `h` is the heap size and `σ` the fan-out of
//! the parents visited (at most the alphabet size); a call that evicts nothing costs `O(1)`.
//!
//! Heap entries name nodes by id (see `slab.rs`) and are hints: an entry is checked against the
//! node's current owners when it is popped (the node may be gone, its id reused, its time
//! raised, or it may have gained a child of the tenant). Detaching a tenant from a node locks
//! the node's parent and then the node, and re-checks everything under the locks; lock order is
//! the tenant's LRU lock, then parent, then child. Inserts push their new leaves after they
//! released every node lock, so the two orders never meet; an insert that finds the LRU lock
//! taken (an eviction holds it through a batch) parks its entry behind a second lock, taken
//! after the first or alone, and never waits for the eviction (see [`Lru`]).

use super::raw::{NewOwners, Node, Without};
use super::slab::Counts;
use super::{PrefixTree, TenantState};
use crate::reclaim::{self, Guard};
use crate::sync::{self, AtomicBool, Mutex, MutexGuard, Ordering};
use crate::tenant::TenantId;
use crate::text;
use std::collections::BinaryHeap;
use std::ptr;

/// Per-tenant LRU candidates: a lazy min-heap of `(last access, node id)` over the tenant's
/// leaves. Entries may be stale; they are checked when popped. Every leaf of the tenant has an
/// entry whose key is at most its current time (once the insert that made it a leaf returned),
/// in the heap or parked ([`Lru`]).
#[derive(Default)]
pub(crate) struct LruHeap {
    heap: BinaryHeap<LruEntry>,
}

impl LruHeap {
    /// Adds an entry: node `id` is a leaf of the tenant at time `ts`.
    pub(super) fn push(&mut self, ts: u64, id: u32) {
        self.push_entry(LruEntry::new(ts, id));
    }

    /// An empty heap with room for `n` entries (a restore, which knows how many).
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            heap: BinaryHeap::with_capacity(n),
        }
    }

    /// Adds an entry, growing the storage by a quarter when it is full (see [`Self::reserve`]).
    fn push_entry(&mut self, e: LruEntry) {
        self.reserve(1);
        self.heap.push(e);
    }

    /// Room for `n` more entries, growing by a quarter (at least 16) rather than doubling: the
    /// heaps hold an entry per leaf of each tenant, a tenth of a W1 tree's own heap, and
    /// doubling leaves about 28 % of that unused on average (growing by a quarter, about
    /// 10 %), for at most four times the (amortized O(1)) copying.
    ///
    /// The storage is copied into a new allocation, not `realloc`ated: glibc reallocates a block
    /// inside the arena that holds it, under that arena's lock, so a thread growing a heap that
    /// another thread's arena holds (threads inserting for the same tenant take turns at it)
    /// would hold the other thread's allocator through the copy. Two threads building W1 trees
    /// on disjoint system prompts for the same tenants inserted 1.69–1.78 M/s this way against
    /// 1.53–1.61 M/s with `reserve_exact` (the performance log's twentieth session).
    fn reserve(&mut self, n: usize) {
        let (len, cap) = (self.heap.len(), self.heap.capacity());
        if len + n > cap {
            let old = std::mem::take(&mut self.heap).into_vec();
            let mut grown = Vec::with_capacity(len + (len / 4).max(16).max(n));
            grown.extend_from_slice(&old);
            drop(old);
            // A valid heap already: the rebuild compares each parent with its children once
            // and moves nothing (amortized O(1) per push, like the copy).
            self.heap = BinaryHeap::from(grown);
        }
    }

    /// Heap bytes of the heap's storage.
    pub(super) fn heap_bytes(&self) -> usize {
        self.heap.capacity() * std::mem::size_of::<LruEntry>()
    }
}

/// A tenant's LRU: the heap behind the tenant's LRU lock, which an eviction holds through a
/// batch of timestamp groups, and the entries of inserts that found that lock taken, behind a
/// lock held only for a push or a take. An insert never waits for an eviction: it parks its
/// entry, and whoever holds the heap moves parked entries in before it looks at the heap and
/// when it lets go of it (an eviction: before it picks each group, not within one, so that a
/// group is bounded by what the heap held when it began even while inserts at the group's time
/// keep coming).
pub(crate) struct Lru {
    heap: Mutex<LruHeap>,
    parked: Mutex<Vec<LruEntry>>,
    /// Set (after the push) when `parked` may hold entries; cleared by the taker before it
    /// takes them, so an entry parked meanwhile keeps it set.
    has_parked: AtomicBool,
}

impl Lru {
    pub(crate) fn new() -> Self {
        Self {
            heap: Mutex::new(LruHeap::default()),
            parked: Mutex::new(Vec::new()),
            has_parked: AtomicBool::new(false),
        }
    }

    /// Locks the heap, with every entry parked so far moved in.
    pub(super) fn lock(&self) -> LruLock<'_> {
        let mut l = LruLock {
            lru: self,
            locked: sync::lock(&self.heap),
        };
        l.unpark();
        l
    }

    /// Records that node `id` became a leaf at `ts`: in the heap if its lock is free, else
    /// parked (never waiting for an eviction). Returns the locked heap in the first case.
    fn push(&self, ts: u64, id: u32) -> Option<LruLock<'_>> {
        let e = LruEntry::new(ts, id);
        match sync::try_lock(&self.heap) {
            Some(locked) => {
                let mut l = LruLock { lru: self, locked };
                l.unpark();
                l.push_entry(e);
                Some(l)
            }
            None => {
                sync::lock(&self.parked).push(e);
                // Release: pairs with the AcqRel swap in `unpark` (the entry itself is handed
                // over by the `parked` lock).
                self.has_parked.store(true, Ordering::Release);
                None
            }
        }
    }

    /// Replaces the heap (and drops what is parked): a tenant's removal or a slot's new tenant.
    pub(super) fn reset(&self, heap: LruHeap) {
        let mut l = sync::lock(&self.heap);
        self.has_parked.store(false, Ordering::Relaxed);
        sync::lock(&self.parked).clear();
        *l = heap;
    }

    /// Heap bytes of the heap's and the parked entries' storage.
    pub(super) fn heap_bytes(&self) -> usize {
        let parked = sync::lock(&self.parked).capacity() * std::mem::size_of::<LruEntry>();
        sync::lock(&self.heap).heap_bytes() + parked
    }
}

/// A tenant's locked LRU heap (see [`Lru`]).
pub(super) struct LruLock<'a> {
    lru: &'a Lru,
    locked: MutexGuard<'a, LruHeap>,
}

impl LruLock<'_> {
    /// Moves the parked entries into the heap.
    #[inline]
    fn unpark(&mut self) {
        // Relaxed: a hint; the swap below decides.
        if self.lru.has_parked.load(Ordering::Relaxed) {
            self.take_parked();
        }
    }

    #[cold]
    fn take_parked(&mut self) {
        if !self.lru.has_parked.swap(false, Ordering::AcqRel) {
            return;
        }
        let parked = std::mem::take(&mut *sync::lock(&self.lru.parked));
        self.locked.reserve(parked.len());
        self.locked.heap.extend(parked);
    }
}

impl Drop for LruLock<'_> {
    /// Moves in what was parked while the heap was held (still under its lock: the guard is
    /// dropped after this), so that the holder, an eviction say, pays for it, not the next
    /// insert. An entry whose flag is raised just after this look waits for the next holder
    /// (a push that finds the heap free, a lock, an eviction's next group).
    fn drop(&mut self) {
        self.unpark();
    }
}

impl std::ops::Deref for LruLock<'_> {
    type Target = LruHeap;
    fn deref(&self) -> &LruHeap {
        &self.locked
    }
}

impl std::ops::DerefMut for LruLock<'_> {
    fn deref_mut(&mut self) -> &mut LruHeap {
        &mut self.locked
    }
}

/// `(last access, node id)` packed in 12 bytes, ordered so the max-heap pops the oldest first.
#[derive(Clone, Copy, PartialEq, Eq)]
struct LruEntry {
    ts_hi: u32,
    ts_lo: u32,
    id: u32,
}

impl LruEntry {
    fn new(ts: u64, id: u32) -> Self {
        Self {
            ts_hi: (ts >> 32) as u32,
            ts_lo: ts as u32,
            id,
        }
    }

    fn ts(self) -> u64 {
        (self.ts_hi as u64) << 32 | self.ts_lo as u64
    }
}

impl Ord for LruEntry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.ts_hi, o.ts_lo, o.id).cmp(&(self.ts_hi, self.ts_lo, self.id))
    }
}

impl PartialOrd for LruEntry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// How a tenant's LRU heap entry relates to the tree now.
enum Entry {
    /// A current leaf of the tenant with exactly the entry's time.
    Leaf,
    /// A current leaf whose time rose to the given value.
    Newer(u64),
    /// Gone, no longer owned by the tenant, or no longer a leaf of it.
    Stale,
}

/// What [`PrefixTree::detach`] did.
enum Detached<'g> {
    /// The tenant was removed from the node (`chars` debited); `parent` is the node's parent.
    Removed { chars: usize, parent: &'g Node },
    /// Kept: the tenant's time is not the one asked for any more (it is now the given time),
    /// or the tenant owns a child of the node.
    Kept(Option<u64>),
    /// The node is gone, or the tenant no longer owns it.
    Gone,
}

/// Nodes a tenant's removal detaches (see `PrefixTree::sweep`), or LRU entries the eviction of
/// one timestamp group takes, between two re-pins: about a millisecond of work. One under loom
/// and miri, so their models and tests re-pin after every node.
#[cfg(not(any(loom, miri)))]
const SWEEP_CHUNK: usize = 1024;
#[cfg(any(loom, miri))]
const SWEEP_CHUNK: usize = 1;

/// Timestamp groups `evict_tenant_by_lru` evicts under one pin. One under loom and miri, so
/// their models and tests cross batch boundaries.
#[cfg(not(any(loom, miri)))]
const EVICT_CHUNK_GROUPS: usize = 64;
#[cfg(any(loom, miri))]
const EVICT_CHUNK_GROUPS: usize = 1;

impl PrefixTree {
    /// Records that node `id` became a leaf of `slot` at `ts`.
    /// Called unpinned (a compaction pins for itself). Never waits for an eviction holding the
    /// heap: the entry is parked instead (see [`Lru`]).
    pub(super) fn push_lru(&self, state: &TenantState, slot: usize, ts: u64, id: u32) {
        let Some(mut lru) = state.lru.push(ts, id) else {
            return;
        };
        if lru.heap.len() > 2 * state.nodes.load(Ordering::Relaxed) + 64 {
            self.compact_lru(&mut lru, slot, &reclaim::pin());
        }
    }

    /// Rebuilds a heap from its valid entries (amortized against the pushes since the last
    /// rebuild).
    fn compact_lru(&self, lru: &mut LruHeap, slot: usize, guard: &Guard) {
        let old = std::mem::take(&mut lru.heap).into_vec();
        let mut keep: Vec<LruEntry> = Vec::with_capacity(old.len() / 2);
        let mut seen = std::collections::HashSet::new();
        for LruEntry { id, .. } in old {
            let Some(node) = self.store.slab.get(id, guard) else {
                continue;
            };
            let Some(cell) = node.owners(guard).ts_of(slot) else {
                continue;
            };
            if node.slot_owns_a_child(slot, guard) || !seen.insert(id) {
                continue;
            }
            keep.push(LruEntry::new(cell.load(Ordering::Relaxed), id));
        }
        lru.heap = BinaryHeap::from(keep);
    }

    /// Removes tenant `t` from every node, pruning nodes left without owners; returns the chars
    /// removed (0 for an unknown or already removed tenant). Its id becomes invalid; its slot is
    /// reused, with a new generation, only after a grace period.
    pub fn remove_tenant(&self, t: TenantId) -> usize {
        self.remove_tenants(&[t])[0]
    }

    /// [`remove_tenant`](Self::remove_tenant) of each tenant of `ts`, in one batch: returns
    /// the chars removed for each, in the order given (0 for an unknown or already removed
    /// tenant, and for a tenant listed again). With an eviction of the tenant running at the
    /// same time, what that eviction takes is reported by it, not here (a per-tenant
    /// eviction in its return value; a global-budget pass counts distinct chars only). The
    /// root's owner table is rebuilt once for all of them, so removing `k` of `n` tenants
    /// costs `O(n + k)` there, not `O(n k)`; each tenant's own nodes are swept as by
    /// `remove_tenant`.
    ///
    /// ```
    /// let tree = kvtrie::PrefixTree::new();
    /// let a = tree.add_tenant("a");
    /// let b = tree.add_tenant("b");
    /// let c = tree.add_tenant("c");
    /// tree.insert_at("hello", a, 1).unwrap();
    /// tree.insert_at("hello world", b, 2).unwrap();
    /// assert_eq!(tree.remove_tenants(&[b, a, b]), vec![11, 5, 0]);
    /// assert_eq!(tree.tenants(), vec![c]);
    /// assert_eq!(tree.stats().nodes, 0);
    /// ```
    pub fn remove_tenants(&self, ts: &[TenantId]) -> Vec<usize> {
        let mut removed = vec![0; ts.len()];
        // One removal at a time; the registry only while the tenants are marked dead and
        // unnamed, not through their sweeps (so a lookup of a live tenant's name, which a
        // router makes per request, waits for no sweep).
        let _one = sync::lock(&self.removals);
        // (position in `ts`, slot) of each tenant this call removes.
        let mut dying: Vec<(usize, usize)> = Vec::new();
        let released = {
            let mut r = sync::lock(&self.registry);
            let guard = reclaim::pin();
            let table = self.slots.load(&guard);
            for (i, &t) in ts.iter().enumerate() {
                // A tenant listed again is no longer live once its generation changed.
                if !table.is_live(t) {
                    continue;
                }
                // One side of the removal handshake (see `SlotTable::is_live_after_publish`):
                // the generation changes (SeqCst) before the sweep reads any owner table.
                table.set_gen(t.slot(), t.generation().wrapping_add(1));
                dying.push((i, t.slot()));
            }
            if dying.is_empty() {
                return removed;
            }
            sync::fence(Ordering::SeqCst);
            for &(_, slot) in &dying {
                if let Some(name) = r.slot_names.get_mut(slot).and_then(Option::take) {
                    r.names.remove(&name);
                }
            }
            let mut slots: Vec<usize> = dying.iter().map(|&(_, slot)| slot).collect();
            slots.sort_unstable();
            let root = self.root().lock().expect("the root is never obsolete");
            let owners = NewOwners::without_all(root.node().owners(&guard), &slots);
            root.set_owners(owners, &self.store, &guard);
            r.released.clone()
        };
        // Each sweep pins by itself and re-pins between chunks (see `sweep`). No slot of
        // `dying` is reused meanwhile: a slot is released only by the closure deferred below.
        // Each tenant's report is what its sweep removed: everything it owned when it died
        // but what an eviction running then took (reported by that eviction), and perhaps
        // bits an insert that raced the removal gave it before undoing them itself (that
        // undo takes only what lies from the insert's first credited node on, along its
        // text). No char is reported twice; for the chars no report holds, see
        // `detach_path` and the global-budget note above.
        for &(i, slot) in &dying {
            removed[i] = self.sweep(slot);
        }
        // The LRU locks before the pin: an eviction of a tenant may hold its lock through a
        // batch of groups (a pinned waiter would hold the epoch back meanwhile).
        for &(_, slot) in &dying {
            let state = self.slots.state_of(slot).expect("a live slot has a state");
            state.lru.reset(LruHeap::default());
        }
        let guard = reclaim::pin();
        let mut free: Vec<u32> = Vec::with_capacity(dying.len());
        for &(i, slot) in &dying {
            self.state(slot, &guard).root_ts.store(0, Ordering::Relaxed);
            // The slot is reused with the next odd generation; one whose generations are used
            // up is never reused (a wrapped generation could make a stale id live again).
            if ts[i].generation() < u32::MAX - 2 {
                free.push(slot as u32);
            }
        }
        if !free.is_empty() {
            reclaim::defer(&guard, move || sync::lock(&released).extend(free));
        }
        // Removals are rare and retire many objects at once: hand them (and the deferred slot
        // releases) to the global queue now, so they are freed after the grace period instead
        // of when this thread's batches and bag fill.
        self.store.retirer.flush(&guard);
        removed
    }

    /// Removes `slot` from every node until none is left; returns the chars it removed. For a
    /// removed tenant: no insert adds new bits for it (an insert that raced the removal
    /// removes its own), so each pass finds less, and a pass that finds nothing ends it.
    ///
    /// A tenant can own most of a large tree, and a pinned thread holds back the reclamation of
    /// everything every thread retires meanwhile. So a pass lists the nodes by id and, after
    /// every [`SWEEP_CHUNK`] nodes, hands its retired batches over and re-pins: what the removal
    /// frees, and what other writers retire during it, is freed while it runs.
    fn sweep(&self, slot: usize) -> usize {
        /// Appends the ids of `n`'s children that `slot` owns to both lists.
        fn owned_children(n: &Node, slot: usize, lists: [&mut Vec<u32>; 2], g: &Guard) {
            let [order, stack] = lists;
            for c in n.children(g) {
                if c.owners(g).contains(slot) {
                    order.push(c.id());
                    stack.push(c.id());
                }
            }
        }
        #[cfg(all(test, not(loom)))]
        tests::SWEEP_HOOK.with(|h| {
            if let Some(f) = &*h.borrow() {
                f(self)
            }
        });
        let mut spins = 0;
        let mut removed = 0;
        let mut guard = reclaim::pin();
        loop {
            // Pre-order list of the nodes `slot` owns (prefix closure: a subtree at the root),
            // by id; detached in reverse, children before parents. The listing re-pins too; an
            // id that names nothing after a re-pin (split or pruned meanwhile) is skipped here
            // and its replacements are listed by the next pass.
            let mut order: Vec<u32> = Vec::new();
            let mut stack: Vec<u32> = Vec::new();
            owned_children(self.root(), slot, [&mut order, &mut stack], &guard);
            let mut listed = 0;
            while let Some(id) = stack.pop() {
                listed += 1;
                if listed % SWEEP_CHUNK == 0 {
                    reclaim::repin(&mut guard);
                }
                if let Some(n) = self.store.slab.get(id, &guard) {
                    owned_children(n, slot, [&mut order, &mut stack], &guard);
                }
            }
            if order.is_empty() {
                return removed;
            }
            for (i, id) in order.into_iter().rev().enumerate() {
                if i > 0 && i % SWEEP_CHUNK == 0 {
                    self.store.retirer.flush_bulk(&guard);
                    reclaim::repin(&mut guard);
                }
                // After a re-pin an id may name nothing (the node was split or pruned meanwhile:
                // its replacements are found by the next pass) or a newer node. Any node `slot`
                // owns is detached; one met before a child it owns keeps its bit (`detach`
                // re-checks under the locks) until the next pass.
                if let Some(n) = self.store.slab.get(id, &guard) {
                    if n.owners(&guard).contains(slot) {
                        if let Detached::Removed { chars, .. } = self.detach(n, slot, None, &guard)
                        {
                            removed += chars;
                        }
                    }
                }
            }
            self.store.retirer.flush_bulk(&guard);
            reclaim::repin(&mut guard);
            // What is left was changed meanwhile (split, or a racing insert's bit that it is
            // undoing): let those writers finish.
            sync::spin_wait(&mut spins);
        }
    }

    /// Removes `slot` from the nodes along `bytes`' path that begin at byte `from` or later
    /// and lie on `bytes` (the undo of an insert that raced the removal of its tenant: the
    /// nodes it gave the tenant), deepest first. The nodes above `from` the tenant owned
    /// before; the removal's sweep takes those, and counts them.
    ///
    /// The nodes are found by their place in the text, not by identity: if the insert's own
    /// nodes were evicted before its undo and another insert of the tenant put new ones in
    /// the same place, the undo takes those (their chars are then in no report; a removal
    /// still reports at least what the tenant owned before the racing insert).
    pub(super) fn detach_path(&self, bytes: &[u8], from: usize, slot: usize, guard: &Guard) {
        let mut spins = 0;
        loop {
            let mut path: Vec<&Node> = Vec::new();
            let (mut node, mut off) = (self.root(), 0);
            while off < bytes.len() {
                let rest = &bytes[off..];
                let Some(c) = node.child(text::edge_key(rest), guard) else {
                    break;
                };
                // The insert's nodes lie on its text, below nodes the tenant owns.
                if !c.owners(guard).contains(slot) || !text::starts_with(rest, c.text()) {
                    break;
                }
                if off >= from {
                    path.push(c);
                }
                off += c.len();
                node = c;
            }
            if path.is_empty() {
                return;
            }
            for n in path.into_iter().rev() {
                if let Detached::Kept(None) = self.detach(n, slot, None, guard) {
                    self.store.retirer.flush_if_due(guard);
                    // The tenant owns a child off this path, or one this path's node was split
                    // into meanwhile (a split keeps the owners on both halves, and the obsolete
                    // node detached as `Gone`). Either way the removal's sweep removes the rest:
                    // it took the slot off the root first, and a pass ends only when it finds no
                    // node the slot owns, so it cannot have finished while such a child exists.
                    return;
                }
            }
            sync::spin_wait(&mut spins);
        }
    }

    /// Removes `slot` from `node`, with `only_at`: only if its time there is exactly that.
    /// Locks the parent, then the node, and re-checks under the locks that the node is linked,
    /// owned by `slot`, and has no child `slot` owns; prunes the node if no owner is left.
    fn detach<'g>(
        &'g self,
        node: &'g Node,
        slot: usize,
        only_at: Option<u64>,
        guard: &'g Guard,
    ) -> Detached<'g> {
        let key = text::edge_key(node.text());
        let mut spins = 0;
        loop {
            if node.is_obsolete() {
                return Detached::Gone;
            }
            if spins > 0 {
                // The parent was replaced or the node unlinked while we looked: let the writer
                // doing it finish.
                sync::spin_wait(&mut spins);
            }
            spins = spins.saturating_add(1);
            // The parent by id: if it was split meanwhile, its id names its replacement.
            let Some(parent) = self.store.slab.get(node.parent_id(), guard) else {
                return Detached::Gone;
            };
            let Some(p_lock) = parent.lock() else {
                continue; // the parent was replaced; its id now names the replacement
            };
            if !parent.child(key, guard).is_some_and(|c| ptr::eq(c, node)) {
                // Unlinked (or replaced by a split) before we locked the parent.
                drop(p_lock);
                if node.is_obsolete() {
                    return Detached::Gone;
                }
                continue;
            }
            let n_lock = node.lock().expect("a child of a locked node is linked");
            let o = node.owners(guard);
            if !o.contains(slot) {
                return Detached::Gone;
            }
            if node.slot_owns_a_child(slot, guard) {
                return Detached::Kept(None);
            }
            let chars = node.chars();
            let state = self.state(slot, guard);
            match NewOwners::without(o, slot, only_at) {
                Without::Kept(copy, ts) => {
                    n_lock.set_owners(copy, &self.store, guard);
                    return Detached::Kept(Some(ts));
                }
                Without::Removed(owners) => n_lock.set_owners(owners, &self.store, guard),
                Without::Empty => {
                    // No owner left: by prefix closure no child has one either, so the node
                    // has no children (they were pruned with their last owners).
                    p_lock.remove_child(n_lock, &self.store, guard);
                    let gone = Counts::node(chars, node.len()).removed();
                    self.store.slab.settle([None, None], gone);
                }
            }
            state.refund(chars);
            return Detached::Removed { chars, parent };
        }
    }

    /// Evicts tenant `t`'s least recently used text until at least `min_chars` chars were
    /// removed or `t` owns nothing: repeatedly takes the oldest last-access time among `t`'s
    /// nodes and removes `t` from every node it owns with that time (a whole timestamp group,
    /// leaves before parents), pruning nodes left without owners. Returns the chars removed,
    /// which may exceed `min_chars` (as in Ray); 0 if `min_chars == 0` or `t` is unknown.
    ///
    /// Concurrent inserts for `t` go on meanwhile: the eviction works in batches of timestamp
    /// groups, and it stops once it has removed as many chars as `t` owned when it began, so
    /// `evict_tenant_by_lru(t, usize::MAX)` ends even while they keep coming. A leaf that a
    /// concurrent insert for `t` is still adding joins `t`'s LRU only when that insert finishes:
    /// an eviction that finds the LRU empty before then returns, and leaves that insert's path
    /// in place (model-checked: `g_evict_everything_vs_insert_across_batches` in
    /// `tests/loom.rs`).
    pub fn evict_tenant_by_lru(&self, t: TenantId, min_chars: usize) -> usize {
        // In batches of a bounded number of groups, each under a pin of its own, so that a large
        // eviction does not hold back reclamation (see `crate::reclaim`) while it runs. At most
        // what `t` owned when the call began: between batches the tenant's LRU lock is free, so
        // an eviction of "everything" ends even while inserts for `t` keep coming.
        let Some(owned) = self.char_count(t) else {
            return 0;
        };
        in_batches(min_chars.min(owned), |need| {
            self.evict_batch(t, need, EVICT_CHUNK_GROUPS)
        })
    }

    /// Evicts at most `max_groups` of `t`'s oldest timestamp groups, stopping once `min_chars`
    /// were removed; returns the chars removed and whether `t` still owns something. Bounded
    /// work per call, for the background thread.
    pub(super) fn evict_batch(
        &self,
        t: TenantId,
        min_chars: usize,
        max_groups: usize,
    ) -> (usize, bool) {
        // The LRU lock before the pin: another eviction of `t` may hold it through a batch, and
        // a pinned waiter would hold back reclamation meanwhile. The state is the tree's, not a
        // guard's: the group eviction re-pins holding its lock.
        let Some(state) = self.slots.state_of(t.slot()) else {
            return (0, false);
        };
        let mut lru = state.lru.lock();
        let mut guard = reclaim::pin();
        // A removed `t`: the first group eviction finds it gone and returns `None`.
        let (mut removed, mut more) = (0, true);
        for _ in 0..max_groups {
            if removed >= min_chars {
                break;
            }
            match self.evict_oldest_group(&mut lru, t, &mut guard) {
                Some(n) => removed += n,
                None => {
                    more = false;
                    break;
                }
            }
        }
        drop(lru);
        self.store.retirer.flush_bulk(&guard);
        (removed, more && state.nodes.load(Ordering::Relaxed) > 0)
    }

    /// Global LRU: evicts at most `max_groups` of the oldest timestamp groups across all
    /// tenants, stopping once the tree's distinct chars dropped by `min_chars`; returns the
    /// distinct chars removed and whether anything is left to evict.
    pub(super) fn evict_global_batch(&self, min_chars: usize, max_groups: usize) -> (usize, bool) {
        let before = self.distinct_chars();
        let tenants: Vec<TenantId> = {
            let guard = reclaim::pin();
            let table = self.slots.load(&guard);
            (self.root().owners(&guard).slots())
                .map(|s| table.id_of_seen(s))
                .collect()
        };
        // Every LRU lock is taken unpinned, then pinned under (as in `evict_batch`): an
        // eviction of the tenant by another thread may hold it through a batch.
        for _ in 0..max_groups {
            if before.saturating_sub(self.distinct_chars()) >= min_chars {
                break;
            }
            let mut best: Option<(u64, TenantId)> = None;
            for &t in &tenants {
                let Some(state) = self.slots.state_of(t.slot()) else {
                    continue;
                };
                let mut lru = state.lru.lock();
                let guard = reclaim::pin();
                // A tenant removed since the batch began: its slot may serve another by now.
                if !self.slots.load(&guard).is_live(t) {
                    continue;
                }
                if let Some(ts) = self.oldest(&mut lru, t.slot(), &guard) {
                    if best.is_none_or(|b| ts < b.0) {
                        best = Some((ts, t));
                    }
                }
            }
            let Some((_, t)) = best else {
                return (before.saturating_sub(self.distinct_chars()), false);
            };
            if let Some(state) = self.slots.state_of(t.slot()) {
                let mut lru = state.lru.lock();
                let mut guard = reclaim::pin();
                self.evict_oldest_group(&mut lru, t, &mut guard);
                drop(lru);
                self.store.retirer.flush_bulk(&guard);
            }
        }
        (
            before.saturating_sub(self.distinct_chars()),
            self.node_count() > 0,
        )
    }

    /// The oldest last-access time among `slot`'s nodes, found at its leaves.
    fn oldest(&self, lru: &mut LruLock<'_>, slot: usize, guard: &Guard) -> Option<u64> {
        lru.unpark();
        loop {
            let e = *lru.heap.peek()?;
            match self.check_entry(slot, e.ts(), e.id, guard) {
                Entry::Leaf => return Some(e.ts()),
                Entry::Newer(cur) => {
                    lru.heap.pop();
                    lru.heap.push(LruEntry::new(cur, e.id));
                }
                Entry::Stale => {
                    lru.heap.pop();
                }
            }
        }
    }

    /// Classifies a heap entry of `slot` (lock-free; re-checked under locks when acted on).
    fn check_entry(&self, slot: usize, key: u64, id: u32, guard: &Guard) -> Entry {
        let Some(node) = self.store.slab.get(id, guard) else {
            return Entry::Stale;
        };
        let Some(cell) = node.owners(guard).ts_of(slot) else {
            return Entry::Stale;
        };
        let cur = cell.load(Ordering::Relaxed);
        // `cur < key`: the id was reused by a node with its own (smaller) entry.
        if cur < key || node.slot_owns_a_child(slot, guard) {
            Entry::Stale
        } else if cur > key {
            Entry::Newer(cur)
        } else {
            Entry::Leaf
        }
    }

    /// Removes tenant `t` from its whole oldest timestamp group; returns the chars removed, or
    /// `None` if it owns nothing (or was removed).
    ///
    /// A group can be any size (a bulk load at one time). Every [`SWEEP_CHUNK`] entries the
    /// eviction hands its retired batches over and re-pins, as the removal sweep does, so the
    /// group does not hold back reclamation while it goes. Entries that inserts of `t` park
    /// meanwhile wait for the next group: taken in here, inserts at time `m` could extend the
    /// group for as long as they come. Entries name nodes by id; no reference survives an
    /// iteration.
    fn evict_oldest_group(
        &self,
        lru: &mut LruLock<'_>,
        t: TenantId,
        guard: &mut Guard,
    ) -> Option<usize> {
        let slot = t.slot();
        // Under the heap's lock a removal of `t` cannot finish (it resets the heap under that
        // lock), so the slot stays `t`'s throughout if `t` is live now.
        if !self.slots.load(guard).is_live(t) {
            return None;
        }
        let m = self.oldest(lru, slot, guard)?;
        let mut removed = 0;
        let mut taken = 0;
        loop {
            if taken > 0 && taken % SWEEP_CHUNK == 0 {
                self.store.retirer.flush_bulk(guard);
                reclaim::repin(guard);
            }
            let Some(&e) = lru.heap.peek() else {
                break;
            };
            if e.ts() != m {
                break;
            }
            taken += 1;
            let guard = &*guard;
            lru.heap.pop();
            match self.check_entry(slot, m, e.id, guard) {
                Entry::Stale => continue,
                Entry::Newer(cur) => {
                    lru.heap.push(LruEntry::new(cur, e.id));
                    continue;
                }
                Entry::Leaf => {}
            }
            let Some(node) = self.store.slab.get(e.id, guard) else {
                continue;
            };
            let parent = match self.detach(node, slot, Some(m), guard) {
                Detached::Removed { chars, parent } => {
                    removed += chars;
                    parent
                }
                // Raised concurrently: no longer in this group; re-queued with its new time.
                Detached::Kept(Some(ts)) => {
                    lru.heap.push(LruEntry::new(ts, e.id));
                    continue;
                }
                Detached::Gone
                    if node.is_obsolete()
                        && self
                            .store
                            .slab
                            .get(e.id, guard)
                            .is_some_and(|n| !ptr::eq(n, node)) =>
                {
                    // Split meanwhile: the suffix took the id (and the times); try it.
                    lru.heap.push(e);
                    continue;
                }
                Detached::Kept(None) | Detached::Gone => continue,
            };
            if !ptr::eq(parent, self.root()) && !parent.slot_owns_a_child(slot, guard) {
                if let Some(cell) = parent.owners(guard).ts_of(slot) {
                    // The parent became a leaf of `slot`; if its time is `m` it joins this group
                    // (popped next, as `m` is minimal).
                    lru.heap
                        .push(LruEntry::new(cell.load(Ordering::Relaxed), parent.id()));
                }
            }
        }
        Some(removed)
    }
}

/// Runs `batch(need)` (which returns what it removed and whether anything is left) until
/// `need` is met or nothing is left; returns what all batches removed. The loop of every
/// batched eviction: each batch pins, locks and flushes on its own.
pub(super) fn in_batches(mut need: usize, mut batch: impl FnMut(usize) -> (usize, bool)) -> usize {
    let mut removed = 0;
    while need > 0 {
        let (n, more) = batch(need);
        removed += n;
        need = need.saturating_sub(n);
        if !more {
            break;
        }
    }
    removed
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::NodeSnapshot;

    /// A test's look at the tree from inside a removal.
    type Hook = Box<dyn Fn(&PrefixTree)>;

    thread_local! {
        /// Called by `sweep` on this thread, before it pins.
        pub(super) static SWEEP_HOOK: std::cell::RefCell<Option<Hook>> =
            const { std::cell::RefCell::new(None) };
    }

    /// A removal sweeps without the registry: meanwhile a live tenant's name is looked up,
    /// and tenants are added, without waiting (a router looks up the replica's name per
    /// request); the tenants being removed are unnamed already.
    #[test]
    fn a_removal_sweeps_without_the_registry() {
        let tree = PrefixTree::new();
        let (a, b, c) = (
            tree.add_tenant("a"),
            tree.add_tenant("b"),
            tree.add_tenant("c"),
        );
        tree.insert_at("hello world", a, 1).unwrap();
        tree.insert_at("hello there", b, 2).unwrap();
        tree.insert_at("help", c, 3).unwrap();
        let sweeps = std::rc::Rc::new(std::cell::Cell::new(0));
        let seen = sweeps.clone();
        SWEEP_HOOK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |t: &PrefixTree| {
                seen.set(seen.get() + 1);
                assert!(
                    sync::try_lock(&t.registry).is_some(),
                    "the registry is held through a sweep"
                );
                assert_eq!(t.tenant_name(b).as_deref(), Some("b"));
                assert_eq!((t.tenant_id("a"), t.tenant_id("c")), (None, None));
                let d = t.add_tenant("d");
                t.insert_at("hello", d, 4).unwrap();
            }))
        });
        let removed = tree.remove_tenants(&[a, c]);
        SWEEP_HOOK.with(|h| h.borrow_mut().take());
        assert_eq!(sweeps.get(), 2);
        assert_eq!(removed, vec![11, 4]);
        let d = tree.tenant_id("d").unwrap();
        assert_eq!(tree.tenants(), vec![b, d]);
        assert_eq!(
            (tree.char_count(b), tree.char_count(d)),
            (Some(11), Some(5))
        );
        tree.check_invariants().unwrap();
    }

    /// The entries of `t`'s LRU heap as `(time, id)`, ascending (moving in what was parked).
    fn entries(tree: &PrefixTree, t: TenantId) -> Vec<(u64, u32)> {
        let state = tree.slots.state_of(t.slot()).expect("a live tenant");
        let lru = state.lru.lock();
        let mut v: Vec<(u64, u32)> = lru.heap.iter().map(|e| (e.ts(), e.id)).collect();
        v.sort_unstable();
        v
    }

    /// The id of the node reached from the root by the edges starting `path`'s texts.
    fn id_at(tree: &PrefixTree, path: &[&str]) -> u32 {
        let guard = reclaim::pin();
        let mut n = tree.root();
        for p in path {
            n = n
                .child(text::edge_key(p.as_bytes()), &guard)
                .expect("on the path");
        }
        n.id()
    }

    fn node(
        text: &str,
        tenants: Vec<(TenantId, u64)>,
        children: Vec<NodeSnapshot>,
    ) -> NodeSnapshot {
        NodeSnapshot {
            text: text.into(),
            tenants,
            children,
        }
    }

    /// A compaction keeps one entry per current leaf of the tenant, at its current time, and
    /// drops duplicates, entries of nodes that gained a child of the tenant, of nodes it does
    /// not own, and of ids that name nothing.
    #[test]
    fn compaction_keeps_each_current_leaf_once_at_its_time() {
        let tree = PrefixTree::new();
        let (a, b) = (tree.add_tenant("a"), tree.add_tenant("b"));
        tree.insert_at("ab", a, 1).unwrap();
        tree.insert_at("ac", a, 2).unwrap();
        tree.insert_at("x", a, 3).unwrap();
        tree.insert_at("y", b, 4).unwrap();
        let (ab, ac, x) = (
            id_at(&tree, &["a", "b"]),
            id_at(&tree, &["a", "c"]),
            id_at(&tree, &["x"]),
        );
        let (inner, other) = (id_at(&tree, &["a"]), id_at(&tree, &["y"]));
        assert_eq!(entries(&tree, a), vec![(1, ab), (2, ac), (3, x)]);
        // "x" raised to 5: its entry (3) is older than the node.
        tree.insert_at("x", a, 5).unwrap();
        let nothing = tree.store.slab.id_bound() + 100;
        let state = tree.slots.state_of(a.slot()).unwrap();
        let mut lru = state.lru.lock();
        lru.push(1, ab);
        lru.push(0, inner);
        lru.push(7, other);
        lru.push(9, nothing);
        assert_eq!(lru.heap.len(), 7);
        tree.compact_lru(&mut lru, a.slot(), &reclaim::pin());
        drop(lru);
        assert_eq!(entries(&tree, a), vec![(1, ab), (2, ac), (5, x)]);
    }

    /// An insert's push compacts the heap exactly when it then holds more than twice the
    /// tenant's nodes plus 64 entries.
    #[test]
    fn a_push_compacts_once_the_heap_exceeds_twice_the_nodes_plus_64() {
        let tree = PrefixTree::new();
        let a = tree.add_tenant("a");
        for (i, s) in ["a", "b", "c"].into_iter().enumerate() {
            tree.insert_at(s, a, i as u64 + 1).unwrap();
        }
        let leaves = entries(&tree, a);
        assert_eq!(leaves.len(), 3);
        let state = tree.slots.state_of(a.slot()).unwrap();
        assert_eq!(state.nodes.load(Ordering::Relaxed), 3);
        let nothing = tree.store.slab.id_bound() + 100;
        let mut lens = Vec::new();
        for k in 1..=140u64 {
            tree.push_lru(state, a.slot(), 100 + k, nothing);
            lens.push(state.lru.lock().heap.len());
        }
        // 2 × 3 + 64 = 70: the push that makes 71 entries compacts to the three leaves.
        let expected: Vec<usize> = (1..=140).map(|k| 3 + k % 68).collect();
        assert_eq!(lens, expected);
        assert_eq!(
            entries(&tree, a),
            leaves
                .iter()
                .copied()
                .chain((137..=140).map(|k| (100 + k, nothing)))
                .collect::<Vec<_>>()
        );
    }

    /// The heap grows by a quarter of its length, at least 16 entries, and its bytes are its
    /// capacity's.
    #[test]
    fn the_heap_grows_by_a_quarter_at_least_16() {
        let mut h = LruHeap::default();
        assert_eq!(h.heap_bytes(), 0);
        let mut caps = Vec::new();
        for i in 0..130u32 {
            h.push(u64::from(i), i);
            let bytes = h.heap_bytes();
            assert_eq!(bytes % 12, 0);
            if caps.last() != Some(&(bytes / 12)) {
                caps.push(bytes / 12);
            }
        }
        assert_eq!(caps, vec![16, 32, 48, 64, 80, 100, 125, 156]);
        assert_eq!(h.heap.len(), 130);
        // The heap pops the oldest first.
        assert_eq!(h.heap.peek().map(|e| (e.ts(), e.id)), Some((0, 0)));
    }

    /// Growing keeps every entry and the heap order (oldest first, then by id): the storage is
    /// copied into a new allocation and the heap rebuilt from it, which must move nothing
    /// (300 entries in a scrambled order cross ten growths; the capacities are checked above).
    #[test]
    fn growth_keeps_the_heap_order() {
        let mut h = LruHeap::default();
        let ts = |i: u32| u64::from(i * 7919 % 1000);
        for i in 0..300 {
            h.push(ts(i), i);
        }
        let mut popped = Vec::new();
        while let Some(e) = h.heap.pop() {
            popped.push((e.ts(), e.id));
        }
        let mut want: Vec<(u64, u32)> = (0..300).map(|i| (ts(i), i)).collect();
        want.sort_unstable();
        assert_eq!(popped, want);
    }

    /// An entry pushed while the heap is held is parked, and the holder moves it in when it
    /// lets go; one parked after the holder's last look is moved in by the next push that
    /// finds the heap free, before its own entry.
    #[test]
    fn entries_pushed_while_the_heap_is_held_are_parked_then_moved_in() {
        let lru = Lru::new();
        let held = lru.lock();
        assert!(lru.push(5, 42).is_none());
        assert!(lru.has_parked.load(Ordering::Relaxed));
        assert_eq!(sync::lock(&lru.parked).len(), 1);
        assert!(held.heap.is_empty());
        drop(held);
        assert!(!lru.has_parked.load(Ordering::Relaxed));
        assert!(sync::lock(&lru.parked).is_empty());
        // Parked after the holder's last look (as by an insert racing its drop).
        sync::lock(&lru.parked).push(LruEntry::new(3, 7));
        lru.has_parked.store(true, Ordering::Release);
        let l = lru.push(4, 8).expect("the heap is free");
        let mut got: Vec<(u64, u32)> = l.heap.iter().map(|e| (e.ts(), e.id)).collect();
        got.sort_unstable();
        assert_eq!(got, vec![(3, 7), (4, 8), (5, 42)]);
        assert!(sync::lock(&lru.parked).is_empty());
    }

    /// A reset replaces the heap and drops what was parked.
    #[test]
    fn a_reset_replaces_the_heap_and_drops_the_parked_entries() {
        let lru = Lru::new();
        drop(lru.push(1, 1));
        drop(lru.push(2, 2));
        sync::lock(&lru.parked).push(LruEntry::new(3, 3));
        lru.has_parked.store(true, Ordering::Release);
        let mut fresh = LruHeap::default();
        fresh.push(9, 9);
        lru.reset(fresh);
        assert!(!lru.has_parked.load(Ordering::Relaxed));
        assert!(sync::lock(&lru.parked).is_empty());
        let l = lru.lock();
        assert_eq!(
            l.heap.iter().map(|e| (e.ts(), e.id)).collect::<Vec<_>>(),
            vec![(9, 9)]
        );
    }

    /// The undo of an insert that raced its tenant's removal: `detach_path` removes the tenant
    /// from the nodes along the text's path, deepest first, pruning nodes left without owners,
    /// and stops at a node where the tenant owns a child off the path.
    #[test]
    fn detach_path_removes_the_tenant_along_the_path_deepest_first() {
        let tree = PrefixTree::new();
        let (a, b) = (tree.add_tenant("a"), tree.add_tenant("b"));
        tree.insert_at("hello world", a, 1).unwrap();
        tree.insert_at("hello", b, 2).unwrap();
        tree.insert_at("help", a, 3).unwrap();
        tree.detach_path(b"hello world", 0, a.slot(), &reclaim::pin());
        assert_eq!(
            tree.snapshot().children,
            vec![node(
                "hel",
                vec![(a, 3), (b, 2)],
                vec![
                    node("lo", vec![(b, 2)], vec![]),
                    node("p", vec![(a, 3)], vec![])
                ]
            )]
        );
        assert_eq!(tree.char_count(a), Some(4));
        tree.check_invariants().unwrap();
        // A path the tenant owns to its end: all of it goes, the pruned leaf first.
        tree.detach_path(b"help", 0, a.slot(), &reclaim::pin());
        assert_eq!(
            tree.snapshot().children,
            vec![node(
                "hel",
                vec![(b, 2)],
                vec![node("lo", vec![(b, 2)], vec![])]
            )]
        );
        assert_eq!((tree.char_count(a), tree.node_count()), (Some(0), 2));
        tree.check_invariants().unwrap();
    }

    /// The undo takes only the nodes from `from` on, and only nodes on its own text: what the
    /// tenant owned above `from`, and a node off the text (another insert's), stay for the
    /// removal's sweep.
    #[test]
    fn detach_path_takes_only_the_inserts_part_of_the_path() {
        let tree = PrefixTree::new();
        let a = tree.add_tenant("a");
        tree.insert_at("hello", a, 1).unwrap();
        tree.insert_at("hello world", a, 2).unwrap();
        tree.detach_path(b"hello world", 5, a.slot(), &reclaim::pin());
        assert_eq!(
            tree.snapshot().children,
            vec![node("hello", vec![(a, 2)], vec![])]
        );
        assert_eq!(tree.char_count(a), Some(5));
        tree.insert_at("hello there", a, 3).unwrap();
        // " there" begins at 5 but is not on "hello thing": not this undo's.
        tree.detach_path(b"hello thing", 5, a.slot(), &reclaim::pin());
        assert_eq!(tree.char_count(a), Some(11));
        tree.check_invariants().unwrap();
    }

    /// From the race review: an insert (I1, "abcd" at 5 for t, which owned "abqq") publishes
    /// its leaf "cd" and stalls before its liveness check; an eviction takes "cd"; another
    /// insert (I3) adds "cx" at the same place; t is removed; I1's undo runs before the sweep.
    /// The undo leaves "cx" (off its text), so the removal reports all 6 chars t owned.
    #[test]
    fn an_undo_leaves_a_node_off_its_text_to_the_removal() {
        let tree = PrefixTree::new();
        let t = tree.add_tenant("t");
        tree.insert_at("abqq", t, 9).unwrap();
        tree.insert_at("abcd", t, 5).unwrap(); // I1's publish
        assert_eq!(tree.evict_tenant_by_lru(t, 2), 2); // "cd"
        tree.insert_at("abcx", t, 7).unwrap(); // I3
        assert_eq!(tree.char_count(t), Some(6)); // ab + qq + cx
        let slot = t.slot();
        SWEEP_HOOK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |tr: &PrefixTree| {
                // I1's undo: its first node began at 2 (the split of "abqq" was not new).
                tr.detach_path(b"abcd", 2, slot, &reclaim::pin());
            }))
        });
        let removed = tree.remove_tenants(&[t]);
        SWEEP_HOOK.with(|h| h.borrow_mut().take());
        assert_eq!(removed, vec![6]);
        assert_eq!(tree.stats().nodes, 0);
        tree.check_invariants().unwrap();
    }

    /// `oldest` finds the oldest time among the tenant's leaves: it drops the entries of nodes
    /// that gained a child of the tenant and re-queues an entry older than its leaf at the
    /// leaf's time, leaving one entry per leaf it looked at.
    #[test]
    fn oldest_drops_entries_of_inner_nodes_and_requeues_raised_leaves() {
        let tree = PrefixTree::new();
        let a = tree.add_tenant("a");
        tree.insert_at("ab", a, 1).unwrap();
        // "ab" raised to 2 and now owning "c": its entry (1) is stale.
        tree.insert_at("abc", a, 2).unwrap();
        tree.insert_at("x", a, 3).unwrap();
        // "x" raised to 10: its entry (3) is older than the leaf.
        tree.insert_at("x", a, 10).unwrap();
        let (ab, c, x) = (
            id_at(&tree, &["a"]),
            id_at(&tree, &["a", "c"]),
            id_at(&tree, &["x"]),
        );
        assert_eq!(entries(&tree, a), vec![(1, ab), (2, c), (3, x)]);
        let state = tree.slots.state_of(a.slot()).unwrap();
        let oldest = || {
            let mut lru = state.lru.lock();
            tree.oldest(&mut lru, a.slot(), &reclaim::pin())
        };
        assert_eq!(oldest(), Some(2));
        assert_eq!(entries(&tree, a), vec![(2, c), (3, x)]);
        // The group at 2 is "c" and then its parent "ab".
        assert_eq!(tree.evict_tenant_by_lru(a, 1), 3);
        assert_eq!(entries(&tree, a), vec![(3, x)]);
        assert_eq!(oldest(), Some(10));
        assert_eq!(entries(&tree, a), vec![(10, x)]);
    }

    /// An eviction queues a parent only once it became a leaf of the tenant: a parent that
    /// still owns another child gets no entry.
    #[test]
    fn an_eviction_queues_a_parent_only_once_it_is_a_leaf() {
        let tree = PrefixTree::new();
        let a = tree.add_tenant("a");
        tree.insert_at("ab", a, 1).unwrap();
        tree.insert_at("ac", a, 2).unwrap();
        let c = id_at(&tree, &["a", "c"]);
        assert_eq!(tree.evict_tenant_by_lru(a, 1), 1);
        assert_eq!(entries(&tree, a), vec![(2, c)]);
        // "c" goes, and then "a", queued when it became a leaf, in the same group.
        assert_eq!(tree.evict_tenant_by_lru(a, 1), 2);
        assert_eq!(entries(&tree, a), vec![]);
    }
}
