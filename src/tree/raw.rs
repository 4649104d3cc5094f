//! The raw, unsafe core of the tree: node, owner-table and child-table layouts.
//!
//! Every object here is one heap allocation with a fixed header followed by a variable-length
//! tail. Nodes and tables are published with `Release` stores and read with `Acquire` loads
//! while the reader holds an epoch guard; once replaced or unlinked they are retired through
//! [`crate::reclaim`]. The edge text of a node and the membership (bits) of an owner table are
//! immutable after publication; only per-owner timestamps are mutated in place (monotone
//! `fetch_max`), and child slots are swapped in place when a child is split.

use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::mem::{align_of, size_of};
use std::ptr;

/// `Node::parent` of the root.
pub(crate) const NO_PARENT: u32 = u32::MAX - 1;
/// `Node::parent` of a node unlinked from the tree (split or pruned); set under the writer lock.
pub(crate) const DEAD: u32 = u32::MAX;
/// `Node::chars` flag: the edge text is pure ASCII (bytes == chars).
const ASCII: u32 = 1 << 31;

/// A tree node: header followed by `len` bytes of UTF-8 edge text.
///
/// The first membership word (tenant slots 0..63) is duplicated inline (`bits0`) so the common
/// read path (at most 64 tenants) never touches the owner table.
#[repr(C)]
pub(crate) struct Node {
    // Invariant: null (no children) or a `ChildTable` published with Release; replaced only
    // under the writer lock, the replaced table being retired (or handed to a split's suffix
    // node, see `PrefixTree::split`).
    pub(crate) children: AtomicPtr<ChildTable>,
    // Invariant: never null; an `Owners` table published with Release, replaced only under the
    // writer lock (through `set_owners`); the replaced table is marked superseded and retired.
    owners: AtomicPtr<Owners>,
    /// Word 0 of the current owner table's membership (slots 0..63), stored after each
    /// replacement. A reader may briefly see it one replacement ahead of or behind the table it
    /// loads; each is a valid membership of some moment.
    bits0: AtomicU64,
    /// Slab id of the parent ([`NO_PARENT`] at the root, [`DEAD`] once unlinked); read and
    /// written only under the writer lock.
    pub(crate) parent: AtomicU32,
    /// Slab id (see `WriterState::slab`); immutable.
    pub(crate) id: u32,
    len: u32,
    /// Length in chars, with the [`ASCII`] flag in bit 31.
    chars: u32,
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

// The node header budget: 40 bytes (text follows inline).
#[cfg(not(loom))]
const _: () = assert!(size_of::<Node>() <= 40);

impl Node {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(size_of::<Node>() + len, align_of::<Node>()).expect("node layout")
    }

    /// Allocates a node holding a copy of `text` (valid UTF-8, shorter than 2^31 bytes).
    pub(crate) fn alloc(
        text: &[u8],
        id: u32,
        parent: u32,
        children: *mut ChildTable,
        owners: *mut Owners,
    ) -> *mut Node {
        let p = Self::alloc_detached(text);
        // Safety: `p` is fresh and unpublished; `owners` is a live table handed to the node.
        unsafe { Self::adopt(p, id, parent, children, owners) };
        p
    }

    /// Allocates an unpublished node holding a copy of `text`, without links: an insert
    /// prepares its nodes this way before taking the writer lock, then [`Node::adopt`]s them.
    pub(crate) fn alloc_detached(text: &[u8]) -> *mut Node {
        let len = u32::try_from(text.len()).expect("edge length checked by the caller");
        let ascii = text.is_ascii();
        let chars = if ascii {
            len | ASCII
        } else {
            crate::text::char_count(text) as u32
        };
        let layout = Self::layout(text.len());
        // Safety: the layout has non-zero size (the header is not empty).
        let p = unsafe { alloc(layout) } as *mut Node;
        if p.is_null() {
            handle_alloc_error(layout);
        }
        // Safety: `p` is a fresh allocation of `layout`, large enough and aligned for the header
        // followed by `len` bytes; we initialize the header and then the text.
        unsafe {
            ptr::write(
                p,
                Node {
                    children: AtomicPtr::new(ptr::null_mut()),
                    owners: AtomicPtr::new(ptr::null_mut()),
                    bits0: AtomicU64::new(0),
                    parent: AtomicU32::new(DEAD),
                    id: u32::MAX,
                    len,
                    chars,
                    #[cfg(loom)]
                    poison: Default::default(),
                },
            );
            ptr::copy_nonoverlapping(
                text.as_ptr(),
                (p as *mut u8).add(size_of::<Node>()),
                text.len(),
            );
        }
        p
    }

