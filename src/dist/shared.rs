//! [`SharedRouter`]: prefix-affinity routers that share their routing history over JetStream.

use super::codec::{
    encode_decisions, truncate_str, Decision, DecisionBatch, DecisionRef, DecisionsView,
};
use super::runtime::{
    backoff, connect, jetstream, jump, poll_until, pull_in_order, tokio_deadline, Background,
    IdleChecks, Jump, LastError, Link, LinkStats, Shutdown,
};
use super::warm::{
    load_latest, merge_tree, store, stream_id, stream_identity, SnapshotInfo, Unreadable,
};
use super::{check_fetch, ensure_stream, new_id, stream_replaced, unix_ms, DistError, NatsConfig};
use crate::router::RouteError;
use crate::router::{Candidate, PrefixAffinityConfig, PrefixAffinityRouter, ReplicaId, Route};
use crate::sync::{self, AtomicU64, Mutex, Ordering};
use crate::tree::{Error as TreeError, PrefixTree};
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage as Publish;
use async_nats::jetstream::Context;
use bytes::Bytes;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The largest [`SharedConfig::buffer_decisions`] (the queue's channel refuses more).
pub const MAX_BUFFER_DECISIONS: usize = 1 << 30;

/// Parameters of a [`SharedRouter`].
///
/// ```
/// use kvtrie::dist::{NatsConfig, SharedConfig};
/// let cfg = SharedConfig::new(NatsConfig::new("nats://127.0.0.1:4222"));
/// assert_eq!(cfg.max_lag, 10_000);
/// assert!(cfg.warm_start);
/// ```
#[derive(Clone, Debug)]
pub struct SharedConfig {
    /// The server, streams and bucket.
    pub nats: NatsConfig,
    /// This router's id (`None`: a random one): the writer id of its snapshots, so that a
    /// router restarted with the same id replaces its own older ones. Its decision batches
    /// carry an id of their own, new at every start ([`SharedStats::incarnation`]): routers
    /// skip the batches of their own run only, so a router restarted with the same
    /// `router_id` applies what its previous run published after the snapshot it loads.
    pub router_id: Option<u64>,
    /// Most decisions per published batch.
    pub batch_max: usize,
    /// Most prompt bytes per published batch (keep it below the server's max payload, 1 MiB by
    /// default).
    pub batch_bytes: usize,
    /// How long a batch waits to fill before it is published.
    pub batch_interval: Duration,
    /// Decisions waiting to be published (at most [`MAX_BUFFER_DECISIONS`]); beyond that (or
    /// [`Self::buffer_bytes`]) they are dropped and counted
    /// ([`SharedStats::dropped_decisions`]).
    pub buffer_decisions: usize,
    /// Prompt bytes waiting to be published.
    pub buffer_bytes: usize,
    /// Longer prompts are published cut to this many bytes (at a char boundary): peers learn
    /// the prefix, which is what prefix affinity uses.
    pub max_prompt_bytes: usize,
    /// How long a peer's decision for a replica this router does not have is held back for
    /// it, counted from when it was held (see [`SharedRouter::update_replicas`]); then it is
    /// dropped and counted in
    /// [`SharedStats::unknown_replicas`] (a replica that never comes here must not fill the
    /// hold-back buffer for the replicas that do).
    pub hold_for: Duration,
    /// A router more than this many messages behind the routes stream merges the newest
    /// snapshot and skips the messages it covers (or, without a newer snapshot, skips to the
    /// end of the stream) instead of working through the backlog.
    pub max_lag: u64,
    /// Load the newest snapshot at start ([`SharedRouter::start`]).
    pub warm_start: bool,
    /// Longest wait for that snapshot (start cold after this; at once if no server could be
    /// reached at all).
    pub warm_timeout: Duration,
    /// Store a snapshot of the tree this often (`None`: only on
    /// [`SharedRouter::snapshot_now`]).
    pub snapshot_interval: Option<Duration>,
    /// Largest snapshot loaded.
    pub max_snapshot_bytes: usize,
    /// Messages per pull request of the applier (at most
    /// [`MAX_FETCH_BATCH`](super::MAX_FETCH_BATCH)).
    pub fetch_batch: usize,
    /// How long one pull request waits for messages (at most
    /// [`MAX_FETCH_WAIT`](super::MAX_FETCH_WAIT)).
    pub fetch_wait: Duration,
}

impl SharedConfig {
    /// The defaults for `nats`: batches of up to 256 decisions / 512 KiB every 5 ms, a
    /// buffer of 16,384 decisions / 64 MiB, prompts cut at 64 KiB, peers' decisions held back
    /// for at most 5 minutes, a lag bound of 10,000 messages, warm start within 5 s, a
    /// snapshot every 60 s.
    pub fn new(nats: NatsConfig) -> Self {
        Self {
            nats,
            router_id: None,
            batch_max: 256,
            batch_bytes: 512 << 10,
            batch_interval: Duration::from_millis(5),
            buffer_decisions: 16_384,
            buffer_bytes: 64 << 20,
            max_prompt_bytes: 64 << 10,
            hold_for: Duration::from_secs(300),
            max_lag: 10_000,
            warm_start: true,
            warm_timeout: Duration::from_secs(5),
            snapshot_interval: Some(Duration::from_secs(60)),
            max_snapshot_bytes: 1 << 30,
            fetch_batch: 256,
            fetch_wait: Duration::from_millis(100),
        }
    }

    fn validate(&self) -> Result<(), DistError> {
        self.nats.validate()?;
        if self.batch_max == 0
            || self.batch_bytes == 0
            || self.buffer_decisions == 0
            || self.buffer_bytes == 0
            || self.max_prompt_bytes == 0
            || self.hold_for.is_zero()
            || self.max_lag == 0
        {
            return Err(DistError::Config(
                "batch, buffer, prompt, hold and lag sizes must be positive",
            ));
        }
        check_fetch(self.fetch_batch, self.fetch_wait)?;
        if self.buffer_decisions > MAX_BUFFER_DECISIONS {
            return Err(DistError::Config(
                "buffer_decisions must be at most MAX_BUFFER_DECISIONS (2^30)",
            ));
        }
        if self.snapshot_interval.is_some_and(|d| d.is_zero()) {
            return Err(DistError::Config("snapshot_interval must be positive"));
        }
        Ok(())
    }
}

/// What a [`SharedRouter`] has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedStats {
    /// The connection.
    pub link: LinkStats,
    /// This router's id ([`SharedConfig::router_id`]).
    pub router_id: u64,
    /// The id this run's decision batches carry (new at every start; equal to `router_id`
    /// when that is random).
    pub incarnation: u64,
    /// Decisions accepted for publishing.
    pub recorded: u64,
    /// Decisions the stream acknowledged.
    pub published: u64,
    /// Decisions dropped (buffer full, NATS down for long, or a batch larger than the server
    /// accepts).
    pub dropped_decisions: u64,
    /// Batches published.
    pub published_batches: u64,
    /// Failed publishes, and failed attempts to find or create the routes stream before one
    /// (retried, unless the server refused the batch as too large).
    pub publish_errors: u64,
    /// Recorded decisions in batches the server refused as larger than its `max_payload`
    /// (dropped; also counted in `dropped_decisions`).
    pub refused_decisions: u64,
    /// The last routes-stream sequence applied (or skipped past).
    pub applied_seq: u64,
    /// Peers' batches applied.
    pub applied_batches: u64,
    /// Peers' decisions applied to the tree.
    pub applied_decisions: u64,
    /// This router's own batches seen on the stream (skipped).
    pub own_batches: u64,
    /// Peers' decisions for replicas this router did not have, dropped because the
    /// hold-back buffer was full (or the tree refused them).
    pub unknown_replicas: u64,
    /// Peers' decisions held back right now, for replicas this router does not have yet;
    /// they are applied when the replica is added (see [`SharedRouter::update_replicas`]).
    pub held_decisions: u64,
    /// Messages that did not decode (skipped).
    pub malformed: u64,
    /// Messages left in the stream after the last one applied (the lag in messages).
    pub pending: u64,
    /// Time from a peer's decision to its application here, for the last batch (ms).
    pub last_lag_ms: u64,
    /// The largest such time seen.
    pub max_lag_ms: u64,
    /// Times the router fell more than `max_lag` behind and skipped ahead.
    pub lag_skips: u64,
    /// Messages skipped by those (covered by a merged snapshot, or lost).
    pub skipped_messages: u64,
    /// Routes-stream messages that no longer existed when this router came to them (expired
    /// or deleted before it read them): their decisions are not in the tree. Counted once
    /// this router has applied something (a cold router's start is not a loss).
    pub lost_messages: u64,
    /// Times deliveries were lost in transit (a connection that dropped while they were on
    /// the way; seen by a jump in the sequences, or, with nothing newer after them, by asking
    /// the server while nothing comes): the router then reads the stream again
    /// right after the last applied sequence, so nothing is missed.
    pub refetches: u64,
    /// Failed pull requests or consumer creations (retried).
    pub consumer_errors: u64,
    /// Times the routes stream turned out to be a new one at a re-attach (a server that lost
    /// its store): the router then reads it from its first message, and `applied_seq` counts
    /// from 0 again.
    pub stream_resets: u64,
    /// Snapshots stored.
    pub snapshots_written: u64,
    /// Failed snapshot stores or loads.
    pub snapshot_errors: u64,
    /// The sequence the snapshot this router started from covers (0: started cold).
    pub warm_start_seq: u64,
    /// Time to load and restore that snapshot (µs).
    pub warm_start_us: u64,
}

