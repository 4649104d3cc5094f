//! [`KvConsumer`]: the KV-event stream → a [`BlockIndex`], through a durable pull consumer.

use super::codec::decode_kv_events;
use super::recent::Recent;
use super::runtime::{
    connect, jetstream, jump, poll_until, pull_in_order, Background, IdleChecks, Jump, LastError,
    Link, LinkStats, Shutdown,
};
use super::warm::{store, stream_id};
use super::{check_fetch, ensure_stream, stream_replaced, DistError, NatsConfig};
use crate::blocks::{BlockIndex, WorkerId};
use crate::sync::{self, AtomicU64, Mutex, Ordering};
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Parameters of a [`KvConsumer`].
///
/// ```
/// use kvtrie::dist::{KvConsumerConfig, NatsConfig};
/// let cfg = KvConsumerConfig::new(NatsConfig::new("nats://127.0.0.1:4222"), "router-a");
/// assert_eq!(cfg.applied_through, 0);
/// ```
#[derive(Clone, Debug)]
pub struct KvConsumerConfig {
    /// The server and streams.
    pub nats: NatsConfig,
    /// Name of the durable consumer (one per index: two indexes never share one).
    pub durable_name: String,
    /// The index already reflects the stream up to this sequence (0: an empty index; the
    /// sequence a restored snapshot covers otherwise). Messages at or below it are skipped;
    /// a durable consumer that has acknowledged past it (the index is newer than the
    /// snapshot it came from, e.g. a fresh index after a process restart) is rewound.
    pub applied_through: u64,
    /// The identity of the stream `applied_through` counts, if known
    /// ([`SnapshotInfo::stream`](super::SnapshotInfo::stream) of the snapshot it came from):
    /// if the stream there at the first attach is another one (a server that lost its store
    /// meanwhile), the consumer reads it from its start instead of after `applied_through`.
    /// Without it, only a stream shorter than `applied_through` is recognised as new.
    pub applied_stream: Option<String>,
    /// Messages per pull request (at most [`MAX_FETCH_BATCH`](super::MAX_FETCH_BATCH)).
    pub batch: usize,
    /// How long one pull request waits for messages (at most
    /// [`MAX_FETCH_WAIT`](super::MAX_FETCH_WAIT)).
    pub fetch_wait: Duration,
    /// Store a snapshot of the index in the object store this often (`None`: never), tagged
    /// with the stream sequence it reflects exactly (taken between two messages, so no event
    /// is half in it). A new router restores the newest with
    /// [`latest_snapshot`](super::latest_snapshot)`::<BlockIndex>` and starts its consumer
    /// with `applied_through` = that sequence: it starts warm and replays only the rest.
    pub snapshot_interval: Option<Duration>,
}

impl KvConsumerConfig {
    /// The defaults: batches of 512 messages, 200 ms pull waits, an empty index, a snapshot
    /// of the index every 60 s.
    pub fn new(nats: NatsConfig, durable_name: impl Into<String>) -> Self {
        Self {
            nats,
            durable_name: durable_name.into(),
            applied_through: 0,
            applied_stream: None,
            batch: 512,
            fetch_wait: Duration::from_millis(200),
            snapshot_interval: Some(Duration::from_secs(60)),
        }
    }
}

