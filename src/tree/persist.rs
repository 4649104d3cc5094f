//! Snapshots of a [`PrefixTree`]: written live, restored into a new tree.
//!
//! # Payload (kind 1, see [`crate::snapshot`] for the framing)
//!
//! | record | tag | payload |
//! |---|---|---|
//! | meta | 1 | tree clock in ms (`u64`), tenants (`u32`), slots in use (`u32`: one past the highest) |
//! | tenant | 2 | slot (`u32`), generation (`u32`), last access at the root (`u64`), name (`u32` length + UTF-8) |
//! | slots | 4 | the generation (`u32`) of every slot in use, from slot 0 (format version 2 on) |
//! | node | 3 | edge (`u32` length + UTF-8), owners (`u32` count, then `(slot u32, ts u64)` ascending), children (`u32`) |
//!
//! One meta record, then one tenant record per live tenant, then the slots record, then the
//! nodes in pre-order (root first, with an empty edge and the live tenants as owners), each
//! followed by its subtrees; a node's children are in ascending edge order.
//!
//! The slots record carries the generations of the slots no live tenant holds (a removed
//! tenant's slot keeps the generation its removal left), so that a restored tree gives a new
//! tenant on such a slot a generation its removed tenant never had: a removed tenant's id
//! stays stale, as in the tree that wrote the snapshot. A version 1 snapshot has no slots
//! record; restored from it, a free slot starts again at generation 0, and the id of a tenant
//! removed before that snapshot may name a tenant added after the restore.
//!
//! # Taken live
//!
//! [`PrefixTree::write_snapshot`] walks the tree while other threads read and write; tenant
//! additions and removals wait for it (inserts and evictions do not). Every insert completed
//! before it started is in it, unless evicted meanwhile; inserts concurrent with it may or may
//! not be. The result is always a valid tree: a node's owners are cut down to its parent's
//! written owners (a tenant attached top-down while the walk passed keeps only the part above),
//! nodes left without owners are skipped with their subtrees, and a restore raises each node's
//! times to at least its children's.
//!
//! The walk goes in chunks, each under its own epoch pin, and writes each chunk's bytes to the
//! sink between pins. What it carries from one chunk to the next is owned data: the nodes still
//! to write (edge, owners, depth: read when their parent was written, which fixed the parent's
//! child count) and the path to the last written node. A chunk finds its first node again by
//! descending from the root along that node's path: a split of an edge on the way changes
//! nothing (the path still ends at a node, the split's suffix, which has the children), and a
//! node gone since (pruned, or its path now ending inside an edge) is written as the leaf it
//! was with no children.

use super::lru::LruHeap;
use super::raw::{NewNode, NewOwners, Node};
use super::slab::Counts;
use super::{PrefixTree, TenantState, MAX_TENANTS, MAX_TEXT_BYTES};
use crate::reclaim::{self, Guard};
use crate::snapshot::{
    put_blob, Payload, SnapshotError, SnapshotKind, SnapshotReader, SnapshotWriter,
};
use crate::sync::{self, Ordering};
use crate::tenant::TenantId;
use crate::text;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

const META: u8 = 1;
const TENANT: u8 = 2;
const NODE: u8 = 3;

/// A node record: the edge (a length and the bytes), the owner count, each owner's slot and
/// time, the child count. The largest node a tree can hold must fit one record.
const _: () = assert!(
    4 + MAX_TEXT_BYTES + 4 + MAX_TENANTS * (4 + 8) + 4 <= crate::snapshot::MAX_RECORD as usize
);
const SLOTS: u8 = 4;

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

/// Nodes [`PrefixTree::write_snapshot`] writes under one pin (two under miri, so that its
/// snapshot tests cross chunk boundaries).
#[cfg(not(miri))]
const SNAPSHOT_CHUNK_NODES: usize = 1024;
#[cfg(miri)]
const SNAPSHOT_CHUNK_NODES: usize = 2;

/// Output a chunk may buffer before the walk unpins to write it out.
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

/// A node the snapshot walk will write: its depth (the root is 0), its edge and the owners it
/// will be written with (read when its parent was written, cut down to the parent's written
/// owners).
struct Pending {
    depth: usize,
    edge: Vec<u8>,
    owners: Vec<(u32, u64)>,
}

