//! [`KvEventRelay`]: engine KV events → a JetStream stream, one subject per worker.

use super::codec::{encode_kv_events, split_kv_events, KvEventBatch, TieredEvent, MIN_SPLIT_BYTES};
use super::recent::Recent;
use super::runtime::{
    connect, jetstream_window, poll_until, Background, LastError, Link, LinkStats, Shutdown,
};
use super::{ensure_stream, new_id, DistError, NatsConfig};
use crate::blocks::WorkerId;
use crate::events::vllm::DecodedBatch;
use crate::sync::{self, AtomicU64, Mutex, Ordering};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage as Publish;
use bytes::Bytes;
use std::collections::VecDeque;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The largest [`RelayConfig::max_in_flight`].
pub const MAX_IN_FLIGHT: usize = 1 << 16;
/// The largest [`RelayConfig::queue_capacity`] (the queue's channel refuses more).
pub const MAX_QUEUE_CAPACITY: usize = 1 << 30;
/// How long the relay waits before publishing again when the client has no room for another
/// outstanding ack and none of its own is outstanding (the client still holds acks of a
/// window abandoned after a failure; they settle within the operation timeout).
const ACK_ROOM_WAIT: Duration = Duration::from_millis(10);

/// Parameters of a [`KvEventRelay`].
///
/// ```
/// use kvtrie::dist::{NatsConfig, RelayConfig};
/// let cfg = RelayConfig::new(NatsConfig::new("nats://127.0.0.1:4222"));
/// assert_eq!(cfg.queue_capacity, 65_536);
/// ```
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// The server and streams.
    pub nats: NatsConfig,
    /// Messages (one per [`KvEventRelay::publish`], or more for a publish larger than
    /// [`Self::max_message_bytes`]) waiting for the background task; beyond that, publishes
    /// are dropped and counted ([`RelayStats::dropped`]).
    pub queue_capacity: usize,
    /// Payload bytes of the messages the relay holds at once: queued, awaiting their ack or
    /// waiting to be sent again (at least [`max_message_bytes`](Self::max_message_bytes));
    /// beyond that, publishes are dropped and counted too. While the server is down, this
    /// bounds what the relay's memory grows by.
    pub queue_bytes: usize,
    /// Publishes awaiting their JetStream ack at once (at most [`MAX_IN_FLIGHT`]).
    pub max_in_flight: usize,
    /// Largest message published, in bytes (at least [`MIN_SPLIT_BYTES`]): a publish whose
    /// events encode to more is cut into several consecutive messages
    /// ([`split_kv_events`]). Keep it below the server's `max_payload` (1 MiB by default);
    /// a message the server still refuses as too large is dropped and counted
    /// ([`RelayStats::rejected`]) instead of blocking the queue.
    pub max_message_bytes: usize,
}

impl RelayConfig {
    /// The defaults for `nats`: a queue of 65,536 messages and 256 MiB, 512 publishes in
    /// flight, messages of at most 512 KiB.
    pub fn new(nats: NatsConfig) -> Self {
        Self {
            nats,
            queue_capacity: 65_536,
            queue_bytes: 256 << 20,
            max_in_flight: 512,
            max_message_bytes: 512 << 10,
        }
    }
}

/// What a [`KvEventRelay`] has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// The connection.
    pub link: LinkStats,
    /// Messages accepted into the queue.
    pub enqueued: u64,
    /// Publishes dropped (all their messages) because the queue was full or the relay had
    /// stopped.
    pub dropped: u64,
    /// Messages the stream acknowledged (duplicates of a retried publish included once).
    pub acked: u64,
    /// Publishes that failed (timeout, no stream, connection lost) and were retried.
    pub publish_errors: u64,
    /// Messages the server refused as larger than its `max_payload`, dropped (see
    /// [`RelayConfig::max_message_bytes`]).
    pub rejected: u64,
    /// Messages queued or in flight right now.
    pub pending: u64,
}

#[derive(Debug, Default)]
struct Counters {
    /// Payload bytes of the messages the relay holds: queued, in flight or to be sent again
    /// (added by `publish`, taken away once a message is acknowledged or refused for good).
    queued_bytes: AtomicU64,
    enqueued: AtomicU64,
    dropped: AtomicU64,
    acked: AtomicU64,
    errors: AtomicU64,
    rejected: AtomicU64,
    last_error: LastError,
}

impl Counters {
    /// `m` is settled (acknowledged, or refused for good): the relay no longer holds it.
    fn let_go(&self, m: &Outgoing) {
        self.queued_bytes
            .fetch_sub(m.payload.len() as u64, Ordering::Relaxed);
    }
}

