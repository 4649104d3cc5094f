//! The wire format of the messages kvtrie puts on NATS: KV events of one worker, and batches of
//! routing decisions.
//!
//! # Format (version 1)
//!
//! Every message starts with the codec version ([`CODEC_VERSION`]) and a kind byte (1 = KV
//! events, 2 = routing decisions). Integers written `varint` are unsigned LEB128 (at most 10
//! bytes); `u64` is 8 bytes little-endian; a string is a `varint` byte length and that many
//! bytes of UTF-8.
//!
//! | kind | body |
//! |---|---|
//! | 1: [`KvEventBatch`] | worker `u64` ([`WorkerId`], DP rank in the top bits), source `u64`, sequence `varint`, event count `varint`, events |
//! | 2: [`DecisionBatch`] | router `u64`, base time `u64` (Unix ms), name count `varint`, names (strings), decision count `varint`, decisions |
//!
//! A KV event is a tag byte (1 stored, 2 removed, 3 cleared), a tier byte ([`Tier::index`]),
//! then for `Stored` a parent flag byte (0/1), the parent `u64` if the flag is 1, a block count
//! `varint` and `(engine hash u64, local hash u64)` per block; for `Removed` a count `varint`
//! and the engine hashes (`u64` each); nothing for `Cleared`.
//!
//! A decision is the index of its replica in the batch's name table (`varint`), its time as a
//! `varint` offset from the base time, and the prompt (string). Replica names repeat across a
//! batch, so each is written once.
//!
//! # Hostile input
//!
//! Decoding never panics: truncated, foreign (another version or kind), oversized or
//! inconsistent bytes give a [`CodecError`]. A decoder allocates only for counts whose bytes it
//! has seen (a count is checked against the bytes left before any `Vec` is reserved), so the
//! memory of a decode is bounded by a small multiple of the message length, except for the
//! copies of replica names that [`decode_decisions`] gives every decision (a shared router
//! reads its peers' batches in place, without them).

use crate::blocks::{KvEvent, StoredBlock, Tier, WorkerId};
use std::fmt;

/// The codec version this crate writes and reads.
pub const CODEC_VERSION: u8 = 1;

/// Longest message [`decode_kv_events`] and [`decode_decisions`] accept (NATS itself limits
/// payloads to 1 MiB by default, 64 MiB at most).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

const KIND_KV: u8 = 1;
const KIND_DECISIONS: u8 = 2;

const EV_STORED: u8 = 1;
const EV_REMOVED: u8 = 2;
const EV_CLEARED: u8 = 3;

/// One KV event and the storage tier it applies to.
///
/// ```
/// use kvtrie::blocks::{KvEvent, Tier};
/// use kvtrie::dist::TieredEvent;
/// let e = TieredEvent::gpu(KvEvent::Cleared);
/// assert_eq!(e.tier, Tier::Gpu);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TieredEvent {
    /// The tier (`BlockIndex::apply_in`'s tier).
    pub tier: Tier,
    /// The event.
    pub event: KvEvent,
}

impl TieredEvent {
    /// An event in the GPU tier.
    pub fn gpu(event: KvEvent) -> Self {
        Self {
            tier: Tier::Gpu,
            event,
        }
    }
}

/// The KV events of one worker, as one message of the event stream.
///
/// `source` and `seq` identify the publisher (a relay) and its per-worker message counter, so
/// a consumer can see gaps and reordering (see `KvConsumerStats::sequence_gaps`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventBatch {
    /// The worker (engine and data-parallel rank).
    pub worker: WorkerId,
    /// The publisher's id (0: unknown).
    pub source: u64,
    /// The publisher's message counter for this worker (1, 2, …; 0: not counted).
    pub seq: u64,
    /// The events, in the order the engine reported them.
    pub events: Vec<TieredEvent>,
}