/// The snapshot walk's state between chunks: owned data only (no node references, which are
/// valid under one pin).
struct Walk {
    /// Nodes still to write, the next on top (pre-order).
    pending: Vec<Pending>,
    /// The edges from the root to the last written node.
    path: Vec<u8>,
    /// `ends[d]`: the length of `path` up to the end of the last written node of depth `d`.
    ends: Vec<usize>,
}

/// The snapshot's sink, written to only between chunks, unpinned: a chunk's bytes are
/// buffered meanwhile.
struct Deferred<W: Write> {
    out: W,
    buf: Vec<u8>,
}

impl<W: Write> Deferred<W> {
    fn new(out: W) -> Self {
        Self {
            out,
            buf: Vec::new(),
        }
    }

    fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Writes what is buffered to the sink.
    fn drain(&mut self) -> std::io::Result<()> {
        self.out.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }
}

impl<W: Write> Write for Deferred<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.drain()?;
        self.out.flush()
    }
}

impl PrefixTree {
    /// Writes a snapshot of the tree to `out` (see [`crate::snapshot`] for the format and
    /// `tree/persist.rs` for what a live snapshot contains), streaming. Besides one chunk of
    /// output, its memory is the nodes still to write along the current path: the unwritten
    /// siblings of each node on it, with a copy of their edges (so at most the text under the
    /// widest node), not the whole tree.
    ///
    /// Runs while other threads read and write; adding and removing tenants waits for it (a
    /// removal that has begun before finishes its sweep beside it: the snapshot leaves out the
    /// tenants it has marked dead).
    ///
    /// The walk holds an epoch pin for one chunk of nodes at a time (1,024 nodes, or as many
    /// as the chunk's first node is deep, or 1 MiB of output) and writes each chunk to `out`
    /// unpinned, so neither a large tree nor a slow sink holds back the reclamation of what
    /// writers retire meanwhile. It holds the tree's tenant registry throughout, so `out` must
    /// not add or remove tenants of this tree, look up their names or ids (`tenant_id`,
    /// `tenant_name`), nor take another snapshot of it (nor wait for a thread that does): that
    /// would deadlock. Inserting, matching and evicting are fine.
    pub fn write_snapshot<W: Write>(&self, out: W) -> Result<SnapshotSummary, SnapshotError> {
        self.write_snapshot_in_chunks(out, SNAPSHOT_CHUNK_NODES)
    }

    /// [`write_snapshot`](Self::write_snapshot) with chunks of at most `chunk_nodes` nodes
    /// (at least one): tests write one node per chunk and change the tree from the sink,
    /// which is written to only between chunks.
    pub(crate) fn write_snapshot_in_chunks<W: Write>(
        &self,
        out: W,
        chunk_nodes: usize,
    ) -> Result<SnapshotSummary, SnapshotError> {
        // The registry first: not pinned while waiting for it (see `try_add_tenant`).
        let registry = sync::lock(&self.registry);
        let guard = reclaim::pin();
        let table = self.slots.load(&guard);
        let mut w = SnapshotWriter::new(Deferred::new(out), SnapshotKind::PrefixTree)?;
        let live: Vec<usize> = self.root().owners(&guard).slots().collect();
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
        // Every slot's generation: a free slot's is what a restored tree must count on from.
        let p = w.payload();
        for s in 0..registry.next_slot as usize {
            p.extend_from_slice(&table.gen(s).to_le_bytes());
        }
        w.end_record(SLOTS)?;
        drop(guard);
        // Pre-order walk in chunks, each under its own pin.
        let mut walk = Walk {
            pending: vec![Pending {
                depth: 0,
                edge: Vec::new(),
                owners: live.iter().map(|&s| (s as u32, 0)).collect(),
            }],
            path: Vec::new(),
            ends: Vec::new(),
        };
        while !walk.pending.is_empty() {
            let guard = reclaim::pin();
            summary.nodes += self.write_chunk(&mut walk, &mut w, chunk_nodes, &guard)?;
            drop(guard);
            w.get_mut().drain()?;
        }
        drop(registry);
        let (bytes, _) = w.finish()?;
        summary.bytes = bytes;
        Ok(summary)
    }

