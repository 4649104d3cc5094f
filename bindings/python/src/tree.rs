//! `kvtrie.PrefixTree`: a drop-in for Ray Serve LLM's `PrefixTree`
//! (`ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_tree.py`, Ray 2.60.0).

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use arc_swap::ArcSwap;
use kvtrie::evict::EvictionTotals;
use kvtrie::{
    Error, EvictionConfig, EvictionHandle, NodeSnapshot, PrefixMatch, PrefixTree, TenantId,
    MAX_TEXT_BYTES,
};
use pyo3::exceptions::{PyAssertionError, PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyDict, PyList, PyString};

use crate::util::{
    drop_arc_in_background, drop_in_background, duration_arg, eviction_totals_dict, now_s,
    saturating_bound, saturating_count, str_list, text_arg, time_from_key, time_key, type_name,
    Entry, ForkGuarded, Registry,
};

thread_local! {
    /// Per-thread match result storage, so a lookup allocates nothing in the tree.
    static MATCH: RefCell<PrefixMatch> = RefCell::new(PrefixMatch::default());
}

/// Runs `f` with this thread's match storage (fresh storage if it is in use further up the
/// stack, e.g. a lookup made from a destructor that ran during another lookup).
fn with_match<R>(f: impl FnOnce(&mut PrefixMatch) -> R) -> R {
    MATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut m) => f(&mut m),
        Err(_) => f(&mut PrefixMatch::default()),
    })
}

