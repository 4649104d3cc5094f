//! Differential fuzzing of `BlockIndex` against a plain `HashMap` model written here.
//!
//! The fuzz input is decoded with `arbitrary` into a sequence of per-worker KV events
//! (`Stored` with or without a parent, `Removed`, `Cleared`), `remove_worker` calls and
//! lookups, over 4 workers, 8 engine hashes and 6 local hashes (so engine ids get reused for
//! other content, duplicate stores happen, and chains share prefixes). Every result is
//! compared with the model:
//!
//! - the model keeps, per known worker, `engine hash → sequence hash`; a worker holds a
//!   sequence hash while at least one of its engine hashes maps to it;
//! - `Stored`: an unknown parent is an error and stores nothing; otherwise each block's
//!   sequence hash chains from the previous one (`BlockHasher::chain`); storing an existing
//!   mapping is a no-op; an engine hash stored again with other content moves;
//! - `find_matches(local)`: for every worker, the number of *leading* request blocks it holds
//!   (workers with 0 are absent);
//! - block counts, distinct blocks, known workers and the event counters (`stats()`).
//!
//! Run: `cd fuzz && cargo +nightly fuzz run block_index_ops -- -max_total_time=60` (one hour:
//! `-max_total_time=3600`). Seeds live in `fuzz/corpus/block_index_ops/`.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use kvtrie::blocks::IndexStats;
use kvtrie::{BlockIndex, EventError, KvEvent, StoredBlock, WorkerId};
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
        parent: Option<u8>,
        blocks: Vec<(u8, u8)>,
    },
    Removed {
        worker: u8,
        engine: Vec<u8>,
    },
    Cleared {
        worker: u8,
    },
    RemoveWorker {
        worker: u8,
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

#[derive(Default)]
struct Model {
    workers: BTreeMap<WorkerId, HashMap<u64, u64>>,
    stats: IndexStats,
}

impl Model {
    fn holds(&self, w: WorkerId, seq: u64) -> bool {
        self.workers[&w].values().any(|&s| s == seq)
    }

    fn store(
        &mut self,
        index: &BlockIndex,
        w: WorkerId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        let mut prev = match parent {
            None => None,
            Some(p) => match self.workers.get(&w).and_then(|m| m.get(&p)) {
                Some(&s) => Some(s),
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
        for b in blocks {
            let seq = match prev {
                None => b.local_hash,
                Some(p) => index.hasher().chain(p, b.local_hash),
            };
            prev = Some(seq);
            if map.insert(b.engine_hash, seq) != Some(seq) {
                self.stats.blocks_stored += 1;
            }
        }
        Ok(())
    }

    fn remove(&mut self, w: WorkerId, engine: &[u64]) {
        self.stats.events_applied += 1;
        let Some(map) = self.workers.get_mut(&w) else {
            self.stats.unknown_removes += engine.len() as u64;
            return;
        };
        for e in engine {
            if map.remove(e).is_some() {
                self.stats.blocks_removed += 1;
            } else {
                self.stats.unknown_removes += 1;
            }
        }
    }

    fn clear(&mut self, w: WorkerId) {
        self.stats.events_applied += 1;
        if let Some(map) = self.workers.get_mut(&w) {
            map.clear();
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

    fn find(&self, index: &BlockIndex, locals: &[u64]) -> Vec<(WorkerId, usize)> {
        let seqs = index.hasher().chain_local(locals);
        self.workers
            .keys()
            .map(|&w| (w, seqs.iter().take_while(|&&s| self.holds(w, s)).count()))
            .filter(|x| x.1 > 0)
            .collect()
    }

    fn distinct(&self) -> usize {
        self.workers
            .values()
            .flat_map(|m| m.values().copied())
            .collect::<BTreeSet<u64>>()
            .len()
    }
}

fn run(ops: &[Op]) {
    let index = BlockIndex::new();
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Stored {
                worker,
                parent,
                blocks,
            } => {
                let w = WorkerId(u64::from(worker % WORKERS));
                let parent = parent.map(engine);
                let blocks: Vec<StoredBlock> = blocks
                    .iter()
                    .take(6)
                    .map(|&(e, l)| StoredBlock {
                        engine_hash: engine(e),
                        local_hash: local(l),
                    })
                    .collect();
                let want = model.store(&index, w, parent, &blocks);
                let got = index.apply(w, KvEvent::Stored { parent, blocks });
                assert_eq!(got, want, "{op:?}");
            }
            Op::Removed { worker, engine: e } => {
                let w = WorkerId(u64::from(worker % WORKERS));
                let hashes: Vec<u64> = e.iter().take(6).map(|&x| engine(x)).collect();
                model.remove(w, &hashes);
                index
                    .apply(
                        w,
                        KvEvent::Removed {
                            engine_hashes: hashes,
                        },
                    )
                    .unwrap();
            }
            Op::Cleared { worker } => {
                let w = WorkerId(u64::from(worker % WORKERS));
                model.clear(w);
                index.apply(w, KvEvent::Cleared).unwrap();
            }
            Op::RemoveWorker { worker } => {
                let w = WorkerId(u64::from(worker % WORKERS));
                assert_eq!(index.remove_worker(w), model.remove_worker(w), "{op:?}");
            }
            Op::Find { local: l } => {
                let locals: Vec<u64> = l.iter().take(8).map(|&x| local(x)).collect();
                let want = model.find(&index, &locals);
                let got: Vec<(WorkerId, usize)> = index.find_matches(&locals).iter().collect();
                assert_eq!(got, want, "{op:?}");
                let seqs = index.hasher().chain_local(&locals);
                let by_seq: Vec<(WorkerId, usize)> = index.find_matches_seq(&seqs).iter().collect();
                assert_eq!(by_seq, want, "find_matches_seq {op:?}");
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
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    run(&ops);
});
