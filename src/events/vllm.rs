//! Decoder for vLLM's KV-cache event batches (msgpack), feature `vllm`.
//!
//! vLLM publishes `KVEventBatch`es (`vllm/distributed/kv_events.py`) as msgpack. Over its
//! releases the same batch has been encoded in several shapes; [`decode_batch`] accepts all of
//! them, even mixed within one batch:
//!
//! * the batch: an array `[ts, events, data_parallel_rank]` or a map
//!   `{ts, events, data_parallel_rank}`;
//! * each event: a map tagged by its `"type"` key, or an array whose first element is the tag,
//!   followed by the fields in declaration order (`BlockStored`: `block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
//!   group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window`; `BlockRemoved`:
//!   `block_hashes, medium, group_idx`; `AllBlocksCleared`: nothing);
//! * SGLang's additions to that layout (`disaggregation/kv_events.py`): a salted
//!   `BlockStored` carries a `metadata` map `{cache_salt, ...}` where vLLM has `lora_name`
//!   (`BlockStoredWithMetadata`), map-encoded events a top-level `cache_salt`; a token id may
//!   be a bigram `[t, next]` (EAGLE speculative decoding), read as `t`;
//! * unknown map keys and extra trailing array elements are ignored; missing trailing optional
//!   fields (older releases) are tolerated; `data_parallel_rank` may be absent or `nil`;
//! * a block hash is an unsigned int, a negative int (old builds; its bits are reinterpreted as
//!   `u64`), or `bin` bytes (the last 8 bytes, big-endian, left-padded with zeros).
//!
//! # Mapping to [`KvEvent`]
//!
//! * `BlockStored` → [`KvEvent::Stored`] with `parent = parent_block_hash`; the router-side
//!   local hashes are computed from `token_ids` with the router's
//!   [`BlockHasher`] (salted with the event's `lora_name` and the configured namespace).
//! * `BlockRemoved` → [`KvEvent::Removed`].
//! * `AllBlocksCleared` → [`KvEvent::Cleared`].
//! * **Attention kinds.** Only KV-cache groups whose `kv_cache_spec_kind` is in
//!   [`DecodeConfig::attention_kinds`] are indexed — by default the full-attention kinds
//!   [`DEFAULT_ATTENTION_KINDS`] (`full_attention`, `mla_attention` as in DeepSeek models,
//!   `sink_full_attention`), the kinds whose blocks hold a whole reusable prefix, as NVIDIA
//!   Dynamo indexes. Events of any other kind (`sliding_window` and `sliding_window_mla` in
//!   hybrid models, `chunked_local_attention`, `mamba`, `cross_attention`,
//!   `encoder_only_attention`, `unknown`, anything newer) are dropped and counted in
//!   [`DecodedBatch::skipped_groups`]. An event without a kind (older releases) is indexed. A
//!   `BlockRemoved` carries no kind, only `group_idx`; it is dropped when an earlier
//!   `BlockStored` (in this batch for [`decode_batch`], in any earlier batch for a
//!   [`Decoder`]) showed that group to be of a skipped kind. Otherwise it is kept (removing a
//!   hash the index does not hold is harmless).
//! * **Storage tiers.** Each event's `medium` is kept in [`DecodedEvent::medium`]; apply it with
//!   `BlockIndex::apply_in(worker, event.tier(), event.event)`.
//! * **Locality.** vLLM ≥ 0.26 may say where a tier's copy is: `locality` `"LOCAL"` (storage
//!   of the publishing instance) or `"REMOTE"` (a shared or remote pool). An event (a
//!   `BlockStored`, a `BlockRemoved`, or any other carrying the key) whose `locality` is given
//!   and is not `"LOCAL"` (any case) is dropped and counted in
//!   [`DecodedBatch::skipped_remote`], as Dynamo drops it: the copy is not this worker's, and
//!   crediting the worker with it would route requests to it for blocks it does not hold.
//!   Events without `locality` are indexed. The key is read from map-encoded events only
//!   (vLLM encodes its events as maps; positions after the fields above are ignored). An
//!   event whose `medium` names a shared pool (`EXTERNAL`, SGLang's "L4: shared / remote
//!   pool"; `REMOTE`; `SHARED`; any case) is skipped and counted the same way.
//! * **Cache partitions.** `lora_name` (or, from older releases, `lora_id` alone) salts the
//!   local hashes' seed; each block's `extra_keys` tuple, less its leading LoRA name, is hashed
//!   after the block's tokens ([`crate::blocks::CacheKeys`] computes the same hashes for a
//!   request). SGLang's `cache_salt` is hashed as a key of the first block of a sequence (a
//!   store without `parent_block_hash`), where vLLM puts its salt. With an engine block of k
//!   router blocks, the first sub-block gets the keys that are not multimodal (the salt), and
//!   a multimodal key `(identifier, offset)` goes to every sub-block from the one where the
//!   item starts, with its offset from that sub-block's start: the item's length is not
//!   published, so one that ends inside an engine block is also given to its later
//!   sub-blocks, whose hashes then differ from the request's; since sequence hashes chain,
//!   a request then matches such a sequence only up to the end of that item.
//! * SGLang's opt-in component-typed events (`--enable-kv-events-component-types`:
//!   `BlockStoredWithComponentType`, `BlockRemovedWithComponentType`) are not read as such:
//!   their wire layout was not available to check against.
//! * Events with an unknown tag (a newer vLLM) are dropped and counted in
//!   [`DecodedBatch::skipped_unknown`] instead of failing the batch.
//! * **Stores without tokens.** Two well-formed kinds of `BlockStored` do not say which tokens
//!   each hash holds; they are dropped and counted in [`DecodedBatch::skipped_groups`] instead
//!   of failing the batch: placeholders with no `token_ids` (vLLM's offloading connector
//!   publishes its CPU-tier stores with `token_ids = []` and `block_size` 0 or the block
//!   size; vllm-ascend's pool connector `token_ids = None`), and stores whose `token_ids`
//!   span more whole engine blocks than there are hashes (a sliding-window or Mamba group
//!   skips its null blocks in `block_hashes` but not in `token_ids`). Only the store is
//!   skipped: a group that names no `kv_cache_spec_kind` stays indexed (its dense stores are
//!   copies of the blocks, and its removals take them away; every group publishes the same
//!   block hashes), so a removal of a block whose store was skipped can take another group's
//!   copy of it: the index then under-reports that block until it is stored again, where
//!   marking the group would have kept the copies of its earlier stores forever.
//!
//! # Engine blocks larger than router blocks
//!
//! When the engine's `block_size` E equals the router's block size R, every engine block
//! becomes one [`StoredBlock`]. When E = k·R (k > 1), each engine block with hash `h` is split
//! into k router blocks, in token order:
//!
//! * sub-blocks `0..k-1` get synthetic engine hashes [`sub_block_hash`]`(h, i)`
//!   (`xxh3_64_with_seed(le_u64(h) || le_u64(i), SUB_BLOCK_SEED)`);
//! * the **last** sub-block carries the real engine hash `h`, so a later `parent_block_hash`
//!   of `h` chains from the end of the engine block and a later removal of `h` resolves.
//!
//! A removal of `h` is expanded to `h` followed by the synthetic hashes `k-2, …, 0` (deepest
//! first). `BlockRemoved` carries no block size, so k is taken from the largest block size of
//! the full-attention `BlockStored`s seen (within the batch for [`decode_batch`], across
//! batches for a [`Decoder`]; a newer vLLM also stores partial entries of a smaller size, and
//! a removal expanded past what a block had only counts the missing sub-blocks as unknown
//! removes), else from [`DecodeConfig::with_engine_block_size`], else k = 1. Feeding removals
//! of split blocks through [`decode_batch`] without either source under-removes (the synthetic
//! sub-blocks stay indexed); long-lived subscribers should use a [`Decoder`] and set the engine
//! block size when it is known.
//!
//! A `BlockStored` whose engine block size is not a multiple of the router's, or splits into
//! more than [`MAX_SUB_BLOCKS`] router blocks, is skipped and counted
//! ([`DecodedBatch::skipped_block_sizes`]), as NVIDIA Dynamo skips it; the rest of the batch
//! applies. Engines send such stores next to ones the router can split: a hybrid
//! (attention + Mamba) model enlarges its attention blocks (528, 1,056, 2,048 tokens, ...)
//! and, with partial prefix caching, also stores partial entries of its hash block size. A
//! router set to a block size the engine never uses sees every store counted there.
//!
//! # Malformed events
//!
//! An event that is well-formed msgpack but malformed in its values — `token_ids` whose length
//! is not `blocks × block_size` (other than the stores without tokens above,
//! [`DecodeErrorKind::TokenCountMismatch`]), a token id past 32 bits, a block hash that is not
//! an integer or bytes, a missing required field — is dropped alone and counted in
//! [`DecodedBatch::skipped_malformed`], with the first one's reason in
//! [`DecodedBatch::malformed`]; the batch's other events are kept. Connectors publish into the
//! engine's batches (LMCache has put 64-bit hashes in `token_ids`), and an error for the whole
//! batch would lose the engine's own events with it, and every later store chained from the
//! lost ones. Malformed msgpack (a truncated payload, an event that is not a whole value) and
//! a malformed batch (no `ts` or `events`, trailing bytes) are errors ([`DecodeError`]).

