//! KV block hashing and the lock-free block index.
//!
//! - [`BlockHasher`]: Dynamo-compatible xxh3 block and sequence hashes.
//! - [`BlockIndex`]: sequence hash → the workers (and the storage [`Tier`]s) holding the
//!   block, fed by [`KvEvent`]s, answering per-worker leading-block overlap
//!   ([`OverlapScores`], per tier and [`TierWeights`]-weighted) without locks; memory per
//!   block independent of the number of workers.
//! - [`WorkerId`]: a worker, optionally one data-parallel rank of an engine
//!   ([`WorkerId::new`]); [`CacheKeys`]: a request's cache partition (LoRA, salt, multimodal
//!   items) for [`BlockHasher::local_hashes_with`].
//! - [`ApproxIndex`]: the same index fed by routing decisions instead of engine events, with
//!   TTL expiry and a per-worker LRU bound (Dynamo's approximate mode).
//!
//! The raw table (`table.rs`), the slot-name directory (`names.rs`) and the writer's compact
//! map (`map.rs`) are private; the concurrency protocol is documented in `index/mod.rs`,
//! `table.rs` and `names.rs`.

mod approx;
mod event;
pub(crate) mod hash;
mod index;
mod map;
mod names;
mod persist;
mod table;

pub use approx::{ApproxConfig, ApproxIndex};
pub use event::{KvEvent, StoredBlock, Tier, TierWeights, WorkerId};
pub use hash::{BlockHasher, CacheKeys, HasherError, MmInput, DEFAULT_SEED};
pub use index::{
    BlockIndex, DuplicateStores, EventError, IndexStats, Overlap, OverlapScores, MAX_COPIES,
};
pub use persist::BlockSnapshotSummary;