    /// Sets the links of a node before it is published; a null `owners` keeps the current one.
    ///
    /// # Safety
    ///
    /// `p` came from [`Node::alloc_detached`] and is not yet reachable by any other thread;
    /// `owners`, if not null, is a live table now owned by the node. Before publication the
    /// node must have an owner table.
    pub(crate) unsafe fn adopt(
        p: *mut Node,
        id: u32,
        parent: u32,
        children: *mut ChildTable,
        owners: *mut Owners,
    ) {
        // Safety: exclusive access to an unpublished node (caller's contract).
        unsafe {
            (*p).id = id;
            (*p).parent.store(parent, Ordering::Relaxed);
            (*p).children.store(children, Ordering::Relaxed);
            if !owners.is_null() {
                (*p).set_owners(owners);
            }
        }
    }

    /// Frees a node that was never published, with its owner table if it has one.
    ///
    /// # Safety
    ///
    /// `p` came from [`Node::alloc_detached`], was never published, and is freed once.
    pub(crate) unsafe fn free_unpublished(p: *mut Node) {
        // Safety: unpublished, so exclusively ours; its owner table (if any) is its own.
        unsafe {
            let o = (*p).owners.load(Ordering::Relaxed);
            if !o.is_null() {
                Owners::destroy(o);
            }
            Self::free_alone(p);
        }
    }

    /// Frees a node and its current owner table (not its child table, which a split hands to
    /// the suffix node, and which a pruned node no longer has).
    ///
    /// # Safety
    ///
    /// `p` came from [`Node::alloc`], is unreachable by every other thread, and is freed once.
    pub(crate) unsafe fn destroy(p: *mut Node) {
        #[cfg(loom)]
        {
            // Under loom, poison instead of freeing: later reads through a stale pointer then
            // fail loudly (see `crate::sync::PoisonFlag`).
            // Safety: the caller guarantees `p` is a node that is still allocated.
            unsafe { (*p).poison.poison() };
        }
        #[cfg(not(loom))]
        // Safety: by the caller's contract nobody else holds `p`; its owner table belongs to it.
        unsafe {
            let owners = (*p).owners.load(Ordering::Relaxed);
            Owners::destroy(owners);
            Self::free_alone(p);
        }
    }

    /// Frees only the node's own allocation.
    ///
    /// # Safety
    ///
    /// As for [`Node::destroy`]; the owner and child tables must be freed or owned elsewhere.
    pub(crate) unsafe fn free_alone(p: *mut Node) {
        // Safety: `p` is a live node allocated with `Self::layout(len)`.
        unsafe {
            let layout = Self::layout((*p).len as usize);
            ptr::drop_in_place(p);
            dealloc(p as *mut u8, layout);
        }
    }

    #[inline]
    pub(crate) fn check(&self) {
        #[cfg(loom)]
        self.poison.assert_alive("node");
    }

    /// The edge text (immutable).
    #[inline]
    pub(crate) fn text(&self) -> &[u8] {
        self.check();
        // Safety: the allocation holds `len` initialized bytes right after the header, written
        // once before the node was published and never modified.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const Node as *const u8).add(size_of::<Node>()),
                self.len as usize,
            )
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    #[inline]
    pub(crate) fn chars(&self) -> usize {
        (self.chars & !ASCII) as usize
    }

    #[inline]
    pub(crate) fn is_ascii(&self) -> bool {
        self.chars & ASCII != 0
    }

    /// Unlinked? (Writer lock held.)
    pub(crate) fn is_dead(&self) -> bool {
        self.parent.load(Ordering::Relaxed) == DEAD
    }

    /// Marks the node unlinked; writer lock held.
    pub(crate) fn mark_dead(&self) {
        self.parent.store(DEAD, Ordering::Relaxed);
    }

    /// The current owner table as a raw pointer (writer lock held, or for `Drop`).
    pub(crate) fn owners_ptr(&self) -> *mut Owners {
        self.owners.load(Ordering::Acquire)
    }