    /// Writes nodes of `walk` under one pin, until it is done or the chunk is full
    /// (`chunk_nodes` nodes, or [`SNAPSHOT_CHUNK_BYTES`] of output); returns how
    /// many (not counting the root). The first node's ancestors are found again from the root
    /// by their paths (what the previous chunk saw may be gone), once per chunk; every later
    /// node of the chunk is found from its parent, through references valid under `guard`. A
    /// chunk writes at least as many nodes as that first descent took steps (unless it fills
    /// its bytes first), so the descents cost at most one step per node written, or one
    /// tree depth per chunk of output, however deep the tree (a chain of a million nodes, one
    /// descent per 1,024 nodes, took quadratic time).
    fn write_chunk<'g, W: Write>(
        &'g self,
        walk: &mut Walk,
        w: &mut SnapshotWriter<Deferred<W>>,
        chunk_nodes: usize,
        guard: &'g Guard,
    ) -> Result<u64, SnapshotError> {
        let mut written = 0u64;
        let mut nodes = 0usize;
        // Nodes this chunk must write before it may end (see above).
        let mut at_least = 0usize;
        // The nodes of the pending entries pushed under this guard, in step with them: those
        // entries are the top of `walk.pending` (a stack), above the ones carried from an
        // earlier chunk, which have no node yet.
        let mut seen: Vec<&'g Node> = Vec::new();
        // The node written at each depth of the current path (`None`: gone), under this guard.
        let mut ancestors: Vec<Option<&'g Node>> = Vec::new();
        while let Some(e) = walk.pending.pop() {
            let known = seen.pop();
            // The path to this node: its ancestors' (still the last written ones, pre-order),
            // then its own edge.
            let at = if e.depth == 0 {
                0
            } else {
                walk.ends[e.depth - 1]
            };
            walk.path.truncate(at);
            walk.path.extend_from_slice(&e.edge);
            walk.ends.truncate(e.depth);
            walk.ends.push(walk.path.len());
            ancestors.truncate(e.depth);
            if ancestors.len() < e.depth {
                // The chunk's first node (pending entries are in pre-order: every later one's
                // parent is this node or one of its ancestors, or was written in this chunk).
                let mut node = Some(self.root());
                ancestors.push(node);
                for d in 1..e.depth {
                    let edge = &walk.path[walk.ends[d - 1]..walk.ends[d]];
                    node = node.and_then(|n| Self::node_below(n, edge, guard));
                    ancestors.push(node);
                }
                at_least = e.depth;
            }
            let node = match (known, e.depth) {
                (Some(n), _) => Some(n),
                (None, 0) => Some(self.root()),
                (None, d) => ancestors[d - 1].and_then(|p| Self::node_below(p, &e.edge, guard)),
            };
            ancestors.push(node);
            // Its children, with owners cut down to this node's written owners. A node gone
            // since its parent was written is written as a leaf (its state at that moment).
            let mut kids: Vec<(Pending, &'g Node)> = Vec::new();
            for c in node.into_iter().flat_map(|n| n.children(guard)) {
                let o = c.owners(guard);
                let kept: Vec<(u32, u64)> = o
                    .slots()
                    .zip(o.ts())
                    // `e.owners` is ascending by slot (`slots()` order).
                    .filter(|(s, _)| e.owners.binary_search_by_key(&(*s as u32), |x| x.0).is_ok())
                    .map(|(s, t)| (s as u32, t.load(Ordering::Relaxed)))
                    .collect();
                if !kept.is_empty() {
                    let edge = c.text().to_vec();
                    let depth = e.depth + 1;
                    kids.push((
                        Pending {
                            depth,
                            edge,
                            owners: kept,
                        },
                        c,
                    ));
                }
            }
            // The format lists children in ascending edge order; a small child table keeps
            // them in insertion order.
            kids.sort_unstable_by_key(|(k, _)| text::edge_key(&k.edge));
            let p = w.payload();
            put_blob(p, &e.edge);
            p.extend_from_slice(&(e.owners.len() as u32).to_le_bytes());
            for &(s, t) in &e.owners {
                p.extend_from_slice(&s.to_le_bytes());
                p.extend_from_slice(&t.to_le_bytes());
            }
            p.extend_from_slice(&(kids.len() as u32).to_le_bytes());
            w.end_record(NODE)?;
            if e.depth > 0 {
                written += 1;
            }
            for (k, c) in kids.into_iter().rev() {
                walk.pending.push(k);
                seen.push(c);
            }
            nodes += 1;
            if (nodes >= chunk_nodes && nodes >= at_least)
                || w.get_mut().buffered() >= SNAPSHOT_CHUNK_BYTES
            {
                break;
            }
        }
        Ok(written)
    }

    /// The node whose path from `node` is exactly `path`, if there is one.
    fn node_below<'g>(mut node: &'g Node, path: &[u8], guard: &'g Guard) -> Option<&'g Node> {
        let mut off = 0;
        while off < path.len() {
            let rest = &path[off..];
            let c = node.child(text::edge_key(rest), guard)?;
            if !text::starts_with(rest, c.text()) {
                return None;
            }
            off += c.len();
            node = c;
        }
        Some(node)
    }

    /// Restores a tree from a snapshot written by [`write_snapshot`](Self::write_snapshot),
    /// with the same tenants (names, ids), nodes, owners and times; the tree clock continues
    /// from the snapshot's. The id of a tenant removed before the snapshot stays stale: a
    /// tenant added to the restored tree never gets it (snapshots of format version 1, which
    /// did not record free slots, excepted). Any malformed, truncated, damaged or hostile input is a
    /// [`SnapshotError`] naming what is wrong; restoring allocates in proportion to the bytes
    /// it has read (but for the slot table a version 1 snapshot's slot count asks for: at most
    /// about 24 MiB, at [`MAX_TENANTS`] slots), and a restored tree
    /// always passes its invariant checks.
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
                return Err(p.invalid("a live tenant's generation is even"));
            }
            let name: Arc<str> = Arc::from(name);
            if !names.insert(name.clone()) {
                return Err(p.invalid(format!("tenant name {name:?} appears twice")));
            }
            if tenants.insert(slot, (gen, root_ts, name)).is_some() {
                return Err(p.invalid(format!("slot {slot} appears twice")));
            }
        }
        // The generations of the slots no tenant holds (version 2 on; 0 before, as for a slot
        // never used).
        // (Allocated once the record's bytes are read: a restore allocates in proportion to
        // what it has read.)
        let mut free_gens: Vec<u32> = Vec::new();
        if r.version() >= 2 {
            let pos = r.position();
            let rec = r
                .next_record()?
                .ok_or_else(|| invalid(Some(pos), "no slots record"))?;
            if rec.tag != SLOTS {
                return Err(invalid(Some(pos), "expected the slots record"));
            }
            let mut p = Payload::new(rec.payload, pos);
            if rec.payload.len() != 4 * slots_in_use as usize {
                return Err(p.invalid(format!(
                    "the slots record holds {} bytes, not 4 per slot in use ({slots_in_use})",
                    rec.payload.len()
                )));
            }
            free_gens = vec![0; slots_in_use as usize];
            for (s, free) in free_gens.iter_mut().enumerate() {
                let gen = p.u32("a slot's generation")?;
                match tenants.get(&(s as u32)) {
                    Some(&(g, ..)) if g != gen => {
                        return Err(
                            p.invalid(format!("slot {s} has generation {gen}, its tenant {g}"))
                        );
                    }
                    Some(_) => {}
                    None if gen & 1 == 1 => {
                        return Err(p.invalid(format!(
                            "free slot {s} has the generation of a live tenant ({gen})"
                        )));
                    }
                    None => *free = gen,
                }
            }
            p.end()?;
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
        // The root's owners with their times raised to its children's (a live snapshot wrote
        // the tenants' root times before the nodes, which may be newer).
        let mut root_times: Vec<(u32, u64)> = Vec::new();
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
                // A node's times are at least its children's (eviction relies on it). One pass
                // over the children's owners also notes which owners own a child (linear in
                // what was read: a test per owner and child was quadratic on wide nodes).
                let mut owners = f.owners;
                let mut owns_child = vec![false; owners.len()];
                for (_, co) in &child_owners {
                    for &(s, t) in co {
                        if let Ok(i) = owners.binary_search_by_key(&s, |x| x.0) {
                            owners[i].1 = owners[i].1.max(t);
                            owns_child[i] = true;
                        }
                    }
                }
                if stack.is_empty() {
                    // The root.
                    root_children = Some(children);
                    root_times = owners;
                    break;
                }
                let mut node = f.node.expect("only the root has no node");
                let id = node.node().id();
                node.set_owners(NewOwners::from_sorted(&owners));
                let node_chars = node.node().chars();
                // Leaves of each owner: it owns the node but none of its children.
                for (&(s, t), &owns_child) in owners.iter().zip(&owns_child) {
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
                let gen = free_gens.get(s as usize).copied().unwrap_or(0);
                if gen != 0 {
                    // The next tenant on this slot gets a generation above every earlier
                    // tenant's of it, moved on by a step of this tree's own: two trees restored
                    // from one snapshot then issue different ids to the tenants they add (so
                    // an id of one is unknown to the other), and neither issues the original
                    // tree's next id. Only the generation is kept: a state is made when a
                    // tenant takes the slot (a snapshot of many free slots stays small).
                    let table = tree.slots.reserve(s as usize, &guard);
                    table.set_gen(s as usize, gen.wrapping_add(restore_step(reg.first_gen)));
                }
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
            let below = root_times
                .binary_search_by_key(&s, |x| x.0)
                .map_or(0, |i| root_times[i].1);
            st.root_ts.store((*root_ts).max(below), Ordering::Relaxed);
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
        tree.store.slab.settle(
            [None, None],
            Counts {
                nodes: nodes as isize,
                chars: chars as isize,
                bytes: bytes as isize,
            },
        );
        // The newest time in the tree: a live snapshot read its clock before the nodes, so
        // inserts that ran during the write may carry later times.
        let newest = root_times
            .iter()
            .map(|x| x.1)
            .chain(tenants.values().map(|v| v.1))
            .max()
            .unwrap_or(0);
        let mut tree = tree;
        // The clock resumes where the snapshot's stopped, or at its newest time if that is
        // later (whatever the machine's uptime: an `Instant` that far back may not exist).
        tree.origin = Instant::now();
        tree.clock_base = clock.max(newest);
        Ok(tree)
    }
}

