//! The raw concurrent table behind [`BlockIndex`](super::BlockIndex): sequence hash → the set of
//! `(worker slot, tier mask)` holders of the block.
//!
//! Open addressing with linear probing over one flat array of `AtomicU64` pairs: per entry the
//! key, then one **holder word**. Capacities are arbitrary (not powers of two): the home slot of
//! a key is `fastrange(mix(key), cap)`.
//!
//! # Holder words
//!
//! A holder is a worker slot with the storage tiers it holds the block in (`holder = slot << 4 |
//! tiers`, tiers a non-zero 4-bit mask, bit `t` = [`crate::blocks::Tier`] `t`). The holder word
//! of an entry encodes the whole holder set of its key, in one of four forms chosen by its low
//! two bits, so that the memory of an entry never depends on how many workers exist:
//!
//! | low bits | form | contents |
//! |---|---|---|
//! | `0` (whole word 0) | empty | no holder (a dead entry) |
//! | `01` | bitset | bits `2..6` = one tier mask shared by every holder, bits `6..64` = slots `0..58` |
//! | `10` | pair | one or two holders of 31 bits (slot < 2²⁷), ascending slots |
//! | `00`, non-zero | set | pointer to an immutable out-of-line [`SetHeader`] + sorted holders |
//!
//! The writer always stores the canonical form of a set: bitset when every holder has slot < 58
//! and they all hold the block in the same tiers (the common case: GPU only, or GPU and CPU on
//! an offloading engine), else a pair for one or two holders, else an out-of-line set — dense
//! (a bitset over the slots it spans, again with one shared tier mask) when that is no bigger
//! than the sorted holder list, sparse otherwise. An entry therefore costs 16 bytes in the
//! table whatever the worker count; an out-of-line set costs at most 4 bytes per holder plus an
//! 8-byte header.
//!
//! # Protocol
//!
//! - **One writer at a time.** Every mutating method is called by the holder of the index's
//!   table-side mutex (`BlockIndex::tables`); readers never take it.
//! - **Keys are write-once.** Word 0 of an entry is `EMPTY` (0) until the writer publishes a
//!   key there with a `Release` store, after the entry's holder word was written; it never
//!   changes again for the lifetime of this table. Removing the last holder of a key only
//!   empties its holder word (the entry becomes *dead*, a tombstone that keeps its key and is
//!   revived if the key is stored again); dead entries are dropped when the writer rebuilds
//!   the table.
//! - **Holder words change by whole-word `Release` stores.** The writer builds the new form
//!   first (an out-of-line set is fully written before the store that publishes it) and
//!   readers `Acquire`-load the word, so a reader sees one complete holder set, old or new.
//!   Out-of-line sets are immutable once published; a replaced set is unlinked by that store
//!   and handed to the caller's [`SetLedger`], which retires it through the epoch reclaimer
//!   (one deferred batch per writer operation), so a reader pinned while it could still reach
//!   the set keeps it alive.
//! - **Sets belong to the current table.** A rebuild moves holder words (and so set pointers)
//!   into the new table; the old table is retired without freeing any set. A set replaced in
//!   the new table after the rebuild may still be reachable through the old table by readers
//!   pinned before the old table was retired: those readers were pinned when the set was
//!   retired too, so it outlives them.
//! - **Readers never miss a present key.** The writer places a key in the first `EMPTY` slot of
//!   its probe sequence (or finds it already there). Since slots never return to `EMPTY`, every
//!   slot between a key's home and its position stays non-empty, so a reader's probe (Acquire
//!   key loads, stopping at the key or at `EMPTY`) reaches it.
//! - **Probes terminate.** The writer keeps at most `MAX_LOAD_NUM / MAX_LOAD_DEN` of the slots
//!   non-empty, so every
//!   probe sequence meets an `EMPTY` slot.
//! - Key 0 cannot be stored in a slot (it is `EMPTY`); its holder word lives in `zero`.

use core::alloc::Layout;
use core::ptr::NonNull;

use crate::reclaim::{self, Guard};
use crate::sync::{AtomicU64, Ordering};

/// Maximum fraction of non-empty slots (live + dead), as `MAX_LOAD_NUM / MAX_LOAD_DEN`.
const MAX_LOAD_NUM: usize = 3;
const MAX_LOAD_DEN: usize = 4;
/// Smallest capacity a table is built with.
pub(crate) const MIN_CAP: usize = 16;

/// A word that marks a slot without key.
const EMPTY: u64 = 0;

const TAG_MASK: u64 = 0b11;
const TAG_BITS: u64 = 0b01;
const TAG_PAIR: u64 = 0b10;

/// Slots the bitset form covers (`0..BITSET_SLOTS`).
pub(crate) const BITSET_SLOTS: u32 = 58;
/// Bit position of the slots in the bitset form (after the tag and the tier mask).
const BITS_SHIFT: u32 = 6;
/// Worker slots the table can name (`0..MAX_SLOTS`; the pair form's 27-bit slot field).
pub(crate) const MAX_SLOTS: u32 = 1 << 27;
/// The GPU tier's bit in a tier mask.
pub(crate) const GPU: u8 = 1;
/// Tier-mask bits.
pub(crate) const TIER_BITS: u32 = 4;
const TIER_MASK: u32 = (1 << TIER_BITS) - 1;
/// Mask of one 31-bit pair holder.
const PAIR_HOLDER: u64 = (1 << 31) - 1;

/// A holder: `slot << 4 | tiers`.
#[inline]
pub(crate) fn holder(slot: u32, tiers: u8) -> u32 {
    (slot << TIER_BITS) | (u32::from(tiers) & TIER_MASK)
}

/// The slot of a holder.
#[inline]
pub(crate) fn holder_slot(h: u32) -> u32 {
    h >> TIER_BITS
}

/// The tier mask of a holder.
#[inline]
pub(crate) fn holder_tiers(h: u32) -> u8 {
    (h & TIER_MASK) as u8
}

