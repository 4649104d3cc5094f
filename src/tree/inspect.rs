//! Inspection: sizes, the retired backlog, snapshots and the invariant checker.

use super::raw::Node;
use super::{NodeSnapshot, PrefixTree, RetiredBacklog, TreeStats};
use crate::reclaim;
use crate::sync::Ordering;
use std::ptr;

impl PrefixTree {
    /// Nodes in the tree, not counting the root.
    pub fn node_count(&self) -> usize {
        self.counters.get(0)
    }

    /// Distinct chars stored (sum of edge lengths).
    pub fn distinct_chars(&self) -> usize {
        self.counters.get(1)
    }

    /// Distinct bytes stored (sum of edge lengths in bytes).
    pub fn distinct_bytes(&self) -> usize {
        self.counters.get(2)
    }

    /// Size figures, computed by a full walk (O(nodes), lock-free: concurrent writers make the
    /// figures those of some moment during the walk, approximately).
    pub fn stats(&self) -> TreeStats {
        let guard = reclaim::pin();
        let mut s = TreeStats::default();
        let mut stack = vec![self.root()];
        while let Some(n) = stack.pop() {
            if !ptr::eq(n, self.root()) {
                s.nodes += 1;
                s.chars += n.chars();
                s.bytes += n.len();
            }
            s.heap_bytes += n.bytes_with(n.owners(&guard));
            if let Some(t) = n.child_table(&guard) {
                s.heap_bytes += t.bytes();
                stack.extend(t.iter().map(|(_, c)| c));
            }
        }
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
    }

    /// Hands every partially filled batch of retired objects to the reclaimer (after bulk
    /// retirements: eviction passes, tenant removal).
    pub(super) fn flush_retired(&self) {
        let guard = reclaim::pin();
        self.store.retirer.flush(&guard);
    }

    /// Objects this tree retired (replaced or unlinked nodes and tables) that the epoch
    /// reclaimer has not freed yet, and their heap bytes. O(1): it locks each writer shard's
    /// retire batch for a moment (a retire itself writes no shared counter).
    ///
    /// Retired objects are batched and handed to the reclaimer in bulk, so the backlog stays
    /// bounded under any sustained load: a constant (a few partial batches) plus what the tree
    /// retires while every thread pinned at a retirement finishes its operation.
    pub fn retired_backlog(&self) -> RetiredBacklog {
        let b = self.store.retirer.backlog();
        RetiredBacklog {
            objects: b.objects,
            bytes: b.bytes,
        }
    }
}
