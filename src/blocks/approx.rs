//! Approximate mode: a [`BlockIndex`] fed by the router's own routing decisions instead of
//! engine events (Dynamo's "approx KV indexer"), with TTL expiry and a per-worker block bound
//! evicting least recently routed blocks first.

use std::collections::{HashMap, VecDeque};

use super::event::{StoredBlock, WorkerId};
use super::index::{BlockIndex, OverlapScores};
use crate::sync::{lock, Mutex};

/// Expiry policy of an [`ApproxIndex`]. Times are `u64` in caller units (e.g. milliseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApproxConfig {
    /// A block not routed to a worker again within `ttl` is forgotten for that worker by
    /// [`ApproxIndex::expire`]. `u64::MAX`: never.
    pub ttl: u64,
    /// Maximum blocks remembered per worker (0: unbounded); beyond it the least recently routed
    /// blocks are forgotten, the tail of a request before its prefix.
    pub max_blocks_per_worker: usize,
}

impl Default for ApproxConfig {
    /// Dynamo's default: 120 s TTL (in milliseconds), unbounded.
    fn default() -> Self {
        Self {
            ttl: 120_000,
            max_blocks_per_worker: 0,
        }
    }
}

/// Per worker: sequence hash → last routing time, and a queue of `(time, seq)` in time order
/// (stale entries, whose block was routed again later, are skipped lazily).
#[derive(Default)]
struct Lru {
    last: HashMap<u64, u64>,
    queue: VecDeque<(u64, u64)>,
    /// Largest time recorded, so that the queue stays sorted even if clocks step back.
    clock: u64,
}

/// A block index that predicts cache contents from routing decisions.
///
/// [`ApproxIndex::record`] notes that a request's blocks are now cached on a worker; lookups
/// go straight to the lock-free [`BlockIndex`] (see [`ApproxIndex::index`]); expiry and
/// the per-worker bound run on the writer side.
///
/// ```
/// use kvtrie::blocks::{ApproxConfig, ApproxIndex};
/// use kvtrie::WorkerId;
///
/// let approx = ApproxIndex::new(ApproxConfig { ttl: 1_000, max_blocks_per_worker: 0 });
/// approx.record(WorkerId(3), &[11, 12, 13], 0);
/// assert_eq!(approx.find_matches(&[11, 12, 99]).get(WorkerId(3)), 2);
/// approx.expire(1_000);
/// assert!(approx.find_matches(&[11]).is_empty());
/// ```
pub struct ApproxIndex {
    index: BlockIndex,
    config: ApproxConfig,
    lru: Mutex<HashMap<WorkerId, Lru>>,
}

impl core::fmt::Debug for ApproxIndex {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ApproxIndex")
            .field("config", &self.config)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl ApproxIndex {
    /// An empty approximate index with the default hasher (seed 1337, block size 16).
    pub fn new(config: ApproxConfig) -> Self {
        Self::with_index(BlockIndex::new(), config)
    }

    /// An approximate index over `index` (use [`BlockIndex::with_hasher`] for salted hashes).
    pub fn with_index(index: BlockIndex, config: ApproxConfig) -> Self {
        Self {
            index,
            config,
            lru: Mutex::new(HashMap::new()),
        }
    }

    /// The underlying index, for lock-free lookups and introspection.
    pub fn index(&self) -> &BlockIndex {
        &self.index
    }

    /// The expiry policy.
    pub fn config(&self) -> ApproxConfig {
        self.config
    }

    /// [`BlockIndex::find_matches`] on the predicted contents.
    pub fn find_matches(&self, local_hashes: &[u64]) -> OverlapScores {
        self.index.find_matches(local_hashes)
    }

    /// Records that a request with these **local** block hashes was routed to `worker` at
    /// time `now`: all its blocks count as cached there (and refreshed) until they expire or
    /// are evicted by the per-worker bound.
    pub fn record(&self, worker: WorkerId, local_hashes: &[u64], now: u64) {
        if local_hashes.is_empty() {
            return;
        }
        let seqs = self.index.hasher().chain_local(local_hashes);
        let blocks: Vec<StoredBlock> = local_hashes
            .iter()
            .zip(&seqs)
            .map(|(&local_hash, &engine_hash)| StoredBlock {
                engine_hash,
                local_hash,
            })
            .collect();
        let mut lru = lock(&self.lru);
        // The engine hash of a predicted block is its sequence hash, so re-recording a prefix
        // is an idempotent store.
        if self.index.store_blocks_idempotent(worker, &blocks).is_err() {
            // The index is full of workers: nothing was recorded.
            return;
        }
        let w = lru.entry(worker).or_default();
        w.clock = w.clock.max(now);
        let t = w.clock;
        // Tail first: among blocks routed at the same time, the queue evicts a request's
        // last blocks before its prefix. A block already recorded at `t` keeps its entry (a
        // second one would be current too, and a clock that does not advance would then grow
        // the queue by a request's blocks on every record).
        for &s in seqs.iter().rev() {
            if w.last.insert(s, t) != Some(t) {
                w.queue.push_back((t, s));
            }
        }
        let max = self.config.max_blocks_per_worker;
        let mut evicted = Vec::new();
        if max > 0 {
            while w.last.len() > max {
                match Self::pop_oldest(w) {
                    Some(s) => evicted.push(s),
                    None => break,
                }
            }
        }
        Self::compact(w);
        if !evicted.is_empty() {
            self.index.remove_blocks(worker, &evicted);
        }
    }

    /// Forgets every block whose last routing time `t` has `t + ttl <= now` (with a `ttl` of
    /// `u64::MAX`, none, whatever `now`). Returns the number of (worker, block) pairs forgotten.
    pub fn expire(&self, now: u64) -> usize {
        if self.config.ttl == u64::MAX {
            return 0;
        }
        let mut lru = lock(&self.lru);
        let mut total = 0;
        for (&worker, w) in lru.iter_mut() {
            let mut evicted = Vec::new();
            while let Some(&(t, s)) = w.queue.front() {
                if w.last.get(&s) != Some(&t) {
                    w.queue.pop_front(); // stale: the block was routed again later
                    continue;
                }
                if t.saturating_add(self.config.ttl) > now {
                    break;
                }
                w.queue.pop_front();
                w.last.remove(&s);
                evicted.push(s);
            }
            Self::compact(w);
            total += evicted.len();
            if !evicted.is_empty() {
                self.index.remove_blocks(worker, &evicted);
            }
        }
        total
    }

    /// Forgets `worker` entirely; returns the blocks it held.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        let mut lru = lock(&self.lru);
        lru.remove(&worker);
        self.index.remove_worker(worker)
    }

