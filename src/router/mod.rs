//! Routing policies over the structures: thin, safe layers that turn a match into a choice.
//!
//! - [`PrefixAffinityRouter`]: Ray Serve's `PrefixCacheAffinityRouter` policy (and an SGLang
//!   `cache_aware` preset) over a [`PrefixTree`](crate::PrefixTree). One request costs one
//!   tree descent: the match, the choice and the insert of the prompt for the chosen replica
//!   happen in [`PrefixTree::match_and_insert`](crate::PrefixTree::match_and_insert).
//! - [`KvAwareRouter`]: NVIDIA Dynamo's cost policy over a [`BlockIndex`](crate::BlockIndex):
//!   `cost = overlap_weight × (request blocks − cached overlap) + active decode blocks` (the
//!   prefill queued on a worker is booked and reported, not costed), lowest cost (or softmax
//!   sampling), with the chosen worker's load booked in the same call.
//! - [`LoadBook`]: the load booking [`KvAwareRouter`] is built on (per-worker load words read
//!   without a lock, a choose-and-book validated against them, prompt blocks active once per
//!   worker, a sharded request table, exact releases, TTL expiry), public for routing
//!   policies of one's own.
//!
//! The routers contain no `unsafe` code. Their only shared mutable state besides the
//! structures they wrap is load bookkeeping: per-router counters (tie rotation, a seeded
//! random stream), per-worker load words, and a sharded request table.
//!
//! ```
//! use kvtrie::router::{Candidate, PrefixAffinityConfig, PrefixAffinityRouter, RouteReason};
//!
//! let router = PrefixAffinityRouter::new(PrefixAffinityConfig::default());
//! let ids = router.update_replicas(&["a", "b"]);
//! let idle: Vec<Candidate> = ids.iter().map(|&r| Candidate::new(r, 0)).collect();
//! let first = router.route("You are a helpful assistant. Hi!", &idle).unwrap();
//! let again = router.route("You are a helpful assistant. Bye!", &idle).unwrap();
//! assert_eq!(again.replica, first.replica);
//! assert_eq!(again.reason, RouteReason::PrefixMatch);
//! ```

mod kv_aware;
mod load;
mod prefix_affinity;

pub use kv_aware::{
    KvAwareConfig, KvAwareRouter, KvAwareStats, SelectError, Selection, MAX_OVERLAP_WEIGHT,
};
pub use load::{Booked, Choice, LoadBook, LoadStats, WorkerLoad};
pub use prefix_affinity::{
    prompt_text, prompt_text_into, Candidate, ChatMessage, ContentPart, LoadChoice, MessageContent,
    MissPolicy, PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId, Route, RouteError,
    RouteReason,
};

use crate::blocks::HasherError;
use crate::sync::{AtomicU64, Ordering};
use crate::tree::EvictionConfigError;
use std::fmt;

use crate::rng::{mix64, GOLDEN};

/// A seeded SplitMix64 stream shared by the threads of one router: each draw is one relaxed
/// `fetch_add` (no lock). Single-threaded, the sequence is a pure function of the seed.
#[derive(Debug)]
struct SharedRng(AtomicU64);

impl SharedRng {
    fn new(seed: u64) -> Self {
        Self(AtomicU64::new(seed))
    }

    #[inline]
    fn next(&self) -> u64 {
        mix64(
            self.0
                .fetch_add(GOLDEN, Ordering::Relaxed)
                .wrapping_add(GOLDEN),
        )
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift.
    #[inline]
    fn below(&self, n: usize) -> usize {
        ((self.next() as u128 * n as u128) >> 64) as usize
    }

    /// Uniform in `[0, 1)`.
    #[inline]
    fn unit(&self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A per-router rotation counter: ties are broken by taking the `k`-th tied option, `k`
/// advancing by one per tie, so consecutive ties spread over the tied options.
#[derive(Debug, Default)]
struct Rotation(AtomicU64);

impl Rotation {
    /// An index in `0..n`; touches the shared counter only when there is a real tie.
    #[inline]
    fn pick(&self, n: usize) -> usize {
        if n <= 1 {
            0
        } else {
            (self.0.fetch_add(1, Ordering::Relaxed) % n as u64) as usize
        }
    }
}

/// A `HashMap` hasher for integer ids (request ids, worker ids): one SplitMix64 mix, no
/// SipHash. Ids are not attacker-chosen keys here (they come from the router's own caller).
#[derive(Clone, Copy, Default, Debug)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    #[inline]
    fn finish(&self) -> u64 {
        mix64(self.0)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01B3);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.wrapping_add(n).wrapping_mul(GOLDEN);
    }
}

type IdBuildHasher = std::hash::BuildHasherDefault<IdHasher>;

/// Why a router configuration ([`KvAwareConfig`], [`PrefixAffinityConfig`]), or the router
/// built from it, is unusable.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The block size cannot make a hasher (it is 0).
    Hasher(HasherError),
    /// The eviction settings are unusable (see [`EvictionConfig::validate`]).
    ///
    /// [`EvictionConfig::validate`]: crate::EvictionConfig::validate
    Eviction(EvictionConfigError),
    /// A field has an unusable value.
    InvalidValue {
        /// The field.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// The shared index chains sequence hashes with another seed than the configuration's
    /// hasher, so its matches would never agree with the router's hashes.
    SeedMismatch {
        /// The index's seed.
        index: u64,
        /// The configuration's seed.
        config: u64,
    },
    /// The shared index hashes token blocks of another size than the configuration's, so the
    /// blocks the router hashes from a request never name the index's.
    BlockSizeMismatch {
        /// The index's block size.
        index: usize,
        /// The configuration's block size.
        config: usize,
    },
}

impl From<HasherError> for ConfigError {
    fn from(e: HasherError) -> Self {
        ConfigError::Hasher(e)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Hasher(e) => write!(f, "KV-aware router config: {e}"),
            ConfigError::Eviction(e) => write!(f, "router config: `eviction`: {e}"),
            ConfigError::InvalidValue { field, reason } => {
                write!(f, "router config: `{field}` {reason}")
            }
            ConfigError::SeedMismatch { index, config } => write!(
                f,
                "the index chains hashes with seed {index}, the router's hasher with {config}: \
                 build it with BlockIndex::with_hasher(&config.hasher())"
            ),
            ConfigError::BlockSizeMismatch { index, config } => write!(
                f,
                "the index hashes blocks of {index} tokens, the router's configuration of \
                 {config}: build it with BlockIndex::with_hasher(&config.hasher())"
            ),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Hasher(e) => Some(e),
            ConfigError::Eviction(e) => Some(e),
            _ => None,
        }
    }
}
