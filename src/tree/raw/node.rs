//! The node header, node locks, and the builders of nodes not yet published.

use super::children::{ChildTable, NewChildTable};
use super::owners::{Mask, NewOwners, OwnerView, Owners, Shape};
use crate::reclaim::{Guard, Retire};
use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use crate::tree::slab::Store;
#[cfg(not(loom))]
use std::alloc::dealloc;
use std::alloc::{alloc, handle_alloc_error, Layout};
use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::ptr::{self, NonNull};

/// Parent id of the root.
pub(crate) const NO_PARENT: u32 = (1 << 30) - 1;
/// Largest node id (ids share the lock word with two flag bits).
pub(crate) const MAX_NODE_ID: u32 = NO_PARENT - 1;
/// Lock word: held.
const LOCKED: u32 = 1 << 31;
/// Lock word: unlinked from the tree; set while locked, never cleared, the lock never released.
const OBSOLETE: u32 = 1 << 30;
/// Lock word: the parent's id.
const PARENT: u32 = OBSOLETE - 1;
/// `Node::chars` flag: the edge text is pure ASCII (bytes == chars).
const ASCII: u32 = 1 << 31;
/// `Node::len` flag: the node's allocation holds its first owner table (a new leaf's single
/// owner, or a split suffix's copy of the split node's), after the text.
const EMBEDDED: u32 = 1 << 31;

/// A new node's first owner table.
enum FirstOwners {
    /// None yet (set before publication).
    None,
    /// A separately allocated table handed to the node.
    Table(*mut Owners),
    /// A single owner `(slot, ts)`, in a table inside the node's allocation. Trade-off (as for
    /// [`FirstOwners::Room`]): while that table is current, lock-free raises write its
    /// timestamps at least 16 bytes past the end of the text, which can share a cache line
    /// with the text's end (or, for a short edge, the header) that readers load; a separate
    /// table can as well share a line with whatever the allocator placed next to it. In
    /// exchange: one allocation (and later one free) fewer per node. Measured on W1, neither
    /// layout is faster (`doc/performance-log.md`).
    Single(usize, u64),
    /// Room for a table of this shape inside the node's allocation, blank until its builder
    /// fills it (`NewNode::fill_owners_from`): a split's suffix, whose table is a copy of the
    /// split node's, known only under its lock. Only for shapes of at most [`ROOM_MAX_BYTES`]:
    /// the room stays (dead) inside the node once its table is superseded or if it is never
    /// filled. A split's prefix gets no room (see `PreparedSplit::new`).
    Room(Shape),
}

/// A tree node: header, then `len` bytes of UTF-8 edge text, then (for a node born a leaf, or
/// the suffix of a split) its first owner table, aligned.
///
/// The first membership word (tenant slots 0..63) is duplicated inline (`bits0`) so the common
/// read path (at most 64 tenants) never touches the owner table.
#[repr(C)]
pub(crate) struct Node {
    // Invariant: null (no children) or a `ChildTable` published with Release, all of whose
    // children are live nodes; replaced (or appended to in place, see `ChildTable::push`)
    // only through this node's `NodeLock`, the replaced table being retired (or, by a split,
    // handed to the suffix node that takes this node's place).
    children: AtomicPtr<ChildTable>,
    // Invariant: never null once published; an `Owners` table published with Release and
    // replaced only through this node's `NodeLock`; the replaced table is marked superseded
    // and retired, unless it is the table embedded in this node's allocation, which stays
    // there until the node is freed. Once replaced, the embedded table is never current again
    // (new tables are separate allocations). Before publication only, the node's builder may
    // fill its embedded table in place (`NewNode::fill_owners_from`).
    owners: AtomicPtr<Owners>,
    /// Word 0 of the current owner table's membership (slots 0..63), stored after each
    /// replacement. A reader may briefly see it one replacement ahead of or behind the table it
    /// loads; each is a valid membership of some moment.
    bits0: AtomicU64,
    /// The lock word: [`LOCKED`] | [`OBSOLETE`] | parent id (immutable while the node is
    /// linked: a split gives the replacement nodes the ids the children already name).
    state: AtomicU32,
    /// This node's id (its slot in the tree's slab); immutable.
    id: u32,
    /// Edge length in bytes, with the [`EMBEDDED`] flag in bit 31; immutable.
    len: u32,
    /// Length in chars, with the [`ASCII`] flag in bit 31.
    chars: u32,
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

// The node header budget: 40 bytes (text follows inline), with the lock word in it.
#[cfg(not(loom))]
const _: () = assert!(size_of::<Node>() == 40);
/// Largest owner table a split's suffix gets room for inside its allocation (one membership
/// word and up to 12 owners): a room stays in the node, dead, once its table is superseded, so
/// a large table is allocated separately and freed when superseded.
const ROOM_MAX_BYTES: usize = 112;

/// Alignment of an owner table (its header, words and timestamps).
const TABLE_ALIGN: usize = {
    let a = align_of::<Owners>();
    let a = if align_of::<u64>() > a {
        align_of::<u64>()
    } else {
        a
    };
    if align_of::<AtomicU64>() > a {
        align_of::<AtomicU64>()
    } else {
        a
    }
};
// An embedded owner table, at a multiple of `TABLE_ALIGN` from the node's start, is aligned.
const _: () = assert!(TABLE_ALIGN <= align_of::<Node>());

impl Node {
    /// The layout of a node with `len` bytes of text and an embedded owner table of
    /// `embedded` bytes (none if 0).
    fn layout(len: usize, embedded: usize) -> Layout {
        let size = if embedded == 0 {
            size_of::<Node>() + len
        } else {
            Self::embedded_off(len) + embedded
        };
        Layout::from_size_align(size, align_of::<Node>()).expect("node layout")
    }