use std::fmt;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::msgpack::{self, Kind, Reader, Token, Value};
use crate::blocks::hash::{hash_block_keyed, keys, lora_seed};
use crate::blocks::{BlockHasher, KvEvent, StoredBlock, Tier};

/// The KV-cache kinds indexed by default: the full-attention kinds (whose blocks hold a whole
/// reusable prefix), as NVIDIA Dynamo indexes them.
pub const DEFAULT_ATTENTION_KINDS: [&str; 3] =
    ["full_attention", "mla_attention", "sink_full_attention"];

/// Most router blocks one engine block may split into. Stores of larger ratios are skipped
/// ([`DecodedBatch::skipped_block_sizes`]): a `BlockRemoved` expands every hash into that many,
/// so the cap bounds how much output a small hostile payload can produce.
pub const MAX_SUB_BLOCKS: usize = 64;

/// Seed of [`sub_block_hash`] (ASCII `"kvtrieSB"`).
pub const SUB_BLOCK_SEED: u64 = 0x6b76_7472_6965_5342;

/// The synthetic engine hash of router sub-block `index` of the engine block `engine_hash`
/// (see the [module docs](self)): `xxh3_64_with_seed(le_u64(engine_hash) || le_u64(index),
/// SUB_BLOCK_SEED)`. The last sub-block of an engine block uses `engine_hash` itself instead.
pub fn sub_block_hash(engine_hash: u64, index: usize) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&engine_hash.to_le_bytes());
    buf[8..].copy_from_slice(&(index as u64).to_le_bytes());
    xxh3_64_with_seed(&buf, SUB_BLOCK_SEED)
}

/// The router-side settings the decoder needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeConfig {
    block_size: usize,
    namespace: String,
    engine_block_size: Option<usize>,
    attention_kinds: Vec<String>,
}

impl DecodeConfig {
    /// Decode for a router whose [`BlockHasher`] uses `block_size` tokens per block (no
    /// namespace salt, engine block size learned from the events).
    pub fn new(block_size: usize) -> Self {
        DecodeConfig {
            block_size,
            namespace: String::new(),
            engine_block_size: None,
            attention_kinds: DEFAULT_ATTENTION_KINDS.map(String::from).to_vec(),
        }
    }

    /// Index only the KV-cache groups of these `kv_cache_spec_kind`s (default
    /// [`DEFAULT_ATTENTION_KINDS`]); events of other kinds are skipped and counted.
    ///
    /// ```
    /// use kvtrie::events::vllm::DecodeConfig;
    /// let c = DecodeConfig::new(16).with_attention_kinds(["full_attention"]);
    /// assert_eq!(c.attention_kinds(), ["full_attention"]);
    /// ```
    pub fn with_attention_kinds<I, S>(mut self, kinds: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.attention_kinds = kinds.into_iter().map(Into::into).collect();
        self
    }

    /// The indexed KV-cache kinds.
    pub fn attention_kinds(&self) -> &[String] {
        &self.attention_kinds
    }

    /// Salt local hashes with this namespace (`BlockHasher::with_salt(lora_name, namespace)`;
    /// empty = no namespace).
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// The engine's block size, when known from its configuration: used to expand
    /// `BlockRemoved` events before any `BlockStored` has revealed it.
    pub fn with_engine_block_size(mut self, engine_block_size: usize) -> Self {
        self.engine_block_size = Some(engine_block_size);
        self
    }

    /// Router block size (tokens per block).
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Namespace salt (empty = none).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Configured engine block size, if any.
    pub fn engine_block_size(&self) -> Option<usize> {
        self.engine_block_size
    }

    fn validate(&self) -> Result<(), DecodeError> {
        let reason = if self.block_size == 0 {
            "router block size is 0"
        } else if self.engine_block_size == Some(0) {
            "engine block size is 0"
        } else if self
            .engine_block_size
            .is_some_and(|e| e % self.block_size != 0)
        {
            "engine block size is not a multiple of the router block size"
        } else if self
            .engine_block_size
            .is_some_and(|e| e / self.block_size > MAX_SUB_BLOCKS)
        {
            "engine block size is more than MAX_SUB_BLOCKS router blocks"
        } else {
            return Ok(());
        };
        Err(DecodeError {
            event: None,
            kind: DecodeErrorKind::InvalidConfig { reason },
        })
    }
}

