//! [`KvAwareRouter`]: NVIDIA Dynamo's KV-overlap cost policy over a [`BlockIndex`], with load
//! booking.

use super::{mix64, IdBuildHasher, Rotation, SharedRng};
use crate::blocks::{
    BlockHasher, BlockIndex, CacheKeys, HasherError, OverlapScores, TierWeights, WorkerId,
};
use crate::sync::{AtomicU64, Mutex, Ordering};
use crossbeam_utils::CachePadded;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Parameters of a [`KvAwareRouter`].
///
/// ```
/// use std::time::Duration;
/// use kvtrie::router::KvAwareConfig;
///
/// let c = KvAwareConfig::new(32);
/// assert_eq!((c.block_size, c.overlap_weight, c.temperature), (32, 1.0, 0.0));
/// assert_eq!(KvAwareConfig::default().block_size, 16);
/// assert_eq!(c.reservation_ttl, Duration::from_secs(300));
/// // A salted configuration hashes like Dynamo with a LoRA name and namespace.
/// let salted = KvAwareConfig { salt: Some(("my-lora".into(), "ns".into())), ..c };
/// assert_ne!(salted.hasher().seed(), KvAwareConfig::new(32).hasher().seed());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct KvAwareConfig {
    /// Tokens per KV block (must match the engines' and the index's hashing).
    pub block_size: usize,
    /// Weight of prefill work against decode load (Dynamo's `overlap_score_weight`): 1.0.
    pub overlap_weight: f64,
    /// 0.0: the lowest cost wins. Above 0: softmax sampling over `−cost / temperature`.
    pub temperature: f64,
    /// Optional hashing salt `(lora_name, namespace)` (see [`BlockHasher::with_salt`]).
    pub salt: Option<(String, String)>,
    /// Seed of the router's random stream (softmax sampling).
    pub seed: u64,
    /// A booking not completed within this time is released (stale reservation).
    pub reservation_ttl: Duration,
    /// How much a cached block is worth in each storage tier (default GPU 1.0, CPU 0.8, disk
    /// 0.5, other 1.0; see [`TierWeights`]): the overlap in the cost is the tier-weighted one.
    pub tier_weights: TierWeights,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self::new(16)
    }
}

