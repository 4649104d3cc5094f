//! The routers: `PrefixAffinityRouter` (Ray / SGLang prefix-cache affinity over a prefix tree)
//! and `KvAwareRouter` (Dynamo's KV-overlap cost over a block index), with their
//! configurations under the Rust API's names.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvtrie::router::{
    Candidate, ConfigError, KvAwareConfig, KvAwareRouter, LoadChoice, MissPolicy,
    PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId, RouteError as CoreRouteError,
    RouteReason, SelectError,
};
use kvtrie::{BlockIndex, EvictionConfig, TenantId, WorkerId};
use pyo3::exceptions::{PyAssertionError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyDict, PyList, PyMapping, PyString, PyTuple};

use crate::blocks::{block_size_arg, token_list, Keys, PyBlockHasher, PyBlockIndex};
use crate::tree::tree_err;
use crate::util::{
    drop_arc_in_background, duration_arg, eviction_totals_dict, float_repr, int_list, opt_repr,
    saturating_bound, saturating_count, str_list, str_repr, text_arg, type_name, Entry, Registry,
};
#[cfg(feature = "nats")]
use crate::util::{drop_in_background, ForkGuarded};
#[cfg(feature = "nats")]
use kvtrie::dist::{DistError, SharedRouter, SharedStats};

pyo3::create_exception!(
    kvtrie,
    RouteError,
    PyValueError,
    "No replica or worker could be chosen (no candidates, or none of them is live)."
);

fn route_err(e: CoreRouteError) -> PyErr {
    match e {
        CoreRouteError::Tree(t) => tree_err(t),
        other => RouteError::new_err(other.to_string()),
    }
}

/// A `dist` start error as a Python exception.
#[cfg(feature = "nats")]
fn dist_err(e: DistError) -> PyErr {
    match e {
        DistError::Connect(_) => pyo3::exceptions::PyConnectionError::new_err(e.to_string()),
        DistError::Runtime(_) => pyo3::exceptions::PyRuntimeError::new_err(e.to_string()),
        other => PyValueError::new_err(other.to_string()),
    }
}

/// A shared router's counters as a dict, under the Rust `SharedStats` field names (the
/// connection's as `connected`, `connects`, `disconnects`, `link_errors`).
#[cfg(feature = "nats")]
fn shared_stats_dict<'py>(py: Python<'py>, s: &SharedStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("connected", s.link.connected)?;
    let counts = [
        ("connects", s.link.connects),
        ("disconnects", s.link.disconnects),
        ("link_errors", s.link.errors),
        ("router_id", s.router_id),
        ("incarnation", s.incarnation),
        ("recorded", s.recorded),
        ("published", s.published),
        ("dropped_decisions", s.dropped_decisions),
        ("published_batches", s.published_batches),
        ("publish_errors", s.publish_errors),
        ("refused_decisions", s.refused_decisions),
        ("applied_seq", s.applied_seq),
        ("applied_batches", s.applied_batches),
        ("applied_decisions", s.applied_decisions),
        ("own_batches", s.own_batches),
        ("unknown_replicas", s.unknown_replicas),
        ("held_decisions", s.held_decisions),
        ("malformed", s.malformed),
        ("pending", s.pending),
        ("lost_messages", s.lost_messages),
        ("refetches", s.refetches),
        ("consumer_errors", s.consumer_errors),
        ("stream_resets", s.stream_resets),
        ("snapshots_written", s.snapshots_written),
        ("snapshot_errors", s.snapshot_errors),
        ("warm_start_seq", s.warm_start_seq),
        ("warm_start_us", s.warm_start_us),
        ("skipped_messages", s.skipped_messages),
        ("lag_skips", s.lag_skips),
        ("last_lag_ms", s.last_lag_ms),
        ("max_lag_ms", s.max_lag_ms),
    ];
    for (k, v) in counts {
        d.set_item(k, v)?;
    }
    Ok(d)
}

// ---------------------------------------------------------------------------------------------
// EvictionConfig
// ---------------------------------------------------------------------------------------------

/// Parameters of a background eviction thread: every ``interval`` seconds, each tenant
/// holding more than ``threshold_chars`` chars is evicted (LRU) down to ``target_chars``;
/// with a global budget, the least recently used text across tenants goes first while the
/// tree holds more than ``max_total_chars`` distinct chars, down to ``target_total_chars``.
/// A target above its threshold (or maximum) is lowered to it, as the Rust
/// ``EvictionConfig::new`` does, so a tenant over its threshold is still evicted; Ray's
/// ``PrefixTree.start_eviction_loop(threshold, target, interval)`` raises the threshold to
/// the target instead, and so does kvtrie's.
///
/// >>> kvtrie.EvictionConfig(5, 10, 1.0).target_chars
/// 5
/// >>> kvtrie.EvictionConfig.ray()
/// EvictionConfig(threshold_chars=400000, target_chars=360000, interval=10.0, global_budget=None, batch_groups=16)
#[pyclass(frozen, eq, module = "kvtrie", name = "EvictionConfig")]
#[derive(Clone, PartialEq)]
pub struct PyEvictionConfig {
    pub inner: EvictionConfig,
}

#[pymethods]
impl PyEvictionConfig {
    #[new]
    #[pyo3(signature = (threshold_chars, target_chars, interval, *, global_budget = None, batch_groups = 16))]
    fn new(
        threshold_chars: &Bound<'_, PyAny>,
        target_chars: &Bound<'_, PyAny>,
        interval: f64,
        global_budget: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        batch_groups: usize,
    ) -> PyResult<Self> {
        let mut c = EvictionConfig::new(
            saturating_bound(threshold_chars, "threshold_chars")?,
            saturating_bound(target_chars, "target_chars")?,
            duration_arg(interval, "interval")?,
        );
        if let Some((max, target)) = global_budget {
            c = c.with_global_budget(
                saturating_bound(&max, "max_total_chars")?,
                saturating_bound(&target, "target_total_chars")?,
            );
        }
        if batch_groups == 0 {
            return Err(PyValueError::new_err("batch_groups must be positive"));
        }
        c.batch_groups = batch_groups;
        Ok(Self { inner: c })
    }

    /// Ray's settings: above 400,000 chars, down to 360,000, every 10 s.
    #[staticmethod]
    fn ray() -> Self {
        Self {
            inner: EvictionConfig::new(400_000, 360_000, Duration::from_secs(10)),
        }
    }

    /// This configuration with a global budget on the tree's distinct chars.
    /// Its numbers are read as the constructor's ``global_budget`` (a float is rounded down,
    /// a negative number is 0, a huge one saturates; ``NaN`` is a ``ValueError``).
    fn with_global_budget(
        &self,
        max_total_chars: &Bound<'_, PyAny>,
        target_total_chars: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: self.inner.with_global_budget(
                saturating_bound(max_total_chars, "max_total_chars")?,
                saturating_bound(target_total_chars, "target_total_chars")?,
            ),
        })
    }

    #[getter]
    fn threshold_chars(&self) -> usize {
        self.inner.threshold_chars
    }

    #[getter]
    fn target_chars(&self) -> usize {
        self.inner.target_chars
    }

    /// Seconds between passes.
    #[getter]
    fn interval(&self) -> f64 {
        self.inner.interval.as_secs_f64()
    }

    /// ``(max_total_chars, target_total_chars)`` or ``None``.
    #[getter]
    fn global_budget(&self) -> Option<(usize, usize)> {
        self.inner.global
    }

    #[getter]
    fn batch_groups(&self) -> usize {
        self.inner.batch_groups
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "EvictionConfig(threshold_chars={}, target_chars={}, interval={}, global_budget={}, \
             batch_groups={})",
            c.threshold_chars,
            c.target_chars,
            float_repr(c.interval.as_secs_f64()),
            c.global
                .map_or("None".to_string(), |(a, b)| format!("({a}, {b})")),
            c.batch_groups
        )
    }
}

