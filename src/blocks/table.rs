//! The raw concurrent table behind [`crate::BlockIndex`]: sequence hash → bitset of worker slots.
//!
//! Open addressing with linear probing over one flat array of `AtomicU64`s. Each entry is
//! `1 + words` words: the key, then `words` bitset words (bit `s` of word `s / 64` = worker
//! slot `s`). Capacities are arbitrary (not powers of two): the home slot of a key is
//! `fastrange(mix(key), cap)`.
//!
//! # Protocol
//!
//! - **One writer at a time.** Every mutating method is called by the holder of the index's
//!   writer mutex; readers never take it.
//! - **Keys are write-once.** Word 0 of an entry is `EMPTY` (0) until the writer publishes a
//!   key there with a `Release` store, after the entry's bitset words were written; it never
//!   changes again for the lifetime of this table. Removing a key only clears its bits (the entry
//!   becomes *dead*, a tombstone that still holds its key and is revived if the same key is
//!   stored again); dead entries are dropped when the writer rebuilds the table.
//! - **Readers never miss a present key.** The writer places a key in the first `EMPTY` slot of
//!   its probe sequence (or finds it already there). Since slots never return to `EMPTY`, every
//!   slot between a key's home and its position stays non-empty, so a reader's probe (Acquire
//!   key loads, stopping at the key or at `EMPTY`) reaches it.
//! - **Probes terminate.** The writer keeps at most `MAX_LOAD` of the slots non-empty, so every
//!   probe sequence meets an `EMPTY` slot.
//! - Key 0 cannot be stored in a slot (it is `EMPTY`); its bitset lives in `zero`.

use crate::sync::{AtomicU64, Ordering};

/// Maximum fraction of non-empty slots (live + dead), as `MAX_LOAD_NUM / MAX_LOAD_DEN`.
const MAX_LOAD_NUM: usize = 3;
const MAX_LOAD_DEN: usize = 4;
/// Smallest capacity a table is built with.
pub(crate) const MIN_CAP: usize = 16;

/// A word that marks a slot without key.
const EMPTY: u64 = 0;

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

/// Outcome of [`Table::set_bit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SetOutcome {
    /// The bit was already set.
    AlreadySet,
    /// The bit is now set. `revived`: the key had no bits before (a new or dead entry);
    /// `new_slot`: a previously empty slot was used.
    Set { revived: bool, new_slot: bool },
    /// The key is absent and inserting it would exceed the maximum load: rebuild first.
    Full,
}

/// Outcome of [`Table::clear_bit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ClearOutcome {
    /// The key is absent or the bit was not set.
    NotSet,
    /// The bit was cleared; `dead`: the key has no bits left.
    Cleared { dead: bool },
}

/// An open-addressing table of sequence hash → worker-slot bitset. See the module docs for the
/// concurrency protocol.
pub(crate) struct Table {
    cap: usize,
    words: usize,
    /// `cap * (1 + words)` words: per slot, the key then the bitset words.
    slots: Box<[AtomicU64]>,
    /// The bitset of key 0.
    zero: Box<[AtomicU64]>,
    /// Under loom, set by the retire destructor instead of freeing (see `crate::sync`).
    #[cfg(loom)]
    pub(crate) poison: crate::sync::PoisonFlag,
}

