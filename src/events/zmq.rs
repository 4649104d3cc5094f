//! Live vLLM KV-event subscriber over ZeroMQ (feature `zmq`).
//!
//! A vLLM engine started with `--kv-events-config '{"enable_kv_cache_events": true,
//! "publisher": "zmq", ...}'` binds a **PUB** socket that sends every `KVEventBatch` as three
//! frames `[topic, seq (8-byte big-endian), payload (msgpack)]`, `seq` counting batches from 0
//! per publisher, and optionally a **ROUTER** "replay" socket that answers a `start_seq`
//! (8-byte BE) with every buffered `[topic, seq, payload]` from there on, closed by
//! `seq = 0xFFFF_FFFF_FFFF_FFFF` and an empty payload (vLLM releases before its PR #45177
//! answer without the topic frame: both forms are read).
//!
//! [`Subscriber::try_spawn`] checks every [`EngineConfig`] (endpoints, names, decoder
//! settings) and then runs one background thread per engine that connects a SUB socket,
//! decodes each payload with a stateful [`Decoder`] and applies the events, in order, to a
//! shared [`BlockIndex`]. An invalid configuration is an error before anything starts
//! ([`SpawnError`]). Sequence numbers, never timing, are the truth:
//!
//! * **Gaps.** A batch whose `seq` is not `last + 1` is a gap (the SUB socket dropped batches:
//!   high-water mark, reconnect, slow start). With a replay endpoint, the thread asks it for
//!   everything from `last + 1`, applies the replayed batches in `last + 1 .. seq` in order,
//!   skipping any already applied, then applies the live batch and carries on. Batches the
//!   replay buffer no longer holds (or every batch of the gap when there is no replay endpoint,
//!   or the replay failed [`REPLAY_ATTEMPTS`] times in a row without bringing a batch) are
//!   counted in [`EngineStats::lost`]; the index then misses those changes until the engine
//!   stores or removes the blocks again. An answer that jumps after it has brought the next
//!   batch lost the rest in transit (vLLM's replay ROUTER drops what exceeds its send limit,
//!   1,000 messages by default): the thread asks again from where the answer stopped.
//! * **First batch.** If the first `seq` seen is above 0 and a replay endpoint exists, the
//!   thread first replays `0 .. seq` ([`EngineConfig::with_initial_replay`], on by default):
//!   a router started after the engine, or a SUB socket that joined late (the PUB/SUB
//!   "slow joiner"), still learns the blocks stored before it joined, as far as the engine's
//!   replay buffer reaches back. Those batches are counted in [`EngineStats::caught_up`], not
//!   in [`EngineStats::replayed`] (which is for gaps only) and the first batch is not a gap.
//! * **An idle engine.** An engine that publishes nothing after the subscription (idle when
//!   the router starts, or after its restart was recognized) sends no first batch. So once
//!   the connection has been quiet for [`START_AFTER`] (2 s) with no batch received, the
//!   thread asks the replay endpoint for everything from seq 0 itself (with the initial
//!   replay on): what it brings is caught up and starts the sequence, and a live batch that
//!   repeats one of those batches (published while the answer was under way) is recognized
//!   by its contents and skipped. An empty answer leaves it to the first live batch; a
//!   failed one is asked again after more quiet, three times at most (without a socket
//!   monitor the quiet is counted from the socket's creation, connected or not).
//! * **Implausible jumps.** A `seq` more than [`EngineConfig::max_seq_jump`] ahead of the next
//!   expected one is not believed on its own (a corrupted or forged frame would otherwise
//!   record a loss of 10¹² batches and make every later batch look like a restart): the batch
//!   is held back. If the next batches continue it (`seq + 1`, `seq + 2`, [`RESYNC_AFTER`]
//!   batches in all), the jump was real and is handled as a gap; if a batch with the expected
//!   `seq` comes first, the held batches are dropped and counted in
//!   [`EngineStats::implausible_seqs`], and nothing else changes.
//! * **Engine restarts.** A restarted publisher counts from 0 again with an empty cache. The
//!   thread recognizes it when `seq` goes *below* the next expected one, or — when a restart
//!   outran the old counter while the socket was reconnecting — when a gap's replay answers
//!   the last batch it applied with different contents (it remembers a fingerprint of that
//!   batch and asks the replay endpoint from there). Either way the old epoch ends once: the
//!   thread drops every block (all tiers) of every worker it has fed, resets its decoder,
//!   counts [`EngineStats::restarts`] (not a gap) and starts the new epoch: with a replay
//!   endpoint it re-creates the SUB socket (whose queue may still hold old-epoch batches, even
//!   interleaved with new ones by libzmq's fair queuing across the old and new connection) and
//!   catches up from seq 0 with the initial replay at the first batch it receives (or, with
//!   the initial replay on, after [`START_AFTER`] of quiet, which brings the batch that
//!   revealed the restart); without one
//!   it applies the batch as the new epoch's first. Batches of the new epoch before its first
//!   one received that are not caught up count as [`EngineStats::lost`] (the thread was
//!   subscribed when they were published).
//! * **Restarts that land on the expected `seq`.** A restart can also bring, as the first
//!   batch after the socket reconnected, exactly the `seq` expected next (the new epoch's
//!   earlier batches published while the socket reconnected). The socket monitor sees the
//!   connection drop and come back, so from then on the batches that continue the sequence
//!   are checked the same way, by asking the replay endpoint for the batch applied last,
//!   until a check (or a gap's replay) finds it as it was; a check that cannot tell (the
//!   replay does not hold that batch, or does not answer) counts, and after three such checks
//!   the batches are taken as continuations. Batches still queued from the old connection
//!   are applied unchecked while the connection is down. Without a replay endpoint (or a
//!   socket monitor) only a `seq` going backwards reveals a restart.
//! * **Batches published while the connection was down, then quiet.** The batches an engine
//!   published while the socket was reconnecting never reach it, and when the engine then
//!   publishes nothing, no later batch reveals the gap. So once the new connection has been
//!   quiet for [`TAIL_AFTER`] (500 ms) since the reconnection the socket monitor saw (or
//!   since the last batch received), the thread asks the replay endpoint for everything from
//!   the batch applied last: if the publisher still holds that batch unchanged, the batches
//!   after it are applied (counted in [`EngineStats::replayed`]); a changed one is a restart;
//!   a replay that cannot tell is asked again after more quiet, three times at most. A batch
//!   of that tail that the new connection brings again (published while the replay was
//!   answered) is recognized by its contents and skipped, not taken for a restart. This needs
//!   a replay endpoint and the socket monitor.
//! * **Malformed messages** (not 3 frames, a `seq` frame that is not 8 bytes) and payloads
//!   that fail to decode count as [`EngineStats::decode_errors`] and never panic. A payload
//!   that fails to decode still consumes its (valid) `seq`, so it is not replayed again.
//! * **Malformed events** (whole msgpack, but a value out of range, a token count that does not
//!   match the blocks: see the decoder's *Malformed events*) are dropped alone and count as
//!   [`EngineStats::malformed_events`], with the first one's reason in
//!   [`EngineStats::last_error`]; the rest of their batch applies.
//! * **Events the index rejects** (a `BlockStored` whose parent it does not hold) count as
//!   [`EngineStats::apply_errors`]; the rest of the batch is applied.
//!
//! # Workers and data-parallel ranks
//!
//! vLLM's data-parallel ranks each publish on their own port (the endpoint's port offset by
//! the rank) with their own `seq`, so the usual setup is one [`EngineConfig`] per rank. By
//! default ([`WorkerMapping::PerRank`]) a batch goes to `WorkerId::new(engine, rank)`, the
//! engine taken from [`EngineConfig::worker`] and the rank from the batch's
//! `data_parallel_rank`: every rank is a worker of its own, as its cache is. The old "one
//! worker per engine" mapping is [`WorkerMapping::Fixed`]; [`WorkerMapping::AddRank`] and
//! [`WorkerMapping::Custom`] cover other numbering schemes. Where engines of one
//! [`Subscriber`] may share a worker (`Fixed` with one configuration per rank, `Custom`), each
//! keeps a ledger of the copies it stored: its `AllBlocksCleared` or restart takes away only
//! those, and its `BlockRemoved` only removes hashes it holds a copy of (a removal of a block
//! whose store this engine lost or never sent leaves the other engines' copies). Engines of
//! different subscribers that feed one worker keep ledgers only when told
//! ([`EngineConfig::with_shared_worker`]).
//!
//! With [`DuplicateStores::Reports`] set on the index (engines that report reused blocks), an
//! engine that keeps a ledger treats a GPU store of a block its ledger holds as a report, and
//! any other as its own copy beside the other engines' copies: each engine's copy counts once.
//!
//! # Tiers and attention kinds
//!
//! Each event is applied in the storage tier its `medium` names
//! ([`BlockIndex::apply_in`], [`crate::blocks::Tier::from_medium`]); the decoder indexes the
//! full-attention KV-cache kinds and skips the others (counted in
//! [`EngineStats::skipped_events`]).
//!
//! # Threads, stop and reconnects
//!
//! Every socket has a receive timeout of [`POLL_INTERVAL`] (50 ms), so a thread notices
//! [`Subscriber::stop`] (or `Drop`) within about that long, even in the middle of a replay.
//! libzmq reconnects a connected socket by itself when its peer goes away and comes back
//! (SUB: retry interval 100 ms, backing off exponentially to 5 s); a socket that fails
//! outright (creation, a receive error other than a timeout) is closed and re-created after
//! an exponential backoff (100 ms doubling to 5 s), counted in [`EngineStats::reconnects`],
//! with the error in [`EngineStats::last_error`]. The replay DEALER socket is kept between
//! gaps and re-created after a failed replay.
//!
//! # Connection state
//!
//! libzmq's `connect` never fails for an endpoint where nothing listens: it retries in the
//! background. To make that visible, the SUB socket runs a libzmq **socket monitor**
//! (`zmq_socket_monitor` over an `inproc` PAIR socket, read between receives): its
//! `CONNECTED`/`HANDSHAKE_SUCCEEDED`, `DISCONNECTED` and `CONNECT_RETRIED` events set
//! [`EngineStats::connected`] and count [`EngineStats::disconnects`] and
//! [`EngineStats::connect_retries`]. When the socket has not connected within
//! [`EngineConfig::connect_timeout`] (default 5 s) of its creation or of its last
//! disconnection, the thread counts [`EngineStats::connect_timeouts`] and sets
//! [`EngineStats::last_error`] to say so (once per disconnected period; it keeps retrying).
//!
//! # Why the `zmq` crate (libzmq) and not the pure-Rust `zeromq` crate
//!
//! Both were tried here (SUB from PUB and DEALER to ROUTER on loopback; both work):
//!
//! * **Build / CI.** `zmq` 0.10 builds its own libzmq 4.3 from vendored sources
//!   (`zmq-sys` → `zeromq-src`, no `libzmq3-dev`, no `pkg-config`, no cmake): the only
//!   requirement is a C++ compiler, which the Rust image has (`build-essential`). It costs a
//!   one-time ~80 s C++ compile on 2 cores. `zeromq` compiles in ~30 s but pulls ~110 crates
//!   (tokio, futures, ...) into the tree.
//! * **Blocking vs async.** The subscriber is a few long-lived threads doing blocking receives
//!   with a timeout: exactly libzmq's model (`ZMQ_RCVTIMEO`). `zeromq` is async only; it would
//!   need a tokio runtime per subscriber and timeouts wrapped around every receive.
//! * **Reconnects.** libzmq's `connect` never blocks and reconnects in the background with
//!   backoff — the same library vLLM's pyzmq publisher runs on. With `zeromq` 0.6, `connect`
//!   to an endpoint that is not bound yet blocked (we saw it hang for as long as we waited),
//!   so a router started before its engines would stall.
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvtrie::blocks::{BlockIndex, WorkerId};
//! use kvtrie::events::vllm::DecodeConfig;
//! use kvtrie::events::zmq::{EngineConfig, Subscriber};
//!
//! let index = Arc::new(BlockIndex::new());
//! let engine = EngineConfig::new("tcp://10.0.0.5:5557", WorkerId(1), DecodeConfig::new(16))
//!     .with_replay("tcp://10.0.0.5:5558");
//! let subscriber = Subscriber::try_spawn(Arc::clone(&index), vec![engine])?;
//! // ... route with `index.find_matches(...)` ...
//! for s in subscriber.stats() {
//!     println!("{}: {} batches, {} gaps, last seq {:?}", s.name, s.batches, s.gaps, s.last_seq);
//! }
//! subscriber.stop();
//! # Ok::<(), kvtrie::events::zmq::SpawnError>(())
//! ```