/// What a [`KvConsumer`] has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvConsumerStats {
    /// The connection.
    pub link: LinkStats,
    /// The last stream sequence applied to the index.
    pub applied_seq: u64,
    /// Messages applied.
    pub messages: u64,
    /// Events applied.
    pub events: u64,
    /// Events the index rejected (e.g. a `Stored` whose parent it does not know).
    pub rejected_events: u64,
    /// Redelivered messages skipped because their sequence was already applied.
    pub duplicates: u64,
    /// Messages that did not decode (skipped and acknowledged).
    pub malformed: u64,
    /// Stream sequences that were never delivered (expired or deleted before this consumer
    /// read them): the index misses their events.
    pub lost_messages: u64,
    /// Times deliveries were lost in transit (a connection that dropped while they were on
    /// the way: the stream sequence and the consumer's delivery sequence both jumped, or, with
    /// nothing newer after them, the server reports, while nothing comes, deliveries this
    /// consumer never received; see the README's NATS section). The consumer then attaches
    /// again right after the last applied sequence and reads them, so nothing is missed.
    pub refetches: u64,
    /// Per-worker relay counters that jumped or went back (a message lost or reordered
    /// between a relay and the stream). A counter back at 1 is not counted: a relay starts a
    /// worker silent for longer than the stream's retention again at 1.
    pub sequence_gaps: u64,
    /// Messages left in the stream for this consumer at the last delivery (its lag).
    pub pending: u64,
    /// Failed pull requests, acks or consumer creations (all retried).
    pub errors: u64,
    /// Times the durable consumer was (re)attached.
    pub attaches: u64,
    /// Times the stream turned out to be a new one at a re-attach (a server that lost its
    /// store): the consumer then reads it from its first message, and `applied_seq` counts
    /// from 0 again.
    pub stream_resets: u64,
    /// Snapshots of the index stored in the object store.
    pub snapshots_written: u64,
    /// Snapshots that could not be stored (retried at the next interval).
    pub snapshot_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    applied_seq: AtomicU64,
    /// The identity of the stream `applied_seq` counts, once known (see `attach`).
    stream: Mutex<Option<String>>,
    messages: AtomicU64,
    events: AtomicU64,
    rejected: AtomicU64,
    duplicates: AtomicU64,
    malformed: AtomicU64,
    lost: AtomicU64,
    refetches: AtomicU64,
    gaps: AtomicU64,
    pending: AtomicU64,
    errors: AtomicU64,
    attaches: AtomicU64,
    stream_resets: AtomicU64,
    snapshots: AtomicU64,
    snapshot_errors: AtomicU64,
    last_error: LastError,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Applies the KV-event stream to a [`BlockIndex`] in a background thread.
///
/// Delivery is at least once (explicit acks, sent after a message is applied); application is
/// idempotent: the consumer remembers the last stream sequence it applied and skips anything
/// at or below it, so a redelivery (an ack lost with a connection) never stores a block twice.
/// After a restart the durable consumer resumes after its last acknowledged message when that
/// is what the index reflects, and is rewound (recreated from the next sequence) when it is
/// not; start it with [`KvConsumerConfig::applied_through`] = the sequence the index reflects
/// ([`KvConsumer::stop`] returns it; 0 for an empty index, a snapshot's sequence for a
/// restored one).
/// Malformed messages are counted, acknowledged and skipped. The events are applied as the
/// index's [`BlockIndex::set_duplicate_stores`] says (set it on a restored index again).
pub struct KvConsumer {
    index: Arc<BlockIndex>,
    counters: Arc<Counters>,
    link: Arc<Link>,
    bg: Background,
}

