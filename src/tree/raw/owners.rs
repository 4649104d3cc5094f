//! Owner tables: which tenants own a node, with their last-access times; owner masks.

use crate::reclaim::Retire;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
use std::alloc::dealloc;
use std::alloc::{alloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

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

/// The size class of an owner table: its number of membership words and of owners (what its
/// allocation's size depends on).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Shape {
    nwords: usize,
    n: usize,
}

impl Shape {
    /// Bytes of a table of this shape.
    pub(super) fn size(self) -> usize {
        Owners::layout(self.nwords, self.n).0.size()
    }

    /// The shape of `t`.
    pub(super) fn of(t: &Owners) -> Shape {
        Shape {
            nwords: t.nwords as usize,
            n: t.len(),
        }
    }
}

impl Owners {
    fn layout(nwords: usize, n: usize) -> (Layout, usize, usize) {
        let (l, bits_off) = Layout::new::<Owners>()
            .extend(Layout::array::<u64>(nwords).expect("owners layout"))
            .expect("owners layout");
        let (l, ts_off) = l
            .extend(Layout::array::<AtomicU64>(n).expect("owners layout"))
            .expect("owners layout");
        debug_assert_eq!((bits_off, ts_off), (Self::BITS_OFF, Self::ts_off(nwords)));
        (l.pad_to_align(), bits_off, ts_off)
    }

    /// Offset of the membership words (what [`Self::layout`] computes, without its overflow
    /// checks: the accessors run on every raise and lookup).
    const BITS_OFF: usize = size_of::<Owners>().next_multiple_of(align_of::<u64>());

    /// Offset of the timestamps after `nwords` words (see [`Self::BITS_OFF`]).
    #[inline]
    fn ts_off(nwords: usize) -> usize {
        (Self::BITS_OFF + nwords * size_of::<u64>()).next_multiple_of(align_of::<AtomicU64>())
    }

    /// Allocates a table from `(slot, ts)` pairs in strictly ascending slot order.
    pub(super) fn alloc(entries: &[(u32, u64)]) -> *mut Owners {
        let n = entries.len();
        let (lo, nwords) = match (entries.first(), entries.last()) {
            (Some(f), Some(l)) => {
                let lo = f.0 as usize / 64;
                (lo, l.0 as usize / 64 + 1 - lo)
            }
            _ => (0, 0),
        };
        let (p, bits, ts) = Self::alloc_uninit(lo, nwords, n);
        debug_assert!(
            entries.windows(2).all(|w| w[0].0 < w[1].0),
            "slots ascending"
        );
        for (i, &(slot, t)) in entries.iter().enumerate() {
            let w = slot as usize / 64 - lo;
            // Safety: word `w < nwords`, zeroed by `alloc_uninit` and not shared yet.
            unsafe { *bits.wrapping_add(w) |= 1u64 << (slot % 64) };
            // Safety: timestamp `i < n` of the fresh allocation, not shared yet.
            unsafe { ts.wrapping_add(i).write(AtomicU64::new(t)) };
        }
        p
    }

    /// A copy of `old`, plus `add`'s slot at its time if given (the slot's time raised to it
    /// if it already owns the node), built directly from `old`'s words and times (read now,
    /// with `SeqCst`; see [`Owners::mark_superseded`]). Returns the table and whether `add`'s
    /// slot is new.
    fn alloc_from(old: &Owners, add: Option<(usize, u64)>) -> (*mut Owners, bool) {
        let shape = Self::shape_from(old, add);
        let p = Self::alloc_raw(shape.nwords, shape.n);
        // Safety: a fresh allocation of the table's layout for `shape_from(old, add)`, not
        // shared.
        let added = unsafe { Self::init_from(p, old, add) };
        (p, added)
    }

    /// The shape of the table [`Self::init_from`] builds from `old` and `add`: the same for
    /// every time `add` carries, and for a copy of `old` in place of `old`.
    pub(super) fn shape_from(old: &Owners, add: Option<(usize, u64)>) -> Shape {
        let (lo, bits, n) = (old.lo(), old.bits(), old.len());
        let Some((slot, _)) = add else {
            return Shape {
                nwords: bits.len(),
                n,
            };
        };
        let w = slot / 64;
        let nwords = if n == 0 {
            1
        } else {
            (lo + bits.len()).max(w + 1) - lo.min(w)
        };
        Shape {
            nwords,
            n: n + usize::from(!old.contains(slot)),
        }
    }

    /// Writes a copy of `old` plus `add` (as [`Self::alloc_from`] describes) into `p`; returns
    /// whether `add`'s slot is new.
    ///
    /// # Safety
    ///
    /// `p` is valid for writes of `Self::shape_from(old, add).size()` bytes, aligned for
    /// `Owners`, `u64` and `AtomicU64`, holds no initialized table (or one already dropped) and
    /// is not shared.
    pub(super) unsafe fn init_from(
        p: *mut Owners,
        old: &Owners,
        add: Option<(usize, u64)>,
    ) -> bool {
        debug_assert!(p.cast::<AtomicU64>().is_aligned());
        let added = match *old.bits() {
            [word] if add.is_none_or(|(slot, _)| slot / 64 == old.lo()) => {
                // Safety: forwarded (caller's contract).
                unsafe { Self::init_from_word(p, old.lo(), word, old.ts(), add) }
            }
            // Safety: forwarded (caller's contract).
            _ => unsafe { Self::init_from_words(p, old, add) },
        };
        #[cfg(debug_assertions)]
        {
            // Safety: just initialized; not shared.
            let built = Shape::of(unsafe { &*p });
            assert_eq!(built, Self::shape_from(old, add), "shape_from agrees");
        }
        added
    }

