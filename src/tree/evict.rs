//! Background eviction: a thread that keeps every tenant (and optionally the whole tree) within
//! a char budget.
//!
//! Every `interval`, each tenant whose char count is strictly greater than `threshold_chars` is
//! evicted by LRU ([`PrefixTree::evict_tenant_by_lru`] semantics) down to `target_chars`. With a
//! global budget, when the tree's distinct chars exceed `max_total_chars`, the globally least
//! recently used timestamp groups (across tenants) are evicted until the tree holds at most
//! `target_total_chars`. Eviction works in bounded batches (a few timestamp groups at a time),
//! each under the evicted tenant's LRU lock and the locks of the nodes it changes: readers
//! never wait, inserts of other tenants wait only for a node lock they happen to share, and an
//! insert of the tenant being evicted does not wait for the batch: it parks its new leaf's LRU
//! entry, which the eviction takes in before its next group. A pass
//! that evicts nothing costs `O(tenants)` (one relaxed load per tenant).
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use kvtrie::{EvictionConfig, PrefixTree};
//!
//! let tree = Arc::new(PrefixTree::new());
//! let a = tree.add_tenant("a");
//! tree.insert("some prompt text", a).unwrap();
//! let handle = tree
//!     .start_eviction(EvictionConfig::new(10, 5, Duration::from_millis(1)))
//!     .unwrap();
//! // A second thread for the same tree is refused.
//! assert!(tree.start_eviction(EvictionConfig::new(1, 1, Duration::from_secs(1))).is_none());
//! while tree.char_count(a).unwrap() > 10 {
//!     std::thread::sleep(Duration::from_millis(1));
//! }
//! handle.stop();
//! ```

use super::lru::in_batches;
use super::PrefixTree;
use crate::sync::os::{thread, Condvar, Mutex};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Shortest interval between passes the background thread accepts; [`EvictionConfig::new`]
/// and [`PrefixTree::start_eviction`] raise shorter ones (including zero) to it, and
/// [`EvictionConfig::try_new`] rejects them.
pub const MIN_EVICTION_INTERVAL: Duration = Duration::from_millis(1);

/// Parameters of the background eviction thread.
///
/// Build it with [`EvictionConfig::new`] (which clamps) or [`EvictionConfig::try_new`] (which
/// rejects what it would clamp). A configuration written as a struct literal is normalized the
/// same way when it is used: a `target_chars` above `threshold_chars` evicts down to
/// `threshold_chars` (so a tenant over budget is still evicted), an `interval` below
/// [`MIN_EVICTION_INTERVAL`] runs every [`MIN_EVICTION_INTERVAL`], `batch_groups == 0` evicts one group per
/// lock acquisition, and a global target above its maximum evicts down to the maximum. Any
/// interval up to [`Duration::MAX`] works (a pass then runs effectively never).
///
/// ```
/// use std::time::Duration;
/// use kvtrie::EvictionConfig;
///
/// let c = EvictionConfig::new(400_000, 360_000, Duration::from_secs(10));
/// assert_eq!((c.threshold_chars, c.target_chars), (400_000, 360_000));
/// // `new` clamps the target to the threshold and the interval to the minimum ...
/// let clamped = EvictionConfig::new(100, 500, Duration::ZERO);
/// assert_eq!((clamped.target_chars, clamped.interval), (100, kvtrie::evict::MIN_EVICTION_INTERVAL));
/// // ... where `try_new` says what is wrong.
/// assert!(EvictionConfig::try_new(100, 500, Duration::from_secs(1)).is_err());
/// assert!(EvictionConfig::try_new(100, 50, Duration::ZERO).is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionConfig {
    /// A tenant is evicted when its char count is strictly greater than this.
    pub threshold_chars: usize,
    /// ... down to this many chars (or fewer: groups are evicted whole). Values above
    /// `threshold_chars` act as `threshold_chars`.
    pub target_chars: usize,
    /// Time between passes (at least [`MIN_EVICTION_INTERVAL`]; shorter values act as it).
    pub interval: Duration,
    /// Optional global budget: `(max_total_chars, target_total_chars)` over the tree's
    /// distinct chars.
    pub global: Option<(usize, usize)>,
    /// Timestamp groups evicted per acquisition of the tenant's LRU lock (0 acts as 1).
    pub batch_groups: usize,
}