impl std::fmt::Debug for KvConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvConsumer")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl KvConsumer {
    /// Starts applying the stream to `index`.
    ///
    /// # Errors
    ///
    /// [`DistError::Config`] for a bad configuration, [`DistError::Connect`] for an invalid
    /// address; an unreachable server is not an error (the consumer attaches when it can).
    pub fn start(index: Arc<BlockIndex>, cfg: KvConsumerConfig) -> Result<Self, DistError> {
        cfg.nats.validate()?;
        let name_ok = !cfg.durable_name.is_empty()
            && cfg
                .durable_name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !name_ok {
            return Err(DistError::Config(
                "durable_name must be non-empty [A-Za-z0-9_-]",
            ));
        }
        check_fetch(cfg.batch, cfg.fetch_wait)?;
        if cfg.snapshot_interval.is_some_and(|d| d.is_zero()) {
            return Err(DistError::Config("snapshot_interval must be positive"));
        }
        let counters = Arc::new(Counters::default());
        counters
            .applied_seq
            .store(cfg.applied_through, Ordering::Relaxed);
        *sync::lock(&counters.stream) = cfg.applied_stream.clone();
        let link = Arc::new(Link::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let task = {
            let (index, counters, link) = (index.clone(), counters.clone(), link.clone());
            move |shutdown: Shutdown| async move {
                let client = match connect(&cfg.nats, link).await {
                    Ok(c) => {
                        let _ = ready_tx.send(Ok(()));
                        c
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                run(cfg, client, index, counters, shutdown).await;
            }
        };
        let bg = Background::start("kvtrie-kv-consumer", task)?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(DistError::Runtime("the consumer thread exited".into())),
        }
        Ok(Self {
            index,
            counters,
            link,
            bg,
        })
    }

    /// The index being fed.
    pub fn index(&self) -> &Arc<BlockIndex> {
        &self.index
    }

    /// The last stream sequence applied to the index.
    pub fn applied_seq(&self) -> u64 {
        self.counters.applied_seq.load(Ordering::Acquire)
    }

    /// Waits until the index reflects the stream up to `seq`, at most `timeout`.
    pub fn wait_applied(&self, seq: u64, timeout: Duration) -> bool {
        poll_until(&self.bg, timeout, || self.applied_seq() >= seq)
    }

    /// The identity of the stream [`applied_seq`](Self::applied_seq) counts, once known (the
    /// `applied_stream` of a consumer that continues over the same index). On a running
    /// consumer, read it before `applied_seq`: a stream reset stores the sequence 0 before the
    /// new identity, so that order never pairs a new identity with an old sequence.
    /// [`stop_resumable`](Self::stop_resumable) returns both after the thread stopped.
    pub fn applied_stream(&self) -> Option<String> {
        sync::lock(&self.counters.stream).clone()
    }

    /// Stops the consumer (joins its thread) and returns the last stream sequence it
    /// applied: the `applied_through` of a consumer that continues over the same index. Give
    /// that consumer the stream's identity too ([`stop_resumable`](Self::stop_resumable)):
    /// with the sequence alone, a server that lost its store meanwhile and whose new stream
    /// is already longer goes unnoticed, and the new stream's first messages are skipped.
    pub fn stop(self) -> u64 {
        self.stop_resumable().0
    }

    /// Stops the consumer (joins its thread) and returns where a consumer that continues over
    /// the same index resumes: its `applied_through` and `applied_stream`.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use kvtrie::BlockIndex;
    /// # use kvtrie::dist::{KvConsumer, KvConsumerConfig, NatsConfig};
    /// let nats = NatsConfig::new("nats://127.0.0.1:4222");
    /// let index = Arc::new(BlockIndex::new());
    /// let c = KvConsumer::start(index.clone(), KvConsumerConfig::new(nats.clone(), "a"))?;
    /// // ... later
    /// let (seq, stream) = c.stop_resumable();
    /// let mut cfg = KvConsumerConfig::new(nats, "a");
    /// (cfg.applied_through, cfg.applied_stream) = (seq, stream);
    /// let c = KvConsumer::start(index, cfg)?;
    /// # Ok::<(), kvtrie::dist::DistError>(())
    /// ```
    pub fn stop_resumable(self) -> (u64, Option<String>) {
        let counters = self.counters.clone();
        drop(self);
        let stream = sync::lock(&counters.stream).clone();
        (counters.applied_seq.load(Ordering::Acquire), stream)
    }

    /// Whether the background thread still runs: it stops only when this is dropped, so
    /// `false` means it died (a bug: please report it), and nothing is shared any more.
    pub fn running(&self) -> bool {
        self.bg.running()
    }

    /// The last error the consumer met, in words (`None` if none yet): what its `errors`,
    /// `snapshot_errors` and connection `errors` counted last (e.g. a stream of the same name
    /// made for other subjects, refused at every attach). It is kept after the consumer
    /// recovers; compare the counters to see whether it is still happening.
    pub fn last_error(&self) -> Option<String> {
        LastError::newest(&self.counters.last_error, &self.link.last_error)
    }

    /// The counters.
    pub fn stats(&self) -> KvConsumerStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        KvConsumerStats {
            link: self.link.stats(),
            applied_seq: self.applied_seq(),
            messages: l(&c.messages),
            events: l(&c.events),
            rejected_events: l(&c.rejected),
            duplicates: l(&c.duplicates),
            malformed: l(&c.malformed),
            lost_messages: l(&c.lost),
            refetches: l(&c.refetches),
            sequence_gaps: l(&c.gaps),
            pending: l(&c.pending),
            errors: l(&c.errors),
            attaches: l(&c.attaches),
            stream_resets: l(&c.stream_resets),
            snapshots_written: l(&c.snapshots),
            snapshot_errors: l(&c.snapshot_errors),
        }
    }
}