    /// Offset of the embedded owner table in a node with `len` bytes of text.
    #[inline]
    fn embedded_off(len: usize) -> usize {
        (size_of::<Node>() + len).next_multiple_of(TABLE_ALIGN)
    }

    /// Has this node's allocation its first owner table inside?
    #[inline]
    fn is_embedded(&self) -> bool {
        self.len & EMBEDDED != 0
    }

    /// Where a node at `p` with `len` bytes of text keeps an embedded owner table.
    #[inline]
    fn embedded_at(p: *const Node, len: usize) -> *mut Owners {
        p.cast::<u8>()
            .wrapping_add(Self::embedded_off(len))
            .cast::<Owners>()
            .cast_mut()
    }

    /// The owner table inside this node's allocation (null if it has none), for comparisons.
    #[inline]
    fn embedded_owners(&self) -> *const Owners {
        if self.is_embedded() {
            Self::embedded_at(self, self.len())
        } else {
            ptr::null()
        }
    }

    /// Bytes of the embedded owner table (0 if none): its size is its own, immutable shape.
    fn embedded_bytes(&self) -> usize {
        // Safety: an embedded table is initialized when the node is built and stays allocated
        // (current or not) as long as the node; its shape never changes once the node is
        // shared (only an unpublished node's builder rewrites it, see
        // `NewNode::fill_owners_from`).
        unsafe { self.embedded_owners().as_ref() }.map_or(0, Owners::bytes)
    }

    /// Allocates a locked node with `text`, id `id`, parent `parent`, no children and the given
    /// first owners.
    fn alloc(text: &[u8], id: u32, parent: u32, first: FirstOwners) -> NonNull<Node> {
        let len = u32::try_from(text.len()).expect("edge length checked by the caller");
        debug_assert!(len & EMBEDDED == 0, "edges are shorter than 2^31 bytes");
        let chars = if crate::text::is_ascii(text) {
            len | ASCII
        } else {
            crate::text::char_count(text) as u32
        };
        let embedded = match first {
            FirstOwners::None | FirstOwners::Table(_) => 0,
            FirstOwners::Single(..) => Owners::SINGLE_SIZE,
            FirstOwners::Room(shape) => shape.size(),
        };
        let layout = Self::layout(text.len(), embedded);
        // Safety: the layout has non-zero size (the header is not empty).
        let p = unsafe { alloc(layout) }.cast::<Node>();
        let Some(p) = NonNull::new(p) else {
            handle_alloc_error(layout)
        };
        // The table and its first membership word (for the header's copy). The word of a
        // table written here is known without reading it back: the read would wait for the
        // store's cache miss on fresh memory (a fifth of this function's samples on W1 inserts).
        let (owners, bits0) = match first {
            FirstOwners::None => (ptr::null_mut(), 0),
            // Safety: a live table handed to this node.
            FirstOwners::Table(t) => (t, unsafe { &*t }.word(0)),
            FirstOwners::Single(slot, ts) => {
                let o = Self::embedded_at(p.as_ptr(), text.len());
                // Safety: the allocation has `Owners::SINGLE_SIZE` bytes at `embedded_off`
                // (`layout`), aligned for `Owners`, `u64` and `AtomicU64` (`TABLE_ALIGN`);
                // fresh.
                unsafe { Owners::init_single(o, slot, ts) };
                (o, if slot < 64 { 1u64 << slot } else { 0 })
            }
            FirstOwners::Room(shape) => {
                let o = Self::embedded_at(p.as_ptr(), text.len());
                // Safety: the allocation has `shape.size()` bytes at `embedded_off`
                // (`layout`), aligned as above; fresh.
                unsafe { Owners::init_blank(o, shape) };
                // A blank table has no owner yet.
                (o, 0)
            }
        };
        debug_assert!(
            // Safety: `owners`, if not null, was initialized above or handed over live.
            owners.is_null() || unsafe { &*owners }.word(0) == bits0,
            "the header's copy of the first word"
        );
        let len = if embedded > 0 { len | EMBEDDED } else { len };
        let header = Node {
            children: AtomicPtr::new(ptr::null_mut()),
            owners: AtomicPtr::new(owners),
            bits0: AtomicU64::new(bits0),
            state: AtomicU32::new(LOCKED | parent),
            id,
            len,
            chars,
            #[cfg(loom)]
            poison: Default::default(),
        };
        // Safety: `p` is a fresh allocation of `layout`, aligned for the header.
        unsafe { p.as_ptr().write(header) };
        let dst = p.as_ptr().cast::<u8>().wrapping_add(size_of::<Node>());
        // Safety: the allocation has room for `len` bytes right after the header (`dst`), and
        // `text` cannot overlap a fresh allocation.
        unsafe { ptr::copy_nonoverlapping(text.as_ptr(), dst, text.len()) };
        p
    }

    /// Frees a node and its current owner table (not its child table: a split hands it to the
    /// suffix node, and a pruned node has none). An embedded owner table, current or not, goes
    /// with the node's allocation.
    ///
    /// # Safety
    ///
    /// `p` came from [`Node::alloc`], no other thread can reach it, and it is freed once.
    unsafe fn destroy(p: *mut Node) {
        #[cfg(loom)]
        {
            // Under loom, poison instead of freeing: later reads through a stale pointer then
            // fail loudly (see `crate::sync::PoisonFlag`).
            // Safety: the caller guarantees `p` is a node that is still allocated.
            unsafe { (*p).poison.poison() };
        }
        #[cfg(not(loom))]
        {
            // Safety: by the caller's contract `p` is live and ours.
            let node = unsafe { &*p };
            let owners = node.owners.load(Ordering::Relaxed);
            // An embedded table goes with the node's allocation.
            if !owners.is_null() && !ptr::eq(owners, node.embedded_owners()) {
                // Safety: the owner table belongs to the node, which nobody else can reach.
                unsafe { Owners::destroy(owners) };
            }
            // Safety: as above.
            unsafe { Self::free_alone(p) };
        }
    }

