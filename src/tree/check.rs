//! The invariant checker (test support, feature `testing`).

use super::raw::Mask;
use super::PrefixTree;
use crate::reclaim;
use crate::sync::Ordering;
use crate::text;
use std::collections::HashMap;
use std::ptr;

impl PrefixTree {
    /// Checks the structural invariants (test support, feature `testing`; O(nodes);
    /// meaningful at quiescence):
    /// exact per-tenant char and node counts (recount), prefix closure, non-empty edges with
    /// distinct first chars, no owner-less node, valid UTF-8 edges, consistent parent links,
    /// node ids (the id table maps exactly the reachable nodes) and counters, no unlinked node
    /// reachable.
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
            // The inline copy of the first membership word (what lookups of slots 0..63 read).
            let first_word = Mask {
                lo: 0,
                words: &[u64::MAX],
            };
            let mut inline = 0u64;
            n.owner_view(first_word, &guard)
                .for_each(first_word, |s| inline |= 1 << s);
            if inline != o.word(0) {
                return Err(format!(
                    "inline owner word {inline:#x} is not the table's {:#x}",
                    o.word(0)
                ));
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
                let keys = t.keys();
                if keys.len() > t.capacity() || (t.is_large() && keys.len() != t.capacity()) {
                    return Err(format!(
                        "child table of {} entries in {} slots",
                        keys.len(),
                        t.capacity()
                    ));
                }
                if t.is_large() && !keys.windows(2).all(|w| w[0] < w[1]) {
                    return Err("large child table's keys not strictly ascending".into());
                }
                let mut sorted = keys.to_vec();
                sorted.sort_unstable();
                if sorted.windows(2).any(|w| w[0] == w[1]) {
                    return Err("duplicate child keys".into());
                }
                for (key, c) in t.iter() {
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
        // Every id entry is a reachable node (each reachable node's entry was checked above):
        // what `stats` scans is the tree.
        let mut entries = 0usize;
        let bound = self.store.slab.id_bound();
        self.store
            .slab
            .for_each_in(0..bound, &guard, |_| entries += 1);
        if entries != nodes + 1 {
            return Err(format!(
                "the id table maps {entries} ids to nodes, the tree has {} nodes",
                nodes + 1
            ));
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
}