/// Why an [`EvictionConfig`] was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionConfigError {
    /// `target_chars` is above `threshold_chars`: a tenant over its threshold would never be
    /// evicted down to the target.
    TargetAboveThreshold {
        /// The threshold.
        threshold: usize,
        /// The target.
        target: usize,
    },
    /// The global budget's target is above its maximum.
    GlobalTargetAboveMax {
        /// The maximum.
        max: usize,
        /// The target.
        target: usize,
    },
    /// The interval is shorter than [`MIN_EVICTION_INTERVAL`] (a zero interval would busy-loop a core).
    IntervalTooShort(Duration),
}

impl fmt::Display for EvictionConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvictionConfigError::TargetAboveThreshold { threshold, target } => write!(
                f,
                "eviction target of {target} chars is above the threshold of {threshold} chars"
            ),
            EvictionConfigError::GlobalTargetAboveMax { max, target } => write!(
                f,
                "global eviction target of {target} chars is above the maximum of {max} chars"
            ),
            EvictionConfigError::IntervalTooShort(d) => write!(
                f,
                "eviction interval {d:?} is shorter than the minimum of {MIN_EVICTION_INTERVAL:?}"
            ),
        }
    }
}

impl std::error::Error for EvictionConfigError {}

impl EvictionConfig {
    /// Per-tenant eviction: above `threshold_chars`, down to `target_chars`, every `interval`.
    /// A target above the threshold is clamped to it, an interval below [`MIN_EVICTION_INTERVAL`] is
    /// raised to it; [`try_new`](Self::try_new) rejects both instead.
    pub fn new(threshold_chars: usize, target_chars: usize, interval: Duration) -> Self {
        Self {
            threshold_chars,
            target_chars: target_chars.min(threshold_chars),
            interval: interval.max(MIN_EVICTION_INTERVAL),
            global: None,
            batch_groups: 16,
        }
    }

    /// [`new`](Self::new), but an error instead of a clamp.
    pub fn try_new(
        threshold_chars: usize,
        target_chars: usize,
        interval: Duration,
    ) -> Result<Self, EvictionConfigError> {
        let c = Self {
            threshold_chars,
            target_chars,
            interval,
            global: None,
            batch_groups: 16,
        };
        c.validate()?;
        Ok(c)
    }

    /// Adds a global budget on the tree's distinct chars: above `max_total_chars`, the least
    /// recently used groups across all tenants go first until at most `target_total_chars`
    /// remain (a target above the maximum is clamped to it). Of tenants whose oldest groups
    /// have the same time, the one with the smallest [`TenantId`](crate::TenantId) (the first
    /// in [`PrefixTree::tenants`]) goes first.
    pub fn with_global_budget(mut self, max_total_chars: usize, target_total_chars: usize) -> Self {
        self.global = Some((max_total_chars, target_total_chars.min(max_total_chars)));
        self
    }

    /// Checks the configuration: the errors [`try_new`](Self::try_new) reports, for a
    /// configuration built any way.
    pub fn validate(&self) -> Result<(), EvictionConfigError> {
        if self.target_chars > self.threshold_chars {
            return Err(EvictionConfigError::TargetAboveThreshold {
                threshold: self.threshold_chars,
                target: self.target_chars,
            });
        }
        if let Some((max, target)) = self.global {
            if target > max {
                return Err(EvictionConfigError::GlobalTargetAboveMax { max, target });
            }
        }
        if self.interval < MIN_EVICTION_INTERVAL {
            return Err(EvictionConfigError::IntervalTooShort(self.interval));
        }
        Ok(())
    }

