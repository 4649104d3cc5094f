//! [`Replica`]: one serving engine of the simulated cluster.

use std::collections::VecDeque;

use super::{LruCache, Micros};

/// A replica: a prefix cache, at most `max_running` requests in service, a FIFO queue for the
/// rest.
///
/// ```
/// use kvtrie::sim::Replica;
/// let mut r = Replica::new(64, 1);
/// assert_eq!(r.submit(7), Some(7)); // starts at once
/// assert_eq!(r.submit(8), None); // waits
/// assert_eq!(r.finish(), Some(8)); // 7 finished, 8 takes its slot
/// assert_eq!((r.running(), r.waiting(), r.assigned), (1, 0, 2));
/// ```
#[derive(Clone, Debug)]
pub struct Replica {
    /// Its prefix cache.
    pub cache: LruCache,
    max_running: usize,
    running: usize,
    waiting: VecDeque<usize>,
    /// When each prefill lane is free next.
    lanes: Vec<Micros>,
    /// Requests routed to it.
    pub assigned: u64,
}

impl Replica {
    /// An idle replica with a cache of `cache_blocks` blocks serving `max_running` requests at
    /// once (at least 1).
    pub fn new(cache_blocks: usize, max_running: usize) -> Self {
        Self::with_prefill_lanes(cache_blocks, max_running, max_running)
    }

    /// An idle replica that computes at most `lanes` prefills at a time (at least 1; more
    /// than `max_running` is the same as `max_running`): a started request's prefill waits
    /// for the lane that frees first.
    pub fn with_prefill_lanes(cache_blocks: usize, max_running: usize, lanes: usize) -> Self {
        let max_running = max_running.max(1);
        Self {
            cache: LruCache::new(cache_blocks),
            max_running,
            running: 0,
            waiting: VecDeque::new(),
            lanes: vec![0; lanes.clamp(1, max_running)],
            assigned: 0,
        }
    }

    /// Schedules a prefill of `duration` for a request started at `now` on the lane that
    /// frees first; returns when it completes.
    pub fn schedule_prefill(&mut self, now: Micros, duration: Micros) -> Micros {
        let lane = (0..self.lanes.len())
            .min_by_key(|&i| self.lanes[i])
            .unwrap_or(0);
        let done = self.lanes[lane].max(now).saturating_add(duration);
        self.lanes[lane] = done;
        done
    }

    /// Accepts request `req`: returns it if it starts now, else queues it and returns `None`.
    pub fn submit(&mut self, req: usize) -> Option<usize> {
        self.assigned += 1;
        if self.running < self.max_running {
            self.running += 1;
            Some(req)
        } else {
            self.waiting.push_back(req);
            None
        }
    }

    /// A running request finished: frees its slot and returns the queued request that takes
    /// it, if any (first come, first served). On an idle replica this does nothing.
    pub fn finish(&mut self) -> Option<usize> {
        if self.running == 0 {
            return None;
        }
        self.running -= 1;
        let next = self.waiting.pop_front()?;
        self.running += 1;
        Some(next)
    }

    /// Requests in service.
    pub fn running(&self) -> usize {
        self.running
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in service or waiting (the "queue length" routers see).
    pub fn load(&self) -> usize {
        self.running + self.waiting.len()
    }
}
