//! A sequential reference model of [`PrefixTree`](crate::tree::PrefixTree)'s semantics.
//!
//! Deliberately simple and slow: text is a `Vec<char>`, nodes live in a `Vec` arena, owners in
//! a `BTreeMap`, eviction scans every node. The proptests and the `tree_ops` fuzz target apply
//! the same operations to it and to the real tree and compare every result.
//!
//! ```
//! use kvtrie::model::ModelTree;
//! let mut m = ModelTree::default();
//! let a = m.add_tenant("a");
//! m.insert("hello", a, 1).unwrap();
//! assert_eq!(m.prefix_match("help", None), (3, vec![a]));
//! ```

use std::collections::BTreeMap;

/// A tenant of the model: its registration number (never reused).
pub type ModelTenant = usize;

#[derive(Clone, Debug)]
struct MNode {
    text: Vec<char>,
    children: Vec<usize>,
    owners: BTreeMap<ModelTenant, u64>,
    parent: usize,
}

/// The reference model.
#[derive(Clone, Debug)]
pub struct ModelTree {
    nodes: Vec<Option<MNode>>,
    names: Vec<String>,
    live: BTreeMap<ModelTenant, usize>,
}

impl Default for ModelTree {
    fn default() -> Self {
        Self {
            nodes: vec![Some(MNode {
                text: Vec::new(),
                children: Vec::new(),
                owners: BTreeMap::new(),
                parent: usize::MAX,
            })],
            names: Vec::new(),
            live: BTreeMap::new(),
        }
    }
}

/// A node of [`ModelTree::snapshot`]: text, owners with times, children sorted by text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSnapshot {
    /// Edge text.
    pub text: String,
    /// Owners and times.
    pub tenants: Vec<(ModelTenant, u64)>,
    /// Children sorted by text.
    pub children: Vec<ModelSnapshot>,
}

impl ModelTree {
    fn n(&self, i: usize) -> &MNode {
        self.nodes[i].as_ref().expect("live node")
    }

    fn nm(&mut self, i: usize) -> &mut MNode {
        self.nodes[i].as_mut().expect("live node")
    }

    /// Registers a tenant (idempotent by name among live tenants).
    pub fn add_tenant(&mut self, name: &str) -> ModelTenant {
        if let Some(&t) = self.live.keys().find(|&&t| self.names[t] == name) {
            return t;
        }
        let t = self.names.len();
        self.names.push(name.to_string());
        self.live.insert(t, 0);
        self.nm(0).owners.insert(t, 0);
        t
    }

    /// Is `t` live?
    pub fn is_live(&self, t: ModelTenant) -> bool {
        self.live.contains_key(&t)
    }

    /// The live tenants.
    pub fn tenants(&self) -> Vec<ModelTenant> {
        self.live.keys().copied().collect()
    }

    /// `t`'s char count.
    pub fn char_count(&self, t: ModelTenant) -> Option<usize> {
        self.live.get(&t).copied()
    }

    /// Inserts `text` for `t` at time `ts`; `Err(())` for an unknown tenant.
    #[allow(clippy::result_unit_err)]
    pub fn insert(&mut self, text: &str, t: ModelTenant, ts: u64) -> Result<(), ()> {
        if !self.is_live(t) {
            return Err(());
        }
        let text: Vec<char> = text.chars().collect();
        if text.is_empty() {
            return Ok(());
        }
        let mut cur = 0;
        let mut i = 0;
        self.touch(cur, t, ts);
        while i < text.len() {
            let rest = &text[i..];
            let child = self
                .n(cur)
                .children
                .iter()
                .copied()
                .find(|&c| self.n(c).text[0] == rest[0]);
            let Some(c) = child else {
                let leaf = self.nodes.len();
                self.nodes.push(Some(MNode {
                    text: rest.to_vec(),
                    children: Vec::new(),
                    owners: BTreeMap::from([(t, ts)]),
                    parent: cur,
                }));
                self.nm(cur).children.push(leaf);
                *self.live.get_mut(&t).unwrap() += rest.len();
                return Ok(());
            };
            let shared = self
                .n(c)
                .text
                .iter()
                .zip(rest)
                .take_while(|(a, b)| a == b)
                .count();
            let next = if shared < self.n(c).text.len() {
                // Split `c` into prefix `p` (new) and `c` keeping the suffix.
                let p = self.nodes.len();
                let prefix = self.n(c).text[..shared].to_vec();
                let owners = self.n(c).owners.clone();
                self.nodes.push(Some(MNode {
                    text: prefix,
                    children: vec![c],
                    owners,
                    parent: cur,
                }));
                let suffix = self.n(c).text[shared..].to_vec();
                self.nm(c).text = suffix;
                self.nm(c).parent = p;
                let siblings = &mut self.nm(cur).children;
                let k = siblings.iter().position(|&x| x == c).unwrap();
                siblings[k] = p;
                p
            } else {
                c
            };
            self.touch(next, t, ts);
            i += shared;
            cur = next;
        }
        Ok(())
    }

