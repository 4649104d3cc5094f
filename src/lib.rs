#![doc = include_str!("../README.md")]
#![doc = include_str!("../doc/crate.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod blocks;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod dist;
pub mod events;
mod hint;
/// Test support: a sequential reference model of [`PrefixTree`] and the differential driver
/// the proptest and the fuzz target share (feature `testing`; not part of the product API).
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod model;
mod reclaim;
mod rng;
pub mod router;
#[cfg(feature = "sim")]
pub mod sim;
pub mod snapshot;
mod sync;
mod tenant;
mod text;
mod tree;

/// Background eviction of a [`PrefixTree`]: its configuration, handle, errors and pass
/// statistics ([`EvictionConfig`] and [`EvictionHandle`] are also at the crate root).
pub mod evict {
    pub use crate::tree::{
        EvictionConfig, EvictionConfigError, EvictionHandle, EvictionStartError, EvictionTotals,
        PassStats, MIN_EVICTION_INTERVAL,
    };
}
/// Test and benchmark support: the standard workloads W1–W6 (feature `testing`; not part of
/// the product API).
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod workload;

pub use blocks::{
    BlockHasher, BlockIndex, EventError, KvEvent, OverlapScores, StoredBlock, WorkerId,
};
pub use router::{
    Candidate, KvAwareConfig, KvAwareRouter, PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId,
    Route, RouteReason, Selection,
};
pub use tenant::{TenantId, TenantSet};
pub use tree::{
    Error, EvictionConfig, EvictionHandle, NodeSnapshot, PrefixMatch, PrefixTree, RetiredBacklog,
    SnapshotSummary, TreeStats, MAX_TENANTS, MAX_TEXT_BYTES,
};