    /// The configuration as it is applied: every documented clamp done.
    pub fn normalized(&self) -> Self {
        Self {
            threshold_chars: self.threshold_chars,
            target_chars: self.target_chars.min(self.threshold_chars),
            interval: self.interval.max(MIN_EVICTION_INTERVAL),
            global: self.global.map(|(max, target)| (max, target.min(max))),
            batch_groups: self.batch_groups.max(1),
        }
    }
}

/// Why [`PrefixTree::try_start_eviction`] did not start a thread.
#[derive(Debug)]
#[non_exhaustive]
pub enum EvictionStartError {
    /// An eviction thread is already running for this tree (it keeps its parameters).
    AlreadyRunning,
    /// The configuration is invalid.
    Config(EvictionConfigError),
    /// The operating system refused to start a thread.
    Spawn(std::io::Error),
}

impl fmt::Display for EvictionStartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvictionStartError::AlreadyRunning => {
                write!(f, "an eviction thread is already running for this tree")
            }
            EvictionStartError::Config(e) => write!(f, "invalid eviction configuration: {e}"),
            EvictionStartError::Spawn(e) => write!(f, "could not start the eviction thread: {e}"),
        }
    }
}

impl std::error::Error for EvictionStartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EvictionStartError::Config(e) => Some(e),
            EvictionStartError::Spawn(e) => Some(e),
            EvictionStartError::AlreadyRunning => None,
        }
    }
}

/// State shared by a running thread and its handle.
#[derive(Default)]
struct State {
    /// Stop requested (by the handle, or the tree's `Drop`).
    stopped: bool,
    /// The thread panicked with this message (it then exited).
    panicked: Option<String>,
    /// What the thread's passes did so far.
    totals: EvictionTotals,
    /// Deadlines the thread computed (counted under the lock it then waits with: a test that
    /// reads it has seen the thread reach the wait).
    #[cfg(test)]
    waits: u64,
    /// Test hook: the thread's next pass panics.
    #[cfg(test)]
    panic_next_pass: bool,
}

/// Stop signal and status shared by a running thread and its handle.
#[derive(Default)]
struct Signal {
    state: Mutex<State>,
    cv: Condvar,
}

impl Signal {
    fn state(&self) -> crate::sync::os::MutexGuard<'_, State> {
        crate::sync::os::lock(&self.state)
    }

    fn stop(&self) {
        self.state().stopped = true;
        self.cv.notify_all();
    }

    /// `f` of the state, read in the process that started the thread (`pid`). In a child made
    /// by `fork` the parent's thread may have held the lock at the fork, for ever: the state is
    /// read only if the lock is free there (`R::default()` otherwise).
    fn read<R: Default>(&self, pid: u32, f: impl FnOnce(&State) -> R) -> R {
        if pid == std::process::id() {
            f(&self.state())
        } else {
            crate::sync::os::try_lock(&self.state).map_or_else(R::default, |s| f(&s))
        }
    }
}

/// The tree's record of its running eviction thread.
pub(crate) struct Running {
    signal: Arc<Signal>,
    thread: Option<thread::JoinHandle<()>>,
    /// The process that started the thread (see [`Running::stop_and_join`]).
    pid: u32,
}

