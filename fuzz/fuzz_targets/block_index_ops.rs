//! Differential fuzzing of `BlockIndex` against a plain `HashMap` model written here.
//!
//! The fuzz input is decoded with `arbitrary` into a sequence of per-worker KV events in a
//! storage tier (`Stored` with or without a parent, `Removed`, `Cleared` of one tier or of
//! all), `remove_worker` calls and lookups, over 4 workers (some of them in worker slots past
//! the index's inline bitset), 8 engine hashes, 6 local hashes and 4 tiers (so engine ids get
//! reused for other content, duplicate copies happen, and chains share prefixes). Every
//! result is compared with the model:
//!
//! - the model keeps, per known worker, `engine hash → (sequence hash, copies per tier)`; a
//!   worker holds a sequence hash in a tier while one of its engine hashes that map to it has
//!   a copy there;
//! - `Stored` in tier `t`: an unknown parent (in any tier) is an error and stores nothing;
//!   otherwise each block's sequence hash chains from the previous one
//!   (`BlockHasher::chain`); storing an existing mapping adds a copy in `t` (up to
//!   `MAX_COPIES`); an engine hash stored again with other content moves (its copies reset);
//! - `Removed` in tier `t`: one copy fewer in `t`; the engine hash goes with its last copy
//!   (counted as a removed block then);
//! - `set_duplicate_stores`: with `Reports`, a GPU store of a mapping that has a GPU copy
//!   changes nothing;
//! - `find_matches(local)`: for every worker, the number of *leading* request blocks it holds
//!   in any tier and in each tier (workers with 0 are absent), and the tier-weighted sum;
//! - block counts, distinct blocks, known workers and the event counters (`stats()`).
//!
//! Run: `cd fuzz && cargo +nightly fuzz run block_index_ops -- -max_total_time=60` (one hour:
//! `-max_total_time=3600`). Seeds live in `fuzz/corpus/block_index_ops/`.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use kvtrie::blocks::{
    BlockIndex, DuplicateStores, EventError, IndexStats, KvEvent, StoredBlock, Tier, TierWeights,
    WorkerId, MAX_COPIES,
};
use libfuzzer_sys::fuzz_target;
use std::collections::{BTreeMap, BTreeSet, HashMap};

const WORKERS: u8 = 4;
const ENGINE: u8 = 8;
const LOCAL: u8 = 6;
const MAX_OPS: usize = 64;

#[derive(Arbitrary, Debug)]
enum Op {
    Stored {
        worker: u8,
        tier: u8,
        parent: Option<u8>,
        blocks: Vec<(u8, u8)>,
    },
    Removed {
        worker: u8,
        tier: u8,
        engine: Vec<u8>,
    },
    /// `tier: None`: `apply(Cleared)`, every tier.
    Cleared {
        worker: u8,
        tier: Option<u8>,
    },
    RemoveWorker {
        worker: u8,
    },
    /// `true`: `DuplicateStores::Reports`.
    SetDuplicateStores {
        reports: bool,
    },
    Find {
        local: Vec<u8>,
    },
}

/// Local hashes spread over the u64 range (small ids would make the chained hashes of a
/// request collide with local ones only by accident, like real hashes).
fn local(l: u8) -> u64 {
    0x9E37_79B9_7F4A_7C15u64.wrapping_mul(u64::from(l % LOCAL) + 1)
}

fn engine(e: u8) -> u64 {
    u64::from(e % ENGINE) + 100
}

fn tier(t: u8) -> Tier {
    Tier::ALL[usize::from(t) % 4]
}

/// Per worker: engine hash → (sequence hash, copies per tier).
type Held = HashMap<u64, (u64, [u32; 4])>;

#[derive(Default)]
struct Model {
    workers: BTreeMap<WorkerId, Held>,
    stats: IndexStats,
    /// `DuplicateStores::Reports` is set.
    reports: bool,
}

impl Model {
    fn tiers_of(&self, w: WorkerId, seq: u64) -> [bool; 4] {
        let mut t = [false; 4];
        for &(s, c) in self.workers[&w].values() {
            if s == seq {
                for k in 0..4 {
                    t[k] |= c[k] > 0;
                }
            }
        }
        t
    }

