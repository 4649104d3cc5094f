//! KV blocks: `BlockHasher`, `BlockIndex`, `StoredBlock` and `KvEvent` (thin wrappers over
//! `kvtrie::blocks`).

use std::sync::{Arc, OnceLock};

use kvtrie::blocks::{CacheKeys, DuplicateStores, MmInput, Tier};
use kvtrie::{BlockHasher, BlockIndex, EventError, KvEvent, StoredBlock, WorkerId};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::events::PyDecodedEvent;
use crate::util::{drop_arc_in_background, int_list, text_arg};

pyo3::create_exception!(
    kvtrie,
    UnknownParentError,
    PyValueError,
    "A ``KvEvent.Stored`` named a parent block the worker does not hold; nothing was stored."
);

/// An index error as a Python exception.
pub fn event_err(e: EventError) -> PyErr {
    UnknownParentError::new_err(e.to_string())
}

/// A request's cache partition from Python keyword arguments (`cache_salt`, `lora_name`,
/// `mm_inputs` as `(identifier, offset, length)` triples), owned, to lend as [`CacheKeys`].
#[derive(Default)]
pub struct Keys {
    cache_salt: Option<String>,
    lora_name: Option<String>,
    lora_id: Option<u64>,
    mm: Vec<(String, usize, usize)>,
}

impl Keys {
    /// Reads the arguments; `None` everywhere is the plain partition.
    pub fn from_args(
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        lora_id: Option<u64>,
        mm_inputs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let text = |o: Option<&Bound<'_, PyAny>>, what: &str| -> PyResult<Option<String>> {
            match o {
                Some(o) if !o.is_none() => Ok(Some(text_arg(o, what)?.to_owned())),
                _ => Ok(None),
            }
        };
        let mut mm = Vec::new();
        if let Some(items) = mm_inputs.filter(|o| !o.is_none()) {
            if items.is_instance_of::<PyString>() {
                return Err(PyTypeError::new_err(
                    "mm_inputs must be a list of (identifier, offset, length), not a str",
                ));
            }
            for item in items.try_iter()? {
                let item = item?;
                let (id, offset, length) = item
                    .extract::<(Bound<'_, PyAny>, usize, usize)>()
                    .map_err(|_| {
                        PyTypeError::new_err(
                            "each of mm_inputs is (identifier: str, offset: int >= 0, \
                             length: int >= 0)",
                        )
                    })?;
                mm.push((
                    text_arg(&id, "an mm_inputs identifier")?.to_owned(),
                    offset,
                    length,
                ));
            }
        }
        // vLLM keeps a request's items sorted by offset.
        mm.sort_by_key(|&(_, offset, _)| offset);
        Ok(Keys {
            cache_salt: text(cache_salt, "cache_salt")?,
            lora_name: text(lora_name, "lora_name")?,
            lora_id,
            mm,
        })
    }

    /// Calls `f` with the partition as [`CacheKeys`].
    pub fn with<R>(&self, f: impl FnOnce(&CacheKeys<'_>) -> R) -> R {
        let mm: Vec<MmInput<'_>> = self
            .mm
            .iter()
            .map(|(identifier, offset, length)| MmInput {
                identifier,
                offset: *offset,
                length: *length,
            })
            .collect();
        f(&CacheKeys {
            lora_name: self.lora_name.as_deref(),
            lora_id: self.lora_id,
            cache_salt: self.cache_salt.as_deref(),
            mm_inputs: &mm,
        })
    }

    /// Is this the plain partition (no salt, adapter or item)?
    pub fn is_plain(&self) -> bool {
        self.cache_salt.as_deref().is_none_or(str::is_empty)
            && self.lora_name.as_deref().is_none_or(str::is_empty)
            && self.lora_id.is_none()
            && self.mm.is_empty()
    }
}

/// A block size from Python: positive, else `ValueError`.
pub fn block_size_arg(block_size: usize) -> PyResult<usize> {
    if block_size == 0 {
        Err(PyValueError::new_err("block_size must be positive"))
    } else {
        Ok(block_size)
    }
}

/// Hashes token blocks the way NVIDIA Dynamo's KV router does: the *local* hash of a full
/// block is ``xxh3_64`` (seed 1337) over the tokens as little-endian ``u32`` bytes (a trailing
/// partial block is ignored); *sequence* hashes chain them
/// (``seq[i] = xxh3_64(le(seq[i-1]) + le(local[i]))``). Identical to the Rust crate.
///
/// >>> h = kvtrie.BlockHasher(4)
/// >>> local = h.local_hashes(range(10))  # two full blocks
/// >>> len(local)
/// 2
/// >>> h.sequence_hashes(range(10))[1] == h.chain(local[0], local[1])
/// True
#[pyclass(frozen, eq, hash, module = "kvtrie", name = "BlockHasher")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyBlockHasher {
    pub inner: BlockHasher,
}