/// One decoded event with the metadata the router may want besides the [`KvEvent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedEvent {
    /// The event, in router blocks.
    pub event: KvEvent,
    /// Cache tier the event refers to (`"GPU"`, `"CPU"`, ...), when the engine says.
    pub medium: Option<String>,
    /// KV-cache group index, when the engine says.
    pub group_idx: Option<u64>,
}

impl DecodedEvent {
    /// The storage tier the event refers to ([`Tier::from_medium`] of [`Self::medium`]; no
    /// medium is the GPU).
    pub fn tier(&self) -> Tier {
        Tier::from_medium(self.medium.as_deref())
    }
}

/// One decoded `KVEventBatch`.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedBatch {
    /// Publisher timestamp (seconds since the epoch, as a float).
    pub ts: f64,
    /// Data-parallel rank of the publishing engine, if present and not `nil`.
    pub data_parallel_rank: Option<u32>,
    /// The kept events, in order.
    pub events: Vec<DecodedEvent>,
    /// Events dropped because their KV-cache group is not of an indexed kind
    /// ([`DecodeConfig::attention_kinds`]), and `BlockStored` events without the tokens of
    /// their blocks (see the [module docs](self)).
    pub skipped_groups: usize,
    /// Events dropped because their tag is unknown (e.g. from a newer vLLM).
    pub skipped_unknown: usize,
    /// `BlockStored` events dropped because their `block_size` does not split into this
    /// router's blocks: not a multiple of [`DecodeConfig::block_size`], or more than
    /// [`MAX_SUB_BLOCKS`] of them (see the [module docs](self)).
    pub skipped_block_sizes: usize,
    /// Events (`BlockStored`, `BlockRemoved`, or any other carrying the key) dropped because
    /// their `locality` says the copy is not in storage local to the publisher (`"REMOTE"`, or
    /// a value not known to mean local), or their `medium` names a shared pool (`EXTERNAL`,
    /// `REMOTE`, `SHARED`): not this worker's cache (as Dynamo drops remote copies).
    pub skipped_remote: usize,
    /// Events dropped because they are malformed in their values while well-formed msgpack: a
    /// token id that does not fit 32 bits (LMCache has published 64-bit hashes there), a
    /// `token_ids` length that is not `blocks × block_size`, a missing `block_hashes`, ... The
    /// rest of the batch is kept: the engine's other events in it are as valid as ever, and
    /// an error for the whole batch lost them all (and, since later stores chain from the
    /// lost ones, their sequences too).
    pub skipped_malformed: usize,
    /// Why the first of the [`skipped_malformed`](Self::skipped_malformed) events was dropped.
    pub malformed: Option<DecodeError>,
}

/// Why a batch could not be decoded, or (in [`DecodedBatch::malformed`]) why one of its
/// events was dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError {
    /// Index of the event (in the batch's `events` list) the error is in, if any.
    pub event: Option<usize>,
    /// What went wrong.
    pub kind: DecodeErrorKind,
}