impl Running {
    /// Signals the thread and joins it (unless called from the thread itself, which happens
    /// when the thread held the last reference to the tree: then it exits on its own).
    ///
    /// In a child made by `fork` (Python's `multiprocessing` does that), the record is the
    /// parent's and the thread does not exist: joining it would fail (std panics), and the
    /// signal's lock may have been held by it at the fork, for ever. Nothing is done then (the
    /// handle is leaked).
    pub(crate) fn stop_and_join(mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(self.thread.take());
            return;
        }
        self.signal.stop();
        if let Some(h) = self.thread.take() {
            if h.thread().id() != thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// Controls a background eviction thread; stopping or dropping it stops and joins the thread.
#[must_use = "dropping the handle stops the eviction thread"]
pub struct EvictionHandle {
    tree: Weak<PrefixTree>,
    signal: Arc<Signal>,
    /// The process that started the thread: a handle dropped in a child made by `fork` does
    /// nothing (see [`Running::stop_and_join`]).
    pid: u32,
}

impl EvictionHandle {
    /// Stops the thread, waits for it to exit (promptly, whatever the interval: a pass under
    /// way ends after its current batch), and returns its final [`totals`](Self::totals):
    /// every pass it ran, the last one included (a pass cut short counts what it evicted).
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use kvtrie::{EvictionConfig, PrefixTree};
    ///
    /// let tree = Arc::new(PrefixTree::new());
    /// let handle = tree
    ///     .start_eviction(EvictionConfig::new(10, 5, Duration::from_secs(3600)))
    ///     .unwrap();
    /// let totals = handle.stop();
    /// assert_eq!(totals.chars_evicted, 0);
    /// ```
    pub fn stop(self) -> EvictionTotals {
        let (signal, pid) = (self.signal.clone(), self.pid);
        drop(self);
        signal.read(pid, |s| s.totals)
    }

    /// The thread is running on a live tree: not stopped, not exited after a panic, and the
    /// tree not dropped.
    pub fn is_running(&self) -> bool {
        if self.pid != std::process::id() {
            // A parent's thread, seen from a child made by `fork`: it does not run here.
            return false;
        }
        let s = self.signal.state();
        !s.stopped && s.panicked.is_none() && self.tree.strong_count() > 0
    }

    /// If the thread panicked (a bug: there should be none), the panic message. The thread
    /// has then exited and released the tree's eviction slot, so
    /// [`PrefixTree::start_eviction`] can start a new one.
    pub fn panic_message(&self) -> Option<String> {
        self.signal.read(self.pid, |s| s.panicked.clone())
    }

    /// What the thread's passes have done since it started: a router's metrics. Counted after
    /// each pass completes (a pass under way is not in them yet); they stay readable after the
    /// thread stopped, exited or panicked.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use kvtrie::{EvictionConfig, PrefixTree};
    ///
    /// let tree = Arc::new(PrefixTree::new());
    /// let a = tree.add_tenant("a");
    /// tree.insert_at("0123456789", a, 1).unwrap();
    /// tree.insert_at("abcdefghij", a, 2).unwrap();
    /// let handle = tree
    ///     .start_eviction(EvictionConfig::new(15, 10, Duration::from_millis(1)))
    ///     .unwrap();
    /// // Two passes: the first evicted, the second found nothing over the threshold.
    /// while handle.totals().passes < 2 {
    ///     std::thread::sleep(Duration::from_millis(1));
    /// }
    /// let t = handle.totals();
    /// assert_eq!((t.tenants_evicted, t.chars_evicted, t.global_chars_evicted), (1, 10, 0));
    /// assert_eq!(tree.char_count(a), Some(10));
    /// ```
    pub fn totals(&self) -> EvictionTotals {
        self.signal.read(self.pid, |s| s.totals)
    }
}

impl Drop for EvictionHandle {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            return;
        }
        self.signal.stop();
        if let Some(tree) = self.tree.upgrade() {
            let running = tree.take_eviction_if(&self.signal);
            drop(tree);
            if let Some(r) = running {
                r.stop_and_join();
            }
        }
    }
}

impl fmt::Debug for EvictionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EvictionHandle")
            .field("running", &self.is_running())
            .finish_non_exhaustive()
    }
}

impl PrefixTree {
    /// Takes the tree's eviction record if it belongs to `signal`'s thread.
    fn take_eviction_if(&self, signal: &Arc<Signal>) -> Option<Running> {
        let mut slot = crate::sync::lock(self.eviction_slot());
        let mine = slot
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(&r.signal, signal));
        if mine {
            slot.take()
        } else {
            None
        }
    }
}

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassStats {
    /// Tenants evicted (over their threshold).
    pub tenants_evicted: usize,
    /// Chars removed from tenants (per-tenant accounting).
    pub chars_evicted: usize,
    /// Distinct chars removed from the tree by the global budget.
    pub global_chars_evicted: usize,
}

