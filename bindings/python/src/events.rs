//! vLLM KV events: msgpack decoding (`kvtrie::events::vllm`) and, with the `zmq` feature, the
//! live subscriber (`kvtrie::events::zmq`) running its own threads.

use std::borrow::Cow;
use std::sync::Mutex;

use kvtrie::events::vllm::{decode_batch, DecodeConfig, DecodeError, DecodedBatch, Decoder};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::PyString;

use crate::blocks::{block_size_arg, PyKvEvent};
use crate::util::{float_repr, opt_repr, str_repr};

pyo3::create_exception!(
    kvtrie,
    KvEventDecodeError,
    PyValueError,
    "A vLLM KV-event batch could not be decoded (``event_index``: the event it is in, if any)."
);

fn decode_err(py: Python<'_>, e: DecodeError) -> PyErr {
    let err = KvEventDecodeError::new_err(e.to_string());
    // Best effort: the attribute only adds detail to the message.
    let _ = err.value(py).setattr("event_index", e.event);
    err
}

/// The decoder settings from Python arguments (validated: `ValueError` for a bad config).
fn decode_config(
    block_size: usize,
    namespace: &str,
    engine_block_size: Option<usize>,
) -> PyResult<DecodeConfig> {
    let mut cfg = DecodeConfig::new(block_size_arg(block_size)?).with_namespace(namespace);
    if let Some(e) = engine_block_size {
        cfg = cfg.with_engine_block_size(e);
    }
    // Validates the configuration.
    Decoder::new(cfg.clone()).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(cfg)
}

/// One decoded event with its metadata.
#[pyclass(frozen, eq, module = "kvtrie.vllm", name = "DecodedEvent")]
#[derive(PartialEq)]
pub struct PyDecodedEvent {
    /// The event, in router blocks (a :class:`kvtrie.KvEvent`).
    #[pyo3(get)]
    pub(crate) event: PyKvEvent,
    /// Cache tier (``"GPU"``, ``"CPU"``, ...), when the engine says.
    #[pyo3(get)]
    pub(crate) medium: Option<String>,
    /// KV-cache group index, when the engine says.
    #[pyo3(get)]
    group_idx: Option<u64>,
    /// The router block size the event's local hashes were computed for (the decoder's
    /// ``block_size``): an index that hashes other blocks refuses it.
    #[pyo3(get)]
    pub(crate) block_size: usize,
}

