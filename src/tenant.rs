//! Tenants (replicas): dense slot ids with generations, result sets, and the lock-free slot table.

use crate::reclaim::{self, Guard};
use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::fmt;

/// A tenant (replica) of a [`PrefixTree`](crate::PrefixTree).
///
/// A small `Copy` handle: a dense slot plus a generation. Slots of removed tenants are reused
/// only after a grace period, with a new generation, so a stale id never aliases a new tenant:
/// operations with a removed tenant's id are rejected or are no-ops.
///
/// ```
/// let tree = kvtrie::PrefixTree::new();
/// let a = tree.add_tenant("replica-a");
/// assert_eq!(tree.tenant_id("replica-a"), Some(a));
/// assert_eq!(&*tree.tenant_name(a).unwrap(), "replica-a");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantId {
    slot: u32,
    gen: u32,
}

impl TenantId {
    pub(crate) fn new(slot: u32, gen: u32) -> Self {
        debug_assert!(gen & 1 == 1, "live generations are odd");
        Self { slot, gen }
    }

    /// The dense slot of this tenant (reused, with a new generation, after removal).
    pub fn slot(self) -> usize {
        self.slot as usize
    }

    /// The generation of the slot this id was issued for.
    pub fn generation(self) -> u32 {
        self.gen
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantId({}#{})", self.slot, self.gen)
    }
}

/// A set of tenants, as returned by [`PrefixTree::prefix_match`](crate::PrefixTree::prefix_match).
///
/// Iterates in ascending [`TenantId`] order. Reusing one `TenantSet` across calls
/// (`prefix_match_into`) allocates nothing once its capacity suffices.
///
/// ```
/// let tree = kvtrie::PrefixTree::new();
/// let a = tree.add_tenant("a");
/// tree.insert("abc", a).unwrap();
/// let m = tree.prefix_match("abd", None);
/// assert!(m.tenants.contains(a));
/// assert_eq!(m.tenants.iter().collect::<Vec<_>>(), vec![a]);
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct TenantSet {
    ids: Vec<TenantId>,
}

impl TenantSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// The tenants, in ascending order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = TenantId> + '_ {
        self.ids.iter().copied()
    }

    /// The tenants as a sorted slice.
    pub fn as_slice(&self) -> &[TenantId] {
        &self.ids
    }

    /// Number of tenants.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Is the set empty?
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Does the set contain `t`?
    pub fn contains(&self, t: TenantId) -> bool {
        self.ids.binary_search(&t).is_ok()
    }

    /// Removes every tenant, keeping the capacity.
    pub fn clear(&mut self) {
        self.ids.clear();
    }

    /// Adds a tenant whose slot is larger than every slot in the set.
    pub(crate) fn push_ascending(&mut self, t: TenantId) {
        debug_assert!(self.ids.last().is_none_or(|l| l.slot < t.slot));
        self.ids.push(t);
    }
}

impl fmt::Debug for TenantSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.ids.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a TenantSet {
    type Item = TenantId;
    type IntoIter = std::iter::Copied<std::slice::Iter<'a, TenantId>>;
    fn into_iter(self) -> Self::IntoIter {
        self.ids.iter().copied()
    }
}

impl FromIterator<TenantId> for TenantSet {
    fn from_iter<I: IntoIterator<Item = TenantId>>(iter: I) -> Self {
        let mut ids: Vec<TenantId> = iter.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        Self { ids }
    }
}

/// Per-slot state readable without locks: the slot's generation (odd while a tenant is live
/// in it, even once removed) and the tenant's char count.
pub(crate) struct SlotTable {
    gens: Box<[AtomicU32]>,
    chars: Box<[AtomicU64]>,
}