/// What a background eviction thread's passes have done since it started
/// ([`EvictionHandle::totals`]): the sums of their [`PassStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EvictionTotals {
    /// Passes completed.
    pub passes: u64,
    /// Tenants evicted, summed over the passes (a tenant evicted in two passes counts twice).
    pub tenants_evicted: u64,
    /// Chars removed from tenants (per-tenant accounting).
    pub chars_evicted: u64,
    /// Distinct chars removed from the tree by the global budget.
    pub global_chars_evicted: u64,
}

impl EvictionTotals {
    /// Adds one completed pass.
    fn add(&mut self, pass: PassStats) {
        // Saturating: a count that could overflow only after centuries must not panic a
        // thread that runs for weeks.
        let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        self.passes = self.passes.saturating_add(1);
        self.tenants_evicted = self
            .tenants_evicted
            .saturating_add(wide(pass.tenants_evicted));
        self.chars_evicted = self.chars_evicted.saturating_add(wide(pass.chars_evicted));
        self.global_chars_evicted = self
            .global_chars_evicted
            .saturating_add(wide(pass.global_chars_evicted));
    }
}

impl PrefixTree {
    /// Starts the background eviction thread for this tree; `None` if one is already running
    /// (which keeps its parameters) or the thread could not be started. The configuration is
    /// [normalized](EvictionConfig::normalized) (see [`EvictionConfig`] for the clamps). The
    /// thread holds only a weak reference to the tree.
    pub fn start_eviction(self: &Arc<Self>, config: EvictionConfig) -> Option<EvictionHandle> {
        self.try_start_eviction(config.normalized()).ok()
    }

    /// [`start_eviction`](Self::start_eviction) with the reason when no thread is started;
    /// rejects an invalid configuration ([`EvictionConfig::validate`]) instead of clamping it.
    pub fn try_start_eviction(
        self: &Arc<Self>,
        config: EvictionConfig,
    ) -> Result<EvictionHandle, EvictionStartError> {
        config.validate().map_err(EvictionStartError::Config)?;
        let config = config.normalized();
        let mut slot = crate::sync::lock(self.eviction_slot());
        // A record inherited through `fork` names a thread that does not run here.
        if let Some(r) = slot.take_if(|r| r.pid != std::process::id()) {
            r.stop_and_join();
        }
        if slot.is_some() {
            return Err(EvictionStartError::AlreadyRunning);
        }
        let signal = Arc::new(Signal::default());
        let weak = Arc::downgrade(self);
        let sig = signal.clone();
        let thread = thread::Builder::new()
            .name("kvtrie-evict".into())
            .spawn(move || eviction_thread(weak, sig, config))
            .map_err(EvictionStartError::Spawn)?;
        let pid = std::process::id();
        *slot = Some(Running {
            signal: signal.clone(),
            thread: Some(thread),
            pid,
        });
        Ok(EvictionHandle {
            tree: Arc::downgrade(self),
            signal,
            pid,
        })
    }

    /// Runs one eviction pass with `config` on the calling thread (what the background thread
    /// does every interval). A pass that evicts hands what it retired to the reclaimer; a pass
    /// that evicts nothing frees the retired objects parked for writers that have gone idle
    /// (see [`retired_backlog`](Self::retired_backlog)).
    ///
    /// The configuration is [normalized](EvictionConfig::normalized) first: a target above the
    /// threshold evicts down to the threshold.
    pub fn run_eviction_pass(&self, config: &EvictionConfig) -> PassStats {
        self.eviction_pass(config, &|| false)
    }