// ---------------------------------------------------------------------------------------------
// PrefixAffinityConfig
// ---------------------------------------------------------------------------------------------

fn load_choice(s: &str) -> PyResult<LoadChoice> {
    match s {
        "power_of_two" => Ok(LoadChoice::PowerOfTwo),
        "least_loaded" => Ok(LoadChoice::LeastLoaded),
        _ => Err(PyValueError::new_err(format!(
            "imbalanced_choice must be \"power_of_two\" or \"least_loaded\", not {s:?}"
        ))),
    }
}

fn load_choice_name(c: LoadChoice) -> &'static str {
    match c {
        LoadChoice::PowerOfTwo => "power_of_two",
        LoadChoice::LeastLoaded => "least_loaded",
    }
}

fn miss_policy(s: &str) -> PyResult<MissPolicy> {
    match s {
        "smallest_tenants" => Ok(MissPolicy::SmallestTenants),
        "least_loaded" => Ok(MissPolicy::LeastLoaded),
        _ => Err(PyValueError::new_err(format!(
            "miss_policy must be \"smallest_tenants\" or \"least_loaded\", not {s:?}"
        ))),
    }
}

fn miss_policy_name(p: MissPolicy) -> &'static str {
    match p {
        MissPolicy::SmallestTenants => "smallest_tenants",
        MissPolicy::LeastLoaded => "least_loaded",
    }
}

/// Parameters of a :class:`PrefixAffinityRouter` (the Rust ``PrefixAffinityConfig``). The
/// defaults are Ray Serve's ``PrefixCacheAffinityRouter``; :meth:`sglang` is SGLang's
/// ``cache_aware`` policy. Enums are strings: ``imbalanced_choice`` is ``"power_of_two"``
/// or ``"least_loaded"``, ``miss_policy`` ``"smallest_tenants"`` or ``"least_loaded"``.
///
/// >>> kvtrie.PrefixAffinityConfig().match_rate_threshold
/// 0.1
/// >>> kvtrie.PrefixAffinityConfig.sglang().imbalanced_ratio
/// 1.5
/// >>> kvtrie.PrefixAffinityConfig.ray(match_rate_threshold=0.5).match_rate_threshold
/// 0.5
#[pyclass(frozen, eq, module = "kvtrie", name = "PrefixAffinityConfig")]
#[derive(Clone, PartialEq)]
pub struct PyPrefixAffinityConfig {
    pub inner: PrefixAffinityConfig,
}

impl PyPrefixAffinityConfig {
    fn with(&self, kw: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut c = self.inner;
        let Some(kw) = kw else {
            return Ok(Self { inner: c });
        };
        for (k, v) in kw.iter() {
            let k: String = k.extract()?;
            match k.as_str() {
                "imbalanced_threshold" => c.imbalanced_threshold = v.extract()?,
                "imbalanced_ratio" => c.imbalanced_ratio = v.extract()?,
                "imbalanced_choice" => c.imbalanced_choice = load_choice(text_arg(&v, &k)?)?,
                "match_rate_threshold" => c.match_rate_threshold = v.extract()?,
                "miss_policy" => c.miss_policy = miss_policy(text_arg(&v, &k)?)?,
                "eviction" => {
                    c.eviction = if v.is_none() {
                        None
                    } else {
                        Some(v.cast::<PyEvictionConfig>()?.get().inner)
                    }
                }
                "seed" => c.seed = v.extract()?,
                other => {
                    return Err(PyTypeError::new_err(format!(
                        "unexpected keyword argument {other:?}"
                    )))
                }
            }
        }
        // The router's own checks, so that every value it would refuse is refused here.
        c.validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self { inner: c })
    }
}

#[pymethods]
impl PyPrefixAffinityConfig {
    /// Ray's defaults, with any field overridden by keyword.
    #[new]
    #[pyo3(signature = (**kwargs))]
    fn new(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self {
            inner: PrefixAffinityConfig::ray(),
        }
        .with(kwargs)
    }

    /// Ray Serve's ``PrefixCacheAffinityRouter`` policy (the default), with overrides.
    #[staticmethod]
    #[pyo3(signature = (**kwargs))]
    fn ray(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::new(kwargs)
    }

    /// SGLang's ``cache_aware`` policy with its router's command-line defaults (eviction
    /// every 120 s of each replica above 2**26 chars down to 2**26), with overrides.
    #[staticmethod]
    #[pyo3(signature = (**kwargs))]
    fn sglang(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self {
            inner: PrefixAffinityConfig::sglang(),
        }
        .with(kwargs)
    }

    /// A copy with the given fields changed.
    #[pyo3(signature = (**kwargs))]
    fn replace(&self, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        self.with(kwargs)
    }

    /// This configuration with Ray's eviction settings (:meth:`EvictionConfig.ray`).
    fn with_eviction(&self) -> Self {
        Self {
            inner: self.inner.with_eviction(),
        }
    }

    #[getter]
    fn imbalanced_threshold(&self) -> f64 {
        self.inner.imbalanced_threshold
    }

    #[getter]
    fn imbalanced_ratio(&self) -> Option<f64> {
        self.inner.imbalanced_ratio
    }

    #[getter]
    fn imbalanced_choice(&self) -> &'static str {
        load_choice_name(self.inner.imbalanced_choice)
    }

    #[getter]
    fn match_rate_threshold(&self) -> f64 {
        self.inner.match_rate_threshold
    }

    #[getter]
    fn miss_policy(&self) -> &'static str {
        miss_policy_name(self.inner.miss_policy)
    }

    #[getter]
    fn eviction(&self) -> Option<PyEvictionConfig> {
        self.inner.eviction.map(|inner| PyEvictionConfig { inner })
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "PrefixAffinityConfig(imbalanced_threshold={}, imbalanced_ratio={}, \
             imbalanced_choice='{}', match_rate_threshold={}, miss_policy='{}', eviction={}, \
             seed={})",
            float_repr(c.imbalanced_threshold),
            opt_repr(c.imbalanced_ratio, float_repr),
            load_choice_name(c.imbalanced_choice),
            float_repr(c.match_rate_threshold),
            miss_policy_name(c.miss_policy),
            c.eviction
                .map_or("None".into(), |e| PyEvictionConfig { inner: e }.__repr__()),
            c.seed
        )
    }
}

// ---------------------------------------------------------------------------------------------
// PrefixAffinityRouter
// ---------------------------------------------------------------------------------------------

/// Every `reason` a `Route` can carry (what `reason_name` returns for the router's reasons).
const REASON_NAMES: [&str; 5] = [
    "prefix_match",
    "smallest_tenants",
    "least_loaded",
    "imbalanced",
    "no_text",
];

