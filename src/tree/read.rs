//! Reads: the lock-free descent shared by [`PrefixTree::prefix_match`] and routing.

use super::raw::{Mask, Node};
use super::{PrefixMatch, PrefixTree};
use crate::reclaim::{self, Guard};
use crate::tenant::TenantId;
use crate::text;
use std::cell::Cell;

thread_local! {
    /// Mask words beyond the stack's 1024 slots, kept per thread so that a warm thread's
    /// matches allocate nothing: taken for a call and given back after it (a call nested in a
    /// router's `choose` finds it taken and uses a buffer of its own).
    static MASK_WORDS: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
}

/// This thread's mask buffer (empty if taken or gone).
pub(super) fn take_mask_words() -> Vec<u64> {
    MASK_WORDS.try_with(Cell::take).unwrap_or_default()
}

/// Gives the mask buffer back to this thread.
pub(super) fn give_back_mask_words(words: Vec<u64>) {
    let _ = MASK_WORDS.try_with(|c| c.set(words));
}

/// Capacity of a [`RecordedPath`] (deeper paths record no further; the insert re-walks).
const PATH_CAP: usize = 48;

/// The path a lock-free descent recorded: the root and each node whose whole edge matched,
/// valid while the guard the descent ran under lives.
pub(super) struct RecordedPath<'g> {
    nodes: [&'g Node; PATH_CAP],
    len: usize,
    /// Bytes of text consumed by the recorded nodes.
    pub(super) offset: usize,
    /// The descent consumed the whole text exactly at the last recorded node.
    pub(super) exact: bool,
    /// Where the text left the tree after the last recorded node.
    pub(super) divergence: Divergence<'g>,
}

/// How a lock-free descent left the tree (lets an insert prepare its nodes before locking).
#[derive(Clone, Copy)]
pub(super) enum Divergence<'g> {
    /// Not known (the path was truncated or is exact).
    Unknown,
    /// The last recorded node has no child for the next char.
    NoChild,
    /// The text diverges `lcp` bytes into this child of the last recorded node.
    Partial { child: &'g Node, lcp: usize },
}

impl<'g> RecordedPath<'g> {
    /// An empty path (`root` only fills the unused entries).
    pub(super) fn new(root: &'g Node) -> Self {
        Self {
            nodes: [root; PATH_CAP],
            len: 0,
            offset: 0,
            exact: false,
            divergence: Divergence::Unknown,
        }
    }

    pub(super) fn push(&mut self, n: &'g Node) -> bool {
        if self.len == PATH_CAP {
            return false;
        }
        self.nodes[self.len] = n;
        self.len += 1;
        true
    }

    /// Number of recorded nodes.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Recorded node `i` (the root is 0).
    pub(super) fn get(&self, i: usize) -> &'g Node {
        self.nodes[..self.len][i]
    }

    /// Bytes of text consumed by recorded nodes `0..=i`.
    pub(super) fn offset_after(&self, i: usize) -> usize {
        self.nodes[1..=i].iter().map(|n| n.len()).sum()
    }

    /// The recorded nodes, root first.
    pub(super) fn iter(&self) -> impl Iterator<Item = &'g Node> + '_ {
        self.nodes[..self.len].iter().copied()
    }
}

impl PrefixTree {
    /// The longest prefix of `text` stored in the tree, walking only into nodes owned by at
    /// least one of `available` (`None`: all live tenants; `Some(&[])`: none; unknown ids are
    /// ignored). A partial match inside the last node counts. Read-only and lock-free.
    ///
    /// ```
    /// let tree = kvtrie::PrefixTree::new();
    /// let a = tree.add_tenant("a");
    /// tree.insert("hello", a).unwrap();
    /// assert_eq!(tree.prefix_match("help", None).matched_chars, 3);
    /// assert_eq!(tree.prefix_match("help", Some(&[])).matched_chars, 0);
    /// ```
    pub fn prefix_match(&self, text: &str, available: Option<&[TenantId]>) -> PrefixMatch {
        let mut out = PrefixMatch::default();
        self.prefix_match_into(text, available, &mut out);
        out
    }

    /// [`prefix_match`](Self::prefix_match) writing into caller-owned storage: allocates
    /// nothing once `out.tenants` has room for the result (an `available` list with ids of slot
    /// 1024 or more uses a buffer that each thread allocates once).
    pub fn prefix_match_into(
        &self,
        text: &str,
        available: Option<&[TenantId]>,
        out: &mut PrefixMatch,
    ) {
        let guard = reclaim::pin();
        let mut stack_words = [0u64; 16];
        let mut heap_words = take_mask_words();
        let mask = self.mask(available, &mut stack_words, &mut heap_words, &guard);
        let mut path = RecordedPath::new(self.root());
        self.walk::<false>(text.as_bytes(), mask, out, &mut path, &guard);
        give_back_mask_words(heap_words);
    }