    /// [`Self::init_from`] for any table and any `add`.
    ///
    /// # Safety
    ///
    /// As for [`Self::init_from`].
    unsafe fn init_from_words(p: *mut Owners, old: &Owners, add: Option<(usize, u64)>) -> bool {
        let (old_lo, old_bits, old_ts) = (old.lo(), old.bits(), old.ts());
        let (mut lo, mut hi) = (old_lo, old_lo + old_bits.len());
        // Where `add` goes among the times, and whether it is new.
        let mut at = None;
        if let Some((slot, ts)) = add {
            let w = slot / 64;
            (lo, hi) = if old_ts.is_empty() {
                (w, w + 1)
            } else {
                (lo.min(w), hi.max(w + 1))
            };
            at = Some((old.rank_below(slot), !old.contains(slot), ts));
        }
        let added = at.is_some_and(|a| a.1);
        let n = old_ts.len() + usize::from(added);
        debug_assert_eq!(Self::shape_from(old, add), Shape { nwords: hi - lo, n });
        // Safety: `p` has room for this shape (caller's contract, checked above in debug).
        let (bits, new_ts) = unsafe { Self::init_uninit(p, lo, hi - lo, n) };
        for (i, &b) in old_bits.iter().enumerate() {
            // Safety: word `old_lo + i - lo < hi - lo` of the new table, not shared yet.
            unsafe { *bits.wrapping_add(old_lo + i - lo) = b };
        }
        if let Some((slot, _)) = add {
            // Safety: word `slot / 64 - lo < hi - lo` of the new table, not shared yet.
            unsafe { *bits.wrapping_add(slot / 64 - lo) |= 1u64 << (slot % 64) };
        }
        let read = |i: usize| old_ts[i].load(Ordering::SeqCst);
        for i in 0..n {
            let t = match at {
                Some((rank, true, ts)) if i == rank => ts,
                Some((rank, false, ts)) if i == rank => read(i).max(ts),
                Some((rank, true, _)) if i > rank => read(i - 1),
                _ => read(i),
            };
            // Safety: timestamp `i < n` of the new table, not shared yet.
            unsafe { new_ts.wrapping_add(i).write(AtomicU64::new(t)) };
        }
        added
    }

    /// [`Self::init_from`] for a table of one membership word (at most 64 tenants, the common
    /// case) with `add` in that word: the same table, without the general range and rank
    /// arithmetic.
    ///
    /// # Safety
    ///
    /// As for [`Self::init_from`], `old` being the table of word `lo`, `word` and times
    /// `old_ts`.
    unsafe fn init_from_word(
        p: *mut Owners,
        lo: usize,
        word: u64,
        old_ts: &[AtomicU64],
        add: Option<(usize, u64)>,
    ) -> bool {
        let read = |i: usize| old_ts[i].load(Ordering::SeqCst);
        let (word, at) = match add {
            None => (word, None),
            Some((slot, ts)) => {
                let bit = 1u64 << (slot % 64);
                let rank = (word & (bit - 1)).count_ones() as usize;
                (word | bit, Some((rank, word & bit == 0, ts)))
            }
        };
        let added = at.is_some_and(|a| a.1);
        let n = old_ts.len() + usize::from(added);
        // Safety: `p` has room for one word and `n` times (caller's contract: the shape
        // `Self::shape_from` gives for a one-word table and an `add` within its word).
        let (bits, new_ts) = unsafe { Self::init_uninit(p, lo, 1, n) };
        // Safety: the table's only word, not shared yet.
        unsafe { *bits = word };
        let write = |i: usize, t: u64| {
            // Safety: timestamp `i < n` of the new table, not shared yet.
            unsafe { new_ts.wrapping_add(i).write(AtomicU64::new(t)) };
        };
        match at {
            None => (0..n).for_each(|i| write(i, read(i))),
            Some((rank, true, ts)) => {
                (0..rank).for_each(|i| write(i, read(i)));
                write(rank, ts);
                (rank..old_ts.len()).for_each(|i| write(i + 1, read(i)));
            }
            Some((rank, false, ts)) => {
                (0..n).for_each(|i| write(i, if i == rank { read(i).max(ts) } else { read(i) }));
            }
        }
        added
    }

    /// Allocates room for a table of `nwords` words and `n` timestamps (uninitialized).
    fn alloc_raw(nwords: usize, n: usize) -> *mut Owners {
        let (layout, _, _) = Self::layout(nwords, n);
        // Safety: non-zero size (the header is not empty).
        let p = unsafe { alloc(layout) }.cast::<Owners>();
        if p.is_null() {
            handle_alloc_error(layout);
        }
        p
    }

