//! Snapshots of a [`PrefixTree`]: written live, restored into a new tree.
//!
//! # Payload (kind 1, see [`crate::snapshot`] for the framing)
//!
//! | record | tag | payload |
//! |---|---|---|
//! | meta | 1 | tree clock in ms (`u64`), tenants (`u32`), slots in use (`u32`: one past the highest) |
//! | tenant | 2 | slot (`u32`), generation (`u32`), last access at the root (`u64`), name (`u32` length + UTF-8) |
//! | node | 3 | edge (`u32` length + UTF-8), owners (`u32` count, then `(slot u32, ts u64)` ascending), children (`u32`) |
//!
//! One meta record, then one tenant record per live tenant, then the nodes in pre-order (root
//! first, with an empty edge and the live tenants as owners), each followed by its subtrees;
//! a node's children are in ascending edge order.
//!
//! # Taken live
//!
//! [`PrefixTree::write_snapshot`] walks the tree under one epoch guard while other threads read
//! and write; tenant additions and removals wait for it (inserts and evictions do not). Every
//! insert completed before it started is in it; inserts concurrent with it may or may not be.
//! The result is always a valid tree: a node's owners are cut down to its parent's written
//! owners (a tenant attached top-down while the walk passed keeps only the part above), nodes
//! left without owners are skipped with their subtrees, and a restore raises each node's times
//! to at least its children's.

use super::lru::LruHeap;
use super::raw::{NewNode, NewOwners, Node};
use super::{PrefixTree, TenantState, MAX_TENANTS, MAX_TEXT_BYTES};
use crate::reclaim;
use crate::snapshot::{
    put_blob, Payload, SnapshotError, SnapshotKind, SnapshotReader, SnapshotWriter,
};
use crate::sync::{self, Ordering};
use crate::tenant::TenantId;
use crate::text;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

const META: u8 = 1;
const TENANT: u8 = 2;
const NODE: u8 = 3;

/// What [`PrefixTree::write_snapshot`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotSummary {
    /// Bytes written.
    pub bytes: u64,
    /// Nodes written (not counting the root).
    pub nodes: u64,
    /// Tenants written.
    pub tenants: u64,
}

/// A node being restored: its record, and the children built so far.
struct Frame {
    /// The node (`None` for the root, which the tree already has), owners not set yet.
    node: Option<NewNode>,
    owners: Vec<(u32, u64)>,
    remaining: u32,
    children: Vec<NewNode>,
    /// Each child's key and owners, for the prefix-closure, key and leaf checks.
    child_owners: Vec<(u32, Vec<(u32, u64)>)>,
}