/// A durable consumer, whether its stream was replaced since the last attach, and the
/// stream's identity ([`stream_id`]).
type Attached = (
    async_nats::jetstream::consumer::Consumer<pull::Config>,
    bool,
    String,
);

/// Creates or finds the durable consumer; rewinds it if it is past what the index reflects.
/// A stream replaced since the attach that saw stream `known` (see [`stream_replaced`]) is
/// read from its start: `applied` counts as 0 and the flag returned is true. The caller
/// records the identity returned only once the attach succeeded, so a replacement seen by a
/// failed attach is seen again by the next.
async fn attach(
    js: &async_nats::jetstream::Context,
    cfg: &KvConsumerConfig,
    mut applied: u64,
    known: Option<&str>,
) -> Result<Attached, String> {
    let stream = ensure_stream(js, &cfg.nats, &cfg.nats.kv_stream, cfg.nats.kv_subjects()).await?;
    let info = stream.cached_info();
    let now = stream_id(info);
    let replaced = stream_replaced(&now, info.state.last_sequence, known, applied);
    if replaced {
        applied = 0;
    }
    let config = pull::Config {
        durable_name: Some(cfg.durable_name.clone()),
        ack_policy: AckPolicy::Explicit,
        deliver_policy: if applied == 0 {
            DeliverPolicy::All
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: applied + 1,
            }
        },
        ack_wait: Duration::from_secs(30),
        max_ack_pending: 100_000,
        // A durable name no consumer uses for as long as the stream keeps messages is
        // forgotten by the server (attaching creates it again where the index stands).
        inactive_threshold: cfg.nats.retention,
        ..Default::default()
    };
    let mut consumer = stream
        .get_or_create_consumer(&cfg.durable_name, config.clone())
        .await
        .map_err(|e| e.to_string())?;
    let info = consumer.info().await.map_err(|e| e.to_string())?;
    if info.ack_floor.stream_sequence > applied || info.delivered.stream_sequence > applied {
        // The durable consumer has acknowledged messages this index never saw (a fresh index
        // under an old name), or delivered messages past what was applied (to an earlier
        // incarnation that stopped before applying them: the server would redeliver those
        // only after the ack wait, behind newer ones). Start it over right after what the
        // index reflects, so delivery stays in stream order.
        stream
            .delete_consumer(&cfg.durable_name)
            .await
            .map_err(|e| e.to_string())?;
        consumer = stream
            .create_consumer(config)
            .await
            .map_err(|e| e.to_string())?;
    } else if info.config.inactive_threshold != cfg.nats.retention {
        // A durable created by an older version (none) or under another retention keeps its
        // own threshold: `get_or_create_consumer` returns it unchanged. The threshold is an
        // editable field; the rest of the existing configuration stays. A failed update only
        // leaves the old threshold (the consumer works either way).
        let mut updated = info.config.clone();
        updated.inactive_threshold = cfg.nats.retention;
        let _ = stream.update_consumer(updated).await;
    }
    Ok((consumer, replaced, now))
}