impl KvAwareConfig {
    /// Defaults with blocks of `block_size` tokens: weight 1.0, temperature 0, no salt,
    /// seed 0, reservations expire after 300 s.
    ///
    /// # Panics
    ///
    /// If `block_size == 0`; [`Self::try_new`] returns an error instead.
    pub fn new(block_size: usize) -> Self {
        match Self::try_new(block_size) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::new`], or [`ConfigError::Hasher`] for a block size of 0.
    ///
    /// ```
    /// use kvtrie::router::{ConfigError, KvAwareConfig};
    /// assert!(matches!(KvAwareConfig::try_new(0), Err(ConfigError::Hasher(_))));
    /// assert_eq!(KvAwareConfig::try_new(16).unwrap(), KvAwareConfig::new(16));
    /// ```
    pub fn try_new(block_size: usize) -> Result<Self, ConfigError> {
        BlockHasher::try_new(block_size)?;
        Ok(Self {
            block_size,
            overlap_weight: 1.0,
            temperature: 0.0,
            salt: None,
            seed: 0,
            reservation_ttl: Duration::from_secs(300),
            tier_weights: TierWeights::default(),
        })
    }

    /// Checks the fields (they are public, so a struct literal can set anything): a positive
    /// block size, a finite non-negative overlap weight and temperature, and a non-zero
    /// reservation TTL.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvtrie::router::{ConfigError, KvAwareConfig};
    /// let c = KvAwareConfig { overlap_weight: f64::NAN, ..KvAwareConfig::new(16) };
    /// assert!(matches!(c.validate(), Err(ConfigError::InvalidValue { field: "overlap_weight", .. })));
    /// let c = KvAwareConfig { reservation_ttl: Duration::ZERO, ..KvAwareConfig::new(16) };
    /// assert!(c.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        BlockHasher::try_new(self.block_size)?;
        for (field, value) in [
            ("overlap_weight", self.overlap_weight),
            ("temperature", self.temperature),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(ConfigError::InvalidValue {
                    field,
                    reason: "must be finite and not negative",
                });
            }
        }
        if self.reservation_ttl.is_zero() {
            return Err(ConfigError::InvalidValue {
                field: "reservation_ttl",
                reason: "must not be zero",
            });
        }
        if let Err(reason) = self.tier_weights.validate() {
            return Err(ConfigError::InvalidValue {
                field: "tier_weights",
                reason,
            });
        }
        Ok(())
    }

    /// The hasher this configuration describes (block size and salt). The router's index must
    /// chain sequence hashes with the same seed: build it with
    /// `BlockIndex::with_hasher(&config.hasher())`.
    ///
    /// # Panics
    ///
    /// If `block_size == 0`; [`Self::try_hasher`] returns an error instead.
    pub fn hasher(&self) -> BlockHasher {
        match self.try_hasher() {
            Ok(h) => h,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::hasher`], or an error for a block size of 0.
    pub fn try_hasher(&self) -> Result<BlockHasher, ConfigError> {
        let h = BlockHasher::try_new(self.block_size)?;
        Ok(match &self.salt {
            Some((lora, ns)) => h.with_salt(lora, ns),
            None => h,
        })
    }
}

/// Why a [`KvAwareConfig`] (or the router built from it) is unusable.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The block size cannot make a hasher (it is 0).
    Hasher(HasherError),
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
            ConfigError::InvalidValue { field, reason } => {
                write!(f, "KV-aware router config: `{field}` {reason}")
            }
            ConfigError::SeedMismatch { index, config } => write!(
                f,
                "the index chains hashes with seed {index}, the router's hasher with {config}: \
                 build it with BlockIndex::with_hasher(&config.hasher())"
            ),
        }
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConfigError::Hasher(e) => Some(e),
            _ => None,
        }
    }
}

/// The worker [`KvAwareRouter::select_and_reserve`] chose, and what it booked there.
///
/// ```
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
/// use kvtrie::WorkerId;
/// let router = KvAwareRouter::new(KvAwareConfig::new(4));
/// let s = router.select_and_reserve(1, &[1, 2, 3, 4, 5], &[WorkerId(0)], 8).unwrap();
/// // 5 tokens = 2 blocks (ceil), none cached: prefill 2; decode 2 + 8/4 = 4.
/// assert_eq!((s.worker, s.overlap_blocks, s.prefill_blocks, s.decode_blocks), (WorkerId(0), 0, 2, 4));
/// assert_eq!(s.cost, 2.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Selection {
    /// The chosen worker: with data-parallel engines, one rank of one engine (send the request
    /// to [`Selection::engine`] with `data_parallel_rank` = [`Selection::dp_rank`]).
    pub worker: WorkerId,
    /// Leading blocks of the request the worker already holds (in any tier).
    pub overlap_blocks: usize,
    /// The same overlap weighted by storage tier ([`KvAwareConfig::tier_weights`]): what the
    /// cost counts as cached.
    pub weighted_overlap: f64,
    /// The worker's cost at the time of the choice (see [`KvAwareRouter`]).
    pub cost: f64,
    /// Prefill blocks booked on the worker (released by
    /// [`prefill_complete`](KvAwareRouter::prefill_complete)).
    pub prefill_blocks: usize,
    /// Decode blocks booked on the worker (released by
    /// [`request_complete`](KvAwareRouter::request_complete)).
    pub decode_blocks: usize,
}

impl Selection {
    /// The engine of the chosen worker ([`WorkerId::engine`]).
    pub fn engine(&self) -> u64 {
        self.worker.engine()
    }

    /// The data-parallel rank of the chosen worker ([`WorkerId::dp_rank`]).
    pub fn dp_rank(&self) -> u16 {
        self.worker.dp_rank()
    }
}

/// Errors of [`KvAwareRouter::select_and_reserve`].
///
/// ```
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter, SelectError};
/// use kvtrie::WorkerId;
/// let router = KvAwareRouter::new(KvAwareConfig::default());
/// assert_eq!(router.select_and_reserve(1, &[], &[WorkerId(0)], 0), Err(SelectError::EmptyTokens));
/// assert_eq!(router.select_and_reserve(1, &[7], &[], 0), Err(SelectError::NoWorkers));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SelectError {
    /// The request has no tokens.
    EmptyTokens,
    /// The allowed worker set is empty.
    NoWorkers,
}