/// One routing decision: `prompt` was sent to the replica named `replica` at `timestamp_ms`
/// (Unix milliseconds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The prompt text (possibly cut at a char boundary; the prefix is what matters).
    pub prompt: String,
    /// The replica's name (the tenant name in every router's tree).
    pub replica: String,
    /// When the decision was made (Unix ms).
    pub timestamp_ms: u64,
}

/// A batch of routing decisions of one router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionBatch {
    /// The id of the router that made them (receivers skip their own).
    pub router: u64,
    /// The decisions, oldest first.
    pub decisions: Vec<Decision>,
}

/// Why a message could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CodecError {
    /// The message is empty.
    Empty,
    /// The message is of another codec version (or not a kvtrie message at all).
    UnsupportedVersion(u8),
    /// The message is of another kind than expected.
    WrongKind {
        /// The kind expected.
        expected: u8,
        /// The kind byte found.
        found: u8,
    },
    /// The message is longer than [`MAX_MESSAGE_BYTES`].
    TooLarge(usize),
    /// The message ended while reading the named field.
    Truncated(&'static str),
    /// A field holds an impossible value.
    Invalid(&'static str),
    /// Bytes are left after the message.
    TrailingBytes(usize),
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecError::Empty => write!(f, "empty message"),
            CodecError::UnsupportedVersion(v) => {
                write!(f, "codec version {v} (this build reads {CODEC_VERSION})")
            }
            CodecError::WrongKind { expected, found } => {
                write!(f, "message kind {found}, expected {expected}")
            }
            CodecError::TooLarge(n) => write!(f, "message of {n} bytes is too large"),
            CodecError::Truncated(what) => write!(f, "message truncated in {what}"),
            CodecError::Invalid(what) => write!(f, "invalid {what}"),
            CodecError::TrailingBytes(n) => write!(f, "{n} bytes after the message"),
        }
    }
}

impl std::error::Error for CodecError {}

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Encodes the events of one worker into `out` (appended).
///
/// ```
/// use kvtrie::blocks::{KvEvent, StoredBlock, WorkerId};
/// use kvtrie::dist::{decode_kv_events, encode_kv_events, KvEventBatch, TieredEvent};
/// let batch = KvEventBatch {
///     worker: WorkerId::new(3, 1),
///     source: 9,
///     seq: 1,
///     events: vec![TieredEvent::gpu(KvEvent::Stored {
///         parent: None,
///         blocks: vec![StoredBlock { engine_hash: 1, local_hash: 2 }],
///     })],
/// };
/// let mut bytes = Vec::new();
/// encode_kv_events(&batch, &mut bytes);
/// assert_eq!(decode_kv_events(&bytes).unwrap(), batch);
/// ```
pub fn encode_kv_events(batch: &KvEventBatch, out: &mut Vec<u8>) {
    out.push(CODEC_VERSION);
    out.push(KIND_KV);
    put_u64(out, batch.worker.0);
    put_u64(out, batch.source);
    put_varint(out, batch.seq);
    put_varint(out, batch.events.len() as u64);
    for e in &batch.events {
        let tier = e.tier.index() as u8;
        match &e.event {
            KvEvent::Stored { parent, blocks } => {
                out.extend_from_slice(&[EV_STORED, tier]);
                match parent {
                    Some(p) => {
                        out.push(1);
                        put_u64(out, *p);
                    }
                    None => out.push(0),
                }
                put_varint(out, blocks.len() as u64);
                for b in blocks {
                    put_u64(out, b.engine_hash);
                    put_u64(out, b.local_hash);
                }
            }
            KvEvent::Removed { engine_hashes } => {
                out.extend_from_slice(&[EV_REMOVED, tier]);
                put_varint(out, engine_hashes.len() as u64);
                for h in engine_hashes {
                    put_u64(out, *h);
                }
            }
            KvEvent::Cleared => out.extend_from_slice(&[EV_CLEARED, tier]),
        }
    }
}

/// Bytes of a KV event batch's header at most: version, kind, worker, source, and the two
/// varints (sequence, event count).
const KV_HEADER_MAX: usize = 2 + 8 + 8 + 10 + 10;

