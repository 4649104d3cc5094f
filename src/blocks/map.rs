//! A compact single-threaded `u64 → V` hash map for the writer's per-worker bookkeeping
//! (engine hash → sequence hash, or → sequence hash and copy counts): `8 + size_of::<V>()`
//! bytes per slot (16 for `V = u64`), linear probing, backward-shift deletion (no tombstones),
//! arbitrary capacities so the load stays at most `MAX_NUM / MAX_DEN` (resizing to
//! `TARGET_NUM / TARGET_DEN`).

use super::table::home;

/// Grow when the load would exceed `MAX_NUM / MAX_DEN`.
const MAX_NUM: usize = 4;
const MAX_DEN: usize = 5;
/// Resize to load `TARGET_NUM / TARGET_DEN` when growing or shrinking.
const TARGET_NUM: usize = 5;
const TARGET_DEN: usize = 9;
const MIN_CAP: usize = 8;

/// Engine hash → `V`. Key 0 is stored out of line.
pub(crate) struct EngineMap<V: Copy + Default = u64> {
    /// `(key, value)`; key 0 marks an empty slot.
    slots: Vec<(u64, V)>,
    len: usize,
    zero: Option<V>,
}

impl<V: Copy + Default> Default for EngineMap<V> {
    fn default() -> Self {
        EngineMap {
            slots: Vec::new(),
            len: 0,
            zero: None,
        }
    }
}

impl<V: Copy + Default> EngineMap<V> {
    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Heap bytes owned by the map.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * core::mem::size_of::<(u64, V)>()
    }

    fn index_of(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let cap = self.slots.len();
        let mut i = home(key, cap);
        loop {
            let k = self.slots[i].0;
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// Hints the CPU to fetch the slot where a probe for `key` starts (bulk inserts issue it a
    /// few keys ahead, so the cache misses of consecutive keys overlap).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if !self.slots.is_empty() {
            crate::hint::prefetch(self.slots[home(key, self.slots.len())..].as_ptr());
        }
    }

    /// Whether the map is empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value of `key`.
    pub(crate) fn get(&self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero;
        }
        self.index_of(key).map(|i| self.slots[i].1)
    }

    /// The value of `key`, to update in place.
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == 0 {
            return self.zero.as_mut();
        }
        let i = self.index_of(key)?;
        Some(&mut self.slots[i].1)
    }

    /// Inserts or replaces; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        if key == 0 {
            return self.zero.replace(value);
        }
        if let Some(i) = self.index_of(key) {
            return Some(core::mem::replace(&mut self.slots[i].1, value));
        }
        if (self.len + 1) * MAX_DEN > self.slots.len() * MAX_NUM {
            self.resize((self.len + 1) * TARGET_DEN / TARGET_NUM + 1);
        }
        self.place(key, value);
        self.len += 1;
        None
    }

    /// Makes room for `additional` more entries without resizing, growing at least to twice
    /// the capacity when it must grow (bulk loads: fewer, larger rehashes).
    pub(crate) fn reserve(&mut self, additional: usize) {
        let want = self.len.saturating_add(additional);
        if want.saturating_mul(MAX_DEN) > self.slots.len().saturating_mul(MAX_NUM) {
            let cap = (want.saturating_mul(TARGET_DEN) / TARGET_NUM + 1).max(self.slots.len() * 2);
            self.resize(cap);
        }
    }

    /// Resizes to the load a grown map settles at, if the map is larger (after bulk loads
    /// that [`Self::reserve`]d ahead).
    pub(crate) fn shrink_to_target(&mut self) {
        let cap = (self.len * TARGET_DEN / TARGET_NUM + 1).max(MIN_CAP);
        if self.slots.len() > cap {
            self.resize(cap);
        }
    }

    fn place(&mut self, key: u64, value: V) {
        let cap = self.slots.len();
        let mut i = home(key, cap);
        while self.slots[i].0 != 0 {
            i += 1;
            if i == cap {
                i = 0;
            }
        }
        self.slots[i] = (key, value);
    }

    fn resize(&mut self, cap: usize) {
        let cap = cap.max(MIN_CAP);
        let old = core::mem::replace(&mut self.slots, vec![(0, V::default()); cap]);
        for (k, v) in old {
            if k != 0 {
                self.place(k, v);
            }
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero.take();
        }
        let mut hole = self.index_of(key)?;
        let value = self.slots[hole].1;
        let cap = self.slots.len();
        // Backward-shift deletion: move later members of the probe run into the hole when
        // their home does not lie cyclically in (hole, j].
        let mut j = hole;
        loop {
            j += 1;
            if j == cap {
                j = 0;
            }
            let k = self.slots[j].0;
            if k == 0 {
                break;
            }
            let h = home(k, cap);
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = (0, V::default());
        self.len -= 1;
        if self.len == 0 {
            self.slots = Vec::new();
        } else if cap > 4 * MIN_CAP && self.len * 5 < cap {
            self.resize(self.len * TARGET_DEN / TARGET_NUM + 1);
        }
        Some(value)
    }

    /// Every `(key, value)` entry, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        self.zero
            .map(|v| (0, v))
            .into_iter()
            .chain(self.slots.iter().copied().filter(|&(k, _)| k != 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn matches_std_hashmap() {
        let mut m: EngineMap = EngineMap::default();
        let mut r: HashMap<u64, u64> = HashMap::new();
        let mut x = 12345u64;
        let n = if cfg!(miri) { 300 } else { 20_000 };
        for i in 0..n {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            // Small keys, so inserts and removes collide; include key 0.
            let key = (x >> 33) % 200;
            if (x >> 20).is_multiple_of(3) {
                assert_eq!(m.remove(key), r.remove(&key), "op {i}");
            } else {
                assert_eq!(m.insert(key, i), r.insert(key, i), "op {i}");
            }
            assert_eq!(m.len(), r.len());
            if i % 97 == 0 {
                for k in 0..200 {
                    assert_eq!(m.get(k), r.get(&k).copied(), "op {i} key {k}");
                }
                let mut a: Vec<_> = m.iter().collect();
                let mut b: Vec<_> = r.iter().map(|(&k, &v)| (k, v)).collect();
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn grows_and_shrinks() {
        let mut m: EngineMap = EngineMap::default();
        for k in 1..=10_000u64 {
            m.insert(k, k * 2);
        }
        assert!(m.heap_bytes() <= 10_000 * 16 * 2, "{}", m.heap_bytes());
        for k in 1..=9_990u64 {
            assert_eq!(m.remove(k), Some(k * 2));
        }
        assert_eq!(m.len(), 10);
        assert!(m.heap_bytes() < 1_000, "{}", m.heap_bytes());
        for k in 9_991..=10_000u64 {
            assert_eq!(m.get(k), Some(k * 2));
        }
    }
}
