//! The read path: [`BlockIndex::find_matches`] and its forms, lock-free (see the module
//! docs of `index`, "Concurrency protocol").

use super::scores::{best_weights, Active, BestWeights, OverlapScores, Shared};
use super::{BlockIndex, TIERS};
use crate::blocks::event::TierWeights;
use crate::blocks::hash::{chain, hash_u32s};
use crate::blocks::names::SlotNames;
use crate::blocks::table::{
    bits_of, decode, holder_slot, holder_tiers, Holders, Table, BITSET_SLOTS,
};
use crate::reclaim::{self, Guard};

/// The tier mask `slot` holds in `h` (0 if none).
#[inline]
fn tiers_in(h: Holders<'_>, slot: u32, from: &mut usize) -> u8 {
    match h {
        Holders::Empty => 0,
        Holders::Bits(m, b) => {
            if slot < BITSET_SLOTS && (b >> slot) & 1 != 0 {
                m
            } else {
                0
            }
        }
        Holders::Pair(h0, h1) => {
            if holder_slot(h0) == slot {
                holder_tiers(h0)
            } else if h1 != 0 && holder_slot(h1) == slot {
                holder_tiers(h1)
            } else {
                0
            }
        }
        Holders::Sparse(set) => {
            // `from` only moves forward: the active workers are visited in slot order, and
            // they are a subset of the previous block's holders, so a linear merge is cheap.
            let mut i = (*from).min(set.len());
            while i < set.len() && holder_slot(set[i]) < slot {
                i += 1;
            }
            *from = i;
            match set.get(i) {
                Some(&h) if holder_slot(h) == slot => holder_tiers(h),
                _ => 0,
            }
        }
        Holders::Dense(m, base, words) => {
            let k = (slot / 64).wrapping_sub(base) as usize;
            match words.get(k) {
                Some(&w) if (w >> (slot % 64)) & 1 != 0 => m,
                _ => 0,
            }
        }
    }
}

/// Calls `f(slot, tiers)` for every holder of `h`, in slot order.
fn for_each_holder(h: Holders<'_>, mut f: impl FnMut(u32, u8)) {
    match h {
        Holders::Empty => {}
        Holders::Bits(m, mut b) => {
            while b != 0 {
                f(b.trailing_zeros(), m);
                b &= b - 1;
            }
        }
        Holders::Pair(h0, h1) => {
            f(holder_slot(h0), holder_tiers(h0));
            if h1 != 0 {
                f(holder_slot(h1), holder_tiers(h1));
            }
        }
        Holders::Sparse(set) => set.iter().for_each(|&h| f(holder_slot(h), holder_tiers(h))),
        Holders::Dense(m, base, words) => {
            for (k, &w) in words.iter().enumerate() {
                let mut b = w;
                while b != 0 {
                    f((base as usize + k) as u32 * 64 + b.trailing_zeros(), m);
                    b &= b - 1;
                }
            }
        }
    }
}

/// The tier mask every holder of `h` shares, if they share one (`None`: they differ).
fn uniform_mask(h: Holders<'_>) -> Option<u8> {
    match h {
        Holders::Empty => Some(0),
        Holders::Bits(m, _) | Holders::Dense(m, ..) => Some(m),
        Holders::Pair(h0, h1) => {
            let m = holder_tiers(h0);
            (h1 == 0 || holder_tiers(h1) == m).then_some(m)
        }
        Holders::Sparse(set) => {
            let m = set.first().map_or(0, |&h| holder_tiers(h));
            set.iter().all(|&h| holder_tiers(h) == m).then_some(m)
        }
    }
}

/// The active workers of a wide-bitset scan: bit `b` of `words[i]` = slot
/// `64 * (off + i) + b`; words outside `lo..hi` (absolute word indexes) are zero.
struct Wide {
    words: Vec<u64>,
    next: Vec<u64>,
    off: usize,
    lo: usize,
    hi: usize,
}