async fn run(
    cfg: KvConsumerConfig,
    client: async_nats::Client,
    index: Arc<BlockIndex>,
    counters: Arc<Counters>,
    mut shutdown: Shutdown,
) {
    let js = jetstream(&cfg.nats, client);
    // Each worker's last (relay, counter), for gap detection; a worker silent for longer than
    // the stream's retention is forgotten.
    let mut last: Last = Recent::new(cfg.nats.retention);
    let mut failures = 0usize;
    // Snapshots: this consumer's writer id (its durable name's hash, so a restarted consumer
    // replaces its own older snapshots), the last time and the sequence covered.
    let writer = crate::rng::mix64(xxhash_rust::xxh3::xxh3_64(cfg.durable_name.as_bytes()));
    let (mut snap_at, mut snap_seq) = (Instant::now(), cfg.applied_through);
    // Whether this consumer has stored a snapshot (from then on it keeps one in the bucket).
    let mut snap_written = false;
    // When to ask, while nothing comes, whether deliveries were lost at the end of a burst.
    let mut idle = IdleChecks::new(&js.client());
    'attach: while !shutdown.requested() {
        let applied = counters.applied_seq.load(Ordering::Relaxed);
        // The identity of the stream as last attached (before the first attach: of the
        // stream `applied_through` counts, if known).
        let known = sync::lock(&counters.stream).clone();
        let Some(attached) = shutdown
            .or_stop(attach(&js, &cfg, applied, known.as_deref()))
            .await
        else {
            break;
        };
        let consumer = match attached {
            Ok((c, replaced, now)) => {
                if replaced {
                    // A new stream: its sequences start at 1 again. The index keeps what it
                    // has (the engines' caches did not change); the new stream's events
                    // follow it.
                    bump(&counters.stream_resets);
                    counters.applied_seq.store(0, Ordering::Release);
                    snap_seq = 0;
                }
                *sync::lock(&counters.stream) = Some(now);
                c
            }
            Err(e) => {
                bump(&counters.errors);
                counters.last_error.set("attach", e);
                if !shutdown.back_off(&mut failures, &cfg.nats).await {
                    break;
                }
                continue;
            }
        };
        bump(&counters.attaches);
        // The stream attached to, for the snapshots' tags.
        let created = sync::lock(&counters.stream).clone();
        let msgs = tokio::select! {
            m = pull_in_order(&consumer, cfg.batch, cfg.fetch_wait) => m,
            _ = shutdown.wait() => break 'attach,
        };
        let msgs = msgs
            .inspect_err(|e| counters.last_error.set("subscribe", e))
            .ok();
        if let Some(mut msgs) = msgs {
            // The consumer's delivery sequence of the last message (see `jump`).
            let mut delivered = consumer.cached_info().delivered.consumer_sequence;
            idle.attached(delivered);
            loop {
                // The bucket forgets a snapshot after the retention: the last one is written
                // again at half of it when nothing new came (the index is as it covers), so
                // that a quiet spell does not leave new routers to start cold.
                let refresh = cfg.nats.retention / 2;
                let refresh_in = refresh.saturating_sub(snap_at.elapsed());
                let refreshing = cfg.snapshot_interval.is_some() && snap_written;
                let m = tokio::select! {
                    m = msgs.next() => m,
                    _ = shutdown.wait() => break 'attach,
                    _ = idle.tick_due() => {
                        let applied = counters.applied_seq.load(Ordering::Relaxed);
                        let lost = tokio::select! {
                            l = idle.tick(&consumer, applied) => l,
                            _ = shutdown.wait() => break 'attach,
                        };
                        if lost {
                            // Lost in transit with nothing after them: the server would send
                            // them again only after the ack wait. Attach again after
                            // `applied` (`attach` starts the durable over there).
                            bump(&counters.refetches);
                            continue 'attach;
                        }
                        continue;
                    }
                    _ = tokio::time::sleep(refresh_in), if refreshing => {
                        let applied = counters.applied_seq.load(Ordering::Relaxed);
                        let stream = created.as_deref().unwrap_or_default();
                        let stored = snapshot(&js, &cfg, &index, &counters, applied, writer, stream);
                        let Some(ok) = shutdown.or_stop(stored).await else {
                            break 'attach;
                        };
                        // After a failure, again after a snapshot interval (at least a few
                        // seconds: no hot loop against a failing store), not half a retention.
                        let again = if ok {
                            Duration::ZERO
                        } else {
                            let retry = cfg.snapshot_interval.unwrap_or(refresh);
                            refresh.saturating_sub(retry.max(REFRESH_RETRY))
                        };
                        snap_at = Instant::now().checked_sub(again).unwrap_or_else(Instant::now);
                        snap_seq = applied;
                        continue;
                    }
                };
                let m = match m {
                    None => break,
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        bump(&counters.errors);
                        counters.last_error.set("pull", e);
                        break;
                    }
                };
                failures = 0;
                let (seq, pending, delivery) = match m.info() {
                    Ok(i) => (i.stream_sequence, i.pending, i.consumer_sequence),
                    Err(_) => {
                        bump(&counters.malformed);
                        let _ = m.ack().await;
                        continue;
                    }
                };
                idle.received(delivery);
                counters.pending.store(pending, Ordering::Relaxed);
                let applied = counters.applied_seq.load(Ordering::Relaxed);
                if seq <= applied {
                    // A redelivery takes a delivery sequence too, which is not counted as the
                    // last: deliveries lost around it then still show as a jump.
                    bump(&counters.duplicates);
                } else {
                    let last_delivery = core::mem::replace(&mut delivered, delivery);
                    match jump(applied, seq, last_delivery, delivery) {
                        None => {}
                        Some(Jump::Gone(n)) => {
                            counters.lost.fetch_add(n, Ordering::Relaxed);
                        }
                        Some(Jump::InTransit) => {
                            // Attach again after `applied` (this message unacknowledged: the
                            // consumer starts over there).
                            bump(&counters.refetches);
                            continue 'attach;
                        }
                    }
                    apply(&index, &m.payload, &counters, &mut last);
                    counters.applied_seq.store(seq, Ordering::Release);
                }
                if let Err(e) = m.ack().await {
                    bump(&counters.errors);
                    counters.last_error.set("ack", e);
                }
                // Between two messages the index reflects exactly the stream through
                // `applied`: the moment to snapshot it (nothing is applied meanwhile).
                let applied = counters.applied_seq.load(Ordering::Relaxed);
                if let Some(every) = cfg.snapshot_interval {
                    if applied > snap_seq && snap_at.elapsed() >= every {
                        // Tagged with the stream this consumer attached to (set above).
                        let stream = created.as_deref().unwrap_or_default();
                        let stored =
                            snapshot(&js, &cfg, &index, &counters, applied, writer, stream);
                        let Some(ok) = shutdown.or_stop(stored).await else {
                            break 'attach;
                        };
                        snap_written |= ok;
                        (snap_at, snap_seq) = (Instant::now(), applied);
                    }
                }
            }
        }
        // A failed pull: the connection may be down; back off a little and re-attach.
        if !shutdown.back_off(&mut failures, &cfg.nats).await {
            break;
        }
    }
}

