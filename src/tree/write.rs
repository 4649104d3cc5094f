//! Inserts: the lock-free timestamp raise along an owned path, and the locked descent that
//! attaches the tenant, adds a leaf or splits an edge.
//!
//! An insert first runs the lock-free descent of `read.rs`, recording the nodes whose whole
//! edge matched. It raises the tenant's time on the leading recorded nodes the tenant already
//! owns, without locks. If the tenant owns the whole path and the text ends on a node boundary,
//! that is all. Otherwise the deepest owned node becomes the *anchor*: the insert locks it,
//! checks it is still linked (not obsolete) and still owned by the tenant, and descends from it
//! with lock coupling (child locked before the parent is released), attaching the tenant to each
//! node, and ends by adding a leaf or splitting the edge where the text leaves the tree. Nodes
//! it will add are allocated before any lock is taken, from where the lock-free descent left the
//! tree, and used under the lock if the tree still diverges there.

use super::raw::{Mask, NewNode, NewOwners, Node, NodeLock, PreparedSplit};
use super::read::{give_back_mask_words, take_mask_words, Divergence, RecordedPath};
use super::slab::Counts;
use super::{Error, PrefixMatch, PrefixTree, MAX_TEXT_BYTES};
use crate::reclaim::{self, Guard};
use crate::sync::{self, Ordering};
use crate::tenant::TenantId;
use crate::text;
use std::ptr;

/// What an insert allocates before it takes any lock: the ids of the (at most) two nodes it
/// can add — a leaf and the prefix of a split — so that running out of ids fails before
/// anything is published, and, from where its lock-free descent left the tree, those nodes with
/// their text copied. Under the lock a prepared node is used if the tree still diverges there;
/// otherwise a node is built with the reserved id. Unused nodes are freed and unused ids
/// released on drop.
struct Prepared<'t> {
    tree: &'t PrefixTree,
    leaf_id: Option<u32>,
    prefix_id: Option<u32>,
    /// Offset of the text where the prepared leaf starts.
    leaf_at: usize,
    leaf: Option<NewNode>,
    /// The child the prepared split is for, and where.
    split_child: *const Node,
    split_at: usize,
    split: Option<PreparedSplit>,
    /// The nodes the insert added, for the tree's counts (settled with the unused ids).
    added: Counts,
}

impl<'t> Prepared<'t> {
    /// Nothing reserved or prepared yet (see [`Self::prepare`]).
    fn new(tree: &'t PrefixTree) -> Self {
        Prepared {
            tree,
            leaf_id: None,
            prefix_id: None,
            leaf_at: usize::MAX,
            leaf: None,
            split_child: ptr::null(),
            split_at: 0,
            split: None,
            added: Counts::default(),
        }
    }

    /// Reserves the ids and prepares the nodes, in place (an insert's caller keeps this on its
    /// stack: returning it by value through a `Result` cost a W1 insert a stalled copy).
    fn prepare(
        &mut self,
        bytes: &[u8],
        path: &RecordedPath<'_>,
        slot: usize,
        ts: u64,
        guard: &Guard,
    ) -> Result<(), Error> {
        let (leaf_id, prefix_id) = self
            .tree
            .store
            .slab
            .reserve_two()
            .ok_or(Error::TooManyNodes)?;
        (self.leaf_id, self.prefix_id) = (Some(leaf_id), Some(prefix_id));
        let (child, lcp) = match path.divergence {
            Divergence::Unknown => return Ok(()),
            Divergence::NoChild => {
                self.leaf = Some(Self::leaf(&bytes[path.offset..], leaf_id, slot, ts));
                self.leaf_at = path.offset;
                return Ok(());
            }
            Divergence::Partial { child, lcp } => (child, lcp),
        };
        if lcp == 0 || lcp >= child.len() {
            return Ok(());
        }
        let owners = child.owners(guard);
        self.split = Some(PreparedSplit::new(
            child.text(),
            lcp,
            prefix_id,
            child.id(),
            owners,
        ));
        self.split_child = child;
        self.split_at = lcp;
        let tail_at = path.offset + lcp;
        if tail_at < bytes.len() {
            self.leaf = Some(Self::leaf(&bytes[tail_at..], leaf_id, slot, ts));
            self.leaf_at = tail_at;
        }
        Ok(())
    }

