//! Argument conversion shared by the classes: strings, timestamps, saturating integers,
//! durations, and the tenant-name registry.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvtrie::evict::EvictionTotals;
use kvtrie::TenantId;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// `obj` as UTF-8 text: `TypeError` unless it is a `str`, `ValueError` if it holds a lone
/// surrogate (not encodable as UTF-8). Borrows the string's UTF-8 buffer (no copy for ASCII
/// strings; CPython caches the encoding of others), which lives as long as `obj`. Python
/// strings are immutable, so the borrow stays valid while the GIL is released.
pub fn text_arg<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<&'a str> {
    let s = obj.cast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be str, not {}",
            type_name(obj).unwrap_or_else(|| "?".into())
        ))
    })?;
    s.to_str().map_err(|e| surrogate_error(obj.py(), what, e))
}

/// The `ValueError` for a string that cannot be encoded as UTF-8 (`cause`: Python's
/// `UnicodeEncodeError`).
fn surrogate_error(py: Python<'_>, what: &str, cause: PyErr) -> PyErr {
    let err = PyValueError::new_err(format!(
        "{what} is not valid Unicode text: it contains a lone surrogate, which cannot be \
         encoded as UTF-8"
    ));
    err.set_cause(py, Some(cause));
    err
}

/// The type name of `obj`, for error messages.
pub fn type_name(obj: &Bound<'_, PyAny>) -> Option<String> {
    obj.get_type().name().ok().map(|n| n.to_string())
}

/// The strings of an iterable of `str` (a bare `str` is rejected: it is almost certainly a
/// single name passed where a list was meant).
pub fn str_list<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Vec<Bound<'py, PyString>>> {
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list of str, not a single str"
        )));
    }
    let mut out = Vec::new();
    for item in obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a list of str, not {}",
            type_name(obj).unwrap_or_else(|| "?".into())
        ))
    })? {
        let item = item?;
        match item.cast_into::<PyString>() {
            Ok(s) => {
                if let Err(e) = s.to_str() {
                    return Err(surrogate_error(s.py(), what, e));
                }
                out.push(s)
            }
            Err(e) => {
                let item = e.into_inner();
                return Err(PyTypeError::new_err(format!(
                    "{what} must hold only str, not {}",
                    type_name(&item).unwrap_or_else(|| "?".into())
                )));
            }
        }
    }
    Ok(out)
}

/// A timestamp in seconds as an order-preserving `u64` key, so kvtrie's integer clock keeps
/// exactly Ray's float timestamps (equal floats are one LRU group, order is preserved).
/// `NaN` is rejected; `-0.0` equals `0.0`. Never returns 0 (0 means "never touched").
pub fn time_key(t: f64) -> PyResult<u64> {
    if t.is_nan() {
        return Err(PyValueError::new_err("time_s must be a number, not NaN"));
    }
    let t = if t == 0.0 { 0.0 } else { t };
    let bits = t.to_bits();
    Ok(if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    })
}

/// Inverse of [`time_key`] (`None` for key 0, "never touched").
pub fn time_from_key(k: u64) -> Option<f64> {
    if k == 0 {
        None
    } else if k >> 63 == 1 {
        Some(f64::from_bits(k & !(1 << 63)))
    } else {
        Some(f64::from_bits(!k))
    }
}

/// `s` as Python's `repr(str)` prints it (`'a'`, `"it's"`).
pub fn str_repr(py: Python<'_>, s: &str) -> PyResult<String> {
    Ok(PyString::new(py, s).repr()?.to_string())
}

/// `x` as Python's `repr(float)` prints it: the shortest digits that read back as `x`, in
/// positional notation for decimal exponents from -4 to 15 (`1.0`, `0.0001`,
/// `1000000000000000.0`) and in scientific notation otherwise (`1.5e-07`, `1e+16`), `inf`,
/// `nan`.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` prints the same shortest digits, as `1.5e-7`.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if x != 0.0 && !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
    } else {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            s + ".0"
        }
    }
}