/// The reason of a [`DecodeError`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeErrorKind {
    /// Malformed msgpack, or a value of the wrong msgpack type, while reading `field`.
    Msgpack {
        /// The field being read (`"batch"`, `"event"`, `"token_ids"`, ...).
        field: &'static str,
        /// The low-level error.
        error: msgpack::Error,
    },
    /// A required field is absent (or `nil`).
    MissingField {
        /// The field.
        field: &'static str,
    },
    /// A batch-level field appears twice in a map-encoded batch.
    DuplicateField {
        /// The field.
        field: &'static str,
    },
    /// A field has a well-formed but unacceptable value.
    InvalidValue {
        /// The field.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// `token_ids.len() != block_hashes.len() × block_size`.
    TokenCountMismatch {
        /// Number of token ids.
        tokens: usize,
        /// Number of block hashes.
        blocks: usize,
        /// The event's `block_size`.
        block_size: u64,
    },
    /// Bytes after the end of the batch.
    TrailingBytes {
        /// Offset of the first extra byte.
        offset: usize,
    },
    /// The [`DecodeConfig`] is unusable.
    InvalidConfig {
        /// Why.
        reason: &'static str,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("vLLM KV event batch: ")?;
        if let Some(i) = self.event {
            write!(f, "event {i}: ")?;
        }
        match &self.kind {
            DecodeErrorKind::Msgpack { field, error } => write!(f, "reading `{field}`: {error}"),
            DecodeErrorKind::MissingField { field } => write!(f, "missing field `{field}`"),
            DecodeErrorKind::DuplicateField { field } => write!(f, "duplicate field `{field}`"),
            DecodeErrorKind::InvalidValue { field, reason } => {
                write!(f, "invalid `{field}`: {reason}")
            }
            DecodeErrorKind::TokenCountMismatch {
                tokens,
                blocks,
                block_size,
            } => write!(
                f,
                "{tokens} token ids for {blocks} blocks of {block_size} tokens"
            ),
            DecodeErrorKind::TrailingBytes { offset } => {
                write!(f, "trailing bytes after the batch, from byte {offset}")
            }
            DecodeErrorKind::InvalidConfig { reason } => write!(f, "invalid config: {reason}"),
        }
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            DecodeErrorKind::Msgpack { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// Decode one vLLM `KVEventBatch` payload (the last ZMQ frame) statelessly.
///
/// Equivalent to a fresh [`Decoder`] per call: what is learned from `BlockStored` events
/// (engine block size, which groups are not full attention) only applies within this batch.
///
/// ```
/// use kvtrie::blocks::{BlockHasher, KvEvent};
/// use kvtrie::events::vllm::{decode_batch, DecodeConfig};
///
/// let payload = include_bytes!(concat!(
///     env!("CARGO_MANIFEST_DIR"),
///     "/tests/data/vllm/batch_map_events.msgpack"
/// ));
/// let batch = decode_batch(payload, &DecodeConfig::new(4)).unwrap();
/// assert_eq!(batch.ts, 1_700_000_000.5);
/// assert_eq!(batch.data_parallel_rank, Some(0));
/// assert_eq!(batch.events.len(), 3);
///
/// let local = BlockHasher::new(4).local_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]);
/// match &batch.events[0].event {
///     KvEvent::Stored { parent, blocks } => {
///         assert_eq!(*parent, None);
///         assert_eq!(blocks[1].engine_hash, 17_270_480_062_156_288_726);
///         assert_eq!(blocks[1].local_hash, local[1]);
///     }
///     other => panic!("unexpected {other:?}"),
/// }
/// assert_eq!(batch.events[0].medium.as_deref(), Some("GPU"));
/// assert_eq!(
///     batch.events[1].event,
///     KvEvent::Removed { engine_hashes: vec![17_270_480_062_156_288_726] }
/// );
/// assert_eq!(batch.events[2].event, KvEvent::Cleared);
///
/// // malformed input is an error, never a panic
/// assert!(decode_batch(&payload[..40], &DecodeConfig::new(4)).is_err());
/// ```
pub fn decode_batch(payload: &[u8], cfg: &DecodeConfig) -> Result<DecodedBatch, DecodeError> {
    Decoder::new(cfg.clone())?.decode(payload)
}

/// Most KV-cache groups a [`Decoder`] remembers.
const MAX_LEARNED_GROUPS: usize = 64;

/// Per-publisher state learned from `BlockStored` events.
#[derive(Clone, Debug, Default)]
struct Learned {
    /// Block size of the last full-attention `BlockStored`.
    engine_block_size: Option<usize>,
    /// `(group_idx, is_full_attention)` as revealed by `BlockStored` events.
    groups: Vec<(u64, bool)>,
}

impl Learned {
    fn group_is_full(&self, group: u64) -> Option<bool> {
        self.groups
            .iter()
            .find(|(g, _)| *g == group)
            .map(|&(_, full)| full)
    }

    fn learn_group(&mut self, group: u64, full: bool) {
        if let Some(entry) = self.groups.iter_mut().find(|(g, _)| *g == group) {
            entry.1 = full;
        } else if self.groups.len() < MAX_LEARNED_GROUPS {
            // a hostile stream could announce many groups; a handful is all vLLM uses
            self.groups.push((group, full));
        }
    }
}

/// A stateful decoder for one publisher (one engine / data-parallel rank).
///
/// Unlike [`decode_batch`] it remembers, across batches, the engine block size and which
/// KV-cache groups are not full attention, so `BlockRemoved` events in later batches are
/// expanded and filtered correctly. State is only updated by batches that decode successfully,
/// and not by the malformed events they drop.
pub struct Decoder {
    cfg: DecodeConfig,
    base: BlockHasher,
    learned: Learned,
}

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder")
            .field("cfg", &self.cfg)
            .field("learned", &self.learned)
            .finish_non_exhaustive()
    }
}

impl Decoder {
    /// A decoder with the given settings; fails if the config is unusable (router block size
    /// 0, or an engine block size that is 0, not a multiple of it, or more than
    /// [`MAX_SUB_BLOCKS`] router blocks).
    pub fn new(cfg: DecodeConfig) -> Result<Self, DecodeError> {
        cfg.validate()?;
        let base = if cfg.namespace.is_empty() {
            BlockHasher::new(cfg.block_size)
        } else {
            BlockHasher::new(cfg.block_size).with_salt("", &cfg.namespace)
        };
        Ok(Decoder {
            cfg,
            base,
            learned: Learned::default(),
        })
    }

    /// The settings this decoder was built with.
    pub fn config(&self) -> &DecodeConfig {
        &self.cfg
    }

    /// Decode one batch payload (see [`decode_batch`] and the module docs).
    pub fn decode(&mut self, payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
        let mut learned = self.learned.clone();
        let batch = self.decode_inner(payload, &mut learned)?;
        self.learned = learned;
        Ok(batch)
    }

    fn decode_inner(
        &self,
        payload: &[u8],
        learned: &mut Learned,
    ) -> Result<DecodedBatch, DecodeError> {
        let top = |kind| DecodeError { event: None, kind };
        let mut r = Reader::new(payload);
        let mut ts = None;
        let mut dp_rank = None;
        let mut out: Option<EventsOut> = None;
        match ctx("batch", r.next_token()).map_err(top)? {
            Token::Array(n) => {
                for i in 0..n {
                    match i {
                        0 => ts = Some(read_ts(&mut r).map_err(top)?),
                        1 => out = Some(self.read_events(&mut r, learned)?),
                        2 => dp_rank = read_dp_rank(&mut r).map_err(top)?,
                        _ => ctx("batch", r.skip_value()).map_err(top)?,
                    }
                }
            }
            Token::Map(n) => {
                for _ in 0..n {
                    match read_key(&mut r).map_err(top)? {
                        Some("ts") => {
                            if ts.is_some() {
                                return Err(top(DecodeErrorKind::DuplicateField { field: "ts" }));
                            }
                            ts = Some(read_ts(&mut r).map_err(top)?);
                        }
                        Some("events") => {
                            if out.is_some() {
                                return Err(top(DecodeErrorKind::DuplicateField {
                                    field: "events",
                                }));
                            }
                            out = Some(self.read_events(&mut r, learned)?);
                        }
                        Some("data_parallel_rank") => {
                            dp_rank = read_dp_rank(&mut r).map_err(top)?;
                        }
                        _ => ctx("batch", r.skip_value()).map_err(top)?,
                    }
                }
            }
            t => {
                return Err(top(DecodeErrorKind::Msgpack {
                    field: "batch",
                    error: msgpack::Error::TypeMismatch {
                        offset: 0,
                        expected: "array or map",
                        found: t.kind(),
                    },
                }))
            }
        }
        if !r.is_empty() {
            return Err(top(DecodeErrorKind::TrailingBytes {
                offset: r.position(),
            }));
        }
        let ts = ts.ok_or(top(DecodeErrorKind::MissingField { field: "ts" }))?;
        let out = out.ok_or(top(DecodeErrorKind::MissingField { field: "events" }))?;
        Ok(DecodedBatch {
            ts,
            data_parallel_rank: dp_rank,
            events: out.events,
            skipped_groups: out.skipped_groups,
            skipped_unknown: out.skipped_unknown,
            skipped_block_sizes: out.skipped_block_sizes,
            skipped_remote: out.skipped_remote,
            skipped_malformed: out.skipped_malformed,
            malformed: out.malformed,
        })
    }

    fn read_events(
        &self,
        r: &mut Reader<'_>,
        learned: &mut Learned,
    ) -> Result<EventsOut, DecodeError> {
        let n =
            ctx("events", r.read_array_len()).map_err(|kind| DecodeError { event: None, kind })?;
        let mut out = EventsOut {
            events: Vec::with_capacity(r.capacity_hint(n, 2)),
            skipped_groups: 0,
            skipped_unknown: 0,
            skipped_block_sizes: 0,
            skipped_remote: 0,
            skipped_malformed: 0,
            malformed: None,
        };
        for i in 0..n {
            let index = usize::try_from(i).unwrap_or(usize::MAX);
            let start = r.clone();
            if let Err(kind) = self.read_event(r, learned, &mut out) {
                let error = DecodeError {
                    event: Some(index),
                    kind,
                };
                // An event that is whole msgpack is dropped alone (an event adds to `out`, and
                // teaches `learned` what its group is, only once it is read without error);
                // one that is not ends the batch, whose later events cannot be found.
                *r = start;
                if r.skip_value().is_err() {
                    return Err(error);
                }
                out.skipped_malformed += 1;
                out.malformed.get_or_insert(error);
            }
        }
        Ok(out)
    }

    fn read_event(
        &self,
        r: &mut Reader<'_>,
        learned: &mut Learned,
        out: &mut EventsOut,
    ) -> Result<(), DecodeErrorKind> {
        let raw = match RawEvent::read(r)? {
            Some(raw) => raw,
            None => {
                out.skipped_unknown += 1;
                return Ok(());
            }
        };
        // Is this event's KV-cache group full attention? A store naming a skipped kind teaches
        // it at once (its body is not read); one naming an indexed kind once it is read without
        // error (`full_group`), so that a dropped malformed event teaches nothing.
        let mut full_group = None;
        let full = match (raw.f.spec_kind, raw.f.group_idx) {
            (Some(kind), group) => {
                let full = self.cfg.attention_kinds.iter().any(|k| k == kind);
                if let (Tag::Stored, Some(g)) = (raw.tag, group) {
                    if full {
                        full_group = Some(g);
                    } else {
                        learned.learn_group(g, false);
                    }
                }
                full
            }
            (None, Some(g)) => learned.group_is_full(g).unwrap_or(true),
            (None, None) => true,
        };
        if !full {
            out.skipped_groups += 1;
            return Ok(());
        }
        let kept = self.read_kept(raw, learned, out);
        if let (Ok(()), Some(g)) = (&kept, full_group) {
            learned.learn_group(g, true);
        }
        kept
    }

    /// The rest of [`Self::read_event`] for an event of an indexed group.
    fn read_kept(
        &self,
        raw: RawEvent<'_>,
        learned: &mut Learned,
        out: &mut EventsOut,
    ) -> Result<(), DecodeErrorKind> {
        if raw.f.not_local || raw.f.medium.is_some_and(is_shared_pool) {
            // A copy in storage that is not the publisher's own (a shared or remote pool):
            // crediting this worker with it would route to it for blocks it does not hold.
            out.skipped_remote += 1;
            return Ok(());
        }
        let event = match raw.tag {
            Tag::Cleared => KvEvent::Cleared,
            Tag::Removed => {
                let hashes = raw.f.block_hashes.ok_or(DecodeErrorKind::MissingField {
                    field: "block_hashes",
                })?;
                let k = learned
                    .engine_block_size
                    .or(self.cfg.engine_block_size)
                    .map_or(1, |e| e / self.cfg.block_size)
                    .clamp(1, MAX_SUB_BLOCKS);
                let mut engine_hashes = Vec::with_capacity(hashes.len().saturating_mul(k));
                for h in hashes {
                    engine_hashes.push(h);
                    engine_hashes.extend((0..k - 1).rev().map(|i| sub_block_hash(h, i)));
                }
                KvEvent::Removed { engine_hashes }
            }
            Tag::Stored => {
                let hashes = raw.f.block_hashes.ok_or(DecodeErrorKind::MissingField {
                    field: "block_hashes",
                })?;
                // No `token_ids` (absent or nil: vllm-ascend's pool connector) is no tokens.
                let tokens = raw.f.token_ids.unwrap_or_default();
                if unindexable_store(&hashes, &tokens, raw.f.block_size.unwrap_or(0)) {
                    // Well-formed, but without the tokens of its blocks: skipped, not an error
                    // (the rest of the batch still applies). The group is not marked as sparse:
                    // its earlier, dense stores were indexed as copies, and only its removals
                    // take those copies away again.
                    out.skipped_groups += 1;
                    return Ok(());
                }
                let engine_bs = raw.f.block_size.ok_or(DecodeErrorKind::MissingField {
                    field: "block_size",
                })?;
                // Malformed whatever the router's block size: an error (checked before the
                // block-size skip below, so that the router's block size decides nothing here).
                let engine_block = usize::try_from(engine_bs).ok();
                let whole = engine_block.and_then(|e| hashes.len().checked_mul(e));
                if whole != Some(tokens.len()) {
                    return Err(DecodeErrorKind::TokenCountMismatch {
                        tokens: tokens.len(),
                        blocks: hashes.len(),
                        block_size: engine_bs,
                    });
                }
                // All-nil keys (whatever their count) are no keys.
                let extra_keys = raw
                    .f
                    .extra_keys
                    .as_ref()
                    .filter(|per_block| per_block.iter().any(Option::is_some));
                if extra_keys.is_some_and(|per_block| per_block.len() != hashes.len()) {
                    return Err(DecodeErrorKind::InvalidValue {
                        field: "extra_keys",
                        reason: "not one entry per block",
                    });
                }
                let router_bs = self.cfg.block_size;
                // The engine block in router blocks, if it splits into at most MAX_SUB_BLOCKS.
                let split = engine_block
                    .filter(|&e| e > 0 && e % router_bs == 0 && e / router_bs <= MAX_SUB_BLOCKS);
                let Some(e) = split else {
                    // Well-formed, but not in this router's blocks: skipped, as Dynamo skips
                    // it; the rest of the batch still applies (see the module docs).
                    out.skipped_block_sizes += 1;
                    return Ok(());
                };
                let k = e / router_bs;
                let lora_name = raw.f.lora_name.filter(|n| !n.is_empty());
                let seed = lora_seed(self.base.seed(), lora_name, raw.f.lora_id);
                // SGLang's request salt goes into the first block of a sequence only (as
                // vLLM's `cache_salt` in its `extra_keys`); later blocks inherit it by chaining.
                let salt = raw
                    .f
                    .cache_salt
                    .filter(|s| !s.is_empty() && raw.f.parent.is_none());
                let local: Vec<u64> = if extra_keys.is_none() && salt.is_none() {
                    tokens
                        .chunks_exact(router_bs)
                        .map(|b| hash_block_keyed(b, &[], seed))
                        .collect()
                } else {
                    let mut out = Vec::with_capacity(hashes.len() * k);
                    let mut extra = Vec::new();
                    for (i, engine_block) in tokens.chunks_exact(e).enumerate() {
                        let keys = extra_keys.and_then(|per_block| per_block[i].as_deref());
                        for (j, block) in engine_block.chunks_exact(router_bs).enumerate() {
                            extra.clear();
                            if let Some(keys) = keys {
                                let sub = (k > 1).then_some((j, router_bs));
                                encode_extra_keys(keys, lora_name, raw.f.lora_id, sub, &mut extra);
                            }
                            if let (0, 0, Some(s)) = (i, j, salt) {
                                // Unless the block's own keys (less the LoRA name, besides
                                // the images) already carry it.
                                let listed = keys.is_some_and(|keys| {
                                    without_lora(keys, lora_name, raw.f.lora_id)
                                        .iter()
                                        .any(|v| mm_key(v).is_none() && v.as_str() == Some(s))
                                });
                                if !listed {
                                    keys::str(&mut extra, s.as_bytes());
                                }
                            }
                            out.push(hash_block_keyed(block, &extra, seed));
                        }
                    }
                    out
                };
                debug_assert_eq!(local.len(), hashes.len() * k);
                let mut blocks = Vec::with_capacity(local.len());
                for (&h, sub) in hashes.iter().zip(local.chunks(k)) {
                    for (i, &local_hash) in sub.iter().enumerate() {
                        let engine_hash = if i + 1 == k { h } else { sub_block_hash(h, i) };
                        blocks.push(StoredBlock {
                            engine_hash,
                            local_hash,
                        });
                    }
                }
                // The largest engine block size seen: stores of smaller (partial-entry) blocks
                // must not shrink the expansion of later removals of full blocks (removing a
                // sub-block that was never stored is a counted no-op).
                learned.engine_block_size = Some(learned.engine_block_size.map_or(e, |k| k.max(e)));
                KvEvent::Stored {
                    parent: raw.f.parent,
                    blocks,
                }
            }
        };
        out.events.push(DecodedEvent {
            event,
            medium: raw.f.medium.map(str::to_owned),
            group_idx: raw.f.group_idx,
        });
        Ok(())
    }
}

/// Is a well-formed `BlockStored` without the tokens of its blocks? Either it has no token ids
/// at all (vLLM's offloading connector publishes its CPU-tier stores with `token_ids = []` and
/// `block_size` 0 or the block size), or its `token_ids` span more whole engine blocks than it
/// has hashes (the group skipped its null blocks: sliding window, Mamba in align mode), so
/// which hash goes with which tokens is unknown.
fn unindexable_store(hashes: &[u64], tokens: &[u32], block_size: u64) -> bool {
    if tokens.is_empty() {
        return !hashes.is_empty();
    }
    usize::try_from(block_size)
        .ok()
        .filter(|&e| e > 0)
        .is_some_and(|e| tokens.len().is_multiple_of(e) && tokens.len() / e > hashes.len())
}

struct EventsOut {
    events: Vec<DecodedEvent>,
    skipped_groups: usize,
    skipped_unknown: usize,
    skipped_block_sizes: usize,
    skipped_remote: usize,
    skipped_malformed: usize,
    malformed: Option<DecodeError>,
}

/// Attach the field name to a low-level error.
fn ctx<T>(field: &'static str, r: Result<T, msgpack::Error>) -> Result<T, DecodeErrorKind> {
    r.map_err(|error| DecodeErrorKind::Msgpack { field, error })
}

/// The canonical bytes of one block's extra-keys tuple, less a leading LoRA name (or id)
/// that the seed already carries.
///
/// `sub`: `Some((j, router_block))` for router sub-block `j` of a larger engine block. A
/// multimodal key `(identifier, offset)` (offset from the engine block's start) then goes to
/// each sub-block from the one where the item starts, with its offset from that sub-block's
/// start (the item is taken to reach the engine block's end: its length is not published);
/// any other key (the `cache_salt`, which vLLM puts in the first block) to sub-block 0 only.
fn encode_extra_keys(
    keys: &[Value<'_>],
    lora_name: Option<&str>,
    lora_id: Option<u64>,
    sub: Option<(usize, usize)>,
    out: &mut Vec<u8>,
) {
    let keys = without_lora(keys, lora_name, lora_id);
    let Some((j, router_block)) = sub else {
        keys.iter().for_each(|v| encode_value(v, out));
        return;
    };
    let start = i128::try_from(j * router_block).unwrap_or(i128::MAX);
    let end = start.saturating_add(i128::try_from(router_block).unwrap_or(i128::MAX));
    for v in keys {
        match mm_key(v) {
            // An item that starts before this sub-block's end reaches it (see above).
            Some((identifier, offset)) if offset < end => {
                keys::list(out, 2);
                keys::str(out, identifier);
                keys::int(out, offset - start);
            }
            Some(_) => {}
            None if j == 0 => encode_value(v, out),
            None => {}
        }
    }
}

/// A block's extra keys less a leading LoRA name (or id) that the seed already carries.
fn without_lora<'k, 'v>(
    keys: &'k [Value<'v>],
    lora_name: Option<&str>,
    lora_id: Option<u64>,
) -> &'k [Value<'v>] {
    let lora_first = match (keys.first(), lora_name) {
        (Some(Value::Str(s)), Some(name)) => *s == name.as_bytes(),
        (Some(Value::Uint(v)), None) => Some(*v) == lora_id,
        _ => false,
    };
    &keys[usize::from(lora_first)..]
}