    /// Publishes a new owner table (writer lock held); the caller retires the old one.
    pub(crate) fn set_owners(&self, new: *mut Owners) {
        self.owners.store(new, Ordering::Release);
        // Safety: `new` is a live table just published by the writer.
        self.bits0
            .store(unsafe { (*new).word(0) }, Ordering::Release);
    }

    /// The node's owners within `mask`, from one read: the inline word when the mask lies
    /// within slots 0..63 (no owner-table access), else the owner table.
    #[inline]
    pub(crate) fn owner_view(&self, mask: Mask<'_>) -> OwnerView<'_> {
        if mask.lo == 0 && mask.words.len() <= 1 {
            let w0 = mask.words.first().copied().unwrap_or(0);
            OwnerView::Word(self.bits0.load(Ordering::Acquire) & w0)
        } else {
            let o = self.owners();
            OwnerView::Table(o, o.intersects(mask))
        }
    }

    /// The owner table, valid while the caller's epoch guard lives.
    #[inline]
    pub(crate) fn owners(&self) -> &Owners {
        self.check();
        // Safety: never null (see the field invariant); a replaced table is retired through the
        // epoch reclaimer, so it outlives the caller's guard, which was pinned before this load.
        let o = unsafe { &*self.owners.load(Ordering::Acquire) };
        o.check();
        o
    }

    /// The child table, if any, valid while the caller's epoch guard lives.
    #[inline]
    pub(crate) fn children(&self) -> Option<&ChildTable> {
        self.check();
        let p = self.children.load(Ordering::Acquire);
        // Safety: null or a published table that stays allocated until retired after the
        // caller's guard was pinned (field invariant).
        let t = unsafe { p.as_ref() };
        if let Some(t) = t {
            t.check();
        }
        t
    }

    /// The child whose edge starts with the char keyed `key`.
    #[inline]
    pub(crate) fn child(&self, key: u32) -> Option<&Node> {
        let c = self.children()?.get(key)?;
        // Safety: child pointers in a published table are live nodes until retired, which
        // happens only after they are unlinked, after the caller pinned.
        let c = unsafe { &*c };
        c.check();
        Some(c)
    }
}

/// Owner table: which tenants own a node, and each owner's last-access time.
///
/// Header, then `nwords` bit words covering slots `64 * lo ..`, then one `AtomicU64` timestamp
/// per owner in ascending slot order. Membership never changes after publication (the writer
/// publishes a new table instead); timestamps are raised in place with `fetch_max`.
#[repr(C)]
pub(crate) struct Owners {
    /// Bit 31: superseded (a newer table replaced this one; see [`Owners::mark_superseded`]);
    /// bits 0..31: number of owners (immutable).
    meta: AtomicU32,
    lo: u16,
    nwords: u16,
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

const SUPERSEDED: u32 = 1 << 31;

impl Owners {
    fn layout(nwords: usize, n: usize) -> (Layout, usize, usize) {
        let (l, bits_off) = Layout::new::<Owners>()
            .extend(Layout::array::<u64>(nwords).expect("owners layout"))
            .expect("owners layout");
        let (l, ts_off) = l
            .extend(Layout::array::<AtomicU64>(n).expect("owners layout"))
            .expect("owners layout");
        (l.pad_to_align(), bits_off, ts_off)
    }

    /// Allocates a table from `(slot, ts)` pairs in strictly ascending slot order.
    pub(crate) fn from_sorted(entries: &[(u32, u64)]) -> *mut Owners {
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        let (lo, nwords) = match (entries.first(), entries.last()) {
            (Some(f), Some(l)) => {
                let lo = f.0 as usize / 64;
                (lo, l.0 as usize / 64 + 1 - lo)
            }
            _ => (0, 0),
        };
        let lo16 = u16::try_from(lo).expect("tenant slots are bounded");
        let nwords16 = u16::try_from(nwords).expect("tenant slots are bounded");
        let (layout, bits_off, ts_off) = Self::layout(nwords, entries.len());
        // Safety: non-zero size (the header is not empty).
        let p = unsafe { alloc(layout) } as *mut Owners;
        if p.is_null() {
            handle_alloc_error(layout);
        }
        // Safety: fresh allocation of `layout`; header, bits and timestamps are written at the
        // offsets `Layout::extend` computed, each properly aligned.
        unsafe {
            ptr::write(
                p,
                Owners {
                    meta: AtomicU32::new(entries.len() as u32),
                    lo: lo16,
                    nwords: nwords16,
                    #[cfg(loom)]
                    poison: Default::default(),
                },
            );
            let bits = (p as *mut u8).add(bits_off) as *mut u64;
            for i in 0..nwords {
                bits.add(i).write(0);
            }
            let ts = (p as *mut u8).add(ts_off) as *mut AtomicU64;
            for (i, &(slot, t)) in entries.iter().enumerate() {
                let w = slot as usize / 64 - lo;
                *bits.add(w) |= 1u64 << (slot % 64);
                ts.add(i).write(AtomicU64::new(t));
            }
        }
        p
    }