#[derive(Debug, Default)]
struct Counters {
    recorded: AtomicU64,
    published: AtomicU64,
    dropped: AtomicU64,
    batches: AtomicU64,
    publish_errors: AtomicU64,
    refused: AtomicU64,
    buffered_bytes: AtomicU64,
    applied_seq: AtomicU64,
    applied_batches: AtomicU64,
    applied_decisions: AtomicU64,
    own: AtomicU64,
    unknown: AtomicU64,
    held: AtomicU64,
    malformed: AtomicU64,
    pending: AtomicU64,
    last_lag: AtomicU64,
    max_lag: AtomicU64,
    lag_skips: AtomicU64,
    skipped: AtomicU64,
    lost: AtomicU64,
    refetches: AtomicU64,
    consumer_errors: AtomicU64,
    stream_resets: AtomicU64,
    snapshots: AtomicU64,
    snapshot_errors: AtomicU64,
    warm_seq: AtomicU64,
    warm_us: AtomicU64,
    last_error: LastError,
}

impl Counters {
    /// Counts a snapshot that could not be written or read (`what` was doing it) and records
    /// why.
    fn snapshot_failed(&self, what: &str, e: impl std::fmt::Display) {
        add(&self.snapshot_errors, 1);
        self.last_error.set(what, e);
    }

    /// Counts the snapshots `load_latest` passed over (`what` was loading) as snapshot
    /// errors, and says why the newest of them could not be read.
    fn unreadable(&self, u: &Unreadable, what: &str) {
        add(&self.snapshot_errors, u.count);
        if let Some(e) = &u.first_error {
            self.last_error.set(
                what,
                format_args!("a snapshot passed over as unreadable: {e}"),
            );
        }
    }
}

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// Everything the background tasks share.
struct Ctx {
    cfg: SharedConfig,
    id: u64,
    /// The id of this run's decision batches.
    incarnation: u64,
    router: Arc<PrefixAffinityRouter>,
    counters: Arc<Counters>,
    held: Arc<Held>,
    /// The identity of the routes stream the applier last attached to ([`stream_id`]): the
    /// stream `applied_seq` counts, with which snapshots are tagged (none before the first
    /// attach).
    attached: Arc<Mutex<Option<String>>>,
    js: Context,
}