fn reason_name(r: RouteReason) -> &'static str {
    match r {
        RouteReason::PrefixMatch => "prefix_match",
        RouteReason::SmallestTenants => "smallest_tenants",
        RouteReason::LeastLoaded => "least_loaded",
        RouteReason::Imbalanced => "imbalanced",
        RouteReason::NoText => "no_text",
        _ => "other",
    }
}

/// The decision of :meth:`PrefixAffinityRouter.route`: the chosen ``replica`` (its name; the
/// prompt has been recorded for it), the ``reason`` (``"prefix_match"``,
/// ``"smallest_tenants"``, ``"least_loaded"``, ``"imbalanced"`` or ``"no_text"``) and
/// ``matched_chars``, the chars of the prompt the candidates' caches held before.
#[pyclass(frozen, module = "kvtrie", name = "Route")]
pub struct PyRoute {
    #[pyo3(get)]
    replica: Py<PyString>,
    #[pyo3(get)]
    reason: &'static str,
    #[pyo3(get)]
    matched_chars: usize,
}

#[pymethods]
impl PyRoute {
    /// A decision with these fields, as :meth:`PrefixAffinityRouter.route` returns it (for
    /// tests of code that takes routes, and for pickling: Ray passes an actor's results by
    /// pickle). ``reason`` is one of the router's reasons, ``matched_chars`` an int ≥ 0.
    #[new]
    #[pyo3(signature = (replica, reason, matched_chars))]
    fn new(replica: Bound<'_, PyString>, reason: &str, matched_chars: usize) -> PyResult<Self> {
        let Some(&reason) = REASON_NAMES.iter().find(|&&r| r == reason) else {
            return Err(PyValueError::new_err(format!(
                "reason must be one of {}, not {reason:?}",
                REASON_NAMES.join(", ")
            )));
        };
        Ok(Self {
            replica: replica.unbind(),
            reason,
            matched_chars,
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Route(replica={}, reason='{}', matched_chars={})",
            self.replica.bind(py).repr()?,
            self.reason,
            self.matched_chars
        ))
    }

    /// Consistent with ``==`` (routes can be counted, e.g. with ``collections.Counter``).
    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        (self.replica.clone_ref(py), self.reason, self.matched_chars)
            .into_pyobject(py)?
            .hash()
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(o) = other.cast::<PyRoute>() else {
            return Ok(false);
        };
        let o = o.get();
        Ok(self.replica.bind(py).as_any().eq(o.replica.bind(py))?
            && self.reason == o.reason
            && self.matched_chars == o.matched_chars)
    }
}

/// Ray Serve's prefix-cache affinity policy (or SGLang's) over kvtrie's prefix tree, whose
/// tenants are the replicas (by name). Per request, among the candidates that are replicas:
/// imbalanced queues → by load alone; else the least-loaded candidate holding at least
/// ``match_rate_threshold`` of the prompt; else the least-loaded of the smallest caches (Ray)
/// or the least-loaded candidate (SGLang). The prompt is recorded for the chosen replica in
/// the same descent of the tree; ties rotate. Routing takes no lock, releases the GIL, and
/// runs in parallel from several Python threads.
///
/// >>> router = kvtrie.PrefixAffinityRouter()
/// >>> router.update_replicas(["r0", "r1"])
/// >>> idle = {"r0": 0, "r1": 0}
/// >>> first = router.route("You are terse. What is Rust?", idle)
/// >>> again = router.route("You are terse. And Go?", idle)
/// >>> again.replica == first.replica, again.reason
/// (True, 'prefix_match')
#[pyclass(frozen, weakref, module = "kvtrie", name = "PrefixAffinityRouter")]
pub struct PyPrefixAffinityRouter {
    router: Arc<PrefixAffinityRouter>,
    reg: ArcSwap<Registry>,
    admin: Mutex<()>,
    /// The NATS side of a router made by :meth:`shared` (its `router` is this one's).
    #[cfg(feature = "nats")]
    shared: Option<ForkGuarded<SharedRouter>>,
}

/// The live candidates of a route call, with their names.
type Cands<'py> = (Vec<Candidate>, Vec<(TenantId, Bound<'py, PyString>)>);

impl Drop for PyPrefixAffinityRouter {
    /// The router (its tree, and its eviction thread, joined) is dropped off the GIL: see
    /// [`drop_in_background`].
    fn drop(&mut self) {
        // Its background thread is joined when it drops (not in a forked child, where the
        // guard leaks it).
        #[cfg(feature = "nats")]
        if let Some(shared) = self.shared.take() {
            drop_in_background(shared);
        }
        static EMPTY: OnceLock<Arc<PrefixAffinityRouter>> = OnceLock::new();
        drop_arc_in_background(&mut self.router, &EMPTY, || {
            PrefixAffinityRouter::new(PrefixAffinityConfig::ray())
        });
    }
}