    fn store(
        &mut self,
        index: &BlockIndex,
        w: WorkerId,
        t: Tier,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        let mut prev = match parent {
            None => None,
            Some(p) => match self.workers.get(&w).and_then(|m| m.get(&p)) {
                Some(&(s, _)) => Some(s),
                None => {
                    self.stats.unknown_parents += 1;
                    return Err(EventError::UnknownParent {
                        worker: w,
                        parent: p,
                    });
                }
            },
        };
        self.stats.events_applied += 1;
        if blocks.is_empty() {
            return Ok(());
        }
        let map = self.workers.entry(w).or_default();
        let k = t.index();
        for b in blocks {
            let seq = match prev {
                None => b.local_hash,
                Some(p) => index.hasher().chain(p, b.local_hash),
            };
            prev = Some(seq);
            match map.get_mut(&b.engine_hash) {
                Some(e) if e.0 == seq && self.reports && k == 0 && e.1[0] > 0 => {}
                Some(e) if e.0 == seq => {
                    if e.1[k] == u32::from(MAX_COPIES) {
                        self.stats.copies_saturated += 1;
                    } else {
                        if e.1[k] > 0 {
                            self.stats.duplicate_copies += 1;
                        }
                        e.1[k] += 1;
                    }
                }
                Some(e) => {
                    *e = (seq, [0; 4]);
                    e.1[k] = 1;
                    self.stats.blocks_stored += 1;
                }
                None => {
                    let mut c = [0; 4];
                    c[k] = 1;
                    map.insert(b.engine_hash, (seq, c));
                    self.stats.blocks_stored += 1;
                }
            }
        }
        Ok(())
    }

    fn remove(&mut self, w: WorkerId, t: Tier, engine: &[u64]) {
        self.stats.events_applied += 1;
        let Some(map) = self.workers.get_mut(&w) else {
            self.stats.unknown_removes += engine.len() as u64;
            return;
        };
        let k = t.index();
        for e in engine {
            match map.get_mut(e) {
                Some(x) if x.1[k] > 0 => {
                    x.1[k] -= 1;
                    if x.1 == [0; 4] {
                        map.remove(e);
                        self.stats.blocks_removed += 1;
                    }
                }
                _ => self.stats.unknown_removes += 1,
            }
        }
    }

    fn clear(&mut self, w: WorkerId, t: Option<Tier>) {
        self.stats.events_applied += 1;
        if let Some(map) = self.workers.get_mut(&w) {
            match t {
                None => map.clear(),
                Some(t) => {
                    for x in map.values_mut() {
                        x.1[t.index()] = 0;
                    }
                    map.retain(|_, x| x.1 != [0; 4]);
                }
            }
        }
    }

    fn remove_worker(&mut self, w: WorkerId) -> usize {
        match self.workers.remove(&w) {
            Some(map) => {
                self.stats.events_applied += 1;
                map.len()
            }
            None => 0,
        }
    }

    /// Per worker with a positive score: (worker, any-tier run, per-tier runs, weighted).
    fn find(
        &self,
        index: &BlockIndex,
        locals: &[u64],
        weights: &TierWeights,
    ) -> Vec<(WorkerId, usize, [usize; 4], f64)> {
        let seqs = index.hasher().chain_local(locals);
        let mut out = Vec::new();
        for &w in self.workers.keys() {
            let tiers: Vec<[bool; 4]> = seqs.iter().map(|&s| self.tiers_of(w, s)).collect();
            let n = tiers.iter().take_while(|t| t.contains(&true)).count();
            if n == 0 {
                continue;
            }
            let mut per = [0; 4];
            for (k, p) in per.iter_mut().enumerate() {
                *p = tiers.iter().take_while(|t| t[k]).count();
            }
            let weighted = tiers[..n]
                .iter()
                .map(|t| {
                    Tier::ALL
                        .iter()
                        .filter(|x| t[x.index()])
                        .map(|&x| weights.weight(x))
                        .fold(f64::NEG_INFINITY, f64::max)
                })
                .sum();
            out.push((w, n, per, weighted));
        }
        out
    }

    fn distinct(&self) -> usize {
        self.workers
            .values()
            .flat_map(|m| m.values().map(|x| x.0))
            .collect::<BTreeSet<u64>>()
            .len()
    }
}

/// A fuzzed worker (4 of them). With `many`, 70 filler workers register first, so the fuzzed
/// ones get slots past the inline bitset and holder sets take every form.
fn worker(w: u8) -> WorkerId {
    WorkerId::new(u64::from(w % WORKERS), 0)
}

