//! [`PrefixTree`]: a concurrent radix tree over prompt text with per-tenant accounting and LRU
//! eviction.
//!
//! # Files
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the facade: [`PrefixTree`], its result types, tenants |
//! | `raw/` | node, owner-table and child-table layouts, node locks: every raw dereference |
//! | `slab.rs` | node ids (id → node) for references that outlive a guard |
//! | `read.rs` | the lock-free descent (`prefix_match`, and the first half of every insert) |
//! | `write.rs` | inserts: the lock-free timestamp raise, the locked descent, splits |
//! | `lru.rs` | per-tenant LRU heaps, eviction by LRU, detaching and pruning, tenant removal |
//! | `evict.rs` | the background eviction thread and its configuration |
//! | `inspect.rs` | sizes, the retired backlog, snapshots |
//! | `check.rs` | the invariant checker (test support, feature `testing`) |
//! | `persist.rs` | snapshots: written live, restored into a new tree |
//!
//! # Concurrency
//!
//! * **Reads** ([`PrefixTree::prefix_match`]) pin the epoch once, walk nodes with `Acquire`
//!   loads and compare immutable edge bytes. They take no lock, perform no read-modify-write,
//!   write no shared memory and (in the `_into` form) allocate nothing.
//! * **Edges are immutable.** A split builds two new nodes and swaps one child slot in the
//!   parent; the old node is retired. Owner tables are copy-on-write. A child table of at most
//!   64 slots takes a new child in place while it has a free slot (the entry is written, then
//!   its length is published with `Release`); otherwise, and for removals, it is copied.
//! * **Writers lock nodes, not the tree** (optimistic lock coupling, as in ART/congee). A
//!   writer locks only the node whose child table or owner table it replaces — the parent for
//!   a new child or a split, the node itself for an owner change — and a node that was unlinked
//!   meanwhile is *obsolete*: its lock is never granted again, and the writer retries from a
//!   live ancestor. Adding a tenant to a node also holds the parent's lock (with the tenant
//!   checked there), and removing a tenant from a node checks, under the node's lock, that the
//!   tenant owns none of its children: together they keep every tenant's nodes closed under
//!   prefixes (invariant 2) under any interleaving. Lock order is parent before child.
//! * **An insert whose path the tenant already owns takes no lock**: it raises the timestamps in
//!   place with `fetch_max` and validates that the table it wrote was not superseded meanwhile
//!   (else it redoes the raise, or the insert, under locks).
//! * **Accounting** is exact: a tenant's char count changes only when a writer publishes an
//!   owner table (or a node) that adds or drops that tenant, under that node's lock.
//! * **Tenants** are added and removed under a registry lock that inserts never take (a removal
//!   holds it while it marks its tenants dead and unnames them, not through their sweeps; one
//!   removal runs at a time). Removal bumps the tenant's generation (`SeqCst`) and then sweeps
//!   its bits; an insert that published a bit re-checks the generation after a `SeqCst` fence
//!   and undoes what it gave the tenant if the tenant died, so no bit of a removed tenant
//!   survives. A removal reports what its sweep took, an eviction what it took: each char is
//!   reported once. Slots are recycled only after an epoch grace period following the sweep,
//!   with a new generation, so a stale [`TenantId`] never aliases a new tenant.
//! * **Counters** (nodes, chars, bytes) are sharded per thread and summed when read. They live
//!   with the node-id caches: an insert adds its nodes when it gives back its unused ids, under
//!   the one shard lock it takes for that anyway; a prune subtracts its node on its own.
//! * **Eviction** works per tenant, under that tenant's LRU lock (see `lru.rs`); it locks the
//!   nodes it detaches like any writer, so it never blocks inserts of other tenants except on the
//!   nodes it is changing.

#[cfg(any(test, feature = "testing"))]
mod check;
mod evict;
mod inspect;
mod lru;
mod persist;
mod raw;
mod read;
mod slab;
mod write;

pub use persist::SnapshotSummary;

pub use evict::{
    EvictionConfig, EvictionConfigError, EvictionHandle, EvictionStartError, EvictionTotals,
    PassStats, MIN_EVICTION_INTERVAL,
};

use crate::reclaim::{self, Retirer};
use crate::sync::{self, AtomicU64, AtomicUsize, Mutex, Ordering};
use crate::tenant::{first_generation, Slots, TenantId, TenantSet};
use lru::{Lru, LruHeap};
use raw::{NewOwners, Node};
use slab::{Slab, Store};
use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

/// Longest text accepted by [`PrefixTree::insert`] (2 GiB − 1: edges store lengths in 31 bits).
pub const MAX_TEXT_BYTES: usize = (1 << 31) - 1;

/// Most tenants a tree can hold at once (slots of removed tenants are reused).
pub const MAX_TENANTS: usize = 1 << 20;

/// Errors of [`PrefixTree`] operations.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The tenant id is unknown to this tree, or its tenant was removed.
    UnknownTenant(TenantId),
    /// The text is longer than [`MAX_TEXT_BYTES`].
    TextTooLong {
        /// Length of the rejected text in bytes.
        len: usize,
    },
    /// [`MAX_TENANTS`] tenant slots are in use: live tenants, and removed ones whose slots
    /// are reused only once the removal's sweeps are done and every thread pinned before it
    /// has unpinned. An add at the limit collects such slots itself (a bounded amount of the
    /// process's deferred reclamation per call), so a later call may succeed where one failed.
    TooManyTenants,
    /// The tree holds the most nodes it can address (about 2^30); nothing was changed.
    TooManyNodes,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnknownTenant(t) => write!(f, "unknown or removed tenant {t:?}"),
            Error::TooManyTenants => write!(f, "more than {MAX_TENANTS} live tenants"),
            Error::TextTooLong { len } => write!(
                f,
                "text of {len} bytes is longer than the maximum of {MAX_TEXT_BYTES} bytes"
            ),
            Error::TooManyNodes => write!(f, "the tree holds the most nodes it can address"),
        }
    }
}

impl std::error::Error for Error {}

