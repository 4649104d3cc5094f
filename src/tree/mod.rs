//! [`PrefixTree`]: a concurrent radix tree over prompt text with per-tenant accounting and LRU
//! eviction.
//!
//! # Concurrency
//!
//! * **Reads** ([`PrefixTree::prefix_match`]) pin the epoch once, walk nodes with `Acquire`
//!   loads and compare immutable edge bytes. They take no lock, perform no read-modify-write,
//!   write no shared memory and (in the `_into` form) allocate nothing.
//! * **Edges are immutable.** A split builds two new nodes and swaps one child slot in the
//!   parent; the old node is retired. Child tables and owner tables are copy-on-write.
//! * **Writers** that change structure or membership serialize on one writer mutex; readers
//!   never wait for it. An insert whose path already carries the tenant (and ends on a node
//!   boundary) takes no lock: it raises the timestamps in place with `fetch_max` and validates
//!   that no owner table it wrote was superseded meanwhile (else it redoes the insert under the
//!   lock). An insert that needs the lock reuses the path its lock-free descent recorded, as long
//!   as the nodes on it are still linked, so the text is compared once.
//! * **Accounting** is exact: a tenant's char count changes only when the writer publishes an
//!   owner table that adds or drops that tenant.
//! * **Tenant slots** are recycled only after an epoch grace period following the sweep of
//!   their bits, with a new generation, so a stale [`TenantId`] never aliases a new tenant.
//!
//! # Eviction cost
//!
//! Each tenant keeps a lazy min-heap of its *leaves* (nodes it owns with no child it owns),
//! keyed by last-access time. Timestamps never decrease along a root-to-leaf path, so the oldest
//! timestamp group is always found at such leaves. Evicting `k` nodes costs
//! `O(k · (log h + σ))` amortized, where `h` is the heap size and `σ` the fan-out of the parents
//! visited (at most the alphabet size); a call that evicts nothing costs `O(1)`.

mod raw;

use crate::reclaim::{self, Guard};
use crate::sync::{self, AtomicUsize, Mutex, Ordering};
use crate::tenant::{Slots, TenantId, TenantSet};
use crate::text;
use raw::{ChildTable, Mask, Node, Owners, NO_PARENT};
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::ptr;
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
    /// [`MAX_TENANTS`] tenants are live already.
    TooManyTenants,
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
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeSnapshot {
    /// The node's edge text (empty at the root).
    pub text: String,
    /// Owners and their last-access times, by ascending tenant id.
    pub tenants: Vec<(TenantId, u64)>,
    /// Children, sorted by text.
    pub children: Vec<NodeSnapshot>,
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

/// Per-tenant LRU candidates: a lazy min-heap of `(last access, node id)` over the tenant's
/// leaves. Entries may be stale (the node's time rose, it gained a child of the tenant, or it
/// is gone); they are checked when popped. Every leaf of the tenant has an entry whose key is at
/// most its current time.
#[derive(Default)]
struct TenantLru {
    heap: BinaryHeap<LruEntry>,
    /// Nodes (other than the root) the tenant owns.
    nodes: usize,
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

/// State only the writer (holding `PrefixTree::writer`) touches.
struct WriterState {
    names: HashMap<Arc<str>, TenantId>,
    slot_names: Vec<Option<Arc<str>>>,
    /// Slots whose grace period has passed, ready for reuse.
    free_slots: Vec<u32>,
    /// Filled by deferred closures once a removed tenant's grace period has passed.
    released: sync::Arc<Mutex<Vec<u32>>>,
    next_slot: u32,
    lru: Vec<TenantLru>,
    /// Live nodes by id (null: free id). Lets LRU entries refer to nodes that may be gone.
    slab: Vec<*mut Node>,
    free_ids: Vec<u32>,
    scratch: Vec<(u32, u64)>,
    child_scratch: Vec<(u32, *mut Node)>,
}

// Safety: the raw node pointers in the slab are only dereferenced by the writer holding the
// mutex, and nodes are `Sync` data (atomics and immutable bytes).
unsafe impl Send for WriterState {}

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
    // empty and its owner table holds exactly the live tenants.
    root: *mut Node,
    slots: Slots,
    writer: sync::WriterLock<WriterState>,
    nodes: AtomicUsize,
    chars: AtomicUsize,
    bytes: AtomicUsize,
    origin: Instant,
    eviction: Mutex<Option<crate::evict::Running>>,
    retirer: reclaim::Retirer,
}

// Safety: all shared state is reached through atomics, epoch-protected immutable data, or the
// writer mutex; the root pointer is owned by the tree.
unsafe impl Send for PrefixTree {}
// Safety: as above; `&PrefixTree` methods synchronize through atomics and the mutex.
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

/// Path recorded by a lock-free descent: the root and each node whose whole edge matched.
const PATH_CAP: usize = 48;

struct PathBuf {
    nodes: [*const Node; PATH_CAP],
    len: usize,
    /// Bytes of text consumed by the recorded nodes.
    offset: usize,
    /// The descent consumed the whole text exactly at the last recorded node.
    exact: bool,
    /// Where the text left the tree after the last recorded node.
    div: Div,
}

/// How a lock-free descent left the tree (lets an insert prepare its nodes before locking).
#[derive(Clone, Copy)]
enum Div {
    /// Not known (the path was truncated or is exact).
    Unknown,
    /// The last recorded node has no child for the next char.
    NoChild,
    /// The text diverges `lcp` bytes into this child of the last recorded node.
    Partial { child: *const Node, lcp: usize },
}

/// Nodes of a split prepared before locking (text copied, links unset).
#[derive(Clone, Copy)]
struct SplitNodes {
    prefix: *mut Node,
    suffix: *mut Node,
    leaf: Option<*mut Node>,
}

/// The nodes an insert allocates and fills with text before it takes the writer lock, from
/// where its lock-free descent left the tree; under the lock they are used only if the tree
/// still diverges at the same place, and freed otherwise. Keeps allocation and copying out of
/// the critical section.
struct Prebuilt {
    /// The child to split (null: a plain new leaf under the last recorded node).
    split_child: *const Node,
    split_at: usize,
    split: Option<SplitNodes>,
    leaf: Option<*mut Node>,
}

impl Prebuilt {
    fn new(bytes: &[u8], path: &PathBuf, slot: usize, ts: u64) -> Self {
        let mut pre = Prebuilt {
            split_child: ptr::null(),
            split_at: 0,
            split: None,
            leaf: None,
        };
        let leaf = |text: &[u8]| {
            let n = Node::alloc_detached(text);
            let owners = Owners::from_sorted(&[(slot as u32, ts)]);
            // Safety: fresh and unpublished; the owner table is handed to it.
            unsafe { Node::adopt(n, u32::MAX, raw::DEAD, ptr::null_mut(), owners) };
            n
        };
        match path.div {
            Div::Unknown => {}
            Div::NoChild => pre.leaf = Some(leaf(&bytes[path.offset..])),
            Div::Partial { child, lcp } => {
                // Safety: recorded under the caller's guard, which is still held.
                let c = unsafe { &*child };
                if lcp > 0 && lcp < c.len() {
                    let edge = c.text();
                    let tail = &bytes[path.offset + lcp..];
                    pre.split_child = child;
                    pre.split_at = lcp;
                    pre.split = Some(SplitNodes {
                        prefix: Node::alloc_detached(&edge[..lcp]),
                        suffix: Node::alloc_detached(&edge[lcp..]),
                        leaf: (!tail.is_empty()).then(|| leaf(tail)),
                    });
                }
            }
        }
        pre
    }

    fn take_leaf(&mut self) -> Option<*mut Node> {
        self.leaf.take()
    }

    fn take_split(&mut self, child: &Node, at: usize) -> Option<SplitNodes> {
        if ptr::eq(self.split_child, child) && self.split_at == at {
            self.split.take()
        } else {
            None
        }
    }
}

impl Drop for Prebuilt {
    fn drop(&mut self) {
        let split = self
            .split
            .into_iter()
            .flat_map(|n| [Some(n.prefix), Some(n.suffix), n.leaf]);
        for n in self.leaf.into_iter().chain(split.flatten()) {
            // Safety: prepared nodes that were not taken were never published.
            unsafe { Node::free_unpublished(n) };
        }
    }
}

impl PathBuf {
    fn new() -> Self {
        Self {
            nodes: [ptr::null(); PATH_CAP],
            len: 0,
            offset: 0,
            exact: false,
            div: Div::Unknown,
        }
    }

    fn push(&mut self, n: &Node) -> bool {
        if self.len == PATH_CAP {
            return false;
        }
        self.nodes[self.len] = n;
        self.len += 1;
        true
    }

    fn iter<'g>(&self, _guard: &'g Guard) -> impl Iterator<Item = &'g Node> + '_ {
        // Safety: every recorded pointer was loaded under `_guard` from a published table, so
        // the node stays allocated while the guard lives (it is retired only after unlinking).
        self.nodes[..self.len].iter().map(|&p| unsafe { &*p })
    }
}