/// A multimodal extra key `(identifier, offset)`: its identifier and offset.
fn mm_key<'v>(v: &Value<'v>) -> Option<(&'v [u8], i128)> {
    match v {
        Value::Array(pair) => match pair.as_slice() {
            [Value::Str(id), Value::Uint(o)] => Some((id, i128::from(*o))),
            [Value::Str(id), Value::Int(o)] => Some((id, i128::from(*o))),
            _ => None,
        },
        _ => None,
    }
}

/// Is `medium` a pool shared by several engines rather than the publisher's own storage?
/// SGLang's `EXTERNAL` tier ("L4: shared / remote pool", e.g. Mooncake), and the names
/// `REMOTE` and `SHARED`, in any case.
fn is_shared_pool(medium: &str) -> bool {
    let m = medium.trim();
    ["external", "remote", "shared"]
        .iter()
        .any(|n| m.eq_ignore_ascii_case(n))
}

fn encode_value(v: &Value<'_>, out: &mut Vec<u8>) {
    match v {
        Value::Nil => keys::nil(out),
        Value::Bool(b) => keys::bool(out, *b),
        Value::Uint(u) => keys::int(out, i128::from(*u)),
        Value::Int(i) => keys::int(out, i128::from(*i)),
        Value::F32(f) => keys::float(out, f64::from(*f)),
        Value::F64(f) => keys::float(out, *f),
        Value::Str(s) => keys::str(out, s),
        Value::Bin(b) => keys::bin(out, b),
        Value::Array(items) => {
            keys::list(out, items.len());
            items.iter().for_each(|i| encode_value(i, out));
        }
        Value::Map(pairs) => {
            keys::map(out, pairs.len());
            for (k, v) in pairs {
                encode_value(k, out);
                encode_value(v, out);
            }
        }
        Value::Ext(t, b) => keys::ext(out, *t, b),
    }
}