/// A tree error as a Python exception.
pub fn tree_err(e: Error) -> PyErr {
    match e {
        Error::TextTooLong { .. } => PyValueError::new_err(e.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// `(matched_text, matched_tenants, chosen)` of `match_and_insert`.
type MatchInsert<'py> = (
    Bound<'py, PyString>,
    Option<Bound<'py, PyList>>,
    Option<Bound<'py, PyString>>,
);

/// The tenants a lookup may use: all (`None`), or the known ones of a list, in the list's
/// order and with its duplicates (what Ray's result lists follow).
enum Available {
    All,
    Known(Vec<(TenantId, Py<PyString>)>),
    /// A non-empty list none of whose names is a tenant.
    NoneKnown,
}

/// A concurrent prefix tree over prompt text shared by tenants (replicas): a drop-in for Ray
/// Serve LLM's ``PrefixTree`` with the same methods, arguments, defaults, return values and
/// Python types, backed by kvtrie's lock-free radix tree.
///
/// Lookups take no lock and release the GIL, so Python threads match in parallel; inserts
/// serialize only on structural changes. Text is any ``str`` (lengths in code points, as in
/// Ray).
///
/// Example::
///
///     >>> import kvtrie
///     >>> tree = kvtrie.PrefixTree()
///     >>> tree.add_tenants(["replica-a", "replica-b"], 0.0)
///     >>> tree.insert("hello world", "replica-a", 1.0)
///     >>> tree.insert("hello there", "replica-b", 2.0)
///     >>> tree.prefix_match("hello wor")
///     ('hello wor', ['replica-a'])
///     >>> tree.prefix_match("hello", ["replica-b"])
///     ('hello', ['replica-b'])
///     >>> tree.tenant_to_char_count == {"replica-a": 11, "replica-b": 11}
///     True
///     >>> tree.evict_tenant_by_lru("replica-a", 1)
///     11
///
/// Deliberate deviations from Ray (kvtrie's documented semantics):
///
/// * Timestamps are monotone per node: inserting with an older ``time_s`` keeps the newer
///   time (Ray overwrites it with the smaller value).
/// * Removing the same tenant twice in one ``remove_tenants`` call reports its chars once
///   (Ray reports 0 for the repeated name).
/// * Inserting ``""`` touches nothing (Ray refreshes the root's time).
/// * ``time_s`` and ``min_remove_size`` must not be NaN (``ValueError``); names and text
///   must be ``str`` (``TypeError``) holding no lone surrogates (``ValueError``; nothing is
///   changed); a bare ``str`` where Ray takes a list of names is a ``TypeError`` (Ray reads
///   ``"ab"`` as the names ``"a"`` and ``"b"``).
/// * Times are held as floats: integer times past 2**53 round as floats do (Ray keeps Python
///   ints exact).
/// * Ray's internals (``root``, ``Node``, ``lock``, ``tenant_to_lru_tail``,
///   ``_get_lru_chain``) are not exposed; ``snapshot()`` returns the tree as plain data.
#[pyclass(frozen, weakref, module = "kvtrie", name = "PrefixTree")]
pub struct PyPrefixTree {
    tree: Arc<PrefixTree>,
    reg: ArcSwap<Registry>,
    /// Serializes tenant changes (tree and registry together). Taken with
    /// `lock_py_attached`, so a thread waiting for it never holds the GIL.
    admin: Mutex<()>,
    eviction: Mutex<EvictionLoop>,
}

/// The eviction loop of a Python tree: its handle until stopped, then its final totals.
#[derive(Default)]
struct EvictionLoop {
    handle: Option<ForkGuarded<EvictionHandle>>,
    /// The final totals of the loop `stop_eviction_loop` stopped.
    stopped: Option<EvictionTotals>,
}

impl EvictionLoop {
    /// The loop's handle, if a loop was started here (not in a parent before a `fork`) and
    /// not stopped.
    fn handle(&self) -> Option<&EvictionHandle> {
        self.handle.as_ref().and_then(ForkGuarded::get)
    }

    /// The loop's totals so far, or its final ones once stopped. In a child made by `fork`,
    /// the parent's loop's totals as of the fork (as `PrefixAffinityRouter.eviction_totals`
    /// gives them there): the tree the child inherited is what those passes left.
    fn totals(&self) -> Option<EvictionTotals> {
        let inherited = self.handle.as_ref().and_then(ForkGuarded::inherited);
        inherited.map(EvictionHandle::totals).or(self.stopped)
    }
}

impl Drop for PyPrefixTree {
    /// The tree (and its eviction thread, joined when its handle drops) are dropped off the
    /// GIL: see [`drop_in_background`].
    fn drop(&mut self) {
        static EMPTY: OnceLock<Arc<PrefixTree>> = OnceLock::new();
        // The eviction thread first (its handle joins it), then the tree.
        let eviction = match self.eviction.get_mut() {
            Ok(e) => e.handle.take(),
            Err(poisoned) => poisoned.into_inner().handle.take(),
        };
        if let Some(handle) = eviction.and_then(ForkGuarded::into_inner) {
            drop_in_background(handle);
        }
        drop_arc_in_background(&mut self.tree, &EMPTY, PrefixTree::new);
    }
}

impl PyPrefixTree {
    /// The eviction loop, locked (a thread waiting for the lock holds no GIL).
    fn eviction_loop(&self, py: Python<'_>) -> MutexGuard<'_, EvictionLoop> {
        self.eviction
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner())
    }

    fn available(&self, available: Option<&Bound<'_, PyAny>>) -> PyResult<Available> {
        let Some(obj) = available else {
            return Ok(Available::All);
        };
        if obj.is_none() {
            return Ok(Available::All);
        }
        // Ray: `if available_tenants:` -- a false value (an empty list, tuple or set) means
        // every tenant; a true one that names nothing (an empty iterator or generator) is
        // filtered down to no tenant at all.
        if !obj.is_truthy()? {
            return Ok(Available::All);
        }
        let names = str_list(obj, "available_tenants")?;
        let reg = self.reg.load();
        let known: Vec<_> = names
            .into_iter()
            .filter_map(|n| {
                let id = reg.get(n.to_str().ok()?)?.id;
                Some((id, n.unbind()))
            })
            .collect();
        Ok(if known.is_empty() {
            Available::NoneKnown
        } else {
            Available::Known(known)
        })
    }

    /// Ray's `(matched_text, tenants_or_None)` for a match result.
    fn match_result<'py>(
        &self,
        py: Python<'py>,
        text_obj: &Bound<'py, PyAny>,
        text: &str,
        m: &PrefixMatch,
        available: &Available,
    ) -> PyResult<(Bound<'py, PyString>, Option<Bound<'py, PyList>>)> {
        self.result(
            py,
            text_obj,
            text,
            m.matched_bytes,
            m.tenants.as_slice(),
            available,
        )
    }

    /// [`match_result`](Self::match_result) from the matched length and the owners.
    fn result<'py>(
        &self,
        py: Python<'py>,
        text_obj: &Bound<'py, PyAny>,
        text: &str,
        matched_bytes: usize,
        owners: &[TenantId],
        available: &Available,
    ) -> PyResult<(Bound<'py, PyString>, Option<Bound<'py, PyList>>)> {
        let matched = if matched_bytes == text.len() && text_obj.is_exact_instance_of::<PyString>()
        {
            text_obj.cast::<PyString>()?.clone()
        } else {
            PyString::new(py, &text[..matched_bytes])
        };
        let names: Vec<Bound<'py, PyString>> = match available {
            Available::All => self.reg.load().names_in_order(py, owners),
            Available::Known(list) => list
                .iter()
                .filter(|(id, _)| owners.binary_search(id).is_ok())
                .map(|(_, n)| n.bind(py).clone())
                .collect(),
            Available::NoneKnown => Vec::new(),
        };
        let tenants = if names.is_empty() {
            None
        } else {
            Some(PyList::new(py, names)?)
        };
        Ok((matched, tenants))
    }

    fn tenant(&self, name: &str) -> Option<TenantId> {
        self.reg.load().get(name).map(|e| e.id)
    }

    /// `(name, chars)` of every tenant, in the order they were added.
    fn counts<'py>(&self, py: Python<'py>) -> Vec<(Bound<'py, PyString>, usize)> {
        let reg = self.reg.load();
        reg.entries()
            .iter()
            .filter_map(|e| Some((e.name.bind(py).clone(), self.tree.char_count(e.id)?)))
            .collect()
    }

    fn count_of(&self, key: &Bound<'_, PyAny>) -> Option<usize> {
        let name = key.cast::<PyString>().ok()?.to_str().ok()?;
        self.tree.char_count(self.tenant(name)?)
    }
}