    fn touch(&mut self, node: usize, t: ModelTenant, ts: u64) {
        let len = self.n(node).text.len();
        match self.nm(node).owners.get_mut(&t) {
            Some(old) => *old = (*old).max(ts),
            None => {
                self.nm(node).owners.insert(t, ts);
                *self.live.get_mut(&t).unwrap() += len;
            }
        }
    }

    /// `(matched chars, owners of the deepest node among available)`.
    pub fn prefix_match(
        &self,
        text: &str,
        available: Option<&[ModelTenant]>,
    ) -> (usize, Vec<ModelTenant>) {
        let ok = |t: &ModelTenant| self.is_live(*t) && available.is_none_or(|a| a.contains(t));
        let text: Vec<char> = text.chars().collect();
        let mut cur = 0;
        let mut i = 0;
        while i < text.len() {
            let child = self
                .n(cur)
                .children
                .iter()
                .copied()
                .find(|&c| self.n(c).text[0] == text[i]);
            let Some(c) = child else { break };
            if !self.n(c).owners.keys().any(ok) {
                break;
            }
            let shared = self
                .n(c)
                .text
                .iter()
                .zip(&text[i..])
                .take_while(|(a, b)| a == b)
                .count();
            i += shared;
            cur = c;
            if shared < self.n(c).text.len() {
                break;
            }
        }
        (i, self.n(cur).owners.keys().copied().filter(ok).collect())
    }

    fn detach(&mut self, node: usize, t: ModelTenant) -> usize {
        if self.nm(node).owners.remove(&t).is_none() {
            return 0;
        }
        let len = self.n(node).text.len();
        *self.live.get_mut(&t).unwrap() -= len;
        if node != 0 && self.n(node).owners.is_empty() {
            assert!(self.n(node).children.is_empty(), "prefix closure");
            let p = self.n(node).parent;
            self.nm(p).children.retain(|&c| c != node);
            self.nodes[node] = None;
        }
        len
    }

    fn depth(&self, mut node: usize) -> usize {
        let mut d = 0;
        while node != 0 {
            node = self.n(node).parent;
            d += 1;
        }
        d
    }

    /// Removes `t` everywhere; returns chars removed.
    pub fn remove_tenant(&mut self, t: ModelTenant) -> usize {
        if !self.is_live(t) {
            return 0;
        }
        let mut owned: Vec<usize> = (1..self.nodes.len())
            .filter(|&i| {
                self.nodes[i]
                    .as_ref()
                    .is_some_and(|n| n.owners.contains_key(&t))
            })
            .collect();
        owned.sort_by_key(|&i| std::cmp::Reverse(self.depth(i)));
        let removed = owned.into_iter().map(|i| self.detach(i, t)).sum();
        self.nm(0).owners.remove(&t);
        self.live.remove(&t);
        removed
    }

    /// LRU eviction by whole timestamp groups; returns chars removed.
    pub fn evict_tenant_by_lru(&mut self, t: ModelTenant, min_chars: usize) -> usize {
        if min_chars == 0 || !self.is_live(t) {
            return 0;
        }
        let mut removed = 0;
        while removed < min_chars {
            let owned: Vec<(usize, u64)> = (1..self.nodes.len())
                .filter_map(|i| Some((i, *self.nodes[i].as_ref()?.owners.get(&t)?)))
                .collect();
            let Some(min) = owned.iter().map(|x| x.1).min() else {
                break;
            };
            let mut group: Vec<usize> = owned.iter().filter(|x| x.1 == min).map(|x| x.0).collect();
            group.sort_by_key(|&i| std::cmp::Reverse(self.depth(i)));
            for i in group {
                removed += self.detach(i, t);
            }
        }
        removed
    }

    /// Tenants tied at the minimum count among `available`.
    pub fn smallest_tenants(&self, available: Option<&[ModelTenant]>) -> Vec<ModelTenant> {
        let cands: Vec<(ModelTenant, usize)> = self
            .live
            .iter()
            .filter(|(t, _)| available.is_none_or(|a| a.contains(t)))
            .map(|(&t, &c)| (t, c))
            .collect();
        let Some(min) = cands.iter().map(|x| x.1).min() else {
            return Vec::new();
        };
        cands
            .into_iter()
            .filter(|x| x.1 == min)
            .map(|x| x.0)
            .collect()
    }