    /// Frees a table.
    ///
    /// # Safety
    ///
    /// `p` came from [`Owners::from_sorted`], no other thread holds it, and it is freed once.
    pub(crate) unsafe fn destroy(p: *mut Owners) {
        #[cfg(loom)]
        {
            // Safety: the table is still allocated (poisoned, never freed, under loom).
            unsafe { (*p).poison.poison() };
        }
        #[cfg(not(loom))]
        // Safety: `p` is a live table allocated with `Self::layout(nwords, n)`; we drop the
        // timestamps in place (no-ops for std atomics) and free the block.
        unsafe {
            let o = &*p;
            let (layout, _, ts_off) = Self::layout(o.nwords as usize, o.len());
            let ts = (p as *mut u8).add(ts_off) as *mut AtomicU64;
            for i in 0..o.len() {
                ptr::drop_in_place(ts.add(i));
            }
            ptr::drop_in_place(p);
            dealloc(p as *mut u8, layout);
        }
    }

    #[inline]
    pub(crate) fn check(&self) {
        #[cfg(loom)]
        self.poison.assert_alive("owner table");
    }

    /// Number of owners.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        (self.meta.load(Ordering::Relaxed) & !SUPERSEDED) as usize
    }

    /// First bit word index (the table covers slots `64 * lo ..`).
    #[inline]
    pub(crate) fn lo(&self) -> usize {
        self.lo as usize
    }

    /// The membership bit words.
    #[inline]
    pub(crate) fn bits(&self) -> &[u64] {
        let (_, bits_off, _) = Self::layout(self.nwords as usize, 0);
        // Safety: the allocation holds `nwords` initialized words at `bits_off`, written before
        // the table was published and never modified after.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const Owners as *const u8).add(bits_off) as *const u64,
                self.nwords as usize,
            )
        }
    }

    /// The owners' timestamps, in ascending slot order.
    #[inline]
    pub(crate) fn ts(&self) -> &[AtomicU64] {
        let n = self.len();
        let (_, _, ts_off) = Self::layout(self.nwords as usize, n);
        // Safety: the allocation holds `n` initialized atomics at `ts_off`.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const Owners as *const u8).add(ts_off) as *const AtomicU64,
                n,
            )
        }
    }

    /// Membership word `w` (slots `64 * w ..`), zero outside the stored range.
    #[inline]
    pub(crate) fn word(&self, w: usize) -> u64 {
        w.checked_sub(self.lo())
            .and_then(|i| self.bits().get(i).copied())
            .unwrap_or(0)
    }

    /// Does `slot` own the node?
    #[inline]
    pub(crate) fn contains(&self, slot: usize) -> bool {
        let w = slot / 64;
        w >= self.lo()
            && self
                .bits()
                .get(w - self.lo())
                .is_some_and(|b| b >> (slot % 64) & 1 == 1)
    }

    /// Index of `slot`'s timestamp, if it is an owner.
    #[inline]
    pub(crate) fn rank(&self, slot: usize) -> Option<usize> {
        if !self.contains(slot) {
            return None;
        }
        let bits = self.bits();
        let w = slot / 64 - self.lo();
        let below: u32 = bits[..w].iter().map(|b| b.count_ones()).sum();
        let mask = (1u64 << (slot % 64)) - 1;
        Some(below as usize + (bits[w] & mask).count_ones() as usize)
    }

    /// `slot`'s timestamp, if it is an owner.
    #[inline]
    pub(crate) fn ts_of(&self, slot: usize) -> Option<&AtomicU64> {
        self.rank(slot).map(|r| &self.ts()[r])
    }

    /// Does any tenant of `mask` own the node?
    #[inline]
    pub(crate) fn intersects(&self, mask: Mask<'_>) -> bool {
        let (a_lo, a) = (self.lo(), self.bits());
        let lo = a_lo.max(mask.lo);
        let hi = (a_lo + a.len()).min(mask.lo + mask.words.len());
        (lo..hi).any(|w| a[w - a_lo] & mask.words[w - mask.lo] != 0)
    }

    /// The owner slots, ascending.
    pub(crate) fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        let lo = self.lo();
        self.bits()
            .iter()
            .enumerate()
            .flat_map(move |(i, &w)| BitIter(w).map(move |b| (lo + i) * 64 + b))
    }

    /// Marks the table superseded before its timestamps are copied into a replacement.
    ///
    /// Pairs with the lock-free insert path, which raises a timestamp with a `SeqCst`
    /// `fetch_max` and then checks this flag with a `SeqCst` load: either that check sees the
    /// flag (and the insert retries under the lock), or its `fetch_max` precedes this store in
    /// the single `SeqCst` order and the writer's `SeqCst` copy of the timestamps sees it.
    pub(crate) fn mark_superseded(&self) {
        self.meta.fetch_or(SUPERSEDED, Ordering::SeqCst);
        // A SeqCst fence too: loom models SeqCst accesses as AcqRel but SeqCst fences exactly,
        // so with the fences (here and in `touch_path`) the handshake is model-checked.
        crate::sync::fence(Ordering::SeqCst);
    }

    /// See [`Owners::mark_superseded`].
    #[inline]
    pub(crate) fn is_superseded(&self) -> bool {
        self.meta.load(Ordering::SeqCst) & SUPERSEDED != 0
    }

    /// Marks this table superseded and returns its `(slot, ts)` entries (writer lock held).
    pub(crate) fn snapshot_for_replace(&self, out: &mut Vec<(u32, u64)>) {
        self.mark_superseded();
        out.clear();
        for (slot, ts) in self.slots().zip(self.ts()) {
            out.push((slot as u32, ts.load(Ordering::SeqCst)));
        }
    }
}

