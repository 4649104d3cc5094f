//! Inspection: sizes, the retired backlog, snapshots and the invariant checker.

use super::raw::Node;
use super::{NodeSnapshot, PrefixTree, RetiredBacklog, TreeStats};
use crate::reclaim;
use crate::sync::Ordering;
use std::ptr;

/// Node ids [`PrefixTree::stats`] scans under one pin (three under miri and loom, so that
/// their tests and models cross chunk boundaries).
#[cfg(not(any(miri, loom)))]
const STATS_CHUNK_IDS: u32 = 4096;
#[cfg(any(miri, loom))]
const STATS_CHUNK_IDS: u32 = 3;

impl PrefixTree {
    /// Nodes in the tree, not counting the root.
    pub fn node_count(&self) -> usize {
        self.store.slab.counts().nodes.max(0) as usize
    }

    /// Distinct chars stored (sum of edge lengths).
    pub fn distinct_chars(&self) -> usize {
        self.store.slab.counts().chars.max(0) as usize
    }

    /// Distinct bytes stored (sum of edge lengths in bytes).
    pub fn distinct_bytes(&self) -> usize {
        self.store.slab.counts().bytes.max(0) as usize
    }

    /// Size figures, computed by a scan of every node, lock-free: O(the highest node id handed
    /// out, about the most nodes the tree has held at once). The scan goes through the node-id
    /// table in chunks of a few thousand ids, each under its own epoch pin, so a call on a
    /// large tree never holds back the reclamation of what writers retire meanwhile.
    /// Concurrent writers make the figures approximate (a node may be counted before and
    /// after a change, or neither); at quiescence they are exact.
    ///
    /// ```
    /// let tree = kvtrie::PrefixTree::new();
    /// let a = tree.add_tenant("a");
    /// tree.insert("hello", a).unwrap();
    /// tree.insert("help", a).unwrap();
    /// let s = tree.stats();
    /// assert_eq!((s.nodes, s.chars, s.tenants), (3, 6, 1)); // "hel", "lo", "p"
    /// assert!(s.heap_bytes > 0);
    /// ```
    pub fn stats(&self) -> TreeStats {
        self.stats_in_chunks(STATS_CHUNK_IDS, || {})
    }

    /// [`stats`](Self::stats) with chunks of `chunk_ids` ids (at least one), calling
    /// `between` after each chunk, unpinned.
    pub(crate) fn stats_in_chunks(&self, chunk_ids: u32, mut between: impl FnMut()) -> TreeStats {
        let mut s = TreeStats::default();
        let mut from = 0u32;
        loop {
            let guard = reclaim::pin();
            // Read again each chunk: ids handed out meanwhile are scanned too.
            let end = self.store.slab.id_bound();
            if from >= end {
                break;
            }
            let to = from.saturating_add(chunk_ids.max(1)).min(end);
            self.store.slab.for_each_in(from..to, &guard, |n| {
                if !ptr::eq(n, self.root()) {
                    s.nodes += 1;
                    s.chars += n.chars();
                    s.bytes += n.len();
                }
                s.heap_bytes += n.bytes_with(n.owners(&guard));
                if let Some(t) = n.child_table(&guard) {
                    s.heap_bytes += t.bytes();
                }
            });
            drop(guard);
            from = to;
            between();
        }
        let guard = reclaim::pin();
        let capacity = self.slots.load(&guard).capacity();
        s.heap_bytes += self.store.slab.heap_bytes() + capacity * 12;
        s.tenants = self.root().owners(&guard).len();
        // The states outlive the guard; their LRU locks are taken unpinned, since an eviction
        // may hold one through a batch of timestamp groups (a pinned waiter would hold back
        // reclamation meanwhile).
        let states: Vec<_> = (0..capacity)
            .filter_map(|i| self.slots.state_in(i, &guard))
            .collect();
        drop(guard);
        s.heap_bytes += states
            .iter()
            .map(|st| 128 + st.lru.heap_bytes())
            .sum::<usize>();
        s
    }

    /// The whole tree as plain data: children sorted by text, owners by tenant id.
    pub fn snapshot(&self) -> NodeSnapshot {
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        // Iterative: collect nodes in pre-order with their parent index, then assemble
        // bottom-up (no recursion, so arbitrarily deep trees are fine).
        let mut nodes: Vec<(usize, NodeSnapshot)> = Vec::new();
        let mut stack: Vec<(usize, &Node)> = vec![(usize::MAX, self.root())];
        while let Some((parent, n)) = stack.pop() {
            let is_root = ptr::eq(n, self.root());
            let o = n.owners(&guard);
            let tenants = o
                .slots()
                .zip(o.ts())
                .map(|(s, ts)| {
                    // A slot added after `table` was loaded is in a newer table.
                    let t = if s < table.capacity() {
                        table
                    } else {
                        self.slots.load(&guard)
                    };
                    let ts = if is_root {
                        t.state(s)
                            .map_or(0, |st| st.root_ts.load(Ordering::Relaxed))
                    } else {
                        ts.load(Ordering::Relaxed)
                    };
                    (t.id_of_seen(s), ts)
                })
                .collect();
            let idx = nodes.len();
            nodes.push((
                parent,
                NodeSnapshot {
                    text: String::from_utf8_lossy(n.text()).into_owned(),
                    tenants,
                    children: Vec::new(),
                },
            ));
            stack.extend(n.children(&guard).map(|c| (idx, c)));
        }
        while nodes.len() > 1 {
            let (parent, mut snap) = nodes.pop().expect("len > 1");
            snap.children.sort_by(|a, b| a.text.cmp(&b.text));
            nodes[parent].1.children.push(snap);
        }
        let mut root = nodes.pop().map(|x| x.1).unwrap_or_default();
        root.children.sort_by(|a, b| a.text.cmp(&b.text));
        root
    }