/// Peers' decisions for replicas this router does not have yet (a cold router reads the
/// stream before its replicas are registered; a peer may know a replica first), by replica
/// name, oldest first; at most [`SharedConfig::buffer_decisions`] decisions and
/// [`SharedConfig::buffer_bytes`] prompt bytes.
#[derive(Default)]
struct Held {
    inner: Mutex<HeldInner>,
}

#[derive(Default)]
struct HeldInner {
    /// Per replica name: (prompt, decision time, time held, stream sequence of its message),
    /// in the order held.
    by_replica: HashMap<String, Vec<(String, u64, u64, u64)>>,
    decisions: usize,
    bytes: usize,
}

impl Held {
    /// Holds `d` (from the message at stream sequence `seq`) back; false if the buffer is
    /// full.
    fn hold(&self, replica: &str, d: &DecisionRef<'_>, seq: u64, cfg: &SharedConfig) -> bool {
        let mut h = sync::lock(&self.inner);
        let bytes = d.prompt.len() + replica.len();
        if h.decisions >= cfg.buffer_decisions || h.bytes + bytes > cfg.buffer_bytes {
            return false;
        }
        h.decisions += 1;
        h.bytes += bytes;
        let entry = (d.prompt.to_owned(), d.timestamp_ms, unix_ms(), seq);
        match h.by_replica.get_mut(replica) {
            Some(held) => held.push(entry),
            None => {
                h.by_replica.insert(replica.to_owned(), vec![entry]);
            }
        }
        true
    }

    /// The stream sequence of the oldest message a decision is held from, if any: a snapshot
    /// of the tree does not hold those decisions, so it covers the stream only up to the
    /// message before (a router restored from it reads them again and holds them in turn).
    fn oldest_seq(&self) -> Option<u64> {
        let h = sync::lock(&self.inner);
        h.by_replica.values().flatten().map(|e| e.3).min()
    }

    /// The stream was replaced (sequences count from 1 again): what is held came from the old
    /// one, whose sequences say nothing about the new stream's, so they count as 0 (the
    /// oldest possible) until they are released or expire.
    fn stream_reset(&self) {
        let mut h = sync::lock(&self.inner);
        for e in h.by_replica.values_mut().flatten() {
            e.3 = 0;
        }
    }

    /// Applies the held decisions of every replica the router now has.
    fn release(&self, router: &PrefixAffinityRouter, counters: &Counters, hold_for: Duration) {
        let mut h = sync::lock(&self.inner);
        if h.decisions == 0 {
            counters.held.store(0, Ordering::Relaxed);
            return;
        }
        // Drop what was held too long (each list is in the order held, so sorted by it).
        let cutoff =
            unix_ms().saturating_sub(u64::try_from(hold_for.as_millis()).unwrap_or(u64::MAX));
        let (mut dropped, mut freed) = (0, 0);
        h.by_replica.retain(|name, list| {
            let stale = list.partition_point(|&(_, _, held, _)| held < cutoff);
            dropped += stale;
            freed += list[..stale]
                .iter()
                .map(|(p, ..)| p.len() + name.len())
                .sum::<usize>();
            list.drain(..stale);
            !list.is_empty()
        });
        h.decisions -= dropped;
        h.bytes -= freed;
        add(&counters.unknown, dropped as u64);
        let ready: Vec<(ReplicaId, String)> = h
            .by_replica
            .keys()
            .filter_map(|name| router.replica(name).map(|id| (id, name.clone())))
            .collect();
        for (id, name) in ready {
            let Some(list) = h.by_replica.remove(&name) else {
                continue;
            };
            h.decisions -= list.len();
            h.bytes -= list
                .iter()
                .map(|(p, ..)| p.len() + name.len())
                .sum::<usize>();
            let clock = PeerClock::new(router.tree());
            let mut applied = 0;
            for (prompt, at_ms, ..) in &list {
                if clock.insert(id, prompt, *at_ms) {
                    applied += 1;
                } else {
                    add(&counters.unknown, 1);
                }
            }
            add(&counters.applied_decisions, applied);
        }
        counters.held.store(h.decisions as u64, Ordering::Relaxed);
    }
}

/// A [`PrefixAffinityRouter`] whose routing history is shared with its peers over NATS
/// JetStream (see [`crate::dist`]).
///
/// [`route`](Self::route) routes on the local tree exactly as the plain router does, then
/// queues the decision (prompt, replica name, time) for publishing — never blocking: a full
/// buffer drops the decision and counts it. A background task publishes batches to
/// [`NatsConfig::routes_subject`] and applies every peer's batches to the local tree
/// (skipping its own). With NATS unreachable, routing goes on over local state; publishing
/// resumes and the applier catches up from the stream once it is back.
pub struct SharedRouter {
    router: Arc<PrefixAffinityRouter>,
    tx: mpsc::Sender<Decision>,
    counters: Arc<Counters>,
    link: Arc<Link>,
    client: async_nats::Client,
    cfg: SharedConfig,
    id: u64,
    incarnation: u64,
    held: Arc<Held>,
    attached: Arc<Mutex<Option<String>>>,
    bg: Background,
}