#[pymethods]
impl PyDecodedEvent {
    /// An event as the decoder gives it: ``event`` in router blocks of ``block_size`` tokens
    /// (the size its local hashes were computed for), with the engine's ``medium`` and
    /// ``group_idx`` if any. For tests of code that takes decoded events, and for pickling.
    #[new]
    #[pyo3(signature = (event, block_size, medium = None, group_idx = None))]
    fn new(
        event: PyKvEvent,
        block_size: usize,
        medium: Option<String>,
        group_idx: Option<u64>,
    ) -> PyResult<Self> {
        Ok(Self {
            event,
            medium,
            group_idx,
            block_size: block_size_arg(block_size)?,
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let ev = self
            .event
            .clone()
            .into_pyobject(py)?
            .into_any()
            .repr()?
            .to_string();
        let medium = match &self.medium {
            Some(m) => str_repr(py, m)?,
            None => "None".into(),
        };
        Ok(format!(
            "DecodedEvent(event={ev}, block_size={}, medium={medium}, group_idx={})",
            self.block_size,
            opt_repr(self.group_idx, |g| g.to_string())
        ))
    }
}

/// One decoded ``KVEventBatch``.
#[pyclass(frozen, module = "kvtrie.vllm", name = "DecodedBatch")]
pub struct PyDecodedBatch {
    /// Publisher timestamp (seconds since the epoch).
    #[pyo3(get)]
    ts: f64,
    /// Data-parallel rank of the publishing engine, if present.
    #[pyo3(get)]
    data_parallel_rank: Option<u32>,
    /// The kept events, in order (:class:`DecodedEvent`).
    events: Vec<Py<PyDecodedEvent>>,
    /// Events dropped because they belong to a non-full-attention KV-cache group, and stores
    /// without the tokens of their blocks (no ``token_ids``, or fewer hashes than blocks).
    #[pyo3(get)]
    skipped_groups: usize,
    /// Events dropped because their tag is unknown (a newer vLLM).
    #[pyo3(get)]
    skipped_unknown: usize,
    /// ``BlockStored`` events dropped because their block size does not split into the
    /// router's blocks (not a multiple, or more than 64 of them).
    #[pyo3(get)]
    skipped_block_sizes: usize,
    /// Events dropped because their ``locality`` is not ``"LOCAL"``, or their ``medium``
    /// names a shared pool (``EXTERNAL``, ``REMOTE``, ``SHARED``): not this engine's cache.
    #[pyo3(get)]
    skipped_remote: usize,
    /// Events dropped because they are malformed in their values (a token id past 32 bits, a
    /// token count that does not match the blocks, ...); the batch's other events are kept.
    #[pyo3(get)]
    skipped_malformed: usize,
    /// Why the first malformed event was dropped (``None`` if none was).
    #[pyo3(get)]
    malformed: Option<String>,
}

#[pymethods]
impl PyDecodedBatch {
    /// A batch as the decoder gives it (for tests of code that takes decoded batches, and for
    /// pickling): ``events`` is a list of :class:`DecodedEvent`.
    #[new]
    #[pyo3(signature = (
        ts, events, data_parallel_rank = None, *, skipped_groups = 0, skipped_unknown = 0,
        skipped_block_sizes = 0, skipped_remote = 0, skipped_malformed = 0, malformed = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        ts: f64,
        events: Vec<Py<PyDecodedEvent>>,
        data_parallel_rank: Option<u32>,
        skipped_groups: usize,
        skipped_unknown: usize,
        skipped_block_sizes: usize,
        skipped_remote: usize,
        skipped_malformed: usize,
        malformed: Option<String>,
    ) -> Self {
        Self {
            ts,
            data_parallel_rank,
            events,
            skipped_groups,
            skipped_unknown,
            skipped_block_sizes,
            skipped_remote,
            skipped_malformed,
            malformed,
        }
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        let Ok(o) = other.cast::<PyDecodedBatch>() else {
            return false;
        };
        let o = o.get();
        self.ts == o.ts
            && self.data_parallel_rank == o.data_parallel_rank
            && self.skipped_groups == o.skipped_groups
            && self.skipped_unknown == o.skipped_unknown
            && self.skipped_block_sizes == o.skipped_block_sizes
            && self.skipped_remote == o.skipped_remote
            && self.skipped_malformed == o.skipped_malformed
            && self.malformed == o.malformed
            && self.events.len() == o.events.len()
            && self
                .events
                .iter()
                .zip(&o.events)
                .all(|(a, b)| a.get() == b.get())
    }

    /// The kept events, in order.
    #[getter]
    fn events(&self, py: Python<'_>) -> Vec<Py<PyDecodedEvent>> {
        self.events.iter().map(|e| e.clone_ref(py)).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "DecodedBatch(ts={}, data_parallel_rank={}, events=<{} events>, skipped_groups={}, \
             skipped_unknown={}, skipped_block_sizes={}, skipped_remote={}, \
             skipped_malformed={})",
            float_repr(self.ts),
            opt_repr(self.data_parallel_rank, |r| r.to_string()),
            self.events.len(),
            self.skipped_groups,
            self.skipped_unknown,
            self.skipped_block_sizes,
            self.skipped_remote,
            self.skipped_malformed
        )
    }
}

fn batch_to_py(py: Python<'_>, b: DecodedBatch, block_size: usize) -> PyResult<PyDecodedBatch> {
    let events = b
        .events
        .into_iter()
        .map(|e| {
            Py::new(
                py,
                PyDecodedEvent {
                    event: e.event.into(),
                    medium: e.medium,
                    group_idx: e.group_idx,
                    block_size,
                },
            )
        })
        .collect::<PyResult<_>>()?;
    Ok(PyDecodedBatch {
        ts: b.ts,
        data_parallel_rank: b.data_parallel_rank,
        events,
        skipped_groups: b.skipped_groups,
        skipped_unknown: b.skipped_unknown,
        skipped_block_sizes: b.skipped_block_sizes,
        skipped_remote: b.skipped_remote,
        skipped_malformed: b.skipped_malformed,
        malformed: b.malformed.map(|e| e.to_string()),
    })
}

/// A batch payload from Python: ``bytes`` (borrowed), or another bytes-like value or list of
/// ints in ``0..256`` (copied). A ``str`` is a ``TypeError`` that says what is wanted (PyO3's
/// own text named neither the argument nor the type).
fn payload_arg<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, [u8]>> {
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "payload must be bytes (the msgpack batch as received), not str",
        ));
    }
    obj.extract::<Cow<'a, [u8]>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "payload must be bytes (the msgpack batch as received), not {}",
            crate::util::type_name(obj).unwrap_or_else(|| "?".into())
        ))
    })
}

