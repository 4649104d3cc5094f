//! The [`Policy`] interface between the simulated cluster and a routing policy, and the
//! policies that need no router: [`RoundRobin`], [`PowerOfTwo`], [`Oracle`].

use std::fmt;

use super::Replica;
use crate::blocks::KvEvent;
use crate::rng::SplitMix64;

/// What a policy needs of a request besides its block hashes (the simulator derives only
/// what is asked for, outside the timed routing call).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// The prompt's tokens ([`RouteRequest::tokens`]).
    pub tokens: bool,
    /// The prompt's text ([`RouteRequest::text`]).
    pub text: bool,
}

/// What a policy sees of a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Request id (dense, in arrival order).
    pub id: u64,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens (empty unless the policy's [`Needs::tokens`]).
    pub tokens: &'a [u32],
    /// Prompt text (empty unless the policy's [`Needs::text`]).
    pub text: &'a str,
    /// Sequence hashes of the prompt's full blocks.
    pub seq_hashes: &'a [u64],
    /// Response length (known to the simulator; routers may use it as the expected length).
    pub output_tokens: usize,
}

/// The cluster as a policy may observe it at decision time.
#[derive(Clone, Copy, Debug)]
pub struct ClusterView<'a> {
    replicas: &'a [Replica],
    loads: &'a [usize],
}

impl<'a> ClusterView<'a> {
    /// A view of `replicas`, whose queue lengths are `loads`.
    pub fn new(replicas: &'a [Replica], loads: &'a [usize]) -> Self {
        Self { replicas, loads }
    }

    /// The number of replicas.
    pub fn len(&self) -> usize {
        self.loads.len()
    }

    /// Whether there are no replicas.
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty()
    }

    /// Every replica's queue length (running + waiting), by index.
    pub fn loads(&self) -> &'a [usize] {
        self.loads
    }

    /// When replica `r`'s least recently used block was last used, if its cache is full
    /// (see [`LruCache::eviction_age`](super::LruCache::eviction_age)).
    pub fn eviction_age(&self, r: usize) -> Option<u64> {
        self.replicas.get(r).and_then(|x| x.cache.eviction_age())
    }

    /// The leading blocks of `seq_hashes` held in replica `r`'s cache (0 for an unknown
    /// replica). Only the [`Oracle`] looks: routers learn the caches from events.
    pub fn cached_prefix(&self, r: usize, seq_hashes: &[u64]) -> usize {
        self.replicas
            .get(r)
            .map_or(0, |x| x.cache.cached_prefix(seq_hashes))
    }
}

/// A change of one replica's cache, caused by one request's prefill or completion.
#[derive(Clone, Copy, Debug)]
pub struct CacheUpdate<'a> {
    /// The replica.
    pub replica: usize,
    /// The request whose blocks were cached.
    pub request: u64,
    /// Sequence hashes of the blocks the request cached (all cached now, up to the cache's
    /// capacity).
    pub seq_hashes: &'a [u64],
    /// Their local hashes.
    pub local_hashes: &'a [u64],
    /// The engine's KV events of the change (evictions, then stores).
    pub events: &'a [KvEvent],
}

/// A policy failed to route a request (a router error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyError(pub String);

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PolicyError {}

/// A routing policy under simulation. Only [`Policy::route`] is timed.
pub trait Policy {
    /// Display name.
    fn name(&self) -> &str;
    /// What the policy reads of a request besides its block hashes.
    fn needs(&self) -> Needs {
        Needs::default()
    }
    /// Picks a replica index in `0..cluster.len()`.
    ///
    /// # Errors
    ///
    /// The router's error, if it cannot route the request.
    fn route(
        &mut self,
        req: &RouteRequest<'_>,
        cluster: &ClusterView<'_>,
    ) -> Result<usize, PolicyError>;
    /// A replica's cache just changed (the KV events it published, and the request that
    /// caused them).
    ///
    /// # Errors
    ///
    /// The router rejected an event.
    fn cache_update(&mut self, _update: &CacheUpdate<'_>) -> Result<(), PolicyError> {
        Ok(())
    }
    /// The request's prefill finished (its first token was produced).
    fn prefill_complete(&mut self, _id: u64) {}
    /// The request finished.
    fn request_complete(&mut self, _id: u64) {}
}

/// Round-robin over the replicas.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// Starting at replica `start` (taken modulo the replica count).
    pub fn starting_at(start: usize) -> Self {
        Self { next: start }
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn route(
        &mut self,
        _req: &RouteRequest<'_>,
        c: &ClusterView<'_>,
    ) -> Result<usize, PolicyError> {
        let r = self.next % c.len().max(1);
        self.next = self.next.wrapping_add(1);
        Ok(r)
    }
}