/// How far a restored tree moves a free slot's generation on: even (a free slot's generation
/// stays even), at least 2, and drawn from the tree's own first generation, so that two trees
/// restored from one snapshot almost surely differ (one chance in 2^19 that they do not).
fn restore_step(first_gen: u32) -> u32 {
    2 * (1 + (first_gen >> 11))
}

fn invalid(record: Option<u64>, reason: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid {
        record,
        reason: reason.into(),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::NodeSnapshot;
    use std::io;

    /// A sink that changes the tree it receives a snapshot of, each time the walk writes a
    /// chunk out (between pins): `churn(tree, call)`.
    struct Meddler<'t, F: FnMut(&PrefixTree, usize)> {
        tree: &'t PrefixTree,
        bytes: Vec<u8>,
        calls: usize,
        churn: F,
    }

    impl<F: FnMut(&PrefixTree, usize)> Write for Meddler<'_, F> {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            (self.churn)(self.tree, self.calls);
            self.calls += 1;
            self.bytes.extend_from_slice(b);
            Ok(b.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A chain far deeper than a chunk: a chunk writes at least as many nodes as its first
    /// node is deep, so the chunks (one sink write each) grow geometrically. They used to be
    /// one per node here, each found again from the root (quadratic time in the depth).
    #[test]
    fn a_deep_chain_is_written_in_few_chunks() {
        let depth = if cfg!(miri) { 40 } else { 3_000 };
        let tree = PrefixTree::new();
        let a = tree.add_tenant("a");
        // Longest first: each shorter text splits the top edge, one node deeper.
        let s = "a".repeat(depth);
        for k in (1..=depth).rev() {
            tree.insert_at(&s[..k], a, (depth - k) as u64).unwrap();
        }
        let mut sink = Meddler {
            tree: &tree,
            bytes: Vec::new(),
            calls: 0,
            churn: |_: &PrefixTree, _: usize| {},
        };
        let summary = tree.write_snapshot_in_chunks(&mut sink, 1).unwrap();
        assert_eq!(summary.nodes, depth as u64);
        let log2 = (usize::BITS - depth.leading_zeros()) as usize;
        assert!(
            sink.calls <= 2 * log2 + 4,
            "{} sink writes for a chain of {depth}",
            sink.calls
        );
        let restored = PrefixTree::read_snapshot(&sink.bytes[..]).unwrap();
        assert!(restored.snapshot() == tree.snapshot());
    }

    /// Prompts sharing prefixes at several depths: `{topic}/{sub}/{n}` with long segments.
    fn prompts(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| {
                format!(
                    "topic {} {}/sub {} {}/item {i}",
                    i % 3,
                    "x".repeat(20),
                    i % 7,
                    "y".repeat(10)
                )
            })
            .collect()
    }

    /// Chunks of one and of three nodes while the sink splits pending edges, evicts and
    /// re-grows the other tenant's paths (also longer than before, so that a pending node's
    /// path may end inside an edge) and adds new prompts: the snapshot restores to a valid
    /// tree holding every prompt the untouched tenant had before it began.
    #[test]
    fn a_snapshot_written_in_chunks_survives_changes_between_them() {
        let n = if cfg!(miri) { 12 } else { 60 };
        for chunk in [1, 3] {
            let tree = PrefixTree::new();
            let (a, b) = (tree.add_tenant("a"), tree.add_tenant("b"));
            let ps = prompts(n);
            for (i, p) in ps.iter().enumerate() {
                tree.insert_at(p, if i % 2 == 0 { a } else { b }, i as u64)
                    .unwrap();
            }
            let mut sink = Meddler {
                tree: &tree,
                bytes: Vec::new(),
                calls: 0,
                churn: |t: &PrefixTree, call: usize| {
                    let ts = 1_000 + call as u64;
                    let p = &ps[(call * 7 + call / 5) % n];
                    match call % 5 {
                        // Split an edge somewhere inside a prompt's path.
                        0 => t
                            .insert_at(&format!("{}#{call}", &p[..p.len() / 2]), b, ts)
                            .unwrap(),
                        // Evict some of b's oldest leaves (pruning nodes a does not own).
                        1 => {
                            t.evict_tenant_by_lru(b, 40);
                        }
                        // b takes a prompt (an owner change on a's paths, or a re-insert).
                        2 => t.insert_at(p, b, ts).unwrap(),
                        // b's paths grow past where they ended.
                        3 => t.insert_at(&format!("{p} and more {call}"), b, ts).unwrap(),
                        // New prompts for a (concurrent: may or may not be in the snapshot).
                        _ => t.insert_at(&format!("new {call} {p}"), a, ts).unwrap(),
                    }
                    t.collect_garbage();
                },
            };
            let summary = tree.write_snapshot_in_chunks(&mut sink, chunk).unwrap();
            let restored = PrefixTree::read_snapshot(&sink.bytes[..]).unwrap();
            restored.check_invariants().unwrap();
            // One sink write per chunk, then the trailer; a chunk holds `chunk` nodes, or as
            // many as its first node is deep.
            let mut deepest = 0;
            let plain = restored.snapshot();
            let mut stack = vec![(&plain, 0u64)];
            while let Some((n, d)) = stack.pop() {
                deepest = deepest.max(d);
                stack.extend(n.children.iter().map(|c| (c, d + 1)));
            }
            assert!(deepest >= 3, "a tree deeper than a chunk");
            assert!(
                sink.calls as u64 > summary.nodes / deepest.max(chunk as u64),
                "{} sink writes for {} nodes at most {deepest} deep",
                sink.calls,
                summary.nodes
            );
            assert_eq!(restored.tenant_id("a"), Some(a));
            // A tenant's time at the root is at least its time on any node (the tenant records
            // were written before the nodes, which the sink kept touching).
            let snap = restored.snapshot();
            for (t, root_ts) in &snap.tenants {
                let mut stack: Vec<&NodeSnapshot> = snap.children.iter().collect();
                while let Some(n) = stack.pop() {
                    if let Some((_, ts)) = n.tenants.iter().find(|(o, _)| o == t) {
                        assert!(
                            ts <= root_ts,
                            "chunk {chunk}: {t:?} at {ts} under {root_ts}"
                        );
                    }
                    stack.extend(n.children.iter());
                }
            }
            for p in ps.iter().step_by(2) {
                let m = restored.prefix_match(p, Some(&[a]));
                assert_eq!(m.matched_chars, p.chars().count(), "chunk {chunk}: {p}");
            }
        }
    }
}
