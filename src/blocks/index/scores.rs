//! Lookup results: per-worker overlap with a request ([`OverlapScores`]), and the scan
//! state the lookups share.

use super::{ALL_TIERS, TIERS};
use crate::blocks::event::{Tier, WorkerId};
use crate::blocks::names::SlotNames;

/// One worker's overlap with a request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub(super) worker: WorkerId,
    /// Leading blocks held in any tier.
    pub(super) blocks: usize,
    /// Per tier, leading blocks held in that tier.
    pub(super) tiers: [usize; TIERS],
    /// Σ over the leading blocks of the best weight among the tiers holding each.
    pub(super) weighted: f64,
}

impl Entry {
    pub(super) fn overlap(&self) -> Overlap {
        Overlap {
            blocks: self.blocks,
            per_tier: self.tiers,
            weighted: self.weighted,
        }
    }
}

/// One worker's overlap with a request, per tier (see [`OverlapScores::overlap`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overlap {
    /// Leading blocks held in any tier ([`OverlapScores::get`]).
    pub blocks: usize,
    /// Per tier (indexed by [`Tier::index`]), leading blocks held in that tier.
    pub per_tier: [usize; TIERS],
    /// Tier-weighted leading blocks ([`OverlapScores::weighted`]).
    pub weighted: f64,
}

/// A worker still matching during a scan in list mode.
#[derive(Clone, Copy, Debug)]
pub(super) struct Active {
    pub(super) slot: u32,
    /// Tiers that held every block so far.
    pub(super) run: u8,
    /// Per tier, the depth at which the tier's run ended (valid once it left `run`).
    pub(super) lead: [usize; TIERS],
    pub(super) weighted: f64,
}

/// Per-worker overlap with a request: how many leading blocks of it each worker holds.
///
/// Returned by [`BlockIndex::find_matches`]; holds only workers with a positive score,
/// sorted by [`WorkerId`].
///
/// ```
/// use kvtrie::{BlockIndex, KvEvent, StoredBlock, WorkerId};
///
/// let index = BlockIndex::new();
/// let blocks = vec![
///     StoredBlock { engine_hash: 1, local_hash: 10 },
///     StoredBlock { engine_hash: 2, local_hash: 20 },
/// ];
/// index.apply(WorkerId(7), KvEvent::Stored { parent: None, blocks }).unwrap();
/// let scores = index.find_matches(&[10, 20, 30]);
/// assert_eq!(scores.get(WorkerId(7)), 2);
/// assert_eq!(scores.get(WorkerId(8)), 0);
/// assert_eq!(scores.iter().collect::<Vec<_>>(), vec![(WorkerId(7), 2)]);
/// assert_eq!(scores.max(), 2);
/// ```
///
/// [`BlockIndex::find_matches`]: crate::blocks::BlockIndex::find_matches
#[derive(Clone, Default)]
pub struct OverlapScores {
    /// Score > 0, sorted by worker.
    pub(super) entries: Vec<Entry>,
    /// Scratch of a scan in list mode.
    pub(super) active: Vec<Active>,
    /// Scratch of a scan in wide-bitset mode: the active words, and the next block's.
    pub(super) wide: Vec<u64>,
    pub(super) next: Vec<u64>,
}

impl OverlapScores {
    /// An empty result, to pass to [`BlockIndex::find_matches_into`].
    ///
    /// [`BlockIndex::find_matches_into`]: crate::blocks::BlockIndex::find_matches_into
    pub fn new() -> Self {
        Self::default()
    }

    pub(super) fn entry(&self, worker: WorkerId) -> Option<&Entry> {
        self.entries
            .binary_search_by_key(&worker, |e| e.worker)
            .ok()
            .map(|i| &self.entries[i])
    }

    /// The number of leading request blocks `worker` holds (0 if none or unknown).
    pub fn get(&self, worker: WorkerId) -> usize {
        self.entry(worker).map_or(0, |e| e.blocks)
    }

    /// The number of leading request blocks `worker` holds in `tier` (0 if none): the run
    /// of blocks from the first that all have a copy there.
    pub fn get_tier(&self, worker: WorkerId, tier: Tier) -> usize {
        self.entry(worker).map_or(0, |e| e.tiers[tier.index()])
    }

    /// The tier-weighted overlap of `worker`: the sum, over the leading blocks it holds (in
    /// any tier), of the best weight among the tiers that hold each block (0.0 if none).
    /// The weights are those of the lookup ([`BlockIndex::find_matches_weighted`]; the other
    /// lookups use [`TierWeights::default`]), so for GPU-only copies this is [`Self::get`].
    ///
    /// [`BlockIndex::find_matches_weighted`]: crate::blocks::BlockIndex::find_matches_weighted
    /// [`TierWeights::default`]: crate::blocks::TierWeights::default
    pub fn weighted(&self, worker: WorkerId) -> f64 {
        self.entry(worker).map_or(0.0, |e| e.weighted)
    }

    /// Everything known about `worker`'s overlap, if it holds the first block.
    pub fn overlap(&self, worker: WorkerId) -> Option<Overlap> {
        self.entry(worker).map(Entry::overlap)
    }