impl fmt::Display for SelectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SelectError::EmptyTokens => write!(f, "the request has no tokens"),
            SelectError::NoWorkers => write!(f, "no allowed workers"),
        }
    }
}

impl std::error::Error for SelectError {}

/// The load booked on one worker, in blocks.
///
/// ```
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter, WorkerLoad};
/// use kvtrie::WorkerId;
/// let router = KvAwareRouter::new(KvAwareConfig::new(4));
/// assert_eq!(router.load(WorkerId(3)), WorkerLoad::default());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WorkerLoad {
    /// Prompt blocks still to be computed (booked requests whose prefill has not completed).
    pub prefill_blocks: u64,
    /// Blocks the booked requests keep active on the worker (prompt + expected output), until
    /// they complete.
    pub decode_blocks: u64,
}

/// Counters of a [`KvAwareRouter`] (see [`KvAwareRouter::stats`]).
///
/// ```
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
/// let router = KvAwareRouter::new(KvAwareConfig::default());
/// assert!(!router.request_complete(42));
/// assert_eq!(router.stats().unknown_ids, 1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvAwareStats {
    /// Successful selections.
    pub selections: u64,
    /// Bookings currently held.
    pub active_requests: u64,
    /// Prefill parts released by `prefill_complete`.
    pub prefills_completed: u64,
    /// Bookings released by `request_complete`.
    pub requests_completed: u64,
    /// Bookings released because they outlived the reservation TTL.
    pub expired: u64,
    /// Bookings replaced by a new selection with the same request id.
    pub replaced: u64,
    /// Lifecycle calls for ids with no booking (or repeated `prefill_complete`).
    pub unknown_ids: u64,
    /// Choices redone because another selection or release changed the winner's load first.
    pub retries: u64,
}

// ---------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------

/// A worker's load word: prefill blocks in the low half, decode blocks in the high half, so
/// one compare-and-swap books both.
const HALF: u64 = 32;
const LOW: u64 = (1 << HALF) - 1;

#[inline]
fn unpack(w: u64) -> WorkerLoad {
    WorkerLoad {
        prefill_blocks: w & LOW,
        decode_blocks: w >> HALF,
    }
}

#[inline]
fn pack(prefill: u64, decode: u64) -> u64 {
    (decode << HALF) | prefill
}

/// Request-table shards (a power of two).
const SHARDS: usize = 16;

#[derive(Clone, Copy, Debug)]
struct Booking {
    worker: WorkerId,
    /// Prefill blocks still booked (0 once released).
    prefill: u64,
    prefill_done: bool,
    decode: u64,
    at: Instant,
}

#[derive(Default)]
struct Shard {
    bookings: HashMap<u64, Booking, IdBuildHasher>,
    stats: KvAwareStats,
}

type Loads = HashMap<WorkerId, CachePadded<AtomicU64>, IdBuildHasher>;

/// Releases `b`'s remaining load from its worker's counter (if the worker is still known).
fn release(loads: &Loads, b: &Booking) {
    if let Some(cell) = loads.get(&b.worker) {
        cell.fetch_sub(pack(b.prefill, b.decode), Ordering::AcqRel);
    }
}

/// Per-thread scratch of a selection, so selecting allocates nothing once warm.
#[derive(Default)]
struct Scratch {
    hashes: Vec<u64>,
    scores: OverlapScores,
    overlap: Vec<usize>,
    weighted: Vec<f64>,
    loads: Vec<u64>,
    costs: Vec<f64>,
}

/// One selection request's inputs.
struct Request<'a> {
    id: u64,
    tokens: &'a [u32],
    keys: &'a CacheKeys<'a>,
    expected_output_tokens: usize,
    now: Instant,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Dynamo's KV-aware routing policy over a shared [`BlockIndex`], with load booking.