#[pymethods]
impl PyBlockHasher {
    /// A hasher for blocks of ``block_size`` tokens (> 0) with ``seed`` (default 1337,
    /// Dynamo's).
    #[new]
    #[pyo3(signature = (block_size, seed = kvtrie::blocks::DEFAULT_SEED))]
    fn new(block_size: usize, seed: u64) -> PyResult<Self> {
        Ok(Self {
            inner: BlockHasher::with_seed(block_size_arg(block_size)?, seed),
        })
    }

    /// This hasher salted like Dynamo with a LoRA adapter name and a namespace:
    /// ``seed = 1337 + xxh3(lora_name, 0) + xxh3(namespace, 1)``; ``""`` adds nothing.
    #[pyo3(signature = (lora_name = "", namespace = ""))]
    fn with_salt(&self, lora_name: &str, namespace: &str) -> Self {
        Self {
            inner: self.inner.with_salt(lora_name, namespace),
        }
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// The seed of every hash.
    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed()
    }

    /// The local hash of one block of tokens (any length; callers pass full blocks).
    fn hash_block(&self, py: Python<'_>, tokens: Vec<u32>) -> u64 {
        let h = self.inner;
        py.detach(|| h.hash_block(&tokens))
    }

    /// The sequence hash of a block after one with sequence hash ``prev_seq``.
    fn chain(&self, prev_seq: u64, local: u64) -> u64 {
        self.inner.chain(prev_seq, local)
    }

    /// Local hashes of every full block of ``tokens`` (an iterable of ints in ``0..2**32``).
    /// ``cache_salt``, ``lora_name`` and ``mm_inputs`` (``(identifier, offset, length)`` of
    /// each multimodal item) hash the request in its cache partition, as vLLM does and as the
    /// decoder hashes the engine's ``extra_keys`` (or SGLang's ``cache_salt``). ``lora_id`` is
    /// the adapter's integer id, for engines whose events carry only ``lora_id`` (older vLLM
    /// releases); it is ignored when ``lora_name`` is given.
    #[pyo3(signature = (tokens, *, cache_salt = None, lora_name = None, mm_inputs = None, lora_id = None))]
    fn local_hashes(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        mm_inputs: Option<&Bound<'_, PyAny>>,
        lora_id: Option<u64>,
    ) -> PyResult<Vec<u64>> {
        let tokens = token_list(tokens)?;
        let keys = Keys::from_args(cache_salt, lora_name, lora_id, mm_inputs)?;
        let h = self.inner;
        Ok(py.detach(|| keys.with(|k| h.local_hashes_with(&tokens, k))))
    }

    /// Sequence hashes of every full block of ``tokens``.
    fn sequence_hashes(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let tokens = token_list(tokens)?;
        let h = self.inner;
        Ok(py.detach(|| h.sequence_hashes(&tokens)))
    }

    /// Chains local hashes into sequence hashes.
    fn chain_local(&self, py: Python<'_>, local: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let local = int_list(local, "local")?;
        let h = self.inner;
        Ok(py.detach(|| h.chain_local(&local)))
    }

    fn __repr__(&self) -> String {
        format!(
            "kvtrie.BlockHasher(block_size={}, seed={})",
            self.inner.block_size(),
            self.inner.seed()
        )
    }
}