    /// Frees only the node's own allocation.
    ///
    /// # Safety
    ///
    /// As for [`Node::destroy`]; its tables are freed or owned elsewhere.
    #[cfg(not(loom))]
    unsafe fn free_alone(p: *mut Node) {
        // Safety: `p` is live (caller's contract), so its header is readable.
        let node = unsafe { &*p };
        let layout = Self::layout(node.len(), node.embedded_bytes());
        // Safety: `p` was allocated with this layout and is dropped and freed once.
        unsafe {
            ptr::drop_in_place(p);
        }
        // Safety: as above.
        unsafe { dealloc(p.cast::<u8>(), layout) };
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
        let start = (self as *const Node)
            .cast::<u8>()
            .wrapping_add(size_of::<Node>());
        // Safety: the allocation holds `len` initialized bytes right after the header
        // (`start`), written once before the node was published and never modified.
        unsafe { std::slice::from_raw_parts(start, self.len()) }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        (self.len & !EMBEDDED) as usize
    }

    #[inline]
    pub(crate) fn chars(&self) -> usize {
        (self.chars & !ASCII) as usize
    }

    #[inline]
    pub(crate) fn is_ascii(&self) -> bool {
        self.chars & ASCII != 0
    }

    /// This node's id in the tree's slab.
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// The parent's id ([`NO_PARENT`] at the root). Immutable while the node is linked.
    #[inline]
    pub(crate) fn parent_id(&self) -> u32 {
        self.state.load(Ordering::Relaxed) & PARENT
    }

    /// Unlinked (pruned or replaced by a split)? Exact only for a holder of the parent's lock;
    /// otherwise a hint.
    #[inline]
    pub(crate) fn is_obsolete(&self) -> bool {
        // Acquire: pairs with the Release store of the mark in `NodeLock::make_obsolete`, so
        // a writer that sees the mark also sees the parent's new table.
        self.state.load(Ordering::Acquire) & OBSOLETE != 0
    }

    /// Takes this node's lock, waiting while another writer holds it; `None` if the node is
    /// obsolete (unlinked: the caller retries from a live ancestor).
    pub(crate) fn lock(&self) -> Option<NodeLock<'_>> {
        self.check();
        let mut spins = 0;
        loop {
            // Acquire: a caller that finds the node obsolete retries from the parent, whose new
            // table the unlinker published before the mark (Release in `make_obsolete`).
            let s = self.state.load(Ordering::Acquire);
            if s & OBSOLETE != 0 {
                return None;
            }
            if s & LOCKED == 0
                // Acquire: pairs with the Release of the previous holder's unlock, so its
                // table replacements are visible to this holder.
                && self
                    .state
                    .compare_exchange_weak(s, s | LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return Some(NodeLock {
                    node: self,
                    _not_send: PhantomData,
                });
            }
            crate::sync::spin_wait(&mut spins);
        }
    }

    /// The node's owners within `mask`, from one read: the inline word when the mask lies
    /// within slots 0..63 (no owner-table access), else the owner table.
    #[inline]
    pub(crate) fn owner_view<'g>(&'g self, mask: Mask<'_>, guard: &'g Guard) -> OwnerView<'g> {
        if mask.lo == 0 && mask.words.len() <= 1 {
            let w0 = mask.words.first().copied().unwrap_or(0);
            // Acquire: pairs with the Release store in `NodeLock::set_owners`.
            OwnerView::Word(self.bits0.load(Ordering::Acquire) & w0)
        } else {
            let o = self.owners(guard);
            OwnerView::Table(o, o.intersects(mask))
        }
    }

    /// The owner table, valid while `_guard` lives.
    #[inline]
    pub(crate) fn owners<'g>(&'g self, _guard: &'g Guard) -> &'g Owners {
        self.check();
        // Acquire: pairs with the Release in `NodeLock::set_owners` (or the node's publication),
        // so the table is initialized.
        let p = self.owners.load(Ordering::Acquire);
        debug_assert!(!p.is_null(), "owners of a node still being built");
        // Safety: never null once the node is published (field invariant); the only `&Node`s
        // of unpublished nodes are the builders' (`NewNode::node`), and no builder reads the
        // owners of a node it has not given owners yet.
        // A replaced table is retired through the epoch reclaimer after it was unlinked, so it
        // stays allocated while `_guard`, pinned before this load, lives; an embedded table is
        // part of this node, which the guard keeps allocated (see `Node::child_table`).
        let o = unsafe { &*p };
        o.check();
        o
    }

    /// The child table, if any, valid while `_guard` lives.
    #[inline]
    pub(crate) fn child_table<'g>(&'g self, _guard: &'g Guard) -> Option<&'g ChildTable> {
        self.check();
        // Acquire: pairs with the Release in `NodeLock::set_children` (or the publication of
        // the suffix node a split handed the table to).
        let p = self.children.load(Ordering::Acquire);
        // Safety: null or a published, initialized table that stays allocated until it is
        // retired after being replaced, i.e. while `_guard`, pinned before this load, lives.
        let t = unsafe { p.as_ref() };
        if let Some(t) = t {
            t.check();
        }
        t
    }

    /// The children (in no particular order), valid while `guard` lives.
    #[inline]
    pub(crate) fn children<'g>(&'g self, guard: &'g Guard) -> impl Iterator<Item = &'g Node> {
        self.child_table(guard)
            .into_iter()
            .flat_map(|t| t.iter().map(|(_, c)| c))
    }

    /// The child whose edge starts with the char keyed `key`, valid while `guard` lives.
    #[inline]
    pub(crate) fn child<'g>(&'g self, key: u32, guard: &'g Guard) -> Option<&'g Node> {
        self.child_table(guard)?.get(key)
    }

    /// Does tenant `slot` own a child of this node? Exact for a holder of this node's lock
    /// (children gain owners only under their parent's lock).
    pub(crate) fn slot_owns_a_child(&self, slot: usize, guard: &Guard) -> bool {
        self.children(guard).any(|c| c.owners(guard).contains(slot))
    }

    /// Heap bytes of this node's own allocation (with its embedded owner table, if any).
    pub(crate) fn bytes(&self) -> usize {
        Self::layout(self.len(), self.embedded_bytes()).size()
    }

    /// Heap bytes of this node with its current owner table `o`: the allocation, plus the table
    /// unless it is the embedded one.
    pub(crate) fn bytes_with(&self, o: &Owners) -> usize {
        if ptr::eq(o, self.embedded_owners()) {
            self.bytes()
        } else {
            self.bytes() + o.bytes()
        }
    }
}