    /// [`run_eviction_pass`](Self::run_eviction_pass), ending early once `stop()` is true: it
    /// is asked before each tenant and each batch, so that a stopping thread's handle does not
    /// wait out a long pass (a large tree evicted to a small target takes seconds). What was
    /// evicted until then is handed on as after a whole pass.
    fn eviction_pass(&self, config: &EvictionConfig, stop: &dyn Fn() -> bool) -> PassStats {
        let config = &config.normalized();
        let mut stats = PassStats::default();
        for t in self.tenants() {
            let Some(c) = self.char_count(t) else {
                continue;
            };
            if c > config.threshold_chars && !stop() {
                stats.tenants_evicted += 1;
                // A batch once stopped evicts nothing and ends the loop.
                stats.chars_evicted += in_batches(c.saturating_sub(config.target_chars), |need| {
                    if stop() {
                        return (0, false);
                    }
                    self.evict_batch(t, need, config.batch_groups)
                });
            }
        }
        if let Some((max, target)) = config.global {
            let total = self.distinct_chars();
            if total > max && !stop() {
                stats.global_chars_evicted += in_batches(total.saturating_sub(target), |need| {
                    if stop() {
                        return (0, false);
                    }
                    self.evict_global_batch(need, config.batch_groups)
                });
            }
        }
        if stats.chars_evicted + stats.global_chars_evicted > 0 {
            // A pass retires in bulk: hand it to the reclaimer now rather than leave partial
            // batches with a thread that is about to sleep.
            self.flush_retired();
        } else {
            // Objects parked for the writers to free (`reclaim`, *Freeing a few at a time*)
            // wait for them; once the writers are idle, the passes free them.
            self.store.retirer.free_parked_if_idle();
        }
        stats
    }
}

/// The thread's body: the loop, with a panic (a bug) caught, recorded for the handle, and the
/// tree's eviction slot released so a new thread can be started.
fn eviction_thread(tree: Weak<PrefixTree>, signal: Arc<Signal>, config: EvictionConfig) {
    let outcome = catch_unwind(AssertUnwindSafe(|| eviction_loop(&tree, &signal, &config)));
    if let Err(payload) = outcome {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "the eviction thread panicked".to_owned());
        // Release the slot before the panic is visible: a caller that sees the message (and
        // `is_running() == false`) can start a new thread at once.
        if let Some(tree) = tree.upgrade() {
            // Dropping the record detaches this (exiting) thread's join handle.
            drop(tree.take_eviction_if(&signal));
        }
        signal.state().panicked = Some(msg);
        signal.cv.notify_all();
    }
}