/// The result of [`PrefixTree::prefix_match`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Matched length in chars (Unicode scalar values).
    pub matched_chars: usize,
    /// Matched length in bytes (always on a char boundary of the query).
    pub matched_bytes: usize,
    /// The available tenants owning the deepest node reached (all available live tenants when
    /// nothing matched).
    pub tenants: TenantSet,
}

/// The whole tree as plain data (see [`PrefixTree::snapshot`]).
///
/// A tree can be as deep as its longest text has chars. Cloning, comparing and formatting a
/// snapshot walk it with a heap stack, not by recursion, so they are safe at any depth.
/// Dropping it is the compiler's drop, which recurses once per level (the fields stay plain,
/// so a snapshot can be taken apart by value); a snapshot of a tree tens of thousands of
/// nodes deep is dropped with [`drop_flat`](Self::drop_flat):
///
/// ```
/// let tree = kvtrie::PrefixTree::new();
/// let a = tree.add_tenant("a");
/// let text = "ab".repeat(15_000);
/// for k in (1..=text.len()).rev() {
///     tree.insert_at(&text[..k], a, 1).unwrap(); // each one node deeper
/// }
/// let snap = tree.snapshot();
/// let copy = snap.clone(); // iterative, as are `==` and `Debug`
/// assert!(copy == snap);
/// // A plain `drop` would recurse 30,000 levels deep.
/// copy.drop_flat();
/// snap.drop_flat();
/// ```
#[derive(Default)]
pub struct NodeSnapshot {
    /// The node's edge text (empty at the root).
    pub text: String,
    /// Owners and their last-access times, by ascending tenant id.
    pub tenants: Vec<(TenantId, u64)>,
    /// Children, sorted by text.
    pub children: Vec<NodeSnapshot>,
}

impl NodeSnapshot {
    /// Drops `self` with a heap stack instead of recursion: each node is dropped after its
    /// children were moved out of it.
    pub fn drop_flat(mut self) {
        let mut stack = std::mem::take(&mut self.children);
        while let Some(mut n) = stack.pop() {
            stack.append(&mut n.children);
        }
    }

    /// This node without its children.
    fn shallow(&self) -> NodeSnapshot {
        NodeSnapshot {
            text: self.text.clone(),
            tenants: self.tenants.clone(),
            children: Vec::with_capacity(self.children.len()),
        }
    }
}

impl Clone for NodeSnapshot {
    fn clone(&self) -> Self {
        // Breadth-first order with parent indices (parents before children), then assembled
        // from the back: when a copy is taken, every child of it has been attached already.
        let mut order: Vec<(&NodeSnapshot, usize)> = vec![(self, 0)];
        let mut i = 0;
        while let Some(&(n, _)) = order.get(i) {
            order.extend(n.children.iter().map(|c| (c, i)));
            i += 1;
        }
        let mut copies: Vec<NodeSnapshot> = order.iter().map(|(n, _)| n.shallow()).collect();
        for j in (1..order.len()).rev() {
            let mut copy = std::mem::take(&mut copies[j]);
            // Attached last child first.
            copy.children.reverse();
            copies[order[j].1].children.push(copy);
        }
        let mut root = std::mem::take(&mut copies[0]);
        root.children.reverse();
        root
    }
}

impl PartialEq for NodeSnapshot {
    fn eq(&self, other: &Self) -> bool {
        let mut stack = vec![(self, other)];
        while let Some((a, b)) = stack.pop() {
            if a.text != b.text || a.tenants != b.tenants || a.children.len() != b.children.len() {
                return false;
            }
            stack.extend(a.children.iter().zip(&b.children));
        }
        true
    }
}

impl Eq for NodeSnapshot {}

