//! [`LruCache`]: a replica's KV prefix cache, publishing the KV events an engine would.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::blocks::{KvEvent, StoredBlock};

const NIL: u32 = u32::MAX;
/// Blocks an empty cache makes room for up front; beyond, it grows as it fills.
const PREALLOCATED_BLOCKS: usize = 1 << 12;

/// A hasher for keys that are block hashes already (one multiply-xorshift, no SipHash).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct BlockKeyHasher(u64);

impl Hasher for BlockKeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

/// A `HashMap`/`HashSet` hasher builder for block hashes.
pub(super) type BlockKeys = BuildHasherDefault<BlockKeyHasher>;

#[derive(Clone, Debug)]
struct Slot {
    hash: u64,
    prev: u32, // towards MRU
    next: u32, // towards LRU
    /// The cache's clock when the block was last used.
    used: u64,
}

/// A replica's KV prefix cache: at most `capacity` blocks keyed by **sequence** hash, evicted
/// least-recently-used first.
///
/// Because keys are chained hashes, a block is reusable only when every block before it is
/// cached too: [`Self::lookup`] counts leading cached blocks. Touching a sequence marks its
/// blocks used in reverse order, so its first block is the most recent: a sequence's tail is
/// evicted before its head (vLLM frees a request's blocks in reverse order for the same reason).
///
/// [`Self::insert`] reports the changes as the [`KvEvent`]s an engine would publish: one
/// `Removed` for the blocks evicted to make room, then one `Stored` per run of newly cached
/// blocks, chained to the block before the run (engine hash = sequence hash).
#[derive(Clone, Debug)]
pub struct LruCache {
    capacity: usize,
    map: HashMap<u64, u32, BlockKeys>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    head: u32, // MRU
    tail: u32, // LRU
    /// Scratch of `insert`: the slot of each block of the sequence (`NIL` = not cached).
    found: Vec<u32>,
    /// The time stamped on the blocks used from now on (see [`Self::set_clock`]).
    clock: u64,
}

impl LruCache {
    /// An empty cache of `capacity` blocks. Its memory grows with the blocks it holds, not
    /// with its capacity (a cluster of many replicas with huge caches only allocates what
    /// its traffic fills).
    pub fn new(capacity: usize) -> Self {
        let reserve = capacity.min(PREALLOCATED_BLOCKS);
        Self {
            capacity,
            map: HashMap::with_capacity_and_hasher(reserve, BlockKeys::default()),
            slots: Vec::with_capacity(reserve),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            found: Vec::new(),
            clock: 0,
        }
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no block is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether the block with this sequence hash is cached.
    pub fn contains(&self, seq_hash: u64) -> bool {
        self.map.contains_key(&seq_hash)
    }

    /// Sets the time stamped on the blocks that lookups and inserts use from now on (the
    /// simulator passes its clock; 0 by default).
    pub fn set_clock(&mut self, now: u64) {
        self.clock = now;
    }

    /// When the least recently used block was last used, if the cache is full (the next
    /// insert evicts it); `None` while it has room. The older, the less a new sequence
    /// displaces.
    pub fn eviction_age(&self) -> Option<u64> {
        if self.len() < self.capacity || self.tail == NIL {
            return None;
        }
        Some(self.slots[self.tail as usize].used)
    }

    /// The cached blocks from most to least recently used.
    pub fn mru_order(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len());
        let mut i = self.head;
        while i != NIL {
            out.push(self.slots[i as usize].hash);
            i = self.slots[i as usize].next;
        }
        out
    }

    /// The number of leading blocks of `seq` that are cached, without touching anything.
    pub fn cached_prefix(&self, seq: &[u64]) -> usize {
        seq.iter().take_while(|h| self.map.contains_key(h)).count()
    }

