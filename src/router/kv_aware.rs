//! [`KvAwareRouter`]: NVIDIA Dynamo's KV-overlap cost policy over a [`BlockIndex`], with load
//! booking.

use super::load::{Choice, LoadBook, LoadStats, WorkerLoad};
use super::{ConfigError, Rotation, SharedRng};
use crate::blocks::{BlockHasher, BlockIndex, CacheKeys, OverlapScores, TierWeights, WorkerId};
use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;
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
/// assert_eq!(c.reservation_ttl, Duration::from_secs(3600));
/// // A salted configuration hashes like Dynamo with a LoRA name and namespace.
/// let salted = KvAwareConfig { salt: Some(("my-lora".into(), "ns".into())), ..c };
/// assert_ne!(salted.hasher().seed(), KvAwareConfig::new(32).hasher().seed());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct KvAwareConfig {
    /// Tokens per KV block (must match the engines' and the index's hashing).
    pub block_size: usize,
    /// Weight of prefill work against decode load (Dynamo's `overlap_score_weight`): 1.0; at
    /// most [`MAX_OVERLAP_WEIGHT`].
    pub overlap_weight: f64,
    /// 0.0: the lowest cost wins. Above 0: softmax sampling as Dynamo's `router_temperature`:
    /// worker `i` is drawn with weight `exp(−(cost_i − min) / ((max − min) × temperature))`
    /// over the allowed workers' costs, so the cheapest weighs `e^(1/temperature)` times the
    /// dearest whatever the costs' scale (1.0: about 2.7 times; 0.1: about 22,000 times), and
    /// equal costs are drawn uniformly.
    pub temperature: f64,
    /// Optional hashing salt `(lora_name, namespace)` (see [`BlockHasher::with_salt`]).
    pub salt: Option<(String, String)>,
    /// Seed of the router's random stream (softmax sampling).
    pub seed: u64,
    /// A booking not completed within this time is released (stale reservation; default an
    /// hour, as Dynamo's `EXPIRY_DURATION`).
    pub reservation_ttl: Duration,
    /// How much a cached block is worth in each storage tier (default GPU 1.0, CPU 0.8, disk
    /// 0.5, other 1.0; see [`TierWeights`]): the overlap in the cost is the tier-weighted one.
    pub tier_weights: TierWeights,
}

/// The largest [`KvAwareConfig::overlap_weight`]: with it, a cost stays finite for any number
/// of blocks (below 2^64) a request may have.
pub const MAX_OVERLAP_WEIGHT: f64 = 1e15;

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self::new(16)
    }
}

