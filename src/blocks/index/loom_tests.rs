//! Model checks of the reader/writer protocol: `RUSTFLAGS="--cfg loom --cfg crossbeam_loom"
//! LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib blocks::index::loom_tests`.

use super::BlockIndex;
use crate::blocks::event::{StoredBlock, WorkerId};
use crate::sync::{thread, Arc};

fn one(engine_hash: u64, local_hash: u64) -> [StoredBlock; 1] {
    [StoredBlock {
        engine_hash,
        local_hash,
    }]
}

/// A reader racing `remove_worker` + a new worker (which may get the recycled slot once the
/// writer's flushes end the grace period) never attributes one worker's block to the other.
#[test]
fn remove_worker_vs_reader() {
    loom::model(|| {
        let index = Arc::new(BlockIndex::new());
        index.store_blocks(WorkerId(1), None, &one(1, 10)).unwrap();
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                index.remove_worker(WorkerId(1));
                for _ in 0..2 {
                    index.collect_garbage();
                }
                index.store_blocks(WorkerId(2), None, &one(2, 20)).unwrap();
            })
        };
        let a = index.find_matches(&[10]);
        let b = index.find_matches(&[20]);
        assert_eq!(a.get(WorkerId(2)), 0, "{a:?}");
        assert_eq!(b.get(WorkerId(1)), 0, "{b:?}");
        writer.join().unwrap();
        assert!(index.find_matches(&[10]).is_empty());
        assert_eq!(index.find_matches(&[20]).get(WorkerId(2)), 1);
    });
}

/// A chain stored before the reader starts stays fully visible while the writer's inserts
/// fill the table and it is rebuilt (RCU swap + retire).
#[test]
fn reader_vs_rebuild() {
    loom::model(|| {
        let index = Arc::new(BlockIndex::new());
        let base: Vec<StoredBlock> = (1..=11)
            .map(|i| StoredBlock {
                engine_hash: i,
                local_hash: i * 1000,
            })
            .collect();
        index.store_blocks(WorkerId(1), None, &base).unwrap();
        let cap = index.table_cap();
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                // Two more keys: the second finds 12 of 16 slots used and rebuilds.
                let more: Vec<StoredBlock> = (1..=2)
                    .map(|i| StoredBlock {
                        engine_hash: i,
                        local_hash: 77 + i,
                    })
                    .collect();
                index.store_blocks(WorkerId(2), None, &more).unwrap();
            })
        };
        let locals: Vec<u64> = (1..=11).map(|i| i * 1000).collect();
        assert_eq!(index.find_matches(&locals).get(WorkerId(1)), 11);
        writer.join().unwrap();
        assert_ne!(index.table_cap(), cap, "the table was rebuilt");
        assert_eq!(index.find_matches(&locals).get(WorkerId(1)), 11);
        assert_eq!(index.find_matches(&[78, 79]).get(WorkerId(2)), 2);
    });
}