/// Smallest message size [`split_kv_events`] accepts: room for the header and one block.
pub const MIN_SPLIT_BYTES: usize = 256;

/// Encoded bytes of one event at most (varints counted at their longest).
fn event_bytes_max(e: &TieredEvent) -> usize {
    match &e.event {
        KvEvent::Stored { blocks, .. } => 2 + 1 + 8 + 10 + 16 * blocks.len(),
        KvEvent::Removed { engine_hashes } => 2 + 10 + 8 * engine_hashes.len(),
        KvEvent::Cleared => 2,
    }
}

/// Cuts `events` of one worker into consecutive groups whose [`KvEventBatch`] encodes to at
/// most `max_bytes` (at least [`MIN_SPLIT_BYTES`]; smaller values count as that), in order,
/// so that no message exceeds a server's payload limit. An event too large for one message is
/// itself cut: a `Stored` into runs of blocks, each run after the first chaining from the last
/// block of the run before (applied in order, the same blocks with the same parents); a
/// `Removed` into runs of hashes. Applying the groups in order is applying `events`.
///
/// ```
/// use kvtrie::blocks::{KvEvent, StoredBlock, WorkerId};
/// use kvtrie::dist::{encode_kv_events, split_kv_events, KvEventBatch, TieredEvent};
/// let blocks: Vec<StoredBlock> = (0..1000)
///     .map(|i| StoredBlock { engine_hash: i, local_hash: i })
///     .collect();
/// let groups = split_kv_events(
///     vec![TieredEvent::gpu(KvEvent::Stored { parent: None, blocks })],
///     4096,
/// );
/// assert!(groups.len() >= 4);
/// for (i, events) in groups.into_iter().enumerate() {
///     let mut bytes = Vec::new();
///     let batch = KvEventBatch { worker: WorkerId(1), source: 7, seq: i as u64 + 1, events };
///     encode_kv_events(&batch, &mut bytes);
///     assert!(bytes.len() <= 4096);
/// }
/// ```
pub fn split_kv_events(events: Vec<TieredEvent>, max_bytes: usize) -> Vec<Vec<TieredEvent>> {
    let room = max_bytes.max(MIN_SPLIT_BYTES) - KV_HEADER_MAX;
    let mut groups: Vec<Vec<TieredEvent>> = Vec::new();
    let (mut cur, mut used) = (Vec::new(), 0usize);
    for e in events {
        let size = event_bytes_max(&e);
        if used + size <= room {
            used += size;
            cur.push(e);
            continue;
        }
        if !cur.is_empty() {
            groups.push(std::mem::take(&mut cur));
            used = 0;
        }
        if size <= room {
            used = size;
            cur.push(e);
            continue;
        }
        // Too large for any message: one message per run.
        let tier = e.tier;
        match e.event {
            KvEvent::Stored { mut parent, blocks } => {
                for run in blocks.chunks((room - (2 + 1 + 8 + 10)) / 16) {
                    groups.push(vec![TieredEvent {
                        tier,
                        event: KvEvent::Stored {
                            parent,
                            blocks: run.to_vec(),
                        },
                    }]);
                    parent = run.last().map(|b| b.engine_hash);
                }
            }
            KvEvent::Removed { engine_hashes } => {
                for run in engine_hashes.chunks((room - (2 + 10)) / 8) {
                    groups.push(vec![TieredEvent {
                        tier,
                        event: KvEvent::Removed {
                            engine_hashes: run.to_vec(),
                        },
                    }]);
                }
            }
            // Two bytes: it always fits (kept for completeness).
            KvEvent::Cleared => groups.push(vec![TieredEvent {
                tier,
                event: KvEvent::Cleared,
            }]),
        }
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
}

/// Encodes a batch of decisions into `out` (appended).
///
/// ```
/// use kvtrie::dist::{decode_decisions, encode_decisions, Decision, DecisionBatch};
/// let batch = DecisionBatch {
///     router: 7,
///     decisions: vec![Decision { prompt: "hello".into(), replica: "r0".into(), timestamp_ms: 5 }],
/// };
/// let mut bytes = Vec::new();
/// encode_decisions(&batch, &mut bytes);
/// assert_eq!(decode_decisions(&bytes).unwrap(), batch);
/// ```
pub fn encode_decisions(batch: &DecisionBatch, out: &mut Vec<u8>) {
    out.push(CODEC_VERSION);
    out.push(KIND_DECISIONS);
    put_u64(out, batch.router);
    let base = batch
        .decisions
        .iter()
        .map(|d| d.timestamp_ms)
        .min()
        .unwrap_or(0);
    put_u64(out, base);
    // Name table, in order of first appearance (batches are small: a linear scan is fine for
    // the handful of replicas a deployment has, and bounded by the batch length).
    let mut names: Vec<&str> = Vec::new();
    let mut index = Vec::with_capacity(batch.decisions.len());
    for d in &batch.decisions {
        let i = match names.iter().position(|n| *n == d.replica) {
            Some(i) => i,
            None => {
                names.push(&d.replica);
                names.len() - 1
            }
        };
        index.push(i);
    }
    put_varint(out, names.len() as u64);
    for n in &names {
        put_str(out, n);
    }
    put_varint(out, batch.decisions.len() as u64);
    for (d, i) in batch.decisions.iter().zip(index) {
        put_varint(out, i as u64);
        put_varint(out, d.timestamp_ms - base);
        put_str(out, &d.prompt);
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn header(bytes: &'a [u8], kind: u8) -> Result<Self, CodecError> {
        if bytes.len() > MAX_MESSAGE_BYTES {
            return Err(CodecError::TooLarge(bytes.len()));
        }
        let (&version, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
        if version != CODEC_VERSION {
            return Err(CodecError::UnsupportedVersion(version));
        }
        let &found = rest.first().ok_or(CodecError::Truncated("the kind"))?;
        if found != kind {
            return Err(CodecError::WrongKind {
                expected: kind,
                found,
            });
        }
        Ok(Self { bytes, pos: 2 })
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], CodecError> {
        if self.left() < n {
            return Err(CodecError::Truncated(what));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, CodecError> {
        Ok(self.take(1, what)?[0])
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, CodecError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn varint(&mut self, what: &'static str) -> Result<u64, CodecError> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.u8(what)?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(CodecError::Invalid(what));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(CodecError::Invalid(what))
    }

    /// A count of items of at least `min_item` bytes each: never more than the bytes left
    /// allow, so reserving it is bounded by the message length.
    fn count(&mut self, min_item: usize, what: &'static str) -> Result<usize, CodecError> {
        let n = self.varint(what)?;
        let max = (self.left() / min_item.max(1)) as u64;
        if n > max {
            return Err(CodecError::Truncated(what));
        }
        Ok(n as usize)
    }

    fn str(&mut self, what: &'static str) -> Result<&'a str, CodecError> {
        let n = self.varint(what)?;
        if n > self.left() as u64 {
            return Err(CodecError::Truncated(what));
        }
        let b = self.take(n as usize, what)?;
        std::str::from_utf8(b).map_err(|_| CodecError::Invalid(what))
    }

    fn end(&self) -> Result<(), CodecError> {
        match self.left() {
            0 => Ok(()),
            n => Err(CodecError::TrailingBytes(n)),
        }
    }
}

fn tier(code: u8) -> Result<Tier, CodecError> {
    Tier::ALL
        .get(code as usize)
        .copied()
        .ok_or(CodecError::Invalid("tier"))
}

/// Decodes a message written by [`encode_kv_events`].
///
/// # Errors
///
/// A [`CodecError`] for anything that is not a complete, valid version-1 KV event message.
pub fn decode_kv_events(bytes: &[u8]) -> Result<KvEventBatch, CodecError> {
    let mut r = Reader::header(bytes, KIND_KV)?;
    let worker = WorkerId(r.u64("the worker")?);
    let source = r.u64("the source")?;
    let seq = r.varint("the sequence")?;
    let n = r.count(2, "the event count")?;
    let mut events = Vec::with_capacity(n);
    for _ in 0..n {
        let tag = r.u8("an event tag")?;
        let tier = tier(r.u8("a tier")?)?;
        let event = match tag {
            EV_STORED => {
                let parent = match r.u8("the parent flag")? {
                    0 => None,
                    1 => Some(r.u64("the parent")?),
                    _ => return Err(CodecError::Invalid("parent flag")),
                };
                let k = r.count(16, "the block count")?;
                let mut blocks = Vec::with_capacity(k);
                for _ in 0..k {
                    blocks.push(StoredBlock {
                        engine_hash: r.u64("a block")?,
                        local_hash: r.u64("a block")?,
                    });
                }
                KvEvent::Stored { parent, blocks }
            }
            EV_REMOVED => {
                let k = r.count(8, "the removed count")?;
                let mut engine_hashes = Vec::with_capacity(k);
                for _ in 0..k {
                    engine_hashes.push(r.u64("a removed hash")?);
                }
                KvEvent::Removed { engine_hashes }
            }
            EV_CLEARED => KvEvent::Cleared,
            _ => return Err(CodecError::Invalid("event tag")),
        };
        events.push(TieredEvent { tier, event });
    }
    r.end()?;
    Ok(KvEventBatch {
        worker,
        source,
        seq,
        events,
    })
}

/// Decodes a message written by [`encode_decisions`].
///
/// # Errors
///
/// A [`CodecError`] for anything that is not a complete, valid version-1 decision batch
/// (including a name index outside the name table and a time that overflows).
///
/// Each decision owns a copy of its replica's name, which the message holds once: a batch of
/// many decisions for a long name decodes to many times its size. A router applying batches
/// from the network reads them in place instead (nothing copied).
pub fn decode_decisions(bytes: &[u8]) -> Result<DecisionBatch, CodecError> {
    let view = DecisionsView::decode(bytes)?;
    let decisions = view
        .decisions
        .iter()
        .map(|d| Decision {
            prompt: d.prompt.to_owned(),
            replica: view.names[d.name].to_owned(),
            timestamp_ms: d.timestamp_ms,
        })
        .collect();
    Ok(DecisionBatch {
        router: view.router,
        decisions,
    })
}

/// A decision batch read in place: names and prompts borrowed from the message. It takes at
/// most 32 bytes per decision and 16 per name (each at least 3 and 1 bytes of the message).
pub(crate) struct DecisionsView<'a> {
    /// The id of the router that made them.
    pub(crate) router: u64,
    /// The batch's name table.
    pub(crate) names: Vec<&'a str>,
    /// The decisions, oldest first.
    pub(crate) decisions: Vec<DecisionRef<'a>>,
}

/// One decision of a [`DecisionsView`].
pub(crate) struct DecisionRef<'a> {
    /// Its replica's index in the name table (checked).
    pub(crate) name: usize,
    pub(crate) timestamp_ms: u64,
    pub(crate) prompt: &'a str,
}

impl<'a> DecisionsView<'a> {
    /// Decodes a whole message, as [`decode_decisions`] does, without copying.
    pub(crate) fn decode(bytes: &'a [u8]) -> Result<Self, CodecError> {
        let mut r = Reader::header(bytes, KIND_DECISIONS)?;
        let router = r.u64("the router")?;
        let base = r.u64("the base time")?;
        let n_names = r.count(1, "the name count")?;
        let mut names = Vec::with_capacity(n_names);
        for _ in 0..n_names {
            names.push(r.str("a replica name")?);
        }
        let n = r.count(3, "the decision count")?;
        let mut decisions = Vec::with_capacity(n);
        for _ in 0..n {
            let i = r.varint("a name index")?;
            let name = usize::try_from(i)
                .ok()
                .filter(|&i| i < names.len())
                .ok_or(CodecError::Invalid("name index"))?;
            let dt = r.varint("a time")?;
            let timestamp_ms = base
                .checked_add(dt)
                .ok_or(CodecError::Invalid("decision time"))?;
            let prompt = r.str("a prompt")?;
            decisions.push(DecisionRef {
                name,
                timestamp_ms,
                prompt,
            });
        }
        r.end()?;
        Ok(DecisionsView {
            router,
            names,
            decisions,
        })
    }
}

/// `s` cut to at most `max_bytes`, at a char boundary.
pub(crate) fn truncate_str(s: &str, max_bytes: usize) -> &str {
    if s.len() <= max_bytes {
        return s;
    }
    let mut end = max_bytes;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A batch of many decisions for one long replica name: read in place, its names and
    /// prompts point into the message, and the view takes a few words per decision, where
    /// owned decisions copy the name into every one.
    #[test]
    fn a_decision_view_borrows_its_names_and_prompts() {
        let name = "r".repeat(4096);
        let batch = DecisionBatch {
            router: 7,
            decisions: (0..1000u64)
                .map(|i| Decision {
                    prompt: String::new(),
                    replica: name.clone(),
                    timestamp_ms: 1_000 + i,
                })
                .collect(),
        };
        let mut bytes = Vec::new();
        encode_decisions(&batch, &mut bytes);
        assert!(bytes.len() < 8_000, "{}", bytes.len());
        let view = DecisionsView::decode(&bytes).unwrap();
        let inside = |s: &str| bytes.as_ptr_range().contains(&s.as_ptr()) || s.is_empty();
        assert_eq!(
            (view.router, view.names.len(), view.decisions.len()),
            (7, 1, 1000)
        );
        assert!(inside(view.names[0]) && view.names[0] == name);
        assert!(view
            .decisions
            .iter()
            .all(|d| d.name == 0 && inside(d.prompt)));
        let heap = view.names.capacity() * size_of::<&str>()
            + view.decisions.capacity() * size_of::<DecisionRef<'_>>();
        assert!(heap <= 32 * 1000 + 16, "{heap}");
        // The owned form agrees (and holds 1000 copies of the name).
        assert_eq!(decode_decisions(&bytes).unwrap(), batch);
    }

    fn tier_s() -> impl Strategy<Value = Tier> {
        (0usize..4).prop_map(|i| Tier::ALL[i])
    }

    fn event_s() -> impl Strategy<Value = TieredEvent> {
        let block =
            (any::<u64>(), any::<u64>()).prop_map(|(engine_hash, local_hash)| StoredBlock {
                engine_hash,
                local_hash,
            });
        let ev = prop_oneof![
            (
                proptest::option::of(any::<u64>()),
                proptest::collection::vec(block, 0..6)
            )
                .prop_map(|(parent, blocks)| KvEvent::Stored { parent, blocks }),
            proptest::collection::vec(any::<u64>(), 0..6)
                .prop_map(|engine_hashes| KvEvent::Removed { engine_hashes }),
            Just(KvEvent::Cleared),
        ];
        (tier_s(), ev).prop_map(|(tier, event)| TieredEvent { tier, event })
    }

    /// One step of [`steps`]: tier, then parent and block of a store, or a removed hash.
    type Step = (usize, Option<u64>, Option<StoredBlock>, Option<u64>);

    /// What applying `events` in order does, one block at a time: `(tier, parent, block)` for
    /// each stored block (its parent the block before it in its event), `(tier, hash)` for
    /// each removal, `(tier)` for a clear.
    fn steps(events: &[TieredEvent]) -> Vec<Step> {
        let mut v = Vec::new();
        for e in events {
            let t = e.tier.index();
            match &e.event {
                KvEvent::Stored { parent, blocks } => {
                    let mut p = *parent;
                    for b in blocks {
                        v.push((t, p, Some(*b), None));
                        p = Some(b.engine_hash);
                    }
                }
                KvEvent::Removed { engine_hashes } => {
                    v.extend(engine_hashes.iter().map(|&h| (t, None, None, Some(h))));
                }
                KvEvent::Cleared => v.push((t, None, None, None)),
            }
        }
        v
    }

    fn kv_s() -> impl Strategy<Value = KvEventBatch> {
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(event_s(), 0..8),
        )
            .prop_map(|(w, source, seq, events)| KvEventBatch {
                worker: WorkerId(w),
                source,
                seq,
                events,
            })
    }

    fn decisions_s() -> impl Strategy<Value = DecisionBatch> {
        let d = (
            "\\PC{0,40}",
            prop_oneof![Just("r0".to_string()), Just("r1".to_string()), "\\PC{0,8}"],
            any::<u64>(),
        )
            .prop_map(|(prompt, replica, timestamp_ms)| Decision {
                prompt,
                replica,
                timestamp_ms,
            });
        (any::<u64>(), proptest::collection::vec(d, 0..8))
            .prop_map(|(router, decisions)| DecisionBatch { router, decisions })
    }

    proptest! {
        #[test]
        fn kv_round_trip(b in kv_s()) {
            let mut bytes = Vec::new();
            encode_kv_events(&b, &mut bytes);
            prop_assert_eq!(decode_kv_events(&bytes).unwrap(), b);
            // Every strict prefix is an error, never a panic.
            for cut in 0..bytes.len() {
                prop_assert!(decode_kv_events(&bytes[..cut]).is_err());
            }
            prop_assert!(decode_decisions(&bytes).is_err());
        }

        #[test]
        fn decisions_round_trip(b in decisions_s()) {
            let mut bytes = Vec::new();
            encode_decisions(&b, &mut bytes);
            prop_assert_eq!(decode_decisions(&bytes).unwrap(), b);
            for cut in 0..bytes.len() {
                prop_assert!(decode_decisions(&bytes[..cut]).is_err());
            }
            prop_assert!(decode_kv_events(&bytes).is_err());
        }

        #[test]
        fn split_messages_fit_and_apply_as_the_whole(
            events in proptest::collection::vec(event_s(), 0..8),
            big in proptest::collection::vec((0u64..40, 0usize..120), 0..3),
            max in 200usize..700,
        ) {
            // Some events far larger than one message, among small ones.
            let mut events = events;
            for (i, &(p, n)) in big.iter().enumerate() {
                let blocks: Vec<StoredBlock> = (0..n as u64)
                    .map(|h| StoredBlock { engine_hash: h * 1000 + p, local_hash: h })
                    .collect();
                events.insert(i.min(events.len()), TieredEvent::gpu(KvEvent::Stored {
                    parent: (p > 0).then_some(p),
                    blocks,
                }));
                events.push(TieredEvent::gpu(KvEvent::Removed {
                    engine_hashes: (0..n as u64 * 2).collect(),
                }));
            }
            let groups = split_kv_events(events.clone(), max);
            let mut sent: Vec<TieredEvent> = Vec::new();
            for (i, g) in groups.into_iter().enumerate() {
                prop_assert!(!g.is_empty());
                let b = KvEventBatch {
                    worker: WorkerId(u64::MAX),
                    source: u64::MAX,
                    seq: u64::MAX - i as u64,
                    events: g,
                };
                let mut bytes = Vec::new();
                encode_kv_events(&b, &mut bytes);
                prop_assert!(bytes.len() <= max.max(MIN_SPLIT_BYTES), "{} > {max}", bytes.len());
                sent.extend(b.events);
            }
            // The same single-block steps, in the same order.
            prop_assert_eq!(steps(&sent), steps(&events));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_kv_events(&bytes);
            let _ = decode_decisions(&bytes);
            let mut v = vec![CODEC_VERSION, KIND_KV];
            v.extend_from_slice(&bytes);
            let _ = decode_kv_events(&v);
            v[1] = KIND_DECISIONS;
            let _ = decode_decisions(&v);
        }
    }

    #[test]
    fn hostile_headers_and_counts() {
        assert_eq!(decode_kv_events(&[]), Err(CodecError::Empty));
        assert_eq!(
            decode_kv_events(b"{\"json\":1}"),
            Err(CodecError::UnsupportedVersion(b'{'))
        );
        assert_eq!(
            decode_kv_events(&[CODEC_VERSION, KIND_DECISIONS]),
            Err(CodecError::WrongKind {
                expected: KIND_KV,
                found: KIND_DECISIONS
            })
        );
        // An absurd event count is rejected before anything is reserved.
        let mut v = vec![CODEC_VERSION, KIND_KV];
        v.extend_from_slice(&[0; 16]);
        v.push(0);
        v.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
        assert_eq!(
            decode_kv_events(&v),
            Err(CodecError::Truncated("the event count"))
        );
        // A varint longer than 64 bits.
        let mut w = vec![CODEC_VERSION, KIND_KV];
        w.extend_from_slice(&[0; 16]);
        w.extend_from_slice(&[0xff; 11]);
        assert!(matches!(
            decode_kv_events(&w),
            Err(CodecError::Invalid(_) | CodecError::Truncated(_))
        ));
        // Trailing bytes.
        let mut ok = Vec::new();
        encode_decisions(
            &DecisionBatch {
                router: 1,
                decisions: vec![],
            },
            &mut ok,
        );
        ok.push(0);
        assert_eq!(decode_decisions(&ok), Err(CodecError::TrailingBytes(1)));
        // A name index past the table.
        let mut bad = vec![CODEC_VERSION, KIND_DECISIONS];
        bad.extend_from_slice(&[0; 16]);
        bad.extend_from_slice(&[0, 1, 5, 0, 0]);
        assert_eq!(
            decode_decisions(&bad),
            Err(CodecError::Invalid("name index"))
        );
    }

    /// A name index equal to the length of the name table is past its end: an error, as any
    /// index outside the table, never a panic nor another name.
    #[test]
    fn a_name_index_one_past_the_table_is_invalid() {
        // router 0, base time 0, names ["r0"], one decision: index 1, time +0, prompt "".
        let mut bad = vec![CODEC_VERSION, KIND_DECISIONS];
        bad.extend_from_slice(&[0; 16]);
        bad.extend_from_slice(&[1, 2, b'r', b'0', 1, 1, 0, 0]);
        assert_eq!(
            decode_decisions(&bad),
            Err(CodecError::Invalid("name index"))
        );
        // Index 0 is the one name.
        let last = bad.len() - 3;
        bad[last] = 0;
        let batch = decode_decisions(&bad).unwrap();
        assert_eq!(batch.decisions[0].replica, "r0");
    }

    /// A varint is at most 10 bytes of LEB128 for a `u64`: the tenth byte carries the top bit
    /// alone, so a larger tenth byte overflows 64 bits and is invalid, not a wrapped value.
    #[test]
    fn a_varint_past_64_bits_is_invalid() {
        let kv = |seq: &[u8]| {
            let mut v = vec![CODEC_VERSION, KIND_KV];
            v.extend_from_slice(&[0; 16]);
            v.extend_from_slice(seq);
            v.push(0); // no events
            decode_kv_events(&v)
        };
        let mut max = vec![0xff; 9];
        max.push(0x01);
        assert_eq!(kv(&max).unwrap().seq, u64::MAX);
        for top in [0x02, 0x03, 0x7f] {
            let mut over = vec![0xff; 9];
            over.push(top);
            assert_eq!(
                kv(&over),
                Err(CodecError::Invalid("the sequence")),
                "{top:#x}"
            );
        }
        let mut high_zero = vec![0x80; 9];
        high_zero.push(0x02);
        assert_eq!(kv(&high_zero), Err(CodecError::Invalid("the sequence")));
    }

    #[test]
    fn truncation_keeps_char_boundaries() {
        assert_eq!(truncate_str("héllo", 2), "h");
        assert_eq!(truncate_str("héllo", 3), "hé");
        assert_eq!(truncate_str("abc", 10), "abc");
    }
}