impl Retire for Node {
    fn heap_bytes(&self) -> usize {
        // A retired node is freed with its current owner table (see `Node::destroy`).
        let o = self.owners.load(Ordering::Acquire);
        // Safety: a retired node still owns its (non-null) owner table until it is destroyed.
        unsafe { o.as_ref() }.map_or(self.bytes(), |o| self.bytes_with(o))
    }

    unsafe fn destroy(p: *mut Self) {
        // Safety: forwarded to the caller (`Retire::destroy`'s contract is `Node::destroy`'s).
        unsafe { Node::destroy(p) }
    }
}

/// A held node lock: the only handle through which a node's tables are replaced. Dropping it
/// unlocks the node (unless it was made obsolete).
pub(crate) struct NodeLock<'a> {
    node: &'a Node,
    /// Locks are released by the thread that took them (keeps the API honest; not required
    /// by the protocol).
    _not_send: PhantomData<*const ()>,
}

impl Drop for NodeLock<'_> {
    fn drop(&mut self) {
        // Only the holder writes a locked word (waiters' CASes expect it unlocked and fail),
        // so this Relaxed load is its own last write and a plain store unlocks: no locked
        // instruction. Release: publishes this holder's table replacements to the next holder
        // (whose lock Acquires it).
        let s = self.node.state.load(Ordering::Relaxed);
        debug_assert!(s & LOCKED != 0);
        self.node.state.store(s & !LOCKED, Ordering::Release);
    }
}