impl PrefixTree {
    /// Writes a snapshot of the tree to `out` (see [`crate::snapshot`] for the format and
    /// `tree/persist.rs` for what a live snapshot contains), streaming: memory is bounded by
    /// the depth of the tree, not its size.
    ///
    /// Runs while other threads read and write; adding and removing tenants waits for it.
    ///
    /// The walk holds one epoch pin from start to end, writes to `out` included: whatever
    /// writers retire meanwhile (replaced tables, split and pruned nodes) is freed only after
    /// it returns. Give it a sink that does not block for long — memory (`Vec<u8>`, as the
    /// NATS snapshot store does) or a buffered file — and send the bytes elsewhere afterwards.
    pub fn write_snapshot<W: Write>(&self, out: W) -> Result<SnapshotSummary, SnapshotError> {
        // The registry first: not pinned while waiting for it (see `try_add_tenant`).
        let registry = sync::lock(&self.registry);
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        let mut w = SnapshotWriter::new(out, SnapshotKind::PrefixTree)?;
        let root = self.root();
        let live: Vec<usize> = root.owners(&guard).slots().collect();
        let mut summary = SnapshotSummary {
            tenants: live.len() as u64,
            ..SnapshotSummary::default()
        };
        let p = w.payload();
        p.extend_from_slice(&self.now().to_le_bytes());
        p.extend_from_slice(&(live.len() as u32).to_le_bytes());
        p.extend_from_slice(&(registry.next_slot).to_le_bytes());
        w.end_record(META)?;
        for &s in &live {
            let id = table.id_of_seen(s);
            let name = registry
                .slot_names
                .get(s)
                .and_then(|n| n.as_deref())
                .unwrap_or_default();
            let root_ts = table
                .state(s)
                .map_or(0, |st| st.root_ts.load(Ordering::Relaxed));
            let p = w.payload();
            p.extend_from_slice(&(s as u32).to_le_bytes());
            p.extend_from_slice(&id.generation().to_le_bytes());
            p.extend_from_slice(&root_ts.to_le_bytes());
            put_blob(p, name.as_bytes());
            w.end_record(TENANT)?;
        }
        // Pre-order walk; each entry carries the owners it will be written with (read once,
        // cut down to the parent's written owners).
        let root_owners: Vec<(u32, u64)> = live.iter().map(|&s| (s as u32, 0)).collect();
        let mut stack: Vec<(&Node, Vec<(u32, u64)>)> = vec![(root, root_owners)];
        while let Some((node, owners)) = stack.pop() {
            let mut kids: Vec<(&Node, Vec<(u32, u64)>)> = Vec::new();
            for c in node.children(&guard) {
                let o = c.owners(&guard);
                let kept: Vec<(u32, u64)> = o
                    .slots()
                    .zip(o.ts())
                    .filter(|(s, _)| owners.iter().any(|x| x.0 as usize == *s))
                    .map(|(s, t)| (s as u32, t.load(Ordering::Relaxed)))
                    .collect();
                if !kept.is_empty() {
                    kids.push((c, kept));
                }
            }
            // The format lists children in ascending edge order; a small child table keeps
            // them in insertion order.
            kids.sort_unstable_by_key(|(c, _)| text::edge_key(c.text()));
            let p = w.payload();
            put_blob(p, node.text());
            p.extend_from_slice(&(owners.len() as u32).to_le_bytes());
            for &(s, t) in &owners {
                p.extend_from_slice(&s.to_le_bytes());
                p.extend_from_slice(&t.to_le_bytes());
            }
            p.extend_from_slice(&(kids.len() as u32).to_le_bytes());
            w.end_record(NODE)?;
            if !std::ptr::eq(node, root) {
                summary.nodes += 1;
            }
            stack.extend(kids.into_iter().rev());
        }
        drop(registry);
        let (bytes, _) = w.finish()?;
        summary.bytes = bytes;
        Ok(summary)
    }