/// `Some(x)` as `repr(x)`, `None` as `None`.
pub fn opt_repr<T>(x: Option<T>, f: impl FnOnce(T) -> String) -> String {
    x.map_or_else(|| "None".to_string(), f)
}

/// `time.time()`.
pub fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A count from Python: an `int` (or an object with `__index__`) or a `float`, saturated to
/// `0..=usize::MAX` (negative → 0, too large → `usize::MAX`; a float is rounded up, since the
/// counts it is compared with are integers and must reach it: `removed >= count`). `NaN` is a
/// `ValueError`, anything else a `TypeError`.
pub fn saturating_count(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    saturating(obj, what, f64::ceil)
}

/// [`saturating_count`] for a bound that integer counts are kept at or under (`count <= bound`,
/// `count > bound`, as an eviction threshold or target): a float is rounded down, so that
/// 10.5 behaves as Ray's comparison with 10.5 does.
pub fn saturating_bound(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    saturating(obj, what, f64::floor)
}

fn saturating(obj: &Bound<'_, PyAny>, what: &str, round: fn(f64) -> f64) -> PyResult<usize> {
    if let Ok(f) = obj.cast::<PyFloat>() {
        let v = f.value();
        if v.is_nan() {
            return Err(PyValueError::new_err(format!("{what} must not be NaN")));
        }
        // `as` saturates (and maps -inf to 0, +inf to usize::MAX).
        return Ok(round(v) as usize);
    }
    let int = obj.cast::<PyInt>().ok().cloned().or_else(|| {
        obj.call_method0("__index__")
            .ok()
            .and_then(|i| i.cast_into::<PyInt>().ok())
    });
    let Some(int) = int else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, not {}",
            type_name(obj).unwrap_or_else(|| "?".into())
        )));
    };
    if int.lt(0)? {
        return Ok(0);
    }
    Ok(int.extract::<u64>().map_or(usize::MAX, |v| v as usize))
}

/// An eviction thread's totals as ``{"passes", "tenants_evicted", "chars_evicted",
/// "global_chars_evicted"}``.
pub fn eviction_totals_dict(py: Python<'_>, t: EvictionTotals) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("passes", t.passes)?;
    d.set_item("tenants_evicted", t.tenants_evicted)?;
    d.set_item("chars_evicted", t.chars_evicted)?;
    d.set_item("global_chars_evicted", t.global_chars_evicted)?;
    Ok(d)
}

/// A list of ints from Python, the argument named `what` (tokens, hashes, worker ids): a
/// `list`, `tuple` or any iterable of ints (or of objects with `__index__`, as numpy's) in
/// `T`'s range. A list or tuple is read in one call, running no Python code (PyO3's check of
/// any other sequence is the ABC's Python `isinstance`). A `str` or `bytes` (iterable, but not
/// of ints), a non-iterable and a non-int item are a `TypeError` naming the argument (PyO3's
/// own text, "Can't extract `str` to `Vec`", named neither); an int out of range keeps PyO3's
/// `OverflowError`.
pub fn int_list<T>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>>
where
    T: for<'a, 'py> FromPyObject<'a, 'py>,
{
    let not_a_list = || {
        PyTypeError::new_err(format!(
            "{what} must be a list of int, not {}",
            type_name(obj).unwrap_or_else(|| "?".into())
        ))
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(not_a_list());
    }
    if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
        if let Ok(v) = obj.extract::<Vec<T>>() {
            return Ok(v);
        }
    }
    let mut out = Vec::new();
    for item in obj.try_iter().map_err(|_| not_a_list())? {
        let item = item?;
        let value: PyResult<T> = item.extract::<T>().map_err(Into::into);
        match value {
            Ok(x) => out.push(x),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => return Err(e),
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "{what} must hold only int, not {}",
                    type_name(&item).unwrap_or_else(|| "?".into())
                )))
            }
        }
    }
    Ok(out)
}