impl<'a> NodeLock<'a> {
    /// The locked node.
    #[inline]
    pub(crate) fn node(&self) -> &'a Node {
        self.node
    }

    /// Publishes `new` as the node's owner table and retires the old one.
    pub(crate) fn set_owners(&self, new: NewOwners, store: &Store, guard: &Guard) {
        let new = new.into_raw();
        let old = self.node.owners.load(Ordering::Relaxed);
        // Release: a reader that Acquire-loads the pointer sees the table's contents.
        self.node.owners.store(new, Ordering::Release);
        // Safety: `new` is live: we just published it and only a later holder of this lock
        // can retire it.
        let w0 = unsafe { &*new }.word(0);
        // Release: pairs with the Acquire load in `owner_view`.
        self.node.bits0.store(w0, Ordering::Release);
        // An embedded table stays (superseded) in the node's allocation until the node is
        // freed; readers that loaded it are pinned, which keeps the node alive.
        if !ptr::eq(old, self.node.embedded_owners()) {
            // Safety: `old` was the published table (never null for a published node) and is
            // now unlinked: only this lock's holder replaces it, so it is retired exactly
            // once; readers that loaded it are pinned and keep it alive.
            unsafe { store.retirer.retire(guard, old) };
        }
    }

    /// Publishes `new` as the node's child table (`None`: no children) and retires the old.
    fn set_children(&self, new: Option<NewChildTable>, store: &Store, guard: &Guard) {
        let new = new.map_or(ptr::null_mut(), NewChildTable::into_raw);
        // Only this lock's holder replaces the table: a load and a store, not a locked swap.
        let old = self.node.children.load(Ordering::Relaxed);
        // Release: readers that Acquire-load the table see its keys and child pointers.
        self.node.children.store(new, Ordering::Release);
        if !old.is_null() {
            // Safety: `old` is unlinked by the store; only this lock's holder replaces it, so
            // it is retired exactly once.
            unsafe { store.retirer.retire(guard, old) };
        }
    }

    /// Links the unpublished `leaf` as a new child (whose key the node has no child for) and
    /// returns the leaf's lock (it is born locked; dropping the lock unlocks it).
    pub(crate) fn add_child<'g>(
        &self,
        mut leaf: NewNode,
        store: &Store,
        guard: &'g Guard,
    ) -> NodeLock<'g>
    where
        'a: 'g,
    {
        let key = crate::text::edge_key(leaf.node().text());
        let old = self.node.child_table(guard);
        debug_assert!(old.is_none_or(|t| t.find(key).is_none()), "duplicate key");
        leaf.set_parent(self.node.id);
        let leaf = leaf.into_raw();
        // In place if the table has room (no copy, nothing to retire), else a grown copy.
        // Safety: we hold this node's lock, its table has no child keyed `key`, and `leaf` is
        // a fully built node whose edge starts with that char.
        if !old.is_some_and(|t| unsafe { t.push(key, leaf) }) {
            let table = NewChildTable::with_inserted(old, key, leaf);
            self.set_children(Some(table), store, guard);
        }
        // Safety: published just above; live while `guard` lives (see below).
        store.slab.set(unsafe { &*leaf }.id, leaf);
        // Safety: `leaf` is now published in this node's child table; a linked node is freed
        // only after a grace period that `guard` delays, so it is live for `'g`.
        let leaf = unsafe { &*leaf };
        NodeLock {
            node: leaf,
            _not_send: PhantomData,
        }
    }

    /// Installs `children` (unpublished subtrees, edge keys strictly ascending) as this node's
    /// children, replacing none (the node has no children): a restore, before the tree is
    /// shared.
    pub(crate) fn install_children(&self, children: Vec<NewNode>, store: &Store, guard: &Guard) {
        debug_assert!(self.node.child_table(guard).is_none());
        let mut holder = NewNode {
            ptr: NonNull::from(self.node),
            owns_subtree: false,
        };
        holder.adopt_children(children, store);
        let table = holder
            .node()
            .children
            .swap(ptr::null_mut(), Ordering::Relaxed);
        // The holder only borrowed this (published) node: never free it.
        std::mem::forget(holder);
        if !table.is_null() {
            // Release: readers that Acquire-load the table see the whole subtree.
            self.node.children.store(table, Ordering::Release);
        }
    }

    /// Unlinks `child` (locked, owner-less, without children) and retires it; the child's
    /// lock is consumed and never released (the node is obsolete).
    pub(crate) fn remove_child(&self, child: NodeLock<'_>, store: &Store, guard: &Guard) {
        let c = child.node;
        debug_assert!(c.child_table(guard).is_none(), "pruned nodes are leaves");
        let key = crate::text::edge_key(c.text());
        let old = self
            .node
            .child_table(guard)
            .expect("a locked parent lists its child");
        let (table, raw) = NewChildTable::without(old, key);
        debug_assert!(ptr::eq(raw, c), "the key names this child");
        self.set_children(table, store, guard);
        let id = c.id;
        child.make_obsolete();
        // The slab must not name the node once it is retired.
        store.slab.release(id);
        // Safety: `raw` (loaded from the table, with the allocation's provenance) is unlinked
        // now: the new table does not list it and it is obsolete, so no writer reaches it
        // either; it is retired once, here.
        unsafe { store.retirer.retire(guard, raw) };
    }

    /// Splits `child` (locked, a child of this node) after the edge prefix `nodes` were made
    /// for: a new prefix node takes its place with the child's owners (plus `add`, a
    /// `(slot, ts)` the split is made for), the suffix keeps the child's owners and takes its
    /// children, and `leaf` (if any) becomes the prefix's second child. The child's owner table
    /// is copied once, after marking it superseded, so both halves get the same times. Returns
    /// the locks of the new prefix, suffix and leaf (all born locked) and whether `add`'s slot
    /// is new on the prefix. The old child is made obsolete and retired.
    pub(crate) fn split_child<'g>(
        &self,
        child: NodeLock<'g>,
        nodes: PreparedSplit,
        add: Option<(usize, u64)>,
        leaf: Option<NewNode>,
        store: &Store,
        guard: &'g Guard,
    ) -> SplitLocks<'g>
    where
        'a: 'g,
    {
        let c = child.node;
        let edge = c.text();
        let at = nodes.prefix.node().len();
        debug_assert!(at > 0 && at < edge.len() && nodes.matches(edge, at));
        let PreparedSplit {
            prefix: mut p,
            suffix: mut s,
        } = nodes;
        // The owner tables of the two halves, after marking the child's superseded (see
        // `NewOwners::with`): the suffix's a plain copy, the prefix's with `add`. The child's
        // times are read once, into the suffix's table, and the prefix's is built from that
        // unpublished copy: a lock-free raise landing on the child's table between two reads
        // could otherwise give the suffix a later time than its prefix, and a tenant's time on
        // a node is never later than on its parent (eviction takes the oldest times first).
        let old = c.owners(guard);
        old.mark_superseded();
        s.fill_owners_from(old, None);
        let newly = p.fill_owners_from(s.owners(), add);
        s.set_parent(p.node().id);
        // The suffix takes over the child's children: a plain pointer hand-over, as the child
        // becomes obsolete below and its destructor never frees a child table. Relaxed: the
        // suffix is published only through the prefix's table, which the swap below publishes
        // with Release.
        let kids = c.children.load(Ordering::Acquire);
        s.node().children.store(kids, Ordering::Relaxed);
        p.set_parent(self.node.id);
        let (p_id, s_id) = (p.node().id, s.node().id);
        let s = s.into_raw();
        let mut entries = [
            (crate::text::edge_key(&edge[at..]), s),
            (0, ptr::null_mut()),
        ];
        let leaf = leaf.map(|mut l| {
            l.set_parent(p.node().id);
            let key = crate::text::edge_key(l.node().text());
            let l = l.into_raw();
            entries[1] = (key, l);
            l
        });
        let n = 1 + usize::from(leaf.is_some());
        entries[..n].sort_unstable_by_key(|e| e.0);
        p.set_children(NewChildTable::with_room(&entries[..n]));
        let p = p.into_raw();
        let table = self
            .node
            .child_table(guard)
            .expect("a locked parent lists its child");
        // Safety: we hold this node's lock (the only writer of its table's slots), and `p` is
        // a fully built node whose edge starts with the same char as the child's.
        let old = unsafe { table.swap_child(crate::text::edge_key(edge), p) }
            .expect("the child is listed");
        debug_assert!(ptr::eq(old, c));
        // The slab names the new nodes before the old one is obsolete (a writer that finds it
        // obsolete then finds its replacement by id) and before it is retired (a reader of the
        // slab pinned after the retirement must not find it).
        store.slab.set(p_id, p);
        store.slab.set(s_id, s);
        if let Some(l) = leaf {
            // Safety: published in the prefix's table; live while `guard` lives.
            store.slab.set(unsafe { &*l }.id, l);
        }
        child.make_obsolete();
        // Safety: `old` (with the allocation's provenance) is unlinked: the slot now holds the
        // prefix, and it is obsolete; retired once, here. Its child table now belongs to the
        // suffix, and `Node::destroy` never frees a child table.
        unsafe { store.retirer.retire(guard, old) };
        let lock = |n: *mut Node| NodeLock {
            // Safety: published just above (the prefix in our table, the suffix and the leaf
            // in the prefix's); a linked node is freed only after a grace period that `guard`
            // delays, so it is live for `'g`.
            node: unsafe { &*n },
            _not_send: PhantomData,
        };
        // The suffix is complete: unlock it. From now on only its lock holders change the child
        // table it took over (the old child is obsolete and never unlocked again); this
        // unlock (Release) orders the table's earlier appends, made under the old child's
        // lock, before those of its next holder (Acquire). This function touches the suffix
        // no more.
        drop(lock(s));
        SplitLocks {
            prefix: lock(p),
            leaf: leaf.map(lock),
            newly,
        }
    }

    /// Marks the node obsolete (unlinked) and keeps it locked forever.
    fn make_obsolete(self) {
        // The holder is the word's only writer (see `NodeLock::drop`). Release: a writer that
        // Acquire-loads the mark also sees the parent's new table.
        let s = self.node.state.load(Ordering::Relaxed);
        self.node.state.store(s | OBSOLETE, Ordering::Release);
        std::mem::forget(self);
    }
}