impl std::fmt::Debug for SharedRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRouter")
            .field("id", &self.id)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl SharedRouter {
    /// Starts a shared router: loads the newest tree snapshot if
    /// [`SharedConfig::warm_start`] (waiting at most [`SharedConfig::warm_timeout`]), builds
    /// the router over it (or over an empty tree), and starts publishing and applying from
    /// the sequence after the one the snapshot covers.
    ///
    /// If the first attempt to reach a server (each of [`NatsConfig`]'s servers in turn)
    /// fails, the router starts cold at once instead of waiting out the timeout: the skipped
    /// warm start counts in [`SharedStats::snapshot_errors`], and once a server answers the
    /// router catches up on the stream (merging the newest snapshot if it is more than
    /// [`SharedConfig::max_lag`] behind).
    ///
    /// # Errors
    ///
    /// [`DistError::Config`] or [`DistError::Router`] for a bad configuration,
    /// [`DistError::Connect`] for an invalid address; an unreachable server is not an error.
    pub fn start(config: PrefixAffinityConfig, cfg: SharedConfig) -> Result<Self, DistError> {
        cfg.validate()?;
        config.validate().map_err(DistError::Router)?;
        let retention = cfg.nats.retention;
        let incarnation = new_id();
        let id = cfg.router_id.unwrap_or(incarnation);
        let counters = Arc::new(Counters::default());
        let held = Arc::new(Held::default());
        let attached = Arc::new(Mutex::new(None));
        let link = Arc::new(Link::default());
        let (tx, rx) = mpsc::channel(cfg.buffer_decisions);
        type Ready = Result<(async_nats::Client, Option<(PrefixTree, u64)>), DistError>;
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Ready>(1);
        let (router_tx, router_rx) = oneshot::channel::<Arc<PrefixAffinityRouter>>();
        let task = {
            let (cfg, counters, link) = (cfg.clone(), counters.clone(), link.clone());
            let (held, attached) = (held.clone(), attached.clone());
            move |mut shutdown: Shutdown| async move {
                let client = match connect(&cfg.nats, link.clone()).await {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let js = jetstream(&cfg.nats, client.clone());
                let mut warm = None;
                if cfg.warm_start {
                    let t0 = Instant::now();
                    let mut unreadable = Unreadable::default();
                    let load = load_latest::<PrefixTree>(
                        &js,
                        &cfg.nats,
                        cfg.max_snapshot_bytes,
                        &mut unreadable,
                    );
                    // No server reachable: start cold at once rather than after the timeout
                    // (the applier replays the stream, or merges the newest snapshot if it is
                    // far behind, once a server answers).
                    let loaded = tokio::select! {
                        l = tokio::time::timeout(cfg.warm_timeout, load) => Some(l),
                        () = link.unreachable_at_start() => None,
                    };
                    // Newer snapshots passed over count as errors, whatever was loaded.
                    counters.unreadable(&unreadable, "warm start");
                    match loaded {
                        None => counters.snapshot_failed(
                            "warm start",
                            "skipped: no server was reachable (starting cold)",
                        ),
                        Some(Ok(Ok(Some((tree, info))))) => {
                            counters.warm_seq.store(info.seq, Ordering::Relaxed);
                            counters.applied_seq.store(info.seq, Ordering::Relaxed);
                            // The stream that sequence counts: a stream replaced before the
                            // applier attaches is then recognised as new.
                            *sync::lock(&attached) = Some(info.stream.clone());
                            let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
                            counters.warm_us.store(us, Ordering::Relaxed);
                            // (Its clock already counts the time since the snapshot was
                            // written: `load_latest`.)
                            warm = Some((tree, info.seq));
                        }
                        Some(Ok(Ok(None))) => {}
                        // (every snapshot tried failing is counted already)
                        Some(Ok(Err(_))) if unreadable.count > 0 => {}
                        Some(Ok(Err(e))) => counters.snapshot_failed("warm start", e),
                        Some(Err(_)) => {
                            let t = cfg.warm_timeout;
                            counters.snapshot_failed(
                                "warm start",
                                format_args!("timed out after {t:?}"),
                            );
                        }
                    }
                }
                let _ = ready_tx.send(Ok((client, warm)));
                let router = tokio::select! {
                    r = router_rx => match r { Ok(r) => r, Err(_) => return },
                    _ = shutdown.wait() => return,
                };
                let ctx = Ctx {
                    cfg,
                    id,
                    incarnation,
                    router,
                    counters,
                    held,
                    attached,
                    js,
                };
                tokio::join!(
                    publisher(&ctx, rx, shutdown.clone()),
                    applier(&ctx, shutdown.clone()),
                    snapshotter(&ctx, shutdown.clone()),
                );
            }
        };
        let bg = Background::start("kvtrie-shared-router", task)?;
        let (client, warm) = match ready_rx.recv() {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(DistError::Runtime("the router thread exited".into())),
        };
        let tree = match warm {
            Some((tree, _)) => tree,
            None => {
                // A new tree's clock starts at the stream's retention (at most about 35 years,
                // so the clock never nears its end), so that the peers' decisions it replays
                // (at most that old) keep their ages below its now instead of all counting as
                // time 0.
                let mut tree = PrefixTree::new();
                let ms = u64::try_from(retention.as_millis()).unwrap_or(u64::MAX);
                tree.advance_clock(ms.min(1 << 40));
                tree
            }
        };
        let router = Arc::new(PrefixAffinityRouter::with_tree(Arc::new(tree), config));
        let _ = router_tx.send(router.clone());
        Ok(Self {
            router,
            tx,
            counters,
            link,
            client,
            cfg,
            id,
            incarnation,
            held,
            attached,
            bg,
        })
    }

    /// The local router (its tree holds this router's decisions and the peers' applied ones).
    pub fn router(&self) -> &Arc<PrefixAffinityRouter> {
        &self.router
    }

    /// This router's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// [`PrefixAffinityRouter::update_replicas`], then applies the peers' decisions held
    /// back for the replicas it added (a router that read the stream before its replicas
    /// were registered, or a replica a peer knew first). Replicas added through
    /// [`Self::router`] directly get theirs when the next peer batch arrives.
    ///
    /// # Panics
    ///
    /// As [`PrefixAffinityRouter::update_replicas`]; [`Self::try_update_replicas`] returns an
    /// error instead.
    pub fn update_replicas(&self, names: &[&str]) -> Vec<ReplicaId> {
        match self.try_update_replicas(names) {
            Ok(ids) => ids,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::update_replicas`], or the error of
    /// [`PrefixAffinityRouter::try_update_replicas`] (the replica set is then as it was).
    pub fn try_update_replicas(&self, names: &[&str]) -> Result<Vec<ReplicaId>, TreeError> {
        let ids = self.router.try_update_replicas(names)?;
        self.held
            .release(&self.router, &self.counters, self.cfg.hold_for);
        Ok(ids)
    }

    /// [`PrefixAffinityRouter::try_add_replica`], then applies the peers' decisions held
    /// back for it.
    pub fn try_add_replica(&self, name: &str) -> Result<ReplicaId, TreeError> {
        let id = self.router.try_add_replica(name)?;
        self.held
            .release(&self.router, &self.counters, self.cfg.hold_for);
        Ok(id)
    }

    /// Routes `prompt` with the local router, then shares the decision (never blocks).
    ///
    /// # Errors
    ///
    /// As [`PrefixAffinityRouter::route`].
    pub fn route(&self, prompt: &str, candidates: &[Candidate]) -> Result<Route, RouteError> {
        let r = self.router.route(prompt, candidates)?;
        self.record(prompt, r.replica);
        Ok(r)
    }

    /// Shares a decision made elsewhere (e.g. routed with [`Self::router`] directly):
    /// `prompt` went to `replica`. Returns `false` if it was dropped (buffer full) or the
    /// replica is unknown. Never blocks.
    pub fn record(&self, prompt: &str, replica: ReplicaId) -> bool {
        let Some(name) = self.router.replica_name(replica) else {
            return false;
        };
        let prompt = truncate_str(prompt, self.cfg.max_prompt_bytes);
        let bytes = (prompt.len() + name.len()) as u64;
        let c = &self.counters;
        let before = c.buffered_bytes.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > self.cfg.buffer_bytes as u64 {
            c.buffered_bytes.fetch_sub(bytes, Ordering::Relaxed);
            add(&c.dropped, 1);
            return false;
        }
        let d = Decision {
            prompt: prompt.to_owned(),
            replica: name.to_string(),
            timestamp_ms: unix_ms(),
        };
        match self.tx.try_send(d) {
            Ok(()) => {
                add(&c.recorded, 1);
                true
            }
            Err(_) => {
                c.buffered_bytes.fetch_sub(bytes, Ordering::Relaxed);
                add(&c.dropped, 1);
                false
            }
        }
    }

    /// Waits until every recorded decision is acknowledged by the stream (or refused by the
    /// server as too large, see [`SharedStats::refused_decisions`]), at most `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        let c = &self.counters;
        poll_until(&self.bg, timeout, || {
            get(&c.published) + get(&c.refused) >= get(&c.recorded)
        })
    }

    /// The last sequence of the routes stream (0 if empty), asked of the server (at most
    /// `timeout`; `None` if it cannot be reached).
    pub fn stream_last_seq(&self, timeout: Duration) -> Option<u64> {
        let (nats, client) = (self.cfg.nats.clone(), self.client.clone());
        self.bg
            .run(timeout, async move {
                let js = jetstream(&nats, client);
                let (_, last) = stream_identity(&js, &nats, &nats.routes_stream)
                    .await
                    .ok()?;
                Some(last)
            })
            .flatten()
    }

    /// Waits until this router has applied the routes stream up to `seq`, at most `timeout`.
    pub fn wait_applied(&self, seq: u64, timeout: Duration) -> bool {
        poll_until(&self.bg, timeout, || get(&self.counters.applied_seq) >= seq)
    }

    /// Stores a snapshot of the tree now (blocking, at most `timeout`), tagged with the
    /// sequence applied so far (short of the messages whose decisions are held back for
    /// replicas this router does not have: a router restored from it reads those again).
    ///
    /// # Errors
    ///
    /// The reason the snapshot could not be stored (also counted in
    /// [`SharedStats::snapshot_errors`]).
    pub fn snapshot_now(&self, timeout: Duration) -> Result<SnapshotInfo, String> {
        let client = self.client.clone();
        let (nats, tree, id) = (self.cfg.nats.clone(), self.router.tree().clone(), self.id);
        // The stream first, then the sequence: a reset in between sets the sequence to 0
        // before it names the new stream, so the pair never tags the new stream with an old
        // sequence.
        let stream = sync::lock(&self.attached).clone();
        let seq = covered_seq(&self.counters, &self.held, self.cfg.max_lag);
        let r = match stream {
            None => Err("not attached to the routes stream yet".into()),
            Some(stream) => self
                .bg
                .run(timeout, async move {
                    let js = jetstream(&nats, client);
                    store(&js, &nats, tree, seq, id, &stream).await
                })
                .unwrap_or_else(|| Err("timed out".into())),
        };
        match &r {
            Ok(_) => add(&self.counters.snapshots, 1),
            Err(e) => self.counters.snapshot_failed("snapshot", e),
        }
        r
    }

    /// Whether the background thread still runs: it stops only when this is dropped, so
    /// `false` means it died (a bug: please report it), and nothing is shared any more.
    pub fn running(&self) -> bool {
        self.bg.running()
    }

    /// The last error the shared router met, in words (`None` if none yet): what its
    /// `publish_errors`, `consumer_errors`, `snapshot_errors` and connection `errors` counted
    /// last (e.g. a routes stream of the same name made for other subjects, refused at every
    /// attach). It is kept after the router recovers; compare the counters to see whether it
    /// is still happening.
    pub fn last_error(&self) -> Option<String> {
        LastError::newest(&self.counters.last_error, &self.link.last_error)
    }

    /// The counters.
    pub fn stats(&self) -> SharedStats {
        let c = &self.counters;
        SharedStats {
            link: self.link.stats(),
            router_id: self.id,
            incarnation: self.incarnation,
            recorded: get(&c.recorded),
            published: get(&c.published),
            dropped_decisions: get(&c.dropped),
            published_batches: get(&c.batches),
            publish_errors: get(&c.publish_errors),
            refused_decisions: get(&c.refused),
            applied_seq: get(&c.applied_seq),
            applied_batches: get(&c.applied_batches),
            applied_decisions: get(&c.applied_decisions),
            own_batches: get(&c.own),
            unknown_replicas: get(&c.unknown),
            held_decisions: get(&c.held),
            malformed: get(&c.malformed),
            pending: get(&c.pending),
            last_lag_ms: get(&c.last_lag),
            max_lag_ms: get(&c.max_lag),
            lag_skips: get(&c.lag_skips),
            skipped_messages: get(&c.skipped),
            lost_messages: get(&c.lost),
            refetches: get(&c.refetches),
            consumer_errors: get(&c.consumer_errors),
            stream_resets: get(&c.stream_resets),
            snapshots_written: get(&c.snapshots),
            snapshot_errors: get(&c.snapshot_errors),
            warm_start_seq: get(&c.warm_seq),
            warm_start_us: get(&c.warm_us),
        }
    }
}

/// Batches queued decisions and publishes them, retrying (same message id) until acked.
async fn publisher(ctx: &Ctx, mut rx: mpsc::Receiver<Decision>, mut shutdown: Shutdown) {
    let (cfg, c) = (&ctx.cfg, &ctx.counters);
    let subject = cfg.nats.routes_subject();
    let mut n = 0u64;
    let mut failures = 0usize;
    // The routes stream is known to exist (found or created since the last failure): the
    // first publish of a deployment would otherwise fail on a stream not made yet.
    let mut have_stream = false;
    loop {
        let first = tokio::select! {
            d = rx.recv() => match d { Some(d) => d, None => return },
            _ = shutdown.wait() => return,
        };
        let mut bytes = first.prompt.len() + first.replica.len();
        let mut batch = vec![first];
        let deadline = tokio_deadline(cfg.batch_interval);
        while batch.len() < cfg.batch_max && bytes < cfg.batch_bytes {
            tokio::select! {
                d = rx.recv() => match d {
                    Some(d) => {
                        bytes += d.prompt.len() + d.replica.len();
                        batch.push(d);
                    }
                    None => break,
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        c.buffered_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
        let k = batch.len() as u64;
        let mut payload = Vec::with_capacity(bytes + 16 * batch.len() + 32);
        encode_decisions(
            &DecisionBatch {
                router: ctx.incarnation,
                decisions: batch,
            },
            &mut payload,
        );
        let payload = Bytes::from(payload);
        n += 1;
        // This run's id: a router restarted with the same `router_id` within the stream's
        // duplicate window must not have its first batches taken for its previous run's.
        let msg_id = format!("{:016x}-{n}", ctx.incarnation);
        loop {
            if !have_stream {
                let ensured = ensure_stream(
                    &ctx.js,
                    &cfg.nats,
                    &cfg.nats.routes_stream,
                    cfg.nats.routes_subject(),
                );
                match shutdown.or_stop(ensured).await {
                    None => return,
                    Some(Ok(_)) => have_stream = true,
                    Some(Err(e)) => {
                        add(&c.publish_errors, 1);
                        c.last_error.set("stream", e);
                        if !shutdown.back_off(&mut failures, &cfg.nats).await {
                            return;
                        }
                        continue;
                    }
                }
            }
            let p = Publish::build()
                .payload(payload.clone())
                .message_id(&msg_id);
            let Some(sent) = shutdown
                .or_stop(ctx.js.send_publish(subject.clone(), p))
                .await
            else {
                return;
            };
            let r = match sent {
                Ok(ack) => match shutdown.or_stop(ack).await {
                    Some(r) => r.map(|_| ()).map_err(|e| e.to_string()),
                    None => return,
                },
                Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    // Larger than the server accepts: sending it again would fail forever
                    // and hold up every batch behind it. Drop it and count its decisions.
                    add(&c.publish_errors, 1);
                    add(&c.dropped, k);
                    add(&c.refused, k);
                    c.last_error.set("publish (batch dropped)", e);
                    break;
                }
                Err(e) => Err(e.to_string()),
            };
            match r {
                Ok(()) => {
                    add(&c.published, k);
                    add(&c.batches, 1);
                    failures = 0;
                    break;
                }
                Err(e) => {
                    add(&c.publish_errors, 1);
                    c.last_error.set("publish", e);
                    // The server may have restarted without its store: find or make the
                    // stream again before the next attempt.
                    have_stream = false;
                    if !shutdown.back_off(&mut failures, &cfg.nats).await {
                        return;
                    }
                }
            }
        }
    }
}

/// Applies peers' batches from the routes stream (an ephemeral consumer, recreated from the
/// last applied sequence after any error).
async fn applier(ctx: &Ctx, mut shutdown: Shutdown) {
    let (cfg, c) = (&ctx.cfg, &ctx.counters);
    let mut failures = 0usize;
    // The creation time of the routes stream as last attached (before the first attach: of
    // the stream the warm-start snapshot counts, if there was one).
    let mut created = sync::lock(&ctx.attached).clone();
    // Lag skips in a row that moved nothing on (see below).
    let mut stuck = 0usize;
    // When to ask, while nothing comes, whether deliveries were lost at the end of a burst.
    let mut idle = IdleChecks::new(&ctx.js.client());
    'attach: while !shutdown.requested() {
        let mut applied = get(&c.applied_seq);
        let consumer = async {
            let stream = ensure_stream(
                &ctx.js,
                &cfg.nats,
                &cfg.nats.routes_stream,
                cfg.nats.routes_subject(),
            )
            .await?;
            let info = stream.cached_info();
            let id = stream_id(info);
            if stream_replaced(&id, info.state.last_sequence, created.as_deref(), applied) {
                // A new stream (sequences from 1 again): read it from its start.
                add(&c.stream_resets, 1);
                ctx.held.stream_reset();
                c.applied_seq.store(0, Ordering::Release);
                applied = 0;
            }
            // Acted on (the reset is already in the counters): this is the known stream now,
            // named after the sequence was reset (see `snapshot_now`).
            *sync::lock(&ctx.attached) = Some(id.clone());
            created = Some(id);
            stream
                .create_consumer(pull::Config {
                    ack_policy: AckPolicy::None,
                    deliver_policy: if applied == 0 {
                        DeliverPolicy::All
                    } else {
                        DeliverPolicy::ByStartSequence {
                            start_sequence: applied + 1,
                        }
                    },
                    inactive_threshold: Duration::from_secs(30),
                    memory_storage: true,
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string())
        };
        let Some(consumer) = shutdown.or_stop(consumer).await else {
            break;
        };
        let consumer = match consumer {
            Ok(c) => c,
            Err(e) => {
                add(&c.consumer_errors, 1);
                c.last_error.set("attach", e);
                if !shutdown.back_off(&mut failures, &cfg.nats).await {
                    break;
                }
                continue;
            }
        };
        let msgs = tokio::select! {
            m = pull_in_order(&consumer, cfg.fetch_batch, cfg.fetch_wait) => m,
            _ = shutdown.wait() => break 'attach,
        };
        let msgs = msgs.inspect_err(|e| c.last_error.set("subscribe", e)).ok();
        if let Some(mut msgs) = msgs {
            // The consumer's delivery sequence of the last message (see `jump`).
            let mut delivered = consumer.cached_info().delivered.consumer_sequence;
            idle.attached(delivered);
            loop {
                let m = tokio::select! {
                    m = msgs.next() => m,
                    _ = shutdown.wait() => break 'attach,
                    _ = idle.tick_due() => {
                        let applied = get(&c.applied_seq);
                        let lost = tokio::select! {
                            l = idle.tick(&consumer, applied) => l,
                            _ = shutdown.wait() => break 'attach,
                        };
                        if lost {
                            // Lost in transit with nothing after them: read the stream again
                            // after `applied` (the server never sends them again).
                            add(&c.refetches, 1);
                            continue 'attach;
                        }
                        continue;
                    }
                };
                let m = match m {
                    None => break,
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        c.last_error.set("pull", e);
                        break;
                    }
                };
                failures = 0;
                let Ok(info) = m.info() else {
                    add(&c.malformed, 1);
                    continue;
                };
                let (seq, pending) = (info.stream_sequence, info.pending);
                idle.received(info.consumer_sequence);
                let applied = get(&c.applied_seq);
                if seq <= applied {
                    continue;
                }
                // (as in the KV consumer: only new messages count as the last delivery)
                let last_delivery = core::mem::replace(&mut delivered, info.consumer_sequence);
                match jump(applied, seq, last_delivery, info.consumer_sequence) {
                    // (a cold router's start, `applied == 0`, is not a loss)
                    Some(Jump::Gone(n)) if applied > 0 => add(&c.lost, n),
                    None | Some(Jump::Gone(_)) => {}
                    Some(Jump::InTransit) => {
                        // Without acks the server never sends them again: read the stream
                        // again after `applied`.
                        add(&c.refetches, 1);
                        continue 'attach;
                    }
                }
                c.pending.store(pending, Ordering::Relaxed);
                if pending > cfg.max_lag {
                    if shutdown.or_stop(skip_ahead(ctx, seq)).await.is_none() {
                        break 'attach;
                    }
                    if get(&c.applied_seq) == applied {
                        // Neither a snapshot nor the stream's end could be read: back off
                        // before trying again, longer each time.
                        stuck += 1;
                        let d = backoff(stuck, cfg.nats.reconnect_base, cfg.nats.reconnect_max);
                        if !shutdown.sleep(d).await {
                            break 'attach;
                        }
                    } else {
                        stuck = 0;
                    }
                    // Re-attach after the new applied sequence.
                    continue 'attach;
                }
                apply_batch(ctx, &m.payload, seq);
                c.applied_seq.store(seq, Ordering::Release);
            }
        }
        add(&c.consumer_errors, 1);
        if !shutdown.back_off(&mut failures, &cfg.nats).await {
            break;
        }
    }
}

/// The stream sequence a snapshot of the tree taken now covers: what was applied, short of
/// the messages whose decisions are still held back (not in the tree), but never more than
/// half of `max_lag` short (a decision can be held for `hold_for`, minutes: a tag that far
/// back would leave a router restored from the snapshot, or one that fell behind, more than
/// `max_lag` behind, and it would skip the whole backlog instead; decisions held from further
/// back are not covered, as before they were held). Applied first, then held: a decision is
/// held before its message counts as applied, so one read in between is seen by one or the
/// other.
fn covered_seq(c: &Counters, held: &Held, max_lag: u64) -> u64 {
    // Acquire: pairs with the applier's Release store after the batch (and its holds).
    let seq = c.applied_seq.load(Ordering::Acquire);
    let floor = seq.saturating_sub(max_lag / 2);
    held.oldest_seq()
        .map_or(seq, |oldest| seq.min(oldest.saturating_sub(1)).max(floor))
}

/// Applies one message of the routes stream to the tree.
fn apply_batch(ctx: &Ctx, payload: &[u8], seq: u64) {
    let c = &ctx.counters;
    // Read in place: a decision's replica name is not copied (a hostile batch of many
    // decisions for one long name would otherwise decode to many times its size).
    let batch = match DecisionsView::decode(payload) {
        Ok(b) => b,
        Err(_) => {
            add(&c.malformed, 1);
            return;
        }
    };
    if batch.router == ctx.incarnation {
        add(&c.own, 1);
        return;
    }
    let clock = PeerClock::new(ctx.router.tree());
    // Each name of the batch's table looked up once, when a decision first names it.
    let mut ids: Vec<Option<Option<ReplicaId>>> = vec![None; batch.names.len()];
    let mut applied = 0;
    let mut lag = 0;
    for d in &batch.decisions {
        let replica = batch.names[d.name];
        let id = *ids[d.name].get_or_insert_with(|| ctx.router.replica(replica));
        let Some(id) = id else {
            // Not (yet) a replica here: hold it back until it is one.
            if !ctx.held.hold(replica, d, seq, &ctx.cfg) {
                add(&c.unknown, 1);
            }
            continue;
        };
        lag = lag.max(clock.now_unix.saturating_sub(d.timestamp_ms));
        if clock.insert(id, d.prompt, d.timestamp_ms) {
            applied += 1;
        } else {
            add(&c.unknown, 1);
        }
    }
    // Replicas added since the last batch (or while this one was applied) get the decisions
    // held back for them, and the expired ones go (the gauge is brought up to date).
    ctx.held.release(&ctx.router, c, ctx.cfg.hold_for);
    add(&c.applied_batches, 1);
    add(&c.applied_decisions, applied);
    c.last_lag.store(lag, Ordering::Relaxed);
    c.max_lag.fetch_max(lag, Ordering::Relaxed);
}

/// Peers' decisions inserted into a tree at their age on its clock: a decision made `age` ms
/// ago (Unix time) is inserted `age` ms before the tree's now.
struct PeerClock<'t> {
    tree: &'t PrefixTree,
    now_unix: u64,
    now_tree: u64,
}

impl<'t> PeerClock<'t> {
    fn new(tree: &'t PrefixTree) -> Self {
        Self {
            tree,
            now_unix: unix_ms(),
            now_tree: tree.now(),
        }
    }

    /// Inserts `prompt` for replica `id`, routed at Unix time `at_ms`; whether the tree took
    /// it (not if the replica was removed meanwhile).
    fn insert(&self, id: ReplicaId, prompt: &str, at_ms: u64) -> bool {
        let age = self.now_unix.saturating_sub(at_ms);
        self.tree
            .insert_at(prompt, id.tenant(), self.now_tree.saturating_sub(age))
            .is_ok()
    }
}

/// Too far behind at stream sequence `seq`: merge the newest snapshot if it is ahead of us
/// and continue after it; otherwise skip to the end of the stream.
async fn skip_ahead(ctx: &Ctx, seq: u64) {
    let c = &ctx.counters;
    add(&c.lag_skips, 1);
    let from = seq.saturating_sub(1);
    let mut unreadable = Unreadable::default();
    let loaded = load_latest::<PrefixTree>(
        &ctx.js,
        &ctx.cfg.nats,
        ctx.cfg.max_snapshot_bytes,
        &mut unreadable,
    )
    .await;
    c.unreadable(&unreadable, "lag skip");
    match loaded {
        Ok(Some((snap, info))) if info.seq > from => {
            let dst = ctx.router.tree().clone();
            let merged = tokio::task::spawn_blocking(move || {
                merge_tree(&dst, &snap);
            })
            .await;
            if merged.is_ok() {
                add(&c.skipped, info.seq - from);
                c.applied_seq.store(info.seq, Ordering::Release);
                return;
            }
            c.snapshot_failed("lag skip", "merging the newest snapshot failed");
        }
        Ok(_) => {}
        // (every snapshot tried failing is counted already)
        Err(_) if unreadable.count > 0 => {}
        Err(e) => c.snapshot_failed("lag skip", e),
    }
    // No usable snapshot: drop the backlog.
    let last = stream_identity(&ctx.js, &ctx.cfg.nats, &ctx.cfg.nats.routes_stream).await;
    if let Ok((_, last)) = last {
        if last > from {
            add(&c.skipped, last - from);
            c.applied_seq.store(last, Ordering::Release);
        }
    }
}

/// Stores a snapshot of the tree every `snapshot_interval` (when something changed).
async fn snapshotter(ctx: &Ctx, mut shutdown: Shutdown) {
    let Some(every) = ctx.cfg.snapshot_interval else {
        return;
    };
    let c = &ctx.counters;
    let mut last = (u64::MAX, u64::MAX);
    // The bucket forgets a snapshot after the retention: one is written again at half of it,
    // changed or not, so that a quiet spell longer than the retention does not leave new
    // routers to start cold.
    let refresh = ctx.cfg.nats.retention / 2;
    let mut written: Option<Instant> = None;
    while shutdown.sleep(every.min(refresh / 2)).await {
        // As in `snapshot_now`: the stream, then the sequence.
        let Some(stream) = sync::lock(&ctx.attached).clone() else {
            continue;
        };
        let seq = covered_seq(c, &ctx.held, ctx.cfg.max_lag);
        // Changed since the last snapshot: applied (not the tag, which held decisions can
        // keep still while the tree changes) or published.
        let mark = (get(&c.applied_seq), get(&c.published));
        let age = written.map(|w| w.elapsed());
        let changed = mark != last && age.is_none_or(|a| a >= every);
        if !changed && age.is_none_or(|a| a < refresh) {
            continue;
        }
        let tree = ctx.router.tree().clone();
        let stored = store(&ctx.js, &ctx.cfg.nats, tree, seq, ctx.id, &stream);
        let Some(stored) = shutdown.or_stop(stored).await else {
            return;
        };
        match stored {
            Ok(_) => {
                add(&c.snapshots, 1);
                last = mark;
                written = Some(Instant::now());
            }
            Err(e) => c.snapshot_failed("snapshot", e),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn decision() -> DecisionRef<'static> {
        DecisionRef {
            name: 0,
            prompt: "p",
            timestamp_ms: 1,
        }
    }

    /// A snapshot covers the stream up to the oldest held message, but never more than half of
    /// `max_lag` back; after a stream reset, held decisions count as the oldest possible.
    #[test]
    fn covered_sequence_stops_before_held_decisions_within_half_the_lag() {
        let (c, held) = (Counters::default(), Held::default());
        let cfg = SharedConfig::new(NatsConfig::new("nats://127.0.0.1:4222"));
        c.applied_seq.store(100, Ordering::Release);
        assert_eq!(covered_seq(&c, &held, 10_000), 100);
        assert!(held.hold("r9", &decision(), 70, &cfg));
        assert!(held.hold("r8", &decision(), 60, &cfg));
        assert!(held.hold("r9", &decision(), 50, &cfg));
        assert_eq!(covered_seq(&c, &held, 10_000), 49);
        assert_eq!(covered_seq(&c, &held, 20), 90);
        held.stream_reset();
        c.applied_seq.store(7, Ordering::Release);
        assert_eq!(covered_seq(&c, &held, 10_000), 0);
        assert_eq!(covered_seq(&c, &held, 4), 5);
    }
}