/// Iterator over the set bits of a word.
pub(crate) struct BitIter(pub(crate) u64);

impl Iterator for BitIter {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(b)
    }
}

/// One read of a node's owners restricted to a mask (see [`Node::owner_view`]).
pub(crate) enum OwnerView<'a> {
    /// Owners among slots 0..63, already masked.
    Word(u64),
    /// The owner table, and whether it intersects the mask.
    Table(&'a Owners, bool),
}

impl OwnerView<'_> {
    /// Does any tenant of the mask own the node?
    #[inline]
    pub(crate) fn any(&self) -> bool {
        match *self {
            OwnerView::Word(w) => w != 0,
            OwnerView::Table(_, any) => any,
        }
    }

    /// Calls `f` for each owner slot in `mask`, ascending.
    #[inline]
    pub(crate) fn for_each(&self, mask: Mask<'_>, mut f: impl FnMut(usize)) {
        match *self {
            OwnerView::Word(w) => BitIter(w).for_each(f),
            OwnerView::Table(o, _) => o.slots().filter(|&s| mask.contains(s)).for_each(&mut f),
        }
    }
}

/// A set of tenant slots as bit words starting at word `lo`.
#[derive(Clone, Copy)]
pub(crate) struct Mask<'a> {
    pub(crate) lo: usize,
    pub(crate) words: &'a [u64],
}

impl Mask<'_> {
    #[inline]
    pub(crate) fn contains(&self, slot: usize) -> bool {
        let w = slot / 64;
        w >= self.lo
            && self
                .words
                .get(w - self.lo)
                .is_some_and(|b| b >> (slot % 64) & 1 == 1)
    }
}