fn read_ts(r: &mut Reader<'_>) -> Result<f64, DecodeErrorKind> {
    ctx("ts", r.read_f64())
}

fn read_dp_rank(r: &mut Reader<'_>) -> Result<Option<u32>, DecodeErrorKind> {
    if ctx("data_parallel_rank", r.read_nil_opt())? {
        return Ok(None);
    }
    let v = ctx("data_parallel_rank", r.read_u64())?;
    u32::try_from(v)
        .map(Some)
        .map_err(|_| DecodeErrorKind::InvalidValue {
            field: "data_parallel_rank",
            reason: "does not fit in u32",
        })
}

/// Read a map key: `Some(text)` for a UTF-8 string key, `None` for any other key (which is
/// consumed whole; the caller skips its value).
fn read_key<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeErrorKind> {
    if ctx("key", r.peek_kind())? == Kind::Str {
        match ctx("key", r.next_token())? {
            // a key that is not UTF-8 cannot be one we know: treat it as unknown
            Token::Str(bytes) => Ok(std::str::from_utf8(bytes).ok()),
            _ => Ok(None),
        }
    } else {
        ctx("key", r.skip_value())?;
        Ok(None)
    }
}

/// A block hash: uint, negative int (bits reinterpreted), or bin (last 8 bytes, big-endian).
fn read_block_hash(r: &mut Reader<'_>, field: &'static str) -> Result<u64, DecodeErrorKind> {
    let offset = r.position();
    match ctx(field, r.next_token())? {
        Token::Uint(v) => Ok(v),
        Token::Int(v) => Ok(u64::from_ne_bytes(v.to_ne_bytes())),
        Token::Bin(b) => {
            let tail = b.get(b.len().saturating_sub(8)..).unwrap_or(&[]);
            Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        t => Err(DecodeErrorKind::Msgpack {
            field,
            error: msgpack::Error::TypeMismatch {
                offset,
                expected: "block hash (integer or binary)",
                found: t.kind(),
            },
        }),
    }
}

/// A token id: an unsigned int or, in SGLang's bigram keys (EAGLE speculative decoding), a
/// non-empty array `[token, next token]` whose first element is the position's token.
fn read_token_id(r: &mut Reader<'_>) -> Result<u64, DecodeErrorKind> {
    let offset = r.position();
    match ctx("token_ids", r.next_token())? {
        Token::Uint(v) => Ok(v),
        Token::Array(n) if n > 0 => {
            let t = ctx("token_ids", r.read_u64())?;
            ctx("token_ids", r.skip_values(u64::from(n - 1)))?;
            Ok(t)
        }
        t => Err(DecodeErrorKind::Msgpack {
            field: "token_ids",
            error: msgpack::Error::TypeMismatch {
                offset,
                expected: "token id (unsigned integer, or a bigram array)",
                found: t.kind(),
            },
        }),
    }
}

fn read_opt_str<'a>(
    r: &mut Reader<'a>,
    field: &'static str,
) -> Result<Option<&'a str>, DecodeErrorKind> {
    if ctx(field, r.read_nil_opt())? {
        Ok(None)
    } else {
        ctx(field, r.read_str()).map(Some)
    }
}