/// A duration in seconds: finite and non-negative, else `ValueError`.
pub fn duration_arg(secs: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        let within = if secs.is_finite() && secs >= 0.0 {
            // Finite and non-negative, but past what a `Duration` holds (2**64 s).
            " of at most 1.8e19"
        } else {
            ""
        };
        PyValueError::new_err(format!(
            "{what} must be a finite, non-negative number of seconds{within}, not {}",
            float_repr(secs)
        ))
    })
}

/// One registered tenant (replica): its id in the tree and its name as a Python `str` (so
/// results return the same object instead of building a new string per call).
pub struct Entry {
    pub id: TenantId,
    pub name: Py<PyString>,
    /// `time_s` of `add_tenants` (Ray's time of the root for this tenant).
    pub added_at: f64,
}

/// Name ↔ id of the live tenants, in the order they were added (Ray's dict order). Published
/// as an immutable snapshot (`ArcSwap`): lookups take no lock; changes copy it (tenants
/// change rarely).
pub struct Registry {
    by_name: HashMap<Box<str>, usize>,
    entries: Vec<Entry>,
    /// slot → index into `entries` + 1 (0: none).
    by_slot: Vec<u32>,
    /// Do the entries' slots ascend in insertion order? (Then a set of ids in ascending order
    /// is already in Ray's order.)
    slot_ordered: bool,
}

impl Default for Registry {
    fn default() -> Self {
        Self {
            by_name: HashMap::new(),
            entries: Vec::new(),
            by_slot: Vec::new(),
            slot_ordered: true,
        }
    }
}

impl Registry {
    /// The names of the tenants `ids` (ascending ids, e.g. a match result) in the order the
    /// tenants were added; ids that are not registered are skipped.
    pub fn names_in_order<'py>(
        &self,
        py: Python<'py>,
        ids: &[TenantId],
    ) -> Vec<Bound<'py, PyString>> {
        if self.slot_ordered {
            let mut out = Vec::with_capacity(ids.len());
            out.extend(
                ids.iter()
                    .filter_map(|&t| self.by_id(t))
                    .map(|(_, e)| e.name.bind(py).clone()),
            );
            out
        } else {
            let mut found: Vec<(usize, &Entry)> =
                ids.iter().filter_map(|&t| self.by_id(t)).collect();
            found.sort_unstable_by_key(|(i, _)| *i);
            found.iter().map(|(_, e)| e.name.bind(py).clone()).collect()
        }
    }

    /// The live tenant called `name`.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }

    /// The tenant with id `id` (same slot and generation), with its position in the order
    /// tenants were added.
    pub fn by_id(&self, id: TenantId) -> Option<(usize, &Entry)> {
        let i = (*self.by_slot.get(id.slot())? as usize).checked_sub(1)?;
        let e = self.entries.get(i)?;
        (e.id == id).then_some((i, e))
    }

    /// The tenants in the order they were added.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// A copy with `added` appended and the names in `removed` dropped.
    pub fn rebuilt(&self, py: Python<'_>, added: Vec<Entry>, removed: &[&str]) -> Registry {
        let mut r = Registry::default();
        let removed: HashSet<&str> = removed.iter().copied().collect();
        let kept = self.entries.iter().filter(|e| {
            let name = e.name.bind(py).to_str().unwrap_or_default();
            !removed.contains(name)
        });
        for e in kept {
            r.push(
                Entry {
                    id: e.id,
                    name: e.name.clone_ref(py),
                    added_at: e.added_at,
                },
                py,
            );
        }
        for e in added {
            r.push(e, py);
        }
        r
    }

    fn push(&mut self, e: Entry, py: Python<'_>) {
        let name: Box<str> = e.name.bind(py).to_str().unwrap_or_default().into();
        let i = self.entries.len();
        let slot = e.id.slot();
        if self
            .entries
            .last()
            .is_some_and(|last| last.id.slot() >= slot)
        {
            self.slot_ordered = false;
        }
        if self.by_slot.len() <= slot {
            self.by_slot.resize(slot + 1, 0);
        }
        self.by_slot[slot] = i as u32 + 1;
        self.by_name.insert(name, i);
        self.entries.push(e);
    }
}