    /// Allocates a table with `nwords` zeroed membership words from word `lo` and room for `n`
    /// timestamps, which the caller must all write before the table is read or freed. Returns
    /// the table and pointers to its words and timestamps.
    fn alloc_uninit(lo: usize, nwords: usize, n: usize) -> (*mut Owners, *mut u64, *mut AtomicU64) {
        let p = Self::alloc_raw(nwords, n);
        // Safety: a fresh allocation of the table's layout, not shared.
        let (bits, ts) = unsafe { Self::init_uninit(p, lo, nwords, n) };
        (p, bits, ts)
    }

    /// Writes the header and zeroed membership words of a table (as [`Self::alloc_uninit`])
    /// into `p`; returns pointers to its words and timestamps.
    ///
    /// # Safety
    ///
    /// `p` is valid for writes of `Self::layout(nwords, n)`, aligned for it, and not shared.
    unsafe fn init_uninit(
        p: *mut Owners,
        lo: usize,
        nwords: usize,
        n: usize,
    ) -> (*mut u64, *mut AtomicU64) {
        let lo16 = u16::try_from(lo).expect("tenant slots are bounded");
        let nwords16 = u16::try_from(nwords).expect("tenant slots are bounded");
        let (_, bits_off, ts_off) = Self::layout(nwords, n);
        let header = Owners {
            meta: AtomicU32::new(n as u32),
            lo: lo16,
            nwords: nwords16,
            #[cfg(loom)]
            poison: Default::default(),
        };
        // Safety: `p` is valid for the layout and aligned for the header (caller's contract).
        unsafe { p.write(header) };
        // The memory holds `nwords` words at `bits_off` and `n` atomics at `ts_off`, each
        // aligned as `Layout::extend` computed; we initialize the words.
        let bits = p.cast::<u8>().wrapping_add(bits_off).cast::<u64>();
        let ts = p.cast::<u8>().wrapping_add(ts_off).cast::<AtomicU64>();
        for i in 0..nwords {
            // Safety: word `i < nwords` of the memory (see above), not shared.
            unsafe { bits.wrapping_add(i).write(0) };
        }
        (bits, ts)
    }

    /// Writes a table of shape `shape` with no owners' bits set and all times 0 into `p`: room
    /// for a table, initialized (so that its shape can be read back), to be filled by
    /// [`Self::init_from`] before it is shared, or left unused (dead room).
    ///
    /// # Safety
    ///
    /// `p` is valid for writes of `shape.size()` bytes, aligned for `Owners`, `u64` and
    /// `AtomicU64`, and not shared.
    pub(super) unsafe fn init_blank(p: *mut Owners, shape: Shape) {
        debug_assert!(p.cast::<AtomicU64>().is_aligned());
        // Safety: forwarded (caller's contract).
        let (_, ts) = unsafe { Self::init_uninit(p, 0, shape.nwords, shape.n) };
        for i in 0..shape.n {
            // Safety: timestamp `i < n` of the table, not shared.
            unsafe { ts.wrapping_add(i).write(AtomicU64::new(0)) };
        }
    }

    /// Size of a table with a single owner (as a new leaf's, which lives inside the node's
    /// allocation: see `Node`): header, one word, one timestamp (what `Self::layout(1, 1)`
    /// computes; checked in [`Self::init_single`]).
    pub(crate) const SINGLE_SIZE: usize = (Self::BITS_OFF + size_of::<u64>())
        .next_multiple_of(align_of::<AtomicU64>())
        + size_of::<AtomicU64>();

    /// Writes a table with the single owner `slot` at `ts` into `p`.
    ///
    /// # Safety
    ///
    /// `p` is valid for writes of [`Self::SINGLE_SIZE`] bytes, aligned for `Owners`, `u64` and
    /// `AtomicU64` (the table's header, word and timestamp), and not shared.
    pub(super) unsafe fn init_single(p: *mut Owners, slot: usize, ts: u64) {
        debug_assert_eq!(Self::layout(1, 1).0.size(), Self::SINGLE_SIZE);
        debug_assert!(p.cast::<AtomicU64>().is_aligned());
        // Safety: forwarded (caller's contract), for one word and one owner.
        let (bits, t) = unsafe { Self::init_uninit(p, slot / 64, 1, 1) };
        // Safety: the table's only word, zeroed above, not shared.
        unsafe { *bits |= 1u64 << (slot % 64) };
        // Safety: the table's only timestamp, not shared.
        unsafe { t.write(AtomicU64::new(ts)) };
    }

    /// Frees a table.
    ///
    /// # Safety
    ///
    /// `p` is a separately allocated table (from [`Owners::alloc`], `alloc_from` or
    /// `alloc_uninit`; never a node's embedded table, see [`Self::init_single`] and
    /// [`Self::init_blank`]), no other thread holds it, and it is freed once.
    pub(super) unsafe fn destroy(p: *mut Owners) {
        #[cfg(loom)]
        {
            // Safety: the table is still allocated (poisoned, never freed, under loom).
            unsafe { (*p).poison.poison() };
        }
        #[cfg(not(loom))]
        {
            // Safety: `p` is live (caller's contract).
            let t = unsafe { &*p };
            let layout = Self::layout(t.nwords as usize, t.len()).0;
            // Safety: live, ours, and dropped once (caller's contract).
            unsafe { Self::drop_contents(p) };
            // Safety: the block was allocated with `layout` and is freed once.
            unsafe { dealloc(p.cast::<u8>(), layout) };
        }
    }

