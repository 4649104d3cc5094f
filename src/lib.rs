#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod blocks;
pub mod events;
pub mod evict;
pub mod model;
mod reclaim;
pub mod router;
#[cfg(feature = "sim")]
pub mod sim;
mod sync;
mod tenant;
mod text;
mod tree;
pub mod workload;

pub use blocks::{
    BlockHasher, BlockIndex, EventError, KvEvent, OverlapScores, StoredBlock, WorkerId,
};
pub use evict::{EvictionConfig, EvictionHandle};
pub use router::{
    Candidate, KvAwareConfig, KvAwareRouter, PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId,
    Route, RouteReason, Selection,
};
pub use tenant::{TenantId, TenantSet};
pub use tree::{
    Error, NodeSnapshot, PrefixMatch, PrefixTree, RetiredBacklog, TreeStats, MAX_TENANTS,
    MAX_TEXT_BYTES,
};