/// Tokens from Python: a `list`, `tuple`, `range` or any iterable of ints in `0..2**32` (a
/// `str` or `bytes` is rejected; see [`int_list`]).
pub fn token_list(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    int_list(obj, "tokens")
}

/// One block of a ``KvEvent.Stored``: the engine's id for it and the router-side local hash
/// of its tokens.
///
/// >>> kvtrie.StoredBlock(engine_hash=7, local_hash=42)
/// StoredBlock(engine_hash=7, local_hash=42)
#[pyclass(
    frozen,
    eq,
    hash,
    module = "kvtrie",
    name = "StoredBlock",
    from_py_object
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyStoredBlock {
    /// The engine's opaque id for the block (vLLM's ``block_hash``).
    #[pyo3(get)]
    pub engine_hash: u64,
    /// The router-side local hash of the block's tokens (:class:`BlockHasher`).
    #[pyo3(get)]
    pub local_hash: u64,
}

#[pymethods]
impl PyStoredBlock {
    #[new]
    fn new(engine_hash: u64, local_hash: u64) -> Self {
        Self {
            engine_hash,
            local_hash,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "StoredBlock(engine_hash={}, local_hash={})",
            self.engine_hash, self.local_hash
        )
    }
}

impl From<StoredBlock> for PyStoredBlock {
    fn from(b: StoredBlock) -> Self {
        Self {
            engine_hash: b.engine_hash,
            local_hash: b.local_hash,
        }
    }
}

impl From<PyStoredBlock> for StoredBlock {
    fn from(b: PyStoredBlock) -> Self {
        StoredBlock {
            engine_hash: b.engine_hash,
            local_hash: b.local_hash,
        }
    }
}

/// A change to one worker's KV cache (Rust's ``kvtrie::KvEvent``):
///
/// * ``KvEvent.Stored(parent, blocks)``: blocks stored in order, the first chaining from the
///   engine hash ``parent`` (``None``: they start a sequence);
/// * ``KvEvent.Removed(engine_hashes)``: blocks evicted;
/// * ``KvEvent.Cleared()``: the worker dropped its whole cache.
///
/// >>> ev = kvtrie.KvEvent.Stored(parent=None, blocks=[kvtrie.StoredBlock(1, 10)])
/// >>> isinstance(ev, kvtrie.KvEvent), ev.blocks[0].local_hash
/// (True, 10)
#[pyclass(frozen, eq, module = "kvtrie", name = "KvEvent", from_py_object)]
#[derive(Clone, PartialEq)]
pub enum PyKvEvent {
    /// Blocks were stored, in order.
    Stored {
        parent: Option<u64>,
        blocks: Vec<PyStoredBlock>,
    },
    /// Blocks were evicted.
    Removed { engine_hashes: Vec<u64> },
    /// The worker dropped its whole cache.
    Cleared {},
}

