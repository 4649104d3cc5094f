//! The raw core of the tree: node, owner-table and child-table layouts, node locks, and every
//! raw dereference the tree makes.
//!
//! Every object here is one heap allocation with a fixed header followed by a variable-length
//! tail. Nodes and tables are published with `Release` stores and read with `Acquire` loads
//! while the reader holds an epoch guard; once replaced or unlinked they are retired through
//! [`crate::reclaim`]. The edge text of a node and the membership (bits) of an owner table are
//! immutable after publication; only per-owner timestamps are mutated in place (monotone
//! `fetch_max`), and a child slot is swapped in place when the child is split.
//!
//! # Writers: per-node locks
//!
//! Each node has a lock word ([`Node::lock`]). A node's owner table and child table are replaced
//! only by the holder of its lock, through a [`NodeLock`]; that is the only way to publish
//! anything, so the type system carries the rule. A node that is unlinked (pruned, or replaced
//! by a split) is marked *obsolete* while locked and is never unlocked again: a writer that was
//! waiting for it sees the mark and retries from a live ancestor (optimistic lock coupling, as
//! in ART/congee). Readers never look at the lock word.
//!
//! # Guards and lifetimes
//!
//! Accessors that follow a pointer take the caller's epoch guard and return references bounded
//! by it: `fn owners<'g>(&'g self, guard: &'g Guard) -> &'g Owners`. A `&Node` or a
//! `&ChildTable` is itself only ever obtained under a guard (or with the tree exclusively
//! owned), so the objects it names stay allocated for as long as the reference.

use super::slab::Store;
use crate::reclaim::{Guard, Retire};
use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
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

/// A tree node: header followed by `len` bytes of UTF-8 edge text.
///
/// The first membership word (tenant slots 0..63) is duplicated inline (`bits0`) so the common
/// read path (at most 64 tenants) never touches the owner table.
#[repr(C)]
pub(crate) struct Node {
    // Invariant: null (no children) or a `ChildTable` published with Release, all of whose
    // children are live nodes; replaced only through this node's `NodeLock`, the replaced table
    // being retired (or, by a split, handed to the suffix node that takes this node's place).
    children: AtomicPtr<ChildTable>,
    // Invariant: never null once published; an `Owners` table published with Release and
    // replaced only through this node's `NodeLock`; the replaced table is marked superseded
    // and retired.
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
    len: u32,
    /// Length in chars, with the [`ASCII`] flag in bit 31.
    chars: u32,
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
}

// The node header budget: 40 bytes (text follows inline), with the lock word in it.
#[cfg(not(loom))]
const _: () = assert!(size_of::<Node>() == 40);

