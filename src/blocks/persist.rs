//! Snapshots of a [`BlockIndex`]: written live, restored into a new index.
//!
//! # Payload (kind 2, see [`crate::snapshot`] for the framing)
//!
//! | record | tag | payload |
//! |---|---|---|
//! | meta | 1 | block size (`u64`), seed (`u64`), then the eight [`IndexStats`] counters (`u64` each, in field order: events applied, blocks stored, blocks removed, unknown parents, unknown removes, rejected workers, duplicate copies, copies saturated) |
//! | worker | 2 | the [`WorkerId`] (`u64`: engine in the low 48 bits, data-parallel rank in the high 16) |
//! | GPU blocks | 3 | 1 to 4,096 × (engine hash `u64`, sequence hash `u64`): blocks the worker holds as exactly one GPU copy |
//! | blocks with copies | 4 | 1 to 4,096 × (engine hash `u64`, sequence hash `u64`, copies per tier `4 × u8`: GPU, CPU, disk, other) |
//!
//! One meta record, then per worker (in the order of its slot) one worker record followed by
//! the block records of its blocks: first those held once on the GPU (the common case, 16
//! bytes a block), in ascending engine-hash order, then the others (several copies, or tiers
//! other than the GPU), in ascending engine-hash order. A worker that holds no block has a
//! worker record and no block record.
//!
//! The index keeps, per worker, engine hash → sequence hash (the chained hash already encodes
//! the block's whole prefix, so no parent link is stored) and copies per tier; everything else
//! it holds (the shared table's holders per sequence hash and tier, the sequence hashes
//! several engine hashes of one worker map to, the block counters) follows from that and is
//! rebuilt on restore. Worker slots are not stored: a restored index numbers its workers
//! densely in the order written, so a snapshot of the restored index has the same bytes.
//!
//! # Taken live
//!
//! [`BlockIndex::write_snapshot`] runs while other threads look up and apply events. It reads
//! the list of workers and the event counters at its start, with the worker registry held
//! exclusively (so no event is half-applied; events wait for that short read), then
//! each worker's blocks under that worker's lock, one worker at a time (the lock is released
//! before anything is written, so a worker's writer waits at most for its own maps to be
//! copied, and other workers' writers do not wait). Each worker's blocks in the
//! snapshot are therefore that worker's state at one moment during the snapshot: every event
//! applied (returned) before the snapshot started is in it; events concurrent with it may or
//! may not be (per worker, those up to that moment are). Workers added after the start are
//! not in it; workers removed before their turn are skipped. Since every event concerns one
//! worker, the result is always a state that applying the events could have produced, so a
//! restored index is consistent. The counters are those of the start.

use super::event::WorkerId;
use super::hash::BlockHasher;
use super::index::{BlockIndex, IndexStats, TierCopies};
use crate::snapshot::{Payload, SnapshotError, SnapshotKind, SnapshotReader, SnapshotWriter};
use std::io::{Read, Write};

const META: u8 = 1;
const WORKER: u8 = 2;
const GPU_BLOCKS: u8 = 3;
const COPY_BLOCKS: u8 = 4;

/// Most blocks in one block record.
const BATCH: usize = 4096;
/// Bytes of one entry of a GPU-blocks record.
const GPU_ENTRY: usize = 16;
/// Bytes of one entry of a blocks-with-copies record.
const COPY_ENTRY: usize = 20;

/// What [`BlockIndex::write_snapshot`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockSnapshotSummary {
    /// Bytes written.
    pub bytes: u64,
    /// Workers written.
    pub workers: u64,
    /// Blocks written: Σ over workers of the engine hashes each holds.
    pub blocks: u64,
}

fn stats_fields(s: &IndexStats) -> [u64; 8] {
    [
        s.events_applied,
        s.blocks_stored,
        s.blocks_removed,
        s.unknown_parents,
        s.unknown_removes,
        s.rejected_workers,
        s.duplicate_copies,
        s.copies_saturated,
    ]
}