///
/// For a request of `tokens` (prompt blocks `P = ⌈tokens / block_size⌉`, the trailing partial
/// block counted as a block of work) and each allowed worker `w` holding `overlap(w)` leading
/// blocks of it (from [`BlockIndex::find_matches_weighted`] over the request's local hashes,
/// each block weighted by the best storage tier holding it, [`KvAwareConfig::tier_weights`]:
/// a GPU copy counts 1.0, a CPU copy 0.8 by default; a request shorter than one block has
/// overlap 0 everywhere and is routed by load alone):
///
/// ```text
/// cost(w) = overlap_weight × (P − overlap(w)) + active(w)
/// ```
///
/// the prefill work the request would need on `w` against the KV blocks already active
/// there: `active(w)` ([`WorkerLoad::decode_blocks`]) sums, over the requests booked on `w`
/// by earlier selections, `P + ⌈expected_output_tokens / block_size⌉` (prompt and output
/// blocks, held until [`request_complete`](Self::request_complete)). Each booking also records
/// its `⌈P − overlap⌉` blocks of prefill work ([`WorkerLoad::prefill_blocks`], released by
/// [`prefill_complete`](Self::prefill_complete)) for callers that watch queues; the cost does
/// not count them twice.
///
/// `overlap_weight` prices a cached block against an active one. Dynamo's default, 1.0,
/// balances load first; on chat traffic a larger weight keeps conversations where their
/// cache is (the simulator's sweep, `cargo run --release --example simulate -- --sweep`,
/// finds the hit rate rising up to about 32–64 with the tail latency still below
/// round-robin's; see the README).
///
/// At temperature 0 the lowest cost wins; ties rotate over the tied workers (a per-router
/// counter). At temperature `T > 0` the worker is sampled with probability ∝
/// `exp(−(cost − min cost) / T)` from the router's seeded random stream.
///
/// The choice and the booking are one step: the winner's load word is updated by a
/// compare-and-swap against the value its cost was computed from, and the choice is redone if
/// it changed meanwhile, so concurrent selections see each other's bookings and do not herd
/// onto one worker. The booking enters the request table (16 mutex-protected shards, each
/// held for one hash-map operation) in the same critical section, so a lifecycle call that
/// follows the selection always finds it. Bookings older than
/// [`reservation_ttl`](KvAwareConfig::reservation_ttl) are released by
/// [`expire_stale`](Self::expire_stale), which selections also run lazily (at most once per
/// quarter TTL), so a reservation lasts between 1 and 1.25 TTL when nobody calls it.
///
/// ```
/// use std::sync::Arc;
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
/// use kvtrie::{BlockIndex, KvEvent, StoredBlock, WorkerId};
///
/// let config = KvAwareConfig::new(4);
/// let index = Arc::new(BlockIndex::with_hasher(&config.hasher()));
/// let router = KvAwareRouter::with_index(index.clone(), config);
/// let prompt: Vec<u32> = (0..16).collect();
/// // Worker 1 holds the first 3 blocks of the prompt.
/// let local = router.hasher().local_hashes(&prompt);
/// let blocks = local[..3].iter().map(|&h| StoredBlock { engine_hash: h, local_hash: h }).collect();
/// index.apply(WorkerId(1), KvEvent::Stored { parent: None, blocks }).unwrap();
///
/// let workers = [WorkerId(0), WorkerId(1)];
/// let s = router.select_and_reserve(7, &prompt, &workers, 16).unwrap();
/// assert_eq!((s.worker, s.overlap_blocks, s.cost), (WorkerId(1), 3, 1.0));
/// // Booked: one block of prefill; the 4 prompt and 4 output blocks stay active.
/// assert_eq!(router.load(WorkerId(1)).prefill_blocks, 1);
/// assert_eq!(router.load(WorkerId(1)).decode_blocks, 4 + 4);
/// router.prefill_complete(7);
/// router.request_complete(7);
/// assert_eq!(router.load(WorkerId(1)).decode_blocks, 0);
/// ```
pub struct KvAwareRouter {
    index: Arc<BlockIndex>,
    hasher: BlockHasher,
    config: KvAwareConfig,
    /// Per-worker load words. Read-locked by every selection and release (workers are
    /// registered on first sight, under the write lock).
    loads: RwLock<Loads>,
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    rng: SharedRng,
    rotation: Rotation,
    origin: Instant,
    /// Nanoseconds since `origin` after which a selection runs `expire_stale`.
    next_sweep: AtomicU64,
}