    /// Drops a table's header and timestamps in place, leaving its memory allocated.
    ///
    /// # Safety
    ///
    /// `p` is an initialized table that no other thread holds, dropped once; it is not read
    /// again before it is initialized anew.
    pub(super) unsafe fn drop_contents(p: *mut Owners) {
        // Safety: `p` is live (caller's contract).
        let t = unsafe { &*p };
        let (nwords, n) = (t.nwords as usize, t.len());
        let ts_off = Self::ts_off(nwords);
        let ts = p.cast::<u8>().wrapping_add(ts_off).cast::<AtomicU64>();
        for i in 0..n {
            // Safety: timestamp `i < n` is an initialized atomic of the table, dropped once.
            unsafe { std::ptr::drop_in_place(ts.wrapping_add(i)) };
        }
        // Safety: the header is initialized and dropped once.
        unsafe { std::ptr::drop_in_place(p) };
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
        let start = (self as *const Owners)
            .cast::<u8>()
            .wrapping_add(Self::BITS_OFF)
            .cast::<u64>();
        // Safety: the allocation holds `nwords` initialized words at `bits_off`, written before
        // the table was published and never modified after.
        unsafe { std::slice::from_raw_parts(start, self.nwords as usize) }
    }

    /// The owners' timestamps, in ascending slot order.
    #[inline]
    pub(crate) fn ts(&self) -> &[AtomicU64] {
        let n = self.len();
        let start = (self as *const Owners)
            .cast::<u8>()
            .wrapping_add(Self::ts_off(self.nwords as usize))
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
        self.contains(slot).then(|| self.rank_below(slot))
    }

    /// Number of owners with a slot below `slot` (its timestamp's index if it owns the node).
    #[inline]
    fn rank_below(&self, slot: usize) -> usize {
        let bits = self.bits();
        let (w, lo) = (slot / 64, self.lo());
        if w < lo {
            return 0;
        }
        let whole = (w - lo).min(bits.len());
        let below: u32 = bits[..whole].iter().map(|b| b.count_ones()).sum();
        let part = bits
            .get(w - lo)
            .map_or(0, |b| (b & ((1u64 << (slot % 64)) - 1)).count_ones());
        (below + part) as usize
    }