impl BlockIndex {
    /// Writes a snapshot of the index to `out` (see [`crate::snapshot`] for the framing and
    /// the payload table below), streaming: besides the output, memory is bounded by the
    /// largest worker's blocks, not the index's size.
    ///
    /// | record | tag | payload |
    /// |---|---|---|
    /// | meta | 1 | block size `u64`, seed `u64`, the 8 [`IndexStats`] counters (`u64`, field order) |
    /// | worker | 2 | [`WorkerId`] `u64` |
    /// | GPU blocks | 3 | 1..=4096 × (engine hash `u64`, sequence hash `u64`), held once on the GPU |
    /// | blocks with copies | 4 | 1..=4096 × (engine hash `u64`, sequence hash `u64`, copies `[u8; 4]` per tier) |
    ///
    /// Meta first, then each worker (slot order) followed by its blocks, GPU blocks then the
    /// others, each group in ascending engine-hash order.
    ///
    /// **Taken live**: runs while other threads look up and apply events. It starts by
    /// reading the worker list and counters with the registry held exclusively (new events wait
    /// for the ones in flight to finish and for that read); then a worker's writer waits at most
    /// for its own blocks to be copied, and other workers' writers do not wait. Every event applied before the call started
    /// is in the snapshot; each worker's part is its state at one moment during the call
    /// (events concurrent with it may or may not be in it), so the snapshot is always a state
    /// the events could have produced. Workers added meanwhile are not in it.
    ///
    /// ```
    /// use kvtrie::blocks::{BlockIndex, KvEvent, StoredBlock, Tier, WorkerId};
    ///
    /// let index = BlockIndex::new();
    /// let blocks = vec![
    ///     StoredBlock { engine_hash: 1, local_hash: 10 },
    ///     StoredBlock { engine_hash: 2, local_hash: 20 },
    /// ];
    /// index.apply(WorkerId::new(3, 1), KvEvent::Stored { parent: None, blocks: blocks.clone() }).unwrap();
    /// index.apply_in(WorkerId(4), Tier::Cpu, KvEvent::Stored { parent: None, blocks }).unwrap();
    /// let mut bytes = Vec::new();
    /// let summary = index.write_snapshot(&mut bytes).unwrap();
    /// assert_eq!((summary.workers, summary.blocks), (2, 4));
    ///
    /// let restored = BlockIndex::read_snapshot(&bytes[..]).unwrap();
    /// assert_eq!(restored.find_matches(&[10, 20]), index.find_matches(&[10, 20]));
    /// assert_eq!(restored.find_matches(&[10]).get_tier(WorkerId(4), Tier::Cpu), 1);
    /// assert_eq!(restored.stats(), index.stats());
    /// ```
    pub fn write_snapshot<W: Write>(&self, out: W) -> Result<BlockSnapshotSummary, SnapshotError> {
        let (workers, stats) = self.snapshot_workers();
        let mut w = SnapshotWriter::new(out, SnapshotKind::BlockIndex)?;
        let p = w.payload();
        p.extend_from_slice(&(self.hasher().block_size() as u64).to_le_bytes());
        p.extend_from_slice(&self.hasher().seed().to_le_bytes());
        for x in stats_fields(&stats) {
            p.extend_from_slice(&x.to_le_bytes());
        }
        w.end_record(META)?;
        let mut summary = BlockSnapshotSummary::default();
        let (mut simple, mut multi) = (Vec::new(), Vec::new());
        for worker in workers {
            if !self.worker_blocks_into(worker, &mut simple, &mut multi) {
                continue; // removed since the start
            }
            simple.sort_unstable_by_key(|b| b.0);
            multi.sort_unstable_by_key(|b| b.0);
            summary.workers += 1;
            summary.blocks += (simple.len() + multi.len()) as u64;
            w.payload().extend_from_slice(&worker.0.to_le_bytes());
            w.end_record(WORKER)?;
            for chunk in simple.chunks(BATCH) {
                let p = w.payload();
                p.reserve(chunk.len() * GPU_ENTRY);
                for &(e, s) in chunk {
                    p.extend_from_slice(&e.to_le_bytes());
                    p.extend_from_slice(&s.to_le_bytes());
                }
                w.end_record(GPU_BLOCKS)?;
            }
            for chunk in multi.chunks(BATCH) {
                let p = w.payload();
                p.reserve(chunk.len() * COPY_ENTRY);
                for &(e, s, c) in chunk {
                    p.extend_from_slice(&e.to_le_bytes());
                    p.extend_from_slice(&s.to_le_bytes());
                    p.extend_from_slice(&c);
                }
                w.end_record(COPY_BLOCKS)?;
            }
        }
        let (bytes, _) = w.finish()?;
        summary.bytes = bytes;
        Ok(summary)
    }

