//! Tenants (replicas): dense slot ids with generations, result sets, and the lock-free slot table.

use crate::reclaim::{self, Guard};
use crate::sync::{AtomicPtr, AtomicU32, Ordering};
use crossbeam_utils::CachePadded;
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

/// The generation a tree gives a slot's first tenant: odd, and drawn per tree (a mixed
/// process-wide counter, below 2^30, so that a slot still has over a billion reuses before its
/// generations run out). An id issued by one tree therefore names, in another tree, a
/// generation that tree has almost surely never issued (the chance that two trees share their
/// first generation is 2^-29), and is rejected there as unknown instead of acting on whichever
/// tenant holds the same slot. Under loom, 1 (models stay deterministic).
pub(crate) fn first_generation() -> u32 {
    #[cfg(loom)]
    {
        1
    }
    #[cfg(not(loom))]
    {
        let k = crate::sync::next_tree_number();
        (crate::rng::mix64(k.wrapping_mul(crate::rng::GOLDEN)) as u32 & ((1 << 30) - 1)) | 1
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
/// in it, even once removed) and a pointer to the slot's own state `S` (allocated when the
/// slot is first used, reused by later tenants of the slot, freed with the [`Slots`]).
pub(crate) struct SlotTable<S> {
    gens: Box<[AtomicU32]>,
    // Invariant: null (slot never used) or a `Box<CachePadded<S>>` from `Box::into_raw`, owned
    // by the `Slots` and freed only by its `Drop`; copied, never moved, when the table grows.
    states: Box<[AtomicPtr<CachePadded<S>>]>,
}

impl<S> SlotTable<S> {
    fn with_capacity(cap: usize) -> Self {
        Self {
            gens: (0..cap).map(|_| AtomicU32::new(0)).collect(),
            states: (0..cap)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.gens.len()
    }

    /// The current generation of `slot` (0 for slots never used).
    #[inline]
    pub(crate) fn gen(&self, slot: usize) -> u32 {
        // Acquire: pairs with the Release in `set_gen`.
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

    /// The state of `slot`, if the slot was ever used.
    #[inline]
    pub(crate) fn state(&self, slot: usize) -> Option<&S> {
        // Acquire: pairs with the Release in `Slots::ensure`, so the state is initialized.
        let p = self.states.get(slot)?.load(Ordering::Acquire);
        // Safety: null or a state owned by the `Slots` this table belongs to, freed only when
        // the `Slots` is dropped, which cannot happen while the table (borrowed from it, or
        // from its epoch-protected history) is borrowed.
        unsafe { p.as_ref() }.map(|s| &**s)
    }

    /// Sets `slot`'s generation (`SeqCst`: see [`Slots::is_live_after_publish`]).
    pub(crate) fn set_gen(&self, slot: usize, gen: u32) {
        self.gens[slot].store(gen, Ordering::SeqCst);
    }
}

/// The slot table behind an atomic pointer: readers load it lock-free; the registry (one
/// writer at a time, the caller's lock) grows it by copying into a larger table and retiring
/// the old one.
pub(crate) struct Slots<S> {
    // Invariant: never null; points to a table published with Release that stays allocated
    // until retired after being replaced (by the registry's holder).
    table: AtomicPtr<SlotTable<S>>,
}

#[cfg(not(loom))]
const INITIAL_SLOTS: usize = 64;
#[cfg(loom)]
const INITIAL_SLOTS: usize = 2;

impl<S: Send + Sync + 'static> Slots<S> {
    pub(crate) fn new() -> Self {
        Self {
            table: AtomicPtr::new(Box::into_raw(Box::new(SlotTable::with_capacity(
                INITIAL_SLOTS,
            )))),
        }
    }

    /// Is `t` live, as one side of a store-buffering handshake: a `SeqCst` fence, then the
    /// *current* table's generation with a `SeqCst` load. A writer that published a change for
    /// `t` and then finds `t` dead must undo it; the remover bumps the generation (`SeqCst`, in
    /// the current table: growth and removal both happen under the registry lock) before it
    /// sweeps, so either the sweep sees the change or this check sees the removal. The table is
    /// reloaded after the fence: one loaded earlier may have been replaced by a growth.
    pub(crate) fn is_live_after_publish(&self, t: TenantId, guard: &Guard) -> bool {
        crate::sync::fence(Ordering::SeqCst);
        self.load(guard)
            .gens
            .get(t.slot())
            .is_some_and(|g| g.load(Ordering::SeqCst) == t.generation())
    }

    /// The state of `slot`, if the slot was ever used, borrowed from the `Slots` itself rather
    /// than from a guard: a state is freed only when the `Slots` is dropped (a table replaced
    /// by a growth hands its states to the new one), so a long operation may hold the state's
    /// lock across re-pins.
    pub(crate) fn state_of(&self, slot: usize) -> Option<&S> {
        self.state_in(slot, &reclaim::pin())
    }

    /// [`Self::state_of`] under the caller's guard (which only reads the current table): the
    /// state outlives the guard.
    pub(crate) fn state_in(&self, slot: usize, guard: &Guard) -> Option<&S> {
        let p = self.load(guard).states.get(slot)?.load(Ordering::Acquire);
        // Safety: null or a state owned by this `Slots` (see `SlotTable::state`), freed only
        // when the `Slots` is dropped, which cannot happen while `self` is borrowed.
        unsafe { p.as_ref() }.map(|s| &**s)
    }

    /// The current table, valid while `guard` is held.
    #[inline]
    pub(crate) fn load<'g>(&'g self, _guard: &'g Guard) -> &'g SlotTable<S> {
        // Safety: the pointer is never null, and a replaced table is retired through the epoch
        // reclaimer, so it stays allocated while `_guard` (pinned before this load) lives.
        unsafe { &*self.table.load(Ordering::Acquire) }
    }

    /// Makes sure `slot` fits and has a state (`init()` for a slot never used). For the one
    /// writer of the registry (the caller's lock).
    pub(crate) fn ensure(&self, slot: usize, init: impl FnOnce() -> S, guard: &Guard) {
        let table = self.reserve(slot, guard);
        if table.states[slot].load(Ordering::Relaxed).is_null() {
            let state = Box::into_raw(Box::new(CachePadded::new(init())));
            // Release: pairs with the Acquire in `SlotTable::state`.
            table.states[slot].store(state, Ordering::Release);
        }
    }

    /// Makes sure `slot` fits (a state is made only by [`Self::ensure`]); returns the current
    /// table. For the one writer of the registry (the caller's lock).
    pub(crate) fn reserve<'g>(&'g self, slot: usize, guard: &'g Guard) -> &'g SlotTable<S> {
        let old = self.table.load(Ordering::Acquire);
        // Safety: see `load`; the caller's lock excludes concurrent growth.
        let cur = unsafe { &*old };
        if slot < cur.capacity() {
            return cur;
        }
        let cap = (slot + 1).next_power_of_two().max(cur.capacity() * 2);
        let new = SlotTable::with_capacity(cap);
        for i in 0..cur.capacity() {
            new.gens[i].store(cur.gens[i].load(Ordering::Relaxed), Ordering::Relaxed);
            new.states[i].store(cur.states[i].load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let new = Box::into_raw(Box::new(new));
        // Release: readers that Acquire-load the table see its contents.
        self.table.store(new, Ordering::Release);
        // Safety: `old` was just unlinked (the only shared pointer to it is replaced) and is
        // retired once; a reader still holding it sees the same states and slightly stale
        // generations (slots are only added here).
        unsafe { reclaim::retire(guard, old, drop_slot_table::<S>) };
        // Safety: just published; replaced only by this writer, and retired through the epoch
        // reclaimer, so it stays allocated while `guard` lives.
        unsafe { &*new }
    }
}

/// # Safety
///
/// `p` came from `Box::into_raw` and no thread holds it any more. The per-slot states it points
/// to are not freed (the live table and the `Slots` own them).
unsafe fn drop_slot_table<S>(p: *mut SlotTable<S>) {
    // Safety: forwarded to the caller.
    drop(unsafe { Box::from_raw(p) });
}

impl<S> Drop for Slots<S> {
    fn drop(&mut self) {
        // Safety: `&mut self`: no reader can hold the current table any more.
        let table = unsafe { Box::from_raw(self.table.load(Ordering::Relaxed)) };
        for s in table.states.iter() {
            let p = s.load(Ordering::Relaxed);
            if !p.is_null() {
                // Safety: each state is owned by the `Slots` (invariant) and freed once, here.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A slot's generation is odd while its tenant is live and even once it is removed; a
    /// reader pinned across the removal names the bit it saw by the live generation, or the
    /// one just before the removed one (never the next tenant's).
    #[test]
    fn id_of_seen_names_the_live_or_the_just_removed_tenant() {
        let slots: Slots<()> = Slots::new();
        let guard = reclaim::pin();
        slots.ensure(3, || (), &guard);
        let table = slots.load(&guard);
        table.set_gen(3, 7);
        assert_eq!(table.id_of_seen(3), TenantId::new(3, 7));
        assert!(table.is_live(TenantId::new(3, 7)));
        table.set_gen(3, 8);
        assert_eq!(table.id_of_seen(3), TenantId::new(3, 7));
        assert!(!table.is_live(TenantId::new(3, 7)));
    }

    /// A slot at or past the capacity grows the table to the next power of two above the slot
    /// (even straight from 64 slots to slot 128, past double), keeping every earlier slot's
    /// generation and state; a slot below the capacity leaves the table as it is.
    #[test]
    fn reserve_grows_to_fit_the_slot_and_keeps_earlier_slots() {
        let slots: Slots<usize> = Slots::new();
        let guard = reclaim::pin();
        slots.ensure(5, || 5, &guard);
        slots.load(&guard).set_gen(5, 9);
        slots.ensure(INITIAL_SLOTS - 1, || 63, &guard);
        assert_eq!(slots.load(&guard).capacity(), INITIAL_SLOTS);
        slots.ensure(2 * INITIAL_SLOTS, || 128, &guard);
        assert_eq!(slots.load(&guard).capacity(), 4 * INITIAL_SLOTS);
        assert_eq!(
            slots.reserve(4 * INITIAL_SLOTS, &guard).capacity(),
            8 * INITIAL_SLOTS
        );
        let table = slots.load(&guard);
        assert_eq!(table.capacity(), 8 * INITIAL_SLOTS);
        assert_eq!((table.gen(5), table.gen(6), table.gen(9999)), (9, 0, 0));
        assert_eq!(table.state(5), Some(&5));
        assert_eq!(table.state(INITIAL_SLOTS - 1), Some(&63));
        assert_eq!(table.state(2 * INITIAL_SLOTS), Some(&128));
        assert_eq!(
            (table.state(6), table.state(4 * INITIAL_SLOTS)),
            (None, None)
        );
        assert_eq!(slots.state_of(5), Some(&5));
    }

    /// Dropping the slots drops each slot's state exactly once, whether it was made before or
    /// after a growth (a replaced table hands its states on and frees none of them).
    #[test]
    fn dropping_the_slots_drops_every_state_once() {
        use crate::sync::{Arc, AtomicUsize};
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let slots: Slots<Counted> = Slots::new();
        {
            let guard = reclaim::pin();
            for s in [0, 3, 3, 200] {
                slots.ensure(s, || Counted(drops.clone()), &guard);
            }
            slots.reserve(1000, &guard);
        }
        assert_eq!(drops.load(Ordering::Relaxed), 0);
        drop(slots);
        assert_eq!(drops.load(Ordering::Relaxed), 3);
    }

    /// The writer's side of the removal handshake: live only while the current table holds the
    /// id's own generation (not after the removal bumps it, not for a slot past the table).
    #[test]
    fn is_live_after_publish_is_false_once_the_generation_moves_on() {
        let slots: Slots<()> = Slots::new();
        let guard = reclaim::pin();
        slots.ensure(2, || (), &guard);
        slots.load(&guard).set_gen(2, 5);
        assert!(slots.is_live_after_publish(TenantId::new(2, 5), &guard));
        assert!(!slots.is_live_after_publish(TenantId::new(2, 7), &guard));
        slots.load(&guard).set_gen(2, 6);
        assert!(!slots.is_live_after_publish(TenantId::new(2, 5), &guard));
        assert!(!slots.is_live_after_publish(TenantId::new(999, 1), &guard));
        // After a growth the current table is read, not one loaded before it.
        let old = slots.load(&guard);
        slots.reserve(999, &guard).set_gen(999, 1);
        assert_eq!(old.gen(999), 0);
        assert!(slots.is_live_after_publish(TenantId::new(999, 1), &guard));
    }
}
