//! Background eviction: a thread that keeps every tenant (and optionally the whole tree) within
//! a char budget.
//!
//! Every `interval`, each tenant whose char count is strictly greater than `threshold_chars` is
//! evicted by LRU ([`PrefixTree::evict_tenant_by_lru`] semantics) down to `target_chars`. With a
//! global budget, when the tree's distinct chars exceed `max_total_chars`, the globally least
//! recently used timestamp groups (across tenants) are evicted until the tree holds at most
//! `target_total_chars`. Eviction takes the writer lock in bounded batches (a few timestamp
//! groups at a time), so readers never wait and inserts wait at most one batch. A pass that
//! evicts nothing costs `O(tenants)` (one relaxed load per tenant).
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

use crate::sync::os::{thread, Condvar, Mutex};
use crate::PrefixTree;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Parameters of the background eviction thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictionConfig {
    /// A tenant is evicted when its char count is strictly greater than this.
    pub threshold_chars: usize,
    /// ... down to this many chars (or fewer: groups are evicted whole).
    pub target_chars: usize,
    /// Time between passes.
    pub interval: Duration,
    /// Optional global budget: `(max_total_chars, target_total_chars)` over the tree's
    /// distinct chars.
    pub global: Option<(usize, usize)>,
    /// Timestamp groups evicted per writer-lock acquisition.
    pub batch_groups: usize,
}

impl EvictionConfig {
    /// Per-tenant eviction: above `threshold_chars`, down to `target_chars`, every `interval`.
    pub fn new(threshold_chars: usize, target_chars: usize, interval: Duration) -> Self {
        Self {
            threshold_chars,
            target_chars: target_chars.min(threshold_chars),
            interval,
            global: None,
            batch_groups: 16,
        }
    }

    /// Adds a global budget on the tree's distinct chars: above `max_total_chars`, the least
    /// recently used groups across all tenants go first until at most `target_total_chars`
    /// remain.
    pub fn with_global_budget(mut self, max_total_chars: usize, target_total_chars: usize) -> Self {
        self.global = Some((max_total_chars, target_total_chars.min(max_total_chars)));
        self
    }
}

/// Stop signal shared by a running thread and its handle.
struct Signal {
    stopped: Mutex<bool>,
    cv: Condvar,
}

impl Signal {
    fn stop(&self) {
        *self.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.cv.notify_all();
    }
}

/// The tree's record of its running eviction thread.
pub(crate) struct Running {
    signal: Arc<Signal>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Running {
    /// Signals the thread and joins it (unless called from the thread itself, which happens
    /// when the thread held the last reference to the tree: then it exits on its own).
    pub(crate) fn stop_and_join(mut self) {
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
}

impl EvictionHandle {
    /// Stops the thread and waits for it to exit (promptly, whatever the interval).
    pub fn stop(self) {
        drop(self);
    }

    /// The configuration is running on a live tree.
    pub fn is_running(&self) -> bool {
        !*self
            .signal
            .stopped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            && self.tree.strong_count() > 0
    }
}

impl Drop for EvictionHandle {
    fn drop(&mut self) {
        self.signal.stop();
        if let Some(tree) = self.tree.upgrade() {
            let mut slot = tree
                .eviction_slot()
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let mine = slot
                .as_ref()
                .is_some_and(|r| Arc::ptr_eq(&r.signal, &self.signal));
            let running = if mine { slot.take() } else { None };
            drop(slot);
            drop(tree);
            if let Some(r) = running {
                r.stop_and_join();
            }
        }
    }
}

impl std::fmt::Debug for EvictionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EvictionHandle").finish_non_exhaustive()
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

impl PrefixTree {
    /// Starts the background eviction thread for this tree; `None` if one is already running
    /// (which keeps its parameters). The thread holds only a weak reference to the tree.
    pub fn start_eviction(self: &Arc<Self>, config: EvictionConfig) -> Option<EvictionHandle> {
        let mut slot = self
            .eviction_slot()
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return None;
        }
        let signal = Arc::new(Signal {
            stopped: Mutex::new(false),
            cv: Condvar::new(),
        });
        let weak = Arc::downgrade(self);
        let sig = signal.clone();
        let thread = thread::Builder::new()
            .name("kvtrie-evict".into())
            .spawn(move || eviction_loop(weak, sig, config))
            .ok()?;
        *slot = Some(Running {
            signal: signal.clone(),
            thread: Some(thread),
        });
        Some(EvictionHandle {
            tree: Arc::downgrade(self),
            signal,
        })
    }

    /// Runs one eviction pass with `config` on the calling thread (what the background thread
    /// does every interval).
    pub fn run_eviction_pass(&self, config: &EvictionConfig) -> PassStats {
        let mut stats = PassStats::default();
        for t in self.tenants() {
            let Some(c) = self.char_count(t) else {
                continue;
            };
            if c > config.threshold_chars {
                stats.tenants_evicted += 1;
                let mut need = c.saturating_sub(config.target_chars);
                while need > 0 {
                    let (n, more) = self.evict_batch(t, need, config.batch_groups.max(1));
                    stats.chars_evicted += n;
                    need = need.saturating_sub(n);
                    if !more {
                        break;
                    }
                }
            }
        }
        if let Some((max, target)) = config.global {
            let total = self.distinct_chars();
            if total > max {
                let mut need = total.saturating_sub(target);
                while need > 0 {
                    let (n, more) = self.evict_global_batch(need, config.batch_groups.max(1));
                    stats.global_chars_evicted += n;
                    need = need.saturating_sub(n);
                    if !more {
                        break;
                    }
                }
            }
        }
        stats
    }
}

fn eviction_loop(tree: Weak<PrefixTree>, signal: Arc<Signal>, config: EvictionConfig) {
    loop {
        {
            let deadline = Instant::now() + config.interval;
            let mut stopped = signal.stopped.lock().unwrap_or_else(|e| e.into_inner());
            while !*stopped {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                stopped = signal
                    .cv
                    .wait_timeout(stopped, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            if *stopped {
                return;
            }
        }
        let Some(tree) = tree.upgrade() else {
            return;
        };
        tree.run_eviction_pass(&config);
    }
}