/// Power of two choices on queue length: two distinct replicas drawn at random (seeded), the
/// shorter queue wins (the first drawn on ties).
#[derive(Debug)]
pub struct PowerOfTwo {
    rng: SplitMix64,
}

impl PowerOfTwo {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix64::new(seed),
        }
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &str {
        "power-of-two"
    }
    fn route(
        &mut self,
        _req: &RouteRequest<'_>,
        c: &ClusterView<'_>,
    ) -> Result<usize, PolicyError> {
        let loads = c.loads();
        let n = loads.len() as u64;
        if n <= 1 {
            return Ok(0);
        }
        let a = self.rng.below(n) as usize;
        let b = (a + 1 + self.rng.below(n - 1) as usize) % n as usize;
        Ok(if loads[b] < loads[a] { b } else { a })
    }
}

/// A reference policy that sees what no router can: every replica's cache contents and queue
/// at decision time. Among the replicas whose queue length is at most the shortest queue +
/// `slack` (its balance bound), it picks the one holding the longest cached prefix of the
/// prompt at decision time (not counting what prefills queued there will have cached by the
/// time the request's own prefill starts: greedy on those, it herds requests onto the
/// replicas computing a popular prefix); ties go to the shortest queue, then to the cache
/// whose least recently used block is oldest (what the prompt would displace matters least
/// there; a cache with room first), then rotate. A strong reference for hit rate under a load bound, not a proof of
/// optimality: greedy placement can lose to a policy that keeps each prefix on one replica
/// whatever the caches do.
///
/// ```
/// use kvtrie::sim::{ClusterView, Oracle, Policy, Replica, RouteRequest};
/// let mut replicas = vec![Replica::new(64, 4), Replica::new(64, 4)];
/// let mut ev = Vec::new();
/// replicas[1].cache.insert(&[10, 11], &[1, 2], &mut ev);
/// let req = RouteRequest { id: 0, prompt_tokens: 48, tokens: &[], text: "", seq_hashes: &[10, 11, 12], output_tokens: 1 };
/// let mut oracle = Oracle::new(2);
/// // Replica 1 holds 2 leading blocks and its queue (2) is within min (0) + slack (2).
/// assert_eq!(oracle.route(&req, &ClusterView::new(&replicas, &[0, 2])).unwrap(), 1);
/// // Beyond the bound, the cache no longer wins.
/// assert_eq!(oracle.route(&req, &ClusterView::new(&replicas, &[0, 3])).unwrap(), 0);
/// ```
#[derive(Debug)]
pub struct Oracle {
    slack: usize,
    rotation: usize,
    name: String,
    scores: Vec<Option<(usize, usize, u64)>>,
}

impl Oracle {
    /// An oracle whose balance bound allows queues up to the shortest + `slack`.
    pub fn new(slack: usize) -> Self {
        Self {
            slack,
            rotation: 0,
            name: "oracle".into(),
            scores: Vec::new(),
        }
    }
}

impl Policy for Oracle {
    fn name(&self) -> &str {
        &self.name
    }
    fn route(&mut self, req: &RouteRequest<'_>, c: &ClusterView<'_>) -> Result<usize, PolicyError> {
        let loads = c.loads();
        let Some(&min) = loads.iter().min() else {
            return Err(PolicyError("no replicas".into()));
        };
        let bound = min.saturating_add(self.slack);
        self.scores.clear();
        // Score (cached blocks, −queue, −LRU age) of every eligible replica; the best wins.
        // A cache with room scores as if its LRU block were infinitely old.
        self.scores.extend(loads.iter().enumerate().map(|(r, &l)| {
            let age = c.eviction_age(r).map_or(0, |used| used.saturating_add(1));
            (l <= bound).then(|| {
                (
                    c.cached_prefix(r, req.seq_hashes),
                    usize::MAX - l,
                    u64::MAX - age,
                )
            })
        }));
        let best = self.scores.iter().flatten().max().copied();
        let best = best.ok_or_else(|| PolicyError("no eligible replica".into()))?;
        let ties = self.scores.iter().filter(|s| **s == Some(best)).count();
        let k = if ties > 1 {
            self.rotation = self.rotation.wrapping_add(1);
            self.rotation % ties
        } else {
            0
        };
        let pick = self
            .scores
            .iter()
            .enumerate()
            .filter(|(_, s)| **s == Some(best))
            .nth(k);
        Ok(pick.map_or(0, |(r, _)| r))
    }
}