impl fmt::Debug for NodeSnapshot {
    /// The derived format (`NodeSnapshot { text: .., tenants: [..], children: [..] }`), on one
    /// line whatever the flags.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        enum Step<'a> {
            Node(&'a NodeSnapshot),
            Text(&'static str),
        }
        let mut stack = vec![Step::Node(self)];
        while let Some(step) = stack.pop() {
            match step {
                Step::Text(s) => f.write_str(s)?,
                Step::Node(n) => {
                    write!(
                        f,
                        "NodeSnapshot {{ text: {:?}, tenants: {:?}, children: [",
                        n.text, n.tenants
                    )?;
                    stack.push(Step::Text("] }"));
                    for (i, c) in n.children.iter().enumerate().rev() {
                        stack.push(Step::Node(c));
                        if i > 0 {
                            stack.push(Step::Text(", "));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Size figures of a tree (see [`PrefixTree::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Nodes, not counting the root.
    pub nodes: usize,
    /// Distinct stored chars (sum of edge lengths in chars).
    pub chars: usize,
    /// Distinct stored bytes (sum of edge lengths in bytes).
    pub bytes: usize,
    /// Heap bytes held by the tree: nodes with their text, owner and child tables, the tenant
    /// table, and the writer's bookkeeping (LRU heaps, node slab).
    pub heap_bytes: usize,
    /// Live tenants.
    pub tenants: usize,
}

/// Retired objects not yet freed (see [`PrefixTree::retired_backlog`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetiredBacklog {
    /// Retired nodes and tables the reclaimer has not freed yet.
    pub objects: usize,
    /// Their heap bytes.
    pub bytes: usize,
}

/// Per-tenant state, one per tenant slot (reused by the slot's later tenants), on its own
/// cache line: only writes for this tenant touch it.
pub(crate) struct TenantState {
    /// Chars the tenant owns (each owned node's edge length once).
    chars: AtomicU64,
    /// Nodes (other than the root) the tenant owns.
    nodes: AtomicUsize,
    /// The tenant's last-access time at the root (the root's owner table holds no times, so
    /// that inserts of different tenants do not write one shared cache line).
    root_ts: AtomicU64,
    /// The tenant's LRU candidates.
    lru: Lru,
}

impl TenantState {
    fn new() -> Self {
        Self {
            chars: AtomicU64::new(0),
            nodes: AtomicUsize::new(0),
            root_ts: AtomicU64::new(0),
            lru: Lru::new(),
        }
    }

    /// Charges `chars` chars and `nodes` nodes (nothing if `nodes` is 0). Relaxed: a figure,
    /// made exact by the lock under which the change it counts was published.
    fn charge(&self, chars: usize, nodes: usize) {
        if nodes > 0 {
            self.chars.fetch_add(chars as u64, Ordering::Relaxed);
            self.nodes.fetch_add(nodes, Ordering::Relaxed);
        }
    }

    /// Refunds one node of `chars` chars (Relaxed, as [`Self::charge`]).
    fn refund(&self, chars: usize) {
        self.chars.fetch_sub(chars as u64, Ordering::Relaxed);
        self.nodes.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Tenant names and slot allocation: changed only by `add_tenant`/`remove_tenants`, which
/// serialize on it (a removal only while it marks its tenants dead and unnames them, not
/// through their sweeps); inserts and reads never take it.
struct Registry {
    names: HashMap<Arc<str>, TenantId>,
    slot_names: Vec<Option<Arc<str>>>,
    /// Slots whose grace period has passed, ready for reuse.
    free_slots: Vec<u32>,
    /// Filled by deferred closures once a removed tenant's grace period has passed.
    released: sync::Arc<Mutex<Vec<u32>>>,
    next_slot: u32,
    /// The generation of a slot's first tenant ([`first_generation`]).
    first_gen: u32,
}

/// A concurrent radix tree over prompt text, shared by tenants (replicas).
///
/// ```
/// use kvtrie::PrefixTree;
///
/// let tree = PrefixTree::new();
/// let a = tree.add_tenant("replica-a");
/// let b = tree.add_tenant("replica-b");
/// tree.insert_at("hello world", a, 1).unwrap();
/// tree.insert_at("hello there", b, 2).unwrap();
/// let m = tree.prefix_match("hello wor", None);
/// assert_eq!(m.matched_chars, 9);
/// assert_eq!(m.tenants.iter().collect::<Vec<_>>(), vec![a]);
/// assert_eq!(tree.char_count(a), Some(11));
/// // a's oldest group is ts 1: "hello " and "world"; "hello " survives for b.
/// assert_eq!(tree.evict_tenant_by_lru(a, 1), 11);
/// assert_eq!(tree.char_count(b), Some(11));
/// ```
pub struct PrefixTree {
    // Invariant: the root node, allocated in `new`, never retired or replaced; its edge is
    // empty and its owner table holds exactly the live tenants (with no times: see
    // `TenantState::root_ts`).
    root: NonNull<Node>,
    slots: Slots<TenantState>,
    store: Store,
    registry: Mutex<Registry>,
    /// Held by a tenant removal throughout (taken before `registry`): removals run one at a
    /// time, and their sweeps do not hold the registry.
    removals: Mutex<()>,
    /// The tree clock reads `clock_base` + the milliseconds since `origin`.
    origin: Instant,
    clock_base: u64,
    eviction: Mutex<Option<evict::Running>>,
}

// Safety: all shared state is reached through atomics, epoch-protected immutable data, node
// locks or mutexes; the root pointer is owned by the tree.
unsafe impl Send for PrefixTree {}
// Safety: as above; `&PrefixTree` methods synchronize through atomics, locks and the epoch.
unsafe impl Sync for PrefixTree {}

impl Default for PrefixTree {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for PrefixTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixTree")
            .field("nodes", &self.node_count())
            .field("chars", &self.distinct_chars())
            .finish_non_exhaustive()
    }
}

impl PrefixTree {
    /// An empty tree.
    pub fn new() -> Self {
        Self::with_ids_from(1)
    }

    /// An empty tree whose first node id (after the root's 0) is `first`: tests start near
    /// the end of the id space to reach it.
    fn with_ids_from(first: u32) -> Self {
        let root = raw::new_root();
        let slab = Slab::new(first);
        // The root is id 0 (never released), live as long as the tree.
        slab.set(0, root.as_ptr());
        Self {
            root,
            slots: Slots::new(),
            store: Store {
                slab,
                retirer: Retirer::new(),
            },
            registry: Mutex::new(Registry {
                names: HashMap::new(),
                slot_names: Vec::new(),
                free_slots: Vec::new(),
                released: sync::Arc::new(Mutex::new(Vec::new())),
                next_slot: 0,
                first_gen: first_generation(),
            }),
            removals: Mutex::new(()),
            origin: Instant::now(),
            clock_base: 0,
            eviction: Mutex::new(None),
        }
    }

    /// An empty tree whose next new tenant slot is `first`: tests start near
    /// [`MAX_TENANTS`] to reach it (test support, feature `testing`).
    #[cfg(all(any(test, feature = "testing"), not(loom)))]
    #[doc(hidden)]
    pub fn with_tenant_slots_from(first: u32) -> Self {
        let t = Self::new();
        sync::lock(&t.registry).next_slot = first;
        t
    }

    #[inline]
    fn root(&self) -> &Node {
        // Safety: the root lives as long as the tree (field invariant).
        unsafe { self.root.as_ref() }
    }

    /// The tree clock used by [`insert`](Self::insert): milliseconds since the tree was created
    /// (for a tree read from a snapshot: the snapshot's clock, or its newest time if that is
    /// later, plus the milliseconds since it was read), plus any
    /// [`advance_clock`](Self::advance_clock).
    pub fn now(&self) -> u64 {
        let elapsed = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.clock_base.saturating_add(elapsed)
    }

    /// Moves the tree clock forward by `ms` milliseconds. A tree read from a snapshot resumes
    /// at the clock the snapshot recorded; a caller that knows how long ago the snapshot was
    /// written adds that time, so that what it inserts at the tree clock from now on is newer
    /// than everything the snapshot holds by as much as it really is (eviction takes the
    /// oldest first). Also gives a new tree room below its clock for entries known to be
    /// older than the tree itself.
    ///
    /// ```
    /// use kvtrie::PrefixTree;
    /// let mut tree = PrefixTree::new();
    /// tree.advance_clock(60_000);
    /// assert!(tree.now() >= 60_000);
    /// ```
    pub fn advance_clock(&mut self, ms: u64) {
        self.clock_base = self.clock_base.saturating_add(ms);
    }

    fn eviction_slot(&self) -> &Mutex<Option<evict::Running>> {
        &self.eviction
    }

    /// The state of tenant slot `slot` (which was used at least once).
    fn state<'g>(&'g self, slot: usize, guard: &'g reclaim::Guard) -> &'g TenantState {
        self.slots
            .load(guard)
            .state(slot)
            .expect("a slot that owns something has a state")
    }

    // ----------------------------------------------------------------------------------------
    // Tenants
    // ----------------------------------------------------------------------------------------

    /// Registers a tenant (replica) by name and returns its id; an existing name returns its id
    /// unchanged. Any string is a valid name.
    ///
    /// Adding (or removing) a tenant publishes a new owner table of the root, which lists every
    /// live tenant: its cost grows with the live tenants. Add many at once with
    /// [`try_add_tenants`](Self::try_add_tenants) (one table for all; from Python,
    /// `add_tenants` of 80,000 new names takes 0.15 s, against 3.2 s one by one). Removals
    /// go one by one: removing tens of thousands of tenants at once takes seconds.
    ///
    /// # Panics
    ///
    /// With [`MAX_TENANTS`] tenants live already; [`try_add_tenant`](Self::try_add_tenant)
    /// returns an error instead.
    pub fn add_tenant(&self, name: &str) -> TenantId {
        self.try_add_tenant(name)
            .expect("more than MAX_TENANTS live tenants")
    }

    /// [`add_tenant`](Self::add_tenant), or [`Error::TooManyTenants`] (and no change) when
    /// [`MAX_TENANTS`] tenants are live.
    pub fn try_add_tenant(&self, name: &str) -> Result<TenantId, Error> {
        self.try_add_tenants(&[name])
            .pop()
            .expect("one result per name")
    }

    /// [`try_add_tenant`](Self::try_add_tenant) for each name, in order (a name given twice
    /// gets the same id twice), with one new owner table of the root for all of them: adding
    /// `n` tenants to `m` live ones costs `O(n + m)`, where `n` single adds cost `O(n · m)`.
    /// Names past [`MAX_TENANTS`] live tenants get [`Error::TooManyTenants`]; the others are
    /// added.
    ///
    /// ```
    /// let tree = kvtrie::PrefixTree::new();
    /// let ids = tree.try_add_tenants(&["a", "b", "a"]);
    /// assert_eq!(ids[0], ids[2]);
    /// assert_eq!(tree.tenants().len(), 2);
    /// ```
    pub fn try_add_tenants(&self, names: &[&str]) -> Vec<Result<TenantId, Error>> {
        self.add_tenants_reporting(names)
            .into_iter()
            .map(|r| r.map(|(t, _)| t))
            .collect()
    }

    /// [`try_add_tenants`](Self::try_add_tenants), saying for each name whether this call
    /// added it (the first of repeated names only).
    pub(crate) fn add_tenants_reporting(
        &self,
        names: &[&str],
    ) -> Vec<Result<(TenantId, bool), Error>> {
        // The registry first: a thread waiting for it (behind a tenant's removal) must not
        // hold a pin meanwhile, which would keep the epoch from advancing. It is held until
        // the root lists the new tenants, so no one learns an id the root does not list yet.
        let mut r = sync::lock(&self.registry);
        if let Some(need) = Self::slots_to_collect(&r, names) {
            // At the limit: collect removed tenants' slots once per call, without the registry
            // (see `collect_released`); `register_tenant` takes them from `released`.
            let released = r.released.clone();
            drop(r);
            Self::collect_released(&released, need);
            r = sync::lock(&self.registry);
        }
        let mut out = Vec::with_capacity(names.len());
        let mut added = Vec::new();
        for name in names {
            let result = self.register_tenant(&mut r, name);
            if let Ok((t, true)) = result {
                added.push(t.slot());
            }
            out.push(result);
        }
        if !added.is_empty() {
            added.sort_unstable();
            // The root is owned by exactly the live tenants.
            let guard = reclaim::pin();
            let root = self.root().lock().expect("the root is never obsolete");
            let owners = NewOwners::with_all(root.node().owners(&guard), &added, 0);
            root.set_owners(owners, &self.store, &guard);
        }
        out
    }

    /// Registers `name` (under the registry lock `r`) but does not list it at the root yet;
    /// returns its id and whether it is new.
    fn register_tenant(&self, r: &mut Registry, name: &str) -> Result<(TenantId, bool), Error> {
        if let Some(&t) = r.names.get(name) {
            return Ok((t, false));
        }
        let released: Vec<u32> = std::mem::take(&mut *sync::lock(&r.released));
        r.free_slots.extend(released);
        let slot = match r.free_slots.pop() {
            Some(s) => s,
            None if (r.next_slot as usize) < MAX_TENANTS => {
                let s = r.next_slot;
                r.next_slot += 1;
                s
            }
            None => return Err(Error::TooManyTenants),
        };
        let s = slot as usize;
        let state = {
            let guard = reclaim::pin();
            self.slots.ensure(s, TenantState::new, &guard);
            // States outlive the guard (they live as long as the tree).
            self.slots.state_in(s, &guard).expect("ensured above")
        };
        // The slot's previous tenant (if any) was swept to nothing before its grace period.
        debug_assert_eq!(state.chars.load(Ordering::Relaxed), 0);
        state.chars.store(0, Ordering::Relaxed);
        state.nodes.store(0, Ordering::Relaxed);
        state.root_ts.store(0, Ordering::Relaxed);
        // Unpinned: an eviction of the slot's previous tenant may have just taken its LRU (it
        // finds that tenant gone and lets go); no pin waits for it.
        state.lru.reset(LruHeap::default());
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        let gen = match table.gen(s) {
            0 => r.first_gen,
            g => g.wrapping_add(1) | 1,
        };
        table.set_gen(s, gen);
        let t = TenantId::new(slot, gen);
        let name: Arc<str> = Arc::from(name);
        r.names.insert(name.clone(), t);
        if r.slot_names.len() <= s {
            r.slot_names.resize(s + 1, None);
        }
        r.slot_names[s] = Some(name);
        Ok((t, true))
    }

    /// How many released slots adding `names` needs beyond those released already, if it
    /// needs any: the new names (each once) are more than the never-used slots, the free ones
    /// and those in `released`.
    fn slots_to_collect(r: &Registry, names: &[&str]) -> Option<usize> {
        let unused = MAX_TENANTS - r.next_slot as usize;
        if names.len() <= unused + r.free_slots.len() {
            return None;
        }
        let new: std::collections::HashSet<&str> = names
            .iter()
            .copied()
            .filter(|n| !r.names.contains_key(*n))
            .collect();
        let need = new.len().checked_sub(unused + r.free_slots.len())?;
        (need > sync::lock(&r.released).len()).then_some(need)
    }

    /// Not every new name has a slot: runs the reclaimer's collection until `released` holds
    /// `need` slots, or for a few rounds, so that the slots of removed tenants whose grace
    /// period has passed (no thread pinned before their removal is still pinned) are released.
    /// It does not wait for a pinned thread. A slot's release is a deferred function of the
    /// epoch reclaimer, which runs only when some thread pins and collects; in a process doing
    /// nothing but adding tenants (a caller retrying after [`Error::TooManyTenants`]) none
    /// would, and the slot would never come back.
    ///
    /// Called without the registry: a collection runs expired deferred functions of every
    /// structure in the process (up to eight bags of 64 per round, each perhaps a batch of 64
    /// retired objects to free), which takes a while after a large removal or eviction, and
    /// the registry is what name lookups (a router's, per request) wait for.
    fn collect_released(released: &sync::Arc<Mutex<Vec<u32>>>, need: usize) {
        // A few rounds: the epoch advances at most once per collection (which runs a bounded
        // number of deferred batches), and a slot is released two advances after its
        // removal's deferral. A thread still pinned from before the removal stops it, and so
        // does a backlog of more than about 8 bags per round ahead of the release (a later
        // call goes on from there).
        for _ in 0..32 {
            {
                let guard = reclaim::pin();
                reclaim::flush(&guard);
            }
            #[cfg(all(test, not(loom)))]
            tests::COLLECT_HOOK.with(|h| {
                if let Some(f) = &*h.borrow() {
                    f()
                }
            });
            if sync::lock(released).len() >= need {
                return;
            }
        }
    }

    /// The id of the live tenant called `name`.
    pub fn tenant_id(&self, name: &str) -> Option<TenantId> {
        sync::lock(&self.registry).names.get(name).copied()
    }

    /// The name of a live tenant.
    pub fn tenant_name(&self, t: TenantId) -> Option<Arc<str>> {
        if !self.slots.load(&reclaim::pin()).is_live(t) {
            return None;
        }
        // Not pinned while waiting for the registry (see `try_add_tenant`).
        let r = sync::lock(&self.registry);
        // Under the registry lock the liveness check is authoritative.
        if !self.slots.load(&reclaim::pin()).is_live(t) {
            return None;
        }
        r.slot_names.get(t.slot())?.clone()
    }

    /// The live tenants, in ascending order.
    pub fn tenants(&self) -> Vec<TenantId> {
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        self.root()
            .owners(&guard)
            .slots()
            .map(|s| table.id_of_seen(s))
            .filter(|t| table.is_live(*t))
            .collect()
    }

    /// Is `t` a live tenant of this tree?
    pub fn is_live(&self, t: TenantId) -> bool {
        let guard = reclaim::pin();
        self.slots.load(&guard).is_live(t)
    }

    /// Chars owned by tenant `t` (each node it owns counts its edge length once), or `None` for
    /// an unknown or removed tenant.
    pub fn char_count(&self, t: TenantId) -> Option<usize> {
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        if !table.is_live(t) {
            return None;
        }
        Some(table.state(t.slot())?.chars.load(Ordering::Relaxed) as usize)
    }

    /// All tenants tied at the smallest char count among `available` (`None`: all live
    /// tenants; unknown ids are ignored), in ascending order; empty when there are none.
    pub fn smallest_tenants(&self, available: Option<&[TenantId]>) -> Vec<TenantId> {
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        let mut best = u64::MAX;
        let mut out = Vec::new();
        let mut consider = |t: TenantId| {
            if !table.is_live(t) {
                return;
            }
            let Some(state) = table.state(t.slot()) else {
                return;
            };
            let c = state.chars.load(Ordering::Relaxed);
            if c < best {
                best = c;
                out.clear();
            }
            if c == best && !out.contains(&t) {
                out.push(t);
            }
        };
        match available {
            None => self
                .root()
                .owners(&guard)
                .slots()
                .for_each(|s| consider(table.id_of_seen(s))),
            Some(list) => list.iter().copied().for_each(&mut consider),
        }
        out.sort_unstable();
        out
    }
}

impl Drop for PrefixTree {
    fn drop(&mut self) {
        if let Some(running) = self.eviction.get_mut().ok().and_then(|e| e.take()) {
            running.stop_and_join();
        }
        // Safety: `&mut self`: no other thread can reach the tree; every reachable node and
        // table is owned by the tree and freed exactly once here (retired ones are no longer
        // reachable and belong to the reclaimer or the retirer's batches).
        unsafe { raw::free_tree(self.root) };
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    thread_local! {
        /// Called after each collection round of an add at the tenant limit, on its thread.
        pub(super) static COLLECT_HOOK: std::cell::RefCell<Option<Box<dyn Fn()>>> =
            const { std::cell::RefCell::new(None) };
    }

    /// An add at the tenant limit runs the reclaimer's collection without the registry: the
    /// deferred functions it runs (of any structure in the process) can free a large backlog,
    /// and a router looks a replica's name up (under the registry) per request meanwhile.
    /// Removed tenants' slots still come back through it.
    #[test]
    // Under miri a tree at the last tenant slots costs a quarter of an hour (a slot table and a
    // root owner table sized for 2^20 slots), as `a_failed_replica_update_changes_nothing`.
    #[cfg_attr(miri, ignore)]
    fn an_add_at_the_limit_collects_without_the_registry() {
        let tree = std::sync::Arc::new(PrefixTree::with_tenant_slots_from(MAX_TENANTS as u32 - 1));
        let a = tree.add_tenant("a");
        let rounds = std::rc::Rc::new(std::cell::Cell::new(0));
        {
            let (t, seen) = (tree.clone(), rounds.clone());
            COLLECT_HOOK.with(|h| {
                *h.borrow_mut() = Some(Box::new(move || {
                    seen.set(seen.get() + 1);
                    assert!(
                        sync::try_lock(&t.registry).is_some(),
                        "the registry is held through the collection"
                    );
                    // A name lookup meanwhile does not wait.
                    assert_eq!(t.tenant_id("none"), None);
                }));
            });
        }
        assert_eq!(tree.try_add_tenant("b"), Err(Error::TooManyTenants));
        assert!(rounds.get() > 0, "an add at the limit collects");
        tree.insert_at("hello", a, 1).unwrap();
        assert_eq!(tree.remove_tenant(a), 5);
        // Other tests' threads may hold the epoch back for a while.
        let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let b = loop {
            match tree.try_add_tenant("b") {
                Ok(b) => break b,
                Err(e) => assert!(std::time::Instant::now() < end, "{e:?}"),
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        COLLECT_HOOK.with(|h| h.borrow_mut().take());
        assert_eq!(b.slot(), a.slot());
        assert!(!tree.is_live(a));
        assert_eq!(tree.try_add_tenant("c"), Err(Error::TooManyTenants));
        tree.check_invariants().unwrap();
    }

    /// Out of node ids: the insert that needs one more fails with `TooManyNodes`, leaves the
    /// tree as it was (invariants and counts exact), and succeeds once an eviction freed an id.
    #[test]
    fn running_out_of_node_ids_is_an_error_and_changes_no_node() {
        // Four ids left: "ab", then the split "a" | "b" + "c" use three (an insert reserves two
        // before it takes any lock, so the fourth alone is not enough).
        let t = PrefixTree::with_ids_from(raw::MAX_NODE_ID - 3);
        let a = t.add_tenant("a");
        t.insert_at("ab", a, 1).unwrap();
        t.insert_at("ac", a, 2).unwrap();
        let before = t.snapshot().children;
        assert_eq!(t.insert_at("xy", a, 3), Err(Error::TooManyNodes));
        assert_eq!(t.snapshot().children, before);
        t.check_invariants().unwrap();
        assert_eq!((t.node_count(), t.char_count(a)), (3, Some(3)));
        // The oldest group ("b" at 1) goes, and its id is reused.
        assert_eq!(t.evict_tenant_by_lru(a, 1), 1);
        t.insert_at("xy", a, 4).unwrap();
        t.check_invariants().unwrap();
        assert_eq!(t.char_count(a), Some(4));
        assert_eq!(t.prefix_match("xyz", None).matched_chars, 2);
    }

    /// A removed tenant's slot is reused (after the grace period) with the next odd
    /// generation, but not once the next tenant's removal would wrap the generation past
    /// `u32::MAX` (to 0, which reads as a slot never used): that slot is retired.
    #[test]
    fn a_slot_whose_generations_are_used_up_is_never_reused() {
        /// Slots released after their grace period and not taken again, ascending.
        fn reusable(tree: &PrefixTree) -> Vec<u32> {
            let r = sync::lock(&tree.registry);
            let mut s = r.free_slots.clone();
            s.extend(sync::lock(&r.released).iter().copied());
            s.sort_unstable();
            s
        }
        /// Collects until `slot` is released (other tests' threads may hold the epoch back).
        fn wait_for_release(tree: &PrefixTree, slot: u32) {
            let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !reusable(tree).contains(&slot) {
                assert!(
                    std::time::Instant::now() < end,
                    "slot {slot} never released"
                );
                tree.collect_garbage();
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        let tree = PrefixTree::new();
        sync::lock(&tree.registry).first_gen = u32::MAX - 4;
        let t0 = tree.add_tenant("t0");
        assert_eq!((t0.slot(), t0.generation()), (0, u32::MAX - 4));
        tree.insert_at("text", t0, 1).unwrap();
        assert_eq!(tree.remove_tenant(t0), 4);
        wait_for_release(&tree, 0);
        let t1 = tree.add_tenant("t1");
        assert_eq!((t1.slot(), t1.generation()), (0, u32::MAX - 2));
        assert_eq!(tree.remove_tenant(t1), 0);
        // A tenant on a fresh slot, removed after `t1`: its slot's release comes after t1's
        // would (the grace periods end in order).
        let u = tree.add_tenant("u");
        assert_eq!((u.slot(), u.generation()), (1, u32::MAX - 4));
        tree.remove_tenant(u);
        wait_for_release(&tree, 1);
        assert_eq!(reusable(&tree), [1]);
        let v = tree.add_tenant("v");
        assert_eq!((v.slot(), v.generation()), (1, u32::MAX - 2));
        let w = tree.add_tenant("w");
        assert_eq!((w.slot(), w.generation()), (2, u32::MAX - 4));
        for old in [t0, t1, u] {
            assert!(!tree.is_live(old));
        }
    }

    /// `check_invariants` holds the id table to the tree: an entry naming a node that is not
    /// linked (what `stats` would count, or read after it is freed) is an error.
    #[test]
    fn a_stray_id_entry_fails_the_invariants() {
        let t = PrefixTree::new();
        let a = t.add_tenant("a");
        t.insert_at("hello", a, 1).unwrap();
        t.check_invariants().unwrap();
        let id = t.store.slab.reserve().unwrap();
        let spare = raw::NewNode::leaf(b"x", id, a.slot(), 1);
        t.store
            .slab
            .set(id, std::ptr::from_ref(spare.node()).cast_mut());
        let err = t.check_invariants().unwrap_err();
        assert!(err.contains("maps 3 ids to nodes"), "{err}");
        t.store.slab.release(id);
        t.check_invariants().unwrap();
    }

    #[test]
    fn split_and_match() {
        let t = PrefixTree::new();
        let a = t.add_tenant("a");
        t.insert_at("hello", a, 1).unwrap();
        t.insert_at("help", a, 2).unwrap();
        assert_eq!(t.char_count(a), Some(6));
        let m = t.prefix_match("helium", None);
        assert_eq!((m.matched_chars, m.matched_bytes), (3, 3));
        assert_eq!(t.node_count(), 3);
        t.check_invariants().unwrap();
        t.collect_garbage();
    }

    /// A new leaf's single-owner table is part of its allocation: counted with the node while
    /// current, kept (not retired) inside it once a second owner supersedes it, and freed with
    /// the node when eviction prunes it.
    #[test]
    fn a_leaf_owner_table_lives_in_the_leaf() {
        let t = PrefixTree::new();
        let (a, b, c) = (t.add_tenant("a"), t.add_tenant("b"), t.add_tenant("c"));
        t.insert_at("hello", a, 1).unwrap();
        let g = reclaim::pin();
        let key = crate::text::edge_key(b"h");
        let n = t.root().child(key, &g).expect("leaf");
        let first: *const _ = n.owners(&g);
        // The table follows the text, 8-aligned.
        let size = (std::mem::size_of::<Node>() + 5).next_multiple_of(8) + raw::Owners::SINGLE_SIZE;
        assert_eq!(
            n.bytes(),
            size,
            "header, text and owner table in one allocation"
        );
        assert_eq!(
            n.bytes_with(n.owners(&g)),
            size,
            "the current table is inside"
        );
        assert_eq!(n.text(), b"hello");
        // A second owner supersedes the table, which is not retired (the guard held, nothing
        // is freed meanwhile, so any retirement would show in the backlog).
        let before = t.retired_backlog();
        t.insert_at("hello", b, 2).unwrap();
        assert_eq!(
            t.retired_backlog().objects,
            before.objects,
            "nothing retired"
        );
        let n2 = t.root().child(key, &g).expect("leaf");
        assert!(std::ptr::eq(n, n2), "gaining an owner keeps the node");
        let o = n.owners(&g);
        assert!(!std::ptr::eq(o, first), "a second owner means a new table");
        assert_eq!(n.bytes_with(o), size + o.bytes());
        assert_eq!(n.text(), b"hello");
        t.check_invariants().unwrap();
        // Pruning a leaf whose embedded table is current retires the node (with its table)
        // and the parent's replaced child table, nothing else.
        t.insert_at("xyz", c, 3).unwrap();
        let x = t
            .root()
            .child(crate::text::edge_key(b"x"), &g)
            .expect("leaf");
        let root_table = t.root().child_table(&g).expect("children").bytes();
        let before = t.retired_backlog();
        assert_eq!(t.evict_tenant_by_lru(c, 3), 3);
        let after = t.retired_backlog();
        assert_eq!(
            (after.objects - before.objects, after.bytes - before.bytes),
            (2, x.bytes() + root_table)
        );
        drop(g);
        assert_eq!(t.evict_tenant_by_lru(a, 5), 5);
        assert_eq!(t.evict_tenant_by_lru(b, 5), 5);
        assert_eq!(t.node_count(), 0);
        t.check_invariants().unwrap();
        t.collect_garbage();
    }

    /// A split's suffix has its owner table inside its allocation (a copy of the split node's);
    /// the prefix, where the inserting tenant attaches, has a separate one (its copy plus that
    /// tenant). Both with the right owners and times.
    #[test]
    fn split_suffixes_hold_their_owner_tables() {
        let t = PrefixTree::new();
        let (a, b, c) = (t.add_tenant("a"), t.add_tenant("b"), t.add_tenant("c"));
        t.insert_at("hello world", a, 1).unwrap();
        t.insert_at("hello world", c, 2).unwrap();
        let before = t.retired_backlog();
        t.insert_at("hello there", b, 3).unwrap();
        let g = reclaim::pin();
        let prefix = t
            .root()
            .child(crate::text::edge_key(b"h"), &g)
            .expect("prefix");
        let suffix = prefix
            .child(crate::text::edge_key(b"w"), &g)
            .expect("suffix");
        assert_eq!(
            (prefix.text(), suffix.text()),
            (&b"hello "[..], &b"world"[..])
        );
        let o = prefix.owners(&g);
        assert_eq!(o.entries(), vec![(0, 1), (1, 3), (2, 2)]);
        assert_eq!(prefix.bytes(), std::mem::size_of::<Node>() + prefix.len());
        assert_eq!(
            prefix.bytes_with(o),
            prefix.bytes() + o.bytes(),
            "a separate table"
        );
        let o = suffix.owners(&g);
        assert_eq!(o.entries(), vec![(0, 1), (2, 2)]);
        assert_eq!(
            suffix.bytes_with(o),
            suffix.bytes(),
            "the current table is inside"
        );
        let size = (std::mem::size_of::<Node>() + suffix.len()).next_multiple_of(8) + o.bytes();
        assert_eq!(
            suffix.bytes(),
            size,
            "header, text and table in one allocation"
        );
        // The split retired the old node (freed with its separate table of two owners, not
        // retired on its own), and the root's child table is unchanged (one slot swapped).
        let after = t.retired_backlog();
        assert_eq!(after.objects - before.objects, 1, "the split node");
        drop(g);
        t.check_invariants().unwrap();
        for (tenant, ts) in [(a, 1), (b, 3), (c, 2)] {
            t.evict_tenant_by_lru(tenant, ts);
        }
        assert_eq!(t.node_count(), 0);
        t.check_invariants().unwrap();
        t.collect_garbage();
    }

    /// A new leaf's header copy of the first membership word is written without reading the
    /// table back: right for slots in the first word and beyond it (checked by the invariants,
    /// and by lookups that filter on it).
    #[test]
    fn a_new_leaf_header_word_matches_its_table() {
        let t = PrefixTree::new();
        let ids: Vec<TenantId> = (0..70).map(|i| t.add_tenant(&format!("t{i}"))).collect();
        for (i, &s) in [0usize, 63, 64, 69].iter().enumerate() {
            t.insert_at(&format!("leaf {s}"), ids[s], i as u64 + 1)
                .unwrap();
            t.check_invariants().unwrap();
            let m = t.prefix_match(&format!("leaf {s}"), Some(&ids[s..=s]));
            assert_eq!(m.matched_chars, format!("leaf {s}").len(), "slot {s}");
            assert_eq!(m.tenants.iter().collect::<Vec<_>>(), [ids[s]]);
        }
        // Tenants 0..64 reach "leaf 6" (tenant 63's), not tenant 64's leaf "4".
        assert_eq!(t.prefix_match("leaf 64", Some(&ids[..64])).matched_chars, 6);
    }

    /// A split's suffix gets its copy inside its allocation while it is small (here two
    /// membership words and two owners), and a separate table when it is large (13 owners);
    /// the prefix's table is always separate.
    #[test]
    fn split_suffixes_embed_small_tables_only() {
        let t = PrefixTree::new();
        let ids: Vec<TenantId> = (0..70).map(|i| t.add_tenant(&format!("t{i}"))).collect();
        let g = reclaim::pin();
        let node = |text: &[u8]| {
            let mut n = t.root();
            let mut rest = text;
            while !rest.is_empty() {
                n = n.child(crate::text::edge_key(rest), &g).expect("path");
                rest = &rest[n.len()..];
            }
            n
        };
        // Two words: tenants 0 and 65 own "small world", tenant 3 splits it.
        t.insert_at("small world", ids[0], 1).unwrap();
        t.insert_at("small world", ids[65], 2).unwrap();
        t.insert_at("small talk", ids[3], 3).unwrap();
        for (text, owners, inside) in [(&b"small "[..], 3, false), (&b"small world"[..], 2, true)] {
            let n = node(text);
            let o = n.owners(&g);
            assert_eq!((o.bits().len(), o.len()), (2, owners), "{text:?}");
            assert_eq!(n.bytes_with(o) == n.bytes(), inside, "{text:?}");
        }
        // Fourteen owners: separate tables, and no room in the node.
        for (i, id) in ids.iter().take(13).enumerate() {
            t.insert_at("large world", *id, i as u64).unwrap();
        }
        t.insert_at("large talk", ids[20], 30).unwrap();
        for (text, owners) in [(&b"large "[..], 14), (&b"large world"[..], 13)] {
            let n = node(text);
            let o = n.owners(&g);
            assert_eq!(o.len(), owners, "{text:?}");
            assert_eq!(
                n.bytes(),
                std::mem::size_of::<Node>() + n.len(),
                "{text:?}: no room"
            );
            assert_eq!(n.bytes_with(o), n.bytes() + o.bytes(), "{text:?}: apart");
        }
        drop(g);
        t.check_invariants().unwrap();
    }

    /// One node with 150 children (70 under miri): its table grows in place and by copies,
    /// becomes sorted past 64 children, shrinks back through both kinds as leaves are evicted,
    /// and regrows; snapshots list the children in ascending order whatever the table's order.
    #[test]
    fn wide_nodes_grow_shrink_and_round_trip() {
        let t = PrefixTree::new();
        let a = t.add_tenant("a");
        let n = if cfg!(miri) { 70 } else { 150 };
        let chars: Vec<char> = ('!'..='~').chain('À'..='ÿ').take(n).collect();
        // The i-th insert (time i + 1) adds `order(i)`: a fixed shuffle (97 is prime to n).
        let order = |i: usize| chars[(i * 97) % n];
        let g = reclaim::pin();
        // "p"'s table: (entries, slots) after each insert from the second on (the split makes
        // it with both children and room for a third). It grows by half when full, in place in
        // between, up to 64 slots; past 64 it is sorted and exact.
        let p_table = || {
            let p = t.root().child(crate::text::edge_key(b"p"), &g).expect("p");
            let c = p.child_table(&g).expect("children");
            (c.len(), c.capacity(), c.is_large())
        };
        let mut cap = 3;
        for i in 0..n {
            t.insert_at(&format!("p{}", order(i)), a, i as u64 + 1)
                .unwrap();
            if i == 0 {
                continue;
            }
            let len = i + 1;
            if len > cap {
                cap = [6, 10, 16, 25, 39, 60, 64]
                    .into_iter()
                    .find(|&c| c >= len)
                    .unwrap_or(len);
            }
            assert_eq!(p_table(), (len, cap, len > 64), "after insert {i}");
            if i % 32 == 0 {
                t.check_invariants().unwrap();
            }
            if i == 40 {
                // A small table in insertion order: the snapshot must list it sorted (the
                // reader refuses anything else), and restores the same tree.
                let mut b = Vec::new();
                t.write_snapshot(&mut b).unwrap();
                let r = PrefixTree::read_snapshot(&b[..]).unwrap();
                r.check_invariants().unwrap();
                assert_eq!(r.snapshot(), t.snapshot());
            }
        }
        drop(g);
        t.check_invariants().unwrap();
        assert_eq!((t.node_count(), t.char_count(a)), (n + 1, Some(n + 1)));
        for c in &chars {
            assert_eq!(t.prefix_match(&format!("p{c}z"), None).matched_chars, 2);
        }
        let mut buf = Vec::new();
        t.write_snapshot(&mut buf).unwrap();
        let r = PrefixTree::read_snapshot(&buf[..]).unwrap();
        r.check_invariants().unwrap();
        assert_eq!(r.snapshot(), t.snapshot());
        // The oldest leaves go (one char each), leaving 30; "p" is newer than all of them.
        let evicted = n - 30;
        assert_eq!(t.evict_tenant_by_lru(a, evicted), evicted);
        t.check_invariants().unwrap();
        for i in 0..n {
            let m = t.prefix_match(&format!("p{}", order(i)), None);
            assert_eq!(m.matched_chars, if i >= evicted { 2 } else { 1 }, "{i}");
        }
        for i in 0..evicted {
            t.insert_at(&format!("p{}", order(i)), a, 1000 + i as u64)
                .unwrap();
        }
        t.check_invariants().unwrap();
        assert_eq!((t.node_count(), t.char_count(a)), (n + 1, Some(n + 1)));
        for c in &chars {
            assert_eq!(t.prefix_match(&format!("p{c}"), None).matched_chars, 2);
        }
        t.collect_garbage();
    }
}
