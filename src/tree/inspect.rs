//! Inspection: sizes, the retired backlog, snapshots and the invariant checker.

use super::raw::{ChildTable, Node};
use super::{NodeSnapshot, PrefixTree, RetiredBacklog, TreeStats};
use crate::reclaim;
use crate::sync::{self, Ordering};
use crate::text;
use std::collections::HashMap;
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
            s.heap_bytes += n.bytes() + n.owners(&guard).bytes();
            if let Some(t) = n.child_table(&guard) {
                s.heap_bytes += ChildTable::bytes(t.len());
                stack.extend(t.iter().map(|(_, c)| c));
            }
        }
        let table = self.slots.load(&guard);
        s.heap_bytes += self.store.slab.heap_bytes()
            + table.capacity() * 12
            + (0..table.capacity())
                .filter_map(|i| table.state(i))
                .map(|st| 128 + sync::lock(&st.lru).heap_bytes())
                .sum::<usize>();
        s.tenants = self.root().owners(&guard).len();
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

    /// Checks the structural invariants (test support, feature `testing`; O(nodes);
    /// meaningful at quiescence):
    /// exact per-tenant char and node counts (recount), prefix closure, non-empty edges with
    /// distinct first chars, no owner-less node, valid UTF-8 edges, consistent parent links,
    /// node ids and counters, no unlinked node reachable.
    #[cfg(any(test, feature = "testing"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn check_invariants(&self) -> Result<(), String> {
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        let mut recount: HashMap<usize, (u64, usize)> = HashMap::new();
        let (mut nodes, mut chars, mut bytes) = (0usize, 0usize, 0usize);
        let mut stack = vec![self.root()];
        while let Some(n) = stack.pop() {
            let is_root = ptr::eq(n, self.root());
            let o = n.owners(&guard);
            if n.is_obsolete() {
                return Err("an unlinked node is reachable".into());
            }
            if !self
                .store
                .slab
                .get(n.id(), &guard)
                .is_some_and(|x| ptr::eq(x, n))
            {
                return Err("the slab does not map the node's id to it".into());
            }
            if !is_root {
                nodes += 1;
                chars += n.chars();
                bytes += n.len();
                if n.len() == 0 {
                    return Err("non-root node with an empty edge".into());
                }
                if std::str::from_utf8(n.text()).is_err() {
                    return Err(format!("edge is not valid UTF-8: {:?}", n.text()));
                }
                if n.chars() != text::char_count(n.text()) {
                    return Err("stored char length is wrong".into());
                }
                if o.len() == 0 {
                    return Err(format!(
                        "owner-less node {:?} is reachable",
                        String::from_utf8_lossy(n.text())
                    ));
                }
                for s in o.slots() {
                    let e = recount.entry(s).or_default();
                    e.0 += n.chars() as u64;
                    e.1 += 1;
                }
            } else {
                for s in o.slots() {
                    if !table.is_live(table.id_of_seen(s)) {
                        return Err(format!("root owned by dead slot {s}"));
                    }
                }
            }
            if let Some(t) = n.child_table(&guard) {
                if t.len() == 0 {
                    return Err("empty child table".into());
                }
                let mut prev = None;
                for (key, c) in t.iter() {
                    if prev.is_some_and(|p| p >= key) {
                        return Err("child keys not strictly ascending".into());
                    }
                    prev = Some(key);
                    if c.len() == 0 || text::edge_key(c.text()) != key {
                        return Err("child key differs from its first char".into());
                    }
                    if c.parent_id() != n.id() {
                        return Err("wrong parent link".into());
                    }
                    for s in c.owners(&guard).slots() {
                        if !o.contains(s) {
                            return Err(format!(
                                "prefix closure: slot {s} owns {:?} but not its parent",
                                String::from_utf8_lossy(c.text())
                            ));
                        }
                    }
                    stack.push(c);
                }
            }
        }
        for s in self.root().owners(&guard).slots() {
            let Some(st) = table.state(s) else {
                return Err(format!("slot {s} has no state"));
            };
            let have = (
                st.chars.load(Ordering::Relaxed),
                st.nodes.load(Ordering::Relaxed),
            );
            let want = recount.get(&s).copied().unwrap_or((0, 0));
            if have != want {
                return Err(format!(
                    "slot {s}: (chars, nodes) counted {have:?}, recount {want:?}"
                ));
            }
        }
        if recount
            .keys()
            .any(|&s| !self.root().owners(&guard).contains(s))
        {
            return Err("a node is owned by a tenant that is not live".into());
        }
        if (nodes, chars, bytes)
            != (
                self.node_count(),
                self.distinct_chars(),
                self.distinct_bytes(),
            )
        {
            return Err("node/char/byte counters differ from a recount".into());
        }
        Ok(())
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
    /// reclaimer has not freed yet, and their heap bytes. O(1).
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