impl PyPrefixAffinityRouter {
    /// Candidates from Python: a mapping ``{name: queue_len}``, or an iterable of names
    /// (queue length 0) or of ``(name, queue_len)`` pairs. Names that are not replicas are
    /// dropped.
    fn candidates<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<Cands<'py>> {
        let reg = self.reg.load();
        let mut cands = Vec::new();
        let mut names = Vec::new();
        let mut push = |name: &Bound<'py, PyAny>, queue: usize| -> PyResult<()> {
            let s = text_arg(name, "a candidate name")?;
            if let Some(e) = reg.get(s) {
                cands.push(Candidate::new(ReplicaId(e.id), queue));
                names.push((e.id, name.cast::<PyString>()?.clone()));
            }
            Ok(())
        };
        // A dict, list or tuple is recognized without running Python code: the check for any
        // other mapping is `isinstance(obj, collections.abc.Mapping)`, which runs the ABC's
        // Python `__instancecheck__`, and a daemon thread running Python code while the
        // interpreter exits is ended by CPython (before 3.14) with an unwind that aborts the
        // process when it reaches a Rust frame ("FATAL: exception not rethrown").
        let is_sequence =
            obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>();
        if let Ok(d) = obj.cast::<PyDict>() {
            for (k, v) in d.iter() {
                push(&k, saturating_count(&v, "queue_len")?)?;
            }
        } else if let Some(m) = (!is_sequence)
            .then(|| obj.cast::<PyMapping>().ok())
            .flatten()
        {
            // Any other mapping (`MappingProxyType`, `ChainMap`, a `Mapping` of one's own):
            // its values are the queue lengths too.
            for pair in m.items()?.iter() {
                let (k, v) = pair.extract::<(Bound<'py, PyAny>, Bound<'py, PyAny>)>()?;
                push(&k, saturating_count(&v, "queue_len")?)?;
            }
        } else {
            if obj.is_instance_of::<PyString>() {
                return Err(PyTypeError::new_err(
                    "candidates must be a dict, or a list of names or (name, queue_len) pairs",
                ));
            }
            for item in obj.try_iter()? {
                let item = item?;
                if item.is_instance_of::<PyString>() {
                    push(&item, 0)?;
                } else if let Ok(t) = item.cast::<PyTuple>() {
                    if t.len() != 2 {
                        return Err(PyTypeError::new_err(
                            "a candidate pair is (name, queue_len)",
                        ));
                    }
                    push(
                        &t.get_item(0)?,
                        saturating_count(&t.get_item(1)?, "queue_len")?,
                    )?;
                } else {
                    return Err(PyTypeError::new_err(format!(
                        "a candidate must be a name or a (name, queue_len) pair, not {}",
                        type_name(&item).unwrap_or_default()
                    )));
                }
            }
        }
        Ok((cands, names))
    }

    /// The NATS side, if this router shares its decisions (and this is the process that
    /// made it).
    #[cfg(feature = "nats")]
    fn nats(&self) -> Option<&SharedRouter> {
        self.shared.as_ref().and_then(ForkGuarded::get)
    }

    /// Makes the replica set exactly `names` (a shared router then applies the peers'
    /// decisions it held back for replicas it did not have).
    fn update_names(&self, names: &[&str]) -> Result<Vec<ReplicaId>, kvtrie::Error> {
        #[cfg(feature = "nats")]
        if let Some(shared) = self.nats() {
            return shared.try_update_replicas(names);
        }
        self.router.try_update_replicas(names)
    }

    /// Adds one replica (a shared router then applies the peers' decisions it held back for
    /// it).
    fn add_name(&self, name: &str) -> Result<ReplicaId, kvtrie::Error> {
        #[cfg(feature = "nats")]
        if let Some(shared) = self.nats() {
            return shared.try_add_replica(name);
        }
        self.router.try_add_replica(name)
    }

    /// Routes `text` among `cands`, sharing the decision if this router is shared.
    fn route_text(
        &self,
        text: &str,
        cands: &[Candidate],
    ) -> Result<kvtrie::router::Route, CoreRouteError> {
        #[cfg(feature = "nats")]
        if let Some(shared) = self.nats() {
            return shared.route(text, cands);
        }
        self.router.route(text, cands)
    }

    /// Runs `pick` (a route or a choice) on `text` among the live `candidates` with the GIL
    /// released, and names the replica it picked.
    fn decide<F>(
        &self,
        py: Python<'_>,
        text: &str,
        candidates: &Bound<'_, PyAny>,
        pick: F,
    ) -> PyResult<PyRoute>
    where
        F: FnOnce(&str, &[Candidate]) -> Result<kvtrie::router::Route, CoreRouteError> + Send,
    {
        let (cands, names) = self.candidates(candidates)?;
        if cands.is_empty() {
            return Err(RouteError::new_err(
                "none of the candidates is a replica of this router",
            ));
        }
        let r = py.detach(|| pick(text, &cands));
        self.finish(py, r, &names)
    }

    fn finish(
        &self,
        py: Python<'_>,
        r: Result<kvtrie::router::Route, CoreRouteError>,
        names: &[(TenantId, Bound<'_, PyString>)],
    ) -> PyResult<PyRoute> {
        let r = r.map_err(route_err)?;
        let name = names
            .iter()
            .find(|(id, _)| *id == r.replica.tenant())
            .map(|(_, n)| n.clone().unbind())
            .ok_or_else(|| RouteError::new_err("the chosen replica is not a candidate"))?;
        let _ = py;
        Ok(PyRoute {
            replica: name,
            reason: reason_name(r.reason),
            matched_chars: r.matched_chars,
        })
    }
}

#[pymethods]
impl PyPrefixAffinityRouter {
    /// A router over a new, empty tree (``config`` defaults to Ray's policy). Starts the
    /// background eviction thread if ``config.eviction`` is set.
    #[new]
    #[pyo3(signature = (config = None))]
    fn new(config: Option<&PyPrefixAffinityConfig>) -> PyResult<Self> {
        let cfg = config.map_or_else(PrefixAffinityConfig::ray, |c| c.inner);
        // A configuration is checked when built; `try_new` keeps a refused one from
        // panicking here all the same.
        let router =
            PrefixAffinityRouter::try_new(cfg).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self {
            router: Arc::new(router),
            reg: ArcSwap::from_pointee(Registry::default()),
            admin: Mutex::new(()),
            #[cfg(feature = "nats")]
            shared: None,
        })
    }

    /// A router that shares its routing decisions with the other routers of the same
    /// ``subject_prefix`` over NATS JetStream (``nats_url``, e.g. ``"nats://127.0.0.1:4222"``;
    /// the server must run with JetStream, ``nats-server -js``), and applies theirs to its
    /// tree: routers in different processes (several proxies, or several ingress replicas of a
    /// Ray Serve application) route as one router that saw every request. It loads the newest
    /// tree snapshot of the bucket at start (``warm_start``, waiting at most ``warm_timeout``
    /// seconds, or not at all once the first connection attempt failed) and stores one every
    /// ``snapshot_interval`` seconds if set; the streams keep ``retention`` seconds of
    /// decisions (at least 1). An unreachable server is not an error: the router starts cold,
    /// routes on what it knows and catches up when the server is back.
    ///
    /// Raises ``ValueError`` for a bad configuration (``subject_prefix`` is one token of
    /// ``[A-Za-z0-9_-]``, at most 241 chars: the streams and bucket are named after it) and
    /// ``ConnectionError`` for an invalid address. Its stats are :meth:`shared_stats`.
    #[staticmethod]
    #[pyo3(signature = (
        nats_url,
        config = None,
        *,
        subject_prefix = "kvtrie",
        router_id = None,
        warm_start = true,
        warm_timeout = 5.0,
        snapshot_interval = None,
        retention = 3600.0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn shared(
        py: Python<'_>,
        nats_url: &Bound<'_, PyAny>,
        config: Option<&PyPrefixAffinityConfig>,
        subject_prefix: &str,
        router_id: Option<u64>,
        warm_start: bool,
        warm_timeout: f64,
        snapshot_interval: Option<f64>,
        retention: f64,
    ) -> PyResult<Self> {
        #[cfg(feature = "nats")]
        {
            use kvtrie::dist::{NatsConfig, SharedConfig};
            // Streams and bucket named after the prefix (see `NatsConfig::with_prefix`).
            let mut nats = NatsConfig::new(text_arg(nats_url, "nats_url")?)
                .with_prefix(subject_prefix)
                .map_err(dist_err)?;
            nats.retention = duration_arg(retention, "retention")?;
            let mut cfg = SharedConfig::new(nats);
            cfg.router_id = router_id;
            cfg.warm_start = warm_start;
            cfg.warm_timeout = duration_arg(warm_timeout, "warm_timeout")?;
            cfg.snapshot_interval = snapshot_interval
                .map(|s| duration_arg(s, "snapshot_interval"))
                .transpose()?;
            let policy = config.map_or_else(PrefixAffinityConfig::ray, |c| c.inner);
            let shared = py
                .detach(|| SharedRouter::start(policy, cfg))
                .map_err(dist_err)?;
            Ok(Self {
                router: shared.router().clone(),
                reg: ArcSwap::from_pointee(Registry::default()),
                admin: Mutex::new(()),
                shared: Some(ForkGuarded::new(shared)),
            })
        }
        #[cfg(not(feature = "nats"))]
        {
            let _ = (
                py,
                nats_url,
                config,
                subject_prefix,
                router_id,
                warm_start,
                warm_timeout,
                snapshot_interval,
                retention,
            );
            Err(pyo3::exceptions::PyNotImplementedError::new_err(
                "this build of kvtrie has no NATS support (Rust feature `nats`)",
            ))
        }
    }

    /// Does this router share its decisions over NATS (:meth:`shared`)?
    #[getter]
    fn is_shared(&self) -> bool {
        #[cfg(feature = "nats")]
        {
            self.nats().is_some()
        }
        #[cfg(not(feature = "nats"))]
        false
    }

    /// Records that ``prompt`` went to ``replica`` (a decision made elsewhere), as
    /// :meth:`route` does for its own: in the tree, and for a shared router with its peers
    /// too. Returns ``False`` if ``replica`` is not a replica (or, shared, the decision was
    /// dropped because the publishing buffer is full). Never waits for the server.
    fn record(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        replica: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let text = text_arg(prompt, "prompt")?;
        let name = text_arg(replica, "replica")?;
        let Some(id) = self.reg.load().get(name).map(|e| e.id) else {
            return Ok(false);
        };
        let tree = self.router.tree();
        let inserted = py.detach(|| tree.insert(text, id).is_ok());
        #[cfg(feature = "nats")]
        if let Some(shared) = self.nats() {
            return Ok(inserted && shared.record(text, ReplicaId(id)));
        }
        Ok(inserted)
    }

    /// Waits (at most ``timeout`` seconds, the GIL released) until every decision routed or
    /// recorded so far is stored by the server, then until this router has applied every
    /// decision its peers stored before that. ``True`` once both hold (at once for a router
    /// that is not shared); ``False`` on timeout.
    #[pyo3(signature = (timeout = 30.0))]
    fn sync(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = duration_arg(timeout, "timeout")?;
        #[cfg(feature = "nats")]
        if let Some(shared) = self.nats() {
            return Ok(py.detach(|| {
                let end = latest_within(Instant::now(), timeout);
                let left = || end.saturating_duration_since(Instant::now());
                if !shared.flush(left()) {
                    return false;
                }
                // The stream may not exist yet (nothing published so far), or the server be
                // away for a moment: ask again until the deadline.
                loop {
                    if let Some(last) = shared.stream_last_seq(left()) {
                        return shared.wait_applied(last, left());
                    }
                    if left().is_zero() {
                        return false;
                    }
                    std::thread::sleep(left().min(Duration::from_millis(20)));
                }
            }));
        }
        let _ = (py, timeout);
        Ok(true)
    }

    /// The NATS counters of a shared router (``None`` if it is not shared), under the Rust
    /// ``SharedStats`` field names: decisions ``recorded``, ``published``,
    /// ``applied_decisions`` (the peers'), ``dropped_decisions``, ``held_decisions``,
    /// ``publish_errors``, ``applied_seq``, and the others; the connection's as
    /// ``connected``, ``connects``, ``disconnects`` and ``link_errors``.
    fn shared_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        #[cfg(feature = "nats")]
        if let Some(shared) = self.nats() {
            return shared_stats_dict(py, &shared.stats()).map(Some);
        }
        let _ = py;
        Ok(None)
    }

    /// The last error a shared router met, in words (``None`` if none yet, or if the router
    /// is not shared): what ``shared_stats()``'s ``publish_errors``, ``consumer_errors``,
    /// ``snapshot_errors`` and ``link_errors`` counted last, e.g. a routes stream of the same
    /// name made for other subjects. It is kept after the router recovers.
    fn shared_last_error(&self) -> Option<String> {
        #[cfg(feature = "nats")]
        if let Some(shared) = self.nats() {
            return shared.last_error();
        }
        None
    }

    /// The configuration.
    #[getter]
    fn config(&self) -> PyPrefixAffinityConfig {
        PyPrefixAffinityConfig {
            inner: *self.router.config(),
        }
    }

    /// Makes the replica set exactly ``names``: adds new ones, removes (with their cached
    /// prefixes) those not listed. Routing continues meanwhile.
    fn update_replicas(&self, py: Python<'_>, names: &Bound<'_, PyAny>) -> PyResult<()> {
        let names = str_list(names, "names")?;
        let _admin = self
            .admin
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner());
        let strs: Vec<&str> = names.iter().map(|n| n.to_str()).collect::<PyResult<_>>()?;
        let ids = py.detach(|| self.update_names(&strs)).map_err(tree_err)?;
        let mut seen: HashSet<&str> = HashSet::new();
        let mut added = Vec::new();
        for ((s, n), id) in strs.iter().zip(&names).zip(ids) {
            if seen.insert(s) {
                added.push(Entry {
                    id: id.tenant(),
                    name: n.clone().unbind(),
                    added_at: 0.0,
                });
            }
        }
        self.reg
            .store(Arc::new(Registry::default().rebuilt(py, added, &[])));
        Ok(())
    }

    /// Adds one replica (an existing name is kept).
    fn add_replica(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = text_arg(name, "name")?;
        let _admin = self
            .admin
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner());
        let reg = self.reg.load_full();
        if reg.get(s).is_some() {
            return Ok(());
        }
        let id = py.detach(|| self.add_name(s)).map_err(tree_err)?;
        let e = Entry {
            id: id.tenant(),
            name: name.cast::<PyString>()?.clone().unbind(),
            added_at: 0.0,
        };
        self.reg.store(Arc::new(reg.rebuilt(py, vec![e], &[])));
        Ok(())
    }

    /// Removes one replica and its cached prefixes; returns the chars removed (0 if unknown).
    fn remove_replica(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<usize> {
        let s = text_arg(name, "name")?;
        let _admin = self
            .admin
            .lock_py_attached(py)
            .unwrap_or_else(|e| e.into_inner());
        let reg = self.reg.load_full();
        let Some(id) = reg.get(s).map(|e| e.id) else {
            return Ok(0);
        };
        let router = &self.router;
        let n = py.detach(|| router.remove_replica(ReplicaId(id)));
        self.reg.store(Arc::new(reg.rebuilt(py, Vec::new(), &[s])));
        Ok(n)
    }

    /// The replicas: in the order of the last :meth:`update_replicas`, then those added since by
    /// :meth:`add_replica`.
    fn replicas<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let reg = self.reg.load();
        PyList::new(py, reg.entries().iter().map(|e| e.name.bind(py).clone()))
    }

    /// Chooses a replica for ``prompt`` among ``candidates`` and records the prompt for it.
    /// ``candidates`` is ``{name: queue_len}``, or a list of names (queue length 0) or of
    /// ``(name, queue_len)`` pairs; names that are not replicas are ignored. Raises
    /// :class:`RouteError` when no candidate is a replica.
    fn route(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        candidates: &Bound<'_, PyAny>,
    ) -> PyResult<PyRoute> {
        let text = text_arg(prompt, "prompt")?;
        self.decide(py, text, candidates, |t, c| self.route_text(t, c))
    }

    /// Chooses a replica for ``prompt`` as :meth:`route` does, but records nothing (nor
    /// shares anything): for a caller that records the prompt with :meth:`record` once the
    /// request is placed, as Ray records in its routed callback.
    fn choose(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        candidates: &Bound<'_, PyAny>,
    ) -> PyResult<PyRoute> {
        let text = text_arg(prompt, "prompt")?;
        self.decide(py, text, candidates, |t, c| self.router.choose(t, c))
    }

    /// :meth:`route` for a chat request, by the text Ray's ``PrefixCacheAffinityRouter``
    /// takes from it (its ``_normalize_prompt_to_string``): a ``str`` is itself; a list is the
    /// concatenation of its messages (a dict message gives its ``"content"``), each made text
    /// as Ray does: ``None`` is empty, a ``str`` itself, a list the concatenation of its items,
    /// a dict its ``"text"`` if that is a ``str``, else its ``"content"`` made text; anything
    /// else (images, numbers, tuples) is empty. No roles, no separators. Deeply nested lists
    /// cost no recursion.
    fn route_chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        candidates: &Bound<'_, PyAny>,
    ) -> PyResult<PyRoute> {
        let text = ray_prompt_text(messages)?;
        self.decide(py, &text, candidates, |t, c| self.route_text(t, c))
    }

    /// ``{replica: chars cached}`` in the order replicas were added.
    fn char_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let reg = self.reg.load();
        let d = PyDict::new(py);
        for e in reg.entries() {
            if let Some(c) = self.router.tree().char_count(e.id) {
                d.set_item(e.name.bind(py), c)?;
            }
        }
        Ok(d)
    }

    /// The chars of ``text`` cached for any replica (a read-only match).
    fn matched_chars(&self, py: Python<'_>, text: &Bound<'_, PyAny>) -> PyResult<usize> {
        let s = text_arg(text, "text")?;
        let tree = self.router.tree();
        Ok(py.detach(|| tree.prefix_match(s, None).matched_chars))
    }

    /// Is the background eviction thread running?
    #[getter]
    fn is_evicting(&self) -> bool {
        self.router.is_evicting()
    }

    /// What the background eviction thread has done so far: ``{"passes", "tenants_evicted",
    /// "chars_evicted", "global_chars_evicted"}``, counted after each completed pass; after
    /// :meth:`stop_eviction`, the thread's final totals; ``None`` when the router never had an
    /// eviction thread (``config.eviction`` unset).
    fn eviction_totals<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.router
            .eviction_totals()
            .map(|t| eviction_totals_dict(py, t))
            .transpose()
    }

    /// Stops the background eviction thread, if one runs, and waits for it to exit; the
    /// tree is quiescent once routing stops too (e.g. for :meth:`check_invariants`). The GIL
    /// is released while it waits. Returns the thread's final totals (as
    /// :meth:`eviction_totals`), or ``None`` if the router never had one.
    fn stop_eviction<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let router = &self.router;
        py.detach(|| router.stop_eviction())
            .map(|t| eviction_totals_dict(py, t))
            .transpose()
    }

    /// Checks the tree's invariants (including exact per-replica char counts by a recount);
    /// raises ``AssertionError`` on the first violation. For tests.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let tree = self.router.tree();
        py.detach(|| tree.check_invariants())
            .map_err(PyAssertionError::new_err)
    }

    fn __repr__(&self) -> String {
        format!(
            "kvtrie.PrefixAffinityRouter(replicas={}, nodes={})",
            self.reg.load().len(),
            self.router.tree().node_count()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// KvAwareRouter
// ---------------------------------------------------------------------------------------------

/// Parameters of a :class:`KvAwareRouter` (the Rust ``KvAwareConfig``): ``block_size``
/// tokens per block (must match the engines'), ``overlap_weight`` (Dynamo's
/// ``overlap_score_weight``), ``temperature`` (0: lowest cost wins; above 0: softmax
/// sampling on Dynamo's ``router_temperature`` scale, the costs divided by their spread),
/// ``salt`` (``(lora_name, namespace)`` or ``None``), ``seed`` of the sampling
/// stream, ``reservation_ttl`` in seconds.
///
/// >>> kvtrie.KvAwareConfig(block_size=32).overlap_weight
/// 1.0
#[pyclass(frozen, eq, module = "kvtrie", name = "KvAwareConfig")]
#[derive(Clone, PartialEq)]
pub struct PyKvAwareConfig {
    pub inner: KvAwareConfig,
}

#[pymethods]
impl PyKvAwareConfig {
    #[new]
    #[pyo3(signature = (block_size = 16, *, overlap_weight = 1.0, temperature = 0.0, salt = None, seed = 0, reservation_ttl = 3600.0))]
    fn new(
        block_size: usize,
        overlap_weight: f64,
        temperature: f64,
        salt: Option<(String, String)>,
        seed: u64,
        reservation_ttl: f64,
    ) -> PyResult<Self> {
        let mut c = KvAwareConfig::new(block_size_arg(block_size)?);
        if !overlap_weight.is_finite() || overlap_weight < 0.0 {
            return Err(PyValueError::new_err(
                "overlap_weight must be finite and non-negative",
            ));
        }
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(PyValueError::new_err(
                "temperature must be finite and non-negative",
            ));
        }
        c.overlap_weight = overlap_weight;
        c.temperature = temperature;
        c.salt = salt;
        c.seed = seed;
        c.reservation_ttl = duration_arg(reservation_ttl, "reservation_ttl")?;
        if c.reservation_ttl.is_zero() {
            return Err(PyValueError::new_err(
                "reservation_ttl must be a positive number of seconds",
            ));
        }
        // Whatever else the router would refuse is refused here, where it was set.
        c.validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self { inner: c })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }

    #[getter]
    fn overlap_weight(&self) -> f64 {
        self.inner.overlap_weight
    }

    #[getter]
    fn temperature(&self) -> f64 {
        self.inner.temperature
    }

    #[getter]
    fn salt(&self) -> Option<(String, String)> {
        self.inner.salt.clone()
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed
    }

    /// Seconds.
    #[getter]
    fn reservation_ttl(&self) -> f64 {
        self.inner.reservation_ttl.as_secs_f64()
    }

    /// The hasher this configuration describes (block size and salt).
    fn hasher(&self) -> PyBlockHasher {
        PyBlockHasher {
            inner: self.inner.hasher(),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let c = &self.inner;
        let salt = match &c.salt {
            Some((a, b)) => format!("({}, {})", str_repr(py, a)?, str_repr(py, b)?),
            None => "None".into(),
        };
        Ok(format!(
            "KvAwareConfig(block_size={}, overlap_weight={}, temperature={}, salt={salt}, \
             seed={}, reservation_ttl={})",
            c.block_size,
            float_repr(c.overlap_weight),
            float_repr(c.temperature),
            c.seed,
            float_repr(c.reservation_ttl.as_secs_f64())
        ))
    }
}

/// The worker :meth:`KvAwareRouter.select_and_reserve` chose and what it booked there.
#[pyclass(frozen, eq, module = "kvtrie", name = "Selection")]
#[derive(PartialEq)]
pub struct PySelection {
    #[pyo3(get)]
    worker: u64,
    #[pyo3(get)]
    overlap_blocks: usize,
    /// The overlap weighted by storage tier: what the cost counts as cached.
    #[pyo3(get)]
    weighted_overlap: f64,
    #[pyo3(get)]
    cost: f64,
    #[pyo3(get)]
    prefill_blocks: usize,
    #[pyo3(get)]
    decode_blocks: usize,
}

#[pymethods]
impl PySelection {
    /// A selection with these fields, as :meth:`KvAwareRouter.select_and_reserve` returns it
    /// (for tests of code that takes selections, and for pickling). It books nothing.
    #[new]
    #[pyo3(signature = (worker, overlap_blocks, weighted_overlap, cost, prefill_blocks, decode_blocks))]
    fn new(
        worker: u64,
        overlap_blocks: usize,
        weighted_overlap: f64,
        cost: f64,
        prefill_blocks: usize,
        decode_blocks: usize,
    ) -> Self {
        Self {
            worker,
            overlap_blocks,
            weighted_overlap,
            cost,
            prefill_blocks,
            decode_blocks,
        }
    }

    /// Consistent with ``==`` (Python's hashes of the fields; ``0.0`` and ``-0.0`` alike).
    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        (
            self.worker,
            self.overlap_blocks,
            self.weighted_overlap,
            self.cost,
            self.prefill_blocks,
            self.decode_blocks,
        )
            .into_pyobject(py)?
            .hash()
    }

    /// The engine of the chosen worker (its low 48 bits; see ``zmq.EngineConfig`` mapping
    /// ``"per_rank"``).
    #[getter]
    fn engine(&self) -> u64 {
        WorkerId(self.worker).engine()
    }

    /// The data-parallel rank of the chosen worker (its top 16 bits; 0 for a plain id).
    #[getter]
    fn dp_rank(&self) -> u16 {
        WorkerId(self.worker).dp_rank()
    }

    fn __repr__(&self) -> String {
        format!(
            "Selection(worker={}, overlap_blocks={}, weighted_overlap={}, cost={}, \
             prefill_blocks={}, decode_blocks={})",
            self.worker,
            self.overlap_blocks,
            float_repr(self.weighted_overlap),
            float_repr(self.cost),
            self.prefill_blocks,
            self.decode_blocks
        )
    }
}