impl Table {
    /// An empty table of `cap` slots (at least [`MIN_CAP`]) with `words` bitset words per key.
    pub(crate) fn new(cap: usize, words: usize) -> Self {
        let cap = cap.max(MIN_CAP);
        let words = words.max(1);
        let slots = (0..cap * (1 + words)).map(|_| AtomicU64::new(0)).collect();
        let zero = (0..words).map(|_| AtomicU64::new(0)).collect();
        Self {
            cap,
            words,
            slots,
            zero,
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

    /// Bitset words per key (the table can hold worker slots `0..64 * words`).
    #[inline]
    pub(crate) fn words(&self) -> usize {
        self.words
    }

    /// Whether one more slot may be filled without exceeding the maximum load.
    #[inline]
    pub(crate) fn has_room(&self, used: usize) -> bool {
        (used + 1) * MAX_LOAD_DEN <= self.cap * MAX_LOAD_NUM
    }

    /// Heap bytes owned by this table.
    pub(crate) fn heap_bytes(&self) -> usize {
        (self.slots.len() + self.zero.len()) * core::mem::size_of::<AtomicU64>()
    }

    /// Hints the CPU to fetch the slot where a probe for `key` starts (writer side, before a
    /// batch of [`Self::set_bit`] calls).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        {
            let i = home(key, self.cap) * (1 + self.words);
            let p = self.slots[i..].as_ptr().cast::<i8>();
            // Safety: `_mm_prefetch` is only a cache hint: it never faults and has no effect
            // on program state (it is not a load in the memory model); `p` points into our own
            // live allocation anyway. SSE is part of the x86_64 baseline.
            unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p) };
        }
        #[cfg(not(all(target_arch = "x86_64", not(loom))))]
        let _ = key;
    }

    /// The bitset words of `key`, or `None` if the key has no entry (reader side: lock-free,
    /// Acquire key loads, no writes).
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<&[AtomicU64]> {
        #[cfg(loom)]
        self.poison.assert_alive("block table");
        if key == EMPTY {
            return Some(&self.zero);
        }
        let stride = 1 + self.words;
        let mut i = home(key, self.cap);
        loop {
            let base = i * stride;
            // Acquire pairs with the writer's Release store of the key, so the bitset words
            // written before it are visible.
            let k = self.slots[base].load(Ordering::Acquire);
            if k == key {
                return Some(&self.slots[base + 1..base + stride]);
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

    /// Word 0 of the bitset of `key` (0 if absent). Reader side.
    #[inline]
    pub(crate) fn word0(&self, key: u64) -> u64 {
        match self.find(key) {
            // Relaxed: the bits carry no data that must be synchronized; the reader loaded
            // the slot-name snapshot before this load (see `index.rs`, "Worker slots").
            Some(w) => w[0].load(Ordering::Relaxed),
            None => 0,
        }
    }

    /// Whether `slot`'s bit is set for `key`. Writer side.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn test_bit(&self, key: u64, slot: usize) -> bool {
        let (w, m) = (slot / 64, 1u64 << (slot % 64));
        if w >= self.words {
            return false;
        }
        match self.find(key) {
            Some(words) => words[w].load(Ordering::Relaxed) & m != 0,
            None => false,
        }
    }

    /// Sets `slot`'s bit for `key`, inserting the key if needed. Writer side (one writer at a
    /// time); `used` is the number of non-empty slots, which the caller tracks.
    ///
    /// # Panics
    ///
    /// If `slot >= 64 * words` (the caller rebuilds with more words first).
    pub(crate) fn set_bit(&self, key: u64, slot: usize, used: usize) -> SetOutcome {
        let (w, m) = (slot / 64, 1u64 << (slot % 64));
        assert!(
            w < self.words,
            "worker slot beyond the table's bitset width"
        );
        if key == EMPTY {
            return Self::or_bit(&self.zero, w, m, false);
        }
        let stride = 1 + self.words;
        let mut i = home(key, self.cap);
        loop {
            let base = i * stride;
            let k = self.slots[base].load(Ordering::Relaxed);
            if k == key {
                return Self::or_bit(&self.slots[base + 1..base + stride], w, m, false);
            }
            if k == EMPTY {
                if !self.has_room(used) {
                    return SetOutcome::Full;
                }
                // The slot was never used in this table, so its bitset words are all zero.
                self.slots[base + 1 + w].store(m, Ordering::Relaxed);
                // Invariant (write-once keys): publishes the entry; Release makes the bitset
                // store above visible to readers that Acquire-load this key.
                self.slots[base].store(key, Ordering::Release);
                return SetOutcome::Set {
                    revived: true,
                    new_slot: true,
                };
            }
            i += 1;
            if i == self.cap {
                i = 0;
            }
        }
    }

    fn or_bit(words: &[AtomicU64], w: usize, m: u64, new_slot: bool) -> SetOutcome {
        let was_empty = words.iter().all(|x| x.load(Ordering::Relaxed) == 0);
        let old = words[w].fetch_or(m, Ordering::Release);
        if old & m != 0 {
            SetOutcome::AlreadySet
        } else {
            SetOutcome::Set {
                revived: was_empty,
                new_slot,
            }
        }
    }

    /// Clears `slot`'s bit for `key`. Writer side. The entry stays (dead if no bits remain).
    pub(crate) fn clear_bit(&self, key: u64, slot: usize) -> ClearOutcome {
        let (w, m) = (slot / 64, 1u64 << (slot % 64));
        if w >= self.words {
            return ClearOutcome::NotSet;
        }
        let Some(words) = self.find(key) else {
            return ClearOutcome::NotSet;
        };
        let old = words[w].fetch_and(!m, Ordering::Release);
        if old & m == 0 {
            return ClearOutcome::NotSet;
        }
        let dead = words.iter().all(|x| x.load(Ordering::Relaxed) == 0);
        ClearOutcome::Cleared { dead }
    }

    /// A new table of `cap` slots and `words` bitset words holding every live entry of `self`
    /// (dead entries are dropped). Returns the table and its number of used slots. Writer side.
    pub(crate) fn rebuild(&self, cap: usize, words: usize) -> (Table, usize) {
        let new = Table::new(cap, words.max(self.words));
        let (old_stride, new_stride) = (1 + self.words, 1 + new.words);
        for (z_new, z_old) in new.zero.iter().zip(self.zero.iter()) {
            z_new.store(z_old.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let mut used = 0usize;
        for entry in self.slots.chunks_exact(old_stride) {
            let key = entry[0].load(Ordering::Relaxed);
            if key == EMPTY || entry[1..].iter().all(|x| x.load(Ordering::Relaxed) == 0) {
                continue;
            }
            let mut i = home(key, new.cap);
            loop {
                let base = i * new_stride;
                if new.slots[base].load(Ordering::Relaxed) == EMPTY {
                    for (d, s) in new.slots[base + 1..base + new_stride]
                        .iter()
                        .zip(&entry[1..])
                    {
                        d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
                    }
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

    /// Every live `(key, bitset)` entry, for tests and debugging. Writer side.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn live_entries(&self) -> Vec<(u64, Vec<u64>)> {
        let mut out = Vec::new();
        let z: Vec<u64> = self
            .zero
            .iter()
            .map(|x| x.load(Ordering::Relaxed))
            .collect();
        if z.iter().any(|&x| x != 0) {
            out.push((0, z));
        }
        for entry in self.slots.chunks_exact(1 + self.words) {
            let key = entry[0].load(Ordering::Relaxed);
            let bits: Vec<u64> = entry[1..]
                .iter()
                .map(|x| x.load(Ordering::Relaxed))
                .collect();
            if key != EMPTY && bits.iter().any(|&x| x != 0) {
                out.push((key, bits));
            }
        }
        out.sort();
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn set(t: &Table, used: &mut usize, key: u64, slot: usize) -> SetOutcome {
        let r = t.set_bit(key, slot, *used);
        if let SetOutcome::Set { new_slot: true, .. } = r {
            *used += 1;
        }
        r
    }

    #[test]
    fn insert_find_clear() {
        let t = Table::new(16, 1);
        let mut used = 0;
        assert_eq!(t.word0(42), 0);
        assert_eq!(
            set(&t, &mut used, 42, 3),
            SetOutcome::Set {
                revived: true,
                new_slot: true
            }
        );
        assert_eq!(set(&t, &mut used, 42, 3), SetOutcome::AlreadySet);
        assert_eq!(
            set(&t, &mut used, 42, 5),
            SetOutcome::Set {
                revived: false,
                new_slot: false
            }
        );
        assert_eq!(t.word0(42), (1 << 3) | (1 << 5));
        assert_eq!(t.clear_bit(42, 3), ClearOutcome::Cleared { dead: false });
        assert_eq!(t.clear_bit(42, 3), ClearOutcome::NotSet);
        assert_eq!(t.clear_bit(42, 5), ClearOutcome::Cleared { dead: true });
        assert_eq!(t.word0(42), 0);
        // The dead entry keeps its slot and is revived in place.
        assert_eq!(
            set(&t, &mut used, 42, 1),
            SetOutcome::Set {
                revived: true,
                new_slot: false
            }
        );
        assert_eq!(used, 1);
        assert_eq!(t.clear_bit(7, 1), ClearOutcome::NotSet);
    }

    #[test]
    fn key_zero_and_sequential_keys() {
        let t = Table::new(64, 1);
        let mut used = 0;
        for k in 0..40u64 {
            assert!(matches!(
                set(&t, &mut used, k, (k % 64) as usize),
                SetOutcome::Set { .. }
            ));
        }
        assert_eq!(used, 39, "key 0 does not use a slot");
        for k in 0..40u64 {
            assert_eq!(t.word0(k), 1 << (k % 64), "key {k}");
        }
        assert_eq!(t.word0(40), 0);
        assert_eq!(t.live_entries().len(), 40);
    }

    #[test]
    fn full_and_rebuild_drops_dead() {
        let t = Table::new(16, 1);
        let mut used = 0;
        let mut k = 1u64;
        while let SetOutcome::Set { .. } = set(&t, &mut used, k, 0) {
            k += 1;
        }
        assert_eq!(used, 12, "3/4 of 16 slots");
        for key in 1..7 {
            assert_eq!(t.clear_bit(key, 0), ClearOutcome::Cleared { dead: true });
        }
        // Still full: dead entries occupy their slots until a rebuild.
        assert_eq!(t.set_bit(100, 0, used), SetOutcome::Full);
        let (n, used2) = t.rebuild(Table::cap_for(6), 2);
        assert_eq!(used2, 6);
        assert_eq!(n.words(), 2);
        for key in 1..13 {
            assert_eq!(n.word0(key), u64::from(key >= 7), "key {key}");
        }
        assert!(matches!(n.set_bit(100, 70, used2), SetOutcome::Set { .. }));
        assert!(n.test_bit(100, 70));
        assert!(!n.test_bit(100, 6));
        assert_eq!(n.find(100).map(|w| w[1].load(Ordering::Relaxed)), Some(64));
    }

    #[test]
    fn wraps_around_the_end() {
        // Keys whose home is the last slot must wrap to slot 0.
        let t = Table::new(16, 1);
        let mut used = 0;
        let keys: Vec<u64> = (1..100_000u64)
            .filter(|&k| home(k, 16) == 15)
            .take(3)
            .collect();
        for &k in &keys {
            set(&t, &mut used, k, 2);
        }
        for &k in &keys {
            assert_eq!(t.word0(k), 4);
        }
    }
}