    /// `(worker, overlap)` for every worker with a positive score, sorted by worker.
    pub fn overlaps(&self) -> impl Iterator<Item = (WorkerId, Overlap)> + '_ {
        self.entries.iter().map(|e| (e.worker, e.overlap()))
    }

    /// `(worker, score)` for every worker with a positive score, sorted by worker.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, usize)> + '_ {
        self.entries.iter().map(|e| (e.worker, e.blocks))
    }

    /// Number of workers with a positive score.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no worker holds the request's first block.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The best score (0 when empty).
    pub fn max(&self) -> usize {
        self.entries.iter().map(|e| e.blocks).max().unwrap_or(0)
    }

    /// The worker with the best score (the smallest [`WorkerId`] among ties), if any.
    pub fn best(&self) -> Option<(WorkerId, usize)> {
        self.iter()
            .fold(None, |b: Option<(WorkerId, usize)>, (w, s)| match b {
                Some((_, bs)) if bs >= s => b,
                _ => Some((w, s)),
            })
    }

    /// Removes all scores, keeping the storage.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Records the workers of bitset word `word` (slots `64 * word ..`) set in `mask` as
    /// matching `depth` blocks, with the per-tier runs and weight all active workers share.
    #[inline]
    pub(super) fn push_bits(
        &mut self,
        names: &SlotNames,
        word: usize,
        mut mask: u64,
        depth: usize,
        shared: &Shared,
    ) {
        while mask != 0 {
            let s = (word * 64) as u32 + mask.trailing_zeros();
            mask &= mask - 1;
            if let Some(worker) = names.get(s) {
                self.entries.push(Entry {
                    worker,
                    blocks: depth,
                    tiers: shared.tiers(depth),
                    weighted: shared.weighted(depth),
                });
            }
        }
    }

    pub(super) fn push_active(&mut self, names: &SlotNames, a: &Active, depth: usize) {
        if let Some(worker) = names.get(a.slot) {
            let mut tiers = a.lead;
            for (t, v) in tiers.iter_mut().enumerate() {
                if a.run & (1 << t) != 0 {
                    *v = depth;
                }
            }
            self.entries.push(Entry {
                worker,
                blocks: depth,
                tiers,
                weighted: a.weighted,
            });
        }
    }
}

impl PartialEq for OverlapScores {
    /// Compares the per-worker, per-tier block counts (not the weighted sums, which depend on
    /// the weights a lookup was made with).
    fn eq(&self, other: &Self) -> bool {
        self.entries.len() == other.entries.len()
            && self
                .entries
                .iter()
                .zip(&other.entries)
                .all(|(a, b)| a.worker == b.worker && a.blocks == b.blocks && a.tiers == b.tiers)
    }
}

impl Eq for OverlapScores {}

impl core::fmt::Debug for OverlapScores {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|e| (e.worker.0, e.blocks)))
            .finish()
    }
}

/// Best tier weight for every tier mask.
pub(super) type BestWeights = [f64; 1 << TIERS];

pub(super) fn best_weights(w: &[f64; TIERS]) -> BestWeights {
    let mut best = [0.0; 1 << TIERS];
    for (m, b) in best.iter_mut().enumerate() {
        *b = best_of(w, m as u8);
    }
    best
}

/// The best weight among the tiers of mask `m` (0.0 for no tier).
#[inline]
pub(super) fn best_of(w: &[f64; TIERS], m: u8) -> f64 {
    let mut best = f64::NEG_INFINITY;
    for (t, &x) in w.iter().enumerate() {
        if m & (1 << t) != 0 && x > best {
            best = x;
        }
    }
    if m == 0 {
        0.0
    } else {
        best
    }
}

/// What every active worker shares in the bitset scan modes, where each block so far was held
/// by all of its (active) holders in the same tiers. The weighted sum is kept lazily: blocks
/// `from..` all had mask `mask`, so a request whose blocks all have one mask (the common case)
/// costs one compare per block.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shared {
    /// Tiers that held every block so far.
    pub(super) run: u8,
    /// Per tier, the depth at which its run ended (valid once it left `run`).
    pub(super) lead: [usize; TIERS],
    /// The mask of blocks `from..` (`u8::MAX` before the first block), and its best weight.
    pub(super) mask: u8,
    pub(super) best: f64,
    pub(super) from: usize,
    /// The weighted sum of blocks `..from`.
    pub(super) before: f64,
}

impl Shared {
    pub(super) fn new() -> Self {
        Shared {
            run: ALL_TIERS,
            lead: [0; TIERS],
            mask: u8::MAX,
            best: 0.0,
            from: 0,
            before: 0.0,
        }
    }

    /// The active workers all hold the block at `depth` in tiers `m`.
    #[inline]
    pub(super) fn step(&mut self, m: u8, depth: usize, w: &[f64; TIERS]) {
        if m != self.mask {
            self.change(m, depth, w);
        }
    }

    #[cold]
    pub(super) fn change(&mut self, m: u8, depth: usize, w: &[f64; TIERS]) {
        self.before += (depth - self.from) as f64 * self.best;
        self.from = depth;
        self.mask = m;
        self.best = best_of(w, m);
        let dropped = self.run & !m;
        for (t, lead) in self.lead.iter_mut().enumerate() {
            if dropped & (1 << t) != 0 {
                *lead = depth;
            }
        }
        self.run &= m;
    }

    /// The weighted sum of the first `depth` blocks.
    #[inline]
    pub(super) fn weighted(&self, depth: usize) -> f64 {
        self.before + (depth - self.from) as f64 * self.best
    }

    /// Per-tier runs of a worker that ends with `depth` blocks.
    #[inline]
    pub(super) fn tiers(&self, depth: usize) -> [usize; TIERS] {
        let mut tiers = self.lead;
        for (t, v) in tiers.iter_mut().enumerate() {
            if self.run & (1 << t) != 0 {
                *v = depth;
            }
        }
        tiers
    }

    /// The list-mode state of an active worker in `slot` after `depth` blocks.
    pub(super) fn active(&self, slot: u32, depth: usize) -> Active {
        Active {
            slot,
            run: self.run,
            lead: self.lead,
            weighted: self.weighted(depth),
        }
    }
}