fn run(ops: &[Op], many: bool) {
    let index = BlockIndex::new();
    let mut model = Model::default();
    if many {
        for f in 0..70u64 {
            let b = [StoredBlock {
                engine_hash: 1,
                local_hash: 7 + f,
            }];
            let wf = WorkerId::new(1_000 + f, 1);
            model.store(&index, wf, Tier::Gpu, None, &b).unwrap();
            index.store_blocks(wf, None, &b).unwrap();
        }
    }
    let weights = TierWeights {
        gpu: 0.9,
        cpu: 1.0,
        disk: 0.25,
        other: 0.5,
    };
    for op in ops {
        match op {
            Op::Stored {
                worker: wk,
                tier: t,
                parent,
                blocks,
            } => {
                let w = worker(*wk);
                let parent = parent.map(engine);
                let blocks: Vec<StoredBlock> = blocks
                    .iter()
                    .take(6)
                    .map(|&(e, l)| StoredBlock {
                        engine_hash: engine(e),
                        local_hash: local(l),
                    })
                    .collect();
                let want = model.store(&index, w, tier(*t), parent, &blocks);
                let got = index.apply_in(w, tier(*t), KvEvent::Stored { parent, blocks });
                assert_eq!(got, want, "{op:?}");
            }
            Op::Removed {
                worker: wk,
                tier: t,
                engine: e,
            } => {
                let w = worker(*wk);
                let hashes: Vec<u64> = e.iter().take(6).map(|&x| engine(x)).collect();
                model.remove(w, tier(*t), &hashes);
                index
                    .apply_in(
                        w,
                        tier(*t),
                        KvEvent::Removed {
                            engine_hashes: hashes,
                        },
                    )
                    .unwrap();
            }
            Op::Cleared { worker: wk, tier: t } => {
                let w = worker(*wk);
                model.clear(w, t.map(tier));
                match t {
                    None => index.apply(w, KvEvent::Cleared).unwrap(),
                    Some(t) => index.apply_in(w, tier(*t), KvEvent::Cleared).unwrap(),
                }
            }
            Op::SetDuplicateStores { reports } => {
                model.reports = *reports;
                index.set_duplicate_stores(if *reports {
                    DuplicateStores::Reports
                } else {
                    DuplicateStores::Copies
                });
            }
            Op::RemoveWorker { worker: wk } => {
                let w = worker(*wk);
                assert_eq!(index.remove_worker(w), model.remove_worker(w), "{op:?}");
            }
            Op::Find { local: l } => {
                let locals: Vec<u64> = l.iter().take(8).map(|&x| local(x)).collect();
                let want = model.find(&index, &locals, &weights);
                let got = index.find_matches_weighted(&locals, &weights);
                let got_v: Vec<(WorkerId, usize, [usize; 4])> = got
                    .overlaps()
                    .map(|(w, o)| (w, o.blocks, o.per_tier))
                    .collect();
                let want_v: Vec<(WorkerId, usize, [usize; 4])> =
                    want.iter().map(|&(w, n, p, _)| (w, n, p)).collect();
                assert_eq!(got_v, want_v, "{op:?}");
                for &(w, _, _, weighted) in &want {
                    let g = got.weighted(w);
                    assert!((g - weighted).abs() < 1e-9, "weighted {g} vs {weighted} {op:?}");
                }
                let seqs = index.hasher().chain_local(&locals);
                let by_seq: Vec<(WorkerId, usize)> = index.find_matches_seq(&seqs).iter().collect();
                let want_any: Vec<(WorkerId, usize)> =
                    want.iter().map(|&(w, n, _, _)| (w, n)).collect();
                assert_eq!(by_seq, want_any, "find_matches_seq {op:?}");
            }
        }
        for (&w, map) in &model.workers {
            assert_eq!(
                index.block_count(w),
                map.len(),
                "blocks of {w:?} after {op:?}"
            );
        }
        let total: usize = model.workers.values().map(|m| m.len()).sum();
        assert_eq!(index.total_blocks(), total, "total after {op:?}");
        assert_eq!(
            index.distinct_blocks(),
            model.distinct(),
            "distinct after {op:?}"
        );
        assert_eq!(
            index.workers(),
            model.workers.keys().copied().collect::<Vec<_>>(),
            "workers after {op:?}"
        );
        assert_eq!(index.stats(), model.stats, "stats after {op:?}");
    }
    // Removing every worker empties the index.
    for w in model.workers.keys().copied().collect::<Vec<_>>() {
        model.remove_worker(w);
        index.remove_worker(w);
    }
    assert_eq!(index.total_blocks(), 0);
    assert_eq!(index.distinct_blocks(), 0);
    assert!(index.find_matches(&[local(0), local(1)]).is_empty());
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let many = u.arbitrary::<bool>().unwrap_or(false);
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    run(&ops, many);
});