struct Outgoing {
    subject: String,
    id: String,
    payload: Bytes,
}

/// Publishes KV events to JetStream without blocking the caller.
///
/// Each [`publish`](Self::publish) encodes the events of one worker as one message (see
/// [`crate::dist::codec`]; several, cut by [`split_kv_events`], beyond
/// [`RelayConfig::max_message_bytes`]) and queues it; a background task publishes the queue in order to
/// the subject [`NatsConfig::kv_subject`] of the worker, with up to
/// [`RelayConfig::max_in_flight`] acks outstanding. Every message carries a `Nats-Msg-Id`
/// (relay id and a counter), so the publishes a connection loss forces the relay to retry are
/// stored once (within the stream's two-minute duplicate window). Each message also carries
/// the relay's per-worker counter, so consumers can see a gap or a reordering (counted in
/// their stats). A full queue drops the message and counts it: the caller is never blocked.
///
/// If the server is unreachable the relay keeps queueing and retries with backoff; the stream
/// is created on first contact (retention [`NatsConfig::retention`]).
pub struct KvEventRelay {
    tx: mpsc::Sender<Outgoing>,
    nats: NatsConfig,
    source: u64,
    next_id: AtomicU64,
    max_message_bytes: usize,
    queue_bytes: u64,
    /// Each worker's last message counter; a worker silent for longer than the stream's
    /// retention is forgotten (its counter starts again at 1, which consumers accept).
    worker_seq: Mutex<Recent<WorkerId, u64>>,
    counters: Arc<Counters>,
    link: Arc<Link>,
    bg: Background,
}

