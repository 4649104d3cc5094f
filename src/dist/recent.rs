//! [`Recent`]: a map that forgets keys not touched for a while, for the per-worker counters of
//! the relay and the consumer.
//!
//! Worker ids come and go (an engine restarted under a new id never says goodbye), so a map
//! keyed by every worker ever seen would grow by an entry per restart for as long as the
//! process runs. These maps only need workers that could still matter: one silent for longer
//! than the stream's retention has no message left in the stream to be compared with, so it
//! is forgotten. Forgetting is amortized: when an insert finds the map at its limit, entries
//! idle for the span are dropped and the limit becomes twice what is left (at least
//! [`MIN_LIMIT`]), so each insert pays O(1) on average and the map holds at most about twice
//! the keys touched within one span.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// The smallest limit: maps this small are never swept.
pub(crate) const MIN_LIMIT: usize = 64;

/// A map from keys to values that drops the entries idle for longer than a span.
#[derive(Debug)]
pub(crate) struct Recent<K, V> {
    map: HashMap<K, (V, Instant)>,
    idle: Duration,
    /// The size at which the next insert of a new key sweeps.
    limit: usize,
}

impl<K: Eq + Hash, V: Copy> Recent<K, V> {
    /// An empty map forgetting keys idle for longer than `idle`.
    pub(crate) fn new(idle: Duration) -> Self {
        Self {
            map: HashMap::new(),
            idle,
            limit: MIN_LIMIT,
        }
    }

    /// The value of `key`, if it was touched within the span (or not swept yet).
    pub(crate) fn get(&self, key: &K) -> Option<V> {
        self.map.get(key).map(|&(v, _)| v)
    }

    /// Sets `key` to `value`, touched at `now`; returns its previous value. An insert of a new
    /// key into a full map first forgets every key idle for longer than the span at `now`.
    pub(crate) fn insert(&mut self, key: K, value: V, now: Instant) -> Option<V> {
        if let Some(slot) = self.map.get_mut(&key) {
            let prev = slot.0;
            *slot = (value, now);
            return Some(prev);
        }
        if self.map.len() >= self.limit {
            let idle = self.idle;
            self.map
                .retain(|_, &mut (_, at)| now.saturating_duration_since(at) <= idle);
            self.limit = (2 * self.map.len()).max(MIN_LIMIT);
            // A sweep scans the whole table: after a burst, give back what it grew to, or
            // every later sweep would scan the burst's capacity.
            if self.map.capacity() > 4 * self.limit {
                self.map.shrink_to(self.limit);
            }
        }
        self.map.insert(key, (value, now));
        None
    }

    /// Keys held (forgotten ones included until a sweep drops them).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Entries the table has room for.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn capacity(&self) -> usize {
        self.map.capacity()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn values_are_kept_and_replaced() {
        let t0 = Instant::now();
        let mut m = Recent::new(Duration::from_secs(10));
        assert_eq!(m.insert(1u64, 5u64, t0), None);
        assert_eq!(m.get(&1), Some(5));
        assert_eq!(m.insert(1, 6, t0), Some(5));
        assert_eq!(m.get(&1), Some(6));
        assert_eq!(m.get(&2), None);
    }

    /// Fresh keys arriving for ever, each touched once: the map stays within twice the keys
    /// of one span (plus the minimum), and keys touched within the span are never dropped.
    #[test]
    fn a_stream_of_fresh_keys_stays_bounded() {
        let t0 = Instant::now();
        let span = Duration::from_millis(100);
        let mut m = Recent::new(span);
        // One key per millisecond (about 100 per span) and one key touched every step.
        let mut largest = 0;
        for i in 0..100_000u64 {
            let now = t0 + Duration::from_millis(i);
            m.insert(i + 1, i, now);
            m.insert(0, i, now);
            largest = largest.max(m.len());
            if i >= 100 {
                assert_eq!(
                    m.get(&(i - 100 + 1)),
                    Some(i - 100),
                    "touched within the span"
                );
            }
            assert_eq!(m.get(&0), Some(i));
        }
        assert!(largest <= 2 * 102 + MIN_LIMIT, "{largest}");
    }

    /// After a burst of keys, a sweep gives the table's room back: later sweeps scan a table
    /// of the size of what is left, not of the burst.
    #[test]
    fn a_burst_does_not_leave_a_large_table_behind() {
        let t0 = Instant::now();
        let span = Duration::from_millis(10);
        let mut m = Recent::new(span);
        for k in 0..100_000u64 {
            m.insert(k, k, t0);
        }
        assert!(m.capacity() >= 100_000);
        // Slow churn afterwards, one key per span: once the map reaches its limit (set by the
        // burst), the sweep leaves a few keys and a small table.
        for k in 0..40_000u64 {
            m.insert(1_000_000 + k, k, t0 + span * (k as u32 + 2));
        }
        assert!(m.len() <= 2 * MIN_LIMIT, "{}", m.len());
        assert!(m.capacity() <= 8 * MIN_LIMIT, "{}", m.capacity());
    }

    /// A sweep sets the limit to twice what it left: the keys it kept, then as many new ones
    /// again, are held before the next insert sweeps (so each insert pays O(1) on average).
    #[test]
    fn after_a_sweep_the_limit_is_twice_what_is_left() {
        let t0 = Instant::now();
        let span = Duration::from_millis(10);
        let (t1, t2) = (
            t0 + Duration::from_secs(3600),
            t0 + Duration::from_secs(7200),
        );
        let mut m = Recent::new(span);
        // 24 keys go idle, 40 are fresh when the map reaches its limit.
        for k in 0..24u64 {
            m.insert(k, k, t0);
        }
        for k in 100..140u64 {
            m.insert(k, k, t1);
        }
        assert_eq!(m.len(), MIN_LIMIT);
        // The next new key sweeps: 40 left, limit 80.
        m.insert(1_000, 0, t1);
        assert_eq!(m.len(), 41);
        assert_eq!(m.get(&0), None);
        // Everything is idle by t2, but no sweep comes before the map holds 80 keys.
        for k in 2_000..2_039u64 {
            m.insert(k, k, t2);
        }
        assert_eq!(m.len(), 80);
        assert_eq!(m.get(&100), Some(100));
        // The 81st key sweeps the idle ones: the 39 of t2 stay, with it.
        m.insert(3_000, 0, t2);
        assert_eq!(m.len(), 40);
        assert_eq!(m.get(&100), None);
        assert_eq!(m.get(&2_000), Some(2_000));
    }

    /// A map below its limit is never swept, whatever the time: a small, stable set of
    /// workers keeps its entries however long they are silent.
    #[test]
    fn small_maps_are_not_swept() {
        let t0 = Instant::now();
        let mut m = Recent::new(Duration::from_millis(1));
        for k in 0..MIN_LIMIT as u64 - 1 {
            m.insert(k, k, t0);
        }
        m.insert(1000, 0, t0 + Duration::from_secs(3600));
        assert_eq!(m.len(), MIN_LIMIT);
        assert_eq!(m.get(&0), Some(0));
        // The next new key finds the map full and forgets the idle ones.
        m.insert(1001, 0, t0 + Duration::from_secs(3600));
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(&0), None);
        assert_eq!(m.get(&1000), Some(0));
    }
}