/// What [`NodeLock::split_child`] built: the new prefix and leaf, still locked.
pub(crate) struct SplitLocks<'g> {
    /// The prefix node (in the split node's place).
    pub(crate) prefix: NodeLock<'g>,
    /// The new leaf, if one was added.
    pub(crate) leaf: Option<NodeLock<'g>>,
    /// The slot the split was made for is a new owner of the prefix.
    pub(crate) newly: bool,
}

/// An allocated node not yet linked into the tree, exclusively owned; freed (with its owner
/// table) on drop unless published.
pub(crate) struct NewNode {
    ptr: NonNull<Node>,
    /// The node's child table and the subtree under it belong to this handle (a subtree
    /// being restored): freed with it if it is dropped unpublished.
    owns_subtree: bool,
}

// Safety: an unpublished node is plain owned data (atomics and bytes).
unsafe impl Send for NewNode {}

impl NewNode {
    /// A locked node holding a copy of `text` (valid UTF-8 shorter than 2^31 bytes) with id
    /// `id`, and owners if given.
    pub(crate) fn new(text: &[u8], id: u32, owners: Option<NewOwners>) -> Self {
        let first = owners.map_or(FirstOwners::None, |o| FirstOwners::Table(o.into_raw()));
        Self {
            ptr: Node::alloc(text, id, NO_PARENT, first),
            owns_subtree: false,
        }
    }

    /// A new leaf: a locked node holding a copy of `text` (as for [`Self::new`]) with id `id`
    /// and the single owner `slot` at `ts`, whose table is part of the node's allocation.
    pub(crate) fn leaf(text: &[u8], id: u32, slot: usize, ts: u64) -> Self {
        Self {
            ptr: Node::alloc(text, id, NO_PARENT, FirstOwners::Single(slot, ts)),
            owns_subtree: false,
        }
    }

    /// A locked node holding a copy of `text` (as for [`Self::new`]) with id `id` and, inside
    /// its allocation, room for a copy of the owner table `old` if that is small (at most
    /// [`ROOM_MAX_BYTES`]): a blank table of that shape, which [`Self::fill_owners_from`]
    /// fills. Without room, the node gets a separate table then.
    fn with_room_for(text: &[u8], id: u32, old: &Owners) -> Self {
        let shape = Owners::shape_from(old, None);
        let first = if shape.size() <= ROOM_MAX_BYTES {
            FirstOwners::Room(shape)
        } else {
            FirstOwners::None
        };
        Self {
            ptr: Node::alloc(text, id, NO_PARENT, first),
            owns_subtree: false,
        }
    }

    /// Gives the node a copy of `old` plus `add` (see `Owners::init_from`, which reads `old`'s
    /// times once): written over its embedded table if that is its current one and has this
    /// table's shape, else a new table. Returns whether `add`'s slot is new.
    fn fill_owners_from(&mut self, old: &Owners, add: Option<(usize, u64)>) -> bool {
        let n = self.node();
        let emb = if n.is_embedded() {
            Node::embedded_at(self.ptr.as_ptr(), n.len())
        } else {
            ptr::null_mut()
        };
        let shape = Owners::shape_from(old, add);
        // Safety: a non-null embedded table is initialized and part of the node (see
        // `Node::embedded_bytes`).
        let fits = unsafe { emb.as_ref() }.is_some_and(|e| Shape::of(e) == shape);
        if !fits || !ptr::eq(n.owners.load(Ordering::Relaxed), emb) {
            let (table, added) = NewOwners::copy_of(old, add);
            self.set_owners(table);
            return added;
        }
        // Safety: the node is unpublished, so its current, embedded table is ours alone, and
        // initialized; it is initialized anew just below, before anything reads it.
        unsafe { Owners::drop_contents(emb) };
        // Safety: the embedded table's room has the shape's size (checked above), aligned at
        // `embedded_off` (`TABLE_ALIGN`); its old contents were dropped; unpublished.
        let added = unsafe { Owners::init_from(emb, old, add) };
        // Safety: just initialized, owned by the node.
        n.bits0.store(unsafe { &*emb }.word(0), Ordering::Relaxed);
        added
    }