impl std::fmt::Debug for KvEventRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventRelay")
            .field("source", &self.source)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl KvEventRelay {
    /// Starts a relay (its background thread and connection).
    ///
    /// # Errors
    ///
    /// [`DistError::Config`] for a bad configuration, [`DistError::Connect`] for an invalid
    /// address; an unreachable server is not an error.
    pub fn start(cfg: RelayConfig) -> Result<Self, DistError> {
        cfg.nats.validate()?;
        if cfg.queue_capacity == 0 || cfg.max_in_flight == 0 {
            return Err(DistError::Config(
                "queue_capacity and max_in_flight must be positive",
            ));
        }
        if cfg.queue_capacity > MAX_QUEUE_CAPACITY || cfg.max_in_flight > MAX_IN_FLIGHT {
            return Err(DistError::Config(
                "queue_capacity must be at most MAX_QUEUE_CAPACITY (2^30) and max_in_flight at \
                 most MAX_IN_FLIGHT (65,536)",
            ));
        }
        if cfg.max_message_bytes < MIN_SPLIT_BYTES {
            return Err(DistError::Config(
                "max_message_bytes must be at least MIN_SPLIT_BYTES (256)",
            ));
        }
        if cfg.queue_bytes < cfg.max_message_bytes {
            return Err(DistError::Config(
                "queue_bytes must be at least max_message_bytes",
            ));
        }
        let (tx, rx) = mpsc::channel(cfg.queue_capacity);
        let counters = Arc::new(Counters::default());
        let link = Arc::new(Link::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let task = {
            let (nats, counters, link) = (cfg.nats.clone(), counters.clone(), link.clone());
            let max_in_flight = cfg.max_in_flight;
            move |shutdown: Shutdown| async move {
                let client = match connect(&nats, link).await {
                    Ok(c) => {
                        let _ = ready_tx.send(Ok(()));
                        c
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                run(nats, client, rx, counters, max_in_flight, shutdown).await;
            }
        };
        let bg = Background::start("kvtrie-relay", task)?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(DistError::Runtime("the relay thread exited".into())),
        }
        Ok(Self {
            tx,
            worker_seq: Mutex::new(Recent::new(cfg.nats.retention)),
            nats: cfg.nats,
            source: new_id(),
            next_id: AtomicU64::new(0),
            max_message_bytes: cfg.max_message_bytes,
            queue_bytes: cfg.queue_bytes as u64,
            counters,
            link,
            bg,
        })
    }

    /// This relay's id (the `source` of its messages).
    pub fn id(&self) -> u64 {
        self.source
    }

    /// Queues `events` of `worker` for publishing. Returns `false` (and counts the drop) if
    /// the queue is full. Never blocks. An empty event list publishes nothing. Events that
    /// encode to more than [`RelayConfig::max_message_bytes`] go out as several consecutive
    /// messages, queued all together or not at all.
    pub fn publish(&self, worker: WorkerId, events: Vec<TieredEvent>) -> bool {
        if events.is_empty() {
            return true;
        }
        let groups = split_kv_events(events, self.max_message_bytes);
        // The per-worker counter and the enqueue happen under one lock, so a worker's
        // messages enter the queue in counter order; every enqueue happens under it, so the
        // room checked here can only grow before the sends below.
        let mut seqs = sync::lock(&self.worker_seq);
        if self.tx.capacity() < groups.len() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let first = seqs.get(&worker).unwrap_or(0) + 1;
        let payloads: Vec<Vec<u8>> = groups
            .into_iter()
            .zip(first..)
            .map(|(events, seq)| {
                let mut payload = Vec::new();
                let batch = KvEventBatch {
                    worker,
                    source: self.source,
                    seq,
                    events,
                };
                encode_kv_events(&batch, &mut payload);
                payload
            })
            .collect();
        let bytes: u64 = payloads.iter().map(|p| p.len() as u64).sum();
        let queued = &self.counters.queued_bytes;
        // Publishers add under the lock; the task only takes away, so this cannot overshoot.
        if queued.load(Ordering::Relaxed).saturating_add(bytes) > self.queue_bytes {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let now = Instant::now();
        for (payload, seq) in payloads.into_iter().zip(first..) {
            let n = self.next_id.fetch_add(1, Ordering::Relaxed);
            let len = payload.len() as u64;
            let msg = Outgoing {
                subject: self.nats.kv_subject(worker),
                id: format!("{:016x}-{n}", self.source),
                payload: Bytes::from(payload),
            };
            queued.fetch_add(len, Ordering::Relaxed);
            if self.tx.try_send(msg).is_err() {
                // Only a stopped relay refuses here.
                queued.fetch_sub(len, Ordering::Relaxed);
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            seqs.insert(worker, seq, now);
            self.counters.enqueued.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// Queues the events of a decoded vLLM batch for engine `engine` (the batch's
    /// data-parallel rank picks the worker; each event keeps its tier). Returns `false` if
    /// dropped, or if the rank does not fit a [`WorkerId`] (above 65,535).
    pub fn publish_vllm(&self, engine: u64, batch: DecodedBatch) -> bool {
        let Ok(rank) = u16::try_from(batch.data_parallel_rank.unwrap_or(0)) else {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        let events = batch
            .events
            .into_iter()
            .map(|e| TieredEvent {
                tier: e.tier(),
                event: e.event,
            })
            .collect();
        self.publish(WorkerId::new(engine, rank), events)
    }

    /// Waits until every queued message is acknowledged by the stream, at most `timeout`.
    /// Returns whether the queue drained.
    pub fn flush(&self, timeout: Duration) -> bool {
        poll_until(&self.bg, timeout, || self.stats().pending == 0)
    }

    /// Whether the background thread still runs: it stops only when this is dropped, so
    /// `false` means it died (a bug: please report it), and nothing is shared any more.
    pub fn running(&self) -> bool {
        self.bg.running()
    }

    /// The last error the relay met, in words (`None` if none yet): what its
    /// `publish_errors`, `rejected` and connection `errors` counted last. It is kept after the
    /// relay recovers; compare the counters to see whether it is still happening. A stream
    /// the relay cannot use shows here while it retries: one of the same name made for other
    /// subjects (refused by the relay's check, `stream: ...`), or one created beforehand that
    /// is full and set to discard new messages (its publishes are refused,
    /// `publish acknowledgement: ... maximum messages exceeded`).
    pub fn last_error(&self) -> Option<String> {
        LastError::newest(&self.counters.last_error, &self.link.last_error)
    }

    /// The counters.
    pub fn stats(&self) -> RelayStats {
        let c = &self.counters;
        let enqueued = c.enqueued.load(Ordering::Relaxed);
        let acked = c.acked.load(Ordering::Relaxed);
        let rejected = c.rejected.load(Ordering::Relaxed);
        RelayStats {
            link: self.link.stats(),
            enqueued,
            dropped: c.dropped.load(Ordering::Relaxed),
            acked,
            publish_errors: c.errors.load(Ordering::Relaxed),
            rejected,
            pending: enqueued.saturating_sub(acked + rejected),
        }
    }
}

type AckFuture = Pin<
    Box<
        dyn Future<
                Output = Result<
                    async_nats::jetstream::publish::PublishAck,
                    async_nats::jetstream::context::PublishError,
                >,
            > + Send,
    >,
>;

/// The relay's background loop: publish in order with a window of acks; on any failure, put
/// every message in flight back at the head of the queue (same message ids), back off, and
/// publish again.
async fn run(
    nats: NatsConfig,
    client: async_nats::Client,
    mut rx: mpsc::Receiver<Outgoing>,
    counters: Arc<Counters>,
    max_in_flight: usize,
    mut shutdown: Shutdown,
) {
    let js = jetstream_window(&nats, client, max_in_flight);
    let mut retry: VecDeque<Outgoing> = VecDeque::new();
    let mut in_flight: VecDeque<(Outgoing, AckFuture)> = VecDeque::new();
    let mut failures = 0usize;
    let mut have_stream = false;
    // The client had no room for another outstanding ack: settle one of ours before the next
    // publish (or, with none of ours outstanding, wait a moment).
    let mut no_room = false;
    while !shutdown.requested() {
        if !have_stream {
            let ensured = ensure_stream(&js, &nats, &nats.kv_stream, nats.kv_subjects());
            match shutdown.or_stop(ensured).await {
                None => break,
                Some(Ok(_)) => have_stream = true,
                Some(Err(e)) => {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    counters.last_error.set("stream", e);
                    if !shutdown.back_off(&mut failures, &nats).await {
                        break;
                    }
                    continue;
                }
            }
        }
        // Messages to publish again, in stream order, if something failed.
        let mut redo: Option<Vec<Outgoing>> = None;
        // Retries first, in their order, then the queue.
        if no_room && in_flight.is_empty() {
            if !shutdown.sleep(ACK_ROOM_WAIT).await {
                break;
            }
            no_room = false;
        }
        let next = if in_flight.len() < max_in_flight && !no_room {
            if let Some(m) = retry.pop_front() {
                Some(m)
            } else if in_flight.is_empty() {
                tokio::select! {
                    m = rx.recv() => match m { Some(m) => Some(m), None => break },
                    _ = shutdown.wait() => break,
                }
            } else {
                rx.try_recv().ok()
            }
        } else {
            None
        };
        if let Some(m) = next {
            let p = Publish::build()
                .payload(m.payload.clone())
                .message_id(&m.id);
            let sent = tokio::select! {
                r = js.send_publish(m.subject.clone(), p) => r,
                _ = shutdown.wait() => break,
            };
            match sent {
                Ok(ack) => in_flight.push_back((m, Box::pin(ack.into_future()))),
                Err(e) if e.kind() == PublishErrorKind::MaxAckPending => {
                    // Nothing was sent: publish it again once an ack settled.
                    retry.push_front(m);
                    no_room = true;
                }
                Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    // Sending it again would fail again, forever, and hold up every message
                    // behind it: drop it (the consumers see a gap in the worker's counter).
                    counters.rejected.fetch_add(1, Ordering::Relaxed);
                    counters.last_error.set("publish (message dropped)", e);
                    counters.let_go(&m);
                }
                Err(e) => {
                    counters.last_error.set("publish", e);
                    // Everything in flight was sent before it.
                    let mut v: Vec<Outgoing> = in_flight.drain(..).map(|(m, _)| m).collect();
                    v.push(m);
                    redo = Some(v);
                }
            }
        } else if let Some((_, ack)) = in_flight.front_mut() {
            let r = tokio::select! {
                r = ack => r,
                _ = shutdown.wait() => break,
            };
            let (m, _) = in_flight.pop_front().expect("front exists");
            no_room = false;
            match r {
                Ok(_) => {
                    counters.acked.fetch_add(1, Ordering::Relaxed);
                    counters.let_go(&m);
                    failures = 0;
                }
                Err(e) => {
                    counters.last_error.set("publish acknowledgement", e);
                    redo = Some(failed_from(m, &mut in_flight));
                }
            }
        }
        // Settle acks that are already in, without waiting.
        while redo.is_none() {
            let Some((_, ack)) = in_flight.front_mut() else {
                break;
            };
            let Some(r) = futures_util::FutureExt::now_or_never(ack.as_mut()) else {
                break;
            };
            let (m, _) = in_flight.pop_front().expect("front exists");
            no_room = false;
            match r {
                Ok(_) => {
                    counters.acked.fetch_add(1, Ordering::Relaxed);
                    counters.let_go(&m);
                }
                Err(e) => {
                    counters.last_error.set("publish acknowledgement", e);
                    redo = Some(failed_from(m, &mut in_flight));
                }
            }
        }
        if let Some(redo) = redo {
            counters.errors.fetch_add(1, Ordering::Relaxed);
            for m in redo.into_iter().rev() {
                retry.push_front(m);
            }
            have_stream = false;
            if !shutdown.back_off(&mut failures, &nats).await {
                break;
            }
        }
    }
}

/// The failed message `m` and every message in flight after it, in order.
fn failed_from(m: Outgoing, in_flight: &mut VecDeque<(Outgoing, AckFuture)>) -> Vec<Outgoing> {
    let mut v = vec![m];
    v.extend(in_flight.drain(..).map(|(m, _)| m));
    v
}