use crate::sync::os::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::os::{lock, thread, JoinHandle, Mutex};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64;

use crate::blocks::{
    BlockIndex, DuplicateStores, EventError, KvEvent, StoredBlock, Tier, WorkerId,
};
use crate::events::vllm::{DecodeConfig, Decoder};

/// Receive timeout of every socket: how long a thread may take to notice a stop request.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The `seq` that ends a replay answer.
pub const END_OF_REPLAY: u64 = u64::MAX;

/// How many times a gap's replay is attempted before its batches are counted as lost.
pub const REPLAY_ATTEMPTS: u32 = 3;

/// First delay before re-creating a failed socket or retrying a replay; doubles up to
/// [`MAX_BACKOFF`].
pub const MIN_BACKOFF: Duration = Duration::from_millis(100);

/// Longest delay between socket re-creations or replay attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Default SUB receive high-water mark (messages): how many batches libzmq queues while the
/// thread is busy (e.g. replaying) before it drops some (which then shows up as a gap).
pub const DEFAULT_RCVHWM: i32 = 100_000;

/// Default [`EngineConfig::max_seq_jump`]: 2²⁰ batches (vLLM publishes about one batch per
/// scheduler step, so this is hours of traffic, and 100 times vLLM's default replay buffer).
pub const DEFAULT_MAX_SEQ_JUMP: u64 = 1 << 20;

/// Consecutive batches that must continue an implausible jump before it is believed.
pub const RESYNC_AFTER: usize = 3;

/// Default [`EngineConfig::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a batch's `data_parallel_rank` chooses the worker its events are applied to.
#[derive(Clone, Default)]
pub enum WorkerMapping {
    /// Each data-parallel rank is a worker of its own (the default): `WorkerId::new(engine,
    /// rank)` with the engine of [`EngineConfig::worker`] (a missing or `nil` rank is that
    /// worker's own rank; ranks above 65535 are 65535). A rank's KV cache is its own, so the
    /// index and the router see — and select — ranks, not engines.
    #[default]
    PerRank,
    /// Every batch goes to [`EngineConfig::worker`], whatever its rank: one worker per engine
    /// (the ranks' caches merged; a block held by two ranks is two copies).
    ///
    /// When several engines of one [`Subscriber`] (one per rank, say) share an engine id
    /// and one of them maps this way, each keeps a ledger of the copies it stored (a hash map
    /// entry per block, about 40 bytes), so that its `AllBlocksCleared`, its restart and its
    /// `BlockRemoved` take away its own copies and leave the other engines' blocks of the
    /// worker. A subscriber cannot see other subscribers' engines: engines feeding one worker
    /// from two subscribers keep a ledger only when configured with
    /// [`EngineConfig::with_shared_worker`] (else one's restart clears the worker).
    Fixed,
    /// `WorkerId(worker.0 + rank)` (a missing or `nil` rank counts as 0; wraps on overflow).
    /// Give such engines worker ids far enough apart that their ranges do not overlap.
    AddRank,
    /// A user callback `(engine worker, rank) -> worker`, called once per batch. Workers may
    /// be shared, so every engine of a subscriber with such a mapping keeps a ledger of its
    /// copies (as with [`Self::Fixed`]).
    Custom(Arc<dyn Fn(WorkerId, Option<u32>) -> WorkerId + Send + Sync>),
}

impl WorkerMapping {
    /// The worker for a batch with this rank from an engine configured as `worker`.
    ///
    /// ```
    /// use kvtrie::blocks::WorkerId;
    /// use kvtrie::events::zmq::WorkerMapping;
    /// assert_eq!(WorkerMapping::default().map(WorkerId(5), Some(3)), WorkerId::new(5, 3));
    /// assert_eq!(WorkerMapping::Fixed.map(WorkerId(5), Some(3)), WorkerId(5));
    /// ```
    pub fn map(&self, worker: WorkerId, rank: Option<u32>) -> WorkerId {
        match self {
            WorkerMapping::PerRank => WorkerId::new(
                worker.engine(),
                rank.map_or(worker.dp_rank(), |r| u16::try_from(r).unwrap_or(u16::MAX)),
            ),
            WorkerMapping::Fixed => worker,
            WorkerMapping::AddRank => WorkerId(worker.0.wrapping_add(u64::from(rank.unwrap_or(0)))),
            WorkerMapping::Custom(f) => f(worker, rank),
        }
    }
}

impl fmt::Debug for WorkerMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerMapping::PerRank => f.write_str("PerRank"),
            WorkerMapping::Fixed => f.write_str("Fixed"),
            WorkerMapping::AddRank => f.write_str("AddRank"),
            WorkerMapping::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// One engine (one vLLM publisher) to subscribe to.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Label in [`EngineStats::name`] and the thread name (default: the PUB endpoint).
    pub name: String,
    /// The engine's PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub pub_endpoint: String,
    /// The engine's replay ROUTER endpoint, if it has one, e.g. `tcp://10.0.0.5:5558`.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (`""`, vLLM's default, = every batch).
    pub topic: String,
    /// The worker this engine's events are applied to (see [`WorkerMapping`]).
    pub worker: WorkerId,
    /// How `data_parallel_rank` maps to a worker (default [`WorkerMapping::PerRank`]).
    pub mapping: WorkerMapping,
    /// Decoder settings (router block size, namespace, engine block size).
    pub decode: DecodeConfig,
    /// Replay `0 .. first seq` when the first batch seen has `seq > 0` (default `true`).
    pub initial_replay: bool,
    /// SUB receive high-water mark in messages (default [`DEFAULT_RCVHWM`]; 0 = unbounded).
    pub rcvhwm: i32,
    /// Give up on one replay answer when no frame arrives for this long (default 2 s).
    pub replay_timeout: Duration,
    /// A `seq` more than this far ahead of the next expected one is implausible (see the
    /// module docs; default [`DEFAULT_MAX_SEQ_JUMP`], at least 1).
    pub max_seq_jump: u64,
    /// Report the PUB endpoint in [`EngineStats::last_error`] and
    /// [`EngineStats::connect_timeouts`] when the SUB socket has not connected for this long
    /// (default [`DEFAULT_CONNECT_TIMEOUT`]).
    pub connect_timeout: Duration,
    /// Keep a ledger of this engine's copies whatever the other engines of its subscriber are
    /// (default `false`; see [`Self::with_shared_worker`]).
    pub shared_worker: bool,
}

impl EngineConfig {
    /// An engine publishing on `pub_endpoint`, applied to `worker`, decoded with `decode`; no
    /// replay endpoint, topic `""`.
    pub fn new(pub_endpoint: impl Into<String>, worker: WorkerId, decode: DecodeConfig) -> Self {
        let pub_endpoint = pub_endpoint.into();
        EngineConfig {
            name: pub_endpoint.clone(),
            pub_endpoint,
            replay_endpoint: None,
            topic: String::new(),
            worker,
            mapping: WorkerMapping::PerRank,
            decode,
            initial_replay: true,
            rcvhwm: DEFAULT_RCVHWM,
            replay_timeout: Duration::from_secs(2),
            max_seq_jump: DEFAULT_MAX_SEQ_JUMP,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            shared_worker: false,
        }
    }