/// Decodes one vLLM ``KVEventBatch`` payload (the last ZMQ frame; ``bytes`` or
/// ``bytearray``) statelessly, accepting every encoding vLLM has shipped. ``block_size`` is
/// the router's block size; local hashes are salted with the event's LoRA name and
/// ``namespace``. A payload that is not whole msgpack, or not a batch, raises
/// :class:`KvEventDecodeError` (a ``ValueError``), never crashes; an event malformed in its
/// values is dropped alone and counted (:attr:`DecodedBatch.skipped_malformed`). The GIL is
/// released while decoding.
///
/// >>> batch = kvtrie.vllm.decode_batch(payload, block_size=4)  # doctest: +SKIP
/// >>> [type(e.event).__name__ for e in batch.events]  # doctest: +SKIP
/// ['Stored', 'Removed', 'Cleared']
#[pyfunction]
#[pyo3(signature = (payload, block_size = 16, namespace = "", engine_block_size = None))]
pub fn decode_vllm_batch(
    py: Python<'_>,
    payload: &Bound<'_, PyAny>,
    block_size: usize,
    namespace: &str,
    engine_block_size: Option<usize>,
) -> PyResult<PyDecodedBatch> {
    let cfg = decode_config(block_size, namespace, engine_block_size)?;
    let payload = payload_arg(payload)?;
    let payload: &[u8] = &payload;
    let b = py
        .detach(|| decode_batch(payload, &cfg))
        .map_err(|e| decode_err(py, e))?;
    batch_to_py(py, b, cfg.block_size())
}

/// A stateful decoder for one publisher: remembers the engine block size and the
/// non-full-attention KV-cache groups across batches (so later ``BlockRemoved`` events are
/// expanded and filtered correctly). Thread-safe (calls are serialized).
#[pyclass(frozen, module = "kvtrie.vllm", name = "Decoder")]
pub struct PyDecoder {
    inner: Mutex<Decoder>,
}

#[pymethods]
impl PyDecoder {
    #[new]
    #[pyo3(signature = (block_size = 16, namespace = "", engine_block_size = None))]
    fn new(block_size: usize, namespace: &str, engine_block_size: Option<usize>) -> PyResult<Self> {
        let cfg = decode_config(block_size, namespace, engine_block_size)?;
        let d = Decoder::new(cfg).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self {
            inner: Mutex::new(d),
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let d = self
            .inner
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner());
        let cfg = d.config();
        Ok(format!(
            "kvtrie.vllm.Decoder(block_size={}, namespace={}, engine_block_size={})",
            cfg.block_size(),
            str_repr(py, cfg.namespace())?,
            opt_repr(cfg.engine_block_size(), |b| b.to_string())
        ))
    }

    /// Decodes one batch payload (see :func:`decode_batch`); state is only updated by
    /// batches that decode successfully.
    fn decode(&self, py: Python<'_>, payload: &Bound<'_, PyAny>) -> PyResult<PyDecodedBatch> {
        let payload = payload_arg(payload)?;
        let mut d = self
            .inner
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner());
        let payload: &[u8] = &payload;
        let dec = &mut *d;
        let block_size = dec.config().block_size();
        let b = py
            .detach(|| dec.decode(payload))
            .map_err(|e| decode_err(py, e))?;
        drop(d);
        batch_to_py(py, b, block_size)
    }
}

#[cfg(feature = "zmq")]
pub use subscriber::{PyEngineConfig, PySubscriber};

#[cfg(feature = "zmq")]
mod subscriber {
    use std::sync::Mutex;

    use kvtrie::events::zmq::{EngineConfig, EngineStats, SpawnError, Subscriber, WorkerMapping};
    use kvtrie::WorkerId;
    use pyo3::exceptions::{PyOSError, PyValueError};
    use pyo3::prelude::*;
    use pyo3::sync::MutexExt;
    use pyo3::types::{PyDict, PyTuple};

    use super::decode_config;
    use crate::blocks::PyBlockIndex;
    use crate::util::{duration_arg, str_repr, ForkGuarded};