/// The shortest wait before a failed snapshot refresh is tried again.
const REFRESH_RETRY: Duration = Duration::from_secs(5);

/// Stores a snapshot of `index` through `applied` (tagged with `stream`) and counts the
/// outcome; returns whether it was stored.
async fn snapshot(
    js: &async_nats::jetstream::Context,
    cfg: &KvConsumerConfig,
    index: &Arc<BlockIndex>,
    counters: &Counters,
    applied: u64,
    writer: u64,
    stream: &str,
) -> bool {
    match store(js, &cfg.nats, index.clone(), applied, writer, stream).await {
        Ok(_) => {
            bump(&counters.snapshots);
            true
        }
        Err(e) => {
            bump(&counters.snapshot_errors);
            counters.last_error.set("snapshot", e);
            false
        }
    }
}

/// Each worker's last (relay id, message counter).
type Last = Recent<WorkerId, (u64, u64)>;

fn apply(index: &BlockIndex, payload: &[u8], counters: &Counters, last: &mut Last) {
    let batch = match decode_kv_events(payload) {
        Ok(b) => b,
        Err(_) => {
            bump(&counters.malformed);
            return;
        }
    };
    if batch.seq != 0 {
        let prev = last.insert(batch.worker, (batch.source, batch.seq), Instant::now());
        if let Some((source, seq)) = prev {
            // A counter back at 1 is a relay that forgot a silent worker: no gap.
            if source == batch.source && batch.seq != seq.wrapping_add(1) && batch.seq != 1 {
                bump(&counters.gaps);
            }
        }
    }
    bump(&counters.messages);
    for e in batch.events {
        bump(&counters.events);
        if index.apply_in(batch.worker, e.tier, e.event).is_err() {
            bump(&counters.rejected);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::blocks::{KvEvent, Tier};
    use crate::dist::codec::{encode_kv_events, KvEventBatch, TieredEvent};

    fn message(worker: u64, source: u64, seq: u64) -> Vec<u8> {
        let batch = KvEventBatch {
            worker: WorkerId(worker),
            source,
            seq,
            events: vec![TieredEvent {
                tier: Tier::Gpu,
                event: KvEvent::Cleared,
            }],
        };
        let mut out = Vec::new();
        encode_kv_events(&batch, &mut out);
        out
    }

    /// Gap detection per worker and relay: a jump or a step back is a gap; a counter back at 1
    /// (a relay that forgot a silent worker), another relay, or a worker first seen is not.
    #[test]
    fn counter_gaps_are_counted_and_restarts_are_not() {
        let index = BlockIndex::new();
        let counters = Counters::default();
        let mut last: Last = Recent::new(Duration::from_secs(3600));
        let gaps = |c: &Counters| c.gaps.load(Ordering::Relaxed);
        for (worker, source, seq, total) in [
            (1, 7, 5, 0), // first sight of worker 1
            (1, 7, 6, 0),
            (1, 7, 8, 1), // 7 went missing
            (1, 7, 1, 1), // the relay forgot worker 1 and started again
            (1, 7, 2, 1),
            (1, 9, 40, 1), // another relay
            (2, 7, 3, 1),  // first sight of worker 2
            (1, 9, 39, 2), // a step back
        ] {
            apply(&index, &message(worker, source, seq), &counters, &mut last);
            assert_eq!(
                gaps(&counters),
                total,
                "worker {worker} relay {source} seq {seq}"
            );
        }
        assert_eq!(counters.messages.load(Ordering::Relaxed), 8);
        assert_eq!(counters.rejected.load(Ordering::Relaxed), 0);
    }

    /// A payload that does not decode is counted as malformed only: it is not a message
    /// applied, and its events (none) are not counted.
    #[test]
    fn undecodable_payloads_count_as_malformed_not_as_applied_messages() {
        let index = BlockIndex::new();
        let counters = Counters::default();
        let mut last: Last = Recent::new(Duration::from_secs(3600));
        apply(&index, b"not kvtrie", &counters, &mut last);
        apply(&index, &message(1, 7, 1), &counters, &mut last);
        apply(&index, &[1, 2, 9], &counters, &mut last);
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (
                l(&counters.malformed),
                l(&counters.messages),
                l(&counters.events)
            ),
            (2, 1, 1)
        );
    }
}