    /// The available tenants as a bit mask: the root's owner bits (all live tenants) for `None`,
    /// else the live ids of the list, in `stack` (or `heap` beyond 1024 slots).
    pub(super) fn mask<'a>(
        &'a self,
        available: Option<&[TenantId]>,
        stack: &'a mut [u64; 16],
        heap: &'a mut Vec<u64>,
        guard: &'a Guard,
    ) -> Mask<'a> {
        let table = self.slots.load(guard);
        match available {
            None => {
                let o = self.root().owners(guard);
                Mask {
                    lo: o.lo(),
                    words: o.bits(),
                }
            }
            Some(list) => {
                let max = list
                    .iter()
                    .filter(|t| table.is_live(**t))
                    .map(|t| t.slot())
                    .max();
                let words: &mut [u64] = match max {
                    Some(m) if m >= 64 * stack.len() => {
                        heap.clear();
                        heap.resize(m / 64 + 1, 0);
                        heap
                    }
                    Some(m) => &mut stack[..m / 64 + 1],
                    None => &mut stack[..0],
                };
                for t in list {
                    // `get_mut`: an id may turn live between the two passes (never index out of
                    // bounds on a racing `add_tenant`); such an id is simply not available.
                    if let Some(w) = words.get_mut(t.slot() / 64).filter(|_| table.is_live(*t)) {
                        *w |= 1 << (t.slot() % 64);
                    }
                }
                Mask { lo: 0, words }
            }
        }
    }

    /// The lock-free descent shared by reads and routing. Matches along `bytes` into `out`
    /// (stopping before a child no tenant of `mask` owns; a partial match in the last node
    /// counts). With `RECORD`, keeps descending through whole-edge matches regardless of
    /// owners and records that path for an insert.
    #[inline]
    pub(super) fn walk<'g, const RECORD: bool>(
        &'g self,
        bytes: &[u8],
        mask: Mask<'_>,
        out: &mut PrefixMatch,
        path: &mut RecordedPath<'g>,
        guard: &'g Guard,
    ) {
        let table = self.slots.load(guard);
        let root = self.root();
        // The deepest node of the match, seen through one read of its owners: the result set
        // is built from the same read that admitted the node.
        let mut matched = root.owner_view(mask, guard);
        // An empty mask (e.g. a plain insert) matches nothing: only record.
        let mut matching = mask.words.iter().any(|&w| w != 0);
        // Recording stops when the path buffer is full; matching goes on.
        let mut recording = RECORD;
        let (mut matched_bytes, mut matched_chars) = (0usize, 0usize);
        let mut off = 0usize;
        if RECORD {
            path.push(root);
        }
        // The child the text from `off` on continues into, looked up one step ahead (below).
        let mut next = Self::child_for(root, bytes, guard);
        while off < bytes.len() {
            let rest = &bytes[off..];
            let Some(child) = next else {
                if recording {
                    path.divergence = Divergence::NoChild;
                }
                break;
            };
            let edge = child.text();
            // The child's owners, read before its child table below: a reader that sees an
            // owner table (Acquire) then sees every child linked beneath the node before that
            // table was published, so the tenants it reports never come with an older child
            // list. (Read after the table, a reader could miss the new child of a completed
            // insert and report, at its parent, a tenant that a later insert added there: a
            // result no moment of the tree had; loom model `a_owners_read_before_children`.)
            let view = matching.then(|| child.owner_view(mask, guard));
            // The child's own child for the text after its edge, looked up before the edge is
            // compared (unused if the edge does not match) and its header prefetched, so that
            // its cache miss overlaps the comparison rather than following it.
            next = rest
                .get(edge.len()..)
                .and_then(|r| Self::child_for(child, r, guard));
            if let Some(n) = next {
                // The line at the node's start holds its child-table and owner pointers.
                crate::hint::prefetch(n as *const Node);
            }
            let full = text::starts_with(rest, edge);
            if recording && !full {
                path.divergence = Divergence::Partial {
                    child,
                    lcp: text::common_prefix(edge, rest),
                };
            }
            if let Some(view) = view {
                if view.any() {
                    matched = view;
                    if full {
                        matched_bytes += edge.len();
                        matched_chars += child.chars();
                    } else {
                        let l = text::common_prefix(edge, rest);
                        debug_assert!(l > 0, "a child's first char equals its key");
                        matched_bytes += l;
                        matched_chars += if child.is_ascii() {
                            l
                        } else {
                            text::char_count(&rest[..l])
                        };
                    }
                } else {
                    matching = false;
                }
            }
            if !full || !(recording || matching) {
                break;
            }
            if recording && !path.push(child) {
                // Path full: keep matching, record no more (the insert re-walks the rest).
                recording = false;
                path.offset = off;
                if !matching {
                    break;
                }
            }
            off += edge.len();
        }
        if recording {
            path.offset = off;
            path.exact = off == bytes.len();
        }
        out.matched_bytes = matched_bytes;
        out.matched_chars = matched_chars;
        out.tenants.clear();
        matched.for_each(mask, |s| out.tenants.push_ascending(table.id_of_seen(s)));
    }

    /// The child of `node` whose edge starts with the first char of `rest`: none if `rest` is
    /// empty or starts inside a char (as it can after an edge that does not match). Always
    /// inlined: the compiler left it a call, and W1 hot lookups ran about 2 % slower so.
    #[inline(always)]
    fn child_for<'g>(node: &'g Node, rest: &[u8], guard: &'g Guard) -> Option<&'g Node> {
        if rest.first().is_none_or(|&b| text::is_continuation(b)) {
            return None;
        }
        node.child(text::edge_key(rest), guard)
    }
}
