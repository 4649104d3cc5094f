//! The raw core of the tree: node, owner-table and child-table layouts, node locks, and every
//! raw dereference the tree makes.
//!
//! Every object here is one heap allocation with a fixed header followed by a variable-length
//! tail; a node's first owner table (a new leaf's single owner, or a split suffix's copy of the
//! split node's table when it is small) lives inside the node's allocation, after the text (it
//! is freed with the node, never retired on its own). Nodes and
//! tables are published with `Release` stores and read with `Acquire` loads while the reader
//! holds an epoch guard; once replaced or unlinked they are retired through
//! [`crate::reclaim`]. The edge text of a node and the membership (bits) of an owner table are
//! immutable after publication; only per-owner timestamps are mutated in place (monotone
//! `fetch_max`), a child slot is swapped in place when the child is split, and a small child
//! table appends a new child in a free slot (entry first, then its length with `Release`;
//! readers read only the entries below the length they loaded).
//!
//! # Writers: per-node locks
//!
//! Each node has a lock word ([`Node::lock`]). A node's owner table and child table are replaced
//! only by the holder of its lock, through a [`NodeLock`]; that is the only way to publish
//! anything, so the type system carries the rule. A node that is unlinked (pruned, or replaced
//! by a split) is marked *obsolete* while locked and is never unlocked again: a writer that was
//! waiting for it sees the mark and retries from a live ancestor (optimistic lock coupling, as
//! in ART/congee). Readers never look at the lock word.
//!
//! # Guards and lifetimes
//!
//! Accessors that follow a pointer take the caller's epoch guard and return references bounded
//! by it: `fn owners<'g>(&'g self, guard: &'g Guard) -> &'g Owners`. A `&Node` or a
//! `&ChildTable` is itself only ever obtained under a guard (or with the tree exclusively
//! owned), so the objects it names stay allocated for as long as the reference.
//!
//! # Files
//!
//! `node.rs`: the node header, its lock and the builders of unpublished nodes;
//! `owners.rs`: owner tables (membership and times) and owner masks; `children.rs`: child
//! tables.

mod children;
mod node;
mod owners;

pub(crate) use node::{free_tree, new_root, NewNode, Node, NodeLock, PreparedSplit, MAX_NODE_ID};
#[cfg(all(test, not(loom)))]
pub(crate) use owners::Owners;
pub(crate) use owners::{Mask, NewOwners, Without};