    /// The number of leading blocks of `seq` that are cached (a prefix-cache hit); those blocks
    /// become the most recently used, the first one most recent of all.
    pub fn lookup(&mut self, seq: &[u64]) -> usize {
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        found.extend(seq.iter().map_while(|h| self.map.get(h).copied()));
        for &i in found.iter().rev() {
            self.move_to_front(i);
        }
        let n = found.len();
        self.found = found;
        n
    }

    /// Caches the blocks of a sequence (`seq[i]` chained, `local[i]` its local hash); only the
    /// first `capacity` blocks fit. Every block of `seq` ends up cached and most recently used,
    /// in reverse order. The engine events of the change are appended to `events`. The two
    /// slices pair up index by index: blocks beyond the shorter one are ignored, in debug and
    /// release builds alike.
    pub fn insert(&mut self, seq: &[u64], local: &[u64], events: &mut Vec<KvEvent>) {
        let n = seq.len().min(local.len()).min(self.capacity);
        let (seq, local) = (&seq[..n], &local[..n]);
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        found.extend(seq.iter().map(|h| self.map.get(h).copied().unwrap_or(NIL)));
        // 1. Cached blocks of the sequence become MRU. The evictions below remove
        //    `len + missing - capacity` blocks from the LRU end; since `seq.len() <= capacity`,
        //    that is at most `len - (seq.len() - missing)`: only blocks outside `seq`, so the
        //    slots recorded in `found` stay valid.
        let mut missing = 0;
        for &i in found.iter().rev() {
            if i == NIL {
                missing += 1;
            } else {
                self.move_to_front(i);
            }
        }
        // 2. Evict to make room.
        let over = (self.len() + missing).saturating_sub(self.capacity);
        if over > 0 {
            let mut removed = Vec::with_capacity(over);
            for _ in 0..over {
                removed.extend(self.pop_lru());
            }
            events.push(KvEvent::Removed {
                engine_hashes: removed,
            });
        }
        // 3. Store the missing blocks, one event per run.
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = None;
        for (i, (&h, &l)) in seq.iter().zip(local).enumerate() {
            if found[i] == NIL {
                // Only a sequence that repeats a hash finds it stored earlier in this loop.
                if let Some(&j) = self.map.get(&h) {
                    found[i] = j;
                }
            }
            if found[i] != NIL {
                if !run.is_empty() {
                    events.push(KvEvent::Stored {
                        parent: run_parent,
                        blocks: std::mem::take(&mut run),
                    });
                }
                continue;
            }
            if run.is_empty() {
                run_parent = if i == 0 { None } else { Some(seq[i - 1]) };
            }
            run.push(StoredBlock {
                engine_hash: h,
                local_hash: l,
            });
            found[i] = self.push_front(h);
        }
        if !run.is_empty() {
            events.push(KvEvent::Stored {
                parent: run_parent,
                blocks: run,
            });
        }
        // 4. Final recency: the first block most recent.
        for &i in found.iter().rev() {
            self.move_to_front(i);
        }
        self.found = found;
    }

    fn unlink(&mut self, i: u32) {
        let Slot { prev, next, .. } = self.slots[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
    }

    fn link_front(&mut self, i: u32) {
        self.slots[i as usize].used = self.clock;
        self.slots[i as usize].prev = NIL;
        self.slots[i as usize].next = self.head;
        if self.head != NIL {
            self.slots[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    fn move_to_front(&mut self, i: u32) {
        if self.head != i {
            self.unlink(i);
            self.link_front(i);
        }
    }

    fn push_front(&mut self, hash: u64) -> u32 {
        let slot = Slot {
            hash,
            used: self.clock,
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.map.insert(hash, i);
        self.link_front(i);
        i
    }

    fn pop_lru(&mut self) -> Option<u64> {
        let i = self.tail;
        if i == NIL {
            return None;
        }
        self.unlink(i);
        let h = self.slots[i as usize].hash;
        self.map.remove(&h);
        self.free.push(i);
        Some(h)
    }
}