    /// The owner table of this unpublished node, which must have one.
    fn owners(&self) -> &Owners {
        let p = self.node().owners.load(Ordering::Relaxed);
        debug_assert!(!p.is_null());
        // Safety: a table set by this node's builder (never null once set), owned by the
        // unpublished node, which nobody else can reach: it lives while `self` is borrowed.
        unsafe { &*p }
    }

    /// Builds an unpublished subtree (a restore, with the tree exclusively owned): links
    /// `children` (unpublished, edge keys strictly ascending) under this node, registers them
    /// in the slab and unlocks them. The subtree is freed with this handle unless published.
    pub(crate) fn adopt_children(&mut self, children: Vec<NewNode>, store: &Store) {
        debug_assert!(self.node().children.load(Ordering::Relaxed).is_null());
        if children.is_empty() {
            return;
        }
        let id = self.node().id;
        let entries: Vec<(u32, *mut Node)> = children
            .into_iter()
            .map(|mut c| {
                // Unlocked with its parent set: nobody else can reach it before publication.
                c.node().state.store(id, Ordering::Relaxed);
                c.owns_subtree = false;
                let key = crate::text::edge_key(c.node().text());
                let cid = c.node().id;
                // The subtree now belongs to this node's table (freed through it on drop).
                let p = c.into_raw_subtree();
                store.slab.set(cid, p);
                (key, p)
            })
            .collect();
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        self.set_children(NewChildTable::from_sorted(&entries));
        self.owns_subtree = true;
    }

    /// [`Self::into_raw`] for a node whose subtree is handed over with it.
    fn into_raw_subtree(self) -> *mut Node {
        let p = self.ptr.as_ptr();
        std::mem::forget(self);
        p
    }

    /// The node (not yet shared).
    pub(crate) fn node(&self) -> &Node {
        // Safety: exclusively owned and live.
        unsafe { self.ptr.as_ref() }
    }

    /// Sets the parent id (before publication).
    pub(crate) fn set_parent(&mut self, parent: u32) {
        debug_assert!(parent <= NO_PARENT);
        self.node().state.store(LOCKED | parent, Ordering::Relaxed);
    }

    /// Sets the owner table, freeing a previous one.
    pub(crate) fn set_owners(&mut self, owners: NewOwners) {
        let n = self.node();
        let new = owners.into_raw();
        // Not shared yet: a load and a store, not a locked swap.
        let old = n.owners.load(Ordering::Relaxed);
        n.owners.store(new, Ordering::Relaxed);
        // Safety: `new` is live and now owned by the node.
        n.bits0.store(unsafe { &*new }.word(0), Ordering::Relaxed);
        if !old.is_null() && !ptr::eq(old, n.embedded_owners()) {
            // Safety: the previous table was owned by this unpublished node alone.
            unsafe { Owners::destroy(old) };
        }
    }

    /// Sets the child table (before publication; the node had none).
    fn set_children(&mut self, table: NewChildTable) {
        let children = &self.node().children;
        debug_assert!(children.load(Ordering::Relaxed).is_null());
        // Not shared yet.
        children.store(table.into_raw(), Ordering::Relaxed);
    }

    /// Hands the node over for publication: the caller links it (with a Release store) and
    /// from then on retires, never frees, it.
    fn into_raw(self) -> *mut Node {
        debug_assert!(!self.node().owners.load(Ordering::Relaxed).is_null());
        let p = self.ptr.as_ptr();
        std::mem::forget(self);
        p
    }
}

impl Drop for NewNode {
    fn drop(&mut self) {
        if self.owns_subtree {
            // Safety: never published, so the node and the subtree it adopted are exclusively
            // ours and freed once, here.
            unsafe { free_tree(self.ptr) };
        } else {
            // Safety: never published, so exclusively ours; its owner table (if any) is its
            // own, and a child table it may hold (a split's suffix, about to be published) is
            // not freed by `Node::destroy`.
            unsafe { Node::destroy(self.ptr.as_ptr()) };
        }
    }
}

/// The two nodes of a split, allocated and filled with text before any lock is taken.
pub(crate) struct PreparedSplit {
    prefix: NewNode,
    suffix: NewNode,
}

impl PreparedSplit {
    /// Nodes for splitting an edge `edge` after `at` bytes (see [`NodeLock::split_child`]);
    /// the prefix gets id `prefix_id`, the suffix `suffix_id`. `owners` is the split node's
    /// owner table as last seen: the suffix gets room for its copy inside its allocation (if
    /// small), which the split fills if the table keeps its shape.
    ///
    /// The prefix gets a separate table (allocated under the lock): it is where the split's
    /// tenant attaches, and an upper node goes on gaining owners, each superseding its table;
    /// room inside it would mostly end up dead. On a W1 build, room in both nodes left 63 KB
    /// of dead tables in 1,988 nodes, 1,975 of them prefixes', and put the tree's heap at
    /// 1.535 × its text (over the 1.5 budget); with room in the suffix only, 13 nodes hold a
    /// dead table.
    pub(crate) fn new(
        edge: &[u8],
        at: usize,
        prefix_id: u32,
        suffix_id: u32,
        owners: &Owners,
    ) -> Self {
        Self {
            prefix: NewNode::new(&edge[..at], prefix_id, None),
            suffix: NewNode::with_room_for(&edge[at..], suffix_id, owners),
        }
    }