fn eviction_loop(tree: &Weak<PrefixTree>, signal: &Signal, config: &EvictionConfig) {
    loop {
        {
            // A deadline past what `Instant` can represent means "never": wait for the stop.
            let deadline = Instant::now().checked_add(config.interval);
            let mut state = signal.state();
            #[cfg(test)]
            {
                state.waits += 1;
                signal.cv.notify_all();
            }
            while !state.stopped {
                let wait = match deadline {
                    Some(d) => match d.checked_duration_since(Instant::now()) {
                        Some(w) if !w.is_zero() => w,
                        _ => break,
                    },
                    None => Duration::from_secs(3600),
                };
                state = signal
                    .cv
                    .wait_timeout(state, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            if state.stopped {
                return;
            }
        }
        let Some(tree) = tree.upgrade() else {
            return;
        };
        #[cfg(test)]
        if std::mem::take(&mut signal.state().panic_next_pass) {
            panic!("injected eviction-pass panic");
        }
        let pass = tree.eviction_pass(config, &|| signal.state().stopped);
        signal.state().totals.add(pass);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_thread_is_surfaced_and_can_be_replaced() {
        let tree = Arc::new(PrefixTree::new());
        let a = tree.add_tenant("a");
        tree.insert("some prompt text", a).unwrap();
        let cfg = EvictionConfig::new(1_000, 500, MIN_EVICTION_INTERVAL);
        let h = tree.start_eviction(cfg).unwrap();
        h.signal.state().panic_next_pass = true;
        let end = Instant::now() + Duration::from_secs(60);
        while h.panic_message().is_none() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            h.panic_message().as_deref(),
            Some("injected eviction-pass panic")
        );
        assert!(!h.is_running());
        // The slot was released: a new thread starts, and stopping the old handle leaves it.
        let h2 = tree
            .start_eviction(cfg)
            .expect("a new thread after the panic");
        drop(h);
        assert!(h2.is_running());
        h2.stop();
    }

    /// Stopping a handle, or dropping the tree, joins the thread before it returns, even one
    /// whose next pass is an hour away: the thread's share of the signal is gone by then (the
    /// handle's, the tree's record's and the thread's while it runs).
    #[test]
    fn stop_and_tree_drop_join_the_thread() {
        let cfg = EvictionConfig::new(10, 5, Duration::from_secs(3600));
        let tree = Arc::new(PrefixTree::new());
        let h = tree.start_eviction(cfg).unwrap();
        let signal = h.signal.clone();
        assert_eq!(Arc::strong_count(&signal), 4);
        h.stop();
        assert_eq!(Arc::strong_count(&signal), 1);
        let h = tree.start_eviction(cfg).unwrap();
        assert_eq!(Arc::strong_count(&h.signal), 3);
        drop(tree);
        assert_eq!(Arc::strong_count(&h.signal), 1);
        assert!(h.signal.state().stopped);
        assert!(!h.is_running());
    }

    /// A pass asked to stop ends between two batches, per tenant and for the global budget
    /// (the thread asks its handle's signal): a handle stopped during a long pass does not
    /// wait out the rest of it. An unstopped pass then evicts the rest.
    #[test]
    fn a_pass_ends_between_batches_once_stopped() {
        let tree = PrefixTree::new();
        let a = tree.add_tenant("a");
        // 40 groups of one 3-char leaf each, every leaf a child of the root.
        for i in 0..40u32 {
            let c = char::from_u32(0x4E00 + i).unwrap();
            tree.insert_at(&c.to_string().repeat(3), a, u64::from(i))
                .unwrap();
        }
        let mut cfg = EvictionConfig::new(0, 0, Duration::from_secs(3600));
        cfg.batch_groups = 4;
        let asked = std::cell::Cell::new(0);
        // Stopped from the fourth question on: the tenant's, then two batches'.
        let stop = || {
            asked.set(asked.get() + 1);
            asked.get() > 3
        };
        let pass = tree.eviction_pass(&cfg, &stop);
        assert_eq!((pass.tenants_evicted, pass.chars_evicted), (1, 2 * 4 * 3));
        assert_eq!(tree.char_count(a), Some(120 - 24));
        // The global budget's loop, likewise.
        let mut global = EvictionConfig::new(usize::MAX, usize::MAX, Duration::from_secs(3600))
            .with_global_budget(0, 0);
        global.batch_groups = 4;
        asked.set(0);
        let pass = tree.eviction_pass(&global, &stop);
        assert_eq!(pass.global_chars_evicted, 2 * 4 * 3);
        assert_eq!(tree.eviction_pass(&cfg, &|| true), PassStats::default());
        assert_eq!(tree.run_eviction_pass(&cfg).chars_evicted, 120 - 48);
        assert_eq!(tree.char_count(a), Some(0));
    }

    /// Passes that evict nothing free what an idle writer on another shard left retired:
    /// they flush every shard's partial batch and free every parked batch (a flush after an
    /// evicting pass frees only the parked batches of the pass's own shard).
    #[test]
    #[cfg_attr(miri, ignore = "polls the epoch reclaimer until a deadline")]
    fn passes_that_evict_nothing_free_what_idle_writers_left() {
        let tree = Arc::new(PrefixTree::new());
        let mine = crate::sync::shard_index();
        // A writer thread on another shard than this one (shards go round-robin to threads):
        // its inserts split nodes and its eviction prunes them, retiring both.
        let wrote = |t: Arc<PrefixTree>| {
            std::thread::spawn(move || {
                if crate::sync::shard_index() == mine {
                    return false;
                }
                let a = t.add_tenant("a");
                for k in 0..20u64 {
                    t.insert_at(&format!("p{k:03}"), a, k).unwrap();
                }
                // "p0", then "0" and "1", then 20 one-char leaves.
                assert_eq!(t.evict_tenant_by_lru(a, usize::MAX), 24);
                true
            })
            .join()
            .unwrap()
        };
        while !wrote(tree.clone()) {}
        assert!(tree.retired_backlog().objects > 0);
        let cfg = EvictionConfig::new(usize::MAX, usize::MAX, Duration::from_secs(3600));
        let end = Instant::now() + Duration::from_secs(60);
        while tree.retired_backlog().objects > 0 && Instant::now() < end {
            assert_eq!(tree.run_eviction_pass(&cfg), PassStats::default());
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(tree.retired_backlog(), crate::RetiredBacklog::default());
    }

    /// Blocks until `h`'s thread has begun `n` waits for a deadline (at most 60 s).
    fn await_waits(h: &EvictionHandle, n: u64) {
        let end = Instant::now() + Duration::from_secs(60);
        let mut state = h.signal.state();
        while state.waits < n {
            let left = end.saturating_duration_since(Instant::now());
            assert_eq!(state.panicked, None, "the thread panicked");
            assert!(
                !left.is_zero(),
                "the thread began {} waits of {n}",
                state.waits
            );
            state = h.signal.cv.wait_timeout(state, left).unwrap().0;
        }
    }

    /// Intervals too long for an `Instant` deadline: the thread reaches its wait alive and
    /// stops when asked (the wait itself is bounded, so the stop is seen).
    #[test]
    fn any_interval_reaches_its_wait_and_stops() {
        for interval in [
            Duration::MAX,
            Duration::from_secs(u64::MAX / 2),
            Duration::from_secs(u64::MAX),
        ] {
            let tree = Arc::new(PrefixTree::new());
            let a = tree.add_tenant("a");
            tree.insert(&"x".repeat(100), a).unwrap();
            let h = tree
                .start_eviction(EvictionConfig::new(50, 10, interval))
                .unwrap();
            await_waits(&h, 1);
            assert!(h.is_running(), "{interval:?}: the thread died");
            assert_eq!(h.panic_message(), None);
            assert_eq!(h.stop().passes, 0);
            // The slot is free again.
            assert!(tree
                .start_eviction(EvictionConfig::new(50, 10, interval))
                .is_some());
        }
    }

    /// The thread waits out its interval before its first pass, not only between passes: when
    /// it first waits, it has run no pass.
    #[test]
    fn the_first_wait_comes_before_any_pass() {
        let tree = Arc::new(PrefixTree::new());
        let a = tree.add_tenant("a");
        tree.insert(&"x".repeat(1000), a).unwrap();
        let h = tree
            .start_eviction(EvictionConfig::new(500, 400, Duration::from_secs(3600)))
            .unwrap();
        await_waits(&h, 1);
        assert_eq!(h.totals().passes, 0);
        assert_eq!(tree.char_count(a), Some(1000));
        assert_eq!(h.stop().passes, 0);
    }

    /// A short interval: every wait but the first follows a pass.
    #[test]
    fn each_wait_after_the_first_follows_a_pass() {
        let tree = Arc::new(PrefixTree::new());
        let a = tree.add_tenant("a");
        tree.insert(&"x".repeat(1000), a).unwrap();
        let h = tree
            .start_eviction(EvictionConfig::new(500, 400, MIN_EVICTION_INTERVAL))
            .unwrap();
        await_waits(&h, 4);
        let (waits, passes) = {
            let s = h.signal.state();
            (s.waits, s.totals.passes)
        };
        // A pass may be under way after the last wait, none before the first.
        assert!(
            passes + 1 == waits || passes == waits,
            "{passes} passes, {waits} waits"
        );
        assert!(h.stop().passes >= 3);
        assert_eq!(tree.char_count(a), Some(0));
    }
}