/// A node's children, sorted by edge key (first char of the edge): header, `len` keys, then
/// `len` child pointers (keys packed densely so a lookup scans one cache line).
///
/// Invariant: each child pointer is a live, published node whose edge starts with the char of
/// its key; a slot is swapped in place only by a split (under the writer lock), for a node with
/// the same first char.
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
        (l.pad_to_align(), keys, ptrs)
    }

    /// Allocates a table from `(key, child)` pairs in strictly ascending key order; null when
    /// there are none (a node without children has a null table).
    pub(crate) fn from_sorted(entries: &[(u32, *mut Node)]) -> *mut ChildTable {
        if entries.is_empty() {
            return ptr::null_mut();
        }
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        let n = entries.len();
        let (layout, koff, poff) = Self::layout(n);
        // Safety: non-zero size.
        let p = unsafe { alloc(layout) } as *mut ChildTable;
        if p.is_null() {
            handle_alloc_error(layout);
        }
        // Safety: fresh allocation of `layout`: header, `n` keys at `koff`, `n` pointers at
        // `poff`, each aligned as `Layout::extend` computed.
        unsafe {
            ptr::write(
                p,
                ChildTable {
                    len: n as u32,
                    _tail: crate::sync::FreezeMarker::new(0),
                    #[cfg(loom)]
                    poison: Default::default(),
                },
            );
            let k = (p as *mut u8).add(koff) as *mut u32;
            let c = (p as *mut u8).add(poff) as *mut AtomicPtr<Node>;
            for (i, &(key, child)) in entries.iter().enumerate() {
                k.add(i).write(key);
                c.add(i).write(AtomicPtr::new(child));
            }
        }
        p
    }

    /// Frees a table (not the children).
    ///
    /// # Safety
    ///
    /// `p` came from [`ChildTable::from_sorted`], no other thread holds it, freed once.
    pub(crate) unsafe fn destroy(p: *mut ChildTable) {
        #[cfg(loom)]
        {
            // Safety: still allocated (never freed under loom).
            unsafe { (*p).poison.poison() };
        }
        #[cfg(not(loom))]
        // Safety: live table allocated with `Self::layout(len)`.
        unsafe {
            let n = (*p).len as usize;
            let (layout, _, poff) = Self::layout(n);
            let c = (p as *mut u8).add(poff) as *mut AtomicPtr<Node>;
            for i in 0..n {
                ptr::drop_in_place(c.add(i));
            }
            ptr::drop_in_place(p);
            dealloc(p as *mut u8, layout);
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
        let (_, koff, _) = Self::layout(0);
        // Safety: `len` initialized keys follow the header at `koff` (independent of `len`).
        unsafe {
            std::slice::from_raw_parts(
                (self as *const ChildTable as *const u8).add(koff) as *const u32,
                self.len as usize,
            )
        }
    }

    /// The child slots, in key order.
    #[inline]
    pub(crate) fn slots(&self) -> &[AtomicPtr<Node>] {
        let n = self.len as usize;
        let (_, _, poff) = Self::layout(n);
        // Safety: `n` initialized pointers follow the keys at `poff`.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const ChildTable as *const u8).add(poff) as *const AtomicPtr<Node>,
                n,
            )
        }
    }

    /// `(key, child)` pairs, in key order (child pointers loaded with Acquire).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, *mut Node)> + '_ {
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
    pub(crate) fn get(&self, key: u32) -> Option<*mut Node> {
        self.find(key)
            .map(|i| self.slots()[i].load(Ordering::Acquire))
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

impl Owners {
    /// Heap bytes of this table.
    pub(crate) fn bytes(&self) -> usize {
        Self::layout(self.nwords as usize, self.len()).0.size()
    }
}

impl Node {
    /// Heap bytes of this node's own allocation.
    pub(crate) fn bytes(&self) -> usize {
        Self::layout(self.len()).size()
    }
}

impl crate::reclaim::Retire for Node {
    fn heap_bytes(&self) -> usize {
        // A retired node is freed with its current owner table (see `Node::destroy`).
        let o = self.owners.load(Ordering::Acquire);
        // Safety: never null (field invariant); the table is owned by this still-live node.
        self.bytes() + unsafe { &*o }.bytes()
    }

    unsafe fn destroy(p: *mut Self) {
        // Safety: forwarded to the caller (`Retire::destroy`'s contract is `Node::destroy`'s).
        unsafe { Node::destroy(p) }
    }
}

impl crate::reclaim::Retire for Owners {
    fn heap_bytes(&self) -> usize {
        self.bytes()
    }

    unsafe fn destroy(p: *mut Self) {
        // Safety: forwarded to the caller.
        unsafe { Owners::destroy(p) }
    }
}

impl crate::reclaim::Retire for ChildTable {
    fn heap_bytes(&self) -> usize {
        Self::bytes(self.len())
    }

    unsafe fn destroy(p: *mut Self) {
        // Safety: forwarded to the caller.
        unsafe { ChildTable::destroy(p) }
    }
}