impl KvAwareConfig {
    /// Defaults with blocks of `block_size` tokens: weight 1.0, temperature 0, no salt,
    /// seed 0, reservations expire after an hour (3,600 s, as in Dynamo: a safety net for
    /// lost completions, set above any real request's life; long agentic requests stay active
    /// for many minutes).
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
            reservation_ttl: Duration::from_secs(3600),
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
        if self.overlap_weight > MAX_OVERLAP_WEIGHT {
            // Above it, `weight × blocks` can overflow to infinity: every cost ties, and the
            // router would silently rotate instead of weighing.
            return Err(ConfigError::InvalidValue {
                field: "overlap_weight",
                reason: "must be at most 1e15 (larger weights make the costs overflow)",
            });
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
    /// The allowed worker set is empty (or every allowed worker was removed with
    /// [`KvAwareRouter::remove_worker`] while the selection ran).
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

/// Counters of a [`KvAwareRouter`] (see [`KvAwareRouter::stats`]): its [`LoadBook`]'s.
///
/// ```
/// use kvtrie::router::{KvAwareConfig, KvAwareRouter};
/// let router = KvAwareRouter::new(KvAwareConfig::default());
/// assert!(!router.request_complete(42));
/// assert_eq!(router.stats().unknown_ids, 1);
/// ```
pub type KvAwareStats = LoadStats;

// ---------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------

/// Per-thread scratch of a selection, so selecting allocates nothing once warm.
#[derive(Default)]
struct Scratch {
    hashes: Vec<u64>,
    /// The prompt's sequence hashes (its blocks as the load book keeps them active).
    seq: Vec<u64>,
    scores: OverlapScores,
    overlap: Vec<usize>,
    weighted: Vec<f64>,
    loads: Vec<WorkerLoad>,
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
/// there: `active(w)` ([`WorkerLoad::decode_blocks`]) counts the blocks the requests booked on
/// `w` by earlier selections keep active until [`request_complete`](Self::request_complete):
/// their prompts' full blocks, each once however many of those requests share it (as Dynamo's
/// active sequences count unique blocks: ten conversations on one system prompt hold its
/// blocks once), and each request's partial last block and
/// `⌈expected_output_tokens / block_size⌉` output blocks. Each booking also records
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
/// `exp(−(cost − min cost) / ((max cost − min cost) × T))` from the router's seeded random
/// stream, as Dynamo samples (costs scaled by their spread).
///
/// The booking is a [`LoadBook`] ([`LoadBook::book_sequence`]); the router adds the cost and
/// the choice. The choice and the booking are one step: the winner's load is booked only if
/// its load word is still the one its cost was computed from, and the choice is redone if it
/// changed meanwhile, so concurrent selections see each other's bookings and do not herd onto
/// one worker. The booking enters the request table (16 mutex-protected shards, each
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
    /// The load booked on each worker and the bookings that make it up.
    book: LoadBook,
    rng: SharedRng,
    rotation: Rotation,
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
    /// If `config` is invalid, or if the index chains hashes with a different seed or hashes
    /// blocks of a different size than `config`'s hasher (its matches would never agree with
    /// the router's hashes);
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
        if index.hasher().block_size() != hasher.block_size() {
            return Err(ConfigError::BlockSizeMismatch {
                index: index.hasher().block_size(),
                config: hasher.block_size(),
            });
        }
        Ok(Self {
            rng: SharedRng::new(config.seed),
            rotation: Rotation::default(),
            index,
            hasher,
            book: LoadBook::new(config.reservation_ttl),
            config,
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
        self.book.maybe_expire(now);
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

        // The full blocks as the book keeps them active: a block that several requests on a
        // worker share counts once there, as in Dynamo's active sequences.
        self.hasher.chain_local_into(&s.hashes, &mut s.seq);
        let beyond = (prompt_blocks - s.seq.len() as u64).saturating_add(output_blocks);
        let w = self.config.overlap_weight;
        let Scratch {
            seq,
            loads,
            costs,
            weighted,
            ..
        } = s;
        let booked = self.book.book_sequence_with(
            request_id,
            allowed,
            now,
            seq,
            loads,
            &mut Vec::new(),
            false,
            |loads, _| {
                costs.clear();
                costs.extend(loads.iter().zip(weighted.iter()).map(|(l, &cached)| {
                    w * (prompt_blocks as f64 - cached) + l.decode_blocks as f64
                }));
                let i = self.choose(costs);
                // A block cached in a slower tier still costs part of its prefill: round the
                // weighted remainder up. Decode keeps the request's whole sequence active on
                // the worker until it completes: its prompt's full blocks (booked by the book,
                // once per worker), a partial last block and the expected output. The book
                // clamps what it adds to the room left in the worker's load word.
                Choice {
                    index: i,
                    prefill_blocks: ((prompt_blocks as f64 - weighted[i]).ceil() as u64)
                        .min(prompt_blocks),
                    decode_blocks: beyond,
                }
            },
        );
        let Some(b) = booked else {
            // `allowed` is not empty and `choose` returns an index into it: every allowed
            // worker was removed while the book chose.
            return Err(SelectError::NoWorkers);
        };
        Ok(Selection {
            worker: b.worker,
            overlap_blocks: s.overlap[b.index],
            weighted_overlap: s.weighted[b.index],
            cost: s.costs[b.index],
            prefill_blocks: b.prefill_blocks as usize,
            decode_blocks: b.decode_blocks as usize,
        })
    }

    /// The index of the chosen cost: the minimum (ties rotate) at temperature 0, else a
    /// softmax sample as Dynamo's (see [`KvAwareConfig::temperature`]).
    fn choose(&self, costs: &[f64]) -> usize {
        let (min, max) = costs
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
                (lo.min(c), hi.max(c))
            });
        let t = self.config.temperature;
        if t > 0.0 && min.is_finite() {
            // The costs scaled to [0, 1] by their spread, then divided by the temperature:
            // the cheapest worker weighs e^(1/T) times the dearest, whatever the costs' size.
            // Equal costs (or a spread that does not scale) weigh the same; a cost that is
            // not a number weighs nothing.
            let spread = max - min;
            let weight = |c: f64| {
                if !c.is_finite() {
                    0.0
                } else if spread > 0.0 && spread.is_finite() {
                    // Scaled before dividing by `t`: `spread * t` can underflow to 0 (a tiny
                    // temperature), which made the cheapest weight 0 / 0.
                    (-((c - min) / spread) / t).exp()
                } else {
                    1.0
                }
            };
            let total: f64 = costs.iter().map(|&c| weight(c)).sum();
            let mut u = self.rng.unit() * total;
            for (i, &c) in costs.iter().enumerate() {
                let p = weight(c);
                if u < p {
                    return i;
                }
                u -= p;
            }
            // Rounding: fall back to the last worker with a positive weight.
            return costs.iter().rposition(|&c| weight(c) > 0.0).unwrap_or(0);
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
        self.book.prefill_complete(request_id)
    }

    /// Releases everything still booked for `request_id` (the request finished or was
    /// cancelled). Returns whether it had a booking: unknown ids are no-ops.
    pub fn request_complete(&self, request_id: u64) -> bool {
        self.book.request_complete(request_id)
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
    /// assert_eq!(router.expire_stale(Instant::now() + Duration::from_secs(3601)), 1);
    /// assert_eq!(router.stats().expired, 1);
    /// assert_eq!(router.load(WorkerId(0)).decode_blocks, 0);
    /// ```
    pub fn expire_stale(&self, now: Instant) -> usize {
        self.book.expire_stale(now)
    }

    /// Forgets a worker: drops its bookings and its load counter (e.g. when it leaves the
    /// pool; also call [`BlockIndex::remove_worker`] on the index). Returns the bookings
    /// dropped. Selecting it again registers it afresh.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        self.book.remove_worker(worker)
    }

    /// Forgets every data-parallel rank of `engine` ([`WorkerId::engine`]): their bookings
    /// and load counters (also call [`BlockIndex::remove_engine`] on the index). Returns the
    /// bookings dropped.
    pub fn remove_engine(&self, engine: u64) -> usize {
        self.book.remove_engine(engine)
    }

    /// The load booked on `worker` (zero for a worker never selected).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.book.load(worker)
    }

    /// Every known worker's booked load, by ascending worker id.
    pub fn loads(&self) -> Vec<(WorkerId, WorkerLoad)> {
        self.book.loads()
    }

    /// The counters, summed over the request-table shards.
    pub fn stats(&self) -> KvAwareStats {
        self.book.stats()
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