    /// Whether another engine may feed this engine's worker from outside its [`Subscriber`]
    /// (say, one subscriber per data-parallel rank, every rank mapped to one worker). Such
    /// an engine keeps a ledger of the copies it stored, about 40 bytes per block, so that its
    /// `AllBlocksCleared`, restart and `BlockRemoved` take away only its own copies; set it
    /// on every engine that feeds the shared worker. Engines of one subscriber that may share
    /// a worker keep ledgers without it (see [`WorkerMapping::Fixed`]).
    ///
    /// ```
    /// use kvtrie::blocks::WorkerId;
    /// use kvtrie::events::vllm::DecodeConfig;
    /// use kvtrie::events::zmq::{EngineConfig, WorkerMapping};
    /// let rank1 = EngineConfig::new("tcp://10.0.0.5:5558", WorkerId(5), DecodeConfig::new(16))
    ///     .with_mapping(WorkerMapping::Fixed)
    ///     .with_shared_worker(true);
    /// assert!(rank1.shared_worker);
    /// ```
    pub fn with_shared_worker(mut self, on: bool) -> Self {
        self.shared_worker = on;
        self
    }

    /// Use this replay ROUTER endpoint to fill gaps.
    pub fn with_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// Subscribe to this topic prefix only.
    pub fn with_topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Set the label used in stats and the thread name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Set how `data_parallel_rank` maps to a worker.
    pub fn with_mapping(mut self, mapping: WorkerMapping) -> Self {
        self.mapping = mapping;
        self
    }

    /// Whether to replay `0 .. first seq` when the first batch seen has `seq > 0`, or from 0
    /// after [`START_AFTER`] of quiet when no batch comes (see the module docs).
    pub fn with_initial_replay(mut self, on: bool) -> Self {
        self.initial_replay = on;
        self
    }

    /// Set the SUB receive high-water mark (messages; 0 = unbounded).
    pub fn with_rcvhwm(mut self, hwm: i32) -> Self {
        self.rcvhwm = hwm;
        self
    }

    /// Set how long a replay may go without receiving a frame before it is abandoned.
    pub fn with_replay_timeout(mut self, timeout: Duration) -> Self {
        self.replay_timeout = timeout;
        self
    }

    /// Set how far ahead of the expected `seq` a batch may jump before it is held back as
    /// implausible (see the module docs).
    pub fn with_max_seq_jump(mut self, max: u64) -> Self {
        self.max_seq_jump = max;
        self
    }

    /// Set how long the SUB socket may stay unconnected before it is reported.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Checks this configuration: names and endpoints without NUL bytes, endpoints that
    /// libzmq accepts and that can reach an engine (not `udp://` or `inproc://`; for `tcp://`,
    /// `ws://` and `wss://` also a host and a port in `1..=65535`; transports that libzmq has
    /// only when built with them, such as `pgm://`, are checked with `zmq_has`), a
    /// valid decoder configuration, a non-negative high-water mark, non-zero timeouts and a
    /// `max_seq_jump` of at least 1. [`Subscriber::try_spawn`] calls it for every engine.
    ///
    /// ```
    /// use kvtrie::blocks::WorkerId;
    /// use kvtrie::events::vllm::DecodeConfig;
    /// use kvtrie::events::zmq::EngineConfig;
    ///
    /// let ok = EngineConfig::new("tcp://127.0.0.1:5557", WorkerId(1), DecodeConfig::new(16));
    /// assert!(ok.validate().is_ok());
    /// let bad = EngineConfig::new("tcp://127.0.0.1:99999", WorkerId(1), DecodeConfig::new(16));
    /// assert!(bad.validate().unwrap_err().contains("port"));
    /// ```
    pub fn validate(&self) -> Result<(), String> {
        // The endpoints first: the name defaults to the PUB endpoint, whose fault it then is.
        check_endpoint(&self.pub_endpoint).map_err(|e| format!("PUB endpoint: {e}"))?;
        if let Some(r) = &self.replay_endpoint {
            check_endpoint(r).map_err(|e| format!("replay endpoint: {e}"))?;
        }
        if self.name.contains('\0') {
            return Err(format!("name {:?} contains a NUL byte", self.name));
        }
        Decoder::new(self.decode.clone()).map_err(|e| e.to_string())?;
        if self.rcvhwm < 0 {
            return Err(format!("rcvhwm {} is negative", self.rcvhwm));
        }
        if self.replay_timeout.is_zero() {
            return Err("replay_timeout is zero".into());
        }
        if self.connect_timeout.is_zero() {
            return Err("connect_timeout is zero".into());
        }
        if self.max_seq_jump == 0 {
            return Err("max_seq_jump is zero".into());
        }
        Ok(())
    }
}

/// Transports libzmq knows.
const TRANSPORTS: [&str; 11] = [
    "tcp", "ipc", "inproc", "pgm", "epgm", "tipc", "vmci", "udp", "ws", "wss", "norm",
];

/// Syntax check of a connect endpoint (libzmq's own check follows at spawn).
fn check_endpoint(ep: &str) -> Result<(), String> {
    if ep.contains('\0') {
        return Err(format!("{ep:?} contains a NUL byte"));
    }
    let Some((transport, rest)) = ep.split_once("://") else {
        return Err(format!("{ep:?} is not of the form transport://address"));
    };
    if !TRANSPORTS.contains(&transport) {
        return Err(format!("{ep:?}: unknown transport {transport:?}"));
    }
    // Known to libzmq, but never usable here: `udp` carries only RADIO/DISH sockets (the
    // subscriber's are SUB and DEALER), and `inproc` reaches only the subscriber's own
    // context, where no engine can bind.
    if matches!(transport, "udp" | "inproc") {
        return Err(format!(
            "{ep:?}: transport {transport:?} cannot reach an engine (SUB and DEALER sockets \
             in the subscriber's own context)"
        ));
    }
    if rest.is_empty() {
        return Err(format!("{ep:?}: empty address"));
    }
    // Transports that libzmq has only when built with them (`zmq_has`; `epgm` is `pgm`'s).
    let capability = match transport {
        "ipc" => Some("ipc"),
        "pgm" | "epgm" => Some("pgm"),
        "tipc" => Some("tipc"),
        "norm" => Some("norm"),
        "vmci" => Some("vmci"),
        "ws" => Some("WS"),
        "wss" => Some("WSS"),
        _ => None,
    };
    if let Some(c) = capability {
        if zmq::has(c) != Some(true) {
            return Err(format!(
                "{ep:?}: this build's libzmq has no {transport:?} transport"
            ));
        }
    }
    if matches!(transport, "tcp" | "ws" | "wss") {
        // `tcp://[source;]host:port`, `ws://host:port/path`
        let dst = rest.rsplit(';').next().unwrap_or(rest);
        let hostport = match transport {
            "ws" | "wss" => dst.split('/').next().unwrap_or(dst),
            _ => dst,
        };
        let Some((host, port)) = hostport.rsplit_once(':') else {
            return Err(format!("{ep:?}: no port"));
        };
        if host.is_empty() {
            return Err(format!("{ep:?}: no host"));
        }
        if host == "*" {
            // vLLM's own default (`tcp://*:5557`) is the address it binds.
            return Err(format!(
                "{ep:?}: host \"*\" is where an engine binds; connect to its address"
            ));
        }
        if host.starts_with('[') != host.ends_with(']') {
            return Err(format!("{ep:?}: unbalanced brackets around the host"));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return Err(format!("{ep:?}: port {port:?} is not in 1..=65535")),
        }
    }
    Ok(())
}

/// Why [`Subscriber::try_spawn`] started nothing.
#[derive(Debug)]
#[non_exhaustive]
pub enum SpawnError {
    /// Engine `engine` (its index in the list) has an invalid configuration.
    InvalidConfig {
        /// Index of the engine in the list given to `try_spawn`.
        engine: usize,
        /// [`EngineConfig::name`].
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The operating system refused a thread (the threads already started were stopped).
    Thread(std::io::Error),
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpawnError::InvalidConfig {
                engine,
                name,
                reason,
            } => write!(f, "engine {engine} ({name:?}): {reason}"),
            SpawnError::Thread(e) => write!(f, "cannot start a subscriber thread: {e}"),
        }
    }
}

impl std::error::Error for SpawnError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SpawnError::Thread(e) => Some(e),
            SpawnError::InvalidConfig { .. } => None,
        }
    }
}

/// Counters of one engine's subscription (see [`Subscriber::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// [`EngineConfig::name`].
    pub name: String,
    /// Batches decoded and applied (live, replayed and caught up).
    pub batches: u64,
    /// Events applied successfully.
    pub events: u64,
    /// Events the decoder skipped: KV-cache groups of kinds not indexed (sliding window,
    /// Mamba, ...), unknown event types, copies not local to the engine or in a shared pool
    /// ([`crate::events::vllm::DecodedBatch::skipped_remote`]), the stores counted in
    /// [`skipped_block_sizes`](Self::skipped_block_sizes) and the events counted in
    /// [`malformed_events`](Self::malformed_events).
    pub skipped_events: u64,
    /// `BlockStored` events skipped because their block size does not split into the
    /// router's blocks ([`crate::events::vllm::DecodedBatch::skipped_block_sizes`]): a few
    /// next to indexed stores are an engine's other block sizes; every store counted here
    /// means the router's block size does not fit the engine's.
    pub skipped_block_sizes: u64,
    /// Events the decoder dropped as malformed
    /// ([`crate::events::vllm::DecodedBatch::skipped_malformed`]; also in
    /// [`skipped_events`](Self::skipped_events)): the rest of their batches applied.
    pub malformed_events: u64,
    /// Sequence gaps detected between two live batches.
    pub gaps: u64,
    /// Batches recovered from the replay endpoint to fill gaps (and, after a reconnection,
    /// those the engine published while the connection was down).
    pub replayed: u64,
    /// Batches before the first live one recovered by the initial replay.
    pub caught_up: u64,
    /// Batches of gaps that could not be recovered (no replay endpoint, no longer buffered,
    /// or the replay failed), and batches a restarted engine published before the first one
    /// received from it that were not caught up.
    pub lost: u64,
    /// Malformed messages and payloads that failed to decode.
    pub decode_errors: u64,
    /// Events the index rejected ([`crate::blocks::EventError`], e.g. an unknown parent).
    pub apply_errors: u64,
    /// Engine restarts recognized (a `seq` going backwards, or a replayed batch that differs
    /// from the one applied; see the module docs): each dropped the engine's blocks once.
    pub restarts: u64,
    /// Batches dropped because their `seq` jumped more than
    /// [`EngineConfig::max_seq_jump`] ahead and the stream did not continue from them.
    pub implausible_seqs: u64,
    /// Whether the SUB socket is connected to the publisher (socket monitor).
    pub connected: bool,
    /// Times the SUB socket lost its connection (socket monitor).
    pub disconnects: u64,
    /// Connection attempts libzmq retried (socket monitor).
    pub connect_retries: u64,
    /// Times the SUB socket stayed unconnected for [`EngineConfig::connect_timeout`].
    pub connect_timeouts: u64,
    /// Replays that failed (timeout, socket error, malformed answer).
    pub replay_failures: u64,
    /// Sockets re-created after an error.
    pub reconnects: u64,
    /// `seq` of the last batch consumed (applied, or failed to decode), if any.
    pub last_seq: Option<u64>,
    /// The last socket or replay error, for diagnosis.
    pub last_error: Option<String>,
}