    /// Number of nodes other than the root.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().flatten().count() - 1
    }

    /// The tree as plain data.
    pub fn snapshot(&self) -> ModelSnapshot {
        self.snap(0)
    }

    fn snap(&self, i: usize) -> ModelSnapshot {
        let n = self.n(i);
        let mut children: Vec<ModelSnapshot> = n.children.iter().map(|&c| self.snap(c)).collect();
        children.sort_by(|a, b| a.text.cmp(&b.text));
        ModelSnapshot {
            text: n.text.iter().collect(),
            tenants: n.owners.iter().map(|(&t, &ts)| (t, ts)).collect(),
            children,
        }
    }
}

/// One operation of a differential run (see [`run_differential`]). Tenants are named by small
/// numbers (`n` ↦ `"t{n}"`); an operation on a name never added is skipped.
#[derive(Clone, Debug)]
pub enum DiffOp {
    /// `add_tenant`.
    Add(u8),
    /// `insert_at(text, name, ts)`.
    Insert(String, u8, u64),
    /// `prefix_match(text, available names)`.
    Match(String, Option<Vec<u8>>),
    /// `remove_tenant`.
    Remove(u8),
    /// `remove_tenants` of the names' ids, in this order (repeats and removed names
    /// included; names never added are left out).
    RemoveMany(Vec<u8>),
    /// `evict_tenant_by_lru(name, min_chars)`.
    Evict(u8, usize),
    /// `smallest_tenants(available names)`.
    Smallest(Option<Vec<u8>>),
    /// `match_and_insert(text, available, ts, choose)`: `choose` picks the `pick`-th tenant of
    /// the match (modulo its size); when the match has no tenant it picks the tenant named
    /// `fallback` (possibly removed), or declines when `fallback` is `None`.
    MatchAndInsert(String, Option<Vec<u8>>, u64, usize, Option<u8>),
}

/// Real and model ids of each tenant name (the latest incarnation, possibly removed).
#[derive(Default)]
struct Ids {
    by_name: std::collections::HashMap<u8, (crate::tenant::TenantId, ModelTenant)>,
    to_model: std::collections::HashMap<crate::tenant::TenantId, ModelTenant>,
}

impl Ids {
    fn get(&self, n: u8) -> Option<(crate::tenant::TenantId, ModelTenant)> {
        self.by_name.get(&n).copied()
    }

    fn list(
        &self,
        v: &Option<Vec<u8>>,
    ) -> (
        Option<Vec<crate::tenant::TenantId>>,
        Option<Vec<ModelTenant>>,
    ) {
        match v {
            None => (None, None),
            Some(names) => {
                let pairs: Vec<_> = names.iter().filter_map(|&n| self.get(n)).collect();
                (
                    Some(pairs.iter().map(|p| p.0).collect()),
                    Some(pairs.iter().map(|p| p.1).collect()),
                )
            }
        }
    }

    /// Maps real ids to model ids, sorted (slot order and registration order differ once slots
    /// are reused).
    fn map(&self, v: impl IntoIterator<Item = crate::tenant::TenantId>) -> Vec<ModelTenant> {
        let mut m: Vec<ModelTenant> = v.into_iter().map(|t| self.to_model[&t]).collect();
        m.sort_unstable();
        m
    }

    fn convert(&self, s: &crate::tree::NodeSnapshot) -> ModelSnapshot {
        let mut tenants: Vec<_> = s
            .tenants
            .iter()
            .map(|&(t, ts)| (self.to_model[&t], ts))
            .collect();
        tenants.sort_unstable();
        ModelSnapshot {
            text: s.text.clone(),
            tenants,
            children: s.children.iter().map(|c| self.convert(c)).collect(),
        }
    }

    fn check_match(
        &self,
        text: &str,
        got: &crate::tree::PrefixMatch,
        want: &(usize, Vec<ModelTenant>),
    ) {
        assert_eq!(
            (got.matched_chars, self.map(got.tenants.iter())),
            *want,
            "match {text:?}"
        );
        let bytes: usize = text
            .chars()
            .take(got.matched_chars)
            .map(char::len_utf8)
            .sum();
        assert_eq!(got.matched_bytes, bytes, "matched bytes of {text:?}");
    }
}