impl Node {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(size_of::<Node>() + len, align_of::<Node>()).expect("node layout")
    }

    /// Allocates a locked node with `text`, id `id`, parent `parent`, no children and the given
    /// owners (`None`: no owner table yet).
    fn alloc(text: &[u8], id: u32, parent: u32, owners: *mut Owners) -> NonNull<Node> {
        let len = u32::try_from(text.len()).expect("edge length checked by the caller");
        let chars = if text.is_ascii() {
            len | ASCII
        } else {
            crate::text::char_count(text) as u32
        };
        let layout = Self::layout(text.len());
        // Safety: the layout has non-zero size (the header is not empty).
        let p = unsafe { alloc(layout) }.cast::<Node>();
        let Some(p) = NonNull::new(p) else {
            handle_alloc_error(layout)
        };
        let header = Node {
            children: AtomicPtr::new(ptr::null_mut()),
            owners: AtomicPtr::new(owners),
            bits0: AtomicU64::new(if owners.is_null() {
                0
            } else {
                // Safety: a non-null `owners` is a live table handed to this node.
                unsafe { &*owners }.word(0)
            }),
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
    /// suffix node, and a pruned node has none).
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
            let owners = unsafe { &*p }.owners.load(Ordering::Relaxed);
            if !owners.is_null() {
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
        let layout = Self::layout(unsafe { &*p }.len as usize);
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
        // Safety: the allocation holds `len` initialized bytes right after the header (`start`),
        // written once before the node was published and never modified.
        unsafe { std::slice::from_raw_parts(start, self.len as usize) }
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
        // Acquire: pairs with the Release that published the mark (the unlock of the parent).
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
        // stays allocated while `_guard`, pinned before this load, lives.
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

    /// The children, in key order, valid while `guard` lives.
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

    /// Heap bytes of this node's own allocation.
    pub(crate) fn bytes(&self) -> usize {
        Self::layout(self.len()).size()
    }
}

impl Retire for Node {
    fn heap_bytes(&self) -> usize {
        // A retired node is freed with its current owner table (see `Node::destroy`).
        let o = self.owners.load(Ordering::Acquire);
        // Safety: a retired node still owns its (non-null) owner table until it is destroyed.
        self.bytes() + unsafe { o.as_ref() }.map_or(0, Owners::bytes)
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
        // Release: publishes this holder's table replacements to the next holder (whose lock
        // Acquires) and the obsolete mark to writers that load the state.
        self.node.state.fetch_and(!LOCKED, Ordering::Release);
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
        // Safety: `old` was the published table (never null for a published node) and is
        // now unlinked: only this lock's holder replaces it, so it is retired exactly once;
        // readers that loaded it are pinned and keep it alive.
        unsafe { store.retirer.retire(guard, old) };
    }

    /// Publishes `new` as the node's child table (`None`: no children) and retires the old.
    fn set_children(&self, new: Option<NewChildTable>, store: &Store, guard: &Guard) {
        let new = new.map_or(ptr::null_mut(), NewChildTable::into_raw);
        // Release: readers that Acquire-load the table see its keys and child pointers.
        let old = self.node.children.swap(new, Ordering::AcqRel);
        if !old.is_null() {
            // Safety: `old` is unlinked by the swap; only this lock's holder replaces it, so
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
        let table = NewChildTable::with_inserted(old, key, leaf);
        self.set_children(Some(table), store, guard);
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
        let entries = c.owners(guard).supersede();
        let (prefix_owners, newly) = match add {
            Some((slot, ts)) => NewOwners::with_entry(entries.as_slice(), slot, ts),
            None => (NewOwners::from_entries(entries.as_slice()), false),
        };
        s.set_owners(NewOwners::from_entries(entries.as_slice()));
        s.set_parent(p.node().id);
        // The suffix takes over the child's children: a plain pointer hand-over, as the child
        // becomes obsolete below and its destructor never frees a child table. Relaxed: the
        // suffix is published only through the prefix's table, which the swap below publishes
        // with Release.
        let kids = c.children.load(Ordering::Acquire);
        s.node().children.store(kids, Ordering::Relaxed);
        p.set_owners(prefix_owners);
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
        p.set_children(NewChildTable::from_sorted(&entries[..n]));
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
        // The suffix's writers lock its parent (the prefix) first, which stays locked: the
        // suffix's own lock is not needed any more.
        drop(lock(s));
        SplitLocks {
            prefix: lock(p),
            leaf: leaf.map(lock),
            newly,
        }
    }

    /// Marks the node obsolete (unlinked) and keeps it locked forever.
    fn make_obsolete(self) {
        // Release: a writer that Acquire-loads the mark also sees the parent's new table.
        self.node.state.fetch_or(OBSOLETE, Ordering::Release);
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
        let owners = owners.map_or(ptr::null_mut(), NewOwners::into_raw);
        Self {
            ptr: Node::alloc(text, id, NO_PARENT, owners),
            owns_subtree: false,
        }
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
        let old = n.owners.swap(new, Ordering::Relaxed);
        // Safety: `new` is live and now owned by the node.
        n.bits0.store(unsafe { &*new }.word(0), Ordering::Relaxed);
        if !old.is_null() {
            // Safety: the previous table was owned by this unpublished node alone.
            unsafe { Owners::destroy(old) };
        }
    }

    /// Sets the child table (before publication; the node had none).
    fn set_children(&mut self, table: NewChildTable) {
        let old = self
            .node()
            .children
            .swap(table.into_raw(), Ordering::Relaxed);
        debug_assert!(old.is_null());
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
    /// Nodes for splitting an edge `edge` after `at` bytes; the prefix gets id `prefix_id`,
    /// the suffix `suffix_id`.
    pub(crate) fn new(edge: &[u8], at: usize, prefix_id: u32, suffix_id: u32) -> Self {
        Self {
            prefix: NewNode::new(&edge[..at], prefix_id, None),
            suffix: NewNode::new(&edge[at..], suffix_id, None),
        }
    }

    /// The edge these nodes were made for.
    pub(crate) fn matches(&self, edge: &[u8], at: usize) -> bool {
        self.prefix.node().text() == &edge[..at] && self.suffix.node().text() == &edge[at..]
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
    fn alloc(entries: &[(u32, u64)]) -> *mut Owners {
        let n = entries.len();
        let (lo, nwords) = match (entries.first(), entries.last()) {
            (Some(f), Some(l)) => {
                let lo = f.0 as usize / 64;
                (lo, l.0 as usize / 64 + 1 - lo)
            }
            _ => (0, 0),
        };
        let lo16 = u16::try_from(lo).expect("tenant slots are bounded");
        let nwords16 = u16::try_from(nwords).expect("tenant slots are bounded");
        let (layout, bits_off, ts_off) = Self::layout(nwords, n);
        // Safety: non-zero size (the header is not empty).
        let p = unsafe { alloc(layout) }.cast::<Owners>();
        if p.is_null() {
            handle_alloc_error(layout);
        }
        let header = Owners {
            meta: AtomicU32::new(n as u32),
            lo: lo16,
            nwords: nwords16,
            #[cfg(loom)]
            poison: Default::default(),
        };
        // Safety: fresh allocation of `layout`, aligned for the header.
        unsafe { p.write(header) };
        // The allocation holds `nwords` words at `bits_off` and `n` atomics at `ts_off`, each
        // aligned as `Layout::extend` computed; we initialize all of them.
        let bits = p.cast::<u8>().wrapping_add(bits_off).cast::<u64>();
        let ts = p.cast::<u8>().wrapping_add(ts_off).cast::<AtomicU64>();
        for i in 0..nwords {
            // Safety: word `i < nwords` of the fresh allocation (see above).
            unsafe { bits.wrapping_add(i).write(0) };
        }
        debug_assert!(
            entries.windows(2).all(|w| w[0].0 < w[1].0),
            "slots ascending"
        );
        for (i, &(slot, t)) in entries.iter().enumerate() {
            let w = slot as usize / 64 - lo;
            // Safety: word `w < nwords`, initialized just above and not shared yet.
            unsafe { *bits.wrapping_add(w) |= 1u64 << (slot % 64) };
            // Safety: timestamp `i < n` of the fresh allocation, not shared yet.
            unsafe { ts.wrapping_add(i).write(AtomicU64::new(t)) };
        }
        p
    }

    /// Frees a table.
    ///
    /// # Safety
    ///
    /// `p` came from [`Owners::alloc`], no other thread holds it, and it is freed once.
    unsafe fn destroy(p: *mut Owners) {
        #[cfg(loom)]
        {
            // Safety: the table is still allocated (poisoned, never freed, under loom).
            unsafe { (*p).poison.poison() };
        }
        #[cfg(not(loom))]
        {
            // Safety: `p` is live (caller's contract).
            let t = unsafe { &*p };
            let (nwords, n) = (t.nwords as usize, t.len());
            let (layout, _, ts_off) = Self::layout(nwords, n);
            let ts = p.cast::<u8>().wrapping_add(ts_off).cast::<AtomicU64>();
            for i in 0..n {
                // Safety: timestamp `i < n` is an initialized atomic of the table, dropped once.
                unsafe { ptr::drop_in_place(ts.wrapping_add(i)) };
            }
            // Safety: the header is initialized and dropped once.
            unsafe { ptr::drop_in_place(p) };
            // Safety: the block was allocated with `layout` and is freed once.
            unsafe { dealloc(p.cast::<u8>(), layout) };
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
        let start = (self as *const Owners)
            .cast::<u8>()
            .wrapping_add(bits_off)
            .cast::<u64>();
        // Safety: the allocation holds `nwords` initialized words at `bits_off`, written before
        // the table was published and never modified after.
        unsafe { std::slice::from_raw_parts(start, self.nwords as usize) }
    }

    /// The owners' timestamps, in ascending slot order.
    #[inline]
    pub(crate) fn ts(&self) -> &[AtomicU64] {
        let n = self.len();
        let (_, _, ts_off) = Self::layout(self.nwords as usize, n);
        let start = (self as *const Owners)
            .cast::<u8>()
            .wrapping_add(ts_off)
            .cast::<AtomicU64>();
        // Safety: the allocation holds `n` initialized atomics at `ts_off`.
        unsafe { std::slice::from_raw_parts(start, n) }
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
        self.word(slot / 64) >> (slot % 64) & 1 == 1
    }

    /// Index of `slot`'s timestamp, if it is an owner.
    #[inline]
    fn rank(&self, slot: usize) -> Option<usize> {
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
    pub(crate) fn slots(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        let lo = self.lo();
        self.bits()
            .iter()
            .enumerate()
            .flat_map(move |(i, &w)| BitIter(w).map(move |b| (lo + i) * 64 + b))
    }

    /// Marks the table superseded before its timestamps are copied into a replacement.
    ///
    /// Invariant: the lock holder that marks a table superseded then publishes a replacement
    /// on the node or makes the node obsolete; lock-free raisers wait for one or the other.
    ///
    /// Pairs with the lock-free insert path, which raises a timestamp with a `SeqCst`
    /// `fetch_max` and then checks this flag with a `SeqCst` load: either that check sees the
    /// flag (and the insert redoes the raise on the new table), or its `fetch_max` precedes
    /// this store in the single `SeqCst` order and the writer's `SeqCst` copy of the timestamps
    /// sees it.
    fn mark_superseded(&self) {
        self.meta.fetch_or(SUPERSEDED, Ordering::SeqCst);
        // A SeqCst fence too: loom models SeqCst accesses as AcqRel but SeqCst fences exactly,
        // so with the fences (here and in the lock-free raise) the handshake is model-checked.
        crate::sync::fence(Ordering::SeqCst);
    }

    /// See [`Owners::mark_superseded`].
    #[inline]
    pub(crate) fn is_superseded(&self) -> bool {
        self.meta.load(Ordering::SeqCst) & SUPERSEDED != 0
    }

    /// Marks the table superseded and returns its `(slot, ts)` entries, the timestamps read
    /// after the mark (see [`Owners::mark_superseded`]). For a holder of the node's lock.
    fn supersede(&self) -> Entries {
        self.mark_superseded();
        let mut e = Entries::new();
        for (s, t) in self.slots().zip(self.ts()) {
            e.push((s as u32, t.load(Ordering::SeqCst)));
        }
        e
    }

    /// Heap bytes of this table.
    pub(crate) fn bytes(&self) -> usize {
        Self::layout(self.nwords as usize, self.len()).0.size()
    }
}

impl Retire for Owners {
    fn heap_bytes(&self) -> usize {
        self.bytes()
    }

    unsafe fn destroy(p: *mut Self) {
        // Safety: forwarded to the caller.
        unsafe { Owners::destroy(p) }
    }
}

/// `(slot, ts)` entries of one owner table, on the stack for the common case of few owners.
struct Entries {
    inline: [(u32, u64); 16],
    len: usize,
    spill: Vec<(u32, u64)>,
}

impl Entries {
    fn new() -> Self {
        Self {
            inline: [(0, 0); 16],
            len: 0,
            spill: Vec::new(),
        }
    }

    fn push(&mut self, x: (u32, u64)) {
        if self.spill.is_empty() && self.len < self.inline.len() {
            self.inline[self.len] = x;
            self.len += 1;
        } else {
            if self.spill.is_empty() {
                self.spill.extend_from_slice(&self.inline[..self.len]);
            }
            self.spill.push(x);
        }
    }

    fn as_slice(&self) -> &[(u32, u64)] {
        if self.spill.is_empty() {
            &self.inline[..self.len]
        } else {
            &self.spill
        }
    }
}

/// An owner table not yet published, exclusively owned; freed on drop unless published.
pub(crate) struct NewOwners {
    ptr: NonNull<Owners>,
}

// Safety: an unpublished table is plain owned data.
unsafe impl Send for NewOwners {}

impl NewOwners {
    /// A table with the single owner `slot` at `ts`.
    pub(crate) fn single(slot: usize, ts: u64) -> Self {
        Self::from_entries(&[(slot as u32, ts)])
    }

    /// A table with no owners (the root of an empty tree).
    pub(crate) fn empty() -> Self {
        Self::from_entries(&[])
    }

    /// A table from `(slot, ts)` entries in strictly ascending slot order.
    pub(crate) fn from_sorted(e: &[(u32, u64)]) -> Self {
        debug_assert!(e.windows(2).all(|w| w[0].0 < w[1].0));
        Self::from_entries(e)
    }

    fn from_entries(e: &[(u32, u64)]) -> Self {
        let p = Owners::alloc(e);
        Self {
            // Safety: `Owners::alloc` never returns null (it aborts on allocation failure).
            ptr: unsafe { NonNull::new_unchecked(p) },
        }
    }

    /// `entries` plus `slot` at `ts` (or `slot`'s time raised to `ts`); whether it is new.
    fn with_entry(entries: &[(u32, u64)], slot: usize, ts: u64) -> (Self, bool) {
        let s = slot as u32;
        let i = entries.partition_point(|x| x.0 < s);
        let added = entries.get(i).is_none_or(|x| x.0 != s);
        let mut e = Entries::new();
        entries[..i].iter().for_each(|&x| e.push(x));
        e.push((s, if added { ts } else { ts.max(entries[i].1) }));
        entries[i + usize::from(!added)..]
            .iter()
            .for_each(|&x| e.push(x));
        (Self::from_entries(e.as_slice()), added)
    }

    /// `old` plus `slot` at `ts` (or `slot`'s time raised to `ts`), marking `old` superseded
    /// first so that concurrent lock-free raises land in the copy or retry. For a holder of the
    /// lock of `old`'s node. Returns the table and whether `slot` is new.
    pub(crate) fn with(old: &Owners, slot: usize, ts: u64) -> (Self, bool) {
        Self::with_entry(old.supersede().as_slice(), slot, ts)
    }

    /// `old` without `slot`, marking `old` superseded; with `only_at`, only if `slot`'s time in
    /// the superseded copy is exactly that value. The caller publishes whatever table this
    /// returns (a superseded table must be replaced, see [`Owners::mark_superseded`]).
    pub(crate) fn without(old: &Owners, slot: usize, only_at: Option<u64>) -> Without {
        let s = slot as u32;
        let e = old.supersede();
        if let Some(&(_, t)) = e.as_slice().iter().find(|x| x.0 == s) {
            if only_at.is_some_and(|m| m != t) {
                return Without::Kept(Self::from_entries(e.as_slice()), t);
            }
        }
        let mut rest = Entries::new();
        e.as_slice()
            .iter()
            .filter(|x| x.0 != s)
            .for_each(|&x| rest.push(x));
        if rest.as_slice().is_empty() {
            Without::Empty
        } else {
            Without::Removed(Self::from_entries(rest.as_slice()))
        }
    }

    fn into_raw(self) -> *mut Owners {
        let p = self.ptr.as_ptr();
        std::mem::forget(self);
        p
    }
}

impl Drop for NewOwners {
    fn drop(&mut self) {
        // Safety: never published, so exclusively ours.
        unsafe { Owners::destroy(self.ptr.as_ptr()) };
    }
}

/// What [`NewOwners::without`] made.
pub(crate) enum Without {
    /// The table without the slot.
    Removed(NewOwners),
    /// No owner would be left: the caller unlinks the node (making it obsolete).
    Empty,
    /// The slot's time is not the one asked for, but the given one: a plain copy.
    Kept(NewOwners, u64),
}

/// Iterator over the set bits of a word.
#[derive(Clone)]
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
    /// No tenant.
    pub(crate) const EMPTY: Mask<'static> = Mask { lo: 0, words: &[] };

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
        (l.pad_to_align(), keys, ptrs)
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
    unsafe fn destroy(p: *mut ChildTable) {
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
                unsafe { ptr::drop_in_place(c.wrapping_add(i)) };
            }
            // Safety: the header is initialized and dropped once.
            unsafe { ptr::drop_in_place(p) };
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
        let (_, koff, _) = Self::layout(0);
        let start = (self as *const ChildTable)
            .cast::<u8>()
            .wrapping_add(koff)
            .cast::<u32>();
        // Safety: `len` initialized keys follow the header at `koff` (independent of `len`).
        unsafe { std::slice::from_raw_parts(start, self.len as usize) }
    }

    /// The child slots, in key order.
    #[inline]
    fn slots(&self) -> &[AtomicPtr<Node>] {
        let n = self.len as usize;
        let (_, _, poff) = Self::layout(n);
        let start = (self as *const ChildTable)
            .cast::<u8>()
            .wrapping_add(poff)
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
    fn raw_iter(&self) -> impl Iterator<Item = (u32, *mut Node)> + '_ {
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
    unsafe fn swap_child(&self, key: u32, new: *mut Node) -> Option<*mut Node> {
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
struct NewChildTable {
    ptr: NonNull<ChildTable>,
}

impl NewChildTable {
    fn from_sorted(entries: &[(u32, *mut Node)]) -> Self {
        Self {
            ptr: ChildTable::alloc(entries.iter().copied()),
        }
    }

    /// `old`'s entries plus `(key, child)`.
    fn with_inserted(old: Option<&ChildTable>, key: u32, child: *mut Node) -> Self {
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
    fn without(old: &ChildTable, key: u32) -> (Option<Self>, *mut Node) {
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

    fn into_raw(self) -> *mut ChildTable {
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