    /// One vLLM engine (one ZMQ publisher) to subscribe to.
    ///
    /// ``mapping``: ``"fixed"`` (every batch goes to ``worker``), ``"add_rank"``
    /// (``worker + data_parallel_rank``) or ``"per_rank"`` (each data-parallel rank a worker
    /// of its own: ``worker | rank << 48``, the Rust crate's default). Ranks merged into one
    /// worker with ``"fixed"`` (one config per rank, the same ``worker``, in one
    /// ``Subscriber``) each keep a record of the blocks they stored, so that one rank's
    /// ``AllBlocksCleared`` or restart removes its own blocks and not the other ranks'. Pass
    /// ``shared_worker=True`` to every engine that feeds ``worker`` when the engines sharing
    /// it run in different ``Subscriber``\ s (a subscriber cannot see the others' engines);
    /// each then keeps that record (about 40 bytes per block). A malformed endpoint or name,
    /// a transport that cannot reach an engine (``udp://``, ``inproc://``), or one this
    /// wheel's libzmq was built without (such as ``pgm://``), raises ``ValueError`` here.
    #[pyclass(frozen, module = "kvtrie.zmq", name = "EngineConfig")]
    pub struct PyEngineConfig {
        inner: EngineConfig,
        /// The constructor's arguments by name, as given (for pickling: see `_init_args`).
        args: Py<PyDict>,
    }