#[pymethods]
impl PyPrefixTree {
    /// An empty tree.
    #[new]
    fn new() -> Self {
        Self {
            tree: Arc::new(PrefixTree::new()),
            reg: ArcSwap::from_pointee(Registry::default()),
            admin: Mutex::new(()),
            eviction: Mutex::new(EvictionLoop::default()),
        }
    }

    /// Adds tenants (replicas) by name; names that exist already are skipped. ``time_s`` is
    /// the tenants' initial access time (Ray inserts ``""`` for each at that time).
    ///
    /// At most :data:`MAX_TENANTS` tenants are live at once (removed tenants count until
    /// their grace period ends): names past that raise ``RuntimeError`` after the names
    /// before them were added.
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a", "b", "a"], 0.0)
    /// >>> list(tree.tenant_to_char_count)
    /// ['a', 'b']
    fn add_tenants(&self, py: Python<'_>, tenants: &Bound<'_, PyAny>, time_s: f64) -> PyResult<()> {
        time_key(time_s)?;
        let names = str_list(tenants, "tenants")?;
        let _admin = self
            .admin
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner());
        let reg = self.reg.load_full();
        let mut new: Vec<(&str, Bound<'_, PyString>)> = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for n in &names {
            let s = n.to_str()?;
            if reg.get(s).is_none() && seen.insert(s) {
                new.push((s, n.clone()));
            }
        }
        if new.is_empty() {
            return Ok(());
        }
        let tree = &self.tree;
        let strs: Vec<&str> = new.iter().map(|(s, _)| *s).collect();
        let ids: Vec<Result<TenantId, Error>> = py.detach(|| tree.try_add_tenants(&strs));
        let mut added = Vec::new();
        let mut failure = None;
        for ((_, name), id) in new.into_iter().zip(ids) {
            match id {
                Ok(id) => added.push(Entry {
                    id,
                    name: name.unbind(),
                    added_at: time_s,
                }),
                Err(e) => failure = Some(e),
            }
        }
        self.reg.store(Arc::new(reg.rebuilt(py, added, &[])));
        match failure {
            Some(e) => Err(tree_err(e)),
            None => Ok(()),
        }
    }

    /// Inserts ``text`` for ``tenant`` at time ``time_s``: every node on its path records
    /// the tenant's last access time; the tenant is charged each node's length once. An
    /// unknown tenant changes nothing (as in Ray). The GIL is released during the insert.
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a"], 0.0)
    /// >>> tree.insert("hello", "a", 1.0)
    /// >>> tree.insert("help", "a", 2.0)
    /// >>> tree.tenant_to_char_count["a"]  # "hel" + "lo" + "p"
    /// 6
    /// >>> tree.insert("hello", "nobody", 3.0)  # unknown tenant: no change
    fn insert(
        &self,
        py: Python<'_>,
        text: &Bound<'_, PyAny>,
        tenant: &Bound<'_, PyAny>,
        time_s: f64,
    ) -> PyResult<()> {
        let text = text_arg(text, "text")?;
        let name = text_arg(tenant, "tenant")?;
        let ts = time_key(time_s)?;
        let Some(id) = self.tenant(name) else {
            return Ok(());
        };
        let tree = &self.tree;
        match py.detach(|| tree.insert_at(text, id, ts)) {
            // Removed meanwhile: as for an unknown tenant.
            Ok(()) | Err(Error::UnknownTenant(_)) => Ok(()),
            Err(e) => Err(tree_err(e)),
        }
    }

    /// The longest prefix of ``text`` stored for ``available_tenants`` and the tenants
    /// owning it, exactly as Ray returns it:
    ///
    /// * ``available_tenants`` false (``None``, ``[]``, ``()``): every tenant is available;
    /// * names none of which is a tenant (also an empty iterator or generator, which Ray's
    ///   ``if available_tenants:`` takes as true): ``("", None)``;
    /// * no tenants at all: ``("", None)``;
    /// * no prefix matched: ``("", [every available tenant])``;
    /// * else ``(matched_prefix, [available tenants owning the deepest matched node])``,
    ///   in the order of ``available_tenants`` (or the order tenants were added).
    ///
    /// Lock-free; the GIL is released during the walk.
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a", "b"], 0.0)
    /// >>> tree.insert("hello", "a", 1.0)
    /// >>> tree.prefix_match("help")
    /// ('hel', ['a'])
    /// >>> tree.prefix_match("xyz")
    /// ('', ['a', 'b'])
    /// >>> tree.prefix_match("hello", ["b"])
    /// ('', ['b'])
    /// >>> tree.prefix_match("hello", ["nobody"])
    /// ('', None)
    #[pyo3(signature = (text, available_tenants=None))]
    fn prefix_match<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyAny>,
        available_tenants: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyString>, Option<Bound<'py, PyList>>)> {
        let s = text_arg(text, "text")?;
        let available = self.available(available_tenants)?;
        let tree = &self.tree;
        with_match(|m| {
            match &available {
                Available::NoneKnown => {
                    return Ok((PyString::new(py, ""), None));
                }
                Available::All => py.detach(|| tree.prefix_match_into(s, None, m)),
                Available::Known(list) => {
                    let ids: Vec<TenantId> = list.iter().map(|(id, _)| *id).collect();
                    py.detach(|| tree.prefix_match_into(s, Some(&ids), m))
                }
            }
            self.match_result(py, text, s, m, &available)
        })
    }

    /// :meth:`prefix_match` for many texts in one call: a list of ``(matched_text,
    /// tenants_or_None)``, one per text, exactly as :meth:`prefix_match` would return them.
    /// The GIL is released once for the whole batch, so Python threads calling it run their
    /// lookups in parallel (per-call lookups are bounded by the interpreter lock).
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a"], 0.0)
    /// >>> tree.insert("hello", "a", 1.0)
    /// >>> tree.prefix_match_many(["help", "xyz"])
    /// [('hel', ['a']), ('', ['a'])]
    #[pyo3(signature = (texts, available_tenants=None))]
    fn prefix_match_many<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        available_tenants: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        if texts.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "texts must be a list of str, not a single str",
            ));
        }
        let iter = texts.try_iter().map_err(|_| {
            PyTypeError::new_err(format!(
                "texts must be a list of str, not {}",
                type_name(texts).unwrap_or_default()
            ))
        })?;
        // Each element is checked as it comes: an endless iterator of non-str fails at once
        // instead of filling memory.
        let mut objs: Vec<Bound<'py, PyAny>> = Vec::new();
        for o in iter {
            let o = o?;
            text_arg(&o, "each text")?;
            objs.push(o);
        }
        let strs: Vec<&str> = objs
            .iter()
            .map(|o| text_arg(o, "each text"))
            .collect::<PyResult<_>>()?;
        let available = self.available(available_tenants)?;
        let ids: Option<Vec<TenantId>> = match &available {
            Available::All => None,
            Available::Known(list) => Some(list.iter().map(|(id, _)| *id).collect()),
            Available::NoneKnown => {
                let empty = PyString::new(py, "");
                let none = py.None();
                let items = (0..strs.len()).map(|_| (empty.clone(), none.clone_ref(py)));
                return PyList::new(py, items);
            }
        };
        let tree = &self.tree;
        // (matched bytes, first owner, owners) per text; owners in one flat vector.
        let mut found: Vec<(usize, usize, usize)> = Vec::with_capacity(strs.len());
        let mut owners: Vec<TenantId> = Vec::new();
        py.detach(|| {
            with_match(|m| {
                for s in &strs {
                    tree.prefix_match_into(s, ids.as_deref(), m);
                    found.push((m.matched_bytes, owners.len(), m.tenants.len()));
                    owners.extend(m.tenants.iter());
                }
            })
        });
        let out = PyList::empty(py);
        for ((obj, s), &(mb, start, n)) in objs.iter().zip(&strs).zip(&found) {
            let r = self.result(py, obj, s, mb, &owners[start..start + n], &available)?;
            out.append(r)?;
        }
        Ok(out)
    }

    /// Removes tenants and all their text; returns ``{tenant: chars removed}`` (0 for a name
    /// that is not a tenant). A name listed twice reports its chars once (Ray: 0 the second
    /// time). The GIL is released while the tree is pruned.
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a", "b"], 0.0)
    /// >>> tree.insert("hello", "a", 1.0)
    /// >>> tree.remove_tenants(["a", "zzz"])
    /// {'a': 5, 'zzz': 0}
    fn remove_tenants<'py>(
        &self,
        py: Python<'py>,
        tenants: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let names = str_list(tenants, "tenants")?;
        let _admin = self
            .admin
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner());
        let reg = self.reg.load_full();
        let mut ids: Vec<(&str, Option<TenantId>)> = Vec::with_capacity(names.len());
        let mut seen: HashSet<&str> = HashSet::new();
        for n in &names {
            let s = n.to_str()?;
            // A repeated name is removed once (the first time).
            let id = if seen.insert(s) {
                reg.get(s).map(|e| e.id)
            } else {
                None
            };
            ids.push((s, id));
        }
        let tree = &self.tree;
        // One batch (the root's owner table is rebuilt once); a name that is no tenant gets 0.
        let known: Vec<TenantId> = ids.iter().filter_map(|(_, id)| *id).collect();
        let mut chars = py.detach(|| tree.remove_tenants(&known)).into_iter();
        let removed: Vec<usize> = ids
            .iter()
            .map(|(_, id)| id.map_or(0, |_| chars.next().unwrap_or(0)))
            .collect();
        let gone: Vec<&str> = ids
            .iter()
            .filter(|(_, id)| id.is_some())
            .map(|(s, _)| *s)
            .collect();
        if !gone.is_empty() {
            self.reg.store(Arc::new(reg.rebuilt(py, Vec::new(), &gone)));
        }
        let out = PyDict::new(py);
        for (name, ((_, id), chars)) in names.iter().zip(ids.iter().zip(removed)) {
            // A repeated name keeps the chars reported the first time.
            if id.is_some() || !out.contains(name)? {
                out.set_item(name, chars)?;
            }
        }
        Ok(out)
    }

    /// Evicts ``tenant``'s least recently used text until at least ``min_remove_size`` chars
    /// were removed or it owns nothing. Whole timestamp groups go at once (every node the
    /// tenant last touched at the oldest time), so the result may exceed
    /// ``min_remove_size``. Returns the chars removed (0 for an unknown tenant).
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a"], 0.0)
    /// >>> tree.insert("hello", "a", 1.0)
    /// >>> tree.insert("help", "a", 2.0)
    /// >>> tree.evict_tenant_by_lru("a", 1)  # "lo", last touched at 1.0
    /// 2
    /// >>> tree.tenant_to_char_count["a"]
    /// 4
    fn evict_tenant_by_lru(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        min_remove_size: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let name = text_arg(tenant, "tenant")?;
        let min = saturating_count(min_remove_size, "min_remove_size")?;
        let Some(id) = self.tenant(name) else {
            return Ok(0);
        };
        let tree = &self.tree;
        Ok(py.detach(|| tree.evict_tenant_by_lru(id, min)))
    }

    /// The tenants tied at the smallest char count, in the order they were added; ``None``
    /// if there are no tenants.
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.get_smallest_tenants() is None
    /// True
    /// >>> tree.add_tenants(["a", "b", "c"], 0.0)
    /// >>> tree.insert("hi", "b", 1.0)
    /// >>> tree.get_smallest_tenants()
    /// ['a', 'c']
    fn get_smallest_tenants<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let counts = self.counts(py);
        let Some(min) = counts.iter().map(|(_, c)| *c).min() else {
            return Ok(None);
        };
        let names = counts
            .into_iter()
            .filter(|(_, c)| *c == min)
            .map(|(n, _)| n);
        Ok(Some(PyList::new(py, names)?))
    }

    /// Starts a background thread that, every ``interval_secs``, evicts each tenant holding
    /// more than ``eviction_threshold`` chars down to ``eviction_target`` (LRU). Returns
    /// ``True`` if it was started, ``False`` if one is already running. The thread needs no
    /// GIL.
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.start_eviction_loop(400_000, 360_000, 10.0)
    /// True
    /// >>> tree.start_eviction_loop(1, 1, 1.0)
    /// False
    /// >>> tree.stop_eviction_loop()
    fn start_eviction_loop(
        &self,
        py: Python<'_>,
        eviction_threshold: &Bound<'_, PyAny>,
        eviction_target: &Bound<'_, PyAny>,
        interval_secs: f64,
    ) -> PyResult<bool> {
        let threshold = saturating_bound(eviction_threshold, "eviction_threshold")?;
        let target = saturating_bound(eviction_target, "eviction_target")?;
        let interval = duration_arg(interval_secs, "interval_secs")?;
        let mut slot = self.eviction_loop(py);
        if slot.handle().is_some_and(EvictionHandle::is_running) {
            return Ok(false);
        }
        // Ray evicts a tenant only when its count exceeds the threshold *and* the target
        // (`excess = count - target` must be positive), down to the target: the same as
        // kvtrie's loop with the threshold raised to the target.
        let config = EvictionConfig::new(threshold.max(target), target, interval);
        match self.tree.start_eviction(config) {
            Some(h) => {
                // A stopped handle (or, in a forked child, the parent's) goes; joining a
                // stopped thread takes no time.
                let old = slot.handle.replace(ForkGuarded::new(h));
                slot.stopped = None;
                if let Some(old) = old.and_then(ForkGuarded::into_inner) {
                    py.detach(|| old.stop());
                }
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Stops the eviction thread (if any) and waits for it to exit, with the GIL released;
    /// :meth:`eviction_totals` keeps its final totals.
    fn stop_eviction_loop(&self, py: Python<'_>) {
        // The lock is held while the thread is joined (a thread waiting for it holds no GIL),
        // so that no reader sees neither the handle nor the totals.
        let mut slot = self.eviction_loop(py);
        // In a forked child the thread is the parent's: nothing to stop (see `ForkGuarded`),
        // and the totals stay those of the fork.
        if let Some(g) = slot.handle.take() {
            let inherited = g.inherited().map(EvictionHandle::totals);
            slot.stopped = match g.into_inner() {
                Some(h) => Some(py.detach(|| h.stop())),
                None => inherited,
            };
        }
    }

    /// ``{tenant: chars}`` for every tenant, as Ray's attribute: a read-only live mapping
    /// (``collections.abc.Mapping``) in the order tenants were added, equal to the ``dict``
    /// Ray would hold.
    #[getter]
    fn tenant_to_char_count(slf: Py<Self>) -> TenantCharCounts {
        TenantCharCounts { tree: slf }
    }

    // ---------------------------------------------------------------------------------------
    // Extras beyond Ray
    // ---------------------------------------------------------------------------------------

    /// Matches ``text`` and records it for a tenant (a router's per-request work), in one
    /// descent of the tree when ``tenant`` is a name. ``tenant`` is a name, or a callable
    /// ``choose(matched_text, matched_tenants) -> name | None`` that picks one from the match
    /// (called with the GIL held, between the match and the insert, which then takes a second
    /// descent: no Python code runs inside a descent, so a slow callable holds nothing
    /// back). Returns
    /// ``(matched_text, matched_tenants, chosen)``: the first two exactly as
    /// :meth:`prefix_match` returned them before the insert, ``chosen`` the tenant the text
    /// was inserted for (``None`` if the callable declined or the tenant is unknown).
    /// ``time_s`` defaults to ``time.time()``.
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a", "b"], 0.0)
    /// >>> tree.match_and_insert("hello world", "a", 1.0)
    /// ('', ['a', 'b'], 'a')
    /// >>> pick = lambda text, owners: owners[0] if text else "b"
    /// >>> tree.match_and_insert("hello there", pick, 2.0)
    /// ('hello ', ['a'], 'a')
    #[pyo3(signature = (text, tenant, time_s=None, available_tenants=None))]
    fn match_and_insert<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyAny>,
        tenant: &Bound<'py, PyAny>,
        time_s: Option<f64>,
        available_tenants: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<MatchInsert<'py>> {
        let s = text_arg(text, "text")?;
        let ts = time_key(time_s.unwrap_or_else(now_s))?;
        let fixed = if tenant.is_callable() {
            None
        } else {
            Some(text_arg(tenant, "tenant")?)
        };
        let available = self.available(available_tenants)?;
        let ids: Option<Vec<TenantId>> = match &available {
            Available::All => None,
            Available::Known(list) => Some(list.iter().map(|(id, _)| *id).collect()),
            Available::NoneKnown => Some(Vec::new()),
        };
        let tree = &self.tree;
        with_match(|m| {
            let outcome = match fixed {
                // A name: the choice needs no Python, the GIL stays released throughout.
                Some(name) => {
                    let id = self.tenant(name);
                    let r = py.detach(|| tree.match_and_insert(s, ids.as_deref(), ts, m, |_| id));
                    let (matched, tenants) = self.match_result(py, text, s, m, &available)?;
                    let chosen = match r {
                        Ok(Some(_)) => Some(tenant.cast::<PyString>()?.clone()),
                        Ok(None) | Err(Error::UnknownTenant(_)) => None,
                        Err(e) => return Err(tree_err(e)),
                    };
                    return Ok((matched, tenants, chosen));
                }
                None => {
                    // A callable: match, call it, then insert (two descents). Python code
                    // does not run in the middle of a descent: that thread would stay pinned
                    // for as long as the callable runs (or waits for the GIL), holding back
                    // the freeing of memory for every kvtrie structure in the process.
                    if s.len() > MAX_TEXT_BYTES {
                        return Err(tree_err(Error::TextTooLong { len: s.len() }));
                    }
                    py.detach(|| tree.prefix_match_into(s, ids.as_deref(), m));
                    let (matched, tenants) = self.match_result(py, text, s, m, &available)?;
                    // The callable gets its own list: what it does to it (a caller's
                    // `owners.remove(...)`) does not change the result returned.
                    let theirs = match &tenants {
                        Some(t) => Some(PyList::new(py, t.iter())?),
                        None => None,
                    };
                    let r = tenant.call1((&matched, theirs))?;
                    let mut chosen: Option<Py<PyString>> = None;
                    let id = if r.is_none() {
                        None
                    } else {
                        let id = self.tenant(text_arg(&r, "the chosen tenant")?);
                        if id.is_some() {
                            chosen = Some(r.cast_into::<PyString>()?.unbind());
                        }
                        id
                    };
                    let r = match id {
                        Some(id) => py.detach(|| tree.insert_at(s, id, ts)).map(|()| Some(id)),
                        None => Ok(None),
                    };
                    let result = Some((matched.unbind(), tenants.map(|t| t.unbind())));
                    (r, result, chosen)
                }
            };
            let (r, result, chosen) = outcome;
            let (matched, tenants) = match result {
                Some((mt, t)) => (mt.into_bound(py), t.map(|t| t.into_bound(py))),
                None => self.match_result(py, text, s, m, &available)?,
            };
            let chosen = match r {
                Ok(Some(_)) => chosen.map(|c| c.into_bound(py)),
                Ok(None) | Err(Error::UnknownTenant(_)) => None,
                Err(e) => return Err(tree_err(e)),
            };
            Ok((matched, tenants, chosen))
        })
    }

    /// The whole tree as plain data: ``{"text": str, "tenants": {name: time_s},
    /// "children": [...]}`` from the root (text ``""``), children sorted by text. Taken
    /// without stopping readers or writers (a consistent view of each node, not of the
    /// whole tree under concurrent changes).
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.add_tenants(["a"], 0.0)
    /// >>> tree.insert("hi", "a", 1.0)
    /// >>> tree.snapshot()
    /// {'text': '', 'tenants': {'a': 1.0}, 'children': [{'text': 'hi', 'tenants': {'a': 1.0}, 'children': []}]}
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let tree = &self.tree;
        let root = py.detach(|| tree.snapshot());
        let reg = self.reg.load();
        let node = |n: &NodeSnapshot,
                    children: &Bound<'py, PyList>|
         -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            d.set_item("text", &n.text)?;
            let tenants = PyDict::new(py);
            for &(id, key) in &n.tenants {
                if let Some((_, e)) = reg.by_id(id) {
                    tenants.set_item(e.name.bind(py), time_from_key(key).unwrap_or(e.added_at))?;
                }
            }
            d.set_item("tenants", tenants)?;
            d.set_item("children", children)?;
            Ok(d)
        };
        // Iterative, moving children out of each node, so neither building the result nor
        // dropping the snapshot recurses (trees can be deep).
        let mut root = root;
        let kids = PyList::empty(py);
        let out = node(&root, &kids)?;
        let mut stack: Vec<(NodeSnapshot, Bound<'py, PyList>)> = std::mem::take(&mut root.children)
            .into_iter()
            .rev()
            .map(|c| (c, kids.clone()))
            .collect();
        while let Some((mut n, parent)) = stack.pop() {
            let kids = PyList::empty(py);
            parent.append(node(&n, &kids)?)?;
            stack.extend(
                std::mem::take(&mut n.children)
                    .into_iter()
                    .rev()
                    .map(|c| (c, kids.clone())),
            );
        }
        Ok(out)
    }

    /// Checks the tree's invariants (exact per-tenant char counts by a full recount, prefix
    /// closure, edge structure); raises ``AssertionError`` describing the first violation.
    /// O(nodes), for tests.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let tree = &self.tree;
        py.detach(|| tree.check_invariants())
            .map_err(PyAssertionError::new_err)
    }

    /// Size figures: ``{"nodes", "chars", "bytes", "heap_bytes", "tenants"}``: a scan of every
    /// node, in chunks that each hold the reclaimer back only briefly, without the GIL; exact
    /// when no other thread writes meanwhile.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let tree = &self.tree;
        let s = py.detach(|| tree.stats());
        let d = PyDict::new(py);
        d.set_item("nodes", s.nodes)?;
        d.set_item("chars", s.chars)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("heap_bytes", s.heap_bytes)?;
        d.set_item("tenants", s.tenants)?;
        Ok(d)
    }

    /// Distinct chars stored (each node's text counted once, whatever its owners).
    #[getter]
    fn distinct_chars(&self) -> usize {
        self.tree.distinct_chars()
    }

    /// Is the background eviction thread running?
    #[getter]
    fn eviction_running(&self, py: Python<'_>) -> bool {
        self.eviction_loop(py)
            .handle()
            .is_some_and(EvictionHandle::is_running)
    }

    /// What the eviction loop started by :meth:`start_eviction_loop` has done so far:
    /// ``{"passes", "tenants_evicted", "chars_evicted", "global_chars_evicted"}``, counted
    /// after each completed pass (a tenant evicted in two passes counts twice); after
    /// :meth:`stop_eviction_loop`, the loop's final totals; ``None`` if no loop was started.
    /// In a child made by ``fork``, the parent's loop's totals as of the fork (no loop runs in
    /// the child until it starts one).
    ///
    /// >>> tree = kvtrie.PrefixTree()
    /// >>> tree.eviction_totals() is None
    /// True
    /// >>> tree.start_eviction_loop(400_000, 360_000, 10.0)
    /// True
    /// >>> sorted(tree.eviction_totals())
    /// ['chars_evicted', 'global_chars_evicted', 'passes', 'tenants_evicted']
    /// >>> tree.stop_eviction_loop()
    /// >>> tree.eviction_totals()["chars_evicted"]
    /// 0
    fn eviction_totals<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let totals = self.eviction_loop(py).totals();
        totals.map(|t| eviction_totals_dict(py, t)).transpose()
    }

    /// The number of nodes in the tree (not counting the root).
    fn __len__(&self) -> usize {
        self.tree.node_count()
    }

    /// Always true, as Ray's tree (which has no length) is: an empty tree is still a tree
    /// (``tree = given or PrefixTree()`` keeps a configured empty one).
    fn __bool__(&self) -> bool {
        true
    }

    fn __repr__(&self) -> String {
        format!(
            "kvtrie.PrefixTree(tenants={}, nodes={}, chars={})",
            self.reg.load().len(),
            self.tree.node_count(),
            self.tree.distinct_chars()
        )
    }
}

