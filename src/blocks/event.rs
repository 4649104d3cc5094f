//! KV-cache events as engines report them, and the worker id they are reported for.

/// Identifies one engine worker (one replica, or one data-parallel rank of a replica).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub u64);

/// One block of a [`KvEvent::Stored`] event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's own opaque id for the block (vLLM's `block_hash`).
    pub engine_hash: u64,
    /// The router-side local hash of the block's tokens ([`crate::blocks::BlockHasher`]).
    pub local_hash: u64,
}

/// A change to one worker's KV cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were stored, in order; the first chains from `parent`, an engine hash the same
    /// worker stored earlier (`None`: the blocks start a sequence).
    Stored {
        /// Engine hash of the block the first stored block follows.
        parent: Option<u64>,
        /// The stored blocks, in sequence order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks were evicted from the worker's cache.
    Removed {
        /// Engine hashes of the removed blocks.
        engine_hashes: Vec<u64>,
    },
    /// The worker dropped its whole cache.
    Cleared,
}