    #[pymethods]
    impl PyEngineConfig {
        #[new]
        #[pyo3(signature = (
            pub_endpoint, worker, block_size = 16, *, replay_endpoint = None, topic = "",
            name = None, namespace = "", engine_block_size = None, mapping = "fixed",
            initial_replay = true, rcvhwm = kvtrie::events::zmq::DEFAULT_RCVHWM,
            replay_timeout = 2.0, shared_worker = false,
        ))]
        #[allow(clippy::too_many_arguments)]
        fn new(
            py: Python<'_>,
            pub_endpoint: String,
            worker: u64,
            block_size: usize,
            replay_endpoint: Option<String>,
            topic: &str,
            name: Option<String>,
            namespace: &str,
            engine_block_size: Option<usize>,
            mapping: &str,
            initial_replay: bool,
            rcvhwm: i32,
            replay_timeout: f64,
            shared_worker: bool,
        ) -> PyResult<Self> {
            let args = PyDict::new(py);
            args.set_item("pub_endpoint", &pub_endpoint)?;
            args.set_item("worker", worker)?;
            args.set_item("block_size", block_size)?;
            args.set_item("replay_endpoint", &replay_endpoint)?;
            args.set_item("topic", topic)?;
            args.set_item("name", &name)?;
            args.set_item("namespace", namespace)?;
            args.set_item("engine_block_size", engine_block_size)?;
            args.set_item("mapping", mapping)?;
            args.set_item("initial_replay", initial_replay)?;
            args.set_item("rcvhwm", rcvhwm)?;
            args.set_item("replay_timeout", replay_timeout)?;
            args.set_item("shared_worker", shared_worker)?;
            let decode = decode_config(block_size, namespace, engine_block_size)?;
            let mapping = match mapping {
                "fixed" => WorkerMapping::Fixed,
                "add_rank" => WorkerMapping::AddRank,
                "per_rank" => WorkerMapping::PerRank,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "mapping must be \"fixed\", \"add_rank\" or \"per_rank\", not {other:?}"
                    )))
                }
            };
            if rcvhwm < 0 {
                return Err(PyValueError::new_err("rcvhwm must be >= 0"));
            }
            let mut c = EngineConfig::new(pub_endpoint, WorkerId(worker), decode)
                .with_topic(topic)
                .with_mapping(mapping)
                .with_initial_replay(initial_replay)
                .with_rcvhwm(rcvhwm)
                .with_replay_timeout(duration_arg(replay_timeout, "replay_timeout")?)
                .with_shared_worker(shared_worker);
            if let Some(r) = replay_endpoint {
                c = c.with_replay(r);
            }
            if let Some(n) = name {
                c = c.with_name(n);
            }
            // Bad endpoints and names are refused here, not when a subscriber starts.
            c.validate()
                .map_err(|e| PyValueError::new_err(format!("engine {:?}: {e}", c.name)))?;
            Ok(Self {
                inner: c,
                args: args.unbind(),
            })
        }

        /// The constructor's arguments by name (a copy): ``EngineConfig(**c._init_args())``
        /// builds an equal configuration. Pickling and ``copy`` use it (Ray passes a
        /// deployment's arguments by pickle).
        fn _init_args<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
            self.args.bind(py).copy()
        }

        /// Equal when built from equal arguments (defaults included).
        fn __eq__(&self, py: Python<'_>, other: PyRef<'_, Self>) -> PyResult<bool> {
            self.args.bind(py).eq(other.args.bind(py))
        }

        /// Consistent with `__eq__` (a class with `__eq__` alone is not hashable, and this one
        /// was before it compared by value).
        fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
            PyTuple::new(py, self.args.bind(py).items().iter())?.hash()
        }

        /// The label used in stats (default: the PUB endpoint).
        #[getter]
        fn name(&self) -> &str {
            &self.inner.name
        }

        #[getter]
        fn pub_endpoint(&self) -> &str {
            &self.inner.pub_endpoint
        }

        #[getter]
        fn worker(&self) -> u64 {
            self.inner.worker.0
        }

        fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
            let replay = match &self.inner.replay_endpoint {
                Some(e) => str_repr(py, e)?,
                None => "None".into(),
            };
            Ok(format!(
                "kvtrie.zmq.EngineConfig({}, worker={}, replay_endpoint={replay})",
                str_repr(py, &self.inner.pub_endpoint)?,
                self.inner.worker.0,
            ))
        }
    }

    fn stats_dict<'py>(py: Python<'py>, s: &EngineStats) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("name", &s.name)?;
        d.set_item("batches", s.batches)?;
        d.set_item("events", s.events)?;
        d.set_item("skipped_events", s.skipped_events)?;
        d.set_item("skipped_block_sizes", s.skipped_block_sizes)?;
        d.set_item("malformed_events", s.malformed_events)?;
        d.set_item("gaps", s.gaps)?;
        d.set_item("replayed", s.replayed)?;
        d.set_item("caught_up", s.caught_up)?;
        d.set_item("lost", s.lost)?;
        d.set_item("decode_errors", s.decode_errors)?;
        d.set_item("apply_errors", s.apply_errors)?;
        d.set_item("restarts", s.restarts)?;
        d.set_item("implausible_seqs", s.implausible_seqs)?;
        d.set_item("connected", s.connected)?;
        d.set_item("disconnects", s.disconnects)?;
        d.set_item("connect_retries", s.connect_retries)?;
        d.set_item("connect_timeouts", s.connect_timeouts)?;
        d.set_item("replay_failures", s.replay_failures)?;
        d.set_item("reconnects", s.reconnects)?;
        d.set_item("last_seq", s.last_seq)?;
        d.set_item("last_error", s.last_error.as_deref())?;
        Ok(d)
    }

    /// Subscribes a :class:`kvtrie.BlockIndex` to vLLM engines: one background thread per
    /// engine connects a SUB socket, decodes every batch and applies it to the index, with
    /// gap detection, replay and reconnects (see the Rust docs of
    /// ``kvtrie::events::zmq``). The threads need no GIL. Stop with :meth:`stop` (or use it
    /// as a context manager); dropping it stops it too. Every engine's ``block_size`` must be
    /// the index's hasher's (``ValueError`` otherwise: the index hashes requests in its
    /// hasher's blocks, and events decoded into other blocks would never match them). The
    /// engines' ``namespace`` must be the one the index's hasher is salted with too (not
    /// checked: a hasher's seed does not say which of its salts is the namespace).
    ///
    /// >>> index = kvtrie.BlockIndex(kvtrie.BlockHasher(16))
    /// >>> engine = kvtrie.zmq.EngineConfig("tcp://127.0.0.1:5557", worker=1)
    /// >>> with kvtrie.zmq.Subscriber(index, [engine]) as sub:  # doctest: +SKIP
    /// ...     print(sub.stats()[0]["batches"])
    #[pyclass(frozen, weakref, module = "kvtrie.zmq", name = "Subscriber")]
    pub struct PySubscriber {
        /// The threads' handle (in a child made by `fork`, the parent's: no thread runs there,
        /// and the child neither stops nor joins them).
        inner: Mutex<Option<ForkGuarded<Subscriber>>>,
        /// The stats `stats()` gives once `inner` is taken: the last live ones while the
        /// threads stop, then the final ones.
        final_stats: Mutex<Vec<EngineStats>>,
        /// Held by `stop` through the join: a second `stop` waits for the first's final stats.
        stopping: Mutex<()>,
        /// The engines' names, in order (for `repr`).
        names: Vec<String>,
    }

    #[pymethods]
    impl PySubscriber {
        /// Starts the threads. An engine configuration libzmq rejects raises ``ValueError``,
        /// a thread the system refuses ``OSError``; nothing is left running then.
        #[new]
        fn new(
            py: Python<'_>,
            index: &PyBlockIndex,
            engines: Vec<PyRef<'_, PyEngineConfig>>,
        ) -> PyResult<Self> {
            let engines: Vec<EngineConfig> = engines.iter().map(|e| e.inner.clone()).collect();
            // The index hashes requests (`find_matches_tokens`, a `KvAwareRouter` on it) in
            // its hasher's blocks: events decoded into other blocks would never match them.
            let bs = index.inner.hasher().block_size();
            if let Some((i, e)) = engines
                .iter()
                .enumerate()
                .find(|(_, e)| e.decode.block_size() != bs)
            {
                return Err(PyValueError::new_err(format!(
                    "kvtrie ZMQ subscriber: engine {i} ({:?}) decodes into blocks of {} tokens, \
                     but the index hashes requests in blocks of {bs}: give the EngineConfig \
                     block_size={bs} (an engine's larger blocks are split into the router's), \
                     or the index a BlockHasher of the engines' block size",
                    e.name,
                    e.decode.block_size()
                )));
            }
            let names = engines.iter().map(|e| e.name.clone()).collect();
            let index = index.inner.clone();
            let s = py
                .detach(|| Subscriber::try_spawn(index, engines))
                .map_err(|e| match e {
                    SpawnError::Thread(io) => PyOSError::new_err(format!(
                        "kvtrie ZMQ subscriber: cannot start a thread: {io}"
                    )),
                    other => PyValueError::new_err(format!("kvtrie ZMQ subscriber: {other}")),
                })?;
            Ok(Self {
                inner: Mutex::new(Some(ForkGuarded::new(s))),
                final_stats: Mutex::new(Vec::new()),
                stopping: Mutex::new(()),
                names,
            })
        }

        /// Every engine's counters (a list of dicts, in the order the engines were given).
        fn stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
            let stats = match self
                .inner
                .lock_py_attached(py)
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .and_then(ForkGuarded::get)
            {
                Some(s) => s.stats(),
                None => self
                    .final_stats
                    .lock_py_attached(py)
                    .unwrap_or_else(|e| e.into_inner())
                    .clone(),
            };
            stats.iter().map(|s| stats_dict(py, s)).collect()
        }

        /// Stops the threads, waits for them (about 50 ms, GIL released) and returns the
        /// final stats. Idempotent: a call while another stops waits for it and returns the
        /// same. Meanwhile ``stats()`` gives the last stats taken before the stop.
        fn stop<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
            let _one = self
                .stopping
                .lock_py_attached(py)
                .unwrap_or_else(|e| e.into_inner());
            let sub = {
                let mut inner = self
                    .inner
                    .lock_py_attached(py)
                    .unwrap_or_else(|e| e.into_inner());
                // Lock order: `inner`, then `final_stats` (as in `stats`).
                if let Some(s) = inner.as_ref().and_then(ForkGuarded::get) {
                    *self
                        .final_stats
                        .lock_py_attached(py)
                        .unwrap_or_else(|e| e.into_inner()) = s.stats();
                }
                inner.take()
            };
            if let Some(s) = sub.and_then(ForkGuarded::into_inner) {
                let stats = py.detach(|| s.stop());
                *self
                    .final_stats
                    .lock_py_attached(py)
                    .unwrap_or_else(|e| e.into_inner()) = stats;
            }
            self.stats(py)
        }

        fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
            let names = self
                .names
                .iter()
                .map(|n| str_repr(py, n))
                .collect::<PyResult<Vec<_>>>()?;
            Ok(format!(
                "kvtrie.zmq.Subscriber(engines=[{}], running={})",
                names.join(", "),
                if self.running(py) { "True" } else { "False" }
            ))
        }

        /// Is it running (not stopped)?
        #[getter]
        fn running(&self, py: Python<'_>) -> bool {
            self.inner
                .lock_py_attached(py)
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .and_then(ForkGuarded::get)
                .is_some()
        }

        fn __enter__(slf: Py<Self>) -> Py<Self> {
            slf
        }

        #[pyo3(signature = (*_args))]
        fn __exit__(
            &self,
            py: Python<'_>,
            _args: &Bound<'_, pyo3::types::PyTuple>,
        ) -> PyResult<bool> {
            self.stop(py)?;
            Ok(false)
        }
    }

    impl Drop for PySubscriber {
        fn drop(&mut self) {
            // Joining needs no GIL, and the threads never take it.
            let sub = self.inner.get_mut().ok().and_then(Option::take);
            if let Some(s) = sub.and_then(ForkGuarded::into_inner) {
                s.stop();
            }
        }
    }
}
