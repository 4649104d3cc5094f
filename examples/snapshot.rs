//! Saves a W1 tree and a W4 block index to a file and restores them, printing sizes and rates
//! (issue 17 figures: snapshot size ÷ heap size, write MB/s, restore MB/s, restore time ÷
//! rebuilding by re-inserting the prompts / re-applying the `Stored` events).
//!
//! ```text
//! cargo run --release --example snapshot -- [--file PATH] [--best 3]
//! ```
//!
//! `--file PATH` is where the snapshots are written (the W1 tree's, then the W4 index's, each
//! overwriting the last) and kept; without it, a file in the temporary directory that is
//! removed at the end. Prints a table and one JSON line per figure. Compare ratios from one
//! run.

use kvtrie::blocks::{BlockHasher, BlockIndex, StoredBlock, WorkerId};
use kvtrie::workload::{ChatWorkload, KvWorkload};
use kvtrie::{PrefixTree, TenantId};
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::Path;
use std::time::Instant;

/// Ends the program with `msg` (an I/O or snapshot error: a message, not a panic).
fn fail(msg: String) -> ! {
    eprintln!("snapshot: {msg}");
    std::process::exit(1)
}

fn create(path: &Path) -> BufWriter<File> {
    BufWriter::new(File::create(path).unwrap_or_else(|e| fail(format!("{}: {e}", path.display()))))
}

fn open(path: &Path) -> BufReader<File> {
    BufReader::new(File::open(path).unwrap_or_else(|e| fail(format!("{}: {e}", path.display()))))
}

fn main() {
    let mut path = std::env::temp_dir().join(format!("kvtrie-w1-{}.snapshot", std::process::id()));
    let mut keep = false;
    let mut best = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--file", Some(p)) if !p.is_empty() => (path, keep) = (p.into(), true),
            ("--best", Some(n)) if n.parse::<usize>().is_ok_and(|n| (1..=1000).contains(&n)) => {
                best = n.parse().expect("checked above")
            }
            _ => {
                eprintln!("usage: snapshot [--file PATH] [--best N, 1 to 1000]");
                std::process::exit(2);
            }
        }
    }
    // Fail before building anything if the file cannot be written.
    drop(create(&path));
    let w = ChatWorkload::w1(0);
    let build = || {
        let tree = PrefixTree::new();
        let ids: Vec<TenantId> = w.tenants.iter().map(|n| tree.add_tenant(n)).collect();
        for (i, p) in w.prompts.iter().enumerate() {
            tree.insert_at(p, ids[i % ids.len()], i as u64).unwrap();
        }
        tree
    };
    // Rebuilding by re-inserting: what a restart without a snapshot costs.
    let mut rebuild = f64::MAX;
    let mut tree = None;
    for _ in 0..best {
        let t0 = Instant::now();
        let t = build();
        rebuild = rebuild.min(t0.elapsed().as_secs_f64());
        tree = Some(t);
    }
    let tree = tree.expect("built");
    let heap = tree.stats().heap_bytes;
    let (mut write, mut bytes) = (f64::MAX, 0u64);
    for _ in 0..best {
        let t0 = Instant::now();
        let s = tree
            .write_snapshot(create(&path))
            .unwrap_or_else(|e| fail(format!("writing {}: {e}", path.display())));
        write = write.min(t0.elapsed().as_secs_f64());
        bytes = s.bytes;
    }
    let mut restore = f64::MAX;
    for _ in 0..best {
        let t0 = Instant::now();
        let back = PrefixTree::read_snapshot(open(&path))
            .unwrap_or_else(|e| fail(format!("reading {}: {e}", path.display())));
        restore = restore.min(t0.elapsed().as_secs_f64());
        assert_eq!(back.node_count(), tree.node_count());
        assert_eq!(back.distinct_chars(), tree.distinct_chars());
    }
    let back = PrefixTree::read_snapshot(open(&path))
        .unwrap_or_else(|e| fail(format!("reading {}: {e}", path.display())));
    back.check_invariants().expect("restored tree is valid");
    assert_eq!(back.snapshot(), tree.snapshot());
    let mb = bytes as f64 / 1e6;
    println!(
        "W1 tree: {} nodes, {:.1} MB heap; snapshot {} ({:.1} MB), best of {best}",
        tree.node_count(),
        heap as f64 / 1e6,
        path.display(),
        mb
    );
    let figs = [
        (
            "w1_snapshot_bytes_over_heap",
            bytes as f64 / heap as f64,
            "ratio",
        ),
        ("w1_snapshot_write_mb_per_s", mb / write, "MB/s"),
        ("w1_snapshot_restore_mb_per_s", mb / restore, "MB/s"),
        ("w1_snapshot_write_ms", write * 1e3, "ms"),
        ("w1_snapshot_restore_ms", restore * 1e3, "ms"),
        ("w1_rebuild_by_reinserting_ms", rebuild * 1e3, "ms"),
        ("w1_restore_over_rebuild", restore / rebuild, "ratio"),
    ];
    let mut figs = figs.to_vec();
    figs.extend(w4(&path, best));
    println!("{:<36} {:>12} unit", "figure", "value");
    for &(name, v, unit) in &figs {
        println!("{name:<36} {v:>12.3} {unit}");
    }
    for &(name, v, unit) in &figs {
        println!("{{\"figure\":\"{name}\",\"value\":{v:.4},\"unit\":\"{unit}\"}}");
    }
    if !keep {
        let _ = std::fs::remove_file(&path);
    }
}