    /// Blocks remembered for `worker`.
    pub fn block_count(&self, worker: WorkerId) -> usize {
        self.index.block_count(worker)
    }

    /// Pops queue entries until one is current (not superseded by a later routing of the same
    /// block); forgets and returns that block.
    fn pop_oldest(w: &mut Lru) -> Option<u64> {
        while let Some((t, s)) = w.queue.pop_front() {
            if w.last.get(&s) == Some(&t) {
                w.last.remove(&s);
                return Some(s);
            }
        }
        None
    }

    /// Drops stale queue entries once they outnumber the live ones, so the queue stays
    /// O(blocks remembered).
    fn compact(w: &mut Lru) {
        if w.queue.len() > 2 * w.last.len() + 64 {
            let last = &w.last;
            w.queue.retain(|(t, s)| last.get(s) == Some(t));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const W: WorkerId = WorkerId(1);

    #[test]
    fn ttl_expiry_and_refresh() {
        let a = ApproxIndex::new(ApproxConfig {
            ttl: 100,
            max_blocks_per_worker: 0,
        });
        a.record(W, &[1, 2, 3], 0);
        a.record(W, &[1, 2], 50); // refreshes the prefix
        assert_eq!(a.expire(99), 0);
        assert_eq!(
            a.expire(100),
            1,
            "block 3 expires, the refreshed prefix stays"
        );
        assert_eq!(a.find_matches(&[1, 2, 3]).get(W), 2);
        assert_eq!(a.expire(150), 2);
        assert!(a.find_matches(&[1]).is_empty());
        assert_eq!(a.block_count(W), 0);
    }

    #[test]
    fn bound_evicts_least_recent_tail_first() {
        let a = ApproxIndex::new(ApproxConfig {
            ttl: u64::MAX,
            max_blocks_per_worker: 4,
        });
        a.record(W, &[1, 2, 3], 0);
        a.record(W, &[7, 8], 1);
        // 5 blocks > 4: the oldest request loses its last block, not its first.
        assert_eq!(a.block_count(W), 4);
        assert_eq!(a.find_matches(&[1, 2, 3]).get(W), 2);
        assert_eq!(a.find_matches(&[7, 8]).get(W), 2);
        // Re-routing the old prefix makes the other request the least recent.
        a.record(W, &[1, 2], 2);
        a.record(W, &[5], 3);
        assert_eq!(a.find_matches(&[1, 2]).get(W), 2);
        assert_eq!(a.find_matches(&[7, 8]).get(W), 1);
        assert_eq!(a.find_matches(&[5]).get(W), 1);
        assert_eq!(a.expire(u64::MAX - 1), 0);
        // "Never" holds at the end of time too (t + ttl saturated to u64::MAX <= now).
        assert_eq!(a.expire(u64::MAX), 0);
        assert_eq!(a.block_count(W), 4);
    }

    #[test]
    fn a_clock_stepping_back_never_shortens_a_blocks_life() {
        let a = ApproxIndex::new(ApproxConfig {
            ttl: 100,
            max_blocks_per_worker: 0,
        });
        a.record(W, &[1], 100);
        // Routed again with an earlier clock: the block was last routed at 100 all the same.
        a.record(W, &[1], 50);
        assert_eq!(a.expire(150), 0);
        assert_eq!(a.find_matches(&[1]).get(W), 1);
        assert_eq!(a.expire(199), 0);
        assert_eq!(a.expire(200), 1);
        assert_eq!(a.block_count(W), 0);
    }

    #[test]
    fn queue_stays_bounded_when_the_clock_stands_still() {
        let a = ApproxIndex::new(ApproxConfig {
            ttl: u64::MAX,
            max_blocks_per_worker: 1024,
        });
        let prefix: Vec<u64> = (1..=16).collect();
        for _ in 0..if cfg!(miri) { 50 } else { 5_000 } {
            a.record(W, &prefix, 7);
        }
        a.record(W, &[1, 2, 99], 7);
        let lru = lock(&a.lru);
        assert_eq!(lru[&W].queue.len(), 17, "one entry per block remembered");
        drop(lru);
        assert_eq!(a.block_count(W), 17);
        assert_eq!(a.find_matches(&prefix).get(W), 16);
    }

    #[test]
    fn queue_stays_bounded_under_refreshes() {
        let a = ApproxIndex::new(ApproxConfig {
            ttl: 10,
            max_blocks_per_worker: 0,
        });
        for t in 0..1000 {
            a.record(W, &[1, 2, 3, 4], t);
        }
        let lru = lock(&a.lru);
        assert!(lru[&W].queue.len() <= 2 * 4 + 64 + 4);
        drop(lru);
        assert_eq!(a.expire(1009), 4);
        assert_eq!(a.remove_worker(W), 0);
    }
}