    fn leaf(text: &[u8], id: u32, slot: usize, ts: u64) -> NewNode {
        NewNode::leaf(text, id, slot, ts)
    }

    /// The leaf for the text from `at` on (`text`): the prepared one if it was made for that
    /// offset (hence that text), else a new one with the reserved leaf id.
    fn take_leaf(&mut self, at: usize, text: &[u8], slot: usize, ts: u64) -> NewNode {
        let id = self.leaf_id.take().expect("one leaf per insert");
        match self.leaf.take() {
            Some(l) if self.leaf_at == at => l,
            _ => Self::leaf(text, id, slot, ts),
        }
    }

    /// The split nodes for `child` after `at` bytes: the prepared ones if they were made for
    /// it, else new ones with the reserved prefix id.
    fn take_split(&mut self, child: &Node, at: usize, guard: &Guard) -> PreparedSplit {
        let prepared = self.split.take();
        let id = self.prefix_id.take().expect("one split per insert");
        match prepared {
            Some(s) if ptr::eq(self.split_child, child) && self.split_at == at => s,
            _ => PreparedSplit::new(child.text(), at, id, child.id(), child.owners(guard)),
        }
    }
}

impl Drop for Prepared<'_> {
    fn drop(&mut self) {
        // Unused nodes are freed by their own drop; unused reserved ids (never entered in the
        // slab) go back to it, with the counts of the nodes added, under one lock.
        self.tree
            .store
            .slab
            .settle([self.leaf_id, self.prefix_id], self.added);
    }
}

/// Why a locked descent gave up: the anchor it locked was unlinked or lost the tenant
/// meanwhile; the insert re-runs its lock-free descent.
struct Retry;

impl PrefixTree {
    /// Routes and records in one descent: matches `text` like
    /// [`prefix_match_into`](Self::prefix_match_into), lets `choose` pick a tenant from the
    /// result, then inserts `text` for it at time `ts`, reusing the path the match walked (no
    /// second comparison of the text). Returns the chosen tenant (`None` if `choose` declined).
    ///
    /// `choose` runs in the middle of the descent, while this thread is pinned (the epoch
    /// reclaimer is shared by the whole process): keep it short and never block in it (I/O,
    /// waiting for a lock or another thread). While it runs, no kvtrie structure in the
    /// process frees what its writers retire, and removed tenants' slots are not reused. To
    /// decide with a slow call, use [`prefix_match_into`](Self::prefix_match_into), then
    /// [`insert_at`](Self::insert_at).
    ///
    /// ```
    /// let tree = kvtrie::PrefixTree::new();
    /// let a = tree.add_tenant("a");
    /// let b = tree.add_tenant("b");
    /// tree.insert_at("hello world", a, 1).unwrap();
    /// let mut m = kvtrie::PrefixMatch::default();
    /// // Route to the first owner of the longest match, or to `b` on a miss.
    /// let chosen = tree
    ///     .match_and_insert("hello there", None, 2, &mut m, |m| {
    ///         Some(if m.matched_chars > 3 { m.tenants.iter().next().unwrap() } else { b })
    ///     })
    ///     .unwrap();
    /// assert_eq!((chosen, m.matched_chars), (Some(a), 6));
    /// assert_eq!(tree.prefix_match("hello there", None).matched_chars, 11);
    /// ```
    pub fn match_and_insert<F>(
        &self,
        text: &str,
        available: Option<&[TenantId]>,
        ts: u64,
        out: &mut PrefixMatch,
        choose: F,
    ) -> Result<Option<TenantId>, Error>
    where
        F: FnOnce(&PrefixMatch) -> Option<TenantId>,
    {
        if text.len() > MAX_TEXT_BYTES {
            return Err(Error::TextTooLong { len: text.len() });
        }
        let guard = reclaim::pin();
        let mut stack_words = [0u64; 16];
        let mut heap_words = take_mask_words();
        let mask = self.mask(available, &mut stack_words, &mut heap_words, &guard);
        let mut path = RecordedPath::new(self.root());
        self.walk::<true>(text.as_bytes(), mask, out, &mut path, &guard);
        give_back_mask_words(heap_words);
        let Some(t) = choose(out) else {
            return Ok(None);
        };
        if let Some(id) = self.insert_recorded(text.as_bytes(), t, ts, &mut path, &guard)? {
            // The new leaf joins the tenant's LRU after this thread unpinned (a compaction of the
            // LRU pins for itself); it never waits for an eviction holding the LRU, but parks
            // its entry (see `Lru`). The entry names the leaf by id and is checked when popped.
            let state = self.slots.state_in(t.slot(), &guard);
            drop(guard);
            if let Some(state) = state {
                self.push_lru(state, t.slot(), ts, id);
            }
        }
        Ok(Some(t))
    }