/// NVIDIA Dynamo's KV-aware routing over a :class:`BlockIndex`:
/// ``cost(w) = overlap_weight × (P − overlap(w)) + decode(w)`` over the allowed workers,
/// where ``P`` is the request's blocks (a partial block counts), ``overlap(w)`` the leading
/// blocks ``w`` holds (weighted by storage tier: GPU 1.0, CPU 0.8, disk 0.5) and ``decode(w)``
/// the blocks earlier selections keep active on ``w`` (their prompts' full blocks, once each
/// however many requests share them, as Dynamo counts active blocks; each request's partial
/// block and expected output; the prefill blocks booked on ``w``, :meth:`load`, are not
/// counted). Lowest cost wins (ties
/// rotate) or softmax sampling at ``temperature > 0``; the chosen worker's load is booked in the same step (released by
/// :meth:`prefill_complete` and :meth:`request_complete`, or after ``reservation_ttl``).
/// Workers are ints. The GIL is released while selecting.
///
/// >>> router = kvtrie.KvAwareRouter(kvtrie.KvAwareConfig(block_size=4))
/// >>> s = router.select_and_reserve(1, list(range(16)), [0, 1], 16)
/// >>> s.overlap_blocks, s.prefill_blocks
/// (0, 4)
/// >>> router.request_complete(1)
/// True
#[pyclass(frozen, weakref, module = "kvtrie", name = "KvAwareRouter")]
pub struct PyKvAwareRouter {
    router: Arc<KvAwareRouter>,
    index: Py<PyBlockIndex>,
}