/// Spreads a 64-bit key so that sequential keys land far apart.
#[inline]
pub(crate) fn mix(key: u64) -> u64 {
    (key ^ (key >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Home slot of `key` in a table of `cap` slots (`cap > 0`).
#[inline]
pub(crate) fn home(key: u64, cap: usize) -> usize {
    ((u128::from(mix(key)) * cap as u128) >> 64) as usize
}

// ---------------------------------------------------------------------------------------------
// Out-of-line holder sets
// ---------------------------------------------------------------------------------------------

/// Flag in [`SetHeader::len`] marking a dense set.
const DENSE: u32 = 1 << 31;
/// A dense set's `base` field: the first word index (slot / 64, below 2²¹) in the low bits,
/// the shared tier mask from bit `MASK_SHIFT`.
const MASK_SHIFT: u32 = 24;
const BASE_MASK: u32 = (1 << MASK_SHIFT) - 1;

/// Header of an out-of-line holder set, followed in the same allocation by its payload:
///
/// - **sparse**: `len` holders (`u32`, sorted by slot, any tiers);
/// - **dense** (`len & DENSE`): `len & !DENSE` bitset words (`u64`) covering slots
///   `64 * (base & BASE_MASK) ..`, every holder in the tiers `base >> MASK_SHIFT`.
///
/// Immutable once published.
#[repr(C)]
pub(crate) struct SetHeader {
    /// Under loom, set by the retire destructor instead of freeing (see `crate::sync`).
    #[cfg(loom)]
    poison: crate::sync::PoisonFlag,
    len: u32,
    base: u32,
}

/// Layout of a set with this `len` field, and the byte offset of its payload.
fn set_layout(len: u32) -> (Layout, usize) {
    let payload = if len & DENSE != 0 {
        Layout::array::<u64>((len & !DENSE) as usize)
    } else {
        Layout::array::<u32>(len as usize)
    };
    let (layout, offset) = Layout::new::<SetHeader>()
        .extend(payload.expect("set size bounded by MAX_SLOTS"))
        .expect("set size bounded by MAX_SLOTS");
    (layout.pad_to_align(), offset)
}

/// Bytes of the set whose header says `len`.
fn set_bytes(len: u32) -> usize {
    set_layout(len).0.size()
}

/// A sparse set of sorted holders.
fn sparse_alloc(holders: &[u32]) -> NonNull<SetHeader> {
    debug_assert!(holders.len() < DENSE as usize);
    // Safety: the payload of a sparse set of `holders.len()` holders is exactly `holders`'
    // bytes.
    unsafe {
        set_alloc_exact(
            holders.len() as u32,
            0,
            holders.as_ptr().cast(),
            holders.len() * 4,
        )
    }
}

/// A dense set of bitset `words` starting at word `base`, every holder in tiers `mask`.
fn dense_alloc(mask: u8, base: u32, words: &[u64]) -> NonNull<SetHeader> {
    debug_assert!(!words.is_empty() && words.len() < DENSE as usize && base <= BASE_MASK);
    let base = base | u32::from(mask) << MASK_SHIFT;
    // Safety: the payload of a dense set of `words.len()` words is exactly `words`' bytes.
    unsafe {
        set_alloc_exact(
            words.len() as u32 | DENSE,
            base,
            words.as_ptr().cast(),
            words.len() * 8,
        )
    }
}

/// Allocates a set with header `(len, base)` and copies `bytes` payload bytes from `src`
/// (any padding after them is never read).
///
/// # Safety
///
/// `src` must be valid for reads of `bytes` bytes, and `bytes` must be the unpadded payload
/// size for `len`.
unsafe fn set_alloc_exact(len: u32, base: u32, src: *const u8, bytes: usize) -> NonNull<SetHeader> {
    let (layout, offset) = set_layout(len);
    debug_assert!(offset + bytes <= layout.size());
    // Safety: the layout has non-zero size (the header alone is 8 bytes).
    let raw = unsafe { std::alloc::alloc(layout) };
    let Some(p) = NonNull::new(raw) else {
        std::alloc::handle_alloc_error(layout)
    };
    let header = p.cast::<SetHeader>();
    // Safety: `header` points to a fresh allocation of `layout`, which starts with a
    // `SetHeader` and is suitably aligned for it; writing initializes it.
    unsafe {
        header.as_ptr().write(SetHeader {
            #[cfg(loom)]
            poison: crate::sync::PoisonFlag::default(),
            len,
            base,
        })
    };
    // Safety: `offset` is within this fresh allocation of `layout` (the payload's offset).
    let dst = unsafe { raw.add(offset) };
    // Safety: `dst..dst + bytes` is the payload of this fresh allocation, the caller vouches
    // that `src` is readable for `bytes` bytes, and the regions are distinct.
    unsafe { core::ptr::copy_nonoverlapping(src, dst, bytes) };
    header
}

/// The contents of a set.
///
/// # Safety
///
/// `p` must point to a set from [`sparse_alloc`]/[`dense_alloc`] that is not freed while the
/// returned value lives (readers: the set was reachable after their guard was pinned; writers:
/// it is still linked).
#[inline]
unsafe fn set_view<'a>(p: *const SetHeader) -> Holders<'a> {
    // Safety: `p` is a live set by the caller's contract; its header and payload were written
    // before the set was published and never change; `set_layout` gives the payload's offset
    // and element type for this `len`.
    let header = unsafe { &*p };
    #[cfg(loom)]
    header.poison.assert_alive("holder set");
    let len = header.len;
    // Safety: the payload starts `set_layout(len).1` bytes into the same live allocation.
    let payload = unsafe { p.cast::<u8>().add(set_layout(len).1) };
    if len & DENSE != 0 {
        let base = header.base;
        // Safety: a dense set's payload holds `len & !DENSE` initialized `u64` words, aligned
        // by `set_layout`, immutable while the set is live.
        let words =
            unsafe { core::slice::from_raw_parts(payload.cast::<u64>(), (len & !DENSE) as usize) };
        Holders::Dense((base >> MASK_SHIFT) as u8, base & BASE_MASK, words)
    } else {
        // Safety: a sparse set's payload holds `len` initialized `u32` ids, aligned by
        // `set_layout`, immutable while the set is live.
        Holders::Sparse(unsafe { core::slice::from_raw_parts(payload.cast::<u32>(), len as usize) })
    }
}

/// Frees (under loom: poisons) a set.
///
/// # Safety
///
/// `p` must come from [`sparse_alloc`]/[`dense_alloc`], be unreachable by every thread that
/// could still read it, and be passed exactly once.
unsafe fn set_free(p: *mut SetHeader) {
    #[cfg(loom)]
    // Safety: forwarded to the caller; under loom the set is leaked, never freed.
    unsafe {
        (*p).poison.poison()
    };
    #[cfg(not(loom))]
    {
        // Safety: forwarded to the caller; the set is still allocated, its header readable.
        let layout = set_layout(unsafe { (*p).len }).0;
        // Safety: forwarded to the caller; `layout` is the one the set was allocated with.
        unsafe { std::alloc::dealloc(p.cast::<u8>(), layout) };
    }
}

/// The table writer's record of out-of-line sets: the bytes of those linked into the current
/// table, and those unlinked since the last [`SetLedger::retire`] (by any writer holding the
/// table side), retired together by it.
#[derive(Default)]
pub(crate) struct SetLedger {
    /// Heap bytes of the sets linked into the current table.
    pub(crate) live_bytes: usize,
    /// Out-of-line sets currently linked into the current table.
    pub(crate) live_sets: usize,
    unlinked: Vec<SetPtr>,
}

/// A set pointer that may cross threads (to the reclaimer).
struct SetPtr(*mut SetHeader);

// Safety: a set is immutable plain data; the pointer is only dereferenced by readers under a
// guard and freed once by the reclaimer's destructor.
unsafe impl Send for SetPtr {}

/// A retired batch of sets.
struct SetBatch(Vec<SetPtr>);

/// Destructor of a retired [`SetBatch`].
///
/// # Safety
///
/// `p` must come from `Box::into_raw`, every set in it must be unlinked from every table, and
/// it must be passed exactly once.
unsafe fn free_batch(p: *mut SetBatch) {
    // Safety: forwarded to the caller.
    let batch = unsafe { Box::from_raw(p) };
    for s in batch.0 {
        // Safety: each set was unlinked before its batch was retired, and the reclaimer runs
        // this destructor only after every reader pinned at that time has unpinned.
        unsafe { set_free(s.0) };
    }
}

impl SetLedger {
    fn linked(&mut self, p: NonNull<SetHeader>) -> NonNull<SetHeader> {
        // Safety: `p` was just allocated by this writer.
        self.live_bytes += set_bytes(unsafe { (*p.as_ptr()).len });
        self.live_sets += 1;
        p
    }

    fn unlink(&mut self, p: NonNull<SetHeader>) {
        // Safety: the writer only unlinks sets it linked, which are live.
        self.live_bytes -= set_bytes(unsafe { (*p.as_ptr()).len });
        self.live_sets -= 1;
        self.unlinked.push(SetPtr(p.as_ptr()));
    }

    /// Retires every set unlinked since the last call, as one deferred batch.
    pub(crate) fn retire(&mut self, guard: &Guard) {
        if self.unlinked.is_empty() {
            return;
        }
        let batch = Box::into_raw(Box::new(SetBatch(core::mem::take(&mut self.unlinked))));
        // Safety: every set in the batch was unlinked by a Release store of its table entry
        // (or by dropping the table that held it, under `&mut`), so only readers pinned before
        // this point can reach it; the batch is a fresh object retired once; `free_batch`
        // frees plain memory, which is sound on any thread.
        unsafe { reclaim::retire(guard, batch, free_batch) };
    }
}

impl Drop for SetLedger {
    fn drop(&mut self) {
        // Only reached when the index is dropped (`&mut`, no reader left): free directly.
        for s in self.unlinked.drain(..) {
            // Safety: unlinked, never retired, and no thread can read it any more.
            unsafe { set_free(s.0) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Holder words
// ---------------------------------------------------------------------------------------------

/// A decoded holder word, borrowed for the lifetime of the guard it was read under.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Holders<'a> {
    /// No holder.
    Empty,
    /// `(tiers, slots)`: slots `0..58` (bit `s` = slot `s`), each in tiers `tiers`.
    Bits(u8, u64),
    /// One or two holders (the second is 0 when absent), ascending slots.
    Pair(u32, u32),
    /// Holders sorted by slot.
    Sparse(&'a [u32]),
    /// `(tiers, base, words)`: bit `b` of `words[k]` = slot `64 * (base + k) + b`, each in
    /// tiers `tiers`.
    Dense(u8, u32, &'a [u64]),
}

/// The `(tiers, slots)` of a word in the inline bitset form (`(0, 0)` for the empty word), or
/// `None` for the other forms: the lookup's hot path, without building a [`Holders`].
#[inline(always)]
pub(crate) fn bits_of(word: u64) -> Option<(u8, u64)> {
    if word & TAG_MASK == TAG_BITS {
        Some((((word >> 2) & 0xF) as u8, word >> BITS_SHIFT))
    } else if word == 0 {
        Some((0, 0))
    } else {
        None
    }
}

/// Decodes a holder word read under `_guard`.
#[inline]
pub(crate) fn decode(word: u64, _guard: &Guard) -> Holders<'_> {
    match word & TAG_MASK {
        TAG_BITS => Holders::Bits(((word >> 2) & 0xF) as u8, word >> BITS_SHIFT),
        TAG_PAIR => Holders::Pair(
            ((word >> 2) & PAIR_HOLDER) as u32,
            ((word >> 33) & PAIR_HOLDER) as u32,
        ),
        _ if word == 0 => Holders::Empty,
        _ => {
            // Under loom, a scheduling point between loading the pointer and reading the set,
            // so models explore a writer replacing (and retiring) the set in between.
            #[cfg(loom)]
            crate::sync::thread::yield_now();
            // Safety: a non-zero word with tag 00 is a set pointer published by a Release
            // store that this reader Acquire-loaded after pinning `_guard`; the set is freed
            // only after every guard pinned before its retirement is dropped (module docs,
            // "Protocol").
            unsafe { set_view(word as usize as *const SetHeader) }
        }
    }
}

/// Appends the holders of `h`, sorted by slot, to `out`.
pub(crate) fn holders_into(h: Holders<'_>, out: &mut Vec<u32>) {
    match h {
        Holders::Empty => {}
        Holders::Bits(m, mut b) => {
            while b != 0 {
                out.push(holder(b.trailing_zeros(), m));
                b &= b - 1;
            }
        }
        Holders::Pair(h0, h1) => {
            out.push(h0);
            if h1 != 0 {
                out.push(h1);
            }
        }
        Holders::Sparse(set) => out.extend_from_slice(set),
        Holders::Dense(m, base, words) => {
            for (k, &w) in words.iter().enumerate() {
                let mut b = w;
                while b != 0 {
                    let slot = (base as usize + k) * 64 + b.trailing_zeros() as usize;
                    out.push(holder(slot as u32, m));
                    b &= b - 1;
                }
            }
        }
    }
}

/// Decodes a holder word into sorted holders (writer side).
fn decode_into(word: u64, out: &mut Vec<u32>) {
    out.clear();
    // Safety (of the guard-free decode): the writer reads a set it linked itself and has not
    // unlinked, so it is live for the duration of this call.
    let h = match word & TAG_MASK {
        TAG_BITS | TAG_PAIR => {
            // The inline forms do not dereference anything; decode them with a local view.
            if word & TAG_MASK == TAG_BITS {
                Holders::Bits(((word >> 2) & 0xF) as u8, word >> BITS_SHIFT)
            } else {
                Holders::Pair(
                    ((word >> 2) & PAIR_HOLDER) as u32,
                    ((word >> 33) & PAIR_HOLDER) as u32,
                )
            }
        }
        _ if word == 0 => Holders::Empty,
        // Safety: see above.
        _ => unsafe { set_view(word as usize as *const SetHeader) },
    };
    holders_into(h, out);
}

/// The set pointer of a word, if it is one.
#[inline]
fn set_ptr(word: u64) -> Option<NonNull<SetHeader>> {
    if word & TAG_MASK == 0 {
        NonNull::new(word as usize as *mut SetHeader)
    } else {
        None
    }
}

/// The bitset word of `bits` (slots below [`BITSET_SLOTS`]) all in tiers `mask`.
#[inline]
fn bits_word(mask: u8, bits: u64) -> u64 {
    TAG_BITS | u64::from(mask) << 2 | bits << BITS_SHIFT
}

/// The canonical holder word for sorted `holders` (allocating an out-of-line set if needed):
/// bitset (one shared tier mask), pair, dense (one shared tier mask, when the bitset is no
/// bigger than the holder list), sparse.
fn encode(holders: &[u32], ledger: &mut SetLedger, words: &mut Vec<u64>) -> u64 {
    let Some(&last) = holders.last() else {
        return 0;
    };
    let mask = holder_tiers(holders[0]);
    let uniform = holders.iter().all(|&h| holder_tiers(h) == mask);
    if uniform && holder_slot(last) < BITSET_SLOTS {
        let bits = holders.iter().fold(0u64, |b, &h| b | 1 << holder_slot(h));
        return bits_word(mask, bits);
    }
    if holders.len() <= 2 {
        let h1 = holders.get(1).copied().unwrap_or(0);
        return TAG_PAIR | u64::from(holders[0]) << 2 | u64::from(h1) << 33;
    }
    let base = holder_slot(holders[0]) / 64;
    let span = (holder_slot(last) / 64 - base + 1) as usize;
    let p = if uniform && 2 * span <= holders.len() {
        words.clear();
        words.resize(span, 0);
        for &h in holders {
            let s = (holder_slot(h) - base * 64) as usize;
            words[s / 64] |= 1 << (s % 64);
        }
        dense_alloc(mask, base, words)
    } else {
        sparse_alloc(holders)
    };
    ledger.linked(p).as_ptr() as usize as u64
}

/// Reusable writer storage for holder-set edits.
#[derive(Default)]
pub(crate) struct Scratch {
    holders: Vec<u32>,
    words: Vec<u64>,
}

impl Scratch {
    /// Heap bytes of the scratch buffers.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.holders.capacity() * 4 + self.words.capacity() * 8
    }
}

/// Outcome of [`Table::add`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AddOutcome {
    /// The slot already held the key in this tier; its tiers.
    AlreadySet(u8),
    /// The tier is now held. `revived`: the key had no holder before (a new or dead entry);
    /// `new_slot`: a previously empty table slot was used; `prev`: the slot's tiers before.
    Set {
        revived: bool,
        new_slot: bool,
        prev: u8,
    },
    /// The key is absent and inserting it would exceed the maximum load: rebuild first.
    Full,
}

/// Outcome of [`Table::remove`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RemoveOutcome {
    /// The key is absent, or the slot did not hold it in any of the tiers.
    NotSet,
    /// Tiers were removed; `dead`: the key has no holder left.
    Removed { dead: bool },
}

/// An open-addressing table of sequence hash → holder word. See the module docs for the
/// concurrency protocol.
pub(crate) struct Table {
    cap: usize,
    /// `cap * 2` words: per slot, the key then the holder word.
    slots: Box<[AtomicU64]>,
    /// The holder word of key 0.
    zero: AtomicU64,
    /// Under loom, set by the retire destructor instead of freeing (see `crate::sync`).
    #[cfg(loom)]
    pub(crate) poison: crate::sync::PoisonFlag,
}

impl Table {
    /// An empty table of `cap` slots (at least [`MIN_CAP`]).
    pub(crate) fn new(cap: usize) -> Self {
        let cap = cap.max(MIN_CAP);
        let slots = (0..cap * 2).map(|_| AtomicU64::new(0)).collect();
        Self {
            cap,
            slots,
            zero: AtomicU64::new(0),
            #[cfg(loom)]
            poison: crate::sync::PoisonFlag::default(),
        }
    }

    /// The capacity needed to hold `live` keys at load one half.
    pub(crate) fn cap_for(live: usize) -> usize {
        (live.saturating_add(1)).saturating_mul(2).max(MIN_CAP)
    }

    /// Number of slots.
    #[inline]
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Whether one more slot may be filled without exceeding the maximum load.
    #[inline]
    pub(crate) fn has_room(&self, used: usize) -> bool {
        (used + 1) * MAX_LOAD_DEN <= self.cap * MAX_LOAD_NUM
    }

    /// Heap bytes owned by this table itself (not its out-of-line sets).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.len() * core::mem::size_of::<AtomicU64>()
    }

    /// Hints the CPU to fetch the slot where a probe for `key` starts (writer side, before a
    /// batch of [`Self::add`] calls).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        {
            let i = home(key, self.cap) * 2;
            let p = self.slots[i..].as_ptr().cast::<i8>();
            // Safety: `_mm_prefetch` is only a cache hint: it never faults and has no effect
            // on program state (it is not a load in the memory model); `p` points into our own
            // live allocation anyway. SSE is part of the x86_64 baseline.
            unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p) };
        }
        #[cfg(not(all(target_arch = "x86_64", not(loom))))]
        let _ = key;
    }

    /// The holder-word cell of `key`, or `None` if the key has no entry (lock-free: Acquire
    /// key loads, no writes).
    #[inline]
    fn cell(&self, key: u64) -> Option<&AtomicU64> {
        #[cfg(loom)]
        self.poison.assert_alive("block table");
        if key == EMPTY {
            return Some(&self.zero);
        }
        let mut i = home(key, self.cap);
        loop {
            let base = i * 2;
            // Acquire pairs with the writer's Release store of the key, so the holder word
            // written before it is visible.
            let k = self.slots[base].load(Ordering::Acquire);
            if k == key {
                return Some(&self.slots[base + 1]);
            }
            if k == EMPTY {
                return None;
            }
            i += 1;
            if i == self.cap {
                i = 0;
            }
        }
    }

    /// The holder word of `key` (0 if absent). Reader side.
    #[inline]
    pub(crate) fn word(&self, key: u64) -> u64 {
        match self.cell(key) {
            // Acquire pairs with the writer's Release store of the word, so an out-of-line set
            // it points to is fully written.
            Some(c) => c.load(Ordering::Acquire),
            None => 0,
        }
    }

    /// The tier mask `slot` holds `key` in (0 if none). Writer side, or tests.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn tiers_of(&self, key: u64, slot: u32) -> u8 {
        let word = self.word(key);
        let mut v = Vec::new();
        decode_into(word, &mut v);
        v.iter()
            .find(|&&h| holder_slot(h) == slot)
            .map_or(0, |&h| holder_tiers(h))
    }

    /// Adds `tier` (a single-bit mask) for `slot` to `key`, inserting the key if needed.
    /// Writer side (one writer at a time); `used` is the number of non-empty table slots, which
    /// the caller tracks; `scratch` is reusable storage.
    pub(crate) fn add(
        &self,
        key: u64,
        slot: u32,
        tier: u8,
        used: usize,
        ledger: &mut SetLedger,
        scratch: &mut Scratch,
    ) -> AddOutcome {
        debug_assert!(slot < MAX_SLOTS && tier.count_ones() == 1);
        let cell = if key == EMPTY {
            &self.zero
        } else {
            let mut i = home(key, self.cap);
            loop {
                let base = i * 2;
                let k = self.slots[base].load(Ordering::Relaxed);
                if k == key {
                    break &self.slots[base + 1];
                }
                if k == EMPTY {
                    if !self.has_room(used) {
                        return AddOutcome::Full;
                    }
                    // The slot was never used in this table, so its holder word is 0.
                    let word = encode(&[holder(slot, tier)], ledger, &mut scratch.words);
                    self.slots[base + 1].store(word, Ordering::Relaxed);
                    // Invariant (write-once keys): publishes the entry; Release makes the
                    // holder word (and any set it points to) visible to readers that
                    // Acquire-load this key.
                    self.slots[base].store(key, Ordering::Release);
                    return AddOutcome::Set {
                        revived: true,
                        new_slot: true,
                        prev: 0,
                    };
                }
                i += 1;
                if i == self.cap {
                    i = 0;
                }
            }
        };
        let old = cell.load(Ordering::Relaxed);
        // Fast paths: the bitset form stays a bitset while its holders share one tier mask.
        if slot < BITSET_SLOTS && (old == 0 || old & TAG_MASK == TAG_BITS) {
            let bit = 1u64 << (slot + BITS_SHIFT);
            let mask = ((old >> 2) & 0xF) as u8;
            if old & bit != 0 && mask & tier != 0 {
                return AddOutcome::AlreadySet(mask);
            }
            if old == 0 || (old & bit == 0 && mask == tier) {
                // Release: a reader that sees the new bit sees everything written before it.
                cell.store(
                    bits_word(tier, (old | bit) >> BITS_SHIFT),
                    Ordering::Release,
                );
                return AddOutcome::Set {
                    revived: old == 0,
                    new_slot: false,
                    prev: 0,
                };
            }
        }
        let hs = &mut scratch.holders;
        decode_into(old, hs);
        let pos = hs.partition_point(|&h| holder_slot(h) < slot);
        let prev = match hs.get(pos) {
            Some(&h) if holder_slot(h) == slot => {
                if holder_tiers(h) & tier != 0 {
                    return AddOutcome::AlreadySet(holder_tiers(h));
                }
                hs[pos] = h | u32::from(tier);
                holder_tiers(h)
            }
            _ => {
                hs.insert(pos, holder(slot, tier));
                0
            }
        };
        Self::replace(cell, old, scratch, ledger);
        AddOutcome::Set {
            revived: old == 0,
            new_slot: false,
            prev,
        }
    }

    /// Stores the canonical word for `holders` in `cell` (whose word is `old`) and unlinks the
    /// set `old` pointed to, if any.
    fn replace(cell: &AtomicU64, old: u64, scratch: &mut Scratch, ledger: &mut SetLedger) {
        let new = encode(&scratch.holders, ledger, &mut scratch.words);
        // Release publishes the new set (written by `encode`) to Acquire readers.
        cell.store(new, Ordering::Release);
        if let Some(p) = set_ptr(old) {
            ledger.unlink(p);
        }
    }

    /// Removes the tiers `tiers` of `slot` from `key` (the holder goes when no tier is left).
    /// Writer side.
    pub(crate) fn remove(
        &self,
        key: u64,
        slot: u32,
        tiers: u8,
        ledger: &mut SetLedger,
        scratch: &mut Scratch,
    ) -> RemoveOutcome {
        let Some(cell) = self.cell(key) else {
            return RemoveOutcome::NotSet;
        };
        let old = cell.load(Ordering::Relaxed);
        if old & TAG_MASK == TAG_BITS {
            let mask = ((old >> 2) & 0xF) as u8;
            if slot >= BITSET_SLOTS || tiers & mask == 0 || old & (1u64 << (slot + BITS_SHIFT)) == 0
            {
                return RemoveOutcome::NotSet;
            }
            if mask & !tiers == 0 {
                // The slot loses every tier: drop its bit.
                let bits = (old >> BITS_SHIFT) & !(1u64 << slot);
                let new = if bits == 0 { 0 } else { bits_word(mask, bits) };
                cell.store(new, Ordering::Release);
                return RemoveOutcome::Removed { dead: new == 0 };
            }
            // The slot keeps some tiers, unlike the others: the general path re-encodes.
        }
        let hs = &mut scratch.holders;
        decode_into(old, hs);
        let Ok(pos) = hs.binary_search_by_key(&slot, |&h| holder_slot(h)) else {
            return RemoveOutcome::NotSet;
        };
        let h = hs[pos];
        if holder_tiers(h) & tiers == 0 {
            return RemoveOutcome::NotSet;
        }
        let left = holder_tiers(h) & !tiers;
        if left == 0 {
            hs.remove(pos);
        } else {
            hs[pos] = holder(slot, left);
        }
        let dead = hs.is_empty();
        Self::replace(cell, old, scratch, ledger);
        RemoveOutcome::Removed { dead }
    }

    /// A new table of `cap` slots holding every live entry of `self` (dead entries are
    /// dropped); holder words (and the sets they point to) move to it. Returns the table and
    /// its number of used slots. Writer side.
    pub(crate) fn rebuild(&self, cap: usize) -> (Table, usize) {
        let new = Table::new(cap);
        new.zero
            .store(self.zero.load(Ordering::Relaxed), Ordering::Relaxed);
        let mut used = 0usize;
        for entry in self.slots.chunks_exact(2) {
            let key = entry[0].load(Ordering::Relaxed);
            let word = entry[1].load(Ordering::Relaxed);
            if key == EMPTY || word == 0 {
                continue;
            }
            let mut i = home(key, new.cap);
            loop {
                let base = i * 2;
                if new.slots[base].load(Ordering::Relaxed) == EMPTY {
                    new.slots[base + 1].store(word, Ordering::Relaxed);
                    new.slots[base].store(key, Ordering::Relaxed);
                    break;
                }
                i += 1;
                if i == new.cap {
                    i = 0;
                }
            }
            used += 1;
        }
        assert!(
            new.has_room(used.saturating_sub(1)),
            "rebuilt table over its maximum load"
        );
        // The new table is published later with a Release store of the table pointer, which
        // makes all of the Relaxed stores above visible to readers that Acquire-load it.
        (new, used)
    }

    /// Hands every out-of-line set of this table to `ledger` without touching its counters
    /// (teardown: the table is being dropped, and `ledger` frees the sets when it drops).
    pub(crate) fn unlink_all(&self, ledger: &mut SetLedger) {
        let zero = self.zero.load(Ordering::Relaxed);
        for word in self
            .slots
            .chunks_exact(2)
            .map(|e| e[1].load(Ordering::Relaxed))
            .chain(core::iter::once(zero))
        {
            if let Some(p) = set_ptr(word) {
                ledger.unlinked.push(SetPtr(p.as_ptr()));
            }
        }
    }

    /// Every live `(key, holders)` entry, sorted, for tests and debugging. Writer side.
    #[cfg(all(any(test, feature = "testing"), not(loom)))]
    pub(crate) fn live_entries(&self) -> Vec<(u64, Vec<(u32, u8)>)> {
        let mut out = Vec::new();
        let mut v = Vec::new();
        let words = self
            .slots
            .chunks_exact(2)
            .map(|e| (e[0].load(Ordering::Relaxed), e[1].load(Ordering::Relaxed)))
            .chain(core::iter::once((0, self.zero.load(Ordering::Relaxed))));
        for (key, word) in words {
            if word == 0 {
                continue;
            }
            decode_into(word, &mut v);
            out.push((
                key,
                v.iter()
                    .map(|&h| (holder_slot(h), holder_tiers(h)))
                    .collect(),
            ));
        }
        out.sort();
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const CPU: u8 = 2;

    struct T {
        t: Table,
        used: usize,
        ledger: SetLedger,
        scratch: Scratch,
    }

    impl T {
        fn new(cap: usize) -> Self {
            T {
                t: Table::new(cap),
                used: 0,
                ledger: SetLedger::default(),
                scratch: Scratch::default(),
            }
        }
        fn add(&mut self, key: u64, slot: u32, tier: u8) -> AddOutcome {
            let r = self.t.add(
                key,
                slot,
                tier,
                self.used,
                &mut self.ledger,
                &mut self.scratch,
            );
            if let AddOutcome::Set { new_slot: true, .. } = r {
                self.used += 1;
            }
            r
        }
        fn remove(&mut self, key: u64, slot: u32, tiers: u8) -> RemoveOutcome {
            self.t
                .remove(key, slot, tiers, &mut self.ledger, &mut self.scratch)
        }
        fn holders(&self, key: u64) -> Vec<(u32, u8)> {
            let mut v = Vec::new();
            decode_into(self.t.word(key), &mut v);
            v.iter()
                .map(|&h| (holder_slot(h), holder_tiers(h)))
                .collect()
        }
    }

    impl Drop for T {
        fn drop(&mut self) {
            let mut sets = SetLedger::default();
            self.t.unlink_all(&mut sets);
        }
    }

    #[test]
    fn insert_find_remove() {
        let mut t = T::new(16);
        assert_eq!(t.t.word(42), 0);
        assert_eq!(
            t.add(42, 3, GPU),
            AddOutcome::Set {
                revived: true,
                new_slot: true,
                prev: 0
            }
        );
        assert_eq!(t.add(42, 3, GPU), AddOutcome::AlreadySet(GPU));
        assert_eq!(
            t.add(42, 5, GPU),
            AddOutcome::Set {
                revived: false,
                new_slot: false,
                prev: 0
            }
        );
        assert_eq!(t.t.word(42), bits_word(GPU, (1 << 3) | (1 << 5)));
        assert_eq!(t.remove(42, 3, GPU), RemoveOutcome::Removed { dead: false });
        assert_eq!(t.remove(42, 3, GPU), RemoveOutcome::NotSet);
        assert_eq!(t.remove(42, 5, GPU), RemoveOutcome::Removed { dead: true });
        assert_eq!(t.t.word(42), 0);
        // The dead entry keeps its slot and is revived in place.
        assert_eq!(
            t.add(42, 1, GPU),
            AddOutcome::Set {
                revived: true,
                new_slot: false,
                prev: 0
            }
        );
        assert_eq!(t.used, 1);
        assert_eq!(t.remove(7, 1, GPU), RemoveOutcome::NotSet);
    }

    #[test]
    fn forms_follow_the_holder_set() {
        let mut t = T::new(16);
        // Bitset: low slots, GPU only.
        t.add(9, 0, GPU);
        t.add(9, 57, GPU);
        assert_eq!(t.t.word(9) & TAG_MASK, TAG_BITS);
        // A slot past the bitset: two holders do not fit a pair with three.
        t.add(9, 62, GPU);
        // Three GPU holders within one 64-slot word: a dense set of one word.
        let guard = reclaim::pin();
        assert!(
            matches!(decode(t.t.word(9), &guard), Holders::Dense(GPU, 0, [w]) if *w == 1 | 1 << 57 | 1 << 62)
        );
        drop(guard);
        assert_eq!(t.holders(9), vec![(0, GPU), (57, GPU), (62, GPU)]);
        assert_eq!(t.ledger.live_sets, 1);
        assert_eq!(t.ledger.live_bytes, set_bytes(1 | DENSE));
        // Removing one leaves a pair (62 is beyond the bitset).
        t.remove(9, 0, GPU);
        assert_eq!(t.t.word(9) & TAG_MASK, TAG_PAIR);
        assert_eq!(t.holders(9), vec![(57, GPU), (62, GPU)]);
        assert_eq!(t.ledger.live_sets, 0);
        // A second tier on the only holder: still a bitset (one shared mask).
        t.remove(9, 62, GPU);
        assert_eq!(t.t.word(9) & TAG_MASK, TAG_BITS);
        assert_eq!(
            t.add(9, 57, CPU),
            AddOutcome::Set {
                revived: false,
                new_slot: false,
                prev: GPU
            }
        );
        assert_eq!(t.t.word(9), bits_word(GPU | CPU, 1 << 57));
        assert_eq!(t.t.tiers_of(9, 57), GPU | CPU);
        assert_eq!(t.add(9, 57, CPU), AddOutcome::AlreadySet(GPU | CPU));
        // Another holder in the GPU only: the masks differ, a pair.
        t.add(9, 3, GPU);
        assert_eq!(t.t.word(9) & TAG_MASK, TAG_PAIR);
        assert_eq!(t.holders(9), vec![(3, GPU), (57, GPU | CPU)]);
        // ... and the same mask again: a bitset.
        t.add(9, 3, CPU);
        assert_eq!(t.t.word(9), bits_word(GPU | CPU, 1 << 3 | 1 << 57));
        assert_eq!(
            t.remove(9, 3, GPU | CPU),
            RemoveOutcome::Removed { dead: false }
        );
        // Removing the GPU tier keeps the CPU copy.
        assert_eq!(t.remove(9, 57, GPU), RemoveOutcome::Removed { dead: false });
        assert_eq!(t.holders(9), vec![(57, CPU)]);
        assert_eq!(t.t.word(9), bits_word(CPU, 1 << 57));
        assert_eq!(t.remove(9, 57, GPU), RemoveOutcome::NotSet);
        assert_eq!(t.remove(9, 57, CPU), RemoveOutcome::Removed { dead: true });
        // Highest slot in a pair.
        t.add(9, MAX_SLOTS - 1, 8);
        assert_eq!(t.holders(9), vec![(MAX_SLOTS - 1, 8)]);
        t.add(9, 5, GPU);
        assert_eq!(t.holders(9), vec![(5, GPU), (MAX_SLOTS - 1, 8)]);
        let guard = reclaim::pin();
        t.ledger.retire(&guard);
    }

    #[test]
    fn sparse_and_dense_sets() {
        let mut t = T::new(16);
        // GPU holders spread far apart: a sparse set.
        for s in [100, 5_000, 90_000] {
            t.add(3, s, GPU);
        }
        let guard = reclaim::pin();
        assert!(matches!(decode(t.t.word(3), &guard), Holders::Sparse(h) if h.len() == 3));
        assert_eq!(t.ledger.live_bytes, set_bytes(3));
        // Many GPU holders in a narrow range: dense, base = first word.
        for s in 640..700 {
            t.add(4, s, GPU);
        }
        match decode(t.t.word(4), &guard) {
            Holders::Dense(m, base, words) => {
                assert_eq!((m, base, words.len()), (GPU, 10, 1));
                assert_eq!(words[0], u64::MAX >> 4);
            }
            other => panic!("{other:?}"),
        }
        // A CPU copy on one holder makes it sparse.
        t.add(4, 650, CPU);
        assert!(matches!(decode(t.t.word(4), &guard), Holders::Sparse(h) if h.len() == 60));
        assert_eq!(t.t.tiers_of(4, 650), GPU | CPU);
        assert_eq!(
            t.remove(4, 650, CPU),
            RemoveOutcome::Removed { dead: false }
        );
        assert!(matches!(
            decode(t.t.word(4), &guard),
            Holders::Dense(GPU, 10, _)
        ));
        // Every holder with the same two tiers: dense again, with that mask.
        for s in 640..700 {
            t.add(4, s, CPU);
        }
        assert!(matches!(decode(t.t.word(4), &guard), Holders::Dense(m, 10, _) if m == GPU | CPU));
        drop(guard);
        assert_eq!(t.ledger.live_sets, 2);
        let g = reclaim::pin();
        t.ledger.retire(&g);
    }

    #[test]
    fn many_holders_stay_sorted() {
        let mut t = T::new(16);
        let slots: Vec<u32> = (0..300u32).map(|i| (i * 7919) % 1000).collect();
        for &s in &slots {
            t.add(77, s, if s % 3 == 0 { CPU } else { GPU });
        }
        let mut want: Vec<(u32, u8)> = slots
            .iter()
            .map(|&s| (s, if s % 3 == 0 { CPU } else { GPU }))
            .collect();
        want.sort();
        want.dedup();
        assert_eq!(t.holders(77), want);
        for &s in &slots[..150] {
            t.remove(77, s, GPU | CPU);
        }
        let rest: Vec<u32> = slots[150..].to_vec();
        let got: Vec<u32> = t.holders(77).iter().map(|x| x.0).collect();
        let mut rs = rest.clone();
        rs.sort();
        rs.dedup();
        assert_eq!(got, rs);
        let guard = reclaim::pin();
        t.ledger.retire(&guard);
    }

    #[test]
    fn key_zero_and_sequential_keys() {
        let mut t = T::new(64);
        for k in 0..40u64 {
            assert!(matches!(
                t.add(k, (k % 70) as u32, GPU),
                AddOutcome::Set { .. }
            ));
        }
        assert_eq!(t.used, 39, "key 0 does not use a slot");
        for k in 0..40u64 {
            assert_eq!(t.holders(k), vec![((k % 70) as u32, GPU)], "key {k}");
        }
        assert_eq!(t.t.word(40), 0);
        assert_eq!(t.t.live_entries().len(), 40);
    }

    #[test]
    fn full_and_rebuild_drops_dead() {
        let mut t = T::new(16);
        let mut k = 1u64;
        while let AddOutcome::Set { .. } = t.add(k, 0, GPU) {
            k += 1;
        }
        assert_eq!(t.used, 12, "3/4 of 16 slots");
        for key in 1..7 {
            assert_eq!(t.remove(key, 0, GPU), RemoveOutcome::Removed { dead: true });
        }
        // Still full: dead entries occupy their slots until a rebuild.
        assert_eq!(
            t.t.add(100, 0, GPU, t.used, &mut t.ledger, &mut t.scratch),
            AddOutcome::Full
        );
        // A set moves to the rebuilt table untouched.
        for s in [100, 200, 300] {
            t.add(9, s, GPU);
        }
        let (n, used2) = t.t.rebuild(Table::cap_for(6));
        assert_eq!(used2, 6);
        for key in 1..13 {
            let want = if key == 9 {
                vec![(0, GPU), (100, GPU), (200, GPU), (300, GPU)]
            } else if key >= 7 {
                vec![(0, GPU)]
            } else {
                vec![]
            };
            let mut v = Vec::new();
            decode_into(n.word(key), &mut v);
            let got: Vec<(u32, u8)> = v
                .iter()
                .map(|&h| (holder_slot(h), holder_tiers(h)))
                .collect();
            assert_eq!(got, want, "key {key}");
        }
        // The old table no longer owns the set: only the new one unlinks it.
        t.t = n;
    }

    #[test]
    fn wraps_around_the_end() {
        // Keys whose home is the last slot must wrap to slot 0.
        let mut t = T::new(16);
        let keys: Vec<u64> = (1..100_000u64)
            .filter(|&k| home(k, 16) == 15)
            .take(3)
            .collect();
        for &k in &keys {
            t.add(k, 2, GPU);
        }
        for &k in &keys {
            assert_eq!(t.holders(k), vec![(2, GPU)]);
        }
    }

    /// Slot 57 is the last one the inline bitset holds: slot 58 takes the pair form, whether it
    /// is the first holder of a key or joins a bitset, and removing slot 58 or above from a
    /// bitset finds nothing.
    #[test]
    fn bitset_ends_before_slot_58() {
        let mut t = T::new(16);
        assert_eq!(
            t.add(1, BITSET_SLOTS, GPU),
            AddOutcome::Set {
                revived: true,
                new_slot: true,
                prev: 0
            }
        );
        assert_eq!(
            t.t.word(1),
            TAG_PAIR | u64::from(holder(BITSET_SLOTS, GPU)) << 2
        );
        assert_eq!(t.holders(1), vec![(58, GPU)]);
        t.add(2, 3, GPU);
        assert_eq!(
            t.add(2, BITSET_SLOTS, GPU),
            AddOutcome::Set {
                revived: false,
                new_slot: false,
                prev: 0
            }
        );
        assert_eq!(t.t.word(2) & TAG_MASK, TAG_PAIR);
        assert_eq!(t.holders(2), vec![(3, GPU), (58, GPU)]);
        assert_eq!(
            t.remove(2, BITSET_SLOTS, GPU),
            RemoveOutcome::Removed { dead: false }
        );
        assert_eq!(t.t.word(2), bits_word(GPU, 1 << 3));
        assert_eq!(t.remove(2, BITSET_SLOTS, GPU), RemoveOutcome::NotSet);
        assert_eq!(t.remove(2, 63, GPU), RemoveOutcome::NotSet);
        assert_eq!(t.t.word(2), bits_word(GPU, 1 << 3));
    }

    /// A pair word never takes the bitset fast paths: adding a low slot to a pair re-encodes
    /// the whole set (here as a dense set), and removing a tier that a pair holder lacks finds
    /// nothing and leaves the word as it was.
    #[test]
    fn pair_words_take_the_general_path() {
        let mut t = T::new(16);
        t.add(5, 3, GPU);
        t.add(5, 60, GPU);
        let pair = t.t.word(5);
        assert_eq!(
            pair,
            TAG_PAIR | u64::from(holder(3, GPU)) << 2 | u64::from(holder(60, GPU)) << 33
        );
        assert_eq!(t.remove(5, 3, CPU), RemoveOutcome::NotSet);
        assert_eq!(t.remove(5, 60, CPU), RemoveOutcome::NotSet);
        assert_eq!(t.t.word(5), pair);
        assert_eq!(
            t.add(5, 4, GPU),
            AddOutcome::Set {
                revived: false,
                new_slot: false,
                prev: 0
            }
        );
        assert_eq!(t.holders(5), vec![(3, GPU), (4, GPU), (60, GPU)]);
        let guard = reclaim::pin();
        assert!(
            matches!(decode(t.t.word(5), &guard), Holders::Dense(GPU, 0, [w]) if *w == 1 << 3 | 1 << 4 | 1 << 60)
        );
    }

    /// Removing every tier of one holder of a bitset drops its bit and keeps the shared tier
    /// mask of the others.
    #[test]
    fn removing_all_tiers_keeps_the_shared_mask() {
        let mut t = T::new(16);
        t.add(6, 5, GPU);
        t.add(6, 9, GPU);
        assert_eq!(t.remove(6, 5, 0xF), RemoveOutcome::Removed { dead: false });
        assert_eq!(t.t.word(6), bits_word(GPU, 1 << 9));
        assert_eq!(t.remove(6, 9, 0xF), RemoveOutcome::Removed { dead: true });
        assert_eq!(t.t.word(6), 0);
    }

    /// A uniform set is dense once its bitset words are at most half its holders
    /// (`2 * span <= len`): five GPU holders over three 64-slot words stay sparse, a sixth makes
    /// them a dense set of three words from word 1. The ledger counts each linked set's exact
    /// bytes (an 8-byte header, then 4 per sparse holder or 8 per dense word), and `retire`
    /// hands the unlinked ones to the reclaimer.
    #[test]
    fn dense_sets_span_several_words() {
        let mut t = T::new(16);
        // 64..=66 is a dense set, 67 replaces it, 200 makes it sparse.
        for s in [64, 65, 66, 67, 200] {
            t.add(8, s, GPU);
        }
        let guard = reclaim::pin();
        assert!(matches!(decode(t.t.word(8), &guard), Holders::Sparse(h) if h.len() == 5));
        assert_eq!((t.ledger.live_sets, t.ledger.live_bytes), (1, 8 + 5 * 4));
        t.add(8, 68, GPU);
        match decode(t.t.word(8), &guard) {
            Holders::Dense(m, base, words) => {
                assert_eq!((m, base, words), (GPU, 1, &[0b1_1111, 0, 1 << 8][..]));
            }
            other => panic!("{other:?}"),
        }
        drop(guard);
        let want: Vec<(u32, u8)> = [64, 65, 66, 67, 68, 200].map(|s| (s, GPU)).to_vec();
        assert_eq!(t.holders(8), want);
        assert_eq!((t.ledger.live_sets, t.ledger.live_bytes), (1, 8 + 3 * 8));
        assert_eq!(t.ledger.unlinked.len(), 3);
        for (i, &(s, _)) in want.iter().enumerate() {
            assert_eq!(t.remove(8, s, GPU), RemoveOutcome::Removed { dead: i == 5 });
        }
        assert_eq!((t.ledger.live_sets, t.ledger.live_bytes), (0, 0));
        let guard = reclaim::pin();
        t.ledger.retire(&guard);
        assert!(t.ledger.unlinked.is_empty());
    }

    /// `unlink_all` hands every out-of-line set of the table, key 0's included, to the
    /// ledger, without touching its counters.
    #[test]
    fn unlink_all_hands_over_every_set() {
        let mut t = T::new(16);
        for s in [100, 5_000, 90_000] {
            t.add(0, s, GPU);
            t.add(11, s, GPU);
        }
        t.add(12, 1, GPU);
        assert_eq!(t.ledger.live_sets, 2);
        let mut sets = SetLedger::default();
        t.t.unlink_all(&mut sets);
        assert_eq!(sets.unlinked.len(), 2);
        assert_eq!((sets.live_sets, sets.live_bytes), (0, 0));
        // `sets` frees them when dropped: the table must not hand them over again.
        t.t = Table::new(16);
    }

    /// Byte counts: a table owns two words per slot, the scratch 4 bytes per holder and 8 per
    /// bitset word of capacity, and a set its 8-byte header plus its payload.
    #[test]
    fn byte_counts() {
        assert_eq!(Table::new(1).cap(), MIN_CAP);
        assert_eq!(Table::new(100).heap_bytes(), 100 * 16);
        let s = Scratch {
            holders: Vec::with_capacity(3),
            words: Vec::with_capacity(5),
        };
        assert_eq!(
            s.heap_bytes(),
            4 * s.holders.capacity() + 8 * s.words.capacity()
        );
        assert_eq!(set_bytes(3), 8 + 3 * 4);
        assert_eq!(set_bytes(DENSE | 2), 8 + 2 * 8);
    }

    /// `home` spreads sequential keys: keys 1 to 64 get 64 different homes among 4096 slots.
    #[test]
    fn sequential_keys_get_distinct_homes() {
        let mut homes: Vec<usize> = (1..=64u64).map(|k| home(k, 4096)).collect();
        homes.sort_unstable();
        homes.dedup();
        assert_eq!(homes.len(), 64);
    }

    /// A rebuild probes past taken slots, wrapping at the end, for keys sharing a home.
    #[test]
    fn rebuild_places_colliding_keys() {
        let mut t = T::new(16);
        let keys: Vec<u64> = (1..100_000u64)
            .filter(|&k| home(k, 16) == 15)
            .take(3)
            .collect();
        for (s, &k) in keys.iter().enumerate() {
            t.add(k, s as u32, GPU);
        }
        let (n, used) = t.t.rebuild(16);
        assert_eq!(used, 3);
        for (s, &k) in keys.iter().enumerate() {
            assert_eq!(n.word(k), bits_word(GPU, 1 << s), "key {k}");
        }
    }
}