/// The read-only live view ``PrefixTree.tenant_to_char_count``: ``{tenant: chars}`` in the
/// order tenants were added. A ``collections.abc.Mapping`` that compares equal to the
/// corresponding ``dict``. While other threads add or remove tenants, take one consistent
/// snapshot with ``view.copy()`` or ``dict(view.items())``: ``dict(view)`` lists the keys,
/// then looks each up, and raises ``KeyError`` for a tenant removed in between.
#[pyclass(frozen, mapping, module = "kvtrie", name = "TenantCharCounts")]
pub struct TenantCharCounts {
    tree: Py<PyPrefixTree>,
}

impl TenantCharCounts {
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (n, c) in self.tree.get().counts(py) {
            d.set_item(n, c)?;
        }
        Ok(d)
    }
}

#[pymethods]
impl TenantCharCounts {
    fn __len__(&self) -> usize {
        self.tree.get().reg.load().len()
    }

    fn __getitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.tree
            .get()
            .count_of(key)
            .ok_or_else(|| PyKeyError::new_err(key.clone().unbind()))
    }

    fn __contains__(&self, key: &Bound<'_, PyAny>) -> bool {
        self.tree.get().count_of(key).is_some()
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let names: Vec<_> = self
            .tree
            .get()
            .counts(py)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        PyList::new(py, names)?.try_iter().map(|i| i.into_any())
    }

    /// The value for ``key``, or ``default`` if it is not a tenant.
    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match self.tree.get().count_of(key) {
            Some(c) => Ok(c.into_pyobject(py)?.into_any()),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.to_dict(py)?.call_method0("keys")
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.to_dict(py)?.call_method0("values")
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.to_dict(py)?.call_method0("items")
    }

    /// A plain ``dict`` copy.
    fn copy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.to_dict(py)
    }

    /// Pickles (and ``copy.copy`` / ``copy.deepcopy``) as the plain ``dict`` Ray's attribute
    /// is, e.g. when returned from a Ray actor method.
    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyDict>,))> {
        let dict_type = py.get_type::<PyDict>().into_any();
        Ok((dict_type, (self.to_dict(py)?,)))
    }

    /// ``counts | other``: a new ``dict``, as for Ray's ``dict``.
    fn __or__<'py>(
        &self,
        py: Python<'py>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.to_dict(py)?.into_any().bitor(other)
    }

    /// ``other | counts``: a new ``dict``, as for Ray's ``dict``.
    fn __ror__<'py>(
        &self,
        py: Python<'py>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        other.bitor(self.to_dict(py)?)
    }

    fn __eq__<'py>(
        &self,
        py: Python<'py>,
        other: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mine = self.to_dict(py)?;
        let other = match other.cast::<TenantCharCounts>() {
            Ok(o) => o.get().to_dict(py)?.into_any(),
            Err(_) => other.clone(),
        };
        if other.is_instance_of::<PyDict>()
            || other
                .py()
                .import("collections.abc")?
                .getattr("Mapping")
                .and_then(|m| other.is_instance(&m))?
        {
            let other_dict = PyDict::new(py);
            other_dict.call_method1("update", (other,))?;
            Ok(mine
                .eq(other_dict)?
                .into_pyobject(py)?
                .to_owned()
                .into_any())
        } else {
            Ok(py.NotImplemented().into_bound(py))
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.to_dict(py)?.repr()?.to_string())
    }
}