impl Wide {
    /// Narrows `lo..hi` to the non-zero words; false if none is left.
    fn trim(&mut self) -> bool {
        while self.lo < self.hi && self.words[self.lo - self.off] == 0 {
            self.lo += 1;
        }
        while self.hi > self.lo && self.words[self.hi - 1 - self.off] == 0 {
            self.hi -= 1;
        }
        self.lo < self.hi
    }

    /// Keeps the active workers of word `k` that `held(k)` has; the others end with `depth`
    /// blocks and the `shared` state.
    #[inline]
    fn intersect(
        &mut self,
        names: &SlotNames,
        depth: usize,
        shared: &Shared,
        out: &mut OverlapScores,
        held: impl Fn(usize) -> u64,
    ) {
        for k in self.lo..self.hi {
            let a = &mut self.words[k - self.off];
            let kept = *a & held(k);
            if kept != *a {
                out.push_bits(names, k, *a & !kept, depth, shared);
                *a = kept;
            }
        }
    }

    /// Intersects the active workers with the holders `h` of the block at `depth` (0-based):
    /// those that do not hold it end with `depth` blocks and the `shared` state. Returns the
    /// tier mask the remaining ones all hold it in (`Some((false, _))`: none remains), or
    /// `None` (changing nothing) when the active holders' tiers differ: the scan must
    /// continue in list mode.
    fn step(
        &mut self,
        names: &SlotNames,
        h: Holders<'_>,
        depth: usize,
        shared: &Shared,
        out: &mut OverlapScores,
    ) -> Option<(bool, u8)> {
        let (off, lo, hi) = (self.off, self.lo, self.hi);
        let mask = match h {
            Holders::Empty => {
                self.intersect(names, depth, shared, out, |_| 0);
                0
            }
            Holders::Bits(m, b) => {
                self.intersect(names, depth, shared, out, |k| if k == 0 { b } else { 0 });
                m
            }
            Holders::Dense(m, base, words) => {
                let base = base as usize;
                self.intersect(names, depth, shared, out, |k| {
                    words.get(k.wrapping_sub(base)).copied().unwrap_or(0)
                });
                m
            }
            Holders::Pair(..) | Holders::Sparse(_) => {
                self.next.clear();
                self.next.resize(hi - lo, 0);
                let mut mask = None;
                let mut mixed = false;
                let words = &self.words;
                let next = &mut self.next;
                for_each_holder(h, |slot, tiers| {
                    let k = slot as usize / 64;
                    if (lo..hi).contains(&k) && (words[k - off] >> (slot % 64)) & 1 != 0 {
                        match mask {
                            None => mask = Some(tiers),
                            Some(m) if m != tiers => mixed = true,
                            Some(_) => {}
                        }
                        next[k - lo] |= 1 << (slot % 64);
                    }
                });
                if mixed {
                    return None;
                }
                for k in lo..hi {
                    let a = &mut self.words[k - off];
                    let kept = self.next[k - lo];
                    out.push_bits(names, k, *a & !kept, depth, shared);
                    *a = kept;
                }
                mask.unwrap_or(0)
            }
        };
        Some((self.trim(), mask))
    }
}

impl BlockIndex {
    // ----------------------------------------------------------------------------------------
    // Readers
    // ----------------------------------------------------------------------------------------

    /// For every worker, the number of leading blocks of a request it holds, given the
    /// request's **local** block hashes in order (sequence hashes are chained on the fly with
    /// this index's seed). Stops as soon as no worker can extend its run.
    pub fn find_matches(&self, local_hashes: &[u64]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_into(local_hashes, &mut out);
        out
    }