impl SlotTable {
    fn with_capacity(cap: usize) -> Self {
        Self {
            gens: (0..cap).map(|_| AtomicU32::new(0)).collect(),
            chars: (0..cap).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.gens.len()
    }

    /// The current generation of `slot` (0 for slots never used).
    #[inline]
    pub(crate) fn gen(&self, slot: usize) -> u32 {
        self.gens.get(slot).map_or(0, |g| g.load(Ordering::Acquire))
    }

    /// Is `t` the live tenant of its slot?
    #[inline]
    pub(crate) fn is_live(&self, t: TenantId) -> bool {
        self.gen(t.slot()) == t.gen
    }

    /// The id of the tenant whose bit a reader pinned since before the tenant's removal saw in
    /// `slot`: the current generation if live, else the one just before it (a slot is reused
    /// only after a grace period, so it cannot have advanced further while the reader is pinned).
    #[inline]
    pub(crate) fn id_of_seen(&self, slot: usize) -> TenantId {
        let g = self.gen(slot);
        TenantId::new(slot as u32, if g & 1 == 1 { g } else { g.wrapping_sub(1) })
    }

    pub(crate) fn chars(&self, slot: usize) -> &AtomicU64 {
        &self.chars[slot]
    }

    pub(crate) fn set_gen(&self, slot: usize, gen: u32) {
        self.gens[slot].store(gen, Ordering::Release);
    }
}

/// The slot table behind an atomic pointer: readers load it lock-free; the writer (holding the
/// tree's writer lock) grows it by copying into a larger table and retiring the old one.
pub(crate) struct Slots {
    // Invariant: never null; points to a table published with Release that stays allocated
    // until retired after being replaced (under the writer lock).
    table: AtomicPtr<SlotTable>,
}

#[cfg(not(loom))]
const INITIAL_SLOTS: usize = 64;
#[cfg(loom)]
const INITIAL_SLOTS: usize = 2;

impl Slots {
    pub(crate) fn new() -> Self {
        Self {
            table: AtomicPtr::new(Box::into_raw(Box::new(SlotTable::with_capacity(
                INITIAL_SLOTS,
            )))),
        }
    }

    /// The current table, valid while `guard` is held.
    #[inline]
    pub(crate) fn load<'g>(&self, _guard: &'g Guard) -> &'g SlotTable {
        // Safety: the pointer is never null, and a replaced table is retired through the epoch
        // reclaimer, so it stays allocated while `_guard` (pinned before this load) lives.
        unsafe { &*self.table.load(Ordering::Acquire) }
    }

    /// Makes sure `slot` fits; writer lock held.
    pub(crate) fn ensure(&self, slot: usize, guard: &Guard) {
        let old = self.table.load(Ordering::Acquire);
        // Safety: see `load`; the writer lock (held by the caller) excludes concurrent growth.
        let cur = unsafe { &*old };
        if slot < cur.capacity() {
            return;
        }
        let cap = (slot + 1).next_power_of_two().max(cur.capacity() * 2);
        let new = SlotTable::with_capacity(cap);
        for i in 0..cur.capacity() {
            new.gens[i].store(cur.gens[i].load(Ordering::Relaxed), Ordering::Relaxed);
            new.chars[i].store(cur.chars[i].load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.table
            .store(Box::into_raw(Box::new(new)), Ordering::Release);
        // Safety: `old` was just unlinked (the only shared pointer to it is replaced) and is
        // retired once; only the writer mutates counts, and it now writes the new table, so a
        // reader still holding the old one reads a frozen, slightly stale copy.
        unsafe { reclaim::retire(guard, old, drop_slot_table) };
    }
}

/// # Safety
///
/// `p` came from `Box::into_raw` and no thread holds it any more.
unsafe fn drop_slot_table(p: *mut SlotTable) {
    // Safety: forwarded to the caller.
    drop(unsafe { Box::from_raw(p) });
}

impl Drop for Slots {
    fn drop(&mut self) {
        // Safety: `&mut self`: no reader can hold the current table any more.
        drop(unsafe { Box::from_raw(self.table.load(Ordering::Relaxed)) });
    }
}