impl Drop for PyKvAwareRouter {
    /// The router (its bookings, and the index when it is the last owner) is dropped off the
    /// GIL: see [`drop_in_background`].
    fn drop(&mut self) {
        static EMPTY: OnceLock<Arc<KvAwareRouter>> = OnceLock::new();
        drop_arc_in_background(&mut self.router, &EMPTY, || {
            KvAwareRouter::new(KvAwareConfig::default())
        });
    }
}

#[pymethods]
impl PyKvAwareRouter {
    /// A router over ``index`` (default: a new index built with ``config``'s hasher). The
    /// index must chain hashes with the configuration's seed (``ValueError`` otherwise).
    #[new]
    #[pyo3(signature = (config = None, index = None))]
    fn new(
        py: Python<'_>,
        config: Option<&PyKvAwareConfig>,
        index: Option<Py<PyBlockIndex>>,
    ) -> PyResult<Self> {
        let cfg = config.map_or_else(KvAwareConfig::default, |c| c.inner.clone());
        block_size_arg(cfg.block_size)?;
        let index = match index {
            Some(i) => i,
            None => Py::new(
                py,
                PyBlockIndex {
                    inner: Arc::new(BlockIndex::with_hasher(&cfg.hasher())),
                },
            )?,
        };
        let arc = index.get().inner.clone();
        let router = KvAwareRouter::try_with_index(arc, cfg).map_err(|e| match e {
            ConfigError::SeedMismatch { .. } | ConfigError::BlockSizeMismatch { .. } => {
                PyValueError::new_err(format!(
                    "{e} (in Python: the index must be built with the router's hasher, \
                     BlockIndex(config.hasher()))"
                ))
            }
            other => PyValueError::new_err(other.to_string()),
        })?;
        Ok(Self {
            router: Arc::new(router),
            index,
        })
    }