    /// [`Self::find_matches`] into the caller's storage (no allocation once `out` has grown).
    pub fn find_matches_into(&self, local_hashes: &[u64], out: &mut OverlapScores) {
        let seed = self.hasher.seed();
        let mut prev = None;
        self.scan(
            local_hashes.iter().map(|&l| {
                let s = match prev {
                    None => l,
                    Some(p) => chain(p, l, seed),
                };
                prev = Some(s);
                s
            }),
            &TierWeights::default().as_array(),
            out,
        );
    }

    /// [`Self::find_matches`] with tier weights for [`OverlapScores::weighted`] (the block
    /// counts do not depend on them).
    ///
    /// ```
    /// use kvtrie::blocks::{BlockIndex, KvEvent, StoredBlock, Tier, TierWeights, WorkerId};
    /// let index = BlockIndex::new();
    /// let blocks: Vec<StoredBlock> = (1..=4)
    ///     .map(|i| StoredBlock { engine_hash: i, local_hash: 10 * i })
    ///     .collect();
    /// // Worker 1 holds the chain on the GPU, worker 2 only in host memory.
    /// index.apply(WorkerId(1), KvEvent::Stored { parent: None, blocks: blocks.clone() }).unwrap();
    /// index.apply_in(WorkerId(2), Tier::Cpu, KvEvent::Stored { parent: None, blocks }).unwrap();
    /// let s = index.find_matches_weighted(&[10, 20, 30, 40], &TierWeights::default());
    /// assert_eq!((s.get(WorkerId(1)), s.get(WorkerId(2))), (4, 4));
    /// assert_eq!((s.weighted(WorkerId(1)), s.weighted(WorkerId(2))), (4.0, 3.2));
    /// ```
    pub fn find_matches_weighted(
        &self,
        local_hashes: &[u64],
        weights: &TierWeights,
    ) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_weighted_into(local_hashes, weights, &mut out);
        out
    }

    /// [`Self::find_matches_weighted`] into the caller's storage.
    pub fn find_matches_weighted_into(
        &self,
        local_hashes: &[u64],
        weights: &TierWeights,
        out: &mut OverlapScores,
    ) {
        let seed = self.hasher.seed();
        let mut prev = None;
        self.scan(
            local_hashes.iter().map(|&l| {
                let s = match prev {
                    None => l,
                    Some(p) => chain(p, l, seed),
                };
                prev = Some(s);
                s
            }),
            &weights.as_array(),
            out,
        );
    }

    /// [`Self::find_matches`] for already chained **sequence** hashes.
    pub fn find_matches_seq(&self, seq_hashes: &[u64]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_seq_into(seq_hashes, &mut out);
        out
    }

    /// [`Self::find_matches_seq`] into the caller's storage.
    pub fn find_matches_seq_into(&self, seq_hashes: &[u64], out: &mut OverlapScores) {
        self.scan(
            seq_hashes.iter().copied(),
            &TierWeights::default().as_array(),
            out,
        );
    }

    /// [`Self::find_matches`] straight from tokens, hashed with this index's hasher. Blocks
    /// past the point where no worker matches are not hashed at all.
    pub fn find_matches_tokens(&self, tokens: &[u32]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.find_matches_tokens_into(tokens, &mut out);
        out
    }

    /// [`Self::find_matches_tokens`] into the caller's storage.
    pub fn find_matches_tokens_into(&self, tokens: &[u32], out: &mut OverlapScores) {
        let seed = self.hasher.seed();
        let mut prev = None;
        self.scan(
            tokens.chunks_exact(self.hasher.block_size()).map(|b| {
                let l = hash_u32s(b, seed);
                let s = match prev {
                    None => l,
                    Some(p) => chain(p, l, seed),
                };
                prev = Some(s);
                s
            }),
            &TierWeights::default().as_array(),
            out,
        );
    }

    /// The lookup proper: lock-free, no shared writes, no allocation beyond `out`'s storage.
    ///
    /// Three modes, each entered at most once and in this order, because each handles a
    /// superset of the holder forms of the previous one:
    ///
    /// 1. **small bitset**: while every block's holders are in the inline bitset form (holders
    ///    in slots 0..58 sharing one tier mask, the common case) the active workers are one
    ///    `u64`, and their per-tier runs and weight one shared state;
    /// 2. **wide bitset**: while the active workers hold each block in one shared tier mask,
    ///    they are a bitset over the slot range they span, intersected word by word with dense
    ///    sets (or bit by bit with pairs and sparse sets), still with one shared state;
    /// 3. **list**: otherwise, a sorted list of active workers with their own per-tier runs,
    ///    merged with each block's sorted holders.
    fn scan(
        &self,
        seqs: impl Iterator<Item = u64>,
        weights: &[f64; TIERS],
        out: &mut OverlapScores,
    ) {
        out.entries.clear();
        let guard = reclaim::pin();
        // Order matters: slot names first, then the table (module docs, "Worker slots").
        let names = self.names.load(&guard);
        let table = self.load_table(&guard);
        let mut seqs = seqs;
        let mut depth = 0usize;
        let mut active = u64::MAX;
        let mut shared = Shared::new();
        let mut pending = None;
        for seq in seqs.by_ref() {
            let word = table.word(seq);
            let Some((m, held)) = bits_of(word) else {
                pending = Some(word);
                break;
            };
            let bits = held & active;
            if bits != active {
                if depth > 0 {
                    out.push_bits(names, 0, active & !bits, depth, &shared);
                }
                active = bits;
                if bits == 0 {
                    break;
                }
            }
            shared.step(m, depth, weights);
            depth += 1;
        }
        match pending {
            Some(word) => Self::scan_wide(
                names,
                table,
                &guard,
                decode(word, &guard),
                active,
                depth,
                shared,
                seqs,
                weights,
                out,
            ),
            None if depth > 0 => out.push_bits(names, 0, active, depth, &shared),
            None => {}
        }
        drop(guard);
        out.entries.sort_unstable_by_key(|e| e.worker);
    }

    /// Modes 2 and 3 of [`Self::scan`], from the block whose holders are `first`, at `depth`
    /// leading blocks matched by the slots of `active` with state `shared` (`depth == 0`: none
    /// yet, `first` is the request's first block).
    #[allow(clippy::too_many_arguments)]
    fn scan_wide(
        names: &SlotNames,
        table: &Table,
        guard: &Guard,
        first: Holders<'_>,
        active: u64,
        mut depth: usize,
        mut shared: Shared,
        mut seqs: impl Iterator<Item = u64>,
        weights: &[f64; TIERS],
        out: &mut OverlapScores,
    ) {
        let mut wide = Wide {
            words: core::mem::take(&mut out.wide),
            next: core::mem::take(&mut out.next),
            off: 0,
            lo: 0,
            hi: 0,
        };
        wide.words.clear();
        // The holders at which the scan must switch to list mode, if it must.
        let mut to_list = None;
        if depth == 0 {
            match uniform_mask(first) {
                Some(m) => {
                    // `first` is a pair or an out-of-line set, so it has a holder.
                    let mut min = u32::MAX;
                    let mut max = 0;
                    for_each_holder(first, |slot, _| {
                        min = min.min(slot);
                        max = max.max(slot);
                    });
                    wide.off = min as usize / 64;
                    wide.lo = wide.off;
                    wide.hi = max as usize / 64 + 1;
                    wide.words.resize(wide.hi - wide.off, 0);
                    let (off, words) = (wide.off, &mut wide.words);
                    for_each_holder(first, |slot, _| {
                        words[slot as usize / 64 - off] |= 1 << (slot % 64);
                    });
                    shared.step(m, 0, weights);
                    depth = 1;
                }
                None => {
                    Self::scan_list(
                        names,
                        table,
                        guard,
                        Vec::new(),
                        first,
                        0,
                        seqs,
                        weights,
                        out,
                    );
                    wide.words.clear();
                    out.wide = wide.words;
                    out.next = wide.next;
                    return;
                }
            }
        } else {
            wide.words.push(active);
            wide.hi = 1;
            match wide.step(names, first, depth, &shared, out) {
                Some((true, m)) => {
                    shared.step(m, depth, weights);
                    depth += 1;
                }
                Some((false, _)) => {}
                None => to_list = Some(first),
            }
        }
        if to_list.is_none() && wide.lo < wide.hi {
            for seq in seqs.by_ref() {
                let h = decode(table.word(seq), guard);
                match wide.step(names, h, depth, &shared, out) {
                    Some((true, m)) => {
                        shared.step(m, depth, weights);
                        depth += 1;
                    }
                    Some((false, _)) => break,
                    None => {
                        to_list = Some(h);
                        break;
                    }
                }
            }
        }
        match to_list {
            Some(h) => {
                let mut list = core::mem::take(&mut out.active);
                list.clear();
                for k in wide.lo..wide.hi {
                    let mut bits = wide.words[k - wide.off];
                    while bits != 0 {
                        list.push(shared.active((k * 64) as u32 + bits.trailing_zeros(), depth));
                        bits &= bits - 1;
                    }
                }
                Self::scan_list(names, table, guard, list, h, depth, seqs, weights, out);
            }
            None => {
                for k in wide.lo..wide.hi {
                    out.push_bits(names, k, wide.words[k - wide.off], depth, &shared);
                }
            }
        }
        wide.words.clear();
        out.wide = wide.words;
        out.next = wide.next;
    }

    /// Mode 3 of [`Self::scan`]: `list` holds the workers matching `depth` leading blocks
    /// (`depth == 0`: none yet, `first` is the request's first block), `first` the holders of
    /// the block at `depth`.
    #[allow(clippy::too_many_arguments)]
    fn scan_list(
        names: &SlotNames,
        table: &Table,
        guard: &Guard,
        mut list: Vec<Active>,
        first: Holders<'_>,
        mut depth: usize,
        seqs: impl Iterator<Item = u64>,
        weights: &[f64; TIERS],
        out: &mut OverlapScores,
    ) {
        let best = best_weights(weights);
        if depth == 0 {
            list.clear();
            for_each_holder(first, |slot, run| {
                list.push(Active {
                    slot,
                    run,
                    lead: [0; TIERS],
                    weighted: best[run as usize],
                })
            });
            depth = 1;
        } else {
            Self::step(names, &mut list, first, depth, &best, out);
            if !list.is_empty() {
                depth += 1;
            }
        }
        if !list.is_empty() {
            for seq in seqs {
                let h = decode(table.word(seq), guard);
                Self::step(names, &mut list, h, depth, &best, out);
                if list.is_empty() {
                    break;
                }
                depth += 1;
            }
        }
        for a in &list {
            out.push_active(names, a, depth);
        }
        list.clear();
        out.active = list;
    }

    /// Intersects the active workers with the holders `h` of the block at `depth` (0-based):
    /// workers that do not hold it end with `depth` blocks.
    #[inline]
    fn step(
        names: &SlotNames,
        list: &mut Vec<Active>,
        h: Holders<'_>,
        depth: usize,
        best: &BestWeights,
        out: &mut OverlapScores,
    ) {
        let mut from = 0usize;
        let mut keep = 0usize;
        for i in 0..list.len() {
            let mut a = list[i];
            let tiers = tiers_in(h, a.slot, &mut from);
            if tiers == 0 {
                out.push_active(names, &a, depth);
                continue;
            }
            let dropped = a.run & !tiers;
            if dropped != 0 {
                for (t, lead) in a.lead.iter_mut().enumerate() {
                    if dropped & (1 << t) != 0 {
                        *lead = depth;
                    }
                }
                a.run &= tiers;
            }
            a.weighted += best[tiers as usize];
            list[keep] = a;
            keep += 1;
        }
        list.truncate(keep);
    }
}