    /// The edge these nodes were made for.
    pub(crate) fn matches(&self, edge: &[u8], at: usize) -> bool {
        self.prefix.node().text() == &edge[..at] && self.suffix.node().text() == &edge[at..]
    }
}

/// The root of a new tree: an empty edge with an empty owner table, id 0, unlocked.
pub(crate) fn new_root() -> NonNull<Node> {
    let root = NewNode::new(b"", 0, Some(NewOwners::empty()));
    let p = root.into_raw();
    // Safety: fresh and exclusively ours; unlock it (nodes are born locked).
    unsafe { &*p }.state.store(NO_PARENT, Ordering::Relaxed);
    // Safety: `into_raw` never returns null.
    unsafe { NonNull::new_unchecked(p) }
}

/// Frees every node reachable from `root`, with their tables.
///
/// # Safety
///
/// The caller owns the tree exclusively (its `Drop`): no other thread can reach any of its
/// nodes, and each reachable node and table is freed exactly once here (retired ones are no
/// longer reachable and belong to the reclaimer).
pub(crate) unsafe fn free_tree(root: NonNull<Node>) {
    let mut stack = vec![root.as_ptr()];
    while let Some(p) = stack.pop() {
        // Safety: reachable, hence live and exclusively ours (caller's contract).
        let ct = unsafe { &*p }.children.load(Ordering::Relaxed);
        // Safety: as above, for the node's child table.
        if let Some(t) = unsafe { ct.as_ref() } {
            stack.extend(t.raw_iter().map(|(_, c)| c));
            // Safety: the table is reachable only from this node, freed once here.
            unsafe { ChildTable::destroy(ct) };
        }
        // Safety: the node and its owner table are freed once here.
        unsafe { Node::destroy(p) };
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A split node's room is filled in place when the table it was made for kept its shape
    /// (whatever its owners and times now), and a separate table is used when it changed.
    #[test]
    fn a_split_node_uses_its_room_only_for_a_table_of_its_shape() {
        let seen = Owners::alloc(&[(3, 1), (9, 2)]);
        let same_shape = Owners::alloc(&[(4, 5), (60, 6)]);
        let grown = Owners::alloc(&[(3, 1), (9, 2), (70, 7)]);
        // Safety: fresh tables, not shared; freed at the end of this test.
        let seen_t = unsafe { &*seen };
        // Safety: as above.
        let same_t = unsafe { &*same_shape };
        // Safety: as above.
        let grown_t = unsafe { &*grown };
        for (now, add, want, inside) in [
            (same_t, None, vec![(4, 5), (60, 6)], true),
            (same_t, Some((4, 9)), vec![(4, 9), (60, 6)], true),
            (grown_t, None, vec![(3, 1), (9, 2), (70, 7)], false),
        ] {
            let mut n = NewNode::with_room_for(b"text", 7, seen_t);
            let room = n.node().bytes();
            let added = n.fill_owners_from(now, add);
            assert!(!added);
            let o = n.owners();
            assert_eq!(o.entries(), want);
            assert_eq!(n.node().bits0.load(Ordering::Relaxed), o.word(0));
            assert_eq!(n.node().bytes(), room, "the node's allocation is unchanged");
            let current_inside = ptr::eq(o, n.node().embedded_owners());
            assert_eq!(current_inside, inside, "{want:?}");
            assert_eq!(n.node().bytes_with(o) == room, inside);
        }
        // A new owner changes the shape: a separate table.
        let mut n = NewNode::with_room_for(b"text", 7, seen_t);
        assert!(n.fill_owners_from(seen_t, Some((5, 4))));
        assert_eq!(n.owners().entries(), vec![(3, 1), (5, 4), (9, 2)]);
        assert!(!ptr::eq(n.owners(), n.node().embedded_owners()));
        drop(n);
        for t in [seen, same_shape, grown] {
            // Safety: as above; freed once, here.
            unsafe { Owners::destroy(t) };
        }
    }

    /// The nodes of a split match exactly the edge and split point they were made for.
    #[test]
    fn a_prepared_split_matches_only_its_own_edge_and_point() {
        let t = Owners::alloc(&[(3, 1)]);
        // Safety: a fresh table, not shared; freed at the end of this test.
        let owners = unsafe { &*t };
        let split = PreparedSplit::new(b"hello world", 5, 1, 2, owners);
        assert!(split.matches(b"hello world", 5));
        assert!(!split.matches(b"hello there", 5), "another suffix");
        assert!(!split.matches(b"jello world", 5), "another prefix");
        assert!(!split.matches(b"hello world", 6), "another point");
        drop(split);
        // Safety: as above; freed once, here.
        unsafe { Owners::destroy(t) };
    }

    /// A node is born locked, with no parent yet (`NO_PARENT`); the largest id fits the lock
    /// word's parent field beside the flags, and is not `NO_PARENT`: a node may have it as its
    /// parent.
    #[test]
    fn a_new_node_is_locked_and_the_largest_id_can_be_its_parent() {
        let mut n = NewNode::leaf(b"x", 1, 0, 1);
        assert_eq!(n.node().state.load(Ordering::Relaxed), LOCKED | NO_PARENT);
        assert_eq!(n.node().parent_id(), NO_PARENT);
        n.set_parent(MAX_NODE_ID);
        assert_eq!(n.node().state.load(Ordering::Relaxed), LOCKED | MAX_NODE_ID);
        assert_eq!(n.node().parent_id(), MAX_NODE_ID);
        assert_ne!(n.node().parent_id(), NO_PARENT);
        assert!(!n.node().is_obsolete());
    }
}