/// Applies `ops` to a real [`PrefixTree`](crate::tree::PrefixTree) and to a [`ModelTree`] and
/// panics at the first difference: every result, and after each operation the tree's
/// invariants (`check_invariants`), every tenant's char count and liveness, the live tenants
/// and the node count; at the end the whole snapshot, and that removing every tenant empties
/// the tree. Shared by the proptest (`tests/model.rs`) and the `tree_ops` fuzz target.
///
/// ```
/// use kvtrie::model::{run_differential, DiffOp};
/// run_differential(&[
///     DiffOp::Add(0),
///     DiffOp::Insert("héllo".into(), 0, 1),
///     DiffOp::Match("hélp".into(), None),
///     DiffOp::Evict(0, 1),
/// ]);
/// ```
pub fn run_differential(ops: &[DiffOp]) {
    let tree = crate::tree::PrefixTree::new();
    let mut model = ModelTree::default();
    let mut ids = Ids::default();
    for op in ops {
        match op {
            DiffOp::Add(n) => {
                let name = format!("t{n}");
                let t = tree.add_tenant(&name);
                let m = model.add_tenant(&name);
                assert_eq!(tree.tenant_id(&name), Some(t));
                assert_eq!(tree.tenant_name(t).as_deref(), Some(name.as_str()));
                ids.by_name.insert(*n, (t, m));
                ids.to_model.insert(t, m);
            }
            DiffOp::Insert(text, n, ts) => {
                let Some((t, m)) = ids.get(*n) else { continue };
                let r = tree.insert_at(text, t, *ts);
                let mr = model.insert(text, m, *ts);
                assert_eq!(r.is_ok(), mr.is_ok(), "{op:?}: {r:?}");
            }
            DiffOp::Match(text, avail) => {
                let (ra, ma) = ids.list(avail);
                let got = tree.prefix_match(text, ra.as_deref());
                ids.check_match(text, &got, &model.prefix_match(text, ma.as_deref()));
            }
            DiffOp::Remove(n) => {
                let Some((t, m)) = ids.get(*n) else { continue };
                assert_eq!(tree.remove_tenant(t), model.remove_tenant(m), "{op:?}");
                assert_eq!(tree.tenant_name(t), None);
            }
            DiffOp::RemoveMany(names) => {
                let (real, model_ids): (Vec<_>, Vec<_>) =
                    names.iter().filter_map(|&n| ids.get(n)).unzip();
                let want: Vec<usize> = model_ids.iter().map(|&m| model.remove_tenant(m)).collect();
                assert_eq!(tree.remove_tenants(&real), want, "{op:?}");
                for t in real {
                    assert_eq!(tree.tenant_name(t), None);
                }
            }
            DiffOp::Evict(n, c) => {
                let Some((t, m)) = ids.get(*n) else { continue };
                let got = tree.evict_tenant_by_lru(t, *c);
                assert_eq!(got, model.evict_tenant_by_lru(m, *c), "{op:?}");
            }
            DiffOp::Smallest(avail) => {
                let (ra, ma) = ids.list(avail);
                let mut want = model.smallest_tenants(ma.as_deref());
                want.sort_unstable();
                assert_eq!(
                    ids.map(tree.smallest_tenants(ra.as_deref())),
                    want,
                    "{op:?}"
                );
            }
            DiffOp::MatchAndInsert(text, avail, ts, pick, fallback) => {
                let (ra, ma) = ids.list(avail);
                let fb = fallback.and_then(|f| ids.get(f));
                let want = model.prefix_match(text, ma.as_deref());
                let mut out = crate::tree::PrefixMatch::default();
                let mut chosen = None;
                let r = tree.match_and_insert(text, ra.as_deref(), *ts, &mut out, |m| {
                    chosen = if m.tenants.is_empty() {
                        fb.map(|f| f.0)
                    } else {
                        Some(m.tenants.as_slice()[pick % m.tenants.len()])
                    };
                    chosen
                });
                ids.check_match(text, &out, &want);
                match chosen {
                    None => assert_eq!(r, Ok(None), "{op:?}"),
                    Some(t) => match model.insert(text, ids.to_model[&t], *ts) {
                        Ok(()) => assert_eq!(r, Ok(Some(t)), "{op:?}"),
                        Err(()) => {
                            assert_eq!(r, Err(crate::tree::Error::UnknownTenant(t)), "{op:?}")
                        }
                    },
                }
            }
        }
        tree.check_invariants()
            .unwrap_or_else(|e| panic!("after {op:?}: {e}"));
        for &(t, m) in ids.by_name.values() {
            assert_eq!(
                tree.char_count(t),
                model.char_count(m),
                "count after {op:?}"
            );
            assert_eq!(tree.is_live(t), model.is_live(m), "liveness after {op:?}");
        }
        assert_eq!(
            ids.map(tree.tenants()),
            model.tenants(),
            "tenants after {op:?}"
        );
        assert_eq!(tree.node_count(), model.node_count(), "nodes after {op:?}");
    }
    assert_eq!(ids.convert(&tree.snapshot()), model.snapshot());
    for t in tree.tenants() {
        tree.remove_tenant(t);
    }
    assert_eq!((tree.node_count(), tree.distinct_chars()), (0, 0));
    tree.check_invariants().unwrap();
}