    /// Restores an index from a snapshot written by [`write_snapshot`](Self::write_snapshot):
    /// the same hasher (block size, seed), workers, blocks with their copies per tier, and
    /// event counters, so it answers every lookup as the original did. Faster than replaying
    /// the events: no hashing, and each block is restored once, whatever its copies.
    ///
    /// Any malformed, truncated, damaged or hostile input is a [`SnapshotError`] naming what
    /// is wrong; restoring allocates in proportion to the bytes it has read, and never
    /// returns an index whose bookkeeping and table disagree.
    ///
    /// The restored index counts duplicate stores as copies: set
    /// [`BlockIndex::set_duplicate_stores`] again if the engines report reused blocks.
    pub fn read_snapshot<R: Read>(input: R) -> Result<BlockIndex, SnapshotError> {
        let mut r = SnapshotReader::new(input, SnapshotKind::BlockIndex)?;
        let pos = r.position();
        let rec = r
            .next_record()?
            .ok_or_else(|| invalid(None, "no meta record"))?;
        if rec.tag != META {
            return Err(invalid(
                Some(pos),
                "the first record is not the meta record",
            ));
        }
        let mut p = Payload::new(rec.payload, pos);
        let block_size = p.u64("the block size")?;
        let seed = p.u64("the seed")?;
        let mut f = [0u64; 8];
        for x in &mut f {
            *x = p.u64("the event counters")?;
        }
        p.end()?;
        let block_size = usize::try_from(block_size)
            .map_err(|_| p.invalid(format!("block size {block_size} does not fit a usize")))?;
        let hasher =
            BlockHasher::try_with_seed(block_size, seed).map_err(|e| p.invalid(e.to_string()))?;
        let index = BlockIndex::with_hasher(&hasher);
        index.restore_stats(IndexStats {
            events_applied: f[0],
            blocks_stored: f[1],
            blocks_removed: f[2],
            unknown_parents: f[3],
            unknown_removes: f[4],
            rejected_workers: f[5],
            duplicate_copies: f[6],
            copies_saturated: f[7],
        });
        let mut worker: Option<WorkerId> = None;
        let mut batch: Vec<(u64, u64, TierCopies)> = Vec::new();
        loop {
            let pos = r.position();
            let Some(rec) = r.next_record()? else {
                break;
            };
            let p = Payload::new(rec.payload, pos);
            match rec.tag {
                WORKER => {
                    let mut p = p;
                    let id = WorkerId(p.u64("the worker id")?);
                    p.end()?;
                    index.restore_worker(id).map_err(|e| p.invalid(e))?;
                    worker = Some(id);
                }
                GPU_BLOCKS | COPY_BLOCKS => {
                    let w = worker
                        .ok_or_else(|| p.invalid("a block record before any worker record"))?;
                    let entry = if rec.tag == GPU_BLOCKS {
                        GPU_ENTRY
                    } else {
                        COPY_ENTRY
                    };
                    let bytes = rec.payload;
                    if bytes.is_empty() || bytes.len() % entry != 0 || bytes.len() / entry > BATCH {
                        return Err(p.invalid(format!(
                            "a block record of {} bytes is not 1 to {BATCH} entries of {entry}",
                            bytes.len()
                        )));
                    }
                    let u64_at = |b: &[u8], i: usize| {
                        u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
                    };
                    batch.clear();
                    batch.extend(bytes.chunks_exact(entry).map(|b| {
                        let copies: TierCopies = if entry == GPU_ENTRY {
                            [1, 0, 0, 0]
                        } else {
                            b[16..20].try_into().expect("4 bytes")
                        };
                        (u64_at(b, 0), u64_at(b, 8), copies)
                    }));
                    index.restore_blocks(w, &batch).map_err(|e| p.invalid(e))?;
                }
                tag => return Err(p.invalid(format!("unexpected record tag {tag}"))),
            }
        }
        index.restore_finish();
        Ok(index)
    }
}

fn invalid(record: Option<u64>, reason: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid {
        record,
        reason: reason.into(),
    }
}