    /// `slot`'s timestamp, if it is an owner.
    #[inline]
    pub(crate) fn ts_of(&self, slot: usize) -> Option<&AtomicU64> {
        let rank = match *self.bits() {
            // One word (at most 64 tenants, the common case): no range arithmetic.
            [word] => {
                let bit = 1u64 << (slot % 64);
                if slot / 64 != self.lo() || word & bit == 0 {
                    return None;
                }
                (word & (bit - 1)).count_ones() as usize
            }
            _ => self.rank(slot)?,
        };
        Some(&self.ts()[rank])
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
    /// Pairs with the lock-free insert path, which raises timestamps with `fetch_max`, then
    /// runs a `SeqCst` fence and checks this flag: either that check sees the flag (and the
    /// insert redoes the raise on the new table), or its fence precedes this one in the single
    /// `SeqCst` order and the writer's copy of the timestamps, read after this fence, sees the
    /// raise.
    ///
    /// Only the node's lock holder writes `meta` (a superseded table is replaced or its node
    /// unlinked before the lock is released), so the mark is a plain store, not a locked
    /// instruction. Fence to fence also lets loom check the handshake: it models `SeqCst`
    /// accesses as `AcqRel`, but `SeqCst` fences exactly.
    pub(super) fn mark_superseded(&self) {
        let m = self.meta.load(Ordering::Relaxed);
        self.meta.store(m | SUPERSEDED, Ordering::Relaxed);
        crate::sync::fence(Ordering::SeqCst);
    }

    /// See [`Owners::mark_superseded`].
    #[inline]
    pub(crate) fn is_superseded(&self) -> bool {
        self.meta.load(Ordering::SeqCst) & SUPERSEDED != 0
    }

    /// Marks the table superseded and returns its `(slot, ts)` entries, the timestamps read
    /// after the mark (see [`Owners::mark_superseded`]). For a holder of the node's lock.
    pub(super) fn supersede(&self) -> Entries {
        self.mark_superseded();
        let mut e = Entries::new();
        for (s, t) in self.slots().zip(self.ts()) {
            e.push((s as u32, t.load(Ordering::SeqCst)));
        }
        e
    }

    /// The `(slot, ts)` entries, times read now (for tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn entries(&self) -> Vec<(usize, u64)> {
        self.slots()
            .zip(self.ts())
            .map(|(s, x)| (s, x.load(Ordering::Relaxed)))
            .collect()
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
pub(super) struct Entries {
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

    pub(super) fn as_slice(&self) -> &[(u32, u64)] {
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
    /// A table with no owners (the root of an empty tree).
    pub(crate) fn empty() -> Self {
        Self::from_entries(&[])
    }

    /// A table from `(slot, ts)` entries in strictly ascending slot order.
    pub(crate) fn from_sorted(e: &[(u32, u64)]) -> Self {
        debug_assert!(e.windows(2).all(|w| w[0].0 < w[1].0));
        Self::from_entries(e)
    }

    pub(super) fn from_entries(e: &[(u32, u64)]) -> Self {
        let p = Owners::alloc(e);
        Self {
            // Safety: `Owners::alloc` never returns null (it aborts on allocation failure).
            ptr: unsafe { NonNull::new_unchecked(p) },
        }
    }

    /// `old` plus `slot` at `ts` (or `slot`'s time raised to `ts`), marking `old` superseded
    /// first so that concurrent lock-free raises land in the copy or retry. For a holder of the
    /// lock of `old`'s node. Returns the table and whether `slot` is new.
    pub(crate) fn with(old: &Owners, slot: usize, ts: u64) -> (Self, bool) {
        old.mark_superseded();
        Self::copy_of(old, Some((slot, ts)))
    }

    /// `old` plus every slot of `add` (ascending) at `ts` (a slot `old` has keeps its time),
    /// marking `old` superseded first as [`Self::with`] does; one copy for many new owners
    /// (the root when tenants are added in a batch). For a holder of the lock of `old`'s node.
    pub(crate) fn with_all(old: &Owners, add: &[usize], ts: u64) -> Self {
        debug_assert!(add.windows(2).all(|w| w[0] < w[1]));
        let e = old.supersede();
        let old = e.as_slice();
        let mut merged = Vec::with_capacity(old.len() + add.len());
        let (mut i, mut j) = (0, 0);
        while i < old.len() || j < add.len() {
            let next_add = add.get(j).map(|&s| s as u32);
            match (old.get(i), next_add) {
                (Some(&o), Some(a)) if o.0 < a => (merged.push(o), i += 1),
                (Some(&o), Some(a)) if o.0 == a => (merged.push(o), (i, j) = (i + 1, j + 1)),
                (_, Some(a)) => (merged.push((a, ts)), j += 1),
                (Some(&o), None) => (merged.push(o), i += 1),
                (None, None) => unreachable!("the loop condition"),
            };
        }
        Self::from_entries(&merged)
    }

    /// A copy of `old` plus `add` (see `Owners::alloc_from`), for a caller that marked `old`
    /// superseded if it is published. Returns the table and whether `add`'s slot is new.
    pub(super) fn copy_of(old: &Owners, add: Option<(usize, u64)>) -> (Self, bool) {
        let (p, added) = Owners::alloc_from(old, add);
        (Self::from_raw(p), added)
    }

    /// Wraps a table fresh from one of `Owners`' allocators.
    fn from_raw(p: *mut Owners) -> Self {
        Self {
            // Safety: `Owners`' allocators never return null (they abort on allocation failure).
            ptr: unsafe { NonNull::new_unchecked(p) },
        }
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

    /// `old` without every slot of `remove` (ascending; slots `old` lacks are ignored),
    /// marking `old` superseded as [`Self::without`] does; one copy for many owners gone (the
    /// root when tenants are removed in a batch). The table may be empty. For a holder of the
    /// lock of `old`'s node.
    pub(crate) fn without_all(old: &Owners, remove: &[usize]) -> Self {
        debug_assert!(remove.windows(2).all(|w| w[0] < w[1]));
        let e = old.supersede();
        let mut j = 0;
        let rest: Vec<(u32, u64)> = e
            .as_slice()
            .iter()
            .filter(|&&(s, _)| {
                let s = s as usize;
                while remove.get(j).is_some_and(|&r| r < s) {
                    j += 1;
                }
                remove.get(j) != Some(&s)
            })
            .copied()
            .collect();
        Self::from_entries(&rest)
    }

    pub(super) fn into_raw(self) -> *mut Owners {
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// `(slot, ts)` entries of a table (frees it).
    fn take_entries(p: *mut Owners) -> Vec<(usize, u64)> {
        // Safety: a fresh table from one of `Owners`' allocators, not shared.
        let e = unsafe { &*p }.entries();
        // Safety: as above; freed once, here.
        unsafe { Owners::destroy(p) };
        e
    }

    /// The one-word copy builds exactly what the general copy builds, for every kind of add:
    /// none, a new slot below, between and above the owners, an owner raised and not raised;
    /// and both build the shape `shape_from` predicts, also for adds outside the table's words
    /// (its range grows up or down) and for a table of two words.
    #[test]
    fn one_word_copies_match_the_general_copy() {
        let tables: [&[(u32, u64)]; 5] = [
            &[],
            &[(5, 10)],
            &[(0, 3), (7, 9), (63, 1)],
            &[(64, 4), (70, 8), (127, 2)],
            &[(3, 1), (64, 2), (100, 3)],
        ];
        for e in tables {
            let old = Owners::alloc(e);
            // Safety: fresh, not shared; freed at the end of this iteration.
            let o = unsafe { &*old };
            let base = e.first().map_or(0, |x| x.0 as usize / 64 * 64);
            let mut adds: Vec<Option<(usize, u64)>> = vec![None];
            // Within the first word, then beyond the table's words (the range grows up), and
            // below them where there is room (it grows down).
            for slot in [0, 1, 5, 6, 7, 33, 62, 63, 64, 130, 200] {
                for ts in [0, 5, 100] {
                    adds.push(Some((base + slot, ts)));
                }
            }
            if base >= 64 {
                adds.push(Some((2, 7)));
            }
            for add in adds {
                let shape = Owners::shape_from(o, add);
                let general = Owners::alloc_raw(shape.nwords, shape.n);
                // Safety: a fresh allocation of `shape_from(o, add)`'s size, not shared.
                let general_added = unsafe { Owners::init_from_words(general, o, add) };
                let fast = Owners::alloc_from(o, add);
                assert_eq!(fast.1, general_added, "{e:?} + {add:?}");
                for p in [fast.0, general] {
                    // Safety: fresh tables, not shared.
                    assert_eq!(Shape::of(unsafe { &*p }), shape, "{e:?} + {add:?}");
                }
                assert_eq!(
                    take_entries(fast.0),
                    take_entries(general),
                    "{e:?} + {add:?}"
                );
            }
            // Safety: as above.
            unsafe { Owners::destroy(old) };
        }
    }

    /// Every accessor of a table, against values worked out by hand: one word at word 0, one
    /// word above word 0, several words from word 0 and from above it (with an empty word
    /// inside), and the empty table.
    #[test]
    fn accessors_give_exact_values() {
        struct Case {
            e: &'static [(u32, u64)],
            lo: usize,
            bits: &'static [u64],
        }
        let cases = [
            Case {
                e: &[],
                lo: 0,
                bits: &[],
            },
            Case {
                e: &[(0, 3), (7, 9), (63, 1)],
                lo: 0,
                bits: &[1 | 1 << 7 | 1 << 63],
            },
            Case {
                e: &[(65, 4), (70, 8), (127, 2)],
                lo: 1,
                bits: &[1 << 1 | 1 << 6 | 1 << 63],
            },
            Case {
                e: &[(3, 1), (64, 2), (100, 3), (200, 4)],
                lo: 0,
                bits: &[1 << 3, 1 | 1 << 36, 0, 1 << 8],
            },
            Case {
                e: &[(129, 5), (150, 6), (256, 7)],
                lo: 2,
                bits: &[1 << 1 | 1 << 22, 0, 1],
            },
        ];
        for c in cases {
            let p = Owners::alloc(c.e);
            // Safety: fresh, not shared; freed at the end of this iteration.
            let o = unsafe { &*p };
            let n = c.e.len();
            assert_eq!(o.len(), n, "{:?}", c.e);
            assert_eq!(o.lo(), c.lo, "{:?}", c.e);
            assert_eq!(o.bits(), c.bits, "{:?}", c.e);
            assert_eq!(
                Shape::of(o),
                Shape {
                    nwords: c.bits.len(),
                    n
                }
            );
            let times: Vec<u64> = o.ts().iter().map(|t| t.load(Ordering::Relaxed)).collect();
            let want: Vec<u64> = c.e.iter().map(|x| x.1).collect();
            assert_eq!(times, want, "{:?}", c.e);
            for w in 0..8usize {
                let want = w
                    .checked_sub(c.lo)
                    .and_then(|i| c.bits.get(i).copied())
                    .unwrap_or(0);
                assert_eq!(o.word(w), want, "{:?} word {w}", c.e);
            }
            let slots: Vec<usize> = o.slots().collect();
            let want: Vec<usize> = c.e.iter().map(|x| x.0 as usize).collect();
            assert_eq!(slots, want, "{:?}", c.e);
            assert_eq!(o.slots().clone().count(), n);
            assert_eq!(
                o.entries(),
                c.e.iter()
                    .map(|&(s, t)| (s as usize, t))
                    .collect::<Vec<_>>()
            );
            for slot in 0..400 {
                let at = c.e.iter().position(|x| x.0 as usize == slot);
                let below = c.e.iter().filter(|x| (x.0 as usize) < slot).count();
                assert_eq!(o.contains(slot), at.is_some(), "{:?} slot {slot}", c.e);
                assert_eq!(o.rank_below(slot), below, "{:?} slot {slot}", c.e);
                assert_eq!(o.rank(slot), at, "{:?} slot {slot}", c.e);
                assert_eq!(
                    o.ts_of(slot).map(|t| t.load(Ordering::Relaxed)),
                    at.map(|i| c.e[i].1),
                    "{:?} slot {slot}",
                    c.e
                );
                if let Some(i) = at {
                    // The cell itself, not a copy of its value.
                    assert!(std::ptr::eq(o.ts_of(slot).unwrap(), &o.ts()[i]));
                }
            }
            assert!(!o.is_superseded());
            // An 8-byte header, the words, the times.
            let bytes = 8 + 8 * c.bits.len() + 8 * n;
            assert_eq!(o.bytes(), bytes, "{:?}", c.e);
            assert_eq!(Retire::heap_bytes(o), bytes, "{:?}", c.e);
            assert_eq!(Shape::of(o).size(), bytes, "{:?}", c.e);
            // Safety: as above.
            unsafe { Owners::destroy(p) };
        }
    }

    /// `Mask::contains` and `Owners::intersects` for masks that start below, at and above a
    /// table's words, overlap it partly or not at all; `BitIter` yields exactly the set bits.
    #[test]
    fn masks_and_bit_iteration_give_exact_values() {
        let words = [1u64 << 5, 0, 1 | 1 << 63];
        for lo in [0, 1, 3] {
            let m = Mask { lo, words: &words };
            for slot in 0..64 * 8 {
                let want = [5, 128, 191].iter().any(|&s| slot == 64 * lo + s);
                assert_eq!(m.contains(slot), want, "lo {lo} slot {slot}");
            }
        }
        assert!((0..1000).all(|s| !Mask::EMPTY.contains(s)));
        // The table owns 3 (word 0), 100 (word 1) and 200 (word 3).
        let p = Owners::alloc(&[(3, 1), (100, 2), (200, 3)]);
        // Safety: fresh, not shared; freed below.
        let o = unsafe { &*p };
        let cases: [(usize, &[u64], bool); 10] = [
            (0, &[], false),
            (0, &[1 << 3], true),
            (0, &[1 << 4], false),
            (0, &[!(1 << 3), !(1 << 36)], false),
            (1, &[1 << 36], true),
            (1, &[!(1 << 36), !0, 0], false),
            (2, &[0, 1 << 8], true),
            (3, &[1 << 8], true),
            (3, &[!(1 << 8)], false),
            (4, &[!0, !0], false),
        ];
        for (lo, words, want) in cases {
            assert_eq!(o.intersects(Mask { lo, words }), want, "{lo} {words:?}");
        }
        // Safety: as above.
        unsafe { Owners::destroy(p) };
        let high = Owners::alloc(&[(130, 1)]);
        // Safety: fresh, not shared; freed below.
        let h = unsafe { &*high };
        assert!(!h.intersects(Mask {
            lo: 0,
            words: &[1 << 2, 0, 0]
        }));
        assert!(h.intersects(Mask {
            lo: 0,
            words: &[0, 0, 1 << 2]
        }));
        assert!(!h.intersects(Mask {
            lo: 0,
            words: &[!0, !0]
        }));
        // Safety: as above.
        unsafe { Owners::destroy(high) };
        let bits = |w: u64| BitIter(w).collect::<Vec<_>>();
        assert_eq!(bits(0), Vec::<usize>::new());
        assert_eq!(bits(1), vec![0]);
        assert_eq!(bits(1 << 63 | 1 << 9 | 1 << 2), vec![2, 9, 63]);
        assert_eq!(bits(!0), (0..64).collect::<Vec<_>>());
    }

    /// `NewOwners::with`, `with_all`, `without` and `from_sorted` build exactly the tables
    /// expected, mark the old table superseded, and report what they did.
    #[test]
    fn new_tables_hold_exact_entries() {
        let take = |t: NewOwners| take_entries(t.into_raw());
        let old = NewOwners::from_sorted(&[(3, 10), (70, 20), (200, 30)]);
        // Safety: `old` is live until dropped at the end.
        let o = unsafe { old.ptr.as_ref() };
        assert_eq!(o.entries(), vec![(3, 10), (70, 20), (200, 30)]);
        assert!(!o.is_superseded());
        let (t, added) = NewOwners::with(o, 100, 5);
        assert!(added);
        assert!(o.is_superseded());
        assert_eq!(o.len(), 3, "the mark leaves the count");
        assert_eq!(take(t), vec![(3, 10), (70, 20), (100, 5), (200, 30)]);
        let (t, added) = NewOwners::with(o, 70, 25);
        assert!(!added);
        assert_eq!(take(t), vec![(3, 10), (70, 25), (200, 30)]);
        let (t, added) = NewOwners::with(o, 70, 15);
        assert!(!added);
        assert_eq!(take(t), vec![(3, 10), (70, 20), (200, 30)]);
        let t = NewOwners::with_all(o, &[0, 3, 4, 70, 71, 300], 7);
        assert_eq!(
            take(t),
            vec![
                (0, 7),
                (3, 10),
                (4, 7),
                (70, 20),
                (71, 7),
                (200, 30),
                (300, 7)
            ]
        );
        let t = NewOwners::with_all(o, &[], 7);
        assert_eq!(take(t), vec![(3, 10), (70, 20), (200, 30)]);
        let t = NewOwners::with_all(o, &[201, 202], 7);
        assert_eq!(
            take(t),
            vec![(3, 10), (70, 20), (200, 30), (201, 7), (202, 7)]
        );
        match NewOwners::without(o, 70, None) {
            Without::Removed(t) => assert_eq!(take(t), vec![(3, 10), (200, 30)]),
            _ => panic!("70 removed"),
        }
        match NewOwners::without(o, 70, Some(20)) {
            Without::Removed(t) => assert_eq!(take(t), vec![(3, 10), (200, 30)]),
            _ => panic!("70 removed at its time"),
        }
        match NewOwners::without(o, 70, Some(21)) {
            Without::Kept(t, at) => {
                assert_eq!(at, 20);
                assert_eq!(take(t), vec![(3, 10), (70, 20), (200, 30)]);
            }
            _ => panic!("70 kept: not at 21"),
        }
        match NewOwners::without(o, 71, Some(20)) {
            Without::Removed(t) => assert_eq!(take(t), vec![(3, 10), (70, 20), (200, 30)]),
            _ => panic!("71 is no owner: a plain copy"),
        }
        let one = NewOwners::from_sorted(&[(70, 20)]);
        // Safety: `one` is live until dropped below.
        let single = unsafe { one.ptr.as_ref() };
        assert!(matches!(
            NewOwners::without(single, 70, None),
            Without::Empty
        ));
        assert!(single.is_superseded());
        drop(one);
        let empty = NewOwners::empty();
        // Safety: live until dropped below.
        let e = unsafe { empty.ptr.as_ref() };
        assert_eq!((e.len(), e.bits().len(), e.entries()), (0, 0, vec![]));
        let (t, added) = NewOwners::with(e, 130, 4);
        assert!(added);
        assert_eq!(take(t), vec![(130, 4)]);
        drop(empty);
        drop(old);
        // More owners than `Entries` holds inline (16): the copies spill to the heap.
        let many: Vec<(u32, u64)> = (0..40).map(|i| (3 * i, u64::from(i) + 1)).collect();
        let all = NewOwners::from_sorted(&many);
        // Safety: live until dropped below.
        let a = unsafe { all.ptr.as_ref() };
        let as_usize =
            |e: &[(u32, u64)]| e.iter().map(|&(s, t)| (s as usize, t)).collect::<Vec<_>>();
        assert_eq!(a.entries(), as_usize(&many));
        let mut want = many.clone();
        want.insert(1, (1, 99));
        assert_eq!(take(NewOwners::with_all(a, &[1], 99)), as_usize(&want));
        match NewOwners::without(a, 60, None) {
            Without::Removed(t) => {
                let want: Vec<_> = many.iter().copied().filter(|x| x.0 != 60).collect();
                assert_eq!(take(t), as_usize(&want));
            }
            _ => panic!("60 removed"),
        }
        drop(all);
    }

    /// The superseded mark sets a flag, it does not toggle one: a table marked again stays
    /// superseded, and the mark never changes the count of owners. The tree marks a table once
    /// and replaces it, but `with`, `with_all`, `without` and `without_all` each mark the table
    /// they copy, and the tests above copy one table many times.
    #[test]
    fn marking_twice_leaves_the_table_superseded() {
        let t = NewOwners::from_sorted(&[(3, 10), (70, 20)]);
        // Safety: live until dropped at the end.
        let o = unsafe { t.ptr.as_ref() };
        for _ in 0..3 {
            o.mark_superseded();
            assert!(o.is_superseded());
            assert_eq!(o.len(), 2);
        }
        let (copy, added) = NewOwners::with(o, 5, 1);
        assert!(added);
        assert!(o.is_superseded(), "still marked after a copy");
        assert_eq!(
            take_entries(copy.into_raw()),
            vec![(3, 10), (5, 1), (70, 20)]
        );
        assert_eq!(o.entries(), vec![(3, 10), (70, 20)]);
        drop(t);
    }

    /// `Entries` keeps up to 16 entries inline (a superseded table of few owners is copied
    /// without a heap allocation, its reason to exist) and moves them all to the heap, in
    /// order, from the 17th on; `supersede` fills it in slot order.
    #[test]
    fn entries_stay_inline_up_to_sixteen() {
        let mut e = Entries::new();
        assert!(e.as_slice().is_empty());
        for i in 0..16u32 {
            e.push((i, u64::from(i) * 10));
            assert_eq!(e.len, i as usize + 1);
            assert_eq!(e.spill.capacity(), 0, "inline at {} entries", i + 1);
        }
        let want: Vec<(u32, u64)> = (0..17).map(|i| (i, u64::from(i) * 10)).collect();
        assert_eq!(e.as_slice(), &want[..16]);
        e.push(want[16]);
        assert_eq!(e.spill, want, "all moved to the heap");
        assert_eq!(e.as_slice(), &want[..]);
        for n in [16, 17] {
            let t = NewOwners::from_sorted(&want[..n]);
            // Safety: live until dropped below.
            let e = unsafe { t.ptr.as_ref() }.supersede();
            assert_eq!(e.as_slice(), &want[..n]);
            assert_eq!(e.spill.is_empty(), n == 16, "{n} owners");
            drop(t);
        }
    }

    /// `NewOwners::without_all` drops exactly the listed slots that are owners (in any
    /// position, absent ones ignored), marks the old table superseded, and may leave nothing.
    #[test]
    fn without_all_drops_exactly_the_listed_owners() {
        let take = |t: NewOwners| take_entries(t.into_raw());
        let many: Vec<(u32, u64)> = (0..40).map(|i| (3 * i, u64::from(i) + 1)).collect();
        let all = NewOwners::from_sorted(&many);
        // Safety: live until dropped at the end.
        let a = unsafe { all.ptr.as_ref() };
        let want = |gone: &[u32]| -> Vec<(usize, u64)> {
            many.iter()
                .filter(|x| !gone.contains(&x.0))
                .map(|&(s, t)| (s as usize, t))
                .collect()
        };
        assert_eq!(take(NewOwners::without_all(a, &[])), want(&[]));
        assert!(a.is_superseded());
        // First, last, middle; 1, 2, 118 and 500 are no owners.
        let t = NewOwners::without_all(a, &[0, 1, 2, 3, 60, 61, 117, 118, 500]);
        assert_eq!(take(t), want(&[0, 3, 60, 117]));
        let t = NewOwners::without_all(a, &[1, 4, 7]);
        assert_eq!(take(t), want(&[]));
        let every: Vec<usize> = (0..120).collect();
        assert_eq!(take(NewOwners::without_all(a, &every)), vec![]);
        drop(all);
    }
}
