//! [`EventQueue`]: the simulation's clock.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::Micros;

struct Entry<E> {
    time: Micros,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.time, self.seq) == (other.time, other.seq)
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap, we pop the earliest (then first inserted).
        (other.time, other.seq).cmp(&(self.time, self.seq))
    }
}

/// A priority queue of timed events: pops in time order, ties in insertion order.
pub struct EventQueue<E> {
    heap: BinaryHeap<Entry<E>>,
    next_seq: u64,
    now: Micros,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> EventQueue<E> {
    /// An empty queue at time 0.
    pub fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            next_seq: 0,
            now: 0,
        }
    }

    /// Schedules `event` at `time` (not before the current time).
    pub fn push(&mut self, time: Micros, event: E) {
        debug_assert!(time >= self.now, "event scheduled in the past");
        self.heap.push(Entry {
            time,
            seq: self.next_seq,
            event,
        });
        self.next_seq += 1;
    }

    /// The earliest event (the first scheduled among equal times); advances the clock.
    pub fn pop(&mut self) -> Option<(Micros, E)> {
        let e = self.heap.pop()?;
        self.now = e.time;
        Some((e.time, e.event))
    }

    /// Time of the last popped event.
    pub fn now(&self) -> Micros {
        self.now
    }

    /// Pending events.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}