    /// Restores a tree from a snapshot written by [`write_snapshot`](Self::write_snapshot),
    /// with the same tenants (names, ids), nodes, owners and times; the tree clock continues
    /// from the snapshot's. Any malformed, truncated, damaged or hostile input is a
    /// [`SnapshotError`] naming what is wrong; restoring allocates in proportion to the bytes
    /// it has read, and a restored tree always passes its invariant checks.
    pub fn read_snapshot<R: Read>(input: R) -> Result<PrefixTree, SnapshotError> {
        let mut r = SnapshotReader::new(input, SnapshotKind::PrefixTree)?;
        let tree = PrefixTree::new();
        let guard = reclaim::pin();
        // Meta.
        let (clock, n_tenants, slots_in_use) = {
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
            let v = (
                p.u64("the clock")?,
                p.u32("the tenant count")?,
                p.u32("the slot count")?,
            );
            p.end()?;
            v
        };
        if n_tenants as usize > MAX_TENANTS || slots_in_use as usize > MAX_TENANTS {
            return Err(invalid(Some(0), "more tenants than a tree can hold"));
        }
        if n_tenants > slots_in_use {
            return Err(invalid(Some(0), "more tenants than slots in use"));
        }
        // Tenants.
        let mut tenants: HashMap<u32, (u32, u64, Arc<str>)> = HashMap::new();
        let mut names: HashSet<Arc<str>> = HashSet::new();
        for _ in 0..n_tenants {
            let pos = r.position();
            let rec = r
                .next_record()?
                .ok_or_else(|| invalid(Some(pos), "fewer tenant records than announced"))?;
            if rec.tag != TENANT {
                return Err(invalid(Some(pos), "expected a tenant record"));
            }
            let mut p = Payload::new(rec.payload, pos);
            let slot = p.u32("the slot")?;
            let gen = p.u32("the generation")?;
            let root_ts = p.u64("the root time")?;
            let name = std::str::from_utf8(p.blob("the name")?)
                .map_err(|_| p.invalid("the tenant name is not UTF-8"))?;
            p.end()?;
            if slot >= slots_in_use {
                return Err(p.invalid(format!("slot {slot} is not below {slots_in_use}")));
            }
            if gen & 1 == 0 {
                return Err(p.invalid("a live tenant's generation is odd"));
            }
            let name: Arc<str> = Arc::from(name);
            if !names.insert(name.clone()) {
                return Err(p.invalid(format!("tenant name {name:?} appears twice")));
            }
            if tenants.insert(slot, (gen, root_ts, name)).is_some() {
                return Err(p.invalid(format!("slot {slot} appears twice")));
            }
        }
        // Per-tenant tallies, indexed by the tenant's rank among the (sorted) slots.
        let mut slots: Vec<u32> = tenants.keys().copied().collect();
        slots.sort_unstable();
        let rank = |s: u32| slots.binary_search(&s).ok();
        let mut counts: Vec<(u64, usize)> = vec![(0, 0); slots.len()];
        let mut lru: Vec<Vec<(u64, u32)>> = vec![Vec::new(); slots.len()];
        // Nodes, pre-order: a stack of the nodes whose children are still coming.
        let mut stack: Vec<Frame> = Vec::new();
        let mut root_children: Option<Vec<NewNode>> = None;
        let (mut nodes, mut chars, mut bytes) = (0usize, 0usize, 0usize);
        loop {
            let pos = r.position();
            let Some(rec) = r.next_record()? else {
                break;
            };
            if rec.tag != NODE {
                return Err(invalid(
                    Some(pos),
                    format!("unexpected record tag {}", rec.tag),
                ));
            }
            if root_children.is_some() {
                return Err(invalid(Some(pos), "a node after the root's subtree"));
            }
            let mut p = Payload::new(rec.payload, pos);
            let edge = p.blob("the edge")?;
            let n_owners = p.u32("the owner count")?;
            let mut owners: Vec<(u32, u64)> = Vec::new();
            for _ in 0..n_owners {
                let s = p.u32("an owner slot")?;
                let t = p.u64("an owner time")?;
                if owners.last().is_some_and(|l: &(u32, u64)| l.0 >= s) {
                    return Err(p.invalid("owner slots are not strictly ascending"));
                }
                if rank(s).is_none() {
                    return Err(p.invalid(format!("owner slot {s} is not a tenant")));
                }
                owners.push((s, t));
            }
            let n_children = p.u32("the child count")?;
            p.end()?;
            if std::str::from_utf8(edge).is_err() {
                return Err(p.invalid("the edge is not UTF-8"));
            }
            if edge.len() > MAX_TEXT_BYTES {
                return Err(p.invalid("the edge is too long"));
            }
            match stack.last() {
                None => {
                    // The root: empty edge, owned by exactly the tenants.
                    if !edge.is_empty() {
                        return Err(p.invalid("the root's edge is not empty"));
                    }
                    if owners.len() != tenants.len() {
                        return Err(p.invalid("the root is not owned by exactly the tenants"));
                    }
                }
                Some(parent) => {
                    if edge.is_empty() {
                        return Err(p.invalid("a node with an empty edge"));
                    }
                    if owners.is_empty() {
                        return Err(p.invalid("a node without owners"));
                    }
                    if let Some((s, _)) = owners
                        .iter()
                        .find(|o| parent.owners.binary_search_by_key(&o.0, |x| x.0).is_err())
                    {
                        return Err(p.invalid(format!(
                            "slot {s} owns a node but not its parent (prefix closure)"
                        )));
                    }
                }
            }
            let node = if stack.is_empty() {
                None
            } else {
                let id = tree
                    .store
                    .slab
                    .reserve()
                    .ok_or_else(|| p.invalid("more nodes than a tree can hold"))?;
                Some(NewNode::new(edge, id, None))
            };
            stack.push(Frame {
                node,
                owners,
                remaining: n_children,
                children: Vec::new(),
                child_owners: Vec::new(),
            });
            // Finish every frame whose children are all there, bottom-up.
            while stack.last().is_some_and(|f| f.remaining == 0) {
                let f = stack.pop().expect("checked");
                let children = f.children;
                let child_owners = f.child_owners;
                // Children come in ascending key order (as written), keys distinct.
                if child_owners.windows(2).any(|w| w[0].0 >= w[1].0) {
                    return Err(invalid(
                        Some(pos),
                        "children are not in ascending order of distinct first chars",
                    ));
                }
                // A node's times are at least its children's (eviction relies on it).
                let mut owners = f.owners;
                for (_, co) in &child_owners {
                    for &(s, t) in co {
                        if let Ok(i) = owners.binary_search_by_key(&s, |x| x.0) {
                            owners[i].1 = owners[i].1.max(t);
                        }
                    }
                }
                if stack.is_empty() {
                    // The root.
                    root_children = Some(children);
                    break;
                }
                let mut node = f.node.expect("only the root has no node");
                let id = node.node().id();
                node.set_owners(NewOwners::from_sorted(&owners));
                let node_chars = node.node().chars();
                // Leaves of each owner: it owns the node but none of its children.
                for &(s, t) in &owners {
                    let owns_child = child_owners
                        .iter()
                        .any(|(_, co)| co.binary_search_by_key(&s, |x| x.0).is_ok());
                    let r = rank(s).expect("owners were checked to be tenants");
                    if !owns_child {
                        lru[r].push((t, id));
                    }
                    counts[r].0 += node_chars as u64;
                    counts[r].1 += 1;
                }
                nodes += 1;
                chars += node_chars;
                bytes += node.node().len();
                let key = text::edge_key(node.node().text());
                node.adopt_children(children, &tree.store);
                let parent = stack.last_mut().expect("not the root");
                parent.remaining -= 1;
                parent.children.push(node);
                parent.child_owners.push((key, owners));
            }
        }
        let Some(children) = root_children else {
            return Err(invalid(None, "the snapshot ends inside the tree"));
        };
        // Install: tenants, root, counters. The tree is not shared yet.
        let mut reg = sync::lock(&tree.registry);
        reg.next_slot = slots_in_use;
        reg.slot_names = vec![None; slots_in_use as usize];
        for s in 0..slots_in_use {
            if !tenants.contains_key(&s) {
                reg.free_slots.push(s);
            }
        }
        reg.free_slots.reverse();
        let mut root_entries: Vec<(u32, u64)> = Vec::new();
        for (r, &s) in slots.iter().enumerate() {
            let (gen, root_ts, name) = &tenants[&s];
            let su = s as usize;
            tree.slots.ensure(su, TenantState::new, &guard);
            let table = tree.slots.load(&guard);
            table.set_gen(su, *gen);
            let st = table.state(su).expect("ensured");
            let (c, n) = counts[r];
            st.chars.store(c, Ordering::Relaxed);
            st.nodes.store(n, Ordering::Relaxed);
            st.root_ts.store(*root_ts, Ordering::Relaxed);
            let mut heap = LruHeap::with_capacity(lru[r].len());
            for &(t, id) in &lru[r] {
                heap.push(t, id);
            }
            st.lru.reset(heap);
            reg.names.insert(name.clone(), TenantId::new(s, *gen));
            reg.slot_names[su] = Some(name.clone());
            root_entries.push((s, 0));
        }
        drop(reg);
        {
            let root = tree.root().lock().expect("a new tree's root");
            root.set_owners(NewOwners::from_sorted(&root_entries), &tree.store, &guard);
            root.install_children(children, &tree.store, &guard);
        }
        tree.counters
            .add(nodes as isize, chars as isize, bytes as isize);
        let mut tree = tree;
        tree.origin = Instant::now()
            .checked_sub(Duration::from_millis(clock))
            .unwrap_or_else(Instant::now);
        Ok(tree)
    }
}

fn invalid(record: Option<u64>, reason: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid {
        record,
        reason: reason.into(),
    }
}