#[pymethods]
impl PyKvEvent {
    fn __repr__(&self) -> String {
        match self {
            PyKvEvent::Stored { parent, blocks } => format!(
                "KvEvent.Stored(parent={}, blocks=[{}])",
                parent.map_or("None".into(), |p| p.to_string()),
                blocks
                    .iter()
                    .map(|b| b.__repr__())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            PyKvEvent::Removed { engine_hashes } => {
                format!("KvEvent.Removed(engine_hashes={engine_hashes:?})")
            }
            PyKvEvent::Cleared {} => "KvEvent.Cleared()".into(),
        }
    }
}

impl From<KvEvent> for PyKvEvent {
    fn from(e: KvEvent) -> Self {
        match e {
            KvEvent::Stored { parent, blocks } => PyKvEvent::Stored {
                parent,
                blocks: blocks.into_iter().map(Into::into).collect(),
            },
            KvEvent::Removed { engine_hashes } => PyKvEvent::Removed { engine_hashes },
            KvEvent::Cleared => PyKvEvent::Cleared {},
        }
    }
}

impl From<PyKvEvent> for KvEvent {
    fn from(e: PyKvEvent) -> Self {
        match e {
            PyKvEvent::Stored { parent, blocks } => KvEvent::Stored {
                parent,
                blocks: blocks.into_iter().map(Into::into).collect(),
            },
            PyKvEvent::Removed { engine_hashes } => KvEvent::Removed { engine_hashes },
            PyKvEvent::Cleared {} => KvEvent::Cleared,
        }
    }
}

/// A lock-free index of KV-cache blocks fed by engine events: which workers hold the longest
/// leading run of a request's blocks. Lookups take no lock and release the GIL; writers
/// serialize among themselves only.
///
/// >>> h = kvtrie.BlockHasher(4)
/// >>> index = kvtrie.BlockIndex(h)
/// >>> local = h.local_hashes(range(8))
/// >>> blocks = [kvtrie.StoredBlock(100 + i, l) for i, l in enumerate(local)]
/// >>> index.apply(0, kvtrie.KvEvent.Stored(parent=None, blocks=blocks))
/// >>> index.find_matches(local)
/// {0: 2}
/// >>> index.find_matches_tokens(range(8))
/// {0: 2}
#[pyclass(frozen, weakref, module = "kvtrie", name = "BlockIndex")]
pub struct PyBlockIndex {
    pub inner: Arc<BlockIndex>,
}

/// `{worker: leading blocks}` for workers with a positive overlap.
fn scores<'py>(py: Python<'py>, s: &kvtrie::OverlapScores) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (w, n) in s.iter() {
        d.set_item(w.0, n)?;
    }
    Ok(d)
}

impl Drop for PyBlockIndex {
    /// The index is dropped off the GIL (when this was its last owner): see
    /// [`crate::util::drop_in_background`].
    fn drop(&mut self) {
        static EMPTY: OnceLock<Arc<BlockIndex>> = OnceLock::new();
        drop_arc_in_background(&mut self.inner, &EMPTY, BlockIndex::new);
    }
}

#[pymethods]
impl PyBlockIndex {
    /// An empty index whose sequence hashes chain with ``hasher``'s seed (default: block
    /// size 16, seed 1337). Use the (salted) hasher the local hashes come from.
    #[new]
    #[pyo3(signature = (hasher = None))]
    fn new(hasher: Option<&PyBlockHasher>) -> Self {
        let h = hasher.map_or_else(|| BlockHasher::new(16), |h| h.inner);
        Self {
            inner: Arc::new(BlockIndex::with_hasher(&h)),
        }
    }