/// The W4 index: request `i` stored on worker `i % 16` as one `Stored` event chaining its
/// full blocks (engine hash = sequence hash). Rebuilding re-applies those events (their local
/// hashes computed beforehand: the rebuild time excludes hashing tokens).
fn w4(path: &Path, best: usize) -> Vec<(&'static str, f64, &'static str)> {
    let w = KvWorkload::w4(0);
    let hasher = BlockHasher::new(w.block_size);
    let events: Vec<Vec<StoredBlock>> = w
        .requests
        .iter()
        .map(|r| {
            let local = hasher.local_hashes(r);
            let seq = hasher.chain_local(&local);
            local
                .iter()
                .zip(&seq)
                .map(|(&l, &s)| StoredBlock {
                    engine_hash: s,
                    local_hash: l,
                })
                .collect()
        })
        .collect();
    let build = || {
        let index = BlockIndex::with_hasher(&hasher);
        for (i, blocks) in events.iter().enumerate() {
            index
                .store_blocks(WorkerId((i % 16) as u64), None, blocks)
                .expect("a W4 event applies");
        }
        index
    };
    let mut rebuild = f64::MAX;
    let mut index = None;
    for _ in 0..best {
        let t0 = Instant::now();
        let i = build();
        rebuild = rebuild.min(t0.elapsed().as_secs_f64());
        index = Some(i);
    }
    let index = index.expect("built");
    index.collect_garbage();
    let heap = index.heap_bytes();
    let (mut write, mut bytes) = (f64::MAX, 0u64);
    for _ in 0..best {
        let t0 = Instant::now();
        let s = index
            .write_snapshot(create(path))
            .unwrap_or_else(|e| fail(format!("writing {}: {e}", path.display())));
        write = write.min(t0.elapsed().as_secs_f64());
        bytes = s.bytes;
    }
    let mut restore = f64::MAX;
    for _ in 0..best {
        let t0 = Instant::now();
        let back = BlockIndex::read_snapshot(open(path))
            .unwrap_or_else(|e| fail(format!("reading {}: {e}", path.display())));
        restore = restore.min(t0.elapsed().as_secs_f64());
        assert_eq!(back.total_blocks(), index.total_blocks());
        assert_eq!(back.distinct_blocks(), index.distinct_blocks());
    }
    let back = BlockIndex::read_snapshot(open(path))
        .unwrap_or_else(|e| fail(format!("reading {}: {e}", path.display())));
    back.check_invariants().expect("restored index is valid");
    let restored_heap = back.heap_bytes();
    for r in w.requests.iter().step_by(97) {
        assert_eq!(back.find_matches_tokens(r), index.find_matches_tokens(r));
    }
    let mb = bytes as f64 / 1e6;
    println!(
        "W4 index: {} workers, {} (worker, block) entries, {} distinct blocks, {:.1} MB heap; \
         snapshot {:.1} MB, best of {best}",
        index.workers().len(),
        index.total_blocks(),
        index.distinct_blocks(),
        heap as f64 / 1e6,
        mb
    );
    vec![
        (
            "w4_snapshot_bytes_over_heap",
            bytes as f64 / heap as f64,
            "ratio",
        ),
        ("w4_snapshot_write_mb_per_s", mb / write, "MB/s"),
        ("w4_snapshot_restore_mb_per_s", mb / restore, "MB/s"),
        ("w4_snapshot_write_ms", write * 1e3, "ms"),
        ("w4_snapshot_restore_ms", restore * 1e3, "ms"),
        ("w4_rebuild_by_reapplying_ms", rebuild * 1e3, "ms"),
        ("w4_restore_over_rebuild", restore / rebuild, "ratio"),
        (
            "w4_restored_heap_over_original",
            restored_heap as f64 / heap as f64,
            "ratio",
        ),
    ]
}