    /// The index (apply engine events to it).
    #[getter]
    fn index(&self, py: Python<'_>) -> Py<PyBlockIndex> {
        self.index.clone_ref(py)
    }

    /// The configuration.
    #[getter]
    fn config(&self) -> PyKvAwareConfig {
        PyKvAwareConfig {
            inner: self.router.config().clone(),
        }
    }

    /// The hasher requests are hashed with.
    #[getter]
    fn hasher(&self) -> PyBlockHasher {
        PyBlockHasher {
            inner: *self.router.hasher(),
        }
    }

    /// Chooses a worker for request ``request_id`` (an int in ``0..2**64``) among
    /// ``allowed_workers`` and books its load there. Selecting an id that is still booked
    /// replaces its booking. Raises :class:`RouteError` for empty ``tokens`` or workers.
    /// ``cache_salt``, ``lora_name`` (or ``lora_id``) and ``mm_inputs`` (``(identifier,
    /// offset, length)`` of each multimodal item) put the request in its cache partition, as
    /// the engine hashes it (see :meth:`BlockHasher.local_hashes`): a salted request matches
    /// only blocks stored with its salt.
    #[pyo3(signature = (
        request_id, tokens, allowed_workers, expected_output_tokens = None, *,
        cache_salt = None, lora_name = None, mm_inputs = None, lora_id = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn select_and_reserve(
        &self,
        py: Python<'_>,
        request_id: u64,
        tokens: &Bound<'_, PyAny>,
        allowed_workers: &Bound<'_, PyAny>,
        expected_output_tokens: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        mm_inputs: Option<&Bound<'_, PyAny>>,
        lora_id: Option<u64>,
    ) -> PyResult<PySelection> {
        let tokens = token_list(tokens)?;
        let keys = Keys::from_args(cache_salt, lora_name, lora_id, mm_inputs)?;
        let out = match expected_output_tokens {
            Some(o) => saturating_count(o, "expected_output_tokens")?,
            None => 0,
        };
        let workers: Vec<WorkerId> = int_list(allowed_workers, "allowed_workers")?
            .into_iter()
            .map(WorkerId)
            .collect();
        let router = &self.router;
        let s = py
            .detach(|| {
                keys.with(|k| router.select_and_reserve_with(request_id, &tokens, k, &workers, out))
            })
            .map_err(|e| match e {
                SelectError::EmptyTokens | SelectError::NoWorkers => {
                    RouteError::new_err(e.to_string())
                }
                other => RouteError::new_err(other.to_string()),
            })?;
        Ok(PySelection {
            worker: s.worker.0,
            overlap_blocks: s.overlap_blocks,
            weighted_overlap: s.weighted_overlap,
            cost: s.cost,
            prefill_blocks: s.prefill_blocks,
            decode_blocks: s.decode_blocks,
        })
    }