    /// What a GPU-tier store of a block the worker already holds on the GPU means, from the
    /// next event on: ``"copies"`` (the default: another copy, which takes a removal of its
    /// own, as vLLM's default incremental reports mean it) or ``"reports"`` (a report that the
    /// block is still held: nothing changes, and one removal removes it). Use ``"reports"``
    /// when requests ask vLLM for full reports (``kv_cache_report_mode = "full"`` in their
    /// ``vllm_xargs``, which gateways set to learn of prefix-cache hits): vLLM then stores every
    /// reused block again, and counted as copies those blocks would stay in the index after
    /// the engine evicted them. Copies in other tiers are always counted.
    ///
    /// >>> index = kvtrie.BlockIndex()
    /// >>> index.set_duplicate_stores("reports")
    /// >>> index.duplicate_stores
    /// 'reports'
    fn set_duplicate_stores(&self, py: Python<'_>, mode: &str) -> PyResult<()> {
        let d = match mode {
            "copies" => DuplicateStores::Copies,
            "reports" => DuplicateStores::Reports,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "duplicate stores must be \"copies\" or \"reports\", not {}",
                    crate::util::str_repr(py, mode)?
                )))
            }
        };
        self.inner.set_duplicate_stores(d);
        Ok(())
    }

    /// ``"copies"`` or ``"reports"``: see :meth:`set_duplicate_stores`.
    #[getter]
    fn duplicate_stores(&self) -> &'static str {
        match self.inner.duplicate_stores() {
            DuplicateStores::Copies => "copies",
            DuplicateStores::Reports => "reports",
        }
    }

    /// The hasher whose seed chains sequence hashes (and whose block size
    /// :meth:`find_matches_tokens` uses).
    #[getter]
    fn hasher(&self) -> PyBlockHasher {
        PyBlockHasher {
            inner: *self.inner.hasher(),
        }
    }

    /// Applies one event of ``worker`` (an int). ``event`` is a :class:`KvEvent` (GPU tier;
    /// ``Cleared`` drops every tier) or a decoded vLLM event (:class:`kvtrie.vllm.DecodedEvent`),
    /// applied in the storage tier its ``medium`` names, as :class:`kvtrie.zmq.Subscriber`
    /// applies it (``Cleared``: that tier only). Raises :class:`UnknownParentError` if a
    /// ``Stored`` event names a parent the worker does not hold (nothing is stored), and
    /// ``ValueError`` for a decoded event whose ``block_size`` is not the index's.
    fn apply(&self, py: Python<'_>, worker: u64, event: &Bound<'_, PyAny>) -> PyResult<()> {
        // A decoded vLLM event is applied in the storage tier its `medium` names, as the ZMQ
        // subscriber applies it (a CPU copy is not a GPU copy: it weighs less, and a GPU
        // removal leaves it); a `KvEvent` is a GPU-tier event (`Cleared`: every tier).
        let (event, tier): (PyKvEvent, Option<Tier>) = match event.extract::<PyKvEvent>() {
            Ok(e) => (e, None),
            Err(_) => {
                if let Ok(d) = event.cast::<PyDecodedEvent>() {
                    let d = d.get();
                    let ours = self.inner.hasher().block_size();
                    if d.block_size != ours {
                        return Err(PyValueError::new_err(format!(
                            "the event was decoded for blocks of {} tokens, this index hashes \
                             blocks of {ours}: its local hashes would never match (decode with \
                             block_size={ours})",
                            d.block_size
                        )));
                    }
                    (
                        d.event.clone(),
                        Some(Tier::from_medium(d.medium.as_deref())),
                    )
                } else {
                    let e = event
                        .getattr("event")
                        .ok()
                        .and_then(|e| e.extract::<PyKvEvent>().ok())
                        .ok_or_else(|| {
                            PyTypeError::new_err(
                                "event must be a kvtrie.KvEvent or a decoded vLLM event",
                            )
                        })?;
                    (e, None)
                }
            }
        };
        let index = &self.inner;
        py.detach(|| match tier {
            Some(t) => index.apply_in(WorkerId(worker), t, event.into()),
            None => index.apply(WorkerId(worker), event.into()),
        })
        .map_err(event_err)
    }

    /// Applies a ``Stored`` event given as its parts.
    #[pyo3(signature = (worker, parent, blocks))]
    fn store_blocks(
        &self,
        py: Python<'_>,
        worker: u64,
        parent: Option<u64>,
        blocks: Vec<PyStoredBlock>,
    ) -> PyResult<()> {
        let blocks: Vec<StoredBlock> = blocks.into_iter().map(Into::into).collect();
        let index = &self.inner;
        py.detach(|| index.store_blocks(WorkerId(worker), parent, &blocks))
            .map_err(event_err)
    }

    /// Applies a ``Removed`` event (unknown hashes are counted, not an error).
    fn remove_blocks(
        &self,
        py: Python<'_>,
        worker: u64,
        engine_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let engine_hashes = int_list(engine_hashes, "engine_hashes")?;
        let index = &self.inner;
        py.detach(|| index.remove_blocks(WorkerId(worker), &engine_hashes));
        Ok(())
    }

    /// Drops every block of ``worker`` (it stays known).
    fn clear_worker(&self, py: Python<'_>, worker: u64) {
        let index = &self.inner;
        py.detach(|| index.clear_worker(WorkerId(worker)))
    }

    /// Forgets ``worker`` and its blocks; returns how many blocks it held.
    fn remove_worker(&self, py: Python<'_>, worker: u64) -> usize {
        let index = &self.inner;
        py.detach(|| index.remove_worker(WorkerId(worker)))
    }

    /// Forgets every data-parallel rank of ``engine`` (workers ``engine | rank << 48``) and
    /// their blocks, as when the engine leaves; returns how many blocks they held.
    fn remove_engine(&self, py: Python<'_>, engine: u64) -> usize {
        let index = &self.inner;
        py.detach(|| index.remove_engine(engine))
    }

    /// ``{worker: leading blocks held}`` for a request given by its **local** block hashes,
    /// in order (workers with no overlap are absent).
    fn find_matches<'py>(
        &self,
        py: Python<'py>,
        local_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let local_hashes = int_list(local_hashes, "local_hashes")?;
        let index = &self.inner;
        let s = py.detach(|| index.find_matches(&local_hashes));
        scores(py, &s)
    }

    /// :meth:`find_matches` for already chained **sequence** hashes.
    fn find_matches_seq<'py>(
        &self,
        py: Python<'py>,
        seq_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let seq_hashes = int_list(seq_hashes, "seq_hashes")?;
        let index = &self.inner;
        let s = py.detach(|| index.find_matches_seq(&seq_hashes));
        scores(py, &s)
    }

    /// :meth:`find_matches` straight from tokens, hashed with the index's hasher (in the
    /// cache partition ``cache_salt`` / ``lora_name`` / ``lora_id`` / ``mm_inputs`` if given, see
    /// :meth:`BlockHasher.local_hashes`).
    #[pyo3(signature = (tokens, *, cache_salt = None, lora_name = None, mm_inputs = None, lora_id = None))]
    fn find_matches_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora_name: Option<&Bound<'py, PyAny>>,
        mm_inputs: Option<&Bound<'py, PyAny>>,
        lora_id: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tokens = token_list(tokens)?;
        let keys = Keys::from_args(cache_salt, lora_name, lora_id, mm_inputs)?;
        let index = &self.inner;
        let s = py.detach(|| {
            if keys.is_plain() {
                index.find_matches_tokens(&tokens)
            } else {
                let local = keys.with(|k| index.hasher().local_hashes_with(&tokens, k));
                index.find_matches(&local)
            }
        });
        scores(py, &s)
    }

    /// Blocks (engine hashes) ``worker`` holds.
    fn block_count(&self, py: Python<'_>, worker: u64) -> usize {
        let index = &self.inner;
        py.detach(|| index.block_count(WorkerId(worker)))
    }

    /// Total blocks over all workers.
    #[getter]
    fn total_blocks(&self, py: Python<'_>) -> usize {
        let index = &self.inner;
        py.detach(|| index.total_blocks())
    }

    /// Distinct sequence hashes held by at least one worker.
    #[getter]
    fn distinct_blocks(&self, py: Python<'_>) -> usize {
        let index = &self.inner;
        py.detach(|| index.distinct_blocks())
    }

    /// The known workers, ascending.
    fn workers(&self, py: Python<'_>) -> Vec<u64> {
        let index = &self.inner;
        py.detach(|| index.workers().into_iter().map(|w| w.0).collect())
    }

    /// Event counters: ``events_applied``, ``blocks_stored``, ``blocks_removed``,
    /// ``unknown_parents``, ``unknown_removes``, ``rejected_workers``, ``duplicate_copies``,
    /// ``copies_saturated``.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let index = &self.inner;
        let s = py.detach(|| index.stats());
        let d = PyDict::new(py);
        d.set_item("events_applied", s.events_applied)?;
        d.set_item("blocks_stored", s.blocks_stored)?;
        d.set_item("blocks_removed", s.blocks_removed)?;
        d.set_item("unknown_parents", s.unknown_parents)?;
        d.set_item("unknown_removes", s.unknown_removes)?;
        d.set_item("rejected_workers", s.rejected_workers)?;
        d.set_item("duplicate_copies", s.duplicate_copies)?;
        d.set_item("copies_saturated", s.copies_saturated)?;
        Ok(d)
    }

    /// Heap bytes owned by the index.
    fn heap_bytes(&self, py: Python<'_>) -> usize {
        let index = &self.inner;
        py.detach(|| index.heap_bytes())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let index = &self.inner;
        let (w, b) = py.detach(|| (index.workers().len(), index.total_blocks()));
        format!("kvtrie.BlockIndex(workers={w}, blocks={b})")
    }
}