fn read_opt_u64(r: &mut Reader<'_>, field: &'static str) -> Result<Option<u64>, DecodeErrorKind> {
    if ctx(field, r.read_nil_opt())? {
        Ok(None)
    } else {
        ctx(field, r.read_u64()).map(Some)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

impl Tag {
    fn parse(s: &str) -> Option<Tag> {
        match s {
            "BlockStored" => Some(Tag::Stored),
            "BlockRemoved" => Some(Tag::Removed),
            "AllBlocksCleared" => Some(Tag::Cleared),
            _ => None,
        }
    }
}

/// The fields of one event, whichever its encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Type,
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraId,
    LoraName,
    /// Array position 7 of a `BlockStored`: vLLM's `lora_name`, or SGLang's `metadata` map
    /// (`BlockStoredWithMetadata`, sent for salted requests in place of vLLM's later fields).
    LoraNameOrMetadata,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    Locality,
    /// SGLang's top-level `cache_salt` (map-encoded events).
    CacheSalt,
    /// SGLang's `metadata` map (`{cache_salt, ...}`).
    Metadata,
    Ignored,
}

impl Field {
    fn from_key(key: &str) -> Field {
        match key {
            "type" => Field::Type,
            "block_hashes" => Field::BlockHashes,
            "parent_block_hash" => Field::Parent,
            "token_ids" => Field::TokenIds,
            "block_size" => Field::BlockSize,
            "medium" => Field::Medium,
            "lora_id" => Field::LoraId,
            "lora_name" => Field::LoraName,
            "extra_keys" => Field::ExtraKeys,
            "group_idx" => Field::GroupIdx,
            "kv_cache_spec_kind" => Field::SpecKind,
            "locality" => Field::Locality,
            "cache_salt" => Field::CacheSalt,
            "metadata" => Field::Metadata,
            // kv_cache_spec_sliding_window, anything newer
            _ => Field::Ignored,
        }
    }

    /// Field at array position `pos` (≥ 1; position 0 is the tag) of an array-encoded event.
    fn at(tag: Tag, pos: u32) -> Field {
        const STORED: [Field; 11] = [
            Field::BlockHashes,
            Field::Parent,
            Field::TokenIds,
            Field::BlockSize,
            Field::LoraId,
            Field::Medium,
            Field::LoraNameOrMetadata,
            Field::ExtraKeys,
            Field::GroupIdx,
            Field::SpecKind,
            Field::Ignored, // kv_cache_spec_sliding_window
        ];
        // `locality` is read from map-encoded events only: vLLM encodes its events as maps
        // since before it added the field, and other publishers put other fields at the
        // positions after these (ATOM's `token_offset`, for one).
        const REMOVED: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];
        let table: &[Field] = match tag {
            Tag::Stored => &STORED,
            Tag::Removed => &REMOVED,
            Tag::Cleared => &[],
        };
        usize::try_from(pos)
            .ok()
            .and_then(|p| p.checked_sub(1))
            .and_then(|p| table.get(p))
            .copied()
            .unwrap_or(Field::Ignored)
    }
}

#[derive(Debug)]
struct RawEvent<'a> {
    tag: Tag,
    f: Fields<'a>,
}

/// Fields collected before the tag is known (map keys may come in any order).
#[derive(Debug, Default)]
struct Fields<'a> {
    tag: Option<&'a str>,
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u64>,
    medium: Option<&'a str>,
    lora_id: Option<u64>,
    lora_name: Option<&'a str>,
    /// Per engine block, its extra-keys tuple (`None`: nil).
    extra_keys: Option<Vec<Option<Vec<Value<'a>>>>>,
    group_idx: Option<u64>,
    spec_kind: Option<&'a str>,
    /// A `locality` other than `"LOCAL"` (any case) was given: the copy is not in storage
    /// local to the publisher.
    not_local: bool,
    /// SGLang's request salt (top-level `cache_salt`, or in `metadata`).
    cache_salt: Option<&'a str>,
}