    /// Releases the prefill part of ``request_id``'s booking; False for unknown ids and
    /// repeated calls.
    fn prefill_complete(&self, request_id: u64) -> bool {
        self.router.prefill_complete(request_id)
    }

    /// Releases everything booked for ``request_id``; False if it had no booking.
    fn request_complete(&self, request_id: u64) -> bool {
        self.router.request_complete(request_id)
    }

    /// Releases every booking older than ``reservation_ttl`` as of ``after`` seconds from now
    /// (default 0); returns how many.
    #[pyo3(signature = (after = 0.0))]
    fn expire_stale(&self, py: Python<'_>, after: f64) -> PyResult<usize> {
        let d = duration_arg(after, "after")?;
        let router = &self.router;
        Ok(py.detach(|| router.expire_stale(latest_within(Instant::now(), d))))
    }

    /// Forgets a worker's bookings and load (also remove it from the index); returns the
    /// bookings dropped.
    fn remove_worker(&self, py: Python<'_>, worker: u64) -> usize {
        let router = &self.router;
        py.detach(|| router.remove_worker(WorkerId(worker)))
    }

    /// Forgets the bookings and loads of every data-parallel rank of ``engine`` (workers
    /// ``engine | rank << 48``; also remove it from the index); returns the bookings dropped.
    fn remove_engine(&self, py: Python<'_>, engine: u64) -> usize {
        let router = &self.router;
        py.detach(|| router.remove_engine(engine))
    }

    /// ``(prefill_blocks, decode_blocks)`` booked on ``worker``.
    fn load(&self, worker: u64) -> (u64, u64) {
        let l = self.router.load(WorkerId(worker));
        (l.prefill_blocks, l.decode_blocks)
    }

    /// ``{worker: (prefill_blocks, decode_blocks)}`` for every known worker.
    fn loads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (w, l) in self.router.loads() {
            d.set_item(w.0, (l.prefill_blocks, l.decode_blocks))?;
        }
        Ok(d)
    }

    /// Counters: ``selections``, ``active_requests``, ``prefills_completed``,
    /// ``requests_completed``, ``expired``, ``replaced``, ``unknown_ids``, ``removed``
    /// (bookings dropped with their worker by ``remove_worker``), ``retries``.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.router.stats();
        let d = PyDict::new(py);
        d.set_item("selections", s.selections)?;
        d.set_item("active_requests", s.active_requests)?;
        d.set_item("prefills_completed", s.prefills_completed)?;
        d.set_item("requests_completed", s.requests_completed)?;
        d.set_item("expired", s.expired)?;
        d.set_item("replaced", s.replaced)?;
        d.set_item("unknown_ids", s.unknown_ids)?;
        d.set_item("removed", s.removed)?;
        d.set_item("retries", s.retries)?;
        Ok(d)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "kvtrie.KvAwareRouter({})",
            self.config().__repr__(py)?
        ))
    }
}

/// Most values (strings, lists, dicts, parts) one prompt's messages may hold.
const MAX_PROMPT_VALUES: u64 = 100_000_000;

/// The text Ray's ``PrefixCacheAffinityRouter`` routes a prompt or chat by (its
/// ``_normalize_prompt_to_string`` and ``_coerce_to_text``), built with an explicit stack.
fn ray_prompt_text(prompt: &Bound<'_, PyAny>) -> PyResult<String> {
    if prompt.is_instance_of::<PyString>() {
        return Ok(text_arg(prompt, "prompt")?.to_owned());
    }
    let Ok(list) = prompt.cast::<PyList>() else {
        return Ok(String::new());
    };
    // Values still to make text, the next one last; a `Leave` marks where the walk leaves a
    // container (popped after its contents).
    enum Item<'py> {
        Value(Bound<'py, PyAny>),
        Leave(usize),
    }
    let mut stack: Vec<Item<'_>> = Vec::new();
    for m in list.iter().rev() {
        match m.cast::<PyDict>() {
            Ok(d) => {
                if let Some(c) = d.get_item("content")? {
                    stack.push(Item::Value(c));
                }
            }
            Err(_) => stack.push(Item::Value(m)),
        }
    }
    let mut out = String::new();
    // The lists and dicts being expanded (by address): one met again inside itself would be
    // expanded for ever (Ray's recursion stops with a RecursionError). Siblings may repeat.
    let mut open: HashSet<usize> = HashSet::new();
    let cycle = || {
        PyValueError::new_err(
            "the prompt's messages contain themselves (a list or dict inside itself)",
        )
    };
    // A bound on the work, for values shared so often that expanding them never ends.
    let mut budget: u64 = MAX_PROMPT_VALUES;
    while let Some(item) = stack.pop() {
        let v = match item {
            Item::Value(v) => v,
            Item::Leave(id) => {
                open.remove(&id);
                continue;
            }
        };
        budget = budget.checked_sub(1).ok_or_else(|| {
            PyValueError::new_err(format!(
                "the prompt's messages hold more than {MAX_PROMPT_VALUES} values"
            ))
        })?;
        if out.len() > kvtrie::MAX_TEXT_BYTES {
            // Longer than any prompt the tree takes: stop before a shared part, repeated,
            // builds a string of gigabytes.
            return Err(PyValueError::new_err(format!(
                "the prompt's messages hold more than {} bytes of text",
                kvtrie::MAX_TEXT_BYTES
            )));
        }
        if v.is_instance_of::<PyString>() {
            out.push_str(text_arg(&v, "message content")?);
        } else if let Ok(l) = v.cast::<PyList>() {
            let id = l.as_ptr() as usize;
            if !open.insert(id) {
                return Err(cycle());
            }
            stack.push(Item::Leave(id));
            stack.extend(l.iter().rev().map(Item::Value));
        } else if let Ok(d) = v.cast::<PyDict>() {
            match d.get_item("text")? {
                Some(t) if t.is_instance_of::<PyString>() => {
                    out.push_str(text_arg(&t, "message content")?);
                }
                _ => {
                    if let Some(c) = d.get_item("content")? {
                        let id = d.as_ptr() as usize;
                        if !open.insert(id) {
                            return Err(cycle());
                        }
                        stack.push(Item::Leave(id));
                        stack.push(Item::Value(c));
                    }
                }
            }
        }
        // None and anything else: no text.
    }
    Ok(out)
}

/// `now + d`, or the latest instant this platform can represent when that overflows (so a
/// larger horizon never expires less than a smaller one).
fn latest_within(now: Instant, d: Duration) -> Instant {
    if let Some(t) = now.checked_add(d) {
        return t;
    }
    // Binary search for the largest addable duration below `d`.
    let (mut lo, mut hi) = (Duration::ZERO, d);
    while hi - lo > Duration::from_nanos(1) {
        let mid = lo + (hi - lo) / 2;
        if now.checked_add(mid).is_some() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    now + lo
}