impl PrefixTree {
    /// An empty tree.
    pub fn new() -> Self {
        let root = Node::alloc(b"", 0, NO_PARENT, ptr::null_mut(), Owners::from_sorted(&[]));
        Self {
            root,
            slots: Slots::new(),
            writer: sync::WriterLock::new(WriterState {
                names: HashMap::new(),
                slot_names: Vec::new(),
                free_slots: Vec::new(),
                released: sync::Arc::new(Mutex::new(Vec::new())),
                next_slot: 0,
                lru: Vec::new(),
                slab: vec![root],
                free_ids: Vec::new(),
                scratch: Vec::new(),
                child_scratch: Vec::new(),
            }),
            nodes: AtomicUsize::new(0),
            chars: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            origin: Instant::now(),
            eviction: Mutex::new(None),
            retirer: reclaim::Retirer::new(),
        }
    }

    #[inline]
    fn root(&self) -> &Node {
        // Safety: the root lives as long as the tree (field invariant).
        unsafe { &*self.root }
    }

    /// The tree clock used by [`insert`](Self::insert): milliseconds since the tree was created.
    pub fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    pub(crate) fn eviction_slot(&self) -> &Mutex<Option<crate::evict::Running>> {
        &self.eviction
    }

    // ----------------------------------------------------------------------------------------
    // Tenants
    // ----------------------------------------------------------------------------------------