    /// Inserts `text` for tenant `t` at the tree clock ([`now`](Self::now)).
    ///
    /// Errors on an unknown or removed tenant (nothing changes) and on text longer than
    /// [`MAX_TEXT_BYTES`]. Inserting `""` is valid and changes nothing.
    pub fn insert(&self, text: &str, t: TenantId) -> Result<(), Error> {
        self.insert_at(text, t, self.now())
    }

    /// Inserts `text` for tenant `t` with the caller's timestamp `ts`: every node on the path
    /// gets `t`'s last-access time `max(old, ts)`; `t` is charged each node's length the first
    /// time it owns it; a partial match splits the node (both halves keep their owners and
    /// times; counts do not change).
    ///
    /// ```
    /// let tree = kvtrie::PrefixTree::new();
    /// let a = tree.add_tenant("a");
    /// tree.insert_at("hello", a, 1).unwrap();
    /// tree.insert_at("help", a, 2).unwrap();
    /// assert_eq!(tree.char_count(a), Some(6)); // "hel" + "lo" + "p"
    /// ```
    pub fn insert_at(&self, text: &str, t: TenantId, ts: u64) -> Result<(), Error> {
        // The routing descent with no tenant available: it records the path without matching.
        let mut unused = PrefixMatch::default();
        self.match_and_insert(text, Some(&[]), ts, &mut unused, |_| Some(t))
            .map(|_| ())
    }