impl fmt::Debug for KvAwareRouter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvAwareRouter")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl KvAwareRouter {
    /// A router over a new, empty index built with `config`'s hasher.
    ///
    /// # Panics
    ///
    /// If `config` is invalid ([`KvAwareConfig::validate`]); [`Self::try_new`] returns an
    /// error instead.
    pub fn new(config: KvAwareConfig) -> Self {
        match Self::try_new(config) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::new`], or the reason `config` is unusable.
    ///
    /// ```
    /// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
    /// let bad = KvAwareConfig { block_size: 0, ..KvAwareConfig::default() };
    /// assert!(KvAwareRouter::try_new(bad).is_err());
    /// assert!(KvAwareRouter::try_new(KvAwareConfig::new(16)).is_ok());
    /// ```
    pub fn try_new(config: KvAwareConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let index = Arc::new(BlockIndex::with_hasher(&config.try_hasher()?));
        Self::try_with_index(index, config)
    }

    /// A router over a shared index.
    ///
    /// # Panics
    ///
    /// If `config` is invalid, or if the index chains hashes with a different seed than
    /// `config`'s hasher (its matches would never agree with the router's hashes);
    /// [`Self::try_with_index`] returns an error instead.
    pub fn with_index(index: Arc<BlockIndex>, config: KvAwareConfig) -> Self {
        match Self::try_with_index(index, config) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::with_index`], or the reason the pair is unusable.
    pub fn try_with_index(
        index: Arc<BlockIndex>,
        config: KvAwareConfig,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let hasher = config.try_hasher()?;
        if index.hasher().seed() != hasher.seed() {
            return Err(ConfigError::SeedMismatch {
                index: index.hasher().seed(),
                config: hasher.seed(),
            });
        }
        Ok(Self {
            rng: SharedRng::new(config.seed),
            rotation: Rotation::default(),
            index,
            hasher,
            config,
            loads: RwLock::new(Loads::default()),
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(Mutex::new(Shard::default())))
                .collect(),
            origin: Instant::now(),
            next_sweep: AtomicU64::new(0),
        })
    }

    /// The index (apply engine events to it).
    pub fn index(&self) -> &Arc<BlockIndex> {
        &self.index
    }

    /// The hasher requests are hashed with.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The configuration.
    pub fn config(&self) -> &KvAwareConfig {
        &self.config
    }

    #[inline]
    fn shard(&self, request_id: u64) -> &Mutex<Shard> {
        &self.shards[mix64(request_id) as usize & (SHARDS - 1)]
    }

    fn read_loads(&self) -> std::sync::RwLockReadGuard<'_, Loads> {
        self.loads.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Chooses a worker for request `request_id` among `allowed_workers` and books its load
    /// there in the same step (see the [type docs](Self)). Selecting an id that is still
    /// booked replaces its booking (the old one is released).
    ///
    /// # Errors
    ///
    /// [`SelectError::EmptyTokens`] for an empty request, [`SelectError::NoWorkers`] for an
    /// empty allowed set.
    pub fn select_and_reserve(
        &self,
        request_id: u64,
        tokens: &[u32],
        allowed_workers: &[WorkerId],
        expected_output_tokens: usize,
    ) -> Result<Selection, SelectError> {
        if tokens.is_empty() {
            return Err(SelectError::EmptyTokens);
        }
        if allowed_workers.is_empty() {
            return Err(SelectError::NoWorkers);
        }
        self.select_and_reserve_with(
            request_id,
            tokens,
            &CacheKeys::default(),
            allowed_workers,
            expected_output_tokens,
        )
    }

    /// [`Self::select_and_reserve`] for a request in a cache partition (LoRA adapter,
    /// `cache_salt`, multimodal items; see [`CacheKeys`]): its blocks are hashed as the engine
    /// hashes them, so it matches only blocks cached for the same partition.
    ///
    /// ```
    /// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
    /// use kvtrie::blocks::{CacheKeys, KvEvent, StoredBlock, WorkerId};
    /// let router = KvAwareRouter::new(KvAwareConfig::new(4));
    /// let prompt: Vec<u32> = (0..8).collect();
    /// let salted = CacheKeys { cache_salt: Some("user-1"), ..CacheKeys::default() };
    /// let local = router.hasher().local_hashes_with(&prompt, &salted);
    /// let blocks = local.iter().map(|&h| StoredBlock { engine_hash: h, local_hash: h }).collect();
    /// router.index().apply(WorkerId(1), KvEvent::Stored { parent: None, blocks }).unwrap();
    /// let w = [WorkerId(0), WorkerId(1)];
    /// let s = router.select_and_reserve_with(1, &prompt, &salted, &w, 0).unwrap();
    /// assert_eq!((s.worker, s.overlap_blocks), (WorkerId(1), 2));
    /// // Without the salt the request is another partition: nothing cached.
    /// assert_eq!(router.select_and_reserve(2, &prompt, &w, 0).unwrap().overlap_blocks, 0);
    /// ```
    pub fn select_and_reserve_with(
        &self,
        request_id: u64,
        tokens: &[u32],
        keys: &CacheKeys<'_>,
        allowed_workers: &[WorkerId],
        expected_output_tokens: usize,
    ) -> Result<Selection, SelectError> {
        if tokens.is_empty() {
            return Err(SelectError::EmptyTokens);
        }
        if allowed_workers.is_empty() {
            return Err(SelectError::NoWorkers);
        }
        let now = Instant::now();
        self.maybe_expire(now);
        let req = Request {
            id: request_id,
            tokens,
            keys,
            expected_output_tokens,
            now,
        };
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut s) => self.select_with(&req, allowed_workers, &mut s),
            Err(_) => self.select_with(&req, allowed_workers, &mut Scratch::default()),
        })
    }

    fn select_with(
        &self,
        req: &Request<'_>,
        allowed: &[WorkerId],
        s: &mut Scratch,
    ) -> Result<Selection, SelectError> {
        let (request_id, tokens, now) = (req.id, req.tokens, req.now);
        let bs = self.hasher.block_size();
        self.hasher
            .local_hashes_with_into(tokens, req.keys, &mut s.hashes);
        self.index
            .find_matches_weighted_into(&s.hashes, &self.config.tier_weights, &mut s.scores);
        // Caller-sized numbers: saturate (a booking is clamped to the load word's halves below).
        let prompt_blocks = tokens.len().div_ceil(bs) as u64;
        let output_blocks = req.expected_output_tokens.div_ceil(bs) as u64;
        s.overlap.clear();
        s.overlap.extend(allowed.iter().map(|&w| s.scores.get(w)));
        s.weighted.clear();
        s.weighted.extend(
            allowed
                .iter()
                .map(|&w| s.scores.weighted(w).min(prompt_blocks as f64)),
        );

        // Register unseen workers, then hold the read lock through the choice and booking
        // (so no worker can be removed meanwhile).
        let loads = loop {
            let loads = self.read_loads();
            if allowed.iter().all(|w| loads.contains_key(w)) {
                break loads;
            }
            drop(loads);
            let mut wl = self.loads.write().unwrap_or_else(|p| p.into_inner());
            for &w in allowed {
                wl.entry(w).or_default();
            }
        };
        let w = self.config.overlap_weight;
        loop {
            s.loads.clear();
            s.costs.clear();
            for (i, wid) in allowed.iter().enumerate() {
                let word = loads.get(wid).map_or(0, |c| c.load(Ordering::Acquire));
                let l = unpack(word);
                let new_prefill = prompt_blocks as f64 - s.weighted[i];
                s.loads.push(word);
                s.costs.push(w * new_prefill + l.decode_blocks as f64);
            }
            let i = self.choose(&s.costs);
            let worker = allowed[i];
            let overlap = s.overlap[i];
            let word = s.loads[i];
            let cur = unpack(word);
            // Book within the 32-bit halves (clamped; never reached in practice), recording
            // exactly what was added so the releases are exact. A block cached in a slower
            // tier still costs part of its prefill: round the weighted remainder up. Decode
            // books the request's whole sequence (prompt + expected output), the blocks it
            // keeps active on the worker until it completes.
            let prefill = ((prompt_blocks as f64 - s.weighted[i]).ceil() as u64)
                .min(prompt_blocks)
                .min(LOW - cur.prefill_blocks);
            let decode = prompt_blocks
                .saturating_add(output_blocks)
                .min(LOW - cur.decode_blocks);
            let Some(cell) = loads.get(&worker) else {
                unreachable!("allowed workers are registered while the read lock is held");
            };
            let mut shard = crate::sync::lock(self.shard(request_id));
            if cell
                .compare_exchange(
                    word,
                    word + pack(prefill, decode),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
            {
                shard.stats.retries += 1;
                continue;
            }
            let booking = Booking {
                worker,
                prefill,
                prefill_done: false,
                decode,
                at: now,
            };
            shard.stats.selections += 1;
            if let Some(old) = shard.bookings.insert(request_id, booking) {
                release(&loads, &old);
                shard.stats.replaced += 1;
            }
            return Ok(Selection {
                worker,
                overlap_blocks: overlap,
                weighted_overlap: s.weighted[i],
                cost: s.costs[i],
                prefill_blocks: prefill as usize,
                decode_blocks: decode as usize,
            });
        }
    }

    /// The index of the chosen cost: the minimum (ties rotate) at temperature 0, else a
    /// softmax sample.
    fn choose(&self, costs: &[f64]) -> usize {
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let t = self.config.temperature;
        if t > 0.0 && min.is_finite() {
            let total: f64 = costs.iter().map(|&c| (-(c - min) / t).exp()).sum();
            let mut u = self.rng.unit() * total;
            for (i, &c) in costs.iter().enumerate() {
                let p = (-(c - min) / t).exp();
                if u < p {
                    return i;
                }
                u -= p;
            }
            // Rounding: fall back to the last worker with a positive weight.
            return costs
                .iter()
                .rposition(|&c| (-(c - min) / t).exp() > 0.0)
                .unwrap_or(0);
        }
        let ties = costs.iter().filter(|&&c| c == min).count();
        if ties == 0 {
            // No comparable cost (NaN weights): rotate over all workers.
            return self.rotation.pick(costs.len());
        }
        let k = self.rotation.pick(ties);
        costs
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c == min)
            .nth(k)
            .map_or(0, |(i, _)| i)
    }

    /// Releases the prefill part of `request_id`'s booking (its prompt has been computed).
    /// Returns whether the booking existed with its prefill outstanding (possibly 0 blocks,
    /// for a fully cached prompt); unknown ids and repeated calls are no-ops returning false.
    pub fn prefill_complete(&self, request_id: u64) -> bool {
        let loads = self.read_loads();
        let mut shard = crate::sync::lock(self.shard(request_id));
        let shard = &mut *shard;
        match shard.bookings.get_mut(&request_id) {
            Some(b) if !b.prefill_done => {
                if let Some(cell) = loads.get(&b.worker) {
                    cell.fetch_sub(b.prefill, Ordering::AcqRel);
                }
                b.prefill = 0;
                b.prefill_done = true;
                shard.stats.prefills_completed += 1;
                true
            }
            _ => {
                shard.stats.unknown_ids += 1;
                false
            }
        }
    }

    /// Releases everything still booked for `request_id` (the request finished or was
    /// cancelled). Returns whether it had a booking: unknown ids are no-ops.
    pub fn request_complete(&self, request_id: u64) -> bool {
        let loads = self.read_loads();
        let mut shard = crate::sync::lock(self.shard(request_id));
        match shard.bookings.remove(&request_id) {
            Some(b) => {
                release(&loads, &b);
                shard.stats.requests_completed += 1;
                true
            }
            None => {
                shard.stats.unknown_ids += 1;
                false
            }
        }
    }

    /// Releases every booking made more than
    /// [`reservation_ttl`](KvAwareConfig::reservation_ttl) before `now`; returns how many.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
    /// use kvtrie::WorkerId;
    /// let router = KvAwareRouter::new(KvAwareConfig::new(4));
    /// router.select_and_reserve(1, &[1, 2, 3, 4], &[WorkerId(0)], 0).unwrap();
    /// assert_eq!(router.expire_stale(Instant::now()), 0);
    /// assert_eq!(router.expire_stale(Instant::now() + Duration::from_secs(301)), 1);
    /// assert_eq!(router.stats().expired, 1);
    /// assert_eq!(router.load(WorkerId(0)).decode_blocks, 0);
    /// ```
    pub fn expire_stale(&self, now: Instant) -> usize {
        let ttl = self.config.reservation_ttl;
        let loads = self.read_loads();
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut shard = crate::sync::lock(shard);
            let shard = &mut *shard;
            let before = shard.bookings.len();
            shard.bookings.retain(|_, b| {
                let keep = now.saturating_duration_since(b.at) < ttl;
                if !keep {
                    release(&loads, b);
                }
                keep
            });
            let expired = before - shard.bookings.len();
            shard.stats.expired += expired as u64;
            n += expired;
        }
        n
    }

    /// Runs [`expire_stale`](Self::expire_stale) if a quarter TTL (at least 1 ms) has passed
    /// since the last sweep; one selection wins the sweep, the others skip it.
    fn maybe_expire(&self, at: Instant) {
        let now =
            u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX);
        let next = self.next_sweep.load(Ordering::Relaxed);
        if now < next {
            return;
        }
        let step = (self.config.reservation_ttl / 4).max(Duration::from_millis(1));
        let to = now.saturating_add(u64::try_from(step.as_nanos()).unwrap_or(u64::MAX));
        if self
            .next_sweep
            .compare_exchange(next, to, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
            && next != 0
        {
            self.expire_stale(at);
        }
    }

    /// Forgets a worker: drops its bookings and its load counter (e.g. when it leaves the
    /// pool; also call [`BlockIndex::remove_worker`] on the index). Returns the bookings
    /// dropped. Selecting it again registers it afresh.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        let mut loads = self.loads.write().unwrap_or_else(|p| p.into_inner());
        loads.remove(&worker);
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut shard = crate::sync::lock(shard);
            let before = shard.bookings.len();
            shard.bookings.retain(|_, b| b.worker != worker);
            n += before - shard.bookings.len();
        }
        n
    }

    /// The load booked on `worker` (zero for a worker never selected).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.read_loads()
            .get(&worker)
            .map_or_else(WorkerLoad::default, |c| unpack(c.load(Ordering::Acquire)))
    }

    /// Every known worker's booked load, by ascending worker id.
    pub fn loads(&self) -> Vec<(WorkerId, WorkerLoad)> {
        let mut v: Vec<_> = self
            .read_loads()
            .iter()
            .map(|(&w, c)| (w, unpack(c.load(Ordering::Acquire))))
            .collect();
        v.sort_unstable_by_key(|&(w, _)| w);
        v
    }

    /// The counters, summed over the request-table shards.
    pub fn stats(&self) -> KvAwareStats {
        let mut t = KvAwareStats::default();
        for shard in self.shards.iter() {
            let shard = crate::sync::lock(shard);
            let s = &shard.stats;
            t.selections += s.selections;
            t.active_requests += shard.bookings.len() as u64;
            t.prefills_completed += s.prefills_completed;
            t.requests_completed += s.requests_completed;
            t.expired += s.expired;
            t.replaced += s.replaced;
            t.unknown_ids += s.unknown_ids;
            t.retries += s.retries;
        }
        t
    }

    /// Writes a snapshot of the router's index to `out` ([`BlockIndex::write_snapshot`]:
    /// taken live, while requests are routed and events applied). The bookings are not in
    /// it. A router restarted from it: [`BlockIndex::read_snapshot`], then
    /// [`Self::with_index`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvtrie::blocks::{BlockIndex, KvEvent, StoredBlock, WorkerId};
    /// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
    /// let router = KvAwareRouter::new(KvAwareConfig::new(4));
    /// let blocks = vec![StoredBlock { engine_hash: 1, local_hash: 10 }];
    /// router.index().apply(WorkerId(0), KvEvent::Stored { parent: None, blocks }).unwrap();
    /// let mut bytes = Vec::new();
    /// router.write_snapshot(&mut bytes).unwrap();
    /// let index = Arc::new(BlockIndex::read_snapshot(&bytes[..]).unwrap());
    /// let warm = KvAwareRouter::with_index(index, KvAwareConfig::new(4));
    /// assert_eq!(warm.index().find_matches(&[10]).get(WorkerId(0)), 1);
    /// ```
    pub fn write_snapshot<W: std::io::Write>(
        &self,
        out: W,
    ) -> Result<crate::blocks::BlockSnapshotSummary, crate::snapshot::SnapshotError> {
        self.index.write_snapshot(out)
    }
}