impl<'a> Fields<'a> {
    fn read(&mut self, r: &mut Reader<'a>, field: Field) -> Result<(), DecodeErrorKind> {
        match field {
            Field::Type => self.tag = Some(ctx("type", r.read_str())?),
            Field::BlockHashes => {
                if ctx("block_hashes", r.read_nil_opt())? {
                    self.block_hashes = None;
                } else {
                    let n = ctx("block_hashes", r.read_array_len())?;
                    let mut v = Vec::with_capacity(r.capacity_hint(n, 1));
                    for _ in 0..n {
                        v.push(read_block_hash(r, "block_hashes")?);
                    }
                    self.block_hashes = Some(v);
                }
            }
            Field::Parent => {
                self.parent = if ctx("parent_block_hash", r.read_nil_opt())? {
                    None
                } else {
                    Some(read_block_hash(r, "parent_block_hash")?)
                }
            }
            Field::TokenIds => {
                if ctx("token_ids", r.read_nil_opt())? {
                    self.token_ids = None;
                } else {
                    let n = ctx("token_ids", r.read_array_len())?;
                    let mut v = Vec::with_capacity(r.capacity_hint(n, 1));
                    for _ in 0..n {
                        let t = read_token_id(r)?;
                        v.push(u32::try_from(t).map_err(|_| DecodeErrorKind::InvalidValue {
                            field: "token_ids",
                            reason: "token id does not fit in u32",
                        })?);
                    }
                    self.token_ids = Some(v);
                }
            }
            Field::BlockSize => self.block_size = read_opt_u64(r, "block_size")?,
            Field::Medium => self.medium = read_opt_str(r, "medium")?,
            Field::LoraId => {
                // Older releases put a (possibly negative) int here; only the value matters.
                self.lora_id = if ctx("lora_id", r.read_nil_opt())? {
                    None
                } else {
                    match ctx("lora_id", r.next_token())? {
                        Token::Uint(v) => Some(v),
                        Token::Int(v) => Some(v as u64),
                        _ => {
                            return Err(DecodeErrorKind::InvalidValue {
                                field: "lora_id",
                                reason: "not an integer",
                            })
                        }
                    }
                }
            }
            Field::LoraName => self.lora_name = read_opt_str(r, "lora_name")?,
            Field::LoraNameOrMetadata => {
                if ctx("lora_name", r.peek_kind())? == Kind::Map {
                    self.read(r, Field::Metadata)?;
                } else {
                    self.lora_name = read_opt_str(r, "lora_name")?;
                }
            }
            Field::CacheSalt => {
                // SGLang's salt is a string; a value of another kind under this name (another
                // publisher's field) is ignored, as unknown keys are.
                self.cache_salt = match ctx("cache_salt", r.read_value())? {
                    Value::Str(s) => std::str::from_utf8(s).ok(),
                    _ => None,
                };
            }
            Field::Metadata => {
                // SGLang's `BlockStoredMetadata` map; anything else under this name is another
                // publisher's field, ignored. Inside the map a salt must be a string: a salted
                // store read without its salt would be credited to unsalted requests.
                if let Value::Map(pairs) = ctx("metadata", r.read_value())? {
                    for (key, value) in pairs {
                        if key.as_str() != Some("cache_salt") {
                            continue; // session_id, anything newer
                        }
                        self.cache_salt = match value {
                            Value::Nil => None,
                            Value::Str(s) => Some(std::str::from_utf8(s).map_err(|_| {
                                DecodeErrorKind::InvalidValue {
                                    field: "cache_salt",
                                    reason: "not UTF-8",
                                }
                            })?),
                            _ => {
                                return Err(DecodeErrorKind::InvalidValue {
                                    field: "cache_salt",
                                    reason: "not a string",
                                })
                            }
                        };
                    }
                }
            }
            Field::ExtraKeys => {
                self.extra_keys = if ctx("extra_keys", r.read_nil_opt())? {
                    None
                } else {
                    let n = ctx("extra_keys", r.read_array_len())?;
                    let mut v = Vec::with_capacity(r.capacity_hint(n, 1));
                    for _ in 0..n {
                        v.push(match ctx("extra_keys", r.read_value())? {
                            Value::Nil => None,
                            Value::Array(items) => Some(items),
                            // a single key not wrapped in a tuple
                            other => Some(vec![other]),
                        });
                    }
                    Some(v)
                }
            }
            Field::GroupIdx => self.group_idx = read_opt_u64(r, "group_idx")?,
            Field::SpecKind => self.spec_kind = read_opt_str(r, "kv_cache_spec_kind")?,
            Field::Locality => {
                // `"LOCAL"`, `"REMOTE"` or absent (unspecified); anything else, of any type,
                // is not known to be local (fail closed, as Dynamo).
                self.not_local = match ctx("locality", r.read_value())? {
                    Value::Nil => false,
                    Value::Str(s) => !s.eq_ignore_ascii_case(b"LOCAL"),
                    _ => true,
                }
            }
            Field::Ignored => ctx("event", r.skip_value())?,
        }
        Ok(())
    }
}

impl<'a> RawEvent<'a> {
    /// Read one event (map or array encoded). `None`: a well-formed event with an unknown tag,
    /// already skipped.
    fn read(r: &mut Reader<'a>) -> Result<Option<RawEvent<'a>>, DecodeErrorKind> {
        let mut f = Fields::default();
        let offset = r.position();
        match ctx("event", r.next_token())? {
            Token::Map(n) => {
                for _ in 0..n {
                    match read_key(r)? {
                        Some(key) => f.read(r, Field::from_key(key))?,
                        None => ctx("event", r.skip_value())?,
                    }
                }
                let tag = f
                    .tag
                    .ok_or(DecodeErrorKind::MissingField { field: "type" })?;
                Ok(Tag::parse(tag).map(|tag| RawEvent { tag, f }))
            }
            Token::Array(n) => {
                if n == 0 {
                    return Err(DecodeErrorKind::MissingField { field: "type" });
                }
                let tag = Tag::parse(ctx("type", r.read_str())?);
                for pos in 1..n {
                    match tag {
                        Some(t) => f.read(r, Field::at(t, pos))?,
                        None => ctx("event", r.skip_value())?,
                    }
                }
                Ok(tag.map(|tag| RawEvent { tag, f }))
            }
            t => Err(DecodeErrorKind::Msgpack {
                field: "event",
                error: msgpack::Error::TypeMismatch {
                    offset,
                    expected: "array or map",
                    found: t.kind(),
                },
            }),
        }
    }
}