    /// The insert proper, after a recording descent. Returns the id of the node that became a
    /// leaf of `t`, for its LRU.
    fn insert_recorded<'g>(
        &'g self,
        bytes: &[u8],
        t: TenantId,
        ts: u64,
        path: &mut RecordedPath<'g>,
        guard: &'g Guard,
    ) -> Result<Option<u32>, Error> {
        let slot = t.slot();
        let table = self.slots.load(guard);
        if !table.is_live(t) {
            return Err(Error::UnknownTenant(t));
        }
        if bytes.is_empty() {
            return Ok(None);
        }
        let state = self.state(slot, guard);
        // The root's time lives with the tenant (see `TenantState::root_ts`).
        if state.root_ts.load(Ordering::Relaxed) < ts {
            state.root_ts.fetch_max(ts, Ordering::Relaxed);
        }
        let mut owned = self.raise_owned(path, slot, ts, guard);
        if owned == path.len() && path.exact {
            return Ok(None);
        }
        let mut prepared = Prepared::new(self);
        prepared.prepare(bytes, path, slot, ts, guard)?;
        let mut retries = 0;
        // Where the nodes this insert gave the tenant begin (the text's byte offset): all of
        // them lie on the text's path from there down.
        let mut credited_from = None;
        let new_leaf = loop {
            if owned == 0 {
                // Not even the root lists the tenant: it was removed meanwhile.
                return Err(Error::UnknownTenant(t));
            }
            let locked = self.insert_locked(
                bytes,
                slot,
                ts,
                path,
                owned,
                &mut prepared,
                &mut credited_from,
                guard,
            );
            match locked {
                Ok(leaf) => break leaf,
                Err(Retry) => {
                    // The anchor changed under us: let the writer that changed it finish.
                    sync::spin_wait(&mut retries);
                    *path = RecordedPath::new(self.root());
                    let mut unused = PrefixMatch::default();
                    self.walk::<true>(bytes, Mask::EMPTY, &mut unused, path, guard);
                    owned = self.raise_owned(path, slot, ts, guard);
                    if owned == path.len() && path.exact {
                        break None;
                    }
                }
            }
        };
        drop(prepared);
        // The other half of the removal handshake (see `Slots::is_live_after_publish`): if the
        // tenant was removed while this insert published its bits, remove them again: its own
        // only (what the tenant owned before is the removal's, swept and reported by it).
        if !self.slots.is_live_after_publish(t, guard) {
            if let Some(from) = credited_from {
                self.detach_path(bytes, from, slot, guard);
            }
            return Err(Error::UnknownTenant(t));
        }
        self.store.retirer.flush_if_due(guard);
        Ok(new_leaf)
    }

    /// Raises `slot`'s time to `ts` on the leading recorded nodes it owns, top-down, without
    /// locks; returns how many it owns and raised (the root counts when the tenant is live).
    fn raise_owned(&self, path: &RecordedPath<'_>, slot: usize, ts: u64, guard: &Guard) -> usize {
        let mut nodes = path.iter();
        match nodes.next() {
            Some(root) if root.owners(guard).contains(slot) => {}
            _ => return 0,
        }
        let mut owned = 1;
        for n in nodes {
            if !Self::raise(n, slot, ts, guard) {
                break;
            }
            owned += 1;
        }
        owned
    }

    /// The lock-free raise of `slot`'s time on `node`: false if `slot` does not own it (or the
    /// node was unlinked while we raised), so the caller takes the locked path from there.
    ///
    /// A raise that finds its table superseded may be missing from the copy; it waits for the
    /// node's next table (every superseded table is replaced, or its node unlinked, by the
    /// writer that marked it) and raises there.
    fn raise(node: &Node, slot: usize, ts: u64, guard: &Guard) -> bool {
        let mut o = node.owners(guard);
        loop {
            let Some(cell) = o.ts_of(slot) else {
                return false;
            };
            Self::raise_cell(cell, ts);
            // Pairs with the fence in `Owners::mark_superseded` (checkable by loom): either the
            // table is not superseded yet, and any copy made later sees a time of at least `ts`
            // (ours, or a higher one already there), or we wait for the copy and raise there.
            sync::fence(Ordering::SeqCst);
            if !o.is_superseded() {
                return true;
            }
            // Wait for the replacement (our value in the superseded table proves nothing).
            let mut spins = 0;
            loop {
                if node.is_obsolete() {
                    return false;
                }
                let next = node.owners(guard);
                if !ptr::eq(next, o) {
                    o = next;
                    break;
                }
                sync::spin_wait(&mut spins);
            }
        }
    }

    /// `cell = max(cell, ts)`, with no locked instruction when it is already there.
    #[inline]
    fn raise_cell(cell: &crate::sync::AtomicU64, ts: u64) {
        if cell.load(Ordering::Relaxed) < ts {
            cell.fetch_max(ts, Ordering::SeqCst);
        }
    }

    /// The locked descent from the deepest owned recorded node (`path`'s node `owned - 1`).
    /// Returns the id of a node that became a leaf of `slot` (for its LRU), `Err(Retry)` if
    /// the anchor changed under us (before it gave the tenant any node). Sets `credited_from`
    /// to the byte offset where the first node it gave the tenant begins.
    #[allow(clippy::too_many_arguments)]
    fn insert_locked<'g>(
        &'g self,
        bytes: &[u8],
        slot: usize,
        ts: u64,
        path: &RecordedPath<'g>,
        owned: usize,
        prepared: &mut Prepared<'_>,
        credited_from: &mut Option<usize>,
        guard: &'g Guard,
    ) -> Result<Option<u32>, Retry> {
        let anchor = path.get(owned - 1);
        let mut off = path.offset_after(owned - 1);
        let mut cur = anchor.lock().ok_or(Retry)?;
        // Under the anchor's lock its owners cannot change: it must still list the tenant
        // (for the root: the tenant is still live).
        let Some(cell) = anchor.owners(guard).ts_of(slot) else {
            return Err(Retry);
        };
        // The lock-free raise already put `ts` in the anchor's table and saw it not superseded
        // after its fence, so a table replaced since copied it: this always skips (a load, no
        // locked instruction). The root's time lives with the tenant.
        if !ptr::eq(anchor, self.root()) {
            Self::raise_cell(cell, ts);
        }
        // The recorded nodes below the anchor: the children we expect to meet (hints).
        let mut expected = path.iter().skip(owned);
        let state = self.state(slot, guard);
        loop {
            if off == bytes.len() {
                return Ok(None);
            }
            let rest = &bytes[off..];
            let Some(child) = cur.node().child(text::edge_key(rest), guard) else {
                let leaf = prepared.take_leaf(off, rest, slot, ts);
                let id = leaf.node().id();
                let (chars, len) = (leaf.node().chars(), leaf.node().len());
                let leaf = cur.add_child(leaf, &self.store, guard);
                state.charge(chars, 1);
                credited_from.get_or_insert(off);
                prepared.added.add(Counts::node(chars, len));
                drop(leaf);
                return Ok(Some(id));
            };
            let edge = child.text();
            // Under `cur`'s lock its children cannot change: a child we recorded is still this
            // one, and its whole edge matched.
            let l = if expected.next().is_some_and(|e| ptr::eq(e, child)) {
                edge.len()
            } else {
                text::common_prefix(edge, rest)
            };
            let child_lock = child.lock().expect("a child of a locked node is linked");
            if l < edge.len() {
                let (leaf, newly) = self.split_locked(
                    &cur,
                    child_lock,
                    l,
                    bytes,
                    off + l,
                    slot,
                    ts,
                    prepared,
                    guard,
                );
                // The new prefix begins at `off` (new to the tenant or not), the leaf at
                // `off + l`.
                if newly {
                    credited_from.get_or_insert(off);
                } else if off + l < bytes.len() {
                    credited_from.get_or_insert(off + l);
                }
                return Ok(leaf);
            }
            let o = child.owners(guard);
            match o.ts_of(slot) {
                Some(cell) => {
                    // Under the child's lock its table is not replaced; lock-free raisers
                    // also only `fetch_max`.
                    Self::raise_cell(cell, ts);
                }
                None => {
                    // The parent (`cur`) is locked and lists the tenant: prefix closure holds.
                    let (owners, _) = NewOwners::with(o, slot, ts);
                    child_lock.set_owners(owners, &self.store, guard);
                    state.charge(child.chars(), 1);
                    credited_from.get_or_insert(off);
                    if off + l == bytes.len() {
                        // Newly owned where the text ends: the tenant owns no child of it
                        // (prefix closure), so it is a new leaf of the tenant.
                        return Ok(Some(child.id()));
                    }
                }
            }
            off += l;
            cur = child_lock;
        }
    }

    /// Splits `child` (of `parent`, both locked) after `at` bytes for `slot`, with a new leaf
    /// for the text from `tail_at` on if there is any. Returns the id of the node that became a
    /// leaf of `slot`, and whether the new prefix is new to `slot`.
    #[allow(clippy::too_many_arguments)]
    fn split_locked<'g>(
        &'g self,
        parent: &NodeLock<'g>,
        child: NodeLock<'g>,
        at: usize,
        bytes: &[u8],
        tail_at: usize,
        slot: usize,
        ts: u64,
        prepared: &mut Prepared<'_>,
        guard: &'g Guard,
    ) -> (Option<u32>, bool) {
        let c = child.node();
        let nodes = prepared.take_split(c, at, guard);
        let leaf = (tail_at < bytes.len())
            .then(|| prepared.take_leaf(tail_at, &bytes[tail_at..], slot, ts));
        let leaf_size = leaf.as_ref().map(|l| (l.node().chars(), l.node().len()));
        let split = parent.split_child(child, nodes, Some((slot, ts)), leaf, &self.store, guard);
        // Every owner of the split node also owns the new prefix node (the split node, now
        // retired, is still readable under our guard).
        let table = self.slots.load(guard);
        for s in c.owners(guard).slots() {
            if let Some(st) = table.state(s) {
                st.nodes.fetch_add(1, Ordering::Relaxed);
            }
        }
        let prefix = split.prefix.node();
        // The tenant's charge for the prefix (if new to it) and the leaf, in one pair of adds.
        let (mut chars, mut nodes) = (0, 0);
        if split.newly {
            (chars, nodes) = (prefix.chars(), 1);
        }
        // The prefix adds a node (its text was the split node's).
        prepared.added.add(Counts::node(0, 0));
        if let Some((c, l)) = leaf_size {
            (chars, nodes) = (chars + c, nodes + 1);
            prepared.added.add(Counts::node(c, l));
        }
        self.state(slot, guard).charge(chars, nodes);
        let leaf = match &split.leaf {
            Some(l) => Some(l.node().id()),
            None if split.newly => Some(prefix.id()),
            None => None,
        };
        (leaf, split.newly)
    }
}
