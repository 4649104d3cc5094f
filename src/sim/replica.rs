//! [`Replica`]: one serving engine of the simulated cluster.

use std::collections::VecDeque;

use super::LruCache;

/// At most `cap` holders at a time; the others wait in arrival order.
#[derive(Clone, Debug)]
struct Gate {
    cap: usize,
    busy: usize,
    queue: VecDeque<usize>,
}

impl Gate {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            busy: 0,
            queue: VecDeque::new(),
        }
    }

    /// `req` passes now (returned) if there is room, else waits (`None`).
    fn enter(&mut self, req: usize) -> Option<usize> {
        if self.busy < self.cap {
            self.busy += 1;
            Some(req)
        } else {
            self.queue.push_back(req);
            None
        }
    }

    /// A holder left: the first waiter, if any, takes its place (returned). Does nothing
    /// when no one holds the gate.
    fn leave(&mut self) -> Option<usize> {
        if self.busy == 0 {
            return None;
        }
        self.busy -= 1;
        let next = self.queue.pop_front()?;
        self.busy += 1;
        Some(next)
    }
}

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
    /// Requests in service (`max_running`), the others waiting.
    service: Gate,
    /// Prefills being computed (`lanes`), the other requests in service waiting for a lane.
    prefills: Gate,
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
    /// than `max_running` is the same as `max_running`): a request in service waits for a
    /// free lane, first come first served.
    pub fn with_prefill_lanes(cache_blocks: usize, max_running: usize, lanes: usize) -> Self {
        let max_running = max_running.max(1);
        Self {
            cache: LruCache::new(cache_blocks),
            service: Gate::new(max_running),
            prefills: Gate::new(lanes.clamp(1, max_running)),
            assigned: 0,
        }
    }

    /// Accepts request `req`: returns it if it starts now, else queues it and returns `None`.
    pub fn submit(&mut self, req: usize) -> Option<usize> {
        self.assigned += 1;
        self.service.enter(req)
    }

    /// A running request finished: frees its slot and returns the queued request that takes
    /// it, if any (first come, first served). On an idle replica this does nothing.
    pub fn finish(&mut self) -> Option<usize> {
        self.service.leave()
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
        self.prefills.enter(req)
    }

    /// A prefill finished: frees its lane and returns the request whose prefill starts on
    /// it, if any (first come, first served). With no prefill running this does nothing.
    pub fn prefill_finished(&mut self) -> Option<usize> {
        self.prefills.leave()
    }

    /// Prefills being computed.
    pub fn prefilling(&self) -> usize {
        self.prefills.busy
    }

    /// Requests in service waiting for a prefill lane.
    pub fn prefill_waiting(&self) -> usize {
        self.prefills.queue.len()
    }

    /// Requests in service.
    pub fn running(&self) -> usize {
        self.service.busy
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.service.queue.len()
    }

    /// Requests in service or waiting (the "queue length" routers see).
    pub fn load(&self) -> usize {
        self.service.busy + self.service.queue.len()
    }
}