    /// Forces this thread's retired objects toward reclamation (test support, feature
    /// `testing`: tests and benchmarks use it so reclamation really happens while small
    /// workloads run; production code never needs it, the backlog stays bounded by itself).
    #[cfg(any(test, feature = "testing"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn collect_garbage(&self) {
        self.flush_retired();
        for _ in 0..4 {
            let guard = reclaim::pin();
            reclaim::flush(&guard);
        }
        self.store.retirer.free_parked();
    }

    /// Hands every partially filled batch of retired objects to the reclaimer (after bulk
    /// retirements: eviction passes, tenant removal).
    pub(super) fn flush_retired(&self) {
        let guard = reclaim::pin();
        self.store.retirer.flush(&guard);
    }

    /// Objects this tree retired (replaced or unlinked nodes and tables) that have not been
    /// freed yet, and their heap bytes. O(1): it locks each writer shard's retire batch for a
    /// moment (a retire itself writes no shared counter).
    ///
    /// Retired objects are batched and handed to the reclaimer in bulk, so the backlog stays
    /// bounded under any sustained load: a constant (a few partial batches, and up to about
    /// 1,500 objects whose grace period has passed, parked for the writers to free a few at a
    /// time after their writes) plus what the tree retires while every thread pinned at a
    /// retirement finishes its operation. Parked objects are freed by the next writes, or by an
    /// eviction pass once the writers are idle.
    pub fn retired_backlog(&self) -> RetiredBacklog {
        let b = self.store.retirer.backlog();
        RetiredBacklog {
            objects: b.objects,
            bytes: b.bytes,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A tree whose ids have been freed and reused: prompts for `a` and `b`, then half of
    /// `b`'s leaves evicted and new prompts for `a`.
    fn churned_tree(n: usize) -> (PrefixTree, crate::TenantId, crate::TenantId) {
        let tree = PrefixTree::new();
        let (a, b) = (tree.add_tenant("a"), tree.add_tenant("b"));
        for i in 0..n {
            let p = format!("doc {} {}/part {}/{i}", i % 4, "z".repeat(12), i % 9);
            tree.insert_at(&p, if i % 3 == 0 { a } else { b }, i as u64)
                .unwrap();
        }
        tree.evict_tenant_by_lru(b, 200);
        for i in 0..n / 4 {
            tree.insert_at(&format!("doc {} again {i}", i % 4), a, (n + i) as u64)
                .unwrap();
        }
        tree.collect_garbage();
        (tree, a, b)
    }

    /// Nodes of `t` in a plain-data snapshot.
    fn owned_nodes(tree: &PrefixTree, t: crate::TenantId) -> usize {
        let snap = tree.snapshot();
        let mut stack: Vec<&NodeSnapshot> = snap.children.iter().collect();
        let mut n = 0;
        while let Some(s) = stack.pop() {
            n += usize::from(s.tenants.iter().any(|(o, _)| *o == t));
            stack.extend(s.children.iter());
        }
        n
    }

    /// `stats` scans in chunks, unpinned between them (where what writers retired meanwhile can
    /// be freed); at quiescence every chunk size gives the same figures, those of the tree's
    /// counters.
    #[test]
    fn stats_scan_in_chunks_and_unpin_between_them() {
        let (tree, _, _) = churned_tree(if cfg!(miri) { 20 } else { 300 });
        tree.check_invariants().unwrap();
        let whole = tree.stats_in_chunks(u32::MAX, || {});
        assert_eq!(
            (whole.nodes, whole.chars, whole.bytes, whole.tenants),
            (
                tree.node_count(),
                tree.distinct_chars(),
                tree.distinct_bytes(),
                2
            )
        );
        for chunk in [1, 5, 64] {
            let mut calls = 0u32;
            let s = tree.stats_in_chunks(chunk, || {
                assert!(!reclaim::is_pinned(), "pinned between chunks");
                calls += 1;
            });
            assert_eq!(s, whole, "chunks of {chunk}");
            assert_eq!(calls, tree.store.slab.id_bound().div_ceil(chunk));
        }
        assert_eq!(tree.stats(), whole);
    }

    /// Writers between chunks (splits, new leaves on ids handed out meanwhile, evictions that
    /// free ids): the scan ends, and counts every node that was there throughout (`a`'s nodes
    /// are never removed, and an id, once a node's, stays with it or its split suffix).
    #[test]
    fn stats_scan_survives_writers_between_chunks() {
        let n = if cfg!(miri) { 20 } else { 300 };
        let (tree, a, b) = churned_tree(n);
        let kept = owned_nodes(&tree, a);
        let mut call = 0usize;
        let s = tree.stats_in_chunks(4, || {
            call += 1;
            let ts = (10 * n + call) as u64;
            match call % 3 {
                0 => tree
                    .insert_at(
                        &format!("doc {} {}/par#{call}", call % 4, "z".repeat(12)),
                        a,
                        ts,
                    )
                    .unwrap(),
                1 => {
                    tree.evict_tenant_by_lru(b, 30);
                }
                _ => tree.insert_at(&format!("fresh {call}"), b, ts).unwrap(),
            }
            tree.collect_garbage();
        });
        assert!(
            s.nodes >= kept,
            "{} counted, {kept} there throughout",
            s.nodes
        );
        tree.check_invariants().unwrap();
    }
}