    /// Registers a tenant (replica) by name and returns its id; an existing name returns its id
    /// unchanged. Any string is a valid name.
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
        let guard = reclaim::pin();
        let mut w = self.writer.lock();
        if let Some(&t) = w.names.get(name) {
            return Ok(t);
        }
        let released: Vec<u32> = std::mem::take(&mut *sync::lock(&w.released));
        w.free_slots.extend(released);
        let slot = match w.free_slots.pop() {
            Some(s) => s,
            None if (w.next_slot as usize) < MAX_TENANTS => {
                let s = w.next_slot;
                w.next_slot += 1;
                s
            }
            None => return Err(Error::TooManyTenants),
        };
        self.slots.ensure(slot as usize, &guard);
        let table = self.slots.load(&guard);
        let gen = table.gen(slot as usize).wrapping_add(1) | 1;
        table.chars(slot as usize).store(0, Ordering::Relaxed);
        table.set_gen(slot as usize, gen);
        let t = TenantId::new(slot, gen);
        let name: Arc<str> = Arc::from(name);
        w.names.insert(name.clone(), t);
        let s = slot as usize;
        if w.slot_names.len() <= s {
            w.slot_names.resize(s + 1, None);
            w.lru.resize_with(s + 1, TenantLru::default);
        }
        w.slot_names[s] = Some(name);
        w.lru[s] = TenantLru::default();
        // The root is owned by exactly the live tenants.
        self.replace_owners(
            &mut w,
            self.root(),
            |e| {
                let i = e.partition_point(|x| x.0 < slot);
                e.insert(i, (slot, 0));
            },
            &guard,
        );
        Ok(t)
    }

    /// The id of the live tenant called `name`.
    pub fn tenant_id(&self, name: &str) -> Option<TenantId> {
        self.writer.lock().names.get(name).copied()
    }

    /// The name of a live tenant.
    pub fn tenant_name(&self, t: TenantId) -> Option<Arc<str>> {
        let guard = reclaim::pin();
        if !self.slots.load(&guard).is_live(t) {
            return None;
        }
        let w = self.writer.lock();
        // Under the writer lock the liveness check is authoritative.
        if !self.slots.load(&guard).is_live(t) {
            return None;
        }
        w.slot_names.get(t.slot())?.clone()
    }

    /// The live tenants, in ascending order.
    pub fn tenants(&self) -> Vec<TenantId> {
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        self.root()
            .owners()
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
        Some(table.chars(t.slot()).load(Ordering::Relaxed) as usize)
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
            let c = table.chars(t.slot()).load(Ordering::Relaxed);
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
                .owners()
                .slots()
                .for_each(|s| consider(table.id_of_seen(s))),
            Some(list) => list.iter().copied().for_each(&mut consider),
        }
        out.sort_unstable();
        out
    }

    // ----------------------------------------------------------------------------------------
    // Reads
    // ----------------------------------------------------------------------------------------

    /// The longest prefix of `text` stored in the tree, walking only into nodes owned by at
    /// least one of `available` (`None`: all live tenants; `Some(&[])`: none; unknown ids are
    /// ignored). A partial match inside the last node counts. Read-only and lock-free.
    ///
    /// ```
    /// let tree = kvtrie::PrefixTree::new();
    /// let a = tree.add_tenant("a");
    /// tree.insert("hello", a).unwrap();
    /// assert_eq!(tree.prefix_match("help", None).matched_chars, 3);
    /// assert_eq!(tree.prefix_match("help", Some(&[])).matched_chars, 0);
    /// ```
    pub fn prefix_match(&self, text: &str, available: Option<&[TenantId]>) -> PrefixMatch {
        let mut out = PrefixMatch::default();
        self.prefix_match_into(text, available, &mut out);
        out
    }

    /// [`prefix_match`](Self::prefix_match) writing into caller-owned storage: allocates
    /// nothing once `out.tenants` has room for the result (and no id in `available` has a slot
    /// of 1024 or more).
    pub fn prefix_match_into(
        &self,
        text: &str,
        available: Option<&[TenantId]>,
        out: &mut PrefixMatch,
    ) {
        let guard = reclaim::pin();
        let mut stack_words = [0u64; 16];
        let mut heap_words = Vec::new();
        let mask = self.mask(available, &mut stack_words, &mut heap_words, &guard);
        self.walk::<false>(text.as_bytes(), mask, out, &mut PathBuf::new(), &guard);
    }

    /// Routes and records in one descent: matches `text` like
    /// [`prefix_match_into`](Self::prefix_match_into), lets `choose` pick a tenant from the
    /// result, then inserts `text` for it at time `ts`, reusing the path the match walked (no
    /// second comparison of the text). Returns the chosen tenant (`None` if `choose` declined).
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
        let mut heap_words = Vec::new();
        let mask = self.mask(available, &mut stack_words, &mut heap_words, &guard);
        let mut path = PathBuf::new();
        self.walk::<true>(text.as_bytes(), mask, out, &mut path, &guard);
        let Some(t) = choose(out) else {
            return Ok(None);
        };
        if !self.slots.load(&guard).is_live(t) {
            return Err(Error::UnknownTenant(t));
        }
        if text.is_empty() || (path.exact && self.touch_path(&path, t.slot(), ts, &guard)) {
            return Ok(Some(t));
        }
        let mut pre = Prebuilt::new(text.as_bytes(), &path, t.slot(), ts);
        self.insert_locked(text.as_bytes(), t, ts, &path, &mut pre, &guard)
            .map(|()| Some(t))
    }

    /// The available tenants as a bit mask: the root's owner bits (all live tenants) for `None`,
    /// else the live ids of the list, in `stack` (or `heap` beyond 1024 slots).
    fn mask<'a>(
        &self,
        available: Option<&[TenantId]>,
        stack: &'a mut [u64; 16],
        heap: &'a mut Vec<u64>,
        guard: &'a Guard,
    ) -> Mask<'a> {
        let table = self.slots.load(guard);
        match available {
            None => {
                // Safety: the root lives as long as the tree, which outlives this call; its
                // owner table is protected by `guard`.
                let o = unsafe { &*self.root }.owners();
                Mask {
                    lo: o.lo(),
                    words: o.bits(),
                }
            }
            Some(list) => {
                let max = list
                    .iter()
                    .filter(|t| table.is_live(**t))
                    .map(|t| t.slot())
                    .max();
                let words: &mut [u64] = match max {
                    Some(m) if m >= 64 * stack.len() => {
                        heap.resize(m / 64 + 1, 0);
                        heap
                    }
                    Some(m) => &mut stack[..m / 64 + 1],
                    None => &mut stack[..0],
                };
                for t in list {
                    // `get_mut`: an id may turn live between the two passes (never index out of
                    // bounds on a racing `add_tenant`); such an id is simply not available.
                    if let Some(w) = words.get_mut(t.slot() / 64).filter(|_| table.is_live(*t)) {
                        *w |= 1 << (t.slot() % 64);
                    }
                }
                Mask { lo: 0, words }
            }
        }
    }

    /// The lock-free descent shared by reads and routing. Matches along `bytes` into `out`
    /// (stopping before a child no tenant of `mask` owns; a partial match in the last node
    /// counts). With `RECORD`, keeps descending through whole-edge matches regardless of
    /// owners and records that path for an insert.
    #[inline]
    fn walk<const RECORD: bool>(
        &self,
        bytes: &[u8],
        mask: Mask<'_>,
        out: &mut PrefixMatch,
        path: &mut PathBuf,
        guard: &Guard,
    ) {
        let table = self.slots.load(guard);
        let root = self.root();
        let mut node = root;
        // The deepest node of the match, seen through one read of its owners: the result set
        // is built from the same read that admitted the node.
        let mut matched = root.owner_view(mask);
        // An empty mask (e.g. a plain insert) matches nothing: only record.
        let mut matching = mask.words.iter().any(|&w| w != 0);
        // Recording stops when the path buffer is full; matching goes on.
        let mut recording = RECORD;
        let (mut mb, mut mc) = (0usize, 0usize);
        let mut off = 0usize;
        if RECORD {
            path.push(root);
        }
        while off < bytes.len() {
            let rest = &bytes[off..];
            let Some(child) = node.child(text::edge_key(rest)) else {
                if recording {
                    path.div = Div::NoChild;
                }
                break;
            };
            let edge = child.text();
            let full = text::starts_with(rest, edge);
            if recording && !full {
                path.div = Div::Partial {
                    child,
                    lcp: text::common_prefix(edge, rest),
                };
            }
            if matching {
                let view = child.owner_view(mask);
                if view.any() {
                    matched = view;
                    if full {
                        mb += edge.len();
                        mc += child.chars();
                    } else {
                        let l = text::common_prefix(edge, rest);
                        debug_assert!(l > 0, "a child's first char equals its key");
                        mb += l;
                        mc += if child.is_ascii() {
                            l
                        } else {
                            text::char_count(&rest[..l])
                        };
                    }
                } else {
                    matching = false;
                }
            }
            if !full || !(recording || matching) {
                break;
            }
            if recording && !path.push(child) {
                // Path full: keep matching, record no more (the insert re-walks the rest).
                recording = false;
                path.offset = off;
                if !matching {
                    break;
                }
            }
            off += edge.len();
            node = child;
        }
        if recording {
            path.offset = off;
            path.exact = off == bytes.len();
        }
        out.matched_bytes = mb;
        out.matched_chars = mc;
        out.tenants.clear();
        matched.for_each(mask, |s| out.tenants.push_ascending(table.id_of_seen(s)));
    }

    // ----------------------------------------------------------------------------------------
    // Inserts
    // ----------------------------------------------------------------------------------------

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

    /// The lock-free insert: every node on `path` must already be owned by `slot`; raises the
    /// timestamps top-down. Returns false (nothing to undo: raising is idempotent) when the
    /// insert must be redone under the lock.
    fn touch_path(&self, path: &PathBuf, slot: usize, ts: u64, guard: &Guard) -> bool {
        if !path.iter(guard).all(|n| n.owners().contains(slot)) {
            return false;
        }
        for n in path.iter(guard) {
            let o = n.owners();
            let Some(cell) = o.ts_of(slot) else {
                return false;
            };
            if cell.load(Ordering::Relaxed) < ts {
                cell.fetch_max(ts, Ordering::SeqCst);
                // Pairs with the fence in `Owners::mark_superseded` (checkable by loom).
                sync::fence(Ordering::SeqCst);
                // See `Owners::mark_superseded`: if the table was replaced, the raise may have
                // been lost in the copy; redo under the lock.
                if o.is_superseded() {
                    return false;
                }
            }
        }
        true
    }

    fn insert_locked(
        &self,
        bytes: &[u8],
        t: TenantId,
        ts: u64,
        path: &PathBuf,
        pre: &mut Prebuilt,
        guard: &Guard,
    ) -> Result<(), Error> {
        let mut w = self.writer.lock();
        if !self.slots.load(guard).is_live(t) {
            return Err(Error::UnknownTenant(t));
        }
        let slot = t.slot();
        // Nodes are never moved: a recorded node that is not dead is still linked under the
        // recorded parent with the same edge, so the prefix of the path up to the first dead
        // node is still valid and need not be compared again.
        let valid = path.iter(guard).take_while(|n| !n.is_dead()).count();
        let whole_path = valid == path.len;
        let mut recorded = path.iter(guard).skip(1).take(valid.saturating_sub(1));
        let mut node = self.root();
        self.attach(&mut w, node, slot, ts, guard);
        let mut off = 0;
        while off < bytes.len() {
            let rest = &bytes[off..];
            // Nodes prepared before locking apply only where the descent left the tree.
            let at_div = whole_path && off == path.offset;
            let (child, l) = match recorded.next() {
                Some(c) => (c, c.len()),
                None => match node.child(text::edge_key(rest)) {
                    Some(c) => (c, text::common_prefix(c.text(), rest)),
                    None => {
                        let leaf = if at_div { pre.take_leaf() } else { None };
                        self.add_leaf(&mut w, node, rest, slot, ts, leaf, guard);
                        return Ok(());
                    }
                },
            };
            if l < child.len() {
                // Split, attach and (if the text goes on) the new leaf, in one step.
                let tail = &bytes[off + l..];
                let nodes = if at_div {
                    pre.take_split(child, l)
                } else {
                    None
                };
                let (p, newly) = self.split(&mut w, node, child, l, slot, ts, tail, nodes, guard);
                if newly && tail.is_empty() {
                    self.push_lru(&mut w, slot, ts, p.id, guard);
                }
                return Ok(());
            }
            let newly = self.attach(&mut w, child, slot, ts, guard);
            off += l;
            if newly && off == bytes.len() {
                // The text ends here and `t` owns no child of it (prefix closure): a new leaf
                // of `t`.
                self.push_lru(&mut w, slot, ts, child.id, guard);
            }
            node = child;
        }
        Ok(())
    }

    /// Makes `slot` an owner of `node` with time at least `ts`; returns whether it was new (and
    /// charges it). Writer lock held.
    fn attach(
        &self,
        w: &mut WriterState,
        node: &Node,
        slot: usize,
        ts: u64,
        guard: &Guard,
    ) -> bool {
        let o = node.owners();
        if let Some(cell) = o.ts_of(slot) {
            cell.fetch_max(ts, Ordering::SeqCst);
            return false;
        }
        let s = slot as u32;
        self.replace_owners(
            w,
            node,
            |e| {
                let i = e.partition_point(|x| x.0 < s);
                e.insert(i, (s, ts));
            },
            guard,
        );
        if !ptr::eq(node, self.root()) {
            self.credit(slot, node.chars() as u64, true, guard);
            w.lru[slot].nodes += 1;
        }
        true
    }

    /// Publishes a copy of `node`'s owner table edited by `edit`; retires the old one (or, if
    /// the edit leaves no owner on a non-root node, prunes the node). Writer lock held.
    fn replace_owners(
        &self,
        w: &mut WriterState,
        node: &Node,
        edit: impl FnOnce(&mut Vec<(u32, u64)>),
        guard: &Guard,
    ) {
        let old = node.owners_ptr();
        let mut e = std::mem::take(&mut w.scratch);
        // Safety: never null; only the writer (us) replaces it.
        unsafe { &*old }.snapshot_for_replace(&mut e);
        edit(&mut e);
        if e.is_empty() && !ptr::eq(node, self.root()) {
            w.scratch = e;
            self.prune(w, node, guard);
            return;
        }
        let new = Owners::from_sorted(&e);
        w.scratch = e;
        node.set_owners(new);
        // Safety: `old` is no longer reachable from the node (just replaced), retired once;
        // readers that loaded it hold a guard pinned earlier.
        unsafe { self.retirer.retire(guard, old) };
    }

    fn credit(&self, slot: usize, chars: u64, add: bool, guard: &Guard) {
        let c = self.slots.load(guard).chars(slot);
        if add {
            c.fetch_add(chars, Ordering::Relaxed);
        } else {
            c.fetch_sub(chars, Ordering::Relaxed);
        }
    }

    /// Reserves a node id (its slab slot is filled by `publish_id`).
    fn reserve_id(w: &mut WriterState) -> u32 {
        match w.free_ids.pop() {
            Some(id) => id,
            None => {
                w.slab.push(ptr::null_mut());
                (w.slab.len() - 1) as u32
            }
        }
    }

    /// Allocates a leaf holding `rest` with parent `parent_id`, owned by `slot` at `ts`, and
    /// does its bookkeeping (ids, counters, accounting, LRU); the caller links it. Writer lock
    /// held.
    #[allow(clippy::too_many_arguments)]
    fn new_leaf(
        &self,
        w: &mut WriterState,
        parent_id: u32,
        rest: &[u8],
        slot: usize,
        ts: u64,
        pre: Option<*mut Node>,
        guard: &Guard,
    ) -> *mut Node {
        let id = Self::reserve_id(w);
        let leaf = match pre {
            Some(p) => {
                debug_assert!(
                    // Safety: a prepared node is alive and unpublished.
                    unsafe { &*p }.text() == rest,
                    "prepared leaf holds this text"
                );
                // Safety: `p` is unpublished and ours; it already has its owner table.
                unsafe { Node::adopt(p, id, parent_id, ptr::null_mut(), ptr::null_mut()) };
                p
            }
            None => Node::alloc(
                rest,
                id,
                parent_id,
                ptr::null_mut(),
                Owners::from_sorted(&[(slot as u32, ts)]),
            ),
        };
        w.slab[id as usize] = leaf;
        // Safety: `leaf` was just allocated and is not shared yet.
        let leaf_ref = unsafe { &*leaf };
        self.nodes.fetch_add(1, Ordering::Relaxed);
        self.chars.fetch_add(leaf_ref.chars(), Ordering::Relaxed);
        self.bytes.fetch_add(leaf_ref.len(), Ordering::Relaxed);
        self.credit(slot, leaf_ref.chars() as u64, true, guard);
        w.lru[slot].nodes += 1;
        self.push_lru(w, slot, ts, id, guard);
        leaf
    }

    /// Adds a leaf holding `rest` under `parent` for `slot`. Writer lock held.
    #[allow(clippy::too_many_arguments)]
    fn add_leaf(
        &self,
        w: &mut WriterState,
        parent: &Node,
        rest: &[u8],
        slot: usize,
        ts: u64,
        pre: Option<*mut Node>,
        guard: &Guard,
    ) {
        let leaf = self.new_leaf(w, parent.id, rest, slot, ts, pre, guard);
        let old = parent.children.load(Ordering::Acquire);
        let mut e = std::mem::take(&mut w.child_scratch);
        e.clear();
        if let Some(t) = parent.children() {
            e.extend(t.iter());
        }
        let key = text::edge_key(rest);
        let i = e.partition_point(|x| x.0 < key);
        debug_assert!(e.get(i).is_none_or(|x| x.0 != key), "duplicate child key");
        e.insert(i, (key, leaf));
        parent
            .children
            .store(ChildTable::from_sorted(&e), Ordering::Release);
        w.child_scratch = e;
        if !old.is_null() {
            // Safety: `old` was just replaced in the only place that published it, retired once.
            unsafe { self.retirer.retire(guard, old) };
        }
    }

    /// Splits `child` (of `parent`) after `at` bytes (a char boundary) for an insert by `slot`
    /// at `ts` whose text continues with `tail` after the split point. The new prefix node takes
    /// `child`'s place with `child`'s owners plus `slot`; the suffix keeps `child`'s owners,
    /// times, children and id; a non-empty `tail` becomes a new leaf of `slot` under the prefix,
    /// built in the same step. Returns the prefix and whether `slot` newly owns it. Writer lock
    /// held.
    #[allow(clippy::too_many_arguments)]
    fn split<'g>(
        &self,
        w: &mut WriterState,
        parent: &Node,
        child: &Node,
        at: usize,
        slot: usize,
        ts: u64,
        tail: &[u8],
        pre: Option<SplitNodes>,
        guard: &'g Guard,
    ) -> (&'g Node, bool) {
        debug_assert!(at > 0 && at < child.len());
        let edge = child.text();
        let old_owners = child.owners_ptr();
        let mut e = std::mem::take(&mut w.scratch);
        // Safety: never null; only the writer replaces it. Marks it superseded so a concurrent
        // lock-free raise either lands before our copy or retries.
        unsafe { &*old_owners }.snapshot_for_replace(&mut e);
        let children = child.children.load(Ordering::Acquire);
        let pid = Self::reserve_id(w);
        // The suffix takes over the child's id, so the grandchildren's parent ids and the LRU
        // entries that name the child stay valid.
        let suffix_owners = Owners::from_sorted(&e);
        let suffix = match pre {
            Some(n) => {
                // Safety: a prepared node is unpublished and ours; it holds `edge[at..]`.
                unsafe { Node::adopt(n.suffix, child.id, pid, children, suffix_owners) };
                n.suffix
            }
            None => Node::alloc(&edge[at..], child.id, pid, children, suffix_owners),
        };
        for &(s, _) in &e {
            w.lru[s as usize].nodes += 1;
        }
        let s32 = slot as u32;
        let newly = match e.binary_search_by_key(&s32, |x| x.0) {
            Ok(i) => {
                e[i].1 = e[i].1.max(ts);
                false
            }
            Err(i) => {
                e.insert(i, (s32, ts));
                true
            }
        };
        let mut kids = std::mem::take(&mut w.child_scratch);
        kids.clear();
        kids.push((text::edge_key(&edge[at..]), suffix));
        if !tail.is_empty() {
            let leaf = self.new_leaf(w, pid, tail, slot, ts, pre.and_then(|n| n.leaf), guard);
            kids.push((text::edge_key(tail), leaf));
            kids.sort_unstable_by_key(|x| x.0);
        }
        let kids_table = ChildTable::from_sorted(&kids);
        let prefix_owners = Owners::from_sorted(&e);
        let prefix = match pre {
            Some(n) => {
                // Safety: a prepared node is unpublished and ours; it holds `edge[..at]`.
                unsafe { Node::adopt(n.prefix, pid, parent.id, kids_table, prefix_owners) };
                n.prefix
            }
            None => Node::alloc(&edge[..at], pid, parent.id, kids_table, prefix_owners),
        };
        w.child_scratch = kids;
        w.scratch = e;
        w.slab[pid as usize] = prefix;
        w.slab[child.id as usize] = suffix;
        // Safety: `prefix` is fresh; it is published just below and lives until retired.
        let p = unsafe { &*prefix };
        if newly {
            self.credit(slot, p.chars() as u64, true, guard);
            w.lru[slot].nodes += 1;
        }
        let table = parent
            .children()
            .expect("a child's parent has a child table");
        let i = table.find(text::edge_key(edge)).expect("child is linked");
        // The swap returns the pointer with the allocation's provenance (a pointer derived
        // from `child: &Node` may not be used to free it).
        let old = table.slots()[i].swap(prefix, Ordering::AcqRel);
        debug_assert!(ptr::eq(old, child));
        child.mark_dead();
        // Safety: `child` was just unlinked (its slot now holds `prefix`) and is retired once;
        // its child table now belongs to `suffix`, and `Node::destroy` does not free it.
        unsafe { self.retirer.retire(guard, old) };
        self.nodes.fetch_add(1, Ordering::Relaxed);
        (p, newly)
    }

    /// Unlinks and retires an owner-less node (which has no children). Writer lock held.
    fn prune(&self, w: &mut WriterState, node: &Node, guard: &Guard) {
        debug_assert!(node.children().is_none(), "pruned nodes are leaves");
        let parent = self
            .slab_node(w, node.parent.load(Ordering::Relaxed))
            .expect("the parent of a linked node is linked");
        let old = parent.children.load(Ordering::Acquire);
        let key = text::edge_key(node.text());
        let e: Vec<(u32, *mut Node)> = parent
            .children()
            .expect("a child's parent has a child table")
            .iter()
            .filter(|x| x.0 != key)
            .collect();
        parent
            .children
            .store(ChildTable::from_sorted(&e), Ordering::Release);
        // Safety: `old` was replaced in the only place that published it; retired once.
        unsafe { self.retirer.retire(guard, old) };
        node.mark_dead();
        // The slab's pointer carries the allocation's provenance (one derived from `&Node`
        // may not be used to free it).
        let p = std::mem::replace(&mut w.slab[node.id as usize], ptr::null_mut());
        debug_assert!(ptr::eq(p, node));
        w.free_ids.push(node.id);
        self.nodes.fetch_sub(1, Ordering::Relaxed);
        self.chars.fetch_sub(node.chars(), Ordering::Relaxed);
        self.bytes.fetch_sub(node.len(), Ordering::Relaxed);
        // Safety: unlinked just above, retired once; its owner table (superseded by the caller)
        // is freed with it.
        unsafe { self.retirer.retire(guard, p) };
    }

    /// Removes `slot` from `node` (which has no child owned by `slot`); debits it and prunes
    /// the node if it has no owner left. Returns the chars debited. Writer lock held.
    fn detach(&self, w: &mut WriterState, node: &Node, slot: usize, guard: &Guard) -> usize {
        self.detach_if(w, node, slot, None, guard).unwrap_or(0)
    }

    /// [`detach`](Self::detach), but when `only_at` is given, only if `slot`'s time is still
    /// exactly that value in the table snapshot taken (superseded) for the replacement: a
    /// lock-free insert that raised the time concurrently either lands in that snapshot (and
    /// the node is kept and re-queued with its new time) or retries under the lock after us.
    /// Returns the chars debited, `None` if kept.
    fn detach_if(
        &self,
        w: &mut WriterState,
        node: &Node,
        slot: usize,
        only_at: Option<u64>,
        guard: &Guard,
    ) -> Option<usize> {
        if !node.owners().contains(slot) {
            return Some(0);
        }
        let chars = node.chars();
        let s = slot as u32;
        let mut kept = None;
        self.replace_owners(
            w,
            node,
            |e| {
                if let Some(i) = e.iter().position(|x| x.0 == s) {
                    match only_at {
                        Some(m) if e[i].1 != m => kept = Some(e[i].1),
                        _ => {
                            e.remove(i);
                        }
                    }
                }
            },
            guard,
        );
        if let Some(ts) = kept {
            self.push_lru(w, slot, ts, node.id, guard);
            return None;
        }
        self.credit(slot, chars as u64, false, guard);
        w.lru[slot].nodes -= 1;
        Some(chars)
    }

    fn owns_a_child(node: &Node, slot: usize, guard: &Guard) -> bool {
        let _ = guard;
        node.children().is_some_and(|t| {
            t.iter().any(|(_, xchild)| {
                // Safety: children of a live table are live under the guard.
                unsafe { &*xchild }.owners().contains(slot)
            })
        })
    }

    fn push_lru(&self, w: &mut WriterState, slot: usize, ts: u64, id: u32, guard: &Guard) {
        let lru = &mut w.lru[slot];
        lru.heap.push(LruEntry::new(ts, id));
        if lru.heap.len() > 2 * lru.nodes + 64 {
            self.compact_lru(w, slot, guard);
        }
    }

    /// Rebuilds `slot`'s heap from its valid entries (amortized against the pushes since the
    /// last rebuild).
    fn compact_lru(&self, w: &mut WriterState, slot: usize, guard: &Guard) {
        let old = std::mem::take(&mut w.lru[slot].heap).into_vec();
        let mut keep: Vec<LruEntry> = Vec::with_capacity(w.lru[slot].nodes);
        let mut seen = std::collections::HashSet::new();
        for LruEntry { id, .. } in old {
            let Some(node) = self.slab_node(w, id) else {
                continue;
            };
            let Some(cell) = node.owners().ts_of(slot) else {
                continue;
            };
            if Self::owns_a_child(node, slot, guard) || !seen.insert(id) {
                continue;
            }
            keep.push(LruEntry::new(cell.load(Ordering::Relaxed), id));
        }
        w.lru[slot].heap = BinaryHeap::from(keep);
    }

    fn slab_node<'a>(&self, w: &WriterState, id: u32) -> Option<&'a Node> {
        let p = *w.slab.get(id as usize)?;
        // Safety: slab entries are live nodes (cleared under the writer lock before a node is
        // retired), and the caller holds the writer lock and a guard.
        unsafe { p.as_ref() }
    }

    // ----------------------------------------------------------------------------------------
    // Removal and eviction
    // ----------------------------------------------------------------------------------------

    /// Removes tenant `t` from every node, pruning nodes left without owners; returns the chars
    /// removed (0 for an unknown or already removed tenant). Its id becomes invalid; its slot is
    /// reused, with a new generation, only after a grace period.
    pub fn remove_tenant(&self, t: TenantId) -> usize {
        let guard = reclaim::pin();
        let mut w = self.writer.lock();
        let table = self.slots.load(&guard);
        if !table.is_live(t) {
            return 0;
        }
        let slot = t.slot();
        table.set_gen(slot, t.generation().wrapping_add(1));
        let s = slot as u32;
        self.replace_owners(&mut w, self.root(), |e| e.retain(|x| x.0 != s), &guard);
        // Pre-order list of the nodes `t` owns (prefix closure: they form a subtree at the
        // root), then detach in reverse, children before parents.
        let mut order: Vec<*const Node> = Vec::new();
        let mut stack: Vec<&Node> = vec![self.root()];
        while let Some(n) = stack.pop() {
            if let Some(ct) = n.children() {
                for (_, xchild) in ct.iter() {
                    // Safety: children of a live table are live under the guard.
                    let c = unsafe { &*xchild };
                    if c.owners().contains(slot) {
                        order.push(c);
                        stack.push(c);
                    }
                }
            }
        }
        let mut removed = 0;
        for &n in order.iter().rev() {
            // Safety: collected under our guard and writer lock; only we unlink nodes, and we
            // only unlink each after its descendants, so it is still live here.
            removed += self.detach(&mut w, unsafe { &*n }, slot, &guard);
        }
        table.chars(slot).store(0, Ordering::Relaxed);
        w.lru[slot] = TenantLru::default();
        if let Some(name) = w.slot_names[slot].take() {
            w.names.remove(&name);
        }
        let released = w.released.clone();
        reclaim::defer(&guard, move || sync::lock(&released).push(s));
        // Removals are rare and retire many objects at once: hand them (and the deferred slot
        // release) to the global queue now, so they are freed after the grace period instead
        // of when this thread's batches and bag fill.
        self.retirer.flush(&guard);
        removed
    }

    /// Evicts tenant `t`'s least recently used text until at least `min_chars` chars were
    /// removed or `t` owns nothing: repeatedly takes the oldest last-access time among `t`'s
    /// nodes and removes `t` from every node it owns with that time (a whole timestamp group,
    /// leaves before parents), pruning nodes left without owners. Returns the chars removed,
    /// which may exceed `min_chars` (as in Ray); 0 if `min_chars == 0` or `t` is unknown.
    pub fn evict_tenant_by_lru(&self, t: TenantId, min_chars: usize) -> usize {
        if min_chars == 0 {
            return 0;
        }
        let guard = reclaim::pin();
        let mut w = self.writer.lock();
        if !self.slots.load(&guard).is_live(t) {
            return 0;
        }
        let mut removed = 0;
        while removed < min_chars {
            match self.evict_oldest_group(&mut w, t.slot(), &guard) {
                Some(n) => removed += n,
                None => break,
            }
        }
        removed
    }

    /// Evicts at most `max_groups` of `t`'s oldest timestamp groups, stopping once `min_chars`
    /// were removed; returns the chars removed and whether `t` still owns something. Bounded
    /// work per writer-lock acquisition, for the background thread.
    pub(crate) fn evict_batch(
        &self,
        t: TenantId,
        min_chars: usize,
        max_groups: usize,
    ) -> (usize, bool) {
        let guard = reclaim::pin();
        let mut w = self.writer.lock();
        if !self.slots.load(&guard).is_live(t) {
            return (0, false);
        }
        let mut removed = 0;
        for _ in 0..max_groups {
            if removed >= min_chars {
                break;
            }
            match self.evict_oldest_group(&mut w, t.slot(), &guard) {
                Some(n) => removed += n,
                None => return (removed, false),
            }
        }
        (removed, w.lru[t.slot()].nodes > 0)
    }

    /// Global LRU: evicts at most `max_groups` of the oldest timestamp groups across all
    /// tenants, stopping once the tree's distinct chars dropped by `min_chars`; returns the
    /// distinct chars removed and whether anything is left to evict.
    pub(crate) fn evict_global_batch(&self, min_chars: usize, max_groups: usize) -> (usize, bool) {
        let guard = reclaim::pin();
        let mut w = self.writer.lock();
        let before = self.distinct_chars();
        let slots: Vec<usize> = self.root().owners().slots().collect();
        for _ in 0..max_groups {
            if before.saturating_sub(self.distinct_chars()) >= min_chars {
                break;
            }
            let mut best: Option<(u64, usize)> = None;
            for &s in &slots {
                if let Some(ts) = self.oldest(&mut w, s, &guard) {
                    if best.is_none_or(|b| ts < b.0) {
                        best = Some((ts, s));
                    }
                }
            }
            let Some((_, s)) = best else {
                return (before.saturating_sub(self.distinct_chars()), false);
            };
            self.evict_oldest_group(&mut w, s, &guard);
        }
        (
            before.saturating_sub(self.distinct_chars()),
            self.node_count() > 0,
        )
    }

    /// The oldest last-access time among `slot`'s nodes, found at its leaves.
    fn oldest(&self, w: &mut WriterState, slot: usize, guard: &Guard) -> Option<u64> {
        loop {
            let e = *w.lru[slot].heap.peek()?;
            let (key, id) = (e.ts(), e.id);
            match self.check_entry(w, slot, key, id, guard) {
                Entry::Leaf => return Some(key),
                Entry::Newer(cur) => {
                    w.lru[slot].heap.pop();
                    w.lru[slot].heap.push(LruEntry::new(cur, id));
                }
                Entry::Stale => {
                    w.lru[slot].heap.pop();
                }
            }
        }
    }

    /// Classifies a heap entry of `slot`.
    fn check_entry(&self, w: &WriterState, slot: usize, key: u64, id: u32, guard: &Guard) -> Entry {
        let Some(node) = self.slab_node(w, id) else {
            return Entry::Stale;
        };
        let Some(cell) = node.owners().ts_of(slot) else {
            return Entry::Stale;
        };
        let cur = cell.load(Ordering::Relaxed);
        // `cur < key`: the id was reused by a node with its own (smaller) entry.
        if cur < key || Self::owns_a_child(node, slot, guard) {
            Entry::Stale
        } else if cur > key {
            Entry::Newer(cur)
        } else {
            Entry::Leaf
        }
    }

    /// Removes `slot` from its whole oldest timestamp group; returns the chars removed, or
    /// `None` if it owns nothing.
    fn evict_oldest_group(&self, w: &mut WriterState, slot: usize, guard: &Guard) -> Option<usize> {
        let m = self.oldest(w, slot, guard)?;
        let mut removed = 0;
        while let Some(&e) = w.lru[slot].heap.peek() {
            let (key, id) = (e.ts(), e.id);
            if key != m {
                break;
            }
            w.lru[slot].heap.pop();
            match self.check_entry(w, slot, key, id, guard) {
                Entry::Stale => continue,
                Entry::Newer(cur) => {
                    w.lru[slot].heap.push(LruEntry::new(cur, id));
                    continue;
                }
                Entry::Leaf => {}
            }
            let node = self.slab_node(w, id).expect("checked");
            let parent_p = node.parent.load(Ordering::Relaxed);
            let Some(n) = self.detach_if(w, node, slot, Some(m), guard) else {
                continue; // raised concurrently: no longer in this group
            };
            removed += n;
            let parent = self
                .slab_node(w, parent_p)
                .expect("the parent of a linked node is linked");
            if !ptr::eq(parent, self.root()) && !Self::owns_a_child(parent, slot, guard) {
                if let Some(cell) = parent.owners().ts_of(slot) {
                    // The parent became a leaf of `slot`; if its time is `m` it joins this group
                    // (popped next, as `m` is minimal).
                    let pts = cell.load(Ordering::Relaxed);
                    w.lru[slot].heap.push(LruEntry::new(pts, parent.id));
                }
            }
        }
        Some(removed)
    }

    // ----------------------------------------------------------------------------------------
    // Introspection
    // ----------------------------------------------------------------------------------------

    /// Nodes in the tree, not counting the root.
    pub fn node_count(&self) -> usize {
        self.nodes.load(Ordering::Relaxed)
    }

    /// Distinct chars stored (sum of edge lengths).
    pub fn distinct_chars(&self) -> usize {
        self.chars.load(Ordering::Relaxed)
    }

    /// Distinct bytes stored (sum of edge lengths in bytes).
    pub fn distinct_bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Size figures, computed by a full walk under the writer lock (O(nodes)).
    pub fn stats(&self) -> TreeStats {
        let guard = reclaim::pin();
        let w = self.writer.lock();
        let mut s = TreeStats::default();
        let mut stack = vec![self.root()];
        while let Some(n) = stack.pop() {
            if !ptr::eq(n, self.root()) {
                s.nodes += 1;
                s.chars += n.chars();
                s.bytes += n.len();
            }
            s.heap_bytes += n.bytes() + n.owners().bytes();
            if let Some(t) = n.children() {
                s.heap_bytes += ChildTable::bytes(t.len());
                for (_, xchild) in t.iter() {
                    // Safety: children of a live table are live under the guard.
                    stack.push(unsafe { &*xchild });
                }
            }
        }
        let table = self.slots.load(&guard);
        s.heap_bytes += table.capacity() * 12
            + w.slab.capacity() * std::mem::size_of::<*mut Node>()
            + w.free_ids.capacity() * 4
            + w.lru.iter().map(|l| l.heap.capacity() * 16).sum::<usize>();
        s.tenants = self.root().owners().len();
        s
    }

    /// The whole tree as plain data: children sorted by text, owners by tenant id.
    pub fn snapshot(&self) -> NodeSnapshot {
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        // Iterative: collect nodes in pre-order with their parent index, then assemble
        // bottom-up (no recursion, so arbitrarily deep trees are fine).
        let mut nodes: Vec<(usize, NodeSnapshot)> = Vec::new();
        let mut stack: Vec<(usize, &Node)> = vec![(usize::MAX, self.root())];
        while let Some((parent, n)) = stack.pop() {
            let o = n.owners();
            let tenants = o
                .slots()
                .zip(o.ts())
                .map(|(s, ts)| {
                    // A slot added after `table` was loaded is in a newer table.
                    let id = if s < table.capacity() {
                        table.id_of_seen(s)
                    } else {
                        self.slots.load(&guard).id_of_seen(s)
                    };
                    (id, ts.load(Ordering::Relaxed))
                })
                .collect();
            let idx = nodes.len();
            nodes.push((
                parent,
                NodeSnapshot {
                    text: String::from_utf8_lossy(n.text()).into_owned(),
                    tenants,
                    children: Vec::new(),
                },
            ));
            if let Some(t) = n.children() {
                for (_, xchild) in t.iter() {
                    // Safety: children of a live table are live under the guard.
                    stack.push((idx, unsafe { &*xchild }));
                }
            }
        }
        while nodes.len() > 1 {
            let (parent, mut snap) = nodes.pop().expect("len > 1");
            snap.children.sort_by(|a, b| a.text.cmp(&b.text));
            nodes[parent].1.children.push(snap);
        }
        let mut root = nodes.pop().map(|x| x.1).unwrap_or_default();
        root.children.sort_by(|a, b| a.text.cmp(&b.text));
        root
    }

    /// Checks the structural invariants (for tests; O(nodes), under the writer lock):
    /// exact per-tenant char counts (recount), prefix closure, non-empty edges with distinct
    /// first chars, no owner-less node, valid UTF-8 edges, consistent parent links and counters.
    pub fn check_invariants(&self) -> Result<(), String> {
        let guard = reclaim::pin();
        let w = self.writer.lock();
        let table = self.slots.load(&guard);
        let mut recount: HashMap<usize, u64> = HashMap::new();
        let (mut nodes, mut chars, mut bytes) = (0usize, 0usize, 0usize);
        let mut stack = vec![self.root()];
        while let Some(n) = stack.pop() {
            let is_root = ptr::eq(n, self.root());
            let o = n.owners();
            if !is_root {
                nodes += 1;
                chars += n.chars();
                bytes += n.len();
                if n.len() == 0 {
                    return Err("non-root node with an empty edge".into());
                }
                if std::str::from_utf8(n.text()).is_err() {
                    return Err(format!("edge is not valid UTF-8: {:?}", n.text()));
                }
                if n.chars() != text::char_count(n.text()) {
                    return Err("stored char length is wrong".into());
                }
                if o.len() == 0 {
                    return Err(format!(
                        "owner-less node {:?} is reachable",
                        String::from_utf8_lossy(n.text())
                    ));
                }
                if n.is_dead() {
                    return Err("a dead node is reachable".into());
                }
                if w.slab.get(n.id as usize).copied() != Some(n as *const Node as *mut Node) {
                    return Err("slab does not map the node's id to it".into());
                }
                for s in o.slots() {
                    *recount.entry(s).or_default() += n.chars() as u64;
                }
            } else {
                for s in o.slots() {
                    if !table.is_live(table.id_of_seen(s)) {
                        return Err(format!("root owned by dead slot {s}"));
                    }
                }
            }
            if let Some(t) = n.children() {
                if t.len() == 0 {
                    return Err("empty child table".into());
                }
                let mut prev = None;
                for (xkey, xchild) in t.iter() {
                    // Safety: children of a live table are live under the guard.
                    let c = unsafe { &*xchild };
                    if prev.is_some_and(|p| p >= xkey) {
                        return Err("child keys not strictly ascending".into());
                    }
                    prev = Some(xkey);
                    if c.len() == 0 || text::edge_key(c.text()) != xkey {
                        return Err("child key differs from its first char".into());
                    }
                    if c.parent.load(Ordering::Relaxed) != n.id {
                        return Err("wrong parent link".into());
                    }
                    for s in c.owners().slots() {
                        if !o.contains(s) {
                            return Err(format!(
                                "prefix closure: slot {s} owns {:?} but not its parent",
                                String::from_utf8_lossy(c.text())
                            ));
                        }
                    }
                    stack.push(c);
                }
            }
        }
        for s in self.root().owners().slots() {
            let have = table.chars(s).load(Ordering::Relaxed);
            let want = recount.get(&s).copied().unwrap_or(0);
            if have != want {
                return Err(format!("slot {s}: char count {have}, recount {want}"));
            }
            if w.lru[s].nodes != self.count_owned(s) {
                return Err(format!("slot {s}: node count off"));
            }
        }
        if (nodes, chars, bytes)
            != (
                self.node_count(),
                self.distinct_chars(),
                self.distinct_bytes(),
            )
        {
            return Err("node/char/byte counters differ from a recount".into());
        }
        Ok(())
    }

    fn count_owned(&self, slot: usize) -> usize {
        let mut n = 0;
        let mut stack = vec![self.root()];
        while let Some(x) = stack.pop() {
            if let Some(t) = x.children() {
                for (_, c) in t.iter() {
                    // Safety: children of a live table are live under the caller's guard.
                    let c = unsafe { &*c };
                    if c.owners().contains(slot) {
                        n += 1;
                        stack.push(c);
                    }
                }
            }
        }
        n
    }

    /// Forces this thread's retired objects toward reclamation (tests and benchmarks use it so
    /// reclamation really happens while small workloads run).
    pub fn collect_garbage(&self) {
        let guard = reclaim::pin();
        self.retirer.flush(&guard);
        drop(guard);
        for _ in 0..4 {
            let guard = reclaim::pin();
            reclaim::flush(&guard);
        }
    }

    /// Hands every partially filled batch of retired objects to the reclaimer (after bulk
    /// retirements: eviction passes, tenant removal).
    pub(crate) fn flush_retired(&self) {
        let guard = reclaim::pin();
        self.retirer.flush(&guard);
    }

    /// Objects this tree retired (replaced or unlinked nodes and tables) that the epoch
    /// reclaimer has not freed yet, and their heap bytes. O(1).
    ///
    /// Retired objects are batched and handed to the reclaimer in bulk, so the backlog stays
    /// bounded under any sustained load: a constant (a few partial batches) plus what the tree
    /// retires while every thread pinned at a retirement finishes its operation.
    pub fn retired_backlog(&self) -> RetiredBacklog {
        let b = self.retirer.backlog();
        RetiredBacklog {
            objects: b.objects,
            bytes: b.bytes,
        }
    }
}

impl Drop for PrefixTree {
    fn drop(&mut self) {
        if let Some(running) = self.eviction.get_mut().ok().and_then(|e| e.take()) {
            running.stop_and_join();
        }
        // Exclusive access: free every reachable node with its tables.
        let mut stack = vec![self.root];
        while let Some(p) = stack.pop() {
            // Safety: `&mut self`: no other thread can reach the tree; every reachable node,
            // owner table and child table is owned by the tree and freed exactly once here
            // (retired ones are no longer reachable and are freed by the reclaimer).
            unsafe {
                let ct = (*p).children.load(Ordering::Relaxed);
                if let Some(t) = ct.as_ref() {
                    for (_, xchild) in t.iter() {
                        stack.push(xchild);
                    }
                    ChildTable::destroy(ct);
                }
                Owners::destroy((*p).owners_ptr());
                Node::free_alone(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        t.collect_garbage();
    }
}