/// Replaces `slot` with the shared empty structure of `empty` (made by `make` on first use)
/// and drops what it held with [`drop_in_background`]: a Python object's `Drop` gives up its
/// structure this way without freeing it under the GIL.
pub fn drop_arc_in_background<T: Send + Sync + 'static>(
    slot: &mut Arc<T>,
    empty: &OnceLock<Arc<T>>,
    make: impl FnOnce() -> T,
) {
    let empty = Arc::clone(empty.get_or_init(|| Arc::new(make())));
    drop_in_background(std::mem::replace(slot, empty));
}

/// A value tied to the process that made it: the handle of a background thread. A child
/// made by `fork` (Python's `multiprocessing` on Linux) inherits the handle but not the
/// thread, so it must neither signal nor join it (joining fails, and a lock the thread held at
/// the fork stays held for ever): there the value reads as absent and is leaked, never
/// dropped.
pub struct ForkGuarded<T> {
    value: Option<T>,
    pid: u32,
}

impl<T> ForkGuarded<T> {
    /// `value`, owned by this process.
    pub fn new(value: T) -> Self {
        Self {
            value: Some(value),
            pid: std::process::id(),
        }
    }

    /// The value, in the process that made it (`None` in a forked child).
    pub fn get(&self) -> Option<&T> {
        self.value
            .as_ref()
            .filter(|_| self.pid == std::process::id())
    }

    /// The value in any process, a forked child included: only for reads that are safe
    /// there (that take no lock the parent's thread may have held at the fork, or only try
    /// it, as [`EvictionHandle::totals`](kvtrie::EvictionHandle::totals) does).
    pub fn inherited(&self) -> Option<&T> {
        self.value.as_ref()
    }

    /// The value, in the process that made it; `None` in a forked child, where it is leaked.
    pub fn into_inner(mut self) -> Option<T> {
        if self.pid == std::process::id() {
            self.value.take()
        } else {
            None
        }
    }
}

impl<T> Drop for ForkGuarded<T> {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(self.value.take());
        }
    }
}

/// The process whose dropper thread [`drop_in_background`] uses: a child made by `fork`
/// inherits the thread's sender but not the thread, and drops in place instead. Claimed when
/// the module is imported ([`claim_dropper`]), so a child forked before anything was dropped
/// does not take it for its own.
static DROPPER_OWNER: OnceLock<u32> = OnceLock::new();

/// Makes this process the owner of the dropper thread (see [`DROPPER_OWNER`]).
pub fn claim_dropper() {
    DROPPER_OWNER.get_or_init(std::process::id);
}

/// Drops `value` on the module's dropper thread instead of the caller's: a Python object
/// that owns a large structure is deallocated with the GIL held, and freeing a tree of
/// 300,000 nodes takes about 0.2 s, which would stop every other Python thread. The thread
/// is started on first use; if it cannot be, `value` is dropped here.
pub fn drop_in_background<T: Send + 'static>(value: T) {
    use std::sync::{mpsc, Mutex};
    type Garbage = Box<dyn Send>;
    static DROPPER: OnceLock<Option<Mutex<mpsc::Sender<Garbage>>>> = OnceLock::new();
    if *DROPPER_OWNER.get_or_init(std::process::id) != std::process::id() {
        drop(value);
        return;
    }
    let tx = DROPPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Garbage>();
        std::thread::Builder::new()
            .name("kvtrie-dropper".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .ok()
            .map(|_| Mutex::new(tx))
    });
    let garbage: Garbage = Box::new(value);
    let unsent = match tx {
        Some(tx) => match tx.lock() {
            Ok(tx) => tx.send(garbage).err().map(|e| e.0),
            Err(_) => Some(garbage),
        },
        None => Some(garbage),
    };
    drop(unsent);
}
