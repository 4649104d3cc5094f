//! [`Replica`]: one serving engine of the simulated cluster.

use std::collections::VecDeque;

use super::{LruCache, Micros};

/// A replica: a prefix cache, at most `max_running` requests in service, a FIFO queue for the
/// rest; among the requests in service, at most `lanes` prefills at a time, the others waiting
/// for a lane in FIFO order ([`queue_prefill`](Self::queue_prefill),
/// [`prefill_finished`](Self::prefill_finished)).
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
    /// When each prefill lane is free next (for [`Self::schedule_prefill`]).
    lanes: Vec<Micros>,
    /// Prefills being computed.
    prefilling: usize,
    /// Requests in service waiting for a prefill lane, first come first served.
    prefill_queue: VecDeque<usize>,
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
            prefilling: 0,
            prefill_queue: VecDeque::new(),
            assigned: 0,
        }
    }

    /// Reserves the lane that frees first for a prefill of `duration` queued at `now`;
    /// returns when it completes. The duration must be known when the prefill is queued, so
    /// this cannot model a cache lookup made when the prefill starts: [`simulate`](super::simulate)
    /// uses [`queue_prefill`](Self::queue_prefill) and
    /// [`prefill_finished`](Self::prefill_finished) instead (same lanes, same order).
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

    /// A request in service needs a prefill: returns it if a lane is free (its prefill
    /// starts now), else queues it for the next free lane and returns `None`.
    ///
    /// ```
    /// use kvtrie::sim::Replica;
    /// let mut r = Replica::with_prefill_lanes(64, 4, 1);
    /// assert_eq!(r.queue_prefill(1), Some(1));
    /// assert_eq!(r.queue_prefill(2), None); // waits for the lane
    /// assert_eq!((r.prefilling(), r.prefill_waiting()), (1, 1));
    /// assert_eq!(r.prefill_finished(), Some(2)); // 1 done: 2 starts
    /// assert_eq!(r.prefill_finished(), None);
    /// ```
    pub fn queue_prefill(&mut self, req: usize) -> Option<usize> {
        if self.prefilling < self.lanes.len() {
            self.prefilling += 1;
            Some(req)
        } else {
            self.prefill_queue.push_back(req);
            None
        }
    }

    /// A prefill finished: frees its lane and returns the request whose prefill starts on
    /// it, if any (first come, first served). With no prefill running this does nothing.
    pub fn prefill_finished(&mut self) -> Option<usize> {
        if self.prefilling == 0 {
            return None;
        }
        self.prefilling -= 1;
        let next = self.prefill_queue.pop_front()?;
        self.prefilling += 1;
        Some(next)
    }

    /// Prefills being computed.
    pub fn prefilling(&self) -> usize {
        self.prefilling
    }

    /// Requests in service waiting for a prefill lane.
    pub fn prefill_waiting(&self) -> usize {
        self.prefill_queue.len()
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
