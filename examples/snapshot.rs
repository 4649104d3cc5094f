//! Saves a W1 tree to a file and restores it, printing sizes and rates (issue figures: snapshot
//! size ÷ heap size, write MB/s, restore MB/s, restore time ÷ rebuilding by re-inserting).
//!
//! ```text
//! cargo run --release --example snapshot -- [--file PATH] [--best 3]
//! ```
//!
//! Prints a table and one JSON line per figure. Compare ratios from one run.

use kvtrie::workload::ChatWorkload;
use kvtrie::{PrefixTree, TenantId};
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::time::Instant;

fn main() {
    let mut path = std::env::temp_dir().join("kvtrie-w1.snapshot");
    let mut best = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--file", Some(p)) => path = p.into(),
            ("--best", Some(n)) => best = n.parse().unwrap_or(3).max(1),
            _ => {
                eprintln!("usage: snapshot [--file PATH] [--best N]");
                std::process::exit(2);
            }
        }
    }
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
        let f = File::create(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let s = tree.write_snapshot(BufWriter::new(f)).expect("write");
        write = write.min(t0.elapsed().as_secs_f64());
        bytes = s.bytes;
    }
    let mut restore = f64::MAX;
    for _ in 0..best {
        let t0 = Instant::now();
        let f = File::open(&path).expect("open");
        let back = PrefixTree::read_snapshot(BufReader::new(f)).expect("restore");
        restore = restore.min(t0.elapsed().as_secs_f64());
        assert_eq!(back.node_count(), tree.node_count());
        assert_eq!(back.distinct_chars(), tree.distinct_chars());
    }
    let back = PrefixTree::read_snapshot(BufReader::new(File::open(&path).unwrap())).unwrap();
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
    println!("{:<36} {:>12} unit", "figure", "value");
    for (name, v, unit) in figs {
        println!("{name:<36} {v:>12.3} {unit}");
    }
    for (name, v, unit) in figs {
        println!("{{\"figure\":\"{name}\",\"value\":{v:.4},\"unit\":\"{unit}\"}}");
    }
    let _ = std::fs::remove_file(&path);
}