/// Background subscription of a [`BlockIndex`] to vLLM engines; see the [module docs](self).
///
/// Stops and joins its threads on [`Subscriber::stop`] or when dropped.
pub struct Subscriber {
    stop: Arc<AtomicBool>,
    stats: Vec<Arc<Mutex<EngineStats>>>,
    threads: Vec<JoinHandle<()>>,
    // Dropped after the threads are joined (they own its sockets).
    _ctx: zmq::Context,
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("engines", &self.stats.len())
            .field("stopped", &self.stop.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Subscriber {
    /// Checks every engine's configuration ([`EngineConfig::validate`], then a trial
    /// `connect` of each endpoint on a throwaway socket, so whatever libzmq rejects is caught
    /// here) and starts one background thread per engine, feeding `index`. On error nothing
    /// keeps running: no thread is left behind and no socket stays open.
    ///
    /// An endpoint where nothing listens (yet) is not an error: the thread keeps connecting
    /// in the background and reports it ([`EngineStats::connected`],
    /// [`EngineStats::connect_timeouts`], [`EngineStats::last_error`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvtrie::blocks::{BlockIndex, WorkerId};
    /// use kvtrie::events::vllm::DecodeConfig;
    /// use kvtrie::events::zmq::{EngineConfig, SpawnError, Subscriber};
    ///
    /// let index = Arc::new(BlockIndex::new());
    /// let bad = EngineConfig::new("tcp://127.0.0.1:99999", WorkerId(1), DecodeConfig::new(16));
    /// match Subscriber::try_spawn(index, vec![bad]) {
    ///     Err(SpawnError::InvalidConfig { engine: 0, .. }) => {}
    ///     other => panic!("{other:?}"),
    /// }
    /// ```
    pub fn try_spawn(
        index: Arc<BlockIndex>,
        engines: Vec<EngineConfig>,
    ) -> Result<Subscriber, SpawnError> {
        let ctx = zmq::Context::new();
        for (i, cfg) in engines.iter().enumerate() {
            let invalid = |reason: String| SpawnError::InvalidConfig {
                engine: i,
                name: cfg.name.clone(),
                reason,
            };
            cfg.validate().map_err(invalid)?;
            for ep in core::iter::once(&cfg.pub_endpoint).chain(&cfg.replay_endpoint) {
                trial_connect(&ctx, ep).map_err(|e| invalid(format!("{ep:?}: {e}")))?;
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut sub = Subscriber {
            stop: Arc::clone(&stop),
            stats: Vec::with_capacity(engines.len()),
            threads: Vec::with_capacity(engines.len()),
            _ctx: ctx.clone(),
        };
        // Engines whose worker another engine may feed too keep a ledger of their own copies:
        // every engine when one maps with a callback, else two engines of one engine id of
        // which one is `Fixed` (several `PerRank` engines of one id feed a worker per rank),
        // and engines configured as sharing their worker with other subscribers' engines.
        let custom = engines
            .iter()
            .any(|c| matches!(c.mapping, WorkerMapping::Custom(_)));
        let fixed = |c: &EngineConfig| matches!(c.mapping, WorkerMapping::Fixed);
        let add = |c: &EngineConfig| matches!(c.mapping, WorkerMapping::AddRank);
        let shared: Vec<bool> = (0..engines.len())
            .map(|i| {
                let cfg = &engines[i];
                custom
                    || cfg.shared_worker
                    || engines.iter().enumerate().any(|(j, o)| {
                        j != i
                            && o.worker.engine() == cfg.worker.engine()
                            && (fixed(o) || fixed(cfg))
                            && !add(o)
                            && !add(cfg)
                    })
            })
            .collect();
        for (cfg, shared) in engines.into_iter().zip(shared) {
            let st = Arc::new(Mutex::new(EngineStats {
                name: cfg.name.clone(),
                ..EngineStats::default()
            }));
            let name = format!("kvtrie-zmq-{}", cfg.name);
            let engine_name = cfg.name.clone();
            let mut worker =
                EngineThread::new(cfg, ctx.clone(), Arc::clone(&index), Arc::clone(&stop), &st)
                    .map_err(|reason| SpawnError::InvalidConfig {
                        engine: sub.stats.len(),
                        name: engine_name,
                        reason,
                    })?;
            if shared {
                worker.ledger = Some(Ledger::default());
            }
            match thread::Builder::new()
                .name(name)
                .spawn(move || worker.run())
            {
                Ok(handle) => {
                    sub.stats.push(st);
                    sub.threads.push(handle);
                }
                // `sub` drops here: it stops and joins the threads already started.
                Err(e) => return Err(SpawnError::Thread(e)),
            }
        }
        Ok(sub)
    }

    /// [`Self::try_spawn`] for callers that treat a bad configuration as a bug.
    ///
    /// # Panics
    ///
    /// If [`Self::try_spawn`] fails (an invalid endpoint, name or decoder configuration, or
    /// no thread available); nothing is left running.
    pub fn spawn(index: Arc<BlockIndex>, engines: Vec<EngineConfig>) -> Subscriber {
        match Self::try_spawn(index, engines) {
            Ok(s) => s,
            Err(e) => panic!("kvtrie ZMQ subscriber: {e}"),
        }
    }

    /// A snapshot of every engine's counters, in the order the engines were given.
    pub fn stats(&self) -> Vec<EngineStats> {
        self.stats.iter().map(|s| lock(s).clone()).collect()
    }

    /// Stop the threads, wait for them (about [`POLL_INTERVAL`]), and return the final stats.
    pub fn stop(mut self) -> Vec<EngineStats> {
        self.shutdown();
        self.stats()
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            // a panicking thread already reported itself; nothing more to do here
            let _ = t.join();
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// libzmq's own check of a connect endpoint, on a throwaway socket closed right away.
fn trial_connect(ctx: &zmq::Context, ep: &str) -> Result<(), zmq::Error> {
    let s = ctx.socket(zmq::SUB)?;
    s.set_linger(0)?;
    s.connect(ep)
}

/// A unique `inproc` endpoint for one socket monitor.
fn monitor_endpoint() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "inproc://kvtrie-zmq-monitor-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Why a receive loop ended early.
enum Interrupt {
    /// Stop was requested.
    Stop,
    /// The socket failed (or its peer misbehaved); re-create it.
    Failed(String),
    /// The publisher restarted: re-create the socket to drop what the old epoch left queued.
    Resubscribe,
}

/// What a live batch led to.
enum Step {
    Continue,
    Stop,
    Resubscribe,
}

fn failed(e: zmq::Error) -> Interrupt {
    Interrupt::Failed(e.to_string())
}

/// The `(seq, payload)` of one message of a replay answer, as the DEALER receives it (the
/// ROUTER's identity frame removed), or `None` if it is malformed. vLLM answers
/// `["", topic, seq, payload]` and ends with `["", "", END_OF_REPLAY, ""]` since it added the
/// topic frame (its PR #45177, 2026); before, `["", seq, payload]` and `["", END_OF_REPLAY,
/// ""]`. A publisher that answered a request without the empty delimiter frame sends
/// `[topic, seq, payload]` or `[seq, payload]`. In every form the last two frames are `seq`
/// and the payload.
fn replay_answer(frames: &[Vec<u8>]) -> Option<(u64, &[u8])> {
    let (seq, payload) = match frames {
        [seq, payload] | [_, seq, payload] => (seq, payload),
        [delimiter, _topic, seq, payload] if delimiter.is_empty() => (seq, payload),
        _ => return None,
    };
    let seq = u64::from_be_bytes(<[u8; 8]>::try_from(seq.as_slice()).ok()?);
    Some((seq, payload.as_slice()))
}

/// What checking a reconnection found.
enum Verify {
    /// The publisher still holds the batch applied last, as it was.
    Same,
    /// The check could not tell (see [`REJOIN_CHECKS`]).
    Unknown,
    /// The publisher restarted.
    Restarted,
    /// Stop was requested.
    Stop,
}

/// How filling a gap ended.
enum Fill {
    /// The gap is filled (or counted as lost); `next` is its end.
    Done,
    /// Stop was requested.
    Stop,
    /// The replay showed that the publisher restarted (a new epoch).
    Restarted,
}

/// The SUB socket with its monitor.
struct Sub {
    sock: zmq::Socket,
    monitor: Option<zmq::Socket>,
    /// Whether the socket is connected, and since when its disconnected period lasts.
    connected: bool,
    since: Instant,
    /// Whether the current disconnected period was already reported.
    reported: bool,
    /// Whether the publisher may have restarted while the connection was lost.
    rejoin: Rejoin,
    /// A check for batches published while the connection was down, pending.
    tail: Option<TailCheck>,
    /// No batch received yet since the start or a restart: the initial catch-up from seq 0
    /// is due once the connection has been quiet for [`START_AFTER`] (see
    /// [`EngineThread::quiet_start`]), when no live batch has asked for it first.
    start: Option<TailCheck>,
}

/// Where the SUB socket stands after losing an established connection: the publisher may have
/// restarted meanwhile, and its new epoch may reach exactly the `seq` expected next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rejoin {
    /// No connection lost since a replay last found the batch applied last as it was.
    Steady,
    /// The connection is lost: what arrives was queued from the old connection.
    Lost,
    /// The connection is back: batches continuing the sequence are checked against the replay
    /// endpoint until a check finds the batch applied last as it was (or
    /// [`REJOIN_CHECKS`] checks could not tell).
    Back { checks: u32 },
}

/// Quiet after a reconnection (no batch received for this long) before the replay endpoint is
/// asked for the batches published while the connection was down: batches that come on the
/// new connection reveal such a gap themselves, but an engine that goes quiet sends none.
pub const TAIL_AFTER: Duration = Duration::from_millis(500);

/// Quiet after the connection, with no batch received since the start (or a restart), before
/// the initial catch-up asks the replay endpoint for everything from seq 0 (see
/// [`EngineThread::quiet_start`]): an engine that stays idle sends no batch to ask for it.
pub const START_AFTER: Duration = Duration::from_secs(2);

/// After a reconnection: when to ask the replay endpoint for the batches published while the
/// connection was down (see [`EngineThread::tail`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TailCheck {
    /// The last batch received (or the reconnection): the check is due [`TAIL_AFTER`] later.
    quiet_since: Instant,
    /// Checks that could not tell (the replay does not hold the batch applied last, or does
    /// not answer); at [`REJOIN_CHECKS`] the check is given up.
    unknown: u32,
}

/// Checks after a reconnection that cannot tell (the replay does not hold the batch applied
/// last, or does not answer) before the batches are taken as continuations unchecked.
const REJOIN_CHECKS: u32 = 3;

/// One engine's subscription, run on its own thread.
struct EngineThread {
    cfg: EngineConfig,
    ctx: zmq::Context,
    index: Arc<BlockIndex>,
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<EngineStats>>,
    decoder: Decoder,
    /// Seq of the next batch to apply; `None` before the first batch (or after a restart).
    next: Option<u64>,
    /// `(seq, xxh3 of the payload)` of the last batch consumed, to recognize a restarted
    /// publisher by its replay.
    last: Option<(u64, u64)>,
    /// Batches held back after an implausible jump (see the module docs).
    suspects: Vec<(u64, Vec<u8>)>,
    /// Whether the last replay answered the batch applied last with the same contents.
    matched: bool,
    /// A tail replay is running ([`Self::tail`]): it applies nothing unless it found the batch
    /// applied last unchanged, and it records what it applies in `tail_batches`.
    tailing: bool,
    /// `(seq, xxh3 of the payload)` of the batches the last tail replay (or quiet start)
    /// applied, until a live batch past them comes: the connection may bring them again.
    tail_batches: Vec<(u64, u64)>,
    /// A quiet start's catch-up is running ([`Self::quiet_start`]): what it applies is
    /// recorded in `tail_batches`.
    recording: bool,
    /// Workers this engine has fed (cleared on an engine restart).
    workers: Vec<WorkerId>,
    /// This engine's own copies, when its worker may be shared (see [`Ledger`]).
    ledger: Option<Ledger>,
    /// A restart was recognized and the new epoch's first batch has not come yet: the
    /// batches before it were published while this thread was subscribed, so what is not
    /// caught up is lost (unlike before the very first batch, when it was not there).
    restarted: bool,
    replay: Option<zmq::Socket>,
}

impl EngineThread {
    /// Fails only for an invalid decoder configuration (`try_spawn` checked it already).
    fn new(
        cfg: EngineConfig,
        ctx: zmq::Context,
        index: Arc<BlockIndex>,
        stop: Arc<AtomicBool>,
        stats: &Arc<Mutex<EngineStats>>,
    ) -> Result<Self, String> {
        let decoder = Decoder::new(cfg.decode.clone()).map_err(|e| e.to_string())?;
        Ok(EngineThread {
            cfg,
            ctx,
            index,
            stop,
            stats: Arc::clone(stats),
            decoder,
            next: None,
            last: None,
            suspects: Vec::new(),
            matched: false,
            tailing: false,
            tail_batches: Vec::new(),
            recording: false,
            workers: Vec::new(),
            ledger: None,
            restarted: false,
            replay: None,
        })
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Sleep `d` in slices, returning early (true) when stop is requested.
    fn sleep(&self, d: Duration) -> bool {
        let end = Instant::now().checked_add(d);
        loop {
            if self.stopped() {
                return true;
            }
            let now = Instant::now();
            let left = match end {
                Some(end) if now >= end => return false,
                Some(end) => end - now,
                None => POLL_INTERVAL,
            };
            thread::sleep(left.min(POLL_INTERVAL));
        }
    }

    fn error(&self, what: &str, e: impl fmt::Display) {
        lock(&self.stats).last_error = Some(format!("{what}: {e}"));
    }

    fn run(&mut self) {
        let mut backoff = MIN_BACKOFF;
        while !self.stopped() {
            let mut sub = match self.connect_sub() {
                Ok(s) => s,
                Err(e) => {
                    self.error("SUB socket", e);
                    lock(&self.stats).reconnects += 1;
                    if self.sleep(backoff) {
                        break;
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            };
            let end = self.recv_loop(&mut sub, &mut backoff);
            lock(&self.stats).connected = false;
            match end {
                Interrupt::Stop => break,
                Interrupt::Resubscribe => drop(sub),
                Interrupt::Failed(e) => {
                    self.error("SUB receive", e);
                    lock(&self.stats).reconnects += 1;
                    drop(sub);
                    if self.sleep(backoff) {
                        break;
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    fn connect_sub(&self) -> Result<Sub, zmq::Error> {
        let s = self.ctx.socket(zmq::SUB)?;
        s.set_linger(0)?;
        s.set_rcvtimeo(POLL_INTERVAL.as_millis() as i32)?;
        s.set_rcvhwm(self.cfg.rcvhwm)?;
        s.set_reconnect_ivl(100)?;
        s.set_reconnect_ivl_max(MAX_BACKOFF.as_millis() as i32)?;
        s.set_subscribe(self.cfg.topic.as_bytes())?;
        // The monitor must exist before `connect`, or the first events are lost. A monitor
        // that cannot be set up only costs the connection state, not the subscription.
        let monitor = (|| {
            let ep = monitor_endpoint();
            let events = [
                zmq::SocketEvent::CONNECTED,
                zmq::SocketEvent::CONNECT_RETRIED,
                zmq::SocketEvent::DISCONNECTED,
                zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
            ]
            .iter()
            .fold(0i32, |m, e| m | i32::from(e.to_raw()));
            s.monitor(&ep, events)?;
            let m = self.ctx.socket(zmq::PAIR)?;
            m.set_linger(0)?;
            m.connect(&ep)?;
            Ok::<_, zmq::Error>(m)
        })();
        let monitor = match monitor {
            Ok(m) => Some(m),
            Err(e) => {
                self.error("SUB socket monitor", e);
                None
            }
        };
        s.connect(&self.cfg.pub_endpoint)?;
        Ok(Sub {
            sock: s,
            monitor,
            connected: false,
            since: Instant::now(),
            reported: false,
            rejoin: Rejoin::Steady,
            tail: None,
            start: (self.next.is_none()
                && self.cfg.initial_replay
                && self.cfg.replay_endpoint.is_some())
            .then(|| TailCheck {
                quiet_since: Instant::now(),
                unknown: 0,
            }),
        })
    }

    /// Reads the socket monitor's pending events and reports a connection that is overdue.
    fn watch(&self, sub: &mut Sub) {
        if let Some(m) = &sub.monitor {
            // Each event is two frames: [u16 event | u32 value] (little-endian), endpoint.
            while let Ok(frames) = m.recv_multipart(zmq::DONTWAIT) {
                let Some(head) = frames.first().filter(|f| f.len() >= 6) else {
                    continue;
                };
                let event = u16::from_le_bytes([head[0], head[1]]);
                let mut st = lock(&self.stats);
                if event == zmq::SocketEvent::CONNECTED.to_raw()
                    || event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw()
                {
                    sub.connected = true;
                    st.connected = true;
                    if let Some(t) = &mut sub.start {
                        // Quiet is counted from the connection.
                        t.quiet_since = Instant::now();
                    }
                    if sub.rejoin == Rejoin::Lost {
                        sub.rejoin = Rejoin::Back { checks: 0 };
                        sub.tail = Some(TailCheck {
                            quiet_since: Instant::now(),
                            unknown: 0,
                        });
                    }
                } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                    if sub.connected {
                        st.disconnects += 1;
                        if self.cfg.replay_endpoint.is_some() {
                            sub.rejoin = Rejoin::Lost;
                        }
                    }
                    sub.connected = false;
                    sub.since = Instant::now();
                    sub.reported = false;
                    st.connected = false;
                } else if event == zmq::SocketEvent::CONNECT_RETRIED.to_raw() {
                    st.connect_retries += 1;
                }
            }
        }
        if !sub.connected && !sub.reported && sub.since.elapsed() >= self.cfg.connect_timeout {
            sub.reported = true;
            let mut st = lock(&self.stats);
            st.connect_timeouts += 1;
            st.last_error = Some(format!(
                "SUB {}: not connected after {:?} ({} connect retries so far)",
                self.cfg.pub_endpoint, self.cfg.connect_timeout, st.connect_retries
            ));
        }
    }

    fn recv_loop(&mut self, sub: &mut Sub, backoff: &mut Duration) -> Interrupt {
        loop {
            if self.stopped() {
                return Interrupt::Stop;
            }
            self.watch(sub);
            let frames = match sub.sock.recv_multipart(0) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {
                    if sub
                        .tail
                        .is_some_and(|t| t.quiet_since.elapsed() >= TAIL_AFTER)
                    {
                        match self.tail(sub) {
                            Step::Continue => {}
                            Step::Stop => return Interrupt::Stop,
                            Step::Resubscribe => return Interrupt::Resubscribe,
                        }
                    } else if sub.start.is_some_and(|t| {
                        (sub.connected || sub.monitor.is_none())
                            && t.quiet_since.elapsed() >= START_AFTER
                    }) && self.quiet_start(sub)
                    {
                        return Interrupt::Stop;
                    }
                    continue;
                }
                Err(e) => return failed(e),
            };
            *backoff = MIN_BACKOFF;
            if let Some(t) = &mut sub.tail {
                // Batches still flow (from the old connection's queue, or revealing a gap on
                // the new one): the check waits for quiet.
                t.quiet_since = Instant::now();
            }
            let seq = match frames.as_slice() {
                [_topic, seq, _payload] => match <[u8; 8]>::try_from(seq.as_slice()) {
                    Ok(b) => u64::from_be_bytes(b),
                    Err(_) => {
                        self.decode_error("seq frame is not 8 bytes");
                        continue;
                    }
                },
                _ => {
                    self.decode_error("message is not 3 frames");
                    continue;
                }
            };
            let payload = frames.into_iter().nth(2).unwrap_or_default();
            // A live batch starts the sequence itself (with the initial catch-up if due).
            sub.start = None;
            // A reconnection precedes (in libzmq's I/O thread) whatever the new connection
            // brings, so its monitor events are pending by now if this batch came after it.
            self.watch(sub);
            match self.live(seq, payload, &mut sub.rejoin) {
                Step::Continue => {}
                Step::Stop => return Interrupt::Stop,
                Step::Resubscribe => return Interrupt::Resubscribe,
            }
        }
    }

    /// Handles live batch `seq`, given where the socket stands after a lost connection.
    fn live(&mut self, seq: u64, payload: Vec<u8>, rejoin: &mut Rejoin) -> Step {
        match self.next {
            // The connection's first batches may repeat the end of a tail just replayed (they
            // were published while the replay was answered): not a restart.
            Some(n) if seq < n && self.tail_repeats(seq, &payload) => return Step::Continue,
            Some(n) if seq >= n => self.tail_batches.clear(),
            _ => {}
        }
        match self.next {
            Some(n) if seq == n => {
                self.drop_suspects();
                if let Rejoin::Back { checks } = rejoin {
                    // A publisher that restarted while the socket reconnected can reach
                    // exactly the seq expected next: ask the replay whether it still holds
                    // the batch applied last.
                    match self.verify(n) {
                        Verify::Same => *rejoin = Rejoin::Steady,
                        Verify::Unknown => {
                            *checks += 1;
                            if *checks >= REJOIN_CHECKS {
                                *rejoin = Rejoin::Steady;
                            }
                        }
                        Verify::Stop => return Step::Stop,
                        Verify::Restarted => {
                            self.restart();
                            return self.new_epoch();
                        }
                    }
                }
            }
            Some(n) if seq > n && seq - n > self.cfg.max_seq_jump => {
                // Implausible on its own: hold it back until the stream confirms it.
                let continues = self.suspects.last().is_some_and(|&(s, _)| seq == s + 1);
                if !continues {
                    self.drop_suspects();
                }
                self.suspects.push((seq, payload));
                if self.suspects.len() < RESYNC_AFTER {
                    return Step::Continue;
                }
                // Confirmed: a real jump. It is a gap up to the first held batch.
                let held = core::mem::take(&mut self.suspects);
                let first = held[0].0;
                match self.gap(n, first) {
                    Fill::Stop => return Step::Stop,
                    Fill::Restarted => return self.new_epoch(),
                    Fill::Done => self.settle(rejoin),
                }
                for (s, p) in held {
                    self.consume(s, &p, Source::Live);
                }
                return Step::Continue;
            }
            Some(n) if seq > n => {
                self.drop_suspects();
                match self.gap(n, seq) {
                    Fill::Stop => return Step::Stop,
                    Fill::Restarted => return self.new_epoch(),
                    Fill::Done => self.settle(rejoin),
                }
            }
            Some(_) => {
                // seq went backwards: the publisher restarted with an empty cache
                self.drop_suspects();
                self.restart();
                if self.cfg.replay_endpoint.is_some() {
                    return self.new_epoch();
                }
                if self.first(seq) {
                    return Step::Stop;
                }
            }
            None => {
                if self.first(seq) {
                    return Step::Stop;
                }
            }
        }
        self.consume(seq, &payload, Source::Live);
        Step::Continue
    }

    /// After a restart (already counted and applied) with a replay endpoint: the SUB socket
    /// may still hold batches of the old epoch, interleaved with the new one's, so it is
    /// re-created; the first batch it receives starts the new epoch, caught up from seq 0 by
    /// the initial replay (which also brings the batch that revealed the restart).
    fn new_epoch(&mut self) -> Step {
        self.suspects.clear();
        self.tail_batches.clear();
        Step::Resubscribe
    }

    /// Is the batch consumed last `n - 1` (so a replay from it can check the publisher)?
    fn applied_last(&self, n: u64) -> bool {
        self.last.is_some_and(|(s, _)| s.wrapping_add(1) == n)
    }

    /// A replay failed: its socket is re-created for the next one, and the failure counted.
    fn replay_failed(&mut self, what: &str, e: &str) {
        self.replay = None;
        let mut st = lock(&self.stats);
        st.replay_failures += 1;
        st.last_error = Some(format!("{what}: {e}"));
    }

    /// Is live batch `seq` one the last tail replay applied, with the same contents?
    fn tail_repeats(&self, seq: u64, payload: &[u8]) -> bool {
        self.tail_batches
            .iter()
            .any(|&(s, fp)| s == seq && fp == xxh3_64(payload))
    }

    /// After a reconnection and [`TAIL_AFTER`] without a batch: asks the replay endpoint for
    /// everything from the batch applied last on. If the publisher still holds that batch
    /// unchanged, the batches after it (published while the connection was down) are
    /// applied, asking again from where an answer that lost batches in transit stopped; a
    /// changed one is a restart. A check that cannot tell is asked again after more quiet, at
    /// most [`REJOIN_CHECKS`] times. Batches more than [`EngineConfig::max_seq_jump`] ahead
    /// are left to the live stream (an implausible answer does not move the sequence).
    fn tail(&mut self, sub: &mut Sub) -> Step {
        let Some(mut check) = sub.tail.take() else {
            return Step::Continue;
        };
        if self.cfg.replay_endpoint.is_none() || !self.next.is_some_and(|n| self.applied_last(n)) {
            return Step::Continue;
        }
        self.tail_batches.clear();
        loop {
            let before = self.next;
            let to = before
                .unwrap_or(0)
                .saturating_add(self.cfg.max_seq_jump)
                .min(END_OF_REPLAY - 1);
            self.tailing = true;
            let r = self.replay(to, Catch::Gap);
            self.tailing = false;
            match r {
                Ok(Fill::Done) if self.matched => {
                    // The same epoch, caught up: a later reconnection check has nothing to do.
                    if matches!(sub.rejoin, Rejoin::Back { .. }) {
                        sub.rejoin = Rejoin::Steady;
                    }
                    return Step::Continue;
                }
                // the replay does not hold the batch applied last
                Ok(Fill::Done) => break,
                Ok(Fill::Restarted) | Err(Interrupt::Resubscribe) => {
                    self.restart();
                    return self.new_epoch();
                }
                Ok(Fill::Stop) | Err(Interrupt::Stop) => return Step::Stop,
                Err(Interrupt::Failed(e)) => {
                    self.replay_failed("replay (after a reconnection)", &e);
                    if self.next == before {
                        break;
                    }
                    // The answer brought batches, then lost some in transit: ask again from
                    // the batch applied last (each such round moves the sequence on).
                }
            }
        }
        check.unknown += 1;
        if check.unknown < REJOIN_CHECKS {
            check.quiet_since = Instant::now();
            sub.tail = Some(check);
        }
        Step::Continue
    }

    /// Drops the batches held back after an implausible jump: the stream did not confirm it.
    fn drop_suspects(&mut self) {
        if !self.suspects.is_empty() {
            let mut st = lock(&self.stats);
            st.implausible_seqs += self.suspects.len() as u64;
            st.last_error = Some(format!(
                "dropped {} batch(es) whose seq jumped implausibly far (to {})",
                self.suspects.len(),
                self.suspects[0].0
            ));
            self.suspects.clear();
        }
    }

    /// A gap `from .. to` between live batches: fill it, or find a restart.
    fn gap(&mut self, from: u64, to: u64) -> Fill {
        let fill = self.fill(from, to, Catch::Gap);
        match fill {
            Fill::Restarted => self.restart(),
            Fill::Done => lock(&self.stats).gaps += 1,
            Fill::Stop => {}
        }
        fill
    }

    /// A gap's replay found the batch applied last as it was: a reconnection has been checked.
    fn settle(&self, rejoin: &mut Rejoin) {
        if self.matched {
            *rejoin = Rejoin::Steady;
        }
    }

    /// After a reconnection, live batch `n` continues the sequence: checks with the replay
    /// endpoint that the publisher still holds batch `n - 1` as it was applied (else it
    /// restarted). The batch is applied as a continuation unless a restart is found.
    fn verify(&mut self, n: u64) -> Verify {
        if self.cfg.replay_endpoint.is_none() || !self.applied_last(n) {
            return Verify::Unknown;
        }
        match self.replay(n, Catch::Gap) {
            Ok(Fill::Done) if self.matched => Verify::Same,
            // the replay does not hold `n - 1` (yet): a new epoch may not have got there
            Ok(Fill::Done) => Verify::Unknown,
            Ok(Fill::Restarted) => Verify::Restarted,
            Ok(Fill::Stop) | Err(Interrupt::Stop) => Verify::Stop,
            // (the replay never asks for this)
            Err(Interrupt::Resubscribe) => Verify::Restarted,
            Err(Interrupt::Failed(e)) => {
                self.replay_failed("replay (checking a reconnection)", &e);
                Verify::Unknown
            }
        }
    }

    /// No batch has come since the start (or a restart) and the connection has been quiet for
    /// [`START_AFTER`]: the initial catch-up asks the replay endpoint for everything from seq 0
    /// now, instead of at the first live batch, which an engine that stays idle never sends
    /// (the batches it published before the subscription, or the batch that revealed its
    /// restart, would wait for it). What it applies starts the sequence; a live batch that
    /// repeats one of them (published while the answer was under way) is recognized by its
    /// contents and skipped. The answer is not bounded by [`EngineConfig::max_seq_jump`] (no
    /// live batch bounds it; an engine that ran for long holds seqs far past 0). One that lost
    /// batches in transit is asked again from where it stopped. An empty answer leaves the
    /// sequence to the first live batch; one that failed before bringing a batch is asked
    /// again after more quiet, [`REJOIN_CHECKS`] times at most. Returns true if stop was
    /// requested meanwhile.
    fn quiet_start(&mut self, sub: &mut Sub) -> bool {
        let Some(mut check) = sub.start.take() else {
            return false;
        };
        if self.next.is_some() {
            return false;
        }
        let catch = if self.restarted {
            Catch::AfterRestart
        } else {
            Catch::Initial
        };
        self.next = Some(0);
        self.last = None;
        self.tail_batches.clear();
        self.recording = true;
        // Everything the publisher holds: no live batch bounds it (the buffer of an engine
        // that ran for long starts far past 0).
        let r = loop {
            let before = self.next;
            let r = self.replay(END_OF_REPLAY - 1, catch);
            let Err(Interrupt::Failed(e)) = &r else {
                break r;
            };
            self.replay_failed("replay (catching up while the engine is quiet)", e);
            if self.next == before {
                break r;
            }
            // The answer brought batches, then lost some in transit (or its end never came):
            // ask again from where it stopped. Every such round moves the sequence on.
        };
        self.recording = false;
        if self.next == Some(0) {
            // Nothing applied: the first live batch starts the sequence.
            self.next = None;
        } else {
            self.restarted = false;
        }
        match r {
            Err(Interrupt::Stop) | Ok(Fill::Stop) => return true,
            Err(Interrupt::Failed(_)) => {
                check.unknown += 1;
                if self.next.is_none() && check.unknown < REJOIN_CHECKS {
                    check.quiet_since = Instant::now();
                    sub.start = Some(check);
                }
            }
            // Without a batch to check, the answer cannot reveal a restart.
            Ok(Fill::Done) | Ok(Fill::Restarted) | Err(Interrupt::Resubscribe) => {}
        }
        false
    }

    /// The first batch (since start or a restart) is `seq`: catch up on `0 .. seq` if
    /// configured. Returns true if stop was requested meanwhile.
    fn first(&mut self, seq: u64) -> bool {
        self.next = Some(0);
        // Before the very first batch this thread was not there, so what it misses is not
        // lost; after a restart it was.
        let catch = if core::mem::take(&mut self.restarted) {
            Catch::AfterRestart
        } else {
            Catch::Initial
        };
        if seq > 0 && self.cfg.initial_replay && self.cfg.replay_endpoint.is_some() {
            // After a restart the old epoch's fingerprint means nothing.
            self.last = None;
            !matches!(self.fill(0, seq, catch), Fill::Done | Fill::Restarted)
        } else {
            if catch == Catch::AfterRestart {
                let mut st = lock(&self.stats);
                st.lost = st.lost.saturating_add(seq);
            }
            self.next = Some(seq);
            false
        }
    }

    /// The publisher restarted: its old epoch's blocks are dropped (every tier), once.
    fn restart(&mut self) {
        match &mut self.ledger {
            // Other engines' copies in the shared worker stay.
            Some(ledger) => ledger.clear(&self.index, None),
            None => {
                for &w in &self.workers {
                    self.index.clear_worker(w);
                }
            }
        }
        self.workers.clear();
        if let Ok(d) = Decoder::new(self.cfg.decode.clone()) {
            self.decoder = d;
        }
        self.next = None;
        self.last = None;
        self.restarted = true;
        lock(&self.stats).restarts += 1;
    }

    fn decode_error(&self, what: &str) {
        let mut st = lock(&self.stats);
        st.decode_errors += 1;
        st.last_error = Some(format!("decode: {what}"));
    }

    /// Decode and apply batch `seq` (which must be `self.next`), then advance.
    fn consume(&mut self, seq: u64, payload: &[u8], source: Source) {
        self.next = Some(seq.wrapping_add(1));
        self.last = Some((seq, xxh3_64(payload)));
        let batch = match self.decoder.decode(payload) {
            Ok(b) => b,
            Err(e) => {
                let mut st = lock(&self.stats);
                st.decode_errors += 1;
                st.last_error = Some(format!("decode batch {seq}: {e}"));
                st.last_seq = Some(seq);
                return;
            }
        };
        let worker = self
            .cfg
            .mapping
            .map(self.cfg.worker, batch.data_parallel_rank);
        if !self.workers.contains(&worker) {
            self.workers.push(worker);
        }
        let (mut ok, mut failed) = (0u64, 0u64);
        for ev in batch.events {
            let tier = ev.tier();
            let applied = match (&mut self.ledger, ev.event) {
                (None, event) => self.index.apply_in(worker, tier, event),
                (Some(ledger), KvEvent::Stored { parent, blocks })
                    if tier == Tier::Gpu
                        && self.index.duplicate_stores() == DuplicateStores::Reports =>
                {
                    ledger.store_reported(&self.index, worker, parent, &blocks)
                }
                (Some(ledger), KvEvent::Stored { parent, blocks }) => {
                    let r = self.index.store_blocks_in(worker, tier, parent, &blocks);
                    if r.is_ok() {
                        ledger.stored(worker, tier, &blocks);
                    }
                    r
                }
                (Some(ledger), KvEvent::Removed { mut engine_hashes }) => {
                    // Only this engine's copies: another engine's copy of a hash this one
                    // never stored (or whose store was lost) stays.
                    ledger.removed(worker, tier, &mut engine_hashes);
                    self.index.remove_blocks_in(worker, tier, &engine_hashes);
                    Ok(())
                }
                (Some(ledger), KvEvent::Cleared) => {
                    ledger.clear(&self.index, Some((worker, tier)));
                    Ok(())
                }
            };
            match applied {
                Ok(()) => ok += 1,
                Err(_) => failed += 1,
            }
        }
        let mut st = lock(&self.stats);
        st.batches += 1;
        st.events += ok;
        st.skipped_events += (batch.skipped_groups
            + batch.skipped_unknown
            + batch.skipped_block_sizes
            + batch.skipped_remote
            + batch.skipped_malformed) as u64;
        st.skipped_block_sizes += batch.skipped_block_sizes as u64;
        st.malformed_events += batch.skipped_malformed as u64;
        if let Some(m) = &batch.malformed {
            // The count says how many; this says why (the first of the batch).
            st.last_error = Some(format!("decode: batch {seq}: {m}"));
        }
        st.apply_errors += failed;
        st.last_seq = Some(seq);
        match source {
            Source::Live => {}
            Source::Replay => st.replayed += 1,
            Source::CatchUp => st.caught_up += 1,
        }
    }

    /// Fill `from .. to` (`self.next == from`) from the replay endpoint, counting what cannot
    /// be recovered as lost; afterwards `self.next == to` (unless a restart was found).
    fn fill(&mut self, from: u64, to: u64, catch: Catch) -> Fill {
        debug_assert_eq!(self.next, Some(from));
        if self.cfg.replay_endpoint.is_some() {
            let mut backoff = MIN_BACKOFF;
            let mut attempt = 0;
            while attempt < REPLAY_ATTEMPTS {
                if attempt > 0 && self.sleep(backoff) {
                    return Fill::Stop;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                let before = self.next;
                match self.replay(to, catch) {
                    Ok(Fill::Done) => break,
                    Ok(other) => return other,
                    Err(Interrupt::Stop) => return Fill::Stop,
                    // (the replay never asks for this)
                    Err(Interrupt::Resubscribe) => return Fill::Restarted,
                    Err(Interrupt::Failed(e)) => self.replay_failed("replay", &e),
                }
                if self.next == Some(to) {
                    break;
                }
                if self.next == before {
                    attempt += 1;
                } else {
                    // The answer brought batches, then failed (batches lost in transit, or
                    // its end never came): ask again for the rest, attempts counted afresh.
                    // Every such round moves `next` on, so the rounds are bounded.
                    (attempt, backoff) = (0, MIN_BACKOFF);
                }
            }
        }
        let next = self.next.unwrap_or(from);
        if next < to && catch.counts_losses() {
            let mut st = lock(&self.stats);
            st.lost = st.lost.saturating_add(to - next);
        }
        self.next = Some(to);
        Fill::Done
    }

    /// One replay request; applies answers in `self.next .. to` in order. When the last
    /// consumed batch is `self.next - 1`, the request starts there, to check that the
    /// publisher still has the same batch (else it restarted: `Ok(Fill::Restarted)`).
    fn replay(&mut self, to: u64, catch: Catch) -> Result<Fill, Interrupt> {
        self.matched = false;
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return Ok(Fill::Done);
        };
        let next = self.next.unwrap_or(0);
        let check = self
            .last
            .filter(|&(s, _)| s.wrapping_add(1) == next && catch == Catch::Gap);
        let start = check.map_or(next, |(s, _)| s);
        if self.replay.is_none() {
            let s = self.ctx.socket(zmq::DEALER).map_err(failed)?;
            s.set_linger(0).map_err(failed)?;
            // No receive limit: vLLM's ROUTER drops (silently) what does not fit the pipe, so a
            // limit would lose the middle of a long answer while this thread applies its
            // start. The answer is bounded by the publisher's replay buffer.
            s.set_rcvhwm(0).map_err(failed)?;
            s.set_rcvtimeo(POLL_INTERVAL.as_millis() as i32)
                .map_err(failed)?;
            s.set_sndtimeo(POLL_INTERVAL.as_millis() as i32)
                .map_err(failed)?;
            s.connect(&endpoint).map_err(failed)?;
            self.replay = Some(s);
        }
        let sock = self.replay.take().expect("set above");
        let result = self.replay_on(&sock, start, check, to, catch);
        if result.is_ok() {
            self.replay = Some(sock);
        }
        result
    }

    fn replay_on(
        &mut self,
        sock: &zmq::Socket,
        start: u64,
        check: Option<(u64, u64)>,
        to: u64,
        catch: Catch,
    ) -> Result<Fill, Interrupt> {
        // The empty delimiter frame makes this look like a REQ request, which is what vLLM's
        // replay ROUTER expects: [identity, "", start_seq].
        let sent = Instant::now();
        loop {
            match sock.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0) {
                Ok(()) => break,
                // no connected peer yet: keep trying until the timeout, noticing stop
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {
                    if self.stopped() {
                        return Err(Interrupt::Stop);
                    }
                    if sent.elapsed() >= self.cfg.replay_timeout {
                        return Err(Interrupt::Failed("timed out".into()));
                    }
                }
                Err(e) => return Err(failed(e)),
            }
        }
        let mut last_frame = Instant::now();
        let source = if catch == Catch::Gap {
            Source::Replay
        } else {
            Source::CatchUp
        };
        let mut restarted = false;
        // The answer has brought `next` itself: the publisher still held where we were, and
        // its buffer is contiguous, so a jump after that is a loss in transit (vLLM's ROUTER
        // drops what does not fit its send limit), not batches it no longer has.
        let mut in_order = false;
        loop {
            if self.stopped() {
                return Err(Interrupt::Stop);
            }
            let frames = match sock.recv_multipart(0) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => {
                    if last_frame.elapsed() >= self.cfg.replay_timeout {
                        return Err(Interrupt::Failed("timed out".into()));
                    }
                    continue;
                }
                Err(e) => return Err(failed(e)),
            };
            last_frame = Instant::now();
            let Some((seq, payload)) = replay_answer(&frames) else {
                return Err(Interrupt::Failed("malformed answer".into()));
            };
            if seq == END_OF_REPLAY {
                return Ok(if restarted {
                    Fill::Restarted
                } else {
                    Fill::Done
                });
            }
            if restarted {
                // drain the rest of the answer; the new epoch starts over from 0
                continue;
            }
            if let Some((cseq, fp)) = check {
                if seq == cseq {
                    if xxh3_64(payload) == fp {
                        self.matched = true;
                    } else {
                        // the publisher's batch `cseq` is not the one we applied
                        restarted = true;
                    }
                    continue;
                }
            }
            if self.tailing && !self.matched {
                // not known to continue what was applied: apply nothing
                continue;
            }
            let next = self.next.unwrap_or(start);
            if seq < next || seq >= to {
                // already applied, or the live stream will bring it
                continue;
            }
            if seq > next && in_order {
                return Err(Interrupt::Failed(format!(
                    "batches {next}..{seq} of the answer lost in transit"
                )));
            }
            if seq > next && catch.counts_losses() {
                // the replay buffer no longer holds `next .. seq`
                let mut st = lock(&self.stats);
                st.lost = st.lost.saturating_add(seq - next);
            }
            in_order = true;
            self.consume(seq, payload, source);
            if self.tailing || self.recording {
                self.tail_batches.extend(self.last);
            }
        }
    }
}

/// The copies one engine stored, by worker, tier and engine hash, kept when its worker may be
/// fed by other engines too ([`WorkerMapping::Fixed`] shared by several engines of one
/// [`Subscriber`], and [`WorkerMapping::Custom`]): a `Cleared` event or a restart of this
/// engine then removes its own copies, not every engine's blocks of the shared worker.
#[derive(Default)]
struct Ledger {
    copies: HashMap<(WorkerId, Tier, u64), u32>,
}

impl Ledger {
    fn stored(&mut self, worker: WorkerId, tier: Tier, blocks: &[StoredBlock]) {
        for b in blocks {
            *self
                .copies
                .entry((worker, tier, b.engine_hash))
                .or_insert(0) += 1;
        }
    }

    /// A GPU store under [`DuplicateStores::Reports`] on a worker other engines may feed: a
    /// block this engine's ledger holds is a report of it (nothing changes), any other is this
    /// engine's copy, stored as one more copy beside the other engines' (letting the index
    /// ignore it as a report would leave this engine's clear or restart to take away another
    /// engine's copy). The blocks to store go in runs, each chained from the block before it.
    fn store_reported(
        &mut self,
        index: &BlockIndex,
        worker: WorkerId,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), EventError> {
        // Blocks `start..i` are not held yet; a held block (or the end) closes the run.
        let mut start = 0;
        for i in 0..=blocks.len() {
            let held = blocks.get(i).is_some_and(|b| {
                self.copies
                    .contains_key(&(worker, Tier::Gpu, b.engine_hash))
            });
            if i < blocks.len() && !held {
                continue;
            }
            if start < i {
                let from = match start {
                    0 => parent,
                    _ => Some(blocks[start - 1].engine_hash),
                };
                index.store_copies(worker, from, &blocks[start..i])?;
                self.stored(worker, Tier::Gpu, &blocks[start..i]);
            }
            start = i + 1;
        }
        Ok(())
    }

    /// Takes one copy of each hash away, and keeps in `engine_hashes` only those this engine
    /// held a copy of.
    fn removed(&mut self, worker: WorkerId, tier: Tier, engine_hashes: &mut Vec<u64>) {
        engine_hashes.retain(|&h| match self.copies.entry((worker, tier, h)) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
                true
            }
            std::collections::hash_map::Entry::Vacant(_) => false,
        });
    }

    /// Removes from `index` every copy in the ledger (only `worker`'s in `tier`, if given).
    fn clear(&mut self, index: &BlockIndex, only: Option<(WorkerId, Tier)>) {
        let mut gone: HashMap<(WorkerId, Tier), Vec<u64>> = HashMap::new();
        self.copies.retain(|&(w, t, h), &mut n| {
            if only.is_some_and(|o| o != (w, t)) {
                return true;
            }
            let hashes = gone.entry((w, t)).or_default();
            hashes.extend(core::iter::repeat_n(h, n as usize));
            false
        });
        for ((w, t), hashes) in gone {
            index.remove_blocks_in(w, t, &hashes);
        }
        if only.is_none() {
            self.copies = HashMap::new();
        }
    }
}

/// What a replay fills.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Catch {
    /// A gap between live batches (checks the batch applied last, counts losses).
    Gap,
    /// The batches before the first one this thread received (nothing is lost).
    Initial,
    /// The batches of a new epoch before its first live batch (counts losses).
    AfterRestart,
}

impl Catch {
    fn counts_losses(self) -> bool {
        self != Catch::Initial
    }
}

#[derive(Clone, Copy)]
enum Source {
    Live,
    Replay,
    CatchUp,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Under full reports, an engine's ledger stores only the blocks it does not hold yet, in
    /// runs chained from the block before each (a held block between two runs), and counts
    /// each of its blocks once; another engine's stores of the same blocks are its own copies.
    #[test]
    fn reported_stores_add_only_the_engines_new_blocks_in_chained_runs() {
        let index = BlockIndex::new();
        index.set_duplicate_stores(DuplicateStores::Reports);
        let w = WorkerId(5);
        let blocks = |ids: &[u64]| -> Vec<StoredBlock> {
            ids.iter()
                .map(|&i| StoredBlock {
                    engine_hash: 100 + i,
                    local_hash: i,
                })
                .collect()
        };
        let (mut a, mut b) = (Ledger::default(), Ledger::default());
        a.store_reported(&index, w, None, &blocks(&[1, 3])).unwrap();
        // 1 and 3 held: 2 chains from 1 and 4 from 3.
        a.store_reported(&index, w, None, &blocks(&[1, 2, 3, 4]))
            .unwrap();
        assert_eq!(
            index.find_matches(&[1, 2, 3, 4]).get(w),
            2,
            "3 chained from 1"
        );
        b.store_reported(&index, w, None, &blocks(&[1, 2])).unwrap();
        assert!(a.copies.values().chain(b.copies.values()).all(|&n| n == 1));
        assert_eq!(a.copies.len(), 4);
        // a's clear takes its copies away; b's 1 and 2 stay.
        a.clear(&index, None);
        assert_eq!(index.find_matches(&[1, 2]).get(w), 2);
        assert_eq!(
            (index.block_count(w), index.stats().unknown_removes),
            (2, 0)
        );
    }

    /// Every documented form of a replay answer gives its last two frames as `(seq, payload)`;
    /// any other shape (a four-frame answer without the leading empty delimiter, a `seq`
    /// frame that is not 8 bytes, too few or too many frames) is malformed.
    #[test]
    fn replay_answers_parse_in_their_documented_forms_only() {
        let seq = 7u64.to_be_bytes().to_vec();
        let p = b"payload".to_vec();
        let f = |frames: &[&[u8]]| frames.iter().map(|x| x.to_vec()).collect::<Vec<_>>();
        for frames in [
            f(&[b"", b"topic", &seq, &p]),
            f(&[b"", b"", &seq, &p]),
            f(&[b"", &seq, &p]),
            f(&[b"topic", &seq, &p]),
            f(&[&seq, &p]),
        ] {
            assert_eq!(replay_answer(&frames), Some((7, &p[..])), "{frames:?}");
        }
        for frames in [
            f(&[b"x", b"topic", &seq, &p]),
            f(&[b"", b"topic", b"short", &p]),
            f(&[&p]),
            f(&[b"", b"", b"topic", &seq, &p]),
        ] {
            assert_eq!(replay_answer(&frames), None, "{frames:?}");
        }
    }
}
