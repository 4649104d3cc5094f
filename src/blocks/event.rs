//! KV-cache events as engines report them, the worker id they are reported for, and the
//! storage tier they refer to.

/// Identifies one engine worker: one replica, or one data-parallel rank of a replica.
///
/// A plain id (`WorkerId(3)`) is engine 3, rank 0. [`WorkerId::new`] packs a data-parallel
/// rank into the top 16 bits, so every rank of an engine is a worker of its own for the index
/// and the router (the rank's cache is its own), while [`WorkerId::engine`] still names the
/// engine to send the request to:
///
/// ```
/// use kvtrie::WorkerId;
/// let w = WorkerId::new(7, 2);
/// assert_eq!((w.engine(), w.dp_rank()), (7, 2));
/// assert_eq!(WorkerId::new(3, 0), WorkerId(3));
/// assert_eq!(WorkerId::ranks(7, 3).collect::<Vec<_>>(),
///            vec![WorkerId::new(7, 0), WorkerId::new(7, 1), WorkerId::new(7, 2)]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub u64);

impl WorkerId {
    /// Bit position of the data-parallel rank.
    pub const RANK_SHIFT: u32 = 48;
    /// Largest engine id [`WorkerId::new`] keeps whole (2⁴⁸ − 1).
    pub const MAX_ENGINE: u64 = (1 << Self::RANK_SHIFT) - 1;

    /// The worker for data-parallel rank `dp_rank` of engine `engine`. Engine ids above
    /// [`Self::MAX_ENGINE`] keep only their low 48 bits.
    #[inline]
    pub const fn new(engine: u64, dp_rank: u16) -> Self {
        WorkerId((engine & Self::MAX_ENGINE) | (dp_rank as u64) << Self::RANK_SHIFT)
    }

    /// The engine this worker belongs to.
    #[inline]
    pub const fn engine(self) -> u64 {
        self.0 & Self::MAX_ENGINE
    }

    /// The worker's data-parallel rank within its engine (0 for a plain id).
    #[inline]
    pub const fn dp_rank(self) -> u16 {
        (self.0 >> Self::RANK_SHIFT) as u16
    }

    /// Ranks `0..dp_size` of `engine`, e.g. to list an engine's workers for the router.
    pub fn ranks(engine: u64, dp_size: u16) -> impl Iterator<Item = WorkerId> {
        (0..dp_size).map(move |r| WorkerId::new(engine, r))
    }
}

/// A storage tier that may hold a worker's copy of a block (vLLM's `medium` field).
///
/// ```
/// use kvtrie::blocks::Tier;
/// assert_eq!(Tier::from_medium(None), Tier::Gpu);
/// assert_eq!(Tier::from_medium(Some("CPU")), Tier::Cpu);
/// assert_eq!(Tier::from_medium(Some("disk")), Tier::Disk);
/// assert_eq!(Tier::from_medium(Some("lmcache-l2-s3")), Tier::Other);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Device (GPU) memory: the engine's own prefix cache.
    Gpu = 0,
    /// Host memory (CPU offloading, LMCache's local CPU tier).
    Cpu = 1,
    /// Local storage (disk, SSD, NVMe).
    Disk = 2,
    /// Any other medium (remote or unrecognized stores).
    Other = 3,
}

impl Tier {
    /// Every tier, in index order.
    pub const ALL: [Tier; 4] = [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Other];

    /// The tier an engine's `medium` string names, case-insensitively. `None` (older vLLM
    /// releases, which only had the GPU cache) is the GPU. `gpu`, `cuda`, `device`, `hbm` →
    /// [`Tier::Gpu`]; `cpu`, `host`, `dram`, `ram`, `cpu_pinned`, `cpu_tier1` → [`Tier::Cpu`];
    /// `disk`, `ssd`, `nvme`, `local_disk`, `storage`, `file`, `cpu_tier2` → [`Tier::Disk`]
    /// (`cpu_tier1` / `cpu_tier2` as NVIDIA Dynamo's `StorageTier::from_kv_medium` reads
    /// them); anything else → [`Tier::Other`].
    pub fn from_medium(medium: Option<&str>) -> Tier {
        let Some(m) = medium else {
            return Tier::Gpu;
        };
        let m = m.trim();
        let is = |names: &[&str]| names.iter().any(|n| m.eq_ignore_ascii_case(n));
        if is(&["gpu", "cuda", "device", "hbm"]) {
            Tier::Gpu
        } else if is(&["cpu", "host", "dram", "ram", "cpu_pinned", "cpu_tier1"]) {
            Tier::Cpu
        } else if is(&[
            "disk",
            "ssd",
            "nvme",
            "local_disk",
            "storage",
            "file",
            "cpu_tier2",
        ]) {
            Tier::Disk
        } else {
            Tier::Other
        }
    }

    /// The tier's index (`0..4`).
    #[inline]
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The tier's bit in a tier mask.
    #[inline]
    pub(crate) const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// How much a block held in each tier is worth to a request, relative to recomputing it
/// (1.0: as good as the GPU cache, 0.0: worthless). Used by
/// [`crate::blocks::BlockIndex::find_matches_weighted`] and the KV-aware router's cost.
///
/// The defaults (GPU 1.0, CPU 0.8, disk 0.5, any other tier 1.0) follow the llm-d KV-cache
/// indexer's scorer, which weighs `gpu` 1.0 and `cpu` 0.8 and scores media it has no entry
/// for at its default backend weight of 1.0; disk sits between CPU and llm-d's shared-storage
/// tiers (0.3–0.4), since loading from a local SSD is slower than from host memory but still
/// far cheaper than a long prefill. Deployments with measured load times should set their own.
///
/// ```
/// use kvtrie::blocks::{Tier, TierWeights};
/// let w = TierWeights::default();
/// assert_eq!((w.gpu, w.cpu, w.disk, w.other), (1.0, 0.8, 0.5, 1.0));
/// assert_eq!(w.weight(Tier::Cpu), 0.8);
/// assert!(TierWeights { cpu: f64::NAN, ..w }.validate().is_err());
/// assert!(TierWeights { disk: 1.5, ..w }.validate().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWeights {
    /// Weight of a GPU copy.
    pub gpu: f64,
    /// Weight of a CPU copy.
    pub cpu: f64,
    /// Weight of a disk copy.
    pub disk: f64,
    /// Weight of a copy in any other tier.
    pub other: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights {
            gpu: 1.0,
            cpu: 0.8,
            disk: 0.5,
            other: 1.0,
        }
    }
}

impl TierWeights {
    /// Every tier weighs 1.0 (a block counts fully wherever it is).
    pub const UNIFORM: TierWeights = TierWeights {
        gpu: 1.0,
        cpu: 1.0,
        disk: 1.0,
        other: 1.0,
    };

    /// The weight of `tier`.
    pub fn weight(&self, tier: Tier) -> f64 {
        self.as_array()[tier.index()]
    }

    /// The weights in tier index order.
    pub fn as_array(&self) -> [f64; 4] {
        [self.gpu, self.cpu, self.disk, self.other]
    }

    /// Checks that every weight lies in `[0, 1]`: a copy is worth at most a GPU copy (a weight
    /// above 1 made a partly cached prompt weigh more than its blocks, and the KV-aware router,
    /// which caps the weighted overlap at the prompt's blocks, cost it as wholly cached).
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.as_array().iter().all(|w| (0.0..=1.0).contains(w)) {
            Ok(())
        } else {
            Err("tier weights must be between 0 and 1")
        }
    }
}

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
